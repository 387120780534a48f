"""`python -m benchmarks.masks` on the CPU at a small vocabulary: both forms of the schemas'
grammars walk the same tokens under the same masks, synthetic and tiktoken vocabularies alike;
the state walk's tables, and the states it names a document's points by."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("xgrammar")


def _masks(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "benchmarks.masks", "--rows", "16",
                           "--steps", "6", "--warmup", "2", "--docs", "2", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
def test_masks_of_both_forms_agree(tmp_path):
    proc = _masks("--vocab-size", "3000")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "masks of both forms equal: True" in proc.stdout
    assert "| engine (grammar.fast_form) |" in proc.stdout
    assert "fill ms/step (median) | mean | p90 | p99 | max |" in proc.stdout
    # the state walk: 2 documents of each of the 8 schemas, every one starting at "start"
    assert "| start | 16 |" in proc.stdout and "| string |" in proc.stdout
    assert "slowest 10 fills:" in proc.stdout
    # a tiktoken file: the bytes, then merges of them (one cut mid-character)
    tokens = [bytes([b]) for b in range(256)] + [b'",', b"ab", b" xyz", "中".encode()[:2], b'"}']
    path = tmp_path / "t.tiktoken"
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens)))
    proc = _masks("--tiktoken", str(path), "--vocab-size", "300")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{len(tokens) + 1} tokens of 300 ids" in proc.stdout


@pytest.mark.parametrize("text, state", [
    ("", "start"), ("{", "next key"), ('{"na', "key"), ('{"name"', "after key"),
    ('{"name": ', "value start"), ('{"name": "Ab', "string"), ('{"a": "x\\"}', "string"),
    ('{"a": "x\\\\"', "after value"), ('{"lat": -1', "number/literal"),
    ('{"ok": tr', "number/literal"), ('{"a": 1, ', "next key"), ('{"a": [', "next item"),
    ('{"a": [1, ', "next item"), ('{"a": ["x", "y', "string"), ('{"a": {"b": 1}', "after value"),
    ('{"a": [{"k": 1}, {"', "key"), ('{"a": "{\\"k\\": ', "string")])
def test_json_state_names_where_a_document_stands(text, state):
    from benchmarks.mask_states import json_state

    assert json_state(text) == state
