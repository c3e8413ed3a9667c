/* CPU backend dequantization, matmul and get_rows: dequantization against gguf-py's output
 * (tests/fixtures/dequant.bin), matmul against a double-precision product of the dequantized
 * weights, get_rows against skv_dequantize_row, for every supported weight type. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "kernels/backend.h"

/* NMSE (sum (out - ref)^2 / sum ref^2) bounds; measured worst cases on this data in brackets.
 * Two references, both in double precision over the dequantized weights:
 *  - ref_f: with x as given. Float weights (F32/F16/BF16), and any type through the sgemm or
 *    the dequantize-then-dot path, only add fp32 accumulation error: NMSE_EXACT [~3e-12].
 *  - ref_q: with x rounded the way the integer GEMV path rounds it (per 32 values to 16 bits,
 *    e = amax / 32767, q = round(x / e)). A quantized type at a small batch must match ref_f
 *    or ref_q within NMSE_EXACT [kernel vs ref_q ~1e-13]; NMSE_EXACT sits below the activation
 *    rounding noise, so the integer path passes only through ref_q and any layout, kernel or
 *    rounding bug shows. It must also stay within that noise of ref_f, about
 *    (amax / 32767)^2 / 12 relative per element, i.e. ~4e-10 here (the former 8-bit
 *    activations gave 258^2 times more, ~2.5e-5, and were checked against 2e-4): NMSE_Q16,
 *    checked where there are enough outputs (>= 64) for the estimate to be stable
 *    [up to ~1.3e-9]. */
#define NMSE_EXACT 1e-10
#define NMSE_Q16 4e-9
#define Q16_PATH_MAX_N 64  /* at or below this batch size a quantized type may use the Q16 path */
/* Activations with one outlier channel 100 times the rest per 32 values, as the residual
 * stream of small Llamas has: the former 8-bit activations rounded most other values to 0
 * or one step (NMSE ~1e-4 against ref_f here); 16 bits keep them: NMSE_OUTLIER [4e-9]. */
#define OUTLIER_SCALE 100.0f
#define NMSE_OUTLIER 2e-8

struct rng {
    uint64_t s;
};

static uint64_t rng_next(struct rng *r)
{
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 0x2545F4914F6CDD1DULL;
}

