/* The strategy API from C: replica ids, collectives inside a step, cross-replica reduce, every
 * kind, and the error paths (NULL handles, bad enums, a failing replica, reuse after it). */
#include "check.h"

#include <math.h>

typedef struct shared {
    size_t ids[8];
    float gathered[8];
} shared;

static tutti_result step(const tutti_replica_context *ctx, void *user) {
    shared *s = user;
    size_t id = 0, local = 0;
    float v[3];
    int32_t root_value;
    tutti_result r = tutti_replica_id(ctx, &id, &local);
    if (r != TUTTI_SUCCESS) {
        return r;
    }
    s->ids[local] = id;
    v[0] = (float)id;
    v[1] = 1.0f;
    v[2] = (float)(id * id);
    r = tutti_replica_all_reduce(ctx, 3, TUTTI_DTYPE_F32, TUTTI_OP_SUM, v);
    if (r != TUTTI_SUCCESS) {
        return r;
    }
    s->gathered[local] = v[0] + 10.0f * v[1] + 100.0f * v[2];
    root_value = (int32_t)(id * 7);
    return tutti_replica_broadcast(ctx, 1, TUTTI_DTYPE_I32, 1, &root_value) == TUTTI_SUCCESS &&
                   root_value == 7
               ? TUTTI_SUCCESS
               : TUTTI_ERROR_INTERNAL;
}

static tutti_result failing_step(const tutti_replica_context *ctx, void *user) {
    size_t id = 0;
    float v[2] = {1, 2};
    (void)user;
    tutti_replica_id(ctx, &id, NULL);
    if (id == 2) {
        /* A tutti call with a bad argument: its code and message travel out of run. */
        return tutti_replica_all_reduce(ctx, 2, 99, TUTTI_OP_SUM, v);
    }
    return tutti_replica_all_reduce(ctx, 2, TUTTI_DTYPE_F32, TUTTI_OP_SUM, v);
}

/* The log records the callback received. */
/* Each replica reads its copy of the variable `user` and checks it holds {2.5, 3}. */
static tutti_result read_variable_step(const tutti_replica_context *ctx, void *user) {
    float got[2] = {0, 0};
    tutti_result r = tutti_variable_read((const tutti_variable *)user, ctx, TUTTI_DTYPE_F32, 2, got);
    if (r != TUTTI_SUCCESS) {
        return r;
    }
    return got[0] == 2.5f && got[1] == 3.0f ? TUTTI_SUCCESS : TUTTI_ERROR_INTERNAL;
}

/* Each replica's update {id, 1} to the device variable `user` (host memory on CPU replicas),
 * averaged across the replicas and assigned to every copy. */
static tutti_result device_variable_step(const tutti_replica_context *ctx, void *user) {
    size_t id = 0;
    float x[2];
    tutti_tensor *t = NULL;
    tutti_result r = tutti_replica_id(ctx, &id, NULL);
    if (r != TUTTI_SUCCESS) {
        return r;
    }
    x[0] = (float)id;
    x[1] = 1.0f;
    r = tutti_replica_place(ctx, 2, TUTTI_DTYPE_F32, x, &t);
    if (r == TUTTI_SUCCESS) {
        r = tutti_device_variable_update_in(ctx, user, TUTTI_ASSIGN, TUTTI_AGGREGATION_MEAN, t);
    }
    tutti_tensor_destroy(t);
    return r;
}

/* Momentum SGD on the device variable: each replica's gradient {id, 1}, summed across them. */
typedef struct stepped {
    tutti_optimizer *opt;
    tutti_device_variable *var;
} stepped;

static tutti_result optimizer_step(const tutti_replica_context *ctx, void *user) {
    stepped *st = user;
    size_t id = 0;
    float x[2];
    tutti_tensor *t = NULL;
    tutti_result r = tutti_replica_id(ctx, &id, NULL);
    if (r != TUTTI_SUCCESS) {
        return r;
    }
    x[0] = (float)id;
    x[1] = 1.0f;
    r = tutti_replica_place(ctx, 2, TUTTI_DTYPE_F32, x, &t);
    if (r == TUTTI_SUCCESS) {
        const tutti_device_variable *vars[1] = {st->var};
        r = tutti_optimizer_apply_device_gradients(ctx, st->opt, 1, &t, vars);
    }
    tutti_tensor_destroy(t);
    return r;
}

static int log_records;
static char log_last[512];

static void on_log(tutti_log_level level, const char *message, void *user) {
    (void)level;
    if (user == (void *)&log_records) {
        log_records++;
        snprintf(log_last, sizeof log_last, "%s", message);
    }
}

