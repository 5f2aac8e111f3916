"""Memory plan of a run, per device, without its accelerators or a checkpoint: every program the
run executes, compiled at the run's real shapes on a fake CPU mesh, read from XLA's
`compiled.memory_analysis()`.

    python -m benchmarks.memory --config configs/qwen3_gpu.py --arch qwen3-8b
    python -m benchmarks.memory --config configs/qwen3_tpu_pod.py --arch qwen3-8b

The architecture comes from a shipped table (`bebop/checkpoints/arch/NAME.json`, the model's
`config.json` fields; no weights). Abstract arrays (`jax.ShapeDtypeStruct`) carry the run's
shardings (`bebop.sharding`, activations pinned under `sharding.activation_mesh`); each program
is the function the run calls (`rl.learner.build`'s policy step, `rl.loop.snapshot` for the
weight publish, `sampling.sample_jit`, `speculative.sample_jit`, `mtp_losses.mtp_loss` in
`train.make_train_step`, `model.decode_layers_jit`), lowered and compiled for the mesh.

Per device it prints the resident state (policy parameters, AdamW moments, the weight store's
published versions, the MTP and its optimizer; the KL reference with `rl.kl_coef`), then each
program's transient memory: its temporaries (`temp_size_in_bytes`), its outputs that do not
alias a donated input, and its inputs that are not resident (the batch, a decode copy made
outside the loop), beside an analytic estimate; the peak (resident + transient) and whether it
fits `--budget_gb` (default 80 for a GPU node, 95 for a v5p pod; the target is 90 % of it). In
one process (a GPU node) the rollout worker's sampler and the learner's step run at the same
time: the row `learner + rollout` adds both transients.

Depth: programs are compiled at `--layers` (default 2 and 4) and every figure is extrapolated
linearly to the architecture's depth (the per-layer parts of a program -- weights, KV caches,
saved activations -- grow linearly with the layers); `--check_layers 6` also compiles at 6 layers
and reports the extrapolation's error there. A pod: `--devices` (default 8) fake devices stand
for the pod's `--pod_devices` chips with the same per-device shapes -- the same `fsdp` and
`tensor` axes, and every batch scaled by the ratio of the `data` axes -- since compiling for
hundreds of fake devices is slow here; the output says so.

Last line: one JSON object with `programs` (per program: peak, transient, temporaries and the
analytic estimate, GB per device), `resident_gb`, `peak_gb`, `fits`, `budget_gb`, `target_gb`,
`meets_target`, `wall_s`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time
from pathlib import Path

GB = 1e9


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/qwen3_gpu.py")
    ap.add_argument("--arch", default="qwen3-8b", help="bebop/checkpoints/arch/NAME.json")
    ap.add_argument("--devices", type=int, default=8, help="fake CPU devices to compile on")
    ap.add_argument(
        "--pod_devices",
        type=int,
        default=0,
        help="devices of the real machine (default: --devices, or 64 chips for a config with "
        "distributed.auto, a v5p-128 slice)",
    )
    ap.add_argument("--budget_gb", type=float, default=0.0, help="default 80 GPU / 95 TPU v5p")
    ap.add_argument("--layers", default="2,4", help="depths to compile (extrapolated linearly)")
    ap.add_argument("--check_layers", type=int, default=0, help="also compile here; report error")
    ap.add_argument("--prompt_len", type=int, default=128, help="padded prompt width (tokens)")
    ap.add_argument("--set", "--override", action="append", default=[], help="config KEY=VALUE")
    ap.add_argument("--programs", default="", help="comma-separated subset of program names")
    return ap.parse_args(argv)


def set_device_count(n: int) -> None:
    """Before JAX starts: `n` fake CPU devices."""
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


# ----------------------------------------------------------------------------- sizes


def jax_jit(fn, **kw):
    import jax

    return jax.jit(fn, **kw)


def nbytes_per_device(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs carrying shardings (the largest
    shard; replicated leaves whole)."""
    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.shape
        sh = getattr(x, "sharding", None)
        if sh is not None and shape:
            shape = sh.shard_shape(shape)
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


