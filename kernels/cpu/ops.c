/* CPU elementwise and per-row ops: rmsnorm, rope (NORM / NEOX, linear and Llama 3 scaling,
 * frequency factors), swiglu, add, row_logprobs and row_top_logprobs. Rows or tokens are
 * independent, so results do not depend on the thread count. Large calls are split over the
 * backend's pool. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/status.h"
#include "kernels/cpu/cpu.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "kernels/cpu/vexp.h"
#endif

/* Elements one parallel_for chunk should at least cover before splitting pays off. */
#define OPS_GRAIN_ELEMS 16384

/* ---- vector helpers --------------------------------------------------------------- */

#if defined(__AVX2__) && defined(__FMA__)
/* Sum of squares with the products and the sum in double. */
static double sum_squares(const float *x, int n)
{
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
        __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        a0 = _mm256_fmadd_pd(lo, lo, a0);
        a1 = _mm256_fmadd_pd(hi, hi, a1);
    }
    __m256d a = _mm256_add_pd(a0, a1);
    __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    double s = _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
    for (; i < n; i++)
        s += (double)x[i] * x[i];
    return s;
}

/* o[i] = x[i] * s * w[i]; o may alias x. */
static void scale_mul(float *o, const float *x, float s, const float *w, int n)
{
    const __m256 sv = _mm256_set1_ps(s);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), sv),
                                              _mm256_loadu_ps(w + i)));
    for (; i < n; i++)
        o[i] = x[i] * s * w[i];
}

/* o[i] = a[i] + b[i]; o may alias a or b. */
static void add_vec(float *o, const float *a, const float *b, int64_t begin, int64_t end)
{
    int64_t i = begin;
    for (; i + 8 <= end; i += 8)
        _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    for (; i < end; i++)
        o[i] = a[i] + b[i];
}

static __m256 swiglu8(__m256 gv, __m256 uv)
{
    /* e^-g = 2^(-g log2 e); below 2^-126 the term is 0 and silu(g) = g */
    const __m256 e = skv_exp2_ps(_mm256_mul_ps(gv, _mm256_set1_ps(-1.44269504088896341f)));
    return _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), uv);
}

/* o[i] = silu(g[i]) * u[i] = g[i] / (1 + e^-g[i]) * u[i]; o may alias g. The tail goes through
 * the same lanes (padded), so an element's value does not depend on where a row or a thread's
 * share begins: a session decoded alone or in a batch gets the same bits. */
static void swiglu_vec(float *o, const float *g, const float *u, int64_t begin, int64_t end)
{
    int64_t i = begin;
    for (; i + 8 <= end; i += 8)
        _mm256_storeu_ps(o + i, swiglu8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < end) {
        float gt[8] = {0}, ut[8] = {0}, ot[8];
        memcpy(gt, g + i, (size_t)(end - i) * sizeof *gt);
        memcpy(ut, u + i, (size_t)(end - i) * sizeof *ut);
        _mm256_storeu_ps(ot, swiglu8(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut)));
        memcpy(o + i, ot, (size_t)(end - i) * sizeof *ot);
    }
}
#else
static double sum_squares(const float *x, int n)
{
    double s = 0.0;
    for (int i = 0; i < n; i++)
        s += (double)x[i] * x[i];
    return s;
}

static void scale_mul(float *o, const float *x, float s, const float *w, int n)
{
    for (int i = 0; i < n; i++)
        o[i] = x[i] * s * w[i];
}

static void add_vec(float *o, const float *a, const float *b, int64_t begin, int64_t end)
{
    for (int64_t i = begin; i < end; i++)
        o[i] = a[i] + b[i];
}

static void swiglu_vec(float *o, const float *g, const float *u, int64_t begin, int64_t end)
{
    for (int64_t i = begin; i < end; i++)
        o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}
#endif

/* ---- rmsnorm ---------------------------------------------------------------------- */

struct rmsnorm_args {
    float *out;
    const float *x, *w;
    int dim;
    float eps;
};

static void rmsnorm_rows(void *p, int64_t begin, int64_t end, int tid)
{
    const struct rmsnorm_args *a = p;
    const int dim = a->dim;
    (void)tid;
    for (int64_t r = begin; r < end; r++) {
        const float *x = a->x + r * dim;
        float *o = a->out + r * dim;
        const float s = (float)(1.0 / sqrt(sum_squares(x, dim) / dim + (double)a->eps));
        scale_mul(o, x, s, a->w, dim);
    }
}

