"""Sampling and logprobs as OpenAI and vLLM define them, through `moeserve serve` and the
official openai client: seeded choices, the sampled token in completions' top_logprobs, echo
with logprobs, vLLM's prompt_logprobs, logit_bias, min_tokens, skip_special_tokens, a content
key on every streamed chat chunk, and the fields that are accepted and change nothing.

The tiny preset's tokenizer is byte-level: ids 0-255 are bytes, 256 is its EOS."""

from __future__ import annotations

import json

import openai
import pytest

from server_proc import MODEL, SSEClient, ServerProcess, http

pytestmark = pytest.mark.timeout(300)
EOS = 256
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("logprobs") / "server.log")
    yield proc
    assert proc.terminate() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def test_seeded_choices_differ_and_repeat(client):
    for _ in range(2):
        kw = dict(model=MODEL, max_tokens=8, n=3, temperature=1.0, seed=42, extra_body=NO_EOS)
        a = client.completions.create(prompt="Pick one:", **kw)
        b = client.completions.create(prompt="Pick one:", **kw)
        texts = [c.text for c in a.choices]
        assert len(set(texts)) == 3, texts
        assert [c.text for c in b.choices] == texts
        msgs = [{"role": "user", "content": "hi"}]
        c = client.chat.completions.create(messages=msgs, **kw)
        d = client.chat.completions.create(messages=msgs, **kw)
        assert len({x.message.content for x in c.choices}) == 3
        assert [x.message.content for x in d.choices] == [x.message.content for x in c.choices]


@pytest.mark.parametrize("logprobs,temperature", [(0, 0.0), (1, 1.5), (3, 1.0)])
def test_completion_top_logprobs_hold_the_sampled_token(client, logprobs, temperature):
    r = client.completions.create(model=MODEL, prompt="The sky", max_tokens=12, seed=3,
                                  temperature=temperature, logprobs=logprobs, extra_body=NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value is not None and value <= 0
        # ids the stand-in has no text for all print as "": the dict keeps the likelier
        assert top[tok] == value if tok else top[tok] >= value
        assert 1 <= len(top) <= logprobs + 1  # (fewer where two ids print alike)
        if temperature == 0:  # greedy: the most likely token
            assert value == max(top.values())


def test_echo_with_logprobs_scores_the_prompt(client):
    """The prompt's logprobs (prefill) equal the sampled tokens' logprobs (decode) of a
    greedy run whose output is now part of the prompt."""
    letters = {str(b): 50 for b in range(97, 123)}  # (the logprobs stay the model's own)
    first = client.completions.create(model=MODEL, prompt=[72, 105, 33], max_tokens=6,
                                      temperature=0, logprobs=2, logit_bias=letters,
                                      extra_body=NO_EOS)
    out_lp = first.choices[0].logprobs
    ids = [72, 105, 33] + [ord(t) for t in out_lp.tokens]
    echo = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                     logprobs=2, echo=True, extra_body=NO_EOS)
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith("Hi!" + first.choices[0].text)
    assert len(lp.tokens) == len(ids) + 1 and lp.tokens[:3] == ["H", "i", "!"]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[:4] == [0, 1, 2, 3]
    assert lp.token_logprobs[3:9] == pytest.approx(out_lp.token_logprobs, abs=1e-4)
    for top, tok in zip(lp.top_logprobs[1:], lp.tokens[1:]):
        assert tok in top and 2 <= len(top) <= 3
    greedy = client.completions.create(model=MODEL, prompt=[72, 105], max_tokens=1,
                                       temperature=0, logprobs=1, extra_body=NO_EOS)
    # lm-evaluation-harness's greedy check: "!" is greedy after "Hi" when it is the top token
    is_top = lp.token_logprobs[2] == max(lp.top_logprobs[2].values())
    assert is_top == (greedy.choices[0].text == "!")


