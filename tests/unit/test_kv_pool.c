/* The KV block pool and copy-on-write forks: pool counts and slab reuse, forks that share
 * every block, appends and compactions of a fork that copy only what they write and leave
 * the parent bit-identical, a fork that outlives its parent, block sizes that give the same
 * logits bit for bit, rows to and from host memory at any offset (one block or several), and
 * reference counts back at zero (no leak, also under ASan). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/status.h"
#include "daemon/compress/compress.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/kv_pool.h"
#include "daemon/engine/kv_store.h"
#include "kernels/backend.h"
#include "tests/common/fixture.h"
#include "tests/common/tiny.h"


static struct skv_kv_pool_stats pool_stats(struct skv_kv_pool *p)
{
    struct skv_kv_pool_stats s;
    skv_kv_pool_stats(p, &s);
    return s;
}

/* Every row of every head, K then V, with positions: a cache's whole content on the host. */
static float *snapshot(const struct skv_kv_cache *c, int32_t **pos_out, size_t *floats_out)
{
    size_t floats = 0, rows = 0;
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++)
        rows += (size_t)c->heads[i].len;
    floats = rows * 2 * (size_t)c->head_dim;
    float *out = malloc((floats ? floats : 1) * sizeof *out), *at = out;
    int32_t *pos = malloc((rows ? rows : 1) * sizeof *pos), *pat = pos;
    assert_non_null(out);
    assert_non_null(pos);
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++) {
        const struct skv_kv_head *hd = &c->heads[i];
        for (int kv = 0; kv < 2; kv++) {
            assert_int_equal(skv_kv_cache_read_rows(c, i / c->n_kv_heads, i % c->n_kv_heads, kv, 0, hd->len, at),
                             SKV_OK);
            at += (size_t)hd->len * c->head_dim;
        }
        memcpy(pat, hd->pos, (size_t)hd->len * sizeof *pat);
        pat += hd->len;
    }
    *pos_out = pos;
    *floats_out = floats;
    return out;
}

static void expect_snapshot(const struct skv_kv_cache *c, const float *want, const int32_t *want_pos, size_t floats)
{
    int32_t *pos;
    size_t n;
    float *got = snapshot(c, &pos, &n);
    assert_int_equal(n, floats);
    assert_memory_equal(got, want, floats * sizeof *got);
    assert_memory_equal(pos, want_pos, floats / 2 / c->head_dim * sizeof *pos);
    free(got);
    free(pos);
}

static void prefill(struct tiny *t, struct skv_kv_cache *c, const int32_t *ids, int n, float *logits)
{
    assert_int_equal(skv_engine_forward(t->e, c, ids, n, NULL, logits), SKV_OK);
}

/* Two prompts of n ids that share none. */
static void two_prompts(const struct tiny *t, int32_t *ids, int32_t *other, int n)
{
    for (int i = 0; i < n; i++) {
        ids[i] = (int32_t)((i * 7 + 3) % t->m->cfg.n_vocab);
        other[i] = (int32_t)((i * 11 + 5) % t->m->cfg.n_vocab);
    }
}

/* ---- the pool alone ------------------------------------------------------------------------- */

static void test_pool_counts(void **state)
{
    struct tiny *t = *state;
    struct skv_kv_pool *p = NULL;
    assert_int_equal(skv_kv_pool_new(t->be, 16, 0, SKV_DTYPE_F32, &p), SKV_E_INVAL);
    assert_int_equal(skv_kv_pool_new(NULL, 16, 16, SKV_DTYPE_F32, &p), SKV_E_INVAL);
    assert_int_equal(skv_kv_pool_new(t->be, 16, 4, SKV_DTYPE_F32, &p), SKV_OK);
    assert_int_equal(skv_kv_pool_block_bytes(p), (size_t)2 * 4 * 16 * 4);
    enum { N = 200 };
    struct skv_kv_block *b[N];
    for (int i = 0; i < N; i++) {
        assert_int_equal(skv_kv_pool_get(p, &b[i]), SKV_OK);
        memset(b[i]->mem, i, skv_kv_pool_block_bytes(p)); /* CPU: host memory */
    }
    struct skv_kv_pool_stats s = pool_stats(p);
    assert_int_equal(s.blocks_in_use, N);
    assert_int_equal(s.blocks_shared, 0);
    assert_true(s.bytes_reserved >= N * s.block_bytes);
    /* a second holder, then copy-on-write for one of them */
    skv_kv_pool_hold(p, b[7]);
    assert_true(skv_kv_pool_is_shared(p, b[7]));
    assert_int_equal(pool_stats(p).blocks_shared, 1);
    assert_int_equal(skv_kv_pool_count_shared(p, b, N), 1);
    struct skv_kv_block *mine = b[7];
    assert_int_equal(skv_kv_pool_unshare(p, &mine), SKV_OK);
    assert_ptr_not_equal(mine, b[7]);
    assert_memory_equal(mine->mem, b[7]->mem, skv_kv_pool_block_bytes(p));
    assert_false(skv_kv_pool_is_shared(p, b[7]));
    assert_int_equal(pool_stats(p).blocks_shared, 0);
    assert_int_equal(pool_stats(p).blocks_in_use, N + 1);
    struct skv_kv_block *same = mine; /* a private block stays itself */
    assert_int_equal(skv_kv_pool_unshare(p, &same), SKV_OK);
    assert_ptr_equal(same, mine);
    skv_kv_pool_put(p, mine);
    skv_kv_pool_put(p, NULL);
    for (int i = 0; i < N; i++)
        skv_kv_pool_put(p, b[i]);
    s = pool_stats(p);
    assert_int_equal(s.blocks_in_use, 0);
    /* all but one slab went back to the backend */
    assert_true(s.bytes_reserved <= 64 * s.block_bytes);
    skv_kv_pool_unref(&p);
    assert_null(p);
    skv_kv_pool_unref(&p);
}

/* Weak references: a block is held again by pointer and stamp only while it is in use with
 * that stamp; a block given back, taken again or written in place is not. While pinned, the
 * pool keeps the slabs whose blocks are all free (the pointers stay readable); the last unpin
 * gives them back as the puts would have, one kept. */
static void test_pool_weak(void **state)
{
    struct tiny *t = *state;
    struct skv_kv_pool *p = NULL;
    assert_int_equal(skv_kv_pool_new(t->be, 16, 4, SKV_DTYPE_F32, &p), SKV_OK);
    enum { N = 200 };
    struct skv_kv_block *b[N];
    uint64_t stamp[N];
    skv_kv_pool_pin_slabs(p);
    for (int i = 0; i < N; i++) {
        assert_int_equal(skv_kv_pool_get(p, &b[i]), SKV_OK);
        stamp[i] = b[i]->stamp;
    }
    const uint64_t reserved = pool_stats(p).bytes_reserved;
    assert_true(skv_kv_pool_hold_if(p, b[3], stamp[3])); /* in use, unchanged */
    assert_int_equal(pool_stats(p).blocks_shared, 1);
    skv_kv_pool_put(p, b[3]);
    assert_false(skv_kv_pool_hold_if(p, b[3], stamp[3] + 1)); /* another stamp */
    struct skv_kv_block *w = b[4];
    assert_int_equal(skv_kv_pool_unshare(p, &w), SKV_OK); /* written in place: a new stamp */
    assert_ptr_equal(w, b[4]);
    assert_false(skv_kv_pool_hold_if(p, b[4], stamp[4]));
    skv_kv_pool_put(p, b[5]);
    assert_false(skv_kv_pool_hold_if(p, b[5], stamp[5])); /* free */
    struct skv_kv_block *again = NULL;
    assert_int_equal(skv_kv_pool_get(p, &again), SKV_OK); /* the block just freed, taken again */
    assert_ptr_equal(again, b[5]);
    assert_false(skv_kv_pool_hold_if(p, b[5], stamp[5]));
    skv_kv_pool_put(p, again);
    for (int i = 0; i < N; i++)
        if (i != 5)
            skv_kv_pool_put(p, b[i]);
    struct skv_kv_pool_stats s = pool_stats(p);
    assert_int_equal(s.blocks_in_use, 0);
    assert_int_equal(s.blocks_shared, 0);
    assert_int_equal(s.bytes_reserved, reserved); /* pinned: every slab stays */
    assert_false(skv_kv_pool_hold_if(p, b[N - 1], stamp[N - 1]));
    skv_kv_pool_pin_slabs(p); /* nested pins: only the last unpin gives back */
    skv_kv_pool_unpin_slabs(p);
    assert_int_equal(pool_stats(p).bytes_reserved, reserved);
    skv_kv_pool_unpin_slabs(p);
    s = pool_stats(p);
    assert_true(s.bytes_reserved > 0 && s.bytes_reserved <= 64 * s.block_bytes); /* one slab kept */
    assert_int_equal(s.blocks_free * s.block_bytes, s.bytes_reserved);
    skv_kv_pool_unref(&p);
}

/* A reserved pool holds its slabs from the start and never gives them back. */
static void test_pool_reserve(void **state)
{
    struct tiny *t = *state;
    struct skv_kv_pool *p = NULL;
    assert_int_equal(skv_kv_pool_new(t->be, 16, 4, SKV_DTYPE_F32, &p), SKV_OK);
    const size_t bb = skv_kv_pool_block_bytes(p), slab = 64 * bb;
    assert_int_equal(skv_kv_pool_reserve(p, 3 * slab - 1), SKV_OK); /* rounds up to slabs */
    struct skv_kv_pool_stats s = pool_stats(p);
    assert_int_equal(s.bytes_reserved, 3 * slab);
    assert_int_equal(s.blocks_free, 3 * 64);
    assert_int_equal(s.blocks_in_use, 0);
    enum { N = 3 * 64 + 10 }; /* past the reservation: one more slab */
    struct skv_kv_block *b[N];
    for (int i = 0; i < N; i++)
        assert_int_equal(skv_kv_pool_get(p, &b[i]), SKV_OK);
    assert_int_equal(pool_stats(p).bytes_reserved, 4 * slab);
    for (int i = 0; i < N; i++)
        skv_kv_pool_put(p, b[i]);
    s = pool_stats(p);
    assert_int_equal(s.blocks_in_use, 0);
    assert_true(s.bytes_reserved >= 3 * slab && s.bytes_reserved <= 4 * slab); /* the reserved stay */
    assert_int_equal(skv_kv_pool_reserve(p, 0), SKV_OK); /* never shrinks */
    assert_true(pool_stats(p).bytes_reserved >= 3 * slab);
    skv_kv_pool_unref(&p);
}

