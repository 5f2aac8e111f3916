"""Verifiable tasks generated in code, behind one interface (`Task`: problem i of a stream, its
prompt ids for a tokenizer, the reward of a completion), by name in `TASKS`.

`arithmetic`: add two integers of 1..`digits` digits. The worked solution goes column by column
from the right, `a_i+b_i+carry=sum`, then `>` and the final answer:

    prompt "47+38="   response "7+8+0=15,4+3+1=8>85"

The reward checks only the integer after the last `>` against the true sum (exact match). The
SFT data corrupts the final answer of a `noise` fraction of examples so that the supervised
policy is good but not perfect and RL has room to improve it. `countdown`: reach a target with
+ - * / over given numbers. `gsm8k`: a GSM8K-style JSONL file. `wordmath`: one-step maths word
problems for chat models.

Reward code parses text; it never evaluates model output as code, and completions are truncated
before parsing. Rewards run in worker processes (`bebop/rewards.py`), so reward functions are
module-level functions and problems plain dataclasses (picklable).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bebop.config import TaskConfig
from bebop.io import DamagedFileError


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str
    answer: int
    solution: str  # a correct worked solution (SFT target)


def make_problem(rng: np.random.Generator, digits: int) -> Problem:
    nd_a, nd_b = rng.integers(1, digits + 1, size=2)
    a = int(rng.integers(0, 10**nd_a))
    b = int(rng.integers(0, 10**nd_b))
    return Problem(prompt=f"{a}+{b}=", answer=a + b, solution=worked_solution(a, b))


def worked_solution(a: int, b: int) -> str:
    da, db = str(a)[::-1], str(b)[::-1]
    carry, steps = 0, []
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        steps.append(f"{x}+{y}+{carry}={s}")
        carry = s // 10
    return ",".join(steps) + f">{a + b}"


def corrupt_answer(rng: np.random.Generator, solution: str) -> str:
    """Replaces the final answer with a nearby wrong one (an off-by-a-digit slip)."""
    head, _, ans = solution.rpartition(">")
    wrong = int(ans) + int(rng.choice([-10, -1, 1, 10]))
    return f"{head}>{abs(wrong)}" if abs(wrong) != int(ans) else f"{head}>{int(ans) + 1}"


_ANSWER = re.compile(r">\s*([0-9]{1,32})\s*$")


def extract_answer(text: str) -> int | None:
    """The integer after the last '>' at the end of the text; None if absent or malformed."""
    m = _ANSWER.search(text[-200:])
    return int(m.group(1)) if m else None


def reward(text: str, answer: int) -> float:
    return 1.0 if extract_answer(text) == answer else 0.0


def problem_at(cfg: TaskConfig, seed: int, index: int) -> Problem:
    """Deterministic problem `index` of the stream `seed` (random access, for grain)."""
    return make_problem(np.random.default_rng([seed, index]), cfg.digits)


# ----------------------------------------------------------------------------- countdown


@dataclasses.dataclass(frozen=True)
class CountdownProblem:
    prompt: str
    numbers: tuple[int, ...]
    target: int


def make_countdown(rng: np.random.Generator, num_numbers: int) -> CountdownProblem:
    """Numbers 1..25; the target is reached by a random +,-,* combination of all of them (so a
    solution exists). Prompt: '3,7,9>24?'"""
    nums = [int(x) for x in rng.integers(1, 26, size=num_numbers)]
    value = nums[0]
    for x in nums[1:]:
        op = rng.integers(3)
        value = value + x if op == 0 else abs(value - x) if op == 1 else value * x
    prompt = ",".join(map(str, nums)) + f">{value}?"
    return CountdownProblem(prompt, tuple(nums), value)


_EXPR_MAX = 200


def evaluate_expression(text: str) -> int | None:
    """Integer value of an arithmetic expression over + - * / and parentheses, parsed by a
    recursive-descent parser (never `eval`). Division must be exact. Returns None on anything
    malformed, too long (> 200 chars), too deep, or with intermediate values beyond 10**12."""
    if len(text) > _EXPR_MAX:
        return None
    toks = re.findall(r"[0-9]+|[-+*/()]|\S", text)
    pos = 0

    def peek():
        return toks[pos] if pos < len(toks) else None

    def take():
        nonlocal pos
        pos += 1
        return toks[pos - 1]

    def check(v):
        if v is None or abs(v) > 10**12:
            raise ValueError
        return v

    def atom(depth):
        if depth > 20:
            raise ValueError
        t = take() if peek() is not None else None
        if t == "(":
            v = expr(depth + 1)
            if take() != ")":
                raise ValueError
            return v
        if t == "-":
            return -atom(depth + 1)
        if t is not None and t.isdigit() and t.isascii():
            return int(t)
        raise ValueError

    def term(depth):
        v = atom(depth)
        while peek() in ("*", "/"):
            op, r = take(), atom(depth)
            if op == "*":
                v = check(v * r)
            elif r == 0 or v % r:
                raise ValueError
            else:
                v //= r
        return v

    def expr(depth):
        v = term(depth)
        while peek() in ("+", "-"):
            op, r = take(), term(depth)
            v = check(v + r if op == "+" else v - r)
        return v

    try:
        value = expr(0)
    except (ValueError, IndexError):
        return None
    return value if pos == len(toks) else None


def countdown_reward(text: str, problem: CountdownProblem) -> float:
    """1 if the expression after the last '>' uses each given number at most once and equals
    the target."""
    expr = text.rpartition(">")[2].strip() if ">" in text else text.strip()
    if len(expr) > _EXPR_MAX:
        return 0.0
    used = [int(x) for x in re.findall(r"[0-9]+", expr)]
    pool = list(problem.numbers)
    for u in used:
        if u not in pool:
            return 0.0
        pool.remove(u)
    return 1.0 if used and evaluate_expression(expr) == problem.target else 0.0


# ----------------------------------------------------------------------------- GSM8K-style


@dataclasses.dataclass(frozen=True)
class WordProblem:
    question: str
    answer: float
    where: str = dataclasses.field(default="", compare=False)  # "file:line" of a file's record


def _jsonl_records(path):
    """(where, record) of each non-empty line of a JSONL file: "file:line" and a dict.

    UTF-8, a leading byte-order mark allowed. Records are split on newlines only (JSON strings
    may hold other Unicode line breaks), so a bad record's reported line number is the line an
    editor shows. Every problem raises `DamagedFileError` naming the file and line."""
    raw = Path(path).read_bytes()
    for i, line_bytes in enumerate(raw.split(b"\n")):
        where = f"{path}:{i + 1}"
        try:
            line = line_bytes.decode("utf-8-sig" if i == 0 else "utf-8")
        except UnicodeDecodeError as e:
            bad = line_bytes[e.start : e.start + 4]
            raise DamagedFileError(f"{where}: not UTF-8 (byte {e.start + 1}: {bad!r})") from e
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DamagedFileError(f"{where}: invalid JSON at column {e.colno}: {e.msg}") from e
        if not isinstance(rec, dict):
            raise DamagedFileError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        yield where, rec


def _text_field(rec: dict, key: str, where: str, required: bool = True) -> str | None:
    value = rec.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        got = "missing" if key not in rec else repr(value)[:80]
        raise DamagedFileError(f"{where}: {key!r} must be a non-empty string, got {got}")
    return value


def _answer_field(rec: dict, key: str, where: str) -> str:
    """A record's answer as text: a string or a number (not a bool, list, object or null)."""
    value = rec.get(key)
    ok = isinstance(value, str | int | float) and not isinstance(value, bool)
    if not ok or (isinstance(value, float) and not np.isfinite(value)):
        got = "missing" if key not in rec else repr(value)[:80]
        raise DamagedFileError(f"{where}: {key!r} must be a string or a number, got {got}")
    return str(value)


