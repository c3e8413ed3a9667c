/* The Llama-family forward pass over backend ops, layer by layer over the whole batch so a
 * hook can compress each layer's KV right after its attention (memory-lean prefill).
 * Projections and the MLP run in chunks of tokens to bound activation memory. */
#include "daemon/engine/engine.h"
#include "common/status.h"
#include "daemon/engine/sampler.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 256 /* tokens per projection / MLP chunk */
/* a decode group fits one chunk: layer_attention_batch's len0 and the views are per group */
_Static_assert(SKV_ENGINE_MAX_BATCH <= CHUNK, "a decode group is one chunk");

struct skv_engine {
    struct skv_model *m;
    struct skv_backend *be;
    int cap_tokens;        /* n the full-batch buffers hold */
    float *x;              /* [cap][dim] residual stream */
    float *x_in;           /* [cap][dim] residual before the layer (hooks only) */
    float *q;              /* [cap][n_heads * head_dim] post-RoPE queries */
    float *att;            /* [cap][n_heads * head_dim] attention output */
    int32_t *pos;          /* [cap] positions (host) */
    float *xb;             /* [CHUNK][dim] */
    float *kb, *vb;        /* [CHUNK][n_kv_heads * head_dim] */
    float *ob;             /* [CHUNK][dim] */
    float *gb, *ub;        /* [CHUNK][ffn_dim] */
    float *lb;             /* [n_vocab]: one position's logits (decode), kept between calls */
    float *lg;             /* [decode group][n_vocab]: a decode group's logits, made at its first use and
                            * kept between forwards (an alloc and a free a forward cost a device-wide wait
                            * on the GPU); freed with the other buffers when they grow */
    float *lhost;          /* [decode group][n_vocab], host: a decode group's logits, given to the
                            * sequences only once every row came down */
    uint64_t scratch_bytes;
    int decode_group;      /* sessions per decode forward (decode_group_size); 0: not known yet */
    int small_forward;     /* skv_engine_small_forward's answer; -1: not known yet */
    const struct skv_forward_opts *tick; /* the running forward's opts when they have a tick */
    /* rows_add / rows_flush: K and V rows bound for the cache, stored by one copy_rows */
    void **row_dst;
    const void **row_src;
    size_t n_rows, rows_cap;
    int rows_type;         /* the KV type of the queued rows' cache (f16 / q8_0: by their store op) */
    struct skv_kv_view *views; /* [SKV_ENGINE_MAX_BATCH]: a decode group's (attention_batch); NULL until one */
    /* a layer's attention probabilities (skv_forward_opts.attention_probs): sequence i of the
     * forward's at probs_at[i] ([n_heads][probs_stride[i]]; NULL: none), in probs (backend memory,
     * probs_cap floats, made at its first use) */
    float *probs;
    size_t probs_cap;
    float *probs_at[SKV_ENGINE_MAX_BATCH];
    int64_t probs_stride[SKV_ENGINE_MAX_BATCH];
};

/* ---- KV cache ----------------------------------------------------------------------------- */

int skv_kv_cache_new_in(const struct skv_model *m, struct skv_kv_pool *pool, struct skv_kv_cache **out)
{
    if (!pool)
        return skv_errorf(SKV_E_INVAL, "KV cache: no block pool");
    struct skv_kv_cache *c = calloc(1, sizeof *c);
    if (!c)
        return SKV_E_NOMEM;
    c->n_layers = m->cfg.n_layers;
    c->n_kv_heads = m->cfg.n_kv_heads;
    c->head_dim = m->cfg.head_dim;
    c->be = m->be;
    c->heads = calloc((size_t)c->n_layers * c->n_kv_heads, sizeof *c->heads);
    if (!c->heads) {
        free(c);
        return SKV_E_NOMEM;
    }
    c->pool = skv_kv_pool_ref(pool);
    c->block_rows = skv_kv_pool_block_rows(pool);
    c->kv_type = skv_kv_pool_kv_type(pool);
    c->row_bytes = skv_kv_pool_row_bytes(pool);
    *out = c;
    return SKV_OK;
}

int skv_kv_cache_new(const struct skv_model *m, struct skv_kv_cache **out)
{
    return skv_kv_cache_new_in(m, m->kv_pool, out);
}

static int blocks_for(const struct skv_kv_cache *c, int rows)
{
    return (rows + c->block_rows - 1) / c->block_rows;
}

/* Gives back the head's blocks from index `keep` on. */
static void head_release_from(struct skv_kv_cache *c, struct skv_kv_head *hd, int keep)
{
    for (int b = keep; b < hd->n_blocks; b++) {
        skv_kv_pool_put(c->pool, hd->blk[b]);
        hd->blk[b] = NULL;
        hd->mem[b] = NULL;
    }
    if (keep < hd->n_blocks)
        hd->n_blocks = keep;
}

void skv_kv_cache_free(struct skv_kv_cache **cache_p)
{
    if (!cache_p || !*cache_p)
        return;
    struct skv_kv_cache *c = *cache_p;
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++) {
        struct skv_kv_head *hd = &c->heads[i];
        head_release_from(c, hd, 0);
        free(hd->blk);
        free(hd->mem);
        free(hd->pos);
        free(hd->score);
    }
    free(c->heads);
    skv_kv_pool_unref(&c->pool);
    free(c);
    *cache_p = NULL;
}

/* Makes the head's block table take nb blocks. */
static int table_reserve(struct skv_kv_head *hd, int nb)
{
    if (nb <= hd->blk_cap)
        return SKV_OK;
    int cap = hd->blk_cap ? hd->blk_cap : 4;
    while (cap < nb)
        cap *= 2;
    struct skv_kv_block **blk = realloc(hd->blk, (size_t)cap * sizeof *blk);
    if (!blk)
        return SKV_E_NOMEM;
    hd->blk = blk;
    void **mem = realloc(hd->mem, (size_t)cap * sizeof *mem);
    if (!mem)
        return SKV_E_NOMEM;
    hd->mem = mem;
    hd->blk_cap = cap;
    return SKV_OK;
}

/* Gives back a head's block table past nb entries (nb >= its blocks; at least 4 kept, as
 * table_reserve starts): a 128K-row prompt compressed to 1024 rows kept 8192 entries, 128 KiB
 * a head, for as long as the session lived. A failed realloc keeps the larger table. */
static void table_shrink(struct skv_kv_head *hd, int nb)
{
    if (nb < 4)
        nb = 4;
    if (nb >= hd->blk_cap)
        return;
    struct skv_kv_block **blk = realloc(hd->blk, (size_t)nb * sizeof *blk);
    if (!blk)
        return;
    hd->blk = blk;
    hd->blk_cap = nb; /* (mem may stay larger) */
    void **mem = realloc(hd->mem, (size_t)nb * sizeof *mem);
    if (mem)
        hd->mem = mem;
}

/* Resizes a head's host arrays to exactly `cap` rows (cap >= len) and its table to their
 * blocks. */
static int head_realloc(struct skv_kv_cache *c, struct skv_kv_head *hd, int cap)
{
    int32_t *pos = realloc(hd->pos, (size_t)cap * sizeof *pos);
    if (!pos)
        return SKV_E_NOMEM;
    hd->pos = pos;
    /* cap counts rows both arrays hold: a shrunk pos with score's realloc failing is smaller */
    int both = cap < hd->cap ? cap : hd->cap;
    float *score = realloc(hd->score, (size_t)cap * sizeof *score);
    if (!score) {
        hd->cap = both;
        return SKV_E_NOMEM;
    }
    hd->score = score;
    hd->cap = cap;
    return table_reserve(hd, blocks_for(c, cap));
}

static int head_grow(struct skv_kv_cache *c, struct skv_kv_head *hd, int need)
{
    if (need <= hd->cap)
        return SKV_OK;
    int cap = hd->cap ? hd->cap : 64;
    while (cap < need)
        cap = cap > (1 << 29) ? need : cap * 2;
    return head_realloc(c, hd, cap);
}

/* Makes the blocks of rows [row0, row0 + n) present and private to this head (row0 <= its
 * rows): new blocks from the pool, shared ones copied (copy-on-write). */
static int head_open(struct skv_kv_cache *c, struct skv_kv_head *hd, int row0, int n)
{
    if (n <= 0)
        return SKV_OK;
    int b0 = row0 / c->block_rows, b1 = blocks_for(c, row0 + n);
    int rc = table_reserve(hd, b1);
    if (b0 > hd->n_blocks)
        b0 = hd->n_blocks;
    for (int b = b0; b < b1 && !rc; b++) {
        if (b < hd->n_blocks) {
            rc = skv_kv_pool_unshare(c->pool, &hd->blk[b]); /* and a new stamp: its bytes change */
        } else if (!(rc = skv_kv_pool_get(c->pool, &hd->blk[b]))) {
            hd->n_blocks++;
        }
        if (!rc)
            hd->mem[b] = hd->blk[b]->mem;
    }
    return rc;
}

enum rows_io {
    ROWS_FROM_BACKEND, /* write the blocks from backend memory (any row stride) */
    ROWS_FROM_HOST,    /* write the blocks from host memory (contiguous rows) */
    ROWS_TO_HOST,      /* read the blocks into host memory (contiguous rows) */
};

/* head_rows_io between host memory and more than one block: the n rows go through one
 * backend buffer, with one upload or download and one copy_rows between it and the blocks.
 * Block by block, a 16K-row head of a GPU daemon took 1024 copies each way (IMPORT_KV of a
 * full 16K session of an 8B shape: 524,288 copies; the H200 run of 2026-11-30 ran out of time
 * filling a pool so). */
