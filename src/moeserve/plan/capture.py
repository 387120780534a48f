"""CUDA-graph capture lists: decode batch sizes and prefill (piecewise) token counts.

Defaults follow SGLang's shape (dense at small sizes, sparser above), are capped by their max
knobs and by what the scheduler can form, and keep only multiples of attn_tp whenever tokens are
split evenly across the attention-TP ranks (docs/DESIGN.md invariant 6; SGLang #23972).
"""

from __future__ import annotations

from moeserve.config import EngineConfig
from moeserve.parallel.layout import ParallelLayout

DEFAULT_CUDA_GRAPH_MAX_BS = 256
DEFAULT_PIECEWISE_MAX_TOKENS = 8192  # the default prefill chunk: a full chunk replays


def default_decode_batch_sizes(limit: int) -> list[int]:
    sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 513, 16), *range(544, 4097, 32)]
    return [s for s in sizes if s <= limit]


def default_prefill_token_sizes(limit: int) -> list[int]:
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
             *range(1280, 4097, 256), *range(4608, 16385, 512), *range(17408, 65537, 1024)]
    return [s for s in sizes if s <= limit]


def _finish(sizes: list[int], limit: int, add_limit: bool, multiple: int) -> list[int]:
    """Cap at `limit`, add the limit itself (so the largest formable batch has a bucket), and
    keep multiples of `multiple`; sorted and unique."""
    kept = {s for s in sizes if 1 <= s <= limit}
    if add_limit and limit >= 1:
        kept.add(limit)
    return sorted(s for s in kept if s % multiple == 0)


def capture_multiple(layout: ParallelLayout) -> int:
    return layout.attn_tp if layout.scatter_across_attn_tp else 1


def decode_batch_sizes(cfg: EngineConfig, layout: ParallelLayout,
                       max_running_per_dp: int) -> list[int]:
    """Decode batch sizes (requests per DP rank) to capture; each step runs
    bs * tokens_per_decode_request tokens."""
    if cfg.disable_cuda_graph:
        return []
    explicit = cfg.cuda_graph_bs is not None
    max_bs = cfg.cuda_graph_max_bs or (max(cfg.cuda_graph_bs) if explicit
                                       else DEFAULT_CUDA_GRAPH_MAX_BS)
    limit = min(max_bs, max_running_per_dp)
    base = list(cfg.cuda_graph_bs) if explicit else default_decode_batch_sizes(limit)
    return _finish(base, limit, add_limit=not explicit, multiple=capture_multiple(layout))


def prefill_token_limit(cfg: EngineConfig, extend_tokens: int) -> int:
    if cfg.disable_piecewise_cuda_graph:
        return 0
    want = cfg.piecewise_cuda_graph_max_tokens or min(extend_tokens, DEFAULT_PIECEWISE_MAX_TOKENS)
    return min(want, extend_tokens)


def prefill_token_sizes(cfg: EngineConfig, layout: ParallelLayout, extend_tokens: int) -> list[int]:
    """Prefill token counts (per DP rank) to capture piecewise; never above the extend bound,
    so a padded prefill never exceeds what the scheduler admits."""
    limit = prefill_token_limit(cfg, extend_tokens)
    if limit == 0:
        return []
    return _finish(default_prefill_token_sizes(limit), limit, add_limit=True,
                   multiple=capture_multiple(layout))
