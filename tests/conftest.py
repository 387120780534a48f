"""What every test shares: the `gpu` marker and its skip, and this folder on sys.path for
the helper modules (moe_cases, attention_cases, spies, ...) that tests and the ranks they
spawn import.

    @pytest.mark.gpu        needs a CUDA GPU
    @pytest.mark.gpu(2)     needs 2 CUDA GPUs
    @pytest.mark.slow       minutes long, skipped unless asked for (the soak: MOESERVE_SOAK=1)

`python -m pytest -q -m gpu` runs the GPU tests on a GPU machine; elsewhere they are skipped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu(n=1): needs n CUDA GPUs (skipped with fewer)")
    config.addinivalue_line("markers", "multiproc: spawns gloo processes")
    config.addinivalue_line("markers", "slow: minutes long, run on request (MOESERVE_SOAK=1)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        need = marker.args[0] if marker.args else marker.kwargs.get("n", 1)
        if have < need:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {need} CUDA GPU{'s' if need > 1 else ''}, this machine has {have}"))
