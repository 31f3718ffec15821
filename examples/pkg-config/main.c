/* A C consumer of an installed tutti, built with pkg-config (scripts/install-c.sh --prefix DIR):
 *
 *   export PKG_CONFIG_PATH=DIR/lib/pkgconfig
 *   cc -std=c11 main.c $(pkg-config --cflags --libs tutti) \
 *       -Wl,-rpath,"$(pkg-config --variable=libdir tutti)" -o replicas
 *   ./replicas
 *
 * (without the rpath: LD_LIBRARY_PATH=DIR/lib ./replicas). Four replicas' buffers are summed and
 * broadcast by one caller; every value is checked, and a wrong one exits nonzero. */
#include <stdio.h>
#include <string.h>

#include <tutti.h>

#define REPLICAS 4
#define COUNT 256

static int fail(const char *call, tutti_result r) {
    char why[512];
    tutti_last_error(why, sizeof why);
    fprintf(stderr, "%s: %s\n%s\n", call, tutti_result_string(r), why);
    return 1;
}

int main(void) {
    double bufs[REPLICAS][COUNT];
    void *ptrs[REPLICAS];
    tutti_config config = TUTTI_CONFIG_INIT;
    tutti_replicas *reps = NULL;
    tutti_result r;
    int status = 0;
    size_t i, k;

    if (strcmp(tutti_version_string(), TUTTI_VERSION_STRING) != 0) {
        fprintf(stderr, "library %s with header %s\n", tutti_version_string(), TUTTI_VERSION_STRING);
        return 1;
    }
    config.timeout_ms = 30000;
    r = tutti_replicas_create(REPLICAS, &config, &reps);
    if (r != TUTTI_SUCCESS) {
        return fail("tutti_replicas_create", r);
    }
    for (k = 0; k < REPLICAS; k++) {
        for (i = 0; i < COUNT; i++) {
            bufs[k][i] = (double)(k + 1) * (double)i; /* the sum over replicas: 10 i */
        }
        ptrs[k] = bufs[k];
    }
    r = tutti_replicas_all_reduce(reps, COUNT, TUTTI_DTYPE_F64, TUTTI_OP_SUM, REPLICAS, ptrs);
    if (r != TUTTI_SUCCESS) {
        status = fail("tutti_replicas_all_reduce", r);
    }
    for (k = 0; k < REPLICAS && status == 0; k++) {
        for (i = 0; i < COUNT; i++) {
            if (bufs[k][i] != 10.0 * (double)i) {
                fprintf(stderr, "wrong: sum at replica %zu [%zu] = %g, not %g\n", k, i, bufs[k][i],
                        10.0 * (double)i);
                status = 1;
                break;
            }
        }
    }
    if (status == 0) {
        bufs[2][0] = -7.0;
        r = tutti_replicas_broadcast(reps, COUNT, TUTTI_DTYPE_F64, 2, REPLICAS, ptrs);
        if (r != TUTTI_SUCCESS) {
            status = fail("tutti_replicas_broadcast", r);
        }
        for (k = 0; k < REPLICAS && status == 0; k++) {
            if (bufs[k][0] != -7.0 || bufs[k][COUNT - 1] != 10.0 * (COUNT - 1)) {
                fprintf(stderr, "wrong: broadcast from replica 2 at replica %zu\n", k);
                status = 1;
            }
        }
    }
    tutti_replicas_destroy(reps);
    if (status == 0) {
        printf("ok: tutti %s found by pkg-config; replicas sum and broadcast right\n",
               tutti_version_string());
    }
    return status;
}
