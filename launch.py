"""bebop entry point: flags -> config -> jax.distributed (multi-process) -> mesh -> stages.

    python launch.py --config configs/demo.py[:arg] [--config.a.b=v ...] [--workdir DIR]
                     [--sweep_index i | --sweep_index all | --list_sweep] [--rerun_from STAGE]

The resolved config is written to DIR/config.json when DIR has none, and replaced (the old one
kept as config.<time>.json) only after a launch with a different config has finished every stage;
each stage also records the exact config it ran with in DIR/<stage>/runs.json. A config that
changes the inputs of a finished stage is refused (exit 2) unless --rerun_from names that stage.
Process 0 holds DIR/.lock while it runs. The last line printed is one JSON object with the
summaries of the stages; on failure the last line of stderr is the error.

Exit codes: 0 done, 1 run error (damaged file, divergence, workdir locked, ...), 2 config error,
143 stopped by SIGTERM after saving a checkpoint (rerun the same command to resume).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shlex
import sys
import traceback
from pathlib import Path

SWEEP_HELP = """\
entry i of the config file's sweep(arg), a list of
{'dotted.key': value} dicts applied before the --config.*
overrides; 'all' runs every entry one after another, each
in DIR/sweep<i> (see --list_sweep for a job array)"""
RERUN_HELP = """\
run STAGE and the stages after it again although they
finished (the old directories are kept as
<stage>.replaced-<time>); needed when the config changes
a finished stage's inputs"""


def parse_flags(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", required=True, help="configs/x.py[:arg]")
    p.add_argument("--workdir", default=None, help="run directory (default runs/<config>[_arg])")
    p.add_argument("--sweep_index", default=None, metavar="{i,all}", help=SWEEP_HELP)
    p.add_argument(
        "--list_sweep", action="store_true", help="print one launch command per sweep entry"
    )
    p.add_argument("--rerun_from", default=None, metavar="STAGE", help=RERUN_HELP)
    args, rest = p.parse_known_args(argv)
    overrides = []
    for item in rest:
        if not item.startswith("--config."):
            p.error(f"unrecognized argument {item!r}")
        overrides.append(item[len("--config.") :])
    if args.sweep_index not in (None, "all"):
        try:
            args.sweep_index = int(args.sweep_index)
        except ValueError:
            p.error(f"--sweep_index must be an integer or 'all', got {args.sweep_index!r}")
    return args, overrides


def default_workdir(spec: str, sweep_index) -> Path:
    path, _, arg = spec.partition(":")
    name = Path(path).stem + (f"_{arg.replace(',', '_').replace('=', '')}" if arg else "")
    return Path("runs") / (name + (f"/sweep{sweep_index}" if sweep_index is not None else ""))


_DISTRIBUTED = False


def maybe_init_distributed(dcfg) -> None:
    """One process of a multi-process job: an explicit coordinator (`distributed.*` keys; on one
    machine `python -m bebop.local_cluster` sets them) or the cluster's own discovery. CPU
    devices talk over gloo (a no-op for GPU/TPU collectives)."""
    import jax

    global _DISTRIBUTED
    _DISTRIBUTED = bool(dcfg.coordinator_address or dcfg.num_processes > 1 or dcfg.auto)
    _DISTRIBUTED = _DISTRIBUTED or bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))
    if _DISTRIBUTED and "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if dcfg.coordinator_address or dcfg.num_processes > 1:
        if dcfg.process_id != 0:  # JAX aborts the process when the coordinator never answers
            wait_for_coordinator(dcfg.coordinator_address, dcfg.init_timeout_s)
        jax.distributed.initialize(
            coordinator_address=dcfg.coordinator_address or None,
            num_processes=dcfg.num_processes,
            process_id=dcfg.process_id,
            initialization_timeout=dcfg.init_timeout_s,
        )
    elif dcfg.auto or os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize()  # cluster auto-detection (TPU pods, SLURM, ...)


class CoordinatorUnreachable(RuntimeError):
    """No coordinator accepts connections at `distributed.coordinator_address`."""


def wait_for_coordinator(address: str, timeout_s: float, poll_s: float = 0.25) -> None:
    """Returns once something accepts TCP connections at `address` (host:port); raises
    `CoordinatorUnreachable` naming the address and `distributed.init_timeout_s` after
    `timeout_s` seconds of refused or unanswered connections."""
    import socket
    import time

    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host.strip("[]"), int(port)), max(0.1, min(5, left))):
                return
        except (OSError, ValueError) as e:
            last = e
        if time.monotonic() + poll_s >= deadline:
            raise CoordinatorUnreachable(
                f"config key 'distributed.coordinator_address': no coordinator answered at "
                f"{address} within distributed.init_timeout_s={timeout_s:g}s ({last}); start "
                "process 0 first (it serves the address), or check the host and port"
            )
        time.sleep(poll_s)


def list_sweep(args, overrides) -> int:
    from bebop import config as config_lib

    entries = config_lib.sweep_entries(args.config)
    for i, entry in enumerate(entries):
        cmd = ["python", "launch.py", "--config", args.config, "--sweep_index", str(i)]
        if args.workdir:
            cmd += ["--workdir", str(Path(args.workdir) / f"sweep{i}")]
        cmd += [f"--config.{o}" for o in overrides]
        desc = " ".join(f"{k}={v!r}" for k, v in entry.items())
        print(f"{shlex.join(cmd)}  # {desc}")
    return 0


