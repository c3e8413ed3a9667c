/* Hugging Face folders through the whole engine: tiny random-weight Llama / Qwen2
 * checkpoints (f32, bf16, sharded, Llama 3 rope scaling) made by transformers
 * (tests/reference/gen_model_reference.py) must give transformers' logits at every position
 * and the same greedy continuation; so must the Llama 3 one as a GGUF with rope_freqs.weight. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/status.h"
#include "daemon/compress/compress.h"
#include "daemon/compress/spec.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/gguf.h"
#include "daemon/engine/model.h"
#include "daemon/engine/sampler.h"
#include "daemon/engine/tokenizer.h"
#include "kernels/backend.h"
#include "tests/common/fixture.h"
#include "tests/common/gguf_build.h"

/* The group's backend: the CPU, or in the CUDA group device 0 (tests/gpu/check.sh runs that
 * group on a GPU; without a device its tests skip). Prompts of more than 8 tokens go through
 * cuBLAS there, with bf16 activations for bf16 weights, so its bound on the logits is looser. */
static bool g_cuda, g_cuda_ok;

static int backend_new(int threads, struct skv_backend **be)
{
    return g_cuda ? skv_backend_cuda_new(0, be) : skv_backend_cpu_new(threads, be);
}

static int32_t *json_ids(json_t *arr, int *n)
{
    *n = (int)json_array_size(arr);
    int32_t *ids = malloc((size_t)(*n > 0 ? *n : 1) * sizeof *ids);
    for (int i = 0; i < *n; i++)
        ids[i] = (int32_t)json_integer_value(json_array_get(arr, (size_t)i));
    return ids;
}

/* Loads fixture folder `name` (or, when gguf is set, that GGUF fixture made from the same
 * weights), runs the folder's ids, compares logits (rel tolerance) and greedy ids. */
static void check_model(const char *name, const char *gguf, double rel_tol, bool reference_mode)
{
    char rel[256];
    snprintf(rel, sizeof rel, "tests/fixtures/%s/reference.json", name);
    json_t *ref = fixture_json(rel);
    assert_non_null(ref);
    snprintf(rel, sizeof rel, "tests/fixtures/%s", name);
    char *dir = gguf ? fixture_path(gguf) : fixture_stage_dir(rel);
    assert_non_null(dir);

    struct skv_backend *be = NULL;
    assert_int_equal(backend_new(2, &be), SKV_OK);
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
    if (g_cuda) /* fp32 sums in another order; bf16 activations into bf16 weights */
        rel_tol = fmax(rel_tol, m->layers[0].wq.type == SKV_DTYPE_BF16 ? 2e-2 : 1e-3);
    printf("# %s%s%s: %d positions x %d, max |ref| %.4f, max |diff| %.3g (bound %.3g)\n", name,
           gguf ? " (gguf)" : "", g_cuda ? " [cuda]" : "", rows, nv, max_ref, max_diff, rel_tol * max_ref);
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
    if (gguf)
        free(dir);
    else
        fixture_remove_dir(dir);
    json_decref(ref);
}

