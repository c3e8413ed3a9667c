/* Dequantization of every supported GGML type (skv_dequantize_row), the 16-bit quantization
 * of activation rows, and the dot kernels of the CPU matmul: integer dots of quantized weight
 * rows against 16-bit activations (AVX2) and float dots for F32 / F16 / BF16 weights.
 * Without AVX2 + FMA + F16C the integer kernels are absent and matmul dequantizes instead. */
#include "kernels/cpu/quant.h"

#include <assert.h>
#include <math.h>
#include <string.h>

#include "common/status.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SKV_QUANT_AVX2 1
#include <immintrin.h>
#include "kernels/cpu/vdot.h" /* hsum8 */
#endif

#define SKV_ALWAYS_INLINE inline __attribute__((always_inline))

_Static_assert(sizeof(struct skv_block_q4_0) == 18, "q4_0 layout");
_Static_assert(sizeof(struct skv_block_q4_1) == 20, "q4_1 layout");
_Static_assert(sizeof(struct skv_block_q5_0) == 22, "q5_0 layout");
_Static_assert(sizeof(struct skv_block_q5_1) == 24, "q5_1 layout");
_Static_assert(sizeof(struct skv_block_q8_0) == 34, "q8_0 layout");
_Static_assert(sizeof(struct skv_block_q2_k) == 84, "q2_k layout");
_Static_assert(sizeof(struct skv_block_q3_k) == 110, "q3_k layout");
_Static_assert(sizeof(struct skv_block_q4_k) == 144, "q4_k layout");
_Static_assert(sizeof(struct skv_block_q5_k) == 176, "q5_k layout");
_Static_assert(sizeof(struct skv_block_q6_k) == 210, "q6_k layout");
_Static_assert(sizeof(struct skv_block_q8_k) == 292, "q8_k layout");

/* ---- SIMD helpers ---- */

#if SKV_QUANT_AVX2

/* 16 packed bytes -> 32 bytes in [0, 15]: low nibbles first, then the high nibbles. */
static SKV_ALWAYS_INLINE __m256i nibbles32(const uint8_t *qs)
{
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0f));
}

/* 32 bits -> 32 bytes, byte i = 0xff when bit i is set. */
static SKV_ALWAYS_INLINE __m256i bits32_to_bytes(uint32_t bits)
{
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                             0x0101010101010101LL, 0);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

/* Sum of w[i] * y[i] over the 32 elements of activation block b, w as two int16 vectors
 * (elements 0-15, 16-31), as 8 floats. Every lane adds four products; with |w| <= 128 and
 * |y| <= 32767 that stays below 2^24, so even the conversion to float is exact. */
static SKV_ALWAYS_INLINE __m256 dot16(const __m256i w[2], const struct skv_q16_act *a, int64_t blk)
{
    const int16_t *y = a->qs + blk * SKV_QK;
    const __m256i p0 = _mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i *)y));
    const __m256i p1 = _mm256_madd_epi16(w[1], _mm256_loadu_si256((const __m256i *)(y + 16)));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1));
}

/* 16 bits -> 16 int16 lanes, lane i = 0x10 when bit i is set (the 5th bit of Q5 values). */
static SKV_ALWAYS_INLINE __m256i bits16_to_0x10(uint32_t bits)
{
    const __m256i mask = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048,
                                           4096, 8192, 16384, (short)0x8000);
    const __m256i v = _mm256_and_si256(_mm256_set1_epi16((short)bits), mask);
    return _mm256_and_si256(_mm256_cmpeq_epi16(v, mask), _mm256_set1_epi16(0x10));
}

/* [e_b, s_b, 0, 0] of activation block b. */
static SKV_ALWAYS_INLINE __m128 act_ds(const struct skv_q16_act *a, int64_t blk)
{
    return _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(a->ds + 2 * blk)));
}

/* [d, m, 0, 0] from two adjacent fp16 fields. */
static SKV_ALWAYS_INLINE __m128 fp16x2(const uint16_t *p)
{
    uint32_t u;
    memcpy(&u, p, sizeof u);
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)u));
}

/* [d, d, d, d] from one fp16 field. */
static SKV_ALWAYS_INLINE __m128 fp16x4(uint16_t h)
{
    return _mm_cvtph_ps(_mm_set1_epi16((short)h));
}

static SKV_ALWAYS_INLINE __m256i q5_bytes(const uint8_t *qs, const uint8_t *qh)
{
    uint32_t bits;
    memcpy(&bits, qh, sizeof bits);
    const __m256i hi = _mm256_and_si256(bits32_to_bytes(bits), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(nibbles32(qs), hi);
}

/* Q4_K / Q5_K super-block scales. scales[12] packs eight 6-bit scales sc_g and mins m_g:
 * g < 4: sc = s[g] & 63, m = s[g + 4] & 63; g >= 4: sc = (s[g + 4] & 15) | (s[g - 4] >> 6) << 4,
 * m = (s[g + 4] >> 4) | (s[g] >> 6) << 4. Unpacked four at a time from 32-bit words, then
 * [d * sc_g, dmin * m_g] for every group g, stored interleaved: group g's pair starts at
 * pairs[k45_pair_pos[g]]. Both block types begin with d, dmin, scales[12]. */
static const int k45_pair_pos[8] = {0, 2, 8, 10, 4, 6, 12, 14};

static SKV_ALWAYS_INLINE void k45_pairs(const uint8_t *blk, float pairs[16])
{
    const struct skv_block_q4_k *b = (const void *)blk;
    uint32_t a, m, c;
    memcpy(&a, b->scales, 4);
    memcpy(&m, b->scales + 4, 4);
    memcpy(&c, b->scales + 8, 4);
    const uint32_t lo6 = 0x3f3f3f3f, lo4 = 0x0f0f0f0f, lo2 = 0x03030303;
    const uint64_t sc = (uint64_t)(a & lo6) | (uint64_t)((c & lo4) | ((a >> 6) & lo2) << 4) << 32;
    const uint64_t mn = (uint64_t)(m & lo6) | (uint64_t)(((c >> 4) & lo4) | ((m >> 6) & lo2) << 4) << 32;
    const __m256 scf = _mm256_mul_ps(_mm256_set1_ps(skv_quant_fp16(b->d)),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc))));
    const __m256 mnf = _mm256_mul_ps(_mm256_set1_ps(skv_quant_fp16(b->dmin)),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))));
    _mm256_storeu_ps(pairs, _mm256_unpacklo_ps(scf, mnf));
    _mm256_storeu_ps(pairs + 8, _mm256_unpackhi_ps(scf, mnf));
}

