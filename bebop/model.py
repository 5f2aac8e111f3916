"""Qwen2 / Qwen3 / Llama-family decoder-only policy (Flax NNX) and its pure jitted entry points.

Glossary for shape suffixes (used across bebop):
  B batch, T time (tokens in this call), S cache length, D model dim, H query heads, K kv heads,
  G query heads per kv head (H / K), Dh head dim, F feed-forward dim, V vocab, L layers,
  Y draft steps (γ in the papers).

Pieces: RMSNorm; RoPE (rotate-half layout, as in HF); grouped-query attention with optional qkv bias
(Qwen2) and q/k RMSNorm (Qwen3); SwiGLU MLP; tied or untied output head. Parameters are stored
stacked (`[L, ...]` leading axis). Full-sequence forwards (training) scan over them when
`ModelConfig.scan_layers` is set (fast to compile) and unroll otherwise.

Cached forwards (prefill, extend, the decode loops) always unroll the layers over per-layer
weights and a per-layer KV cache (`kvcache.py`), because a layer loop that indexes stacked arrays
copies each layer's slice on every step (profiled on CPU, SmolLM2-135M: the scan loop copied
every weight each step, +45 % step time at batch 1; the stacked `[L, B, K, S, Dh]` cache cost two
cache copies per layer per step, 22 % at batch 8). `decode_layers` lays the weights out once per
parameter version (`DecodeWeights`: per-layer arrays, q/k/v and gate/up each fused into one
matrix, and a `[D, V]` head); pass it as `layers=`
to every call inside a loop, or to the sampler, which otherwise makes it on each call (a copy of
every weight, a few decode steps' time).

Entry points take the graph definition (static) and the parameter state split once with `nnx.split`:
  forward(graphdef, params, tokens_BxT, positions_BxT) -> (logits_BxTxV, hidden_BxTxD)
  extend(graphdef, params, cache, tokens_BxT, num_new_B, layers) -> (logits, hidden, cache)
  prefill(graphdef, params, tokens_BxT, lengths_B, max_len) -> (logits, hidden, cache)
`hidden` is the last decoder layer's output before the final norm (what an MTP layer consumes);
`logits_from_hidden` applies final norm + head. Logits are float32. `Policy.hidden_features`,
`Policy.forward_features` and `prefill_last_features` also return the outputs of chosen decoder
layers from the same pass (an MTP with `mtp.features`): `run_blocks(collect=...)`.

Mixed precision (`ModelConfig.param_dtype`, `ModelConfig.dtype`): parameters are stored in the
parameter dtype (float32 by default: the optimizer updates float32 masters, so an AdamW step of
1e-6 is not lost to bfloat16's resolution), and every forward rounds each weight to the compute
dtype where it is used (`compute_weight`), so matmuls, activations and the KV cache are in the
compute dtype. RMSNorm statistics, RoPE, attention softmax and the logits are float32.
`decode_layers` is the compute-dtype copy of the weights a decode loop reads (half the bytes for
bfloat16); the full forward rounds the same way, so the learner's log-probs and the sampler's
agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from bebop import kvcache, sharding
from bebop.config import REMAT_CHOICES, REMAT_POLICIES, ConfigError, ModelConfig
from bebop.kvcache import KVCache

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# Logical axes of the activations the model pins (`sharding.constrain`): the batch over the data
# axes, the model width whole; q/k/v heads and the MLP's hidden over `tensor`.
X_AXES = ("batch", "act_seq", "act_embed")
Q_AXES = ("batch", "act_seq", "act_heads", "head_dim")  # [B, T, H, Dh]
KV_AXES = ("batch", "act_kv_heads", "act_seq", "head_dim")  # [B, K, T|S, Dh]
MLP_AXES = ("batch", "act_seq", "act_mlp")
LOGITS_AXES = ("batch", "act_seq", "act_vocab")


def compute_weight(var, dtype) -> jax.Array:
    """A weight as the forward uses it: rounded to the compute dtype (a no-op when it is already
    in it, e.g. a `decode_layers` copy). Gradients flow back to the parameter's own dtype."""
    return var[...].astype(dtype)


def to_compute(state, cfg: ModelConfig):
    """Every array of a parameter state cast to the compute dtype `cfg.dtype`."""
    return jax.tree.map(lambda a: a.astype(DTYPES[cfg.dtype]), state)


def _param(rngs: nnx.Rngs, shape, axes, std, dtype):
    return nnx.Param((std * jax.random.normal(rngs.params(), shape)).astype(dtype), axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), dtype), axes=("norm",))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # The scale is rounded to the compute dtype (x's) first, as every weight is.
        return (y * compute_weight(self.scale, x.dtype).astype(jnp.float32)).astype(x.dtype)


