"""`run_bench` with a grammar per prompt (the structured-output benchmark's driver): each
request follows its own grammar, whose end ends it, and the summary counts finish reasons; and
with an output cap per prompt (the benchmark's control run)."""

import pytest

from moeserve.bench import run_bench
from moeserve.runtime.engine import Engine
from moeserve.runtime.grammar import GrammarSpec
from moeserve.runtime.request import TokenOutput
from moeserve.runtime.sampling import Finish

pytest.importorskip("xgrammar")


def test_each_prompt_gets_its_own_grammar():
    rows = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    three = GrammarSpec("regex", "[a-c]{3}")
    five = GrammarSpec("regex", "x{5}")
    with Engine("preset:tiny", load_format="dummy", device="cpu", max_total_tokens=2048,
                context_length=128) as e:
        s = run_bench(e, rows, 12, 2, progress=False, grammars=[three, None, five, None])
    assert s["completed"] == 4 and not s["errors"]
    # a regex's characters, then the EOS that ends its grammar; unconstrained rows run to the cap
    assert s["output_tokens"] == (3 + 1) + 12 + (5 + 1) + 12
    assert s["finish_reasons"] == {"stop": 2, "length": 2}


def test_grammars_are_handed_to_the_engine_only_where_given():
    seen = []

    class Engine:
        def submit(self, input_ids, params, stream, grammar, on_output):
            seen.append((input_ids[0], grammar))
            on_output(TokenOutput("r", [1], Finish("length")))
            return "r", None

    spec = GrammarSpec("json_object")
    s = run_bench(Engine(), [[0], [1], [2]], 1, 1, progress=False, grammars=[None, spec, None])
    assert sorted(seen, key=lambda t: t[0]) == [(0, None), (1, spec), (2, None)]
    assert s["finish_reasons"] == {"length": 3}
    with pytest.raises(ValueError, match="2 grammars for 3 prompts"):
        run_bench(Engine(), [[0], [1], [2]], 1, 1, progress=False, grammars=[None, spec])


def test_each_prompt_may_have_its_own_output_cap():
    """The structured benchmark's control: requests capped at the lengths another run reached;
    the summary gives each request's tokens in the order of the prompts."""
    with Engine("preset:tiny", load_format="dummy", device="cpu", max_total_tokens=2048,
                context_length=128) as e:
        s = run_bench(e, [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], [3, 9, 1, 5], 2,
                      progress=False)
    assert s["completed"] == 4 and s["finish_reasons"] == {"length": 4}
    assert s["request_output_tokens"] == [3, 9, 1, 5] and s["output_tokens"] == 18
    with pytest.raises(ValueError, match="3 output lengths for 4 prompts"):
        run_bench(e, [[1]] * 4, [1, 2, 3], 2, progress=False)
