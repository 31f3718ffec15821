/* Every error path of the C API: NULL handles and pointers, bad enum values, count and
 * algorithm mismatches between ranks, roots out of range, misaligned and overlapping buffers,
 * bad config structs, abort from another thread, timeouts, destroy(NULL), and the text of the
 * last error. */
#include "check.h"

static tutti_config config_with_timeout(uint64_t ms) {
    tutti_config c = TUTTI_CONFIG_INIT;
    c.timeout_ms = ms;
    return c;
}

static void make_group(size_t n, uint64_t timeout_ms, tutti_comm **comms) {
    tutti_config c = config_with_timeout(timeout_ms);
    CHECK(tutti_comm_create_group(n, &c, comms));
}

static void destroy_group(size_t n, tutti_comm **comms) {
    size_t r;
    for (r = 0; r < n; r++) {
        tutti_comm_destroy(comms[r]);
    }
}

static void result_strings_and_last_error(void) {
    tutti_result codes[] = {TUTTI_SUCCESS,          TUTTI_ERROR_INVALID_ARGUMENT,
                            TUTTI_ERROR_MISMATCH,   TUTTI_ERROR_PEER_REJECTED,
                            TUTTI_ERROR_TIMEOUT,    TUTTI_ERROR_ABORTED,
                            TUTTI_ERROR_UNAVAILABLE, TUTTI_ERROR_SYSTEM,
                            TUTTI_ERROR_INTERNAL,   TUTTI_ERROR_PEER_LOST,
                            TUTTI_ERROR_WAIT_TIMEOUT, TUTTI_ERROR_TASK_LOST,
                            TUTTI_ERROR_STEP_FAILED};
    size_t i, j, n;
    char small[8], big[256];
    EXPECT(TUTTI_SUCCESS == 0);
    for (i = 0; i < sizeof codes / sizeof codes[0]; i++) {
        EXPECT(tutti_result_string(codes[i]) != NULL && tutti_result_string(codes[i])[0] != 0);
        for (j = 0; j < i; j++) {
            EXPECT(strcmp(tutti_result_string(codes[i]), tutti_result_string(codes[j])) != 0);
        }
    }
    EXPECT(strstr(tutti_result_string((tutti_result)12345), "unknown") != NULL);
    EXPECT(strstr(tutti_result_string(TUTTI_ERROR_ABORTED), "create a new group") != NULL);

    /* No error yet: empty. */
    EXPECT(tutti_last_error(big, sizeof big) == 0 && big[0] == 0);
    EXPECT(tutti_last_error(NULL, 0) == 0);

    /* A failure sets it, snprintf-style; a success clears it. */
    EXPECT(tutti_comm_rank(NULL, NULL) == TUTTI_ERROR_INVALID_ARGUMENT);
    n = tutti_last_error(NULL, 0);
    EXPECT(n == strlen("tutti_comm_rank: comm is NULL"));
    EXPECT(tutti_last_error(small, sizeof small) == n);
    EXPECT(strcmp(small, "tutti_c") == 0);
    EXPECT(tutti_last_error(big, 0) == n); /* len 0: nothing written */
    EXPECT(tutti_last_error(NULL, 100) == n);
    {
        size_t count = 0;
        CHECK(tutti_device_count(&count));
        EXPECT(count >= 1);
        EXPECT(tutti_last_error(big, sizeof big) == 0 && big[0] == 0);
    }
}

static void version(void) {
    uint32_t major = 99, minor = 99, patch = 99;
    char want[64];
    CHECK(tutti_version(&major, &minor, &patch));
    EXPECT(major == TUTTI_VERSION_MAJOR && minor == TUTTI_VERSION_MINOR &&
           patch == TUTTI_VERSION_PATCH);
    snprintf(want, sizeof want, "%u.%u.%u", major, minor, patch);
    EXPECT(strcmp(tutti_version_string(), want) == 0);
    EXPECT(strcmp(tutti_version_string(), TUTTI_VERSION_STRING) == 0);
    EXPECT_ERROR(tutti_version(&major, NULL, &patch), TUTTI_ERROR_INVALID_ARGUMENT,
                 "tutti_version", "minor is NULL");
}

