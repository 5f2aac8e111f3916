"""Speculative sampler: greedy equality with the plain sampler, losslessness (chi-square against
exact probabilities), behaviour log-probs, acceptance statistics, 1 vs 8 devices."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bebop import model, sampling, sharding, speculative
from bebop import mtp as mtp_lib
from bebop.config import MeshConfig, ModelConfig
from bebop.speculative import ACCEPTED, UNDRAFTED, SpecConfig

from .helpers import bigram_policy_and_copy_mtp, perturb, random_policy

CFG = ModelConfig(
    vocab_size=16, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffw_dim=48
)
PROMPTS = [[1, 5, 6, 7], [1, 3], [1, 4, 4, 4, 4, 9], [1, 8, 2]]


def _spec(pol, mtp, prompts, scfg, spec, seed=0, vocab=None):
    toks, lens = sampling.pad_prompts(prompts)
    return speculative.sample_jit(*pol, *mtp, toks, lens, jax.random.key(seed), scfg, spec, vocab)


def _plain(pol, prompts, scfg, seed=0):
    toks, lens = sampling.pad_prompts(prompts)
    return sampling.sample_jit(*pol, toks, lens, jax.random.key(seed), scfg)


def _models(kind, num_mtp=1):
    if kind == "random":  # a random MTP: rarely agrees with the policy
        return random_policy(CFG, 0), mtp_lib.init(
            dataclasses.replace(CFG, init_std=0.3), num_mtp, 1
        )
    pol, (mg, mp) = bigram_policy_and_copy_mtp(CFG, 0)
    if kind == "agrees_often":  # a slightly perturbed copy
        mp = perturb(mp, 3, 0.05)
    return pol, (mg, mp)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["random", "agrees_often"])
@pytest.mark.parametrize("rule", ["rejection", "target_only"])
@pytest.mark.parametrize("num_mtp", [1, 2, "1+vocab", "1+unrolled"])
def test_greedy_equals_plain_sampler_token_for_token(kind, rule, num_mtp):
    vocab = jnp.arange(0, CFG.vocab_size, 2) if num_mtp == "1+vocab" else None  # even ids only
    pol, mtp = _models(kind, num_mtp if isinstance(num_mtp, int) else 1)
    if num_mtp == "1+unrolled":  # the policy's decode loop on per-layer weights sliced once
        unrolled = dataclasses.replace(model.graphdef_config(*pol), scan_layers=False)
        pol = (model.abstract(unrolled)[0], pol[1])
    scfg = sampling.SamplingConfig(temperature=0.0, max_new_tokens=24, eos_ids=(2,))
    plain = jax.device_get(_plain(pol, PROMPTS, scfg))
    out = jax.device_get(_spec(pol, mtp, PROMPTS, scfg, SpecConfig(3, rule), vocab=vocab))
    np.testing.assert_array_equal(out.sample.lengths, plain.lengths)
    np.testing.assert_array_equal(out.sample.tokens, plain.tokens)
    np.testing.assert_allclose(out.sample.logprobs, plain.logprobs, atol=1e-5)
    np.testing.assert_allclose(out.sample.entropy, plain.entropy, atol=1e-5)
    rate = out.stats.accepts.sum() / max(out.stats.attempts.sum(), 1)
    if kind == "agrees_often":
        floor = 0.6 if vocab is None else 0.2  # half the tokens cannot be drafted
        assert rate > floor and out.stats.verify_calls.sum() < (1 - floor) * plain.lengths.sum()


# ----------------------------------------------------------------------------- losslessness

V_SMALL = 8
SMALL = ModelConfig(
    vocab_size=V_SMALL,
    dim=16,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    ffw_dim=32,
    init_std=0.4,
)
PROMPT = [1, 3, 5]
N_SAMPLES = 100_000


def _exact_joint(pol, scfg):
    """P(x1, x2, x3 | prompt) for all V^3 continuations, from full forwards of every prefix."""
    seqs = np.array([PROMPT + list(c) for c in itertools.product(range(V_SMALL), repeat=2)])
    pos = jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape)
    logits = model.forward(*pol, jnp.asarray(seqs), pos)[0]
    lp = np.asarray(sampling.process_logits(logits, scfg))  # [V^2, P+2, V]
    p1 = np.exp(lp[0, len(PROMPT) - 1])
    p2 = np.exp(lp[:, len(PROMPT)]).reshape(V_SMALL, V_SMALL, V_SMALL)[:, 0]  # [x1, x2]
    p3 = np.exp(lp[:, len(PROMPT) + 1]).reshape(V_SMALL, V_SMALL, V_SMALL)  # [x1, x2, x3]
    return p1[:, None, None] * p2[:, :, None] * p3


def _chi2_pvalue(counts, probs):
    """Pearson chi-square; cells with expected < 5 are pooled into one."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(jax.scipy.special.gammaincc(dof / 2, stat / 2)), dof


