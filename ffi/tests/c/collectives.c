/* A 4-rank in-process group, a thread per rank: every collective with every algorithm over
 * several dtypes and ops, out of place and in place, every value checked. */
#include "check.h"

#define WORLD 4
#define COUNT 1031 /* not a multiple of the world size, to exercise uneven slices */

typedef struct algo {
    tutti_algorithm algorithm;
    uint32_t arg;
    const char *name;
} algo;

static const algo ALGOS[] = {
    {TUTTI_ALGORITHM_AUTO, 0, "auto"},
    {TUTTI_ALGORITHM_DIRECT, 0, "direct"},
    {TUTTI_ALGORITHM_RING, 0, "ring"},
    {TUTTI_ALGORITHM_HIERARCHICAL_COPY, 0, "hierarchical-copy"},
    {TUTTI_ALGORITHM_HIERARCHICAL_COPY, 4, "hierarchical-copy:4"},
    {TUTTI_ALGORITHM_REDUCE_TO_ONE, 0, "reduce-to-one"},
    {TUTTI_ALGORITHM_REDUCE_TO_ONE, 3, "reduce-to-one:3"},
};
#define NUM_ALGOS (sizeof ALGOS / sizeof ALGOS[0])

static const tutti_dtype DTYPES[] = {
    TUTTI_DTYPE_F32, TUTTI_DTYPE_F64, TUTTI_DTYPE_F16, TUTTI_DTYPE_BF16, TUTTI_DTYPE_I8,
    TUTTI_DTYPE_U8,  TUTTI_DTYPE_I32, TUTTI_DTYPE_U32, TUTTI_DTYPE_I64,  TUTTI_DTYPE_U64,
};
#define NUM_DTYPES (sizeof DTYPES / sizeof DTYPES[0])

static const tutti_op OPS[] = {TUTTI_OP_SUM, TUTTI_OP_PROD, TUTTI_OP_MIN, TUTTI_OP_MAX,
                               TUTTI_OP_MEAN};
/* torch's and NCCL's name for the mean. */
_Static_assert(TUTTI_OP_AVG == TUTTI_OP_MEAN, "TUTTI_OP_AVG is TUTTI_OP_MEAN");
#define NUM_OPS (sizeof OPS / sizeof OPS[0])

/* Rank r's element i: small integers, exact in every dtype. */
static double input_value(size_t rank, size_t i) {
    return (double)((rank + 1) * (i % 5 + 1));
}

/* The reduction over WORLD ranks of input_value(., i), as the dtype computes it. */
static double expected(tutti_dtype d, tutti_op op, size_t i) {
    double k = (double)(i % 5 + 1), sum = 10 * k;
    switch (op) {
    case TUTTI_OP_SUM:
        return sum;
    case TUTTI_OP_PROD: {
        double p = 24 * k * k * k * k; /* (1·2·3·4) k^4, at most 15000 */
        if (d == TUTTI_DTYPE_I8) {
            return (double)(int8_t)(uint8_t)((unsigned long)p % 256); /* wraps */
        }
        if (d == TUTTI_DTYPE_U8) {
            return (double)((unsigned long)p % 256);
        }
        return p;
    }
    case TUTTI_OP_MIN:
        return k;
    case TUTTI_OP_MAX:
        return 4 * k;
    default:
        /* integer MEAN truncates toward zero */
        return is_float(d) ? sum / WORLD : (double)((long)sum / WORLD);
    }
}

/* bf16 and f16 products beyond their precision are rounded; compare within a relative bound. */
static int close_enough(tutti_dtype d, double got, double want) {
    double tol = 0;
    if (d == TUTTI_DTYPE_BF16) {
        tol = 1.0 / 128;
    } else if (d == TUTTI_DTYPE_F16) {
        tol = 1.0 / 1024;
    }
    double diff = got > want ? got - want : want - got;
    return diff <= tol * (want < 0 ? -want : want);
}

static void check_buffer(const rank_ctx *c, const char *what, tutti_dtype d, tutti_op op,
                         const void *buf, size_t count) {
    size_t i;
    for (i = 0; i < count; i++) {
        double got = get_elem(d, buf, i), want = expected(d, op, i);
        if (!close_enough(d, got, want)) {
            FAIL("rank %zu, %s, dtype %s, op %u: element %zu is %g, expected %g", c->rank, what,
                 dtype_name(d), (unsigned)op, i, got, want);
        }
    }
}

