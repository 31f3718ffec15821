/* tutti_comm_create_store: ranks that meet through a key-value store the program provides.
 * An in-memory store (a mutex and a condition variable) shared by a thread per rank, as a
 * framework's store is shared by processes; every error path of the store's callbacks. */
#include "check.h"

#include <errno.h>

#define TOKEN "a-token-of-32-bytes-for-the-test"
#define MAX_KEYS 256

typedef struct mem_store {
    pthread_mutex_t lock;
    pthread_cond_t changed;
    size_t n;
    char *keys[MAX_KEYS];
    uint8_t *values[MAX_KEYS];
    size_t lens[MAX_KEYS];
    /* A key whose `set` fails (NULL: none), and how many calls were made. */
    const char *fail_set;
    int calls;
} mem_store;

static void store_init(mem_store *s) {
    memset(s, 0, sizeof *s);
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->changed, NULL);
}

static void store_free(mem_store *s) {
    size_t i;
    for (i = 0; i < s->n; i++) {
        free(s->keys[i]);
        free(s->values[i]);
    }
    pthread_cond_destroy(&s->changed);
    pthread_mutex_destroy(&s->lock);
}

/* The index of `key`, or -1. Under the lock. */
static long find(mem_store *s, const char *key) {
    size_t i;
    for (i = 0; i < s->n; i++) {
        if (strcmp(s->keys[i], key) == 0) {
            return (long)i;
        }
    }
    return -1;
}

/* Set `key` to `len` bytes. Under the lock. */
static int put(mem_store *s, const char *key, const uint8_t *value, size_t len) {
    long i = find(s, key);
    uint8_t *copy = malloc(len ? len : 1);
    if (copy == NULL) {
        return 2;
    }
    memcpy(copy, value, len);
    if (i < 0) {
        if (s->n == MAX_KEYS) {
            free(copy);
            return 3;
        }
        i = (long)s->n++;
        s->keys[i] = strdup(key);
    } else {
        free(s->values[i]);
    }
    s->values[i] = copy;
    s->lens[i] = len;
    pthread_cond_broadcast(&s->changed);
    return 0;
}

static int mem_set(void *ctx, const char *key, const uint8_t *value, size_t len) {
    mem_store *s = ctx;
    int rc;
    pthread_mutex_lock(&s->lock);
    s->calls++;
    rc = (s->fail_set != NULL && strstr(key, s->fail_set) != NULL) ? 42 : put(s, key, value, len);
    pthread_mutex_unlock(&s->lock);
    return rc;
}

static int mem_get(void *ctx, const char *key, uint64_t timeout_ms, uint8_t *buf, size_t cap,
                   size_t *len) {
    mem_store *s = ctx;
    struct timespec until;
    long i;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += (time_t)(timeout_ms / 1000);
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&s->lock);
    s->calls++;
    while ((i = find(s, key)) < 0) {
        if (pthread_cond_timedwait(&s->changed, &s->lock, &until) == ETIMEDOUT) {
            pthread_mutex_unlock(&s->lock);
            return TUTTI_STORE_TIMEOUT;
        }
    }
    *len = s->lens[i];
    memcpy(buf, s->values[i], s->lens[i] < cap ? s->lens[i] : cap);
    pthread_mutex_unlock(&s->lock);
    return 0;
}

static int mem_add(void *ctx, const char *key, int64_t delta, int64_t *value) {
    mem_store *s = ctx;
    long i;
    int64_t v = delta;
    char text[32];
    int rc;
    pthread_mutex_lock(&s->lock);
    s->calls++;
    i = find(s, key);
    if (i >= 0) {
        char old[32] = {0};
        memcpy(old, s->values[i], s->lens[i] < 31 ? s->lens[i] : 31);
        v += strtoll(old, NULL, 10);
    }
    snprintf(text, sizeof text, "%lld", (long long)v);
    rc = put(s, key, (const uint8_t *)text, strlen(text));
    pthread_mutex_unlock(&s->lock);
    *value = v;
    return rc;
}

/* A `get` that claims a value of a megabyte. */
static int huge_get(void *ctx, const char *key, uint64_t timeout_ms, uint8_t *buf, size_t cap,
                    size_t *len) {
    (void)ctx;
    (void)key;
    (void)timeout_ms;
    memset(buf, 'x', cap);
    *len = (size_t)1 << 20;
    return 0;
}

/* A `get` that fails. */
static int failing_get(void *ctx, const char *key, uint64_t timeout_ms, uint8_t *buf, size_t cap,
                       size_t *len) {
    (void)ctx;
    (void)key;
    (void)timeout_ms;
    (void)buf;
    (void)cap;
    (void)len;
    return -7;
}

static tutti_store callbacks(mem_store *s) {
    tutti_store t;
    memset(&t, 0, sizeof t);
    t.struct_size = sizeof(tutti_store);
    t.ctx = s;
    t.set = mem_set;
    t.get = mem_get;
    t.add = mem_add;
    return t;
}

typedef struct job {
    mem_store *store;
    size_t world;
    size_t rank;
    uint64_t timeout_ms;
    tutti_result result;
    char error[2048];
    float sum[2];
} job;