@dataclasses.dataclass
class Program:
    """One compiled program's figures (bytes per device at the compiled depth)."""

    temp: int
    out: int
    alias: int
    args: int
    transient_args: int  # inputs that are not resident state (exact, from shapes)
    estimate: int  # analytic transient estimate

    @property
    def transient(self) -> int:
        return self.temp + max(self.out - self.alias, 0) + self.transient_args


def compile_figures(fn, args, kwargs=None) -> dict:
    """memory_analysis() of `fn` lowered and compiled at `args` (ShapeDtypeStructs). A step
    that picks its jitted program when called (`train.jit_pinned`, a learner step per row
    width) is traced inside one `jax.jit` (its inner jit inlined), the train state donated as
    the run donates it (`kwargs["donate"]`)."""
    kwargs = dict(kwargs or {})
    donate = kwargs.pop("donate", ())
    if not hasattr(fn, "lower"):
        inner = fn
        fn = jax_jit(lambda *a: inner(*a), donate_argnums=donate)
    c = fn.lower(*args, **kwargs).compile()
    ma = c.memory_analysis()
    return {
        "temp": int(ma.temp_size_in_bytes),
        "out": int(ma.output_size_in_bytes),
        "alias": int(ma.alias_size_in_bytes),
        "args": int(ma.argument_size_in_bytes),
        "compiled": c,
    }


# ----------------------------------------------------------------------------- the run


@dataclasses.dataclass
class Setup:
    cfg: object  # RunConfig with batches scaled to the fake mesh
    arch: object  # ModelConfig at full depth
    mesh: object
    scale: float  # fake rows / real rows
    prompt_len: int
    microbatch: int = 0  # the learner's rows per accumulation chunk (set by `programs`)
    eos: tuple = (151645,)
    pad: int = 151643


def scaled_config(cfg, scale: float):
    """`cfg` with every batch (rows) scaled by `scale` (the fake mesh's share of the pod's)."""

    def s(n: int, what: str) -> int:
        out = n * scale
        if out != int(out) or out < 1:
            raise SystemExit(f"{what}={n} does not scale to the fake mesh by {scale}")
        return int(out)

    rl = cfg.rl
    rl = dataclasses.replace(
        rl,
        prompts_per_step=s(rl.prompts_per_step, "rl.prompts_per_step"),
        microbatch=s(rl.microbatch, "rl.microbatch") if rl.microbatch > 0 else rl.microbatch,
        eval_samples=max(1, int(rl.eval_samples * scale)),
    )
    distill = dataclasses.replace(
        cfg.distill, batch_size=s(cfg.distill.batch_size, "distill.batch_size")
    )
    mtp = dataclasses.replace(cfg.mtp, batch_size=s(cfg.mtp.batch_size, "mtp.batch_size"))
    return dataclasses.replace(cfg, rl=rl, distill=distill, mtp=mtp)


def scfg_of(st: Setup, max_new=None):
    from bebop import sampling

    r = st.cfg.rollout
    return sampling.SamplingConfig(
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=max_new or r.max_new_tokens,
        eos_ids=st.eos,
        pad_id=st.pad,
    )


def batch_sds(mesh, shape, dtype):
    import jax

    from bebop import sharding

    return jax.ShapeDtypeStruct(
        shape, dtype, sharding=sharding.batch_sharding(mesh, len(shape), shape[0])
    )


def _features_for(features, layers: int) -> tuple[int, ...]:
    """`mtp.features` for a policy compiled `layers` deep: as configured where they fit, else the
    last layers, as many (the same fusion width, hence the same memory)."""
    from bebop.config import ConfigError, resolve_features

    try:
        return resolve_features(features, layers)
    except ConfigError:
        n = min(len(features), layers)
        return tuple(range(layers - n, layers))


