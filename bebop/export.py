"""Export a run's policy (+ MTP) to a Hugging Face directory that transformers loads (vLLM reads
the same layout).

    python -m bebop.export --workdir runs/demo --out hf/demo [--stage rl|sft|mtp]
                           [--dtype float32|bfloat16|float16] [--with_mtp]

Reads the run's `DIR/config.json`. The weights (`--stage`, default `rl` when `DIR/rl/ckpt` holds
a checkpoint, else `sft`):
  rl   the policy of the newest `rl` checkpoint; `--with_mtp`: the MTP trained alongside it;
  sft  the policy the run started from (`policy.source`: this run's `sft` stage, or the GGUF /
       HF checkpoint as loaded); `--with_mtp`: the MTP layers that checkpoint ships;
  mtp  that same policy with the `mtp` stage's trained MTP (implies `--with_mtp`).
MTP layers are written in the checkpoint's own layout if it shipped one, else Qwen3.5's (one
layer: `mtp.*`) or DeepSeek-V3's (several: `model.layers.{L+j}.*`); transformers ignores them,
`bebop.checkpoints.hf.load` reads them back. A draft vocabulary (`mtp.draft_vocab`) is not
exported: the draft head is the full output head.

An MTP that reads several backbone layers (`mtp.features`) or runs several blocks per step
(`mtp.depth`) is written with bebop's extensions of those layouts (`checkpoints/names.py`,
`MTP_EXTENSIONS`), in the Qwen3.5 layout:
  mtp.fc_features.weight   [D, F*D] the fusion projection (torch Linear [out, in]); its input
                           columns are the F feature layers' hidden states in increasing layer
                           order, D each (absent for the last layer alone)
  mtp.layers.{i}.*         decoder block i of the draft step, run in order i = 0 .. depth-1
(DeepSeek-V3: `model.layers.{L}.fc_features.weight` and `model.layers.{L+j}.blocks.{i}.*` for
i >= 1; MiMo: `model.mtp_layers.0.fc_features.weight`, `model.mtp_layers.{j}.blocks.{i}.*`),
and config.json records them as `"bebop_mtp": {"features": [l_1, ..., l_F], "depth": d}`
(0-based decoder-layer indices), which the loader reads back.

Written: `config.json` (the architecture as Llama / Qwen2 / Qwen3, `torch_dtype` and `dtype` =
`--dtype`), `model.safetensors` (sharded past `--max_shard_gb`, with an index), tokenizer files,
and `generation_config.json` (BOS / EOS / pad ids; the run's `rollout.temperature`, `top_p`,
`top_k` as sampling defaults). Tokenizer files: an HF source's own files are copied; a GGUF
source's BPE tokenizer is written as `tokenizer.json` + `tokenizer_config.json` (with the GGUF's
chat template); the demo's character tokenizer is written as an equivalent `tokenizer.json`
(one token per character, BOS prepended), so `AutoTokenizer` gives the demo's token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

import jax
from flax import nnx

from bebop import config as config_lib
from bebop import policies, sharding
from bebop.checkpoints import hf, names
from bebop.checkpoints.tokenizer_files import write_tokenizer
from bebop.ckpt import CheckpointRestoreError
from bebop.io import DamagedFileError, read_json

STAGES = ("rl", "sft", "mtp")


class ExportError(ValueError):
    """Bad export input (workdir, stage, checkpoint, output directory); names the culprit."""


def has_checkpoint(ckpt_dir: Path) -> bool:
    return ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())


def run_config(workdir: Path) -> config_lib.RunConfig:
    """The config a run recorded in `DIR/config.json`."""
    if not workdir.is_dir():
        raise ExportError(f"--workdir {workdir}: no such directory")
    path = workdir / "config.json"
    if not path.exists():
        raise ExportError(f"{path}: missing; --workdir must be a run directory of launch.py")
    cfg = config_lib.from_dict(config_lib.RunConfig, read_json(path))
    cfg.validate()
    return cfg


def weights(
    src: config_lib.PolicyConfig,
    run_model: config_lib.ModelConfig,
    m: config_lib.MTPConfig,
    workdir: Path,
    stage: str,
    with_mtp: bool,
    mesh,
):
    """(policy as loaded, policy params to export, MTP (graphdef, params) or None, MTP
    layout) of the run in `workdir` (its `policy`, `model` and `mtp` sections) after `stage`."""
    policy = policies.load(src, run_model, workdir, mesh)
    fmt = "qwen3_5" if m.num_layers == 1 else "deepseek_v3"
    if policy.mtp_format is not None:  # the checkpoint's own layout, if it holds n layers
        limit = names.MTP_FORMATS[policy.mtp_format]["max_layers"]
        fmt = policy.mtp_format if limit is None or m.num_layers <= limit else fmt
    if stage == "rl":
        pol_params, mtp_params = policies.load_rl(m, workdir, mesh, policy.cfg)
        mtp_gd = policies.abstract_mtp(policy.cfg, m)[0]
        return policy, pol_params, (mtp_gd, mtp_params) if with_mtp else None, fmt
    if stage == "mtp":
        mtp_gd, mtp_params, _ = policies.load_mtp(m, workdir / "mtp" / "ckpt", policy.cfg, mesh)
        return policy, policy.params, (mtp_gd, mtp_params), fmt
    if with_mtp and policy.mtp is None:
        raise ExportError(
            f"--with_mtp --stage sft: the policy (policy.source={src.source!r}"
            f"{', ' + src.path if src.path else ''}) ships no MTP layers; export "
            "the trained MTP with --stage mtp or --stage rl"
        )
    return policy, policy.params, policy.mtp if with_mtp else None, fmt


def generation_config(r: config_lib.RolloutConfig, ids: dict, base: dict | None = None) -> dict:
    """transformers' generation defaults: the token ids and the rollout section's sampling."""
    gen = dict(base or {})  # an HF source's own BOS / pad ids win over bebop's defaults
    gen["eos_token_id"] = ids["eos"]  # the ids bebop's sampler stops at
    for k in ("bos", "pad"):
        if ids[k] is not None:
            gen.setdefault(f"{k}_token_id", ids[k])
    for k in ("temperature", "top_p", "top_k", "do_sample"):
        gen.pop(k, None)
    if r.temperature > 0:  # top_k=0 turns transformers' default top-k of 50 off
        gen.update(do_sample=True, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
    else:
        gen["do_sample"] = False
    return gen


# ----------------------------------------------------------------------------- main


def export_run(args) -> tuple[Path, str]:
    """Exports what `args` (the parsed flags) name; returns (out, the stage exported)."""
    workdir, out = Path(args.workdir), Path(args.out)
    cfg = run_config(workdir)
    stage = args.stage or ("rl" if has_checkpoint(workdir / "rl" / "ckpt") else "sft")
    need = {"rl": workdir / "rl" / "ckpt", "mtp": workdir / "mtp" / "ckpt"}
    if cfg.policy.source == "sft":
        need["sft"] = workdir / "sft" / "ckpt"
    if stage in need and not has_checkpoint(need[stage]):
        raise ExportError(f"--stage {stage}: {need[stage]} holds no checkpoint")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"--out {out}: not empty; choose a new or empty directory")
    with_mtp = args.with_mtp or stage == "mtp"
    # One host device: export gathers every tensor to the host anyway.
    mesh = sharding.make_mesh(config_lib.MeshConfig(data=1), jax.devices("cpu")[:1])
    try:
        policy, params, mtp, fmt = weights(
            cfg.policy, cfg.model, cfg.mtp, workdir, stage, with_mtp, mesh
        )
    except CheckpointRestoreError as e:
        raise ExportError(
            f"{workdir / 'config.json'} does not describe the checkpoints in {workdir} (was it "
            f"edited after the run?): {e}"
        ) from e
    base_cfg, base_gen, src = {}, {}, None
    if cfg.policy.source == "hf":  # keep what bebop does not model (token ids, max positions)
        src = policies.hf_dir(cfg.policy, workdir)
        base_cfg = read_json(src / "config.json")
        if (src / "generation_config.json").exists():
            base_gen = read_json(src / "generation_config.json")
    model_type = base_cfg.get("model_type") or hf.model_type_for(policy.cfg)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(out, cfg.policy.source, policy.tok, src)
    if cfg.policy.source != "hf":
        base_cfg = {
            "bos_token_id": ids["bos"],
            "eos_token_id": ids["eos"],
            "pad_token_id": ids["pad"],
        }
    hf.export(
        out,
        policy.cfg,
        params,
        model_type,
        None if mtp is None else mtp[1],
        fmt,
        max_shard_bytes=int(args.max_shard_gb * 2**30),
        dtype=args.dtype,
        base_config=base_cfg,
        mtp_features=None if mtp is None else nnx.merge(*mtp).features,
    )
    gen = generation_config(cfg.rollout, ids, base_gen)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out, stage


def parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m bebop.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workdir", required=True, help="the run directory (holds config.json)")
    p.add_argument("--out", required=True, help="the new Hugging Face directory")
    p.add_argument("--stage", choices=STAGES, default=None, help="whose weights (see above)")
    p.add_argument("--dtype", choices=sorted(hf.EXPORT_DTYPES), default="float32")
    p.add_argument("--with_mtp", action="store_true", help="also write the MTP layers")
    p.add_argument("--max_shard_gb", type=float, default=5.0, help="safetensors shard size")
    return p.parse_args(argv)


def main(argv=None) -> Path:
    args = parse(argv)
    out, stage = export_run(args)
    print(json.dumps({"exported": str(out), "stage": stage, "dtype": args.dtype}))
    return out


def _exit(code: int) -> None:
    """Exits without the interpreter's shutdown, where orbax's background threads would print
    "Event loop is closed" (and more) after the error line."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _quiet_closed_loops() -> None:
    """Orbax's and TensorStore's background callbacks raise "Event loop is closed" when a
    checkpoint reader closes while they still schedule work, each printing a traceback (through
    `sys.excepthook` from native threads, `threading.excepthook` from Python ones); they are not
    errors of the export, whose own error must stay its only line."""

    def closed(exc) -> bool:
        return isinstance(exc, RuntimeError) and "loop is closed" in str(exc)

    default_thread, default_sys = threading.excepthook, sys.excepthook

    def thread_hook(args):
        if not closed(args.exc_value):
            default_thread(args)

    def sys_hook(tp, value, tb):
        if not closed(value):
            default_sys(tp, value, tb)

    threading.excepthook, sys.excepthook = thread_hook, sys_hook


if __name__ == "__main__":
    _quiet_closed_loops()
    try:
        main()
    except (
        ExportError,
        config_lib.ConfigError,
        hf.CheckpointError,
        FileNotFoundError,
        CheckpointRestoreError,
        DamagedFileError,
    ) as e:
        print(f"bebop.export: error: {e}", file=sys.stderr)
        _exit(2)
    _exit(0)
