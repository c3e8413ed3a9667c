/* The forward pass: prefill, append and decode of Llama-family models over backend ops,
 * into a per-sequence KV cache that stores each (layer, KV head) separately, in pool blocks
 * behind a block table, so compression can keep a different number of entries per layer and
 * per head and forks share blocks copy-on-write. Knows no socket. */
#ifndef SKV_ENGINE_H
#define SKV_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/engine/model.h"
#include "daemon/engine/kv_pool.h"

/* One (layer, KV head) run of cached entries, rows in original-position order. The K/V rows
 * live in pool blocks of block_rows rows: row j is row j % block_rows of blk[j / block_rows].
 * Blocks may be shared with forks of the cache: every write goes through the engine, which
 * copies a shared block first (copy-on-write). Never write mem[] directly. */
struct skv_kv_head {
    struct skv_kv_block **blk; /* [n_blocks] the block table */
    void **mem;                  /* [n_blocks] blk[b]->mem: the table an attention view reads */
    int n_blocks, blk_cap;       /* blocks held; table entries allocated */
    int32_t *pos;      /* [cap] original position of each kept row (host memory) */
    float *score;      /* [cap] the compression policy's importance of each row (host) */
    int len;           /* rows in use */
    int cap;           /* rows pos / score hold */
};

/* One sequence's cache. heads[layer * n_kv_heads + h]. */
struct skv_kv_cache {
    int n_layers, n_kv_heads, head_dim;
    struct skv_kv_head *heads;
    int32_t n_past;    /* position of the next token: the original length, not the kept one */
    struct skv_backend *be;
    struct skv_kv_pool *pool;   /* where its blocks come from (one reference held) */
    int block_rows;
    int kv_type;                /* its pool's: SKV_DTYPE_F32, SKV_DTYPE_F16 or SKV_DTYPE_Q8_0 */
    size_t row_bytes;           /* one K or V row of head_dim in kv_type */
    bool unordered;             /* a head's rows may be out of position order (skv_kv_cache_drop_rows) */
};

/* An empty cache whose blocks come from the model's pool (m->kv_pool). */
int skv_kv_cache_new(const struct skv_model *m, struct skv_kv_cache **out);
/* The same from another pool of the model's head_dim and backend (tests, other block sizes). */
int skv_kv_cache_new_in(const struct skv_model *m, struct skv_kv_pool *pool, struct skv_kv_cache **out);
/* Releases its blocks (a shared one stays with its other holders). Accepts NULL. */
void skv_kv_cache_free(struct skv_kv_cache **cache_p);
/* Makes every head's host arrays and block table able to take `extra` more rows (blocks
 * themselves are taken from the pool when rows are written). */
int skv_kv_cache_reserve(struct skv_kv_cache *cache, int extra);
/* As reserve, and also takes (or copies, when shared with a fork) the blocks the next `extra`
 * rows of every head will be written to, so a forward of that many tokens allocates nothing:
 * a batched decode prepares each session first, and one that is out of memory fails alone
 * instead of failing the batch halfway. Lengths do not change. */
int skv_kv_cache_prepare(struct skv_kv_cache *cache, int extra);
/* FORK: a copy that shares every block of src (reference counts), with its own positions
 * and scores; either side copies a block before writing it. */
int skv_kv_cache_clone(const struct skv_kv_cache *src, struct skv_kv_cache **out);
/* The same with each head's first `rows` rows at most, and n_past at most `rows` (prefix reuse:
 * the rows of a full cache's first `rows` positions, on a whole number of blocks). */
int skv_kv_cache_clone_rows(const struct skv_kv_cache *src, int rows, struct skv_kv_cache **out);
static inline struct skv_kv_head *skv_kv_cache_head(struct skv_kv_cache *c, int layer, int h)
{
    return &c->heads[layer * c->n_kv_heads + h];
}
/* Gives back each head's blocks of `layer` past its rows and its host capacity beyond its
 * rows plus `slack` (after compression: the memory really goes back). */