static void all_reduce_case(const rank_ctx *c, const algo *a, tutti_dtype d, tutti_op op) {
    size_t es = dtype_size(d), i;
    void *in = malloc(COUNT * es), *out = malloc(COUNT * es);
    char what[128];
    EXPECT(in && out);
    for (i = 0; i < COUNT; i++) {
        set_elem(d, in, i, input_value(c->rank, i));
        set_elem(d, out, i, -1);
    }
    CHECK(tutti_all_reduce(c->comm, COUNT, d, op, in, out));
    snprintf(what, sizeof what, "all_reduce %s", a->name);
    check_buffer(c, what, d, op, out, COUNT);
    for (i = 0; i < COUNT; i++) {
        if (get_elem(d, in, i) != input_value(c->rank, i)) {
            FAIL("rank %zu: all_reduce %s changed its input", c->rank, a->name);
        }
    }
    /* in place */
    CHECK(tutti_all_reduce(c->comm, COUNT, d, op, in, in));
    snprintf(what, sizeof what, "in-place all_reduce %s", a->name);
    check_buffer(c, what, d, op, in, COUNT);
    free(in);
    free(out);
}

static void other_collectives(const rank_ctx *c, const algo *a, tutti_dtype d) {
    size_t es = dtype_size(d), n = 257, i, r;
    unsigned char *buf = malloc(WORLD * n * es), *mine = malloc(n * es);
    EXPECT(buf && mine);

    /* broadcast from rank 2 */
    for (i = 0; i < n; i++) {
        set_elem(d, buf, i, c->rank == 2 ? (double)(i % 100) : 0);
    }
    CHECK(tutti_broadcast(c->comm, n, d, 2, buf));
    for (i = 0; i < n; i++) {
        if (get_elem(d, buf, i) != (double)(i % 100)) {
            FAIL("rank %zu: broadcast %s %s: element %zu is %g", c->rank, a->name, dtype_name(d),
                 i, get_elem(d, buf, i));
        }
    }

    /* all-gather out of place, then in place */
    for (i = 0; i < n; i++) {
        set_elem(d, mine, i, (double)(c->rank * 10 + i % 7));
    }
    CHECK(tutti_all_gather(c->comm, n, d, mine, buf));
    for (r = 0; r < WORLD; r++) {
        for (i = 0; i < n; i++) {
            if (get_elem(d, buf, r * n + i) != (double)(r * 10 + i % 7)) {
                FAIL("rank %zu: all_gather %s %s: slice %zu element %zu is %g", c->rank, a->name,
                     dtype_name(d), r, i, get_elem(d, buf, r * n + i));
            }
        }
    }
    memset(buf, 0, WORLD * n * es);
    memcpy(buf + c->rank * n * es, mine, n * es);
    CHECK(tutti_all_gather(c->comm, n, d, buf + c->rank * n * es, buf));
    for (r = 0; r < WORLD; r++) {
        EXPECT(get_elem(d, buf, r * n + 3) == (double)(r * 10 + 3));
    }

    /* reduce-scatter: rank r gets slice r of the sum */
    for (r = 0; r < WORLD; r++) {
        for (i = 0; i < n; i++) {
            set_elem(d, buf, r * n + i, (double)(c->rank + r + i % 3));
        }
    }
    CHECK(tutti_reduce_scatter(c->comm, n, d, TUTTI_OP_SUM, buf, mine));
    for (i = 0; i < n; i++) {
        /* sum over ranks q of (q + rank + i%3) = 6 + 4·rank + 4·(i%3) */
        double want = (double)(6 + 4 * c->rank + 4 * (i % 3));
        if (get_elem(d, mine, i) != want) {
            FAIL("rank %zu: reduce_scatter %s %s: element %zu is %g, expected %g", c->rank,
                 a->name, dtype_name(d), i, get_elem(d, mine, i), want);
        }
    }
    /* in place: the output is this rank's slice of the input */
    CHECK(tutti_reduce_scatter(c->comm, n, d, TUTTI_OP_MAX, buf, buf + c->rank * n * es));
    EXPECT(get_elem(d, buf, c->rank * n + 1) == (double)(3 + c->rank + 1));

    /* reduce onto rank 1 (MAX); off the root the output is not used */
    for (i = 0; i < n; i++) {
        set_elem(d, mine, i, (double)(c->rank * 3 + i % 4));
    }
    CHECK(tutti_reduce(c->comm, n, d, TUTTI_OP_MAX, 1, mine, c->rank == 1 ? buf : NULL));
    if (c->rank == 1) {
        for (i = 0; i < n; i++) {
            EXPECT(get_elem(d, buf, i) == (double)(9 + i % 4));
        }
    }
    /* in place at the root */
    CHECK(tutti_reduce(c->comm, n, d, TUTTI_OP_SUM, 1, mine, mine));
    if (c->rank == 1) {
        EXPECT(get_elem(d, mine, 2) == (double)(18 + 4 * 2));
    }
    CHECK(tutti_barrier(c->comm));
    free(buf);
    free(mine);
}

