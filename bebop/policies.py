"""Loading what a stage runs on, without building any optimizer:

- `load`: the policy (`RunConfig.policy`): this run's SFT checkpoint, a GGUF file, or a Hugging
  Face directory (`hf_dir`: `policy.path`, or a tiny random one built in the workdir for
  `tiny:KIND`), as a `LoadedPolicy` (architecture, graphdef, params on the mesh, tokenizer, and
  the MTP layers an HF checkpoint ships).
- `init_mtp`: the MTP a stage starts from: `mtp.init_from`, else by `mtp.init` a random one, one
  from the backbone's last layer, or the checkpoint's shipped MTP layers (`checkpoint`);
  `load_mtp`: a trained one from an `mtp` stage's checkpoints, with its draft vocabulary.
- `load_rl`: the policy and MTP parameters of this run's `rl` checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
from flax import nnx

from bebop import model, sharding
from bebop import mtp as mtp_lib
from bebop.checkpoints import LoadedPolicy
from bebop.checkpoints.tokenizer_files import read_char_tokenizer
from bebop.ckpt import restore_params, restore_partial
from bebop.config import (
    ConfigError,
    ModelConfig,
    MTPConfig,
    PolicyConfig,
    check_vocab,
    resolve_features,
)
from bebop.finite import check_finite
from bebop.tokenizer import BPETokenizer, CharTokenizer


def load(src: PolicyConfig, run_model: ModelConfig, workdir: Path, mesh) -> LoadedPolicy:
    """The policy the `policy` section names, its weights checked finite
    (`finite.check_finite`); `run_model`: the `model` section (the architecture of
    `policy.source=sft`, the dtypes and run knobs of a checkpoint's)."""
    loaded, where = _load(src, run_model, workdir, mesh)
    check_finite(loaded.params, f"the policy ({where})")
    if loaded.mtp is not None:
        check_finite(loaded.mtp[1], f"the MTP layers the policy ships ({where})")
    return loaded


def _load(src: PolicyConfig, m: ModelConfig, workdir: Path, mesh) -> tuple[LoadedPolicy, str]:
    if src.source == "sft":  # the demo policy trained by this run's `sft` stage
        graphdef, abstract = model.abstract(m)
        ckpt_dir = Path(workdir) / "sft" / "ckpt"
        params = restore_params(ckpt_dir, abstract, mesh)
        return LoadedPolicy(m, graphdef, params, CharTokenizer()), str(ckpt_dir)
    if src.source == "gguf":
        from bebop.checkpoints import gguf

        path = gguf.find_smollm2(src.path or None)
        loaded = gguf.load(path, mesh, m.dtype, m.scan_layers, m.param_dtype, src.num_layers)
        check_vocab(loaded.tok.vocab_size, loaded.cfg.vocab_size, str(path), str(path))
        return with_run_knobs(loaded, m), str(path)
    from bebop.checkpoints import hf

    path = hf_dir(src, workdir)
    loaded = hf.load(path, mesh, m.dtype, m.scan_layers, m.param_dtype, src.num_layers)
    tok = hf_tokenizer(path)
    check_vocab(tok.vocab_size, loaded.cfg.vocab_size, f"{path}/tokenizer.json", str(path))
    return dataclasses.replace(with_run_knobs(loaded, m), tok=tok), str(path)


# `ModelConfig` fields that are how bebop runs an architecture, not part of it: a checkpoint's
# architecture takes them from the run's `model.*` keys.
RUN_KNOBS = ("remat", "attention", "attention_chunk")


def with_run_knobs(loaded: LoadedPolicy, run_model: ModelConfig) -> LoadedPolicy:
    """A checkpoint's policy with the run's `RUN_KNOBS` (`model.remat`, `model.attention`, ...)
    in its architecture and graph (the parameters are unchanged)."""
    knobs = {k: getattr(run_model, k) for k in RUN_KNOBS}
    if all(getattr(loaded.cfg, k) == v for k, v in knobs.items()):
        return loaded
    cfg = dataclasses.replace(loaded.cfg, **knobs)
    return dataclasses.replace(loaded, cfg=cfg, graphdef=model.abstract(cfg)[0])


def hf_dir(src: PolicyConfig, workdir: Path) -> Path:
    """The Hugging Face directory of `policy.source=hf`: `policy.path`, or for
    `policy.path="tiny:KIND"` the tiny random checkpoint `<workdir>/tiny_hf/KIND`, built on first
    use (`bebop/checkpoints/tiny.py`)."""
    from bebop.checkpoints import tiny

    kind = tiny.kind_of(src.path)
    return Path(src.path) if kind is None else tiny.ensure(workdir, kind)


def hf_tokenizer(directory: Path) -> BPETokenizer:
    """The tokenizer of a Hugging Face directory (`tokenizer.json`; EOS ids from
    `generation_config.json`). The demo's character tokenizer, as `bebop.export` writes it, is
    read back as a `CharTokenizer` (raw task prompts, no chat template)."""
    tok_file = Path(directory) / "tokenizer.json"
    if not tok_file.exists():
        raise FileNotFoundError(f"{tok_file}: the policy directory needs a tokenizer.json")
    char = read_char_tokenizer(tok_file)
    if char is not None:
        return char
    gen = Path(directory) / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id", 0) if gen.exists() else 0
    eos_ids = eos if isinstance(eos, list) else [eos]
    return BPETokenizer.from_file(tok_file, eos_ids=eos_ids, pad_id=eos_ids[0])


def abstract_mtp(pol_cfg: ModelConfig, mtp_cfg: MTPConfig):
    """(graphdef, params as ShapeDtypeStructs) of the MTP `mtp_cfg` describes (`num_layers`,
    `features`, `depth`) for the policy `pol_cfg`, without allocating weights."""
    return mtp_lib.abstract(pol_cfg, mtp_cfg.num_layers, mtp_cfg.features, mtp_cfg.depth)


def init_mtp(m: MTPConfig, src: PolicyConfig, seed: int, policy: LoadedPolicy, mesh):
    """(graphdef, params) on the mesh of the MTP a stage starts from: `m.init_from`, else by
    `m.init` a random one (from the run's `seed`), the backbone's last layer, or the MTP layers
    `policy`'s checkpoint (`src`) ships (`checkpoint`)."""
    if not m.init_from and m.init == "checkpoint":
        graphdef, params = shipped_mtp(m, src, policy)
        return graphdef, sharding.place_state(params, mesh)
    graphdef, params = mtp_lib.init(policy.cfg, m.num_layers, seed + 100, m.features, m.depth)
    if m.init_from:
        params = restore_mtp(Path(m.init_from), params, mesh, "mtp.init_from")
    elif m.init == "last_layer":
        params = mtp_lib.init_from_last_layer(params, jax.device_get(policy.params))
    return graphdef, sharding.place_state(params, mesh)


def shipped_mtp(m: MTPConfig, src: PolicyConfig, policy: LoadedPolicy):
    """(graphdef, params) of the MTP layers the policy checkpoint `src` ships
    (`mtp.init=checkpoint`), checked against the MTP section `m`, or an error naming the key and
    the checkpoint."""
    where = f"policy.source={src.source!r}" + (f" ({src.path})" if src.path else "")
    if policy.mtp is None:
        raise ConfigError(
            f"config key 'mtp.init': 'checkpoint' starts the MTP from the MTP layers the policy "
            f"checkpoint ships, but {where} has none; use mtp.init='random' or 'last_layer', or "
            "mtp.init_from=DIR"
        )
    shipped = nnx.merge(*policy.mtp)
    want = {
        "num_layers": m.num_layers,
        "features": resolve_features(m.features, policy.cfg.num_layers),
        "depth": m.depth,
    }
    for key, value in want.items():
        got = getattr(shipped, key)
        if got != value:
            what = f"{got} MTP layer(s)" if key == "num_layers" else f"MTP layers with {key}={got}"
            raise ConfigError(
                f"config key 'mtp.{key}': {value}, but {where} ships {what} "
                f"({policy.mtp_format} format) for mtp.init='checkpoint'"
            )
    return policy.mtp


def restore_mtp(ckpt_dir: Path, abstract, mesh, key: str):
    """The MTP params of the checkpoints in `ckpt_dir`, checked finite; a directory that holds
    something else (an sft or rl checkpoint, another architecture) is a `ConfigError` naming
    `key`, what the directory holds and what was expected."""
    from bebop.ckpt import CheckpointRestoreError, describe, saved_keys

    expected = "an MTP checkpoint (an mtp stage's DIR/mtp/ckpt)"
    try:
        params = restore_params(ckpt_dir, abstract, mesh)
    except CheckpointRestoreError as e:
        raise ConfigError(
            f"config key '{key}': {ckpt_dir} holds {describe(saved_keys(ckpt_dir))} that does "
            f"not fit this MTP ({e}); expected {expected} of this policy with mtp.num_layers "
            "layers of mtp.depth blocks reading mtp.features"
        ) from e
    leaves = jax.tree.leaves(params)
    if not leaves or not all(isinstance(x, jax.Array) for x in leaves):  # keys it does not hold
        raise ConfigError(
            f"config key '{key}': {ckpt_dir} holds {describe(saved_keys(ckpt_dir))}, "
            f"expected {expected}"
        )
    check_finite(params, f"the MTP in {ckpt_dir}")
    return params


def load_mtp(mtp: MTPConfig, ckpt_dir: Path, pol_cfg: ModelConfig, mesh):
    """(graphdef, params on the mesh, draft vocabulary or None) of the MTP (`mtp` section) whose
    checkpoints are in `ckpt_dir` (an `mtp` stage's `DIR/mtp/ckpt`; its draft vocabulary sits
    next to it) on the policy architecture `pol_cfg`."""
    ckpt_dir = Path(ckpt_dir)
    graphdef, abstract = abstract_mtp(pol_cfg, mtp)
    params = restore_mtp(ckpt_dir, abstract, mesh, "mtp.init_from")
    vocab = mtp_lib.load_draft_vocab(ckpt_dir.parent, pol_cfg.vocab_size)
    return graphdef, params, vocab


def load_rl(mtp: MTPConfig, workdir: Path, mesh, pol_cfg: ModelConfig):
    """(policy params, MTP params) from this run's `rl` checkpoints; `pol_cfg`: the policy's
    architecture (`LoadedPolicy.cfg`; for `policy.source=sft`, the `model` section)."""
    _, pol_abstract = model.abstract(pol_cfg)
    _, mtp_abstract = abstract_mtp(pol_cfg, mtp)
    target = {
        "policy": {"params": sharding.abstract_on_mesh(pol_abstract, mesh)},
        "mtp": {"params": sharding.abstract_on_mesh(mtp_abstract, mesh)},
    }
    state = restore_partial(Path(workdir) / "rl" / "ckpt", target)
    return state["policy"]["params"], state["mtp"]["params"]
