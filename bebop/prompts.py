"""Prompt sets, generated in code (no downloads at run time).

`task`: the run's task's prompts (`bebop/tasks.py`: the demo's arithmetic, `wordmath`, ... or
a GSM8K-style file), one stream per use so that distillation, evaluation and RL never share
prompts. `mixed`: real-text requests for a chat model such as SmolLM2, a third each of
instructions, maths word problems and code requests, built from templates and word lists with a
seeded generator. `blend`: task prompts with a share of mixed ones.
"""

from __future__ import annotations

import numpy as np

from bebop import tasks
from bebop.config import TaskConfig

STREAMS = {"distill": 11, "eval": 1_000_003, "rl": 23, "bench": 37}

_TOPICS = [
    "the ocean",
    "autumn leaves",
    "a lighthouse",
    "friendship",
    "the night sky",
    "a busy city",
    "mountains",
    "a small robot",
    "rain",
    "the first day of school",
]
_CONCEPTS = [
    "photosynthesis",
    "gravity",
    "how vaccines work",
    "why the sky is blue",
    "compound interest",
    "the water cycle",
    "how a bicycle stays upright",
    "what a prime number is",
    "how computers store numbers",
    "the seasons",
]
_INSTRUCTIONS = [
    "Write a short poem about {t}.",
    "Explain {c} to a ten-year-old.",
    "Give three tips for learning about {c}.",
    "Write a two-sentence story about {t}.",
    "Summarize {c} in one paragraph.",
    "List five words that describe {t}.",
]
_MATHS = [
    "{n} has {a} {i} and buys {b} more. How many {i} does {n} have now?",
    "{n} had {a} {i} and gave away {b}. How many {i} are left?",
    "A box holds {a} {i}. How many {i} are in {b} boxes?",
    "{n} shares {p} {i} equally among {b} friends. How many does each get?",
]
_CODE = [
    "Write a Python function that returns the {k} of a list of numbers.",
    "Write a Python function that checks whether a string is a {w}.",
    "Write a JavaScript function that {j}.",
    "Explain what this Python code does: `sum(x * x for x in range({a}))`",
]
_K = ["sum", "average", "largest element", "median", "product"]
_W = ["palindrome", "valid email address", "number", "title-cased sentence"]
_J = ["reverses a string", "counts the vowels in a word", "removes duplicates from an array"]


def mixed_prompt(rng: np.random.Generator) -> str:
    kind = rng.integers(3)
    pick = lambda xs: xs[rng.integers(len(xs))]  # noqa: E731
    if kind == 0:
        return pick(_INSTRUCTIONS).format(t=pick(_TOPICS), c=pick(_CONCEPTS))
    a, b = int(rng.integers(2, 50)), int(rng.integers(2, 12))
    if kind == 1:
        return pick(_MATHS).format(n=pick(tasks.NAMES), i=pick(tasks.ITEMS), a=a, b=b, p=a * b)
    return pick(_CODE).format(k=pick(_K), w=pick(_W), j=pick(_J), a=a)


def prompt_ids(
    task_cfg: TaskConfig, seed: int, tok, n: int, stream: str, kind: str = "task"
) -> list[list[int]]:
    """`n` tokenized prompts of the given kind from one stream of the run's `seed`: `task` (the
    `task` section's task, via `tasks.make_task`: arithmetic, wordmath, countdown, a GSM8K-style
    or jsonl file) or `mixed`."""
    seed = seed + STREAMS[stream]
    if kind == "task":
        task = tasks.make_task(task_cfg)
        problem = task.eval_problem if stream == "eval" else task.problem
        return [task.prompt_ids(tok, problem(seed, i)) for i in range(n)]
    if kind != "mixed":
        raise ValueError(f"unknown prompt kind {kind!r} (task | mixed)")
    rng = np.random.default_rng(seed)
    return [tok.chat([{"role": "user", "content": mixed_prompt(rng)}]) for _ in range(n)]


def blend(task_cfg: TaskConfig, seed: int, tok, n: int, stream: str, kind: str, mixed_fraction):
    """`n` prompts: `kind`'s, with a `mixed_fraction` share of mixed chat prompts interleaved at
    seeded positions (the two kinds draw from the same stream offsets; `mixed` never repeats)."""
    n_mixed = round(n * mixed_fraction) if kind == "task" else 0
    main = prompt_ids(task_cfg, seed, tok, n - n_mixed, stream, kind)
    if not n_mixed:
        return main
    mixed = prompt_ids(task_cfg, seed, tok, n_mixed, stream, "mixed")
    order = np.random.default_rng(seed + STREAMS[stream] + 1).permutation(n)
    is_mixed = np.zeros(n, bool)
    is_mixed[order[:n_mixed]] = True
    it_main, it_mixed = iter(main), iter(mixed)
    return [next(it_mixed) if m else next(it_main) for m in is_mixed]
