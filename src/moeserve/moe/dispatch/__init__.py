"""MoE dispatchers behind one contract (base.py): local, gather, all_to_all."""

from moeserve.moe.dispatch import all_to_all, gather, local  # noqa: F401  (register them)
from moeserve.moe.dispatch.base import (DISPATCHERS, DispatchedTokens, Dispatcher,  # noqa: F401
                                        create_dispatcher, register_dispatcher)
