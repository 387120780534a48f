"""Which device a rank runs on, and the memory it plans for."""

from __future__ import annotations

import torch

from moeserve.config import EngineConfig

# On a CPU the "device memory" the plan divides is host memory the engine may take for weights,
# buffers and the KV cache; --gpu-memory-gb overrides it.
CPU_DEFAULT_MEMORY_GB = 1.0


def engine_device_type(cfg: EngineConfig) -> str:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda, but torch sees no CUDA device; use --device cpu")
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def rank_device(cfg: EngineConfig, rank: int) -> torch.device:
    kind = engine_device_type(cfg)
    if kind == "cpu":
        return torch.device("cpu")
    local = rank % (cfg.tp_size // cfg.nnodes)
    return torch.device("cuda", local % torch.cuda.device_count())


def runtime_config(cfg: EngineConfig) -> EngineConfig:
    """The config the engine plans with: on a CPU, plan for CPU_DEFAULT_MEMORY_GB of host
    memory unless --gpu-memory-gb says otherwise."""
    if engine_device_type(cfg) == "cpu" and cfg.gpu_memory_gb is None:
        return cfg.replace(gpu_memory_gb=CPU_DEFAULT_MEMORY_GB)
    return cfg


def resolve_backends(cfg: EngineConfig, device: torch.device) -> tuple[str, str]:
    """(attention backend, expert runner) for a rank on `device`: the fast GPU ones on CUDA
    when asked for "auto", the portable torch ones on a CPU. DeepSeek's latent attention has
    both too, under the same names (layers/mla.py)."""
    gpu = device.type == "cuda"
    attention = cfg.attention_backend
    if attention == "auto":
        attention = "triton" if gpu else "torch"
    experts = cfg.moe_runner_backend
    if experts == "auto":
        experts = "triton" if gpu else "reference"
    if not gpu and (attention, experts) != ("torch", "reference"):
        raise ValueError(f"--attention-backend {attention} / --moe-runner-backend {experts} "
                         "need a GPU; on a CPU use torch / reference (or auto)")
    return attention, experts


def resolve_a2a_transport(cfg: EngineConfig, device_type: str) -> str:
    """How MoE tokens travel: "none" (the gather path), "all_to_all" (NCCL, or gloo on a CPU)
    or "nvlink" (one-sided stores into the peers' symmetric memory). auto takes nvlink on the
    GPUs of one node, all_to_all across nodes or on a CPU. An explicit nvlink on a CPU is
    honoured: the peers' stores are emulated with gloo exchanges of the same layout (tests)."""
    if not cfg.a2a_enabled:
        return "none"
    if cfg.moe_a2a_backend == "auto":
        return "nvlink" if device_type == "cuda" and cfg.nnodes == 1 else "all_to_all"
    return cfg.moe_a2a_backend


def resolve_symm_comm(cfg: EngineConfig, device_type: str) -> int:
    """Bytes up to which a step's collectives run one-shot on symmetric memory: the flag's on
    the GPUs of one node (the rule of the nvlink all-to-all's auto), 0 (NCCL, or gloo on a
    CPU, for every collective) across nodes or on a CPU."""
    return cfg.symm_comm_max_bytes if device_type == "cuda" and cfg.nnodes == 1 else 0
