/* Op parity tests: every elementwise op and attention of each compiled backend, called
 * through be->ops on seeded random data, against naive double-precision references written
 * here; plus the CPU thread pool, scratch buffers, determinism and backend selection.
 * Outputs are poisoned with NaN first, so an element an op forgets to write fails. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <dirent.h>
#include <signal.h>

#include "common/status.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"

/* NMSE = sum (got - ref)^2 / sum ref^2 must stay under these (fp32 outputs). */
#define NMSE_RMSNORM 1e-12
#define NMSE_ROPE 1e-10
#define NMSE_SWIGLU 1e-12
#define NMSE_ADD 1e-14
#define NMSE_MATMUL_F32 1e-10
#define NMSE_ATTENTION 1e-10

#define TEST_THREADS 2

struct fixture {
    struct skv_backend *be;   /* NULL: backend not available, tests skip */
};

/* ---- helpers ---------------------------------------------------------------------- */

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

static double rng_uniform(struct rng *r) /* [0, 1) */
{
    return (double)(rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

static double rng_normal(struct rng *r)
{
    double u = rng_uniform(r), v = rng_uniform(r);
    return sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v);
}

static float *host_normal(struct rng *r, size_t count, double scale)
{
    float *p = malloc(count * sizeof(float) + 1);
    assert_non_null(p);
    for (size_t i = 0; i < count; i++)
        p[i] = (float)(rng_normal(r) * scale);
    return p;
}

static float *host_nan(size_t count)
{
    float *p = malloc(count * sizeof(float) + 1);
    assert_non_null(p);
    for (size_t i = 0; i < count; i++)
        p[i] = NAN;
    return p;
}

static double *host_double(size_t count)
{
    double *p = calloc(count + 1, sizeof(double));
    assert_non_null(p);
    return p;
}

static void *dev_from(struct skv_backend *be, const void *src, size_t bytes)
{
    void *p = NULL;
    assert_int_equal(be->ops->alloc(be, bytes, &p), SKV_OK);
    assert_non_null(p);
    assert_int_equal(be->ops->upload(be, p, src, bytes), SKV_OK);
    return p;
}

static void dev_to(struct skv_backend *be, void *dst, const void *src, size_t bytes)
{
    assert_int_equal(be->ops->sync(be), SKV_OK);
    assert_int_equal(be->ops->download(be, dst, src, bytes), SKV_OK);
}

static double nmse(const float *got, const double *ref, size_t count)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < count; i++) {
        if (!isfinite(got[i]))
            return INFINITY;
        double e = (double)got[i] - ref[i];
        num += e * e;
        den += ref[i] * ref[i];
    }
    return den > 0.0 ? num / den : num;
}

static void check_nmse(const char *what, const float *got, const double *ref, size_t count,
                       double limit)
{
    double e = nmse(got, ref, count);
    if (!(e < limit)) {
        print_error("%s: NMSE %.3g over limit %.3g\n", what, e, limit);
        fail();
    }
}

static struct skv_backend *fixture_be(void **state)
{
    struct fixture *f = *state;
    if (!f || !f->be)
        skip();
    return f->be;
}

/* ---- references ------------------------------------------------------------------- */

static void rmsnorm_ref(double *out, const float *x, const float *w, int n, int dim, double eps)
{
    for (int r = 0; r < n; r++) {
        double ss = 0.0;
        for (int i = 0; i < dim; i++)
            ss += (double)x[r * dim + i] * x[r * dim + i];
        double s = 1.0 / sqrt(ss / dim + eps);
        for (int i = 0; i < dim; i++)
            out[r * dim + i] = x[r * dim + i] * s * w[i];
    }
}

/* Inverse frequency of pair j, following HF transformers' rope init (default + llama3). */
static double rope_inv_freq_hf(const struct skv_rope *rp, int j)
{
    double f = 1.0 / pow(rp->theta, (2.0 * j) / rp->rot_dim);
    if (rp->l3_factor == 0.0f)
        return f;
    double low_wl = rp->l3_original_ctx / (double)rp->l3_low_freq_factor;
    double high_wl = rp->l3_original_ctx / (double)rp->l3_high_freq_factor;
    double wl = 2.0 * 3.14159265358979323846 / f;
    double scaled = wl > low_wl ? f / rp->l3_factor : f;
    double smooth = (rp->l3_original_ctx / wl - rp->l3_low_freq_factor) /
                    (rp->l3_high_freq_factor - rp->l3_low_freq_factor);
    double smoothed = (1.0 - smooth) * scaled / rp->l3_factor + smooth * scaled;
    bool medium = !(wl < high_wl) && !(wl > low_wl);
    return medium ? smoothed : scaled;
}

/* ... then divided by pair j's frequency factor, as llama.cpp's rope applies freq_factors. */
static double rope_inv_freq_ref(const struct skv_rope *rp, int j)
{
    double f = rope_inv_freq_hf(rp, j);
    return rp->freq_factors ? f / rp->freq_factors[j] : f;
}

static void rope_ref(double *out, const float *x, int n, int n_heads, int hd, const int32_t *pos,
                     const struct skv_rope *rp)
{
    int half = rp->rot_dim / 2;
    for (int t = 0; t < n; t++)
        for (int h = 0; h < n_heads; h++) {
            const float *xi = x + ((size_t)t * n_heads + h) * hd;
            double *o = out + ((size_t)t * n_heads + h) * hd;
            for (int i = 0; i < hd; i++)
                o[i] = xi[i];
            for (int j = 0; j < half; j++) {
                double ang = (double)pos[t] * rp->freq_scale * rope_inv_freq_ref(rp, j);
                int i0 = rp->mode == SKV_ROPE_NEOX ? j : 2 * j;
                int i1 = rp->mode == SKV_ROPE_NEOX ? j + half : 2 * j + 1;
                o[i0] = xi[i0] * cos(ang) - xi[i1] * sin(ang);
                o[i1] = xi[i0] * sin(ang) + xi[i1] * cos(ang);
            }
        }
}

/* k[g], v[g]: [prefix[g] + n][d] on the host. window > 0: query i of head g (position
 * pos[g][prefix[g] + i]) sees only rows j with pos[g][j] > that - window. */
static void attention_ref(double *out, const float *q, int n, int n_heads, int n_kv, int d,
                          float *const *k, float *const *v, const int32_t *prefix, int window,
                          int32_t *const *pos)
{
    int group = n_heads / n_kv;
    int64_t max_len = 0;
    for (int g = 0; g < n_kv; g++)
        if (prefix[g] + n > max_len)
            max_len = prefix[g] + n;
    double *p = host_double((size_t)max_len);
    for (int i = 0; i < n; i++)
        for (int h = 0; h < n_heads; h++) {
            int g = h / group;
            int64_t len = prefix[g] + i + 1;
            const float *qi = q + ((size_t)i * n_heads + h) * d;
            double mx = -INFINITY, sum = 0.0;
            for (int64_t j = 0; j < len; j++) {
                double s = 0.0;
                for (int t = 0; t < d; t++)
                    s += (double)qi[t] * k[g][j * d + t];
                p[j] = s / sqrt((double)d);
                if (window > 0 && pos[g][j] <= pos[g][len - 1] - window)
                    p[j] = -INFINITY;
                mx = p[j] > mx ? p[j] : mx;
            }
            for (int64_t j = 0; j < len; j++) {
                p[j] = exp(p[j] - mx);
                sum += p[j];
            }
            double *o = out + ((size_t)i * n_heads + h) * d;
            for (int t = 0; t < d; t++) {
                double acc = 0.0;
                for (int64_t j = 0; j < len; j++)
                    acc += p[j] * v[g][j * d + t];
                o[t] = acc / sum;
            }
        }
    free(p);
}

/* ---- fixtures --------------------------------------------------------------------- */

static int setup_cpu(void **state)
{
    struct fixture *f = calloc(1, sizeof *f);
    if (!f || skv_backend_cpu_new(TEST_THREADS, &f->be) != SKV_OK) {
        free(f);
        return -1;
    }
    *state = f;
    return 0;
}

static int setup_cuda(void **state)
{
    struct fixture *f = calloc(1, sizeof *f);
    if (!f)
        return -1;
    if (skv_backend_cuda_new(0, &f->be) != SKV_OK)
        f->be = NULL; /* not compiled in or no device: the group's tests skip */
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    if (f)
        skv_backend_destroy(&f->be);
    free(f);
    return 0;
}

/* ---- elementwise ops -------------------------------------------------------------- */

static void run_rmsnorm(struct skv_backend *be, struct rng *r, int n, int dim, float eps,
                        bool in_place, float *got_out)
{
    size_t count = (size_t)n * dim;
    float *x = host_normal(r, count, 3.0), *w = host_normal(r, (size_t)dim, 1.0);
    float *got = host_nan(count);
    double *ref = host_double(count);
    float *dx = dev_from(be, x, count * sizeof(float));
    float *dw = dev_from(be, w, (size_t)dim * sizeof(float));
    float *dout = in_place ? dx : dev_from(be, got, count * sizeof(float));

    assert_int_equal(be->ops->rmsnorm(be, dout, dx, dw, n, dim, eps), SKV_OK);
    dev_to(be, got, dout, count * sizeof(float));
    rmsnorm_ref(ref, x, w, n, dim, eps);
    char what[96];
    snprintf(what, sizeof what, "rmsnorm n=%d dim=%d%s", n, dim, in_place ? " in place" : "");
    check_nmse(what, got, ref, count, NMSE_RMSNORM);
    if (got_out)
        memcpy(got_out, got, count * sizeof(float));

    if (!in_place)
        be->ops->free(be, dout);
    be->ops->free(be, dw);
    be->ops->free(be, dx);
    free(ref);
    free(got);
    free(w);
    free(x);
}

static void test_rmsnorm(void **state)
{
    struct skv_backend *be = fixture_be(state);
    struct rng r = {0x1234567ULL};
    const int dims[] = {64, 576, 4096}, ns[] = {1, 7, 300};
    for (size_t i = 0; i < 3; i++)
        for (size_t j = 0; j < 3; j++)
            run_rmsnorm(be, &r, ns[j], dims[i], j == 0 ? 1e-5f : 1e-6f, j == 1, NULL);
}

static void run_rope(struct skv_backend *be, struct rng *r, const struct skv_rope *rp,
                     int n_heads, int hd)
{
    const int n = 48;
    size_t count = (size_t)n * n_heads * hd;
    int32_t pos[48];
    for (int t = 0; t < n; t++)
        pos[t] = t < 4 ? t : t == 4 ? 9000 : t == 5 ? 8999 : (int32_t)(rng_uniform(r) * 9001);
    float *x = host_normal(r, count, 1.0), *got = host_nan(count);
    double *ref = host_double(count);
    float *dx = dev_from(be, x, count * sizeof(float));
    int32_t *dpos = dev_from(be, pos, sizeof pos);

    assert_int_equal(be->ops->rope(be, dx, n, n_heads, hd, dpos, rp), SKV_OK);
    dev_to(be, got, dx, count * sizeof(float));
    rope_ref(ref, x, n, n_heads, hd, pos, rp);
    char what[128];
    snprintf(what, sizeof what, "rope mode=%d hd=%d rot=%d theta=%g l3=%g", rp->mode, hd,
             rp->rot_dim, (double)rp->theta, (double)rp->l3_factor);
    check_nmse(what, got, ref, count, NMSE_ROPE);
    /* the unrotated tail is passed through exactly */
    for (size_t i = 0; i < count; i++)
        if ((int)(i % hd) >= rp->rot_dim)
            assert_true(got[i] == x[i]);

    be->ops->free(be, dpos);
    be->ops->free(be, dx);
    free(ref);
    free(got);
    free(x);
}

