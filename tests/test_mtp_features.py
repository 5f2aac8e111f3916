"""An MTP that reads several backbone layers (`mtp.features`, EAGLE-3 style fusion) and runs several
blocks per draft step (`mtp.depth`): its logits against a reference built from per-layer hiddens,
the sampler's catch-up state against a fresh forward (after rejections, compaction and a change
of γ), losslessness (chi-square), GrowMTP's recorded features, the HF round trip, the config
checks, and the default MTP's unchanged parameters and layout."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bebop import compaction, model, sampling, sharding, spec_compacted, speculative
from bebop import mtp as mtp_lib
from bebop.checkpoints import hf, names
from bebop.config import ConfigError, MeshConfig, ModelConfig, MTPConfig, RunConfig, from_dict
from bebop.mtp_losses import mtp_loss
from bebop.rl import learner, loop
from bebop.speculative import SpecConfig

from .test_speculative import SMALL, _broken_rule, _chi2_pvalue, _counts, _exact_joint

CFG = ModelConfig(
    vocab_size=16,
    dim=16,
    num_layers=4,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    ffw_dim=32,
    init_std=0.3,
    qk_norm=True,
)
FEATURES = (0, 2, 3)  # layers i, j, k of a 4-layer policy (the last among them)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 16, (2, 9)))


def _pol(cfg=CFG, seed=0):
    return model.init(cfg, seed)


def _mtp(cfg=CFG, n=2, features=FEATURES, depth=2, seed=1):
    return mtp_lib.init(dataclasses.replace(cfg, init_std=0.3), n, seed, features, depth)


def _layer_hiddens(pol, tokens_BxT):
    """Every decoder layer's output from full forwards of the policy cut after it: `[L, B, T, D]`
    (independent of `run_blocks(collect=...)`)."""
    cfg = model.graphdef_config(*pol)
    pos = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
    out = []
    for i in range(cfg.num_layers):
        cut = dataclasses.replace(cfg, num_layers=i + 1)
        params = jax.tree.map(lambda a: a, pol[1])
        params["layers"] = jax.tree.map(lambda a, i=i: a[: i + 1], params["layers"])
        out.append(model.forward(model.abstract(cut)[0], params, tokens_BxT, pos)[1])
    return jnp.stack(out)


def _reference_step1(pol, mtp, tokens_BxT, features=FEATURES):
    """Draft-1 logits `[B, T, V]` at every anchor t (token t+1 fed), by hand from the per-layer
    hiddens: concatenate the feature layers, fuse with `fc_features`, then MTP layer 0's norms,
    `W_fc` and blocks (full causal passes, no cache), output norm and the policy's head."""
    policy, m = nnx.merge(*pol), nnx.merge(*mtp)
    hid_LxBxTxD = _layer_hiddens(pol, tokens_BxT)
    feats = jnp.concatenate([hid_LxBxTxD[i] for i in features], axis=-1)
    fused = feats @ m.fc_features[...]
    layer = m.layer(0)
    b, t = tokens_BxT.shape
    nxt = jnp.pad(tokens_BxT[:, 1:], ((0, 0), (0, 1)))
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    x = jnp.concatenate([layer.emb_norm(policy.embed_tokens(nxt)), layer.hid_norm(fused)], -1)
    x = x @ layer.w_fc[...]
    for block in [layer.block, layer.block_1]:
        x, _ = block(x, pos)
    return policy.head(layer.out_norm(x))


# ----------------------------------------------------------------------------- draft logits


