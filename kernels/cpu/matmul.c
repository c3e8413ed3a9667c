/* The CPU matmul op: out[n][rows] = x[n][cols] . W^T (+ bias), W kept in its file dtype.
 * Small batches (decode) multiply the quantized rows directly against 16-bit activations;
 * large batches (prefill) dequantize W a tile of rows at a time and call OpenBLAS sgemm. */
#include <limits.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include <cblas.h>

#include "common/status.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/quant.h"

/* Batches up to SKV_MM_GEMV_MAX_N take the integer GEMV path (quantized weights) and up to
 * SKV_MM_FLOAT_GEMV_MAX_N the float GEMV (F32/F16/BF16 weights, or dequantize-then-dot for
 * the types without an integer kernel); larger batches the tiled sgemm. Measured on the
 * target (AMD EPYC, AVX2, OpenBLAS 0.3.21 Zen kernels), one thread, ms per call, GEMV vs sgemm:
 *   q4_1 576->576    n=8 0.08 vs 0.20   n=16 0.17 vs 0.25   n=32 0.33 vs 0.36   n=64 0.66 vs 0.59
 *   q4_1 576->1536   n=16 0.43 vs 0.65  n=32 0.87 vs 0.96   n=64 1.77 vs 1.55   n=512 14.5 vs 10.4
 *   q4_1 1536->576   n=16 0.42 vs 0.64  n=32 0.84 vs 0.95   n=64 1.71 vs 1.56   n=512 14.0 vs 10.7
 *   f32 576->576     n=8 0.09 vs 0.13   n=16 0.22 vs 0.19
 *   f16 576->1536    n=8 0.22 vs 0.41   n=16 0.53 vs 0.57
 * so the integer path wins up to n = 32 and the float GEMV up to n = 8. Re-measured after the
 * switch from 8-bit to 16-bit activations (quant.c says why): the integer GEMV times moved by
 * under 4% (q4_1 576->1536 n=32 0.92 vs sgemm 0.94), so the limits stand. */
#ifndef SKV_MM_GEMV_MAX_N
#define SKV_MM_GEMV_MAX_N 32
#endif
#ifndef SKV_MM_FLOAT_GEMV_MAX_N
#define SKV_MM_FLOAT_GEMV_MAX_N 8
#endif
/* Output rows per parallel_for grain, and the f32 tile each worker dequantizes into. */
#define SKV_MM_ROW_GRAIN 16
/* Float-weight GEMV rows prefetched ahead of the one computed. */
#define SKV_MM_PF_ROWS 4
/* Most weights one matmul_multi takes. */
#define SKV_MM_MULTI_MAX 8
#define SKV_MM_ROW_BLOCK 64
#ifndef SKV_MM_TILE_BYTES
#define SKV_MM_TILE_BYTES (2048 * 1024)
#endif

struct mm_job {
    struct skv_backend *be;
    float *out;                   /* [n][rows] */
    const uint8_t *w;             /* rows x row_bytes */
    const float *bias;            /* [rows] or NULL */
    const float *x;               /* [n][cols] */
    const struct skv_q16_act *xa; /* [n], integer path only */
    skv_q16_gemv_fn qgemv;
    skv_f_dot_fn fdot;
    size_t row_bytes;
    int64_t rows, cols;
    int64_t tile_rows;
    int type;
    int n;
    atomic_int status;            /* first failure inside a worker */
};

static void mm_fail(struct mm_job *job, int status)
{
    int ok = SKV_OK;
    atomic_compare_exchange_strong(&job->status, &ok, status);
}

static void mm_store(const struct mm_job *job, int64_t r, int j0, int nc, const float *res)
{
    const float b = job->bias != NULL ? job->bias[r] : 0.0f;
    for (int j = 0; j < nc; j++)
        job->out[(int64_t)(j0 + j) * job->rows + r] = res[j] + b;
}

static void mm_add_bias(const struct mm_job *job, int64_t begin, int64_t end)
{
    if (job->bias == NULL)
        return;
    for (int j = 0; j < job->n; j++) {
        float *o = job->out + (int64_t)j * job->rows;
        for (int64_t r = begin; r < end; r++)
            o[r] += job->bias[r];
    }
}

/* Quantized weights against 16-bit activations, SKV_MM_ROW_BLOCK rows at a time so a block
 * stays in cache across the column groups. */
