"""The OpenAI API's request bodies, as strict pydantic models.

Strict: a wrong JSON type is an error, never coerced ("5" is not an int). A field we do not know is
an error (`extra="forbid"`); a field OpenAI defines that we do not implement is declared here so
that `unsupported()` can name it in a clear error instead of a generic "extra field" one. Our
extensions (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids) are those SGLang and
vLLM accept. The ranges of the sampling fields are those of runtime/sampling.RANGES, checked here
(before the prompt is tokenized) with the same rule the engine applies.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from moeserve.runtime.sampling import RANGES, STOP_RULE, SamplingParamsError, stop_strings

# an API field -> its rule in RANGES, where the names differ
_RULE = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
         "logprobs": "top_logprobs"}
_RANGED = ("n", "max_tokens", "temperature", "top_p", "seed", "presence_penalty",
           "frequency_penalty", "top_k", "min_p", "repetition_penalty")


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
    user: Optional[str] = None  # an end-user id for the operator's logs; no effect on output
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
    # defined by OpenAI, not implemented: rejected with a message when set (see unsupported())
    logit_bias: Optional[dict[str, Any]] = None

    _ranged = field_validator(*_RANGED)(_in_range)

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
        if self.logit_bias:
            return "logit_bias"
        return None


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
        if self.echo and self.logprobs is not None:
            return "echo"  # with logprobs it needs the prompt's logprobs, which we don't compute
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
    # not implemented
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None

    _ranged_chat = field_validator("max_completion_tokens", "top_logprobs")(_in_range)

    def unsupported(self) -> Optional[str]:
        for name in ("functions", "function_call", "parallel_tool_calls"):
            if getattr(self, name):
                return name
        return super().unsupported()

    @property
    def output_limit(self) -> Optional[int]:
        """max_completion_tokens is OpenAI's current name of max_tokens; it wins when both
        are given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
