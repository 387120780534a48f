"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged cache of latents.

Legend: T new tokens, N query heads (local to this attn_tp rank), C kv_lora_rank (the
compressed KV, "latent"), R qk_rope_head_dim, P qk_nope_head_dim, Q = P + R (qk head dim),
V v_head_dim, S a request's cached tokens (prefix + new), H hidden.

    q_TNQ   = q_proj(h)                        or q_b_proj(q_a_layernorm(q_a_proj(h)))
    c_T(C+R)= kv_a_proj_with_mqa(h)            -> latent_TC = kv_a_layernorm(c[:C]), k_pe_TR
    rope on q_pe (the last R dims of every head) and k_pe (one key shared by the heads)
    cache   <- [latent | k_pe] per token       (what the plan sizes: C + R per layer)
    k_nope_SNP, v_SNV = kv_b_proj(latent_SC)   for every cached token of the request
    o_TNV   = softmax((q_nope.k_nope + q_pe.k_pe) * scale) @ v;    out = o_proj(o)

The latent and k_pe are replicated on every attn_tp rank (q_a/kv_a are not split); the heads
are split: q_proj/q_b_proj and kv_b_proj column-parallel, o_proj row-parallel (partial sums,
reduced by the layer communicator as for every attention block). q_proj (or q_a_proj) and
kv_a_proj_with_mqa read the same h: they are one GEMM (q_kv_a), this rank's q heads beside the
whole kv_a, so a decode step streams both weights in one launch.

Rope: DeepSeek lays the rope dims out in interleaved pairs (x0, x1), (x2, x3) ... rotated by
one frequency each (DeepSeek-V2, and V3 with rope_interleave, the default); the rotated pairs
are written de-interleaved [even dims | odd dims] as transformers' V3 does. q and k are
permuted alike, so q_pe.k_pe (all that rope feeds) is the same as in the interleaved layout.
Without rope_interleave the two halves rotate together (neox style).

Softmax scale: Q^-0.5, times mscale(factor, mscale_all_dim)^2 for a yarn rope whose config
sets mscale_all_dim (transformers' yarn_apply_mscale).

Backends follow the attention backend contract (AttentionBackend.forward(q, layer, fb)) with
q = [q_nope | q_pe] per head and an output of V dims per head. "torch" is the reference: per
request it expands the cached latents through kv_b_proj and computes causal softmax attention
in fp32; it serves extend after a cached prefix and decode alike. It does not absorb kv_b_proj
into q and o, and reads host lengths (no CUDA graph). "triton" (mla_triton.py, the GPU default)
absorbs it and attends in the latent space: every head reads the cached rows themselves.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config.registry import Registry
from moeserve.layers.attention import AttentionBackend, causal_softmax
from moeserve.kernels import ops as K
from moeserve.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                    RowParallelLinear)
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.config.quant import QuantSpec
from moeserve.config.spec import MLASpec, ModelSpec
from moeserve.parallel.groups import ParallelState
from moeserve.batch.forward_batch import ForwardBatch, ForwardMode


def mla_softmax_scale(mla: MLASpec, rope_scaling: Optional[dict[str, Any]],
                      max_position: int) -> float:
    scale = mla.qk_head_dim ** -0.5
    p = rope_scaling or {}
    kind = p.get("rope_type", p.get("type", "default"))
    m_all = p.get("mscale_all_dim")
    if kind != "default" and m_all:
        factor = p.get("factor") or max_position / p["original_max_position_embeddings"]
        mscale = 1.0 if factor <= 1 else 0.1 * m_all * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def rope_interleaved(x: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor
                     ) -> torch.Tensor:
    """Rotate the pairs (x[2i], x[2i+1]) of x [T, heads, R] by angle i; returns
    [rotated evens | rotated odds]. cos/sin are RotaryEmbedding.cos_sin's [T, R] (both halves
    hold the pair angles)."""
    half = x.shape[-1] // 2
    cos, sin = cos_TR[:, None, :half].to(x.dtype), sin_TR[:, None, :half].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# --- backends ---------------------------------------------------------------------------------

MLA_BACKENDS: Registry[type[AttentionBackend]] = Registry("MLA backend")