int skv_kv_cache_fit(struct skv_kv_cache *cache, int layer, int slack);
/* Makes dst's `layer` hold src's rows (same model and pool): shares src's blocks. */
int skv_kv_cache_copy_layer(struct skv_kv_cache *dst, const struct skv_kv_cache *src, int layer);
/* Keeps rows idx[0..cnt) (strictly increasing, < len) of head h of `layer` as its rows
 * 0..cnt, with their positions and scores. Leading blocks that keep all their rows in place
 * are kept (and stay shared); the others are gathered into fresh blocks and the old ones
 * released, so a fork's compaction never touches the rows of the cache it shares with. */
int skv_kv_cache_compact(struct skv_kv_cache *cache, int layer, int h, const int32_t *idx, int cnt);
/* Drops rows drop[0..n) (strictly increasing, < len) of head h of `layer` by moving the head's
 * last rows into their places (K, V, position and score): 2 row copies a row dropped, where a
 * compaction gathers every block after the first one dropped. A block written is unshared
 * first (a fork's rows stay as they are). The rows are then out of position order: the cache is
 * marked unordered until skv_kv_cache_order. Attention does not depend on the rows' order;
 * a sliding-window layer's does (skv_kv_view_first), so the caller never drops this way there.
 * Blocks past the new length stay held (skv_kv_cache_fit gives them back). */
int skv_kv_cache_drop_rows(struct skv_kv_cache *cache, int layer, int h, const int32_t *drop, int n);
/* Puts every head's rows back in position order (a gather into fresh blocks, as a compaction)
 * when the cache is unordered; what reads the rows as a sequence (SAVE, a spill, EXPORT,
 * INSPECT's positions, COMPRESS) calls it first. */
int skv_kv_cache_order(struct skv_kv_cache *cache);
/* Blocks skv_kv_cache_order may take from the pool past those it gives back: *shared, every
 * shared block of a head out of order (a fork's: the other holder keeps it), which stay taken,
 * and while it runs *most, the largest such head's unshared blocks (each head's old blocks go
 * once its new ones are written). Returns their sum. */
int skv_kv_cache_order_blocks(const struct skv_kv_cache *cache, int *shared, int *most);
/* Whether head kh's rows are in position order; idx[0..len): its rows' indices in position
 * order (what reads the rows as a sequence without changing the cache: a spill's write). */
bool skv_kv_head_in_order(const struct skv_kv_head *kh);
void skv_kv_head_argsort(const struct skv_kv_head *kh, int32_t *idx);
/* Shares the cache's full blocks (every row in use) with equal blocks d indexes under group,
 * and indexes the others (kv_pool.h); *n_shared: how many became shared. */
int skv_kv_cache_dedupe(struct skv_kv_cache *cache, struct skv_kv_dedupe *d, uint64_t group, uint64_t *n_shared);
/* Appends block b (a full block of this cache's pool that another holder wrote) to head h of
 * `layer` as its next block_rows rows, one more holder of b and no copy. The head's rows must
 * fill its blocks; positions and scores of the new rows are the caller's. */
int skv_kv_cache_append_block(struct skv_kv_cache *cache, int layer, int h, struct skv_kv_block *b);
/* Cuts head h of `layer` to its first len rows (len <= its rows), releasing blocks past. */
int skv_kv_cache_truncate(struct skv_kv_cache *cache, int layer, int h, int len);
/* Host copies of rows [row0, row0 + n) of head h of `layer`: K (which == 0) or V, [n][head_dim]. */
int skv_kv_cache_read_rows(const struct skv_kv_cache *cache, int layer, int h, int which, int row0, int n,
                           float *dst);
/* Writes rows [row0, row0 + n) of head h of `layer` (row0 <= its rows) from host memory,
 * taking blocks and copying shared ones as needed; the head's length becomes at least
 * row0 + n (positions and scores of new rows are the caller's). */
int skv_kv_cache_write_rows(struct skv_kv_cache *cache, int layer, int h, int which, int row0, int n,
                            const float *src);
/* The paged attention view of `layer` (k/v tables, positions, window 0); the caller sets
 * prefix_len and window. */
