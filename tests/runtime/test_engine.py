"""The runtime end to end: Engine and `moeserve generate` against transformers' generate."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from moeserve.runtime.engine import Engine, EngineError
from moeserve.runtime.warmup import run_warmup, warm_up_prefill
from moeserve.testing.tiny_models import make_hf_model, save_checkpoint

ARCHS = {
    "Qwen3MoeForCausalLM": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=12, num_experts=8,
                                num_experts_per_tok=2, moe_intermediate_size=16,
                                intermediate_size=48, vocab_size=96, norm_topk_prob=True,
                                mlp_only_layers=[1]),
    "Qwen2MoeForCausalLM": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                intermediate_size=48, vocab_size=96),
    "MixtralForCausalLM": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                               intermediate_size=16, vocab_size=96),
    "OlmoeForCausalLM": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                             intermediate_size=16, vocab_size=96),
}
LAYOUTS = {
    "tp2": dict(tp_size=2),
    "ep2": dict(tp_size=2, ep_size=2),
    "dp2": dict(tp_size=2, dp_size=2, enable_dp_attention=True),
    "a2a-sp": dict(tp_size=2, ep_size=2, moe_a2a_backend="all_to_all"),
    # the nvlink dispatcher's layout, its peers' stores emulated by gloo
    "nvlink-dp": dict(tp_size=2, ep_size=2, dp_size=2, enable_dp_attention=True,
                      moe_a2a_backend="nvlink"),
}
PROMPTS = [[3, 17, 42, 5, 9], [60, 2], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [7]]
NEW = 6
BASE = dict(dtype="float32", max_total_tokens=2048, context_length=128, skip_tokenizer_init=True,
            max_running_requests=8, disable_cuda_graph=True, disable_piecewise_cuda_graph=True,
            device="cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One tiny checkpoint per architecture, and transformers' greedy tokens for PROMPTS."""
    out = {}
    for i, (arch, shape) in enumerate(ARCHS.items()):
        hf = make_hf_model(arch, seed=i, **shape)
        folder = save_checkpoint(hf, tmp_path_factory.mktemp(arch))
        hf.generation_config.eos_token_id = None
        ref = []
        with torch.no_grad():
            for p in PROMPTS:
                seq = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                                  min_new_tokens=NEW, pad_token_id=0)
                ref.append(seq[0, len(p):].tolist())
        out[arch] = (str(folder), ref)
    return out


GREEDY = dict(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_one_rank_greedy_equals_transformers(checkpoints, arch):
    folder, ref = checkpoints[arch]
    with Engine(folder, **BASE) as engine:
        results = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [r["token_ids"] for r in results] == ref
        assert all(r["finish_reason"] == "length" for r in results)
        assert results[0]["usage"] == {"prompt_tokens": 5, "completion_tokens": NEW,
                                       "cached_tokens": 0}
        # chunked prefill and prefix-cache hits give the same tokens
    for chunk in (2, 3):
        with Engine(folder, **{**BASE, "chunked_prefill_size": chunk}) as engine:
            again = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert [r["token_ids"] for r in again] == ref, chunk
            # the same prompts again: their prefixes now come from the prefix cache
            cached = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert [r["token_ids"] for r in cached] == ref
            assert cached[2]["usage"]["cached_tokens"] > 0


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_greedy_equal_transformers(checkpoints, layout):
    for arch, (folder, ref) in checkpoints.items():
        with Engine(folder, **BASE, **LAYOUTS[layout]) as engine:
            got = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [r["token_ids"] for r in got] == ref, (arch, layout)


def _cli(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "moeserve.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.mark.multiproc
@pytest.mark.parametrize("arch,layout", [("Qwen3MoeForCausalLM", "a2a-sp"),
                                         ("Qwen2MoeForCausalLM", "dp2"),
                                         ("MixtralForCausalLM", "ep2"),
                                         ("OlmoeForCausalLM", "tp2")])
def test_cli_generate_json_equals_transformers(checkpoints, arch, layout):
    folder, ref = checkpoints[arch]
    flags = []
    for k, v in {**BASE, **LAYOUTS[layout]}.items():
        flag = "--" + k.replace("_", "-")
        flags += [flag] if v is True else [flag, str(v)]
    ids = [a for p in PROMPTS for a in ("--input-ids", ",".join(map(str, p)))]
    proc = _cli("generate", "--model", folder, *flags, *ids, "--max-new-tokens", str(NEW),
                "--temperature", "0", "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])["results"]
    assert [r["token_ids"] for r in results] == ref
    assert all(r["finish_reason"] == "length" for r in results)


def test_startup_warm_up_leaves_no_trace(checkpoints):
    """Every eager variant of the warm-up list (run on GPUs at startup; here forced on the CPU)
    takes no KV slot or request row, leaves the sampler's generator as it was and changes no
    later token."""
    folder, ref = checkpoints["Qwen3MoeForCausalLM"]
    with Engine(folder, **BASE) as engine:
        runner = engine._thread._args[0].runner
        wplan = runner.warmup_plan
        assert run_warmup(runner, wplan).skipped == wplan.skipped is not None  # a CPU
        slots, rows = runner.kv_pool.available_slots, runner.req_pool.available_rows
        generator = runner.sampler.generator.get_state()
        report = run_warmup(runner, wplan, force=True)
        eager = [v for v in wplan.variants if v.via == "eager"]
        assert sum(report.ran.values()) == len(eager) > 0
        # a prefill longer than a request row (the context, 128 tokens) runs as several
        assert warm_up_prefill(runner, [5, 33, 300]) == [5, 33, 300]
        assert runner.kv_pool.available_slots == slots
        assert runner.req_pool.available_rows == rows
        assert torch.equal(runner.sampler.generator.get_state(), generator)
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["token_ids"] for o in outs] == ref


def test_64_concurrent_requests_of_mixed_lengths_finish():
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 200))] for _ in range(64)]
    params = [dict(max_new_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 0.8]),
                   seed=i, ignore_eos=True) for i in range(64)]
    with Engine("preset:tiny", load_format="dummy", device="cpu", max_total_tokens=6000,
                max_running_requests=32, chunked_prefill_size=256,
                disable_cuda_graph=True) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=params)
        assert [len(r["token_ids"]) for r in results] == [p["max_new_tokens"] for p in params]
        assert all(r["error"] is None for r in results)
        # every KV slot is back once every request is done (the prefix cache may keep some)
        stats = engine.kv_stats()
        assert stats["used_slots"] == stats["prefix_cached_slots"]