def _broken_rule(key, logq, cfg):
    """A realistic bug, the two rules mixed up: greedy draft d = argmax q, but the acceptance
    test and residual use q itself. (Note that a draft drawn any way and tested as a one-hot, i.e.
    target-only with any proposal, would still be lossless.)"""
    del key, cfg
    return jnp.argmax(logq, axis=-1).astype(jnp.int32), jnp.exp(logq)


SETTINGS = {
    "t1": sampling.SamplingConfig(temperature=1.0, max_new_tokens=3, eos_ids=(-1,)),
    "t0.7_p0.9": sampling.SamplingConfig(
        temperature=0.7, top_p=0.9, max_new_tokens=3, eos_ids=(-1,)
    ),
}


# The chi-square samplers run 4 batches of 25,000 rows, so they are compiled with XLA's optimising
# passes (level 2; XLA's default is 3), which the suite's fast-compile flags turn off: the 14
# chi-square tests that count here took 90.8 s instead of 123.1 s (docs/development.md).
OPTIMISED = {"xla_backend_optimization_level": 2, "xla_llvm_disable_expensive_passes": False}


def _counts(sampler, scfg):
    """(x1, x2, x3) counts of `sampler` (a jitted fn of tokens, lengths, key and a static
    `scfg`) over N_SAMPLES rows of PROMPT: 4 batches of 25k rows, keys 0..3."""
    toks, lens = sampling.pad_prompts([PROMPT] * (N_SAMPLES // 4))
    run = sampler.lower(toks, lens, jax.random.key(0), scfg).compile(compiler_options=OPTIMISED)
    rows = [np.asarray(run(toks, lens, jax.random.key(seed))) for seed in range(4)]
    seqs = np.concatenate(rows)
    idx = (seqs[:, 0] * V_SMALL + seqs[:, 1]) * V_SMALL + seqs[:, 2]
    return np.bincount(idx, minlength=V_SMALL**3)


DRAFT_VOCAB = jnp.array([6, 1, 3, 4])  # half of the 8 tokens, unsorted


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize(
    "rule", ["plain", "rejection", "target_only", "broken", "rejection+vocab", "target_only+vocab"]
)
def test_lossless_joint_distribution_of_first_three_tokens(setting, rule, monkeypatch):
    """Chi-square goodness of fit of 1e5 samples of (x1, x2, x3) against exact probabilities:
    every real sampler passes at p > 0.01 (`+vocab`: the draft restricted to 4 of the 8 tokens);
    the broken verifier must fail (p < 1e-6)."""
    scfg = SETTINGS[setting]
    pol = model.init(SMALL, 0)
    mtp = mtp_lib.init(dataclasses.replace(SMALL, init_std=0.8), 1, 5)
    monkeypatch.setitem(speculative.DRAFT_RULES, "broken", _broken_rule)
    if rule == "plain":
        run = jax.jit(lambda t, n, k, c: sampling.sample(*pol, t, n, k, c).tokens, static_argnums=3)
    else:
        rule, _, with_vocab = rule.partition("+")
        spec, vocab = SpecConfig(num_draft=2, rule=rule), DRAFT_VOCAB if with_vocab else None
        run = jax.jit(
            lambda t, n, k, c: (
                speculative.sample(*pol, *mtp, t, n, k, c, spec, vocab).sample.tokens
            ),
            static_argnums=3,
        )
    pvalue, dof = _chi2_pvalue(_counts(run, scfg), _exact_joint(pol, scfg).ravel())
    assert dof > 50
    if rule == "broken":
        assert pvalue < 1e-6
    else:
        assert pvalue > 0.01, (rule, setting, pvalue)


# ----------------------------------------------------------------------------- log-probs, stats


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["rejection", "target_only"])
def test_behaviour_logprobs_match_a_full_forward(rule):
    pol, mtp = _models("agrees_often")
    scfg = sampling.SamplingConfig(temperature=0.8, max_new_tokens=20, eos_ids=(2,))
    out = jax.device_get(_spec(pol, mtp, PROMPTS, scfg, SpecConfig(3, rule), seed=7))
    for r, prompt in enumerate(PROMPTS):
        n = int(out.sample.lengths[r])
        seq = np.array(prompt + list(out.sample.tokens[r, :n]))
        logits = model.forward(*pol, jnp.asarray(seq[None]), jnp.arange(len(seq))[None])[0][0]
        logp = jax.nn.log_softmax(logits / 0.8, axis=-1)
        want = logp[len(prompt) - 1 : len(seq) - 1][np.arange(n), seq[len(prompt) :]]
        np.testing.assert_allclose(out.sample.logprobs[r, :n], want, atol=1e-4)


def test_copy_mtp_is_always_accepted():
    pol, mtp = _models("copy")
    y = 3
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=1 + 5 * (y + 1), eos_ids=(-1,))
    out = jax.device_get(_spec(pol, mtp, PROMPTS, scfg, SpecConfig(y, "rejection"), seed=1))
    st = out.stats
    np.testing.assert_array_equal(st.accepts, st.attempts)
    assert st.attempts.sum() == len(PROMPTS) * 5 * y
    np.testing.assert_array_equal(st.verify_calls, 5)
    np.testing.assert_allclose(st.overlap[st.status == ACCEPTED], 1.0, atol=1e-5)


