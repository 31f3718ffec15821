/* Non-blocking collectives from C: each rank of a 2-rank CPU group issues 16
 * tutti_all_reduce_async calls before waiting for any, then checks every result; every other
 * collective's _async form; tutti_work_test; a wait with a short bound that times out while the
 * call goes on; destroying a pending handle; a mismatch delivered through the handle. */
#include "check.h"

#define WORLD 2
#define CALLS 16
#define COUNT 4099

static void *sixteen_in_flight(void *p) {
    rank_ctx *c = p;
    float *bufs[CALLS];
    tutti_work *works[CALLS];
    size_t k, i;
    for (k = 0; k < CALLS; k++) {
        bufs[k] = malloc(COUNT * sizeof(float));
        EXPECT(bufs[k] != NULL);
        for (i = 0; i < COUNT; i++) {
            bufs[k][i] = (float)((c->rank + 1) * (k + 1)) + (float)(i % 7);
        }
        /* In place, every call on its own buffer. */
        CHECK(tutti_all_reduce_async(c->comm, COUNT, TUTTI_DTYPE_F32, TUTTI_OP_SUM, bufs[k],
                                     bufs[k], &works[k]));
    }
    /* Wait newest first: calls still complete in issue order. */
    for (k = CALLS; k-- > 0;) {
        CHECK(tutti_work_wait(works[k], 0));
    }
    for (k = 0; k < CALLS; k++) {
        bool done = false;
        CHECK(tutti_work_test(works[k], &done));
        EXPECT(done);
        for (i = 0; i < COUNT; i++) {
            float want = (float)(3 * (k + 1)) + 2.0f * (float)(i % 7);
            if (bufs[k][i] != want) {
                FAIL("rank %zu call %zu element %zu: %g, want %g", c->rank, k, i,
                     (double)bufs[k][i], (double)want);
            }
        }
        tutti_work_destroy(works[k]);
        free(bufs[k]);
    }
    return NULL;
}

static void *every_collective(void *p) {
    rank_ctx *c = p;
    int32_t bcast[5], gathered[2 * 3], mine[3], rs_in[2 * 4], rs_out[4], red[6];
    size_t i;
    tutti_work *w[5];
    for (i = 0; i < 5; i++) {
        bcast[i] = c->rank == 1 ? (int32_t)(100 + i) : -1;
    }
    for (i = 0; i < 3; i++) {
        mine[i] = (int32_t)(10 * c->rank + i);
    }
    for (i = 0; i < 8; i++) {
        rs_in[i] = (int32_t)(i + c->rank);
    }
    for (i = 0; i < 6; i++) {
        red[i] = (int32_t)(c->rank + i);
    }
    CHECK(tutti_broadcast_async(c->comm, 5, TUTTI_DTYPE_I32, 1, bcast, &w[0]));
    CHECK(tutti_all_gather_async(c->comm, 3, TUTTI_DTYPE_I32, mine, gathered, &w[1]));
    CHECK(tutti_reduce_scatter_async(c->comm, 4, TUTTI_DTYPE_I32, TUTTI_OP_MAX, rs_in, rs_out,
                                     &w[2]));
    CHECK(tutti_reduce_async(c->comm, 6, TUTTI_DTYPE_I32, TUTTI_OP_SUM, 0, red,
                             c->rank == 0 ? red : NULL, &w[3]));
    CHECK(tutti_barrier_async(c->comm, &w[4]));
    for (i = 0; i < 5; i++) {
        CHECK(tutti_work_wait(w[i], 0));
        tutti_work_destroy(w[i]);
    }
    for (i = 0; i < 5; i++) {
        EXPECT(bcast[i] == (int32_t)(100 + i));
    }
    for (i = 0; i < 6; i++) {
        EXPECT(gathered[i] == (int32_t)(10 * (i / 3) + i % 3));
    }
    for (i = 0; i < 4; i++) {
        EXPECT(rs_out[i] == (int32_t)(c->rank * 4 + i + 1));
    }
    if (c->rank == 0) {
        for (i = 0; i < 6; i++) {
            EXPECT(red[i] == (int32_t)(2 * i + 1));
        }
    }
    return NULL;
}

