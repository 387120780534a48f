"""Hostile requests against one real server (tiny preset, CPU): each gets a 4xx with an OpenAI
error body, never a 5xx, and the server answers a normal request and /health after each.

The cases extend those of test_server.py, test_server_sampling.py and test_server_guard.py:
malformed JSON, a wrong type for every field, huge and negative numbers, NaN and infinities,
lone surrogates and other unicode, deep nesting, unknown fields, wrong methods and content types,
empty and oversized bodies, arrays where objects belong, bad roles, oversized n. Requests go
over a raw connection so that the method, the headers and the bytes are exactly the case's.
"""

from __future__ import annotations

import http.client as httpclient
import json

import pytest

from server_proc import MODEL, ServerProcess

pytestmark = pytest.mark.timeout(600)
C, H = "/v1/completions", "/v1/chat/completions"
LIMIT = 256 * 1024
JSON = {"Content-Type": "application/json"}
CHEAP = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "ignore_eos": True}
BASE = {C: {"model": MODEL, "prompt": "hi", "max_tokens": 2},
        H: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}


def with_(path, **extra):
    return json.dumps({**BASE[path], **extra}).encode()


def raw_field(path, name, literal):
    """The base body with `name` set to a JSON literal that json.dumps would not write."""
    body = {**BASE[path], name: "@@"}
    return json.dumps(body).replace('"@@"', literal).encode()


def msg(**fields):
    return with_(H, messages=[fields])


# name: (method, path, body bytes or None, headers)
CASES: dict[str, tuple[str, str, bytes | None, dict[str, str]]] = {}


def case(name, body, path=C, method="POST", headers=JSON):
    assert name not in CASES, name
    CASES[name] = (method, path, body, headers)


# --- malformed JSON and bodies that are not an object ------------------------------------------
for p, tag in ((C, "c"), (H, "h")):
    case(f"empty-body-{tag}", b"", p)
    case(f"null-{tag}", b"null", p)
    case(f"number-{tag}", b"42", p)
    case(f"string-{tag}", b'"hello"', p)
    case(f"empty-array-{tag}", b"[]", p)
    case(f"array-of-object-{tag}", b"[" + json.dumps(BASE[p]).encode() + b"]", p)
    case(f"empty-object-{tag}", b"{}", p)
    case(f"trailing-comma-{tag}", json.dumps(BASE[p]).encode()[:-1] + b",}", p)
    case(f"single-quotes-{tag}", json.dumps(BASE[p]).replace('"', "'").encode(), p)
    case(f"trailing-garbage-{tag}", json.dumps(BASE[p]).encode() + b" xyz", p)
case("truncated", b'{"model": "preset:tiny", "prompt": "hi", "max_tokens"')
case("comment", b'{"model": "preset:tiny", /* hi */ "prompt": "hi"}')
case("bare-nan-body", b"NaN")
case("invalid-utf8", b'{"model": "preset:tiny", "prompt": "\xff\xfe\xfd", "max_tokens": 2}')
case("overlong-utf8", b'{"model": "preset:tiny", "prompt": "\xc0\xaf", "max_tokens": 2}')
case("utf16-body", json.dumps(BASE[C]).encode("utf-16"))
case("nul-bytes", b"\x00" * 64)
case("unquoted-key", b'{model: "preset:tiny", "prompt": "hi"}')
case("hex-number", raw_field(C, "max_tokens", "0x10"))
case("leading-zero-number", raw_field(C, "max_tokens", "007"))
case("plus-number", raw_field(C, "max_tokens", "+5"))

# --- deep nesting ----------------------------------------------------------------------------
case("deep-array-prompt", raw_field(C, "prompt", "[" * 100_000 + "]" * 100_000))
case("deep-object-logit-bias", raw_field(C, "logit_bias", '{"a":' * 10_000 + "1" + "}" * 10_000))
case("deep-unclosed", b"[" * 200_000)
case("deep-content-parts", msg(role="user", content=[[[[[[{"type": "text", "text": "x"}]]]]]]))
case("deep-stop", raw_field(H, "stop", "[" * 5000 + '"x"' + "]" * 5000), H)

