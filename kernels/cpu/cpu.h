/* Internals shared by the CPU backend's files: its state, the thread pool and the entry
 * points each op file exports to cpu_backend.c (which fills the op table). */
#ifndef SKV_CPU_H
#define SKV_CPU_H

#include <stdint.h>
#include <string.h>

#include "kernels/backend.h"

/* Runs fn(arg, begin, end, thread_id) over [0, n) split into contiguous chunks, one per
 * thread (the calling thread takes part), and returns when all are done. Chunks are
 * aligned to `grain` items. With one thread (or n <= grain) it runs inline. */
typedef void (*skv_cpu_task_fn)(void *arg, int64_t begin, int64_t end, int thread_id);
void skv_cpu_parallel_for(struct skv_backend *be, int64_t n, int64_t grain, skv_cpu_task_fn fn,
                          void *arg);
/* Runs fn(arg, t, t + 1, thread_id) for every task t of [0, n), the threads taking the next
 * task as each finishes one (an atomic claim a task): tasks of unequal cost balance to within
 * one task, where parallel_for's one contiguous chunk a thread balances only their count. A
 * task's result must not depend on the thread that runs it. With one thread, one call runs
 * them all (fn(arg, 0, n, 0)). */
void skv_cpu_parallel_tasks(struct skv_backend *be, int64_t n, skv_cpu_task_fn fn, void *arg);

/* Per-thread scratch buffer of at least `bytes`, owned by the backend (valid until the next
 * call with the same thread_id). NULL on allocation failure. */
void *skv_cpu_scratch(struct skv_backend *be, int thread_id, size_t bytes);

/* KV rows of f16 (a pool of kv-type f16) widened to f32, exactly, and f32 rows rounded to f16
 * (nearest even; magnitudes past f16's largest, 65504, saturate to it, so a stored row stays
 * finite and saves and loads like any other; NaN stays NaN), n values. */
#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
static inline void skv_cpu_f16_to_f32(float *dst, const uint16_t *src, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++)
        dst[i] = skv_fp16_to_f32(src[i]);
}
static inline void skv_cpu_f32_to_f16(uint16_t *dst, const float *src, int64_t n)
{
    const __m256 hi = _mm256_set1_ps(65504.0f), lo = _mm256_set1_ps(-65504.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) { /* min(hi, x), max(lo, y): the second operand (x, y) when it is NaN */
        const __m256 x = _mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_loadu_ps(src + i)));
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; i++)
        dst[i] = skv_f32_to_fp16_sat(src[i]);
}
#else
static inline void skv_cpu_f16_to_f32(float *dst, const uint16_t *src, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = skv_fp16_to_f32(src[i]);
}
static inline void skv_cpu_f32_to_f16(uint16_t *dst, const float *src, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = skv_f32_to_fp16_sat(src[i]);
}
#endif
#if defined(__AVX2__) && defined(__F16C__)
/* q8_0 rows (n a multiple of 32) widened: d * q per value, as skv_dequantize_row, inline. */
static inline void skv_cpu_q8_0_to_f32(float *dst, const void *src, int64_t n)
{
    const unsigned char *b = src;
    for (int64_t i = 0; i < n; i += 32, b += 34, dst += 32) {
        uint16_t h;
        memcpy(&h, b, sizeof h);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(h));
        for (int k = 0; k < 4; k++) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * k));
            _mm256_storeu_ps(dst + 8 * k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
        }
    }
}
#else
static inline void skv_cpu_q8_0_to_f32(float *dst, const void *src, int64_t n)
{
    (void)skv_dequantize_row(SKV_DTYPE_Q8_0, src, dst, n);
}
#endif

/* One K or V row of d values of an f16 or q8_0 KV view widened to f32, exactly (q8_0: d * q
 * per value, the one product every backend computes). */
static inline void skv_cpu_kv_widen(float *dst, const void *row, int kv_type, int64_t d)
{
    if (kv_type == SKV_DTYPE_F16)
        skv_cpu_f16_to_f32(dst, row, d);
    else
        skv_cpu_q8_0_to_f32(dst, row, d); /* the view's check: d % 32 == 0 */
}

/* Op entry points (signatures as in struct skv_backend_ops). */
int skv_cpu_get_rows(struct skv_backend *be, float *out, const struct skv_tensor *table,
                     const int32_t *ids, int n);
int skv_cpu_matmul_rows_as_one(struct skv_backend *be, const struct skv_tensor *w);
int skv_cpu_matmul(struct skv_backend *be, float *out, const struct skv_tensor *w,
                   const float *bias, const float *x, int n);
int skv_cpu_matmul_multi(struct skv_backend *be, const struct skv_matmul_part *parts, int count,
                         const float *x, int n);
int skv_cpu_rmsnorm(struct skv_backend *be, float *out, const float *x, const float *w, int n,
                    int dim, float eps);
int skv_cpu_rope(struct skv_backend *be, float *x, int n, int n_heads, int head_dim,
                 const int32_t *pos, const struct skv_rope *rope);
int skv_cpu_swiglu(struct skv_backend *be, float *out, const float *gate, const float *up,
                   int64_t count);
int skv_cpu_add(struct skv_backend *be, float *out, const float *a, const float *b,
                int64_t count);
int skv_cpu_attention_split_rows(struct skv_backend *be, int n_heads, int n_kv_heads);
int skv_cpu_attention(struct skv_backend *be, float *out, const float *q, int n, int n_heads,
                      const struct skv_kv_view *kv);
int skv_cpu_attention_batch(struct skv_backend *be, float *out, const float *q, int n_seq, int n_heads,
                            const struct skv_kv_view *kv);
int skv_cpu_attention_batch_probs(struct skv_backend *be, float *out, const float *q, int n_seq, int n_heads,
                                  const struct skv_kv_view *kv, float *const *probs, const int64_t *stride);
int skv_cpu_attention_colsum(struct skv_backend *be, float *out, int64_t out_stride, const float *q,
                             int n, int n_heads, const struct skv_kv_view *kv, int q_first);
int skv_cpu_group_scores(struct skv_backend *be, float *out, const float *colsum, int64_t stride, int n_heads,
                         int n_kv, const int *len, const int *pooled, float div, int kernel, bool pool_max,
                         bool gqa_max);
int skv_cpu_topk_rows(struct skv_backend *be, int32_t *idx, int *cnt, const float *keys, int64_t stride,
                      const int *n, int n_seg, int k, bool joint);
int skv_cpu_cosine_mean(struct skv_backend *be, float *out, const float *a, const float *b, int n,
                        int dim);
int skv_cpu_copy_rows(struct skv_backend *be, void *const *dst, const void *const *src, size_t row_bytes, int n);
int skv_cpu_store_rows_f16(struct skv_backend *be, void *const *dst, const float *const *src, int d, int n);
int skv_cpu_store_rows_q8_0(struct skv_backend *be, void *const *dst, const float *const *src, int d, int n);
int skv_cpu_row_logprobs(struct skv_backend *be, float *out, int32_t *top, const float *logits,
                         const int32_t *targets, int n, int n_vocab);
int skv_cpu_row_top_logprobs(struct skv_backend *be, float *out, int32_t *ids, float *lps, int k, const float *logits,
                             const int32_t *targets, int n, int n_vocab);

/* Scratch rules: matmul's integer path keeps the quantized activations in slot 0 of the
 * calling thread for the length of the call, and attention takes slot 0 for its working
 * area; no op may hold a scratch pointer from one call to the next. parallel_for is not
 * reentrant. */

#endif
