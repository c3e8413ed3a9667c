/* Compression: spec parsing, the policy pieces on hand-computed inputs (pooling, GQA
 * reduction, PyramidKV and SqueezeAttention budgets), and whole compressed prefills on the
 * tiny random Llama fixture: every policy's kept rows against a naive re-implementation from
 * the same queries and keys, the edge cases, head granularity, decode-time eviction and
 * query-aware reuse of a kept document; SnapKV re-scoring while decoding on a hand-made cache,
 * against a naive double-precision re-implementation, at its edges and across a clone. */
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
#include "daemon/engine/engine.h"
#include "daemon/engine/kv_pool.h"
#include "kernels/backend.h"
#include "tests/common/fixture.h"
#include "tests/common/tiny.h"

/* ---- spec ------------------------------------------------------------------------------ */

static void test_spec_parse(void **state)
{
    (void)state;
    struct skv_compress_spec s;
    assert_int_equal(skv_compress_spec_parse("policy=snapkv,ratio=0.1", &s), SKV_OK);
    assert_int_equal(s.policy, SKV_POLICY_SNAPKV);
    assert_true(fabs(s.ratio - 0.1) < 1e-12);
    assert_int_equal(s.window, 32);
    assert_int_equal(s.kernel, 7);
    assert_int_equal(s.pool, SKV_POOL_MAX);
    assert_int_equal(s.gqa, SKV_GQA_MEAN);
    assert_int_equal(s.granularity, SKV_GRAN_LAYER);
    assert_int_equal(skv_compress_spec_parse(
                         "policy=snapkv,alloc=squeeze,budget=512,window=32,kernel=7,pool=max,gqa=mean,granularity=head",
                         &s),
                     SKV_OK);
    assert_int_equal(s.budget, 512);
    assert_true(s.ratio < 0);
    assert_int_equal(s.alloc, SKV_ALLOC_SQUEEZE);
    assert_int_equal(s.granularity, SKV_GRAN_HEAD);
    assert_int_equal(skv_compress_spec_parse("policy=full", &s), SKV_OK);
    assert_int_equal(skv_compress_spec_parse("", &s), SKV_OK);
    assert_int_equal(s.policy, SKV_POLICY_FULL);

    const char *bad[] = {
        "policy=snapkv",                      /* no budget */
        "policy=snapkv,budget=10,ratio=0.5",  /* both */
        "policy=nope,budget=10",              "policy=snapkv,budget=0",
        "policy=snapkv,budget=-3",            "policy=snapkv,ratio=1.5",
        "policy=snapkv,ratio=abc",            "policy=snapkv,budget=10,kernel=4",
        "policy=snapkv,budget=10,pool=min",   "policy=snapkv,budget=10,colour=red",
        "policy=snapkv,budget=10,budget=11",  "policy=full,budget=10",
        "policy=snapkv,budget=10,window",     "policy=snapkv,budget=10,gqa=sum",
        "policy=snapkv,budget=10,granularity=token", "policy=snapkv,budget=10,p=2",
        "policy=snapkv,budget=10,min_budget=64", /* a floor only under ratio */
        "policy=full,min_budget=64",          "policy=snapkv,ratio=0.1,min_budget=0",
        "policy=full,decode_budget=64", /* accepted, and did nothing, before */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct skv_compress_spec before;
        skv_compress_spec_default(&before);
        s = before;
        assert_int_equal(skv_compress_spec_parse(bad[i], &s), SKV_E_INVAL);
        assert_true(strlen(skv_error_msg()) > 10);
        assert_memory_equal(&s, &before, sizeof s); /* untouched on error */
    }
}

/* A key set where the spec's policy and allocator never read it is refused, naming what reads
 * it (it was taken, and changed nothing); at its default it is taken, as the canonical text
 * writes every key. A saved spec (a SAVE file's, maybe from a daemon before the check) is read
 * as it was. Blanks around a pair are skipped, and a spec with no size says so first. */
static void test_spec_ignored_keys(void **state)
{
    (void)state;
    static const struct {
        const char *spec, *msg;
    } refused[] = {
        {"policy=h2o,budget=8,kernel=11", "kernel does nothing with policy=h2o,alloc=uniform; it is read by "
                                          "policy=snapkv"},
        {"policy=streaming,budget=8,pool=avg", "pool does nothing with policy=streaming"},
        {"policy=window,budget=8,gqa=max", "gqa does nothing with policy=window"},
        {"policy=snapkv,budget=8,sinks=8", "sinks does nothing with policy=snapkv,alloc=uniform; it is read by "
                                           "policy=streaming"},
        {"policy=snapkv,budget=8,p=0.5", "p does nothing with policy=snapkv,alloc=uniform; it is read by "
                                         "alloc=squeeze"},
        {"policy=snapkv,alloc=squeeze,budget=8,beta=10", "beta does nothing with policy=snapkv,alloc=squeeze"},
        {"policy=snapkv,ratio=0.1,interval=16", "interval does nothing"},
        {"policy=h2o,budget=8,decode_budget=16,interval=8", "interval does nothing with policy=h2o"},
        {"policy=full,kernel=11", "kernel does nothing with policy=full"},
        {"policy=full,sinks=2", "sinks does nothing with policy=full"},
    };
    struct skv_compress_spec s, t;
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        if (skv_compress_spec_parse(refused[i].spec, &s) != SKV_E_INVAL || !strstr(skv_error_msg(), refused[i].msg))
            fail_msg("%s: '%s', '%s' expected", refused[i].spec, skv_error_msg(), refused[i].msg);
        assert_int_equal(skv_compress_spec_parse_saved(refused[i].spec, &s), SKV_OK);
    }
    assert_int_equal(skv_compress_spec_parse_saved("policy=h2o,budget=8,kernel=11", &s), SKV_OK);
    assert_int_equal(s.kernel, 11);
    static const char *const taken[] = {
        "policy=h2o,budget=8,kernel=7,pool=max,sinks=4,p=0.3,beta=20,interval=64", /* the defaults */
        "policy=streaming,budget=8,window=16", /* window: the tokens COMPRESS runs again */
        "policy=window,budget=8,granularity=head",
        "policy=h2o,budget=8,gqa=max",
        "policy=snapkv,alloc=pyramid,budget=8,beta=10",
        "policy=streaming,alloc=squeeze,budget=8,p=0.5,sinks=2",
        "policy=snapkv,budget=8,decode_budget=16,interval=8,kernel=5,pool=avg",
    };
    char canon[512];
    for (size_t i = 0; i < sizeof taken / sizeof taken[0]; i++) {
        if (skv_compress_spec_parse(taken[i], &s) != SKV_OK)
            fail_msg("%s: %s", taken[i], skv_error_msg());
        assert_int_equal(skv_compress_spec_format(&s, canon, sizeof canon), SKV_OK);
        assert_int_equal(skv_compress_spec_parse(canon, &t), SKV_OK); /* its canonical text, every key */
        assert_memory_equal(&s, &t, sizeof s);
    }
    /* blanks around a pair (the last value's were taken as part of it) */
    assert_int_equal(skv_compress_spec_parse(" policy=snapkv , ratio=0.1 ", &s), SKV_OK);
    assert_true(s.policy == SKV_POLICY_SNAPKV && s.ratio == 0.1);
    /* no size: that first, not min_budget's "with budget=N" */
    assert_int_equal(skv_compress_spec_parse("policy=snapkv,min_budget=64", &s), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "needs budget=N or ratio=R"));
}

static void test_spec_format_and_budget(void **state)
{
    (void)state;
    struct skv_compress_spec s, t;
    char buf[512];
    assert_int_equal(skv_compress_spec_parse("policy=h2o,alloc=pyramid,budget=64,window=8,gqa=max", &s), SKV_OK);
    assert_int_equal(skv_compress_spec_format(&s, buf, sizeof buf), SKV_OK);
    assert_int_equal(skv_compress_spec_parse(buf, &t), SKV_OK);
    assert_memory_equal(&s, &t, sizeof s);
    assert_int_equal(skv_compress_spec_format(&s, buf, 8), SKV_E_LIMIT);
    assert_int_equal(skv_compress_spec_parse("policy=snapkv,budget=64,decode_budget=48,interval=8", &s), SKV_OK);
    assert_int_equal(skv_compress_spec_format(&s, buf, sizeof buf), SKV_OK);
    assert_int_equal(skv_compress_spec_parse(buf, &t), SKV_OK);
    assert_memory_equal(&s, &t, sizeof s);
    assert_int_equal(t.decode_budget, 48);
    assert_int_equal(t.interval, 8);
    /* ratio and p come back exactly (SAVE stores this text), in their shortest form */
    assert_int_equal(skv_compress_spec_parse("policy=snapkv,alloc=squeeze,ratio=0.1234567891,p=0.3", &s), SKV_OK);
    assert_int_equal(skv_compress_spec_format(&s, buf, sizeof buf), SKV_OK);
    assert_non_null(strstr(buf, "ratio=0.1234567891,"));
    assert_non_null(strstr(buf, ",p=0.3,"));
    assert_int_equal(skv_compress_spec_parse(buf, &t), SKV_OK);
    assert_true(t.ratio == s.ratio && t.p == s.p);
    /* budgets: ratio rounds up, at least 1, at most n */
    assert_int_equal(skv_compress_spec_parse("policy=snapkv,ratio=0.1", &s), SKV_OK);
    assert_int_equal(skv_compress_spec_budget(&s, 1000), 100);
    assert_int_equal(skv_compress_spec_budget(&s, 1001), 101);
    assert_int_equal(skv_compress_spec_budget(&s, 1), 1);
    assert_int_equal(skv_compress_spec_parse("policy=snapkv,ratio=0", &s), SKV_OK);
    assert_int_equal(skv_compress_spec_budget(&s, 500), 1);
    assert_int_equal(skv_compress_spec_parse("policy=snapkv,ratio=1", &s), SKV_OK);
    assert_int_equal(skv_compress_spec_budget(&s, 500), 500);
    assert_int_equal(skv_compress_spec_parse("policy=snapkv,budget=1024", &s), SKV_OK);
    assert_int_equal(skv_compress_spec_budget(&s, 300), 300);
    /* min_budget raises a ratio's budget on short prompts, still at most n */
    assert_int_equal(skv_compress_spec_parse("policy=snapkv,ratio=0.1,min_budget=96", &s), SKV_OK);
    assert_int_equal(s.min_budget, 96);
    assert_int_equal(skv_compress_spec_budget(&s, 512), 96);
    assert_int_equal(skv_compress_spec_budget(&s, 960), 96);
    assert_int_equal(skv_compress_spec_budget(&s, 961), 97);
    assert_int_equal(skv_compress_spec_budget(&s, 2000), 200);
    assert_int_equal(skv_compress_spec_budget(&s, 50), 50);
    assert_int_equal(skv_compress_spec_format(&s, buf, sizeof buf), SKV_OK);
    assert_non_null(strstr(buf, ",min_budget=96"));
    assert_int_equal(skv_compress_spec_parse(buf, &t), SKV_OK);
    assert_memory_equal(&s, &t, sizeof s);
    assert_int_equal(skv_compress_spec_parse("policy=snapkv,ratio=0.1", &s), SKV_OK);
    assert_int_equal(skv_compress_spec_format(&s, buf, sizeof buf), SKV_OK);
    assert_null(strstr(buf, "min_budget")); /* absent when unset */

    /* the short form: only what differs from the defaults, and it parses back to the same spec */
    static const struct {
        const char *in, *want;
    } shorts[] = {
        {"policy=full", "policy=full"},
        {"policy=snapkv,budget=4", "policy=snapkv,budget=4"},
        {"policy=snapkv,ratio=0.1,kernel=7,window=32", "policy=snapkv,ratio=0.1"},
        {"policy=h2o,alloc=pyramid,budget=64,window=8,gqa=max", "policy=h2o,alloc=pyramid,budget=64,window=8,gqa=max"},
        {"policy=snapkv,alloc=squeeze,ratio=0.2,min_budget=128,kernel=11,p=0.5,decode_budget=48,interval=8",
         "policy=snapkv,alloc=squeeze,ratio=0.2,min_budget=128,kernel=11,p=0.5,interval=8,decode_budget=48"},
        {"policy=streaming,alloc=pyramid,ratio=0.1,sinks=8,granularity=head,beta=10",
         "policy=streaming,alloc=pyramid,ratio=0.1,granularity=head,sinks=8,beta=10"},
    };
    for (size_t i = 0; i < sizeof shorts / sizeof shorts[0]; i++) {
        assert_int_equal(skv_compress_spec_parse(shorts[i].in, &s), SKV_OK);
        assert_int_equal(skv_compress_spec_format_short(&s, buf, sizeof buf), SKV_OK);
        assert_string_equal(buf, shorts[i].want);
        assert_int_equal(skv_compress_spec_parse(buf, &t), SKV_OK); /* the same spec: the same canonical text */
        char cs[512], ct[512];
        assert_int_equal(skv_compress_spec_format(&s, cs, sizeof cs), SKV_OK);
        assert_int_equal(skv_compress_spec_format(&t, ct, sizeof ct), SKV_OK);
        assert_string_equal(cs, ct);
    }
    assert_int_equal(skv_compress_spec_format_short(&s, buf, 10), SKV_E_LIMIT);
}