def load_gsm8k_jsonl(path) -> list[WordProblem]:
    """GSM8K-style JSONL: {"question": ..., "answer": "... #### 42"} (or a bare number); the
    question a non-empty string. See `_jsonl_records` for the file format and errors."""
    out = []
    for where, rec in _jsonl_records(path):
        question = _text_field(rec, "question", where)
        answer = _answer_field(rec, "answer", where)
        ans = extract_number(answer.rpartition("####")[2])
        if ans is None:
            raise DamagedFileError(f"{where}: no numeric final answer in {rec['answer']!r}")
        out.append(WordProblem(question, ans, where))
    if not out:
        raise DamagedFileError(f"{path}: no problems (empty file)")
    return out


_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def extract_number(text: str) -> float | None:
    """The final numeric answer of a completion: after '####' if present, else inside the last
    \\boxed{...}, else the last number in the text. ASCII digits only; commas are thousands
    separators; at most 40 characters per number."""
    text = text[-2000:]
    if "####" in text:
        text = text.rpartition("####")[2]
    elif "\\boxed{" in text:
        text = text.rpartition("\\boxed{")[2].partition("}")[0]
    nums = [m.group(0) for m in _NUMBER.finditer(text) if len(m.group(0)) <= 40]
    if not nums:
        return None
    try:
        return float(nums[-1].replace(",", ""))
    except ValueError:
        return None


