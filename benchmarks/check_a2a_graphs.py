"""Decode through CUDA graphs with the all-to-all dispatcher gives the eager tokens (2 GPUs).

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python benchmarks/check_a2a_graphs.py
"""
import time

from moeserve.runtime.engine import Engine


def main() -> None:
    prompts = [[(7 * i + 3 * j) % 1000 + 10 for j in range(20 + 6 * i)] for i in range(6)]
    params = dict(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    toks, times = {}, {}
    for graphs in (False, True):
        with Engine("preset:qwen3-30b-a3b", load_format="dummy", dtype="bfloat16", tp_size=2,
                    ep_size=2, moe_a2a_backend="all_to_all", context_length=4096,
                    cuda_graph_max_bs=16, disable_cuda_graph=not graphs) as e:
            e.generate(input_ids=prompts[:2], sampling_params=dict(params, max_new_tokens=4))
            t = time.perf_counter()
            toks[graphs] = [r["token_ids"] for r in e.generate(input_ids=prompts, sampling_params=params)]
            times[graphs] = time.perf_counter() - t
    print("graphs_equal_eager", toks[False] == toks[True], "eager_s", round(times[False], 2),
          "graphs_s", round(times[True], 2))


if __name__ == "__main__":
    main()