/* ---- policy pieces ----------------------------------------------------------------------- */

static void test_pyramid(void **state)
{
    (void)state;
    int b[4];
    /* B 40, w 8: avg 32, min 32/20 = 1, max 63, steps (63-1)/3 = 20 -> 71, 51, 31, 11 */
    skv_pyramid_budgets(4, 40, 8, 20, 1000, b);
    assert_int_equal(b[0], 71);
    assert_int_equal(b[1], 51);
    assert_int_equal(b[2], 31);
    assert_int_equal(b[3], 11);
    /* a shorter prompt clamps the top: max = n - w = 70 - 8 = 62, min = 64 - 62 = 2, steps 20 */
    skv_pyramid_budgets(4, 40, 8, 20, 70, b);
    assert_int_equal(b[0], 70);
    assert_int_equal(b[3], 10);
    /* below 2 (B - w) = 64 rows every layer keeps B (KVCache-Factory's middle case), below B all */
    skv_pyramid_budgets(4, 40, 8, 20, 50, b);
    for (int l = 0; l < 4; l++)
        assert_int_equal(b[l], 40);
    skv_pyramid_budgets(4, 40, 8, 20, 30, b);
    for (int l = 0; l < 4; l++)
        assert_int_equal(b[l], 30);
    /* one layer: no schedule, its budget (it had max + w = 118 of B 64) */
    skv_pyramid_budgets(1, 64, 8, 20, 1000, b);
    assert_int_equal(b[0], 64);
    skv_pyramid_budgets(1, 64, 8, 20, 50, b);
    assert_int_equal(b[0], 50);
}

static void test_squeeze_budgets(void **state)
{
    (void)state;
    const float sim[] = {0.50f, 0.98f, 0.97f, 0.70f, 0.99f, 0.72f, 0.98f, 0.51f};
    int b[8];
    skv_squeeze_budgets(sim, 8, 100, 0, 0.3, 10000, b);
    long total = 0;
    for (int l = 0; l < 8; l++)
        total += b[l];
    assert_int_equal(total, 800); /* conserved */
    /* the least-changing cluster {1, 2, 4, 6} gets p * B = 30; the other four share 680 */
    const int low[] = {1, 2, 4, 6}, high[] = {0, 3, 5, 7};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(b[low[i]], 30);
        assert_int_equal(b[high[i]], 170);
    }
    /* a prompt of 150 tokens caps the important layers at 150: the 80 they cannot hold go
     * back to the others, 20 each, and the total is still 800 */
    skv_squeeze_budgets(sim, 8, 100, 0, 0.3, 150, b);
    total = 0;
    for (int l = 0; l < 8; l++)
        total += b[l];
    assert_int_equal(total, 800);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(b[high[i]], 150);
        assert_int_equal(b[low[i]], 50);
    }
    /* a policy window of 32 stays on top: the low cluster gets 32 + 0.3 * 68 = 52, the others
     * (800 - 4 * 52) / 4 = 148; a window above the budget is the budget */
    skv_squeeze_budgets(sim, 8, 100, 32, 0.3, 10000, b);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(b[low[i]], 52);
        assert_int_equal(b[high[i]], 148);
    }
    skv_squeeze_budgets(sim, 8, 100, 500, 0.3, 10000, b);
    for (int i = 0; i < 4; i++)
        assert_int_equal(b[low[i]], 100);
    /* a NaN similarity is the most changing layer, and the others cluster as they would: the
     * least-changing {3, 4, 7} get 30 (before, -INFINITY made every split's cost NaN, the first
     * split won, and six layers got 30) */
    const float with_nan[] = {NAN, 0.1f, 0.2f, 0.9f, 0.95f, 0.5f, 0.55f, 0.92f};
    skv_squeeze_budgets(with_nan, 8, 100, 0, 0.3, 10000, b);
    for (int l = 0; l < 8; l++)
        assert_true(l == 3 || l == 4 || l == 7 ? b[l] == 30 : b[l] > 30);
    /* equal similarities share a cluster: {1, 2, 3} all 0.9 are squeezed together (before, a
     * split ran through them and layer 1 got the surplus); two distinct values: the higher
     * squeezed; one: uniform */
    const float ties[] = {0.5f, 0.9f, 0.9f, 0.9f, 0.1f};
    skv_squeeze_budgets(ties, 5, 100, 0, 0.3, 10000, b);
    assert_true(b[1] == 30 && b[2] == 30 && b[3] == 30 && b[0] + b[4] == 410);
    const float two[] = {0.4f, 0.8f, 0.4f, 0.8f};
    skv_squeeze_budgets(two, 4, 100, 0, 0.3, 10000, b);
    assert_true(b[1] == 30 && b[3] == 30 && b[0] == 170 && b[2] == 170);
    const float one[] = {0.7f, 0.7f, 0.7f, 0.7f};
    skv_squeeze_budgets(one, 4, 100, 0, 0.3, 10000, b);
    for (int l = 0; l < 4; l++)
        assert_int_equal(b[l], 100);
}

/* ---- whole compressed prefills on the tiny model ------------------------------------------ */


/* Runs a compressed forward of ids[0..n) onto cache (new when *cache is NULL). */
static void run(struct tiny *t, const char *spec_text, struct skv_kv_cache **cache, const int32_t *ids, int n,
                struct skv_compressor **keep)
{
    struct skv_compress_spec spec;
    struct skv_compressor *c = NULL;
    if (!*cache)
        assert_int_equal(skv_kv_cache_new(t->m, cache), SKV_OK);
    assert_int_equal(skv_compress_spec_parse(spec_text, &spec), SKV_OK);
    assert_int_equal(skv_compressor_new(&spec, t->m, &c), SKV_OK);
    assert_int_equal(skv_compressor_begin(c, *cache, n), SKV_OK);
    struct skv_forward_opts fo = {.hook = skv_compressor_hook, .hook_user = c};
    assert_int_equal(skv_engine_forward(t->e, *cache, ids, n, &fo, NULL), SKV_OK);
    assert_int_equal(skv_compressor_finish(c, *cache), SKV_OK);
    if (keep)
        *keep = c;
    else
        skv_compressor_free(&c);
}

/* The newest position a head holds (a StreamingLLM or window decode moves its newest rows into
 * the places of those it drops: the rows are then out of position order). */
static int32_t newest_pos(const struct skv_kv_head *kh)
{
    int32_t m = -1;
    for (int j = 0; j < kh->len; j++)
        m = kh->pos[j] > m ? kh->pos[j] : m;
    return m;
}

static bool holds_pos(const struct skv_kv_head *kh, int32_t p)
{
    for (int j = 0; j < kh->len; j++)
        if (kh->pos[j] == p)
            return true;
    return false;
}

static void expect_positions(struct skv_kv_cache *c, int layer, int h, const int32_t *want, int n)
{
    const struct skv_kv_head *kh = skv_kv_cache_head(c, layer, h);
    assert_int_equal(kh->len, n);
    assert_memory_equal(kh->pos, want, (size_t)n * sizeof *want);
}

static void test_streaming_and_window(void **state)
{
    struct tiny *t = *state;
    struct skv_kv_cache *c = NULL;
    run(t, "policy=streaming,budget=8,sinks=2", &c, t->ids, t->n, NULL);
    const int32_t s[] = {0, 1, 34, 35, 36, 37, 38, 39};
    for (int l = 0; l < c->n_layers; l++)
        for (int h = 0; h < c->n_kv_heads; h++) {
            expect_positions(c, l, h, s, 8);
            assert_true(skv_kv_cache_head(c, l, h)->cap <= 8 + 16); /* the memory went back */
            assert_int_equal(skv_kv_cache_head(c, l, h)->n_blocks, (8 + c->block_rows - 1) / c->block_rows);
        }
    assert_int_equal(c->n_past, 40);
    skv_kv_cache_free(&c);
    run(t, "policy=window,budget=5", &c, t->ids, t->n, NULL);
    const int32_t w[] = {35, 36, 37, 38, 39};
    expect_positions(c, 1, 1, w, 5);
    skv_kv_cache_free(&c);
    /* sinks >= budget: the earliest budget - 1 sinks and the newest row (the sinks filled it
     * before, and each decoded token went right after its own step) */
    run(t, "policy=streaming,budget=3,sinks=6", &c, t->ids, t->n, NULL);
    const int32_t s3[] = {0, 1, 39};
    expect_positions(c, 0, 0, s3, 3);
    skv_kv_cache_free(&c);
    run(t, "policy=streaming,budget=1,sinks=4", &c, t->ids, t->n, NULL);
    const int32_t s1[] = {39};
    expect_positions(c, 1, 1, s1, 1);
    skv_kv_cache_free(&c);
}

/* Naive SnapKV from the hook's view: softmax of each window query over the keys it sees,
 * mean over the window, mean over the group, max-pool, top (B - w) + window. */
struct naive {
    struct skv_compressor *c;
    int budget, window, kernel;
    int32_t want[2][4][64]; /* [layer][kv head][kept positions] */
};

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return x < y ? -1 : x > y;
}

static int naive_hook(void *user, const struct skv_layer_view *v)
{
    struct naive *nv = user;
    int l = v->layer, n = v->n, H = 4, hkv = v->cache->n_kv_heads, d = v->cache->head_dim, g = H / hkv;
    int w = nv->window < n ? nv->window : n;
    struct skv_kv_view kv = {0};
    skv_kv_cache_view(v->cache, l, &kv); /* CPU: the blocks are host memory */
    for (int h = 0; h < hkv; h++) {
        double score[64] = {0};
        for (int qh = h * g; qh < (h + 1) * g; qh++)
            for (int i = n - w; i < n; i++) {
                const float *q = v->q + ((size_t)i * H + qh) * d;
                double p[64], mx = -1e300, z = 0;
                for (int j = 0; j <= i; j++) {
                    double dot = 0;
                    for (int k = 0; k < d; k++)
                        dot += (double)q[k] * skv_kv_view_row(&kv, h, 0, j)[k];
                    p[j] = dot / sqrt((double)d);
                    mx = p[j] > mx ? p[j] : mx;
                }
                for (int j = 0; j <= i; j++)
                    z += p[j] = exp(p[j] - mx);
                for (int j = 0; j <= i; j++)
                    score[j] += p[j] / z / w / g;
            }
        int cand = n - w, keep = nv->budget - w;
        double pooled[64];
        for (int j = 0; j < cand; j++) {
            pooled[j] = -1;
            for (int t = j - nv->kernel / 2; t <= j + nv->kernel / 2; t++)
                if (t >= 0 && t < cand && score[t] > pooled[j])
                    pooled[j] = score[t];
        }
        int32_t *out = nv->want[l][h], k = 0;
        for (int r = 0; r < keep; r++) { /* top by pooled score, ties to the earlier position */
            int best = -1;
            for (int j = 0; j < cand; j++)
                if (pooled[j] >= 0 && (best < 0 || pooled[j] > pooled[best]))
                    best = j;
            out[k++] = best;
            pooled[best] = -2;
        }
        for (int j = cand; j < n; j++)
            out[k++] = j;
        qsort(out, (size_t)k, sizeof *out, cmp_i32);
    }
    return skv_compressor_hook(nv->c, v);
}