/* Rank r's element i for the bitwise ops: every bit of the word in play. */
static uint32_t bits32(size_t rank, size_t i) {
    uint32_t x = (uint32_t)(i + 1) * 0x9E3779B9u ^ (0x85EBCA6Bu >> rank) ^ ((uint32_t)rank << 29);
    return x ^ (x >> 15);
}

static uint32_t bitwise_fold(tutti_op op, size_t i, size_t shift) {
    uint32_t acc = bits32(0, i + shift), r;
    for (r = 1; r < WORLD; r++) {
        uint32_t v = bits32(r, i + shift);
        acc = op == TUTTI_OP_BAND ? acc & v : op == TUTTI_OP_BOR ? acc | v : acc ^ v;
    }
    return acc;
}

/* BAND, BOR, BXOR on u32 (all-reduce out of place and in place, reduce-scatter, reduce) and
 * on i64 (all-reduce, the high half of every element in play), every value checked. */
static void bitwise_case(const rank_ctx *c, const algo *a) {
    static const tutti_op BITWISE[] = {TUTTI_OP_BAND, TUTTI_OP_BOR, TUTTI_OP_BXOR};
    uint32_t in[WORLD * 37], out[WORLD * 37];
    int64_t wide[37];
    size_t o, i, n = 37;
    for (o = 0; o < 3; o++) {
        tutti_op op = BITWISE[o];
        for (i = 0; i < n; i++) {
            in[i] = bits32(c->rank, i);
            out[i] = 0;
        }
        CHECK(tutti_all_reduce(c->comm, n, TUTTI_DTYPE_U32, op, in, out));
        CHECK(tutti_all_reduce(c->comm, n, TUTTI_DTYPE_U32, op, in, in));
        for (i = 0; i < n; i++) {
            if (out[i] != bitwise_fold(op, i, 0) || in[i] != out[i]) {
                FAIL("rank %zu: all_reduce %s op %u u32: element %zu is %08x (in place %08x), "
                     "expected %08x",
                     c->rank, a->name, (unsigned)op, i, out[i], in[i], bitwise_fold(op, i, 0));
            }
        }
        /* reduce-scatter: slice `rank` of the reduction of WORLD·n elements */
        for (i = 0; i < WORLD * n; i++) {
            in[i] = bits32(c->rank, i + 1000);
        }
        CHECK(tutti_reduce_scatter(c->comm, n, TUTTI_DTYPE_U32, op, in, out));
        for (i = 0; i < n; i++) {
            EXPECT(out[i] == bitwise_fold(op, c->rank * n + i, 1000));
        }
        /* reduce onto rank 3 */
        for (i = 0; i < n; i++) {
            in[i] = bits32(c->rank, i);
        }
        CHECK(tutti_reduce(c->comm, n, TUTTI_DTYPE_U32, op, 3, in, c->rank == 3 ? out : NULL));
        if (c->rank == 3) {
            for (i = 0; i < n; i++) {
                EXPECT(out[i] == bitwise_fold(op, i, 0));
            }
        }
        /* i64: the same words in the high half, their complement in the low half */
        for (i = 0; i < n; i++) {
            uint64_t v = bits32(c->rank, i);
            wide[i] = (int64_t)(v << 32 | (uint32_t)~v);
        }
        CHECK(tutti_all_reduce(c->comm, n, TUTTI_DTYPE_I64, op, wide, wide));
        for (i = 0; i < n; i++) {
            uint64_t hi = bitwise_fold(op, i, 0), r, lo = (uint32_t)~bits32(0, i);
            for (r = 1; r < WORLD; r++) {
                uint32_t v = (uint32_t)~bits32(r, i);
                lo = op == TUTTI_OP_BAND ? lo & v : op == TUTTI_OP_BOR ? lo | v : lo ^ v;
            }
            EXPECT((uint64_t)wide[i] == (hi << 32 | lo));
        }
    }
}

