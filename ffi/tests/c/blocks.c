/* The collectives over blocks from C: tutti_all_to_all, tutti_all_to_all_v, tutti_gather,
 * tutti_scatter, tutti_all_gather_v and tutti_reduce_scatter_v, blocking and _async, on groups
 * of 1 to 4 ranks (a thread per rank), every dtype, uneven counts with zeros, every root, every
 * element checked; counts copied when an _async call is issued; argument errors (NULL counts,
 * overlapping buffers, NULL root buffers, counts that overflow, wrong roots, counts that
 * disagree between ranks) returning an error that names the problem; tutti_comm_split. */
#include "check.h"

#define MAX_WORLD 4

static const tutti_dtype DTYPES[] = {
    TUTTI_DTYPE_F32, TUTTI_DTYPE_F64, TUTTI_DTYPE_F16, TUTTI_DTYPE_BF16, TUTTI_DTYPE_I8,
    TUTTI_DTYPE_U8,  TUTTI_DTYPE_I32, TUTTI_DTYPE_U32, TUTTI_DTYPE_I64,  TUTTI_DTYPE_U64,
};
#define NUM_DTYPES (sizeof DTYPES / sizeof DTYPES[0])

/* Element i of what rank `from` sends rank `to`: small integers, exact in every dtype. */
static double value(size_t from, size_t to, size_t i) {
    return (double)(from * 16 + to * 4 + i % 4);
}

/* Rank `from`'s count of elements for rank `to` in all_to_all_v: uneven, zeros included. */
static size_t a2av_count(size_t from, size_t to) {
    return (from + 2 * to) % 3;
}

/* The count of rank k in all_gather_v and reduce_scatter_v: 0, 3, 2, 1. */
static size_t v_count(size_t k) {
    return (k * 3) % 4;
}

/* Exactly `n` elements of `d` (NULL when n is 0, which the calls accept), every byte set so
 * that an element the call should write and did not is seen. */
static void *alloc_elems(tutti_dtype d, size_t n) {
    void *p;
    if (n == 0) {
        return NULL;
    }
    p = malloc(n * dtype_size(d));
    EXPECT(p != NULL);
    memset(p, 0x5a, n * dtype_size(d));
    return p;
}

static void expect_elem(const rank_ctx *c, const char *what, tutti_dtype d, const void *buf,
                        size_t i, double want) {
    double got = get_elem(d, buf, i);
    if (got != want) {
        FAIL("world %zu rank %zu: %s %s: element %zu is %g, expected %g", c->world, c->rank, what,
             dtype_name(d), i, got, want);
    }
}

/* Wait for a work handle and release it. */
static void finish(tutti_work *w) {
    CHECK(tutti_work_wait(w, 0));
    tutti_work_destroy(w);
}

static void all_to_all_case(const rank_ctx *c, tutti_dtype d, size_t count, int async) {
    size_t p = c->world, r = c->rank, k, i;
    void *in = alloc_elems(d, p * count), *out = alloc_elems(d, p * count);
    for (k = 0; k < p; k++) {
        for (i = 0; i < count; i++) {
            set_elem(d, in, k * count + i, value(r, k, i));
        }
    }
    if (async) {
        tutti_work *w = NULL;
        CHECK(tutti_all_to_all_async(c->comm, count, d, in, out, &w));
        finish(w);
    } else {
        CHECK(tutti_all_to_all(c->comm, count, d, in, out));
    }
    for (k = 0; k < p; k++) {
        for (i = 0; i < count; i++) {
            expect_elem(c, "all_to_all", d, out, k * count + i, value(k, r, i));
            expect_elem(c, "all_to_all's input", d, in, k * count + i, value(r, k, i));
        }
    }
    free(in);
    free(out);
}

