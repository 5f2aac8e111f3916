"""Learning curves of one run of the SmolLM2 MTP recipe (`configs/mtp_smollm2.py`).

Reads `DIR/mtp/metrics.jsonl` and draws, against the training step: the held-out accept length
(RS and TO on wordmath prompts, RS on mixed chat; γ = 3, at the run's rollout temperature), the
held-out RS acceptance per draft position, and the training batches' own per-position α
(teacher-forced, analytic). Writes `<prefix>curves.png`, `<prefix>per_position.png` and
`<prefix>results.json` here. Last line: JSON.

    python -m experiments.mtp_recipe.plot --run runs/mtp_1500                # 2-digit, T = 1
    python -m experiments.mtp_recipe.plot --run runs/mtp_smollm2 --prefix rl_task_
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from bebop import plots
from bebop.io import write_json_atomic

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def setting(workdir: Path) -> str:
    """The run's recipe in a title, from its config.json."""
    c = json.loads((workdir / "config.json").read_text())
    data = f"{c['distill']['num_samples']} {c['task']['digits']}-digit answers"
    return f"SmolLM2 MTP ({c['mtp']['loss']}, {data}), γ = 3, T = {c['rollout']['temperature']:g}"


def windowed(x, y, width: int):
    """Means of y over consecutive windows of `width` steps (the training batches are noisy)."""
    edges = np.arange(0, x.max() + width, width)
    idx = np.digitize(x, edges[1:-1])
    keep = [i for i in range(len(edges) - 1) if (idx == i).any()]
    return edges[1:][keep], np.asarray([y[idx == i].mean() for i in keep])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", "--workdir", default="runs/mtp_smollm2", help="a finished run")
    ap.add_argument("--prefix", default="", help="of the output files")
    args = ap.parse_args()
    records = plots.read_metrics(REPO / args.run / "mtp" / "metrics.jsonl")
    title = setting(REPO / args.run)
    held_out = {
        "RS, wordmath": "eval/rejection/accept_len",
        "TO, wordmath": "eval/target_only/accept_len",
        "RS, mixed chat": "eval/mixed/rejection/accept_len",
    }
    curves = {label: plots.series(records, key) for label, key in held_out.items()}
    x, y = plots.series(records, "accept_len")  # training batches, teacher-forced
    curves["training batches (analytic)"] = windowed(x, y, 150)
    plots.lines(
        HERE / f"{args.prefix}curves.png",
        curves,
        "MTP training step",
        "accept length (tokens / verify)",
        f"{title}: held-out",
    )
    per_pos = {}
    for k in (1, 2, 3):
        per_pos[f"held-out RS, position {k}"] = plots.series(
            records, f"eval/rejection/accept_rate_{k}"
        )
        x, y = plots.series(records, f"alpha_{k}")
        per_pos[f"training α, position {k}"] = windowed(x, y, 150)
    plots.lines(
        HERE / f"{args.prefix}per_position.png",
        per_pos,
        "MTP training step",
        "acceptance at draft position k",
        f"{title}: per position",
    )
    out = {
        label: [[float(a), float(b)] for a, b in zip(*c, strict=True)]
        for label, c in curves.items()
    }
    result = {"workdir": args.run, "curves": out}
    write_json_atomic(HERE / f"{args.prefix}results.json", result, indent=1)
    print(json.dumps({label: c[-1] for label, c in out.items()}))


if __name__ == "__main__":
    main()
