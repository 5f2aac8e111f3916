"""One entry point for the policy a stage runs on: the run's SFT checkpoint, a GGUF file, or a
Hugging Face directory (`RunConfig.policy`). Returns (graphdef, params on the mesh, tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

from bebop.config import RunConfig
from bebop.tokenizer import BPETokenizer, CharTokenizer


def load(cfg: RunConfig, workdir: Path, mesh):
    src = cfg.policy
    if src.source == "sft":
        from bebop import sft

        graphdef, params = sft.load_policy(cfg, workdir, mesh)
        return graphdef, params, CharTokenizer()
    if src.source == "gguf":
        from bebop.checkpoints import gguf

        loaded, tok = gguf.load(
            gguf.find_smollm2(src.path or None), mesh, cfg.model.dtype, cfg.model.scan_layers
        )
        return loaded.graphdef, loaded.params, tok
    from bebop.checkpoints import hf

    loaded = hf.load(src.path, mesh, cfg.model.dtype, cfg.model.scan_layers)
    tok_file = Path(src.path) / "tokenizer.json"
    if not tok_file.exists():
        raise FileNotFoundError(f"{tok_file}: the policy directory needs a tokenizer.json")
    gen = Path(src.path) / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id", 0) if gen.exists() else 0
    eos_ids = eos if isinstance(eos, list) else [eos]
    tok = BPETokenizer.from_file(tok_file, eos_ids=eos_ids, pad_id=eos_ids[0])
    return loaded.graphdef, loaded.params, tok