void skv_kv_cache_view(struct skv_kv_cache *cache, int layer, struct skv_kv_view *view);
/* Bytes of K and V in used rows (what compression keeps; not the blocks' rounding). */
uint64_t skv_kv_cache_bytes(const struct skv_kv_cache *cache);
/* Host bytes the cache holds beside its blocks: each head's positions, scores and block table. */
uint64_t skv_kv_cache_host_bytes(const struct skv_kv_cache *cache);
/* Blocks the cache holds and how many of them are shared with another holder. */
struct skv_kv_blocks {
    uint64_t held, shared;
};
void skv_kv_cache_blocks(const struct skv_kv_cache *cache, struct skv_kv_blocks *out);
/* The same for one head. */
void skv_kv_head_blocks(const struct skv_kv_cache *cache, const struct skv_kv_head *hd, struct skv_kv_blocks *out);
/* Eviction's bookkeeping (the worker thread's): skv_kv_cache_mark sets every block the cache
 * holds to `mark`; skv_kv_cache_mark_new sets those marked neither `keep` nor `mark` to `mark`
 * and returns how many it set; skv_kv_cache_holds_unmarked says whether any is not `keep`. */
void skv_kv_cache_mark(const struct skv_kv_cache *cache, uint64_t mark);
uint64_t skv_kv_cache_mark_new(const struct skv_kv_cache *cache, uint64_t keep, uint64_t mark);
bool skv_kv_cache_holds_unmarked(const struct skv_kv_cache *cache, uint64_t keep);
/* Sets every block the cache holds whose tally is not `tally` to it and returns how many it set
 * (a walk that counts blocks once over several caches: skv_kv_block.tally). */
uint64_t skv_kv_cache_tally(const struct skv_kv_cache *cache, uint64_t tally);
/* An upper bound on what a forward of n more tokens adds, in bytes: to the blocks the cache
 * holds (*more_held) and to the pool's unique blocks (*more_unique: also the shared blocks a
 * write copies, i.e. the one the next row goes to, or every shared one when the forward may
 * compact the cache). */
void skv_kv_cache_growth(const struct skv_kv_cache *cache, int n, bool compacts, uint64_t *more_held,
                         uint64_t *more_unique);
/* The same bound, compacts true, for n rows on a copy of the cache cut to each head's rows of
 * positions below `cut` that shares every block it keeps with the cache (a COMPRESS's re-run),
 * counted before the cut and whatever the rows' order. */
void skv_kv_cache_cut_growth(const struct skv_kv_cache *cache, int cut, int n, uint64_t *more_held,
                             uint64_t *more_unique);

struct skv_engine;

/* What a layer hook sees right after a layer's attention during a forward of n tokens:
 * the layer's new K/V are in the cache, q holds the batch's post-RoPE queries
 * [n][n_heads][head_dim], and x_in / x_mid are the residual stream before the layer and
 * after its attention block ([n][dim]; x_mid is only complete after the whole batch's
 * attention output was added, i.e. when the hook runs). */
struct skv_layer_view {
    int layer;
    int n;                 /* tokens in this forward */
    int window;            /* the layer's sliding window (0: full causal attention) */
    const float *q;
    const float *x_in;
    const float *x_mid;
    struct skv_kv_cache *cache;
    /* with skv_forward_opts.attention_probs and n = 1, where the backend has
     * attention_batch_probs: the probability the new query's head h gave row j of its KV head,
     * probs[h * probs_stride + j] for j < the head's len (backend memory); else NULL */
    const float *probs;
    int64_t probs_stride;
};
typedef int (*skv_layer_hook_fn)(void *user, const struct skv_layer_view *view);

