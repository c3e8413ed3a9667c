/* The compressor: the engine's layer hook that scores a layer's cached rows with the
 * sequence policy and cuts each KV head (or the layer's heads together) to its budget, then
 * compacts K, V, positions and scores in place. H2O and StreamingLLM / window rules live
 * here beside the selection; SnapKV pooling, PyramidKV and SqueezeAttention have files. */
#include "daemon/compress/compress.h"
#include "common/status.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Memory-lean SqueezeAttention keeps at most 4 B rows per layer and head until every layer's
 * similarity is known; a layer allotted more gets the cap, and what it cannot hold goes to the
 * most important (least similar) layers still under their cap. */
#define SQUEEZE_CAP_FACTOR 4

struct skv_compressor {
    struct skv_compress_spec spec;
    const struct skv_model *m;
    struct skv_backend *be;
    int n_layers, n_heads, n_kv, head_dim;
    int budget;             /* B: per layer and KV head */
    int total_len;          /* sequence length after the forward */
    int batch;              /* tokens in the forward */
    bool decode;            /* decode upkeep instead of a compressing forward */
    int *layer_budget;      /* [L] */
    float *sim;             /* [L] squeeze cosines */
    float *colsum;          /* [n_heads][colsum_stride] (backend memory, capacity colsum_cap per head) */
    float *colsum_host;     /* the same, read back for the host-side policy code */
    int64_t colsum_cap;
    int64_t colsum_stride;  /* rows per head in the last window_colsum: the layer's longest head */
    float *agg;             /* [colsum_cap] host scratch */
    struct row *rows;       /* selection scratch */
    int rows_cap;
    int32_t *idx;           /* kept indices of one head */
    int idx_cap;
};

struct row {
    float key;      /* policy score (higher keeps) */
    int32_t prio;   /* order among must-keep rows (higher keeps) */
    int32_t idx;    /* row in the head */
    int16_t head;
    int8_t must;    /* window / sinks: kept before any scored row */
};

static int grow(void **p, int *cap, int need, size_t elem)
{
    if (need <= *cap)
        return SKV_OK;
    int c = *cap ? *cap : 1024;
    while (c < need)
        c *= 2;
    void *np = realloc(*p, (size_t)c * elem);
    if (!np)
        return SKV_E_NOMEM;
    *p = np;
    *cap = c;
    return SKV_OK;
}

int skv_compressor_new(const struct skv_compress_spec *spec, const struct skv_model *m, struct skv_compressor **out)
{
    if (spec->policy == SKV_POLICY_SNAPKV && spec->decode_budget > 0)
        return skv_errorf(SKV_E_UNSUPPORTED, "compression spec: decode_budget with policy=snapkv (re-scoring "
                                             "while decoding) is not implemented yet");
    if (spec->window > 0 && spec->policy == SKV_POLICY_SNAPKV && spec->kernel > 255)
        return skv_errorf(SKV_E_INVAL, "compression spec: kernel too large");
    struct skv_compressor *c = calloc(1, sizeof *c);
    if (!c)
        return SKV_E_NOMEM;
    c->spec = *spec;
    c->m = m;
    c->be = m->be;
    c->n_layers = m->cfg.n_layers;
    c->n_heads = m->cfg.n_heads;
    c->n_kv = m->cfg.n_kv_heads;
    c->head_dim = m->cfg.head_dim;
    c->layer_budget = calloc((size_t)c->n_layers, sizeof *c->layer_budget);
    c->sim = calloc((size_t)c->n_layers, sizeof *c->sim);
    if (!c->layer_budget || !c->sim) {
        skv_compressor_free(&c);
        return SKV_E_NOMEM;
    }
    *out = c;
    return SKV_OK;
}

void skv_compressor_free(struct skv_compressor **c_p)
{
    if (!c_p || !*c_p)
        return;
    struct skv_compressor *c = *c_p;
    if (c->colsum)
        c->be->ops->free(c->be, c->colsum);
    free(c->colsum_host);
    free(c->agg);
    free(c->rows);
    free(c->idx);
    free(c->layer_budget);
    free(c->sim);
    free(c);
    *c_p = NULL;
}

int skv_compressor_clone(const struct skv_compressor *src, struct skv_compressor **out)
{
    struct skv_compressor *c = NULL;
    int rc = skv_compressor_new(&src->spec, src->m, &c);
    if (rc)
        return rc;
    c->budget = src->budget;
    c->total_len = src->total_len;
    c->batch = src->batch;
    memcpy(c->layer_budget, src->layer_budget, (size_t)c->n_layers * sizeof *c->layer_budget);
    memcpy(c->sim, src->sim, (size_t)c->n_layers * sizeof *c->sim);
    *out = c;
    return SKV_OK;
}

