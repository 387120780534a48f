"""Structured outputs in the runtime: the bitmask in the sampler, the matchers' masks, and
grammars through a real engine (with and without the overlap schedule, n > 1 alike)."""

from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar as xgr

from moeserve.runtime.engine import Engine
from moeserve.runtime.grammar import (MAX_UNROLL, GrammarBackend, GrammarError, GrammarSpec,
                                      can_start, fill_bitmask, tokenizer_info,
                                      unroll_bounded_strings)
from moeserve.runtime.sampler import Sampler, SamplingBatch
from moeserve.runtime.sampling import SamplingParams
from moeserve.runtime.tokenizer import load_tokenizer

V = 300  # not a multiple of 32: the last bitmask word is partly past the vocabulary


def _allowed(bitmask_BW: torch.Tensor, vocab: int = V) -> torch.Tensor:
    """[B, vocab] bool from an xgrammar bitmask, bit by bit (the reference)."""
    words = bitmask_BW.to(torch.int64) & 0xFFFFFFFF
    bits = (words[:, :, None] >> torch.arange(32)) & 1
    return bits.reshape(bitmask_BW.shape[0], -1)[:, :vocab].bool()


def test_sampler_applies_the_bitmask_and_keeps_raw_logprobs():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    B = 6
    logits = torch.randn(B, V, generator=g) * 4
    bitmask = torch.randint(-2**31, 2**31 - 1, (B, (V + 31) // 32), generator=g,
                            dtype=torch.int32)
    bitmask[3] = -1  # a row without a grammar allows every token
    allowed = _allowed(bitmask)
    params = [SamplingParams(temperature=0.0, logprobs=True),
              SamplingParams(temperature=1.0, seed=1, logprobs=True),
              SamplingParams(temperature=0.7, top_p=0.9, seed=2, logprobs=True),
              SamplingParams(temperature=0.0, logprobs=True),
              SamplingParams(temperature=1.5, top_k=5, seed=3, presence_penalty=1.0,
                             logprobs=True),
              SamplingParams(temperature=2.0, seed=4, logprobs=True)]
    before = logits.clone()
    for trial in range(20):
        sb = SamplingBatch.build(params, [[trial % V]] * B, None, V, steps=[trial] * B,
                                 token_bitmask=bitmask)
        out = Sampler("cpu", seed=trial)(logits, sb)
        tokens = out.token_ids_B
        assert allowed[torch.arange(B), tokens].all(), (trial, tokens)
        # greedy rows: the most likely allowed token
        for r in (0, 3):
            assert tokens[r] == logits[r].masked_fill(~allowed[r], -torch.inf).argmax()
        # logprobs are the model's own (raw logits), not renormalised over the allowed set
        raw = torch.log_softmax(logits, dim=-1)
        assert torch.allclose(out.logprobs_B, raw[torch.arange(B), tokens])
    assert torch.equal(logits, before)  # the model's logits are left as they were
    # without a bitmask a row goes where the mask would have forbidden
    free = Sampler("cpu")(logits, SamplingBatch.build(params[:1], [[]], None, V))
    assert free.token_ids_B[0] == logits[0].argmax()
    assert not allowed[0, logits[0].argmax()] or allowed[0].all()


@pytest.fixture(scope="module")
def backend():
    tok = load_tokenizer("preset:tiny")
    return tok, GrammarBackend(tokenizer_info(tok, 320, tok.eos_token_ids), max_threads=1)


def test_matcher_masks_follow_the_grammar(backend):
    tok, be = backend
    spec = GrammarSpec.json_schema({"type": "object", "properties": {
        "k": {"enum": ["ab", "cd"]}}, "required": ["k"]})
    m = be.matcher(spec)
    text = '{"k": "cd"}'
    for t in tok.encode(text):
        mask = _allowed(fill_bitmask([None, m], 320)[1:], 320)[0]
        # exactly the byte that keeps the text a prefix of some valid output may follow
        assert mask[t]
        assert mask.sum() <= 2  # '{', then one of '"a'/'"c' or the fixed next byte
        assert m.accept_token(t)
    # complete: only EOS may follow; once it is taken the matcher has ended, and its row
    # allows everything (its request finished while a step was in flight)
    mask = _allowed(fill_bitmask([m], 320), 320)[0]
    assert mask.nonzero().flatten().tolist() == [256]
    assert m.accept_token(256) and m.is_terminated()
    assert _allowed(fill_bitmask([m], 320), 320)[0].all()
    assert fill_bitmask([None, None], 320) is None
    # compiled once per spec (an LRU keyed by it)
    n = be.compiles
    be.matcher(GrammarSpec.json_schema({"type": "object", "properties": {
        "k": {"enum": ["ab", "cd"]}}, "required": ["k"]}))
    assert be.compiles == n


@pytest.mark.parametrize("spec", [GrammarSpec("regex", "(ab"),
                                  GrammarSpec("json_schema", '{"type": "nope"}'),
                                  GrammarSpec("ebnf", 'root ::= "a" |'),
                                  GrammarSpec("ebnf", 'start ::= "a"'),
                                  GrammarSpec("structural_tag", "{}")])
def test_invalid_grammars_say_why(spec):
    with pytest.raises(GrammarError, match=f"invalid {spec.kind.replace('_', ' ')}: .+"):
        spec.check()


@pytest.mark.parametrize("spec", [GrammarSpec.json_schema({"$ref": "#"}),
                                  GrammarSpec("regex", r"[^\s\S]"),
                                  GrammarSpec("ebnf", 'root ::= [^\\x00-\\U0010FFFF]')])
def test_grammars_that_match_no_text_say_so(spec):
    assert not can_start(spec.grammar())
    with pytest.raises(GrammarError, match="matches no text"):
        spec.check()


@pytest.mark.parametrize("spec", [GrammarSpec("regex", ""), GrammarSpec("regex", "é+"),
                                  GrammarSpec("regex", r"a[^\s\S]"),
                                  GrammarSpec("ebnf", 'root ::= "a" root'),
                                  GrammarSpec("json_object")])
def test_grammars_that_can_begin_pass(spec):
    r"""The empty text alone (the stop token first), a multi-byte first character, and
    languages whose first steps parse although no text ends them (`a[^\s\S]` is empty,
    `root ::= "a" root` infinite): their dead end comes in generation."""
    assert can_start(spec.grammar())
    spec.check()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_grammar_dead_end_fails_its_request_alone(overlap):
    r"""After `a`, `a[^\s\S]` allows no token: its request ends with an error that says so,
    marked as the request's own; a request beside it goes on."""
    torch.set_num_threads(1)
    dead = GrammarSpec("regex", r"a[^\s\S]")
    with Engine("preset:tiny", load_format="dummy", device="cpu", max_total_tokens=4096,
                disable_overlap_schedule=not overlap) as engine:
        outs = []
        _, q_dead = engine.submit(list(b"say a"), SamplingParams(max_new_tokens=8), grammar=dead)
        _, q_free = engine.submit(list(b"say a"), SamplingParams(max_new_tokens=8,
                                                                 ignore_eos=True))
        while True:
            out = q_dead.get(timeout=60)
            outs.append(out)
            if out.finish is not None or out.error is not None:
                break
        assert outs[-1].invalid_request, outs[-1]
        assert "grammar allows no token after 1 output token:" in outs[-1].error
        assert [t for o in outs for t in o.token_ids] == [ord("a")]  # not the refused one
        assert engine._collect("", q_free)["finish_reason"] == "length"


@pytest.mark.parametrize("overlap", [True, False])
def test_engine_outputs_follow_their_grammars(overlap):
    torch.set_num_threads(1)
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "n": {"type": "integer", "minimum": -5, "maximum": 300},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
        "required": ["name", "n", "tags"]}
    grammars = [GrammarSpec("regex", r"(yes|no)-[0-9]{2,4}"),
                GrammarSpec.json_schema(schema), None,
                GrammarSpec("ebnf", 'root ::= "(" [a-c]+ ")"')]
    with Engine("preset:tiny", load_format="dummy", device="cpu", max_total_tokens=4096,
                disable_overlap_schedule=not overlap) as engine:
        with pytest.raises(GrammarError):
            engine.submit([1, 2], None, grammar=GrammarSpec("regex", "[a-"))
        queues = []
        for k, g in enumerate(grammars * 3):  # n > 1: three sequences of each, sampled
            params = SamplingParams(max_new_tokens=120, temperature=1.0, seed=k,
                                    ignore_eos=g is None)
            queues.append((g, engine.submit(list(b"give json"), params, grammar=g)[1]))
        for g, q in queues:
            out = engine._collect("", q)
            assert out["error"] is None
            text = out["text"]
            if g is None:
                assert out["finish_reason"] == "length"
                continue
            assert out["finish_reason"] == "stop", (g, text)  # the grammar's end ends it
            if g.kind == "regex":
                assert re.fullmatch(r"(yes|no)-[0-9]{2,4}", text), text
            elif g.kind == "ebnf":
                assert re.fullmatch(r"\([a-c]+\)", text), text
            else:
                value = json.loads(text)
                assert set(value) == {"name", "n", "tags"} and -5 <= value["n"] <= 300
                assert re.fullmatch("[a-z]{1,6}", value["name"])


