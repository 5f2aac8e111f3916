"""Mixed precision (`model.dtype` = compute, `model.param_dtype` = stored weights): float32 master
weights learn at RL learning rates where bfloat16 ones cannot; the bf16-compute forward stays
close to the float32 one; the sampler's KV cache is bf16 and its log-probs float32; loaders store
weights in the parameter dtype; bad values name their key."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from bebop import config as config_lib
from bebop import model, sampling, sharding
from bebop import mtp as mtp_lib
from bebop.checkpoints import hf
from bebop.config import ConfigError, MeshConfig, ModelConfig, OptimConfig
from bebop.train import TrainState, make_optimizer, make_train_step, token_cross_entropy

from .conftest import REPO

LR = 1e-6
# Same tiny shape as conftest's `tiny_cfg`; init_std 0.1 gives logits up to ~2.5, so argmax is
# mostly away from ties (0.02 leaves them near-uniform).
F32 = ModelConfig(
    vocab_size=23,
    dim=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    ffw_dim=48,
    init_std=0.1,
    qk_norm=True,
    qkv_bias=True,
)
MIXED = dataclasses.replace(F32, dtype="bfloat16")  # param_dtype float32 (the default)
TOKENS = jax.random.randint(jax.random.key(1), (8, 32), 0, F32.vocab_size)
_forward = jax.jit(model.forward, static_argnums=0)


def _loss(graphdef):
    def loss_fn(params, batch, rng):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        pos = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
        logits = model.forward(graphdef, params, inputs, pos)[0]
        return token_cross_entropy(logits, targets, jnp.ones(targets.shape)), {}

    return loss_fn


def _one_step(cfg):
    """(params before, state after) of one AdamW step at lr 1e-6 on a fixed batch. Unrolled
    layers: this train step compiled faster than scanned on CPU (2 layers)."""
    cfg = dataclasses.replace(cfg, scan_layers=False)
    graphdef, params = model.init(cfg, seed=0)
    optim = OptimConfig(lr=LR, warmup_steps=0, schedule="constant", weight_decay=0.0)
    optimizer = make_optimizer(optim, total_steps=10)
    before = jax.tree.map(lambda a: np.asarray(a.astype(jnp.float32)), params)
    state = TrainState.create(params, optimizer, seed=0)
    batch = TOKENS[:4, :16]
    state, metrics = make_train_step(_loss(graphdef), optimizer, donate=False)(state, batch)
    assert int(metrics["skipped"]) == 0
    return before, state


def _grad(state):
    """The (clipped) gradient the first AdamW step used: its first moment is (1 - b1) g."""
    return _flat(optax.tree.get(state.opt_state, "mu")) / 0.1


def _flat(tree):
    return np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(tree)])


@pytest.mark.slow
def test_float32_masters_learn_at_rl_lr_and_bf16_params_do_not(tiny_cfg):
    """AdamW's first step is lr * m/(sqrt(v)+eps) = lr * sign(g) (bias-corrected, |g| >> eps,
    no weight decay here): every float32 master weight with a gradient moves by ~1e-6. The same
    step on bfloat16 parameters (the old `model.dtype=bfloat16`) rounds back to the old value
    almost everywhere (bf16's spacing at 0.02 is 1.2e-4). Measured: float32 masters, median
    |Δ| = 1.0002e-6 over the 99.6 % of 16,256 weights with |g| > 1e-6, all signs against g;
    bf16 parameters: 1.8 % of them move, median |Δ| = 0."""
    before, state = _one_step(dataclasses.replace(tiny_cfg, dtype="bfloat16"))
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(state.opt_state) if x.ndim} == {jnp.dtype(jnp.float32)}
    delta, g = _flat(state.params) - _flat(before), _grad(state)
    has_grad = np.abs(g) > 1e-6
    assert has_grad.mean() > 0.5  # most weights take part
    median = float(np.median(np.abs(delta[has_grad])))
    assert abs(median - LR) <= 0.1 * LR, median
    # The step goes down the gradient: sign(delta) = -sign(g) nearly everywhere.
    assert np.mean(np.sign(delta[has_grad]) == -np.sign(g[has_grad])) > 0.99

    before16, state16 = _one_step(
        dataclasses.replace(tiny_cfg, dtype="bfloat16", param_dtype="bfloat16")
    )
    delta16 = _flat(state16.params) - _flat(before16)
    moved16 = np.abs(_grad(state16)) > 1e-6
    assert float(np.median(np.abs(delta16[moved16]))) == 0.0
    assert np.mean(delta16[moved16] != 0) < 0.05  # only weights within ~2.5e-4 of zero move


def test_bf16_compute_forward_matches_float32():
    """Same float32 parameters, forward in bf16 vs float32 over 8x32 random tokens. Measured
    (CPU): max |Δ logit| = 1.2e-2 x max |logit| (2.5), argmax agreement 98.8 %. Tolerance:
    3e-2 x max |logit| and >= 95 % argmax agreement."""
    graphdef32, params = model.init(F32, seed=0)
    graphdef16, _ = model.init(MIXED, seed=0)
    pos = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
    l32 = np.asarray(_forward(graphdef32, params, TOKENS, pos)[0])
    l16, hidden16 = _forward(graphdef16, params, TOKENS, pos)
    assert l16.dtype == jnp.float32 and hidden16.dtype == jnp.bfloat16
    err = float(np.abs(np.asarray(l16) - l32).max())
    assert 0 < err <= 3e-2 * float(np.abs(l32).max()), err  # > 0: the bf16 path really ran
    assert np.mean(np.asarray(l16).argmax(-1) == l32.argmax(-1)) >= 0.95


@pytest.mark.slow
def test_bf16_sampler_kv_cache_and_float32_logprobs():
    """The decode copy of float32 weights is bf16, the KV cache after the sampler's prefill is
    bf16 (dtypes by tracing: no compile), and the sampler's behaviour log-probs are float32 and
    agree with the learner's bf16-compute forward (the same rounded weights). Measured on CPU
    over 8 x 12 sampled tokens (mean |log-prob| 2.9): max |Δ log-prob| = 8.8e-3 (bf16
    activations round differently in the decode layout; 2.1e-2 against a float32 learner);
    bound 3e-2."""
    graphdef, params = model.init(MIXED, seed=0)
    layers = jax.eval_shape(functools.partial(model.decode_layers, graphdef), params)
    assert {x.dtype for x in jax.tree.leaves(layers)} == {jnp.dtype(jnp.bfloat16)}
    rows, p, n = TOKENS.shape[0], 8, 12
    prompts = TOKENS[:, :p]
    lens = jnp.array([8, 5, 3, 8, 1, 2, 7, 6])
    prefill = functools.partial(model.prefill_last, graphdef, max_len=p + n)
    _, _, cache = jax.eval_shape(prefill, params, prompts, lens)
    assert {x.dtype for x in (*cache.k, *cache.v)} == {jnp.dtype(jnp.bfloat16)}

    scfg = sampling.SamplingConfig(max_new_tokens=n, eos_ids=(F32.vocab_size,), pad_id=0)
    out = sampling.sample_jit(graphdef, params, prompts, lens, jax.random.key(3), scfg)
    assert out.logprobs.dtype == jnp.float32 and out.entropy.dtype == jnp.float32
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    # The learner's log-probs of the sampled tokens: one full forward over prompt + completion,
    # padded to TOKENS' shape (the forward compiled for the parity test).
    seqs = np.zeros(TOKENS.shape, np.int32)
    for r in range(rows):
        seqs[r, : lens[r]] = prompts[r, : lens[r]]
        seqs[r, lens[r] : lens[r] + n] = out.tokens[r]
    pos = jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape)
    logp = jax.nn.log_softmax(_forward(graphdef, params, jnp.asarray(seqs), pos)[0], axis=-1)
    learner = np.stack(
        [
            np.asarray(logp[r, np.arange(lens[r] - 1, lens[r] + n - 1), out.tokens[r]])
            for r in range(rows)
        ]
    )
    err = float(np.abs(learner - np.asarray(out.logprobs)).max())
    assert err < 3e-2, err


def test_loaders_store_the_parameter_dtype(tmp_path):
    """An HF directory loads with float32 weights (policy and shipped MTP) under bf16 compute,
    and in bf16 only when `param_dtype` says so."""
    graphdef, params = model.init(F32, seed=0)
    _, mparams = mtp_lib.init(F32, 1, seed=1)
    hf.export(tmp_path, F32, params, "qwen3", mparams, "qwen3_5")
    mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    loaded = hf.load(tmp_path, mesh, dtype="bfloat16")
    assert loaded.cfg.dtype == "bfloat16" and loaded.cfg.param_dtype == "float32"
    for tree in (loaded.params, loaded.mtp[1]):
        assert {x.dtype for x in jax.tree.leaves(tree)} == {jnp.dtype(jnp.float32)}
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded.params), strict=True):
        np.testing.assert_array_equal(a, b)  # float32 weights round-trip exactly
    low = hf.load(tmp_path, mesh, dtype="bfloat16", param_dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(low.params)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("key", ["dtype", "param_dtype"])
def test_bad_dtype_names_its_key(key):
    with pytest.raises(ConfigError, match=rf"model\.{key}'.*'float16'"):
        ModelConfig(**{key: "float16"}).validate()
    with pytest.raises(ConfigError, match=rf"model\.{key}"):
        config_lib.load(str(REPO / "configs/demo.py"), [f"model.{key}=float8"])


def test_pod_configs_compute_in_bf16_with_float32_masters():
    for name in ("qwen3_gpu", "qwen3_tpu_pod"):
        cfg, _ = config_lib.load(str(REPO / f"configs/{name}.py"), [])
        assert (cfg.model.dtype, cfg.model.param_dtype) == ("bfloat16", "float32"), name


def test_mtp_layer_computes_in_bf16_from_float32_weights():
    """The MTP layer (the policy's block type) under bf16 compute: float32 weights, bf16 outputs
    and cache (by tracing), and draft logits through the policy's bf16 decode head equal those
    through its float32 `head` (the same rounded values, float32 accumulation)."""
    pol_gd, pol_params = model.init(MIXED, seed=0)
    mtp_gd, mtp_params = mtp_lib.init(MIXED, 1, seed=1)
    assert {x.dtype for x in jax.tree.leaves(mtp_params)} == {jnp.dtype(jnp.float32)}

    def draft(pol_params, mtp_params):
        policy, mtp = nnx.merge(pol_gd, pol_params), nnx.merge(mtp_gd, mtp_params)
        hid = policy.hidden(TOKENS[:2, :6], jnp.broadcast_to(jnp.arange(6), (2, 6)))[0]
        cache = mtp_lib.new_cache(MIXED, 1, 2, 16)
        return mtp_lib.extend(mtp, policy, 0, cache, hid, TOKENS[:2, 1:7])

    out, normed, cache = jax.eval_shape(draft, pol_params, mtp_params)
    assert out.dtype == normed.dtype == cache.k[0].dtype == cache.v[0].dtype == jnp.bfloat16
    policy = nnx.merge(pol_gd, pol_params)
    normed = jax.random.normal(jax.random.key(4), (2, 6, MIXED.dim)).astype(jnp.bfloat16)
    head_DxV = model.decode_layers_jit(pol_gd, pol_params).head_DxV
    via_decode_head = mtp_lib.logits(policy, normed, head_DxV)
    via_head = mtp_lib.logits(policy, normed)
    assert via_decode_head.dtype == via_head.dtype == jnp.float32
    np.testing.assert_allclose(via_decode_head, via_head, atol=1e-5)