@pytest.mark.parametrize("scan", [True, False, "remat"])
def test_draft_logits_from_layers_i_j_k_equal_a_per_layer_reference(scan):
    """Features from layers (0, 2, 3), depth 2, float32: the policy's forward returns exactly the
    cut forwards' layer outputs (scanned, unrolled, rematerialised), and the draft's logits --
    training's teacher-forced step 1 and the sampler's first draft (prefill + catch-up) -- equal
    the reference built from them to 1e-5."""
    cfg = dataclasses.replace(
        CFG, scan_layers=scan is not False, remat="block" if scan == "remat" else "none"
    )
    pol = (model.abstract(cfg)[0], _pol()[1])
    mtp = _mtp()
    ref_hid = _layer_hiddens(pol, TOKENS)
    pos = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
    hidden, feats, _ = nnx.merge(*pol).hidden_features(TOKENS, pos, features=FEATURES)
    np.testing.assert_allclose(hidden, ref_hid[-1], atol=1e-6)
    want = jnp.concatenate([ref_hid[i] for i in FEATURES], -1)
    np.testing.assert_allclose(feats, want, atol=1e-6)

    ref = _reference_step1(pol, mtp, TOKENS)
    normed = mtp_lib.train_hidden(*mtp, *pol, TOKENS, feats, 2)[0]
    np.testing.assert_allclose(nnx.merge(*pol).head(normed), ref, atol=1e-5)

    # the sampler: prefill (features of the prompt) and the first catch-up's draft-1 logits
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=4, eos_ids=(-1,))
    prompt, p = TOKENS[:, :6], 6
    m = speculative.make_models(*pol, *mtp, None, None, scfg, SpecConfig(3), p + 4 + 3 + 1)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(0), jnp.arange(2))

    @jax.jit
    def first_draft(prompt):
        s = speculative.init_state(m, *pol, prompt, jnp.full((2,), p), keys)
        return s.pending_B, speculative._catch_up(m, s)[1]

    first_B, logits_BxV = first_draft(prompt)
    seq = jnp.concatenate([prompt, first_B[:, None]], axis=1)
    np.testing.assert_allclose(logits_BxV, _reference_step1(pol, mtp, seq)[:, p - 1], atol=1e-5)


# ----------------------------------------------------------------------------- catch-up state


def _rows_seq(prompts, s):
    """Each row's tokens so far (prompt, then what it emitted), right-padded with 0."""
    out = np.asarray(s.out.tokens)
    lengths = np.asarray(s.out.lengths)
    seqs = [list(p) + list(out[b, : lengths[b]]) for b, p in enumerate(prompts)]
    width = max(map(len, seqs)) + 1
    return np.asarray([q + [0] * (width - len(q)) for q in seqs], np.int32)


def _check_catch_up(m, s, pol, mtp, prompts):
    """The sampler's MTP state against a fresh forward of each row's tokens: the catch-up buffer
    holds the fused features of the positions the MTP has not consumed (policy length - n_catch
    .. policy length - 1) and the tokens after them; the MTP cache's entries of the consumed
    positions (every layer, every block) are those of a fresh prefill over the fresh features."""
    seq = _rows_seq(prompts, s)
    b, t = seq.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    _, feats, _ = nnx.merge(*pol).hidden_features(jnp.asarray(seq), pos, features=FEATURES)
    fused = np.asarray(mtp_lib.fuse(nnx.merge(*mtp), feats))
    lp, lm = np.asarray(s.policy_cache.lengths), np.asarray(s.mtp_cache.lengths)
    n_catch, done = np.asarray(s.n_catch_B), np.asarray(s.done_B)
    catch_hid, catch_tok = np.asarray(s.catch_hid_BxWxD), np.asarray(s.catch_tok_BxW)
    checked = 0
    for r in range(b):
        if done[r]:
            continue
        assert lm[r] + n_catch[r] == lp[r]
        for w in range(n_catch[r]):
            np.testing.assert_allclose(catch_hid[r, w], fused[r, lm[r] + w], rtol=1e-5, atol=1e-5)
            assert catch_tok[r, w] == seq[r, lm[r] + w + 1]
            checked += 1
    slots, depth = s.mtp_cache.k[0].shape[2], m.mtp.depth
    fresh = mtp_lib.new_cache(m.mtp.cfg, m.mtp.num_layers, b, slots, depth)
    fused_in, next_in = jnp.asarray(fused[:, :-1]), jnp.asarray(seq[:, 1:])
    for j in range(m.mtp.num_layers):
        fresh = mtp_lib.write_kv(m.mtp, m.policy, j, fresh, fused_in, next_in)
    got, want = (*s.mtp_cache.k, *s.mtp_cache.v), (*fresh.k, *fresh.v)
    for got_SxD, want_SxD in zip(got, want, strict=True):  # every block's keys and values
        for r in range(b):
            if not done[r]:
                sl = np.s_[r, :, : lm[r]]
                np.testing.assert_allclose(
                    np.asarray(got_SxD)[sl], np.asarray(want_SxD)[sl], rtol=1e-5, atol=1e-5
                )
    return checked


