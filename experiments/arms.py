"""One RL arm of a study: `launch.py` run as a subprocess from one finished base run (its SFT
policy and pre-RL MTP), so that arms differ only in what their overrides say.

An arm lives in `<root>/<name>/` and is reused once its `rl/summary.json` exists (delete the
directory to redo it); study scripts that name the same arm share one run. A finished arm is also
kept in the repository (`kept_arms/<root's name>/<name>.json`: its config, records, summary and
wall time), so that a later launch from an identical base reuses it after its run directory is
gone: a study can be run in parts, on different days. Arms that start from none of the base's
weights (SmolLM2's plain arms) need only the base's config, not a trained base. A study that
compares no wall times checkpoints its arms and resumes an interrupted one (`run_arm`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from subprocess import PIPE

from bebop import io, plots

REPO = Path(__file__).resolve().parents[1]


def launch(config: str, workdir: Path, overrides=()) -> dict:
    """Runs `launch.py --config config --workdir workdir --config.<o>...`; returns its final JSON
    line. A failed run raises with the command and the tail of its stderr (`run_child`)."""
    cmd = [sys.executable, "launch.py", "--config", config, "--workdir", str(workdir)]
    cmd += [f"--config.{o}" for o in overrides]
    return json.loads(run_child(cmd).strip().splitlines()[-1])


def run_child(cmd: list[str]) -> str:
    """Runs `cmd` in the repository, returns its stdout; a non-zero exit raises naming the
    command, its exit status and the tail of its stderr. In the main thread a SIGTERM, or a
    SIGINT sent to this process (`kill -INT <pid>`), is passed on to the child as a SIGTERM and
    its end awaited, so that a launch stopped with the study saves its checkpoint (`launch.py`
    exits 143 after saving) instead of losing its work to a closed pipe; then the signals take
    their course here in the order they came (SIGTERM: this process's own handler, by default it
    ends; SIGINT: KeyboardInterrupt). A signal that arrives while the child is being started
    reaches it once it exists; a child that does not end as a saved launch does (exit 143) has
    its stderr's tail printed first. A second SIGINT stops waiting: KeyboardInterrupt at once,
    the child left to itself. Any other exception while waiting sends the child a SIGTERM and
    waits for it before it propagates."""
    child: list[subprocess.Popen] = []
    stopped: list[int] = []

    def forward(signum, _frame):
        stopped.append(signum)
        if stopped.count(signal.SIGINT) > 1:
            raise KeyboardInterrupt("a second SIGINT: not waiting for the launch to end")
        for c in child:
            c.send_signal(signal.SIGTERM)

    main = threading.current_thread() is threading.main_thread()
    earlier = {}
    try:
        for s in (signal.SIGTERM, signal.SIGINT) if main else ():
            if signal.getsignal(s) is not signal.SIG_IGN:
                earlier[s] = signal.signal(s, forward)
        child.append(subprocess.Popen(cmd, cwd=REPO, stdout=PIPE, stderr=PIPE, text=True))
        if stopped:  # a signal before the child existed
            child[0].send_signal(signal.SIGTERM)
        out, err = child[0].communicate()
    except BaseException:  # the child too saves and ends first, unless a second SIGINT came
        if child and child[0].poll() is None and stopped.count(signal.SIGINT) < 2:
            child[0].send_signal(signal.SIGTERM)
            child[0].communicate()
        raise
    finally:
        for s, handler in earlier.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
    code = child[0].returncode
    if stopped and code not in (0, 143, -signal.SIGTERM):  # it did not save and end: say how
        tail = err[-3000:]
        print(
            f"{' '.join(cmd)} ended with exit {code} after the stop request:\n{tail}",
            file=sys.stderr,
            flush=True,
        )
    for s in dict.fromkeys(stopped):
        signal.raise_signal(s)
    if code:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {code}):\n{err[-3000:]}")
    return out


def link_tree(src: Path, dst: Path) -> None:
    """Hard-linked copy of a finished stage directory (no extra disk)."""
    if not dst.exists():
        shutil.copytree(src, dst, copy_function=os.link)


def base_run(
    workdir: Path,
    config: str = "configs/demo.py",
    stages=("sft", "distill", "mtp"),
    extra=(),
    config_only: bool = False,
) -> Path:
    """A run of `config` whose `stages` (the last: `mtp`) are finished: `workdir` as it is if so
    (e.g. the demo's `runs/demo`), else those stages are trained there first (with `extra`
    overrides). `config_only`: the arms start from none of the base's weights (no SFT stage and
    no pre-RL MTP: plain rollouts or GrowMTP from scratch on a checkpoint's policy), so only the
    base's `config.json` is written (as its launch writes it) and nothing is trained."""
    workdir = Path(workdir).absolute()
    done = (workdir / "mtp" / "summary.json").exists()
    if config_only and not done and "sft" not in stages:
        from bebop import config as config_lib

        cfg = config_lib.load(config, [f"stages={tuple(stages)!r}", *extra])[0]
        path = workdir / "config.json"
        new = json.loads(json.dumps(config_lib.to_dict(cfg)))
        old = json.loads(path.read_text()) if path.exists() else None
        if old != new:
            if old is not None and any(workdir.glob("*/summary.json")):
                raise SystemExit(
                    f"{path}: a base of another config has finished stages there; "
                    "give another --base"
                )
            workdir.mkdir(parents=True, exist_ok=True)
            config_lib.dump(cfg, path)
        return workdir
    if not done:
        print(f"training the base run ({', '.join(stages)}) in {workdir}", flush=True)
        launch(config, workdir, [f"stages={tuple(stages)!r}", *extra])
    return workdir


