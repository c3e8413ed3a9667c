/* Sampler: greedy ties, determinism per seed, top-k / top-p truncation, the empirical
 * distribution at temperature 1, rejected parameters, and the logit bias, penalties and min-p
 * against transformers' logits processors (tests/fixtures/sampling/). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "common/status.h"
#include "daemon/engine/sampler.h"
#include "tests/common/fixture.h"

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

/* top_k keeps every token tied with the k-th, as transformers' TopKLogitsWarper (which removes
 * only those below the k-th logit): {2, 2, 2, 0} with top_k 1 samples 0, 1 and 2 alike, and
 * {3, 1, 1, 1} with top_k 2 keeps all four. */
static void test_top_k_ties(void **state)
{
    (void)state;
    float three[] = {2.0f, 2.0f, 2.0f, 0.0f};
    struct skv_sampler s;
    struct skv_sampler_params p = {.temperature = 1.0f, .top_k = 1, .seed = 11};
    assert_int_equal(skv_sampler_init(&s, &p, 4), SKV_OK);
    double mass = 0;
    assert_int_equal(skv_sampler_candidates(&s, three, &mass), 3);
    int seen[4] = {0};
    for (int i = 0; i < 3000; i++)
        seen[skv_sampler_sample(&s, three)]++;
    assert_int_equal(seen[3], 0);
    for (int i = 0; i < 3; i++)
        assert_true(seen[i] > 800 && seen[i] < 1200);
    skv_sampler_fini(&s);
    float four[] = {3.0f, 1.0f, 1.0f, 1.0f};
    p.top_k = 2;
    assert_int_equal(skv_sampler_init(&s, &p, 4), SKV_OK);
    assert_int_equal(skv_sampler_candidates(&s, four, &mass), 4);
    assert_int_equal(s.idx[0], 0); /* the likeliest first, then the tied ones by id */
    assert_int_equal(s.idx[1], 1);
    assert_int_equal(s.idx[3], 3);
    skv_sampler_fini(&s);
    /* a low temperature: the weights of all but the top tokens underflow to 0; top_k 5 keeps
     * 5, not every token not below the least selected logit (about 1000 to sort a token) */
    enum { N = 1000 };
    static float ramp[N];
    for (int i = 0; i < N; i++)
        ramp[i] = -(float)(N - i);
    ramp[N - 1] = 0;
    struct skv_sampler_params cold = {.temperature = 0.01f, .top_k = 5, .seed = 3};
    assert_int_equal(skv_sampler_init(&s, &cold, N), SKV_OK);
    assert_int_equal(skv_sampler_candidates(&s, ramp, &mass), 5);
    skv_sampler_fini(&s);
}

/* Non-finite logits: NaN is never picked (greedy or sampled), a +inf logit holds all the mass,
 * and NaN or -inf everywhere gives the lowest id, without a NaN in qsort's comparisons. */
static void test_non_finite(void **state)
{
    (void)state;
    float nan_first[] = {NAN, 1.0f, 3.0f, 2.0f};
    assert_int_equal(skv_argmax(nan_first, 4), 2); /* a NaN at 0 stayed the best before */
    struct skv_sampler s;
    struct skv_sampler_params p = {.temperature = 1.0f, .top_p = 0.9f, .top_k = 3, .seed = 5};
    assert_int_equal(skv_sampler_init(&s, &p, 4), SKV_OK);
    for (int i = 0; i < 500; i++)
        assert_int_not_equal(skv_sampler_sample(&s, nan_first), 0);
    float inf[] = {0.0f, INFINITY, 1.0f, NAN};
    assert_int_equal(skv_sampler_sample(&s, inf), 1);
    float none[] = {NAN, -INFINITY, NAN, -INFINITY};
    assert_int_equal(skv_sampler_sample(&s, none), 1); /* the lowest id that is not NaN */
    skv_sampler_fini(&s);
}

/* The candidates are found by selection, not a full sort: over many random distributions, a
 * sampled token is always among the top_k largest, and with top_p alone among the nucleus a
 * full sort gives (the bound that leaves small tokens out of the sort must not cut it). */
