"""Tokenizers. `CharTokenizer` is the demo policy's character-level tokenizer.

Ids 0-2 are the specials `<pad>`, `<bos>`, `<eos>`; the rest map one character each. Token ids
flow from sampler to learner unchanged: nothing decodes and re-encodes between stages.
"""

from __future__ import annotations

DEMO_ALPHABET = "0123456789+-*=,>?: \n"


class CharTokenizer:
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
