"""Tokenizer of a checkpoint: `tokenizers` from tokenizer.json, the chat template rendered with
jinja2 as transformers renders it, special tokens and EOS ids from the checkpoint's files, and an
incremental detokenizer for streaming.

    tok = load_tokenizer(cfg.model, spec)
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    dec = tok.detokenizer(prompt_ids=ids)
    for t in generated: text += dec.add(t)
    text += dec.flush()

Files read from the checkpoint folder: tokenizer.json (required), tokenizer_config.json (chat
template, bos/eos/pad tokens), chat_template.jinja / chat_template.json (where newer
transformers saves the template), generation_config.json and config.json (eos_token_id).
A `preset:NAME` model has no vocabulary: a byte-level stand-in (ids 0-255 are bytes, 256 ends
the text) lets the engine run text through dummy weights.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from tokenizers import Tokenizer as HFTokenizer

REPLACEMENT = "\ufffd"  # what a decoder yields for the bytes of an unfinished character


class TokenizerError(ValueError):
    pass


def _token_text(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from exc


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class IncrementalDetokenizer:
    """Text of a growing sequence of ids, handed out as soon as it is final.

    It decodes a short window of ids twice, with and without the newest ones, and hands out
    the difference only when it does not end in an unfinished character: a character whose
    bytes span several tokens appears once, whole, when its last token arrives. Decoding a
    window that starts a few tokens back also keeps the leading spaces that some decoders
    strip at the start of a text."""

    def __init__(self, tokenizer: "Tokenizer", prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True, context: int = 5):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-context:]) if context else []
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.ids)  # ids before this are handed out already
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_id: int) -> str:
        """Append one id; return the text that became final (possibly "")."""
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""
        new = full[len(prefix):]
        # the next window starts at the ids just handed out; drop the ones before it
        del self.ids[:self.read_offset]
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.text += new
        return new

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character decodes as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        new = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += new
        return new


class _GenerationTag:
    """jinja2 extension for `{% generation %}...{% endgeneration %}` (assistant-mask markers of
    some templates): renders its body unchanged."""

    @staticmethod
    def build() -> Any:
        from jinja2 import nodes
        from jinja2.ext import Extension

        class GenerationTag(Extension):
            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.CallBlock(self.call_method("_render", []), [], [], body
                                       ).set_lineno(lineno)

            def _render(self, caller: Any) -> str:
                return caller()

        return GenerationTag


def compile_chat_template(source: str) -> Any:
    """A jinja2 template in transformers' environment: sandboxed, trim_blocks, lstrip_blocks,
    loop controls, its tojson (no HTML escaping), raise_exception and strftime_now."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols",
                                                    _GenerationTag.build()])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, *, chat_template: Optional[str] = None,
                 special_tokens: Optional[dict[str, str]] = None,
                 eos_token_ids: Iterable[int] = (), name: str = ""):
        self.name = name
        self.hf = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # bos_token, eos_token, pad_token, ...
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_token_ids = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        eos = set(eos_token_ids)
        eos_text = self.special_tokens.get("eos_token")
        if eos_text is not None and tokenizer.token_to_id(eos_text) is not None:
            eos.add(tokenizer.token_to_id(eos_text))
        self.eos_token_ids = frozenset(eos)
        bos_text = self.special_tokens.get("bos_token")
        self.bos_token_id = tokenizer.token_to_id(bos_text) if bos_text else None
        self._template: Any = None

    # --- ids <-> text ---------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # the batch call releases the GIL (a long prompt tokenized in a server thread does not
        # hold up the event loop) and its _fast form skips the offsets; same ids as encode
        encode = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
        return encode([text], add_special_tokens=add_special_tokens)[0].ids

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), found without encoding (a huge prompt is refused
        at once, not after seconds of tokenizing): a token stands for at most
        `max_token_bytes` bytes of the normalized text, a character is at least a byte, and
        Unicode normalization shrinks a text less than SHRINK-fold. 0 when a normalizer that
        may shrink a text without bound (strip, replace, ...) comes first."""
        bound = self._chars_per_token_bound
        return 0 if bound is None else len(text) // bound

    @functools.cached_property
    def _chars_per_token_bound(self) -> Optional[int]:
        """The most characters of a text one token can account for (see min_tokens)."""
        spec = json.loads(self.hf.to_str()).get("normalizer")
        shrink = 1 if spec is None else _normalizer_shrink(spec)
        if shrink is None:
            return None
        longest = max((len(t.encode("utf-8")) for t in
                       self.hf.get_vocab(with_added_tokens=True)), default=1)
        return shrink * max(longest, 1)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self.hf.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> Optional[int]:
        return self.hf.token_to_id(token)

    def detokenizer(self, prompt_ids: Sequence[int] = (),
                    skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)

    # --- chat -----------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *,
                            add_generation_prompt: bool = True,
                            tools: Optional[Sequence[dict[str, Any]]] = None,
                            **kwargs: Any) -> str:
        """The prompt text of a conversation, rendered as transformers renders it (the extra
        keyword arguments reach the template, e.g. enable_thinking for Qwen3)."""
        if self.chat_template is None:
            raise TokenizerError(f"the tokenizer of {self.name or 'this model'} has no chat "
                                 "template (tokenizer_config.json / chat_template.jinja); send "
                                 "a plain prompt to the completions API instead")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        return self._template.render(messages=list(messages), tools=tools,
                                     add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens, **kwargs)

    def encode_chat(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Token ids of the rendered conversation; the template writes the special tokens, so
        none are added (as transformers' apply_chat_template(tokenize=True))."""
        return self.encode(self.apply_chat_template(messages, **kwargs),
                           add_special_tokens=False)


