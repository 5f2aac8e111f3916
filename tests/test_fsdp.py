"""Data / FSDP parallelism on 8 fake CPU devices, read from the compiled programs: the learner
step's activations are split over the devices (`memory_analysis()`), its HLO all-reduces no
activation-sized tensor, and the samplers of the end-of-RL speed comparison hold nothing
batch-sized whole on a device."""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bebop import model, sampling, sharding, speculative
from bebop import mtp as mtp_lib
from bebop.config import MeshConfig, ModelConfig, OptimConfig
from bebop.rl import grpo, loop
from bebop.rl import rollouts as rl_rollouts
from bebop.sampling import SamplingConfig
from bebop.train import TrainState, make_optimizer, make_train_step

# Every weight (at most 64 x 96 = 6,144 elements) is smaller than one device's share of an
# activation ([32 / 8 rows, 40 tokens, 64] = 10,240), so an all-reduce at least that large is
# an activation's.
CFG = ModelConfig(
    vocab_size=64, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffw_dim=96
)
ROWS, SEQ = 32, 41


def _learner_step(n: int, pinned: bool):
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=n), jax.devices()[:n])
    graphdef, abstract = model.abstract(CFG)
    params = sharding.abstract_on_mesh(abstract, mesh)
    opt = make_optimizer(OptimConfig(lr=1e-3), 10)
    state = jax.eval_shape(lambda p: TrainState.create(p, opt, 0), params)
    state = sharding.abstract_like_params(state, params, mesh)

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(
            shape, dtype, sharding=sharding.batch_sharding(mesh, len(shape), shape[0])
        )

    batch = loop.LearnerBatch(
        sds((ROWS, SEQ), jnp.int32),
        sds((ROWS, SEQ), jnp.float32),
        sds((ROWS, SEQ), jnp.float32),
        sds((ROWS,), jnp.float32),
    )
    scfg = SamplingConfig()

    def loss(p, b, _, ref):
        return grpo.policy_loss(graphdef, p, b, 0.2, 0.28, 0.0, "token", scfg, ref)

    step = make_train_step(loss, opt, jit=False)
    # a fresh function per call: a program traced without pins is never reused with them
    with sharding.activation_mesh(mesh if pinned else None):
        return jax.jit(lambda s, b: step(s, b, None)).lower(state, batch).compile()


def _all_reduce_sizes(hlo: str) -> list[int]:
    """Element counts of every all-reduce operand (tuple all-reduces: each element)."""
    sizes = []
    for line in hlo.splitlines():
        m = re.search(r"= (.*?) all-reduce(?:-start)?\(", line)
        if m is None:
            continue
        for dims in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", m.group(1)):
            sizes.append(int(np.prod([int(d) for d in dims.split(",") if d] or [1])))
    return sizes


@pytest.fixture(scope="module")
def learner_programs(devices):
    return {(n, p): _learner_step(n, p) for n, p in ((1, True), (8, True), (8, False))}


@pytest.mark.slow
def test_fsdp_learner_activations_split_over_devices(learner_programs):
    """Per-device temporaries of the learner step (its activations, logits and gradients) fall
    at least 6x from 1 to 8 devices (batch 32 split 8 ways; measured 7.5x)."""
    one = learner_programs[(1, True)].memory_analysis().temp_size_in_bytes
    eight = learner_programs[(8, True)].memory_analysis().temp_size_in_bytes
    assert one / eight >= 6.0, (one, eight)


def test_fsdp_step_all_reduces_no_activation(learner_programs):
    """With the pins the step gathers weights and reduces gradients (weight-sized) but never
    all-reduces an activation; without them GSPMD split activations along the model width and
    all-reduced whole-batch matmul outputs (the check sees that, so it can fail)."""
    activation = ROWS // 8 * (SEQ - 1) * CFG.dim
    pinned = _all_reduce_sizes(learner_programs[(8, True)].as_text())
    assert pinned and max(pinned) < activation, sorted(pinned)[-5:]
    assert "all-gather" in learner_programs[(8, True)].as_text()  # weights gathered per layer
    unpinned = _all_reduce_sizes(learner_programs[(8, False)].as_text())
    assert max(unpinned) >= activation


def _shapes(hlo: str):
    """Every array shape in an HLO text, as tuples of ints."""
    for dims in re.findall(r"\b(?:f32|bf16|s32|u32|pred|f16|u8|s8)\[([0-9,]+)\]", hlo):
        yield tuple(int(d) for d in dims.split(","))


@pytest.mark.slow
def test_speed_comparison_holds_nothing_batch_sized_whole(devices):
    """The speed comparison's prompts are laid out by rows (`rl.rollouts.speedup_inputs`), and in
    both compiled samplers no array has the whole batch on one device unless it is small
    (tokens, log-probs: rows x slots): KV caches, hiddens and logits are split."""
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=4), devices)
    stub = types.SimpleNamespace(  # what `speedup_inputs` reads of a `rl.rollouts.Rollouts`
        mesh=mesh,
        cfg=types.SimpleNamespace(rollout=types.SimpleNamespace(compact=False)),
        tok=types.SimpleNamespace(pad_id=0),
    )
    rows, new = 40, 8  # 5 rows a device; no weight dimension is 40
    rng = np.random.default_rng(0)
    ids = [list(rng.integers(1, CFG.vocab_size, 5 + r % 3)) for r in range(rows)]
    toks, lens = rl_rollouts.speedup_inputs(stub, ids)
    assert toks.sharding.spec[0] == ("data", "fsdp") and lens.sharding.spec[0] == ("data", "fsdp")
    graphdef, params = model.init(CFG, 0)
    params = sharding.place_state(params, mesh)
    mtp_gd, mtp_params = mtp_lib.init(CFG, 1, 1)
    mtp_params = sharding.place_state(mtp_params, mesh)
    scfg = SamplingConfig(max_new_tokens=new, eos_ids=(1,), pad_id=0)
    spec = speculative.SpecConfig(2, "rejection")
    key = jax.random.key(0)
    slots = toks.shape[1] + new + 4
    limit = rows * slots * 4  # tokens / log-probs / statuses of every row are allowed
    with sharding.activation_mesh(mesh):
        plain = jax.jit(lambda *a: sampling.sample(*a), static_argnums=(0, 5))
        spec_fn = jax.jit(lambda *a: speculative.sample(*a), static_argnums=(0, 2, 7, 8))
        hlos = {
            "plain": plain.lower(graphdef, params, toks, lens, key, scfg).compile().as_text(),
            "spec": spec_fn.lower(graphdef, params, mtp_gd, mtp_params, toks, lens, key, scfg, spec)
            .compile()
            .as_text(),
        }
    for name, hlo in hlos.items():
        whole = [s for s in _shapes(hlo) if s[0] == rows and np.prod(s) > limit]
        assert not whole, (name, whole[:5])
        # the per-device KV cache layer: [rows / 8, kv heads, slots, head dim]
        assert any(s[:2] == (rows // 8, CFG.num_kv_heads) and len(s) == 4 for s in _shapes(hlo))
