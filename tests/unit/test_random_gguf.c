/* tests/gpu/random_gguf (the GPU check's random-weight models): the file it writes loads with
 * the shapes asked for, each weight type is what was asked, the weights have the intended
 * spread (std ~0.02 for Q8_0 and Q4_1, ~0.012 for F16), a forward gives finite logits, and bad
 * arguments are refused with a message. Runs $SKV_BUILDDIR/tests/gpu/random_gguf. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include <math.h>

#include "common/status.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/model.h"
#include "kernels/backend.h"

/* Runs random_gguf with `args`; its exit status (-1 when it could not run). */
static int run_writer(const char *args)
{
    const char *build = getenv("SKV_BUILDDIR") ? getenv("SKV_BUILDDIR") : ".";
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s/tests/gpu/random_gguf %s >/dev/null 2>&1", build, args);
    int st = system(cmd);
    return st == -1 || !WIFEXITED(st) ? -1 : WEXITSTATUS(st);
}

/* Mean and standard deviation of a weight matrix, dequantized row by row. */
static void weight_stats(const struct skv_tensor *t, double *mean, double *sd)
{
    int64_t cols = t->ne[0], rows = t->ne[1];
    size_t row_bytes = t->nbytes / (size_t)rows;
    float *row = malloc((size_t)cols * sizeof *row);
    assert_non_null(row);
    double s = 0, s2 = 0;
    for (int64_t r = 0; r < rows; r++) {
        assert_int_equal(skv_dequantize_row(t->type, (const char *)t->data + r * row_bytes, row, cols), SKV_OK);
        for (int64_t c = 0; c < cols; c++) {
            s += row[c];
            s2 += (double)row[c] * row[c];
        }
    }
    free(row);
    double n = (double)cols * (double)rows;
    *mean = s / n;
    *sd = sqrt(s2 / n - *mean * *mean);
}

static void check_type(const char *type, int wtype, int etype, double sd_lo, double sd_hi)
{
    char path[] = "/tmp/test_random_gguf-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    char args[256];
    snprintf(args, sizeof args, "--shape tiny --type %s --seed 3 --out %s", type, path);
    assert_int_equal(run_writer(args), 0);

    struct skv_backend *be = NULL;
    struct skv_model *m = NULL;
    struct skv_engine *e = NULL;
    assert_int_equal(skv_backend_cpu_new(1, &be), SKV_OK);
    assert_int_equal(skv_model_load(path, be, NULL, &m), SKV_OK);
    const struct skv_model_config *c = &m->cfg;
    /* the "tiny" preset: 2 layers, dim 256, 8 / 2 heads of 32, ffn 512, vocab 2048 */
    assert_string_equal(c->arch, "llama");
    assert_int_equal(c->n_layers, 2);
    assert_int_equal(c->dim, 256);
    assert_int_equal(c->n_heads, 8);
    assert_int_equal(c->n_kv_heads, 2);
    assert_int_equal(c->head_dim, 32);
    assert_int_equal(c->ffn_dim, 512);
    assert_int_equal(c->n_vocab, 2048);
    assert_int_equal(c->max_ctx, 131072);
    assert_float_equal(c->rope.theta, 10000.0f, 0.0f);
    assert_false(c->tied_output);
    assert_null(m->tok);
    const struct skv_layer_weights *w = &m->layers[1];
    assert_int_equal(w->wq.type, wtype);
    assert_int_equal(w->w_down.type, wtype);
    assert_int_equal(w->wk.ne[0], 256);
    assert_int_equal(w->wk.ne[1], 64);
    assert_int_equal(w->w_down.ne[0], 512);
    assert_int_equal(w->w_down.ne[1], 256);
    assert_int_equal(w->attn_norm.type, SKV_DTYPE_F32);
    assert_int_equal(m->tok_embd.type, etype);
    assert_int_equal(m->output.type, etype);

    double mean, sd;
    weight_stats(&w->w_up, &mean, &sd);
    assert_true(fabs(mean) < 0.001);
    assert_true(sd > sd_lo && sd < sd_hi);
    weight_stats(&m->output, &mean, &sd);
    assert_true(fabs(mean) < 0.001);

    /* a forward through the random weights stays finite */
    struct skv_kv_cache *cache = NULL;
    float *logits = malloc(2048 * sizeof *logits);
    int32_t ids[5] = {1, 200, 1999, 7, 42};
    assert_non_null(logits);
    assert_int_equal(skv_engine_new(m, &e), SKV_OK);
    assert_int_equal(skv_kv_cache_new(m, &cache), SKV_OK);
    assert_int_equal(skv_engine_forward(e, cache, ids, 5, NULL, logits), SKV_OK);
    double spread = 0;
    for (int i = 0; i < 2048; i++) {
        assert_true(isfinite(logits[i]));
        spread += fabs(logits[i] - logits[0]);
    }
    assert_true(spread > 0); /* not a constant row */
    free(logits);
    skv_kv_cache_free(&cache);
    skv_engine_free(&e);
    skv_model_free(&m);
    skv_backend_destroy(&be);
    unlink(path);
}

/* Q8_0: scale 2.7e-4 over int8 quants, std 0.01995 (gguf-py reads the same) */
static void test_q8_0(void **state)
{
    (void)state;
    check_type("q8_0", SKV_DTYPE_Q8_0, SKV_DTYPE_Q8_0, 0.0195, 0.0205);
}

/* Q4_1: (q - 7.5) * 0.00433, std 0.01996; embedding and output Q8_0 as llama.cpp quantizes */
static void test_q4_1(void **state)
{
    (void)state;
    check_type("q4_1", SKV_DTYPE_Q4_1, SKV_DTYPE_Q8_0, 0.0195, 0.0205);
}

/* F16: |x| uniform in [2^-7, 2^-6) with a random sign, std 0.0119 */
static void test_f16(void **state)
{
    (void)state;
    check_type("f16", SKV_DTYPE_F16, SKV_DTYPE_F16, 0.0115, 0.0123);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    assert_int_equal(run_writer("--shape nope --out /tmp/x.gguf"), 2);
    assert_int_equal(run_writer("--shape tiny --type q5_0 --out /tmp/x.gguf"), 2);
    assert_int_equal(run_writer("--shape tiny --heads 7 --out /tmp/x.gguf"), 2);
    assert_int_equal(run_writer("--shape tiny --kv-heads 3 --out /tmp/x.gguf"), 2);
    assert_int_equal(run_writer("--shape tiny"), 2);
    assert_int_equal(run_writer("--shape tiny --out /nonexistent-dir/x.gguf"), 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_q8_0),
        cmocka_unit_test(test_q4_1),
        cmocka_unit_test(test_f16),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