static int head_rows_staged(const struct skv_kv_cache *c, const struct skv_kv_head *hd, int which, int row0, int n,
                            void *host, enum rows_io dir)
{
    struct skv_backend *be = c->be;
    const int t = c->block_rows;
    const size_t row = c->row_bytes;
    char *tmp = NULL;
    void **blk = malloc((size_t)n * sizeof *blk), **run = malloc((size_t)n * sizeof *run);
    int rc = blk && run ? be->ops->alloc(be, (size_t)n * row, (void **)&tmp) : skv_errorf(SKV_E_NOMEM, "KV rows: tables");
    if (!rc) {
        for (int i = 0; i < n; i++) {
            int j = row0 + i;
            blk[i] = (char *)hd->mem[j / t] + ((size_t)which * t + j % t) * row;
            run[i] = tmp + (size_t)i * row;
        }
        if (dir == ROWS_FROM_HOST) {
            rc = be->ops->upload(be, tmp, host, (size_t)n * row);
            if (!rc)
                rc = be->ops->copy_rows(be, blk, (const void *const *)run, row, n);
            if (!rc)
                rc = be->ops->sync(be); /* before tmp is freed */
        } else {
            rc = be->ops->copy_rows(be, run, (const void *const *)blk, row, n);
            if (!rc)
                rc = be->ops->download(be, host, tmp, (size_t)n * row);
        }
    }
    if (tmp)
        be->ops->free(be, tmp);
    free(blk);
    free(run);
    return rc;
}

/* Copies rows [row0, row0 + n) of a head between its blocks and a run of n rows of K
 * (which == 0) or V elsewhere, `stride` bytes apart, in the cache's KV type (ROWS_FROM_BACKEND:
 * f32 caches only). The blocks are present (and, to be written, private). */
static int head_rows_io(const struct skv_kv_cache *c, const struct skv_kv_head *hd, int which, int row0, int n,
                        void *other, size_t stride, enum rows_io dir)
{
    struct skv_backend *be = c->be;
    const int t = c->block_rows;
    const size_t row = c->row_bytes;
    if (n <= 0) /* (at a block boundary the test below would take the staged path, a device buffer) */
        return SKV_OK;
    if (dir != ROWS_FROM_BACKEND && stride == row && row0 / t != (row0 + n - 1) / t)
        return head_rows_staged(c, hd, which, row0, n, other, dir);
    for (int j = row0; j < row0 + n;) {
        int b = j / t, off = j % t, m = t - off < row0 + n - j ? t - off : row0 + n - j;
        char *blk = (char *)hd->mem[b] + ((size_t)which * t + off) * row;
        char *o = (char *)other + (size_t)(j - row0) * stride;
        int rc;
        if (dir == ROWS_FROM_BACKEND)
            rc = be->ops->copy_2d(be, blk, row, o, stride, row, m);
        else if (stride != row)
            rc = skv_errorf(SKV_E_INTERNAL, "KV rows: host copies are contiguous");
        else if (dir == ROWS_FROM_HOST)
            rc = be->ops->upload(be, blk, o, (size_t)m * row);
        else
            rc = be->ops->download(be, o, blk, (size_t)m * row);
        if (rc)
            return rc;
        j += m;
    }
    return SKV_OK;
}

int skv_kv_cache_fit(struct skv_kv_cache *c, int layer, int slack)
{
    for (int h = 0; h < c->n_kv_heads; h++) {
        struct skv_kv_head *hd = skv_kv_cache_head(c, layer, h);
        head_release_from(c, hd, blocks_for(c, hd->len));
        int target = hd->len + slack;
        if (target < hd->cap) {
            int rc = head_realloc(c, hd, target > 0 ? target : 1);
            if (rc)
                return rc;
        }
        table_shrink(hd, blocks_for(c, hd->cap));
    }
    return SKV_OK;
}

/* copy_layer of each head's first `rows` rows at most. */
static int copy_layer_rows(struct skv_kv_cache *dst, const struct skv_kv_cache *src, int layer, int rows)
{
    if (dst->pool != src->pool || dst->head_dim != src->head_dim)
        return skv_errorf(SKV_E_INVAL, "KV cache: copying a layer between different pools");
    for (int h = 0; h < dst->n_kv_heads; h++) {
        const struct skv_kv_head *s = &src->heads[layer * src->n_kv_heads + h];
        struct skv_kv_head *d = skv_kv_cache_head(dst, layer, h);
        int len = rows < s->len ? rows : s->len;
        int nb = blocks_for(src, len);
        int rc = head_grow(dst, d, len);
        if (!rc)
            rc = table_reserve(d, nb);
        if (rc)
            return rc;
        for (int b = 0; b < nb; b++)
            skv_kv_pool_hold(dst->pool, s->blk[b]); /* before the release: the blocks may be d's own */
        head_release_from(dst, d, 0);
        for (int b = 0; b < nb; b++) {
            d->blk[b] = s->blk[b];
            d->mem[b] = s->mem[b];
        }
        d->n_blocks = nb;
        if (len > 0) { /* an empty head may have no arrays yet */
            memcpy(d->pos, s->pos, (size_t)len * sizeof *d->pos);
            memcpy(d->score, s->score, (size_t)len * sizeof *d->score);
        }
        d->len = len;
    }
    return SKV_OK;
}

int skv_kv_cache_copy_layer(struct skv_kv_cache *dst, const struct skv_kv_cache *src, int layer)
{
    int rc = copy_layer_rows(dst, src, layer, INT_MAX);
    dst->unordered |= !rc && src->unordered;
    return rc;
}

int skv_kv_cache_reserve(struct skv_kv_cache *c, int extra)
{
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++) {
        struct skv_kv_head *hd = &c->heads[i];
        int rc = head_grow(c, hd, hd->len + extra);
        if (!rc)
            rc = table_reserve(hd, blocks_for(c, hd->len + extra));
        if (rc)
            return rc;
    }
    return SKV_OK;
}

int skv_kv_cache_prepare(struct skv_kv_cache *c, int extra)
{
    int rc = skv_kv_cache_reserve(c, extra);
    for (int i = 0; i < c->n_layers * c->n_kv_heads && !rc; i++)
        rc = head_open(c, &c->heads[i], c->heads[i].len, extra);
    return rc;
}

int skv_kv_cache_clone_rows(const struct skv_kv_cache *src, int rows, struct skv_kv_cache **out)
{
    if (rows < 0)
        return skv_errorf(SKV_E_INVAL, "KV cache: a copy of %d rows", rows);
    if (src->unordered && rows < src->n_past) /* its first rows need not be its earliest */
        return skv_errorf(SKV_E_INTERNAL, "KV cache: a copy of the first %d rows of rows out of position order", rows);
    struct skv_kv_cache *c = calloc(1, sizeof *c);
    if (!c)
        return SKV_E_NOMEM;
    *c = *src;
    c->heads = calloc((size_t)c->n_layers * c->n_kv_heads, sizeof *c->heads);
    if (!c->heads) {
        free(c);
        return SKV_E_NOMEM;
    }
    skv_kv_pool_ref(c->pool);
    for (int l = 0; l < c->n_layers; l++) {
        int rc = copy_layer_rows(c, src, l, rows);
        if (rc) {
            skv_kv_cache_free(&c);
            return rc;
        }
    }
    if (rows < c->n_past)
        c->n_past = rows;
    *out = c;
    return SKV_OK;
}

int skv_kv_cache_clone(const struct skv_kv_cache *src, struct skv_kv_cache **out)
{
    return skv_kv_cache_clone_rows(src, INT_MAX, out);
}

/* Head hd's rows become rows idx[0..cnt) of it (< len, distinct; increasing: a compaction,
 * else any order): a block whose every row stays where it is is kept (and stays shared); the
 * others are gathered into fresh blocks, one copy_rows call for the head, and the old ones
 * released. */
static int head_gather(struct skv_kv_cache *c, struct skv_kv_head *hd, const int32_t *idx, int cnt, bool increasing)
{
    struct skv_backend *be = c->be;
    const int t = c->block_rows, nb = blocks_for(c, cnt);
    const size_t row = c->row_bytes, kv_off = (size_t)t * row;
    struct skv_kv_block **fresh = calloc((size_t)(nb ? nb : 1), sizeof *fresh);
    /* K and V of every moved row, one copy_rows call for the head */
    void **to = malloc((size_t)(2 * cnt + 1) * sizeof *to);
    const void **from = malloc((size_t)(2 * cnt + 1) * sizeof *from);
    /* the positions and scores as they were: in any order they cannot be moved in place */
    int32_t *pos = increasing ? NULL : malloc((size_t)(cnt + 1) * sizeof *pos);
    float *score = increasing ? NULL : malloc((size_t)(cnt + 1) * sizeof *score);
    int rc = fresh && to && from && (increasing || (pos && score)) ? SKV_OK : SKV_E_NOMEM, moved = 0;
    for (int b = 0; b < nb && !rc; b++) {
        int r0 = b * t, r1 = r0 + t < cnt ? r0 + t : cnt;
        bool stays = idx[r0] == r0 && idx[r1 - 1] == r1 - 1; /* increasing: its ends say it */
        for (int i = r0 + 1; !increasing && i < r1 - 1 && stays; i++)
            stays = idx[i] == i;
        if (stays) {
            fresh[b] = hd->blk[b]; /* every row of the block stays where it is */
            skv_kv_pool_hold(c->pool, fresh[b]);
            continue;
        }
        if ((rc = skv_kv_pool_get(c->pool, &fresh[b])))
            break;
        for (int i = r0; i < r1; i++) {
            char *dst = (char *)fresh[b]->mem + (size_t)(i - r0) * row;
            const char *src = (const char *)hd->mem[idx[i] / t] + (size_t)(idx[i] % t) * row;
            to[moved] = dst;
            from[moved++] = src;
            to[moved] = dst + kv_off;
            from[moved++] = src + kv_off;
        }
    }
    if (!rc && moved)
        rc = be->ops->copy_rows(be, to, from, row, moved);
    free(to);
    free(from);
    if (rc) {
        for (int b = 0; fresh && b < nb; b++)
            skv_kv_pool_put(c->pool, fresh[b]);
        free(fresh);
        free(pos);
        free(score);
        return rc;
    }
    head_release_from(c, hd, 0);
    for (int b = 0; b < nb; b++) {
        hd->blk[b] = fresh[b];
        hd->mem[b] = fresh[b]->mem;
    }
    hd->n_blocks = nb;
    if (increasing) {
        for (int i = 0; i < cnt; i++) { /* idx[i] >= i: forward in place */
            hd->pos[i] = hd->pos[idx[i]];
            hd->score[i] = hd->score[idx[i]];
        }
    } else {
        for (int i = 0; i < cnt; i++) {
            pos[i] = hd->pos[idx[i]];
            score[i] = hd->score[idx[i]];
        }
        memcpy(hd->pos, pos, (size_t)cnt * sizeof *pos);
        memcpy(hd->score, score, (size_t)cnt * sizeof *score);
    }
    hd->len = cnt;
    free(fresh);
    free(pos);
    free(score);
    return SKV_OK;
}