/* Uniform in [-1, 1). */
static float rng_unit(struct rng *r)
{
    return (float)((double)(rng_next(r) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

/* Roughly normal (sum of uniforms), for activations with an occasional large value. */
static float rng_normal(struct rng *r)
{
    float s = 0.0f;
    for (int i = 0; i < 4; i++)
        s += rng_unit(r);
    return s * 0.866f;
}

static int64_t block_elems(int type)
{
    return skv_dtype_block_elems(type);
}

/* Byte offsets of the fp16 scale fields inside one block (-1 ends the list). */
static const int *fp16_fields(int type)
{
    static const int q_d[] = {0, -1}, q_dm[] = {0, 2, -1}, q2k[] = {80, 82, -1},
                     q3k[] = {108, -1}, q6k[] = {208, -1}, none[] = {-1};
    switch (type) {
    case SKV_DTYPE_Q4_0: case SKV_DTYPE_Q5_0: case SKV_DTYPE_Q8_0: return q_d;
    case SKV_DTYPE_Q4_1: case SKV_DTYPE_Q5_1: case SKV_DTYPE_Q4_K: case SKV_DTYPE_Q5_K: return q_dm;
    case SKV_DTYPE_Q2_K: return q2k;
    case SKV_DTYPE_Q3_K: return q3k;
    case SKV_DTYPE_Q6_K: return q6k;
    default: return none;
    }
}

/* A random weight matrix of `type`: plain types get normal values, block types random bytes
 * with sane scales (dequantization is the reference, so any block content is a valid test). */
static void *random_weights(struct rng *r, int type, int64_t rows, int64_t cols, size_t *nbytes)
{
    const size_t row_bytes = skv_dtype_row_bytes(type, cols);
    const size_t total = row_bytes * (size_t)rows;
    uint8_t *w = malloc(total ? total : 1);
    assert_non_null(w);
    const int64_t count = rows * cols;
    if (type == SKV_DTYPE_F32) {
        for (int64_t i = 0; i < count; i++)
            ((float *)w)[i] = rng_normal(r) * 0.1f;
    } else if (type == SKV_DTYPE_F16 || type == SKV_DTYPE_BF16) {
        for (int64_t i = 0; i < count; i++) {
            const float v = rng_normal(r) * 0.1f;
            ((uint16_t *)w)[i] = type == SKV_DTYPE_F16 ? skv_f32_to_fp16(v) : skv_f32_to_bf16(v);
        }
    } else {
        const size_t bb = skv_dtype_block_bytes(type);
        const size_t nblocks = total / bb;
        for (size_t i = 0; i < total; i++)
            w[i] = (uint8_t)(rng_next(r) >> 56);
        for (size_t b = 0; b < nblocks; b++) {
            uint8_t *blk = w + b * bb;
            for (const int *f = fp16_fields(type); *f >= 0; f++) {
                float v = 0.001f + 0.05f * fabsf(rng_unit(r));
                const uint16_t h = skv_f32_to_fp16(rng_unit(r) < 0 ? -v : v);
                memcpy(blk + *f, &h, sizeof h);
            }
            if (type == SKV_DTYPE_Q8_K) {
                const float d = 0.0005f + 0.005f * fabsf(rng_unit(r));
                memcpy(blk, &d, sizeof d);
            }
        }
    }
    *nbytes = total;
    return w;
}

static double nmse(const float *out, const double *ref, int64_t count)
{
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < count; i++) {
        const double e = (double)out[i] - ref[i];
        num += e * e;
        den += ref[i] * ref[i];
    }
    return den > 0.0 ? num / den : num;
}

/* ---- dequantization against gguf-py ---- */

static uint8_t *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    uint8_t *buf = NULL;
    if (fseek(f, 0, SEEK_END) == 0) {
        const long n = ftell(f);
        if (n > 0 && fseek(f, 0, SEEK_SET) == 0) {
            buf = malloc((size_t)n);
            if (buf != NULL && fread(buf, 1, (size_t)n, f) != (size_t)n) {
                free(buf);
                buf = NULL;
            }
            *len = (size_t)n;
        }
    }
    fclose(f);
    return buf;
}

static uint32_t rd_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void test_dequant_fixtures(void **state)
{
    (void)state;
    const char *src = getenv("SKV_SRCDIR") != NULL ? getenv("SKV_SRCDIR") : ".";
    char path[4096];
    snprintf(path, sizeof path, "%s/tests/fixtures/dequant.bin", src);
    size_t len = 0;
    uint8_t *buf = read_file(path, &len);
    if (buf == NULL)
        fail_msg("cannot read %s (set SKV_SRCDIR to the source tree)", path);
    assert_true(len >= 12);
    assert_memory_equal(buf, "SKVDQ001", 8);
    const uint32_t count = rd_u32(buf + 8);
    assert_int_equal(count, 14);
    size_t off = 12;
    int seen_types = 0;
    for (uint32_t r = 0; r < count; r++) {
        assert_true(off + 12 <= len);
        const int type = (int)rd_u32(buf + off);
        const uint32_t n = rd_u32(buf + off + 4), nbytes = rd_u32(buf + off + 8);
        off += 12;
        assert_true(off + nbytes + 4 * (size_t)n <= len);
        assert_int_equal(skv_dtype_row_bytes(type, n), nbytes);
        /* copy so the block data is aligned as in a GGUF file */
        void *raw = malloc(nbytes);
        float *expect = malloc(4 * (size_t)n), *got = malloc(4 * (size_t)n);
        assert_true(raw != NULL && expect != NULL && got != NULL);
        memcpy(raw, buf + off, nbytes);
        memcpy(expect, buf + off + nbytes, 4 * (size_t)n);
        off += nbytes + 4 * (size_t)n;
        for (uint32_t i = 0; i < n; i++)
            got[i] = NAN;
        assert_int_equal(skv_dequantize_row(type, raw, got, n), SKV_OK);
        for (uint32_t i = 0; i < n; i++) {
            /* same formula as gguf-py; allow one rounding of difference (contraction) */
            const float tol = 1e-6f * (1.0f + fabsf(expect[i]));
            if (!(fabsf(got[i] - expect[i]) <= tol))
                fail_msg("%s element %u: got %.9g, gguf-py %.9g", skv_dtype_name(type), i,
                         (double)got[i], (double)expect[i]);
        }
        seen_types |= 1 << (type % 31);
        free(raw);
        free(expect);
        free(got);
    }
    assert_int_equal(off, len);
    /* the default model's types and the ones the brief requires are all present */
    const int must[] = {SKV_DTYPE_F32, SKV_DTYPE_Q4_1, SKV_DTYPE_Q8_0, SKV_DTYPE_Q4_0,
                        SKV_DTYPE_Q5_0, SKV_DTYPE_Q5_1, SKV_DTYPE_Q4_K, SKV_DTYPE_Q6_K};
    for (size_t i = 0; i < sizeof must / sizeof must[0]; i++)
        assert_true(seen_types & (1 << must[i]));
    free(buf);
}

static void test_dequant_errors(void **state)
{
    (void)state;
    float y[64];
    uint8_t raw[64] = {0};
    assert_int_equal(skv_dequantize_row(SKV_DTYPE_Q4_0, raw, y, 31), SKV_E_INVAL);
    assert_int_equal(skv_dequantize_row(SKV_DTYPE_Q4_K, raw, y, 32), SKV_E_INVAL);
    assert_int_equal(skv_dequantize_row(SKV_DTYPE_I32, raw, y, 4), SKV_E_UNSUPPORTED);
    assert_int_equal(skv_dequantize_row(99, raw, y, 4), SKV_E_UNSUPPORTED);
    assert_int_equal(skv_dequantize_row(SKV_DTYPE_F32, raw, y, -1), SKV_E_INVAL);
    assert_int_equal(skv_dequantize_row(SKV_DTYPE_Q8_0, raw, y, 0), SKV_OK);
}

/* ---- matmul ---- */

static const int all_types[] = {
    SKV_DTYPE_F32, SKV_DTYPE_F16, SKV_DTYPE_BF16, SKV_DTYPE_Q4_0, SKV_DTYPE_Q4_1,
    SKV_DTYPE_Q5_0, SKV_DTYPE_Q5_1, SKV_DTYPE_Q8_0, SKV_DTYPE_Q2_K, SKV_DTYPE_Q3_K,
    SKV_DTYPE_Q4_K, SKV_DTYPE_Q5_K, SKV_DTYPE_Q6_K, SKV_DTYPE_Q8_K,
};
#define N_TYPES (sizeof all_types / sizeof all_types[0])

/* x as the integer GEMV path sees it (kernels/cpu/quant.c, the same float operations): per
 * 32 values e = amax / 32767, q = round(x * 32767 / amax), x ~= e * q. */
static void q16_round(const float *x, float *xq, int64_t count)
{
    for (int64_t b = 0; b < count; b += 32) {
        float amax = 0.0f;
        for (int l = 0; l < 32; l++)
            amax = fmaxf(amax, fabsf(x[b + l]));
        const float e = amax / 32767.0f, id = amax > 0.0f ? 32767.0f / amax : 0.0f;
        for (int l = 0; l < 32; l++)
            xq[b + l] = e * nearbyintf(x[b + l] * id);
    }
}

struct mm_result {
    double nmse_f;   /* against ref_f */
    double nmse_q;   /* against ref_q (only when asked for) */
};

/* Runs one random matmul and measures it against the references; with outlier > 0, element
 * 5 of every 32 of x is scaled by it. */
static struct mm_result check_matmul(struct skv_backend *be, struct rng *r, int type,
                                     int64_t rows, int64_t cols, int n, bool with_bias,
                                     bool want_q, float outlier)
{
    size_t nbytes;
    void *wdata = random_weights(r, type, rows, cols, &nbytes);
    struct skv_tensor w = {
        .type = type, .ndim = 2, .ne = {cols, rows, 1, 1}, .data = wdata, .nbytes = nbytes,
        .name = "w",
    };
    float *x = malloc(sizeof(float) * (size_t)(n * cols));
    float *xq = malloc(sizeof(float) * (size_t)(n * cols));
    float *out = malloc(sizeof(float) * (size_t)(n * rows));
    float *bias = malloc(sizeof(float) * (size_t)rows);
    float *wrow = malloc(sizeof(float) * (size_t)cols);
    double *ref_f = malloc(sizeof(double) * (size_t)(n * rows));
    double *ref_q = malloc(sizeof(double) * (size_t)(n * rows));
    assert_true(x && xq && out && bias && wrow && ref_f && ref_q);
    for (int64_t i = 0; i < n * cols; i++)
        x[i] = rng_normal(r) * (outlier > 0.0f && i % 32 == 5 ? outlier : 1.0f);
    for (int64_t i = 0; i < rows; i++)
        bias[i] = rng_unit(r);
    for (int64_t i = 0; i < n * rows; i++)
        out[i] = NAN;
    if (want_q)
        q16_round(x, xq, n * cols);

    const size_t rb = skv_dtype_row_bytes(type, cols);
    for (int64_t i = 0; i < rows; i++) {
        assert_int_equal(skv_dequantize_row(type, (uint8_t *)wdata + i * rb, wrow, cols), SKV_OK);
        for (int j = 0; j < n; j++) {
            double sf = with_bias ? bias[i] : 0.0, sq = sf;
            for (int64_t k = 0; k < cols; k++) {
                sf += (double)wrow[k] * x[j * cols + k];
                if (want_q)
                    sq += (double)wrow[k] * xq[j * cols + k];
            }
            ref_f[j * rows + i] = sf;
            ref_q[j * rows + i] = sq;
        }
    }
    const int rc = be->ops->matmul(be, out, &w, with_bias ? bias : NULL, x, n);
    if (rc != SKV_OK)
        fail_msg("matmul %s: %s", skv_dtype_name(type), skv_error_msg());
    for (int64_t i = 0; i < n * rows; i++)
        if (!isfinite(out[i]))
            fail_msg("%s rows %lld cols %lld n %d: out[%lld] not written", skv_dtype_name(type),
                     (long long)rows, (long long)cols, n, (long long)i);
    struct mm_result res = {nmse(out, ref_f, n * rows), want_q ? nmse(out, ref_q, n * rows) : 1.0};
    free(wdata);
    free(x);
    free(xq);
    free(out);
    free(bias);
    free(wrow);
    free(ref_f);
    free(ref_q);
    return res;
}

static void matmul_types(void **state, bool float_types)
{
    struct skv_backend *be = *state;
    struct rng r = {float_types ? 0x1234567ULL : 0x9abcdefULL};
    static const int ns[] = {1, 2, 3, 7, 13, 64, 300};
    for (size_t t = 0; t < N_TYPES; t++) {
        const int type = all_types[t];
        const int64_t qk = block_elems(type);
        if ((qk == 1) != float_types)
            continue;
        /* (rows, cols): odd rows counts, cols from one block to 4096 */
        const int64_t shapes[4][2] = {
            {1, qk == 1 ? 37 : qk},
            {7, 4096},
            {33, qk == 256 ? 768 : 576},
            {257, qk == 256 ? 512 : (qk == 1 ? 100 : 96)},
        };
        double worst_exact = 0.0, worst_q16 = 0.0;
        for (int s = 0; s < 4; s++)
            for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
                const int n = ns[k];
                const int64_t rows = shapes[s][0], cols = shapes[s][1];
                const bool small_q = qk > 1 && n <= Q16_PATH_MAX_N;
                const struct mm_result e = check_matmul(be, &r, type, rows, cols, n,
                                                        (s + k) % 2 == 1, small_q, 0.0f);
                const double exact = e.nmse_f < e.nmse_q ? e.nmse_f : e.nmse_q;
                if (!(exact <= NMSE_EXACT))
                    fail_msg("%s rows %lld cols %lld n %d: nmse %.3g (q16 ref %.3g) > %.1g",
                             skv_dtype_name(type), (long long)rows, (long long)cols, n,
                             e.nmse_f, e.nmse_q, NMSE_EXACT);
                if (small_q && n * rows >= 64 && !(e.nmse_f <= NMSE_Q16))
                    fail_msg("%s rows %lld cols %lld n %d: nmse %.3g > %.1g",
                             skv_dtype_name(type), (long long)rows, (long long)cols, n,
                             e.nmse_f, NMSE_Q16);
                if (exact > worst_exact)
                    worst_exact = exact;
                if (small_q && n * rows >= 64 && e.nmse_f > worst_q16)
                    worst_q16 = e.nmse_f;
            }
        print_message("  %-5s worst nmse: exact-ref %.2g, small-n vs float x %.2g\n",
                      skv_dtype_name(type), worst_exact, worst_q16);
    }
}

