"""MTP training: no gradient reaches the policy, the backbone stays bitwise frozen, and the
train-time forward agrees with decode-time drafting on step 1."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bebop import model, sampling, sharding, speculative
from bebop import mtp as mtp_lib
from bebop.config import MeshConfig, OptimConfig
from bebop.fit import PREEMPTED, Preempted
from bebop.mtp_losses import MTP_LOSSES, MTPBatch, mtp_loss
from bebop.stages import distill
from bebop.stages.mtp import (
    cached_target,
    load_draft_vocab,
    patience_stop,
    policy_hiddens,
    select_draft_vocab,
)
from bebop.train import TrainState, make_optimizer, make_train_step

from .helpers import perturb, random_policy


@pytest.fixture
def setup(tiny_cfg):
    pol_gd, pol_params = random_policy(tiny_cfg, 0)
    mtp_gd, mtp_params = mtp_lib.init(tiny_cfg, 2, seed=1)
    rng = np.random.default_rng(0)
    batch = MTPBatch(
        tokens=jnp.asarray(rng.integers(0, tiny_cfg.vocab_size, (3, 12)), jnp.int32),
        mask=jnp.asarray((rng.random((3, 12)) < 0.8).astype(np.float32)),
    )
    return pol_gd, mtp_gd, mtp_params, pol_params, batch


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MTP_LOSSES))
def test_no_gradient_reaches_the_policy(setup, name):
    pol_gd, mtp_gd, mtp_params, pol_params, batch = setup
    fn = mtp_loss(pol_gd, mtp_gd, name, train_steps=3, chunk=8, temperature=1.0)

    def loss(mp, pp):
        return fn(mp, batch, None, pp)[0]

    g_mtp, g_pol = jax.grad(loss, argnums=(0, 1))(mtp_params, pol_params)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(g_pol))
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_mtp)) > 0.0


def test_draft_vocabulary_is_the_most_frequent_supervised_tokens_plus_eos():
    tokens = np.array([[5, 5, 5, 7, 7, 3, 9, 9, 9, 9], [1, 1, 1, 1, 1, 1, 7, 3, 0, 0]])
    mask = np.array([[1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]])
    # supervised counts: 9 x4, 5 x3, 7 x3, 3 x2, 0 x2 (a tie: the lower id wins); token 1
    # (6 times) is only in the unsupervised prompt
    np.testing.assert_array_equal(select_draft_vocab(tokens, mask, 3, (2,), 12), [2, 5, 9])
    np.testing.assert_array_equal(select_draft_vocab(tokens, mask, 5, (2,), 12), [0, 2, 5, 7, 9])
    np.testing.assert_array_equal(select_draft_vocab(tokens, mask, 4, (), 12), [0, 5, 7, 9])
    with pytest.raises(ValueError, match="mtp.draft_vocab=13"):
        select_draft_vocab(tokens, mask, 13, (2,), 12)


@pytest.mark.parametrize(
    "bad", [np.array([3, 3, 5]), np.array([[1, 2]]), np.array([1.0, 2.0]), np.array([4, 99])]
)
def test_a_corrupt_draft_vocabulary_file_is_refused(tmp_path, bad):
    np.save(tmp_path / "draft_vocab.npy", bad)
    with pytest.raises(ValueError, match="draft_vocab.npy: not a draft vocabulary"):
        load_draft_vocab(tmp_path, vocab_size=23)
    np.save(tmp_path / "draft_vocab.npy", np.array([7, 2, 11]))
    np.testing.assert_array_equal(load_draft_vocab(tmp_path, vocab_size=23), [7, 2, 11])
    assert load_draft_vocab(tmp_path / "missing") is None


def test_draft_vocabulary_mtp_loss_trains_only_the_mtp(setup):
    pol_gd, mtp_gd, mtp_params, pol_params, batch = setup
    fn = mtp_loss(pol_gd, mtp_gd, "e2e_tv", 3, 4, 1.0, vocab=np.array([0, 2, 5, 7, 11]))
    g_mtp, g_pol = jax.grad(lambda mp, pp: fn(mp, batch, None, pp)[0], argnums=(0, 1))(
        mtp_params, pol_params
    )
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(g_pol))
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_mtp)) > 0.0


@pytest.mark.slow
@pytest.mark.parametrize(
    "vocab, temperature, cut",
    [
        (None, 1.0, {}),
        (np.array([0, 2, 5, 7, 11]), 0.7, {}),
        (np.array([0, 2, 5, 7, 11]), 0.7, {"top_k": 9, "top_p": 0.8}),
    ],
    ids=["full", "vocab", "vocab-truncated"],
)
def test_cached_hiddens_and_normalisers_give_the_same_loss_and_gradient(
    setup, vocab, temperature, cut
):
    """`mtp.cache_hidden`: hiddens and the target's full-vocabulary normalisers (with the
    sampler's truncation: its support floor and the normaliser over its support) computed once
    (batches of 2, the last one padded) give the loss and gradient of computing them per step."""
    pol_gd, mtp_gd, mtp_params, pol_params, batch = setup
    fn = mtp_loss(pol_gd, mtp_gd, "e2e_tv", 3, 8, temperature, vocab=vocab, **cut)
    tokens = np.asarray(batch.tokens)
    hiddens, stats, feats = policy_hiddens(pol_gd, pol_params, tokens, 2, temperature, **cut)
    assert feats is None  # the default MTP reads the last hidden state only
    assert hiddens.shape == (*tokens.shape, 32)
    assert sorted(stats) == sorted(["target_lse"] + ["target_floor", "target_lse_kept"] * bool(cut))
    assert all(v.shape == tokens.shape for v in stats.values())
    # the normaliser is the policy's own: log Σ_v exp(logits / T) over all 23 tokens
    logits = model.forward(pol_gd, pol_params, tokens, np.broadcast_to(np.arange(12), (3, 12)))
    want = jax.scipy.special.logsumexp(logits[0] / temperature, axis=-1)
    np.testing.assert_allclose(stats["target_lse"], want, atol=1e-5)
    if cut:  # over the sampler's support: the tokens `process_logits` keeps, 9 of 23 at most
        scfg = sampling.SamplingConfig(temperature=temperature, **cut)
        kept = np.isfinite(np.asarray(sampling.process_logits(logits[0], scfg)))
        z = np.asarray(logits[0] / temperature)
        np.testing.assert_array_equal(z >= stats["target_floor"][..., None], kept)
        want = jax.scipy.special.logsumexp(np.where(kept, z, -np.inf), axis=-1)
        np.testing.assert_allclose(stats["target_lse_kept"], want, atol=1e-5)
        assert 1 <= kept.sum(-1).min() and kept.sum(-1).max() <= 9
    # split over a mesh (each device computes its share of each batch, then gathered): the same
    mesh = sharding.make_mesh(MeshConfig(data=2), jax.devices()[:2])
    rows = sharding.process_rows(mesh, 2)
    split = policy_hiddens(pol_gd, pol_params, tokens, 2, temperature, mesh, rows, **cut)
    np.testing.assert_allclose(split[0], hiddens, atol=1e-5)
    for k, v in stats.items():
        np.testing.assert_allclose(split[1][k], v, atol=1e-5)
    cached = batch.replace(hidden=hiddens, **stats)
    (l0, _), g0 = jax.value_and_grad(fn, has_aux=True)(mtp_params, batch, None, pol_params)
    (l1, _), g1 = jax.value_and_grad(fn, has_aux=True)(mtp_params, cached, None, pol_params)
    np.testing.assert_allclose(l0, l1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_cached_target_is_reused_only_for_the_same_tokens_policy_and_temperature(setup, tmp_path):
    """The on-disk target cache (`cached_target`) is read back for the same distill tokens, policy
    weights, T and truncation, and recomputed -- never reused -- when any of them changes."""
    pol_gd, _, _, params, batch = setup
    tokens = np.asarray(batch.tokens)
    first = cached_target(tmp_path, pol_gd, params, tokens, 2, 1.0)
    again = cached_target(tmp_path, pol_gd, params, tokens, 2, 1.0)
    assert isinstance(again["hidden"], np.memmap)  # read from disk, not recomputed
    np.testing.assert_array_equal(again["hidden"], first["hidden"])
    np.testing.assert_array_equal(again["target_lse"], first["target_lse"])
    other = jax.tree.map(lambda a: a * 1.01, params)
    changed = {
        "policy": cached_target(tmp_path, pol_gd, other, tokens, 2, 1.0),
        "tokens": cached_target(tmp_path, pol_gd, params, (tokens + 1) % 23, 2, 1.0),
    }
    for name, got in changed.items():
        assert not isinstance(got["hidden"], np.memmap), name
        assert np.abs(got["hidden"] - first["hidden"]).max() > 1e-4, name
    hot = cached_target(tmp_path, pol_gd, params, tokens, 2, 0.5)  # its own directory
    assert not isinstance(hot["hidden"], np.memmap)
    assert np.abs(hot["target_lse"] - first["target_lse"]).max() > 1e-3
    cut = cached_target(tmp_path, pol_gd, params, tokens, 2, 1.0, top_k=4)  # its own too
    assert not isinstance(cut["hidden"], np.memmap) and "target_floor" in cut
    again = cached_target(tmp_path, pol_gd, params, tokens, 2, 1.0, top_k=4)
    assert isinstance(again["target_floor"], np.memmap)
    np.testing.assert_array_equal(again["target_lse_kept"], cut["target_lse_kept"])
    want = ["target_T0.5", "target_T1", "target_T1_k4_p1"]
    assert sorted(d.name for d in tmp_path.iterdir()) == want


@pytest.mark.slow
def test_mtp_initialised_from_the_last_backbone_layer(tiny_cfg):
    """`mtp.init=last_layer`: each MTP block is the policy's last block, W_fc's hidden half is the
    identity, the output norm is the final norm; so at step 0 the MTP layer computes
    out_norm(Block_last(emb_norm(e) W_e + hid_norm(h)))."""
    cfg = dataclasses.replace(tiny_cfg, init_std=0.3)
    pol_gd, pol_params = model.init(cfg, 0)
    mtp_gd, mtp_params = mtp_lib.init(cfg, 2, seed=1)
    init = mtp_lib.init_from_last_layer(mtp_params, pol_params)
    policy, mtp = nnx.merge(pol_gd, pol_params), nnx.merge(mtp_gd, init)
    last = model.unstack(policy.layers)[-1]
    block_gd = nnx.split(policy.layers)[0]
    rng = np.random.default_rng(0)
    emb = jnp.asarray(rng.normal(size=(2, 5, 32)), jnp.float32)
    hid = jnp.asarray(rng.normal(size=(2, 5, 32)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    for i in range(2):
        layer = mtp.layer(i)
        w_e = layer.w_fc[...][:32]
        np.testing.assert_array_equal(layer.w_fc[...][32:], np.eye(32))
        np.testing.assert_array_equal(w_e, mtp_params["layers"]["w_fc"][...][i, :32])
        x = layer.emb_norm(emb) @ w_e + layer.hid_norm(hid)
        want = policy.final_norm(nnx.merge(block_gd, last)(x, pos)[0])
        _, got, _ = layer(emb, hid, pos)
        np.testing.assert_allclose(got, want, atol=1e-5)
    # the random init differs: the copy is what makes the outputs agree
    _, rand_out, _ = nnx.merge(mtp_gd, mtp_params).layer(0)(emb, hid, pos)
    assert float(jnp.abs(rand_out - want).max()) > 0.1


@pytest.mark.slow
def test_random_init_is_the_eager_draws_compiled_once_per_shape(tiny_cfg):
    """`mtp.init` draws the parameters of an eagerly built `MTP` (same keys, same std) in one
    compiled program, whatever the seed: equal up to the rounding of the std scaling (a few
    float32 ulps, < 1e-6 relative; a different draw differs by O(1))."""
    cfg = dataclasses.replace(tiny_cfg, init_std=0.05)
    for n, seed in ((1, 3), (2, 7)):
        ref_gd, ref = nnx.split(mtp_lib.MTP(cfg, n, nnx.Rngs(params=seed)))
        gd, got = mtp_lib.init(cfg, n, seed)
        assert gd == ref_gd
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
    before = mtp_lib._init_params._cache_size()
    other = mtp_lib.init(cfg, 2, 8)[1]  # a new seed: the same program
    assert mtp_lib._init_params._cache_size() == before
    w, w_ref = other["layers"]["w_fc"][...], ref["layers"]["w_fc"][...]
    assert float(jnp.abs(w - w_ref).max()) > 0.05
    assert float(jnp.std(w)) == pytest.approx(0.05, rel=0.05)  # 2 x 2D x D = 4096 draws


def test_patience_stops_after_evaluations_without_a_new_best():
    stop = patience_stop(2)
    seq = [1.0, 1.2, 1.1, 1.3, 1.25, 1.3, 1.4]
    got = [stop({"rejection/accept_len": v}) for v in seq]
    # best 1.3 at index 3; 1.25 and 1.3 (not better) are two evaluations without a new best
    assert got == [False, False, False, False, False, True, False]
    assert not any(patience_stop(0)({"rejection/accept_len": 0.0}) for _ in range(5))


@pytest.mark.slow
def test_speculative_distillation_samples_the_policy_distribution(tiny_cfg):
    """Distilling with the speculative sampler (a random MTP: many rejections) gives responses
    with the plain sampler's distribution. 6000 rows of 2 tokens each (same prompt, independent
    keys); two-sample chi-square on the 23 x 23 joint of the two tokens (cells with < 5 expected
    pooled counts merged); p > 0.01 required. A verifier that accepts every draft fails it."""
    pol_gd, pol_params = random_policy(tiny_cfg, 3, std=0.4)
    mtp_gd, mtp_params = mtp_lib.init(tiny_cfg, 1, seed=4)
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=2, eos_ids=(99,), pad_id=0)
    ids = [[1, 4, 2]] * 6000
    spec = speculative.SpecConfig(2, "rejection")
    runs = []
    for i, draft in enumerate([None, (mtp_gd, mtp_params, None, spec)]):
        toks, mask = distill.sample_responses(
            (pol_gd, pol_params), ids, scfg, jax.random.key(10 + i), 2000, draft
        )
        assert mask.sum(1).min() == 2
        resp = toks[:, 3:5]
        runs.append(np.bincount(resp[:, 0] * 23 + resp[:, 1], minlength=23 * 23))
    table = np.stack(runs)
    keep = table.sum(0) >= 10
    merged = np.concatenate([table[:, keep], table[:, ~keep].sum(1, keepdims=True)], axis=1)
    merged = merged[:, merged.sum(0) > 0]
    expected = merged.sum(1, keepdims=True) * merged.sum(0, keepdims=True) / merged.sum()
    stat = float(((merged - expected) ** 2 / expected).sum())
    dof = merged.shape[1] - 1
    p = float(jax.scipy.special.gammaincc(dof / 2, stat / 2))
    assert dof > 20 and p > 0.01, (p, dof)


def test_sigterm_stops_distillation_between_batches(tiny_cfg):
    """SIGTERM (the preemption flag) ends distillation after the batch in flight with
    `Preempted`, naming how far it got; without it every batch is sampled."""
    pol = random_policy(tiny_cfg, 3, std=0.4)
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=2, eos_ids=(99,), pad_id=0)
    done = []
    run = functools.partial(
        distill.sample_responses,
        pol,
        [[1, 4, 2]] * 6,
        scfg,
        jax.random.key(0),
        2,
        progress=lambda rows, n: done.append(rows),
    )
    assert run()[0].shape[0] == 6 and done == [2, 2, 2]
    done.clear()
    PREEMPTED.set()
    try:
        with pytest.raises(Preempted, match="SIGTERM after 2 of 6 samples"):
            run()
    finally:
        PREEMPTED.clear()
    assert done == [2]


@pytest.mark.slow
def test_backbone_is_bitwise_unchanged_by_mtp_training(setup):
    pol_gd, mtp_gd, mtp_params, pol_params, batch = setup
    before = jax.tree.map(np.array, pol_params)
    opt = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), 10)
    step = make_train_step(mtp_loss(pol_gd, mtp_gd, "e2e_tv", 3, 8, 1.0), opt)
    state = TrainState.create(mtp_params, opt, 0)
    start = jax.tree.map(np.array, state.params)
    for _ in range(3):
        state, m = step(state, batch, pol_params)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(pol_params), strict=True):
        np.testing.assert_array_equal(a, b)
    moved = [
        np.abs(a - np.asarray(b)).max()
        for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(state.params), strict=True)
    ]  # noqa: E501
    assert max(moved) > 0 and np.isfinite(float(m["loss"]))


@pytest.mark.slow
def test_train_time_step_one_matches_decode_time_drafting(tiny_cfg):
    """Step 1 of the teacher-forced forward at anchor t equals the cached MTP extend at t."""
    cfg = dataclasses.replace(tiny_cfg, init_std=0.3)
    pol_gd, pol_params = model.init(cfg, 0)
    mtp_gd, mtp_params = mtp_lib.init(cfg, 1, seed=2)
    tokens = jax.random.randint(jax.random.key(0), (2, 10), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(10), (2, 10))
    policy = nnx.merge(pol_gd, pol_params)
    hidden = policy.hidden(tokens, pos)[0]
    train = mtp_lib.train_hidden(mtp_gd, mtp_params, pol_gd, pol_params, tokens, hidden, 2)
    want_logits = policy.head(train[0])  # step 1, all anchors
    mtp = nnx.merge(mtp_gd, mtp_params)
    cache = mtp_lib.new_cache(cfg, 1, 2, 16)
    next_tokens = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    _, normed, _ = mtp_lib.extend(mtp, policy, 0, cache, hidden[:, :9], next_tokens[:, :9])
    np.testing.assert_allclose(mtp_lib.logits(policy, normed), want_logits[:, :9], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True], ids=["train_layout", "decode_layout"])
def test_catch_up_outputs_at_one_position_and_key_value_writes_equal_the_full_extend(
    tiny_cfg, fused
):
    """`extend(at_B=)` (outputs of one position per row) and `write_kv` (no outputs) against the
    full extend over the same 4 positions of a half-filled cache, for both layers of a 2-layer
    MTP: outputs at `at_B` and every key/value slot equal to 1e-5, slots outside the write
    untouched. Every MTP weight random (biases and norm scales too: a wrong bias slice or a
    swapped norm would show), qkv bias, qk-norm and rope on, rows at different offsets."""
    cfg = dataclasses.replace(tiny_cfg, init_std=0.3, qk_norm=True, qkv_bias=True)
    pol_gd, pol_params = model.init(cfg, 0)
    mtp_gd, mtp_params = mtp_lib.init(cfg, 2, seed=3)
    policy = nnx.merge(pol_gd, pol_params)
    mtp = nnx.merge(mtp_gd, perturb(mtp_params, 4, 0.3))
    mtp = mtp_lib.for_decode(mtp) if fused else mtp
    b, t, d = 3, 4, cfg.dim
    keys = jax.random.split(jax.random.key(1), 3)
    cache = mtp_lib.new_cache(cfg, 2, b, 16)
    pre_hid = jax.random.normal(keys[0], (b, 6, d))
    pre_tok = jax.random.randint(keys[1], (b, 6), 0, cfg.vocab_size)
    for j in range(2):
        _, _, cache = mtp_lib.extend(mtp, policy, j, cache, pre_hid, pre_tok)
    cache = cache.advance(jnp.array([6, 2, 4]))  # rows at different offsets
    hid = jax.random.normal(keys[2], (b, t, d))
    tok = jnp.roll(pre_tok[:, :t], 1, axis=1)
    at_B, rows = jnp.array([3, 0, 2]), jnp.arange(b)
    for j in range(2):
        out, normed, full = mtp_lib.extend(mtp, policy, j, cache, hid, tok)
        out1, normed1, part = mtp_lib.extend(mtp, policy, j, cache, hid, tok, at_B=at_B)
        kv_only = mtp_lib.write_kv(mtp, policy, j, cache, hid, tok)
        assert out1.shape == normed1.shape == (b, 1, d)
        np.testing.assert_allclose(out1[:, 0], out[rows, at_B], atol=1e-5)
        np.testing.assert_allclose(normed1[:, 0], normed[rows, at_B], atol=1e-5)
        for got in (part, kv_only):
            for side in ("k", "v"):
                for i in range(2):  # layer j written, the other layer untouched
                    want = getattr(full if i == j else cache, side)[i]
                    np.testing.assert_allclose(getattr(got, side)[i], want, atol=1e-5)
            np.testing.assert_array_equal(got.lengths, cache.lengths)
        # the write covered exactly the 4 new slots of each row: the rest is the old cache
        old_k, new_k = np.asarray(cache.k[j]), np.asarray(kv_only.k[j])
        for r, start in enumerate([6, 2, 4]):
            changed = np.any(old_k[r] != new_k[r], axis=(0, 2))
            assert set(np.flatnonzero(changed)) <= set(range(start, start + t))
            assert changed[start : start + t].all()
