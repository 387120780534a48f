"""The router: scores over experts, top-k choice, top-k weights (M tokens, E experts, K top-k).

Matches the Hugging Face MoE blocks (transformers 5.x):

  softmax + greedy           Qwen2/3-MoE, OLMoE, Mixtral, DeepSeek-V2 "greedy": top-k of the
                             softmax; renormalised when norm_topk_prob (Mixtral: always)
  softmax + group_limited    DeepSeek-V2: a group's score is its max expert score; experts outside
                             the topk_group best groups score 0; top-k of the masked scores
  sigmoid + noaux_tc         DeepSeek-V3: choice by sigmoid scores + e_score_correction_bias; a
                             group's score is the sum of its 2 best biased scores; weights are the
                             unbiased scores of the chosen experts
then `weights /= sum(weights) + 1e-20` when norm_topk_prob, and `weights *= routed_scaling_factor`.
(transformers' DeepSeek-V2 never renormalises; DeepSeek-V2 checkpoints set norm_topk_prob false.)

Ids are int32 and weights float32: the all-to-all payload carries them in that form. Padding
rows (index >= num_valid) get id -1 and weight 0, and contribute nothing downstream. Bound to
the plan's moe.router.* buffers (bind), a step's top-k are their first M rows, which the MoE
layer's dispatch consumes before the next layer routes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.batch.buffers import RouterBuffers
from moeserve.kernels import ops as K
from moeserve.layers.linear import linear, skinny
from moeserve.config.spec import ModelSpec
from moeserve.layers.weights import copy_into, empty_param, expect_shape, read

SCORINGS = ("softmax", "sigmoid")
FP32_SKINNY_ROWS = 64
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def router_gemm_suits(rows: int, num_experts: int) -> bool:
    """Whether a GPU router of a 16-bit model takes kernels/moe/router.router_topk (the
    logits GEMM and the top-k in one launch) over cuBLAS's logits and then the top-k's launch.
    By graph replays on an H200: with E no multiple of 8 cuBLAS's GEMM is slow, and one
    launch wins from 512 rows; elsewhere it wins from 8192 rows at E <= 64 and at 128 experts
    from 16384 rows: each program reads all of W [E, H] from L2, which costs more than
    cuBLAS's tiles save until the rows are many."""
    if rows < 512:
        return False
    if num_experts % 8:
        return True
    return rows >= (8192 if num_experts <= 64 else 16384)


@dataclass(frozen=True)
class RoutingConfig:
    num_experts: int
    top_k: int
    scoring: str
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> "RoutingConfig":
        cfg = cls(spec.num_experts, spec.top_k, spec.scoring, spec.topk_method, spec.n_group,
                  spec.topk_group, spec.norm_topk_prob, spec.routed_scaling_factor)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring_func {self.scoring!r} is not supported ({SCORINGS})")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported "
                             f"({TOPK_METHODS})")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, {self.num_experts}]")
        if self.topk_method != "greedy" and (self.num_experts % self.n_group
                                             or not 1 <= self.topk_group <= self.n_group):
            raise ValueError(f"n_group {self.n_group} must divide {self.num_experts} experts and "
                             f"topk_group {self.topk_group} must be in [1, n_group]")

    @property
    def uses_correction_bias(self) -> bool:
        return self.scoring == "sigmoid"


