"""The length limits of one request, each rule in one function.

A request of P prompt tokens runs only when 0 < P < context length (`check_prompt`), and ends by
length after `output_limit` output tokens: its max_new_tokens, or fewer where the context
leaves less room. The scheduler and the stop checker enforce them; the OpenAI server applies
the same rules up front, so that a request it cannot serve fails before it is queued.
"""

from __future__ import annotations


class PromptError(ValueError):
    """A prompt that cannot run: empty, or (`too_long`) leaving no room for output."""

    def __init__(self, message: str, too_long: bool) -> None:
        super().__init__(message)
        self.too_long = too_long


def check_prompt(num_prompt: int, context_length: int, remedy: str) -> None:
    """Raise PromptError unless a prompt of `num_prompt` tokens leaves room for one output token;
    the message ends with `remedy` (what the caller's user can change)."""
    if num_prompt == 0:
        raise PromptError("the prompt is empty", too_long=False)
    if num_prompt >= context_length:
        raise PromptError(f"the prompt has {num_prompt} tokens and the context length is "
                          f"{context_length}: it leaves no room for output; {remedy}",
                          too_long=True)


def output_limit(num_prompt: int, max_new_tokens: int, context_length: int) -> int:
    """The most output tokens a request may have: max_new_tokens, cut to the room the prompt
    leaves in the context (the prompt and output together hold at most context_length)."""
    return min(max_new_tokens, context_length - num_prompt)
