"""The tiny random HF checkpoint of the Qwen3 smoke runs (`policy.path="tiny:qwen3"`): built once
in the workdir by `policies.load`, a directory transformers loads with bebop's logits and token
ids; unknown kinds fail naming the key."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from bebop import config as config_lib
from bebop import model, policies
from bebop.checkpoints import hf, tiny
from bebop.config import ConfigError, RunConfig

from .test_checkpoints import _mesh

TOKS = np.random.default_rng(0).integers(0, 49152, (2, 7))
TEXT = "Tom has 12 apples; he eats 3. How many are left?"


def _cfg(path="tiny:qwen3", source="hf") -> RunConfig:
    cfg = config_lib.from_dict(RunConfig, {"policy": {"source": source, "path": path}})
    cfg.validate()
    return cfg


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(workdir, the policy loaded by the first `policies.load`, which built the directory)."""
    workdir = tmp_path_factory.mktemp("run")
    return workdir, policies.load(_cfg().policy, _cfg().model, workdir, _mesh())


def test_tiny_qwen3_loads_in_transformers_with_bebops_logits_and_tokens(built):
    workdir, policy = built
    directory = workdir / "tiny_hf" / "qwen3"
    m = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    assert type(m).__name__ == "Qwen3ForCausalLM" and m.config.tie_word_embeddings
    shape = (m.config.num_hidden_layers, m.config.hidden_size, m.config.vocab_size)
    assert shape == (2, 64, 49152)  # vocabulary: SmolLM2's tokenizer
    with torch.no_grad():
        want = m(torch.tensor(TOKS)).logits.numpy()
    pos = jnp.broadcast_to(jnp.arange(TOKS.shape[1]), TOKS.shape)
    forward = jax.jit(model.forward, static_argnums=0)  # one compile, not one per eager op
    got = np.asarray(forward(policy.graphdef, policy.params, jnp.asarray(TOKS), pos)[0])
    assert want.std() > 0.3  # random weights of std 0.1: logits far from all-equal
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # the SmolLM2 tokenizer: the same ids through AutoTokenizer and bebop's tokenizer
    hf_tok = transformers.AutoTokenizer.from_pretrained(directory)
    assert hf_tok(TEXT, add_special_tokens=False).input_ids == policy.tok.encode(TEXT)
    assert policy.tok.eos_ids[0] == hf_tok.eos_token_id == m.config.eos_token_id[0]
    messages = [{"role": "user", "content": TEXT}]
    want_text = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert policy.tok.render(messages) == want_text and want_text.startswith("<|im_start|>")


def test_tiny_checkpoint_is_built_once_and_reused(built):
    workdir, first = built
    directory = workdir / "tiny_hf" / "qwen3"
    before = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
    (directory / "marker").write_text("kept")  # a rebuild would replace the directory
    again = policies.load(_cfg().policy, _cfg().model, workdir, _mesh())
    assert (directory / "marker").read_text() == "kept"
    assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir() if p.name != "marker"} == (
        before
    )
    assert [p.name for p in (workdir / "tiny_hf").iterdir()] == ["qwen3"]  # no temp dir left
    np.testing.assert_array_equal(
        np.asarray(again.params["embed"].get_value()), np.asarray(first.params["embed"].get_value())
    )


def test_tiny_path_validation_names_the_key():
    with pytest.raises(ConfigError, match=r"'policy.path': unknown tiny kind 'qwen4'"):
        _cfg("tiny:qwen4")
    with pytest.raises(ConfigError, match=r"'policy.source'.*needs source='hf'"):
        _cfg("tiny:qwen3", source="gguf")
    assert tiny.kind_of("/models/Qwen3-4B") is None and tiny.kind_of("tiny:llama") == "llama"
    for kind in tiny.KINDS:  # each kind's flags are the family transformers computes for them
        assert hf.model_type_for(tiny.model_config(kind, 100)) == kind