/* Q5_K: the fifth bit of group g's 32 values (bit g of qh[l]) as 0x10 bytes. */
static SKV_ALWAYS_INLINE __m256i k5_high(__m256i qh, int g)
{
    const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(g)),
                                         _mm256_set1_epi8(1));
    return _mm256_slli_epi16(bit, 4);
}

/* Q6_K: the four activation-block-sized runs of half h (128 values) as signed bytes in
 * [-32, 31]: run k is elements 128h + 32k .. + 31. */
static SKV_ALWAYS_INLINE void q6_bytes(const struct skv_block_q6_k *b, int h, __m256i q[4])
{
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    const __m256i k32 = _mm256_set1_epi8(32);
    const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h));
    const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
    q[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4),
                           _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45));
    q[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4),
                           _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                           _mm256_and_si256(qh, bits45));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45));
    for (int k = 0; k < 4; k++)
        q[k] = _mm256_sub_epi8(q[k], k32);
}

/* Block i of a weight row of a 32-wide format (kind = its dtype): its 32 values as bytes
 * (unsigned for the 4/5-bit formats, signed for Q8_0) and its scales, [d, m] or [d, d]. */
static SKV_ALWAYS_INLINE void w32_block(const uint8_t *w, int64_t i, const int kind, __m256i *q,
                                        __m128 *sc)
{
    switch (kind) {
    case SKV_DTYPE_Q4_0: {
        const struct skv_block_q4_0 *b = (const struct skv_block_q4_0 *)w + i;
        *q = nibbles32(b->qs);
        *sc = fp16x4(b->d);
        break;
    }
    case SKV_DTYPE_Q4_1: {
        const struct skv_block_q4_1 *b = (const struct skv_block_q4_1 *)w + i;
        *q = nibbles32(b->qs);
        *sc = fp16x2(&b->d);
        break;
    }
    case SKV_DTYPE_Q5_0: {
        const struct skv_block_q5_0 *b = (const struct skv_block_q5_0 *)w + i;
        *q = q5_bytes(b->qs, b->qh);
        *sc = fp16x4(b->d);
        break;
    }
    case SKV_DTYPE_Q5_1: {
        const struct skv_block_q5_1 *b = (const struct skv_block_q5_1 *)w + i;
        *q = q5_bytes(b->qs, b->qh);
        *sc = fp16x2(&b->d);
        break;
    }
    default: {
        const struct skv_block_q8_0 *b = (const struct skv_block_q8_0 *)w + i;
        *q = _mm256_loadu_si256((const __m256i *)b->qs);
        *sc = fp16x4(b->d);
        break;
    }
    }
}

/* Block i of a weight row of a 32-wide format, for the dot kernels: its 32 values as int16
 * (elements 0-15 in w[0], 16-31 in w[1]; unsigned for the 4/5-bit formats, signed for Q8_0)
 * and its scales, [d, m] or [d, d]. */
static SKV_ALWAYS_INLINE void w32_block16(const uint8_t *w, int64_t i, const int kind,
                                          __m256i q[2], __m128 *sc)
{
    const __m256i low4 = _mm256_set1_epi16(0x0f);
    const uint8_t *qs;
    uint32_t qh = 0;
    switch (kind) {
    case SKV_DTYPE_Q4_0: {
        const struct skv_block_q4_0 *b = (const struct skv_block_q4_0 *)w + i;
        qs = b->qs;
        *sc = fp16x4(b->d);
        break;
    }
    case SKV_DTYPE_Q4_1: {
        const struct skv_block_q4_1 *b = (const struct skv_block_q4_1 *)w + i;
        qs = b->qs;
        *sc = fp16x2(&b->d);
        break;
    }
    case SKV_DTYPE_Q5_0: {
        const struct skv_block_q5_0 *b = (const struct skv_block_q5_0 *)w + i;
        qs = b->qs;
        memcpy(&qh, b->qh, sizeof qh);
        *sc = fp16x4(b->d);
        break;
    }
    case SKV_DTYPE_Q5_1: {
        const struct skv_block_q5_1 *b = (const struct skv_block_q5_1 *)w + i;
        qs = b->qs;
        memcpy(&qh, b->qh, sizeof qh);
        *sc = fp16x2(&b->d);
        break;
    }
    default: {
        const struct skv_block_q8_0 *b = (const struct skv_block_q8_0 *)w + i;
        q[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b->qs));
        q[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b->qs + 16)));
        *sc = fp16x4(b->d);
        return;
    }
    }
    /* byte l holds element l (low nibble) and l + 16 (high nibble) */
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs));
    q[0] = _mm256_and_si256(v, low4);
    q[1] = _mm256_srli_epi16(v, 4);
    if (kind == SKV_DTYPE_Q5_0 || kind == SKV_DTYPE_Q5_1) {
        q[0] = _mm256_or_si256(q[0], bits16_to_0x10(qh & 0xffff));
        q[1] = _mm256_or_si256(q[1], bits16_to_0x10(qh >> 16));
    }
}

#endif

/* ---- dequantization ---- */

#if SKV_QUANT_AVX2

/* Block i of a 32-wide format to floats: integer offsets are removed before the scale
 * and x = d * q + m is not fused, so the values match GGML's scalar code bit for bit. */