def gsm8k_reward(text: str, problem: WordProblem) -> float:
    got = extract_number(text)
    return 1.0 if got is not None and abs(got - problem.answer) < 1e-6 else 0.0


# ----------------------------------------------------------------------------- word problems

# Also used by `prompts.mixed_prompt`.
NAMES = ["Ava", "Liam", "Maya", "Noah", "Zoe", "Omar", "Lena", "Ravi"]
ITEMS = ["apples", "marbles", "stickers", "books", "cookies", "pencils"]


def make_word_problem(rng: np.random.Generator, digits: int) -> WordProblem:
    """A one-step maths word problem with its numeric answer (for chat models)."""
    name = NAMES[rng.integers(len(NAMES))]
    item = ITEMS[rng.integers(len(ITEMS))]
    a, b = int(rng.integers(2, 10**digits)), int(rng.integers(2, 10 ** max(1, digits - 1)))
    kind = rng.integers(3)
    if kind == 0:
        return WordProblem(f"{name} has {a} {item} and buys {b} more. How many {item} now?", a + b)
    if kind == 1:
        a += b
        return WordProblem(f"{name} had {a} {item} and gave away {b}. How many are left?", a - b)
    return WordProblem(f"A box holds {a} {item}. How many {item} are in {b} boxes?", a * b)


# ----------------------------------------------------------------------------- tasks by name


@dataclasses.dataclass(frozen=True)
class Task:
    problem: Callable[[int, int], object]  # (seed, index) -> problem
    prompt_ids: Callable[[object, object], list[int]]  # (tokenizer, problem) -> ids
    reward: Callable[[str, object], float]  # (completion text, problem) -> reward
    # (seed, index) -> a held-out problem; None: `problem` (generated tasks hold out by stream)
    held_out: Callable[[int, int], object] | None = None

    def eval_problem(self, seed: int, index: int):
        return (self.held_out or self.problem)(seed, index)


def arithmetic_prompt_ids(tok, problem: Problem) -> list[int]:
    """Char-level demo policies see the raw prompt; chat models get it as a user message."""
    if not tok.is_chat:
        return tok.encode(problem.prompt, bos=True)
    return tok.chat([{"role": "user", "content": f"Compute {problem.prompt[:-1]}."}])


def arithmetic_reward(text: str, problem: Problem) -> float:
    return reward(text, problem.answer)


def arithmetic(cfg: TaskConfig) -> Task:
    return Task(lambda seed, i: problem_at(cfg, seed, i), arithmetic_prompt_ids, arithmetic_reward)


def countdown_prompt_ids(tok, p: CountdownProblem) -> list[int]:
    if not tok.is_chat:
        return tok.encode(p.prompt, bos=True)
    nums = ", ".join(map(str, p.numbers))
    msg = (
        f"Using the numbers {nums} (each at most once) and + - * /, write an expression "
        f"equal to {p.target}. End with '>' followed by the expression."
    )
    return tok.chat([{"role": "user", "content": msg}])


def countdown(cfg: TaskConfig) -> Task:
    return Task(
        lambda seed, i: make_countdown(np.random.default_rng([seed, i]), cfg.digits + 1),
        countdown_prompt_ids,
        countdown_reward,
    )


