"""Policy: cached decoding equals the full forward; causality; loop modes agree."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bebop import model

VARIANTS = {
    "llama": {},
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(qk_norm=True, tie_embeddings=False),
    "unrolled": dict(scan_layers=False, qk_norm=True),
}


def _randomize_biases(params, seed):
    # zero-initialised biases would hide a bias bug: give every bias a random value.
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    return jax.tree.map_with_path(
        lambda path, x: (
            x + 0.1 * jax.random.normal(next(keys), x.shape)
            if any(getattr(p, "key", None) in ("bq", "bk", "bv") for p in path)
            else x
        ),
        params,
    )


@pytest.fixture(params=list(VARIANTS))
def policy(request, tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, **VARIANTS[request.param])
    graphdef, params = model.init(cfg, seed=0)
    return cfg, graphdef, _randomize_biases(params, 1)


def _full(graphdef, params, tokens):
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return _forward_jit(graphdef, params, tokens, pos)[0]


# Jitted once per shape: op-by-op dispatch of a whole forward made these tests several times slower.
_forward_jit = jax.jit(model.forward, static_argnums=0)
_prefill_jit = jax.jit(model.prefill, static_argnums=(0, 4))
_extend_jit = jax.jit(model.extend, static_argnums=0)


@pytest.mark.slow
def test_cached_decoding_matches_full_forward(policy):
    cfg, graphdef, params = policy
    b, t = 3, 14
    tokens = jax.random.randint(jax.random.key(2), (b, t), 0, cfg.vocab_size)
    full = np.asarray(_full(graphdef, params, tokens))
    lens = np.array([3, 6, 1])
    logits, _, cache = _prefill_jit(graphdef, params, tokens[:, :6], jnp.asarray(lens), 24)
    for r in range(b):  # prompt logits, rows of different lengths
        np.testing.assert_allclose(logits[r, : lens[r]], full[r, : lens[r]], atol=1e-5)
    extend = _extend_jit
    for width in (1, 3, 2):  # single and multi-token extends at each row's own offset
        new = np.stack([np.asarray(tokens[r, lens[r] : lens[r] + width]) for r in range(b)])
        logits, _, cache = extend(graphdef, params, cache, jnp.asarray(new))
        for r in range(b):
            np.testing.assert_allclose(logits[r], full[r, lens[r] : lens[r] + width], atol=1e-5)
        lens = lens + width
        np.testing.assert_array_equal(cache.lengths, lens)
    # Rollback: row 0 keeps one fewer token, row 2 keeps two fewer; then extend again.
    lens = lens - np.array([1, 0, 2])
    cache = cache.rollback(jnp.asarray(lens))
    new = np.stack([np.asarray(tokens[r, lens[r] : lens[r] + 2]) for r in range(b)])
    logits, _, cache = extend(graphdef, params, cache, jnp.asarray(new))
    for r in range(b):
        np.testing.assert_allclose(logits[r], full[r, lens[r] : lens[r] + 2], atol=1e-5)


def test_num_new_advances_rows_independently(tiny_cfg):
    graphdef, params = model.init(tiny_cfg, seed=0)
    cache = model.new_cache(tiny_cfg, 2, 8)
    tokens = jnp.ones((2, 3), jnp.int32)
    _, _, cache = model.extend(graphdef, params, cache, tokens, jnp.array([3, 1]))
    np.testing.assert_array_equal(cache.lengths, [3, 1])
    np.testing.assert_array_equal(cache.rollback(jnp.array([5, 0])).lengths, [3, 0])


def test_causality(policy):
    cfg, graphdef, params = policy
    tokens = jax.random.randint(jax.random.key(3), (2, 10), 0, cfg.vocab_size)
    changed = tokens.at[:, 6].set((tokens[:, 6] + 1) % cfg.vocab_size)
    a, b = _full(graphdef, params, tokens), _full(graphdef, params, changed)
    np.testing.assert_array_equal(a[:, :6], b[:, :6])
    assert float(jnp.abs(a[:, 6:] - b[:, 6:]).max()) > 1e-4  # the change is visible after it


def test_scan_and_unrolled_layers_agree(tiny_cfg):
    g1, params = model.init(dataclasses.replace(tiny_cfg, scan_layers=False), seed=4)
    g2, _ = model.init(dataclasses.replace(tiny_cfg, scan_layers=True), seed=4)
    tokens = jax.random.randint(jax.random.key(5), (2, 9), 0, tiny_cfg.vocab_size)
    np.testing.assert_allclose(_full(g1, params, tokens), _full(g2, params, tokens), atol=1e-5)


def test_hidden_states_feed_the_head(tiny_cfg):
    graphdef, params = model.init(tiny_cfg, seed=0)
    tokens = jnp.arange(8)[None] % tiny_cfg.vocab_size
    logits, hidden = model.forward(graphdef, params, tokens, jnp.arange(8)[None])
    again = nnx.merge(graphdef, params).logits_from_hidden(hidden)
    np.testing.assert_allclose(logits, again, atol=1e-6)
    assert hidden.shape == (1, 8, tiny_cfg.dim)


# tied and untied output head, the fused qkv bias
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["llama", "qwen3", "qwen2"])
def test_decode_weights_give_the_full_forward(tiny_cfg, variant):
    """`decode_layers` (per-layer weights in the fused q/k/v and gate/up layout, `[D, V]` head)
    in prefill and extend: same logits as the full forward with the stacked weights."""
    cfg = dataclasses.replace(tiny_cfg, **VARIANTS[variant])
    graphdef, params = model.init(cfg, seed=6)
    params = _randomize_biases(params, seed=8)
    layers = model.decode_layers_jit(graphdef, params)
    assert len(layers.layers) == cfg.num_layers
    assert layers.head_DxV.shape == (cfg.dim, cfg.vocab_size)
    qkv_width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    assert set(layers.layers[0]["attn"]) >= {"wqkv"} and "wq" not in layers.layers[0]["attn"]
    assert layers.layers[0]["attn"]["wqkv"].shape == (cfg.dim, qkv_width)
    assert layers.layers[0]["mlp"]["w_gate_up"].shape == (cfg.dim, 2 * cfg.ffw_dim)
    tokens = jax.random.randint(jax.random.key(7), (2, 9), 0, cfg.vocab_size)
    full = np.asarray(_full(graphdef, params, tokens))
    lens = jnp.array([4, 2])
    logits, _, cache = _prefill_jit(graphdef, params, tokens[:, :4], lens, 16, layers)
    np.testing.assert_allclose(logits[0], full[0, :4], atol=1e-5)
    np.testing.assert_allclose(logits[1, :2], full[1, :2], atol=1e-5)
    new = jnp.stack([tokens[0, 4:7], tokens[1, 2:5]])
    logits, _, cache = _extend_jit(graphdef, params, cache, new, None, layers)
    np.testing.assert_allclose(logits[0], full[0, 4:7], atol=1e-5)
    np.testing.assert_allclose(logits[1], full[1, 2:5], atol=1e-5)
