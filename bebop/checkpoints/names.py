"""The one table between Hugging Face tensor names/layouts and bebop parameter paths.

Policy (Qwen3 / Qwen2 / Llama): `model.embed_tokens`, `model.layers.{i}.*`, `model.norm`,
`lm_head`. MTP layers, three published layouts (`MTP_FORMATS`):
  - `qwen3_5`: `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`,
    `mtp.norm` (one MTP layer);
  - `mimo`: `model.mtp_layers.{j}.{token_layernorm,hidden_layernorm,input_proj,final_layernorm}`
    plus the decoder-layer names; MiMo concatenates [hidden ; embedding] (bebop: [e ; h]);
  - `deepseek_v3`: `model.layers.{L+j}.{enorm,hnorm,eh_proj,shared_head.norm}` plus the decoder
    names under the same prefix (usable when that block is of the policy's type).
bebop's extensions (no published checkpoint has them; `MTP_EXTENSIONS`): an MTP reading several
backbone layers (`mtp.features`) has one fusion projection, HF shape `[D, F*D]` (a torch Linear:
`[out, in]`; input columns are the F layers' hidden states in increasing layer order, D each):
`mtp.fc_features.weight` (qwen3_5), `model.mtp_layers.0.fc_features.weight` (mimo),
`model.layers.{L}.fc_features.weight` (deepseek_v3). With `mtp.depth` > 1 the decoder block i
(0-based, run in that order) of MTP layer j is: `mtp.layers.{i}.*` (qwen3_5, one MTP layer;
block 0 is the usual `mtp.layers.0`), `model.mtp_layers.{j}.blocks.{i}.*` (mimo) and
`model.layers.{L+j}.blocks.{i}.*` (deepseek_v3) for i >= 1, block 0 under the usual prefix. The
feature layers and depth are recorded in config.json as `"bebop_mtp": {"features": [...],
"depth": d}` (absent: the last layer, depth 1).

Layout transforms (`kind`), bebop shape <- HF shape:
  id        same array
  T         [in, out] <- [out, in]
  T_heads   [D, N, Dh] <- [N*Dh, D]        (q/k/v projections)
  heads_T   [H, Dh, D] <- [D, H*Dh]        (o projection)
  heads_vec [N, Dh] <- [N*Dh]              (q/k/v biases)
  T_swap    [2D, D] <- [D, 2D] with the two input halves swapped (MiMo's [h ; e])
"""

from __future__ import annotations

import numpy as np

POLICY = {
    "embed": ("model.embed_tokens.weight", "id"),
    "final_norm.scale": ("model.norm.weight", "id"),
    "lm_head": ("lm_head.weight", "T"),
}

DECODER_LAYER = {
    "attn_norm.scale": ("input_layernorm.weight", "id"),
    "mlp_norm.scale": ("post_attention_layernorm.weight", "id"),
    "attn.wq": ("self_attn.q_proj.weight", "T_heads"),
    "attn.wk": ("self_attn.k_proj.weight", "T_heads"),
    "attn.wv": ("self_attn.v_proj.weight", "T_heads"),
    "attn.wo": ("self_attn.o_proj.weight", "heads_T"),
    "attn.bq": ("self_attn.q_proj.bias", "heads_vec"),
    "attn.bk": ("self_attn.k_proj.bias", "heads_vec"),
    "attn.bv": ("self_attn.v_proj.bias", "heads_vec"),
    "attn.q_norm.scale": ("self_attn.q_norm.weight", "id"),
    "attn.k_norm.scale": ("self_attn.k_norm.weight", "id"),
    "mlp.w_gate": ("mlp.gate_proj.weight", "T"),
    "mlp.w_up": ("mlp.up_proj.weight", "T"),
    "mlp.w_down": ("mlp.down_proj.weight", "T"),
}

POLICY_LAYER_PREFIX = "model.layers.{i}."

# bebop MTP-layer path -> (HF name relative to the format's prefix, kind); "block." paths use
# DECODER_LAYER under `block_prefix`.
MTP_FORMATS = {
    "qwen3_5": {
        "prefix": "mtp.",
        "block_prefix": "mtp.layers.{j}.",
        "max_layers": 1,
        "emb_norm.scale": ("pre_fc_norm_embedding.weight", "id"),
        "hid_norm.scale": ("pre_fc_norm_hidden.weight", "id"),
        "w_fc": ("fc.weight", "T"),
        "out_norm.scale": ("norm.weight", "id"),
    },
    "mimo": {
        "prefix": "model.mtp_layers.{j}.",
        "block_prefix": "model.mtp_layers.{j}.",
        "max_layers": None,
        "emb_norm.scale": ("token_layernorm.weight", "id"),
        "hid_norm.scale": ("hidden_layernorm.weight", "id"),
        "w_fc": ("input_proj.weight", "T_swap"),
        "out_norm.scale": ("final_layernorm.weight", "id"),
    },
    "deepseek_v3": {
        "prefix": "model.layers.{L_plus_j}.",
        "block_prefix": "model.layers.{L_plus_j}.",
        "max_layers": None,
        "emb_norm.scale": ("enorm.weight", "id"),
        "hid_norm.scale": ("hnorm.weight", "id"),
        "w_fc": ("eh_proj.weight", "T"),
        "out_norm.scale": ("shared_head.norm.weight", "id"),
    },
}

