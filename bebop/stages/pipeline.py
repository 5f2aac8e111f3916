"""Runs the configured stages in order, in a workdir that describes itself and that one run owns.

- A stage whose `DIR/<stage>/summary.json` exists is done and is skipped on re-run; an unfinished
  stage resumes from its own checkpoints. A damaged `summary.json` (empty, cut off) is set aside
  as `summary.json.damaged` and the stage re-runs: it resumes from its final checkpoint.
- Each stage keeps `DIR/<stage>/runs.json`: one entry per launch that ran it, with the config,
  argv, git commit, package versions, start and end time and the outcome.
- Before anything runs, a finished stage whose inputs (`stage_inputs`) differ from the config it
  finished with is refused, naming the differing keys; `rerun_from=STAGE` instead sets that stage
  and the ones after it aside (`<stage>.replaced-<time>`, nothing deleted) and runs them again.
- `WorkdirLock`: process 0 holds `DIR/.lock` while it runs; a second run on the same workdir fails
  naming the holder; a lock whose process is gone (same host) is taken over.
- Several processes: process 0 alone writes records, decides which stages are done (the others
  follow its answer), and every process waits for the others after each stage.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

from bebop import config as config_lib
from bebop.config import STAGES, RunConfig
from bebop.io import DamagedFileError, read_json, write_json_atomic
from bebop.metrics import flatten

log = logging.getLogger(__name__)

# Top-level config sections a stage's result depends on (besides those of the stages before it
# in `cfg.stages`, whose outputs it reads). Not inputs: logging, checkpoint cadence, mesh.
STAGE_SECTIONS = {
    "sft": ("seed", "model", "task", "sft"),
    "distill": ("seed", "model", "task", "policy", "rollout", "distill"),
    "mtp": ("seed", "model", "policy", "rollout", "mtp"),
    "rl": ("seed", "model", "task", "policy", "rollout", "mtp", "rl"),
}
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy", "jinja2")


class StageConfigChanged(config_lib.ConfigError):
    pass


class WorkdirLocked(RuntimeError):
    pass


def stage_inputs(cfg_dict: dict, stage: str, stages) -> dict:
    """The flattened config keys the result of `stage` depends on."""
    upto = list(stages)[: list(stages).index(stage) + 1] if stage in stages else [stage]
    sections = {s for st in upto for s in STAGE_SECTIONS[st]}
    return {k: v for k, v in flatten(cfg_dict).items() if k.split(".")[0] in sections}


def diff_keys(old: dict, new: dict) -> list[str]:
    """`key: old -> new` for each differing key. A key the old record lacks (it predates the
    key) counts as its default value."""
    defaults = flatten(_jsonable(config_lib.to_dict(RunConfig())))
    old = {**{k: defaults[k] for k in new if k in defaults and k not in old}, **old}
    return [
        f"{k}: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}"
        for k in sorted(set(old) | set(new))
        if old.get(k, "<absent>") != new.get(k, "<absent>")
    ]


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d))  # tuples -> lists, as read back from runs.json


def finished_config(stage_dir: Path, workdir: Path) -> dict | None:
    """The config a finished stage ran with: its last `runs.json` entry that finished (older
    workdirs: the workdir's `config.json`), or None."""
    runs = stage_dir / "runs.json"
    if runs.exists():
        entries = read_json(runs)["runs"]
        done = [r for r in entries if r["status"] == "done"] or entries
        if done:
            return done[-1]["config"]
    if (workdir / "config.json").exists():
        return read_json(workdir / "config.json")
    return None


def is_done(stage_dir: Path, primary: bool = True) -> bool:
    done = stage_dir / "summary.json"
    if not done.exists():
        return False
    try:
        read_json(done)
    except DamagedFileError as e:
        log.warning("%s; setting it aside as summary.json.damaged and re-running the stage", e)
        if primary:
            os.replace(done, stage_dir / "summary.json.damaged")
        return False
    return True


def check_finished_stages(cfg: RunConfig, workdir: Path, rerun_from: str | None = None) -> None:
    """Refuses a config that changes the inputs of a finished stage (before anything runs)."""
    new = _jsonable(config_lib.to_dict(cfg))
    if rerun_from is not None and rerun_from not in cfg.stages:
        raise config_lib.ConfigError(f"--rerun_from={rerun_from!r} is not in stages {cfg.stages}")
    for name in cfg.stages:
        if name == rerun_from:
            return
        sdir = Path(workdir) / name
        if not is_done(sdir, primary=_primary()):
            continue
        old = finished_config(sdir, Path(workdir))
        if old is None:
            log.warning("stage %s is done but records no config; cannot check it", name)
            continue
        changed = diff_keys(
            stage_inputs(old, name, cfg.stages), stage_inputs(new, name, cfg.stages)
        )
        if changed:
            raise StageConfigChanged(
                f"stage '{name}' in {workdir} finished with a different config; changed "
                f"input key(s): {'; '.join(changed)}. Use a new --workdir, or pass "
                f"--rerun_from {name} to run '{name}' and the stages after it again (the old "
                f"results are kept as <stage>.replaced-<time>)."
            )


def set_aside_from(workdir: Path, stage: str) -> list[Path]:
    """Renames `stage` and every later stage's directory to `<name>.replaced-<UTC time>`."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    moved = []
    for name in STAGES[STAGES.index(stage) :]:
        src = Path(workdir) / name
        if src.exists():
            dst = src.with_name(f"{name}.replaced-{stamp}")
            src.rename(dst)
            moved.append(dst)
            log.info("--rerun_from %s: %s set aside as %s", stage, src, dst)
    return moved


def _git_commit() -> str | None:
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


@dataclasses.dataclass
class StageRecord:
    """Appends this launch to `<stage>/runs.json` at the start; `finish` fills in the outcome."""

    path: Path
    entry: dict
    index: int

    @classmethod
    def start(cls, stage_dir: Path, cfg: RunConfig, argv) -> StageRecord:
        stage_dir.mkdir(parents=True, exist_ok=True)
        entry = {
            "config": config_lib.to_dict(cfg),
            "argv": list(argv),
            "git_commit": _git_commit(),
            "versions": _versions(),
            "host": socket.gethostname(),
            "start_time": _now(),
            "end_time": None,
            "status": "running",
        }
        path = stage_dir / "runs.json"
        runs = read_json(path)["runs"] if path.exists() else []
        write_json_atomic(path, {"runs": [*runs, entry]})
        return cls(path, entry, len(runs))

    def finish(self, status: str) -> None:
        self.entry.update(end_time=_now(), status=status)
        runs = read_json(self.path)["runs"]
        runs[self.index] = self.entry
        write_json_atomic(self.path, {"runs": runs})


class WorkdirLock:
    """`DIR/.lock` (created exclusively) holding the owner's pid, host and start time."""

    def __init__(self, workdir: Path):
        self.path = Path(workdir) / ".lock"
        self.held = False

    def acquire(self) -> WorkdirLock:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": _now()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if not self._take_over_if_stale():
                    raise
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(info, f)
            self.held = True
            return self
        raise WorkdirLocked(f"{self.path}: could not take the workdir lock")

    def _take_over_if_stale(self) -> bool:
        try:
            owner = json.loads(self.path.read_text())
            pid, host = int(owner["pid"]), owner["host"]
        except (OSError, ValueError, KeyError, TypeError):
            # A lock file being written right now, or a damaged one: say so, do not guess.
            raise WorkdirLocked(
                f"{self.path} exists but is unreadable; if no run uses {self.path.parent}, "
                f"delete it"
            ) from None
        if host == socket.gethostname() and not _alive(pid):
            log.warning(
                "%s: taking over a stale lock of pid %d (no longer running)", self.path, pid
            )
            self.path.unlink(missing_ok=True)
            return True
        where = "this host" if host == socket.gethostname() else f"host {host}"
        raise WorkdirLocked(
            f"workdir {self.path.parent} is in use by pid {pid} on {where} since "
            f"{owner.get('since')} (lock file {self.path}); wait for it, use another --workdir, "
            f"or delete the lock file if that run is gone"
        )

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> WorkdirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def run(cfg: RunConfig, workdir: Path, mesh, argv=(), rerun_from: str | None = None) -> dict:
    """Runs the stages in order (launch.py holds the workdir lock around this). Refuses a
    changed config on a finished stage before anything runs."""
    import jax

    from bebop import sharding
    from bebop.stages import distill, sft
    from bebop.stages import mtp as mtp_train
    from bebop.stages import rl as rl_stage

    stages = {"sft": sft.run, "distill": distill.run, "mtp": mtp_train.run, "rl": rl_stage.run}
    workdir, primary = Path(workdir), jax.process_index() == 0
    check_finished_stages(cfg, workdir, rerun_from)
    if rerun_from is not None and primary:
        set_aside_from(workdir, rerun_from)
    sharding.sync("bebop.pipeline: stages checked")
    summaries = {}
    for name in cfg.stages:
        sdir = workdir / name
        if _agreed(is_done(sdir, primary) if primary else False):
            log.info("stage %s already done (%s); skipping", name, sdir / "summary.json")
            summaries[name] = read_json(sdir / "summary.json")
            continue
        record = StageRecord.start(sdir, cfg, argv) if primary else None
        try:
            # activations, KV caches and decode copies pinned on the mesh (`sharding`)
            with sharding.activation_mesh(mesh):
                summaries[name] = stages[name](cfg, workdir, mesh)
        except BaseException as e:
            if record is not None:
                record.finish(f"failed: {type(e).__name__}: {str(e)[:500]}")
            raise
        if record is not None:
            record.finish("done")
        sharding.sync(f"bebop.pipeline: {name} done")  # its files are written: the next reads
    return summaries


def _primary() -> bool:
    import jax

    return jax.process_index() == 0


def _agreed(flag: bool) -> bool:
    """Process 0's answer, in every process: all processes run the same stages even if one
    of them sees the file system differently (a summary being written, a damaged one)."""
    import jax

    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))