static SKV_ALWAYS_INLINE void deq32_block(const uint8_t *w, int64_t i, const int kind, float *y)
{
    __m256i q;
    __m128 sc;
    w32_block(w, i, kind, &q, &sc);
    if (kind == SKV_DTYPE_Q4_0)
        q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
    else if (kind == SKV_DTYPE_Q5_0)
        q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
    const __m256 d = _mm256_broadcastss_ps(sc);
    const __m256 m = _mm256_broadcastss_ps(_mm_movehdup_ps(sc));
    const bool has_min = kind == SKV_DTYPE_Q4_1 || kind == SKV_DTYPE_Q5_1;
    const __m128i half[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    for (int k = 0; k < 4; k++) {
        const __m128i bytes = k % 2 ? _mm_srli_si128(half[k / 2], 8) : half[k / 2];
        __m256 f = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
        if (has_min)
            f = _mm256_add_ps(f, m);
        _mm256_storeu_ps(y + 8 * k, f);
    }
}

#define SKV_DEQ32(name, kind)                                                                 \
    static void deq_##name(const void *src, float *y, int64_t nb)                             \
    {                                                                                         \
        for (int64_t i = 0; i < nb; i++)                                                      \
            deq32_block(src, i, kind, y + i * SKV_QK);                                        \
    }

SKV_DEQ32(q4_0, SKV_DTYPE_Q4_0)
SKV_DEQ32(q4_1, SKV_DTYPE_Q4_1)
SKV_DEQ32(q5_0, SKV_DTYPE_Q5_0)
SKV_DEQ32(q5_1, SKV_DTYPE_Q5_1)
SKV_DEQ32(q8_0, SKV_DTYPE_Q8_0)

#else

static void deq_q4_0(const void *src, float *y, int64_t nb)
{
    const struct skv_block_q4_0 *b = src;
    for (int64_t i = 0; i < nb; i++, y += SKV_QK) {
        const float d = skv_quant_fp16(b[i].d);
        for (int l = 0; l < SKV_QK / 2; l++) {
            y[l] = d * (float)((b[i].qs[l] & 0x0f) - 8);
            y[l + 16] = d * (float)((b[i].qs[l] >> 4) - 8);
        }
    }
}

static void deq_q4_1(const void *src, float *y, int64_t nb)
{
    const struct skv_block_q4_1 *b = src;
    for (int64_t i = 0; i < nb; i++, y += SKV_QK) {
        const float d = skv_quant_fp16(b[i].d), m = skv_quant_fp16(b[i].m);
        for (int l = 0; l < SKV_QK / 2; l++) {
            y[l] = d * (float)(b[i].qs[l] & 0x0f) + m;
            y[l + 16] = d * (float)(b[i].qs[l] >> 4) + m;
        }
    }
}

static uint32_t load_u32le(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void deq_q5_0(const void *src, float *y, int64_t nb)
{
    const struct skv_block_q5_0 *b = src;
    for (int64_t i = 0; i < nb; i++, y += SKV_QK) {
        const float d = skv_quant_fp16(b[i].d);
        const uint32_t qh = load_u32le(b[i].qh);
        for (int l = 0; l < SKV_QK / 2; l++) {
            const int q0 = (b[i].qs[l] & 0x0f) | (int)((qh >> l) & 1) << 4;
            const int q1 = (b[i].qs[l] >> 4) | (int)((qh >> (l + 16)) & 1) << 4;
            y[l] = d * (float)(q0 - 16);
            y[l + 16] = d * (float)(q1 - 16);
        }
    }
}

static void deq_q5_1(const void *src, float *y, int64_t nb)
{
    const struct skv_block_q5_1 *b = src;
    for (int64_t i = 0; i < nb; i++, y += SKV_QK) {
        const float d = skv_quant_fp16(b[i].d), m = skv_quant_fp16(b[i].m);
        const uint32_t qh = load_u32le(b[i].qh);
        for (int l = 0; l < SKV_QK / 2; l++) {
            const int q0 = (b[i].qs[l] & 0x0f) | (int)((qh >> l) & 1) << 4;
            const int q1 = (b[i].qs[l] >> 4) | (int)((qh >> (l + 16)) & 1) << 4;
            y[l] = d * (float)q0 + m;
            y[l + 16] = d * (float)q1 + m;
        }
    }
}

static void deq_q8_0(const void *src, float *y, int64_t nb)
{
    const struct skv_block_q8_0 *b = src;
    for (int64_t i = 0; i < nb; i++, y += SKV_QK) {
        const float d = skv_quant_fp16(b[i].d);
        for (int l = 0; l < SKV_QK; l++)
            y[l] = d * (float)b[i].qs[l];
    }
}

#endif

static void deq_q2_k(const void *src, float *y, int64_t nb)
{
    const struct skv_block_q2_k *b = src;
    for (int64_t i = 0; i < nb; i++, y += SKV_QK_K) {
        const float d = skv_quant_fp16(b[i].d), dmin = skv_quant_fp16(b[i].dmin);
        for (int e = 0; e < SKV_QK_K; e++) {
            const int h = e / 128, k = (e / 32) % 4, l = e % 32;
            const int q = (b[i].qs[32 * h + l] >> (2 * k)) & 3;
            const uint8_t sc = b[i].scales[e / 16];
            y[e] = d * (float)(sc & 0x0f) * (float)q - dmin * (float)(sc >> 4);
        }
    }
}

static void deq_q3_k(const void *src, float *y, int64_t nb)
{
    const struct skv_block_q3_k *b = src;
    for (int64_t i = 0; i < nb; i++, y += SKV_QK_K) {
        const float d = skv_quant_fp16(b[i].d);
        int sc[16];
        for (int g = 0; g < 16; g++) {
            const int lo = g < 8 ? (b[i].scales[g] & 0x0f) : (b[i].scales[g - 8] >> 4);
            const int hi = (b[i].scales[8 + g % 4] >> (2 * (g / 4))) & 3;
            sc[g] = (lo | hi << 4) - 32;
        }
        for (int e = 0; e < SKV_QK_K; e++) {
            const int h = e / 128, k = (e / 32) % 4, l = e % 32;
            const int lo = (b[i].qs[32 * h + l] >> (2 * k)) & 3;
            const int hbit = (b[i].hmask[l] >> (e / 32)) & 1;
            y[e] = d * (float)sc[e / 16] * (float)(lo - (hbit ? 0 : 4));
        }
    }
}

#if SKV_QUANT_AVX2

/* 32 bytes (signed) -> y[0..31] = scale * q - min, scale s0 for the first 16 values and s1
 * for the last 16; product and difference are rounded separately, as in the scalar code. */
static SKV_ALWAYS_INLINE void deq_bytes32(__m256i q, __m256 s0, __m256 s1, __m256 m,
                                          const bool has_min, float *y)
{
    const __m128i half[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    for (int k = 0; k < 4; k++) {
        const __m128i bytes = k % 2 ? _mm_srli_si128(half[k / 2], 8) : half[k / 2];
        __m256 f = _mm256_mul_ps(k < 2 ? s0 : s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
        if (has_min)
            f = _mm256_sub_ps(f, m);
        _mm256_storeu_ps(y + 8 * k, f);
    }
}

static SKV_ALWAYS_INLINE void deq_k45(const void *src, float *y, int64_t nb, const bool q5)
{
    const size_t bsize = q5 ? sizeof(struct skv_block_q5_k) : sizeof(struct skv_block_q4_k);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int64_t i = 0; i < nb; i++, y += SKV_QK_K) {
        const uint8_t *blk = (const uint8_t *)src + i * bsize;
        const struct skv_block_q5_k *b5 = (const void *)blk;
        const uint8_t *qs = q5 ? b5->qs : ((const struct skv_block_q4_k *)(const void *)blk)->qs;
        float pairs[16];
        k45_pairs(blk, pairs);
        const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)b5->qh) : _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            const __m256i q2[2] = {_mm256_and_si256(raw, low4),
                                   _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4)};
            for (int t = 0; t < 2; t++) {
                const int g = 2 * c + t;
                const __m256i q = q5 ? _mm256_or_si256(q2[t], k5_high(qh, g)) : q2[t];
                const __m256 dl = _mm256_set1_ps(pairs[k45_pair_pos[g]]);
                const __m256 ml = _mm256_set1_ps(pairs[k45_pair_pos[g] + 1]);
                deq_bytes32(q, dl, dl, ml, true, y + 32 * g);
            }
        }
    }
}

