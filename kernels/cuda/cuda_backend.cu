/* The CUDA backend: device probing, device memory and copies on one stream, and the whole op
 * table (get_rows, matmul via GEMV kernels or cuBLAS, rmsnorm, rope, swiglu, add, attention,
 * the compression scores and row gathers). kernels/cpu is the reference these ops mirror. */
#include "kernels/cuda/common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

extern "C" {
#include "kernels/backend.h"
}

#include <climits>
#include <cmath>
#include <stdint.h>
#include <stdlib.h>

/* Largest rot_dim, as on the CPU. */
#define ROPE_MAX_DIM 1024
/* Up to this many activation rows the matmul runs a dequantizing GEMV kernel. */
#define MM_GEMV_MAX_N 8
#define MM_GEMV_WARPS 8
/* Bytes of f32 weight tile a quantized GEMM dequantizes at a time. */
#define MM_TILE_BYTES ((size_t)64 << 20)
#define ATT_THREADS 128
#define ATT_TILE 64
#define EW_THREADS 256
#define SCRATCH_ROUND ((size_t)1 << 20)

struct cuda_impl {
    int device;
    cudaStream_t stream;
    cublasHandle_t blas;
    void *scratch;          /* device scratch, grown on demand; ops use it in stream order */
    size_t scratch_bytes;
};

/* ---- memory, copies ----------------------------------------------------------------- */

static int cuda_alloc(struct skv_backend *be, size_t bytes, void **out)
{
    (void)be;
    if (!out)
        return skv_errorf(SKV_E_INVAL, "alloc: NULL output");
    void *p = NULL;
    SKV_CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 1));
    *out = p;
    return SKV_OK;
}

static void cuda_free(struct skv_backend *be, void *ptr)
{
    (void)be;
    if (ptr)
        cudaFree(ptr);
}

static int cuda_upload(struct skv_backend *be, void *dst, const void *src, size_t bytes)
{
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    SKV_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, impl->stream));
    return SKV_OK;
}

static int cuda_download(struct skv_backend *be, void *dst, const void *src, size_t bytes)
{
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    SKV_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, impl->stream));
    SKV_CUDA_CHECK(cudaStreamSynchronize(impl->stream));
    return SKV_OK;
}

static int cuda_copy_2d(struct skv_backend *be, void *dst, size_t dst_stride, const void *src,
                        size_t src_stride, size_t row_bytes, int64_t n_rows)
{
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    if (n_rows < 0)
        return skv_errorf(SKV_E_INVAL, "copy_2d: %lld rows", (long long)n_rows);
    if (n_rows == 0 || row_bytes == 0)
        return SKV_OK;
    SKV_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_stride, src, src_stride, row_bytes, (size_t)n_rows,
                                     cudaMemcpyDeviceToDevice, impl->stream));
    return SKV_OK;
}

static int cuda_sync(struct skv_backend *be)
{
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    SKV_CUDA_CHECK(cudaStreamSynchronize(impl->stream));
    return SKV_OK;
}

/* A device scratch buffer of at least `bytes`. Growing waits for queued work that may still
 * read the old buffer. */
static int scratch_get(struct cuda_impl *impl, size_t bytes, void **out)
{
    if (bytes > impl->scratch_bytes) {
        size_t want = (bytes + SCRATCH_ROUND - 1) / SCRATCH_ROUND * SCRATCH_ROUND;
        SKV_CUDA_CHECK(cudaStreamSynchronize(impl->stream));
        if (impl->scratch)
            SKV_CUDA_CHECK(cudaFree(impl->scratch));
        impl->scratch = NULL;
        impl->scratch_bytes = 0;
        SKV_CUDA_CHECK(cudaMalloc(&impl->scratch, want));
        impl->scratch_bytes = want;
    }
    *out = impl->scratch;
    return SKV_OK;
}

static size_t align_up(size_t v)
{
    return (v + 255) / 256 * 256;
}

/* True when p is device (or managed) memory; pageable host memory answers false. Ops whose
 * small index arguments may come from either side (rope positions, get_rows ids) use it. */
static bool is_device_ptr(const void *p)
{
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

static unsigned grid_for(int64_t count, int threads)
{
    int64_t b = (count + threads - 1) / threads;
    return (unsigned)(b < 65536 ? (b > 0 ? b : 1) : 65536);
}

/* ---- device helpers ----------------------------------------------------------------- */

__device__ __forceinline__ float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, o));
    return v;
}

/* Sum over the block (blockDim a multiple of 32, at most 1024); every thread gets it. */
__device__ double block_sum_d(double v, double *red)
{
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        double s = lane < nw ? red[lane] : 0.0;
        s = warp_sum_d(s);
        if (lane == 0)
            red[32] = s;
    }
    __syncthreads();
    return red[32];
}

__device__ __forceinline__ float half_bits(const uint8_t *p)
{
    return __half2float(__ushort_as_half(*(const unsigned short *)p));
}

/* Element e of a row of TYPE (blocks of 32 for the quantized types; the 2-byte scales keep
 * every block 2-byte aligned). */
template <int TYPE>
__device__ __forceinline__ float deq_elem(const uint8_t *row, int64_t e)
{
    if constexpr (TYPE == SKV_DTYPE_F32) {
        return ((const float *)row)[e];
    } else if constexpr (TYPE == SKV_DTYPE_F16) {
        return half_bits(row + 2 * e);
    } else if constexpr (TYPE == SKV_DTYPE_BF16) {
        return __uint_as_float((uint32_t)((const unsigned short *)row)[e] << 16);
    } else if constexpr (TYPE == SKV_DTYPE_Q8_0) {
        const uint8_t *b = row + (e / 32) * 34;
        return half_bits(b) * (float)(int8_t)b[2 + e % 32];
    } else if constexpr (TYPE == SKV_DTYPE_Q4_0) {
        const uint8_t *b = row + (e / 32) * 18;
        const int k = (int)(e % 32);
        const int q = k < 16 ? (b[2 + k] & 0x0f) : (b[2 + k - 16] >> 4);
        return half_bits(b) * (float)(q - 8);
    } else { /* Q4_1 */
        const uint8_t *b = row + (e / 32) * 20;
        const int k = (int)(e % 32);
        const int q = k < 16 ? (b[4 + k] & 0x0f) : (b[4 + k - 16] >> 4);
        return half_bits(b) * (float)q + half_bits(b + 2);
    }
}

static bool cuda_type_supported(int type)
{
    return type == SKV_DTYPE_F32 || type == SKV_DTYPE_F16 || type == SKV_DTYPE_BF16 ||
           type == SKV_DTYPE_Q8_0 || type == SKV_DTYPE_Q4_0 || type == SKV_DTYPE_Q4_1;
}

/* Calls LAUNCH(T) with T the compile-time type of the runtime `type`. */
#define DISPATCH_TYPE(type, LAUNCH)                                                               \
    switch (type) {                                                                               \
    case SKV_DTYPE_F32: LAUNCH(SKV_DTYPE_F32); break;                                             \
    case SKV_DTYPE_F16: LAUNCH(SKV_DTYPE_F16); break;                                             \
    case SKV_DTYPE_BF16: LAUNCH(SKV_DTYPE_BF16); break;                                           \
    case SKV_DTYPE_Q8_0: LAUNCH(SKV_DTYPE_Q8_0); break;                                           \
    case SKV_DTYPE_Q4_0: LAUNCH(SKV_DTYPE_Q4_0); break;                                           \
    default: LAUNCH(SKV_DTYPE_Q4_1); break;                                                       \
    }

