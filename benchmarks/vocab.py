"""A checkpoint folder for dummy weights with a vocabulary the size of the model's: the preset's
config.json and a byte-level tokenizer.json of `vocab_size` tokens (the 256 bytes, then words,
words after a space, digit runs, JSON punctuation runs and CJK characters, like a BPE
vocabulary's; the last id is <|endoftext|>, the EOS).

A preset's own stand-in has 257 tokens, so a grammar's mask over it costs next to nothing;
xgrammar's work per step grows with the vocabulary, and a benchmark of structured output needs
one of a real size. The prompts are token ids, so the tokenizer never encodes text (it has no
merges); it decodes outputs and gives xgrammar every token's bytes.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Iterator

EOS = "<|endoftext|>"
PUNCT = '{}[]":,. \n'


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as one printable character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _words(rng: random.Random) -> Iterator[str]:
    letters = string.ascii_lowercase
    while True:
        kind = rng.random()
        if kind < 0.70:  # a word, often after a space, sometimes capitalised
            w = "".join(rng.choice(letters) for _ in range(rng.randint(2, 10)))
            w = w.capitalize() if rng.random() < 0.2 else w
            yield (" " + w) if rng.random() < 0.5 else w
        elif kind < 0.78:
            yield "".join(rng.choice(string.digits) for _ in range(rng.randint(1, 3)))
        elif kind < 0.88:
            yield "".join(rng.choice(PUNCT) for _ in range(rng.randint(2, 4)))
        else:
            yield "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 2)))


def synthetic_tokens(vocab_size: int, seed: int = 0) -> list[str]:
    """`vocab_size - 1` distinct token texts (the 256 single bytes first) in the byte-level
    alphabet; the caller adds EOS as the last id."""
    if vocab_size < 258:
        raise ValueError(f"a byte-level vocabulary needs at least 258 ids, not {vocab_size}")
    table = bytes_to_unicode()
    tokens = [table[b] for b in range(256)]
    seen = set(tokens)
    for text in _words(random.Random(seed)):
        if len(tokens) == vocab_size - 1:
            break
        piece = "".join(table[b] for b in text.encode("utf-8"))
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
    return tokens


def write_checkpoint(folder: Path, model: str, seed: int = 0) -> Path:
    """config.json of `model` (a preset), and a tokenizer of its full vocabulary, in folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from moeserve.config.spec import load_hf_config, load_model_spec

    vocab_size = load_model_spec(model).vocab_size
    tokens = synthetic_tokens(vocab_size, seed)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    eos = len(tokens)
    assert tok.token_to_id(EOS) == eos == vocab_size - 1
    config = {**load_hf_config(model), "eos_token_id": eos}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return folder