static void test_matmul_float_weights(void **state)
{
    matmul_types(state, true);
}

static void test_matmul_quant_weights(void **state)
{
    matmul_types(state, false);
}

/* The integer path keeps its precision with an outlier channel in the activations. */
static void test_matmul_outlier_activations(void **state)
{
    struct skv_backend *be = *state;
    struct rng r = {0x0171e5ULL};
    static const int types[] = {SKV_DTYPE_Q4_0, SKV_DTYPE_Q4_1, SKV_DTYPE_Q5_1, SKV_DTYPE_Q8_0,
                                SKV_DTYPE_Q4_K, SKV_DTYPE_Q5_K, SKV_DTYPE_Q6_K};
    static const int ns[] = {1, 4, 16};
    double worst = 0.0;
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++)
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            const struct mm_result e = check_matmul(be, &r, types[t], 64, 768, ns[k], false,
                                                    true, OUTLIER_SCALE);
            if (!(e.nmse_q <= NMSE_EXACT) || !(e.nmse_f <= NMSE_OUTLIER))
                fail_msg("%s n %d with outliers: nmse %.3g (q16 ref %.3g), limits %.1g / %.1g",
                         skv_dtype_name(types[t]), ns[k], e.nmse_f, e.nmse_q, NMSE_OUTLIER,
                         NMSE_EXACT);
            if (e.nmse_f > worst)
                worst = e.nmse_f;
        }
    print_message("  outlier activations: worst nmse vs float x %.2g\n", worst);
}

