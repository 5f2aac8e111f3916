"""Tokenizers behind one small interface: `encode(text, bos=False) -> ids`, `decode(ids)`,
`vocab_size`, `bos_id`, `pad_id`, `eos_ids` (several allowed), and `chat(messages)` for ChatML.

`CharTokenizer` is the demo policy's character-level tokenizer. `BPETokenizer` wraps a HF
`tokenizers.Tokenizer`, from a `tokenizer.json` or built from GGUF metadata (gpt2-style BPE with
a digit-splitting, byte-level pre-tokenizer, as SmolLM2 ships it). Token ids flow from sampler to
learner unchanged: nothing decodes and re-encodes between stages.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
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


class BPETokenizer:
    is_chat = True  # task prompts go in as a user message of the chat template

    def __init__(
        self,
        tok,
        bos_id: int | None,
        eos_ids: Sequence[int],
        pad_id: int,
        default_system: str | None = None,
    ):
        self.tok = tok
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)
        self.pad_id = pad_id
        self.default_system = default_system

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id] + ids if bos and self.bos_id is not None else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def chat(self, messages: Sequence[dict]) -> list[int]:
        return self.encode(render_chatml(messages, self.default_system))

    @classmethod
    def from_file(cls, path: Path, eos_ids: Sequence[int], bos_id=None, pad_id=0):
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)), bos_id, eos_ids, pad_id)

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> BPETokenizer:
        """`fields`: GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`) as Python
        values. Only the gpt2-style BPE model is supported."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' BPE)")
        tokens = fields["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False)
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
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
        template = fields.get("tokenizer.chat_template") or ""
        m = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", template, re.S)
        return cls(
            tok,
            bos_id=None
            if not fields.get("tokenizer.ggml.add_bos_token")
            else fields.get("tokenizer.ggml.bos_token_id"),
            eos_ids=eos_ids,
            pad_id=fields.get("tokenizer.ggml.padding_token_id", eos),
            default_system=m.group(1) if m else None,
        )