def test_tokenizer_info_marks_padding_ids_unusable(backend):
    tok, be = backend
    m = be.matcher(GrammarSpec("regex", "[^a]*"))
    mask = _allowed(fill_bitmask([m], 320), 320)[0]
    assert not mask[257:].any() and mask[ord("b")] and not mask[ord("a")]
    assert isinstance(be.info, xgr.TokenizerInfo)


def _walk_vocab(seed: int = 0, size: int = 3000) -> list[bytes]:
    """A byte-level vocabulary of the kinds of tokens a mask must sort: every byte, then
    pieces of words, digits, JSON punctuation (quotes and backslashes inside them), whitespace
    and multi-byte characters, some cut mid-character."""
    g = torch.Generator().manual_seed(seed)
    alphabet = [*"abcxyzAZ09 ", '"', "\\", ",", ":", "}", "]", "{", "[", "\t", "\n", "é", "中"]
    vocab, seen = [bytes([b]) for b in range(256)], set()
    while len(vocab) < size - 1:
        n = int(torch.randint(2, 9, (1,), generator=g))
        text = "".join(alphabet[i] for i in torch.randint(len(alphabet), (n,), generator=g))
        piece = text.encode()[:int(torch.randint(2, 4 * n, (1,), generator=g))]
        if len(piece) > 1 and piece not in seen:
            seen.add(piece)
            vocab.append(piece)
    return vocab + [b"<eos>"]


