/* The compressor: the engine's layer hook that scores a layer's cached rows with the
 * sequence policy and cuts each KV head (or the layer's heads together) to its budget, then
 * compacts K, V, positions and scores in place; while decoding, the same hook keeps evicting
 * (H2O, StreamingLLM / window) or re-scores SnapKV with the newest decoded tokens' queries.
 * H2O and StreamingLLM / window rules live here beside the selection; the scoring math
 * (column sums, GQA reduction, SnapKV's pooling) and SnapKV's top-k are backend ops, so they
 * run where the cache is; PyramidKV and SqueezeAttention have files. */
#include "daemon/compress/compress.h"
#include "common/status.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Memory-lean SqueezeAttention keeps at most 4 B rows per layer and head until every layer's
 * similarity is known; a layer allotted more gets the cap, and what it cannot hold is shared
 * evenly by the layers still under their cap (the reference has no cap: it only bounds memory,
 * it should not reshape the allocation). */
#define SQUEEZE_CAP_FACTOR 4
/* Rows of room a compacted head keeps for decoded tokens (the rest of its memory goes back). */
#define COMPACT_SLACK 16

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
    int *decode_budgets;    /* [L] decode_budget spread like the prefill's layer budgets */
    float *sim;             /* [L] squeeze cosines */
    /* A layer's scores on the backend: column sums [n_heads][stride], then their reduction over
     * each GQA group (pooled for SnapKV) [n_kv][stride]; capacity score_cap rows per head.
     * scored_layer: the layer whose rows `scores` describes as they are now (-1: none). */
    float *colsum, *scores;
    int64_t score_cap;
    int64_t score_stride;   /* rows per head in the last scoring: the layer's longest head */
    int scored_layer;
    float *agg;             /* [n_kv][score_cap] host copy of H2O's reduced scores */
    int32_t *sel;           /* [n_kv][score_cap] rows topk_rows kept */
    struct row *rows;       /* selection scratch */
    int rows_cap;
    int32_t *idx;           /* kept indices of one head */
    int idx_cap;
    /* SnapKV re-scoring while decoding (decode_budget): the post-RoPE queries of the newest
     * obs_cap tokens decoded since the last compressing forward, per layer, in a ring indexed
     * by position: obs_q [L][obs_cap][n_heads * head_dim] (backend memory), slot pos % obs_cap. */
    float *obs_q;
    float *obs_win;         /* [obs_cap][n_heads * head_dim]: the window in position order */
    int obs_cap;            /* min(window, decode_budget) */
    int32_t obs_start;      /* position of the first decoded token observed */
    int32_t score_from;     /* H2O: this forward's attention goes to rows from this position on */
    int32_t rerun_from;     /* ... set for the next forward by skv_compressor_rerun */
    int32_t obs_end;        /* position after the last token observed; -1: none yet */
    int32_t obs_from;       /* the oldest position whose query the ring still holds for sure: obs_start,
                             * or past it when a forward that failed wrote over older slots */
    /* Decode upkeep deferred to the forward's end (skv_compressor_decode_reserve with defer:
     * H2O, StreamingLLM, window, SnapKV's re-scoring): the hook records each layer,
     * skv_compressor_hook_done cuts them all once the whole forward succeeded, so a forward that
     * fails part way leaves every layer as it was. pend[l]: layer l waits; pend_agg
     * [L][n_kv][pend_stride] H2O's scores of the forward's queries for layer l (pend_rows[l] a
     * head: its longest head then). SnapKV's queries wait in its ring (obs_q). */
    bool defer;
    uint8_t *pend;
    float *pend_agg;
    int64_t pend_stride;
    int64_t *pend_rows;
    int pend_n;             /* the forward's tokens */
    int cut_failures;       /* deferred cuts that failed, for skv_compressor_take_cut_failures */
};

