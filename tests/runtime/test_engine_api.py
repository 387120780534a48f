"""Engine API details on the tiny preset (one rank, in process): streaming, stop strings,
stop tokens, logprobs, seeds, and `moeserve bench` / `moeserve generate` on the CPU."""

import json
import subprocess
import sys
import time

import pytest

from moeserve.runtime.engine import Engine
from moeserve.runtime.request import TokenOutput
from moeserve.runtime.sampling import Finish

FLAGS = dict(load_format="dummy", device="cpu", max_total_tokens=4096, context_length=256)


@pytest.fixture(scope="module")
def engine():
    with Engine("preset:tiny", **FLAGS) as e:
        yield e


def test_stream_chunks_add_up_to_generate(engine):
    params = dict(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    whole = engine.generate("hello moe", params)
    chunks = list(engine.stream("hello moe", params))
    assert len(chunks) >= 2  # tokens arrive step by step
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 12
    assert all(c["finish_reason"] is None for c in chunks[:-1])


def test_stop_string_cuts_text_and_tokens(engine):
    params = dict(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    full = engine.generate("abc", params)
    text = full["text"]
    # pick a stop string from the middle of what the model writes greedily
    stop = next((text[i:i + 2] for i in range(3, len(text) - 2)
                 if text[i:i + 2].isprintable() and text[i:i + 2] not in text[:i + 1]), None)
    if stop is None:
        pytest.skip("the dummy model wrote no printable two-character string")
    cut = engine.generate("abc", {**params, "stop": [stop]})
    assert cut["finish_reason"] == "stop" and cut["matched_stop"] == stop
    assert cut["text"] == text[:text.index(stop)]
    assert full["token_ids"][:len(cut["token_ids"])] == cut["token_ids"]
    assert len(cut["token_ids"]) < len(full["token_ids"])
    streamed = list(engine.stream("abc", {**params, "stop": [stop]}))
    assert "".join(c["text"] for c in streamed) == cut["text"]
    assert stop not in "".join(c["text"] for c in streamed)


def test_stop_token_and_eos(engine):
    params = dict(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    full = engine.generate(input_ids=[5, 6, 7], sampling_params=params)
    target = full["token_ids"][4]
    first = full["token_ids"].index(target)
    cut = engine.generate(input_ids=[5, 6, 7],
                          sampling_params={**params, "stop_token_ids": [target]})
    assert cut["token_ids"] == full["token_ids"][:first + 1]  # the stop token is kept
    assert cut["finish_reason"] == "stop" and cut["matched_stop"] == target


def test_logprobs_are_log_softmax_of_the_model(engine):
    r = engine.generate(input_ids=[1, 2, 3], sampling_params=dict(
        max_new_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3))
    assert len(r["logprobs"]) == 4
    for lp, tok in zip(r["logprobs"], r["token_ids"]):
        assert lp["token_id"] == tok and lp["logprob"] <= 0.0
        assert len(lp["top"]) == 3 and lp["top"][0][0] == tok  # greedy = most likely
        assert lp["top"][0][1] == pytest.approx(lp["logprob"])
        assert lp["top"][0][1] >= lp["top"][1][1] >= lp["top"][2][1]


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    p = dict(max_new_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    alone = engine.generate(input_ids=[9, 8, 7], sampling_params=p)["token_ids"]
    mixed = engine.generate(input_ids=[[9, 8, 7], [1, 1, 1, 1], [4]],
                            sampling_params=[p, {**p, "seed": 1}, {**p, "seed": None}])
    assert mixed[0]["token_ids"] == alone
    other = engine.generate(input_ids=[9, 8, 7], sampling_params={**p, "seed": 99})
    assert other["token_ids"] != alone


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "moeserve.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_cli_generate_text_and_bench_json(tmp_path):
    gen = _cli("generate", "--model", "preset:tiny", "--load-format", "dummy", "--device", "cpu",
               "--max-total-tokens", "2048", "--prompt", "hi", "--prompt", "hello there",
               "--max-new-tokens", "4", "--temperature", "0", "--ignore-eos", "--json")
    assert gen.returncode == 0, gen.stderr[-2000:]
    results = json.loads(gen.stdout.strip().splitlines()[-1])["results"]
    assert [len(r["token_ids"]) for r in results] == [4, 4]
    out = tmp_path / "bench.json"
    bench = _cli("bench", "--model", "preset:tiny", "--load-format", "dummy", "--device", "cpu",
                 "--max-total-tokens", "4096", "--num-prompts", "12", "--input-len", "16",
                 "--output-len", "5", "--max-concurrency", "4", "--json", str(out))
    assert bench.returncode == 0, bench.stderr[-2000:]
    assert "output tokens: 60" in bench.stdout and "TTFT ms" in bench.stdout
    summary = json.loads(out.read_text())
    assert summary["completed"] == 12 and summary["output_tokens"] == 60
    assert summary["input_tokens"] == 12 * 16 and summary["output_tokens_per_s"] > 0
    assert summary["ttft_ms_p50"] is not None and summary["itl_ms_p50"] is not None
    bad = _cli("generate", "--model", "preset:tiny", "--load-format", "dummy", "--device", "cpu",
               "--prompt", "x", "--temperature", "-1")
    assert bad.returncode == 2 and "temperature" in bad.stderr


def test_preempted_requests_finish_with_the_same_greedy_tokens():
    import random

    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(20, 60))] for _ in range(12)]
    params = dict(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    results = []
    for kv in (8192, 400):  # 400 slots cannot hold 12 requests of ~80 tokens: preemption
        with Engine("preset:tiny", **{**FLAGS, "max_total_tokens": kv,
                                       "chunked_prefill_size": 64}) as e:
            results.append([r["token_ids"] for r in e.generate(input_ids=prompts,
                                                               sampling_params=params)])
            stats = e.kv_stats()
        assert (stats["retracted"] > 0) == (kv == 400), stats
    assert results[0] == results[1]


def test_bench_gives_every_request_the_penalties_asked_for():
    from moeserve.bench import run_bench

    seen = []

    class Engine:
        def submit(self, input_ids, params, stream, grammar, on_output):
            seen.append(params)
            on_output(TokenOutput("r", [1, 2], Finish("length")))
            return "r", None

    summary = run_bench(Engine(), [[5, 6]] * 3, 2, 2, progress=False, repetition_penalty=1.2,
                        frequency_penalty=0.5, presence_penalty=0.25)
    assert summary["completed"] == 3 and len(seen) == 3
    assert all((p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.temperature)
               == (1.2, 0.5, 0.25, 0.0) for p in seen)


@pytest.mark.multiproc
def test_kv_figures_are_summed_over_the_dp_ranks_each_reporting_its_own():
    """Every DP group's first rank puts its figures on the engine's queue itself."""
    flags = dict(FLAGS, max_total_tokens=1024)
    with Engine("preset:tiny", **flags) as one:
        one.generate(input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 2})
        per_rank = one.kv_stats()["total_slots"]
    with Engine("preset:tiny", **flags, tp_size=2, dp_size=2, enable_dp_attention=True) as e:
        out = e.generate(input_ids=[[1, 2, 3], [4, 5, 6, 7]], sampling_params={
            "max_new_tokens": 4, "ignore_eos": True})
        assert [len(o["token_ids"]) for o in out] == [4, 4]
        deadline = time.monotonic() + 10
        while e.kv_stats().get("total_slots") != 2 * per_rank and time.monotonic() < deadline:
            time.sleep(0.05)  # (each rank reports once its figures change)
        stats = e.kv_stats()
    assert stats["total_slots"] == 2 * per_rank and stats["running"] == 0, stats


@pytest.mark.multiproc
def test_an_abort_reaches_the_dp_rank_of_its_request_and_the_others_go_on():
    """Rank 0's messages reach every rank at the exchange after they arrive: a stream closed
    after its first token is aborted where it runs (its KV back), the rest finish, and the
    engine serves the next request."""
    long = {"max_new_tokens": 240, "ignore_eos": True, "temperature": 0.0}
    short = dict(long, max_new_tokens=16)
    with Engine("preset:tiny", **FLAGS, tp_size=2, dp_size=2, enable_dp_attention=True) as e:
        streams = [e.stream(input_ids=[3 + i, 5, 7], sampling_params=long if i < 2 else short)
                   for i in range(4)]
        firsts = [next(s) for s in streams]  # all four run, two on each DP rank
        assert all(f["token_ids"] for f in firsts)
        for s in streams[:2]:
            s.close()  # aborts its request, which would run 239 more steps
        rest = [[c for c in s] for s in streams[2:]]
        assert all(sum(len(c["token_ids"]) for c in r) == 15 for r in rest)
        deadline = time.monotonic() + 1
        while e.kv_stats().get("running", 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = e.kv_stats()
        assert stats["running"] == 0 and stats["waiting"] == 0, stats
        assert stats["used_slots"] == stats["prefix_cached_slots"], stats
        out = e.generate(input_ids=[9, 9, 9], sampling_params={"max_new_tokens": 3})
        assert out["error"] is None and len(out["token_ids"]) == 3
