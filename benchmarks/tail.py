"""Tail-aware rollouts: wall time of one RL-shaped rollout, static vs compacted batches.

    python -m benchmarks.tail --model demo --run runs/demo_base          # B=64 demo prompts
    python -m benchmarks.tail --model smollm2 --batches 16 --new_tokens 256 [--mtp_ckpt DIR]
    python -m benchmarks.tail --model demo --run runs/demo --batches 128 --group 8 --gammas 2

One batch of `--batches` rows (the RL task's held-out prompts, each once; the demo's rollout
temperature and token budget unless given), sampled with the real response-length
distribution, four ways: the static plain loop (every row runs until the longest ends),
compacted plain (`sampling.sample_compacted`: half the rows each time the live rows fall to
half), the static speculative loop at `--gammas`, and compacted speculative with a γ per bucket
(`--draft_table`, e.g. "64:0,16:2"; `auto`: `compaction.draft_table` from the verify / draft
costs `spec_compacted.loop_costs` measures at each bucket size and the static speculative run's
per-position acceptance). `--group G`: an RL batch's layout, batch / G prompts each over G rows,
prefilled once per group (both samplers); the static loops are also timed with a prefill per
row. Wall time: best of `--repeats` after a warm-up call that compiles.
One cell: `--batches`, `--temperatures`, `--rules` and `--gammas` take one value each.
Prints each variant's time and its ratio to the static plain loop; last line: one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np

from bebop import compaction, model, sampling, sharding, spec_compacted, speculative
from bebop import config as config_lib
from benchmarks.common import load_models


def best_time(fn, repeats: int):
    out = jax.block_until_ready(fn())  # compiles
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best, out


def parse_table(text: str) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(int(x) for x in item.split(":")) for item in text.split(",") if item)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["demo", "smollm2"], default="demo")
    ap.add_argument(
        "--run", "--workdir", default="runs/demo_base", help="--model demo: a finished run"
    )
    ap.add_argument("--mtp_ckpt", default="")
    ap.add_argument(
        "--config", default="configs/rl_smollm2.py", help="smollm2: the config of the task"
    )
    ap.add_argument("--batches", "--batch", dest="batch", type=int, default=64, help="one value")
    ap.add_argument("--new_tokens", type=int, default=0, help="0: the run's rollout budget")
    ap.add_argument(
        "--temperatures",
        "--temperature",
        dest="temperature",
        type=float,
        default=-1.0,
        help="one value (<0: the run's)",
    )
    ap.add_argument("--rules", "--rule", dest="rule", default="rejection", help="one rule")
    ap.add_argument("--gammas", "--gamma", dest="gamma", type=int, default=3, help="one value")
    ap.add_argument("--draft_table", default="auto")
    ap.add_argument("--min_bucket", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", choices=["task", "mixed"], default="task")
    ap.add_argument(
        "--group",
        type=int,
        default=1,
        help="GRPO-shaped: batch / group prompts, each over a run of `group` rows, prefilled "
        "once per run (`SamplingConfig.prompt_group`); also times both static loops without",
    )
    args = ap.parse_args()
    if args.group < 1 or args.batch % args.group:
        ap.error(f"--group {args.group} must divide --batches {args.batch}")
    args.num_prompts = args.batch // args.group

    mesh = sharding.make_mesh(config_lib.MeshConfig(data=1), jax.devices()[:1])
    pol, mtp, vocab, tok, ids, mtp_source = load_models(args, mesh)
    rollout = config_lib.RolloutConfig()
    if args.model == "demo":
        run_cfg = json.loads((Path(args.run) / "config.json").read_text())
        rollout = config_lib.from_dict(config_lib.RolloutConfig, run_cfg["rollout"], "rollout.")
    scfg = sampling.SamplingConfig(
        temperature=rollout.temperature if args.temperature < 0 else args.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_new_tokens=args.new_tokens or rollout.max_new_tokens,
        eos_ids=tuple(tok.eos_ids),
        pad_id=tok.pad_id,
        prompt_group=args.group,
    )
    rows = [p for p in ids[: args.num_prompts] for _ in range(args.group)]
    toks, lens = sampling.pad_prompts(rows, tok.pad_id)
    layers = model.decode_layers_jit(*pol)
    key, mb = jax.random.key(0), args.min_bucket
    spec = speculative.SpecConfig(args.gamma, args.rule)
    vocab = None if vocab is None else jax.numpy.asarray(vocab)

    res, outs = {}, {}
    res["static_plain_s"], outs["static_plain"] = best_time(
        lambda: sampling.sample_jit(*pol, toks, lens, key, scfg, layers), args.repeats
    )
    res["compact_plain_s"], outs["compact_plain"] = best_time(
        lambda: sampling.sample_compacted(*pol, toks, lens, key, scfg, layers, mb), args.repeats
    )
    res["static_spec_s"], static_spec = best_time(
        lambda: speculative.sample_jit(*pol, *mtp, toks, lens, key, scfg, spec, vocab, layers),
        args.repeats,
    )
    summ = speculative.summarize(static_spec)
    if args.group > 1:  # the same static loops, one prefill per row
        ungrouped = dataclasses.replace(scfg, prompt_group=1)
        res["static_plain_ungrouped_s"], _ = best_time(
            lambda: sampling.sample_jit(*pol, toks, lens, key, ungrouped, layers), args.repeats
        )
        res["static_spec_ungrouped_s"], _ = best_time(
            lambda: speculative.sample_jit(
                *pol, *mtp, toks, lens, key, ungrouped, spec, vocab, layers
            ),
            args.repeats,
        )
    if args.draft_table == "auto":
        context = int(toks.shape[1]) + scfg.max_new_tokens // 2
        sizes = compaction.bucket_sizes(args.batch, mb)
        costs = spec_compacted.bucket_costs(
            pol, layers, mtp, vocab, sizes, context, args.gamma, args.repeats
        )
        rates = [summ[f"accept_rate_{k}"] for k in range(1, args.gamma + 1)]
        table = compaction.draft_table(rates, costs, args.gamma)
        res["bucket_costs_ms"] = {
            b: {k: round(v * 1e3, 3) for k, v in sorted(c.items())} for b, c in costs.items()
        }
        print(f"per-iteration costs (ms) by bucket size: {res['bucket_costs_ms']}", flush=True)
    else:
        table = parse_table(args.draft_table)
    res["compact_spec_s"], compact_spec = best_time(
        lambda: spec_compacted.sample_compacted(
            *pol, *mtp, toks, lens, key, scfg, spec, vocab, layers, mb, table
        ),
        args.repeats,
    )
    lengths = np.asarray(outs["static_plain"].lengths)
    same = bool(np.array_equal(lengths, np.asarray(outs["compact_plain"].lengths)))
    base = res["static_plain_s"]
    for name in ("compact_plain", "static_spec", "compact_spec"):
        res[f"{name}_speedup"] = base / res[f"{name}_s"]
    # what speculation adds to a tail-aware rollout (the RL stage's `rollout_speedup` with
    # `rollout.compact` on compares these two)
    res["compact_spec_vs_compact_plain"] = res["compact_plain_s"] / res["compact_spec_s"]
    if args.group > 1:  # what one prefill per group saves, and speculation without it
        for name in ("static_plain", "static_spec"):
            res[f"{name}_group_gain"] = res[f"{name}_ungrouped_s"] / res[f"{name}_s"]
        res["static_spec_vs_plain_ungrouped"] = (
            res["static_plain_ungrouped_s"] / res["static_spec_ungrouped_s"]
        )
    print(
        f"B={args.batch} lengths median {np.median(lengths):.0f} max {lengths.max()} "
        f"(budget {scfg.max_new_tokens})  draft table {table}  accept_rate "
        f"{summ['accept_rate']:.2f}\n"
        f"static plain {base:.2f} s  compacted plain {res['compact_plain_s']:.2f} s "
        f"({res['compact_plain_speedup']:.2f}x)  static spec γ={args.gamma} "
        f"{res['static_spec_s']:.2f} s ({res['static_spec_speedup']:.2f}x)  compacted spec "
        f"{res['compact_spec_s']:.2f} s ({res['compact_spec_speedup']:.2f}x; "
        f"{res['compact_spec_vs_compact_plain']:.2f}x compacted plain)",
        flush=True,
    )
    if args.group > 1:
        print(
            f"groups of {args.group}: static plain {res['static_plain_group_gain']:.2f}x and "
            f"static spec {res['static_spec_group_gain']:.2f}x faster than with a prefill per "
            f"row (spec vs plain without groups: {res['static_spec_vs_plain_ungrouped']:.2f}x)",
            flush=True,
        )
    print(
        json.dumps(
            {
                "model": args.model,
                "mtp": mtp_source,
                "batch": args.batch,
                "new_tokens": scfg.max_new_tokens,
                "temperature": scfg.temperature,
                "rule": args.rule,
                "gamma": args.gamma,
                "group": args.group,
                "min_bucket": mb,
                "draft_table": table,
                "accept_rate": summ["accept_rate"],
                "length_median": float(np.median(lengths)),
                "length_max": int(lengths.max()),
                "compact_plain_same_lengths": same,
                **res,
            }
        )
    )


if __name__ == "__main__":
    main()
