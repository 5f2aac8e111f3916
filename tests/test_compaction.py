"""Tail-aware rollouts (bebop/compaction.py): compacted sampling gives the uncompacted loop's
samples; with a per-bucket draft length it stays lossless (chi-square) and greedy-exact; the
draft-length cost model on known costs; the config keys."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bebop import (
    compaction,
    config,
    model,
    sampling,
    sharding,
    spec_compacted,
    speculative,
    tasks,
)
from bebop import mtp as mtp_lib
from bebop.rl import rollouts as rl_rollouts
from bebop.speculative import SpecConfig
from bebop.tokenizer import CharTokenizer

from .conftest import REPO
from .test_speculative import SMALL, V_SMALL, _broken_rule, _chi2_pvalue, _models

# Prompts and EOS ids under which the test policies' rows end at very different lengths
# (1 to ~20 of 24 tokens): two compactions, 8 -> 4 -> 2 rows.
_rng = np.random.default_rng(0)
PROMPTS = [list(_rng.integers(3, 16, size=_rng.integers(1, 6))) for _ in range(8)]
N = 24
EOS = (12,)  # the bigram policies ("agrees_often", "copy")
RANDOM_EOS = (5,)  # the random policy


def _spread(lengths):
    """At least 6 of the 8 rows end before the longest: the loop compacts twice."""
    lengths = np.asarray(lengths)
    assert (lengths < lengths.max()).sum() >= 6 and lengths.min() < lengths.max() / 3, lengths


def _assert_same(a, b, tol=1e-5):
    """Tokens, lengths and integer statistics exactly; floats to the cross-batch-size rounding
    of XLA's CPU matmuls (`compaction`)."""

    def same(x, y):
        if np.issubdtype(x.dtype, np.integer):
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(x, y, atol=tol, rtol=tol)

    jax.tree.map(same, jax.device_get(a), jax.device_get(b))


@pytest.mark.slow
def test_plain_compacted_equals_uncompacted():
    pol, _ = _models("random")
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=N, eos_ids=RANDOM_EOS)
    toks, lens = sampling.pad_prompts(PROMPTS)
    ref = sampling.sample_jit(*pol, toks, lens, jax.random.key(1), scfg)
    out = sampling.sample_compacted(*pol, toks, lens, jax.random.key(1), scfg, min_bucket=2)
    _spread(ref.lengths)
    _assert_same(out, ref)


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["rejection", "target_only"])
def test_speculative_compacted_equals_uncompacted(rule):
    """Every output, statistics and recorded hiddens / cycle lengths included."""
    pol, mtp = _models("agrees_often")
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=N, eos_ids=EOS)
    spec = SpecConfig(3, rule, record=True)
    toks, lens = sampling.pad_prompts(PROMPTS)
    key = jax.random.key(2)
    ref = speculative.sample_jit(*pol, *mtp, toks, lens, key, scfg, spec)
    out = spec_compacted.sample_compacted(*pol, *mtp, toks, lens, key, scfg, spec, min_bucket=2)
    _spread(ref.sample.lengths)
    assert 0 < ref.stats.accepts.sum() < ref.stats.attempts.sum()
    _assert_same(out, ref)


# Buckets of 8, 4, 2 rows: plain decoding, then γ = 3, then γ = 1 (the MTP consumes the excess
# of a long accepted run when γ goes down).
TABLE = ((8, 0), (4, 3), (2, 1))


@pytest.mark.slow
def test_greedy_speculative_with_compaction_and_a_draft_table_equals_plain():
    """The bigram policy's greedy chains reach EOS 14 from these last prompt tokens after 1, 1,
    2, 2, 3, 4 tokens, never from the last two: the loop runs at 8, 4 and 2 rows."""
    pol, mtp = _models("agrees_often")
    scfg = sampling.SamplingConfig(temperature=0.0, max_new_tokens=N, eos_ids=(14,))
    toks, lens = sampling.pad_prompts([[1, t] for t in (3, 4, 12, 5, 9, 10, 6, 15)])
    plain = jax.device_get(sampling.sample_jit(*pol, toks, lens, jax.random.key(0), scfg))
    _spread(plain.lengths)
    out = spec_compacted.sample_compacted(
        *(*pol, *mtp, toks, lens, jax.random.key(0), scfg, SpecConfig(2, "rejection")),
        min_bucket=2,
        draft_table=TABLE,
    )
    out = jax.device_get(out)
    np.testing.assert_array_equal(out.sample.lengths, plain.lengths)
    np.testing.assert_array_equal(out.sample.tokens, plain.tokens)
    np.testing.assert_allclose(out.sample.logprobs, plain.logprobs, atol=1e-5)
    assert out.stats.attempts.shape[1] == 3  # as wide as the table's largest γ
    assert out.stats.attempts.sum() > 0  # drafted after the γ = 0 bucket