/* A bitwise op on a float dtype: an argument error naming the op and the dtype, before
 * anything is sent; made by one rank alone, the others are told which rank refused. The
 * group goes on working. */
static void bitwise_on_floats(const rank_ctx *c) {
    float x[4] = {1, 2, 3, 4};
    double y[2] = {1, 2};
    EXPECT_ERROR(tutti_all_reduce(c->comm, 4, TUTTI_DTYPE_F32, TUTTI_OP_BAND, x, x),
                 TUTTI_ERROR_INVALID_ARGUMENT, "band is defined on integer types only, not f32");
    EXPECT_ERROR(tutti_reduce(c->comm, 2, TUTTI_DTYPE_F64, TUTTI_OP_BOR, 0, y,
                              c->rank == 0 ? y : NULL),
                 TUTTI_ERROR_INVALID_ARGUMENT, "bor is defined on integer types only, not f64");
    if (c->rank == 2) {
        EXPECT_ERROR(tutti_all_reduce(c->comm, 4, TUTTI_DTYPE_F32, TUTTI_OP_BXOR, x, x),
                     TUTTI_ERROR_INVALID_ARGUMENT, "bxor is defined on integer types only, not f32");
    } else {
        EXPECT_ERROR(tutti_all_reduce(c->comm, 4, TUTTI_DTYPE_F32, TUTTI_OP_SUM, x, x),
                     TUTTI_ERROR_PEER_REJECTED, "rank 2", "bxor");
    }
    EXPECT(x[0] == 1 && x[3] == 4);
    {
        uint8_t v = (uint8_t)(1u << c->rank);
        CHECK(tutti_all_reduce(c->comm, 1, TUTTI_DTYPE_U8, TUTTI_OP_BOR, &v, &v));
        EXPECT(v == 0x0f);
    }
}

/* The pre-multiplied sums, in place and out of place: rank r scales by r + 1. */
static void premul_sums(rank_ctx *c) {
    size_t i, r = c->rank;
    float x[2 * WORLD], into[2 * WORLD], part[2];
    for (i = 0; i < 2 * WORLD; i++) {
        x[i] = (float)(i % 3);
    }
    CHECK(tutti_all_reduce_premul_sum(c->comm, 2 * WORLD, TUTTI_DTYPE_F32, (double)(r + 1), x,
                                      into));
    CHECK(tutti_reduce_scatter_premul_sum(c->comm, 2, TUTTI_DTYPE_F32, (double)(r + 1), x, part));
    CHECK(tutti_all_reduce_premul_sum(c->comm, 2 * WORLD, TUTTI_DTYPE_F32, (double)(r + 1), x, x));
    for (i = 0; i < 2 * WORLD; i++) {
        float want = (float)(i % 3) * (float)(WORLD * (WORLD + 1) / 2);
        EXPECT(into[i] == want && x[i] == want);
    }
    for (i = 0; i < 2; i++) {
        EXPECT(part[i] == (float)((2 * r + i) % 3) * (float)(WORLD * (WORLD + 1) / 2));
    }
    {
        /* In issue order: the pre-multiplied sums read their input when they start, after a
         * non-blocking all-reduce still writing it has completed; and they do not wait. */
        enum { N = 1 << 16 };
        static float big[WORLD][N], out[WORLD][N];
        float *b = big[r], *o = out[r];
        tutti_work *w[3] = {NULL, NULL, NULL};
        const float sum = (float)(WORLD * (WORLD + 1) / 2);
        for (i = 0; i < N; i++) {
            b[i] = (float)(r + 1);
        }
        CHECK(tutti_all_reduce_async(c->comm, N, TUTTI_DTYPE_F32, TUTTI_OP_SUM, b, b, &w[0]));
        CHECK(tutti_all_reduce_premul_sum_async(c->comm, N, TUTTI_DTYPE_F32, 2.0, b, b, &w[1]));
        CHECK(tutti_reduce_scatter_premul_sum_async(c->comm, N / WORLD, TUTTI_DTYPE_F32, 0.5, b,
                                                     o, &w[2]));
        for (i = 0; i < 3; i++) {
            CHECK(tutti_work_wait(w[i], 0));
            tutti_work_destroy(w[i]);
        }
        for (i = 0; i < N; i++) {
            EXPECT(b[i] == 2.0f * (float)WORLD * sum);
        }
        for (i = 0; i < N / WORLD; i++) {
            EXPECT(o[i] == (float)WORLD * (float)WORLD * sum);
        }
        /* And the blocking form after a call in flight. */
        for (i = 0; i < N; i++) {
            b[i] = (float)(r + 1);
        }
        CHECK(tutti_all_reduce_async(c->comm, N, TUTTI_DTYPE_F32, TUTTI_OP_SUM, b, b, &w[0]));
        CHECK(tutti_all_reduce_premul_sum(c->comm, N, TUTTI_DTYPE_F32, 3.0, b, b));
        CHECK(tutti_work_wait(w[0], 0));
        tutti_work_destroy(w[0]);
        EXPECT(b[0] == 3.0f * (float)WORLD * sum && b[N - 1] == b[0]);
    }
}