/* ---- a forward that fails part way ----------------------------------------------------------- */

/* A hook that fails at `layer` of the sequence whose cache is `cache` (NULL: any): by then
 * that layer and those before it hold the forward's rows. */
struct fail_at {
    int layer;
    const struct skv_kv_cache *cache;
};

static int fail_hook(void *user, const struct skv_layer_view *v)
{
    const struct fail_at *f = user;
    if (v->layer == f->layer && (!f->cache || f->cache == v->cache))
        return skv_errorf(SKV_E_DEVICE, "injected failure at layer %d", v->layer);
    return SKV_OK;
}

/* A backend whose downloads fail past the first logits row of a decode group (the test swaps
 * its ops in): the group's first row comes down, the second does not. */
static const char *g_first_src;
static size_t g_row_bytes;
static int (*g_real_download)(struct skv_backend *be, void *dst, const void *src, size_t bytes);
static int failing_download(struct skv_backend *be, void *dst, const void *src, size_t bytes)
{
    if (!g_first_src)
        g_first_src = src;
    if ((const char *)src + bytes > g_first_src + g_row_bytes)
        return skv_errorf(SKV_E_DEVICE, "injected download failure");
    return g_real_download(be, dst, src, bytes);
}

/* A forward that fails part way (here at layer 1 of 2, the rows already in both layers' heads
 * up to it) leaves the cache as it was: the same rows, positions and n_past, its blocks back
 * in the pool; the next forward then gives what a cache that never saw the failure gives. A
 * batched decode that fails in one group leaves that group's caches so and the other groups'
 * sequences take their token (the tiny model's float weights: groups of 8). */
static void test_failed_forward_undone(void **state)
{
    struct tiny *t = *state;
    struct skv_kv_pool *pool = t->m->kv_pool;
    const int nv = t->m->cfg.n_vocab, L = t->m->cfg.n_layers;
    assert_true(L >= 2);
    struct skv_kv_cache *c = NULL, *ref = NULL;
    float *a = malloc((size_t)nv * sizeof *a), *b = malloc((size_t)nv * sizeof *b);
    assert_int_equal(skv_kv_cache_new(t->m, &c), SKV_OK);
    assert_int_equal(skv_kv_cache_new(t->m, &ref), SKV_OK);
    prefill(t, c, t->ids, 12, NULL);
    prefill(t, ref, t->ids, 12, NULL);
    const uint64_t in_use = pool_stats(pool).blocks_in_use;
    int32_t *pos;
    size_t floats;
    float *before = snapshot(c, &pos, &floats);
    struct fail_at f = {L - 1, NULL};
    struct skv_forward_opts fo = {.hook = fail_hook, .hook_user = &f};
    for (int n = 1; n <= 9; n += 8) { /* one token (a decode step), and 9 across a block edge */
        assert_int_equal(skv_engine_forward(t->e, c, t->ids + 12, n, &fo, a), SKV_E_DEVICE);
        assert_non_null(strstr(skv_error_msg(), "injected failure"));
        assert_int_equal(c->n_past, 12);
        expect_snapshot(c, before, pos, floats);
        assert_int_equal(pool_stats(pool).blocks_in_use, in_use);
    }
    prefill(t, c, t->ids + 12, 5, a);
    prefill(t, ref, t->ids + 12, 5, b);
    assert_memory_equal(a, b, (size_t)nv * sizeof *a);
    free(before);
    free(pos);

    /* a batch of 10 in groups of 8 and 2; sequence 9's hook fails at the last layer */
    enum { NB = 10 };
    struct skv_kv_cache *bc[NB];
    struct skv_batch_seq seqs[NB];
    int32_t n0[NB];
    for (int i = 0; i < NB; i++) {
        assert_int_equal(skv_kv_cache_new(t->m, &bc[i]), SKV_OK);
        prefill(t, bc[i], t->ids + i, 3 + i, NULL);
        n0[i] = bc[i]->n_past;
    }
    struct fail_at f9 = {L - 1, bc[9]};
    struct skv_forward_opts fo9 = {.hook = fail_hook, .hook_user = &f9};
    float *snap8 = snapshot(bc[8], &pos, &floats);
    for (int i = 0; i < NB; i++)
        seqs[i] = (struct skv_batch_seq){bc[i], t->ids[40 + i], &fo9, NULL};
    assert_int_equal(skv_engine_decode_batch(t->e, seqs, NB), SKV_E_DEVICE);
    for (int i = 0; i < NB; i++) {
        assert_int_equal(bc[i]->n_past, n0[i] + (i < 8)); /* the first group took its token */
        for (int l = 0; l < L; l++)
            assert_int_equal(skv_kv_cache_head(bc[i], l, 0)->len, n0[i] + (i < 8));
    }
    expect_snapshot(bc[8], snap8, pos, floats);

    /* the logits fail to come down: each sequence keeps the logits of its token before (the
     * first sequences' were overwritten before, so they sampled from a token not in their cache) */
    float *lg[2];
    for (int i = 0; i < 2; i++) {
        lg[i] = malloc((size_t)nv * sizeof *lg[i]);
        for (int v = 0; v < nv; v++)
            lg[i][v] = (float)(i * nv + v);
        seqs[i] = (struct skv_batch_seq){bc[i], t->ids[50 + i], NULL, lg[i]};
    }
    const struct skv_backend_ops *real = t->be->ops;
    struct skv_backend_ops broken = *real;
    broken.download = failing_download;
    g_real_download = real->download;
    g_first_src = NULL;
    g_row_bytes = (size_t)nv * sizeof(float);
    t->be->ops = &broken;
    int rc = skv_engine_decode_batch(t->e, seqs, 2);
    t->be->ops = real;
    assert_int_equal(rc, SKV_E_DEVICE);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(bc[i]->n_past, n0[i] + 1); /* as after the batch above */
        for (int v = 0; v < nv; v++)
            assert_true(lg[i][v] == (float)(i * nv + v));
        free(lg[i]);
    }
    for (int i = 0; i < NB; i++)
        skv_kv_cache_free(&bc[i]);
    free(snap8);
    free(pos);
    skv_kv_cache_free(&c);
    skv_kv_cache_free(&ref);
    assert_int_equal(pool_stats(pool).blocks_in_use, 0);
    free(a);
    free(b);
}

/* ---- forks ------------------------------------------------------------------------------------ */

/* FORK shares every block; an append copies only each head's last, partial block; the
 * parent stays bit-identical; the fork computes what an unshared cache computes. */
static void test_fork_append(void **state)
{
    struct tiny *t = *state;
    struct skv_kv_pool *pool = t->m->kv_pool;
    const int nv = t->m->cfg.n_vocab, heads = t->m->cfg.n_layers * t->m->cfg.n_kv_heads;
    struct skv_kv_cache *doc = NULL, *fork = NULL, *solo = NULL;
    float *a = malloc((size_t)nv * sizeof *a), *b = malloc((size_t)nv * sizeof *b);
    assert_int_equal(skv_kv_cache_new(t->m, &doc), SKV_OK);
    prefill(t, doc, t->ids, 40, NULL); /* 40 rows: blocks of 16, 16 and 8 per head */
    const uint64_t base = pool_stats(pool).blocks_in_use;
    struct skv_kv_blocks kb;
    skv_kv_cache_blocks(doc, &kb);
    assert_int_equal(kb.held, (uint64_t)heads * 3);
    assert_int_equal(kb.shared, 0);
    int32_t *pos;
    size_t floats;
    float *before = snapshot(doc, &pos, &floats);

    assert_int_equal(skv_kv_cache_clone(doc, &fork), SKV_OK);
    assert_int_equal(pool_stats(pool).blocks_in_use, base); /* no byte more */
    assert_int_equal(pool_stats(pool).blocks_shared, (uint64_t)heads * 3);
    skv_kv_cache_blocks(fork, &kb);
    assert_int_equal(kb.shared, (uint64_t)heads * 3);
    assert_int_equal(skv_kv_cache_bytes(fork), skv_kv_cache_bytes(doc));
    expect_snapshot(fork, before, pos, floats);

    /* prepare (a batched decode's first step) copies the partial block of each head without
     * writing a row; the append that follows then takes nothing more */
    assert_int_equal(skv_kv_cache_prepare(fork, 1), SKV_OK);
    assert_int_equal(pool_stats(pool).blocks_in_use, base + heads);
    assert_int_equal(skv_kv_cache_head(fork, 1, 1)->len, 40);
    expect_snapshot(fork, before, pos, floats);
    prefill(t, fork, t->ids + 40, 1, a); /* the append copies the partial block of each head */
    assert_int_equal(pool_stats(pool).blocks_in_use, base + heads);
    assert_int_equal(pool_stats(pool).blocks_shared, (uint64_t)heads * 2);
    skv_kv_head_blocks(fork, skv_kv_cache_head(fork, 1, 1), &kb);
    assert_int_equal(kb.held, 3);
    assert_int_equal(kb.shared, 2);
    expect_snapshot(doc, before, pos, floats);

    /* an unshared cache fed the same tokens gives the same logits, bit for bit */
    assert_int_equal(skv_kv_cache_new(t->m, &solo), SKV_OK);
    prefill(t, solo, t->ids, 40, NULL);
    prefill(t, solo, t->ids + 40, 1, b);
    assert_memory_equal(a, b, (size_t)nv * sizeof *a);

    /* the parent goes; the fork keeps its blocks and keeps decoding */
    skv_kv_cache_free(&doc);
    assert_int_equal(pool_stats(pool).blocks_shared, 0);
    for (int i = 41; i < 60; i++) {
        prefill(t, fork, t->ids + i, 1, a);
        prefill(t, solo, t->ids + i, 1, b);
        assert_memory_equal(a, b, (size_t)nv * sizeof *a);
    }
    skv_kv_cache_free(&fork);
    skv_kv_cache_free(&solo);
    assert_int_equal(pool_stats(pool).blocks_in_use, 0); /* every reference came back */
    free(before);
    free(pos);
    free(a);
    free(b);
}

