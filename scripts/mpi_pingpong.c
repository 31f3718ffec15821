/* Open MPI's point-to-point latency, as examples/ping_pong.rs measures tutti's: rank 0 sends
 * BYTES (default 8) to rank 1 with MPI_Send, which sends them back; half the median round trip
 * of ITERS (default 10000, after 1000 warm-up rounds), in microseconds, as one JSON line.
 *   mpicc -O2 -o target/mpi_pingpong scripts/mpi_pingpong.c
 *   mpirun --allow-run-as-root -np 2 --mca btl self,vader target/mpi_pingpong [BYTES [ITERS]] */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int rank, i;
    size_t bytes = argc > 1 ? strtoul(argv[1], NULL, 10) : 8;
    int iters = argc > 2 ? atoi(argv[2]) : 10000;
    char *buf;
    double *times;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (iters < 1) iters = 1;
    buf = calloc(bytes ? bytes : 1, 1);
    times = malloc(sizeof(double) * iters);
    for (i = -1000; i < iters; i++) {
        double t = MPI_Wtime();
        if (rank == 0) {
            MPI_Send(buf, (int)bytes, MPI_BYTE, 1, 0, MPI_COMM_WORLD);
            MPI_Recv(buf, (int)bytes, MPI_BYTE, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        } else {
            MPI_Recv(buf, (int)bytes, MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            MPI_Send(buf, (int)bytes, MPI_BYTE, 0, 0, MPI_COMM_WORLD);
        }
        if (i >= 0) times[i] = MPI_Wtime() - t;
    }
    qsort(times, iters, sizeof(double), cmp);
    if (rank == 0)
        printf("{\"bytes\": %zu, \"half_round_trip_us\": %.2f}\n", bytes, times[iters / 2] * 1e6 / 2);
    free(buf);
    free(times);
    MPI_Finalize();
    return 0;
}