/* Create rank `rank` through the store and all-reduce (rank+1, 10*rank). */
static void *join_and_reduce(void *arg) {
    job *j = arg;
    tutti_store t = callbacks(j->store);
    tutti_config c = TUTTI_CONFIG_INIT;
    tutti_comm *comm = NULL;
    c.timeout_ms = j->timeout_ms;
    j->result = tutti_comm_create_store(j->rank, j->world, &t, TOKEN, NULL, &c, &comm);
    if (j->result != TUTTI_SUCCESS) {
        last_error(j->error, sizeof j->error);
        EXPECT(comm == NULL);
        return NULL;
    }
    {
        float in[2], out[2];
        in[0] = (float)j->rank + 1.0f;
        in[1] = 10.0f * (float)j->rank;
        CHECK(tutti_all_reduce(comm, 2, TUTTI_DTYPE_F32, TUTTI_OP_SUM, in, out));
        j->sum[0] = out[0];
        j->sum[1] = out[1];
    }
    tutti_comm_destroy(comm);
    return NULL;
}

/* Ranks `ranks[0..n)` of `world` join through `s` on a thread each. */
static void run_job(mem_store *s, size_t world, const size_t *ranks, size_t n, uint64_t timeout_ms,
                    job *jobs) {
    pthread_t threads[8];
    size_t k;
    EXPECT(n <= 8);
    for (k = 0; k < n; k++) {
        memset(&jobs[k], 0, sizeof jobs[k]);
        jobs[k].store = s;
        jobs[k].world = world;
        jobs[k].rank = ranks[k];
        jobs[k].timeout_ms = timeout_ms;
        if (pthread_create(&threads[k], NULL, join_and_reduce, &jobs[k]) != 0) {
            FAIL("pthread_create failed");
        }
    }
    for (k = 0; k < n; k++) {
        pthread_join(threads[k], NULL);
    }
}

static void three_ranks_all_reduce(void) {
    static const size_t ranks[3] = {0, 1, 2};
    mem_store s;
    job jobs[3];
    int round;
    size_t k;
    store_init(&s);
    /* Twice over one store: the second communicator is numbered apart from the first. */
    for (round = 0; round < 2; round++) {
        run_job(&s, 3, ranks, 3, 20000, jobs);
        for (k = 0; k < 3; k++) {
            if (jobs[k].result != TUTTI_SUCCESS) {
                FAIL("rank %zu: %s", k, jobs[k].error);
            }
            EXPECT(jobs[k].sum[0] == 6.0f && jobs[k].sum[1] == 30.0f);
        }
    }
    store_free(&s);
}

static void a_missing_rank_is_a_timeout_naming_it(void) {
    static const size_t ranks[2] = {0, 2};
    mem_store s;
    job jobs[2];
    size_t k;
    store_init(&s);
    run_job(&s, 3, ranks, 2, 500, jobs);
    for (k = 0; k < 2; k++) {
        EXPECT(jobs[k].result == TUTTI_ERROR_TIMEOUT);
        if (strstr(jobs[k].error, "rank 1 did not publish") == NULL) {
            FAIL("rank %zu: %s", jobs[k].rank, jobs[k].error);
        }
    }
    store_free(&s);
}