/* ---- get_rows ----------------------------------------------------------------------- */

template <int TYPE>
__global__ void get_rows_kernel(float *out, const uint8_t *table, size_t row_bytes, int64_t cols,
                                int64_t rows, const int32_t *ids, int n)
{
    const int64_t total = (int64_t)n * cols;
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < total;
         k += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = k / cols, e = k % cols;
        const int32_t id = ids[i];
        out[k] = id >= 0 && id < rows ? deq_elem<TYPE>(table + (size_t)id * row_bytes, e) : NAN;
    }
}

/* Shape checks shared by get_rows and matmul; *rows_out / *row_bytes_out on success. */
static int table_check(const char *op, const struct skv_tensor *t, int64_t limit,
                       int64_t *rows_out, size_t *row_bytes_out)
{
    const char *name = t->name != NULL ? t->name : "?";
    if (t->ndim < 1 || t->ndim > 4)
        return skv_errorf(SKV_E_INVAL, "%s: tensor %s has %d dimensions", op, name, t->ndim);
    const int64_t cols = t->ne[0];
    int64_t rows = 1;
    for (int d = 1; d < t->ndim && rows <= limit; d++)
        rows = t->ne[d] > 0 && t->ne[d] <= limit ? rows * t->ne[d] : 0;
    if (cols <= 0 || rows <= 0 || rows > limit || cols > INT_MAX)
        return skv_errorf(SKV_E_INVAL, "%s: tensor %s has a bad shape", op, name);
    if (!cuda_type_supported(t->type))
        return skv_errorf(SKV_E_UNSUPPORTED,
                          "%s: tensor %s has type %s (%d), which the CUDA backend does not "
                          "support (f32, f16, bf16, q8_0, q4_0, q4_1)",
                          op, name, skv_dtype_name(t->type) ? skv_dtype_name(t->type) : "?",
                          t->type);
    const size_t row_bytes = skv_dtype_row_bytes(t->type, cols);
    if (row_bytes == 0)
        return skv_errorf(SKV_E_INVAL, "%s: tensor %s: %lld columns do not fill blocks", op, name,
                          (long long)cols);
    if (t->data == NULL || t->nbytes < (size_t)rows * row_bytes)
        return skv_errorf(SKV_E_INVAL, "%s: tensor %s holds %zu bytes, needs %zu", op, name,
                          t->nbytes, (size_t)rows * row_bytes);
    *rows_out = rows;
    *row_bytes_out = row_bytes;
    return SKV_OK;
}

static int cuda_get_rows(struct skv_backend *be, float *out, const struct skv_tensor *table,
                         const int32_t *ids, int n)
{
    if (be == NULL || table == NULL || n < 0 || (n > 0 && (out == NULL || ids == NULL)))
        return skv_errorf(SKV_E_INVAL, "get_rows: bad arguments");
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    int64_t rows = 0;
    size_t row_bytes = 0;
    int rc = table_check("get_rows", table, INT32_MAX, &rows, &row_bytes);
    if (rc < 0)
        return rc;
    if (n == 0)
        return SKV_OK;
    const int32_t *dids = ids;
    if (!is_device_ptr(ids)) {
        /* host ids: check them, then stage them on the device */
        for (int i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= rows)
                return skv_errorf(SKV_E_INVAL, "get_rows: id %d out of range [0, %lld) of %s",
                                  (int)ids[i], (long long)rows, table->name ? table->name : "?");
        void *s = NULL;
        if ((rc = scratch_get(impl, (size_t)n * sizeof(int32_t), &s)) < 0)
            return rc;
        SKV_CUDA_CHECK(cudaMemcpyAsync(s, ids, (size_t)n * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, impl->stream));
        dids = (const int32_t *)s;
    }
    const int64_t cols = table->ne[0];
    const unsigned grid = grid_for((int64_t)n * cols, EW_THREADS);
#define GR_LAUNCH(T)                                                                              \
    get_rows_kernel<T><<<grid, EW_THREADS, 0, impl->stream>>>(                                    \
        out, (const uint8_t *)table->data, row_bytes, cols, rows, dids, n)
    DISPATCH_TYPE(table->type, GR_LAUNCH)
#undef GR_LAUNCH
    SKV_CUDA_CHECK(cudaGetLastError());
    return SKV_OK;
}

/* ---- matmul ------------------------------------------------------------------------- */

/* One warp per weight row, lanes over the columns; n <= MM_GEMV_MAX_N activation rows. */
template <int TYPE>
__global__ void gemv_kernel(float *out, const uint8_t *w, size_t row_bytes, const float *bias,
                            const float *x, int rows, int cols, int n)
{
    const int lane = threadIdx.x % 32;
    const int r = blockIdx.x * MM_GEMV_WARPS + threadIdx.x / 32;
    if (r >= rows)
        return;
    const uint8_t *wr = w + (size_t)r * row_bytes;
    float acc[MM_GEMV_MAX_N];
#pragma unroll
    for (int j = 0; j < MM_GEMV_MAX_N; j++)
        acc[j] = 0.0f;
    for (int e = lane; e < cols; e += 32) {
        const float wv = deq_elem<TYPE>(wr, e);
#pragma unroll
        for (int j = 0; j < MM_GEMV_MAX_N; j++)
            if (j < n)
                acc[j] = fmaf(wv, x[(size_t)j * cols + e], acc[j]);
    }
    const float b = bias ? bias[r] : 0.0f;
#pragma unroll
    for (int j = 0; j < MM_GEMV_MAX_N; j++) {
        if (j < n) {
            const float s = warp_sum(acc[j]);
            if (lane == 0)
                out[(size_t)j * rows + r] = s + b;
        }
    }
}

template <int TYPE>
__global__ void dequant_tile_kernel(float *dst, const uint8_t *w, size_t row_bytes, int64_t rows,
                                    int64_t cols)
{
    const int64_t total = rows * cols;
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < total;
         k += (int64_t)gridDim.x * blockDim.x)
        dst[k] = deq_elem<TYPE>(w + (size_t)(k / cols) * row_bytes, k % cols);
}

__global__ void to_f16_kernel(__half *dst, const float *src, int64_t count)
{
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < count;
         k += (int64_t)gridDim.x * blockDim.x)
        dst[k] = __float2half_rn(src[k]);
}

__global__ void to_bf16_kernel(__nv_bfloat16 *dst, const float *src, int64_t count)
{
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < count;
         k += (int64_t)gridDim.x * blockDim.x)
        dst[k] = __float2bfloat16_rn(src[k]);
}

__global__ void add_bias_kernel(float *out, const float *bias, int rows, int64_t count)
{
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < count;
         k += (int64_t)gridDim.x * blockDim.x)
        out[k] += bias[k % rows];
}

