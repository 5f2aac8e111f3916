"""MTP initialisation on SmolLM2: random vs the backbone's last layer (`mtp.init`).

Both arms run Bebop's pre-RL recipe (`configs/mtp_smollm2.py`: same distilled data, loss, steps,
batch order and seed); the last-layer arm is the config's default and its workdir is the one RL
and the benchmarks use. The random arm shares its distill data (copied, not re-sampled). Plots
step-1..3 RS acceptance and accept length on held-out RL-task prompts against the training step,
and the training batches' per-position α, from the two `metrics.jsonl`. Last line: JSON.

    python -m experiments.mtp_init.run [--main runs/mtp_smollm2] [--steps 300] [--plot_only]

The committed results.json and plots are from `--steps 300` (the recipe's length then).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from bebop import plots
from bebop.io import write_json_atomic

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def launch(workdir: Path, steps: int, *overrides: str) -> None:
    cmd = [
        sys.executable,
        "launch.py",
        "--config",
        "configs/mtp_smollm2.py",
        "--workdir",
        str(workdir),
        *[f"--config.{o}" for o in (f"mtp.steps={steps}", *overrides)],
    ]
    subprocess.run(cmd, cwd=REPO, check=True)


def curves(workdir: Path) -> dict:
    records = plots.read_metrics(workdir / "mtp" / "metrics.jsonl")
    out = {}
    for key in (
        "eval/rejection/accept_len",
        "eval/mixed/rejection/accept_len",
        *(f"eval/rejection/accept_rate_{k}" for k in (1, 2, 3)),
        *(f"alpha_{k}" for k in (1, 2, 3)),
    ):
        x, y = plots.series(records, key)
        out[key] = (x.tolist(), y.tolist())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--main", default="runs/mtp_smollm2")
    ap.add_argument("--random", default="runs/mtp_smollm2_random")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--plot_only", action="store_true")
    args = ap.parse_args()
    main_dir, rand_dir = REPO / args.main, REPO / args.random
    if not args.plot_only:
        # distils, caches the target's hiddens, trains the last-layer arm
        launch(main_dir, args.steps)
        # The random arm reuses the distill data and the cached target (same policy, tokens, T).
        shutil.copytree(main_dir / "distill", rand_dir / "distill", dirs_exist_ok=True)
        launch(rand_dir, args.steps, "mtp.init='random'")
    arms = {"last layer": curves(main_dir), "random": curves(rand_dir)}
    setting = "SmolLM2 MTP, γ = 3, RS, T = 1"
    for key, name, prompts in [
        ("eval/rejection/accept_len", "accept_len", "wordmath"),
        ("eval/mixed/rejection/accept_len", "accept_len_mixed", "mixed chat"),
    ]:
        drawn = {a: c[key] for a, c in arms.items() if c[key][0]}
        plots.lines(
            HERE / f"{name}.png",
            drawn,
            "MTP training step",
            "accept length (tokens / verify)",
            f"{setting}: {prompts} held-out prompts",
        )
    per_pos = {}
    for a, c in arms.items():
        for k in (1, 2, 3):
            if c[f"eval/rejection/accept_rate_{k}"][0]:
                per_pos[f"{a}, position {k}"] = c[f"eval/rejection/accept_rate_{k}"]
    plots.lines(
        HERE / "per_position.png",
        per_pos,
        "MTP training step",
        "RS acceptance at draft position k",
        f"{setting}: wordmath held-out prompts",
    )
    summary = {a: {k: (v[1][-1] if v[1] else None) for k, v in c.items()} for a, c in arms.items()}
    write_json_atomic(HERE / "results.json", {"final": summary, "curves": arms}, indent=1)
    print(json.dumps({"final": summary}))


if __name__ == "__main__":
    main()