static void test_rope(void **state)
{
    struct skv_backend *be = fixture_be(state);
    struct rng r = {0xfeedULL};
    const struct skv_rope cases[] = {
        {.mode = SKV_ROPE_NORM, .rot_dim = 64, .theta = 10000.0f, .freq_scale = 1.0f},
        {.mode = SKV_ROPE_NEOX, .rot_dim = 64, .theta = 100000.0f, .freq_scale = 1.0f},
        {.mode = SKV_ROPE_NORM, .rot_dim = 32, .theta = 10000.0f, .freq_scale = 1.0f},
        {.mode = SKV_ROPE_NEOX, .rot_dim = 48, .theta = 10000.0f, .freq_scale = 1.0f},
        {.mode = SKV_ROPE_NEOX, .rot_dim = 64, .theta = 10000.0f, .freq_scale = 0.25f},
        {.mode = SKV_ROPE_NORM, .rot_dim = 64, .theta = 500000.0f, .freq_scale = 1.0f,
         .l3_factor = 8.0f, .l3_low_freq_factor = 1.0f, .l3_high_freq_factor = 4.0f,
         .l3_original_ctx = 8192},
        {.mode = SKV_ROPE_NEOX, .rot_dim = 64, .theta = 500000.0f, .freq_scale = 1.0f,
         .l3_factor = 32.0f, .l3_low_freq_factor = 1.0f, .l3_high_freq_factor = 4.0f,
         .l3_original_ctx = 1024},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_rope(be, &r, &cases[i], 3, 64);
    struct skv_rope wide = {.mode = SKV_ROPE_NEOX, .rot_dim = 128, .theta = 1000000.0f,
                            .freq_scale = 1.0f};
    run_rope(be, &r, &wide, 2, 128);
    /* frequency factors (GGUF rope_freqs.weight): 1 for short wavelengths, up to 8 for long */
    float factors[32];
    for (int j = 0; j < 32; j++)
        factors[j] = j < 10 ? 1.0f : j > 24 ? 8.0f : 1.0f + 7.0f * (float)(j - 10) / 15.0f;
    struct skv_rope ff = {.mode = SKV_ROPE_NORM, .rot_dim = 64, .theta = 500000.0f,
                          .freq_scale = 1.0f, .freq_factors = factors};
    run_rope(be, &r, &ff, 3, 64);
    ff.mode = SKV_ROPE_NEOX;
    ff.freq_scale = 0.5f;
    run_rope(be, &r, &ff, 3, 64);
}

static void test_rope_llama3_freqs(void **state)
{
    /* The reference's llama3 rule on the Llama 3.1 config: pair 0 (wavelength 6.3) is kept,
     * the last pair (wavelength ~4.5e5 > 8192) is divided by 8, and a pair in the band is
     * between the two. Guards the reference itself. */
    (void)state;
    struct skv_rope rp = {.mode = SKV_ROPE_NORM, .rot_dim = 128, .theta = 500000.0f,
                          .freq_scale = 1.0f, .l3_factor = 8.0f, .l3_low_freq_factor = 1.0f,
                          .l3_high_freq_factor = 4.0f, .l3_original_ctx = 8192};
    struct skv_rope plain = rp;
    plain.l3_factor = 0.0f;
    assert_true(rope_inv_freq_ref(&rp, 0) == 1.0);
    assert_true(fabs(rope_inv_freq_ref(&rp, 63) * 8.0 / rope_inv_freq_ref(&plain, 63) - 1.0) <
                1e-12);
    for (int j = 0; j < 64; j++) {
        double f = rope_inv_freq_ref(&plain, j), s = rope_inv_freq_ref(&rp, j);
        double wl = 2.0 * 3.14159265358979323846 / f;
        if (wl >= 2048.0 && wl <= 8192.0)
            assert_true(s <= f && s >= f / 8.0);
    }
    /* llama.cpp's converter stores the same rule as rope_freqs.weight factors (1 for short
     * wavelengths, the factor for long ones, 1 / ((1 - smooth) / factor + smooth) between):
     * theta plus those f32 factors gives the llama3 frequencies to float precision. */
    float factors[64];
    for (int j = 0; j < 64; j++) {
        double f = rope_inv_freq_hf(&plain, j), wl = 2.0 * 3.14159265358979323846 / f;
        double smooth = (8192.0 / wl - 1.0) / (4.0 - 1.0);
        factors[j] = (float)(wl < 8192.0 / 4.0 ? 1.0 : wl > 8192.0 ? 8.0
                                                                    : 1.0 / ((1.0 - smooth) / 8.0 + smooth));
    }
    struct skv_rope ff = plain;
    ff.freq_factors = factors;
    double a[64], b[64];
    skv_rope_inv_freq(&rp, 64, a);
    skv_rope_inv_freq(&ff, 64, b);
    for (int j = 0; j < 64; j++)
        assert_true(fabs(b[j] / a[j] - 1.0) < 1e-7);
}

static void test_rope_invalid(void **state)
{
    struct skv_backend *be = fixture_be(state);
    float x[2 * 64] = {0};
    int32_t pos[2] = {0, 1};
    struct skv_rope ok = {.mode = SKV_ROPE_NORM, .rot_dim = 64, .theta = 10000.0f,
                          .freq_scale = 1.0f};
    struct skv_rope bad = ok;
    /* the buffers on the backend's side: the valid call below runs the kernel */
    float *dx = dev_from(be, x, sizeof x);
    int32_t *dpos = dev_from(be, pos, sizeof pos);
    /* invalid parameters are rejected before any device access */
    bad.rot_dim = 66;
    assert_int_equal(be->ops->rope(be, dx, 2, 1, 64, dpos, &bad), SKV_E_INVAL);
    bad = ok;
    bad.rot_dim = 31;
    assert_int_equal(be->ops->rope(be, dx, 2, 1, 64, dpos, &bad), SKV_E_INVAL);
    bad = ok;
    bad.mode = 1;
    assert_int_equal(be->ops->rope(be, dx, 2, 1, 64, dpos, &bad), SKV_E_INVAL);
    bad = ok;
    bad.theta = 0.0f;
    assert_int_equal(be->ops->rope(be, dx, 2, 1, 64, dpos, &bad), SKV_E_INVAL);
    bad = ok;
    bad.l3_factor = 8.0f; /* high <= low */
    assert_int_equal(be->ops->rope(be, dx, 2, 1, 64, dpos, &bad), SKV_E_INVAL);
    float factors[32];
    for (int j = 0; j < 32; j++)
        factors[j] = 2.0f;
    bad = ok;
    bad.freq_factors = factors;
    assert_int_equal(be->ops->rope(be, dx, 2, 1, 64, dpos, &bad), SKV_OK);
    factors[31] = 0.0f;
    assert_int_equal(be->ops->rope(be, dx, 2, 1, 64, dpos, &bad), SKV_E_INVAL);
    factors[31] = NAN;
    assert_int_equal(be->ops->rope(be, dx, 2, 1, 64, dpos, &bad), SKV_E_INVAL);
    assert_int_equal(be->ops->sync(be), SKV_OK);
    be->ops->free(be, dpos);
    be->ops->free(be, dx);
}

static void run_binary(struct skv_backend *be, struct rng *r, int64_t count, bool swiglu,
                       bool in_place)
{
    float *a = host_normal(r, (size_t)count, swiglu ? 6.0 : 1.0);
    float *b = host_normal(r, (size_t)count, 1.0), *got = host_nan((size_t)count);
    double *ref = host_double((size_t)count);
    if (swiglu && count > 4) {
        a[0] = 40.0f; /* exp overflow and underflow of the sigmoid */
        a[1] = -40.0f;
        a[2] = -100.0f;
        a[3] = 0.0f;
    }
    size_t bytes = (size_t)count * sizeof(float);
    float *da = dev_from(be, a, bytes), *db = dev_from(be, b, bytes);
    float *dout = in_place ? da : dev_from(be, got, bytes);

    if (swiglu)
        assert_int_equal(be->ops->swiglu(be, dout, da, db, count), SKV_OK);
    else
        assert_int_equal(be->ops->add(be, dout, da, db, count), SKV_OK);
    dev_to(be, got, dout, bytes);
    for (int64_t i = 0; i < count; i++)
        ref[i] = swiglu ? a[i] / (1.0 + exp(-(double)a[i])) * b[i] : (double)a[i] + b[i];
    char what[96];
    snprintf(what, sizeof what, "%s count=%lld%s", swiglu ? "swiglu" : "add", (long long)count,
             in_place ? " in place" : "");
    check_nmse(what, got, ref, (size_t)count, swiglu ? NMSE_SWIGLU : NMSE_ADD);

    if (!in_place)
        be->ops->free(be, dout);
    be->ops->free(be, db);
    be->ops->free(be, da);
    free(ref);
    free(got);
    free(b);
    free(a);
}

static void test_swiglu(void **state)
{
    struct skv_backend *be = fixture_be(state);
    struct rng r = {0xabcdefULL};
    const int64_t counts[] = {1, 7, 1536, 100003, 300 * 1536};
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
        run_binary(be, &r, counts[i], true, i % 2 == 1);

    /* a row's values do not depend on the rows before it: two rows of 100 (a decode batch) give
     * the second row the bits it gets alone (before, its last 4 went through another exp) */
    float *g = host_normal(&r, 200, 6.0), *u = host_normal(&r, 200, 1.0);
    float batch[200] = {0}, alone[100];
    size_t bytes = sizeof batch;
    float *dg = dev_from(be, g, bytes), *du = dev_from(be, u, bytes), *dout = dev_from(be, batch, bytes);
    assert_int_equal(be->ops->swiglu(be, dout, dg, du, 200), SKV_OK);
    dev_to(be, batch, dout, bytes);
    assert_int_equal(be->ops->swiglu(be, dout, dg + 100, du + 100, 100), SKV_OK);
    dev_to(be, alone, dout, sizeof alone);
    assert_memory_equal(alone, batch + 100, sizeof alone);
    be->ops->free(be, dout);
    be->ops->free(be, du);
    be->ops->free(be, dg);
    free(u);
    free(g);
}

static void test_add(void **state)
{
    struct skv_backend *be = fixture_be(state);
    struct rng r = {0x5151ULL};
    const int64_t counts[] = {1, 1000, 576, 300001, 2048 * 576};
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
        run_binary(be, &r, counts[i], false, i % 2 == 0);
}

/* Quantized and half-precision weights: matmul against a double-precision product of the
 * dequantized rows, on the GEMV path (n <= 8) and the GEMM path (n = 40); random block bytes
 * with sane fp16 scales (any content is a valid block). The CPU's integer GEMV rounds x to 16
 * bits (NMSE ~1e-9); CUDA's GEMMs take f16 (F16 weights) or bf16 inputs (the others). */
static void test_matmul_types(void **state)
{
    struct skv_backend *be = fixture_be(state);
    struct rng r = {0x7a7aULL};
    const int types[] = {SKV_DTYPE_Q4_0, SKV_DTYPE_Q4_1, SKV_DTYPE_Q8_0, SKV_DTYPE_F16, SKV_DTYPE_BF16};
    const double limit[] = {1e-7, 1e-7, 1e-7, 1e-6, 1e-4};
    /* 576 columns: 16-byte rows (CUDA's vectorized GEMV for F16 / BF16); 102: the element
     * kernel (F16 / BF16 only, the quantized types need whole blocks of 32) */
    const int rows = 300, col_counts[] = {576, 102}, ns[] = {1, 5, 40};
    const size_t n_types = sizeof types / sizeof types[0];
    for (size_t ti = 0; ti < 2 * n_types; ti++) {
        const int type = types[ti % n_types], cols = col_counts[ti / n_types];
        if (cols % 32 && type != SKV_DTYPE_F16 && type != SKV_DTYPE_BF16)
            continue;
        const size_t rb = skv_dtype_row_bytes(type, cols), total = rb * rows;
        uint8_t *w = malloc(total);
        float *wrow = malloc(sizeof(float) * cols);
        assert_non_null(w);
        assert_non_null(wrow);
        if (type == SKV_DTYPE_F16 || type == SKV_DTYPE_BF16) {
            for (size_t i = 0; i < total / 2; i++) {
                const float v = (float)(rng_normal(&r) * 0.1);
                ((uint16_t *)w)[i] = type == SKV_DTYPE_F16 ? skv_f32_to_fp16(v) : skv_f32_to_bf16(v);
            }
        } else {
            const size_t bb = skv_dtype_block_bytes(type);
            for (size_t i = 0; i < total; i++)
                w[i] = (uint8_t)(rng_next(&r) >> 56);
            for (size_t b = 0; b < total / bb; b++) {
                const int fields = type == SKV_DTYPE_Q4_1 ? 2 : 1; /* d (and m) lead the block */
                for (int f = 0; f < fields; f++) {
                    const uint16_t h = skv_f32_to_fp16((float)(0.001 + 0.05 * rng_uniform(&r)) *
                                                       (rng_uniform(&r) < 0.5 ? -1.0f : 1.0f));
                    memcpy(w + b * bb + 2 * f, &h, sizeof h);
                }
            }
        }
        void *dw = dev_from(be, w, total);
        struct skv_tensor tw = {.type = type, .ndim = 2, .ne = {cols, rows, 1, 1}, .data = dw, .nbytes = total,
                                .name = "w"};
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            const int n = ns[k];
            float *x = host_normal(&r, (size_t)n * cols, 1.0), *got = host_nan((size_t)n * rows);
            double *ref = host_double((size_t)n * rows);
            float *dx = dev_from(be, x, (size_t)n * cols * sizeof(float));
            float *dout = dev_from(be, got, (size_t)n * rows * sizeof(float));
            assert_int_equal(be->ops->matmul(be, dout, &tw, NULL, dx, n), SKV_OK);
            dev_to(be, got, dout, (size_t)n * rows * sizeof(float));
            for (int o = 0; o < rows; o++) {
                assert_int_equal(skv_dequantize_row(type, w + (size_t)o * rb, wrow, cols), SKV_OK);
                for (int i = 0; i < n; i++) {
                    double acc = 0.0;
                    for (int c = 0; c < cols; c++)
                        acc += (double)wrow[c] * x[(size_t)i * cols + c];
                    ref[(size_t)i * rows + o] = acc;
                }
            }
            char what[64];
            snprintf(what, sizeof what, "matmul %s cols=%d n=%d", skv_dtype_name(type), cols, n);
            /* CUDA's GEMM path (n > 8) runs on bf16 inputs for every weight type but f32 / f16 */
            check_nmse(what, got, ref, (size_t)n * rows, n > 8 && type != SKV_DTYPE_F16 ? 1e-4 : limit[ti % n_types]);
            be->ops->free(be, dout);
            be->ops->free(be, dx);
            free(ref);
            free(got);
            free(x);
        }
        be->ops->free(be, dw);
        free(wrow);
        free(w);
    }
}

/* ---- matmul_multi ----------------------------------------------------------------- */

/* Two f32 weights (one with a bias) against the same x, every output element checked
 * against a double-precision product. */
static void test_matmul_multi(void **state)
{
    struct skv_backend *be = fixture_be(state);
    struct rng r = {0x3131ULL};
    const int cols = 96, rows[2] = {70, 33};
    const int ns[] = {1, 5, 40};
    for (size_t t = 0; t < sizeof ns / sizeof ns[0]; t++) {
        const int n = ns[t];
        float *x = host_normal(&r, (size_t)n * cols, 1.0), *bias = host_normal(&r, 70, 1.0);
        float *dx = dev_from(be, x, (size_t)n * cols * sizeof(float));
        float *dbias = dev_from(be, bias, 70 * sizeof(float));
        float *w[2], *got[2];
        struct skv_tensor tw[2];
        struct skv_matmul_part parts[2];
        for (int k = 0; k < 2; k++) {
            w[k] = host_normal(&r, (size_t)rows[k] * cols, 0.5);
            got[k] = host_nan((size_t)n * rows[k]);
            tw[k] = (struct skv_tensor){.type = SKV_DTYPE_F32, .ndim = 2, .ne = {cols, rows[k], 1, 1},
                                        .data = dev_from(be, w[k], (size_t)rows[k] * cols * sizeof(float)),
                                        .nbytes = (size_t)rows[k] * cols * sizeof(float), .name = "w"};
            parts[k] = (struct skv_matmul_part){dev_from(be, got[k], (size_t)n * rows[k] * sizeof(float)),
                                                &tw[k], k == 0 ? dbias : NULL};
        }
        assert_int_equal(be->ops->matmul_multi(be, parts, 2, dx, n), SKV_OK);
        for (int k = 0; k < 2; k++) {
            dev_to(be, got[k], parts[k].out, (size_t)n * rows[k] * sizeof(float));
            double *ref = host_double((size_t)n * rows[k]);
            for (int i = 0; i < n; i++)
                for (int o = 0; o < rows[k]; o++) {
                    double acc = k == 0 ? bias[o] : 0.0;
                    for (int c = 0; c < cols; c++)
                        acc += (double)x[i * cols + c] * w[k][o * cols + c];
                    ref[i * rows[k] + o] = acc;
                }
            char what[64];
            snprintf(what, sizeof what, "matmul_multi n=%d weight %d", n, k);
            check_nmse(what, got[k], ref, (size_t)n * rows[k], NMSE_MATMUL_F32);
            be->ops->free(be, parts[k].out);
            be->ops->free(be, tw[k].data);
            free(ref);
            free(got[k]);
            free(w[k]);
        }
        be->ops->free(be, dbias);
        be->ops->free(be, dx);
        free(bias);
        free(x);
    }
}

/* ---- attention -------------------------------------------------------------------- */

struct att_case {
    int n, n_heads, n_kv, d;
    int32_t prefix[SKV_MAX_KV_HEADS];
    double q_scale;
    int window;      /* sliding window (0: none) */
    int gaps;        /* window cases: prefix rows spread over gaps x the longest prefix */
    int block_rows;  /* > 0: the rows are read through a paged view of blocks of this many */
};

/* Row positions of head g for a window case: the prefix rows spread evenly over
 * [0, P) (P = gaps x the longest prefix, so compression-like holes when gaps > 1), then
 * the batch at P, P + 1, ... */
static int32_t *case_positions(const struct att_case *c, int g)
{
    int32_t maxp = 0;
    for (int h = 0; h < c->n_kv; h++)
        maxp = c->prefix[h] > maxp ? c->prefix[h] : maxp;
    const int64_t big = (int64_t)maxp * (c->gaps > 1 ? c->gaps : 1);
    int32_t *pos = malloc((size_t)(c->prefix[g] + c->n) * sizeof *pos);
    assert_non_null(pos);
    for (int j = 0; j < c->prefix[g]; j++)
        pos[j] = (int32_t)((int64_t)j * big / c->prefix[g]);
    for (int i = 0; i < c->n; i++)
        pos[c->prefix[g] + i] = (int32_t)big + i;
    return pos;
}

/* Copies rows [rows][d] of K and V (host) into backend blocks of t rows (K [t][d] then
 * V [t][d] each, as the engine's pool lays them out); returns the host block table. */
static void **paged_from(struct skv_backend *be, const float *k, const float *v, int rows, int d,
                         int t)
{
    const int nb = (rows + t - 1) / t;
    void **tbl = calloc((size_t)(nb ? nb : 1), sizeof *tbl);
    assert_non_null(tbl);
    float *blk = host_nan((size_t)2 * t * d);
    for (int b = 0; b < nb; b++) {
        const int m = rows - b * t < t ? rows - b * t : t;
        memcpy(blk, k + (size_t)b * t * d, (size_t)m * d * sizeof(float));
        memcpy(blk + (size_t)t * d, v + (size_t)b * t * d, (size_t)m * d * sizeof(float));
        tbl[b] = dev_from(be, blk, (size_t)2 * t * d * sizeof(float));
    }
    free(blk);
    return tbl;
}

static void paged_free(struct skv_backend *be, void **tbl, int rows, int t)
{
    for (int b = 0; b < (rows + t - 1) / t; b++)
        be->ops->free(be, tbl[b]);
    free(tbl);
}

/* Runs one case on `be`; returns the output (caller frees) after checking it against the
 * reference when `check` is set. */
static float *run_attention(struct skv_backend *be, struct rng *r, const struct att_case *c,
                            bool check)
{
    const int n = c->n, d = c->d;
    size_t qcount = (size_t)n * c->n_heads * d;
    float *q = host_normal(r, qcount, c->q_scale), *got = host_nan(qcount);
    float *k[SKV_MAX_KV_HEADS], *v[SKV_MAX_KV_HEADS];
    int32_t *pos[SKV_MAX_KV_HEADS] = {NULL};
    void **tbl[SKV_MAX_KV_HEADS] = {NULL};
    struct skv_kv_view kv = {.n_kv_heads = c->n_kv, .head_dim = d, .kv_type = SKV_DTYPE_F32,
                             .window = c->window, .block_rows = c->block_rows};
    for (int g = 0; g < c->n_kv; g++) {
        size_t kc = (size_t)(c->prefix[g] + n) * d;
        k[g] = host_normal(r, kc, 1.0);
        v[g] = host_normal(r, kc, 1.0);
        if (c->block_rows > 0) {
            kv.blocks[g] = tbl[g] = paged_from(be, k[g], v[g], c->prefix[g] + n, d, c->block_rows);
        } else {
            kv.k[g] = dev_from(be, k[g], kc * sizeof(float));
            kv.v[g] = dev_from(be, v[g], kc * sizeof(float));
        }
        kv.prefix_len[g] = c->prefix[g];
        if (c->window > 0)
            kv.pos[g] = pos[g] = case_positions(c, g);
    }
    float *dq = dev_from(be, q, qcount * sizeof(float));
    float *dout = dev_from(be, got, qcount * sizeof(float));

    assert_int_equal(be->ops->attention(be, dout, dq, n, c->n_heads, &kv), SKV_OK);
    dev_to(be, got, dout, qcount * sizeof(float));
    if (check) {
        double *ref = host_double(qcount);
        attention_ref(ref, q, n, c->n_heads, c->n_kv, d, k, v, c->prefix, c->window, pos);
        char what[160];
        snprintf(what, sizeof what,
                 "attention n=%d heads=%d kv=%d d=%d prefix=%d,%d q_scale=%g window=%d gaps=%d "
                 "block_rows=%d",
                 n, c->n_heads, c->n_kv, d, (int)c->prefix[0], (int)c->prefix[c->n_kv - 1],
                 c->q_scale, c->window, c->gaps, c->block_rows);
        check_nmse(what, got, ref, qcount, NMSE_ATTENTION);
        free(ref);
    }

    be->ops->free(be, dout);
    be->ops->free(be, dq);
    for (int g = 0; g < c->n_kv; g++) {
        if (tbl[g]) {
            paged_free(be, tbl[g], c->prefix[g] + n, c->block_rows);
        } else {
            be->ops->free(be, (void *)kv.v[g]);
            be->ops->free(be, (void *)kv.k[g]);
        }
        free(v[g]);
        free(k[g]);
        free(pos[g]);
    }
    free(q);
    return got;
}

