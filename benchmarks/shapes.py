"""Random-weight models at real shapes for the decode and rollout benchmarks (no checkpoint file
needed), and the bytes a decode step reads.

    cfg = model_config("qwen3_8b", layers=4, dtype="bfloat16")
    graphdef, params = random_params(cfg)        # on the device
    arrays = hf_arrays(params)                   # HF-named, for benchmarks.minimal_decoder
    step = decode_step_bytes(layers, cfg, batch=8, context=96)

Shapes (`SHAPES`): SmolLM2-135M's (30 layers, width 576, MLP 1536, 9 query / 3 KV heads of 64,
vocabulary 49152, tied head); Qwen3-8B's widths (4096, MLP 12288, 32 / 8 heads of 128,
vocabulary 151936, separate head; its 36 layers, or the first `layers` of them) as a
Llama-architecture model (no q/k norms: `benchmarks.minimal_decoder` decodes the same
weights); `tiny`, for dry runs on a CPU. Weights (N(0, 0.02²), norm scales 1) are drawn on the
device: the same bytes move through the same kernels as a trained model's (outputs are noise).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from bebop.config import ModelConfig

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


def random_params(cfg: ModelConfig, seed: int = 0, std: float = 0.02):
    """(graphdef, params) of a random `cfg` policy, drawn on the default device (seconds at
    billions of parameters, where drawing them in numpy on the host took minutes): weights
    N(0, std²) in `cfg.param_dtype`, norm scales 1."""
    import jax
    import jax.numpy as jnp

    from bebop import model

    graphdef, abstract = model.abstract(cfg)
    key = jax.random.key(seed)
    count = [0]

    def draw(path, x):
        if "scale" in jax.tree_util.keystr(path):
            return jnp.ones(x.shape, x.dtype)
        count[0] += 1
        k = jax.random.fold_in(key, count[0])
        return (std * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)

    return graphdef, jax.tree_util.tree_map_with_path(draw, abstract)


def hf_arrays(params) -> dict:
    """HF-named arrays (the names and layouts bebop's HF loader reads) of bebop `params`, made on
    the device holding them (`names.to_hf`'s transposes and reshapes)."""
    from bebop.checkpoints import hf, names

    out = {}
    for path, var in hf._paths(params):
        x = var.get_value()
        for i in range(x.shape[0]) if path.startswith("layers.") else [None]:
            name, kind = hf._policy_name(path, i)
            out[name] = names.to_hf(kind, x if i is None else x[i])
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