static void *rank_main(void *p) {
    rank_ctx *c = p;
    size_t a, d, o, rank = 99, world = 0;
    tutti_algorithm got;
    uint32_t arg;
    CHECK(tutti_comm_rank(c->comm, &rank));
    CHECK(tutti_comm_world_size(c->comm, &world));
    EXPECT(rank == c->rank && world == WORLD);
    for (a = 0; a < NUM_ALGOS; a++) {
        CHECK(tutti_comm_set_algorithm(c->comm, ALGOS[a].algorithm, ALGOS[a].arg));
        CHECK(tutti_comm_algorithm(c->comm, &got, &arg));
        EXPECT(got == ALGOS[a].algorithm);
        EXPECT(arg == (ALGOS[a].algorithm == TUTTI_ALGORITHM_HIERARCHICAL_COPY && ALGOS[a].arg == 0
                           ? 2u
                           : ALGOS[a].arg));
        for (d = 0; d < NUM_DTYPES; d++) {
            for (o = 0; o < NUM_OPS; o++) {
                all_reduce_case(c, &ALGOS[a], DTYPES[d], OPS[o]);
            }
            other_collectives(c, &ALGOS[a], DTYPES[d]);
        }
        bitwise_case(c, &ALGOS[a]);
    }
    bitwise_on_floats(c);
    premul_sums(c);
    return NULL;
}

/* A group whose algorithm comes from its config. */
static void *config_rank_main(void *p) {
    rank_ctx *c = p;
    tutti_algorithm got;
    uint32_t arg;
    uint64_t timeout_ms = 0;
    float x[3];
    CHECK(tutti_comm_algorithm(c->comm, &got, &arg));
    EXPECT(got == TUTTI_ALGORITHM_REDUCE_TO_ONE && arg == 2);
    CHECK(tutti_comm_timeout_ms(c->comm, &timeout_ms));
    EXPECT(timeout_ms == 45000);
    x[0] = (float)c->rank;
    x[1] = 1.0f;
    x[2] = -2.0f;
    CHECK(tutti_all_reduce(c->comm, 3, TUTTI_DTYPE_F32, TUTTI_OP_MEAN, x, x));
    EXPECT(x[0] == 1.5f && x[1] == 1.0f && x[2] == -2.0f);
    return NULL;
}

int main(void) {
    tutti_comm *comms[WORLD];
    tutti_config config = TUTTI_CONFIG_INIT;
    size_t r;

    config.timeout_ms = 60000;
    CHECK(tutti_comm_create_group(WORLD, &config, comms));
    run_ranks(WORLD, comms, rank_main, NULL);
    for (r = 0; r < WORLD; r++) {
        tutti_comm_destroy(comms[r]);
    }

    config.timeout_ms = 45000;
    config.algorithm = TUTTI_ALGORITHM_REDUCE_TO_ONE;
    config.algorithm_arg = 2;
    config.chunk_bytes = 64;
    CHECK(tutti_comm_create_group(WORLD, &config, comms));
    run_ranks(WORLD, comms, config_rank_main, NULL);
    for (r = 0; r < WORLD; r++) {
        tutti_comm_destroy(comms[r]);
    }

    /* NULL config: every default */
    CHECK(tutti_comm_create_group(1, NULL, comms));
    {
        int64_t v = 7;
        CHECK(tutti_all_reduce(comms[0], 1, TUTTI_DTYPE_I64, TUTTI_OP_SUM, &v, &v));
        EXPECT(v == 7);
    }
    tutti_comm_destroy(comms[0]);
    printf("collectives: %zu algorithms x %zu dtypes x %zu ops, and the bitwise ops, on %d "
           "ranks: ok\n",
           (size_t)NUM_ALGOS, (size_t)NUM_DTYPES, (size_t)NUM_OPS, WORLD);
    return 0;
}