# bebop's MTP extensions by format (see the module doc): the fusion projection of several
# backbone layers, and where a layer's blocks past the first live ({i}: the block index).
MTP_EXTENSIONS = {
    "qwen3_5": {"fc_features": "mtp.fc_features.weight", "depth_prefix": "mtp.layers.{i}."},
    "mimo": {
        "fc_features": "model.mtp_layers.0.fc_features.weight",
        "depth_prefix": "model.mtp_layers.{j}.blocks.{i}.",
    },
    "deepseek_v3": {
        "fc_features": "model.layers.{L}.fc_features.weight",
        "depth_prefix": "model.layers.{L_plus_j}.blocks.{i}.",
    },
}

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def mtp_name(fmt: str, path: str, j: int | None, num_policy_layers: int) -> tuple[str, str]:
    """HF (name, kind) of bebop MTP path `path`: an MTP-layer path (e.g. 'w_fc',
    'block.attn.wq', 'block_1.attn.wq' for the layer's second block) of MTP layer `j`, or the
    MTP's own 'fc_features' (`j` None)."""
    f, ext = MTP_FORMATS[fmt], MTP_EXTENSIONS[fmt]
    if path == "fc_features":
        return ext["fc_features"].format(L=num_policy_layers), "T"
    fill = {"j": j, "L_plus_j": num_policy_layers + j}
    head, _, rest = path.partition(".")
    if head == "block" or head.startswith("block_"):
        i = 0 if head == "block" else int(head[len("block_") :])
        name, kind = DECODER_LAYER[rest]
        prefix = f["block_prefix"] if i == 0 else ext["depth_prefix"]
        return prefix.format(i=i, **fill) + name, kind
    name, kind = f[path]
    return f["prefix"].format(**fill) + name, kind


def detect_mtp_format(names, num_policy_layers: int) -> str | None:
    if any(n.startswith("mtp.") for n in names):
        return "qwen3_5"
    if any(n.startswith("model.mtp_layers.") for n in names):
        return "mimo"
    if any(n.startswith(f"model.layers.{num_policy_layers}.") for n in names):
        return "deepseek_v3"
    return None


def hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor shape holding a bebop array of `shape` (without the layer axis)."""
    if kind == "id":
        return shape
    if kind in ("T", "T_swap"):
        return shape[::-1]
    if kind == "T_heads":
        return (shape[1] * shape[2], shape[0])
    if kind == "heads_T":
        return (shape[2], shape[0] * shape[1])
    if kind == "heads_vec":
        return (shape[0] * shape[1],)
    raise KeyError(kind)


def _bounds(s: slice, dim: int) -> tuple[int, int]:
    start, stop, step = s.indices(dim)
    if step != 1:
        raise ValueError("strided shards are not supported")
    return start, stop


def read_slice(kind: str, read, shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """The bebop-layout block `index` of an array of `shape`, from `read(hf_index)` which returns
    the HF-layout block. Only the block is read (safetensors lazy slices)."""
    b = [_bounds(s, d) for s, d in zip(index, shape, strict=True)]
    if kind == "id":
        return read(tuple(slice(*x) for x in b))
    if kind == "T":
        return read((slice(*b[1]), slice(*b[0]))).T
    if kind == "T_swap":  # bebop rows [e ; h] <- HF columns [h ; e]
        full = read((slice(*b[1]), slice(None))).T
        half = full.shape[0] // 2
        return np.concatenate([full[half:], full[:half]])[slice(*b[0])]
    dh = shape[-1] if kind != "heads_T" else shape[1]
    if kind == "T_heads":
        (d0, d1), (n0, n1), dh_b = b
        assert dh_b == (0, dh), "head_dim must not be sharded"
        arr = read((slice(n0 * dh, n1 * dh), slice(d0, d1)))
        return arr.reshape(n1 - n0, dh, d1 - d0).transpose(2, 0, 1)
    if kind == "heads_T":
        (h0, h1), dh_b, (d0, d1) = b
        assert dh_b == (0, dh), "head_dim must not be sharded"
        return read((slice(d0, d1), slice(h0 * dh, h1 * dh))).T.reshape(h1 - h0, dh, d1 - d0)
    if kind == "heads_vec":
        (n0, n1), dh_b = b
        return read((slice(n0 * dh, n1 * dh),)).reshape(n1 - n0, dh)
    raise KeyError(kind)


def to_hf(kind: str, x: np.ndarray) -> np.ndarray:
    """Inverse of `read_slice` on a whole array (export)."""
    if kind == "id":
        return x
    if kind == "T":
        return x.T
    if kind == "T_swap":
        half = x.shape[0] // 2
        return np.concatenate([x[half:], x[:half]]).T
    if kind == "T_heads":
        return x.transpose(1, 2, 0).reshape(x.shape[1] * x.shape[2], x.shape[0])
    if kind == "heads_T":
        return x.reshape(x.shape[0] * x.shape[1], x.shape[2]).T
    if kind == "heads_vec":
        return x.reshape(-1)
    raise KeyError(kind)