def state_at(st: Setup, layers: int):
    """Abstract policy / MTP parameters and train states on the mesh, `layers` deep."""
    import jax

    from bebop import model, sharding
    from bebop import mtp as mtp_lib
    from bebop.train import TrainState, make_optimizer

    cfg = st.cfg
    arch = dataclasses.replace(st.arch, num_layers=layers)
    pol_gd, pol_abs = model.abstract(arch)
    pol = sharding.abstract_on_mesh(pol_abs, st.mesh)
    mtp_gd, mtp_abs = mtp_lib.abstract(
        arch, cfg.mtp.num_layers, _features_for(cfg.mtp.features, layers), cfg.mtp.depth
    )
    mtp = sharding.abstract_on_mesh(mtp_abs, st.mesh)
    opt = make_optimizer(cfg.rl.optim, cfg.rl.steps)
    mtp_opt = make_optimizer(cfg.rl.mtp_optim, cfg.rl.steps)
    mtp_train_opt = make_optimizer(cfg.mtp.optim, cfg.mtp.steps)

    def train_state(params, o):
        shapes = jax.eval_shape(lambda p: TrainState.create(p, o, 0), params)
        return sharding.abstract_like_params(shapes, params, st.mesh)

    return {
        "arch": arch,
        "pol_gd": pol_gd,
        "pol": pol,
        "mtp_gd": mtp_gd,
        "mtp": mtp,
        "opt": opt,
        "mtp_opt": mtp_opt,
        "mtp_train_opt": mtp_train_opt,
        "pol_state": train_state(pol, opt),
        "mtp_state": train_state(mtp, mtp_opt),
        "mtp_train_state": train_state(mtp, mtp_train_opt),
    }


def resident(st: Setup, s: dict, stage: str = "rl") -> dict:
    """Resident state per device (bytes) of a stage: what lives between its programs. `rl`: the
    policy's train state, the weight store's `rl.max_staleness + 2` published versions
    (`loop.WeightStore`), the MTP's train state (and the KL reference); `mtp`: the frozen policy
    and the MTP's train state; `distill`: the policy."""
    cfg = st.cfg
    params = nbytes_per_device(s["pol"])
    if stage == "distill":
        return {"params": params}
    if stage == "mtp":
        return {"params": params, "mtp": nbytes_per_device(s["mtp_train_state"])}
    pol_state = nbytes_per_device(s["pol_state"])
    keep = cfg.rl.max_staleness + 2
    out = {
        "params": params,
        "optimizer": pol_state - params,
        "weight_store": keep * (store_bytes(st, s["pol"]) + store_bytes(st, s["mtp"])),
        "mtp": nbytes_per_device(s["mtp_state"]),
    }
    if cfg.rl.kl_coef > 0:
        out["kl_reference"] = params
    return out


def store_bytes(st: Setup, params) -> int:
    """Bytes per device of one published copy of `params` (`loop.WeightStore`)."""
    import jax
    import jax.numpy as jnp

    from bebop.rl import loop

    if not hasattr(loop, "behaviour_copy"):  # a store of float32 snapshots
        return nbytes_per_device(params)
    dt = jnp.dtype(st.arch.dtype)  # behaviour versions in the decode dtype

    def one(x):
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        return jax.ShapeDtypeStruct(x.shape, dt if floating else x.dtype, sharding=x.sharding)

    return nbytes_per_device(jax.tree.map(one, params))


# ----------------------------------------------------------------------------- analytic


def kv_bytes(arch, rows_local: int, length: int, layers: int | None = None) -> int:
    """A KV cache's bytes for `rows_local` rows of `length` slots."""
    import numpy as np

    from bebop.model import DTYPES

    b = np.dtype(DTYPES[arch.dtype]).itemsize
    n = arch.num_layers if layers is None else layers
    return 2 * n * rows_local * arch.num_kv_heads * length * arch.head_dim * b