static void deq_q4_k(const void *src, float *y, int64_t nb)
{
    deq_k45(src, y, nb, false);
}

static void deq_q5_k(const void *src, float *y, int64_t nb)
{
    deq_k45(src, y, nb, true);
}

static void deq_q6_k(const void *src, float *y, int64_t nb)
{
    const struct skv_block_q6_k *b = src;
    for (int64_t i = 0; i < nb; i++, y += SKV_QK_K) {
        const float d = skv_quant_fp16(b[i].d);
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            q6_bytes(&b[i], h, q);
            for (int k = 0; k < 4; k++) {
                const int t = 4 * h + k;
                const __m256 s0 = _mm256_set1_ps(d * (float)b[i].scales[2 * t]);
                const __m256 s1 = _mm256_set1_ps(d * (float)b[i].scales[2 * t + 1]);
                deq_bytes32(q[k], s0, s1, s0, false, y + 32 * t);
            }
        }
    }
}

#else

/* Scale and min of group g (0..7) of a Q4_K / Q5_K super-block. */
static void k4_scale_min(const uint8_t *s, int g, int *sc, int *m)
{
    if (g < 4) {
        *sc = s[g] & 63;
        *m = s[g + 4] & 63;
    } else {
        *sc = (s[g + 4] & 0x0f) | (s[g - 4] >> 6) << 4;
        *m = (s[g + 4] >> 4) | (s[g] >> 6) << 4;
    }
}

static void deq_q4_k(const void *src, float *y, int64_t nb)
{
    const struct skv_block_q4_k *b = src;
    for (int64_t i = 0; i < nb; i++, y += SKV_QK_K) {
        const float d = skv_quant_fp16(b[i].d), dmin = skv_quant_fp16(b[i].dmin);
        for (int g = 0; g < 8; g++) {
            int sc, m;
            k4_scale_min(b[i].scales, g, &sc, &m);
            const float dl = d * (float)sc, ml = dmin * (float)m;
            const uint8_t *q = b[i].qs + 32 * (g / 2);
            const int shift = 4 * (g % 2);
            for (int l = 0; l < 32; l++)
                y[32 * g + l] = dl * (float)((q[l] >> shift) & 0x0f) - ml;
        }
    }
}

static void deq_q5_k(const void *src, float *y, int64_t nb)
{
    const struct skv_block_q5_k *b = src;
    for (int64_t i = 0; i < nb; i++, y += SKV_QK_K) {
        const float d = skv_quant_fp16(b[i].d), dmin = skv_quant_fp16(b[i].dmin);
        for (int g = 0; g < 8; g++) {
            int sc, m;
            k4_scale_min(b[i].scales, g, &sc, &m);
            const float dl = d * (float)sc, ml = dmin * (float)m;
            const uint8_t *q = b[i].qs + 32 * (g / 2);
            const int shift = 4 * (g % 2);
            for (int l = 0; l < 32; l++) {
                const int v = ((q[l] >> shift) & 0x0f) | ((b[i].qh[l] >> g) & 1) << 4;
                y[32 * g + l] = dl * (float)v - ml;
            }
        }
    }
}

static void deq_q6_k(const void *src, float *y, int64_t nb)
{
    const struct skv_block_q6_k *b = src;
    for (int64_t i = 0; i < nb; i++, y += SKV_QK_K) {
        const float d = skv_quant_fp16(b[i].d);
        for (int e = 0; e < SKV_QK_K; e++) {
            const int h = e / 128, k = (e / 32) % 4, l = e % 32;
            const uint8_t ql = b[i].ql[64 * h + 32 * (k % 2) + l];
            const int lo = (k < 2 ? ql : ql >> 4) & 0x0f;
            const int hi = (b[i].qh[32 * h + l] >> (2 * k)) & 3;
            y[e] = d * (float)b[i].scales[e / 16] * (float)((lo | hi << 4) - 32);
        }
    }
}

#endif

static void deq_q8_k(const void *src, float *y, int64_t nb)
{
    const struct skv_block_q8_k *b = src;
    for (int64_t i = 0; i < nb; i++, y += SKV_QK_K)
        for (int l = 0; l < SKV_QK_K; l++)
            y[l] = b[i].d * (float)b[i].qs[l];
}

static void deq_bf16(const void *src, float *y, int64_t n)
{
    const uint16_t *h = src;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t u = (uint32_t)h[i] << 16;
        memcpy(&y[i], &u, sizeof u);
    }
}

#if SKV_QUANT_AVX2
static void deq_f16(const void *src, float *y, int64_t n)
{
    const uint16_t *h = src;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++)
        y[i] = skv_quant_fp16(h[i]);
}
#else
static void deq_f16(const void *src, float *y, int64_t n)
{
    const uint16_t *h = src;
    for (int64_t i = 0; i < n; i++)
        y[i] = skv_quant_fp16(h[i]);
}
#endif

