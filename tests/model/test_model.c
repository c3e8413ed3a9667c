/* Hugging Face folders through the whole engine: tiny random-weight Llama / Qwen2
 * checkpoints (f32, bf16, sharded, Llama 3 rope scaling) made by transformers
 * (tests/reference/gen_model_reference.py) must give transformers' logits at every position
 * and the same greedy continuation. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "daemon/compress/compress.h"
#include "daemon/compress/spec.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/model.h"
#include "daemon/engine/sampler.h"
#include "kernels/backend.h"
#include "tests/common/fixture.h"

static int32_t *json_ids(json_t *arr, int *n)
{
    *n = (int)json_array_size(arr);
    int32_t *ids = malloc((size_t)(*n > 0 ? *n : 1) * sizeof *ids);
    for (int i = 0; i < *n; i++)
        ids[i] = (int32_t)json_integer_value(json_array_get(arr, (size_t)i));
    return ids;
}

/* Loads fixture folder `name`, runs its ids, compares logits (rel tolerance) and greedy ids. */
static void check_folder(const char *name, double rel_tol, bool reference_mode)
{
    char rel[256];
    snprintf(rel, sizeof rel, "tests/fixtures/%s/reference.json", name);
    json_t *ref = fixture_json(rel);
    assert_non_null(ref);
    snprintf(rel, sizeof rel, "tests/fixtures/%s", name);
    char *dir = fixture_stage_dir(rel);
    assert_non_null(dir);

    struct skv_backend *be = NULL;
    assert_int_equal(skv_backend_cpu_new(2, &be), SKV_OK);
    struct skv_model *m = NULL;
    struct skv_model_opts mo = {.reference = reference_mode};
    int rc = skv_model_load(dir, be, &mo, &m);
    if (rc)
        fail_msg("%s: %s", name, skv_error_msg());
    int nv = (int)json_integer_value(json_object_get(ref, "vocab_size"));
    assert_int_equal(m->cfg.n_vocab, nv);

    int n;
    int32_t *ids = json_ids(json_object_get(ref, "ids"), &n);
    snprintf(rel, sizeof rel, "tests/fixtures/%s/%s", name,
             json_string_value(json_object_get(ref, "logits_file")));
    size_t size = 0;
    float *want = fixture_read(rel, &size);
    assert_non_null(want);
    int rows = (int)(size / ((size_t)nv * sizeof(float))); /* every position, or the last one */
    assert_true(rows == n || rows == 1);
    assert_int_equal(size, (size_t)rows * nv * sizeof(float));

    struct skv_engine *e = NULL;
    struct skv_kv_cache *cache = NULL;
    assert_int_equal(skv_engine_new(m, &e), SKV_OK);
    assert_int_equal(skv_kv_cache_new(m, &cache), SKV_OK);
    float *got = malloc((size_t)n * nv * sizeof *got);
    struct skv_forward_opts fo = {.logits_all = rows > 1};
    assert_int_equal(skv_engine_forward(e, cache, ids, n, &fo, got), SKV_OK);
    double max_ref = 0, max_diff = 0;
    for (size_t i = 0; i < (size_t)rows * nv; i++) {
        max_ref = fmax(max_ref, fabs(want[i]));
        max_diff = fmax(max_diff, fabs(want[i] - got[i]));
    }
    printf("# %s: %d positions x %d, max |ref| %.4f, max |diff| %.3g\n", name, rows, nv, max_ref, max_diff);
    assert_true(max_diff <= rel_tol * max_ref);

    /* greedy continuation, when the fixture has one: decode token by token */
    json_t *greedy = json_object_get(ref, "greedy");
    if (greedy) {
        int ng;
        int32_t *want_ids = json_ids(json_object_get(greedy, "ids"), &ng);
        float *last = got + (size_t)(rows > 1 ? n - 1 : 0) * nv;
        for (int k = 0; k < ng; k++) {
            int32_t t = skv_argmax(last, nv);
            assert_int_equal(t, want_ids[k]);
            assert_int_equal(skv_engine_forward(e, cache, &t, 1, NULL, last), SKV_OK);
        }
        free(want_ids);
    }
    free(got);
    free(want);
    free(ids);
    skv_kv_cache_free(&cache);
    skv_engine_free(&e);
    skv_model_free(&m);
    skv_backend_destroy(&be);
    fixture_remove_dir(dir);
    json_decref(ref);
}