static int cuda_matmul(struct skv_backend *be, float *out, const struct skv_tensor *w,
                       const float *bias, const float *x, int n)
{
    if (be == NULL || out == NULL || w == NULL || x == NULL || n < 0)
        return skv_errorf(SKV_E_INVAL, "matmul: bad arguments");
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    int64_t rows64 = 0;
    size_t row_bytes = 0;
    int rc = table_check("matmul", w, INT_MAX, &rows64, &row_bytes);
    if (rc < 0)
        return rc;
    if (n == 0)
        return SKV_OK;
    const int rows = (int)rows64, cols = (int)w->ne[0];
    const uint8_t *wd = (const uint8_t *)w->data;
    const float one = 1.0f, zero = 0.0f;

    if (n <= MM_GEMV_MAX_N) {
        const unsigned grid = (unsigned)((rows + MM_GEMV_WARPS - 1) / MM_GEMV_WARPS);
#define MV_LAUNCH(T)                                                                              \
    gemv_kernel<T><<<grid, MM_GEMV_WARPS * 32, 0, impl->stream>>>(out, wd, row_bytes, bias, x,     \
                                                                  rows, cols, n)
        DISPATCH_TYPE(w->type, MV_LAUNCH)
#undef MV_LAUNCH
        SKV_CUDA_CHECK(cudaGetLastError());
        return SKV_OK;
    }

    /* Column-major view: W is cols x rows (ld cols), x is cols x n, out is rows x n. */
    if (w->type == SKV_DTYPE_F32) {
        SKV_CUBLAS_CHECK(cublasSgemm(impl->blas, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, &one,
                                     (const float *)wd, cols, x, cols, &zero, out, rows));
    } else if (w->type == SKV_DTYPE_F16 || w->type == SKV_DTYPE_BF16) {
        const bool f16 = w->type == SKV_DTYPE_F16;
        const int64_t count = (int64_t)n * cols;
        void *xs = NULL;
        if ((rc = scratch_get(impl, (size_t)count * 2, &xs)) < 0)
            return rc;
        if (f16)
            to_f16_kernel<<<grid_for(count, EW_THREADS), EW_THREADS, 0, impl->stream>>>(
                (__half *)xs, x, count);
        else
            to_bf16_kernel<<<grid_for(count, EW_THREADS), EW_THREADS, 0, impl->stream>>>(
                (__nv_bfloat16 *)xs, x, count);
        SKV_CUDA_CHECK(cudaGetLastError());
        const cudaDataType_t dt = f16 ? CUDA_R_16F : CUDA_R_16BF;
        SKV_CUBLAS_CHECK(cublasGemmEx(impl->blas, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, &one,
                                      wd, dt, cols, xs, dt, cols, &zero, out, CUDA_R_32F, rows,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    } else {
        /* quantized: dequantize row tiles to f32, one Sgemm per tile */
        int64_t tr = (int64_t)(MM_TILE_BYTES / ((size_t)cols * sizeof(float)));
        tr = tr < 1 ? 1 : tr > rows ? rows : tr;
        void *tile = NULL;
        if ((rc = scratch_get(impl, (size_t)tr * cols * sizeof(float), &tile)) < 0)
            return rc;
        for (int64_t r0 = 0; r0 < rows; r0 += tr) {
            const int64_t m = rows - r0 < tr ? rows - r0 : tr;
            const unsigned grid = grid_for(m * cols, EW_THREADS);
            const uint8_t *src = wd + (size_t)r0 * row_bytes;
#define DQ_LAUNCH(T)                                                                              \
    dequant_tile_kernel<T><<<grid, EW_THREADS, 0, impl->stream>>>((float *)tile, src, row_bytes, m, \
                                                                  (int64_t)cols)
            DISPATCH_TYPE(w->type, DQ_LAUNCH)
#undef DQ_LAUNCH
            SKV_CUDA_CHECK(cudaGetLastError());
            SKV_CUBLAS_CHECK(cublasSgemm(impl->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)m, n, cols,
                                         &one, (const float *)tile, cols, x, cols, &zero,
                                         out + r0, rows));
        }
    }
    if (bias) {
        const int64_t count = (int64_t)n * rows;
        add_bias_kernel<<<grid_for(count, EW_THREADS), EW_THREADS, 0, impl->stream>>>(
            out, bias, rows, count);
        SKV_CUDA_CHECK(cudaGetLastError());
    }
    return SKV_OK;
}

/* The weights one after the other: each is a launch of its own on the stream. */
static int cuda_matmul_multi(struct skv_backend *be, const struct skv_matmul_part *parts,
                             int count, const float *x, int n)
{
    if (be == NULL || parts == NULL || count < 1 || x == NULL || n < 0)
        return skv_errorf(SKV_E_INVAL, "matmul_multi: bad arguments");
    for (int i = 0; i < count; i++) {
        if (parts[i].w == NULL || parts[i].w->ne[0] != parts[0].w->ne[0])
            return skv_errorf(SKV_E_INVAL, "matmul_multi: weight %d does not match weight 0", i);
        int rc = cuda_matmul(be, parts[i].out, parts[i].w, parts[i].bias, x, n);
        if (rc < 0)
            return rc;
    }
    return SKV_OK;
}

/* ---- rmsnorm, rope, swiglu, add ----------------------------------------------------- */

__global__ void rmsnorm_kernel(float *out, const float *x, const float *w, int dim, float eps)
{
    __shared__ double red[33];
    const float *xr = x + (size_t)blockIdx.x * dim;
    float *o = out + (size_t)blockIdx.x * dim;
    double ss = 0.0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        ss += (double)xr[i] * xr[i];
    ss = block_sum_d(ss, red);
    const float s = (float)(1.0 / sqrt(ss / dim + (double)eps));
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        o[i] = xr[i] * s * w[i];
}

static int cuda_rmsnorm(struct skv_backend *be, float *out, const float *x, const float *w, int n,
                        int dim, float eps)
{
    if (n < 0 || dim <= 0 || !(eps >= 0.0f))
        return skv_errorf(SKV_E_INVAL, "rmsnorm: bad shape n=%d dim=%d eps=%g", n, dim,
                          (double)eps);
    if (n == 0)
        return SKV_OK;
    if (!out || !x || !w)
        return skv_errorf(SKV_E_INVAL, "rmsnorm: NULL buffer");
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    rmsnorm_kernel<<<(unsigned)n, EW_THREADS, 0, impl->stream>>>(out, x, w, dim, eps);
    SKV_CUDA_CHECK(cudaGetLastError());
    return SKV_OK;
}

/* One thread per (token, rotated pair): the angle and its cos / sin in double, the rotation
 * in float for every head, as the CPU does. */
__global__ void rope_kernel(float *x, const int32_t *pos, const double *inv_freq, int n,
                            int n_heads, int head_dim, int half, int neox, double freq_scale)
{
    const int64_t total = (int64_t)n * half;
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < total;
         k += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = k / half;
        const int j = (int)(k % half);
        const double ang = (double)pos[t] * freq_scale * inv_freq[j];
        double sd, cd;
        sincos(ang, &sd, &cd);
        const float c = (float)cd, s = (float)sd;
        const int i0 = neox ? j : 2 * j, i1 = neox ? j + half : 2 * j + 1;
        for (int h = 0; h < n_heads; h++) {
            float *xh = x + (t * n_heads + h) * (int64_t)head_dim;
            const float v0 = xh[i0], v1 = xh[i1];
            xh[i0] = v0 * c - v1 * s;
            xh[i1] = v0 * s + v1 * c;
        }
    }
}


