/* The dtype table (GGML ids, block sizes, names, what the CPU backend supports) and the
 * scalar fp16 / bf16 <-> f32 conversions, exact and round-to-nearest-even, that every
 * loader and kernel shares; the Q8_0 quantizer of q8_0 KV rows. */
#include "kernels/backend.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

struct dtype_info {
    const char *name;    /* NULL: id not a known type */
    int64_t block_elems; /* elements per block; 1 for plain types */
    size_t block_bytes;  /* bytes per block */
    bool supported;      /* the CPU backend dequantizes and multiplies it */
};

/* Indexed by enum skv_dtype; GGML's block layouts (QK4_0 = 32, QK_K = 256). Ids 4 and 5
 * (removed Q4_2 / Q4_3), 16..23 and 29 (IQ types) are not known here. */
static const struct dtype_info dtype_table[SKV_DTYPE_COUNT] = {
    [SKV_DTYPE_F32] = {"f32", 1, 4, true},
    [SKV_DTYPE_F16] = {"f16", 1, 2, true},
    [SKV_DTYPE_Q4_0] = {"q4_0", 32, 18, true},  /* f16 d, 16 B of nibbles */
    [SKV_DTYPE_Q4_1] = {"q4_1", 32, 20, true},  /* f16 d, f16 m, 16 B of nibbles */
    [SKV_DTYPE_Q5_0] = {"q5_0", 32, 22, true},  /* f16 d, 4 B high bits, 16 B nibbles */
    [SKV_DTYPE_Q5_1] = {"q5_1", 32, 24, true},  /* f16 d, f16 m, 4 B high bits, 16 B */
    [SKV_DTYPE_Q8_0] = {"q8_0", 32, 34, true},  /* f16 d, 32 int8 */
    [SKV_DTYPE_Q8_1] = {"q8_1", 32, 36, false}, /* f16 d, f16 s, 32 int8 */
    [SKV_DTYPE_Q2_K] = {"q2_K", 256, 84, true},
    [SKV_DTYPE_Q3_K] = {"q3_K", 256, 110, true},
    [SKV_DTYPE_Q4_K] = {"q4_K", 256, 144, true},
    [SKV_DTYPE_Q5_K] = {"q5_K", 256, 176, true},
    [SKV_DTYPE_Q6_K] = {"q6_K", 256, 210, true},
    [SKV_DTYPE_Q8_K] = {"q8_K", 256, 292, true}, /* f32 d, 256 int8, 16 int16 sums */
    [SKV_DTYPE_I8] = {"i8", 1, 1, false},
    [SKV_DTYPE_I16] = {"i16", 1, 2, false},
    [SKV_DTYPE_I32] = {"i32", 1, 4, false},
    [SKV_DTYPE_I64] = {"i64", 1, 8, false},
    [SKV_DTYPE_F64] = {"f64", 1, 8, false},
    [SKV_DTYPE_BF16] = {"bf16", 1, 2, true},
};

static const struct dtype_info *dtype_info(int type)
{
    if (type < 0 || type >= SKV_DTYPE_COUNT || dtype_table[type].name == NULL)
        return NULL;
    return &dtype_table[type];
}

const char *skv_dtype_name(int type)
{
    const struct dtype_info *info = dtype_info(type);
    return info ? info->name : NULL;
}

int skv_kv_type_parse(const char *name)
{
    return !name ? -1 : strcmp(name, "f32") == 0 ? SKV_DTYPE_F32 : strcmp(name, "f16") == 0 ? SKV_DTYPE_F16
           : strcmp(name, "q8_0") == 0 ? SKV_DTYPE_Q8_0 : -1;
}

int64_t skv_dtype_block_elems(int type)
{
    const struct dtype_info *info = dtype_info(type);
    return info ? info->block_elems : 0;
}

size_t skv_dtype_block_bytes(int type)
{
    const struct dtype_info *info = dtype_info(type);
    return info ? info->block_bytes : 0;
}

size_t skv_dtype_row_bytes(int type, int64_t n)
{
    const struct dtype_info *info = dtype_info(type);
    if (info == NULL || n < 0 || n % info->block_elems != 0)
        return 0;
    uint64_t blocks = (uint64_t)(n / info->block_elems);
    if (blocks > SIZE_MAX / info->block_bytes)
        return 0; /* does not fit in size_t: treat like an invalid row */
    return (size_t)blocks * info->block_bytes;
}

bool skv_dtype_supported(int type)
{
    const struct dtype_info *info = dtype_info(type);
    return info != NULL && info->supported;
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float skv_fp16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;

    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24, exact in f32 */
        float mag = (float)mant * 0x1p-24f;
        return bits_f32(sign | f32_bits(mag));
    }
    if (exp == 31) {
        if (mant == 0)
            return bits_f32(sign | 0x7f800000u);
        /* NaN: keep the payload, set the quiet bit (what F16C does) */
        return bits_f32(sign | 0x7fc00000u | (mant << 13));
    }
    return bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t skv_f32_to_fp16(float f)
{
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7fffffffu;

    if (ax >= 0x7f800000u) {
        if (ax == 0x7f800000u)
            return sign | 0x7c00;
        /* NaN: quiet, top payload bits kept */
        return sign | 0x7e00 | (uint16_t)((ax >> 13) & 0x3ff);
    }
    if (ax >= 0x477ff000u) /* >= 65520: rounds past 65504 to infinity */
        return sign | 0x7c00;
    if (ax < 0x38800000u) {
        /* below 2^-14: a subnormal half, mantissa = round(|f| / 2^-24) */
        if (ax <= 0x33000000u) /* <= 2^-25: rounds to zero (the tie goes to even 0) */
            return sign;
        uint32_t e = ax >> 23;
        uint32_t m = (ax & 0x7fffffu) | 0x800000u; /* |f| = m * 2^(e - 150) */
        uint32_t shift = 126 - e;                   /* 14..24 */
        uint32_t q = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1)))
            q++; /* may carry into the smallest normal, whose encoding follows on */
        return sign | (uint16_t)q;
    }
    /* normal: round away the low 13 mantissa bits to nearest even, then rebias 127 -> 15 */
    uint32_t r = ax + 0xfffu + ((ax >> 13) & 1);
    r -= 112u << 23;
    return sign | (uint16_t)(r >> 13);
}

float skv_bf16_to_f32(uint16_t h)
{
    return bits_f32((uint32_t)h << 16);
}

uint16_t skv_f32_to_bf16(float f)
{
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40); /* NaN stays NaN (quiet) */
    /* round to nearest even; overflow carries into infinity as it should */
    x += 0x7fffu + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

void skv_quantize_row_q8_0(void *dst, const float *src, int64_t n)
{
    uint8_t *o = dst;
    for (int64_t b = 0; b + 32 <= n; b += 32, o += 34, src += 32) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(src[i]);
            amax = a > amax ? a : amax; /* a NaN never passes */
        }
        float d = amax / 127.0f;
        d = d >= 65520.0f ? 65504.0f : d; /* below 65520 it rounds to 65504 as an f16 by itself */
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        const uint16_t h = skv_f32_to_fp16(d);
        memcpy(o, &h, sizeof h);
        for (int i = 0; i < 32; i++) {
            const float v = src[i] * id;
            const float r = v >= 127.0f ? 127.0f : v <= -127.0f ? -127.0f : v == v ? roundf(v) : 0.0f;
            o[2 + i] = (uint8_t)(int8_t)r;
        }
    }
}