bool skv_quant_supported(int type)
{
    switch (type) {
    case SKV_DTYPE_F32: case SKV_DTYPE_F16: case SKV_DTYPE_BF16:
    case SKV_DTYPE_Q4_0: case SKV_DTYPE_Q4_1: case SKV_DTYPE_Q5_0: case SKV_DTYPE_Q5_1:
    case SKV_DTYPE_Q8_0: case SKV_DTYPE_Q2_K: case SKV_DTYPE_Q3_K: case SKV_DTYPE_Q4_K:
    case SKV_DTYPE_Q5_K: case SKV_DTYPE_Q6_K: case SKV_DTYPE_Q8_K:
        return true;
    default:
        return false;
    }
}

int skv_dequantize_row(int type, const void *src, float *dst, int64_t n)
{
    if (n < 0 || (n > 0 && (src == NULL || dst == NULL)))
        return skv_errorf(SKV_E_INVAL, "dequantize: bad arguments (n = %lld)", (long long)n);
    const int64_t qk = type >= SKV_DTYPE_Q2_K && type <= SKV_DTYPE_Q8_K ? SKV_QK_K : SKV_QK;
    switch (type) {
    case SKV_DTYPE_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        return SKV_OK;
    case SKV_DTYPE_F16:
        deq_f16(src, dst, n);
        return SKV_OK;
    case SKV_DTYPE_BF16:
        deq_bf16(src, dst, n);
        return SKV_OK;
    default:
        break;
    }
    if (!skv_quant_supported(type))
        return skv_errorf(SKV_E_UNSUPPORTED, "dequantize: type %d not supported", type);
    if (n % qk != 0)
        return skv_errorf(SKV_E_INVAL, "dequantize: %lld elements is not a multiple of %lld",
                          (long long)n, (long long)qk);
    const int64_t nb = n / qk;
    switch (type) {
    case SKV_DTYPE_Q4_0: deq_q4_0(src, dst, nb); break;
    case SKV_DTYPE_Q4_1: deq_q4_1(src, dst, nb); break;
    case SKV_DTYPE_Q5_0: deq_q5_0(src, dst, nb); break;
    case SKV_DTYPE_Q5_1: deq_q5_1(src, dst, nb); break;
    case SKV_DTYPE_Q8_0: deq_q8_0(src, dst, nb); break;
    case SKV_DTYPE_Q2_K: deq_q2_k(src, dst, nb); break;
    case SKV_DTYPE_Q3_K: deq_q3_k(src, dst, nb); break;
    case SKV_DTYPE_Q4_K: deq_q4_k(src, dst, nb); break;
    case SKV_DTYPE_Q5_K: deq_q5_k(src, dst, nb); break;
    case SKV_DTYPE_Q6_K: deq_q6_k(src, dst, nb); break;
    case SKV_DTYPE_Q8_K: deq_q8_k(src, dst, nb); break;
    default: return skv_errorf(SKV_E_INTERNAL, "dequantize: type %d has no kernel", type);
    }
    return SKV_OK;
}

/* ---- 16-bit activation rows ---- */

/* Per block: e = amax / 32767, q = round(x * 32767 / amax) (tests/backend/test_matmul.c
 * repeats these float operations). */

size_t skv_q16_act_bytes(int64_t cols)
{
    const size_t nb = (size_t)(cols / SKV_QK);
    return (nb * SKV_QK * sizeof(int16_t) + 2 * nb * sizeof(float) + 63) & ~(size_t)63;
}

#if SKV_QUANT_AVX2
void skv_q16_act_quantize(const float *x, int64_t cols, void *buf, struct skv_q16_act *act)
{
    const int64_t nb = cols / SKV_QK;
    int16_t *qs = buf;
    float *ds = (float *)(qs + nb * SKV_QK);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    assert(cols % SKV_QK == 0);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * SKV_QK;
        __m256 v[4];
        for (int k = 0; k < 4; k++)
            v[k] = _mm256_loadu_ps(xb + 8 * k);
        __m256 am = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(am), _mm256_extractf128_ps(am, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const __m256 id = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
        __m256i q[4];
        for (int k = 0; k < 4; k++)
            q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], id));
        const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        /* packs works per 128-bit lane: [a0-3 b0-3 | a4-7 b4-7], reordered to a0-7 b0-7 */
        for (int k = 0; k < 2; k++) {
            const __m256i p = _mm256_packs_epi32(q[2 * k], q[2 * k + 1]);
            _mm256_storeu_si256((__m256i *)(qs + b * SKV_QK + 16 * k),
                                _mm256_permute4x64_epi64(p, 0xd8));
        }
        const float e = amax / 32767.0f;
        ds[2 * b] = e;
        ds[2 * b + 1] = e * (float)_mm_cvtsi128_si32(s4);
    }
    act->qs = qs;
    act->ds = ds;
}
#else
void skv_q16_act_quantize(const float *x, int64_t cols, void *buf, struct skv_q16_act *act)
{
    const int64_t nb = cols / SKV_QK;
    int16_t *qs = buf;
    float *ds = (float *)(qs + nb * SKV_QK);
    assert(cols % SKV_QK == 0);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * SKV_QK;
        float amax = 0.0f;
        for (int l = 0; l < SKV_QK; l++)
            amax = fmaxf(amax, fabsf(xb[l]));
        const float id = amax > 0.0f ? 32767.0f / amax : 0.0f;
        int sum = 0;
        for (int l = 0; l < SKV_QK; l++) {
            long q = lrintf(xb[l] * id);
            q = q > 32767 ? 32767 : q < -32767 ? -32767 : q;
            qs[b * SKV_QK + l] = (int16_t)q;
            sum += (int)q;
        }
        ds[2 * b] = amax / 32767.0f;
        ds[2 * b + 1] = ds[2 * b] * (float)sum;
    }
    act->qs = qs;
    act->ds = ds;
}
#endif

/* ---- dot kernels ---- */

#if SKV_QUANT_AVX2

