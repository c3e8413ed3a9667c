/* Sampler: greedy ties, determinism per seed, top-k / top-p truncation, the empirical
 * distribution at temperature 1, and rejected parameters. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>

#include "common/status.h"
#include "daemon/engine/sampler.h"

static void test_greedy(void **state)
{
    (void)state;
    float logits[] = {0.5f, 3.0f, 3.0f, -1.0f};
    assert_int_equal(skv_argmax(logits, 4), 1); /* first of the tied maxima */
    struct skv_sampler s;
    struct skv_sampler_params p = {0};
    assert_int_equal(skv_sampler_init(&s, &p, 4), SKV_OK);
    assert_int_equal(skv_sampler_sample(&s, logits), 1);
    skv_sampler_fini(&s);
}

static void test_distribution(void **state)
{
    (void)state;
    /* probabilities 0.1, 0.2, 0.3, 0.4 at temperature 1 */
    float logits[] = {logf(0.1f), logf(0.2f), logf(0.3f), logf(0.4f)};
    struct skv_sampler s;
    struct skv_sampler_params p = {.temperature = 1.0f, .seed = 7};
    assert_int_equal(skv_sampler_init(&s, &p, 4), SKV_OK);
    int counts[4] = {0};
    for (int i = 0; i < 40000; i++)
        counts[skv_sampler_sample(&s, logits)]++;
    for (int i = 0; i < 4; i++)
        assert_true(fabs(counts[i] / 40000.0 - 0.1 * (i + 1)) < 0.01);
    skv_sampler_fini(&s);
}

static void test_seed_reproducible(void **state)
{
    (void)state;
    float logits[16];
    for (int i = 0; i < 16; i++)
        logits[i] = sinf((float)i);
    struct skv_sampler a, b;
    struct skv_sampler_params p = {.temperature = 0.8f, .top_p = 0.9f, .seed = 1234};
    assert_int_equal(skv_sampler_init(&a, &p, 16), SKV_OK);
    assert_int_equal(skv_sampler_init(&b, &p, 16), SKV_OK);
    for (int i = 0; i < 100; i++)
        assert_int_equal(skv_sampler_sample(&a, logits), skv_sampler_sample(&b, logits));
    skv_sampler_fini(&a);
    skv_sampler_fini(&b);
}

static void test_truncation(void **state)
{
    (void)state;
    float logits[] = {logf(0.05f), logf(0.5f), logf(0.3f), logf(0.15f)};
    struct skv_sampler s;
    struct skv_sampler_params k2 = {.temperature = 1.0f, .top_k = 2, .seed = 3};
    assert_int_equal(skv_sampler_init(&s, &k2, 4), SKV_OK);
    for (int i = 0; i < 2000; i++) {
        int t = skv_sampler_sample(&s, logits);
        assert_true(t == 1 || t == 2);
    }
    skv_sampler_fini(&s);
    /* top_p 0.6: 0.5 alone is below, 0.5 + 0.3 reaches it -> {1, 2} */
    struct skv_sampler_params tp = {.temperature = 1.0f, .top_p = 0.6f, .seed = 4};
    assert_int_equal(skv_sampler_init(&s, &tp, 4), SKV_OK);
    int seen[4] = {0};
    for (int i = 0; i < 4000; i++)
        seen[skv_sampler_sample(&s, logits)]++;
    assert_int_equal(seen[0], 0);
    assert_int_equal(seen[3], 0);
    assert_true(seen[1] > seen[2] && seen[2] > 0);
    skv_sampler_fini(&s);
}

static void test_invalid(void **state)
{
    (void)state;
    struct skv_sampler s;
    struct skv_sampler_params p = {.temperature = NAN};
    assert_int_equal(skv_sampler_init(&s, &p, 4), SKV_E_INVAL);
    p = (struct skv_sampler_params){.temperature = -1};
    assert_int_equal(skv_sampler_init(&s, &p, 4), SKV_E_INVAL);
    p = (struct skv_sampler_params){.top_p = 1.5f};
    assert_int_equal(skv_sampler_init(&s, &p, 4), SKV_E_INVAL);
    p = (struct skv_sampler_params){.top_k = -2};
    assert_int_equal(skv_sampler_init(&s, &p, 4), SKV_E_INVAL);
    p = (struct skv_sampler_params){0};
    assert_int_equal(skv_sampler_init(&s, &p, 0), SKV_E_INVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy),     cmocka_unit_test(test_distribution),
        cmocka_unit_test(test_seed_reproducible), cmocka_unit_test(test_truncation),
        cmocka_unit_test(test_invalid),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