static void devices(void) {
    tutti_device_info info = TUTTI_DEVICE_INFO_INIT;
    size_t count = 0;
    EXPECT_ERROR(tutti_device_count(NULL), TUTTI_ERROR_INVALID_ARGUMENT, "count is NULL");
    CHECK(tutti_device_count(&count));
    CHECK(tutti_device_get(0, &info));
    EXPECT(info.kind == TUTTI_DEVICE_CPU && strcmp(info.spec, "cpu:0") == 0);
    EXPECT(info.name[0] != 0);
    EXPECT_ERROR(tutti_device_get(count, &info), TUTTI_ERROR_INVALID_ARGUMENT, "out of range");
    EXPECT_ERROR(tutti_device_get(0, NULL), TUTTI_ERROR_INVALID_ARGUMENT, "info is NULL");
    info.struct_size = 0;
    EXPECT_ERROR(tutti_device_get(0, &info), TUTTI_ERROR_INVALID_ARGUMENT, "struct_size is 0",
                 "TUTTI_DEVICE_INFO_INIT");
}

static void destroy_null(void) {
    char m[64];
    /* Destroying NULL is a no-op and leaves the last error alone. */
    EXPECT(tutti_comm_rank(NULL, NULL) != TUTTI_SUCCESS);
    tutti_comm_destroy(NULL);
    tutti_replicas_destroy(NULL);
    tutti_last_error(m, sizeof m);
    EXPECT(strstr(m, "comm is NULL") != NULL);
}

static void null_handles_and_outputs(void) {
    float x[4] = {0};
    size_t s = 0;
    uint64_t t = 0;
    bool b = false;
    tutti_algorithm a;
    uint32_t arg;
    tutti_comm *comms[2] = {NULL, NULL};
    EXPECT_ERROR(tutti_all_reduce(NULL, 4, TUTTI_DTYPE_F32, TUTTI_OP_SUM, x, x),
                 TUTTI_ERROR_INVALID_ARGUMENT, "tutti_all_reduce: comm is NULL");
    EXPECT_ERROR(tutti_broadcast(NULL, 4, TUTTI_DTYPE_F32, 0, x), TUTTI_ERROR_INVALID_ARGUMENT,
                 "tutti_broadcast: comm is NULL");
    EXPECT_ERROR(tutti_all_gather(NULL, 1, TUTTI_DTYPE_F32, x, x), TUTTI_ERROR_INVALID_ARGUMENT,
                 "tutti_all_gather: comm is NULL");
    EXPECT_ERROR(tutti_reduce_scatter(NULL, 1, TUTTI_DTYPE_F32, TUTTI_OP_SUM, x, x),
                 TUTTI_ERROR_INVALID_ARGUMENT, "tutti_reduce_scatter: comm is NULL");
    EXPECT_ERROR(tutti_reduce(NULL, 1, TUTTI_DTYPE_F32, TUTTI_OP_SUM, 0, x, x),
                 TUTTI_ERROR_INVALID_ARGUMENT, "tutti_reduce: comm is NULL");
    EXPECT_ERROR(tutti_barrier(NULL), TUTTI_ERROR_INVALID_ARGUMENT, "tutti_barrier: comm is NULL");
    EXPECT_ERROR(tutti_comm_world_size(NULL, &s), TUTTI_ERROR_INVALID_ARGUMENT, "comm is NULL");
    EXPECT_ERROR(tutti_comm_timeout_ms(NULL, &t), TUTTI_ERROR_INVALID_ARGUMENT, "comm is NULL");
    EXPECT_ERROR(tutti_comm_algorithm(NULL, &a, &arg), TUTTI_ERROR_INVALID_ARGUMENT,
                 "comm is NULL");
    EXPECT_ERROR(tutti_comm_set_algorithm(NULL, TUTTI_ALGORITHM_RING, 0),
                 TUTTI_ERROR_INVALID_ARGUMENT, "comm is NULL");
    EXPECT_ERROR(tutti_comm_abort(NULL, "x"), TUTTI_ERROR_INVALID_ARGUMENT,
                 "tutti_comm_abort: comm is NULL");
    EXPECT_ERROR(tutti_comm_is_aborted(NULL, &b), TUTTI_ERROR_INVALID_ARGUMENT, "comm is NULL");

    make_group(1, 5000, comms);
    EXPECT_ERROR(tutti_comm_rank(comms[0], NULL), TUTTI_ERROR_INVALID_ARGUMENT, "rank is NULL");
    EXPECT_ERROR(tutti_comm_world_size(comms[0], NULL), TUTTI_ERROR_INVALID_ARGUMENT,
                 "world_size is NULL");
    EXPECT_ERROR(tutti_comm_timeout_ms(comms[0], NULL), TUTTI_ERROR_INVALID_ARGUMENT,
                 "timeout_ms is NULL");
    EXPECT_ERROR(tutti_comm_algorithm(comms[0], &a, NULL), TUTTI_ERROR_INVALID_ARGUMENT,
                 "arg is NULL");
    EXPECT_ERROR(tutti_comm_is_aborted(comms[0], NULL), TUTTI_ERROR_INVALID_ARGUMENT,
                 "aborted is NULL");
    /* Outputs are written only on success. */
    s = 12345;
    EXPECT_ERROR(tutti_comm_rank(NULL, &s), TUTTI_ERROR_INVALID_ARGUMENT, "comm is NULL");
    EXPECT(s == 12345);
    destroy_group(1, comms);
}

