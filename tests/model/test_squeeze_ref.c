/* SqueezeAttention against references no one here wrote (tests/reference/gen_squeeze_fixture.py):
 * the per-layer similarities the compressor measures during a compressing prefill of the
 * default model match Hugging Face transformers' (mean over tokens of cos(layer input, input +
 * self_attn output)), and the layers the allocator squeezes are exactly scikit-learn KMeans(3)'s
 * highest-similarity cluster, both from transformers' similarities and from our own. On the
 * default model and on the second model of the quality runs; each skips without its model. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "tests/common/fixture.h"
#include "tests/common/refmodel.h"

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

static void check_model(const char *fixture, bool qwen, const char *spec)
{
    struct refmodel r;
    refmodel_load_path(&r, qwen ? fixture_qwen_model_path() : fixture_model_path());
    json_t *fx = fixture_json(fixture);
    assert_non_null(fx);
    int L = r.m->cfg.n_layers;
    assert_true(L <= MAX_LAYERS);

    json_t *prompts = json_object_get(fx, "prompts");
    assert_int_equal(json_array_size(prompts), 3);
    size_t pi;
    json_t *p;
    json_array_foreach(prompts, pi, p) {
        json_t *jsim = json_object_get(p, "similarity"), *jlab = json_object_get(p, "kmeans_labels");
        assert_int_equal((int)json_array_size(jsim), L);
        int n = 0;
        int32_t *ids = refmodel_ids(json_object_get(p, "ids"), &n);
        struct skv_compressor *comp = NULL;
        struct skv_kv_cache *cache = NULL;
        refmodel_prefill(&r, spec, ids, n, &cache, &comp);

        const float *ours = skv_compressor_similarity(comp);
        assert_non_null(ours);
        float ref[MAX_LAYERS];
        double worst = 0;
        for (int l = 0; l < L; l++) {
            ref[l] = (float)json_real_value(json_array_get(jsim, (size_t)l));
            double d = fabs((double)ours[l] - json_real_value(json_array_get(jsim, (size_t)l)));
            worst = d > worst ? d : worst;
            if (d > 1e-5)
                fail_msg("%s layer %d: similarity %.6f, transformers %.6f",
                         json_string_value(json_object_get(p, "prompt")), l, ours[l],
                         json_real_value(json_array_get(jsim, (size_t)l)));
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
            if ((b[l] <= lo + 1) != from_ref[l])
                fail_msg("layer %d: budget %d, least %d, squeezed by KMeans %d", l, b[l], lo, from_ref[l]);
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
    refmodel_free(&r);
    json_decref(fx);
}

static void test_similarity_and_clusters(void **state)
{
    (void)state;
    check_model("tests/fixtures/squeeze/similarity.json", false, "policy=snapkv,alloc=squeeze,ratio=0.1");
}

/* The second model: qwen2 (q/k/v biases, 24 layers, g = 7). Its `small` prompt is 297 tokens,
 * so 10% would be 30 rows, under the 32-row window, where squeezing has nothing to take
 * (skv_squeeze_budgets keeps the window): 20% instead. */
static void test_similarity_and_clusters_qwen(void **state)
{
    (void)state;
    check_model("tests/fixtures/squeeze/similarity-qwen2.5-coder-0.5b.json", true,
                "policy=snapkv,alloc=squeeze,ratio=0.2");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_similarity_and_clusters),
        cmocka_unit_test(test_similarity_and_clusters_qwen),
    };
    return cmocka_run_group_tests_name("squeeze-reference", tests, NULL, NULL);
}
