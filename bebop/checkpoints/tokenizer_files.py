"""Hugging Face tokenizer files for a bebop tokenizer: an HF source's own files copied, a GGUF
source's BPE tokenizer written as `tokenizer.json` + `tokenizer_config.json` (with its chat
template), the demo's character tokenizer as an equivalent `tokenizer.json`. Used by the export
command and by the tiny random checkpoints of smoke runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from bebop.tokenizer import CharTokenizer

# Tokenizer files of an HF source, copied when present.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def char_tokenizer_json(tok: CharTokenizer):
    """A `tokenizers.Tokenizer` with the ids of `tok`: one token per character (BPE without
    merges over one pre-token: the whole text), the specials as special tokens, BOS prepended
    when special tokens are added (the demo's prompts start with BOS)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    vocab = {s: i for i, s in enumerate(tok.specials)}
    vocab.update({c: i + len(tok.specials) for i, c in enumerate(tok.alphabet)})
    t = Tokenizer(models.BPE(vocab, [], fuse_unk=False))
    t.decoder = decoders.Fuse()  # join tokens without the default separating spaces
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in tok.specials])
    bos = tok.specials[tok.bos_id]
    t.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.bos_id)]
    )
    return t


def write_tokenizer(out: Path, source: str, tok, hf_source: Path | None = None) -> dict:
    """Writes the tokenizer files of the tokenizer `tok` of a policy from `source`
    (`policy.source`; for "hf": copied from its directory `hf_source`); returns the special token
    ids {bos, eos, pad} (eos: a list when there are several)."""
    eos = list(tok.eos_ids)
    ids = {"bos": tok.bos_id, "eos": eos if len(eos) > 1 else eos[0], "pad": tok.pad_id}
    if source == "hf":
        for name in HF_TOKENIZER_FILES:
            if (hf_source / name).exists():
                shutil.copy2(hf_source / name, out / name)
        return ids
    if source == "sft":  # the demo's CharTokenizer
        fast, add_bos, template = char_tokenizer_json(tok), True, None
    else:  # GGUF: the BPE tokenizer bebop built from its metadata (parity-tested vs transformers)
        fast, add_bos = tok.tok, tok.add_bos
        template = tok.chat_template.text if tok.chat_template is not None else None
    fast.save(str(out / "tokenizer.json"))

    def name(i):
        return fast.id_to_token(i) if i is not None else None

    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(ids["bos"]),
        "eos_token": name(eos[0]),
        "pad_token": name(ids["pad"]),
        "add_bos_token": add_bos,
        "clean_up_tokenization_spaces": False,
    }
    if template:
        tok_cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return ids


def read_char_tokenizer(path: Path) -> CharTokenizer | None:
    """The `CharTokenizer` a `tokenizer.json` is the export of (`char_tokenizer_json`: a BPE
    without merges whose vocabulary is the demo's specials, then one character per id), or None
    for any other tokenizer. The demo policy reads raw prompts: read back as a chat tokenizer, its
    prompts would be wrapped in a chat template of characters it has never seen."""
    try:
        spec = json.loads(Path(path).read_text(encoding="utf-8"))
        model = spec["model"]
        if model.get("type") != "BPE" or model.get("merges"):
            return None
        vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    specials = CharTokenizer.specials
    tokens = [t for t, _ in vocab]
    if [i for _, i in vocab] != list(range(len(vocab))) or tuple(
        tokens[: len(specials)]
    ) != specials:
        return None
    alphabet = tokens[len(specials) :]
    if not alphabet or any(len(t) != 1 for t in alphabet) or len(set(alphabet)) != len(alphabet):
        return None
    return CharTokenizer("".join(alphabet))
