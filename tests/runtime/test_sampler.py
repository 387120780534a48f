"""Sampling parameters, the batched sampler and stop conditions, against references."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from moeserve.runtime.sampler import (Sampler, SamplingBatch, apply_penalties,
                                      sample_from_logits, seeded_uniform)
from moeserve.runtime.sampling import (Finish, SamplingParams, SamplingParamsError,
                                       StopChecker)

V = 50


def _logits(seed: int, rows: int, vocab: int = V, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def _sample(logits, params, outputs=None, prompts=None, sampler=None):
    outputs = outputs if outputs is not None else [[] for _ in params]
    batch = SamplingBatch.build(params, outputs, prompts, logits.shape[-1])
    return (sampler or Sampler(seed=0))(logits, batch)


# --- SamplingParams --------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("max_new_tokens", 0), ("max_new_tokens", 1.5), ("max_new_tokens", True),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_k", -2), ("top_k", 2.0), ("min_p", -0.1),
    ("min_p", 1.5), ("seed", 1.0), ("seed", 2**64), ("repetition_penalty", 0.0),
    ("frequency_penalty", 2.5), ("presence_penalty", -3.0), ("stop", [""]), ("stop", [3]), ("stop", 3),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop_token_ids", 5), ("ignore_eos", 1), ("logprobs", "yes"),
    ("top_logprobs", 21), ("top_logprobs", -1),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**{field: value})


def test_params_normalised():
    p = SamplingParams(top_k=0, stop="###", stop_token_ids=[7, 8], logprobs=True, top_logprobs=3)
    assert p.top_k == -1 and p.stop == ("###",) and p.stop_token_ids == (7, 8)
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy and not SamplingParams().has_penalties
    with pytest.raises(SamplingParamsError, match="logprobs=True"):
        SamplingParams(top_logprobs=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5


# --- stop conditions -------------------------------------------------------------------------

def test_stop_tokens_and_length():
    c = StopChecker(SamplingParams(max_new_tokens=3, stop_token_ids=(9,)), eos_token_ids=[2])
    assert c.check_token(5, 1) is None
    assert c.check_token(2, 1) == Finish("stop", None)
    assert c.check_token(9, 2) == Finish("stop", 9)
    assert c.check_token(5, 3) == Finish("length")
    c = StopChecker(SamplingParams(max_new_tokens=3, ignore_eos=True), eos_token_ids=[2])
    assert c.check_token(2, 1) is None and c.check_token(2, 3) == Finish("length")
    c = StopChecker(SamplingParams(max_new_tokens=3), max_output=2)  # the context's room
    assert c.check_token(5, 1) is None and c.check_token(5, 2) == Finish("length")


# --- counter-based uniforms ------------------------------------------------------------------

def _fmix32_ref(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_seeded_uniform_matches_python_reference():
    rng = random.Random(0)
    seeds = [0, 1, 2**32 - 1, 2**32, 2**64 - 1] + [rng.getrandbits(64) for _ in range(200)]
    steps = [rng.randrange(0, 2**31) for _ in seeds]
    got = seeded_uniform(torch.tensor([s & 0xFFFFFFFF for s in seeds]),
                         torch.tensor([s >> 32 for s in seeds]), torch.tensor(steps))
    for i, (s, t) in enumerate(zip(seeds, steps)):
        h = _fmix32_ref((s & 0xFFFFFFFF) ^ 0x9E3779B9)
        h = _fmix32_ref(h ^ (s >> 32))
        h = _fmix32_ref(h ^ _fmix32_ref(t))
        assert got[i].item() == (h >> 8) / 2**24


def test_seeded_uniform_is_uniform():
    n = 20000
    for lo, step in [(torch.arange(n), torch.zeros(n, dtype=torch.int64)),
                     (torch.full((n,), 7), torch.arange(n))]:
        u = seeded_uniform(lo, torch.zeros(n, dtype=torch.int64), step)
        assert u.min() >= 0 and u.max() < 1
        counts = torch.histc(u, bins=20, min=0, max=1)
        chi2 = ((counts - n / 20) ** 2 / (n / 20)).sum().item()
        assert chi2 < 43.8  # 19 degrees of freedom, p = 0.001


# --- greedy, restriction sets, distribution --------------------------------------------------

def test_greedy_is_argmax():
    logits = _logits(1, 16)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=0.8)] * 8
    out = _sample(logits, params)
    assert torch.equal(out.token_ids_B, logits.argmax(-1))


def _allowed(row: torch.Tensor, p: SamplingParams, eps: float = 1e-5) -> set[int]:
    """A float64 reference of the allowed set, generous by eps at each boundary."""
    probs = torch.softmax(row.double() / p.temperature, -1)
    ps, order = probs.sort(descending=True)
    k = p.top_k if p.top_k > 0 else len(ps)
    keep = (ps >= ps[min(k, len(ps)) - 1] - eps) & (ps >= p.min_p * ps[0] - eps)
    kept = ps * keep
    before = (kept.cumsum(0) - kept) / kept.sum()
    keep &= before < p.top_p + eps
    return set(order[keep].tolist())


@settings(max_examples=60, deadline=None)
@given(data_seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 200),
       params=st.lists(st.builds(
           SamplingParams, temperature=st.sampled_from([0.3, 0.7, 1.0, 1.5]),
           top_k=st.sampled_from([-1, 1, 2, 5, 20]),
           top_p=st.sampled_from([1.0, 0.95, 0.6, 0.2, 0.01]),
           min_p=st.sampled_from([0.0, 0.05, 0.3, 0.9]),
           seed=st.one_of(st.none(), st.integers(0, 2**40))), min_size=1, max_size=6))
def test_sampled_tokens_stay_in_allowed_set(data_seed, vocab, params):
    logits = _logits(data_seed, len(params), vocab, scale=2.0)
    for step in range(4):  # several draws per row: different step, different uniform
        out = _sample(logits, params, outputs=[[0] * step for _ in params],
                      sampler=Sampler(seed=data_seed + step))
        for r, p in enumerate(params):
            assert out.token_ids_B[r].item() in _allowed(logits[r], p), (r, p)


def _chi2(tokens: torch.Tensor, expected_p: torch.Tensor) -> float:
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=expected_p.numel()).double()
    assert counts[expected_p == 0].sum() == 0, "sampled a token of probability zero"
    exp = expected_p[expected_p > 0] * n
    return (((counts[expected_p > 0] - exp) ** 2) / exp).sum().item()


@pytest.mark.parametrize("seeded", [True, False])
def test_temperature_distribution_matches_softmax(seeded):
    n, vocab = 20000, 8
    row = _logits(3, 1, vocab, scale=1.0)
    params = [SamplingParams(temperature=0.7, seed=i if seeded else None) for i in range(n)]
    out = _sample(row.expand(n, vocab), params)
    expected = torch.softmax(row[0].double() / 0.7, -1)
    assert _chi2(out.token_ids_B, expected) < 24.3  # 7 degrees of freedom, p = 0.001


def test_filtered_distribution_over_steps():
    """One seeded request over many steps follows the top-k/top-p renormalised softmax."""
    n, vocab = 20000, 12
    row = _logits(4, 1, vocab, scale=1.0)[0]
    p = SamplingParams(temperature=1.3, top_k=6, top_p=0.8, seed=1234)
    batch = SamplingBatch.build([p] * n, [[]] * n, None, vocab)
    batch = dataclasses.replace(batch, step_S=torch.arange(n))
    tokens = Sampler(seed=0)(row.expand(n, vocab), batch).token_ids_B
    probs = torch.softmax(row.double() / 1.3, -1)
    ps, order = probs.sort(descending=True)
    ps[6:] = 0
    before = ps.cumsum(0) - ps
    ps[before >= 0.8 * ps.sum()] = 0
    expected = torch.zeros(vocab, dtype=torch.float64)
    expected[order] = ps / ps.sum()
    dof = int((expected > 0).sum()) - 1
    assert 2 <= dof <= 5
    assert _chi2(tokens, expected) < {2: 13.8, 3: 16.3, 4: 18.5, 5: 20.5}[dof]


# --- seeds -----------------------------------------------------------------------------------

def test_seed_independent_of_batch_composition():
    vocab = 100
    rng = random.Random(5)
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    target_logits = _logits(6, 1, vocab, scale=1.0)
    alone = [_sample(target_logits, [target], outputs=[[1] * step]).token_ids_B.item()
             for step in range(12)]
    assert len(set(alone)) > 3  # the seed drives a sequence, not one repeated token
    others = [SamplingParams(temperature=0), SamplingParams(top_k=5, seed=7),
              SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5),
              SamplingParams(min_p=0.2), SamplingParams(temperature=0.5, logprobs=True,
                                                        top_logprobs=4)]
    for step in range(12):
        batch_params = rng.sample(others, rng.randint(1, len(others)))
        pos = rng.randint(0, len(batch_params))
        batch_params.insert(pos, target)
        logits = _logits(100 + step, len(batch_params), vocab)
        logits[pos] = target_logits[0]
        outputs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
                   for _ in batch_params]
        outputs[pos] = [1] * step
        prompts = [[rng.randrange(vocab) for _ in range(3)] for _ in batch_params]
        out = _sample(logits, batch_params, outputs, prompts, sampler=Sampler(seed=step))
        assert out.token_ids_B[pos].item() == alone[step], step


# --- penalties -------------------------------------------------------------------------------

def _penalised_ref(row, p: SamplingParams, prompt, output):
    x = row.double().tolist()
    for t in set(prompt) | set(output):  # HF: over the whole input_ids, once per token
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):  # OpenAI: over generated tokens
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return torch.tensor(x, dtype=torch.float64)


@settings(max_examples=40, deadline=None)
@given(data_seed=st.integers(0, 2**31 - 1), params=st.lists(st.builds(
    SamplingParams, temperature=st.just(0.0),
    repetition_penalty=st.sampled_from([1.0, 0.7, 1.2, 2.0]),
    frequency_penalty=st.sampled_from([0.0, -1.0, 0.5, 2.0]),
    presence_penalty=st.sampled_from([0.0, 1.5, -0.5])), min_size=1, max_size=5))
def test_penalties_match_reference(data_seed, params):
    vocab = 30
    rng = random.Random(data_seed)
    logits = _logits(data_seed, len(params), vocab)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(0, 8))] for _ in params]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 12))] for _ in params]
    batch = SamplingBatch.build(params, outputs, prompts, vocab)
    got = apply_penalties(logits, batch)
    ref = torch.stack([_penalised_ref(logits[r], p, prompts[r], outputs[r])
                       for r, p in enumerate(params)])
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    tokens = Sampler(seed=0)(logits, batch).token_ids_B
    assert torch.equal(tokens, ref.argmax(-1))


@settings(max_examples=30, deadline=None)
@given(data_seed=st.integers(0, 2**31 - 1), params=st.lists(st.builds(
    SamplingParams, temperature=st.just(0.0),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    frequency_penalty=st.sampled_from([0.0, 1.0]),
    presence_penalty=st.sampled_from([0.0, 0.5])), min_size=1, max_size=5))
def test_a_token_still_on_the_device_is_counted_as_output(data_seed, params):
    """The overlap schedule's token in flight (a row of next_tokens) penalises as if it were
    the last output token on the host."""
    vocab = 30
    rng = random.Random(data_seed)
    logits = _logits(data_seed, len(params), vocab)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 6))] for _ in params]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randint(1, 8))] for _ in params]
    next_tokens = torch.tensor([rng.randrange(vocab) for _ in range(8)])
    rows = rng.sample(range(8), len(params))  # each request has its own row in flight
    pending = [rng.choice([-1, j]) for j in rows]
    known = [o if j < 0 else o[:-1] for o, j in zip(outputs, pending)]
    for o, j in zip(outputs, pending):
        if j >= 0:
            next_tokens[j] = o[-1]  # the host has not seen it yet
    got = apply_penalties(logits, SamplingBatch.build(params, known, prompts, vocab,
                                                      pending=pending,
                                                      next_tokens=next_tokens))
    want = apply_penalties(logits, SamplingBatch.build(params, outputs, prompts, vocab))
    assert torch.equal(got, want)


def test_repetition_penalty_matches_transformers():
    transformers = pytest.importorskip("transformers")
    logits = _logits(8, 3, 40)
    ids = [[1, 5, 5, 9, 30], [0, 2, 39, 2, 2], [7, 7, 7, 7, 1]]
    p = SamplingParams(repetition_penalty=1.4)
    batch = SamplingBatch.build([p] * 3, [row[3:] for row in ids], [row[:3] for row in ids], 40)
    proc = transformers.RepetitionPenaltyLogitsProcessor(1.4)
    torch.testing.assert_close(apply_penalties(logits, batch),
                               proc(torch.tensor([r[:3] + r[3:] for r in ids]), logits.clone()))


def test_build_rejects_bad_token_ids():
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        SamplingBatch.build([SamplingParams(presence_penalty=1.0)], [[3, 10]], None, 10)
    with pytest.raises(ValueError, match="prompt_ids"):
        SamplingBatch.build([SamplingParams(repetition_penalty=1.1)], [[3]], None, 10)


# --- logprobs --------------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax():
    vocab = 64
    logits = _logits(9, 4, vocab)
    params = [SamplingParams(logprobs=True, top_logprobs=5, temperature=0.5, top_k=3),
              SamplingParams(logprobs=True, repetition_penalty=1.5, temperature=0),
              SamplingParams(temperature=0),
              SamplingParams(logprobs=True, top_logprobs=2, seed=3, presence_penalty=1.0)]
    out = _sample(logits, params, outputs=[[1, 2]] * 4, prompts=[[3]] * 4)
    ref = torch.log_softmax(logits.double(), -1)
    chosen = ref.gather(1, out.token_ids_B[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs_B.double(), chosen, rtol=1e-5, atol=1e-5)
    assert out.top_logprobs_BN.shape == (4, 5)
    top = ref.topk(5, dim=-1)
    torch.testing.assert_close(out.top_logprobs_BN.double(), top.values, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.top_token_ids_BN, top.indices)
    plain = _sample(logits, [SamplingParams(temperature=0)] * 4)
    assert plain.logprobs_B is None and plain.top_logprobs_BN is None


def test_extreme_uniforms_pick_the_ends_of_the_allowed_set():
    """u = 0 takes the most likely kept token; u at (or, by rounding, past) the top of [0, 1)
    takes the least likely kept one, never a filtered one."""
    vocab, rows = 40, 6
    logits = _logits(10, rows, vocab)
    params = [SamplingParams(top_k=4), SamplingParams(top_p=0.5), SamplingParams(min_p=0.2),
              SamplingParams(temperature=0.3, min_p=0.01), SamplingParams(top_k=3, top_p=0.9),
              SamplingParams(top_k=2, min_p=0.9)]
    batch = SamplingBatch.build(params, [[]] * rows, None, vocab)
    for u, pick in [(0.0, min), (1 - 2**-24, max), (1.0, max)]:
        tokens = sample_from_logits(logits, batch, torch.full((rows,), u))
        for r, p in enumerate(params):
            allowed = _allowed(logits[r], p, eps=0)
            probs = torch.softmax(logits[r].double() / p.temperature, -1)
            expect = pick(allowed, key=lambda t: (-probs[t].item(), t))
            assert tokens[r].item() == expect, (r, u)


# --- inputs that are not numbers -------------------------------------------------------------

INF, NAN = float("inf"), float("nan")
MODES = {  # one of each way to pick a token
    "greedy": SamplingParams(temperature=0.0),
    "top_k=1": SamplingParams(top_k=1, temperature=0.8),
    "plain": SamplingParams(),
    "cold": SamplingParams(temperature=1.01e-5),
    "hot": SamplingParams(temperature=1e30),
    "top_k": SamplingParams(top_k=3, seed=5),
    "top_p": SamplingParams(top_p=1e-9),
    "min_p": SamplingParams(min_p=1.0),
    "all filters": SamplingParams(top_k=2, top_p=0.3, min_p=0.9, temperature=0.5, seed=2**64 - 1),
    "penalties": SamplingParams(repetition_penalty=1e-6, frequency_penalty=-2.0,
                                presence_penalty=2.0, temperature=0.7),
    "logprobs": SamplingParams(logprobs=True, top_logprobs=20, temperature=1.0,
                               repetition_penalty=2.0),
}


def _crafted_rows(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    rows = {"-inf": torch.full((vocab,), -INF), "nan": torch.full((vocab,), NAN),
            "+inf": torch.full((vocab,), INF), "float max": torch.full((vocab,), 3.4e38),
            "+-max": torch.tensor([3.4e38, -3.4e38] * (vocab // 2))}
    some = torch.randn(vocab, generator=g) * 5
    some[[2, 7]] = INF
    rows["two +inf"] = some
    some = torch.randn(vocab, generator=g) * 5
    some[::2] = NAN
    rows["half nan"] = some
    some = torch.full((vocab,), -INF)
    some[9] = 1.0
    rows["one finite"] = some
    rows["huge"] = torch.randn(vocab, generator=g) * 1e37
    return rows


@pytest.mark.parametrize("mode", list(MODES))
def test_any_logits_give_a_token_in_range(mode):
    """Rows with no finite logit, +inf, NaN and overflowing values, in every sampling mode:
    the sampler returns a token of the vocabulary for each and finite logprobs, never fails."""
    vocab = 24
    rows = _crafted_rows(vocab)
    logits = torch.stack(list(rows.values()))
    p = MODES[mode]
    n = len(rows)
    prompts = [[0, 9, 2] for _ in range(n)]
    outputs = [[7, 7, 3] for _ in range(n)]
    for step in range(3):
        out = _sample(logits, [p] * n, [o + [1] * step for o in outputs], prompts,
                      sampler=Sampler(seed=step))
        tokens = out.token_ids_B
        assert tokens.dtype == torch.int64 and tokens.shape == (n,)
        assert ((tokens >= 0) & (tokens < vocab)).all(), tokens
        got = dict(zip(rows, tokens.tolist()))
        if not p.greedy:
            # +inf dominates: only the +inf tokens can be drawn; a lone finite logit wins
            assert got["two +inf"] in (2, 7) and got["one finite"] == 9, got
            assert got["half nan"] % 2 == 1, got  # a NaN logit is never drawn
        if p.logprobs:
            assert torch.isfinite(out.logprobs_B).all()
            assert torch.isfinite(out.top_logprobs_BN).all()
            top = out.top_token_ids_BN
            assert ((top >= 0) & (top < vocab)).all()


def test_a_row_that_keeps_nothing_takes_its_most_likely_token():
    """Filters that would keep no token (a SamplingBatch built by hand, outside the ranges
    SamplingParams allows) fall back to the most likely token, not to index -1."""
    vocab = 10
    logits = _logits(12, 3, vocab)
    batch = SamplingBatch.build([SamplingParams()] * 3, [[]] * 3, None, vocab)
    batch = dataclasses.replace(batch, top_k_S=torch.zeros(3, dtype=torch.int64),
                                min_p_S=torch.full((3,), 2.0), top_p_S=torch.zeros(3))
    tokens = sample_from_logits(logits, batch, torch.tensor([0.0, 0.5, 1.0]))
    assert torch.equal(tokens, logits.argmax(-1))