static void mm_gemv_q16_task(void *arg, int64_t begin, int64_t end, int thread_id)
{
    const struct mm_job *job = arg;
    const int64_t nb32 = job->cols / SKV_QK;
    (void)thread_id;
    /* one column group: the whole range in one call, so the kernel's prefetch runs ahead
     * across it instead of stopping at every block's end */
    const int64_t block = job->n <= SKV_DOT_MAX_NC ? end - begin : SKV_MM_ROW_BLOCK;
    for (int64_t r0 = begin; r0 < end; r0 += block) {
        const int64_t nr = end - r0 < block ? end - r0 : block;
        for (int j0 = 0; j0 < job->n; j0 += SKV_DOT_MAX_NC) {
            const int nc = job->n - j0 < SKV_DOT_MAX_NC ? job->n - j0 : SKV_DOT_MAX_NC;
            job->qgemv(job->w + (size_t)r0 * job->row_bytes, job->row_bytes, nr, job->xa + j0,
                       nb32, nc, job->out + (int64_t)j0 * job->rows + r0, job->rows);
        }
        mm_add_bias(job, r0, r0 + nr);
    }
}

/* Float weights (F32 / F16 / BF16) against float activations. */
static void mm_gemv_f_task(void *arg, int64_t begin, int64_t end, int thread_id)
{
    const struct mm_job *job = arg;
    float res[SKV_DOT_MAX_NC];
    (void)thread_id;
    for (int64_t r = begin; r < end; r++) {
        const uint8_t *wr = job->w + (size_t)r * job->row_bytes;
        if (r + SKV_MM_PF_ROWS < end) /* bf16 / f16 rows, one thread: 10.5 -> 11.6 GB/s */
            for (size_t o = 0; o < job->row_bytes; o += 64)
                __builtin_prefetch(wr + SKV_MM_PF_ROWS * job->row_bytes + o);
        for (int j0 = 0; j0 < job->n; j0 += SKV_DOT_MAX_NC) {
            const int nc = job->n - j0 < SKV_DOT_MAX_NC ? job->n - j0 : SKV_DOT_MAX_NC;
            job->fdot(wr, job->x + (int64_t)j0 * job->cols, job->cols, job->cols, nc, res);
            mm_store(job, r, j0, nc, res);
        }
    }
}

/* Types without an integer kernel: dequantize each row, then a float dot. */
static void mm_gemv_deq_task(void *arg, int64_t begin, int64_t end, int thread_id)
{
    struct mm_job *job = arg;
    const skv_f_dot_fn dot = skv_f_dot_for(SKV_DTYPE_F32);
    float res[SKV_DOT_MAX_NC];
    float *row = skv_cpu_scratch(job->be, thread_id, (size_t)job->cols * sizeof(float));
    if (row == NULL) {
        mm_fail(job, SKV_E_NOMEM);
        return;
    }
    for (int64_t r = begin; r < end; r++) {
        skv_dequantize_row(job->type, job->w + (size_t)r * job->row_bytes, row, job->cols);
        for (int j0 = 0; j0 < job->n; j0 += SKV_DOT_MAX_NC) {
            const int nc = job->n - j0 < SKV_DOT_MAX_NC ? job->n - j0 : SKV_DOT_MAX_NC;
            dot(row, job->x + (int64_t)j0 * job->cols, job->cols, job->cols, nc, res);
            mm_store(job, r, j0, nc, res);
        }
    }
}

/* Large batches: out[:, r0:r0+tr] = x . tile^T with the tile dequantized to f32. */
static void mm_gemm_task(void *arg, int64_t begin, int64_t end, int thread_id)
{
    struct mm_job *job = arg;
    const int64_t cols = job->cols;
    float *tile = NULL;
    if (job->type != SKV_DTYPE_F32) {
        tile = skv_cpu_scratch(job->be, thread_id, (size_t)job->tile_rows * cols * sizeof(float));
        if (tile == NULL) {
            mm_fail(job, SKV_E_NOMEM);
            return;
        }
    }
    for (int64_t r0 = begin; r0 < end; r0 += job->tile_rows) {
        const int64_t tr = end - r0 < job->tile_rows ? end - r0 : job->tile_rows;
        const float *wt;
        if (tile == NULL) {
            wt = (const float *)(job->w + (size_t)r0 * job->row_bytes);
        } else {
            for (int64_t r = 0; r < tr; r++)
                skv_dequantize_row(job->type, job->w + (size_t)(r0 + r) * job->row_bytes,
                                   tile + r * cols, cols);
            wt = tile;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, job->n, (int)tr, (int)cols, 1.0f,
                    job->x, (int)cols, wt, (int)cols, 0.0f, job->out + r0, (int)job->rows);
        mm_add_bias(job, r0, r0 + tr);
    }
}

