"""What the study scripts share: `launch.py` runs as subprocesses, hard-linked stage copies, and
RL arms that start from one finished base run (its SFT policy and pre-RL MTP), so that arms
differ only in what their overrides say.

An arm lives in `<root>/<name>/` and is reused once its `rl/summary.json` exists (delete the
directory to redo it); study scripts that name the same arm share one run. A finished arm is also
kept in the repository (`kept_arms/<root's name>/<name>.json`: its config, records, summary and
wall time), so that a later launch from an identical base reuses it after its run directory is
gone: a study can be run in parts, on different days. Arms that start from none of the base's
weights (SmolLM2's plain arms) need only the base's config, not a trained base.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bebop import io, plots

REPO = Path(__file__).resolve().parents[1]
KEPT = Path(__file__).resolve().parent / "kept_arms"


def launch(config: str, workdir: Path, overrides=()) -> dict:
    """Runs `launch.py --config config --workdir workdir --config.<o>...`; returns its final JSON
    line. A failed run raises with the command and the tail of its stderr."""
    cmd = [sys.executable, "launch.py", "--config", config, "--workdir", str(workdir)]
    cmd += [f"--config.{o}" for o in overrides]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


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


def kept_arm(keep: Path, arm: Arm, key: dict, report: bool = False) -> ArmResult | None:
    """The arm kept in `keep` (`keep_arm`) if it ran the launch `key` (an unreadable file counts
    as none); `report` (the arm is reported, not launched): also one kept from a trained base of
    the config whose MTP `key`'s base has not trained (`untrained_base_match`)."""
    path = Path(keep) / f"{arm.name}.json"
    if not path.exists():
        return None
    try:
        k = json.loads(path.read_text())
        mtp = ((k.get("key") or {}).get("base") or {}).get("mtp")
        result = ArmResult(arm, k["summary"], k["records"], k["wall_s"], k["config"], mtp)
    except (ValueError, KeyError) as e:
        print(f"  {arm.name}: {path} is unreadable ({e!r}); running the arm", flush=True)
        return None
    if k.get("key") != key:
        if report and untrained_base_match(k.get("key"), key):
            print(f"  {arm.name}: kept from a base of this config (none trained here)", flush=True)
            return result
        print(f"  {arm.name}: {path} is of another launch or base; running the arm", flush=True)
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