/* Compaction of a fork (SnapKV with a question appended) leaves the parent intact; a
 * compaction that keeps whole leading blocks in place keeps sharing them. */
static void test_fork_compact(void **state)
{
    struct tiny *t = *state;
    struct skv_kv_pool *pool = t->m->kv_pool;
    struct skv_kv_cache *doc = NULL, *fork = NULL;
    assert_int_equal(skv_kv_cache_new(t->m, &doc), SKV_OK);
    prefill(t, doc, t->ids, 40, NULL);
    int32_t *pos;
    size_t floats;
    float *before = snapshot(doc, &pos, &floats);

    assert_int_equal(skv_kv_cache_clone(doc, &fork), SKV_OK);
    struct skv_compress_spec spec;
    struct skv_compressor *comp = NULL;
    assert_int_equal(skv_compress_spec_parse("policy=snapkv,budget=12,window=4", &spec), SKV_OK);
    assert_int_equal(skv_compressor_new(&spec, t->m, &comp), SKV_OK);
    assert_int_equal(skv_compressor_begin(comp, fork, 4), SKV_OK);
    struct skv_forward_opts fo = {.hook = skv_compressor_hook, .hook_user = comp};
    assert_int_equal(skv_engine_forward(t->e, fork, t->ids + 40, 4, &fo, NULL), SKV_OK);
    assert_int_equal(skv_compressor_finish(comp, fork), SKV_OK);
    skv_compressor_free(&comp);
    assert_int_equal(skv_kv_cache_head(fork, 0, 0)->len, 12);
    assert_int_equal(skv_kv_cache_head(fork, 0, 0)->n_blocks, 1);
    expect_snapshot(doc, before, pos, floats);
    skv_kv_cache_free(&fork);

    /* keep rows 0..19 and 30..35 of one head: block 0 stays shared, block 1 is gathered */
    assert_int_equal(skv_kv_cache_clone(doc, &fork), SKV_OK);
    int32_t idx[26];
    for (int i = 0; i < 20; i++)
        idx[i] = i;
    for (int i = 0; i < 6; i++)
        idx[20 + i] = 30 + i;
    const uint64_t used = pool_stats(pool).blocks_in_use;
    int32_t bad[3] = {0, 5, 5};
    assert_int_equal(skv_kv_cache_compact(fork, 1, 0, bad, 3), SKV_E_INVAL);
    bad[2] = 40;
    assert_int_equal(skv_kv_cache_compact(fork, 1, 0, bad, 3), SKV_E_INVAL);
    assert_int_equal(skv_kv_cache_head(fork, 1, 0)->len, 40); /* refused: unchanged */
    assert_int_equal(skv_kv_cache_compact(fork, 1, 0, idx, 26), SKV_OK);
    struct skv_kv_blocks kb;
    skv_kv_head_blocks(fork, skv_kv_cache_head(fork, 1, 0), &kb);
    assert_int_equal(kb.held, 2);
    assert_int_equal(kb.shared, 1);
    assert_int_equal(pool_stats(pool).blocks_in_use, used + 1); /* one fresh block */
    const int d = doc->head_dim;
    float want[26 * 64], got[26 * 64];
    for (int kv = 0; kv < 2; kv++) {
        float all[40 * 64];
        assert_int_equal(skv_kv_cache_read_rows(doc, 1, 0, kv, 0, 40, all), SKV_OK);
        for (int i = 0; i < 26; i++)
            memcpy(want + (size_t)i * d, all + (size_t)idx[i] * d, (size_t)d * sizeof(float));
        assert_int_equal(skv_kv_cache_read_rows(fork, 1, 0, kv, 0, 26, got), SKV_OK);
        assert_memory_equal(got, want, (size_t)26 * d * sizeof(float));
    }
    for (int i = 0; i < 26; i++)
        assert_int_equal(skv_kv_cache_head(fork, 1, 0)->pos[i], idx[i]);

    /* a host write to a shared row copies its block first; truncation gives blocks back */
    float row[64];
    for (int k = 0; k < d; k++)
        row[k] = (float)k;
    assert_int_equal(skv_kv_cache_write_rows(fork, 0, 1, 1, 3, 1, row), SKV_OK);
    assert_int_equal(skv_kv_cache_read_rows(fork, 0, 1, 1, 3, 1, got), SKV_OK);
    assert_memory_equal(got, row, (size_t)d * sizeof(float));
    assert_int_equal(skv_kv_cache_read_rows(doc, 0, 1, 1, 3, 1, got), SKV_OK);
    assert_memory_not_equal(got, row, (size_t)d * sizeof(float));
    assert_int_equal(skv_kv_cache_truncate(fork, 0, 1, 10), SKV_OK);
    assert_int_equal(skv_kv_cache_head(fork, 0, 1)->n_blocks, 1);
    assert_int_equal(skv_kv_cache_truncate(fork, 0, 1, 11), SKV_E_INVAL);
    expect_snapshot(doc, before, pos, floats);

    skv_kv_cache_free(&fork);
    skv_kv_cache_free(&doc);
    assert_int_equal(pool_stats(pool).blocks_in_use, 0);
    assert_int_equal(pool_stats(pool).blocks_shared, 0);
    free(before);
    free(pos);
}

/* Block sizes that do and do not divide the attention tiles give the same logits bit for
 * bit as the default, over a prefill, appends and decode steps. */
static void test_block_sizes(void **state)
{
    struct tiny *t = *state;
    const int nv = t->m->cfg.n_vocab, sizes[] = {1, 5, 16, 64, 100};
    float *want = malloc((size_t)nv * 5 * sizeof *want), *got = malloc((size_t)nv * 5 * sizeof *got);
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        struct skv_kv_pool *pool = NULL;
        struct skv_kv_cache *c = NULL;
        float *out = s == 0 ? want : got;
        assert_int_equal(skv_kv_pool_new(t->be, t->m->cfg.head_dim, sizes[s], SKV_DTYPE_F32, &pool), SKV_OK);
        assert_int_equal(skv_kv_cache_new_in(t->m, pool, &c), SKV_OK);
        skv_kv_pool_unref(&pool); /* the cache holds it */
        prefill(t, c, t->ids, 37, out);
        prefill(t, c, t->ids + 37, 9, out + nv);
        for (int i = 0; i < 3; i++)
            prefill(t, c, t->ids + 46 + i, 1, out + (size_t)(2 + i) * nv);
        assert_int_equal(skv_kv_cache_head(c, 1, 1)->n_blocks, (49 + sizes[s] - 1) / sizes[s]);
        if (s > 0)
            assert_memory_equal(got, want, (size_t)nv * 5 * sizeof *got);
        skv_kv_cache_free(&c);
    }
    free(want);
    free(got);
}

/* skv_kv_cache_fit gives back the block table too: a head reserved for 4096 rows (as a long
 * prompt's prefill opens every row of a layer) and fitted to its 37 rows plus 8 keeps a table
 * of its 3 blocks' size (it kept 256 entries), and goes on as a cache that never grew. */
static void test_fit_tables(void **state)
{
    struct tiny *t = *state;
    const int nv = t->m->cfg.n_vocab;
    struct skv_kv_cache *c = NULL, *ref = NULL;
    float *want = malloc((size_t)nv * sizeof *want), *got = malloc((size_t)nv * sizeof *got);
    assert_int_equal(skv_kv_cache_new(t->m, &c), SKV_OK);
    assert_int_equal(skv_kv_cache_new(t->m, &ref), SKV_OK);
    prefill(t, c, t->ids, 37, got);
    prefill(t, ref, t->ids, 37, want);
    const uint64_t before = skv_kv_cache_host_bytes(c);
    assert_int_equal(skv_kv_cache_reserve(c, 4096), SKV_OK);
    const int rows = c->block_rows;
    assert_true(skv_kv_cache_head(c, 0, 0)->blk_cap >= (37 + 4096) / rows);
    for (int l = 0; l < c->n_layers; l++)
        assert_int_equal(skv_kv_cache_fit(c, l, 8), SKV_OK);
    for (int l = 0; l < c->n_layers; l++)
        for (int h = 0; h < c->n_kv_heads; h++) {
            const struct skv_kv_head *hd = skv_kv_cache_head(c, l, h);
            int nb = (37 + 8 + rows - 1) / rows;
            assert_int_equal(hd->cap, 45);
            assert_int_equal(hd->blk_cap, nb > 4 ? nb : 4);
        }
    assert_true(skv_kv_cache_host_bytes(c) <= before);
    prefill(t, c, t->ids + 37, 1, got);
    prefill(t, ref, t->ids + 37, 1, want);
    assert_memory_equal(got, want, (size_t)nv * sizeof *got);
    skv_kv_cache_free(&c);
    skv_kv_cache_free(&ref);
    free(want);
    free(got);
}

/* Rows between host memory and the blocks (IMPORT_KV / EXPORT_KV / SAVE / LOAD): runs inside
 * one block go block by block, runs across blocks through one backend buffer; either way each
 * row lands where the other reads it, at any offset, and a clone's write leaves its parent as
 * it was (5-row blocks). */
