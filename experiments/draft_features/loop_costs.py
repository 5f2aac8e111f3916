"""What each arm's draft head costs in the real speculative loop at batch 1, side by side.

The batch-1 benchmark (`run.speed`) prices a cycle from loops of its parts
(`spec_compacted.loop_cost_timers`): a (γ+1)-token verify that keeps no layers' outputs, and a
draft step without the fusion projection, so its costs are nearly the same for every arm. This
times the sampler's whole cycle as well (`speculative.sample_jit`: the verify that also keeps
the chosen layers' outputs, the catch-up through the fusion, the chained draft steps of
`mtp.depth` blocks, the acceptance test) for every arm's `mtp` shape in one process, in paired
rounds: per round the parts' loops, then per γ a plain decode step (`timing.step_seconds`)
followed by every arm's cycle at γ (`timing.cycle_seconds`: one whole rollout with EOS off
minus its set-up, over its cycles).

The heads are random weights of each arm's shape (layers, `mtp.features`, `mtp.depth`, the
8,192-token draft vocabulary): with EOS off a cycle runs the same fixed-shape work whatever it
accepts. `--trained ARM=RUN` also times RUN's trained MTP (as `ARM_trained`), which checks
that reading. Figures per arm and γ, medians over rounds (`cost_figures`): the cycle in plain
decode steps (`cycle_cost`), against `last_d1`'s cycle of the same round (`vs_last_d1`), and
the parts' sum (`model_cost`). At batch 1 the speedup over plain decoding is about accept
length / cycle_cost, the loop's set-up aside.

    python -m experiments.draft_features.loop_costs [--arms last_d1,layers3_d1] [--rounds 3] \
        [--trained last_d2=runs/exp_draft_features/last_d2]

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
from bebop import model, policies, sampling, sharding, spec_compacted, speculative
from bebop.config import resolve_features
from bebop.io import write_json_atomic
from benchmarks.common import load_models, sampling_config, shaped_mtp, trained_mtp_config
from experiments import mtp_arms
from experiments.draft_features.run import ARMS, GAMMAS, HERE
from experiments.e2e_speedup import timing

RULE = "rejection"
COST_ITERS = 16  # iterations of each verify/draft cost loop, as benchmarks.rollout
TEMPERATURE = 0.7


def cost_figures(rounds: list[dict], reference: str = "last_d1") -> dict:
    """Per arm and γ (as text), medians over `rounds` of: the cycle in plain decode steps
    (`cycle_cost`: over the step timed just before that γ's cycles), the cycle against
    `reference`'s of the same round and γ (`vs_<reference>`, paired), and the cost model's
    cycle, a (γ+1)-token verify and γ draft steps in 1-token verifies (`model_cost`:
    `spec_compacted.loop_cost_timers`' loops, as `benchmarks.rollout` times them). Each round
    is `{"step_s": {γ: s}, "cycle_s": {arm: {γ: s}}, "costs_s": {"verify_W": s, "draft":
    {arm: s}}}`, γ and W as ints or text."""
    med = statistics.median
    out = {}
    for arm, per in rounds[0]["cycle_s"].items():
        out[arm] = {}
        for g in per:
            n, cyc = int(g), [r["cycle_s"][arm][g] for r in rounds]
            model_cost = [
                (r["costs_s"][f"verify_{n + 1}"] + n * r["costs_s"]["draft"][arm])
                / r["costs_s"]["verify_1"]
                for r in rounds
            ]
            out[arm][str(g)] = {
                "cycle_cost": med(c / r["step_s"][g] for c, r in zip(cyc, rounds, strict=True)),
                f"vs_{reference}": med(
                    c / r["cycle_s"][reference][g] for c, r in zip(cyc, rounds, strict=True)
                ),
                "model_cost": med(model_cost),
            }
    return out


def load_heads(config: str, names, trained: dict, fallback, pol_cfg, mesh) -> dict:
    """name -> ((graphdef, params), draft vocabulary or None): random weights of each arm's
    `mtp` shape (`names`), and for each `trained` arm (ARM -> RUN/mtp/ckpt) that run's MTP as
    `ARM_trained` (its run's `mtp` section, else `fallback`), refused unless it reads the arm's
    layers with the arm's depth."""
    shapes = {n: config_lib.load(config, ARMS[n])[0].mtp for n in {*names, *trained}}
    heads = {}
    for name in names:
        gd, params, v = shaped_mtp(shapes[name], pol_cfg)
        heads[name] = ((gd, params), None if v is None else jnp.asarray(v))
    for name, ckpt in trained.items():
        mtp_cfg, want = trained_mtp_config(ckpt, fallback), shapes[name]
        got = (resolve_features(mtp_cfg.features, pol_cfg.num_layers), mtp_cfg.depth)
        if got != (resolve_features(want.features, pol_cfg.num_layers), want.depth):
            raise SystemExit(
                f"--trained {name}={ckpt.parent.parent}: its MTP reads layers {got[0]} with "
                f"depth {got[1]}, not arm {name}'s {tuple(want.features)} / {want.depth}"
            )
        gd, params, v = policies.load_mtp(mtp_cfg, ckpt, pol_cfg, mesh)
        heads[f"{name}_trained"] = ((gd, params), None if v is None else jnp.asarray(v))
    return heads


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated; last_d1 first")
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds (medians over them)")
    ap.add_argument("--repeats", type=int, default=2, help="best of, per figure and round")
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--gammas", default=",".join(map(str, GAMMAS)), help="comma-separated")
    ap.add_argument("--out", default=str(HERE / "loop_costs.json"))
    ap.add_argument(
        "--trained", action="append", default=[], help="ARM=RUN: also time RUN's trained MTP"
    )
    args = ap.parse_args(argv)
    names = args.arms.split(",")
    gammas = [int(g) for g in args.gammas.split(",")]
    if names[0] != "last_d1" or any(n not in ARMS for n in names):
        raise SystemExit(f"--arms: want 'last_d1' first, then any of {list(ARMS)}; got {names}")
    if not all(g >= 1 for g in gammas):
        raise SystemExit(f"--gammas: want drafted tokens >= 1, got {gammas}")
    if args.rounds < 1 or args.repeats < 1:
        raise SystemExit(f"--rounds and --repeats: want >= 1, got {args.rounds}, {args.repeats}")
    trained = {}  # ARM=RUN: that run's trained MTP, timed as `<ARM>_trained`
    for item in args.trained:
        name, _, run = item.partition("=")
        trained[name] = Path(run) / "mtp" / "ckpt"
        if name not in ARMS or not trained[name].exists():
            raise SystemExit(f"--trained {item}: want ARM=RUN, ARM in {list(ARMS)}, RUN/mtp/ckpt")
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
    heads = load_heads(config, names, trained, cfg.mtp, model.graphdef_config(*pol), mesh)
    context = int(toks.shape[1]) + args.new_tokens // 2
    timers = spec_compacted.loop_cost_timers(
        pol, s.layers, *heads["last_d1"], 1, context, gammas, COST_ITERS
    )
    drafts = {  # each head's draft-step loop (the verify loops do not depend on the head)
        name: spec_compacted.loop_cost_timers(pol, s.layers, m, v, 1, context, (), COST_ITERS)[
            "draft"
        ]
        for name, (m, v) in heads.items()
    }
    t0, rounds = time.perf_counter(), []
    for r in range(args.rounds):
        costs = spec_compacted.time_costs(
            {k: f for k, f in timers.items() if k != "draft"}, COST_ITERS
        )
        costs["draft"] = spec_compacted.time_costs(drafts, COST_ITERS)
        steps, cyc = {}, {name: {} for name in heads}
        for g in gammas:  # a plain step, then every head's cycle at γ: minutes apart at most
            steps[g] = timing.step_seconds(s, 1, args.repeats)[0]
            for name, (m, v) in heads.items():
                spec = speculative.SpecConfig(g, RULE)
                cyc[name][g] = timing.cycle_seconds(s, m, v, 1, spec, args.repeats)[0]
        rounds.append({"step_s": steps, "cycle_s": cyc, "costs_s": costs})
        print(f"round {r}: step {1e3 * steps[gammas[0]]:.1f} ms", flush=True)
    figs = cost_figures(rounds)
    for name, per in figs.items():
        row = "  ".join(
            f"γ={g}: {f['cycle_cost']:.2f} plain steps ({f['vs_last_d1']:.3f}x; parts "
            f"{f['model_cost']:.2f} verifies)"
            for g, f in per.items()
        )
        print(f"{name:18s} {row}", flush=True)
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
    write_json_atomic(Path(args.out), out, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