static void bad_group_configs(void) {
    tutti_comm *comms[4] = {NULL, NULL, NULL, NULL};
    tutti_config c = TUTTI_CONFIG_INIT;
    EXPECT_ERROR(tutti_comm_create_group(0, NULL, comms), TUTTI_ERROR_INVALID_ARGUMENT,
                 "tutti_comm_create_group", "at least one rank");
    EXPECT(comms[0] == NULL); /* nothing written on failure */
    /* A huge group is an error, not an allocation that aborts the program (the room given is
     * never touched: the size is refused first). */
    EXPECT_ERROR(tutti_comm_create_group(30000, NULL, comms), TUTTI_ERROR_INVALID_ARGUMENT,
                 "30000 ranks in one process");
    EXPECT_ERROR(tutti_comm_create_rank(0, (size_t)-1, "127.0.0.1:1", NULL, comms),
                 TUTTI_ERROR_INVALID_ARGUMENT, "more ranks than tutti supports");
    EXPECT_ERROR(tutti_comm_create_group(2, NULL, NULL), TUTTI_ERROR_INVALID_ARGUMENT,
                 "comms is NULL");
    c.struct_size = 0;
    EXPECT_ERROR(tutti_comm_create_group(2, &c, comms), TUTTI_ERROR_INVALID_ARGUMENT,
                 "struct_size is 0", "TUTTI_CONFIG_INIT");
    c.struct_size = sizeof c;
    c.algorithm = (tutti_algorithm)77;
    EXPECT_ERROR(tutti_comm_create_group(2, &c, comms), TUTTI_ERROR_INVALID_ARGUMENT,
                 "config->algorithm", "algorithm 77 is not a tutti_algorithm");
    c.algorithm = TUTTI_ALGORITHM_RING;
    c.algorithm_arg = 3;
    EXPECT_ERROR(tutti_comm_create_group(2, &c, comms), TUTTI_ERROR_INVALID_ARGUMENT,
                 "algorithm ring takes no argument");
    c.algorithm = TUTTI_ALGORITHM_REDUCE_TO_ONE;
    c.algorithm_arg = 9;
    EXPECT_ERROR(tutti_comm_create_group(4, &c, comms), TUTTI_ERROR_INVALID_ARGUMENT,
                 "root 9 is out of range for a world of 4 ranks");
    EXPECT(comms[0] == NULL && comms[3] == NULL);
    c.algorithm = TUTTI_ALGORITHM_AUTO;
    c.algorithm_arg = 0;
    c.deterministic = 3;
    EXPECT_ERROR(tutti_comm_create_group(2, &c, comms), TUTTI_ERROR_INVALID_ARGUMENT,
                 "config->deterministic is 3", "1 (on) or 2 (off)");
    EXPECT(comms[0] == NULL);
}

