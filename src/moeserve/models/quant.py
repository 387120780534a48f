"""Which weights are quantized, by canonical checkpoint name, and the names of their scales.

The projections of attention (q, k, v, o; latent attention's q_a, q_b, kv_a, kv_b), of dense
MLPs and shared experts (gate, up, down) and of the routed experts are quantized; norms, the
router gate (and Qwen2-MoE's shared-expert gate), embeddings and the LM head stay as the
checkpoint has them, as do the modules its quantization_config lists in
modules_to_not_convert. A quantized weight `W.weight` of an fp8 checkpoint comes with
`W.weight_scale_inv`; the loader reads the two together (layers/weights.Fp8Source).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from moeserve.config.quant import QuantSpec

SCALE_SUFFIX = "_scale_inv"  # W.weight -> W.weight_scale_inv
QUANTIZED = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|"
    r"kv_a_proj_with_mqa|kv_b_proj)|mlp\.(experts\.\d+\.|shared_experts?\.)?"
    r"(gate_proj|up_proj|down_proj))\.weight")


def is_scale(name: str) -> bool:
    return name.endswith(".weight" + SCALE_SUFFIX)


def scale_of(weight: str) -> str:
    return weight + SCALE_SUFFIX


def weight_of(scale: str) -> str:
    return scale.removesuffix(SCALE_SUFFIX)


def weight_quant(model_cls: Any, quant: Optional[QuantSpec], name: str) -> Optional[QuantSpec]:
    """The quantization of canonical weight `name` in a model of `model_cls` (its
    from_canonical gives the checkpoint's module name that modules_to_not_convert matches)."""
    if quant is None or not QUANTIZED.fullmatch(name):
        return None
    module = model_cls.from_canonical(name).removesuffix(".weight")
    return quant if quant.converts(module) else None


def block_quant(model_cls: Any, quant: Optional[QuantSpec], prefix: str,
                projections: tuple[str, ...]) -> Optional[QuantSpec]:
    """The one quantization of a block's projections `prefix.{p}.weight` (a layer that keeps
    them in one weight or one runner quantizes all or none); an error when
    modules_to_not_convert names some of them only."""
    found = {p: weight_quant(model_cls, quant, f"{prefix}.{p}.weight") for p in projections}
    kinds = {q is None for q in found.values()}
    if len(kinds) > 1:
        kept = [p for p, q in found.items() if q is None]
        raise ValueError(f"modules_to_not_convert keeps {', '.join(kept)} of {prefix} in its "
                         f"dtype but not {', '.join(p for p in found if p not in kept)}; "
                         "moeserve quantizes these together: list all of them or none")
    return next(iter(found.values()))
