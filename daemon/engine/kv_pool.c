/* The KV block pool (see kv_pool.h): slabs of SLAB_BLOCKS blocks from the backend, a doubly
 * linked free list of blocks so a slab whose blocks are all free can leave it and go back,
 * reference counts and counts of blocks in use and shared, under one mutex. */
#include "daemon/engine/kv_pool.h"
#include "common/status.h"

#include <pthread.h>
#include <sodium.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define SLAB_BLOCKS 64 /* blocks per backend allocation (512 KiB at 16 rows x 64 dims) */

struct skv_kv_slab {
    void *mem;                              /* SLAB_BLOCKS blocks of block_bytes */
    int n_free;
    struct skv_kv_slab *prev, *next;      /* all slabs */
    struct skv_kv_block blocks[SLAB_BLOCKS];
};

struct skv_kv_pool {
    pthread_mutex_t lock;
    struct skv_backend *be;
    int head_dim, block_rows, kv_type;
    size_t block_bytes;
    int refs;                               /* the pool's own references (caches, owner) */
    struct skv_kv_slab *slabs;
    struct skv_kv_block *free_head;
    int empty_slabs;                        /* slabs with every block free (at most 1 kept) */
    uint64_t keep_slabs;                    /* reserved: never fewer slabs than this */
    uint64_t n_slabs, in_use, shared, n_free;
    uint64_t stamps;                        /* the last stamp given to a block */
    int pins;                               /* weak references may exist: no slab leaves */
};

int skv_kv_pool_new(struct skv_backend *be, int head_dim, int block_rows, int kv_type, struct skv_kv_pool **out)
{
    if (!be || !out || head_dim <= 0 || block_rows <= 0 || block_rows > (1 << 16))
        return skv_errorf(SKV_E_INVAL, "KV pool: head_dim %d, %d rows per block", head_dim, block_rows);
    if (kv_type != SKV_DTYPE_F32 && kv_type != SKV_DTYPE_F16 && kv_type != SKV_DTYPE_Q8_0)
        return skv_errorf(SKV_E_INVAL, "KV pool: KV type %d (f32, f16 or q8_0)", kv_type);
    if (skv_kv_row_bytes(kv_type, head_dim) == 0)
        return skv_errorf(SKV_E_UNSUPPORTED, "KV pool: q8_0 rows need a head_dim that is a multiple of 32, not %d",
                          head_dim);
    if (!skv_backend_kv_type_ok(be, kv_type))
        return skv_errorf(SKV_E_UNSUPPORTED, "KV pool: the %s backend does not keep %s KV", be->name,
                          skv_dtype_name(kv_type));
    struct skv_kv_pool *p = calloc(1, sizeof *p);
    if (!p)
        return SKV_E_NOMEM;
    if (pthread_mutex_init(&p->lock, NULL)) {
        free(p);
        return SKV_E_NOMEM;
    }
    p->be = be;
    p->head_dim = head_dim;
    p->block_rows = block_rows;
    p->kv_type = kv_type;
    p->block_bytes = (size_t)2 * block_rows * skv_kv_row_bytes(kv_type, head_dim);
    p->refs = 1;
    *out = p;
    return SKV_OK;
}

struct skv_kv_pool *skv_kv_pool_ref(struct skv_kv_pool *pool)
{
    pthread_mutex_lock(&pool->lock);
    pool->refs++;
    pthread_mutex_unlock(&pool->lock);
    return pool;
}

static void free_list_remove(struct skv_kv_pool *p, struct skv_kv_block *b)
{
    if (b->prev)
        b->prev->next = b->next;
    else
        p->free_head = b->next;
    if (b->next)
        b->next->prev = b->prev;
    b->prev = b->next = NULL;
    p->n_free--;
}

static void free_list_push(struct skv_kv_pool *p, struct skv_kv_block *b)
{
    b->prev = NULL;
    b->next = p->free_head;
    if (p->free_head)
        p->free_head->prev = b;
    p->free_head = b;
    p->n_free++;
}

/* Unlinks a slab whose blocks are all free and gives its memory back. */
static void slab_release(struct skv_kv_pool *p, struct skv_kv_slab *s)
{
    for (int i = 0; i < SLAB_BLOCKS; i++)
        free_list_remove(p, &s->blocks[i]);
    if (s->prev)
        s->prev->next = s->next;
    else
        p->slabs = s->next;
    if (s->next)
        s->next->prev = s->prev;
    p->be->ops->free(p->be, s->mem);
    free(s);
    p->n_slabs--;
}

