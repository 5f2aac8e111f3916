"""GrowMTP finding 5: a draft head grown from random init inside RL, from what verification
already computes (DCA loss on the recorded target distributions, detached from the policy).

The demo RL run (the demo's GRPO stage from one SFT policy, same seed and prompts) four ways:
plain rollouts (no speculation), GrowMTP from random init, Bebop's pre-trained e2e-TV MTP frozen,
and the pre-trained MTP with GrowMTP updates. Per RL step: accept length, and the rollout's wall
time next to the plain run's at the same step (running means); the step from which GrowMTP's
rollouts stay at most as slow as plain ones ("starts paying", or never); the final rollout
speedup (the RL stage's timed plain-vs-speculative rollouts of its final weights).

    python experiments/growmtp/run.py --base runs/demo

Arms land in `runs/exp_rl_speed/<arm>/` (shared with `experiments/e2e_speedup`: run both on an
otherwise idle machine, their wall times are compared); figures and `results.json` next to this
file. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bebop import plots  # noqa: E402
from experiments import common  # noqa: E402

HERE = Path(__file__).resolve().parent
ARMS = ("plain", "grow_scratch", "frozen_rs", "grow_pretrained")
SPEC = ARMS[1:]


def pays_from(step, ratio) -> int | None:
    """The first step from which `ratio` (speculative / plain rollout time) stays <= 1."""
    above = np.nonzero(np.asarray(ratio) > 1.0)[0]
    if above.size == 0:
        return int(step[0])
    last = above[-1]
    return int(step[last + 1]) if last + 1 < len(step) else None


def row(res: common.ArmResult, plain: common.ArmResult, window: int) -> dict:
    step, t = res.series("rollout_s")
    pstep, pt = plain.series("rollout_s")
    if not np.array_equal(step, pstep):
        raise ValueError(f"{res.arm.name} and plain record rollout_s at different steps")
    ratio = common.running_mean(t, window) / common.running_mean(pt, window)
    speed = res.summary.get("rollout_speedup") or {}
    _, alen = res.series("accept_len")
    return {
        "label": res.arm.label,
        "accept_len_first": float(alen[0]),
        "accept_len_first10": common.window_mean(res, "accept_len", True, window),
        "accept_len_last10": common.window_mean(res, "accept_len", False, window),
        "rollout_s_ratio_first10": float(t[:window].sum() / pt[:window].sum()),
        "rollout_s_ratio_last10": float(t[-window:].sum() / pt[-window:].sum()),
        "rollout_s_total_ratio": float(t[1:].sum() / pt[1:].sum()),
        "pays_from_step": pays_from(step, ratio),
        "final_rollout_speedup": speed.get("speedup"),
        "final_speedup_batch": speed.get("batch"),
        "reward_last10": common.window_mean(res, "reward_mean", False, window),
        "accuracy_after": res.summary["accuracy_after"],
    }


def figures(results: dict[str, common.ArmResult], window: int) -> None:
    setting = f"demo GRPO, T = 0.7, γ = 2, 128 rows/step; running mean of {window} steps"
    smooth = lambda r, k: (r.series(k)[0], common.running_mean(r.series(k)[1], window))  # noqa: E731
    plots.lines(
        HERE / "accept_len.png",
        {results[n].arm.label: smooth(results[n], "accept_len") for n in SPEC},
        "RL step",
        "accept length (tokens per verify)",
        f"GrowMTP vs a pre-trained MTP ({setting})",
        size=(7, 4.5),
    )
    plots.lines(
        HERE / "rollout_time.png",
        {results[n].arm.label: smooth(results[n], "rollout_s") for n in ARMS},
        "RL step",
        "rollout wall time per step (s)",
        f"rollout time vs plain decoding ({setting})",
        size=(7, 4.5),
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="runs/demo", help="a finished demo run (sft + mtp)")
    ap.add_argument("--workdir", default=common.TIMED_ROOT)
    ap.add_argument("--window", type=int, default=10, help="steps per window / running mean")
    args = ap.parse_args()
    t0 = time.perf_counter()
    base = common.base_run(Path(args.base))
    results = common.study2_arms(ARMS, base, Path(args.workdir))
    rows = {n: row(results[n], results["plain"], args.window) for n in SPEC}
    figures(results, args.window)
    for n, r in rows.items():
        print(
            f"{n:16s} accept len {r['accept_len_first']:.2f} -> {r['accept_len_last10']:.2f}  "
            f"rollout time vs plain {r['rollout_s_ratio_first10']:.2f} -> "
            f"{r['rollout_s_ratio_last10']:.2f} (all steps {r['rollout_s_total_ratio']:.2f})  "
            f"pays from step {r['pays_from_step']}  final speedup {r['final_rollout_speedup']}",
            flush=True,
        )
    out = {
        "study": "growmtp",
        "model": "demo",
        "base": str(base),
        "window_steps": args.window,
        "arms": rows,
        "arm_wall_s": {n: r.wall_s for n, r in results.items()},
        "wall_s": time.perf_counter() - t0,
    }
    common.write_json(HERE / "results.json", out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