@pytest.mark.slow
def test_copy_mtp_accepts_every_draft_as_the_draft_length_changes():
    """q = p exactly (a bigram policy and its copy as the MTP): every draft is accepted, in
    every bucket, whatever γ -- so the catch-up buffer still ends at the right token after each
    change of γ (a misaligned one drafts from another token's q). The counters stay consistent."""
    pol, mtp = _models("copy")
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=N, eos_ids=EOS)
    toks, lens = sampling.pad_prompts(PROMPTS)
    table = ((8, 4), (4, 2), (2, 1))  # γ only goes down: the excess path
    out = spec_compacted.sample_compacted(
        *(*pol, *mtp, toks, lens, jax.random.key(3), scfg, SpecConfig(3, "rejection")),
        min_bucket=2,
        draft_table=table,
    )
    st, lengths = jax.device_get(out.stats), np.asarray(out.sample.lengths)
    _spread(lengths)
    np.testing.assert_array_equal(st.accepts, st.attempts)
    assert (st.attempts.sum(0) > 0).all()
    k = np.arange(st.accept_hist.shape[1])
    np.testing.assert_array_equal(st.accept_hist.sum(1), st.verify_calls)
    np.testing.assert_array_equal(1 + (st.accept_hist * (k + 1)).sum(1), lengths)


# ----------------------------------------------------------------------------- losslessness

CHI_K = 5  # the token budget: every sampled token is counted
CHI_EOS = 1  # P(ended) after 1, 2, 3 tokens: 0.12, 0.39, ~0.55 -> the batch compacts


def _exact_truncated(pol, scfg, prompt):
    """P of each first-`CHI_K`-token outcome as the sampler writes it (pad, 0, after EOS), from
    full forwards of every prefix."""
    v, k = V_SMALL, CHI_K
    seqs = np.array([prompt + list(c) for c in itertools.product(range(v), repeat=k - 1)])
    pos = jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape)
    lp = np.asarray(sampling.process_logits(model.forward(*pol, jnp.asarray(seqs), pos)[0], scfg))
    p_SxKxV = np.exp(lp[:, len(prompt) - 1 :])  # [V^(k-1), k, V]: p(x_j | prompt, x_<j)
    joint = p_SxKxV[:, k - 1].reshape((v,) * k)
    for j in range(k - 1):  # p(x_j+1 | x_<=j) does not depend on x_>j: take x_>j = 0
        p_j = p_SxKxV[:, j].reshape((v,) * (k - 1) + (v,))[(slice(None),) * j + (0,) * (k - 1 - j)]
        joint = joint * p_j.reshape(p_j.shape + (1,) * (k - 1 - j))
    idx_CxK = np.array(list(itertools.product(range(v), repeat=k)))
    eos = idx_CxK == CHI_EOS
    after = (np.cumsum(eos, axis=1) - eos) > 0
    cells = np.where(after, 0, idx_CxK) @ v ** np.arange(k)[::-1]
    out = np.zeros(v**k)
    np.add.at(out, cells, joint.ravel())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["rejection", "target_only", "broken"])