def gsm8k_prompt_ids(tok, p: WordProblem) -> list[int]:
    msg = f"{p.question}\nSolve step by step and end with '#### <number>'."
    return tok.chat([{"role": "user", "content": msg}])


def gsm8k(cfg: TaskConfig) -> Task:
    """A GSM8K-style file split once into `task.eval_size` held-out problems (a fixed seeded
    choice: the same for every run on the file) and the rest; a stream draws the rest in a fresh
    seeded order every epoch (each problem once per epoch), evaluation the held-out ones."""
    return _file_task(cfg, load_gsm8k_jsonl(cfg.path), gsm8k_prompt_ids, gsm8k_reward)


def _file_task(cfg: TaskConfig, probs: list, prompt_ids, reward_fn) -> Task:
    """The problems of a file as a task: held-out split and epoch order as `gsm8k`'s."""
    if len(probs) <= cfg.eval_size:
        raise ValueError(
            f"task.path={cfg.path}: {len(probs)} problems, need more than task.eval_size="
            f"{cfg.eval_size} (the held-out evaluation split)"
        )
    split = np.random.default_rng(0).permutation(len(probs))
    held, train = split[: cfg.eval_size], split[cfg.eval_size :]

    @functools.lru_cache(maxsize=8)
    def epoch_order(seed: int, epoch: int) -> np.ndarray:
        return train[np.random.default_rng([seed, epoch]).permutation(len(train))]

    def problem(seed: int, i: int) -> WordProblem:
        epoch, j = divmod(i, len(train))
        return probs[epoch_order(seed, epoch)[j]]

    def held_out(seed: int, i: int) -> WordProblem:
        del seed  # one fixed evaluation set
        return probs[held[i % len(held)]]

    return Task(problem, prompt_ids, reward_fn, held_out)


def wordmath_prompt_ids(tok, p: WordProblem) -> list[int]:
    msg = f"{p.question}\nAnswer with the final number after '####'."
    return tok.chat([{"role": "user", "content": msg}])


def wordmath(cfg: TaskConfig) -> Task:
    return Task(
        lambda seed, i: make_word_problem(np.random.default_rng([seed, i]), cfg.digits),
        wordmath_prompt_ids,
        gsm8k_reward,
    )


# ----------------------------------------------------------------------------- your own task


@dataclasses.dataclass(frozen=True)
class JsonlProblem:
    """One line of a `task.name=jsonl` file: the prompt (a user message), the reference answer as
    text, an optional system message, the line's JSON text (what a `task.reward` function gets,
    parsed) and where it is ("file:line")."""

    prompt: str
    answer: str
    system: str | None
    record: str
    where: str = dataclasses.field(default="", compare=False)


def load_jsonl_task(path) -> list[JsonlProblem]:
    """A JSONL file of {"prompt": str, "answer": str | number[, "system": str], ...}; other
    fields are kept for the reward function. Errors name the file and line."""
    out = []
    for where, rec in _jsonl_records(path):
        prompt = _text_field(rec, "prompt", where)
        answer = _answer_field(rec, "answer", where)
        system = _text_field(rec, "system", where, required=False)
        out.append(JsonlProblem(prompt, answer, system, json.dumps(rec), where))
    if not out:
        raise DamagedFileError(f"{path}: no problems (empty file)")
    return out


def final_answer(text: str) -> str:
    """A completion's final answer: the text after the last '####' if present, else its last
    non-empty line, stripped."""
    text = text[-2000:]
    if "####" in text:
        return text.rpartition("####")[2].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def jsonl_exact_match(text: str, problem: JsonlProblem) -> float:
    """The default `jsonl` reward: 1 if the final answer (`final_answer`) equals the record's
    answer -- as numbers when both are numbers (commas as thousands separators), else as text."""
    got, want = final_answer(text), problem.answer.strip()
    a, b = extract_number(got), extract_number(want)
    full = _NUMBER.fullmatch
    if a is not None and b is not None and full(got.replace(" ", "")) and full(want):
        return 1.0 if abs(a - b) < 1e-9 * max(1.0, abs(b)) else 0.0
    return 1.0 if got == want else 0.0


