"""Run a test script with Triton's interpreter (TRITON_INTERPRET=1: the kernels on the CPU, with
numpy semantics) in a subprocess, so that the flag never leaks into the other tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# triton 3.6's interpreter calls int() on 1-element arrays, which numpy >= 2.3 refuses
PRELUDE = r"""
import triton.runtime.interpreter as ti
if hasattr(ti, "_patch_lang_tensor"):
    _orig = ti._patch_lang_tensor
    def _patched(tensor, scope):
        _orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    ti._patch_lang_tensor = _patched
"""


def run_interpreted(script: str, timeout: float = 280) -> None:
    """Run PRELUDE + script; it must print "interpreter ok" and exit 0."""
    tests = Path(__file__).resolve().parent
    # the scripts import test modules of any package folder, as pytest's own sys.path has them
    paths = [tests.parent / "src", tests] + sorted(p for p in tests.iterdir() if p.is_dir()
                                                   and p.name != "__pycache__")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(str(p) for p in paths)}
    proc = subprocess.run([sys.executable, "-c", PRELUDE + script], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and "interpreter ok" in proc.stdout, proc.stderr[-4000:]
