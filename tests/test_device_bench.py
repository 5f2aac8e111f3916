"""The GPU check's benchmark pieces: random-weight models at real shapes (`benchmarks.shapes`),
the decode bound's bytes (`benchmarks.decode`), `benchmarks.rollout --dtype` and its
predicted speedups at stated acceptances."""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bebop import model, sharding
from bebop.checkpoints import hf as hf_ckpt
from bebop.config import MeshConfig, ModelConfig
from benchmarks import common, decode, shapes


def _cfg(dtype):
    return ModelConfig(
        vocab_size=23,
        dim=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        ffw_dim=48,
        tie_embeddings=False,
        dtype=dtype,
        param_dtype="float32",
    )


@pytest.mark.parametrize("dtype,item", [("bfloat16", 2), ("float32", 4)])
def test_decode_bound_reads_the_compute_dtype_bytes_of_the_decode_weights(dtype, item):
    """float32 master parameters, `dtype` compute: the bound's bytes are the decode weights in
    `dtype` (per layer q/k/v, output, gate/up and down matrices and two norm scales, plus the
    [D, V] head), counted here from the shape alone, not the parameters' float32 bytes."""
    cfg = _cfg(dtype)
    gd, params = model.init(cfg, 0)
    layers = model.decode_layers(gd, params)
    d, f, v, dh = 32, 48, 23, 8
    per_layer = d * (4 + 2 * 2) * dh + 4 * dh * d + 3 * d * f + 2 * d
    want = item * (2 * per_layer + d * v)
    step = shapes.decode_step_bytes(layers, cfg, batch=3, context=10)
    assert step["weights"] == want
    assert step["embed_rows"] == item * 3 * d
    assert step["kv"] == item * 2 * 2 * 3 * 2 * dh * 10  # k and v, 2 layers, 3 rows, 2 heads
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert param_bytes > want if dtype == "bfloat16" else param_bytes >= want
    # the bound: batch tokens per step, each step reading those bytes at the given rate
    total = want + item * 3 * d + step["kv"]
    assert decode.hbm_bound_tok_s(step, 3, 1e9) == pytest.approx(3 * 1e9 / total)


def test_random_model_round_trips_through_the_hf_loader():
    """`hf_arrays` of a random model has exactly the tensors (names, shapes, layouts) the HF
    loader reads: it refuses a missing, misshapen or extra tensor, and loading them back gives
    the same parameters. Weights: 65k draws of N(0, 0.02²), std within 10 %; norm scales 1."""
    cfg = shapes.model_config("tiny", layers=1, dtype="float32")
    assert cfg.num_layers == 1
    gd, params = shapes.random_params(cfg)
    arrays = {k: np.asarray(v) for k, v in shapes.hf_arrays(params).items()}
    mesh = sharding.make_mesh(MeshConfig(data=1), jax.devices()[:1])
    loaded = hf_ckpt.load_source(hf_ckpt.ArraySource(arrays, "random"), cfg, mesh)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    emb = arrays["model.embed_tokens.weight"]
    assert emb.shape == (256, 64) and abs(float(emb.std()) - 0.02) < 0.002
    np.testing.assert_array_equal(arrays["model.layers.0.input_layernorm.weight"], np.ones(64))
    with pytest.raises(ValueError, match="layers"):
        shapes.model_config("smollm2", layers=31)
    with pytest.raises(ValueError, match="unknown"):
        shapes.model_config("gpt5")


def test_minimal_decoder_decodes_the_random_model_as_bebop_does():
    """float32, greedy, 6 new tokens at batch 2 on the same random weights: the minimal decoder
    (its own code) and bebop's sampler emit the same tokens, so the yardstick reads the same
    weights in the same layout."""
    from bebop import sampling
    from benchmarks import minimal_decoder

    cfg = dataclasses.replace(shapes.model_config("tiny", dtype="float32"), init_std=0.02)
    gd, params = shapes.random_params(cfg, seed=1, std=0.2)  # std 0.2: clear argmax margins
    ids = shapes.random_prompts(cfg, 1, lo=8, hi=8)[0]
    mini = minimal_decoder.from_hf_arrays(shapes.hf_arrays(params), cfg)
    want = np.asarray(minimal_decoder.generate(mini, cfg, jnp.asarray([ids] * 2, jnp.int32), 6))
    scfg = sampling.SamplingConfig(temperature=0.0, max_new_tokens=6, eos_ids=(-1,))
    toks, lens = sampling.pad_prompts([ids] * 2)
    got = sampling.sample_jit(gd, params, toks, lens, jax.random.key(0), scfg, None).tokens
    np.testing.assert_array_equal(np.asarray(got)[:, :6], want[:, -6:])


def test_rollout_dtype_sets_the_policy_compute_dtype():
    args = argparse.Namespace(
        model="random", shape="tiny", layers=1, dtype="bfloat16", num_prompts=3, mtp_ckpt=""
    )
    mesh = sharding.make_mesh(MeshConfig(data=1), jax.devices()[:1])
    pol, mtp, vocab, tok, ids, _ = common.load_models(args, mesh)
    assert model.graphdef_config(*pol).dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(model.decode_layers(*pol))} == {jnp.dtype("bfloat16")}
    assert len(ids) == 3 and vocab is None and tok.eos_ids == (-1,)
    cfg = argparse.Namespace(model=_cfg("float32"))
    run_cfg = dataclasses.make_dataclass("R", [("model", ModelConfig)])(_cfg("float32"))
    assert common.with_dtype(run_cfg, "bfloat16").model.dtype == "bfloat16"
    assert common.with_dtype(cfg, "") is cfg


def test_predicted_speedup_at_a_stated_acceptance():
    """γ = 2, α = 0.5: 1 + 0.5 + 0.25 = 1.75 tokens per cycle; a cycle is a 3-token verify (0.15
    s) and two drafts (0.025 s each) = 0.2 s against a 0.1 s plain step: 1.75 x 0.1 / 0.2."""
    costs = {"verify_1": 0.1, "verify_3": 0.15, "draft": 0.025}
    got = common.predicted_at([0.5, 1.0], 2, costs)
    assert got["0.5"] == pytest.approx(0.875)
    assert got["1"] == pytest.approx(3 * 0.1 / 0.2)


def test_device_summary_reports_cut_skipped_and_silent_steps(tmp_path):
    """`benchmarks/device.sh`'s summary: a step cut at its limit keeps the figures it printed; a
    skipped step and a step without a JSON line are errors; a finished one is not."""
    import json

    from benchmarks import device_summary

    (tmp_path / "decode_a.json").write_text(
        json.dumps({"model": "m", "bebop_tok_s_b1": 5.0, "bebop_tok_s_b1_greedy": 5.0})
    )
    (tmp_path / "runlocal.json").write_text(json.dumps({"sft": {"steps": 2, "x": [1]}}))
    (tmp_path / "rollout_b.json").write_text("")
    tsv = "decode_a\t124\t100\t100\nrollout_b\t0\t3\t90\nrunlocal\t0\t40\t90\ne2e\tskipped\t0\t0\n"
    got = device_summary.summarize(tmp_path, tsv, {"jax": "0.11.2"})
    assert got["jax"] == "0.11.2"
    assert got["steps"]["decode_a"]["headline"] == {"model": "m", "bebop_tok_s_b1": 5.0}
    assert got["steps"]["runlocal"]["headline"] == {"sft": {"steps": 2}}
    assert got["errors"] == {
        "decode_a": "cut at its time limit (figures so far kept)",
        "rollout_b": "no JSON line in its output",
        "e2e": "no time left",
    }