static void test_attention(void **state)
{
    struct skv_backend *be = fixture_be(state);
    struct rng r = {0x77aa77ULL};
    const int ns[] = {1, 5, 64, 200}, prefixes[] = {0, 17, 300}, dims[] = {64, 128};
    const int groups[][2] = {{2, 1}, {3, 3}, {2, 4}}; /* {n_kv, heads per KV head} */

    for (size_t a = 0; a < 4; a++)
        for (size_t b = 0; b < 3; b++)
            for (size_t c = 0; c < 2; c++)
                for (size_t g = 0; g < 3; g++) {
                    struct att_case ac = {.n = ns[a], .n_kv = groups[g][0], .d = dims[c],
                                          .q_scale = 1.0};
                    ac.n_heads = groups[g][0] * groups[g][1];
                    for (int h = 0; h < ac.n_kv; h++)
                        ac.prefix[h] = prefixes[b] == 0 ? 0 : prefixes[b] + 13 * h;
                    free(run_attention(be, &r, &ac, true));
                }
}

static void test_attention_peaky(void **state)
{
    /* large logits: the running max changes often and most weights underflow */
    struct skv_backend *be = fixture_be(state);
    struct rng r = {0x99ULL};
    struct att_case c1 = {.n = 100, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {0, 40, 130},
                          .q_scale = 6.0};
    free(run_attention(be, &r, &c1, true));
    struct att_case c2 = {.n = 1, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {3000, 2000, 10},
                          .q_scale = 6.0};
    free(run_attention(be, &r, &c2, true));
}

static void test_attention_decode_long(void **state)
{
    struct skv_backend *be = fixture_be(state);
    struct rng r = {0x4242ULL};
    struct att_case c = {.n = 1, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {8999, 8999, 8999},
                         .q_scale = 1.0};
    free(run_attention(be, &r, &c, true));
    struct att_case c2 = {.n = 1, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {8999, 4000, 700},
                          .q_scale = 2.0};
    free(run_attention(be, &r, &c2, true));
    struct att_case c3 = {.n = 3, .n_heads = 8, .n_kv = 2, .d = 128, .prefix = {5000, 5500},
                          .q_scale = 1.0};
    free(run_attention(be, &r, &c3, true));
    /* a short batch after a long cache: 48 rows per KV head, key chunks merged */
    struct att_case c4 = {.n = 16, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {1000, 700, 1500},
                          .q_scale = 1.0};
    free(run_attention(be, &r, &c4, true));
}

static void test_attention_odd_dim(void **state)
{
    /* head_dim 18: vector loops with scalar tails */
    struct skv_backend *be = fixture_be(state);
    struct rng r = {0x1818ULL};
    const int ns[] = {1, 40, 100};
    for (size_t i = 0; i < 3; i++) {
        struct att_case c = {.n = ns[i], .n_heads = 4, .n_kv = 2, .d = 18, .prefix = {5, 600},
                             .q_scale = 1.5};
        free(run_attention(be, &r, &c, true));
    }
}

/* Sliding window over every kernel path: prefill (wide tiles, row tiles), appends after a
 * cache, decode (split keys), positions with holes (rows compression dropped), a window of
 * 1 (only the query itself), head_dim 18. */
