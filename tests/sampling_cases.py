"""Sampling parameters that exercise every path of a step's sampling, for the rank-loop tests
that compare two ways of running the same requests (tests/runtime/test_worker.py,
test_mixed_chunk.py)."""

from __future__ import annotations

from moeserve.runtime.sampling import SamplingParams


def varied(stop: list[int]) -> dict[str, SamplingParams]:
    """Seeded sampling, penalties, logprobs, a stop token (`stop`) and eos, in that order."""
    p = dict(temperature=0.0, ignore_eos=True)
    return {
        "seeded": SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=7,
                                 ignore_eos=True),
        "penalised": SamplingParams(max_new_tokens=7, frequency_penalty=1.5,
                                    repetition_penalty=1.3, **p),
        "logprobs": SamplingParams(max_new_tokens=5, logprobs=True, top_logprobs=2, **p),
        "stop": SamplingParams(max_new_tokens=12, stop_token_ids=stop, **p),
        "eos": SamplingParams(max_new_tokens=12, temperature=0.0),
    }
