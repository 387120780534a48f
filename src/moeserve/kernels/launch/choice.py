"""Which kernels a rank runs: chosen once, at startup, from the device and the launch options.

On a CUDA device where Triton imports, the fused ops run as Triton kernels (one launch each
where the torch formulation takes several); on a CPU, or where Triton is missing, the layers
run their torch formulations, which compute the same functions. The engine selects a
`KernelSet` for its device when a rank starts (`install`), logs it, and `moeserve plan`
shows it. Nothing switches at run time: a kernel that fails raises, as any op does.

The layers reach the kernels through kernels/ops.py, which reads `kernels_for(x.device)`:
the installed set of that device, else the default selection (PDL on), which is what tests
and tools that build layers by hand get. Attention and the expert GEMMs are chosen with their
backends (`--attention-backend`, `--moe-runner-backend`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional

if TYPE_CHECKING:  # torch is imported where a device is asked about: `moeserve plan` on a
    import torch  # machine without a GPU never needs it

FAMILIES = ("elementwise", "router", "skinny", "mla", "fp8")  # the families kernels/ops.py hands out


@dataclass(frozen=True, kw_only=True)
class KernelSet:
    device: str  # the device the choice is for, e.g. "cuda:0" or "cpu"
    triton: bool  # the families run as Triton kernels (else their torch formulations)
    pdl: bool  # programmatic dependent launch between a decode step's kernels (sm90+)
    reason: str  # why, in words, for the log and the plan

    def describe(self) -> str:
        impl = "triton" if self.triton else "torch"
        pdl = ", PDL on" if self.pdl else ""
        return f"{self.device}: {', '.join(FAMILIES)} -> {impl}{pdl} ({self.reason})"


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton's own switch (TRITON_INTERPRET=1): its kernels run on CPU tensors, as the
    interpreter tests run them."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _pdl_supported(index: int) -> bool:
    """sm90+, and a CUDA that captures PDL launches into graphs (12.3+): the driver's version
    where torch exposes it, else the runtime's torch was built with."""
    import torch

    try:
        version = int(torch._C._cuda_getDriverVersion())
    except (AttributeError, RuntimeError, TypeError, ValueError):
        version = _as_int(torch.version.cuda)
    return torch.cuda.get_device_capability(index)[0] >= 9 and version >= 12030


def _as_int(cuda: Optional[str]) -> int:
    """"12.4" -> 12040, as the CUDA driver API numbers versions."""
    if not cuda:
        return 0
    major, minor = (cuda.split(".") + ["0"])[:2]
    return int(major) * 1000 + int(minor) * 10


def _index(device: "torch.device") -> int:
    import torch

    return device.index if device.index is not None else torch.cuda.current_device()


def select_kernels(device: "torch.device", *, pdl: bool = True) -> KernelSet:
    """The kernels for `device`; `pdl=False` (--disable-pdl) launches every kernel after the
    one before it has finished."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return KernelSet(device=str(device), triton=False, pdl=False,
                         reason=f"no Triton kernels on {device.type}")
    name = f"cuda:{_index(device)}"
    if not triton_installed():
        return KernelSet(device=name, triton=False, pdl=False, reason="triton is not installed")
    if not pdl:
        return KernelSet(device=name, triton=True, pdl=False, reason="PDL off (--disable-pdl)")
    on = _pdl_supported(_index(device))
    return KernelSet(device=name, triton=True, pdl=on,
                     reason="sm90+" if on else "PDL needs sm90+ and CUDA 12.3+")


_installed: dict[str, KernelSet] = {}


def install(kset: KernelSet) -> Optional[KernelSet]:
    """Make `kset` the choice for its device (a rank at startup); returns the one it replaces."""
    previous = _installed.get(kset.device)
    _installed[kset.device] = kset
    return previous


@contextlib.contextmanager
def use_kernels(kset: KernelSet) -> Iterator[KernelSet]:
    """`kset` for its device within the block (tests and benchmarks comparing choices)."""
    previous = install(kset)
    try:
        yield kset
    finally:
        if previous is None:
            _installed.pop(kset.device, None)
        else:
            _installed[kset.device] = previous


@functools.lru_cache(maxsize=None)
def _default(device: str) -> KernelSet:
    import torch

    return select_kernels(torch.device(device))


def kernels_for(device: "torch.device") -> KernelSet:
    if device.type != "cuda":
        return _default(device.type)
    name = f"cuda:{_index(device)}"
    return _installed.get(name) or _default(name)
