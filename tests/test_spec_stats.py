"""Speculative acceptance statistics: counted from what was emitted (never drafts past EOS or the
token budget), and the decoder's step-1 acceptance equal to the train-time one on a random MTP
(whose hidden half, attention and cache paths all matter, unlike the copy fixture's)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
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


def test_step1_acceptance_after_a_plain_bucket_equals_train_time():
    """Compacted sampling whose 16- and 8-row buckets decode with γ = 0 -- the MTP's catch-up
    deferred, consumed in `CATCH_CHUNK`-position passes when the 4-row bucket drafts (γ = 3) --:
    every step-1 token drafted after the plain buckets has the train-time Σ min(p, q), so the
    MTP's cache holds every position they verified. Under these EOS and keys the 4 rows that
    draft do so from their 18th token on: two passes."""
    pol, mtp = _random_models()
    toks, lens = sampling.pad_prompts(PROMPTS)
    scfg = dataclasses.replace(SCFG, eos_ids=(14,))  # rows end after 1 .. 40 tokens
    out = spec_compacted.sample_compacted(
        *(*pol, *mtp, toks, lens, jax.random.key(7), scfg, SpecConfig(Y, "rejection")),
        min_bucket=4,
        draft_table=((16, 0), (8, 0), (4, 3)),
    )
    out = jax.device_get(out)
    lengths = np.asarray(out.sample.lengths)
    status = out.stats.status
    # a row that drafted at all did so after the plain bucket; its first drafted token's index
    first = [np.flatnonzero(status[r, : lengths[r]] <= ACCEPTED) for r in range(len(PROMPTS))]
    late = [r for r, f in enumerate(first) if len(f) and f[0] > spec_compacted.CATCH_CHUNK]
    assert len(late) >= 3, [f[:1] for f in first]
    alpha_BxT = _train_step1_alpha(pol, mtp, out, toks, lens)
    assert _check_step1(out, alpha_BxT, lens, late) > 30