static void test_attention_window(void **state)
{
    struct skv_backend *be = fixture_be(state);
    struct rng r = {0x5a5aULL};
    const struct att_case cases[] = {
        {.n = 200, .n_heads = 9, .n_kv = 3, .d = 64, .q_scale = 1.0, .window = 16},
        {.n = 200, .n_heads = 8, .n_kv = 2, .d = 128, .q_scale = 2.0, .window = 70},
        {.n = 100, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {0, 40, 130}, .q_scale = 3.0,
         .window = 50, .gaps = 2},
        {.n = 5, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {300, 313, 326}, .q_scale = 1.0,
         .window = 37},
        {.n = 1, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {8999, 4000, 700}, .q_scale = 1.0,
         .window = 4096, .gaps = 1},
        {.n = 1, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {8999, 4000, 700}, .q_scale = 1.0,
         .window = 3000, .gaps = 3},
        {.n = 1, .n_heads = 4, .n_kv = 2, .d = 64, .prefix = {2000, 2000}, .q_scale = 1.0,
         .window = 1},
        {.n = 16, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {1000, 700, 1500}, .q_scale = 1.0,
         .window = 200, .gaps = 2},
        {.n = 40, .n_heads = 4, .n_kv = 2, .d = 18, .prefix = {5, 600}, .q_scale = 1.5,
         .window = 100},
        {.n = 64, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {10, 20, 30}, .q_scale = 1.0,
         .window = 100000},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        free(run_attention(be, &r, &cases[i], true));
}

/* Boundaries of every attention kernel path, against the double reference: decode (n = 1;
 * CUDA's split-K) over 1, 63, 64, 65, 4097 and 33000 keys (tiles of 32 and 64 keys, chunks
 * of 256 and more); prefill of 1, 63, 64, 65 and 300 queries (CUDA's 64-query tiles) after no
 * cache or a short one; GQA groups of 1, 3 and 4; head_dim 64 and 128; contiguous and paged
 * views (blocks of 16 and 100 rows); no window and a window. The combinations rotate so every
 * length meets each layout and window setting. Then the edges between paths: 8 and 9 queries
 * (split-K's limit), a group's rows split over blocks (head_dim 256, 8 x 8 rows), and
 * head_dim 320 (CUDA's fallback kernel). */
static void test_attention_paths(void **state)
{
    struct skv_backend *be = fixture_be(state);
    struct rng r = {0xba7e5ULL};
    const int keys[] = {1, 63, 64, 65, 4097, 33000}, ns[] = {1, 63, 64, 65, 300};
    const int groups[] = {1, 3, 4}, dims[] = {64, 128}, layouts[] = {0, 16, 100};
    int rot = 0;
    for (size_t a = 0; a < sizeof keys / sizeof keys[0]; a++)
        for (size_t b = 0; b < 3; b++)
            for (size_t c = 0; c < 2; c++, rot++) {
                /* the longest head has exactly keys[a] rows; the other one fewer */
                struct att_case ac = {.n = 1, .n_kv = 2, .n_heads = 2 * groups[b], .d = dims[c],
                                      .prefix = {keys[a] - 1, keys[a] / 2}, .q_scale = 1.0,
                                      .block_rows = layouts[rot % 3]};
                if (rot % 2) {
                    ac.window = keys[a] / 3 + 1;
                    ac.gaps = 2;
                }
                free(run_attention(be, &r, &ac, true));
            }
    for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
        for (size_t b = 0; b < 3; b++)
            for (size_t c = 0; c < 2; c++, rot++) {
                struct att_case ac = {.n = ns[a], .n_kv = 2, .n_heads = 2 * groups[b],
                                      .d = dims[c], .q_scale = 1.5,
                                      .block_rows = layouts[rot % 3]};
                if (rot % 4 >= 2) {
                    ac.prefix[0] = 100;
                    ac.prefix[1] = 37;
                }
                if (rot % 2)
                    ac.window = 50;
                free(run_attention(be, &r, &ac, true));
            }
    const struct att_case edges[] = {
        {.n = 8, .n_heads = 8, .n_kv = 2, .d = 128, .prefix = {700, 500}, .q_scale = 1.0},
        {.n = 9, .n_heads = 8, .n_kv = 2, .d = 128, .prefix = {700, 500}, .q_scale = 1.0,
         .block_rows = 16},
        {.n = 8, .n_heads = 16, .n_kv = 2, .d = 256, .prefix = {3000, 20}, .q_scale = 1.0,
         .window = 1000, .block_rows = 100},
        {.n = 100, .n_heads = 8, .n_kv = 2, .d = 256, .prefix = {0, 30}, .q_scale = 1.0},
        {.n = 1, .n_heads = 4, .n_kv = 2, .d = 320, .prefix = {900, 90}, .q_scale = 1.0,
         .block_rows = 16},
        {.n = 20, .n_heads = 4, .n_kv = 2, .d = 320, .prefix = {0, 10}, .q_scale = 1.0,
         .window = 7},
    };
    for (size_t i = 0; i < sizeof edges / sizeof edges[0]; i++)
        free(run_attention(be, &r, &edges[i], true));
}

/* Column sums with a window: each query adds only to the keys its window holds. */
static void test_colsum_window(void **state)
{
    struct skv_backend *be = fixture_be(state);
    struct rng r = {0xc01ULL};
    struct att_case c = {.n = 30, .n_heads = 4, .n_kv = 2, .d = 32, .prefix = {50, 70},
                         .q_scale = 2.0, .window = 24, .gaps = 2};
    const int n = c.n, d = c.d, q_first = 10, stride = 100;
    size_t qcount = (size_t)n * c.n_heads * d;
    float *q = host_normal(&r, qcount, c.q_scale);
    float *k[2], *v[2];
    int32_t *pos[2];
    struct skv_kv_view kv = {.n_kv_heads = 2, .head_dim = d, .kv_type = SKV_DTYPE_F32,
                             .window = c.window};
    for (int g = 0; g < 2; g++) {
        size_t kc = (size_t)(c.prefix[g] + n) * d;
        k[g] = host_normal(&r, kc, 1.0);
        v[g] = host_normal(&r, kc, 1.0);
        kv.k[g] = dev_from(be, k[g], kc * sizeof(float));
        kv.v[g] = dev_from(be, v[g], kc * sizeof(float));
        kv.prefix_len[g] = c.prefix[g];
        kv.pos[g] = pos[g] = case_positions(&c, g);
    }
    float *dq = dev_from(be, q, qcount * sizeof(float));
    float *got = host_nan((size_t)c.n_heads * stride);
    for (size_t i = 0; i < (size_t)c.n_heads * stride; i++)
        got[i] = 0.0f;
    float *dout = dev_from(be, got, (size_t)c.n_heads * stride * sizeof(float));
    assert_int_equal(be->ops->attention_colsum(be, dout, stride, dq, n, c.n_heads, &kv, q_first),
                     SKV_OK);
    dev_to(be, got, dout, (size_t)c.n_heads * stride * sizeof(float));
    for (int h = 0; h < c.n_heads; h++) {
        const int g = h / 2, len = c.prefix[g] + n;
        double ref[100] = {0};
        for (int i = q_first; i < n; i++) {
            const int self = c.prefix[g] + i;
            double p[100], mx = -INFINITY, sum = 0.0;
            for (int j = 0; j <= self; j++) {
                double sc = 0.0;
                for (int t = 0; t < d; t++)
                    sc += (double)q[((size_t)i * c.n_heads + h) * d + t] * k[g][(size_t)j * d + t];
                p[j] = pos[g][j] > pos[g][self] - c.window ? sc / sqrt((double)d) : -INFINITY;
                mx = p[j] > mx ? p[j] : mx;
            }
            for (int j = 0; j <= self; j++)
                sum += (p[j] = exp(p[j] - mx));
            for (int j = 0; j <= self; j++)
                ref[j] += p[j] / sum;
        }
        int outside = 0;
        for (int j = 0; j < len; j++) {
            assert_true(fabs(got[h * stride + j] - ref[j]) < 1e-5 * (1.0 + ref[j]));
            outside += ref[j] == 0.0;
        }
        assert_true(outside > 0); /* some keys were outside every window */
    }
    be->ops->free(be, dout);
    be->ops->free(be, dq);
    for (int g = 0; g < 2; g++) {
        be->ops->free(be, (void *)kv.k[g]);
        be->ops->free(be, (void *)kv.v[g]);
        free(k[g]);
        free(v[g]);
        free(pos[g]);
    }
    free(got);
    free(q);
}

/* attention_batch_probs' probabilities of one sequence (got, [n_heads][stride], host) against
 * the column sums of its one query (want, the same layout): within rounding row for row, each
 * head's summing to 1, and the rows from its KV head's len on left as they were (NaN). */
static void probs_match(const char *what, const float *got, const float *want, int n_heads, int group,
                        int64_t stride, const struct skv_kv_view *kv)
{
    for (int h = 0; h < n_heads; h++) {
        const int64_t len = kv->prefix_len[h / group] + 1;
        double sum = 0;
        for (int64_t j = 0; j < len; j++) {
            const float g = got[h * stride + j], w = want[h * stride + j];
            if (!(fabsf(g - w) <= 1e-5f * w + 1e-12f))
                fail_msg("%s: head %d row %lld: %.9g from the attention, %.9g from colsum", what, h, (long long)j, g,
                         w);
            sum += g;
        }
        if (fabs(sum - 1.0) > 1e-5) /* (a device sums the softmax's denominator its own way) */
            fail_msg("%s: head %d sums to %.9g", what, h, sum);
        for (int64_t j = len; j < stride; j++)
            if (!isnan(got[h * stride + j]))
                fail_msg("%s: head %d row %lld past its %lld written", what, h, (long long)j, (long long)len);
    }
}

/* attention_batch_probs over a batch's views (test_attention_batch): out bit for bit as
 * attention_batch gives it (want), and each sequence's probabilities those its one query's
 * column sums give (a sequence without a buffer gets none; a stride within a head's rows is
 * refused). */
static void batch_probs(struct skv_backend *be, const char *what, float *dout, const float *dq, int S, int n_heads,
                        const struct skv_kv_view *views, const float *want, size_t qcount)
{
    float **dp = calloc((size_t)S, sizeof *dp);
    int64_t *stride = calloc((size_t)S, sizeof *stride);
    assert_true(dp && stride);
    const int group = n_heads / views[0].n_kv_heads;
    for (int s = 0; s < S; s++) {
        for (int g = 0; g < views[s].n_kv_heads; g++)
            stride[s] = views[s].prefix_len[g] + 1 > stride[s] ? views[s].prefix_len[g] + 1 : stride[s];
        stride[s] += s % 3; /* (room past the rows: left alone) */
        if (S == 1 || s != 1) {
            float *nan = host_nan((size_t)n_heads * stride[s]);
            dp[s] = dev_from(be, nan, (size_t)n_heads * stride[s] * sizeof(float));
            free(nan);
        }
    }
    float *got = host_nan(qcount);
    be->ops->upload(be, dout, got, qcount * sizeof(float));
    assert_int_equal(be->ops->attention_batch_probs(be, dout, dq, S, n_heads, views, dp, stride), SKV_OK);
    dev_to(be, got, dout, qcount * sizeof(float));
    if (memcmp(got, want, qcount * sizeof(float)))
        fail_msg("%s: attention_batch_probs' output is not attention_batch's", what);
    const size_t qdim = qcount / (size_t)S;
    for (int s = 0; s < S; s++) {
        if (!dp[s])
            continue;
        const size_t cnt = (size_t)n_heads * stride[s];
        float *p = malloc(cnt * sizeof *p), *c = host_nan(cnt), *dc = dev_from(be, c, cnt * sizeof(float));
        assert_non_null(p);
        dev_to(be, p, dp[s], cnt * sizeof(float));
        assert_int_equal(be->ops->attention_colsum(be, dc, stride[s], dq + s * qdim, 1, n_heads, &views[s], 0), SKV_OK);
        dev_to(be, c, dc, cnt * sizeof(float));
        char name[96];
        snprintf(name, sizeof name, "%s, sequence %d", what, s);
        probs_match(name, p, c, n_heads, group, stride[s], &views[s]);
        be->ops->free(be, dc);
        free(c);
        free(p);
    }
    int64_t keep = stride[0];
    stride[0] = views[0].prefix_len[0]; /* the new row would not fit */
    if (dp[0])
        assert_int_equal(be->ops->attention_batch_probs(be, dout, dq, S, n_heads, views, dp, stride), SKV_E_INVAL);
    stride[0] = keep;
    for (int s = 0; s < S; s++)
        if (dp[s])
            be->ops->free(be, dp[s]);
    free(got);
    free(dp);
    free(stride);
}

/* attention_batch: a decode group of sequences (one new query each) in one call gives every
 * sequence bit for bit what `attention` with n = 1 gives it alone. The sequences differ in
 * length (short ones that run inline, long ones that take split-K), in per-head lengths and in
 * block tables; two sets have a sliding window, two groups of 16 (the wide kernels); 70
 * sequences pass one round of the CPU's plan (short ones, then split-K ones). Views that
 * disagree on their shapes, or one without its rows, are refused; batch_probs checks
 * attention_batch_probs on each set. */
static void test_attention_batch(void **state)
{
    struct skv_backend *be = fixture_be(state);
    if (!be->ops->attention_batch)
        skip();
    struct rng r = {0xba7c4ULL};
    struct batch_set {
        int n_seq, n_heads, n_kv, d, window, block_rows, max_prefix;
    } sets[] = {
        {9, 9, 3, 64, 0, 16, 3000},
        {5, 8, 2, 128, 700, 16, 2500},
        {70, 9, 3, 64, 0, 16, 90},
        {3, 4, 4, 18, 0, 5, 600},
        {4, 32, 2, 64, 0, 16, 1200}, /* groups of 16 rows: the wide kernels */
        {4, 32, 2, 64, 700, 16, 1200}, /* the wide kernels in a sliding window */
        {70, 9, 3, 64, 0, 16, 1500},   /* split-K in the plan's second round too */
    };
    for (size_t si = 0; si < sizeof sets / sizeof sets[0]; si++) {
        const struct batch_set *b = &sets[si];
        const int S = b->n_seq, d = b->d;
        const size_t qdim = (size_t)b->n_heads * d, qcount = (size_t)S * qdim;
        struct skv_kv_view *views = calloc((size_t)S, sizeof *views);
        void ***tbls = calloc((size_t)S * b->n_kv, sizeof *tbls);
        int32_t **pos = calloc((size_t)S * b->n_kv, sizeof *pos);
        int *rows = calloc((size_t)S * b->n_kv, sizeof *rows);
        assert_true(views && tbls && pos && rows);
        for (int s = 0; s < S; s++) {
            struct skv_kv_view *kv = &views[s];
            *kv = (struct skv_kv_view){.n_kv_heads = b->n_kv, .head_dim = d, .kv_type = SKV_DTYPE_F32,
                                       .window = b->window, .block_rows = b->block_rows};
            for (int g = 0; g < b->n_kv; g++) {
                /* lengths from 0 to max_prefix, the heads of one sequence apart (head-wise kept) */
                const int pre = (int)((uint64_t)(s * 7919 + g * 104729) % (uint64_t)(b->max_prefix + 1));
                const int n_rows = pre + 1;
                float *k = host_normal(&r, (size_t)n_rows * d, 1.0), *v = host_normal(&r, (size_t)n_rows * d, 1.0);
                kv->blocks[g] = tbls[s * b->n_kv + g] = paged_from(be, k, v, n_rows, d, b->block_rows);
                kv->prefix_len[g] = pre;
                rows[s * b->n_kv + g] = n_rows;
                if (b->window > 0) {
                    int32_t *p = malloc((size_t)n_rows * sizeof *p);
                    assert_non_null(p);
                    for (int j = 0; j < n_rows; j++)
                        p[j] = 2 * j; /* holes, as compression leaves */
                    kv->pos[g] = pos[s * b->n_kv + g] = p;
                }
                free(k);
                free(v);
            }
        }
        float *q = host_normal(&r, qcount, 2.0), *want = host_nan(qcount), *got = host_nan(qcount);
        float *dq = dev_from(be, q, qcount * sizeof(float)), *dout = dev_from(be, want, qcount * sizeof(float));
        for (int s = 0; s < S; s++)
            assert_int_equal(be->ops->attention(be, dout + s * qdim, dq + s * qdim, 1, b->n_heads, &views[s]), SKV_OK);
        dev_to(be, want, dout, qcount * sizeof(float));
        float *poison = host_nan(qcount);
        be->ops->upload(be, dout, poison, qcount * sizeof(float));
        free(poison);
        assert_int_equal(be->ops->attention_batch(be, dout, dq, S, b->n_heads, views), SKV_OK);
        dev_to(be, got, dout, qcount * sizeof(float));
        for (size_t x = 0; x < qcount; x++)
            if (memcmp(&got[x], &want[x], sizeof(float)) != 0)
                fail_msg("set %zu: sequence %zu, value %zu: %.9g in the batch, %.9g alone", si, x / qdim, x % qdim,
                         got[x], want[x]);
        if (be->ops->attention_batch_probs) {
            char what[64];
            snprintf(what, sizeof what, "set %zu", si);
            batch_probs(be, what, dout, dq, S, b->n_heads, views, want, qcount);
        }
        assert_int_equal(be->ops->attention_batch(be, dout, dq, 0, b->n_heads, views), SKV_OK);
        if (S > 1) {
            struct skv_kv_view keep = views[1];
            views[1].head_dim = d + 1; /* a sequence of another shape */
            assert_int_equal(be->ops->attention_batch(be, dout, dq, S, b->n_heads, views), SKV_E_INVAL);
            views[1] = keep;
            views[1].blocks[0] = NULL; /* a sequence without its rows */
            assert_int_equal(be->ops->attention_batch(be, dout, dq, S, b->n_heads, views), SKV_E_INVAL);
            views[1] = keep;
        }
        be->ops->free(be, dout);
        be->ops->free(be, dq);
        for (int x = 0; x < S * b->n_kv; x++) {
            paged_free(be, tbls[x], rows[x], b->block_rows);
            free(pos[x]);
        }
        free(q);
        free(want);
        free(got);
        free(views);
        free(tbls);
        free(pos);
        free(rows);
    }
}

/* Attention and column sums over a paged view equal the contiguous view bit for bit, for
 * block sizes that do and do not divide the kernels' tiles and lengths that are not a
 * multiple of the block: every kernel path (wide prefill tiles, row tiles, split-K decode,
 * sliding window). */
/* Views every kernel path reads: wide prefill tiles, row tiles, split-K decode, head_dim 18, a
 * sliding window over rows with holes, head_dim 96 (rows of 102 bytes in q8_0, 2-byte aligned)
 * (test_attention_paged, test_kv_f16, test_kv_q8_0). */
static const struct att_case view_cases[] = {
    {.n = 200, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {0, 0, 0}, .q_scale = 1.0},
    {.n = 5, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {300, 313, 326}, .q_scale = 2.0},
    {.n = 1, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {4095, 2000, 77}, .q_scale = 1.0},
    {.n = 16, .n_heads = 8, .n_kv = 2, .d = 18, .prefix = {1000, 601}, .q_scale = 1.5},
    {.n = 100, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {0, 40, 130}, .q_scale = 3.0, .window = 50, .gaps = 2},
    {.n = 1, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {2999, 1000, 700}, .q_scale = 1.0, .window = 900, .gaps = 3},
    {.n = 3, .n_heads = 4, .n_kv = 2, .d = 96, .prefix = {150, 37}, .q_scale = 1.0}, /* q8_0: 3 blocks a row */
};

static void test_attention_paged(void **state)
{
    struct skv_backend *be = fixture_be(state);
    struct rng r = {0x9a9eULL};
    const int blocks[] = {1, 5, 16, 64, 100};
    for (size_t ci = 0; ci < sizeof view_cases / sizeof view_cases[0]; ci++) {
        const struct att_case *c = &view_cases[ci];
        const int n = c->n, d = c->d;
        const size_t qcount = (size_t)n * c->n_heads * d;
        float *q = host_normal(&r, qcount, c->q_scale);
        float *k[SKV_MAX_KV_HEADS], *v[SKV_MAX_KV_HEADS];
        int32_t *pos[SKV_MAX_KV_HEADS] = {NULL};
        struct skv_kv_view flat = {.n_kv_heads = c->n_kv, .head_dim = d, .kv_type = SKV_DTYPE_F32,
                                   .window = c->window};
        int max_rows = 0;
        for (int g = 0; g < c->n_kv; g++) {
            const int rows = c->prefix[g] + n;
            k[g] = host_normal(&r, (size_t)rows * d, 1.0);
            v[g] = host_normal(&r, (size_t)rows * d, 1.0);
            flat.k[g] = dev_from(be, k[g], (size_t)rows * d * sizeof(float));
            flat.v[g] = dev_from(be, v[g], (size_t)rows * d * sizeof(float));
            flat.prefix_len[g] = c->prefix[g];
            if (c->window > 0)
                flat.pos[g] = pos[g] = case_positions(c, g);
            max_rows = rows > max_rows ? rows : max_rows;
        }
        const int q_first = n > 4 ? n - 4 : 0;
        const size_t ccount = (size_t)c->n_heads * max_rows;
        float *dq = dev_from(be, q, qcount * sizeof(float));
        float *want = host_nan(qcount), *got = host_nan(qcount);
        float *cwant = calloc(ccount, sizeof(float)), *cgot = calloc(ccount, sizeof(float));
        assert_non_null(cwant);
        assert_non_null(cgot);
        float *dout = dev_from(be, want, qcount * sizeof(float));
        float *dcol = dev_from(be, cwant, ccount * sizeof(float));
        assert_int_equal(be->ops->attention(be, dout, dq, n, c->n_heads, &flat), SKV_OK);
        dev_to(be, want, dout, qcount * sizeof(float));
        assert_int_equal(be->ops->attention_colsum(be, dcol, max_rows, dq, n, c->n_heads, &flat, q_first), SKV_OK);
        dev_to(be, cwant, dcol, ccount * sizeof(float));
        for (size_t bi = 0; bi < sizeof blocks / sizeof blocks[0]; bi++) {
            struct skv_kv_view paged = flat;
            void **tbl[SKV_MAX_KV_HEADS];
            paged.block_rows = blocks[bi];
            for (int g = 0; g < c->n_kv; g++) {
                paged.k[g] = paged.v[g] = NULL; /* the paged form must not read them */
                paged.blocks[g] = tbl[g] = paged_from(be, k[g], v[g], c->prefix[g] + n, d, blocks[bi]);
            }
            assert_int_equal(be->ops->attention(be, dout, dq, n, c->n_heads, &paged), SKV_OK);
            dev_to(be, got, dout, qcount * sizeof(float));
            assert_int_equal(be->ops->attention_colsum(be, dcol, max_rows, dq, n, c->n_heads, &paged, q_first),
                             SKV_OK);
            dev_to(be, cgot, dcol, ccount * sizeof(float));
            if (memcmp(got, want, qcount * sizeof(float)) || memcmp(cgot, cwant, ccount * sizeof(float)))
                fail_msg("case %zu, blocks of %d rows: paged view differs from the contiguous one", ci,
                         blocks[bi]);
            for (int g = 0; g < c->n_kv; g++)
                paged_free(be, tbl[g], c->prefix[g] + n, blocks[bi]);
        }
        /* a paged view without a table is refused */
        struct skv_kv_view bad = flat;
        bad.block_rows = 16;
        assert_int_equal(be->ops->attention(be, dout, dq, n, c->n_heads, &bad), SKV_E_INVAL);
        be->ops->free(be, dcol);
        be->ops->free(be, dout);
        be->ops->free(be, dq);
        for (int g = 0; g < c->n_kv; g++) {
            be->ops->free(be, (void *)flat.k[g]);
            be->ops->free(be, (void *)flat.v[g]);
            free(k[g]);
            free(v[g]);
            free(pos[g]);
        }
        free(cwant);
        free(cgot);
        free(want);
        free(got);
        free(q);
    }
}

/* Blocks of t rows of `row` bytes (K rows then V rows each, the pool's layout) from host rows. */
static void **paged_from_bytes(struct skv_backend *be, const void *k, const void *v, int rows, size_t row, int t)
{
    const int nb = (rows + t - 1) / t;
    void **tbl = calloc((size_t)(nb ? nb : 1), sizeof *tbl);
    unsigned char *blk = malloc(2 * (size_t)t * row);
    assert_non_null(tbl);
    assert_non_null(blk);
    memset(blk, 0xff, 2 * (size_t)t * row); /* f16 NaN in the rows past the end */
    for (int b = 0; b < nb; b++) {
        const int m = rows - b * t < t ? rows - b * t : t;
        memcpy(blk, (const char *)k + (size_t)b * t * row, (size_t)m * row);
        memcpy(blk + (size_t)t * row, (const char *)v + (size_t)b * t * row, (size_t)m * row);
        tbl[b] = dev_from(be, blk, 2 * (size_t)t * row);
    }
    free(blk);
    return tbl;
}

/* Rows of d values (rows * d of them in x) as bytes of kv_type (f16 or q8_0), and x replaced by the
 * f32 values those bytes hold: an f32 view of x then holds exactly what the typed view holds. */
static void *kv_round(float *x, size_t rows, int d, int kv_type)
{
    const size_t row = skv_kv_row_bytes(kv_type, d);
    unsigned char *raw = malloc(rows * row + 1);
    assert_non_null(raw);
    for (size_t i = 0; i < rows; i++) {
        float *xi = x + i * d;
        unsigned char *ri = raw + i * row;
        if (kv_type == SKV_DTYPE_F16) {
            for (int t = 0; t < d; t++) {
                const uint16_t h = skv_f32_to_fp16(xi[t]);
                memcpy(ri + 2 * t, &h, 2);
                xi[t] = skv_fp16_to_f32(h);
            }
        } else {
            skv_quantize_row_q8_0(ri, xi, d);
            assert_int_equal(skv_dequantize_row(SKV_DTYPE_Q8_0, ri, xi, d), SKV_OK);
        }
    }
    return raw;
}

/* f16 and q8_0 KV (kv-type f16, q8_0): attention, attention_colsum and attention_batch over rows
 * of kv_type, contiguous and paged, give bit for bit what they give over an f32 view of the same
 * (rounded) values, on every path (prefill tiles, wide and row kernels, split-K decode, a sliding
 * window; f16 also an odd head_dim, which q8_0 refuses). A backend without the type's store op
 * refuses such views. */
static void kv_typed_views(void **state, int kv_type, uint64_t seed)
{
    struct skv_backend *be = fixture_be(state);
    struct rng r = {seed};
    const bool typed_ok = skv_backend_kv_type_ok(be, kv_type);
    for (size_t ci = 0; ci < sizeof view_cases / sizeof view_cases[0]; ci++) {
        const struct att_case *c = &view_cases[ci];
        const int n = c->n, d = c->d;
        const size_t qcount = (size_t)n * c->n_heads * d, row = skv_kv_row_bytes(kv_type, d);
        float *q = host_normal(&r, qcount, c->q_scale);
        float *kr[SKV_MAX_KV_HEADS], *vr[SKV_MAX_KV_HEADS];
        void *kh[SKV_MAX_KV_HEADS], *vh[SKV_MAX_KV_HEADS];
        int32_t *pos[SKV_MAX_KV_HEADS] = {NULL};
        struct skv_kv_view f32v = {.n_kv_heads = c->n_kv, .head_dim = d, .kv_type = SKV_DTYPE_F32,
                                   .window = c->window};
        struct skv_kv_view tv = f32v;
        tv.kv_type = kv_type;
        int max_rows = 0;
        for (int g = 0; g < c->n_kv; g++) {
            const int rows = c->prefix[g] + n;
            const size_t cnt = (size_t)rows * d;
            kr[g] = host_normal(&r, cnt, 1.0);
            vr[g] = host_normal(&r, cnt, 1.0);
            if (row == 0) { /* q8_0 of a head_dim not a multiple of 32: rows of it are not read */
                kh[g] = malloc(cnt);
                vh[g] = malloc(cnt);
            } else {
                kh[g] = kv_round(kr[g], rows, d, kv_type);
                vh[g] = kv_round(vr[g], rows, d, kv_type);
            }
            f32v.k[g] = dev_from(be, kr[g], cnt * sizeof(float));
            f32v.v[g] = dev_from(be, vr[g], cnt * sizeof(float));
            tv.k[g] = dev_from(be, kh[g], row ? rows * row : cnt);
            tv.v[g] = dev_from(be, vh[g], row ? rows * row : cnt);
            f32v.prefix_len[g] = tv.prefix_len[g] = c->prefix[g];
            if (c->window > 0)
                f32v.pos[g] = tv.pos[g] = pos[g] = case_positions(c, g);
            max_rows = rows > max_rows ? rows : max_rows;
        }
        const int q_first = n > 4 ? n - 4 : 0;
        const size_t ccount = (size_t)c->n_heads * max_rows;
        float *dq = dev_from(be, q, qcount * sizeof(float));
        float *want = host_nan(2 * qcount), *got = host_nan(qcount); /* dout takes two sequences' */
        float *cwant = calloc(ccount, sizeof(float)), *cgot = calloc(ccount, sizeof(float));
        assert_non_null(cwant);
        assert_non_null(cgot);
        float *dout = dev_from(be, want, 2 * qcount * sizeof(float));
        float *dcol = dev_from(be, cwant, ccount * sizeof(float));
        if (!typed_ok || row == 0) {
            const int bad = row == 0 ? SKV_E_INVAL : SKV_E_UNSUPPORTED;
            assert_int_equal(be->ops->attention(be, dout, dq, n, c->n_heads, &tv), bad);
            assert_int_not_equal(be->ops->attention_colsum(be, dcol, max_rows, dq, n, c->n_heads, &tv, q_first),
                                 SKV_OK);
            if (n == 1 && be->ops->attention_batch)
                assert_int_equal(be->ops->attention_batch(be, dout, dq, 1, c->n_heads, &tv), bad);
        } else {
            assert_int_equal(be->ops->attention(be, dout, dq, n, c->n_heads, &f32v), SKV_OK);
            dev_to(be, want, dout, qcount * sizeof(float));
            assert_int_equal(be->ops->attention_colsum(be, dcol, max_rows, dq, n, c->n_heads, &f32v, q_first),
                             SKV_OK);
            dev_to(be, cwant, dcol, ccount * sizeof(float));
            const int blocks[] = {0, 16, 5};
            for (size_t bi = 0; bi < sizeof blocks / sizeof blocks[0]; bi++) {
                struct skv_kv_view v = tv;
                void **tbl[SKV_MAX_KV_HEADS] = {NULL};
                if (blocks[bi] > 0) {
                    v.block_rows = blocks[bi];
                    for (int g = 0; g < c->n_kv; g++) {
                        v.k[g] = v.v[g] = NULL;
                        v.blocks[g] = tbl[g] = paged_from_bytes(be, kh[g], vh[g], c->prefix[g] + n, row, blocks[bi]);
                    }
                }
                assert_int_equal(be->ops->attention(be, dout, dq, n, c->n_heads, &v), SKV_OK);
                dev_to(be, got, dout, qcount * sizeof(float));
                assert_int_equal(be->ops->attention_colsum(be, dcol, max_rows, dq, n, c->n_heads, &v, q_first),
                                 SKV_OK);
                dev_to(be, cgot, dcol, ccount * sizeof(float));
                if (memcmp(got, want, qcount * sizeof(float)) || memcmp(cgot, cwant, ccount * sizeof(float)))
                    fail_msg("case %zu, blocks of %d rows: the %s view differs from the f32 one", ci, blocks[bi],
                             skv_dtype_name(kv_type));
                if (n == 1 && be->ops->attention_batch) { /* a typed and an f32 sequence in one call */
                    struct skv_kv_view two[2] = {v, f32v};
                    float *both = host_nan(2 * qcount), *dq_both = NULL;
                    memcpy(both, q, qcount * sizeof(float));
                    memcpy(both + qcount, q, qcount * sizeof(float));
                    dq_both = dev_from(be, both, 2 * qcount * sizeof(float));
                    assert_int_equal(be->ops->attention_batch(be, dout, dq_both, 2, c->n_heads, two), SKV_OK);
                    dev_to(be, both, dout, 2 * qcount * sizeof(float));
                    assert_memory_equal(both, want, qcount * sizeof(float));
                    assert_memory_equal(both + qcount, want, qcount * sizeof(float));
                    if (be->ops->attention_batch_probs) {
                        memcpy(both, want, qcount * sizeof(float));
                        memcpy(both + qcount, want, qcount * sizeof(float));
                        char what[64];
                        snprintf(what, sizeof what, "case %zu, %s, blocks of %d", ci, skv_dtype_name(kv_type),
                                 blocks[bi]);
                        batch_probs(be, what, dout, dq_both, 2, c->n_heads, two, both, 2 * qcount);
                    }
                    be->ops->free(be, dq_both);
                    free(both);
                }
                for (int g = 0; g < c->n_kv && blocks[bi] > 0; g++)
                    paged_free(be, tbl[g], c->prefix[g] + n, blocks[bi]);
            }
        }
        be->ops->free(be, dcol);
        be->ops->free(be, dout);
        be->ops->free(be, dq);
        for (int g = 0; g < c->n_kv; g++) {
            be->ops->free(be, (void *)f32v.k[g]);
            be->ops->free(be, (void *)f32v.v[g]);
            be->ops->free(be, (void *)tv.k[g]);
            be->ops->free(be, (void *)tv.v[g]);
            free(kr[g]);
            free(vr[g]);
            free(kh[g]);
            free(vh[g]);
            free(pos[g]);
        }
        free(cwant);
        free(cgot);
        free(want);
        free(got);
        free(q);
    }
}

/* f16 views (kv_typed_views); store_rows_f16 rounds as skv_f32_to_fp16 does, saturating. */
static void test_kv_f16(void **state)
{
    struct skv_backend *be = fixture_be(state);
    struct rng r = {0xf16f16ULL};
    kv_typed_views(state, SKV_DTYPE_F16, 0xf16f16ULL);
    if (!be->ops->store_rows_f16)
        return;
    /* store_rows_f16: scattered rows, odd and vector-sized widths, values from tiny to past f16's
     * range, which saturate at +-65504 (a stored row stays finite) */
    const int dims[] = {64, 13};
    for (size_t di = 0; di < 2; di++) {
        enum { N = 29 };
        const int d = dims[di];
        float *src = host_normal(&r, (size_t)N * d, 1.0);
        for (int i = 0; i < N * d; i++)
            src[i] *= (float)pow(2.0, (double)(i % 48) - 30.0); /* subnormals, past 65504 */
        src[0] = 65519.0f;  /* rounds down to 65504 */
        src[1] = 65520.0f;  /* would round to inf */
        src[2] = -1e30f;
        src[3] = INFINITY;
        uint16_t want16[N * 64], got16[N * 64];
        memset(want16, 0xab, sizeof want16);
        float *dsrc = dev_from(be, src, (size_t)N * d * sizeof(float));
        uint16_t *ddst = dev_from(be, want16, (size_t)N * d * sizeof(uint16_t));
        void *to[N];
        const float *from[N];
        for (int i = 0; i < N; i++) {
            int j = (i * 7 + 3) % N;
            to[i] = ddst + (size_t)i * d;
            from[i] = dsrc + (size_t)j * d;
            for (int t = 0; t < d; t++) {
                float x = src[j * d + t];
                want16[i * d + t] = skv_f32_to_fp16(x > 65504.0f ? 65504.0f : x < -65504.0f ? -65504.0f : x);
                assert_int_equal(want16[i * d + t], skv_f32_to_fp16_sat(x));
            }
        }
        assert_int_equal(be->ops->store_rows_f16(be, to, from, d, N), SKV_OK);
        dev_to(be, got16, ddst, (size_t)N * d * sizeof(uint16_t));
        assert_memory_equal(got16, want16, (size_t)N * d * sizeof(uint16_t));
        assert_int_equal(be->ops->store_rows_f16(be, to, from, d, -1), SKV_E_INVAL);
        to[0] = NULL;
        assert_int_equal(be->ops->store_rows_f16(be, to, from, d, 1), SKV_E_INVAL);
        be->ops->free(be, dsrc);
        be->ops->free(be, ddst);
        free(src);
    }
}

/* q8_0 views (kv_typed_views); store_rows_q8_0 and skv_quantize_row_q8_0 make the bytes gguf-py's
 * Q8_0 quantizer makes (tests/fixtures/q8_0_kv.bin, tests/reference/gen_q8_kv_fixture.py: rows of
 * several magnitudes, outlier channels, a zero block, a scale that underflows to 0 and subnormal
 * ones, ties that round away from zero, values that x * (1 / d) and x / d round apart, a scale
 * between 65504 and 65520), scattered rows; values the reference makes infinite or leaves
 * undefined (past f16's range, inf, NaN) give a finite block in range on every backend. */
static void test_kv_q8_0(void **state)
{
    struct skv_backend *be = fixture_be(state);
    kv_typed_views(state, SKV_DTYPE_Q8_0, 0x58b0ULL);
    const char *srcdir = getenv("SKV_SRCDIR") ? getenv("SKV_SRCDIR") : ".";
    char path[4096];
    snprintf(path, sizeof path, "%s/tests/fixtures/q8_0_kv.bin", srcdir);
    FILE *f = fopen(path, "rb");
    if (!f)
        fail_msg("cannot read %s (set SKV_SRCDIR to the source tree)", path);
    char magic[8];
    uint32_t hdr[2];
    assert_int_equal(fread(magic, 1, 8, f), 8);
    assert_memory_equal(magic, "SKVQ8001", 8);
    assert_int_equal(fread(hdr, 4, 2, f), 2);
    const int rows = (int)hdr[0], d = (int)hdr[1];
    assert_int_equal(rows, 35);
    assert_int_equal(d, 64);
    const size_t row = skv_kv_row_bytes(SKV_DTYPE_Q8_0, d);
    assert_int_equal(row, 68);
    float *x = malloc((size_t)rows * d * sizeof(float));
    unsigned char *want = malloc((size_t)rows * row), *got = malloc((size_t)rows * row);
    assert_non_null(x);
    assert_non_null(want);
    assert_non_null(got);
    assert_int_equal(fread(x, sizeof(float), (size_t)rows * d, f), (size_t)rows * d);
    assert_int_equal(fread(want, 1, (size_t)rows * row, f), (size_t)rows * row);
    assert_int_equal(fgetc(f), EOF);
    fclose(f);
    for (int i = 0; i < rows; i++)
        skv_quantize_row_q8_0(got + (size_t)i * row, x + (size_t)i * d, d);
    assert_memory_equal(got, want, (size_t)rows * row);
    /* the tie row: amax 127 gives d = 1.0 (f16 0x3c00); 2.5 -> 3, -0.5 -> -1, 126.5 -> 127 */
    const unsigned char *tie = want + (size_t)30 * row;
    assert_int_equal(tie[0] | tie[1] << 8, 0x3c00);
    assert_int_equal((int8_t)tie[2 + 2], 3);
    assert_int_equal((int8_t)tie[2 + 5], -1);
    assert_int_equal((int8_t)tie[2 + 6], 127);
    /* row 34: d = 65512 is stored as 65504 (0x7bff), and 98262 takes q from the f32 d: 1, not 2 */
    const unsigned char *big = want + (size_t)34 * row;
    assert_int_equal(big[0] | big[1] << 8, 0x7bff);
    assert_int_equal((int8_t)big[2 + 1], 1);
    /* row 29: d underflows to an f16 0 with q not all 0 (gguf-py's bytes; the values are 0) */
    assert_int_equal(want[(size_t)29 * row] | want[(size_t)29 * row + 1], 0);
    if (!be->ops->store_rows_q8_0) {
        free(x);
        free(want);
        free(got);
        return;
    }
    /* the backend's op, rows scattered: destination i gets fixture row j */
    float *dsrc = dev_from(be, x, (size_t)rows * d * sizeof(float));
    memset(got, 0xab, (size_t)rows * row);
    unsigned char *ddst = dev_from(be, got, (size_t)rows * row);
    void *to[35];
    const float *from[35];
    unsigned char *perm = malloc((size_t)rows * row);
    assert_non_null(perm);
    for (int i = 0; i < rows; i++) {
        const int j = (i * 7 + 3) % rows;
        to[i] = ddst + (size_t)i * row;
        from[i] = dsrc + (size_t)j * d;
        memcpy(perm + (size_t)i * row, want + (size_t)j * row, row);
    }
    assert_int_equal(be->ops->store_rows_q8_0(be, to, from, d, rows), SKV_OK);
    dev_to(be, got, ddst, (size_t)rows * row);
    assert_memory_equal(got, perm, (size_t)rows * row);
    /* past the reference: huge, infinite and NaN values give what the host quantizer gives,
     * d saturated at 65504 (0x7bff), every q in [-127, 127], NaN as 0 */
    float edge[64];
    for (int t = 0; t < 64; t++)
        edge[t] = (float)(t - 32) * 0.25f;
    edge[0] = 1e30f;
    edge[1] = -INFINITY;
    edge[2] = NAN;
    edge[40] = NAN;
    edge[41] = 3e9f;
    unsigned char ewant[68], egot[68];
    skv_quantize_row_q8_0(ewant, edge, 64);
    assert_int_equal(ewant[0] | ewant[1] << 8, 0x7bff);
    assert_int_equal((int8_t)ewant[2 + 0], 127);
    assert_int_equal((int8_t)ewant[2 + 1], -127);
    assert_int_equal((int8_t)ewant[2 + 2], 0);
    assert_int_equal(ewant[34] | ewant[35] << 8, 0x7bff);
    assert_int_equal((int8_t)ewant[36 + 8], 0);
    assert_int_equal((int8_t)ewant[36 + 9], 127);
    be->ops->free(be, dsrc);
    dsrc = dev_from(be, edge, sizeof edge);
    to[0] = ddst;
    from[0] = dsrc;
    assert_int_equal(be->ops->store_rows_q8_0(be, to, from, 64, 1), SKV_OK);
    dev_to(be, egot, ddst, sizeof egot);
    assert_memory_equal(egot, ewant, sizeof ewant);
    /* bad arguments */
    assert_int_equal(be->ops->store_rows_q8_0(be, to, from, 48, 1), SKV_E_INVAL);
    assert_int_equal(be->ops->store_rows_q8_0(be, to, from, 64, -1), SKV_E_INVAL);
    to[0] = NULL;
    assert_int_equal(be->ops->store_rows_q8_0(be, to, from, 64, 1), SKV_E_INVAL);
    be->ops->free(be, dsrc);
    be->ops->free(be, ddst);
    free(perm);
    free(x);
    free(want);
    free(got);
}

/* attention_batch over f16 / q8_0 paged views whose sequences share blocks, as forks of one
 * document do: every sequence gets bit for
 * bit what `attention` gives it alone. Five forks of a 600-row document (37 full blocks shared
 * by all, the partial 38th shared by the two that appended the same row; split-K decode), one
 * typed sequence sharing nothing, and one f32 contiguous sequence, in one call. */
static void kv_shared_batch(void **state, int kv_type)
{
    struct skv_backend *be = fixture_be(state);
    if (!skv_backend_kv_type_ok(be, kv_type))
        skip();
    struct rng r = {0x5a4eULL + (uint64_t)kv_type};
    enum { D = 64, NKV = 2, NH = 6, T = 16, P = 600, NS = 7, LMAX = P + 40 }; /* 600: split-K chunks */
    const int extra[NS] = {1, 3, 17, 1, 40, 9, 5}; /* rows after the document; 3 appends what 0 did */
    const size_t row = skv_kv_row_bytes(kv_type, D), qdim = (size_t)NH * D;
    float *rows[NS][NKV][2];           /* each sequence's rows (rounded), K and V */
    unsigned char *raw[NS][NKV][2];    /* and as kv_type bytes */
    for (int g = 0; g < NKV; g++)
        for (int w = 0; w < 2; w++) {
            float *doc = host_normal(&r, (size_t)LMAX * D, 1.0);
            float *tail0 = host_normal(&r, (size_t)40 * D, 1.0);
            for (int s = 0; s < NS; s++) {
                rows[s][g][w] = malloc((size_t)LMAX * D * sizeof(float));
                assert_non_null(rows[s][g][w]);
                memcpy(rows[s][g][w], doc, (size_t)P * D * sizeof(float));
                float *tail = s == 0 || s == 3 ? tail0 : host_normal(&r, (size_t)40 * D, 1.0);
                memcpy(rows[s][g][w] + (size_t)P * D, tail, (size_t)40 * D * sizeof(float));
                if (s == 5) /* the one that shares nothing: a document of its own */
                    for (int i = 0; i < P * D; i++)
                        rows[s][g][w][i] += 0.5f;
                if (tail != tail0)
                    free(tail);
                raw[s][g][w] = kv_round(rows[s][g][w], LMAX, D, kv_type);
            }
            free(doc);
            free(tail0);
        }
    /* blocks: 0..5 shared by the forks (0-4), block 6 by 0 and 3, the rest each one's own */
    void *blk[NS][NKV][LMAX / T + 1];
    memset(blk, 0, sizeof blk);
    unsigned char *tmp = malloc(2 * (size_t)T * row);
    assert_non_null(tmp);
    for (int s = 0; s < NS; s++)
        for (int g = 0; g < NKV; g++)
            for (int b = 0; b * T < P + extra[s]; b++) {
                const bool fork = s < 5;
                if (fork && b < P / T && s > 0) {
                    blk[s][g][b] = blk[0][g][b];
                    continue;
                }
                if (s == 3 && b == P / T) {
                    blk[s][g][b] = blk[0][g][b];
                    continue;
                }
                memset(tmp, 0xff, 2 * (size_t)T * row);
                const int m = P + extra[s] - b * T < T ? P + extra[s] - b * T : T;
                memcpy(tmp, raw[s][g][0] + (size_t)b * T * row, (size_t)m * row);
                memcpy(tmp + (size_t)T * row, raw[s][g][1] + (size_t)b * T * row, (size_t)m * row);
                blk[s][g][b] = dev_from(be, tmp, 2 * (size_t)T * row);
            }
    free(tmp);
    struct skv_kv_view kv[NS + 1];
    memset(kv, 0, sizeof kv);
    for (int s = 0; s < NS; s++) {
        kv[s].n_kv_heads = NKV;
        kv[s].head_dim = D;
        kv[s].kv_type = kv_type;
        kv[s].block_rows = T;
        for (int g = 0; g < NKV; g++) {
            kv[s].prefix_len[g] = P + extra[s] - 1;
            kv[s].blocks[g] = blk[s][g];
        }
    }
    float *k32[NKV], *v32[NKV]; /* and an f32 sequence, contiguous */
    kv[NS] = (struct skv_kv_view){.n_kv_heads = NKV, .head_dim = D, .kv_type = SKV_DTYPE_F32};
    for (int g = 0; g < NKV; g++) {
        float *kh = host_normal(&r, 60 * D, 1.0), *vh = host_normal(&r, 60 * D, 1.0);
        kv[NS].k[g] = k32[g] = dev_from(be, kh, 60 * D * sizeof(float));
        kv[NS].v[g] = v32[g] = dev_from(be, vh, 60 * D * sizeof(float));
        kv[NS].prefix_len[g] = 59;
        free(kh);
        free(vh);
    }
    float *q = host_normal(&r, (NS + 1) * qdim, 2.0), *got = host_nan((NS + 1) * qdim), *one = host_nan(qdim);
    float *dq = dev_from(be, q, (NS + 1) * qdim * sizeof(float)), *dout = dev_from(be, got, (NS + 1) * qdim * sizeof(float));
    assert_int_equal(be->ops->attention_batch(be, dout, dq, NS + 1, NH, kv), SKV_OK);
    dev_to(be, got, dout, (NS + 1) * qdim * sizeof(float));
    for (int s = 0; s <= NS; s++) {
        assert_int_equal(be->ops->attention(be, dout, dq + s * qdim, 1, NH, &kv[s]), SKV_OK);
        dev_to(be, one, dout, qdim * sizeof(float));
        if (memcmp(one, got + s * qdim, qdim * sizeof(float)) != 0)
            fail_msg("%s: sequence %d of the batch differs from its own call", skv_dtype_name(kv_type), s);
    }
    if (be->ops->attention_batch_probs) /* through the memo: the forks' probabilities too */
        batch_probs(be, skv_dtype_name(kv_type), dout, dq, NS + 1, NH, kv, got, (NS + 1) * qdim);
    be->ops->free(be, dq);
    be->ops->free(be, dout);
    for (int s = 0; s < NS; s++)
        for (int g = 0; g < NKV; g++) {
            for (int b = 0; b * T < P + extra[s]; b++)
                if (!(s < 5 && s > 0 && b < P / T) && !(s == 3 && b == P / T))
                    be->ops->free(be, blk[s][g][b]);
            for (int w = 0; w < 2; w++) {
                free(rows[s][g][w]);
                free(raw[s][g][w]);
            }
        }
    for (int g = 0; g < NKV; g++) {
        be->ops->free(be, k32[g]);
        be->ops->free(be, v32[g]);
    }
    free(q);
    free(got);
    free(one);
}

static void test_kv_shared_batch(void **state)
{
    kv_shared_batch(state, SKV_DTYPE_F16);
    kv_shared_batch(state, SKV_DTYPE_Q8_0);
}

/* copy_rows: rows moved between two buffers in a scrambled order, odd and word-sized rows. */
static void test_copy_rows(void **state)
{
    struct skv_backend *be = fixture_be(state);
    struct rng r = {0xc0e7ULL};
    const size_t sizes[] = {256, 6};
    for (size_t si = 0; si < 2; si++) {
        enum { N = 37 };
        const size_t row = sizes[si];
        unsigned char src_h[N * 256], want[N * 256], got[N * 256];
        for (size_t i = 0; i < N * row; i++)
            src_h[i] = (unsigned char)(rng_next(&r) >> 24);
        memset(want, 0xab, sizeof want);
        char *dsrc = dev_from(be, src_h, N * row), *ddst = dev_from(be, want, N * row);
        void *to[N];
        const void *from[N];
        for (int i = 0; i < N; i++) {
            int j = (i * 11 + 5) % N; /* destination row i gets source row j */
            to[i] = ddst + (size_t)i * row;
            from[i] = dsrc + (size_t)j * row;
            memcpy(want + (size_t)i * row, src_h + (size_t)j * row, row);
        }
        assert_int_equal(be->ops->copy_rows(be, to, from, row, N), SKV_OK);
        dev_to(be, got, ddst, N * row);
        assert_memory_equal(got, want, N * row);
        assert_int_equal(be->ops->copy_rows(be, to, from, row, 0), SKV_OK);
        assert_int_equal(be->ops->copy_rows(be, to, from, row, -1), SKV_E_INVAL);
        assert_int_equal(be->ops->copy_rows(be, NULL, from, row, 2), SKV_E_INVAL);
        to[1] = NULL;
        assert_int_equal(be->ops->copy_rows(be, to, from, row, 2), SKV_E_INVAL);
        be->ops->free(be, dsrc);
        be->ops->free(be, ddst);
    }
}

/* ---- SnapKV scores and top-k ---------------------------------------------------------- */

/* group_scores' definition, step by step in the same float operations (so the op must match
 * it to the last bit up to the 1e-6 relative slack the checks allow a device). */
static void group_scores_ref(float *out, const float *colsum, int64_t stride, int n_heads, int n_kv, const int *len,
                             const int *pooled, float div, int kernel, bool pool_max, bool gqa_max)
{
    int g = n_heads / n_kv, half = kernel / 2;
    float *agg = malloc((size_t)stride * sizeof *agg + 1);
    assert_non_null(agg);
    for (int h = 0; h < n_kv; h++) {
        for (int j = 0; j < len[h]; j++) {
            float acc = colsum[(int64_t)h * g * stride + j];
            for (int r = 1; r < g; r++) {
                float v = colsum[((int64_t)h * g + r) * stride + j];
                acc = gqa_max ? fmaxf(acc, v) : acc + v;
            }
            agg[j] = (gqa_max ? acc : acc / (float)g) / div;
        }
        for (int j = 0; j < len[h]; j++) {
            float *o = &out[(int64_t)h * stride + j];
            if (j >= pooled[h]) {
                *o = agg[j];
                continue;
            }
            double sum = 0;
            float mx = -INFINITY;
            for (int t = j - half; t <= j + half; t++)
                if (t >= 0 && t < pooled[h]) {
                    sum += agg[t];
                    mx = fmaxf(mx, agg[t]);
                }
            *o = pool_max ? mx : (float)(sum / kernel);
        }
    }
    free(agg);
}

/* Runs group_scores and checks it against the reference; rows at and past len stay poisoned. */
static void check_group_scores(struct skv_backend *be, const float *colsum, int64_t stride, int n_heads, int n_kv,
                               const int *len, const int *pooled, float div, int kernel, bool pool_max, bool gqa_max)
{
    size_t in_count = (size_t)stride * n_heads, out_count = (size_t)stride * n_kv;
    float *got = host_nan(out_count), *want = host_nan(out_count);
    float *din = dev_from(be, colsum, in_count * sizeof(float)), *dout = dev_from(be, got, out_count * sizeof(float));
    assert_int_equal(be->ops->group_scores(be, dout, din, stride, n_heads, n_kv, len, pooled, div, kernel, pool_max,
                                           gqa_max),
                     SKV_OK);
    dev_to(be, got, dout, out_count * sizeof(float));
    group_scores_ref(want, colsum, stride, n_heads, n_kv, len, pooled, div, kernel, pool_max, gqa_max);
    for (int h = 0; h < n_kv; h++)
        for (int64_t j = 0; j < stride; j++) {
            float a = got[h * stride + j], b = want[h * stride + j];
            if (j >= len[h]) {
                assert_true(isnan(a)); /* left alone */
                continue;
            }
            if (!(fabsf(a - b) <= 1e-6f * fabsf(b))) {
                print_error("group_scores h=%d j=%lld: %.9g, want %.9g (pooled %d, kernel %d, %s/%s)\n", h,
                            (long long)j, a, b, pooled[h], kernel, pool_max ? "max" : "avg", gqa_max ? "max" : "mean");
                fail();
            }
        }
    be->ops->free(be, din);
    be->ops->free(be, dout);
    free(got);
    free(want);
}

static void test_group_scores(void **state)
{
    struct skv_backend *be = fixture_be(state);
    /* by hand: one head, pooling over all 5 rows with kernel 3 */
    const float x[] = {1, 5, 2, 0, 3};
    int len1[] = {5}, all5[] = {5}, none[] = {0};
    float *dx = dev_from(be, x, sizeof x), got[5];
    float *dout = dev_from(be, x, sizeof x);
    const float want_max[] = {5, 5, 5, 3, 3};
    assert_int_equal(be->ops->group_scores(be, dout, dx, 5, 1, 1, len1, all5, 1.0f, 3, true, false), SKV_OK);
    dev_to(be, got, dout, sizeof got);
    assert_memory_equal(got, want_max, sizeof got);
    const float want_avg[] = {6.0f / 3, 8.0f / 3, 7.0f / 3, 5.0f / 3, 3.0f / 3}; /* padding counts as 0 */
    assert_int_equal(be->ops->group_scores(be, dout, dx, 5, 1, 1, len1, all5, 1.0f, 3, false, false), SKV_OK);
    dev_to(be, got, dout, sizeof got);
    for (int i = 0; i < 5; i++)
        assert_true(fabsf(got[i] - want_avg[i]) < 1e-6f);
    assert_int_equal(be->ops->group_scores(be, dout, dx, 5, 1, 1, len1, none, 2.0f, 3, true, false), SKV_OK);
    dev_to(be, got, dout, sizeof got);
    const float halved[] = {0.5f, 2.5f, 1, 0, 1.5f}; /* nothing pooled, divided by 2 */
    assert_memory_equal(got, halved, sizeof got);
    be->ops->free(be, dx);
    be->ops->free(be, dout);
    /* by hand: two query heads of one KV head, mean and max */
    const float in[] = {1, 2, 3, 0, /* head 0 */ 3, 0, 3, 4 /* head 1 */};
    int len4[] = {4}, none4[] = {0};
    float *din = dev_from(be, in, sizeof in), g4[4];
    dout = dev_from(be, in, 4 * sizeof(float));
    const float mean[] = {2, 1, 3, 2}, mx[] = {3, 2, 3, 4};
    assert_int_equal(be->ops->group_scores(be, dout, din, 4, 2, 1, len4, none4, 1.0f, 1, true, false), SKV_OK);
    dev_to(be, g4, dout, sizeof g4);
    assert_memory_equal(g4, mean, sizeof g4);
    assert_int_equal(be->ops->group_scores(be, dout, din, 4, 2, 1, len4, none4, 1.0f, 1, true, true), SKV_OK);
    dev_to(be, g4, dout, sizeof g4);
    assert_memory_equal(g4, mx, sizeof g4);
    be->ops->free(be, din);
    be->ops->free(be, dout);

    /* random: 12 query heads over 4 KV heads, ragged lengths, every pooling / GQA mode */
    struct rng r = {0x5c0e5ULL};
    enum { STRIDE = 3001 };
    float *colsum = host_normal(&r, (size_t)STRIDE * 12, 1.0);
    for (size_t i = 0; i < (size_t)STRIDE * 12; i++)
        colsum[i] = fabsf(colsum[i]);
    int len[4] = {3001, 0, 1, 2500}, pooled[4] = {2969, 0, 0, 2500};
    for (int mode = 0; mode < 4; mode++)
        check_group_scores(be, colsum, STRIDE, 12, 4, len, pooled, 7.0f, mode < 2 ? 7 : 5, mode & 1, mode >= 2);
    int len_b[2] = {40, 9}, pooled_b[2] = {8, 9};
    check_group_scores(be, colsum, 41, 8, 2, len_b, pooled_b, 3.0f, 31, false, false); /* kernel past the edges */
    check_group_scores(be, colsum, 41, 1, 1, len_b, pooled_b, 1.0f, 1, true, false);  /* no GQA, kernel 1 */
    free(colsum);

    /* argument rules */
    float *d = dev_from(be, x, sizeof x);
    assert_int_equal(be->ops->group_scores(be, d, d, 5, 1, 1, len1, all5, 1.0f, 4, true, false), SKV_E_INVAL);
    assert_int_equal(be->ops->group_scores(be, d, d, 5, 1, 1, len1, all5, 0.0f, 3, true, false), SKV_E_INVAL);
    assert_int_equal(be->ops->group_scores(be, d, d, 5, 3, 2, len1, all5, 1.0f, 3, true, false), SKV_E_INVAL);
    assert_int_equal(be->ops->group_scores(be, d, d, 4, 1, 1, len1, all5, 1.0f, 3, true, false), SKV_E_INVAL);
    int six[] = {6};
    assert_int_equal(be->ops->group_scores(be, d, d, 5, 1, 1, len1, six, 1.0f, 3, true, false), SKV_E_INVAL);
    be->ops->free(be, d);
}

/* topk_rows' definition by sorting: larger key first (NaN last, -0 equal to +0), then lower
 * segment, then lower row. */
struct topk_item {
    float key;
    int seg, row;
};

static int topk_item_cmp(const void *a, const void *b)
{
    const struct topk_item *x = a, *y = b;
    bool xn = isnan(x->key), yn = isnan(y->key);
    if (xn != yn)
        return xn ? 1 : -1;
    if (!xn && x->key != y->key)
        return x->key > y->key ? -1 : 1;
    if (x->seg != y->seg)
        return x->seg < y->seg ? -1 : 1;
    return x->row < y->row ? -1 : x->row > y->row;
}

static int int_cmp(const void *a, const void *b)
{
    int x = *(const int32_t *)a, y = *(const int32_t *)b;
    return x < y ? -1 : x > y;
}

static void topk_ref(int32_t *idx, int *cnt, const float *keys, int64_t stride, const int *n, int n_seg, int k,
                     bool joint)
{
    int64_t at = 0;
    for (int s0 = 0; s0 < n_seg; s0 = joint ? n_seg : s0 + 1) {
        int s1 = joint ? n_seg : s0 + 1, total = 0;
        for (int s = s0; s < s1; s++)
            total += n[s];
        struct topk_item *it = malloc((size_t)total * sizeof *it + 1);
        assert_non_null(it);
        int m = 0;
        for (int s = s0; s < s1; s++)
            for (int j = 0; j < n[s]; j++)
                it[m++] = (struct topk_item){keys[s * stride + j], s, j};
        qsort(it, (size_t)m, sizeof *it, topk_item_cmp);
        int take = k < m ? k : m;
        for (int s = s0; s < s1; s++) {
            int c = 0;
            for (int i = 0; i < take; i++)
                if (it[i].seg == s)
                    idx[at + c++] = it[i].row;
            qsort(idx + at, (size_t)c, sizeof *idx, int_cmp);
            cnt[s] = c;
            at += c;
        }
        free(it);
    }
}

static void check_topk(struct skv_backend *be, const float *keys, int64_t stride, const int *n, int n_seg, int k,
                       bool joint)
{
    size_t count = (size_t)stride * n_seg, cap = count + 8;
    int32_t *got = malloc(cap * sizeof *got), *want = malloc(cap * sizeof *want);
    assert_non_null(got);
    assert_non_null(want);
    for (size_t i = 0; i < cap; i++)
        got[i] = want[i] = -7; /* poison */
    int cnt[SKV_MAX_KV_HEADS], want_cnt[SKV_MAX_KV_HEADS];
    for (int s = 0; s < n_seg; s++)
        cnt[s] = -1;
    float *dk = dev_from(be, keys, count * sizeof(float));
    assert_int_equal(be->ops->topk_rows(be, got, cnt, dk, stride, n, n_seg, k, joint), SKV_OK);
    topk_ref(want, want_cnt, keys, stride, n, n_seg, k, joint);
    int64_t total = skv_topk_total(n, n_seg, k, joint), sum = 0;
    for (int s = 0; s < n_seg; s++)
        sum += want_cnt[s];
    assert_int_equal(sum, total);
    if (memcmp(cnt, want_cnt, (size_t)n_seg * sizeof *cnt) || memcmp(got, want, cap * sizeof *got)) {
        print_error("topk_rows: %d segments (first %d rows), k %d, %s: kept rows differ\n", n_seg, n[0], k,
                    joint ? "joint" : "per segment");
        fail();
    }
    be->ops->free(be, dk);
    free(got);
    free(want);
}

static void test_topk_rows(void **state)
{
    struct skv_backend *be = fixture_be(state);
    struct rng r = {0x70bcULL};
    enum { STRIDE = 5000, SEGS = 8 };
    float *keys = host_normal(&r, (size_t)STRIDE * SEGS, 1.0);
    /* many ties: a third of the keys from a handful of values, some zeros of both signs,
     * NaN, infinities and negative numbers */
    for (size_t i = 0; i < (size_t)STRIDE * SEGS; i++) {
        uint64_t v = rng_next(&r) % 30;
        if (v < 10)
            keys[i] = (float)(v % 4) * 0.25f;
        else if (v == 10)
            keys[i] = -0.0f;
        else if (v == 11)
            keys[i] = NAN;
        else if (v == 12)
            keys[i] = rng_next(&r) & 1 ? INFINITY : -INFINITY;
    }
    const int lens[][SEGS] = {
        {5000, 4096, 1, 0, 33, 4999, 512, 700},
        {40, 40, 40, 40, 40, 40, 40, 40},
    };
    const int ks[] = {0, 1, 7, 39, 40, 41, 511, 2048, 4999, 5000, 40000};
    for (int li = 0; li < 2; li++)
        for (size_t ki = 0; ki < sizeof ks / sizeof *ks; ki++)
            for (int joint = 0; joint < 2; joint++) {
                check_topk(be, keys, STRIDE, lens[li], SEGS, ks[ki], joint);
                check_topk(be, keys, STRIDE, lens[li], 3, ks[ki], joint);
            }
    /* all equal: the lowest rows (and segments) win */
    for (size_t i = 0; i < (size_t)STRIDE * SEGS; i++)
        keys[i] = 0.5f;
    check_topk(be, keys, STRIDE, lens[0], SEGS, 2048, true);
    check_topk(be, keys, STRIDE, lens[0], SEGS, 2048, false);

    int32_t idx[4];
    int cnt[2], n2[2] = {2, 2}, big[1] = {6};
    float *dk = dev_from(be, keys, 4 * sizeof(float));
    assert_int_equal(be->ops->topk_rows(be, idx, cnt, dk, 2, n2, 0, 1, false), SKV_E_INVAL);
    assert_int_equal(be->ops->topk_rows(be, idx, cnt, dk, 2, n2, 2, -1, false), SKV_E_INVAL);
    assert_int_equal(be->ops->topk_rows(be, idx, cnt, dk, 5, big, 1, 1, false), SKV_E_INVAL);
    assert_int_equal(be->ops->topk_rows(be, idx, cnt, dk, 2, n2, SKV_MAX_KV_HEADS + 1, 1, false), SKV_E_INVAL);
    be->ops->free(be, dk);
    free(keys);
}

static void test_attention_invalid(void **state)
{
    struct skv_backend *be = fixture_be(state);
    float q[8 * 64] = {0}, out[8 * 64], kbuf[4 * 64] = {0};
    struct skv_kv_view kv = {.n_kv_heads = 3, .head_dim = 64, .kv_type = SKV_DTYPE_F32};
    for (int g = 0; g < 3; g++) {
        kv.k[g] = kbuf;
        kv.v[g] = kbuf;
    }
    /* shape checks come before any buffer is touched, so host buffers do for any backend */
    assert_int_equal(be->ops->attention(be, out, q, 1, 8, &kv), SKV_E_INVAL);
    kv.n_kv_heads = 0;
    assert_int_equal(be->ops->attention(be, out, q, 1, 8, &kv), SKV_E_INVAL);
    kv.n_kv_heads = SKV_MAX_KV_HEADS + 1;
    assert_int_equal(be->ops->attention(be, out, q, 1, SKV_MAX_KV_HEADS + 1, &kv), SKV_E_INVAL);
    kv.n_kv_heads = 2;
    kv.head_dim = 0;
    assert_int_equal(be->ops->attention(be, out, q, 1, 8, &kv), SKV_E_INVAL);
    kv.head_dim = 64;
    kv.kv_type = SKV_DTYPE_BF16; /* f32, f16 and q8_0 only (test_kv_f16, test_kv_q8_0) */
    assert_int_equal(be->ops->attention(be, out, q, 1, 8, &kv), SKV_E_UNSUPPORTED);
    kv.kv_type = SKV_DTYPE_F32;
    kv.prefix_len[1] = -1;
    assert_int_equal(be->ops->attention(be, out, q, 1, 8, &kv), SKV_E_INVAL);
    kv.prefix_len[1] = 0;
    kv.window = -1;
    assert_int_equal(be->ops->attention(be, out, q, 1, 8, &kv), SKV_E_INVAL);
    kv.window = 16; /* a window needs the rows' positions */
    assert_int_equal(be->ops->attention(be, out, q, 1, 8, &kv), SKV_E_INVAL);
    assert_int_equal(be->ops->attention_colsum(be, out, 64, q, 1, 8, &kv, 0), SKV_E_INVAL);
}

/* ---- CPU pool, scratch, determinism, selection ------------------------------------ */

/* The CPU attention of a query does not depend on where its call starts: queries [P, n) in a
 * call of their own over the first P rows as prefix give bit for bit what they get in one call
 * of all n, for calls of more than 8 queries (a PREFILL after a reused prefix computes more
 * than the engine's small-batch size: 8 with float weights, 32 with quantized ones). A call of
 * more than 8 queries takes the wide kernels for every query block, however few its rows, and
 * never split-K (att_plan, ATT_SMALL_CALL): a short last block taking the row kernels, or a
 * one-block call taking split-K, made a call's tail differ. GQA groups of SmolLM2 (3) and
 * Qwen2.5-0.5B (7), and MHA (1, 64-query blocks) past 512 keys, where a 9..64-query call was
 * one block that took split-K. */
static void test_attention_start_free(void **state)
{
    struct skv_backend *be = fixture_be(state);
    struct rng r = {0x5717ULL};
    const int n = 640, d = 64, groups[] = {3, 7, 1};
    const int starts[] = {631, 620, 607, 600, 576, 567, 560, 536, 535, 517, 459, 416, 16};
    for (size_t gi = 0; gi < 3; gi++) {
        const int n_kv = 2, n_heads = n_kv * groups[gi];
        const size_t row = (size_t)n_heads * d, kc = (size_t)n * d;
        float *q = host_normal(&r, (size_t)n * row, 1.0), *whole = host_nan((size_t)n * row);
        float *k[2], *v[2];
        struct skv_kv_view kv = {.n_kv_heads = n_kv, .head_dim = d, .kv_type = SKV_DTYPE_F32};
        for (int g = 0; g < n_kv; g++) {
            k[g] = host_normal(&r, kc, 1.0);
            v[g] = host_normal(&r, kc, 1.0);
            kv.k[g] = dev_from(be, k[g], kc * sizeof(float));
            kv.v[g] = dev_from(be, v[g], kc * sizeof(float));
        }
        float *dq = dev_from(be, q, (size_t)n * row * sizeof(float));
        float *dout = dev_from(be, whole, (size_t)n * row * sizeof(float));
        assert_int_equal(be->ops->attention(be, dout, dq, n, n_heads, &kv), SKV_OK);
        dev_to(be, whole, dout, (size_t)n * row * sizeof(float));
        for (size_t si = 0; si < sizeof starts / sizeof starts[0]; si++) {
            const int p = starts[si], m = n - p;
            float *part = host_nan((size_t)m * row);
            for (int g = 0; g < n_kv; g++)
                kv.prefix_len[g] = p;
            assert_int_equal(be->ops->attention(be, dout, dq + (size_t)p * row, m, n_heads, &kv), SKV_OK);
            dev_to(be, part, dout, (size_t)m * row * sizeof(float));
            for (int g = 0; g < n_kv; g++)
                kv.prefix_len[g] = 0;
            if (memcmp(part, whole + (size_t)p * row, (size_t)m * row * sizeof(float)) != 0)
                fail_msg("group %d: queries %d..%d alone differ from the same queries in one call", groups[gi], p,
                         n - 1);
            free(part);
        }
        be->ops->free(be, dout);
        be->ops->free(be, dq);
        for (int g = 0; g < n_kv; g++) {
            be->ops->free(be, (void *)kv.k[g]);
            be->ops->free(be, (void *)kv.v[g]);
            free(k[g]);
            free(v[g]);
        }
        free(whole);
        free(q);
    }
}


struct cover {
    atomic_int *hits;
    int64_t grain;
    int64_t most; /* > 0: items a call may cover at most */
    int n_threads;
    atomic_int bad;
};

static void cover_fn(void *arg, int64_t begin, int64_t end, int tid)
{
    struct cover *c = arg;
    if (begin % c->grain != 0 || begin >= end || tid < 0 || tid >= c->n_threads ||
        (c->most > 0 && end - begin > c->most))
        atomic_fetch_add(&c->bad, 1);
    for (int64_t i = begin; i < end; i++)
        atomic_fetch_add_explicit(&c->hits[i], 1, memory_order_relaxed);
}

/* Threads of this process named skv-cpu; every one must block the daemon's signals (SIGTERM,
 * SIGINT, SIGHUP go to its socket thread). */
static int pool_threads_blocking(void)
{
    DIR *dir = opendir("/proc/self/task");
    assert_non_null(dir);
    int named = 0;
    struct dirent *de;
    while ((de = readdir(dir))) {
        char path[300], line[256], comm[32] = "";
        snprintf(path, sizeof path, "/proc/self/task/%s/comm", de->d_name);
        FILE *f = fopen(path, "r");
        if (f && fgets(comm, sizeof comm, f))
            comm[strcspn(comm, "\n")] = '\0';
        if (f)
            fclose(f);
        if (strcmp(comm, "skv-cpu") != 0)
            continue;
        named++;
        snprintf(path, sizeof path, "/proc/self/task/%s/status", de->d_name);
        assert_non_null(f = fopen(path, "r"));
        unsigned long long blocked = 0;
        bool seen = false;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "SigBlk: %llx", &blocked) == 1)
                seen = true;
        fclose(f);
        assert_true(seen);
        const int sigs[] = {SIGHUP, SIGINT, SIGTERM};
        for (int k = 0; k < 3; k++)
            assert_true(blocked & (1ull << (sigs[k] - 1)));
    }
    closedir(dir);
    return named;
}