@pytest.mark.slow
def test_catch_up_features_equal_a_fresh_forward_after_rejections_and_compaction():
    """A multi-feature, depth-2 MTP of 2 layers, sampled at temperature 1 (a random draft:
    rejections in most cycles). After γ = 2 cycles, after compacting 6 rows to 3 and running
    γ = 0 (the deferred catch-up), and after `regamma` back to γ = 3 and more cycles, the
    catch-up buffer and the MTP caches hold what a fresh forward of each row's tokens gives."""
    pol, mtp = _pol(), _mtp()
    n, max_draft = 40, 3
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=n, eos_ids=(-1,))
    prompts = [[1, 5, 6, 7], [1, 3], [1, 4, 4, 4, 4, 9], [1, 8, 2], [2, 2], [9, 1, 3]]
    toks, lens = sampling.pad_prompts(prompts)
    max_len = toks.shape[1] + n + max_draft + 1

    def models(gamma, sync):
        spec = SpecConfig(gamma)
        return speculative.make_models(
            *pol, *mtp, None, None, scfg, spec, max_len, max_draft=max_draft, sync_mtp=sync
        )

    def cycles(m, s, k):
        step = jax.jit(functools.partial(speculative._cycle, m))
        for _ in range(k):
            s = step(s)
        return s

    m2 = dataclasses.replace(models(2, True), mtp_slack=spec_compacted.CATCH_CHUNK)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(3), jnp.arange(len(prompts)))
    s = jax.jit(lambda t, n: speculative.init_state(m2, *pol, t, n, keys))(toks, lens)
    assert _check_catch_up(m2, s, pol, mtp, prompts) == len(prompts)
    s = cycles(m2, s, 4)
    st = s.stats
    assert int(st.attempts.sum()) > int(st.accepts.sum()) > 0  # rejections and acceptances
    assert _check_catch_up(m2, s, pol, mtp, prompts) > len(prompts)

    idx = np.asarray([4, 1, 3], np.int32)  # compaction: 3 of the 6 rows go on
    s = compaction.gather_rows(s, jnp.asarray(idx))
    kept = [prompts[i] for i in idx]
    width0 = speculative.catch_width(0, True, n, max_draft)
    m0 = models(0, True)
    s = jax.jit(lambda s: spec_compacted.regamma(m0, s, width0))(s)
    s = cycles(m0, s, 5)
    assert int(np.asarray(s.n_catch_B).min()) >= 5  # deferred: the MTP has not consumed them
    assert _check_catch_up(m0, s, pol, mtp, kept) >= 15

    m3 = models(3, True)
    s = jax.jit(lambda s: spec_compacted.regamma(m3, s, 4))(s)
    assert _check_catch_up(m3, s, pol, mtp, kept) >= 3
    s = cycles(m3, s, 3)
    assert _check_catch_up(m3, s, pol, mtp, kept) >= 3


# ----------------------------------------------------------------------------- losslessness

SMALL3 = dataclasses.replace(SMALL, num_layers=3)  # test_speculative's chi-square policy, deeper


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["rejection", "broken"])
def test_lossless_with_a_multi_feature_depth_2_draft(rule, monkeypatch):
    """Chi-square goodness of fit of N = 1e5 samples (4 batches of 25,000 rows) of the first three
    tokens (8^3 cells, expected < 5 pooled) against exact probabilities from full forwards, the
    draft reading layers (0, 2) of a 3-layer policy through `fc_features`, 2 blocks per step,
    γ = 2, temperature 1: rejection sampling passes at p > 0.01; the broken verifier (greedy
    draft tested with q) must fail at p < 1e-6. (The draft features change what is drafted, not
    the verifier: target-only verification's losslessness is `test_speculative.py`'s.)"""
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=3, eos_ids=(-1,))
    pol = model.init(SMALL3, 0)
    mtp = mtp_lib.init(dataclasses.replace(SMALL3, init_std=0.8), 1, 5, (0, 2), 2)
    monkeypatch.setitem(speculative.DRAFT_RULES, "broken", _broken_rule)
    spec = SpecConfig(num_draft=2, rule=rule)
    run = jax.jit(
        lambda t, n, k, c: speculative.sample(*pol, *mtp, t, n, k, c, spec).sample.tokens,
        static_argnums=3,
    )
    pvalue, dof = _chi2_pvalue(_counts(run, scfg), _exact_joint(pol, scfg).ravel())
    assert dof > 50
    if rule == "broken":
        assert pvalue < 1e-6
    else:
        assert pvalue > 0.01, (rule, pvalue)


