"""Held-out accept length against γ for one trained draft head: how far a longer draft goes.

The study's arms are evaluated at γ = 3, the chain length their e2e TV loss trains. A longer
draft can only add accepted tokens, but each extra position is accepted at most as often as the
one before it was reached, so the accept length is bounded. This evaluates one run's final MTP
on the same held-out prompts and keys as the study (`mtp_arms.heldout`, RS) at several γ and
temperatures, and sets each measurement beside the geometric prediction from the γ = `--ref`
evaluation's pooled acceptance α: 1 + α + … + α^γ, whose limit 1 / (1 - α) is the most any γ
gives while the acceptance per position stays at α. Drafts beyond the trained chain length can
fall below it.

    python -m experiments.draft_features.gamma_sweep --run runs/exp_draft_features/last_d2 \\
        --name last_d2 [--gammas 3,5,6,8] [--temperatures 0.7,1.0] [--prompts 256]

Writes `gamma_sweep_<name>.json` here (finished evaluations of the same run, steps and prompts
are reused when it runs again); last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from experiments import mtp_arms

HERE = Path(__file__).parent


def geometric_accept_len(alpha: float, gamma: int) -> float:
    """Expected tokens per verify when each of γ drafted positions is accepted with probability
    `alpha` given the ones before it were: 1 + α + … + α^γ."""
    return sum(alpha**k for k in range(gamma + 1))


def sweep_figures(evals: dict[int, dict], ref: int) -> dict:
    """Per γ (`evals`: γ -> a `heldout` result at one temperature): the measured accept length,
    the acceptance per draft position, the geometric prediction from γ = `ref`'s pooled
    acceptance, and that acceptance's ceiling 1 / (1 - α)."""
    if ref not in evals:
        raise ValueError(f"--ref {ref}: no evaluation at γ = {ref} among {sorted(evals)}")
    alpha = evals[ref]["rs_accept"]
    per_gamma = {
        str(g): {
            "accept_len": e["rs_accept_len"],
            "rs_accept": e["rs_accept"],
            "rs_accept_by_position": [e[f"rs_accept_{k}"] for k in range(1, g + 1)],
            "predicted_accept_len": geometric_accept_len(alpha, g),
        }
        for g, e in sorted(evals.items())
    }
    best = max(evals, key=lambda g: evals[g]["rs_accept_len"])
    return {
        "ref_gamma": ref,
        "ref_alpha": alpha,
        "ceiling": 1 / (1 - alpha),
        "best_gamma": best,
        "best_accept_len": evals[best]["rs_accept_len"],
        "per_gamma": per_gamma,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="a run with a trained MTP")
    ap.add_argument("--name", required=True, help="names the output file")
    ap.add_argument("--gammas", default="3,5,6,8")
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--ref", type=int, default=3, help="γ whose acceptance predicts the others")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    gammas = sorted({int(g) for g in args.gammas.split(",")})
    temps = [float(t) for t in args.temperatures.split(",")]
    if args.ref not in gammas:
        ap.error(f"--ref {args.ref} is not among --gammas {gammas}")
    if not (args.run / "mtp" / "summary.json").exists():
        ap.error(f"--run {args.run}: no trained MTP (mtp/summary.json) there")
    out_path = HERE / f"gamma_sweep_{args.name}.json"
    steps = json.loads((args.run / "mtp" / "summary.json").read_text())["steps_run"]
    same = {"run": str(args.run), "steps_run": steps, "prompts": args.prompts}
    saved = json.loads(out_path.read_text()) if out_path.exists() else {}
    evals = saved.get("evals", {}) if saved.get("setup") == {**same, "batch": args.batch} else {}
    t0 = time.perf_counter()
    for t in temps:
        for g in gammas:
            key = f"t{t}_g{g}"
            if key not in evals:
                evals[key] = mtp_arms.heldout(args.run, args.prompts, args.batch, t, gamma=g)
                out_path.write_text(
                    json.dumps({"setup": {**same, "batch": args.batch}, "evals": evals}) + "\n"
                )
            e = evals[key]
            print(f"T={t} γ={g}: accept len {e['rs_accept_len']:.3f}", flush=True)
    figures = {
        f"t{t}": sweep_figures({g: evals[f"t{t}_g{g}"] for g in gammas}, args.ref) for t in temps
    }
    out = {
        "study": "draft_features_gamma_sweep",
        "arm": args.name,
        **same,
        "batch": args.batch,
        "figures": figures,
        "wall_s": time.perf_counter() - t0,
    }
    out_path.write_text(
        json.dumps({"setup": {**same, "batch": args.batch}, "evals": evals, **out}) + "\n"
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