def decode_copy_bytes(arch, layers: int | None = None) -> int:
    """The decode copy (`model.decode_layers`): every block weight and the head, compute dtype,
    whole on each device (`sharding.decode_replicated`)."""
    import numpy as np

    from bebop.model import DTYPES

    b = np.dtype(DTYPES[arch.dtype]).itemsize
    n = arch.num_layers if layers is None else layers
    d, f, h, k, dh = arch.dim, arch.ffw_dim, arch.num_heads, arch.num_kv_heads, arch.head_dim
    per_layer = d * (h + 2 * k) * dh + h * dh * d + 3 * d * f + 2 * d + 2 * dh
    return (n * per_layer + d * arch.vocab_size) * b


def sampler_estimate(arch, rows_local: int, prompt: int, new: int, extra_len: int = 0) -> int:
    """Plain (and, with `extra_len`, speculative) sampler transients: the KV cache twice (the
    prefill's and the decode loop's state: XLA copies the loop's initial state; measured on
    XLA:CPU at float32, `tests/test_memory_plan.py`), the decode copy, the prefill's activations
    and a few [rows, V] float32 arrays (logits, log-probs, sampling). At bfloat16 XLA:CPU's
    figure is higher still: it writes a bfloat16 cache through a float32 scatter."""
    length = prompt + new + extra_len
    act = rows_local * prompt * (4 * arch.dim + 2 * arch.ffw_dim) * 4
    return (
        2 * kv_bytes(arch, rows_local, length)
        + decode_copy_bytes(arch)
        + act
        + 6 * rows_local * arch.vocab_size * 4
    )


def learner_estimate(
    arch, rows_local: int, seq: int, params_local: int, logit_chunk=0, kl=False, truncated=False
) -> int:
    """The learner step's transients: saved activations of every layer for the backward (compute
    dtype: block input, normed inputs, q/k/v, attention output, gate/up/hidden; float32 attention
    probabilities [H, T, T]), the float32 logits and their log-softmax / gradient, one layer's
    gathered float32 weights (twice: forward and backward), and float32 gradients and Adam
    update temporaries the size of the parameters."""
    import numpy as np

    from bebop.model import DTYPES

    b = np.dtype(DTYPES[arch.dtype]).itemsize
    d, f, h, k, dh = arch.dim, arch.ffw_dim, arch.num_heads, arch.num_kv_heads, arch.head_dim
    layer_w = 4 * (d * (h + 2 * k) * dh + h * dh * d + 3 * d * f)
    try:  # the learner's own per-row model (remat, attention, logit chunks), where there is one
        from bebop.rl.microbatch import learner_row_bytes
    except ImportError:
        learner_row_bytes = None
    if learner_row_bytes is not None:
        row = learner_row_bytes(arch, seq + 1, logit_chunk, kl, truncated)
        return rows_local * row + 2 * layer_w + 3 * params_local
    per_tok_layer = b * (4 * d + 3 * f + 2 * (h + 2 * k) * dh) + 4 * 2 * d
    scores = 4 * 2 * h * seq  # probabilities and scores, per token
    act = rows_local * seq * arch.num_layers * (per_tok_layer + scores)
    logits = 3 * rows_local * seq * arch.vocab_size * 4
    return act + logits + 2 * layer_w + 3 * params_local


# ----------------------------------------------------------------------------- programs


