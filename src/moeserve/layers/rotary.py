"""Rotary position embeddings (neox style: the two halves of each head rotate together).

rope_scaling types: default, linear, llama3 and yarn, with the formulas of transformers'
modeling_rope_utils. Dynamic NTK (its frequencies change with the batch's length) and longrope
are rejected with an error rather than approximated. cos/sin are computed from the positions
at each forward, in fp32, as transformers does.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from moeserve.kernels import ops as K

if TYPE_CHECKING:
    from moeserve.batch.kv_cache import KVWrite

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RopeScalingError(ValueError):
    pass


def _base_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(dim: int, base: float, p: dict[str, Any], max_position: int
          ) -> tuple[torch.Tensor, float]:
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1 where the frequency is kept, 0 where it is interpolated
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _llama3(dim: int, base: float, p: dict[str, Any]) -> torch.Tensor:
    inv_freq = _base_inv_freq(dim, base)
    factor, low_f, high_f = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low_f, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low_f) / (high_f - low_f)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high_f) & ~(wavelen > old / low_f)
    return torch.where(medium, smoothed, scaled)


def rope_frequencies(head_dim: int, base: float, scaling: Optional[dict[str, Any]],
                     max_position: int) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim/2] (fp32, CPU) and the factor applied to cos and sin."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise RopeScalingError(f"rope_scaling type {kind!r} is not supported; moeserve "
                               f"supports {', '.join(SUPPORTED_ROPE_TYPES)}")
    if kind == "default":
        return _base_inv_freq(head_dim, base), 1.0
    if kind == "linear":
        return _base_inv_freq(head_dim, base) / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(head_dim, base, scaling), 1.0
    return _yarn(head_dim, base, scaling, max_position)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies rope to q [T, heads, D] and k [T, kv_heads, D] at `positions` [T]."""

    def __init__(self, head_dim: int, base: float, scaling: Optional[dict[str, Any]],
                 max_position: int):
        super().__init__()
        self.head_dim = head_dim
        with torch.device("cpu"):  # also when the model is built under a meta/cuda device
            inv_freq, self.attention_factor = rope_frequencies(head_dim, base, scaling,
                                                               max_position)
        self._inv_freq_cpu = inv_freq
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The frequencies [head_dim / 2] (fp32) on `device` (copied there once)."""
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq_cpu.to(device)
        return self._inv_freq[device]

    def cos_sin(self, positions_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs_TD2 = positions_T.float()[:, None] * self.inv_freq(positions_T.device)[None, :]
        emb_TD = torch.cat((freqs_TD2, freqs_TD2), dim=-1)
        return emb_TD.cos() * self.attention_factor, emb_TD.sin() * self.attention_factor

    def forward(self, positions_T: torch.Tensor, q_TND: torch.Tensor, k_TKD: torch.Tensor,
                norms: Optional[tuple[Any, Any]] = None, kv_write: Optional["KVWrite"] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """norms: per-head RMSNorm modules (q_norm, k_norm) to apply first (Qwen3-MoE).
        kv_write: the layer's K/V store; when given, the rotated k and v are in the KV cache
        on return, written by the rope kernel in its launch or else by the pool's set_kv."""
        ops = K.elementwise(q_TND.device)
        if (ops is not None and q_TND.shape[-1] == 2 * self._inv_freq_cpu.shape[0]
                and q_TND.stride(-1) == 1 and k_TKD.stride(-1) == 1
                and q_TND.dtype == k_TKD.dtype):
            extra = () if norms is None else (norms[0].weight, norms[1].weight, norms[0].eps)
            out = ops.rotary(positions_T, q_TND, k_TKD, self.inv_freq(q_TND.device),
                             self.attention_factor,
                             *extra, kv_cache=None if kv_write is None else kv_write.kernel_args())
            if out is not None:  # one launch on a GPU (kernels/elementwise/fused.py)
                return out
        if norms is not None:
            q_TND, k_TKD = norms[0](q_TND), norms[1](k_TKD)
        cos, sin = self.cos_sin(positions_T)
        cos, sin = cos[:, None, :].to(q_TND.dtype), sin[:, None, :].to(q_TND.dtype)
        q_TND, k_TKD = (q_TND * cos + rotate_half(q_TND) * sin,
                        k_TKD * cos + rotate_half(k_TKD) * sin)
        if kv_write is not None:
            kv_write.write(k_TKD)
        return q_TND, k_TKD