/* 3-D weights count the trailing dimensions as rows. */
static void test_matmul_3d_weight(void **state)
{
    struct skv_backend *be = *state;
    float w[2 * 3 * 4], x[4] = {1, 2, 3, 4}, out[6];
    for (int i = 0; i < 24; i++)
        w[i] = (float)i;
    struct skv_tensor t = {.type = SKV_DTYPE_F32, .ndim = 3, .ne = {4, 3, 2, 1}, .data = w,
                           .nbytes = sizeof w};
    assert_int_equal(be->ops->matmul(be, out, &t, NULL, x, 1), SKV_OK);
    for (int r = 0; r < 6; r++)
        assert_float_equal(out[r], 10.0f * 4 * r + 20.0f, 1e-4);
}

static void test_matmul_errors(void **state)
{
    struct skv_backend *be = *state;
    uint8_t data[4096] = {0};
    float x[256] = {0}, out[64];
    struct skv_tensor w = {.type = SKV_DTYPE_Q4_1, .ndim = 2, .ne = {64, 8, 1, 1}, .data = data,
                           .nbytes = 8 * 2 * 20};
    assert_int_equal(be->ops->matmul(be, out, &w, NULL, x, 0), SKV_OK);
    assert_int_equal(be->ops->matmul(be, out, &w, NULL, x, 1), SKV_OK);
    w.nbytes = 8 * 2 * 20 - 1;
    assert_int_equal(be->ops->matmul(be, out, &w, NULL, x, 1), SKV_E_INVAL);
    w.nbytes = sizeof data;
    w.ne[0] = 48;   /* not a whole number of blocks */
    assert_int_equal(be->ops->matmul(be, out, &w, NULL, x, 1), SKV_E_INVAL);
    w.ne[0] = 64;
    w.type = SKV_DTYPE_I32;
    assert_int_equal(be->ops->matmul(be, out, &w, NULL, x, 1), SKV_E_UNSUPPORTED);
    w.type = SKV_DTYPE_Q4_1;
    assert_int_equal(be->ops->matmul(be, out, &w, NULL, x, -1), SKV_E_INVAL);
    w.data = NULL;
    assert_int_equal(be->ops->matmul(be, out, &w, NULL, x, 1), SKV_E_INVAL);
}

