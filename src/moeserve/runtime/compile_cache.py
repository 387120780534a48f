"""The persistent compile cache: one directory that outlives the process, for Triton's compiled
kernels (TRITON_CACHE_DIR) and torch inductor's (TORCHINDUCTOR_CACHE_DIR), so that a second
start of the same config on the same machine loads every kernel instead of compiling it.

`use_compile_cache` points both at the directory of --compile-cache-dir (default: moeserve/
compile under $XDG_CACHE_HOME, else ~/.cache). Every rank process calls it first thing, before
anything compiles (Triton reads its variable whenever it looks a kernel up, so setting it before
the first launch is enough); the engine's process sets it too, so that what it spawns inherits
it. The cache's keys hold the kernel source, its constexprs, the device and Triton's version,
so a shared directory is safe across configs and upgrades; deleting it costs one cold start.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from moeserve.config import EngineConfig

TRITON_ENV, INDUCTOR_ENV = "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"


def default_compile_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moeserve" / "compile"


def compile_cache_dir(cfg: EngineConfig) -> Path:
    if cfg.compile_cache_dir:
        return Path(cfg.compile_cache_dir).expanduser().resolve()
    return default_compile_cache_dir()


def use_compile_cache(cfg: EngineConfig) -> Path:
    """Create the cache's folders and point Triton and inductor at them in this process (and
    in the processes it starts from now on); returns the directory."""
    root = compile_cache_dir(cfg)
    try:
        for sub in ("triton", "inductor"):
            (root / sub).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--compile-cache-dir {root} cannot be created ({exc.strerror}); "
                         "give a writable folder") from None
    os.environ[TRITON_ENV] = str(root / "triton")
    os.environ[INDUCTOR_ENV] = str(root / "inductor")
    return root


def cached_kernels(root: Optional[Path]) -> int:
    """Kernels in the Triton cache at `root` (one folder per compiled kernel)."""
    folder = None if root is None else root / "triton"
    if folder is None or not folder.is_dir():
        return 0
    return sum(1 for p in folder.iterdir() if p.is_dir())
