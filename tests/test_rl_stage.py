"""The RL stage on a run with sft, distill and mtp done: per-process prompt rows, the async
loop's staleness bound and step records, MTP strategies never touching the policy, GrowMTP
growing a head, kill-and-resume, failure handling, re-running RL alone."""

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

from bebop import mtp as mtp_lib
from bebop import policies, rewards, sharding, speculative, tasks
from bebop.config import MeshConfig
from bebop.metrics import read_jsonl
from bebop.rl import records
from bebop.rl import rollouts as rl_rollouts
from bebop.speculative import ACCEPTED, REJECTED
from bebop.stages import mtp as mtp_train
from bebop.stages import rl as rl_stage
from bebop.tokenizer import CharTokenizer

from . import reward_fns
from .conftest import REPO
from .rl_config import PRE
from .rl_config import rl_cfg as _rl_cfg

# ----------------------------------------------------------------------------- the RL stage


def _mesh():
    return sharding.make_mesh(MeshConfig(data=1), jax.devices()[:1])


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A run directory with sft, distill and mtp done (shared by the RL tests)."""
    from bebop.stages import pipeline

    d = tmp_path_factory.mktemp("pre")
    cfg = _rl_cfg("stages=('sft','distill','mtp')")
    pipeline.run(cfg, d, _mesh())
    return d


def _copy_pre(pretrained, dst):
    import shutil

    for stage in ("sft", "distill", "mtp"):
        shutil.copytree(pretrained / stage, dst / stage)
    return dst


class Capturing(rl_rollouts.Rollouts):
    """The real rollout source, keeping the speculative output the sampler returned for each
    batch (`captured[i]`)."""

    captured: dict = {}

    def __call__(self, i, *a):
        self._i = i
        try:
            return super().__call__(i, *a)
        finally:
            self._i = None

    def sample(self, *args):
        out = super().sample(*args)
        if getattr(self, "_i", None) is not None:  # not the speed comparison's calls
            self.captured[self._i] = out[1]
        return out


def test_rollout_prompts_of_some_rows_are_those_rows_of_the_batch():
    """A process builds the prompts of its own rows only (`Rollouts.prompts(i, rows)`): they
    are exactly those rows of the whole batch (groups of `group_size` samples per problem)."""
    cfg = _rl_cfg("rl.prompts_per_step=3", "rl.group_size=2")
    ro = rl_rollouts.Rollouts(cfg, None, None, CharTokenizer(), tasks.make_task(cfg.task))
    problems, ids = ro.prompts(5)
    assert len(ids) == 6 and ids[0] == ids[1] and ids[0] != ids[2]
    some_problems, some_ids = ro.prompts(5, [4, 1, 5])
    assert some_ids == [ids[4], ids[1], ids[5]]
    assert some_problems == [problems[4], problems[1], problems[5]]


@pytest.mark.slow
def test_staleness_bound_and_step_records(pretrained, tmp_path):
    """6 steps with max_staleness 2, a KL penalty, evaluations every 2 steps: the staleness bound
    is reached (the schedule is deterministic: batch i comes from version max(0, i - 2), whatever
    the speeds) and never exceeded; each step's logged per-position acceptance and
    accept-length histogram equal `speculative.summarize` of that step's rollout (captured from
    the real sampler); the KL is exactly 0 at step 1 (policy = reference) and never makes an
    update non-finite; lr, time split, reward spread and evaluations are logged;
    `draft_tokens.bin` holds exactly the emitted drafts of 3 rows per step."""
    captured = Capturing.captured = {}
    cfg = _rl_cfg(
        "rl.max_staleness=2",
        "rl.steps=6",
        "rl.kl_coef=0.05",
        "rl.eval_every=2",
        "rl.draft_log_rows=3",
    )
    summary = rl_stage.run(cfg, _copy_pre(pretrained, tmp_path), _mesh(), make_rollouts=Capturing)
    recs = read_jsonl(tmp_path / "rl/metrics.jsonl")
    stale = [r["policy_version"] - 1 - r["batch_policy_version"] for r in recs]
    assert max(stale) == 2 and min(stale) >= 0  # the bound is reached and never exceeded

    y = cfg.rollout.num_draft
    keys = [f"accept_rate_{k}" for k in range(1, y + 1)] + ["accept_len"]
    keys += [f"accept_hist_{m}" for m in range(1, y + 2)]
    keys += [f"analytic_alpha_{k}" for k in range(1, y + 1)]
    for r in recs:
        summ = speculative.summarize(captured[r["step"] - 1])
        assert [r[k] for k in keys] == [summ[k] for k in keys], r["step"]
    # the policy starts at the reference (the same weights: k3 KL 0 up to float rounding); the KL
    # term adds no non-finite update
    assert abs(recs[0]["kl"]) < 1e-9 and all(r["kl"] >= 0 and r["skipped"] == 0 for r in recs)
    assert all(r["lr"] == pytest.approx(cfg.rl.optim.lr) for r in recs)
    assert (np.diff([r["time"] for r in recs]) > 0).all()
    for k in ("wait_s", "train_s", "sync_s", "rollout_s", "reward_s"):
        assert all(r[k] >= 0 for r in recs), k
    assert all(0 <= r["zero_std_frac"] <= 1 and r["reward_std"] >= 0 for r in recs)
    assert [r["step"] for r in recs if "eval_accuracy" in r] == [2, 4]
    assert [s for s, _ in summary["eval_curve"]] == [0, 2, 4, 6]

    drafts = records.load_draft_tokens(tmp_path / "rl/draft_tokens.bin")
    assert sorted(set(drafts["step"])) == list(range(1, 7))
    for step in range(1, 7):
        d = drafts[drafts["step"] == step]
        rows = sorted(set(d["row"]))
        status = np.asarray(captured[step - 1].stats.status)[rows]
        assert len(rows) == 3 and len(d) == np.isin(status, [ACCEPTED, REJECTED]).sum()
        assert d["accepted"].sum() == (status == ACCEPTED).sum()


@pytest.mark.slow
def test_mtp_strategies_never_touch_the_policy(pretrained, tmp_path):
    """Given the same rollouts (recorded once, replayed), the policy after 3 learner steps is
    bitwise identical with MTP strategies frozen, online and growmtp, while the MTP does move."""
    recorded = {}

    class Replay(rl_rollouts.Rollouts):
        def __init__(self, *a, record=False, keep_hidden=False, **k):
            # hiddens + cycle lengths for growmtp replays
            super().__init__(*a, record=True, keep_hidden=True, **k)

        def __call__(self, i, *a):
            if i not in recorded:
                recorded[i] = super().__call__(i, *a)
            return recorded[i]

    finals = {}
    for strategy in ("frozen", "online", "growmtp"):
        cfg = _rl_cfg(f"rl.mtp_strategy='{strategy}'", "rl.max_staleness=0", "rl.steps=3")
        d = _copy_pre(pretrained, tmp_path / strategy)
        rl_stage.run(cfg, d, _mesh(), make_rollouts=Replay)
        finals[strategy] = policies.load_rl(cfg.mtp, d, _mesh(), cfg.model)
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


@pytest.mark.slow
def test_growmtp_grows_a_draft_head_from_random_init(pretrained, tmp_path):
    """12 RL steps of GrowMTP (random MTP, DCA loss on verification's own hiddens): the mean
    accept length of the last 3 rollout batches beats the first 3 by > 0.1 tokens."""
    cfg = _rl_cfg(
        "rl.mtp_strategy='growmtp'",
        "rl.steps=12",
        "rl.prompts_per_step=8",
        "rl.mtp_optim.lr=3e-3",
        "rl.mtp_optim.warmup_steps=2",
    )
    d = _copy_pre(pretrained, tmp_path)
    rl_stage.run(cfg, d, _mesh())
    acc = [r["accept_len"] for r in read_jsonl(d / "rl/metrics.jsonl")]
    assert np.mean(acc[-3:]) > np.mean(acc[:3]) + 0.1, acc


def _launch(workdir, *overrides, wait=True):
    cmd = [
        sys.executable,
        "launch.py",
        "--config",
        "configs/demo.py:runlocal",
        "--workdir",
        str(workdir),
        *[f"--config.{o}" for o in overrides],
    ]
    if wait:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


RESUME = [
    "rl.steps=6",
    "rl.prompts_per_step=4",
    "rl.group_size=4",
    "rl.eval_samples=16",
    "ckpt.every=2",
    "rl.max_staleness=1",
    "ckpt.async_save=False",
    *PRE,
]


@pytest.mark.slow
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
    # staleness 1: the first batch after the resume comes from the version before the
    # checkpoint, as in the uninterrupted run (the checkpoint holds those weights)
    keys = ("loss", "reward_mean", "grad_norm", "entropy", "accept_len", "batch_policy_version")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [r["staleness"] for r in b] == [0] + [1] * 5
    sa = json.loads((tmp_path / "full/rl/summary.json").read_text())
    sb = json.loads((cut / "rl/summary.json").read_text())
    same = ("accuracy_after", "reward_first", "reward_last", "accept_len", "max_staleness_seen")
    assert [sa[k] for k in same] == [sb[k] for k in same]  # the summary covers all 6 steps


@pytest.mark.slow
def test_a_failing_reward_fails_the_run(pretrained, tmp_path):
    cfg = _rl_cfg()
    t = tasks.make_task(cfg.task)
    task = tasks.Task(t.problem, t.prompt_ids, reward_fns.backend_down)
    with pytest.raises(rewards.RewardError, match="reward backend down"):
        rl_stage.run(cfg, _copy_pre(pretrained, tmp_path), _mesh(), task=task)


@pytest.mark.slow
def test_rl_without_the_mtp_stage_loads_the_trained_draft_or_names_the_missing_one(
    pretrained, tmp_path
):
    """Re-running only the RL stage drafts with the `mtp` stage's checkpoint (not a random MTP);
    with no checkpoint the error names `DIR/mtp/ckpt`; GrowMTP starts fresh unless `mtp.init_from`
    names a pre-trained head."""
    cfg = _rl_cfg("stages=('rl',)")
    mesh = _mesh()
    policy = policies.load(cfg.policy, cfg.model, pretrained, mesh)
    pol_cfg = policy.cfg
    _, got, vocab = rl_stage.load_draft_model(cfg, pretrained, policy, mesh)
    want = mtp_train.load_trained(cfg, pretrained, pol_cfg, mesh)[1]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    fresh = mtp_lib.init(pol_cfg, cfg.mtp.num_layers, cfg.seed + 100)[1]
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(fresh), strict=True)
    )
    (tmp_path / "mtp").mkdir()
    with pytest.raises(FileNotFoundError, match=r"mtp/ckpt holds no checkpoint"):
        rl_stage.load_draft_model(cfg, tmp_path, policy, mesh)
    # another run's pre-RL MTP (`mtp.init_from`) when this workdir has none
    other = _rl_cfg("stages=('rl',)", f"mtp.init_from='{pretrained / 'mtp' / 'ckpt'}'")
    _, got_other, _ = rl_stage.load_draft_model(other, tmp_path, policy, mesh)
    for a, b in zip(jax.tree.leaves(got_other), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    missing = _rl_cfg("stages=('rl',)", f"mtp.init_from='{tmp_path / 'none'}'")
    with pytest.raises(FileNotFoundError, match=r"'mtp.init_from': .*none holds no checkpoint"):
        rl_stage.load_draft_model(missing, tmp_path, policy, mesh)
    grow = _rl_cfg("stages=('rl',)", "rl.mtp_strategy='growmtp'")
    _, got_grow, _ = rl_stage.load_draft_model(grow, pretrained, policy, mesh)
    for a, b in zip(jax.tree.leaves(got_grow), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    # GrowMTP's updates from a pre-trained head (`mtp.init_from`) start from its weights
    grow_pre = _rl_cfg(
        "stages=('rl',)",
        "rl.mtp_strategy='growmtp'",
        f"mtp.init_from='{pretrained / 'mtp' / 'ckpt'}'",
    )
    _, got_grow_pre, _ = rl_stage.load_draft_model(grow_pre, tmp_path, policy, mesh)
    for a, b in zip(jax.tree.leaves(got_grow_pre), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
