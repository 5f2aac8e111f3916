"""Tokenizers behind one small interface: `encode(text, bos=False) -> ids`, `decode(ids)`,
`vocab_size`, `bos_id`, `pad_id`, `eos_ids` (several allowed), and `chat(messages)`.

`CharTokenizer` is the demo policy's character-level tokenizer. `BPETokenizer` wraps a HF
`tokenizers.Tokenizer`, from a `tokenizer.json` or built from GGUF metadata (gpt2-style BPE with
a digit-splitting, byte-level pre-tokenizer, as SmolLM2 ships it). Its `chat` renders the
checkpoint's own jinja chat template as transformers does (ChatML when it has none). Token ids
flow from sampler to learner unchanged: nothing decodes and re-encodes between stages.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

DEMO_ALPHABET = "0123456789+-*/=()<>,;?: \n"


def render_chatml(messages: Sequence[dict], default_system: str | None, add_generation_prompt=True):
    """ChatML: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message (+ assistant header)."""
    parts = []
    if default_system is not None and (not messages or messages[0]["role"] != "system"):
        parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    for m in messages:
        parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


@functools.cache
def _jinja_env():
    """The environment transformers renders chat templates in: sandboxed (templates come from
    checkpoints, i.e. untrusted), `trim_blocks`/`lstrip_blocks`, loop controls, `{% generation %}`
    (a no-op here), `raise_exception`, `strftime_now` and a `tojson` that does not escape HTML."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        # `{% generation %}` marks assistant spans (for loss masks); here it renders its body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class TokenizerError(ValueError):
    """A tokenizer file or its chat template is unusable; the message names the file and key."""


