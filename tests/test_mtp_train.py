"""MTP training: no gradient reaches the policy, the backbone stays bitwise frozen, and the
train-time forward agrees with decode-time drafting on step 1."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bebop import model
from bebop import mtp as mtp_lib
from bebop.config import OptimConfig
from bebop.mtp_losses import MTP_LOSSES
from bebop.mtp_train import load_draft_vocab, mtp_loss, policy_hiddens, select_draft_vocab
from bebop.train import TrainState, make_optimizer, make_train_step

from .helpers import random_policy


@pytest.fixture
def setup(tiny_cfg):
    pol_gd, pol_params = random_policy(tiny_cfg, 0)
    mtp_gd, mtp_params = mtp_lib.init(tiny_cfg, 2, seed=1)
    rng = np.random.default_rng(0)
    batch = {
        "tokens": jnp.asarray(rng.integers(0, tiny_cfg.vocab_size, (3, 12)), jnp.int32),
        "mask": jnp.asarray((rng.random((3, 12)) < 0.8).astype(np.float32)),
        "policy": pol_params,
    }
    return pol_gd, mtp_gd, mtp_params, batch


@pytest.mark.parametrize("name", list(MTP_LOSSES))
def test_no_gradient_reaches_the_policy(setup, name):
    pol_gd, mtp_gd, mtp_params, batch = setup
    fn = mtp_loss(pol_gd, mtp_gd, name, train_steps=3, chunk=8, temperature=1.0)

    def loss(mp, pp):
        return fn(mp, {**batch, "policy": pp}, None)[0]

    g_mtp, g_pol = jax.grad(loss, argnums=(0, 1))(mtp_params, batch["policy"])
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
    pol_gd, mtp_gd, mtp_params, batch = setup
    fn = mtp_loss(pol_gd, mtp_gd, "e2e_tv", 3, 4, 1.0, vocab=np.array([0, 2, 5, 7, 11]))
    g_mtp, g_pol = jax.grad(lambda mp, pp: fn(mp, {**batch, "policy": pp}, None)[0],
                            argnums=(0, 1))(mtp_params, batch["policy"])  # fmt: skip
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(g_pol))
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_mtp)) > 0.0


def test_cached_policy_hiddens_give_the_same_loss_and_gradient(setup):
    """`mtp.cache_hidden`: hiddens computed once (batches of 2, the last one padded) = per step."""
    pol_gd, mtp_gd, mtp_params, batch = setup
    fn = mtp_loss(pol_gd, mtp_gd, "e2e_tv", 3, 8, 1.0)
    hiddens = policy_hiddens(pol_gd, batch["policy"], np.asarray(batch["tokens"]), batch_size=2)
    assert hiddens.shape == (*batch["tokens"].shape, 32)
    (l0, _), g0 = jax.value_and_grad(fn, has_aux=True)(mtp_params, batch, None)
    (l1, _), g1 = jax.value_and_grad(fn, has_aux=True)(mtp_params, {**batch, "hidden": hiddens},
                                                       None)  # fmt: skip
    np.testing.assert_allclose(l0, l1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_backbone_is_bitwise_unchanged_by_mtp_training(setup):
    pol_gd, mtp_gd, mtp_params, batch = setup
    before = jax.tree.map(np.array, batch["policy"])
    opt = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), 10)
    step = make_train_step(mtp_loss(pol_gd, mtp_gd, "e2e_tv", 3, 8, 1.0), opt)
    state = TrainState.create(mtp_params, opt, 0)
    start = jax.tree.map(np.array, state.params)
    for _ in range(3):
        state, m = step(state, batch)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(batch["policy"]), strict=True):
        np.testing.assert_array_equal(a, b)
    moved = [
        np.abs(a - np.asarray(b)).max()
        for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(state.params), strict=True)
    ]  # noqa: E501
    assert max(moved) > 0 and np.isfinite(float(m["loss"]))


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
    _, got_logits, _ = mtp_lib.extend(mtp, policy, 0, cache, hidden[:, :9], next_tokens[:, :9])
    np.testing.assert_allclose(got_logits, want_logits[:, :9], atol=1e-5)
