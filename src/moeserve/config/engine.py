"""The engine config: one frozen dataclass, and the command line generated from it.

Every knob lives here once. Flags are spelled as SGLang spells them. Derived values are
properties; values found at run time (KV page count, free memory) live elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional


def knob(default: Any, help: str, *flags: str, choices: tuple | None = None) -> Any:
    """A config field with its CLI flags (the first is the canonical one) and help text."""
    return field(default=default, metadata={"help": help, "flags": flags, "choices": choices})


DTYPES = ("auto", "bfloat16", "float16", "float32")
LOAD_FORMATS = ("auto", "dummy")
A2A_BACKENDS = ("none", "all_to_all", "nvlink", "auto")
DEVICES = ("auto", "cuda", "cpu")
MOE_RUNNERS = ("auto", "triton", "grouped_mm", "reference")
ATTENTION_BACKENDS = ("auto", "triton", "torch")
# up to this many bytes (a collective's full tensor) a step's all-reduce, all-gather and
# reduce-scatter run one-shot on symmetric memory, above it on NCCL: the largest size up to
# which the one-shot path beat NCCL for all three ops at every size (`python -m benchmarks
# collectives --gpus 2`, 2x H200, benchmarks/RESULTS.md "Step collectives, 2 ranks")
SYMM_COMM_MAX_BYTES = 128 << 10


@dataclass(frozen=True)
class EngineConfig:
    # --- model -------------------------------------------------------------------------------
    model: str = knob("preset:tiny", "Path to a Hugging Face checkpoint folder, or preset:NAME.",
                      "--model", "--model-path")
    load_format: str = knob("auto", "auto: read safetensors weights; dummy: deterministic random "
                            "weights.", "--load-format", choices=LOAD_FORMATS)
    dtype: str = knob("auto", "Weight and activation dtype; auto takes the checkpoint's "
                      "torch_dtype (bfloat16 when absent).", "--dtype", choices=DTYPES)
    quantization: Optional[str] = knob(
        None, "fp8: quantize the weights at load into float8_e4m3fn with 128x128 block scales "
        "(activations per token per 128 columns at run time), as DeepSeek-V3 and Qwen3 FP8 "
        "checkpoints ship them; such checkpoints are served in fp8 without this flag.",
        "--quantization", choices=("fp8",))
    context_length: Optional[int] = knob(None, "Max tokens of one request (prompt + output); "
                                         "default: the model's max_position_embeddings.",
                                         "--context-length")
    # --- parallel layout ---------------------------------------------------------------------
    tp_size: int = knob(1, "Ranks that serve one model replica.", "--tp-size", "--tp")
    dp_size: int = knob(1, "Attention data-parallel groups inside the tp ranks (needs "
                        "--enable-dp-attention).", "--dp-size", "--dp")
    enable_dp_attention: bool = knob(False, "Run attention data-parallel across --dp-size "
                                     "groups.", "--enable-dp-attention")
    ep_size: int = knob(1, "Expert-parallel size: experts are split across this many ranks.",
                        "--ep-size", "--ep")
    moe_dense_tp_size: Optional[int] = knob(None, "Tensor-parallel size of dense MLP layers: 1 "
                                            "(replicated) or --tp-size (default).",
                                            "--moe-dense-tp-size")
    moe_a2a_backend: str = knob(
        "none", "MoE token exchange: none (all-gather + reduce-scatter), all_to_all (NCCL), "
        "nvlink (one-sided stores into the peers' symmetric memory, GPUs of one node) or auto "
        "(with DP attention and ep = tp: nvlink on the GPUs of one node, all_to_all across "
        "nodes or on a CPU; none otherwise).", "--moe-a2a-backend", choices=A2A_BACKENDS)
    moe_a2a_max_tokens_per_rank: Optional[int] = knob(
        None, "Per-rank token cap of the all-to-all workspace; default: the plan's worst case.",
        "--moe-a2a-max-tokens-per-rank")
    symm_comm_max_bytes: int = knob(
        SYMM_COMM_MAX_BYTES, "On the GPUs of one node, a step's all-reduce, all-gather and "
        "reduce-scatter whose tensor (all ranks' rows) is at most this many bytes run one-shot "
        "on symmetric memory (one launch, the peers' memory loaded and stored directly), larger "
        "ones on NCCL; each axis holds a window of 4 x its ranks x this size. 0: NCCL for "
        "every collective.",
        "--symm-comm-max-bytes")
    # --- scheduling bounds -------------------------------------------------------------------
    max_running_requests: Optional[int] = knob(
        None, "Max requests decoding at once, over all DP ranks (default 1024).",
        "--max-running-requests")
    max_prefill_tokens: int = knob(16384, "Max new tokens in one prefill forward per DP rank.",
                                   "--max-prefill-tokens")
    chunked_prefill_size: Optional[int] = knob(
        None, "Prompt chunk size (default 8192; -1 disables chunking). Divided by --dp-size "
        "under DP attention.", "--chunked-prefill-size")
    enable_mixed_chunk: bool = knob(
        False, "Run the running requests' decode tokens inside each prefill step (out of its "
        "token budget), instead of making them wait for the next decode step.",
        "--enable-mixed-chunk")
    max_total_tokens: Optional[int] = knob(None, "Cap on the KV cache size in tokens.",
                                           "--max-total-tokens")
    mem_fraction_static: float = knob(0.88, "Fraction of GPU memory for weights, static "
                                      "buffers and the KV cache.", "--mem-fraction-static")
    page_size: int = knob(1, "Tokens per KV page.", "--page-size")
    speculative_num_draft_tokens: Optional[int] = knob(
        None, "Tokens verified per request per decode step under speculative decoding.",
        "--speculative-num-draft-tokens")
    # --- CUDA graphs -------------------------------------------------------------------------
    cuda_graph_max_bs: Optional[int] = knob(None, "Largest decode batch captured (default 256).",
                                            "--cuda-graph-max-bs")
    cuda_graph_bs: Optional[tuple[int, ...]] = knob(None, "Explicit decode batch sizes to "
                                                    "capture.", "--cuda-graph-bs")
    disable_cuda_graph: bool = knob(False, "Run decode eagerly.", "--disable-cuda-graph")
    piecewise_cuda_graph_max_tokens: Optional[int] = knob(
        None, "Largest prefill token count captured (default: the extend bound, at most 8192).",
        "--piecewise-cuda-graph-max-tokens")
    disable_piecewise_cuda_graph: bool = knob(False, "Run prefill eagerly.",
                                              "--disable-piecewise-cuda-graph")
    # --- runtime -----------------------------------------------------------------------------
    device: str = knob("auto", "Where the engine runs: cuda when a GPU is present (auto), or "
                       "cpu.", "--device", choices=DEVICES)
    cpu_threads_per_rank: Optional[int] = knob(
        None, "Torch threads of each rank process (torch.set_num_threads). Default on a CPU: "
        "the cores this process may use divided by the ranks on this node, so that ranks do "
        "not fight over cores; on a GPU torch's own default. A one-rank engine that runs in "
        "the caller's process keeps its thread count unless this is given.",
        "--cpu-threads-per-rank")
    random_seed: int = knob(0, "Seed of sampling for requests that give no seed.",
                            "--random-seed")
    moe_runner_backend: str = knob("auto", "Expert GEMMs: triton (fused kernel), grouped_mm "
                                   "(torch._grouped_mm) or reference (plain torch); auto picks "
                                   "triton on a GPU, reference on a CPU.",
                                   "--moe-runner-backend", choices=MOE_RUNNERS)
    attention_backend: str = knob("auto", "Paged attention: triton on a GPU, torch (portable "
                                  "reference); auto picks by device.", "--attention-backend",
                                  choices=ATTENTION_BACKENDS)
    disable_radix_cache: bool = knob(False, "Turn off the prefix cache.", "--disable-radix-cache")
    enable_deterministic_inference: bool = knob(
        False, "The same output bits for the same requests run after run, batched the same "
        "way: the MoE top-k sums add in a fixed order (no atomic adds), which costs some "
        "prefill speed. It does not make a request's output independent of its batch.",
        "--enable-deterministic-inference")
    disable_overlap_schedule: bool = knob(
        False, "Read each step's tokens back before the next step is scheduled (by default "
        "the host prepares step N+1 while the device runs step N).",
        "--disable-overlap-schedule")
    disable_pdl: bool = knob(
        False, "Launch each GPU kernel of a step only after the one before it has finished "
        "(by default, on sm90+, a decode step's kernels overlap their launches: PDL).",
        "--disable-pdl")
    skip_tokenizer_init: bool = knob(False, "Run without a tokenizer: token ids in and out.",
                                     "--skip-tokenizer-init")
    watchdog_timeout: float = knob(
        300.0, "Seconds without a finished step, while requests are pending, after which the "
        "engine counts as stalled (a stopped or hung rank): every pending request fails with "
        "an error and the engine stops (the server then exits with code 1, for a supervisor "
        "to restart it). 0 or less turns the watchdog off.", "--watchdog-timeout")
    compile_cache_dir: Optional[str] = knob(
        None, "Folder of the persistent compile cache (Triton's kernels, TRITON_CACHE_DIR, and "
        "torch inductor's), set in every rank before anything compiles, so that a second start "
        "of the same config compiles nothing. Default: moeserve/compile under $XDG_CACHE_HOME "
        "(~/.cache when unset).", "--compile-cache-dir")
    nnodes: int = knob(1, "Nodes that together run the --tp-size ranks.", "--nnodes")
    node_rank: int = knob(0, "This node's index in [0, --nnodes).", "--node-rank")
    dist_init_addr: Optional[str] = knob(None, "HOST:PORT of node 0 for the rendezvous "
                                         "(needed with --nnodes > 1).", "--dist-init-addr")
    # --- memory for planning -----------------------------------------------------------------
    gpu_memory_gb: Optional[float] = knob(None, "GPU memory per rank in GB for the plan "
                                          "(default: the local GPU's, else 80).",
                                          "--gpu-memory-gb")

    # --- derived values ----------------------------------------------------------------------
    @property
    def dense_tp_size(self) -> int:
        return self.tp_size if self.moe_dense_tp_size is None else self.moe_dense_tp_size

    @property
    def attn_dp_size(self) -> int:
        return self.dp_size if self.enable_dp_attention else 1

    @property
    def chunked_prefill_enabled(self) -> bool:
        return self.chunked_prefill_size is None or self.chunked_prefill_size > 0

    @property
    def chunk_tokens_per_dp_rank(self) -> Optional[int]:
        """Prompt chunk size per DP rank (SGLang divides the engine's chunk by dp)."""
        if not self.chunked_prefill_enabled:
            return None
        size = 8192 if self.chunked_prefill_size is None else self.chunked_prefill_size
        return max(1, size // self.attn_dp_size)

    @property
    def max_running_requests_total(self) -> int:
        return 1024 if self.max_running_requests is None else self.max_running_requests

    @property
    def tokens_per_decode_request(self) -> int:
        return self.speculative_num_draft_tokens or 1

    @property
    def a2a_enabled(self) -> bool:
        """Tokens travel to whole experts (the all-to-all path), by either transport. auto
        takes it with whole experts per rank under DP attention, where each rank brings rows
        of its own; without DP attention every rank of an attention group holds the same rows
        after its all-reduce, and the gather path (each rank's experts on those rows, one
        all-reduce) moves less and synchronises less than scattering them for an exchange
        (benchmarks/RESULTS.md, "Scale-out, 2 GPUs")."""
        if self.moe_a2a_backend == "auto":
            return (self.tp_size > 1 and self.ep_size == self.tp_size
                    and self.enable_dp_attention)
        return self.moe_a2a_backend in ("all_to_all", "nvlink")

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


# ------------------------------------------------------------------------------------------
# The CLI, generated from the fields.

def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return inner[0], True
    return tp, False


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per EngineConfig field to `parser` (dest is the field name)."""
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        tp, _ = _unwrap_optional(hints[f.name])
        flags = f.metadata["flags"]
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": f.metadata["help"]}
        if tp is bool:
            kwargs["action"] = "store_true"
        elif typing.get_origin(tp) is tuple:
            kwargs.update(type=int, nargs="+")
        else:
            kwargs["type"] = tp
            if f.metadata["choices"]:
                kwargs["choices"] = f.metadata["choices"]
        group.add_argument(*flags, **kwargs)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The config of a command line; a hub id given as --model becomes its cached snapshot's
    folder (config/hub.py)."""
    from moeserve.config.hub import resolve_model

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    values["model"] = resolve_model(values["model"])
    if values["cuda_graph_bs"] is not None:
        values["cuda_graph_bs"] = tuple(values["cuda_graph_bs"])
    return EngineConfig(**values)


def config_errors(cfg: EngineConfig) -> list[tuple[str, str]]:
    """Knob values that are wrong on their own (message, fix); layout checks live in parallel/."""
    errors: list[tuple[str, str]] = []

    def positive(name: str, flag: str, allow_none: bool = True) -> None:
        value = getattr(cfg, name)
        if value is None and allow_none:
            return
        if value is None or value < 1:
            errors.append((f"{flag} must be a positive integer, got {value}.",
                           f"set {flag} to 1 or more"))

    for name, flag in [("tp_size", "--tp-size"), ("dp_size", "--dp-size"),
                       ("ep_size", "--ep-size"), ("page_size", "--page-size"),
                       ("max_prefill_tokens", "--max-prefill-tokens")]:
        positive(name, flag, allow_none=False)
    for name, flag in [("moe_dense_tp_size", "--moe-dense-tp-size"),
                       ("moe_a2a_max_tokens_per_rank", "--moe-a2a-max-tokens-per-rank"),
                       ("max_running_requests", "--max-running-requests"),
                       ("max_total_tokens", "--max-total-tokens"),
                       ("speculative_num_draft_tokens", "--speculative-num-draft-tokens"),
                       ("cuda_graph_max_bs", "--cuda-graph-max-bs"),
                       ("piecewise_cuda_graph_max_tokens", "--piecewise-cuda-graph-max-tokens"),
                       ("context_length", "--context-length"),
                       ("cpu_threads_per_rank", "--cpu-threads-per-rank")]:
        positive(name, flag)
    if not 0 <= cfg.symm_comm_max_bytes < 2**31:
        errors.append((f"--symm-comm-max-bytes must be in [0, 2**31), got "
                       f"{cfg.symm_comm_max_bytes}.",
                       f"set --symm-comm-max-bytes {SYMM_COMM_MAX_BYTES}, or 0 for NCCL alone"))
    if cfg.chunked_prefill_size is not None and cfg.chunked_prefill_size == 0:
        errors.append(("--chunked-prefill-size 0 is not a chunk size.",
                       "set --chunked-prefill-size to a positive size, or -1 to disable chunking"))
    if cfg.cuda_graph_bs is not None and any(b < 1 for b in cfg.cuda_graph_bs):
        errors.append((f"--cuda-graph-bs has sizes below 1: {list(cfg.cuda_graph_bs)}.",
                       "give positive batch sizes"))
    if cfg.cuda_graph_bs is not None and not cfg.cuda_graph_bs:
        errors.append(("--cuda-graph-bs is empty: no decode batch size to capture.",
                       "give at least one batch size, or --disable-cuda-graph"))
    if not 0.0 < cfg.mem_fraction_static <= 1.0:
        errors.append((f"--mem-fraction-static must be in (0, 1], got {cfg.mem_fraction_static}.",
                       "set --mem-fraction-static 0.88"))
    if cfg.gpu_memory_gb is not None and cfg.gpu_memory_gb <= 0:
        errors.append((f"--gpu-memory-gb must be positive, got {cfg.gpu_memory_gb}.",
                       "set --gpu-memory-gb 80"))
    if cfg.nnodes < 1 or not 0 <= cfg.node_rank < cfg.nnodes:
        errors.append((f"--node-rank {cfg.node_rank} is not in [0, --nnodes {cfg.nnodes}).",
                       "give --nnodes >= 1 and --node-rank between 0 and nnodes - 1"))
    elif cfg.tp_size % cfg.nnodes:
        errors.append((f"--tp-size {cfg.tp_size} ranks do not split evenly over --nnodes "
                       f"{cfg.nnodes}.", f"set --nnodes to a divisor of {cfg.tp_size}"))
    elif cfg.nnodes > 1 and not cfg.dist_init_addr:
        errors.append(("--nnodes > 1 needs the rendezvous address of node 0.",
                       "set --dist-init-addr HOST:PORT (the same on every node)"))
    if cfg.max_running_requests is not None and cfg.max_running_requests < cfg.attn_dp_size:
        errors.append((f"--max-running-requests {cfg.max_running_requests} is below the "
                       f"{cfg.attn_dp_size} DP ranks: some rank could run no request.",
                       f"set --max-running-requests {cfg.attn_dp_size} or more"))
    return errors
