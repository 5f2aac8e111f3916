"""GrowMTP finding 5: a draft head grown from random init inside RL, from what verification
already computes (DCA loss on the recorded target distributions, detached from the policy).

The demo RL run (the demo's GRPO stage from one SFT policy, same seed and prompts) four ways:
plain rollouts (no speculation), GrowMTP from random init, Bebop's pre-trained e2e-TV MTP frozen,
and the pre-trained MTP with GrowMTP updates. Per RL step: accept length, and the rollout's wall
time and the whole step's (rollout, learner update, and GrowMTP's head update) next to the plain
run's at the same step, as running means without step 1 (which compiles); the step from which
each stays at most as slow as plain ("starts paying", or never); the final rollout speedup (the
RL stage's timed plain-vs-speculative rollouts of its final weights).

    python -m experiments.growmtp.run --base runs/demo
    python -m experiments.growmtp.run --model smollm2 --base runs/mtp_smollm2 \
        [--arms plain,grow_scratch] [--costs experiments/e2e_speedup/results_smollm2.json]

`--model smollm2`: the RL task of `configs/rl_smollm2.py` from one run of the recipe's MTP
(`common.MODELS`; its static arms with `rollout.compact=False`), arms in
`runs/exp_rl_speed_smollm2/`, results in `results_smollm2.json`, figures `*_smollm2.png`; a fifth
arm, `grow_last_layer`, grows a head from a copy of the policy's last block (the SmolLM2
configs' `mtp.init`), with no MTP training before RL.
`--arms`: run only these (the others enter the results where finished or kept); the arms that
never draft with the base's MTP (plain, grow_scratch, grow_last_layer) need no trained SmolLM2
base. `--rerun`: run these again although finished or kept (times are compared only between
arms that started within 12 h of each other, e.g. a kept plain arm of another day and a new
GrowMTP arm); the arms and their kept JSON are shared with `experiments.e2e_speedup`, whose
results file keeps the earlier timing until it runs again.

Arms land in `runs/exp_rl_speed/<arm>/` (shared with `experiments/e2e_speedup`: run both on an
otherwise idle machine, their wall times are compared); figures and `results.json` next to this
file (`--runlocal` / `--set`: under `<out>/results/`). Last line: one JSON object.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from bebop import costs, plots
from experiments import arms, common

HERE = Path(__file__).resolve().parent
ARMS = ("plain", "grow_scratch", "frozen_rs", "grow_pretrained")
# per model (`--model`): SmolLM2 also grows a head from its config's MTP init, the policy's last
# block (`mtp.init='last_layer'`)
ARMS_OF = {"demo": ARMS, "smollm2": (*ARMS, "grow_last_layer")}
SPEC = tuple(n for n in ARMS_OF["smollm2"] if n != "plain")


def pays_from(step, ratio) -> int | None:
    """The first step from which `ratio` (speculative / plain rollout time) stays <= 1."""
    above = np.nonzero(np.asarray(ratio) > 1.0)[0]
    if above.size == 0:
        return int(step[0])
    last = above[-1]
    return int(step[last + 1]) if last + 1 < len(step) else None


def ratio_vs_plain(step, t, pstep, pt, window: int) -> dict:
    """Speculative / plain seconds per step (series that start at step 2: step 1 compiles a
    different program in each arm): first and last `window` steps, all steps, and the step from
    which the running-mean ratio stays <= 1."""
    if not np.array_equal(step, pstep):
        raise ValueError("the arm and the plain run record different steps")
    ratio = common.running_mean(t, window) / common.running_mean(pt, window)
    return {
        "first": float(t[:window].sum() / pt[:window].sum()),
        "last": float(t[-window:].sum() / pt[-window:].sum()),
        "all": float(t.sum() / pt.sum()),
        "pays_from_step": pays_from(step, ratio),
    }


def after_step_1(res: arms.ArmResult, key: str):
    """(step, value) of `key` from step 2 on (step 1 also compiles)."""
    step, y = res.series(key)
    return step[1:], y[1:]


def pays_by_cost_model(res: arms.ArmResult, measured: dict, window: int) -> dict:
    """The step from which the arm's running-mean accept length stays at or above the cost
    model's break-even (`costs.break_even_accept_len` at the full batch and `rollout.num_draft`)
    from `measured`, the per-bucket costs `experiments.e2e_speedup.predict` measured, with the
    cycle of the arm's own loop (`predict.arm_bucket_costs`; `predicted` times it where
    missing), with the loop those costs are of and the arm's draft vocabulary (0: the full one)."""
    from bebop import config as config_lib
    from experiments.e2e_speedup import predict

    cfg = config_lib.from_dict(config_lib.RunConfig, res.config)
    bucket = predict.arm_bucket_costs(measured, cfg)
    batch = max(bucket)
    gamma = cfg.rollout.num_draft
    if cfg.rollout.mode == "plain" or not gamma:  # the longest cycle timed
        gamma = max(int(k.split("_")[1]) for k in bucket[batch] if k.startswith("cycle_"))
    need = costs.break_even_accept_len(bucket, batch, gamma)
    step, alen = res.series("accept_len")
    # "slower than plain" where the running accept length is below the break-even
    first = pays_from(step, need / common.running_mean(alen, window))
    return {
        "break_even_accept_len": need,
        "batch": batch,
        "gamma": gamma,
        "pays_from_step": first,
        "costs_timed_for": predict.loop_variant(cfg) or measured.get("mtp"),
        "arm_draft_vocab": (res.config.get("mtp") or {}).get("draft_vocab"),
    }