static void test_snapkv_matches_naive(void **state)
{
    struct tiny *t = *state;
    assert_int_equal(t->m->cfg.n_heads, 4);
    struct skv_compress_spec spec;
    struct naive nv = {.budget = 14, .window = 6, .kernel = 3};
    assert_int_equal(skv_compress_spec_parse("policy=snapkv,budget=14,window=6,kernel=3,pool=max,gqa=mean", &spec),
                     SKV_OK);
    struct skv_kv_cache *c = NULL;
    assert_int_equal(skv_kv_cache_new(t->m, &c), SKV_OK);
    assert_int_equal(skv_compressor_new(&spec, t->m, &nv.c), SKV_OK);
    assert_int_equal(skv_compressor_begin(nv.c, c, t->n), SKV_OK);
    struct skv_forward_opts fo = {.hook = naive_hook, .hook_user = &nv};
    assert_int_equal(skv_engine_forward(t->e, c, t->ids, t->n, &fo, NULL), SKV_OK);
    for (int l = 0; l < c->n_layers; l++)
        for (int h = 0; h < c->n_kv_heads; h++)
            expect_positions(c, l, h, nv.want[l][h], 14);
    skv_compressor_free(&nv.c);
    skv_kv_cache_free(&c);
}

static void test_edge_cases(void **state)
{
    struct tiny *t = *state;
    struct skv_kv_cache *c = NULL;
    int32_t all[40];
    for (int i = 0; i < 40; i++)
        all[i] = i;
    /* budget >= prompt: kept whole */
    run(t, "policy=snapkv,budget=64", &c, t->ids, t->n, NULL);
    expect_positions(c, 1, 0, all, 40);
    skv_kv_cache_free(&c);
    /* ratio 1: whole; ratio 0: one row (the newest) */
    run(t, "policy=snapkv,ratio=1", &c, t->ids, t->n, NULL);
    expect_positions(c, 0, 1, all, 40);
    skv_kv_cache_free(&c);
    run(t, "policy=snapkv,ratio=0", &c, t->ids, t->n, NULL);
    expect_positions(c, 0, 1, all + 39, 1);
    skv_kv_cache_free(&c);
    /* budget < window: the newest budget rows of the window */
    run(t, "policy=snapkv,budget=4,window=10", &c, t->ids, t->n, NULL);
    expect_positions(c, 1, 1, all + 36, 4);
    skv_kv_cache_free(&c);
    /* prompt shorter than the window, budget smaller than the prompt */
    run(t, "policy=snapkv,budget=3,window=32", &c, t->ids, 5, NULL);
    expect_positions(c, 0, 0, all + 2, 3);
    skv_kv_cache_free(&c);
    /* one-token prompt */
    for (int p = 0; p < 4; p++) {
        const char *specs[] = {"policy=snapkv,ratio=0.1", "policy=h2o,budget=1", "policy=streaming,budget=1",
                               "policy=window,ratio=0"};
        run(t, specs[p], &c, t->ids, 1, NULL);
        expect_positions(c, 0, 0, all, 1);
        skv_kv_cache_free(&c);
    }
}

static void test_head_granularity(void **state)
{
    struct tiny *t = *state;
    struct skv_kv_cache *c = NULL;
    run(t, "policy=snapkv,budget=12,window=4,granularity=head", &c, t->ids, t->n, NULL);
    bool differ = false;
    for (int l = 0; l < c->n_layers; l++) {
        int total = 0;
        for (int h = 0; h < c->n_kv_heads; h++) {
            const struct skv_kv_head *kh = skv_kv_cache_head(c, l, h);
            total += kh->len;
            differ |= kh->len != 12;
            for (int j = 36; j < 40; j++) { /* window kept in every head */
                bool found = false;
                for (int r = 0; r < kh->len; r++)
                    found |= kh->pos[r] == j;
                assert_true(found);
            }
            for (int r = 1; r < kh->len; r++)
                assert_true(kh->pos[r] > kh->pos[r - 1]);
        }
        assert_int_equal(total, 12 * c->n_kv_heads);
    }
    assert_true(differ); /* heads really keep different counts */
    /* bytes are real: the cache holds exactly the kept rows */
    assert_int_equal(skv_kv_cache_bytes(c), (uint64_t)12 * c->n_kv_heads * c->n_layers * 2 * c->head_dim * 4);
    skv_kv_cache_free(&c);
}

/* skv_kv_cache_drop_rows: the rows dropped (2, 5, 6 of 40, blocks of 4) take the head's last
 * rows (37, 38, 39), K, V, position and score, and the cache is marked unordered; a fork that
 * shared the blocks keeps its rows as they were (the blocks written were unshared); a row at the
 * end goes without a copy; skv_kv_cache_order puts the rows back in position order with the
 * same values; a copy of the first rows of an unordered cache is refused; a drop list that is
 * not increasing or out of range is refused and changes nothing. */
static void test_drop_rows(void **state)
{
    struct tiny *t = *state;
    assert_int_equal(skv_model_set_kv_pool(t->m, 4, SKV_DTYPE_F32), SKV_OK);
    struct skv_kv_cache *c = NULL, *fork = NULL, *part = NULL;
    assert_int_equal(skv_kv_cache_new(t->m, &c), SKV_OK);
    assert_int_equal(skv_kv_cache_reserve(c, 40), SKV_OK);
    const int d = c->head_dim, H = c->n_kv_heads;
    float *kr = calloc((size_t)40 * d, sizeof *kr), *vr = calloc((size_t)40 * d, sizeof *vr);
    assert_true(kr && vr);
    for (int h = 0; h < H; h++) {
        for (int j = 0; j < 40; j++)
            for (int e = 0; e < d; e++) {
                kr[(size_t)j * d + e] = (float)(j * 100 + e + 10000 * h);
                vr[(size_t)j * d + e] = -(float)(j * 100 + e + 10000 * h);
            }
        assert_int_equal(skv_kv_cache_write_rows(c, 0, h, 0, 0, 40, kr), SKV_OK);
        assert_int_equal(skv_kv_cache_write_rows(c, 0, h, 1, 0, 40, vr), SKV_OK);
        struct skv_kv_head *kh = skv_kv_cache_head(c, 0, h);
        for (int j = 0; j < 40; j++) {
            kh->pos[j] = j;
            kh->score[j] = (float)j / 2;
        }
    }
    c->n_past = 40;
    assert_int_equal(skv_kv_cache_clone(c, &fork), SKV_OK);
    const int32_t bad[][3] = {{5, 2, 6}, {2, 5, 40}, {-1, 2, 3}};
    for (int i = 0; i < 3; i++)
        assert_int_equal(skv_kv_cache_drop_rows(c, 0, 0, bad[i], 3), SKV_E_INVAL);
    assert_int_equal(skv_kv_cache_head(c, 0, 0)->len, 40);
    assert_false(c->unordered);
    const int32_t drop[] = {2, 5, 6};
    assert_int_equal(skv_kv_cache_drop_rows(c, 0, 0, drop, 3), SKV_OK);
    assert_true(c->unordered);
    const int32_t want[] = {0, 1, 37, 3, 4, 38, 39, 7};
    for (int pass = 0; pass < 2; pass++) { /* as dropped, then in order */
        const struct skv_kv_head *kh = skv_kv_cache_head(c, 0, 0);
        assert_int_equal(kh->len, 37);
        assert_int_equal(skv_kv_cache_read_rows(c, 0, 0, 0, 0, 37, kr), SKV_OK);
        assert_int_equal(skv_kv_cache_read_rows(c, 0, 0, 1, 0, 37, vr), SKV_OK);
        for (int j = 0; j < 37; j++) {
            if (pass == 0 && j < 8)
                assert_int_equal(kh->pos[j], want[j]);
            if (pass == 1)
                assert_int_equal(kh->pos[j], j < 2 ? j : j < 4 ? j + 1 : j + 3);
            assert_true(kh->score[j] == (float)kh->pos[j] / 2);
            for (int e = 0; e < d; e++) {
                assert_true(kr[(size_t)j * d + e] == (float)(kh->pos[j] * 100 + e));
                assert_true(vr[(size_t)j * d + e] == -(float)(kh->pos[j] * 100 + e));
            }
        }
        if (pass == 0) {
            assert_int_equal(skv_kv_cache_clone_rows(c, 10, &part), SKV_E_INTERNAL);
            assert_int_equal(skv_kv_cache_order(c), SKV_OK);
            assert_false(c->unordered);
        }
    }
    for (int h = 0; h < H; h++) { /* the fork's rows, and the other heads', as written */
        for (int k = 0; k < 2; k++) {
            struct skv_kv_cache *x = k ? c : fork;
            if (k && h == 0)
                continue;
            const struct skv_kv_head *kh = skv_kv_cache_head(x, 0, h);
            assert_int_equal(kh->len, 40);
            assert_int_equal(skv_kv_cache_read_rows(x, 0, h, 0, 0, 40, kr), SKV_OK);
            for (int j = 0; j < 40; j++) {
                assert_int_equal(kh->pos[j], j);
                assert_true(kr[(size_t)j * d + 1] == (float)(j * 100 + 1 + 10000 * h));
            }
        }
    }
    const int32_t last[] = {36};
    assert_int_equal(skv_kv_cache_drop_rows(c, 0, 0, last, 1), SKV_OK); /* no hole: no copy */
    assert_false(c->unordered);
    assert_int_equal(skv_kv_cache_head(c, 0, 0)->len, 36);
    free(kr);
    free(vr);
    skv_kv_cache_free(&fork);
    skv_kv_cache_free(&c);
    assert_int_equal(skv_model_set_kv_pool(t->m, SKV_KV_BLOCK_ROWS, SKV_DTYPE_F32), SKV_OK);
}

/* A StreamingLLM, window or H2O decode (its recent window, 3 rows, or 12: more than the budget,
 * found by position), its upkeep deferred to the forward's end as the daemon runs it, drops its
 * rows by moving the newest into their places (skv_kv_cache_drop_rows): the same
 * rows as the compaction keeps, and the same logits within float rounding (attention sums the
 * rows in another order). Checked against a twin whose upkeep runs inside the forward, which
 * compacts (rows in position order), blocks of 4 rows, 12 steps past a budget of 10, layer and
 * head granularity. */