/* The CPU pool's threads, one per thread past the first, are named skv-cpu and block the
 * daemon's signals whatever the creating thread's mask. */
static void test_pool_threads(void **state)
{
    (void)state;
    int before = pool_threads_blocking();
    struct skv_backend *be = NULL;
    assert_int_equal(skv_backend_cpu_new(3, &be), SKV_OK);
    assert_int_equal(pool_threads_blocking(), before + 2);
    skv_backend_destroy(&be);
}

static void test_parallel_for(void **state)
{
    (void)state;
    const int threads[] = {1, 2, 3, 4, 8};
    const int64_t ns[] = {0, 1, 2, 5, 63, 64, 65, 1000, 4097};
    const int64_t grains[] = {0, 1, 3, 64, 1000};
    atomic_int *hits = calloc(4097, sizeof *hits);
    assert_non_null(hits);

    for (size_t t = 0; t < sizeof threads / sizeof threads[0]; t++) {
        struct skv_backend *be = NULL;
        assert_int_equal(skv_backend_cpu_new(threads[t], &be), SKV_OK);
        assert_int_equal(be->n_threads, threads[t]);
        for (int rep = 0; rep < 20; rep++)
            for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++)
                for (size_t g = 0; g < sizeof grains / sizeof grains[0]; g++) {
                    struct cover c = {.hits = hits, .grain = grains[g] < 1 ? 1 : grains[g],
                                      .n_threads = threads[t]};
                    atomic_init(&c.bad, 0);
                    for (int64_t k = 0; k < ns[i]; k++)
                        atomic_init(&hits[k], 0);
                    skv_cpu_parallel_for(be, ns[i], grains[g], cover_fn, &c);
                    assert_int_equal(atomic_load(&c.bad), 0);
                    for (int64_t k = 0; k < ns[i]; k++)
                        assert_int_equal(atomic_load(&hits[k]), 1);
                }
        skv_backend_destroy(&be);
        assert_null(be);
    }
    free(hits);
}