static void test_selection_matches_sort(void **state)
{
    (void)state;
    enum { N = 300 };
    float logits[N];
    uint64_t r = 42;
    for (int trial = 0; trial < 40; trial++) {
        for (int i = 0; i < N; i++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            logits[i] = (float)((r >> 40) % 1000) / 100.0f - (i % 7 == 0 ? 5.0f : 0.0f);
        }
        /* the full order (probabilities fall with logits; ties to the lower id) */
        int order[N];
        for (int i = 0; i < N; i++)
            order[i] = i;
        for (int i = 0; i < N; i++)
            for (int j = i + 1; j < N; j++)
                if (logits[order[j]] > logits[order[i]] ||
                    (logits[order[j]] == logits[order[i]] && order[j] < order[i])) {
                    int t = order[i];
                    order[i] = order[j];
                    order[j] = t;
                }
        int rank[N];
        for (int i = 0; i < N; i++)
            rank[order[i]] = i;
        struct skv_sampler s;
        struct skv_sampler_params pk = {.temperature = 1.0f, .top_k = 7, .seed = (uint64_t)trial};
        assert_int_equal(skv_sampler_init(&s, &pk, N), SKV_OK);
        for (int i = 0; i < 50; i++) /* not below the 7th largest (tokens tied with it stay) */
            assert_true(logits[skv_sampler_sample(&s, logits)] >= logits[order[6]]);
        skv_sampler_fini(&s);
        /* the nucleus of top_p 0.5 by the full order */
        double sum = 0, acc = 0, mx = logits[order[0]];
        for (int i = 0; i < N; i++)
            sum += exp(logits[i] - mx);
        int nucleus = 0;
        while (nucleus < N && acc < 0.5 * sum)
            acc += exp(logits[order[nucleus++]] - mx);
        struct skv_sampler_params pp = {.temperature = 1.0f, .top_p = 0.5f, .seed = (uint64_t)trial};
        assert_int_equal(skv_sampler_init(&s, &pp, N), SKV_OK);
        for (int i = 0; i < 50; i++)
            assert_true(rank[skv_sampler_sample(&s, logits)] < nucleus + 1);
        skv_sampler_fini(&s);
    }
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

/* Feeds pieces through a matcher of `stop`; the released text goes to got (with "|" after each
 * piece's release); returns the index of the piece that completed a sequence, or -1 (then the
 * flushed hold is appended after a final "|"). */
static int feed_all(const char *const *stop, size_t n_stop, const char *const *pieces, size_t n, char *got)
{
    struct skv_stop_text st;
    assert_int_equal(skv_stop_text_init(&st, stop, n_stop), SKV_OK);
    got[0] = '\0';
    char out[SKV_STOP_STRING_BYTES + 64];
    int hit = -1;
    for (size_t i = 0; i < n && hit < 0; i++) {
        size_t n_out = 99;
        bool done = skv_stop_text_feed(&st, pieces[i], strlen(pieces[i]), out, &n_out);
        assert_int_equal(n_out, strlen(out));
        strcat(got, out);
        strcat(got, "|");
        if (done)
            hit = (int)i;
    }
    if (hit < 0) {
        size_t k = skv_stop_text_flush(&st, out);
        assert_int_equal(k, strlen(out));
        strcat(got, out);
    }
    skv_stop_text_fini(&st);
    return hit;
}

/* skv_kl_logits: KL(P || Q) worked out by hand, and the cases that are no number: quality's
 * fidelity turned a NaN (a broken compressed cache) into KL 0, the best score there is. */
static void test_kl_logits(void **state)
{
    (void)state;
    double kl = -1;
    const float a[2] = {0.0f, 0.0f}, b[2] = {0.0f, logf(3.0f)}; /* (1/2, 1/2) and (1/4, 3/4) */
    assert_int_equal(skv_kl_logits(a, a, 2, &kl), SKV_OK);
    assert_true(kl == 0.0);
    assert_int_equal(skv_kl_logits(a, b, 2, &kl), SKV_OK);
    assert_true(fabs(kl - 0.5 * log(4.0 / 3.0)) < 1e-7); /* 1/2 ln 2 + 1/2 ln 2/3 */
    const float one[2] = {0.0f, -INFINITY}; /* (1, 0): the second token adds nothing */
    assert_int_equal(skv_kl_logits(one, a, 2, &kl), SKV_OK);
    assert_true(fabs(kl - log(2.0)) < 1e-7);
    const float nan_q[2] = {0.0f, NAN}, inf_q[2] = {0.0f, INFINITY}, none[2] = {-INFINITY, -INFINITY};
    kl = 0;
    assert_int_equal(skv_kl_logits(a, nan_q, 2, &kl), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "KL: Q's logit 1 is NaN"));
    assert_int_equal(skv_kl_logits(a, inf_q, 2, &kl), SKV_E_INVAL);
    assert_int_equal(skv_kl_logits(none, a, 2, &kl), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "KL: every logit of P is -inf"));
    assert_int_equal(skv_kl_logits(a, one, 2, &kl), SKV_E_INVAL); /* P's second token, none under Q */
    assert_non_null(strstr(skv_error_msg(), "divergence is infinite"));
}

