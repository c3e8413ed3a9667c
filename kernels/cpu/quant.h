/* Internal to the CPU backend: the GGML block layouts (byte for byte; gguf-py's quants.py is
 * the reference they are tested against), the 16-bit activation rows the quantized GEMV
 * multiplies against, and the per-type dot kernels matmul.c dispatches to. */
#ifndef SKV_CPU_QUANT_H
#define SKV_CPU_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

#define SKV_QK 32            /* elements per block of the 32-wide formats */
#define SKV_QK_K 256         /* elements per K-quant super-block */
#define SKV_K_SCALE_SIZE 12  /* packed 6-bit scales and mins of Q4_K / Q5_K */

/* fp16 fields are raw IEEE half bits. x = element value. */
struct skv_block_q4_0 {      /* x = d * (q - 8), q 4 bits */
    uint16_t d;
    uint8_t qs[SKV_QK / 2];  /* element i low nibble of qs[i], element i + 16 high nibble */
};
struct skv_block_q4_1 {      /* x = d * q + m */
    uint16_t d, m;
    uint8_t qs[SKV_QK / 2];
};
struct skv_block_q5_0 {      /* x = d * (q - 16), q = nibble | bit i of qh << 4 */
    uint16_t d;
    uint8_t qh[4];           /* little-endian 32-bit mask, bit i = 5th bit of element i */
    uint8_t qs[SKV_QK / 2];
};
struct skv_block_q5_1 {      /* x = d * q + m */
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[SKV_QK / 2];
};
struct skv_block_q8_0 {      /* x = d * q */
    uint16_t d;
    int8_t qs[SKV_QK];
};
struct skv_block_q2_k {      /* 16 groups of 16: x = d * (sc & 15) * q - dmin * (sc >> 4) */
    uint8_t scales[SKV_QK_K / 16];
    uint8_t qs[SKV_QK_K / 4];        /* 2 bits; per 128: byte l, shift 2k -> element 32k + l */
    uint16_t d, dmin;
};
struct skv_block_q3_k {      /* 16 groups of 16: x = d * (sc - 32) * (q - 4 * !hbit) */
    uint8_t hmask[SKV_QK_K / 8];     /* bit j of byte l: high bit of element 32j + l */
    uint8_t qs[SKV_QK_K / 4];        /* low 2 bits, as Q2_K */
    uint8_t scales[12];              /* 16 x 6 bits */
    uint16_t d;
};
struct skv_block_q4_k {      /* 8 groups of 32: x = d * sc * q - dmin * m */
    uint16_t d, dmin;
    uint8_t scales[SKV_K_SCALE_SIZE]; /* 8 x (6-bit scale, 6-bit min) */
    uint8_t qs[SKV_QK_K / 2];        /* per 64: 32 bytes, low nibbles group 2c, high 2c + 1 */
};
struct skv_block_q5_k {      /* as Q4_K with a 5th bit: bit j of qh[l] for element 32j + l */
    uint16_t d, dmin;
    uint8_t scales[SKV_K_SCALE_SIZE];
    uint8_t qh[SKV_QK_K / 8];
    uint8_t qs[SKV_QK_K / 2];
};
struct skv_block_q6_k {      /* 16 groups of 16: x = d * sc * (q - 32), q 6 bits */
    uint8_t ql[SKV_QK_K / 2];        /* low 4 bits */
    uint8_t qh[SKV_QK_K / 4];        /* high 2 bits */
    int8_t scales[SKV_QK_K / 16];
    uint16_t d;
};
struct skv_block_q8_k {      /* x = d * q; bsums are per-16 sums of q */
    float d;
    int8_t qs[SKV_QK_K];
    int16_t bsums[SKV_QK_K / 16];
};

/* Half precision bits -> float, inline for the kernels. */
static inline float skv_quant_fp16(uint16_t h)
{
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return skv_fp16_to_f32(h);
#endif
}

/* True when skv_dequantize_row() and the matmul handle this type. */
bool skv_quant_supported(int type);

/* One activation row quantized to 16 bits per 32 elements: x[k] ~= e_b * qs[k] with b = k / 32,
 * e_b = amax_b / 32767, and s_b = e_b * (sum of block b's qs), which the offset and min formats
 * need. e_b and s_b sit side by side so a kernel loads both with one 8-byte load. */
struct skv_q16_act {
    const int16_t *qs;   /* [cols] */
    const float *ds;     /* [cols / 32][2]: e_b, s_b */
};

/* Bytes one quantized row of `cols` (a multiple of 32) takes in a buffer; a multiple of 64. */
size_t skv_q16_act_bytes(int64_t cols);
/* Quantizes x[cols] into buf (skv_q16_act_bytes(cols) bytes) and points *act into it. */
void skv_q16_act_quantize(const float *x, int64_t cols, void *buf, struct skv_q16_act *act);

/* Most activation columns one dot kernel call handles (the weight row is decoded once for
 * all of them). */
#define SKV_DOT_MAX_NC 4

/* out[j * out_stride + r] = sum_k W_r[k] * X_j[k] for rows r < nrows (row_bytes apart from w)
 * and columns j < nc (1 <= nc <= SKV_DOT_MAX_NC), rows of nb32 * 32 elements in their block
 * format, X_j the quantized activation xa[j]. NULL when the type has no integer kernel in
 * this build (matmul falls back to floats). */
typedef void (*skv_q16_gemv_fn)(const void *w, size_t row_bytes, int64_t nrows,
                                const struct skv_q16_act *xa, int64_t nb32, int nc, float *out,
                                int64_t out_stride);
skv_q16_gemv_fn skv_q16_gemv_for(int type);

/* res[j] = sum_k W[k] * x[j * x_stride + k], k < cols, for a float weight row
 * (F32, F16 or BF16; any cols). NULL for other types. */
typedef void (*skv_f_dot_fn)(const void *w, const float *x, int64_t x_stride, int64_t cols,
                             int nc, float *res);
skv_f_dot_fn skv_f_dot_for(int type);

#endif