/* skv_cpu_parallel_tasks: every task runs once, on a valid thread, one task a call (two at most
 * past the 65535 claims a job holds; one thread runs them all in one call). */
static void test_parallel_tasks(void **state)
{
    (void)state;
    const int threads[] = {1, 2, 3, 8};
    const int64_t ns[] = {0, 1, 2, 5, 65, 4097, 70000};
    atomic_int *hits = calloc(70000, sizeof *hits);
    assert_non_null(hits);
    for (size_t t = 0; t < sizeof threads / sizeof threads[0]; t++) {
        struct skv_backend *be = NULL;
        assert_int_equal(skv_backend_cpu_new(threads[t], &be), SKV_OK);
        for (int rep = 0; rep < 5; rep++)
            for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
                struct cover c = {.hits = hits, .grain = 1, .n_threads = threads[t],
                                  .most = threads[t] == 1 ? 0 : ns[i] > 65535 ? 2 : 1};
                atomic_init(&c.bad, 0);
                for (int64_t k = 0; k < ns[i]; k++)
                    atomic_init(&hits[k], 0);
                skv_cpu_parallel_tasks(be, ns[i], cover_fn, &c);
                assert_int_equal(atomic_load(&c.bad), 0);
                for (int64_t k = 0; k < ns[i]; k++)
                    assert_int_equal(atomic_load(&hits[k]), 1);
            }
        skv_backend_destroy(&be);
    }
    free(hits);
}