/* skv_logprobs: log-softmax values worked out by hand (logits 0, log 2, log 3, log 2 for 1 : 2 :
 * 3 : 2, total 8), the top list most likely first with equal ones by id, a NaN as -inf, +inf
 * logits sharing the mass, and no distribution at all. */
static void test_logprobs(void **state)
{
    (void)state;
    const float l[5] = {0.0f, logf(2.0f), logf(3.0f), logf(2.0f), NAN};
    float lp = 0, top_lp[9];
    int32_t top[9];
    assert_int_equal(skv_logprobs(l, 5, 2, 3, &lp, top, top_lp), 3);
    assert_float_equal(lp, logf(3.0f / 8.0f), 1e-6);
    assert_int_equal(top[0], 2);
    assert_int_equal(top[1], 1); /* log 2 twice: the lower id first */
    assert_int_equal(top[2], 3);
    assert_float_equal(top_lp[0], logf(3.0f / 8.0f), 1e-6);
    assert_float_equal(top_lp[1], logf(2.0f / 8.0f), 1e-6);
    assert_float_equal(top_lp[2], logf(2.0f / 8.0f), 1e-6);
    assert_int_equal(skv_logprobs(l, 5, 4, 5, &lp, top, top_lp), 5); /* all of them: the NaN last */
    assert_true(isinf(lp) && lp < 0);
    assert_int_equal(top[3], 0);
    assert_int_equal(top[4], 4);
    assert_float_equal(top_lp[3], logf(1.0f / 8.0f), 1e-6);
    assert_true(isinf(top_lp[4]) && top_lp[4] < 0);
    assert_int_equal(skv_logprobs(l, 5, 1, 9, &lp, top, top_lp), 5); /* top_n past n: n of them */
    assert_int_equal(top[0], 2);
    assert_int_equal(top[4], 4);
    assert_int_equal(skv_logprobs(l, 5, 0, 0, &lp, NULL, NULL), 0); /* the token's alone */
    assert_float_equal(lp, logf(1.0f / 8.0f), 1e-6);
    /* huge logits: no overflow (x - max first) */
    const float big[3] = {1000.0f, 1000.0f, 990.0f};
    assert_int_equal(skv_logprobs(big, 3, 0, 1, &lp, top, top_lp), 1);
    assert_float_equal(lp, -log(2.0 + exp(-10.0)), 1e-6);
    assert_int_equal(top[0], 0);
    /* two +inf logits hold all the mass */
    const float inf[4] = {1.0f, INFINITY, 5.0f, INFINITY};
    assert_int_equal(skv_logprobs(inf, 4, 3, 2, &lp, top, top_lp), 2);
    assert_float_equal(lp, -logf(2.0f), 1e-6);
    assert_int_equal(top[0], 1);
    assert_int_equal(top[1], 3);
    assert_int_equal(skv_logprobs(inf, 4, 2, 0, &lp, NULL, NULL), 0);
    assert_true(isinf(lp) && lp < 0);
    /* no distribution */
    const float none[2] = {-INFINITY, NAN};
    assert_int_equal(skv_logprobs(none, 2, 0, 2, &lp, top, top_lp), 2);
    assert_true(isinf(lp) && lp < 0 && isinf(top_lp[0]) && isinf(top_lp[1]));
    assert_int_equal(top[0], 0);
}

