/* Point-to-point from C: tutti_send, tutti_recv, their _async forms and groups of them
 * (tutti_group_start / tutti_group_end), on groups of 1 to 4 ranks on threads and 3 ranks in
 * separate processes (TCP): a ring exchange of 1 MiB per rank in a group (each rank sends to the
 * next and receives from the previous: more than a socket buffer, so run one by one it would
 * deadlock between processes), the same group ended without waiting (tutti_group_end_async),
 * one thread driving every rank of a group, blocking pairs, the async forms, a count mismatch
 * naming both ranks (the communicator is aborted), this rank's argument errors (the
 * communicator stays usable), and the misuses of a group: an end without a start, collectives
 * and _async calls inside one, nesting, a communicator destroyed between a recorded call and
 * the end, and those of tutti_group_end_async. */
#include "check.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_WORLD 4
#define RING_N (256 * 1024) /* f32: 1 MiB */

/* Element i of what rank `from` sends: exact in f32. */
static float value(size_t from, size_t i) {
    return (float)(from * 1000 + i % 997);
}

static float *ring_buffer(size_t rank) {
    float *p = malloc(RING_N * sizeof(float));
    size_t i;
    EXPECT(p != NULL);
    for (i = 0; i < RING_N; i++) {
        p[i] = value(rank, i);
    }
    return p;
}

static void expect_from(const char *what, size_t rank, const float *got, size_t n, size_t from) {
    size_t i;
    for (i = 0; i < n; i++) {
        if (got[i] != value(from, i)) {
            FAIL("rank %zu: %s: element %zu is %g, expected %g (from rank %zu)", rank, what, i,
                 (double)got[i], (double)value(from, i), from);
        }
    }
}

/* The ring in a group: send to r+1, receive from r-1, posted in either order. */
static void ring(tutti_comm *comm, size_t rank, size_t world, int recv_first) {
    float *out = ring_buffer(rank), *in = calloc(RING_N, sizeof(float));
    size_t next = (rank + 1) % world, prev = (rank + world - 1) % world;
    EXPECT(in != NULL);
    CHECK(tutti_group_start());
    if (recv_first) {
        CHECK(tutti_recv(comm, RING_N, TUTTI_DTYPE_F32, in, prev));
        CHECK(tutti_send(comm, RING_N, TUTTI_DTYPE_F32, out, next));
    } else {
        CHECK(tutti_send(comm, RING_N, TUTTI_DTYPE_F32, out, next));
        CHECK(tutti_recv(comm, RING_N, TUTTI_DTYPE_F32, in, prev));
    }
    CHECK(tutti_group_end());
    expect_from("ring", rank, in, RING_N, prev);
    expect_from("ring's send buffer", rank, out, RING_N, rank);
    free(out);
    free(in);
}

/* The ring in a group ended without waiting (tutti_group_end_async): the handle completes
 * once both buffers are done with; a collective issued after it comes after it. */
static void ring_async(tutti_comm *comm, size_t rank, size_t world) {
    float *out = ring_buffer(rank), *in = calloc(RING_N, sizeof(float));
    size_t next = (rank + 1) % world, prev = (rank + world - 1) % world;
    tutti_work *w = NULL;
    float x = 1.0f;
    EXPECT(in != NULL);
    CHECK(tutti_group_start());
    CHECK(tutti_send(comm, RING_N, TUTTI_DTYPE_F32, out, next));
    CHECK(tutti_recv(comm, RING_N, TUTTI_DTYPE_F32, in, prev));
    CHECK(tutti_group_end_async(&w));
    EXPECT(w != NULL);
    CHECK(tutti_all_reduce(comm, 1, TUTTI_DTYPE_F32, TUTTI_OP_SUM, &x, &x));
    EXPECT(x == (float)world);
    CHECK(tutti_work_wait(w, 0));
    tutti_work_destroy(w);
    expect_from("async group's ring", rank, in, RING_N, prev);
    free(out);
    free(in);
}