struct tid_use {
    atomic_int used[8];
};

static void tid_fn(void *arg, int64_t begin, int64_t end, int tid)
{
    struct tid_use *u = arg;
    (void)begin;
    (void)end;
    atomic_fetch_add(&u->used[tid], 1);
}

static void test_parallel_for_chunks(void **state)
{
    /* one contiguous chunk per thread: n_threads calls when there is enough work */
    (void)state;
    struct skv_backend *be = NULL;
    assert_int_equal(skv_backend_cpu_new(4, &be), SKV_OK);
    for (int rep = 0; rep < 1000; rep++) {
        struct tid_use u;
        for (int i = 0; i < 8; i++)
            atomic_init(&u.used[i], 0);
        skv_cpu_parallel_for(be, 100, 1, tid_fn, &u);
        int calls = 0;
        for (int i = 0; i < 8; i++)
            calls += atomic_load(&u.used[i]);
        assert_int_equal(calls, 4);
    }
    skv_backend_destroy(&be);
}

static void test_scratch_alloc(void **state)
{
    (void)state;
    struct skv_backend *be = NULL;
    assert_int_equal(skv_backend_cpu_new(3, &be), SKV_OK);
    const size_t sizes[] = {1, 100, 4096, 1 << 20, 10, 3 << 20};
    for (int t = 0; t < 3; t++)
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
            unsigned char *p = skv_cpu_scratch(be, t, sizes[i]);
            assert_non_null(p);
            assert_int_equal((uintptr_t)p % 64, 0);
            memset(p, 0xa5, sizes[i]);
        }
    /* per thread, distinct */
    void *p0 = skv_cpu_scratch(be, 0, 256), *p1 = skv_cpu_scratch(be, 1, 256);
    assert_ptr_not_equal(p0, p1);

    const size_t asz[] = {0, 1, 63, 64, 1000, 1 << 22};
    for (size_t i = 0; i < sizeof asz / sizeof asz[0]; i++) {
        void *m = NULL;
        assert_int_equal(be->ops->alloc(be, asz[i], &m), SKV_OK);
        assert_non_null(m);
        assert_int_equal((uintptr_t)m % 64, 0);
        memset(m, 1, asz[i]);
        be->ops->free(be, m);
    }
    char src[100], dst[100];
    memset(src, 7, sizeof src);
    assert_int_equal(be->ops->upload(be, dst, src, sizeof src), SKV_OK);
    assert_memory_equal(dst, src, sizeof src);
    assert_int_equal(be->ops->sync(be), SKV_OK);
    skv_backend_destroy(&be);
}