/* ----- arguments one rank rejects before taking part: that rank gets INVALID_ARGUMENT, its
 * group is aborted, and its peers fail at once (not after the timeout) ----- */

typedef struct reject_case {
    const char *name;
    int bad_rank;
    tutti_result peer_result;
} reject_case;

static void *reject_rank(void *p) {
    rank_ctx *c = p;
    const char *which = c->arg;
    float x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    double t0 = now_seconds();
    if (c->rank == 1) {
        char *odd = (char *)x + 1;
        if (strcmp(which, "null buffer") == 0) {
            EXPECT_ERROR(tutti_all_reduce(c->comm, 8, TUTTI_DTYPE_F32, TUTTI_OP_SUM, x, NULL),
                         TUTTI_ERROR_INVALID_ARGUMENT, "tutti_all_reduce: rank 1",
                         "output is NULL but must hold 8 f32 elements", "create a new group");
        } else if (strcmp(which, "bad dtype") == 0) {
            EXPECT_ERROR(tutti_all_reduce(c->comm, 8, (tutti_dtype)99, TUTTI_OP_SUM, x, x),
                         TUTTI_ERROR_INVALID_ARGUMENT, "rank 1", "dtype 99 is not a tutti_dtype");
        } else if (strcmp(which, "bad op") == 0) {
            EXPECT_ERROR(tutti_all_reduce(c->comm, 8, TUTTI_DTYPE_F32, (tutti_op)42, x, x),
                         TUTTI_ERROR_INVALID_ARGUMENT, "op 42 is not a tutti_op");
        } else if (strcmp(which, "misaligned") == 0) {
            EXPECT_ERROR(tutti_broadcast(c->comm, 4, TUTTI_DTYPE_F32, 0, odd),
                         TUTTI_ERROR_INVALID_ARGUMENT, "tutti_broadcast", "not aligned to 4");
        } else if (strcmp(which, "overlap") == 0) {
            EXPECT_ERROR(tutti_all_reduce(c->comm, 4, TUTTI_DTYPE_F32, TUTTI_OP_SUM, x, x + 2),
                         TUTTI_ERROR_INVALID_ARGUMENT, "overlap");
        } else if (strcmp(which, "all_gather overlap") == 0) {
            EXPECT_ERROR(tutti_all_gather(c->comm, 2, TUTTI_DTYPE_F32, x + 1, x),
                         TUTTI_ERROR_INVALID_ARGUMENT, "for an in-place all-gather");
        } else if (strcmp(which, "null input at a non-root") == 0) {
            EXPECT_ERROR(tutti_reduce(c->comm, 4, TUTTI_DTYPE_F32, TUTTI_OP_SUM, 0, NULL, NULL),
                         TUTTI_ERROR_INVALID_ARGUMENT, "tutti_reduce", "input is NULL");
        } else {
            FAIL("unknown case %s", which);
        }
    } else {
        EXPECT_ERROR(tutti_all_reduce(c->comm, 8, TUTTI_DTYPE_F32, TUTTI_OP_SUM, x, x),
                     TUTTI_ERROR_ABORTED, "rank 1 rejected its arguments");
    }
    if (now_seconds() - t0 > 20) {
        FAIL("rank %zu waited %.1f s for a peer that had rejected its arguments", c->rank,
             now_seconds() - t0);
    }
    /* The group stays aborted. */
    {
        bool aborted = false;
        CHECK(tutti_comm_is_aborted(c->comm, &aborted));
        EXPECT(aborted);
        EXPECT_ERROR(tutti_barrier(c->comm), TUTTI_ERROR_ABORTED, "aborted");
    }
    return NULL;
}