# ----------------------------------------------------------------------------- GrowMTP


@pytest.mark.slow
def test_growmtp_trains_on_the_features_verification_recorded():
    """A recorded speculative rollout returns the feature layers' outputs verification computed
    (equal to a fresh forward's at every emitted position); the learner hands them to the MTP
    loss (`mtp_batch`), whose value and gradient equal those of the loss that recomputes them
    with one policy forward."""
    pol, mtp = _pol(), _mtp()
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=12, eos_ids=(-1,))
    toks, lens = sampling.pad_prompts([[1, 5, 6, 7], [1, 3, 2, 2]])
    spec = SpecConfig(3, record=True)
    out = speculative.sample_jit(*pol, *mtp, toks, lens, jax.random.key(1), scfg, spec)
    p = 4  # both prompts' length (`pad_prompts` pads them wider)
    tokens = jnp.concatenate([toks[:, :p], out.sample.tokens], axis=1)
    t = tokens.shape[1]
    pos = jnp.broadcast_to(jnp.arange(t), tokens.shape)
    _, feats, _ = nnx.merge(*pol).hidden_features(tokens, pos, features=FEATURES)
    rec_feats, rec_hidden = out.features[:, :t], out.hidden[:, :t]
    assert rec_feats.shape == feats.shape
    # every position but the last (its token is never verified)
    np.testing.assert_allclose(rec_feats[:, :-1], feats[:, :-1], rtol=1e-5, atol=1e-5)

    mask = (jnp.arange(t) >= p).astype(jnp.float32)[None].repeat(2, 0)
    batch = loop.LearnerBatch(
        tokens, mask, mask, jnp.zeros((2,)), out.cycle_len[:, :t], rec_hidden, rec_feats
    )
    recorded = learner.mtp_batch(batch, hidden=True)
    assert recorded.features is rec_feats
    fn = mtp_loss(pol[0], mtp[0], "dca", 3, 8192, 1.0)
    grad = jax.jit(jax.value_and_grad(lambda mp, b: fn(mp, b, None, pol[1])[0]))
    loss_rec, g_rec = grad(mtp[1], recorded)
    loss_new, g_new = grad(mtp[1], learner.mtp_batch(batch, hidden=False))
    assert np.isfinite(float(loss_rec)) and float(loss_rec) == pytest.approx(float(loss_new), 1e-5)
    for a, b in zip(jax.tree.leaves(g_rec), jax.tree.leaves(g_new), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert float(jnp.abs(g_rec["fc_features"].get_value()).max()) > 0  # the fusion trains


# ----------------------------------------------------------------------------- HF round trip


def _mesh():
    return sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])


