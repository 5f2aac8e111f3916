"""Bebop's Table 2 and Fig. 4 on SmolLM2: which MTP training loss gives the best acceptance, and
does CE's acceptance decline during training while TV's holds?

Every arm is the pre-RL recipe of `configs/mtp_smollm2.py` (its distilled data -- the RL task's
own samples at the rollout temperature, with a quarter of mixed chat --, its steps, warm-up,
init, draft vocabulary and seed) with only `mtp.loss` changed, and no early stop (every arm
runs all the steps). The frozen target's hiddens and log-normalisers are cached once with the
distilled data and shared by every arm, so an arm costs only its MTP's own steps.

Measured per arm:
- curves (Fig. 4): the training batches' own per-position α (teacher-forced, analytic; logged
  every `mtp.log_every` steps) and the 16-prompt held-out RS accept length every
  `mtp.eval_every` steps;
- the final MTP on `--eval_prompts` held-out prompts of the task (RS, γ = `mtp.eval_draft`, the
  rollout temperature, the same prompts and keys for every arm): per-position acceptance,
  accept length, and the analytic acceptance Σ min(p, q) of the drafted tokens, with the
  acceptance's difference to CE paired by prompt (mean ± 1 s.e. over prompts).

    python -m experiments.mtp_loss_ablation.run                   # SmolLM2, ~55 min an arm here
    python -m experiments.mtp_loss_ablation.run --model demo      # the demo policy, minutes

Runs live under `OUT/<model>/` (`--out`): `base/` is a run of the recipe (`--base DIR` to use one,
e.g. `runs/mtp_smollm2`; else its stages before `mtp` run there first); its `mtp` stage, when it
has one that ran every step with the e2e TV loss, is that arm. Each other arm `<loss>/`
hard-links the base's distilled data and target cache (the first arm to need the cache computes
it and links it back into the base). An arm is reused once finished (`mtp/summary.json`) and
resumes from its last checkpoint when interrupted; its held-out evaluation is saved as
`<loss>/heldout.json`. A finished arm's figures (held-out evaluation and curves) are also kept
here, in `arms/<model>_<loss>.json` with the arm's config: a later launch whose arm config is the
same uses them instead of training the arm again, so the arms of this study can be trained in
separate launches (run directories do not survive a fresh checkout). Writes
`results_<model>.json` and the curves here. Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from bebop.io import write_json_atomic

# This process evaluates each arm (JAX) before the next arm's training launch starts: on a GPU it
# must not hold three quarters of the memory that launch needs.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from experiments import mtp_arms
from experiments.mtp_arms import MODELS, paired_delta

HERE = Path(__file__).resolve().parent
LOSSES = ("ce", "kl", "reverse_kl", "tv", "e2e_tv", "e2e_tv_partial")
# Bebop Table 2: RS acceptance gain over CE, in points, over five benchmarks (docs/method.md §7).
PAPER_DELTA = {
    "ce": "0",
    "kl": "≈ +0",
    "reverse_kl": "≤ +1.3",
    "tv": "+1.4 to +5.2",
    "e2e_tv": "+2.3 to +8.0",
    "e2e_tv_partial": "(not in the paper)",
}
ARMS_DIR = HERE / "arms"


def loss_arm(loss: str) -> list[str]:
    """An arm's own overrides: its MTP loss."""
    return [f"mtp.loss={loss!r}"]


