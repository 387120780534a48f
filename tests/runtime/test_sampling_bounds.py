"""The allowed range of every sampling field (runtime/sampling.RANGES): each boundary accepted or
rejected with a message naming the range, and a property test over the fields' extreme and
boundary values through the real engine (tiny preset, one rank, CPU): a value in range gives a
well-formed result, one out of range a ValueError, and nothing takes the engine down."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from moeserve.runtime.engine import Engine
from moeserve.runtime.sampling import (MAX_STOP_CHARS, MAX_STOP_STRINGS, RANGES, STOP_RULE,
                                       SamplingParams, SamplingParamsError)

INF, NAN = float("inf"), float("nan")
TINY = 1.2e-38  # about float32's smallest normal number
BIG = 10**400  # an integer no float holds

# field: (values at and inside the boundaries, values just outside and absurd ones)
BOUNDARIES = {
    "max_new_tokens": ([1, 2, 2**63], [0, -1, 1.0, True, None, "8"]),
    "temperature": ([0, 0.0, 1e-300, 1e-5, 2.0, 1e300, 10**300], [-1e-300, -1, NAN, INF, -INF,
                                                                BIG, "1"]),
    "top_p": ([1e-300, 0.5, 1, 1.0], [0, 0.0, -0.1, 1.0000001, NAN, INF, BIG]),
    "top_k": ([-1, 0, 1, 2**63, BIG], [-2, -BIG, 1.0, True, NAN]),
    "min_p": ([0, 0.0, 1e-300, 1.0], [-1e-300, 1.0000001, NAN, INF]),
    "seed": ([-(2**63), -1, 0, 2**63 - 1, 2**64 - 1], [-(2**63) - 1, 2**64, BIG, 1.0, True]),
    "repetition_penalty": ([1e-6, 0.5, 1, 2.0], [1e-300, 1e-39, TINY, 9.99e-7, 0, -1,
                                                 2.0000001, NAN, INF, BIG]),
    "frequency_penalty": ([-2, -2.0, 0, 2.0], [-2.0000001, 2.0000001, NAN, -INF, BIG]),
    "presence_penalty": ([-2.0, 0.0, 2], [-2.0000001, 2.0000001, NAN, INF, -BIG]),
    "top_logprobs": ([0, 20], [-1, 21, BIG, 1.0]),
}


def _params(field, value):
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    return SamplingParams(**{field: value, **extra})


@pytest.mark.parametrize("field", list(BOUNDARIES))
def test_each_boundary_accepted_or_rejected_naming_the_range(field):
    ok, bad = BOUNDARIES[field]
    for value in ok:
        assert getattr(_params(field, value), field) == (-1 if field == "top_k" and value == 0
                                                         else value)
    want = str(RANGES[field])
    for value in bad:
        with pytest.raises(SamplingParamsError) as e:
            _params(field, value)
        msg = str(e.value)
        assert msg.startswith(f"{field}=") and f"{field} must be {want}" in msg, msg
        assert len(msg) < 200, msg  # a huge value is not quoted whole


def test_ranges_read_as_intervals():
    assert str(RANGES["top_p"]) == "a number in (0, 1]"
    assert str(RANGES["repetition_penalty"]) == "a number in [1e-06, 2]"
    assert str(RANGES["temperature"]) == "a number >= 0"
    assert str(RANGES["n"]) == "an integer in [1, 128]"
    assert str(RANGES["seed"]) == f"an integer in [{-(2**63)}, {2**64 - 1}]"


def test_stop_lists_are_bounded():
    assert SamplingParams(stop=["x"] * MAX_STOP_STRINGS).stop == ("x",) * MAX_STOP_STRINGS
    assert SamplingParams(stop="y" * MAX_STOP_CHARS).stop == ("y" * MAX_STOP_CHARS,)
    for stop in (["x"] * (MAX_STOP_STRINGS + 1), "y" * (MAX_STOP_CHARS + 1),
                 ["ok", "y" * (MAX_STOP_CHARS + 1)], [""], ["a", 3], 3):
        with pytest.raises(SamplingParamsError, match=re.escape(STOP_RULE)) as e:
            SamplingParams(stop=stop)
        assert len(str(e.value)) < 300


# --- through the engine ----------------------------------------------------------------------

FLAGS = dict(load_format="dummy", device="cpu", max_total_tokens=2048, context_length=40)


@pytest.fixture(scope="module")
def engine():
    with Engine("preset:tiny", **FLAGS) as e:
        yield e


FIELDS = ["temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
          "frequency_penalty", "presence_penalty", "top_logprobs", "max_new_tokens"]
LEGAL = {f: st.sampled_from(BOUNDARIES[f][0]) for f in FIELDS}
LEGAL["stop"] = st.sampled_from([[], ["a"], ["z" * MAX_STOP_CHARS] * MAX_STOP_STRINGS])
ILLEGAL = [(f, v) for f in FIELDS for v in BOUNDARIES[f][1]] + [
    ("stop", [""]), ("stop", ["b" * (MAX_STOP_CHARS + 1)]),
    ("stop", ["c"] * (MAX_STOP_STRINGS + 1))]


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(chosen=st.fixed_dictionaries({}, optional=LEGAL), logprobs=st.booleans(),
       broken=st.one_of(st.none(), st.sampled_from(ILLEGAL)))
@example(chosen=dict(temperature=1e300, top_p=1e-300, min_p=1.0, repetition_penalty=1e-6,
                     top_k=BIG, seed=2**64 - 1, max_new_tokens=2**63, top_logprobs=20),
         logprobs=True, broken=None)
@example(chosen=dict(temperature=1e-5, frequency_penalty=-2.0, presence_penalty=2,
                     repetition_penalty=2.0, stop=["z" * MAX_STOP_CHARS] * MAX_STOP_STRINGS),
         logprobs=False, broken=None)
@example(chosen=dict(temperature=1.0), logprobs=False, broken=("repetition_penalty", 1e-300))
def test_extreme_params_through_the_engine(engine, chosen, logprobs, broken):
    params = {"max_new_tokens": 8, **chosen, "ignore_eos": True,
              "logprobs": logprobs or "top_logprobs" in chosen}
    if broken is not None:
        params[broken[0]] = broken[1]
    # a batch: the extreme request runs beside a plain one, which must not notice
    plain = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    if broken is not None:
        with pytest.raises(ValueError, match=broken[0]):
            engine.generate(input_ids=[[5, 6, 7], [5, 6, 7]], sampling_params=[params, plain])
        return
    extreme, normal = engine.generate(input_ids=[[5, 6, 7], [5, 6, 7]],
                                      sampling_params=[params, plain])
    vocab = engine.spec.vocab_size
    limit = min(params["max_new_tokens"], FLAGS["context_length"] - 3)
    assert len(extreme["token_ids"]) <= limit
    assert all(0 <= t < vocab for t in extreme["token_ids"])
    assert extreme["finish_reason"] in ("stop", "length")
    if extreme["finish_reason"] == "length":
        assert len(extreme["token_ids"]) == limit
    if params["logprobs"]:
        assert len(extreme["logprobs"]) == len(extreme["token_ids"])
        for lp in extreme["logprobs"]:
            assert math.isfinite(lp["logprob"]) and lp["logprob"] <= 0.0
            assert len(lp["top"]) == params.get("top_logprobs", 0)
            assert all(0 <= t < vocab and math.isfinite(v) for t, v in lp["top"])
    assert len(normal["token_ids"]) == 3 and normal["finish_reason"] == "length"
    # and the engine still serves
    again = engine.generate(input_ids=[5, 6, 7], sampling_params=plain)
    assert again["token_ids"] == normal["token_ids"]