@pytest.mark.parametrize("fmt,n", [("qwen3_5", 1), ("deepseek_v3", 2), ("mimo", 2)])
def test_export_import_round_trip_keeps_the_drafts_outputs(fmt, n, tmp_path):
    """Export (policy + an MTP reading layers (0, 2, 3), depth 2) and import: the documented
    tensor names and `bebop_mtp` entry are written, the loader rebuilds the same MTP
    (features, depth, every parameter) and its draft logits equal the original's."""
    pol, mtp = _pol(), _mtp(n=n)
    hf.export(tmp_path, CFG, pol[1], "qwen3", mtp[1], fmt, mtp_features=FEATURES)
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert hf_cfg["bebop_mtp"] == {"features": list(FEATURES), "depth": 2}
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "np") as f:
        names = set(f.keys())
    want = {
        "qwen3_5": ["mtp.fc_features.weight", "mtp.layers.0.mlp.down_proj.weight"],
        "deepseek_v3": [
            "model.layers.4.fc_features.weight",
            "model.layers.5.blocks.1.mlp.up_proj.weight",
        ],
        "mimo": [
            "model.mtp_layers.0.fc_features.weight",
            "model.mtp_layers.1.blocks.1.mlp.up_proj.weight",
        ],
    }[fmt]
    assert set(want) <= names
    if fmt == "qwen3_5":
        assert "mtp.layers.1.self_attn.q_proj.weight" in names  # the second block
    with safe_open(tmp_path / "model.safetensors", "np") as f:
        assert f.get_tensor(want[0]).shape == (CFG.dim, len(FEATURES) * CFG.dim)

    loaded = hf.load(tmp_path, _mesh())
    got = nnx.merge(*loaded.mtp)
    assert (loaded.mtp_format, got.features, got.depth, got.num_layers) == (fmt, FEATURES, 2, n)
    for a, b in zip(jax.tree.leaves(mtp[1]), jax.tree.leaves(loaded.mtp[1]), strict=True):
        np.testing.assert_array_equal(a, b)
    pos = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)

    def draft_logits(p, m):
        _, feats, _ = nnx.merge(*p).hidden_features(TOKENS, pos, features=FEATURES)
        normed_YxBxTxD = mtp_lib.train_hidden(*m, *p, TOKENS, feats, 3)
        return nnx.merge(*p).head(normed_YxBxTxD.reshape((-1,) + normed_YxBxTxD.shape[2:]))

    want_logits = draft_logits(pol, mtp)
    got_logits = draft_logits((loaded.graphdef, loaded.params), loaded.mtp)
    np.testing.assert_allclose(got_logits, want_logits, atol=1e-5)


def test_a_checkpoint_without_the_features_entry_refuses_the_fusion_tensor(tmp_path):
    """The loader builds the MTP config.json describes: a fusion tensor without `bebop_mtp` is an
    unexpected tensor, a `bebop_mtp` naming a layer the policy lacks an error naming it."""
    pol, mtp = _pol(), _mtp(n=1)
    hf.export(tmp_path, CFG, pol[1], "qwen3", mtp[1], "qwen3_5", mtp_features=FEATURES)
    path = tmp_path / "config.json"
    hf_cfg = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in hf_cfg.items() if k != "bebop_mtp"}))
    with pytest.raises(hf.CheckpointError, match="unexpected tensor"):
        hf.load(tmp_path, _mesh())
    path.write_text(json.dumps({**hf_cfg, "bebop_mtp": {"features": [0, 7], "depth": 2}}))
    with pytest.raises(hf.CheckpointError, match="bebop_mtp.features"):
        hf.load(tmp_path, _mesh())
    with pytest.raises(ValueError, match="fc_features"):  # features that do not fit the params
        hf.export(tmp_path / "x", CFG, pol[1], "qwen3", mtp[1], "qwen3_5", mtp_features=(1, 3))


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "features,why",
    [
        ((), "at least one"),
        ((0, 4), "in \\[-4, 4\\)"),
        ((2, 1), "sorted"),
        ((1, 1), "distinct"),
        ((3, -1), "distinct"),
    ],
)
def test_bad_features_are_config_errors_naming_the_key(features, why):
    cfg = from_dict(RunConfig, {"model": dataclasses.asdict(CFG), "mtp": {"features": features}})
    with pytest.raises(ConfigError, match=f"'mtp.features'.*{why}"):
        cfg.validate()
    with pytest.raises(ConfigError, match=f"'mtp.features'.*{why}"):
        mtp_lib.abstract(CFG, 1, features)
    with pytest.raises(ConfigError, match="'mtp.depth'"):
        MTPConfig(depth=0).validate()


def test_an_hf_policy_checks_features_when_the_mtp_is_built(tmp_path):
    """A Hugging Face policy's depth is known at load time: `mtp.features` past it fails there,
    naming the key; the policy cut to `policy.num_layers` is checked at validation."""
    cfg = from_dict(
        RunConfig, {"policy": {"source": "hf", "path": "x"}, "mtp": {"features": [0, 30]}}
    )
    cfg.validate()  # the depth is not known yet
    with pytest.raises(ConfigError, match="'mtp.features'"):
        mtp_lib.init(CFG, 1, 0, cfg.mtp.features)
    cut = from_dict(
        RunConfig,
        {"policy": {"source": "hf", "path": "x", "num_layers": 4}, "mtp": {"features": [0, 30]}},
    )
    with pytest.raises(ConfigError, match="'mtp.features'"):
        cut.validate()