@pytest.mark.slow
def test_copy_mtp_with_a_draft_vocabulary_is_accepted_exactly_on_it():
    """q = p restricted to a draft vocabulary: with every token in it (shuffled order) all drafts
    are accepted; with half of them, drafts are always in it and acceptance equals the target's
    mass on it (the analytic Σ min(p, q)), not 1."""
    pol, mtp = _models("copy")
    y, n = 3, 1 + 6 * 4
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=n, eos_ids=(-1,))
    perm = jnp.asarray(np.random.default_rng(0).permutation(CFG.vocab_size))
    toks, lens = sampling.pad_prompts(PROMPTS)
    out = jax.device_get(
        speculative.sample_jit(
            *pol, *mtp, toks, lens, jax.random.key(1), scfg, SpecConfig(y, "rejection"), perm
        )
    )
    np.testing.assert_array_equal(out.stats.accepts, out.stats.attempts)
    half = perm[: CFG.vocab_size // 2]
    out = jax.device_get(
        speculative.sample_jit(
            *pol,
            *mtp,
            *sampling.pad_prompts(PROMPTS * 8),
            jax.random.key(2),
            scfg,
            SpecConfig(y, "rejection"),
            half,
        )
    )
    st = out.stats
    acc = st.status == ACCEPTED
    assert np.isin(out.sample.tokens[acc], np.asarray(half)).all()
    drafted = acc | (st.status == 0)
    rate = st.accepts.sum() / st.attempts.sum()
    assert 0.05 < rate < 0.95
    assert abs(rate - st.overlap[drafted].mean()) < 0.08  # sample size: ~500 drafts


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["rejection", "target_only"])
def test_acceptance_counts_are_consistent(rule):
    pol, mtp = _models("agrees_often")
    y = 3
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=40, eos_ids=(2,))
    prompts = PROMPTS * 4
    out = jax.device_get(_spec(pol, mtp, prompts, scfg, SpecConfig(y, rule), seed=2))
    st, lengths = out.stats, out.sample.lengths
    hist = st.accept_hist  # [B, Y+1]: verifies that emitted k+1 tokens
    k = np.arange(y + 1)
    assert hist.shape[1] == y + 1  # accept lengths never exceed Y + 1
    np.testing.assert_array_equal(hist.sum(1), st.verify_calls)
    np.testing.assert_array_equal(1 + (hist * (k + 1)).sum(1), lengths)  # emitted, after cuts
    for j in range(y):  # draft j+1 is evaluated iff the first j were accepted
        np.testing.assert_array_equal(st.attempts[:, j], hist[:, j:].sum(1))
    produced = 1 + (hist * (k + 1)).sum(1)  # first token + tokens per verify before cuts
    assert (lengths <= produced).all() and (lengths >= produced - y).all()
    for r in range(len(prompts)):  # per emitted token: every accepted draft is counted
        n_acc = (st.status[r, : lengths[r]] == ACCEPTED).sum()
        assert st.accepts[r].sum() - y <= n_acc <= st.accepts[r].sum()
        assert st.status[r, 0] == UNDRAFTED and (st.status[r, lengths[r] :] == -1).all()
    assert 0 < st.accepts.sum() < st.attempts.sum()


