"""Where the layers reach the fused GPU kernels (layers/fused_kernels.py, layers/skinny_gemm.py,
layers/mla_kernels.py, layers/router_kernels.py).

`fused(name, device)` returns the kernel wrapper `name` (one of KERNELS) for CUDA tensors, or
None (CPU tensors, Triton absent, or a kernel that failed to build here: then the layer keeps
its torch formulation, which computes the same function). Triton is imported on first use, so
CPU-only installs never import it.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Optional

import torch

log = logging.getLogger(__name__)
# kernel name -> the module (under moeserve.layers) that defines it
KERNELS = {"rms_norm": "fused_kernels", "add_rms_norm": "fused_kernels",
           "rotary": "fused_kernels", "topk_softmax": "router_kernels",
           "router_topk": "router_kernels",
           "store_kv": "fused_kernels", "act_and_mul": "fused_kernels",
           "shared_gate_add": "fused_kernels",
           "unpack_decode_inputs": "fused_kernels",
           "skinny_linear": "skinny_gemm", "mla_prep": "mla_kernels"}
_broken: set[str] = set()
_wrappers: dict[str, Callable[..., Any]] = {}


def fused(name: str, device: torch.device) -> Optional[Callable[..., Any]]:
    if device.type != "cuda" or name in _broken:
        return None
    if name in _wrappers:
        return _wrappers[name]
    try:
        module = importlib.import_module(f"moeserve.layers.{KERNELS[name]}")
    except ImportError as exc:  # no Triton: the torch formulation everywhere
        log.warning("fused GPU kernels unavailable (%s); using the torch layers", exc)
        _broken.update(KERNELS)
        return None
    fn = getattr(module, name)

    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # a build failure on this device: fall back, once, loudly
            if torch.cuda.is_current_stream_capturing():
                raise
            log.warning("fused kernel %s failed (%s: %s); using the torch formulation", name,
                        type(exc).__name__, exc)
            _broken.add(name)
            return None

    _wrappers[name] = guarded
    return guarded