@MLA_BACKENDS.register("torch")
class TorchMLABackend(AttentionBackend):
    def forward(self, q_TNQ: torch.Tensor, layer: "MLAttention",
                fb: ForwardBatch) -> torch.Tensor:
        n, p, r, v = layer.heads_local, layer.mla.qk_nope_head_dim, layer.mla.qk_rope_head_dim, \
            layer.mla.v_head_dim
        out_TNV = q_TNQ.new_empty(q_TNQ.shape[0], n, v)
        if fb.mode is ForwardMode.IDLE or q_TNQ.shape[0] == 0:
            return out_TNV
        cache_SW = fb.kv_pool.latent_cache(layer.layer_id)
        w_kvb = layer.kv_b_proj.weight.float()  # [N (P + V), C]
        c = layer.mla.kv_lora_rank
        start = 0
        for i, (prefix, new) in enumerate(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
            seq = prefix + new
            slots_S = fb.req_to_token[fb.req_pool_indices[i], :seq].long()
            latent_SC, k_pe_SR = cache_SW[slots_S].float().split([c, r], dim=-1)
            k_nope_SNP, v_SNV = F.linear(latent_SC, w_kvb).view(seq, n, p + v).split([p, v], -1)
            q_nope_tNP, q_pe_tNR = q_TNQ[start:start + new].float().split([p, r], dim=-1)
            scores_NtS = (torch.einsum("tnp,snp->nts", q_nope_tNP, k_nope_SNP)
                          + torch.einsum("tnr,sr->nts", q_pe_tNR, k_pe_SR)) * layer.scaling
            probs_NtS = causal_softmax(scores_NtS, prefix)
            out_TNV[start:start + new] = torch.einsum("nts,snv->tnv", probs_NtS,
                                                      v_SNV).to(q_TNQ.dtype)
            start += new
        return out_TNV


# --- the attention block ----------------------------------------------------------------------

class MLAttention(nn.Module):
    """h_TH -> partial attention output [T, H] (o_proj without its reduction over attn_tp)."""

    def __init__(self, spec: ModelSpec, state: ParallelState, layer_id: int, dtype: torch.dtype,
                 rotary: RotaryEmbedding, backend: AttentionBackend, *, interleaved_rope: bool,
                 quant: Callable[..., Optional[QuantSpec]] = lambda *projs: None):
        """quant: (projection names) -> their quantization. kv_b_proj stays in `dtype`
        whatever the checkpoint holds (an fp8 one is dequantized at load): the backends
        absorb its weight into the query and the output."""
        super().__init__()
        if spec.mla is None:
            raise ValueError(f"{spec.architecture} has no MLA dims (kv_lora_rank ...)")
        m = self.mla = spec.mla
        axis, h, n = state.attn_tp, spec.hidden_size, spec.num_heads
        if n % axis.size:
            raise ValueError(f"{n} attention heads do not split across {axis.size} attention-TP "
                             "ranks")
        self.spec, self.layer_id, self.backend = spec, layer_id, backend
        self.heads_local = n // axis.size
        self.bias = spec.attention_bias
        # the two projections of h in one GEMM: [q_proj's heads of this rank | the whole
        # kv_a_proj_with_mqa], or [q_a_proj | kv_a_proj_with_mqa], both whole, with q_lora
        self.q_name = "q_proj" if m.q_lora_rank is None else "q_a_proj"
        first_out = n * m.qk_head_dim if m.q_lora_rank is None else m.q_lora_rank
        self.q_kv_a = MergedColumnParallelLinear(
            h, (first_out, m.kv_cache_dim), bias=self.bias, axis=axis, dtype=dtype,
            replicated=(m.q_lora_rank is not None, True),
            quant=quant(self.q_name, "kv_a_proj_with_mqa"))
        if m.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6, dtype)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, n * m.qk_head_dim, bias=False,
                                                 axis=axis, dtype=dtype,
                                                 quant=quant("q_b_proj"))
        # transformers builds these two norms with the default eps, not rms_norm_eps
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6, dtype)
        self.kv_b_proj = ColumnParallelLinear(m.kv_lora_rank, n * (m.qk_nope_head_dim
                                                                   + m.v_head_dim),
                                              bias=False, axis=axis, dtype=dtype)
        self.o_proj = RowParallelLinear(n * m.v_head_dim, h, bias=self.bias, axis=axis,
                                        dtype=dtype, quant=quant("o_proj"))
        self.rotary, self.interleaved_rope = rotary, interleaved_rope
        self.scaling = mla_softmax_scale(m, spec.rope_scaling_dict, spec.max_position_embeddings)

    def _rope(self, positions_T: torch.Tensor, q_pe_TNR: torch.Tensor, k_pe_TR: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.interleaved_rope:
            cos, sin = self.rotary.cos_sin(positions_T)
            return (rope_interleaved(q_pe_TNR, cos, sin),
                    rope_interleaved(k_pe_TR[:, None, :], cos, sin)[:, 0])
        q_pe_TNR, k_pe_T1R = self.rotary(positions_T, q_pe_TNR.contiguous(),
                                         k_pe_TR[:, None, :].contiguous())
        return q_pe_TNR, k_pe_T1R[:, 0]

    def forward(self, positions_T: torch.Tensor, h_TH: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        m, t, n = self.mla, h_TH.shape[0], self.heads_local
        q, kv_TW = self.q_kv_a.split(self.q_kv_a(h_TH))  # views of one [T, Q + W] output
        if m.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q.contiguous()))
        q_TNQ = q.view(t, n, m.qk_head_dim)
        ops = K.mla(h_TH.device) if t else None
        roped = None if ops is None else ops.mla_prep(
            positions_T, q_TNQ, kv_TW, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps,
            self.rotary.inv_freq(h_TH.device), self.rotary.attention_factor, fb.out_cache_loc,
            fb.kv_pool.latent_cache(self.layer_id), m.qk_nope_head_dim, self.interleaved_rope)
        if roped is not None:  # one launch on a GPU (kernels/mla/kernels.py)
            q_TNQ = roped
        else:
            q_TNQ = self._prep(positions_T, q_TNQ, kv_TW, fb)
        if fb.attention_hook is not None:  # a prefill graph's capture cuts the forward here
            o_TNV = fb.attention_hook(q_TNQ, self, fb)
        else:
            o_TNV = self.backend.forward(q_TNQ, self, fb)
        return self.o_proj(o_TNV.reshape(t, n * m.v_head_dim))

    def _prep(self, positions_T: torch.Tensor, q_TNQ: torch.Tensor, kv_TW: torch.Tensor,
              fb: ForwardBatch) -> torch.Tensor:
        """The new tokens' cache rows [kv_a_layernorm(latent) | rope(k_pe)] stored, and
        [q_nope | rope(q_pe)] returned (what mla_kernels.mla_prep does in one launch)."""
        m = self.mla
        q_nope_TNP, q_pe_TNR = q_TNQ.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent_TC, k_pe_TR = kv_TW.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent_TC = self.kv_a_layernorm(latent_TC.contiguous())
        q_pe_TNR, k_pe_TR = self._rope(positions_T, q_pe_TNR, k_pe_TR)
        if q_TNQ.shape[0]:
            fb.kv_pool.set_latent(self.layer_id, fb.out_cache_loc, latent_TC, k_pe_TR)
        return torch.cat((q_nope_TNP, q_pe_TNR), dim=-1)

    # --- weights (names relative to "self_attn.") ----------------------------------------
    def _shapes(self) -> dict[str, tuple[int, ...]]:
        m, h, n = self.mla, self.spec.hidden_size, self.spec.num_heads
        shapes: dict[str, tuple[int, ...]] = {}
        if m.q_lora_rank is None:
            shapes["q_proj.weight"] = (n * m.qk_head_dim, h)
        else:
            shapes["q_a_proj.weight"] = (m.q_lora_rank, h)
            if self.bias:
                shapes["q_a_proj.bias"] = (m.q_lora_rank,)
            shapes["q_a_layernorm.weight"] = (m.q_lora_rank,)
            shapes["q_b_proj.weight"] = (n * m.qk_head_dim, m.q_lora_rank)
        shapes["kv_a_proj_with_mqa.weight"] = (m.kv_cache_dim, h)
        if self.bias:
            shapes["kv_a_proj_with_mqa.bias"] = (m.kv_cache_dim,)
        shapes["kv_a_layernorm.weight"] = (m.kv_lora_rank,)
        shapes["kv_b_proj.weight"] = (n * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        shapes["o_proj.weight"] = (h, n * m.v_head_dim)
        if self.bias:
            shapes["o_proj.bias"] = (h,)
        return shapes

    def checkpoint_names(self) -> list[str]:
        return list(self._shapes())

    def checkpoint_shape(self, name: str) -> tuple[int, ...]:
        shapes = self._shapes()
        if name not in shapes:
            raise KeyError(f"MLA attention has no tensor {name!r}; it has {', '.join(shapes)}")
        return shapes[name]

    def load_weight(self, name: str, src: Any) -> None:
        if name not in self._shapes():
            raise KeyError(f"MLA attention of layer {self.layer_id} has no tensor {name!r}")
        module_name, param = name.split(".")
        if module_name in (self.q_name, "kv_a_proj_with_mqa"):
            self.q_kv_a.load_weight(param, src, int(module_name != self.q_name))
        else:
            getattr(self, module_name).load_weight(param, src)