def test_vllm_prompt_logprobs(client):
    prompt = [72, 105, 33, 32, 97]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                  extra_body={"prompt_logprobs": 2, **NO_EOS})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(prompt) and got[0] is None
    for tid, entry in zip(prompt[1:], got[1:]):
        mine = entry[str(tid)]
        assert mine["decoded_token"] == chr(tid) and mine["rank"] >= 1
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(tid))
        assert ranks == [1, 2] or (mine["rank"] <= 2 and len(entry) == 2)
    echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True,
                                     logprobs=0, extra_body=NO_EOS)
    assert echo.choices[0].logprobs.token_logprobs[1:5] == pytest.approx(
        [e[str(t)]["logprob"] for t, e in zip(prompt[1:], got[1:])], abs=1e-5)
    chat = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": "hi"}], extra_body={"prompt_logprobs": 0})
    plp = chat.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == chat.usage.prompt_tokens
    assert all(len(e) == 1 for e in plp[1:])
    plain = client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert plain.choices[0].model_extra["prompt_logprobs"] is None


def test_logit_bias(client):
    r = client.completions.create(model=MODEL, prompt="Say:", max_tokens=6, temperature=1.0,
                                  logit_bias={"97": 100}, extra_body=NO_EOS)
    assert r.choices[0].text == "aaaaaa"
    c = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                       messages=[{"role": "user", "content": "hi"}],
                                       logit_bias={"98": 100, "99": 100}, extra_body=NO_EOS)
    assert set(c.choices[0].message.content) <= {"b", "c"}


def test_min_tokens_and_skip_special_tokens(client):
    eos = {"logit_bias": {str(EOS): 100}}
    ended = client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body=eos)
    assert ended.usage.completion_tokens == 1 and ended.choices[0].finish_reason == "stop"
    held = client.completions.create(model=MODEL, prompt="x", max_tokens=8,
                                     extra_body={**eos, "min_tokens": 5})
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    kept = client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                     extra_body={**eos, **NO_EOS, "skip_special_tokens": False})
    assert kept.choices[0].text == "<|endoftext|>" * 2
    skipped = client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                        extra_body={**eos, **NO_EOS})
    assert skipped.choices[0].text == ""


def test_every_streamed_chat_chunk_has_content(server):
    """Random bytes from the tiny model end mid-character often: those chunks carry ""."""
    s = SSEClient(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
        "stream": True, "ignore_eos": True, "logprobs": True, "temperature": 1.0,
        "seed": 7, "logit_bias": {str(b): 8 for b in range(0xC2, 0xF0)}})
    events = s.events()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas and all(isinstance(d.get("content"), str) for d in deltas)
    assert any(d["content"] == "" for d in deltas[1:])  # a character still incomplete


def test_fields_that_change_nothing_are_accepted(server, client):
    msgs = [{"role": "user", "content": "hi", "extra_field": "0"}]
    kw = dict(model=MODEL, max_tokens=4, temperature=0, user="u-1", store=False,
              metadata={"team": "eval"}, service_tier="auto", extra_body=NO_EOS)
    base = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}],
                                          model=MODEL, max_tokens=4, temperature=0,
                                          extra_body=NO_EOS)
    r = client.chat.completions.create(messages=msgs, parallel_tool_calls=False,
                                       reasoning_effort="low", **kw)
    assert r.choices[0].message.content == base.choices[0].message.content
    c = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, user="u-1",
                                  extra_body={"store": True, "metadata": {"a": "b"},
                                              "service_tier": "default", **NO_EOS})
    assert c.usage.completion_tokens == 4
    status, _, err = http(server, "POST", "/v1/completions", {
        "model": MODEL, "prompt": "hi", "max_tokens": 2, "frobnicate": 1})
    assert status == 400 and err["error"]["param"] == "frobnicate"


def test_bad_values_are_400(server):
    for body, param in [({"logit_bias": {"x": 1}}, "logit_bias"),
                        ({"logit_bias": {"5": -100.5}}, "logit_bias"),
                        ({"logit_bias": {"512": 1}}, "logit_bias"),
                        ({"min_tokens": -1}, "min_tokens"),
                        ({"prompt_logprobs": 21}, "prompt_logprobs"),
                        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs")]:
        status, _, err = http(server, "POST", "/v1/completions",
                              {"model": MODEL, "prompt": "hi", "max_tokens": 2, **body})
        assert status == 400 and err["error"]["param"] == param, (body, err)
