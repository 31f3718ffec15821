/* Lifetimes across the C API, meant to run under AddressSanitizer (.ci/run): handles destroyed
 * from one thread while other threads are inside calls on them (the watchdog pattern: abort,
 * then destroy), two threads destroying one handle at once and a destroy repeated, a work
 * handle destroyed while another thread waits on it, shared memory freed while a non-blocking
 * call on it is still queued, an in-place reduce-scatter issued after a non-blocking call
 * that still writes its input, and threads calling in a loop on a handle that another thread
 * destroys. */
#include "check.h"

#define ROUNDS 20

typedef struct {
    tutti_comm *comm;
    tutti_result result;
    char error[512];
} call_ctx;

/* A blocking all-reduce that waits for a peer which never calls. */
static void *blocked_all_reduce(void *p) {
    call_ctx *c = p;
    float x[64] = {0};
    c->result = tutti_all_reduce(c->comm, 64, TUTTI_DTYPE_F32, TUTTI_OP_SUM, x, x);
    last_error(c->error, sizeof c->error);
    return NULL;
}

typedef struct {
    tutti_comm *comm;
    char error[512];
} destroy_ctx;

static void *destroy_comm(void *p) {
    destroy_ctx *d = p;
    tutti_comm_destroy(d->comm);
    last_error(d->error, sizeof d->error);
    return NULL;
}

/* Abort then destroy, from two threads at once, while a rank's thread is inside a call. */
static void watchdog_destroys_while_a_call_runs(void) {
    int round;
    for (round = 0; round < ROUNDS; round++) {
        tutti_config cfg = TUTTI_CONFIG_INIT;
        tutti_comm *comms[2];
        pthread_t t, d[2];
        call_ctx call;
        destroy_ctx dc[2];
        int k, released = 0, refused = 0;
        char m[512];
        cfg.timeout_ms = 30000;
        CHECK(tutti_comm_create_group(2, &cfg, comms));
        call.comm = comms[0];
        pthread_create(&t, NULL, blocked_all_reduce, &call);
        sleep_ms(round % 3 == 0 ? 0 : 5);
        CHECK(tutti_comm_abort(comms[0], "watchdog"));
        for (k = 0; k < 2; k++) {
            dc[k].comm = comms[0];
            pthread_create(&d[k], NULL, destroy_comm, &dc[k]);
        }
        for (k = 0; k < 2; k++) {
            pthread_join(d[k], NULL);
            if (dc[k].error[0] == '\0') {
                released++;
            } else if (strstr(dc[k].error, "not a live tutti_comm") != NULL) {
                refused++;
            } else {
                FAIL("destroy: %s", dc[k].error);
            }
        }
        pthread_join(t, NULL);
        EXPECT(released == 1 && refused == 1);
        if (call.result != TUTTI_ERROR_ABORTED && call.result != TUTTI_ERROR_INVALID_ARGUMENT) {
            FAIL("the call inside returned %u: %s", (unsigned)call.result, call.error);
        }
        if (call.result == TUTTI_ERROR_INVALID_ARGUMENT) {
            /* It had not entered yet when the destroy began (or even ended). */
            EXPECT(strstr(call.error, "being destroyed") != NULL ||
                   strstr(call.error, "not a live tutti_comm") != NULL);
        }
        /* A third destroy, long after: nothing happens, and it says so. */
        tutti_comm_destroy(comms[0]);
        last_error(m, sizeof m);
        EXPECT(strstr(m, "not a live tutti_comm") != NULL);
        tutti_comm_destroy(comms[1]);
        last_error(m, sizeof m);
        EXPECT(m[0] == '\0');
    }
}