/* Quantizes the n activation rows for the integer path. The buffer is the calling thread's
 * scratch slot 0; the integer-path workers use no scratch, so nothing overwrites it. */
static int mm_quantize_x(struct skv_backend *be, const float *x, int n, int64_t cols,
                         struct skv_q16_act *xa)
{
    const size_t row = skv_q16_act_bytes(cols);
    uint8_t *buf = skv_cpu_scratch(be, 0, (size_t)n * row + 64);
    if (buf == NULL)
        return skv_errorf(SKV_E_NOMEM, "matmul: no scratch for %d activation rows", n);
    buf += (64 - (uintptr_t)buf % 64) % 64;
    for (int j = 0; j < n; j++)
        skv_q16_act_quantize(x + (int64_t)j * cols, cols, buf + (size_t)j * row, &xa[j]);
    return SKV_OK;
}

/* Checks w against the op's rules and fills the job's weight fields. */
static int mm_check_weight(const struct skv_tensor *w, struct mm_job *job)
{
    const char *name = w->name != NULL ? w->name : "?";
    if (w->ndim < 1 || w->ndim > 4)
        return skv_errorf(SKV_E_INVAL, "matmul: weight %s has %d dimensions", name, w->ndim);
    /* Dimensions past the first all count as rows. */
    const int64_t cols = w->ne[0];
    int64_t rows = 1;
    for (int d = 1; d < w->ndim && rows <= INT_MAX; d++)
        rows = w->ne[d] > 0 && w->ne[d] <= INT_MAX ? rows * w->ne[d] : 0;
    if (cols <= 0 || rows <= 0 || cols > INT_MAX || rows > INT_MAX)
        return skv_errorf(SKV_E_INVAL, "matmul: weight %s has a bad shape", name);
    if (!skv_quant_supported(w->type))
        return skv_errorf(SKV_E_UNSUPPORTED, "matmul: weight %s has unsupported type %d", name,
                          w->type);
    const size_t row_bytes = skv_dtype_row_bytes(w->type, cols);
    if (row_bytes == 0)
        return skv_errorf(SKV_E_INVAL, "matmul: weight %s: %lld columns do not fill blocks",
                          name, (long long)cols);
    if (w->data == NULL || w->nbytes < (size_t)rows * row_bytes)
        return skv_errorf(SKV_E_INVAL, "matmul: weight %s holds %zu bytes, needs %zu", name,
                          w->nbytes, (size_t)rows * row_bytes);
    job->w = w->data;
    job->row_bytes = row_bytes;
    job->rows = rows;
    job->cols = cols;
    job->type = w->type;
    job->qgemv = skv_q16_gemv_for(w->type);
    job->fdot = skv_f_dot_for(w->type);
    return SKV_OK;
}

int skv_cpu_matmul_rows_as_one(struct skv_backend *be, const struct skv_tensor *w)
{
    (void)be;
    /* the GEMV kernels compute each row on its own; past these sizes a GEMM takes over */
    return skv_q16_gemv_for(w->type) != NULL ? SKV_MM_GEMV_MAX_N : SKV_MM_FLOAT_GEMV_MAX_N;
}

