"""Prefill CUDA graphs cut at each attention: the size choice (CPU), the static buffers from the
plan (CPU), the cut points of the forward (CPU), and on a GPU the same tokens and logprobs
with and without --disable-piecewise-cuda-graph."""

from __future__ import annotations

import random

import pytest
import torch

from moeserve.config import EngineConfig
from moeserve.config.spec import load_model_spec
from moeserve.parallel.groups import single_process_state
from moeserve.plan.capacity import build_plan
from moeserve.runtime.prefill_graph import PrefillGraphRunner, choose_size
from spies import spy


def test_size_is_the_smallest_that_holds_the_largest_dp_rank():
    sizes = [4, 8, 12, 16, 32, 48]
    assert choose_size(sizes, [1]) == 4
    assert choose_size(sizes, [13]) == 16
    assert choose_size(sizes, [0, 33, 5]) == 48  # an idle DP rank replays it too
    assert choose_size(sizes, [48]) == 48
    assert choose_size(sizes, [49]) is None  # above the largest: eager
    assert choose_size(sizes, [0, 0]) is None
    assert choose_size([], [3]) is None


def test_prefill_graph_buffers_come_from_the_plan():
    from moeserve.runtime.buffers import bind_buffers

    # plans for a GPU (on any machine: the records are the config's)
    cfg = EngineConfig(model="preset:tiny", device="cuda", gpu_memory_gb=1.0,
                       chunked_prefill_size=256, skip_tokenizer_init=True)
    plan = build_plan(cfg, load_model_spec(cfg.model))
    sizes = plan.budget.prefill_token_sizes
    assert sizes[0] == 4 and sizes[-1] == 256
    spec = plan.spec  # 4 query heads of 16 dims
    assert plan.buffer("graph.prefill.inputs").shape == (3, 256)
    assert plan.buffer("graph.prefill.q").shape == (256, spec.num_heads, spec.head_dim)
    assert plan.buffer("graph.prefill.attn_out").shape == (256, 4, 16)
    assert plan.buffer("graph.prefill.q").dtype == "float32"
    bufs = bind_buffers(plan, "cpu").prefill_graph
    assert bufs.q.shape == (256, 4, 16) and bufs.inputs.dtype == torch.int64
    assert not bufs.attn_out.any()  # rows no attention writes hold zeros from the start
    off = build_plan(cfg.replace(disable_piecewise_cuda_graph=True), spec)
    assert off.budget.prefill_token_sizes == ()
    assert not [r for r in off.buffers if r.name.startswith("graph.prefill.")]
    # latent attention hands over [q_nope | q_pe] (192 dims) and gets v_head_dim (128) back
    ds = EngineConfig(model="preset:deepseek-v2-lite", gpu_memory_gb=80.0, device="cuda",
                      skip_tokenizer_init=True)
    ds_plan = build_plan(ds, load_model_spec(ds.model))
    t = max(ds_plan.budget.prefill_token_sizes)
    assert ds_plan.ok and t
    assert ds_plan.buffer("graph.prefill.q").shape == (t, 16, 192)
    assert ds_plan.buffer("graph.prefill.attn_out").shape == (t, 16, 128)


