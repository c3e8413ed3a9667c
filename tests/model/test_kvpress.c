/* SnapKV selection against NVIDIA kvpress (SnapKVPress on the same GGUF through transformers,
 * tests/reference/gen_kvpress_fixture.py): the engine's compressed prefill with kvpress's
 * settings (window 32, avg pooling kernel 5, mean over the KV group, and kvpress's own count
 * n_kept = int(n (1 - r)) as the budget) must keep exactly kvpress's positions, head by head, in
 * every layer whose cut kvpress's scores do not leave a near-tie (the fixture's boundary_tie: no
 * fixture has one), and >= 99% of them in one that does (and in the fast-mode cases on Qwen).
 * The same for head granularity against kvpress's
 * AdaKVPress(SnapKVPress, alpha_safeguard 0) (gen_kvpress_adakv_fixture.py): one top-k over
 * the layer's KV heads, so heads keep different counts, and the layer keeps exactly
 * n_kv * n_kept rows. On the default model and on the second model of the quality runs
 * (Qwen2.5-Coder-0.5B, tests/fixtures/kvpress-qwen2.5-coder-0.5b/); each case skips when its
 * model is not there. */
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

#include "tests/common/fixture.h"
#include "tests/common/refmodel.h"

static void check_fixture(const char *rel, bool head_granularity, bool qwen, bool fast, bool exact)
{
    struct refmodel r;
    char *path = qwen ? fixture_qwen_model_path() : fixture_model_path();
    if (fast)
        refmodel_load_fast(&r, path);
    else
        refmodel_load_path(&r, path);
    json_t *fx = fixture_json(rel);
    assert_non_null(fx);
    int n = 0;
    int32_t *ids = refmodel_ids(json_object_get(fx, "ids"), &n);
    json_t *cases = json_object_get(fx, "cases");
    for (size_t ci = 0; ci < json_array_size(cases); ci++) {
        json_t *cs = json_array_get(cases, ci);
        int n_kept = (int)json_integer_value(json_object_get(cs, "n_kept"));
        char spec_text[128];
        snprintf(spec_text, sizeof spec_text, "policy=snapkv,budget=%d,window=32,kernel=5,pool=avg,gqa=mean%s", n_kept,
                 head_granularity ? ",granularity=head" : "");
        struct skv_compressor *comp = NULL;
        struct skv_kv_cache *cache = NULL;
        refmodel_prefill(&r, spec_text, ids, n, &cache, &comp);
        json_t *layers = json_object_get(cs, "layers");
        double worst = 1.0;
        int missed_total = 0, len_differ = 0, spread = 0;
        for (size_t l = 0; l < json_array_size(layers); l++) {
            json_t *jl = json_array_get(layers, l), *heads = json_object_get(jl, "heads");
            int hit = 0, total = 0, ours = 0, lo = n, hi = 0, layer_len_differ = 0;
            bool tie = json_is_true(json_object_get(jl, "boundary_tie")); /* (AdaKV: per layer) */
            for (size_t h = 0; h < json_array_size(heads); h++) {
                json_t *jh = json_array_get(heads, h), *kept = json_object_get(jh, "kept");
                const struct skv_kv_head *kh = skv_kv_cache_head(cache, (int)l, (int)h);
                tie = tie || json_is_true(json_object_get(jh, "boundary_tie")); /* (SnapKV: per head) */
                if (head_granularity)
                    layer_len_differ += kh->len != (int)json_array_size(kept);
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
            len_differ += layer_len_differ;
            if (exact && !tie && (hit != total || layer_len_differ))
                fail_msg("%s r=%.1f layer %zu: %d positions and %d head lengths differ from kvpress's, whose "
                         "scores leave no tie at the cut",
                         rel, json_real_value(json_object_get(cs, "compression_ratio")), l, total - hit,
                         layer_len_differ);
            if (overlap < 0.99)
                fail_msg("%s r=%.1f layer %zu: overlap %.4f", rel,
                         json_real_value(json_object_get(cs, "compression_ratio")), l, overlap);
        }
        printf("# %s%s r=%.2f (n_kept %d of %d): worst layer overlap %.4f, %d positions differ in all", rel,
               fast ? " (fast mode)" : "", json_real_value(json_object_get(cs, "compression_ratio")), n_kept, n,
               worst, missed_total);
        if (head_granularity)
            printf("; heads of a layer keep up to %d rows more than another, %d head lengths differ\n", spread,
                   len_differ);
        else
            printf("\n");
        skv_kv_cache_free(&cache);
        skv_compressor_free(&comp);
    }
    free(ids);
    refmodel_free(&r);
    json_decref(fx);
}

struct kvpress_case {
    const char *fixture;
    bool head_granularity; /* AdaKVPress */
    bool qwen;             /* the second model (fixture_qwen_model_path) */
    bool fast;             /* the engine's fast mode, which serves, not its reference mode */
    bool exact;            /* every position where kvpress's cut has no tie; else >= 99% a layer */
};

static void run_case(void **state)
{
    const struct kvpress_case *c = *state;
    check_fixture(c->fixture, c->head_granularity, c->qwen, c->fast, c->exact);
}

#define CASE_MODE(test_name, file, head, qwen, fast, exact)                                        \
    {.name = test_name, .test_func = run_case, .initial_state = &(struct kvpress_case){file, head, qwen, fast, exact}}
#define CASE(test_name, file, head, qwen) CASE_MODE(test_name, file, head, qwen, false, true)

int main(void)
{
    const struct CMUnitTest tests[] = {
        CASE("snapkv_small", "tests/fixtures/kvpress/snapkv_small.json", false, false),
        CASE("snapkv_fidelity", "tests/fixtures/kvpress/snapkv_fidelity.json", false, false),
        CASE("snapkv_long", "tests/fixtures/kvpress/snapkv_long.json", false, false),
        CASE("adakv_small", "tests/fixtures/kvpress/adakv_small.json", true, false),
        CASE("adakv_fidelity", "tests/fixtures/kvpress/adakv_fidelity.json", true, false),
        CASE("adakv_long", "tests/fixtures/kvpress/adakv_long.json", true, false),
        /* the serving path too (fast mode): the same positions, on the default model */
        CASE_MODE("snapkv_long_fast", "tests/fixtures/kvpress/snapkv_long.json", false, false, true, true),
        CASE_MODE("adakv_long_fast", "tests/fixtures/kvpress/adakv_long.json", true, false, true, true),
        /* Qwen2.5-Coder-0.5B: 14 query heads on 2 KV heads, so the mean runs over groups of 7 */
        CASE("qwen_snapkv_small", "tests/fixtures/kvpress-qwen2.5-coder-0.5b/snapkv_small.json", false, true),
        CASE("qwen_snapkv_fidelity", "tests/fixtures/kvpress-qwen2.5-coder-0.5b/snapkv_fidelity.json", false, true),
        CASE("qwen_snapkv_long", "tests/fixtures/kvpress-qwen2.5-coder-0.5b/snapkv_long.json", false, true),
        CASE("qwen_adakv_small", "tests/fixtures/kvpress-qwen2.5-coder-0.5b/adakv_small.json", true, true),
        CASE("qwen_adakv_fidelity", "tests/fixtures/kvpress-qwen2.5-coder-0.5b/adakv_fidelity.json", true, true),
        CASE("qwen_adakv_long", "tests/fixtures/kvpress-qwen2.5-coder-0.5b/adakv_long.json", true, true),
        /* and on Qwen in fast mode, where its lower-precision activations move a score at the cut
         * once (one position of one head in layer 3 of the fidelity prompt at r = 0.5): >= 99% */
        CASE_MODE("qwen_snapkv_fidelity_fast", "tests/fixtures/kvpress-qwen2.5-coder-0.5b/snapkv_fidelity.json", false,
                  true, true, false),
        CASE_MODE("qwen_adakv_long_fast", "tests/fixtures/kvpress-qwen2.5-coder-0.5b/adakv_long.json", true, true,
                  true, false),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