/* Stop sequences: a sequence split over pieces, text held back only while it may still begin
 * one (and released when it cannot, or flushed at the end), the earliest of several, a
 * sequence inside one piece with text after it, overlapping prefixes, and the limits. */
static void test_stop_text(void **state)
{
    (void)state;
    char got[512];
    const char *end[] = {"END"};
    const char *p1[] = {"Hello E", "N", "D and more"};
    assert_int_equal(feed_all(end, 1, p1, 3, got), 2);
    assert_string_equal(got, "Hello |||"); /* "E", "EN" held; nothing after the sequence */
    const char *p2[] = {"Hello E", "N", "d"};
    assert_int_equal(feed_all(end, 1, p2, 3, got), -1);
    assert_string_equal(got, "Hello ||ENd|"); /* "EN" then "ENd" cannot begin END */
    const char *p3[] = {"x E"};
    assert_int_equal(feed_all(end, 1, p3, 1, got), -1);
    assert_string_equal(got, "x |E"); /* held to the end, then flushed */
    const char *two[] = {"\n\n", "bc"};
    const char *p4[] = {"abcd\n", "\nx"};
    assert_int_equal(feed_all(two, 2, p4, 2, got), 0); /* "bc" inside the first piece */
    assert_string_equal(got, "a|");
    const char *p5[] = {"ab", "d\n", "\nx"};
    assert_int_equal(feed_all(two, 2, p5, 3, got), 2);
    assert_string_equal(got, "a|bd||"); /* "b" held, then released; "\n" held */
    const char *ovl[] = {"aab"};
    const char *p6[] = {"xa", "a", "a", "b!"};
    assert_int_equal(feed_all(ovl, 1, p6, 4, got), 3);
    assert_string_equal(got, "x||a||"); /* "aa" held; at "aaa" the first "a" goes, "aa" stays */
    const char *utf[] = {"\xc3\xa9t\xc3\xa9"}; /* "été" */
    const char *p7[] = {"un \xc3\xa9", "t\xc3\xa9 chaud"};
    assert_int_equal(feed_all(utf, 1, p7, 2, got), 1);
    assert_string_equal(got, "un ||");

    struct skv_stop_text st;
    assert_int_equal(skv_stop_text_init(&st, NULL, 0), SKV_OK); /* none: all released */
    char out[64];
    size_t n_out;
    assert_false(skv_stop_text_feed(&st, "abc", 3, out, &n_out));
    assert_string_equal(out, "abc");
    skv_stop_text_fini(&st);
    const char *empty[] = {"x", ""};
    assert_int_equal(skv_stop_text_init(&st, empty, 2), SKV_E_INVAL);
    char longest[SKV_STOP_STRING_BYTES + 2];
    memset(longest, 'a', sizeof longest - 1);
    longest[sizeof longest - 1] = '\0';
    const char *too_long[] = {longest};
    assert_int_equal(skv_stop_text_init(&st, too_long, 1), SKV_E_LIMIT);
    longest[SKV_STOP_STRING_BYTES] = '\0'; /* exactly the limit */
    assert_int_equal(skv_stop_text_init(&st, too_long, 1), SKV_OK);
    skv_stop_text_fini(&st);
    const char *many[SKV_STOP_STRINGS_MAX + 1];
    for (unsigned i = 0; i <= SKV_STOP_STRINGS_MAX; i++)
        many[i] = "z";
    assert_int_equal(skv_stop_text_init(&st, many, SKV_STOP_STRINGS_MAX + 1), SKV_E_LIMIT);
}

