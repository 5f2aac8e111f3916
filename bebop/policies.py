"""Loading what a stage runs on, without building any optimizer:

- `load`: the policy (`RunConfig.policy`): this run's SFT checkpoint, a GGUF file, or a Hugging
  Face directory. Returns (graphdef, params on the mesh, tokenizer).
- `init_mtp`: a fresh MTP (random or from the backbone's last layer) or `mtp.init_from`;
  `load_mtp`: a trained one from an `mtp` stage's checkpoints, with its draft vocabulary.
- `load_rl`: the policy and MTP parameters of this run's `rl` checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax

from bebop import model, sharding
from bebop import mtp as mtp_lib
from bebop.ckpt import restore_params, restore_partial
from bebop.config import ModelConfig, RunConfig, check_vocab
from bebop.tokenizer import BPETokenizer, CharTokenizer


def load(cfg: RunConfig, workdir: Path, mesh):
    src = cfg.policy
    if src.source == "sft":  # the demo policy trained by this run's `sft` stage
        graphdef, abstract = model.abstract(cfg.model)
        params = restore_params(Path(workdir) / "sft" / "ckpt", abstract, mesh)
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


def abstract_mtp(pol_cfg: ModelConfig, num_layers: int):
    """(graphdef, params as ShapeDtypeStructs) of an MTP, without allocating weights."""
    return mtp_lib.abstract(pol_cfg, num_layers)


def init_mtp(cfg: RunConfig, pol_cfg: ModelConfig, mesh, pol_params=None):
    """(graphdef, params) of a fresh MTP (`mtp.init`: random, or the backbone's last layer, which
    needs `pol_params`), or of `mtp.init_from`, on the mesh."""
    graphdef, params = mtp_lib.init(pol_cfg, cfg.mtp.num_layers, cfg.seed + 100)
    if cfg.mtp.init_from:
        params = restore_params(Path(cfg.mtp.init_from), params, mesh)
    elif cfg.mtp.init == "last_layer":
        params = mtp_lib.init_from_last_layer(params, jax.device_get(pol_params))
    return graphdef, sharding.place_state(params, mesh)


def load_mtp(cfg: RunConfig, ckpt_dir: Path, pol_cfg: ModelConfig, mesh):
    """(graphdef, params on the mesh, draft vocabulary or None) of the MTP whose checkpoints are
    in `ckpt_dir` (an `mtp` stage's `DIR/mtp/ckpt`; its draft vocabulary sits next to it)."""
    ckpt_dir = Path(ckpt_dir)
    graphdef, abstract = abstract_mtp(pol_cfg, cfg.mtp.num_layers)
    params = restore_params(ckpt_dir, abstract, mesh)
    vocab = mtp_lib.load_draft_vocab(ckpt_dir.parent, pol_cfg.vocab_size)
    return graphdef, params, vocab


def load_rl(cfg: RunConfig, workdir: Path, mesh):
    """(policy params, MTP params) from this run's `rl` checkpoints (for `policy.source=sft`,
    whose architecture is `cfg.model`)."""
    _, pol_abstract = model.abstract(cfg.model)
    _, mtp_abstract = abstract_mtp(cfg.model, cfg.mtp.num_layers)
    target = {
        "policy": {"params": sharding.abstract_on_mesh(pol_abstract, mesh)},
        "mtp": {"params": sharding.abstract_on_mesh(mtp_abstract, mesh)},
    }
    state = restore_partial(Path(workdir) / "rl" / "ckpt", target)
    return state["policy"]["params"], state["mtp"]["params"]
