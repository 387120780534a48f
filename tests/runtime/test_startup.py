"""How ranks start: torch threads per CPU rank, an unguarded script that fails in seconds with
the fix, and the README's guarded example."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moeserve.cli import build_parser
from moeserve.config import EngineConfig, config_errors, config_from_args
from moeserve.runtime.engine import Engine
from moeserve.runtime.worker import available_cores, torch_threads_for_rank

SRC = Path(__file__).resolve().parents[2] / "src"


def _python(script: Path, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    """Run a script with this checkout's moeserve; returns the process and its seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(SRC)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=script.parent)
    return proc, time.monotonic() - start


def test_cpu_ranks_share_the_cores_of_their_node():
    cpu = dict(device="cpu")
    assert torch_threads_for_rank(EngineConfig(tp_size=2, **cpu), "cpu", cores=2) == 1
    assert torch_threads_for_rank(EngineConfig(tp_size=4, **cpu), "cpu", cores=16) == 4
    assert torch_threads_for_rank(EngineConfig(tp_size=4, **cpu), "cpu", cores=7) == 1
    assert torch_threads_for_rank(EngineConfig(tp_size=4, **cpu), "cpu", cores=3) == 1
    assert torch_threads_for_rank(EngineConfig(tp_size=1, **cpu), "cpu", cores=6) == 6
    # two nodes: each runs tp/nnodes ranks on its own cores
    two = EngineConfig(tp_size=4, nnodes=2, dist_init_addr="h:1", **cpu)
    assert torch_threads_for_rank(two, "cpu", cores=8) == 4
    # the flag wins on either device; a GPU rank keeps torch's default without it
    assert torch_threads_for_rank(EngineConfig(tp_size=2, cpu_threads_per_rank=3), "cpu",
                                  cores=2) == 3
    assert torch_threads_for_rank(EngineConfig(tp_size=2, cpu_threads_per_rank=3), "cuda",
                                  cores=64) == 3
    assert torch_threads_for_rank(EngineConfig(tp_size=2), "cuda", cores=64) is None
    assert available_cores() == len(os.sched_getaffinity(0))


def test_threads_flag_is_parsed_and_checked():
    args = build_parser().parse_args(["plan", "--cpu-threads-per-rank", "2"])
    assert config_from_args(args).cpu_threads_per_rank == 2
    assert config_from_args(build_parser().parse_args(["plan"])).cpu_threads_per_rank is None
    assert any("--cpu-threads-per-rank" in m
               for m, _ in config_errors(EngineConfig(cpu_threads_per_rank=0)))


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_spawned_ranks_run_with_the_threads_asked_for():
    with Engine("preset:tiny", load_format="dummy", device="cpu", tp_size=2,
                max_total_tokens=2048, cpu_threads_per_rank=3) as engine:
        assert engine.torch_threads == {0: 3, 1: 3}
        assert engine.generate(input_ids=[1, 2, 3],
                               sampling_params={"max_new_tokens": 2})["error"] is None


README_EXAMPLE = """\
from moeserve import Engine

if __name__ == "__main__":
    with Engine("preset:tiny", load_format="dummy", tp_size=2, ep_size=2) as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
        print(out["text"])
        print("threads", engine.torch_threads)
"""


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_unguarded_script_fails_in_seconds_with_the_fix(tmp_path):
    unguarded = tmp_path / "unguarded.py"
    body = README_EXAMPLE.split('if __name__ == "__main__":\n')[1]
    unguarded.write_text("from moeserve import Engine\n\n" + textwrap.dedent(body))
    proc, seconds = _python(unguarded, timeout=60)
    assert proc.returncode != 0
    assert seconds < 45, f"took {seconds:.0f} s"
    assert 'if __name__ == "__main__":' in proc.stderr, proc.stderr[-3000:]
    assert "__mp_main__" in proc.stderr
    # the README's example, with its guard, runs; its ranks share this machine's cores
    guarded = tmp_path / "guarded.py"
    guarded.write_text(README_EXAMPLE)
    proc, _ = _python(guarded, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    share = max(1, available_cores() // 2)
    assert f"threads {{0: {share}, 1: {share}}}" in proc.stdout