static void rejected_arguments(void) {
    const char *cases[] = {"null buffer", "bad dtype",          "bad op",
                           "misaligned",  "all_gather overlap", "overlap",
                           "null input at a non-root"};
    size_t i;
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tutti_comm *comms[3];
        make_group(3, 60000, comms);
        run_ranks(3, comms, reject_rank, (void *)cases[i]);
        destroy_group(3, comms);
    }
}

/* ----- errors the ranks agree on: the communicator stays usable ----- */

static void *mismatch_rank(void *p) {
    rank_ctx *c = p;
    int32_t x[200];
    size_t i;
    for (i = 0; i < 200; i++) {
        x[i] = 1;
    }
    /* count mismatch: every rank fails, and says which rank disagreed on what */
    EXPECT_ERROR(tutti_all_reduce(c->comm, c->rank == 0 ? 100 : 200, TUTTI_DTYPE_I32,
                                  TUTTI_OP_SUM, x, x),
                 TUTTI_ERROR_MISMATCH, "all_reduce", "count is", "every rank must make the same");
    EXPECT(x[0] == 1); /* nothing written */
    /* dtype mismatch */
    EXPECT_ERROR(tutti_all_reduce(c->comm, 100, c->rank == 1 ? TUTTI_DTYPE_U32 : TUTTI_DTYPE_I32,
                                  TUTTI_OP_SUM, x, x),
                 TUTTI_ERROR_MISMATCH, "dtype");
    /* op mismatch */
    EXPECT_ERROR(tutti_all_reduce(c->comm, 100, TUTTI_DTYPE_I32,
                                  c->rank == 1 ? TUTTI_OP_MAX : TUTTI_OP_SUM, x, x),
                 TUTTI_ERROR_MISMATCH, "op");
    /* algorithm mismatch */
    CHECK(tutti_comm_set_algorithm(c->comm,
                                   c->rank == 0 ? TUTTI_ALGORITHM_RING : TUTTI_ALGORITHM_DIRECT, 0));
    EXPECT_ERROR(tutti_all_reduce(c->comm, 100, TUTTI_DTYPE_I32, TUTTI_OP_SUM, x, x),
                 TUTTI_ERROR_MISMATCH, "algorithm");
    CHECK(tutti_comm_set_algorithm(c->comm, TUTTI_ALGORITHM_AUTO, 0));
    /* a root out of range on one rank: that rank's own error, and its peers say who */
    if (c->rank == 1) {
        EXPECT_ERROR(tutti_broadcast(c->comm, 10, TUTTI_DTYPE_I32, 7, x),
                     TUTTI_ERROR_INVALID_ARGUMENT, "broadcast", "rank 1",
                     "root 7 is out of range for a world of 2 ranks");
    } else {
        EXPECT_ERROR(tutti_broadcast(c->comm, 10, TUTTI_DTYPE_I32, 0, x),
                     TUTTI_ERROR_PEER_REJECTED, "rank 1 rejected its arguments", "root 7");
    }
    /* bad set_algorithm arguments */
    EXPECT_ERROR(tutti_comm_set_algorithm(c->comm, (tutti_algorithm)9, 0),
                 TUTTI_ERROR_INVALID_ARGUMENT, "tutti_comm_set_algorithm", "algorithm 9");
    EXPECT_ERROR(tutti_comm_set_algorithm(c->comm, TUTTI_ALGORITHM_REDUCE_TO_ONE, 5),
                 TUTTI_ERROR_INVALID_ARGUMENT, "root 5 is out of range");
    /* and after all that, the communicator still works */
    CHECK(tutti_all_reduce(c->comm, 200, TUTTI_DTYPE_I32, TUTTI_OP_SUM, x, x));
    EXPECT(x[0] == 2 && x[199] == 2);
    {
        bool aborted = true;
        CHECK(tutti_comm_is_aborted(c->comm, &aborted));
        EXPECT(!aborted);
    }
    return NULL;
}

static void mismatches(void) {
    tutti_comm *comms[2];
    make_group(2, 60000, comms);
    run_ranks(2, comms, mismatch_rank, NULL);
    destroy_group(2, comms);
}

