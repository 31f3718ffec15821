/* Parameter servers from C: a ps task, two workers and the chief on threads of one process.
 * The chief creates a sharded variable, schedules steps carrying payloads and fetches what they
 * sent back, runs steps, reads the variable; a step function that fails is the step's error
 * (TUTTI_ERROR_STEP_FAILED, the workers stay); a float64 variable the steps push to with momentum,
 * which the ps task applies; the strategy's scope, whose variables live on the ps task; and the
 * argument errors. */
#include "check.h"

static char cluster[512];

/* The TF_CONFIG text of task `type`:`index`. */
static void tf_config(char *buf, size_t len, const char *type, int index) {
    snprintf(buf, len, "{\"cluster\": %s, \"task\": {\"type\": \"%s\", \"index\": %d}}", cluster,
             type, index);
}

/* A wrong gradient length, a wrong dtype and a bad update were refused inside a step, as they
 * should be. */
static int refused_gradient = 0, refused_dtype = 0, refused_update = 0;

/* The payload is a command. The output: this worker's index, then the variable's first element
 * as pulled. */
static tutti_result step_fn(tutti_ps_step *step, void *user_data) {
    const void *payload = NULL, *data = NULL;
    const float *w = NULL;
    size_t len = 0, n = 0, worker = 0, workers = 0, vars = 0;
    uint64_t number = 0;
    float ones[6] = {1, 1, 1, 1, 1, 1}, out[2];
    double twos[2] = {1, 1};
    tutti_dtype dtype = 99;
    tutti_ps_update momentum = TUTTI_PS_UPDATE_INIT, bad = TUTTI_PS_UPDATE_INIT;
    char why[512];
    (void)user_data;
    momentum.learning_rate = 0.1f;
    momentum.momentum = 0.9f;
    momentum.slots = 3;
    bad.struct_size = 8;
    CHECK(tutti_ps_step_info(step, &number, &worker, &workers, &vars));
    EXPECT(workers == 2 && (vars == 2 || vars == 3));
    CHECK(tutti_ps_step_payload(step, &payload, &len));
    CHECK(tutti_ps_step_variable(step, 0, &dtype, &data, &n));
    EXPECT(n == 6 && dtype == TUTTI_DTYPE_F32);
    w = data;
    CHECK(tutti_ps_step_variable(step, 1, &dtype, &data, &n));
    EXPECT(n == 2 && dtype == TUTTI_DTYPE_F64);
    if (len == 6 && memcmp(payload, "scoped", 6) == 0) {
        /* The variable made in the chief's scope, by its index. */
        CHECK(tutti_ps_step_variable(step, 2, &dtype, &data, &n));
        EXPECT(vars == 3 && n == 3 && dtype == TUTTI_DTYPE_F32);
        out[0] = (float)worker;
        out[1] = ((const float *)data)[2];
        CHECK(tutti_ps_step_set_output(step, out, sizeof out));
        return TUTTI_SUCCESS;
    }
    if (len == 5 && memcmp(payload, "raise", 5) == 0) {
        CHECK(tutti_ps_step_set_error(step, "raised by the C step"));
        return TUTTI_ERROR_INVALID_ARGUMENT;
    }
    if (tutti_ps_step_set_gradient(step, 0, TUTTI_DTYPE_F32, ones, 5) ==
        TUTTI_ERROR_INVALID_ARGUMENT) {
        refused_gradient = 1;
    }
    if (tutti_ps_step_push(step, 1, TUTTI_DTYPE_F32, ones, 2, &momentum) ==
            TUTTI_ERROR_INVALID_ARGUMENT &&
        (last_error(why, sizeof why), strstr(why, "2 f32 elements for variable 1, of 2 f64"))) {
        refused_dtype = 1;
    }
    if (tutti_ps_step_push(step, 1, TUTTI_DTYPE_F64, twos, 2, &bad) ==
            TUTTI_ERROR_INVALID_ARGUMENT &&
        (last_error(why, sizeof why), strstr(why, "struct_size is 8"))) {
        refused_update = 1;
    }
    if (len == 4 && memcmp(payload, "step", 4) == 0) {
        CHECK(tutti_ps_step_set_gradient(step, 0, TUTTI_DTYPE_F32, ones, 6));
        CHECK(tutti_ps_step_push(step, 1, TUTTI_DTYPE_F64, twos, 2, &momentum));
    }
    out[0] = (float)worker;
    out[1] = w[0];
    CHECK(tutti_ps_step_set_output(step, out, sizeof out));
    CHECK(tutti_ps_step_set_loss(step, (float)number));
    return TUTTI_SUCCESS;
}