@pytest.mark.slow
def test_other_rule_overlap_is_what_the_other_rule_computes_on_the_same_draft():
    """`SpecConfig.other_rule` records, per drafted position, the other rule's analytic
    acceptance. The first draft of each row has the same context and the same MTP q under both
    rules (same prompt, same first token), so an RS run's `overlap_other` there is a TO run's
    `overlap` (p(argmax q)) and the other way round; recording it changes no token."""
    pol, mtp = _models("random")
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=12, eos_ids=(-1,))
    prompts = PROMPTS * 4
    rs, to, rs_plain = (
        jax.device_get(_spec(pol, mtp, prompts, scfg, SpecConfig(3, rule, other_rule=o), seed=3))
        for rule, o in (("rejection", True), ("target_only", True), ("rejection", False))
    )
    assert rs_plain.stats.overlap_other is None
    np.testing.assert_array_equal(rs.sample.tokens, rs_plain.sample.tokens)
    np.testing.assert_array_equal(rs.stats.overlap, rs_plain.stats.overlap)
    assert (rs.stats.status[:, 1] != UNDRAFTED).all()  # position 1 is draft 1 of cycle 1
    np.testing.assert_allclose(rs.stats.overlap_other[:, 1], to.stats.overlap[:, 1], atol=1e-6)
    np.testing.assert_allclose(to.stats.overlap_other[:, 1], rs.stats.overlap[:, 1], atol=1e-6)
    # the two rules' acceptances differ here (a random MTP), so the check above is not vacuous
    assert np.abs(rs.stats.overlap[:, 1] - to.stats.overlap[:, 1]).max() > 0.05
    other, drafted = rs.stats.overlap_other, rs.stats.status != UNDRAFTED
    assert (other[~drafted] == 0).all()
    assert ((other[drafted] >= 0) & (other[drafted] <= 1 + 1e-6)).all()


@pytest.mark.slow
def test_same_tokens_on_one_device_and_an_8_device_mesh(devices):
    pol, mtp = _models("agrees_often")
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=16, eos_ids=(2,))
    toks, lens = sampling.pad_prompts(PROMPTS * 2)
    outs = []
    for mesh_cfg, devs in ((MeshConfig(data=1), devices[:1]), (MeshConfig(2, 2, 2), devices)):
        mesh = sharding.make_mesh(mesh_cfg, devs)
        pp = sharding.place_state(pol[1], mesh)
        mp = sharding.place_state(mtp[1], mesh)
        batch = sharding.shard_batch({"t": toks, "l": lens}, mesh)
        out = speculative.sample_jit(
            pol[0], pp, mtp[0], mp, batch["t"], batch["l"], jax.random.key(3), scfg, SpecConfig()
        )
        outs.append(jax.device_get(out.sample))
    np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
    np.testing.assert_array_equal(outs[0].lengths, outs[1].lengths)


