"""Structured outputs: a request's grammar, compiled by xgrammar, as a token mask per step.

A `GrammarSpec` is what a request asks for (a JSON schema, any JSON object, a regex, an EBNF
grammar, or an xgrammar structural tag); it is checked where the request arrives (`check`:
parsing needs no tokenizer), so a bad one is the client's error. Each rank keeps a
`GrammarBackend`: the checkpoint's vocabulary as xgrammar's TokenizerInfo, a compiler, and an LRU
cache of compiled grammars keyed by the spec. A request's `GrammarMatcher` lives on its `Req`
in the scheduler, which advances it with every sampled token; before a step samples, the model
runner has the matchers fill one bitmask row per sampling request (`fill_bitmask`), which the
sampler applies on the device.

Every rank that samples a request holds its own matcher and advances it with the same tokens:
xgrammar is deterministic, so the masks, and with them the sampled tokens, agree on every rank
without a collective (docs/DESIGN.md, "Structured outputs").

A JSON string with a `maxLength` compiles (xgrammar's JSON schema converter) into a counted
repetition of its character class, whose mask xgrammar computes by walking every token of the
vocabulary through its parser at each step: 10-30 ms a row at a 150k vocabulary, where an open
string's mask costs tens of microseconds (xgrammar issue 852). `unroll_bounded_strings` writes
the same language as a chain of rules, one per number of characters read, whose masks xgrammar
precomputes like an open string's; the masks are the same bit for bit (tests/runtime/
test_grammar.py).
"""

from __future__ import annotations

import collections
import functools
import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
CACHE_SIZE = 256  # compiled grammars kept per rank
# a random or weak model may pad JSON with whitespace forever: outputs are compact
JSON_OPTIONS = {"any_whitespace": False}
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
# xgrammar's EBNF of a bounded JSON string: `rule ::= (("\"" chars{lo, hi} "\""))`, where
# `chars ::= (([class]))`
_BOUNDED_STRING = re.compile(r'^(\w+) ::= \(\("\\"" (\w+)\{(\d+), (\d+)\} "\\""\)\)$', re.M)
_CLASS_RULE = re.compile(r"\(\(\[(?:\\.|[^\]\\])*\]\)\)")
_RULE = re.compile(r"^(\w+) ::= (.*)$", re.M)
BYTE_VOCAB = 257  # the vocabulary of `can_start`: the 256 bytes and a stop token
MAX_UNROLL = 256  # longer bounds stay xgrammar's repetition (a rule per character compiles slowly)


class GrammarError(ValueError):
    """A grammar that cannot be used; the message says what is wrong with it."""


@dataclass(frozen=True)
class GrammarSpec:
    """A request's output constraint: `kind` (one of KINDS) and its text (the JSON schema as
    JSON, the regex, the EBNF with a `root` rule, the structural tag as JSON; empty for
    json_object). Frozen and hashable: it is the key of the compile cache."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; one of {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: Any) -> "GrammarSpec":
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be a JSON object (or true/false)")
        return cls("json_schema", json.dumps(schema, sort_keys=True))

    def grammar(self) -> Any:
        """The xgrammar Grammar; GrammarError (with xgrammar's reason) when it is invalid."""
        import xgrammar as xgr

        try:
            if self.kind == "json_schema":
                return xgr.Grammar.from_json_schema(self.text, **JSON_OPTIONS)
            if self.kind == "json_object":
                return xgr.Grammar.from_json_schema('{"type": "object"}', **JSON_OPTIONS)
            if self.kind == "regex":
                return xgr.Grammar.from_regex(self.text)
            if self.kind == "ebnf":
                return xgr.Grammar.from_ebnf(self.text)
            return xgr.Grammar.from_structural_tag(self.text)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"invalid {self.kind.replace('_', ' ')}: {_reason(exc)}") from None

    def check(self) -> None:
        """Raise GrammarError unless the grammar parses and some text can begin it
        (`can_start`; the answers of the last CACHE_SIZE specs are kept: a schema with
        counted repetitions takes tens of ms to compile even over 257 tokens)."""
        if not _spec_can_start(self):
            raise GrammarError(f"the {self.kind.replace('_', ' ')} matches no text: no output "
                               "can satisfy it")


