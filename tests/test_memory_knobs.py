"""The learner's memory knobs change memory, not values: chunked / dot-product attention
(`model.attention`), per-block rematerialisation (`model.remat`), sequence-chunked log-probs,
entropy and KL (`rl.logit_chunk`), microbatches chosen from a memory budget (`rl.microbatch=-1`),
behaviour weights kept in the decode dtype, and train step / samplers compiled once per shape."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bebop import config as config_lib
from bebop import model, sampling, sharding, speculative
from bebop import mtp as mtp_lib
from bebop.config import ConfigError, MeshConfig, OptimConfig
from bebop.rl import grpo, learner, loop, microbatch
from bebop.sampling import SamplingConfig
from bebop.train import TrainState, make_optimizer, make_train_step

from .conftest import REPO
from .helpers import random_policy

T1 = SamplingConfig(temperature=1.0)
TRUNC = SamplingConfig(temperature=0.7, top_k=7, top_p=0.8)


def _cfg(tiny_cfg, **kw):
    return dataclasses.replace(tiny_cfg, qk_norm=True, **kw)


def _tokens(cfg, rows=4, width=13, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, width)), jnp.int32)


def _close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol)


def _max_diff(a, b):
    return max(
        float(jnp.abs(x - y).max())
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _loss_and_grad(cfg, params, tokens):
    gd = model.abstract(cfg)[0]  # the same parameters under `cfg`'s knobs

    def loss(p):
        pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        logits, _ = model.forward(gd, p, tokens, pos)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * jnp.cos(logits[..., 1]))

    return jax.jit(jax.value_and_grad(loss))(params)


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("chunk", [4, 5, 13, 64])
def test_chunked_attention_equals_attend_for_any_positions(chunk):
    """Right-padded rows (positions restart) and a T that the chunk does not divide."""
    b, t, h, k, dh = 3, 13, 4, 2, 8
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, t, h, dh))
    kk = jax.random.normal(keys[1], (b, k, t, dh))
    v = jax.random.normal(keys[2], (b, k, t, dh))
    pos = jnp.stack([jnp.arange(t), jnp.minimum(jnp.arange(t), 6), jnp.arange(t)[::-1]])
    want = model.attend(q, kk, v, pos[:, None, :] <= pos[:, :, None])
    got = model.attend_chunked(q, kk, v, pos, pos, chunk)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["chunked", "dot_product"])
@pytest.mark.parametrize("scan", [True, False])
def test_attention_choices_equal_xla_forward_and_gradient(tiny_cfg, attention, scan):
    base = _cfg(tiny_cfg, scan_layers=scan)
    _, params = random_policy(base, 0)
    tokens = _tokens(base)
    want = _loss_and_grad(base, params, tokens)
    got = _loss_and_grad(
        dataclasses.replace(base, attention=attention, attention_chunk=4), params, tokens
    )
    assert (
        abs(float(want[0])) > 1e-4
        and _max_diff(want[1], jax.tree.map(jnp.zeros_like, want[1])) > 1e-4
    )
    _close(got, want)


# ----------------------------------------------------------------------------- remat


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["block", "dots_saveable", "nothing_saveable"])
@pytest.mark.parametrize("scan", [True, False])
def test_remat_leaves_loss_and_gradients_unchanged(tiny_cfg, remat, scan):
    base = _cfg(tiny_cfg, scan_layers=scan)
    _, params = random_policy(base, 1)
    tokens = _tokens(base)
    want = _loss_and_grad(base, params, tokens)
    got = _loss_and_grad(dataclasses.replace(base, remat=remat), params, tokens)
    _close(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, False])
def test_remat_lowers_the_compiled_backwards_memory(tiny_cfg, scan):
    """XLA's own figure for the gradient program (`memory_analysis`): block remat keeps less
    than no remat (so the knob is not silently ignored), at 4 layers x 4 rows x 96 tokens."""
    base = _cfg(tiny_cfg, scan_layers=scan, num_layers=4)
    _, params = random_policy(base, 1)
    tokens = _tokens(base, rows=4, width=96)

    def temp_bytes(cfg):
        gd = model.abstract(cfg)[0]
        pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        fn = jax.jit(jax.grad(lambda p: jnp.sin(model.forward(gd, p, tokens, pos)[0]).sum()))
        return fn.lower(params).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(dataclasses.replace(base, remat="block")) < 0.7 * temp_bytes(base)


# ----------------------------------------------------------------------------- chunked log-probs


def _learner_batch(cfg, pol, rows=4, width=13):
    rng = np.random.default_rng(5)
    tokens = _tokens(cfg, rows, width, seed=5)
    logp, _ = grpo.token_logprobs(*pol, tokens, T1)
    mask = np.zeros((rows, width), np.float32)
    for r in range(rows):
        mask[r, 3 : 5 + (r * 3) % (width - 5)] = 1.0
    shift = rng.normal(0, 0.3, (rows, width)).astype(np.float32)
    adv = rng.normal(0, 1, rows).astype(np.float32)
    return loop.LearnerBatch(tokens, jnp.asarray(mask), logp + shift, jnp.asarray(adv))


@pytest.mark.slow
@pytest.mark.parametrize("scfg", [T1, TRUNC], ids=["t1", "t0.7_topk_topp"])
@pytest.mark.parametrize("chunk", [1, 5, 12, 40])
def test_chunked_token_stats_equal_unchunked(tiny_cfg, scfg, chunk):
    cfg = _cfg(tiny_cfg)
    gd, params = random_policy(cfg, 2)
    _, ref_params = random_policy(cfg, 3)
    tokens = _tokens(cfg, width=13)
    logits = grpo._logits(gd, params, tokens)
    logp, ent = grpo._token_stats(logits, tokens, scfg)
    kl = grpo.k3_kl(logits, grpo._logits(gd, ref_params, tokens), tokens, scfg)
    c_logp, c_ent, c_kl = jax.jit(
        lambda p, r: grpo.chunked_token_stats(gd, p, tokens, scfg, chunk, r)
    )(params, ref_params)
    assert c_logp.shape == tokens.shape and float(kl.max()) > 1e-3
    if scfg is TRUNC:  # the truncation is live: the support leaves out some of the vocabulary
        assert bool(jnp.isinf(sampling.stats_logprobs(logits, scfg)).any())
    np.testing.assert_array_equal(np.isinf(c_logp), np.isinf(logp))
    fin = np.isfinite(np.asarray(logp))
    np.testing.assert_allclose(np.asarray(c_logp)[fin], np.asarray(logp)[fin], atol=1e-5)
    np.testing.assert_allclose(np.asarray(c_ent), np.asarray(ent), atol=1e-5)
    np.testing.assert_allclose(np.asarray(c_kl), np.asarray(kl), atol=1e-5, rtol=1e-5)
    _, _, none = grpo.chunked_token_stats(gd, params, tokens, scfg, chunk)
    assert none is None


@pytest.mark.slow
@pytest.mark.parametrize("kl_coef", [0.0, 0.5])
def test_chunked_policy_loss_equals_unchunked_loss_metrics_and_gradient(tiny_cfg, kl_coef):
    cfg = _cfg(tiny_cfg)
    gd, params = random_policy(cfg, 4)
    _, ref_params = random_policy(cfg, 6)
    scfg = SamplingConfig(temperature=0.9, top_p=0.95)
    batch = _learner_batch(cfg, (gd, params))

    def run(chunk):
        def loss(p):
            return grpo.policy_loss(
                gd, p, batch, 0.2, 0.28, kl_coef, "token", scfg, ref_params, logit_chunk=chunk
            )

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (l0, m0), g0 = run(0)
    (l1, m1), g1 = run(5)
    assert abs(float(l0)) > 1e-3
    if kl_coef:
        assert float(m0["kl"]) > 1e-3
    np.testing.assert_allclose(float(l1), float(l0), atol=1e-5, rtol=1e-5)
    for k in m0:
        np.testing.assert_allclose(float(m1[k]), float(m0[k]), atol=1e-5, rtol=1e-5)
    _close(g1, g0)


# ----------------------------------------------------------------------------- microbatches


@pytest.mark.slow
def test_microbatched_step_with_every_knob_equals_the_whole_batch_step(tiny_cfg):
    """Accumulation over 4 row chunks, with remat, chunked attention and chunked log-probs,
    against the plain whole-batch step (float32): gradients (SGD lr 1: the new params) to 1e-5."""
    base = _cfg(tiny_cfg, scan_layers=False)
    gd0, params = random_policy(base, 7)
    knobs = dataclasses.replace(base, remat="block", attention="chunked", attention_chunk=4)
    gd1 = model.abstract(knobs)[0]
    batch = _learner_batch(base, (gd0, params), rows=8)
    opt = optax.sgd(1.0)

    def step(gd, chunks, logit_chunk):
        def loss(p, b, _, ref):
            return grpo.policy_loss(
                gd, p, b, 0.2, 0.28, 0.0, "token", TRUNC, ref, logit_chunk=logit_chunk
            )

        fn = make_train_step(
            loss, opt, donate=False, microbatches=chunks, chunk_weight=grpo.chunk_weight("token")
        )
        return fn(TrainState.create(params, opt, 0), batch, None)

    whole, m1 = step(gd0, 1, 0)
    acc, m4 = step(gd1, 4, 5)
    assert _max_diff(whole.params, params) > 1e-3
    np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), atol=1e-6, rtol=1e-5)
    _close(acc.params, whole.params)


def _row_bytes(tiny_cfg, seq_len=200, **kw):
    return microbatch.learner_row_bytes(_cfg(tiny_cfg, **kw), seq_len)


def test_row_estimate_falls_with_each_knob(tiny_cfg):
    none = _row_bytes(tiny_cfg, num_layers=8)
    assert _row_bytes(tiny_cfg, num_layers=8, remat="block") < none / 2
    assert _row_bytes(tiny_cfg, num_layers=8, attention="chunked", attention_chunk=16) < none
    chunked = microbatch.learner_row_bytes(_cfg(tiny_cfg, vocab_size=50000), 200, logit_chunk=16)
    assert chunked < microbatch.learner_row_bytes(_cfg(tiny_cfg, vocab_size=50000), 200) / 5
    # Proportional to the rows' length at least (attention: faster than linear)
    assert _row_bytes(tiny_cfg, 400) > 2 * _row_bytes(tiny_cfg, 200)


@pytest.mark.parametrize("shards", [1, 4])
def test_auto_microbatch_picks_the_largest_divisor_that_fits(shards):
    rows, row = 96, 10_000
    for budget in (10_000, 35_000, 123_456, 10**9):
        m = microbatch.auto_microbatch(rows, row, budget, shards)
        assert rows % m == 0 and m % shards == 0
        assert -(-m // shards) * row <= budget
        larger = [d for d in range(m + 1, rows + 1) if rows % d == 0 and d % shards == 0]
        assert all(-(-d // shards) * row > budget for d in larger)
    assert microbatch.auto_microbatch(rows, row, 10**9, shards) == rows
    assert microbatch.auto_microbatch(rows, row, 35_000, 1) == 3
    assert microbatch.auto_microbatch(rows, row, 35_000, 4) == 12  # 3 rows on each of 4


def test_auto_microbatch_fails_clearly_when_one_row_does_not_fit():
    with pytest.raises(ConfigError, match="rl.memory_budget_gb") as e:
        microbatch.auto_microbatch(64, 2 * 10**9, 1.5e9, 8)
    assert "2 GB" in str(e.value) and "model.remat" in str(e.value)


def test_microbatch_rows_resolves_auto_from_the_config():
    plain, _ = config_lib.load(str(REPO / "configs/demo.py:runlocal"))
    rows = plain.rl.prompts_per_step * plain.rl.group_size  # 64
    # rl.microbatch=0: the whole batch
    assert learner.microbatch_rows(plain.rl, plain.rollout, plain.model, 48) == rows
    row = microbatch.learner_row_bytes(plain.model, 48)

    def auto(budget_bytes, shards=1):
        rl = dataclasses.replace(plain.rl, microbatch=-1, memory_budget_gb=budget_bytes / 1e9)
        return learner.microbatch_rows(rl, plain.rollout, plain.model, 48, shards)

    assert auto(10.5 * row) == 8  # the largest divisor of 64 rows <= 10
    assert auto(10.5 * row, shards=4) == 32  # 8 rows on each of 4 devices
    assert auto(1e12) == rows
    with pytest.raises(ConfigError, match="rl.memory_budget_gb"):
        auto(0.5 * row)


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.remat=blocks", "model.remat"),
        ("model.attention=flash", "model.attention"),
        ("model.attention_chunk=0", "model.attention_chunk"),
        ("rl.microbatch=-2", "rl.microbatch"),
        ("rl.logit_chunk=-1", "rl.logit_chunk"),
        ("rl.memory_budget_gb=0", "rl.memory_budget_gb"),
    ],
)
def test_bad_knob_values_name_their_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_lib.load(str(REPO / "configs/demo.py:runlocal"), [override])


def test_accelerator_configs_turn_the_knobs_on():
    for name in ("qwen3_gpu", "qwen3_tpu_pod"):
        cfg, _ = config_lib.load(str(REPO / f"configs/{name}.py"))
        assert cfg.model.remat == "block" and cfg.model.attention == "chunked"
        assert cfg.rl.microbatch == -1 and cfg.rl.logit_chunk > 0
    demo, _ = config_lib.load(str(REPO / "configs/demo.py"))
    assert (demo.model.remat, demo.model.attention, demo.rl.microbatch) == ("none", "xla", 0)
    assert demo.rl.logit_chunk == 0


# ----------------------------------------------------------------------------- weight store


@pytest.mark.slow
def test_behaviour_copy_keeps_bf16_with_the_same_layout_and_samples(tiny_cfg):
    cfg = _cfg(tiny_cfg, dtype="bfloat16")
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=-1))
    gd, params = random_policy(cfg, 8)
    params = sharding.place_state(params, mesh)
    copy = loop.behaviour_copy(params, cfg.dtype)
    for a, b in zip(jax.tree.leaves(copy), jax.tree.leaves(params), strict=True):
        assert a.dtype == jnp.bfloat16 and b.dtype == jnp.float32
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    # float32 runs: an exact copy in float32
    f32 = loop.behaviour_copy(params, "float32")
    _close(f32, params, tol=0)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(f32))
    # the sampler rounds every weight to bfloat16 anyway: the same samples and log-probs
    scfg = SamplingConfig(temperature=1.0, max_new_tokens=6, eos_ids=(1,))
    toks, lens = sampling.pad_prompts([[3, 4, 5], [6, 7], [8], [9, 10]])
    a = sampling.sample_jit(gd, params, toks, lens, jax.random.key(0), scfg)
    b = sampling.sample_jit(gd, copy, toks, lens, jax.random.key(0), scfg)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-6)


# ----------------------------------------------------------------------------- one compile


@pytest.mark.slow
def test_train_step_and_samplers_compile_once_across_versions(tiny_cfg):
    """On an 8-device FSDP mesh: three train steps, each fed the previous one's state, are one
    program; the plain and the speculative sampler, each run on the three published versions
    (`loop.behaviour_copy`, as the weight store keeps them), one program each."""
    cfg = _cfg(tiny_cfg, dtype="bfloat16")
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=-1))
    gd, params = random_policy(cfg, 9)
    params = sharding.place_state(params, mesh)
    mtp_gd, mtp_params = mtp_lib.init(cfg, 1, 10)
    mtp_params = sharding.place_state(mtp_params, mesh)
    opt = make_optimizer(OptimConfig(lr=1e-2), 10)
    state = sharding.replicate_unplaced(TrainState.create(params, opt, 0), mesh)
    batch = sharding.shard_batch(_learner_batch(cfg, (gd, params), rows=8), mesh)

    def loss(p, b, _, ref):
        return grpo.policy_loss(gd, p, b, 0.2, 0.28, 0.0, "token", T1, ref, logit_chunk=4)

    step = make_train_step(loss, opt)
    versions = []
    for _ in range(3):
        state, _ = step(state, batch, None)
        versions.append(loop.behaviour_copy(state.params, cfg.dtype))
    assert step._cache_size() == 1
    assert _max_diff(versions[0], versions[2]) > 0  # the versions differ

    # A sampler config no other test uses: the cache counts only this test's programs.
    scfg = SamplingConfig(temperature=1.0, max_new_tokens=7, eos_ids=(1,))
    spec = speculative.SpecConfig(2, "rejection")
    toks, lens = sampling.pad_prompts([[3, 4, 5], [6, 7], [8], [9, 10]] * 2)
    toks, lens = sharding.shard_batch((jnp.asarray(toks), jnp.asarray(lens)), mesh)
    plain0 = sampling.sample_jit._cache_size()
    spec0 = speculative.sample_jit._cache_size()
    for v in versions:
        sampling.sample_jit(gd, v, toks, lens, jax.random.key(1), scfg)
        speculative.sample_jit(gd, v, mtp_gd, mtp_params, toks, lens, jax.random.key(1), scfg, spec)
    assert sampling.sample_jit._cache_size() - plain0 == 1
    assert speculative.sample_jit._cache_size() - spec0 == 1


def test_bf16_behaviour_weights_checkpoint_and_restore_in_bf16(tiny_cfg, tmp_path):
    """A resumed bfloat16 run reads the behaviour versions back as the store keeps them."""
    from bebop.ckpt import Checkpointer
    from bebop.config import RLConfig
    from bebop.stages import rl as stage

    cfg = _cfg(tiny_cfg, dtype="bfloat16")
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=-1))
    _, params = random_policy(cfg, 11)
    _, mtp_params = mtp_lib.init(cfg, 1, 12)
    opt = make_optimizer(OptimConfig(), 10)
    pol_state = sharding.replicate_unplaced(
        TrainState.create(sharding.place_state(params, mesh), opt, 0), mesh
    )
    mtp_state = sharding.replicate_unplaced(
        TrainState.create(sharding.place_state(mtp_params, mesh), opt, 1), mesh
    )
    store = loop.WeightStore(keep=3)
    kept = loop.behaviour_copy(pol_state.params, cfg.dtype)
    store.publish(0, kept, loop.snapshot(mtp_state.params), 0)
    state, meta = stage.checkpoint_state(pol_state, mtp_state, store, 1, RLConfig(max_staleness=1))
    ckpt = Checkpointer(tmp_path / "ckpt", 2, False)
    ckpt.save(1, state, meta)
    ckpt.wait()
    step, restored, _ = stage.restore(ckpt, pol_state, mtp_state, 1, cfg.dtype)
    ckpt.close()
    back = restored["behaviour"]["v0"]["policy"]
    assert step == 1
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(kept), strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    _close(restored["policy"].params, pol_state.params, tol=0)


@pytest.mark.slow
def test_auto_microbatch_learner_step_equals_the_whole_batch_step():
    """`learner.build` under `rl.microbatch=-1` with a budget of ~20 rows: 64 rows run as 4
    chunks of 16 (also through `.lower` on abstract arguments), with the whole batch's update."""
    plain, _ = config_lib.load(str(REPO / "configs/demo.py:runlocal"))
    m = plain.model
    gd, params = model.init(m, 0)
    mtp_gd, mtp_params = mtp_lib.init(m, 1, 1)
    rows, width = 64, 12
    budget = 20.5 * microbatch.learner_row_bytes(m, width) / 1e9
    scfg = SamplingConfig(temperature=0.7)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, m.vocab_size, (rows, width)), jnp.int32)
    logp, _ = grpo.token_logprobs(gd, params, tokens, scfg)
    mask = jnp.asarray((np.arange(width) >= 4) & (rng.random((rows, width)) < 0.8), jnp.float32)
    batch = loop.LearnerBatch(tokens, mask, logp + 0.1, jnp.asarray(rng.normal(size=rows)))

    def run(mb, budget_gb):
        rl = dataclasses.replace(plain.rl, microbatch=mb, memory_budget_gb=budget_gb)
        cfg = dataclasses.replace(plain, rl=rl)
        opt = optax.sgd(1.0)
        store = loop.WeightStore(keep=2)
        learn = learner.build(cfg, gd, mtp_gd, scfg, None, opt, opt, store)
        state = TrainState.create(loop.snapshot(params), opt, 0)  # donated by the step
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        return learn, learn.policy_step(state, batch, None), cfg, abstract

    learn, (auto_state, auto_m), cfg, state = run(-1, budget)
    assert learner.microbatch_rows(cfg.rl, cfg.rollout, m, width) == 16
    _, (whole_state, whole_m), _, _ = run(0, budget)
    assert learn.policy_step._cache_size() == 1
    np.testing.assert_allclose(float(auto_m["loss"]), float(whole_m["loss"]), atol=1e-6, rtol=1e-5)
    assert _max_diff(whole_state.params, params) > 1e-3
    _close(auto_state.params, whole_state.params)
    abstract_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    hlo = learn.policy_step.lower(state, abstract_batch, None).as_text()
    assert "while" in hlo  # the accumulation loop over the 4 chunks
