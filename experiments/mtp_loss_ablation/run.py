"""Bebop's Table 2 on our models: which MTP training loss gives the best acceptance?

The five losses (CE, KL, reverse KL, per-step TV, end-to-end TV) each fine-tune the same
warm-started MTP with the same self-distillation data, steps, batch order and seed, with the
policy frozen. The warm start (the same for every loss) is the MTP trained with CE for
`--warm_steps`, the analogue of the paper's CE-pretrained MTP. Evaluation is the real speculative
sampler on held-out prompts at γ = 3: per-position acceptance of rejection sampling (RS), mean
accept length, and target-only (TO) acceptance; deltas are against the CE row, next to the
paper's (docs/method.md §7). Last line: one JSON object with the table.

    python experiments/mtp_loss_ablation/run.py --model demo
    python experiments/mtp_loss_ablation/run.py --model smollm2

Every run is a `launch.py` run under `--workdir/<model>/`: `base/` (policy, distill data, the
warm start), one directory per loss (`<loss>/mtp/ckpt`, `draft_vocab.npy`, `metrics.jsonl`). As
in the pipeline, finished runs (a `summary.json`) are reused, so `--losses` can add an arm
(e.g. `e2e_tv_partial`, not in the paper) to a finished ablation; delete a directory to redo it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from experiments.common import launch  # noqa: E402

LOSSES = ("ce", "kl", "reverse_kl", "tv", "e2e_tv")
# Bebop Table 2: RS acceptance gain over CE, in points, over five benchmarks (docs/method.md §7).
PAPER_DELTA = {
    "ce": "0",
    "kl": "≈ +0",
    "reverse_kl": "≤ +1.3",
    "tv": "+1.4 to +5.2",
    "e2e_tv": "+2.3 to +8.0",
    "e2e_tv_partial": "(not in the paper)",
}
MODELS = {
    "demo": dict(
        config="configs/demo.py",
        policy_stages=("sft", "distill"),
        warm_steps=100,
        steps=100,
        extra=(),
    ),
    "smollm2": dict(
        config="configs/mtp_smollm2.py",
        policy_stages=("distill",),
        warm_steps=40,
        steps=60,
        extra=(),
    ),
}


def row(after: dict) -> dict:
    return {
        "rs_accept_1": after["rejection/accept_rate_1"],
        "rs_accept_2": after["rejection/accept_rate_2"],
        "rs_accept_3": after["rejection/accept_rate_3"],
        "rs_accept": after["rejection/accept_rate"],
        "rs_accept_len": after["rejection/accept_len"],
        "to_accept": after["target_only/accept_rate"],
        "to_accept_len": after["target_only/accept_len"],
        "analytic_alpha": after["rejection/analytic_alpha"],
        "mean_entropy": after["rejection/mean_entropy"],
    }


def table(rows: dict) -> str:
    head = (
        "| loss | RS acc. step 1 | step 2 | step 3 | RS accept len | TO acceptance | "
        "Δ RS acc. vs CE (points) | paper Δ |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for loss, r in rows.items():
        if loss not in PAPER_DELTA:
            continue
        delta = 100 * (r["rs_accept"] - rows["ce"]["rs_accept"])
        lines.append(
            f"| {loss} | {r['rs_accept_1']:.3f} | {r['rs_accept_2']:.3f} | {r['rs_accept_3']:.3f}"
            f" | {r['rs_accept_len']:.2f} | {r['to_accept']:.3f} | {delta:+.1f} |"
            f" {PAPER_DELTA[loss]} |"
        )
    return "\n".join(lines)


def ablate(name: str, root: Path, warm_steps: int, steps: int, overrides, losses) -> dict:
    spec = MODELS[name]
    root = root / name
    base = root / "base"
    t0 = time.perf_counter()
    common = [*spec["extra"], *overrides, "mtp.warmup_loss_steps=0"]
    base_res = launch(
        spec["config"],
        base,
        [
            f"stages={(*spec['policy_stages'], 'mtp')!r}",
            "mtp.loss='ce'",
            f"mtp.steps={warm_steps}",
            f"mtp.eval_every={warm_steps}",
            *common,
        ],
    )
    rows, wall = {"warm_start": row(base_res["mtp"]["after"])}, {}
    print(f"[{name}] warm start (CE x {warm_steps}): {rows['warm_start']}", flush=True)
    for loss in losses:
        wd = root / loss
        done = wd / "mtp" / "summary.json"
        if done.exists():  # finished earlier: reuse
            rows[loss], wall[loss] = row(json.loads(done.read_text())["after"]), None
            continue
        shutil.rmtree(wd, ignore_errors=True)
        wd.mkdir(parents=True)
        for stage in spec["policy_stages"]:
            shutil.copytree(base / stage, wd / stage)
        t1 = time.perf_counter()
        res = launch(
            spec["config"],
            wd,
            [
                f"stages={(*spec['policy_stages'], 'mtp')!r}",
                f"mtp.loss={loss!r}",
                f"mtp.steps={steps}",
                f"mtp.eval_every={steps}",
                f"mtp.init_from={str(base / 'mtp' / 'ckpt')!r}",
                *common,
            ],
        )
        rows[loss] = row(res["mtp"]["after"])
        wall[loss] = time.perf_counter() - t1
        print(f"[{name}] {loss:10s} {rows[loss]}  ({wall[loss]:.0f} s)", flush=True)
    total = time.perf_counter() - t0
    print(
        f"\n{name}: warm start CE x {warm_steps} steps, then {steps} steps per loss; "
        f"{total / 60:.1f} min\n{table(rows)}\n",
        flush=True,
    )
    return {
        "warm_steps": warm_steps,
        "steps": steps,
        "wall_s": total,
        "arm_wall_s": wall,
        "rows": rows,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=[*MODELS, "both"], default="both")
    ap.add_argument("--workdir", default="runs/exp_mtp_loss_ablation")
    ap.add_argument("--warm_steps", type=int, default=0, help="0: the model's default")
    ap.add_argument("--steps", type=int, default=0, help="0: the model's default")
    ap.add_argument("--override", action="append", default=[], help="extra config overrides")
    ap.add_argument("--losses", default=",".join(LOSSES), help="comma-separated; ce first")
    args = ap.parse_args()
    root = Path(args.workdir).absolute()
    names = list(MODELS) if args.model == "both" else [args.model]
    out = {}
    for name in names:
        spec = MODELS[name]
        out[name] = ablate(
            name,
            root,
            args.warm_steps or spec["warm_steps"],
            args.steps or spec["steps"],
            args.override,
            args.losses.split(","),
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
