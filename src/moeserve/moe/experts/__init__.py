"""Expert runners behind one base class (base.py): reference (torch), grouped_mm
(torch._grouped_mm), triton (fused kernels; triton imported on first use)."""

from moeserve.moe.experts import grouped_mm, reference, triton_fused  # noqa: F401  (register)
from moeserve.moe.experts.base import (EXPERTS, Experts, create_experts,  # noqa: F401
                                       register_experts)