static void test_decode_drop_matches(void **state)
{
    struct tiny *t = *state;
    const int nv = t->m->cfg.n_vocab;
    const char *specs[] = {"policy=streaming,budget=10,sinks=2", "policy=window,budget=10",
                           "policy=streaming,budget=10,sinks=2,alloc=pyramid",
                           "policy=streaming,budget=10,sinks=2,granularity=head",
                           "policy=window,budget=10,granularity=head", "policy=h2o,budget=10,window=3",
                           "policy=h2o,budget=10,window=3,granularity=head", "policy=h2o,budget=10,window=12"};
    float *lg[2] = {malloc((size_t)nv * sizeof(float)), malloc((size_t)nv * sizeof(float))};
    assert_true(lg[0] && lg[1]);
    assert_int_equal(skv_model_set_kv_pool(t->m, 4, SKV_DTYPE_F32), SKV_OK);
    for (int s = 0; s < 8; s++) {
        struct skv_kv_cache *c[2] = {NULL, NULL};
        struct skv_compressor *comp[2] = {NULL, NULL};
        for (int k = 0; k < 2; k++)
            run(t, specs[s], &c[k], t->ids, t->n, &comp[k]);
        double worst = 0;
        bool unordered = false;
        for (int step = 0; step < 12; step++) {
            int32_t tok = t->ids[(40 + step) % 64];
            /* 0 as the daemon decodes (the upkeep at the forward's end: rows dropped in place);
             * 1 with the upkeep inside the forward, which compacts */
            struct skv_forward_opts fo = {0}, inside = {.hook = skv_compressor_hook, .hook_user = comp[1]};
            assert_int_equal(skv_compressor_begin_step(comp[0], c[0], 1, true, &fo), SKV_OK);
            assert_int_equal(skv_engine_forward(t->e, c[0], &tok, 1, &fo, lg[0]), SKV_OK);
            assert_int_equal(skv_compressor_begin_decode(comp[1], c[1]), SKV_OK);
            assert_int_equal(skv_engine_forward(t->e, c[1], &tok, 1, &inside, lg[1]), SKV_OK);
            unordered |= c[0]->unordered;
            assert_false(c[1]->unordered);
            for (int i = 0; i < nv; i++)
                worst = fmax(worst, fabs((double)lg[0][i] - lg[1][i]));
            for (int l = 0; l < c[0]->n_layers; l++)
                for (int h = 0; h < c[0]->n_kv_heads; h++) {
                    const struct skv_kv_head *a = skv_kv_cache_head(c[0], l, h), *b = skv_kv_cache_head(c[1], l, h);
                    assert_int_equal(a->len, b->len);
                    for (int j = 0; j < b->len; j++)
                        assert_true(holds_pos(a, b->pos[j]));
                    assert_int_equal(newest_pos(a), 40 + step);
                }
        }
        print_message("%s: logits within %.2g of the compacting twin's\n", specs[s], worst);
        assert_true(unordered);
        assert_true(worst < 1e-4);
        if (s == 0) { /* a compressing forward (SnapKV reads rows by index) puts them back in order first */
            struct skv_compress_spec sp;
            struct skv_compressor *snap = NULL;
            assert_true(c[0]->unordered);
            assert_int_equal(skv_compress_spec_parse("policy=snapkv,budget=6,window=2", &sp), SKV_OK);
            assert_int_equal(skv_compressor_new(&sp, t->m, &snap), SKV_OK);
            assert_int_equal(skv_compressor_begin(snap, c[0], 1), SKV_OK);
            assert_false(c[0]->unordered);
            for (int l = 0; l < c[0]->n_layers; l++)
                for (int h = 0; h < c[0]->n_kv_heads; h++)
                    assert_true(skv_kv_head_in_order(skv_kv_cache_head(c[0], l, h)));
            skv_compressor_free(&snap);
        }
        for (int k = 0; k < 2; k++) {
            skv_compressor_free(&comp[k]);
            skv_kv_cache_free(&c[k]);
        }
    }
    assert_int_equal(skv_model_set_kv_pool(t->m, SKV_KV_BLOCK_ROWS, SKV_DTYPE_F32), SKV_OK);
    free(lg[0]);
    free(lg[1]);
}

/* Decode continues at the original positions; streaming and h2o keep evicting to budget;
 * logits after compression differ from full but decode runs. */
static void test_decode_eviction(void **state)
{
    struct tiny *t = *state;
    const char *specs[] = {"policy=streaming,budget=10,sinks=2", "policy=h2o,budget=10,window=3"};
    for (int s = 0; s < 2; s++) {
        struct skv_kv_cache *c = NULL;
        struct skv_compressor *comp = NULL;
        run(t, specs[s], &c, t->ids, t->n, &comp);
        struct skv_forward_opts fo = {.hook = skv_compressor_hook, .hook_user = comp};
        for (int k = 0; k < 6; k++) {
            int32_t tok = t->ids[40 + k];
            assert_int_equal(skv_compressor_begin_decode(comp, c), SKV_OK);
            assert_int_equal(skv_engine_forward(t->e, c, &tok, 1, &fo, NULL), SKV_OK);
            const struct skv_kv_head *kh = skv_kv_cache_head(c, 1, 0);
            assert_int_equal(kh->len, 10);
            assert_int_equal(newest_pos(kh), 40 + k); /* newest row at its original position */
            if (s == 0) /* the sinks stay, each in its place */
                assert_true(kh->pos[0] == 0 && kh->pos[1] == 1);
        }
        assert_int_equal(c->n_past, 46);
        skv_compressor_free(&comp);
        skv_kv_cache_free(&c);
    }
}

/* Head granularity while decoding: H2O's eviction and SnapKV's re-scoring (decode_budget) cut
 * one top-k over a layer's heads, so each layer keeps budget x heads rows in all, heads keep
 * different counts, and every head keeps its window (the newest token among it) in order. */
static void test_decode_head_granularity(void **state)
{
    struct tiny *t = *state;
    const char *specs[] = {"policy=h2o,budget=10,window=3,granularity=head",
                           "policy=snapkv,budget=10,window=4,granularity=head,decode_budget=10,interval=2"};
    for (int s = 0; s < 2; s++) {
        struct skv_kv_cache *c = NULL;
        struct skv_compressor *comp = NULL;
        run(t, specs[s], &c, t->ids, t->n, &comp);
        struct skv_forward_opts fo = {.hook = skv_compressor_hook, .hook_user = comp};
        bool differ = false;
        for (int k = 0; k < 7; k++) {
            int32_t tok = t->ids[40 + k];
            assert_int_equal(skv_compressor_begin_decode(comp, c), SKV_OK);
            assert_int_equal(skv_engine_forward(t->e, c, &tok, 1, &fo, NULL), SKV_OK);
            for (int l = 0; l < c->n_layers; l++) {
                int total = 0;
                for (int h = 0; h < c->n_kv_heads; h++) {
                    const struct skv_kv_head *kh = skv_kv_cache_head(c, l, h);
                    total += kh->len;
                    differ |= kh->len != 10;
                    assert_true(kh->len >= 3);
                    assert_int_equal(kh->pos[kh->len - 1], 40 + k); /* the newest, at its position */
                    for (int r = 1; r < kh->len; r++)
                        assert_true(kh->pos[r] > kh->pos[r - 1]);
                }
                /* SnapKV between re-scorings holds the rows decoded since (interval 2) */
                if (s == 0 || k % 2 == 1)
                    assert_int_equal(total, 10 * c->n_kv_heads);
                else
                    assert_true(total > 10 * c->n_kv_heads && total <= 11 * c->n_kv_heads);
            }
        }
        assert_true(differ);
        assert_int_equal(c->n_past, 47);
        skv_compressor_free(&comp);
        skv_kv_cache_free(&c);
    }
}

/* A compressed cache in an f16 pool decodes as the f32 one does: StreamingLLM keeps the same
 * positions (it reads none of the values), H2O its budget, and the logits stay within f16's
 * rounding of the f32 cache's. */
static void test_decode_f16_pool(void **state)
{
    struct tiny *t = *state;
    const int nv = t->m->cfg.n_vocab;
    const char *specs[] = {"policy=streaming,budget=10,sinks=2", "policy=h2o,budget=10,window=3"};
    float *lg[2];
    for (int s = 0; s < 2; s++) {
        struct skv_kv_cache *c[2] = {NULL, NULL};
        struct skv_compressor *comp[2] = {NULL, NULL};
        for (int d = 0; d < 2; d++) {
            lg[d] = malloc((size_t)nv * sizeof *lg[d]);
            assert_int_equal(skv_model_set_kv_pool(t->m, SKV_KV_BLOCK_ROWS, d ? SKV_DTYPE_F16 : SKV_DTYPE_F32),
                             SKV_OK);
            run(t, specs[s], &c[d], t->ids, t->n, &comp[d]);
            struct skv_forward_opts fo = {.hook = skv_compressor_hook, .hook_user = comp[d]};
            for (int k = 0; k < 5; k++) {
                int32_t tok = t->ids[40 + k];
                assert_int_equal(skv_compressor_begin_decode(comp[d], c[d]), SKV_OK);
                assert_int_equal(skv_engine_forward(t->e, c[d], &tok, 1, &fo, lg[d]), SKV_OK);
            }
        }
        assert_int_equal(skv_model_set_kv_pool(t->m, SKV_KV_BLOCK_ROWS, SKV_DTYPE_F32), SKV_OK);
        assert_true(skv_kv_cache_bytes(c[1]) * 2 == skv_kv_cache_bytes(c[0]));
        for (int l = 0; l < c[0]->n_layers; l++)
            for (int h = 0; h < c[0]->n_kv_heads; h++) {
                const struct skv_kv_head *a = skv_kv_cache_head(c[0], l, h), *b = skv_kv_cache_head(c[1], l, h);
                assert_int_equal(a->len, 10);
                assert_int_equal(b->len, 10);
                if (s == 0)
                    assert_memory_equal(a->pos, b->pos, 10 * sizeof *a->pos);
                assert_int_equal(newest_pos(b), 44);
            }
        double worst = 0;
        for (int i = 0; i < nv; i++)
            worst = fmax(worst, fabs((double)lg[0][i] - lg[1][i]));
        print_message("%s: f16 pool's logits within %.2g of the f32 pool's\n", specs[s], worst);
        assert_true(worst < 0.02);
        for (int d = 0; d < 2; d++) {
            skv_compressor_free(&comp[d]);
            skv_kv_cache_free(&c[d]);
            free(lg[d]);
        }
    }
}

/* Query-aware reuse: a document prefilled whole, cloned, a question appended with SnapKV:
 * the question is the observation window, the document's rows compete for the budget. */
static void test_query_aware_reuse(void **state)
{
    struct tiny *t = *state;
    struct skv_kv_cache *doc = NULL, *fork = NULL;
    run(t, "policy=full", &doc, t->ids, 32, NULL);
    assert_int_equal(skv_kv_cache_head(doc, 0, 0)->len, 32);
    assert_int_equal(skv_kv_cache_clone(doc, &fork), SKV_OK);
    run(t, "policy=snapkv,budget=16,window=8", &fork, t->ids + 32, 8, NULL);
    for (int l = 0; l < fork->n_layers; l++)
        for (int h = 0; h < fork->n_kv_heads; h++) {
            const struct skv_kv_head *kh = skv_kv_cache_head(fork, l, h);
            assert_int_equal(kh->len, 16);
            for (int j = 0; j < 8; j++)
                assert_int_equal(kh->pos[8 + j], 32 + j); /* the question, whole */
            for (int r = 0; r < 8; r++)
                assert_true(kh->pos[r] < 32); /* the rest from the document */
        }
    assert_int_equal(fork->n_past, 40);
    assert_int_equal(skv_kv_cache_head(doc, 0, 0)->len, 32); /* the document is untouched */
    skv_kv_cache_free(&doc);
    skv_kv_cache_free(&fork);
}

static void test_squeeze_conserves(void **state)
{
    struct tiny *t = *state;
    struct skv_kv_cache *c = NULL;
    struct skv_compressor *comp = NULL;
    run(t, "policy=snapkv,alloc=squeeze,budget=10,window=4", &c, t->ids, t->n, &comp);
    const float *sim = skv_compressor_similarity(comp);
    assert_non_null(sim);
    for (int l = 0; l < c->n_layers; l++)
        assert_true(sim[l] > -1.0f && sim[l] <= 1.0f);
    /* two layers: fewer than three clusters, so uniform: each head of each layer keeps 10 */
    for (int l = 0; l < c->n_layers; l++)
        for (int h = 0; h < c->n_kv_heads; h++)
            assert_int_equal(skv_kv_cache_head(c, l, h)->len, 10);
    skv_compressor_free(&comp);
    skv_kv_cache_free(&c);

    /* a budget whose 4 B cap holds the whole prompt: the layer is not cut during the forward
     * but must still be scored, so that finish() keeps what SnapKV keeps (not the first rows) */
    struct skv_kv_cache *u = NULL;
    run(t, "policy=snapkv,alloc=squeeze,budget=12,window=4", &c, t->ids, t->n, NULL);
    run(t, "policy=snapkv,budget=12,window=4", &u, t->ids, t->n, NULL);
    bool beyond_first = false;
    for (int l = 0; l < c->n_layers; l++)
        for (int h = 0; h < c->n_kv_heads; h++) {
            const struct skv_kv_head *kh = skv_kv_cache_head(u, l, h);
            expect_positions(c, l, h, kh->pos, kh->len);
            beyond_first |= kh->pos[7] != 7;
        }
    assert_true(beyond_first);
    skv_kv_cache_free(&u);
    skv_kv_cache_free(&c);
}

/* ---- SnapKV re-scoring while decoding ---------------------------------------------------- */

