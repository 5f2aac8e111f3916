"""MTP losses under the sampler's top-k / top-p: every acceptance they measure is the
verifier's, Σ_v min(p, q) between the target's and the draft's tempered, truncated
distributions; gradients stay finite; without truncation nothing changes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from bebop import model, rollout, sampling, tasks
from bebop import mtp as mtp_lib
from bebop import mtp_losses as L
from bebop.rl import learner, loop
from bebop.rl import rollouts as rl_rollouts
from bebop.tokenizer import CharTokenizer
from bebop.train import TrainState

from .rl_config import rl_cfg

Y, B, T, D, V = 3, 2, 9, 8, 37
SUB = np.array([0, 3, 4, 9, 10, 11, 20, 25, 31, 36])  # a draft vocabulary of 10 of the 37 ids
CUTS = {"top_k": {"top_k": 3}, "top_p": {"top_p": 0.5}, "both": {"top_k": 5, "top_p": 0.6}}


def _jit_init(make):
    return nnx.split(nnx.eval_shape(make))[0], jax.jit(lambda: nnx.split(make())[1])()


@pytest.mark.slow
def test_mtp_update_measures_the_acceptance_of_the_verification_under_top_k_top_p(tiny_cfg):
    """A real recorded speculative rollout with `rollout.top_k` and `rollout.top_p` both live,
    then the RL learner's own MTP update (GrowMTP's `dca`): the step-1 acceptance it measures
    over the verify cycles equals the verifier's analytic Σ min(p, q) of the same drafts
    (`analytic_alpha_1`, 1e-5). The untruncated distributions, or either truncation alone,
    give another acceptance: the truncated pair is the one measured."""
    cfg = rl_cfg(
        "rl.mtp_strategy='growmtp'",
        "rl.prompts_per_step=4",
        "rl.group_size=2",
        "rollout.top_k=8",
        "rollout.top_p=0.8",
    )
    tok = CharTokenizer()
    mcfg = dataclasses.replace(tiny_cfg, vocab_size=tok.vocab_size, init_std=0.3)
    pol_gd, pol_params = _jit_init(lambda: model.Policy(mcfg, nnx.Rngs(params=0)))
    mtp_gd, mtp_params = _jit_init(lambda: mtp_lib.MTP(mcfg, 1, nnx.Rngs(params=1)))
    record, keep_hidden = learner.rollout_records(cfg.rl)
    rollouts = rl_rollouts.Rollouts(
        cfg, pol_gd, mtp_gd, tok, tasks.make_task(cfg.task), record, keep_hidden=keep_hidden
    )
    store = loop.WeightStore(keep=3)
    store.publish(0, pol_params, mtp_params, 0)
    batch = rollouts(0, 0, pol_params, mtp_params, 0)
    verified = batch.stats["analytic_alpha_1"]
    opt = optax.sgd(0.0)
    scfg = rollout.sampling_config(cfg.rollout, tok)
    learn = learner.build(cfg, pol_gd, mtp_gd, scfg, None, opt, opt, store)

    def update(inputs):  # the learner's jitted MTP step (it donates the state: a copy)
        state = TrainState.create(loop.snapshot(mtp_params), opt, 0)
        return {k: float(v) for k, v in learn.mtp_step(state, *inputs)[1].items()}

    grow = update(learner.growmtp_update_inputs(store, batch.data, batch.policy_version))
    assert 0.02 < verified < 0.98
    assert grow["gated_alpha_1"] == pytest.approx(verified, abs=1e-5)
    assert np.isfinite(grow["loss"]) and np.isfinite(grow["grad_norm"]) and grow["grad_norm"] > 0
    # online updates (the policy recomputes its hiddens): the same acceptance
    online = update(learner.online_update_inputs(batch.data, pol_params))
    assert online["gated_alpha_1"] == pytest.approx(verified, abs=1e-4)

    mb, behaviour = learner.growmtp_update_inputs(store, batch.data, batch.policy_version)
    loss_name, steps = learner.mtp_objective(cfg.rl, cfg.mtp.train_steps, cfg.rollout.num_draft)
    for cut in ({}, {"top_k": 8}, {"top_p": 0.8}):
        fn = L.mtp_loss(pol_gd, mtp_gd, loss_name, steps, 8192, cfg.rollout.temperature, **cut)
        other = jax.jit(lambda mp, b, pp, fn=fn: fn(mp, b, None, pp)[1]["gated_alpha_1"])
        assert abs(float(other(mtp_params, mb, behaviour)) - verified) > 1e-2, cut


# ----------------------------------------------------------------------------- numpy references


def _inputs(seed=0, scale=1.5, noise=0.5):
    """Drafts near the target's hiddens (shifted by their step) plus noise: α around 0.5."""
    k = jax.random.split(jax.random.key(seed), 4)
    target = jax.random.normal(k[1], (B, T, D))
    shifted = [jnp.pad(target[:, j:], ((0, 0), (0, j), (0, 0))) for j in range(1, Y + 1)]
    draft = jnp.stack(shifted) + noise * jax.random.normal(k[0], (Y, B, T, D))
    head = scale * jax.random.normal(k[2], (D, V))
    tokens = jax.random.randint(k[3], (B, T), 0, V)
    mask = jnp.ones((B, T)).at[1, 6:].set(0.0)  # row 1 ends early: its chains are masked
    return draft, target, head, tokens, mask


