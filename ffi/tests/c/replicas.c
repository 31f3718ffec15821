/* The one-call form over per-replica buffers: every replicas collective, for several
 * algorithms and dtypes, every value checked. */
#include "check.h"

#define NREP 4
#define N 333

static void run(tutti_algorithm algorithm, tutti_dtype d) {
    tutti_config config = TUTTI_CONFIG_INIT;
    tutti_replicas *rep = NULL;
    size_t es = dtype_size(d), i, r, q;
    unsigned char *buf[NREP], *gathered[NREP], *out;
    void *bufs[NREP], *outs[NREP];
    const void *ins[NREP];
    config.timeout_ms = 60000;
    config.algorithm = algorithm;
    CHECK(tutti_replicas_create(NREP, &config, &rep));
    for (r = 0; r < NREP; r++) {
        buf[r] = malloc(NREP * N * es);
        gathered[r] = malloc(NREP * N * es);
        EXPECT(buf[r] && gathered[r]);
        bufs[r] = buf[r];
        outs[r] = gathered[r];
        ins[r] = buf[r];
    }
    out = malloc(N * es);
    EXPECT(out);

    /* all-reduce SUM, then MEAN */
    for (r = 0; r < NREP; r++) {
        for (i = 0; i < N; i++) {
            set_elem(d, buf[r], i, (double)(r + i % 9));
        }
    }
    CHECK(tutti_replicas_all_reduce(rep, N, d, TUTTI_OP_SUM, NREP, bufs));
    for (r = 0; r < NREP; r++) {
        for (i = 0; i < N; i++) {
            if (get_elem(d, buf[r], i) != (double)(6 + 4 * (i % 9))) {
                FAIL("replicas all_reduce %s: replica %zu element %zu is %g", dtype_name(d), r, i,
                     get_elem(d, buf[r], i));
            }
        }
    }
    CHECK(tutti_replicas_all_reduce(rep, N, d, TUTTI_OP_MEAN, NREP, bufs));
    EXPECT(get_elem(d, buf[2], 1) == 10.0);

    /* broadcast from replica 3 */
    for (r = 0; r < NREP; r++) {
        for (i = 0; i < N; i++) {
            set_elem(d, buf[r], i, (double)(r * 20 + i % 5));
        }
    }
    CHECK(tutti_replicas_broadcast(rep, N, d, 3, NREP, bufs));
    for (r = 0; r < NREP; r++) {
        EXPECT(get_elem(d, buf[r], 4) == 64.0 && get_elem(d, buf[r], N - 1) == 60.0 + (N - 1) % 5);
    }

    /* all-gather: out of place, then in place */
    for (r = 0; r < NREP; r++) {
        for (i = 0; i < N; i++) {
            set_elem(d, buf[r], i, (double)(r * 10 + i % 3));
        }
    }
    CHECK(tutti_replicas_all_gather(rep, N, d, NREP, ins, outs));
    for (r = 0; r < NREP; r++) {
        for (q = 0; q < NREP; q++) {
            for (i = 0; i < N; i++) {
                if (get_elem(d, gathered[r], q * N + i) != (double)(q * 10 + i % 3)) {
                    FAIL("replicas all_gather %s: output %zu slice %zu element %zu is %g",
                         dtype_name(d), r, q, i, get_elem(d, gathered[r], q * N + i));
                }
            }
        }
    }
    {
        const void *own[NREP];
        for (r = 0; r < NREP; r++) {
            memset(gathered[r], 0, NREP * N * es);
            memcpy(gathered[r] + r * N * es, buf[r], N * es);
            own[r] = gathered[r] + r * N * es;
        }
        CHECK(tutti_replicas_all_gather(rep, N, d, NREP, own, outs));
        EXPECT(get_elem(d, gathered[0], 3 * N + 2) == 32.0);
        EXPECT(get_elem(d, gathered[3], 0 * N + 1) == 1.0);
    }

    /* reduce-scatter: replica r gets slice r of the sum */
    for (r = 0; r < NREP; r++) {
        for (i = 0; i < NREP * N; i++) {
            set_elem(d, buf[r], i, (double)(r + i / N));
        }
    }
    {
        void *slices[NREP];
        for (r = 0; r < NREP; r++) {
            slices[r] = gathered[r];
        }
        CHECK(tutti_replicas_reduce_scatter(rep, N, d, TUTTI_OP_SUM, NREP, ins, slices));
        for (r = 0; r < NREP; r++) {
            for (i = 0; i < N; i++) {
                EXPECT(get_elem(d, gathered[r], i) == (double)(6 + 4 * r));
            }
        }
    }

    /* reduce into a separate output (MAX), then in place into inputs[0] (SUM) */
    for (r = 0; r < NREP; r++) {
        for (i = 0; i < N; i++) {
            set_elem(d, buf[r], i, (double)(r * 2 + i % 2));
        }
    }
    CHECK(tutti_replicas_reduce(rep, N, d, TUTTI_OP_MAX, NREP, ins, out));
    EXPECT(get_elem(d, out, 0) == 6.0 && get_elem(d, out, 1) == 7.0);
    CHECK(tutti_replicas_reduce(rep, N, d, TUTTI_OP_SUM, NREP, ins, buf[0]));
    EXPECT(get_elem(d, buf[0], 0) == 12.0 && get_elem(d, buf[0], 1) == 16.0);
    EXPECT(get_elem(d, buf[1], 1) == 3.0); /* other inputs untouched */

    for (r = 0; r < NREP; r++) {
        free(buf[r]);
        free(gathered[r]);
    }
    free(out);
    tutti_replicas_destroy(rep);
}

int main(void) {
    const tutti_algorithm algos[] = {TUTTI_ALGORITHM_AUTO, TUTTI_ALGORITHM_RING,
                                     TUTTI_ALGORITHM_HIERARCHICAL_COPY,
                                     TUTTI_ALGORITHM_REDUCE_TO_ONE};
    const tutti_dtype dtypes[] = {TUTTI_DTYPE_F32, TUTTI_DTYPE_BF16, TUTTI_DTYPE_I64,
                                  TUTTI_DTYPE_U8};
    size_t a, d;
    for (a = 0; a < sizeof algos / sizeof algos[0]; a++) {
        for (d = 0; d < sizeof dtypes / sizeof dtypes[0]; d++) {
            run(algos[a], dtypes[d]);
        }
    }
    printf("replicas: every collective, 4 algorithms x 4 dtypes: ok\n");
    return 0;
}