static void check_folder(const char *name, double rel_tol, bool reference_mode)
{
    check_model(name, NULL, rel_tol, reference_mode);
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

/* Sliding-window attention (transformers' rule: query q sees keys k with q - W < k <= q):
 * Mistral with W = 16 in every layer, Qwen2 with W = 12 in layer 1 only; 40-token prompts,
 * so most queries drop keys, and 16 greedy tokens decoded one by one over the cache. */
static void test_tiny_mistral_swa(void **state)
{
    (void)state;
    check_folder("tiny-mistral-swa", 1e-4, false);
    check_folder("tiny-mistral-swa", 1e-4, true);
}

static void test_tiny_qwen2_swa(void **state)
{
    (void)state;
    check_folder("tiny-qwen2-swa", 1e-4, false);
    /* the same weights as llama.cpp's converter writes them: qwen2.attention.sliding_window
     * and sliding_window_pattern [false, true] */
    check_model("tiny-qwen2-swa", "tests/fixtures/tiny-qwen2-swa.gguf.fixture", 1e-4, false);
    char *path = fixture_path("tests/fixtures/tiny-qwen2-swa.gguf.fixture");
    struct skv_backend *be = NULL;
    struct skv_model *m = NULL;
    assert_int_equal(backend_new(1, &be), SKV_OK);
    assert_int_equal(skv_model_load(path, be, NULL, &m), SKV_OK);
    assert_true(m->cfg.sliding_window == 12 && m->layers[0].window == 0 && m->layers[1].window == 12);
    assert_true(m->cfg.qkv_bias && m->cfg.tied_output && m->cfg.rope.mode == SKV_ROPE_NEOX);
    skv_model_free(&m);
    skv_backend_destroy(&be);
    free(path);
}

/* A fixture folder staged with its config.json edited by `edit`, loaded on be: the status
 * (*out: the model when it loaded; *dir_out: the folder, for fixture_remove_dir). */
static int load_config_edited(const char *fixture, void (*edit)(json_t *root), struct skv_backend *be,
                              struct skv_model **out, char **dir_out)
{
    char *dir = fixture_stage_dir(fixture);
    assert_non_null(dir);
    char path[1024];
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_t *root = json_load_file(path, 0, NULL);
    assert_non_null(root);
    edit(root);
    assert_int_equal(json_dump_file(root, path, JSON_INDENT(1)), 0);
    json_decref(root);
    *out = NULL;
    *dir_out = dir;
    return skv_model_load(dir, be, NULL, out);
}

/* Loads a staged copy of fixture folder `name` with config.json edited by `edit`; returns the
 * load status, the windows of layers 0 and 1 in w[] and cfg.sliding_window in w[2]. */
static int load_edited(const char *name, void (*edit)(json_t *cfg), int w[3])
{
    char rel[256];
    snprintf(rel, sizeof rel, "tests/fixtures/%s", name);
    struct skv_backend *be = NULL;
    struct skv_model *m = NULL;
    char *dir = NULL;
    assert_int_equal(backend_new(1, &be), SKV_OK);
    int rc = load_config_edited(rel, edit, be, &m, &dir);
    if (rc == SKV_OK) {
        w[0] = m->layers[0].window;
        w[1] = m->layers[1].window;
        w[2] = m->cfg.sliding_window;
    }
    skv_model_free(&m);
    skv_backend_destroy(&be);
    fixture_remove_dir(dir);
    return rc;
}

static void edit_none(json_t *c) { (void)c; }
static void edit_drop_window(json_t *c) { json_object_del(c, "sliding_window"); }
static void edit_null_window(json_t *c) { json_object_set_new(c, "sliding_window", json_null()); }
static void edit_zero_window(json_t *c) { json_object_set_new(c, "sliding_window", json_integer(0)); }
static void edit_no_swa(json_t *c) { json_object_set_new(c, "use_sliding_window", json_false()); }
static void edit_no_types(json_t *c) { json_object_del(c, "layer_types"); }
static void edit_types_all(json_t *c)
{
    json_t *t = json_array();
    json_array_append_new(t, json_string("sliding_attention"));
    json_array_append_new(t, json_string("sliding_attention"));
    json_object_set_new(c, "layer_types", t);
}
static void edit_types_bad(json_t *c)
{
    json_t *t = json_array();
    json_array_append_new(t, json_string("chunked_attention"));
    json_array_append_new(t, json_string("full_attention"));
    json_object_set_new(c, "layer_types", t);
}
static void edit_types_short(json_t *c)
{
    json_t *t = json_array();
    json_array_append_new(t, json_string("full_attention"));
    json_object_set_new(c, "layer_types", t);
}

static void edit_l3_band(json_t *c)
{
    json_object_del(c, "rope_parameters"); /* rope_scaling alone, as transformers 4 wrote it */
    json_object_set_new(json_object_get(c, "rope_scaling"), "high_freq_factor", json_real(0.5));
}
static void edit_l3_factor0(json_t *c)
{
    json_object_del(c, "rope_parameters"); /* rope_scaling alone, as transformers 4 wrote it */
    json_object_set_new(json_object_get(c, "rope_scaling"), "factor", json_real(0.0));
}
static void edit_rope_yarn(json_t *c)
{
    json_object_del(c, "rope_parameters"); /* rope_scaling alone, as transformers 4 wrote it */
    json_object_set_new(c, "rope_scaling", json_pack("{s:s, s:f}", "rope_type", "yarn", "factor", 4.0));
}
static void edit_linear_factor0(json_t *c)
{
    json_object_del(c, "rope_parameters"); /* rope_scaling alone, as transformers 4 wrote it */
    json_object_set_new(c, "rope_scaling", json_pack("{s:s, s:f}", "rope_type", "linear", "factor", 0.0));
}
static void edit_linear_2(json_t *c)
{
    json_object_del(c, "rope_parameters"); /* rope_scaling alone, as transformers 4 wrote it */
    json_object_set_new(c, "rope_scaling", json_pack("{s:s, s:f}", "rope_type", "linear", "factor", 2.0));
}

static void edit_rope_no_type(json_t *c)
{
    json_object_del(c, "rope_parameters");
    json_object_set_new(c, "rope_scaling", json_pack("{s:f}", "factor", 2.0));
}
static void edit_linear_no_factor(json_t *c)
{
    json_object_del(c, "rope_parameters");
    json_object_set_new(c, "rope_scaling", json_pack("{s:s}", "rope_type", "linear"));
}
static void edit_l3_no_original(json_t *c)
{
    json_object_del(c, "rope_parameters");
    json_object_del(json_object_get(c, "rope_scaling"), "original_max_position_embeddings");
}

/* RoPE parameters config.json gives are checked at load with the rope op's rules: a llama3 band
 * with high_freq_factor <= low_freq_factor (accepted at load before, refused at the first
 * forward) and a factor of 0 (llama3 scaling silently off before) fail there with a message. */
static void test_hf_rope_config(void **state)
{
    (void)state;
    int w[3];
    assert_int_equal(load_edited("tiny-llama3-rope", edit_none, w), SKV_OK);
    assert_int_equal(load_edited("tiny-llama3-rope", edit_l3_band, w), SKV_E_FORMAT);
    assert_non_null(strstr(skv_error_msg(), "rope"));
    assert_int_equal(load_edited("tiny-llama3-rope", edit_l3_factor0, w), SKV_E_FORMAT);
    assert_non_null(strstr(skv_error_msg(), "factor"));
    assert_int_equal(load_edited("tiny-llama3-rope", edit_linear_factor0, w), SKV_E_FORMAT);
    assert_int_equal(load_edited("tiny-llama3-rope", edit_rope_yarn, w), SKV_E_UNSUPPORTED);
    assert_non_null(strstr(skv_error_msg(), "yarn"));
    assert_int_equal(load_edited("tiny-llama3-rope", edit_linear_2, w), SKV_OK);
    /* keys transformers requires (before: no scaling, a factor of 1, llama3's defaults) */
    assert_int_equal(load_edited("tiny-llama3-rope", edit_rope_no_type, w), SKV_E_FORMAT);
    assert_non_null(strstr(skv_error_msg(), "no rope_type"));
    assert_int_equal(load_edited("tiny-llama3-rope", edit_linear_no_factor, w), SKV_E_FORMAT);
    assert_non_null(strstr(skv_error_msg(), "has no factor"));
    assert_int_equal(load_edited("tiny-llama3-rope", edit_l3_no_original, w), SKV_E_FORMAT);
    assert_non_null(strstr(skv_error_msg(), "has no original_max_position_embeddings"));
}

/* Which layers slide, from each way config.json can say it (transformers' reading). */
static void test_swa_config(void **state)
{
    (void)state;
    int w[3];
    assert_int_equal(load_edited("tiny-mistral-swa", edit_none, w), SKV_OK);
    assert_true(w[0] == 16 && w[1] == 16 && w[2] == 16);
    assert_int_equal(load_edited("tiny-mistral-swa", edit_drop_window, w), SKV_OK);
    assert_true(w[0] == 4096 && w[1] == 4096 && w[2] == 4096); /* MistralConfig's default */
    assert_int_equal(load_edited("tiny-mistral-swa", edit_null_window, w), SKV_OK);
    assert_true(w[0] == 0 && w[1] == 0 && w[2] == 0);
    assert_int_equal(load_edited("tiny-mistral-swa", edit_zero_window, w), SKV_E_FORMAT);
    assert_int_equal(load_edited("tiny-mistral-swa", edit_types_bad, w), SKV_OK); /* Mistral ignores them */
    assert_true(w[0] == 16 && w[1] == 16);
    assert_int_equal(load_edited("tiny-qwen2-swa", edit_none, w), SKV_OK);
    assert_true(w[0] == 0 && w[1] == 12 && w[2] == 12);
    assert_int_equal(load_edited("tiny-qwen2-swa", edit_no_types, w), SKV_OK); /* max_window_layers 1 */
    assert_true(w[0] == 0 && w[1] == 12);
    assert_int_equal(load_edited("tiny-qwen2-swa", edit_types_all, w), SKV_OK);
    assert_true(w[0] == 12 && w[1] == 12);
    assert_int_equal(load_edited("tiny-qwen2-swa", edit_no_swa, w), SKV_OK);
    assert_true(w[0] == 0 && w[1] == 0 && w[2] == 0);
    assert_int_equal(load_edited("tiny-qwen2-swa", edit_types_bad, w), SKV_E_UNSUPPORTED);
    assert_int_equal(load_edited("tiny-qwen2-swa", edit_types_short, w), SKV_E_FORMAT);
    assert_int_equal(load_edited("tiny-qwen2", edit_none, w), SKV_OK);
    assert_true(w[0] == 0 && w[1] == 0 && w[2] == 0);
}

/* Rows out of every future query's window can leave the cache (as compression drops rows):
 * decoding over the compacted cache gives the same logits, because the window is applied by
 * the rows' original positions; and a prefill in pieces equals the whole one. */
static void test_swa_compacted_cache(void **state)
{
    (void)state;
    char *dir = fixture_stage_dir("tests/fixtures/tiny-mistral-swa");
    json_t *ref = fixture_json("tests/fixtures/tiny-mistral-swa/reference.json");
    assert_non_null(dir);
    assert_non_null(ref);
    struct skv_backend *be = NULL;
    struct skv_model *m = NULL;
    struct skv_engine *e = NULL;
    struct skv_kv_cache *full = NULL, *cut = NULL;
    assert_int_equal(backend_new(2, &be), SKV_OK);
    assert_int_equal(skv_model_load(dir, be, NULL, &m), SKV_OK);
    assert_int_equal(skv_engine_new(m, &e), SKV_OK);
    int n, nv = m->cfg.n_vocab, W = m->cfg.sliding_window;
    int32_t *ids = json_ids(json_object_get(ref, "ids"), &n);
    float *a = malloc((size_t)nv * sizeof *a), *b = malloc((size_t)nv * sizeof *b);
    assert_int_equal(skv_kv_cache_new(m, &full), SKV_OK);
    assert_int_equal(skv_engine_forward(e, full, ids, n, NULL, a), SKV_OK);
    assert_int_equal(skv_kv_cache_new(m, &cut), SKV_OK);
    assert_int_equal(skv_engine_forward(e, cut, ids, 7, NULL, b), SKV_OK);
    assert_int_equal(skv_engine_forward(e, cut, ids + 7, 20, NULL, b), SKV_OK);
    assert_int_equal(skv_engine_forward(e, cut, ids + 27, n - 27, NULL, b), SKV_OK);
    for (int i = 0; i < nv; i++)
        assert_true(fabsf(a[i] - b[i]) <= 1e-4f * (1.0f + fabsf(a[i])));
    /* queries from position n on see positions > n - W: drop every row at or below n - W */
    for (int l = 0; l < m->cfg.n_layers; l++)
        for (int h = 0; h < m->cfg.n_kv_heads; h++) {
            struct skv_kv_head *kh = skv_kv_cache_head(cut, l, h);
            int32_t idx[64];
            int kept = 0;
            for (int r = 0; r < kh->len; r++)
                if (kh->pos[r] > n - W)
                    idx[kept++] = r;
            assert_int_equal(skv_kv_cache_compact(cut, l, h, idx, kept), SKV_OK);
        }
    assert_int_equal(skv_kv_cache_head(cut, 1, 1)->len, W - 1);
    for (int k = 0; k < 16; k++) {
        int32_t t = skv_argmax(a, nv);
        assert_int_equal(skv_engine_forward(e, full, &t, 1, NULL, a), SKV_OK);
        assert_int_equal(skv_engine_forward(e, cut, &t, 1, NULL, b), SKV_OK);
        for (int i = 0; i < nv; i++)
            assert_true(fabsf(a[i] - b[i]) <= 1e-5f * (1.0f + fabsf(a[i])));
    }
    free(a);
    free(b);
    free(ids);
    skv_kv_cache_free(&full);
    skv_kv_cache_free(&cut);
    skv_engine_free(&e);
    skv_model_free(&m);
    skv_backend_destroy(&be);
    fixture_remove_dir(dir);
    json_decref(ref);
}

/* Runs ids through a loaded model; the logits of every position ([n][n_vocab]). */
static float *forward_all(struct skv_model *m, const int32_t *ids, int n)
{
    struct skv_engine *e = NULL;
    struct skv_kv_cache *cache = NULL;
    assert_int_equal(skv_engine_new(m, &e), SKV_OK);
    assert_int_equal(skv_kv_cache_new(m, &cache), SKV_OK);
    float *got = malloc((size_t)n * m->cfg.n_vocab * sizeof *got);
    struct skv_forward_opts fo = {.logits_all = true};
    assert_int_equal(skv_engine_forward(e, cache, ids, n, &fo, got), SKV_OK);
    skv_kv_cache_free(&cache);
    skv_engine_free(&e);
    return got;
}

/* The same checkpoint as tiny-llama3-rope, as llama.cpp's converter writes a Llama 3.1 GGUF:
 * rope_freqs.weight instead of scaling keys, Q/K rows permuted. Must give the folder's
 * transformers logits (last position, and the top-10 ids where they are clear). */
static void test_gguf_rope_freqs(void **state)
{
    (void)state;
    json_t *ref = fixture_json("tests/fixtures/tiny-llama3-rope/reference.json");
    assert_non_null(ref);
    size_t size = 0;
    float *want = fixture_read("tests/fixtures/tiny-llama3-rope/logits_last.f32", &size);
    assert_non_null(want);
    char *path = fixture_path("tests/fixtures/tiny-llama3-rope-freqs.gguf.fixture");
    struct skv_backend *be = NULL;
    assert_int_equal(backend_new(2, &be), SKV_OK);
    for (int mode = 0; mode < 2; mode++) {
        struct skv_model *m = NULL;
        struct skv_model_opts mo = {.reference = mode == 1};
        if (skv_model_load(path, be, &mo, &m))
            fail_msg("%s: %s", path, skv_error_msg());
        const struct skv_rope *rp = &m->cfg.rope;
        assert_int_equal(rp->mode, SKV_ROPE_NORM);
        assert_true(rp->freq_factors != NULL && rp->l3_factor == 0.0f && rp->freq_scale == 1.0f);
        assert_true(rp->freq_factors[0] == 1.0f && rp->freq_factors[7] == 8.0f);
        assert_true(rp->freq_factors[1] > 1.0f && rp->freq_factors[1] < 8.0f);
        assert_null(m->tok);
        int n, nv = m->cfg.n_vocab;
        assert_int_equal((size_t)nv * sizeof(float), size);
        int32_t *ids = json_ids(json_object_get(ref, "ids"), &n);
        float *got = forward_all(m, ids, n);
        const float *last = got + (size_t)(n - 1) * nv;
        double max_ref = 0, max_diff = 0;
        for (int i = 0; i < nv; i++) {
            max_ref = fmax(max_ref, fabs(want[i]));
            max_diff = fmax(max_diff, fabs(want[i] - last[i]));
        }
        printf("# gguf rope_freqs (%s): last of %d positions, max |ref| %.4f, max |diff| %.3g\n",
               mode ? "reference" : "fast", n, max_ref, max_diff);
        assert_true(max_diff <= 1e-4 * max_ref);
        /* top-1 at every position the fixture records */
        size_t k;
        json_t *tk;
        json_array_foreach(json_object_get(ref, "topk"), k, tk) {
            int p = (int)json_integer_value(json_object_get(tk, "pos"));
            json_t *tids = json_object_get(tk, "ids"), *tvals = json_object_get(tk, "values");
            double gap = json_number_value(json_array_get(tvals, 0)) - json_number_value(json_array_get(tvals, 1));
            if (gap > 1e-3)
                assert_int_equal(skv_argmax(got + (size_t)p * nv, nv), json_integer_value(json_array_get(tids, 0)));
        }
        free(got);
        free(ids);
        skv_model_free(&m);
    }

    /* a factor of 0 in the file is refused with a message, and a wrong count too */
    size_t fsize = 0;
    unsigned char *bytes = fixture_read("tests/fixtures/tiny-llama3-rope-freqs.gguf.fixture", &fsize);
    assert_non_null(bytes);
    struct skv_gguf *g = NULL;
    assert_int_equal(skv_gguf_open_buffer(bytes, fsize, &g), SKV_OK);
    size_t off = (size_t)((const unsigned char *)skv_gguf_find_tensor(g, "rope_freqs.weight")->data - bytes);
    skv_gguf_close(&g);
    char tmp[] = "/tmp/skv-ropefreqs-XXXXXX";
    int fd = mkstemp(tmp);
    assert_true(fd >= 0);
    memset(bytes + off + 3 * sizeof(float), 0, sizeof(float));
    assert_int_equal(write(fd, bytes, fsize), (ssize_t)fsize);
    close(fd);
    struct skv_model *m = NULL;
    assert_int_equal(skv_model_load(tmp, be, NULL, &m), SKV_E_FORMAT);
    assert_null(m);
    assert_non_null(strstr(skv_error_msg(), "rope_freqs.weight"));
    unlink(tmp);
    free(bytes);
    free(want);
    free(path);
    skv_backend_destroy(&be);
    json_decref(ref);
}

/* ---- GGUFs written here: rope scaling keys, tokenizer sizes ---- */

/* What a test puts in the GGUF besides the model. */
struct gguf_extra {
    const char *scaling_type; /* llama.rope.scaling.type; NULL: absent */
    float scaling_factor;     /* llama.rope.scaling.factor; 0: absent */
    float freq_base;          /* llama.rope.freq_base; 0: absent */
    int n_tokens;             /* a tokenizer of this many tokens ('A' + i); 0: none */
    const char *tok_model;    /* its tokenizer.ggml.model (NULL: gpt2) */
    const char *freq_base_str; /* llama.rope.freq_base as a string (a hand-edited file); NULL: none */
    int experts;              /* llama.expert_count; 0: absent */
    bool no_eps;              /* llama.attention.layer_norm_rms_epsilon left out (else 1e-5) */
    float weight;             /* every matrix's value (0: 0.01) */
    float eps;                /* llama.attention.layer_norm_rms_epsilon (0: 1e-5) */
    const char *eps_str;      /* the same key as a string instead (a hand-edited file); NULL: none */
};

/* Writes a llama GGUF to a temporary file and returns its path (malloc'd): 1 layer, dim 8,
 * 2 heads of 4, ffn 16, 32 embedding rows, f32 weights of 0.01 and norms of 1, tied output. */
static char *write_gguf(const struct gguf_extra *x)
{
    static const struct {
        const char *name;
        uint64_t ne0, ne1; /* ne1 0: a vector */
    } tensors[] = {
        {"token_embd.weight", 8, 32},       {"output_norm.weight", 8, 0},
        {"blk.0.attn_norm.weight", 8, 0},   {"blk.0.attn_q.weight", 8, 8},
        {"blk.0.attn_k.weight", 8, 8},      {"blk.0.attn_v.weight", 8, 8},
        {"blk.0.attn_output.weight", 8, 8}, {"blk.0.ffn_norm.weight", 8, 0},
        {"blk.0.ffn_gate.weight", 8, 16},   {"blk.0.ffn_up.weight", 8, 16},
        {"blk.0.ffn_down.weight", 16, 8},
    };
    const size_t n_tensors = sizeof tensors / sizeof tensors[0], align = 32;
    struct gguf_buf b = {0};
    gb_begin(&b, n_tensors);
    gb_kv_str(&b, "general.architecture", "llama");
    gb_kv_u32(&b, "llama.block_count", 1);
    gb_kv_u32(&b, "llama.embedding_length", 8);
    gb_kv_u32(&b, "llama.feed_forward_length", 16);
    gb_kv_u32(&b, "llama.attention.head_count", 2);
    gb_kv_u32(&b, "llama.context_length", 64);
    if (x->eps_str)
        gb_kv_str(&b, "llama.attention.layer_norm_rms_epsilon", x->eps_str);
    else if (!x->no_eps)
        gb_kv_f32(&b, "llama.attention.layer_norm_rms_epsilon", x->eps != 0.0f ? x->eps : 1e-5f);
    if (x->freq_base != 0.0f)
        gb_kv_f32(&b, "llama.rope.freq_base", x->freq_base);
    if (x->freq_base_str)
        gb_kv_str(&b, "llama.rope.freq_base", x->freq_base_str);
    if (x->experts)
        gb_kv_u32(&b, "llama.expert_count", (uint32_t)x->experts);
    if (x->scaling_type)
        gb_kv_str(&b, "llama.rope.scaling.type", x->scaling_type);
    if (x->scaling_factor != 0.0f)
        gb_kv_f32(&b, "llama.rope.scaling.factor", x->scaling_factor);
    if (x->n_tokens > 0) {
        gb_kv_str(&b, "tokenizer.ggml.model", x->tok_model ? x->tok_model : "gpt2");
        gb_key(&b, "tokenizer.ggml.tokens", 9);
        gb_u32(&b, 8);
        gb_u64(&b, (uint64_t)x->n_tokens);
        for (int i = 0; i < x->n_tokens; i++) {
            char t[2] = {(char)('A' + i), '\0'};
            gb_str(&b, t);
        }
    }
    gb_end(&b);
    uint64_t off = 0;
    for (size_t i = 0; i < n_tensors; i++) {
        uint64_t rows = tensors[i].ne1 ? tensors[i].ne1 : 1;
        gb_str(&b, tensors[i].name);
        gb_u32(&b, tensors[i].ne1 ? 2 : 1);
        gb_u64(&b, tensors[i].ne0);
        if (tensors[i].ne1)
            gb_u64(&b, tensors[i].ne1);
        gb_u32(&b, 0); /* f32 */
        gb_u64(&b, off);
        off += (tensors[i].ne0 * rows * 4 + align - 1) / align * align;
    }
    while (b.len % align)
        gb_put(&b, "", 1);
    for (size_t i = 0; i < n_tensors; i++) {
        float v = tensors[i].ne1 ? (x->weight != 0.0f ? x->weight : 0.01f) : 1.0f;
        for (uint64_t k = 0; k < tensors[i].ne0 * (tensors[i].ne1 ? tensors[i].ne1 : 1); k++)
            gb_put(&b, &v, 4);
        while (b.len % align)
            gb_put(&b, "", 1);
    }
    char path[] = "/tmp/skv-model-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, b.p, b.len), (ssize_t)b.len);
    close(fd);
    free(b.p);
    return strdup(path);
}

/* Loads the GGUF write_gguf makes of x; the status, the model in *out on SKV_OK. */
static int load_written(const struct gguf_extra *x, struct skv_backend *be, struct skv_model **out)
{
    char *path = write_gguf(x);
    int rc = skv_model_load(path, be, NULL, out);
    unlink(path); /* the mapping stays */
    free(path);
    return rc;
}

/* <arch>.rope.scaling.type as llama.cpp reads it: none; linear (also when the key is absent)
 * dividing positions by rope.scaling.factor (absent or 0: no scaling). yarn, longrope and
 * other types are refused at load, not run without their scaling; so are a negative factor
 * and a theta the rope op would refuse at the first forward. */
static void test_gguf_rope_scaling(void **state)
{
    (void)state;
    static const struct {
        struct gguf_extra x;
        int rc;
        float freq_scale; /* on SKV_OK */
        const char *in_msg; /* otherwise */
    } cases[] = {
        {{NULL, 0.0f, 0.0f, 0, NULL, NULL, 0, false, 0.0f, 0.0f, NULL}, SKV_OK, 1.0f, NULL},
        {{"none", 4.0f, 0.0f, 0, NULL, NULL, 0, false, 0.0f, 0.0f, NULL}, SKV_OK, 1.0f, NULL},
        {{"linear", 4.0f, 0.0f, 0, NULL, NULL, 0, false, 0.0f, 0.0f, NULL}, SKV_OK, 0.25f, NULL},
        {{NULL, 2.0f, 0.0f, 0, NULL, NULL, 0, false, 0.0f, 0.0f, NULL}, SKV_OK, 0.5f, NULL},
        {{"linear", 0.0f, 0.0f, 0, NULL, NULL, 0, false, 0.0f, 0.0f, NULL}, SKV_OK, 1.0f, NULL},
        {{"yarn", 4.0f, 0.0f, 0, NULL, NULL, 0, false, 0.0f, 0.0f, NULL}, SKV_E_UNSUPPORTED, 0.0f, "yarn"},
        {{"longrope", 0.0f, 0.0f, 0, NULL, NULL, 0, false, 0.0f, 0.0f, NULL}, SKV_E_UNSUPPORTED, 0.0f, "longrope"},
        {{"llama3", 8.0f, 0.0f, 0, NULL, NULL, 0, false, 0.0f, 0.0f, NULL}, SKV_E_UNSUPPORTED, 0.0f, "llama3"},
        {{"linear", -2.0f, 0.0f, 0, NULL, NULL, 0, false, 0.0f, 0.0f, NULL}, SKV_E_FORMAT, 0.0f, "rope.scaling.factor"},
        {{NULL, 0.0f, INFINITY, 0, NULL, NULL, 0, false, 0.0f, 0.0f, NULL}, SKV_E_FORMAT, 0.0f, "rope"},
        /* present but unreadable: refused (before, 10000 was used without a word) */
        {{NULL, 0.0f, 0.0f, 0, NULL, "500000", 0, false, 0.0f, 0.0f, NULL}, SKV_E_UNSUPPORTED, 0.0f, "llama.rope.freq_base is present but"},
        {{NULL, 0.0f, 0.0f, 0, NULL, NULL, 8, false, 0.0f, 0.0f, NULL}, SKV_E_UNSUPPORTED, 0.0f, "mixture of experts"},
        /* required, as llama.cpp requires it (before, 1e-5 was taken for any model) */
        {{NULL, 0.0f, 0.0f, 0, NULL, NULL, 0, true, 0.0f, 0.0f, NULL}, SKV_E_FORMAT, 0.0f, "missing llama.attention.layer_norm_rms_epsilon"},
    };
    struct skv_backend *be = NULL;
    assert_int_equal(backend_new(1, &be), SKV_OK);
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        struct skv_model *m = NULL;
        int rc = load_written(&cases[k].x, be, &m);
        if (rc != cases[k].rc)
            fail_msg("case %zu: status %d, %d expected (%s)", k, rc, cases[k].rc, skv_error_msg());
        if (rc != SKV_OK) {
            assert_null(m);
            assert_non_null(strstr(skv_error_msg(), cases[k].in_msg));
            continue;
        }
        assert_float_equal(m->cfg.rope.freq_scale, cases[k].freq_scale, 1e-7);
        assert_null(m->tok);
        if (k == 0) { /* the written model runs */
            struct skv_engine *e = NULL;
            struct skv_kv_cache *cache = NULL;
            float logits[32];
            int32_t ids[3] = {1, 7, 31};
            assert_int_equal(skv_engine_new(m, &e), SKV_OK);
            assert_int_equal(skv_kv_cache_new(m, &cache), SKV_OK);
            assert_int_equal(skv_engine_forward(e, cache, ids, 3, NULL, logits), SKV_OK);
            for (int i = 0; i < 32; i++)
                assert_true(isfinite(logits[i]));
            skv_kv_cache_free(&cache);
            skv_engine_free(&e);
        }
        skv_model_free(&m);
    }
    /* the file's epsilon is the one the norms use (a loader that required the key and kept
     * 1e-5 passed the cases above); one that is not a number is refused */
    struct gguf_extra eps = {.eps = 1e-3f}, eps_str = {.eps_str = "1e-6"};
    struct skv_model *m = NULL;
    assert_int_equal(load_written(&eps, be, &m), SKV_OK);
    assert_true(m->cfg.norm_eps == 1e-3f);
    skv_model_free(&m);
    assert_int_equal(load_written(&eps_str, be, &m), SKV_E_UNSUPPORTED);
    assert_null(m);
    assert_non_null(strstr(skv_error_msg(), "llama.attention.layer_norm_rms_epsilon is present but"));
    skv_backend_destroy(&be);
}