BOUNDED = {"type": "object", "properties": {
    "a": {"type": "string", "maxLength": 5},
    "b": {"type": "string", "minLength": 2, "maxLength": 4},
    "c": {"type": "array", "items": {"type": "string", "maxLength": 3}},
    "d": {"type": "string", "maxLength": 0},
    "e": {"type": "string", "maxLength": 12}, "f": {"type": "string"}},
    "required": ["a", "b", "c", "e", "f"], "additionalProperties": False}


@pytest.mark.parametrize("spec", [
    GrammarSpec.json_schema(BOUNDED),
    GrammarSpec.json_schema({"type": "string", "minLength": 2, "maxLength": 2}),
    GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": {
        "type": "tags_with_separator", "separator": "\n", "at_least_one": True,
        "stop_after_first": False, "tags": [{"type": "tag", "begin": "<f>", "end": "</f>",
                                             "content": {"type": "json_schema",
                                                         "json_schema": BOUNDED}}]}}))])
def test_bounded_strings_unroll_to_the_same_masks(spec):
    """A bounded string's chain of rules (grammar.unroll_bounded_strings) gives the masks of
    xgrammar's counted repetition, bit for bit, along random walks through the grammar (the
    bits past the vocabulary in the last word are left as either fill happens to leave them)."""
    vocab = _walk_vocab()
    V = len(vocab) + 5  # the model's padding ids too
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=V,
                             stop_token_ids=[len(vocab) - 1])
    be = GrammarBackend(info, max_threads=1)
    assert unroll_bounded_strings(str(spec.grammar())) != str(spec.grammar())
    reference = be.compiler.compile_grammar(spec.grammar())
    rows = 0
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        fast, slow = be.matcher(spec), xgr.GrammarMatcher(reference)
        for _ in range(300):
            if slow.is_terminated():
                break
            masks = _allowed(fill_bitmask([fast, slow], V), V)
            assert torch.equal(masks[0], masks[1]), (seed, rows)
            allowed = masks[1].nonzero().flatten()
            token = int(allowed[torch.randint(len(allowed), (1,), generator=g)])
            assert fast.accept_token(token) and slow.accept_token(token)
            assert fast.is_terminated() == slow.is_terminated()
            rows += 1
    assert rows >= 12 * 2  # (every walk: its text, then EOS)


def test_long_bounds_stay_repetitions():
    text = str(GrammarSpec.json_schema({"type": "string", "maxLength": MAX_UNROLL + 1}).grammar())
    assert unroll_bounded_strings(text) == text
    text = str(GrammarSpec.json_schema({"type": "string", "maxLength": MAX_UNROLL}).grammar())
    assert "_len_0" in unroll_bounded_strings(text)
