"""Finding 6: the end-to-end speedup of one RL run with and without speculation.

The demo RL run (the demo's GRPO stage from one SFT policy and one pre-RL e2e-TV MTP, same seed
and prompts, 120 steps of 16 prompts x 8 samples, T = 0.7, γ = 2) four ways, one after the other
in one sitting: plain rollouts and frozen-MTP speculative rollouts (rejection sampling), each
synchronous (every batch from the current policy) and asynchronous (staleness 1: the next batch
is sampled while the learner updates). Figures: rollout time, step time and RL time without the
first step (which compiles) and their ratios; reward vs step and vs wall-clock on one figure.

Then the cost model: per verify cycle the policy's (γ+1)-token forward and γ MTP draft steps,
timed on this machine at the RL batch (`spec_compacted.loop_costs`), give the rollout speedup
expected_tokens(α, γ) · t_step / (t_verify + γ · t_draft) for the acceptance α the run measured
-- and, labelled as a projection, the same with a GPU's memory-bound costs: a (γ+1)-token verify
costs one decode step (it reads the same weights) and a draft step costs the MTP's share of the
bytes a decode step reads (its parameters / the policy's). The projected end-to-end figure puts
that rollout speedup into the synchronous plain run's measured split of step time (Amdahl).

    python experiments/e2e_speedup/run.py --base runs/demo

Arms land in `runs/exp_rl_speed/<arm>/` (shared with `experiments/growmtp`; run both on an
otherwise idle machine, one after the other: their wall times are compared); figures and
`results.json` next to this file. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bebop import (  # noqa: E402  # noqa: E402
    compaction,
    model,
    mtp_train,
    plots,
    policies,
    prompts,
    sampling,
    sharding,
    spec_compacted,
)
from bebop import config as config_lib  # noqa: E402
from experiments import common  # noqa: E402

HERE = Path(__file__).resolve().parent
ARMS = ("plain_sync", "frozen_rs_sync", "plain", "frozen_rs")
# Bebop and GrowMTP's end-to-end figures (docs/method.md §6-7).
PAPER = {"bebop_e2e": "up to 1.8x", "growmtp_e2e": "1.60x (rollout 2.13x)"}


def timing(res: common.ArmResult) -> dict:
    _, dt = common.step_times(res)
    _, roll = res.series("rollout_s")
    _, train = res.series("train_s")
    return {
        "rl_s_after_step_1": float(dt.sum()),
        "step_s_median": float(np.median(dt)),
        "rollout_s": float(roll[1:].sum()),
        "train_s": float(train[1:].sum()),
        "rl_wall_s": res.summary["rl_wall_s"],
        "accept_len": res.summary.get("accept_len"),
        "reward_last10": common.window_mean(res, "reward_mean", False),
        "accuracy_after": res.summary["accuracy_after"],
    }


def ratios(t: dict) -> dict:
    """Plain time / speculative time (> 1: speculation is faster)."""
    pairs = {
        "sync": ("plain_sync", "frozen_rs_sync"),
        "async": ("plain", "frozen_rs"),
        "async_spec_vs_sync_plain": ("plain_sync", "frozen_rs"),
        "async_plain_vs_sync_plain": ("plain_sync", "plain"),
    }
    out = {}
    for name, (a, b) in pairs.items():
        out[name] = {
            k: t[a][k] / t[b][k] for k in ("rl_s_after_step_1", "step_s_median", "rollout_s")
        }
    return out


def cost_model(base: Path, frozen: common.ArmResult, plain_sync: dict, gamma: int) -> dict:
    """Measured loop costs at the RL batch, the CPU model's rollout speedup, and the GPU
    projection (see the module docstring)."""
    cfg = config_lib.from_dict(config_lib.RunConfig, json.loads((base / "config.json").read_text()))
    mesh = sharding.make_mesh(config_lib.MeshConfig(data=1), jax.devices()[:1])
    pol = policies.load(cfg, base, mesh)
    mtp = mtp_train.load_trained(cfg, base, cfg.model, mesh)
    vocab = mtp_train.load_draft_vocab(base / "mtp", cfg.model.vocab_size)
    vocab = None if vocab is None else jnp.asarray(vocab)
    ids = prompts.prompt_ids(cfg, pol.tok, 8, "bench", "task")
    width = int(sampling.pad_prompts(ids, pol.tok.pad_id)[0].shape[1])
    batch = cfg.rl.prompts_per_step * cfg.rl.group_size
    layers = model.decode_layers_jit(pol.graphdef, pol.params)
    costs = spec_compacted.loop_costs(
        (pol.graphdef, pol.params),
        layers,
        mtp,
        vocab,
        batch,
        width + cfg.rollout.max_new_tokens // 2,
        [gamma],
    )
    alpha = [common.window_mean(frozen, f"accept_rate_{k}", True, 120) for k in range(1, gamma + 1)]
    tokens = compaction.expected_tokens(alpha, gamma)
    c_verify = costs[f"verify_{gamma + 1}"] / costs["verify_1"]
    c_draft = costs["draft"] / costs["verify_1"]
    n_pol = sum(x.size for x in jax.tree.leaves(pol.params))
    n_mtp = sum(x.size for x in jax.tree.leaves(mtp[1]))
    head = cfg.model.vocab_size * cfg.model.dim  # the MTP drafts through the policy's head
    gpu_draft = (n_mtp + head) / n_pol
    cpu_rollout = tokens / (c_verify + gamma * c_draft)
    gpu_rollout = tokens / (1.0 + gamma * gpu_draft)
    share = plain_sync["rollout_s"] / plain_sync["rl_s_after_step_1"]
    return {
        "batch": batch,
        "gamma": gamma,
        "alpha_per_position": alpha,
        "expected_tokens_per_verify": tokens,
        "cpu_costs_s": costs,
        "cpu_verify_over_step": c_verify,
        "cpu_draft_over_step": c_draft,
        "cpu_model_rollout_speedup": cpu_rollout,
        "policy_params": n_pol,
        "mtp_params_with_head": n_mtp + head,
        "gpu_assumed_verify_over_step": 1.0,
        "gpu_assumed_draft_over_step": gpu_draft,
        "gpu_projected_rollout_speedup": gpu_rollout,
        "plain_sync_rollout_share": share,
        "gpu_projected_e2e_speedup_sync": 1.0 / ((1 - share) + share / gpu_rollout),
    }


def figures(results: dict[str, common.ArmResult], window: int) -> None:
    curves = {}
    for r in results.values():
        step, reward = r.series("reward_mean")
        _, t = r.series("time")
        curves[r.arm.label] = (step, (t - t[0]) / 60.0, common.running_mean(reward, window))
    plots.twin_x(
        HERE / "reward.png",
        curves,
        ("RL step", "RL wall-clock (minutes since the first step)"),
        f"sampled reward (running mean of {window} steps)",
        "demo GRPO, 128 rows/step, T = 0.7, γ = 2: reward vs step and vs wall-clock",
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="runs/demo", help="a finished demo run (sft + mtp)")
    ap.add_argument("--workdir", default=common.TIMED_ROOT)
    ap.add_argument("--window", type=int, default=10, help="running-mean width in steps")
    args = ap.parse_args()
    t0 = time.perf_counter()
    base = common.base_run(Path(args.base))
    results = common.study2_arms(ARMS, base, Path(args.workdir))
    times = {n: timing(r) for n, r in results.items()}
    rat = ratios(times)
    figures(results, args.window)
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
        print(f"speedup {n:28s} " + "  ".join(f"{k} {v:.2f}x" for k, v in r.items()), flush=True)
    print(
        f"cost model at {model_['batch']} rows: verify {model_['cpu_verify_over_step']:.2f}x, "
        f"draft {model_['cpu_draft_over_step']:.2f}x a decode step -> rollouts "
        f"{model_['cpu_model_rollout_speedup']:.2f}x; GPU projection (verify 1.0x, draft "
        f"{model_['gpu_assumed_draft_over_step']:.2f}x): rollouts "
        f"{model_['gpu_projected_rollout_speedup']:.2f}x, end to end "
        f"{model_['gpu_projected_e2e_speedup_sync']:.2f}x",
        flush=True,
    )
    out = {
        "study": "e2e_speedup",
        "model": "demo",
        "base": str(base),
        "load_average_1min_at_end": os.getloadavg()[0],
        "arms": times,
        "ratios": rat,
        "cost_model": model_,
        "paper": PAPER,
        "arm_wall_s": {n: r.wall_s for n, r in results.items()},
        "wall_s": time.perf_counter() - t0,
    }
    common.write_json(HERE / "results.json", out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
