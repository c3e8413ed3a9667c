/* SnapKV selection against NVIDIA kvpress (SnapKVPress on the same GGUF through transformers,
 * tests/reference/gen_kvpress_fixture.py): the engine's compressed prefill with kvpress's
 * settings (window 32, avg pooling kernel 5, mean over the KV group, n_kept = int(n (1 - r)))
 * must keep >= 99% of kvpress's positions in every layer; a miss is only allowed where kvpress's
 * own scores at the cut are a near-tie. The same for head granularity against kvpress's
 * AdaKVPress(SnapKVPress, alpha_safeguard 0) (gen_kvpress_adakv_fixture.py): one top-k over
 * the layer's KV heads, so heads keep different counts, and the layer keeps exactly
 * n_kv * n_kept rows. Skips without the model. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "daemon/compress/compress.h"
#include "daemon/engine/engine.h"
#include "kernels/backend.h"
#include "tests/common/fixture.h"

static void check_fixture(const char *rel, bool head_granularity)
{
    char *path = fixture_model_path();
    if (!path)
        skip();
    json_t *fx = fixture_json(rel);
    assert_non_null(fx);
    struct skv_backend *be = NULL;
    struct skv_model *m = NULL;
    struct skv_engine *e = NULL;
    struct skv_model_opts mo = {.reference = true};
    assert_int_equal(skv_backend_cpu_new(0, &be), SKV_OK);
    assert_int_equal(skv_model_load(path, be, &mo, &m), SKV_OK);
    assert_int_equal(skv_engine_new(m, &e), SKV_OK);
    json_t *jids = json_object_get(fx, "ids");
    int n = (int)json_array_size(jids);
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    for (int i = 0; i < n; i++)
        ids[i] = (int32_t)json_integer_value(json_array_get(jids, (size_t)i));
    json_t *cases = json_object_get(fx, "cases");
    for (size_t ci = 0; ci < json_array_size(cases); ci++) {
        json_t *cs = json_array_get(cases, ci);
        int n_kept = (int)json_integer_value(json_object_get(cs, "n_kept"));
        char spec_text[128];
        snprintf(spec_text, sizeof spec_text, "policy=snapkv,budget=%d,window=32,kernel=5,pool=avg,gqa=mean%s", n_kept,
                 head_granularity ? ",granularity=head" : "");
        struct skv_compress_spec spec;
        struct skv_compressor *comp = NULL;
        struct skv_kv_cache *cache = NULL;
        assert_int_equal(skv_compress_spec_parse(spec_text, &spec), SKV_OK);
        assert_int_equal(skv_compressor_new(&spec, m, &comp), SKV_OK);
        assert_int_equal(skv_kv_cache_new(m, &cache), SKV_OK);
        assert_int_equal(skv_compressor_begin(comp, cache, n), SKV_OK);
        struct skv_forward_opts fo = {.hook = skv_compressor_hook, .hook_user = comp};
        assert_int_equal(skv_engine_forward(e, cache, ids, n, &fo, NULL), SKV_OK);
        json_t *layers = json_object_get(cs, "layers");
        double worst = 1.0;
        int missed_total = 0, len_differ = 0, spread = 0;
        for (size_t l = 0; l < json_array_size(layers); l++) {
            json_t *heads = json_object_get(json_array_get(layers, l), "heads");
            int hit = 0, total = 0, ours = 0, lo = n, hi = 0;
            for (size_t h = 0; h < json_array_size(heads); h++) {
                json_t *jh = json_array_get(heads, h), *kept = json_object_get(jh, "kept");
                const struct skv_kv_head *kh = skv_kv_cache_head(cache, (int)l, (int)h);
                if (head_granularity)
                    len_differ += kh->len != (int)json_array_size(kept);
                else
                    assert_int_equal(kh->len, (int)json_array_size(kept));
                ours += kh->len;
                lo = kh->len < lo ? kh->len : lo;
                hi = kh->len > hi ? kh->len : hi;
                int a = 0;
                for (size_t j = 0; j < json_array_size(kept); j++) {
                    int32_t want = (int32_t)json_integer_value(json_array_get(kept, j));
                    while (a < kh->len && kh->pos[a] < want)
                        a++;
                    hit += a < kh->len && kh->pos[a] == want;
                }
                total += (int)json_array_size(kept);
            }
            /* real rows: the layer holds exactly n_kv * n_kept, however the heads share them */
            assert_int_equal(ours, (int)json_array_size(heads) * n_kept);
            assert_int_equal(total, ours);
            spread = hi - lo > spread ? hi - lo : spread;
            double overlap = (double)hit / total;
            worst = overlap < worst ? overlap : worst;
            missed_total += total - hit;
            if (overlap < 0.99)
                fail_msg("%s r=%.1f layer %zu: overlap %.4f", rel,
                         json_real_value(json_object_get(cs, "compression_ratio")), l, overlap);
        }
        printf("# %s r=%.2f (n_kept %d of %d): worst layer overlap %.4f, %d positions differ in all", rel,
               json_real_value(json_object_get(cs, "compression_ratio")), n_kept, n, worst, missed_total);
        if (head_granularity)
            printf("; heads of a layer keep up to %d rows more than another, %d head lengths differ\n", spread,
                   len_differ);
        else
            printf("\n");
        skv_kv_cache_free(&cache);
        skv_compressor_free(&comp);
    }
    free(ids);
    skv_engine_free(&e);
    skv_model_free(&m);
    skv_backend_destroy(&be);
    json_decref(fx);
    free(path);
}

static void test_small(void **state)
{
    (void)state;
    check_fixture("tests/fixtures/kvpress/snapkv_small.json", false);
}

static void test_adakv_small(void **state)
{
    (void)state;
    check_fixture("tests/fixtures/kvpress/adakv_small.json", true);
}

static void test_fidelity(void **state)
{
    (void)state;
    check_fixture("tests/fixtures/kvpress/snapkv_fidelity.json", false);
}

static void test_adakv_fidelity(void **state)
{
    (void)state;
    check_fixture("tests/fixtures/kvpress/adakv_fidelity.json", true);
}

static void test_long(void **state)
{
    (void)state;
    check_fixture("tests/fixtures/kvpress/snapkv_long.json", false);
}

static void test_adakv_long(void **state)
{
    (void)state;
    check_fixture("tests/fixtures/kvpress/adakv_long.json", true);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_small),
        cmocka_unit_test(test_fidelity),
        cmocka_unit_test(test_long),
        cmocka_unit_test(test_adakv_small),
        cmocka_unit_test(test_adakv_fidelity),
        cmocka_unit_test(test_adakv_long),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
