/* Checkpoints from C: insert tensors of several types, save through a strategy (its chief
 * writes) and without one, keep the last N, restore the latest, read back, and the error paths
 * (absent names, the wrong type or count, NULL arguments, a damaged file). */
#include "check.h"

#include <unistd.h>

int main(void) {
    const char *dir = getenv("CHECKPOINT_DIR");
    char path[1024];
    tutti_strategy *s = NULL;
    tutti_checkpoint *c = NULL, *back = NULL;
    float w[6] = {1.5f, -2.0f, 3.25f, 0.0f, 4.0f, 5.5f}, got[6] = {0};
    int64_t counter = 42, counter_back = 0;
    size_t shape[2] = {2, 3}, dims[4] = {0}, ndim = 0;
    tutti_dtype dtype = 99;
    uint64_t step = 0, k;
    FILE *f;

    EXPECT(dir != NULL);
    /* Nothing there yet: NULL, not an error. */
    back = (tutti_checkpoint *)1;
    CHECK(tutti_checkpoint_restore(NULL, dir, &back));
    EXPECT(back == NULL);

    CHECK(tutti_strategy_create(TUTTI_STRATEGY_MIRRORED, 2, TUTTI_CROSS_DEVICE_OPS_RING, &s));
    for (k = 10; k <= 40; k += 10) {
        CHECK(tutti_checkpoint_create(k, &c));
        CHECK(tutti_checkpoint_insert(c, "weights", TUTTI_DTYPE_F32, 2, shape, w));
        CHECK(tutti_checkpoint_insert(c, "counter", TUTTI_DTYPE_I64, 0, NULL, &counter));
        CHECK(tutti_checkpoint_save(k % 20 == 0 ? s : NULL, dir, 2, c));
        tutti_checkpoint_destroy(c);
        c = NULL;
    }
    /* The last two by step are kept. */
    snprintf(path, sizeof path, "%s/ckpt-20.tutti", dir);
    EXPECT(access(path, F_OK) != 0);
    snprintf(path, sizeof path, "%s/ckpt-30.tutti", dir);
    EXPECT(access(path, F_OK) == 0);

    CHECK(tutti_checkpoint_restore(s, dir, &back));
    EXPECT(back != NULL);
    CHECK(tutti_checkpoint_step(back, &step));
    EXPECT(step == 40);
    CHECK(tutti_checkpoint_variable(back, "weights", &dtype, &ndim, dims, 4));
    EXPECT(dtype == TUTTI_DTYPE_F32 && ndim == 2 && dims[0] == 2 && dims[1] == 3);
    CHECK(tutti_checkpoint_variable(back, "counter", &dtype, &ndim, NULL, 0));
    EXPECT(dtype == TUTTI_DTYPE_I64 && ndim == 0);
    CHECK(tutti_checkpoint_read(back, "weights", TUTTI_DTYPE_F32, 6, got));
    EXPECT(memcmp(got, w, sizeof w) == 0);
    CHECK(tutti_checkpoint_read(back, "counter", TUTTI_DTYPE_I64, 1, &counter_back));
    EXPECT(counter_back == 42);

    EXPECT_ERROR(tutti_checkpoint_read(back, "bias", TUTTI_DTYPE_F32, 6, got),
                 TUTTI_ERROR_INVALID_ARGUMENT, "no such variable", "weights");
    EXPECT_ERROR(tutti_checkpoint_read(back, "weights", TUTTI_DTYPE_F64, 3, got),
                 TUTTI_ERROR_INVALID_ARGUMENT, "6 f32 elements", "3 f64");
    EXPECT_ERROR(tutti_checkpoint_read(back, "weights", TUTTI_DTYPE_F32, 5, got),
                 TUTTI_ERROR_INVALID_ARGUMENT, "out is 5 f32");
    EXPECT_ERROR(tutti_checkpoint_insert(back, "weights", TUTTI_DTYPE_F32, 2, shape, w),
                 TUTTI_ERROR_INVALID_ARGUMENT, "already");
    EXPECT_ERROR(tutti_checkpoint_insert(back, "x", TUTTI_DTYPE_F32, 2, NULL, w),
                 TUTTI_ERROR_INVALID_ARGUMENT, "shape is NULL");
    EXPECT_ERROR(tutti_checkpoint_insert(back, "x", TUTTI_DTYPE_F32, 2, shape, NULL),
                 TUTTI_ERROR_INVALID_ARGUMENT, "data is NULL");
    EXPECT_ERROR(tutti_checkpoint_insert(back, NULL, TUTTI_DTYPE_F32, 2, shape, w),
                 TUTTI_ERROR_INVALID_ARGUMENT, "name is NULL");
    EXPECT_ERROR(tutti_checkpoint_insert(back, "x", 77, 2, shape, w), TUTTI_ERROR_INVALID_ARGUMENT,
                 "dtype 77");
    EXPECT_ERROR(tutti_checkpoint_insert(back, "x", TUTTI_DTYPE_F32, 65, shape, w),
                 TUTTI_ERROR_INVALID_ARGUMENT, "ndim 65: at most 64");
    EXPECT_ERROR(tutti_checkpoint_variable(back, "weights", NULL, NULL, NULL, 2),
                 TUTTI_ERROR_INVALID_ARGUMENT, "shape is NULL");
    EXPECT_ERROR(tutti_checkpoint_step(NULL, &step), TUTTI_ERROR_INVALID_ARGUMENT,
                 "checkpoint is NULL");
    EXPECT_ERROR(tutti_checkpoint_save(s, dir, 0, back), TUTTI_ERROR_INVALID_ARGUMENT,
                 "max_to_keep");
    EXPECT_ERROR(tutti_checkpoint_restore(s, NULL, &back), TUTTI_ERROR_INVALID_ARGUMENT,
                 "directory is NULL");
    tutti_checkpoint_destroy(back);
    back = NULL;

    /* A damaged latest checkpoint: an error naming the file, and nothing written out. */
    snprintf(path, sizeof path, "%s/ckpt-50.tutti", dir);
    f = fopen(path, "wb");
    EXPECT(f != NULL);
    fputs("TUTTICKP", f);
    fclose(f);
    EXPECT_ERROR(tutti_checkpoint_restore(s, dir, &back), TUTTI_ERROR_INVALID_ARGUMENT,
                 "ckpt-50.tutti", "cut short");
    EXPECT(back == NULL);
    tutti_strategy_destroy(s);
    tutti_checkpoint_destroy(NULL);
    printf("checkpoint: ok\n");
    return 0;
}