/* A GGUF model's fingerprint covers the config its metadata gives, not only its tensors: two
 * files that differ only in rope.freq_base, or only in the norms' epsilon (same size, same
 * tensors), get other fingerprints, so a restore, LOAD or the store tells their KV apart; their
 * legacy fingerprints (the tensors and the size: what daemons before wrote) were one. */
static void test_gguf_fingerprint_config(void **state)
{
    (void)state;
    struct skv_backend *be = NULL;
    assert_int_equal(backend_new(1, &be), SKV_OK);
    const struct gguf_extra x[3] = {{.freq_base = 10000.0f}, {.freq_base = 500000.0f},
                                    {.freq_base = 10000.0f, .eps = 1e-6f}};
    char fp[3][65], legacy[3][65];
    for (int k = 0; k < 3; k++) {
        struct skv_model *m = NULL;
        assert_int_equal(load_written(&x[k], be, &m), SKV_OK);
        assert_int_equal(strlen(m->fingerprint), 64);
        snprintf(fp[k], sizeof fp[k], "%s", m->fingerprint);
        snprintf(legacy[k], sizeof legacy[k], "%s", m->legacy_fingerprint);
        skv_model_free(&m);
    }
    assert_string_not_equal(fp[0], fp[1]);
    assert_string_not_equal(fp[0], fp[2]);
    assert_string_not_equal(fp[1], fp[2]);
    assert_string_equal(legacy[0], legacy[1]);
    assert_string_equal(legacy[0], legacy[2]);
    assert_string_not_equal(fp[0], legacy[0]);
    struct skv_model *m = NULL; /* the same file: the same fingerprint */
    assert_int_equal(load_written(&x[1], be, &m), SKV_OK);
    assert_string_equal(m->fingerprint, fp[1]);
    skv_model_free(&m);
    skv_backend_destroy(&be);
}

