/* Backend selection by name ("auto", "cpu", "cuda"), the one destructor every backend
 * shares, and the sliding-window row bounds every attention op uses. The chosen backend's
 * name is in be->name; callers that want the reason CUDA was not taken call
 * skv_backend_cuda_new() themselves. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "common/status.h"
#include "kernels/backend.h"

int skv_backend_open(const char *name, int n_threads, struct skv_backend **out)
{
    if (!name || !out)
        return skv_errorf(SKV_E_INVAL, "backend: NULL name or out");
    if (strcmp(name, "cpu") == 0)
        return skv_backend_cpu_new(n_threads, out);
    if (strcmp(name, "cuda") == 0) { /* asked for by name: a device that fails the self-test is refused */
        int rc = skv_backend_cuda_new(0, out);
        if (rc == SKV_OK && (rc = skv_backend_selftest(*out)) != SKV_OK)
            skv_backend_destroy(out);
        return rc;
    }
    if (strcmp(name, "auto") == 0) { /* as the daemon takes it: a device that passes the self-test */
        if (skv_backend_cuda_compiled() && skv_backend_cuda_new(0, out) == SKV_OK) {
            if (skv_backend_selftest(*out) == SKV_OK)
                return SKV_OK;
            skv_backend_destroy(out);
        }
        skv_error_clear();
        return skv_backend_cpu_new(n_threads, out);
    }
    return skv_errorf(SKV_E_INVAL, "unknown backend '%s' (auto, cpu or cuda)", name);
}

void skv_backend_destroy(struct skv_backend **be_p)
{
    if (!be_p || !*be_p)
        return;
    (*be_p)->ops->destroy(*be_p);
    *be_p = NULL;
}

/* ---- sliding window ------------------------------------------------------------------------ */

