"""Timing the inputs of the cost model's prediction (`experiments.e2e_speedup.predict`,
`bebop/costs.py`) on a base run's models, with nothing else running (`measure`):
  * per bucket size b of the RL batch (b = B, B/2, ... down to `rollout.min_bucket`) the real
    sampler loops' seconds per iteration: a plain decode step (`step`) and a speculative cycle at
    each γ = 1 .. `rollout.num_draft` (`cycle_γ`), each timed as one whole rollout with EOS off
    (every row runs to the token budget) minus its set-up, over its iterations; best of
    `--repeats` after a call that compiles;
  * the compilation of each of those loops (its first call minus its best): a derived draft
    table that changes compiles the loops of its new (bucket, γ) pairs during the run;
  * the set-up of a rollout of the whole batch (prefill, once per GRPO group, and the first
    token; `setup`, `spec_setup`), and one compaction (gather the live half of the loop state,
    scatter the outputs back, read the live rows on the host; `switch`, `spec_switch`);
  * one GRPO learner step on a batch of the RL shape (`learner_s`; rows x (prompt + budget)
    tokens, fixed-shape);
  * the contention κ of `costs.step_time`: a plain rollout and a learner step started together,
    κ = (both - the longer alone) / the shorter alone, median of `--repeats`;
and, for an arm that ran another loop than the one timed above (`predict.loop_variant`), that
loop's cycle beside the timed one (`variant_costs`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bebop import compaction, costs, model, sampling, sharding, spec_compacted, speculative, tasks
from bebop import config as config_lib
from bebop.rl import learner, loop
from bebop.rl import rollouts as rl_rollouts
from bebop.spec_compacted import best_time as _best
from bebop.train import TrainState, make_optimizer
from benchmarks.common import load_models
from experiments import arms


@dataclasses.dataclass
class Setup:
    cfg: config_lib.RunConfig
    pol: tuple
    mtp: tuple
    vocab: object
    layers: object
    scfg: sampling.SamplingConfig
    toks: np.ndarray  # batch 0's prompts, as the RL run places them
    lens: np.ndarray
    mtp_source: str  # the MTP timed (a checkpoint, or random weights of its shape)


def load(base: Path, model_name: str, config: str) -> Setup:
    """The base run's policy and MTP (`benchmarks.common.load_models`) and the RL batch's
    prompts (`rl.rollouts.Rollouts`: batch 0, padded to the run's width). A base whose MTP has
    not trained here (SmolLM2's base as only its config: `arms.base_run(config_only=True)`)
    times random weights of its `mtp` section's shape -- layers, depth, features and draft
    vocabulary size: the loops' seconds do not depend on the weights' values (EOS is off)."""
    mesh = sharding.make_mesh(config_lib.MeshConfig(data=1), jax.devices()[:1])
    cfg = config_lib.load(str(arms.REPO / config))[0]
    ckpt, shape = base / "mtp" / "ckpt", None
    if not (base / "mtp" / "summary.json").exists():  # as `same_base` tells an untrained MTP
        if model_name == "demo":
            raise SystemExit(
                f"{base}: no trained MTP (mtp/summary.json): the demo's base trains its own "
                "SFT policy and MTP first (python launch.py --config configs/demo.py)"
            )
        saved = json.loads((base / "config.json").read_text())
        shape = config_lib.from_dict(config_lib.RunConfig, saved).mtp
    ns = argparse.Namespace(
        model=model_name,
        run=str(base),
        config=config,
        mtp_ckpt="" if shape is not None else str(ckpt),
        mtp_shape=shape,
        num_prompts=1,
        prompts="task",
    )
    pol, mtp, vocab, tok, _, source = load_models(ns, mesh)
    print(f"MTP timed: {source}", flush=True)
    vocab = None if vocab is None else jnp.asarray(vocab)
    src = rl_rollouts.Rollouts(cfg, pol[0], mtp[0], tok, tasks.make_task(cfg.task), vocab=vocab)
    _, ids = src.prompts(0)
    toks, lens = src.place(ids)
    layers = model.decode_layers_jit(*pol)
    return Setup(cfg, pol, mtp, vocab, layers, src.scfg, np.asarray(toks), np.asarray(lens), source)


def step_seconds(s: Setup, rows: int, repeats: int) -> tuple[float, float]:
    """(seconds per plain decode step, compilation seconds) on the first `rows` rows of the
    batch: one whole rollout with EOS off (every row runs to the token budget) minus its set-up,
    over its steps."""
    t, ln, key = s.toks[:rows], s.lens[:rows], jax.random.key(0)
    noeos = dataclasses.replace(s.scfg, eos_ids=(), prompt_group=1)
    plain, first = (*s.pol, t, ln, key, noeos, s.layers), []
    full = _best(lambda: sampling.sample_jit(*plain), repeats, first)
    init = _best(lambda: sampling._init_jit(*plain).out, repeats)
    return (full - init) / noeos.max_new_tokens, max(0.0, first[0] - full)


def cycle_seconds(
    s: Setup, mtp: tuple, vocab, rows: int, spec, repeats: int
) -> tuple[float, float]:
    """(seconds per verify cycle, compilation seconds) of the speculative loop with the MTP
    `mtp` (graphdef, params), draft vocabulary `vocab` and `spec` on the first `rows` rows of the
    RL batch: one whole rollout with EOS off minus its set-up, over its cycles."""
    t, ln, key = s.toks[:rows], s.lens[:rows], jax.random.key(0)
    noeos = dataclasses.replace(s.scfg, eos_ids=(), prompt_group=1)
    args = (*s.pol, *mtp, t, ln, key, noeos, spec, vocab, s.layers)
    first = []
    full = _best(lambda: speculative.sample_jit(*args), repeats, first)
    cycles = int(np.asarray(speculative.sample_jit(*args).stats.verify_calls).max())
    g = spec.num_draft
    call = (*s.pol, *mtp, vocab, s.layers, t, ln, key, noeos, spec, True, g, 0)
    init = _best(lambda: spec_compacted._init_jit(*call).out, repeats)
    return (full - init) / max(cycles, 1), max(0.0, first[0] - full)


def loop_costs(s: Setup, repeats: int) -> dict:
    """Per bucket size: seconds per plain step and per speculative cycle at each γ (the real
    loops, EOS off), and at the full batch the set-ups and one compaction (module docstring)."""
    r = s.cfg.rollout
    batch = s.toks.shape[0]
    sizes = compaction.bucket_sizes(batch, r.min_bucket)
    key = jax.random.key(0)
    out = {}
    for b in sizes:
        c = {}
        c["step"], c["compile_0"] = step_seconds(s, b, repeats)
        for g in range(1, r.num_draft + 1):
            spec = speculative.SpecConfig(g, r.mode)
            c[f"cycle_{g}"], c[f"compile_{g}"] = cycle_seconds(s, s.mtp, s.vocab, b, spec, repeats)
        out[b] = c
    # the full batch's set-ups, with one prefill per GRPO group as the RL run does
    t, ln = s.toks, s.lens
    out[batch]["setup"] = _best(
        lambda: sampling._init_jit(*s.pol, t, ln, key, s.scfg, s.layers).out, repeats
    )
    y = r.num_draft
    spec = speculative.SpecConfig(y, r.mode)
    call = (*s.pol, *s.mtp, s.vocab, s.layers, t, ln, key, s.scfg, spec, True, y, 0)
    out[batch]["spec_setup"] = _best(lambda: spec_compacted._init_jit(*call).out, repeats)
    if len(sizes) > 1:
        idx = np.arange(sizes[1], dtype=np.int32)
        plain_state = sampling._init_jit(*s.pol, t, ln, key, s.scfg, s.layers)
        spec_state = spec_compacted._init_jit(*call)

        def switch(state, outputs, live):
            part = compaction.gather_rows(state, idx)
            np.asarray(live(part))
            return compaction.scatter_rows(outputs(state), outputs(part), idx)

        out[batch]["switch"] = _best(
            lambda: switch(plain_state, lambda x: x.out, lambda x: sampling._live(x, s.scfg)),
            repeats,
        )
        out[batch]["spec_switch"] = _best(
            lambda: switch(
                spec_state, speculative.row_outputs, lambda x: speculative.live(x, s.scfg)
            ),
            repeats,
        )
    return out


def learner_step(s: Setup):
    """A function running one GRPO learner step (`learner.build`'s policy step) on a batch of
    the RL shape: rows x (prompt width + budget), half the budget as response."""
    cfg = s.cfg
    opt = make_optimizer(cfg.rl.optim, cfg.rl.steps)
    mtp_opt = make_optimizer(cfg.rl.mtp_optim, cfg.rl.steps)
    store = loop.WeightStore(keep=2)
    ref = s.pol[1] if cfg.rl.kl_coef > 0 else None
    learn = learner.build(cfg, s.pol[0], s.mtp[0], s.scfg, s.vocab, opt, mtp_opt, store, ref)
    b, p = s.toks.shape
    width = p + s.scfg.max_new_tokens
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 100, (b, width)).astype(np.int32)
    mask = np.zeros((b, width), np.float32)
    mask[:, p : p + s.scfg.max_new_tokens // 2] = 1.0
    batch = loop.LearnerBatch(
        jnp.asarray(tokens),
        jnp.asarray(mask),
        jnp.asarray(-np.ones((b, width), np.float32) * mask),
        jnp.asarray(rng.standard_normal(b).astype(np.float32)),
    )
    state = [TrainState.create(jax.tree.map(jnp.copy, s.pol[1]), opt, cfg.seed + 200)]

    def step():
        state[0], m = learn.policy_step(state[0], batch, ref)
        return state[0].params

    return step


def contention(rollout_fn, learner_fn, repeats: int) -> dict:
    """κ of `costs.step_time` from a rollout and a learner step started together, with each
    phase's time alone, the pair's (`both_s`), the rollout's own time in each pair
    (`rollout_beside_learner_s`) and what `costs.rollout_in_step` makes of it from κ."""
    t_r = _best(rollout_fn, repeats)
    t_l = _best(learner_fn, repeats)
    both, rollout_in = [], []

    def rollout(t0):
        jax.block_until_ready(rollout_fn())
        rollout_in.append(time.perf_counter() - t0)

    for _ in range(repeats):
        t0 = time.perf_counter()
        th = threading.Thread(target=rollout, args=(t0,))
        th.start()
        jax.block_until_ready(learner_fn())
        th.join()
        both.append(time.perf_counter() - t0)
    kappas = [(x - max(t_r, t_l)) / min(t_r, t_l) for x in both]
    kappa = float(min(1.0, max(0.0, statistics.median(kappas))))
    return {
        "rollout_alone_s": t_r,
        "learner_alone_s": t_l,
        "both_s": both,
        "contention": kappa,
        # the rollout's own seconds beside the learner, and what `costs.rollout_in_step`
        # (both phases slowed alike) makes of κ: a check of that reading
        "rollout_beside_learner_s": rollout_in,
        "rollout_beside_learner_by_kappa_s": costs.rollout_in_step(t_r, t_l, True, kappa),
    }


def measure(base: Path, model_name: str, config: str, repeats: int) -> dict:
    s = load(base, model_name, config)
    t0 = time.perf_counter()
    bucket = loop_costs(s, repeats)
    step = learner_step(s)
    key = jax.random.key(1)
    plain = lambda: sampling.sample_jit(*s.pol, s.toks, s.lens, key, s.scfg, s.layers)  # noqa: E731
    over = contention(plain, step, repeats)
    return {
        "machine": f"{jax.devices()[0].platform}, {jax.device_count()} device(s)",
        "mtp": s.mtp_source,
        "batch": int(s.toks.shape[0]),
        "prompt_width": int(s.toks.shape[1]),
        "budget": s.scfg.max_new_tokens,
        "repeats": repeats,
        "bucket_costs_s": {str(b): c for b, c in bucket.items()},
        "learner_s": over["learner_alone_s"],
        "contention": over["contention"],
        "contention_timings": over,
        "measure_s": time.perf_counter() - t0,
    }


def variant_costs(s: Setup, cfg: config_lib.RunConfig, sizes, repeats: int) -> dict:
    """Per bucket size in `sizes`: arm `cfg`'s loop's seconds per cycle at γ =
    `rollout.num_draft` (`predict.loop_variant`; a random head of the arm's `mtp` shape, EOS
    off) and, timed just before it in the same process, those of the loop `loop_costs` times
    (the base's MTP and rule, `reference_cycle_γ`), and their ratio: what
    `predict.arm_bucket_costs` scales the measured cycle by."""
    from flax import nnx

    from benchmarks.common import shaped_mtp

    gd, params, vocab = shaped_mtp(cfg.mtp, nnx.merge(*s.pol).cfg)
    vocab = None if vocab is None else jnp.asarray(vocab)
    g, out = cfg.rollout.num_draft, {}
    reference = speculative.SpecConfig(g, s.cfg.rollout.mode)
    mine = speculative.SpecConfig(g, cfg.rollout.mode, record=True)
    for b in sizes:
        ref, _ = cycle_seconds(s, s.mtp, s.vocab, b, reference, repeats)
        cyc, comp = cycle_seconds(s, (gd, params), vocab, b, mine, repeats)
        out[str(b)] = {
            f"cycle_{g}": cyc,
            f"compile_{g}": comp,
            f"reference_cycle_{g}": ref,
            "ratio": cyc / ref,
        }
    return out