/* SKV_OK when rows[0..n) of head hd are strictly increasing row indices, else SKV_E_INVAL
 * naming `what`. */
static int check_row_list(const struct skv_kv_head *hd, const int32_t *rows, int n, const char *what)
{
    if (n < 0 || n > hd->len || (n > 0 && !rows))
        return skv_errorf(SKV_E_INVAL, "%s: %d of %d rows", what, n, hd->len);
    for (int i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= hd->len || (i > 0 && rows[i] <= rows[i - 1]))
            return skv_errorf(SKV_E_INVAL, "%s: row %d at %d is out of range or order", what, rows[i], i);
    return SKV_OK;
}

int skv_kv_cache_compact(struct skv_kv_cache *c, int layer, int h, const int32_t *idx, int cnt)
{
    struct skv_kv_head *hd = skv_kv_cache_head(c, layer, h);
    int rc = check_row_list(hd, idx, cnt, "compaction");
    if (rc)
        return rc;
    if (cnt == hd->len)
        return SKV_OK; /* strictly increasing and as many as there are: every row in place */
    return head_gather(c, hd, idx, cnt, true);
}

int skv_kv_cache_drop_rows(struct skv_kv_cache *c, int layer, int h, const int32_t *drop, int n)
{
    struct skv_kv_head *hd = skv_kv_cache_head(c, layer, h);
    int rc = check_row_list(hd, drop, n, "dropping rows");
    if (rc)
        return rc;
    const int len = hd->len - n, t = c->block_rows;
    /* the holes below the new length, and as many kept rows from above it, both increasing */
    int holes = 0;
    while (holes < n && drop[holes] < len)
        holes++;
    int32_t stack_src[16], *src = holes <= 16 ? stack_src : malloc((size_t)holes * sizeof *src);
    void *stack_to[32], **to = holes <= 16 ? stack_to : malloc((size_t)(2 * holes) * sizeof *to);
    const void *stack_from[32], **from = holes <= 16 ? stack_from : malloc((size_t)(2 * holes) * sizeof *from);
    rc = src && to && from ? SKV_OK : SKV_E_NOMEM;
    for (int j = len, d = holes, k = 0; !rc && j < hd->len && k < holes; j++) {
        if (d < n && drop[d] == j)
            d++;
        else
            src[k++] = j;
    }
    /* every block written unshared first; a failure leaves the rows as they were */
    for (int i = 0; i < holes && !rc; i++) {
        int b = drop[i] / t;
        if (i == 0 || drop[i - 1] / t != b) {
            rc = skv_kv_pool_unshare(c->pool, &hd->blk[b]);
            hd->mem[b] = hd->blk[b]->mem;
        }
    }
    if (!rc && holes) {
        const size_t row = c->row_bytes, kv_off = (size_t)t * row;
        for (int i = 0; i < holes; i++) {
            char *dst = (char *)hd->mem[drop[i] / t] + (size_t)(drop[i] % t) * row;
            const char *from_row = (const char *)hd->mem[src[i] / t] + (size_t)(src[i] % t) * row;
            to[2 * i] = dst;
            from[2 * i] = from_row;
            to[2 * i + 1] = dst + kv_off;
            from[2 * i + 1] = from_row + kv_off;
        }
        rc = c->be->ops->copy_rows(c->be, to, from, row, 2 * holes);
    }
    if (!rc) {
        for (int i = 0; i < holes; i++) {
            hd->pos[drop[i]] = hd->pos[src[i]];
            hd->score[drop[i]] = hd->score[src[i]];
        }
        hd->len = len;
        c->unordered |= holes > 0;
    }
    if (src != stack_src)
        free(src);
    if (to != stack_to)
        free(to);
    if (from != stack_from)
        free(from);
    return rc;
}

static int by_pos_of(const void *a, const void *b, void *arg)
{
    const int32_t *pos = arg;
    int32_t x = pos[*(const int32_t *)a], y = pos[*(const int32_t *)b];
    return x < y ? -1 : x > y;
}

bool skv_kv_head_in_order(const struct skv_kv_head *kh)
{
    for (int j = 1; j < kh->len; j++)
        if (kh->pos[j] <= kh->pos[j - 1])
            return false;
    return true;
}

void skv_kv_head_argsort(const struct skv_kv_head *kh, int32_t *idx)
{
    for (int k = 0; k < kh->len; k++)
        idx[k] = k;
    qsort_r(idx, (size_t)kh->len, sizeof *idx, by_pos_of, kh->pos);
}

int skv_kv_cache_order(struct skv_kv_cache *c)
{
    if (!c->unordered)
        return SKV_OK;
    int32_t *idx = NULL;
    int cap = 0, rc = SKV_OK;
    for (int i = 0; i < c->n_layers * c->n_kv_heads && !rc; i++) {
        struct skv_kv_head *hd = &c->heads[i];
        if (skv_kv_head_in_order(hd))
            continue;
        if (hd->len > cap) {
            int32_t *p = realloc(idx, (size_t)hd->len * sizeof *idx);
            if (!p) {
                rc = SKV_E_NOMEM;
                break;
            }
            idx = p;
            cap = hd->len;
        }
        skv_kv_head_argsort(hd, idx);
        rc = head_gather(c, hd, idx, hd->len, false);
    }
    free(idx);
    if (!rc)
        c->unordered = false;
    return rc;
}

int skv_kv_cache_order_blocks(const struct skv_kv_cache *c, int *shared_out, int *most_out)
{
    int shared = 0, most = 0;
    for (int i = 0; c->unordered && i < c->n_layers * c->n_kv_heads; i++) {
        const struct skv_kv_head *hd = &c->heads[i];
        if (skv_kv_head_in_order(hd))
            continue;
        int n = (int)skv_kv_pool_count_shared(c->pool, hd->blk, hd->n_blocks);
        shared += n;
        most = hd->n_blocks - n > most ? hd->n_blocks - n : most;
    }
    *shared_out = shared;
    *most_out = most;
    return shared + most;
}

int skv_kv_cache_dedupe(struct skv_kv_cache *c, struct skv_kv_dedupe *d, uint64_t group, uint64_t *n_shared)
{
    *n_shared = 0;
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++) {
        struct skv_kv_head *kh = &c->heads[i];
        for (int b = 0; b < kh->len / c->block_rows; b++) {
            bool shared;
            int rc = skv_kv_dedupe_block(d, group, &kh->blk[b], &shared);
            if (rc)
                return rc;
            kh->mem[b] = kh->blk[b]->mem;
            *n_shared += shared;
        }
    }
    return SKV_OK;
}

int skv_kv_cache_append_block(struct skv_kv_cache *c, int layer, int h, struct skv_kv_block *b)
{
    struct skv_kv_head *hd = skv_kv_cache_head(c, layer, h);
    if (hd->len % c->block_rows != 0 || hd->n_blocks != hd->len / c->block_rows)
        return skv_errorf(SKV_E_INVAL, "appending a block after %d rows in %d blocks", hd->len, hd->n_blocks);
    int rc = head_grow(c, hd, hd->len + c->block_rows);
    if (!rc)
        rc = table_reserve(hd, hd->n_blocks + 1);
    if (rc)
        return rc;
    skv_kv_pool_hold(c->pool, b);
    hd->blk[hd->n_blocks] = b;
    hd->mem[hd->n_blocks] = b->mem;
    hd->n_blocks++;
    hd->len += c->block_rows;
    return SKV_OK;
}

int skv_kv_cache_truncate(struct skv_kv_cache *c, int layer, int h, int len)
{
    struct skv_kv_head *hd = skv_kv_cache_head(c, layer, h);
    if (len < 0 || len > hd->len)
        return skv_errorf(SKV_E_INVAL, "truncating %d rows to %d", hd->len, len);
    hd->len = len;
    head_release_from(c, hd, blocks_for(c, len));
    return SKV_OK;
}

