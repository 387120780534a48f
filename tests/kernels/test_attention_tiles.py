"""The attention backend's measured choices (kernels/attention/tiles.py): every size finds its
tiles, SDPA's padded lengths and the decode splits keep their contracts, and the table is
immutable (CPU, no Triton)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, strategies as st

from moeserve.kernels.attention.tiles import ATTENTION_TILES as TL, AttentionTiles


def test_tile_tables_cover_every_size_in_ascending_bounds():
    for table in (TL.extend, TL.decode):
        bounds = [b for b, _ in table]
        assert bounds == sorted(bounds) and bounds[-1] >= 1 << 40
    assert TL.extend_tiles(1) == TL.extend[0][1]
    assert TL.extend_tiles(TL.extend[0][0] + 1) == TL.extend[1][1]
    assert TL.decode_tiles(1) == TL.decode[0][1]
    assert TL.decode_tiles(TL.decode[0][0] + 1) == TL.decode[1][1]
    assert TL.sdpa_min_extend % TL.sdpa_bucket == 0 and TL.sdpa_min_extend <= TL.sdpa_max_extend


@given(st.integers(1, 1 << 20))
def test_sdpa_pads_a_length_to_the_next_bucket(n):
    t = TL.sdpa_length(n)
    assert t % TL.sdpa_bucket == 0 and n <= t < n + TL.sdpa_bucket


@given(st.integers(1, 20000), st.integers(1, 40000))
def test_warm_up_lengths_are_every_padded_length_an_extend_can_take(low, high):
    lengths = TL.sdpa_warm_lengths(low, high)
    top = min(high, TL.sdpa_max_extend)
    takes = {TL.sdpa_length(n) for n in (low, top, (low + top) // 2) if low <= n <= top}
    assert takes <= set(lengths)
    assert lengths == sorted(set(lengths))
    assert all(x % TL.sdpa_bucket == 0 and x <= TL.sdpa_length(top) for x in lengths)
    assert not lengths or lengths[0] == TL.sdpa_length(low)
    assert (lengths == []) == (high < low or low > TL.sdpa_max_extend)


def test_mla_extend_rows_are_a_dot_of_16_or_more():
    for heads in (1, 3, 16, 20, 128):
        block_h, block_t, *_ = TL.mla_extend_tiles(heads)
        assert block_h * block_t == TL.mla_extend_rows >= 16 and block_h <= 16
        assert block_h >= min(heads, 16)


@given(st.integers(1, 4096), st.integers(1, 16), st.integers(1, 264),
       st.sampled_from([None, TL.gqa_whole_from, TL.mla_whole_from]))
def test_decode_splits_stay_in_range_and_fall_as_the_batch_grows(batch, kv_heads, sms, whole):
    splits = TL.decode_num_splits(batch, kv_heads, sms, whole)
    assert 1 <= splits <= TL.max_splits
    assert TL.decode_num_splits(batch + 1, kv_heads, sms, whole) <= splits
    # the kernels that write their output themselves take one split (and no combine) once
    # the batch's programs reach that share of the SMs
    assert (splits == 1) >= (whole is not None and batch * kv_heads >= whole * sms)
    assert splits <= TL.decode_num_splits(batch, kv_heads, sms)


def test_the_spy_records_each_call_and_keeps_the_result(monkeypatch):
    """tests/spies.py, which the GPU tests use to count graph replays and SDPA calls."""
    import spies

    class Runner:
        def replay(self, batch, size):
            return batch * size

    seen = spies.spy(monkeypatch, Runner, "replay", lambda self, batch, size: size)
    assert [Runner().replay(2, 3), Runner().replay(5, 7)] == [6, 35] and seen == [3, 7]
    seen_tiles = spies.spy(monkeypatch, AttentionTiles, "sdpa_length", lambda self, n: n)
    n = TL.sdpa_bucket + 1
    assert TL.sdpa_length(n) == 2 * TL.sdpa_bucket and seen_tiles == [n]


def test_the_table_is_immutable_and_a_replaced_one_is_a_new_table():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TL.max_splits = 1
    one = dataclasses.replace(TL, max_splits=1, sdpa_bucket=16)
    assert one.decode_num_splits(1, 1, 132) == 1 and one.sdpa_length(17) == 32
    assert TL.max_splits == AttentionTiles().max_splits and TL.sdpa_length(17) == TL.sdpa_bucket
