"""One loaded-policy type for every source, MTP layers an HF checkpoint ships (`mtp.init=
checkpoint`), and `python -m bebop.export`: transformers loads the exported run (weights, dtype,
tokenizer, generation defaults) and computes bebop's logits."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from bebop import config as config_lib
from bebop import export, model, policies
from bebop import mtp as mtp_lib
from bebop.checkpoints import LoadedPolicy, hf, tokenizer_files
from bebop.ckpt import Checkpointer
from bebop.config import ConfigError, RunConfig
from bebop.stages import rl as rl_stage
from bebop.tokenizer import BPETokenizer, CharTokenizer

from .test_checkpoints import _hf_model, _mesh

TOKS = np.random.default_rng(1).integers(0, 28, (2, 10))  # ids of the char tokenizer (< 96)


def _random(abstract_state, seed: int, std: float = 0.3):
    """Random values for a state's shapes, drawn in numpy: eager JAX random ops would compile
    once per shape (seconds on CPU)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: jnp.asarray(std * rng.standard_normal(x.shape), x.dtype), abstract_state
    )


def _perturb(state, seed: int, scale: float):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: jnp.asarray(np.asarray(x) + scale * rng.standard_normal(x.shape), x.dtype), state
    )


def _tokenizer_files(directory):
    """The demo's char tokenizer as the HF source's tokenizer (28 ids, within its 96 rows)."""
    tokenizer_files.char_tokenizer_json(CharTokenizer()).save(str(directory / "tokenizer.json"))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2})
    )


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two HF checkpoints (Qwen3, 2 layers): `plain`, and `mtp` which also ships one MTP layer
    in Qwen3.5's layout; returns (root, the MTP params)."""
    root = tmp_path_factory.mktemp("hf")
    _hf_model("qwen3", root / "plain")
    _tokenizer_files(root / "plain")
    loaded = hf.load(root / "plain", _mesh())
    mparams = _random(mtp_lib.abstract(loaded.cfg, 1)[1], 3)
    hf.export(root / "mtp", loaded.cfg, loaded.params, "qwen3", mparams, "qwen3_5")
    _tokenizer_files(root / "mtp")
    return root, mparams


def _hf_run(tmp_path, src, *overrides) -> RunConfig:
    cfg = config_lib.from_dict(
        RunConfig,
        {
            "policy": {"source": "hf", "path": str(src)},
            "rollout": {"temperature": 0.7, "top_p": 0.9},
            **dict(overrides),
        },
    )
    tmp_path.mkdir(parents=True, exist_ok=True)
    config_lib.dump(cfg, tmp_path / "config.json")
    return cfg


def _equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


_forward = jax.jit(model.forward, static_argnums=0)  # one compile, not one per eager op


def _bebop_logits(graphdef, params, toks=TOKS):
    pos = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
    return np.asarray(_forward(graphdef, params, jnp.asarray(toks), pos)[0])


def _hf_logits(directory, toks=TOKS):
    m = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return m, m(torch.tensor(toks)).logits.float().numpy()


# ----------------------------------------------------------------------------- LoadedPolicy


def test_load_returns_one_type_for_every_source_and_keeps_shipped_mtp(sources, tmp_path):
    root, mparams = sources
    mesh = _mesh()
    # sft: the run's own checkpoint, cfg = cfg.model, the char tokenizer, no MTP
    cfg = RunConfig()
    gd, params = model.abstract(cfg.model)
    params = _random(params, 0)
    ck = Checkpointer(tmp_path / "sft" / "ckpt", async_save=False)
    ck.save(1, {"params": params}, {})
    ck.close()
    sft = policies.load(cfg.policy, cfg.model, tmp_path, mesh)
    assert isinstance(sft, LoadedPolicy) and sft.cfg == cfg.model and sft.mtp is None
    assert isinstance(sft.tok, CharTokenizer)
    _equal(sft.params, params)
    # hf: architecture from config.json, tokenizer from tokenizer.json, the shipped MTP kept
    a = _hf_run(tmp_path / "a", root / "mtp")
    with_mtp = policies.load(a.policy, a.model, tmp_path / "a", mesh)
    assert isinstance(with_mtp, LoadedPolicy) and with_mtp.cfg.qk_norm
    assert (with_mtp.cfg.num_layers, with_mtp.cfg.vocab_size) == (2, 96)
    # the source ships the demo's character tokenizer: read back as one (raw task prompts)
    assert isinstance(with_mtp.tok, CharTokenizer) and with_mtp.tok.eos_ids == (2,)
    assert with_mtp.mtp is not None and with_mtp.mtp_format == "qwen3_5"
    _equal(with_mtp.mtp[1], mparams)
    b = _hf_run(tmp_path / "b", root / "plain")
    plain = policies.load(b.policy, b.model, tmp_path / "b", mesh)
    assert plain.mtp is None and plain.mtp_format is None


