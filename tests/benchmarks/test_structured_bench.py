"""`python -m benchmarks structured` end to end on the CPU (tiny preset, its synthetic
vocabulary): the run's JSON and section, both modes at each concurrency, the output check; and
the synthetic vocabulary and schemas it relies on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

pytest.importorskip("xgrammar")


def _bench(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "benchmarks", *args, "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
def test_structured_runs_both_modes_and_writes_its_section(tmp_path):
    proc = _bench(tmp_path, "structured", "--model", "preset:tiny", "--device", "cpu",
                  "--concurrency", "2", "4", "--prompts-per-concurrency", "2",
                  "--input-len", "16", "--output-len", "20", "--context-length", "512",
                  "--max-total-tokens", "4096")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "structured.json").read_text())
    assert res["tokenizer_tokens"] == res["vocab_size"] == 512  # the full-size vocabulary
    control = "unconstrained, json_schema's lengths"
    assert [(r["concurrency"], r["mode"]) for r in res["rows"]] == [
        (c, m) for c in (2, 4) for m in ("unconstrained", "json_schema", control)]
    for r in res["rows"]:
        assert r["completed"] == r["num_prompts"] == 2 * r["concurrency"]
        assert r["output_tokens_per_s"] > 0 and r["ttft_ms_p50"] is not None
        assert 0 < r["output_tokens"] <= 20 * r["completed"]
        if r["mode"] != "json_schema":  # ignore_eos: every request runs to its cap
            assert r["finish_reasons"] == {"length": r["completed"]}
        if r["mode"] == "unconstrained":
            assert r["request_output_tokens"] == [20] * r["completed"]
    for constrained, same in zip(res["rows"][1::3], res["rows"][2::3]):
        # the control: each request capped at what its constrained run produced
        assert same["request_output_tokens"] == constrained["request_output_tokens"]
    chk = res["check"]
    assert chk["requests"] == chk["json_start"] == 8
    assert chk["valid"] == chk["ended"] and not chk["invalid"]
    md = (tmp_path / "structured.md").read_text()
    assert md.startswith("## Structured output") and "Command: `" in md
    assert "Constrained ÷ unconstrained output tok/s: " in md and "at concurrency 4" in md
    assert "Constrained ÷ the control (the same lengths unconstrained)" in md
    assert f"| 4 | {control} | 8 |" in md
    assert "mixed chunks off" in md


@pytest.mark.timeout(150)
def test_structured_runs_an_engine_with_mixed_chunks(tmp_path):
    proc = _bench(tmp_path, "structured", "--model", "preset:tiny", "--device", "cpu",
                  "--concurrency", "3", "--prompts-per-concurrency", "2", "--input-len", "16",
                  "--output-len", "12", "--context-length", "512", "--max-total-tokens", "4096",
                  "--enable-mixed-chunk")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "structured.json").read_text())
    assert res["args"]["enable_mixed_chunk"] is True
    assert all(r["completed"] == 6 for r in res["rows"]) and not res["problems"]
    assert "--enable-mixed-chunk (a prefill step carries" in (
        tmp_path / "structured.md").read_text()


def test_synthetic_vocabulary_fills_the_model_vocab(tmp_path):
    from moeserve.config.spec import load_model_spec
    from moeserve.runtime.tokenizer import load_tokenizer

    from benchmarks.vocab import EOS, bytes_to_unicode, synthetic_tokens, write_checkpoint

    tokens = synthetic_tokens(4096, seed=3)
    assert len(tokens) == len(set(tokens)) == 4095
    assert tokens[:256] == [bytes_to_unicode()[b] for b in range(256)]
    folder = write_checkpoint(tmp_path / "ckpt", "preset:tiny")
    spec = load_model_spec(str(folder))
    assert spec.vocab_size == load_model_spec("preset:tiny").vocab_size
    tok = load_tokenizer(str(folder), spec)
    assert tok.hf.get_vocab_size(with_added_tokens=True) == spec.vocab_size
    assert set(tok.eos_token_ids) == {spec.vocab_size - 1}
    assert tok.hf.id_to_token(spec.vocab_size - 1) == EOS
    # bytes round-trip through the byte-level decoder, multi-byte characters included
    text = "{\"a\": \"é 中\"}"
    ids = [tokens.index(bytes_to_unicode()[b]) for b in text.encode("utf-8")]
    assert tok.decode(ids) == text


def test_every_schema_compiles_and_its_closed_variant_is_bounded():
    from moeserve.runtime.grammar import GrammarSpec

    from benchmarks.schemas import SCHEMAS, closed

    def walk(s):
        if isinstance(s, dict):
            yield s
            for v in s.values():
                yield from walk(v)
        elif isinstance(s, list):
            for v in s:
                yield from walk(v)

    for schema in SCHEMAS:
        GrammarSpec.json_schema(schema).check()
        bounded = closed(schema)
        GrammarSpec.json_schema(bounded).check()
        for node in walk(bounded):
            if node.get("type") == "array":
                assert node["maxItems"] <= 4
            if node.get("type") == "string" and "pattern" not in node:
                assert node["maxLength"] <= 16
    # the open field the timed schemas end in is what closed() bounds
    assert any("maxLength" not in n for n in walk(SCHEMAS[0]) if n.get("type") == "string"
               and "pattern" not in n)


@pytest.mark.timeout(150)
def test_failed_requests_make_an_invalid_run_kept_out_of_results(tmp_path):
    results = tmp_path / "RESULTS.md"
    # prompts longer than the context: every request is refused
    proc = _bench(tmp_path, "structured", "--model", "preset:tiny", "--device", "cpu",
                  "--concurrency", "2", "--prompts-per-concurrency", "1", "--input-len", "200",
                  "--output-len", "4", "--context-length", "128", "--max-total-tokens", "2048",
                  "--results", str(results))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "structured.json").read_text())
    # the check, then the three runs
    assert res["check"]["errors"] and len(res["problems"]) == 4
    assert all(r["completed"] == 0 for r in res["rows"])
    assert "**Invalid run: " in (tmp_path / "structured.md").read_text()
    assert not results.exists()