/* Blocking pairs: rank 0 sends to every other rank, which answers with its own values. */
static void pairs(tutti_comm *comm, size_t rank, size_t world) {
    enum { N = 1000 };
    float mine[N], got[N];
    size_t i, k;
    for (i = 0; i < N; i++) {
        mine[i] = value(rank, i);
    }
    if (rank == 0) {
        for (k = 1; k < world; k++) {
            CHECK(tutti_send(comm, N, TUTTI_DTYPE_F32, mine, k));
            memset(got, 0, sizeof got);
            CHECK(tutti_recv(comm, N, TUTTI_DTYPE_F32, got, k));
            expect_from("pair", rank, got, N, k);
        }
    } else {
        CHECK(tutti_recv(comm, N, TUTTI_DTYPE_F32, got, 0));
        expect_from("pair", rank, got, N, 0);
        CHECK(tutti_send(comm, N, TUTTI_DTYPE_F32, mine, 0));
    }
    /* count 0 with NULL buffers */
    if (world > 1) {
        if (rank == 0) {
            CHECK(tutti_send(comm, 0, TUTTI_DTYPE_F64, NULL, 1));
        } else if (rank == 1) {
            CHECK(tutti_recv(comm, 0, TUTTI_DTYPE_F64, NULL, 0));
        }
    }
}

/* The async forms: each rank sends to the next first, then receives from the previous (a small
 * message: without a group a send may wait for its receiver between processes). */
static void async_ring(tutti_comm *comm, size_t rank, size_t world) {
    enum { N = 333 };
    int64_t mine[N], got[N];
    tutti_work *s = NULL, *r = NULL;
    size_t i, next = (rank + 1) % world, prev = (rank + world - 1) % world;
    for (i = 0; i < N; i++) {
        mine[i] = (int64_t)(rank * 1000000 + i);
        got[i] = -1;
    }
    if (world == 1) {
        return; /* a send to itself needs its receive in the same group */
    }
    CHECK(tutti_send_async(comm, N, TUTTI_DTYPE_I64, mine, next, &s));
    CHECK(tutti_recv_async(comm, N, TUTTI_DTYPE_I64, got, prev, &r));
    CHECK(tutti_work_wait(s, 0));
    CHECK(tutti_work_wait(r, 0));
    tutti_work_destroy(s);
    tutti_work_destroy(r);
    for (i = 0; i < N; i++) {
        EXPECT(got[i] == (int64_t)(prev * 1000000 + i));
    }
}

/* This rank's own argument errors: refused at once, the communicator stays usable. */
static void argument_errors(tutti_comm *comm, size_t rank, size_t world) {
    float x[4] = {0};
    tutti_work *w = NULL;
    EXPECT_ERROR(tutti_send(comm, 4, TUTTI_DTYPE_F32, NULL, 0), TUTTI_ERROR_INVALID_ARGUMENT,
                 "tutti_send", "buf is NULL");
    EXPECT_ERROR(tutti_recv(comm, 4, (tutti_dtype)99, x, 0), TUTTI_ERROR_INVALID_ARGUMENT,
                 "tutti_recv", "dtype 99");
    EXPECT_ERROR(tutti_send(comm, SIZE_MAX / 2, TUTTI_DTYPE_F32, x, 0),
                 TUTTI_ERROR_INVALID_ARGUMENT, "more bytes than a buffer can hold");
    EXPECT_ERROR(tutti_recv(comm, 4, TUTTI_DTYPE_F32, x, world), TUTTI_ERROR_INVALID_ARGUMENT,
                 "is out of range");
    EXPECT_ERROR(tutti_send_async(comm, 4, TUTTI_DTYPE_F32, x, 0, NULL),
                 TUTTI_ERROR_INVALID_ARGUMENT, "work is NULL");
    EXPECT_ERROR(tutti_recv(NULL, 4, TUTTI_DTYPE_F32, x, 0), TUTTI_ERROR_INVALID_ARGUMENT,
                 "comm is NULL");
    EXPECT(w == NULL);
    /* A send to itself without its receive in the same group. */
    EXPECT_ERROR(tutti_send(comm, 4, TUTTI_DTYPE_F32, x, rank), TUTTI_ERROR_INVALID_ARGUMENT,
                 "sends to itself");
    CHECK(tutti_barrier(comm));
}

static void *rank_main(void *arg) {
    rank_ctx *c = arg;
    ring(c->comm, c->rank, c->world, 0);
    ring(c->comm, c->rank, c->world, 1);
    ring_async(c->comm, c->rank, c->world);
    pairs(c->comm, c->rank, c->world);
    async_ring(c->comm, c->rank, c->world);
    argument_errors(c->comm, c->rank, c->world);
    /* a collective after point-to-point keeps working */
    {
        float x = 1.0f;
        CHECK(tutti_all_reduce(c->comm, 1, TUTTI_DTYPE_F32, TUTTI_OP_SUM, &x, &x));
        EXPECT(x == (float)c->world);
    }
    return NULL;
}

