"""logit_bias, min_tokens' banned tokens, per-choice seeds and prompt scoring in the sampler,
against dense references."""

from __future__ import annotations

import math

import pytest
import torch

from moeserve.runtime.sampler import Sampler, SamplingBatch, apply_penalties, score_prompt
from moeserve.runtime.sampling import (MAX_LOGIT_BIAS, SamplingParams, SamplingParamsError,
                                       StopChecker, choice_seed)

V = 64


def _logits(seed: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3.0


def test_bias_and_bans_against_a_dense_reference():
    logits = _logits(1, 4)
    params = [SamplingParams(logit_bias={3: 5.5, 9: -100.0}), SamplingParams(),
              SamplingParams(logit_bias={3: 2.0, 60: 100.0}, frequency_penalty=0.5),
              SamplingParams(logit_bias={7: 1.0})]
    banned = [set(), {4, 5}, set(), {7}]
    outputs = [[1], [2, 2], [3], []]
    batch = SamplingBatch.build(params, outputs, None, V, banned=banned)
    got = apply_penalties(logits, batch)
    want = logits.clone()
    want[0, 3] += 5.5
    want[0, 9] -= 100.0
    want[1, [4, 5]] = -math.inf
    want[2, 3] += 2.0
    want[2, 60] += 100.0
    want[2, 3] -= 0.5  # frequency penalty over the output [3]
    want[3, 7] = -math.inf  # a bias and a ban of one token: banned
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(logits, _logits(1, 4))  # the input is left as it was


def test_banned_tokens_are_never_sampled_and_logprobs_stay_raw():
    logits = _logits(2, 3)
    top = logits.argmax(dim=-1).tolist()
    params = [SamplingParams(temperature=0, logprobs=True),
              SamplingParams(temperature=1.0, seed=9, logprobs=True),
              SamplingParams(temperature=0.7, logprobs=True, logit_bias={11: 100.0})]
    sampler = Sampler(seed=0)
    raw = torch.log_softmax(logits, dim=-1)
    for step in range(60):
        banned = [{top[0]}, {top[1], 0, 1, 2}, set()]
        batch = SamplingBatch.build(params, [[0] * step] * 3, None, V, banned=banned)
        out = sampler(logits, batch)
        toks = out.token_ids_B.tolist()
        assert toks[0] != top[0] and toks[0] == logits[0].topk(2).indices[1].item()
        assert toks[1] not in banned[1]
        assert toks[2] == 11  # +100 on a logit of a few units: all the mass
        torch.testing.assert_close(out.logprobs_B, raw[torch.arange(3), out.token_ids_B])


def test_build_rejects_bias_outside_the_vocabulary():
    with pytest.raises(ValueError, match="must lie in"):
        SamplingBatch.build([SamplingParams(logit_bias={V: 1.0})], [[]], None, V)


@pytest.mark.parametrize("bias", [{1: 100.5}, {1: -101}, {1: math.nan}, {-1: 1.0},
                                  {"1": 1.0}, {True: 1.0},
                                  {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}])
def test_logit_bias_validation(bias):
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_normalised_and_min_tokens_bound():
    p = SamplingParams(logit_bias={9: 1, 2: -3.5})
    assert p.logit_bias == ((2, -3.5), (9, 1.0))
    assert SamplingParams(logit_bias=[(9, 1.0), (2, -3.5)]).logit_bias == p.logit_bias
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(max_new_tokens=3, min_tokens=4)
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_stop_checker_bans_ending_tokens_until_min_tokens():
    stop = StopChecker(SamplingParams(min_tokens=3, stop_token_ids=(5,)), eos_token_ids=(0,))
    assert [stop.banned(n) for n in range(5)] == [{0, 5}] * 3 + [set()] * 2
    eos_off = StopChecker(SamplingParams(min_tokens=2, ignore_eos=True), eos_token_ids=(0,))
    assert eos_off.banned(0) == set()


def test_choice_seeds_are_distinct_streams():
    for seed in (0, 1, 2**64 - 1, 12345):
        seeds = [choice_seed(seed, j) for j in range(64)]
        assert seeds[0] == seed and len(set(seeds)) == 64
        assert all(0 <= s < 2**64 for s in seeds)
        assert seeds == [choice_seed(seed, j) for j in range(64)]
    # seed s's second choice is not seed s + 1's first, as it would be with seed + j
    assert choice_seed(7, 1) != 8 and choice_seed(7, 1) != choice_seed(8, 0)


def test_score_prompt_against_log_softmax():
    logits = _logits(3, 6).double()
    targets = torch.tensor([0, 5, 63, 17, 17, 2])
    got = score_prompt(logits, targets, 4)
    ref = torch.log_softmax(logits, dim=-1)
    want = ref[torch.arange(6), targets]
    torch.testing.assert_close(got.logprobs_R.double(), want, atol=1e-5, rtol=0)
    ranks = (ref > want[:, None]).sum(dim=-1) + 1
    assert got.ranks_R.tolist() == ranks.tolist()
    assert got.top_token_ids_RN.tolist() == ref.topk(4).indices.tolist()
    assert score_prompt(logits, targets, 0).top_logprobs_RN is None
