/* Communicators of separate processes: forked ranks join through tutti_comm_create_rank (TCP and
 * shared memory) and tutti_comm_create_from_env, run collectives with checked values (in
 * tutti_mem_alloc memory too), and a rank that leaves makes its peers fail (not hang). */
#include "check.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define WORLD 3

static void unset_launcher_env(void) {
    const char *vars[] = {"TUTTI_RANK", "TUTTI_WORLD_SIZE", "TUTTI_MASTER_ADDR", "TF_CONFIG",
                          "RANK",       "WORLD_SIZE",       "OMPI_COMM_WORLD_RANK",
                          "SLURM_PROCID", "TUTTI_TRANSPORT"};
    size_t i;
    for (i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        unsetenv(vars[i]);
    }
}

typedef enum how { BY_RANK_TCP, BY_RANK_SHM, FROM_ENV, PEER_LEAVES } how;

/* Shared memory from tutti_mem_alloc: over shared memory the collectives run `direct` between
 * the processes (forced here, so that a fallback would be an error); over TCP there is none. */
static void shared_work(tutti_comm *comm, size_t rank, how h) {
    /* 512 KiB of f32: large enough to run through shared memory, even where the ranks
       outnumber the cores (from 64 KiB where each has one) */
    enum { N = 131072 };
    float *in = NULL, *out = NULL, stray = 0.0f;
    size_t i;
    if (h == BY_RANK_TCP) {
        EXPECT_ERROR(tutti_mem_alloc(comm, N * 4, (void **)&in), TUTTI_ERROR_INVALID_ARGUMENT,
                     "shared memory of this host");
        EXPECT(in == NULL);
        return;
    }
    CHECK(tutti_mem_alloc(comm, N * 4 * WORLD, (void **)&in));
    CHECK(tutti_mem_alloc(comm, N * 4 * WORLD, (void **)&out));
    EXPECT(in != NULL && out != NULL && (uintptr_t)in % 64 == 0 && in[N * WORLD - 1] == 0.0f);
    CHECK(tutti_comm_set_algorithm(comm, TUTTI_ALGORITHM_DIRECT, 0));
    for (i = 0; i < N; i++) {
        in[i] = (float)(rank + i % 7);
    }
    CHECK(tutti_all_reduce(comm, N, TUTTI_DTYPE_F32, TUTTI_OP_SUM, in, out));
    for (i = 0; i < N; i++) {
        EXPECT(out[i] == (float)(3 + 3 * (i % 7)));
    }
    CHECK(tutti_all_reduce(comm, N, TUTTI_DTYPE_F32, TUTTI_OP_MAX, in, in));
    EXPECT(in[0] == 2.0f && in[N - 1] == (float)(2 + (N - 1) % 7));
    CHECK(tutti_all_gather(comm, N, TUTTI_DTYPE_F32, in, out));
    EXPECT(out[N + 3] == 5.0f && out[N * WORLD - 1] == in[N - 1]);
    CHECK(tutti_comm_set_algorithm(comm, TUTTI_ALGORITHM_AUTO, 0));
    EXPECT_ERROR(tutti_mem_free(comm, &stray), TUTTI_ERROR_INVALID_ARGUMENT,
                 "not memory from tutti_mem_alloc");
    CHECK(tutti_mem_free(comm, in));
    CHECK(tutti_mem_free(comm, NULL));
    /* memory left allocated goes with the communicator */
    (void)out;
}

