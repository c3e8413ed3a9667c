/* Dot products of f32 rows shared by the CPU kernels (attention's scores, the compression
 * scores; the quantized GEMVs' horizontal sum). AVX2 + FMA only: include it inside the files'
 * AVX2 sections. */
#ifndef SKV_CPU_VDOT_H
#define SKV_CPU_VDOT_H

#include <immintrin.h>

static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float dot1(const float *a, const float *b, int d)
{
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int t = 0;
    for (; t + 16 <= d; t += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + t), _mm256_loadu_ps(b + t), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + t + 8), _mm256_loadu_ps(b + t + 8), acc1);
    }
    for (; t + 8 <= d; t += 8)
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + t), _mm256_loadu_ps(b + t), acc0);
    float s = hsum8(_mm256_add_ps(acc0, acc1));
    for (; t < d; t++)
        s += a[t] * b[t];
    return s;
}

/* s[0..8) = q . k_j for the 8 key rows k[0..8). */
static inline void dot8(const float *q, const float *const *k, int d, float *s)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
           a7 = a0;
    const float *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3], *k4 = k[4], *k5 = k[5],
                *k6 = k[6], *k7 = k[7];
    int t = 0;
    for (; t + 8 <= d; t += 8) {
        const __m256 qv = _mm256_loadu_ps(q + t);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + t), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + t), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + t), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + t), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k4 + t), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k5 + t), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k6 + t), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k7 + t), a7);
    }
    /* Transposing reduction: lane j of the result is the full sum of a_j. */
    const __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3);
    const __m256 h45 = _mm256_hadd_ps(a4, a5), h67 = _mm256_hadd_ps(a6, a7);
    const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                             _mm256_permute2f128_ps(h0123, h4567, 0x31));
    _mm256_storeu_ps(s, r);
    for (; t < d; t++)
        for (int j = 0; j < 8; j++)
            s[j] += q[t] * k[j][t];
}

#endif