/* Why 16-bit activations. With GGML-style 8-bit activations (x ~= d * q8, d = amax / 127 per
 * 32 values) SmolLM2-135M decoded 1024 tokens with top-1 agreement 0.973 and mean KL 3.4e-3
 * against the f32 reference: its activations have outlier channels, so the 8-bit step is
 * coarse for the other values of a block. Alternatives measured on the target (agreement /
 * mean KL; one thread, ms per pass over one layer's Q4_1 matrices in cache, and over a whole
 * token's 96 MB of weights from memory):
 *   8-bit (before)                            0.973 / 3.4e-3    0.154 ms   14.2 ms
 *   two 8-bit levels, x ~= e (254 hi + lo)    1.000 / < 1e-5    0.193 ms   14.1 ms
 *   16-bit, madd_epi16 (this)                 1.000 / < 1e-5    0.150 ms   ~14 ms
 * The two-level form keeps maddubs but needs two maddubs and two madds per 32 values and
 * column. int16 widens the weights once per block (vpmovzxbw, shared by all columns) and then
 * needs two madds per column, as cheap as 8 bits for Q4_0 / Q4_1 / Q8_0 / Q4_K; Q5_K loses
 * ~6%, Q6_K ~20% and Q5_0 / Q5_1 ~35% in cache (their extra bits cost more to widen), which
 * decode, bound by memory bandwidth, mostly hides. A float path (weights unpacked to f32 in
 * registers, FMA) would be exact but needs four conversions per block and four FMAs per block
 * and column. Decode at 2 threads measured the same before and after (within the noise of a
 * shared machine). */

/* A tile of nr weight rows x nc activation columns of a 32-wide format. Per block, the weight
 * scales times act_ds give [d * e_b, m * s_b] (or [d * e_b, d * s_b]) in one multiply:
 * lane 0 scales the integer dot, lane 1 collects the offset term, which enters the result
 * as + m * s_b (x = d * q + m) or - o * d * s_b (x = d * (q - o), o = 8 Q4_0, 16 Q5_0). */
static SKV_ALWAYS_INLINE void gemv32_tile(const uint8_t *w, size_t row_bytes,
                                          const struct skv_q16_act *xa, int64_t nb, const int nr,
                                          const int nc, const int kind, float *out, int64_t os)
{
    const float omul = kind == SKV_DTYPE_Q4_0 ? -8.0f : kind == SKV_DTYPE_Q5_0 ? -16.0f : 1.0f;
    __m256 acc[2][SKV_DOT_MAX_NC];
    __m128 off[2][SKV_DOT_MAX_NC];
    _Pragma("GCC unroll 2")
    for (int r = 0; r < nr; r++) {
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nc; j++) {
            acc[r][j] = _mm256_setzero_ps();
            off[r][j] = _mm_setzero_ps();
        }
    }
    for (int64_t i = 0; i < nb; i++) {
        __m256i q[2][2];
        __m128 sc[2];
        _Pragma("GCC unroll 2")
        for (int r = 0; r < nr; r++)
            w32_block16(w + r * row_bytes, i, kind, q[r], &sc[r]);
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nc; j++) {
            const __m128 ds = act_ds(&xa[j], i);
            _Pragma("GCC unroll 2")
            for (int r = 0; r < nr; r++) {
                const __m256 p = dot16(q[r], &xa[j], i);
                const __m128 f = _mm_mul_ps(sc[r], ds);
                acc[r][j] = _mm256_fmadd_ps(_mm256_broadcastss_ps(f), p, acc[r][j]);
                if (kind != SKV_DTYPE_Q8_0)
                    off[r][j] = _mm_add_ps(off[r][j], f);
            }
        }
    }
    _Pragma("GCC unroll 2")
    for (int r = 0; r < nr; r++) {
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nc; j++) {
            float v = hsum8(acc[r][j]);
            if (kind != SKV_DTYPE_Q8_0)
                v += omul * _mm_cvtss_f32(_mm_movehdup_ps(off[r][j]));
            out[j * os + r] = v;
        }
    }
}

/* Rows this far ahead are prefetched while the current ones are computed: the hardware
 * prefetcher alone leaves decode's GEMV waiting on memory. One thread streaming 64 MB of
 * 576-column weights (AMD EPYC, 14 GB/s single-thread read): Q8_0 6.4 -> 13.5 GB/s, Q4_1
 * 9.7 -> 12.5 GB/s with 8 rows ahead (4, 16 and 32 rows measured within 5% of that). */
#ifndef SKV_GEMV_PF_ROWS
#define SKV_GEMV_PF_ROWS 8
#endif

/* Prefetches rows [r, r + n) of w (rows of rb bytes) that exist (r + n <= nrows). */
static SKV_ALWAYS_INLINE void gemv32_prefetch(const uint8_t *w, size_t rb, int64_t r, int n, int64_t nrows)
{
    if (r + n > nrows)
        return;
    const char *p = (const char *)(w + r * rb);
    for (size_t o = 0; o < n * rb; o += 64)
        _mm_prefetch(p + o, _MM_HINT_T0);
}

/* All rows of a 32-wide format: pairs of rows for one column (two independent chains and a
 * shared activation load), single rows for several columns. */
static SKV_ALWAYS_INLINE void gemv32(const void *w, size_t rb, int64_t nrows,
                                     const struct skv_q16_act *xa, int64_t nb, int nc, float *out,
                                     int64_t os, const int kind)
{
    const uint8_t *wr = w;
    int64_t r = 0;
    switch (nc) {
    case 1:
        for (; r + 2 <= nrows; r += 2) {
            gemv32_prefetch(wr, rb, r + SKV_GEMV_PF_ROWS, 2, nrows);
            gemv32_tile(wr + r * rb, rb, xa, nb, 2, 1, kind, out + r, os);
        }
        for (; r < nrows; r++)
            gemv32_tile(wr + r * rb, rb, xa, nb, 1, 1, kind, out + r, os);
        break;
    case 2:
        for (; r < nrows; r++) {
            gemv32_prefetch(wr, rb, r + SKV_GEMV_PF_ROWS, 1, nrows);
            gemv32_tile(wr + r * rb, rb, xa, nb, 1, 2, kind, out + r, os);
        }
        break;
    case 3:
        for (; r < nrows; r++) {
            gemv32_prefetch(wr, rb, r + SKV_GEMV_PF_ROWS, 1, nrows);
            gemv32_tile(wr + r * rb, rb, xa, nb, 1, 3, kind, out + r, os);
        }
        break;
    default:
        for (; r < nrows; r++) {
            gemv32_prefetch(wr, rb, r + SKV_GEMV_PF_ROWS, 1, nrows);
            gemv32_tile(wr + r * rb, rb, xa, nb, 1, 4, kind, out + r, os);
        }
        break;
    }
}

/* Q4_K / Q5_K: eight groups of 32 with a 6-bit scale and min each; activation block = group.
 * Per group [d * sc, dmin * m] times act_ds works as for Q4_1, the min entering with a minus.
 * Each 32 bytes of qs hold group 2c (low nibbles) and 2c + 1 (high nibbles); widened to int16
 * per 16 bytes, a nibble is a mask or a shift away. */
