"""The plans and buffers of a2a.py: one plan per (model, backend) for the ranks of one host,
the dispatchers bound to their buffers, and what the bind took beside what the plan records.

The benchmark loads no weights, so a plan counts each GPU's memory plus the weights it leaves
out: a model whose weights do not fit the GPUs (DeepSeek-V3 in bf16) still plans the buffers
of a rank that holds them elsewhere. Tokens travel in bf16 (nvlink moves rows in the model's
dtype; fp8 + nvlink is a plan error).
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any, Iterator

import torch

from moeserve.config import EngineConfig
from moeserve.config.spec import load_model_spec
from moeserve.parallel.layout import ParallelLayout
from moeserve.plan.capacity import CapacityPlan, build_plan
from moeserve.plan.memory import GB, weight_bytes_per_rank

BACKENDS = ("nvlink", "all_to_all")
DTYPE = "bfloat16"


def plan_for(model: str, backend: str, world: int, sizes: list[int],
             gpu_bytes: int) -> CapacityPlan:
    """The plan of one rank of `world` (tp = dp = ep = world, DP attention) for up to
    max(sizes) tokens a rank, on a GPU of `gpu_bytes` plus room for the rank's weights. No
    windows of the one-shot collectives: the benchmark binds the dispatchers alone."""
    cfg = EngineConfig(model=model, tp_size=world, ep_size=world, dp_size=world,
                       enable_dp_attention=True, moe_a2a_backend=backend, dtype=DTYPE,
                       device="cuda", chunked_prefill_size=max(sizes) * world,
                       max_running_requests=256 * world, symm_comm_max_bytes=0)
    spec = load_model_spec(model)
    weights = weight_bytes_per_rank(spec, ParallelLayout.from_config(cfg), DTYPE)
    gpu = gpu_bytes + weights / cfg.mem_fraction_static
    return build_plan(cfg.replace(gpu_memory_gb=gpu / GB), spec)


def plan_errors(model: str, world: int, sizes: list[int], gpu_bytes: int) -> list[str]:
    """Why a backend's plan of `model` cannot run (empty: every backend's can)."""
    out = []
    for backend in BACKENDS:
        plan = plan_for(model, backend, world, sizes, gpu_bytes)
        out += [f"{model}, {backend}: {e}" for e in plan.errors]
        if plan.ok and plan.quant is not None:
            out.append(f"{model}, {backend}: the benchmark moves {DTYPE} rows, the plan has "
                       f"{plan.quant.describe()} weights")
    return out


def dispatchers(model: str, world: int, rank: int, sizes: list[int], state: Any = None
                ) -> tuple[dict[str, tuple[Any, CapacityPlan]], dict[str, Any], Any]:
    """One MoE dispatcher per backend, each on the buffers of its own plan (bound as the
    engine binds them: the nvlink windows in symmetric memory, rendezvoused here); the nvlink
    bind's accounting (symmetric_bytes); the parallel state (made once, passed back in)."""
    from moeserve.moe.dispatch import create_dispatcher
    from moeserve.parallel.groups import init_parallel_state
    from moeserve.runtime.buffers import bind_model_buffers

    dev = torch.device("cuda", rank)
    gpu = torch.cuda.get_device_properties(rank).total_memory
    out, workspace = {}, {}
    for backend in BACKENDS:
        plan = plan_for(model, backend, world, sizes, gpu)
        assert plan.ok, plan.errors
        state = state or init_parallel_state(plan.layout, dev)
        assert state.layout == plan.layout, (state.layout, plan.layout)  # one layout a run
        disp = create_dispatcher(plan.spec, state, plan, getattr(torch, DTYPE))
        before = _memory(dev)
        bufs = bind_model_buffers(plan, dev)
        if backend == "nvlink":
            workspace = symmetric_bytes(plan, bufs, before, _memory(dev))
        disp.bind(bufs)
        out[backend] = (disp, plan)
    return out, workspace, state


def _memory(dev: torch.device) -> tuple[int, int]:
    """(bytes torch's allocator holds for tensors, bytes the device has free), settled."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize(dev)
    return torch.cuda.memory_allocated(dev), torch.cuda.mem_get_info(dev)[0]


def symmetric_bytes(plan: CapacityPlan, bufs: Any, before: tuple[int, int],
                    after: tuple[int, int]) -> dict[str, Any]:
    """The plan's symmetric records beside the tensors bound for them, the bind's other
    tensors, and what the bind took from torch's allocator and from the device."""
    records = [r for r in plan.buffers if r.symmetric]
    assert all(r.name.startswith("a2a.") for r in records), records  # the windows, in bufs.a2a
    bound = [getattr(bufs.a2a, r.name.removeprefix("a2a.")) for r in records]
    symmetric = sum(t.nbytes for t in bound)
    return {"records": [r.name for r in records],
            "plan_bytes": sum(r.bytes for r in records),
            "bound_bytes": symmetric,
            "other_bound_bytes": sum(t.nbytes for t in _tensors(bufs)) - symmetric,
            "allocator_bytes": after[0] - before[0],
            "device_bytes": before[1] - after[1]}


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a buffers handle (dataclasses and named tuples of tensors)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))
    elif isinstance(obj, tuple):
        for item in obj:
            yield from _tensors(item)