const struct skv_compress_spec *skv_compressor_spec(const struct skv_compressor *c)
{
    return &c->spec;
}

const int *skv_compressor_layer_budgets(const struct skv_compressor *c)
{
    return c->layer_budget;
}

const float *skv_compressor_similarity(const struct skv_compressor *c)
{
    return c->spec.alloc == SKV_ALLOC_SQUEEZE ? c->sim : NULL;
}

int skv_compressor_budget(const struct skv_compressor *c)
{
    return c->budget;
}

int skv_compressor_begin(struct skv_compressor *c, struct skv_kv_cache *cache, int n)
{
    if (n <= 0)
        return skv_errorf(SKV_E_INVAL, "compress: empty forward");
    c->decode = false;
    c->batch = n;
    c->total_len = cache->n_past + n;
    c->budget = skv_compress_spec_budget(&c->spec, c->total_len);
    int L = c->n_layers;
    switch (c->spec.alloc) {
    case SKV_ALLOC_UNIFORM:
        for (int l = 0; l < L; l++)
            c->layer_budget[l] = c->budget;
        break;
    case SKV_ALLOC_PYRAMID:
        skv_pyramid_budgets(L, c->budget, c->spec.window, c->spec.pyramid_beta, c->total_len, c->layer_budget);
        break;
    case SKV_ALLOC_SQUEEZE: {
        /* final budgets are known after the last layer; meanwhile keep a capped upper bound */
        long cap = (long)c->budget * SQUEEZE_CAP_FACTOR;
        for (int l = 0; l < L; l++)
            c->layer_budget[l] = (int)(cap < c->total_len ? cap : c->total_len);
        break;
    }
    }
    return SKV_OK;
}

int skv_compressor_begin_decode(struct skv_compressor *c, struct skv_kv_cache *cache)
{
    c->decode = true;
    c->batch = 1;
    c->total_len = cache->n_past + 1;
    /* h2o / streaming / window keep each layer at its prefill budget (or decode_budget);
     * snapkv never evicts while decoding (rejected at creation when asked to) */
    for (int l = 0; l < c->n_layers; l++)
        if (c->spec.policy == SKV_POLICY_SNAPKV)
            c->layer_budget[l] = 0;
        else if (c->spec.decode_budget > 0)
            c->layer_budget[l] = c->spec.decode_budget;
    return SKV_OK;
}

/* Column sums of the attention the queries q_first.. of the batch give every row of the
 * layer: c->colsum [n_heads][max_rows], read back into c->colsum_host (only the rows in use,
 * so a decode step copies what the layer holds, not the buffer's capacity). */
static int window_colsum(struct skv_compressor *c, const struct skv_layer_view *v, int q_first, int64_t max_rows)
{
    if (max_rows > c->colsum_cap) {
        int64_t cap = c->colsum_cap ? c->colsum_cap : 1024;
        while (cap < max_rows)
            cap *= 2;
        if (c->colsum)
            c->be->ops->free(c->be, c->colsum);
        c->colsum = NULL;
        c->colsum_cap = 0;
        float *agg = realloc(c->agg, (size_t)cap * sizeof *agg);
        if (!agg)
            return SKV_E_NOMEM;
        c->agg = agg;
        float *host = realloc(c->colsum_host, (size_t)cap * c->n_heads * sizeof *host);
        if (!host)
            return SKV_E_NOMEM;
        c->colsum_host = host;
        int rc = c->be->ops->alloc(c->be, (size_t)cap * c->n_heads * sizeof(float), (void **)&c->colsum);
        if (rc)
            return rc;
        c->colsum_cap = cap;
    }
    struct skv_kv_view kv = {.window = v->window};
    skv_kv_cache_view(v->cache, v->layer, &kv);
    for (int h = 0; h < c->n_kv; h++)
        kv.prefix_len[h] = skv_kv_cache_head(v->cache, v->layer, h)->len - v->n;
    c->colsum_stride = max_rows;
    int rc = c->be->ops->attention_colsum(c->be, c->colsum, max_rows, v->q, v->n, c->n_heads, &kv, q_first);
    if (!rc)
        rc = c->be->ops->download(c->be, c->colsum_host, c->colsum, (size_t)max_rows * c->n_heads * sizeof(float));
    return rc;
}

