"""`moeserve plan` output: a readable report of the capacity plan (rich tables)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from moeserve.kernels.moe.configs import tiles_source
from moeserve.plan.capacity import CapacityPlan, local_gpu_name
from moeserve.plan.memory import GB

MIB = 1024 ** 2


def _graphs_line(sizes: tuple[int, ...]) -> str:
    if not sizes:
        return "(none)"
    if len(sizes) <= 12:
        return ", ".join(map(str, sizes))
    head = ", ".join(map(str, sizes[:8]))
    return f"{head}, ..., {sizes[-1]}  ({len(sizes)} sizes)"


def _tiles_line(plan: CapacityPlan) -> str:
    """Where the triton expert runner's tiles come from on this machine's GPU."""
    spec, layout = plan.spec, plan.layout
    assert layout is not None
    return tiles_source(spec.num_experts // layout.ep, spec.hidden_size,
                        spec.moe_intermediate_size // layout.moe_tp, plan.dtype,
                        local_gpu_name(plan.config), plan.expert_block)


def _comm_line(plan: CapacityPlan) -> str:
    """Where the all-reduces, all-gathers and reduce-scatters of a step run."""
    windows = [r.name.removeprefix("comm.symm.") for r in plan.buffers
               if r.name.startswith("comm.symm.")]
    most = plan.backends.symm_comm_max_bytes if plan.backends is not None else 0
    if windows:
        return (f"one-shot on symmetric memory up to {most / 1024:g} KiB (all ranks' rows) "
                f"over {', '.join(windows)}, NCCL above (--symm-comm-max-bytes)")
    if plan.layout is not None and plan.layout.tp == 1:
        return "none (one rank)"
    if most:
        return "none over attn_tp or the world (the all-to-all moves the tokens)"
    why = ("--symm-comm-max-bytes 0" if plan.backends is not None
           and plan.backends.device == "cuda" and plan.config.nnodes == 1
           else "not on the GPUs of one node")
    return f"NCCL (gloo on a CPU) at every size ({why})"


def print_plan(plan: CapacityPlan, console: Console | None = None) -> None:
    console = console or Console(width=160)
    spec, cfg = plan.spec, plan.config
    console.print(f"[bold]moeserve plan[/bold]: {spec.name} ({spec.architecture}), {plan.dtype}, "
                  f"{spec.num_experts} experts, top-{spec.top_k}")
    if plan.quant is not None:
        console.print(f"weights: {plan.quant.describe()}")
    if plan.layout is not None:
        console.print(f"layout: {plan.layout.describe()}")
    if plan.backends is not None:
        be = plan.backends
        graphs = "" if be.graph_blocker is None else f"; no CUDA graphs: {be.graph_blocker}"
        console.print(f"backends on {be.device}: attention {be.attention}, experts {be.experts} "
                      f"({plan.moe_runner_rows} rows at most){graphs}")
        if be.experts == "triton" and plan.layout is not None:
            console.print(f"MoE tiles: {_tiles_line(plan)}")
    if plan.budget is not None:
        b = plan.budget
        t = Table(title="token budget per forward, per DP rank")
        for col in ("mode", "max tokens (T)", "MoE tokens per rank (M)"):
            t.add_column(col, justify="right" if col != "mode" else "left")
        for mode, tokens in b.by_mode().items():
            t.add_row(mode, "-" if tokens is None else str(tokens),
                      "-" if tokens is None else str(plan.moe_tokens[mode]))
        console.print(t)
        console.print(f"limits: {b.max_running_requests} running requests per DP rank x "
                      f"{b.tokens_per_decode_request} tokens each; prefill chunk "
                      f"{b.chunk_tokens or 'off'}; context length {b.context_length}")
        if plan.a2a_cap is not None:
            transport = plan.backends.a2a if plan.backends else "all_to_all"
            symmetric = sum(r.bytes for r in plan.buffers
                            if r.symmetric and r.name.startswith("a2a."))
            console.print(f"all-to-all ({transport}): cap {plan.a2a_cap} tokens per rank, "
                          f"workspace {plan.a2a_workspace_bytes_per_rank / MIB:.1f} MiB per "
                          f"rank" + (f", {symmetric / MIB:.1f} MiB of it symmetric memory "
                                     "(the peers store into it)" if symmetric else ""))
        console.print(f"step collectives: {_comm_line(plan)}")
        console.print(f"decode graph batch sizes: {_graphs_line(b.decode_batch_sizes)}")
        console.print(f"prefill graph token sizes: {_graphs_line(b.prefill_token_sizes)}")
    if plan.buffers:
        t = Table(title="static buffers per rank")
        for col in ("buffer", "shape", "dtype", "MiB", "formula", "knobs"):
            t.add_column(col, justify="right" if col == "MiB" else "left")
        for r in plan.buffers:
            t.add_row(r.name, "x".join(map(str, r.shape)), r.dtype, f"{r.bytes / MIB:.1f}",
                      r.formula, " ".join(r.knobs[:2]) + (" ..." if len(r.knobs) > 2 else ""))
        console.print(t)
    if plan.memory is not None:
        m = plan.memory
        console.print(
            f"memory per rank: GPU {m.gpu_memory_bytes / GB:.1f} GB, static budget "
            f"{m.static_budget_bytes / GB:.1f} GB (--mem-fraction-static "
            f"{cfg.mem_fraction_static}); weights {m.weights_bytes_per_rank / GB:.2f} GB, "
            f"static buffers {m.static_buffer_bytes_per_rank / GB:.2f} GB, KV "
            f"{m.kv_bytes_per_token_per_rank} B/token -> {m.kv_capacity_tokens} tokens")
    if plan.kernels is not None:
        console.print(f"kernels on this machine: {plan.kernels.describe()}")
    if plan.errors:
        console.print(f"[bold red]{len(plan.errors)} error(s):[/bold red]")
        for e in plan.errors:
            console.print(f"  [red]x[/red] {e.message}\n    fix: {e.fix}")
    else:
        console.print("[green]plan ok[/green]")