int skv_kv_cache_read_rows(const struct skv_kv_cache *c, int layer, int h, int which, int row0, int n,
                           float *dst)
{
    const struct skv_kv_head *hd = &c->heads[layer * c->n_kv_heads + h];
    if (row0 < 0 || n < 0 || row0 + n > hd->len || (which != 0 && which != 1))
        return skv_errorf(SKV_E_INVAL, "reading rows [%d, %d) of %d", row0, row0 + n, hd->len);
    if (c->kv_type == SKV_DTYPE_F32)
        return head_rows_io(c, hd, which, row0, n, dst, c->row_bytes, ROWS_TO_HOST);
    /* f16 / q8_0 rows: read as they are, widened on the host */
    void *raw = malloc(n > 0 ? (size_t)n * c->row_bytes : 1);
    if (!raw)
        return skv_errorf(SKV_E_NOMEM, "reading %d %s rows", n, skv_dtype_name(c->kv_type));
    int rc = head_rows_io(c, hd, which, row0, n, raw, c->row_bytes, ROWS_TO_HOST);
    if (!rc)
        rc = skv_dequantize_row(c->kv_type, raw, dst, (int64_t)n * c->head_dim);
    free(raw);
    return rc;
}

int skv_kv_cache_write_rows(struct skv_kv_cache *c, int layer, int h, int which, int row0, int n,
                            const float *src)
{
    struct skv_kv_head *hd = skv_kv_cache_head(c, layer, h);
    if (row0 < 0 || n < 0 || row0 > hd->len || (which != 0 && which != 1))
        return skv_errorf(SKV_E_INVAL, "writing rows [%d, %d) after %d", row0, row0 + n, hd->len);
    int rc = head_grow(c, hd, row0 + n);
    if (!rc)
        rc = head_open(c, hd, row0, n);
    if (!rc && c->kv_type == SKV_DTYPE_F32) {
        rc = head_rows_io(c, hd, which, row0, n, (void *)src, c->row_bytes, ROWS_FROM_HOST);
    } else if (!rc) { /* f16 / q8_0 rows: rounded on the host as the store op rounds, written as they are */
        const int64_t count = (int64_t)n * c->head_dim;
        void *raw = malloc(n > 0 ? (size_t)n * c->row_bytes : 1);
        if (!raw)
            return skv_errorf(SKV_E_NOMEM, "writing %d %s rows", n, skv_dtype_name(c->kv_type));
        if (c->kv_type == SKV_DTYPE_F16)
            for (int64_t i = 0; i < count; i++)
                ((uint16_t *)raw)[i] = skv_f32_to_fp16_sat(src[i]);
        else
            for (int r = 0; r < n; r++)
                skv_quantize_row_q8_0((char *)raw + (size_t)r * c->row_bytes, src + (size_t)r * c->head_dim,
                                      c->head_dim);
        rc = head_rows_io(c, hd, which, row0, n, raw, c->row_bytes, ROWS_FROM_HOST);
        free(raw);
    }
    if (!rc && row0 + n > hd->len)
        hd->len = row0 + n;
    return rc;
}

void skv_kv_cache_view(struct skv_kv_cache *c, int layer, struct skv_kv_view *view)
{
    view->n_kv_heads = c->n_kv_heads;
    view->head_dim = c->head_dim;
    view->kv_type = c->kv_type;
    view->block_rows = c->block_rows;
    for (int h = 0; h < c->n_kv_heads; h++) {
        struct skv_kv_head *hd = skv_kv_cache_head(c, layer, h);
        view->k[h] = view->v[h] = NULL;
        view->blocks[h] = hd->mem;
        view->pos[h] = hd->pos;
    }
}

uint64_t skv_kv_cache_bytes(const struct skv_kv_cache *c)
{
    uint64_t rows = 0;
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++)
        rows += (uint64_t)c->heads[i].len;
    return rows * 2 * (uint64_t)c->row_bytes;
}

uint64_t skv_kv_cache_host_bytes(const struct skv_kv_cache *c)
{
    uint64_t bytes = sizeof *c + (uint64_t)c->n_layers * c->n_kv_heads * sizeof *c->heads;
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++) {
        const struct skv_kv_head *hd = &c->heads[i];
        bytes += (uint64_t)hd->cap * (sizeof *hd->pos + sizeof *hd->score) +
                 (uint64_t)hd->blk_cap * (sizeof *hd->blk + sizeof *hd->mem);
    }
    return bytes;
}

void skv_kv_head_blocks(const struct skv_kv_cache *c, const struct skv_kv_head *hd, struct skv_kv_blocks *out)
{
    out->held = (uint64_t)hd->n_blocks;
    out->shared = skv_kv_pool_count_shared(c->pool, hd->blk, hd->n_blocks);
}

void skv_kv_cache_blocks(const struct skv_kv_cache *c, struct skv_kv_blocks *out)
{
    out->held = out->shared = 0;
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++) {
        struct skv_kv_blocks one;
        skv_kv_head_blocks(c, &c->heads[i], &one);
        out->held += one.held;
        out->shared += one.shared;
    }
}

void skv_kv_cache_mark(const struct skv_kv_cache *c, uint64_t mark)
{
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++)
        for (int b = 0; b < c->heads[i].n_blocks; b++)
            c->heads[i].blk[b]->mark = mark;
}

uint64_t skv_kv_cache_mark_new(const struct skv_kv_cache *c, uint64_t keep, uint64_t mark)
{
    uint64_t n = 0;
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++)
        for (int b = 0; b < c->heads[i].n_blocks; b++) {
            struct skv_kv_block *blk = c->heads[i].blk[b];
            if (blk->mark != keep && blk->mark != mark) {
                blk->mark = mark;
                n++;
            }
        }
    return n;
}

bool skv_kv_cache_holds_unmarked(const struct skv_kv_cache *c, uint64_t keep)
{
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++)
        for (int b = 0; b < c->heads[i].n_blocks; b++)
            if (c->heads[i].blk[b]->mark != keep)
                return true;
    return false;
}

uint64_t skv_kv_cache_tally(const struct skv_kv_cache *c, uint64_t tally)
{
    uint64_t n = 0;
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++)
        for (int b = 0; b < c->heads[i].n_blocks; b++) {
            struct skv_kv_block *blk = c->heads[i].blk[b];
            n += blk->tally != tally;
            blk->tally = tally;
        }
    return n;
}

void skv_kv_cache_growth(const struct skv_kv_cache *c, int n, bool compacts, uint64_t *more_held,
                         uint64_t *more_unique)
{
    uint64_t held = 0, unique = 0;
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++) {
        const struct skv_kv_head *hd = &c->heads[i];
        int need = blocks_for(c, hd->len + n);
        if (need > hd->n_blocks)
            held += (uint64_t)(need - hd->n_blocks);
        int last = hd->len / c->block_rows; /* the block the next row goes to */
        if (compacts) {
            struct skv_kv_blocks one;
            skv_kv_head_blocks(c, hd, &one);
            unique += one.shared;
        } else if (n > 0 && last < hd->n_blocks && skv_kv_pool_is_shared(c->pool, hd->blk[last])) {
            unique++;
        }
    }
    size_t bytes = skv_kv_pool_block_bytes(c->pool);
    *more_held = held * bytes;
    *more_unique = (held + unique) * bytes;
}

void skv_kv_cache_cut_growth(const struct skv_kv_cache *c, int cut, int n, uint64_t *more_held,
                             uint64_t *more_unique)
{
    uint64_t held = 0, kept = 0;
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++) {
        const struct skv_kv_head *hd = &c->heads[i];
        int below = 0;
        for (int j = 0; j < hd->len; j++)
            below += hd->pos[j] < cut;
        kept += (uint64_t)blocks_for(c, below); /* each shared: the compaction copies it */
        held += (uint64_t)(blocks_for(c, below + n) - blocks_for(c, below));
    }
    size_t bytes = skv_kv_pool_block_bytes(c->pool);
    *more_held = held * bytes;
    *more_unique = (held + kept) * bytes;
}

/* ---- engine --------------------------------------------------------------------------------- */

static void free_buffers(struct skv_engine *e)
{
    float **bufs[] = {&e->x,  &e->x_in, &e->q,  &e->att, &e->xb, &e->kb,
                      &e->vb, &e->ob,   &e->gb, &e->ub,  &e->lb, &e->lg};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        e->be->ops->free(e->be, *bufs[i]);
        *bufs[i] = NULL;
    }
    free(e->pos);
    e->pos = NULL;
    free(e->lhost);
    e->lhost = NULL;
    e->be->ops->free(e->be, e->probs);
    e->probs = NULL;
    e->probs_cap = 0;
    e->cap_tokens = 0;
    e->scratch_bytes = 0;
}

void skv_engine_release_scratch(struct skv_engine *e)
{
    if (e)
        free_buffers(e);
}

/* Makes the full-batch buffers hold n tokens. */
static int ensure_capacity(struct skv_engine *e, int n)
{
    if (n <= e->cap_tokens)
        return SKV_OK;
    const struct skv_model_config *c = &e->m->cfg;
    int cap = e->cap_tokens ? e->cap_tokens : 16;
    while (cap < n)
        cap *= 2;
    free_buffers(e);
    size_t qdim = (size_t)c->n_heads * c->head_dim, kvdim = (size_t)c->n_kv_heads * c->head_dim;
    size_t chunk = CHUNK;
    struct {
        float **p;
        size_t floats;
    } plan[] = {
        {&e->x, (size_t)cap * c->dim},  {&e->x_in, (size_t)cap * c->dim}, {&e->q, (size_t)cap * qdim},
        {&e->att, (size_t)cap * qdim},  {&e->xb, chunk * c->dim},         {&e->kb, chunk * kvdim},
        {&e->vb, chunk * kvdim},        {&e->ob, chunk * c->dim},         {&e->gb, chunk * c->ffn_dim},
        {&e->ub, chunk * c->ffn_dim},   {&e->lb, (size_t)c->n_vocab},
    };
    for (size_t i = 0; i < sizeof plan / sizeof plan[0]; i++) {
        int rc = e->be->ops->alloc(e->be, plan[i].floats * sizeof(float), (void **)plan[i].p);
        if (rc) {
            free_buffers(e);
            return rc;
        }
        e->scratch_bytes += plan[i].floats * sizeof(float);
    }
    e->pos = malloc((size_t)cap * sizeof *e->pos);
    if (!e->pos) {
        free_buffers(e);
        return SKV_E_NOMEM;
    }
    e->cap_tokens = cap;
    return SKV_OK;
}