def rope(x_BxTxNxDh: jax.Array, positions_BxT: jax.Array, theta: float) -> jax.Array:
    dh = x_BxTxNxDh.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)
    angles_BxTxDh2 = positions_BxT[..., None].astype(jnp.float32) * inv_freq
    cos = jnp.cos(angles_BxTxDh2)[:, :, None, :]
    sin = jnp.sin(angles_BxTxDh2)[:, :, None, :]
    x = x_BxTxNxDh.astype(jnp.float32)
    x1, x2 = x[..., : dh // 2], x[..., dh // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxDh.dtype)


def take_at(x_BxT, at_B):
    """x[b, at_B[b]] for each row, kept as a length-1 axis: `[B, 1, ...]`."""
    idx = at_B.reshape((-1, 1) + (1,) * (x_BxT.ndim - 2))
    return jnp.take_along_axis(x_BxT, idx, axis=1)


def attend(q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, mask_BxTxS):
    """Grouped-query attention; softmax in float32."""
    b, t, h, dh = q_BxTxHxDh.shape
    k_heads = k_BxKxSxDh.shape[1]
    q_BxTxKxGxDh = q_BxTxHxDh.reshape(b, t, k_heads, h // k_heads, dh)
    scores = jnp.einsum("btkgd,bksd->bkgts", q_BxTxKxGxDh, k_BxKxSxDh).astype(jnp.float32)
    scores = scores * (dh**-0.5)
    scores = jnp.where(mask_BxTxS[:, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxKxSxDh.dtype)
    # The product in [B, K, G, T, Dh] order, then one transpose: asking the einsum for
    # [B, T, K, G, Dh] directly made XLA:CPU loop over B*K tiny matmuls, 10-20x slower at
    # decode shapes (demo B=128: 35 % of a decode step) and 1.4x at training shapes.
    out_BxKxGxTxDh = jnp.einsum("bkgts,bksd->bkgtd", probs, v_BxKxSxDh)
    return out_BxKxGxTxDh.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh)


def attend_chunked(q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, q_pos_BxT, k_pos_BxS, chunk: int):
    """`attend` with the causal-by-position mask (key position <= query position), `chunk`
    queries at a time (a `lax.map`), each chunk under `jax.checkpoint`: the float32 scores are
    `[B, K, G, chunk, S]` at most, in the forward and in the backward (which recomputes one
    chunk's scores at a time). Each query row's arithmetic is `attend`'s, so the outputs agree.
    T is padded up to a multiple of `chunk` with queries at position -1 (they see no key; their
    rows are dropped)."""
    b, t, h, dh = q_BxTxHxDh.shape
    if t <= chunk:
        return attend(
            q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, k_pos_BxS[:, None] <= q_pos_BxT[..., None]
        )
    n = -(-t // chunk)
    pad = n * chunk - t
    q = jnp.pad(q_BxTxHxDh, ((0, 0), (0, pad), (0, 0), (0, 0)))
    pos = jnp.pad(q_pos_BxT, ((0, 0), (0, pad)), constant_values=-1)
    q_NxBxCxHxDh = q.reshape(b, n, chunk, h, dh).swapaxes(0, 1)
    pos_NxBxC = pos.reshape(b, n, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one(args):
        q_c, pos_c = args
        mask_BxCxS = k_pos_BxS[:, None, :] <= pos_c[:, :, None]
        return attend(q_c, k_BxKxSxDh, v_BxKxSxDh, mask_BxCxS)

    out_NxBxCxHxDh = jax.lax.map(one, (q_NxBxCxHxDh, pos_NxBxC))
    return out_NxBxCxHxDh.swapaxes(0, 1).reshape(b, n * chunk, h, dh)[:, :t]


def attend_full(cfg: ModelConfig, q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, q_pos_BxT, k_pos_BxS):
    """The full-sequence (cacheless) forward's attention by `cfg.attention` (see `ModelConfig`):
    every query attends to the keys at or before its position."""
    if cfg.attention == "chunked":
        return attend_chunked(
            q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, q_pos_BxT, k_pos_BxS, cfg.attention_chunk
        )
    mask_BxTxS = k_pos_BxS[:, None, :] <= q_pos_BxT[:, :, None]
    if cfg.attention == "xla":
        return attend(q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, mask_BxTxS)
    # jax.nn.dot_product_attention: keys and values [B, S, K, Dh] (GQA when K < H), a boolean
    # mask broadcast over heads; softmax in float32; scale 1/sqrt(Dh) as in `attend`.
    return jax.nn.dot_product_attention(
        q_BxTxHxDh,
        k_BxKxSxDh.transpose(0, 2, 1, 3),
        v_BxKxSxDh.transpose(0, 2, 1, 3),
        mask=mask_BxTxS[:, None],
        implementation="cudnn" if cfg.attention == "cudnn" else None,
    )


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, k, dh = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        dt, std = DTYPES[cfg.param_dtype], cfg.init_std
        self.cfg = cfg
        self.wq = _param(rngs, (d, h, dh), ("embed", "heads", "head_dim"), std, dt)
        self.wk = _param(rngs, (d, k, dh), ("embed", "kv_heads", "head_dim"), std, dt)
        self.wv = _param(rngs, (d, k, dh), ("embed", "kv_heads", "head_dim"), std, dt)
        self.wo = _param(rngs, (h, dh, d), ("heads", "head_dim", "embed"), std, dt)
        if cfg.qkv_bias:
            self.bq = nnx.Param(jnp.zeros((h, dh), dt), axes=("heads", "head_dim"))
            self.bk = nnx.Param(jnp.zeros((k, dh), dt), axes=("kv_heads", "head_dim"))
            self.bv = nnx.Param(jnp.zeros((k, dh), dt), axes=("kv_heads", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(dh, cfg.norm_eps, dt)
            self.k_norm = RMSNorm(dh, cfg.norm_eps, dt)

    def __call__(self, x_BxTxD, positions_BxT, kv=None, offsets_B=None, valid_BxS=None, at_B=None):
        """Without `kv`: causal attention over the T tokens (by position). With `kv` (this layer's
        `(k, v)` cache `[B, K, S, Dh]`): writes the T new entries at `offsets_B` and attends to
        every cache slot at or before each query's position (and, if given, marked in
        `valid_BxS`). With `at_B`, only the query at index `at_B[b]` of row b attends (out
        `[B, 1, D]`); every key and value is still written. Returns (out, new kv or None)."""
        cfg = self.cfg
        cdt = DTYPES[cfg.dtype]
        q, k_BxKxTxDh, v_BxKxTxDh = self._qkv(x_BxTxD, positions_BxT)
        if kv is None:
            keys, values, key_pos_BxS = k_BxKxTxDh, v_BxKxTxDh, positions_BxT
            new_kv = None
        else:
            keys = kvcache.write(kv[0], k_BxKxTxDh, offsets_B)
            values = kvcache.write(kv[1], v_BxKxTxDh, offsets_B)
            key_pos_BxS = jnp.broadcast_to(
                jnp.arange(keys.shape[2]), (keys.shape[0], keys.shape[2])
            )
            new_kv = (keys, values)
        if kv is None and at_B is None and valid_BxS is None:  # the full-sequence forward
            b, t, h, dh = q.shape
            out_BxTxHxDh = attend_full(cfg, q, keys, values, positions_BxT, key_pos_BxS)
            out_BxTxHDh = out_BxTxHxDh.reshape(b, t, h * dh)
            return out_BxTxHDh @ compute_weight(self.wo, cdt).reshape(h * dh, -1), new_kv
        if at_B is not None:  # one query per row, against every key written above
            q, positions_BxT = take_at(q, at_B), take_at(positions_BxT, at_B)
        mask_BxTxS = key_pos_BxS[:, None, :] <= positions_BxT[:, :, None]
        if valid_BxS is not None:
            mask_BxTxS = mask_BxTxS & valid_BxS[:, None, :]
        b, t, h, dh = q.shape
        out_BxTxHDh = attend(q, keys, values, mask_BxTxS).reshape(b, t, h * dh)
        # One [H*Dh, D] matrix (a free reshape): contracting (h, e) in an einsum let XLA pick a
        # layout that transposed a copy of `wo` on every decode step.
        return out_BxTxHDh @ compute_weight(self.wo, cdt).reshape(h * dh, -1), new_kv

    def _qkv(self, x_BxTxD, positions_BxT, with_q=True):
        """q `[B, T, H, Dh]` (None unless `with_q`), k and v `[B, K, T, Dh]`, normed and rotated
        as configured."""
        cfg = self.cfg
        cdt = DTYPES[cfg.dtype]
        x_BxTxD = x_BxTxD.astype(cdt)
        q = None
        if hasattr(self, "wqkv"):  # the decode layout (`fuse`)
            q, k, v = self._fused_qkv(x_BxTxD, cdt, with_q)
        else:
            if with_q:
                q = jnp.einsum("btd,dhe->bthe", x_BxTxD, compute_weight(self.wq, cdt))
            k = jnp.einsum("btd,dke->btke", x_BxTxD, compute_weight(self.wk, cdt))
            v = jnp.einsum("btd,dke->btke", x_BxTxD, compute_weight(self.wv, cdt))
            if cfg.qkv_bias:
                q = None if q is None else q + compute_weight(self.bq, cdt)
                k = k + compute_weight(self.bk, cdt)
                v = v + compute_weight(self.bv, cdt)
        if cfg.qk_norm:
            k = self.k_norm(k)
            if q is not None:
                q = self.q_norm(q)
        if q is not None:
            q = sharding.constrain(rope(q, positions_BxT, cfg.rope_theta), Q_AXES)
        k_BxKxTxDh = rope(k, positions_BxT, cfg.rope_theta).transpose(0, 2, 1, 3)
        k_BxKxTxDh = sharding.constrain(k_BxKxTxDh, KV_AXES)
        return q, k_BxKxTxDh, sharding.constrain(v.transpose(0, 2, 1, 3), KV_AXES)

    def write_kv(self, x_BxTxD, positions_BxT, kv, offsets_B):
        """Only the cache update of `__call__` with `kv`: the T new keys and values written at
        `offsets_B`, nothing attended (and no query projected). Returns the new kv."""
        _, k_BxKxTxDh, v_BxKxTxDh = self._qkv(x_BxTxD, positions_BxT, with_q=False)
        keys = kvcache.write(kv[0], k_BxKxTxDh, offsets_B)
        values = kvcache.write(kv[1], v_BxKxTxDh, offsets_B)
        return keys, values

    def fuse(self):
        """In place: the decode layout, q, k and v projected by one `[D, (H + 2K) Dh]` matrix
        (and one bias). At batch 1 a decode step is a chain of matrix-vector products, and on
        CPU one product over the concatenated matrix streams the weights faster than three
        (`benchmarks.decode`; docs/performance.md has the figures)."""
        d = self.cfg.dim
        if self.wq.ndim != 3:  # a stacked [L, D, H, Dh] module would reshape into garbage
            raise ValueError(f"fuse: one layer's weights expected, got wq {self.wq.shape}")
        names = ("wq", "wk", "wv")
        self.wqkv = nnx.Param(
            jnp.concatenate([getattr(self, n)[...].reshape(d, -1) for n in names], 1)
        )
        if self.cfg.qkv_bias:
            bs = ("bq", "bk", "bv")
            self.bqkv = nnx.Param(jnp.concatenate([getattr(self, n)[...].reshape(-1) for n in bs]))
            names += bs
        for n in names:
            delattr(self, n)

    def _fused_qkv(self, x_BxTxD, cdt, with_q=True):
        cfg = self.cfg
        h, kh, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        start = 0 if with_q else h * dh  # k and v alone: their columns of the one matrix
        qkv = x_BxTxD @ compute_weight(self.wqkv, cdt)[:, start:]
        if cfg.qkv_bias:
            qkv = qkv + compute_weight(self.bqkv, cdt)[start:]
        b, t = x_BxTxD.shape[:2]
        q, k, v = jnp.split(qkv, [h * dh - start, (h + kh) * dh - start], axis=-1)
        q = q.reshape(b, t, h, dh) if with_q else None
        return q, k.reshape(b, t, kh, dh), v.reshape(b, t, kh, dh)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, dt, std = cfg.dim, cfg.ffw_dim, DTYPES[cfg.param_dtype], cfg.init_std
        self.cfg = cfg
        self.w_gate = _param(rngs, (d, f), ("embed", "mlp"), std, dt)
        self.w_up = _param(rngs, (d, f), ("embed", "mlp"), std, dt)
        self.w_down = _param(rngs, (f, d), ("mlp", "embed"), std, dt)

    def __call__(self, x_BxTxD):
        cdt = DTYPES[self.cfg.dtype]
        x_BxTxD = x_BxTxD.astype(cdt)
        if hasattr(self, "w_gate_up"):  # the decode layout (`fuse`)
            gate_BxTxF, up_BxTxF = jnp.split(x_BxTxD @ compute_weight(self.w_gate_up, cdt), 2, -1)
        else:
            gate_BxTxF = x_BxTxD @ compute_weight(self.w_gate, cdt)
            up_BxTxF = x_BxTxD @ compute_weight(self.w_up, cdt)
        hidden_BxTxF = sharding.constrain(jax.nn.silu(gate_BxTxF) * up_BxTxF, MLP_AXES)
        return hidden_BxTxF @ compute_weight(self.w_down, cdt)

    def fuse(self):
        """In place: the decode layout, gate and up as one `[D, 2F]` matrix (see
        `Attention.fuse`)."""
        self.w_gate_up = nnx.Param(jnp.concatenate([self.w_gate[...], self.w_up[...]], axis=1))
        del self.w_gate, self.w_up


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = DTYPES[cfg.param_dtype]
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, dt)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, dt)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x_BxTxD, positions_BxT, kv=None, offsets_B=None, valid_BxS=None, at_B=None):
        """With `at_B`: every position's key and value are computed (and written to `kv`), but
        only position `at_B[b]` of row b goes on through attention and the MLP (out `[B, 1, D]`).
        Input and output pinned batch-split, model width whole (`sharding.constrain`)."""
        x_BxTxD = sharding.constrain(x_BxTxD, X_AXES)
        xn_BxTxD = self.attn_norm(x_BxTxD)
        h, new_kv = self.attn(xn_BxTxD, positions_BxT, kv, offsets_B, valid_BxS, at_B)
        if at_B is not None:
            x_BxTxD = take_at(x_BxTxD, at_B)
        x_BxTxD = x_BxTxD + h
        out_BxTxD = x_BxTxD + self.mlp(self.mlp_norm(x_BxTxD))
        return sharding.constrain(out_BxTxD, X_AXES), new_kv

    def write_kv(self, x_BxTxD, positions_BxT, kv, offsets_B):
        """The block's cache update alone (its keys and values depend only on its input)."""
        return self.attn.write_kv(self.attn_norm(x_BxTxD), positions_BxT, kv, offsets_B)


def stacked_blocks(cfg: ModelConfig, num: int, rngs: nnx.Rngs, block_cls=None) -> nnx.Module:
    """`num` blocks (default `Block`) whose parameters are stacked on a leading 'layers' axis."""
    block_cls = block_cls or Block
    graphdef, first = nnx.split(block_cls(cfg, rngs))
    states = [first] + [nnx.split(block_cls(cfg, rngs))[1] for _ in range(num - 1)]

    def stack(*vs):
        axes = ("layers",) + tuple(getattr(vs[0], "axes", ()) or ())
        return vs[0].replace(value=jnp.stack([v.get_value() for v in vs]), axes=axes)

    return nnx.merge(graphdef, jax.tree.map(stack, *states, is_leaf=sharding.is_var))


def unstack(blocks) -> list:
    """Per-layer parameter states of stacked blocks (a slice -- a copy -- of each)."""
    state = nnx.split(blocks)[1]
    return [
        jax.tree.map(lambda a, i=i: a[i], state) for i in range(jax.tree.leaves(state)[0].shape[0])
    ]


def remat_policy(remat: str):
    """The `jax.checkpoint` policy of `ModelConfig.remat` ("block": None, i.e. save nothing but
    the block's inputs); an error naming the key for an unknown value."""
    if remat == "block":
        return None
    if remat not in REMAT_POLICIES:
        raise ConfigError(f"config key 'model.remat': unknown {remat!r}; known: {REMAT_CHOICES}")
    return getattr(jax.checkpoint_policies, remat)


def run_blocks(
    blocks: Block,
    x_BxTxD,
    positions_BxT,
    kv=None,
    offsets_B=None,
    scan=False,
    layers=None,
    remat: str = "none",
    collect: tuple[int, ...] | None = None,
):
    """Applies stacked blocks in order. `kv` is `(k, v)`, each a tuple of per-layer `[B, K, S, Dh]`
    arrays, or None. `layers`: the `DecodeWeights` made once outside a decode loop (its per-layer
    blocks are run instead of `blocks`' slices). Only a cacheless call with `scan` and no
    `layers` scans. `remat` (`ModelConfig.remat`, cacheless calls without `layers` only): each
    block under `jax.checkpoint` with that policy, in a scan whatever `scan` says, so the
    backward keeps the blocks' inputs (and what the policy saves) and recomputes the rest one
    block at a time.

    Returns (output, new kv or None); with `collect` (sorted layer indices) also the outputs of
    those layers concatenated on the last axis, `[B, T, F*D]` in `collect`'s order. A scan
    carries only those F outputs (a `[F + 1, B, T, D]` buffer whose last slot takes the layers
    not collected), never all L."""
    graphdef, state = nnx.split(blocks)
    num = jax.tree.leaves(state)[0].shape[0]
    outs = []  # the collected layers' outputs, in order

    def layer(x, layer_gd, layer_state, layer_kv):
        return nnx.merge(layer_gd, layer_state)(x, positions_BxT, layer_kv, offsets_B)

    def done(x_BxTxD, new_kv):
        if collect is None:
            return x_BxTxD, new_kv
        return x_BxTxD, new_kv, jnp.concatenate(outs, axis=-1)

    if kv is None and layers is None:
        step = lambda x, s: layer(x, graphdef, s, None)  # noqa: E731
        if remat != "none":
            # Remat always scans: unrolled, XLA:CPU scheduled every block's recompute early and
            # kept them all (compiled temp bytes of a 4-layer gradient: 9.23 MB remat vs 9.41 MB
            # none unrolled; 3.11 MB vs 11.4 MB scanned). prevent_cse=False: the scan already
            # keeps the recompute apart.
            step = jax.checkpoint(step, policy=remat_policy(remat), prevent_cse=False)
            scan = True
        if scan and collect is None:
            return jax.lax.scan(step, x_BxTxD, state)
        if scan:
            x_BxTxD, buf_FxBxTxD = _scan_collect(step, x_BxTxD, state, num, collect)
            outs.extend(buf_FxBxTxD[j] for j in range(len(collect)))
            return done(x_BxTxD, None)
        for i in range(num):
            x_BxTxD, _ = step(x_BxTxD, jax.tree.map(lambda a, i=i: a[i], state))
            if collect is not None and i in collect:
                outs.append(x_BxTxD)
        return done(x_BxTxD, None)
    new_k, new_v = [], []
    for i in range(num):
        layer_kv = None if kv is None else (kv[0][i], kv[1][i])
        if layers is None:
            layer_gd, layer_state = graphdef, jax.tree.map(lambda a, i=i: a[i], state)
        else:
            layer_gd, layer_state = layers.block_graphdef, layers.layers[i]
        x_BxTxD, out_kv = layer(x_BxTxD, layer_gd, layer_state, layer_kv)
        if collect is not None and i in collect:
            outs.append(x_BxTxD)
        if kv is not None:
            new_k.append(out_kv[0])
            new_v.append(out_kv[1])
    return done(x_BxTxD, (None if kv is None else (tuple(new_k), tuple(new_v))))


def _scan_collect(step, x_BxTxD, state, num: int, collect: tuple[int, ...]):
    """`lax.scan` of `step` over the stacked layers that also keeps the outputs of layers
    `collect`: (last output, `[F, B, T, D]`). Each layer writes its output to its slot of an
    `[F + 1, B, T, D]` carry (slot F for the layers not collected): one slot per layer."""
    f = len(collect)
    slot_L = np.full((num,), f, np.int32)
    slot_L[list(collect)] = np.arange(f)

    def body(carry, xs):
        x, buf = carry
        layer_state, slot = xs
        x, _ = step(x, layer_state)
        return (x, jax.lax.dynamic_update_index_in_dim(buf, x, slot, 0)), None

    buf = jnp.zeros((f + 1,) + x_BxTxD.shape, x_BxTxD.dtype)
    (x_BxTxD, buf), _ = jax.lax.scan(body, (x_BxTxD, buf), (state, jnp.asarray(slot_L)))
    return x_BxTxD, buf[:f]


@struct.dataclass
class DecodeWeights:
    """The weights as a decode loop reads them (`decode_layers`): each layer's block state as
    its own arrays in the fused layout (`fuse_block`; `block_graphdef` is that layout's graph),
    and the output head as `[D, V]`, all in the compute dtype (a `[V, D]` tied embedding as the
    right operand ran the head 1.5x slower on CPU)."""

    layers: list
    head_DxV: jax.Array
    block_graphdef: nnx.GraphDef = struct.field(pytree_node=False)


def fuse_block(block: Block) -> Block:
    """In place: a block in the decode layout (fused q/k/v and gate/up matrices); same outputs."""
    block.attn.fuse()
    block.mlp.fuse()
    return block


class Policy(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = DTYPES[cfg.param_dtype]
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.dim), ("vocab", "embed"), cfg.init_std, dt)
        self.layers = stacked_blocks(cfg, cfg.num_layers, rngs)
        self.final_norm = RMSNorm(cfg.dim, cfg.norm_eps, dt)
        if not cfg.tie_embeddings:
            self.lm_head = _param(
                rngs, (cfg.dim, cfg.vocab_size), ("embed", "vocab"), cfg.init_std, dt
            )

    def _head_weight(self) -> jax.Array:
        """The output weight (`[V, D]` tied embedding or `[D, V]` head) rounded to the compute
        dtype, then float32: the values the decode copy's head holds, multiplied in float32."""
        w = self.embed if self.cfg.tie_embeddings else self.lm_head
        return compute_weight(w, DTYPES[self.cfg.dtype]).astype(jnp.float32)

    def head(self, x_BxTxD) -> jax.Array:
        """Output projection only (no norm), float32; shared with the MTP layer."""
        x32 = x_BxTxD.astype(jnp.float32)
        if self.cfg.tie_embeddings:
            logits = jnp.einsum("btd,vd->btv", x32, self._head_weight())
        else:
            logits = jnp.einsum("btd,dv->btv", x32, self._head_weight())
        return sharding.constrain(logits, LOGITS_AXES)

    def head_compute(self, x_BxTxD) -> jax.Array:
        """`head` with the operands in the compute dtype and float32 accumulation (as the decode
        copy's head): the same values as `head` (products of compute-dtype numbers are exact in
        float32), without a float32 copy of the `[D, V]` weight or of `x`."""
        cdt = DTYPES[self.cfg.dtype]
        w = compute_weight(self.embed if self.cfg.tie_embeddings else self.lm_head, cdt)
        eq = "btd,vd->btv" if self.cfg.tie_embeddings else "btd,dv->btv"
        return jnp.einsum(eq, x_BxTxD.astype(cdt), w, preferred_element_type=jnp.float32)

    def logits_from_hidden(self, hidden_BxTxD, layers: DecodeWeights | None = None) -> jax.Array:
        if layers is None:
            return self.head(self.final_norm(hidden_BxTxD))
        # The normed hidden and the head are in the compute dtype: products are exact in float32
        # and accumulate in float32, as in `head`.
        x_BxTxD = self.final_norm(hidden_BxTxD)
        logits = jnp.matmul(x_BxTxD, layers.head_DxV, preferred_element_type=jnp.float32)
        return sharding.constrain(logits, LOGITS_AXES)

    def embed_tokens(self, tokens_BxT) -> jax.Array:
        """Token embeddings in the compute dtype (only the gathered rows are cast)."""
        return jnp.take(self.embed[...], tokens_BxT, axis=0).astype(DTYPES[self.cfg.dtype])

    def head_matrix(self) -> jax.Array:
        """The output projection as `[D, V]` float32 (for vocabulary-chunked losses); its values
        are the compute-dtype weights, as in `head`."""
        if self.cfg.tie_embeddings:
            return self._head_weight().T
        return self._head_weight()

    def hidden(self, tokens_BxT, positions_BxT, cache: KVCache | None = None, layers=None):
        """Last-layer hidden states (before the final norm) and the updated cache; no head.
        `layers`: `DecodeWeights` from `decode_layers` (inside a decode loop)."""
        hidden_BxTxD, _, new_cache = self.hidden_features(tokens_BxT, positions_BxT, cache, layers)
        return hidden_BxTxD, new_cache

    def hidden_features(
        self, tokens_BxT, positions_BxT, cache: KVCache | None = None, layers=None, features=None
    ):
        """(last-layer hidden states, features, updated cache). The features are the outputs of
        decoder layers `features` (sorted indices) concatenated, `[B, T, F*D]`, from the same
        pass: what a draft reading several backbone layers consumes (`bebop/mtp.py`). None
        without `features`; the last hidden itself when `features` is the last layer alone
        (nothing is collected)."""
        x_BxTxD = sharding.constrain(self.embed_tokens(tokens_BxT), X_AXES)
        kv = None if cache is None else (cache.k, cache.v)
        offsets_B = None if cache is None else cache.lengths
        last_only = features is not None and tuple(features) == (self.cfg.num_layers - 1,)
        collect = None if features is None or last_only else tuple(features)
        out = run_blocks(
            self.layers,
            x_BxTxD,
            positions_BxT,
            kv,
            offsets_B,
            self.cfg.scan_layers,
            layers,
            self.cfg.remat,
            collect,
        )
        hidden_BxTxD, new_kv = out[:2]
        feats = out[2] if collect is not None else (hidden_BxTxD if last_only else None)
        new_cache = None if cache is None else cache.replace(k=new_kv[0], v=new_kv[1])
        return hidden_BxTxD, feats, new_cache

    def __call__(self, tokens_BxT, positions_BxT, cache: KVCache | None = None, layers=None):
        hidden_BxTxD, new_cache = self.hidden(tokens_BxT, positions_BxT, cache, layers)
        return self.logits_from_hidden(hidden_BxTxD, layers), hidden_BxTxD, new_cache

    def forward_features(self, tokens_BxT, positions_BxT, cache=None, layers=None, features=None):
        """`__call__` that also returns the features of `hidden_features`: (logits, hidden,
        features, cache)."""
        hidden_BxTxD, feats, new_cache = self.hidden_features(
            tokens_BxT, positions_BxT, cache, layers, features
        )
        return self.logits_from_hidden(hidden_BxTxD, layers), hidden_BxTxD, feats, new_cache


# ----------------------------------------------------------------------------- pure entry points


def init(cfg: ModelConfig, seed: int):
    """Returns (graphdef, params) of a freshly initialised policy."""
    return nnx.split(Policy(cfg, nnx.Rngs(params=seed)))


def abstract(cfg: ModelConfig):
    """(graphdef, params as ShapeDtypeStructs) without allocating weights."""
    return nnx.split(nnx.eval_shape(lambda: Policy(cfg, nnx.Rngs(params=0))))


def forward(graphdef, params, tokens_BxT, positions_BxT):
    logits, hidden, _ = nnx.merge(graphdef, params)(tokens_BxT, positions_BxT)
    return logits, hidden


def decode_layers(graphdef, params) -> DecodeWeights:
    """The weights laid out for decoding, in the compute dtype `cfg.dtype` (a copy of every
    weight; make it once per parameter version, e.g. with `decode_layers_jit`, and pass it as
    `layers=` to calls in a loop: the samplers make it per call from the parameters the learner
    published, so it follows every version)."""
    cfg = graphdef_config(graphdef, params)
    # cast where each weight is stored (split over the mesh), then gathered in the compute dtype
    policy = nnx.merge(graphdef, sharding.keep_stored_layout(to_compute(params, cfg)))
    head = policy.embed if policy.cfg.tie_embeddings else policy.lm_head
    head_DxV = head[...]
    head_DxV = head_DxV.T if policy.cfg.tie_embeddings else head_DxV
    block_gd = nnx.split(policy.layers)[0]
    fused = [nnx.split(fuse_block(nnx.merge(block_gd, s))) for s in unstack(policy.layers)]
    # replicated over the mesh: data-parallel decoding, no per-step gather (`sharding`)
    layer_states, head_DxV = sharding.decode_replicated(([s for _, s in fused], head_DxV))
    return DecodeWeights(layer_states, head_DxV, fused[0][0])


decode_layers_jit = jax.jit(decode_layers, static_argnums=0)


def extend(graphdef, params, cache: KVCache, tokens_BxT, num_new_B=None, layers=None):
    """Runs T new tokens per row at each row's offset; lengths advance by `num_new_B` (or T).
    `layers`: from `decode_layers`, when called inside a decode loop."""
    positions_BxT = cache.positions(tokens_BxT.shape[1])
    logits, hidden, cache = nnx.merge(graphdef, params)(tokens_BxT, positions_BxT, cache, layers)
    if num_new_B is None:
        num_new_B = jnp.full(cache.lengths.shape, tokens_BxT.shape[1], jnp.int32)
    return logits, hidden, cache.advance(num_new_B)


def new_cache(cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
    """A per-layer cache (a tuple of `[B, K, S, Dh]` arrays per side), split over the batch
    (`sharding.constrain`: never a replicated cache)."""
    cache = KVCache.init_per_layer(
        cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim, DTYPES[cfg.dtype]
    )
    pin = lambda a: sharding.constrain(a, KV_AXES)  # noqa: E731
    return cache.replace(
        k=tuple(map(pin, cache.k)),
        v=tuple(map(pin, cache.v)),
        lengths=sharding.constrain(cache.lengths, ("batch",)),
    )


def prefill(graphdef, params, tokens_BxT, lengths_B, max_len: int, layers=None):
    """Right-padded prompts: writes T slots, keeps `lengths_B` of them (pads get overwritten)"""
    cache = new_cache(graphdef_config(graphdef, params), tokens_BxT.shape[0], max_len)
    return extend(graphdef, params, cache, tokens_BxT, lengths_B, layers)


def prefill_last(graphdef, params, tokens_BxT, lengths_B, max_len: int, layers=None, group=1):
    """Like `prefill`, but projects only each row's last prompt position to logits (a full
    `[B, T, V]` would be large for big vocabularies). Returns (logits_BxV, hidden_BxTxD, cache).

    `group` > 1: the rows come in runs of `group` identical prompts (an RL batch's GRPO groups;
    the caller guarantees it: `sampling.check_prompt_groups`). The forward runs on the first row
    of each run and its outputs are repeated to the run's rows: 1/`group` of the prefill's work."""
    logits_BxV, hidden_BxTxD, _, cache = prefill_last_features(
        graphdef, params, tokens_BxT, lengths_B, max_len, None, layers, group
    )
    return logits_BxV, hidden_BxTxD, cache


def prefill_last_features(
    graphdef, params, tokens_BxT, lengths_B, max_len: int, features, layers=None, group=1
):
    """`prefill_last` that also returns the features of decoder layers `features`
    (`Policy.hidden_features`): (logits_BxV, hidden_BxTxD, features `[B, T, F*D]` or None,
    cache)."""
    if group > 1:
        if tokens_BxT.shape[0] % group:
            raise ValueError(f"prefill_last: {tokens_BxT.shape[0]} rows are not runs of {group}")
        runs = prefill_last_features(
            graphdef, params, tokens_BxT[::group], lengths_B[::group], max_len, features, layers
        )
        return jax.tree.map(lambda x: jnp.repeat(x, group, axis=0), runs)
    policy = nnx.merge(graphdef, params)
    cache = new_cache(policy.cfg, tokens_BxT.shape[0], max_len)
    positions_BxT = cache.positions(tokens_BxT.shape[1])
    hidden_BxTxD, feats, cache = policy.hidden_features(
        tokens_BxT, positions_BxT, cache, layers, features
    )
    last_Bx1xD = jnp.take_along_axis(hidden_BxTxD, (lengths_B - 1)[:, None, None], axis=1)
    logits_BxV = policy.logits_from_hidden(last_Bx1xD, layers)[:, 0]
    return logits_BxV, hidden_BxTxD, feats, cache.advance(lengths_B)


def graphdef_config(graphdef, params) -> ModelConfig:
    return nnx.merge(graphdef, params).cfg


def num_params(params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))