def test_lossless_with_compaction_and_a_draft_table(rule, monkeypatch):
    """Chi-square of 1e5 samples (all tokens: rows end at 1 .. 5 tokens; the loop starts at
    25000 rows with γ = 0 and goes on at 12500 with γ = 2) against exact probabilities of the
    8^5 outcomes: p > 0.01; the broken verifier must fail (p < 1e-6)."""
    pol = model.init(SMALL, 0)
    mtp = mtp_lib.init(dataclasses.replace(SMALL, init_std=0.8), 1, 5)
    monkeypatch.setitem(speculative.DRAFT_RULES, "broken", _broken_rule)
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=CHI_K, eos_ids=(CHI_EOS,))
    prompt, rows = [1, 3, 5], 25_000
    spec, table = SpecConfig(2, rule), ((rows, 0), (rows // 2, 2))
    toks, lens = sampling.pad_prompts([prompt] * rows)
    seqs = []
    for seed in range(4):
        out = spec_compacted.sample_compacted(
            *(*pol, *mtp, toks, lens, jax.random.key(seed), scfg, spec),
            min_bucket=rows // 2,
            draft_table=table,
        )
        seqs.append(np.asarray(out.sample.tokens))
        if seed == 0:  # the γ = 2 bucket drafted (every draft comes from it)
            assert np.asarray(out.stats.attempts).sum() > 5000
    cells = np.concatenate(seqs) @ V_SMALL ** np.arange(CHI_K)[::-1]
    counts = np.bincount(cells, minlength=V_SMALL**CHI_K)
    pvalue, dof = _chi2_pvalue(counts, _exact_truncated(pol, scfg, prompt))
    assert dof > 50
    if rule == "broken":
        assert pvalue < 1e-6
    else:
        assert pvalue > 0.01, (rule, pvalue)


# ----------------------------------------------------------------------------- draft length


def test_choose_num_draft_on_known_costs():
    # α = 0.8; a verify over W tokens costs 1 + 0.1 (W - 1) steps, a draft 0.1 step: tokens per
    # step-time 1 (γ=0), 1.8/1.2 = 1.5, 2.44/1.4 = 1.743, 2.952/1.6 = 1.845, 3.3616/1.8 = 1.868.
    t_verify = {w: 1 + 0.1 * (w - 1) for w in range(2, 6)}
    assert compaction.choose_num_draft(0.8, 1.0, t_verify, 0.1, 4) == 4
    assert compaction.choose_num_draft(0.8, 1.0, t_verify, 0.1, 2) == 2
    # α = 0.5 with the same costs: 1, 1.25, 1.25, 1.172 -> γ = 1 (a tie goes to the smaller γ)
    assert compaction.choose_num_draft(0.5, 1.0, t_verify, 0.1, 4) == 1
    # a verify as dear as W steps (a large batch on a CPU): plain decoding wins at any α < 1
    linear = {w: float(w) for w in range(2, 6)}
    assert compaction.choose_num_draft(0.95, 1.0, linear, 0.05, 4) == 0
    # Keeping the γ in use: α = 0.5 gives 1, 1.25, 1.25, 1.172 for γ = 0..3.
    assert compaction.choose_num_draft(0.5, 1.0, t_verify, 0.1, 4, current=2, margin=0.05) == 2
    assert compaction.choose_num_draft(0.5, 1.0, t_verify, 0.1, 3, current=3, margin=0.05) == 1
    assert compaction.choose_num_draft(0.5, 1.0, t_verify, 0.1, 3, current=3, margin=0.07) == 3
    assert compaction.choose_num_draft(0.5, 1.0, t_verify, 0.1, 3, current=0, margin=0.2) == 1
    assert compaction.choose_num_draft(0.5, 1.0, t_verify, 0.1, 3, current=0, margin=0.3) == 0
    # a γ in use beyond max_draft (a table from a larger num_draft) is not kept
    assert compaction.choose_num_draft(0.5, 1.0, t_verify, 0.1, 2, current=3, margin=0.3) == 1
    assert compaction.expected_tokens(1.0, 3) == 4.0
    assert compaction.expected_tokens(0.5, 2) == pytest.approx(1.75)
    costs = {
        64: {"step": 1.0, "draft": 0.05, **{f"verify_{w}": t for w, t in linear.items()}},
        4: {"step": 1.0, "draft": 0.1, **{f"verify_{w}": t for w, t in t_verify.items()}},
    }
    assert compaction.draft_table(0.8, costs, 4) == ((4, 4), (64, 0))
    # 4 rows: γ = 2 in use, γ = 4 is 1.868 / 1.743 = 7.2 % faster: kept at a 10 % margin
    assert compaction.draft_table(0.8, costs, 4, ((4, 2), (64, 0)), 0.1) == ((4, 2), (64, 0))
    assert compaction.draft_table(0.8, costs, 4, ((4, 2), (64, 0)), 0.05) == ((4, 4), (64, 0))


def test_draft_for_batch_and_bucket_sizes():
    table = ((64, 0), (16, 2))
    assert [compaction.draft_for_batch(table, b, 3) for b in (128, 64, 32, 16, 8)] == [
        0,
        0,
        2,
        2,
        3,
    ]
    assert compaction.bucket_sizes(64, 8) == [64, 32, 16, 8]
    assert compaction.bucket_sizes(12, 4) == [12, 6]
    idx = compaction.live_first(np.array([False, True, False, True, False]), 3)
    assert list(idx) == [1, 3, 0]
    with pytest.raises(ValueError, match="do not fit"):
        compaction.live_first(np.ones(4, bool), 2)


@pytest.mark.parametrize(
    "override,key",
    [
        ("rollout.draft_table=((64,),)", "rollout.draft_table"),
        ("rollout.draft_table=((64, -1),)", "rollout.draft_table"),
        ("rollout.draft_table=((8, 1), (8, 2))", "rollout.draft_table"),
        ("rollout.min_bucket=0", "rollout.min_bucket"),
        ("rollout.compact=3", "rollout.compact"),
    ],
)
def test_bad_rollout_compaction_keys_fail_naming_the_key(override, key):
    with pytest.raises(config.ConfigError, match=key.replace(".", r"\.")):
        config.load(str(REPO / "configs/demo.py"), [override])


def test_rollouts_derive_the_draft_table_from_costs_and_the_running_acceptance():
    """`Rollouts`' default draft table (compaction on, `rollout.draft_table` empty) on given
    costs: 8 rows verify cheaply, 16 rows dearly; per-position acceptance over the last 4
    rollouts. Expected tokens per unit time by hand (E_γ = 1 + α1 + α1 α2 + α1 α2 α3)."""
    cfg, _ = config.load(str(REPO / "configs/demo.py"), ["rollout.compact=True"])
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, num_draft=3))

    def costs(per_token):  # a verify over W tokens: 1 + per_token (W - 1); a draft: 0.1
        return {
            "step": 1.0,
            "draft": 0.1,
            **{f"verify_{w}": 1 + per_token * (w - 1) for w in (2, 3, 4)},
        }

    ro = rl_rollouts.Rollouts(
        cfg, None, None, CharTokenizer(), None, draft_costs={8: costs(0.1), 16: costs(0.5)}
    )
    assert ro.table == () and ro.acceptance is not None  # the first rollout: γ = 3 everywhere
    # α = 0.8, 0.75, 0.75: E = 1.8, 2.4, 2.85. 8 rows: 1.8/1.2 = 1.5, 2.4/1.4 = 1.71,
    # 2.85/1.6 = 1.78 -> γ = 3; 16 rows: 1.8/1.6 = 1.125, 2.4/2.2 = 1.09, 2.85/2.8 = 1.02 -> 1.
    high = ([100, 80, 60], [80, 60, 45])
    assert ro.update_draft_table(*high) == {"draft_table": [[8, 3], [16, 1]]}
    assert ro.update_draft_table(*high) == {}  # unchanged: nothing to log
    assert ro.table == ((8, 3), (16, 1))
    # Acceptance falls to 0.3, 0.3, 1/3 per rollout; a bucket moves only for a gain above
    # DRAFT_MARGIN (5 %). Window after 1 such rollout: α = 190/300, 129/190, 93/129 (E = 1.633,
    # 2.063, 2.373): 8 rows 1.36, 1.47, 1.48 -> 3 (unchanged); 16 rows 1.02, 0.94, 0.85 -> 1
    # (unchanged). After 2: α = .55, 138/220, 96/138 (E = 1.55, 1.895, 2.135): 8 rows 1.29,
    # 1.354, 1.334 -> γ = 2 best but only 1.4 % over γ = 3, kept; 16 rows 1 (γ = 0) vs 0.969,
    # 3.2 % -> 1 kept. After 3: α = .425, 87/170, 54/87 (E = 1.425, 1.643, 1.778): 8 rows 1.19,
    # 1.17, 1.11 -> 1 (6.9 % over γ = 3); 16 rows 1 vs 0.89 -> 0. After 4, only these: α = .3,
    # .3, 1/3 (E = 1.3, 1.39, 1.42): 8 rows 1.08, 0.99, 0.89 -> 1; 16 rows 0.81 -> 0 (unchanged).
    assert rl_rollouts.DRAFT_MARGIN == 0.05
    low = ([100, 30, 9], [30, 9, 3])
    logged = [ro.update_draft_table(*low) for _ in range(4)]
    assert logged == [{}, {}, {"draft_table": [[8, 1], [16, 0]]}, {}]
    # Only γ <= 1 drafts for 4 rollouts: positions 2 and 3 keep their last estimates.
    for _ in range(4):
        ro.update_draft_table([100, 0, 0], [50, 0, 0])
    assert ro.acceptance.rates() == pytest.approx([0.5, 0.3, 1 / 3])
    assert compaction.expected_tokens([0.8, 0.75], 3) == pytest.approx(2.85)