static SKV_ALWAYS_INLINE void dot_k45_nc(const void *w, const struct skv_q16_act *xa,
                                         int64_t nb32, const int nc, float *res, const bool q5)
{
    const int64_t nb = nb32 / 8;
    const size_t bsize = q5 ? sizeof(struct skv_block_q5_k) : sizeof(struct skv_block_q4_k);
    const __m256i low4 = _mm256_set1_epi16(0x0f), bit4 = _mm256_set1_epi16(0x10);
    __m256 acc[SKV_DOT_MAX_NC];
    __m128 off[SKV_DOT_MAX_NC];
    for (int j = 0; j < nc; j++) {
        acc[j] = _mm256_setzero_ps();
        off[j] = _mm_setzero_ps();
    }
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *blk_base = (const uint8_t *)w + i * bsize;
        const struct skv_block_q4_k *b4 = (const void *)blk_base;
        const struct skv_block_q5_k *b5 = (const void *)blk_base;
        const uint8_t *qs = q5 ? b5->qs : b4->qs;
        float pairs[16];
        k45_pairs(blk_base, pairs);
        __m256i qh[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        if (q5) {
            qh[0] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)b5->qh));
            qh[1] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b5->qh + 16)));
        }
        _Pragma("GCC unroll 4")
        for (int c = 0; c < 4; c++) {
            const __m256i v0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 32 * c)));
            const __m256i v1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 32 * c + 16)));
            __m256i q[2][2] = {{_mm256_and_si256(v0, low4), _mm256_and_si256(v1, low4)},
                               {_mm256_srli_epi16(v0, 4), _mm256_srli_epi16(v1, 4)}};
            _Pragma("GCC unroll 2")
            for (int t = 0; t < 2; t++) {
                const int g = 2 * c + t;
                /* bit g of qh[l] to bit 4 (g is a constant once unrolled) */
                _Pragma("GCC unroll 2")
                for (int h = 0; q5 && h < 2; h++) {
                    const __m256i hb = g >= 4 ? _mm256_srli_epi16(qh[h], g - 4)
                                              : _mm256_slli_epi16(qh[h], 4 - g);
                    q[t][h] = _mm256_or_si256(q[t][h], _mm256_and_si256(hb, bit4));
                }
                const __m128 wsc = _mm_castsi128_ps(
                    _mm_loadl_epi64((const __m128i *)(pairs + k45_pair_pos[g])));
                const int64_t blk = 8 * i + g;
                _Pragma("GCC unroll 4")
                for (int j = 0; j < nc; j++) {
                    const __m256 p = dot16(q[t], &xa[j], blk);
                    const __m128 f = _mm_mul_ps(wsc, act_ds(&xa[j], blk));
                    acc[j] = _mm256_fmadd_ps(_mm256_broadcastss_ps(f), p, acc[j]);
                    off[j] = _mm_add_ps(off[j], f);
                }
            }
        }
    }
    for (int j = 0; j < nc; j++)
        res[j] = hsum8(acc[j]) - _mm_cvtss_f32(_mm_movehdup_ps(off[j]));
}

static SKV_ALWAYS_INLINE void dot_q4_k_nc(const void *w, const struct skv_q16_act *xa,
                                          int64_t nb32, const int nc, float *res)
{
    dot_k45_nc(w, xa, nb32, nc, res, false);
}

static SKV_ALWAYS_INLINE void dot_q5_k_nc(const void *w, const struct skv_q16_act *xa,
                                          int64_t nb32, const int nc, float *res)
{
    dot_k45_nc(w, xa, nb32, nc, res, true);
}

/* Q6_K: sixteen groups of 16 with int8 scales; an activation block spans two groups, so the
 * two halves of its dot are converted to float separately and scaled by d * sc there (an
 * integer multiply of the widened weights by sc cost more). */
static SKV_ALWAYS_INLINE void dot_q6_k_nc(const void *w, const struct skv_q16_act *xa,
                                          int64_t nb32, const int nc, float *res)
{
    const struct skv_block_q6_k *b = w;
    const int64_t nb = nb32 / 8;
    __m256 acc[SKV_DOT_MAX_NC];
    for (int j = 0; j < nc; j++)
        acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        float dsc[16];
        const __m256 wd = _mm256_set1_ps(skv_quant_fp16(b[i].d));
        const __m128i sc = _mm_loadu_si128((const __m128i *)b[i].scales);
        _mm256_storeu_ps(dsc, _mm256_mul_ps(wd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
        _mm256_storeu_ps(dsc + 8, _mm256_mul_ps(wd, _mm256_cvtepi32_ps(
                                                   _mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            q6_bytes(&b[i], h, q);
            _Pragma("GCC unroll 4")
            for (int k = 0; k < 4; k++) {
                const int t = 4 * h + k;
                const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q[k]));
                const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q[k], 1));
                const __m256 s0 = _mm256_broadcast_ss(dsc + 2 * t);
                const __m256 s1 = _mm256_broadcast_ss(dsc + 2 * t + 1);
                const int64_t blk = 8 * i + t;
                _Pragma("GCC unroll 4")
                for (int j = 0; j < nc; j++) {
                    const int16_t *y = xa[j].qs + blk * SKV_QK;
                    const __m256 p0 = _mm256_cvtepi32_ps(
                        _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)y)));
                    const __m256 p1 = _mm256_cvtepi32_ps(
                        _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(y + 16))));
                    const __m256 v = _mm256_fmadd_ps(p1, s1, _mm256_mul_ps(p0, s0));
                    acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xa[j].ds + 2 * blk), v, acc[j]);
                }
            }
        }
    }
    for (int j = 0; j < nc; j++)
        res[j] = hsum8(acc[j]);
}

/* The K-quant kernels work row by row; the switch gives the compiler a constant nc. */
#define SKV_GEMV_ROWS(name)                                                                   \
    static void gemv_##name(const void *w, size_t rb, int64_t nrows,                          \
                            const struct skv_q16_act *xa, int64_t nb, int nc, float *out,     \
                            int64_t os)                                                       \
    {                                                                                         \
        float res[SKV_DOT_MAX_NC];                                                            \
        for (int64_t r = 0; r < nrows; r++) {                                                 \
            const uint8_t *wr = (const uint8_t *)w + r * rb;                                  \
            gemv32_prefetch(w, rb, r + SKV_GEMV_PF_ROWS, 1, nrows);                           \
            switch (nc) {                                                                     \
            case 1: dot_##name##_nc(wr, xa, nb, 1, res); break;                               \
            case 2: dot_##name##_nc(wr, xa, nb, 2, res); break;                               \
            case 3: dot_##name##_nc(wr, xa, nb, 3, res); break;                               \
            default: dot_##name##_nc(wr, xa, nb, 4, res); break;                              \
            }                                                                                 \
            for (int j = 0; j < nc; j++)                                                      \
                out[j * os + r] = res[j];                                                     \
        }                                                                                     \
    }