/* A cross-device op of the trainer's: the element-wise max of float values (whatever op is
 * asked: the test asks for SUM and sees the max), counting its calls; "fail" makes it fail. */
typedef struct max_op {
    int calls;
    int fail;
} max_op;

static tutti_result max_all_reduce(void *user, tutti_op op, tutti_dtype dtype, size_t count,
                                   void *const *values, size_t num_values) {
    max_op *m = user;
    size_t i, j;
    (void)op;
    m->calls++;
    if (m->fail || dtype != TUTTI_DTYPE_F32) {
        return TUTTI_ERROR_INVALID_ARGUMENT;
    }
    for (j = 0; j < count; j++) {
        float best = ((float *)values[0])[j];
        for (i = 1; i < num_values; i++) {
            float x = ((float *)values[i])[j];
            best = x > best ? x : best;
        }
        for (i = 0; i < num_values; i++) {
            ((float *)values[i])[j] = best;
        }
    }
    return TUTTI_SUCCESS;
}

static tutti_result max_step(const tutti_replica_context *ctx, void *user) {
    shared *s = user;
    size_t id = 0, local = 0;
    float v[2];
    tutti_result r = tutti_replica_id(ctx, &id, &local);
    if (r != TUTTI_SUCCESS) {
        return r;
    }
    v[0] = (float)id;
    v[1] = -(float)id;
    r = tutti_replica_all_reduce(ctx, 2, TUTTI_DTYPE_F32, TUTTI_OP_SUM, v);
    s->gathered[local] = v[0] + 10.0f * v[1];
    return r;
}

/* A step that fails on replica 1 with a message of its own. */
static tutti_result nan_step(const tutti_replica_context *ctx, void *user) {
    size_t id = 0;
    (void)user;
    CHECK(tutti_replica_id(ctx, &id, NULL));
    if (id != 1) {
        return TUTTI_SUCCESS;
    }
    CHECK(tutti_replica_set_error(ctx, "the loss is NaN at step 7"));
    return TUTTI_ERROR_SYSTEM;
}

/* tutti_strategy_create_mirrored: the trainer's op, hierarchical copy's settings,
 * reduce_to_device, and their errors. */
static void cross_device_ops_settings(void) {
    tutti_cross_device_ops_config c = TUTTI_CROSS_DEVICE_OPS_CONFIG_INIT;
    tutti_strategy *s = NULL;
    max_op m = {0, 0};
    shared sh;
    size_t i;

    c.kind = TUTTI_CROSS_DEVICE_OPS_CUSTOM;
    c.name = "max";
    c.all_reduce = max_all_reduce;
    c.user_data = &m;
    CHECK(tutti_strategy_create_mirrored(3, &c, &s));
    memset(&sh, 0, sizeof sh);
    CHECK(tutti_strategy_run(s, max_step, &sh));
    for (i = 0; i < 3; i++) {
        EXPECT(sh.gathered[i] == 2.0f + 10.0f * 0.0f); /* max(0,1,2), max(0,-1,-2) */
    }
    EXPECT(m.calls == 1);
    m.fail = 1;
    EXPECT_ERROR(tutti_strategy_run(s, max_step, &sh), TUTTI_ERROR_SYSTEM, "cross-device op max");
    tutti_strategy_destroy(s);

    c = (tutti_cross_device_ops_config)TUTTI_CROSS_DEVICE_OPS_CONFIG_INIT;
    c.kind = TUTTI_CROSS_DEVICE_OPS_HIERARCHICAL_COPY;
    c.group_size = 3;
    c.num_packs = 2;
    CHECK(tutti_strategy_create_mirrored(4, &c, &s));
    memset(&sh, 0, sizeof sh);
    CHECK(tutti_strategy_run(s, step, &sh));
    EXPECT(sh.gathered[3] == 6.0f + 40.0f + 1400.0f);
    tutti_strategy_destroy(s);

    c.kind = TUTTI_CROSS_DEVICE_OPS_REDUCTION_TO_ONE_DEVICE;
    c.reduce_to_device = 1;
    CHECK(tutti_strategy_create_mirrored(2, &c, &s));
    memset(&sh, 0, sizeof sh);
    CHECK(tutti_strategy_run(s, step, &sh));
    EXPECT(sh.gathered[0] == 1.0f + 20.0f + 100.0f);
    tutti_strategy_destroy(s);
    c.reduce_to_device = 2;
    EXPECT_ERROR(tutti_strategy_create_mirrored(2, &c, &s), TUTTI_ERROR_INVALID_ARGUMENT,
                 "reduce_to_device 2");

    c.kind = TUTTI_CROSS_DEVICE_OPS_CUSTOM;
    c.all_reduce = NULL;
    EXPECT_ERROR(tutti_strategy_create_mirrored(2, &c, &s), TUTTI_ERROR_INVALID_ARGUMENT,
                 "all_reduce is NULL");
    c.struct_size = 8;
    EXPECT_ERROR(tutti_strategy_create_mirrored(2, &c, &s), TUTTI_ERROR_INVALID_ARGUMENT,
                 "struct_size is 8");
    EXPECT_ERROR(tutti_strategy_create(TUTTI_STRATEGY_MIRRORED, 2, TUTTI_CROSS_DEVICE_OPS_CUSTOM, &s),
                 TUTTI_ERROR_INVALID_ARGUMENT, "tutti_strategy_create_mirrored");
    /* NULL: TensorFlow's choice. */
    CHECK(tutti_strategy_create_mirrored(2, NULL, &s));
    tutti_strategy_destroy(s);
}

