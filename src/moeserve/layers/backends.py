"""The attention backends, by name: GQA (layers/attention.py's registry: torch, and triton from
attention_triton.py) and latent attention (layers/mla.py's registry: torch, and triton from
mla_triton.py). The GPU backends import Triton only when they first launch a kernel."""

from __future__ import annotations

from moeserve.layers import attention_triton, mla_triton  # noqa: F401  (they register)
from moeserve.layers.attention import ATTENTION_BACKENDS, AttentionBackend
from moeserve.layers.mla import MLA_BACKENDS


def create_attention_backend(name: str = "torch") -> AttentionBackend:
    return ATTENTION_BACKENDS.get(name)()


def mla_backend_for(backend: AttentionBackend) -> AttentionBackend:
    """The MLA backend of the same name as `backend` (the one --attention-backend chose)."""
    name = ATTENTION_BACKENDS.name_of(type(backend))
    if name not in MLA_BACKENDS:
        raise ValueError(f"attention backend {name!r} has no MLA (DeepSeek) implementation; "
                         f"MLA backends: {', '.join(MLA_BACKENDS.names())}: pass "
                         "--attention-backend torch (or auto)")
    cls = MLA_BACKENDS.get(name)
    tiles = getattr(backend, "tiles", None)  # a triton backend's table serves its MLA too
    return cls() if tiles is None else cls(tiles)