def predicted(
    results: dict[str, arms.ArmResult],
    costs_file: Path,
    base: Path,
    model: str,
    sims: int = 64,
    config: str | None = None,
    keep: bool = True,
) -> dict:
    """The cost model's prediction of each arm's RL time and rollout time over steps 2..N
    (`experiments.e2e_speedup.predict.predict_arm`) from the measured inputs in `costs_file`,
    with the command and date that measured them. The GrowMTP arms' loops (which also record
    what the head trains on) that `costs_file` lacks are timed here beside the measured loop on
    `base`'s policy with `config` (default: the model's arm config; `predict.with_variants`, a
    few minutes) and, with `keep`, added to `costs_file`'s measured inputs."""
    from bebop import io
    from experiments.e2e_speedup import predict

    inputs = predict.measured_inputs(costs_file)
    config = config or common.MODELS[model].config
    cfgs = [r.config for r in results.values()]
    measured = predict.with_variants(inputs["measured_inputs"], cfgs, base, model, config, 3)
    if keep and measured is not inputs["measured_inputs"]:  # newly timed: kept for later runs
        saved = json.loads(costs_file.read_text())
        saved["prediction"]["measured_inputs"] = measured
        io.write_json_atomic(costs_file, saved, indent=1)
    arms_, missing = {}, {}
    for n, r in results.items():
        try:
            arms_[n] = predict.predict_arm(r.config, r.records, measured, sims)
        except KeyError as e:  # records from before the cost model's inputs were
            if "response_len_hist" not in str(e):
                raise
            missing[n] = str(e)
            print(f"{n:16s} not predicted: {e}", flush=True)
    predict.print_prediction(arms_)
    return {
        "inputs_from": str(costs_file),
        "measured_by": predict.measured_by(inputs),
        "measured_inputs": measured,
        "arms": arms_,
        **({"not_predicted": missing} if missing else {}),
        "max_abs_pred_error": max((abs(a["pred_error"]) for a in arms_.values()), default=None),
    }


def row(res: arms.ArmResult, plain: arms.ArmResult | None, window: int) -> dict:
    """A speculative arm's acceptance and reward, and its times over the plain arm's where the
    plain arm ran beside it (`None`: not run yet, times not compared). RL runs that sample
    differently drift to different response lengths: beside the ratios of times, the ratio of
    sampled tokens (steps 2..; the learner's update has a fixed shape, the rollouts do not)."""
    apart = None if plain is None else common.hours_apart(res, plain)
    tokens = None
    if plain is not None:  # records of before the token counts: None
        mine, theirs = (after_step_1(r, "response_tokens")[1].sum() for r in (res, plain))
        tokens = mine / theirs if mine > 0 and theirs > 0 else None
    if plain is None:
        roll = wall = {"not_compared": "the plain arm has not run"}
    elif apart is None:
        roll = ratio_vs_plain(
            *after_step_1(res, "rollout_s"), *after_step_1(plain, "rollout_s"), window
        )
        wall = ratio_vs_plain(*common.step_times(res), *common.step_times(plain), window)
    else:  # not side by side: times are not compared
        roll = wall = {"not_compared": f"started {apart:.0f} h after or before the plain arm"}
    speed = res.summary.get("rollout_speedup") or {}
    _, alen = res.series("accept_len")
    return {
        "label": res.arm.label,
        "accept_len_first": float(alen[0]),
        "accept_len_first10": common.window_mean(res, "accept_len", True, window),
        "accept_len_last10": common.window_mean(res, "accept_len", False, window),
        # speculative / plain seconds (< 1: speculation is faster), steps 2..
        "rollout_s_ratio": roll,
        "step_s_ratio": wall,
        "response_tokens_ratio": None if tokens is None else float(tokens),
        "final_rollout_speedup": speed.get("speedup"),
        "final_speedup_batch": speed.get("batch"),
        "reward_last10": common.window_mean(res, "reward_mean", False, window),
        "accuracy_after": res.summary["accuracy_after"],
    }


