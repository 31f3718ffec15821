/* A data-parallel trainer in C: four replicas, one thread each, fit the same linear model
 * y = w·x + b on their own shards of the data. Every step each replica computes its gradient,
 * tutti averages the gradients across replicas (all-reduce MEAN), and each replica applies the
 * same update, so the replicas stay identical without ever exchanging weights.
 *
 *     cc -std=c11 -Iinclude examples/c/train_step.c target/release/libtutti.a \
 *        -lpthread -ldl -lm -lrt -lutil -o train_step && ./train_step
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tutti.h"

#define REPLICAS 4
#define FEATURES 8
#define SAMPLES 256 /* per replica */
#define STEPS 200
#define LEARNING_RATE 0.5f

typedef struct replica {
    tutti_comm *comm;
    size_t rank;
    float x[SAMPLES][FEATURES];
    float y[SAMPLES];
    float params[FEATURES + 1]; /* weights, then the bias */
    float first_loss, last_loss;
    int failed;
} replica;

/* Print what failed and why, from the calling thread's last error. */
static int report(const char *what, tutti_result r) {
    char message[1024];
    tutti_last_error(message, sizeof message);
    fprintf(stderr, "%s failed: %s\n  %s\n", what, tutti_result_string(r), message);
    return 1;
}

/* The same true model for everyone; each replica draws its own samples. */
static void make_shard(replica *rep) {
    unsigned seed = 12345u + 7919u * (unsigned)rep->rank;
    size_t s, f;
    for (s = 0; s < SAMPLES; s++) {
        float y = 0.5f; /* true bias */
        for (f = 0; f < FEATURES; f++) {
            seed = seed * 1103515245u + 12345u;
            rep->x[s][f] = (float)((seed >> 16) & 0x7fff) / 32768.0f - 0.5f;
            y += (float)(f + 1) * 0.25f * rep->x[s][f]; /* true weights 0.25, 0.5, ... */
        }
        rep->y[s] = y;
    }
}

/* Mean squared error on this replica's shard, and its gradient. */
static float loss_and_gradient(const replica *rep, float grad[FEATURES + 1]) {
    float loss = 0;
    size_t s, f;
    memset(grad, 0, sizeof(float) * (FEATURES + 1));
    for (s = 0; s < SAMPLES; s++) {
        float pred = rep->params[FEATURES], err;
        for (f = 0; f < FEATURES; f++) {
            pred += rep->params[f] * rep->x[s][f];
        }
        err = pred - rep->y[s];
        loss += err * err;
        for (f = 0; f < FEATURES; f++) {
            grad[f] += 2 * err * rep->x[s][f] / SAMPLES;
        }
        grad[FEATURES] += 2 * err / SAMPLES;
    }
    return loss / SAMPLES;
}

static void *train(void *arg) {
    replica *rep = arg;
    float grad[FEATURES + 1];
    int step;
    size_t i;
    tutti_result r;
    for (step = 0; step < STEPS; step++) {
        float loss = loss_and_gradient(rep, grad);
        /* One call: every replica's gradient becomes the mean over all replicas. */
        r = tutti_all_reduce(rep->comm, FEATURES + 1, TUTTI_DTYPE_F32, TUTTI_OP_MEAN, grad, grad);
        if (r != TUTTI_SUCCESS) {
            rep->failed = report("tutti_all_reduce", r);
            /* Wake the other replicas instead of letting them wait for this one. */
            tutti_comm_abort(rep->comm, "a replica failed");
            return NULL;
        }
        for (i = 0; i < FEATURES + 1; i++) {
            rep->params[i] -= LEARNING_RATE * grad[i];
        }
        if (step == 0) {
            rep->first_loss = loss;
        }
        rep->last_loss = loss;
    }
    /* Check that every replica ended with the same parameters: the max and min agree. */
    {
        float hi[FEATURES + 1], lo[FEATURES + 1];
        memcpy(hi, rep->params, sizeof hi);
        memcpy(lo, rep->params, sizeof lo);
        if ((r = tutti_all_reduce(rep->comm, FEATURES + 1, TUTTI_DTYPE_F32, TUTTI_OP_MAX, hi,
                                  hi)) != TUTTI_SUCCESS ||
            (r = tutti_all_reduce(rep->comm, FEATURES + 1, TUTTI_DTYPE_F32, TUTTI_OP_MIN, lo,
                                  lo)) != TUTTI_SUCCESS) {
            rep->failed = report("checking the parameters", r);
            return NULL;
        }
        rep->failed = memcmp(hi, lo, sizeof hi) != 0;
    }
    return NULL;
}

int main(void) {
    static replica reps[REPLICAS];
    tutti_comm *comms[REPLICAS];
    pthread_t threads[REPLICAS];
    tutti_config config = TUTTI_CONFIG_INIT;
    tutti_result r;
    size_t i;
    int failed = 0;

    config.timeout_ms = 60000; /* no replica waits for a lost peer longer than a minute */
    r = tutti_comm_create_group(REPLICAS, &config, comms);
    if (r != TUTTI_SUCCESS) {
        return report("tutti_comm_create_group", r);
    }
    for (i = 0; i < REPLICAS; i++) {
        reps[i].comm = comms[i];
        reps[i].rank = i;
        make_shard(&reps[i]);
        pthread_create(&threads[i], NULL, train, &reps[i]);
    }
    for (i = 0; i < REPLICAS; i++) {
        pthread_join(threads[i], NULL);
        failed |= reps[i].failed;
        tutti_comm_destroy(comms[i]);
    }
    if (failed) {
        fprintf(stderr, "training failed or the replicas disagree\n");
        return 1;
    }
    printf("loss %.4f -> %.2e after %d steps on %d replicas\n", reps[0].first_loss,
           reps[0].last_loss, STEPS, REPLICAS);
    printf("w[0] = %.3f (true 0.25), bias = %.3f (true 0.5); replicas agree\n", reps[0].params[0],
           reps[0].params[FEATURES]);
    if (!(reps[0].last_loss < reps[0].first_loss / 1000) || fabsf(reps[0].params[0] - 0.25f) > 0.01f ||
        fabsf(reps[0].params[FEATURES] - 0.5f) > 0.01f) {
        fprintf(stderr, "the model did not learn\n");
        return 1;
    }
    return 0;
}