static int rope_check(const struct skv_rope *r, int head_dim)
{
    if (r->mode != SKV_ROPE_NORM && r->mode != SKV_ROPE_NEOX)
        return skv_errorf(SKV_E_INVAL, "rope: unknown mode %d", r->mode);
    if (r->rot_dim <= 0 || r->rot_dim % 2 != 0 || r->rot_dim > head_dim ||
        r->rot_dim > ROPE_MAX_DIM)
        return skv_errorf(SKV_E_INVAL, "rope: rot_dim %d with head_dim %d", r->rot_dim,
                          head_dim);
    if (!(r->theta > 0.0f) || !std::isfinite(r->theta) || !(r->freq_scale > 0.0f) ||
        !std::isfinite(r->freq_scale))
        return skv_errorf(SKV_E_INVAL, "rope: theta %g freq_scale %g", (double)r->theta,
                          (double)r->freq_scale);
    if (r->l3_factor != 0.0f &&
        (!(r->l3_factor > 0.0f) || !(r->l3_low_freq_factor > 0.0f) ||
         !(r->l3_high_freq_factor > r->l3_low_freq_factor) || r->l3_original_ctx <= 0))
        return skv_errorf(SKV_E_INVAL,
                          "rope: llama3 scaling factor %g low %g high %g original ctx %d",
                          (double)r->l3_factor, (double)r->l3_low_freq_factor,
                          (double)r->l3_high_freq_factor, r->l3_original_ctx);
    if (!skv_rope_factors_valid(r, r->rot_dim / 2))
        return skv_errorf(SKV_E_INVAL, "rope: a frequency factor is not a finite value > 0");
    return SKV_OK;
}

static int cuda_rope(struct skv_backend *be, float *x, int n, int n_heads, int head_dim,
                     const int32_t *pos, const struct skv_rope *rope)
{
    if (n < 0 || n_heads <= 0 || head_dim <= 0 || !rope)
        return skv_errorf(SKV_E_INVAL, "rope: bad shape n=%d heads=%d head_dim=%d", n, n_heads,
                          head_dim);
    int rc = rope_check(rope, head_dim);
    if (rc < 0)
        return rc;
    if (n == 0)
        return SKV_OK;
    if (!x || !pos)
        return skv_errorf(SKV_E_INVAL, "rope: NULL buffer");
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    const int half = rope->rot_dim / 2;
    double inv_freq[ROPE_MAX_DIM / 2];
    skv_rope_inv_freq(rope, half, inv_freq);

    const bool pos_dev = is_device_ptr(pos);
    const size_t freq_bytes = align_up((size_t)half * sizeof(double));
    void *s = NULL;
    if ((rc = scratch_get(impl, freq_bytes + (pos_dev ? 0 : (size_t)n * sizeof(int32_t)), &s)) < 0)
        return rc;
    /* pageable host sources: the copy has staged them when cudaMemcpyAsync returns */
    SKV_CUDA_CHECK(cudaMemcpyAsync(s, inv_freq, (size_t)half * sizeof(double),
                                   cudaMemcpyHostToDevice, impl->stream));
    const int32_t *dpos = pos;
    if (!pos_dev) {
        int32_t *p = (int32_t *)((char *)s + freq_bytes);
        SKV_CUDA_CHECK(cudaMemcpyAsync(p, pos, (size_t)n * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, impl->stream));
        dpos = p;
    }
    rope_kernel<<<grid_for((int64_t)n * half, EW_THREADS), EW_THREADS, 0, impl->stream>>>(
        x, dpos, (const double *)s, n, n_heads, head_dim, half, rope->mode == SKV_ROPE_NEOX,
        (double)rope->freq_scale);
    SKV_CUDA_CHECK(cudaGetLastError());
    return SKV_OK;
}

__global__ void swiglu_kernel(float *out, const float *gate, const float *up, int64_t count)
{
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < count;
         k += (int64_t)gridDim.x * blockDim.x) {
        const float g = gate[k];
        out[k] = g / (1.0f + expf(-g)) * up[k];
    }
}

__global__ void add_kernel(float *out, const float *a, const float *b, int64_t count)
{
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < count;
         k += (int64_t)gridDim.x * blockDim.x)
        out[k] = a[k] + b[k];
}

static int cuda_swiglu(struct skv_backend *be, float *out, const float *gate, const float *up,
                       int64_t count)
{
    if (count < 0)
        return skv_errorf(SKV_E_INVAL, "swiglu: count %lld", (long long)count);
    if (count == 0)
        return SKV_OK;
    if (!out || !gate || !up)
        return skv_errorf(SKV_E_INVAL, "swiglu: NULL buffer");
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    swiglu_kernel<<<grid_for(count, EW_THREADS), EW_THREADS, 0, impl->stream>>>(out, gate, up,
                                                                                count);
    SKV_CUDA_CHECK(cudaGetLastError());
    return SKV_OK;
}

static int cuda_add(struct skv_backend *be, float *out, const float *a, const float *b,
                    int64_t count)
{
    if (count < 0)
        return skv_errorf(SKV_E_INVAL, "add: count %lld", (long long)count);
    if (count == 0)
        return SKV_OK;
    if (!out || !a || !b)
        return skv_errorf(SKV_E_INVAL, "add: NULL buffer");
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    add_kernel<<<grid_for(count, EW_THREADS), EW_THREADS, 0, impl->stream>>>(out, a, b, count);
    SKV_CUDA_CHECK(cudaGetLastError());
    return SKV_OK;
}

/* ---- attention ---------------------------------------------------------------------- */

/* The KV view as a kernel argument (about 1.8 KB, under the parameter limit). A paged view's
 * block tables are host memory: each call copies them into device scratch (upload_tables),
 * a few KB per layer, and blk[g] points there. */
struct att_params {
    const float *k[SKV_MAX_KV_HEADS];
    const float *v[SKV_MAX_KV_HEADS];
    const float *const *blk[SKV_MAX_KV_HEADS]; /* device [blocks of head g]; block_rows > 0 */
    int block_rows;                            /* 0: contiguous k / v */
    int prefix[SKV_MAX_KV_HEADS];
    int n, n_heads, group, d;
    float scale;
    const int32_t *first; /* device [n_kv][n]: sliding window's first row per query; NULL: 0 */
};

static int att_check(const char *op, const float *out, const float *q, int n, int n_heads,
                     const struct skv_kv_view *kv)
{
    if (!out || !q || !kv)
        return skv_errorf(SKV_E_INVAL, "%s: NULL buffer", op);
    if (n < 0 || n_heads <= 0 || kv->head_dim <= 0)
        return skv_errorf(SKV_E_INVAL, "%s: n=%d n_heads=%d head_dim=%d", op, n, n_heads,
                          kv->head_dim);
    if (kv->n_kv_heads <= 0 || kv->n_kv_heads > SKV_MAX_KV_HEADS ||
        n_heads % kv->n_kv_heads != 0)
        return skv_errorf(SKV_E_INVAL, "%s: %d heads over %d KV heads (max %d)", op, n_heads,
                          kv->n_kv_heads, SKV_MAX_KV_HEADS);
    if (kv->kv_type != SKV_DTYPE_F32)
        return skv_errorf(SKV_E_UNSUPPORTED, "%s: KV type %d (only f32)", op, kv->kv_type);
    for (int g = 0; g < kv->n_kv_heads; g++) {
        if (kv->prefix_len[g] < 0 || (int64_t)kv->prefix_len[g] + n > INT32_MAX)
            return skv_errorf(SKV_E_INVAL, "%s: KV head %d prefix %d with %d new", op, g,
                              (int)kv->prefix_len[g], n);
    }
    return skv_kv_view_check_rows(kv, op);
}

