"""Where the layers reach the fused GPU kernels (layers/fused_kernels.py).

`fused(name, device)` returns the kernel wrapper `name` of fused_kernels for CUDA tensors, or
None (CPU tensors, Triton absent, or a kernel that failed to build here: then the layer keeps
its torch formulation, which computes the same function). Triton is imported on first use, so
CPU-only installs never import it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

log = logging.getLogger(__name__)
_broken: set[str] = set()
_module: Any = None
_wrappers: dict[str, Callable[..., Any]] = {}


def fused(name: str, device: torch.device) -> Optional[Callable[..., Any]]:
    global _module
    if device.type != "cuda" or name in _broken:
        return None
    if _module is None:
        try:
            from moeserve.layers import fused_kernels
        except ImportError as exc:  # no Triton: the torch formulation everywhere
            log.warning("fused GPU kernels unavailable (%s); using the torch layers", exc)
            _broken.update(("rms_norm", "rotary", "topk_softmax", "store_kv"))
            return None
        _module = fused_kernels
    if name in _wrappers:
        return _wrappers[name]
    fn = getattr(_module, name)

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