/* One thread drives every rank of a group: each communicator's operations are issued before
 * any is waited for. */
static void one_thread_drives_all(size_t world) {
    tutti_comm *comms[MAX_WORLD];
    float *out[MAX_WORLD], *in[MAX_WORLD];
    size_t r;
    CHECK(tutti_comm_create_group(world, NULL, comms));
    CHECK(tutti_group_start());
    for (r = 0; r < world; r++) {
        out[r] = ring_buffer(r);
        in[r] = calloc(RING_N, sizeof(float));
        EXPECT(in[r] != NULL);
        CHECK(tutti_send(comms[r], RING_N, TUTTI_DTYPE_F32, out[r], (r + 1) % world));
        CHECK(tutti_recv(comms[r], RING_N, TUTTI_DTYPE_F32, in[r], (r + world - 1) % world));
    }
    CHECK(tutti_group_end());
    for (r = 0; r < world; r++) {
        expect_from("one thread's ring", r, in[r], RING_N, (r + world - 1) % world);
        free(out[r]);
        free(in[r]);
        tutti_comm_destroy(comms[r]);
    }
}

/* A count mismatch: the receiver fails naming both ranks, the communicator is aborted. */
static void *mismatch_rank(void *arg) {
    rank_ctx *c = arg;
    float x[5] = {1, 2, 3, 4, 5};
    if (c->rank == 0) {
        tutti_result r;
        CHECK(tutti_send(c->comm, 5, TUTTI_DTYPE_F32, x, 1));
        /* the receiver aborts the communicator: the sender's next call fails */
        do {
            r = tutti_barrier(c->comm);
        } while (r == TUTTI_SUCCESS);
        EXPECT(r == TUTTI_ERROR_ABORTED);
    } else {
        EXPECT_ERROR(tutti_recv(c->comm, 4, TUTTI_DTYPE_F32, x, 0), TUTTI_ERROR_INVALID_ARGUMENT,
                     "rank 0 sent 5 f32 where rank 1 receives 4 f32");
        EXPECT_ERROR(tutti_barrier(c->comm), TUTTI_ERROR_ABORTED, "");
    }
    return NULL;
}