@dataclasses.dataclass(frozen=True)
class Arm:
    """One RL run of a study: `overrides` on top of the base config; `pretrained`: rollouts
    draft with (and MTP updates start from) the base run's pre-RL MTP; else GrowMTP grows a head
    from random init (plain rollouts never draft)."""

    name: str
    label: str
    overrides: tuple[str, ...] = ()
    pretrained: bool = True

    @property
    def rule(self) -> str:
        """The arm's `rollout.mode` (the demo's default: rejection)."""
        for o in self.overrides:
            if o.startswith("rollout.mode="):
                return o.partition("=")[2].strip("'\"")
        return "rejection"


@dataclasses.dataclass
class ArmResult:
    arm: Arm
    summary: dict
    records: list[dict]
    wall_s: float | None  # the launch's wall time (from `arm.json` when reused; None: unknown)
    config: dict = dataclasses.field(default_factory=dict)  # the arm's `config.json`
    # the outcome of the pre-RL MTP training the arm drafted with (`base_identity`; None: none)
    mtp: dict | None = None

    def series(self, key: str):
        return plots.series(self.records, key)


def base_identity(base: Path, mtp: bool = True) -> dict:
    """What makes two base runs the same base for an arm: the config they ran and the outcome
    of the training the arm starts from -- the SFT policy's (if the base trained one) and, for an
    arm that drafts with or updates the pre-RL MTP (`mtp`), the MTP's -- as steps run and final
    loss: a base trained again from the same config is the same base only if it trained to the
    same weights, to the last digit."""
    base = Path(base)

    def outcome(stage: str) -> dict | None:
        path = base / stage / "summary.json"
        if not path.exists():
            return None
        summary = json.loads(path.read_text())
        return {k: summary.get(k) for k in ("steps_run", "final_loss")}

    cfg = json.loads((base / "config.json").read_text()) if (base / "config.json").exists() else {}
    return {"config": cfg, "sft": outcome("sft"), "mtp": outcome("mtp") if mtp else None}


def kept_key(config: str, overrides, base: Path, mtp: bool = True) -> dict:
    """What a kept arm must match to be reused: the config its launch resolves to today (so that
    a changed config file or default is a different arm), the base's path replaced by
    `<base>`, and the base's identity (`mtp`: the arm starts from the base's MTP)."""
    from bebop import config as config_lib

    resolved = json.dumps(config_lib.to_dict(config_lib.load(config, overrides)[0]))
    resolved = resolved.replace(json.dumps(str(Path(base).absolute()))[1:-1], "<base>")
    return {"config": json.loads(resolved), "base": base_identity(base, mtp)}