def test_bad_input_is_refused_clearly():
    with pytest.raises(EngineError, match="--speculative-num-draft-tokens"):
        Engine("preset:tiny", load_format="dummy", device="cpu",
               speculative_num_draft_tokens=2)
    with pytest.raises(EngineError, match="tp % ep"):
        Engine("preset:tiny", load_format="dummy", device="cpu", tp_size=2, ep_size=3)
    with Engine("preset:tiny", load_format="dummy", device="cpu", context_length=64,
                max_total_tokens=512) as engine:
        r = engine.generate(input_ids=list(range(64)), sampling_params={"max_new_tokens": 2})
        assert r["finish_reason"] == "error" and "--context-length" in r["error"]
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.generate(input_ids=[1, 2, 100000])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.generate(input_ids=[[1, 2], [1, 100000]])
        assert not engine._pending and not any(engine._load)  # none of that batch ran
        with pytest.raises(ValueError, match="unknown sampling parameter"):
            engine.generate(input_ids=[1, 2], sampling_params={"temprature": 0})
        ok = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 3})
        assert len(ok["token_ids"]) <= 3 and ok["error"] is None


@pytest.mark.multiproc
def test_killed_rank_stops_the_engine_with_an_error_within_seconds():
    engine = Engine("preset:tiny", load_format="dummy", device="cpu", tp_size=2,
                    max_total_tokens=2048)
    try:
        assert engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)["error"] is None
        os.kill(engine._procs[1].pid, signal.SIGKILL)
        start = time.monotonic()
        try:  # the engine may notice the death before or after this request is queued
            r = engine.generate(input_ids=[4, 5, 6], sampling_params={"max_new_tokens": 500,
                                                                       "ignore_eos": True})
            assert r["error"] and "rank 1" in r["error"]
        except EngineError as exc:
            assert "rank 1" in str(exc)
        assert time.monotonic() - start < 30
        with pytest.raises(EngineError, match="rank 1"):
            engine.generate(input_ids=[1])
    finally:
        engine.shutdown()


@pytest.mark.multiproc
def test_two_nodes_on_one_machine_give_the_single_node_tokens():
    from moeserve.parallel.net import free_port

    common = ["--model", "preset:tiny", "--load-format", "dummy", "--device", "cpu",
              "--tp", "2", "--ep", "2", "--max-total-tokens", "2048"]
    gen = ["--input-ids", "5,6,7,8", "--input-ids", "9,10", "--max-new-tokens", "5",
           "--temperature", "0", "--ignore-eos", "--json"]
    single = _cli("generate", *common, *gen)
    assert single.returncode == 0, single.stderr[-3000:]
    addr = f"127.0.0.1:{free_port()}"
    multi = ["--nnodes", "2", "--dist-init-addr", addr]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    node1 = subprocess.Popen([sys.executable, "-m", "moeserve.cli", "worker", *common, *multi,
                              "--node-rank", "1"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        node0 = _cli("generate", *common, *multi, "--node-rank", "0", *gen)
        assert node0.returncode == 0, node0.stderr[-3000:]
        assert node1.wait(timeout=60) == 0, node1.stderr.read()[-3000:]
    finally:
        if node1.poll() is None:
            node1.kill()
    tokens = [json.loads(p.stdout.strip().splitlines()[-1])["results"] for p in (single, node0)]
    assert [r["token_ids"] for r in tokens[0]] == [r["token_ids"] for r in tokens[1]]
    assert all(len(r["token_ids"]) == 5 for r in tokens[1])
