"""`python -m benchmarks outputs` end to end on the CPU, small: a row per client kind, every
request with the stand-in's tokens, and --profile's tables of the output thread and the
clients in the section."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks import outputs


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_rows_and_profile(tmp_path):
    args = SimpleNamespace(concurrency=[8], clients=["bench", "stream"], tokenizer=["on"],
                           batch=[4], output_len=6, waves=2, step_ms=[1.0], repeats=1,
                           profile=True, out=str(tmp_path), results=None)
    assert outputs.run(args, []) == 0
    text = (tmp_path / "outputs.md").read_text()
    assert text.startswith(f"## {outputs.TITLE}\n")
    assert "| bench | 8 | on | 4 | 1 | 8000 |" in text and "| stream | 8 | on | 4 | 1 |" in text
    # the output thread's table shows where a token's time goes: its text, its delivery
    assert "(_translate)" in text and "(_deliver)" in text
    rows = json.loads((tmp_path / "outputs.json").read_text())["rows"]
    assert [(r["output_tokens"], r["wrong"]) for r in rows] == [([8 * 2 * 6], 0)] * 2
