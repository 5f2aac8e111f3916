"""Bebop finding 4: does a frozen MTP keep its acceptance through RL, and what do online updates
do to it?

One demo RL run (the demo's GRPO stage from one SFT policy and one pre-RL e2e-TV MTP, same seed
and prompts) with four MTP strategies: frozen with rejection sampling (RS, Bebop's recipe),
online CE updates with RS, online e2e-TV updates with RS, online CE with target-only verification
(TO). Per RL step: accept length, per-position acceptance, the policy's entropy on the emitted
tokens. The change of acceptance from the first to the last 10 steps is split into the part the
entropy change explains -- study 1's per-token fit of acceptance on entropy
(`experiments/entropy_acceptance/results_demo.json`: the RS-TV slope for RS arms, TO-CE for TO)
times the entropy change -- and the rest (Bebop §5.1).

    python -m experiments.mtp_in_rl.run --base runs/demo
    python -m experiments.mtp_in_rl.run --model smollm2 --base runs/mtp_smollm2 [--arms online_ce]

`--base` is a finished demo run (its `sft` and `mtp` stages; trained there if absent). Arms land
in `runs/exp_mtp_in_rl/<arm>/` and are reused when finished. `--model smollm2`: the RL task of
`configs/rl_smollm2.py` from one run of the recipe's MTP (`common.MODELS`), arms in
`runs/exp_mtp_in_rl_smollm2/`, results in `results_smollm2.json`, figures `*_smollm2.png`. An
arm a timed study kept from the same launch (`frozen_rs`, by `experiments.growmtp`) is taken
from its kept JSON (no run directory here). `--arms`: run only these (the others enter the
results where finished or kept); `--rerun`: run these again although finished or kept
(`frozen_rs` then in this study's own directory, not taken from the timed study's). An arm
interrupted mid-run (killed, or the machine gone) resumes from its newest checkpoint (every 10
RL steps) when the same command runs again (not one started with `--rerun`: that starts over).
Figures and `results.json` land next to this file (`--runlocal` / `--set`: under
`<out>/results/`). Last line: one JSON object.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bebop import plots
from experiments import arms, common

HERE = Path(__file__).resolve().parent
ARMS = ("frozen_rs", "online_ce", "online_tv", "to_online_ce")
RESUME_EVERY = 10  # RL steps between an arm's checkpoints (`arms.run_arm`'s resume_every)
# study 1's fits per model (SmolLM2: with the recipe's MTP, the one its RL arms draft with)
STUDY1 = {
    "demo": HERE.parent / "entropy_acceptance" / "results_demo.json",
    "smollm2": HERE.parent / "entropy_acceptance" / "results_smollm2_recipe.json",
}


def entropy_slope(arm: arms.Arm, study1: dict) -> tuple[str, float]:
    """(study 1 fit used, acceptance per nat) for the arm's verification rule."""
    fit = "TO-CE" if arm.rule == "target_only" else "RS-TV"
    return fit, float(study1["drafts"][fit]["slope"])


def decompose(res: arms.ArmResult, study1: dict, n: int = 10) -> dict:
    """Acceptance and entropy over the first and last `n` steps; the acceptance change split into
    slope x entropy change (explained by the policy's entropy) and the rest."""
    fit, slope = entropy_slope(res.arm, study1)
    a0, a1 = (common.window_mean(res, "accept_rate", f, n) for f in (True, False))
    h0, h1 = (common.window_mean(res, "rollout_entropy", f, n) for f in (True, False))
    explained = slope * (h1 - h0)
    row = {
        "label": res.arm.label,
        "accept_rate_first": a0,
        "accept_rate_last": a1,
        "accept_len_first": common.window_mean(res, "accept_len", True, n),
        "accept_len_last": common.window_mean(res, "accept_len", False, n),
        "entropy_first": h0,
        "entropy_last": h1,
        "delta_accept_rate": a1 - a0,
        "explained_by_entropy": explained,
        "rest": (a1 - a0) - explained,
        "study1_fit": fit,
        "study1_slope": slope,
        "reward_first": common.window_mean(res, "reward_mean", True, n),
        "reward_last": common.window_mean(res, "reward_mean", False, n),
        "accuracy_before": res.summary["accuracy_before"],
        "accuracy_after": res.summary["accuracy_after"],
    }
    for k in range(1, 4):
        if not res.series(f"accept_rate_{k}")[1].size:
            continue
        row[f"accept_rate_{k}_first"] = common.window_mean(res, f"accept_rate_{k}", True, n)
        row[f"accept_rate_{k}_last"] = common.window_mean(res, f"accept_rate_{k}", False, n)
    return row


