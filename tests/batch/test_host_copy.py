"""host_copy.to_device: the values arrive, and on a GPU the copy is queued behind the work in
flight instead of waiting for it (a pageable copy past 64 KiB would wait: a prefill's ids and
positions, or its slots, are that large)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.batch.host_copy import to_device
from moeserve.batch.kv_cache import ReqToTokenPool


def test_values_arrive_with_their_dtype():
    rng = np.random.default_rng(0)
    for dtype in (np.int64, np.int32):
        a = rng.integers(-2 ** 30, 2 ** 30, size=(3, 257)).astype(dtype)
        got = to_device(a[:, ::2], "cpu")  # a strided view: copied contiguous
        assert got.dtype == torch.from_numpy(a).dtype and got.tolist() == a[:, ::2].tolist()


def test_write_packed_sets_each_row_and_position():
    pool = ReqToTokenPool(5, 32)
    rng = np.random.default_rng(1)
    rows, pos = rng.integers(1, 5, 40), rng.permutation(32)[:20].repeat(2)
    keep = {(r, p): i for i, (r, p) in enumerate(zip(rows, pos))}  # the last write wins
    rows, pos = np.array([k[0] for k in keep]), np.array([k[1] for k in keep])
    slots = rng.integers(1, 10 ** 6, len(rows))
    out = pool.write_packed(np.stack((rows, pos, slots)))
    assert out.tolist() == slots.tolist()
    for r, p, s in zip(rows, pos, slots):
        assert int(pool.table[r, p]) == s


@pytest.mark.gpu
def test_a_large_copy_does_not_wait_for_the_device():
    a = np.arange(1 << 20, dtype=np.int64)  # 8 MiB
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 30)  # ~0.5 s of device work queued first
    got = to_device(a, torch.device("cuda"))
    assert not torch.cuda.current_stream().query()  # the host did not wait for the sleep
    assert torch.equal(got.cpu(), torch.from_numpy(a))