def _np_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_sampled(z, top_k=0, top_p=1.0):
    """The distribution the sampler draws from, in float64 from its definition: of the tempered
    logits `z`, the `top_k` largest (0: all), renormalised; of those, the most likely tokens
    until their mass reaches `top_p` (a token is kept while the mass of the more likely ones is
    below `top_p`), renormalised."""
    z = np.asarray(z, np.float64)
    if top_k and top_k < z.shape[-1]:
        kth = np.sort(z, axis=-1)[..., -top_k][..., None]
        z = np.where(z >= kth, z, -np.inf)
    p = _np_softmax(z)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        p_sorted = np.take_along_axis(p, order, -1)
        keep = np.zeros(p.shape, bool)
        np.put_along_axis(keep, order, np.cumsum(p_sorted, -1) - p_sorted < top_p, -1)
        p = np.where(keep, p, 0.0)
        p = p / p.sum(-1, keepdims=True)
    return p


def np_parts(draft, target, head, tokens, mask, temperature=1.0, vocab=None, top_k=0, top_p=1.0):
    """float64 per-step q `[Y, B, T, K]` (the draft's, over the draft vocabulary `vocab`), p on
    the same tokens (the target's, over all V), labels, validity -- as the verifier forms them."""
    draft, target, head = (np.asarray(x, np.float64) for x in (draft, target, head))
    tokens, mask = np.asarray(tokens), np.asarray(mask)
    y = draft.shape[0]
    sub = np.arange(head.shape[1]) if vocab is None else np.asarray(vocab)
    q = np_sampled(np.einsum("ybtd,dv->ybtv", draft, head[:, sub]) / temperature, top_k, top_p)
    p_full = np_sampled(np.einsum("btd,dv->btv", target, head) / temperature, top_k, top_p)
    p = np.stack([np.pad(p_full[:, k:], ((0, 0), (0, k), (0, 0))) for k in range(1, y + 1)])
    labels = np.stack([np.pad(tokens[:, k + 1 :], ((0, 0), (0, k + 1))) for k in range(1, y + 1)])
    valid = np.stack([np.pad(mask[:, k + 1 :], ((0, 0), (0, k + 1))) for k in range(1, y + 1)])
    return q, p[..., sub], labels, valid > 0


def _np_mean(x, m):
    return np.where(m, x, 0.0).sum() / m.sum()  # (positions past the end: p = 0, KL inf)