# ------------------------------------------------------------------------------------------

# normalizers that change a text's length by a bounded factor (Unicode composition and case
# mapping shrink a text's bytes less than SHRINK-fold; prepending only grows it)
BOUNDED_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend"})
SHRINK = 4


def _normalizer_shrink(spec: dict[str, Any]) -> Optional[int]:
    """How many-fold a tokenizer.json normalizer may shrink a text (None: without bound)."""
    parts = spec.get("normalizers", []) if spec.get("type") == "Sequence" else [spec]
    if all(p.get("type") in BOUNDED_NORMALIZERS for p in parts):
        return SHRINK
    return None


def _chat_template(folder: Path, tok_cfg: dict[str, Any]) -> Optional[str]:
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template") or _read_json(folder / "chat_template.json").get(
        "chat_template")
    if isinstance(template, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def byte_tokenizer() -> HFTokenizer:
    """256 byte tokens and <|endoftext|> (id 256), byte-level like GPT-2, no merges."""
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return tok


def _byte_of(char: str) -> int:
    """The byte a GPT-2 byte-level character stands for."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    code = ord(char)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def checkpoint_eos_ids(model: str, vocab_size: int) -> frozenset[int]:
    """EOS ids a checkpoint declares (generation_config.json, else config.json), for engines
    that run without a tokenizer; the stand-in's for presets."""
    if model.startswith("preset:"):
        return frozenset({256}) if vocab_size > 256 else frozenset()
    folder = Path(model)
    folder = folder.parent if folder.is_file() else folder
    eos = _ids(_read_json(folder / "generation_config.json").get("eos_token_id")) or _ids(
        _read_json(folder / "config.json").get("eos_token_id"))
    return frozenset(i for i in eos if 0 <= i < vocab_size)


def load_tokenizer(model: str, spec: Any = None) -> Tokenizer:
    """The tokenizer of checkpoint folder `model` (or a byte-level stand-in for preset:NAME).
    `spec` (the ModelSpec) bounds the EOS ids to the model's vocabulary."""
    if model.startswith("preset:"):
        return Tokenizer(byte_tokenizer(), special_tokens={"eos_token": "<|endoftext|>"},
                         name=model)
    folder = Path(model)
    if folder.is_file():
        folder = folder.parent
    path = folder / "tokenizer.json"
    if not path.exists():
        raise TokenizerError(f"{folder} has no tokenizer.json; moeserve reads fast "
                             "(tokenizers) tokenizers only: save one with transformers' "
                             "tokenizer.save_pretrained")
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises its own Exception type
        raise TokenizerError(f"{path} cannot be read: {exc}") from exc
    tok_cfg = _read_json(folder / "tokenizer_config.json")
    special = {k: _token_text(tok_cfg.get(k)) for k in
               ("bos_token", "eos_token", "pad_token", "unk_token")}
    special = {k: v for k, v in special.items() if v is not None}
    gen_eos = _ids(_read_json(folder / "generation_config.json").get("eos_token_id"))
    eos = gen_eos or _ids(_read_json(folder / "config.json").get("eos_token_id"))
    vocab = max(hf.get_vocab_size(with_added_tokens=True),
                getattr(spec, "vocab_size", 0) or 0)
    return Tokenizer(hf, chat_template=_chat_template(folder, tok_cfg), special_tokens=special,
                     eos_token_ids=[i for i in eos if 0 <= i < vocab], name=str(folder))