/* ----- abort from another thread wakes a blocked collective ----- */

static void *blocked_rank(void *p) {
    rank_ctx *c = p;
    double x[16] = {0}, t0 = now_seconds();
    EXPECT_ERROR(tutti_all_reduce(c->comm, 16, TUTTI_DTYPE_F64, TUTTI_OP_SUM, x, x),
                 TUTTI_ERROR_ABORTED, "tutti_comm_abort was called on rank 1", "trainer stopped");
    if (now_seconds() - t0 > 20) {
        FAIL("the abort did not wake the blocked call");
    }
    return NULL;
}

static void abort_from_another_thread(void) {
    tutti_comm *comms[2];
    pthread_t t;
    rank_ctx ctx;
    make_group(2, 120000, comms);
    ctx.comm = comms[0];
    ctx.rank = 0;
    ctx.world = 2;
    ctx.arg = NULL;
    /* rank 0 blocks in an all-reduce that rank 1 never joins */
    EXPECT(pthread_create(&t, NULL, blocked_rank, &ctx) == 0);
    sleep_ms(200);
    CHECK(tutti_comm_abort(comms[1], "trainer stopped"));
    pthread_join(t, NULL);
    EXPECT_ERROR(tutti_barrier(comms[1]), TUTTI_ERROR_ABORTED, "trainer stopped");
    CHECK(tutti_comm_abort(comms[0], NULL)); /* aborting twice is fine */
    destroy_group(2, comms);
}

static void timeout(void) {
    tutti_comm *comms[2];
    double t0;
    make_group(2, 300, comms);
    t0 = now_seconds();
    EXPECT_ERROR(tutti_barrier(comms[0]), TUTTI_ERROR_TIMEOUT, "tutti_barrier", "timed out",
                 "rank 1");
    EXPECT(now_seconds() - t0 >= 0.25);
    EXPECT_ERROR(tutti_barrier(comms[0]), TUTTI_ERROR_ABORTED, "aborted");
    destroy_group(2, comms);
}

/* ----- the replicas' one-call form ----- */

