"""The "triton" paged attention kernels (kernels/attention/kernels.py) on the CPU under Triton's
interpreter, against the torch backend: the same cases as tests/layers/test_attention_gpu.py runs on
a GPU, in fp32 (extend after a prefix, then decode steps; paged and unpaged, GQA groups of 4
and 1, a sliding window; decode partials in planned buffers that clamp the splits)."""

from __future__ import annotations

import importlib.util

import pytest

from interpreter import run_interpreted

SCRIPT = r"""
import torch
from test_attention_gpu import run_case
cases = [(torch.float32, 16, 8, 2, 64, None, [20, 37], [10, 20]),
         # prefixes past a key block: the unmasked key blocks before the diagonal
         (torch.float32, 16, 8, 2, 64, None, [150, 9], [80, 1]),
         (torch.float32, 1, 4, 4, 32, 7, [9, 30], [4, 12]),
         # 5 requests x 2 KV heads fill the interpreter's 8 "SMs": one split, the decode
         # kernel writes the output itself (no combine)
         (torch.float32, 1, 8, 2, 32, None, [20, 37, 9, 15, 30], [10, 20, 4, 1, 25])]
from moeserve.kernels.attention.tiles import ATTENTION_TILES, clamp_splits
decode_num_splits = ATTENTION_TILES.decode_num_splits
assert decode_num_splits(5, 2, 8, 1.0) == 1 and decode_num_splits(2, 2, 8, 1.0) > 1
for case in cases:
    errors = run_case("cpu", *case)
    assert max(errors) < 1e-5, (case, errors)
# the decode partials from planned buffers (the model runner's): 2 requests x 2 KV heads on
# the interpreter's 8 "SMs" take 4 splits; 6 slots clamp them to 3, 1 slot to one split
assert decode_num_splits(2, 2, 8, ATTENTION_TILES.gqa_whole_from) == 4
assert clamp_splits(4, 2, 6) == 3 and clamp_splits(4, 2, 8) == 4 and clamp_splits(4, 2, 1) == 1
for slots, splits in ((6, 3), (8, 4), (1, 1)):
    o, lse = torch.full((slots, 8, 64), float("nan")), torch.full((slots, 8), float("nan"))
    errors = run_case("cpu", torch.float32, 16, 8, 2, 64, None, [20, 37], [10, 20],
                      partials=(o, lse))
    assert max(errors) < 1e-5, (slots, errors)
    # the steps wrote their partials there; one split writes the output itself, none
    assert o.isnan().all() == (splits == 1) and lse.isnan().all() == (splits == 1)
# the split decode's output also quantized for an fp8 o_proj: quantize_groups' bits
from test_attention_gpu import check_quantized_output
check_quantized_output("cpu", torch.float32)
print("interpreter ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_attention_under_the_interpreter():
    run_interpreted(SCRIPT)
