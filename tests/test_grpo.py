"""GRPO math: group advantages, the clipped importance-weighted objective (on-policy ratio
exactly one, truncated samplers included), the KL term to the reference policy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bebop import sampling
from bebop.config import OptimConfig
from bebop.rl import grpo, loop
from bebop.train import TrainState, make_optimizer, make_train_step

from .helpers import perturb, random_policy

# ----------------------------------------------------------------------------- GRPO


def test_advantages_sum_to_zero_per_group():
    r = np.random.default_rng(0).random((5, 8)).astype(np.float32)
    for std_norm in (True, False):
        a = grpo.advantages(r, std_norm)
        np.testing.assert_allclose(a.sum(1), 0.0, atol=1e-5)
    np.testing.assert_allclose(grpo.advantages(r, True).std(1), 1.0, atol=1e-3)


T1 = sampling.SamplingConfig(temperature=1.0)


def _batch(tiny_cfg, pol, shift=0.0):
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, tiny_cfg.vocab_size, (4, 10)), jnp.int32)
    logp, _ = grpo.token_logprobs(*pol, tokens, T1)
    mask = jnp.zeros((4, 10)).at[:, 4:].set(1.0)
    adv = jnp.asarray([1.0, -1.0, 0.5, -0.5])
    return loop.LearnerBatch(tokens, mask, logp + shift, adv)


def test_on_policy_ratio_is_exactly_one(tiny_cfg):
    pol = random_policy(tiny_cfg, 0)
    _, m = grpo.policy_loss(*pol, _batch(tiny_cfg, pol), 0.2, 0.28, 0.0, "token", T1)
    assert float(m["ratio_mean"]) == 1.0 and float(m["ratio_max"]) == 1.0
    assert float(m["clip_frac"]) == 0.0


@pytest.mark.slow
def test_clipped_objective_has_no_gradient_outside_the_clip_range(tiny_cfg):
    pol = random_policy(tiny_cfg, 0)
    gd, params = pol

    def grad_norm(batch):
        g = jax.grad(lambda p: grpo.policy_loss(gd, p, batch, 0.2, 0.28, 0.0, "token", T1)[0])(
            params
        )
        return float(sum(jnp.abs(x).sum() for x in jax.tree.leaves(g)))

    # ratio = e^{+1} ≈ 2.7 > 1.28 with A > 0 (and e^{-1} < 0.8 with A < 0): clipped, no gradient
    hi = _batch(tiny_cfg, pol, shift=-1.0)
    hi = hi.replace(adv=jnp.abs(hi.adv))
    lo = _batch(tiny_cfg, pol, shift=+1.0)
    lo = lo.replace(adv=-jnp.abs(lo.adv))
    assert grad_norm(hi) == 0.0 and grad_norm(lo) == 0.0
    assert grad_norm(_batch(tiny_cfg, pol)) > 0.0  # inside the range it does move


def _sampled_batch(tiny_cfg, pol, scfg, adv):
    """Rollouts of the real sampler laid out as the RL stage does (behaviour log-probs aligned)."""
    prompts = [[1, 5, 6], [1, 3], [1, 4, 4, 9], [1, 8]]
    toks, lens = sampling.pad_prompts(prompts)
    out = jax.device_get(sampling.sample_jit(*pol, toks, lens, jax.random.key(0), scfg))
    b, p = toks.shape
    tokens = np.zeros((b, p + scfg.max_new_tokens), np.int32)
    mask, behaviour = np.zeros(tokens.shape, np.float32), np.zeros(tokens.shape, np.float32)
    tokens[:, :p] = toks
    for r in range(b):
        s, n = lens[r], out.lengths[r]
        tokens[r, s : s + n] = out.tokens[r, :n]
        mask[r, s : s + n] = 1.0
        behaviour[r, s : s + n] = out.logprobs[r, :n]
    return loop.LearnerBatch(tokens, mask, behaviour, np.asarray(adv))


TOP_P = sampling.SamplingConfig(top_p=0.5, max_new_tokens=8, eos_ids=(-1,))


@pytest.mark.slow
@pytest.mark.parametrize(
    "scfg",
    [TOP_P, sampling.SamplingConfig(temperature=0.7, top_k=3, max_new_tokens=8, eos_ids=(-1,))],
    ids=["top_p0.5", "t0.7_top_k3"],
)
def test_truncated_sampler_on_policy_ratio_is_one_and_negative_advantages_get_gradient(
    tiny_cfg, scfg
):
    """Behaviour log-probs from the real sampler with top-p 0.5 (or top-k 3 at T = 0.7): the
    learner's on-policy ratio is 1 (1e-4) at every token, and with every advantage −1 the policy
    gets a gradient. (The untruncated softmax gave ratio = nucleus mass < 1 and, once that is
    below 1 − clip_low, exactly zero gradient.)"""
    gd, params = random_policy(tiny_cfg, 0)
    batch = _sampled_batch(tiny_cfg, (gd, params), scfg, [-1.0] * 4)

    def loss(p):
        return grpo.policy_loss(gd, p, batch, 0.2, 0.28, 0.0, "token", scfg)

    (_, m), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    assert abs(float(m["ratio_max"]) - 1) < 1e-4 and abs(float(m["ratio_min"]) - 1) < 1e-4
    norms = [float(jnp.abs(x).max()) for x in jax.tree.leaves(g)]
    assert all(np.isfinite(norms)) and max(norms) > 1e-4
    if scfg is TOP_P:  # the old learner's untruncated log-probs: ratio = the nucleus mass
        full = grpo.untruncated(scfg)
        _, m_full = jax.jit(
            lambda p: grpo.policy_loss(gd, p, batch, 0.2, 0.28, 0.0, "token", full)
        )(params)
        assert float(m_full["ratio_min"]) < 0.99


@pytest.mark.slow
def test_kl_term_is_zero_at_the_reference_and_trains_towards_it(tiny_cfg):
    """k3 KL to the reference through the real optimizer and train step, advantages 0: exactly
    0 when the policy is the reference; with the reference elsewhere, 5 steps cut it by more
    than half."""
    gd, params = random_policy(tiny_cfg, 0)
    batch = _sampled_batch(tiny_cfg, (gd, params), TOP_P, [0.0] * 4)
    ref = jax.jit(lambda p: perturb(p, 1, 0.1))(params)
    same = jax.tree.map(jnp.copy, params)  # the state's own buffers are donated

    def loss(p, b, _, ref_params):
        return grpo.policy_loss(gd, p, b, 0.2, 0.28, 1.0, "token", TOP_P, ref_params)

    opt = make_optimizer(OptimConfig(lr=3e-2, warmup_steps=0, schedule="constant"), 5)
    step = make_train_step(loss, opt)
    state, m = step(TrainState.create(params, opt, 0), batch, same)
    assert float(m["kl"]) == 0.0 and float(m["loss"]) == 0.0
    kls = []
    for _ in range(5):
        state, m = step(state, batch, ref)
        kls.append(float(m["kl"]))
    assert kls[0] > 1e-3 and kls[-1] < 0.5 * kls[0], kls
