"""The attention backend's measured choices (layers/attention_tiles.py): every size finds its
tiles, SDPA's padded lengths and the decode splits keep their contracts (CPU, no Triton)."""

from __future__ import annotations

from hypothesis import given, strategies as st

from moeserve.layers import attention_tiles as TL


def test_tile_tables_cover_every_size_in_ascending_bounds():
    for table in (TL.EXTEND_TILES, TL.DECODE_TILES):
        bounds = [b for b, _ in table]
        assert bounds == sorted(bounds) and bounds[-1] >= 1 << 40
    assert TL.extend_tiles(1) == TL.EXTEND_TILES[0][1]
    assert TL.extend_tiles(TL.EXTEND_TILES[0][0] + 1) == TL.EXTEND_TILES[1][1]
    assert TL.decode_tiles(1) == TL.DECODE_TILES[0][1]
    assert TL.decode_tiles(TL.DECODE_TILES[0][0] + 1) == TL.DECODE_TILES[1][1]
    assert TL.SDPA_MIN_EXTEND % TL.SDPA_BUCKET == 0 and TL.SDPA_MIN_EXTEND <= TL.SDPA_MAX_EXTEND


@given(st.integers(1, 1 << 20))
def test_sdpa_pads_a_length_to_the_next_bucket(n):
    t = TL.sdpa_length(n)
    assert t % TL.SDPA_BUCKET == 0 and n <= t < n + TL.SDPA_BUCKET


@given(st.integers(1, 4096), st.integers(1, 16), st.integers(1, 264))
def test_decode_splits_stay_in_range_and_fall_as_the_batch_grows(batch, kv_heads, sms):
    splits = TL.decode_num_splits(batch, kv_heads, sms)
    assert 1 <= splits <= TL.MAX_SPLITS
    assert TL.decode_num_splits(batch + 1, kv_heads, sms) <= splits


def test_the_spy_records_each_call_and_keeps_the_result(monkeypatch):
    """tests/spies.py, which the GPU tests use to count graph replays and SDPA calls."""
    import spies

    class Runner:
        def replay(self, batch, size):
            return batch * size

    seen = spies.spy(monkeypatch, Runner, "replay", lambda self, batch, size: size)
    assert [Runner().replay(2, 3), Runner().replay(5, 7)] == [6, 35] and seen == [3, 7]
    seen_tiles = spies.spy(monkeypatch, TL, "sdpa_length", lambda n: n)
    n = TL.SDPA_BUCKET + 1
    assert TL.sdpa_length(n) == 2 * TL.SDPA_BUCKET and seen_tiles == [n]