static void all_to_all_v_case(const rank_ctx *c, tutti_dtype d, int async) {
    size_t p = c->world, r = c->rank, k, i, at, n_in = 0, n_out = 0;
    size_t *send = malloc(p * sizeof *send), *recv = malloc(p * sizeof *recv);
    void *in, *out;
    EXPECT(send && recv);
    for (k = 0; k < p; k++) {
        send[k] = a2av_count(r, k);
        recv[k] = a2av_count(k, r);
        n_in += send[k];
        n_out += recv[k];
    }
    in = alloc_elems(d, n_in);
    out = alloc_elems(d, n_out);
    for (k = 0, at = 0; k < p; k++) {
        for (i = 0; i < send[k]; i++) {
            set_elem(d, in, at++, value(r, k, i));
        }
    }
    if (async) {
        tutti_work *w = NULL;
        CHECK(tutti_all_to_all_v_async(c->comm, send, recv, d, in, out, &w));
        /* The counts were copied when the call was issued. */
        free(send);
        free(recv);
        send = recv = NULL;
        finish(w);
    } else {
        CHECK(tutti_all_to_all_v(c->comm, send, recv, d, in, out));
        free(send);
        free(recv);
    }
    for (k = 0, at = 0; k < p; k++) {
        for (i = 0; i < a2av_count(k, r); i++) {
            expect_elem(c, "all_to_all_v", d, out, at++, value(k, r, i));
        }
    }
    EXPECT(at == n_out);
    free(in);
    free(out);
}

static void gather_case(const rank_ctx *c, tutti_dtype d, size_t count, size_t root, int async) {
    size_t p = c->world, r = c->rank, k, i;
    void *in = alloc_elems(d, count);
    void *out = r == root ? alloc_elems(d, p * count) : NULL; /* NULL off the root */
    for (i = 0; i < count; i++) {
        set_elem(d, in, i, value(r, root, i));
    }
    if (async) {
        tutti_work *w = NULL;
        CHECK(tutti_gather_async(c->comm, count, d, root, in, out, &w));
        finish(w);
    } else {
        CHECK(tutti_gather(c->comm, count, d, root, in, out));
    }
    if (r == root) {
        for (k = 0; k < p; k++) {
            for (i = 0; i < count; i++) {
                expect_elem(c, "gather", d, out, k * count + i, value(k, root, i));
            }
        }
    }
    free(in);
    free(out);
}

static void scatter_case(const rank_ctx *c, tutti_dtype d, size_t count, size_t root, int async) {
    size_t p = c->world, r = c->rank, k, i;
    void *in = r == root ? alloc_elems(d, p * count) : NULL; /* NULL off the root */
    void *out = alloc_elems(d, count);
    if (r == root) {
        for (k = 0; k < p; k++) {
            for (i = 0; i < count; i++) {
                set_elem(d, in, k * count + i, value(root, k, i));
            }
        }
    }
    if (async) {
        tutti_work *w = NULL;
        CHECK(tutti_scatter_async(c->comm, count, d, root, in, out, &w));
        finish(w);
    } else {
        CHECK(tutti_scatter(c->comm, count, d, root, in, out));
    }
    for (i = 0; i < count; i++) {
        expect_elem(c, "scatter", d, out, i, value(root, r, i));
    }
    free(in);
    free(out);
}

static void all_gather_v_case(const rank_ctx *c, tutti_dtype d, int async) {
    size_t p = c->world, r = c->rank, k, i, at, total = 0;
    size_t counts[MAX_WORLD];
    void *in, *out;
    for (k = 0; k < p; k++) {
        counts[k] = v_count(k);
        total += counts[k];
    }
    in = alloc_elems(d, counts[r]);
    out = alloc_elems(d, total);
    for (i = 0; i < counts[r]; i++) {
        set_elem(d, in, i, value(r, 0, i) + (double)i);
    }
    if (async) {
        tutti_work *w = NULL;
        CHECK(tutti_all_gather_v_async(c->comm, counts, d, in, out, &w));
        /* The counts were copied when the call was issued. */
        memset(counts, 0xff, sizeof counts);
        finish(w);
    } else {
        CHECK(tutti_all_gather_v(c->comm, counts, d, in, out));
    }
    for (k = 0, at = 0; k < p; k++) {
        for (i = 0; i < v_count(k); i++) {
            expect_elem(c, "all_gather_v", d, out, at++, value(k, 0, i) + (double)i);
        }
    }
    EXPECT(at == total);
    free(in);
    free(out);
}