@functools.lru_cache(maxsize=CACHE_SIZE)
def _spec_can_start(spec: GrammarSpec) -> bool:
    return can_start(spec.grammar())


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location."""
    text = str(exc).strip()
    first = text.split("\n", 1)[0]
    return (_CPP_PREFIX.sub("", first) or text)[:500]


def can_start(grammar: Any) -> bool:
    """Whether `grammar` allows a first step: its first mask over a vocabulary of the 256
    bytes and a stop token allows one. Every text is spelled in those bytes, so a grammar whose
    language has a text allows its first byte (or, for the empty text alone, the stop); one
    that allows nothing (`{"$ref": "#"}`, the regex `[^\\s\\S]`) matches no text. A language
    that is empty although its first bytes parse (`a[^\\s\\S]`) passes, and stops at its
    dead end (`allows_no_token`)."""
    import xgrammar as xgr

    compiler = _byte_compiler()
    with compiler.lock:
        compiled = compiler.compile_grammar(grammar)
    return not allows_no_token(xgr.GrammarMatcher(compiled), BYTE_VOCAB)


def allows_no_token(matcher: Any, vocab_size: int) -> bool:
    """Whether `matcher`'s next mask allows no token of the vocabulary: its grammar cannot go
    on from here with these tokens (nor end)."""
    bitmask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask)
    return not bool(bitmask.any())


@functools.cache
def _byte_compiler() -> Any:
    """A grammar compiler over the 256 bytes and a stop token (for `can_start`), made once,
    with a lock: the server checks requests' grammars from several threads."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"</s>"],
                             vocab_type=xgr.VocabType.RAW, stop_token_ids=[256])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiler.lock = threading.Lock()
    return compiler


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> Any:
    """xgrammar's view of the vocabulary of our Tokenizer (runtime/tokenizer.py): ids past the
    tokenizer's own vocabulary (the model's padding) are never allowed."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf)
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                              stop_token_ids=sorted(stop_token_ids))


class GrammarBackend:
    """Compiles grammars for one rank (LRU-cached by spec) and makes their matchers."""

    def __init__(self, info: Any, cache_size: int = CACHE_SIZE, max_threads: int = 8) -> None:
        import xgrammar as xgr

        self.info = info
        self.vocab_size = info.vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self.cache: collections.OrderedDict[GrammarSpec, Any] = collections.OrderedDict()
        self.cache_size = cache_size
        self.compiles = 0  # cache misses, for tests and logs
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, model: str, spec: Any, eos_token_ids: Sequence[int]) -> "GrammarBackend":
        from moeserve.runtime.tokenizer import load_tokenizer

        tok = load_tokenizer(model, spec)
        return cls(tokenizer_info(tok, spec.vocab_size, eos_token_ids or tok.eos_token_ids))

    def compiled(self, spec: GrammarSpec) -> Any:
        with self._lock:
            hit = self.cache.get(spec)
            if hit is not None:
                self.cache.move_to_end(spec)
                return hit
        compiled = self.compiler.compile_grammar(fast_form(spec.grammar()))
        with self._lock:
            self.compiles += 1
            self.cache[spec] = compiled
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec) -> Any:
        """A fresh matcher of `spec` (GrammarError when the grammar is invalid)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiled(spec))


def fast_form(grammar: Any) -> Any:
    """`grammar`, or the same language with its bounded strings unrolled
    (`unroll_bounded_strings`), whose masks are the same and cheaper to fill."""
    import xgrammar as xgr

    text = str(grammar)
    unrolled = unroll_bounded_strings(text)
    return grammar if unrolled == text else xgr.Grammar.from_ebnf(unrolled)


def unroll_bounded_strings(ebnf: str) -> str:
    """xgrammar EBNF with each bounded string `rule ::= "\"" chars{lo, hi} "\""` (hi at most
    MAX_UNROLL) replaced by a chain: `rule_len_i` is the rest of the string after i characters,
    which may close it once i >= lo and take another character while i < hi."""
    rules = dict(_RULE.findall(ebnf))
    chains: list[str] = []

    def unroll(m: re.Match) -> str:
        rule, chars, lo, hi = m.group(1), m.group(2), int(m.group(3)), int(m.group(4))
        if hi > MAX_UNROLL or lo > hi or not _CLASS_RULE.fullmatch(rules.get(chars, "")):
            return m.group(0)
        base = f"{rule}_len"
        while any(name.startswith(base + "_") for name in rules):
            base += "_"
        for i in range(hi + 1):
            ways = (['("\\"")'] if i >= lo else []) + ([f"({chars} {base}_{i + 1})"]
                                                       if i < hi else [])
            chains.append(f"{base}_{i} ::= ({' | '.join(ways)})")
        return f'{rule} ::= (("\\"" {base}_0))'

    unrolled = _BOUNDED_STRING.sub(unroll, ebnf)
    return unrolled if not chains else unrolled.rstrip("\n") + "\n" + "\n".join(chains) + "\n"


def fill_bitmask(matchers: Sequence[Optional[Any]], vocab_size: int,
                 pin: bool = False) -> Optional[torch.Tensor]:
    """One int32 bitmask row per row of a step ([S, ceil(V / 32)]), from each row's matcher;
    None when no row has one. A row without a matcher, or whose matcher has ended (its request
    finished while this step was in flight; the token is dropped), allows every token.
    `pin`: in page-locked memory, so that its copy to a GPU does not wait for the device."""
    live = [(j, m) for j, m in enumerate(matchers) if m is not None and not m.is_terminated()]
    if not any(m is not None for m in matchers):
        return None
    words = (vocab_size + 31) // 32
    bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32, pin_memory=pin)
    if live:  # the rows in parallel, on xgrammar's threads
        _batch_matcher().batch_fill_next_token_bitmask([m for _, m in live], bitmask,
                                                       [j for j, _ in live])
    return bitmask


@functools.cache
def _batch_matcher() -> Any:
    """xgrammar's batch filler (its own thread pool, sized to the machine), made once."""
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher(max_threads="auto")


def apply_bitmask(logits_SV: torch.Tensor, bitmask_SW: torch.Tensor) -> None:
    """Set, in place, the logits of the tokens each row's bitmask forbids to -inf (xgrammar's
    kernel: Triton or CUDA on a GPU, its C++ on a CPU)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits_SV, bitmask_SW.to(logits_SV.device,
                                                             non_blocking=True))