static void att_params_fill(struct att_params *p, const struct skv_kv_view *kv, int n,
                            int n_heads)
{
    for (int g = 0; g < kv->n_kv_heads; g++) {
        p->k[g] = (const float *)kv->k[g];
        p->v[g] = (const float *)kv->v[g];
        p->prefix[g] = kv->prefix_len[g];
    }
    p->n = n;
    p->n_heads = n_heads;
    p->group = n_heads / kv->n_kv_heads;
    p->d = kv->head_dim;
    p->scale = 1.0f / sqrtf((float)kv->head_dim);
    p->first = NULL;
    p->block_rows = kv->block_rows > 0 ? kv->block_rows : 0;
    for (int g = 0; g < SKV_MAX_KV_HEADS; g++)
        p->blk[g] = NULL;
}

/* Blocks of head g a paged view's call reads (its prefix and the n new rows). */
static size_t view_blocks(const struct skv_kv_view *kv, int g, int n)
{
    return ((size_t)kv->prefix_len[g] + n + kv->block_rows - 1) / kv->block_rows;
}

/* Bytes upload_tables() writes: 0 for a contiguous view. */
static size_t tables_bytes(const struct skv_kv_view *kv, int n)
{
    if (kv->block_rows <= 0)
        return 0;
    size_t count = 0;
    for (int g = 0; g < kv->n_kv_heads; g++)
        count += view_blocks(kv, g, n);
    return align_up(count * sizeof(void *));
}

/* For a paged view, copies every head's block table (host) to dst (device), where
 * p->blk[] then point. */
static int upload_tables(struct cuda_impl *impl, const struct skv_kv_view *kv, int n, void *dst,
                         struct att_params *p)
{
    if (kv->block_rows <= 0)
        return SKV_OK;
    const float **at = (const float **)dst;
    for (int g = 0; g < kv->n_kv_heads; g++) {
        const size_t nb = view_blocks(kv, g, n);
        /* a pageable source is staged when cudaMemcpyAsync returns */
        cudaError_t err = cudaMemcpyAsync((void *)at, kv->blocks[g], nb * sizeof(void *),
                                          cudaMemcpyHostToDevice, impl->stream);
        if (err != cudaSuccess)
            return skv_errorf(SKV_E_DEVICE, "%s:%d: %s: %s", __FILE__, __LINE__,
                              cudaGetErrorName(err), cudaGetErrorString(err));
        p->blk[g] = at;
        at += nb;
    }
    return SKV_OK;
}

/* Row j of KV head g: K (which == 0) or V, in either layout (skv_kv_view_row's twin). */
__device__ __forceinline__ const float *kv_row(const struct att_params &p, int g, int which,
                                               int j)
{
    if (p.block_rows <= 0)
        return (which ? p.v[g] : p.k[g]) + (size_t)j * p.d;
    const int t = p.block_rows;
    return p.blk[g][j / t] + ((size_t)which * t + j % t) * p.d;
}

/* Bytes upload_first() writes: 0 without a sliding window. */
static size_t first_bytes(const struct skv_kv_view *kv, int n)
{
    return kv->window > 0 ? align_up((size_t)kv->n_kv_heads * n * sizeof(int32_t)) : 0;
}

/* With a sliding window, computes on the host the first row each (KV head, query) sees
 * (skv_kv_view_first, from the host positions) and copies the table to dst (device), where
 * p->first then points. */
static int upload_first(struct cuda_impl *impl, const struct skv_kv_view *kv, int n, void *dst,
                        struct att_params *p)
{
    if (kv->window <= 0)
        return SKV_OK;
    const size_t count = (size_t)kv->n_kv_heads * n;
    int32_t *host = (int32_t *)malloc(count * sizeof *host);
    if (!host)
        return skv_errorf(SKV_E_NOMEM, "attention: %zu window bounds", count);
    for (int g = 0; g < kv->n_kv_heads; g++)
        for (int i = 0; i < n; i++)
            host[(size_t)g * n + i] = skv_kv_view_first(kv, g, i);
    /* a pageable source is staged when cudaMemcpyAsync returns, so host can go */
    cudaError_t err = cudaMemcpyAsync(dst, host, count * sizeof *host, cudaMemcpyHostToDevice,
                                      impl->stream);
    free(host);
    if (err != cudaSuccess)
        return skv_errorf(SKV_E_DEVICE, "%s:%d: %s: %s", __FILE__, __LINE__, cudaGetErrorName(err),
                          cudaGetErrorString(err));
    p->first = (const int32_t *)dst;
    return SKV_OK;
}

/* Scores of keys j0 .. j0+tn-1 of KV head g against the query in shared memory: one warp
 * per key, lanes over the head dimension. */
__device__ __forceinline__ void att_scores(float *sc, const float *qs, const struct att_params &p,
                                           int g, int j0, int tn, int d, float scale)
{
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    for (int jj = warp; jj < tn; jj += nw) {
        const float *kr = kv_row(p, g, 0, j0 + jj);
        float s = 0.0f;
        for (int t = lane; t < d; t += 32)
            s = fmaf(qs[t], kr[t], s);
        s = warp_sum(s);
        if (lane == 0)
            sc[jj] = s * scale;
    }
}

/* One block per (query, head): online softmax over the key tiles of its causal (and sliding)
 * window, output accumulated in double. */
__global__ void attention_kernel(float *out, const float *q, struct att_params p)
{
    extern __shared__ double att_smem[];
    __shared__ float s_m;
    __shared__ double s_l, s_alpha;
    const int d = p.d;
    double *acc = att_smem;
    float *qs = (float *)(acc + d);
    float *sc = qs + d;
    const int i = blockIdx.x / p.n_heads, h = blockIdx.x % p.n_heads, g = h / p.group;
    const float *qi = q + ((size_t)i * p.n_heads + h) * d;
    const int seen = p.prefix[g] + i + 1;
    const int lo = p.first ? p.first[(size_t)g * p.n + i] : 0;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

    for (int t = threadIdx.x; t < d; t += blockDim.x) {
        qs[t] = qi[t];
        acc[t] = 0.0;
    }
    if (threadIdx.x == 0) {
        s_m = -INFINITY;
        s_l = 0.0;
    }
    __syncthreads();
    for (int j0 = lo; j0 < seen; j0 += ATT_TILE) {
        const int tn = seen - j0 < ATT_TILE ? seen - j0 : ATT_TILE;
        att_scores(sc, qs, p, g, j0, tn, d, p.scale);
        __syncthreads();
        if (warp == 0) {
            float mx = -INFINITY;
            for (int jj = lane; jj < tn; jj += 32)
                mx = fmaxf(mx, sc[jj]);
            mx = warp_max(mx);
            if (lane == 0) {
                const float m_new = fmaxf(s_m, mx);
                s_alpha = exp((double)s_m - (double)m_new);
                s_m = m_new;
            }
        }
        __syncthreads();
        const float m = s_m;
        for (int jj = threadIdx.x; jj < tn; jj += blockDim.x)
            sc[jj] = expf(sc[jj] - m);
        __syncthreads();
        const double alpha = s_alpha;
        if (warp == 0) {
            double ls = 0.0;
            for (int jj = lane; jj < tn; jj += 32)
                ls += sc[jj];
            ls = warp_sum_d(ls);
            if (lane == 0)
                s_l = s_l * alpha + ls;
        }
        for (int t = threadIdx.x; t < d; t += blockDim.x) {
            double a = acc[t] * alpha;
            for (int jj = 0; jj < tn; jj++)
                a += (double)sc[jj] * kv_row(p, g, 1, j0 + jj)[t];
            acc[t] = a;
        }
        __syncthreads();
    }
    float *o = out + ((size_t)i * p.n_heads + h) * d;
    const double inv = 1.0 / s_l;
    for (int t = threadIdx.x; t < d; t += blockDim.x)
        o[t] = (float)(acc[t] * inv);
}

