"""Sampling fields at and past their ranges through `moeserve serve`: a value out of range is a
400 with an OpenAI error body naming the range, before anything runs; a value at a boundary is
served; the server answers a normal request after each. The request of issue 35 that used to
kill the server (repetition_penalty 1e-300 with sampling) is among them."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from moeserve.runtime.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS, RANGES
from moeserve.server.protocol import ChatCompletionRequest, CompletionRequest
from server_proc import MODEL, ServerProcess, http

pytestmark = pytest.mark.timeout(300)
COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 8}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

# (endpoint, field, value, the rule's name in RANGES or "stop")
OUT_OF_RANGE = [
    ("/v1/completions", "repetition_penalty", 1e-300, "repetition_penalty"),
    ("/v1/completions", "repetition_penalty", 1e-39, "repetition_penalty"),
    ("/v1/completions", "repetition_penalty", 0, "repetition_penalty"),
    ("/v1/chat/completions", "repetition_penalty", 2.5, "repetition_penalty"),
    ("/v1/completions", "temperature", -1e-9, "temperature"),
    ("/v1/completions", "top_p", 0, "top_p"),
    ("/v1/chat/completions", "top_p", 1.5, "top_p"),
    ("/v1/completions", "top_k", -2, "top_k"),
    ("/v1/completions", "min_p", 1.01, "min_p"),
    ("/v1/completions", "frequency_penalty", -2.01, "frequency_penalty"),
    ("/v1/chat/completions", "presence_penalty", 1e300, "presence_penalty"),
    ("/v1/completions", "n", 0, "n"),
    ("/v1/completions", "n", 129, "n"),
    ("/v1/completions", "logprobs", 21, "top_logprobs"),
    ("/v1/chat/completions", "top_logprobs", -1, "top_logprobs"),
    ("/v1/completions", "max_tokens", 0, "max_new_tokens"),
    ("/v1/chat/completions", "max_completion_tokens", -5, "max_new_tokens"),
    ("/v1/completions", "seed", 2**64, "seed"),
    ("/v1/completions", "seed", -(2**63) - 1, "seed"),
    ("/v1/completions", "stop", ["x"] * (MAX_STOP_STRINGS + 1), "stop"),
    ("/v1/chat/completions", "stop", "y" * (MAX_STOP_CHARS + 1), "stop"),
]


def _body(path, extra):
    return {**(COMPLETION if path == "/v1/completions" else CHAT), **extra}


@pytest.mark.parametrize("path,name,value,rule", OUT_OF_RANGE)
def test_protocol_names_the_range(path, name, value, rule):
    """The request models check each field against the engine's own rule."""
    cls = CompletionRequest if path == "/v1/completions" else ChatCompletionRequest
    with pytest.raises(ValidationError) as e:
        cls.model_validate_json(json.dumps(_body(path, {name: value})), strict=True)
    err = e.value.errors()[0]
    assert err["loc"] == (name,) and err["type"] == "invalid_value"
    if rule != "stop":
        assert str(RANGES[rule]) in err["msg"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("sampling") / "server.log")
    yield proc
    assert proc.terminate() == 0, proc.log()


def _served(server, path="/v1/completions"):
    status, _, body = http(server, "POST", path, _body(path, {"ignore_eos": True}))
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == _body(path, {})["max_tokens"]


def test_the_request_that_killed_the_server(server):
    status, _, err = http(server, "POST", "/v1/completions",
                          {**COMPLETION, "repetition_penalty": 1e-300})
    assert status == 400, err
    assert err["error"]["param"] == "repetition_penalty"
    assert err["error"]["type"] == "invalid_request_error"
    assert str(RANGES["repetition_penalty"]) in err["error"]["message"]
    assert http(server, "GET", "/health")[0] == 200
    _served(server)


@pytest.mark.parametrize("path,name,value,rule", OUT_OF_RANGE)
def test_out_of_range_is_a_400(server, path, name, value, rule):
    status, _, err = http(server, "POST", path, _body(path, {name: value}))
    assert status == 400, err
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["param"] == name and err["error"]["code"] == "invalid_value", err
    assert "must be" in err["error"]["message"]
    _served(server, path)


@pytest.mark.parametrize("raw", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_non_finite_numbers_are_a_400(server, raw):
    body = json.dumps({**COMPLETION, "temperature": 0.5, "repetition_penalty": 1.0})
    body = body.replace('"repetition_penalty": 1.0', '"repetition_penalty": ' + raw.decode())
    status, _, err = http(server, "POST", "/v1/completions", raw=body.encode())
    assert status == 400, err
    assert err["error"]["param"] == "repetition_penalty"
    _served(server)


@pytest.mark.parametrize("extra", [
    {"repetition_penalty": 1e-6, "temperature": 1.01e-5},
    {"repetition_penalty": 2.0, "frequency_penalty": -2.0, "presence_penalty": 2.0,
     "temperature": 1e30},
    {"top_p": 1e-300, "top_k": 2**62, "min_p": 1.0, "seed": 2**64 - 1, "logprobs": 20},
    {"temperature": 0, "seed": -(2**63), "n": 3, "top_k": 0},
    {"stop": ["z" * MAX_STOP_CHARS] * MAX_STOP_STRINGS, "temperature": 2.0},
])
def test_boundary_values_are_served(server, extra):
    status, _, body = http(server, "POST", "/v1/completions",
                           {**COMPLETION, **extra, "ignore_eos": True})
    assert status == 200, body
    for choice in body["choices"]:
        assert choice["finish_reason"] in ("stop", "length")
        if "logprobs" in extra:
            lp = choice["logprobs"]
            assert all(isinstance(x, float) for x in lp["token_logprobs"])
    assert len(body["choices"]) == extra.get("n", 1)
    _served(server)
