"""HF import/export parity with transformers, sharded loading, SmolLM2 from its GGUF, tokenizer
parity, and clear errors for bad checkpoints."""

import json
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from bebop import model, sampling, sharding
from bebop import mtp as mtp_lib
from bebop.checkpoints import gguf as gguf_ckpt
from bebop.checkpoints import hf
from bebop.config import MeshConfig

from .conftest import REPO

ARCHS = {
    "qwen3": transformers.Qwen3Config,
    "qwen2": transformers.Qwen2Config,
    "llama": transformers.LlamaConfig,
}


def _hf_model(arch, tmp_path, tie=False):
    cfg = ARCHS[arch](
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        rope_theta=5000.0,
    )
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():  # make norms and biases non-trivial
            if "bias" in name or "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.mul_(10.0)  # peakier distributions: greedy decoding is far from ties
    m.save_pretrained(tmp_path)
    return m


def _mesh(shape=(1, 1, 1)):
    devs = jax.devices()[: int(np.prod(shape))]
    return sharding.make_mesh(MeshConfig(*shape), devs)


def _logits(loaded, toks):
    pos = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
    return np.asarray(model.forward(loaded.graphdef, loaded.params, jnp.asarray(toks), pos)[0])


TOKS = np.random.default_rng(0).integers(0, 96, (2, 12))


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHS))
def test_parity_with_transformers(arch, tmp_path):
    m = _hf_model(arch, tmp_path, tie=arch == "llama")
    loaded = hf.load(tmp_path, _mesh())
    assert loaded.cfg.qkv_bias == (arch == "qwen2") and loaded.cfg.qk_norm == (arch == "qwen3")
    with torch.no_grad():
        ref = m(torch.tensor(TOKS)).logits.numpy()
    assert np.abs(_logits(loaded, TOKS) - ref).max() <= 1e-4
    # the same 20 greedy tokens (EOS cleared so both run the full length)
    m.generation_config.eos_token_id = None
    prompt = [5, 17, 33]
    with torch.no_grad():
        want = m.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, 3:]
    scfg = sampling.SamplingConfig(temperature=0.0, max_new_tokens=20, eos_ids=(-1,))
    got = sampling.generate(loaded.graphdef, loaded.params, [prompt], jax.random.key(0), scfg)[0]
    assert got == want.tolist()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_export_reloads_in_transformers(arch, tmp_path):
    _hf_model(arch, tmp_path / "src")
    loaded = hf.load(tmp_path / "src", _mesh())
    hf.export(tmp_path / "out", loaded.cfg, loaded.params, arch)
    m2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        ref = m2(torch.tensor(TOKS)).logits.numpy()
    assert np.abs(_logits(loaded, TOKS) - ref).max() <= 1e-4