struct skv_forward_opts {
    bool logits_all;               /* logits of every position, else of the last one */
    skv_layer_hook_fn hook;        /* may be NULL */
    void *hook_user;
    /* called between two chunks of tokens of a layer's projections and MLP (may be NULL): a
     * point where the caller may do other work on another engine; nothing of this forward's
     * state may be touched there */
    void (*tick)(void *user);
    void *tick_user;
    /* called once the whole forward succeeded (may be NULL), before it returns: a hook that
     * deferred its work to there (the compressor's decode upkeep) does it then; a forward that
     * fails does not call it, and its rows are taken back out of every layer */
    void (*done)(void *user, struct skv_kv_cache *cache);
    void *done_user;
    /* a forward of one token (a decode step, alone or in a group) gives each layer hook the
     * attention's probabilities (skv_layer_view.probs), where the backend computes them with the
     * attention: what H2O's upkeep scores the step by */
    bool attention_probs;
    /* A prompt's scores: with logits != NULL and n_targets in [1, n], for each position i <
     * n_targets the log-probability the model gives token targets[i] there (a prompt scores its
     * own tokens with targets = tokens + 1) into target_logprobs[i], and with target_top the most
     * likely token there; logits still gets the last position's, the same bits as without targets
     * (logits_all must be false). It runs the output matmul for every position scored, in chunks
     * (the tick between them), with the batched kernel where a chunk is larger than the
     * small-batch size, and the backend's row_logprobs (within its tolerance of skv_logprobs;
     * without the op, skv_logprobs and skv_argmax of the downloaded logits). With target_top_n
     * > 0 (at most the vocabulary), each position's target_top_n most likely tokens and their
     * log-probabilities too, most likely first (skv_logprobs' order), by the backend's
     * row_top_logprobs (without it, skv_logprobs of the downloaded logits), which gives
     * target_logprobs then too, and target_top the first of each list (skv_argmax's token but
     * in a row of no finite logit with a NaN first). */
    const int32_t *targets;      /* [n_targets] */
    float *target_logprobs;      /* [n_targets] out */
    int32_t *target_top;         /* [n_targets] out, or NULL: each position's most likely token (skv_argmax) */
    int n_targets;
    int target_top_n;            /* 0: none */
    int32_t *target_top_ids;     /* [n_targets][target_top_n] out */
    float *target_top_logprobs;  /* [n_targets][target_top_n] out */
};

int skv_engine_new(struct skv_model *m, struct skv_engine **out);
void skv_engine_free(struct skv_engine **e_p);
struct skv_model *skv_engine_model(const struct skv_engine *e);

/* Runs n tokens (positions cache->n_past ...) through the model, appending their K/V to the
 * cache, and writes logits ([n][n_vocab] with logits_all, else [n_vocab]) when logits != NULL.
 * tokens are checked against the vocabulary (SKV_E_INVAL). opts may be NULL. When it fails,
 * the cache holds none of the n rows and n_past is as before (rows a hook already evicted, and
 * scores it already added, stay so). */
int skv_engine_forward(struct skv_engine *e, struct skv_kv_cache *cache, const int32_t *tokens, int n,
                       const struct skv_forward_opts *opts, float *logits);

/* One sequence of a batched decode step. */
struct skv_batch_seq {
    struct skv_kv_cache *cache;
    int32_t token;                          /* the next token (position cache->n_past) */
    const struct skv_forward_opts *opts;    /* its hook, or NULL; logits_all is ignored */
    float *logits;                          /* [n_vocab] out, or NULL */
};
#define SKV_ENGINE_MAX_BATCH 64

/* One token for each of n sequences (distinct caches of this model) in one forward: the
 * projections and the MLP run over all n rows at once (weights read once), attention over
 * each sequence's own cache; each sequence's hook sees its own row (view.n = 1). Results
 * equal n separate skv_engine_forward calls. n in [1, SKV_ENGINE_MAX_BATCH]. The sequences
 * go in groups (the backend's matmul_rows_as_one); a group that fails leaves its caches as
 * skv_engine_forward leaves a failed one, and its sequences' logits as they were, and the other
 * groups go on, so after an error each cache either took its token (n_past + 1, its logits
 * those of the token) or did not (its logits untouched); the first error is returned. */
int skv_engine_decode_batch(struct skv_engine *e, const struct skv_batch_seq *seqs, int n);
/* The most tokens a forward of e runs through a matmul kernel that computes each row on its
 * own (the backend's matmul_rows_as_one, the largest over the model's weights; 0 when it has
 * none): a forward of more tokens takes the batched kernel for every weight, whose rows on the
 * CPU backend do not depend on how many there are. */
int skv_engine_small_forward(struct skv_engine *e);

/* Peak bytes of activation scratch the engine holds. */
uint64_t skv_engine_scratch_bytes(const struct skv_engine *e);
/* Gives the activation scratch back (the next forward allocates what it needs again). */
void skv_engine_release_scratch(struct skv_engine *e);

#endif
