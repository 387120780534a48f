"""The OpenAI API's request bodies, as strict pydantic models.

Strict: a wrong JSON type is an error, never coerced ("5" is not an int). A top-level field we do
not know is an error (`extra="forbid"`); a field OpenAI defines that we do not implement is
declared here so that `unsupported()` can name it in a clear error instead of a generic "extra
field" one. Fields of OpenAI's that change nothing on a self-hosted server (user, store,
metadata, service_tier) are accepted and have no effect; so are keys inside a message that we
do not know (as vLLM). Our extensions (top_k, min_p, repetition_penalty, ignore_eos,
stop_token_ids, min_tokens, skip_special_tokens, prompt_logprobs) are those SGLang and vLLM
accept. The ranges of the sampling fields are those of runtime/sampling.RANGES, checked here
(before the prompt is tokenized) with the same rule the engine applies.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from moeserve.runtime.sampling import (MAX_LOGIT_BIAS, RANGES, STOP_RULE, SamplingParams,
                                       SamplingParamsError, stop_strings)

# an API field -> its rule in RANGES, where the names differ
_RULE = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
         "logprobs": "top_logprobs"}
_RANGED = ("n", "max_tokens", "temperature", "top_p", "seed", "presence_penalty",
           "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens",
           "prompt_logprobs")


def _in_range(value: Any, info: ValidationInfo) -> Any:
    """A field validator: the value unless it is outside its range in RANGES."""
    if value is None:
        return value
    rule = _RULE.get(info.field_name, info.field_name)
    if not RANGES[rule].contains(value):
        raise PydanticCustomError("invalid_value", "must be {want}", {"want": str(RANGES[rule])})
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JSONSchemaFormat(_Strict):
    name: Optional[str] = None
    description: Optional[str] = None
    schema_value: Union[dict[str, Any], bool, None] = Field(None, alias="schema")
    strict: Optional[bool] = None  # always strict here: the output follows the schema


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None


class _Sampling(_Strict):
    """Fields shared by both endpoints."""

    model: str
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    # OpenAI's fields for its own platform (an end-user id, stored completions, their
    # metadata, a processing tier): accepted, no effect here
    user: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None  # token id (a decimal string) -> bias
    # extensions (SGLang / vLLM)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    # structured outputs, at most one (server/structured.py): OpenAI's, SGLang's, vLLM's
    response_format: Optional[ResponseFormat] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    min_tokens: Optional[int] = None
    skip_special_tokens: bool = True
    prompt_logprobs: Optional[int] = None  # vLLM's: top tokens per prompt position

    _ranged = field_validator(*_RANGED)(_in_range)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: Any) -> Any:
        if value is None:
            return value
        try:
            SamplingParams(logit_bias={_token_key(k): v for k, v in value.items()})
        except (SamplingParamsError, ValueError):
            raise PydanticCustomError("invalid_value", "must be {want}", {"want": (
                f"an object of at most {MAX_LOGIT_BIAS} token ids (as strings, e.g. "
                f"\"50256\") mapped to a bias {RANGES['logit_bias']}")}) from None
        return value

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, value: Any) -> Any:
        try:
            stop_strings(value)
        except SamplingParamsError:
            raise PydanticCustomError("invalid_value", "must be {want}",
                                      {"want": STOP_RULE}) from None
        return value

    def unsupported(self) -> Optional[str]:
        """The first field that is set but that we do not implement, else None."""
        return None

    def token_bias(self) -> dict[int, float]:
        return {_token_key(k): v for k, v in (self.logit_bias or {}).items()}


def _token_key(key: str) -> int:
    """A logit_bias key: a token id written in decimal."""
    if not key.isascii() or not key.isdigit():
        raise ValueError(f"{key!r} is not a token id")
    return int(key)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: bool = False
    # not implemented
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    _ranged_logprobs = field_validator("logprobs")(_in_range)

    def unsupported(self) -> Optional[str]:
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        if self.suffix:
            return "suffix"
        return super().unsupported()


class TextPart(_Strict):
    type: Literal["text"]
    text: str


TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"  # OpenAI's rule (and a dot, as some models' tools)


class FunctionDef(_Strict):
    name: str = Field(pattern=TOOL_NAME)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None  # always strict here when the call is forced


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    model_config = ConfigDict(extra="ignore", strict=True)  # as vLLM: unknown keys ignored

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[MessageToolCall]] = None  # an assistant's calls
    tool_call_id: Optional[str] = None  # a tool's answer: to which call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # e.g. {"enable_thinking": false}
    parallel_tool_calls: Optional[bool] = None  # false: one call at most (chat_output.py)
    # reaches the chat template as its variable `reasoning_effort` (gpt-oss's templates read
    # it; chat_template_kwargs may set it instead)
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high",
                                       "xhigh"]] = None
    # not implemented
    functions: Optional[list[Any]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None

    _ranged_chat = field_validator("max_completion_tokens", "top_logprobs")(_in_range)

    def unsupported(self) -> Optional[str]:
        for name in ("functions", "function_call"):
            if getattr(self, name):
                return name
        return super().unsupported()

    @property
    def output_limit(self) -> Optional[int]:
        """max_completion_tokens is OpenAI's current name of max_tokens; it wins when both
        are given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages as the chat template renders them."""
    model: Optional[str] = None
    prompt: Optional[str] = None
    add_special_tokens: bool = True  # a prompt's BOS etc. (a rendered chat writes its own)
    messages: Optional[list[ChatMessage]] = None
    tools: Optional[list[Tool]] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]