/* A tokenizer must fit the model: more tokens than embedding rows is refused at load (GGUF and
 * Hugging Face folder); fewer is fine, and decoding skips the rows past the tokenizer. */
static void test_tokenizer_fits_model(void **state)
{
    (void)state;
    struct skv_backend *be = NULL;
    struct skv_model *m = NULL;
    assert_int_equal(backend_new(1, &be), SKV_OK);
    struct gguf_extra big = {.n_tokens = 40}, small = {.n_tokens = 20};
    assert_int_equal(load_written(&big, be, &m), SKV_E_FORMAT);
    assert_null(m);
    assert_non_null(strstr(skv_error_msg(), "40 tokens"));
    /* a SentencePiece-style tokenizer (Llama 2, Mistral v0.x) is not one this tokenizer reads:
     * the weights load for token ids, the note says why (before, the model did not load) */
    struct gguf_extra spm = {.n_tokens = 20, .tok_model = "llama"};
    assert_int_equal(load_written(&spm, be, &m), SKV_OK);
    assert_null(m->tok);
    assert_non_null(strstr(m->tok_note, "tokenizer.ggml.model 'llama'"));
    skv_model_free(&m);
    assert_int_equal(load_written(&small, be, &m), SKV_OK);
    assert_int_equal(m->cfg.n_vocab, 32);
    assert_string_equal(m->tok_note, "");
    assert_int_equal(skv_tokenizer_n_vocab(m->tok), 20);
    int32_t ids[4] = {5, 25, 31, 19}; /* F, two rows past the tokenizer, T */
    char *text = NULL;
    assert_int_equal(skv_tokenizer_decode(m->tok, ids, 4, &text), SKV_OK);
    assert_string_equal(text, "FT");
    free(text);
    skv_model_free(&m);

    /* tiny-llama's 320 rows with the 1201-token tiny tokenizer next to them */
    char *dir = fixture_stage_dir("tests/fixtures/tiny-llama");
    assert_non_null(dir);
    size_t size = 0;
    char *tj = fixture_read("tests/fixtures/tok_tiny/tokenizer.json", &size);
    assert_non_null(tj);
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(tj, 1, size, fp), size);
    fclose(fp);
    free(tj);
    assert_int_equal(skv_model_load(dir, be, NULL, &m), SKV_E_FORMAT);
    assert_null(m);
    assert_non_null(strstr(skv_error_msg(), "1201 tokens"));
    fixture_remove_dir(dir);
    skv_backend_destroy(&be);
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
    assert_int_equal(backend_new(1, &be), SKV_OK);
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