static void replicas_errors(void) {
    tutti_replicas *rep = NULL;
    tutti_config c = config_with_timeout(60000);
    float a[4], b[4], d[4], big[16];
    void *bufs[3];
    const void *ins[3];
    void *outs[3];
    size_t n = 0;
    EXPECT_ERROR(tutti_replicas_create(0, NULL, &rep), TUTTI_ERROR_INVALID_ARGUMENT,
                 "tutti_replicas_create", "at least one rank");
    EXPECT(rep == NULL);
    EXPECT_ERROR(tutti_replicas_create(3, &c, NULL), TUTTI_ERROR_INVALID_ARGUMENT,
                 "replicas is NULL");
    CHECK(tutti_replicas_create(3, &c, &rep));
    CHECK(tutti_replicas_count(rep, &n));
    EXPECT(n == 3);
    EXPECT_ERROR(tutti_replicas_count(rep, NULL), TUTTI_ERROR_INVALID_ARGUMENT,
                 "num_replicas is NULL");
    bufs[0] = a;
    bufs[1] = b;
    bufs[2] = d;
    EXPECT_ERROR(tutti_replicas_all_reduce(NULL, 4, TUTTI_DTYPE_F32, TUTTI_OP_SUM, 3, bufs),
                 TUTTI_ERROR_INVALID_ARGUMENT, "tutti_replicas_all_reduce: replicas is NULL");
    EXPECT_ERROR(tutti_replicas_all_reduce(rep, 4, TUTTI_DTYPE_F32, TUTTI_OP_SUM, 2, bufs),
                 TUTTI_ERROR_INVALID_ARGUMENT, "num_buffers is 2 but there are 3 replicas");
    EXPECT_ERROR(tutti_replicas_all_reduce(rep, 4, TUTTI_DTYPE_F32, TUTTI_OP_SUM, 3, NULL),
                 TUTTI_ERROR_INVALID_ARGUMENT, "buffers is NULL");
    EXPECT_ERROR(tutti_replicas_all_reduce(rep, 4, (tutti_dtype)10, TUTTI_OP_SUM, 3, bufs),
                 TUTTI_ERROR_INVALID_ARGUMENT, "dtype 10");
    EXPECT_ERROR(tutti_replicas_all_reduce(rep, 4, TUTTI_DTYPE_F32, (tutti_op)8, 3, bufs),
                 TUTTI_ERROR_INVALID_ARGUMENT, "op 8");
    EXPECT_ERROR(tutti_replicas_all_reduce(rep, 4, TUTTI_DTYPE_F32, TUTTI_OP_BAND, 3, bufs),
                 TUTTI_ERROR_INVALID_ARGUMENT, "band is defined on integer types only, not f32");
    bufs[2] = NULL;
    EXPECT_ERROR(tutti_replicas_all_reduce(rep, 4, TUTTI_DTYPE_F32, TUTTI_OP_SUM, 3, bufs),
                 TUTTI_ERROR_INVALID_ARGUMENT, "buffers[2] is NULL");
    bufs[2] = a + 2;
    EXPECT_ERROR(tutti_replicas_all_reduce(rep, 4, TUTTI_DTYPE_F32, TUTTI_OP_SUM, 3, bufs),
                 TUTTI_ERROR_INVALID_ARGUMENT, "buffers[0] and buffers[2] overlap");
    bufs[2] = d;
    EXPECT_ERROR(tutti_replicas_broadcast(rep, 4, TUTTI_DTYPE_F32, 3, 3, bufs),
                 TUTTI_ERROR_INVALID_ARGUMENT, "root 3 is out of range for 3 replicas");
    ins[0] = a;
    ins[1] = b;
    ins[2] = big + 4; /* inside outputs[0] */
    outs[0] = big;
    outs[1] = big + 12; /* overlaps outputs[0] */
    outs[2] = NULL;
    EXPECT_ERROR(tutti_replicas_all_gather(rep, 4, TUTTI_DTYPE_F32, 3, ins, outs),
                 TUTTI_ERROR_INVALID_ARGUMENT, "outputs[2] is NULL");
    {
        float o2[12];
        outs[2] = o2;
        ins[2] = big + 1; /* inside outputs[0] = big[0..3) */
        EXPECT_ERROR(tutti_replicas_all_gather(rep, 1, TUTTI_DTYPE_F32, 3, ins, outs),
                     TUTTI_ERROR_INVALID_ARGUMENT, "inputs[2] overlaps outputs[0]");
        EXPECT_ERROR(tutti_replicas_reduce(rep, 4, TUTTI_DTYPE_F32, TUTTI_OP_SUM, 3, ins, a + 1),
                     TUTTI_ERROR_INVALID_ARGUMENT, "inputs[0] overlaps output");
    }
    /* still usable after rejected calls */
    {
        size_t i;
        for (i = 0; i < 4; i++) {
            a[i] = 1;
            b[i] = 2;
            d[i] = 3;
        }
        CHECK(tutti_replicas_all_reduce(rep, 4, TUTTI_DTYPE_F32, TUTTI_OP_SUM, 3, bufs));
        EXPECT(a[3] == 6 && b[0] == 6 && d[2] == 6);
    }
    EXPECT_ERROR(tutti_replicas_abort(NULL, NULL), TUTTI_ERROR_INVALID_ARGUMENT,
                 "replicas is NULL");
    CHECK(tutti_replicas_abort(rep, "stopping early"));
    EXPECT_ERROR(tutti_replicas_all_reduce(rep, 4, TUTTI_DTYPE_F32, TUTTI_OP_SUM, 3, bufs),
                 TUTTI_ERROR_ABORTED, "stopping early");
    tutti_replicas_destroy(rep);
}

int main(void) {
    result_strings_and_last_error();
    version();
    devices();
    destroy_null();
    null_handles_and_outputs();
    bad_group_configs();
    rejected_arguments();
    mismatches();
    abort_from_another_thread();
    timeout();
    replicas_errors();
    printf("errors: every error path: ok\n");
    return 0;
}
