"""Collectives with explicit, uneven sizes (zero included) and the fixed-capacity all-to-all."""

from __future__ import annotations

import pytest
import torch

from collective_ranks import run_collectives
from moeserve.parallel import collectives as C
from moeserve.parallel.groups import Axis
from moeserve.testing.multiproc import run_ranks

SIZES = [[3, 1, 2], [0, 4, 1], [2, 2, 2], [0, 0, 5], [0, 0, 0], [1, 0, 0]]


@pytest.mark.multiproc
def test_uneven_gather_reduce_scatter_and_fixed_all_to_all_on_three_ranks():
    results = run_ranks(run_collectives, 3, SIZES, timeout=120)
    for rank, recs in enumerate(results):
        for rec in recs[: len(SIZES)]:
            sizes = SIZES[rec["case"]]
            assert rec["gather_ok"], (rank, sizes)
            assert rec["gather_shape"] == (sum(sizes), 3, 2)
            assert rec["rs_shape"] == (sizes[rank], 3, 2)
            assert rec["rs_err"] < 1e-12, (rank, sizes, rec["rs_err"])
        assert recs[len(SIZES)]["a2a_ok"], rank
        assert recs[len(SIZES) + 1]["value"] == 6.0


def test_single_rank_axis_is_the_identity():
    one = Axis(None, 0, 1, (0,))
    x = torch.randn(4, 5)
    assert C.all_gather_uneven(x, [4], one) is x
    assert C.reduce_scatter_uneven(x, [4], one) is x
    assert C.all_reduce(x, one) is x
    send = torch.randint(0, 255, (1, 3, 7), dtype=torch.uint8)
    recv = torch.zeros_like(send)
    C.all_to_all_fixed(recv, send, one)
    assert torch.equal(recv, send)


def test_sizes_that_do_not_match_the_rows_are_refused():
    one = Axis(None, 0, 1, (0,))
    with pytest.raises(ValueError, match="holds 4 rows"):
        C.all_gather_uneven(torch.randn(4, 2), [3], one)
    with pytest.raises(ValueError, match="one non-negative size per rank"):
        C.all_gather_uneven(torch.randn(4, 2), [4, 0], one)
    with pytest.raises(ValueError, match="input holds 4 rows where .* ask for 3"):
        C.reduce_scatter_uneven(torch.randn(4, 2), [3], one)
    with pytest.raises(ValueError, match="all-to-all blocks"):
        C.all_to_all_fixed(torch.empty(2, 3), torch.empty(1, 3), one)