static int cuda_attention(struct skv_backend *be, float *out, const float *q, int n, int n_heads,
                          const struct skv_kv_view *kv)
{
    int rc = att_check("attention", out, q, n, n_heads, kv);
    if (rc == SKV_OK)
        rc = skv_kv_view_check_window(kv, "attention");
    if (rc < 0)
        return rc;
    if (n == 0)
        return SKV_OK;
    const size_t smem = (size_t)kv->head_dim * (sizeof(double) + sizeof(float)) +
                        ATT_TILE * sizeof(float);
    if (smem > 48 * 1024)
        return skv_errorf(SKV_E_UNSUPPORTED, "attention: head_dim %d too large", kv->head_dim);
    if ((int64_t)n * n_heads > INT_MAX)
        return skv_errorf(SKV_E_INVAL, "attention: %d queries x %d heads", n, n_heads);
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    struct att_params p;
    att_params_fill(&p, kv, n, n_heads);
    void *s = NULL;
    const size_t fb = first_bytes(kv, n), tb = tables_bytes(kv, n);
    if (fb + tb > 0 && ((rc = scratch_get(impl, fb + tb, &s)) < 0 ||
                        (rc = upload_first(impl, kv, n, s, &p)) < 0 ||
                        (rc = upload_tables(impl, kv, n, (char *)s + fb, &p)) < 0))
        return rc;
    attention_kernel<<<(unsigned)(n * n_heads), ATT_THREADS, smem, impl->stream>>>(out, q, p);
    SKV_CUDA_CHECK(cudaGetLastError());
    return SKV_OK;
}

/* ---- compression scores ------------------------------------------------------------- */

/* Softmax statistics of query q_first + blockIdx.x / n_heads, head blockIdx.x % n_heads:
 * the max score and the sum of exp(score - max), over the keys it sees. */
__global__ void colsum_stats_kernel(float *m_out, double *l_out, const float *q, int q_first,
                                    struct att_params p)
{
    extern __shared__ float cs_smem[];
    __shared__ double red[33];
    __shared__ float s_m;
    const int d = p.d;
    float *qs = cs_smem, *sc = qs + d;
    const int i = q_first + (int)(blockIdx.x / p.n_heads), h = blockIdx.x % p.n_heads;
    const int g = h / p.group;
    const float *qi = q + ((size_t)i * p.n_heads + h) * d;
    const int seen = p.prefix[g] + i + 1;
    const int lo = p.first ? p.first[(size_t)g * p.n + i] : 0;
    for (int t = threadIdx.x; t < d; t += blockDim.x)
        qs[t] = qi[t];
    __syncthreads();
    float mx = -INFINITY;
    for (int j0 = lo; j0 < seen; j0 += ATT_TILE) {
        const int tn = seen - j0 < ATT_TILE ? seen - j0 : ATT_TILE;
        att_scores(sc, qs, p, g, j0, tn, d, p.scale);
        __syncthreads();
        for (int jj = threadIdx.x; jj < tn; jj += blockDim.x)
            mx = fmaxf(mx, sc[jj]);
        __syncthreads();
    }
    /* block max through the double reduction buffer */
    mx = warp_max(mx);
    if (threadIdx.x % 32 == 0)
        red[threadIdx.x / 32] = mx;
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = -INFINITY;
        for (int w = 0; w < (int)blockDim.x / 32; w++)
            m = fmaxf(m, (float)red[w]);
        s_m = m;
    }
    __syncthreads();
    const float m = s_m;
    double l = 0.0;
    for (int j0 = lo; j0 < seen; j0 += ATT_TILE) {
        const int tn = seen - j0 < ATT_TILE ? seen - j0 : ATT_TILE;
        att_scores(sc, qs, p, g, j0, tn, d, p.scale);
        __syncthreads();
        for (int jj = threadIdx.x; jj < tn; jj += blockDim.x)
            l += expf(sc[jj] - m);
        __syncthreads();
    }
    l = block_sum_d(l, red);
    if (threadIdx.x == 0) {
        m_out[blockIdx.x] = m;
        l_out[blockIdx.x] = l;
    }
}

/* out[h][j] = sum over the window's queries that see key j of their probability of j. One
 * thread per (head, key); deterministic, no atomics. */
__global__ void colsum_sum_kernel(float *out, int64_t out_stride, const float *q, int q_first,
                                  const float *m_in, const double *l_in, struct att_params p)
{
    const int h = blockIdx.y, g = h / p.group, d = p.d;
    const int n_keys = p.prefix[g] + p.n;
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n_keys)
        return;
    const float *kr = kv_row(p, g, 0, j);
    int i0 = j - p.prefix[g];
    i0 = i0 > q_first ? i0 : q_first;
    double sum = 0.0;
    for (int i = i0; i < p.n; i++) {
        if (p.first && j < p.first[(size_t)g * p.n + i])
            continue;   /* outside query i's sliding window */
        const float *qi = q + ((size_t)i * p.n_heads + h) * d;
        float s = 0.0f;
        for (int t = 0; t < d; t++)
            s = fmaf(qi[t], kr[t], s);
        const int si = (i - q_first) * p.n_heads + h;
        sum += (double)expf(s * p.scale - m_in[si]) / l_in[si];
    }
    out[(size_t)h * out_stride + j] = (float)sum;
}