def _group_mask(choice_ME: torch.Tensor, cfg: RoutingConfig) -> torch.Tensor:
    """True for experts in the topk_group best groups of each row."""
    m, per = choice_ME.shape[0], cfg.num_experts // cfg.n_group
    grouped = choice_ME.view(m, cfg.n_group, per)
    if cfg.topk_method == "noaux_tc":
        group_score = grouped.topk(min(2, per), dim=-1)[0].sum(dim=-1)
    else:
        group_score = grouped.max(dim=-1).values
    best = group_score.topk(cfg.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
    return keep.unsqueeze(-1).expand(m, cfg.n_group, per).reshape(m, cfg.num_experts)


def select_experts(logits_ME: torch.Tensor, cfg: RoutingConfig,
                   correction_bias_E: Optional[torch.Tensor] = None,
                   num_valid: Optional[int] = None,
                   out: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids [M, K] int32 and weights [M, K] float32 (float64 in, float64 weights out),
    into `out` (ids, weights) when given."""
    wdtype = torch.float64 if logits_ME.dtype == torch.float64 else torch.float32
    logits = logits_ME.to(wdtype)
    scores = logits.sigmoid() if cfg.scoring == "sigmoid" else logits.softmax(dim=-1)
    if cfg.topk_method == "noaux_tc":
        choice = scores if correction_bias_E is None else scores + correction_bias_E.to(wdtype)
        if cfg.n_group > 1:
            choice = choice.masked_fill(~_group_mask(choice, cfg), float("-inf"))
        ids = choice.topk(cfg.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    else:
        if cfg.topk_method == "group_limited_greedy":
            scores = scores.masked_fill(~_group_mask(scores, cfg), 0.0)
        weights, ids = scores.topk(cfg.top_k, dim=-1, sorted=False)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if out is None:
        weights = weights * cfg.routed_scaling_factor
        ids = ids.to(torch.int32)
    else:  # the same launches, their results written into the planned buffers
        weights = torch.mul(weights, cfg.routed_scaling_factor, out=out[1])
        ids = out[0].copy_(ids)
    if num_valid is not None and num_valid < ids.shape[0]:
        ids[num_valid:] = -1
        weights[num_valid:] = 0.0
    return ids, weights


class Router(nn.Module):
    """gate.weight [E, H], replicated on every rank; gate.e_score_correction_bias [E] (fp32)
    with sigmoid scoring."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = RoutingConfig.from_spec(spec)
        self.hidden = spec.hidden_size
        # DeepSeek computes router logits in fp32; the Qwen/Mixtral/OLMoE blocks in the model dtype
        self.fp32_logits = spec.architecture.startswith("Deepseek")
        self.weight = empty_param(spec.num_experts, spec.hidden_size, dtype=dtype)
        if self.cfg.uses_correction_bias:
            self.e_score_correction_bias = empty_param(spec.num_experts, dtype=torch.float32)
        else:
            self.register_parameter("e_score_correction_bias", None)
        self.buffers: Optional[RouterBuffers] = None  # None: each step allocates its top-k

    def bind(self, buffers: Optional[RouterBuffers]) -> None:
        """The plan's moe.router.* buffers, which every step's top-k then go into."""
        self.buffers = buffers

    def logits(self, x_MH: torch.Tensor) -> torch.Tensor:
        """fp32 logits [M, E]: from fp32 products (DeepSeek), or rounded to the model dtype."""
        if self.fp32_logits:
            # up to FP32_SKINNY_ROWS rows the skinny kernel reads the model-dtype x and W and
            # accumulates in fp32: the fp32 product up to the order of summation, without the
            # casts of x and W and the fp32 GEMM (its row groups re-read W, 0.5 MB, from L2)
            out = skinny(x_MH, self.weight, out_dtype=torch.float32, max_rows=FP32_SKINNY_ROWS)
            if out is not None:
                return out
            # past them, one GEMM of the model-dtype operands with fp32 sums and output
            # computes the same (no fp32 copies of x and W)
            if x_MH.is_cuda and x_MH.dtype in (torch.bfloat16, torch.float16) \
                    and self.weight.dtype == x_MH.dtype:
                return torch.mm(x_MH, self.weight.t(), out_dtype=torch.float32)
            return F.linear(x_MH.float(), self.weight.float())
        return linear(x_MH, self.weight).float()

    def forward(self, x_MH: torch.Tensor, num_valid: Optional[int] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        ids, weights, _ = self.route(x_MH, num_valid)
        return ids, weights

    def route(self, x_MH: torch.Tensor, num_valid: Optional[int] = None,
              quantize: Optional[tuple[int, torch.Tensor, torch.Tensor]] = None
              ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(ids, weights, whether x was quantized): quantize (group G, fp8 [M, H], float32
        [M, ceil(H/G)]) asks that the top-k's launch also quantize x's rows into them, as
        kernels/fp8/gemm.quantize_groups would (fp8 experts then need no quantizer launch);
        the top-k kernel does where it takes one row a program, nothing else does."""
        cfg = self.cfg
        out = None if self.buffers is None else self.buffers.rows(x_MH.shape[0])
        if (cfg.scoring, cfg.topk_method) == ("softmax", "greedy") and x_MH.is_cuda:
            fused = self._fused(x_MH, x_MH.shape[0] if num_valid is None else num_valid, out,
                                quantize)
            if fused is not None:
                return fused
        ids, weights = select_experts(self.logits(x_MH), self.cfg,
                                      self.e_score_correction_bias, num_valid, out)
        # HF rounds these blocks' weights to the model dtype
        if not self.fp32_logits and x_MH.dtype != torch.float32:
            rounded = weights.to(x_MH.dtype)
            weights = rounded.float() if out is None else weights.copy_(rounded)
        return ids, weights, False

    def _fused(self, x_MH: torch.Tensor, num_valid: int,
               out: Optional[tuple[torch.Tensor, torch.Tensor]],
               quantize: Optional[tuple[int, torch.Tensor, torch.Tensor]]
               ) -> Optional[tuple[torch.Tensor, torch.Tensor, bool]]:
        """The softmax + greedy router on a GPU (kernels/moe/router.py): the logits GEMM
        and the top-k in one launch where router_gemm_suits, else the logits, then the top-k's
        launch (which quantizes x where asked and it can). None where neither kernel runs."""
        cfg = self.cfg
        # model-dtype logits go in as they are: the kernels upcast them, as .float() would
        round_to = torch.float32 if self.fp32_logits else x_MH.dtype
        args = (cfg.top_k, cfg.norm_topk_prob, cfg.routed_scaling_factor, num_valid)
        if (router_gemm_suits(x_MH.shape[0], cfg.num_experts) and cfg.num_experts <= 256
                and x_MH.dtype in (torch.bfloat16, torch.float16)
                and self.weight.dtype == x_MH.dtype and x_MH.stride(-1) == 1):
            ops = K.router(x_MH.device)
            res = ops and ops.router_topk(x_MH, self.weight, *args, not self.fp32_logits,
                                          round_to, out=out)
            if res is not None:
                return (*res, False)
        ops = K.router(x_MH.device)
        if ops is None:
            return None
        logits = self.logits(x_MH) if self.fp32_logits else linear(x_MH, self.weight)
        rows = None
        if quantize is not None and ops.quantizes_rows(x_MH.shape[0], cfg.num_experts) \
                and x_MH.stride(-1) == 1:
            rows = (x_MH, *quantize)
        return (*ops.topk_softmax(logits, *args, round_to, out=out, quantize=rows),
                rows is not None)

    def checkpoint_names(self) -> list[str]:
        names = ["weight"]
        if self.e_score_correction_bias is not None:
            names.append("e_score_correction_bias")
        return names

    def load_weight(self, name: str, src: Any) -> None:
        if name not in self.checkpoint_names():
            raise KeyError(f"the router has no checkpoint tensor gate.{name}")
        e = self.cfg.num_experts
        want = (e, self.hidden) if name == "weight" else (e,)
        expect_shape(f"gate.{name}", src, want)
        copy_into(getattr(self, name), read(src), f"gate.{name}")