# ----------------------------------------------------------------------------- prompt groups

# GRPO's layout: 4 prompts of different lengths, each repeated over a run of 4 rows.
GROUPED = [p for p in PROMPTS[:4] for _ in range(4)]


def _grouped(scfg, group=4):
    return dataclasses.replace(scfg, prompt_group=group)


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["plain", "speculative", "compacted"])
def test_prompt_groups_prefill_once_and_sample_the_same(sampler):
    """`prompt_group`: the prefill runs once per run of identical prompts; every output (stats,
    recorded hiddens and cycle lengths too) equals the ungrouped sampler's for the same keys.
    A random policy (its attention reads the copied caches) and random MTPs: the static loop
    with 2 MTP layers, and the compacted driver whose first bucket drafts nothing, so the MTP
    first reads its copied cache (and rewrites slot P_b-1) in `regamma`."""
    pol, mtp = _models("random", 2 if sampler == "speculative" else 1)
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=N, eos_ids=RANDOM_EOS)
    toks, lens = sampling.pad_prompts(GROUPED)
    key = jax.random.key(3)
    if sampler == "plain":
        run = lambda c: sampling.sample_jit(*pol, toks, lens, key, c)  # noqa: E731
    elif sampler == "speculative":
        spec = SpecConfig(3, "rejection", record=True)
        run = lambda c: speculative.sample_jit(*pol, *mtp, toks, lens, key, c, spec)  # noqa: E731
    else:
        spec, table = SpecConfig(3, "target_only"), ((16, 0), (8, 3), (4, 1))
        run = lambda c: spec_compacted.sample_compacted(  # noqa: E731
            *pol, *mtp, toks, lens, key, c, spec, min_bucket=4, draft_table=table
        )
    ref = jax.device_get(run(scfg))
    # floats to the rounding of a 4-row against a 16-row prefill (1 of the 20,480 recorded
    # hidden values of the speculative case differs by 1.3e-5; every token is the same)
    _assert_same(run(_grouped(scfg)), ref, tol=1e-4)
    if sampler != "plain":
        assert 0 < ref.stats.accepts.sum() < ref.stats.attempts.sum()
        ref = ref.sample
    # the loop ran past its first bucket: at least half the rows ended before the longest
    assert (ref.lengths < ref.lengths.max()).sum() >= 8, ref.lengths
    # each row still draws from its own key: the rows of a run sampled different responses
    assert all(len({tuple(r) for r in ref.tokens[i : i + 4]}) > 1 for i in range(0, 16, 4))