def table(rows: dict) -> str:
    lines = [
        "| loss | prompts | RS acc. step 1 | step 2 | step 3 | RS accept len | analytic α | "
        "Δ RS acc. vs CE (points, ± 1 s.e., on n prompts) | paper Δ |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for loss, r in rows.items():
        d, se, n = r["delta_vs_ce"]
        lines.append(
            f"| {loss} | {r['prompts']} | {r['rs_accept_1']:.3f} | {r['rs_accept_2']:.3f}"
            f" | {r['rs_accept_3']:.3f}"
            f" | {r['rs_accept_len']:.2f} | {r['analytic_alpha']:.3f} | {d:+.1f} ± {se:.1f} ({n}) |"
            f" {PAPER_DELTA[loss]} |"
        )
    return "\n".join(lines)


def plot_curves(recs: dict[str, list], name: str, window: int) -> list[str]:
    """Per-position training α (windowed means) and held-out accept length against the step,
    from each arm's metric records."""
    from bebop import plots

    paths = []
    for k in (1, 2, 3):
        curves = {}
        for loss, r in recs.items():
            x, y = plots.series(r, f"alpha_{k}")
            if len(x):
                edges = np.arange(0, x.max() + window, window)
                idx = np.digitize(x, edges[1:-1])
                keep = np.unique(idx)
                curves[loss] = (edges[keep] + window, np.array([y[idx == i].mean() for i in keep]))
        path = HERE / f"{name}_alpha_{k}.png"
        plots.lines(
            path,
            curves,
            "training step",
            f"training-batch α, draft step {k}",
            f"{name}: MTP losses, draft step {k} (teacher-forced, {window}-step means)",
        )
        paths.append(path.name)
    curves = {loss: plots.series(r, "eval/rejection/accept_len") for loss, r in recs.items()}
    path = HERE / f"{name}_eval_accept_len.png"
    plots.lines(
        path, curves, "training step", "held-out RS accept length (γ = 3)", f"{name}: MTP losses"
    )
    return [*paths, path.name]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(MODELS), default="smollm2")
    ap.add_argument("--out", "--workdir", default="runs/exp_mtp_loss_ablation", help="the runs")
    ap.add_argument("--base", default="", help="a finished recipe run (default OUT/MODEL/base)")
    ap.add_argument("--losses", default=",".join(LOSSES), help="comma-separated; ce first")
    # 768: 1 s.e. of a paired difference 0.48-0.53 points (commit 0111063; 0.88 on 192 prompts).
    ap.add_argument("--eval_prompts", type=int, default=768)
    ap.add_argument(
        "--retrain",
        default="",
        help="comma-separated kept arms not to reuse: evaluated again from their run directory "
        "if it is here, else trained again (e.g. to stand on more prompts)",
    )
    # Prompt i's sampling key depends on the batch it is in: keep this for comparable arms.
    ap.add_argument("--eval_batch", type=int, default=64)
    ap.add_argument("--window", type=int, default=50, help="steps per point of the α curves")
    ap.add_argument(
        "--set", "--override", action="append", default=[], help="config KEY=VALUE (all runs)"
    )
    args = ap.parse_args()
    spec = MODELS[args.model]
    root = Path(args.out).absolute() / args.model
    base = Path(args.base).absolute() if args.base else root / "base"
    losses = args.losses.split(",")
    if losses[0] != "ce" or any(x not in LOSSES for x in losses):
        raise SystemExit(f"--losses: want 'ce' first, then any of {LOSSES}; got {losses}")
    t0 = time.perf_counter()
    want = {loss: mtp_arms.wanted_config(spec, loss_arm(loss), args.set) for loss in losses}
    retrain = set(filter(None, args.retrain.split(",")))
    if retrain - set(losses):
        raise SystemExit(f"--retrain: {sorted(retrain - set(losses))} not in --losses {losses}")
    kept = {
        loss: mtp_arms.kept_arm(ARMS_DIR, args.model, loss, want[loss])
        for loss in losses
        if loss not in retrain
    }
    kept = {loss: k for loss, k in kept.items() if k is not None}
    todo = [loss for loss in losses if loss not in kept]
    if kept:
        print(f"arms kept in {ARMS_DIR} (same config): {sorted(kept)}", flush=True)
    for loss in todo:  # each arm evaluated and kept as soon as it is trained
        wd = mtp_arms.train_arm(spec, root, base, loss, loss_arm(loss), args.set)
        held = mtp_arms.cached_heldout(
            wd, root / loss / "heldout.json", args.eval_prompts, args.eval_batch
        )
        kept[loss] = mtp_arms.keep_arm(ARMS_DIR, args.model, loss, want[loss], wd, held)
    rows = {loss: kept[loss]["heldout"] for loss in losses}
    if rows["ce"]["prompts"] < args.eval_prompts:
        print(
            f"note: CE was evaluated on {rows['ce']['prompts']} prompts, so every Δ stands on at "
            f"most those (--retrain ce evaluates it on {args.eval_prompts})",
            flush=True,
        )
    for loss, r in rows.items():
        print(f"{loss}: held-out RS accept length {r['rs_accept_len']:.3f}", flush=True)
        r["delta_vs_ce"] = paired_delta(r["per_prompt"], rows["ce"]["per_prompt"])
    print(table(rows), flush=True)
    figures = plot_curves({loss: kept[loss]["metrics"] for loss in losses}, args.model, args.window)
    out = {
        "model": args.model,
        "steps": kept["ce"]["steps"],
        "eval_prompts": args.eval_prompts,
        "wall_s": time.perf_counter() - t0,
        "figures": figures,
        "rows": {k: {kk: v for kk, v in r.items() if kk != "per_prompt"} for k, r in rows.items()},
    }
    write_json_atomic(HERE / f"results_{args.model}.json", out, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