def update_config_json(cfg, workdir: Path) -> None:
    """After a finished launch: config.json describes the run; a different old one is kept."""
    from bebop import config as config_lib

    path = workdir / "config.json"
    new = json.loads(json.dumps(config_lib.to_dict(cfg)))
    if path.exists():
        try:
            if json.loads(path.read_text()) == new:
                return
        except ValueError:
            pass
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        path.rename(workdir / f"config.{stamp}.json")
    config_lib.dump(cfg, path)


def use_fast_compile() -> None:
    """Adds `config.FAST_COMPILE_XLA_FLAGS` to XLA_FLAGS; XLA reads them when JAX starts its
    backend, which nothing in launch.py has done before this."""
    from bebop.config import FAST_COMPILE_XLA_FLAGS

    flags = os.environ.get("XLA_FLAGS", "").split()
    names = {f.split("=")[0] for f in flags}
    flags += [f for f in FAST_COMPILE_XLA_FLAGS if f.split("=")[0] not in names]
    os.environ["XLA_FLAGS"] = " ".join(flags)


def run_one(cfg, workdir: Path, args, argv) -> int:
    import jax

    from bebop import config as config_lib
    from bebop import fit, sharding
    from bebop.stages import pipeline

    try:
        mesh = sharding.make_mesh(cfg.mesh)
        if cfg.tensorboard:
            from bebop.metrics import tensorboard_writer_class

            tensorboard_writer_class()  # fail now, not after the model is built
    except (config_lib.ConfigError, ImportError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    primary = jax.process_index() == 0
    workdir.mkdir(parents=True, exist_ok=True)
    # Later launches (resume, next stage) reuse compiled programs; a cache directory set in the
    # environment (JAX_COMPILATION_CACHE_DIR, e.g. one shared by a cluster's jobs) wins.
    if cfg.compile_cache and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(workdir.absolute() / "jax_cache"))
    lock = pipeline.WorkdirLock(workdir)
    fit.install_preemption_handler()
    try:
        if primary:
            lock.acquire()
            if not (workdir / "config.json").exists():
                config_lib.dump(cfg, workdir / "config.json")
        logging.info(
            "workdir %s, mesh %s, %d devices", workdir, dict(mesh.shape), jax.device_count()
        )
        summaries = pipeline.run(cfg, workdir, mesh, argv, args.rerun_from)
        if primary:
            update_config_json(cfg, workdir)
    except config_lib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except fit.Preempted as e:
        print(f"preempted: {e}", file=sys.stderr)
        return 143
    except Exception as e:  # noqa: BLE001 - every failure ends with its own one-line message
        if not isinstance(e, _known_errors()):
            traceback.print_exc()
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        lock.release()
    print(json.dumps({"workdir": str(workdir), **summaries}))
    return 0


def _known_errors() -> tuple[type, ...]:
    """Errors whose message says it all: no traceback."""
    from bebop.checkpoints.hf import CheckpointError
    from bebop.ckpt import CheckpointRestoreError
    from bebop.io import DamagedFileError
    from bebop.rl.guards import DraftCollapseError
    from bebop.stages.pipeline import WorkdirLocked
    from bebop.tokenizer import TokenizerError
    from bebop.train import NonFiniteError

    return (
        DamagedFileError,
        NonFiniteError,
        WorkdirLocked,
        CheckpointRestoreError,
        CheckpointError,
        TokenizerError,
        FileNotFoundError,
        DraftCollapseError,
    )


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    argv = sys.argv[1:] if argv is None else list(argv)
    args, overrides = parse_flags(argv)

    from bebop import config as config_lib

    try:
        if args.list_sweep:
            return list_sweep(args, overrides)
        if args.sweep_index == "all":
            indices = range(len(config_lib.sweep_entries(args.config)))
        else:
            indices = [args.sweep_index]
        cfgs = [config_lib.load(args.config, overrides, i)[0] for i in indices]
    except config_lib.ConfigError as e:  # every entry validated before anything runs
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if len({c.fast_compile for c in cfgs}) > 1:  # XLA reads its flags once, when JAX starts
        print("config error: sweep entries differ in 'fast_compile'", file=sys.stderr)
        return 2
    if cfgs[0].fast_compile:
        use_fast_compile()
    try:
        maybe_init_distributed(cfgs[0].distributed)
    except CoordinatorUnreachable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    failed = []
    for i, cfg in zip(indices, cfgs, strict=True):
        if args.workdir is None:
            workdir = default_workdir(args.config, i)
        else:
            workdir = Path(args.workdir) / (f"sweep{i}" if args.sweep_index == "all" else "")
        if len(cfgs) > 1:
            logging.info("sweep entry %d of %d -> %s", i, len(cfgs), workdir)
        rc = run_one(cfg, workdir, args, argv)
        if rc != 0:
            failed.append((i, rc))
            if rc == 143:  # preempted: the remaining entries would be killed too
                break
    if len(cfgs) > 1 and failed:
        print(f"error: sweep entries failed: {failed} (index, exit code)", file=sys.stderr)
    return failed[0][1] if failed else 0


def exit_now(code: int) -> None:
    """Exits without the interpreter's shutdown, where orbax's background threads print "cannot
    schedule new futures" / "Event loop is closed" after our error: the stages have closed (waited
    for) every checkpoint manager, so the error printed last stays the last line."""
    if _DISTRIBUTED and code == 0:
        # A failed process skips the shutdown barrier, which would wait for peers that may be
        # gone or stuck (up to its 300 s timeout): its exit closes its connections, and a peer
        # waiting on it in a collective fails instead of hanging.
        import jax

        jax.distributed.shutdown()
    rewards = sys.modules.get("bebop.rewards")
    if rewards is not None:  # its worker pool's semaphores, else reported leaked at exit
        rewards.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