def np_loss(name, q, p, labels, valid):
    """The losses (module doc of `bebop.mtp_losses`) from float64 distributions (positions past
    a sequence's end, where p = 0, are masked out of the means)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return _np_loss(name, q, p, labels, valid)


def _np_loss(name, q, p, labels, valid):
    alpha = np.minimum(p, q).sum(-1)
    prods = np.cumprod(alpha, 0)
    lq, lp = np.log(q), np.log(p)
    if name == "ce":
        return _np_mean(-np.take_along_axis(lq, labels[..., None], -1)[..., 0], valid)
    if name == "kl":
        return _np_mean(np.where(p > 0, p * (lp - lq), 0.0).sum(-1), valid)
    if name == "reverse_kl":
        return _np_mean((q * (lq - lp)).sum(-1), valid)
    if name == "tv":
        return _np_mean(1 - alpha, valid)
    if name == "e2e_tv":
        return _np_mean(1 - prods.mean(0), valid.all(0))
    cut = prods * np.cumprod(valid, 0)
    if name == "e2e_tv_partial":
        return _np_mean(1 - cut.mean(0), valid[0])
    if name == "dca":  # Σ = 0 (disjoint supports) clamped at 1e-9, as the loss does
        return _np_mean(-np.log(np.where(valid[0], np.maximum(cut.sum(0), 1e-9), 1.0)), valid[0])
    raise KeyError(name)


def _alpha_metrics(q, p, valid):
    alpha = np.minimum(p, q).sum(-1)
    return np.array([_np_mean(alpha[k], valid[k]) for k in range(Y)])


# ----------------------------------------------------------------------------- with truncation


@pytest.mark.parametrize("vocab", [None, SUB], ids=["full", "draft_vocab"])
@pytest.mark.parametrize("chunk", [8, 64])  # 5 chunks of the 37 tokens; all in one
@pytest.mark.parametrize("cut", list(CUTS))
def test_acceptance_is_the_verifiers_between_truncated_distributions(cut, chunk, vocab):
    """Per-step α of every loss (and the TV-type losses' values) equal the verifier's formula in
    float64 numpy: Σ_v min(p, q), p and q each tempered, top-k'd and top-p'd as the sampler
    does (q over the draft vocabulary, p over all tokens), 1e-5; and the untruncated α differs
    by > 0.01 at some step (the truncation is what is measured)."""
    args = _inputs(seed=3)
    kw = dict(vocab=vocab, chunk=chunk, temperature=0.8, **CUTS[cut])
    q, p, labels, valid = np_parts(*args, 0.8, vocab, **CUTS[cut])
    want = _alpha_metrics(q, p, valid)
    q0, p0, _, _ = np_parts(*args, 0.8, vocab)
    assert np.abs(want - _alpha_metrics(q0, p0, valid)).max() > 0.01
    for name in L.MTP_LOSSES:
        loss, metrics = L.draft_loss(name, *args, **kw)
        got = np.array([float(metrics[f"alpha_{k + 1}"]) for k in range(Y)])
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=name)
        if name in ("tv", "e2e_tv", "e2e_tv_partial", "dca"):
            want_loss = np_loss(name, q, p, labels, valid)
            np.testing.assert_allclose(float(loss), want_loss, atol=1e-5, err_msg=name)


def test_the_overlap_equals_the_speculative_samplers_own_analytic_acceptance():
    """The same logits through the real sampler's pieces: `speculative._emit`'s overlap is
    Σ min(exp(process_logits(policy)), exp(process_logits(draft))); `overlap` with the floors
    of `support_floor` gives it from the hiddens (the head the identity: hiddens = logits)."""
    k = jax.random.split(jax.random.key(7), 2)
    n, v, temp = 16, 37, 0.9
    zq, zp = 2 * jax.random.normal(k[0], (n, v)), 2 * jax.random.normal(k[1], (n, v))
    eye = jnp.eye(v)
    for cut in CUTS.values():
        scfg = sampling.SamplingConfig(temperature=temp, **cut)
        p = jnp.exp(sampling.process_logits(zp, scfg))
        q = jnp.exp(sampling.process_logits(zq, scfg))
        want = jnp.minimum(p, q).sum(-1)
        floors = tuple(L.support_floor(z, eye, temp, chunk=8, **cut) for z in (zq, zp))
        lse_p = L._lse(zp, *L._chunks(eye, 8), temp, floors[1])
        got = L.overlap(zq, zp, eye, lse_p, 8, temp, floors)
        np.testing.assert_allclose(got, want, atol=1e-6)
        untruncated = L.overlap(zq, zp, eye, jax.nn.logsumexp(zp / temp, -1), 8, temp)
        assert float(jnp.abs(untruncated - want).max()) > 0.05


def _naive_truncated(name, draft, target, head, tokens, mask, vocab, top_k, top_p, temperature):
    """jnp reference for the gradient: full softmaxes restricted to the sampler's supports (the
    supports from `sampling.process_logits`, constant)."""
    cfg = sampling.SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    sub = jnp.arange(V) if vocab is None else jnp.asarray(vocab)

    def restricted(z):
        keep = jax.lax.stop_gradient(jnp.isfinite(sampling.process_logits(z, cfg)))
        return jax.nn.softmax(jnp.where(keep, z / temperature, -jnp.inf), -1)

    q = restricted(jnp.einsum("ybtd,dv->ybtv", draft, head[:, sub]))
    p_full = jax.lax.stop_gradient(restricted(jnp.einsum("btd,dv->btv", target, head)))
    p = jnp.stack([jnp.pad(p_full[:, k:], ((0, 0), (0, k), (0, 0))) for k in range(1, Y + 1)])
    valid = jnp.stack([jnp.pad(mask[:, k + 1 :], ((0, 0), (0, k + 1))) for k in range(1, Y + 1)])
    alpha = jnp.minimum(p[..., sub], q).sum(-1)
    prods = jnp.cumprod(alpha, 0)
    if name == "tv":
        return (((1 - alpha) * valid).sum()) / valid.sum()
    ok = valid.all(0)
    if name == "e2e_tv":
        return ((1 - prods.mean(0)) * ok).sum() / ok.sum()
    terms = jnp.maximum((prods * jnp.cumprod(valid, 0)).sum(0), 1e-9)  # dca, clamped as there
    return (-jnp.log(jnp.where(valid[0] > 0, terms, 1.0)) * valid[0]).sum() / valid[0].sum()


@pytest.mark.parametrize("vocab", [None, SUB], ids=["full", "draft_vocab"])
@pytest.mark.parametrize("name", ["tv", "e2e_tv", "dca"])
def test_truncated_gradients_equal_autodiff_of_a_naive_reference(name, vocab):
    """The analytic TV gradient on q's support (0 off it), through the chunked scans. (Supports
    of several tokens: on a one-token support q is constant, and so is α.)"""
    draft, target, head, tokens, mask = _inputs(seed=3)
    cut = {"top_k": 8, "top_p": 0.9}

    def got(d):
        kw = dict(vocab=vocab, chunk=8, temperature=0.8, **cut)
        return L.draft_loss(name, d, target, head, tokens, mask, **kw)[0]

    def want(d):
        return _naive_truncated(name, d, target, head, tokens, mask, vocab, temperature=0.8, **cut)

    np.testing.assert_allclose(got(draft), want(draft), atol=1e-5)
    g, w = jax.grad(got)(draft), jax.grad(want)(draft)
    np.testing.assert_allclose(g, w, atol=1e-5)
    assert float(jnp.abs(g).max()) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("chunk", "vocab"), [(8, None), (64, SUB)], ids=["chunked-full", "one_chunk-draft_vocab"]
)
@pytest.mark.parametrize("cut", [CUTS["both"], {"top_k": 1}, {"top_p": 1e-3}])
def test_losses_and_gradients_stay_finite_under_truncation(cut, chunk, vocab):
    """Tokens off a support have probability 0 (log-probability -inf in the sampler): every
    loss, metric and gradient stays finite, down to one-token supports (top-k 1, a tiny top-p),
    at a low temperature too."""
    draft, target, head, tokens, mask = _inputs(seed=4, scale=3.0)
    for temperature in (1.0, 1e-3):
        for name in L.MTP_LOSSES:

            def loss(d, name=name, temperature=temperature):
                kw = dict(vocab=vocab, chunk=chunk, temperature=temperature, **cut)
                return L.draft_loss(name, d, target, head, tokens, mask, **kw)

            (value, metrics), g = jax.value_and_grad(loss, has_aux=True)(draft)
            assert np.isfinite(float(value)), (name, temperature)
            assert all(np.isfinite(float(m)) for m in metrics.values()), (name, temperature)
            assert bool(jnp.isfinite(g).all()), (name, temperature)


# ----------------------------------------------------------------------------- without truncation


@pytest.mark.parametrize("vocab", [None, SUB], ids=["full", "draft_vocab"])
@pytest.mark.parametrize("chunk", [8, 64])
def test_without_truncation_the_losses_are_the_untruncated_ones(chunk, vocab):
    """T = 1, top_k = 0, top_p = 1 (and top_k >= the vocabulary, a cut that drops nothing): every
    loss and per-step α is the float64 numpy one of the full softmaxes (p on the draft
    vocabulary: its mass there, the KL losses as P·KL(p/P ‖ q) and KL(q ‖ p/P))."""
    draft, target, head, _, mask = _inputs(seed=5)
    tokens = jnp.asarray(np.resize([0, 3, 5, 9, 20, 7, 36], (B, T)))  # 5, 7 off the draft vocab
    args = (draft, target, head, tokens, mask)
    q, p, labels, valid = np_parts(*args, 1.0, vocab)
    for name in L.MTP_LOSSES:
        if vocab is None or name not in ("ce", "kl", "reverse_kl"):
            want = np_loss(name, q, p, labels, valid)
        elif name == "ce":  # labels outside the draft vocabulary are not supervised
            pos = np.full(V, -1)
            pos[SUB] = np.arange(len(SUB))
            lab = pos[labels]
            assert (valid & (lab >= 0)).sum() >= 3
            want = np_loss(name, q, p, np.maximum(lab, 0), valid & (lab >= 0))
        else:
            mass = p.sum(-1, keepdims=True)
            with np.errstate(divide="ignore", invalid="ignore"):
                p_hat = p / mass
                if name == "kl":
                    want = _np_mean(mass[..., 0] * (p_hat * np.log(p_hat / q)).sum(-1), valid)
                else:
                    want = _np_mean((q * np.log(q / p_hat)).sum(-1), valid)
        alphas = _alpha_metrics(q, p, valid)
        for kw in ({}, {"top_k": V}):
            loss, metrics = L.draft_loss(name, *args, vocab=vocab, chunk=chunk, **kw)
            np.testing.assert_allclose(float(loss), want, atol=1e-5, rtol=1e-5, err_msg=name)
            got = np.array([float(metrics[f"alpha_{k + 1}"]) for k in range(Y)])
            np.testing.assert_allclose(got, alphas, atol=1e-5, err_msg=name)