int skv_cpu_rmsnorm(struct skv_backend *be, float *out, const float *x, const float *w, int n,
                    int dim, float eps)
{
    if (n < 0 || dim <= 0 || !(eps >= 0.0f))
        return skv_errorf(SKV_E_INVAL, "rmsnorm: bad shape n=%d dim=%d eps=%g", n, dim,
                          (double)eps);
    if (n == 0)
        return SKV_OK;
    if (!out || !x || !w)
        return skv_errorf(SKV_E_INVAL, "rmsnorm: NULL buffer");
    struct rmsnorm_args a = {.out = out, .x = x, .w = w, .dim = dim, .eps = eps};
    int64_t grain = OPS_GRAIN_ELEMS / dim + 1;
    skv_cpu_parallel_for(be, n, grain, rmsnorm_rows, &a);
    return SKV_OK;
}

/* ---- rope ------------------------------------------------------------------------- */

struct rope_args {
    float *x;
    const int32_t *pos;
    int n_heads, head_dim, rot_dim, mode;
    double freq_scale;
    double inv_freq[SKV_ROPE_MAX_DIM / 2];  /* per rotated pair, scaling applied */
};

static void rope_tokens(void *p, int64_t begin, int64_t end, int tid)
{
    const struct rope_args *a = p;
    const int half = a->rot_dim / 2, hd = a->head_dim;
    /* NORM rotates (x[2j], x[2j+1]); NEOX rotates (x[j], x[j + half]). */
    const int stride = a->mode == SKV_ROPE_NEOX ? 1 : 2;
    const int other = a->mode == SKV_ROPE_NEOX ? half : 1;
    float c[SKV_ROPE_MAX_DIM / 2], s[SKV_ROPE_MAX_DIM / 2];
    (void)tid;

    for (int64_t t = begin; t < end; t++) {
        const double p_scaled = (double)a->pos[t] * a->freq_scale;
        for (int j = 0; j < half; j++) {
            const double ang = p_scaled * a->inv_freq[j];
            c[j] = (float)cos(ang);
            s[j] = (float)sin(ang);
        }
        for (int h = 0; h < a->n_heads; h++) {
            float *x = a->x + (t * a->n_heads + h) * (int64_t)hd;
            for (int j = 0; j < half; j++) {
                float *x0 = x + j * stride, *x1 = x0 + other;
                const float v0 = *x0, v1 = *x1;
                *x0 = v0 * c[j] - v1 * s[j];
                *x1 = v0 * s[j] + v1 * c[j];
            }
        }
    }
}


int skv_cpu_rope(struct skv_backend *be, float *x, int n, int n_heads, int head_dim,
                 const int32_t *pos, const struct skv_rope *rope)
{
    if (n < 0 || n_heads <= 0 || head_dim <= 0 || !rope)
        return skv_errorf(SKV_E_INVAL, "rope: bad shape n=%d heads=%d head_dim=%d", n,
                          n_heads, head_dim);
    int rc = skv_rope_check(rope, head_dim);
    if (rc < 0)
        return rc;
    if (n == 0)
        return SKV_OK;
    if (!x || !pos)
        return skv_errorf(SKV_E_INVAL, "rope: NULL buffer");

    struct rope_args a = {
        .x = x,
        .pos = pos,
        .n_heads = n_heads,
        .head_dim = head_dim,
        .rot_dim = rope->rot_dim,
        .mode = rope->mode,
        .freq_scale = rope->freq_scale,
    };
    skv_rope_inv_freq(rope, rope->rot_dim / 2, a.inv_freq);
    int64_t grain = OPS_GRAIN_ELEMS / ((int64_t)n_heads * head_dim + rope->rot_dim * 8) + 1;
    skv_cpu_parallel_for(be, n, grain, rope_tokens, &a);
    return SKV_OK;
}

/* ---- swiglu, add ------------------------------------------------------------------ */

struct binary_args {
    float *out;
    const float *a, *b;
};