@pytest.mark.parametrize("arch", ["qwen3-moe", "deepseek-v2"])
def test_the_forward_is_cut_once_per_layer_at_its_attention(arch, tmp_path):
    """hidden_states + logits is the forward; an attention hook sees every layer's query in
    order and its output is the attention's (what a capture relies on), latent attention
    (DeepSeek-V2, [q_nope | q_pe] of 8 + 8 dims) included."""
    import json

    from moeserve.config.presets import PRESETS
    from moeserve.models.build import load_model
    from moeserve.batch.forward_batch import ForwardMode, prepare_batch
    from moeserve.batch.step import step_from_counts
    from moeserve.runtime.buffers import bind_buffers

    model_name = "preset:tiny"
    if arch == "deepseek-v2":
        (tmp_path / "config.json").write_text(json.dumps(dict(
            PRESETS["deepseek-v2-lite"], hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=12, intermediate_size=96, moe_intermediate_size=16,
            n_routed_experts=8, vocab_size=512, torch_dtype="float32")))
        model_name = str(tmp_path)
    cfg = EngineConfig(model=model_name, device="cpu", gpu_memory_gb=1.0,
                       load_format="dummy", max_running_requests=4, context_length=64,
                       skip_tokenizer_init=True)
    plan = build_plan(cfg, load_model_spec(cfg.model))
    state = single_process_state(plan.layout, torch.device("cpu"))
    model = load_model(cfg, plan.spec, state, plan, progress=False)
    bufs = bind_buffers(plan, state.device)
    model.bind_buffers(bufs.model)
    kv, rows = bufs.kv_pool, bufs.req_pool
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    fb = prepare_batch(ForwardMode.EXTEND, prompts, [0, 0], [0, 1], rows, kv)
    step = step_from_counts([fb.num_tokens], plan.layout, 0, plan)
    with torch.no_grad():
        want = model(fb.input_ids, fb.positions, fb, step)
        seen = []

        def hook(q, layer, batch):
            seen.append((layer.layer_id, tuple(q.shape)))
            return layer.backend.forward(q, layer, batch)

        fb.attention_hook = hook
        got = model.logits(*model.hidden_states(fb.input_ids, fb.positions, fb, step), fb)
    assert seen == [(i, (8, 4, 16)) for i in range(plan.spec.num_layers)]
    assert got.shape == (2, plan.spec.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # on a CPU nothing is captured
    assert bufs.prefill_graph is None
    assert PrefillGraphRunner.create(plan, model, state, None, kv, rows, None) is None


@pytest.mark.gpu
@pytest.mark.parametrize("runner", ["reference", "triton"])
def test_prefill_graphs_give_the_eager_tokens_and_logprobs(monkeypatch, runner):
    """Prompts of many lengths, a shared prefix (cached), chunked prefills, a short prompt
    alone, and decodes of more rows than the largest decode bucket (4): the same greedy tokens
    and logprobs as eager forwards (fp32)."""
    from moeserve.batch.forward_batch import ForwardMode
    from moeserve.runtime.engine import Engine

    replays = spy(monkeypatch, PrefillGraphRunner, "replay",
                  lambda self, fb, size: (fb.mode, size))
    rng = random.Random(3)
    shared = [rng.randrange(512) for _ in range(40)]
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (1, 9, 33, 70, 150, 17)]
    prompts += [shared + [1, 2, 3], shared + [4, 5, 6, 7, 8], [rng.randrange(512)
                                                              for _ in range(5)]]
    params = [{"max_new_tokens": m, "temperature": 0.0, "ignore_eos": True, "logprobs": True}
              for m in (6, 9, 5, 3, 4, 12, 5, 7, 4)]
    flags = dict(load_format="dummy", dtype="float32", device="cuda", skip_tokenizer_init=True,
                 max_running_requests=16, max_total_tokens=4096, context_length=256,
                 chunked_prefill_size=32, cuda_graph_max_bs=4,
                 attention_backend="triton", moe_runner_backend=runner)
    results = {}
    for pieces in (True, False):
        with Engine("preset:tiny", disable_piecewise_cuda_graph=not pieces, **flags) as engine:
            first = engine.generate(input_ids=prompts[:6], sampling_params=params[:6])
            second = engine.generate(input_ids=prompts[6:8], sampling_params=params[6:8])
            alone = engine.generate(input_ids=prompts[8:], sampling_params=params[8:])
        out = first + second + alone
        assert all(o["error"] is None for o in out), out
        results[pieces] = out
    graph, eager = results[True], results[False]
    assert [o["token_ids"] for o in graph] == [o["token_ids"] for o in eager]
    for g, e in zip(graph, eager):
        lg = torch.tensor([t["logprob"] for t in g["logprobs"]])
        le = torch.tensor([t["logprob"] for t in e["logprobs"]])
        torch.testing.assert_close(lg, le, rtol=1e-4, atol=1e-4)
    sizes = [size for _, size in replays]
    assert sizes and max(sizes) <= 32 and len(set(sizes)) >= 3
    assert (ForwardMode.DECODE, 8) in replays  # the first six prompts' decodes, 5 or 6 rows


def test_the_runner_takes_decode_graphs_then_prefill_graphs_then_eager():
    """Which path a step takes: a decode graph when every rank decodes and a bucket holds
    the step; otherwise the prefill graphs when a size holds it (a prefill, or a decode above
    the largest bucket); otherwise eager. Without decode graphs (--disable-cuda-graph) a
    decode runs eagerly."""
    from moeserve.batch.step import step_from_counts
    from moeserve.parallel.devices import runtime_config
    from moeserve.runtime.engine import make_plan
    from moeserve.runtime.worker import RankWorker

    cfg = runtime_config(EngineConfig(model="preset:tiny", load_format="dummy", device="cpu",
                                      context_length=64, max_running_requests=4))
    plan = make_plan(cfg)
    runner = RankWorker(cfg, plan.spec, plan, single_process_state(plan.layout), (3,)).runner
    taken = []

    class Decode:
        def bucket_for(self, counts, all_decode):
            return 4 if all_decode and max(counts) <= 4 else None

        def replay(self, batch, bs):
            taken.append(("decode", bs))
            return torch.zeros(0)

    class Prefill:
        def size_for(self, counts):
            return 16 if max(counts) <= 16 else None

        def replay(self, fb, size):
            taken.append(("prefill", size))
            return torch.zeros(0)

    eager = runner.model
    runner.model = lambda *a: taken.append(("eager",)) or torch.zeros(0)
    runner.graphs, runner.prefill_graphs = Decode(), Prefill()
    cases = [(3, True), (9, True), (40, True), (9, False), (3, False), (40, False)]
    for tokens, all_decode in cases:
        step = step_from_counts([tokens], plan.layout, 0, plan)
        runner.forward(None, step, all_decode)
    assert taken == [("decode", 4), ("prefill", 16), ("eager",), ("prefill", 16),
                     ("prefill", 16), ("eager",)]
    taken.clear()
    runner.graphs = None  # --disable-cuda-graph: decodes run eagerly, prefills in pieces
    for tokens, all_decode in cases:
        runner.forward(None, step_from_counts([tokens], plan.layout, 0, plan), all_decode)
    assert taken == [("eager",)] * 3 + [("prefill", 16), ("prefill", 16), ("eager",)]
    runner.model = eager
