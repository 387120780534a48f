"""Structured outputs, tool calls and reasoning through a real server and the openai client.

One server (tiny preset, random weights, CPU; its byte-level tokenizer) with a Qwen3-style chat
template given by --chat-template, --tool-call-parser hermes and --reasoning-parser qwen3. The
text is random; its form must not be: every output follows its grammar and parses.
"""

from __future__ import annotations

import asyncio
import json
import random

import jsonschema
import openai
import pytest

from server_proc import MODEL, ServerProcess, http

pytestmark = pytest.mark.timeout(600)

TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "unit", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "pattern": "^UTC[+-][0-9]$"}},
    "required": ["zone"]}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("structured")
    (folder / "template.jinja").write_text(TEMPLATE)
    proc = ServerProcess(folder / "server.log", "--max-queued-requests", "256",
                         "--chat-template", str(folder / "template.jinja"),
                         "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    yield proc
    assert proc.terminate() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=300) as c:
        yield c


def _loads(text):
    """JSON of an output. Not strict about control characters: xgrammar's rule for strings
    with a maxLength admits raw ones (a tab, U+0001), which Python's strict parser refuses."""
    return json.loads(text, strict=False)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 1-4 properties of varied kinds, some required."""
    kinds = ["pattern", "short", "int", "number", "enum", "bool", "array"] + (
        ["object", "objects"] if depth == 0 else [])
    props = {}
    for k in range(rng.randint(1, 4)):
        kind = rng.choice(kinds)
        lo = rng.randint(-50, 50)
        props[f"{kind}_{k}"] = {
            "pattern": {"type": "string", "pattern": "^[a-z]{1,5}(-[0-9]{2})?$"},
            "short": {"type": "string", "minLength": 1, "maxLength": rng.randint(1, 6)},
            "int": {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)},
            "number": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "enum": {"enum": rng.sample(["red", "green", "blue", "x y", "é"], 3)},
            "bool": {"type": "boolean"},
            "array": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                      "minItems": 1, "maxItems": 3},
            "object": random_schema(rng, depth + 1) if kind == "object" else None,
            "objects": {"type": "array", "items": random_schema(rng, depth + 1),
                        "maxItems": 2} if kind == "objects" else None,
        }[kind]
    names = list(props)
    required = names if rng.random() < 0.5 else rng.sample(names, rng.randint(1, len(names)))
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def test_fifty_json_schemas_parse_and_validate(server):
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(50)]

    async def one(client, k, schema):
        kind = k % 3
        extra = {}
        if kind == 0:  # OpenAI's response_format, chat
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": schema,
                                                          "strict": True}}
            r = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"json {k}"}],
                response_format=fmt, max_tokens=500, temperature=1.0, seed=k)
            return r.choices[0].message.content, r.choices[0].finish_reason
        if kind == 1:  # vLLM's guided_json, completions
            extra = {"guided_json": schema}
        else:  # the same as OpenAI's on completions, streamed
            extra = {"response_format": {"type": "json_schema",
                                         "json_schema": {"name": "x", "schema": schema}}}
        if kind == 1:
            r = await client.completions.create(model=MODEL, prompt=f"json {k}:",
                                                max_tokens=500, seed=k, extra_body=extra)
            return r.choices[0].text, r.choices[0].finish_reason
        chunks = [c async for c in await client.completions.create(
            model=MODEL, prompt=f"json {k}:", max_tokens=500, seed=k, stream=True,
            extra_body=extra)]
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                      max_retries=0, timeout=500) as client:
            return await asyncio.gather(*(one(client, k, s) for k, s in enumerate(schemas)))

    for schema, (text, finish) in zip(schemas, asyncio.run(run())):
        assert finish == "stop", (schema, text)  # the grammar's end ended it
        jsonschema.validate(_loads(text), schema)


def test_regex_choice_ebnf_and_json_object(client):
    def chat(**extra):
        r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=200, seed=3,
                                           n=2, extra_body=extra)
        return [c.message.content for c in r.choices]

    for text in chat(regex=r"[0-9]{3}-[a-z]{2,4}"):
        assert len(text) >= 6 and text[3] == "-" and text[:3].isdigit()
    assert set(chat(guided_choice=["yes", "no", "maybe \"so\""])) <= {
        "yes", "no", "maybe \"so\""}
    for text in chat(ebnf='root ::= "[" item ("," item)* "]"\nitem ::= [a-c]'):
        assert text[0] == "[" and text[-1] == "]" and set(text[1:-1]) <= set("abc,")
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=400, seed=5,
                                       response_format={"type": "json_object"},
                                       stop=["never"])
    if r.choices[0].finish_reason == "stop":  # a random object may outgrow the limit
        assert isinstance(_loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}}, "response_format"),
    ({"regex": "(ab"}, "regex"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"regex": "a", "guided_json": {"type": "object"}}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#"}}}}, "response_format"),  # matches no text
    ({"regex": "[^\\s\\S]"}, "regex"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "nope"}}}], "tool_choice": "required"}, "tools.1.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools.0.function.parameters"),
])
def test_bad_grammars_and_tool_choices_are_400(server, body, field):
    status, _, err = http(server, "POST", "/v1/chat/completions",
                          {"model": MODEL, "messages": USER, "max_tokens": 5, **body})
    assert status == 400, err
    assert err["error"]["param"] == field, err


def test_a_grammar_dead_end_is_the_requests_400(server):
    """`a[^\\s\\S]` parses and begins, then allows no token after `a`: a 400 that says so
    (in a stream, an error event of the same type), and the server serves on."""
    body = {"model": MODEL, "prompt": "say a", "max_tokens": 8, "regex": "a[^\\s\\S]"}
    status, _, err = http(server, "POST", "/v1/completions", body)
    assert status == 400, err
    assert err["error"]["type"] == "invalid_request_error"
    assert "grammar allows no token after 1 output token" in err["error"]["message"], err
    status, _, text = http(server, "POST", "/v1/completions", {**body, "stream": True})
    assert status == 200
    events = [json.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["error"]["type"] == "invalid_request_error", events
    status, _, ok = http(server, "POST", "/v1/completions", {**body, "regex": "a+"})
    assert status == 200 and set(ok["choices"][0]["text"]) == {"a"}, ok


def _calls(message):
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_named_tool_choice_gives_arguments_that_validate(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, n=3,
                                       tool_choice=choice, max_tokens=300, seed=7)
    for c in r.choices:
        assert c.finish_reason == "stop"  # (as OpenAI for a named function)
        (name, args), = _calls(c.message)
        assert name == "get_weather" and c.message.tool_calls[0].id.startswith("call_")
        jsonschema.validate(json.loads(args), SCHEMAS[name])


def test_required_tool_choice_gives_valid_calls_and_streams_the_same(client):
    for seed in range(4):
        kw = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                  max_tokens=400, seed=seed, temperature=1.0)
        whole = client.chat.completions.create(**kw)
        (c,) = whole.choices
        calls = _calls(c.message)
        assert calls and c.finish_reason in ("tool_calls", "length")
        complete = calls if c.finish_reason == "tool_calls" else calls[:-1] or calls
        for name, args in complete:
            jsonschema.validate(json.loads(args), SCHEMAS[name])
        # streamed: the deltas reassemble to the same calls (indexed, each whole once)
        got: dict[int, list] = {}
        content = ""
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kw):
            d = chunk.choices[0].delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                assert tc.index not in got
                got[tc.index] = [tc.function.name, tc.function.arguments]
            finish = chunk.choices[0].finish_reason or finish
        assert [tuple(got[k]) for k in sorted(got)] == calls and finish == c.finish_reason
        assert content.strip() == (c.message.content or "").strip()


def test_tool_history_and_parallel_off(client):
    history = USER + [
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function", "function": {
                "name": "get_weather",
                "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=300, seed=1)
    assert len(_calls(r.choices[0].message)) == 1
    # the history reached the template: the prompt holds the call and the tool's answer
    r2 = client.chat.completions.create(model=MODEL, messages=history, max_tokens=1,
                                        tools=TOOLS, tool_choice="none")
    r3 = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1)
    answer = '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' \
        '{"city": "Paris", "unit": "celsius", "days": 1}}\n</tool_call><|im_end|>\n' \
        '<|im_start|>user\n<tool_response>\nsunny, 21\n</tool_response><|im_end|>\n'
    assert r2.usage.prompt_tokens == r3.usage.prompt_tokens + len(answer.encode())


def test_reasoning_is_split_streamed_alike_and_thinking_can_be_off(client):
    # the regex stands for a model that thinks: <think>, thoughts, </think>, an answer
    think = {"regex": r"<think>\n[a-z ]{1,20}\n</think>\n\n[A-Z][a-z ]{1,20}"}
    kw = dict(model=MODEL, messages=USER, max_tokens=200, seed=11, extra_body=think)
    m = client.chat.completions.create(**kw).choices[0].message
    assert m.content and m.content[0].isupper() and "<think>" not in m.content
    reasoning = m.model_extra["reasoning_content"]
    assert reasoning and set(reasoning) <= set("abcdefghijklmnopqrstuvwxyz \n")
    parts = {"content": "", "reasoning_content": ""}
    for chunk in client.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        parts["content"] += d.content or ""
        parts["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
    assert parts == {"content": m.content, "reasoning_content": reasoning}
    # chat_template_kwargs reach the template: enable_thinking false closes the thinking in
    # the prompt (its 19 bytes more), and the output is all content
    on = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, seed=1)
    off = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, seed=1,
                                         extra_body={"chat_template_kwargs": {
                                             "enable_thinking": False}})
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + len("<think>\n\n</think>\n\n")
    # reasoning_effort reaches it as a variable; chat_template_kwargs may set it instead
    high = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1,
                                          reasoning_effort="high")
    assert high.usage.prompt_tokens == on.usage.prompt_tokens + len("Reasoning: high\n")
    low = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1,
                                         reasoning_effort="high", extra_body={
                                             "chat_template_kwargs": {"reasoning_effort": "lo"}})
    assert low.usage.prompt_tokens == on.usage.prompt_tokens + len("Reasoning: lo\n")
    assert off.choices[0].message.model_extra["reasoning_content"] is None