@pytest.mark.parametrize("fmt", ["qwen3_5", "mimo", "deepseek_v3"])
def test_mtp_tensors_round_trip(fmt, tmp_path):
    _hf_model("qwen3", tmp_path / "src")
    loaded = hf.load(tmp_path / "src", _mesh())
    n = 1 if fmt == "qwen3_5" else 2
    _, mparams = mtp_lib.init(loaded.cfg, n, seed=3)
    hf.export(tmp_path / "out", loaded.cfg, loaded.params, "qwen3", mparams, fmt)
    names = json.loads((tmp_path / "out/config.json").read_text())  # config stays the policy's
    assert names["num_hidden_layers"] == 2
    again = hf.load(tmp_path / "out", _mesh())
    assert again.mtp_format == fmt
    for a, b in zip(jax.tree.leaves(mparams), jax.tree.leaves(again.mtp[1]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_sharded_checkpoint_loads_onto_8_device_mesh(tmp_path, devices):
    _hf_model("qwen3", tmp_path / "src")
    loaded = hf.load(tmp_path / "src", _mesh())
    hf.export(tmp_path / "sharded", loaded.cfg, loaded.params, "qwen3", max_shard_bytes=20_000)
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    big = hf.load(tmp_path / "sharded", _mesh((2, 2, 2)))
    wq = big.params["layers"]["attn"]["wq"][...]
    assert not wq.sharding.is_fully_replicated
    np.testing.assert_allclose(_logits(big, TOKS), _logits(loaded, TOKS), atol=1e-5)


# ----------------------------------------------------------------------------- bad inputs


def _corrupt(tmp_path, edit):
    _hf_model("qwen3", tmp_path)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")


def test_missing_config_and_weights(tmp_path):
    with pytest.raises(hf.CheckpointError, match="config.json"):
        hf.load(tmp_path, _mesh())
    _hf_model("qwen3", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(hf.CheckpointError, match="no \\*.safetensors"):
        hf.load(tmp_path, _mesh())


def test_unknown_architecture(tmp_path):
    _hf_model("qwen3", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hf.CheckpointError, match="gpt_neox"):
        hf.load(tmp_path, _mesh())


def test_wrong_shape_missing_and_unexpected_tensors(tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    _corrupt(tmp_path / "a", lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(hf.CheckpointError, match=f"{name}.*shape"):
        hf.load(tmp_path / "a", _mesh())
    _corrupt(tmp_path / "b", lambda t: t.pop(name))
    with pytest.raises(hf.CheckpointError, match=f"missing tensor {name}"):
        hf.load(tmp_path / "b", _mesh())
    _corrupt(tmp_path / "c", lambda t: t.update({"model.extra.weight": np.ones(3, np.float32)}))
    with pytest.raises(hf.CheckpointError, match="unexpected tensor.*model.extra.weight"):
        hf.load(tmp_path / "c", _mesh())


def test_truncated_safetensors(tmp_path):
    _hf_model("qwen3", tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(hf.CheckpointError, match="model.safetensors"):
        hf.load(tmp_path, _mesh())


def test_gguf_with_unsupported_quant_type(tmp_path):
    import gguf

    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in {"embedding_length": 8, "block_count": 1, "feed_forward_length": 16}.items():
        w.add_uint32(f"llama.{k}", v)
    w.add_uint32("llama.attention.head_count", 2)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c", "d"])
    w.add_tensor("token_embd.weight", np.ones((4, 8), np.int32))  # I32: no dequantizer
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(hf.CheckpointError, match="token_embd.weight.*I32"):
        gguf_ckpt.read(path)


def test_no_pickle_based_loading_anywhere():
    proc = subprocess.run(
        [
            "grep",
            "-rnE",
            r"import pickle|pickle\.load|torch\.load|allow_pickle=True",
            "bebop",
            "launch.py",
            "configs",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.stdout == "", proc.stdout


# ----------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2():
    loaded = gguf_ckpt.load(gguf_ckpt.find_smollm2(), _mesh())
    return loaded, loaded.tok


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(smollm2):
    loaded, tok = smollm2
    ids = tok.chat([{"role": "user", "content": "What is the capital of France?"}])
    scfg = sampling.SamplingConfig(
        temperature=0.0, max_new_tokens=16, eos_ids=tok.eos_ids, pad_id=tok.pad_id
    )
    out = sampling.generate(loaded.graphdef, loaded.params, [ids], jax.random.key(0), scfg)[0]
    assert "Paris" in tok.decode(out)


HARD_STRINGS = [
    "12345678901234567890 and 3.14159, 1e-10",
    "tabs\tand   spaces\n\n\n  trailing   ",
    "unicode: héllo wörld — 你好, 🙂 naïve café",
    "def f(x):\n    return {'a': [1, 2]}  # code\n",
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>",
    "",
]


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2):
    _, tok = smollm2
    path = gguf_ckpt.find_smollm2()
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for s in HARD_STRINGS:
        assert tok.encode(s) == ref.encode(s, add_special_tokens=False), s
        assert tok.decode(tok.encode(s), skip_special_tokens=False) == s


def test_first_layers_cut_is_the_truncated_transformers_model(tmp_path):
    """`policy.num_layers` (smoke runs): loading the first of 2 layers gives the logits of the
    transformers model with its second layer removed; MTP tensors of a `deepseek_v3` export (a
    layer numbered after the policy's) are hidden, not read as policy or MTP layers; asking for
    more layers than the checkpoint has names the key."""
    m = _hf_model("qwen2", tmp_path / "src")
    loaded = hf.load(tmp_path / "src", _mesh())
    _, mparams = mtp_lib.init(loaded.cfg, 1, seed=3)
    hf.export(tmp_path / "out", loaded.cfg, loaded.params, "qwen2", mparams, "deepseek_v3")
    cut = hf.load(tmp_path / "out", _mesh(), num_layers=1)
    assert cut.cfg.num_layers == 1 and cut.mtp is None
    m.model.layers = m.model.layers[:1]
    m.config.num_hidden_layers = 1
    with torch.no_grad():
        ref = m(torch.tensor(TOKS)).logits.numpy()
    assert np.abs(_logits(cut, TOKS) - ref).max() <= 1e-4
    assert np.abs(_logits(loaded, TOKS) - ref).max() > 1e-2  # the second layer mattered
    with pytest.raises(hf.CheckpointError, match="policy.num_layers=3 but .* has 2 decoder"):
        hf.load(tmp_path / "src", _mesh(), num_layers=3)