void skv_kv_pool_unref(struct skv_kv_pool **pool_p)
{
    if (!pool_p || !*pool_p)
        return;
    struct skv_kv_pool *p = *pool_p;
    *pool_p = NULL;
    pthread_mutex_lock(&p->lock);
    bool last = --p->refs == 0;
    pthread_mutex_unlock(&p->lock);
    if (!last)
        return;
    /* blocks still in use here would be a holder's bug; their slabs go anyway */
    while (p->slabs) {
        struct skv_kv_slab *s = p->slabs;
        p->slabs = s->next;
        p->be->ops->free(p->be, s->mem);
        free(s);
    }
    pthread_mutex_destroy(&p->lock);
    free(p);
}

int skv_kv_pool_block_rows(const struct skv_kv_pool *pool)
{
    return pool->block_rows;
}

int skv_kv_pool_head_dim(const struct skv_kv_pool *pool)
{
    return pool->head_dim;
}

int skv_kv_pool_kv_type(const struct skv_kv_pool *pool)
{
    return pool->kv_type;
}

size_t skv_kv_pool_row_bytes(const struct skv_kv_pool *pool)
{
    return skv_kv_row_bytes(pool->kv_type, pool->head_dim);
}

size_t skv_kv_pool_block_bytes(const struct skv_kv_pool *pool)
{
    return pool->block_bytes;
}

/* A new slab's blocks onto the free list (lock held). */
static int slab_add(struct skv_kv_pool *p)
{
    struct skv_kv_slab *s = calloc(1, sizeof *s);
    if (!s)
        return SKV_E_NOMEM;
    int rc = p->be->ops->alloc(p->be, p->block_bytes * SLAB_BLOCKS, &s->mem);
    if (rc) {
        free(s);
        return rc;
    }
    for (int i = SLAB_BLOCKS - 1; i >= 0; i--) {
        struct skv_kv_block *b = &s->blocks[i];
        b->mem = (char *)s->mem + (size_t)i * p->block_bytes;
        b->slab = s;
        free_list_push(p, b);
    }
    s->n_free = SLAB_BLOCKS;
    s->next = p->slabs;
    if (p->slabs)
        p->slabs->prev = s;
    p->slabs = s;
    p->n_slabs++;
    p->empty_slabs++;
    return SKV_OK;
}

int skv_kv_pool_get(struct skv_kv_pool *pool, struct skv_kv_block **out)
{
    pthread_mutex_lock(&pool->lock);
    int rc = pool->free_head ? SKV_OK : slab_add(pool);
    if (!rc) {
        struct skv_kv_block *b = pool->free_head;
        free_list_remove(pool, b);
        if (b->slab->n_free-- == SLAB_BLOCKS)
            pool->empty_slabs--;
        b->refs = 1;
        b->kept = 0;
        b->tally = 0; /* no walk's (theirs start at 1) */
        b->stamp = ++pool->stamps;
        pool->in_use++;
        *out = b;
    }
    pthread_mutex_unlock(&pool->lock);
    return rc;
}

void skv_kv_pool_hold(struct skv_kv_pool *pool, struct skv_kv_block *b)
{
    pthread_mutex_lock(&pool->lock);
    if (b->refs++ == 1)
        pool->shared++;
    pthread_mutex_unlock(&pool->lock);
}

void skv_kv_pool_put(struct skv_kv_pool *pool, struct skv_kv_block *b)
{
    if (!b)
        return;
    pthread_mutex_lock(&pool->lock);
    if (--b->refs == 1)
        pool->shared--;
    if (b->refs == 0) {
        struct skv_kv_slab *s = b->slab;
        pool->in_use--;
        free_list_push(pool, b);
        if (++s->n_free == SLAB_BLOCKS) {
            if (pool->empty_slabs >= 1 && pool->n_slabs > pool->keep_slabs && !pool->pins)
                slab_release(pool, s);
            else
                pool->empty_slabs++;
        }
    }
    pthread_mutex_unlock(&pool->lock);
}

void skv_kv_pool_pin_slabs(struct skv_kv_pool *pool)
{
    pthread_mutex_lock(&pool->lock);
    pool->pins++;
    pthread_mutex_unlock(&pool->lock);
}