def figures(
    results: dict[str, arms.ArmResult], window: int, model: str = "demo", where: Path = HERE
) -> None:
    setting = f"{common.MODELS[model].setting}; running mean of {window} steps"
    suffix = "" if model == "demo" else f"_{model}"
    spec = [n for n in SPEC if n in results]
    if spec:
        plots.lines(
            where / f"accept_len{suffix}.png",
            {results[n].arm.label: common.smoothed(results[n], "accept_len", window) for n in spec},
            "RL step",
            "accept length (tokens per verify)",
            f"GrowMTP vs a pre-trained MTP\n({setting})",
            size=(7, 4.5),
        )

    def timing(x, y):
        return x, common.running_mean(y, window)

    plots.lines(
        where / f"rollout_time{suffix}.png",
        {results[n].arm.label: timing(*after_step_1(results[n], "rollout_s")) for n in results},
        "RL step",
        "rollout wall time per step (s)",
        f"rollout time vs plain decoding\n({setting})",
        size=(7, 4.5),
    )
    plots.lines(
        where / f"step_time{suffix}.png",
        {results[n].arm.label: timing(*common.step_times(results[n])) for n in results},
        "RL step",
        "wall time per RL step (s)",
        f"RL step time vs plain decoding\n({setting})",
        size=(7, 4.5),
    )


def main():
    ap = common.study2_parser(common.TIMED_ROOT)
    ap.add_argument(
        "--costs",
        default="",
        help="a results file with experiments.e2e_speedup.predict's measured costs: the step "
        "from which each head pays by the cost model",
    )
    common.add_arms_flag(ap)
    args = ap.parse_args()
    every = ARMS_OF[args.model]
    names = common.chosen_arms(ap, args, every)
    t0 = time.perf_counter()
    # arms that never draft with the base's MTP (plain, grow_scratch, grow_last_layer) need no
    # trained base on a model without an SFT stage
    base, root = common.study2_base(args, "timed_root", names)
    results = common.study2_chosen(names, every, base, root, args)
    rows = {n: row(results[n], results.get("plain"), args.window) for n in SPEC if n in results}
    prediction = {}
    if args.costs:  # the prediction first: it times the arms' loops the costs lack
        local = args.runlocal or bool(args.set)  # a smoke or --set run keeps no timing
        config = common.MODELS[args.model].config + (":runlocal" if args.runlocal else "")
        prediction = predicted(results, Path(args.costs), base, args.model, 64, config, not local)
        for n in rows:
            rows[n]["cost_model"] = pays_by_cost_model(
                results[n], prediction["measured_inputs"], args.window
            )
    out = common.outputs(args, HERE, root)
    figures(results, args.window, args.model, out)
    for n, r in rows.items():
        ro, st = r["rollout_s_ratio"], r["step_s_ratio"]
        if "not_compared" in ro:
            print(
                f"{n:16s} accept len {r['accept_len_first']:.2f} -> "
                f"{r['accept_len_last10']:.2f}  vs plain: {ro['not_compared']}",
                flush=True,
            )
            continue
        print(
            f"{n:16s} accept len {r['accept_len_first']:.2f} -> {r['accept_len_last10']:.2f}  "
            f"vs plain: rollout time {ro['first']:.2f} -> {ro['last']:.2f} (all {ro['all']:.2f}, "
            f"pays from step {ro['pays_from_step']}), step time {st['first']:.2f} -> "
            f"{st['last']:.2f} (all {st['all']:.2f}, pays from step {st['pays_from_step']}; "
            f"tokens sampled {r['response_tokens_ratio'] or float('nan'):.2f}x plain's)  "
            f"final rollout speedup {r['final_rollout_speedup']}",
            flush=True,
        )
    common.report(
        out,
        "growmtp",
        base,
        results,
        t0,
        args.model,
        window_steps=args.window,
        arms=rows,
        **({"prediction": prediction} if prediction else {}),
    )


if __name__ == "__main__":
    main()