/* A batched decode step equals separate forwards: 40 sessions of different lengths on the
 * default model (quantized weights: the integer GEMV path with several columns; more sessions
 * than it takes at once, so the batch is cut in groups), one of them evicting while it decodes
 * (StreamingLLM through the compression hook). */
static void test_decode_batch_matches_single(void **state)
{
    (void)state;
    char *path = fixture_model_path();
    if (!path) {
        free(path);
        skip();
    }
    enum { NS = 40, STEPS = 6 };
    int lens[NS] = {5, 40, 150, 1};
    for (int s = 4; s < NS; s++)
        lens[s] = 2 + (s * 37) % 100;
    struct skv_backend *be = NULL;
    struct skv_model *m = NULL;
    struct skv_engine *e = NULL;
    assert_int_equal(backend_new(2, &be), SKV_OK);
    assert_int_equal(skv_model_load(path, be, NULL, &m), SKV_OK);
    assert_int_equal(skv_engine_new(m, &e), SKV_OK);
    const int nv = m->cfg.n_vocab;
    struct skv_kv_cache *one[NS], *bat[NS];
    struct skv_compressor *c_one = NULL, *c_bat = NULL, *h_one_c = NULL, *h_bat_c = NULL;
    struct skv_compress_spec spec;
    assert_int_equal(skv_compress_spec_parse("policy=streaming,budget=48,sinks=4", &spec), SKV_OK);
    assert_int_equal(skv_compressor_new(&spec, m, &c_one), SKV_OK);
    assert_int_equal(skv_compressor_new(&spec, m, &c_bat), SKV_OK);
    /* sequence 4: H2O, scored by the probabilities the attention gives (attention_probs) */
    assert_int_equal(skv_compress_spec_parse("policy=h2o,budget=32,window=8", &spec), SKV_OK);
    assert_int_equal(skv_compressor_new(&spec, m, &h_one_c), SKV_OK);
    assert_int_equal(skv_compressor_new(&spec, m, &h_bat_c), SKV_OK);
    assert_true(skv_compressor_wants_probs(h_one_c) && !skv_compressor_wants_probs(c_one));
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
        if (s == 2 || s == 4) { /* the compressed ones */
            struct skv_compressor *co = s == 2 ? c_one : h_one_c, *cb = s == 2 ? c_bat : h_bat_c;
            struct skv_forward_opts o1 = {.hook = skv_compressor_hook, .hook_user = co};
            struct skv_forward_opts o2 = {.hook = skv_compressor_hook, .hook_user = cb};
            assert_int_equal(skv_compressor_begin(co, one[s], lens[s]), SKV_OK);
            assert_int_equal(skv_engine_forward(e, one[s], ids, lens[s], &o1, lo + (size_t)s * nv), SKV_OK);
            assert_int_equal(skv_compressor_finish(co, one[s]), SKV_OK);
            assert_int_equal(skv_compressor_begin(cb, bat[s], lens[s]), SKV_OK);
            assert_int_equal(skv_engine_forward(e, bat[s], ids, lens[s], &o2, lb + (size_t)s * nv), SKV_OK);
            assert_int_equal(skv_compressor_finish(cb, bat[s]), SKV_OK);
        } else {
            assert_int_equal(skv_engine_forward(e, one[s], ids, lens[s], NULL, lo + (size_t)s * nv), SKV_OK);
            assert_int_equal(skv_engine_forward(e, bat[s], ids, lens[s], NULL, lb + (size_t)s * nv), SKV_OK);
        }
    }
    struct skv_forward_opts h_one = {.hook = skv_compressor_hook, .hook_user = c_one};
    struct skv_forward_opts h_bat = {.hook = skv_compressor_hook, .hook_user = c_bat};
    struct skv_forward_opts p_one = {.hook = skv_compressor_hook, .hook_user = h_one_c, .attention_probs = true};
    struct skv_forward_opts p_bat = {.hook = skv_compressor_hook, .hook_user = h_bat_c, .attention_probs = true};
    for (int step = 0; step < STEPS; step++) {
        struct skv_batch_seq seqs[NS];
        for (int s = 0; s < NS; s++) {
            /* greedy from the single-sequence logits; the batch must agree */
            const float *a = lo + (size_t)s * nv, *b = lb + (size_t)s * nv;
            int best = 0;
            for (int i = 1; i < nv; i++)
                best = a[i] > a[best] ? i : best;
            for (int i = 0; i < nv; i++)
                if (memcmp(&a[i], &b[i], sizeof a[i]) != 0) /* bit for bit */
                    fail_msg("step %d sequence %d logit %d: single %g batch %g", step, s, i, a[i], b[i]);
            next[s] = best;
            const struct skv_forward_opts *o = s == 2 ? &h_bat : s == 4 ? &p_bat : NULL;
            seqs[s] = (struct skv_batch_seq){bat[s], best, o, lb + (size_t)s * nv};
        }
        for (int s = 0; s < NS; s++) {
            if (s == 2)
                assert_int_equal(skv_compressor_begin_decode(c_one, one[s]), SKV_OK);
            if (s == 4)
                assert_int_equal(skv_compressor_begin_decode(h_one_c, one[s]), SKV_OK);
            assert_int_equal(skv_engine_forward(e, one[s], &next[s], 1, s == 2 ? &h_one : s == 4 ? &p_one : NULL,
                                                lo + (size_t)s * nv),
                             SKV_OK);
        }
        assert_int_equal(skv_compressor_begin_decode(c_bat, bat[2]), SKV_OK);
        assert_int_equal(skv_compressor_begin_decode(h_bat_c, bat[4]), SKV_OK);
        assert_int_equal(skv_engine_decode_batch(e, seqs, NS), SKV_OK);
        for (int s = 0; s < NS; s++) {
            assert_int_equal(bat[s]->n_past, one[s]->n_past);
            assert_int_equal(skv_kv_cache_head(bat[s], 7, 1)->len, skv_kv_cache_head(one[s], 7, 1)->len);
        }
    }
    assert_int_equal(skv_kv_cache_head(bat[2], 0, 0)->len, 48); /* kept evicting */
    for (int l = 0; l < bat[4]->n_layers; l++) /* H2O too, the same rows in both */
        for (int h = 0; h < bat[4]->n_kv_heads; h++) {
            const struct skv_kv_head *a = skv_kv_cache_head(one[4], l, h), *b = skv_kv_cache_head(bat[4], l, h);
            assert_true(b->len <= 32 + 1);
            assert_int_equal(a->len, b->len);
            assert_memory_equal(a->pos, b->pos, (size_t)a->len * sizeof *a->pos);
        }
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
    skv_compressor_free(&h_one_c);
    skv_compressor_free(&h_bat_c);
    free(lo);
    free(lb);
    skv_engine_free(&e);
    skv_model_free(&m);
    skv_backend_destroy(&be);
    free(path);
}

/* rows of d values of x (n rows) as a cache of kv_type holds them, into out */
static void kv_rounded(float *out, const float *x, int n, int d, int kv_type)
{
    for (size_t i = 0; i < (size_t)n * d; i++)
        out[i] = skv_fp16_to_f32(skv_f32_to_fp16_sat(x[i]));
    if (kv_type != SKV_DTYPE_Q8_0)
        return;
    unsigned char q[1024];
    assert_true(skv_kv_row_bytes(kv_type, d) <= sizeof q);
    for (int i = 0; i < n; i++) {
        skv_quantize_row_q8_0(q, x + (size_t)i * d, d);
        assert_int_equal(skv_dequantize_row(SKV_DTYPE_Q8_0, q, out + (size_t)i * d, d), SKV_OK);
    }
}

/* kv-type f16 (or q8_0) on the real model: a pool of half (17/64) the bytes a block; layer 0's
 * stored rows are exactly the f32 cache's rounded to the type (nothing before them differs); rows
 * written and read on the host round and widen; a compaction moves typed rows intact; a decode
 * group of typed caches gives each one's own logits bit for bit; and the model's outputs stay
 * close to the f32 cache's (logit error, and 24 greedy tokens of a natural prompt the same). */
