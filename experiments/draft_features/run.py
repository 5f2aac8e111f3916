"""Draft heads for a model without native MTP: which backbone layers feed the draft
(`mtp.features`, EAGLE-3 style fusion) and how deep a draft step is (`mtp.depth`), on SmolLM2.

Every arm is the pre-RL recipe of `configs/mtp_smollm2.py` (its distilled data, steps, loss,
warm-up, init, draft vocabulary and seed) with only `mtp.features` / `mtp.depth` changed and no
early stop; the arms share the base run's distilled data and its frozen-target cache
(`experiments.mtp_arms`). Arms (`ARMS`):

| arm | `mtp.features` | `mtp.depth` |
|---|---|---|
| `last_d1` | the last layer (the recipe) | 1 |
| `layers3_d1` | layers 2, 15, 29 of 30 (low, middle, high) | 1 |
| `last_d2` | the last layer | 2 |
| `layers3_d2` | layers 2, 15, 29 | 2 |

Measured per arm:
- held-out accept length (RS, γ = `mtp.eval_draft` = 3) on `--eval_prompts` prompts of the task
  at T = 0.7 and T = 1.0, the same prompts and keys for every arm (per-prompt acceptance kept,
  so arms are compared paired by prompt against `last_d1`);
- the training curve: the 16-prompt held-out accept length every `mtp.eval_every` steps;
- speed at batch 1 (`benchmarks.rollout --model smollm2 --mtp_ckpt <arm>`, T = 0.7, RS,
  γ = 1..4, paired rounds, `--processes` processes, median over processes): the draft step's cost
  and the (γ+1)-token verify's in plain decode steps, and the speculative sampler's speedup over
  the plain one per γ (`speedup_b1`: the best γ's).

    python launch.py --config configs/mtp_smollm2.py --workdir runs/mtp_smollm2   # the base
    python -m experiments.draft_features.run --base runs/mtp_smollm2 [--arms last_d1,layers3_d1]

Arms land in `OUT/<arm>/` (`--out`, default `runs/exp_draft_features`; the base run is the
`last_d1` arm when it ran every step); a finished arm's figures are kept in `arms/` here and
reused by a later launch with the same arm config, so the study can run in parts. Run the speed
measurements on an otherwise idle machine. Writes `results.json` (every arm kept in `arms/`,
not only this launch's), `accept_len.png` (held-out accept length vs training step, per arm)
and `speedup_vs_gamma.png` here. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bebop.io import write_json_atomic

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from experiments import mtp_arms
from experiments.arms import REPO

HERE = Path(__file__).resolve().parent
ARMS_DIR = HERE / "arms"
LAYERS3 = "mtp.features=(2, 15, 29)"  # SmolLM2's 30 layers: low, middle, high
ARMS = {
    "last_d1": [],
    "layers3_d1": [LAYERS3],
    "last_d2": ["mtp.depth=2"],
    "layers3_d2": [LAYERS3, "mtp.depth=2"],
}
TEMPERATURES = (0.7, 1.0)
GAMMAS = (1, 2, 3, 4)
# The targets for SmolLM2 (RS): held-out accept length at T = 0.7 and T = 1, speedup at batch 1.
TARGETS = {"accept_len_t0.7": 3.0, "accept_len_t1.0": 2.5, "speedup_b1": 1.8}


def speed(wd: Path, processes: int, repeats: int, new_tokens: int) -> dict:
    """Batch-1 speed of run `wd`'s MTP: `benchmarks.rollout` in `processes` processes one after
    the other (each times plain and speculative rollouts in paired rounds); per γ the median over
    processes of the speedup, the accept length and the costs in plain decode steps."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.rollout",
        "--model",
        "smollm2",
        "--mtp_ckpt",
        str(wd / "mtp" / "ckpt"),
        "--batches",
        "1",
        "--gammas",
        ",".join(map(str, GAMMAS)),
        "--temperatures",
        "0.7",
        "--rules",
        "rejection",
        "--repeats",
        str(repeats),
        "--new_tokens",
        str(new_tokens),
    ]
    runs = []
    for _ in range(processes):
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(
                f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stderr[-3000:]}"
            )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1])["rows"])
    return {
        **speed_figures(runs),
        "settings": {"repeats": repeats, "new_tokens": new_tokens, "processes": processes},
    }