def programs(st: Setup, s: dict, names=None) -> dict:
    """{name: (jitted fn, args, kwargs, transient_args bytes, analytic estimate bytes or None,
    same-as name or None)} at the depth of `s`."""
    import jax
    import jax.numpy as jnp

    from bebop import model, sampling, sharding, speculative
    from bebop.mtp_losses import MTPBatch, mtp_loss
    from bebop.rl import learner, loop
    from bebop.train import make_train_step

    cfg, mesh, arch = st.cfg, st.mesh, s["arch"]
    nb = mesh.shape["data"] * mesh.shape["fsdp"]
    p, new = st.prompt_len, cfg.rollout.max_new_tokens
    rows = cfg.rl.prompts_per_step * cfg.rl.group_size
    width = p + new
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    scfg = scfg_of(st)
    out = {}

    def want(name):
        return names is None or name in names

    # learner step (per microbatch: `rl.microbatch` rows at a time inside the step)
    if want("learner_step"):
        build_kw = {}
        if hasattr(learner, "microbatch_rows"):  # `rl.microbatch=-1` sized for this mesh
            build_kw = dict(model_cfg=arch, batch_shards=nb)
        learn = learner.build(
            cfg,
            s["pol_gd"],
            s["mtp_gd"],
            scfg,
            None,
            s["opt"],
            s["mtp_opt"],
            None,
            None,
            **build_kw,
        )
        batch = loop.LearnerBatch(
            batch_sds(mesh, (rows, width), jnp.int32),
            batch_sds(mesh, (rows, width), jnp.float32),
            batch_sds(mesh, (rows, width), jnp.float32),
            batch_sds(mesh, (rows,), jnp.float32),
        )
        ref = s["pol"] if cfg.rl.kl_coef > 0 else None
        if hasattr(learner, "microbatch_rows"):
            mb = learner.microbatch_rows(cfg.rl, cfg.rollout, arch, width, nb)
        else:
            mb = cfg.rl.microbatch or rows
        st.microbatch = mb
        r = cfg.rollout
        est = learner_estimate(
            arch,
            max(mb // nb, 1),
            width - 1,
            nbytes_per_device(s["pol"]),
            getattr(cfg.rl, "logit_chunk", 0),
            cfg.rl.kl_coef > 0,
            bool(r.top_k) or r.top_p < 1.0,
        )
        out["learner_step"] = (
            learn.policy_step,
            (s["pol_state"], batch, ref),
            {"donate": (0,)},
            nbytes_per_device(batch),
            est,
            None,
        )
    if want("weight_publish"):
        if hasattr(loop, "behaviour_copy"):  # behaviour versions in the decode dtype

            def snap(tree):
                return jax.tree.map(lambda t: loop.behaviour_copy(t, arch.dtype), tree)

        else:
            snap = jax.jit(loop.snapshot)
        tree = (s["pol"], s["mtp"])
        out["weight_publish"] = (snap, (tree,), {}, 0, store_bytes(st, tree), None)
    toks = batch_sds(mesh, (rows, p), jnp.int32)
    lens = batch_sds(mesh, (rows,), jnp.int32)
    pol = (s["pol_gd"], s["pol"])
    rows_local = max(rows // nb, 1)
    if want("rollout_plain") or want("speed_comparison_plain"):
        args = (*pol, toks, lens, key, scfg)
        est = sampler_estimate(arch, rows_local, p, new)
        out["rollout_plain"] = (sampling.sample_jit, args, {}, 0, est, None)
        out["speed_comparison_plain"] = (None, None, None, 0, est, "rollout_plain")
    spec = None
    if cfg.rollout.mode != "plain":
        spec = speculative.SpecConfig(cfg.rollout.num_draft, cfg.rollout.mode)
    if spec is not None and (want("rollout_speculative") or want("speed_comparison_spec")):
        args = (*pol, s["mtp_gd"], s["mtp"], toks, lens, key, scfg, spec, None)
        est = sampler_estimate(arch, rows_local, p, new, spec.num_draft + 1)
        mtp_blocks = cfg.mtp.num_layers * cfg.mtp.depth
        est += kv_bytes(arch, rows_local, p + new + 2 * spec.num_draft + 2, mtp_blocks)
        out["rollout_speculative"] = (speculative.sample_jit, args, {}, 0, est, None)
        out["speed_comparison_spec"] = (None, None, None, 0, est, "rollout_speculative")
    if want("greedy_eval"):
        n_eval = cfg.rl.eval_samples
        rep = sharding.replicated(mesh)  # host arrays, as `rollout.greedy_accuracy` passes
        e_toks = jax.ShapeDtypeStruct((n_eval, p), jnp.int32, sharding=rep)
        e_lens = jax.ShapeDtypeStruct((n_eval,), jnp.int32, sharding=rep)
        gcfg = dataclasses.replace(scfg, temperature=0.0)
        est = sampler_estimate(arch, max(n_eval // nb, 1), p, new)
        out["greedy_eval"] = (
            sampling.sample_jit,
            (*pol, e_toks, e_lens, key, gcfg),
            {},
            0,
            est,
            None,
        )
    if "distill" in cfg.stages and want("distill_sampler"):
        n = cfg.distill.batch_size
        d_toks = batch_sds(mesh, (n, p), jnp.int32)
        d_lens = batch_sds(mesh, (n,), jnp.int32)
        layers = jax.eval_shape(functools.partial(model.decode_layers, s["pol_gd"]), s["pol"])
        rep = sharding.replicated(mesh)
        layers = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), layers
        )
        # the decode copy is made once for every batch (`distill.sample_responses`): an input
        est = sampler_estimate(arch, max(n // nb, 1), p, new)
        copy = nbytes_per_device(layers)
        if cfg.distill.draft_from:
            dspec = speculative.SpecConfig(cfg.rollout.num_draft, "rejection")
            args = (*pol, s["mtp_gd"], s["mtp"], d_toks, d_lens, key, scfg, dspec, None, layers)
            fn = speculative.sample_jit
        else:
            args = (*pol, d_toks, d_lens, key, scfg, layers)
            fn = sampling.sample_jit
        out["distill_sampler"] = (fn, args, {}, copy, est, None)
    if "mtp" in cfg.stages and want("mtp_train_step"):
        m = cfg.mtp
        seq = sampling.next_pow2(p) + new  # the distill set's width (`distill.sample_responses`)
        temp = cfg.rollout.temperature
        names_ = [m.loss] + (
            [m.warmup_loss] if m.warmup_loss_steps and m.warmup_loss != m.loss else []
        )
        for i, name in enumerate(names_):
            fn = make_train_step(
                mtp_loss(
                    *(s["pol_gd"], s["mtp_gd"], name, m.train_steps, m.chunk, temp, None),
                    *(cfg.rollout.top_k, cfg.rollout.top_p),
                ),
                s["mtp_train_opt"],
            )
            b = MTPBatch(
                batch_sds(mesh, (m.batch_size, seq), jnp.int32),
                batch_sds(mesh, (m.batch_size, seq), jnp.float32),
            )
            est = learner_estimate(
                arch, max(m.batch_size // nb, 1), seq, nbytes_per_device(s["pol"])
            )
            label = "mtp_train_step" if i == 0 else f"mtp_train_step_{name}_warmup"
            args = (s["mtp_train_state"], b, s["pol"])
            out[label] = (fn, args, {}, nbytes_per_device(b), est, None)
    return out


STAGE_OF = {"distill_sampler": "distill", "mtp_train_step": "mtp"}


def stage_of(name: str) -> str:
    return next((v for k, v in STAGE_OF.items() if name.startswith(k)), "rl")


def compile_at(st: Setup, layers: int, names=None, log=print) -> dict:
    """{name: Program} compiled at depth `layers` (aliases of another program copied)."""
    from bebop import sharding

    s = state_at(st, layers)
    progs = programs(st, s, names)
    res = {}
    with sharding.activation_mesh(st.mesh):
        for name, (fn, args, kwargs, transient_args, est, same) in progs.items():
            if same is not None:
                continue
            t0 = time.perf_counter()
            f = compile_figures(fn, args, kwargs)
            res[name] = Program(
                f["temp"], f["out"], f["alias"], f["args"], transient_args, est or 0
            )
            log(f"  compiled {name} at {layers} layers in {time.perf_counter() - t0:.0f} s")
    for name, (*_, same) in progs.items():
        if same is not None and same in res:
            res[name] = res[same]
    return res, s


def extrapolate(at: dict, depth: int) -> dict:
    """Linear in the depth through the two smallest compiled depths: {name: Program}."""
    (l0, p0), (l1, p1) = sorted(at.items())[:2]
    out = {}
    for name in p0:

        def lin(field, name=name):
            a, b = getattr(p0[name], field), getattr(p1[name], field)
            return int(round(a + (b - a) * (depth - l0) / (l1 - l0)))

        out[name] = Program(
            lin("temp"), lin("out"), lin("alias"), lin("args"), lin("transient_args"), 0
        )
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    set_device_count(args.devices)
    t_start = time.perf_counter()
    import jax

    from bebop import config as config_lib
    from bebop import sharding
    from bebop.checkpoints import hf
    from bebop.config import MeshConfig

    cfg, _ = config_lib.load(args.config, args.set)
    arch = hf.known_architecture(
        args.arch,
        dtype=cfg.model.dtype,
        param_dtype=cfg.model.param_dtype,
        scan_layers=cfg.model.scan_layers,
    )
    from bebop import policies

    knobs = getattr(policies, "RUN_KNOBS", ())  # how the run executes the architecture
    arch = dataclasses.replace(arch, **{k: getattr(cfg.model, k) for k in knobs})
    tpu = "tpu" in Path(args.config).name
    budget = args.budget_gb or (95.0 if tpu else 80.0)
    real = args.pod_devices or (64 if cfg.distributed.auto else args.devices)
    real_shape = sharding.mesh_shape(cfg.mesh, real)
    fsdp, tensor = real_shape[1], real_shape[2]
    if args.devices % (fsdp * tensor):
        raise SystemExit(f"--devices {args.devices} cannot hold fsdp={fsdp} x tensor={tensor}")
    fake_data = args.devices // (fsdp * tensor)
    scale = fake_data / real_shape[0]
    mesh = sharding.make_mesh(MeshConfig(data=fake_data, fsdp=fsdp, tensor=tensor))
    one_process = not cfg.distributed.auto
    st = Setup(scaled_config(cfg, scale), arch, mesh, scale, args.prompt_len)
    machine = f"{jax.device_count()} fake CPU devices, mesh {dict(mesh.shape)}"
    if real != args.devices:
        machine += (
            f", standing for {real} devices (mesh data={real_shape[0]}, fsdp={fsdp}, "
            f"tensor={tensor}): every batch scaled by {scale:g}, so per-device shapes match"
        )
    print(f"{args.config} {args.arch}: {machine}; budget {budget:g} GB per device")
    names = set(args.programs.split(",")) if args.programs else None
    depths = [int(x) for x in args.layers.split(",")]
    at = {}
    for depth in depths:
        at[depth], s_small = compile_at(st, depth, names)
    full = arch.num_layers
    if len(depths) == 1:
        progs = at[depths[0]]
    else:
        progs = extrapolate(at, full)
    check = {}
    if args.check_layers:
        real_at, _ = compile_at(st, args.check_layers, names)
        pred = extrapolate(at, args.check_layers)
        for name, prog in real_at.items():
            check[name] = (pred[name].transient - prog.transient) / max(prog.transient, 1)
    s_full = state_at(st, full)
    res = resident(st, s_full)
    stage_res = {k: sum(resident(st, s_full, k).values()) for k in ("rl", "mtp", "distill")}
    est = programs(st, s_full, names)
    resident_total = sum(res.values())
    rows = {}
    for name, prog in progs.items():
        rows[name] = {
            "stage": stage_of(name),
            "peak_gb": (stage_res[stage_of(name)] + prog.transient) / GB,
            "transient_gb": prog.transient / GB,
            "temp_gb": prog.temp / GB,
            "estimate_gb": (est[name][4] or 0) / GB,
        }
    # one process: the rollout worker's sampler runs while the learner steps (with staleness)
    if one_process and st.cfg.rl.max_staleness > 0 and "learner_step" in progs:
        roll = "rollout_speculative" if "rollout_speculative" in progs else "rollout_plain"
        if roll in progs:
            both = progs["learner_step"].transient + progs[roll].transient
            rows["learner + rollout"] = {
                "stage": "rl",
                "peak_gb": (resident_total + both) / GB,
                "transient_gb": both / GB,
                "temp_gb": (progs["learner_step"].temp + progs[roll].temp) / GB,
                "estimate_gb": ((est["learner_step"][4] or 0) + (est[roll][4] or 0)) / GB,
            }
    peak = max(r["peak_gb"] for r in rows.values())
    target = 0.9 * budget
    if st.microbatch:
        mb_dev = st.microbatch // (fake_data * fsdp)
        print(f"learner microbatch: {st.microbatch} rows of the fake mesh ({mb_dev} per device)")
    print(f"\nresident state per device ({full} layers), rl stage:")
    for k, v in res.items():
        print(f"  {k:<28} {v / GB:8.2f} GB")
    print(f"  {'total':<28} {resident_total / GB:8.2f} GB")
    print(
        f"  (mtp stage: {stage_res['mtp'] / GB:.2f} GB: frozen policy + MTP train state; "
        f"distill stage: {stage_res['distill'] / GB:.2f} GB: the policy)"
    )
    r0 = st.cfg.rl.prompts_per_step * st.cfg.rl.group_size // (fake_data * fsdp)
    length = st.prompt_len + st.cfg.rollout.max_new_tokens
    print(
        f"inside the samplers: KV cache {kv_bytes(arch, r0, length) / GB:.2f} GB "
        f"({r0} rows x {length} slots per device), decode copy "
        f"{decode_copy_bytes(arch) / GB:.2f} GB (whole on every device)"
    )
    print(f"\n{'program (stage)':<40}{'temp':>8}{'transient':>11}{'estimate':>10}{'peak':>8}  fits")
    for name, r in rows.items():
        ok = "yes" if r["peak_gb"] <= budget else "NO"
        label = f"{name} ({r['stage']})"
        print(
            f"{label:<40}{r['temp_gb']:8.2f}{r['transient_gb']:11.2f}{r['estimate_gb']:10.2f}"
            f"{r['peak_gb']:8.2f}  {ok}"
        )
    how = f"compiled at {depths} layers, extrapolated linearly to {full}"
    if check:
        worst = max(check.items(), key=lambda kv: abs(kv[1]))
        how += (
            f"; at {args.check_layers} layers the extrapolation is off by at most "
            f"{100 * abs(worst[1]):.1f} % ({worst[0]})"
        )
    print(
        f"\n{how}. GB = 1e9 bytes per device. Peak = the stage's resident state + transient. "
        "Estimates are analytic (accelerator layout); temp and transient are XLA:CPU's."
    )
    print(f"budget {budget:g} GB, target {target:g} GB (90 %): peak {peak:.2f} GB")
    wall = time.perf_counter() - t_start
    result = {
        "config": args.config,
        "arch": args.arch,
        "machine": machine,
        "programs": {
            k: {kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in v.items()}
            for k, v in rows.items()
        },
        "resident_gb": round(resident_total / GB, 3),
        "resident": {k: round(v / GB, 3) for k, v in res.items()},
        "peak_gb": round(peak, 3),
        "budget_gb": budget,
        "target_gb": target,
        "fits": peak <= budget,
        "meets_target": peak <= target,
        "layers_compiled": depths,
        "learner_microbatch_per_device": st.microbatch // (fake_data * fsdp),
        "linearity_error": {k: round(v, 4) for k, v in check.items()},
        "wall_s": round(wall, 1),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