/* One decode step by hand on layer 0 of a cache whose rows we wrote: a new row (key 0) at
 * position n_past and the queries q [n_heads][head_dim], through begin_decode and the hook. */
static void synthetic_step(struct skv_compressor *comp, struct skv_kv_cache *c, const float *q)
{
    assert_int_equal(skv_compressor_begin_decode(comp, c), SKV_OK);
    float zero[256] = {0};
    assert_true(c->head_dim <= 256);
    for (int h = 0; h < c->n_kv_heads; h++) {
        struct skv_kv_head *kh = skv_kv_cache_head(c, 0, h);
        int r = kh->len;
        assert_int_equal(skv_kv_cache_write_rows(c, 0, h, 0, r, 1, zero), SKV_OK);
        assert_int_equal(skv_kv_cache_write_rows(c, 0, h, 1, r, 1, zero), SKV_OK);
        kh->pos[r] = c->n_past;
        kh->score[r] = 0;
        assert_int_equal(kh->len, r + 1);
    }
    struct skv_layer_view v = {.layer = 0, .n = 1, .q = q, .cache = c};
    assert_int_equal(skv_compressor_hook(comp, &v), SKV_OK);
    c->n_past++;
}

/* StreamingLLM while decoding past position 2^24, where neighbouring positions are one float:
 * the newest row stays and the one before it goes (before, both ranked 16777216.0f, the tie
 * went to the older row, and the token just decoded was dropped). */
static void test_streaming_high_positions(void **state)
{
    struct tiny *t = *state;
    struct skv_kv_cache *c = NULL;
    struct skv_compressor *comp = NULL;
    run(t, "policy=streaming,budget=5,sinks=4", &c, t->ids, 5, &comp);
    for (int h = 0; h < c->n_kv_heads; h++)
        skv_kv_cache_head(c, 0, h)->pos[4] = 16777216;
    c->n_past = 16777217;
    float q[1024] = {0};
    assert_true(t->m->cfg.n_heads * c->head_dim <= 1024);
    synthetic_step(comp, c, q);
    const int32_t want[] = {0, 1, 2, 3, 16777217};
    for (int h = 0; h < c->n_kv_heads; h++)
        expect_positions(c, 0, h, want, 5);
    skv_compressor_free(&comp);
    skv_kv_cache_free(&c);
}

/* Hand-computed: 10 rows whose keys are c_j * e0 and queries e0 in every head, so each
 * query's attention grows with c_j; after 2 decoded tokens (interval 2) the 12 rows are cut
 * to decode_budget 6: the 2-token window plus the 4 best of rows 0..9 (kernel 1: by c_j,
 * ties to the earlier row; kernel 3: by the max of c over the neighbours). */
static void test_decode_rescore_hand(void **state)
{
    struct tiny *t = *state;
    const float cval[2][10] = {{0, 5, 0, 3, 0, 0, 4, 0, 0, 1}, {2, 0, 0, 0, 6, 0, 0, 0, 5, 0}};
    const int32_t want[2][2][6] = {
        {{1, 3, 6, 9, 10, 11}, {0, 1, 4, 8, 10, 11}}, /* kernel 1 */
        {{0, 1, 2, 5, 10, 11}, {3, 4, 5, 7, 10, 11}}, /* kernel 3 */
    };
    const char *specs[] = {"policy=snapkv,budget=6,window=2,kernel=1,decode_budget=6,interval=2",
                           "policy=snapkv,budget=6,window=2,kernel=3,decode_budget=6,interval=2"};
    for (int k = 0; k < 2; k++) {
        struct skv_kv_cache *c = NULL;
        struct skv_compress_spec spec;
        struct skv_compressor *comp = NULL;
        assert_int_equal(skv_kv_cache_new(t->m, &c), SKV_OK);
        assert_int_equal(skv_kv_cache_reserve(c, 16), SKV_OK);
        int d = c->head_dim;
        for (int h = 0; h < 2; h++) {
            float kr[10 * 16] = {0}, vr[10 * 16] = {0};
            assert_true(d <= 16);
            for (int j = 0; j < 10; j++) {
                kr[(size_t)j * d] = cval[h][j];
                vr[(size_t)j * d] = (float)j;
            }
            assert_int_equal(skv_kv_cache_write_rows(c, 0, h, 0, 0, 10, kr), SKV_OK);
            assert_int_equal(skv_kv_cache_write_rows(c, 0, h, 1, 0, 10, vr), SKV_OK);
            struct skv_kv_head *kh = skv_kv_cache_head(c, 0, h);
            for (int j = 0; j < 10; j++)
                kh->pos[j] = j;
            assert_int_equal(kh->len, 10);
        }
        c->n_past = 10;
        float q[4 * 16] = {0};
        for (int qh = 0; qh < 4; qh++)
            q[qh * d] = 1.0f;
        assert_int_equal(skv_compress_spec_parse(specs[k], &spec), SKV_OK);
        assert_int_equal(skv_compressor_new(&spec, t->m, &comp), SKV_OK);
        synthetic_step(comp, c, q);
        assert_int_equal(skv_kv_cache_head(c, 0, 0)->len, 11); /* 1 of 2: nothing cut yet */
        synthetic_step(comp, c, q);
        for (int h = 0; h < 2; h++) {
            const struct skv_kv_head *kh = skv_kv_cache_head(c, 0, h);
            expect_positions(c, 0, h, want[k][h], 6);
            float kr[6 * 16], vr[6 * 16];
            assert_int_equal(skv_kv_cache_read_rows(c, 0, h, 0, 0, 6, kr), SKV_OK);
            assert_int_equal(skv_kv_cache_read_rows(c, 0, h, 1, 0, 6, vr), SKV_OK);
            for (int r = 0; r < 6; r++) { /* K and V moved with their positions */
                float cj = kh->pos[r] < 10 ? cval[h][kh->pos[r]] : 0;
                assert_true(kr[(size_t)r * d] == cj);
                assert_true(vr[(size_t)r * d] == (kh->pos[r] < 10 ? (float)kh->pos[r] : 0));
            }
            /* memory released: room for one interval, in whole blocks */
            assert_true(kh->n_blocks * c->block_rows <= ((6 + 2 + c->block_rows - 1) / c->block_rows) * c->block_rows);
        }
        assert_int_equal(c->n_past, 12);
        skv_compressor_free(&comp);
        skv_kv_cache_free(&c);
    }
}

/* Naive re-scoring in double precision from the hook's view: every decoded token's queries
 * are recorded; at each interval boundary the expected rows come from the cache as the
 * forward left it (softmax of the newest min(w, D, decoded) queries over the rows each can
 * see, mean over queries and the group, max-pool over the rows before the kept window, top
 * D - w_keep, plus the newest w_keep). */
struct naive_dec {
    struct skv_compressor *c;
    int budget, window, kernel, interval;
    int step;                      /* decoded tokens before this forward */
    float q[2][32][4 * 16];        /* [layer][step][n_heads * head_dim] */
    bool check[2];
    int32_t want[2][2][64];
};

/* p[0..last]: the softmax of q over key rows 0..last (keys [rows][d]), in double precision. */
static void softmax_over(const float *q, const float *keys, int d, int last, double *p)
{
    double mx = -1e300, z = 0;
    for (int j = 0; j <= last; j++) {
        double dot = 0;
        for (int k = 0; k < d; k++)
            dot += (double)q[k] * keys[(size_t)j * d + k];
        p[j] = dot / sqrt((double)d);
        mx = p[j] > mx ? p[j] : mx;
    }
    for (int j = 0; j <= last; j++)
        z += p[j] = exp(p[j] - mx);
    for (int j = 0; j <= last; j++)
        p[j] /= z;
}

static int naive_dec_hook(void *user, const struct skv_layer_view *v)
{
    struct naive_dec *nd = user;
    int l = v->layer, H = 4, hkv = v->cache->n_kv_heads, d = v->cache->head_dim, g = H / hkv;
    memcpy(nd->q[l][nd->step], v->q, sizeof nd->q[l][nd->step]);
    int seen = nd->step + 1;
    nd->check[l] = seen % nd->interval == 0 && skv_kv_cache_head(v->cache, l, 0)->len > nd->budget;
    if (!nd->check[l])
        return skv_compressor_hook(nd->c, v);
    int w_keep = nd->window < nd->budget ? nd->window : nd->budget;
    int w_q = seen < w_keep ? seen : w_keep;
    for (int h = 0; h < hkv; h++) {
        const struct skv_kv_head *kh = skv_kv_cache_head(v->cache, l, h);
        int n = kh->len;
        double score[64] = {0};
        float keys[64 * 16];
        assert_true(n <= 64 && d <= 16);
        assert_int_equal(skv_kv_cache_read_rows(v->cache, l, h, 0, 0, n, keys), SKV_OK);
        for (int qh = h * g; qh < (h + 1) * g; qh++)
            for (int i = 0; i < w_q; i++) {
                int last = n - w_q + i; /* its own row */
                double p[64];
                softmax_over(nd->q[l][seen - w_q + i] + qh * d, keys, d, last, p);
                for (int j = 0; j <= last; j++)
                    score[j] += p[j] / w_q / g;
            }
        int cand = n - w_keep, keep = nd->budget - w_keep;
        double pooled[64];
        for (int j = 0; j < cand; j++) {
            pooled[j] = -1;
            for (int t = j - nd->kernel / 2; t <= j + nd->kernel / 2; t++)
                if (t >= 0 && t < cand && score[t] > pooled[j])
                    pooled[j] = score[t];
        }
        int32_t *out = nd->want[l][h], k = 0;
        for (int r = 0; r < keep; r++) {
            int best = -1;
            for (int j = 0; j < cand; j++)
                if (pooled[j] >= 0 && (best < 0 || pooled[j] > pooled[best]))
                    best = j;
            out[k++] = kh->pos[best];
            pooled[best] = -2;
        }
        for (int j = cand; j < n; j++)
            out[k++] = kh->pos[j];
        qsort(out, (size_t)k, sizeof *out, cmp_i32);
    }
    return skv_compressor_hook(nd->c, v);
}

static void test_decode_rescore_matches_naive(void **state)
{
    struct tiny *t = *state;
    /* interval 3 (the first window has 3 queries, then 4); interval 1 (1, 2, 3, then 4) */
    const char *specs[] = {"policy=snapkv,budget=20,window=4,kernel=3,decode_budget=12,interval=3",
                           "policy=snapkv,budget=20,window=4,kernel=1,decode_budget=9,interval=1"};
    const int budgets[] = {12, 9}, kernels[] = {3, 1}, intervals[] = {3, 1};
    for (int s = 0; s < 2; s++) {
        struct skv_kv_cache *c = NULL;
        struct naive_dec *nd = calloc(1, sizeof *nd);
        run(t, specs[s], &c, t->ids, t->n, &nd->c);
        nd->budget = budgets[s];
        nd->window = 4;
        nd->kernel = kernels[s];
        nd->interval = intervals[s];
        struct skv_forward_opts fo = {.hook = naive_dec_hook, .hook_user = nd};
        int len = 20, rescored = 0;
        for (int k = 0; k < 10; k++) {
            nd->step = k;
            assert_int_equal(skv_compressor_begin_decode(nd->c, c), SKV_OK);
            assert_int_equal(skv_engine_forward(t->e, c, &t->ids[40 + k], 1, &fo, NULL), SKV_OK);
            len = (k + 1) % nd->interval == 0 && len + 1 > nd->budget ? nd->budget : len + 1;
            for (int l = 0; l < c->n_layers; l++)
                for (int h = 0; h < c->n_kv_heads; h++) {
                    const struct skv_kv_head *kh = skv_kv_cache_head(c, l, h);
                    assert_int_equal(kh->len, len); /* the bound, exactly */
                    assert_int_equal(kh->pos[kh->len - 1], 40 + k);
                    if (nd->check[l]) {
                        expect_positions(c, l, h, nd->want[l][h], nd->budget);
                        rescored++;
                    }
                }
        }
        assert_int_equal(rescored, 2 * 2 * (s == 0 ? 3 : 10));
        assert_int_equal(c->n_past, 50); /* positions continue from the original length */
        skv_compressor_free(&nd->c);
        free(nd);
        skv_kv_cache_free(&c);
    }
}

