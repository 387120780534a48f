"""The parallel layout: the arithmetic of docs/DESIGN.md as pure Python, no torch.distributed.

Axes over the `tp` ranks of one engine (rank r in [0, tp)):
  dp       attention data-parallel groups; r belongs to DP rank r // attn_tp
  attn_tp  tensor parallelism inside one attention group; attn_tp rank r % attn_tp
  ep       expert-parallel size; EP rank r // moe_tp owns experts [ep_rank*E/ep, ...)
  moe_tp   each expert's intermediate dim split; moe_tp rank r % moe_tp
  dense_tp tensor-parallel size of dense MLPs: tp, or 1 (replicated)
  sp       the MoE block works on tokens scattered across the attn_tp ranks
"""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.config import EngineConfig
from moeserve.config.spec import ModelSpec


@dataclass(frozen=True)
class Problem:
    """One thing that stops the engine from starting: what is wrong, and a change that works."""

    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.message} Fix: {self.fix}."


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    dp: int
    ep: int
    dense_tp: int
    a2a: bool

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "ParallelLayout":
        return cls(tp=cfg.tp_size, dp=cfg.attn_dp_size, ep=cfg.ep_size,
                   dense_tp=cfg.dense_tp_size, a2a=cfg.a2a_enabled)

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    @property
    def sp(self) -> bool:
        """Sequence parallelism of the MoE block: on with the all-to-all backend and attn_tp > 1."""
        return self.a2a and self.attn_tp > 1

    @property
    def dense_scattered(self) -> bool:
        """Replicated dense MLPs run on tokens reduce-scattered across the attn_tp ranks."""
        return self.dense_tp == 1 and self.attn_tp > 1

    @property
    def dp_gather(self) -> bool:
        """The gather dispatcher gathers tokens of several DP ranks into one buffer."""
        return not self.a2a and self.dp > 1

    @property
    def shared_expert_tp(self) -> int:
        """Ranks a MoE layer's shared experts are split over: the tp world on the gather path
        with split dense MLPs (their partial sums ride the gather's reduce-scatter), else 1
        (replicated: the all-to-all backend has no reduction over the world to ride)."""
        return self.tp if not self.a2a and self.dense_tp == self.tp else 1

    @property
    def scatter_across_attn_tp(self) -> bool:
        """Tokens are split evenly across attn_tp ranks somewhere in a step (SP, replicated
        dense MLPs, or the DP-attention gather, which contributes attn_tp slices per group)."""
        return self.attn_tp > 1 and (self.sp or self.dense_scattered or self.dp_gather)

    # --- rank arithmetic (used to build process groups) ------------------------------------
    def dp_rank(self, rank: int) -> int:
        return rank // self.attn_tp

    def attn_tp_rank(self, rank: int) -> int:
        return rank % self.attn_tp

    def ep_rank(self, rank: int) -> int:
        return rank // self.moe_tp

    def moe_tp_rank(self, rank: int) -> int:
        return rank % self.moe_tp

    def attn_tp_groups(self) -> list[list[int]]:
        return [list(range(d * self.attn_tp, (d + 1) * self.attn_tp)) for d in range(self.dp)]

    def attn_dp_groups(self) -> list[list[int]]:
        """Ranks with the same attn_tp rank across DP groups."""
        return [list(range(a, self.tp, self.attn_tp)) for a in range(self.attn_tp)]

    def ep_groups(self) -> list[list[int]]:
        """Ranks with the same moe_tp rank across EP ranks (they exchange tokens)."""
        return [list(range(m, self.tp, self.moe_tp)) for m in range(self.moe_tp)]

    def moe_tp_groups(self) -> list[list[int]]:
        return [list(range(e * self.moe_tp, (e + 1) * self.moe_tp)) for e in range(self.ep)]

    def describe(self) -> str:
        return (f"tp={self.tp} dp={self.dp} attn_tp={self.attn_tp} ep={self.ep} "
                f"moe_tp={self.moe_tp} dense_tp={self.dense_tp} sp={'on' if self.sp else 'off'} "
                f"a2a={'all_to_all' if self.a2a else 'none (gather)'}")


