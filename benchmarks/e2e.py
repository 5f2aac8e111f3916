"""The demo pipeline end to end, then its RL stage with and without speculative rollouts.

    python -m benchmarks.e2e --out /tmp/e2e [--config configs/demo.py] [--set rl.steps=60]

1. `launch.py --config CONFIG` (the demo: SFT, distillation, MTP, async GRPO with speculative
   rollouts), timed whole; each stage's scalar summary figures are kept.
2. From that run's SFT policy and MTP, the RL stage twice more with the same seed and prompts
   (`experiments.common`'s arms, greedy evaluation only at the end): `plain` rollouts and
   `frozen_rs` (the frozen MTP drafts, rejection sampling: Bebop's recipe), one after the other.
   Per arm (`experiments.e2e_speedup.run`'s `timing`): RL time after step 1 (which compiles),
   median step, rollout time and its share of the RL time (asynchronous RL samples the next
   batch while the learner updates, so the share can exceed 1), accept length, reward and
   accuracy after RL; and the speedups plain / speculative.

`--set KEY=VALUE` (repeatable) overrides the config in every run (e.g. fewer steps for a short
check). After each part the figures so far are printed as one JSON line, and on SIGTERM (a time
limit) those of the stages finished by then (`cut_after_s`); last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path

ARMS = ("plain", "frozen_rs")
STAGES = ("sft", "distill", "mtp", "rl")


def scalars(path: Path) -> dict:
    """The number- and string-valued entries of a stage's `summary.json` ({} if absent)."""
    if not path.exists():
        return {}
    d = json.loads(path.read_text())
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool)) or v is None}


def arm_figures(res) -> dict:
    from experiments.e2e_speedup.run import timing

    t = timing(res)
    t.pop("draft_table", None)
    t["rollout_share"] = t["rollout_s"] / t["rl_s_after_step_1"] if t["rl_s_after_step_1"] else None
    t["arm_wall_s"] = res.wall_s
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", "--workdir", default="runs/e2e", help="the pipeline's run (the arms: OUT/arms)"
    )
    ap.add_argument("--config", default="configs/demo.py")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE config override")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"RL arms after the pipeline {ARMS}")
    args = ap.parse_args()
    import jax

    from experiments import arms, common

    wd = Path(args.out).absolute()
    res = {"config": args.config, "overrides": args.set, "device": jax.devices()[0].device_kind}
    t0 = time.perf_counter()

    def cut(signum, frame):  # cut at a time limit: the stages finished so far, then exit
        del frame
        res["cut_after_s"] = time.perf_counter() - t0
        res.setdefault("pipeline", {s: scalars(wd / s / "summary.json") for s in STAGES})
        print(json.dumps(res), flush=True)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, cut)
    arms.launch(args.config, wd, args.set)
    res["pipeline_wall_s"] = time.perf_counter() - t0
    res["pipeline"] = {s: scalars(wd / s / "summary.json") for s in STAGES}
    print(json.dumps(res), flush=True)

    figures = {}
    for name in [a for a in args.arms.split(",") if a]:
        arm = common.STUDY2_ARMS[name]
        extra = (*common.STUDY2_EXTRA, *args.set)
        figures[name] = arm_figures(arms.run_arm(arm, wd, wd / "arms", args.config, extra))
        res["arms"] = figures
        print(f"{name}: {json.dumps(figures[name])}", flush=True)
        print(json.dumps(res), flush=True)
    if {"plain", "frozen_rs"} <= figures.keys():
        p, s = figures["plain"], figures["frozen_rs"]
        res["speedup_spec_over_plain"] = {
            k: p[k] / s[k] if s[k] else None
            for k in ("rl_s_after_step_1", "step_s_median", "rollout_s")
        }
    res["wall_s"] = time.perf_counter() - t0
    print(json.dumps(res))


if __name__ == "__main__":
    main()
