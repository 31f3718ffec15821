/* Helpers shared by the C tests of tutti's C API: checks that report the failing call with
 * tutti_last_error, a thread per rank, and element conversions for every dtype. */
#ifndef TUTTI_TEST_CHECK_H
#define TUTTI_TEST_CHECK_H

#define _POSIX_C_SOURCE 200809L

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "tutti.h"

/* The calling thread's last error, in a static per-call buffer owned by the caller. */
static inline void last_error(char *buf, size_t len) {
    size_t n = tutti_last_error(buf, len);
    if (n >= len) {
        fprintf(stderr, "(last error cut short: %zu bytes)\n", n);
    }
}

#define FAIL(...)                                                                                  \
    do {                                                                                           \
        fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                                            \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fprintf(stderr, "\n");                                                                     \
        exit(1);                                                                                   \
    } while (0)

/* The call must succeed. */
#define CHECK(call)                                                                                \
    do {                                                                                           \
        tutti_result check_r_ = (call);                                                            \
        if (check_r_ != TUTTI_SUCCESS) {                                                           \
            char check_m_[2048];                                                                   \
            last_error(check_m_, sizeof check_m_);                                                 \
            FAIL("%s returned %u (%s): %s", #call, (unsigned)check_r_,                             \
                 tutti_result_string(check_r_), check_m_);                                         \
        }                                                                                          \
    } while (0)

#define EXPECT(cond)                                                                               \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            FAIL("expected %s", #cond);                                                            \
        }                                                                                          \
    } while (0)

/* The call must fail with `code`, and the thread's last error must contain every one of the
 * NULL-terminated substrings that follow. */
static inline void expect_error_at(const char *file, int line, const char *text, tutti_result got,
                            tutti_result code, ...);