static void reduce_scatter_v_case(const rank_ctx *c, tutti_dtype d, tutti_op op, int async) {
    size_t p = c->world, r = c->rank, k, i, off = 0, total = 0;
    size_t counts[MAX_WORLD];
    void *in, *out;
    for (k = 0; k < p; k++) {
        counts[k] = v_count(k);
        total += counts[k];
        if (k < r) {
            off += counts[k];
        }
    }
    in = alloc_elems(d, total);
    out = alloc_elems(d, counts[r]);
    /* Rank s's element j: s + j % 7. */
    for (i = 0; i < total; i++) {
        set_elem(d, in, i, (double)(r + i % 7));
    }
    if (async) {
        tutti_work *w = NULL;
        CHECK(tutti_reduce_scatter_v_async(c->comm, counts, d, op, in, out, &w));
        memset(counts, 0xff, sizeof counts);
        finish(w);
    } else {
        CHECK(tutti_reduce_scatter_v(c->comm, counts, d, op, in, out));
    }
    for (i = 0; i < v_count(r); i++) {
        size_t j = off + i;
        double want = op == TUTTI_OP_SUM ? (double)(p * (j % 7) + p * (p - 1) / 2)
                                         : (double)(p - 1 + j % 7); /* MAX */
        expect_elem(c, op == TUTTI_OP_SUM ? "reduce_scatter_v sum" : "reduce_scatter_v max", d,
                    out, i, want);
    }
    free(in);
    free(out);
}

/* Every call, blocking then _async, every dtype, every root. */
static void *every_call(void *arg) {
    rank_ctx *c = arg;
    size_t t, root, world = 0;
    int async;
    CHECK(tutti_comm_world_size(c->comm, &world));
    EXPECT(world == c->world);
    for (async = 0; async < 2; async++) {
        for (t = 0; t < NUM_DTYPES; t++) {
            tutti_dtype d = DTYPES[t];
            all_to_all_case(c, d, 3, async);
            all_to_all_case(c, d, 0, async);
            all_to_all_v_case(c, d, async);
            for (root = 0; root < c->world; root++) {
                gather_case(c, d, 5, root, async);
                scatter_case(c, d, 5, root, async);
            }
            gather_case(c, d, 0, c->world - 1, async);
            scatter_case(c, d, 0, 0, async);
            all_gather_v_case(c, d, async);
            reduce_scatter_v_case(c, d, TUTTI_OP_SUM, async);
            reduce_scatter_v_case(c, d, TUTTI_OP_MAX, async);
        }
    }
    return NULL;
}

/* Many in flight: every new call issued before any is waited for, each with its own
 * buffers; they complete in issue order and each result is right. */
