"""RL: GRPO math, reward parsing, the async loop's staleness bound and failure handling, MTP
strategies never touching the policy, GrowMTP growing a head, kill-and-resume."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bebop import config as config_lib
from bebop import sharding
from bebop.config import MeshConfig
from bebop.metrics import read_jsonl
from bebop.rl import grpo, rewards, tasks
from bebop.rl import stage as rl_stage

from .conftest import REPO
from .helpers import random_policy

# ----------------------------------------------------------------------------- GRPO


def test_advantages_sum_to_zero_per_group():
    r = np.random.default_rng(0).random((5, 8)).astype(np.float32)
    for std_norm in (True, False):
        a = grpo.advantages(r, std_norm)
        np.testing.assert_allclose(a.sum(1), 0.0, atol=1e-5)
    np.testing.assert_allclose(grpo.advantages(r, True).std(1), 1.0, atol=1e-3)


def _batch(tiny_cfg, pol, shift=0.0):
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, tiny_cfg.vocab_size, (4, 10)), jnp.int32)
    logp, _ = grpo.token_logprobs(*pol, tokens, 1.0)
    mask = jnp.zeros((4, 10)).at[:, 4:].set(1.0)
    adv = jnp.asarray([1.0, -1.0, 0.5, -0.5])
    return {"tokens": tokens, "mask": mask, "behaviour_logp": logp + shift, "adv": adv}


def test_on_policy_ratio_is_exactly_one(tiny_cfg):
    pol = random_policy(tiny_cfg, 0)
    _, m = grpo.policy_loss(*pol, _batch(tiny_cfg, pol), 0.2, 0.28, 0.0, "token", 1.0)
    assert float(m["ratio_mean"]) == 1.0 and float(m["ratio_max"]) == 1.0
    assert float(m["clip_frac"]) == 0.0


def test_clipped_objective_has_no_gradient_outside_the_clip_range(tiny_cfg):
    pol = random_policy(tiny_cfg, 0)
    gd, params = pol

    def grad_norm(batch):
        g = jax.grad(lambda p: grpo.policy_loss(gd, p, batch, 0.2, 0.28, 0.0, "token", 1.0)[0])(
            params
        )
        return float(sum(jnp.abs(x).sum() for x in jax.tree.leaves(g)))

    # ratio = e^{+1} ≈ 2.7 > 1.28 with A > 0 (and e^{-1} < 0.8 with A < 0): clipped, no gradient
    hi = _batch(tiny_cfg, pol, shift=-1.0)
    hi["adv"] = jnp.abs(hi["adv"])
    lo = _batch(tiny_cfg, pol, shift=+1.0)
    lo["adv"] = -jnp.abs(lo["adv"])
    assert grad_norm(hi) == 0.0 and grad_norm(lo) == 0.0
    assert grad_norm(_batch(tiny_cfg, pol)) > 0.0  # inside the range it does move


# ----------------------------------------------------------------------------- rewards

ADVERSARIAL = [
    "", ">", ">>>", ">" + "9" * 5000, "7+8+0=15>٣٥", ">{{{}}}", "import os; os.system('x')>12",
    "__import__('os')", ">1e309", ">-5", "\x00>12\x00", "<script>>12", ">12 13", "((((((((((((",
]  # fmt: skip


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


def test_failing_reward_function_fails_loudly():
    def broken(text, problem):
        raise KeyError("boom")

    with pytest.raises(rewards.RewardError, match="KeyError"):
        rewards.score(broken, ["a"], [None], timeout_s=5, retries=2)

    def slow(text, problem):
        time.sleep(2)
        return 1.0

    with pytest.raises(rewards.RewardError, match="exceeded"):
        rewards.score(slow, ["a"], [None], timeout_s=0.2, retries=0)


# ----------------------------------------------------------------------------- the RL stage


def _rl_cfg(*overrides):
    base = [
        "rl.steps=4", "rl.prompts_per_step=4", "rl.group_size=4", "rl.eval_samples=16",
        "rl.speedup_repeats=1", "ckpt.every=2", "sft.steps=60", "sft.eval_samples=8",
        "distill.num_samples=64", "mtp.steps=20", "mtp.warmup_loss_steps=10", "mtp.eval_every=20",
        "mtp.eval_prompts=8",
    ]  # fmt: skip
    return config_lib.load(str(REPO / "configs/demo.py:runlocal"), base + list(overrides))[0]


def _mesh():
    return sharding.make_mesh(MeshConfig(data=1), jax.devices()[:1])


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A run directory with sft, distill and mtp done (shared by the RL tests)."""
    from bebop import pipeline

    d = tmp_path_factory.mktemp("pre")
    cfg = _rl_cfg("stages=('sft','distill','mtp')")
    pipeline.run(cfg, d, _mesh())
    return d


def _copy_pre(pretrained, dst):
    import shutil

    for stage in ("sft", "distill", "mtp"):
        shutil.copytree(pretrained / stage, dst / stage)
    return dst


def test_staleness_bound_holds_with_a_slow_learner(pretrained, tmp_path, monkeypatch):
    real = rl_stage.make_train_step

    def slow_train_step(*a, **k):
        fn = real(*a, **k)

        def wrapped(*args):
            time.sleep(0.3)  # the worker races ahead as far as the bound allows
            return fn(*args)

        return wrapped

    monkeypatch.setattr(rl_stage, "make_train_step", slow_train_step)
    cfg = _rl_cfg("rl.max_staleness=2", "rl.steps=6")
    rl_stage.run(cfg, _copy_pre(pretrained, tmp_path), _mesh())
    recs = read_jsonl(tmp_path / "rl/metrics.jsonl")
    stale = [r["policy_version"] - 1 - r["batch_policy_version"] for r in recs]
    assert max(stale) == 2 and min(stale) >= 0  # the bound is reached and never exceeded