static void test_determinism(void **state)
{
    (void)state;
    struct skv_backend *be[3] = {NULL, NULL, NULL};
    const int threads[3] = {1, 2, 3};
    for (int i = 0; i < 3; i++)
        assert_int_equal(skv_backend_cpu_new(threads[i], &be[i]), SKV_OK);

    const struct att_case cases[] = {
        {.n = 200, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {0, 0, 0}, .q_scale = 1.0},
        {.n = 77, .n_heads = 8, .n_kv = 2, .d = 128, .prefix = {300, 17}, .q_scale = 2.0},
        {.n = 1, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {8999, 6000, 100}, .q_scale = 1.0},
        {.n = 5, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {2000, 2000, 2000}, .q_scale = 1.0},
        {.n = 16, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {1000, 700, 1500}, .q_scale = 1.0},
        {.n = 150, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {100, 0, 50}, .q_scale = 1.0,
         .window = 40, .gaps = 2},
        {.n = 1, .n_heads = 9, .n_kv = 3, .d = 64, .prefix = {8999, 6000, 100}, .q_scale = 1.0,
         .window = 2000, .gaps = 1},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        float *out[3];
        for (int i = 0; i < 3; i++) {
            struct rng r = {0xd00dULL + c};
            out[i] = run_attention(be[i], &r, &cases[c], false);
        }
        size_t count = (size_t)cases[c].n * cases[c].n_heads * cases[c].d;
        assert_memory_equal(out[0], out[1], count * sizeof(float));
        assert_memory_equal(out[0], out[2], count * sizeof(float));
        for (int i = 0; i < 3; i++)
            free(out[i]);
    }

    const int n = 300, dim = 576;
    float *rn[3];
    for (int i = 0; i < 3; i++) {
        struct rng r = {0xbeefULL};
        rn[i] = malloc((size_t)n * dim * sizeof(float));
        assert_non_null(rn[i]);
        run_rmsnorm(be[i], &r, n, dim, 1e-5f, false, rn[i]);
    }
    assert_memory_equal(rn[0], rn[1], (size_t)n * dim * sizeof(float));
    assert_memory_equal(rn[0], rn[2], (size_t)n * dim * sizeof(float));
    for (int i = 0; i < 3; i++) {
        free(rn[i]);
        skv_backend_destroy(&be[i]);
    }
}

/* A device whose GEMM path is broken: matmul of more than 8 rows leaves zeros. */
static const struct skv_backend_ops *g_selftest_real;
static int broken_gemm(struct skv_backend *be, float *out, const struct skv_tensor *w, const float *bias,
                       const float *x, int n)
{
    int rc = g_selftest_real->matmul(be, out, w, bias, x, n);
    if (!rc && n > 8)
        memset(out, 0, (size_t)n * (size_t)w->ne[1] * sizeof(float));
    return rc;
}

/* The start-up self-test the daemon runs before trusting a device backend passes on the CPU,
 * and fails a backend whose GEMM path is broken (before, it ran only rmsnorm and one small
 * attention, and such a device passed). */
static void test_selftest(void **state)
{
    (void)state;
    struct skv_backend *be = NULL;
    assert_int_equal(skv_backend_cpu_new(2, &be), SKV_OK);
    assert_int_equal(skv_backend_selftest(be), SKV_OK);
    g_selftest_real = be->ops;
    struct skv_backend_ops broken = *be->ops;
    broken.matmul = broken_gemm;
    be->ops = &broken;
    assert_int_equal(skv_backend_selftest(be), SKV_E_DEVICE);
    assert_non_null(strstr(skv_error_msg(), "matmul f16 n=16 differs from the CPU reference"));
    be->ops = g_selftest_real;
    skv_backend_destroy(&be);
}

static void test_backend_open(void **state)
{
    (void)state;
    struct skv_backend *be = NULL;

    assert_int_equal(skv_backend_open("cpu", 3, &be), SKV_OK);
    assert_non_null(be);
    assert_string_equal(be->name, "cpu");
    assert_int_equal(be->n_threads, 3);
    skv_backend_destroy(&be);
    assert_null(be);

    assert_int_equal(skv_backend_open("cpu", 0, &be), SKV_OK);
    assert_true(be->n_threads >= 1 && be->n_threads <= 256);
    skv_backend_destroy(&be);

    assert_int_equal(skv_backend_cpu_new(100000, &be), SKV_OK);
    assert_int_equal(be->n_threads, 256);
    skv_backend_destroy(&be);

    assert_int_equal(skv_backend_open("nope", 1, &be), SKV_E_INVAL);
    assert_null(be);
    assert_int_equal(skv_backend_open(NULL, 1, &be), SKV_E_INVAL);

    if (!skv_backend_cuda_compiled()) {
        assert_int_equal(skv_backend_open("cuda", 1, &be), SKV_E_UNSUPPORTED);
        assert_null(be);
        assert_non_null(strstr(skv_error_msg(), "not compiled"));
        assert_int_equal(skv_backend_cuda_new(0, &be), SKV_E_UNSUPPORTED);
    }

    assert_int_equal(skv_backend_open("auto", 2, &be), SKV_OK);
    assert_non_null(be);
    if (!skv_backend_cuda_compiled())
        assert_string_equal(be->name, "cpu");
    skv_backend_destroy(&be);

    skv_backend_destroy(&be);
    skv_backend_destroy(NULL);
}

/* log-softmax of n logits at t in double, as the op defines it: +inf logits share the mass, a
 * NaN counts as -inf, no finite or +inf logit: -inf */
static double ref_logprob(const float *x, int n, int t)
{
    double mx = -INFINITY, s = 0;
    int n_inf = 0;
    for (int i = 0; i < n; i++) {
        mx = x[i] > mx ? x[i] : mx;
        n_inf += x[i] == INFINITY;
    }
    if (n_inf)
        return x[t] == INFINITY ? -log((double)n_inf) : -INFINITY;
    if (mx == -INFINITY || isnan(x[t]))
        return -INFINITY;
    for (int i = 0; i < n; i++)
        s += isnan(x[i]) ? 0.0 : exp((double)x[i] - mx);
    return (double)x[t] - mx - log(s);
}

/* row_logprobs (optional; NULL on a backend without it): random rows of a 49152-token and a
 * 37-token vocabulary (the vector loop's tail) within 1e-5 of the double-precision log-softmax;
 * rows with NaN, -inf and +inf logits as the reference defines them; bad targets refused. */
static void test_row_logprobs(void **state)
{
    struct skv_backend *be = fixture_be(state);
    if (!be->ops->row_logprobs)
        skip();
    struct rng r = {0x10960ULL};
    const int vocabs[] = {49152, 37};
    for (int v = 0; v < 2; v++) {
        const int nv = vocabs[v], n = 9;
        float *x = host_normal(&r, (size_t)n * nv, 4.0);
        int32_t t[9];
        for (int i = 0; i < n; i++)
            t[i] = (int32_t)((i * 7919 + 3) % nv);
        x[nv + 5] = NAN;                      /* row 1: a NaN elsewhere */
        x[2 * nv + t[2]] = NAN;               /* row 2: the target's NaN */
        x[3 * nv + 1] = INFINITY;             /* row 3: two +inf, one the target */
        x[3 * nv + t[3]] = INFINITY;
        for (int i = 0; i < nv; i++)          /* row 4: every logit -inf */
            x[4 * nv + i] = -INFINITY;
        x[5 * nv + t[5]] = -INFINITY;         /* row 5: the target -inf */
        x[6 * nv + 2] = 60.0f;                /* row 6: one logit far above the rest */
        x[7 * nv + 20] = x[7 * nv + 11] = 70.0f; /* row 7: two equal largest, the lower id the top */
        float *dx = dev_from(be, x, (size_t)n * nv * sizeof *x), got[9];
        int32_t top[9];
        assert_int_equal(be->ops->row_logprobs(be, got, top, dx, t, n, nv), SKV_OK);
        for (int i = 0; i < n; i++) {
            const float *row = x + (size_t)i * nv;
            int best = -1; /* the lowest id of the largest logit, NaN never */
            for (int j = 0; j < nv; j++)
                if (!isnan(row[j]) && (best < 0 || row[j] > row[best]))
                    best = j;
            assert_int_equal(top[i], best < 0 ? 0 : best);
            double want = ref_logprob(row, nv, t[i]);
            if (isinf(want) || i == 3)
                assert_true(got[i] == (float)want);
            else if (fabs(got[i] - want) > 1e-5)
                fail_msg("vocab %d row %d: %.9g against %.9g", nv, i, got[i], want);
        }
        assert_int_equal(top[6], 2);
        assert_int_equal(top[7], 11);
        float again[9];
        assert_int_equal(be->ops->row_logprobs(be, again, NULL, dx, t, n, nv), SKV_OK); /* no top wanted */
        assert_memory_equal(again, got, sizeof got);
        t[0] = nv; /* a target outside the vocabulary */
        assert_int_equal(be->ops->row_logprobs(be, got, top, dx, t, n, nv), SKV_E_INVAL);
        be->ops->free(be, dx);
        free(x);
    }
}

/* The order row_top_logprobs ranks in: larger first, a NaN as -inf, equal ones by the lower id. */
static const float *g_rank_row;
static int rank_cmp(const void *pa, const void *pb)
{
    const int a = *(const int *)pa, b = *(const int *)pb;
    const float xa = isnan(g_rank_row[a]) ? -INFINITY : g_rank_row[a];
    const float xb = isnan(g_rank_row[b]) ? -INFINITY : g_rank_row[b];
    return xa > xb ? -1 : xa < xb ? 1 : a - b;
}

/* row_top_logprobs (optional): the rows of test_row_logprobs (NaN, +inf, -inf, equal largest)
 * and rows with many equal logits, k of 1, 5, 20 and the whole 37-token vocabulary: the ids
 * a sort by (logit, id) gives, the values within 1e-5 of the double log-softmax, out the same
 * bits as row_logprobs', the target's value where listed the same bits as out; bad k refused. */
static void test_row_top_logprobs(void **state)
{
    struct skv_backend *be = fixture_be(state);
    if (!be->ops->row_top_logprobs)
        skip();
    struct rng r = {0x70951ULL};
    const int vocabs[] = {49152, 37}, ks[] = {1, 5, 20, 37};
    for (int v = 0; v < 2; v++) {
        const int nv = vocabs[v], n = 11;
        float *x = host_normal(&r, (size_t)n * nv, 4.0);
        int32_t t[11];
        for (int i = 0; i < n; i++)
            t[i] = (int32_t)((i * 7919 + 3) % nv);
        x[nv + 5] = NAN;
        x[2 * nv + t[2]] = NAN;
        x[3 * nv + 1] = INFINITY;
        x[3 * nv + t[3]] = INFINITY;
        for (int i = 0; i < nv; i++)
            x[4 * nv + i] = -INFINITY;
        x[5 * nv + t[5]] = -INFINITY;
        x[6 * nv + 2] = 60.0f;
        x[7 * nv + 20] = x[7 * nv + 11] = 70.0f;
        for (int i = 0; i < nv; i++) /* row 8: four values only, so most are equal to others */
            x[8 * nv + i] = (float)(i % 4);
        x[9 * nv + t[9]] = 50.0f; /* row 9: the target the most likely */
        for (int i = 0; i < nv; i++) /* row 10: every logit NaN */
            x[10 * nv + i] = NAN;
        float *dx = dev_from(be, x, (size_t)n * nv * sizeof *x), want_out[11], got_out[11];
        assert_int_equal(be->ops->row_logprobs(be, want_out, NULL, dx, t, n, nv), SKV_OK);
        int *order = malloc((size_t)nv * sizeof *order);
        for (int ki = 0; ki < 4; ki++) {
            const int k = ks[ki] < nv ? ks[ki] : nv;
            int32_t *ids = malloc((size_t)n * k * sizeof *ids);
            float *lps = malloc((size_t)n * k * sizeof *lps);
            assert_int_equal(be->ops->row_top_logprobs(be, got_out, ids, lps, k, dx, t, n, nv), SKV_OK);
            assert_memory_equal(got_out, want_out, sizeof got_out);
            for (int i = 0; i < n; i++) {
                const float *row = x + (size_t)i * nv;
                for (int j = 0; j < nv; j++)
                    order[j] = j;
                g_rank_row = row;
                qsort(order, (size_t)nv, sizeof *order, rank_cmp);
                for (int j = 0; j < k; j++) {
                    const int32_t id = ids[(size_t)i * k + j];
                    const float lp = lps[(size_t)i * k + j];
                    if (id != order[j])
                        fail_msg("vocab %d k %d row %d rank %d: id %d, the sort's %d", nv, k, i, j, id, order[j]);
                    double want = ref_logprob(row, nv, id);
                    if (isinf(want) || i == 3)
                        assert_true(lp == (float)want);
                    else if (fabs(lp - want) > 1e-5)
                        fail_msg("vocab %d k %d row %d rank %d: %.9g against %.9g", nv, k, i, j, lp, want);
                    if (id == t[i])
                        assert_memory_equal(&lp, &got_out[i], sizeof lp);
                }
            }
            assert_int_equal(ids[9 * k], t[9]);
            free(lps);
            free(ids);
        }
        int32_t ids1[11];
        float lps1[11];
        assert_int_equal(be->ops->row_top_logprobs(be, got_out, ids1, lps1, 0, dx, t, n, nv), SKV_E_INVAL);
        assert_int_equal(be->ops->row_top_logprobs(be, got_out, ids1, lps1, nv + 1, dx, t, n, nv), SKV_E_INVAL);
        assert_int_equal(be->ops->row_top_logprobs(be, got_out, NULL, lps1, 1, dx, t, n, nv), SKV_E_INVAL);
        t[0] = -1;
        assert_int_equal(be->ops->row_top_logprobs(be, got_out, ids1, lps1, 1, dx, t, n, nv), SKV_E_INVAL);
        free(order);
        be->ops->free(be, dx);
        free(x);
    }
}

/* Device memory that is not there is NOMEM, as the CPU's (DEVICE before: a pool slab the GPU
 * could not hold failed its request as a device error), and the device goes on serving. The
 * CPU's own case is not run: a sanitizer build aborts on such a size instead of failing it. */
static void test_alloc_too_much(void **state)
{
    struct skv_backend *be = fixture_be(state);
    if (strcmp(be->name, "cuda") != 0)
        skip();
    void *p = NULL;
    assert_int_equal(be->ops->alloc(be, (size_t)1 << 50, &p), SKV_E_NOMEM);
    assert_int_equal(be->ops->alloc(be, 4096, &p), SKV_OK);
    be->ops->free(be, p);
}

#define OP_TESTS                                                                              \
    cmocka_unit_test(test_rmsnorm), cmocka_unit_test(test_rope),                              \
        cmocka_unit_test(test_rope_invalid), cmocka_unit_test(test_swiglu),                   \
        cmocka_unit_test(test_add), cmocka_unit_test(test_matmul_multi),                      \
        cmocka_unit_test(test_matmul_types),                                                  \
        cmocka_unit_test(test_attention),                                                     \
        cmocka_unit_test(test_attention_peaky), cmocka_unit_test(test_attention_decode_long), \
        cmocka_unit_test(test_attention_odd_dim), cmocka_unit_test(test_attention_window),  \
        cmocka_unit_test(test_attention_paths), cmocka_unit_test(test_colsum_window),       \
        cmocka_unit_test(test_attention_paged), cmocka_unit_test(test_attention_batch),     \
        cmocka_unit_test(test_copy_rows), cmocka_unit_test(test_group_scores),              \
        cmocka_unit_test(test_topk_rows), cmocka_unit_test(test_attention_invalid),         \
        cmocka_unit_test(test_kv_f16), cmocka_unit_test(test_kv_q8_0),               \
        cmocka_unit_test(test_kv_shared_batch), cmocka_unit_test(test_row_logprobs),        \
        cmocka_unit_test(test_row_top_logprobs), cmocka_unit_test(test_alloc_too_much)

int main(void)
{
    const struct CMUnitTest cpu_tests[] = {
        OP_TESTS,
        cmocka_unit_test(test_rope_llama3_freqs),
        cmocka_unit_test(test_parallel_for),
        cmocka_unit_test(test_parallel_tasks),
        cmocka_unit_test(test_pool_threads),
        cmocka_unit_test(test_parallel_for_chunks),
        cmocka_unit_test(test_scratch_alloc),
        cmocka_unit_test(test_determinism),
        cmocka_unit_test(test_attention_start_free),
        cmocka_unit_test(test_backend_open),
        cmocka_unit_test(test_selftest),
    };
    const struct CMUnitTest cuda_tests[] = {OP_TESTS};
    int failed = cmocka_run_group_tests_name("backend_ops_cpu", cpu_tests, setup_cpu, teardown);
    failed += cmocka_run_group_tests_name("backend_ops_cuda", cuda_tests, setup_cuda, teardown);
    return failed ? 1 : 0;
}
