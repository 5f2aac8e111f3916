"""Plain sampler: greedy = argmax of the full forward, EOS handling, processed distributions."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bebop import model, sampling

from .helpers import random_policy


@pytest.mark.parametrize("scan_layers", [True, False])  # False: `decode_layers` slices once
def test_greedy_sampler_follows_full_forward_argmax(tiny_cfg, scan_layers):
    pol = random_policy(dataclasses.replace(tiny_cfg, scan_layers=scan_layers), 0)
    prompts = [[1, 5, 6], [1], [1, 4, 4, 4, 9, 3, 3]]
    scfg = sampling.SamplingConfig(temperature=0.0, max_new_tokens=12, eos_ids=(2,))
    toks, lens = sampling.pad_prompts(prompts)
    assert toks.shape[1] == 8  # bucketed to a power of two
    out = jax.device_get(sampling.sample_jit(*pol, toks, lens, jax.random.key(0), scfg))
    for r, prompt in enumerate(prompts):
        n = int(out.lengths[r])
        seq = np.array(prompt + list(out.tokens[r, :n]))
        logits = model.forward(*pol, jnp.asarray(seq[None]), jnp.arange(len(seq))[None])[0][0]
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