def layout_problems(cfg: EngineConfig, spec: ModelSpec) -> list[Problem]:
    """Every reason the layout cannot serve `spec`, each quoting the numbers."""
    p: list[Problem] = []
    tp, dp, ep = cfg.tp_size, cfg.dp_size, cfg.ep_size
    if min(tp, dp, ep) < 1:
        return p  # reported by config_errors
    if dp > 1 and not cfg.enable_dp_attention:
        p.append(Problem(f"--dp-size {dp} without --enable-dp-attention: moeserve's dp is "
                         "attention data parallelism inside one engine.",
                         "add --enable-dp-attention, or set --dp-size 1"))
    if cfg.enable_dp_attention and tp % dp:
        p.append(Problem(f"tp % dp != 0: --tp-size {tp} is not divisible by --dp-size {dp}.",
                         f"set --dp-size to a divisor of {tp}, e.g. {_divisor_near(tp, dp)}"))
        return p
    if tp % ep:
        p.append(Problem(f"tp % ep != 0: --tp-size {tp} is not divisible by --ep-size {ep}.",
                         f"set --ep-size to a divisor of {tp}, e.g. {_divisor_near(tp, ep)}"))
        return p
    lay = ParallelLayout.from_config(cfg)
    if spec.num_experts % ep:
        p.append(Problem(f"experts % ep != 0: {spec.num_experts} experts do not split across "
                         f"--ep-size {ep}.",
                         f"set --ep-size to a divisor of {spec.num_experts} that divides {tp}"))
    if spec.moe_intermediate_size % lay.moe_tp:
        p.append(Problem(f"expert intermediate % moe_tp != 0: {spec.moe_intermediate_size} "
                         f"does not split across moe_tp = tp/ep = {tp}/{ep} = {lay.moe_tp}.",
                         "raise --ep-size so that moe_tp divides "
                         f"{spec.moe_intermediate_size}"))
    if spec.num_heads % lay.attn_tp:
        p.append(Problem(f"heads % attn_tp != 0: {spec.num_heads} attention heads do not split "
                         f"across attn_tp = tp/dp = {tp}/{lay.dp} = {lay.attn_tp}.",
                         "set --tp-size / --dp-size so that attn_tp divides "
                         f"{spec.num_heads}"))
    kv = spec.num_kv_heads
    if spec.mla is None and kv % lay.attn_tp and lay.attn_tp % kv:
        p.append(Problem(f"{kv} KV heads and attn_tp = {lay.attn_tp}: neither divides the "
                         "other, so KV heads can be neither split nor replicated evenly.",
                         f"choose attn_tp dividing {kv} or a multiple of it"))
    if lay.dense_tp not in (1, tp):
        p.append(Problem(f"--moe-dense-tp-size {lay.dense_tp} must be 1 (replicated) or "
                         f"--tp-size ({tp}).", "set --moe-dense-tp-size 1, or leave it unset"))
    else:
        for what, width, split in [
                ("dense MLP intermediate", spec.dense_intermediate_size
                 if spec.dense_layers else 0, lay.dense_tp),
                ("shared expert intermediate", spec.shared_expert_intermediate_size,
                 lay.shared_expert_tp)]:
            if width and width % split:
                p.append(Problem(f"{what} {width} does not split across {split} ranks "
                                 f"(dense_tp = {lay.dense_tp}).", "set --moe-dense-tp-size 1"))
    if cfg.a2a_enabled and ep != tp:
        p.append(Problem(f"--moe-a2a-backend {cfg.moe_a2a_backend} needs whole experts per "
                         f"rank: ep ({ep}) must equal tp ({tp}).",
                         f"set --ep-size {tp}, or --moe-a2a-backend none"))
    return p


def _divisor_near(n: int, want: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: (abs(d - want), -d))
