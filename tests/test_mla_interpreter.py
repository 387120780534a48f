"""The "triton" latent attention kernels (layers/mla_kernels.py) on the CPU under Triton's
interpreter, against the torch MLA backend, in fp32: the cases of tests/test_mla_gpu.py
(prompts, a chunk after a prefix, decode steps; paged and not; heads below and past one
program's 16, rope dims below a tl.dot's 16), and the prep kernel (latent norm, rope, cache
store) against MLAttention's torch formulation."""

from __future__ import annotations

import importlib.util

import pytest

from interpreter import run_interpreted

SCRIPT = r"""
import torch
from test_mla_gpu import run_case
cases = [(torch.float32, 16, (4, 16, 8, 8, 8), [20, 37], [10, 20]),
         # prefixes past a key block: the unmasked key blocks before the diagonal; 20 heads
         (torch.float32, 1, (20, 32, 4, 8, 12), [90, 9], [70, 1])]
for case in cases:
    errors = run_case("cpu", *case)
    assert max(errors) < 1e-5, (case, errors)
from test_mla_gpu import prep_errors
for interleaved in (True, False):
    errors = prep_errors("cpu", torch.float32, interleaved)
    assert max(errors) < 1e-6, (interleaved, errors)
print("interpreter ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_mla_under_the_interpreter():
    run_interpreted(SCRIPT)