static void test_tiny_llama(void **state)
{
    (void)state;
    check_folder("tiny-llama", 1e-4, false);
}

static void test_tiny_llama_sharded(void **state)
{
    (void)state;
    check_folder("tiny-llama-sharded", 1e-4, false);
}

static void test_tiny_llama_bf16(void **state)
{
    (void)state;
    check_folder("tiny-llama-bf16", 1e-3, false);
    check_folder("tiny-llama-bf16", 1e-4, true);
}

static void test_tiny_qwen2(void **state)
{
    (void)state;
    check_folder("tiny-qwen2", 1e-4, false);
}

static void test_tiny_llama3_rope(void **state)
{
    (void)state;
    check_folder("tiny-llama3-rope", 1e-4, false);
}

/* Append and decode give the same logits as one forward over the whole sequence. */
static void test_incremental_matches_full(void **state)
{
    (void)state;
    char *dir = fixture_stage_dir("tests/fixtures/tiny-llama");
    json_t *ref = fixture_json("tests/fixtures/tiny-llama/reference.json");
    assert_non_null(dir);
    assert_non_null(ref);
    struct skv_backend *be = NULL;
    struct skv_model *m = NULL;
    struct skv_engine *e = NULL;
    struct skv_kv_cache *full = NULL, *inc = NULL;
    assert_int_equal(skv_backend_cpu_new(1, &be), SKV_OK);
    assert_int_equal(skv_model_load(dir, be, NULL, &m), SKV_OK);
    assert_int_equal(skv_engine_new(m, &e), SKV_OK);
    int n, nv = m->cfg.n_vocab;
    int32_t *ids = json_ids(json_object_get(ref, "ids"), &n);
    float *a = malloc((size_t)nv * sizeof *a), *b = malloc((size_t)nv * sizeof *b);
    assert_int_equal(skv_kv_cache_new(m, &full), SKV_OK);
    assert_int_equal(skv_engine_forward(e, full, ids, n, NULL, a), SKV_OK);
    assert_int_equal(skv_kv_cache_new(m, &inc), SKV_OK);
    assert_int_equal(skv_engine_forward(e, inc, ids, 17, NULL, b), SKV_OK);      /* prefill */
    assert_int_equal(skv_engine_forward(e, inc, ids + 17, 20, NULL, b), SKV_OK); /* append */
    for (int i = 37; i < n; i++)                                                  /* decode */
        assert_int_equal(skv_engine_forward(e, inc, ids + i, 1, NULL, b), SKV_OK);
    assert_int_equal(inc->n_past, n);
    for (int i = 0; i < nv; i++)
        assert_true(fabsf(a[i] - b[i]) <= 1e-4f * (1.0f + fabsf(a[i])));
    /* positions recorded per head */
    struct skv_kv_head *h = skv_kv_cache_head(inc, 1, 1);
    assert_int_equal(h->len, n);
    for (int i = 0; i < n; i++)
        assert_int_equal(h->pos[i], i);
    /* a bad token is refused and changes nothing */
    int32_t bad = nv;
    assert_int_equal(skv_engine_forward(e, inc, &bad, 1, NULL, b), SKV_E_INVAL);
    assert_int_equal(inc->n_past, n);
    free(a);
    free(b);
    free(ids);
    skv_kv_cache_free(&full);
    skv_kv_cache_free(&inc);
    skv_engine_free(&e);
    skv_model_free(&m);
    skv_backend_destroy(&be);
    fixture_remove_dir(dir);
    json_decref(ref);
}

