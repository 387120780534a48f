"""Every Triton kernel of moeserve and its tile tables, one subpackage per op family:

    launch/       programmatic dependent launch (PDL) of a decode step's kernel chain
    attention/    paged GQA attention (extend, decode partials and combine) and its tiles
    mla/          latent attention (DeepSeek) over the paged latent cache, absorbed form
    moe/          expert align, fused expert GEMMs and decode GEMVs, router top-k, tile tables
    elementwise/  RMSNorm, add + RMSNorm, rope (+ KV store), act-and-mul, gated add, unpack
    skinny/       1-16 row projections, routers to 128 (FMA GEMV, tensor-core MMA), where they
                  beat cuBLAS

A leaf: kernels know tensors, pointers and tile tables, never the engine's config or its
layers. The subpackages import Triton; the tile tables (`*/tiles.py`, `moe/configs.py`,
`moe/align_torch.py`) do not, so that the planner runs on installs without Triton.
"""