int skv_engine_new(struct skv_model *m, struct skv_engine **out)
{
    struct skv_engine *e = calloc(1, sizeof *e);
    if (!e)
        return SKV_E_NOMEM;
    e->m = m;
    e->be = m->be;
    e->small_forward = -1;
    *out = e;
    return SKV_OK;
}

void skv_engine_free(struct skv_engine **e_p)
{
    if (!e_p || !*e_p)
        return;
    free_buffers(*e_p);
    free((*e_p)->row_dst);
    free((*e_p)->row_src);
    free((*e_p)->views);
    free(*e_p);
    *e_p = NULL;
}

struct skv_model *skv_engine_model(const struct skv_engine *e)
{
    return e->m;
}

uint64_t skv_engine_scratch_bytes(const struct skv_engine *e)
{
    return e ? e->scratch_bytes : 0;
}

#define CHECK(expr)                                                                                \
    do {                                                                                           \
        int rc_ = (expr);                                                                          \
        if (rc_)                                                                                   \
            return rc_;                                                                            \
    } while (0)

/* Rows [i0, i0 + m) of layer l's attention input: x normalized, projected and rotated.
 * Queries land in e->q (row i0 onwards), keys and values in e->kb / e->vb (row 0 onwards). */
static int attn_project(struct skv_engine *e, int l, int i0, int m)
{
    struct skv_backend *be = e->be;
    const struct skv_backend_ops *ops = be->ops;
    const struct skv_model_config *c = &e->m->cfg;
    const struct skv_layer_weights *w = &e->m->layers[l];
    float *q = e->q + (size_t)i0 * c->n_heads * c->head_dim;
    CHECK(ops->rmsnorm(be, e->xb, e->x + (size_t)i0 * c->dim, w->attn_norm.data, m, c->dim, c->norm_eps));
    const struct skv_matmul_part qkv[3] = {
        {q, &w->wq, w->bq.data}, {e->kb, &w->wk, w->bk.data}, {e->vb, &w->wv, w->bv.data},
    };
    CHECK(ops->matmul_multi(be, qkv, 3, e->xb, m));
    CHECK(ops->rope(be, q, m, c->n_heads, c->head_dim, e->pos + i0, &c->rope));
    CHECK(ops->rope(be, e->kb, m, c->n_kv_heads, c->head_dim, e->pos + i0, &c->rope));
    return SKV_OK;
}

/* Rows per head up to which cache_store queues single rows for one copy_rows (decode, short
 * appends: one launch for every head, K and V, and in a batched step every sequence, where
 * copies per head cost a launch each); longer runs go by copy_2d, one per block. */
#define STORE_BY_ROWS 8

/* Stores every queued row: one copy_rows (f32 caches), store_rows_f16 or store_rows_q8_0. */
static int rows_flush(struct skv_engine *e)
{
    int n = (int)e->n_rows;
    e->n_rows = 0;
    if (n == 0)
        return SKV_OK;
    const float *const *src = (const float *const *)e->row_src;
    if (e->rows_type == SKV_DTYPE_F16)
        return e->be->ops->store_rows_f16(e->be, e->row_dst, src, e->m->cfg.head_dim, n);
    if (e->rows_type == SKV_DTYPE_Q8_0)
        return e->be->ops->store_rows_q8_0(e->be, e->row_dst, src, e->m->cfg.head_dim, n);
    return e->be->ops->copy_rows(e->be, e->row_dst, e->row_src, e->m->cfg.head_dim * sizeof(float), n);
}

/* Queues rows [j, j + m) of e->kb / e->vb for rows at[h] ... of every head of layer l (the
 * heads have room), to be stored by rows_flush (rows of a cache of the other KV type queued
 * before are stored first). Queues nothing else when it fails. */
static int rows_add(struct skv_engine *e, struct skv_kv_cache *cache, int l, const int32_t *at, int j, int m)
{
    const struct skv_model_config *c = &e->m->cfg;
    const int hd = c->head_dim, t = cache->block_rows;
    const size_t kvdim = (size_t)c->n_kv_heads * hd, row = cache->row_bytes;
    if (e->n_rows > 0 && e->rows_type != cache->kv_type)
        CHECK(rows_flush(e)); /* a cache of the other type: its rows go by the other op */
    const size_t need = e->n_rows + 2 * (size_t)c->n_kv_heads * m;
    if (need > e->rows_cap) {
        size_t cap = e->rows_cap ? e->rows_cap : 256;
        while (cap < need)
            cap *= 2;
        void **d = realloc(e->row_dst, cap * sizeof *d);
        if (d)
            e->row_dst = d;
        const void **src = realloc(e->row_src, cap * sizeof *src);
        if (src)
            e->row_src = src;
        if (!d || !src)
            return skv_errorf(SKV_E_NOMEM, "engine: a table of %zu KV rows", cap);
        e->rows_cap = cap;
    }
    for (int h = 0; h < c->n_kv_heads; h++) {
        struct skv_kv_head *kh = skv_kv_cache_head(cache, l, h);
        for (int which = 0; which < 2; which++) {
            const float *base = (which ? e->vb : e->kb) + (size_t)h * hd;
            for (int r = 0; r < m; r++) {
                const int at_r = at[h] + r;
                e->row_dst[e->n_rows] = (char *)kh->mem[at_r / t] + ((size_t)which * t + at_r % t) * row;
                e->row_src[e->n_rows++] = base + (size_t)(j + r) * kvdim;
            }
        }
    }
    e->rows_type = cache->kv_type;
    return SKV_OK;
}

/* Records positions e->pos[i0 ...] and zero scores for rows at[h] ... of every head. */
static void rows_meta(struct skv_engine *e, struct skv_kv_cache *cache, int l, const int32_t *at, int m, int i0)
{
    for (int h = 0; h < e->m->cfg.n_kv_heads; h++) {
        struct skv_kv_head *kh = skv_kv_cache_head(cache, l, h);
        memcpy(kh->pos + at[h], e->pos + i0, (size_t)m * sizeof(int32_t));
        memset(kh->score + at[h], 0, (size_t)m * sizeof(float));
    }
}

/* Appends rows [j, j + m) of e->kb / e->vb (original positions e->pos[i0 ...]) to layer l of
 * the cache at row `at` of every head (the heads have room). */
static int cache_store(struct skv_engine *e, struct skv_kv_cache *cache, int l, const int32_t *at, int j,
                       int m, int i0)
{
    const struct skv_model_config *c = &e->m->cfg;
    int hd = c->head_dim;
    size_t kvdim = (size_t)c->n_kv_heads * hd;
    if (m <= STORE_BY_ROWS || cache->kv_type != SKV_DTYPE_F32) { /* f16 / q8_0: always converted by rows */
        CHECK(rows_add(e, cache, l, at, j, m));
        CHECK(rows_flush(e));
    } else {
        for (int h = 0; h < c->n_kv_heads; h++) {
            struct skv_kv_head *kh = skv_kv_cache_head(cache, l, h);
            float *ks = e->kb + (size_t)j * kvdim + (size_t)h * hd, *vs = e->vb + (size_t)j * kvdim + (size_t)h * hd;
            CHECK(head_rows_io(cache, kh, 0, at[h], m, ks, kvdim * sizeof(float), ROWS_FROM_BACKEND));
            CHECK(head_rows_io(cache, kh, 1, at[h], m, vs, kvdim * sizeof(float), ROWS_FROM_BACKEND));
        }
    }
    rows_meta(e, cache, l, at, m, i0);
    return SKV_OK;
}

/* Makes every head of layer l take n more rows (blocks taken, a shared last block copied);
 * len0[h] = its rows before. */
static int cache_open_rows(struct skv_kv_cache *cache, int l, int n, int32_t *len0)
{
    for (int h = 0; h < cache->n_kv_heads; h++) {
        struct skv_kv_head *kh = skv_kv_cache_head(cache, l, h);
        CHECK(head_grow(cache, kh, kh->len + n));
        CHECK(head_open(cache, kh, kh->len, n));
        len0[h] = kh->len;
    }
    return SKV_OK;
}

/* The running forward's tick, between two chunks of a layer (a forward without one: nothing). */
static void tick(struct skv_engine *e)
{
    if (e->tick)
        e->tick->tick(e->tick->tick_user);
}

/* The attention view of layer l of the cache for n new rows after the len0[h] its heads held
 * (the heads' lengths set to include them). Sliding-window layers mask by the rows' original
 * positions (compression may have dropped rows), so the cache keeps every row; the op skips
 * the ones out of reach. */
static void attn_view(struct skv_engine *e, struct skv_kv_cache *cache, int l, const int32_t *len0, int n,
                      struct skv_kv_view *view)
{
    *view = (struct skv_kv_view){.window = e->m->layers[l].window};
    skv_kv_cache_view(cache, l, view);
    for (int h = 0; h < cache->n_kv_heads; h++) {
        skv_kv_cache_head(cache, l, h)->len = len0[h] + n;
        view->prefix_len[h] = len0[h];
    }
}

