"""Rollout speed: plain sampler vs speculative (`target_only`, `rejection`) on the same prompts.

    python benchmarks/rollout.py --model demo --workdir runs/demo          # a finished demo run
    python benchmarks/rollout.py --model smollm2 [--mtp_ckpt runs/mtp_smollm2/mtp/ckpt]

Grid: batch sizes x γ x temperatures x rules (flags). Per cell: tokens/s, speedup over the plain
sampler, accept length (tokens per target forward), acceptance, and the efficiency = measured
speedup / predicted speedup, where predicted = accept_len * t_step / (t_verify(γ+1) + γ * t_draft)
from the measured cost of one plain decode step, one (γ+1)-token verify forward and one MTP draft
step (catch-up + γ-1 chain steps = γ MTP calls per cycle). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bebop import config as config_lib  # noqa: E402
from bebop import model, prompts, sampling, sharding, speculative  # noqa: E402
from bebop import mtp as mtp_lib  # noqa: E402
from bebop.fit import restore_params  # noqa: E402
from bebop.train import make_optimizer  # noqa: E402


def best_time(fn, repeats):
    fn()  # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def step_costs(pol, mtp, vocab, batch, context, gammas, repeats=5):
    """Seconds for one plain decode step, one (γ+1)-token verify, one MTP draft step."""
    cfg = model.graphdef_config(*pol)
    cache = model.new_cache(cfg, batch, context + 16)
    cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))
    extend = jax.jit(model.extend, static_argnums=0)
    res = {"step": best_time(lambda: extend(*pol, cache, jnp.ones((batch, 1), jnp.int32)), repeats)}
    for g in gammas:
        toks = jnp.ones((batch, g + 1), jnp.int32)
        res[f"verify_{g}"] = best_time(lambda t=toks: extend(*pol, cache, t), repeats)
    mcache = mtp_lib.new_cache(cfg, nnx.merge(*mtp).num_layers, batch, context + 16)
    mcache = mcache.replace(lengths=jnp.full((batch,), context, jnp.int32))

    @jax.jit
    def draft(pp, mp, c):
        policy, m = nnx.merge(pol[0], pp), nnx.merge(mtp[0], mp)
        hid = jnp.zeros((batch, 1, cfg.dim), jnp.float32)
        head = None if vocab is None else mtp_lib.draft_head(policy, vocab)
        one = jnp.ones((batch, 1), jnp.int32)
        return mtp_lib.extend(m, policy, 0, c, hid, one, head_DxK=head)[1]

    res["draft"] = best_time(lambda: draft(pol[1], mtp[1], mcache), repeats)
    return res


def load_models(args, mesh):
    if args.model == "demo":
        wd = Path(args.workdir)
        cfg = config_lib.from_dict(
            config_lib.RunConfig, json.loads((wd / "config.json").read_text())
        )
        from bebop import mtp_train, policies

        pol_gd, pol_params, tok = policies.load(cfg, wd, mesh)
        mtp = mtp_train.load_trained(cfg, wd, cfg.model, mesh)
        vocab = mtp_train.load_draft_vocab(wd / "mtp", cfg.model.vocab_size)
        ids = prompts.prompt_ids(cfg, tok, max(args.batches), "bench", "task")
        return (pol_gd, pol_params), mtp, vocab, tok, ids, "trained (demo mtp stage)"
    from bebop import mtp_train
    from bebop.checkpoints import gguf

    # unrolled decode: faster at batch 1, slower at batch 8 (benchmarks/decode.py)
    loaded, tok = gguf.load(gguf.find_smollm2(), mesh, scan_layers=False)
    pol_cfg = loaded.cfg
    mtp_gd, mtp_params = mtp_lib.init(pol_cfg, 1, seed=0)
    source, vocab = "random init", None
    if args.mtp_ckpt:  # DIR/mtp/ckpt; the draft vocabulary, if any, is DIR/mtp/draft_vocab.npy
        opt = make_optimizer(config_lib.OptimConfig(), 1)
        mtp_params = restore_params(Path(args.mtp_ckpt), mtp_params, opt, mesh)
        vocab = mtp_train.load_draft_vocab(Path(args.mtp_ckpt).parent, pol_cfg.vocab_size)
        source = args.mtp_ckpt
    cfg = config_lib.RunConfig()
    ids = prompts.prompt_ids(cfg, tok, max(args.batches), "bench", "mixed")
    return (loaded.graphdef, loaded.params), (mtp_gd, mtp_params), vocab, tok, ids, source


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["demo", "smollm2"], default="demo")
    ap.add_argument("--workdir", default="runs/demo")
    ap.add_argument("--mtp_ckpt", default="")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--gammas", default="1,2,3,4")
    ap.add_argument("--temps", default="0.7,1.0")
    ap.add_argument("--rules", default="target_only,rejection")
    ap.add_argument("--new_tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    args.batches = [int(x) for x in args.batches.split(",")]
    gammas = [int(x) for x in args.gammas.split(",")]
    temps = [float(x) for x in args.temps.split(",")]
    rules = args.rules.split(",")

    mesh = sharding.make_mesh(config_lib.MeshConfig(data=1), jax.devices()[:1])
    pol, mtp, vocab, tok, ids, mtp_source = load_models(args, mesh)
    vocab = None if vocab is None else jnp.asarray(vocab)
    rows = []
    for b in args.batches:
        toks, lens = sampling.pad_prompts(ids[:b], tok.pad_id)
        costs = step_costs(pol, mtp, vocab, b, int(toks.shape[1]) + args.new_tokens // 2, gammas)
        for temp in temps:
            scfg = sampling.SamplingConfig(
                temperature=temp, max_new_tokens=args.new_tokens, eos_ids=tuple(tok.eos_ids),
                pad_id=tok.pad_id,
            )  # fmt: skip
            key = jax.random.key(0)
            plain_out = {}

            def plain(scfg=scfg, key=key, toks=toks, lens=lens, box=plain_out):
                box["o"] = sampling.sample_jit(*pol, toks, lens, key, scfg)
                return box["o"]

            t_plain = best_time(plain, args.repeats)
            plain_tps = int(plain_out["o"].lengths.sum()) / t_plain
            for g in gammas:
                for rule in rules:
                    spec = speculative.SpecConfig(g, rule)
                    box = {}

                    def run(spec=spec, scfg=scfg, key=key, toks=toks, lens=lens, box=box):
                        box["o"] = speculative.sample_jit(
                            *pol, *mtp, toks, lens, key, scfg, spec, vocab
                        )
                        return box["o"]

                    t = best_time(run, args.repeats)
                    summ = speculative.summarize(box["o"])
                    tps = summ["tokens"] / t
                    predicted = (
                        summ["accept_len"]
                        * costs["step"]
                        / (costs[f"verify_{g}"] + g * costs["draft"])
                    )
                    row = {
                        "batch": b, "temperature": temp, "gamma": g, "rule": rule,
                        "plain_tok_s": plain_tps, "spec_tok_s": tps, "speedup": tps / plain_tps,
                        "accept_len": summ["accept_len"], "accept_rate": summ["accept_rate"],
                        "predicted_speedup": predicted, "efficiency": (tps / plain_tps) / predicted,
                        "verify_cost": costs[f"verify_{g}"] / costs["step"],
                        "draft_cost": costs["draft"] / costs["step"],
                    }  # fmt: skip
                    rows.append(row)
                    print(
                        f"B={b:3d} T={temp:.1f} γ={g} {rule:11s} plain {plain_tps:8.1f} tok/s  "
                        f"spec {tps:8.1f} tok/s  speedup {row['speedup']:.2f}x  "
                        f"accept_len {summ['accept_len']:.2f}  predicted {predicted:.2f}x  "
                        f"eff {row['efficiency']:.2f}  verify {row['verify_cost']:.2f}x  "
                        f"draft {row['draft_cost']:.2f}x",
                        flush=True,
                    )
    best = max(rows, key=lambda r: r["speedup"])
    print(json.dumps({"model": args.model, "mtp": mtp_source, "new_tokens": args.new_tokens,
                      "draft_vocab": None if vocab is None else int(vocab.shape[0]),
                      "best": best, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