def speed_figures(runs: list[list[dict]]) -> dict:
    """Per γ the median over benchmark processes (`runs`: each process's rows) of the speedup,
    accept length and costs, keyed by γ as text (as they read back from JSON); the best γ's
    speedup and draft cost."""
    per_gamma = {}
    for g in GAMMAS:
        rows = [next(r for r in run if r["gamma"] == g) for run in runs]
        per_gamma[str(g)] = {
            k: statistics.median(r[k] for r in rows)
            for k in ("speedup", "accept_len", "draft_cost", "verify_cost")
        }
    best = max(GAMMAS, key=lambda g: per_gamma[str(g)]["speedup"])
    return {
        "speedup_b1": per_gamma[str(best)]["speedup"],
        "best_gamma": best,
        "draft_cost": per_gamma[str(best)]["draft_cost"],
        "per_gamma": per_gamma,
        "processes": len(runs),
    }


def arm_figures(kept: dict) -> dict:
    """An arm's row of the results table from its kept figures, with the number of held-out
    prompts they stand on (`eval_prompts`: a kept arm keeps the count it was evaluated on)."""
    held = kept["heldout"]
    row = {f"accept_len_t{t}": held[f"t{t}"]["rs_accept_len"] for t in TEMPERATURES}
    row["eval_prompts"] = held[f"t{TEMPERATURES[0]}"]["prompts"]
    row.update({f"rs_accept_t{t}": held[f"t{t}"]["rs_accept"] for t in TEMPERATURES})
    row.update(kept.get("speed", {}))
    return row


def verify_cost(speed: dict) -> float:
    """The verify's cost in plain decode steps at the best γ of an arm's timing: the host's
    figure that bounds every speedup it timed (speedups timed where it differs do not compare)."""
    return speed["per_gamma"][str(speed["best_gamma"])]["verify_cost"]


