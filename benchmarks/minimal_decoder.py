"""A minimal JAX decoder of a Llama-architecture model, written only as a speed yardstick for
`benchmarks.decode` (it shares no code with `bebop/model.py`).

The minimal decoder's design: Python-unrolled layers, each layer's weights separate arrays
pre-transposed to `[in, out]`, a tuple of per-layer `[B, K, S, Dh]` caches written with
`dynamic_update_slice` at ONE scalar position (every row has the same prompt), one jitted
`fori_loop`, greedy, no log-probs or entropy. It is what a decoder that cuts every corner costs.

    weights = from_hf_arrays(arrays, cfg)               # `gguf.read(path)` arrays, HF names
    tokens_BxN = generate(weights, cfg, prompt_BxP, num_new)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def from_hf_arrays(arrays: dict, cfg) -> dict:
    """HF-named `[out, in]` float32 arrays (numpy, or jax arrays already on the device) ->
    per-layer `[in, out]` jax arrays, cast and transposed on the device (fast at billions of
    parameters)."""
    dt = jnp.float32 if cfg.dtype == "float32" else jnp.bfloat16

    def put(x, transpose=False):
        y = jnp.asarray(x, jnp.float32).astype(dt)
        return y.T if transpose else y

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        t = {
            k: put(arrays[p + n], transpose=True)
            for k, n in (
                ("wq", "self_attn.q_proj.weight"),
                ("wk", "self_attn.k_proj.weight"),
                ("wv", "self_attn.v_proj.weight"),
                ("wo", "self_attn.o_proj.weight"),
                ("wg", "mlp.gate_proj.weight"),
                ("wu", "mlp.up_proj.weight"),
                ("wd", "mlp.down_proj.weight"),
            )
        }
        t["n1"] = put(arrays[p + "input_layernorm.weight"])
        t["n2"] = put(arrays[p + "post_attention_layernorm.weight"])
        layers.append(t)
    embed = arrays["model.embed_tokens.weight"]
    return {
        "layers": layers,
        "embed": put(embed),
        "head": put(arrays.get("lm_head.weight", embed), transpose=True),
        "norm": put(arrays["model.norm.weight"]),
    }


def _norm(x, w, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * w).astype(x.dtype)


def _rope(x_BxTxNxDh, pos_T, theta):
    dh = x_BxTxNxDh.shape[-1]
    ang = pos_T[:, None].astype(jnp.float32) * theta ** (-jnp.arange(0, dh, 2) / dh)
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    x1, x2 = x_BxTxNxDh[..., : dh // 2], x_BxTxNxDh[..., dh // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BxTxNxDh.dtype)


def _forward(w, cfg, tok_BxT, pos, caches):
    """T tokens at scalar position `pos` for every row; returns (logits_BxTxV, caches)."""
    b, t = tok_BxT.shape
    h, k, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = w["embed"][tok_BxT]
    pos_T = pos + jnp.arange(t)
    new = []
    for lw, (kc, vc) in zip(w["layers"], caches, strict=True):
        y = _norm(x, lw["n1"], cfg.norm_eps)
        q = _rope((y @ lw["wq"]).reshape(b, t, h, dh), pos_T, cfg.rope_theta)
        kk = _rope((y @ lw["wk"]).reshape(b, t, k, dh), pos_T, cfg.rope_theta)
        vv = (y @ lw["wv"]).reshape(b, t, k, dh)
        kc = jax.lax.dynamic_update_slice(kc, kk.transpose(0, 2, 1, 3), (0, 0, pos, 0))
        vc = jax.lax.dynamic_update_slice(vc, vv.transpose(0, 2, 1, 3), (0, 0, pos, 0))
        new.append((kc, vc))
        q = q.reshape(b, t, k, h // k, dh)
        s = jnp.einsum("btkgd,bksd->bkgts", q, kc).astype(jnp.float32) * dh**-0.5
        mask_TxS = jnp.arange(kc.shape[2])[None] <= pos_T[:, None]
        s = jnp.where(mask_TxS, s, -1e30)
        o = jnp.einsum("bkgts,bksd->btkgd", jax.nn.softmax(s, -1).astype(vc.dtype), vc)
        x = x + o.reshape(b, t, h * dh) @ lw["wo"]
        y = _norm(x, lw["n2"], cfg.norm_eps)
        x = x + (jax.nn.silu(y @ lw["wg"]) * (y @ lw["wu"])) @ lw["wd"]
    x = _norm(x, w["norm"], cfg.norm_eps)
    return (x @ w["head"]).astype(jnp.float32), tuple(new)


@functools.partial(jax.jit, static_argnames=("cfg", "num_new"))
def generate(w, cfg, prompt_BxP, num_new: int):
    """Greedy: `num_new` tokens per row after a full (unpadded) prompt."""
    b, p = prompt_BxP.shape
    dt = w["embed"].dtype
    shape = (b, cfg.num_kv_heads, p + num_new, cfg.head_dim)
    caches = tuple((jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(cfg.num_layers))
    logits, caches = _forward(w, cfg, prompt_BxP, 0, caches)
    out = jnp.zeros((b, num_new), jnp.int32).at[:, 0].set(jnp.argmax(logits[:, -1], -1))

    def body(i, carry):
        out, caches = carry
        prev_Bx1 = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)
        logits, caches = _forward(w, cfg, prev_Bx1, p + i - 1, caches)
        tok_Bx1 = jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)
        return jax.lax.dynamic_update_slice(out, tok_Bx1, (0, i)), caches

    return jax.lax.fori_loop(1, num_new, body, (out, caches))[0]
