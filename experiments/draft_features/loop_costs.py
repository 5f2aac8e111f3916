"""What each arm's draft head costs in the real speculative loop at batch 1, side by side.

The batch-1 benchmark (`run.speed`) reports a draft step's and a verify's cost from their own
timing loops, which run the verify without collecting any layers' outputs and the draft step
without the fusion: the same code for every arm. This times the sampler's whole cycle instead
(`speculative.sample_jit`: the (γ+1)-token verify that also keeps the chosen layers' outputs,
the catch-up through the fusion projection, γ - 1 chained draft steps of `mtp.depth` blocks,
the acceptance test), for every arm's `mtp` shape in one process, in paired rounds: per round
a plain decode step (`timing.step_seconds`) and then each arm's cycle at each γ
(`timing.cycle_seconds`, one whole rollout with EOS off minus its set-up, over its cycles).

The heads are random weights of each arm's shape (layers, `mtp.features`, `mtp.depth`, the
8,192-token draft vocabulary): with EOS off every cycle runs the same fixed-shape work whatever
the weights accept, so a cycle costs what a trained head's does. Figures per arm and γ, medians
over rounds: the cycle in plain decode steps (`cycle_cost`) and against `last_d1`'s cycle of
the same round (`vs_last_d1`). At batch 1 the speculative sampler's speedup is about
accept length / cycle_cost (the loop's set-up aside).

    python -m experiments.draft_features.loop_costs [--arms last_d1,layers3_d1] [--rounds 3]

Run it with nothing else running. Writes `loop_costs.json` here; last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bebop import config as config_lib
from bebop import model, sampling, sharding, speculative
from benchmarks.common import load_models, sampling_config, shaped_mtp
from experiments import mtp_arms
from experiments.draft_features.run import ARMS, GAMMAS, HERE
from experiments.e2e_speedup import timing

RULE = "rejection"
TEMPERATURE = 0.7


def cost_figures(rounds: list[dict], reference: str = "last_d1") -> dict:
    """Per arm and γ (as text), the medians over `rounds` (each `{"step_s": s, "cycle_s":
    {arm: {γ: s}}}`) of the cycle in plain decode steps and of the cycle against `reference`'s
    cycle of the same round (paired)."""
    arms = list(rounds[0]["cycle_s"])
    out = {}
    for arm in arms:
        out[arm] = {}
        for g in rounds[0]["cycle_s"][arm]:
            cyc = [r["cycle_s"][arm][g] for r in rounds]
            out[arm][str(g)] = {
                "cycle_cost": statistics.median(
                    c / r["step_s"] for c, r in zip(cyc, rounds, strict=True)
                ),
                f"vs_{reference}": statistics.median(
                    c / r["cycle_s"][reference][g] for c, r in zip(cyc, rounds, strict=True)
                )
                if reference in rounds[0]["cycle_s"]
                else None,
            }
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated; last_d1 first")
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds (medians over them)")
    ap.add_argument("--repeats", type=int, default=2, help="best of, per figure and round")
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--out", default=str(HERE / "loop_costs.json"))
    args = ap.parse_args(argv)
    names = args.arms.split(",")
    if names[0] != "last_d1" or any(n not in ARMS for n in names):
        raise SystemExit(f"--arms: want 'last_d1' first, then any of {list(ARMS)}; got {names}")
    if args.rounds < 1 or args.repeats < 1:
        raise SystemExit(f"--rounds and --repeats: want >= 1, got {args.rounds}, {args.repeats}")
    config = mtp_arms.MODELS["smollm2"]["config"]
    cfg = config_lib.load(config)[0]
    mesh = sharding.make_mesh(config_lib.MeshConfig(data=1), jax.devices()[:1])
    ns = argparse.Namespace(
        model="smollm2",
        config=config,
        mtp_ckpt="",
        mtp_shape=cfg.mtp,
        num_prompts=1,
        prompts="task",
    )
    pol, mtp, vocab, tok, ids, _ = load_models(ns, mesh)
    toks, lens = sampling.pad_prompts(ids, tok.pad_id)
    s = timing.Setup(
        cfg,
        pol,
        mtp,
        vocab,
        model.decode_layers_jit(*pol),
        sampling_config(tok, TEMPERATURE, args.new_tokens),
        np.asarray(toks),
        np.asarray(lens),
        "random weights of each arm's mtp shape",
    )
    pol_cfg = model.graphdef_config(*pol)
    heads = {}
    for name in names:
        shape = config_lib.load(config, ARMS[name])[0].mtp
        gd, params, v = shaped_mtp(shape, pol_cfg)
        heads[name] = ((gd, params), None if v is None else jnp.asarray(v))
    t0, rounds = time.perf_counter(), []
    for r in range(args.rounds):
        step, _ = timing.step_seconds(s, 1, args.repeats)
        cyc = {}
        for name, (m, v) in heads.items():
            cyc[name] = {
                g: timing.cycle_seconds(s, m, v, 1, speculative.SpecConfig(g, RULE), args.repeats)[
                    0
                ]
                for g in GAMMAS
            }
        rounds.append({"step_s": step, "cycle_s": cyc})
        print(f"round {r}: step {1e3 * step:.1f} ms", flush=True)
    figs = cost_figures(rounds)
    for name, per in figs.items():
        row = "  ".join(
            f"γ={g}: {f['cycle_cost']:.2f} steps ({f['vs_last_d1']:.3f}x)" for g, f in per.items()
        )
        print(f"{name:11s} {row}", flush=True)
    out = {
        "study": "draft_features.loop_costs",
        "model": "smollm2",
        "machine": f"{jax.devices()[0].platform}, {jax.device_count()} device(s)",
        "batch": 1,
        "rule": RULE,
        "temperature": TEMPERATURE,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "arms": figs,
        "raw": rounds,
        "wall_s": time.perf_counter() - t0,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
