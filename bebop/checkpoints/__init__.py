"""Checkpoint formats (`hf`: Hugging Face safetensors in and out, `gguf`: llama.cpp files in) and
`LoadedPolicy`, the one type every policy loader returns (`hf.load`, `gguf.load`,
`policies.load`)."""

from __future__ import annotations

import dataclasses

from bebop.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class LoadedPolicy:
    """A policy on the mesh, and what came with it."""

    cfg: ModelConfig  # the architecture (read from the checkpoint for GGUF / HF)
    graphdef: object
    params: object
    # The tokenizer: None from `hf.load` (safetensors hold none; `policies.load` adds it).
    tok: object | None = None
    mtp: tuple | None = None  # (graphdef, params) of the MTP layers the checkpoint ships
    mtp_format: str | None = None  # their layout, a key of `names.MTP_FORMATS`