static void expect_rows(const struct skv_kv_cache *c, int which, int row0, int n, const float *want)
{
    const size_t bytes = (size_t)n * c->head_dim * sizeof(float);
    float *got = malloc(bytes);
    assert_int_equal(skv_kv_cache_read_rows(c, 1, 0, which, row0, n, got), SKV_OK);
    assert_memory_equal(got, want, bytes);
    free(got);
}

static void test_rows_io(void **state)
{
    struct tiny *t = *state;
    enum { N = 23 };
    const int d = t->m->cfg.head_dim;
    struct skv_kv_pool *pool = NULL;
    struct skv_kv_cache *c = NULL, *f = NULL;
    assert_int_equal(skv_kv_pool_new(t->be, d, 5, SKV_DTYPE_F32, &pool), SKV_OK);
    assert_int_equal(skv_kv_cache_new_in(t->m, pool, &c), SKV_OK);
    skv_kv_pool_unref(&pool);
    float *k = malloc((size_t)N * d * sizeof *k), *v = malloc((size_t)N * d * sizeof *v);
    for (int i = 0; i < N * d; i++) {
        k[i] = (float)i * 0.25f - 7.0f;
        v[i] = -k[i];
    }
    /* K: rows 0-1 (inside block 0), then 2-22 (blocks 0 to 4); V: all 23 in one call */
    assert_int_equal(skv_kv_cache_write_rows(c, 1, 0, 0, 0, 2, k), SKV_OK);
    assert_int_equal(skv_kv_cache_write_rows(c, 1, 0, 0, 2, N - 2, k + 2 * d), SKV_OK);
    assert_int_equal(skv_kv_cache_write_rows(c, 1, 0, 1, 0, N, v), SKV_OK);
    assert_int_equal(skv_kv_cache_head(c, 1, 0)->len, N);
    const int ranges[][2] = {{0, N}, {3, 14}, {10, 4}, {22, 1}, {4, 2}};
    for (size_t r = 0; r < sizeof ranges / sizeof ranges[0]; r++) {
        expect_rows(c, 0, ranges[r][0], ranges[r][1], k + (size_t)ranges[r][0] * d);
        expect_rows(c, 1, ranges[r][0], ranges[r][1], v + (size_t)ranges[r][0] * d);
    }
    /* a clone shares the blocks; rewriting its K rows 6-12 (blocks 1 and 2) copies them */
    assert_int_equal(skv_kv_cache_clone(c, &f), SKV_OK);
    assert_int_equal(skv_kv_cache_write_rows(f, 1, 0, 0, 6, 7, v), SKV_OK);
    expect_rows(f, 0, 0, 6, k);
    expect_rows(f, 0, 6, 7, v);
    expect_rows(f, 0, 13, N - 13, k + 13 * d);
    expect_rows(c, 0, 0, N, k);
    /* refused: rows past the end, a third kind */
    float *one = malloc((size_t)4 * d * sizeof *one);
    assert_int_equal(skv_kv_cache_read_rows(c, 1, 0, 0, 20, 4, one), SKV_E_INVAL);
    assert_int_equal(skv_kv_cache_write_rows(c, 1, 0, 2, 0, 1, k), SKV_E_INVAL);
    free(one);
    skv_kv_cache_free(&f);
    skv_kv_cache_free(&c);
    free(k);
    free(v);
}

/* Equal blocks of caches written separately (two prefills of the same ids, and a third of other
 * ids) are shared through a dedupe index: every full block of the second cache becomes the
 * first's, its partial last blocks stay its own, the third cache shares nothing; a group apart
 * shares nothing either; the caches read as before, a write to a shared block copies it, and
 * the references are back at zero once all is freed. */
static void test_dedupe(void **state)
{
    struct tiny *t = *state;
    enum { N = 37 }; /* full blocks and a partial one per head, whatever the block size */
    struct skv_kv_pool *pool = t->m->kv_pool;
    const uint64_t base = pool_stats(pool).blocks_in_use;
    int32_t ids[N], other[N];
    two_prompts(t, ids, other, N);
    struct skv_kv_cache *a = NULL, *b = NULL, *c = NULL, *x = NULL;
    assert_int_equal(skv_kv_cache_new(t->m, &a), SKV_OK);
    assert_int_equal(skv_kv_cache_new(t->m, &b), SKV_OK);
    assert_int_equal(skv_kv_cache_new(t->m, &c), SKV_OK);
    assert_int_equal(skv_kv_cache_new(t->m, &x), SKV_OK);
    prefill(t, a, ids, N, NULL);
    prefill(t, b, ids, N, NULL);
    prefill(t, c, other, N, NULL);
    prefill(t, x, ids, N, NULL);
    const int heads = a->n_layers * a->n_kv_heads, full = N / a->block_rows, blocks = full + 1;
    assert_true(full >= 1 && N % a->block_rows != 0);
    assert_int_equal(pool_stats(pool).blocks_in_use, base + 4 * (uint64_t)heads * blocks);
    int32_t *pos_b;
    size_t floats;
    float *snap_b = snapshot(b, &pos_b, &floats);

    struct skv_kv_dedupe *d = NULL;
    assert_int_equal(skv_kv_dedupe_new(pool, &d), SKV_OK);
    uint64_t shared = 99;
    assert_int_equal(skv_kv_cache_dedupe(a, d, 1, &shared), SKV_OK);
    assert_int_equal(shared, 0); /* the first: indexed */
    assert_int_equal(skv_kv_cache_dedupe(b, d, 1, &shared), SKV_OK);
    assert_int_equal(shared, (uint64_t)heads * full);
    assert_int_equal(skv_kv_cache_dedupe(c, d, 1, &shared), SKV_OK);
    assert_int_equal(shared, 0);
    assert_int_equal(skv_kv_cache_dedupe(x, d, 2, &shared), SKV_OK); /* another group */
    assert_int_equal(shared, 0);
    skv_kv_dedupe_free(&d);
    assert_null(d);
    skv_kv_dedupe_free(&d);
    for (int i = 0; i < heads; i++) {
        for (int k = 0; k < full; k++) {
            assert_ptr_equal(b->heads[i].blk[k], a->heads[i].blk[k]);
            assert_ptr_equal(b->heads[i].mem[k], a->heads[i].blk[k]->mem);
            assert_ptr_not_equal(x->heads[i].blk[k], a->heads[i].blk[k]);
        }
        assert_ptr_not_equal(b->heads[i].blk[full], a->heads[i].blk[full]);
    }
    struct skv_kv_pool_stats s = pool_stats(pool);
    assert_int_equal(s.blocks_in_use, base + 4 * (uint64_t)heads * blocks - (uint64_t)heads * full);
    assert_int_equal(s.blocks_shared, (uint64_t)heads * full);
    expect_snapshot(b, snap_b, pos_b, floats);
    /* b's next token: a's blocks stay as they were */
    int32_t *pos_a;
    float *snap_a = snapshot(a, &pos_a, &floats);
    int32_t more = 5;
    prefill(t, b, &more, 1, NULL);
    expect_snapshot(a, snap_a, pos_a, floats);
    skv_kv_cache_free(&a);
    skv_kv_cache_free(&b);
    skv_kv_cache_free(&c);
    skv_kv_cache_free(&x);
    assert_int_equal(pool_stats(pool).blocks_in_use, base);
    free(snap_a);
    free(pos_a);
    free(snap_b);
    free(pos_b);
}

/* The rows of block b of a head of len rows in blocks of br (its last may be partly filled). */
static int block_fill(int b, int br, int len)
{
    return len - b * br < br ? len - b * br : br;
}

/* Puts the first n blocks of each head of c into the store (a head's last block may be partly
 * filled) and writes their indices to refs[head][block]. */
static void store_put_cache(struct skv_kv_store *st, const struct skv_kv_cache *c, uint32_t *refs, int n)
{
    const int br = c->block_rows, dim = c->head_dim;
    float *k = malloc((size_t)br * dim * sizeof *k), *v = malloc((size_t)br * dim * sizeof *v);
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++)
        for (int b = 0; b < n; b++) {
            int l = i / c->n_kv_heads, h = i % c->n_kv_heads, rows = block_fill(b, br, c->heads[i].len);
            assert_int_equal(skv_kv_cache_read_rows(c, l, h, 0, b * br, rows, k), SKV_OK);
            assert_int_equal(skv_kv_cache_read_rows(c, l, h, 1, b * br, rows, v), SKV_OK);
            assert_int_equal(skv_kv_store_put(st, c->heads[i].blk[b], rows, k, v, &refs[i * n + b]), SKV_OK);
        }
    free(k);
    free(v);
}

/* A cache rebuilt as a persist restore does: the first n blocks of each head from the store
 * (under group; a head's last may be partly filled), then the rest of src's rows; *shared: how
 * many blocks came shared. */
static int store_get_cache(struct tiny *t, struct skv_kv_store *st, const struct skv_kv_cache *src,
                           const uint32_t *refs, int n, uint64_t group, struct skv_kv_cache **out, int *shared)
{
    struct skv_kv_cache *c = NULL;
    assert_int_equal(skv_kv_cache_new(t->m, &c), SKV_OK);
    const int br = skv_kv_store_block_rows(st), dim = c->head_dim;
    *shared = 0;
    float *rows = malloc((size_t)(src->heads[0].len + 1) * dim * sizeof *rows);
    int rc = SKV_OK;
    for (int i = 0; i < c->n_layers * c->n_kv_heads && !rc; i++) {
        int l = i / c->n_kv_heads, h = i % c->n_kv_heads, len = src->heads[i].len;
        int row0 = n * br < len ? n * br : len;
        assert_int_equal(skv_kv_cache_reserve(c, len), SKV_OK);
        memcpy(c->heads[i].pos, src->heads[i].pos, (size_t)len * sizeof *rows);
        memcpy(c->heads[i].score, src->heads[i].score, (size_t)len * sizeof *rows);
        for (int b = 0; b < n && !rc; b++) {
            bool sh = false;
            rc = skv_kv_store_get(st, refs[i * n + b], block_fill(b, br, len), group, c, l, h, &sh);
            *shared += sh;
        }
        for (int kv = 0; kv < 2 && !rc; kv++) {
            assert_int_equal(skv_kv_cache_read_rows(src, l, h, kv, row0, len - row0, rows), SKV_OK);
            assert_int_equal(skv_kv_cache_write_rows(c, l, h, kv, row0, len - row0, rows), SKV_OK);
        }
    }
    free(rows);
    c->n_past = src->n_past;
    if (rc)
        skv_kv_cache_free(&c);
    *out = c;
    return rc;
}