static int by_keep_order(const void *a, const void *b)
{
    const struct row *x = a, *y = b;
    if (x->must != y->must)
        return x->must ? -1 : 1;
    if (x->must) {
        if (x->prio != y->prio)
            return x->prio > y->prio ? -1 : 1;
    } else if (x->key != y->key) {
        return x->key > y->key ? -1 : 1;
    }
    if (x->head != y->head)
        return x->head < y->head ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

static int by_head_idx(const void *a, const void *b)
{
    const struct row *x = a, *y = b;
    if (x->head != y->head)
        return x->head < y->head ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

/* Writes the rows of head h of the layer into out[]: policy keys, must flags. w_obs: the
 * observation / recent window in rows. */
static void classify(const struct skv_compressor *c, const struct skv_kv_head *kh, int h, int w_obs, struct row *out)
{
    int n = kh->len;
    for (int j = 0; j < n; j++) {
        struct row *r = &out[j];
        r->idx = j;
        r->head = (int16_t)h;
        r->key = kh->score[j];
        r->must = 0;
        r->prio = 0;
        switch (c->spec.policy) {
        case SKV_POLICY_SNAPKV:
        case SKV_POLICY_H2O:
            if (j >= n - w_obs) { /* the observation (snapkv) or recent (h2o) window */
                r->must = 1;
                r->prio = j;
            }
            break;
        case SKV_POLICY_STREAMING:
            if (kh->pos[j] < c->spec.sinks) {
                r->must = 1;
                r->prio = -kh->pos[j]; /* earliest sinks first when the budget is tiny */
            }
            r->key = (float)kh->pos[j];
            break;
        case SKV_POLICY_WINDOW:
            r->key = (float)kh->pos[j];
            break;
        case SKV_POLICY_FULL:
            break;
        }
    }
}

/* Keeps the chosen rows (sorted by head, then index) and compacts each head in place. */
static int compact(struct skv_compressor *c, struct skv_kv_cache *cache, int layer, struct row *keep, int n_keep)
{
    qsort(keep, (size_t)n_keep, sizeof *keep, by_head_idx);
    int at = 0;
    for (int h = 0; h < c->n_kv; h++) {
        struct skv_kv_head *kh = skv_kv_cache_head(cache, layer, h);
        int cnt = 0;
        int rc = grow((void **)&c->idx, &c->idx_cap, kh->len + 1, sizeof *c->idx);
        if (rc)
            return rc;
        while (at < n_keep && keep[at].head == h)
            c->idx[cnt++] = keep[at++].idx;
        if ((rc = skv_kv_cache_compact(cache, layer, h, c->idx, cnt)))
            return rc;
    }
    /* give the dropped rows' memory back (a little room for decoded tokens) */
    return skv_kv_cache_fit(cache, layer, 16);
}

/* Cuts layer `layer` to `budget` rows per head (layer granularity) or budget * Hkv rows over
 * its heads (head granularity), by the rows' classification. */
static int select_layer(struct skv_compressor *c, struct skv_kv_cache *cache, int layer, int budget, int w_obs)
{
    int total = 0, over = 0;
    for (int h = 0; h < c->n_kv; h++) {
        int len = skv_kv_cache_head(cache, layer, h)->len;
        total += len;
        over |= len > budget;
    }
    bool head_gran = c->spec.granularity == SKV_GRAN_HEAD;
    if (head_gran ? total <= budget * c->n_kv : !over)
        return SKV_OK;
    int rc = grow((void **)&c->rows, &c->rows_cap, total, sizeof *c->rows);
    if (rc)
        return rc;
    int n_keep = 0;
    if (!head_gran) {
        /* per head: classify into its own segment, sort, move the best `budget` rows to the
         * front (segments only move towards the start, never over a later head's) */
        int base = 0;
        for (int h = 0; h < c->n_kv; h++) {
            const struct skv_kv_head *kh = skv_kv_cache_head(cache, layer, h);
            struct row *seg = c->rows + base;
            classify(c, kh, h, w_obs < kh->len ? w_obs : kh->len, seg);
            qsort(seg, (size_t)kh->len, sizeof *seg, by_keep_order);
            int k = kh->len < budget ? kh->len : budget;
            memmove(c->rows + n_keep, seg, (size_t)k * sizeof *seg);
            n_keep += k;
            base += kh->len;
        }
    } else {
        /* one top-k over all heads of the layer (Ada-KV): each head's must-keep rows first
         * (at most budget per head), then the best scored rows of any head */
        int base = 0, quota = budget * c->n_kv;
        for (int h = 0; h < c->n_kv; h++) {
            const struct skv_kv_head *kh = skv_kv_cache_head(cache, layer, h);
            classify(c, kh, h, w_obs < kh->len ? w_obs : kh->len, c->rows + base);
            base += kh->len;
        }
        /* cap must-keep rows per head at the per-head budget */
        qsort(c->rows, (size_t)base, sizeof *c->rows, by_keep_order);
        int must_per_head[SKV_MAX_KV_HEADS] = {0};
        for (int i = 0; i < base; i++)
            if (c->rows[i].must && must_per_head[c->rows[i].head]++ >= budget)
                c->rows[i].must = 0, c->rows[i].key = -INFINITY;
        qsort(c->rows, (size_t)base, sizeof *c->rows, by_keep_order);
        n_keep = quota < base ? quota : base;
    }
    return compact(c, cache, layer, c->rows, n_keep);
}

int skv_compressor_hook(void *user, const struct skv_layer_view *v)
{
    struct skv_compressor *c = user;
    const struct skv_compress_spec *s = &c->spec;
    if (s->policy == SKV_POLICY_FULL)
        return SKV_OK;
    int l = v->layer, budget = c->layer_budget[l];
    if (c->spec.alloc == SKV_ALLOC_SQUEEZE && !c->decode) {
        int rc = c->be->ops->cosine_mean(c->be, &c->sim[l], v->x_in, v->x_mid, v->n, c->m->cfg.dim);
        if (rc)
            return rc;
    }
    if (budget <= 0)
        return SKV_OK; /* decode without a decode budget */
    int64_t max_rows = 0;
    bool over = false;
    for (int h = 0; h < c->n_kv; h++) {
        int len = skv_kv_cache_head(v->cache, l, h)->len;
        max_rows = len > max_rows ? len : max_rows;
        over |= len > budget;
    }
    int w_obs = s->window < v->n ? s->window : v->n;
    if (s->policy == SKV_POLICY_H2O) {
        /* accumulated attention of every query so far; recent window kept */
        int rc = window_colsum(c, v, 0, max_rows);
        if (rc)
            return rc;
        w_obs = s->window;
        int g = c->n_heads / c->n_kv;
        for (int h = 0; h < c->n_kv; h++) {
            struct skv_kv_head *kh = skv_kv_cache_head(v->cache, l, h);
            skv_gqa_reduce(c->colsum_host + (int64_t)h * g * c->colsum_stride, c->colsum_stride, g, kh->len, s->gqa,
                           c->agg);
            for (int j = 0; j < kh->len; j++)
                kh->score[j] += c->agg[j];
        }
    } else if (s->policy == SKV_POLICY_SNAPKV && over && !c->decode) {
        int rc = window_colsum(c, v, v->n - w_obs, max_rows);
        if (rc)
            return rc;
        int g = c->n_heads / c->n_kv;
        for (int h = 0; h < c->n_kv; h++) {
            struct skv_kv_head *kh = skv_kv_cache_head(v->cache, l, h);
            int cand = kh->len - w_obs;
            skv_gqa_reduce(c->colsum_host + (int64_t)h * g * c->colsum_stride, c->colsum_stride, g, kh->len, s->gqa,
                           c->agg);
            for (int j = 0; j < kh->len; j++)
                c->agg[j] /= (float)w_obs; /* mean over the window's queries */
            if (cand > 0)
                skv_pool1d(c->agg, kh->score, cand, s->kernel, s->pool);
            for (int j = cand < 0 ? 0 : cand; j < kh->len; j++)
                kh->score[j] = c->agg[j];
        }
    }
    return select_layer(c, v->cache, l, budget, w_obs);
}

int skv_compressor_finish(struct skv_compressor *c, struct skv_kv_cache *cache)
{
    if (c->spec.policy == SKV_POLICY_FULL || c->spec.alloc != SKV_ALLOC_SQUEEZE || c->decode)
        return SKV_OK;
    int *final = malloc((size_t)c->n_layers * sizeof *final);
    if (!final)
        return SKV_E_NOMEM;
    skv_squeeze_budgets(c->sim, c->n_layers, c->budget, c->spec.p, c->total_len, final);
    long excess = 0;
    for (int l = 0; l < c->n_layers; l++)
        if (final[l] > c->layer_budget[l]) {
            excess += final[l] - c->layer_budget[l];
            final[l] = c->layer_budget[l];
        }
    while (excess > 0) {
        int best = -1;
        for (int l = 0; l < c->n_layers; l++)
            if (final[l] < c->layer_budget[l] && (best < 0 || c->sim[l] < c->sim[best]))
                best = l;
        if (best < 0)
            break; /* every layer holds what it can */
        long room = c->layer_budget[best] - final[best];
        long give = room < excess ? room : excess;
        final[best] += (int)give;
        excess -= give;
    }
    int rc = SKV_OK;
    int w_obs = c->spec.window < c->batch ? c->spec.window : c->batch;
    for (int l = 0; l < c->n_layers && !rc; l++) {
        int b = final[l] < c->layer_budget[l] ? final[l] : c->layer_budget[l];
        c->layer_budget[l] = b;
        rc = select_layer(c, cache, l, b, w_obs);
    }
    free(final);
    return rc;
}