def kept_arm(
    keep: Path, arm: Arm, key: dict, report: bool = False, resumed: bool = True
) -> ArmResult | None:
    """The arm kept in `keep` (`keep_arm`) if it ran the launch `key` (an unreadable file counts
    as none); `report` (the arm is reported, not launched): also one kept from a trained base of
    the config whose MTP `key`'s base has not trained (`untrained_base_match`); `resumed=False`:
    not one that resumed after an interruption (its step times span the gap)."""
    path = Path(keep) / f"{arm.name}.json"
    if not path.exists():
        return None
    then = "not reported" if report else "running the arm"  # a reported arm is never launched
    try:
        k = json.loads(path.read_text())
        mtp = ((k.get("key") or {}).get("base") or {}).get("mtp")
        result = ArmResult(arm, k["summary"], k["records"], k["wall_s"], k["config"], mtp)
    except (ValueError, KeyError) as e:
        print(f"  {arm.name}: {path} is unreadable ({e!r}); {then}", flush=True)
        return None
    if k.get("resumed_from") and not resumed:
        print(f"  {arm.name}: {path} resumed after an interruption; {then}", flush=True)
        return None
    if k.get("key") != key:
        if report and untrained_base_match(k.get("key"), key):
            print(f"  {arm.name}: kept from a base of this config (none trained here)", flush=True)
            return result
        print(f"  {arm.name}: {path} is of another launch or base; {then}", flush=True)
        return None
    return result


def untrained_base_match(kept: dict | None, key: dict) -> bool:
    """`kept` is the launch `key` from a base of the same config whose MTP `key`'s base has not
    trained (a base that is only its config: `base_run(config_only=True)`), so that a study
    launched for plain arms reports the arms kept from a trained base of that config."""
    if not isinstance(kept, dict) or key["base"].get("mtp", {}) is not None:
        return False
    unknown = {**key["base"], "mtp": (kept.get("base") or {}).get("mtp")}
    return kept.get("config") == key["config"] and kept.get("base") == unknown


def keep_arm(keep: Path, res: ArmResult, key: dict, resumed_from=()) -> None:
    Path(keep).mkdir(parents=True, exist_ok=True)
    kept = {
        "key": key,
        "wall_s": res.wall_s,
        **({"resumed_from": list(resumed_from)} if resumed_from else {}),
        "config": res.config,
        "summary": res.summary,
        "records": res.records,
    }
    io.write_json_atomic(Path(keep) / f"{res.arm.name}.json", kept, indent=None)


