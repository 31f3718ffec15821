"""Time Open MPI's f32 sum all-reduce over sizes (the reference column of compare_mpi.sh).

mpirun -np 2 python3 scripts/mpi_allreduce.py 8 1024 4096 ...   -> one line per size on rank 0:
"<bytes> <microseconds per call>", the best of 3 rounds of a timed loop.
"""
import sys
import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
for nbytes in [int(a) for a in sys.argv[1:]]:
    n = max(nbytes // 4, 1)
    src, dst = np.ones(n, np.float32), np.zeros(n, np.float32)
    iters = max(10, min(20000, int(2e8 // max(nbytes, 1024))))
    best = float("inf")
    for _ in range(3):
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(iters):
            comm.Allreduce(src, dst, op=MPI.SUM)
        best = min(best, comm.allreduce((time.perf_counter() - t) / iters, op=MPI.MAX))
    assert dst[0] == comm.size
    if comm.rank == 0:
        print(nbytes, best * 1e6, flush=True)