static void kv_typed_model(int kv_type, double max_logit_diff)
{
    char *path = fixture_model_path();
    if (!path) {
        free(path);
        skip();
    }
    struct skv_backend *be = NULL;
    struct skv_model *m = NULL;
    struct skv_engine *e = NULL;
    assert_int_equal(backend_new(2, &be), SKV_OK);
    assert_int_equal(skv_model_load(path, be, NULL, &m), SKV_OK);
    assert_int_equal(skv_engine_new(m, &e), SKV_OK);
    const int nv = m->cfg.n_vocab, d = m->cfg.head_dim;
    const size_t block32 = skv_kv_pool_block_bytes(m->kv_pool);
    struct skv_kv_cache *c32 = NULL, *c16 = NULL, *g16 = NULL;
    assert_int_equal(skv_kv_cache_new(m, &c32), SKV_OK);
    assert_int_equal(skv_model_set_kv_pool(m, SKV_KV_BLOCK_ROWS, 99), SKV_E_INVAL);
    assert_int_equal(skv_model_set_kv_pool(m, SKV_KV_BLOCK_ROWS, kv_type), SKV_OK);
    const size_t row32 = (size_t)d * sizeof(float), row = skv_kv_row_bytes(kv_type, d);
    assert_int_equal(skv_kv_pool_block_bytes(m->kv_pool) * row32, block32 * row); /* f16 1/2, q8_0 17/64 */
    assert_int_equal(skv_kv_cache_new(m, &c16), SKV_OK);
    assert_int_equal(skv_kv_cache_new(m, &g16), SKV_OK);
    assert_int_equal(c16->kv_type, kv_type);

    static const char text[] =
        "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
        "Rome was not built in a day, and neither was the library of Alexandria, which held scrolls from all over "
        "the known world. Scholars came from far away to read them, copy them and argue about what they meant. "
        "Today we remember the library as a symbol of learning. The capital of France is";
    int32_t ids[256], n = 0;
    assert_int_equal(skv_tokenizer_encode(m->tok, text, strlen(text), false, false, ids, 256, &n), SKV_OK);
    assert_true(n > 60);
    float *l32 = malloc((size_t)nv * sizeof *l32), *l16 = malloc((size_t)nv * sizeof *l16);
    float *lg = malloc((size_t)nv * sizeof *lg);
    assert_non_null(l32);
    assert_non_null(l16);
    assert_non_null(lg);
    assert_int_equal(skv_engine_forward(e, c32, ids, n, NULL, l32), SKV_OK);
    assert_int_equal(skv_engine_forward(e, c16, ids, n, NULL, l16), SKV_OK);
    assert_int_equal(skv_engine_forward(e, g16, ids, n - 7, NULL, lg), SKV_OK);
    assert_int_equal(skv_kv_cache_bytes(c16) * row32, skv_kv_cache_bytes(c32) * row);

    /* layer 0: the same inputs, so the typed rows are the f32 rows rounded */
    float *a = malloc((size_t)n * d * sizeof *a), *b = malloc((size_t)n * d * sizeof *b);
    float *r = malloc((size_t)n * d * sizeof *r);
    assert_non_null(a);
    assert_non_null(b);
    assert_non_null(r);
    for (int h = 0; h < m->cfg.n_kv_heads; h++)
        for (int which = 0; which < 2; which++) {
            assert_int_equal(skv_kv_cache_read_rows(c32, 0, h, which, 0, n, a), SKV_OK);
            assert_int_equal(skv_kv_cache_read_rows(c16, 0, h, which, 0, n, b), SKV_OK);
            kv_rounded(r, a, n, d, kv_type);
            for (int i = 0; i < n * d; i++)
                if (memcmp(&b[i], &r[i], sizeof(float)) != 0)
                    fail_msg("layer 0 head %d %s value %d: f32 %.9g, %s cache %.9g", h, which ? "V" : "K", i, a[i],
                             skv_dtype_name(kv_type), b[i]);
        }
    /* the host's rows: written rounded, read widened */
    struct skv_kv_cache *w16 = NULL;
    assert_int_equal(skv_kv_cache_new(m, &w16), SKV_OK);
    a[1] = 1e6f; /* past f16's range: saturates, stays finite */
    a[2] = -70000.0f;
    assert_int_equal(skv_kv_cache_write_rows(w16, 3, 1, 1, 0, n, a), SKV_OK); /* several blocks: staged */
    assert_int_equal(skv_kv_cache_read_rows(w16, 3, 1, 1, 0, n, b), SKV_OK);
    kv_rounded(r, a, n, d, kv_type);
    assert_memory_equal(b, r, (size_t)n * d * sizeof(float));
    if (kv_type == SKV_DTYPE_F16)
        assert_true(b[1] == 65504.0f && b[2] == -65504.0f);
    else /* q8_0: the block's largest value is kept as 127 d */
        assert_true(fabsf(b[1] - 1e6f) < 1e6f * 1e-3f);
    /* a compaction moves whole typed rows */
    struct skv_kv_cache *k16 = NULL;
    assert_int_equal(skv_kv_cache_clone(c16, &k16), SKV_OK);
    int32_t keep[40];
    for (int i = 0; i < 40; i++)
        keep[i] = i * (n - 1) / 39;
    assert_int_equal(skv_kv_cache_read_rows(c16, 5, 0, 1, 0, n, a), SKV_OK);
    assert_int_equal(skv_kv_cache_compact(k16, 5, 0, keep, 40), SKV_OK);
    assert_int_equal(skv_kv_cache_read_rows(k16, 5, 0, 1, 0, 40, b), SKV_OK);
    for (int i = 0; i < 40; i++)
        assert_memory_equal(b + (size_t)i * d, a + (size_t)keep[i] * d, (size_t)d * sizeof(float));
    skv_kv_cache_free(&k16);
    skv_kv_cache_free(&w16);

    /* next-token logits close to the f32 cache's, and greedy decoding that agrees */
    double worst = 0;
    int best32 = 0, best16 = 0;
    for (int i = 0; i < nv; i++) {
        double diff = fabs((double)l32[i] - l16[i]);
        worst = diff > worst ? diff : worst;
        best32 = l32[i] > l32[best32] ? i : best32;
        best16 = l16[i] > l16[best16] ? i : best16;
    }
    print_message("%s KV: largest logit difference %.4f at %d tokens\n", skv_dtype_name(kv_type), worst, n);
    assert_true(worst < max_logit_diff);
    int agree = 0;
    for (int step = 0; step < 24; step++) {
        assert_int_equal(best16, best32);
        agree++;
        int32_t t32 = best32, t16 = best16;
        /* the typed cache in a decode group with another: its own logits, bit for bit */
        int bg = 0;
        for (int i = 1; i < nv; i++)
            bg = lg[i] > lg[bg] ? i : bg;
        struct skv_kv_cache *single = NULL;
        assert_int_equal(skv_kv_cache_clone(c16, &single), SKV_OK);
        struct skv_batch_seq seqs[2] = {{c16, t16, NULL, l16}, {g16, bg, NULL, lg}};
        assert_int_equal(skv_engine_decode_batch(e, seqs, 2), SKV_OK);
        float *alone = malloc((size_t)nv * sizeof *alone);
        assert_non_null(alone);
        assert_int_equal(skv_engine_forward(e, single, &t16, 1, NULL, alone), SKV_OK);
        assert_memory_equal(alone, l16, (size_t)nv * sizeof(float));
        free(alone);
        skv_kv_cache_free(&single);
        assert_int_equal(skv_engine_forward(e, c32, &t32, 1, NULL, l32), SKV_OK);
        best32 = best16 = 0;
        for (int i = 1; i < nv; i++) {
            best32 = l32[i] > l32[best32] ? i : best32;
            best16 = l16[i] > l16[best16] ? i : best16;
        }
    }
    assert_int_equal(agree, 24);
    free(a);
    free(b);
    free(r);
    free(l32);
    free(l16);
    free(lg);
    skv_kv_cache_free(&c32);
    skv_kv_cache_free(&c16);
    skv_kv_cache_free(&g16);
    skv_engine_free(&e);
    skv_model_free(&m);
    skv_backend_destroy(&be);
    free(path);
}

static void test_kv_f16(void **state)
{
    (void)state;
    kv_typed_model(SKV_DTYPE_F16, 0.1);
}

/* The same for kv-type q8_0: 17/64 of the bytes, every 32 values of a row quantized as GGUF's
 * Q8_0 (test_ops test_kv_q8_0 checks the quantizer against gguf-py). */
static void test_kv_q8_0(void **state)
{
    (void)state;
    kv_typed_model(SKV_DTYPE_Q8_0, 0.5);
}

static void test_load_errors(void **state)
{
    (void)state;
    struct skv_backend *be = NULL;
    struct skv_model *m = NULL;
    assert_int_equal(backend_new(1, &be), SKV_OK);
    assert_int_equal(skv_model_load("/nonexistent/model.gguf", be, NULL, &m), SKV_E_NOT_FOUND);
    assert_null(m);
    char *types = fixture_path("tests/fixtures/types.gguf.fixture");
    int rc = skv_model_load(types, be, NULL, &m); /* a GGUF without a model in it */
    assert_true(rc == SKV_E_FORMAT || rc == SKV_E_UNSUPPORTED || rc == SKV_E_NOT_FOUND);
    assert_null(m);
    free(types);
    skv_backend_destroy(&be);
}

/* The CUDA group: the forward tests again on device 0. */
static int cuda_group_setup(void **state)
{
    (void)state;
    struct skv_backend *be = NULL;
    g_cuda = true;
    g_cuda_ok = skv_backend_cuda_new(0, &be) == SKV_OK;
    if (!g_cuda_ok)
        printf("# CUDA group skipped: %s\n", skv_error_msg());
    skv_backend_destroy(&be);
    return 0;
}

/* The model's name goes out in HELLO and STATUS (UTF-8 `string` fields): a folder named with a
 * byte that is not UTF-8 and 100 two-byte characters gives a name with U+FFFD for the byte, cut
 * at a character's end within 127 bytes. */