static void group_misuse(void) {
    tutti_comm *comms[2], *solo = NULL;
    float x[4] = {1, 2, 3, 4}, y[4] = {0};
    tutti_work *w = NULL;
    EXPECT_ERROR(tutti_group_end(), TUTTI_ERROR_INVALID_ARGUMENT, "tutti_group_end",
                 "no group is open");
    CHECK(tutti_comm_create_group(1, NULL, &solo));
    /* inside a group: collectives, barriers and the _async forms are refused, nothing aborted */
    CHECK(tutti_group_start());
    EXPECT_ERROR(tutti_all_reduce(solo, 4, TUTTI_DTYPE_F32, TUTTI_OP_SUM, x, x),
                 TUTTI_ERROR_INVALID_ARGUMENT, "tutti_all_reduce",
                 "only tutti_send and tutti_recv are grouped");
    EXPECT_ERROR(tutti_barrier(solo), TUTTI_ERROR_INVALID_ARGUMENT, "tutti_barrier",
                 "only tutti_send and tutti_recv are grouped");
    EXPECT_ERROR(tutti_all_reduce_async(solo, 4, TUTTI_DTYPE_F32, TUTTI_OP_SUM, x, x, &w),
                 TUTTI_ERROR_INVALID_ARGUMENT, "only tutti_send and tutti_recv are grouped");
    EXPECT_ERROR(tutti_send_async(solo, 4, TUTTI_DTYPE_F32, x, 0, &w),
                 TUTTI_ERROR_INVALID_ARGUMENT, "tutti_send_async",
                 "only tutti_send and tutti_recv are grouped");
    EXPECT_ERROR(tutti_recv_async(solo, 4, TUTTI_DTYPE_F32, y, 0, &w),
                 TUTTI_ERROR_INVALID_ARGUMENT, "tutti_recv_async", "only tutti_send");
    EXPECT(w == NULL);
    /* nested: the inner end runs nothing, the outer one runs the send to itself */
    CHECK(tutti_send(solo, 4, TUTTI_DTYPE_F32, x, 0));
    CHECK(tutti_group_start());
    CHECK(tutti_recv(solo, 4, TUTTI_DTYPE_F32, y, 0));
    CHECK(tutti_group_end());
    EXPECT(y[3] == 0.0f);
    CHECK(tutti_group_end());
    EXPECT(y[0] == 1.0f && y[3] == 4.0f);
    EXPECT_ERROR(tutti_group_end(), TUTTI_ERROR_INVALID_ARGUMENT, "no group is open");
    CHECK(tutti_all_reduce(solo, 4, TUTTI_DTYPE_F32, TUTTI_OP_SUM, x, x));
    /* an empty group */
    CHECK(tutti_group_start());
    CHECK(tutti_group_end());
    /* a send to itself without its receive in the group: this rank's error, usable after */
    CHECK(tutti_group_start());
    CHECK(tutti_send(solo, 4, TUTTI_DTYPE_F32, x, 0));
    EXPECT_ERROR(tutti_group_end(), TUTTI_ERROR_INVALID_ARGUMENT, "tutti_group_end",
                 "rank 0 of 1", "send 4 f32 to rank 0", "sends to itself");
    CHECK(tutti_barrier(solo));
    /* an argument error inside a group is returned at once and nothing is recorded */
    CHECK(tutti_group_start());
    EXPECT_ERROR(tutti_send(solo, 4, TUTTI_DTYPE_F32, NULL, 0), TUTTI_ERROR_INVALID_ARGUMENT,
                 "buf is NULL");
    CHECK(tutti_group_end());
    /* a communicator destroyed between its recorded calls and the end: an error naming it;
       the other communicator's calls still run */
    CHECK(tutti_comm_create_group(2, NULL, comms));
    CHECK(tutti_group_start());
    CHECK(tutti_send(solo, 4, TUTTI_DTYPE_F32, x, 0));
    CHECK(tutti_recv(solo, 4, TUTTI_DTYPE_F32, y, 0));
    CHECK(tutti_send(comms[0], 4, TUTTI_DTYPE_F32, x, 1));
    tutti_comm_destroy(solo);
    EXPECT_ERROR(tutti_group_end(), TUTTI_ERROR_INVALID_ARGUMENT, "tutti_group_end",
                 "destroyed before tutti_group_end", "rank 0 of 1", "recv 4 f32 from rank 0");
    memset(y, 0, sizeof y);
    CHECK(tutti_recv(comms[1], 4, TUTTI_DTYPE_F32, y, 0));
    EXPECT(y[0] == 1.0f && y[3] == 4.0f);
    tutti_comm_destroy(comms[0]);
    tutti_comm_destroy(comms[1]);
    /* the communicator's address reused by a new one is not mistaken for the destroyed one */
    CHECK(tutti_comm_create_group(1, NULL, &solo));
    CHECK(tutti_group_start());
    CHECK(tutti_send(solo, 4, TUTTI_DTYPE_F32, x, 0));
    tutti_comm_destroy(solo);
    CHECK(tutti_comm_create_group(1, NULL, &solo));
    EXPECT_ERROR(tutti_group_end(), TUTTI_ERROR_INVALID_ARGUMENT, "destroyed before");
    tutti_comm_destroy(solo);
    /* tutti_group_end_async: without a group, with work NULL; an inner or empty group issues
       nothing (NULL); operations on two communicators are refused and the group stays open,
       for tutti_group_end to run them */
    w = (tutti_work *)&w;
    EXPECT_ERROR(tutti_group_end_async(&w), TUTTI_ERROR_INVALID_ARGUMENT,
                 "tutti_group_end_async", "no group is open");
    CHECK(tutti_group_start());
    EXPECT_ERROR(tutti_group_end_async(NULL), TUTTI_ERROR_INVALID_ARGUMENT, "work is NULL");
    CHECK(tutti_group_end_async(&w));
    EXPECT(w == NULL);
    CHECK(tutti_comm_create_group(2, NULL, comms));
    memset(y, 0, sizeof y);
    CHECK(tutti_group_start());
    CHECK(tutti_send(comms[0], 4, TUTTI_DTYPE_F32, x, 1));
    CHECK(tutti_group_start());
    CHECK(tutti_recv(comms[1], 4, TUTTI_DTYPE_F32, y, 0));
    w = (tutti_work *)&w;
    CHECK(tutti_group_end_async(&w));
    EXPECT(w == NULL && y[0] == 0.0f);
    EXPECT_ERROR(tutti_group_end_async(&w), TUTTI_ERROR_INVALID_ARGUMENT,
                 "tutti_group_end_async", "on 2 communicators", "send 4 f32 to rank 1",
                 "recv 4 f32 from rank 0", "the group is still open");
    CHECK(tutti_group_end());
    EXPECT(y[0] == 1.0f && y[3] == 4.0f);
    tutti_comm_destroy(comms[0]);
    tutti_comm_destroy(comms[1]);
    /* a send to itself without its receive: the handle's error names it, usable after */
    CHECK(tutti_comm_create_group(1, NULL, &solo));
    CHECK(tutti_group_start());
    CHECK(tutti_send(solo, 4, TUTTI_DTYPE_F32, x, 0));
    CHECK(tutti_group_end_async(&w));
    EXPECT(w != NULL);
    EXPECT_ERROR(tutti_work_wait(w, 0), TUTTI_ERROR_INVALID_ARGUMENT, "sends to itself");
    tutti_work_destroy(w);
    CHECK(tutti_barrier(solo));
    /* a communicator destroyed before the async end: an error naming it, no handle, and the
       group still open, for tutti_group_end to name it too */
    CHECK(tutti_group_start());
    CHECK(tutti_recv(solo, 4, TUTTI_DTYPE_F32, y, 0));
    tutti_comm_destroy(solo);
    w = (tutti_work *)&w;
    EXPECT_ERROR(tutti_group_end_async(&w), TUTTI_ERROR_INVALID_ARGUMENT,
                 "destroyed before tutti_group_end_async", "recv 4 f32 from rank 0",
                 "the group is still open");
    EXPECT(w == NULL);
    EXPECT_ERROR(tutti_group_end(), TUTTI_ERROR_INVALID_ARGUMENT, "destroyed before tutti_group_end");
    EXPECT_ERROR(tutti_group_end(), TUTTI_ERROR_INVALID_ARGUMENT, "no group is open");
    printf("group misuse: ok\n");
}