/* matmul_multi computes each weight exactly as matmul does: the fused integer path (shared
 * quantized x, one job over every row) is bit-identical to separate calls, for row counts
 * that do not line up with the grain and for batches past the GEMV limit (which loop). */
static void test_matmul_multi(void **state)
{
    struct skv_backend *be = *state;
    struct rng r = {0x77aa55ULL};
    static const int types[][3] = {
        {SKV_DTYPE_Q4_1, SKV_DTYPE_Q4_1, SKV_DTYPE_Q4_1},
        {SKV_DTYPE_Q8_0, SKV_DTYPE_Q4_K, SKV_DTYPE_Q6_K},
        {SKV_DTYPE_Q4_0, SKV_DTYPE_F32, SKV_DTYPE_BF16},   /* float weights: not fused */
    };
    static const int64_t rows[3] = {576, 37, 200};
    static const int ns[] = {1, 3, 32, 40};
    const int64_t cols = 256;
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
            const int n = ns[ni];
            struct skv_tensor w[3];
            struct skv_matmul_part parts[3];
            float *sep[3], *bias = malloc(sizeof(float) * 576);
            float *x = malloc(sizeof(float) * (size_t)(n * cols));
            assert_non_null(bias);
            assert_non_null(x);
            for (int64_t i = 0; i < n * cols; i++)
                x[i] = rng_normal(&r);
            for (int i = 0; i < 576; i++)
                bias[i] = rng_unit(&r);
            for (int k = 0; k < 3; k++) {
                size_t nbytes;
                w[k] = (struct skv_tensor){.type = types[ti][k], .ndim = 2, .ne = {cols, rows[k], 1, 1},
                                           .name = "w"};
                w[k].data = random_weights(&r, types[ti][k], rows[k], cols, &nbytes);
                w[k].nbytes = nbytes;
                sep[k] = malloc(sizeof(float) * (size_t)(n * rows[k]));
                parts[k] = (struct skv_matmul_part){malloc(sizeof(float) * (size_t)(n * rows[k])), &w[k],
                                                    k == 1 ? bias : NULL};
                assert_non_null(sep[k]);
                assert_non_null(parts[k].out);
                for (int64_t i = 0; i < n * rows[k]; i++)
                    parts[k].out[i] = NAN;
                assert_int_equal(be->ops->matmul(be, sep[k], &w[k], parts[k].bias, x, n), SKV_OK);
            }
            assert_int_equal(be->ops->matmul_multi(be, parts, 3, x, n), SKV_OK);
            for (int k = 0; k < 3; k++) {
                if (memcmp(sep[k], parts[k].out, sizeof(float) * (size_t)(n * rows[k])) != 0)
                    fail_msg("matmul_multi %s n=%d weight %d differs from matmul",
                             skv_dtype_name(types[ti][k]), n, k);
                free(sep[k]);
                free(parts[k].out);
                free(w[k].data);
            }
            free(bias);
            free(x);
        }
    }
}

