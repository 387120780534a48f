"""The one way to build a model, from the registry of architectures (models/decoder.py's
ARCHITECTURES, filled by importing every architecture's module here).

    model = build_model(cfg, spec, state, plan)   # empty weights on state.device
    load_weights(model, cfg)                      # safetensors, or --load-format dummy
    logits = model(input_ids, positions, forward_batch, step)

`architectures` in config.json picks the class; an architecture without an implementation is
an error that lists the implemented ones.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from moeserve.config import EngineConfig
from moeserve.layers.backends import create_attention_backend
from moeserve.models import deepseek_v2, mixtral, olmoe, qwen2_moe, qwen3_moe  # noqa: F401
from moeserve.models.decoder import ARCHITECTURES
from moeserve.models.loader import load_weights
from moeserve.models.quant import block_quant
from moeserve.config.spec import ModelSpec, ModelSpecError, load_hf_config
from moeserve.parallel.groups import ParallelState
from moeserve.plan.capacity import CapacityPlan

__all__ = ["build_model", "load_weights", "load_model", "model_class",
           "supported_architectures"]

def supported_architectures() -> tuple[str, ...]:
    return ARCHITECTURES.names()


def model_class(architecture: str) -> type:
    if architecture not in ARCHITECTURES:
        raise ModelSpecError(f"architecture {architecture!r} has no model implementation; "
                             f"moeserve implements: {', '.join(supported_architectures())}")
    return ARCHITECTURES.get(architecture)


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    return name if isinstance(name, torch.dtype) else getattr(torch, name)


def build_model(cfg: EngineConfig, spec: ModelSpec, state: ParallelState, plan: CapacityPlan,
                dtype: Optional[str | torch.dtype] = None, *,
                hf_config: Optional[dict[str, Any]] = None,
                attention_backend: Optional[str] = None, experts: Optional[str] = None
                ) -> torch.nn.Module:
    """The model of `spec` for this rank, its weights allocated on state.device but not
    loaded. `plan` is the CapacityPlan of `cfg` (the MoE layers size their buffers from it);
    dtype defaults to the plan's; hf_config (config.json, for the few architecture switches
    ModelSpec does not carry) defaults to the one of cfg.model; `experts` names the expert
    runner."""
    from moeserve.layers.mlp import DenseMLP
    from moeserve.moe.dispatch import create_dispatcher
    from moeserve.moe.layer import MoELayer
    from moeserve.layers.communicator import LayerCommunicator

    from moeserve.parallel.devices import resolve_backends

    auto_attention, auto_experts = resolve_backends(cfg, state.device)
    attention_backend = attention_backend or auto_attention
    experts = experts or auto_experts
    cls = model_class(spec.architecture)
    if plan.layout is None:
        raise ValueError("the capacity plan has errors: "
                         + "; ".join(str(e) for e in plan.errors))
    if plan.layout != state.layout:
        raise ValueError(f"the plan's layout ({plan.layout.describe()}) is not the process "
                         f"groups' layout ({state.layout.describe()})")
    dt = torch_dtype(dtype or plan.dtype)
    if hf_config is None:
        hf_config = load_hf_config(cfg.model)
    moe_layers = set(spec.moe_layers)
    dispatcher = None  # one for all MoE layers: they share the all-to-all workspace
    quant = plan.quant
    gated = ("gate_proj", "up_proj", "down_proj")

    def mlp_factory(layer_id: int) -> torch.nn.Module:
        nonlocal dispatcher
        mlp = f"model.layers.{layer_id}.mlp"
        if layer_id not in moe_layers:
            return DenseMLP(spec, state, dt, quant=block_quant(cls, quant, mlp, gated))
        if dispatcher is None:
            dispatcher = create_dispatcher(spec, state, plan, dt)
        shared = f"{mlp}.{spec.shared_expert_prefix}"
        routed = tuple(f"experts.{e}.{p}" for e in range(spec.num_experts) for p in gated)
        return MoELayer(spec, state, plan, dt, layer_id, experts=experts, dispatcher=dispatcher,
                        quant=block_quant(cls, quant, mlp, routed),
                        shared_quant=block_quant(cls, quant, shared, gated))

    def comm_factory(layer_id: int) -> LayerCommunicator:
        return LayerCommunicator(state, moe=layer_id in moe_layers)

    with torch.device(state.device):
        model = cls(spec, state, dt, hf_config=hf_config,
                    backend=create_attention_backend(attention_backend),
                    mlp_factory=mlp_factory, comm_factory=comm_factory, quant=quant)
    return model.eval()


def load_model(cfg: EngineConfig, spec: ModelSpec, state: ParallelState, plan: CapacityPlan,
               *, progress: Optional[bool] = None) -> torch.nn.Module:
    """build_model + load_weights."""
    model = build_model(cfg, spec, state, plan)
    load_weights(model, cfg, progress=progress)
    return model