static int cuda_attention_colsum(struct skv_backend *be, float *out, int64_t out_stride,
                                 const float *q, int n, int n_heads,
                                 const struct skv_kv_view *kv, int q_first)
{
    if (!be || !out || !q || !kv || n <= 0 || n_heads <= 0 || kv->n_kv_heads <= 0 ||
        kv->n_kv_heads > SKV_MAX_KV_HEADS || n_heads % kv->n_kv_heads || q_first < 0 ||
        q_first >= n || kv->head_dim <= 0)
        return skv_errorf(SKV_E_INVAL, "attention_colsum: bad shape");
    if (kv->kv_type != SKV_DTYPE_F32)
        return skv_errorf(SKV_E_UNSUPPORTED, "attention_colsum: kv type %d", kv->kv_type);
    int rc = skv_kv_view_check_window(kv, "attention_colsum");
    if (rc == SKV_OK)
        rc = skv_kv_view_check_rows(kv, "attention_colsum");
    if (rc < 0)
        return rc;
    int max_keys = 0;
    for (int h = 0; h < kv->n_kv_heads; h++) {
        if (kv->prefix_len[h] < 0 || (int64_t)kv->prefix_len[h] + n > out_stride ||
            (int64_t)kv->prefix_len[h] + n > INT32_MAX)
            return skv_errorf(SKV_E_INVAL, "attention_colsum: output row too short");
        max_keys = kv->prefix_len[h] + n > max_keys ? kv->prefix_len[h] + n : max_keys;
    }
    const size_t smem = ((size_t)kv->head_dim + ATT_TILE) * sizeof(float);
    if (smem > 48 * 1024)
        return skv_errorf(SKV_E_UNSUPPORTED, "attention_colsum: head_dim %d too large",
                          kv->head_dim);
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    struct att_params p;
    att_params_fill(&p, kv, n, n_heads);
    const int64_t nq = (int64_t)(n - q_first) * n_heads;
    void *s = NULL;
    const size_t m_bytes = align_up((size_t)nq * sizeof(float));
    const size_t l_bytes = align_up((size_t)nq * sizeof(double));
    const size_t f_bytes = first_bytes(kv, n);
    rc = scratch_get(impl, m_bytes + l_bytes + f_bytes + tables_bytes(kv, n), &s);
    if (rc < 0)
        return rc;
    float *m = (float *)s;
    double *l = (double *)((char *)s + m_bytes);
    if ((rc = upload_first(impl, kv, n, (char *)s + m_bytes + l_bytes, &p)) < 0 ||
        (rc = upload_tables(impl, kv, n, (char *)s + m_bytes + l_bytes + f_bytes, &p)) < 0)
        return rc;
    colsum_stats_kernel<<<(unsigned)nq, ATT_THREADS, smem, impl->stream>>>(m, l, q, q_first, p);
    SKV_CUDA_CHECK(cudaGetLastError());
    dim3 grid((unsigned)((max_keys + 127) / 128), (unsigned)n_heads);
    colsum_sum_kernel<<<grid, 128, 0, impl->stream>>>(out, out_stride, q, q_first, m, l, p);
    SKV_CUDA_CHECK(cudaGetLastError());
    return SKV_OK;
}

__global__ void cosine_rows_kernel(double *cos_out, const float *a, const float *b, int dim)
{
    __shared__ double red[33];
    const float *x = a + (size_t)blockIdx.x * dim, *y = b + (size_t)blockIdx.x * dim;
    double xy = 0.0, xx = 0.0, yy = 0.0;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) {
        xy += (double)x[j] * y[j];
        xx += (double)x[j] * x[j];
        yy += (double)y[j] * y[j];
    }
    xy = block_sum_d(xy, red);
    xx = block_sum_d(xx, red);
    yy = block_sum_d(yy, red);
    if (threadIdx.x == 0) {
        const double den = sqrt(xx) * sqrt(yy);
        cos_out[blockIdx.x] = den > 0 ? xy / den : 0.0;
    }
}

static int cuda_cosine_mean(struct skv_backend *be, float *out, const float *a, const float *b,
                            int n, int dim)
{
    if (!be || !out || !a || !b || n <= 0 || dim <= 0)
        return skv_errorf(SKV_E_INVAL, "cosine_mean: bad shape");
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    void *s = NULL;
    int rc = scratch_get(impl, (size_t)n * sizeof(double), &s);
    if (rc < 0)
        return rc;
    double *host = (double *)malloc((size_t)n * sizeof(double));
    if (!host)
        return skv_errorf(SKV_E_NOMEM, "cosine_mean: %d rows", n);
    cosine_rows_kernel<<<(unsigned)n, EW_THREADS, 0, impl->stream>>>((double *)s, a, b, dim);
    cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess)
        err = cudaMemcpyAsync(host, s, (size_t)n * sizeof(double), cudaMemcpyDeviceToHost,
                              impl->stream);
    if (err == cudaSuccess)
        err = cudaStreamSynchronize(impl->stream);
    if (err != cudaSuccess) {
        free(host);
        return skv_errorf(SKV_E_DEVICE, "%s:%d: %s: %s", __FILE__, __LINE__,
                          cudaGetErrorName(err), cudaGetErrorString(err));
    }
    double total = 0.0;
    for (int i = 0; i < n; i++)
        total += host[i];
    free(host);
    *out = (float)(total / n);
    return SKV_OK;
}

/* dst row i = src row idx[i]; 4-byte words when everything is 4-byte aligned. */
__global__ void gather_kernel(uint8_t *dst, const uint8_t *src, size_t row_bytes,
                              const int32_t *idx, int n, int words)
{
    const int64_t per_row = words ? (int64_t)(row_bytes / 4) : (int64_t)row_bytes;
    const int64_t total = (int64_t)n * per_row;
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < total;
         k += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = k / per_row, e = k % per_row;
        const size_t so = (size_t)idx[i] * row_bytes, dof = (size_t)i * row_bytes;
        if (words)
            ((uint32_t *)(dst + dof))[e] = ((const uint32_t *)(src + so))[e];
        else
            dst[dof + e] = src[so + e];
    }
}

static int cuda_gather_rows(struct skv_backend *be, void *dst, const void *src, size_t row_bytes,
                            const int32_t *idx, int n)
{
    if (n < 0 || (n > 0 && (!dst || !src || !idx)))
        return skv_errorf(SKV_E_INVAL, "gather_rows: bad arguments");
    const bool in_place = dst == src;
    for (int i = 0; i < n; i++)
        if (idx[i] < 0 || (in_place && i > 0 && idx[i] <= idx[i - 1]))
            return skv_errorf(SKV_E_INVAL,
                              "gather_rows: index %d at %d is negative or out of order", idx[i], i);
    if (n == 0 || row_bytes == 0)
        return SKV_OK;
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    /* in place: gather into scratch, then copy back, so no row is overwritten before read */
    const size_t idx_bytes = align_up((size_t)n * sizeof(int32_t));
    const size_t rows_bytes = in_place ? (size_t)n * row_bytes : 0;
    void *s = NULL;
    int rc = scratch_get(impl, idx_bytes + rows_bytes, &s);
    if (rc < 0)
        return rc;
    int32_t *didx = (int32_t *)s;
    uint8_t *tmp = (uint8_t *)s + idx_bytes;
    SKV_CUDA_CHECK(cudaMemcpyAsync(didx, idx, (size_t)n * sizeof(int32_t), cudaMemcpyHostToDevice,
                                   impl->stream));
    uint8_t *target = in_place ? tmp : (uint8_t *)dst;
    const int words = (row_bytes % 4 == 0 && (uintptr_t)src % 4 == 0 &&
                       (uintptr_t)target % 4 == 0) ? 1 : 0;
    const int64_t total = (int64_t)n * (int64_t)(words ? row_bytes / 4 : row_bytes);
    gather_kernel<<<grid_for(total, EW_THREADS), EW_THREADS, 0, impl->stream>>>(
        target, (const uint8_t *)src, row_bytes, didx, n, words);
    SKV_CUDA_CHECK(cudaGetLastError());
    if (in_place)
        SKV_CUDA_CHECK(cudaMemcpyAsync(dst, tmp, rows_bytes, cudaMemcpyDeviceToDevice,
                                       impl->stream));
    return SKV_OK;
}