def load_reward(spec: str):
    """The function named by `task.reward` ("package.module:function"), or a `ConfigError`
    naming the key: the module does not import, has no such attribute, or it is not callable."""
    from bebop.config import ConfigError

    mod_name, _, fn_name = spec.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module's
        raise ConfigError(
            f"config key 'task.reward': cannot import {mod_name!r} ({type(e).__name__}: {e}); "
            "the module must be importable from the working directory (or PYTHONPATH)"
        ) from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"config key 'task.reward': {mod_name} has no function {fn_name!r}")
    return fn


@dataclasses.dataclass(frozen=True)
class UserReward:
    """`task.reward`: `function(completion, record)` with the record as a fresh dict. Picklable
    by name, so it runs in the reward worker processes (which import the module themselves)."""

    spec: str

    def __call__(self, text: str, problem: JsonlProblem):
        return load_reward(self.spec)(text, json.loads(problem.record))


def jsonl_prompt_ids(tok, p: JsonlProblem) -> list[int]:
    """A chat model gets the optional system message and the prompt as a user message; a
    character-level policy the raw prompt."""
    if not tok.is_chat:
        try:
            return tok.encode(p.prompt, bos=True)
        except ValueError as e:
            raise DamagedFileError(f"{p.where}: {e} (the policy is character-level)") from e
    system = [{"role": "system", "content": p.system}] if p.system else []
    return tok.chat([*system, {"role": "user", "content": p.prompt}])


def jsonl(cfg: TaskConfig) -> Task:
    """Your own task (`task.name=jsonl`): the problems of `task.path`, split and ordered as
    `gsm8k`'s, scored by `task.reward` (default `jsonl_exact_match`). The reward runs like the
    built-in ones: in worker processes, under `rl.reward_timeout_s`, its value checked."""
    reward_fn = jsonl_exact_match
    if cfg.reward:
        load_reward(cfg.reward)  # fails now, naming the key, not in a worker
        reward_fn = UserReward(cfg.reward)
    return _file_task(cfg, load_jsonl_task(cfg.path), jsonl_prompt_ids, reward_fn)


TASKS = {
    "arithmetic": arithmetic,
    "countdown": countdown,
    "gsm8k": gsm8k,
    "wordmath": wordmath,
    "jsonl": jsonl,
}

# A prompt longer than this many tokens is a damaged record, not a problem: with the new tokens
# its KV cache would not fit any supported model's positions (32,768 to 131,072) or memory.
MAX_PROMPT_TOKENS = 16384


class PromptTooLongError(DamagedFileError):
    """A task prompt exceeds `MAX_PROMPT_TOKENS` (or, `prompts.PromptDoesNotFitError`, the run's
    positions or KV cache bound); the message names the record."""


def record_name(problem) -> str:
    """How an error names a problem: "file:line" of a file's record, else the problem itself."""
    return getattr(problem, "where", "") or f"the problem {str(problem)[:80]!r}"


def checked(task: Task, limits=None) -> Task:
    """`task` whose `prompt_ids` checks each prompt before any sampler allocates a cache for it:
    against `MAX_PROMPT_TOKENS`, and with `limits` (`prompts.PromptLimits`: `limits.check(n,
    where)`) against the policy's positions and the run's samplers' KV caches."""
    prompt_ids = task.prompt_ids

    def ids(tok, problem) -> list[int]:
        out = prompt_ids(tok, problem)
        if len(out) > MAX_PROMPT_TOKENS:
            raise PromptTooLongError(
                f"{record_name(problem)}: the prompt is {len(out)} tokens, more than the "
                f"supported {MAX_PROMPT_TOKENS} (with the new tokens it would not fit the model's "
                "positions or the KV cache)"
            )
        if limits is not None:
            limits.check(len(out), record_name(problem))
        return out

    return dataclasses.replace(task, prompt_ids=ids)


def make_task(cfg: TaskConfig, limits=None) -> Task:
    """The task `cfg` names; its prompts are checked (`checked`: against `MAX_PROMPT_TOKENS`,
    and with `limits` against the policy and the run's samplers) before any sampler allocates a
    cache for them."""
    return checked(TASKS[cfg.name](cfg), limits)
