"""CUDA graphs in tests: a call captured as the engine's graph runners capture it."""

from __future__ import annotations

from typing import Any, Callable

import torch


def captured(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, its output): fn() captured in a CUDA graph, after a call on a side stream
    (compiles and allocator warm-up stay out of the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
