"""Verifiable tasks generated in code.

`arithmetic`: add two integers of 1..`digits` digits. The worked solution goes column by column
from the right, `a_i+b_i+carry=sum`, then `>` and the final answer:

    prompt "47+38="   response "7+8+0=15,4+3+1=8>85"

The reward checks only the integer after the last `>` against the true sum (exact match). The
SFT data corrupts the final answer of a `noise` fraction of examples so that the supervised
policy is good but not perfect and RL has room to improve it.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from bebop.config import TaskConfig


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
