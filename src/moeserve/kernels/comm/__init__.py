"""One-shot collectives on symmetric memory (parallel/symm_comm.py runs them):

    one_shot.py   the all-gather (each rank stores its rows into every peer's window), the
                  all-reduce (each rank stores its tensor into a slot of every window, then
                  sums its own window's slots in fp32, in rank order) and the reduce-scatter
                  (each rank stages its rows in its own window, then sums the rows it keeps
                  from every window), each one launch, synchronising with the peers inside
    layout.py     their windows' and signal pads' sizes (no Triton: the plan uses them)

Imports Triton: parallel/symm_comm.py imports it lazily, on a GPU.
"""
