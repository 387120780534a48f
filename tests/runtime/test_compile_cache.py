"""The persistent compile cache's plumbing (the directory, Triton's and inductor's variables in
the engine and in every spawned rank) and the startup phases' log."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from moeserve.cli import build_parser
from moeserve.config import EngineConfig, config_from_args
from moeserve.runtime.compile_cache import (INDUCTOR_ENV, TRITON_ENV, cached_kernels,
                                            compile_cache_dir, default_compile_cache_dir,
                                            use_compile_cache)
from moeserve.runtime.engine import Engine
from moeserve.runtime.startup import PHASES, StartupClock, summary_line

TINY = dict(load_format="dummy", device="cpu", max_total_tokens=2048, context_length=128)


@pytest.fixture(autouse=True)
def _keep_env():
    saved = {k: os.environ.get(k) for k in (TRITON_ENV, INDUCTOR_ENV)}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_default_is_under_the_users_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_compile_cache_dir() == tmp_path / "xdg" / "moeserve" / "compile"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_compile_cache_dir() == tmp_path / "home" / ".cache" / "moeserve" / "compile"
    assert compile_cache_dir(EngineConfig()) == default_compile_cache_dir()
    assert compile_cache_dir(EngineConfig(compile_cache_dir=str(tmp_path / "c"))) == \
        tmp_path / "c"


def test_the_flag_is_generated_from_the_config():
    args = build_parser().parse_args(["serve", "--compile-cache-dir", "/srv/kernels"])
    assert config_from_args(args).compile_cache_dir == "/srv/kernels"
    assert config_from_args(build_parser().parse_args(["plan"])).compile_cache_dir is None


def test_triton_compiles_into_the_folder(tmp_path):
    root = use_compile_cache(EngineConfig(compile_cache_dir=str(tmp_path / "cc")))
    assert root == tmp_path / "cc"
    assert os.environ[TRITON_ENV] == str(root / "triton")
    assert os.environ[INDUCTOR_ENV] == str(root / "inductor")
    assert (root / "triton").is_dir() and (root / "inductor").is_dir()
    cache = pytest.importorskip("triton.runtime.cache")
    manager = cache.get_cache_manager("a" * 64)  # where Triton would put a compiled kernel
    assert Path(manager.cache_dir).parent == root / "triton"
    assert cached_kernels(root) == 1  # the manager made its kernel's folder
    assert cached_kernels(tmp_path / "none") == 0


def test_a_folder_that_cannot_be_made_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="--compile-cache-dir .* cannot be created"):
        use_compile_cache(EngineConfig(compile_cache_dir=str(tmp_path / "file" / "sub")))


def test_the_clock_reports_each_phase_as_it_ends():
    seen = []
    clock = StartupClock(lambda *a: seen.append(a))
    for name in PHASES:
        with clock.phase(name) as note:
            note["detail"] = name.upper()
    assert [s[0] for s in seen] == list(PHASES) and [s[2] for s in seen] == \
        [p.upper() for p in PHASES]
    assert all(s[1] >= 0 for s in seen)
    with pytest.raises(ValueError, match="unknown startup phase"):
        with clock.phase("coffee"):
            pass
    line = summary_line(3.0, {0: {"weights": 1.0}, 1: {"weights": 2.0}}, 0, "/c")
    assert "weights 2.0 s" in line and "slowest of 2 ranks" in line
    assert "compile cache /c: 0 kernels compiled" in line


def test_an_engine_logs_one_line_per_phase_and_a_summary(caplog, tmp_path):
    with caplog.at_level(logging.INFO, logger="moeserve.runtime.engine"):
        with Engine("preset:tiny", compile_cache_dir=str(tmp_path / "cc"), **TINY) as engine:
            assert engine.ready
    lines = [r.getMessage() for r in caplog.records if r.name == "moeserve.runtime.engine"]
    phases = [m for m in lines if m.startswith("startup: ") and "(rank 0)" in m]
    names = [m.removeprefix("startup: ").split(" s (rank 0)")[0].rsplit(" ", 1)[0]
             for m in phases]
    assert names == list(PHASES)
    assert len(phases) == len(PHASES)
    summary = [m for m in lines if m.startswith("startup: ready in")]
    assert len(summary) == 1 and all(f"{p} " in summary[0] for p in PHASES)
    assert f"compile cache {tmp_path / 'cc'}: 0 kernels compiled" in summary[0]
    assert "warm-up not run: the engine runs on cpu" in phases[2]
    assert set(engine.startup[0]) == set(PHASES)


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_spawned_ranks_use_the_cache_and_report_their_phases(tmp_path):
    root = tmp_path / "cc"
    with Engine("preset:tiny", tp_size=2, compile_cache_dir=str(root), wait=False,
                **TINY) as engine:
        engine.wait_ready()
        assert engine.ready
        for rank in (0, 1):
            info = engine.rank_info[rank]
            assert info["compile_cache"] == str(root)
            assert info["triton_cache_dir"] == str(root / "triton")
            assert set(engine.startup[rank]) == set(PHASES)
        out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        assert len(out["token_ids"]) == 2