static void test_matmul_multi_errors(void **state)
{
    struct skv_backend *be = *state;
    uint8_t data[4096] = {0};
    float x[256] = {0}, out[2][64];
    struct skv_tensor a = {.type = SKV_DTYPE_Q4_1, .ndim = 2, .ne = {64, 8, 1, 1}, .data = data,
                           .nbytes = sizeof data};
    struct skv_tensor b = a;
    b.ne[0] = 32;
    struct skv_matmul_part parts[9];
    for (int i = 0; i < 9; i++)
        parts[i] = (struct skv_matmul_part){out[0], &a, NULL};
    parts[1].out = out[1];
    assert_int_equal(be->ops->matmul_multi(be, parts, 2, x, 1), SKV_OK);
    assert_int_equal(be->ops->matmul_multi(be, parts, 0, x, 1), SKV_E_INVAL);
    assert_int_equal(be->ops->matmul_multi(be, parts, 9, x, 1), SKV_E_INVAL);
    assert_int_equal(be->ops->matmul_multi(be, parts, 2, NULL, 1), SKV_E_INVAL);
    parts[1].w = &b;   /* columns differ */
    assert_int_equal(be->ops->matmul_multi(be, parts, 2, x, 1), SKV_E_INVAL);
    parts[1].w = NULL;
    assert_int_equal(be->ops->matmul_multi(be, parts, 2, x, 1), SKV_E_INVAL);
}

