"""Tasks behind one interface (problem i of a stream, its prompt ids, the reward of a completion)
and reward scoring with a time bound and loud failures.

Reward code parses text; it never evaluates model output as code. Completions are truncated
(tasks.py caps lengths) and every batch of reward calls has a wall-clock bound: a reward function
that raises or exceeds `timeout_s` fails the whole group with `RewardError` (after `retries`
further attempts) instead of silently becoming a zero reward.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from bebop import prompts
from bebop.config import TaskConfig
from bebop.rl import tasks


class RewardError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class Task:
    problem: Callable[[int, int], object]  # (seed, index) -> problem
    prompt_ids: Callable[[object, object], list[int]]  # (tokenizer, problem) -> ids
    reward: Callable[[str, object], float]  # (completion text, problem) -> reward


def _arith(cfg: TaskConfig) -> Task:
    return Task(
        problem=lambda seed, i: tasks.problem_at(cfg, seed, i),
        prompt_ids=prompts.task_prompt_ids,
        reward=lambda text, p: tasks.reward(text, p.answer),
    )


def _countdown(cfg: TaskConfig) -> Task:
    def prompt_ids(tok, p):
        if hasattr(tok, "alphabet"):
            return tok.encode(p.prompt, bos=True)
        nums = ", ".join(map(str, p.numbers))
        msg = f"Using the numbers {nums} (each at most once) and + - * /, write an expression " \
              f"equal to {p.target}. End with '>' followed by the expression."  # fmt: skip
        return tok.chat([{"role": "user", "content": msg}])

    return Task(
        problem=lambda seed, i: tasks.make_countdown(
            np.random.default_rng([seed, i]), cfg.digits + 1
        ),
        prompt_ids=prompt_ids,
        reward=tasks.countdown_reward,
    )


def _gsm8k(cfg: TaskConfig) -> Task:
    probs = tasks.load_gsm8k_jsonl(cfg.path)
    if not probs:
        raise ValueError(f"task.path={cfg.path}: no problems")

    def prompt_ids(tok, p):
        msg = f"{p.question}\nSolve step by step and end with '#### <number>'."
        return tok.chat([{"role": "user", "content": msg}])

    return Task(
        lambda seed, i: probs[(seed * 7919 + i) % len(probs)], prompt_ids, tasks.gsm8k_reward
    )


def _wordmath(cfg: TaskConfig) -> Task:
    def prompt_ids(tok, p):
        msg = f"{p.question}\nAnswer with the final number after '####'."
        return tok.chat([{"role": "user", "content": msg}])

    return Task(
        lambda seed, i: tasks.make_word_problem(np.random.default_rng([seed, i]), cfg.digits),
        prompt_ids,
        tasks.gsm8k_reward,
    )


TASKS = {"arithmetic": _arith, "countdown": _countdown, "gsm8k": _gsm8k, "wordmath": _wordmath}


def make_task(cfg: TaskConfig) -> Task:
    return TASKS[cfg.name](cfg)


def score(reward_fn, texts: Sequence[str], problems: Sequence, timeout_s: float, retries: int):
    """Rewards for a batch; raises RewardError on an exception or a timeout (after retries)."""
    last = None
    for _attempt in range(retries + 1):
        pool = cf.ThreadPoolExecutor(max_workers=1)
        future = pool.submit(
            lambda: [float(reward_fn(t, p)) for t, p in zip(texts, problems, strict=True)]
        )
        try:
            return np.asarray(future.result(timeout=timeout_s), np.float32)
        except cf.TimeoutError as e:
            last = RewardError(f"reward computation exceeded {timeout_s}s for {len(texts)} texts")
            last.__cause__ = e
        except Exception as e:  # noqa: BLE001 - any reward failure fails the group loudly
            last = RewardError(f"reward function failed: {type(e).__name__}: {e}")
            last.__cause__ = e
        finally:
            pool.shutdown(wait=False)
    raise last
