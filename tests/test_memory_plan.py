"""`benchmarks.memory` at toy shapes on 8 fake CPU devices: its analytic estimates agree with
XLA's compiled figures, its resident state is what the arrays hold, the linear extrapolation in
depth holds, and the architecture tables build the published Qwen3 models."""

import jax
import numpy as np
import pytest

from bebop import config as config_lib
from bebop import model, sharding
from bebop.checkpoints import hf
from bebop.config import MeshConfig, ModelConfig
from benchmarks import memory

from .conftest import REPO

# float32: XLA:CPU writes a bfloat16 KV cache through a float32 scatter, which the estimate
# (an accelerator's layout) leaves out.
ARCH = ModelConfig(
    vocab_size=256,
    dim=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    ffw_dim=128,
    qk_norm=True,
)
PROGRAMS = {"learner_step", "rollout_plain", "weight_publish"}


def _setup(devices, **arch):
    overrides = [
        "rollout.max_new_tokens=240",
        "rl.prompts_per_step=8",
        "rl.group_size=8",
        "rl.microbatch=0",
        "distill.batch_size=16",
        "mtp.batch_size=16",
        "rl.eval_samples=16",
    ]
    cfg, _ = config_lib.load(str(REPO / "configs/qwen3_gpu.py"), overrides)
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=8), devices)
    arch = ModelConfig(**{**ARCH.__dict__, **arch})
    return memory.Setup(cfg, arch, mesh, 1.0, 16)


@pytest.fixture(scope="module")
def toy(devices):
    st = _setup(devices)
    at = {n: memory.compile_at(st, n, PROGRAMS, log=lambda *a: None) for n in (2, 4, 6)}
    return st, at


@pytest.mark.slow
def test_estimates_within_15_percent_of_compiled(toy):
    """Learner step (64 rows of 256 tokens over 8 devices), plain sampler (8 rows a device, 256
    cache slots) and weight publish: analytic transient / XLA's transient in [0.85, 1.15]."""
    st, at = toy
    compiled, s = at[2]
    est = memory.programs(st, s, PROGRAMS)
    for name in PROGRAMS:
        ratio = est[name][4] / compiled[name].transient
        assert 0.85 <= ratio <= 1.15, (name, est[name][4], compiled[name].transient)


def test_resident_state_is_what_the_programs_take(toy):
    """The resident parameters per device are the weight publish's compiled argument bytes, and
    a sharded train state holds about an eighth of the whole on each of 8 devices."""
    st, at = toy
    compiled, s = at[2]
    res = memory.resident(st, s)
    mtp = memory.nbytes_per_device(s["mtp"])
    assert compiled["weight_publish"].args == res["params"] + mtp
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(s["pol"]))
    assert res["params"] < whole / 4  # split: norms and undividable dims stay whole


def test_linear_in_depth(toy):
    """The transients extrapolated from 2 and 4 layers to 6 are within 5 % of the compiled 6."""
    _, at = toy
    pred = memory.extrapolate({2: at[2][0], 4: at[4][0]}, 6)
    for name, prog in at[6][0].items():
        assert abs(pred[name].transient - prog.transient) <= 0.05 * prog.transient, name


def test_qwen3_architecture_tables():
    """The shipped tables give the published sizes: 4.02 B parameters (tied) and 8.19 B."""
    sizes = {}
    for name in ("qwen3-4b", "qwen3-8b"):
        cfg = hf.known_architecture(name)
        assert cfg.qk_norm and cfg.vocab_size == 151936 and cfg.num_layers == 36
        sizes[name] = model.num_params(model.abstract(cfg)[1])
    assert abs(sizes["qwen3-4b"] / 1e9 - 4.02) < 0.01
    assert abs(sizes["qwen3-8b"] / 1e9 - 8.19) < 0.01
    with pytest.raises(hf.CheckpointError, match="unknown architecture"):
        hf.known_architecture("qwen3-9b")


def test_kv_cache_estimate_matches_the_sampler_cache(devices):
    """`kv_bytes` is the bytes of the cache `model.new_cache` makes, per device."""
    st = _setup(devices)
    rows, length = 64, 100
    cache = jax.eval_shape(lambda: model.new_cache(st.arch, rows, length))
    whole = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves((cache.k, cache.v)))
    assert memory.kv_bytes(st.arch, rows // 8, length) * 8 == whole
