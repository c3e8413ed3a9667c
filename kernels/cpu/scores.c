/* The CPU backend's compression math: attention column sums (SnapKV's observation window,
 * H2O's accumulated attention), the mean residual cosine (SqueezeAttention) and the row
 * copies that compact a paged cache. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "kernels/cpu/cpu.h"

struct colsum_job {
    float *out;
    int64_t out_stride;
    const float *q;
    int n, n_heads, group, head_dim, q_first;
    const struct skv_kv_view *kv;
    struct skv_backend *be;
    int status;
};

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static float dot(const float *a, const float *b, int d)
{
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= d; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    float s = _mm_cvtss_f32(s4);
    for (; i < d; i++)
        s += a[i] * b[i];
    return s;
}
#else
static float dot(const float *a, const float *b, int d)
{
    float s = 0;
    for (int i = 0; i < d; i++)
        s += a[i] * b[i];
    return s;
}
#endif

/* One query head per task item: probabilities of each query in the window, summed (keys
 * outside a query's sliding window get 0 from it, as in attention). */
static void colsum_task(void *arg, int64_t begin, int64_t end, int thread_id)
{
    struct colsum_job *job = arg;
    int d = job->head_dim;
    float scale = 1.0f / sqrtf((float)d);
    for (int64_t h = begin; h < end; h++) {
        int kvh = (int)h / job->group;
        int prefix = job->kv->prefix_len[kvh];
        int n_keys = prefix + job->n;
        float *out = job->out + h * job->out_stride;
        float *p = skv_cpu_scratch(job->be, thread_id, (size_t)n_keys * sizeof(float));
        if (!p) {
            job->status = SKV_E_NOMEM;
            return;
        }
        memset(out, 0, (size_t)n_keys * sizeof *out);
        for (int i = job->q_first; i < job->n; i++) {
            const float *qi = job->q + ((size_t)i * job->n_heads + (size_t)h) * d;
            int seen = prefix + i + 1, lo = skv_kv_view_first(job->kv, kvh, i);
            float mx = -INFINITY;
            for (int j = lo; j < seen; j++) {
                p[j] = dot(qi, skv_kv_view_row(job->kv, kvh, 0, j), d) * scale;
                mx = p[j] > mx ? p[j] : mx;
            }
            double sum = 0;
            for (int j = lo; j < seen; j++) {
                p[j] = expf(p[j] - mx);
                sum += p[j];
            }
            float inv = (float)(1.0 / sum);
            for (int j = lo; j < seen; j++)
                out[j] += p[j] * inv;
        }
    }
}

int skv_cpu_attention_colsum(struct skv_backend *be, float *out, int64_t out_stride, const float *q,
                             int n, int n_heads, const struct skv_kv_view *kv, int q_first)
{
    if (!be || !out || !q || !kv || n <= 0 || n_heads <= 0 || kv->n_kv_heads <= 0 ||
        kv->n_kv_heads > SKV_MAX_KV_HEADS || n_heads % kv->n_kv_heads || q_first < 0 || q_first >= n)
        return skv_errorf(SKV_E_INVAL, "attention_colsum: bad shape");
    if (kv->kv_type != SKV_DTYPE_F32)
        return skv_errorf(SKV_E_UNSUPPORTED, "attention_colsum: kv type %d", kv->kv_type);
    int rc = skv_kv_view_check_window(kv, "attention_colsum");
    if (!rc)
        rc = skv_kv_view_check_rows(kv, "attention_colsum");
    if (rc)
        return rc;
    for (int h = 0; h < kv->n_kv_heads; h++)
        if (kv->prefix_len[h] < 0 || kv->prefix_len[h] + n > out_stride)
            return skv_errorf(SKV_E_INVAL, "attention_colsum: output row too short");
    struct colsum_job job = {
        .out = out, .out_stride = out_stride, .q = q, .n = n, .n_heads = n_heads,
        .group = n_heads / kv->n_kv_heads, .head_dim = kv->head_dim, .q_first = q_first, .kv = kv, .be = be,
    };
    skv_cpu_parallel_for(be, n_heads, 1, colsum_task, &job);
    return job.status;
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