/* Row i of n: dst[i] <- src[i], 32-bit words when every pointer and the row allow it. */
__global__ void copy_rows_kernel(uint8_t *const *dst, const uint8_t *const *src, size_t row_bytes, int n,
                                 int words)
{
    const int64_t per_row = words ? (int64_t)(row_bytes / 4) : (int64_t)row_bytes;
    const int64_t total = (int64_t)n * per_row;
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < total;
         k += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = k / per_row, e = k % per_row;
        if (words)
            ((uint32_t *)dst[i])[e] = ((const uint32_t *)src[i])[e];
        else
            dst[i][e] = src[i][e];
    }
}

/* The two pointer tables go to device scratch (one upload), then one kernel moves every row. */
static int cuda_copy_rows(struct skv_backend *be, void *const *dst, const void *const *src, size_t row_bytes,
                          int n)
{
    if (n < 0 || (n > 0 && (!dst || !src)))
        return skv_errorf(SKV_E_INVAL, "copy_rows: bad arguments");
    int words = row_bytes % 4 == 0;
    for (int i = 0; i < n; i++) {
        if (!dst[i] || !src[i])
            return skv_errorf(SKV_E_INVAL, "copy_rows: row %d has no %s", i, dst[i] ? "source" : "destination");
        words = words && (uintptr_t)dst[i] % 4 == 0 && (uintptr_t)src[i] % 4 == 0;
    }
    if (n == 0 || row_bytes == 0)
        return SKV_OK;
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    const size_t table = (size_t)n * sizeof(void *);
    void *s = NULL;
    int rc = scratch_get(impl, 2 * align_up(table), &s);
    if (rc < 0)
        return rc;
    uint8_t **ddst = (uint8_t **)s;
    const uint8_t **dsrc = (const uint8_t **)((char *)s + align_up(table));
    /* pageable sources are staged when cudaMemcpyAsync returns */
    SKV_CUDA_CHECK(cudaMemcpyAsync(ddst, dst, table, cudaMemcpyHostToDevice, impl->stream));
    SKV_CUDA_CHECK(cudaMemcpyAsync(dsrc, src, table, cudaMemcpyHostToDevice, impl->stream));
    const int64_t total = (int64_t)n * (int64_t)(words ? row_bytes / 4 : row_bytes);
    copy_rows_kernel<<<grid_for(total, EW_THREADS), EW_THREADS, 0, impl->stream>>>(ddst, dsrc, row_bytes, n,
                                                                                   words);
    SKV_CUDA_CHECK(cudaGetLastError());
    return SKV_OK;
}

/* ---- construction ------------------------------------------------------------------- */

static void cuda_destroy(struct skv_backend *be)
{
    if (!be)
        return;
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    if (impl) {
        if (impl->stream)
            cudaStreamSynchronize(impl->stream);
        if (impl->scratch)
            cudaFree(impl->scratch);
        if (impl->blas)
            cublasDestroy(impl->blas);
        if (impl->stream)
            cudaStreamDestroy(impl->stream);
        free(impl);
    }
    free(be);
}

/* ---- IPC ---------------------------------------------------------------------------- */

static int cuda_ipc_open(struct skv_backend *be, const void *handle, size_t handle_len, void **out)
{
    if (be == NULL || handle == NULL || out == NULL)
        return skv_errorf(SKV_E_INVAL, "ipc_open: bad arguments");
    if (handle_len != sizeof(cudaIpcMemHandle_t))
        return skv_errorf(SKV_E_INVAL, "ipc_open: a CUDA IPC handle has %zu bytes, not %zu",
                          sizeof(cudaIpcMemHandle_t), handle_len);
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof h);
    void *p = NULL;
    SKV_CUDA_CHECK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    *out = p;
    return SKV_OK;
}

static void cuda_ipc_close(struct skv_backend *be, void *ptr)
{
    if (be == NULL || ptr == NULL)
        return;
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    cudaStreamSynchronize(impl->stream); /* nothing queued may still write into it */
    cudaIpcCloseMemHandle(ptr);
}

static const struct skv_backend_ops cuda_ops = {
    /* destroy */ cuda_destroy,
    /* alloc */ cuda_alloc,
    /* free */ cuda_free,
    /* upload */ cuda_upload,
    /* download */ cuda_download,
    /* copy_2d */ cuda_copy_2d,
    /* sync */ cuda_sync,
    /* get_rows */ cuda_get_rows,
    /* matmul */ cuda_matmul,
    /* matmul_multi */ cuda_matmul_multi,
    /* rmsnorm */ cuda_rmsnorm,
    /* rope */ cuda_rope,
    /* swiglu */ cuda_swiglu,
    /* add */ cuda_add,
    /* attention */ cuda_attention,
    /* attention_colsum */ cuda_attention_colsum,
    /* cosine_mean */ cuda_cosine_mean,
    /* gather_rows */ cuda_gather_rows,
    /* copy_rows */ cuda_copy_rows,
    /* ipc_open */ cuda_ipc_open,
    /* ipc_close */ cuda_ipc_close,
};

/* Probes the device and sets up a stream and a cuBLAS handle bound to it. */
static int cuda_probe(int device, struct skv_backend **out)
{
    int count = 0;
    SKV_CUDA_CHECK(cudaGetDeviceCount(&count));
    if (device < 0 || device >= count)
        return skv_errorf(SKV_E_DEVICE, "CUDA device %d not present (%d found)", device, count);
    SKV_CUDA_CHECK(cudaSetDevice(device));
    struct skv_backend *be = (struct skv_backend *)calloc(1, sizeof *be);
    struct cuda_impl *impl = (struct cuda_impl *)calloc(1, sizeof *impl);
    if (!be || !impl) {
        free(be);
        free(impl);
        return skv_errorf(SKV_E_NOMEM, "CUDA backend: out of host memory");
    }
    be->name = "cuda";
    be->ops = &cuda_ops;
    be->impl = impl;
    be->n_threads = 1;
    impl->device = device;
    cudaError_t err = cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking);
    cublasStatus_t bst = err == cudaSuccess ? cublasCreate(&impl->blas) : CUBLAS_STATUS_NOT_INITIALIZED;
    if (bst == CUBLAS_STATUS_SUCCESS)
        bst = cublasSetStream(impl->blas, impl->stream);
    if (err != cudaSuccess || bst != CUBLAS_STATUS_SUCCESS) {
        cuda_destroy(be);
        return err != cudaSuccess
                   ? skv_errorf(SKV_E_DEVICE, "%s:%d: %s", __FILE__, __LINE__, cudaGetErrorName(err))
                   : skv_errorf(SKV_E_DEVICE, "%s:%d: cuBLAS: %s", __FILE__, __LINE__, cublasGetStatusName(bst));
    }
    *out = be;
    return SKV_OK;
}

extern "C" int skv_backend_cuda_new(int device, struct skv_backend **out)
{
    if (!out)
        return skv_errorf(SKV_E_INVAL, "cuda backend: NULL output");
    *out = NULL;
    return cuda_probe(device, out);
}

extern "C" bool skv_backend_cuda_compiled(void)
{
    return true;
}