struct row {
    float key;      /* policy score (higher keeps) */
    int32_t prio;   /* order among must-keep rows (higher keeps) */
    int32_t idx;    /* row in the head */
    int32_t pos;    /* its original position (the last tie-break: the rows may be out of order) */
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
    if (spec->interval <= 0 || spec->decode_budget < 0)
        return skv_errorf(SKV_E_INVAL, "compression spec: interval must be >= 1 and decode_budget >= 0");
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
    c->obs_end = -1;
    c->scored_layer = -1;
    c->layer_budget = calloc((size_t)c->n_layers, sizeof *c->layer_budget);
    c->sim = calloc((size_t)c->n_layers, sizeof *c->sim);
    c->decode_budgets = calloc((size_t)c->n_layers, sizeof *c->decode_budgets);
    if (!c->layer_budget || !c->sim || !c->decode_budgets) {
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
    if (c->scores)
        c->be->ops->free(c->be, c->scores);
    if (c->obs_q)
        c->be->ops->free(c->be, c->obs_q);
    if (c->obs_win)
        c->be->ops->free(c->be, c->obs_win);
    free(c->agg);
    free(c->pend);
    free(c->pend_agg);
    free(c->pend_rows);
    free(c->sel);
    free(c->rows);
    free(c->idx);
    free(c->layer_budget);
    free(c->decode_budgets);
    free(c->sim);
    free(c);
    *c_p = NULL;
}

static bool rescores_decode(const struct skv_compress_spec *s)
{
    return s->policy == SKV_POLICY_SNAPKV && s->decode_budget > 0;
}

/* Queries the re-scoring ring keeps per layer: min(window, decode_budget), since the newest
 * decode_budget rows are all a window can keep. */
static int ring_rows(const struct skv_compress_spec *s)
{
    return s->window < s->decode_budget ? s->window : s->decode_budget;
}

uint64_t skv_compressor_bytes(const struct skv_compressor *c)
{
    if (!rescores_decode(&c->spec))
        return 0;
    int cap = ring_rows(&c->spec);
    return (uint64_t)(c->n_layers + 1) * cap * c->n_heads * c->head_dim * sizeof(float);
}

uint64_t skv_compressor_ring_bytes(const struct skv_compressor *c)
{
    return c && c->obs_q ? skv_compressor_bytes(c) : 0;
}

/* The query ring keeps the newest min(window, decode_budget) queries per layer: more could
 * never be used, since the newest decode_budget rows are all a window can keep. */
static int obs_alloc(struct skv_compressor *c)
{
    if (c->obs_q)
        return SKV_OK;
    int cap = ring_rows(&c->spec);
    size_t row = (size_t)c->n_heads * c->head_dim * sizeof(float);
    int rc = c->be->ops->alloc(c->be, (size_t)c->n_layers * cap * row, (void **)&c->obs_q);
    if (!rc)
        rc = c->be->ops->alloc(c->be, (size_t)cap * row, (void **)&c->obs_win);
    if (rc) {
        if (c->obs_q)
            c->be->ops->free(c->be, c->obs_q);
        c->obs_q = NULL;
        return rc;
    }
    c->obs_cap = cap;
    return SKV_OK;
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
    c->decode = src->decode;
    memcpy(c->layer_budget, src->layer_budget, (size_t)c->n_layers * sizeof *c->layer_budget);
    memcpy(c->decode_budgets, src->decode_budgets, (size_t)c->n_layers * sizeof *c->decode_budgets);
    memcpy(c->sim, src->sim, (size_t)c->n_layers * sizeof *c->sim);
    if (src->obs_q) { /* the fork's cache is a copy: its observation window stays valid */
        size_t row = (size_t)c->n_heads * c->head_dim * sizeof(float);
        if ((rc = obs_alloc(c)) ||
            (rc = c->be->ops->copy_2d(c->be, c->obs_q, row, src->obs_q, row, row,
                                      (int64_t)c->n_layers * c->obs_cap))) {
            skv_compressor_free(&c);
            return rc;
        }
        c->obs_start = src->obs_start;
        c->obs_end = src->obs_end;
        c->obs_from = src->obs_from;
    }
    *out = c;
    return SKV_OK;
}

/* State bytes: int32 n_layers, budget, total_len, decode; int32 layer_budget[L],
 * decode_budgets[L]; float sim[L]; host byte order (saved sessions are read on the host that
 * wrote them; the model fingerprint already ties them to one model). SnapKV re-scoring
 * (decode_budget) with tokens observed since its last compression adds its observation: int32
 * obs_start, obs_end, n_obs, then float [L][n_obs][n_heads * head_dim], the queries of
 * positions obs_end - n_obs .. obs_end - 1 (n_obs = min(ring, obs_end - obs_start), or fewer
 * when a forward that failed had written over the older ones). */
#define STATE_HEAD 4
#define STATE_OBS_HEAD 3

static int obs_copy(struct skv_compressor *c, int layer, float *lin, int32_t first, int32_t end, bool to_ring);

static size_t state_base(const struct skv_compressor *c)
{
    return (size_t)(STATE_HEAD + 3 * c->n_layers) * 4;
}

static size_t state_obs_bytes(const struct skv_compressor *c, int n_obs)
{
    return STATE_OBS_HEAD * 4 + (size_t)c->n_layers * n_obs * c->n_heads * c->head_dim * sizeof(float);
}

/* The observation as of the cache's n_past (*end, and *from: the oldest position whose query
 * the ring holds for sure). A forward that failed once it had observed [n_past, obs_end): the
 * observation goes on from n_past as if it never ran (a retry sees the twin's window and
 * interval count), but its queries overwrote the ring's slots of the positions obs_cap before
 * them, so *from moves past those. false when it cannot go on: tokens went through the model
 * without this compressor, and left no queries here. */
static bool obs_as_of(const struct skv_compressor *c, int32_t n_past, int32_t *end, int32_t *from)
{
    *end = c->obs_end;
    *from = c->obs_from;
    if (c->obs_end == n_past)
        return true;
    if (c->obs_end < n_past || c->obs_start > n_past || c->obs_cap <= 0)
        return false;
    int32_t lost_to = c->obs_end - c->obs_cap;
    if (lost_to > *from)
        *from = lost_to < n_past ? lost_to : n_past;
    *end = n_past;
    return true;
}

/* Queries the saved observation holds: none before the first decoded token, or when the
 * observation cannot go on at n_past (restored as "start again"); those from obs_from on. */
static int state_n_obs(const struct skv_compressor *c, int n_past)
{
    int32_t end, from;
    if (!rescores_decode(&c->spec) || !c->obs_q || !obs_as_of(c, n_past, &end, &from) || end <= from)
        return 0;
    int32_t seen = end - from;
    return seen < c->obs_cap ? (int)seen : c->obs_cap;
}

size_t skv_compressor_state_size(const struct skv_compressor *c, int n_past)
{
    int n_obs = state_n_obs(c, n_past);
    return state_base(c) + (n_obs ? state_obs_bytes(c, n_obs) : 0);
}

size_t skv_compressor_state_max(const struct skv_compressor *c, int n_past)
{
    if (!rescores_decode(&c->spec))
        return state_base(c);
    int cap = ring_rows(&c->spec);
    return state_base(c) + state_obs_bytes(c, cap < n_past ? cap : n_past);
}

int skv_compressor_state_write(struct skv_compressor *c, int n_past, void *buf)
{
    int32_t head[STATE_HEAD] = {c->n_layers, c->budget, c->total_len, c->decode};
    size_t L = (size_t)c->n_layers;
    char *p = buf;
    memcpy(p, head, sizeof head);
    p += sizeof head;
    for (size_t l = 0; l < L; l++, p += 4)
        memcpy(p, &(int32_t){c->layer_budget[l]}, 4);
    for (size_t l = 0; l < L; l++, p += 4)
        memcpy(p, &(int32_t){c->decode_budgets[l]}, 4);
    memcpy(p, c->sim, L * sizeof *c->sim);
    p += L * sizeof *c->sim;
    int n_obs = state_n_obs(c, n_past);
    if (!n_obs)
        return SKV_OK;
    /* (n_obs below min(ring, n_past - obs_start): a failed forward wrote over older queries) */
    int32_t obs[STATE_OBS_HEAD] = {c->obs_start, n_past, n_obs};
    memcpy(p, obs, sizeof obs);
    p += sizeof obs;
    size_t bytes = (size_t)n_obs * c->n_heads * c->head_dim * sizeof(float);
    for (int l = 0; l < c->n_layers; l++, p += bytes) {
        int rc = obs_copy(c, l, c->obs_win, n_past - n_obs, n_past, false);
        if (rc || (rc = c->be->ops->download(c->be, p, c->obs_win, bytes)))
            return rc;
    }
    return SKV_OK;
}

/* The saved observation (state bytes past the base): checked against the spec and n_past,
 * then copied into the ring. */
static int state_read_obs(struct skv_compressor *c, const char *p, size_t len, int n_past)
{
    int32_t obs[STATE_OBS_HEAD];
    if (len < sizeof obs || !rescores_decode(&c->spec))
        return skv_errorf(SKV_E_FORMAT, "compressor state: %zu bytes, expected %zu", len + state_base(c),
                          state_base(c));
    memcpy(obs, p, sizeof obs);
    int cap = ring_rows(&c->spec);
    int32_t start = obs[0], end = obs[1], n_obs = obs[2];
    int64_t seen = (int64_t)end - start;
    if (end != n_past || start < 0 || seen < 1 || n_obs < 1 || n_obs > (seen < cap ? seen : cap))
        return skv_errorf(SKV_E_FORMAT, "compressor state: implausible observation window");
    if (len != state_obs_bytes(c, n_obs))
        return skv_errorf(SKV_E_FORMAT, "compressor state: observation of %zu bytes, expected %zu", len,
                          state_obs_bytes(c, n_obs));
    const float *q = (const float *)(const void *)(p + sizeof obs);
    size_t per_layer = (size_t)n_obs * c->n_heads * c->head_dim;
    for (size_t i = 0; i < per_layer * c->n_layers; i++) {
        float x;
        memcpy(&x, q + i, sizeof x);
        if (!isfinite(x))
            return skv_errorf(SKV_E_FORMAT, "compressor state: a saved query is not finite");
    }
    int rc = obs_alloc(c);
    for (int l = 0; l < c->n_layers && !rc; l++) {
        rc = c->be->ops->upload(c->be, c->obs_win, p + sizeof obs + (size_t)l * per_layer * sizeof(float),
                                per_layer * sizeof(float));
        if (!rc)
            rc = obs_copy(c, l, c->obs_win, end - n_obs, end, true);
    }
    if (rc)
        return rc;
    c->obs_start = start;
    c->obs_from = end - n_obs; /* (past start: what the ring held when it was saved) */
    c->obs_end = end;
    return SKV_OK;
}

/* The window a policy keeps on top of its selection (snapkv's observation window, h2o's recent
 * one), which PyramidKV's and SqueezeAttention's shares leave out; streaming and window keep
 * none (before, PyramidKV counted their spec's window: at budget=32 it took all 32 and
 * tapered nothing). */
static int kept_window(const struct skv_compress_spec *s)
{
    return s->policy == SKV_POLICY_SNAPKV || s->policy == SKV_POLICY_H2O ? s->window : 0;
}

/* What a decode grows a layer's budget to when the prompt did not reach it: budget=N, or a
 * ratio's min_budget floor (0: none). */
static int decode_floor(const struct skv_compress_spec *s)
{
    return s->ratio < 0 ? s->budget : s->min_budget;
}

int skv_compressor_state_read(struct skv_compressor *c, const void *buf, size_t len, int n_past)
{
    size_t base = state_base(c);
    if (len < base || (len > base && !rescores_decode(&c->spec)))
        return skv_errorf(SKV_E_FORMAT, "compressor state: %zu bytes, expected %zu", len, base);
    int32_t head[STATE_HEAD];
    const char *p = buf;
    memcpy(head, p, sizeof head);
    p += sizeof head;
    int L = c->n_layers;
    /* rows a layer may be allotted: at most the sequence, or, for a fixed budget, what a layer
     * grows to while decoding (grow_fixed_budgets: up to 4 B under squeeze) */
    long most = (long)n_past + 1;
    long most_layer = (long)decode_floor(&c->spec) * SQUEEZE_CAP_FACTOR + c->spec.window;
    most_layer = most_layer > most ? most_layer : most;
    /* while decoding, a layer's budget is its share of decode_budget (up to L times it),
     * whatever the sequence's length */
    long most_decode = (long)c->spec.decode_budget * L;
    most_layer = most_layer > most_decode ? most_layer : most_decode;
    if (head[0] != L || head[1] < 0 || head[1] > most || head[2] < 0 || head[2] > most ||
        (head[3] != 0 && head[3] != 1))
        return skv_errorf(SKV_E_FORMAT, "compressor state: implausible header");
    const char *lb = p, *db = p + (size_t)L * 4, *sp = p + (size_t)L * 8;
    for (int l = 0; l < L; l++) {
        int32_t b, d;
        memcpy(&b, lb + (size_t)l * 4, 4);
        memcpy(&d, db + (size_t)l * 4, 4);
        float sim; /* SqueezeAttention's cosine similarity */
        memcpy(&sim, sp + (size_t)l * sizeof sim, sizeof sim);
        /* a layer's decode budget: its share of decode_budget, up to L times it */
        if (b < 0 || b > most_layer || d < 0 || d > (most_decode > SKV_SPEC_MAX_BUDGET ? most_decode : SKV_SPEC_MAX_BUDGET) ||
            !isfinite(sim))
            return skv_errorf(SKV_E_FORMAT, "compressor state: layer %d out of range", l);
    }
    /* nothing observed: SnapKV re-scoring starts its window with the next decoded token */
    int32_t obs_start = c->obs_start, obs_end = c->obs_end, obs_from = c->obs_from;
    c->obs_start = c->obs_end = c->obs_from = n_past;
    if (len > base) {
        int rc = state_read_obs(c, (const char *)buf + base, len - base, n_past);
        if (rc) {
            c->obs_start = obs_start;
            c->obs_end = obs_end;
            c->obs_from = obs_from;
            return rc;
        }
    }
    c->budget = head[1];
    c->total_len = head[2];
    c->decode = head[3] != 0;
    for (int l = 0; l < L; l++) {
        int32_t b, d;
        memcpy(&b, lb + (size_t)l * 4, 4);
        memcpy(&d, db + (size_t)l * 4, 4);
        c->layer_budget[l] = b;
        c->decode_budgets[l] = d;
    }
    memcpy(c->sim, sp, (size_t)L * sizeof *c->sim);
    c->scored_layer = -1;
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

void skv_compressor_rerun(struct skv_compressor *c, struct skv_kv_cache *cache, bool was_h2o, int cut)
{
    if (c->spec.policy != SKV_POLICY_H2O)
        return;
    if (was_h2o) { /* the kept rows' sums already count the queries that run again */
        c->rerun_from = cut;
        return;
    }
    for (int i = 0; i < cache->n_layers * cache->n_kv_heads; i++) /* another policy's scores */
        memset(cache->heads[i].score, 0, (size_t)cache->heads[i].len * sizeof(float));
    c->rerun_from = 0;
}

/* Each layer's budget for a cache of total_len tokens (SqueezeAttention: the capped upper one it
 * keeps until the allocation is known) into out[n_layers]; returns the spec's budget. */
static int plan_budgets(const struct skv_compressor *c, int total_len, int *out)
{
    int budget = skv_compress_spec_budget(&c->spec, total_len), L = c->n_layers;
    switch (c->spec.alloc) {
    case SKV_ALLOC_UNIFORM:
        for (int l = 0; l < L; l++)
            out[l] = budget;
        break;
    case SKV_ALLOC_PYRAMID:
        skv_pyramid_budgets(L, budget, kept_window(&c->spec), c->spec.pyramid_beta, total_len, out);
        break;
    case SKV_ALLOC_SQUEEZE: {
        /* final budgets are known after the last layer; meanwhile keep a capped upper bound */
        long cap = (long)budget * SQUEEZE_CAP_FACTOR;
        for (int l = 0; l < L; l++)
            out[l] = (int)(cap < total_len ? cap : total_len);
        break;
    }
    }
    return budget;
}

/* No deferred upkeep: a forward that failed leaves what it recorded undone. */
static void pend_clear(struct skv_compressor *c)
{
    c->defer = false;
    if (c->pend)
        memset(c->pend, 0, (size_t)c->n_layers);
}

int skv_compressor_begin(struct skv_compressor *c, struct skv_kv_cache *cache, int n)
{
    if (n <= 0)
        return skv_errorf(SKV_E_INVAL, "compress: empty forward");
    /* SnapKV scores and pools rows by index, and a compressing forward's window is its last
     * rows: rows an in-place decode left out of order (a FORK of such a session) go back in
     * order first */
    int rc = skv_kv_cache_order(cache);
    if (rc)
        return rc;
    c->decode = false;
    pend_clear(c);
    c->scored_layer = -1; /* the cache may have changed since the last scores */
    c->score_from = c->rerun_from;
    c->rerun_from = 0;
    c->batch = n;
    c->total_len = cache->n_past + n;
    /* decoded tokens observed from here on: the rows this forward keeps are no window */
    c->obs_start = c->obs_end = c->obs_from = c->total_len;
    c->budget = plan_budgets(c, c->total_len, c->layer_budget);
    return SKV_OK;
}

int64_t skv_compressor_prefill_blocks(const struct skv_compressor *c, const struct skv_kv_cache *cache, int n)
{
    int64_t total = cache->n_past + n, R = cache->block_rows, H = cache->n_kv_heads;
    int64_t whole = H * ((total + R - 1) / R); /* a layer kept whole */
    int *b = malloc((size_t)c->n_layers * sizeof *b);
    if (!b)
        return c->n_layers * whole; /* the most it could be */
    plan_budgets(c, (int)total, b);
    int64_t blocks = 0;
    for (int l = 0; l < c->n_layers; l++) {
        int64_t rows = b[l] < total ? b[l] : total, layer;
        if (c->spec.policy == SKV_POLICY_FULL)
            layer = whole;
        else if (c->spec.granularity == SKV_GRAN_HEAD) /* rows * H over heads of any lengths */
            layer = (rows * H + R - 1) / R + H - 1;
        else
            layer = H * ((rows + R - 1) / R);
        blocks += layer < whole ? layer : whole;
    }
    free(b);
    return blocks;
}

/* decode_budget D is the mean over the layers; the prefill allocation's shape (PyramidKV,
 * SqueezeAttention) carries over: layer l gets D * b_l / mean(b), b the layer budgets the
 * prefill kept, rounded by largest remainder so that the total stays L * D, at least 1 row. */
static void spread_decode_budget(struct skv_compressor *c)
{
    int L = c->n_layers, D = c->spec.decode_budget;
    double sum = 0;
    for (int l = 0; l < L; l++)
        sum += c->layer_budget[l];
    double *frac = malloc((size_t)L * sizeof *frac);
    /* no shape to keep, no memory to compute it, or a layer's share could pass an int: D everywhere */
    if (!frac || sum <= 0 || (long)D * L > INT32_MAX / 2) {
        for (int l = 0; l < L; l++)
            c->decode_budgets[l] = D;
        free(frac);
        return;
    }
    long total = 0;
    for (int l = 0; l < L; l++) {
        double want = (double)D * L * c->layer_budget[l] / sum;
        c->decode_budgets[l] = (int)want;
        frac[l] = want - c->decode_budgets[l];
        total += c->decode_budgets[l];
    }
    /* the rows rounding left over go to the largest remainders (the earlier layer on ties) */
    for (long left = (long)D * L - total; left > 0; left--) {
        int best = 0;
        for (int l = 1; l < L; l++)
            best = frac[l] > frac[best] ? l : best;
        c->decode_budgets[best]++;
        frac[best] = -1;
    }
    /* a layer holds at least one row (the newest); what that adds comes off the largest, so
     * the total stays L * D (before, a squeezed layer rounded to 0 and raised to 1 went over) */
    long over = 0;
    for (int l = 0; l < L; l++)
        if (c->decode_budgets[l] < 1) {
            over += 1 - c->decode_budgets[l];
            c->decode_budgets[l] = 1;
        }
    for (; over > 0; over--) {
        int most = 0;
        for (int l = 1; l < L; l++)
            most = c->decode_budgets[l] > c->decode_budgets[most] ? l : most;
        if (c->decode_budgets[most] <= 1)
            break; /* D >= 1: not reached */
        c->decode_budgets[most]--;
    }
    free(frac);
}

/* A fixed budget (budget=N), or a ratio's min_budget, that the prompt did not reach was cut to
 * the prompt's length at prefill (the layer kept whole); while decoding, the layers grow to the
 * budget the spec asks for, allocated as at prefill (before, a min_budget floor was not: a
 * 20-token prompt under `ratio=0.1,min_budget=32` decoded at 20 rows). */
static void grow_fixed_budgets(struct skv_compressor *c)
{
    int B = decode_floor(&c->spec), L = c->n_layers, w = kept_window(&c->spec);
    switch (c->spec.alloc) {
    case SKV_ALLOC_UNIFORM:
        for (int l = 0; l < L; l++)
            c->layer_budget[l] = B;
        break;
    case SKV_ALLOC_PYRAMID: /* a length no layer's share reaches: nothing is cut */
        skv_pyramid_budgets(L, B, w, c->spec.pyramid_beta, 2 * B + w + 1, c->layer_budget);
        break;
    case SKV_ALLOC_SQUEEZE:
        skv_squeeze_budgets(c->sim, L, B, w, c->spec.p, B * SQUEEZE_CAP_FACTOR, c->layer_budget);
        break;
    }
}

bool skv_compressor_decode_keeps_rows(const struct skv_compressor *c)
{
    return c->spec.policy == SKV_POLICY_FULL || (c->spec.policy == SKV_POLICY_SNAPKV && c->spec.decode_budget <= 0);
}

int skv_compressor_begin_decode(struct skv_compressor *c, struct skv_kv_cache *cache)
{
    if (c->spec.policy == SKV_POLICY_SNAPKV && cache->unordered) { /* its re-scoring reads rows by index */
        int rc = skv_kv_cache_order(cache);
        if (rc)
            return rc;
    }
    if (!c->decode && c->spec.decode_budget > 0)
        spread_decode_budget(c); /* the first decode step after a compressing forward */
    else if (!c->decode && c->budget < decode_floor(&c->spec) && c->spec.policy != SKV_POLICY_SNAPKV)
        grow_fixed_budgets(c);
    c->decode = true;
    pend_clear(c); /* (skv_compressor_decode_reserve defers the forward that follows) */
    c->scored_layer = -1;
    c->score_from = 0;
    c->batch = 1;
    c->total_len = cache->n_past + 1;
    /* after a failed forward the observation goes on (obs_as_of); after tokens that went
     * through the model without this compressor it (and the interval count) starts again here */
    int32_t end, from;
    if (obs_as_of(c, cache->n_past, &end, &from)) {
        c->obs_end = end;
        c->obs_from = from;
    } else {
        c->obs_start = c->obs_end = c->obs_from = cache->n_past;
    }
    /* h2o / streaming / window keep each layer at its prefill budget (or decode_budget);
     * snapkv keeps all until a decode_budget re-scores it every `interval` tokens */
    for (int l = 0; l < c->n_layers; l++)
        if (c->spec.policy == SKV_POLICY_SNAPKV || c->spec.decode_budget > 0)
            c->layer_budget[l] = c->spec.decode_budget > 0 ? c->decode_budgets[l] : 0;
    return SKV_OK;
}

static int scores_reserve(struct skv_compressor *c, int64_t max_rows);

int skv_compressor_decode_reserve(struct skv_compressor *c, const struct skv_kv_cache *cache, int n, bool defer)
{
    const struct skv_compress_spec *s = &c->spec;
    c->defer = false;
    if (s->policy == SKV_POLICY_FULL || skv_compressor_decode_keeps_rows(c))
        return SKV_OK;
    int rc = rescores_decode(s) ? obs_alloc(c) : SKV_OK;
    int most = 0, most_total = 0; /* a head's rows, a layer's, after the forward */
    for (int l = 0; l < c->n_layers; l++) {
        int total = 0;
        for (int h = 0; h < c->n_kv; h++) {
            int len = skv_kv_cache_head((struct skv_kv_cache *)cache, l, h)->len + n;
            most = len > most ? len : most;
            total += len;
        }
        most_total = total > most_total ? total : most_total;
    }
    if (!rc && (s->policy == SKV_POLICY_H2O || rescores_decode(s)))
        rc = scores_reserve(c, most);
    if (!rc)
        rc = grow((void **)&c->rows, &c->rows_cap, most_total, sizeof *c->rows);
    if (!rc)
        rc = grow((void **)&c->idx, &c->idx_cap, most + 1, sizeof *c->idx);
    /* deferred upkeep: the pending marks, and H2O's scores of every layer until the end */
    if (!rc && defer) {
        if (!c->pend && !(c->pend = calloc((size_t)c->n_layers, 1)))
            rc = SKV_E_NOMEM;
        if (!rc && !c->pend_rows && !(c->pend_rows = calloc((size_t)c->n_layers, sizeof *c->pend_rows)))
            rc = SKV_E_NOMEM;
        if (!rc && s->policy == SKV_POLICY_H2O && most > c->pend_stride) {
            float *p = realloc(c->pend_agg, (size_t)c->n_layers * c->n_kv * (size_t)most * sizeof *p);
            if (p) {
                c->pend_agg = p;
                c->pend_stride = most;
            } else {
                rc = SKV_E_NOMEM;
            }
        }
        c->defer = !rc;
    }
    return rc;
}

/* Room for scores of max_rows rows per head (backend buffers and their host companions). */
static int scores_reserve(struct skv_compressor *c, int64_t max_rows)
{
    if (max_rows <= c->score_cap)
        return SKV_OK;
    int64_t cap = c->score_cap ? c->score_cap : 1024;
    while (cap < max_rows)
        cap *= 2;
    struct skv_backend *be = c->be;
    if (c->colsum)
        be->ops->free(be, c->colsum);
    if (c->scores)
        be->ops->free(be, c->scores);
    c->colsum = c->scores = NULL;
    c->score_cap = 0;
    float *agg = realloc(c->agg, (size_t)cap * c->n_kv * sizeof *agg);
    if (!agg)
        return SKV_E_NOMEM;
    c->agg = agg;
    int32_t *sel = realloc(c->sel, (size_t)cap * c->n_kv * sizeof *sel);
    if (!sel)
        return SKV_E_NOMEM;
    c->sel = sel;
    int rc = be->ops->alloc(be, (size_t)cap * c->n_heads * sizeof(float), (void **)&c->colsum);
    if (!rc)
        rc = be->ops->alloc(be, (size_t)cap * c->n_kv * sizeof(float), (void **)&c->scores);
    if (rc)
        return rc;
    c->score_cap = cap;
    return SKV_OK;
}

/* Scores of every row of layer `layer`, on the backend: the attention the queries
 * q[q_first..nq) give each row (q [nq][n_heads][head_dim] are the queries of the layer's newest
 * nq rows, so query i sees rows up to len - nq + i of each head), summed over the queries,
 * reduced over each KV head's group (GQA mean or max) and divided by `div`; each head's rows
 * before its newest `unpooled` are pooled with the spec's kernel (unpooled < 0: none are). Into
 * c->scores [n_kv][max_rows]; nothing comes back to the host. A decode step's one query
 * (nq = 1) takes the probabilities its attention gave where the engine has them (probs, of
 * stride max_rows: skv_layer_view.probs) instead of computing them again. */
static int layer_scores(struct skv_compressor *c, struct skv_kv_cache *cache, int layer, const float *q, int nq,
                        int q_first, int64_t max_rows, int unpooled, float div, const float *probs,
                        int64_t probs_stride)
{
    int rc = scores_reserve(c, max_rows);
    if (rc)
        return rc;
    struct skv_kv_view kv = {.window = c->m->layers[layer].window};
    skv_kv_cache_view(cache, layer, &kv);
    int len[SKV_MAX_KV_HEADS], pooled[SKV_MAX_KV_HEADS];
    for (int h = 0; h < c->n_kv; h++) {
        len[h] = skv_kv_cache_head(cache, layer, h)->len;
        kv.prefix_len[h] = len[h] - nq;
        pooled[h] = unpooled < 0 || len[h] < unpooled ? 0 : len[h] - unpooled;
    }
    c->score_stride = max_rows;
    c->scored_layer = -1;
    struct skv_backend *be = c->be;
    const float *colsum = c->colsum;
    if (probs && nq == 1 && q_first == 0) {
        if (probs_stride != max_rows) /* (the engine's stride is the longest head's rows) */
            return skv_errorf(SKV_E_INTERNAL, "H2O upkeep: probabilities of stride %lld for %lld rows",
                              (long long)probs_stride, (long long)max_rows);
        colsum = probs;
    } else {
        rc = be->ops->attention_colsum(be, c->colsum, max_rows, q, nq, c->n_heads, &kv, q_first);
    }
    if (!rc)
        rc = be->ops->group_scores(be, c->scores, colsum, max_rows, c->n_heads, c->n_kv, len, pooled, div,
                                   c->spec.kernel, c->spec.pool == SKV_POOL_MAX, c->spec.gqa == SKV_GQA_MAX);
    if (!rc)
        c->scored_layer = layer;
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
    } else if (x->prio != y->prio) { /* streaming / window: positions a float cannot tell apart */
        return x->prio > y->prio ? -1 : 1;
    }
    if (x->head != y->head)
        return x->head < y->head ? -1 : 1;
    return x->pos < y->pos ? -1 : x->pos > y->pos; /* (in order: as by index) */
}

static int by_head_idx(const void *a, const void *b)
{
    const struct row *x = a, *y = b;
    if (x->head != y->head)
        return x->head < y->head ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

/* A head's rows over its budget after a decoded token or a short APPEND: at most this many are
 * found in one pass (n * over comparisons) instead of a sort of all n. */
#define FEW_OVER 8

/* The `drop` (<= FEW_OVER) worst of seg's n rows in by_keep_order, into worst[] (indices into
 * seg, in by_keep_order: worst[nw - 1] is the very worst); returns how many. */
static int worst_rows(const struct row *seg, int n, int drop, int worst[FEW_OVER])
{
    int nw = 0;
    for (int j = 0; j < n && drop > 0; j++) {
        if (nw == drop) {
            if (by_keep_order(&seg[j], &seg[worst[0]]) < 0)
                continue; /* better than every one held */
            memmove(worst, worst + 1, (size_t)--nw * sizeof *worst); /* the best held one is kept */
        }
        int at = nw++;
        for (; at > 0 && by_keep_order(&seg[worst[at - 1]], &seg[j]) > 0; at--)
            worst[at] = worst[at - 1];
        worst[at] = j;
    }
    return nw;
}

/* Copies the n rows of seg (in index order) but the `drop` last in by_keep_order into out, in
 * the same order (out may be seg or before it); returns how many were copied. The same rows a
 * sort by by_keep_order would keep first (a total order: no ties). */
static int keep_all_but_worst(const struct row *seg, int n, int drop, struct row *out)
{
    int worst[FEW_OVER];
    int nw = worst_rows(seg, n, drop, worst);
    int k = 0;
    for (int j = 0; j < n; j++) {
        bool dropped = false;
        for (int i = 0; i < nw && !dropped; i++)
            dropped = worst[i] == j;
        if (!dropped)
            out[k++] = seg[j]; /* (out[k] is at or before seg[j]: nothing unread is written) */
    }
    return k;
}

/* The position the newest w of head kh's rows start at (its rows in position order or not:
 * in_order says they are): rows at or past it are the newest w. */
static int32_t newest_start(const struct skv_kv_head *kh, int w, bool in_order)
{
    if (w <= 0)
        return INT32_MAX;
    if (w >= kh->len)
        return INT32_MIN;
    if (in_order)
        return kh->pos[kh->len - w];
    int32_t lo = INT32_MAX, hi = INT32_MIN;
    for (int j = 0; j < kh->len; j++) {
        lo = kh->pos[j] < lo ? kh->pos[j] : lo;
        hi = kh->pos[j] > hi ? kh->pos[j] : hi;
    }
    int at_least = 0; /* while decoding, the newest w positions are those of the last w tokens */
    for (int j = 0; j < kh->len; j++)
        at_least += kh->pos[j] > hi - w;
    if (at_least == w)
        return hi - w + 1;
    while (lo < hi) { /* the largest t with at least w positions >= t (they are distinct: exactly w) */
        int32_t mid = lo + (int32_t)(((int64_t)hi - lo + 1) / 2);
        int cnt = 0;
        for (int j = 0; j < kh->len; j++)
            cnt += kh->pos[j] >= mid;
        if (cnt >= w)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Writes the rows of head h of the layer into out[]: policy keys, must flags. w_obs: the
 * observation / recent window in rows. */
static void classify(const struct skv_compressor *c, const struct skv_kv_cache *cache, const struct skv_kv_head *kh,
                     int h, int w_obs, int budget, struct row *out)
{
    int n = kh->len;
    /* the observation (snapkv) or recent (h2o) window: the newest w_obs rows, by position (the
     * last ones unless a decode dropped rows in place); the other policies have none */
    bool windowed = c->spec.policy == SKV_POLICY_SNAPKV || c->spec.policy == SKV_POLICY_H2O;
    int32_t recent = windowed ? newest_start(kh, w_obs, !cache->unordered) : INT32_MAX;
    /* StreamingLLM's sinks leave the newest row a place: with budget <= sinks they would fill
     * it, and each decoded token would go right after its own step */
    int sinks = c->spec.sinks < budget ? c->spec.sinks : budget - 1;
    for (int j = 0; j < n; j++) {
        struct row *r = &out[j];
        r->idx = j;
        r->pos = kh->pos[j];
        r->head = (int16_t)h;
        r->key = isnan(kh->score[j]) ? -INFINITY : kh->score[j]; /* NaN: last, as the device's top-k */
        r->must = 0;
        r->prio = 0;
        switch (c->spec.policy) {
        case SKV_POLICY_SNAPKV:
        case SKV_POLICY_H2O:
            if (kh->pos[j] >= recent) { /* the observation (snapkv) or recent (h2o) window */
                r->must = 1;
                r->prio = kh->pos[j];
            }
            break;
        case SKV_POLICY_STREAMING:
            if (kh->pos[j] < sinks) {
                r->must = 1;
                r->prio = -kh->pos[j]; /* earliest sinks first when the budget is tiny */
            } else {
                r->prio = kh->pos[j]; /* past 2^24 neighbouring positions are one float */
            }
            r->key = (float)kh->pos[j];
            break;
        case SKV_POLICY_WINDOW:
            r->key = (float)kh->pos[j];
            r->prio = kh->pos[j];
            break;
        case SKV_POLICY_FULL:
            break;
        }
    }
}

/* Deferred decode upkeep (skv_compressor_hook_done) of StreamingLLM, window or H2O (rows chosen
 * by position and score, never by index) on a layer whose attention does not read positions (no
 * sliding window), each
 * head at most FEW_OVER rows over `budget` (head granularity: the layer at most FEW_OVER over
 * budget * heads): the worst rows found in one pass, and the head's last rows moved into their
 * places (skv_kv_cache_drop_rows: a few row copies a token, where a compaction gathered every
 * block after the first row dropped, about 46 MB a token at budget 1024 for SmolLM2). The same
 * rows as the compaction keeps, out of position order. false: not such a cut (*rc untouched). */
static bool drop_worst(struct skv_compressor *c, struct skv_kv_cache *cache, int layer, int budget, int w_obs,
                       int slack, int *rc)
{
    bool in_place = c->spec.policy == SKV_POLICY_STREAMING || c->spec.policy == SKV_POLICY_WINDOW ||
                    c->spec.policy == SKV_POLICY_H2O; /* (SnapKV's re-scoring selects by index) */
    bool head_gran = c->spec.granularity == SKV_GRAN_HEAD;
    /* deferred only: the cut runs once the whole forward succeeded, so a failed forward's rows
     * are still its head's last ones when forward_undo takes them back */
    if (!c->decode || !c->defer || !in_place || c->m->layers[layer].window > 0)
        return false;
    int total = 0, must[SKV_MAX_KV_HEADS] = {0};
    for (int h = 0; h < c->n_kv; h++) {
        int len = skv_kv_cache_head(cache, layer, h)->len;
        if (!head_gran && len - budget > FEW_OVER)
            return false;
        total += len;
    }
    int worst[FEW_OVER], nw = 0;
    if (head_gran) { /* one pass over the layer's heads, as select_layer's: the same rows */
        int quota = budget * c->n_kv;
        if (total - quota > FEW_OVER)
            return false;
        if ((*rc = grow((void **)&c->rows, &c->rows_cap, total, sizeof *c->rows)))
            return true;
        for (int h = 0, base = 0; h < c->n_kv; h++) {
            const struct skv_kv_head *kh = skv_kv_cache_head(cache, layer, h);
            classify(c, cache, kh, h, w_obs < kh->len ? w_obs : kh->len, budget, c->rows + base);
            for (int j = 0; j < kh->len; j++)
                must[h] += c->rows[base + j].must;
            if (must[h] > budget)
                return false; /* capped first: select_layer's sort */
            base += kh->len;
        }
        nw = worst_rows(c->rows, total, total - quota, worst);
    }
    for (int h = 0; h < c->n_kv && !*rc; h++) {
        const struct skv_kv_head *kh = skv_kv_cache_head(cache, layer, h);
        int drop[FEW_OVER], nd = 0;
        if (!head_gran) {
            if (kh->len <= budget)
                continue;
            if ((*rc = grow((void **)&c->rows, &c->rows_cap, kh->len, sizeof *c->rows)))
                break;
            classify(c, cache, kh, h, w_obs < kh->len ? w_obs : kh->len, budget, c->rows);
            nw = worst_rows(c->rows, kh->len, kh->len - budget, worst);
        }
        for (int i = 0; i < nw; i++) { /* this head's, increasing */
            const struct row *r = &c->rows[worst[i]];
            if (r->head != h)
                continue;
            int at = nd++;
            for (; at > 0 && drop[at - 1] > r->idx; at--)
                drop[at] = drop[at - 1];
            drop[at] = r->idx;
        }
        if (nd)
            *rc = skv_kv_cache_drop_rows(cache, layer, h, drop, nd);
    }
    if (!*rc)
        *rc = skv_kv_cache_fit(cache, layer, slack);
    return true;
}

/* Keeps the chosen rows (sorted by head, then index) and compacts each head in place; each
 * head keeps room for `slack` more rows and gives the rest of its memory back. */
static int compact(struct skv_compressor *c, struct skv_kv_cache *cache, int layer, struct row *keep, int n_keep,
                   int slack, bool sorted)
{
    if (!sorted)
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
    return skv_kv_cache_fit(cache, layer, slack);
}

/* SnapKV's cut where its scores are (the backend): each head keeps its newest w_obs rows
 * (w_obs < budget) and topk_rows picks the rest among the older rows, per head or over the
 * layer's heads together; only the kept rows' indices come back. The same rows as the host
 * ordering below (by_keep_order) keeps. */
static int select_scored(struct skv_compressor *c, struct skv_kv_cache *cache, int layer, int budget, int w_obs,
                         int slack)
{
    bool joint = c->spec.granularity == SKV_GRAN_HEAD;
    int cand[SKV_MAX_KV_HEADS], cnt[SKV_MAX_KV_HEADS], k = joint ? budget * c->n_kv : budget - w_obs;
    for (int h = 0; h < c->n_kv; h++) {
        int len = skv_kv_cache_head(cache, layer, h)->len, w = w_obs < len ? w_obs : len;
        cand[h] = len - w;
        k -= joint ? w : 0;
    }
    struct skv_backend *be = c->be;
    int rc = be->ops->topk_rows(be, c->sel, cnt, c->scores, c->score_stride, cand, c->n_kv, k, joint);
    c->scored_layer = -1; /* the rows move now */
    int32_t *sel = c->sel;
    for (int h = 0; h < c->n_kv && !rc; h++) {
        int len = skv_kv_cache_head(cache, layer, h)->len, n_keep = cnt[h];
        if ((rc = grow((void **)&c->idx, &c->idx_cap, len + 1, sizeof *c->idx)))
            break;
        memcpy(c->idx, sel, (size_t)n_keep * sizeof *c->idx);
        for (int j = cand[h]; j < len; j++)
            c->idx[n_keep++] = j; /* the window, after every older kept row */
        sel += cnt[h];
        rc = skv_kv_cache_compact(cache, layer, h, c->idx, n_keep);
    }
    return rc ? rc : skv_kv_cache_fit(cache, layer, slack);
}

/* Cuts layer `layer` to `budget` rows per head (layer granularity) or budget * Hkv rows over
 * its heads (head granularity), by the rows' classification; slack as in compact(). SnapKV
 * right after layer_scores() selects on the backend; everything else sorts on the host. */
static int select_layer(struct skv_compressor *c, struct skv_kv_cache *cache, int layer, int budget, int w_obs,
                        int slack)
{
    int total = 0, over = 0;
    for (int h = 0; h < c->n_kv; h++) {
        int len = skv_kv_cache_head(cache, layer, h)->len;
        total += len;
        over |= len > budget;
    }
    bool head_gran = c->spec.granularity == SKV_GRAN_HEAD;
    /* in 64 bits: a decode budget grown under squeeze times many KV heads passes INT_MAX; past
     * here budget * n_kv < total fits */
    if (head_gran ? total <= (int64_t)budget * c->n_kv : !over)
        return SKV_OK;
    if (c->spec.policy == SKV_POLICY_SNAPKV && c->scored_layer == layer && w_obs < budget)
        return select_scored(c, cache, layer, budget, w_obs, slack);
    int rc = SKV_OK;
    if (drop_worst(c, cache, layer, budget, w_obs, slack, &rc))
        return rc;
    if ((rc = grow((void **)&c->rows, &c->rows_cap, total, sizeof *c->rows)))
        return rc;
    int n_keep = 0;
    bool sorted = !head_gran; /* the kept rows by head and index (no sort before compact) */
    if (!head_gran) {
        /* per head: classify into its own segment, and keep the best `budget` rows, moved to
         * the front in index order (segments only move towards the start, never over a later
         * head's): a few rows over (a decoded token's), the worst found in one pass; more,
         * by a sort */
        int base = 0;
        for (int h = 0; h < c->n_kv; h++) {
            const struct skv_kv_head *kh = skv_kv_cache_head(cache, layer, h);
            struct row *seg = c->rows + base;
            classify(c, cache, kh, h, w_obs < kh->len ? w_obs : kh->len, budget, seg);
            int k = kh->len < budget ? kh->len : budget;
            if (kh->len - k <= FEW_OVER) {
                k = keep_all_but_worst(seg, kh->len, kh->len - k, c->rows + n_keep);
            } else {
                qsort(seg, (size_t)kh->len, sizeof *seg, by_keep_order);
                qsort(seg, (size_t)k, sizeof *seg, by_head_idx);
                memmove(c->rows + n_keep, seg, (size_t)k * sizeof *seg);
            }
            n_keep += k;
            base += kh->len;
        }
    } else {
        /* one top-k over all heads of the layer (Ada-KV): each head's must-keep rows first
         * (at most budget per head), then the best scored rows of any head */
        int base = 0, quota = budget * c->n_kv;
        bool must_fit = true; /* no head has more must-keep rows than the per-head budget */
        for (int h = 0; h < c->n_kv; h++) {
            const struct skv_kv_head *kh = skv_kv_cache_head(cache, layer, h);
            classify(c, cache, kh, h, w_obs < kh->len ? w_obs : kh->len, budget, c->rows + base);
            int must = 0;
            for (int j = 0; j < kh->len; j++)
                must += c->rows[base + j].must;
            must_fit &= must <= budget;
            base += kh->len;
        }
        if (must_fit && base - quota <= FEW_OVER) /* a decoded token's: the worst in one pass */
            return compact(c, cache, layer, c->rows, keep_all_but_worst(c->rows, base, base - quota, c->rows), slack,
                           true);
        /* cap must-keep rows per head at the per-head budget */
        qsort(c->rows, (size_t)base, sizeof *c->rows, by_keep_order);
        int must_per_head[SKV_MAX_KV_HEADS] = {0};
        for (int i = 0; i < base; i++)
            if (c->rows[i].must && must_per_head[c->rows[i].head]++ >= budget)
                c->rows[i].must = 0, c->rows[i].key = -INFINITY;
        qsort(c->rows, (size_t)base, sizeof *c->rows, by_keep_order);
        n_keep = quota < base ? quota : base;
    }
    return compact(c, cache, layer, c->rows, n_keep, slack, sorted);
}

/* SnapKV's scores of layer `layer`: the attention of the queries q[q_first..nq) (those of the
 * newest nq rows) on every row, summed over the group's query heads (GQA mean or max), averaged
 * over the queries; the rows before the newest n_window pooled with the kernel (the window's
 * own rows keep their raw score: they are kept anyway). They stay on the backend for
 * select_scored(); SqueezeAttention's final trim (skv_compressor_finish) re-selects among the
 * kept rows on the host, so with it they are also copied into each head's score[]. */
static int snapkv_score(struct skv_compressor *c, struct skv_kv_cache *cache, int layer, const float *q, int nq,
                        int q_first, int n_window, int64_t max_rows)
{
    int rc = layer_scores(c, cache, layer, q, nq, q_first, max_rows, n_window, (float)(nq - q_first), NULL, 0);
    for (int h = 0; h < c->n_kv && !rc && c->spec.alloc == SKV_ALLOC_SQUEEZE; h++) {
        struct skv_kv_head *kh = skv_kv_cache_head(cache, layer, h);
        rc = c->be->ops->download(c->be, kh->score, c->scores + h * max_rows, (size_t)kh->len * sizeof(float));
    }
    return rc;
}

/* Copies the queries of positions [first, end) between the layer's ring (slot pos % obs_cap)
 * and a linear buffer `lin` whose row 0 is position `first`: into the ring when to_ring. */
static int obs_copy(struct skv_compressor *c, int layer, float *lin, int32_t first, int32_t end, bool to_ring)
{
    size_t row = (size_t)c->n_heads * c->head_dim;
    float *ring = c->obs_q + (size_t)layer * c->obs_cap * row;
    for (int32_t p = first; p < end;) {
        int slot = p % c->obs_cap, run = end - p < c->obs_cap - slot ? end - p : c->obs_cap - slot;
        float *r = ring + (size_t)slot * row, *x = lin + (size_t)(p - first) * row;
        int rc = to_ring ? c->be->ops->copy_2d(c->be, r, row * sizeof(float), x, row * sizeof(float),
                                               row * sizeof(float), run)
                         : c->be->ops->copy_2d(c->be, x, row * sizeof(float), r, row * sizeof(float),
                                               row * sizeof(float), run);
        if (rc)
            return rc;
        p += run;
    }
    return SKV_OK;
}

/* SnapKV's re-scoring of layer l (its longest head max_rows rows) with the queries the ring
 * holds: the newest min(window, decode_budget, D_l) observed ones score every row and the layer
 * keeps D_l rows per head (D_l * Hkv over its heads, head granularity), those window rows always. */
static int snapkv_decode_cut(struct skv_compressor *c, struct skv_kv_cache *cache, int l, int64_t max_rows)
{
    int budget = c->layer_budget[l], rc;
    int32_t end = c->obs_end, seen = end - c->obs_from; /* the queries there are */
    int w_keep = c->obs_cap < budget ? c->obs_cap : budget; /* min(window, decode_budget, this layer's) */
    int w_q = seen < w_keep ? seen : w_keep;
    if (budget > w_keep) { /* else the window is all that stays: no scores needed */
        if ((rc = obs_copy(c, l, c->obs_win, end - w_q, end, false)) ||
            (rc = snapkv_score(c, cache, l, c->obs_win, w_q, 0, w_keep, max_rows)))
            return rc;
    }
    int slack = c->spec.interval < budget ? c->spec.interval : budget; /* room for the next interval's rows */
    return select_layer(c, cache, l, budget, w_keep, slack);
}

/* SnapKV while decoding: remember the newest queries; when this forward completes another
 * `interval` decoded tokens and the layer holds more than its decode budget D_l rows per head
 * (or D_l * Hkv over its heads, head granularity), re-score every row with the newest window's
 * queries exactly as a prefill does and keep D_l, the newest window (min(window,
 * decode_budget, D_l) rows) always. The window's queries are those of decoded tokens
 * only, so right after a compression it is shorter than `window` (down to one query). */
static int snapkv_decode_hook(struct skv_compressor *c, const struct skv_layer_view *v)
{
    const struct skv_compress_spec *s = &c->spec;
    int l = v->layer, budget = c->layer_budget[l];
    int32_t start = v->cache->n_past, end = start + v->n;
    int rc = obs_alloc(c);
    if (rc)
        return rc;
    int32_t first = end - c->obs_cap > start ? end - c->obs_cap : start;
    size_t row = (size_t)c->n_heads * c->head_dim;
    c->obs_end = end; /* first: a copy that fails part way has written over slots too (obs_as_of) */
    if ((rc = obs_copy(c, l, (float *)v->q + (size_t)(first - start) * row, first, end, true)))
        return rc;
    int32_t before = start - c->obs_start, seen = end - c->obs_start;
    if (before / s->interval == seen / s->interval)
        return SKV_OK; /* no re-scoring in this forward */
    int64_t max_rows = 0, total = 0;
    bool over = false;
    for (int h = 0; h < c->n_kv; h++) {
        int len = skv_kv_cache_head(v->cache, l, h)->len;
        max_rows = len > max_rows ? len : max_rows;
        total += len;
        over |= len > budget;
    }
    if (s->granularity == SKV_GRAN_HEAD ? total <= (int64_t)budget * c->n_kv : !over)
        return SKV_OK;
    if (c->defer) { /* the re-scoring at the forward's end (skv_compressor_hook_done) */
        c->pend_rows[l] = max_rows;
        c->pend[l] = 1;
        return SKV_OK;
    }
    return snapkv_decode_cut(c, v->cache, l, max_rows);
}

/* H2O: the attention a forward's queries gave each row of layer l (agg [n_kv][rows]) added to
 * the rows' scores; rows scored before already count these queries. */
static void h2o_add_scores(struct skv_compressor *c, struct skv_kv_cache *cache, int l, const float *agg, int64_t rows)
{
    for (int h = 0; h < c->n_kv; h++) {
        struct skv_kv_head *kh = skv_kv_cache_head(cache, l, h);
        for (int j = 0; j < kh->len; j++)
            if (kh->pos[j] >= c->score_from)
                kh->score[j] += agg[h * rows + j];
    }
}

bool skv_compressor_wants_probs(const struct skv_compressor *c)
{
    return c && c->spec.policy == SKV_POLICY_H2O;
}

int skv_compressor_begin_step(struct skv_compressor *c, struct skv_kv_cache *cache, int n, bool defer,
                              struct skv_forward_opts *fo)
{
    fo->hook = skv_compressor_hook;
    fo->hook_user = c;
    fo->attention_probs = skv_compressor_wants_probs(c);
    fo->done = skv_compressor_hook_done;
    fo->done_user = c;
    int rc = skv_compressor_begin_decode(c, cache);
    return rc ? rc : skv_compressor_decode_reserve(c, cache, n, defer);
}

void skv_compressor_hook_done(void *user, struct skv_kv_cache *cache)
{
    struct skv_compressor *c = user;
    if (!c || !c->pend)
        return;
    const struct skv_compress_spec *s = &c->spec;
    for (int l = 0; l < c->n_layers; l++) {
        if (!c->pend[l])
            continue;
        c->pend[l] = 0;
        /* a cut that fails (no memory for fresh blocks, a device error) leaves the layer over
         * its budget, valid (whole, or some of its heads cut): a later one cuts it */
        if (rescores_decode(s)) {
            c->cut_failures += snapkv_decode_cut(c, cache, l, c->pend_rows[l]) != SKV_OK;
            continue;
        }
        if (s->policy == SKV_POLICY_H2O)
            h2o_add_scores(c, cache, l, c->pend_agg + (size_t)l * c->n_kv * c->pend_stride, c->pend_rows[l]);
        int w_obs = s->policy == SKV_POLICY_H2O || s->window < c->pend_n ? s->window : c->pend_n;
        c->cut_failures += select_layer(c, cache, l, c->layer_budget[l], w_obs, COMPACT_SLACK) != SKV_OK;
    }
}

int skv_compressor_take_cut_failures(struct skv_compressor *c)
{
    int n = c->cut_failures;
    c->cut_failures = 0;
    return n;
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
    if (c->decode && rescores_decode(s))
        return snapkv_decode_hook(c, v);
    if (budget <= 0)
        return SKV_OK; /* snapkv decode without a decode budget */
    int64_t max_rows = 0;
    bool over = false;
    for (int h = 0; h < c->n_kv; h++) {
        int len = skv_kv_cache_head(v->cache, l, h)->len;
        max_rows = len > max_rows ? len : max_rows;
        over |= len > budget;
    }
    int w_obs = s->window < v->n ? s->window : v->n;
    if (c->decode && c->defer && s->policy != SKV_POLICY_SNAPKV) {
        /* deferred: this layer's scores now (the queries are this forward's), the cut at the
         * forward's end (skv_compressor_hook_done) */
        if (s->policy == SKV_POLICY_H2O) {
            if (max_rows > c->pend_stride)
                return skv_errorf(SKV_E_INTERNAL, "H2O upkeep: %lld rows past the %lld reserved",
                                  (long long)max_rows, (long long)c->pend_stride);
            int rc = layer_scores(c, v->cache, l, v->q, v->n, 0, max_rows, -1, 1.0f, v->probs, v->probs_stride);
            if (!rc)
                rc = c->be->ops->download(c->be, c->pend_agg + (size_t)l * c->n_kv * c->pend_stride, c->scores,
                                          (size_t)(max_rows * c->n_kv) * sizeof(float));
            if (rc)
                return rc;
        }
        c->pend_rows[l] = max_rows;
        c->pend_n = v->n;
        c->pend[l] = 1;
        return SKV_OK;
    }
    if (s->policy == SKV_POLICY_H2O) {
        /* accumulated attention of every query so far; recent window kept */
        int rc = layer_scores(c, v->cache, l, v->q, v->n, 0, max_rows, -1, 1.0f, v->probs, v->probs_stride);
        if (!rc)
            rc = c->be->ops->download(c->be, c->agg, c->scores, (size_t)(max_rows * c->n_kv) * sizeof(float));
        if (rc)
            return rc;
        w_obs = s->window;
        h2o_add_scores(c, v->cache, l, c->agg, max_rows);
    } else if (s->policy == SKV_POLICY_SNAPKV && (over || s->alloc == SKV_ALLOC_SQUEEZE)) {
        /* squeeze: finish() may cut a layer that fits its capped budget now: score it too */
        int rc = snapkv_score(c, v->cache, l, v->q, v->n, v->n - w_obs, w_obs, max_rows);
        if (rc)
            return rc;
    }
    return select_layer(c, v->cache, l, budget, w_obs, COMPACT_SLACK);
}

int skv_compressor_finish(struct skv_compressor *c, struct skv_kv_cache *cache)
{
    if (c->spec.policy == SKV_POLICY_FULL || c->spec.alloc != SKV_ALLOC_SQUEEZE || c->decode)
        return SKV_OK;
    int *final = malloc((size_t)c->n_layers * sizeof *final);
    if (!final)
        return SKV_E_NOMEM;
    /* every layer holds its capped upper bound (min(4 B, prompt)); allocating under that cap
     * in one pass shares what a capped layer cannot hold evenly (within one row) among the
     * layers below it, so no final budget exceeds what its layer holds */
    int lim = c->layer_budget[0];
    for (int l = 1; l < c->n_layers; l++)
        lim = c->layer_budget[l] < lim ? c->layer_budget[l] : lim;
    skv_squeeze_budgets(c->sim, c->n_layers, c->budget, kept_window(&c->spec), c->spec.p, lim, final);
    int rc = SKV_OK;
    /* the rows the hook kept as its window: H2O's recent window is always `window` rows */
    int w_obs = c->spec.policy == SKV_POLICY_H2O || c->spec.window < c->batch ? c->spec.window : c->batch;
    for (int l = 0; l < c->n_layers && !rc; l++) {
        c->layer_budget[l] = final[l];
        rc = select_layer(c, cache, l, final[l], w_obs, COMPACT_SLACK);
    }
    free(final);
    return rc;
}