static void test_name_is_text(void **state)
{
    (void)state;
    char *dir = fixture_stage_dir("tests/fixtures/tiny-llama");
    assert_non_null(dir);
    char odd[512];
    int n = snprintf(odd, sizeof odd, "%s-ab\xff", dir);
    for (int i = 0; i < 100; i++)
        n += snprintf(odd + n, sizeof odd - (size_t)n, "\xc3\xa9"); /* é */
    assert_int_equal(rename(dir, odd), 0);
    struct skv_backend *be = NULL;
    struct skv_model *m = NULL;
    assert_int_equal(skv_backend_cpu_new(1, &be), SKV_OK);
    int rc = skv_model_load(odd, be, NULL, &m);
    assert_int_equal(rename(odd, dir), 0);
    char base[64];
    snprintf(base, sizeof base, "%s", strrchr(dir, '/') + 1);
    fixture_remove_dir(dir); /* frees dir */
    assert_int_equal(rc, SKV_OK);
    const char *name = skv_model_name(m);
    size_t len = strlen(name), head = strlen(base);
    assert_memory_equal(name, base, head);
    assert_memory_equal(name + head, "-ab\xef\xbf\xbd", 6);
    assert_true(len <= 127 && len > 120);
    assert_int_equal((len - head - 6) % 2, 0); /* whole é's */
    for (size_t i = head + 6; i < len; i += 2)
        assert_memory_equal(name + i, "\xc3\xa9", 2);
    skv_model_free(&m);
    skv_backend_destroy(&be);
}

#define ON_CUDA(fn)                                                                               \
    static void fn##_cuda(void **state)                                                           \
    {                                                                                             \
        if (!g_cuda_ok)                                                                           \
            skip();                                                                               \
        fn(state);                                                                                \
    }
static void count_tick(void *user)
{
    (*(int *)user)++;
}

/* Every K and V row of two caches are the same bits. */
static void expect_same_cache(const struct skv_kv_cache *a, const struct skv_kv_cache *b)
{
    assert_int_equal(a->n_past, b->n_past);
    for (int l = 0; l < a->n_layers; l++)
        for (int h = 0; h < a->n_kv_heads; h++) {
            const struct skv_kv_head *x = &a->heads[l * a->n_kv_heads + h], *y = &b->heads[l * b->n_kv_heads + h];
            assert_int_equal(x->len, y->len);
            size_t floats = (size_t)x->len * a->head_dim;
            float *u = malloc((floats ? floats : 1) * sizeof *u), *v = malloc((floats ? floats : 1) * sizeof *v);
            for (int kv = 0; kv < 2; kv++) {
                assert_int_equal(skv_kv_cache_read_rows(a, l, h, kv, 0, x->len, u), SKV_OK);
                assert_int_equal(skv_kv_cache_read_rows(b, l, h, kv, 0, y->len, v), SKV_OK);
                assert_memory_equal(u, v, floats * sizeof *u);
            }
            free(u);
            free(v);
        }
}

/* A forward with a tick (a long request in the daemon, which runs decode rounds there) cuts
 * its attention into calls of about 256 queries where the backend says that is exact: on the
 * default model (g = 3: calls of 252) and a sliding-window one, the logits and the cache are
 * the bits of a forward without a tick, also for a chunk after a prefix. */
static void test_tick_matches_plain(void **state)
{
    (void)state;
    char *gguf = fixture_model_path();
    char *swa = fixture_stage_dir("tests/fixtures/tiny-mistral-swa");
    assert_non_null(swa);
    const char *paths[2] = {swa, gguf};
    for (int k = 0; k < 2 && paths[k]; k++) {
        struct skv_backend *be = NULL;
        struct skv_model *m = NULL;
        struct skv_engine *e = NULL;
        assert_int_equal(backend_new(2, &be), SKV_OK);
        assert_int_equal(skv_model_load(paths[k], be, NULL, &m), SKV_OK);
        assert_int_equal(skv_engine_new(m, &e), SKV_OK);
        enum { N = 700, P = 100 };
        const int nv = m->cfg.n_vocab;
        int32_t ids[N];
        for (int i = 0; i < N; i++)
            ids[i] = (i * 131 + 7) % nv;
        float *a = malloc((size_t)nv * sizeof *a), *b = malloc((size_t)nv * sizeof *b);
        struct skv_kv_cache *c = NULL, *ref = NULL;
        assert_int_equal(skv_kv_cache_new(m, &c), SKV_OK);
        assert_int_equal(skv_kv_cache_new(m, &ref), SKV_OK);
        int ticks = 0;
        struct skv_forward_opts ticking = {.tick = count_tick, .tick_user = &ticks};
        assert_int_equal(skv_engine_forward(e, ref, ids, P, NULL, b), SKV_OK);
        assert_int_equal(skv_engine_forward(e, c, ids, P, &ticking, a), SKV_OK);
        assert_int_equal(skv_engine_forward(e, ref, ids + P, N - P, NULL, b), SKV_OK);
        assert_int_equal(skv_engine_forward(e, c, ids + P, N - P, &ticking, a), SKV_OK);
        printf("# %s (%s): %d ticks\n", m->name, be->name, ticks);
        assert_true(ticks > 0);
        assert_memory_equal(a, b, (size_t)nv * sizeof *a);
        expect_same_cache(c, ref);
        skv_kv_cache_free(&c);
        skv_kv_cache_free(&ref);
        free(a);
        free(b);
        skv_engine_free(&e);
        skv_model_free(&m);
        skv_backend_destroy(&be);
    }
    free(gguf);
    fixture_remove_dir(swa);
}

/* A backend that multiplies with f32 and f16 weights only: the model converts the rest to f16
 * as it copies them into backend memory (the CUDA backend and K-quants), and the logits stay
 * those of the CPU backend reading the file's types, within f16's rounding of the weights. */
static bool f16_f32_only(int type)
{
    return type == SKV_DTYPE_F32 || type == SKV_DTYPE_F16;
}

static bool f16_only(int type)
{
    return type == SKV_DTYPE_F16;
}

/* dev: cpu's memory and ops, copied as a device's that multiplies with the types ok takes (ops
 * holds its table; dev is not destroyed: cpu is). */
static void fake_device(struct skv_backend *cpu, bool (*ok)(int), struct skv_backend_ops *ops,
                        struct skv_backend *dev)
{
    *ops = *cpu->ops;
    ops->weight_type_ok = ok;
    *dev = *cpu;
    dev->name = "f16-device";
    dev->ops = ops;
}

/* A weight past f16's range (65504) is refused when it must be converted to f16 for a backend
 * (before, it became infinite there, and every row it touched NaN, where the CPU stayed finite);
 * within the range it is converted. */
static void test_weights_f16_range(void **state)
{
    (void)state;
    struct skv_backend *cpu = NULL;
    assert_int_equal(skv_backend_cpu_new(1, &cpu), SKV_OK);
    struct skv_backend_ops ops;
    struct skv_backend dev;
    fake_device(cpu, f16_only, &ops, &dev);
    struct gguf_extra big = {.weight = 1e5f}, over = {.weight = 65505.0f};
    struct skv_model *m = NULL;
    assert_int_equal(load_written(&big, &dev, &m), SKV_E_FORMAT);
    assert_null(m);
    assert_non_null(strstr(skv_error_msg(), "past f16's range"));
    assert_int_equal(load_written(&over, &dev, &m), SKV_E_FORMAT); /* just past f16's largest */
    assert_null(m);
    /* within the range: converted to the f16 of the value (the dev's memory is the host's), up
     * to f16's largest, 65504 */
    static const struct {
        float value;
        uint16_t bits;
    } fine[] = {{60000.0f, 0x7B53}, {65504.0f, 0x7BFF}, {-65504.0f, 0xFBFF}};
    for (size_t k = 0; k < sizeof fine / sizeof fine[0]; k++) {
        struct gguf_extra x = {.weight = fine[k].value};
        assert_int_equal(load_written(&x, &dev, &m), SKV_OK);
        assert_int_equal(m->layers[0].wq.type, SKV_DTYPE_F16);
        const uint16_t *h = m->layers[0].wq.data;
        for (int i = 0; i < 64; i++) /* 8 x 8 */
            if (h[i] != fine[k].bits)
                fail_msg("%g: element %d converted to 0x%04x, 0x%04x expected", (double)fine[k].value, i, h[i],
                         fine[k].bits);
        skv_model_free(&m);
    }
    assert_int_equal(load_written(&big, cpu, &m), SKV_OK); /* the CPU reads f32 as it is */
    skv_model_free(&m);
    skv_backend_destroy(&cpu);
}