# --- a wrong type for every field ------------------------------------------------------------
WRONG = {  # field: (endpoint, value)
    "model": (C, 5), "n": (C, "2"), "stream": (C, "yes"), "stream_options": (C, "usage"),
    "max_tokens": (C, 1.5), "temperature": (C, "0.5"), "top_p": (C, [0.5]), "seed": (C, 1.0),
    "stop": (C, 5), "presence_penalty": (C, {"v": 1}), "frequency_penalty": (C, "0"),
    "user": (C, 5), "top_k": (C, "5"), "min_p": (C, [0.1]), "repetition_penalty": (C, "1"),
    "ignore_eos": (C, 1), "stop_token_ids": (C, "5"), "logit_bias": (C, [1, 2]),
    "prompt": (C, 5), "logprobs": (C, True), "echo": (C, "yes"), "best_of": (C, "2"),
    "suffix": (C, 5),
    "messages": (H, {"role": "user", "content": "hi"}), "max_completion_tokens": (H, "5"),
    "top_logprobs": (H, 2.0), "tools": (H, "all"), "tool_choice": (H, 5),
    "parallel_tool_calls": (H, "yes"), "functions": (H, {"f": 1}), "function_call": (H, 5),
    "response_format": (H, "json"),
}
for field, (p, value) in WRONG.items():
    case(f"wrong-type-{field}", with_(p, **{field: value}), p)
case("wrong-type-bool-as-float", with_(C, temperature=True))
case("wrong-type-bool-as-int", with_(C, max_tokens=False))
case("wrong-type-stop-item", with_(H, stop=["ok", 7]), H)
case("wrong-type-stop-token-item", with_(C, stop_token_ids=[1, "2"]))
case("wrong-type-prompt-mixed", with_(C, prompt=[[1, 2], "text"]))
case("wrong-type-prompt-nested-str", with_(C, prompt=[[1, "a"]]))
case("wrong-type-prompt-null", with_(C, prompt=None))
case("wrong-type-prompt-object", with_(C, prompt={"text": "hi"}))
case("wrong-type-include-usage", with_(C, stream=True, stream_options={"include_usage": "y"}))
case("unknown-stream-option", with_(C, stream=True, stream_options={"include_usage": True,
                                                                   "x": 1}))
case("wrong-type-logprobs-chat", with_(H, logprobs=1), H)

