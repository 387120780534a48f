"""The engine's output side: stop strings matched in time linear in the new text (boundaries,
overlaps, streaming hold-back, against a brute-force reference), and a failure in one request's
output (its detokenizer) that fails that request only while the engine serves the others."""

import random
import threading
import time

import pytest

from moeserve.runtime.engine import Engine
from moeserve.runtime.output import RequestState, StopMatcher
from moeserve.runtime.request import TokenOutput
from moeserve.runtime.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS, Finish, SamplingParams

FLAGS = dict(load_format="dummy", device="cpu", max_total_tokens=4096, context_length=256)


class PieceDetok:
    """A detokenizer whose token id i is the text pieces[i]."""

    def __init__(self, pieces):
        self.pieces = pieces

    def add(self, t):
        return self.pieces[t]

    def flush(self):
        return ""


def run(pieces, stops, finish_last=None):
    """Feed one token per piece; (text a stream sent, its finish, ended_here of each step)."""
    st = RequestState("r", SamplingParams(stop=tuple(stops), max_new_tokens=1000), 0,
                      PieceDetok(pieces))
    sent, finish, ended = [], None, []
    for i in range(len(pieces)):
        last = finish_last if i == len(pieces) - 1 else None
        out, here = st.translate(TokenOutput("r", [i], last))
        sent.append(out.text)
        ended.append(here)
        if out.finish is not None:
            finish = out.finish
            break
    return "".join(sent), finish, ended


def reference(pieces, stops):
    """Brute force: after each piece, the earliest-ending stop in the whole text (the longest
    of those ending together); the text before it."""
    text = ""
    for p in pieces:
        before = len(text)
        text += p
        for end in range(before + 1, len(text) + 1):
            found = [s for s in stops if text[:end].endswith(s)]
            if found:
                s = max(found, key=len)
                return text[:end - len(s)], s
    return text, None


def test_stop_spanning_two_tokens_is_held_back_then_cut():
    text, finish, ended = run(["hello E", "N", "D more"], ["END"])
    assert text == "hello " and finish == Finish("stop", "END") and ended[-1]


def test_stop_at_the_start_gives_empty_text():
    assert run(["ST", "OP", "x"], ["STOP"])[:2] == ("", Finish("stop", "STOP"))
    assert run(["STOPx"], ["STOP"])[:2] == ("", Finish("stop", "STOP"))


def test_overlapping_stops_first_end_wins_then_longest():
    # "bc" ends before "abcd" does: a client reading characters one by one sees it first
    assert run(["abcd"], ["abcd", "bc"])[:2] == ("a", Finish("stop", "bc"))
    # "abc" and "bc" end on the same character: the longer one, which starts earlier
    assert run(["xab", "c"], ["bc", "abc"])[:2] == ("x", Finish("stop", "abc"))
    # a stop whose prefix is its suffix (KMP's failure links): "aab" in "aaab"
    assert run(["a", "a", "a", "b"], ["aab"])[:2] == ("a", Finish("stop", "aab"))


def test_partial_match_that_fails_is_released():
    sent = []
    st = RequestState("r", SamplingParams(stop=("END",), max_new_tokens=9), 0,
                      PieceDetok(["abc E", "N", "X", "!"]))
    for i in range(4):
        sent.append(st.translate(TokenOutput("r", [i]))[0].text)
    assert sent == ["abc ", "", "ENX", "!"]
    # the finish sends what was held back
    st = RequestState("r", SamplingParams(stop=("END",), max_new_tokens=9), 0,
                      PieceDetok(["abc E", "N"]))
    st.translate(TokenOutput("r", [0]))
    assert st.translate(TokenOutput("r", [1], Finish("length")))[0].text == "EN"


def test_random_texts_match_the_brute_force_reference():
    rng = random.Random(1234)
    for _ in range(400):
        alphabet = "ab c"[:rng.randint(2, 4)]
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 4))]
        pieces = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3)))
                  for _ in range(rng.randint(1, 12))]
        text, finish, _ = run(pieces, stops, finish_last=Finish("length"))
        want_text, want_stop = reference(pieces, stops)
        assert text == want_text, (pieces, stops)
        assert (finish.matched if finish and finish.reason == "stop" else None) == want_stop


def test_matching_cost_does_not_grow_with_the_text():
    """64 stops of 1024 characters (the caps) that almost match a long repetitive output: a
    token costs the same late in the output as early on."""
    stops = tuple("a" * (MAX_STOP_CHARS - 1) + chr(0x100 + k) for k in range(MAX_STOP_STRINGS))
    m = StopMatcher(stops)

    def cost(tokens):
        t0 = time.perf_counter()
        for _ in range(tokens):
            assert m.feed("aaaa") is None
        return time.perf_counter() - t0

    early = cost(200)
    for _ in range(20):
        cost(200)
    late = cost(200)
    assert m.held == MAX_STOP_CHARS - 1
    assert late < 3 * early + 0.05, (early, late)


# --- fault isolation through a real engine ---------------------------------------------------

class FailingDetok:
    """Wraps a detokenizer; raises on the n-th token."""

    def __init__(self, inner, after):
        self.inner, self.after, self.seen = inner, after, 0

    def add(self, t):
        self.seen += 1
        if self.seen > self.after:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected for the test")
        return self.inner.add(t)

    def flush(self):
        return self.inner.flush()


@pytest.fixture(scope="module")
def engine():
    with Engine("preset:tiny", **FLAGS) as e:
        yield e


def test_a_failing_detokenizer_fails_its_request_only(engine, monkeypatch):
    tok = engine.tokenizer
    real = tok.detokenizer
    poisoned = tok.encode("poison here")

    def detokenizer(prompt_ids=(), **kw):
        d = real(prompt_ids, **kw)
        return FailingDetok(d, 2) if list(prompt_ids) == poisoned else d

    monkeypatch.setattr(tok, "detokenizer", detokenizer)
    params = {"max_new_tokens": 12, "ignore_eos": True}
    results = {}

    def go(name, prompt, stream):
        if stream:
            results[name] = list(engine.stream(prompt, params))
        else:
            results[name] = engine.generate(prompt, params)

    jobs = [("bad", "poison here", False), ("bad-stream", "poison here", True),
            ("ok1", "hello world", False), ("ok2", "hello world", True),
            ("ok3", "another prompt", False)]
    threads = [threading.Thread(target=go, args=j) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    bad = results["bad"]
    assert bad["error"].startswith("the request's output failed (UnicodeDecodeError")
    assert bad["finish_reason"] is None
    assert results["bad-stream"][-1]["error"].startswith("the request's output failed")
    for name in ("ok1", "ok3"):
        assert results[name]["error"] is None
        assert results[name]["usage"]["completion_tokens"] == 12
    assert results["ok2"][-1]["finish_reason"] == "length"
    assert all(c["error"] is None for c in results["ok2"])
    # the poisoned requests were aborted in the workers: none runs on
    deadline = time.monotonic() + 30
    while engine.kv_stats().get("running", 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not engine.closed and engine.failure is None
    after = engine.generate("hello world", params)
    assert after["error"] is None and after["usage"]["completion_tokens"] == 12