/* Naive H2O in double precision, from the hook's view: each query's softmax over the rows it
 * sees, summed over every query so far (the prompt's, then each decoded token's), averaged over
 * the group's query heads, by original position; the newest `window` rows and the top
 * (B - window) of the rest by that sum (ties to the earlier position), no pooling. */
struct naive_h2o {
    struct skv_compressor *c;
    int budget, window;
    double score[2][2][64];  /* [layer][kv head][original position] */
    int32_t want[2][2][64];
    int n_want;
    int n_probs;             /* layer views of a decode step that came with the probabilities */
};

static int naive_h2o_hook(void *user, const struct skv_layer_view *v)
{
    struct naive_h2o *nh = user;
    int l = v->layer, H = 4, hkv = v->cache->n_kv_heads, d = v->cache->head_dim, g = H / hkv;
    assert_true(hkv == 2 && d <= 16 && v->cache->n_layers == 2);
    for (int h = 0; h < hkv; h++) {
        const struct skv_kv_head *kh = skv_kv_cache_head(v->cache, l, h);
        int n = kh->len;
        float keys[64 * 16];
        assert_true(n <= 64);
        assert_int_equal(skv_kv_cache_read_rows(v->cache, l, h, 0, 0, n, keys), SKV_OK);
        for (int qh = h * g; qh < (h + 1) * g; qh++)
            for (int i = 0; i < v->n; i++) {
                int last = n - v->n + i; /* the query's own row */
                double p[64];
                softmax_over(v->q + ((size_t)i * H + qh) * d, keys, d, last, p);
                for (int j = 0; j <= last; j++)
                    nh->score[l][h][kh->pos[j]] += p[j] / g;
            }
        int32_t *out = nh->want[l][h], k = 0;
        int keep = n < nh->budget ? n : nh->budget, w = nh->window < keep ? nh->window : keep;
        bool taken[64] = {false};
        for (int j = n - w; j < n; j++)
            taken[j] = true;
        for (int r = w; r < keep; r++) {
            int best = -1;
            for (int j = 0; j < n - w; j++)
                if (!taken[j] && (best < 0 || nh->score[l][h][kh->pos[j]] > nh->score[l][h][kh->pos[best]]))
                    best = j;
            taken[best] = true;
        }
        for (int j = 0; j < n; j++)
            if (taken[j])
                out[k++] = kh->pos[j];
        nh->n_want = k;
    }
    if (v->n == 1 && v->probs)
        nh->n_probs++;
    return skv_compressor_hook(nh->c, v);
}

/* attention_colsum calls so far (h2o_vs_naive's backend) */
static int (*g_real_colsum)(struct skv_backend *, float *, int64_t, const float *, int, int,
                            const struct skv_kv_view *, int);
static int g_colsum_calls;

static int counting_colsum(struct skv_backend *be, float *out, int64_t out_stride, const float *q, int n,
                           int n_heads, const struct skv_kv_view *kv, int q_first)
{
    g_colsum_calls++;
    return g_real_colsum(be, out, out_stride, q, n, n_heads, kv, q_first);
}

/* H2O keeps, after the prefill and after each decoded token, the rows a naive double-precision
 * H2O keeps: the attention every query gave a row, added up across the prompt and the decode
 * steps, with the recent window always kept. With probs, each decode step is scored by the
 * probabilities the attention itself computed (skv_forward_opts.attention_probs). */
static int no_alloc(struct skv_backend *be, size_t bytes, void **out)
{
    (void)be;
    (void)bytes;
    *out = NULL;
    return SKV_E_NOMEM;
}

/* no_memory: every allocation of the decode steps fails (the engine's buffer for the
 * probabilities is the only one they make): the hook computes them itself. */
static void h2o_vs_naive(struct tiny *t, bool probs, bool no_memory)
{
    if (no_memory)
        skv_engine_release_scratch(t->e); /* (so the buffer is made again, in the decode steps) */
    assert_int_equal(t->m->cfg.n_heads, 4);
    for (int l = 0; l < t->m->cfg.n_layers; l++)
        assert_int_equal(t->m->layers[l].window, 0); /* every row is seen */
    struct naive_h2o *nh = calloc(1, sizeof *nh);
    assert_non_null(nh);
    nh->budget = 12;
    nh->window = 3;
    struct skv_compress_spec spec;
    assert_int_equal(skv_compress_spec_parse("policy=h2o,budget=12,window=3", &spec), SKV_OK);
    struct skv_kv_cache *c = NULL;
    assert_int_equal(skv_kv_cache_new(t->m, &c), SKV_OK);
    assert_int_equal(skv_compressor_new(&spec, t->m, &nh->c), SKV_OK);
    assert_int_equal(skv_compressor_begin(nh->c, c, t->n), SKV_OK);
    struct skv_forward_opts fo = {.hook = naive_h2o_hook, .hook_user = nh, .attention_probs = probs};
    assert_int_equal(skv_engine_forward(t->e, c, t->ids, t->n, &fo, NULL), SKV_OK);
    assert_int_equal(skv_compressor_finish(nh->c, c), SKV_OK);
    struct skv_backend *be = t->m->be;
    const struct skv_backend_ops *real = be->ops;
    static struct skv_backend_ops counting; /* (static: a failed assert below leaves be->ops on it) */
    counting = *real;
    g_real_colsum = real->attention_colsum;
    counting.attention_colsum = counting_colsum;
    if (no_memory)
        counting.alloc = no_alloc;
    be->ops = &counting;
    g_colsum_calls = 0;
    int differs = 0; /* H2O's rows are not simply the newest (the test could not tell) */
    for (int k = 0; k <= 8; k++) {
        if (k > 0) {
            assert_int_equal(skv_compressor_begin_decode(nh->c, c), SKV_OK);
            assert_int_equal(skv_engine_forward(t->e, c, &t->ids[t->n + k - 1], 1, &fo, NULL), SKV_OK);
        }
        for (int l = 0; l < c->n_layers; l++)
            for (int h = 0; h < c->n_kv_heads; h++) {
                /* the hook saw layer l's rows before the forward's cut: want is per (l, h) */
                expect_positions(c, l, h, nh->want[l][h], 12);
                differs += nh->want[l][h][0] != t->n + k - 12;
            }
    }
    assert_true(differs > 0);
    assert_int_equal(c->n_past, t->n + 8);
    be->ops = real;
    const bool used = probs && !no_memory;
    assert_int_equal(nh->n_probs, used ? 8 * c->n_layers : 0);
    assert_int_equal(g_colsum_calls, used ? 0 : 8 * c->n_layers); /* none scored again */
    skv_compressor_free(&nh->c);
    free(nh);
    skv_kv_cache_free(&c);
}

static void test_h2o_matches_naive(void **state)
{
    h2o_vs_naive(*state, false, false);
    h2o_vs_naive(*state, true, true);
    h2o_vs_naive(*state, true, false);
}

/* Decodes k tokens with the compressor's hook. */
static void decode_steps(struct tiny *t, struct skv_compressor *comp, struct skv_kv_cache *c, int first, int k)
{
    struct skv_forward_opts fo = {.hook = skv_compressor_hook, .hook_user = comp};
    for (int i = 0; i < k; i++) {
        assert_int_equal(skv_compressor_begin_decode(comp, c), SKV_OK);
        assert_int_equal(skv_engine_forward(t->e, c, &t->ids[first + i], 1, &fo, NULL), SKV_OK);
    }
}

/* A fixed budget grown past the prompt while decoding (layers at 20 rows, 13 positions) is a
 * state LOAD takes back. */
static void test_state_grown_budget(void **state)
{
    struct tiny *t = *state;
    const char *spec_text = "policy=h2o,budget=20,window=3";
    struct skv_kv_cache *a = NULL;
    struct skv_compressor *ca = NULL, *cb = NULL;
    run(t, spec_text, &a, t->ids, 12, &ca);
    decode_steps(t, ca, a, 40, 1);
    assert_int_equal(skv_compressor_layer_budgets(ca)[0], 20);
    size_t len = skv_compressor_state_size(ca, a->n_past);
    unsigned char *buf = malloc(len);
    assert_non_null(buf);
    assert_int_equal(skv_compressor_state_write(ca, a->n_past, buf), SKV_OK);
    struct skv_compress_spec spec;
    assert_int_equal(skv_compress_spec_parse(spec_text, &spec), SKV_OK);
    assert_int_equal(skv_compressor_new(&spec, t->m, &cb), SKV_OK);
    assert_int_equal(skv_compressor_state_read(cb, buf, len, a->n_past), SKV_OK);
    assert_memory_equal(skv_compressor_layer_budgets(cb), skv_compressor_layer_budgets(ca),
                        (size_t)a->n_layers * sizeof(int));
    free(buf);
    skv_compressor_free(&ca);
    skv_compressor_free(&cb);
    skv_kv_cache_free(&a);
}

/* COMPRESS to H2O runs the last tokens again: each query still counts once. After an H2O
 * session the scores equal one H2O forward over the whole prompt; after another policy every
 * row's score comes from the re-run queries alone. */
static void test_h2o_rerun_counts_once(void **state)
{
    struct tiny *t = *state;
    const int cut = 32;
    const char *specs[] = {"policy=h2o,budget=64,window=4", "policy=window,budget=64"};
    struct skv_kv_cache *whole = NULL;
    run(t, specs[0], &whole, t->ids, t->n, NULL); /* budget above the prompt: every row kept, scored */
    for (int k = 0; k < 2; k++) {
        struct skv_kv_cache *c = NULL;
        run(t, specs[k], &c, t->ids, t->n, NULL);
        int H = c->n_kv_heads;
        for (int i = 0; i < c->n_layers * H; i++) {
            const struct skv_kv_head *kh = &c->heads[i];
            int len = kh->len;
            while (len > 0 && kh->pos[len - 1] >= cut)
                len--;
            assert_int_equal(skv_kv_cache_truncate(c, i / H, i % H, len), SKV_OK);
        }
        c->n_past = cut;
        struct skv_compress_spec spec;
        struct skv_compressor *comp = NULL;
        assert_int_equal(skv_compress_spec_parse(specs[0], &spec), SKV_OK);
        assert_int_equal(skv_compressor_new(&spec, t->m, &comp), SKV_OK);
        skv_compressor_rerun(comp, c, k == 0, cut);
        assert_int_equal(skv_compressor_begin(comp, c, t->n - cut), SKV_OK);
        struct skv_forward_opts fo = {.hook = skv_compressor_hook, .hook_user = comp};
        assert_int_equal(skv_engine_forward(t->e, c, t->ids + cut, t->n - cut, &fo, NULL), SKV_OK);
        assert_int_equal(skv_compressor_finish(comp, c), SKV_OK);
        for (int i = 0; i < c->n_layers * H; i++) {
            const struct skv_kv_head *x = &whole->heads[i], *y = &c->heads[i];
            assert_int_equal(y->len, t->n);
            for (int j = 0; j < y->len; j++) {
                float want = x->score[j];
                if (k == 1 && j < cut) /* the re-run queries' share alone: less than the whole sum */
                    assert_true(y->score[j] <= want + 1e-4f);
                else if (fabsf(y->score[j] - want) > 1e-4f * (1 + fabsf(want)))
                    fail_msg("%s first: head %d row %d score %g, one forward %g", specs[k], i, j, y->score[j], want);
            }
        }
        skv_compressor_free(&comp);
        skv_kv_cache_free(&c);
    }
    skv_kv_cache_free(&whole);
}

/* A fixed budget above the prompt keeps the prompt whole, and decoding then grows each layer
 * to the budget (allocated as the spec says) instead of holding it at the prompt's length. */