/* Ints of a JSON array into out (room for cap); returns how many. */
static int json_ints(json_t *a, int32_t *out, int cap)
{
    int n = (int)json_array_size(a);
    assert_true(n <= cap);
    for (int i = 0; i < n; i++)
        out[i] = (int32_t)json_integer_value(json_array_get(a, (size_t)i));
    return n;
}

static float json_num(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    return v ? (float)json_number_value(v) : 0.0f;
}

/* Against transformers (tests/reference/gen_sampling_fixture.py): for random logits, the logits
 * after SequenceBiasLogitsProcessor and RepetitionPenaltyLogitsProcessor are skv_sampler_adjust's
 * bit for bit, and the tokens TemperatureLogitsWarper, TopK, TopP and MinPLogitsWarper leave are
 * skv_sampler_candidates', with the same probabilities (min-p after top-p: the case
 * min_p_after_top_p keeps 5 tokens where min-p first would keep 4). */
static void test_processors_reference(void **state)
{
    (void)state;
    json_t *j = fixture_json("tests/fixtures/sampling/processors.json");
    size_t size = 0;
    float *rows = fixture_read("tests/fixtures/sampling/processors.f32", &size);
    assert_non_null(j);
    assert_non_null(rows);
    const int nv = (int)json_integer_value(json_object_get(j, "vocab"));
    json_t *cases = json_object_get(j, "cases");
    assert_int_equal(size, json_array_size(cases) * 3 * (size_t)nv * sizeof(float));
    for (size_t c = 0; c < json_array_size(cases); c++) {
        json_t *jc = json_array_get(cases, c);
        const float *logits = rows + c * 3 * nv, *adjusted = logits + nv, *probs = logits + 2 * nv;
        int32_t hist[64], bias_ids[64];
        float bias[64];
        int n_hist = json_ints(json_object_get(jc, "history"), hist, 64);
        int n_bias = json_ints(json_object_get(jc, "bias_tokens"), bias_ids, 64);
        for (int i = 0; i < n_bias; i++)
            bias[i] = (float)json_number_value(json_array_get(json_object_get(jc, "bias_values"), (size_t)i));
        struct skv_sampler_params p = {
            .temperature = json_num(jc, "temperature"),
            .top_k = (int)json_num(jc, "top_k"),
            .top_p = json_num(jc, "top_p"),
            .min_p = json_num(jc, "min_p"),
            .repetition_penalty = json_num(jc, "repetition_penalty"),
            .repetition_last_n = (int)json_num(jc, "repetition_last_n"),
            .bias_ids = bias_ids,
            .bias = bias,
            .n_bias = (size_t)n_bias,
        };
        struct skv_sampler s;
        assert_int_equal(skv_sampler_init(&s, &p, nv), SKV_OK);
        const float *a = skv_sampler_adjust(&s, logits, hist, n_hist, NULL, 0);
        assert_memory_equal(a, adjusted, (size_t)nv * sizeof *a);
        double mass;
        int k = skv_sampler_candidates(&s, a, &mass);
        assert_int_equal(k, json_integer_value(json_object_get(jc, "n_kept")));
        bool *kept = calloc((size_t)nv, sizeof *kept);
        assert_non_null(kept);
        json_t *jk = json_object_get(jc, "kept");
        for (size_t i = 0; i < json_array_size(jk); i++)
            kept[json_integer_value(json_array_get(jk, i))] = true;
        for (int i = 0; i < k; i++) {
            int32_t t = s.idx[i];
            assert_true(kept[t]);
            assert_true(fabs(s.prob[t] / mass - probs[t]) < 2e-6 + 1e-5 * probs[t]);
        }
        free(kept);
        printf("# %-18s %3d of %d tokens kept, as transformers keeps them\n",
               json_string_value(json_object_get(jc, "name")), k, nv);
        skv_sampler_fini(&s);
    }
    free(rows);
    json_decref(j);
}

