"""Chat templates: the checkpoint's own jinja template rendered as transformers renders it, one
BOS, `add_bos_token` honoured, ChatML when there is no template, GGUF pre-tokenizer checked, and
SmolLM2's prompts unchanged."""

import json

import pytest
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from bebop.checkpoints import gguf as gguf_ckpt
from bebop.tokenizer import BPETokenizer, TokenizerError, gguf_pre_tokenizer, render_chatml

SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
SPECIALS += ["<|im_start|>", "<|im_end|>"]
BOS, EOT = "<|begin_of_text|>", "<|eot_id|>"

LLAMA3 = (
    "{{- bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# what transformers-style templates use: whitespace control, namespace, loop controls, tojson,
# raise_exception, {% generation %}, eos_token
FEATURES = """{%- set ns = namespace(n=0) %}
{%- for m in messages %}
    {%- if m.role == 'tool' %}{% continue %}{% endif %}
    {%- if (m.role == 'user') != (ns.n % 2 == 0) %}
        {{- raise_exception('roles must alternate user/assistant') }}
    {%- endif %}
    {%- set ns.n = ns.n + 1 %}
    {%- if m.role == 'assistant' %}
        {%- generation %}[A] {{ m.content }}{{ eos_token }}{% endgeneration %}
    {%- else %}
        [U] {{ m.content | tojson }}
    {% endif %}
{%- endfor %}
{%- if add_generation_prompt %}[A]{% endif %}"""
MESSAGES = [
    {"role": "user", "content": '  Héllo <b>wörld</b> "quoted" 12345  '},
    {"role": "assistant", "content": "Hi!\n\nHow can I help?"},
    {"role": "tool", "content": "ignored"},
    {"role": "user", "content": "What is 3+4?"},
]


def _tokenizers_object(bos_post_processor: bool = False) -> Tokenizer:
    """Byte-level BPE without merges (every byte one token) plus the special tokens above."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, [], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    if bos_post_processor:  # as Llama 3's tokenizer.json: BOS before every encoded text
        bos_id = tok.token_to_id(BOS)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, bos_id)]
        )
    return tok


def _hf_dir(tmp_path, config: dict | None, bos_post_processor=False) -> BPETokenizer:
    _tokenizers_object(bos_post_processor).save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    return BPETokenizer.from_file(tmp_path / "tokenizer.json", [tok.token_to_id(EOT)])


def _transformers(template: str) -> transformers.PreTrainedTokenizerFast:
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=_tokenizers_object(), bos_token=BOS, eos_token=EOT, chat_template=template
    )


@pytest.mark.parametrize("template", [LLAMA3, CHATML, FEATURES], ids=["llama3", "chatml", "misc"])
def test_render_and_ids_match_transformers_apply_chat_template(tmp_path, template):
    tok = _hf_dir(tmp_path, {"chat_template": template, "bos_token": BOS, "eos_token": EOT})
    ref = _transformers(template)
    for msgs in (MESSAGES, MESSAGES[:1], [{"role": "system", "content": "Be brief."}]):
        if template is FEATURES and msgs[0]["role"] == "system":
            continue  # that template refuses a system message (tested below)
        want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert tok.render(msgs) == want
        # transformers encodes the rendered text without adding special tokens
        ids = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert tok.chat(msgs) == list(ids)


def test_template_errors_name_the_file(tmp_path):
    tok = _hf_dir(tmp_path, {"chat_template": FEATURES})
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json.*roles must alternate"):
        tok.chat([{"role": "assistant", "content": "first"}])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json.*does not compile"):
        BPETokenizer.from_file(tmp_path / "tokenizer.json", [0])


def test_sandboxed(tmp_path):
    tok = _hf_dir(tmp_path, {"chat_template": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(TokenizerError, match="unsafe|__class__"):
        tok.chat(MESSAGES[:1])


@pytest.mark.parametrize("add_bos_token", [True, None], ids=["config", "post_processor"])
def test_llama3_template_with_bos_gives_exactly_one_bos(tmp_path, add_bos_token):
    config = {"chat_template": LLAMA3, "bos_token": {"content": BOS, "special": True}}
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    tok = _hf_dir(tmp_path, config, bos_post_processor=add_bos_token is None)
    assert tok.add_bos  # the checkpoint asks for BOS, the template writes it: still one
    ids = tok.chat(MESSAGES[:1])
    bos_id = tok.tok.token_to_id(BOS)
    assert ids[0] == bos_id and ids.count(bos_id) == 1


@pytest.mark.parametrize("add_bos_token", [True, False])
def test_add_bos_token_honoured(tmp_path, add_bos_token):
    config = {"chat_template": CHATML, "bos_token": BOS, "add_bos_token": add_bos_token}
    tok = _hf_dir(tmp_path, config)
    plain = tok.tok.encode(tok.render(MESSAGES[:1]), add_special_tokens=False).ids
    bos_id = tok.tok.token_to_id(BOS)
    assert tok.chat(MESSAGES[:1]) == ([bos_id] if add_bos_token else []) + plain


def test_no_template_falls_back_to_chatml(tmp_path):
    for config in (None, {"bos_token": None, "eos_token": EOT}):  # no file; a file without one
        tok = _hf_dir(tmp_path, config)
        want = "<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n"
        assert tok.render(MESSAGES[3:]) == want
        assert tok.chat(MESSAGES[3:]) == tok.tok.encode(want, add_special_tokens=False).ids


def test_list_chat_template_uses_default_and_jinja_file_wins(tmp_path):
    named = [
        {"name": "tool_use", "template": "TOOLS {{ messages[0].content }}"},
        {"name": "default", "template": "DEFAULT {{ messages[0].content }}"},
    ]
    assert (
        _hf_dir(tmp_path, {"chat_template": named}).render(MESSAGES[3:]) == "DEFAULT What is 3+4?"
    )
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json.*\['tool_use'\].*'default'"):
        _hf_dir(tmp_path, {"chat_template": named[:1]})
    # transformers: chat_template.jinja takes priority over tokenizer_config.json
    (tmp_path / "chat_template.jinja").write_text("FILE {{ messages[0].content }}")
    assert _hf_dir(tmp_path, {"chat_template": named}).render(MESSAGES[3:]) == "FILE What is 3+4?"


# ----------------------------------------------------------------------------- GGUF


def _gguf_fields(**extra) -> dict:
    obj = _tokenizers_object()
    vocab = sorted(obj.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens],
        "tokenizer.ggml.bos_token_id": tokens.index(BOS),
        "tokenizer.ggml.eos_token_id": tokens.index(EOT),
        **extra,
    }


def test_unknown_gguf_pre_tokenizer_is_named():
    for fields in ({"tokenizer.ggml.pre": "llama-bpe"}, {}):
        with pytest.raises(TokenizerError) as e:
            gguf_pre_tokenizer(fields, "/m/x.gguf")
        value = repr(fields.get("tokenizer.ggml.pre"))
        for part in ("/m/x.gguf", "tokenizer.ggml.pre", value, "'smollm'"):
            assert part in str(e.value)
    with pytest.raises(TokenizerError, match=r"x\.gguf: tokenizer\.ggml\.pre = 'qwen2'"):
        BPETokenizer.from_gguf_fields(_gguf_fields(**{"tokenizer.ggml.pre": "qwen2"}), "x.gguf")
    bad_bos = _gguf_fields(**{"tokenizer.ggml.bos_token_id": 10**6})
    with pytest.raises(TokenizerError, match=r"x\.gguf: tokenizer\.ggml\.bos_token_id = 1000000"):
        BPETokenizer.from_gguf_fields(bad_bos, "x.gguf")


def test_gguf_template_and_bos():
    bos_id = _gguf_fields()["tokenizer.ggml.bos_token_id"]
    for template, add_bos, n_bos in ((LLAMA3, True, 1), (CHATML, True, 1), (CHATML, False, 0)):
        fields = _gguf_fields(
            **{"tokenizer.chat_template": template, "tokenizer.ggml.add_bos_token": add_bos}
        )
        tok = BPETokenizer.from_gguf_fields(fields, "x.gguf")
        ids = tok.chat(MESSAGES[:1])
        assert tok.render(MESSAGES[:1]) == _transformers(template).apply_chat_template(
            MESSAGES[:1], tokenize=False, add_generation_prompt=True
        )
        assert ids.count(bos_id) == n_bos and (ids[0] == bos_id) == (n_bos == 1)


# ----------------------------------------------------------------------------- SmolLM2

# What bebop rendered before it read templates: ChatML with this default system message, which
# SmolLM2's template writes when the conversation has none (no BOS: add_bos_token is false).
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def smollm2_fields():
    import gguf

    return gguf_ckpt._fields(gguf.GGUFReader(str(gguf_ckpt.find_smollm2())))


def test_smollm2_chat_prompts_unchanged(smollm2_fields):
    tok = BPETokenizer.from_gguf_fields(smollm2_fields, "SmolLM2.gguf")
    assert tok.chat_template is not None and not tok.add_bos
    ref = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.tok, chat_template=smollm2_fields["tokenizer.chat_template"]
    )
    convs = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Answer in French."}, *MESSAGES[:2], MESSAGES[3]],
        MESSAGES[:2] + MESSAGES[3:],
    ]
    for msgs in convs:
        ids = tok.chat(msgs)
        assert ids == tok.encode(render_chatml(msgs, SMOLLM2_SYSTEM))  # the old path
        want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert tok.render(msgs) == want  # the jinja template itself is the reference
