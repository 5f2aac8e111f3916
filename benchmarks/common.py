"""What the benchmarks and the experiments that time samplers share: the policy and MTP they time
(a finished demo run, SmolLM2 or a random model of a real shape) with its prompts, the prompt
batches, the sampling config, a best-of timer, and the rollout cost model whose figures
`benchmarks.rollout`'s docstring defines. No benchmark imports another; they import this."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np

from bebop import config as config_lib
from bebop import mtp as mtp_lib
from bebop import prompts, sampling

REPO = Path(__file__).resolve().parents[1]


def with_dtype(cfg, dtype: str):
    """`cfg` with the policy's compute dtype `dtype` ("" or None: unchanged)."""
    if not dtype:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))


def predicted_at(alphas, gamma: int, costs: dict) -> dict:
    """The rollout speedup the cost model predicts at each per-position acceptance α of
    `alphas`: expected_tokens(α, γ) plain steps' worth of tokens per cycle, a plain step costing
    one 1-token verify, a cycle one (γ+1)-token verify and γ draft steps (`costs`:
    `spec_compacted.loop_costs`' seconds)."""
    from bebop import compaction

    cycle = costs[f"verify_{gamma + 1}"] + gamma * costs["draft"]
    return {
        f"{a:g}": compaction.expected_tokens(a, gamma) * costs["verify_1"] / cycle for a in alphas
    }


def load_models(args, mesh):
    """(policy, mtp, draft vocabulary, tokenizer, prompt ids, mtp source) of `args.model`:
    `demo` (the finished run `args.run`), `random` (`args.shape`, `args.layers`) or `smollm2`
    (`args.config`'s task, `args.mtp_ckpt`'s MTP if given, else random weights of the shape of
    `args.mtp_shape`, an `mtp` section, if given: its costs are a trained one's)."""
    if args.model == "demo":
        wd = Path(args.run)
        cfg = config_lib.from_dict(
            config_lib.RunConfig, json.loads((wd / "config.json").read_text())
        )
        cfg = with_dtype(cfg, getattr(args, "dtype", ""))
        from bebop import policies
        from bebop.stages import mtp as mtp_train

        policy = policies.load(cfg.policy, cfg.model, wd, mesh)
        pol_gd, pol_params, tok = policy.graphdef, policy.params, policy.tok
        mtp = mtp_train.load_trained(cfg, wd, cfg.model, mesh)
        vocab = mtp_train.load_draft_vocab(wd / "mtp", cfg.model.vocab_size)
        ids = prompts.prompt_ids(cfg.task, cfg.seed, tok, args.num_prompts, "bench", args.prompts)
        return (pol_gd, pol_params), mtp, vocab, tok, ids, "trained (demo mtp stage)"
    if args.model == "random":
        from benchmarks import shapes

        pcfg = shapes.model_config(args.shape, args.layers, args.dtype or "float32")
        pol = shapes.random_params(pcfg)  # drawn on the device
        mtp_gd, mtp_params = mtp_lib.init(pcfg, 1, seed=0)
        ids = shapes.random_prompts(pcfg, args.num_prompts)
        return pol, (mtp_gd, mtp_params), None, shapes.RandomTokenizer(), ids, "random init"
    from bebop import policies

    cfg, _ = config_lib.load(str(REPO / args.config))  # the task whose prompts are timed
    cfg = with_dtype(cfg, getattr(args, "dtype", ""))
    policy = policies.load(cfg.policy, cfg.model, Path("."), mesh)
    pol_gd, pol_params, tok, pol_cfg = policy.graphdef, policy.params, policy.tok, policy.cfg
    shape = getattr(args, "mtp_shape", None)  # an `mtp` section: random weights of its shape
    if args.mtp_ckpt:  # DIR/mtp/ckpt; the draft vocabulary, if any, is DIR/mtp/draft_vocab.npy
        mtp_cfg = trained_mtp_config(Path(args.mtp_ckpt), cfg.mtp)
        mtp_gd, mtp_params, vocab = policies.load_mtp(mtp_cfg, Path(args.mtp_ckpt), pol_cfg, mesh)
        source = args.mtp_ckpt
    elif shape is not None:
        mtp_gd, mtp_params, vocab = shaped_mtp(shape, pol_cfg)
        source = (
            f"random init of the mtp section's shape ({shape.num_layers} layer(s), depth "
            f"{shape.depth}, features {tuple(shape.features)}, draft vocabulary "
            f"{shape.draft_vocab or 'full'})"
        )
    else:
        (mtp_gd, mtp_params), vocab, source = mtp_lib.init(pol_cfg, 1, seed=0), None, "random init"
    ids = prompts.prompt_ids(cfg.task, cfg.seed, tok, args.num_prompts, "bench", args.prompts)
    return (pol_gd, pol_params), (mtp_gd, mtp_params), vocab, tok, ids, source