/* Attention of the n queries at e->q + i0 rows over layer l of the cache (whose heads held
 * len0[h] rows before these n were appended), into e->att from row i0. */
static int attn_over_cache(struct skv_engine *e, struct skv_kv_cache *cache, int l, const int32_t *len0, int i0,
                           int n)
{
    const struct skv_model_config *c = &e->m->cfg;
    size_t qdim = (size_t)c->n_heads * c->head_dim;
    struct skv_kv_view view;
    attn_view(e, cache, l, len0, n, &view);
    return e->be->ops->attention(e->be, e->att + (size_t)i0 * qdim, e->q + (size_t)i0 * qdim, n, c->n_heads, &view);
}

/* Attention of the m sequences' new queries (rows i0 .. i0 + m - 1 of e->q; sequence i's
 * heads held len0[i - i0][h] rows before its new one), into e->att: one attention_batch call
 * where the backend has it, else one attention call per sequence (the same bits either way). */
static int attn_over_caches(struct skv_engine *e, const struct skv_batch_seq *seqs, int l,
                            int32_t (*len0)[SKV_MAX_KV_HEADS], int i0, int m)
{
    const struct skv_backend_ops *ops = e->be->ops;
    bool probs = false;
    for (int i = i0; i < i0 + m; i++)
        probs |= e->probs_at[i] != NULL;
    if (!probs && (!ops->attention_batch || m == 1)) {
        for (int i = i0; i < i0 + m; i++)
            CHECK(attn_over_cache(e, seqs[i].cache, l, len0[i - i0], i, 1));
        return SKV_OK;
    }
    if (!e->views && !(e->views = calloc(SKV_ENGINE_MAX_BATCH, sizeof *e->views)))
        return skv_errorf(SKV_E_NOMEM, "engine: the views of a decode group");
    size_t qdim = (size_t)e->m->cfg.n_heads * e->m->cfg.head_dim;
    for (int i = i0; i < i0 + m; i++)
        attn_view(e, seqs[i].cache, l, len0[i - i0], 1, &e->views[i - i0]);
    if (probs)
        return ops->attention_batch_probs(e->be, e->att + (size_t)i0 * qdim, e->q + (size_t)i0 * qdim, m,
                                          e->m->cfg.n_heads, e->views, e->probs_at + i0, e->probs_stride + i0);
    return ops->attention_batch(e->be, e->att + (size_t)i0 * qdim, e->q + (size_t)i0 * qdim, m, e->m->cfg.n_heads,
                                e->views);
}

/* Where the attention of layer l puts each of the n sequences' probabilities (e->probs_at[i],
 * NULL for one whose opts do not ask for them, and for every one when the backend has no
 * attention_batch_probs or there is no memory for them), with room for them in e->probs. Before
 * the layer's new rows are opened: a sequence's stride is its longest head's rows then, plus
 * its new one. */
static int probs_plan(struct skv_engine *e, const struct skv_batch_seq *seqs, int l, int n)
{
    struct skv_backend *be = e->be;
    const int n_heads = e->m->cfg.n_heads;
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        const struct skv_forward_opts *o = seqs[i].opts;
        e->probs_stride[i] = 0;
        if (!be->ops->attention_batch_probs || !o || !o->attention_probs)
            continue;
        for (int h = 0; h < seqs[i].cache->n_kv_heads; h++) {
            int64_t rows = (int64_t)skv_kv_cache_head(seqs[i].cache, l, h)->len + 1;
            e->probs_stride[i] = rows > e->probs_stride[i] ? rows : e->probs_stride[i];
        }
        total += (size_t)n_heads * (size_t)e->probs_stride[i];
    }
    if (total > e->probs_cap) {
        size_t cap = e->probs_cap ? e->probs_cap : 4096;
        while (cap < total)
            cap *= 2;
        if (e->probs) {
            be->ops->free(be, e->probs);
            e->scratch_bytes -= e->probs_cap * sizeof(float);
        }
        e->probs = NULL;
        e->probs_cap = 0;
        if (be->ops->alloc(be, cap * sizeof(float), (void **)&e->probs) != SKV_OK) {
            /* no room: the hooks compute them (attention_colsum, whose memory the compressor
             * took before the forward), rather than the whole decode group failing */
            e->probs = NULL;
            for (int i = 0; i < n; i++)
                e->probs_stride[i] = 0;
        } else {
            e->probs_cap = cap;
            e->scratch_bytes += cap * sizeof(float);
        }
    }
    for (size_t i = 0, at = 0; i < (size_t)n; i++) {
        e->probs_at[i] = e->probs_stride[i] ? e->probs + at : NULL;
        at += (size_t)n_heads * (size_t)e->probs_stride[i];
    }
    return SKV_OK;
}

/* Rows of the chunk of a forward of n rows that starts at row i0: CHUNK, but when the last
 * chunk would have no more rows than the backend computes one by one (skv_engine_small_forward),
 * the last two share the rest evenly. So every chunk of a forward of more rows than that takes
 * the batched kernels, whatever row the call starts at: a PREFILL that computes only a prompt's
 * end after a reused prefix computes each row as a prefill of the whole prompt does. */
static int chunk_rows(struct skv_engine *e, int n, int i0)
{
    int left = n - i0, small = skv_engine_small_forward(e);
    if (left <= CHUNK)
        return left;
    return left - CHUNK <= (small < CHUNK ? small : CHUNK - 1) ? left / 2 : CHUNK; /* left / 2 < CHUNK */
}

/* attn_over_cache of all n queries; in a forward with a tick, in calls of about SPLIT_QUERIES
 * queries with a tick between them, where the backend says such calls give every query what
 * one call gives (attention_split_rows): the attention of a long prompt is the longest step of
 * a layer, and what the tick does (a decode round) should not wait for all of it. */
#define SPLIT_QUERIES 256
static int attn_over_cache_ticking(struct skv_engine *e, struct skv_kv_cache *cache, int l, const int32_t *len0,
                                   int n)
{
    const struct skv_backend_ops *ops = e->be->ops;
    int r = e->tick && ops->attention_split_rows
                ? ops->attention_split_rows(e->be, e->m->cfg.n_heads, e->m->cfg.n_kv_heads)
                : 0;
    int step = r > 0 ? (SPLIT_QUERIES / r > 2 ? SPLIT_QUERIES / r : 2) * r : n;
    if (n <= step)
        return attn_over_cache(e, cache, l, len0, 0, n);
    int32_t at[SKV_MAX_KV_HEADS];
    for (int i0 = 0; i0 < n;) {
        int m = n - i0 < step ? n - i0 : step;
        if (n - i0 - m < 2 * r) /* a short tail joins this call */
            m = n - i0;
        for (int h = 0; h < cache->n_kv_heads; h++)
            at[h] = len0[h] + i0;
        CHECK(attn_over_cache(e, cache, l, at, i0, m));
        i0 += m;
        if (i0 < n)
            tick(e);
    }
    return SKV_OK;
}

/* x += attention output . Wo over the n rows. */
static int attn_output(struct skv_engine *e, int l, int n)
{
    struct skv_backend *be = e->be;
    const struct skv_backend_ops *ops = be->ops;
    const struct skv_model_config *c = &e->m->cfg;
    size_t qdim = (size_t)c->n_heads * c->head_dim;
    for (int i0 = 0, m; i0 < n; i0 += m) {
        m = chunk_rows(e, n, i0);
        float *x = e->x + (size_t)i0 * c->dim;
        CHECK(ops->matmul(be, e->ob, &e->m->layers[l].wo, NULL, e->att + (size_t)i0 * qdim, m));
        CHECK(ops->add(be, x, x, e->ob, (int64_t)m * c->dim));
    }
    return SKV_OK;
}

/* Attention half of layer l for n tokens of one sequence: projections, RoPE, cache append,
 * attention, output projection and residual. Leaves x = x + attn(x). */
static int layer_attention(struct skv_engine *e, struct skv_kv_cache *cache, int l, int n,
                           const struct skv_forward_opts *opts)
{
    const struct skv_batch_seq one = {.cache = cache, .opts = n == 1 ? opts : NULL};
    CHECK(probs_plan(e, &one, l, 1));
    int32_t len0[SKV_MAX_KV_HEADS];
    CHECK(cache_open_rows(cache, l, n, len0));
    for (int i0 = 0, m; i0 < n; i0 += m) {
        m = chunk_rows(e, n, i0);
        int32_t at[SKV_MAX_KV_HEADS];
        for (int h = 0; h < cache->n_kv_heads; h++)
            at[h] = len0[h] + i0;
        CHECK(attn_project(e, l, i0, m));
        CHECK(cache_store(e, cache, l, at, 0, m, i0));
        tick(e);
    }
    if (e->probs_at[0]) /* (n = 1) */
        CHECK(attn_over_caches(e, &one, l, &len0, 0, 1));
    else
        CHECK(attn_over_cache_ticking(e, cache, l, len0, n));
    return attn_output(e, l, n);
}

/* Attention half of layer l for one new token of each of n sequences (row i: seqs[i]). */
static int layer_attention_batch(struct skv_engine *e, const struct skv_batch_seq *seqs, int l, int n)
{
    CHECK(probs_plan(e, seqs, l, n));
    for (int i0 = 0; i0 < n; i0 += CHUNK) {
        int m = n - i0 < CHUNK ? n - i0 : CHUNK;
        CHECK(attn_project(e, l, i0, m));
        /* every sequence's new K / V rows in one copy_rows, then each one's attention */
        int32_t len0[SKV_ENGINE_MAX_BATCH][SKV_MAX_KV_HEADS];
        for (int i = i0; i < i0 + m; i++) {
            int rc = cache_open_rows(seqs[i].cache, l, 1, len0[i - i0]);
            if (!rc)
                rc = rows_add(e, seqs[i].cache, l, len0[i - i0], i - i0, 1);
            if (rc) {
                e->n_rows = 0; /* nothing queued is stored */
                return rc;
            }
            rows_meta(e, seqs[i].cache, l, len0[i - i0], 1, i);
        }
        CHECK(rows_flush(e));
        CHECK(attn_over_caches(e, seqs, l, len0, i0, m));
    }
    return attn_output(e, l, n);
}