void skv_kv_pool_unpin_slabs(struct skv_kv_pool *pool)
{
    pthread_mutex_lock(&pool->lock);
    if (--pool->pins == 0) /* what put() kept while pinned: one empty slab stays */
        for (struct skv_kv_slab *s = pool->slabs, *next; s; s = next) {
            next = s->next;
            if (s->n_free == SLAB_BLOCKS && pool->empty_slabs > 1 && pool->n_slabs > pool->keep_slabs) {
                slab_release(pool, s);
                pool->empty_slabs--;
            }
        }
    pthread_mutex_unlock(&pool->lock);
}

bool skv_kv_pool_hold_if(struct skv_kv_pool *pool, struct skv_kv_block *b, uint64_t stamp)
{
    pthread_mutex_lock(&pool->lock);
    bool live = b->refs > 0 && b->stamp == stamp;
    if (live && b->refs++ == 1)
        pool->shared++;
    pthread_mutex_unlock(&pool->lock);
    return live;
}

bool skv_kv_pool_is_shared(struct skv_kv_pool *pool, const struct skv_kv_block *b)
{
    pthread_mutex_lock(&pool->lock);
    bool shared = b->refs > 1;
    pthread_mutex_unlock(&pool->lock);
    return shared;
}

uint64_t skv_kv_pool_count_kept_only(struct skv_kv_pool *pool, struct skv_kv_block *const *blocks, int n,
                                     uint64_t mark)
{
    uint64_t only = 0;
    pthread_mutex_lock(&pool->lock);
    for (int i = 0; i < n; i++)
        if (blocks[i]->mark != mark) {
            blocks[i]->mark = mark;
            only += blocks[i]->refs == blocks[i]->kept;
        }
    pthread_mutex_unlock(&pool->lock);
    return only;
}

uint64_t skv_kv_pool_count_shared(struct skv_kv_pool *pool, struct skv_kv_block *const *blocks, int n)
{
    uint64_t shared = 0;
    pthread_mutex_lock(&pool->lock);
    for (int i = 0; i < n; i++)
        shared += blocks[i]->refs > 1;
    pthread_mutex_unlock(&pool->lock);
    return shared;
}

int skv_kv_pool_unshare(struct skv_kv_pool *pool, struct skv_kv_block **b_p)
{
    struct skv_kv_block *old = *b_p, *copy = NULL;
    pthread_mutex_lock(&pool->lock);
    bool shared = old->refs > 1;
    if (!shared) /* written in place: its bytes are no longer the ones its stamp saw */
        old->stamp = ++pool->stamps;
    pthread_mutex_unlock(&pool->lock);
    if (!shared)
        return SKV_OK;
    int rc = skv_kv_pool_get(pool, &copy); /* a new stamp */
    if (rc)
        return rc;
    rc = pool->be->ops->copy_2d(pool->be, copy->mem, pool->block_bytes, old->mem, pool->block_bytes,
                                pool->block_bytes, 1);
    if (rc) {
        skv_kv_pool_put(pool, copy);
        return rc;
    }
    skv_kv_pool_put(pool, old);
    *b_p = copy;
    return SKV_OK;
}

void skv_kv_pool_stats(struct skv_kv_pool *pool, struct skv_kv_pool_stats *out)
{
    pthread_mutex_lock(&pool->lock);
    out->block_rows = pool->block_rows;
    out->block_bytes = pool->block_bytes;
    out->blocks_in_use = pool->in_use;
    out->blocks_shared = pool->shared;
    out->blocks_free = pool->n_free;
    out->bytes_reserved = pool->n_slabs * SLAB_BLOCKS * pool->block_bytes;
    pthread_mutex_unlock(&pool->lock);
}

int skv_kv_pool_reserve(struct skv_kv_pool *pool, uint64_t bytes)
{
    const uint64_t slab_bytes = (uint64_t)pool->block_bytes * SLAB_BLOCKS;
    const uint64_t want = (bytes + slab_bytes - 1) / slab_bytes;
    int rc = SKV_OK;
    pthread_mutex_lock(&pool->lock);
    while (!rc && pool->n_slabs < want)
        rc = slab_add(pool);
    pool->keep_slabs = pool->n_slabs;
    pthread_mutex_unlock(&pool->lock);
    if (rc)
        return skv_errorf(rc, "KV pool: %llu of %llu bytes reserved, the backend has no more",
                          (unsigned long long)(pool->n_slabs * slab_bytes), (unsigned long long)bytes);
    return SKV_OK;
}

/* ---- sharing equal blocks (skv_kv_dedupe) ------------------------------------------------- */

