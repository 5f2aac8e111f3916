"""Speculative acceptance statistics: counted from what was emitted (never drafts past EOS or the
token budget), and the decoder's step-1 acceptance equal to the train-time one on a random MTP
(whose hidden half, attention and cache paths all matter, unlike the copy fixture's)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bebop import model, sampling, spec_compacted, speculative
from bebop import mtp as mtp_lib
from bebop.config import ModelConfig
from bebop.speculative import ACCEPTED, REJECTED, SpecConfig

from .helpers import bigram_policy_and_copy_mtp, perturb

CFG = ModelConfig(
    vocab_size=16, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffw_dim=48
)
PROMPTS = [[1, 5, 6, 7], [1, 3], [1, 4, 4, 4, 4, 9], [1, 8, 2]] * 4
Y = 3
# EOS is token 2 (frequent under the bigram policy): many verifies are cut inside an accepted run.
# The first test's settings are test_speculative's consistency test's (one compilation).
SCFG = sampling.SamplingConfig(temperature=1.0, max_new_tokens=40, eos_ids=(2,))


def _run(pol, mtp, seed):
    toks, lens = sampling.pad_prompts(PROMPTS)
    out = speculative.sample_jit(
        *pol, *mtp, toks, lens, jax.random.key(seed), SCFG, SpecConfig(Y, "rejection")
    )
    return jax.device_get(out), toks, lens


def _draft_index(status_row):
    """Draft position (0-based) of each emitted token within its verify cycle; -1 if undrafted."""
    k, out = 0, []
    for s in status_row:
        out.append(k if s in (ACCEPTED, REJECTED) else -1)
        k = k + 1 if s == ACCEPTED else 0
    return np.asarray(out)


def test_acceptance_counts_only_emitted_drafts():
    """Per row and draft position, attempts = emitted drafted tokens there and accepts = emitted
    accepted ones; the histogram of tokens per verify adds up to the emitted length. (Before the
    fix, drafts accepted past EOS / the budget were counted: ~1 per row here.) The host-side
    `draft_positions` agrees with a per-token reference."""
    pol, (mg, mp) = bigram_policy_and_copy_mtp(CFG, 0)
    out, _, _ = _run(pol, (mg, perturb(mp, 3, 0.05)), seed=2)
    st, lengths = out.stats, out.sample.lengths
    cut = 0
    for r in range(len(PROMPTS)):
        status = st.status[r, : lengths[r]]
        k = _draft_index(status)
        np.testing.assert_array_equal(speculative.draft_positions(status[None])[0], k)
        for j in range(Y):
            assert st.attempts[r, j] == (k == j).sum(), (r, j)
            assert st.accepts[r, j] == ((k == j) & (status == ACCEPTED)).sum(), (r, j)
        cut += int(status[-1] == ACCEPTED)  # the row ended inside an accepted run
    hist = st.accept_hist
    np.testing.assert_array_equal(1 + (hist * np.arange(1, Y + 2)).sum(1), lengths)
    summ = speculative.summarize(out)
    np.testing.assert_allclose(
        summ["accept_len"], (lengths.sum() - len(lengths)) / st.verify_calls.sum(), rtol=1e-6
    )
    assert cut >= 4, cut  # the cases the fix is about do occur in this sample


def _random_models():
    """A perturbed policy and a random-ish MTP (the copy fixture plus N(0, 0.1²) on every MTP
    weight: W_fc's hidden half, the MTP block's attention and so its KV cache all matter)."""
    pol, mtp = bigram_policy_and_copy_mtp(CFG, 0)
    return (pol[0], perturb(pol[1], 5, 0.05)), (mtp[0], perturb(mtp[1], 6, 0.1))


def _train_step1_alpha(pol, mtp, out, toks, lens) -> np.ndarray:
    """Σ min(p, q) of step 1 at every anchor of the finished sequences, at train time:
    `mtp.train_hidden` over them and a full policy forward. [B, T-1]: anchor a predicts token
    a + 2 from p at a + 1."""
    b, p = toks.shape
    width = p + SCFG.max_new_tokens
    tokens = np.zeros((b, width), np.int32)
    tokens[:, :p] = toks
    for r in range(b):
        n = int(out.sample.lengths[r])
        tokens[r, lens[r] : lens[r] + n] = out.sample.tokens[r, :n]

    @jax.jit
    def train_alpha(pol_params, mtp_params, tokens_BxT):
        positions = jnp.broadcast_to(jnp.arange(width), (b, width))
        policy = nnx.merge(pol[0], pol_params)
        logits, _ = model.forward(pol[0], pol_params, tokens_BxT, positions)
        hidden = policy.hidden(tokens_BxT, positions)[0]
        train = mtp_lib.train_hidden(mtp[0], mtp_params, pol[0], pol_params, tokens_BxT, hidden, 1)
        logq = jax.nn.log_softmax(policy.head(train[0]) / SCFG.temperature, -1)
        logp = jax.nn.log_softmax(logits / SCFG.temperature, -1)
        return jnp.minimum(jnp.exp(logq[:, :-1]), jnp.exp(logp[:, 1:])).sum(-1)

    return np.asarray(train_alpha(pol[1], mtp[1], jnp.asarray(tokens)))


def _check_step1(out, alpha_BxT, lens, rows) -> int:
    """The decoder's recorded step-1 overlap equals the train-time one (atol 1e-4, on values
    around 0.1) at every step-1 token of `rows`; returns how many were checked."""
    checked = 0
    for r in rows:
        n = int(out.sample.lengths[r])
        step1 = np.flatnonzero(_draft_index(out.stats.status[r, :n]) == 0)  # response indices
        np.testing.assert_allclose(
            out.stats.overlap[r, step1], alpha_BxT[r, lens[r] + step1 - 2], atol=1e-4
        )
        checked += len(step1)
    return checked


def test_decode_step1_acceptance_equals_train_time_on_a_random_mtp():
    """At every verify cycle, the analytic step-1 acceptance Σ min(p, q) the decoder recorded
    equals the one computed at train time (`_train_step1_alpha`) on a random MTP."""
    pol, mtp = _random_models()
    out, toks, lens = _run(pol, mtp, seed=4)
    alpha_BxT = _train_step1_alpha(pol, mtp, out, toks, lens)
    for r in range(len(PROMPTS)):  # every verify emits its step-1 token
        step1 = _draft_index(out.stats.status[r, : out.sample.lengths[r]]) == 0
        assert step1.sum() == out.stats.verify_calls[r]
    checked = _check_step1(out, alpha_BxT, lens, range(len(PROMPTS)))
    assert checked > 100, checked
    drafted = (out.stats.status == ACCEPTED) | (out.stats.status == REJECTED)
    assert 0.05 < float(out.stats.overlap[drafted].mean()) < 0.95  # neither always nor never


@pytest.mark.slow
@pytest.mark.parametrize(
    "table, passes", [(((16, 0), (8, 0), (4, 3)), 1), (((16, 0), (8, 0), (4, 0), (2, 3)), 2)]
)
def test_step1_acceptance_after_plain_buckets_equals_train_time(table, passes):
    """Compacted sampling whose first buckets decode with γ = 0 -- the MTP's catch-up deferred,
    consumed in `CATCH_CHUNK`-position passes when a later bucket drafts (γ = 3) --: every
    step-1 token drafted after the plain buckets has the train-time Σ min(p, q), so the MTP's
    cache holds every position they verified. Under these EOS and keys the rows that draft first
    do so at the same token index n (4 rows at n = 17 with the first table, 2 at n = 32 with the
    second): they hold n entries and the MTP consumes n - (γ + 1) of them, in `passes` passes."""
    pol, mtp = _random_models()
    toks, lens = sampling.pad_prompts(PROMPTS)
    scfg = dataclasses.replace(SCFG, eos_ids=(14,))  # rows end after 1 .. 40 tokens
    out = spec_compacted.sample_compacted(
        *(*pol, *mtp, toks, lens, jax.random.key(7), scfg, SpecConfig(Y, "rejection")),
        min_bucket=2,
        draft_table=table,
    )
    out = jax.device_get(out)
    lengths, status = np.asarray(out.sample.lengths), out.stats.status
    # each row's first drafted token (rows that drafted at all)
    first = {r: np.flatnonzero(status[r, : lengths[r]] <= ACCEPTED) for r in range(len(PROMPTS))}
    first = {r: int(f[0]) for r, f in first.items() if len(f)}
    assert len(first) >= 2 and len(set(first.values())) == 1, first
    consumed = next(iter(first.values())) - (Y + 1)
    assert -(-consumed // spec_compacted.CATCH_CHUNK) == passes, consumed
    alpha_BxT = _train_step1_alpha(pol, mtp, out, toks, lens)
    assert _check_step1(out, alpha_BxT, lens, sorted(first)) >= 3
