"""Block-scaled FP8: the quantizers and the W8A8 product in torch (reference.py, CPU and GPU,
the formulation the Triton kernels are tested against), and the Triton kernels (gemm.py: the
per-token-group activation quantizer and the block-scaled GEMM)."""
