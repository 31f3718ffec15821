/* A data-parallel trainer in C with MirroredStrategy: four replicas fit the same linear model
 * y = w·x + b on their shards of one global batch. The trainer writes the step once; the
 * strategy runs it on every replica at once. Each replica computes its gradient, the gradients
 * are averaged across replicas (all-reduce MEAN), and each replica applies the same update to
 * its mirrored copy of the parameters, so the copies stay identical.
 *
 *     cc -std=c11 -Iinclude examples/c/train_mirrored.c target/release/libtutti.a \
 *        -lpthread -ldl -lm -lrt -lutil -o train_mirrored && ./train_mirrored
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tutti.h"

#define REPLICAS 4
#define FEATURES 8
#define SAMPLES 512 /* the global batch */
#define STEPS 200
#define LEARNING_RATE 0.5f

typedef struct trainer {
    float x[SAMPLES][FEATURES];
    float y[SAMPLES];
    float params[REPLICAS][FEATURES + 1]; /* a mirrored copy per replica: weights, then bias */
    float loss[REPLICAS];
} trainer;

static int report(const char *what, tutti_result r) {
    char message[1024];
    tutti_last_error(message, sizeof message);
    fprintf(stderr, "%s failed: %s\n  %s\n", what, tutti_result_string(r), message);
    return 1;
}

static void make_data(trainer *t) {
    unsigned seed = 2024u;
    size_t s, f;
    for (s = 0; s < SAMPLES; s++) {
        float y = -0.25f; /* true bias */
        for (f = 0; f < FEATURES; f++) {
            seed = seed * 1103515245u + 12345u;
            t->x[s][f] = (float)((seed >> 16) & 0x7fff) / 32768.0f - 0.5f;
            y += (float)(f + 1) * 0.5f * t->x[s][f];
        }
        t->y[s] = y;
    }
}

/* One training step on one replica: gradient on its shard, averaged, applied. */
static tutti_result step(const tutti_replica_context *ctx, void *user_data) {
    trainer *t = user_data;
    size_t id, s, f, first, last, num_replicas = REPLICAS;
    float grad[FEATURES + 2] = {0}; /* gradient, then the loss */
    float *p;
    tutti_result r = tutti_replica_id(ctx, &id, NULL);
    if (r != TUTTI_SUCCESS) {
        return r;
    }
    p = t->params[id];
    first = id * SAMPLES / num_replicas;
    last = (id + 1) * SAMPLES / num_replicas;
    for (s = first; s < last; s++) {
        float err = p[FEATURES] - t->y[s];
        for (f = 0; f < FEATURES; f++) {
            err += p[f] * t->x[s][f];
        }
        for (f = 0; f < FEATURES; f++) {
            grad[f] += 2.0f * err * t->x[s][f] / (float)(last - first);
        }
        grad[FEATURES] += 2.0f * err / (float)(last - first);
        grad[FEATURES + 1] += err * err / (float)(last - first);
    }
    /* Every replica's shard has the same size, so the mean of the shard means is the mean. */
    r = tutti_replica_all_reduce(ctx, FEATURES + 2, TUTTI_DTYPE_F32, TUTTI_OP_MEAN, grad);
    if (r != TUTTI_SUCCESS) {
        return r;
    }
    for (f = 0; f <= FEATURES; f++) {
        p[f] -= LEARNING_RATE * grad[f];
    }
    t->loss[id] = grad[FEATURES + 1];
    return TUTTI_SUCCESS;
}

int main(void) {
    static trainer t;
    tutti_strategy *strategy = NULL;
    size_t replicas = 0, i, f;
    float first_loss = 0;
    int s;
    tutti_result r;

    make_data(&t);
    memset(t.params, 0, sizeof t.params);
    r = tutti_strategy_create(TUTTI_STRATEGY_MIRRORED, REPLICAS, TUTTI_CROSS_DEVICE_OPS_DEFAULT,
                              &strategy);
    if (r != TUTTI_SUCCESS) {
        return report("tutti_strategy_create", r);
    }
    tutti_strategy_num_replicas(strategy, &replicas, NULL);
    for (s = 0; s < STEPS; s++) {
        r = tutti_strategy_run(strategy, step, &t);
        if (r != TUTTI_SUCCESS) {
            tutti_strategy_destroy(strategy);
            return report("tutti_strategy_run", r);
        }
        if (s == 0) {
            first_loss = t.loss[0];
        }
    }
    tutti_strategy_destroy(strategy);
    for (i = 1; i < REPLICAS; i++) {
        if (memcmp(t.params[0], t.params[i], sizeof t.params[0]) != 0) {
            fprintf(stderr, "replica %zu's parameters differ from replica 0's\n", i);
            return 1;
        }
    }
    printf("MirroredStrategy, %zu replicas: loss %.6f -> %.6f\n", replicas, first_loss, t.loss[0]);
    for (f = 0; f < FEATURES; f++) {
        if (fabsf(t.params[0][f] - (float)(f + 1) * 0.5f) > 0.02f) {
            fprintf(stderr, "weight %zu is %f, not %f\n", f, t.params[0][f], (float)(f + 1) * 0.5f);
            return 1;
        }
    }
    if (fabsf(t.params[0][FEATURES] + 0.25f) > 0.02f || !(t.loss[0] < first_loss / 100)) {
        fprintf(stderr, "did not converge\n");
        return 1;
    }
    printf("mirrored replicas agree and converged\n");
    return 0;
}
