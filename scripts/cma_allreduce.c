/* An all-reduce of two processes through cross-memory attach (process_vm_readv), the
 * zero-copy design tutti measured and did not take (README: "Zero-copy between processes:
 * shared buffers"). Nothing of tutti is in it: no call checks, no timeouts, spinning barriers.
 *
 *   gcc -O3 -march=native scripts/cma_allreduce.c -o cma && ./cma BYTES [CHUNK_BYTES]
 *
 * Each rank owns a private input and output of BYTES (f32). Rank r reads half r of the peer's
 * input in chunks into a cache-sized scratch buffer and reduces it with its own input into its
 * output; after a barrier it reads the other half of the result from the peer's output straight
 * into its own. Prints the mean time per all-reduce (the first tenth of the iterations left out)
 * and checks every result. Each process needs ptrace permission over the other (the child
 * reads its parent too): Yama's ptrace_scope 0, or CAP_SYS_PTRACE.
 */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    _Atomic long phase[2];
    float *in[2];
    float *out[2];
    pid_t pid[2];
} Shared;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void barrier(Shared *s, int r, long v) {
    atomic_store(&s->phase[r], v);
    while (atomic_load(&s->phase[1 - r]) < v)
        sched_yield();
}

static void read_peer(pid_t peer, void *dst, const void *src, size_t bytes) {
    struct iovec local = {dst, bytes}, remote = {(void *)src, bytes};
    if (process_vm_readv(peer, &local, 1, &remote, 1, 0) != (ssize_t)bytes) {
        perror("process_vm_readv");
        exit(1);
    }
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s BYTES [CHUNK_BYTES]\n", argv[0]);
        return 2;
    }
    size_t n = (size_t)atol(argv[1]) / 4, chunk = (argc > 2 ? (size_t)atol(argv[2]) : 256 << 10) / 4;
    if (n < 2 || chunk == 0) {
        fprintf(stderr, "BYTES must be at least 8 and CHUNK_BYTES at least 4\n");
        return 2;
    }
    Shared *s = mmap(NULL, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (s == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    memset(s, 0, sizeof(Shared));
    pid_t child = fork();
    if (child < 0) {
        perror("fork");
        return 1;
    }
    int r = child == 0;
    float *in = aligned_alloc(64, n * 4), *out = aligned_alloc(64, n * 4), *scratch = aligned_alloc(64, chunk * 4);
    if (!in || !out || !scratch) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < n; i++)
        in[i] = (float)(r + 1);
    memset(out, 0, n * 4);
    s->in[r] = in;
    s->out[r] = out;
    s->pid[r] = getpid();
    long phase = 1;
    barrier(s, r, phase++);
    pid_t peer = s->pid[1 - r];
    size_t half = n / 2, lo = r ? half : 0, hi = r ? n : half, plo = r ? 0 : half, phi = r ? half : n;
    int iters = n * 4 <= (1 << 20) ? 2000 : 20;
    double sum = 0;
    for (int it = 0; it < iters; it++) {
        double t0 = now();
        barrier(s, r, phase++);
        for (size_t o = lo; o < hi; o += chunk) {
            size_t m = hi - o < chunk ? hi - o : chunk;
            read_peer(peer, scratch, s->in[1 - r] + o, m * 4);
            for (size_t i = 0; i < m; i++)
                out[o + i] = in[o + i] + scratch[i];
        }
        barrier(s, r, phase++);
        read_peer(peer, out + plo, s->out[1 - r] + plo, (phi - plo) * 4);
        barrier(s, r, phase++);
        if (it >= iters / 10)
            sum += now() - t0;
        if (out[0] != 3.0f || out[n - 1] != 3.0f) {
            fprintf(stderr, "rank %d: wrong sum\n", r);
            return 1;
        }
    }
    if (r == 0) {
        printf("%zu bytes: %.1f us per all-reduce\n", n * 4, sum / (iters - iters / 10) * 1e6);
        int status = 0;
        waitpid(child, &status, 0);
        return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    }
    return 0;
}
