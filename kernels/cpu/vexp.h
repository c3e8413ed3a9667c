/* Vector exponential shared by the CPU kernels (attention's softmax, SwiGLU, the compression
 * scores). AVX2 + FMA only: include it inside the files' AVX2 sections. */
#ifndef SKV_CPU_VEXP_H
#define SKV_CPU_VEXP_H

#include <immintrin.h>

/* 2^x for x in [-126, 126] (clamped above; exactly 0 below -126 and for -inf): round-to-
 * nearest split, degree-7 polynomial for 2^f on [-0.5, 0.5] (relative error ~5e-9), exponent
 * bits for 2^n. */
static inline __m256 skv_exp2_ps(__m256 x)
{
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-126.0f)), _mm256_set1_ps(126.0f));
    const __m256 nr = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, nr);
    __m256 p = _mm256_set1_ps(1.5252733804059838e-05f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-04f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428441e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284770e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821576e-02f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910070e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994530e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(nr), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
}

#endif