/* tutti_strategy_create_on_devices: replicas on the devices named (TensorFlow's names too),
 * and errors that name what was wrong. */
static void strategies_on_named_devices(void) {
    const char *three[] = {"/job:localhost/replica:0/task:0/device:CPU:0", "cpu:1", "CPU:2"};
    const char *twice[] = {"cpu:0", "/device:CPU:0"};
    const char *gpu[] = {"/gpu:0"};
    const char *bogus[] = {"npu:0"};
    tutti_cross_device_ops_config c = TUTTI_CROSS_DEVICE_OPS_CONFIG_INIT;
    tutti_strategy *s = NULL;
    shared sh;
    size_t total = 0, local = 0;
    tutti_result r;
    char m[2048];

    c.kind = TUTTI_CROSS_DEVICE_OPS_REDUCTION_TO_ONE_DEVICE;
    c.reduce_to_device = 2;
    CHECK(tutti_strategy_create_on_devices(TUTTI_STRATEGY_MIRRORED, three, 3, &c, &s));
    memset(&sh, 0, sizeof sh);
    CHECK(tutti_strategy_run(s, step, &sh));
    EXPECT(sh.gathered[2] == 3.0f + 30.0f + 500.0f);
    tutti_strategy_destroy(s);
    CHECK(tutti_strategy_create_on_devices(TUTTI_STRATEGY_CENTRAL_STORAGE, three, 2, NULL, &s));
    CHECK(tutti_strategy_num_replicas(s, &total, &local));
    EXPECT(total == 2 && local == 2);
    tutti_strategy_destroy(s);
    CHECK(tutti_strategy_create_on_devices(TUTTI_STRATEGY_ONE_DEVICE, three + 1, 1, NULL, &s));
    CHECK(tutti_strategy_num_replicas(s, &total, &local));
    EXPECT(total == 1 && local == 1);
    tutti_strategy_destroy(s);

    EXPECT_ERROR(tutti_strategy_create_on_devices(TUTTI_STRATEGY_ONE_DEVICE, three, 2, NULL, &s),
                 TUTTI_ERROR_INVALID_ARGUMENT, "ONE_DEVICE takes one device, not 2");
    EXPECT_ERROR(tutti_strategy_create_on_devices(TUTTI_STRATEGY_MIRRORED, twice, 2, NULL, &s),
                 TUTTI_ERROR_INVALID_ARGUMENT, "devices[0] and devices[1] both name cpu:0");
    EXPECT_ERROR(tutti_strategy_create_on_devices(TUTTI_STRATEGY_MIRRORED, bogus, 1, NULL, &s),
                 TUTTI_ERROR_INVALID_ARGUMENT, "npu:0");
    EXPECT_ERROR(tutti_strategy_create_on_devices(TUTTI_STRATEGY_CENTRAL_STORAGE, three, 3, &c, &s),
                 TUTTI_ERROR_INVALID_ARGUMENT, "ops is for a MIRRORED strategy");
    EXPECT_ERROR(tutti_strategy_create_on_devices(TUTTI_STRATEGY_TPU, three, 3, NULL, &s),
                 TUTTI_ERROR_INVALID_ARGUMENT, "tutti_strategy_create");
    EXPECT_ERROR(tutti_strategy_create_on_devices(TUTTI_STRATEGY_MIRRORED, NULL, 0, NULL, &s),
                 TUTTI_ERROR_INVALID_ARGUMENT, "devices is NULL");
    EXPECT_ERROR(tutti_strategy_create_on_devices(TUTTI_STRATEGY_MIRRORED, three, (size_t)1 << 40,
                                                  NULL, &s),
                 TUTTI_ERROR_INVALID_ARGUMENT, "at most 1024 local replicas");
    c.reduce_to_device = 3;
    EXPECT_ERROR(tutti_strategy_create_on_devices(TUTTI_STRATEGY_MIRRORED, three, 3, &c, &s),
                 TUTTI_ERROR_INVALID_ARGUMENT, "reduce_to_device 3");
    /* MultiWorkerMirroredStrategy on named devices with TensorFlow's CommunicationOptions:
     * no cluster here, so one worker of two replicas, as TensorFlow runs it. */
    CHECK(tutti_strategy_create_multi_worker_on_devices(NULL, TUTTI_COMMUNICATION_RING, 1 << 20,
                                                        20000, three, 2, &s));
    CHECK(tutti_strategy_num_replicas(s, &total, &local));
    EXPECT(total == 2 && local == 2);
    memset(&sh, 0, sizeof sh);
    CHECK(tutti_strategy_run(s, step, &sh));
    tutti_strategy_destroy(s);
    EXPECT_ERROR(tutti_strategy_create_multi_worker_on_devices(NULL, 7, 0, 0, three, 2, &s),
                 TUTTI_ERROR_INVALID_ARGUMENT, "communication 7 is not a tutti_communication");
    EXPECT_ERROR(tutti_strategy_create_multi_worker_on_devices(NULL, TUTTI_COMMUNICATION_AUTO, 0,
                                                               0, twice, 2, &s),
                 TUTTI_ERROR_INVALID_ARGUMENT, "devices[0] and devices[1] both name cpu:0");
    EXPECT_ERROR(tutti_strategy_create_multi_worker_on_devices("{not json", 0, 0, 0, three, 2, &s),
                 TUTTI_ERROR_INVALID_ARGUMENT, "TF_CONFIG");
    EXPECT_ERROR(tutti_strategy_create_multi_worker_on_devices(NULL, 0, 0, 0, NULL, 0, &s),
                 TUTTI_ERROR_INVALID_ARGUMENT, "devices is NULL");
    /* A GPU that is not there (or a library without CUDA): UNAVAILABLE, naming it. */
    r = tutti_strategy_create_on_devices(TUTTI_STRATEGY_MIRRORED, gpu, 1, NULL, &s);
    if (r == TUTTI_SUCCESS) {
        tutti_strategy_destroy(s);
    } else {
        last_error(m, sizeof m);
        EXPECT(r == TUTTI_ERROR_UNAVAILABLE && strstr(m, "/gpu:0") != NULL);
    }
}

