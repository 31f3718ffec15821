/* XLA devices from C: a client on the CPU PJRT plugin with 4 devices (TUTTI_PJRT_PLUGIN), its
 * collectives on per-device host buffers, and the error paths. Without a plugin, or in a build
 * without the xla feature, the client must fail cleanly with TUTTI_ERROR_UNAVAILABLE (and this
 * program then says so, or fails when TUTTI_REQUIRE_XLA=1). */
#include "check.h"

/* Each replica of TPUStrategy places a value on its device, all-reduces and gathers it there,
 * and reads it back; replica 1 then passes a host tensor, which every replica refuses. */
static tutti_result tensor_step(const tutti_replica_context *ctx, void *user) {
    float x[2], sum[2], all[8];
    size_t id = 0, count = 0, k;
    tutti_dtype dtype = 0;
    tutti_device_kind kind = 0;
    tutti_tensor *t = NULL, *g = NULL;
    tutti_result r;
    int *bad = user;
    CHECK(tutti_replica_id(ctx, &id, NULL));
    x[0] = (float)id;
    x[1] = 1.0f;
    if (*bad && id == 1) {
        CHECK(tutti_tensor_from_host(2, TUTTI_DTYPE_F32, x, &t));
    } else {
        CHECK(tutti_replica_place(ctx, 2, TUTTI_DTYPE_F32, x, &t));
        CHECK(tutti_tensor_info(t, &dtype, &count, &kind));
        EXPECT(dtype == TUTTI_DTYPE_F32 && count == 2 && kind == TUTTI_DEVICE_XLA);
    }
    r = tutti_replica_all_reduce_tensor(ctx, TUTTI_OP_SUM, t);
    if (r != TUTTI_SUCCESS) {
        tutti_tensor_destroy(t);
        return r;
    }
    CHECK(tutti_tensor_read(t, 2, TUTTI_DTYPE_F32, sum));
    EXPECT(sum[0] == 6.0f && sum[1] == 4.0f);
    EXPECT_ERROR(tutti_tensor_read(t, 3, TUTTI_DTYPE_F32, sum), TUTTI_ERROR_INVALID_ARGUMENT,
                 "its dtype and length");
    CHECK(tutti_replica_place(ctx, 2, TUTTI_DTYPE_F32, x, &g));
    CHECK(tutti_replica_all_gather_tensor(ctx, g));
    CHECK(tutti_tensor_read(g, 8, TUTTI_DTYPE_F32, all));
    for (k = 0; k < 4; k++) {
        EXPECT(all[2 * k] == (float)k && all[2 * k + 1] == 1.0f);
    }
    CHECK(tutti_replica_broadcast_tensor(ctx, 3, t));
    tutti_tensor_destroy(g);
    tutti_tensor_destroy(t);
    return TUTTI_SUCCESS;
}

/* Each replica adds its update {id, 1} to a device variable, summed across the replicas, where
 * the copies lie; then reads its own copy back. */
static tutti_result variable_step(const tutti_replica_context *ctx, void *user) {
    tutti_device_variable *v = user;
    size_t id = 0, local = 0;
    float x[2], got[2];
    tutti_tensor *t = NULL;
    tutti_result r;
    CHECK(tutti_replica_id(ctx, &id, &local));
    x[0] = (float)id;
    x[1] = 1.0f;
    CHECK(tutti_replica_place(ctx, 2, TUTTI_DTYPE_F32, x, &t));
    r = tutti_device_variable_update_in(ctx, v, TUTTI_ASSIGN_ADD, TUTTI_AGGREGATION_SUM, t);
    tutti_tensor_destroy(t);
    if (r != TUTTI_SUCCESS) {
        return r;
    }
    CHECK(tutti_device_variable_read(v, local, 2, TUTTI_DTYPE_F32, got));
    EXPECT(got[0] == 16.0f && got[1] == 24.0f);
    return TUTTI_SUCCESS;
}

