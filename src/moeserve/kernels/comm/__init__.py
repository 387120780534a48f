"""One-shot collectives on symmetric memory (parallel/symm_comm.py runs them):

    one_shot.py   the all-gather (each rank stores its rows into every peer's window) and the
                  reduction (each rank stages its rows in its own window, then sums the rows it
                  keeps from every window in fp32, in rank order), each one launch with the
                  peers' barriers inside it

Imports Triton: parallel/symm_comm.py imports it lazily, on a GPU.
"""