def keep_arm(keep: Path, res: ArmResult, key: dict) -> None:
    Path(keep).mkdir(parents=True, exist_ok=True)
    kept = {
        "key": key,
        "wall_s": res.wall_s,
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
    later call without `rerun` after an interrupted one restores the earlier directory)."""
    wd = Path(root).absolute() / arm.name
    done, record = wd / "rl" / "summary.json", wd / "arm.json"
    base = Path(base).absolute()
    init = [f"mtp.init_from={str(base / 'mtp' / 'ckpt')!r}"] if arm.pretrained else []
    run = {"config": config, "base": str(base)}
    run["overrides"] = ["stages=('rl',)", *init, *extra, *arm.overrides]
    key = kept_key(config, run["overrides"], base, arm.pretrained) if keep else None
    rerun = rerun and launch_missing  # an arm only reported is never launched
    earlier = wd.with_name(f"{arm.name}.before_rerun")
    if not rerun and not done.exists() and (earlier / "rl" / "summary.json").exists():
        shutil.rmtree(wd, ignore_errors=True)  # an interrupted rerun: the earlier run back
        earlier.rename(wd)
    saved = json.loads(record.read_text()) if record.exists() else {}
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
            if (res := kept_arm(kept, arm, key, not launch_missing)) is not None:
                print(f"  {arm.name}: kept in {kept}", flush=True)
                return res
        if not launch_missing:
            return None
    wall = saved.get("wall_s")
    if done.exists() and not same:  # another base, config or setting
        print(f"  {arm.name}: {wd} is a run of another launch; running it again", flush=True)
        done.unlink()
    if not done.exists():
        shutil.rmtree(wd, ignore_errors=True)
        wd.mkdir(parents=True)
        if (base / "sft").exists():  # a policy of its own (not a GGUF / HF checkpoint)
            link_tree(base / "sft", wd / "sft")
        t0 = time.perf_counter()
        launch(config, wd, run["overrides"])
        wall = time.perf_counter() - t0
        saved = {"wall_s": wall, "launch": run, "key": key}
        record.write_text(json.dumps(saved) + "\n")
        print(f"  {arm.name}: {wall:.0f} s", flush=True)
        shutil.rmtree(earlier, ignore_errors=True)
    summary = json.loads(done.read_text())
    cfg = json.loads((wd / "config.json").read_text()) if (wd / "config.json").exists() else {}
    mtp = base_identity(base, arm.pretrained)["mtp"]
    res = ArmResult(arm, summary, plots.read_metrics(wd / "rl" / "metrics.jsonl"), wall, cfg, mtp)
    if keep and saved.get("key") == key:
        keep_arm(keep, res, key)
    return res


# Arms whose wall times are compared must run side by side: this machine's speed drifts by up to
# 1.5-2x between days, so arms that started further apart than this are not compared by time
# (their acceptance and accuracy still are).
SIDE_BY_SIDE_S = 12 * 3600


def hours_apart(a: ArmResult, b: ArmResult) -> float | None:
    """Hours between the starts of two arms if more than `SIDE_BY_SIDE_S` (None: comparable by
    wall time)."""
    apart = abs(a.records[0]["time"] - b.records[0]["time"])
    return apart / 3600 if apart > SIDE_BY_SIDE_S else None


def running_mean(y, width: int) -> np.ndarray:
    """Mean of the last `width` values at each point (fewer at the start)."""
    y = np.asarray(y, np.float64)
    c = np.cumsum(np.insert(y, 0, 0.0))
    lo = np.maximum(np.arange(1, y.size + 1) - width, 0)
    return (c[1:] - c[lo]) / (np.arange(1, y.size + 1) - lo)


def smoothed(res: ArmResult, key: str, width: int):
    """(step, running mean of `key` over `width` steps)."""
    step, y = res.series(key)
    return step, running_mean(y, width)


def window_mean(res: ArmResult, key: str, first: bool, n: int = 10) -> float:
    """Mean of `key` over the first (or last) `n` steps that record it."""
    _, y = res.series(key)
    if y.size == 0:
        raise KeyError(f"{res.arm.name}: no step records {key!r}")
    return float(np.mean(y[:n] if first else y[-n:]))


def step_times(res: ArmResult) -> tuple[np.ndarray, np.ndarray]:
    """(step, seconds since the previous step's record) for steps 2.., i.e. without the first
    step, which also compiles."""
    step, t = res.series("time")
    return step[1:], np.diff(t)


def write_json(path: Path, obj) -> None:
    Path(path).write_text(json.dumps(obj, indent=1) + "\n")


# ------------------------------------------------------------------ study 2: MTP during RL
# The arms of `experiments/{mtp_in_rl,growmtp,e2e_speedup}`: one demo RL run (configs/demo.py's
# RL stage: 120 GRPO steps of 16 prompts x 8 samples, T = 0.7, γ = 2) from one base run, varying
# only how rollouts are drafted and verified and what updates the MTP. An arm named in two
# studies that share a root runs once. Acceptance is measured in `runs/exp_mtp_in_rl`; the arms
# whose wall times are compared (growmtp, e2e_speedup) share `runs/exp_rl_speed`, measured one
# after the other with nothing else running.
STUDY2_ROOT = "runs/exp_mtp_in_rl"
TIMED_ROOT = "runs/exp_rl_speed"
STUDY2_EXTRA = ("rl.eval_every=0",)
STUDY2_ARMS = {
    a.name: a
    for a in (
        Arm("plain", "plain rollouts (no speculation)", ("rollout.mode='plain'",), False),
        Arm("frozen_rs", "frozen e2e-TV MTP, RS (Bebop)", ("rl.mtp_strategy='frozen'",)),
        Arm(
            "online_ce",
            "e2e-TV MTP + online CE, RS",
            ("rl.mtp_strategy='online'", "rl.mtp_loss='ce'"),
        ),
        Arm(
            "online_tv",
            "e2e-TV MTP + online e2e TV, RS",
            ("rl.mtp_strategy='online'", "rl.mtp_loss='e2e_tv'"),
        ),
        Arm(
            "to_online_ce",
            "e2e-TV MTP + online CE, TO",
            ("rollout.mode='target_only'", "rl.mtp_strategy='online'", "rl.mtp_loss='ce'"),
        ),
        Arm("grow_scratch", "GrowMTP from random init, RS", ("rl.mtp_strategy='growmtp'",), False),
        Arm(
            "grow_pretrained",
            "pre-trained MTP + GrowMTP updates, RS",
            ("rl.mtp_strategy='growmtp'",),
        ),
        Arm(
            "plain_sync",
            "plain, synchronous",
            ("rollout.mode='plain'", "rl.max_staleness=0"),
            False,
        ),
        Arm("frozen_rs_sync", "frozen MTP, RS, synchronous", ("rl.max_staleness=0",)),
        # Tail-aware rollouts (`rollout.compact`): the speculative arm with the draft table
        # derived from measured costs and the running acceptance (γ per live-batch size).
        Arm(
            "plain_compact",
            "plain, tail-aware",
            ("rollout.mode='plain'", "rollout.compact=True"),
            False,
        ),
        Arm(
            "frozen_rs_compact",
            "frozen MTP, RS, tail-aware, derived draft table",
            ("rollout.compact=True",),
        ),
        Arm(
            "plain_compact_sync",
            "plain, tail-aware, synchronous",
            ("rollout.mode='plain'", "rollout.compact=True", "rl.max_staleness=0"),
            False,
        ),
        Arm(
            "frozen_rs_compact_sync",
            "frozen MTP, RS, tail-aware, derived draft table, synchronous",
            ("rollout.compact=True", "rl.max_staleness=0"),
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class Model:
    """What a study-2 script runs on (`--model`): the arms' config; the base run every arm
    starts from (its config and stages: the policy and the pre-RL MTP); default directories; the
    results file in the study's directory; overrides every arm gets; the figures' setting."""

    config: str
    base_config: str
    base_stages: tuple[str, ...]
    base: str
    study2_root: str
    timed_root: str
    results: str
    extra: tuple[str, ...]
    setting: str


MODELS = {
    "demo": Model(
        "configs/demo.py",
        "configs/demo.py",
        ("sft", "distill", "mtp"),
        "runs/demo",
        STUDY2_ROOT,
        TIMED_ROOT,
        "results.json",
        STUDY2_EXTRA,
        "demo GRPO, T = 0.7, γ = 2, 128 rows/step",
    ),
    # `configs/rl_smollm2.py`'s task (40 GRPO steps of 4 prompts x 8, T = 0.7, γ = 3, greedy
    # accuracy every 10 steps) from one run of the recipe's MTP (`configs/mtp_smollm2.py`:
    # distil + MTP; the policy is the GGUF's). Its config turns tail-aware rollouts on: static
    # arms turn them off (arms that set `rollout.compact=True` come after).
    "smollm2": Model(
        "configs/rl_smollm2.py",
        "configs/mtp_smollm2.py",
        ("distill", "mtp"),
        "runs/mtp_smollm2",
        "runs/exp_mtp_in_rl_smollm2",
        "runs/exp_rl_speed_smollm2",
        "results_smollm2.json",
        ("rollout.compact=False",),
        "SmolLM2-135M GRPO (wordmath), T = 0.7, γ = 3, 32 rows/step",
    ),
}


def study2_arms(
    names, base: Path, root: Path, args=None, launch_missing: bool = True, borrow=()
) -> dict[str, ArmResult]:
    """The arms `names` from `base` in `root`; `args` (`study2_parser`'s): the model's config
    (`:runlocal` with `--runlocal`) and overrides, then `--set`. Finished arms of the study's own
    setting (no `--runlocal`, no `--set`) are kept in `kept_arms/<root's name>/`.
    `launch_missing=False`: only the arms that are finished or kept; `borrow`: `run_arm`'s; the
    arms of `args.rerun_arms` (`chosen_arms`) run again when launched."""
    m = MODELS[getattr(args, "model", "demo")]
    local, sets = getattr(args, "runlocal", False), tuple(getattr(args, "set", ()))
    config = m.config + (":runlocal" if local else "")
    keep = None if local or sets else kept_dir(root)
    again = getattr(args, "rerun_arms", ())
    out = {
        n: run_arm(
            STUDY2_ARMS[n],
            base,
            root,
            config,
            (*m.extra, *sets),
            keep,
            launch_missing,
            borrow,
            rerun=n in again,  # run_arm launches only with launch_missing
        )
        for n in names
    }
    return {n: r for n, r in out.items() if r is not None}


def study2_chosen(names, every, base: Path, root: Path, args, borrow=()) -> dict[str, ArmResult]:
    """The arms `names` (`--arms`: launched where missing) and the study's other arms of `every`
    that are finished or kept (reported, not launched), in the order of `every`, checked to have
    drafted with one pre-RL MTP (`one_pre_rl_mtp`)."""
    results = study2_arms(names, base, root, args, borrow=borrow)
    rest = [n for n in every if n not in names]
    results.update(study2_arms(rest, base, root, args, False, borrow))
    results = {n: results[n] for n in every if n in results}
    one_pre_rl_mtp(results)
    return results


def one_pre_rl_mtp(results: dict[str, ArmResult]) -> None:
    """Arms compared in one study drafted with one pre-RL MTP: arms reported beside a base that
    is only its config may come from different trained bases of that config (`kept_arm`), which
    is refused here, naming the arms and their MTPs' outcomes."""
    seen: dict[str, list[str]] = {}
    for n, r in results.items():
        if r.mtp is not None:
            seen.setdefault(json.dumps(r.mtp, sort_keys=True), []).append(n)
    if len(seen) > 1:
        which = "; ".join(f"{', '.join(v)}: {k}" for k, v in seen.items())
        raise SystemExit(
            f"the arms drafted with different pre-RL MTPs ({which}): run them again from one base"
        )


def outputs(args, here: Path, root: Path) -> Path:
    """Where a study-2 script writes its results file and figures: the study's directory `here`
    for its own setting; a smoke or `--set` run writes to `root/results/` (it never replaces
    the study's committed results)."""
    if not (getattr(args, "runlocal", False) or getattr(args, "set", ())):
        return Path(here)
    out = Path(root) / "results"
    out.mkdir(parents=True, exist_ok=True)
    return out


def kept_dir(root: Path) -> Path:
    """Where the arms of the arm directory `root` are kept."""
    return KEPT / Path(root).name


def study2_parser(root: str) -> argparse.ArgumentParser:
    """The study-2 scripts' common flags (`root`: the demo's arm directory; `study2_base`
    resolves the model's defaults)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="demo")
    ap.add_argument("--base", default=None, help="a finished base run (default: the model's)")
    ap.add_argument(
        "--out", "--workdir", default=None, help=f"where the arms' runs land (demo: {root})"
    )
    ap.add_argument("--window", type=int, default=10, help="steps per window / running mean")
    ap.add_argument("--runlocal", action="store_true", help="the configs' :runlocal smoke settings")
    ap.add_argument(
        "--set", "--extra", action="append", default=[], help="KEY=VALUE for every arm (repeatable)"
    )
    return ap


def add_arms_flag(ap: argparse.ArgumentParser) -> None:
    """`--arms`: which of a study's arms to run; `--rerun`: which of those to run again even
    where finished or kept (`chosen_arms`)."""
    ap.add_argument(
        "--arms", default="", help="comma-separated arms to run, in this order (default: all)"
    )
    ap.add_argument(
        "--rerun",
        default="",
        help="comma-separated arms among --arms to run again although finished or kept (wall "
        "times are compared only between arms that started within 12 h of each other)",
    )


def chosen_arms(ap: argparse.ArgumentParser, args, known) -> tuple[str, ...]:
    """The arms `--arms` names (all of `known` when empty); an arm not in `known`, or named
    twice, is a usage error naming it and the arms the flag may name. `--rerun` names arms among
    those, else the same error; they are kept on `args.rerun_arms` (`study2_arms` runs them
    again)."""

    def parse(flag: str, value: str, among) -> tuple[str, ...]:
        names = tuple(value.split(","))
        unknown = sorted(set(names) - set(among))
        repeated = sorted({n for n in names if names.count(n) > 1})
        if unknown or repeated:
            what = f"unknown {unknown}" if unknown else f"repeated {repeated}"
            ap.error(f"{flag}: {what} (the arms it may name: {', '.join(among)})")
        return names

    names = parse("--arms", args.arms, known) if args.arms else tuple(known)
    args.rerun_arms = parse("--rerun", args.rerun, names) if getattr(args, "rerun", "") else ()
    return names


def study2_base(args, root_attr: str, names=None) -> tuple[Path, Path]:
    """(base run, trained first if needed; the arms' directory) of parsed `study2_parser`
    flags; `root_attr`: the `Model` field of the default arm directory; `names`: the arms to run
    (None: some need the base's weights), e.g. plain arms need no trained base on a model
    without an SFT stage."""
    m = MODELS[args.model]
    local = ":runlocal" if args.runlocal else ""
    weightless = names is not None and not any(STUDY2_ARMS[n].pretrained for n in names)
    # a smoke run's default directories are its own (never the study's base or arms)
    suffix = "_runlocal" if args.runlocal else ""
    base = Path(args.base or m.base + suffix)
    base = base_run(base, m.base_config + local, m.base_stages, (), weightless)
    return base, Path(args.out or getattr(m, root_attr) + suffix)


def report(
    here: Path,
    study: str,
    base: Path,
    results: dict[str, ArmResult],
    t0: float,
    model: str = "demo",
    **fields,
):
    """Writes the model's results file in `here` and prints it as the script's last line."""
    out = {
        "study": study,
        "model": model,
        "base": str(base),
        **fields,
        "arm_wall_s": {n: r.wall_s for n, r in results.items()},
        "wall_s": time.perf_counter() - t0,
    }
    write_json(here / MODELS[model].results, out)
    print(json.dumps(out))