def shaped_mtp(shape: config_lib.MTPConfig, pol_cfg):
    """(graphdef, params, draft vocabulary or None) of a random MTP of the `mtp` section
    `shape` (layers, features, depth) on the policy `pol_cfg`, with a draft vocabulary of its
    `draft_vocab` size (the first ids): what a trained one of that section costs to run."""
    if shape.draft_vocab > pol_cfg.vocab_size:
        raise ValueError(
            f"mtp.draft_vocab = {shape.draft_vocab} exceeds the policy's vocabulary "
            f"({pol_cfg.vocab_size} tokens)"
        )
    gd, params = mtp_lib.init(pol_cfg, shape.num_layers, 0, shape.features, shape.depth)
    vocab = np.arange(shape.draft_vocab, dtype=np.int32) if shape.draft_vocab else None
    return gd, params, vocab


def trained_mtp_config(ckpt: Path, fallback: config_lib.MTPConfig) -> config_lib.MTPConfig:
    """The `mtp` section of the run that trained checkpoint `ckpt` (DIR/mtp/ckpt: DIR/config.json,
    which says its layers, depth and features), else `fallback` (with a warning when that
    section cannot be read)."""
    saved = ckpt.parent.parent / "config.json"
    if not saved.exists():
        return fallback
    try:
        section = json.loads(saved.read_text())["mtp"]
        return config_lib.from_dict(config_lib.MTPConfig, section, "mtp.")
    except (KeyError, ValueError) as e:  # ConfigError is a ValueError, as is bad JSON
        print(f"warning: {saved}: no readable mtp section ({e}); using the config's", flush=True)
        return fallback


def sampling_config(tok, temperature: float, new_tokens: int) -> sampling.SamplingConfig:
    """The benchmarks' sampling: `temperature`, `new_tokens` at most, the tokenizer's EOS/pad."""
    return sampling.SamplingConfig(
        temperature=temperature,
        max_new_tokens=new_tokens,
        eos_ids=tuple(tok.eos_ids),
        pad_id=tok.pad_id,
    )


def batches(toks_NxP, lens_N, b):
    """Batches of `b` rows cycling through the prompt set until every prompt ran once."""
    n = toks_NxP.shape[0]
    idx = np.arange(-(-n // b) * b) % n
    return [(toks_NxP[idx[i : i + b]], lens_N[idx[i : i + b]]) for i in range(0, len(idx), b)]


def timed_pass(fn, parts, repeats: int):
    """Best-of-`repeats` wall time of running `fn(tokens, lengths, batch index)` over every batch
    of `parts` (compiled first), and the outputs of the last pass."""
    jax.block_until_ready(fn(*parts[0], 0))
    best, outs = float("inf"), None
    for _ in range(repeats):
        t0, outs = time.perf_counter(), []
        for i, (t, ln) in enumerate(parts):
            outs.append(jax.block_until_ready(fn(t, ln, i)))
        best = min(best, time.perf_counter() - t0)
    return best, outs


def cost_model(plain: dict, spec: dict, costs: dict, gamma: int) -> dict:
    """The figures `benchmarks.rollout`'s docstring defines, from one cell's timings. `plain`:
    seconds `t`, set-up seconds `setup`, loop `steps`, `tokens`; `spec`: `t`, `setup`, `cycles`,
    `tokens`; `costs`: `spec_compacted.loop_costs`' seconds per iteration (`verify_{W}`,
    `draft`)."""
    t_step = (plain["t"] - plain["setup"]) / plain["steps"]
    t_cycle = costs[f"verify_{gamma + 1}"] + gamma * costs["draft"]
    modelled = spec["setup"] + spec["cycles"] * t_cycle
    predicted = (plain["t"] / plain["tokens"]) / (modelled / spec["tokens"])
    speedup = (spec["tokens"] / spec["t"]) / (plain["tokens"] / plain["t"])
    loop_s = spec["t"] - spec["setup"]
    return {
        "speedup": speedup,
        "predicted_speedup": predicted,
        "efficiency": speedup / predicted,
        "loop_efficiency": spec["cycles"] * t_cycle / loop_s,
        "step_ms": 1e3 * t_step,
        "cycle_ms": 1e3 * loop_s / spec["cycles"],
        "model_cycle_ms": 1e3 * t_cycle,
        "setup_share_spec": spec["setup"] / spec["t"],
        "verify_cost": costs[f"verify_{gamma + 1}"] / t_step,
        "verify_cost_vs_1": costs[f"verify_{gamma + 1}"] / costs["verify_1"],
        "draft_cost": costs["draft"] / t_step,
    }