/* MLP half of layer l: x = x + down(silu(gate(norm(x))) * up(norm(x))). */
static int layer_mlp(struct skv_engine *e, int l, int n)
{
    struct skv_backend *be = e->be;
    const struct skv_backend_ops *ops = be->ops;
    const struct skv_model_config *c = &e->m->cfg;
    const struct skv_layer_weights *w = &e->m->layers[l];
    for (int i0 = 0, m; i0 < n; i0 += m) {
        m = chunk_rows(e, n, i0);
        float *x = e->x + (size_t)i0 * c->dim;
        CHECK(ops->rmsnorm(be, e->xb, x, w->ffn_norm.data, m, c->dim, c->norm_eps));
        const struct skv_matmul_part gate_up[2] = {{e->gb, &w->w_gate, NULL}, {e->ub, &w->w_up, NULL}};
        CHECK(ops->matmul_multi(be, gate_up, 2, e->xb, m));
        CHECK(ops->swiglu(be, e->gb, e->gb, e->ub, (int64_t)m * c->ffn_dim));
        CHECK(ops->matmul(be, e->ob, &w->w_down, NULL, e->gb, m));
        CHECK(ops->add(be, x, x, e->ob, (int64_t)m * c->dim));
        tick(e);
    }
    return SKV_OK;
}

static int check_cache(const struct skv_model_config *c, const struct skv_kv_cache *cache, int n)
{
    if (cache->n_layers != c->n_layers || cache->n_kv_heads != c->n_kv_heads || cache->head_dim != c->head_dim)
        return skv_errorf(SKV_E_INVAL, "the cache was made for another model");
    if ((int64_t)cache->n_past + n > INT32_MAX / 2)
        return skv_errorf(SKV_E_LIMIT, "sequence too long");
    return SKV_OK;
}

/* After a forward that failed: drops the rows it appended (positions from `from` on: a
 * forward's rows are the tail of every head, whatever its hook evicted) and puts n_past back,
 * so the cache is as before it, less any rows the hook had already evicted. */
static void forward_undo(struct skv_kv_cache *cache, int32_t from)
{
    for (int l = 0; l < cache->n_layers; l++)
        for (int h = 0; h < cache->n_kv_heads; h++) {
            struct skv_kv_head *kh = skv_kv_cache_head(cache, l, h);
            int len = kh->len;
            while (len > 0 && kh->pos[len - 1] >= from)
                len--;
            skv_kv_cache_truncate(cache, l, h, len); /* releases the blocks past: cannot fail */
        }
    cache->n_past = from;
}

static int forward_run(struct skv_engine *e, struct skv_kv_cache *cache, const int32_t *tokens, int n,
                       const struct skv_forward_opts *opts, float *logits);

int skv_engine_forward(struct skv_engine *e, struct skv_kv_cache *cache, const int32_t *tokens, int n,
                       const struct skv_forward_opts *opts, float *logits)
{
    const struct skv_model_config *c = &e->m->cfg;
    if (!cache || !tokens || n <= 0)
        return skv_errorf(SKV_E_INVAL, "forward needs a cache and at least one token");
    CHECK(check_cache(c, cache, n));
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->n_vocab)
            return skv_errorf(SKV_E_INVAL, "token %d at index %d is outside the vocabulary [0, %d)",
                              tokens[i], i, c->n_vocab);
    if (opts && opts->n_targets) {
        if (opts->n_targets < 0 || opts->n_targets > n || !opts->targets || !opts->target_logprobs || !logits ||
            opts->logits_all)
            return skv_errorf(SKV_E_INVAL, "scoring %d targets of a forward of %d tokens needs 1 to %d targets, "
                              "their outputs and the last logits' (not logits_all)", opts->n_targets, n, n);
        for (int i = 0; i < opts->n_targets; i++)
            if (opts->targets[i] < 0 || opts->targets[i] >= c->n_vocab)
                return skv_errorf(SKV_E_INVAL, "target %d at index %d is outside the vocabulary [0, %d)",
                                  opts->targets[i], i, c->n_vocab);
        if (opts->target_top_n < 0 || opts->target_top_n > c->n_vocab ||
            (opts->target_top_n && (!opts->target_top_ids || !opts->target_top_logprobs)))
            return skv_errorf(SKV_E_INVAL, "the %d most likely tokens of each position scored: needs 0 to %d, and "
                              "arrays for them", opts->target_top_n, c->n_vocab);
    }
    int32_t from = cache->n_past;
    e->tick = opts && opts->tick ? opts : NULL;
    int rc = forward_run(e, cache, tokens, n, opts, logits);
    e->tick = NULL;
    if (rc)
        forward_undo(cache, from);
    else if (opts && opts->done)
        opts->done(opts->done_user, cache);
    return rc;
}

/* Rows of logits one chunk of scoring holds ([SCORE_ROWS][n_vocab] on the device, and again on
 * the host where the backend has no row_logprobs: 25 MB each for a 49152-token vocabulary). The
 * last two chunks split evenly where the last would be a small-batch one, so that every row of a
 * prompt longer than that takes the batched matmul. */
#define SCORE_ROWS 128
static int score_rows(struct skv_engine *e, int n, int i0)
{
    int left = n - i0, small = skv_engine_small_forward(e);
    small = small < SCORE_ROWS ? small : SCORE_ROWS - 1; /* left / 2 < SCORE_ROWS */
    return left <= SCORE_ROWS ? left : left - SCORE_ROWS <= small ? left / 2 : SCORE_ROWS;
}

/* The output of a forward's first opts->n_targets rows (e->x, after the last layer), a chunk
 * at a time, scored against opts->targets. */
static int score_targets(struct skv_engine *e, const struct skv_forward_opts *opts)
{
    const struct skv_model_config *c = &e->m->cfg;
    struct skv_backend *be = e->be;
    const struct skv_backend_ops *ops = be->ops;
    int n = opts->n_targets, cap = n < SCORE_ROWS ? n : SCORE_ROWS;
    size_t row = (size_t)c->n_vocab * sizeof(float);
    /* without the backend's op for what is asked, each chunk's logits come to the host */
    int k = opts->target_top_n;
    bool op = k ? ops->row_top_logprobs != NULL : ops->row_logprobs != NULL;
    float *host = op ? NULL : malloc((size_t)cap * row), *out = NULL;
    int rc = host || op ? ops->alloc(be, (size_t)cap * row, (void **)&out) : SKV_E_NOMEM;
    for (int i0 = 0, m; !rc && i0 < n; i0 += m) {
        m = score_rows(e, n, i0);
        if (i0)
            tick(e);
        rc = ops->rmsnorm(be, e->xb, e->x + (size_t)i0 * c->dim, e->m->output_norm.data, m, c->dim, c->norm_eps);
        if (!rc)
            rc = ops->matmul(be, out, &e->m->output, NULL, e->xb, m);
        if (rc)
            break;
        if (op && k) {
            size_t at = (size_t)i0 * (size_t)k;
            rc = ops->row_top_logprobs(be, opts->target_logprobs + i0, opts->target_top_ids + at,
                                       opts->target_top_logprobs + at, k, out, opts->targets + i0, m, c->n_vocab);
            for (int r = 0; !rc && opts->target_top && r < m; r++) /* the first of each list */
                opts->target_top[i0 + r] = opts->target_top_ids[(size_t)(i0 + r) * (size_t)k];
        } else if (op) {
            rc = ops->row_logprobs(be, opts->target_logprobs + i0, opts->target_top ? opts->target_top + i0 : NULL,
                                   out, opts->targets + i0, m, c->n_vocab);
        } else {
            rc = ops->download(be, host, out, (size_t)m * row);
            for (int r = 0; !rc && r < m; r++) {
                const float *lg = host + (size_t)r * c->n_vocab;
                size_t at = (size_t)(i0 + r) * (size_t)k;
                skv_logprobs(lg, c->n_vocab, opts->targets[i0 + r], k, &opts->target_logprobs[i0 + r],
                             k ? opts->target_top_ids + at : NULL, k ? opts->target_top_logprobs + at : NULL);
                if (opts->target_top)
                    opts->target_top[i0 + r] = k ? opts->target_top_ids[at]
                                                 : skv_argmax(lg, c->n_vocab);
            }
        }
    }
    if (out)
        ops->free(be, out);
    free(host);
    return rc;
}

