"""Expert runners behind one base class (base.py): reference (torch)."""

from moeserve.moe.experts import reference  # noqa: F401  (registers it)
from moeserve.moe.experts.base import (EXPERTS, Experts, create_experts,  # noqa: F401
                                       register_experts)