def table(rows: dict, deltas: dict) -> str:
    lines = [
        "| arm | held-out prompts | accept len T=0.7 | T=1.0 | Δ RS acc. T=0.7 vs last_d1 "
        "(points ± s.e., prompts) | draft cost (decode steps) | speedup b1 (best γ, processes; "
        "verify there, decode steps) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        d, se, n = deltas[name]
        speed_ = (
            f"{r['speedup_b1']:.2f}x (γ={r['best_gamma']}, {r['processes']}; "
            f"verify {verify_cost(r):.2f})"
            if "speedup_b1" in r
            else "—"
        )
        cost = f"{r['draft_cost']:.3f}" if "draft_cost" in r else "—"
        lines.append(
            f"| {name} | {r['eval_prompts']} | {r['accept_len_t0.7']:.2f} | "
            f"{r['accept_len_t1.0']:.2f} | {d:+.1f} ± {se:.1f} ({n}) | {cost} | {speed_} |"
        )
    return "\n".join(lines)


def figures(kept: dict) -> list[str]:
    from bebop import plots

    curves = {n: plots.series(k["metrics"], "eval/rejection/accept_len") for n, k in kept.items()}
    plots.lines(
        HERE / "accept_len.png",
        curves,
        "training step",
        "held-out RS accept length (16 prompts, γ = 3)",
        "SmolLM2 draft heads: features and depth",
    )
    names = [n for n, k in kept.items() if "speed" in k]
    if names:
        speed_curves = {
            f"{n} (verify {verify_cost(kept[n]['speed']):.2f} steps at γ="
            f"{kept[n]['speed']['best_gamma']})": (
                list(GAMMAS),
                [kept[n]["speed"]["per_gamma"][str(g)]["speedup"] for g in GAMMAS],
            )
            for n in names
        }
        plots.lines(
            HERE / "speedup_vs_gamma.png",
            speed_curves,
            "γ (drafted tokens per verify)",
            "speedup over plain (batch 1, T = 0.7)",
            "SmolLM2 draft heads: speed at batch 1",
        )
    return ["accept_len.png"] + (["speedup_vs_gamma.png"] if names else [])


def with_kept_arms(kept: dict, arms_dir: Path, extra) -> dict:
    """`kept` (the arms of this launch) with every other arm kept in `arms_dir` for the same
    recipe (`extra` config overrides), in `ARMS` order: the study's figures cover every finished
    arm, whichever subset a launch ran."""
    spec = mtp_arms.MODELS["smollm2"]
    out = {}
    for name, overrides in ARMS.items():
        k = kept.get(name)
        if k is None:
            want = mtp_arms.wanted_config(spec, overrides, extra)
            k = mtp_arms.kept_arm(arms_dir, "smollm2", name, want)
        if k is not None:
            out[name] = k
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="runs/mtp_smollm2", help="a run of the recipe")
    ap.add_argument("--out", default="runs/exp_draft_features", help="the arms' runs")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated; last_d1 first")
    ap.add_argument("--eval_prompts", type=int, default=768)
    ap.add_argument("--eval_batch", type=int, default=64)
    ap.add_argument("--processes", type=int, default=3, help="benchmark processes per arm")
    ap.add_argument("--repeats", type=int, default=3, help="paired rounds per process")
    ap.add_argument("--new_tokens", type=int, default=96)
    ap.add_argument("--no_speed", action="store_true", help="acceptance only (no timing)")
    ap.add_argument(
        "--set", action="append", default=[], help="config KEY=VALUE (every arm's training)"
    )
    args = ap.parse_args(argv)
    names = args.arms.split(",")
    if names[0] != "last_d1" or any(n not in ARMS for n in names):
        raise SystemExit(f"--arms: want 'last_d1' first, then any of {list(ARMS)}; got {names}")
    spec = mtp_arms.MODELS["smollm2"]
    root, base = Path(args.out).absolute(), Path(args.base).absolute()
    t0 = time.perf_counter()
    kept = {}
    timing = {"repeats": args.repeats, "new_tokens": args.new_tokens, "processes": args.processes}
    for name in names:
        want = mtp_arms.wanted_config(spec, ARMS[name], args.set)
        k = mtp_arms.kept_arm(ARMS_DIR, "smollm2", name, want)
        if k is None:  # train (or resume) and evaluate the arm
            wd = mtp_arms.train_arm(spec, root, base, name, ARMS[name], args.set)
            held = {
                f"t{t}": mtp_arms.cached_heldout(
                    wd, root / name / f"heldout_t{t}.json", args.eval_prompts, args.eval_batch, t
                )
                for t in TEMPERATURES
            }
            k = mtp_arms.keep_arm(ARMS_DIR, "smollm2", name, want, wd, held)
        timed = k.get("speed", {}).get("settings") == timing
        if not args.no_speed and not timed:
            ckpt = Path(k["heldout"]["t0.7"]["run"]) / "mtp" / "ckpt"
            if ckpt.exists():
                k["speed"] = speed(
                    ckpt.parent.parent, args.processes, args.repeats, args.new_tokens
                )
                write_json_atomic(ARMS_DIR / f"smollm2_{name}.json", k, indent=None)
            else:  # kept figures whose weights are gone: not trained again only to be timed
                print(f"{name}: no weights at {ckpt} to time (delete its kept file to retrain)")
        kept[name] = k
        print(f"{name}: {arm_figures(k)}", flush=True)
    kept = with_kept_arms(kept, ARMS_DIR, args.set)
    rows = {n: arm_figures(k) for n, k in kept.items()}
    ref = kept["last_d1"]["heldout"]["t0.7"]["per_prompt"]
    deltas = {
        n: mtp_arms.paired_delta(k["heldout"]["t0.7"]["per_prompt"], ref) for n, k in kept.items()
    }
    print(table(rows, deltas), flush=True)
    out = {
        "study": "draft_features",
        "model": "smollm2",
        "eval_prompts": args.eval_prompts,
        "targets": TARGETS,
        "arms": {n: {**r, "delta_rs_accept_t0.7_vs_last_d1": deltas[n]} for n, r in rows.items()},
        "figures": figures(kept),
        "wall_s": time.perf_counter() - t0,
    }
    write_json_atomic(HERE / "results.json", out, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