int32_t skv_kv_view_first(const struct skv_kv_view *kv, int h, int i)
{
    const int32_t self = kv->prefix_len[h] + i;
    if (kv->window <= 0)
        return 0;
    const int32_t *pos = kv->pos[h];
    const int64_t lim = (int64_t)pos[self] - kv->window; /* rows at or below lim are out */
    int32_t lo = 0, hi = self;                            /* positions ascend: binary search */
    while (lo < hi) {
        const int32_t mid = lo + (hi - lo) / 2;
        if ((int64_t)pos[mid] > lim)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

int skv_kv_view_check_window(const struct skv_kv_view *kv, const char *op)
{
    if (kv->window < 0)
        return skv_errorf(SKV_E_INVAL, "%s: sliding window %d", op, (int)kv->window);
    for (int h = 0; kv->window > 0 && h < kv->n_kv_heads; h++)
        if (!kv->pos[h])
            return skv_errorf(SKV_E_INVAL, "%s: sliding window without positions for KV head %d", op, h);
    return SKV_OK;
}

int skv_kv_view_check_rows(const struct skv_kv_view *kv, const char *op)
{
    for (int h = 0; h < kv->n_kv_heads; h++) {
        bool ok = kv->block_rows > 0 ? kv->blocks[h] != NULL : kv->k[h] && kv->v[h];
        if (kv->block_rows < 0 || !ok)
            return skv_errorf(SKV_E_INVAL, "%s: KV head %d has no buffer", op, h);
    }
    return SKV_OK;
}

int skv_attention_check(const char *op, const float *out, const float *q, int n, int n_heads,
                        const struct skv_kv_view *kv)
{
    if (!out || !q || !kv)
        return skv_errorf(SKV_E_INVAL, "%s: NULL buffer", op);
    if (n < 0 || n_heads <= 0 || kv->head_dim <= 0)
        return skv_errorf(SKV_E_INVAL, "%s: n=%d n_heads=%d head_dim=%d", op, n, n_heads, kv->head_dim);
    if (kv->n_kv_heads <= 0 || kv->n_kv_heads > SKV_MAX_KV_HEADS || n_heads % kv->n_kv_heads != 0)
        return skv_errorf(SKV_E_INVAL, "%s: %d heads over %d KV heads (max %d)", op, n_heads, kv->n_kv_heads,
                          SKV_MAX_KV_HEADS);
    if (kv->kv_type != SKV_DTYPE_F32 && kv->kv_type != SKV_DTYPE_F16 && kv->kv_type != SKV_DTYPE_Q8_0)
        return skv_errorf(SKV_E_UNSUPPORTED, "%s: KV type %d (f32, f16 or q8_0)", op, kv->kv_type);
    if (skv_kv_row_bytes(kv->kv_type, kv->head_dim) == 0)
        return skv_errorf(SKV_E_INVAL, "%s: q8_0 rows of head_dim %d (a multiple of 32)", op, kv->head_dim);
    for (int g = 0; g < kv->n_kv_heads; g++)
        if (kv->prefix_len[g] < 0 || (int64_t)kv->prefix_len[g] + n > INT32_MAX)
            return skv_errorf(SKV_E_INVAL, "%s: KV head %d prefix %d with %d new", op, g, (int)kv->prefix_len[g], n);
    int rc = skv_kv_view_check_rows(kv, op);
    return rc ? rc : skv_kv_view_check_window(kv, op);
}

bool skv_backend_kv_type_ok(const struct skv_backend *be, int kv_type)
{
    switch (kv_type) {
    case SKV_DTYPE_F32: return true;
    case SKV_DTYPE_F16: return be->ops->store_rows_f16 != NULL;
    case SKV_DTYPE_Q8_0: return be->ops->store_rows_q8_0 != NULL;
    default: return false;
    }
}

int skv_attention_batch_check(const float *out, const float *q, int n_seq, int n_heads,
                              const struct skv_kv_view *kv)
{
    if (!out || !q || !kv || n_seq < 0)
        return skv_errorf(SKV_E_INVAL, "attention_batch: NULL buffer or %d sequences", n_seq);
    for (int s = 0; s < n_seq; s++) {
        int rc = skv_attention_check("attention", out, q, 1, n_heads, &kv[s]);
        if (rc < 0) {
            char why[256];
            snprintf(why, sizeof why, "%s", skv_error_msg());
            return skv_errorf(rc, "attention_batch: sequence %d: %s", s, why);
        }
        if (kv[s].n_kv_heads != kv[0].n_kv_heads || kv[s].head_dim != kv[0].head_dim)
            return skv_errorf(SKV_E_INVAL, "attention_batch: sequence %d has %d KV heads of %d, sequence 0 %d of %d",
                              s, kv[s].n_kv_heads, kv[s].head_dim, kv[0].n_kv_heads, kv[0].head_dim);
    }
    return SKV_OK;
}

int skv_attention_batch_probs_check(const float *out, const float *q, int n_seq, int n_heads,
                                    const struct skv_kv_view *kv, float *const *probs, const int64_t *stride)
{
    int rc = skv_attention_batch_check(out, q, n_seq, n_heads, kv);
    if (rc < 0)
        return rc;
    if (!probs || !stride)
        return skv_errorf(SKV_E_INVAL, "attention_batch_probs: NULL probs or strides");
    for (int s = 0; s < n_seq; s++)
        for (int h = 0; probs[s] && h < kv[s].n_kv_heads; h++)
            if (stride[s] <= kv[s].prefix_len[h])
                return skv_errorf(SKV_E_INVAL, "attention_batch_probs: sequence %d: stride %lld within KV head %d's "
                                  "%d rows", s, (long long)stride[s], h, kv[s].prefix_len[h] + 1);
    return SKV_OK;
}

/* ---- compression scores -------------------------------------------------------------------- */

int skv_group_scores_check(const float *out, const float *colsum, int64_t stride, int n_heads, int n_kv,
                           const int *len, const int *pooled, float div, int kernel)
{
    if (!out || !colsum || !len || !pooled || n_kv <= 0 || n_kv > SKV_MAX_KV_HEADS || n_heads <= 0 ||
        n_heads % n_kv)
        return skv_errorf(SKV_E_INVAL, "group_scores: bad shape (%d heads, %d KV heads)", n_heads, n_kv);
    if (kernel <= 0 || kernel % 2 == 0)
        return skv_errorf(SKV_E_INVAL, "group_scores: pooling kernel %d is not odd and positive", kernel);
    if (!(div > 0.0f) || div == INFINITY)
        return skv_errorf(SKV_E_INVAL, "group_scores: divisor %g", (double)div);
    for (int h = 0; h < n_kv; h++)
        if (len[h] < 0 || len[h] > stride || pooled[h] < 0 || pooled[h] > len[h])
            return skv_errorf(SKV_E_INVAL, "group_scores: KV head %d: %d rows, %d pooled, stride %lld", h,
                              len[h], pooled[h], (long long)stride);
    return SKV_OK;
}

int skv_topk_check(const int32_t *idx, const int *cnt, const float *keys, int64_t stride, const int *n,
                   int n_seg, int k)
{
    if (!idx || !cnt || !keys || !n || n_seg <= 0 || n_seg > SKV_MAX_KV_HEADS || k < 0)
        return skv_errorf(SKV_E_INVAL, "topk_rows: bad arguments (%d segments, k %d)", n_seg, k);
    for (int s = 0; s < n_seg; s++)
        if (n[s] < 0 || n[s] > stride)
            return skv_errorf(SKV_E_INVAL, "topk_rows: segment %d has %d rows, stride %lld", s, n[s],
                              (long long)stride);
    return SKV_OK;
}

int64_t skv_topk_total(const int *n, int n_seg, int k, bool joint)
{
    int64_t total = 0;
    for (int s = 0; s < n_seg; s++)
        total += joint ? n[s] : (n[s] < k ? n[s] : k);
    return joint && total > k ? k : total;
}

/* ---- start-up self-test --------------------------------------------------------------------- */

static double nmse(const float *a, const float *b, int n)
{
    double num = 0, den = 1e-30;
    for (int i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return num / den;
}

/* One self-test comparison: `what` on be gave dev, the CPU want; NMSE above tol fails it. */
static int selftest_close(const struct skv_backend *be, const char *what, const float *dev, const float *want, int n,
                          double tol)
{
    double e = nmse(dev, want, n);
    if (e > tol || e != e)
        return skv_errorf(SKV_E_DEVICE, "%s backend self-test: %s differs from the CPU reference (NMSE %.3g)",
                          be->name, what, e);
    return SKV_OK;
}

/* A weight matrix of `type` (f16 or q8_0), 32 rows of 64, as file bytes (q8_0: a block is an f16
 * scale and 32 int8). */
enum { ST_ROWS = 32, ST_COLS = 64 };
static size_t selftest_weight(int type, uint32_t seed, uint8_t *out)
{
    float w[ST_ROWS * ST_COLS];
    for (int i = 0; i < ST_ROWS * ST_COLS; i++) {
        seed = seed * 1664525u + 1013904223u;
        w[i] = (float)((seed >> 8) & 0xffff) / 65536.0f - 0.5f;
    }
    if (type == SKV_DTYPE_F16) {
        for (int i = 0; i < ST_ROWS * ST_COLS; i++) {
            uint16_t h = skv_f32_to_fp16(w[i]);
            memcpy(out + 2 * i, &h, 2);
        }
        return (size_t)ST_ROWS * ST_COLS * 2;
    }
    size_t at = 0;
    for (int b = 0; b < ST_ROWS * ST_COLS / 32; b++) {
        float amax = 0;
        for (int i = 0; i < 32; i++)
            amax = fmaxf(amax, fabsf(w[32 * b + i]));
        float d = amax / 127.0f;
        uint16_t h = skv_f32_to_fp16(d);
        memcpy(out + at, &h, 2);
        for (int i = 0; i < 32; i++)
            out[at + 2 + i] = (uint8_t)(int8_t)lrintf(d > 0 ? w[32 * b + i] / d : 0.0f);
        at += 34;
    }
    return at;
}

/* The weight ops a forward needs on `be`: matmul with f16 and q8_0 weights at n = 1 (the GEMV
 * kernels) and n = 16 (the GEMM path: cuBLAS on a device), get_rows of an f16 table, and RoPE
 * at far positions; each against the CPU backend. */
static int selftest_weights(struct skv_backend *be, struct skv_backend *cpu)
{
    static const int types[2] = {SKV_DTYPE_F16, SKV_DTYPE_Q8_0}, ns[2] = {1, 16};
    uint8_t bytes[ST_ROWS * ST_COLS * 2];
    float x[16 * ST_COLS], got[16 * ST_ROWS], want[16 * ST_ROWS];
    uint32_t s = 777;
    for (int i = 0; i < 16 * ST_COLS; i++) {
        s = s * 1664525u + 1013904223u;
        x[i] = (float)((s >> 8) & 0xffff) / 32768.0f - 1.0f;
    }
    void *dw = NULL, *dx = NULL, *dout = NULL;
    int rc = be->ops->alloc(be, sizeof bytes, &dw);
    rc = rc ? rc : be->ops->alloc(be, sizeof x, &dx);
    rc = rc ? rc : be->ops->alloc(be, sizeof got, &dout);
    rc = rc ? rc : be->ops->upload(be, dx, x, sizeof x);
    for (int t = 0; t < 2 && !rc; t++) {
        size_t nb = selftest_weight(types[t], 99u + (uint32_t)t, bytes);
        struct skv_tensor host = {.type = types[t], .ndim = 2, .ne = {ST_COLS, ST_ROWS, 1, 1}, .data = bytes,
                                  .nbytes = nb, .name = "self-test"};
        struct skv_tensor dev = host;
        dev.data = dw;
        rc = be->ops->upload(be, dw, bytes, nb);
        for (int k = 0; k < 2 && !rc; k++) {
            char what[48];
            snprintf(what, sizeof what, "matmul %s n=%d", t ? "q8_0" : "f16", ns[k]);
            rc = be->ops->matmul(be, dout, &dev, NULL, dx, ns[k]);
            rc = rc ? rc : be->ops->download(be, got, dout, (size_t)ns[k] * ST_ROWS * sizeof(float));
            rc = rc ? rc : cpu->ops->matmul(cpu, want, &host, NULL, x, ns[k]);
            rc = rc ? rc : selftest_close(be, what, got, want, ns[k] * ST_ROWS, 1e-3); /* the CPU's 8-bit x */
        }
        if (!rc && types[t] == SKV_DTYPE_F16) {
            static const int32_t ids[3] = {3, 0, 31};
            rc = be->ops->get_rows(be, dout, &dev, ids, 3);
            rc = rc ? rc : be->ops->download(be, got, dout, 3 * ST_COLS * sizeof(float));
            rc = rc ? rc : cpu->ops->get_rows(cpu, want, &host, ids, 3);
            rc = rc ? rc : selftest_close(be, "get_rows f16", got, want, 3 * ST_COLS, 1e-12);
        }
    }
    /* RoPE: 3 tokens of 2 heads of 32 (x's first 192 values), positions up to 30000 */
    static const int32_t pos[3] = {0, 7, 30000};
    struct skv_rope rope = {.mode = SKV_ROPE_NEOX, .rot_dim = 32, .theta = 500000.0f, .freq_scale = 1.0f};
    memcpy(want, x, 3 * 2 * 32 * sizeof(float));
    rc = rc ? rc : be->ops->rope(be, dx, 3, 2, 32, pos, &rope);
    rc = rc ? rc : be->ops->download(be, got, dx, 3 * 2 * 32 * sizeof(float));
    rc = rc ? rc : cpu->ops->rope(cpu, want, 3, 2, 32, pos, &rope);
    rc = rc ? rc : selftest_close(be, "rope", got, want, 3 * 2 * 32, 1e-10);
    void *bufs[] = {dw, dx, dout};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i])
            be->ops->free(be, bufs[i]);
    return rc;
}

/* Runs RMSNorm, a small GQA attention, a decode group's attention (attention_batch, where the
 * backend has it) and the weight ops (selftest_weights) on `be` and on a 1-thread CPU backend
 * and compares. */
int skv_backend_selftest(struct skv_backend *be)
{
    enum { N = 7, DIM = 64, H = 4, HKV = 2, D = 16, ROWS = N };
    float x[N * DIM], w[DIM], q[N * H * D], kv[2][HKV][ROWS * D], got[N * H * D], want[N * H * D];
    uint32_t s = 12345;
    float *all[] = {x, w, q, &kv[0][0][0]};
    int sizes[] = {N * DIM, DIM, N * H * D, 2 * HKV * ROWS * D};
    for (int a = 0; a < 4; a++)
        for (int i = 0; i < sizes[a]; i++) {
            s = s * 1664525u + 1013904223u;
            all[a][i] = (float)((s >> 8) & 0xffff) / 32768.0f - 1.0f;
        }
    struct skv_backend *cpu = NULL;
    int rc = skv_backend_cpu_new(1, &cpu);
    if (rc)
        return rc;
    void *dx = NULL, *dw = NULL, *dq = NULL, *dout = NULL, *dk[HKV] = {0}, *dv[HKV] = {0};
    size_t bx = sizeof x, bw = sizeof w, bq = sizeof q, bkv = sizeof kv[0][0];
    rc = be->ops->alloc(be, bx, &dx);
    rc = rc ? rc : be->ops->alloc(be, bw, &dw);
    rc = rc ? rc : be->ops->alloc(be, bq, &dq);
    rc = rc ? rc : be->ops->alloc(be, bq, &dout);
    for (int h = 0; h < HKV && !rc; h++) {
        rc = be->ops->alloc(be, bkv, &dk[h]);
        rc = rc ? rc : be->ops->alloc(be, bkv, &dv[h]);
        rc = rc ? rc : be->ops->upload(be, dk[h], kv[0][h], bkv);
        rc = rc ? rc : be->ops->upload(be, dv[h], kv[1][h], bkv);
    }
    rc = rc ? rc : be->ops->upload(be, dx, x, bx);
    rc = rc ? rc : be->ops->upload(be, dw, w, bw);
    rc = rc ? rc : be->ops->upload(be, dq, q, bq);
    /* rmsnorm */
    float norm_cpu[N * DIM], norm_dev[N * DIM];
    rc = rc ? rc : be->ops->rmsnorm(be, dx, dx, dw, N, DIM, 1e-5f);
    rc = rc ? rc : be->ops->download(be, norm_dev, dx, bx);
    rc = rc ? rc : cpu->ops->rmsnorm(cpu, norm_cpu, x, w, N, DIM, 1e-5f);
    /* attention: 3 cached rows then 4 new queries */
    struct skv_kv_view view = {.n_kv_heads = HKV, .head_dim = D, .kv_type = SKV_DTYPE_F32};
    struct skv_kv_view host = view;
    for (int h = 0; h < HKV; h++) {
        view.k[h] = dk[h];
        view.v[h] = dv[h];
        view.prefix_len[h] = host.prefix_len[h] = ROWS - 4;
        host.k[h] = kv[0][h];
        host.v[h] = kv[1][h];
    }
    rc = rc ? rc : be->ops->attention(be, dout, dq, 4, H, &view);
    rc = rc ? rc : be->ops->download(be, got, dout, (size_t)4 * H * D * sizeof(float));
    rc = rc ? rc : cpu->ops->attention(cpu, want, q, 4, H, &host);
    rc = rc ? rc : selftest_close(be, "rmsnorm", norm_dev, norm_cpu, N * DIM, 1e-8);
    rc = rc ? rc : selftest_close(be, "attention", got, want, 4 * H * D, 1e-8);
    if (!rc && be->ops->attention_batch) { /* a decode group of two: 6 rows, and 3 with K and V swapped */
        struct skv_kv_view views[2] = {view, view}, hosts[2] = {host, host};
        for (int h = 0; h < HKV; h++) {
            views[0].prefix_len[h] = hosts[0].prefix_len[h] = ROWS - 2;
            views[1].prefix_len[h] = hosts[1].prefix_len[h] = 2;
            views[1].k[h] = view.v[h];
            views[1].v[h] = view.k[h];
            hosts[1].k[h] = host.v[h];
            hosts[1].v[h] = host.k[h];
        }
        rc = be->ops->attention_batch(be, dout, dq, 2, H, views);
        rc = rc ? rc : be->ops->download(be, got, dout, (size_t)2 * H * D * sizeof(float));
        for (int i = 0; i < 2 && !rc; i++)
            rc = cpu->ops->attention(cpu, want + i * H * D, q + i * H * D, 1, H, &hosts[i]);
        rc = rc ? rc : selftest_close(be, "attention_batch", got, want, 2 * H * D, 1e-8);
    }
    rc = rc ? rc : selftest_weights(be, cpu);
    void *bufs[] = {dx, dw, dq, dout, dk[0], dk[1], dv[0], dv[1]};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i])
            be->ops->free(be, bufs[i]);
    skv_backend_destroy(&cpu);
    return rc;
}