static int forward_run(struct skv_engine *e, struct skv_kv_cache *cache, const int32_t *tokens, int n,
                       const struct skv_forward_opts *opts, float *logits)
{
    const struct skv_model_config *c = &e->m->cfg;
    struct skv_backend *be = e->be;
    const struct skv_backend_ops *ops = be->ops;
    CHECK(ensure_capacity(e, n));
    for (int i = 0; i < n; i++)
        e->pos[i] = cache->n_past + i;
    for (int i0 = 0, m; i0 < n; i0 += m) {
        m = chunk_rows(e, n, i0);
        CHECK(ops->get_rows(be, e->x + (size_t)i0 * c->dim, &e->m->tok_embd, tokens + i0, m));
    }
    bool hook = opts && opts->hook;
    for (int l = 0; l < c->n_layers; l++) {
        if (hook)
            CHECK(ops->copy_2d(be, e->x_in, (size_t)n * c->dim * sizeof(float), e->x,
                               (size_t)n * c->dim * sizeof(float), (size_t)n * c->dim * sizeof(float), 1));
        CHECK(layer_attention(e, cache, l, n, opts));
        if (hook) {
            struct skv_layer_view v = {.layer = l, .n = n, .window = e->m->layers[l].window, .q = e->q,
                                       .x_in = e->x_in, .x_mid = e->x, .cache = cache,
                                       .probs = e->probs_at[0], .probs_stride = e->probs_stride[0]};
            CHECK(opts->hook(opts->hook_user, &v));
        }
        CHECK(layer_mlp(e, l, n));
    }
    cache->n_past += n;
    if (!logits)
        return SKV_OK;
    if (opts && opts->n_targets)
        CHECK(score_targets(e, opts));
    bool all = opts && opts->logits_all;
    int first = all ? 0 : n - 1, rows = all ? n : 1;
    for (int i0 = 0, m; i0 < rows; i0 += m) {
        m = chunk_rows(e, rows, i0);
        float *out = NULL;
        size_t bytes = (size_t)m * c->n_vocab * sizeof(float);
        CHECK(ops->rmsnorm(be, e->xb, e->x + (size_t)(first + i0) * c->dim, e->m->output_norm.data, m, c->dim,
                           c->norm_eps));
        if (m == 1)
            out = e->lb;
        else
            CHECK(ops->alloc(be, bytes, (void **)&out));
        int rc = ops->matmul(be, out, &e->m->output, NULL, e->xb, m);
        if (!rc)
            rc = ops->download(be, logits + (size_t)i0 * c->n_vocab, out, bytes);
        if (out != e->lb)
            ops->free(be, out);
        CHECK(rc);
    }
    return SKV_OK;
}

static int decode_group_run(struct skv_engine *e, const struct skv_batch_seq *seqs, const int32_t *tokens, int n,
                            bool hook);
static int decode_group_size(struct skv_engine *e);

/* One forward for the n sequences of a decode group; when it fails, none of them keeps a row
 * of it (forward_undo). */
static int decode_group_forward(struct skv_engine *e, const struct skv_batch_seq *seqs, int n)
{
    const struct skv_model_config *c = &e->m->cfg;
    if (!seqs || n < 1 || n > SKV_ENGINE_MAX_BATCH)
        return skv_errorf(SKV_E_INVAL, "a batched decode takes 1 to %d sequences, not %d", SKV_ENGINE_MAX_BATCH, n);
    int32_t tokens[SKV_ENGINE_MAX_BATCH];
    bool hook = false;
    for (int i = 0; i < n; i++) {
        if (!seqs[i].cache)
            return skv_errorf(SKV_E_INVAL, "sequence %d of the batch has no cache", i);
        CHECK(check_cache(c, seqs[i].cache, 1));
        for (int j = 0; j < i; j++)
            if (seqs[j].cache == seqs[i].cache)
                return skv_errorf(SKV_E_INVAL, "sequences %d and %d of the batch share a cache", j, i);
        if (seqs[i].token < 0 || seqs[i].token >= c->n_vocab)
            return skv_errorf(SKV_E_INVAL, "token %d of sequence %d is outside the vocabulary [0, %d)",
                              seqs[i].token, i, c->n_vocab);
        tokens[i] = seqs[i].token;
        hook = hook || (seqs[i].opts && seqs[i].opts->hook);
    }
    int32_t from[SKV_ENGINE_MAX_BATCH];
    for (int i = 0; i < n; i++)
        from[i] = seqs[i].cache->n_past;
    int rc = decode_group_run(e, seqs, tokens, n, hook);
    for (int i = 0; i < n; i++)
        if (rc)
            forward_undo(seqs[i].cache, from[i]);
        else if (seqs[i].opts && seqs[i].opts->done)
            seqs[i].opts->done(seqs[i].opts->done_user, seqs[i].cache);
    return rc;
}

static int decode_group_run(struct skv_engine *e, const struct skv_batch_seq *seqs, const int32_t *tokens, int n,
                            bool hook)
{
    const struct skv_model_config *c = &e->m->cfg;
    struct skv_backend *be = e->be;
    const struct skv_backend_ops *ops = be->ops;
    size_t qdim = (size_t)c->n_heads * c->head_dim;
    CHECK(ensure_capacity(e, n));
    for (int i = 0; i < n; i++)
        e->pos[i] = seqs[i].cache->n_past;
    CHECK(ops->get_rows(be, e->x, &e->m->tok_embd, tokens, n));
    for (int l = 0; l < c->n_layers; l++) {
        if (hook)
            CHECK(ops->copy_2d(be, e->x_in, (size_t)n * c->dim * sizeof(float), e->x,
                               (size_t)n * c->dim * sizeof(float), (size_t)n * c->dim * sizeof(float), 1));
        CHECK(layer_attention_batch(e, seqs, l, n));
        for (int i = 0; i < n; i++) {
            const struct skv_forward_opts *o = seqs[i].opts;
            if (!o || !o->hook)
                continue;
            struct skv_layer_view v = {.layer = l, .n = 1, .q = e->q + (size_t)i * qdim,
                                       .x_in = e->x_in + (size_t)i * c->dim, .x_mid = e->x + (size_t)i * c->dim,
                                       .cache = seqs[i].cache, .window = e->m->layers[l].window,
                                       .probs = e->probs_at[i], .probs_stride = e->probs_stride[i]};
            CHECK(o->hook(o->hook_user, &v));
        }
        CHECK(layer_mlp(e, l, n));
    }
    for (int i = 0; i < n; i++)
        seqs[i].cache->n_past += 1;
    CHECK(ops->rmsnorm(be, e->xb, e->x, e->m->output_norm.data, n, c->dim, c->norm_eps));
    size_t row = (size_t)c->n_vocab * sizeof(float);
    float *out = e->lb;
    if (n > 1) {
        if (!e->lg) { /* n <= the group size: skv_engine_decode_batch cuts groups so */
            size_t bytes = (size_t)decode_group_size(e) * row;
            CHECK(ops->alloc(be, bytes, (void **)&e->lg));
            e->scratch_bytes += bytes;
        }
        out = e->lg;
    }
    CHECK(ops->matmul(be, out, &e->m->output, NULL, e->xb, n));
    /* every row down first: a download that fails leaves each sequence's logits as they were,
     * those of the token before, as the caller undoes every cache of the group */
    if (!e->lhost) {
        size_t bytes = (size_t)decode_group_size(e) * row;
        if (!(e->lhost = malloc(bytes)))
            return SKV_E_NOMEM;
        e->scratch_bytes += bytes;
    }
    CHECK(ops->download(be, e->lhost, out, (size_t)n * row));
    for (int i = 0; i < n; i++)
        if (seqs[i].logits)
            memcpy(seqs[i].logits, e->lhost + (size_t)i * c->n_vocab, row);
    return SKV_OK;
}

/* The least and most rows the backend's matmul computes one by one exactly as for one row
 * (matmul_rows_as_one) over the model's weights; false when the backend does not say. */
static bool rows_as_one(struct skv_engine *e, int *lo, int *hi)
{
    struct skv_backend *be = e->be;
    if (!be->ops->matmul_rows_as_one)
        return false;
    const struct skv_model *m = e->m;
    *lo = *hi = be->ops->matmul_rows_as_one(be, &m->output);
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const struct skv_layer_weights *w = &m->layers[l];
        const struct skv_tensor *ts[] = {&w->wq, &w->wk, &w->wv, &w->wo, &w->w_gate, &w->w_up, &w->w_down};
        for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) {
            int r = be->ops->matmul_rows_as_one(be, ts[k]);
            *lo = r < *lo ? r : *lo;
            *hi = r > *hi ? r : *hi;
        }
    }
    return true;
}

/* How many sessions one decode forward takes: as many as every weight's matmul computes row by
 * row exactly as for one row (the backend's matmul_rows_as_one), so a batch gives each session
 * what decoding it alone gives. */
static int decode_group_size(struct skv_engine *e)
{
    if (e->decode_group)
        return e->decode_group;
    int g = SKV_ENGINE_MAX_BATCH, hi;
    if (rows_as_one(e, &g, &hi))
        g = g < 1 ? 1 : g > SKV_ENGINE_MAX_BATCH ? SKV_ENGINE_MAX_BATCH : g;
    return e->decode_group = g;
}

int skv_engine_small_forward(struct skv_engine *e)
{
    int lo, hi;
    if (e->small_forward < 0) /* once: it asks the backend about every weight */
        e->small_forward = rows_as_one(e, &lo, &hi) ? hi : 0;
    return e->small_forward;
}

int skv_engine_decode_batch(struct skv_engine *e, const struct skv_batch_seq *seqs, int n)
{
    if (!seqs || n < 1 || n > SKV_ENGINE_MAX_BATCH)
        return skv_errorf(SKV_E_INVAL, "a batched decode takes 1 to %d sequences, not %d", SKV_ENGINE_MAX_BATCH, n);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++)
            if (seqs[i].cache && seqs[j].cache == seqs[i].cache)
                return skv_errorf(SKV_E_INVAL, "sequences %d and %d of the batch share a cache", j, i);
    int g = decode_group_size(e), rc = SKV_OK;
    for (int i0 = 0; i0 < n; i0 += g) { /* a group that fails leaves the others theirs */
        int grc = decode_group_forward(e, seqs + i0, n - i0 < g ? n - i0 : g);
        rc = rc ? rc : grc;
    }
    return rc;
}
