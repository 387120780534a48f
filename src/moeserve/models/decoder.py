"""The decoder shared by the architectures: attention block, decoder layer, causal LM.

Legend: T tokens of this DP rank, H hidden, N/K query/KV heads (local), D head dim, V vocab.

Architectures differ only in a few switches (biases, q/k norm kind, OLMoE's clip_qkv, Mixtral's
sliding window), in the attention block (DeepSeek's latent attention, `attention_factory`), and
in the names their checkpoints use; the checkpoint-facing side of a model is
written in one canonical naming (transformers' Qwen-MoE names) and each architecture translates
its own names to it (`MoECausalLM.to_canonical`).

Weights are addressed by canonical checkpoint name: `checkpoint_names()` lists every tensor a
checkpoint must hold, `checkpoint_shape(name)` its full (unsharded) shape, `needs(name)` whether
this rank reads it at all (experts of other EP ranks: no), `load_weight(name, src)` reads this
rank's part of it from a tensor or a safetensors slice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from moeserve.kernels import ops as K
from moeserve.layers.attention import AttentionBackend, PagedAttention
from moeserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from moeserve.kernels.fp8.reference import empty_groups
from moeserve.kernels.fp8.tiles import DECODE_GEMM_ROWS
from moeserve.layers.linear import QKVParallelLinear, RowParallelLinear, input_group
from moeserve.layers.norm import RMSNorm, ShardedRMSNorm
from moeserve.layers.pending import add_norm, add_norm_quantized, settle
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.config.spec import ModelSpec, ModelSpecError
from moeserve.parallel.groups import ParallelState
from moeserve.batch.buffers import ModelBuffers
from moeserve.batch.forward_batch import ForwardBatch
from moeserve.config.registry import Registry
from moeserve.config.quant import QuantSpec
from moeserve.models import quant as Q

# (projection names of one block) -> their one quantization (models/quant.block_quant)
QuantOf = Callable[..., Optional[QuantSpec]]


def no_quant(*projections: str) -> Optional[QuantSpec]:
    return None


@dataclass(frozen=True)
class AttentionOptions:
    """What differs between the architectures' attention blocks."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"  # "none", "per_head" (Qwen3-MoE), "full" (OLMoE)
    clip_qkv: Optional[float] = None  # OLMoE: clamp q, k, v to [-clip, clip]
    sliding_window: Optional[int] = None


def refuse_sliding_window(architecture: str, hf_config: dict[str, Any]) -> None:
    """Qwen-MoE's sliding window applies to some layers only; moeserve does not run it."""
    if hf_config.get("use_sliding_window"):
        raise ModelSpecError(f"{architecture} with use_sliding_window=true is not supported; "
                             "set use_sliding_window to false in config.json")


