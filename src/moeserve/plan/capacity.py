"""The capacity plan: from the config alone, every bound, buffer and capture list, the memory
they take, and every reason the engine cannot start (docs/DESIGN.md, "The capacity plan")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from moeserve.config import EngineConfig, config_errors
from moeserve.config.quant import QuantizationError, QuantSpec, resolve_quant
from moeserve.config.spec import ModelSpec, load_model_spec
from moeserve.kernels.launch.choice import KernelSet, select_kernels
from moeserve.parallel.layout import ParallelLayout, Problem, layout_problems
from moeserve.plan import buffers as B
from moeserve.plan.budget import MODES, TokenBudget, moe_tokens_per_rank, token_budget
from moeserve.plan.memory import (GB, fp8_expert_layers, fp8_projection_layers,
                                  kv_bytes_per_token, resolve_dtype, weight_bytes_per_rank)

DEFAULT_GPU_MEMORY_GB = 80.0


@dataclass(frozen=True)
class MemoryPlan:
    gpu_memory_bytes: int
    static_budget_bytes: int  # gpu memory x mem_fraction_static
    weights_bytes_per_rank: int
    static_buffer_bytes_per_rank: int  # every buffer except the KV cache
    kv_bytes_per_token_per_rank: int
    kv_capacity_tokens: int

    def to_json(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Backends:
    """What every rank of the engine runs, resolved from the config as build_model resolves it
    for a rank's device (parallel/devices.resolve_backends): the plan records the buffers of
    these and of no others."""

    device: str  # "cuda" or "cpu"
    attention: str  # the attention backend
    experts: str  # the expert runner
    a2a: str = "none"  # the token transport (parallel/devices.resolve_a2a_transport)
    # bytes up to which a step's collectives run one-shot on symmetric memory; 0: NCCL alone
    # (parallel/devices.resolve_symm_comm)
    symm_comm_max_bytes: int = 0

    @property
    def graph_blocker(self) -> Optional[str]:
        """Why no CUDA graph is captured whatever the config asks (None: graphs are taken)."""
        if self.device != "cuda":
            return f"the engine runs on {self.device}, not a GPU"
        if self.attention != "triton":  # the torch backend reads lengths on the host
            return (f"attention backend {self.attention} reads host lengths "
                    "(use --attention-backend triton)")
        return None


def planned_backends(cfg: EngineConfig) -> tuple[Optional[Backends], list[Problem]]:
    """The backends of a rank on the device the config names (auto: this machine's)."""
    import torch

    from moeserve.parallel.devices import (resolve_a2a_transport, resolve_backends,
                                           resolve_symm_comm)

    gpu = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = "cuda" if gpu else "cpu"
    try:
        attention, experts = resolve_backends(cfg, torch.device(device))
    except ValueError as exc:
        return None, [Problem(str(exc), "use --attention-backend auto --moe-runner-backend "
                                        "auto, or run on a GPU (--device cuda)")]
    a2a = resolve_a2a_transport(cfg, device)
    if a2a == "nvlink" and cfg.nnodes > 1:
        return None, [Problem(f"--moe-a2a-backend nvlink stores into the peers' memory over "
                              f"NVLink, within one node; this engine spans {cfg.nnodes} nodes.",
                              "use --moe-a2a-backend all_to_all (or auto) across nodes")]
    return Backends(device, attention, experts, a2a, resolve_symm_comm(cfg, device)), []


@dataclass(frozen=True)
class CapacityPlan:
    config: EngineConfig
    spec: ModelSpec
    layout: Optional[ParallelLayout]
    dtype: str
    budget: Optional[TokenBudget]
    moe_tokens: dict[str, int]  # M per mode (tokens reaching the MoE layer on one rank)
    a2a_cap: Optional[int]  # the per-rank all-to-all cap; None on the gather path
    buffers: tuple[B.BufferRecord, ...]
    memory: Optional[MemoryPlan]
    errors: tuple[Problem, ...] = field(default=())
    # the kernels a rank on this machine's device selects (kernels/launch/choice.py)
    kernels: Optional[KernelSet] = None
    backends: Optional[Backends] = None
    # rows reaching one rank's expert runner in the worst forward (buffers.moe_runner_rows)
    moe_runner_rows: int = 0
    # the weights' quantization (config/quant.py): the checkpoint's or --quantization's
    quant: Optional[QuantSpec] = None

    @property
    def expert_block(self) -> Optional[tuple[int, int]]:
        """The scale blocks of fp8 routed experts (None: the experts are in the model's dtype)."""
        if self.quant is None or not fp8_expert_layers(self.spec, self.quant)[0]:
            return None
        return self.quant.block

    @property
    def a2a_scale_group(self) -> Optional[int]:
        """Columns per float32 scale of the all-to-all's fp8 token rows (None: rows travel in
        the model's dtype): the activations' group of fp8 weights."""
        return None if self.quant is None else self.quant.block_k

    @property
    def ok(self) -> bool:
        return not self.errors

    def buffer(self, name: str) -> B.BufferRecord:
        for rec in self.buffers:
            if rec.name == name:
                return rec
        raise KeyError(f"the plan has no buffer {name!r}; it has "
                       f"{', '.join(r.name for r in self.buffers)}")

    def has_buffer(self, name: str) -> bool:
        return any(rec.name == name for rec in self.buffers)

    @property
    def a2a_workspace_bytes_per_rank(self) -> Optional[int]:
        if self.a2a_cap is None:
            return None
        return sum(r.bytes for r in self.buffers if r.name.startswith("a2a."))

    def to_json(self) -> dict[str, Any]:
        b = self.budget
        return {
            "model": self.spec.name, "architecture": self.spec.architecture,
            "dtype": self.dtype,
            "quantization": None if self.quant is None else self.quant.describe(),
            "layout": None if self.layout is None else {
                "tp": self.layout.tp, "dp": self.layout.dp, "attn_tp": self.layout.attn_tp,
                "ep": self.layout.ep, "moe_tp": self.layout.moe_tp,
                "dense_tp": self.layout.dense_tp, "sp": self.layout.sp,
                "a2a_backend": self.config.moe_a2a_backend,
                "a2a_transport": None if self.backends is None else self.backends.a2a},
            "backends": None if self.backends is None else dict(self.backends.__dict__),
            "moe_runner_rows": self.moe_runner_rows,
            "budget": None if b is None else b.by_mode(),
            "limits": None if b is None else {
                "max_running_requests_per_dp_rank": b.max_running_requests,
                "tokens_per_decode_request": b.tokens_per_decode_request,
                "chunk_tokens_per_dp_rank": b.chunk_tokens, "context_length": b.context_length},
            "moe_tokens_per_rank": self.moe_tokens,
            "a2a": None if self.a2a_cap is None else {
                "max_tokens_per_rank": self.a2a_cap,
                "workspace_bytes_per_rank": self.a2a_workspace_bytes_per_rank},
            "buffers": [r.to_json() for r in self.buffers],
            "graphs": {"decode_batch_sizes": list(b.decode_batch_sizes) if b else [],
                       "prefill_token_sizes": list(b.prefill_token_sizes) if b else []},
            "memory": None if self.memory is None else self.memory.to_json(),
            "errors": [{"message": e.message, "fix": e.fix} for e in self.errors],
            "kernels": None if self.kernels is None else self.kernels.describe(),
        }


def local_gpu_memory_bytes() -> Optional[int]:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    except Exception:  # no usable CUDA: plan for the default size
        return None
    return None


def local_gpu_name(cfg: EngineConfig) -> Optional[str]:
    """The name of the GPU the engine will run on (the MoE tile tables' key), None on a CPU."""
    if cfg.device == "cpu":
        return None
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(torch.cuda.current_device())
    except Exception:  # no usable CUDA: no device tables
        return None
    return None


def local_kernels(cfg: EngineConfig) -> KernelSet:
    """The kernels a rank would select on this machine's first device."""
    import torch

    if cfg.device == "cpu" or not torch.cuda.is_available():
        return select_kernels("cpu", pdl=not cfg.disable_pdl)
    return select_kernels(torch.device("cuda", torch.cuda.current_device()),
                          pdl=not cfg.disable_pdl)


def down_sum_tables(cfg: EngineConfig) -> Optional[str]:
    """The GPU whose tile tables may have the MoE down kernel sum the top-k with atomic adds
    (configs.rows_writing_pairs): the local GPU's, none on a CPU, and none with
    --enable-deterministic-inference, under which every step writes every pair's row."""
    return None if cfg.enable_deterministic_inference else local_gpu_name(cfg)


def build_plan(cfg: EngineConfig, spec: Optional[ModelSpec] = None) -> CapacityPlan:
    """The whole plan. Never raises on a bad config: problems come back in `errors`."""
    spec = spec or load_model_spec(cfg.model)
    dtype = resolve_dtype(cfg, spec)
    problems = [Problem(m, f) for m, f in config_errors(cfg)]
    try:
        quant = resolve_quant(cfg.quantization, spec.quant)
    except QuantizationError as exc:
        quant = None
        problems.append(Problem(str(exc), "use --quantization fp8, or leave it unset"))
    if not problems:
        problems += layout_problems(cfg, spec)
    backends = None
    if not problems:
        backends, backend_problems = planned_backends(cfg)
        problems += backend_problems
    empty = CapacityPlan(cfg, spec, None, dtype, None, {}, None, (), None, tuple(problems))
    if problems:
        return empty
    assert backends is not None
    layout = ParallelLayout.from_config(cfg)
    budget = token_budget(cfg, spec, layout)
    moe_tokens = {m: moe_tokens_per_rank(t, layout)
                  for m, t in budget.by_mode().items() if t is not None}
    worst = max(moe_tokens.values())
    problems += _budget_problems(cfg, spec, layout, budget, worst)

    a2a_cap = None
    records: list[B.BufferRecord] = []
    if layout.a2a:
        a2a_cap = cfg.moe_a2a_max_tokens_per_rank or worst
        records += B.a2a_records(spec, layout, dtype, a2a_cap, backends.a2a,
                                 scale_group=quant and quant.block_k)
    runner_rows, rows_formula = B.moe_runner_rows(layout, budget, a2a_cap or worst)
    records += B.router_records(spec, layout, budget)
    fp8_layers = 0
    if backends.experts == "triton":  # the only runner that takes a static workspace
        fp8_layers, moe_layers = fp8_expert_layers(spec, quant)
        if 0 < fp8_layers < moe_layers:
            problems.append(Problem(
                f"the triton expert runner's workspace is shared by every MoE layer, and "
                f"{fp8_layers} of {moe_layers} MoE layers have fp8 experts (the others are in "
                "modules_to_not_convert)", "use --moe-runner-backend reference"))
        records += B.runner_records(spec, layout, dtype, runner_rows, rows_formula,
                                    down_sum_tables(cfg),
                                    quant.block if quant and fp8_layers else None)
    if backends.device == "cuda" and (fp8_projection_layers(spec, quant) or fp8_layers):
        # the split-K partials of the fp8 projections' GEMM and of the MMA decode down
        records += B.fp8_gemm_records()
    records += B.gather_records(spec, layout, budget, dtype)
    records += B.comm_records(spec, layout, backends.symm_comm_max_bytes)
    if backends.attention == "triton":  # the backends that take planned partials
        records += B.attention_records(spec, layout, budget)
    if backends.graph_blocker is None:
        records += B.decode_graph_records(spec, budget)
        records += B.prefill_graph_records(spec, layout, budget, dtype)
    records.append(B.req_to_token_record(budget))
    records.append(B.next_token_record(budget))

    memory, kv_tokens, mem_problems = _memory(cfg, spec, layout, budget, dtype, records, quant)
    problems += mem_problems
    records += B.kv_records(spec, layout, budget, dtype, kv_tokens)
    return CapacityPlan(cfg, spec, layout, dtype, budget, moe_tokens, a2a_cap, tuple(records),
                        memory, tuple(problems), local_kernels(cfg), backends, runner_rows,
                        quant)


def _budget_problems(cfg: EngineConfig, spec: ModelSpec, layout: ParallelLayout,
                     budget: TokenBudget, worst: int) -> list[Problem]:
    p: list[Problem] = []
    if cfg.moe_a2a_max_tokens_per_rank is not None:
        if not layout.a2a:
            p.append(Problem("--moe-a2a-max-tokens-per-rank only applies to the all-to-all "
                             "backend, and this config uses the gather path.",
                             "drop --moe-a2a-max-tokens-per-rank, or add "
                             "--moe-a2a-backend all_to_all"))
        elif cfg.moe_a2a_max_tokens_per_rank < worst:
            mode = max((m for m in MODES if getattr(budget, m) is not None),
                       key=lambda m: moe_tokens_per_rank(getattr(budget, m), layout))
            p.append(Problem(
                f"--moe-a2a-max-tokens-per-rank {cfg.moe_a2a_max_tokens_per_rank} is below the "
                f"worst case of {worst} MoE tokens per rank (the {mode} forward).",
                f"set --moe-a2a-max-tokens-per-rank {worst} or more, or lower "
                "--chunked-prefill-size / --max-running-requests"))
    if not cfg.disable_cuda_graph and not budget.decode_batch_sizes:
        m = layout.attn_tp
        p.append(Problem(
            "no decode CUDA-graph batch size is left: every size must be a multiple of "
            f"attn_tp = {m} here, and none of {list(cfg.cuda_graph_bs or [])} (max "
            f"{cfg.cuda_graph_max_bs}) is.",
            f"set --cuda-graph-bs {m} {2 * m} (or --cuda-graph-max-bs {m} or more), "
            "or --disable-cuda-graph"))
    if (not cfg.disable_piecewise_cuda_graph and budget.extend >= 1
            and not budget.prefill_token_sizes):
        m = layout.attn_tp
        p.append(Problem(
            "no prefill CUDA-graph token size is left: every size must be a multiple of "
            f"attn_tp = {m}, and --piecewise-cuda-graph-max-tokens "
            f"{cfg.piecewise_cuda_graph_max_tokens} admits none.",
            f"set --piecewise-cuda-graph-max-tokens {m} or more, or "
            "--disable-piecewise-cuda-graph"))
    if cfg.context_length and cfg.context_length > spec.max_position_embeddings:
        p.append(Problem(f"--context-length {cfg.context_length} is above the model's "
                         f"max_position_embeddings {spec.max_position_embeddings}.",
                         f"set --context-length {spec.max_position_embeddings} or less"))
    return p


def _memory(cfg: EngineConfig, spec: ModelSpec, layout: ParallelLayout, budget: TokenBudget,
            dtype: str, records: list[B.BufferRecord], quant: Optional[QuantSpec] = None
            ) -> tuple[MemoryPlan, int, list[Problem]]:
    if cfg.gpu_memory_gb is not None:
        gpu = int(cfg.gpu_memory_gb * GB)
    else:
        gpu = local_gpu_memory_bytes() or int(DEFAULT_GPU_MEMORY_GB * GB)
    static = int(gpu * cfg.mem_fraction_static)
    weights = weight_bytes_per_rank(spec, layout, dtype, quant)
    buffers = sum(r.bytes for r in records)
    per_token = kv_bytes_per_token(spec, layout, dtype)
    free = static - weights - buffers
    kv_tokens = max(0, free // per_token) // cfg.page_size * cfg.page_size
    problems: list[Problem] = []
    if cfg.max_total_tokens is not None:
        if cfg.max_total_tokens > kv_tokens and free > 0:
            problems.append(Problem(
                f"--max-total-tokens {cfg.max_total_tokens} does not fit: the KV cache has room "
                f"for {kv_tokens} tokens per rank.",
                f"set --max-total-tokens {kv_tokens} or less, or raise --mem-fraction-static"))
        kv_tokens = min(kv_tokens, cfg.max_total_tokens) // cfg.page_size * cfg.page_size
    need_gpu = (weights + buffers + budget.context_length * per_token) / cfg.mem_fraction_static
    if free <= 0:
        problems.append(Problem(
            f"{dtype if quant is None else 'fp8'} weights ({weights / GB:.1f} GB per rank) and static buffers "
            f"({buffers / GB:.2f} GB) do not fit the {static / GB:.1f} GB static budget "
            f"({gpu / GB:.0f} GB x --mem-fraction-static {cfg.mem_fraction_static}) of each of "
            f"the {layout.tp} ranks.", _what_fits(cfg, spec, need_gpu)))
    elif kv_tokens < budget.context_length:
        problems.append(Problem(
            f"the KV cache holds {kv_tokens} tokens per rank, less than one request of "
            f"--context-length {budget.context_length}.",
            f"set --context-length {max(kv_tokens, 1)} or less, or give each rank "
            f"--gpu-memory-gb {need_gpu / GB:.0f}"))
    mem = MemoryPlan(gpu, static, weights, buffers, per_token, kv_tokens)
    return mem, kv_tokens, problems


def _what_fits(cfg: EngineConfig, spec: ModelSpec, need_gpu_bytes: float) -> str:
    """A layout that fits: more ranks (tp, and ep with it where ep = tp), either with dp scaled
    alike or with dp kept (bigger attention-TP groups split attention's weights); the first,
    fewest-GPU one whose plan has no memory error."""
    options = [f"GPUs with at least {need_gpu_bytes / GB:.0f} GB each (--gpu-memory-gb)"]
    for factor in (2, 4, 8, 16):
        tp = cfg.tp_size * factor
        ep = cfg.ep_size * factor if cfg.ep_size == cfg.tp_size else cfg.ep_size
        dps = [cfg.dp_size]
        if cfg.enable_dp_attention and cfg.dp_size == cfg.tp_size:
            dps.insert(0, tp)
        fits = None
        for dp in dps:
            plan = build_plan(cfg.replace(tp_size=tp, ep_size=ep, dp_size=dp), spec)
            mem = plan.memory
            if mem is not None and mem.weights_bytes_per_rank + \
                    mem.static_buffer_bytes_per_rank < mem.static_budget_bytes:
                fits = (dp, mem)
                break
        if fits is not None:
            dp, mem = fits
            flags = f"--tp {tp} --ep {ep}" + (f" --dp {dp}" if cfg.enable_dp_attention else "")
            options.append(f"{flags} ({tp} GPUs of {mem.gpu_memory_bytes / GB:.0f} GB)")
            break
    return "use " + ", or ".join(options)