static void swiglu_range(void *p, int64_t begin, int64_t end, int tid)
{
    const struct binary_args *a = p;
    (void)tid;
    swiglu_vec(a->out, a->a, a->b, begin, end);
}

static void add_range(void *p, int64_t begin, int64_t end, int tid)
{
    const struct binary_args *a = p;
    (void)tid;
    add_vec(a->out, a->a, a->b, begin, end);
}

int skv_cpu_swiglu(struct skv_backend *be, float *out, const float *gate, const float *up,
                   int64_t count)
{
    if (count < 0)
        return skv_errorf(SKV_E_INVAL, "swiglu: count %lld", (long long)count);
    if (count == 0)
        return SKV_OK;
    if (!out || !gate || !up)
        return skv_errorf(SKV_E_INVAL, "swiglu: NULL buffer");
    struct binary_args a = {.out = out, .a = gate, .b = up};
    skv_cpu_parallel_for(be, count, OPS_GRAIN_ELEMS, swiglu_range, &a);
    return SKV_OK;
}

int skv_cpu_add(struct skv_backend *be, float *out, const float *a, const float *b,
                int64_t count)
{
    if (count < 0)
        return skv_errorf(SKV_E_INVAL, "add: count %lld", (long long)count);
    if (count == 0)
        return SKV_OK;
    if (!out || !a || !b)
        return skv_errorf(SKV_E_INVAL, "add: NULL buffer");
    struct binary_args args = {.out = out, .a = a, .b = b};
    skv_cpu_parallel_for(be, count, 4 * OPS_GRAIN_ELEMS, add_range, &args);
    return SKV_OK;
}

/* ---- row_logprobs ----------------------------------------------------------------- */

struct logprob_args {
    float *out;
    int32_t *top;
    const float *x;
    const int32_t *targets;
    int n_vocab;
    int k;       /* row_top_logprobs: the list's length, with ids and lps [n][k] */
    int32_t *ids;
    float *lps;
};

/* The largest of n logits (a NaN never is). */
static float row_max(const float *x, int n)
{
    float mx = -INFINITY;
    int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8)
        m = _mm256_max_ps(_mm256_loadu_ps(x + i), m); /* a NaN in the first operand gives the second */
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    for (int k = 0; k < 8; k++)
        mx = lanes[k] > mx ? lanes[k] : mx;
#endif
    for (; i < n; i++)
        mx = x[i] > mx ? x[i] : mx;
    return mx;
}

/* sum exp(x - mx) over n logits, mx their largest (finite); a NaN or -inf adds 0. The
 * exponentials in single precision (skv_exp2_ps), summed in lanes that go into a double every
 * 1024 logits. */
static double sum_exp(const float *x, int n, float mx)
{
    double s = 0;
    int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 m = _mm256_set1_ps(mx), log2e = _mm256_set1_ps(1.4426950408889634f);
    while (i + 8 <= n) {
        __m256 acc = _mm256_setzero_ps();
        for (int end = i + 1024 < n ? i + 1024 : n; i + 8 <= end; i += 8) /* NaN, -inf: exp2 gives 0 */
            acc = _mm256_add_ps(acc, skv_exp2_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), m), log2e)));
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        for (int k = 0; k < 8; k++)
            s += lanes[k];
    }
#endif
    for (; i < n; i++)
        s += isnan(x[i]) ? 0.0 : exp((double)x[i] - mx);
    return s;
}

#define RANK_KEY(v) (isnan(v) ? -INFINITY : (v))

/* Puts j in ids[0..at] at its place, the ranked ones below it moved down one (the last drops). */
static inline void rank_insert(const float *x, int32_t *ids, int at, int32_t j)
{
    const float v = RANK_KEY(x[j]);
    for (; at > 0 && RANK_KEY(x[ids[at - 1]]) < v; at--)
        ids[at] = ids[at - 1];
    ids[at] = j;
}

/* x's k largest (k in [1, n]) into ids, largest first, equal ones by the lower id, a NaN as
 * -inf: the first k in order, then each later one larger than the smallest kept is put in its
 * place (8 at a time compared with that smallest where AVX2 is). */