class DecoderAttention(nn.Module):
    """h_TH -> partial attention output [T, H] (o_proj without its reduction over attn_tp)."""

    def __init__(self, spec: ModelSpec, state: ParallelState, layer_id: int, dtype: torch.dtype,
                 opts: AttentionOptions, rotary: RotaryEmbedding, backend: AttentionBackend,
                 quant: QuantOf = no_quant):
        super().__init__()
        axis = state.attn_tp
        h, d = spec.hidden_size, spec.head_dim
        self.spec, self.opts, self.head_dim = spec, opts, d
        self.qkv_proj = QKVParallelLinear(h, d, spec.num_heads, spec.num_kv_heads,
                                          bias=opts.qkv_bias, axis=axis, dtype=dtype,
                                          quant=quant("q_proj", "k_proj", "v_proj"))
        self.o_proj = RowParallelLinear(spec.num_heads * d, h, bias=opts.o_bias, axis=axis,
                                        dtype=dtype, quant=quant("o_proj"))
        qkv = self.qkv_proj
        self.q_norm: Optional[nn.Module] = None
        self.k_norm: Optional[nn.Module] = None
        if opts.qk_norm == "per_head":
            self.q_norm = RMSNorm(d, spec.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps, dtype)
        elif opts.qk_norm == "full":
            self.q_norm = ShardedRMSNorm(spec.num_heads * d, qkv.q_size, axis.rank * qkv.q_size,
                                         1, spec.rms_norm_eps, axis, dtype)
            self.k_norm = ShardedRMSNorm(spec.num_kv_heads * d, qkv.kv_size,
                                         qkv.kv_head_start * d, qkv.kv_replicas,
                                         spec.rms_norm_eps, axis, dtype)
        elif opts.qk_norm != "none":
            raise ValueError(f"unknown q/k norm {opts.qk_norm!r}")
        self.rotary = rotary
        self.attn = PagedAttention(layer_id, qkv.heads_local, qkv.kv_heads_local, d, d ** -0.5,
                                   backend, opts.sliding_window)

    def input_group(self) -> Optional[int]:
        """The columns by which qkv_proj quantizes its input (fp8 weights), else None."""
        return input_group(self.qkv_proj)

    def forward(self, positions_T: torch.Tensor, h_TH: torch.Tensor, fb: ForwardBatch,
                h_quant: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """h_quant: h's rows already quantized per input_group() columns (by the norm)."""
        t, d = h_TH.shape[0], self.head_dim
        q, k, v = self.qkv_proj(h_TH, x_quant=h_quant)
        if self.opts.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        n, kv = self.qkv_proj.heads_local, self.qkv_proj.kv_heads_local
        q_TND, k_TKD, v_TKD = q.view(t, n, d), k.view(t, kv, d), v.view(t, kv, d)
        norms = None
        if self.opts.qk_norm == "per_head":
            if self.opts.clip_qkv is None:  # the norms ride with the rope (one GPU launch)
                norms = (self.q_norm, self.k_norm)
            else:
                q_TND, k_TKD = self.q_norm(q_TND), self.k_norm(k_TKD)
        if self.opts.clip_qkv is not None:
            c = self.opts.clip_qkv
            q_TND, k_TKD, v_TKD = q_TND.clamp(-c, c), k_TKD.clamp(-c, c), v_TKD.clamp(-c, c)
        # on a GPU the rope kernel also writes k and v into the KV cache (one launch less)
        kv_write = self.attn.kv_write(v_TKD, fb)
        q_TND, k_TKD = self.rotary(positions_T, q_TND, k_TKD, norms, kv_write)
        # fp8 o_proj: its input quantized by the attention's own kernels where they can
        group, quant = input_group(self.o_proj), None
        if group is not None and self.attn.quantizes_output(q_TND, fb, group):
            quant = empty_groups(t, n * d, group, q_TND.device)
        o_TND = self.attn(q_TND, k_TKD, v_TKD, fb, kv_stored=kv_write is not None,
                          quant_out=quant)
        return self.o_proj(o_TND.reshape(t, n * d), x_quant=quant)

    # --- weights (names relative to "self_attn.") ----------------------------------------
    def checkpoint_names(self) -> list[str]:
        names = [f"{p}_proj.weight" for p in "qkvo"]
        if self.opts.qkv_bias:
            names += [f"{p}_proj.bias" for p in "qkv"]
        if self.opts.o_bias:
            names.append("o_proj.bias")
        if self.q_norm is not None:
            names += ["q_norm.weight", "k_norm.weight"]
        return names

    def checkpoint_shape(self, name: str) -> tuple[int, ...]:
        s, d = self.spec, self.head_dim
        width = {"q": s.num_heads * d, "k": s.num_kv_heads * d, "v": s.num_kv_heads * d,
                 "o": s.hidden_size}
        proj, param = name.split(".")
        if proj.endswith("_norm"):
            return (d,) if self.opts.qk_norm == "per_head" else (width[proj[0]],)
        if proj == "o_proj" and param == "weight":
            return (s.hidden_size, s.num_heads * d)
        return (width[proj[0]], s.hidden_size) if param == "weight" else (width[proj[0]],)

    def load_weight(self, name: str, src: Any) -> None:
        module_name, param = name.split(".")
        if module_name in ("q_proj", "k_proj", "v_proj"):
            self.qkv_proj.load_weight(param, src, module_name[0])
        elif module_name == "o_proj":
            self.o_proj.load_weight(param, src)
        else:
            getattr(self, module_name).load_weight(param, src)


# Shapes of the MLP tensors, by name relative to "mlp." (the MoE/dense layers own the loading).
_MLP_SHAPES: list[tuple[str, Callable[[ModelSpec], tuple[int, ...]]]] = [
    (r"gate\.weight", lambda s: (s.num_experts, s.hidden_size)),
    (r"gate\.e_score_correction_bias", lambda s: (s.num_experts,)),
    (r"experts\.\d+\.(gate|up)_proj\.weight", lambda s: (s.moe_intermediate_size, s.hidden_size)),
    (r"experts\.\d+\.down_proj\.weight", lambda s: (s.hidden_size, s.moe_intermediate_size)),
    (r"shared_experts?\.(gate|up)_proj\.weight",
     lambda s: (s.shared_expert_intermediate_size, s.hidden_size)),
    (r"shared_experts?\.down_proj\.weight",
     lambda s: (s.hidden_size, s.shared_expert_intermediate_size)),
    (r"shared_expert_gate\.weight", lambda s: (1, s.hidden_size)),
    (r"(gate|up)_proj\.weight", lambda s: (s.dense_intermediate_size, s.hidden_size)),
    (r"down_proj\.weight", lambda s: (s.hidden_size, s.dense_intermediate_size)),
]


def mlp_checkpoint_shape(spec: ModelSpec, name: str) -> tuple[int, ...]:
    for pattern, shape in _MLP_SHAPES:
        if re.fullmatch(pattern, name):
            return shape(spec)
    raise KeyError(f"no known shape for MLP tensor {name!r}")


class DecoderLayer(nn.Module):
    """One layer, in the layout flow agreed with the MoE layer and the communicator:

        a = attention(input_norm(x))         partial sums over attn_tp
        a = comm.reduce_attn_output(a)       all-reduce, or reduce-scatter to this rank's rows
        r = comm.local_rows(x) + a
        y = mlp(post_norm(r))                MoELayer or DenseMLP, on this rank's rows
        x = comm.gather_rows(r + y)          back to the DP rank's tokens on every attn_tp rank
    """

    def __init__(self, spec: ModelSpec, layer_id: int, dtype: torch.dtype,
                 self_attn: DecoderAttention, mlp: nn.Module, comm: Any):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.mlp = mlp
        self.comm = comm

    def forward(self, positions_T: torch.Tensor, x_TH: torch.Tensor, fb: ForwardBatch,
                step: Any, residual: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(x, None), or (y, r) with x = r + y left unsummed when the rows need no gather:
        the next layer's input norm (or the final norm) adds them in its own launch; y may
        be a Pending sum (layers/pending.py) that this launch also does."""
        quant = None if residual is None else self._input_quant(residual)
        if residual is None:
            h = self.input_layernorm(x_TH)
        elif quant is None:  # x_TH may be a sum the block before left to this norm (pending.py)
            h, x_TH = add_norm(self.input_layernorm, x_TH, residual)
        else:  # the same, the norm's launch also quantizing h for the fp8 qkv_proj
            h, x_TH, done = add_norm_quantized(self.input_layernorm, x_TH, residual, quant)
            quant = quant if done else None
        a = (self.self_attn(positions_T, h, fb) if quant is None
             else self.self_attn(positions_T, h, fb, h_quant=quant))
        # r = local_rows(x) + the reduced a, and its norm: one launch on a GPU (with the
        # all-reduce where the one-shot window takes it)
        h, r = self.comm.reduce_attn_add_norm(a, x_TH, self.post_attention_layernorm, step)
        if self.comm.scattered:
            return self.comm.gather_rows(r + self.mlp(h, step), step), None
        # gather_rows is the identity here, and the block may leave its sum to the next norm
        return self.mlp(h, step, pending_ok=True), r

    def _input_quant(self, residual: torch.Tensor
                     ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Where the input norm's GPU launch may also quantize h for an fp8 qkv_proj (the
        attention's input_group; decode-sized steps, whose projections run the block GEMM;
        16-bit rows, fused.quant_args): fp8 [T, H] and float32 [T, H / group] for it; else
        None."""
        group = getattr(self.self_attn, "input_group", lambda: None)()
        t, hidden = residual.shape[0], residual.shape[-1]
        if (group is None or residual.device.type != "cuda" or not 0 < t < DECODE_GEMM_ROWS
                or hidden % group or residual.element_size() != 2):
            return None
        return empty_groups(t, hidden, group, residual.device)


# config.json's `architectures` name -> the model class (models/build.py imports them all)
ARCHITECTURES: Registry[type["MoECausalLM"]] = Registry("architecture")


def register_model(architecture: str) -> Callable[[type], type]:
    """Registers a model class under its Hugging Face architecture name, which the class
    keeps as `architecture`."""
    def register(cls: type) -> type:
        cls.architecture = architecture
        return ARCHITECTURES.register(architecture)(cls)
    return register


MLPFactory = Callable[[int], nn.Module]  # layer id -> MoELayer or DenseMLP
# comm_factory: layer id -> that layer's LayerCommunicator
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(\w+)\.(.+)")


class MoECausalLM(nn.Module):
    """embed -> decoder layers -> final norm -> LM head. Subclasses (one per architecture) set
    `attention_options` and, where their checkpoints name tensors differently, the renames."""

    architecture = ""

    def __init__(self, spec: ModelSpec, state: ParallelState, dtype: torch.dtype, *,
                 hf_config: dict[str, Any], backend: AttentionBackend, mlp_factory: MLPFactory,
                 comm_factory: Callable[[int], Any], quant: Optional[QuantSpec] = None):
        super().__init__()
        self.spec, self.state, self.dtype, self.quant = spec, state, dtype, quant
        # the one backend of every layer's attention (an architecture's factory may swap it)
        self.attention_backend = backend
        axis = state.attn_tp
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, axis=axis,
                                                   dtype=dtype)
        attention = self.attention_factory(hf_config, backend)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, dtype, attention(i), mlp_factory(i), comm_factory(i))
            for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, axis=axis, dtype=dtype,
                                      tied_to=self.embed_tokens if spec.tie_word_embeddings
                                      else None)

    @classmethod
    def attention_options(cls, spec: ModelSpec, hf_config: dict[str, Any]) -> AttentionOptions:
        raise NotImplementedError

    def attention_factory(self, hf_config: dict[str, Any], backend: AttentionBackend
                          ) -> Callable[[int], nn.Module]:
        """layer id -> that layer's attention block (DecoderAttention with this
        architecture's options). An architecture with another attention (DeepSeek's MLA)
        overrides this; the block must offer DecoderAttention's forward and weight methods."""
        spec = self.spec
        opts = self.attention_options(spec, hf_config)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling_dict,
                                      spec.max_position_embeddings)
        return lambda i: DecoderAttention(spec, self.state, i, self.dtype, opts, self.rotary,
                                          backend, self.attention_quant(i))

    def attention_quant(self, layer_id: int) -> QuantOf:
        """The quantization of layer `layer_id`'s attention projections, by name."""
        prefix = f"model.layers.{layer_id}.self_attn"
        return lambda *projs: Q.block_quant(type(self), self.quant, prefix, projs)

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """True for a checkpoint tensor the model deliberately does not load (the loader
        skips it instead of calling it unexpected)."""
        return False

    def bind_buffers(self, buffers: ModelBuffers) -> None:
        """Hand the plan's static buffers (runtime/buffers.py allocates them) to the layers
        that use them; before any forward that a CUDA graph captures."""
        self.attention_backend.bind_partials(buffers.attention)
        if buffers.fp8_gemm is not None:  # the fp8 projections' split-K GEMM launches
            ops = K.fp8(buffers.fp8_gemm.partials.device)
            if ops is not None:  # (a GPU plan bound on a CPU runs no such launch)
                ops.bind_workspace(buffers.fp8_gemm)
        for layer in self.layers:
            layer.comm.bind(buffers.gather, buffers.comm)
            layer.mlp.bind_buffers(buffers)

    # --- checkpoint naming --------------------------------------------------------------
    @classmethod
    def to_canonical(cls, name: str) -> str:
        """This architecture's checkpoint name -> the canonical (Qwen-MoE) name."""
        return name

    @classmethod
    def from_canonical(cls, name: str) -> str:
        """The canonical name -> this architecture's checkpoint name (for messages)."""
        return name

    # --- forward ------------------------------------------------------------------------
    def forward(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor, fb: ForwardBatch,
                step: Any, logits_out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [rows, V] in fp32: every token's with fb.return_all_logits, else each
        request's last new token's (written into `logits_out` when given)."""
        return self.logits(*self.hidden_states(input_ids_T, positions_T, fb, step), fb,
                           logits_out)

    def hidden_states(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor,
                      fb: ForwardBatch, step: Any
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The last layer's output, (x, None) or (y, r) with x = r + y left unsummed: the
        part of the forward that does not depend on which rows get logits (the prefill
        graphs of runtime/prefill_graph.py capture it)."""
        x_TH = self.embed_tokens(input_ids_T)
        residual = None
        for layer in self.layers:
            x_TH, residual = layer(positions_T, x_TH, fb, step, residual)
        # the final norm reads selected rows: a sum the last block left is done here
        return settle(x_TH), residual

    def logits(self, x_TH: torch.Tensor, residual: Optional[torch.Tensor],
               fb: ForwardBatch, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Final norm and LM head over the rows of `fb` that get logits (fp32), into `out`
        when given: one cast-copy from the LM head's model-dtype output (a decode graph's
        static logits; a float() and then a copy cost 185 us a step at batch 256, H200)."""
        rows = fb.logit_rows
        if rows is not None:
            x_TH = x_TH[rows]
            residual = None if residual is None else residual[rows]
        h = self.norm(x_TH) if residual is None else self.norm.add_forward(x_TH, residual)[0]
        if out is None:
            return self.lm_head(h).float()
        return out.copy_(self.lm_head(h))

    # --- weights (canonical names) ------------------------------------------------------
    def checkpoint_names(self) -> list[str]:
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.spec.tie_word_embeddings:
            names.append("lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            names += [p + "self_attn." + n for n in layer.self_attn.checkpoint_names()]
            names += [p + "mlp." + n for n in layer.mlp.checkpoint_names()]
        if self.quant is not None and self.quant.from_checkpoint:
            names += [Q.scale_of(n) for n in names if self.weight_quant(n) is not None]
        return names

    def weight_quant(self, name: str) -> Optional[QuantSpec]:
        """The quantization of canonical weight `name` (None: kept as the checkpoint has it)."""
        return Q.weight_quant(type(self), self.quant, name)

    def _route(self, name: str) -> tuple[Any, str, str]:
        """(module, name relative to it, kind) for a canonical name."""
        top = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm,
               "lm_head.weight": self.lm_head}
        if name in top:
            return top[name], "weight", "top"
        m = _LAYER_NAME.fullmatch(name)
        if m is None or int(m.group(1)) >= len(self.layers):
            raise KeyError(f"{self.architecture} has no checkpoint tensor {name!r}")
        layer = self.layers[int(m.group(1))]
        part, rest = m.group(2), m.group(3)
        if part in ("input_layernorm", "post_attention_layernorm") and rest == "weight":
            return getattr(layer, part), rest, "norm"
        if part in ("self_attn", "mlp"):
            return getattr(layer, part), rest, part
        raise KeyError(f"{self.architecture} has no checkpoint tensor {name!r}")

    def checkpoint_shape(self, name: str) -> tuple[int, ...]:
        if Q.is_scale(name):
            (n, k), q = self.checkpoint_shape(Q.weight_of(name)), self.quant
            return (-(-n // q.block_n), -(-k // q.block_k))
        module, rest, kind = self._route(name)
        s = self.spec
        if kind == "top":
            return (s.hidden_size,) if name == "model.norm.weight" else (s.vocab_size,
                                                                        s.hidden_size)
        if kind == "norm":
            return (s.hidden_size,)
        if kind == "self_attn":
            return module.checkpoint_shape(rest)
        return mlp_checkpoint_shape(s, rest)

    def needs(self, name: str) -> bool:
        if Q.is_scale(name):  # read with its weight
            return self.needs(Q.weight_of(name))
        module, rest, kind = self._route(name)
        return module.needs(rest) if kind == "mlp" else True

    def load_weight(self, name: str, src: Any) -> None:
        """`src`: the tensor or slice of `name`; an Fp8Source (weight and scale together) for
        a weight of an fp8 checkpoint."""
        if Q.is_scale(name):
            raise KeyError(f"{name} is read with {Q.weight_of(name)}, as one Fp8Source")
        module, rest, _ = self._route(name)
        module.load_weight(rest, src)