static void errors(void) {
    mem_store s;
    tutti_store t;
    tutti_comm *comm = NULL;
    store_init(&s);
    t = callbacks(&s);
    EXPECT_ERROR(tutti_comm_create_store(0, 2, &t, "short", NULL, NULL, &comm),
                 TUTTI_ERROR_INVALID_ARGUMENT, "tutti_comm_create_store", "token is 5 bytes",
                 "at least 16");
    EXPECT_ERROR(tutti_comm_create_store(0, 2, &t, NULL, NULL, NULL, &comm),
                 TUTTI_ERROR_INVALID_ARGUMENT, "token is NULL");
    EXPECT_ERROR(tutti_comm_create_store(0, 2, NULL, TOKEN, NULL, NULL, &comm),
                 TUTTI_ERROR_INVALID_ARGUMENT, "store is NULL");
    EXPECT_ERROR(tutti_comm_create_store(3, 2, &t, TOKEN, NULL, NULL, &comm),
                 TUTTI_ERROR_INVALID_ARGUMENT, "rank 3 is out of range for world_size 2");
    EXPECT_ERROR(tutti_comm_create_store(0, 0, &t, TOKEN, NULL, NULL, &comm),
                 TUTTI_ERROR_INVALID_ARGUMENT, "world_size is 0");
    EXPECT_ERROR(tutti_comm_create_store(0, 1, &t, TOKEN, NULL, NULL, NULL),
                 TUTTI_ERROR_INVALID_ARGUMENT, "comm is NULL");
    EXPECT_ERROR(tutti_comm_create_store(0, 1, &t, TOKEN, "\xff", NULL, &comm),
                 TUTTI_ERROR_INVALID_ARGUMENT, "listen_host is not UTF-8");
    t.struct_size = 8;
    EXPECT_ERROR(tutti_comm_create_store(0, 1, &t, TOKEN, NULL, NULL, &comm),
                 TUTTI_ERROR_INVALID_ARGUMENT, "store->struct_size is 8");
    t = callbacks(&s);
    t.get = NULL;
    EXPECT_ERROR(tutti_comm_create_store(0, 1, &t, TOKEN, NULL, NULL, &comm),
                 TUTTI_ERROR_INVALID_ARGUMENT, "store->get is NULL");
    t = callbacks(&s);
    t.add = NULL;
    EXPECT_ERROR(tutti_comm_create_store(0, 1, &t, TOKEN, NULL, NULL, &comm),
                 TUTTI_ERROR_INVALID_ARGUMENT, "store->add is NULL");
    /* None of these touched the store. */
    EXPECT(s.calls == 0);
    /* A `set` that fails: the error names the callback and the key. */
    t = callbacks(&s);
    s.fail_set = "/addr/";
    EXPECT_ERROR(tutti_comm_create_store(0, 1, &t, TOKEN, NULL, NULL, &comm),
                 TUTTI_ERROR_SYSTEM, "store callback 'set' failed for key 'tutti/1/addr/0'",
                 "returned 42");
    EXPECT(comm == NULL);
    s.fail_set = NULL;
    /* A value longer than tutti reads, and a failing `get`: errors naming the key. */
    t.get = huge_get;
    EXPECT_ERROR(tutti_comm_create_store(0, 1, &t, TOKEN, NULL, NULL, &comm),
                 TUTTI_ERROR_INVALID_ARGUMENT, "1048576 bytes for key 'tutti/2/addr/0'");
    t.get = failing_get;
    EXPECT_ERROR(tutti_comm_create_store(0, 1, &t, TOKEN, NULL, NULL, &comm),
                 TUTTI_ERROR_SYSTEM, "store callback 'get' failed for key 'tutti/3/addr/0'",
                 "returned -7", "rank 0's address");
    EXPECT(comm == NULL);
    t = callbacks(&s);
    /* A world of one needs no peer: the store alone. */
    CHECK(tutti_comm_create_store(0, 1, &t, TOKEN, "127.0.0.1", NULL, &comm));
    EXPECT(comm != NULL);
    tutti_comm_destroy(comm);
    store_free(&s);
}

/* tutti_comm_shrink: rank 1 of 3 leaves (its communicator destroyed, its port closed); the
 * others' next call fails, and they go on as ranks 0 and 1 of 2. */
static void *lose_one_and_shrink(void *arg) {
    job *j = arg;
    tutti_store t = callbacks(j->store);
    tutti_config c = TUTTI_CONFIG_INIT;
    tutti_comm *comm = NULL, *survivors = NULL;
    size_t rank = 99, world = 99;
    float v;
    c.timeout_ms = j->timeout_ms;
    CHECK(tutti_comm_create_store(j->rank, j->world, &t, TOKEN, NULL, &c, &comm));
    CHECK(tutti_barrier(comm));
    if (j->rank == 1) {
        tutti_comm_destroy(comm);
        return NULL;
    }
    EXPECT(tutti_barrier(comm) != TUTTI_SUCCESS);
    EXPECT_ERROR(tutti_comm_shrink(comm, NULL), TUTTI_ERROR_INVALID_ARGUMENT, "tutti_comm_shrink",
                 "newcomm is NULL");
    CHECK(tutti_comm_shrink(comm, &survivors));
    CHECK(tutti_comm_rank(survivors, &rank));
    CHECK(tutti_comm_world_size(survivors, &world));
    EXPECT(world == 2 && rank == (j->rank == 0 ? 0u : 1u));
    v = (float)rank + 1.0f;
    CHECK(tutti_all_reduce(survivors, 1, TUTTI_DTYPE_F32, TUTTI_OP_SUM, &v, &v));
    EXPECT(v == 3.0f);
    /* The parent stays aborted, with its first reason. */
    EXPECT_ERROR(tutti_barrier(comm), TUTTI_ERROR_ABORTED, "lost rank 1");
    tutti_comm_destroy(survivors);
    tutti_comm_destroy(comm);
    return NULL;
}

static void survivors_shrink(void) {
    mem_store s;
    job jobs[3];
    pthread_t threads[3];
    size_t k;
    store_init(&s);
    for (k = 0; k < 3; k++) {
        memset(&jobs[k], 0, sizeof jobs[k]);
        jobs[k].store = &s;
        jobs[k].world = 3;
        jobs[k].rank = k;
        jobs[k].timeout_ms = 20000;
        if (pthread_create(&threads[k], NULL, lose_one_and_shrink, &jobs[k]) != 0) {
            FAIL("pthread_create failed");
        }
    }
    for (k = 0; k < 3; k++) {
        pthread_join(threads[k], NULL);
    }
    store_free(&s);
}

int main(void) {
    errors();
    three_ranks_all_reduce();
    a_missing_rank_is_a_timeout_naming_it();
    survivors_shrink();
    printf("store: ok\n");
    return 0;
}