def run_arm(
    arm: Arm,
    base: Path,
    root: Path,
    config: str = "configs/demo.py",
    extra=(),
    keep: Path | None = None,
    launch_missing: bool = True,
    borrow: tuple[Path, ...] = (),
    rerun: bool = False,
    resume_every: int = 0,
) -> ArmResult | None:
    """The RL stage of `config` from `base`'s SFT policy with `arm`'s overrides (and `extra`,
    the study's common ones), in `root/arm.name`; a finished one is reused when it ran the same
    launch (config, base and overrides, recorded in its `arm.json`; a finished run recorded
    before launches were is reused as it is), else run again. `base` must be a run of the same
    `config` (its SFT checkpoint is restored as that config's policy).

    `keep`: a directory where the finished arm is kept (`keep_arm`; only an arm launched here or
    one whose `arm.json` records the same key) and from which an arm is taken when its run
    directory is not of this launch but the kept one is (`kept_key`: the same resolved config,
    from an identical base; an arm only reported, `launch_missing=False`, also from a trained
    base of the same config when `base` is only its config). `borrow`: other studies' kept
    directories whose arm of the same key is taken too (a study of acceptance reuses an arm a
    timed study ran; never the other way: a timed arm must have run on an otherwise idle
    machine). `launch_missing=False`: None instead of launching. `rerun` (only with
    `launch_missing`): launched again even where finished or kept; the kept arm is replaced, and
    the earlier run directory (moved to `<arm>.before_rerun`) removed, once the new run ends (a
    later call without `rerun` after an interrupted one restores the earlier directory).
    `resume_every` (a study that compares no wall times): the RL stage checkpoints every that
    many steps (`ckpt.every`, outside the kept key) and an interrupted launch of the same arm
    resumes from its newest checkpoint instead of starting over; such an arm records the steps
    it resumed from and no wall time (`resumed_from`; `wall_s` None)."""
    wd = Path(root).absolute() / arm.name
    done, record = wd / "rl" / "summary.json", wd / "arm.json"
    base = Path(base).absolute()
    init = [f"mtp.init_from={str(base / 'mtp' / 'ckpt')!r}"] if arm.pretrained else []
    run = {"config": config, "base": str(base)}
    overrides = ["stages=('rl',)", *init, *extra, *arm.overrides]
    key = kept_key(config, overrides, base, arm.pretrained) if keep else None
    run["overrides"] = [*overrides, *([f"ckpt.every={resume_every}"] if resume_every else [])]
    rerun = rerun and launch_missing  # an arm only reported is never launched
    earlier = wd.with_name(f"{arm.name}.before_rerun")
    if not rerun and not done.exists() and (earlier / "rl" / "summary.json").exists():
        shutil.rmtree(wd, ignore_errors=True)  # an interrupted rerun: the earlier run back
        earlier.rename(wd)
    saved = io.read_json(record) if record.exists() else {}
    # a run directory of this launch (a record from before launches, or keys, were: as it is)
    same = saved.get("launch", run) == run and saved.get("key", key) == key
    if rerun:
        if done.exists() or (keep and (Path(keep) / f"{arm.name}.json").exists()):
            print(f"  {arm.name}: running it again (--rerun)", flush=True)
        if done.exists():  # kept until the new run ends
            shutil.rmtree(earlier, ignore_errors=True)
            wd.rename(earlier)
    elif not (done.exists() and same):
        for kept in (keep, *borrow) if keep else ():
            res = kept_arm(kept, arm, key, not launch_missing, bool(resume_every))
            if res is not None:
                print(f"  {arm.name}: kept in {kept}", flush=True)
                return res
        if not launch_missing:
            return None
    wall = saved.get("wall_s")
    if done.exists() and not same:  # another base, config or setting
        print(f"  {arm.name}: {wd} is a run of another launch; running it again", flush=True)
        done.unlink()
    if not done.exists():
        # an interrupted launch of this arm that checkpointed: resumed (never by a rerun)
        interrupted = saved.get("launch") == run and same and "wall_s" not in saved
        at = checkpointed_step(wd) if resume_every and not rerun and interrupted else None
        resumed = [] if at is None else [*saved.get("resumed_from", []), at]
        if at is None:
            shutil.rmtree(wd, ignore_errors=True)
            wd.mkdir(parents=True)
            if (base / "sft").exists():  # a policy of its own (not a GGUF / HF checkpoint)
                link_tree(base / "sft", wd / "sft")
        else:
            print(f"  {arm.name}: resuming its interrupted run at step {at}", flush=True)
        if resume_every:  # an interrupted launch is recognised by this record
            started = {"launch": run, "key": key, "resumed_from": resumed}
            io.write_json_atomic(record, started, indent=None)
        t0 = time.perf_counter()
        launch(config, wd, run["overrides"])
        wall = None if resumed else time.perf_counter() - t0
        saved = {"wall_s": wall, "launch": run, "key": key}
        if resume_every:
            saved["resumed_from"] = resumed
        io.write_json_atomic(record, saved, indent=None)
        ran = f"resumed from steps {resumed}, no wall time" if resumed else f"{wall:.0f} s"
        print(f"  {arm.name}: {ran}", flush=True)
        shutil.rmtree(earlier, ignore_errors=True)
    summary = json.loads(done.read_text())
    cfg = json.loads((wd / "config.json").read_text()) if (wd / "config.json").exists() else {}
    mtp = base_identity(base, arm.pretrained)["mtp"]
    res = ArmResult(arm, summary, plots.read_metrics(wd / "rl" / "metrics.jsonl"), wall, cfg, mtp)
    if keep and saved.get("key") == key:
        keep_arm(keep, res, key, saved.get("resumed_from", []))
    return res


def checkpointed_step(wd: Path) -> int | None:
    """The newest RL checkpoint step of the arm directory `wd` (None: none)."""
    ckpt = Path(wd) / "rl" / "ckpt"
    steps = [int(p.name) for p in ckpt.iterdir() if p.name.isdigit()] if ckpt.is_dir() else []
    return max(steps, default=None)