# ----------------------------------------------------------------------------- the default


def test_the_default_mtp_keeps_its_parameters_layout_and_path(tmp_path):
    """`mtp.features` = (-1,), `mtp.depth` = 1 (the defaults): the MTP's parameter tree is the
    plain MTP's (no `fc_features`, one `block`), the same draws as naming the last layer
    explicitly, no layer is collected (the features are the last hidden itself), the sampler
    records no features, and the HF export writes exactly the published Qwen3.5 names and no
    `bebop_mtp` entry."""
    assert (MTPConfig().features, MTPConfig().depth) == ((-1,), 1)
    gd, params = mtp_lib.init(CFG, 1, 5)
    shapes = {
        "/".join(str(getattr(k, "key", k)) for k in path): tuple(v.shape)
        for path, v in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]
    }
    d, f, h, kv, dh = CFG.dim, CFG.ffw_dim, CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
    assert shapes == {
        "layers/block/attn/k_norm/scale": (1, dh),
        "layers/block/attn/q_norm/scale": (1, dh),
        "layers/block/attn/wk": (1, d, kv, dh),
        "layers/block/attn/wo": (1, h, dh, d),
        "layers/block/attn/wq": (1, d, h, dh),
        "layers/block/attn/wv": (1, d, kv, dh),
        "layers/block/attn_norm/scale": (1, d),
        "layers/block/mlp/w_down": (1, f, d),
        "layers/block/mlp/w_gate": (1, d, f),
        "layers/block/mlp/w_up": (1, d, f),
        "layers/block/mlp_norm/scale": (1, d),
        "layers/emb_norm/scale": (1, d),
        "layers/hid_norm/scale": (1, d),
        "layers/out_norm/scale": (1, d),
        "layers/w_fc": (1, 2 * d, d),
    }
    explicit = mtp_lib.init(CFG, 1, 5, (CFG.num_layers - 1,), 1)[1]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(explicit), strict=True):
        np.testing.assert_array_equal(a, b)
    m = nnx.merge(gd, params)
    assert m.features == (3,) and not mtp_lib.fused(m) and mtp_lib.collected(m) is None

    pol = _pol()
    pos = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
    hidden, feats, _ = nnx.merge(*pol).hidden_features(TOKENS, pos, features=m.features)
    assert feats is hidden
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=6, eos_ids=(-1,))
    toks, lens = sampling.pad_prompts([[1, 2, 3]])
    out = speculative.sample_jit(
        *pol, gd, params, toks, lens, jax.random.key(0), scfg, SpecConfig(2, record=True)
    )
    assert out.features is None and out.hidden is not None

    hf.export(tmp_path, CFG, pol[1], "qwen3", params, "qwen3_5")
    assert "bebop_mtp" not in json.loads((tmp_path / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "np") as f:
        mtp_names = {k for k in f.keys() if k.startswith("mtp.")}
    block = {"mtp.layers.0." + n for n, _ in names.DECODER_LAYER.values() if "bias" not in n}
    top = {"fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"}
    assert mtp_names == block | {f"mtp.{n}.weight" for n in top}


def test_last_layer_init_with_features_and_depth_drafts_like_the_plain_one():
    """`mtp.init = last_layer` with features (0, 3) and depth 2: `fc_features` passes the last
    layer through and the second block is the identity (zero output projections), so the draft's
    logits are those of the plain last-layer-initialised MTP (same seed: same `W_fc` draws)."""
    pol = _pol()
    plain = mtp_lib.init(CFG, 1, 7)
    rich = mtp_lib.init(CFG, 1, 7, (0, 3), 2)
    plain = (plain[0], mtp_lib.init_from_last_layer(plain[1], pol[1]))
    rich = (rich[0], mtp_lib.init_from_last_layer(rich[1], pol[1]))
    pos = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
    hidden, feats, _ = nnx.merge(*pol).hidden_features(TOKENS, pos, features=(0, 3))
    want = mtp_lib.train_hidden(*plain, *pol, TOKENS, hidden, 2)
    got = mtp_lib.train_hidden(*rich, *pol, TOKENS, feats, 2)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert float(jnp.abs(nnx.merge(*rich).layers.block_1.attn.wq[...]).max()) > 0