int skv_cpu_matmul(struct skv_backend *be, float *out, const struct skv_tensor *w,
                   const float *bias, const float *x, int n)
{
    if (be == NULL || out == NULL || w == NULL || x == NULL || n < 0)
        return skv_errorf(SKV_E_INVAL, "matmul: bad arguments");
    struct mm_job job = {.be = be, .out = out, .bias = bias, .x = x, .n = n};
    int rc = mm_check_weight(w, &job);
    if (rc < 0)
        return rc;
    if (n == 0)
        return SKV_OK;
    atomic_init(&job.status, SKV_OK);
    struct skv_q16_act xa_small[SKV_MM_GEMV_MAX_N];
    skv_cpu_task_fn task;
    if (job.qgemv != NULL && n <= SKV_MM_GEMV_MAX_N) {
        rc = mm_quantize_x(be, x, n, job.cols, xa_small);
        if (rc < 0)
            return rc;
        job.xa = xa_small;
        task = mm_gemv_q16_task;
    } else if (job.fdot != NULL && n <= SKV_MM_FLOAT_GEMV_MAX_N) {
        task = mm_gemv_f_task;
    } else if (job.qgemv == NULL && job.fdot == NULL && n <= SKV_MM_FLOAT_GEMV_MAX_N) {
        task = mm_gemv_deq_task;
    } else {
        int64_t tr = SKV_MM_TILE_BYTES / (job.cols * (int64_t)sizeof(float));
        tr = tr < SKV_MM_ROW_GRAIN ? SKV_MM_ROW_GRAIN : tr - tr % SKV_MM_ROW_GRAIN;
        job.tile_rows = tr;
        task = mm_gemm_task;
    }
    skv_cpu_parallel_for(be, job.rows, SKV_MM_ROW_GRAIN, task, &job);
    rc = atomic_load(&job.status);
    if (rc < 0)
        return skv_errorf(rc, "matmul: weight %s: out of scratch memory",
                          w->name != NULL ? w->name : "?");
    return SKV_OK;
}

/* The rows of several integer-path jobs laid end to end: [start[i], start[i + 1]) are
 * job i's rows. */
struct mm_multi {
    struct mm_job *jobs;
    int64_t start[SKV_MM_MULTI_MAX + 1];
    int count;
};

static void mm_multi_task(void *arg, int64_t begin, int64_t end, int thread_id)
{
    struct mm_multi *mm = arg;
    for (int i = 0; i < mm->count && begin < end; i++) {
        const int64_t lo = mm->start[i], hi = mm->start[i + 1];
        if (begin >= hi)
            continue;
        const int64_t e = end < hi ? end : hi;
        mm_gemv_q16_task(&mm->jobs[i], begin - lo, e - lo, thread_id);
        begin = e;
    }
}

int skv_cpu_matmul_multi(struct skv_backend *be, const struct skv_matmul_part *parts, int count,
                         const float *x, int n)
{
    if (be == NULL || parts == NULL || count < 1 || x == NULL || n < 0)
        return skv_errorf(SKV_E_INVAL, "matmul_multi: bad arguments");
    if (count > SKV_MM_MULTI_MAX)
        return skv_errorf(SKV_E_INVAL, "matmul_multi: %d weights, at most %d", count,
                          SKV_MM_MULTI_MAX);
    struct mm_job jobs[SKV_MM_MULTI_MAX];
    struct mm_multi mm = {.jobs = jobs, .count = count};
    bool fused = n <= SKV_MM_GEMV_MAX_N;
    for (int i = 0; i < count; i++) {
        if (parts[i].out == NULL || parts[i].w == NULL)
            return skv_errorf(SKV_E_INVAL, "matmul_multi: weight %d: bad arguments", i);
        jobs[i] = (struct mm_job){.be = be, .out = parts[i].out, .bias = parts[i].bias, .x = x, .n = n};
        int rc = mm_check_weight(parts[i].w, &jobs[i]);
        if (rc < 0)
            return rc;
        if (jobs[i].cols != jobs[0].cols)
            return skv_errorf(SKV_E_INVAL, "matmul_multi: weight %d has %lld columns, weight 0 %lld",
                              i, (long long)jobs[i].cols, (long long)jobs[0].cols);
        fused = fused && jobs[i].qgemv != NULL;
        mm.start[i + 1] = mm.start[i] + jobs[i].rows;
    }
    if (n == 0)
        return SKV_OK;
    if (!fused) {
        for (int i = 0; i < count; i++) {
            int rc = skv_cpu_matmul(be, parts[i].out, parts[i].w, parts[i].bias, x, n);
            if (rc < 0)
                return rc;
        }
        return SKV_OK;
    }
    struct skv_q16_act xa[SKV_MM_GEMV_MAX_N];
    int rc = mm_quantize_x(be, x, n, jobs[0].cols, xa);
    if (rc < 0)
        return rc;
    for (int i = 0; i < count; i++) {
        jobs[i].xa = xa;
        atomic_init(&jobs[i].status, SKV_OK);
    }
    skv_cpu_parallel_for(be, mm.start[count], SKV_MM_ROW_GRAIN, mm_multi_task, &mm);
    return SKV_OK;
}