/* ---- get_rows ---- */

static void test_get_rows(void **state)
{
    struct skv_backend *be = *state;
    struct rng r = {0x5eed5eedULL};
    for (size_t t = 0; t < N_TYPES; t++) {
        const int type = all_types[t];
        const int64_t cols = block_elems(type) == 1 ? 300 : 2 * 256;
        const int64_t rows = 37;
        size_t nbytes;
        void *table = random_weights(&r, type, rows, cols, &nbytes);
        struct skv_tensor tt = {.type = type, .ndim = 2, .ne = {cols, rows, 1, 1},
                                .data = table, .nbytes = nbytes, .name = "table"};
        const size_t rb = skv_dtype_row_bytes(type, cols);
        float *want = malloc(sizeof(float) * (size_t)cols);
        assert_non_null(want);
        static const int ns[] = {1, 5, 300};   /* 300 x 512 takes the parallel path */
        for (size_t k = 0; k < 3; k++) {
            const int n = ns[k];
            int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
            float *out = malloc(sizeof(float) * (size_t)(n * cols));
            assert_true(ids && out);
            for (int i = 0; i < n; i++)
                ids[i] = i == 0 ? (int32_t)(rows - 1) : (int32_t)(rng_next(&r) % rows);
            for (int64_t i = 0; i < n * cols; i++)
                out[i] = NAN;
            assert_int_equal(be->ops->get_rows(be, out, &tt, ids, n), SKV_OK);
            for (int i = 0; i < n; i++) {
                assert_int_equal(skv_dequantize_row(type, (uint8_t *)table + ids[i] * rb, want,
                                                    cols), SKV_OK);
                assert_memory_equal(out + i * cols, want, sizeof(float) * (size_t)cols);
            }
            free(ids);
            free(out);
        }
        int32_t bad[2] = {0, (int32_t)rows};
        float out2[2 * 512];
        assert_int_equal(be->ops->get_rows(be, out2, &tt, bad, 2), SKV_E_INVAL);
        bad[1] = -1;
        assert_int_equal(be->ops->get_rows(be, out2, &tt, bad, 2), SKV_E_INVAL);
        free(want);
        free(table);
    }
}

static int group_setup(void **state)
{
    struct skv_backend *be = NULL;
    if (skv_backend_cpu_new(2, &be) != SKV_OK)
        return -1;
    *state = be;
    return 0;
}

static int group_teardown(void **state)
{
    struct skv_backend *be = *state;
    skv_backend_destroy(&be);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dequant_fixtures),
        cmocka_unit_test(test_dequant_errors),
        cmocka_unit_test(test_matmul_float_weights),
        cmocka_unit_test(test_matmul_quant_weights),
        cmocka_unit_test(test_matmul_outlier_activations),
        cmocka_unit_test(test_matmul_3d_weight),
        cmocka_unit_test(test_matmul_errors),
        cmocka_unit_test(test_matmul_multi),
        cmocka_unit_test(test_matmul_multi_errors),
        cmocka_unit_test(test_get_rows),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
