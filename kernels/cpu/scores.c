/* The CPU backend's compression math: attention column sums (SnapKV's observation window,
 * H2O's accumulated attention), their reduction over each GQA group with SnapKV's pooling,
 * the top-k of rows by score, the mean residual cosine (SqueezeAttention) and the row
 * copies that compact a paged cache. */
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

#include <stdatomic.h>
#include "kernels/cpu/cpu.h"

struct colsum_job {
    float *out;
    int64_t out_stride;
    const float *q;
    int n, n_heads, group, head_dim, q_first;
    const struct skv_kv_view *kv;
    struct skv_backend *be;
    atomic_int status;         /* SKV_OK, or the first failure (set by any worker) */
};

/* Row j of KV head kvh's keys as f32: the widened copy (f16 / q8_0 rows, keys != NULL, row lo0
 * first) or the view's own row. */
static inline const float *key_row(const struct colsum_job *job, int kvh, const float *keys, int lo0, int j)
{
    return keys ? keys + (size_t)(j - lo0) * job->head_dim : skv_kv_view_row(job->kv, kvh, 0, j);
}

/* The column sums score queries in chunks of at most this many together, each 8-row block of
 * keys read once for all of them (it stays in L1; a query at a time streamed every key row
 * from L3 again: 1032 rows x 3 KV heads of SmolLM2 do not fit L2), and a chunk's scores take
 * at most COLSUM_CHUNK_FLOATS floats a thread (one query's row at the least). */
#define COLSUM_QUERIES 32
#define COLSUM_CHUNK_FLOATS (1 << 20)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "kernels/cpu/vdot.h"
#include "kernels/cpu/vexp.h"

static float hmax8(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* One query's dot products s[j - base] for its rows j in [lo, seen), of the 8-row blocks
 * starting at base: become exp(scale * dot - max), the blocks' rows outside [lo, seen) 0 (in
 * base 2, scaled by log2 e, for the vector exp2); returns 1 / their sum (summed in double). */
