/* The forward pass: prefill, append and decode of Llama-family models over backend ops,
 * into a per-sequence KV cache that stores each (layer, KV head) separately so compression
 * can keep a different number of entries per layer and per head. Knows no socket. */
#ifndef SKV_ENGINE_H
#define SKV_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/engine/model.h"

/* One (layer, KV head) run of cached entries, rows in original-position order. */
struct skv_kv_head {
    float *k;          /* [cap][head_dim], post-RoPE keys */
    float *v;          /* [cap][head_dim] */
    int32_t *pos;      /* [cap] original position of each kept row (host memory) */
    float *score;      /* [cap] the compression policy's importance of each row (host) */
    int len;           /* rows in use */
    int cap;           /* rows allocated */
};

/* One sequence's cache. heads[layer * n_kv_heads + h]. */
struct skv_kv_cache {
    int n_layers, n_kv_heads, head_dim;
    struct skv_kv_head *heads;
    int32_t n_past;    /* position of the next token: the original length, not the kept one */
    struct skv_backend *be;
};

int skv_kv_cache_new(const struct skv_model *m, struct skv_kv_cache **out);
void skv_kv_cache_free(struct skv_kv_cache **cache_p);
/* Makes every head able to take `extra` more rows. */
int skv_kv_cache_reserve(struct skv_kv_cache *cache, int extra);
/* Deep copy (for query-aware reuse: one prefilled document, many questions). */
int skv_kv_cache_clone(const struct skv_kv_cache *src, struct skv_kv_cache **out);
static inline struct skv_kv_head *skv_kv_cache_head(struct skv_kv_cache *c, int layer, int h)
{
    return &c->heads[layer * c->n_kv_heads + h];
}
/* Releases each head's capacity of `layer` beyond its rows plus `slack` (after compression:
 * the memory really goes back). */
int skv_kv_cache_fit(struct skv_kv_cache *cache, int layer, int slack);
/* Makes dst's `layer` an exact copy of src's (same model). */
int skv_kv_cache_copy_layer(struct skv_kv_cache *dst, const struct skv_kv_cache *src, int layer);
/* Bytes of K and V held (used rows, not capacity). */
uint64_t skv_kv_cache_bytes(const struct skv_kv_cache *cache);

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
};
typedef int (*skv_layer_hook_fn)(void *user, const struct skv_layer_view *view);

struct skv_forward_opts {
    bool logits_all;               /* logits of every position, else of the last one */
    skv_layer_hook_fn hook;        /* may be NULL */
    void *hook_user;
};

int skv_engine_new(struct skv_model *m, struct skv_engine **out);
void skv_engine_free(struct skv_engine **e_p);
struct skv_model *skv_engine_model(const struct skv_engine *e);

/* Runs n tokens (positions cache->n_past ...) through the model, appending their K/V to the
 * cache, and writes logits ([n][n_vocab] with logits_all, else [n_vocab]) when logits != NULL.
 * tokens are checked against the vocabulary (SKV_E_INVAL). opts may be NULL. */
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
 * equal n separate skv_engine_forward calls. n in [1, SKV_ENGINE_MAX_BATCH]. */
int skv_engine_decode_batch(struct skv_engine *e, const struct skv_batch_seq *seqs, int n);

/* Peak bytes of activation scratch the engine holds. */
uint64_t skv_engine_scratch_bytes(const struct skv_engine *e);

#endif