/* ----- ranks in separate processes ----- */

static int child(size_t rank, size_t world, int port) {
    tutti_config config = TUTTI_CONFIG_INIT;
    tutti_comm *comm = NULL;
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    config.timeout_ms = 60000;
    config.transport = TUTTI_TRANSPORT_TCP;
    CHECK(tutti_comm_create_rank(rank, world, addr, &config, &comm));
    ring(comm, rank, world, 0);
    ring_async(comm, rank, world);
    pairs(comm, rank, world);
    async_ring(comm, rank, world);
    argument_errors(comm, rank, world);
    tutti_comm_destroy(comm);
    return 0;
}

static void processes(size_t world) {
    pid_t pids[MAX_WORLD];
    int port = free_port(), status, failed = 0;
    size_t r;
    const char *vars[] = {"TUTTI_RANK", "TUTTI_WORLD_SIZE", "TUTTI_MASTER_ADDR", "TF_CONFIG",
                          "TUTTI_TRANSPORT"};
    for (r = 0; r < sizeof vars / sizeof vars[0]; r++) {
        unsetenv(vars[r]);
    }
    fflush(stdout);
    for (r = 0; r < world; r++) {
        pids[r] = fork();
        EXPECT(pids[r] >= 0);
        if (pids[r] == 0) {
            alarm(120); /* a child never outlives the test */
            _exit(child(r, world, port));
        }
    }
    for (r = 0; r < world; r++) {
        EXPECT(waitpid(pids[r], &status, 0) == pids[r]);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "rank %zu of %zu processes failed (status %d)\n", r, world, status);
            failed = 1;
        }
    }
    if (failed) {
        FAIL("point-to-point between %zu processes failed", world);
    }
    printf("%zu processes over TCP: ok\n", world);
}

int main(void) {
    size_t world;
    for (world = 1; world <= MAX_WORLD; world++) {
        tutti_comm *comms[MAX_WORLD];
        CHECK(tutti_comm_create_group(world, NULL, comms));
        run_ranks(world, comms, rank_main, NULL);
        for (size_t r = 0; r < world; r++) {
            tutti_comm_destroy(comms[r]);
        }
        one_thread_drives_all(world);
        printf("%zu ranks on threads: ok\n", world);
    }
    {
        tutti_comm *comms[2];
        CHECK(tutti_comm_create_group(2, NULL, comms));
        run_ranks(2, comms, mismatch_rank, NULL);
        tutti_comm_destroy(comms[0]);
        tutti_comm_destroy(comms[1]);
        printf("count mismatch: ok\n");
    }
    group_misuse();
    processes(3);
    printf("p2p: ok\n");
    return 0;
}