/* Frequency and presence penalties (OpenAI's formula, worked by hand) over the decode's tokens
 * only; the repetition penalty over the whole history, each token once, ids outside the
 * vocabulary ignored; a bias steers greedy picks; history and generated tokens both. */
static void test_penalties_by_hand(void **state)
{
    (void)state;
    float logits[] = {1.0f, 2.0f, -1.0f, 0.5f, 3.0f, 0.0f};
    const int32_t hist[] = {0, 2, 2, 9, -1, 4};
    const int32_t gen[] = {4, 1, 4, 4};
    struct skv_sampler s;
    struct skv_sampler_params p = {.frequency_penalty = 0.5f, .presence_penalty = 0.25f};
    assert_int_equal(skv_sampler_init(&s, &p, 6), SKV_OK);
    const float *a = skv_sampler_adjust(&s, logits, hist, 6, gen, 4);
    /* token 4 came 3 times: 3 - 3 * 0.5 - 0.25; token 1 once: 2 - 0.5 - 0.25 */
    const float want_fp[] = {1.0f, 1.25f, -1.0f, 0.5f, 1.25f, 0.0f};
    assert_memory_equal(a, want_fp, sizeof want_fp);
    assert_int_equal(skv_sampler_next(&s, logits, hist, 6, gen, 4), 1); /* 1.25 twice: the lower id */
    skv_sampler_fini(&s);

    p = (struct skv_sampler_params){.repetition_penalty = 2.0f};
    assert_int_equal(skv_sampler_init(&s, &p, 6), SKV_OK);
    a = skv_sampler_adjust(&s, logits, hist, 6, gen, 4);
    /* 0, 2 and 4 in the history (2 twice: once), 9 and -1 outside: positive halved, negative doubled */
    const float want_rp[] = {0.5f, 2.0f, -2.0f, 0.5f, 1.5f, 0.0f};
    assert_memory_equal(a, want_rp, sizeof want_rp);
    assert_int_equal(skv_sampler_next(&s, logits, hist, 6, gen, 4), 1);
    /* again: the marks were cleared, the same result */
    assert_memory_equal(skv_sampler_adjust(&s, logits, hist, 6, gen, 4), want_rp, sizeof want_rp);
    skv_sampler_fini(&s);

    p.repetition_last_n = 1; /* only token 4 */
    assert_int_equal(skv_sampler_init(&s, &p, 6), SKV_OK);
    a = skv_sampler_adjust(&s, logits, hist, 6, gen, 4);
    assert_true(a[0] == 1.0f && a[2] == -1.0f && a[4] == 1.5f);
    skv_sampler_fini(&s);

    const int32_t bid[] = {5, 4};
    const float bv[] = {10.0f, -100.0f};
    p = (struct skv_sampler_params){.bias_ids = bid, .bias = bv, .n_bias = 2};
    assert_int_equal(skv_sampler_init(&s, &p, 6), SKV_OK);
    assert_int_equal(skv_sampler_sample(&s, logits), 5);
    assert_true(logits[5] == 0.0f && logits[4] == 3.0f); /* not modified */
    skv_sampler_fini(&s);

    /* none on: the logits themselves, no scratch */
    p = (struct skv_sampler_params){.repetition_penalty = 1.0f};
    assert_int_equal(skv_sampler_init(&s, &p, 6), SKV_OK);
    assert_ptr_equal(skv_sampler_adjust(&s, logits, hist, 6, gen, 4), logits);
    assert_null(s.adj);
    skv_sampler_fini(&s);
}

