"""Curves of one RL run (`DIR/rl/metrics.jsonl` and `summary.json`): sampled reward vs step and
vs RL wall-clock (raw and a running mean), greedy accuracy vs step (`rl.eval_every` evaluations
plus before / after), and accept length (tokens per verify) vs step. Writes
`<name>_reward.png`, `<name>_accuracy.png`, `<name>_accept.png` and `<name>.json` here.
Last line: JSON.

    python -m experiments.rl_curves.plot --run runs/demo --name demo
    python -m experiments.rl_curves.plot --run runs/rl_smollm2 --name smollm2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from bebop import plots
from bebop.io import write_json_atomic
from experiments.common import running_mean

HERE = Path(__file__).resolve().parent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", "--workdir", required=True, help="a finished run with an RL stage")
    ap.add_argument("--name", required=True, help="file prefix, e.g. demo")
    ap.add_argument("--setting", default="", help="title text (default: from the summary)")
    ap.add_argument("--window", type=int, default=5, help="running-mean width in steps")
    args = ap.parse_args()
    rdir = Path(args.run) / "rl"
    records = plots.read_metrics(rdir / "metrics.jsonl")
    summary = json.loads((rdir / "summary.json").read_text())
    setting = args.setting or (
        f"{args.name}: GRPO, {summary['steps']} steps, MTP {summary['mtp_strategy']}"
    )
    step, reward = plots.series(records, "reward_mean")
    t0 = min(r["time"] for r in records if "time" in r)
    _, wall = plots.series(records, "time")
    wall = (wall - t0) / 60.0
    smooth = running_mean(reward, args.window)
    plots.twin_x(
        HERE / f"{args.name}_reward.png",
        {
            "sampled reward (batch mean)": (step, wall, reward),
            f"running mean ({args.window} steps)": (step, wall, smooth),
        },
        ("RL step", "RL wall-clock (minutes since the first step)"),
        "reward (fraction correct)",
        setting,
    )
    curve = np.asarray(summary["eval_curve"], np.float64)
    cfg = json.loads((Path(args.run) / "config.json").read_text())
    n_eval = cfg["rl"]["eval_samples"]
    plots.lines(
        HERE / f"{args.name}_accuracy.png",
        {
            f"greedy accuracy ({n_eval} held-out problems)": (
                curve[:, 0],
                100 * curve[:, 1],
            )
        },
        "RL step",
        "greedy accuracy (%)",
        setting,
    )
    s_acc, acc_len = plots.series(records, "accept_len")
    figures = {"reward_first": summary["reward_first"], "reward_last": summary["reward_last"]}
    if s_acc.size:
        plots.lines(
            HERE / f"{args.name}_accept.png",
            {
                "accept length (batch)": (s_acc, acc_len),
                f"running mean ({args.window} steps)": (s_acc, running_mean(acc_len, args.window)),
            },
            "RL step",
            "accept length (tokens / verify)",
            setting,
        )
        figures.update(accept_len_first=float(acc_len[0]), accept_len_last=float(acc_len[-1]))
    figures.update(
        accuracy_before=summary["accuracy_before"],
        accuracy_after=summary["accuracy_after"],
        accuracy_gain_points=100 * (summary["accuracy_after"] - summary["accuracy_before"]),
        eval_curve=summary["eval_curve"],
        rollout_speedup=summary.get("rollout_speedup"),
        rl_wall_s=summary.get("rl_wall_s"),
        steps=summary["steps"],
        eval_samples=n_eval,
    )
    write_json_atomic(HERE / f"{args.name}.json", figures, indent=1)
    print(json.dumps({"name": args.name, **figures}))


if __name__ == "__main__":
    main()