# --- messages --------------------------------------------------------------------------------
case("messages-empty", with_(H, messages=[]), H)
case("messages-null", with_(H, messages=None), H)
case("message-number", with_(H, messages=[5]), H)
case("message-array", with_(H, messages=[["user", "hi"]]), H)
case("message-no-role", msg(content="hi"), H)
case("role-number", msg(role=1, content="hi"), H)
case("tool-call-id-number", msg(role="tool", content="hi", tool_call_id=5), H)
case("tool-calls-not-a-list", msg(role="assistant", content="", tool_calls={"id": "c"}), H)
case("tool-call-arguments-object", msg(role="assistant", content="", tool_calls=[{
    "id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]), H)
case("tool-call-type-unknown", msg(role="assistant", content="", tool_calls=[{
    "id": "c", "type": "code", "function": {"name": "f", "arguments": "{}"}}]), H)
case("role-function", msg(role="function", content="hi"), H)
case("role-empty", msg(role="", content="hi"), H)
case("role-uppercase", msg(role="USER", content="hi"), H)
case("role-unicode", msg(role="usér", content="hi"), H)
case("content-number", msg(role="user", content=5), H)
case("content-object", msg(role="user", content={"text": "hi"}), H)
case("part-without-text", msg(role="user", content=[{"type": "text"}]), H)
case("part-text-number", msg(role="user", content=[{"type": "text", "text": 5}]), H)
case("part-unknown-type", msg(role="user", content=[{"type": "audio", "text": "x"}]), H)
case("part-string", msg(role="user", content=["hi"]), H)
case("message-name-number", msg(role="user", content="hi", name=5), H)

# --- huge and negative numbers, NaN and infinities -------------------------------------------
case("max-tokens-huge", with_(C, max_tokens=10**30))
case("max-tokens-negative", with_(H, max_tokens=-1), H)
case("n-huge", with_(C, n=10**9))
case("n-negative", with_(H, n=-3), H)
case("n-times-prompts-over-queue", with_(C, n=128, prompt=["a"] * 9))
case("seed-googol", with_(C, seed=10**100))
case("seed-float-huge", with_(C, seed=1e30))
case("top-p-negative", with_(H, top_p=-0.5), H)
case("top-k-very-negative", with_(H, top_k=-(2**70)), H)
case("top-k-float", with_(C, top_k=5.0))
case("min-p-negative", with_(H, min_p=-0.1), H)
case("presence-penalty-huge-negative", with_(C, presence_penalty=-1e308))
case("logprobs-negative", with_(C, logprobs=-1))
case("logprobs-huge", with_(C, logprobs=10**12))
case("top-logprobs-huge", with_(H, logprobs=True, top_logprobs=10**6), H)
case("stop-token-id-negative", with_(C, stop_token_ids=[-1]))
case("stop-token-id-huge", with_(C, stop_token_ids=[2**80]))
case("prompt-token-negative", with_(C, prompt=[-1, 5]))
case("prompt-token-huge", with_(C, prompt=[2**70]))
case("prompt-token-float", with_(C, prompt=[1.0, 2.0]))
case("prompts-empty", with_(C, prompt=[]))
case("prompt-tokens-empty", with_(C, prompt=[[]]))
for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
    case(f"temperature-{literal}", raw_field(C, "temperature", literal))
    case(f"top-p-{literal}", raw_field(H, "top_p", literal), H)
case("max-tokens-nan", raw_field(C, "max_tokens", "NaN"))
case("n-infinity", raw_field(H, "n", "Infinity"), H)
case("seed-nan", raw_field(C, "seed", "NaN"))
case("min-p-nan", raw_field(C, "min_p", "NaN"))
case("frequency-penalty-infinity", raw_field(H, "frequency_penalty", "Infinity"), H)
case("presence-penalty-minus-infinity", raw_field(C, "presence_penalty", "-Infinity"))

# --- stops -----------------------------------------------------------------------------------
case("stop-empty-string", with_(C, stop=""))
case("stop-list-with-empty", with_(H, stop=["ok", ""]), H)
case("stop-too-long-unicode", with_(C, stop=["é" * 1025]))
case("stop-10000", with_(H, stop=[f"s{i}" for i in range(10_000)]), H)

# --- unicode ---------------------------------------------------------------------------------
case("model-unicode", with_(C, model="модель-🙂"))
case("model-lone-surrogate", raw_field(C, "model", '"\\ud800"'))
case("unknown-field-lone-surrogate", json.dumps(BASE[C]).encode()[:-1]
     + b', "\\udc00x": 1}')
case("unknown-field-unicode", with_(C, **{"温度": 0.5}))
case("role-lone-surrogate", raw_field(H, "messages", '[{"role": "\\ud800", "content": "x"}]'),
     H)
case("part-type-lone-surrogate", raw_field(
    H, "messages", '[{"role": "user", "content": [{"type": "\\udfff", "text": "x"}]}]'), H)
case("prompt-lone-surrogate-and-bad-n", raw_field(C, "prompt", '"a\\ud800b"')[:-1]
     + b', "n": 0}')
case("stop-lone-surrogate-too-many", raw_field(H, "stop", json.dumps(["\ud800"] * 65)), H)
case("content-rtl-zero-width-and-bad-max", with_(H, messages=[
    {"role": "user", "content": "\u202e\u200b\u2066\ufeff\U0010ffff"}], max_tokens=0), H)
case("prompt-lone-surrogate", raw_field(C, "prompt", '"a\\ud800b"'))
case("prompts-lone-low-surrogate", raw_field(C, "prompt", '["ok", "\\udc00"]'))
case("stop-lone-surrogate", raw_field(H, "stop", '"\\ud83d"'), H)
case("content-lone-surrogate", raw_field(
    H, "messages", '[{"role": "user", "content": "\\ud83d"}]'), H)
case("content-reversed-pair", raw_field(H, "messages", '[{"role": "user", "content": '
                                        '[{"type": "text", "text": "\\ude00\\ud83d"}]}]'), H)
case("unknown-model-nul", with_(C, model="preset:tiny\x00"))
case("unknown-model-newlines", with_(C, model="a\r\nX-Injected: 1"))

# --- unknown fields --------------------------------------------------------------------------
case("unknown-field-nested-object", with_(C, extra_body={"x": {"y": [1]}}))
case("unknown-field-many", json.dumps({**BASE[C], **{f"f{i}": i for i in range(1000)}})
     .encode())
case("unknown-field-chat-functions-v2", with_(H, web_search_options={}), H)
case("tool-choice-without-tools", with_(H, tool_choice="required"), H)
case("response-format-unknown-type", with_(H, response_format={"type": "xml"}), H)
case("response-format-schema-missing", with_(H, response_format={"type": "json_schema"}), H)
case("response-format-schema-not-object", with_(H, response_format={
    "type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}), H)
case("response-format-schema-invalid", with_(H, response_format={
    "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}), H)
case("regex-unbalanced", with_(C, regex="(a"))
case("two-grammars", with_(C, regex="a", guided_choice=["a"]))
case("unsupported-suffix", with_(C, suffix="end"))
case("unsupported-best-of", with_(C, best_of=3))

# --- methods, routes, content types, sizes ---------------------------------------------------
for m in ("GET", "PUT", "DELETE", "PATCH"):
    case(f"method-{m.lower()}-chat", with_(H) if m in ("PUT", "PATCH") else None, H, m)
case("method-delete-completions", None, C, "DELETE")
case("method-delete-models", None, "/v1/models", "DELETE")
case("method-post-models", b"{}", "/v1/models")
case("method-post-health", b"{}", "/health")
case("method-options-no-cors", None, C, "OPTIONS")
case("model-route-unknown", None, "/v1/models/gpt-unknown", "GET")
case("route-traversal", None, "/v1/../../etc/passwd", "GET")
case("route-trailing-slash", with_(C), C + "/")
for ctype in ("application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
              "application/xml", "text/json", "application/jsonx", ""):
    case(f"content-type-{ctype.split(';')[0].replace('/', '-') or 'empty'}", with_(H), H,
         headers={"Content-Type": ctype})
case("content-type-missing", with_(C), C, headers={})
case("oversized-body", with_(C, prompt="x" * (LIMIT + 1)))
case("oversized-chat", with_(H, messages=[{"role": "user", "content": "y" * LIMIT}]), H)

# --- oversized n -----------------------------------------------------------------------------
case("n-over-max-chat", with_(H, n=1000), H)
case("n-max-times-prompts", with_(C, n=128, prompt=["a"] * 100))


def send(server: ServerProcess, method: str, path: str, body: bytes | None,
         headers: dict[str, str]) -> tuple[int, bytes]:
    conn = httpclient.HTTPConnection(server.host, server.port, timeout=120)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("hostile") / "server.log",
                         "--max-request-bytes", str(LIMIT))
    yield proc
    assert proc.terminate() == 0, proc.log()


def served(server: ServerProcess) -> None:
    status, payload = send(server, "GET", "/health", None, {})
    assert status == 200, payload
    status, payload = send(server, "POST", C, json.dumps(CHEAP).encode(), JSON)
    assert status == 200, payload
    assert json.loads(payload)["usage"]["completion_tokens"] == 1


def test_there_are_at_least_100_cases():
    assert len(CASES) >= 100, len(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_request_is_a_4xx_and_the_server_goes_on(server, name):
    method, path, body, headers = CASES[name]
    status, payload = send(server, method, path, body, headers)
    assert 400 <= status < 500, (status, payload[:500])
    err = json.loads(payload)
    assert isinstance(err, dict) and set(err) == {"error"}, err
    assert isinstance(err["error"]["message"], str) and err["error"]["message"], err
    assert isinstance(err["error"]["type"], str) and err["error"]["type"], err
    assert "Traceback" not in payload.decode("utf-8", "replace"), err
    served(server)


LEGAL_UNICODE = ["\u202e\u200b\u2066\ufeff", "\U0010ffff\U0001f600", "模型 ́é\u0301", "\x00\x7f"]


@pytest.mark.parametrize("text", LEGAL_UNICODE)
def test_legal_unicode_in_prompts_stops_and_messages_is_served(server, text):
    """The other side of the unicode cases: valid text anywhere is served (200), whole."""
    for path, extra in ((C, {"prompt": text, "stop": [text]}),
                        (H, {"messages": [{"role": "user", "content": text},
                                          {"role": "assistant", "content": text}],
                             "stop": text})):
        status, payload = send(server, "POST", path, with_(path, **extra, ignore_eos=True),
                               JSON)
        assert status == 200, payload
        body = json.loads(payload)
        assert body["usage"]["completion_tokens"] >= 1 or body["choices"][0][
            "finish_reason"] == "stop", body


def test_the_server_logged_no_internal_error(server):
    served(server)
    log = server.log()
    assert "Traceback" not in log and " 500 " not in log, log[-3000:]