static void *all_in_flight(void *arg) {
    rank_ctx *c = arg;
    size_t p = c->world, r = c->rank, k, i, at;
    int32_t a2a_in[MAX_WORLD * 2], a2a_out[MAX_WORLD * 2];
    int32_t v_in[MAX_WORLD], v_out[MAX_WORLD * MAX_WORLD];
    int32_t g_in[2], g_out[MAX_WORLD * 2], s_in[MAX_WORLD * 2], s_out[2];
    int32_t rs_in[MAX_WORLD * 3], rs_out[3];
    size_t send[MAX_WORLD], recv[MAX_WORLD], counts[MAX_WORLD], rs_counts[MAX_WORLD];
    size_t n_in = 0, v_total = 0;
    tutti_work *w[6];
    for (k = 0; k < p; k++) {
        a2a_in[2 * k] = (int32_t)(100 * r + k);
        a2a_in[2 * k + 1] = -(int32_t)(100 * r + k);
        send[k] = k == r ? 1 : (r + k) % 2; /* rank r sends rank k this many */
        recv[k] = k == r ? 1 : (r + k) % 2;
        counts[k] = k + 1;
        v_total += counts[k];
        rs_counts[k] = 3;
        s_in[2 * k] = (int32_t)(7 * k);
        s_in[2 * k + 1] = (int32_t)(7 * k + 1);
    }
    for (k = 0; k < p; k++) {
        for (i = 0; i < send[k]; i++) {
            v_in[n_in++] = (int32_t)(10 * r + k);
        }
    }
    g_in[0] = (int32_t)r;
    g_in[1] = (int32_t)(r * r);
    for (i = 0; i < 3 * p; i++) {
        rs_in[i] = (int32_t)(i + r);
    }
    {
        int32_t agv_in[MAX_WORLD];
        for (i = 0; i < r + 1; i++) {
            agv_in[i] = (int32_t)(1000 * r + i);
        }
        CHECK(tutti_all_to_all_async(c->comm, 2, TUTTI_DTYPE_I32, a2a_in, a2a_out, &w[0]));
        CHECK(tutti_all_to_all_v_async(c->comm, send, recv, TUTTI_DTYPE_I32, v_in, v_out, &w[1]));
        CHECK(tutti_gather_async(c->comm, 2, TUTTI_DTYPE_I32, p - 1, g_in,
                                 r == p - 1 ? g_out : NULL, &w[2]));
        CHECK(tutti_scatter_async(c->comm, 2, TUTTI_DTYPE_I32, 0, r == 0 ? s_in : NULL, s_out,
                                  &w[3]));
        CHECK(tutti_all_gather_v_async(c->comm, counts, TUTTI_DTYPE_I32, agv_in, v_out + n_in,
                                       &w[4]));
        CHECK(tutti_reduce_scatter_v_async(c->comm, rs_counts, TUTTI_DTYPE_I32, TUTTI_OP_SUM,
                                           rs_in, rs_out, &w[5]));
        for (k = 6; k-- > 0;) {
            finish(w[k]);
        }
    }
    for (k = 0; k < p; k++) {
        EXPECT(a2a_out[2 * k] == (int32_t)(100 * k + r));
        EXPECT(a2a_out[2 * k + 1] == -(int32_t)(100 * k + r));
    }
    for (k = 0, at = 0; k < p; k++) {
        for (i = 0; i < recv[k]; i++) {
            EXPECT(v_out[at++] == (int32_t)(10 * k + r));
        }
    }
    EXPECT(at == n_in); /* every pair symmetric: received as many as sent */
    for (k = 0; k < p; k++) {
        for (i = 0; i < k + 1; i++) {
            EXPECT(v_out[at++] == (int32_t)(1000 * k + i));
        }
    }
    EXPECT(at == n_in + v_total);
    if (r == p - 1) {
        for (k = 0; k < p; k++) {
            EXPECT(g_out[2 * k] == (int32_t)k && g_out[2 * k + 1] == (int32_t)(k * k));
        }
    }
    EXPECT(s_out[0] == (int32_t)(7 * r) && s_out[1] == (int32_t)(7 * r + 1));
    for (i = 0; i < 3; i++) {
        /* sum over ranks s of (3r + i + s) */
        EXPECT(rs_out[i] == (int32_t)(p * (3 * r + i) + p * (p - 1) / 2));
    }
    return NULL;
}

/* ----- argument errors this rank rejects before taking part: INVALID_ARGUMENT naming the
 * problem; the group is aborted so that its peers fail at once ----- */

