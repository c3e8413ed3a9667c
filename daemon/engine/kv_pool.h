/* The KV block pool: fixed-size blocks of block_rows rows of one (layer, KV head), K then V
 * in one backend allocation, carved from slabs and reference-counted so that forked caches
 * share them copy-on-write. The engine's caches hold blocks in per-head block tables.
 * Thread-safe (one mutex): block tables of different caches may change on different threads. */
#ifndef SKV_KV_POOL_H
#define SKV_KV_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

#define SKV_KV_BLOCK_ROWS 16 /* rows per block unless a pool is made with another size */

struct skv_kv_pool;
struct skv_kv_slab;

struct skv_kv_block {
    void *mem;                          /* backend: K [block_rows][head_dim], V [block_rows][head_dim] of
                                           the pool's kv_type */
    int refs;                           /* block tables holding it; 0: free (pool lock) */
    uint64_t stamp;                     /* new whenever the block may be written (taken from the pool,
                                           unshared to be written): two looks at one stamp saw the same bytes */
    struct skv_kv_slab *slab;
    struct skv_kv_block *prev, *next; /* free list */
    uint64_t mark;                      /* scratch of the worker thread's walks: the session table's
                                           (which blocks an eviction would leave held: small numbers)
                                           and the kept prefixes' (the high bit set) */
    uint64_t tally;                     /* scratch of the session table's count of each tenant's
                                           blocks, each once (worker thread) */
    int kept;                           /* of refs, the kept prefixes' (daemon/prefix_cache.c; worker
                                           thread) */
};

struct skv_kv_pool_stats {
    int block_rows;
    size_t block_bytes;        /* 2 * block_rows * the row's bytes (f32: 4 * head_dim, f16: 2 *, q8_0: 34 / 32 *) */
    uint64_t blocks_in_use;    /* unique blocks some table holds */
    uint64_t blocks_shared;    /* of those, held by more than one table */
    uint64_t blocks_free;      /* carved and reusable without allocating */
    uint64_t bytes_reserved;   /* backend memory the pool's slabs hold */
};

/* A pool of blocks of block_rows (> 0) rows of head_dim values of kv_type (SKV_DTYPE_F32;
 * SKV_DTYPE_F16 on a backend with store_rows_f16: half the bytes; SKV_DTYPE_Q8_0 on one with
 * store_rows_q8_0, head_dim a multiple of 32: 17/64 of the bytes) on `be`, holding one
 * reference. */
int skv_kv_pool_new(struct skv_backend *be, int head_dim, int block_rows, int kv_type, struct skv_kv_pool **out);
/* Another reference (a cache made from this pool); returns pool. */
struct skv_kv_pool *skv_kv_pool_ref(struct skv_kv_pool *pool);
/* Drops a reference; the last one frees the pool, which must then hold no block in use.
 * Accepts NULL and *pool_p == NULL; sets *pool_p to NULL. */
void skv_kv_pool_unref(struct skv_kv_pool **pool_p);

int skv_kv_pool_block_rows(const struct skv_kv_pool *pool);
int skv_kv_pool_head_dim(const struct skv_kv_pool *pool);
int skv_kv_pool_kv_type(const struct skv_kv_pool *pool);
/* Bytes of one K or V row of head_dim values of the pool's KV type. */
size_t skv_kv_pool_row_bytes(const struct skv_kv_pool *pool);
size_t skv_kv_pool_block_bytes(const struct skv_kv_pool *pool);

/* A block of undefined contents with one reference (SKV_E_NOMEM / SKV_E_DEVICE when the
 * backend cannot give memory). */
int skv_kv_pool_get(struct skv_kv_pool *pool, struct skv_kv_block **out);
/* One more holder of b (a fork's table). */
void skv_kv_pool_hold(struct skv_kv_pool *pool, struct skv_kv_block *b);
/* Drops one holder; the last one returns the block to the pool (and a slab whose blocks
 * are all free to the backend, keeping one such slab for reuse). Accepts NULL. */
void skv_kv_pool_put(struct skv_kv_pool *pool, struct skv_kv_block *b);
/* Copy-on-write, before a write: when *b_p has other holders, replaces it (for this holder) by
 * a private copy of its contents; either way the block written has a new stamp. */
int skv_kv_pool_unshare(struct skv_kv_pool *pool, struct skv_kv_block **b_p);
/* Weak references: a block seen once, named by its pointer and the stamp it had then, held
 * again only if it is still in use with that stamp (so with the same bytes). Its memory stays
 * while the pool's slabs are pinned: pin before taking such a reference, unpin once none is
 * left (the last unpin gives back the slabs whose blocks are all free, as a put would have). */
void skv_kv_pool_pin_slabs(struct skv_kv_pool *pool);
void skv_kv_pool_unpin_slabs(struct skv_kv_pool *pool);
/* One more holder of b when it is in use with this stamp; false (nothing held) otherwise. */
bool skv_kv_pool_hold_if(struct skv_kv_pool *pool, struct skv_kv_block *b, uint64_t stamp);
/* True when b has more than one holder. */
bool skv_kv_pool_is_shared(struct skv_kv_pool *pool, const struct skv_kv_block *b);
/* Of the n blocks, how many not marked `mark` yet have no holder but kept prefixes (refs ==
 * kept); marks them (one lock for all). */
uint64_t skv_kv_pool_count_kept_only(struct skv_kv_pool *pool, struct skv_kv_block *const *blocks, int n,
                                     uint64_t mark);
/* How many of the n blocks have more than one holder (one lock for all). */
uint64_t skv_kv_pool_count_shared(struct skv_kv_pool *pool, struct skv_kv_block *const *blocks, int n);

void skv_kv_pool_stats(struct skv_kv_pool *pool, struct skv_kv_pool_stats *out);
/* Takes slabs from the backend until the pool holds at least `bytes` of blocks, and keeps
 * them for its lifetime (free slabs up to that size are never given back): a daemon that
 * reserves its pool-size at start allocates later only past it, by the blocks a compaction
 * holds for the moment it copies one head (its kept rows' blocks at most, while a decode
 * evicts or re-scores on a full pool; the daemon's room counts the cache's rows, not these).
 * SKV_E_NOMEM / SKV_E_DEVICE when the memory is not there (what was taken
 * stays reserved). */
int skv_kv_pool_reserve(struct skv_kv_pool *pool, uint64_t bytes);

/* An index of blocks by their contents, to share equal blocks of caches written separately
 * (sessions restored at start: forks that shared their document's blocks before the stop get
 * them back shared). It holds no reference: an indexed block whose holders all dropped it, or
 * that was written since, is no longer found (the pool's slabs stay pinned while it lives). */
struct skv_kv_dedupe;
int skv_kv_dedupe_new(struct skv_kv_pool *pool, struct skv_kv_dedupe **out);
/* *b_p, a block whose every row is written: when the index holds a block of the same group
 * with the same bytes, *b_p becomes that block (one more holder of it, one fewer of the old)
 * and *shared is set; otherwise *b_p is indexed under group. Blocks of different groups (a
 * tenant's caches, which must not learn what another tenant holds) are never shared. */
int skv_kv_dedupe_block(struct skv_kv_dedupe *d, uint64_t group, struct skv_kv_block **b_p, bool *shared);
/* Drops the index. Accepts NULL and *d_p == NULL. */
void skv_kv_dedupe_free(struct skv_kv_dedupe **d_p);
/* SipHash-2-4 (libsodium crypto_shorthash, a fixed key: equal bytes are checked after) of n bytes,
 * read as a little-endian uint64: the dedupe index's keys and groups. */
uint64_t skv_kv_hash64(const void *p, size_t n);

#endif