def test_mtp_init_checkpoint_starts_from_the_shipped_layers_or_names_the_missing_ones(
    sources, tmp_path
):
    root, mparams = sources
    mesh = _mesh()
    cfg = _hf_run(tmp_path / "a", root / "mtp", ("mtp", {"init": "checkpoint"}))
    policy = policies.load(cfg.policy, cfg.model, tmp_path / "a", mesh)
    _, params = policies.init_mtp(cfg.mtp, cfg.policy, cfg.seed, policy, mesh)  # mtp stage's start
    _equal(params, mparams)
    # an rl-only run without an `mtp` stage drafts with the shipped layers (no draft vocabulary)
    _, params, vocab = rl_stage.load_draft_model(cfg, tmp_path / "a", policy, mesh)
    _equal(params, mparams)
    assert vocab is None
    plain = _hf_run(tmp_path / "b", root / "plain", ("mtp", {"init": "checkpoint"}))
    with pytest.raises(ConfigError, match=r"'mtp.init'.*plain.*has none"):
        policy = policies.load(plain.policy, plain.model, tmp_path / "b", mesh)
        policies.init_mtp(plain.mtp, plain.policy, plain.seed, policy, mesh)
    two = _hf_run(tmp_path / "c", root / "mtp", ("mtp", {"init": "checkpoint", "num_layers": 2}))
    with pytest.raises(ConfigError, match=r"'mtp.num_layers'.*ships 1 MTP layer"):
        policy = policies.load(two.policy, two.model, tmp_path / "c", mesh)
        policies.init_mtp(two.mtp, two.policy, two.seed, policy, mesh)
    with pytest.raises(ConfigError, match=r"'mtp.init'.*'ckpt'"):
        config_lib.from_dict(RunConfig, {"mtp": {"init": "ckpt"}}).validate()


# ----------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def rl_run(sources, tmp_path_factory):
    """A HF-source run whose `rl` checkpoint holds a policy and an MTP that differ from the
    source's (each weight moved by 0.05 sigma): what the export must write."""
    root, mparams = sources
    wd = tmp_path_factory.mktemp("run")
    cfg = _hf_run(wd, root / "mtp")
    base = policies.load(cfg.policy, cfg.model, wd, _mesh())
    pol, mtp = _perturb(base.params, 1, 0.05), _perturb(mparams, 2, 0.05)
    ck = Checkpointer(wd / "rl" / "ckpt", async_save=False)
    ck.save(7, {"policy": {"params": pol}, "mtp": {"params": mtp}}, {})
    ck.close()
    return wd, base, pol, mtp


def test_export_of_an_rl_run_loads_in_transformers_with_bebops_logits(rl_run, tmp_path):
    wd, base, pol, mtp = rl_run
    out = export.main(["--workdir", str(wd), "--out", str(tmp_path / "f32"), "--with_mtp"])
    m, got = _hf_logits(out)
    want = _bebop_logits(base.graphdef, pol)
    assert np.abs(got - want).max() <= 1e-4  # the rl policy, not the source's
    assert np.abs(got - _bebop_logits(base.graphdef, base.params)).max() > 1e-2
    _equal(hf.load(out, _mesh()).mtp[1], mtp)  # the MTP trained in rl, read back by bebop
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1 and gen["do_sample"]
    assert (gen["temperature"], gen["top_p"]) == (0.7, 0.9)
    assert m.generation_config.eos_token_id == 2 and m.generation_config.temperature == 0.7
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.encode("12+3=45", add_special_tokens=False) == CharTokenizer().encode("12+3=45")