int main(void) {
    tutti_strategy *s = NULL;
    shared sh;
    size_t n = 0, local = 0, i;
    float parts[4][2], *ptrs[4], out[2];
    unsigned kind;

    CHECK(tutti_strategy_create(TUTTI_STRATEGY_MIRRORED, 4, TUTTI_CROSS_DEVICE_OPS_RING, &s));
    CHECK(tutti_strategy_num_replicas(s, &n, &local));
    EXPECT(n == 4 && local == 4);
    {
        /* Placed on a replica's device from outside run: host memory on CPU replicas. */
        tutti_tensor *t = NULL;
        int32_t x[2] = {7, 9}, back[2] = {0, 0};
        CHECK(tutti_strategy_place(s, 3, 2, TUTTI_DTYPE_I32, x, &t));
        CHECK(tutti_tensor_read(t, 2, TUTTI_DTYPE_I32, back));
        EXPECT(back[0] == 7 && back[1] == 9);
        tutti_tensor_destroy(t);
        EXPECT_ERROR(tutti_strategy_place(NULL, 0, 2, TUTTI_DTYPE_I32, x, &t),
                     TUTTI_ERROR_INVALID_ARGUMENT, "strategy is NULL");
    }
    memset(&sh, 0, sizeof sh);
    CHECK(tutti_strategy_run(s, step, &sh));
    for (i = 0; i < 4; i++) {
        EXPECT(sh.ids[i] == i);
        /* sum of ids 6, four ones, sum of squares 14 */
        EXPECT(sh.gathered[i] == 6.0f + 40.0f + 1400.0f);
    }
    for (i = 0; i < 4; i++) {
        parts[i][0] = (float)i;
        parts[i][1] = 2.0f;
        ptrs[i] = parts[i];
    }
    CHECK(tutti_strategy_reduce(s, 2, TUTTI_DTYPE_F32, TUTTI_OP_MEAN, (const void *const *)ptrs, out));
    EXPECT(out[0] == 1.5f && out[1] == 2.0f);

    /* Gather: the replicas' rows (0, 1, 2 and 3 rows of two elements) in replica order. */
    {
        float rows_of[4][6], g[12];
        const void *gp[4];
        size_t rows[4] = {0, 1, 2, 3}, total = 0, j;
        for (i = 0; i < 4; i++) {
            for (j = 0; j < 6; j++) {
                rows_of[i][j] = (float)(10 * i + j);
            }
            gp[i] = rows_of[i];
        }
        CHECK(tutti_strategy_gather(s, TUTTI_DTYPE_F32, 2, gp, rows, g, 6, &total));
        EXPECT(total == 6 && g[0] == 10.0f && g[1] == 11.0f && g[2] == 20.0f && g[5] == 23.0f &&
               g[6] == 30.0f && g[11] == 35.0f);
        total = 0;
        EXPECT_ERROR(tutti_strategy_gather(s, TUTTI_DTYPE_F32, 2, gp, rows, g, 5, &total),
                     TUTTI_ERROR_INVALID_ARGUMENT, "output holds 5 rows", "gathered 6");
        EXPECT(total == 6);
        EXPECT_ERROR(tutti_strategy_gather(s, TUTTI_DTYPE_F32, 0, gp, rows, g, 6, NULL),
                     TUTTI_ERROR_INVALID_ARGUMENT, "row_len is 0");
        EXPECT_ERROR(tutti_strategy_gather(s, TUTTI_DTYPE_F32, 2, gp, NULL, g, 6, NULL),
                     TUTTI_ERROR_INVALID_ARGUMENT, "rows is NULL");
        EXPECT_ERROR(tutti_strategy_gather(s, TUTTI_DTYPE_F32, 2, gp, rows, NULL, 6, NULL),
                     TUTTI_ERROR_INVALID_ARGUMENT, "output is NULL");
    }

    /* A scope and its variables: made inside, the strategy's kind (a copy per replica). */
    {
        tutti_variable *v = NULL, *plain = NULL;
        tutti_strategy *other = NULL;
        float init[2] = {1, 2}, got[2], upd[4][2];
        double got64[2];
        const void *up[4];
        CHECK(tutti_variable_create(TUTTI_DTYPE_F32, 2, init, TUTTI_AGGREGATION_MEAN, &plain));
        CHECK(tutti_strategy_scope_begin(s));
        CHECK(tutti_variable_create(TUTTI_DTYPE_F32, 2, init, TUTTI_AGGREGATION_MEAN, &v));
        CHECK(tutti_strategy_create(TUTTI_STRATEGY_CENTRAL_STORAGE, 2,
                                    TUTTI_CROSS_DEVICE_OPS_DEFAULT, &other));
        EXPECT_ERROR(tutti_strategy_scope_begin(other), TUTTI_ERROR_INVALID_ARGUMENT,
                     "inside a MirroredStrategy's scope", "CentralStorageStrategy's cannot");
        CHECK(tutti_strategy_scope_end(s));
        EXPECT_ERROR(tutti_strategy_scope_end(s), TUTTI_ERROR_INVALID_ARGUMENT,
                     "not the one this thread is in");
        for (i = 0; i < 4; i++) {
            upd[i][0] = (float)i;
            upd[i][1] = 1.0f;
            up[i] = upd[i];
        }
        /* 1 + mean(0, 1, 2, 3), 2 + 1, on every copy. */
        CHECK(tutti_variable_update(s, v, TUTTI_ASSIGN_ADD, TUTTI_DTYPE_F32, 2, up));
        CHECK(tutti_variable_read(v, NULL, TUTTI_DTYPE_F32, 2, got));
        EXPECT(got[0] == 2.5f && got[1] == 3.0f);
        CHECK(tutti_strategy_run(s, read_variable_step, v));
        /* The plain variable has one copy: not this strategy's four. */
        EXPECT_ERROR(tutti_variable_update(s, plain, TUTTI_ASSIGN, TUTTI_DTYPE_F32, 2, up),
                     TUTTI_ERROR_INVALID_ARGUMENT, "4 updates for 1 replicas");
        EXPECT_ERROR(tutti_variable_read(v, NULL, TUTTI_DTYPE_F64, 2, got64),
                     TUTTI_ERROR_INVALID_ARGUMENT, "the variable is f32, not f64");
        EXPECT_ERROR(tutti_variable_read(v, NULL, TUTTI_DTYPE_F32, 3, got),
                     TUTTI_ERROR_INVALID_ARGUMENT, "count 3", "holds 2");
        EXPECT_ERROR(tutti_variable_create(TUTTI_DTYPE_F32, 2, init, 7, &plain),
                     TUTTI_ERROR_INVALID_ARGUMENT, "aggregation 7");
        tutti_variable_destroy(v);
        tutti_variable_destroy(plain);
        tutti_variable_destroy(NULL);
        /* Destroying a strategy ends its scopes on this thread: ending one after is an error,
         * not a read of the freed handle, and another strategy's scope may begin. */
        CHECK(tutti_strategy_scope_begin(other));
        tutti_strategy_destroy(other);
        EXPECT_ERROR(tutti_strategy_scope_end(other), TUTTI_ERROR_INVALID_ARGUMENT,
                     "not the one this thread is in");
        CHECK(tutti_strategy_scope_begin(s));
        CHECK(tutti_strategy_scope_end(s));
    }

    /* A device variable on CPU replicas: its copies in host memory, updated alike. */
    {
        tutti_device_variable *dv = NULL;
        float init[2] = {5.0f, 5.0f}, got[2];
        CHECK(tutti_strategy_device_variable(s, 2, TUTTI_DTYPE_F32, init, &dv));
        CHECK(tutti_strategy_run(s, device_variable_step, dv));
        for (i = 0; i < 4; i++) {
            CHECK(tutti_device_variable_read(dv, i, 2, TUTTI_DTYPE_F32, got));
            EXPECT(got[0] == 1.5f && got[1] == 1.0f);
        }
        EXPECT_ERROR(tutti_device_variable_update_in(NULL, dv, TUTTI_ASSIGN,
                                                     TUTTI_AGGREGATION_SUM, NULL),
                     TUTTI_ERROR_INVALID_ARGUMENT, "NULL");
        EXPECT_ERROR(tutti_strategy_device_variable(s, 2, TUTTI_DTYPE_F32, NULL, &dv),
                     TUTTI_ERROR_INVALID_ARGUMENT, "initial is NULL");
        tutti_device_variable_destroy(dv);
    }

    /* An optimizer stepping a device variable, its state saved and restored. */
    {
        tutti_ps_update rule = TUTTI_PS_UPDATE_INIT;
        stepped st = {NULL, NULL};
        tutti_optimizer *again = NULL;
        tutti_checkpoint *ck = NULL;
        const char *names[1] = {"w"};
        const tutti_device_variable *vars[1];
        float init[2] = {1.0f, 2.0f}, got[2], momentum[2];
        uint64_t it = 0;
        int32_t ints[2] = {0, 0};
        tutti_device_variable *iv = NULL;
        rule.learning_rate = 0.1f;
        rule.momentum = 0.9f;
        CHECK(tutti_optimizer_create(&rule, &st.opt));
        CHECK(tutti_strategy_device_variable(s, 2, TUTTI_DTYPE_F32, init, &st.var));
        vars[0] = st.var;
        CHECK(tutti_strategy_run(s, optimizer_step, &st));
        CHECK(tutti_strategy_run(s, optimizer_step, &st));
        /* Sums {6, 4}: v = -0.6, then 0.9 v - 0.6 = -1.14 (and -0.4, -0.76). */
        CHECK(tutti_device_variable_read(st.var, 3, 2, TUTTI_DTYPE_F32, got));
        EXPECT(fabsf(got[0] - (1.0f - 1.74f)) < 1e-5f && fabsf(got[1] - (2.0f - 1.16f)) < 1e-5f);
        CHECK(tutti_optimizer_iterations(st.opt, &it));
        EXPECT(it == 2);
        CHECK(tutti_checkpoint_create(2, &ck));
        CHECK(tutti_optimizer_save(st.opt, ck, "opt", 1, names, vars));
        CHECK(tutti_checkpoint_read(ck, "opt/w/momentum", TUTTI_DTYPE_F32, 2, momentum));
        EXPECT(fabsf(momentum[0] + 1.14f) < 1e-5f && fabsf(momentum[1] + 0.76f) < 1e-5f);
        /* Restored into another optimizer, it steps on as the first does. */
        CHECK(tutti_optimizer_create(&rule, &again));
        CHECK(tutti_optimizer_restore(again, ck, "opt", 1, names, vars));
        CHECK(tutti_optimizer_iterations(again, &it));
        EXPECT(it == 2);
        tutti_optimizer_destroy(st.opt);
        st.opt = again;
        CHECK(tutti_strategy_run(s, optimizer_step, &st));
        /* v = 0.9 * -1.14 - 0.6 = -1.626. */
        CHECK(tutti_device_variable_read(st.var, 0, 2, TUTTI_DTYPE_F32, got));
        EXPECT(fabsf(got[0] - (1.0f - 1.74f - 1.626f)) < 1e-5f);
        /* A learning rate set between steps takes the next: v = 0.9 * -1.626 - 0.2 * 6. */
        {
            float lr = 0.0f;
            CHECK(tutti_optimizer_set_learning_rate(again, 0.2f));
            CHECK(tutti_optimizer_learning_rate(again, &lr));
            EXPECT(lr == 0.2f);
            CHECK(tutti_strategy_run(s, optimizer_step, &st));
            CHECK(tutti_device_variable_read(st.var, 0, 2, TUTTI_DTYPE_F32, got));
            EXPECT(fabsf(got[0] - (1.0f - 1.74f - 1.626f - 2.6634f)) < 1e-4f);
            EXPECT_ERROR(tutti_optimizer_set_learning_rate(again, -1.0f),
                         TUTTI_ERROR_INVALID_ARGUMENT, "learning rate -1 must be finite and not negative");
            CHECK(tutti_optimizer_learning_rate(again, &lr));
            EXPECT(lr == 0.2f);
        }
        /* The errors name what was wrong. */
        EXPECT_ERROR(tutti_optimizer_restore(again, ck, "opt", 1, names, NULL),
                     TUTTI_ERROR_INVALID_ARGUMENT, "variables is NULL");
        CHECK(tutti_strategy_device_variable(s, 2, TUTTI_DTYPE_I32, ints, &iv));
        vars[0] = iv;
        EXPECT_ERROR(tutti_optimizer_save(again, ck, "opt2", 1, names, vars),
                     TUTTI_ERROR_INVALID_ARGUMENT, "optimizers step float variables");
        rule.learning_rate = -1.0f;
        EXPECT_ERROR(tutti_optimizer_create(&rule, &again), TUTTI_ERROR_INVALID_ARGUMENT,
                     "learning rate -1");
        EXPECT_ERROR(tutti_optimizer_create(NULL, &again), TUTTI_ERROR_INVALID_ARGUMENT,
                     "rule is NULL");
        tutti_device_variable_destroy(iv);
        tutti_checkpoint_destroy(ck);
        tutti_optimizer_destroy(st.opt);
        tutti_optimizer_destroy(NULL);
        tutti_device_variable_destroy(st.var);
    }

    /* A failing replica: run fails with its code and says which replica and why. */
    EXPECT_ERROR(tutti_strategy_run(s, failing_step, NULL), TUTTI_ERROR_SYSTEM, "replica 2",
                 "returned 1", "dtype 99 is not a tutti_dtype");
    /* ... and the strategy still works. */
    memset(&sh, 0, sizeof sh);
    CHECK(tutti_strategy_run(s, step, &sh));
    EXPECT(sh.gathered[3] == 1446.0f);

    EXPECT_ERROR(tutti_strategy_run(s, NULL, NULL), TUTTI_ERROR_INVALID_ARGUMENT, "step is NULL");
    EXPECT_ERROR(tutti_strategy_run(NULL, step, &sh), TUTTI_ERROR_INVALID_ARGUMENT, "strategy is NULL");
    EXPECT_ERROR(tutti_strategy_reduce(s, 2, TUTTI_DTYPE_F32, TUTTI_OP_MEAN, NULL, out),
                 TUTTI_ERROR_INVALID_ARGUMENT, "per_replica is NULL");
    EXPECT_ERROR(tutti_strategy_reduce(s, 2, TUTTI_DTYPE_F32, TUTTI_OP_MAX, (const void *const *)ptrs, out),
                 TUTTI_ERROR_INVALID_ARGUMENT, "SUM or MEAN");
    EXPECT_ERROR(tutti_replica_id(NULL, &n, NULL), TUTTI_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    /* Which rows of a global batch each replica takes, and where this process stands. */
    {
        size_t starts[5] = {0}, task_id = 9, workers = 0;
        bool chief = false;
        char type[16];
        CHECK(tutti_strategy_batch_rows(s, 10, starts, 5));
        EXPECT(starts[0] == 0 && starts[1] == 3 && starts[2] == 6 && starts[3] == 8 && starts[4] == 10);
        EXPECT_ERROR(tutti_strategy_batch_rows(s, 10, starts, 4), TUTTI_ERROR_INVALID_ARGUMENT,
                     "num_starts is 4", "so 5 starts");
        CHECK(tutti_strategy_cluster(s, type, sizeof type, &task_id, &workers, &chief));
        EXPECT(strcmp(type, "worker") == 0 && task_id == 0 && workers == 1 && chief);
        CHECK(tutti_strategy_cluster(s, type, 3, NULL, NULL, NULL));
        EXPECT(strcmp(type, "wo") == 0);
        EXPECT_ERROR(tutti_strategy_cluster(s, NULL, 4, NULL, NULL, NULL),
                     TUTTI_ERROR_INVALID_ARGUMENT, "task_type is NULL");
    }
    tutti_strategy_destroy(s);
    tutti_strategy_destroy(NULL);

    s = NULL;
    /* MultiWorkerMirroredStrategy with communication options: no cluster here, so one worker;
     * NCCL on CPUs runs the ring (and says so in the log). */
    {
        size_t total = 0, local = 0;
        CHECK(tutti_strategy_create_multi_worker(NULL, TUTTI_COMMUNICATION_NCCL, 2, &s));
        CHECK(tutti_strategy_num_replicas(s, &total, &local));
        EXPECT(total == 2 && local == 2);
        tutti_strategy_destroy(s);
        s = NULL;
        EXPECT_ERROR(tutti_strategy_create_multi_worker(NULL, 9, 2, &s),
                     TUTTI_ERROR_INVALID_ARGUMENT, "communication 9");
        EXPECT_ERROR(tutti_strategy_create_multi_worker("{not json", TUTTI_COMMUNICATION_RING, 2, &s),
                     TUTTI_ERROR_INVALID_ARGUMENT, "TF_CONFIG");
    }
    /* The library prints nothing on its own: its records reach the caller's callback, at the
     * level asked for. MirroredStrategy on CPUs says at info level why it does not use NCCL. */
    CHECK(tutti_set_log_callback(on_log, &log_records));
    CHECK(tutti_set_log_level(TUTTI_LOG_INFO));
    CHECK(tutti_strategy_create(TUTTI_STRATEGY_MIRRORED, 2, TUTTI_CROSS_DEVICE_OPS_DEFAULT, &s));
    tutti_strategy_destroy(s);
    s = NULL;
    EXPECT(log_records >= 1 && strstr(log_last, "ReductionToOneDevice") != NULL);
    CHECK(tutti_set_log_level(TUTTI_LOG_WARN));
    CHECK(tutti_set_log_callback(NULL, NULL));
    EXPECT_ERROR(tutti_set_log_level(9), TUTTI_ERROR_INVALID_ARGUMENT, "level 9");

    EXPECT_ERROR(tutti_strategy_create(17, 2, TUTTI_CROSS_DEVICE_OPS_DEFAULT, &s),
                 TUTTI_ERROR_INVALID_ARGUMENT, "kind 17 is not a tutti_strategy_kind");
    EXPECT(s == NULL);
    EXPECT_ERROR(tutti_strategy_create(TUTTI_STRATEGY_MIRRORED, 2, 9, &s),
                 TUTTI_ERROR_INVALID_ARGUMENT, "cross_device_ops 9");
    EXPECT_ERROR(tutti_strategy_create(TUTTI_STRATEGY_MIRRORED, 2, TUTTI_CROSS_DEVICE_OPS_DEFAULT, NULL),
                 TUTTI_ERROR_INVALID_ARGUMENT, "strategy is NULL");

    /* Every local kind runs the step. */
    for (kind = TUTTI_STRATEGY_DEFAULT; kind <= TUTTI_STRATEGY_CENTRAL_STORAGE; kind++) {
        CHECK(tutti_strategy_create(kind, 2, TUTTI_CROSS_DEVICE_OPS_DEFAULT, &s));
        CHECK(tutti_strategy_num_replicas(s, &n, NULL));
        memset(&sh, 0, sizeof sh);
        if (n > 1) {
            CHECK(tutti_strategy_run(s, step, &sh));
        }
        tutti_strategy_destroy(s);
    }
    cross_device_ops_settings();
    strategies_on_named_devices();

    /* A replica function's own message goes with its failure; a strategy of one worker's
     * replicas has no workers to shrink. */
    CHECK(tutti_strategy_create(TUTTI_STRATEGY_MIRRORED, 2, TUTTI_CROSS_DEVICE_OPS_DEFAULT, &s));
    EXPECT_ERROR(tutti_strategy_run(s, nan_step, NULL), TUTTI_ERROR_SYSTEM, "the loss is NaN at step 7");
    EXPECT_ERROR(tutti_strategy_shrink(s), TUTTI_ERROR_UNAVAILABLE, "only MultiWorkerMirroredStrategy");
    EXPECT_ERROR(tutti_strategy_shrink(NULL), TUTTI_ERROR_INVALID_ARGUMENT, "strategy is NULL");
    EXPECT_ERROR(tutti_replica_set_error(NULL, "x"), TUTTI_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    CHECK(tutti_strategy_scope_begin(s));
    EXPECT_ERROR(tutti_strategy_shrink(s), TUTTI_ERROR_INVALID_ARGUMENT, "a scope is open");
    CHECK(tutti_strategy_scope_end(s));
    tutti_strategy_destroy(s);
    printf("strategy: ok\n");
    return 0;
}
