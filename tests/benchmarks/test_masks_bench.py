"""`python -m benchmarks.masks` on the CPU at a small vocabulary: both forms of the schemas'
grammars walk the same tokens under the same masks, synthetic and tiktoken vocabularies alike."""

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
                           "--steps", "6", "--warmup", "2", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
def test_masks_of_both_forms_agree(tmp_path):
    proc = _masks("--vocab-size", "3000")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "masks of both forms equal: True" in proc.stdout
    assert "| engine (grammar.fast_form) |" in proc.stdout
    # a tiktoken file: the bytes, then merges of them (one cut mid-character)
    tokens = [bytes([b]) for b in range(256)] + [b'",', b"ab", b" xyz", "中".encode()[:2], b'"}']
    path = tmp_path / "t.tiktoken"
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens)))
    proc = _masks("--tiktoken", str(path), "--vocab-size", "300")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{len(tokens) + 1} tokens of 300 ids" in proc.stdout
