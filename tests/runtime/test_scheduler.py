"""Scheduler properties with a deterministic stand-in for the model (no torch model needed):
the next token is a function of the whole sequence so far, as a greedy model's is."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeserve.config import EngineConfig
from moeserve.config.spec import load_model_spec
from moeserve.plan.budget import token_budget
from moeserve.batch.forward_batch import ForwardMode
from moeserve.batch.kv_cache import KVCachePool, ReqToTokenPool
from moeserve.runtime.kv_manager import KVManager
from moeserve.runtime.request import RequestInput
from moeserve.runtime.sampling import SamplingParams
from moeserve.runtime.scheduler import Scheduler

VOCAB = 97
SPEC = load_model_spec("preset:tiny")


def oracle(seq):
    h = 7
    for t in seq:
        h = (h * 31 + t) % 1_000_003
    return h % VOCAB


def make(kv_tokens, page_size=1, prefix_cache=True, **cfg):
    cfg = EngineConfig(model="preset:tiny", page_size=page_size, **cfg)
    budget = token_budget(cfg, SPEC)
    pool = KVCachePool(1, kv_tokens, 1, 2, dtype=__import__("torch").float32,
                       page_size=page_size)
    rows = ReqToTokenPool(budget.max_running_requests + 1, budget.context_length)
    return Scheduler(budget, KVManager(pool, rows, prefix_cache),
                     mixed_chunk=cfg.enable_mixed_chunk), budget


def run(sched, budget, arrivals, max_steps=5000, overlap=False):
    """Drive the scheduler: `arrivals` maps a step to the requests that arrive then. Checks each
    forward against the budget and the KV slots against double use; returns rid -> tokens.
    With `overlap`, as the worker's overlap schedule: a step is scheduled before the tokens of
    the one before are processed, its placeholders stand for those tokens."""
    done, step = {}, 0
    pending = dict(arrivals)
    in_flight = None  # (batch, tokens) launched, not processed

    def collect():
        nonlocal in_flight
        if in_flight is not None:
            batch, tokens = in_flight
            in_flight = None
            for out in sched.process(batch, tokens):
                if out.finish is not None:
                    done[out.rid] = out

    while pending or sched.has_work or in_flight:
        for inp in pending.pop(step, []):
            sched.add(inp)
        for out in sched.drain_rejected():
            done[out.rid] = out
        if in_flight is not None and sched.needs_tokens():
            collect()
        batch = sched.schedule()
        step += 1
        assert step < max_steps, "no progress"
        if batch is None:
            collect()
            continue
        limit = budget.extend if batch.mode is ForwardMode.EXTEND else budget.decode
        assert batch.num_tokens <= limit
        assert len(batch.reqs) <= budget.max_running_requests
        locs = batch.out_cache_loc.tolist()
        assert len(set(locs)) == len(locs) and 0 not in locs  # slot 0 is the dummy
        table = sched.kv.req_pool.table
        for req in batch.reqs:  # the host copy of each request's slots is its table row
            assert list(req.slots) == table[req.row, :req.kv_len].tolist(), req
        # the step's slots, in batch order, are those of each request's new positions
        want = [s for req, new, prefix in zip(batch.reqs, batch.new_tokens, batch.prefix_lens)
                for s in req.slots[prefix:prefix + len(new)]]
        assert locs == want
        sampled = [] if in_flight is None else [
            t for t, s in zip(in_flight[1], in_flight[0].samples) if s]
        assert batch.has_futures == any(t < 0 for new in batch.new_tokens for t in new)
        tokens = []
        for req, new, prefix in zip(batch.reqs, batch.new_tokens, batch.prefix_lens):
            if req.unresolved > (1 if batch.samples[batch.reqs.index(req)] else 0):
                # its token in flight: the placeholder, and nothing else, stands for it
                assert overlap and len(new) == 1 and new[0] < 0 and req.seq_len == prefix
                new = [sampled[-1 - new[0]]]
                assert new == [oracle(req.all_ids)]
            else:
                assert new == req.all_ids[prefix:prefix + len(new)]
            tokens.append(oracle(req.all_ids[:prefix] + new))
        collect()
        in_flight = (batch, tokens)
        if not overlap:
            collect()
    return done, step


def expected(prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(oracle(seq))
    return seq[len(prompt):]


def reqs_from(rng, n, max_len, max_new):
    out = {}
    for i in range(n):
        prompt = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, max_len)))
        params = SamplingParams(max_new_tokens=rng.randint(1, max_new), temperature=0)
        out.setdefault(rng.randint(0, 30), []).append(RequestInput(f"r{i}", prompt, params))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10 ** 6), chunk=st.sampled_from([None, -1, 3, 8, 64]),
       running=st.integers(1, 12), kv=st.integers(40, 400), page=st.sampled_from([1, 4]),
       cache=st.booleans(), overlap=st.booleans(), mixed=st.booleans())
def test_random_arrivals_respect_budget_never_leak_and_match_oracle(seed, chunk, running, kv,
                                                                     page, cache, overlap,
                                                                     mixed):
    rng = random.Random(seed)
    sched, budget = make(kv, page_size=page, prefix_cache=cache, chunked_prefill_size=chunk,
                         max_running_requests=running, max_prefill_tokens=32,
                         context_length=64, enable_mixed_chunk=mixed)
    # shared prefixes so the prefix cache is exercised
    arrivals = reqs_from(rng, rng.randint(1, 20), 30, 20)
    base = tuple(rng.randrange(VOCAB) for _ in range(12))
    arrivals.setdefault(5, []).append(RequestInput("shared-a", base + (1, 2),
                                                   SamplingParams(max_new_tokens=5, temperature=0)))
    arrivals.setdefault(40, []).append(RequestInput("shared-b", base + (3,),
                                                    SamplingParams(max_new_tokens=5, temperature=0)))
    done, _ = run(sched, budget, arrivals, overlap=overlap)
    all_inputs = [r for rs in arrivals.values() for r in rs]
    assert set(done) == {r.rid for r in all_inputs}
    for r in all_inputs:
        out = done[r.rid]
        if out.error:  # only a request larger than the whole cache may fail
            usable = (kv // page - 1) * page  # one page is the dummy page
            assert len(r.input_ids) + r.params.max_new_tokens > usable, (r, out.error)
            continue
        n = min(r.params.max_new_tokens, 64 - len(r.input_ids))
        assert out.token_ids == expected(r.input_ids, n), r.rid
    # KV: nothing held once every request is done, except what the prefix cache keeps
    kvm = sched.kv
    cached = kvm.radix.cached_tokens if kvm.radix else 0
    assert kvm.radix is None or kvm.radix.protected_tokens == 0
    if kvm.radix:
        kvm.radix.reset()
    assert kvm.used_slots == 0, (kvm.used_slots, cached)
    assert kvm.req_pool.available_rows == budget.max_running_requests


def test_tokens_equal_the_oracle_with_chunking_prefix_cache_and_preemption():
    rng = random.Random(3)
    arrivals = reqs_from(rng, 24, 40, 30)
    results = {}
    for chunk, kv, cache, overlap, mixed in [
            (-1, 4000, False, False, False), (5, 4000, True, True, False),
            (16, 120, True, False, False), (16, 120, True, True, False),
            (7, 90, False, True, False), (-1, 4000, False, True, True),
            (5, 4000, True, True, True), (16, 120, True, False, True),
            (16, 120, True, True, True), (7, 90, False, True, True)]:
        sched, budget = make(kv, chunked_prefill_size=chunk, max_running_requests=16,
                             max_prefill_tokens=48, context_length=128,
                             enable_mixed_chunk=mixed)
        done, _ = run(sched, budget, arrivals, overlap=overlap)
        got = {rid: _tokens_of(sched, rid, done) for rid in done}
        results[(chunk, kv, cache, overlap, mixed)] = (got, sched.num_retracted)
    first = next(iter(results.values()))[0]
    for key, (got, retracted) in results.items():
        assert got == first, key
    for mixed in (False, True):
        assert results[(16, 120, True, True, mixed)][1] > 0, "the overlap schedule preempted nothing"
    for inp in [r for rs in arrivals.values() for r in rs]:
        assert first[inp.rid] == expected(inp.input_ids, inp.params.max_new_tokens)


def _tokens_of(sched, rid, done):
    out = done[rid]
    assert out.error is None, out.error
    return out.token_ids


def test_prompt_at_context_length_is_rejected_with_a_fix():
    sched, budget = make(100, context_length=16)
    sched.add(RequestInput("long", tuple(range(16)), SamplingParams(max_new_tokens=2)))
    (out,) = sched.drain_rejected()
    assert out.finish.reason == "error" and "--context-length" in out.error
    assert not sched.has_work


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_ends_by_length_at_max_new_tokens_or_the_context(overlap):
    sched, budget = make(200, context_length=24)
    long, short = tuple(range(1, 17)), tuple(range(1, 9))
    arrivals = {0: [RequestInput("ctx", long, SamplingParams(max_new_tokens=50)),
                    RequestInput("new", short, SamplingParams(max_new_tokens=5))]}
    done, _ = run(sched, budget, arrivals, overlap=overlap)
    assert done["ctx"].finish.reason == done["new"].finish.reason == "length"
    assert done["ctx"].token_ids == expected(long, 24 - 16)
    assert done["new"].token_ids == expected(short, 5)


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_chunk_step_carries_every_running_decode_within_the_extend_budget(overlap):
    """With --enable-mixed-chunk a request admitted while others run is prefilled in a step
    that also decodes each running request (last in the batch, one token on its prefix), the
    prefill chunk taking what the decodes leave of the budget; without it, they wait."""
    params = SamplingParams(max_new_tokens=40, temperature=0)
    for mixed in (False, True):
        sched, budget = make(4000, chunked_prefill_size=16, max_running_requests=8,
                             context_length=128, enable_mixed_chunk=mixed)
        for i in range(5):
            sched.add(RequestInput(f"r{i}", tuple(range(1 + i, 4 + i)), params))
        first = sched.schedule()  # all five prefill together
        assert first.mode is ForwardMode.EXTEND and len(first.reqs) == 5
        sched.process(first, [7] * 5)
        if overlap:  # a decode in flight: the next step is scheduled before its tokens
            sched.schedule()
        sched.add(RequestInput("late", tuple(range(40)), params))
        step = sched.schedule()
        assert step.mode is ForwardMode.EXTEND
        if not mixed:
            assert [r.rid for r in step.reqs] == ["late"]
            continue
        running = [f"r{i}" for i in range(5)]
        assert [r.rid for r in step.reqs] == ["late"] + running
        assert step.num_tokens == budget.extend == 16  # 11 prompt tokens + 5 decodes
        assert [len(t) for t in step.new_tokens] == [11] + [1] * 5
        assert step.samples == [False] + [True] * 5
        for j, (req, new, prefix) in enumerate(zip(step.reqs[1:], step.new_tokens[1:],
                                                   step.prefix_lens[1:])):
            assert prefix == req.kv_len - 1
            assert new == ([-1 - j] if overlap else [req.all_ids[prefix]])  # placeholder
        assert step.has_futures == overlap
        assert [r.future_row for r in step.reqs[1:]] == list(range(5))
        assert step.rows == [r.row for r in step.reqs]
        table = sched.kv.req_pool.table
        assert step.out_cache_loc.tolist() == [
            s for r, p, t in zip(step.reqs, step.prefix_lens, step.new_tokens)
            for s in table[r.row, p:p + len(t)].tolist()]


@pytest.mark.parametrize("page_size,kv_tokens", [(1, 64), (4, 64), (1, 20), (4, 36)])
def test_claim_next_takes_the_slots_one_claim_per_request_would(page_size, kv_tokens):
    """A decode step's claims in one take: the same slots, kv_len and table rows as a claim per
    request in batch order; where the pool cannot hold them all (the smaller caches), each
    request claims on its own, as before, and those that fit get their slot."""
    import torch
    from moeserve.runtime.request import Req

    def state(bulk):
        pool = KVCachePool(1, kv_tokens, 1, 2, dtype=torch.float32, page_size=page_size)
        kv = KVManager(pool, ReqToTokenPool(9, 64), prefix_cache=False)
        rng = random.Random(page_size * 1000 + kv_tokens)
        reqs = []
        for i in range(6):
            params = SamplingParams(max_new_tokens=8, temperature=0)
            req = Req(RequestInput(f"r{i}", (1,) * 4, params), frozenset(), i, 64)
            assert kv.admit(req) and kv.claim(req, rng.randint(1, 3))
            reqs.append(req)
        got = []
        for _ in range(3):
            got.append([r.rid for r in (kv.claim_next(reqs) if bulk
                                        else [r for r in reqs if kv.claim(r, 1)])])
        return got, [list(r.slots) for r in reqs], [r.kv_len for r in reqs], \
            pool.available_slots

    assert state(True) == state(False)
