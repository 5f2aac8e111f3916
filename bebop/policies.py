"""One entry point for the policy a stage runs on: the run's SFT checkpoint, a GGUF file, or a
Hugging Face directory (`RunConfig.policy`). Returns (graphdef, params on the mesh, tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

from flax import nnx

from bebop.config import RunConfig, check_vocab
from bebop.tokenizer import BPETokenizer, CharTokenizer


def load(cfg: RunConfig, workdir: Path, mesh):
    src = cfg.policy
    if src.source == "sft":
        from bebop import sft

        graphdef, params = sft.load_policy(cfg, workdir, mesh)
        return graphdef, params, CharTokenizer()
    if src.source == "gguf":
        from bebop.checkpoints import gguf

        path = gguf.find_smollm2(src.path or None)
        loaded, tok = gguf.load(path, mesh, cfg.model.dtype, cfg.model.scan_layers)
        check_vocab(tok.vocab_size, loaded.cfg.vocab_size, str(path), str(path))
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
    check_vocab(tok.vocab_size, loaded.cfg.vocab_size, str(tok_file), str(Path(src.path)))
    return loaded.graphdef, loaded.params, tok


def load_mtp(cfg: RunConfig, ckpt_dir: Path, pol_cfg, mesh):
    """(graphdef, params on the mesh, draft vocabulary or None) of the MTP whose checkpoints are
    in `ckpt_dir` (an `mtp` stage's `DIR/mtp/ckpt`; its draft vocabulary sits next to it)."""
    from bebop import mtp as mtp_lib
    from bebop.fit import restore_params
    from bebop.train import make_optimizer

    ckpt_dir = Path(ckpt_dir)
    graphdef, abstract = nnx.split(
        nnx.eval_shape(lambda: mtp_lib.MTP(pol_cfg, cfg.mtp.num_layers, nnx.Rngs(params=0)))
    )
    optimizer = make_optimizer(cfg.mtp.optim, cfg.mtp.steps)
    params = restore_params(ckpt_dir, abstract, optimizer, mesh)
    vocab = mtp_lib.load_draft_vocab(ckpt_dir.parent, pol_cfg.vocab_size)
    return graphdef, params, vocab