/* min_p alone: only tokens at least min_p as likely as the top one are drawn, in proportion. */
static void test_min_p(void **state)
{
    (void)state;
    float logits[] = {logf(0.5f), logf(0.3f), logf(0.12f), logf(0.08f)};
    struct skv_sampler s;
    struct skv_sampler_params p = {.temperature = 1.0f, .min_p = 0.2f, .seed = 11};
    assert_int_equal(skv_sampler_init(&s, &p, 4), SKV_OK);
    int seen[4] = {0};
    for (int i = 0; i < 20000; i++)
        seen[skv_sampler_sample(&s, logits)]++;
    /* 0.12 / 0.5 = 0.24 stays, 0.08 / 0.5 = 0.16 goes: 0.5 : 0.3 : 0.12 of 0.92 */
    assert_int_equal(seen[3], 0);
    assert_true(fabs(seen[0] / 20000.0 - 0.5 / 0.92) < 0.015);
    assert_true(fabs(seen[2] / 20000.0 - 0.12 / 0.92) < 0.015);
    skv_sampler_fini(&s);
}

/* Bad values of the new parameters are refused with a message naming them. */
static void test_invalid_penalties(void **state)
{
    (void)state;
    struct skv_sampler s;
    struct {
        struct skv_sampler_params p;
        int rc;
        const char *says;
    } bad[] = {
        {{.min_p = 1.5f}, SKV_E_INVAL, "min_p"},
        {{.min_p = NAN}, SKV_E_INVAL, "min_p"},
        {{.repetition_penalty = -1.0f}, SKV_E_INVAL, "repetition_penalty"},
        {{.repetition_penalty = 101.0f}, SKV_E_INVAL, "repetition_penalty"},
        {{.repetition_penalty = 1e-30f}, SKV_E_INVAL, "repetition_penalty"},
        {{.repetition_last_n = -3}, SKV_E_INVAL, "repetition_last_n"},
        {{.frequency_penalty = 2.5f}, SKV_E_INVAL, "frequency_penalty"},
        {{.presence_penalty = -2.5f}, SKV_E_INVAL, "presence_penalty"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(skv_sampler_init(&s, &bad[i].p, 8), bad[i].rc);
        assert_non_null(strstr(skv_error_msg(), bad[i].says));
    }
    int32_t ids[SKV_LOGIT_BIAS_MAX + 1];
    float b[SKV_LOGIT_BIAS_MAX + 1];
    for (int i = 0; i <= (int)SKV_LOGIT_BIAS_MAX; i++) {
        ids[i] = i;
        b[i] = 1.0f;
    }
    struct skv_sampler_params p = {.bias_ids = ids, .bias = b, .n_bias = SKV_LOGIT_BIAS_MAX + 1};
    assert_int_equal(skv_sampler_init(&s, &p, 4096), SKV_E_LIMIT);
    p.n_bias = SKV_LOGIT_BIAS_MAX;
    assert_int_equal(skv_sampler_init(&s, &p, 4096), SKV_OK);
    skv_sampler_fini(&s);
    assert_int_equal(skv_sampler_init(&s, &p, 1000), SKV_E_INVAL); /* token 1000 is outside */
    assert_non_null(strstr(skv_error_msg(), "outside the vocabulary"));
    ids[1] = 0;
    p.n_bias = 2;
    assert_int_equal(skv_sampler_init(&s, &p, 8), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "twice"));
    ids[1] = 1;
    b[1] = 100.5f;
    assert_int_equal(skv_sampler_init(&s, &p, 8), SKV_E_INVAL);
    b[1] = NAN;
    assert_int_equal(skv_sampler_init(&s, &p, 8), SKV_E_INVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy),     cmocka_unit_test(test_distribution),
        cmocka_unit_test(test_seed_reproducible), cmocka_unit_test(test_truncation),
        cmocka_unit_test(test_top_k_ties),
        cmocka_unit_test(test_invalid),
        cmocka_unit_test(test_non_finite),
        cmocka_unit_test(test_selection_matches_sort),     cmocka_unit_test(test_stop_text),
        cmocka_unit_test(test_logprobs),
        cmocka_unit_test(test_kl_logits),
        cmocka_unit_test(test_processors_reference),
        cmocka_unit_test(test_penalties_by_hand),
        cmocka_unit_test(test_min_p),
        cmocka_unit_test(test_invalid_penalties),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