#define EXPECT_ERROR(call, code, ...)                                                              \
    expect_error_at(__FILE__, __LINE__, #call, (call), (code), __VA_ARGS__, (const char *)NULL)

static inline void expect_error_at(const char *file, int line, const char *text, tutti_result got,
                            tutti_result code, ...) {
    char m[2048];
    va_list ap;
    const char *want;
    last_error(m, sizeof m);
    if (got != code) {
        fprintf(stderr, "%s:%d: %s returned %u (%s), expected %u; last error: %s\n", file, line,
                text, (unsigned)got, tutti_result_string(got), (unsigned)code, m);
        exit(1);
    }
    va_start(ap, code);
    while ((want = va_arg(ap, const char *)) != NULL) {
        if (strstr(m, want) == NULL) {
            fprintf(stderr, "%s:%d: %s: the last error \"%s\" does not mention \"%s\"\n", file,
                    line, text, m, want);
            exit(1);
        }
    }
    va_end(ap);
}

/* ----- a thread per rank ----- */

typedef struct rank_ctx {
    tutti_comm *comm;
    size_t rank;
    size_t world;
    void *arg;
} rank_ctx;

/* Run `fn` on one thread per communicator, and wait for all of them. */
static inline void run_ranks(size_t world, tutti_comm **comms, void *(*fn)(void *), void *arg) {
    pthread_t threads[64];
    rank_ctx ctx[64];
    size_t r;
    EXPECT(world <= 64);
    for (r = 0; r < world; r++) {
        ctx[r].comm = comms[r];
        ctx[r].rank = r;
        ctx[r].world = world;
        ctx[r].arg = arg;
        if (pthread_create(&threads[r], NULL, fn, &ctx[r]) != 0) {
            FAIL("pthread_create failed for rank %zu", r);
        }
    }
    for (r = 0; r < world; r++) {
        pthread_join(threads[r], NULL);
    }
}

/* A TCP port on 127.0.0.1 that nothing listens on right now. */
static inline int free_port(void) {
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    int s = socket(AF_INET, SOCK_STREAM, 0), port;
    EXPECT(s >= 0);
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT(bind(s, (struct sockaddr *)&a, sizeof a) == 0);
    EXPECT(getsockname(s, (struct sockaddr *)&a, &len) == 0);
    port = ntohs(a.sin_port);
    close(s);
    return port;
}

static inline double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static inline void sleep_ms(long ms) {
    struct timespec ts;
    ts.tv_sec = ms / 1000;
    ts.tv_nsec = (ms % 1000) * 1000000L;
    nanosleep(&ts, NULL);
}

/* ----- elements of every dtype, as doubles ----- */

static inline size_t dtype_size(tutti_dtype d) {
    switch (d) {
    case TUTTI_DTYPE_I8:
    case TUTTI_DTYPE_U8:
        return 1;
    case TUTTI_DTYPE_F16:
    case TUTTI_DTYPE_BF16:
        return 2;
    case TUTTI_DTYPE_F32:
    case TUTTI_DTYPE_I32:
    case TUTTI_DTYPE_U32:
        return 4;
    default:
        return 8;
    }
}

static inline const char *dtype_name(tutti_dtype d) {
    static const char *names[] = {"f32", "f64", "f16", "bf16", "i8",
                                  "u8",  "i32", "u32", "i64",  "u64"};
    return d < 10 ? names[d] : "?";
}

static inline uint32_t float_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

static inline float bits_float(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* Exact for the values the tests use: zero and normal numbers with at most 11 significant bits. */
static inline uint16_t f16_from_float(float f) {
    uint32_t b = float_bits(f);
    uint32_t sign = (b >> 31) & 1u, exp = (b >> 23) & 0xffu, mant = b & 0x7fffffu;
    if (exp == 0) {
        return (uint16_t)(sign << 15);
    }
    return (uint16_t)((sign << 15) | ((exp - 127u + 15u) << 10) | (mant >> 13));
}

static inline float f16_to_float(uint16_t h) {
    uint32_t sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0 && mant == 0) {
        return bits_float(sign << 31);
    }
    return bits_float((sign << 31) | ((exp - 15u + 127u) << 23) | (mant << 13));
}

static inline double get_elem(tutti_dtype d, const void *buf, size_t i) {
    switch (d) {
    case TUTTI_DTYPE_F32:
        return ((const float *)buf)[i];
    case TUTTI_DTYPE_F64:
        return ((const double *)buf)[i];
    case TUTTI_DTYPE_F16:
        return f16_to_float(((const uint16_t *)buf)[i]);
    case TUTTI_DTYPE_BF16:
        return bits_float((uint32_t)((const uint16_t *)buf)[i] << 16);
    case TUTTI_DTYPE_I8:
        return ((const int8_t *)buf)[i];
    case TUTTI_DTYPE_U8:
        return ((const uint8_t *)buf)[i];
    case TUTTI_DTYPE_I32:
        return ((const int32_t *)buf)[i];
    case TUTTI_DTYPE_U32:
        return ((const uint32_t *)buf)[i];
    case TUTTI_DTYPE_I64:
        return (double)((const int64_t *)buf)[i];
    default:
        return (double)((const uint64_t *)buf)[i];
    }
}

static inline void set_elem(tutti_dtype d, void *buf, size_t i, double v) {
    switch (d) {
    case TUTTI_DTYPE_F32:
        ((float *)buf)[i] = (float)v;
        break;
    case TUTTI_DTYPE_F64:
        ((double *)buf)[i] = v;
        break;
    case TUTTI_DTYPE_F16:
        ((uint16_t *)buf)[i] = f16_from_float((float)v);
        break;
    case TUTTI_DTYPE_BF16:
        ((uint16_t *)buf)[i] = (uint16_t)(float_bits((float)v) >> 16);
        break;
    case TUTTI_DTYPE_I8:
        ((int8_t *)buf)[i] = (int8_t)v;
        break;
    case TUTTI_DTYPE_U8:
        ((uint8_t *)buf)[i] = (uint8_t)v;
        break;
    case TUTTI_DTYPE_I32:
        ((int32_t *)buf)[i] = (int32_t)v;
        break;
    case TUTTI_DTYPE_U32:
        ((uint32_t *)buf)[i] = (uint32_t)v;
        break;
    case TUTTI_DTYPE_I64:
        ((int64_t *)buf)[i] = (int64_t)v;
        break;
    default:
        ((uint64_t *)buf)[i] = (uint64_t)v;
        break;
    }
}

static inline int is_float(tutti_dtype d) {
    return d <= TUTTI_DTYPE_BF16;
}

#endif
