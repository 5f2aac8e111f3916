"""SFT stage and the training machinery: learning, kill-and-resume, non-finite guard. (Checkpoint
fallback, divergence and the other run-safety tests are in test_runs.py, on a 4-parameter model.)"""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bebop import config as config_lib
from bebop import policies, sharding
from bebop.ckpt import Checkpointer
from bebop.config import OptimConfig
from bebop.metrics import read_jsonl
from bebop.stages import sft
from bebop.train import NonFiniteError, TrainState, check_nonfinite, make_optimizer, make_train_step

from .conftest import REPO


def _cfg(*overrides):
    base = ["sft.steps=12", "sft.log_every=2", "sft.eval_samples=8", "ckpt.every=4", "ckpt.keep=3"]
    return config_lib.load(str(REPO / "configs/demo.py:runlocal"), base + list(overrides))[0]


def _mesh():
    return sharding.make_mesh(config_lib.MeshConfig(data=1), jax.devices()[:1])


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted(tmp_path):
    cfg = _cfg()
    mesh8 = sharding.make_mesh(config_lib.MeshConfig(data=8), jax.devices())  # restored state
    full = sft.run(cfg, tmp_path / "full", mesh8)  # must land on the same devices as a fresh one
    with pytest.raises(sft.Interrupted):
        sft.run(cfg, tmp_path / "cut", mesh8, stop_at_step=6)  # last checkpoint: step 4
    resumed = sft.run(cfg, tmp_path / "cut", mesh8)
    a = read_jsonl(tmp_path / "full/sft/metrics.jsonl")
    b = read_jsonl(tmp_path / "cut/sft/metrics.jsonl")
    assert [r["step"] for r in b] == list(range(2, 13, 2))  # steps 5-6 were dropped and redone
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert full["final_loss"] == resumed["final_loss"]
    pa = policies.load(cfg.policy, cfg.model, tmp_path / "full", _mesh()).params
    pb = policies.load(cfg.policy, cfg.model, tmp_path / "cut", _mesh()).params
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        np.testing.assert_array_equal(x, y)


def test_nonfinite_updates_are_skipped_and_stop_the_run():
    params = {"w": jnp.ones(3)}
    opt = make_optimizer(OptimConfig(lr=0.1, warmup_steps=0), 10)

    def loss_fn(p, batch, rng):
        return jnp.sum(p["w"] ** 2) * batch["scale"], {}

    step = make_train_step(loss_fn, opt, donate=False)
    state = TrainState.create(params, opt, seed=0)
    state, m = step(state, {"scale": jnp.float32(1.0)})
    good = np.asarray(state.params["w"])
    assert int(m["skipped"]) == 0 and not np.allclose(good, 1.0)
    for i in range(3):
        state, m = step(state, {"scale": jnp.float32(jnp.nan)})
        assert int(m["skipped"]) == 1 and int(state.skips_in_row) == i + 1
        np.testing.assert_array_equal(state.params["w"], good)
        assert np.isfinite(np.asarray(jax.tree.leaves(state.opt_state)[1])).all()
    with pytest.raises(NonFiniteError, match="3 consecutive"):
        check_nonfinite(state, 3)
    state, _ = step(state, {"scale": jnp.float32(1.0)})
    assert int(state.skips_in_row) == 0 and int(state.skips_total) == 3


def test_checkpointer_roundtrip_keeps_meta(tmp_path):
    ck = Checkpointer(tmp_path, keep=2)
    tree = {"a": jnp.arange(4.0), "b": {"c": jnp.ones((2, 2), jnp.int32)}}
    for s in (1, 2, 3):
        ck.save(s, jax.tree.map(lambda x, s=s: x * s, tree), {"data": {"next_index": s}})
    step, restored, meta = ck.restore_latest(tree)
    ck.close()
    assert step == 3 and meta == {"data": {"next_index": 3}}
    np.testing.assert_array_equal(restored["a"], np.arange(4.0) * 3)
    assert sorted(p.name for p in Path(tmp_path).iterdir() if p.name.isdigit()) == ["2", "3"]


@pytest.mark.slow
def test_runlocal_pipeline_learns_the_task_and_trains_the_mtp(tmp_path):
    """The 'done when' command: launch.py on the runlocal config. Loss must fall and greedy task
    accuracy on 64 held-out problems must beat chance (exact-match answers in 0..198: chance
    < 1 %) by a wide margin: threshold 30 % (about 0.7 is typical: 7 binomial sd above it)."""
    proc = subprocess.run(
        [
            sys.executable,
            "launch.py",
            "--config",
            "configs/demo.py:runlocal",
            "--workdir",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = json.loads(proc.stdout.strip().splitlines()[-1])
    records = read_jsonl(tmp_path / "sft/metrics.jsonl")
    assert records[-1]["loss"] < 0.5 * records[0]["loss"]
    assert summaries["sft"]["accuracy"] > 0.3, summaries["sft"]
    assert (tmp_path / "config.json").exists()
    assert any(p.name.isdigit() for p in (tmp_path / "sft/ckpt").iterdir())
    # distill + pre-RL MTP training (e2e TV): the real speculative sampler accepts more drafts
    # on 64 held-out prompts after training than with the random initial MTP (+0.3 tokens).
    mtp = summaries["mtp"]
    assert mtp["after"]["rejection/accept_len"] > mtp["before"]["rejection/accept_len"] + 0.3
    assert summaries["distill"]["response_tokens"] > 0
