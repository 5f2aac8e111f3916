"""Random-weight models at real shapes for the decode and rollout benchmarks (no checkpoint file
needed), and the bytes a decode step reads.

    cfg = model_config("qwen3_8b", layers=4, dtype="bfloat16")
    arrays = random_hf_arrays(cfg)               # HF-named float32 numpy arrays
    step = decode_step_bytes(layers, cfg, batch=8, context=96)

Shapes (`SHAPES`): SmolLM2-135M's (30 layers, width 576, MLP 1536, 9 query / 3 KV heads of 64,
vocabulary 49152, tied head); Qwen3-8B's widths (4096, MLP 12288, 32 / 8 heads of 128,
vocabulary 151936, separate head; its 36 layers, or the first `layers` of them) as a
Llama-architecture model (no q/k norms: `benchmarks/minimal_decoder.py` decodes the same
weights); `tiny`, for dry runs on a CPU. Weights are a 2^20-value random block (N(0, 0.02²))
repeated over each tensor at a per-tensor offset: fast to build at billions of parameters, and
the same bytes move through the same kernels as a trained model's (outputs are noise).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bebop.config import ModelConfig  # noqa: E402

SHAPES = {
    "smollm2": dict(
        vocab_size=49152,
        dim=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        ffw_dim=1536,
        rope_theta=100000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
    ),
    "qwen3_8b": dict(
        vocab_size=151936,
        dim=4096,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        ffw_dim=12288,
        rope_theta=1e6,
        tie_embeddings=False,
    ),
    "tiny": dict(
        vocab_size=256,
        dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        ffw_dim=128,
        tie_embeddings=False,
    ),
}
BLOCK = 1 << 20  # values in the random block each tensor repeats


def model_config(shape: str, layers: int = 0, dtype: str = "bfloat16") -> ModelConfig:
    """The `ModelConfig` of `shape` (a key of `SHAPES`), cut to its first `layers` decoder layers
    (0: all), computing in `dtype` with float32 parameters."""
    if shape not in SHAPES:
        raise ValueError(f"--shape {shape!r} unknown; known: {sorted(SHAPES)}")
    cfg = ModelConfig(**SHAPES[shape], dtype=dtype, param_dtype="float32")
    if layers < 0 or layers > cfg.num_layers:
        raise ValueError(f"--layers {layers}: {shape} has {cfg.num_layers} layers (0: all)")
    cfg = dataclasses.replace(cfg, num_layers=layers or cfg.num_layers)
    cfg.validate()
    return cfg


def random_hf_arrays(cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> dict:
    """HF-named float32 arrays of a random `cfg` model (the names and shapes bebop's HF loader
    reads): norm scales 1, every other tensor the random block repeated from its own offset."""
    from bebop import model
    from bebop.checkpoints import hf, names

    block = std * np.random.default_rng(seed).standard_normal(BLOCK, dtype=np.float32)
    _, abstract = model.abstract(cfg)
    out = {}
    for path, var in hf._paths(abstract):
        shape = var.get_value().shape
        stacked = path.startswith("layers.")
        inner = shape[1:] if stacked else shape
        for i in range(shape[0]) if stacked else [None]:
            name, kind = hf._policy_name(path, i)
            hf_shape = names.hf_shape(kind, inner)
            if path.endswith("scale"):
                out[name] = np.ones(hf_shape, np.float32)
            else:
                start = (7919 * len(out)) % BLOCK
                out[name] = np.resize(np.roll(block, -start), hf_shape)
    return out


def random_prompts(cfg: ModelConfig, num: int, seed: int = 0, lo: int = 24, hi: int = 40):
    """`num` prompts of random token ids, `lo` to `hi` tokens each (ids >= 1: 0 pads)."""
    rng = np.random.default_rng(seed)
    return [
        rng.integers(1, cfg.vocab_size, int(rng.integers(lo, hi + 1))).tolist() for _ in range(num)
    ]


def decode_step_bytes(layers, cfg: ModelConfig, batch: int, context: float) -> dict:
    """Bytes one decode step reads from memory: every array of the decode weights (`layers`,
    `model.decode_layers`' output: the fused layer matrices, norms and the `[D, V]` head, in
    their own dtype), the `batch` rows' embedding rows, and the KV cache of `context` tokens per
    row (keys and values of every layer, in `cfg.dtype`)."""
    import jax

    item = 2 if cfg.dtype == "bfloat16" else 4
    weights = sum(x.nbytes for x in jax.tree.leaves(layers))
    embed = batch * cfg.dim * item
    kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * context * item
    return {"weights": int(weights), "embed_rows": int(embed), "kv": float(kv)}


class RandomTokenizer:
    """What the benchmarks use of a tokenizer, for random models: no EOS (every row runs to the
    token budget), pad 0."""

    eos_ids = (-1,)
    pad_id = 0
