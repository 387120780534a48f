"""--enable-mixed-chunk end to end on the CPU: a prefill step carries the running requests'
decodes, and every request gets the tokens it gets without the flag (fp32, tiny model), with
and without the overlap schedule, under KV pressure, and with DP attention on 2 gloo ranks."""

import pytest
import torch

from moeserve.batch.forward_batch import ForwardMode
from moeserve.config import EngineConfig
from moeserve.parallel.devices import runtime_config
from moeserve.parallel.groups import single_process_state
from moeserve.runtime.engine import Engine, make_plan
from moeserve.runtime.grammar import GrammarSpec
from moeserve.runtime.request import RequestInput
from moeserve.runtime.sampling import SamplingParams
from moeserve.runtime.worker import Message, RankWorker
from sampling_cases import varied
from moeserve.testing.tiny_models import make_hf_model, save_checkpoint


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _worker(overlap: bool, mixed: bool, **flags) -> RankWorker:
    torch.manual_seed(0)  # the same dummy weights for every worker
    flags = dict(dict(context_length=128, max_running_requests=4, chunked_prefill_size=16),
                 **flags)
    cfg = runtime_config(EngineConfig(
        model="preset:tiny", load_format="dummy", device="cpu", dtype="float32",
        disable_overlap_schedule=not overlap, enable_mixed_chunk=mixed, random_seed=1,
        **flags))
    plan = make_plan(cfg)
    return RankWorker(cfg, plan.spec, plan, single_process_state(plan.layout), (3,))


def _serve(worker: RankWorker, arrivals: dict[int, list[RequestInput]]) -> tuple[dict, int]:
    """Iterate until every request is done: (rid -> (tokens, logprobs, finish, error), how
    many steps were mixed: a prefill that carries decodes)."""
    mixed = []
    launch = worker.runner.launch_forward

    def spied(batch, *a, **k):
        if batch is not None and batch.mode is ForwardMode.EXTEND:
            decodes = sum(r.kv_len == p + 1 and p >= len(r.prompt_ids)
                          for r, p in zip(batch.reqs, batch.prefix_lens))
            mixed.append(decodes > 0 and decodes < len(batch.reqs))
        return launch(batch, *a, **k)

    worker.runner.launch_forward = spied
    got: dict[str, list] = {}
    finished: dict[str, tuple] = {}
    step, busy = 0, True
    while busy or arrivals:
        outs, _, busy = worker.iteration([Message("add", r) for r in arrivals.pop(step, [])])
        step += 1
        assert step < 1000
        for o in outs:
            toks, lps = got.setdefault(o.rid, [[], []])
            toks += o.token_ids
            lps += [(lp["token_id"], round(lp["logprob"], 3)) for lp in o.logprobs]
            if o.finish is not None:
                finished[o.rid] = (toks, lps, o.finish.reason, o.error)
    kv = worker.scheduler.kv
    assert kv.used_slots == (kv.radix.cached_tokens if kv.radix else 0)
    assert worker.in_flight is None and not worker.scheduler.has_work
    return finished, sum(mixed)


def _requests(stop: list[int]) -> dict[int, list[RequestInput]]:
    """Staggered arrivals and lengths, more requests than run at once: each admission comes
    while others decode."""
    p = dict(temperature=0.0, ignore_eos=True)
    cases = {
        "greedy": SamplingParams(max_new_tokens=9, **p),
        "long": SamplingParams(max_new_tokens=25, **p),
        **varied(stop),
        # n = 2 as the server runs it: the same prompt twice, its sampling seeded apart
        "n0": SamplingParams(max_new_tokens=6, temperature=0.8, seed=11, ignore_eos=True),
        "n1": SamplingParams(max_new_tokens=6, temperature=0.8, seed=12, ignore_eos=True),
        "long2": SamplingParams(max_new_tokens=20, **p),
    }
    arrivals: dict[int, list[RequestInput]] = {}
    prompt: tuple[int, ...] = ()
    for i, (rid, params) in enumerate(cases.items()):
        prompt = (prompt if rid == "n1"  # n0's
                  else tuple((7 * i + 3 * j) % 200 + 1 for j in range(5 + 4 * (i % 6))))
        arrivals.setdefault(2 * i, []).append(RequestInput(rid, prompt, params, 0, True))
    arrivals.setdefault(3, []).append(RequestInput(
        "regex", (5, 6, 7, 8, 9, 10), SamplingParams(max_new_tokens=12, temperature=0.0),
        0, True, GrammarSpec("regex", r"(yes|no)-[a-c]{3,6}")))
    return arrivals


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_chunk_gives_the_tokens_of_separate_steps(overlap):
    plain, none = _serve(_worker(False, False), _requests([]))
    stop = [plain["stop"][0][4]]
    plain, none = _serve(_worker(False, False), _requests(stop))
    assert none == 0 and plain["stop"][2] == "stop"
    assert plain["regex"][3] is None and plain["regex"][2] == "stop"
    got, mixed = _serve(_worker(overlap, True), _requests(stop))
    assert mixed > 0, "no step mixed"
    assert got == plain


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_chunk_under_kv_pressure_retracts_and_keeps_the_tokens(overlap):
    def requests():
        p = dict(temperature=0.0, ignore_eos=True)
        return {2 * i: [RequestInput(f"r{i}", tuple((11 * i + j) % 150 + 1
                                                    for j in range(10 + 3 * i)),
                                     SamplingParams(max_new_tokens=30 - 2 * i, **p), 0, True)]
                for i in range(6)}

    plain, _ = _serve(_worker(False, False, max_total_tokens=120, context_length=64), requests())
    worker = _worker(overlap, True, max_total_tokens=120, context_length=64)
    got, mixed = _serve(worker, requests())
    assert worker.scheduler.num_retracted > 0, "no retraction"
    assert mixed > 0, "no step mixed"
    assert got == plain
    assert all(v[3] is None for v in got.values())


@pytest.mark.multiproc
def test_mixed_chunk_with_dp_attention_on_two_ranks(tmp_path):
    """Each DP rank schedules alone: a mixed step on one rank runs beside a decode, a plain
    prefill or an idle step on the other."""
    hf = make_hf_model("Qwen3MoeForCausalLM", seed=3, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                       intermediate_size=48, vocab_size=96, norm_topk_prob=True)
    folder = str(save_checkpoint(hf, tmp_path))
    prompts = [[(5 * i + 3 * j) % 90 + 1 for j in range(2 + 5 * (i % 5))] for i in range(12)]
    params = [dict(max_new_tokens=3 + (7 * i) % 13, temperature=0.0, ignore_eos=True)
              for i in range(12)]
    flags = dict(dtype="float32", max_total_tokens=2048, context_length=128,
                 skip_tokenizer_init=True, max_running_requests=4, chunked_prefill_size=16,
                 disable_cuda_graph=True, disable_piecewise_cuda_graph=True, device="cpu",
                 cpu_threads_per_rank=1, tp_size=2, dp_size=2, enable_dp_attention=True)
    results = []
    for mixed in (False, True):
        with Engine(folder, **flags, enable_mixed_chunk=mixed) as engine:
            results.append(engine.generate(input_ids=prompts, sampling_params=params))
    plain, mixed = ([(r["token_ids"], r["error"]) for r in rs] for rs in results)
    assert [len(t) for t, _ in plain] == [p["max_new_tokens"] for p in params]
    assert mixed == plain