static void test_fixed_budget_above_prompt(void **state)
{
    struct tiny *t = *state;
    const char *specs[] = {"policy=window,budget=20", "policy=streaming,budget=20,sinks=2",
                           "policy=h2o,budget=20,window=3", "policy=h2o,budget=20,window=3,alloc=pyramid"};
    for (int s = 0; s < 4; s++) {
        struct skv_kv_cache *c = NULL;
        struct skv_compressor *comp = NULL;
        run(t, specs[s], &c, t->ids, 12, &comp);
        for (int l = 0; l < c->n_layers; l++)
            assert_int_equal(skv_kv_cache_head(c, l, 0)->len, 12); /* whole */
        decode_steps(t, comp, c, 40, 14);
        assert_int_equal(c->n_past, 26);
        int want[8];
        skv_pyramid_budgets(c->n_layers, 20, 3, skv_compressor_spec(comp)->pyramid_beta, 2 * 20 + 3 + 1, want);
        for (int l = 0; l < c->n_layers; l++) {
            int b = s == 3 ? want[l] : 20;
            const struct skv_kv_head *kh = skv_kv_cache_head(c, l, 0);
            if (kh->len != (b < 26 ? b : 26))
                fail_msg("%s: layer %d keeps %d rows, budget %d", specs[s], l, kh->len, b);
            assert_int_equal(newest_pos(kh), 25); /* the newest token is kept */
        }
        skv_compressor_free(&comp);
        skv_kv_cache_free(&c);
    }
}

static void test_decode_rescore_edges(void **state)
{
    struct tiny *t = *state;
    struct skv_kv_cache *c = NULL;
    struct skv_compressor *comp = NULL;
    /* decode_budget < window: only the newest decode_budget rows stay, every interval */
    run(t, "policy=snapkv,budget=10,window=8,decode_budget=5,interval=1", &c, t->ids, t->n, &comp);
    for (int k = 0; k < 4; k++) {
        decode_steps(t, comp, c, 40 + k, 1);
        int32_t newest[5];
        for (int i = 0; i < 5; i++)
            newest[i] = 36 + k + i;
        for (int l = 0; l < c->n_layers; l++)
            for (int h = 0; h < c->n_kv_heads; h++)
                expect_positions(c, l, h, newest, 5);
    }
    skv_compressor_free(&comp);
    skv_kv_cache_free(&c);
    /* decode_budget >= length: nothing is cut, rows append at positions 40, 41, ... */
    run(t, "policy=snapkv,budget=10,window=4,decode_budget=100,interval=1", &c, t->ids, t->n, &comp);
    int32_t before[10];
    memcpy(before, skv_kv_cache_head(c, 1, 1)->pos, sizeof before);
    decode_steps(t, comp, c, 40, 6);
    const struct skv_kv_head *kh = skv_kv_cache_head(c, 1, 1);
    assert_int_equal(kh->len, 16);
    assert_memory_equal(kh->pos, before, sizeof before);
    for (int i = 0; i < 6; i++)
        assert_int_equal(kh->pos[10 + i], 40 + i);
    skv_compressor_free(&comp);
    skv_kv_cache_free(&c);
    /* head granularity: one top-k over the layer's heads at each boundary, the window in each */
    run(t, "policy=snapkv,budget=16,window=4,granularity=head,decode_budget=8,interval=2", &c, t->ids, t->n, &comp);
    for (int k = 0; k < 6; k++) {
        decode_steps(t, comp, c, 40 + k, 1);
        for (int l = 0; l < c->n_layers; l++) {
            int total = 0;
            for (int h = 0; h < c->n_kv_heads; h++) {
                const struct skv_kv_head *hh = skv_kv_cache_head(c, l, h);
                total += hh->len;
                if (k % 2 == 1)
                    for (int i = 0; i < 4; i++) /* the newest window, whole */
                        assert_int_equal(hh->pos[hh->len - 4 + i], 40 + k - 3 + i);
            }
            assert_int_equal(total, k % 2 == 1 ? 8 * 2 : k == 0 ? 2 * 16 + 2 : 8 * 2 + 2);
        }
    }
    skv_compressor_free(&comp);
    skv_kv_cache_free(&c);
}

/* decode_budget is the layers' mean: a PyramidKV allocation keeps its shape while decoding
 * (layer l gets D * b_l / mean(b), total conserved), for SnapKV re-scoring and H2O alike. */
static void test_decode_budget_spread(void **state)
{
    struct tiny *t = *state;
    const char *specs[] = {"policy=snapkv,alloc=pyramid,budget=16,window=4,decode_budget=9,interval=2",
                           "policy=h2o,alloc=pyramid,budget=16,window=4,decode_budget=9"};
    for (int si = 0; si < 2; si++) {
        struct skv_kv_cache *c = NULL;
        struct skv_compressor *comp = NULL;
        run(t, specs[si], &c, t->ids, t->n, &comp);
        assert_int_equal(c->n_layers, 2);
        const int *b = skv_compressor_layer_budgets(comp);
        int b0 = b[0], b1 = b[1];
        assert_true(b0 != b1); /* pyramid: the lower layer gets more */
        assert_int_equal(skv_kv_cache_head(c, 0, 0)->len, b0);
        /* by hand: 18 rows in all, split 9 * 2 * b_l / (b0 + b1), the spare row to the larger
         * remainder */
        double w0 = 18.0 * b0 / (b0 + b1), w1 = 18.0 * b1 / (b0 + b1);
        int d0 = (int)w0, d1 = (int)w1;
        if (d0 + d1 < 18) {
            if (w0 - d0 >= w1 - d1)
                d0++;
            else
                d1++;
        }
        assert_int_equal(d0 + d1, 18);
        decode_steps(t, comp, c, 40, 2);
        for (int h = 0; h < c->n_kv_heads; h++) {
            assert_int_equal(skv_kv_cache_head(c, 0, h)->len, d0);
            assert_int_equal(skv_kv_cache_head(c, 1, h)->len, d1);
        }
        const int *d = skv_compressor_layer_budgets(comp);
        assert_int_equal(d[0], d0);
        assert_int_equal(d[1], d1);
        /* a clone made while decoding keeps the spread */
        struct skv_compressor *cl = NULL;
        assert_int_equal(skv_compressor_clone(comp, &cl), SKV_OK);
        assert_int_equal(skv_compressor_begin_decode(cl, c), SKV_OK);
        assert_int_equal(skv_compressor_layer_budgets(cl)[0], d0);
        assert_int_equal(skv_compressor_layer_budgets(cl)[1], d1);
        skv_compressor_free(&cl);
        skv_compressor_free(&comp);
        skv_kv_cache_free(&c);
    }
}

/* A cloned compressor on a cloned cache carries the observation window: both decode alike. */
static void test_decode_rescore_clone(void **state)
{
    struct tiny *t = *state;
    struct skv_kv_cache *a = NULL, *b = NULL;
    struct skv_compressor *ca = NULL, *cb = NULL;
    run(t, "policy=snapkv,budget=16,window=4,decode_budget=10,interval=4", &a, t->ids, t->n, &ca);
    decode_steps(t, ca, a, 40, 3);
    assert_int_equal(skv_kv_cache_clone(a, &b), SKV_OK);
    assert_int_equal(skv_compressor_clone(ca, &cb), SKV_OK);
    decode_steps(t, ca, a, 43, 5);
    decode_steps(t, cb, b, 43, 5);
    for (int l = 0; l < a->n_layers; l++)
        for (int h = 0; h < a->n_kv_heads; h++) {
            const struct skv_kv_head *x = skv_kv_cache_head(a, l, h), *y = skv_kv_cache_head(b, l, h);
            assert_int_equal(x->len, 10); /* cut at 4 and at 8 decoded tokens */
            expect_positions(b, l, h, x->pos, x->len);
            float *xk = malloc((size_t)x->len * a->head_dim * sizeof(float));
            float *yk = malloc((size_t)y->len * a->head_dim * sizeof(float));
            assert_non_null(xk);
            assert_non_null(yk);
            assert_int_equal(skv_kv_cache_read_rows(a, l, h, 0, 0, x->len, xk), SKV_OK);
            assert_int_equal(skv_kv_cache_read_rows(b, l, h, 0, 0, y->len, yk), SKV_OK);
            assert_memory_equal(xk, yk, (size_t)x->len * a->head_dim * sizeof(float));
            free(xk);
            free(yk);
        }
    skv_compressor_free(&ca);
    skv_compressor_free(&cb);
    skv_kv_cache_free(&a);
    skv_kv_cache_free(&b);
}

/* The state bytes SAVE stores: a new compressor of the same spec that reads them decodes on
 * exactly as the original (H2O with decode budgets spread from a pyramid prefill, on a copy of
 * the cache, whose rows carry their scores); bytes that do not fit are refused and change
 * nothing. */
static void test_state_round_trip(void **state)
{
    struct tiny *t = *state;
    const char *spec_text = "policy=h2o,alloc=pyramid,budget=16,window=4,decode_budget=10";
    struct skv_kv_cache *a = NULL, *b = NULL;
    struct skv_compressor *ca = NULL, *cb = NULL;
    run(t, spec_text, &a, t->ids, t->n, &ca);
    decode_steps(t, ca, a, 40, 3);
    size_t len = skv_compressor_state_size(ca, a->n_past);
    assert_int_equal(len, (4 + 3 * (size_t)a->n_layers) * 4);
    unsigned char *buf = malloc(len), *bad = malloc(len);
    assert_non_null(buf);
    assert_non_null(bad);
    assert_int_equal(skv_compressor_state_write(ca, a->n_past, buf), SKV_OK);
    struct skv_compress_spec spec;
    assert_int_equal(skv_compress_spec_parse(spec_text, &spec), SKV_OK);
    assert_int_equal(skv_compressor_new(&spec, t->m, &cb), SKV_OK);
    /* refused: wrong length, another layer count, a negative budget, a layer budget beyond what
     * the spec lets a layer grow to; the compressor keeps its (empty) state */
    assert_int_equal(skv_compressor_state_read(cb, buf, len - 4, a->n_past), SKV_E_FORMAT);
    memcpy(bad, buf, len);
    bad[0] ^= 1;
    assert_int_equal(skv_compressor_state_read(cb, bad, len, a->n_past), SKV_E_FORMAT);
    memcpy(bad, buf, len);
    memcpy(bad + 4, &(int32_t){-1}, 4);
    assert_int_equal(skv_compressor_state_read(cb, bad, len, a->n_past), SKV_E_FORMAT);
    memcpy(bad, buf, len);
    memcpy(bad + 16, &(int32_t){16 * 4 + 4 + 1}, 4);
    assert_int_equal(skv_compressor_state_read(cb, bad, len, a->n_past), SKV_E_FORMAT);
    assert_int_equal(skv_compressor_budget(cb), 0);
    assert_int_equal(skv_compressor_state_read(cb, buf, len, a->n_past), SKV_OK);
    assert_int_equal(skv_compressor_budget(cb), skv_compressor_budget(ca));
    assert_memory_equal(skv_compressor_layer_budgets(cb), skv_compressor_layer_budgets(ca),
                        (size_t)a->n_layers * sizeof(int));
    assert_int_equal(skv_kv_cache_clone(a, &b), SKV_OK);
    decode_steps(t, ca, a, 43, 8);
    decode_steps(t, cb, b, 43, 8);
    for (int l = 0; l < a->n_layers; l++)
        for (int h = 0; h < a->n_kv_heads; h++) {
            const struct skv_kv_head *x = skv_kv_cache_head(a, l, h);
            expect_positions(b, l, h, x->pos, x->len);
        }
    free(buf);
    free(bad);
    skv_compressor_free(&ca);
    skv_compressor_free(&cb);
    skv_kv_cache_free(&a);
    skv_kv_cache_free(&b);
}

/* SnapKV re-scoring's state carries its observation window (the newest min(window,
 * decode_budget) = 4 decoded queries per layer) and the interval count (5 decoded, re-scored
 * at the 3rd): a compressor that reads it re-scores the copied cache at the same tokens, from
 * the same queries, as the original; an observation that does not fit the spec or the cache
 * is refused. */
