"""What the study scripts share: the RL arms of the studies of MTP during RL (`STUDY2_ARMS`,
each run by `arms.run_arm`), the models they run on, their flags, and the series, windows and
results files of their reports."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from bebop.io import write_json_atomic
from experiments.arms import Arm, ArmResult, base_run, run_arm

KEPT = Path(__file__).resolve().parent / "kept_arms"


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
    """`obj` as JSON in `path`, replaced whole (a kill mid-write leaves the previous file)."""
    write_json_atomic(path, obj, indent=1)


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
        Arm(
            "grow_scratch",
            "GrowMTP from random init, RS",
            ("rl.mtp_strategy='growmtp'", "mtp.init='random'", "mtp.draft_vocab=0"),
            False,
        ),
        # SmolLM2's config initialises an MTP from the policy's last block (`mtp.init`): a head
        # grown from there, with no MTP training before RL. A grown head drafts over the full
        # vocabulary (`mtp.draft_vocab=0`; the recipe's head keeps 8,192 tokens)
        Arm(
            "grow_last_layer",
            "GrowMTP from the policy's last block, RS",
            ("rl.mtp_strategy='growmtp'", "mtp.init='last_layer'", "mtp.draft_vocab=0"),
            False,
        ),
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
    names,
    base: Path,
    root: Path,
    args=None,
    launch_missing: bool = True,
    borrow=(),
    resume_every: int = 0,
) -> dict[str, ArmResult]:
    """The arms `names` from `base` in `root`; `args` (`study2_parser`'s): the model's config
    (`:runlocal` with `--runlocal`) and overrides, then `--set`. Finished arms of the study's own
    setting (no `--runlocal`, no `--set`) are kept in `kept_arms/<root's name>/`.
    `launch_missing=False`: only the arms that are finished or kept; `borrow`, `resume_every`:
    `run_arm`'s; the arms of `args.rerun_arms` (`chosen_arms`) run again when launched."""
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
            resume_every=resume_every,
        )
        for n in names
    }
    return {n: r for n, r in out.items() if r is not None}


def study2_chosen(
    names, every, base: Path, root: Path, args, borrow=(), resume_every: int = 0
) -> dict[str, ArmResult]:
    """The arms `names` (`--arms`: launched where missing; `resume_every`: `run_arm`'s) and the
    study's other arms of `every` that are finished or kept (reported, not launched), in the
    order of `every`, checked to have drafted with one pre-RL MTP (`one_pre_rl_mtp`)."""
    results = study2_arms(names, base, root, args, borrow=borrow, resume_every=resume_every)
    rest = [n for n in every if n not in names]
    results.update(study2_arms(rest, base, root, args, False, borrow, resume_every))
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