# ----------------------------------------------------------------------------- accept (no model)

P_TOY = np.array([0.40, 0.25, 0.20, 0.10, 0.05])  # target p over V = 5
Q_TOY = np.array([0.10, 0.50, 0.05, 0.30, 0.05])  # draft q
N_TOY = 200_000


@pytest.mark.parametrize("vocab", [None, [4, 0, 1, 3]], ids=["full", "draft_vocab"])
def test_accept_on_toy_distributions(vocab):
    """`speculative.accept` with one draft d ~ q on 2e5 rows: the acceptance rate is Σ min(p, q)
    (binomial sd 0.0011; tolerance 0.005), the token that replaces a rejected draft follows the
    residual max(0, p - q) / Z, and the emitted token follows p (chi-square, p > 0.01 each).
    `draft_vocab`: q on 4 of the 5 tokens (token 2 never drafted), given in draft-vocab space."""
    rng = np.random.default_rng(0)
    q = Q_TOY.copy()
    if vocab is not None:
        q[2] = 0.0
        q /= q.sum()
    d = rng.choice(5, size=N_TOY, p=q)
    q_vd = q if vocab is None else q[vocab]
    d_idx = d
    if vocab is not None:  # token id -> index into the draft vocabulary
        lookup = np.full(5, -1)
        lookup[vocab] = np.arange(len(vocab))
        d_idx = lookup[d]
    logp = np.log(np.stack([P_TOY, P_TOY]))  # p_0 (tests d) and p_1 (the bonus)
    keys = jax.random.split(jax.random.key(1), N_TOY)
    scfg = sampling.SamplingConfig(temperature=1.0)
    n_acc, nxt = jax.jit(speculative.accept, static_argnums=5)(
        keys,
        jnp.broadcast_to(jnp.asarray(logp, jnp.float32), (N_TOY, 2, 5)),
        jnp.broadcast_to(jnp.asarray(q_vd, jnp.float32), (N_TOY, 1, len(q_vd))),
        jnp.asarray(d_idx, jnp.int32)[:, None],
        jnp.asarray(d, jnp.int32)[:, None],
        scfg,
        None if vocab is None else jnp.asarray(vocab, jnp.int32),
    )
    n_acc, nxt = np.asarray(n_acc), np.asarray(nxt)
    assert abs(n_acc.mean() - np.minimum(P_TOY, q).sum()) < 0.005
    resid = np.maximum(P_TOY - q, 0.0)
    rejected = nxt[n_acc == 0]
    pvalue, _ = _chi2_pvalue(np.bincount(rejected, minlength=5), resid / resid.sum())
    assert pvalue > 0.01, pvalue
    emitted = np.where(n_acc == 1, d, nxt)
    pvalue, _ = _chi2_pvalue(np.bincount(emitted, minlength=5), P_TOY)
    assert pvalue > 0.01, pvalue
    # a wrong residual (p itself instead of max(0, p - q)) is detected at this sample size
    assert _chi2_pvalue(np.bincount(rejected, minlength=5), P_TOY)[0] < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["rejection", "target_only"])
def test_a_rows_sample_does_not_depend_on_its_batch(rule):
    """Per-row key streams: a prompt sampled alone or among other prompts (at another row index)
    gives the same tokens when it keeps its row index's key -- here row 0 of both batches."""
    pol, mtp = _models("agrees_often")
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=24, eos_ids=(2,))
    toks, lens = sampling.pad_prompts(PROMPTS)
    key, spec = jax.random.key(4), SpecConfig(3, rule)
    run = lambda t, n: jax.device_get(speculative.sample_jit(*pol, *mtp, t, n, key, scfg, spec))  # noqa: E731
    alone, batch = run(toks[:1], lens[:1]), run(toks, lens)
    n = int(alone.sample.lengths[0])
    assert n == int(batch.sample.lengths[0]) and n > 4
    np.testing.assert_array_equal(alone.sample.tokens[0, :n], batch.sample.tokens[0, :n])