/* Without an abort, destroy waits for the call inside, which ends at its timeout. */
static void destroy_waits_for_the_call_inside(void) {
    tutti_config cfg = TUTTI_CONFIG_INIT;
    tutti_comm *comms[2];
    pthread_t t;
    call_ctx call;
    double start;
    cfg.timeout_ms = 300;
    CHECK(tutti_comm_create_group(2, &cfg, comms));
    call.comm = comms[0];
    pthread_create(&t, NULL, blocked_all_reduce, &call);
    sleep_ms(20);
    start = now_seconds();
    tutti_comm_destroy(comms[0]);
    EXPECT(now_seconds() - start < 10.0);
    pthread_join(t, NULL);
    if (call.result != TUTTI_ERROR_TIMEOUT) {
        FAIL("the call inside returned %u: %s", (unsigned)call.result, call.error);
    }
    tutti_comm_destroy(comms[1]);
}

typedef struct {
    tutti_work *work;
    tutti_result result;
} wait_ctx;

static void *wait_work(void *p) {
    wait_ctx *w = p;
    w->result = tutti_work_wait(w->work, 0);
    return NULL;
}

typedef struct {
    tutti_comm *comm;
    float *x;
} late_ctx;

static void *late_rank(void *p) {
    late_ctx *l = p;
    sleep_ms(10);
    CHECK(tutti_all_reduce(l->comm, 256, TUTTI_DTYPE_F32, TUTTI_OP_SUM, l->x, l->x));
    return NULL;
}

static void *destroy_work(void *p) {
    tutti_work_destroy(p);
    return NULL;
}

/* A work handle destroyed while another thread waits on it. */
static void work_destroyed_while_waited(void) {
    int round;
    for (round = 0; round < ROUNDS; round++) {
        tutti_config cfg = TUTTI_CONFIG_INIT;
        tutti_comm *comms[2];
        float a[256], b[256];
        pthread_t waiter, late, destroyer;
        wait_ctx w;
        late_ctx l;
        size_t i;
        char m[512];
        for (i = 0; i < 256; i++) {
            a[i] = 1.0f;
            b[i] = 2.0f;
        }
        cfg.timeout_ms = 30000;
        CHECK(tutti_comm_create_group(2, &cfg, comms));
        CHECK(tutti_all_reduce_async(comms[0], 256, TUTTI_DTYPE_F32, TUTTI_OP_SUM, a, a, &w.work));
        pthread_create(&waiter, NULL, wait_work, &w);
        l.comm = comms[1];
        l.x = b;
        pthread_create(&late, NULL, late_rank, &l);
        pthread_create(&destroyer, NULL, destroy_work, w.work);
        pthread_join(destroyer, NULL);
        pthread_join(waiter, NULL);
        pthread_join(late, NULL);
        /* The waiter either saw the result or was turned away as the destroy began. */
        EXPECT(w.result == TUTTI_SUCCESS || w.result == TUTTI_ERROR_INVALID_ARGUMENT);
        EXPECT(a[0] == 3.0f && b[255] == 3.0f);
        tutti_work_destroy(w.work);
        last_error(m, sizeof m);
        EXPECT(strstr(m, "not a live tutti_work") != NULL);
        tutti_comm_destroy(comms[0]);
        tutti_comm_destroy(comms[1]);
    }
}

#define BIG (1 << 16)

/* Shared memory freed while a non-blocking call on it is queued behind another: the call
 * still completes on mapped memory (under ASan, a use after free otherwise). */