SKV_GEMV_ROWS(q4_k)
SKV_GEMV_ROWS(q5_k)
SKV_GEMV_ROWS(q6_k)

#define SKV_GEMV32(name, kind)                                                                \
    static void gemv_##name(const void *w, size_t rb, int64_t nrows,                          \
                            const struct skv_q16_act *xa, int64_t nb, int nc, float *out,     \
                            int64_t os)                                                       \
    {                                                                                         \
        gemv32(w, rb, nrows, xa, nb, nc, out, os, kind);                                      \
    }

SKV_GEMV32(q4_0, SKV_DTYPE_Q4_0)
SKV_GEMV32(q4_1, SKV_DTYPE_Q4_1)
SKV_GEMV32(q5_0, SKV_DTYPE_Q5_0)
SKV_GEMV32(q5_1, SKV_DTYPE_Q5_1)
SKV_GEMV32(q8_0, SKV_DTYPE_Q8_0)

skv_q16_gemv_fn skv_q16_gemv_for(int type)
{
    switch (type) {
    case SKV_DTYPE_Q4_0: return gemv_q4_0;
    case SKV_DTYPE_Q4_1: return gemv_q4_1;
    case SKV_DTYPE_Q5_0: return gemv_q5_0;
    case SKV_DTYPE_Q5_1: return gemv_q5_1;
    case SKV_DTYPE_Q8_0: return gemv_q8_0;
    case SKV_DTYPE_Q4_K: return gemv_q4_k;
    case SKV_DTYPE_Q5_K: return gemv_q5_k;
    case SKV_DTYPE_Q6_K: return gemv_q6_k;
    default: return NULL;
    }
}

/* Float weights: 8 elements of the row as floats (kind = the dtype). */
static SKV_ALWAYS_INLINE __m256 wload8(const void *w, int64_t k, const int kind)
{
    if (kind == SKV_DTYPE_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + k)));
    if (kind == SKV_DTYPE_BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)w + k);
}

static SKV_ALWAYS_INLINE float wload1(const void *w, int64_t k, const int kind)
{
    if (kind == SKV_DTYPE_F16)
        return skv_quant_fp16(((const uint16_t *)w)[k]);
    if (kind == SKV_DTYPE_BF16) {
        const uint32_t u = (uint32_t)((const uint16_t *)w)[k] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return ((const float *)w)[k];
}

static SKV_ALWAYS_INLINE void dot_float_nc(const void *w, const float *x, int64_t xs,
                                           int64_t cols, const int nc, float *res, const int kind)
{
    __m256 a0[SKV_DOT_MAX_NC], a1[SKV_DOT_MAX_NC];
    for (int j = 0; j < nc; j++)
        a0[j] = a1[j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= cols; k += 16) {
        const __m256 w0 = wload8(w, k, kind), w1 = wload8(w, k + 8, kind);
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nc; j++) {
            a0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + j * xs + k), a0[j]);
            a1[j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + j * xs + k + 8), a1[j]);
        }
    }
    for (; k + 8 <= cols; k += 8) {
        const __m256 w0 = wload8(w, k, kind);
        for (int j = 0; j < nc; j++)
            a0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + j * xs + k), a0[j]);
    }
    for (int j = 0; j < nc; j++) {
        float r = hsum8(_mm256_add_ps(a0[j], a1[j]));
        for (int64_t t = k; t < cols; t++)
            r += wload1(w, t, kind) * x[j * xs + t];
        res[j] = r;
    }
}

#define SKV_FDOT_DISPATCH(name, kind)                                                         \
    static void name(const void *w, const float *x, int64_t xs, int64_t cols, int nc,        \
                     float *res)                                                              \
    {                                                                                         \
        switch (nc) {                                                                         \
        case 1: dot_float_nc(w, x, xs, cols, 1, res, kind); break;                            \
        case 2: dot_float_nc(w, x, xs, cols, 2, res, kind); break;                            \
        case 3: dot_float_nc(w, x, xs, cols, 3, res, kind); break;                            \
        default: dot_float_nc(w, x, xs, cols, 4, res, kind); break;                           \
        }                                                                                     \
    }

#else /* no AVX2: scalar float dots, no integer kernels */

skv_q16_gemv_fn skv_q16_gemv_for(int type)
{
    (void)type;
    return NULL;
}

static SKV_ALWAYS_INLINE float wload1(const void *w, int64_t k, const int kind)
{
    if (kind == SKV_DTYPE_F16)
        return skv_quant_fp16(((const uint16_t *)w)[k]);
    if (kind == SKV_DTYPE_BF16) {
        const uint32_t u = (uint32_t)((const uint16_t *)w)[k] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return ((const float *)w)[k];
}

#define SKV_FDOT_DISPATCH(name, kind)                                                         \
    static void name(const void *w, const float *x, int64_t xs, int64_t cols, int nc,        \
                     float *res)                                                              \
    {                                                                                         \
        for (int j = 0; j < nc; j++) {                                                        \
            float r = 0.0f;                                                                   \
            for (int64_t k = 0; k < cols; k++)                                                \
                r += wload1(w, k, kind) * x[j * xs + k];                                      \
            res[j] = r;                                                                       \
        }                                                                                     \
    }

#endif

SKV_FDOT_DISPATCH(dot_f32, SKV_DTYPE_F32)
SKV_FDOT_DISPATCH(dot_f16, SKV_DTYPE_F16)
SKV_FDOT_DISPATCH(dot_bf16, SKV_DTYPE_BF16)

skv_f_dot_fn skv_f_dot_for(int type)
{
    switch (type) {
    case SKV_DTYPE_F32: return dot_f32;
    case SKV_DTYPE_F16: return dot_f16;
    case SKV_DTYPE_BF16: return dot_bf16;
    default: return NULL;
    }
}