def test_prompt_groups_cut_the_prefills_work():
    """XLA's cost analysis of the compiled set-up (prefill and initial state) of both samplers:
    runs of 4 identical prompts cost at most 0.3x the floating-point work of 16 prefills."""
    pol, mtp = _models("agrees_often")
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=N, eos_ids=EOS)
    toks, lens = sampling.pad_prompts(GROUPED)
    layers = model.decode_layers_jit(*pol)
    spec = SpecConfig(3, "rejection")

    def flops(lowered):
        cost = lowered.compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    for group in (1, 4):
        c = _grouped(scfg, group)
        plain = sampling._init_jit.lower(*pol, toks, lens, jax.random.key(0), c, layers)
        speculative_ = spec_compacted._init_jit.lower(
            *pol, *mtp, None, layers, toks, lens, jax.random.key(0), c, spec, False, 3, 0
        )
        if group == 1:
            full = flops(plain), flops(speculative_)
        else:
            assert flops(plain) <= 0.3 * full[0], (flops(plain), full[0])
            assert flops(speculative_) <= 0.3 * full[1], (flops(speculative_), full[1])


def test_prompt_groups_are_checked_and_rollouts_use_them():
    toks, lens = sampling.pad_prompts(GROUPED)
    sampling.check_prompt_groups(toks, lens, 4)  # runs of 4: fine
    with pytest.raises(ValueError, match="prompt row 4 differs from row 0"):
        sampling.check_prompt_groups(toks, lens, 8)
    with pytest.raises(ValueError, match="16 prompt rows are not runs of 3"):
        sampling.check_prompt_groups(toks, lens, 3)
    with pytest.raises(ValueError, match="prompt_group=0 must be >= 1"):
        sampling.SamplingConfig(prompt_group=0)
    # `Rollouts` prefills once per GRPO group where it hands the sampler host arrays: one
    # device, or compaction on; not when the rows are laid out over several devices
    mesh = sharding.make_mesh(config.MeshConfig(data=2), jax.devices()[:2])
    for compact, mesh_, group in ((False, None, 8), (False, mesh, 1), (True, mesh, 8)):
        cfg, _ = config.load(str(REPO / "configs/demo.py"), [f"rollout.compact={compact}"])
        ro = rl_rollouts.Rollouts(cfg, None, None, CharTokenizer(), None, mesh=mesh_)
        assert ro.scfg.prompt_group == group, (compact, mesh_)