static void *reject_rank(void *arg) {
    rank_ctx *c = arg;
    const char *which = c->arg;
    float x[16] = {0};
    size_t ok_counts[3] = {1, 1, 1};
    double t0 = now_seconds();
    tutti_work *w = NULL;
    if (c->rank == 1) {
        if (strcmp(which, "all_gather_v NULL counts") == 0) {
            EXPECT_ERROR(tutti_all_gather_v(c->comm, NULL, TUTTI_DTYPE_F32, x, x + 4),
                         TUTTI_ERROR_INVALID_ARGUMENT, "tutti_all_gather_v: rank 1",
                         "counts is NULL but must hold one count per rank (3 size_t values)");
        } else if (strcmp(which, "reduce_scatter_v NULL counts") == 0) {
            EXPECT_ERROR(tutti_reduce_scatter_v(c->comm, NULL, TUTTI_DTYPE_F32, TUTTI_OP_SUM, x,
                                                x + 4),
                         TUTTI_ERROR_INVALID_ARGUMENT, "tutti_reduce_scatter_v", "counts is NULL");
        } else if (strcmp(which, "all_to_all_v NULL send_counts") == 0) {
            EXPECT_ERROR(tutti_all_to_all_v(c->comm, NULL, ok_counts, TUTTI_DTYPE_F32, x, x + 4),
                         TUTTI_ERROR_INVALID_ARGUMENT, "tutti_all_to_all_v", "send_counts is NULL");
        } else if (strcmp(which, "all_to_all_v_async NULL recv_counts") == 0) {
            EXPECT_ERROR(tutti_all_to_all_v_async(c->comm, ok_counts, NULL, TUTTI_DTYPE_F32, x,
                                                  x + 4, &w),
                         TUTTI_ERROR_INVALID_ARGUMENT, "tutti_all_to_all_v_async",
                         "recv_counts is NULL");
            EXPECT(w == NULL); /* no handle written */
        } else if (strcmp(which, "all_gather_v counts overflow") == 0) {
            size_t huge[3] = {SIZE_MAX, 1, 1};
            EXPECT_ERROR(tutti_all_gather_v(c->comm, huge, TUTTI_DTYPE_F32, x, x + 4),
                         TUTTI_ERROR_INVALID_ARGUMENT, "the entries of counts sum to more f32",
                         "than a buffer can hold");
        } else if (strcmp(which, "all_to_all overlap") == 0) {
            EXPECT_ERROR(tutti_all_to_all(c->comm, 2, TUTTI_DTYPE_F32, x, x + 3),
                         TUTTI_ERROR_INVALID_ARGUMENT, "tutti_all_to_all", "overlap",
                         "all-to-all cannot run in place");
        } else if (strcmp(which, "all_to_all same buffer") == 0) {
            EXPECT_ERROR(tutti_all_to_all_async(c->comm, 2, TUTTI_DTYPE_F32, x, x, &w),
                         TUTTI_ERROR_INVALID_ARGUMENT, "cannot run in place");
        } else if (strcmp(which, "all_to_all_v overlap") == 0) {
            EXPECT_ERROR(tutti_all_to_all_v(c->comm, ok_counts, ok_counts, TUTTI_DTYPE_F32, x,
                                            x + 2),
                         TUTTI_ERROR_INVALID_ARGUMENT, "all-to-all-v cannot run in place");
        } else if (strcmp(which, "gather overlap at the root") == 0) {
            EXPECT_ERROR(tutti_gather(c->comm, 2, TUTTI_DTYPE_F32, 1, x + 2, x),
                         TUTTI_ERROR_INVALID_ARGUMENT, "tutti_gather", "gather cannot run in place");
        } else if (strcmp(which, "gather NULL output at the root") == 0) {
            EXPECT_ERROR(tutti_gather(c->comm, 2, TUTTI_DTYPE_F32, 1, x, NULL),
                         TUTTI_ERROR_INVALID_ARGUMENT,
                         "output (at the root) is NULL but must hold 6 f32 elements");
        } else if (strcmp(which, "scatter overlap at the root") == 0) {
            EXPECT_ERROR(tutti_scatter_async(c->comm, 2, TUTTI_DTYPE_F32, 1, x, x + 5, &w),
                         TUTTI_ERROR_INVALID_ARGUMENT, "tutti_scatter_async",
                         "scatter cannot run in place");
        } else if (strcmp(which, "scatter NULL input at the root") == 0) {
            EXPECT_ERROR(tutti_scatter(c->comm, 2, TUTTI_DTYPE_F32, 1, NULL, x),
                         TUTTI_ERROR_INVALID_ARGUMENT,
                         "input (at the root) is NULL but must hold 6 f32 elements");
        } else if (strcmp(which, "scatter NULL output") == 0) {
            EXPECT_ERROR(tutti_scatter(c->comm, 2, TUTTI_DTYPE_F32, 0, NULL, NULL),
                         TUTTI_ERROR_INVALID_ARGUMENT, "output is NULL but must hold 2 f32");
        } else if (strcmp(which, "all_gather_v overlap") == 0) {
            /* rank 1's input (counts[1] = 1 element) inside the output */
            EXPECT_ERROR(tutti_all_gather_v(c->comm, ok_counts, TUTTI_DTYPE_F32, x + 1, x),
                         TUTTI_ERROR_INVALID_ARGUMENT, "all-gather-v cannot run in place");
        } else if (strcmp(which, "reduce_scatter_v overlap") == 0) {
            EXPECT_ERROR(tutti_reduce_scatter_v_async(c->comm, ok_counts, TUTTI_DTYPE_F32,
                                                      TUTTI_OP_SUM, x, x + 1, &w),
                         TUTTI_ERROR_INVALID_ARGUMENT, "reduce-scatter-v cannot run in place");
        } else if (strcmp(which, "reduce_scatter_v bad op") == 0) {
            EXPECT_ERROR(tutti_reduce_scatter_v(c->comm, ok_counts, TUTTI_DTYPE_F32, (tutti_op)42,
                                                x, x + 4),
                         TUTTI_ERROR_INVALID_ARGUMENT, "op 42 is not a tutti_op");
        } else if (strcmp(which, "gather NULL work") == 0) {
            EXPECT_ERROR(tutti_gather_async(c->comm, 2, TUTTI_DTYPE_F32, 0, x, x + 8, NULL),
                         TUTTI_ERROR_INVALID_ARGUMENT, "work is NULL");
        } else {
            FAIL("unknown case %s", which);
        }
        EXPECT(w == NULL);
    } else {
        EXPECT_ERROR(tutti_barrier(c->comm), TUTTI_ERROR_ABORTED, "rank 1 rejected its arguments");
    }
    if (now_seconds() - t0 > 20) {
        FAIL("rank %zu waited %.1f s for a peer that had rejected its arguments", c->rank,
             now_seconds() - t0);
    }
    return NULL;
}