/* A batched decode step equals separate forwards: four sessions of different lengths on the
 * default model (quantized weights: the integer GEMV path with several columns), one of them
 * evicting while it decodes (StreamingLLM through the compression hook). */
static void test_decode_batch_matches_single(void **state)
{
    (void)state;
    char *path = fixture_model_path();
    if (!path) {
        free(path);
        skip();
    }
    enum { NS = 4, STEPS = 6 };
    const int lens[NS] = {5, 40, 150, 1};
    struct skv_backend *be = NULL;
    struct skv_model *m = NULL;
    struct skv_engine *e = NULL;
    assert_int_equal(skv_backend_cpu_new(2, &be), SKV_OK);
    assert_int_equal(skv_model_load(path, be, NULL, &m), SKV_OK);
    assert_int_equal(skv_engine_new(m, &e), SKV_OK);
    const int nv = m->cfg.n_vocab;
    struct skv_kv_cache *one[NS], *bat[NS];
    struct skv_compressor *c_one = NULL, *c_bat = NULL;
    struct skv_compress_spec spec;
    assert_int_equal(skv_compress_spec_parse("policy=streaming,budget=48,sinks=4", &spec), SKV_OK);
    assert_int_equal(skv_compressor_new(&spec, m, &c_one), SKV_OK);
    assert_int_equal(skv_compressor_new(&spec, m, &c_bat), SKV_OK);
    float *lo = malloc((size_t)NS * nv * sizeof *lo), *lb = malloc((size_t)NS * nv * sizeof *lb);
    int32_t next[NS];
    assert_non_null(lo);
    assert_non_null(lb);
    for (int s = 0; s < NS; s++) {
        int32_t ids[150];
        for (int i = 0; i < lens[s]; i++)
            ids[i] = (int32_t)((i * 7919 + s * 104729 + 11) % 49000) + 100;
        assert_int_equal(skv_kv_cache_new(m, &one[s]), SKV_OK);
        assert_int_equal(skv_kv_cache_new(m, &bat[s]), SKV_OK);
        if (s == 2) { /* the compressed one */
            struct skv_forward_opts o1 = {.hook = skv_compressor_hook, .hook_user = c_one};
            struct skv_forward_opts o2 = {.hook = skv_compressor_hook, .hook_user = c_bat};
            assert_int_equal(skv_compressor_begin(c_one, one[s], lens[s]), SKV_OK);
            assert_int_equal(skv_engine_forward(e, one[s], ids, lens[s], &o1, lo + (size_t)s * nv), SKV_OK);
            assert_int_equal(skv_compressor_finish(c_one, one[s]), SKV_OK);
            assert_int_equal(skv_compressor_begin(c_bat, bat[s], lens[s]), SKV_OK);
            assert_int_equal(skv_engine_forward(e, bat[s], ids, lens[s], &o2, lb + (size_t)s * nv), SKV_OK);
            assert_int_equal(skv_compressor_finish(c_bat, bat[s]), SKV_OK);
        } else {
            assert_int_equal(skv_engine_forward(e, one[s], ids, lens[s], NULL, lo + (size_t)s * nv), SKV_OK);
            assert_int_equal(skv_engine_forward(e, bat[s], ids, lens[s], NULL, lb + (size_t)s * nv), SKV_OK);
        }
    }
    struct skv_forward_opts h_one = {.hook = skv_compressor_hook, .hook_user = c_one};
    struct skv_forward_opts h_bat = {.hook = skv_compressor_hook, .hook_user = c_bat};
    for (int step = 0; step < STEPS; step++) {
        struct skv_batch_seq seqs[NS];
        for (int s = 0; s < NS; s++) {
            /* greedy from the single-sequence logits; the batch must agree */
            const float *a = lo + (size_t)s * nv, *b = lb + (size_t)s * nv;
            int best = 0;
            for (int i = 1; i < nv; i++)
                best = a[i] > a[best] ? i : best;
            for (int i = 0; i < nv; i++)
                if (fabsf(a[i] - b[i]) > 1e-5f * (1.0f + fabsf(a[i])))
                    fail_msg("step %d sequence %d logit %d: single %g batch %g", step, s, i, a[i], b[i]);
            next[s] = best;
            seqs[s] = (struct skv_batch_seq){bat[s], best, s == 2 ? &h_bat : NULL, lb + (size_t)s * nv};
        }
        for (int s = 0; s < NS; s++) {
            if (s == 2)
                assert_int_equal(skv_compressor_begin_decode(c_one, one[s]), SKV_OK);
            assert_int_equal(skv_engine_forward(e, one[s], &next[s], 1, s == 2 ? &h_one : NULL, lo + (size_t)s * nv),
                             SKV_OK);
        }
        assert_int_equal(skv_compressor_begin_decode(c_bat, bat[2]), SKV_OK);
        assert_int_equal(skv_engine_decode_batch(e, seqs, NS), SKV_OK);
        for (int s = 0; s < NS; s++) {
            assert_int_equal(bat[s]->n_past, one[s]->n_past);
            assert_int_equal(skv_kv_cache_head(bat[s], 7, 1)->len, skv_kv_cache_head(one[s], 7, 1)->len);
        }
    }
    assert_int_equal(skv_kv_cache_head(bat[2], 0, 0)->len, 48); /* kept evicting */
    /* errors change nothing */
    struct skv_batch_seq bad[2] = {{bat[0], 1, NULL, NULL}, {bat[0], 2, NULL, NULL}};
    assert_int_equal(skv_engine_decode_batch(e, bad, 2), SKV_E_INVAL);   /* same cache twice */
    bad[1] = (struct skv_batch_seq){bat[1], nv, NULL, NULL};
    assert_int_equal(skv_engine_decode_batch(e, bad, 2), SKV_E_INVAL);   /* token out of range */
    assert_int_equal(skv_engine_decode_batch(e, bad, 0), SKV_E_INVAL);
    assert_int_equal(skv_engine_decode_batch(e, bad, SKV_ENGINE_MAX_BATCH + 1), SKV_E_INVAL);
    assert_int_equal(bat[0]->n_past, one[0]->n_past);
    for (int s = 0; s < NS; s++) {
        skv_kv_cache_free(&one[s]);
        skv_kv_cache_free(&bat[s]);
    }
    skv_compressor_free(&c_one);
    skv_compressor_free(&c_bat);
    free(lo);
    free(lb);
    skv_engine_free(&e);
    skv_model_free(&m);
    skv_backend_destroy(&be);
    free(path);
}

static void test_load_errors(void **state)
{
    (void)state;
    struct skv_backend *be = NULL;
    struct skv_model *m = NULL;
    assert_int_equal(skv_backend_cpu_new(1, &be), SKV_OK);
    assert_int_equal(skv_model_load("/nonexistent/model.gguf", be, NULL, &m), SKV_E_NOT_FOUND);
    assert_null(m);
    char *types = fixture_path("tests/fixtures/types.gguf.fixture");
    int rc = skv_model_load(types, be, NULL, &m); /* a GGUF without a model in it */
    assert_true(rc == SKV_E_FORMAT || rc == SKV_E_UNSUPPORTED || rc == SKV_E_NOT_FOUND);
    assert_null(m);
    free(types);
    skv_backend_destroy(&be);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiny_llama),        cmocka_unit_test(test_tiny_llama_sharded),
        cmocka_unit_test(test_tiny_llama_bf16),   cmocka_unit_test(test_tiny_qwen2),
        cmocka_unit_test(test_tiny_llama3_rope),  cmocka_unit_test(test_incremental_matches_full),
        cmocka_unit_test(test_decode_batch_matches_single),
        cmocka_unit_test(test_load_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
