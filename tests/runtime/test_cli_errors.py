"""Mistakes a user can fix end `moeserve` with one line that says what to change (exit code
2), not a traceback."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

SRC = Path(__file__).resolve().parents[2] / "src"


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(SRC)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    return subprocess.run([sys.executable, "-m", "moeserve.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _one_line_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    err = proc.stderr.strip()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in err and len(err.splitlines()) == 1, err[-3000:]
    assert err.startswith("moeserve: error: ")
    for w in words:
        assert w in err, err
    return err


@pytest.fixture(scope="module")
def weightless_checkpoint(tmp_path_factory):
    """A checkpoint folder with its config.json and no safetensors."""
    folder = tmp_path_factory.mktemp("weightless")
    cfg = transformers.MixtralConfig(hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=4, num_experts_per_tok=2,
                                     intermediate_size=16, vocab_size=96).to_dict()
    cfg["architectures"] = ["MixtralForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def test_a_model_path_that_does_not_exist(tmp_path):
    proc = _cli("generate", "--model", str(tmp_path / "nonexistent"), "--prompt", "hi")
    _one_line_error(proc, "not found", "preset:")


def test_no_model_and_no_dummy_weights():
    # --model defaults to the tiny preset, a shape without weights
    proc = _cli("generate", "--device", "cpu", "--prompt", "hi", "--max-new-tokens", "2")
    _one_line_error(proc, "--load-format dummy")


@pytest.mark.multiproc
@pytest.mark.parametrize("tp", ["1", "2"])
def test_a_checkpoint_without_weights(weightless_checkpoint, tp):
    proc = _cli("generate", "--model", weightless_checkpoint, "--device", "cpu", "--tp-size",
                tp, "--skip-tokenizer-init", "--input-ids", "1,2", "--max-new-tokens", "2")
    _one_line_error(proc, "no safetensors weights", weightless_checkpoint)


def test_a_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        proc = _cli("serve", "--load-format", "dummy", "--device", "cpu", "--port", port)
    _one_line_error(proc, f"--port {port}", "in use")


def test_unexpected_errors_keep_their_traceback(monkeypatch):
    from moeserve import cli

    def broken(args):
        raise KeyError("a bug of ours")

    monkeypatch.setattr(cli, "_plan", broken)  # build_parser reads it when main calls it
    with pytest.raises(KeyError, match="a bug of ours"):
        cli.main(["plan"])
