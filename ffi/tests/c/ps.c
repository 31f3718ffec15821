/* Parameter servers from C: a ps task, two workers and the chief on threads of one process.
 * The chief creates a sharded variable, schedules steps carrying payloads and fetches what they
 * sent back, runs steps, reads the variable; a step function that fails is the step's error
 * (TUTTI_ERROR_STEP_FAILED, the workers stay); and the argument errors. */
#include "check.h"

static char cluster[512];

/* The TF_CONFIG text of task `type`:`index`. */
static void tf_config(char *buf, size_t len, const char *type, int index) {
    snprintf(buf, len, "{\"cluster\": %s, \"task\": {\"type\": \"%s\", \"index\": %d}}", cluster,
             type, index);
}

/* A wrong gradient length was refused inside a step, as it should be. */
static int refused_gradient = 0;

/* The payload is a command. The output: this worker's index, then the variable's first element
 * as pulled. */
static tutti_result step_fn(tutti_ps_step *step, void *user_data) {
    const void *payload = NULL;
    const float *w = NULL;
    size_t len = 0, n = 0, worker = 0, workers = 0, vars = 0;
    uint64_t number = 0;
    float ones[6] = {1, 1, 1, 1, 1, 1}, out[2];
    (void)user_data;
    CHECK(tutti_ps_step_info(step, &number, &worker, &workers, &vars));
    EXPECT(workers == 2 && vars == 1);
    CHECK(tutti_ps_step_payload(step, &payload, &len));
    CHECK(tutti_ps_step_variable(step, 0, &w, &n));
    EXPECT(n == 6);
    if (len == 5 && memcmp(payload, "raise", 5) == 0) {
        CHECK(tutti_ps_step_set_error(step, "raised by the C step"));
        return TUTTI_ERROR_INVALID_ARGUMENT;
    }
    if (tutti_ps_step_set_gradient(step, 0, ones, 5) == TUTTI_ERROR_INVALID_ARGUMENT) {
        refused_gradient = 1;
    }
    if (!(len == 4 && memcmp(payload, "read", 4) == 0)) {
        CHECK(tutti_ps_step_set_gradient(step, 0, ones, 6));
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
    size_t index = 9, shards = 0, workers = 0, out_len = 0, i;
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
    CHECK(tutti_ps_coordinator_create_variable(c, "w", init, 6, 0, 0.5f, &index, &shards));
    EXPECT(index == 0 && shards == 3);

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
    CHECK(tutti_ps_coordinator_read_variable(c, 0, w, 6));
    for (i = 0; i < 6; i++) {
        EXPECT(w[i] == 98.0f); /* 100 - 4 steps x 0.5 x 1 */
    }
    EXPECT(refused_gradient);

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
    EXPECT_ERROR(tutti_ps_coordinator_read_variable(c, 0, w, 5), TUTTI_ERROR_INVALID_ARGUMENT,
                 "len 5", "6 elements");
    /* Set from the coordinator (a restored checkpoint), across the three shards. */
    CHECK(tutti_ps_coordinator_assign_variable(c, 0, init, 6));
    CHECK(tutti_ps_coordinator_read_variable(c, 0, w, 6));
    EXPECT(memcmp(w, init, sizeof w) == 0);
    EXPECT_ERROR(tutti_ps_coordinator_assign_variable(c, 0, init, 4),
                 TUTTI_ERROR_INVALID_ARGUMENT, "4 values", "6 elements");
    EXPECT_ERROR(tutti_ps_coordinator_read_variable(c, 1, w, 6), TUTTI_ERROR_INVALID_ARGUMENT,
                 "variable 1");
    EXPECT_ERROR(tutti_ps_coordinator_create_variable(c, "v", init, 6, 7, 0.5f, NULL, NULL),
                 TUTTI_ERROR_INVALID_ARGUMENT, "7 shards for 6 elements");
    EXPECT_ERROR(tutti_ps_coordinator_fetch(c, read, NULL, NULL, 8, NULL),
                 TUTTI_ERROR_INVALID_ARGUMENT, "output is NULL");

    for (i = 0; i < 4; i++) {
        tutti_ps_remote_value_destroy(values[i]);
    }
    tutti_ps_remote_value_destroy(raised);
    tutti_ps_remote_value_destroy(read);
    CHECK(tutti_ps_coordinator_shutdown(c));
    tutti_ps_strategy_destroy(s);
    for (i = 0; i < 3; i++) {
        EXPECT(pthread_join(threads[i], NULL) == 0);
        EXPECT(tasks[i].result == TUTTI_SUCCESS && !tasks[i].got_coordinator);
    }
    printf("ps: ok\n");
    return 0;
}
