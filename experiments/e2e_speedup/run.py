"""Finding 6: the end-to-end speedup of one RL run with and without speculation.

The demo RL run (the demo's GRPO stage from one SFT policy and one pre-RL e2e-TV MTP, same seed
and prompts, 120 steps of 16 prompts x 8 samples, T = 0.7, γ = 2) six ways, one after the other
in one run: plain rollouts and frozen-MTP speculative rollouts (rejection sampling), each
synchronous (every batch from the current policy) and asynchronous (staleness 1: the next batch
is sampled while the learner updates), and both asynchronous with tail-aware rollouts
(`rollout.compact`; the speculative arm with the draft table derived from measured costs and
the running acceptance). Printed and in `results.json`: rollout time, step time
and RL time without the first step (which compiles) and their ratios; figure: reward vs step and
vs wall-clock (`reward.png`).

Then the cost model: per verify cycle the policy's (γ+1)-token forward and γ MTP draft steps,
timed on this machine at the RL batch (`spec_compacted.loop_costs`), give the rollout speedup
expected_tokens(α, γ) · t_step / (t_verify + γ · t_draft) for the acceptance α the run measured
-- and, labelled as a projection, the same with an H100's roofline costs: a forward over N
tokens costs max(1, N / 295) reads of the weights (bandwidth-bound below the ridge point), so the
(γ+1)-token verify of 128 rows costs 384 / 295 = 1.3 steps and a draft step the MTP's share of the
bytes a decode step reads. The projected end-to-end figure puts that rollout speedup into the
synchronous plain run's measured split of step time (Amdahl).

    python -m experiments.e2e_speedup.run --base runs/demo [--predict]
    python -m experiments.e2e_speedup.run --model smollm2 --base runs/mtp_smollm2 [--sync] \
        [--predict] [--arms plain_compact,frozen_rs_compact]

`--model smollm2`: the RL task of `configs/rl_smollm2.py` (40 GRPO steps of 4 prompts x 8,
T = 0.7, γ = 3, greedy accuracy every 10 steps) from one run of the recipe's MTP
(`configs/mtp_smollm2.py`, trained in `--base` first if absent; plain arms alone need only its
config), three asynchronous arms --
plain static, plain tail-aware, speculative tail-aware with the derived draft table (frozen MTP,
RS) -- and with `--sync` their synchronous twins. Per arm (`results_smollm2.json`, written as
each arm finishes; a later launch reuses finished arms, so the study can run in parts;
`--rerun a,b` runs those again): RL time without step 1 and its split (rollout, learner,
reward, wait, evaluation), the rollout share of the plain step, accept length and
per-position acceptance per step, the greedy accuracy curve; ratios between arms;
`reward_accuracy_smollm2.png`: reward and accuracy vs step and vs wall-clock, all arms.
`--predict`: then `experiments.e2e_speedup.predict` (the cost model's prediction of every arm,
beside its measurement). `--runlocal` / `--set KEY=VALUE`: smoke settings.

Arms land in `OUT/<arm>/` (`--out OUT`; default `runs/exp_rl_speed`, shared with
`experiments.growmtp`; run both on an otherwise idle machine, one after the other: their wall
times are compared); figures and `results.json` next to this file (`--runlocal` / `--set`:
under `<out>/results/`; a smoke run's default base and arm directories end in `_runlocal`).
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bebop import (
    compaction,
    model,
    plots,
    sampling,
    sharding,
    spec_compacted,
)
from bebop import config as config_lib
from benchmarks.common import load_models
from experiments import arms, common

HERE = Path(__file__).resolve().parent
ARMS = ("plain_sync", "frozen_rs_sync", "plain", "frozen_rs", "plain_compact", "frozen_rs_compact")
# SmolLM2: asynchronous plain static, plain tail-aware and speculative tail-aware (derived draft
# table); `--sync` adds their synchronous twins.
SMOLLM2_ARMS = ("plain", "plain_compact", "frozen_rs_compact")
SMOLLM2_SYNC = ("plain_sync", "plain_compact_sync", "frozen_rs_compact_sync")
# Bebop and GrowMTP's end-to-end figures (docs/method.md §6-7).
PAPER = {"bebop_e2e": "up to 1.8x", "growmtp_e2e": "1.60x (rollout 2.13x)"}


def _after_1(res: arms.ArmResult, key: str) -> float:
    """Sum of `key` over steps 2.. (0 where never recorded)."""
    return float(res.series(key)[1][1:].sum())


def timing(res: arms.ArmResult) -> dict:
    _, dt = common.step_times(res)
    return {
        "rl_s_after_step_1": float(dt.sum()),
        "step_s_median": float(np.median(dt)),
        "rollout_s": _after_1(res, "rollout_s"),
        "train_s": _after_1(res, "train_s"),
        "mtp_train_s": _after_1(res, "mtp_train_s"),
        "reward_s": _after_1(res, "reward_s"),
        "wait_s": _after_1(res, "wait_s"),
        "eval_s": _after_1(res, "eval_s"),
        "rl_wall_s": res.summary["rl_wall_s"],
        "response_tokens": _after_1(res, "response_tokens"),
        "accept_len": res.summary.get("accept_len"),
        "reward_last10": common.window_mean(res, "reward_mean", False),
        "accuracy_after": res.summary["accuracy_after"],
        # tail-aware speculative arms: the derived draft table, as it last changed
        "draft_table": next(
            (r["draft_table"] for r in reversed(res.records) if "draft_table" in r), None
        ),
    }


def curves(res: arms.ArmResult) -> dict:
    """Per-step series of one arm: accept length and per-position acceptance (speculative
    arms), the greedy accuracy curve (step, accuracy), and the rollout share of each step."""
    out = {}
    for key in ("accept_len", "accept_rate_1", "accept_rate_2", "accept_rate_3"):
        step, y = res.series(key)
        if y.size:
            out[key] = {"step": step.astype(int).tolist(), "value": y.tolist()}
    out["accuracy_curve"] = [list(e) for e in res.summary.get("eval_curve", [])]
    return out


def ratios(t: dict) -> dict:
    """Speedups: the first arm's time / the second's (> 1: the second is faster), for the pairs
    whose arms both ran, side by side (`common.SIDE_BY_SIDE_S`; each arm's `started`); where
    the arms record their sampled tokens, the second's over the first's beside them."""
    pairs = {
        "sync": ("plain_sync", "frozen_rs_sync"),
        "async": ("plain", "frozen_rs"),
        "async_spec_vs_sync_plain": ("plain_sync", "frozen_rs"),
        "async_plain_vs_sync_plain": ("plain_sync", "plain"),
        "async_compact": ("plain_compact", "frozen_rs_compact"),
        "compact_vs_static_plain": ("plain", "plain_compact"),
        "compact_spec_vs_static_plain": ("plain", "frozen_rs_compact"),
        "sync_compact": ("plain_compact_sync", "frozen_rs_compact_sync"),
        "sync_compact_spec_vs_sync_plain": ("plain_sync", "frozen_rs_compact_sync"),
        "async_compact_spec_vs_sync_plain": ("plain_sync", "frozen_rs_compact"),
    }
    out = {}
    for name, (a, b) in pairs.items():
        if a not in t or b not in t:
            continue
        apart = abs(t[a]["started"] - t[b]["started"])
        if apart > common.SIDE_BY_SIDE_S:  # not side by side: no ratio of times
            out[name] = {"not_compared": f"{a} and {b} started {apart / 3600:.0f} h apart"}
            continue
        out[name] = {
            k: t[a][k] / t[b][k] for k in ("rl_s_after_step_1", "step_s_median", "rollout_s")
        }
        # runs that sample differently drift to different response lengths: said beside the
        # ratios of times (the learner's update has a fixed shape, its rollouts do not)
        if t[a].get("response_tokens") and t[b].get("response_tokens"):
            out[name]["tokens_second_over_first"] = (
                t[b]["response_tokens"] / t[a]["response_tokens"]
            )
    return out


def _fmt(key: str, value) -> str:
    return f"{key} {value:.2f}x" if isinstance(value, float) else f"{key}: {value}"


# The GPU of the projection: H100 SXM, dense bf16 989 TFLOP/s and 3.35 TB/s of HBM (NVIDIA's
# data sheet): a forward over N tokens per read of bf16 weights does ~2N FLOP per 2 bytes, so it
# is bandwidth-bound up to N ≈ RIDGE tokens and costs ∝ max(1, N / RIDGE) weight reads.
GPU = {"name": "H100 SXM", "bf16_flops": 989e12, "hbm_bytes_s": 3.35e12}
RIDGE = GPU["bf16_flops"] / GPU["hbm_bytes_s"]


def weight_reads(tokens: int) -> float:
    """Cost of one forward over `tokens` tokens, in units of one bandwidth-bound weight read."""
    return max(1.0, tokens / RIDGE)


def cost_model(base: Path, frozen: arms.ArmResult, plain_sync: dict, gamma: int) -> dict:
    """Measured loop costs at the RL batch, the CPU model's rollout speedup, and the GPU
    projection (see the module docstring). Tokens per verify: the run's measured accept length
    (the geometric formula over the per-position acceptance is a cross-check: it ignores cycles
    cut at EOS or the budget)."""
    cfg = config_lib.from_dict(config_lib.RunConfig, json.loads((base / "config.json").read_text()))
    mesh = sharding.make_mesh(config_lib.MeshConfig(data=1), jax.devices()[:1])
    demo = argparse.Namespace(model="demo", run=str(base), num_prompts=8, prompts="task")
    pol, mtp, vocab, tok, ids, _ = load_models(demo, mesh)
    vocab = None if vocab is None else jnp.asarray(vocab)
    width = int(sampling.pad_prompts(ids, tok.pad_id)[0].shape[1])
    batch = cfg.rl.prompts_per_step * cfg.rl.group_size
    costs = spec_compacted.loop_costs(
        pol,
        model.decode_layers_jit(*pol),
        mtp,
        vocab,
        batch,
        width + cfg.rollout.max_new_tokens // 2,
        [gamma],
    )
    _, alen = frozen.series("accept_len")
    tokens = float(alen.mean())
    alpha = [float(frozen.series(f"accept_rate_{k}")[1].mean()) for k in range(1, gamma + 1)]
    c_verify = costs[f"verify_{gamma + 1}"] / costs["verify_1"]
    c_draft = costs["draft"] / costs["verify_1"]
    # Bytes a decode step reads: every policy weight except the input embedding table (a lookup
    # of B rows) unless it is tied to the head; a draft step: one MTP layer plus the head over
    # the draft vocabulary.
    m, d = cfg.model, cfg.model.dim
    n_pol = sum(x.size for x in jax.tree.leaves(pol[1]))
    step_bytes = n_pol - (0 if m.tie_embeddings else m.vocab_size * d)
    n_mtp = sum(x.size for x in jax.tree.leaves(mtp[1]))
    head = (m.vocab_size if vocab is None else int(vocab.size)) * d
    draft_bytes = n_mtp / cfg.mtp.num_layers + head
    gpu_verify = weight_reads(batch * (gamma + 1)) / weight_reads(batch)
    gpu_draft = draft_bytes / step_bytes * weight_reads(batch)
    cpu_rollout = tokens / (c_verify + gamma * c_draft)
    gpu_rollout = tokens / (gpu_verify + gamma * gpu_draft)
    share = plain_sync["rollout_s"] / plain_sync["rl_s_after_step_1"]
    return {
        "batch": batch,
        "gamma": gamma,
        "accept_len": tokens,
        "alpha_per_position": alpha,
        "expected_tokens_from_alpha": compaction.expected_tokens(alpha, gamma),
        "cpu_costs_s": costs,
        "cpu_verify_over_step": c_verify,
        "cpu_draft_over_step": c_draft,
        "cpu_model_rollout_speedup": cpu_rollout,
        "projection": {
            "label": "projection, not a measurement",
            "gpu": GPU,
            "ridge_tokens": RIDGE,
            "assumptions": (
                f"every forward reads the weights once in bf16 and costs max(1, tokens / "
                f"{RIDGE:.0f}) weight reads ({GPU['name']} peak bf16 FLOP/s over HBM bytes/s); "
                "a draft step reads one MTP layer and the head; KV-cache traffic, kernel-launch "
                "overhead (which would dominate a model this small) and sampling are ignored; the "
                "rollout share of step time is this CPU run's (plain, synchronous)"
            ),
            "step_weight_bytes_params": step_bytes,
            "draft_weight_bytes_params": draft_bytes,
            "verify_over_step": gpu_verify,
            "draft_over_step": gpu_draft,
            "rollout_speedup": gpu_rollout,
            "rollout_share_of_step": share,
            "e2e_speedup_sync": 1.0 / ((1 - share) + share / gpu_rollout),
        },
    }


def accuracy_figure(path: Path, results: dict[str, arms.ArmResult], window: int, setting: str):
    """Sampled reward (running mean) and greedy accuracy, vs step and vs RL wall-clock, every
    arm on one figure (2 x 2 panels)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharey="row")
    for r in results.values():
        step, reward = r.series("reward_mean")
        tstep, t = r.series("time")
        minutes = (t - t[0]) / 60.0
        smooth = common.running_mean(reward, window)
        axes[0, 0].plot(step, smooth, label=r.arm.label)
        axes[0, 1].plot(minutes, smooth, label=r.arm.label)
        acc = np.asarray(r.summary.get("eval_curve", []), np.float64).reshape(-1, 2)
        # wall-clock of an evaluation: the record of its step (step 0: the first record's time)
        at = np.interp(acc[:, 0], tstep, minutes) if acc.size else acc[:, 0]
        axes[1, 0].plot(acc[:, 0], acc[:, 1], "o-", label=r.arm.label)
        axes[1, 1].plot(at, acc[:, 1], "o-", label=r.arm.label)
    axes[0, 0].set_ylabel(f"sampled reward (running mean of {window} steps)")
    axes[1, 0].set_ylabel("greedy accuracy (held-out)")
    for ax in axes[1]:
        ax.set_xlabel(ax is axes[1, 0] and "RL step" or "RL wall-clock (minutes)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"{setting}: reward and accuracy vs step and vs wall-clock", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def figures(results: dict[str, arms.ArmResult], window: int, where: Path = HERE) -> None:
    curves = {}
    for r in results.values():
        step, reward = r.series("reward_mean")
        _, t = r.series("time")
        curves[r.arm.label] = (step, (t - t[0]) / 60.0, common.running_mean(reward, window))
    plots.twin_x(
        where / "reward.png",
        curves,
        ("RL step", "RL wall-clock (minutes since the first step)"),
        f"sampled reward (running mean of {window} steps)",
        "demo GRPO, 128 rows/step, T = 0.7, γ = 2: reward vs step and vs wall-clock",
    )


def run_arms(names, base: Path, root: Path, args) -> dict[str, arms.ArmResult]:
    """The arms one after the other; after each, its figures are written to the model's
    results file (`arms`: a later launch reuses every finished or kept arm, so the study can be
    run in parts)."""
    m = common.MODELS[args.model]
    path = common.outputs(args, HERE, root) / m.results
    results = {}
    for n in names:
        results.update(common.study2_arms([n], base, root, args))
        res = results[n]
        partial = json.loads(path.read_text()) if path.exists() else {}
        if partial.get("model") != args.model:
            partial = {"study": "e2e_speedup", "model": args.model, "base": str(base)}
        t = {**timing(res), "started": res.records[0]["time"], "curves": curves(res)}
        partial.setdefault("arms", {})[n] = t
        common.write_json(path, partial)
    return results


def main():
    ap = common.study2_parser(common.TIMED_ROOT)
    ap.add_argument("--sync", action="store_true", help="smollm2: also the synchronous twins")
    ap.add_argument("--predict", action="store_true", help="then predict on the arms")
    common.add_arms_flag(ap)
    args = ap.parse_args()
    names = ARMS if args.model == "demo" else SMOLLM2_ARMS + (SMOLLM2_SYNC if args.sync else ())
    if args.arms or args.rerun:
        if args.model == "demo":
            ap.error("--arms, --rerun: the demo runs all its arms (they are for --model smollm2)")
        known = SMOLLM2_ARMS + SMOLLM2_SYNC if args.arms else names
        if not args.arms and set(args.rerun.split(",")) & set(SMOLLM2_SYNC) - set(names):
            ap.error("--rerun: the synchronous arms run with --sync (or name them in --arms)")
        names = common.chosen_arms(ap, args, known)
    t0 = time.perf_counter()
    # plain arms alone need no trained base (--predict then times random weights of the MTP's
    # shape: timing.load)
    base, root = common.study2_base(args, "timed_root", names)
    results = run_arms(names, base, root, args)
    if args.model != "demo":  # the study's other arms that are finished or kept (no launch)
        every = SMOLLM2_ARMS + SMOLLM2_SYNC
        done = common.study2_arms([n for n in every if n not in results], base, root, args, False)
        results = {n: results.get(n) or done[n] for n in every if n in results or n in done}
        common.one_pre_rl_mtp(results)
    times = {n: timing(r) for n, r in results.items()}
    for n, r in results.items():  # when each arm ran, one after the other
        times[n]["started"] = r.records[0]["time"]
        times[n]["curves"] = curves(r)
    # the plain step the rollout share is of: synchronous if it ran, else static, else tail-aware
    ref = next((n for n in ("plain_sync", "plain", "plain_compact") if n in times), None)
    for t in times.values():
        share = ref and times[ref]["rollout_s"] / times[ref]["rl_s_after_step_1"]
        t["rollout_share_of_plain_step"], t["rollout_share_of"] = share, ref
    rat = ratios(times)
    m, out = common.MODELS[args.model], common.outputs(args, HERE, root)
    if args.model != "demo":
        accuracy_figure(out / "reward_accuracy_smollm2.png", results, args.window, m.setting)
        for n, t in times.items():
            print(
                f"{n:24s} RL {t['rl_s_after_step_1']:.0f} s  step {t['step_s_median']:.2f} s  "
                f"rollouts {t['rollout_s']:.0f} s  learner {t['train_s']:.0f} s  reward "
                f"{t['reward_s']:.0f} s  wait {t['wait_s']:.0f} s  accuracy "
                f"{t['accuracy_after']:.3f}",
                flush=True,
            )
        for n, r in rat.items():
            print(f"speedup {n:34s} " + "  ".join(_fmt(k, v) for k, v in r.items()))
        common.report(out, "e2e_speedup", base, results, t0, args.model, arms=times, ratios=rat)
        if args.predict:
            predict_tail(args, base, root, list(results))
        return
    figures(results, args.window, out)
    gamma = config_lib.from_dict(
        config_lib.RunConfig, json.loads((base / "config.json").read_text())
    ).rollout.num_draft
    model_ = cost_model(base, results["frozen_rs"], times["plain_sync"], gamma)
    for n, t in times.items():
        print(
            f"{n:15s} RL {t['rl_s_after_step_1']:.0f} s  step {t['step_s_median']:.2f} s  "
            f"rollouts {t['rollout_s']:.0f} s  learner {t['train_s']:.0f} s",
            flush=True,
        )
    for n, r in rat.items():
        print(f"speedup {n:28s} " + "  ".join(_fmt(k, v) for k, v in r.items()), flush=True)
    proj = model_["projection"]
    print(
        f"cost model at {model_['batch']} rows, accept length {model_['accept_len']:.2f}: this "
        f"CPU verify {model_['cpu_verify_over_step']:.2f}x, draft "
        f"{model_['cpu_draft_over_step']:.2f}x a decode step -> rollouts "
        f"{model_['cpu_model_rollout_speedup']:.2f}x; projection for {GPU['name']} (verify "
        f"{proj['verify_over_step']:.2f}x, draft {proj['draft_over_step']:.2f}x): rollouts "
        f"{proj['rollout_speedup']:.2f}x, end to end {proj['e2e_speedup_sync']:.2f}x",
        flush=True,
    )
    common.report(
        out,
        "e2e_speedup",
        base,
        results,
        t0,
        load_average_1min_at_end=os.getloadavg()[0],
        arms=times,
        ratios=rat,
        cost_model=model_,
        paper=PAPER,
    )
    if args.predict:
        predict_tail(args, base, root, list(results))


def predict_tail(args, base: Path, root: Path, arms: list[str]) -> None:
    """`experiments.e2e_speedup.predict` on `arms` (it updates the results file and prints its
    JSON)."""
    from experiments.e2e_speedup import predict

    m = common.MODELS[args.model]
    flags = ["--model", args.model, "--base", str(base), "--out", str(root)]
    flags += [
        "--arms",
        ",".join(arms),
        "--results",
        str(common.outputs(args, HERE, root) / m.results),
    ]
    predict.main(flags + (["--runlocal"] if args.runlocal else []))


if __name__ == "__main__":
    main()