/* The persist block store: a cache and its fork put the same blocks once, and so does a cache
 * prefilled separately with the same tokens (equal bytes); read back, caches of
 * one group share each block again, with the rows bit for bit, and another group's caches get
 * copies; a block that fails its checksum fails the cache that names it and no other; a store
 * of another model, or cut short, does not open; the references go back to zero. */
static void test_store(void **state)
{
    struct tiny *t = *state;
    enum { N = 37 };
    struct skv_kv_pool *pool = t->m->kv_pool;
    const uint64_t base = pool_stats(pool).blocks_in_use;
    int32_t ids[N], other[N];
    two_prompts(t, ids, other, N);
    struct skv_kv_cache *a = NULL, *b = NULL, *c = NULL, *d = NULL;
    assert_int_equal(skv_kv_cache_new(t->m, &a), SKV_OK);
    assert_int_equal(skv_kv_cache_new(t->m, &c), SKV_OK);
    assert_int_equal(skv_kv_cache_new(t->m, &d), SKV_OK);
    prefill(t, a, ids, N, NULL);
    prefill(t, c, other, N, NULL);
    prefill(t, d, ids, N, NULL);
    assert_int_equal(skv_kv_cache_clone(a, &b), SKV_OK);
    const int heads = a->n_layers * a->n_kv_heads, full = N / a->block_rows;
    assert_true(full >= 1 && N % a->block_rows != 0);
    char fp[64], other_fp[64], path[] = "/tmp/skv-store-XXXXXX";
    memset(fp, 'a', sizeof fp);
    memset(other_fp, 'b', sizeof other_fp);
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);

    struct skv_kv_store *st = NULL;
    assert_int_equal(skv_kv_store_create(path, fp, pool, &st), SKV_OK);
    uint32_t *ra = calloc((size_t)heads * full, 4), *rb = calloc((size_t)heads * full, 4),
             *rc_ = calloc((size_t)heads * full, 4), *rd = calloc((size_t)heads * full, 4);
    store_put_cache(st, a, ra, full);
    store_put_cache(st, b, rb, full); /* the fork's blocks are a's: nothing written */
    store_put_cache(st, c, rc_, full);
    store_put_cache(st, d, rd, full); /* other blocks, a's bytes: nothing written */
    assert_ptr_not_equal(d->heads[0].blk[0], a->heads[0].blk[0]);
    assert_memory_equal(ra, rb, (size_t)heads * full * 4);
    assert_memory_equal(ra, rd, (size_t)heads * full * 4);
    assert_int_equal(skv_kv_store_blocks(st), 2 * heads * full);
    assert_int_equal(skv_kv_store_bytes(st),
                     96 + 2 * (uint64_t)heads * full * (skv_kv_pool_block_bytes(pool) + 16));
    assert_int_equal(skv_kv_store_finish(st), SKV_OK);
    skv_kv_store_close(&st);
    assert_null(st);

    int32_t *pos_a, *pos_c;
    size_t fa, fc;
    float *snap_a = snapshot(a, &pos_a, &fa), *snap_c = snapshot(c, &pos_c, &fc);
    assert_int_equal(skv_kv_store_open(path, other_fp, NULL, a->block_rows, a->head_dim, -1, &st), SKV_E_INVAL);
    assert_int_equal(skv_kv_store_open(path, fp, NULL, a->block_rows, a->head_dim + 1, -1, &st), SKV_E_INVAL);
    assert_int_equal(skv_kv_store_open(path, fp, NULL, a->block_rows, a->head_dim, -1, &st), SKV_OK);
    struct skv_kv_cache *a2, *b2, *c2, *x2;
    int shared;
    assert_int_equal(store_get_cache(t, st, a, ra, full, 1, &a2, &shared), SKV_OK);
    assert_int_equal(shared, 0); /* the first to name them: read */
    assert_int_equal(store_get_cache(t, st, b, rb, full, 1, &b2, &shared), SKV_OK);
    assert_int_equal(shared, heads * full);
    assert_int_equal(store_get_cache(t, st, c, rc_, full, 1, &c2, &shared), SKV_OK);
    assert_int_equal(shared, 0);
    assert_int_equal(store_get_cache(t, st, a, ra, full, 2, &x2, &shared), SKV_OK); /* another tenant */
    assert_int_equal(shared, 0);
    for (int i = 0; i < heads; i++)
        for (int k = 0; k < full; k++) {
            assert_ptr_equal(b2->heads[i].blk[k], a2->heads[i].blk[k]);
            assert_ptr_not_equal(x2->heads[i].blk[k], a2->heads[i].blk[k]);
        }
    expect_snapshot(a2, snap_a, pos_a, fa);
    expect_snapshot(b2, snap_a, pos_a, fa);
    expect_snapshot(x2, snap_a, pos_a, fa);
    expect_snapshot(c2, snap_c, pos_c, fc);
    skv_kv_store_close(&st);
    /* a2 and b2 share their full blocks as a and b share them (a and b also their last one);
     * b2's next token leaves a2 as it was */
    assert_int_equal(pool_stats(pool).blocks_shared, (uint64_t)heads * (full + 1) + (uint64_t)heads * full);
    int32_t more = 5;
    prefill(t, b2, &more, 1, NULL);
    expect_snapshot(a2, snap_a, pos_a, fa);
    skv_kv_cache_free(&a2);
    skv_kv_cache_free(&b2);
    skv_kv_cache_free(&c2);
    skv_kv_cache_free(&x2);

    /* c's first block damaged on disk: c fails there, a still reads */
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    long at = 96 + (long)rc_[0] * (long)(skv_kv_pool_block_bytes(pool) + 16) + 40;
    fseek(f, at, SEEK_SET);
    int ch = fgetc(f);
    fseek(f, at, SEEK_SET);
    fputc(ch ^ 0x21, f);
    fclose(f);
    assert_int_equal(skv_kv_store_open(path, fp, NULL, a->block_rows, a->head_dim, -1, &st), SKV_OK);
    assert_int_equal(store_get_cache(t, st, c, rc_, full, 1, &c2, &shared), SKV_E_FORMAT);
    assert_null(c2);
    assert_int_equal(store_get_cache(t, st, a, ra, full, 1, &a2, &shared), SKV_OK);
    expect_snapshot(a2, snap_a, pos_a, fa);
    uint32_t past = skv_kv_store_blocks(st);
    bool sh;
    assert_int_equal(skv_kv_store_get(st, past, a->block_rows, 1, a2, 0, 0, &sh), SKV_E_FORMAT);
    assert_int_equal(skv_kv_store_get(st, 0, a->block_rows + 1, 1, a2, 0, 0, &sh), SKV_E_FORMAT);
    assert_int_equal(skv_kv_store_get(st, 0, 0, 1, a2, 0, 0, &sh), SKV_E_FORMAT);
    skv_kv_cache_free(&a2);

    /* caches of another block size (kv-block-tokens changed across the restart): the blocks
     * are read as rows, bit for bit, and not shared */
    skv_kv_pool_ref(pool); /* the model's next pools replace it */
    assert_int_equal(skv_model_set_kv_block_rows(t->m, 4), SKV_OK);
    assert_int_equal(store_get_cache(t, st, a, ra, full, 1, &a2, &shared), SKV_OK);
    assert_int_equal(store_get_cache(t, st, b, rb, full, 1, &b2, &shared), SKV_OK);
    assert_int_equal(shared, 0);
    assert_int_equal(a2->block_rows, 4);
    expect_snapshot(a2, snap_a, pos_a, fa);
    expect_snapshot(b2, snap_a, pos_a, fa);
    skv_kv_cache_free(&a2);
    skv_kv_cache_free(&b2);
    assert_int_equal(skv_model_set_kv_block_rows(t->m, SKV_KV_BLOCK_ROWS), SKV_OK);
    skv_kv_store_close(&st);

    /* cut short: does not open */
    assert_int_equal(truncate(path, 96 + 100), 0);
    assert_int_equal(skv_kv_store_open(path, fp, NULL, a->block_rows, a->head_dim, -1, &st), SKV_E_FORMAT);
    assert_null(st);
    unlink(path);

    skv_kv_cache_free(&a);
    skv_kv_cache_free(&b);
    skv_kv_cache_free(&c);
    skv_kv_cache_free(&d);
    assert_int_equal(pool_stats(pool).blocks_in_use, base);
    skv_kv_pool_unref(&pool);
    free(rd);
    free(ra);
    free(rb);
    free(rc_);
    free(snap_a);
    free(pos_a);
    free(snap_c);
    free(pos_c);
}

