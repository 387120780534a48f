"""A failure while one request's output is turned into an OpenAI body fails that request only:
its stream ends with an error event (with the request's id, no traceback) and [DONE], a
non-streaming request gets a 500 OpenAI error with its id, and its sequences are given up (the
engine client's generator is closed, which aborts them) while other requests complete."""

import asyncio
import json

import pytest

from moeserve.runtime.request import TokenOutput
from moeserve.runtime.sampling import Finish, SamplingParams
from moeserve.server import openai_api
from moeserve.server.errors import APIError
from moeserve.server.openai_api import Job, OpenAIHandlers, Prompt


class FakeClient:
    """Yields three tokens per sequence; remembers which generators were closed early."""

    def __init__(self):
        self.closed_early = []

    async def run(self, prompts, params, seats, request_id, grammar=None):
        assert grammar is None  # these jobs ask for no structured output
        done = False
        try:
            for step in range(3):
                for i in range(len(prompts)):
                    finish = Finish("length") if step == 2 else None
                    yield i, TokenOutput("x", [step + 1], finish, f"t{step}",
                                         [{"token_id": step + 1, "logprob": -0.5, "top": []}])
                    await asyncio.sleep(0)
            done = True
        finally:
            if not done:
                self.closed_early.append(request_id)


def job(job_id, stream, logprobs):
    return Job("chat", "m", [Prompt([1, 2], "hi")],
               [[SamplingParams(max_new_tokens=3, logprobs=logprobs)]], stream, False,
               id=job_id)


@pytest.fixture
def poisoned(monkeypatch):
    """chat logprobs formatting raises, as a bug in one request's output would."""
    def boom(codec, entries):
        raise KeyError("token_id /home/someone/src/moeserve/secret.py")
    monkeypatch.setattr(openai_api, "chat_logprobs", boom)


async def _collect(gen):
    return [chunk async for chunk in gen]


def test_a_failing_stream_ends_with_an_error_event_and_others_complete(poisoned):
    client = FakeClient()
    h = OpenAIHandlers(client, codec=None, served_names=["m"], context_length=64)

    async def both():
        return await asyncio.gather(_collect(h.stream(job("bad", True, True), None)),
                                    _collect(h.stream(job("good", True, False), None)))

    bad, good = asyncio.run(both())
    assert bad[-1] == b"data: [DONE]\n\n"
    err = json.loads(bad[-2].decode().removeprefix("data: "))["error"]
    assert err["type"] == "server_error" and "bad" in err["message"]
    assert "Traceback" not in err["message"] and "/home/" not in err["message"]
    assert client.closed_early == ["bad"]
    texts = [json.loads(c.decode().removeprefix("data: "))["choices"][0]["delta"].get("content")
             for c in good[:-1]]
    assert "".join(t or "" for t in texts) == "t0t1t2" and good[-1] == b"data: [DONE]\n\n"


def test_a_failing_response_is_a_500_with_its_id_and_others_complete(poisoned):
    client = FakeClient()
    h = OpenAIHandlers(client, codec=None, served_names=["m"], context_length=64)

    async def both():
        return await asyncio.gather(h.respond(job("bad", False, True), None),
                                    h.respond(job("good", False, False), None),
                                    return_exceptions=True)

    bad, good = asyncio.run(both())
    assert isinstance(bad, APIError) and bad.status == 500
    body = bad.body()["error"]
    assert "request id bad" in body["message"] and "/home/" not in body["message"]
    assert good["choices"][0]["message"]["content"] == "t0t1t2"
    assert good["choices"][0]["finish_reason"] == "length"
