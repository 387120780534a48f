"""ForwardBatch.from_requests: the per-request lists reach the device in one copy that does
not wait for it, each field a view of it that starts on a 16-byte boundary (Triton specialises a
kernel on its pointers' alignment: a field one int64 off would compile another variant while
serving)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from moeserve.batch.forward_batch import ForwardBatch, ForwardMode

FIELDS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "extend_prefix_lens",
          "extend_seq_lens")


class _Pool:
    device = torch.device("cpu")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 7), st.integers(0, 9)), min_size=1, max_size=5),
       st.lists(st.integers(0, 30), max_size=3))
def test_fields_hold_the_lists_and_start_aligned(reqs, extra):
    new = [[100 * i + j for j in range(n)] for i, (n, _) in enumerate(reqs)]
    prefix = [p for _, p in reqs]
    rows = list(range(1, len(reqs) + 1))
    total = sum(n for n, _ in reqs)
    fb = ForwardBatch.from_requests(ForwardMode.EXTEND, new, prefix, rows,
                                    torch.arange(total), torch.zeros(8, 64, dtype=torch.int32),
                                    _Pool(), extra_logit_rows=extra)
    assert fb.input_ids.tolist() == [t for toks in new for t in toks]
    assert fb.positions.tolist() == [p + j for (n, p) in reqs for j in range(n)]
    assert fb.req_pool_indices.tolist() == rows
    assert fb.seq_lens.tolist() == [n + p for n, p in reqs]
    assert fb.extend_prefix_lens.tolist() == prefix
    assert fb.extend_seq_lens.tolist() == [n for n, _ in reqs]
    assert (fb.extra_logit_rows is None) == (not extra)
    if extra:
        assert fb.extra_logit_rows.tolist() == extra
    fields = [getattr(fb, f) for f in FIELDS] + ([fb.extra_logit_rows] if extra else [])
    for t in fields:
        assert t.dtype == torch.int64 and t.is_contiguous()
        assert t.data_ptr() % 16 == 0, t


def test_a_decode_batch_takes_one_token_a_request():
    with pytest.raises(ValueError, match="one new token per request"):
        ForwardBatch.from_requests(ForwardMode.DECODE, [[1, 2]], [3], [1], torch.arange(2),
                                   torch.zeros(4, 8, dtype=torch.int32), _Pool())