static float row_exp(float *s, int base, int lo, int seen, float scale)
{
    const __m256 vscale = _mm256_set1_ps(scale * 1.4426950408889634f), ninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i before = _mm256_set1_epi32(lo - 1), end = _mm256_set1_epi32(seen);
    const int b0 = base + ((lo - base) & ~7);
    __m256 mx = ninf;
    for (int j = b0; j < seen; j += 8) {
        const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(j), lane);
        const __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(idx, before), _mm256_cmpgt_epi32(end, idx));
        const __m256 v = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(s + j - base), vscale),
                                          _mm256_castsi256_ps(in));
        _mm256_storeu_ps(s + j - base, v);
        mx = _mm256_max_ps(mx, v);
    }
    const __m256 m = _mm256_set1_ps(hmax8(mx));
    __m256d sum_lo = _mm256_setzero_pd(), sum_hi = sum_lo;
    for (int j = b0; j < seen; j += 8) {
        const __m256 e = skv_exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j - base), m)); /* exp2(-inf) = 0 */
        _mm256_storeu_ps(s + j - base, e);
        sum_lo = _mm256_add_pd(sum_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        sum_hi = _mm256_add_pd(sum_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    double sum[4];
    _mm256_storeu_pd(sum, _mm256_add_pd(sum_lo, sum_hi));
    return (float)(1.0 / ((sum[0] + sum[1]) + (sum[2] + sum[3])));
}
#else
static void dot8(const float *q, const float *const *k, int d, float *s)
{
    for (int j = 0; j < 8; j++) {
        s[j] = 0;
        for (int t = 0; t < d; t++)
            s[j] += q[t] * k[j][t];
    }
}

static float row_exp(float *s, int base, int lo, int seen, float scale)
{
    float mx = -INFINITY;
    for (int j = lo; j < seen; j++) {
        s[j - base] *= scale;
        mx = s[j - base] > mx ? s[j - base] : mx;
    }
    double sum = 0;
    for (int j = lo; j < seen; j++)
        sum += (s[j - base] = expf(s[j - base] - mx));
    return (float)(1.0 / sum);
}
#endif

/* One query head per task item: probabilities of each query in the window, summed (keys
 * outside a query's sliding window get 0 from it, as in attention). */
static void colsum_task(void *arg, int64_t begin, int64_t end, int thread_id)
{
    struct colsum_job *job = arg;
    const int d = job->head_dim;
    const float scale = 1.0f / sqrtf((float)d);
    for (int64_t h = begin; h < end; h++) {
        int kvh = (int)h / job->group;
        int prefix = job->kv->prefix_len[kvh];
        int n_keys = prefix + job->n;
        float *out = job->out + h * job->out_stride;
        /* the chunk's scores, a query's row of blocks from its chunk's first row; then, for f16
         * or q8_0 rows, the keys the queries see widened to f32 once */
        const bool wide_rows = job->kv->kv_type != SKV_DTYPE_F32;
        const int lo0 = skv_kv_view_first(job->kv, kvh, job->q_first); /* no later query sees before */
        const size_t stride = ((size_t)(n_keys - lo0) + 7) & ~(size_t)7;
        size_t qc = COLSUM_CHUNK_FLOATS / stride, nq = (size_t)(job->n - job->q_first);
        qc = qc < 1 ? 1 : qc > COLSUM_QUERIES ? COLSUM_QUERIES : qc;
        qc = qc < nq ? qc : nq; /* (a decode step's one query: one row) */
        const size_t wide = wide_rows ? (size_t)(n_keys - lo0) * d : 0;
        float *sc = skv_cpu_scratch(job->be, thread_id, (qc * stride + wide) * sizeof(float));
        if (!sc) {
            atomic_store(&job->status, SKV_E_NOMEM); /* every writer stores the same value */
            return;
        }
        float *keys = wide_rows ? sc + qc * stride : NULL; /* f16 / q8_0: row j at keys + (j - lo0) * d */
        for (int j = lo0; wide_rows && j < n_keys; j++)
            skv_cpu_kv_widen(keys + (size_t)(j - lo0) * d, skv_kv_view_row_raw(job->kv, kvh, 0, j), job->kv->kv_type,
                             d);
        memset(out, 0, (size_t)n_keys * sizeof *out);
        for (int i0 = job->q_first; i0 < job->n; i0 += (int)qc) {
            const int i1 = i0 + (int)qc < job->n ? i0 + (int)qc : job->n, seen_max = prefix + i1;
            int lo[COLSUM_QUERIES], base = INT_MAX;
            for (int i = i0; i < i1; i++) {
                lo[i - i0] = skv_kv_view_first(job->kv, kvh, i);
                base = lo[i - i0] < base ? lo[i - i0] : base;
            }
            /* query i's dot product with row j at sc[(i - i0) * stride + j - base], for the
             * 8-row blocks (from base) that hold one of its rows [lo, prefix + i + 1) */
            for (int j = base; j < seen_max; j += 8) {
                const float *k8[8];
                for (int t = 0; t < 8; t++) /* past seen_max: row j again, masked by row_exp */
                    k8[t] = key_row(job, kvh, keys, lo0, j + t < seen_max ? j + t : j);
                for (int i = j - prefix > i0 ? j - prefix : i0; i < i1; i++)
                    if (j + 8 > lo[i - i0])
                        dot8(job->q + ((size_t)i * job->n_heads + (size_t)h) * d, k8, d,
                             sc + (size_t)(i - i0) * stride + (j - base));
            }
            for (int i = i0; i < i1; i++) {
                float *s = sc + (size_t)(i - i0) * stride;
                const int seen = prefix + i + 1;
                const float inv = row_exp(s, base, lo[i - i0], seen, scale);
                for (int j = lo[i - i0]; j < seen; j++)
                    out[j] += s[j - base] * inv;
            }
        }
    }
}

int skv_cpu_attention_colsum(struct skv_backend *be, float *out, int64_t out_stride, const float *q,
                             int n, int n_heads, const struct skv_kv_view *kv, int q_first)
{
    if (!be || !out || !q || !kv || n <= 0 || n_heads <= 0 || kv->n_kv_heads <= 0 ||
        kv->n_kv_heads > SKV_MAX_KV_HEADS || n_heads % kv->n_kv_heads || q_first < 0 || q_first >= n)
        return skv_errorf(SKV_E_INVAL, "attention_colsum: bad shape");
    if (skv_kv_row_bytes(kv->kv_type, kv->head_dim) == 0)
        return skv_errorf(SKV_E_UNSUPPORTED, "attention_colsum: kv type %d of head_dim %d (f32, f16, q8_0 of a "
                          "multiple of 32)", kv->kv_type, kv->head_dim);
    int rc = skv_kv_view_check_window(kv, "attention_colsum");
    if (!rc)
        rc = skv_kv_view_check_rows(kv, "attention_colsum");
    if (rc)
        return rc;
    for (int h = 0; h < kv->n_kv_heads; h++)
        if (kv->prefix_len[h] < 0 || kv->prefix_len[h] > INT_MAX - 8 - n || kv->prefix_len[h] + n > out_stride)
            return skv_errorf(SKV_E_INVAL, "attention_colsum: output row too short (or rows past INT_MAX - 8)");
    struct colsum_job job = {
        .out = out, .out_stride = out_stride, .q = q, .n = n, .n_heads = n_heads,
        .group = n_heads / kv->n_kv_heads, .head_dim = kv->head_dim, .q_first = q_first, .kv = kv, .be = be,
    };
    atomic_init(&job.status, SKV_OK);
    skv_cpu_parallel_tasks(be, n_heads, colsum_task, &job); /* (heads of unequal lengths) */
    return atomic_load(&job.status);
}

int skv_cpu_cosine_mean(struct skv_backend *be, float *out, const float *a, const float *b, int n, int dim)
{
    (void)be;
    if (!out || !a || !b || n <= 0 || dim <= 0)
        return skv_errorf(SKV_E_INVAL, "cosine_mean: bad shape");
    double total = 0;
    for (int i = 0; i < n; i++) {
        const float *x = a + (size_t)i * dim, *y = b + (size_t)i * dim;
        double xy = 0, xx = 0, yy = 0;
        for (int j = 0; j < dim; j++) {
            xy += (double)x[j] * y[j];
            xx += (double)x[j] * x[j];
            yy += (double)y[j] * y[j];
        }
        double den = sqrt(xx) * sqrt(yy);
        total += den > 0 ? xy / den : 0;
    }
    *out = (float)(total / n);
    return SKV_OK;
}

int skv_cpu_copy_rows(struct skv_backend *be, void *const *dst, const void *const *src, size_t row_bytes, int n)
{
    (void)be;
    if (n < 0 || (n > 0 && (!dst || !src)))
        return skv_errorf(SKV_E_INVAL, "copy_rows: bad arguments");
    for (int i = 0; i < n; i++)
        if (!dst[i] || !src[i])
            return skv_errorf(SKV_E_INVAL, "copy_rows: row %d has no %s", i, dst[i] ? "source" : "destination");
    for (int i = 0; i < n; i++)
        memcpy(dst[i], src[i], row_bytes);
    return SKV_OK;
}

/* A store op's arguments (op: its name; d a multiple of `multiple`), SKV_E_INVAL naming them. */
static int store_rows_check(const char *op, void *const *dst, const float *const *src, int d, int multiple, int n)
{
    if (n < 0 || d <= 0 || d % multiple != 0 || (n > 0 && (!dst || !src)))
        return skv_errorf(SKV_E_INVAL, "%s: bad arguments (n = %d, d = %d, a multiple of %d)", op, n, d, multiple);
    for (int i = 0; i < n; i++)
        if (!dst[i] || !src[i])
            return skv_errorf(SKV_E_INVAL, "%s: row %d has no %s", op, i, dst[i] ? "source" : "destination");
    return SKV_OK;
}

int skv_cpu_store_rows_f16(struct skv_backend *be, void *const *dst, const float *const *src, int d, int n)
{
    (void)be;
    int rc = store_rows_check("store_rows_f16", dst, src, d, 1, n);
    for (int i = 0; !rc && i < n; i++)
        skv_cpu_f32_to_f16(dst[i], src[i], d);
    return rc;
}

int skv_cpu_store_rows_q8_0(struct skv_backend *be, void *const *dst, const float *const *src, int d, int n)
{
    (void)be;
    int rc = store_rows_check("store_rows_q8_0", dst, src, d, 32, n);
    for (int i = 0; !rc && i < n; i++)
        skv_quantize_row_q8_0(dst[i], src[i], d);
    return rc;
}

/* ---- SnapKV / H2O scores and top-k ---------------------------------------------------------- */

struct group_job {
    float *out;
    const float *colsum;
    int64_t stride;
    int group;
    const int *len, *pooled;
    float div;
    int kernel;
    bool pool_max, gqa_max;
    struct skv_backend *be;
    atomic_int status;         /* SKV_OK, or the first failure (set by any worker) */
};

/* One KV head per task item: the group's rows reduced, then the leading rows pooled. */
static void group_task(void *arg, int64_t begin, int64_t end, int thread_id)
{
    struct group_job *job = arg;
    const int g = job->group;
    for (int64_t h = begin; h < end; h++) {
        const int n = job->len[h], np = job->pooled[h], half = job->kernel / 2;
        if (n == 0)
            continue;
        const float *in = job->colsum + h * g * job->stride;
        float *out = job->out + h * job->stride;
        float *agg = skv_cpu_scratch(job->be, thread_id, (size_t)n * sizeof(float));
        if (!agg) {
            atomic_store(&job->status, SKV_E_NOMEM); /* every writer stores the same value */
            return;
        }
        for (int j = 0; j < n; j++) {
            float acc = in[j];
            for (int r = 1; r < g; r++) {
                float v = in[(int64_t)r * job->stride + j];
                acc = job->gqa_max ? (v > acc ? v : acc) : acc + v;
            }
            agg[j] = (job->gqa_max ? acc : acc / (float)g) / job->div;
        }
        for (int j = 0; j < np; j++) {
            int lo = j - half < 0 ? 0 : j - half, hi = j + half >= np ? np - 1 : j + half;
            if (job->pool_max) {
                float m = -INFINITY;
                for (int t = lo; t <= hi; t++)
                    m = agg[t] > m ? agg[t] : m;
                out[j] = m;
            } else {
                double s = 0;
                for (int t = lo; t <= hi; t++)
                    s += agg[t];
                out[j] = (float)(s / job->kernel);
            }
        }
        memcpy(out + np, agg + np, (size_t)(n - np) * sizeof *out);
    }
}

int skv_cpu_group_scores(struct skv_backend *be, float *out, const float *colsum, int64_t stride, int n_heads,
                         int n_kv, const int *len, const int *pooled, float div, int kernel, bool pool_max,
                         bool gqa_max)
{
    int rc = skv_group_scores_check(out, colsum, stride, n_heads, n_kv, len, pooled, div, kernel);
    if (rc)
        return rc;
    struct group_job job = {
        .out = out, .colsum = colsum, .stride = stride, .group = n_heads / n_kv, .len = len, .pooled = pooled,
        .div = div, .kernel = kernel, .pool_max = pool_max, .gqa_max = gqa_max, .be = be,
    };
    atomic_init(&job.status, SKV_OK);
    skv_cpu_parallel_tasks(be, n_kv, group_task, &job);
    return atomic_load(&job.status);
}

/* Keys as unsigned integers in the same order (NaN lowest, -0 as +0). */
static uint32_t order_key(float f)
{
    if (isnan(f))
        return 0;
    if (f == 0.0f)
        f = 0.0f;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

/* The k largest keys of segments [s0, s1) as one set: a radix select of the k-th largest key
 * (four 8-bit digits, most significant first), then one pass in (segment, row) order keeps
 * every larger key and the first `ties` equal ones. Returns the rows written to idx. */
static int64_t select_segments(const float *keys, int64_t stride, const int *n, int s0, int s1, int k,
                               int32_t *idx, int *cnt)
{
    int64_t total = 0;
    for (int s = s0; s < s1; s++)
        total += n[s];
    const bool all = total <= k;
    uint32_t thr = 0;
    int64_t ties = 0;
    if (!all && k > 0) {
        uint32_t mask = 0;
        int64_t want = k; /* rows still to take among those matching thr under mask */
        for (int shift = 24; shift >= 0; shift -= 8) {
            int64_t hist[256] = {0};
            for (int s = s0; s < s1; s++)
                for (int j = 0; j < n[s]; j++) {
                    uint32_t u = order_key(keys[s * stride + j]);
                    if ((u & mask) == thr)
                        hist[(u >> shift) & 255]++;
                }
            int b = 255;
            for (; b > 0 && hist[b] < want; b--)
                want -= hist[b];
            thr |= (uint32_t)b << shift;
            mask |= 255u << shift;
        }
        ties = want;
    }
    int64_t out = 0;
    for (int s = s0; s < s1; s++) {
        int c = 0;
        for (int j = 0; j < n[s] && (all || k > 0); j++) {
            uint32_t u = order_key(keys[s * stride + j]);
            if (all || u > thr || (u == thr && ties > 0)) {
                ties -= !all && u == thr;
                idx[out++] = j;
                c++;
            }
        }
        cnt[s] = c;
    }
    return out;
}

int skv_cpu_topk_rows(struct skv_backend *be, int32_t *idx, int *cnt, const float *keys, int64_t stride,
                      const int *n, int n_seg, int k, bool joint)
{
    (void)be;
    int rc = skv_topk_check(idx, cnt, keys, stride, n, n_seg, k);
    if (rc)
        return rc;
    int64_t at = 0;
    for (int s0 = 0; s0 < n_seg; s0 = joint ? n_seg : s0 + 1)
        at += select_segments(keys, stride, n, s0, joint ? n_seg : s0 + 1, k, idx + at, cnt);
    return SKV_OK;
}
