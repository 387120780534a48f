"""A request whose own sampling inputs fail (its bans, its grammar's mask, its parameters) ends
with an error; the other requests of the same steps go on with the tokens they would have had
without it, and the engine keeps serving."""

from __future__ import annotations

import pytest

from moeserve.runtime.engine import Engine
from moeserve.runtime.sampling import StopChecker

FLAGS = dict(load_format="dummy", device="cpu", skip_tokenizer_init=True, max_total_tokens=2048,
             context_length=128, max_running_requests=8, disable_overlap_schedule=False)
PROMPTS = [[3, 17, 42, 5], [60, 2, 9], [11, 12, 13]]
BAD_SEED = 13


def _params(seeds):
    return [{"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True, "seed": s}
            for s in seeds]


@pytest.fixture(scope="module")
def engine():
    with Engine("preset:tiny", **FLAGS) as e:
        yield e


def test_a_request_whose_bans_fail_ends_alone(engine, monkeypatch):
    clean = engine.generate(input_ids=PROMPTS, sampling_params=_params([1, 2, 3]))
    real = StopChecker.banned

    def banned(self, n):
        if self.params.seed == BAD_SEED:
            raise RuntimeError("a broken ban list")
        return real(self, n)

    monkeypatch.setattr(StopChecker, "banned", banned)
    out = engine.generate(input_ids=PROMPTS, sampling_params=_params([1, BAD_SEED, 3]))
    assert out[1]["finish_reason"] == "error" and "a broken ban list" in out[1]["error"], out[1]
    assert "Traceback" not in out[1]["error"]
    for i in (0, 2):
        assert out[i]["error"] is None and out[i]["token_ids"] == clean[i]["token_ids"]
    monkeypatch.undo()
    again = engine.generate(input_ids=PROMPTS, sampling_params=_params([1, 2, 3]))
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in clean]


def test_a_request_whose_parameters_fail_ends_alone(engine, monkeypatch):
    from moeserve.runtime.sampler import SamplingBatch

    clean = engine.generate(input_ids=PROMPTS, sampling_params=_params([1, 2, 3]))
    real = SamplingBatch.build.__func__

    def build(cls, params, *args, **kwargs):
        if any(p.seed == BAD_SEED for p in params):
            raise ValueError("parameters the sampler cannot take")
        return real(cls, params, *args, **kwargs)

    monkeypatch.setattr(SamplingBatch, "build", classmethod(build))
    out = engine.generate(input_ids=PROMPTS, sampling_params=_params([1, 2, BAD_SEED]))
    assert out[2]["finish_reason"] == "error" and "cannot take" in out[2]["error"], out[2]
    for i in (0, 1):
        assert out[i]["error"] is None and out[i]["token_ids"] == clean[i]["token_ids"]
