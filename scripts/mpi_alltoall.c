/* Time Open MPI's MPI_Alltoall of f32 over sizes (the reference column of
 * scripts/compare_mpi_alltoall.sh).
 *
 *   mpicc -O2 -o target/mpi_alltoall scripts/mpi_alltoall.c
 *   mpirun -np 2 target/mpi_alltoall 65536 1048576 ...
 *
 * A size is each rank's input in bytes, as `tutti perf -c all-to-all` counts it (rank i's
 * block j, size / P bytes, goes to rank j). One line per size on rank 0: "<bytes> <microseconds
 * per call>", the best of 3 rounds of a timed loop (the slowest rank's mean). The first call's
 * output is checked: block k must be rank k's block for this rank. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, p;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &p);
    for (int a = 1; a < argc; a++) {
        long bytes = atol(argv[a]);
        long block = bytes / 4 / p;
        if (block < 1) block = 1;
        long n = block * p;
        float *src = malloc(n * sizeof(float)), *dst = malloc(n * sizeof(float));
        if (!src || !dst) MPI_Abort(MPI_COMM_WORLD, 2);
        for (long i = 0; i < n; i++) src[i] = (float)(rank * 1000 + (i / block) * 10 + i % 7);
        MPI_Alltoall(src, (int)block, MPI_FLOAT, dst, (int)block, MPI_FLOAT, MPI_COMM_WORLD);
        for (long i = 0; i < n; i++) {
            long k = i / block;
            if (dst[i] != (float)(k * 1000 + rank * 10 + (rank * block + i % block) % 7)) {
                fprintf(stderr, "rank %d: element %ld is wrong\n", rank, i);
                MPI_Abort(MPI_COMM_WORLD, 1);
            }
        }
        long iters = (long)(2e8 / (bytes > 1024 ? bytes : 1024));
        if (iters < 10) iters = 10;
        if (iters > 20000) iters = 20000;
        double best = 1e30;
        for (int round = 0; round < 3; round++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double t = MPI_Wtime();
            for (long it = 0; it < iters; it++)
                MPI_Alltoall(src, (int)block, MPI_FLOAT, dst, (int)block, MPI_FLOAT,
                             MPI_COMM_WORLD);
            double mine = (MPI_Wtime() - t) / iters, slowest;
            MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (slowest < best) best = slowest;
        }
        if (rank == 0) printf("%ld %.3f\n", n * 4, best * 1e6), fflush(stdout);
        free(src);
        free(dst);
    }
    MPI_Finalize();
    return 0;
}