def test_bfloat16_export(rl_run, tmp_path):
    wd, base, pol, _ = rl_run
    out = export.main(["--workdir", str(wd), "--out", str(tmp_path / "bf16"), "--dtype=bfloat16"])
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    m, got = _hf_logits(out)
    assert m.dtype == torch.bfloat16
    want = _bebop_logits(base.graphdef, pol)
    # bf16 weights and activations (8 mantissa bits) against float32: within 5% of the largest
    # |logit| (measured: 1.8%; a misplaced tensor is off by ~100%), and the same greedy token at
    # >= 90% of the 20 positions (measured: all)
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_export_of_the_demo_policy_with_its_char_tokenizer(tmp_path):
    cfg = RunConfig()
    config_lib.dump(cfg, tmp_path / "config.json")
    gd, params = model.abstract(cfg.model)
    params = _random(params, 0)
    ck = Checkpointer(tmp_path / "sft" / "ckpt", async_save=False)
    ck.save(1, {"params": params}, {})
    ck.close()
    out = export.main(["--workdir", str(tmp_path), "--out", str(tmp_path / "hf")])
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    _, got = _hf_logits(out)
    assert np.abs(got - _bebop_logits(gd, params)).max() <= 1e-4
    tok, char = transformers.AutoTokenizer.from_pretrained(out), CharTokenizer()
    text = "(12+3)*4=60;\n? "
    assert tok.encode(text) == char.encode(text, bos=True)  # BOS as the demo's prompts have it
    assert tok.decode(char.encode(text, bos=True), skip_special_tokens=True) == text
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 0)


def test_gguf_tokenizer_files_encode_like_bebop(tmp_path):
    """A byte-level BPE vocabulary in GGUF metadata (bytes + 3 merges + ChatML specials):
    transformers' tokenizer from the written files gives bebop's ids and the GGUF template."""
    from tokenizers import pre_tokenizers

    tokens = pre_tokenizers.ByteLevel.alphabet()
    tokens = sorted(tokens) + ["Ġt", "he", "Ġthe", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    n = len(tokens)
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
        "tokenizer.ggml.token_type": [1] * (n - 3) + [3] * 3,
        "tokenizer.ggml.bos_token_id": n - 3,
        "tokenizer.ggml.eos_token_id": n - 1,
        "tokenizer.ggml.padding_token_id": n - 3,
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}",
    }
    tok = BPETokenizer.from_gguf_fields(fields)
    ids = tokenizer_files.write_tokenizer(tmp_path, "gguf", tok)
    assert ids == {"bos": n - 3, "eos": [n - 1, n - 3], "pad": n - 3}  # + <|endoftext|>
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for s in ["the theme 1234", "héllo — 你好\n\t x", "<|im_start|>user\nhi<|im_end|>"]:
        assert ref.encode(s, add_special_tokens=False) == tok.encode(s), s
    msgs = [{"role": "user", "content": "the 2"}]
    want = tok.encode("<|im_start|>user\nthe 2<|im_end|>\n")
    assert ref.apply_chat_template(msgs, tokenize=True, return_dict=False) == want


def test_export_errors_name_the_problem(rl_run, sources, tmp_path, capsys):
    wd, *_ = rl_run
    with pytest.raises(SystemExit) as e:
        export.main(["--workdir", str(wd), "--out", str(tmp_path / "o"), "--dtype", "int8"])
    assert e.value.code == 2 and "--dtype" in capsys.readouterr().err
    with pytest.raises(export.ExportError, match=r"--workdir .*nowhere: no such directory"):
        export.main(["--workdir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])
    plain = tmp_path / "plain_run"
    _hf_run(plain, sources[0] / "plain")
    with pytest.raises(export.ExportError, match=r"--stage rl: .*rl/ckpt holds no checkpoint"):
        export.main(["--workdir", str(plain), "--out", str(tmp_path / "o"), "--stage", "rl"])
    with pytest.raises(export.ExportError, match=r"--with_mtp --stage sft.*ships no MTP layers"):
        export.main(["--workdir", str(plain), "--out", str(tmp_path / "o"), "--with_mtp"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(export.ExportError, match=r"--out .*full: not empty"):
        export.main(["--workdir", str(plain), "--out", str(tmp_path / "full")])