/* A model's pool can be replaced (snapkvd's kv-block-tokens): caches made before keep theirs. */
static void test_model_block_rows(void **state)
{
    struct tiny *t = *state;
    const int nv = t->m->cfg.n_vocab;
    struct skv_kv_cache *before = NULL, *after = NULL;
    float *a = malloc((size_t)nv * sizeof *a), *b = malloc((size_t)nv * sizeof *b);
    assert_int_equal(skv_kv_cache_new(t->m, &before), SKV_OK);
    prefill(t, before, t->ids, 20, NULL);
    assert_int_equal(skv_model_set_kv_block_rows(t->m, 0), SKV_E_INVAL);
    assert_int_equal(skv_model_set_kv_block_rows(t->m, 4), SKV_OK);
    assert_int_equal(skv_kv_cache_new(t->m, &after), SKV_OK);
    assert_int_equal(after->block_rows, 4);
    assert_int_equal(before->block_rows, SKV_KV_BLOCK_ROWS);
    prefill(t, after, t->ids, 20, NULL);
    prefill(t, before, t->ids + 20, 1, a);
    prefill(t, after, t->ids + 20, 1, b);
    assert_memory_equal(a, b, (size_t)nv * sizeof *a);
    assert_int_equal(skv_kv_cache_head(after, 0, 0)->n_blocks, 6);
    skv_kv_cache_free(&before); /* the old pool goes with its last cache */
    skv_kv_cache_free(&after);
    assert_int_equal(skv_model_set_kv_block_rows(t->m, SKV_KV_BLOCK_ROWS), SKV_OK);
    free(a);
    free(b);
}

static void count_tick(void *user)
{
    (*(int *)user)++;
}

/* A forward with a tick runs its attention in calls of about 256 queries (the CPU backend's
 * attention_split_rows: 64 / g per block) with a tick between them, and between the chunks of
 * its projections and MLP: logits of every position and the whole cache come out bit for bit
 * as without a tick, also after a prefix (an APPEND) and on a cut past a block edge. */
static void test_tick_exact(void **state)
{
    struct tiny *t = *state;
    const int nv = t->m->cfg.n_vocab, L = t->m->cfg.n_layers;
    enum { N = 600, P = 37 };
    int32_t *ids = malloc(N * sizeof *ids);
    float *a = malloc((size_t)N * nv * sizeof *a), *b = malloc((size_t)N * nv * sizeof *b);
    assert_non_null(ids);
    assert_non_null(a);
    assert_non_null(b);
    for (int i = 0; i < N; i++)
        ids[i] = (i * 37 + 11) % nv;
    const int r = t->be->ops->attention_split_rows(t->be, t->m->cfg.n_heads, t->m->cfg.n_kv_heads);
    assert_int_equal(r, 64 / (t->m->cfg.n_heads / t->m->cfg.n_kv_heads));
    for (int prefix = 0; prefix <= P; prefix += P) {
        struct skv_kv_cache *c = NULL, *ref = NULL;
        assert_int_equal(skv_kv_cache_new(t->m, &c), SKV_OK);
        assert_int_equal(skv_kv_cache_new(t->m, &ref), SKV_OK);
        if (prefix) {
            prefill(t, c, ids, prefix, NULL);
            prefill(t, ref, ids, prefix, NULL);
        }
        const int n = N - prefix;
        int ticks = 0;
        struct skv_forward_opts plain = {.logits_all = true};
        struct skv_forward_opts ticking = {.logits_all = true, .tick = count_tick, .tick_user = &ticks};
        assert_int_equal(skv_engine_forward(t->e, ref, ids + prefix, n, &plain, b), SKV_OK);
        assert_int_equal(skv_engine_forward(t->e, c, ids + prefix, n, &ticking, a), SKV_OK);
        /* per layer: after each 256-token chunk of the projections and of the MLP, and between
         * the attention calls (of 256 queries; a tail under 2 r joins the last one) */
        int chunks = (n + 255) / 256, calls = 0;
        for (int i0 = 0; i0 < n; calls++) {
            int m = n - i0 < 256 ? n - i0 : 256;
            i0 += n - i0 - m < 2 * r ? n - i0 : m;
        }
        printf("# %d tokens after %d: %d ticks (%d attention calls per layer)\n", n, prefix, ticks, calls);
        assert_true(calls >= 2);
        assert_int_equal(ticks, L * (2 * chunks + calls - 1));
        assert_memory_equal(a, b, (size_t)n * nv * sizeof *a);
        int32_t *pos;
        size_t floats;
        float *want = snapshot(ref, &pos, &floats);
        expect_snapshot(c, want, pos, floats);
        free(want);
        free(pos);
        skv_kv_cache_free(&c);
        skv_kv_cache_free(&ref);
    }
    free(ids);
    free(a);
    free(b);
}

/* A partly filled last block that forks share (none has written it) goes to the store once
 * per count of its rows in use, zero rows after them, found again by its stamp and that count;
 * read back, the caches of one group share it again, their rows bit for bit, and a write to one
 * leaves the others as they were; a store that goes on from the restore finds it. (A persist
 * restore gave each fork a block of its own: a document and four forks, 1890 blocks before the
 * stop and 1980 after.) */
static void test_store_partial(void **state)
{
    struct tiny *t = *state;
    enum { N = 37 };
    struct skv_kv_pool *pool = t->m->kv_pool;
    const uint64_t base = pool_stats(pool).blocks_in_use;
    int32_t ids[N], other[N];
    two_prompts(t, ids, other, N);
    struct skv_kv_cache *a = NULL, *b = NULL, *e = NULL;
    assert_int_equal(skv_kv_cache_new(t->m, &a), SKV_OK);
    prefill(t, a, ids, N, NULL);
    assert_int_equal(skv_kv_cache_clone(a, &b), SKV_OK);
    assert_int_equal(skv_kv_cache_clone(a, &e), SKV_OK);
    const int heads = a->n_layers * a->n_kv_heads, br = a->block_rows, full = N / br, n = full + 1;
    const int tail = N - full * br;
    assert_true(tail > 2);
    for (int i = 0; i < heads; i++) /* e: the same last block, two rows fewer of it in use */
        assert_int_equal(skv_kv_cache_truncate(e, i / e->n_kv_heads, i % e->n_kv_heads, N - 2), SKV_OK);
    char fp[64], path[] = "/tmp/skv-store-XXXXXX";
    memset(fp, 'a', sizeof fp);
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);

    struct skv_kv_store *st = NULL;
    assert_int_equal(skv_kv_store_create(path, fp, pool, &st), SKV_OK);
    uint32_t *ra = calloc((size_t)heads * n, 4), *rb = calloc((size_t)heads * n, 4), *re = calloc((size_t)heads * n, 4);
    store_put_cache(st, a, ra, n);
    store_put_cache(st, b, rb, n); /* a's blocks, found by their stamps: nothing written */
    assert_int_equal(skv_kv_store_blocks(st), heads * n);
    assert_memory_equal(ra, rb, (size_t)heads * n * 4);
    store_put_cache(st, e, re, n); /* its last block's first tail - 2 rows: a record of their own */
    assert_int_equal(skv_kv_store_blocks(st), heads * (n + 1));
    for (int i = 0; i < heads; i++) {
        assert_memory_equal(&re[i * n], &ra[i * n], (size_t)full * 4);
        assert_int_not_equal(re[i * n + full], ra[i * n + full]);
    }
    uint32_t idx;
    assert_true(skv_kv_store_find(st, a->heads[0].blk[full], tail, &idx));
    assert_int_equal(idx, ra[full]);
    assert_true(skv_kv_store_find(st, a->heads[0].blk[full], tail - 2, &idx));
    assert_int_equal(idx, re[full]);
    assert_false(skv_kv_store_find(st, a->heads[0].blk[full], tail - 1, &idx));
    assert_false(skv_kv_store_find(st, a->heads[0].blk[full], 0, &idx));
    assert_int_equal(skv_kv_store_put(st, a->heads[0].blk[full], br + 1, NULL, NULL, &idx), SKV_E_INVAL);
    assert_int_equal(skv_kv_store_finish(st), SKV_OK);
    skv_kv_store_end(st, true);
    skv_kv_store_close(&st);

    int32_t *pos_a, *pos_e;
    size_t fa, fe;
    float *snap_a = snapshot(a, &pos_a, &fa), *snap_e = snapshot(e, &pos_e, &fe);
    assert_int_equal(skv_kv_store_open(path, fp, NULL, br, a->head_dim, -1, &st), SKV_OK);
    struct skv_kv_cache *a2, *b2, *e2;
    int shared;
    assert_int_equal(store_get_cache(t, st, a, ra, n, 1, &a2, &shared), SKV_OK);
    assert_int_equal(shared, 0); /* the first to name them: read */
    assert_int_equal(store_get_cache(t, st, b, rb, n, 1, &b2, &shared), SKV_OK);
    assert_int_equal(shared, heads * n); /* the last blocks too */
    assert_int_equal(store_get_cache(t, st, e, re, n, 1, &e2, &shared), SKV_OK);
    assert_int_equal(shared, heads * full);
    for (int i = 0; i < heads; i++) {
        assert_int_equal(a2->heads[i].len, N);
        assert_int_equal(e2->heads[i].len, N - 2);
        assert_ptr_equal(b2->heads[i].blk[full], a2->heads[i].blk[full]);
        assert_ptr_not_equal(e2->heads[i].blk[full], a2->heads[i].blk[full]);
    }
    expect_snapshot(a2, snap_a, pos_a, fa);
    expect_snapshot(b2, snap_a, pos_a, fa);
    expect_snapshot(e2, snap_e, pos_e, fe);
    /* a, b, e hold n blocks a head; a2, b2, e2 as many and e2's last ones */
    assert_int_equal(pool_stats(pool).blocks_in_use, base + (uint64_t)heads * (2 * n + 1));

    /* b2's next token goes into a copy of the last block: a2 stays as it was */
    int32_t more = 5;
    prefill(t, b2, &more, 1, NULL);
    assert_ptr_not_equal(b2->heads[0].blk[full], a2->heads[0].blk[full]);
    expect_snapshot(a2, snap_a, pos_a, fa);
    /* the store goes on: a save of a2 finds every block of it, its last one too */
    assert_int_equal(skv_kv_store_continue(st, path, pool), SKV_OK);
    uint32_t *r2 = calloc((size_t)heads * n, 4);
    store_put_cache(st, a2, r2, n);
    assert_int_equal(skv_kv_store_appended(st), 0);
    assert_memory_equal(r2, ra, (size_t)heads * n * 4);
    skv_kv_store_close(&st);
    unlink(path);

    skv_kv_cache_free(&a2);
    skv_kv_cache_free(&b2);
    skv_kv_cache_free(&e2);
    skv_kv_cache_free(&a);
    skv_kv_cache_free(&b);
    skv_kv_cache_free(&e);
    assert_int_equal(pool_stats(pool).blocks_in_use, base);
    free(ra);
    free(rb);
    free(re);
    free(r2);
    free(snap_a);
    free(pos_a);
    free(snap_e);
    free(pos_e);
}

