"""Per-forward step metadata: one exchange of token counts, one geometry on every rank.

Once per forward every rank all-gathers its token count on the CPU group (`gather_ints`, in
the rank loop of runtime/worker.py, with the other flags of the step); every rank then derives
the same StepContext from that one list (`step_from_counts`): tokens of each DP rank, the rows
each rank holds when tokens are scattered across attention-TP ranks, and the runtime max per
rank (after the SP scatter) that sizes the all-to-all. The runtime guard runs on the gathered
list too, so when a step is larger than the plan every rank raises the same error before any
communication of that step, and the process groups stay usable for the next step.

Scatter across attn_tp splits a DP rank's T tokens into chunks of ceil(T / attn_tp) rows in
rank order (the last ranks may hold fewer rows, or none); padding for the even-size
collectives is added at the end of the last chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

from moeserve.parallel.groups import ParallelState
from moeserve.parallel.layout import ParallelLayout
from moeserve.plan.budget import moe_tokens_per_rank, runtime_max_per_rank
from moeserve.plan.buffers import BUDGET_KNOBS

if TYPE_CHECKING:
    from moeserve.plan.capacity import CapacityPlan


class StepTooLarge(RuntimeError):
    """A forward exceeds a bound of the capacity plan; the message names the knob to raise.
    Raised on every rank of the engine together, before any communication of the step."""


@dataclass(frozen=True, kw_only=True)
class StepContext:
    layout: ParallelLayout
    rank: int  # this rank in the engine's tp world
    tokens_per_dp_rank: tuple[int, ...]  # rows each DP rank runs this forward (padding included)
    num_padding: int  # trailing rows of this DP rank's batch that are padding (graph buckets)
    runtime_max_per_rank: int  # max MoE rows on any rank after the SP scatter; same everywhere

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.rank)

    @property
    def attn_tp_rank(self) -> int:
        return self.layout.attn_tp_rank(self.rank)

    @property
    def num_tokens(self) -> int:
        """T: rows of this DP rank's forward, replicated over its attn_tp ranks."""
        return self.tokens_per_dp_rank[self.dp_rank]

    @property
    def num_valid_tokens(self) -> int:
        return self.num_tokens - self.num_padding

    def chunk_rows(self, dp_rank: int) -> int:
        """Rows per attn_tp rank when DP rank `dp_rank`'s tokens are scattered."""
        return math.ceil(self.tokens_per_dp_rank[dp_rank] / self.layout.attn_tp)

    def scatter_sizes(self, dp_rank: int) -> tuple[int, ...]:
        """Rows each attn_tp rank of `dp_rank` holds when its tokens are scattered."""
        t, c = self.tokens_per_dp_rank[dp_rank], self.chunk_rows(dp_rank)
        return tuple(max(0, min(c, t - a * c)) for a in range(self.layout.attn_tp))

    def row_range(self, scattered: bool) -> tuple[int, int]:
        """[start, end) of this rank's rows within its DP rank's T rows."""
        if not scattered:
            return 0, self.num_tokens
        c = self.chunk_rows(self.dp_rank)
        start = min(self.attn_tp_rank * c, self.num_tokens)
        return start, min(start + c, self.num_tokens)

    def rows_per_rank(self, scattered: bool) -> tuple[int, ...]:
        """Rows each rank of the tp world holds, in rank order."""
        lay = self.layout
        if not scattered:
            return tuple(self.tokens_per_dp_rank[lay.dp_rank(r)] for r in range(lay.tp))
        return tuple(self.scatter_sizes(lay.dp_rank(r))[lay.attn_tp_rank(r)]
                     for r in range(lay.tp))

    def num_rows(self, scattered: bool) -> int:
        start, end = self.row_range(scattered)
        return end - start

    def valid_rows(self, scattered: bool) -> int:
        """How many of this rank's rows are real tokens (the rest are padding rows)."""
        start, end = self.row_range(scattered)
        return max(0, min(end, self.num_valid_tokens) - start)


def step_from_counts(counts_per_rank: Sequence[int], layout: ParallelLayout, rank: int,
                     plan: Optional["CapacityPlan"], num_padding: int = 0) -> StepContext:
    """The step geometry from the token count every tp rank reported (identical list on every
    rank), with the plan's runtime guard. Pure: no communication."""
    if len(counts_per_rank) != layout.tp:
        raise ValueError(f"need one count per tp rank ({layout.tp}), got {list(counts_per_rank)}")
    per_dp: list[int] = []
    for d, ranks in enumerate(layout.attn_tp_groups()):
        seen = {counts_per_rank[r] for r in ranks}
        if len(seen) != 1:
            raise ValueError(f"the attention-TP ranks {ranks} of DP rank {d} run different token "
                             f"counts {[counts_per_rank[r] for r in ranks]}; they must run the "
                             "same batch")
        per_dp.append(seen.pop())
    if min(per_dp) < 0:
        raise ValueError(f"negative token count in {per_dp}")
    if not 0 <= num_padding <= per_dp[layout.dp_rank(rank)]:
        raise ValueError(f"num_padding {num_padding} is not within the rank's "
                         f"{per_dp[layout.dp_rank(rank)]} tokens")
    if plan is not None:
        check_step(per_dp, layout, plan)
    return StepContext(layout=layout, rank=rank, tokens_per_dp_rank=tuple(per_dp),
                       num_padding=num_padding,
                       runtime_max_per_rank=runtime_max_per_rank(per_dp, layout))


def check_step(tokens_per_dp_rank: Sequence[int], layout: ParallelLayout,
               plan: "CapacityPlan") -> None:
    """The runtime guard: raise StepTooLarge when a step exceeds what the plan sized."""
    budget = plan.budget
    if budget is None:
        raise ValueError("the capacity plan has errors and no token budget: "
                         + "; ".join(str(e) for e in plan.errors))
    for d, t in enumerate(tokens_per_dp_rank):
        if t > budget.max_tokens:
            raise StepTooLarge(
                f"DP rank {d} runs a forward of {t} tokens, above the capacity plan's "
                f"{budget.max_tokens} tokens per forward per DP rank, which sized the MoE "
                f"buffers. Fix: raise {' / '.join(BUDGET_KNOBS[:2])} to {t} or more (or "
                "--max-running-requests for decode batches), or schedule smaller batches.")
    if plan.a2a_cap is not None:
        need = max((moe_tokens_per_rank(t, layout) for t in tokens_per_dp_rank), default=0)
        if need > plan.a2a_cap:
            raise StepTooLarge(
                f"this step sends up to {need} tokens per rank through the all-to-all, but "
                f"the workspace holds --moe-a2a-max-tokens-per-rank {plan.a2a_cap}. Fix: set "
                f"--moe-a2a-max-tokens-per-rank {need} or more.")


def gather_ints(values: Sequence[int], state: ParallelState) -> list[tuple[int, ...]]:
    """Every rank's `values` (the same length on every rank), in rank order: one all-gather on
    the CPU group, so every rank gets the same list."""
    if state.world.size == 1:
        return [tuple(int(v) for v in values)]
    mine = torch.tensor([int(v) for v in values], dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(state.world.size)]
    dist.all_gather(out, mine, group=state.cpu)
    return [tuple(int(v) for v in o.tolist()) for o in out]