static void *free_while_queued(void *p) {
    rank_ctx *c = p;
    float *shared = NULL, *first = malloc(BIG * sizeof(float));
    tutti_work *w[2];
    size_t i;
    EXPECT(first != NULL);
    CHECK(tutti_mem_alloc(c->comm, BIG * sizeof(float), (void **)&shared));
    for (i = 0; i < BIG; i++) {
        first[i] = 1.0f;
        shared[i] = (float)c->rank;
    }
    if (c->rank == 1) {
        sleep_ms(30); /* rank 0's calls wait for this one in the meantime */
    }
    CHECK(tutti_all_reduce_async(c->comm, BIG, TUTTI_DTYPE_F32, TUTTI_OP_SUM, first, first, &w[0]));
    CHECK(tutti_all_reduce_async(c->comm, BIG, TUTTI_DTYPE_F32, TUTTI_OP_SUM, shared, shared,
                                 &w[1]));
    CHECK(tutti_mem_free(c->comm, shared));
    EXPECT_ERROR(tutti_mem_free(c->comm, shared), TUTTI_ERROR_INVALID_ARGUMENT, "freed already");
    CHECK(tutti_work_wait(w[0], 0));
    CHECK(tutti_work_wait(w[1], 0));
    EXPECT(first[0] == 2.0f);
    tutti_work_destroy(w[0]);
    tutti_work_destroy(w[1]);
    free(first);
    return NULL;
}

static void shared_memory_freed_while_a_call_is_queued(void) {
    int round;
    for (round = 0; round < 5; round++) {
        tutti_config cfg = TUTTI_CONFIG_INIT;
        tutti_comm *comms[2];
        cfg.timeout_ms = 30000;
        CHECK(tutti_comm_create_group(2, &cfg, comms));
        run_ranks(2, comms, free_while_queued, NULL);
        tutti_comm_destroy(comms[0]);
        tutti_comm_destroy(comms[1]);
    }
}

#define RS 1024

/* An in-place reduce-scatter issued behind a non-blocking all-reduce that writes its input
 * reads the all-reduced values (the input is read when the call runs, not when issued). */
static void *in_place_reduce_scatter_after_a_write(void *p) {
    rank_ctx *c = p;
    int32_t buf[2 * RS];
    tutti_work *w[2];
    size_t i;
    int blocking;
    for (blocking = 0; blocking < 2; blocking++) {
        for (i = 0; i < 2 * RS; i++) {
            buf[i] = (int32_t)(i + 1000 * c->rank);
        }
        if (c->rank == 1) {
            sleep_ms(30); /* rank 0's all-reduce is still waiting when it issues the rest */
        }
        CHECK(tutti_all_reduce_async(c->comm, 2 * RS, TUTTI_DTYPE_I32, TUTTI_OP_SUM, buf, buf,
                                     &w[0]));
        if (blocking) {
            CHECK(tutti_reduce_scatter(c->comm, RS, TUTTI_DTYPE_I32, TUTTI_OP_SUM, buf,
                                       buf + c->rank * RS));
        } else {
            CHECK(tutti_reduce_scatter_async(c->comm, RS, TUTTI_DTYPE_I32, TUTTI_OP_SUM, buf,
                                             buf + c->rank * RS, &w[1]));
            CHECK(tutti_work_wait(w[1], 0));
            tutti_work_destroy(w[1]);
        }
        CHECK(tutti_work_wait(w[0], 0));
        tutti_work_destroy(w[0]);
        for (i = 0; i < RS; i++) {
            size_t j = c->rank * RS + i;
            /* the all-reduce makes 2j + 1000; the reduce-scatter sums that over 2 ranks */
            int32_t want = 2 * (2 * (int32_t)j + 1000);
            if (buf[j] != want) {
                FAIL("rank %zu (%s) element %zu: %d, want %d (the input was read before the "
                     "all-reduce wrote it?)",
                     c->rank, blocking ? "blocking" : "async", j, buf[j], want);
            }
        }
    }
    return NULL;
}

static void in_place_reduce_scatter_reads_when_it_runs(void) {
    tutti_config cfg = TUTTI_CONFIG_INIT;
    tutti_comm *comms[2];
    cfg.timeout_ms = 30000;
    CHECK(tutti_comm_create_group(2, &cfg, comms));
    run_ranks(2, comms, in_place_reduce_scatter_after_a_write, NULL);
    tutti_comm_destroy(comms[0]);
    tutti_comm_destroy(comms[1]);
}

#define HAMMERS 4

typedef struct {
    tutti_comm *comm;
    int collective;
    long ok, closing;
    tutti_result result;
    char error[512];
} hammer_ctx;