static void *a_mismatch_through_the_handle(void *p) {
    rank_ctx *c = p;
    float x[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    tutti_work *w = NULL;
    CHECK(tutti_all_reduce_async(c->comm, c->rank == 0 ? 8 : 7, TUTTI_DTYPE_F32, TUTTI_OP_SUM, x,
                                 x, &w));
    EXPECT_ERROR(tutti_work_wait(w, 0), TUTTI_ERROR_MISMATCH, "count", "rank");
    /* The same result again. */
    EXPECT_ERROR(tutti_work_wait(w, 0), TUTTI_ERROR_MISMATCH, "count");
    tutti_work_destroy(w);
    /* The communicator stays usable. */
    CHECK(tutti_all_reduce(c->comm, 8, TUTTI_DTYPE_F32, TUTTI_OP_SUM, x, x));
    EXPECT(x[0] == 2.0f);
    return NULL;
}

int main(void) {
    tutti_comm *comms[WORLD];
    tutti_config config = TUTTI_CONFIG_INIT;
    tutti_work *w = NULL;
    double a[4] = {1, 2, 3, 4}, b[4] = {10, 20, 30, 40};
    bool done = true;
    config.timeout_ms = 30000;
    CHECK(tutti_comm_create_group(WORLD, &config, comms));
    run_ranks(WORLD, comms, sixteen_in_flight, NULL);
    run_ranks(WORLD, comms, every_collective, NULL);
    run_ranks(WORLD, comms, a_mismatch_through_the_handle, NULL);

    /* A short wait times out while the peer has not arrived; the call then completes. */
    CHECK(tutti_all_reduce_async(comms[0], 4, TUTTI_DTYPE_F64, TUTTI_OP_SUM, a, a, &w));
    /* Its own code: not TUTTI_ERROR_TIMEOUT, which means the group is aborted. */
    EXPECT_ERROR(tutti_work_wait(w, 20), TUTTI_ERROR_WAIT_TIMEOUT, "wait for it again",
                 "this wait's bound");
    {
        bool aborted = true;
        CHECK(tutti_comm_is_aborted(comms[0], &aborted));
        EXPECT(!aborted);
    }
    CHECK(tutti_work_test(w, &done));
    EXPECT(!done);
    CHECK(tutti_all_reduce(comms[1], 4, TUTTI_DTYPE_F64, TUTTI_OP_SUM, b, b));
    CHECK(tutti_work_wait(w, 10000));
    EXPECT(a[3] == 44.0 && b[0] == 11.0);
    tutti_work_destroy(w);

    /* Bad arguments: no handle is written, and the error says which. */
    w = NULL;
    EXPECT_ERROR(tutti_all_reduce_async(comms[0], 4, TUTTI_DTYPE_F64, TUTTI_OP_SUM, a, a, NULL),
                 TUTTI_ERROR_INVALID_ARGUMENT, "work is NULL");
    EXPECT_ERROR(tutti_work_wait(NULL, 0), TUTTI_ERROR_INVALID_ARGUMENT, "work is NULL");
    EXPECT_ERROR(tutti_work_test(NULL, &done), TUTTI_ERROR_INVALID_ARGUMENT, "work is NULL");
    tutti_work_destroy(NULL);
    tutti_comm_destroy(comms[0]);
    tutti_comm_destroy(comms[1]);

    /* Destroying a pending handle whose peer never comes: bounded by the timeout, then the
     * group is aborted so the buffer is free once destroy returns. */
    config.timeout_ms = 300;
    CHECK(tutti_comm_create_group(WORLD, &config, comms));
    {
        double t0 = now_seconds();
        CHECK(tutti_all_reduce_async(comms[0], 4, TUTTI_DTYPE_F64, TUTTI_OP_SUM, a, a, &w));
        tutti_work_destroy(w);
        EXPECT(now_seconds() - t0 < 10.0);
    }
    EXPECT_ERROR(tutti_barrier(comms[0]), TUTTI_ERROR_ABORTED, "");
    tutti_comm_destroy(comms[0]);
    tutti_comm_destroy(comms[1]);
    printf("async: ok\n");
    return 0;
}