def test_rollout_speedup_alternates_the_samplers_and_takes_each_ones_best(monkeypatch):
    """`rl_rollouts.rollout_speedup` on scripted timings: one compiling call of each, then plain and
    speculative alternate; each is its best (seconds, tokens) call after the first."""
    cfg, _ = config.load(str(REPO / "configs/demo.py"), ["rl.speedup_repeats=3"])
    ro = rl_rollouts.Rollouts(cfg, None, None, CharTokenizer(), tasks.make_task(cfg.task))
    calls = []
    scripted = {  # per sampler: (seconds, tokens) of calls 0 (compiles), 1, 2, 3
        "plain": [(9.0, 100), (2.0, 100), (1.0, 120), (1.5, 100)],
        "spec": [(9.0, 100), (0.5, 90), (0.8, 100), (0.4, 80)],
    }

    def fake(rollouts, pol, mtp, toks, lens, spec, rep):
        name = "plain" if spec is None else "spec"
        assert len(toks) == 128 and rep == len([c for c in calls if c[0] == name])
        calls.append((name, rep))
        return scripted[name][rep]

    monkeypatch.setattr(rl_rollouts, "_timed_rollout", fake)
    res = rl_rollouts.rollout_speedup(ro, None, None, cfg.rl.speedup_repeats)
    assert calls == [(n, r) for r in range(4) for n in ("plain", "spec")]
    assert res["plain_s"] == 1.0 and res["plain_tok_s"] == 120.0
    assert res["spec_s"] == 0.4 and res["spec_tok_s"] == 200.0
    assert res["speedup"] == pytest.approx(200.0 / 120.0) and res["batch"] == 128


def test_a_derived_table_that_drafts_nowhere_is_probed_and_can_draft_again():
    """Acceptance so low that no bucket drafts: the rollouts that follow attempt nothing, so the
    running acceptance cannot move; after `DRAFT_PROBE_EVERY` of them one rollout drafts
    `num_draft` everywhere, and what it measures (now high) brings drafting back."""
    cfg, _ = config.load(str(REPO / "configs/demo.py"), ["rollout.compact=True"])
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, num_draft=3))
    dear = {"step": 1.0, "draft": 0.1, **{f"verify_{w}": 1 + 0.5 * (w - 1) for w in (2, 3, 4)}}
    ro = rl_rollouts.Rollouts(
        cfg, None, None, CharTokenizer(), None, draft_costs={8: dear, 16: dear}
    )
    # α = 0.05, 0, 0: E_1 = 1.05 per 1.6 steps < 1 token a step -> γ = 0 at both sizes
    assert ro.update_draft_table([100, 10, 1], [5, 0, 0]) == {"draft_table": [[8, 0], [16, 0]]}
    assert rl_rollouts.DRAFT_PROBE_EVERY == 16
    logged = [ro.update_draft_table([0, 0, 0], [0, 0, 0]) for _ in range(16)]
    assert logged[:15] == [{}] * 15
    assert logged[15] == {"draft_table": [[8, 3], [16, 3]]}  # the probe
    # The probe measures α = 0.8, 0.75, 0.75 (E = 1.8, 2.4, 2.85 over 1.6, 2.2, 2.8 steps:
    # 1.125, 1.09, 1.02 tokens a step): γ = 1 is 10.5 % faster than the probe's γ = 3.
    assert ro.update_draft_table([100, 80, 60], [80, 60, 45]) == {"draft_table": [[8, 1], [16, 1]]}