uint64_t skv_kv_hash64(const void *p, size_t n)
{
    static const unsigned char key[crypto_shorthash_KEYBYTES]; /* no secret: equal bytes are checked after */
    unsigned char h[crypto_shorthash_BYTES];
    crypto_shorthash(h, p, n, key);
    uint64_t v = 0;
    for (int k = 0; k < 8; k++)
        v |= (uint64_t)h[k] << (8 * k);
    return v;
}

struct dedupe_entry {
    uint64_t key;                 /* the block's content hash, never 0; 0: an empty slot */
    uint64_t group;
    struct skv_kv_block *b;       /* not held: checked by its stamp before each use */
    uint64_t stamp;
};

struct skv_kv_dedupe {
    struct skv_kv_pool *pool;
    struct dedupe_entry *tab;     /* open addressing, cap a power of two, at most half full */
    size_t cap, n;
    unsigned char *mine, *theirs; /* host copies of the two blocks compared */
};

enum { DEDUPE_CAP0 = 1024 };

int skv_kv_dedupe_new(struct skv_kv_pool *pool, struct skv_kv_dedupe **out)
{
    struct skv_kv_dedupe *d = calloc(1, sizeof *d);
    if (!d || !(d->mine = malloc(pool->block_bytes)) || !(d->theirs = malloc(pool->block_bytes)) ||
        !(d->tab = calloc(DEDUPE_CAP0, sizeof *d->tab))) {
        if (d) {
            free(d->mine);
            free(d->theirs);
            free(d);
        }
        return SKV_E_NOMEM;
    }
    d->pool = pool;
    d->cap = DEDUPE_CAP0;
    skv_kv_pool_pin_slabs(pool);
    *out = d;
    return SKV_OK;
}

void skv_kv_dedupe_free(struct skv_kv_dedupe **d_p)
{
    struct skv_kv_dedupe *d = d_p ? *d_p : NULL;
    if (!d)
        return;
    skv_kv_pool_unpin_slabs(d->pool);
    free(d->tab);
    free(d->mine);
    free(d->theirs);
    free(d);
    *d_p = NULL;
}

static void dedupe_place(struct dedupe_entry *tab, size_t cap, struct dedupe_entry e)
{
    size_t i = (size_t)e.key & (cap - 1);
    while (tab[i].key)
        i = (i + 1) & (cap - 1);
    tab[i] = e;
}

static int dedupe_grow(struct skv_kv_dedupe *d)
{
    size_t cap = 2 * d->cap;
    struct dedupe_entry *tab = calloc(cap, sizeof *tab);
    if (!tab)
        return SKV_E_NOMEM;
    for (size_t i = 0; i < d->cap; i++)
        if (d->tab[i].key)
            dedupe_place(tab, cap, d->tab[i]);
    free(d->tab);
    d->tab = tab;
    d->cap = cap;
    return SKV_OK;
}

int skv_kv_dedupe_block(struct skv_kv_dedupe *d, uint64_t group, struct skv_kv_block **b_p, bool *shared)
{
    struct skv_kv_pool *p = d->pool;
    const struct skv_backend_ops *ops = p->be->ops;
    *shared = false;
    int rc = ops->download(p->be, d->mine, (*b_p)->mem, p->block_bytes);
    if (rc)
        return rc;
    uint64_t key = skv_kv_hash64(d->mine, p->block_bytes) | 1;
    for (size_t i = (size_t)key & (d->cap - 1); d->tab[i].key; i = (i + 1) & (d->cap - 1)) {
        struct dedupe_entry *e = &d->tab[i];
        if (e->key != key || e->group != group || e->b == *b_p || !skv_kv_pool_hold_if(p, e->b, e->stamp))
            continue;
        if ((rc = ops->download(p->be, d->theirs, e->b->mem, p->block_bytes)) ||
            memcmp(d->mine, d->theirs, p->block_bytes) != 0) {
            skv_kv_pool_put(p, e->b);
            if (rc)
                return rc;
            continue;
        }
        skv_kv_pool_put(p, *b_p);
        *b_p = e->b;
        *shared = true;
        return SKV_OK;
    }
    if (2 * (d->n + 1) > d->cap && (rc = dedupe_grow(d)))
        return rc;
    pthread_mutex_lock(&p->lock);
    uint64_t stamp = (*b_p)->stamp;
    pthread_mutex_unlock(&p->lock);
    dedupe_place(d->tab, d->cap, (struct dedupe_entry){key, group, *b_p, stamp});
    d->n++;
    return SKV_OK;
}