static void test_weights_converted(void **state)
{
    (void)state;
    char *path = fixture_model_path();
    if (!path)
        skip();
    struct skv_backend *cpu = NULL;
    assert_int_equal(skv_backend_cpu_new(2, &cpu), SKV_OK);
    struct skv_backend_ops ops;
    struct skv_backend dev;
    fake_device(cpu, f16_f32_only, &ops, &dev);
    struct skv_model *m[2] = {NULL, NULL};
    assert_int_equal(skv_model_load(path, cpu, NULL, &m[0]), SKV_OK);
    assert_int_equal(skv_model_load(path, &dev, NULL, &m[1]), SKV_OK);
    assert_false(f16_f32_only(m[0]->layers[0].wq.type)); /* a quantized file */
    assert_int_equal(m[1]->layers[0].wq.type, SKV_DTYPE_F16);
    assert_int_equal(m[1]->tok_embd.type, SKV_DTYPE_F16);
    const int nv = m[0]->cfg.n_vocab;
    int32_t ids[12];
    for (int i = 0; i < 12; i++)
        ids[i] = (int32_t)(100 + 997 * i) % nv;
    float *lg[2];
    for (int k = 0; k < 2; k++) {
        struct skv_engine *e = NULL;
        struct skv_kv_cache *c = NULL;
        lg[k] = malloc((size_t)nv * sizeof *lg[k]);
        assert_non_null(lg[k]);
        assert_int_equal(skv_engine_new(m[k], &e), SKV_OK);
        assert_int_equal(skv_kv_cache_new(m[k], &c), SKV_OK);
        assert_int_equal(skv_engine_forward(e, c, ids, 12, NULL, lg[k]), SKV_OK);
        skv_kv_cache_free(&c);
        skv_engine_free(&e);
    }
    double max_ref = 0, max_diff = 0;
    int best[2] = {0, 0};
    for (int i = 0; i < nv; i++) {
        max_ref = fmax(max_ref, fabs(lg[0][i]));
        max_diff = fmax(max_diff, fabs(lg[0][i] - lg[1][i]));
        for (int k = 0; k < 2; k++)
            if (lg[k][i] > lg[k][best[k]])
                best[k] = i;
    }
    printf("converted to f16: max |logit| %.3f, max diff %.5f\n", max_ref, max_diff);
    assert_true(max_diff > 0); /* it did run on the converted weights */
    assert_true(max_diff < 0.01 * max_ref);
    assert_int_equal(best[0], best[1]);
    for (int k = 0; k < 2; k++) {
        free(lg[k]);
        skv_model_free(&m[k]);
    }
    skv_backend_destroy(&cpu);
    free(path);
}

static void v5_theta(json_t *root)
{
    json_object_del(root, "rope_theta");
    json_object_set_new(root, "rope_parameters",
                        json_pack("{s:f, s:s}", "rope_theta", 500000.0, "rope_type", "default"));
}

static void v5_yarn(json_t *root)
{
    json_object_set_new(root, "rope_parameters",
                        json_pack("{s:f, s:s, s:f}", "rope_theta", 10000.0, "rope_type", "yarn", "factor", 4.0));
}

static void v5_per_layer(json_t *root)
{
    json_object_set_new(root, "rope_parameters",
                        json_pack("{s:{s:f, s:s}}", "full_attention", "rope_theta", 10000.0, "rope_type", "default"));
}

static void gelu(json_t *root)
{
    json_object_set_new(root, "hidden_act", json_string("gelu"));
}

/* What a Hugging Face folder's config and tensors say that the engine cannot compute is
 * refused, where it loaded and computed other logits without a word: transformers 5's
 * rope_parameters (its theta was ignored: 10000 was used), a rope type there that is not
 * supported, hidden_act other than silu, and a tensor no weight uses (an o_proj bias). Two
 * folders with one config and other weights get other fingerprints (a restore tells them apart). */
static void test_hf_config_checks(void **state)
{
    (void)state;
    struct skv_model *m = NULL;
    struct skv_backend *be = NULL;
    char *dir = NULL;
    assert_int_equal(skv_backend_cpu_new(1, &be), SKV_OK);
    assert_int_equal(load_config_edited("tests/fixtures/tiny-llama", v5_theta, be, &m, &dir), SKV_OK);
    assert_true(m->cfg.rope.theta == 500000.0f);
    skv_model_free(&m);
    fixture_remove_dir(dir);
    void (*bad[3])(json_t *) = {v5_yarn, v5_per_layer, gelu};
    const char *why[3] = {"rope_scaling type 'yarn' is not supported", "rope_parameters per layer type",
                          "hidden_act 'gelu' is not supported"};
    for (int k = 0; k < 3; k++) {
        assert_int_equal(load_config_edited("tests/fixtures/tiny-llama", bad[k], be, &m, &dir), SKV_E_UNSUPPORTED);
        assert_null(m);
        if (!strstr(skv_error_msg(), why[k]))
            fail_msg("%s", skv_error_msg());
        fixture_remove_dir(dir);
    }

    /* an extra shard holding model.layers.0.self_attn.o_proj.bias, named in the index */
    dir = fixture_stage_dir("tests/fixtures/tiny-llama-sharded");
    assert_non_null(dir);
    char path[1024];
    snprintf(path, sizeof path, "%s/extra.safetensors", dir);
    const char *hdr = "{\"model.layers.0.self_attn.o_proj.bias\":{\"dtype\":\"F32\",\"shape\":[64],"
                      "\"data_offsets\":[0,256]}}";
    uint64_t hlen = strlen(hdr);
    float bias[64] = {0};
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(&hlen, 8, 1, fp), 1);
    assert_int_equal(fwrite(hdr, 1, hlen, fp), hlen);
    assert_int_equal(fwrite(bias, sizeof bias, 1, fp), 1);
    fclose(fp);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    json_t *idx = json_load_file(path, 0, NULL);
    assert_non_null(idx);
    json_object_set_new(json_object_get(idx, "weight_map"), "model.layers.0.self_attn.o_proj.bias",
                        json_string("extra.safetensors"));
    assert_int_equal(json_dump_file(idx, path, JSON_INDENT(1)), 0);
    json_decref(idx);
    assert_int_equal(skv_model_load(dir, be, NULL, &m), SKV_E_UNSUPPORTED);
    if (!strstr(skv_error_msg(), "tensor model.layers.0.self_attn.o_proj.bias is not one this engine computes with"))
        fail_msg("%s", skv_error_msg());
    fixture_remove_dir(dir);

    /* one config, one weight changed: two fingerprints */
    char fp0[65], fp1[65];
    for (int k = 0; k < 2; k++) {
        dir = fixture_stage_dir("tests/fixtures/tiny-llama");
        assert_non_null(dir);
        if (k) { /* the first tensor's first byte (after the 8-byte length and the header) */
            snprintf(path, sizeof path, "%s/model.safetensors", dir);
            fp = fopen(path, "r+b");
            assert_non_null(fp);
            assert_int_equal(fread(&hlen, 8, 1, fp), 1);
            assert_int_equal(fseek(fp, (long)(8 + hlen), SEEK_SET), 0);
            int c = fgetc(fp);
            assert_int_equal(fseek(fp, (long)(8 + hlen), SEEK_SET), 0);
            fputc(c ^ 0x40, fp);
            fclose(fp);
        }
        assert_int_equal(skv_model_load(dir, be, NULL, &m), SKV_OK);
        snprintf(k ? fp1 : fp0, 65, "%s", m->fingerprint);
        skv_model_free(&m);
        fixture_remove_dir(dir);
    }
    assert_string_not_equal(fp0, fp1);
    skv_backend_destroy(&be);
}

ON_CUDA(test_tiny_llama)
ON_CUDA(test_tiny_llama_bf16)
ON_CUDA(test_tiny_qwen2)
ON_CUDA(test_tiny_llama3_rope)
ON_CUDA(test_tiny_mistral_swa)
ON_CUDA(test_tiny_qwen2_swa)
ON_CUDA(test_incremental_matches_full)
ON_CUDA(test_decode_batch_matches_single)
ON_CUDA(test_swa_compacted_cache)
ON_CUDA(test_tick_matches_plain)
#undef ON_CUDA

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiny_llama),        cmocka_unit_test(test_tiny_llama_sharded),
        cmocka_unit_test(test_tiny_llama_bf16),   cmocka_unit_test(test_tiny_qwen2),
        cmocka_unit_test(test_tiny_llama3_rope),  cmocka_unit_test(test_incremental_matches_full),
        cmocka_unit_test(test_decode_batch_matches_single), cmocka_unit_test(test_kv_f16),
        cmocka_unit_test(test_kv_q8_0),
        cmocka_unit_test(test_load_errors),       cmocka_unit_test(test_gguf_rope_freqs),
        cmocka_unit_test(test_tiny_mistral_swa),  cmocka_unit_test(test_tiny_qwen2_swa),
        cmocka_unit_test(test_swa_config),        cmocka_unit_test(test_swa_compacted_cache),
        cmocka_unit_test(test_hf_rope_config),    cmocka_unit_test(test_gguf_rope_scaling),
        cmocka_unit_test(test_gguf_fingerprint_config),
        cmocka_unit_test(test_tokenizer_fits_model), cmocka_unit_test(test_tick_matches_plain),
        cmocka_unit_test(test_weights_converted),
        cmocka_unit_test(test_weights_f16_range),  cmocka_unit_test(test_hf_config_checks),
        cmocka_unit_test(test_name_is_text),
    };
    const struct CMUnitTest cuda[] = {
        cmocka_unit_test(test_tiny_llama_cuda),        cmocka_unit_test(test_tiny_llama_bf16_cuda),
        cmocka_unit_test(test_tiny_qwen2_cuda),        cmocka_unit_test(test_tiny_llama3_rope_cuda),
        cmocka_unit_test(test_tiny_mistral_swa_cuda),  cmocka_unit_test(test_tiny_qwen2_swa_cuda),
        cmocka_unit_test(test_incremental_matches_full_cuda),
        cmocka_unit_test(test_decode_batch_matches_single_cuda),
        cmocka_unit_test(test_swa_compacted_cache_cuda),
        cmocka_unit_test(test_tick_matches_plain_cuda),
    };
    int failed = cmocka_run_group_tests_name("model_cpu", tests, NULL, NULL);
    return failed + cmocka_run_group_tests_name("model_cuda", cuda, cuda_group_setup, NULL);
}