static void test_state_round_trip_snapkv(void **state)
{
    struct tiny *t = *state;
    const char *spec_text = "policy=snapkv,budget=16,window=4,kernel=3,decode_budget=10,interval=3";
    struct skv_kv_cache *a = NULL, *b = NULL;
    struct skv_compressor *ca = NULL, *cb = NULL;
    run(t, spec_text, &a, t->ids, t->n, &ca);
    decode_steps(t, ca, a, 40, 5);
    const struct skv_model_config *mc = &t->m->cfg;
    size_t base = (4 + 3 * (size_t)a->n_layers) * 4;
    size_t len = skv_compressor_state_size(ca, a->n_past);
    assert_int_equal(len, base + 12 + (size_t)mc->n_layers * 4 * mc->n_heads * mc->head_dim * 4);
    assert_true(len <= skv_compressor_state_max(ca, a->n_past));
    unsigned char *buf = malloc(len), *bad = malloc(len);
    assert_non_null(buf);
    assert_non_null(bad);
    assert_int_equal(skv_compressor_state_write(ca, a->n_past, buf), SKV_OK);
    int32_t obs[3];
    memcpy(obs, buf + base, sizeof obs);
    assert_int_equal(obs[0], 40); /* observed from the first decoded token */
    assert_int_equal(obs[1], 45);
    assert_int_equal(obs[2], 4);
    /* an observation past the cache's end (a forward failed after its layers saw the token at
     * n_past - 1) is saved as of the cache's end: the 3 queries the failed forward did not write
     * over; one that starts past it is not saved (the window starts again) */
    assert_int_equal(skv_compressor_state_size(ca, a->n_past - 1),
                     base + 12 + (size_t)mc->n_layers * 3 * mc->n_heads * mc->head_dim * 4);
    assert_int_equal(skv_compressor_state_size(ca, 39), base);
    struct skv_compress_spec spec;
    assert_int_equal(skv_compress_spec_parse(spec_text, &spec), SKV_OK);
    assert_int_equal(skv_compressor_new(&spec, t->m, &cb), SKV_OK);
    /* refused: an n_obs past the ring, a window that does not end at the cache's end, a query
     * that is not finite, a cut observation */
    memcpy(bad, buf, len);
    memcpy(bad + base + 8, &(int32_t){5}, 4);
    assert_int_equal(skv_compressor_state_read(cb, bad, len, a->n_past), SKV_E_FORMAT);
    assert_non_null(strstr(skv_error_msg(), "implausible observation window"));
    assert_int_equal(skv_compressor_state_read(cb, buf, len, a->n_past + 1), SKV_E_FORMAT);
    memcpy(bad, buf, len);
    memcpy(bad + len - 4, &(float){NAN}, 4);
    assert_int_equal(skv_compressor_state_read(cb, bad, len, a->n_past), SKV_E_FORMAT);
    assert_non_null(strstr(skv_error_msg(), "not finite"));
    assert_int_equal(skv_compressor_state_read(cb, buf, len - 4, a->n_past), SKV_E_FORMAT);
    assert_int_equal(skv_compressor_budget(cb), 0);
    assert_int_equal(skv_compressor_state_read(cb, buf, len, a->n_past), SKV_OK);
    assert_int_equal(skv_kv_cache_clone(a, &b), SKV_OK);
    decode_steps(t, ca, a, 45, 10);
    decode_steps(t, cb, b, 45, 10);
    for (int l = 0; l < a->n_layers; l++)
        for (int h = 0; h < a->n_kv_heads; h++) {
            const struct skv_kv_head *x = skv_kv_cache_head(a, l, h);
            assert_true(x->len < 10 + 3); /* it was re-scored: decode_budget plus the interval's rows */
            expect_positions(b, l, h, x->pos, x->len);
        }
    /* a state saved before the observation was (the base alone) still reads: the window
     * starts again */
    struct skv_compressor *cc = NULL;
    assert_int_equal(skv_compressor_new(&spec, t->m, &cc), SKV_OK);
    assert_int_equal(skv_compressor_state_read(cc, buf, base, a->n_past - 10), SKV_OK);
    skv_compressor_free(&cc);
    free(buf);
    free(bad);
    skv_compressor_free(&ca);
    skv_compressor_free(&cb);
    skv_kv_cache_free(&a);
    skv_kv_cache_free(&b);
}

/* While decoding, a layer's budget is its share of decode_budget, which may pass the
 * sequence's length (a short prompt, a large decode_budget): such a state reads back (before,
 * "layer 0 out of range", so SAVE wrote what LOAD refused). */
static void test_state_decode_budget_past_length(void **state)
{
    struct tiny *t = *state;
    static const char *specs[] = {"policy=h2o,ratio=0.5,window=2,decode_budget=64",
                                  "policy=snapkv,budget=8,window=4,decode_budget=200,interval=4"};
    for (size_t k = 0; k < sizeof specs / sizeof specs[0]; k++) {
        struct skv_kv_cache *a = NULL;
        struct skv_compressor *ca = NULL, *cb = NULL;
        run(t, specs[k], &a, t->ids, 12, &ca);
        decode_steps(t, ca, a, 40, 2);
        assert_true(skv_compressor_layer_budgets(ca)[0] > a->n_past + 1);
        size_t len = skv_compressor_state_size(ca, a->n_past);
        unsigned char *buf = malloc(len);
        assert_non_null(buf);
        assert_int_equal(skv_compressor_state_write(ca, a->n_past, buf), SKV_OK);
        struct skv_compress_spec spec;
        assert_int_equal(skv_compress_spec_parse(specs[k], &spec), SKV_OK);
        assert_int_equal(skv_compressor_new(&spec, t->m, &cb), SKV_OK);
        assert_int_equal(skv_compressor_state_read(cb, buf, len, a->n_past), SKV_OK);
        assert_memory_equal(skv_compressor_layer_budgets(cb), skv_compressor_layer_budgets(ca),
                            (size_t)a->n_layers * sizeof(int));
        free(buf);
        skv_compressor_free(&ca);
        skv_compressor_free(&cb);
        skv_kv_cache_free(&a);
    }
}

/* Layer budgets at their edges: PyramidKV under streaming counts no window (it took the spec's
 * 32 from budget=8 and tapered nothing); a decode_budget spread keeps its total L * D when a
 * layer's share rounds to 0 and is raised to 1 (it went over); a ratio's min_budget floor
 * grows the layers while decoding, as budget=N does (they stayed at the prompt's 20). */
static void test_budget_edges(void **state)
{
    struct tiny *t = *state;
    struct skv_kv_cache *c = NULL;
    struct skv_compressor *comp = NULL;
    run(t, "policy=streaming,alloc=pyramid,budget=8", &c, t->ids, t->n, &comp);
    int want[16];
    assert_true(c->n_layers >= 2 && c->n_layers <= 16);
    skv_pyramid_budgets(c->n_layers, 8, 0, 20, t->n, want);
    assert_true(want[0] > want[c->n_layers - 1]);
    for (int l = 0; l < c->n_layers; l++)
        if (skv_kv_cache_head(c, l, 0)->len != want[l])
            fail_msg("streaming + pyramid: layer %d keeps %d rows, %d expected", l, skv_kv_cache_head(c, l, 0)->len,
                     want[l]);
    skv_compressor_free(&comp);
    skv_kv_cache_free(&c);

    run(t, "policy=streaming,alloc=pyramid,budget=8,decode_budget=1", &c, t->ids, t->n, &comp);
    decode_steps(t, comp, c, 40, 1);
    const int *d = skv_compressor_layer_budgets(comp);
    int sum = 0;
    for (int l = 0; l < c->n_layers; l++) {
        assert_true(d[l] >= 1);
        sum += d[l];
        assert_int_equal(skv_kv_cache_head(c, l, 0)->len, d[l]);
    }
    assert_int_equal(sum, c->n_layers);
    skv_compressor_free(&comp);
    skv_kv_cache_free(&c);

    run(t, "policy=streaming,ratio=0.1,min_budget=32", &c, t->ids, 20, &comp);
    for (int l = 0; l < c->n_layers; l++)
        assert_int_equal(skv_kv_cache_head(c, l, 0)->len, 20); /* whole */
    decode_steps(t, comp, c, 40, 8);
    for (int l = 0; l < c->n_layers; l++)
        for (int h = 0; h < c->n_kv_heads; h++)
            assert_int_equal(skv_kv_cache_head(c, l, h)->len, 28);
    decode_steps(t, comp, c, 48, 8);
    for (int l = 0; l < c->n_layers; l++)
        assert_int_equal(skv_kv_cache_head(c, l, 0)->len, 32); /* the floor, then evicting */
    skv_compressor_free(&comp);
    skv_kv_cache_free(&c);
}

/* min_budget: at 10% of the 40-token prompt a layer would keep 4 rows (the window alone);
 * with min_budget=12 it keeps 12 per head, exactly the rows budget=12 keeps; a floor below
 * the ratio's budget changes nothing. */
static void test_min_budget(void **state)
{
    struct tiny *t = *state;
    struct skv_kv_cache *a = NULL, *b = NULL, *c = NULL, *d = NULL;
    run(t, "policy=snapkv,ratio=0.1,window=4,min_budget=12", &a, t->ids, t->n, NULL);
    run(t, "policy=snapkv,budget=12,window=4", &b, t->ids, t->n, NULL);
    run(t, "policy=snapkv,ratio=0.5,window=4,min_budget=12", &c, t->ids, t->n, NULL);
    run(t, "policy=snapkv,ratio=0.5,window=4", &d, t->ids, t->n, NULL);
    for (int l = 0; l < a->n_layers; l++)
        for (int h = 0; h < a->n_kv_heads; h++) {
            const struct skv_kv_head *ha = skv_kv_cache_head(a, l, h), *hb = skv_kv_cache_head(b, l, h);
            const struct skv_kv_head *hc = skv_kv_cache_head(c, l, h), *hd = skv_kv_cache_head(d, l, h);
            assert_int_equal(ha->len, 12);
            assert_memory_equal(ha->pos, hb->pos, 12 * sizeof *ha->pos);
            assert_int_equal(hc->len, 20);
            assert_int_equal(hd->len, 20);
            assert_memory_equal(hc->pos, hd->pos, 20 * sizeof *hc->pos);
        }
    skv_kv_cache_free(&a);
    skv_kv_cache_free(&b);
    skv_kv_cache_free(&c);
    skv_kv_cache_free(&d);
}

int main(void)
{
    const struct CMUnitTest pure[] = {
        cmocka_unit_test(test_spec_parse),   cmocka_unit_test(test_spec_ignored_keys),
        cmocka_unit_test(test_spec_format_and_budget),
        cmocka_unit_test(test_pyramid),      cmocka_unit_test(test_squeeze_budgets),
    };
    const struct CMUnitTest model[] = {
        cmocka_unit_test(test_streaming_and_window), cmocka_unit_test(test_snapkv_matches_naive),
        cmocka_unit_test(test_streaming_high_positions),
        cmocka_unit_test(test_edge_cases),           cmocka_unit_test(test_head_granularity),
        cmocka_unit_test(test_drop_rows),
        cmocka_unit_test(test_decode_drop_matches),
        cmocka_unit_test(test_decode_eviction),
        cmocka_unit_test(test_decode_head_granularity),
        cmocka_unit_test(test_decode_f16_pool),
        cmocka_unit_test(test_fixed_budget_above_prompt), cmocka_unit_test(test_state_grown_budget),
        cmocka_unit_test(test_budget_edges),
        cmocka_unit_test(test_h2o_matches_naive),
        cmocka_unit_test(test_h2o_rerun_counts_once),      cmocka_unit_test(test_query_aware_reuse),
        cmocka_unit_test(test_squeeze_conserves),    cmocka_unit_test(test_decode_rescore_hand),
        cmocka_unit_test(test_decode_rescore_matches_naive), cmocka_unit_test(test_decode_rescore_edges),
        cmocka_unit_test(test_decode_budget_spread),
        cmocka_unit_test(test_decode_rescore_clone),
        cmocka_unit_test(test_state_round_trip),
        cmocka_unit_test(test_state_round_trip_snapkv),
        cmocka_unit_test(test_state_decode_budget_past_length),
        cmocka_unit_test(test_min_budget),
    };
    int failed = cmocka_run_group_tests_name("compress-pieces", pure, NULL, NULL);
    failed += cmocka_run_group_tests_name("compress-tiny-model", model, tiny_setup, tiny_teardown);
    return failed;
}
