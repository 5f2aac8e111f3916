"""Rewards: parsing adversarial completions, exact scoring that never executes text, the gsm8k
loader and its held-out split, and the reward sandbox (loud failures, time-bounded calls)."""

import subprocess
import sys

import numpy as np
import pytest

from bebop import rewards, tasks
from bebop.config import TaskConfig

from . import reward_fns
from .conftest import REPO

# ----------------------------------------------------------------------------- rewards

ADVERSARIAL = [
    "",
    ">",
    ">>>",
    ">" + "9" * 5000,
    "7+8+0=15>٣٥",
    ">{{{}}}",
    "import os; os.system('x')>12",
    "__import__('os')",
    ">1e309",
    ">-5",
    "\x00>12\x00",
    "<script>>12",
    ">12 13",
    "((((((((((((",
]


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_reward_parsing_survives_adversarial_completions(text):
    for fn in (lambda t: tasks.reward(t, 12), tasks.extract_number, tasks.evaluate_expression):
        out = fn(text)
        assert out is None or isinstance(out, (int, float))
    cd = tasks.CountdownProblem("3,4>12?", (3, 4), 12)
    assert tasks.countdown_reward(text, cd) in (0.0, 1.0)


def test_rewards_are_exact_and_never_execute(tmp_path):
    assert tasks.reward("1+2+0=3>3", 3) == 1.0 and tasks.reward("1+2+0=3>4", 3) == 0.0
    cd = tasks.CountdownProblem("3,4,2>14?", (3, 4, 2), 14)
    assert tasks.countdown_reward(">3*4+2", cd) == 1.0
    assert tasks.countdown_reward(">3*4+2+0", cd) == 0.0  # 0 is not one of the numbers
    assert tasks.countdown_reward(">4*4-2", cd) == 0.0  # 4 used twice
    marker = tmp_path / "pwned"
    text = f">__import__('pathlib').Path('{marker}').touch()"
    assert tasks.evaluate_expression(text[1:]) is None and not marker.exists()
    assert tasks.extract_number("The answer is 1,234.5 apples") == 1234.5
    assert tasks.extract_number("\\boxed{{7}} then #### 42") == 42.0


def test_gsm8k_loader(tmp_path):
    f = tmp_path / "g.jsonl"
    f.write_text('{"question": "2+2?", "answer": "so #### 4"}\n{"question": "q", "answer": "7"}\n')
    probs = tasks.load_gsm8k_jsonl(f)
    assert [p.answer for p in probs] == [4.0, 7.0]
    assert tasks.gsm8k_reward("... #### 4", probs[0]) == 1.0
    f.write_text('{"question": "no answer"}\n')
    with pytest.raises(ValueError, match="g.jsonl:1"):
        tasks.load_gsm8k_jsonl(f)


def test_gsm8k_holds_out_an_eval_split_and_shuffles_each_epoch(tmp_path):
    """50 problems, `task.eval_size=10`: evaluation draws only the 10 held-out problems (the same
    in every run), training streams never do; each training epoch visits the other 40 exactly
    once, in an order that changes with the epoch and the stream's seed."""
    f = tmp_path / "g.jsonl"
    f.write_text("".join(f'{{"question": "q{i}", "answer": "{i}"}}\n' for i in range(50)))
    task = tasks.make_task(TaskConfig(name="gsm8k", path=str(f), eval_size=10))
    held = {task.eval_problem(7, i).answer for i in range(30)}
    assert len(held) == 10
    again = tasks.make_task(TaskConfig(name="gsm8k", path=str(f), eval_size=10))
    assert {again.eval_problem(99, i).answer for i in range(10)} == held
    epochs = [[task.problem(3, e * 40 + j).answer for j in range(40)] for e in range(3)]
    for order in epochs:
        assert len(set(order)) == 40 and not set(order) & held
    assert epochs[0] != epochs[1] != epochs[2]
    assert [task.problem(4, j).answer for j in range(40)] != epochs[0]
    with pytest.raises(ValueError, match="task.eval_size=50"):
        tasks.make_task(TaskConfig(name="gsm8k", path=str(f), eval_size=50))


def test_failing_reward_function_fails_loudly():
    with pytest.raises(rewards.RewardError, match="KeyError"):
        rewards.score(reward_fns.broken, ["a"], [None], timeout_s=5, retries=2)
    with pytest.raises(rewards.RewardError, match="rl.reward_timeout_s"):
        rewards.score(reward_fns.slow, ["a"], [None], timeout_s=0.2, retries=0)

    def local(text, problem):  # cannot be sent to a worker process
        return 1.0

    with pytest.raises(rewards.RewardError, match="module-level function"):
        rewards.score(local, ["a"], [None], timeout_s=5, retries=0)
    np.testing.assert_array_equal(  # the pool still works after all that
        rewards.score(
            tasks.arithmetic_reward, [">3", ">4"], [tasks.Problem("1+2=", 3, "")] * 2, 5, 0
        ),
        [1.0, 0.0],
    )


HANG = """
import sys, time
from bebop import rewards
from tests import reward_fns
t0 = time.monotonic()
r = rewards.score(reward_fns.hangs_on_b, ["a", "b", "c"], [None] * 3, {t}, 1, "zero")
print("zero", r.tolist(), time.monotonic() - t0, flush=True)
t0 = time.monotonic()
try:
    rewards.score(reward_fns.hangs_on_b, ["a", "b", "c"], [None] * 3, {t}, 0, "error")
finally:
    print("error after", time.monotonic() - t0, flush=True)
"""


def test_a_hanging_reward_scores_zero_or_fails_and_the_process_exits():
    """A reward that never returns, in a fresh interpreter: with `zero` it scores 0 (the others
    are kept) after the timeout and one retry in a rebuilt pool; with `error` a RewardError naming
    rl.reward_timeout_s. Each within 2 x timeout + 3 s (pool start-up), and the process exits
    (the thread pool this replaced raised, then never exited)."""
    t = 0.5
    proc = subprocess.run(
        [sys.executable, "-c", HANG.format(t=t)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = dict(ln.split(" ", 1) for ln in proc.stdout.splitlines())
    scores, took = lines["zero"].rsplit(" ", 1)
    assert scores == "[1.0, 0.0, 1.0]" and 2 * t <= float(took) < 2 * t + 3, proc.stdout
    assert t <= float(lines["error"].split()[1]) < 2 * t + 3, proc.stdout
    assert proc.returncode == 1 and "rl.reward_timeout_s=0.5" in proc.stderr, proc.stderr[-2000:]