def figures(
    results: dict[str, arms.ArmResult], window: int, model: str = "demo", where: Path = HERE
) -> None:
    setting = f"{common.MODELS[model].setting}; running mean of {window} steps"
    suffix = "" if model == "demo" else f"_{model}"
    plots.lines(
        where / f"accept_len{suffix}.png",
        {r.arm.label: common.smoothed(r, "accept_len", window) for r in results.values()},
        "RL step",
        "accept length (tokens per verify)",
        f"accept length during RL\n({setting})",
        size=(7, 4.5),
    )
    plots.lines(
        where / f"per_position{suffix}.png",
        {
            f"{r.arm.name} pos {k}": common.smoothed(r, f"accept_rate_{k}", window)
            for r in results.values()
            for k in range(1, 4)
            if r.series(f"accept_rate_{k}")[1].size
        },
        "RL step",
        "acceptance at draft position k",
        f"per-position acceptance during RL\n({setting})",
        size=(7, 4.5),
    )
    plots.lines(
        where / f"entropy{suffix}.png",
        {r.arm.label: common.smoothed(r, "rollout_entropy", window) for r in results.values()},
        "RL step",
        "policy entropy of emitted tokens (nats)",
        f"policy entropy during RL\n({setting})",
        size=(7, 4.5),
    )


def table(rows: dict) -> str:
    lines = [
        "| arm | accept len first → last 10 steps | acceptance first → last | Δ acceptance | "
        "explained by entropy | rest | entropy first → last (nats) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows.values():
        lines.append(
            f"| {r['label']} | {r['accept_len_first']:.2f} → {r['accept_len_last']:.2f} | "
            f"{r['accept_rate_first']:.3f} → {r['accept_rate_last']:.3f} | "
            f"{r['delta_accept_rate']:+.3f} | {r['explained_by_entropy']:+.3f} | "
            f"{r['rest']:+.3f} | {r['entropy_first']:.3f} → {r['entropy_last']:.3f} |"
        )
    return "\n".join(lines)


def main():
    ap = common.study2_parser(common.STUDY2_ROOT)
    common.add_arms_flag(ap)
    args = ap.parse_args()
    names = common.chosen_arms(ap, args, ARMS)
    t0 = time.perf_counter()
    base, root = common.study2_base(args, "study2_root", names)
    # an arm the timed studies ran (e.g. frozen_rs in growmtp) is the same run: taken from them
    timed = common.kept_dir(common.MODELS[args.model].timed_root)
    # no wall time is compared here: an interrupted arm resumes from its last 10-step checkpoint
    results = common.study2_chosen(
        names, ARMS, base, root, args, borrow=(timed,), resume_every=RESUME_EVERY
    )
    study1 = json.loads(STUDY1[args.model].read_text())
    rows = {n: decompose(r, study1, args.window) for n, r in results.items()}
    out = common.outputs(args, HERE, root)
    figures(results, args.window, args.model, out)
    print(table(rows), flush=True)
    common.report(
        out,
        "mtp_in_rl",
        base,
        results,
        t0,
        args.model,
        window_steps=args.window,
        arms=rows,
    )


if __name__ == "__main__":
    main()