/* One rank's work: collectives on a communicator of separate processes. */
static void rank_work(tutti_comm *comm, size_t rank, how h) {
    size_t r = 99, world = 0, i;
    double x[1000];
    int64_t mine[4], all[4 * WORLD];
    float b[5];
    CHECK(tutti_comm_rank(comm, &r));
    CHECK(tutti_comm_world_size(comm, &world));
    EXPECT(r == rank && world == WORLD);
    for (i = 0; i < 1000; i++) {
        x[i] = (double)(rank + i);
    }
    CHECK(tutti_all_reduce(comm, 1000, TUTTI_DTYPE_F64, TUTTI_OP_SUM, x, x));
    for (i = 0; i < 1000; i++) {
        EXPECT(x[i] == (double)(3 + 3 * i));
    }
    CHECK(tutti_comm_set_algorithm(comm, TUTTI_ALGORITHM_REDUCE_TO_ONE, 2));
    CHECK(tutti_all_reduce(comm, 1000, TUTTI_DTYPE_F64, TUTTI_OP_MEAN, x, x));
    EXPECT(x[10] == 33.0);
    for (i = 0; i < 4; i++) {
        mine[i] = (int64_t)(rank * 100 + i);
    }
    CHECK(tutti_all_gather(comm, 4, TUTTI_DTYPE_I64, mine, all));
    EXPECT(all[0] == 0 && all[5] == 101 && all[11] == 203);
    for (i = 0; i < 5; i++) {
        b[i] = rank == 1 ? 7.5f : 0.0f;
    }
    CHECK(tutti_broadcast(comm, 5, TUTTI_DTYPE_F32, 1, b));
    EXPECT(b[4] == 7.5f);
    shared_work(comm, rank, h);
    /* a count mismatch across processes: every rank fails naming the field. With the check
       round (TUTTI_CHECK=full) the communicator stays usable; by default the check travels
       with the data, and the ranks that did not see the difference themselves hear it from the
       rank that did, in the reason of an abort. */
    if (getenv("TUTTI_CHECK") != NULL) {
        EXPECT_ERROR(tutti_all_reduce(comm, rank == 0 ? 3 : 4, TUTTI_DTYPE_F64, TUTTI_OP_SUM, x, x),
                     TUTTI_ERROR_MISMATCH, "count");
        CHECK(tutti_barrier(comm));
    } else {
        char m[2048];
        tutti_result st = tutti_all_reduce(comm, rank == 0 ? 3 : 4, TUTTI_DTYPE_F64, TUTTI_OP_SUM,
                                           x, x);
        last_error(m, sizeof m);
        EXPECT(st == TUTTI_ERROR_MISMATCH || st == TUTTI_ERROR_ABORTED);
        EXPECT(strstr(m, "count") != NULL);
        EXPECT(tutti_barrier(comm) == TUTTI_ERROR_ABORTED);
    }
}

static int child(how h, size_t rank, int port) {
    tutti_config config = TUTTI_CONFIG_INIT;
    tutti_comm *comm = NULL;
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    config.timeout_ms = 60000;
    if (h == BY_RANK_TCP) {
        config.transport = TUTTI_TRANSPORT_TCP;
        setenv("TUTTI_CHECK", "full", 1); /* the check round, in one of the jobs */
    } else if (h == BY_RANK_SHM) {
        config.transport = TUTTI_TRANSPORT_SHM;
    }
    if (h == FROM_ENV) {
        char r[32], w[32];
        snprintf(r, sizeof r, "%zu", rank);
        snprintf(w, sizeof w, "%d", WORLD);
        setenv("TUTTI_RANK", r, 1);
        setenv("TUTTI_WORLD_SIZE", w, 1);
        setenv("TUTTI_MASTER_ADDR", addr, 1);
        CHECK(tutti_comm_create_from_env(&config, &comm));
    } else {
        CHECK(tutti_comm_create_rank(rank, WORLD, addr, &config, &comm));
    }
    if (h == PEER_LEAVES) {
        /* rank 2 exits without calling; the others fail instead of waiting forever */
        if (rank == 2) {
            _exit(0);
        }
        {
            float x[4] = {0};
            double t0 = now_seconds();
            tutti_result r = tutti_all_reduce(comm, 4, TUTTI_DTYPE_F32, TUTTI_OP_SUM, x, x);
            char m[1024];
            tutti_last_error(m, sizeof m);
            /* PEER_LOST where this rank saw the connection break; ABORTED where a peer that
             * saw it first aborted the group. Either way the message names the lost rank. */
            if ((r != TUTTI_ERROR_PEER_LOST && r != TUTTI_ERROR_ABORTED) ||
                strstr(m, "lost rank 2") == NULL || now_seconds() - t0 > 50) {
                FAIL("rank %zu: a collective with a departed peer returned %u after %.1f s: %s",
                     rank, (unsigned)r, now_seconds() - t0, m);
            }
        }
    } else {
        rank_work(comm, rank, h);
    }
    tutti_comm_destroy(comm);
    return 0;
}

