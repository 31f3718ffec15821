/* A group of devices of this process through tutti_comm_create_devices: DEVICE_KIND=cpu or xla
 * and DEVICE_COUNT=N in the environment make ranks "cpu:0".."cpu:N-1" or "xla:0".."xla:N-1". Each rank issues 16
 * tutti_all_reduce_async calls before waiting any, then checks every result; then all-gather,
 * reduce-scatter, broadcast (blocking and non-blocking), reduce and a barrier, every value
 * checked. Prints "devices: unavailable" and exits 0 where the device kind is not available
 * (a build without it, or no PJRT plugin). */
#include "check.h"

#define MAX_RANKS 8
#define CALLS 16
#define COUNT 1031

static void *rank_main(void *p) {
    rank_ctx *c = p;
    size_t P = c->world, r = c->rank, k, i;
    float *bufs[CALLS];
    tutti_work *works[CALLS];
    int32_t mine[3], gathered[MAX_RANKS * 3], rs_in[MAX_RANKS * 2], rs_out[2], bc[4], red[5];
    tutti_work *w = NULL;
    /* Only cuda:N ranks take a CUDA stream; going back to none is always fine. */
    EXPECT(tutti_comm_set_cuda_stream(c->comm, NULL) == TUTTI_ERROR_INVALID_ARGUMENT);
    EXPECT(tutti_comm_unset_cuda_stream(c->comm) == TUTTI_SUCCESS);
    for (k = 0; k < CALLS; k++) {
        bufs[k] = malloc(COUNT * sizeof(float));
        EXPECT(bufs[k] != NULL);
        for (i = 0; i < COUNT; i++) {
            bufs[k][i] = (float)((r + 1) * (k + 1) + i % 3);
        }
        CHECK(tutti_all_reduce_async(c->comm, COUNT, TUTTI_DTYPE_F32, TUTTI_OP_SUM, bufs[k],
                                     bufs[k], &works[k]));
    }
    for (k = CALLS; k-- > 0;) {
        CHECK(tutti_work_wait(works[k], 0));
        tutti_work_destroy(works[k]);
    }
    for (k = 0; k < CALLS; k++) {
        for (i = 0; i < COUNT; i++) {
            float want = (float)((k + 1) * P * (P + 1) / 2 + P * (i % 3));
            if (bufs[k][i] != want) {
                FAIL("rank %zu call %zu element %zu: %g, want %g", r, k, i, (double)bufs[k][i],
                     (double)want);
            }
        }
        free(bufs[k]);
    }

    for (i = 0; i < 3; i++) {
        mine[i] = (int32_t)(10 * r + i);
    }
    CHECK(tutti_all_gather(c->comm, 3, TUTTI_DTYPE_I32, mine, gathered));
    for (i = 0; i < 3 * P; i++) {
        EXPECT(gathered[i] == (int32_t)(10 * (i / 3) + i % 3));
    }
    for (i = 0; i < 2 * P; i++) {
        rs_in[i] = (int32_t)(i + r);
    }
    CHECK(tutti_reduce_scatter_async(c->comm, 2, TUTTI_DTYPE_I32, TUTTI_OP_SUM, rs_in, rs_out,
                                     &w));
    CHECK(tutti_work_wait(w, 0));
    tutti_work_destroy(w);
    for (i = 0; i < 2; i++) {
        EXPECT(rs_out[i] == (int32_t)(P * (2 * r + i) + P * (P - 1) / 2));
    }
    for (i = 0; i < 4; i++) {
        bc[i] = r == P - 1 ? (int32_t)(7 * i) : -1;
    }
    CHECK(tutti_broadcast_async(c->comm, 4, TUTTI_DTYPE_I32, P - 1, bc, &w));
    CHECK(tutti_work_wait(w, 0));
    tutti_work_destroy(w);
    for (i = 0; i < 4; i++) {
        EXPECT(bc[i] == (int32_t)(7 * i));
    }
    for (i = 0; i < 4; i++) {
        bc[i] = r == 0 ? (int32_t)(3 + i) : 0;
    }
    CHECK(tutti_broadcast(c->comm, 4, TUTTI_DTYPE_I32, 0, bc));
    EXPECT(bc[3] == 6);
    for (i = 0; i < 5; i++) {
        red[i] = (int32_t)(r + i);
    }
    CHECK(tutti_reduce(c->comm, 5, TUTTI_DTYPE_I32, TUTTI_OP_MAX, 0, red, r == 0 ? red : NULL));
    if (r == 0) {
        for (i = 0; i < 5; i++) {
            EXPECT(red[i] == (int32_t)(P - 1 + i));
        }
    }
    CHECK(tutti_barrier(c->comm));
    return NULL;
}

int main(void) {
    tutti_comm *comms[MAX_RANKS];
    char names[MAX_RANKS][16];
    const char *specs[MAX_RANKS];
    tutti_config config = TUTTI_CONFIG_INIT;
    size_t n, r;
    tutti_result res;
    const char *kind = getenv("DEVICE_KIND"), *count = getenv("DEVICE_COUNT");
    if (kind == NULL || count == NULL) {
        FAIL("set DEVICE_KIND (cpu or xla) and DEVICE_COUNT");
    }
    n = (size_t)strtoul(count, NULL, 10);
    EXPECT(n >= 1 && n <= MAX_RANKS);
    for (r = 0; r < n; r++) {
        snprintf(names[r], sizeof names[r], "%s:%zu", kind, r);
        specs[r] = names[r];
    }
    config.timeout_ms = 120000;
    res = tutti_comm_create_devices(n, specs, &config, comms);
    if (res == TUTTI_ERROR_UNAVAILABLE) {
        char m[1024];
        last_error(m, sizeof m);
        printf("devices: unavailable (%s)\n", m);
        return 0;
    }
    CHECK(res);
    run_ranks(n, comms, rank_main, NULL);
    for (r = 0; r < n; r++) {
        tutti_comm_destroy(comms[r]);
    }
    /* Wrong specs say which. */
    specs[1] = specs[0];
    EXPECT_ERROR(tutti_comm_create_devices(2, specs, &config, comms),
                 TUTTI_ERROR_INVALID_ARGUMENT, "listed twice");
    specs[1] = NULL;
    EXPECT_ERROR(tutti_comm_create_devices(2, specs, &config, comms),
                 TUTTI_ERROR_INVALID_ARGUMENT, "devices[1] is NULL");
    EXPECT_ERROR(tutti_comm_create_devices(2, NULL, &config, comms),
                 TUTTI_ERROR_INVALID_ARGUMENT, "devices is NULL");
    printf("devices %s x%zu: ok\n", kind, n);
    return 0;
}