def test_mtp_strategies_never_touch_the_policy(pretrained, tmp_path, monkeypatch):
    """Given the same rollouts (recorded once, replayed), the policy after 3 learner steps is
    bitwise identical with MTP strategies frozen, online and growmtp, while the MTP does move."""
    recorded = {}
    real_init, real_call = rl_stage.Rollouts.__init__, rl_stage.Rollouts.__call__

    def init(self, *a, record=False, **k):
        real_init(self, *a, record=True, **k)  # hiddens + cycle lengths for growmtp replays

    def call(self, i, *a):
        if i not in recorded:
            recorded[i] = real_call(self, i, *a)
        return recorded[i]

    monkeypatch.setattr(rl_stage.Rollouts, "__init__", init)
    monkeypatch.setattr(rl_stage.Rollouts, "__call__", call)
    finals = {}
    for strategy in ("frozen", "online", "growmtp"):
        cfg = _rl_cfg(f"rl.mtp_strategy='{strategy}'", "rl.max_staleness=0", "rl.steps=3")
        d = _copy_pre(pretrained, tmp_path / strategy)
        rl_stage.run(cfg, d, _mesh())
        finals[strategy] = rl_stage.load_trained(cfg, d, _mesh())
        versions = [r["mtp_version"] for r in read_jsonl(d / "rl/metrics.jsonl")]
        assert versions[-1] == (0 if strategy == "frozen" else 3)
    for strategy in ("online", "growmtp"):
        for a, b in zip(
            jax.tree.leaves(finals["frozen"][0]), jax.tree.leaves(finals[strategy][0]), strict=True
        ):  # noqa: E501
            np.testing.assert_array_equal(a, b)
        moved = [
            float(jnp.abs(a - b).max())
            for a, b in zip(
                jax.tree.leaves(finals["frozen"][1]),
                jax.tree.leaves(finals[strategy][1]),
                strict=True,
            )
        ]  # noqa: E501
        assert max(moved) > 0


def test_growmtp_grows_a_draft_head_from_random_init(pretrained, tmp_path):
    """12 RL steps of GrowMTP (random MTP, DCA loss on verification's own hiddens): the mean
    accept length of the last 3 rollout batches beats the first 3 by > 0.1 tokens."""
    cfg = _rl_cfg("rl.mtp_strategy='growmtp'", "rl.steps=12", "rl.prompts_per_step=8",
                  "rl.mtp_optim.lr=3e-3", "rl.mtp_optim.warmup_steps=2")  # fmt: skip
    d = _copy_pre(pretrained, tmp_path)
    rl_stage.run(cfg, d, _mesh())
    acc = [r["accept_len"] for r in read_jsonl(d / "rl/metrics.jsonl")]
    assert np.mean(acc[-3:]) > np.mean(acc[:3]) + 0.1, acc


def _launch(workdir, *overrides, wait=True):
    cmd = [sys.executable, "launch.py", "--config", "configs/demo.py:runlocal",
           "--workdir", str(workdir), *[f"--config.{o}" for o in overrides]]  # fmt: skip
    if wait:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


RESUME = ["rl.steps=6", "rl.prompts_per_step=4", "rl.group_size=4", "rl.eval_samples=16",
          "rl.speedup_repeats=1", "ckpt.every=2", "rl.max_staleness=0", "ckpt.async_save=False",
          "sft.steps=60", "sft.eval_samples=8", "distill.num_samples=64", "mtp.steps=20",
          "mtp.warmup_loss_steps=10", "mtp.eval_every=20", "mtp.eval_prompts=8"]  # fmt: skip


def test_rl_kill_and_resume_continues_to_the_same_metrics(pretrained, tmp_path):
    full = _launch(_copy_pre(pretrained, tmp_path / "full"), *RESUME)
    assert full.returncode == 0, full.stderr[-6000:]
    cut = _copy_pre(pretrained, tmp_path / "cut")
    proc = _launch(cut, *RESUME, wait=False)
    deadline = time.time() + 300
    while not (cut / "rl/ckpt/2").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # no clean-up of any kind
    proc.wait()
    assert (cut / "rl/ckpt/2").exists() and not (cut / "rl/summary.json").exists()
    again = _launch(cut, *RESUME)
    assert again.returncode == 0, again.stderr[-2000:]
    a = read_jsonl(tmp_path / "full/rl/metrics.jsonl")
    b = read_jsonl(cut / "rl/metrics.jsonl")
    keys = ("loss", "reward_mean", "grad_norm", "entropy")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    assert [r["step"] for r in b] == list(range(1, 7))
    sa = json.loads((tmp_path / "full/rl/summary.json").read_text())
    sb = json.loads((cut / "rl/summary.json").read_text())
    assert sa["accuracy_after"] == sb["accuracy_after"]


def test_a_failing_reward_fails_the_run(pretrained, tmp_path, monkeypatch):
    def broken(text, problem):
        raise ValueError("reward backend down")

    real = rewards.make_task

    def make_task(cfg):
        t = real(cfg)
        return rewards.Task(t.problem, t.prompt_ids, broken)

    monkeypatch.setattr(rl_stage.rewards, "make_task", make_task)
    with pytest.raises(rewards.RewardError, match="reward backend down"):
        rl_stage.run(_rl_cfg(), _copy_pre(pretrained, tmp_path), _mesh())
