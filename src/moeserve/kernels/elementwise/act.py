"""The gated MLP activations of the expert kernels (codes passed as a constexpr)."""

import triton
import triton.language as tl

ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _act(g, ACT: tl.constexpr):
    if ACT == 0:
        out = g * tl.sigmoid(g)
    elif ACT == 1:
        out = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    else:  # tanh approximation, tanh(z) = 2 sigmoid(2z) - 1
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        out = g * tl.sigmoid(2.0 * inner)
    return out
