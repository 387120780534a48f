"""GPU kernels of the MoE experts (Triton) and their pure-torch counterparts.

    align_torch.py   moe_align in plain torch (CPU or GPU): the reference of align.py's output
    align.py         moe_align in Triton: (token, k) pairs grouped by local expert, BLOCK_M-aligned
    fused_moe.py     grouped GEMMs: gate_up with act-and-mul fused, down with the top-k weight,
                     the sum over top-k (weight tiles by pointer loads or TMA)
    decode_moe.py    a few rows: two GEMV launches, no align, the top-k sum in registers
    fused_moe_fp8.py, decode_moe_fp8.py, fp8_tiles.py
                     the same with block-scaled fp8 weights (W8A8): the input quantized once,
                     gate_up's epilogue writing fp8 with its group scales for down
    router.py        the router's top-k kernels (softmax top-k; logits GEMM + top-k in one launch)
    down_ws.py       the down GEMM as a warp-specialised Gluon kernel (sm90)
    configs.py       tile configs: tuned JSON in configs/, else defaults (no triton needed)

Only align_torch and configs import without triton; the Triton modules are imported lazily by
the runner (moe/experts/triton_fused.py), so `import moeserve` never needs triton.
"""
