/* SqueezeAttention against references no one here wrote (tests/reference/gen_squeeze_fixture.py):
 * the per-layer similarities the compressor measures during a compressing prefill of the
 * default model match Hugging Face transformers' (mean over tokens of cos(layer input, input +
 * self_attn output)), and the layers the allocator squeezes are exactly scikit-learn KMeans(3)'s
 * highest-similarity cluster, both from transformers' similarities and from our own.
 * Skips without the model. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/status.h"
#include "daemon/compress/compress.h"
#include "daemon/engine/engine.h"
#include "kernels/backend.h"
#include "tests/common/fixture.h"

#define FIXTURE "tests/fixtures/squeeze/similarity.json"
#define MAX_LAYERS 64

/* The layers skv_squeeze_budgets squeezes for these similarities: with window 0, p 0.3, B 100
 * and a prompt too long to cap anything, the squeezed cluster gets exactly 30 rows a layer and
 * every other layer more. */
static void squeezed_layers(const float *sim, int n_layers, bool *out)
{
    int b[MAX_LAYERS];
    skv_squeeze_budgets(sim, n_layers, 100, 0, 0.3, 1 << 20, b);
    for (int l = 0; l < n_layers; l++) {
        out[l] = b[l] == 30;
        if (!out[l])
            assert_true(b[l] > 30);
    }
}

static void test_similarity_and_clusters(void **state)
{
    (void)state;
    char *path = fixture_model_path();
    if (!path)
        skip();
    json_t *fx = fixture_json(FIXTURE);
    assert_non_null(fx);
    struct skv_backend *be = NULL;
    struct skv_model *m = NULL;
    struct skv_engine *e = NULL;
    struct skv_model_opts mo = {.reference = true};
    assert_int_equal(skv_backend_cpu_new(0, &be), SKV_OK);
    assert_int_equal(skv_model_load(path, be, &mo, &m), SKV_OK);
    assert_int_equal(skv_engine_new(m, &e), SKV_OK);
    int L = m->cfg.n_layers;
    assert_true(L <= MAX_LAYERS);

    json_t *prompts = json_object_get(fx, "prompts");
    assert_int_equal(json_array_size(prompts), 3);
    size_t pi;
    json_t *p;
    json_array_foreach(prompts, pi, p) {
        json_t *jids = json_object_get(p, "ids"), *jsim = json_object_get(p, "similarity"),
               *jlab = json_object_get(p, "kmeans_labels");
        int n = (int)json_array_size(jids);
        assert_int_equal((int)json_array_size(jsim), L);
        int32_t *ids = malloc((size_t)n * sizeof *ids);
        for (int i = 0; i < n; i++)
            ids[i] = (int32_t)json_integer_value(json_array_get(jids, (size_t)i));

        struct skv_compress_spec spec;
        struct skv_compressor *comp = NULL;
        struct skv_kv_cache *cache = NULL;
        assert_int_equal(skv_compress_spec_parse("policy=snapkv,alloc=squeeze,ratio=0.1", &spec), SKV_OK);
        assert_int_equal(skv_compressor_new(&spec, m, &comp), SKV_OK);
        assert_int_equal(skv_kv_cache_new(m, &cache), SKV_OK);
        assert_int_equal(skv_compressor_begin(comp, cache, n), SKV_OK);
        struct skv_forward_opts fo = {.hook = skv_compressor_hook, .hook_user = comp};
        assert_int_equal(skv_engine_forward(e, cache, ids, n, &fo, NULL), SKV_OK);
        assert_int_equal(skv_compressor_finish(comp, cache), SKV_OK);

        const float *ours = skv_compressor_similarity(comp);
        assert_non_null(ours);
        float ref[MAX_LAYERS];
        double worst = 0;
        for (int l = 0; l < L; l++) {
            ref[l] = (float)json_real_value(json_array_get(jsim, (size_t)l));
            double d = fabs((double)ours[l] - json_real_value(json_array_get(jsim, (size_t)l)));
            worst = d > worst ? d : worst;
            if (d > 1e-5)
                fail_msg("%s layer %d: similarity %.6f, transformers %.6f", json_string_value(json_object_get(p, "prompt")),
                         l, ours[l], json_real_value(json_array_get(jsim, (size_t)l)));
        }

        /* the squeezed layers are sklearn's cluster 2, from either set of similarities */
        bool from_ref[MAX_LAYERS], from_ours[MAX_LAYERS];
        squeezed_layers(ref, L, from_ref);
        squeezed_layers(ours, L, from_ours);
        int n_low = 0;
        for (int l = 0; l < L; l++) {
            bool want = json_integer_value(json_array_get(jlab, (size_t)l)) == 2;
            assert_int_equal(from_ref[l], want);
            assert_int_equal(from_ours[l], want);
            n_low += want;
        }
        /* and the compressor's own budgets squeeze the same layers: the least budgets (the
         * cap's surplus, shared evenly, may give some of them one row more) */
        const int *b = skv_compressor_layer_budgets(comp);
        int lo = b[0];
        for (int l = 1; l < L; l++)
            lo = b[l] < lo ? b[l] : lo;
        long total = 0;
        for (int l = 0; l < L; l++) {
            assert_int_equal(b[l] <= lo + 1, from_ref[l]);
            total += b[l];
        }
        assert_int_equal(total, (long)L * skv_compressor_budget(comp));
        printf("# %s (%d tokens): largest similarity difference %.2e; %d of %d layers squeezed to %d-%d rows, "
               "as sklearn's KMeans\n",
               json_string_value(json_object_get(p, "prompt")), n, worst, n_low, L, lo, lo + 1);
        skv_kv_cache_free(&cache);
        skv_compressor_free(&comp);
        free(ids);
    }
    skv_engine_free(&e);
    skv_model_free(&m);
    skv_backend_destroy(&be);
    json_decref(fx);
    free(path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_similarity_and_clusters),
    };
    return cmocka_run_group_tests_name("squeeze-reference", tests, NULL, NULL);
}
