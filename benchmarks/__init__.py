"""moeserve's benchmarks: one tool, run from the repository root.

    PYTHONPATH=src python -m benchmarks SUBCOMMAND --out $OUT [--results benchmarks/RESULTS.md]

    e2e        a whole model on one GPU: decode steps against their floor, transformers'
               generate, `moeserve bench`                                  (e2e.py);
               with --quantization fp8 the FP8 engine's steps against their FP8 floor beside
               the bf16 engine's                                           (e2e_fp8.py)
    moe        the MoE layer against torch._grouped_mm and transformers' block (moe.py)
    attention  decode and extend attention, and the small kernels of a decode step
               (attention.py, step_kernels.py)
    mla        DeepSeek's latent attention, one layer and end to end (mla.py)
    a2a        the MoE all-to-all against NCCL all_to_all_single, several GPUs, one table
               per model (a2a.py; its plans and buffers in a2a_plans.py)
    collectives
               a step's all-reduce, all-gather and reduce-scatter, one-shot on symmetric
               memory against NCCL at decode and prefill sizes, and where NCCL starts to win
               (collectives.py)
    scaleout   `moeserve bench` by parallel layout against one GPU, several GPUs (scaleout.py)
    structured structured output (JSON schemas) against the same requests unconstrained
               (structured.py; its schemas in schemas.py, its vocabulary from vocab.py)
    coldstart  the first batches after a start against the same batches again, and a second
               start with the compile cache in place (coldstart.py)
    outputs    the engine process's output path (router, detokenizer, clients) without a
               model, on the CPU (outputs.py)
    masks      the grammars' token masks per step (fill and accept) without a model, on
               the CPU (masks.py)
    tune-moe   tune the fused MoE kernels' tiles into src/moeserve/kernels/moe/configs/
               (tune_moe.py)
    record     write sections from an --out folder into RESULTS.md (record.py)

Every benchmark but outputs and masks (host work, on any CPU) measures on the GPU, in one
run, moeserve, its baseline and the device's ceilings, all through harness.py; it writes
NAME.json (every number) and NAME.md (its RESULTS.md section) into --out, and with --results
replaces its section in RESULTS.md.
engine_steps.py holds the timed steps of a running engine that e2e and mla share.
"""