class ChatTemplate:
    """A checkpoint's jinja chat template, compiled once. `source` names where it came from (for
    errors); `bos_token`/`eos_token` are the strings the template sees under those names."""

    def __init__(self, text: str, source: str, bos_token: str | None, eos_token: str | None):
        import jinja2

        self.text, self.source = text, source
        # as transformers: a special token the checkpoint lacks is undefined, not ""
        tokens = {"bos_token": bos_token, "eos_token": eos_token}
        self.variables = {k: v for k, v in tokens.items() if v is not None}
        try:
            self._compiled = _jinja_env().from_string(text)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{source}: the chat template does not compile: {e}") from e

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        import jinja2

        try:
            return self._compiled.render(
                messages=[dict(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.variables,
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{self.source}: the chat template failed: {e}") from e


class CharTokenizer:
    is_chat = False  # the demo policies see raw task prompts, no chat template
    pad_id, bos_id, eos_id = 0, 1, 2
    specials = ("<pad>", "<bos>", "<eos>")

    def __init__(self, alphabet: str = DEMO_ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("CharTokenizer: alphabet has repeated characters")
        self.alphabet = alphabet
        self._ids = {c: i + len(self.specials) for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.specials) + len(self.alphabet)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    def encode(self, text: str, bos: bool = False) -> list[int]:
        try:
            ids = [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"CharTokenizer: character {e.args[0]!r} not in the alphabet") from e
        return [self.bos_id] + ids if bos else ids

    def decode(self, ids) -> str:
        n = len(self.specials)
        return "".join(self.alphabet[i - n] for i in ids if i >= n)

    def chat(self, messages: Sequence[dict]) -> list[int]:
        return self.encode("".join(m["content"] for m in messages), bos=True)


def _digits_then_byte_level():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


# `tokenizer.ggml.pre` values whose llama.cpp pre-tokenization bebop reproduces, by name. "smollm":
# each digit alone, then GPT-2's regex, decoded without cleaning up spaces (checked against
# transformers on SmolLM2 in tests/test_checkpoints.py). llama.cpp splits "starcoder", "refact",
# "codeshell" and "exaone" with the same two regexes but cleans up spaces when decoding, so they
# are not listed; other values use other regexes.
GGUF_PRE_TOKENIZERS = {"smollm": _digits_then_byte_level}


def gguf_pre_tokenizer(fields: dict, source: str):
    """The `tokenizers` pre-tokenizer for the GGUF metadata's `tokenizer.ggml.pre`, or an error
    naming `source` (the file), the key and the value."""
    pre = fields.get("tokenizer.ggml.pre")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise TokenizerError(
            f"{source}: tokenizer.ggml.pre = {pre!r} is not a supported pre-tokenizer "
            f"(supported: {', '.join(map(repr, GGUF_PRE_TOKENIZERS))})"
        )
    return GGUF_PRE_TOKENIZERS[pre]()


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _hf_chat_template(config: dict, config_file: Path) -> str | None:
    """`chat_template` of a tokenizer_config.json: a string, or a list of {name, template} of
    which transformers uses the one named "default"."""
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and "name" in t for t in value):
        named = {t["name"]: t.get("template") for t in value}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise TokenizerError(
            f"{config_file}: chat_template lists templates {sorted(named)} but none named "
            "'default' (with a string template)"
        )
    raise TokenizerError(
        f"{config_file}: chat_template must be a string or a list of {{name, template}}, "
        f"not {type(value).__name__}"
    )


class BPETokenizer:
    is_chat = True  # task prompts go in as a user message of the chat template

    def __init__(
        self,
        tok,
        bos_id: int | None,
        eos_ids: Sequence[int],
        pad_id: int,
        chat_template: ChatTemplate | None = None,
        add_bos: bool = False,
    ):
        """`chat_template`: the checkpoint's (None: ChatML without a system message). `add_bos`:
        whether the checkpoint wants BOS before a prompt; `chat` adds it unless the rendered
        template already starts with it."""
        self.tok = tok
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)
        self.pad_id = pad_id
        self.chat_template = chat_template
        self.add_bos = add_bos and bos_id is not None
        self.bos_token = tok.id_to_token(bos_id) if bos_id is not None else None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id] + ids if bos and self.bos_id is not None else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render(self, messages: Sequence[dict]) -> str:
        """The prompt text for `messages`, ending in the assistant's header."""
        if self.chat_template is None:
            return render_chatml(messages, None)
        return self.chat_template.render(messages, add_generation_prompt=True)

    def chat(self, messages: Sequence[dict]) -> list[int]:
        text = self.render(messages)
        # one BOS: templates such as Llama 3's write `{{ bos_token }}` themselves
        bos = self.add_bos and not text.startswith(self.bos_token)
        return self.encode(text, bos=bos)

    @classmethod
    def from_file(cls, path: Path, eos_ids: Sequence[int], bos_id=None, pad_id=0):
        """`path`: a `tokenizer.json`. The chat template and BOS come from the files beside it, as
        transformers reads them: `chat_template.jinja`, else `tokenizer_config.json`'s
        `chat_template`; its `bos_token`, and `add_bos_token` (absent: whether tokenizer.json's
        own post-processor puts BOS first)."""
        from tokenizers import Tokenizer

        path = Path(path)
        tok = Tokenizer.from_file(str(path))
        config_file = path.parent / "tokenizer_config.json"
        config = {}
        if config_file.exists():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise TokenizerError(f"{config_file}: not valid UTF-8 JSON ({e})") from e
            if not isinstance(config, dict):
                raise TokenizerError(f"{config_file}: expected a JSON object")
        bos_token = _token_text(config.get("bos_token"))
        if bos_id is None and bos_token is not None:
            bos_id = tok.token_to_id(bos_token)
            if bos_id is None:
                raise TokenizerError(f"{config_file}: bos_token {bos_token!r} is not in {path}")
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:
            first = tok.encode("", add_special_tokens=True).ids[:1]
            add_bos = bos_id is not None and first == [bos_id]
        eos_token = _token_text(config.get("eos_token"))
        if eos_token is None and eos_ids:
            eos_token = tok.id_to_token(eos_ids[0])
        jinja_file = path.parent / "chat_template.jinja"
        if jinja_file.exists():  # transformers: the file wins over tokenizer_config.json
            text, source = jinja_file.read_text(encoding="utf-8"), jinja_file
        else:
            text, source = _hf_chat_template(config, config_file), config_file
        template = None
        if text is not None:
            template = ChatTemplate(text, str(source), bos_token, eos_token)
        return cls(tok, bos_id, eos_ids, pad_id, template, add_bos)

    @classmethod
    def from_gguf_fields(cls, fields: dict, source: str = "GGUF metadata") -> BPETokenizer:
        """`fields`: GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`) as Python
        values; `source` names the file in errors. Only the gpt2-style BPE model is supported,
        with the pre-tokenizers of `GGUF_PRE_TOKENIZERS`."""
        from tokenizers import AddedToken, Tokenizer, decoders, models

        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(
                f"{source}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2' BPE)"
            )
        pre_tokenizer = gguf_pre_tokenizer(fields, source)
        tokens = fields["tokenizer.ggml.tokens"]
        for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            i = fields.get(key)
            if i is not None and not 0 <= i < len(tokens):
                raise TokenizerError(f"{source}: {key} = {i} is not in the {len(tokens)} tokens")
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False)
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizer
        tok.decoder = decoders.ByteLevel()
        types = fields.get("tokenizer.ggml.token_type", [1] * len(tokens))
        tok.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty == 3
            ]
        )
        eos = fields.get("tokenizer.ggml.eos_token_id")
        eos_ids = [eos] + [i for i, t in enumerate(tokens) if t in ("<|endoftext|>",) and i != eos]
        bos = fields.get("tokenizer.ggml.bos_token_id")
        template = None
        if fields.get("tokenizer.chat_template"):
            template = ChatTemplate(
                fields["tokenizer.chat_template"],
                f"{source}: tokenizer.chat_template",
                tokens[bos] if bos is not None else None,
                tokens[eos] if eos is not None else None,
            )
        return cls(
            tok,
            bos_id=bos,
            eos_ids=eos_ids,
            pad_id=fields.get("tokenizer.ggml.padding_token_id", eos),
            chat_template=template,
            # llama.cpp's default for BPE vocabularies is no BOS
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        )