/* Puts c's full blocks as a save does: those the store finds (written before, unchanged since)
 * are not read; returns how many it found. */
static int store_save_cache(struct skv_kv_store *st, const struct skv_kv_cache *c, uint32_t *refs)
{
    const int br = c->block_rows, dim = c->head_dim, full = c->heads[0].len / br;
    float *k = malloc((size_t)br * dim * sizeof *k), *v = malloc((size_t)br * dim * sizeof *v);
    int found = 0;
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++)
        for (int b = 0; b < full; b++) {
            int l = i / c->n_kv_heads, h = i % c->n_kv_heads;
            if (skv_kv_store_find(st, c->heads[i].blk[b], br, &refs[i * full + b])) {
                found++;
                continue;
            }
            assert_int_equal(skv_kv_cache_read_rows(c, l, h, 0, b * br, br, k), SKV_OK);
            assert_int_equal(skv_kv_cache_read_rows(c, l, h, 1, b * br, br, v), SKV_OK);
            assert_int_equal(skv_kv_store_put(st, c->heads[i].blk[b], br, k, v, &refs[i * full + b]), SKV_OK);
        }
    free(k);
    free(v);
    return found;
}

/* A store written by an f32 pool, restored into an f16 (q8_0) pool (kv-type changed across a restart):
 * the caches hold the rows rounded, and the store, going on, does not take those blocks for their
 * records (the records hold the unrounded values): the next save writes each block's own rows, and
 * the save after finds them all. A store written from f16 blocks restores into f16 caches whose
 * blocks it finds at once. */
static void store_typed(struct tiny *t, int kv_type)
{
    const int br = SKV_KV_BLOCK_ROWS, n = 2 * br;
    int32_t ids[64], other[64];
    two_prompts(t, ids, other, 64);
    struct skv_kv_cache *a = NULL;
    assert_int_equal(skv_kv_cache_new(t->m, &a), SKV_OK);
    assert_int_equal(a->kv_type, SKV_DTYPE_F32);
    prefill(t, a, ids, n, NULL);
    const int heads = a->n_layers * a->n_kv_heads, full = n / br, d = a->head_dim;
    char fp[64], path[] = "/tmp/skv-store16-XXXXXX";
    memset(fp, 'b', sizeof fp);
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    uint32_t *ra = calloc((size_t)heads * full, 4), *r2 = calloc((size_t)heads * full, 4);
    struct skv_kv_store *st = NULL;
    assert_int_equal(skv_kv_store_create(path, fp, t->m->kv_pool, &st), SKV_OK);
    skv_kv_store_begin(st);
    assert_int_equal(store_save_cache(st, a, ra), 0);
    assert_int_equal(skv_kv_store_finish(st), SKV_OK);
    skv_kv_store_end(st, true);
    skv_kv_store_close(&st);

    assert_int_equal(skv_model_set_kv_pool(t->m, br, kv_type), SKV_OK);
    struct skv_kv_cache *a16 = NULL, *b16 = NULL;
    int shared;
    assert_int_equal(skv_kv_store_open(path, fp, NULL, br, d, heads * full, &st), SKV_OK);
    assert_int_equal(store_get_cache(t, st, a, ra, full, 1, &a16, &shared), SKV_OK);
    assert_int_equal(a16->kv_type, kv_type);
    float *x = malloc((size_t)n * d * sizeof *x), *y = malloc((size_t)n * d * sizeof *y);
    float *r = malloc((size_t)n * d * sizeof *r);
    unsigned char *q = malloc(skv_kv_row_bytes(kv_type, d));
    int rounded = 0;
    for (int i = 0; i < heads; i++)
        for (int kv = 0; kv < 2; kv++) {
            assert_int_equal(skv_kv_cache_read_rows(a, i / a->n_kv_heads, i % a->n_kv_heads, kv, 0, n, x), SKV_OK);
            assert_int_equal(skv_kv_cache_read_rows(a16, i / a->n_kv_heads, i % a->n_kv_heads, kv, 0, n, y), SKV_OK);
            for (int row = 0; row < n; row++) { /* the f32 rows as the typed pool rounds them */
                const float *xr = x + (size_t)row * d;
                float *rr = r + (size_t)row * d;
                if (kv_type == SKV_DTYPE_F16)
                    for (int e = 0; e < d; e++)
                        rr[e] = skv_fp16_to_f32(skv_f32_to_fp16_sat(xr[e]));
                else {
                    skv_quantize_row_q8_0(q, xr, d);
                    assert_int_equal(skv_dequantize_row(SKV_DTYPE_Q8_0, q, rr, d), SKV_OK);
                }
            }
            assert_memory_equal(y, r, (size_t)n * d * sizeof *y);
            for (int e = 0; e < n * d; e++)
                rounded += y[e] != x[e];
        }
    assert_true(rounded > 0);
    assert_int_equal(skv_kv_store_continue(st, path, t->m->kv_pool), SKV_OK);
    skv_kv_store_begin(st);
    assert_int_equal(store_save_cache(st, a16, r2), 0); /* every block's own rows written */
    assert_int_equal(skv_kv_store_appended(st), heads * full);
    assert_int_equal(skv_kv_store_finish(st), SKV_OK);
    skv_kv_store_end(st, true);
    skv_kv_store_begin(st);
    assert_int_equal(store_save_cache(st, a16, r2), heads * full); /* and found after */
    assert_int_equal(skv_kv_store_appended(st), 0);
    assert_int_equal(skv_kv_store_finish(st), SKV_OK);
    skv_kv_store_end(st, true);
    skv_kv_store_close(&st);
    /* the f16 records restore into f16 caches, which the store takes for them at once */
    assert_int_equal(skv_kv_store_open(path, fp, NULL, br, d, 2 * heads * full, &st), SKV_OK);
    assert_int_equal(store_get_cache(t, st, a16, r2, full, 1, &b16, &shared), SKV_OK);
    assert_int_equal(skv_kv_store_continue(st, path, t->m->kv_pool), SKV_OK);
    skv_kv_store_begin(st);
    assert_int_equal(store_save_cache(st, b16, ra), heads * full);
    assert_int_equal(skv_kv_store_appended(st), 0);
    assert_int_equal(skv_kv_store_finish(st), SKV_OK);
    skv_kv_store_end(st, true);
    skv_kv_store_close(&st);
    for (int i = 0; i < heads; i++) {
        assert_int_equal(skv_kv_cache_read_rows(a16, i / a->n_kv_heads, i % a->n_kv_heads, 1, 0, n, x), SKV_OK);
        assert_int_equal(skv_kv_cache_read_rows(b16, i / a->n_kv_heads, i % a->n_kv_heads, 1, 0, n, y), SKV_OK);
        assert_memory_equal(x, y, (size_t)n * d * sizeof *x);
    }
    unlink(path);
    skv_kv_cache_free(&a);
    skv_kv_cache_free(&a16);
    skv_kv_cache_free(&b16);
    assert_int_equal(skv_model_set_kv_pool(t->m, SKV_KV_BLOCK_ROWS, SKV_DTYPE_F32), SKV_OK);
    free(x);
    free(y);
    free(r);
    free(q);
    free(ra);
    free(r2);
}

static void test_store_f16(void **state)
{
    store_typed(*state, SKV_DTYPE_F16);
}

/* The same for a q8_0 pool, on the default model (the tiny one's head_dim of 16 is not a multiple
 * of 32: a q8_0 pool for it is refused). */
static void test_store_q8_0(void **state)
{
    struct tiny *t = *state;
    if (!t)
        skip();
    store_typed(t, SKV_DTYPE_Q8_0);
}

/* A q8_0 pool needs a head_dim that is a multiple of 32: refused for the tiny model's 16, with the
 * pool it had kept. */
static void test_q8_0_head_dim(void **state)
{
    struct tiny *t = *state;
    struct skv_kv_pool *before = t->m->kv_pool;
    assert_int_equal(skv_model_set_kv_pool(t->m, SKV_KV_BLOCK_ROWS, SKV_DTYPE_Q8_0), SKV_E_UNSUPPORTED);
    assert_non_null(strstr(skv_error_msg(), "multiple of 32"));
    assert_ptr_equal(t->m->kv_pool, before);
}

/* The default model as a struct tiny (NULL state when it is not fetched: its tests skip). */
static int model_setup(void **state)
{
    *state = NULL;
    char *path = fixture_model_path();
    if (!path)
        return 0;
    struct tiny *t = calloc(1, sizeof *t);
    if (!t || skv_backend_cpu_new(2, &t->be) || skv_model_load(path, t->be, NULL, &t->m) ||
        skv_engine_new(t->m, &t->e)) {
        free(path);
        return -1;
    }
    free(path);
    *state = t;
    return 0;
}

static int model_teardown(void **state)
{
    struct tiny *t = *state;
    if (t) {
        skv_engine_free(&t->e);
        skv_model_free(&t->m);
        skv_backend_destroy(&t->be);
        free(t);
    }
    return 0;
}

/* One store across saves (checkpoints): a save appends only the blocks written since the last
 * one (new ones, and old ones written again: their stamps changed); blocks named by a save that
 * did not end are found by the next; a store read back by a restore goes on, finding the
 * blocks it gave caches, and what a save cut short appended after the manifest's count is
 * ignored and then overwritten; every version reads back bit for bit. */
