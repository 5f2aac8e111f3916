"""Rollout speed: plain sampler vs speculative (`target_only`, `rejection`) on the same prompts.

    python -m benchmarks.rollout --model demo --run runs/demo          # a finished demo run
    python -m benchmarks.rollout --model smollm2 [--mtp_ckpt runs/mtp_smollm2/mtp/ckpt]
        [--config configs/rl_smollm2.py]   # the RL task's prompts (default: the MTP config's)
    python -m benchmarks.rollout --model random --shape qwen3_8b --layers 4 --dtype bfloat16 \\
        --batches 1,8,64,256 --gammas 3 --costs_only --alphas 0.6,0.7,0.8,0.9

`--dtype`: the policy's (and MTP's) compute dtype (default: the run's or config's own).
`--model random`: a random-weight policy of a real shape (`benchmarks.shapes`) with a random
MTP and prompts of random tokens, no EOS; a random MTP accepts almost nothing, so its measured
speedups say little: `--costs_only` times only the loop costs (verify, draft, a cycle) per batch
and reports the rollout speedup the cost model predicts at each stated per-position acceptance
of `--alphas`: expected_tokens(α, γ) · t_verify(1) / (t_verify(γ+1) + γ t_draft) (the loop's
set-up and EOS left out). Every row also carries that prediction (`predicted_at_alpha`).

Prompts: `--num_prompts` (default 16) held-out prompts of the RL task (`wordmath` for SmolLM2,
arithmetic for the demo; `--prompts mixed` for chat requests), padded to one width; a batch of B
rows cycles through them (B=1: 16 runs of one prompt), so acceptance is averaged over the set.
Grid: `--batches` x `--gammas` x `--temperatures` x `--rules`. Per cell: tokens/s, speedup over
the plain sampler, accept length (tokens per target forward), per-position acceptance, and the
efficiency = measured speedup / predicted speedup, where the predicted speedup is the plain
sampler's measured seconds per token over the speculative sampler's modelled seconds per token,
each over its own run's tokens:
    predicted = (plain seconds / plain tokens)
                / ((spec set-up + speculative cycles * (t_verify(γ+1) + γ t_draft)) / spec tokens),
so efficiency = modelled / measured time of the speculative sampler, and loop_efficiency =
cycles * (t_verify(γ+1) + γ t_draft) / (measured time - spec set-up): the cycles alone against
their cost model (efficiency = s + (1 - s) loop_efficiency, s the set-up's share of the
measured time; before commit f60195f the set-up was not modelled, so older `efficiency` figures are
lower by construction). The set-up (the prompt's prefill: the policy's, and for the speculative
sampler also the MTP's, and the first token) is timed on its own as the jitted initial state of
each sampler (`sampling._init_jit`, `spec_compacted._init_jit`);
t_step is the plain sampler's loop step, (plain seconds - plain set-up) / plain steps. t_verify and
t_draft are timed as jitted loops of that one forward the way the samplers run it
(`spec_compacted.loop_costs`: prepared weights, carried cache, outputs used); loop steps and
cycles are counted until each batch's slowest row ends. (The two runs draw different samples,
so their lengths differ: a prediction without the token counts moved the efficiency by the
ratio of the two runs' tokens, e.g. 0.82 at B=1, T=0.7, γ=2.) Both samplers get the decode
weights prepared once (`model.decode_layers_jit`), as RL and distillation do.

Timing: each of `--repeats` rounds times, one after the other, the plain pass, its
set-up, every cell's speculative pass and set-up, and the verify/draft costs; the ratios
(speedup, predicted speedup, efficiency, costs in plain steps) are computed per round from that
round's timings and reported as the median over rounds, with the efficiency's range (each a
median of its own, so `efficiency` need not equal the ratio of the two medians); tokens/s and
set-up milliseconds are best of the rounds; within a round each pass runs once and each cost
loop best of 3. (Before, the costs were timed once per batch size ahead of every run and
each figure was a best-of taken minutes apart from the others: on this machine, whose speed
drifts by 1.5x within minutes, one process's efficiency read anywhere in 0.85-1.23.)
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from bebop import config as config_lib
from bebop import model, sampling, sharding, spec_compacted, speculative
from benchmarks.common import batches, cost_model, load_models, predicted_at, sampling_config

COST_ITERS = 16  # iterations of each verify/draft cost loop


def one_pass(fn, parts):
    """Wall time of running `fn` over every batch, and the outputs."""
    t0, outs = time.perf_counter(), []
    for i, (t, ln) in enumerate(parts):
        outs.append(jax.block_until_ready(fn(t, ln, i)))
    return time.perf_counter() - t0, outs


def interleaved(passes: dict, timers: dict, parts, repeats: int):
    """Times every pass of `passes` (name -> fn over the batches) and every cost timer
    (`spec_compacted.loop_cost_timers`) once per repeat, one after the other, so that each
    repeat's figures come from the same minutes of the machine. All compiled first. Returns
    (per-repeat seconds of each pass, per-repeat costs, the outputs of each pass's last run but
    the set-ups', whose states are dropped)."""
    outs = {}
    for fn in passes.values():
        jax.block_until_ready(fn(*parts[0], 0))
    secs, costs = {name: [] for name in passes}, []
    for _ in range(repeats):
        for name, fn in passes.items():
            t, out = one_pass(fn, parts)
            secs[name].append(t)
            if name != "plain_setup" and name[0] != "setup":  # set-up states (caches) dropped
                outs[name] = out
        costs.append(spec_compacted.time_costs(timers, COST_ITERS))
    return secs, costs, outs


def cost_rows(timers, batch: int, gammas, alphas, repeats: int) -> list[dict]:
    """`--costs_only`: per γ, the loop costs at `batch` rows (median of `repeats` rounds of
    `spec_compacted.time_costs`), in ms and in 1-token verifies (a plain step), and the rollout
    speedups the cost model predicts at `alphas` (`predicted_at`)."""
    rounds = [spec_compacted.time_costs(timers, COST_ITERS) for _ in range(repeats)]
    costs = {k: float(np.median([r[k] for r in rounds])) for k in rounds[0]}
    out = []
    for g in gammas:
        cycle = costs[f"verify_{g + 1}"] + g * costs["draft"]
        row = {
            "batch": batch,
            "gamma": g,
            "step_ms": 1e3 * costs["verify_1"],
            "verify_ms": 1e3 * costs[f"verify_{g + 1}"],
            "draft_ms": 1e3 * costs["draft"],
            "cycle_ms": 1e3 * cycle,
            "verify_cost": costs[f"verify_{g + 1}"] / costs["verify_1"],
            "draft_cost": costs["draft"] / costs["verify_1"],
            "predicted_at_alpha": predicted_at(alphas, g, costs),
        }
        out.append(row)
        pred = "  ".join(f"α={a} {v:.2f}x" for a, v in row["predicted_at_alpha"].items())
        print(
            f"B={batch:3d} γ={g} step {row['step_ms']:.2f} ms  verify {row['verify_cost']:.2f}x "
            f" draft {row['draft_cost']:.2f}x  cycle {row['cycle_ms']:.2f} ms  predicted {pred}",
            flush=True,
        )
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["demo", "smollm2", "random"], default="demo")
    ap.add_argument("--shape", default="smollm2", help="--model random: benchmarks.shapes")
    ap.add_argument("--layers", type=int, default=0, help="--model random: first N layers (0: all)")
    ap.add_argument("--dtype", choices=["", "float32", "bfloat16"], default="")
    ap.add_argument("--costs_only", action="store_true", help="loop costs + predicted speedups")
    ap.add_argument("--alphas", default="0.6,0.7,0.8,0.9", help="acceptances for the prediction")
    ap.add_argument("--run", "--workdir", default="runs/demo", help="--model demo: a finished run")
    ap.add_argument("--mtp_ckpt", default="")
    ap.add_argument(
        "--config",
        default="configs/mtp_smollm2.py",
        help="smollm2: the config whose task gives the prompts (configs/rl_smollm2.py: RL's)",
    )
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--gammas", default="1,2,3,4")
    ap.add_argument("--temperatures", "--temps", default="0.7,1.0")
    ap.add_argument("--rules", default="target_only,rejection")
    ap.add_argument("--new_tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num_prompts", type=int, default=16)
    ap.add_argument("--prompts", choices=["task", "mixed"], default="task")
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats: want at least 1 round, got {args.repeats}")
    args.batches = [int(x) for x in args.batches.split(",")]
    gammas = [int(x) for x in args.gammas.split(",")]
    temps = [float(x) for x in args.temperatures.split(",")]
    rules = args.rules.split(",")
    alphas = [float(x) for x in args.alphas.split(",")]

    mesh = sharding.make_mesh(config_lib.MeshConfig(data=1), jax.devices()[:1])
    pol, mtp, vocab, tok, ids, mtp_source = load_models(args, mesh)
    vocab = None if vocab is None else jnp.asarray(vocab)
    all_toks, all_lens = sampling.pad_prompts(ids, tok.pad_id)  # one width: one compilation
    layers = model.decode_layers_jit(*pol)  # once, as RL and distillation do
    rows = []
    for b in args.batches:
        parts = batches(all_toks, all_lens, b)
        context = int(all_toks.shape[1]) + args.new_tokens // 2
        timers = spec_compacted.loop_cost_timers(
            pol, layers, mtp, vocab, b, context, gammas, COST_ITERS
        )
        if args.costs_only:
            rows += cost_rows(timers, b, gammas, alphas, args.repeats)
            print(json.dumps({"rows": rows}), flush=True)  # the figures so far
            continue
        for temp in temps:
            scfg = sampling_config(tok, temp, args.new_tokens)
            keys = jax.random.split(jax.random.key(0), len(parts))

            def plain(t, ln, i, scfg=scfg, keys=keys):
                return sampling.sample_jit(*pol, t, ln, keys[i], scfg, layers)

            def plain_setup(t, ln, i, scfg=scfg, keys=keys):
                return sampling._init_jit(*pol, t, ln, keys[i], scfg, layers)

            passes = {"plain": plain, "plain_setup": plain_setup}
            cells = [(g, rule) for g in gammas for rule in rules]
            for g, rule in cells:
                spec = speculative.SpecConfig(g, rule)

                def run(t, ln, i, spec=spec, scfg=scfg, keys=keys):
                    return speculative.sample_jit(
                        *pol, *mtp, t, ln, keys[i], scfg, spec, vocab, layers
                    )

                def setup(t, ln, i, spec=spec, scfg=scfg, keys=keys):
                    y = spec.num_draft  # as `speculative.sample` sets the loop up
                    call = (*pol, *mtp, vocab, layers, t, ln, keys[i], scfg, spec)
                    return spec_compacted._init_jit(*call, y > 0, y, 0)

                passes[("spec", g, rule)], passes[("setup", g, rule)] = run, setup
            secs, costs, outs = interleaved(passes, timers, parts, args.repeats)
            plain_tokens = sum(int(o.lengths.sum()) for o in outs["plain"])
            plain_tps = plain_tokens / min(secs["plain"])
            # The plain loop runs until its longest row ends: one step per token of that row.
            plain_steps = sum(int(o.lengths.max()) for o in outs["plain"])
            for g, rule in cells:
                spec_outs = outs[("spec", g, rule)]
                pooled = jax.tree.map(lambda *x: np.concatenate(x), *jax.device_get(spec_outs))
                summ = speculative.summarize(pooled)  # all rows of all batches
                tps = summ["tokens"] / min(secs[("spec", g, rule)])
                # Cost model: the set-up, then each cycle of the loop (until its slowest row
                # ends) one (γ+1)-token verify + γ MTP calls (catch-up + γ-1 chain steps); the
                # plain sampler as measured. Per token of each run, per repeat (paired timings).
                cycles = sum(int(o.stats.verify_calls.max()) for o in spec_outs)
                per_repeat = [
                    cost_model(
                        dict(
                            t=secs["plain"][r],
                            setup=secs["plain_setup"][r],
                            steps=plain_steps,
                            tokens=plain_tokens,
                        ),
                        dict(
                            t=secs[("spec", g, rule)][r],
                            setup=secs[("setup", g, rule)][r],
                            cycles=cycles,
                            tokens=summ["tokens"],
                        ),
                        costs[r],
                        g,
                    )
                    for r in range(args.repeats)
                ]
                figures = {k: float(np.median([f[k] for f in per_repeat])) for k in per_repeat[0]}
                effs = [f["efficiency"] for f in per_repeat]
                row = {
                    "batch": b,
                    "temperature": temp,
                    "gamma": g,
                    "rule": rule,
                    "repeats": args.repeats,
                    "plain_tok_s": plain_tps,
                    "spec_tok_s": tps,
                    "accept_len": summ["accept_len"],
                    "accept_rate": summ["accept_rate"],
                    **{f"accept_rate_{k}": summ[f"accept_rate_{k}"] for k in range(1, g + 1)},
                    **figures,
                    "efficiency_range": [min(effs), max(effs)],
                    "setup_ms_plain": 1e3 * min(secs["plain_setup"]) / len(parts),
                    "setup_ms_spec": 1e3 * min(secs[("setup", g, rule)]) / len(parts),
                    "plain_tokens": plain_tokens,
                    "spec_tokens": summ["tokens"],
                    "predicted_at_alpha": predicted_at(
                        alphas, g, {k: float(np.median([c[k] for c in costs])) for k in costs[0]}
                    ),
                }
                rows.append(row)
                per_pos = " / ".join(f"{row[f'accept_rate_{k}']:.2f}" for k in range(1, g + 1))
                print(
                    f"B={b:3d} T={temp:.1f} γ={g} {rule:11s} plain {plain_tps:8.1f} tok/s  "
                    f"spec {tps:8.1f} tok/s  speedup {row['speedup']:.2f}x  "
                    f"accept_len {summ['accept_len']:.2f} ({per_pos})  "
                    f"predicted {row['predicted_speedup']:.2f}x  "
                    f"eff {row['efficiency']:.2f} [{min(effs):.2f}-{max(effs):.2f}] "
                    f"(loop {row['loop_efficiency']:.2f}, "
                    f"set-up {row['setup_share_spec']:.0%})  "
                    f"verify {row['verify_cost']:.2f}x  draft {row['draft_cost']:.2f}x",
                    flush=True,
                )
    best = None if args.costs_only else max(rows, key=lambda r: r["speedup"])
    print(
        json.dumps(
            {
                "model": args.model if args.model != "random" else f"random {args.shape}",
                "layers": model.graphdef_config(*pol).num_layers,
                "dtype": model.graphdef_config(*pol).dtype,
                "device": jax.devices()[0].device_kind,
                "mtp": mtp_source,
                "new_tokens": args.new_tokens,
                "prompts": f"{args.num_prompts} {args.prompts}",
                "draft_vocab": None if vocab is None else int(vocab.shape[0]),
                "best": best,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