/* Calls on `comm` in a loop (bounded) while it is destroyed: until one fails because the handle
 * is no longer live, after the destroy freed it, which must not read it. Failures meanwhile
 * must say that it is being destroyed. */
static void *hammer(void *p) {
    hammer_ctx *h = p;
    double deadline = now_seconds() + 5.0;
    float x[16] = {0};
    size_t rank;
    h->result = TUTTI_SUCCESS;
    h->error[0] = '\0';
    while (now_seconds() < deadline) {
        tutti_result r = h->collective
                             ? tutti_all_reduce(h->comm, 16, TUTTI_DTYPE_F32, TUTTI_OP_SUM, x, x)
                             : tutti_comm_rank(h->comm, &rank);
        if (r == TUTTI_SUCCESS) {
            h->ok++;
            continue;
        }
        h->result = r;
        last_error(h->error, sizeof h->error);
        if (r != TUTTI_ERROR_INVALID_ARGUMENT || strstr(h->error, "being destroyed") == NULL) {
            return NULL; /* freed, or a failure to report */
        }
        h->closing++;
    }
    return NULL;
}

/* Threads keep calling on a handle while another destroys it: every call either runs on the
 * live handle or fails with TUTTI_ERROR_INVALID_ARGUMENT, and none reads it once freed (a call
 * that races the free is refused by the registry of live handles). No other tutti_comm is
 * created meanwhile, so the freed address is not reused by one. */
static void calls_in_a_loop_while_destroyed(void) {
    int round;
    for (round = 0; round < ROUNDS; round++) {
        tutti_comm *comm;
        pthread_t t[HAMMERS];
        hammer_ctx h[HAMMERS];
        int k;
        char m[512];
        CHECK(tutti_comm_create_group(1, NULL, &comm));
        for (k = 0; k < HAMMERS; k++) {
            h[k].comm = comm;
            h[k].collective = k == 0; /* one thread: a one-rank group runs its calls in order */
            h[k].ok = h[k].closing = 0;
            pthread_create(&t[k], NULL, hammer, &h[k]);
        }
        sleep_ms(round % 4 == 0 ? 0 : 10);
        tutti_comm_destroy(comm);
        last_error(m, sizeof m);
        if (m[0] != '\0') {
            FAIL("destroy: %s", m);
        }
        for (k = 0; k < HAMMERS; k++) {
            pthread_join(t[k], NULL);
            if (h[k].result != TUTTI_ERROR_INVALID_ARGUMENT ||
                strstr(h[k].error, "not a live tutti_comm") == NULL) {
                FAIL("the last call in the loop returned %u: %s", (unsigned)h[k].result,
                     h[k].error);
            }
        }
    }
}

/* LIFETIME_ONLY=name runs one scenario (to watch it fail against an unfixed library). */
static int selected(const char *name) {
    const char *only = getenv("LIFETIME_ONLY");
    return only == NULL || strcmp(only, name) == 0;
}

int main(void) {
    if (selected("reduce_scatter")) {
        in_place_reduce_scatter_reads_when_it_runs();
        printf("in-place reduce-scatter: ok\n");
    }
    if (selected("watchdog")) {
        watchdog_destroys_while_a_call_runs();
        printf("watchdog: ok\n");
    }
    if (selected("loop")) {
        calls_in_a_loop_while_destroyed();
        printf("calls in a loop while destroyed: ok\n");
    }
    if (selected("destroy_waits")) {
        destroy_waits_for_the_call_inside();
        printf("destroy waits: ok\n");
    }
    if (selected("work")) {
        work_destroyed_while_waited();
        printf("work destroyed while waited: ok\n");
    }
    if (selected("shared")) {
        shared_memory_freed_while_a_call_is_queued();
        printf("shared memory freed while queued: ok\n");
    }
    printf("lifetime: ok\n");
    return 0;
}