static void rejected_arguments(void) {
    static const char *cases[] = {
        "all_gather_v NULL counts",       "reduce_scatter_v NULL counts",
        "all_to_all_v NULL send_counts",  "all_to_all_v_async NULL recv_counts",
        "all_gather_v counts overflow",   "all_to_all overlap",
        "all_to_all same buffer",         "all_to_all_v overlap",
        "gather overlap at the root",     "gather NULL output at the root",
        "scatter overlap at the root",    "scatter NULL input at the root",
        "scatter NULL output",            "all_gather_v overlap",
        "reduce_scatter_v overlap",       "reduce_scatter_v bad op",
        "gather NULL work",
    };
    tutti_config config = TUTTI_CONFIG_INIT;
    size_t i, r;
    config.timeout_ms = 60000;
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tutti_comm *comms[3];
        CHECK(tutti_comm_create_group(3, &config, comms));
        run_ranks(3, comms, reject_rank, (void *)cases[i]);
        for (r = 0; r < 3; r++) {
            tutti_comm_destroy(comms[r]);
        }
    }
}

/* ----- errors the communicator finds: a wrong root, counts that disagree between ranks;
 * every rank fails with a message naming the problem ----- */

static void *agreed_errors(void *arg) {
    rank_ctx *c = arg;
    size_t r = c->rank;
    int32_t x[8] = {0}, y[8] = {0};
    size_t counts[2], send[2], recv[2];

    /* a root out of range on rank 1: its own error; rank 0 is told who refused */
    if (r == 1) {
        EXPECT_ERROR(tutti_gather(c->comm, 2, TUTTI_DTYPE_I32, 7, x, NULL),
                     TUTTI_ERROR_INVALID_ARGUMENT, "gather", "rank 1",
                     "root 7 is out of range for a world of 2 ranks");
    } else {
        EXPECT_ERROR(tutti_gather(c->comm, 2, TUTTI_DTYPE_I32, 0, x, y),
                     TUTTI_ERROR_PEER_REJECTED, "rank 1 rejected its arguments", "root 7");
    }
    /* the same wrong root everywhere, async: the call is issued, its handle has the error */
    {
        tutti_work *w = NULL;
        CHECK(tutti_scatter_async(c->comm, 2, TUTTI_DTYPE_I32, 2, NULL, x, &w));
        EXPECT_ERROR(tutti_work_wait(w, 0), TUTTI_ERROR_INVALID_ARGUMENT, "scatter",
                     "root 2 is out of range for a world of 2 ranks");
        tutti_work_destroy(w);
    }
    /* counts that differ between ranks (rank 0: 1 + 2, rank 1: 1 + 3) */
    counts[0] = 1;
    counts[1] = r == 0 ? 2 : 3;
    EXPECT_ERROR(tutti_all_gather_v(c->comm, counts, TUTTI_DTYPE_I32, x + 4, y),
                 TUTTI_ERROR_MISMATCH, "all_gather_v", r == 0 ? "count is 3 here but 4 on rank 1"
                                                              : "count is 4 here but 3 on rank 0");
    EXPECT(y[0] == 0); /* nothing written */
    /* after which the group still works */
    {
        bool aborted = true;
        CHECK(tutti_comm_is_aborted(c->comm, &aborted));
        EXPECT(!aborted);
    }
    x[0] = (int32_t)(r + 1);
    x[1] = (int32_t)(10 * (r + 1));
    CHECK(tutti_all_to_all(c->comm, 1, TUTTI_DTYPE_I32, x, y));
    /* block r of every rank's input: rank 0 gets {1, 2}, rank 1 gets {10, 20} */
    EXPECT(y[0] == (r == 0 ? 1 : 10) && y[1] == (r == 0 ? 2 : 20));

    /* all_to_all_v: rank 0 sends rank 1 two elements where rank 1 expects one. The exchange
     * finds it on whichever rank of the pair sees it first, which names both ranks and both
     * lengths and aborts the group (the other rank fails with that reason, or has finished
     * its part and fails at its next call); rank 1 cannot succeed. */
    send[0] = 1;
    send[1] = r == 0 ? 2 : 1;
    recv[0] = 1;
    recv[1] = 1;
    {
        char m[2048];
        tutti_result got = tutti_all_to_all_v(c->comm, send, recv, TUTTI_DTYPE_I32, x, y);
        last_error(m, sizeof m);
        if (got == TUTTI_SUCCESS ? r == 1
                                 : (got != TUTTI_ERROR_INVALID_ARGUMENT &&
                                    got != TUTTI_ERROR_ABORTED) ||
                                       (strstr(m, "rank 0 sent 8 bytes where 4 were expected") ==
                                            NULL &&
                                        strstr(m, "rank 1 expected 4 bytes where 8 were sent") ==
                                            NULL)) {
            FAIL("rank %zu: all_to_all_v with pairs that disagree returned %u: %s", r,
                 (unsigned)got, m);
        }
    }
    EXPECT_ERROR(tutti_barrier(c->comm), TUTTI_ERROR_ABORTED, "all_to_all_v", "bytes");
    return NULL;
}

