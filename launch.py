"""bebop entry point: flags -> config -> jax.distributed (multi-process) -> mesh -> stages.

    python launch.py --config configs/demo.py[:arg] [--config.a.b=v ...] [--workdir DIR]
                     [--sweep_index i]

The resolved config is written to DIR/config.json; the last line printed is one JSON object with
the summaries of the stages that ran.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path


def parse_flags(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", required=True, help="configs/x.py[:arg]")
    p.add_argument("--workdir", default=None, help="run directory (default runs/<config>[_arg])")
    p.add_argument("--sweep_index", type=int, default=None)
    args, rest = p.parse_known_args(argv)
    overrides = []
    for item in rest:
        if not item.startswith("--config."):
            p.error(f"unrecognized argument {item!r}")
        overrides.append(item[len("--config.") :])
    return args, overrides


def default_workdir(spec: str, sweep_index) -> Path:
    path, _, arg = spec.partition(":")
    name = Path(path).stem + (f"_{arg.replace(',', '_').replace('=', '')}" if arg else "")
    return Path("runs") / (name + (f"/sweep{sweep_index}" if sweep_index is not None else ""))


def maybe_init_distributed(dcfg) -> None:
    import jax

    if dcfg.coordinator_address or dcfg.num_processes > 1:
        jax.distributed.initialize(
            coordinator_address=dcfg.coordinator_address or None,
            num_processes=dcfg.num_processes,
            process_id=dcfg.process_id,
        )
    elif dcfg.auto or os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize()  # cluster auto-detection (TPU pods, SLURM, ...)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    args, overrides = parse_flags(sys.argv[1:] if argv is None else argv)

    from bebop import config as config_lib

    try:
        cfg, _ = config_lib.load(args.config, overrides, args.sweep_index)
    except config_lib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    maybe_init_distributed(cfg.distributed)

    import jax

    from bebop import pipeline, sharding

    workdir = Path(args.workdir) if args.workdir else default_workdir(args.config, args.sweep_index)
    try:
        mesh = sharding.make_mesh(cfg.mesh)
    except config_lib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    workdir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        config_lib.dump(cfg, workdir / "config.json")
    logging.info("workdir %s, mesh %s, %d devices", workdir, dict(mesh.shape), jax.device_count())
    summaries = pipeline.run(cfg, workdir, mesh)
    print(json.dumps({"workdir": str(workdir), **summaries}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