struct task {
    const char *type;
    int index;
    tutti_result result;
    int got_coordinator;
};

static void *serve(void *arg) {
    struct task *t = arg;
    char config[1024];
    tutti_ps_strategy *s = NULL;
    tutti_ps_coordinator *c = (tutti_ps_coordinator *)1;
    tf_config(config, sizeof config, t->type, t->index);
    CHECK(tutti_ps_strategy_create(config, TUTTI_PARTITIONER_FIXED_SHARDS, 3, 30000, &s));
    t->result = tutti_ps_run_role(s, step_fn, NULL, &c);
    t->got_coordinator = c != NULL;
    tutti_ps_strategy_destroy(s);
    return NULL;
}

int main(void) {
    char config[1024];
    struct task tasks[3] = {{"ps", 0, 99, 1}, {"worker", 0, 99, 1}, {"worker", 1, 99, 1}};
    pthread_t threads[3];
    tutti_ps_strategy *s = NULL;
    tutti_ps_coordinator *c = NULL;
    tutti_ps_remote_value *values[4] = {NULL}, *raised = NULL, *read = NULL;
    float init[6] = {100, 100, 100, 100, 100, 100}, w[6], loss = -1, out[2], losses[3];
    double zeros[2] = {0, 0}, m[2];
    size_t index = 9, shards = 0, workers = 0, out_len = 0, i;
    tutti_ps_update sgd = TUTTI_PS_UPDATE_INIT;
    char small[3];

    snprintf(cluster, sizeof cluster,
             "{\"chief\": [\"127.0.0.1:%d\"], \"ps\": [\"127.0.0.1:%d\"], "
             "\"worker\": [\"127.0.0.1:%d\", \"127.0.0.1:%d\"]}",
             free_port(), free_port(), free_port(), free_port());
    setenv("TUTTI_JOB_TOKEN", "c-parameter-server-test-token", 1);

    /* Argument errors first. */
    EXPECT_ERROR(tutti_ps_strategy_create("{}", 9, 1, 0, &s), TUTTI_ERROR_INVALID_ARGUMENT,
                 "partitioner 9");
    EXPECT_ERROR(tutti_ps_strategy_create(NULL, 0, 1, 0, NULL), TUTTI_ERROR_INVALID_ARGUMENT,
                 "strategy is NULL");
    EXPECT_ERROR(tutti_ps_run_role(NULL, step_fn, NULL, &c), TUTTI_ERROR_INVALID_ARGUMENT,
                 "strategy is NULL");
    EXPECT_ERROR(tutti_ps_coordinator_join(NULL), TUTTI_ERROR_INVALID_ARGUMENT,
                 "coordinator is NULL");
    tutti_ps_coordinator_destroy(NULL);
    tutti_ps_remote_value_destroy(NULL);

    for (i = 0; i < 3; i++) {
        EXPECT(pthread_create(&threads[i], NULL, serve, &tasks[i]) == 0);
    }
    tf_config(config, sizeof config, "chief", 0);
    CHECK(tutti_ps_strategy_create(config, TUTTI_PARTITIONER_FIXED_SHARDS, 3, 30000, &s));
    EXPECT_ERROR(tutti_ps_run_role(s, NULL, NULL, &c), TUTTI_ERROR_INVALID_ARGUMENT,
                 "step is NULL");
    CHECK(tutti_ps_run_role(s, step_fn, NULL, &c));
    EXPECT(c != NULL);
    CHECK(tutti_ps_coordinator_num_workers(c, &workers));
    EXPECT(workers == 2);
    sgd.learning_rate = 0.5f;
    CHECK(tutti_ps_coordinator_create_variable(c, "w", TUTTI_DTYPE_F32, init, 6, 0, &sgd, &index,
                                               &shards));
    EXPECT(index == 0 && shards == 3);
    /* Stepped by the rule each step pushes with (NULL here: w -= gradient). */
    CHECK(tutti_ps_coordinator_create_variable(c, "m", TUTTI_DTYPE_F64, zeros, 2, 1, NULL, &index,
                                               &shards));
    EXPECT(index == 1 && shards == 1);

    /* Four scheduled steps: each sends back its worker and the value it pulled. */
    for (i = 0; i < 4; i++) {
        CHECK(tutti_ps_coordinator_schedule(c, "step", 4, &values[i]));
    }
    CHECK(tutti_ps_coordinator_join(c));
    for (i = 0; i < 4; i++) {
        CHECK(tutti_ps_coordinator_fetch(c, values[i], &loss, out, sizeof out, &out_len));
        EXPECT(loss == (float)i && out_len == sizeof out && out[0] < 2.0f);
    }
    /* A buffer too small: what fits, and the full length. */
    CHECK(tutti_ps_coordinator_fetch(c, values[0], NULL, small, sizeof small, &out_len));
    EXPECT(out_len == sizeof out);
    CHECK(tutti_ps_coordinator_read_variable(c, 0, TUTTI_DTYPE_F32, w, 6));
    for (i = 0; i < 6; i++) {
        EXPECT(w[i] == 98.0f); /* 100 - 4 steps x 0.5 x 1 */
    }
    /* Momentum kept on the ps task: v = -0.1, -0.19, -0.271, -0.3439; their sum. */
    CHECK(tutti_ps_coordinator_read_variable(c, 1, TUTTI_DTYPE_F64, m, 2));
    EXPECT(m[0] + 0.9049 < 1e-5 && m[0] + 0.9049 > -1e-5 && m[0] == m[1]);
    /* From the coordinator, at once on the ps task: m -= 1 (NULL update). */
    {
        double ones64[2] = {1, 1};
        tutti_ps_update bad = TUTTI_PS_UPDATE_INIT;
        CHECK(tutti_ps_coordinator_push(c, 1, TUTTI_DTYPE_F64, ones64, 2, NULL));
        CHECK(tutti_ps_coordinator_read_variable(c, 1, TUTTI_DTYPE_F64, m, 2));
        EXPECT(m[0] + 1.9049 < 1e-5 && m[0] + 1.9049 > -1e-5);
        bad.momentum = 1.5f;
        EXPECT_ERROR(tutti_ps_coordinator_push(c, 1, TUTTI_DTYPE_F64, ones64, 2, &bad),
                     TUTTI_ERROR_INVALID_ARGUMENT, "momentum 1.5 must be in [0, 1]");
        bad.momentum = 0.0f;
        bad.reserved = 7;
        EXPECT_ERROR(tutti_ps_coordinator_push(c, 1, TUTTI_DTYPE_F64, ones64, 2, &bad),
                     TUTTI_ERROR_INVALID_ARGUMENT, "reserved is 7");
        EXPECT_ERROR(tutti_ps_coordinator_push(c, 1, TUTTI_DTYPE_F32, ones64, 2, NULL),
                     TUTTI_ERROR_INVALID_ARGUMENT, "2 f32 values for variable 1 of 2 f64");
    }
    EXPECT(refused_gradient && refused_dtype && refused_update);

    /* A read-only step, run by fetch. */
    CHECK(tutti_ps_coordinator_schedule(c, "read", 4, &read));
    CHECK(tutti_ps_coordinator_fetch(c, read, NULL, out, sizeof out, NULL));
    EXPECT(out[1] == 98.0f);

    /* A step that fails: join and fetch say so; the workers stay. */
    CHECK(tutti_ps_coordinator_schedule(c, "raise", 5, &raised));
    EXPECT_ERROR(tutti_ps_coordinator_join(c), TUTTI_ERROR_STEP_FAILED, "raised by the C step",
                 "step 5 failed on worker");
    EXPECT_ERROR(tutti_ps_coordinator_fetch(c, raised, NULL, NULL, 0, NULL),
                 TUTTI_ERROR_STEP_FAILED, "raised by the C step");
    CHECK(tutti_ps_coordinator_num_workers(c, &workers));
    EXPECT(workers == 2);

    CHECK(tutti_ps_coordinator_run_steps(c, 3, losses));
    EXPECT(losses[0] == 0.0f && losses[1] == 1.0f && losses[2] == 2.0f);
    EXPECT_ERROR(tutti_ps_coordinator_read_variable(c, 0, TUTTI_DTYPE_F32, w, 5),
                 TUTTI_ERROR_INVALID_ARGUMENT, "5 f32 elements", "has 6 f32");
    EXPECT_ERROR(tutti_ps_coordinator_read_variable(c, 1, TUTTI_DTYPE_F32, w, 2),
                 TUTTI_ERROR_INVALID_ARGUMENT, "2 f32 elements", "has 2 f64");
    /* Set from the coordinator (a restored checkpoint), across the three shards. */
    CHECK(tutti_ps_coordinator_assign_variable(c, 0, TUTTI_DTYPE_F32, init, 6));
    CHECK(tutti_ps_coordinator_read_variable(c, 0, TUTTI_DTYPE_F32, w, 6));
    EXPECT(memcmp(w, init, sizeof w) == 0);
    EXPECT_ERROR(tutti_ps_coordinator_assign_variable(c, 0, TUTTI_DTYPE_F32, init, 4),
                 TUTTI_ERROR_INVALID_ARGUMENT, "4 f32 values", "6 f32 elements");
    EXPECT_ERROR(tutti_ps_coordinator_read_variable(c, 2, TUTTI_DTYPE_F32, w, 6),
                 TUTTI_ERROR_INVALID_ARGUMENT, "variable 2");
    EXPECT_ERROR(tutti_ps_coordinator_create_variable(c, "v", TUTTI_DTYPE_F32, init, 6, 7, NULL,
                                                      NULL, NULL),
                 TUTTI_ERROR_INVALID_ARGUMENT, "7 shards for 6 elements");
    EXPECT_ERROR(tutti_ps_coordinator_create_variable(c, "i", TUTTI_DTYPE_I32, init, 6, 0, NULL,
                                                      NULL, NULL),
                 TUTTI_ERROR_INVALID_ARGUMENT, "floats (f32, f64, f16, bf16), not i32");
    sgd.learning_rate = -1.0f;
    EXPECT_ERROR(tutti_ps_coordinator_create_variable(c, "v", TUTTI_DTYPE_F32, init, 6, 0, &sgd,
                                                      NULL, NULL),
                 TUTTI_ERROR_INVALID_ARGUMENT, "learning rate -1 must be finite and not negative");
    EXPECT_ERROR(tutti_ps_coordinator_fetch(c, read, NULL, NULL, 8, NULL),
                 TUTTI_ERROR_INVALID_ARGUMENT, "output is NULL");

    /* The strategy's scope on the chief: tutti_variable_create makes a variable on the ps
     * task, which a step reads by its index and the chief reads and steps through it. */
    {
        tutti_variable *v = NULL, *plain = NULL;
        float scoped[3] = {1, 2, 3}, got[3], delta[3] = {1, 1, 1};
        const void *one = delta;
        int32_t i32[1] = {1};
        size_t at = 0;
        tutti_ps_remote_value *peek = NULL;
        char why[512];
        tutti_strategy *mirrored = NULL;
        CHECK(tutti_strategy_create(TUTTI_STRATEGY_MIRRORED, 2, TUTTI_CROSS_DEVICE_OPS_RING,
                                    &mirrored));
        CHECK(tutti_ps_coordinator_scope_begin(c));
        CHECK(tutti_ps_coordinator_scope_begin(c)); /* scopes nest */
        CHECK(tutti_ps_coordinator_scope_end(c));
        /* Another strategy's scope inside it: refused, naming both. */
        EXPECT_ERROR(tutti_strategy_scope_begin(mirrored), TUTTI_ERROR_INVALID_ARGUMENT,
                     "inside a ParameterServerStrategy's scope", "MirroredStrategy's cannot");
        tutti_strategy_destroy(mirrored);
        EXPECT_ERROR(tutti_variable_create(TUTTI_DTYPE_I32, 1, i32, TUTTI_AGGREGATION_SUM,
                                           &plain),
                     TUTTI_ERROR_INVALID_ARGUMENT, "floats (f32, f64, f16, bf16), not i32");
        CHECK(tutti_variable_create(TUTTI_DTYPE_F32, 3, scoped, TUTTI_AGGREGATION_SUM, &v));
        CHECK(tutti_ps_coordinator_scope_end(c));
        EXPECT_ERROR(tutti_ps_coordinator_scope_end(c), TUTTI_ERROR_INVALID_ARGUMENT,
                     "is not the one this thread is in");
        CHECK(tutti_variable_ps_index(v, &at));
        EXPECT(at == 2);
        CHECK(tutti_variable_read(v, NULL, TUTTI_DTYPE_F32, 3, got));
        EXPECT(got[0] == 1.0f && got[1] == 2.0f && got[2] == 3.0f);
        CHECK(tutti_variable_update(NULL, v, TUTTI_ASSIGN_ADD, TUTTI_DTYPE_F32, 3, &one));
        CHECK(tutti_variable_read(v, NULL, TUTTI_DTYPE_F32, 3, got));
        EXPECT(got[0] == 2.0f && got[2] == 4.0f);
        EXPECT_ERROR(tutti_variable_update(NULL, v, TUTTI_ASSIGN, TUTTI_DTYPE_F32, 2, &one),
                     TUTTI_ERROR_INVALID_ARGUMENT, "2 elements for variable 2 of 3");
        EXPECT_ERROR(tutti_variable_read(v, NULL, TUTTI_DTYPE_F32, 2, got),
                     TUTTI_ERROR_INVALID_ARGUMENT, "count 2, but the variable holds 3");
        CHECK(tutti_ps_coordinator_schedule(c, "scoped", 6, &peek));
        CHECK(tutti_ps_coordinator_fetch(c, peek, NULL, out, sizeof out, NULL));
        EXPECT(out[1] == 4.0f);
        tutti_ps_remote_value_destroy(peek);
        /* Outside the scope: a plain variable, with no index there. */
        CHECK(tutti_variable_create(TUTTI_DTYPE_F32, 3, scoped, TUTTI_AGGREGATION_SUM, &plain));
        EXPECT_ERROR(tutti_variable_ps_index(plain, &at), TUTTI_ERROR_INVALID_ARGUMENT,
                     "not made in a parameter-server coordinator's scope");
        EXPECT_ERROR(tutti_variable_update(NULL, plain, TUTTI_ASSIGN, TUTTI_DTYPE_F32, 3, &one),
                     TUTTI_ERROR_INVALID_ARGUMENT, "strategy is NULL");
        tutti_variable_destroy(plain);
        /* A scope left open ends with the coordinator; the variable outlives it, and reading
         * it once the job is over is an error, not a hang. */
        CHECK(tutti_ps_coordinator_scope_begin(c));
        for (i = 0; i < 4; i++) {
            tutti_ps_remote_value_destroy(values[i]);
        }
        tutti_ps_remote_value_destroy(raised);
        tutti_ps_remote_value_destroy(read);
        CHECK(tutti_ps_coordinator_shutdown(c));
        EXPECT(tutti_variable_read(v, NULL, TUTTI_DTYPE_F32, 3, got) != TUTTI_SUCCESS);
        last_error(why, sizeof why);
        EXPECT(strstr(why, "ps task 0") != NULL);
        tutti_variable_destroy(v);
        CHECK(tutti_variable_create(TUTTI_DTYPE_F32, 3, scoped, TUTTI_AGGREGATION_SUM, &plain));
        EXPECT_ERROR(tutti_variable_ps_index(plain, &at), TUTTI_ERROR_INVALID_ARGUMENT,
                     "not made in a parameter-server coordinator's scope");
        tutti_variable_destroy(plain);
    }
    tutti_ps_strategy_destroy(s);
    for (i = 0; i < 3; i++) {
        EXPECT(pthread_join(threads[i], NULL) == 0);
        EXPECT(tasks[i].result == TUTTI_SUCCESS && !tasks[i].got_coordinator);
    }
    printf("ps: ok\n");
    return 0;
}