static void test_store_saves(void **state)
{
    struct tiny *t = *state;
    enum { N = 37 };
    struct skv_kv_pool *pool = t->m->kv_pool;
    const uint64_t base = pool_stats(pool).blocks_in_use;
    int32_t ids[96], other[96];
    two_prompts(t, ids, other, 96);
    struct skv_kv_cache *a = NULL, *c = NULL;
    assert_int_equal(skv_kv_cache_new(t->m, &a), SKV_OK);
    assert_int_equal(skv_kv_cache_new(t->m, &c), SKV_OK);
    prefill(t, a, ids, N, NULL);
    prefill(t, c, other, N, NULL);
    const int heads = a->n_layers * a->n_kv_heads, br = a->block_rows, full = N / br;
    const uint64_t rec = skv_kv_pool_block_bytes(pool) + 16;
    char fp[64], path[] = "/tmp/skv-store-XXXXXX";
    memset(fp, 'a', sizeof fp);
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    uint32_t *ra = calloc((size_t)heads * (full + 2), 4), *rc_ = calloc((size_t)heads * (full + 2), 4);

    /* save 1: a */
    struct skv_kv_store *st = NULL;
    assert_int_equal(skv_kv_store_create(path, fp, pool, &st), SKV_OK);
    skv_kv_store_begin(st);
    assert_int_equal(store_save_cache(st, a, ra), 0);
    assert_int_equal(skv_kv_store_appended(st), heads * full);
    assert_int_equal(skv_kv_store_finish(st), SKV_OK);
    skv_kv_store_end(st, true);
    assert_int_equal(skv_kv_store_live(st), heads * full);
    /* save 2: nothing changed, nothing read or written */
    skv_kv_store_begin(st);
    assert_int_equal(store_save_cache(st, a, ra), heads * full);
    assert_int_equal(skv_kv_store_appended(st), 0);
    assert_int_equal(skv_kv_store_finish(st), SKV_OK);
    skv_kv_store_end(st, true);
    /* save 3: a grew by a block; c is new, but its save does not end (a request came) */
    prefill(t, a, ids + N, 2 * br - N % br, NULL);
    assert_int_equal(a->heads[0].len, (full + 2) * br);
    skv_kv_store_begin(st);
    assert_int_equal(store_save_cache(st, a, ra), heads * full);
    assert_int_equal(store_save_cache(st, c, rc_), 0);
    assert_int_equal(skv_kv_store_appended(st), 2 * heads + heads * full);
    skv_kv_store_end(st, false);
    /* save 4: finds both */
    skv_kv_store_begin(st);
    assert_int_equal(store_save_cache(st, a, ra), heads * (full + 2));
    assert_int_equal(store_save_cache(st, c, rc_), heads * full);
    assert_int_equal(skv_kv_store_appended(st), 0);
    assert_int_equal(skv_kv_store_finish(st), SKV_OK);
    skv_kv_store_end(st, true);
    /* save 5: a's last three blocks were cut and written again with other tokens: written
     * again, the blocks before them found */
    for (int i = 0; i < heads; i++)
        assert_int_equal(skv_kv_cache_truncate(a, i / a->n_kv_heads, i % a->n_kv_heads, full * br - 3), SKV_OK);
    a->n_past = full * br - 3;
    prefill(t, a, other, 3 + 2 * br, NULL);
    skv_kv_store_begin(st);
    assert_int_equal(store_save_cache(st, a, ra), heads * (full - 1));
    assert_int_equal(store_save_cache(st, c, rc_), heads * full);
    assert_int_equal(skv_kv_store_appended(st), 3 * heads);
    assert_int_equal(skv_kv_store_finish(st), SKV_OK);
    skv_kv_store_end(st, true);
    const uint32_t n_blocks = skv_kv_store_blocks(st);
    assert_int_equal(n_blocks, heads * full + 2 * heads + heads * full + 3 * heads);
    assert_int_equal(skv_kv_store_live(st), heads * (full + 2) + heads * full);
    assert_int_equal(skv_kv_store_bytes(st), 96 + (uint64_t)n_blocks * rec);
    assert_false(skv_kv_store_mostly_garbage(st, 0)); /* 3 blocks a head are no cache's, 2 * full + 2 are */
    skv_kv_store_close(&st);

    /* a restore of save 5, its store going on: a's and c's blocks found, none written; a save
     * cut short appended garbage after the manifest's count, which the restore ignores */
    FILE *f = fopen(path, "ab");
    assert_non_null(f);
    for (uint64_t i = 0; i < rec + 7; i++)
        fputc(0x5a, f);
    fclose(f);
    assert_int_equal(skv_kv_store_open(path, fp, NULL, br, a->head_dim, -1, &st), SKV_E_FORMAT);
    assert_int_equal(skv_kv_store_open(path, fp, NULL, br, a->head_dim, n_blocks + 1, &st), SKV_E_FORMAT);
    assert_int_equal(skv_kv_store_open(path, fp, NULL, br, a->head_dim, n_blocks, &st), SKV_OK);
    int32_t *pos_a, *pos_c;
    size_t fa, fc;
    float *snap_a = snapshot(a, &pos_a, &fa), *snap_c = snapshot(c, &pos_c, &fc);
    struct skv_kv_cache *a2, *c2;
    int shared;
    assert_int_equal(store_get_cache(t, st, a, ra, full + 2, 1, &a2, &shared), SKV_OK);
    assert_int_equal(store_get_cache(t, st, c, rc_, full, 1, &c2, &shared), SKV_OK);
    expect_snapshot(a2, snap_a, pos_a, fa);
    expect_snapshot(c2, snap_c, pos_c, fc);
    assert_int_equal(skv_kv_store_continue(st, path, pool), SKV_OK);
    assert_int_equal(skv_kv_store_live(st), heads * (full + 2) + heads * full);
    skv_kv_store_begin(st);
    uint32_t *r2 = calloc((size_t)heads * (full + 2), 4);
    assert_int_equal(store_save_cache(st, a2, r2), heads * (full + 2));
    assert_memory_equal(r2, ra, (size_t)heads * (full + 2) * 4);
    assert_int_equal(store_save_cache(st, c2, r2), heads * full);
    assert_memory_equal(r2, rc_, (size_t)heads * full * 4);
    assert_int_equal(skv_kv_store_appended(st), 0);
    assert_int_equal(skv_kv_store_finish(st), SKV_OK);
    skv_kv_store_end(st, true);
    /* c2 goes on by a block (over the garbage's place); a2 is gone: most of the store is not
     * live now */
    skv_kv_cache_free(&a2);
    prefill(t, c2, ids, br - N % br, NULL);
    skv_kv_store_begin(st);
    assert_int_equal(store_save_cache(st, c2, rc_), heads * full);
    assert_int_equal(skv_kv_store_appended(st), heads);
    assert_int_equal(skv_kv_store_finish(st), SKV_OK);
    skv_kv_store_end(st, true);
    assert_int_equal(skv_kv_store_live(st), heads * (full + 1));
    assert_int_equal(skv_kv_store_blocks(st), n_blocks + heads);
    /* more of it is no cache's than is: a save would start a new store, once that is worth it */
    const uint32_t garbage = n_blocks + heads - heads * (full + 1);
    assert_true(garbage > (uint32_t)heads * (full + 1));
    assert_true(skv_kv_store_mostly_garbage(st, garbage));
    assert_false(skv_kv_store_mostly_garbage(st, garbage + 1));
    skv_kv_store_close(&st);
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(sb.st_size, 96 + (uint64_t)(n_blocks + heads) * rec);
    free(pos_c);
    float *snap_c2 = snapshot(c2, &pos_c, &fc);
    free(pos_c);
    struct skv_kv_cache *c3;
    assert_int_equal(skv_kv_store_open(path, fp, NULL, br, a->head_dim, -1, &st), SKV_OK);
    assert_int_equal(store_get_cache(t, st, c2, rc_, full + 1, 2, &c3, &shared), SKV_OK);
    free(snap_c);
    snap_c = snapshot(c3, &pos_c, &fc);
    assert_memory_equal(snap_c, snap_c2, fc * sizeof *snap_c);
    skv_kv_store_close(&st);
    unlink(path);

    skv_kv_cache_free(&a);
    skv_kv_cache_free(&c);
    skv_kv_cache_free(&a2);
    skv_kv_cache_free(&c2);
    skv_kv_cache_free(&c3);
    assert_int_equal(pool_stats(pool).blocks_in_use, base);
    free(snap_a);
    free(snap_c);
    free(snap_c2);
    free(pos_a);
    free(pos_c);
    free(ra);
    free(rc_);
    free(r2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pool_counts),     cmocka_unit_test(test_fit_tables),
        cmocka_unit_test(test_pool_reserve),
        cmocka_unit_test(test_pool_weak),
        cmocka_unit_test(test_failed_forward_undone),
        cmocka_unit_test(test_tick_exact),
        cmocka_unit_test(test_fork_append),
        cmocka_unit_test(test_fork_compact),
        cmocka_unit_test(test_block_sizes),
        cmocka_unit_test(test_rows_io),
        cmocka_unit_test(test_model_block_rows),
        cmocka_unit_test(test_dedupe),
        cmocka_unit_test(test_store),
        cmocka_unit_test(test_store_partial),
        cmocka_unit_test(test_store_saves),
        cmocka_unit_test(test_store_f16),
        cmocka_unit_test(test_q8_0_head_dim),
    };
    const struct CMUnitTest model_tests[] = {
        cmocka_unit_test(test_store_q8_0),
    };
    int failed = cmocka_run_group_tests_name("kv_pool", tests, tiny_setup, tiny_teardown);
    failed += cmocka_run_group_tests_name("kv_pool-model", model_tests, model_setup, model_teardown);
    return failed ? 1 : 0;
}