/* tutti_comm_split: colors rank % 2 (rank 3 none), keys descending; an all-reduce in each
 * group; a NULL newcomm refused. */
static void *split_ranks(void *p) {
    rank_ctx *c = p;
    tutti_comm *sub = (tutti_comm *)1;
    int64_t color = c->rank == 3 ? -1 : (int64_t)(c->rank % 2);
    size_t sub_rank = 99, sub_world = 99;
    double v;
    CHECK(tutti_comm_split(c->comm, color, -(int64_t)c->rank, &sub));
    if (color < 0) {
        EXPECT(sub == NULL);
        return NULL;
    }
    EXPECT(sub != NULL);
    CHECK(tutti_comm_rank(sub, &sub_rank));
    CHECK(tutti_comm_world_size(sub, &sub_world));
    /* 4 ranks: evens {0, 2} ranked 2, 0; odds {1} alone (rank 3 has no color). */
    EXPECT(sub_world == (c->rank % 2 == 0 ? 2u : 1u));
    EXPECT(sub_rank == (c->rank == 0 ? 1u : 0u));
    v = (double)c->rank;
    CHECK(tutti_all_reduce(sub, 1, TUTTI_DTYPE_F64, TUTTI_OP_SUM, &v, &v));
    EXPECT(v == (c->rank % 2 == 0 ? 2.0 : 1.0));
    tutti_comm_destroy(sub);
    return NULL;
}

