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

Writes `gamma_sweep_<name>.json` here: finished evaluations of the same trained MTP, prompts and
batch are reused when it runs again, and a file of another setup is refused rather than
overwritten. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

from bebop import io
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
    if gammas[0] < 1:
        ap.error(f"--gammas {args.gammas}: every γ must be at least 1")
    if min(temps) <= 0:
        ap.error(f"--temperatures {args.temperatures}: RS needs temperatures above 0")
    if args.ref not in gammas:
        ap.error(f"--ref {args.ref} is not among --gammas {gammas}")
    summary = args.run / "mtp" / "summary.json"
    if not summary.exists():
        ap.error(f"--run {args.run}: no trained MTP (mtp/summary.json) there")
    out_path = HERE / f"gamma_sweep_{args.name}.json"
    setup = {
        "run": str(args.run),
        # which training: a retrained head of the same step count has another summary
        "mtp_summary_sha256": hashlib.sha256(summary.read_bytes()).hexdigest()[:16],
        "steps_run": io.read_json(summary)["steps_run"],
        "prompts": args.prompts,
        "batch": args.batch,
    }
    saved = io.read_json(out_path) if out_path.exists() else {}
    if saved and saved.get("setup") != setup:
        other = sorted(k for k in setup if saved.get("setup", {}).get(k) != setup[k])
        ap.error(
            f"{out_path} holds evaluations of another setup ({', '.join(other)} differ); "
            "pass another --name"
        )
    evals = saved.get("evals", {})
    t0 = time.perf_counter()
    for t in temps:
        for g in gammas:
            key = f"t{t}_g{g}"
            if key not in evals:
                evals[key] = mtp_arms.heldout(args.run, args.prompts, args.batch, t, gamma=g)
                # atomic: a sweep cut off mid-write keeps the evaluations that finished
                io.write_json_atomic(out_path, {"setup": setup, "evals": evals}, indent=None)
            e = evals[key]
            print(f"T={t} γ={g}: accept len {e['rs_accept_len']:.3f}", flush=True)
    figures = {
        f"t{t}": sweep_figures({g: evals[f"t{t}_g{g}"] for g in gammas}, args.ref) for t in temps
    }
    out = {
        "study": "draft_features_gamma_sweep",
        "arm": args.name,
        **setup,
        "figures": figures,
        "wall_s": time.perf_counter() - t0,  # this invocation's: reused evaluations cost nothing
    }
    io.write_json_atomic(out_path, {"setup": setup, "evals": evals, **out}, indent=None)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
