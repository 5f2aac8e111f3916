"""Gradient accumulation over row chunks (`rl.microbatch`, `train.accumulated_value_and_grad`)
gives the whole batch's GRPO update: the same loss, metrics and new parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bebop.rl import grpo, loop
from bebop.sampling import SamplingConfig
from bebop.train import TrainState, make_train_step

from .helpers import random_policy

T1 = SamplingConfig(temperature=1.0)


def _batch(cfg, pol, rows=8, width=12):
    """Rows with very different response lengths (so chunks carry unequal token counts) and
    behaviour log-probs off the policy (ratios away from 1, some clipped)."""
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, width)), jnp.int32)
    logp, _ = grpo.token_logprobs(*pol, tokens, T1)
    mask = np.zeros((rows, width), np.float32)
    for r in range(rows):
        mask[r, 3 : 4 + (r * 5) % (width - 4)] = 1.0
    shift = rng.normal(0, 0.3, (rows, width)).astype(np.float32)
    adv = rng.normal(0, 1, rows).astype(np.float32)
    return loop.LearnerBatch(tokens, jnp.asarray(mask), logp + shift, jnp.asarray(adv))


@pytest.mark.slow
@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_accumulated_policy_step_equals_the_whole_batch_step(tiny_cfg, agg):
    gd, params = random_policy(tiny_cfg, 0)
    batch = _batch(tiny_cfg, (gd, params))
    opt = optax.sgd(1.0)  # new params = params - gradient: compares the gradients themselves

    def loss(p, b, _, ref):
        return grpo.policy_loss(gd, p, b, 0.2, 0.28, 0.0, agg, T1, ref)

    def step(chunks):
        fn = make_train_step(
            loss, opt, donate=False, microbatches=chunks, chunk_weight=grpo.chunk_weight(agg)
        )
        return fn(TrainState.create(params, opt, 0), batch, None)

    whole, m1 = step(1)
    acc, m4 = step(4)
    # the token counts per chunk differ, so an unweighted mean of chunk losses would be off
    counts = np.asarray(batch.mask).reshape(4, 2, -1).sum((1, 2))
    assert len(set(counts.tolist())) > 1
    assert abs(float(m1["loss"])) > 1e-3 and float(m1["clip_frac"]) > 0
    np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(m4["grad_norm"]), float(m1["grad_norm"]), rtol=1e-5)
    for k in ("ratio_max", "ratio_min"):
        assert float(m4[k]) == pytest.approx(float(m1[k]), rel=1e-5)  # float32 rounding
    if agg == "token":  # token means are exact (sequence: row-weighted across chunks)
        for k in ("entropy", "clip_frac", "ratio_mean"):
            np.testing.assert_allclose(float(m4[k]), float(m1[k]), rtol=1e-5, atol=1e-7)
    moved = max(
        float(jnp.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(params), strict=True)
    )
    assert moved > 1e-3  # the update is not a no-op
    for a, b in zip(jax.tree.leaves(acc.params), jax.tree.leaves(whole.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)


def test_microbatch_must_divide_the_batch():
    from bebop import config as config_lib
    from bebop.config import ConfigError

    from .conftest import REPO

    with pytest.raises(ConfigError, match="rl.microbatch"):
        config_lib.load(str(REPO / "configs/demo.py:runlocal"), ["rl.microbatch=5"])