static void rank_top(const float *x, int n, int k, int32_t *ids)
{
    int i = 0;
    for (; i < k; i++) /* each after the equal ones before it */
        rank_insert(x, ids, i, i);
    float low = RANK_KEY(x[ids[k - 1]]);
#if defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8) /* NaN compares false: never above */
        if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(low), _CMP_GT_OQ)))
            for (int j = i; j < i + 8; j++)
                if (x[j] > low) {
                    rank_insert(x, ids, k - 1, j);
                    low = RANK_KEY(x[ids[k - 1]]);
                }
#endif
    for (; i < n; i++)
        if (x[i] > low) {
            rank_insert(x, ids, k - 1, i);
            low = RANK_KEY(x[ids[k - 1]]);
        }
}

static void logprob_rows(void *p, int64_t begin, int64_t end, int tid)
{
    const struct logprob_args *a = p;
    const int nv = a->n_vocab, k = a->k;
    (void)tid;
    for (int64_t r = begin; r < end; r++) {
        const float *x = a->x + r * nv;
        const float mx = row_max(x, nv);
        if (a->top) { /* the first logit equal to the largest (0: every one NaN) */
            int at = 0;
            while (at < nv && !(x[at] == mx))
                at++;
            a->top[r] = at < nv ? at : 0;
        }
        /* each logit's log-probability from the row's log-sum-exp */
        int n_inf = 0;
        double lse = 0;
        if (mx == INFINITY) { /* the +inf logits share the mass */
            for (int i = 0; i < nv; i++)
                n_inf += x[i] == INFINITY;
        } else if (mx > -INFINITY) {
            lse = (double)mx + log(sum_exp(x, nv, mx));
        }
#define ROW_LP(v) (n_inf ? ((v) == INFINITY ? (float)-log((double)n_inf) : -INFINITY) \
                         : mx == -INFINITY || isnan(v) ? -INFINITY : (float)((double)(v) - lse))
        a->out[r] = ROW_LP(x[a->targets[r]]);
        if (k) {
            int32_t *ids = a->ids + r * k;
            rank_top(x, nv, k, ids);
            for (int j = 0; j < k; j++)
                a->lps[r * k + j] = ROW_LP(x[ids[j]]);
        }
#undef ROW_LP
    }
}

/* The row ops' arguments: the shape, the buffers (none needed for no rows), each target in the
 * vocabulary. */
static int check_rows(const char *op, const float *out, const float *logits, const int32_t *targets, int n,
                      int n_vocab)
{
    if (n < 0 || n_vocab <= 0)
        return skv_errorf(SKV_E_INVAL, "%s: bad shape n=%d n_vocab=%d", op, n, n_vocab);
    if (n && (!out || !logits || !targets))
        return skv_errorf(SKV_E_INVAL, "%s: NULL buffer", op);
    for (int r = 0; r < n; r++)
        if (targets[r] < 0 || targets[r] >= n_vocab)
            return skv_errorf(SKV_E_INVAL, "%s: target %d of row %d is outside [0, %d)", op, targets[r], r, n_vocab);
    return SKV_OK;
}

int skv_cpu_row_logprobs(struct skv_backend *be, float *out, int32_t *top, const float *logits,
                         const int32_t *targets, int n, int n_vocab)
{
    int rc = check_rows("row_logprobs", out, logits, targets, n, n_vocab);
    if (rc || n == 0)
        return rc;
    struct logprob_args a = {.out = out, .top = top, .x = logits, .targets = targets, .n_vocab = n_vocab};
    skv_cpu_parallel_for(be, n, 1, logprob_rows, &a);
    return SKV_OK;
}

int skv_cpu_row_top_logprobs(struct skv_backend *be, float *out, int32_t *ids, float *lps, int k, const float *logits,
                             const int32_t *targets, int n, int n_vocab)
{
    if (k < 1 || k > n_vocab || !ids || !lps)
        return skv_errorf(SKV_E_INVAL, "row_top_logprobs: %d most likely of %d, or no arrays for them", k, n_vocab);
    int rc = check_rows("row_top_logprobs", out, logits, targets, n, n_vocab);
    if (rc || n == 0)
        return rc;
    struct logprob_args a = {.out = out, .x = logits, .targets = targets, .n_vocab = n_vocab, .k = k, .ids = ids,
                             .lps = lps};
    skv_cpu_parallel_for(be, n, 1, logprob_rows, &a);
    return SKV_OK;
}