int main(void) {
    tutti_config config = TUTTI_CONFIG_INIT;
    tutti_comm *comms[MAX_WORLD];
    size_t world, r;
    float x[4] = {0};
    size_t counts[1] = {1};

    config.timeout_ms = 60000;
    for (world = 1; world <= MAX_WORLD; world++) {
        CHECK(tutti_comm_create_group(world, &config, comms));
        run_ranks(world, comms, every_call, NULL);
        run_ranks(world, comms, all_in_flight, NULL);
        for (r = 0; r < world; r++) {
            tutti_comm_destroy(comms[r]);
        }
    }

    CHECK(tutti_comm_create_group(4, &config, comms));
    run_ranks(4, comms, split_ranks, NULL);
    for (r = 0; r < 4; r++) {
        tutti_comm_destroy(comms[r]);
    }
    CHECK(tutti_comm_create_group(1, &config, comms));
    EXPECT_ERROR(tutti_comm_split(comms[0], 0, 0, NULL), TUTTI_ERROR_INVALID_ARGUMENT,
                 "tutti_comm_split", "newcomm is NULL");
    /* Threads of one process fail together: there are no survivors to shrink to. */
    EXPECT_ERROR(tutti_comm_shrink(comms[0], comms + 1), TUTTI_ERROR_UNAVAILABLE,
                 "tutti_comm_shrink", "group of threads");
    tutti_comm_destroy(comms[0]);

    /* One rank: every count from the communicator, zeros everywhere are fine. */
    CHECK(tutti_comm_create_group(1, &config, comms));
    counts[0] = 0;
    CHECK(tutti_all_gather_v(comms[0], counts, TUTTI_DTYPE_F32, NULL, NULL));
    CHECK(tutti_reduce_scatter_v(comms[0], counts, TUTTI_DTYPE_F32, TUTTI_OP_SUM, NULL, NULL));
    CHECK(tutti_all_to_all_v(comms[0], counts, counts, TUTTI_DTYPE_F32, NULL, NULL));
    tutti_comm_destroy(comms[0]);

    /* NULL communicators */
    EXPECT_ERROR(tutti_all_to_all(NULL, 1, TUTTI_DTYPE_F32, x, x + 1),
                 TUTTI_ERROR_INVALID_ARGUMENT, "tutti_all_to_all: comm is NULL");
    EXPECT_ERROR(tutti_all_to_all_v(NULL, counts, counts, TUTTI_DTYPE_F32, x, x + 1),
                 TUTTI_ERROR_INVALID_ARGUMENT, "tutti_all_to_all_v: comm is NULL");
    EXPECT_ERROR(tutti_gather(NULL, 1, TUTTI_DTYPE_F32, 0, x, x + 1),
                 TUTTI_ERROR_INVALID_ARGUMENT, "tutti_gather: comm is NULL");
    EXPECT_ERROR(tutti_scatter(NULL, 1, TUTTI_DTYPE_F32, 0, x, x + 1),
                 TUTTI_ERROR_INVALID_ARGUMENT, "tutti_scatter: comm is NULL");
    EXPECT_ERROR(tutti_all_gather_v(NULL, counts, TUTTI_DTYPE_F32, x, x + 1),
                 TUTTI_ERROR_INVALID_ARGUMENT, "tutti_all_gather_v: comm is NULL");
    EXPECT_ERROR(tutti_reduce_scatter_v_async(NULL, counts, TUTTI_DTYPE_F32, TUTTI_OP_SUM, x,
                                              x + 1, NULL),
                 TUTTI_ERROR_INVALID_ARGUMENT, "tutti_reduce_scatter_v_async: comm is NULL");

    rejected_arguments();

    CHECK(tutti_comm_create_group(2, &config, comms));
    run_ranks(2, comms, agreed_errors, NULL);
    tutti_comm_destroy(comms[0]);
    tutti_comm_destroy(comms[1]);

    printf("blocks: every new collective on 1 to %d ranks, blocking and async, and its errors: "
           "ok\n",
           MAX_WORLD);
    return 0;
}