int main(void) {
    tutti_xla_client *c = NULL;
    size_t n = 0, i, j;
    float f[4][3], *fp[4];
    int32_t v[4][2], *vp[4];
    char msg[2048];
    const char *require = getenv("TUTTI_REQUIRE_XLA");
    tutti_result r = tutti_xla_client_create(NULL, "cpu_device_count=4", &c);

    if (r == TUTTI_ERROR_UNAVAILABLE) {
        last_error(msg, sizeof msg);
        EXPECT(c == NULL);
        EXPECT(strstr(msg, "not available") != NULL);
        if (require != NULL && strcmp(require, "1") == 0) {
            FAIL("TUTTI_REQUIRE_XLA=1 but: %s", msg);
        }
        EXPECT_ERROR(tutti_xla_device_count(NULL, &n), TUTTI_ERROR_INVALID_ARGUMENT, "");
        printf("xla: unavailable: %s\n", msg);
        return 0;
    }
    CHECK(r);
    CHECK(tutti_xla_device_count(c, &n));
    EXPECT(n == 4);
    for (i = 0; i < 4; i++) {
        for (j = 0; j < 3; j++) {
            f[i][j] = (float)(i * 10 + j);
        }
        fp[i] = f[i];
        v[i][0] = (int32_t)i;
        v[i][1] = -(int32_t)i;
        vp[i] = v[i];
    }
    CHECK(tutti_xla_all_reduce(c, 3, TUTTI_DTYPE_F32, TUTTI_OP_SUM, (void *const *)fp));
    for (i = 0; i < 4; i++) {
        EXPECT(f[i][0] == 60.0f && f[i][1] == 64.0f && f[i][2] == 68.0f);
    }
    CHECK(tutti_xla_all_reduce(c, 3, TUTTI_DTYPE_F32, TUTTI_OP_MEAN, (void *const *)fp));
    EXPECT(f[3][0] == 60.0f);
    CHECK(tutti_xla_broadcast(c, 2, TUTTI_DTYPE_I32, 2, (void *const *)vp));
    for (i = 0; i < 4; i++) {
        EXPECT(v[i][0] == 2 && v[i][1] == -2);
    }

    EXPECT_ERROR(tutti_xla_all_reduce(c, 3, TUTTI_DTYPE_F32, TUTTI_OP_SUM, NULL),
                 TUTTI_ERROR_INVALID_ARGUMENT, "buffers is NULL");
    fp[2] = f[1];
    EXPECT_ERROR(tutti_xla_all_reduce(c, 3, TUTTI_DTYPE_F32, TUTTI_OP_SUM, (void *const *)fp),
                 TUTTI_ERROR_INVALID_ARGUMENT, "buffers[1] and buffers[2] overlap");
    fp[2] = f[2];
    EXPECT_ERROR(tutti_xla_all_reduce(c, 3, 42, TUTTI_OP_SUM, (void *const *)fp),
                 TUTTI_ERROR_INVALID_ARGUMENT, "dtype 42");
    EXPECT_ERROR(tutti_xla_broadcast(c, 2, TUTTI_DTYPE_I32, 9, (void *const *)vp),
                 TUTTI_ERROR_INVALID_ARGUMENT, "9");
    EXPECT_ERROR(tutti_xla_client_create("/nonexistent/plugin.so", NULL, &c),
                 TUTTI_ERROR_UNAVAILABLE, "/nonexistent/plugin.so");
    tutti_xla_client_destroy(c);
    tutti_xla_client_destroy(NULL);

    /* TPUStrategy over the same plugin's 4 devices: tensors reduced where they lie. */
    {
        tutti_strategy *s = NULL;
        int bad = 0;
        setenv("TUTTI_PJRT_OPTIONS", "cpu_device_count=4", 1);
        CHECK(tutti_strategy_create(TUTTI_STRATEGY_TPU, 0, TUTTI_CROSS_DEVICE_OPS_DEFAULT, &s));
        CHECK(tutti_strategy_run(s, tensor_step, &bad));
        bad = 1;
        EXPECT_ERROR(tutti_strategy_run(s, tensor_step, &bad), TUTTI_ERROR_SYSTEM,
                     "rank 1 is on xla:1", "in host memory");
        bad = 0;
        CHECK(tutti_strategy_run(s, tensor_step, &bad));
        EXPECT_ERROR(tutti_tensor_info(NULL, NULL, NULL, NULL), TUTTI_ERROR_INVALID_ARGUMENT,
                     "tensor is NULL");
        tutti_tensor_destroy(NULL);
        {
            /* A variable whose copies live on the 4 devices: updated there, read back. */
            tutti_device_variable *v = NULL;
            float init[2] = {10.0f, 20.0f}, got[2], upd[4][2];
            const void *up[4];
            double wide[2];
            CHECK(tutti_strategy_device_variable(s, 2, TUTTI_DTYPE_F32, init, &v));
            CHECK(tutti_strategy_run(s, variable_step, v));
            for (i = 0; i < 4; i++) {
                CHECK(tutti_device_variable_read(v, i, 2, TUTTI_DTYPE_F32, got));
                EXPECT(got[0] == 16.0f && got[1] == 24.0f);
                upd[i][0] = (float)i;
                upd[i][1] = -1.0f;
                up[i] = upd[i];
            }
            /* From outside run: replica 0's update, subtracted from every copy. */
            CHECK(tutti_device_variable_update(s, v, TUTTI_ASSIGN_SUB,
                                               TUTTI_AGGREGATION_ONLY_FIRST_REPLICA, 2,
                                               TUTTI_DTYPE_F32, up));
            CHECK(tutti_device_variable_read(v, 3, 2, TUTTI_DTYPE_F32, got));
            EXPECT(got[0] == 16.0f && got[1] == 25.0f);
            EXPECT_ERROR(tutti_device_variable_read(v, 4, 2, TUTTI_DTYPE_F32, got),
                         TUTTI_ERROR_INVALID_ARGUMENT, "no replica 4");
            EXPECT_ERROR(tutti_device_variable_read(v, 0, 2, TUTTI_DTYPE_F64, wide),
                         TUTTI_ERROR_INVALID_ARGUMENT, "is f32, not f64");
            EXPECT_ERROR(tutti_device_variable_update(s, v, 7, TUTTI_AGGREGATION_SUM, 2,
                                                      TUTTI_DTYPE_F32, up),
                         TUTTI_ERROR_INVALID_ARGUMENT, "how 7");
            EXPECT_ERROR(tutti_device_variable_update(s, v, TUTTI_ASSIGN, TUTTI_AGGREGATION_SUM, 3,
                                                      TUTTI_DTYPE_F32, up),
                         TUTTI_ERROR_INVALID_ARGUMENT, "count 3", "holds 2 elements");
            tutti_device_variable_destroy(v);
            tutti_device_variable_destroy(NULL);
        }
        {
            /* Placed on replica 2's device from outside run (an input pipeline). */
            tutti_tensor *t = NULL;
            float x[3] = {1.0f, 2.0f, 3.0f}, back[3];
            tutti_dtype dtype;
            size_t count = 0;
            tutti_device_kind kind;
            CHECK(tutti_strategy_place(s, 2, 3, TUTTI_DTYPE_F32, x, &t));
            CHECK(tutti_tensor_info(t, &dtype, &count, &kind));
            EXPECT(dtype == TUTTI_DTYPE_F32 && count == 3 && kind == TUTTI_DEVICE_XLA);
            CHECK(tutti_tensor_read(t, 3, TUTTI_DTYPE_F32, back));
            EXPECT(back[0] == 1.0f && back[2] == 3.0f);
            tutti_tensor_destroy(t);
            EXPECT_ERROR(tutti_strategy_place(s, 4, 3, TUTTI_DTYPE_F32, x, &t),
                         TUTTI_ERROR_INVALID_ARGUMENT, "no local replica 4");
        }
        tutti_strategy_destroy(s);
    }
    printf("xla: ok\n");
    return 0;
}
