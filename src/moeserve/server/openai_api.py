"""/v1/completions and /v1/chat/completions: requests to sequences, outputs to OpenAI bodies.

A request becomes `len(prompts) x n` sequences; choice `k * n + j` is choice j of prompt k. With
a seed, choice j samples with its own stream of it (sampling.choice_seed), so that n > 1 gives n
different samples and the request repeats as a whole.

Logprobs are those of the model's raw distribution (log_softmax of its logits, before
logit_bias, penalties and temperature), as OpenAI and vLLM report them. Completions'
`top_logprobs` also hold the sampled token (up to logprobs + 1 entries, as OpenAI's legacy
endpoint); `echo` with `logprobs` puts the prompt's tokens first, the first with null logprobs.
`prompt_logprobs` (vLLM's field) gives, per prompt token, {token id: {logprob, rank,
decoded_token}} for it and the most likely tokens; the first is null.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
import uuid
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Iterator, Optional, Union

from moeserve.runtime.limits import PromptError, check_prompt, output_limit
from moeserve.runtime.request import TokenOutput
from moeserve.runtime.sampling import SamplingParams, SamplingParamsError, choice_seed
from moeserve.server.bridge import EngineClient, Seats
from moeserve.server.errors import (APIError, bad_request, internal_error, parse_body,
                                   unsupported)
from moeserve.server.formatting import (chat_logprobs, completion_logprobs, echo_entries,
                                       vllm_prompt_logprobs)
from moeserve.runtime.grammar import GrammarSpec
from moeserve.server.chat_output import ChatOutput, ChatPlanner
from moeserve.server.protocol import ChatCompletionRequest, CompletionRequest
from moeserve.server.structured import request_grammar
from moeserve.server.text import TextCodec

COMPLETION_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions endpoint
API_NAMES = {"max_new_tokens": "max_tokens"}  # SamplingParams field -> API field
log = logging.getLogger("moeserve.server")


@dataclass
class Prompt:
    ids: list[int]
    text: str  # for echo


@dataclass
class Job:
    """What both endpoints hand to the generation loop."""

    kind: str  # "completion" or "chat"
    model: str
    prompts: list[Prompt]
    params: list[list[SamplingParams]]  # [prompt][choice]
    stream: bool
    include_usage: bool
    echo: bool = False
    id: str = ""
    grammar: Optional[GrammarSpec] = None  # every choice's output follows it
    chat: Optional[ChatOutput] = None  # how a chat choice's text is read (reasoning, tools)
    prompt_logprobs: Optional[int] = None  # vLLM's field, as asked
    echo_top: Optional[int] = None  # echo with logprobs: top tokens per prompt token
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n(self) -> int:
        return len(self.params[0])

    @property
    def logprobs(self) -> bool:
        return self.params[0][0].logprobs

    @property
    def num_seqs(self) -> int:
        return len(self.prompts) * self.n


@dataclass
class ChoiceState:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish: Optional[str] = None
    cached: int = 0
    text_offset: int = 0  # completions logprobs: where the next token's text starts
    started: bool = False  # streaming: the first chunk (role, echo) went out
    parsed: Any = None  # streaming chat: its ChatOutputState (tool calls, reasoning)
    prompt_logprobs: list[dict[str, Any]] = field(default_factory=list)  # of tokens 1..


class OpenAIHandlers:
    def __init__(self, client: EngineClient, codec: TextCodec, served_names: list[str],
                 context_length: int, tool_parser: Optional[str] = None,
                 reasoning_parser: Optional[str] = None) -> None:
        self.client, self.codec = client, codec
        self.chat = ChatPlanner(tool_parser, reasoning_parser)
        self.served_names, self.context_length = served_names, context_length

    # --- parsing ----------------------------------------------------------------------------
    def _parse(self, cls: Any, body: bytes) -> Any:
        req = parse_body(cls, body, self.served_names)
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed with stream=true",
                              "stream_options")
        if req.prompt_logprobs is not None and req.stream:  # (as vLLM)
            raise bad_request("prompt_logprobs are not available with stream=true; drop one",
                              "prompt_logprobs")
        field_name = req.unsupported()
        if field_name is not None:
            raise unsupported(field_name)
        return req

    def _limit(self, prompt: Prompt, asked: Optional[int], default: Optional[int],
               prompt_param: str, limit_param: str) -> int:
        n, ctx = len(prompt.ids), self.context_length
        with too_long_as_400(prompt_param):
            check_prompt(n, ctx, "shorten the prompt")
        if asked is None:
            return output_limit(n, default or ctx, ctx)
        room = output_limit(n, asked, ctx)
        if room < asked:
            raise bad_request(f"{limit_param}={asked} with a prompt of {n} tokens exceeds the "
                              f"context length of {ctx}; ask for at most {room} tokens",
                              limit_param, "context_length_exceeded")
        return asked

    def _params(self, req: Any, max_new: int, logprobs: bool, top: int,
                prompt_top: Optional[int] = None) -> list[SamplingParams]:
        extra: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            if getattr(req, name) is not None:
                extra[name] = getattr(req, name)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        bad = [t for t in req.stop_token_ids or () if not 0 <= t < self.codec.vocab_size]
        if bad:  # one outside the vocabulary could never end the output
            raise bad_request(f"stop_token_ids {bad[:5]} are outside the vocabulary "
                              f"[0, {self.codec.vocab_size})", "stop_token_ids")
        bias = req.token_bias()
        bad = [t for t in bias if t >= self.codec.vocab_size]
        if bad:
            raise bad_request(f"logit_bias token ids {bad[:5]} are outside the vocabulary "
                              f"[0, {self.codec.vocab_size})", "logit_bias")
        if req.min_tokens is not None:
            extra["min_tokens"] = req.min_tokens
        out = []
        for j in range(req.n):
            seed = None if req.seed is None else choice_seed(req.seed % 2**64, j)
            try:
                out.append(SamplingParams(
                    max_new_tokens=max_new, seed=seed, stop=tuple(stop),
                    stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                    logprobs=logprobs, top_logprobs=top, logit_bias=bias,
                    prompt_logprobs=prompt_top, skip_special_tokens=req.skip_special_tokens,
                    **extra))
            except SamplingParamsError as exc:
                name = str(exc).split("=", 1)[0]
                raise bad_request(str(exc), API_NAMES.get(name, name)) from None
        return out

    def completion_job(self, body: bytes) -> Job:
        req: CompletionRequest = self._parse(CompletionRequest, body)
        grammar = request_grammar(req)
        prompts = [self._completion_prompt(p) for p in _prompt_list(req.prompt)]
        if not prompts:
            raise bad_request("the prompt list is empty", "prompt")
        limits = [self._limit(p, req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "prompt",
                              "max_tokens") for p in prompts]
        logprobs = req.logprobs is not None
        echo_top = req.logprobs if req.echo and logprobs else None
        asked = [t for t in (echo_top, req.prompt_logprobs) if t is not None]
        prompt_top = max(asked) if asked else None
        params = [self._params(req, m, logprobs, req.logprobs or 0, prompt_top)
                  for m in limits]
        return Job("completion", req.model, prompts, params, req.stream,
                   bool(req.stream_options and req.stream_options.include_usage), req.echo,
                   grammar=grammar, id=f"cmpl-{uuid.uuid4().hex}",
                   prompt_logprobs=req.prompt_logprobs, echo_top=echo_top)

    def _completion_prompt(self, p: Union[str, list[int]]) -> Prompt:
        if isinstance(p, str):
            with too_long_as_400("prompt"):
                return Prompt(self.codec.encode(p, limit=self.context_length), p)
        bad = [t for t in p if not 0 <= t < self.codec.vocab_size]
        if bad:
            raise bad_request(f"token ids {bad[:5]} are outside the vocabulary "
                              f"[0, {self.codec.vocab_size})", "prompt")
        return Prompt(list(p), self.codec.decode(p))

    def chat_job(self, body: bytes) -> Job:
        req: ChatCompletionRequest = self._parse(ChatCompletionRequest, body)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        chat = self.chat.plan(req)
        with too_long_as_400("messages"):
            text, ids = self.codec.encode_chat(chat.messages, chat.template_tools,
                                               chat.template_kwargs, limit=self.context_length)
        output = None if chat.output is None else replace(chat.output, prompt_text=text)
        prompt = Prompt(ids, text)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        limit = self._limit(prompt, req.output_limit, None, "messages", param)
        params = [self._params(req, limit, req.logprobs, req.top_logprobs or 0,
                               req.prompt_logprobs)]
        return Job("chat", req.model, [prompt], params, req.stream,
                   bool(req.stream_options and req.stream_options.include_usage),
                   grammar=chat.grammar, chat=output,
                   id=f"chatcmpl-{uuid.uuid4().hex}", prompt_logprobs=req.prompt_logprobs)

    # --- generation -------------------------------------------------------------------------
    def _outputs(self, job: Job, seats: Seats) -> AsyncIterator[tuple[int, TokenOutput]]:
        ids = [p.ids for p in job.prompts for _ in range(job.n)]
        params = [sp for per_prompt in job.params for sp in per_prompt]
        return self.client.run(ids, params, seats, job.id, job.grammar)

    async def respond(self, job: Job, seats: Seats) -> dict[str, Any]:
        """The whole (non-streaming) response body."""
        states = [ChoiceState() for _ in range(job.num_seqs)]
        try:  # what fails here fails this request (a 500 with its id), and aborts its sequences
            async with aclosing(self._outputs(job, seats)) as outputs:
                async for i, out in outputs:
                    _check(out)
                    s = states[i]
                    s.text.append(out.text)
                    s.token_ids += out.token_ids
                    s.logprobs += out.logprobs
                    s.prompt_logprobs += out.prompt_logprobs
                    if out.finish is not None:
                        s.finish, s.cached = _finish_reason(out), out.cached_tokens
            choices = []
            for i, s in enumerate(states):
                choices.append(self._choice(job, i, s, "".join(s.text), s.logprobs, s.finish))
        except APIError:
            raise
        except Exception as exc:
            raise internal_error(log, job.id, "the response failed", _detail(exc)) from None
        body = {"id": job.id, "object": "text_completion" if job.kind == "completion"
                else "chat.completion", "created": job.created, "model": job.model,
                "choices": choices, "usage": self._usage(job, states),
                "system_fingerprint": None}
        if job.kind == "chat":  # (vLLM's place for it: the choices share the prompt)
            body["prompt_logprobs"] = self._prompt_logprobs(job, 0, states[0])
        return body

    def _prompt_logprobs(self, job: Job, i: int, s: ChoiceState) -> Optional[list[Any]]:
        if job.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.codec, job.prompts[i // job.n].ids,
                                    s.prompt_logprobs, job.prompt_logprobs)

    def _choice(self, job: Job, i: int, s: ChoiceState, text: str,
                logprobs: list[dict[str, Any]], finish: Optional[str],
                delta: bool = False) -> dict[str, Any]:
        want_lp = job.logprobs
        if job.kind == "completion":
            prompt = job.prompts[i // job.n]
            if job.echo and not s.started:
                text = prompt.text + text
                if want_lp:
                    logprobs = echo_entries(prompt.ids, s.prompt_logprobs,
                                            job.echo_top or 0) + logprobs
            s.started = True
            lp = None
            if want_lp:
                lp, s.text_offset = completion_logprobs(self.codec, logprobs, s.text_offset)
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
            if not delta:
                choice["prompt_logprobs"] = self._prompt_logprobs(job, i, s)
            return choice
        lp = {"content": chat_logprobs(self.codec, logprobs), "refusal": None} if want_lp \
            else None
        if not delta:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if job.chat is not None:
                message, finish = job.chat.start().message(text, finish)
            return {"index": i, "message": message, "logprobs": lp, "finish_reason": finish}
        # content on every chunk: "" while a character's bytes are incomplete
        body: dict[str, Any] = ({} if s.started else {"role": "assistant"}) | {"content": text}
        s.started = True
        if job.chat is not None:  # content, reasoning_content and tool_calls, as parsed
            if s.parsed is None:
                s.parsed = job.chat.start()
            body = {k: v for k, v in body.items() if k != "content"} | s.parsed.feed(
                text, final=finish is not None)
            finish = s.parsed.finish_reason(finish)
        return {"index": i, "delta": body, "logprobs": lp, "finish_reason": finish}

    def _usage(self, job: Job, states: list[ChoiceState]) -> dict[str, Any]:
        """Each prompt counts once, however many choices it has (as OpenAI counts)."""
        prompt = sum(len(p.ids) for p in job.prompts)
        completion = sum(len(s.token_ids) for s in states)
        cached = sum(min(s.cached for s in states[k * job.n:(k + 1) * job.n])
                     for k in range(len(job.prompts)))
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def stream(self, job: Job, seats: Seats) -> AsyncIterator[bytes]:
        """Server-sent events: one chunk per step of each choice, the usage chunk when asked,
        then `data: [DONE]`. An error after the first byte is an event with an error body."""
        states = [ChoiceState() for _ in range(job.num_seqs)]
        obj = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
        head = {"id": job.id, "object": obj, "created": job.created, "model": job.model}
        usage_null = {"usage": None} if job.include_usage else {}
        try:
            async with aclosing(self._outputs(job, seats)) as outputs:
                async for i, out in outputs:
                    _check(out)
                    s = states[i]
                    s.token_ids += out.token_ids
                    s.prompt_logprobs += out.prompt_logprobs
                    finish = None
                    if out.finish is not None:
                        finish, s.cached = _finish_reason(out), out.cached_tokens
                    if not (out.text or out.logprobs or finish or not s.started):
                        continue
                    choice = self._choice(job, i, s, out.text, out.logprobs, finish,
                                          delta=True)
                    yield _sse({**head, "choices": [choice], **usage_null})
            if job.include_usage:
                yield _sse({**head, "choices": [], "usage": self._usage(job, states)})
        except APIError as exc:
            yield _sse(exc.body())
        except Exception as exc:  # this request's output: it fails, with its id; others go on
            yield _sse(internal_error(log, job.id, "the stream failed", _detail(exc)).body())
        yield b"data: [DONE]\n\n"


def _prompt_list(prompt: Union[str, list[str], list[int], list[list[int]]]) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _finish_reason(out: TokenOutput) -> str:
    assert out.finish is not None
    if out.finish.reason not in ("stop", "length"):
        raise APIError(500, f"the sequence ended with '{out.finish.reason}'", None,
                       "generation_failed")
    return out.finish.reason


def _check(out: TokenOutput) -> None:
    if out.error is not None and out.invalid_request:
        raise bad_request(out.error, None)
    if out.error is not None:
        raise APIError(500, f"generation failed: {out.error}", None, "generation_failed")


def _detail(exc: Exception) -> str:
    """The exception on the first line (what a client sees of it), then the traceback."""
    return f"{type(exc).__name__}: {exc}\n{''.join(traceback.format_exception(exc))}"


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


@contextmanager
def too_long_as_400(param: str) -> Iterator[None]:
    """A PromptError (empty, or too long for the context) as the 400 that names `param`."""
    try:
        yield
    except PromptError as exc:
        code = "context_length_exceeded" if exc.too_long else "invalid_value"
        raise bad_request(str(exc), param, code) from None