static void run_job(how h, const char *name) {
    pid_t pids[WORLD];
    int port = free_port(), status, failed = 0;
    size_t r;
    for (r = 0; r < WORLD; r++) {
        pids[r] = fork();
        EXPECT(pids[r] >= 0);
        if (pids[r] == 0) {
            alarm(120); /* a child never outlives the test */
            _exit(child(h, r, port));
        }
    }
    for (r = 0; r < WORLD; r++) {
        EXPECT(waitpid(pids[r], &status, 0) == pids[r]);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "%s: rank %zu failed (status %d)\n", name, r, status);
            failed = 1;
        }
    }
    if (failed) {
        FAIL("%s failed", name);
    }
    printf("%s: ok\n", name);
}

int main(void) {
    tutti_comm *comm = NULL;
    unset_launcher_env();
    /* errors first, in this process */
    EXPECT_ERROR(tutti_comm_create_from_env(NULL, &comm), TUTTI_ERROR_INVALID_ARGUMENT,
                 "tutti_comm_create_from_env", "no cluster in the environment");
    EXPECT_ERROR(tutti_comm_create_rank(0, 2, NULL, NULL, &comm), TUTTI_ERROR_INVALID_ARGUMENT,
                 "master_addr is NULL");
    EXPECT_ERROR(tutti_comm_create_rank(5, 2, "127.0.0.1:1", NULL, &comm),
                 TUTTI_ERROR_INVALID_ARGUMENT, "rank 5 is out of range for world_size 2");
    EXPECT_ERROR(tutti_comm_create_rank(0, 2, "nowhere", NULL, &comm),
                 TUTTI_ERROR_INVALID_ARGUMENT, "'nowhere' is not host:port");
    EXPECT_ERROR(tutti_comm_create_rank(0, 2, "127.0.0.1:0", NULL, &comm),
                 TUTTI_ERROR_INVALID_ARGUMENT, "port 0");
    EXPECT_ERROR(tutti_comm_create_rank(0, 1, "127.0.0.1:1", NULL, NULL),
                 TUTTI_ERROR_INVALID_ARGUMENT, "comm is NULL");
    {
        tutti_config c = TUTTI_CONFIG_INIT;
        c.transport = (tutti_transport)7;
        EXPECT_ERROR(tutti_comm_create_rank(0, 1, "127.0.0.1:1", &c, &comm),
                     TUTTI_ERROR_INVALID_ARGUMENT, "transport 7 is not a tutti_transport");
        c.transport = TUTTI_TRANSPORT_TCP;
        EXPECT_ERROR(tutti_comm_create_group(2, &c, &comm), TUTTI_ERROR_INVALID_ARGUMENT,
                     "in-process group");
    }
    EXPECT(comm == NULL);
    fflush(stdout);
    run_job(BY_RANK_TCP, "3 processes over TCP");
    fflush(stdout);
    run_job(BY_RANK_SHM, "3 processes over shared memory");
    fflush(stdout);
    run_job(FROM_ENV, "3 processes from TUTTI_* variables");
    fflush(stdout);
    run_job(PEER_LEAVES, "a rank that exits");
    printf("multiprocess: ok\n");
    return 0;
}
