"""The fused Triton expert runner (kernels in moe/kernels/fused_moe.py).

Per step: align the (token, k) pairs by local expert into BLOCK_M-row blocks, a grouped GEMM
for gate_up with the activation-and-multiply fused, a grouped GEMM for down with the top-k
weight applied, and the sum over top-k. Only the experts that some pair uses are read; no
host synchronisation, so a step can be captured in a CUDA graph. Tile configs come from the
tuned JSON of this (E_local, H, I_local, dtype, device), else from defaults (kernels/configs.py);
with `deterministic` a tuned down that sums the top-k by atomic adds (ATOMIC_SUM) writes every
pair's row for the in-order top-k pass instead.
With fp8 weights (block-scaled, layers/weights.QuantParam) it runs the W8A8 kernels of
kernels/moe/fused_moe_fp8.py (chosen here, at construction: no other path serves them): the
rows quantized once per token per bk columns (or delivered quantized by the dispatcher), gate_up
writing its output in fp8 with its group scales, down reading them; their tables are keyed by
the scale blocks (configs.table_dtype).
Its intermediates live in the plan's `moe.runner.*` buffers, allocated once by the binder
(runtime/buffers.py) and shared by every layer (kernels/moe/align_torch.py: Workspace); a step
larger than they are is refused with the plan's name for it.

triton is imported on the first forward, so that `import moeserve` works without it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from moeserve.layers.mlp import KERNEL_ACTS
from moeserve.layers.pending import TopkRows
from moeserve.config.quant import QuantSpec
from moeserve.config.spec import ModelSpec
from moeserve.moe.experts.base import EXPERT_RUNNERS, Experts
from moeserve.kernels.moe.align_torch import Workspace
from moeserve.kernels.moe.configs import CONFIG_DIR, get_config, warm_up_sizes
from moeserve.kernels.launch.choice import interpreting
from moeserve.parallel.groups import ParallelState


def _device(device: torch.device) -> tuple[str, Optional[tuple[int, int]]]:
    """The device's name (the tuned tables' key) and compute capability (the defaults')."""
    if device.type != "cuda":
        return "cpu", None
    return torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)


@EXPERT_RUNNERS.register("triton")
class TritonFusedExperts(Experts):
    graph_safe = True  # no host synchronisation: CUDA graphs capture it
    supports_fp8 = True

    def __init__(self, spec: ModelSpec, state: ParallelState, dtype: torch.dtype,
                 quant: Optional[QuantSpec] = None) -> None:
        super().__init__(spec, state, dtype, quant)
        if spec.hidden_act not in KERNEL_ACTS:
            raise ValueError(f"the triton expert runner has no kernel for hidden_act "
                             f"{spec.hidden_act!r} ({', '.join(KERNEL_ACTS)}); use "
                             "--moe-runner-backend grouped_mm or reference")
        self.kernel_act = KERNEL_ACTS[spec.hidden_act]
        if quant is not None and (quant.block_k < 16 or quant.block_k & (quant.block_k - 1)):
            raise ValueError(f"the triton expert runner's fp8 kernels take scale blocks whose "
                             f"block_k is a power of two >= 16 (one tile a group), not "
                             f"{quant.block_k}; use --moe-runner-backend reference")
        self.top_k = spec.top_k
        self._configs: dict[tuple[int, str], dict[str, Any]] = {}
        self.config_dir = CONFIG_DIR  # where the tuned tables are (a test may give its own)
        # the plan's moe.runner.* buffers, shared by every layer's runner (bind_workspace);
        # None: each step allocates its own (tests, tools)
        self.workspace: Optional[Workspace] = None

    def bind_workspace(self, workspace: Optional[Workspace]) -> None:
        self.workspace = workspace

    def config_for(self, num_tokens: int, device: torch.device) -> dict[str, Any]:
        key = (num_tokens, str(device))
        if key not in self._configs:
            cfg = get_config(num_tokens, self.top_k, self.num_local, self.hidden, self.i_local,
                             self.dtype, *_device(device), config_dir=self.config_dir,
                             quant_block=self.block)
            if self.deterministic and cfg.get("down", {}).get("ATOMIC_SUM"):
                down = {k: v for k, v in cfg["down"].items() if k != "ATOMIC_SUM"}
                cfg = {**cfg, "down": down}
            self._configs[key] = cfg
        return self._configs[key]

    def warm_up(self, max_rows: int, device: torch.device) -> list[int]:
        """Run the kernels once per tile config that a step of up to max_rows rows takes, on
        random rows and routing, so that Triton compiles them at startup rather than during
        the first prefills (a few seconds each). Returns the row counts run."""
        sizes = warm_up_sizes(max_rows, self.top_k, self.num_local, self.hidden, self.i_local,
                              self.dtype, *_device(device), config_dir=self.config_dir,
                              quant_block=self.block)
        for n in sizes:
            x = torch.randn(n, self.hidden, device=device, dtype=self.dtype)
            ids = torch.rand(n, self.num_experts, device=device).topk(self.top_k, dim=1).indices
            self(x, ids.to(torch.int32), torch.rand(n, self.top_k, device=device))
        return sizes

    def forward(self, x_NH: torch.Tensor, topk_ids_NK: torch.Tensor,
                topk_weights_NK: torch.Tensor, x_scale: Optional[torch.Tensor] = None,
                pending_ok: bool = False):
        assert x_scale is None or self.quant is not None, \
            "unquantized experts take rows in the model's dtype"
        if not x_NH.is_cuda and not interpreting():
            raise ValueError("the triton expert runner needs CUDA tensors; on a CPU use "
                             "--moe-runner-backend reference")
        if x_NH.shape[0] == 0:
            dtype = x_NH.dtype if self.quant is None else self.dtype
            return torch.zeros(0, self.hidden, dtype=dtype, device=x_NH.device)
        cfg = self.config_for(x_NH.shape[0], x_NH.device)
        from moeserve.kernels.moe.fused_moe import fused_experts, leaves_topk_sum

        rows = pending_ok and leaves_topk_sum(cfg)  # the top-k sum left to the caller's norm
        if self.quant is not None:
            from moeserve.kernels.moe.fused_moe_fp8 import fused_experts_fp8

            y = fused_experts_fp8(x_NH, x_scale, self.w13, self.w13_scale_inv, self.w2,
                                  self.w2_scale_inv, topk_ids_NK, topk_weights_NK,
                                  self.first_expert, self.kernel_act, self.quant.block, cfg,
                                  self.dtype, self.workspace, sum_topk=not rows)
        else:
            y = fused_experts(x_NH, self.w13, self.w2, topk_ids_NK, topk_weights_NK,
                              self.first_expert, self.kernel_act, cfg, self.workspace,
                              sum_topk=not rows)
        if not rows:
            return y
        return TopkRows(y, topk_ids_NK.to(torch.int32).contiguous(), self.first_expert,
                        self.num_local)
