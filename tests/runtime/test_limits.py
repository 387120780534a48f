"""The request length rules (runtime/limits.py); test_scheduler checks that the scheduler
enforces them."""

import pytest

from moeserve.runtime.limits import PromptError, check_prompt, output_limit


def test_prompt_rule():
    check_prompt(15, 16, "fix it")
    with pytest.raises(PromptError, match="the prompt is empty") as empty:
        check_prompt(0, 16, "fix it")
    assert not empty.value.too_long
    with pytest.raises(PromptError, match=r"has 16 tokens and the context length is 16: it "
                                          r"leaves no room for output; fix it$") as full:
        check_prompt(16, 16, "fix it")
    assert full.value.too_long


def test_output_rule():
    assert output_limit(10, 4, 16) == 4
    assert output_limit(10, 100, 16) == 6
    assert output_limit(15, 100, 16) == 1
