"""Plain sampler: greedy = argmax of the full forward, EOS handling, processed distributions."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bebop import model, sampling

from .helpers import random_policy

_forward_jit = jax.jit(model.forward, static_argnums=0)


@pytest.mark.parametrize("scan_layers", [True, False])  # the reference forward scans or unrolls
def test_greedy_sampler_follows_full_forward_argmax(tiny_cfg, scan_layers):
    pol = random_policy(dataclasses.replace(tiny_cfg, scan_layers=scan_layers), 0)
    prompts = [[1, 5, 6], [1], [1, 4, 4, 4, 9, 3, 3]]
    scfg = sampling.SamplingConfig(temperature=0.0, max_new_tokens=12, eos_ids=(2,))
    toks, lens = sampling.pad_prompts(prompts)
    assert toks.shape[1] == 16  # bucketed (2^k or 3·2^(k-1), at least 16)
    out = jax.device_get(sampling.sample_jit(*pol, toks, lens, jax.random.key(0), scfg))
    for r, prompt in enumerate(prompts):
        n = int(out.lengths[r])
        seq = np.array(prompt + list(out.tokens[r, :n]))
        logits = _forward_jit(*pol, jnp.asarray(seq[None]), jnp.arange(len(seq))[None])[0][0]
        pred = np.asarray(jnp.argmax(logits, -1))[len(prompt) - 1 : len(seq) - 1]
        np.testing.assert_array_equal(pred, seq[len(prompt) :])
        logp = jax.nn.log_softmax(logits, -1)[len(prompt) - 1 : len(seq) - 1]
        np.testing.assert_allclose(
            out.logprobs[r, :n], logp[np.arange(n), seq[len(prompt) :]], atol=1e-5
        )
        if n < 12:  # stopped early: only because of EOS, which is counted and is last
            assert out.tokens[r, n - 1] == 2
        assert (out.tokens[r, n:] == scfg.pad_id).all()


def test_rows_stop_at_eos_independently(tiny_cfg):
    pol = random_policy(tiny_cfg, 1, std=1.0)
    eos = tuple(range(3, 9))  # several EOS ids: many rows stop early
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=20, eos_ids=eos)
    toks, lens = sampling.pad_prompts([[1, 2]] * 16)
    out = jax.device_get(sampling.sample_jit(*pol, toks, lens, jax.random.key(0), scfg))
    assert len(set(out.lengths.tolist())) > 1
    for r in range(16):
        n = out.lengths[r]
        assert not np.isin(out.tokens[r, : n - 1], eos).any()
        assert n == 20 or out.tokens[r, n - 1] in eos


def _ref_process(logits, temperature, top_k, top_p):
    z = logits / temperature
    if top_k:
        z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros_like(p, bool)
    total = 0.0
    for i in order:  # smallest prefix of the sorted distribution with mass >= top_p
        keep[i] = True
        total += p[i]
        if total >= top_p:
            break
    p = np.where(keep, p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 0.8)])
def test_processed_distribution_matches_reference(temperature, top_k, top_p):
    logits = np.random.default_rng(0).normal(size=(6, 40)).astype(np.float32) * 2
    cfg = sampling.SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    got = np.exp(np.asarray(sampling.process_logits(jnp.asarray(logits), cfg)))
    for r in range(6):
        np.testing.assert_allclose(
            got[r], _ref_process(logits[r], temperature, top_k, top_p), atol=1e-6
        )
    greedy = np.exp(
        np.asarray(sampling.process_logits(jnp.asarray(logits), sampling.SamplingConfig(0.0)))
    )
    np.testing.assert_array_equal(greedy.argmax(-1), logits.argmax(-1))
    np.testing.assert_array_equal(greedy.sum(-1), 1.0)


def _chi2_pvalue(counts, probs):
    expected = probs * counts.sum()
    keep = expected > 0
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return float(jax.scipy.special.gammaincc((keep.sum() - 1) / 2, stat / 2))


@pytest.mark.parametrize("per_row_keys", [False, True])
def test_categorical_draws_follow_the_distribution(per_row_keys):
    """Inverse-CDF sampling, 100k draws per row over 23 tokens (not a multiple of its block
    size): a chi-square test per row at p > 1e-3, and tokens of probability 0 are never drawn."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 23)) * 2
    logits[1, rng.permutation(23)[:18]] = -np.inf  # 5 tokens left
    logits[2, :] = -np.inf
    logits[2, 22] = 0.0  # all mass on the last token
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    n = 100_000
    logp_Nx3xV = jnp.broadcast_to(logp, (n, 3, 23))
    key = jax.random.key(3)
    keys = jax.random.split(key, n * 3).reshape(n, 3) if per_row_keys else key
    draws = np.asarray(jax.jit(sampling.categorical)(keys, logp_Nx3xV))
    probs = np.exp(np.asarray(logp, np.float64))
    for r in range(3):
        counts = np.bincount(draws[:, r], minlength=23)
        assert (counts[probs[r] == 0] == 0).all(), r  # row 2: token 22 every time
        if r < 2:
            assert _chi2_pvalue(counts, probs[r] / probs[r].sum()) > 1e-3, r


def test_argmax_takes_the_first_maximum():
    x = np.random.default_rng(0).integers(0, 4, size=(50, 37)).astype(np.float32)  # many ties
    np.testing.assert_array_equal(sampling.argmax(jnp.asarray(x)), x.argmax(-1))


def test_a_rows_sample_does_not_depend_on_the_other_rows(tiny_cfg):
    """Each row draws from its own key stream: changing the other rows' prompts (and with them
    when they stop) leaves row 0's tokens, log-probs and entropies unchanged."""
    pol = random_policy(tiny_cfg, 2, std=1.0)
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=10, eos_ids=(3,))
    layers = model.decode_layers_jit(*pol)
    outs = []
    for others in ([[1, 2], [5]], [[7, 7, 7], [9, 1]]):
        toks, lens = sampling.pad_prompts([[1, 4, 6]] + others)
        outs.append(sampling.sample_jit(*pol, toks, lens, jax.random.key(5), scfg, layers))
    a, b = outs
    n = int(a.lengths[0])
    assert n == int(b.lengths[0])
    np.testing.assert_array_equal(a.tokens[0], b.tokens[0])
    np.testing.assert_allclose(a.logprobs[0], b.logprobs[0], atol=1e-6)
    np.testing.assert_allclose(a.entropy[0], b.entropy[0], atol=1e-6)
    assert not np.array_equal(a.tokens[1:], b.tokens[1:])  # the other rows did change
