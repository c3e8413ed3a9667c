/* The CUDA backend: device probing, device memory and copies on one stream, and the whole op
 * table (get_rows, matmul via GEMV kernels or cuBLAS, rmsnorm, rope, swiglu, add, attention,
 * the compression scores and row copies). kernels/cpu is the reference these ops mirror. */
#include "kernels/cuda/common.cuh"

#include <cuda.h> /* driver types only: cuMemGetAddressRange comes through the runtime */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

extern "C" {
#include "kernels/backend.h"
}

#include <climits>
#include <cmath>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Up to this many activation rows the matmul runs a dequantizing GEMV kernel. */
#define MM_GEMV_MAX_N 8
#define MM_GEMV_WARPS 8
#define MM_VEC_UNROLL 4        /* 16-byte weight loads in flight per lane (gemv_vec_kernel) */
#define MM_VEC_ROWS 4          /* gemv_vec_kernel with n >= 2: most weight rows per warp */
#define MM_ROWS_WARPS 4        /* and its warps per block */
/* Bytes of bf16 weight tile a quantized GEMM dequantizes at a time. */
#define MM_TILE_BYTES ((size_t)64 << 20)
/* attention_kernel (the fallback) and the colsum kernels */
#define ATT_THREADS 128
#define ATT_TILE 64
/* Split-K decode (att_decode_kernel) and prefill through cuBLAS (att_gemm): see cuda_attention. */
#define ATT_MAX_D 256         /* largest head_dim the decode kernel takes */
#define ATT_SPLIT_MAX_N 8     /* batches of up to this many queries take split-K decode */
#define ATT_TK 32             /* keys per tile */
#define ATT_CHUNK_MIN 64      /* split-K: fewest keys per chunk (a multiple of ATT_TK) */
#define ATT_DEC_WARPS 4       /* split-K decode kernel: warps per block */
#define ATT_DEC_RPW 4         /* its (query, head) rows per warp */
#define ATT_DEC_LROWS 4       /* its tile rows a warp loads before it stores them */
static_assert(ATT_MAX_D % 128 == 0, "a tile row is loaded in float4 slices of 128 floats");
static_assert(ATT_TK % ATT_DEC_WARPS == 0, "every warp loads the same number of tile rows");
#define ATT_DEC_BLOCKS_PER_SM 8 /* split-K: chunks sized for about this many blocks per SM */
#define ATT_MAX_CHUNKS 1024   /* split-K: most chunks per KV head */
#ifndef ATT_GEMM_S_BYTES /* the host emulation sets a small one: queries then go in batches */
#define ATT_GEMM_S_BYTES ((size_t)256 << 20) /* prefill through cuBLAS: scores of one batch */
#endif
#define ATT_GEMM_MAX_BYTES ((size_t)4 << 30) /* its scratch above this: attention_kernel */
#define RMS_THREADS 1024   /* rmsnorm: most threads per row */
#define RMS_PER_THREAD 8   /* rmsnorm: elements each thread holds in registers */
#define EW_THREADS 256
#define SCRATCH_ROUND ((size_t)1 << 20)

/* the ops SKV_CUDA_PROFILE times, in prof_names' order */
enum {
    P_ALLOC, P_FREE, P_UPLOAD, P_DOWNLOAD, P_COPY_2D, P_SYNC, P_GET_ROWS, P_MATMUL, P_MATMUL_MULTI, P_RMSNORM,
    P_ROPE, P_SWIGLU, P_ADD, P_ATTENTION, P_COLSUM, P_GROUP_SCORES, P_TOPK, P_COSINE, P_COPY_ROWS, P_ATT_BATCH,
    P_ROW_LOGPROBS, P_ROW_TOP_LOGPROBS, P_OPS
};

struct cuda_impl {
    int device;
    cudaStream_t stream;
    cublasHandle_t blas;
    void *scratch;          /* device scratch, grown on demand; ops use it in stream order */
    size_t scratch_bytes;
    void *stage;            /* host staging of per-call tables (window bounds, block tables) */
    size_t stage_bytes;
    /* RoPE's frequencies and host positions as last uploaded (rope_table): a decode step
     * rotates q and k of every layer with the same ones */
    double *rope_freq;      /* device [SKV_ROPE_MAX_DIM / 2] */
    double rope_freq_host[SKV_ROPE_MAX_DIM / 2];
    int rope_half;          /* frequencies held; 0: none */
    int32_t *rope_pos;      /* device [rope_pos_cap] */
    int32_t *rope_pos_host; /* host copy of the rope_pos_n uploaded */
    int rope_pos_n, rope_pos_cap;
    int sm_count;           /* streaming multiprocessors: sizes the split-K grid */
    bool att_smem_set;      /* att_decode_kernel may use > 48 KB of shared memory */
    bool att_batch_smem_set; /* and att_decode_batch_kernel */
    int prof_mode;          /* SKV_CUDA_PROFILE: 0 off, 1 host time per op, 2 each op synchronized */
    int prof_depth;         /* op calls in progress (an op calling another counts once) */
    int prof_phase;         /* 1 since the last op with at most PROF_DECODE_ROWS rows, else 0 */
    struct prof_acc { uint64_t calls, ns; } prof[2][P_OPS]; /* [prof_phase][op] */
};

/* ---- the op profile (SKV_CUDA_PROFILE) ---------------------------------------------- */

static const char *const prof_names[P_OPS] = {
    "alloc", "free", "upload", "download", "copy_2d", "sync", "get_rows", "matmul", "matmul_multi", "rmsnorm",
    "rope", "swiglu", "add", "attention", "attention_colsum", "group_scores", "topk_rows", "cosine_mean",
    "copy_rows", "attention_batch", "row_logprobs", "row_top_logprobs",
};

static uint64_t prof_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* Times one op call on the host, from entry to return (mode 2: to the end of the work it
 * queued), into impl->prof; an op that another op calls counts in the caller's time. An op
 * with a row count (rows >= 0) sets the phase its time and the next row-less ops' go to:
 * decode-sized (at most PROF_DECODE_ROWS rows: a decode step's get_rows starts it) or the rest
 * (prefill, and the weight copies before any op with rows). */
#define PROF_DECODE_ROWS 8
struct prof_scope {
    struct cuda_impl *impl; /* NULL: profile off */
    int op;
    bool outer;
    uint64_t t0;
    prof_scope(struct skv_backend *be, int op_, int rows) : impl(NULL), op(op_), outer(false), t0(0)
    {
        struct cuda_impl *i = be ? (struct cuda_impl *)be->impl : NULL;
        if (!i || !i->prof_mode)
            return;
        impl = i;
        outer = i->prof_depth++ == 0;
        if (outer && rows >= 0)
            i->prof_phase = rows <= PROF_DECODE_ROWS;
        if (outer)
            t0 = prof_now();
    }
    ~prof_scope()
    {
        if (!impl)
            return;
        impl->prof_depth--;
        if (!outer)
            return;
        if (impl->prof_mode == 2 && cudaStreamSynchronize(impl->stream) != cudaSuccess)
            (void)cudaGetLastError(); /* the next op's check is not this one's */
        struct cuda_impl::prof_acc *a = &impl->prof[impl->prof_phase][op];
        a->calls++;
        a->ns += prof_now() - t0;
    }
};

/* ---- memory, copies ----------------------------------------------------------------- */

static int cuda_alloc(struct skv_backend *be, size_t bytes, void **out)
{
    prof_scope prof_(be, P_ALLOC, -1);
    if (!out)
        return skv_errorf(SKV_E_INVAL, "alloc: NULL output");
    void *p = NULL;
    SKV_CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 1));
    *out = p;
    return SKV_OK;
}

static void cuda_free(struct skv_backend *be, void *ptr)
{
    prof_scope prof_(be, P_FREE, -1);
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    if (!ptr)
        return;
    /* queued work on the stream may still read it: wait for it here rather than count on
     * cudaFree synchronizing the device (a stream-ordered allocator would not) */
    (void)cudaStreamSynchronize(impl->stream);
    cudaFree(ptr);
    (void)cudaGetLastError(); /* a failure here is not the next request's */
}

static int cuda_upload(struct skv_backend *be, void *dst, const void *src, size_t bytes)
{
    prof_scope prof_(be, P_UPLOAD, -1);
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    SKV_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, impl->stream));
    return SKV_OK;
}

static int cuda_download(struct skv_backend *be, void *dst, const void *src, size_t bytes)
{
    prof_scope prof_(be, P_DOWNLOAD, -1);
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    SKV_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, impl->stream));
    SKV_CUDA_CHECK(cudaStreamSynchronize(impl->stream));
    return SKV_OK;
}

static int cuda_copy_2d(struct skv_backend *be, void *dst, size_t dst_stride, const void *src,
                        size_t src_stride, size_t row_bytes, int64_t n_rows)
{
    prof_scope prof_(be, P_COPY_2D, -1);
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    if (n_rows < 0)
        return skv_errorf(SKV_E_INVAL, "copy_2d: %lld rows", (long long)n_rows);
    if (n_rows == 0 || row_bytes == 0)
        return SKV_OK;
    if (n_rows == 1 || (dst_stride == row_bytes && src_stride == row_bytes)) {
        /* contiguous: one plain copy (a 2-D copy refuses pitches past the device's memPitch,
         * 2^31 - 1: a whole 128K-token residual stream passed as one row) */
        SKV_CUDA_CHECK(cudaMemcpyAsync(dst, src, row_bytes * (size_t)n_rows, cudaMemcpyDeviceToDevice, impl->stream));
        return SKV_OK;
    }
    SKV_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_stride, src, src_stride, row_bytes, (size_t)n_rows,
                                     cudaMemcpyDeviceToDevice, impl->stream));
    return SKV_OK;
}

static int cuda_sync(struct skv_backend *be)
{
    prof_scope prof_(be, P_SYNC, -1);
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

/* A host buffer of at least `bytes` for tables that one cudaMemcpyAsync then uploads. A
 * pageable source is staged when cudaMemcpyAsync returns, so the next call may reuse it. */
static int stage_get(struct cuda_impl *impl, size_t bytes, void **out)
{
    if (bytes > impl->stage_bytes) {
        void *p = realloc(impl->stage, bytes);
        if (!p)
            return skv_errorf(SKV_E_NOMEM, "CUDA backend: %zu bytes of host staging", bytes);
        impl->stage = p;
        impl->stage_bytes = bytes;
    }
    *out = impl->stage;
    return SKV_OK;
}

static size_t align_up(size_t v)
{
    return (v + 255) / 256 * 256;
}

/* Uploads a small host table (ids, positions, block tables) to device dst in stream order;
 * src may be reused on return: the driver stages a pageable source before returning. (A
 * pinned staging ring measured slower on the H200 host: 8.1 against 6.2 ms per decoded
 * token of the 135M model, each small copy then going through the copy engine.) */
static int upload_table(struct cuda_impl *impl, void *dst, const void *src, size_t bytes)
{
    if (bytes > 0)
        SKV_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, impl->stream));
    return SKV_OK;
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

/* Sum (MAX: max) over the warp by butterfly: every lane gets the result. */
template <bool MAX, class T>
__device__ __forceinline__ T warp_reduce(T v)
{
    for (int o = 16; o > 0; o >>= 1) {
        const T u = __shfl_xor_sync(0xffffffffu, v, o);
        v = MAX ? fmax(v, u) : v + u; /* fmax: a NaN lane does not win */
    }
    return v;
}

__device__ __forceinline__ float warp_sum(float v) { return warp_reduce<false>(v); }
__device__ __forceinline__ double warp_sum_d(double v) { return warp_reduce<false>(v); }
__device__ __forceinline__ float warp_max(float v) { return warp_reduce<true>(v); }

/* Sum (MAX: max) over the block (blockDim a multiple of 32, at most 1024) with red[33] of
 * shared memory; every thread gets it. */
template <bool MAX, class T>
__device__ T block_reduce(T v, T *red)
{
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    v = warp_reduce<MAX>(v);
    __syncthreads();
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        T x = lane < nw ? red[lane] : MAX ? (T)-INFINITY : (T)0;
        x = warp_reduce<MAX>(x);
        if (lane == 0)
            red[32] = x;
    }
    __syncthreads();
    return red[32];
}

__device__ double block_sum_d(double v, double *red) { return block_reduce<false>(v, red); }

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
    prof_scope prof_(be, P_GET_ROWS, n);
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
        if ((rc = upload_table(impl, s, ids, (size_t)n * sizeof(int32_t))) < 0)
            return rc;
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

/* A GEMV warp's row r: each lane's partial sums reduced over the warp, plus the bias. */
__device__ __forceinline__ void gemv_store(float *out, const float *acc, const float *bias, int r, int rows, int n,
                                           int lane)
{
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

/* One warp per weight row, lanes over the columns; n <= MM_GEMV_MAX_N activation rows (any
 * type, any alignment; F32 / F16 / BF16 rows that allow it take gemv_vec_kernel). */
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
    gemv_store(out, acc, bias, r, rows, n, lane);
}

/* Eight 16-bit (F16 or BF16) or four F32 weights of one 16-byte load, as floats. */
template <int TYPE>
__device__ __forceinline__ void unpack16(const uint4 v, float *f)
{
    const uint32_t word[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if constexpr (TYPE == SKV_DTYPE_F32) {
            f[i] = __uint_as_float(word[i]);
        } else if constexpr (TYPE == SKV_DTYPE_BF16) {
            f[2 * i] = __uint_as_float(word[i] << 16);
            f[2 * i + 1] = __uint_as_float(word[i] & 0xffff0000u);
        } else {
            const float2 t = __half22float2(*reinterpret_cast<const __half2 *>(&word[i]));
            f[2 * i] = t.x;
            f[2 * i + 1] = t.y;
        }
    }
}

/* gemv_kernel for F32 / F16 / BF16 rows whose bytes and activations are 16-byte aligned: a warp
 * per R weight rows, each lane reading 16 bytes of each row at a time (4 or 8 weights),
 * MM_VEC_UNROLL loads a row in flight, so that decode streams the weights near the memory's
 * bandwidth; WARPS warps a block. One activation row (batch-1 decode) takes R = 1. With 2 ..
 * MM_GEMV_MAX_N (a decode group, a short append) a warp takes up to MM_VEC_ROWS weight rows
 * (gemv_rows_per_warp), so that each activation load serves all of them: one weight row a
 * warp reads n x 32 bytes of activations per 16 bytes of weights, for every weight row, and at
 * n = 8 that traffic from L1 and L2, not the weights from DRAM, bounds the kernel. Whatever R
 * and WARPS, each lane visits its columns in the same order and keeps one sum per (weight row,
 * activation row), and the warp sums them as gemv_store does: every output is bit for bit the
 * same, so a session's decode does not depend on its group. */
template <int TYPE, int R, int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
gemv_vec_kernel(float *out, const uint8_t *w, size_t row_bytes, const float *bias, const float *x, int rows,
                     int cols, int n)
{
    constexpr int EPL = TYPE == SKV_DTYPE_F32 ? 4 : 8;
    const int lane = threadIdx.x % 32;
    const int r0 = (blockIdx.x * WARPS + threadIdx.x / 32) * R;
    if (r0 >= rows)
        return;
    const uint4 *wr[R];
#pragma unroll
    for (int k = 0; k < R; k++) /* a row past the last reads the last and is not stored */
        wr[k] = reinterpret_cast<const uint4 *>(w + (size_t)(r0 + k < rows ? r0 + k : rows - 1) * row_bytes);
    const int chunks = cols / EPL;
    float acc[R][MM_GEMV_MAX_N];
#pragma unroll
    for (int k = 0; k < R; k++)
#pragma unroll
        for (int j = 0; j < MM_GEMV_MAX_N; j++)
            acc[k][j] = 0.0f;
    for (int c0 = lane; c0 < chunks; c0 += 32 * MM_VEC_UNROLL) {
        uint4 v[MM_VEC_UNROLL][R];
#pragma unroll
        for (int u = 0; u < MM_VEC_UNROLL; u++)
#pragma unroll
            for (int k = 0; k < R; k++)
                v[u][k] = c0 + 32 * u < chunks ? __ldg(wr[k] + c0 + 32 * u) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int u = 0; u < MM_VEC_UNROLL; u++) {
            const int c = c0 + 32 * u;
            if (c >= chunks)
                break;
            float wf[R][EPL];
#pragma unroll
            for (int k = 0; k < R; k++)
                unpack16<TYPE>(v[u][k], wf[k]);
#pragma unroll
            for (int j = 0; j < MM_GEMV_MAX_N; j++) {
                if (j >= n)
                    break;
                const float4 *xp = reinterpret_cast<const float4 *>(x + (size_t)j * cols + (size_t)c * EPL);
#pragma unroll
                for (int q = 0; q < EPL / 4; q++) {
                    const float4 xv = __ldg(xp + q);
#pragma unroll
                    for (int k = 0; k < R; k++) {
                        acc[k][j] = fmaf(wf[k][4 * q], xv.x, acc[k][j]);
                        acc[k][j] = fmaf(wf[k][4 * q + 1], xv.y, acc[k][j]);
                        acc[k][j] = fmaf(wf[k][4 * q + 2], xv.z, acc[k][j]);
                        acc[k][j] = fmaf(wf[k][4 * q + 3], xv.w, acc[k][j]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int k = 0; k < R; k++)
        if (r0 + k < rows)
            gemv_store(out, acc[k], bias, r0 + k, rows, n, lane);
}

/* Rows of a quantized weight dequantized to bf16: the quantized GEMM's tensor-core input. */
template <int TYPE>
__global__ void dequant_tile_bf16_kernel(__nv_bfloat16 *dst, const uint8_t *w, size_t row_bytes, int64_t rows,
                                         int64_t cols)
{
    const int64_t total = rows * cols;
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < total;
         k += (int64_t)gridDim.x * blockDim.x)
        dst[k] = __float2bfloat16_rn(deq_elem<TYPE>(w + (size_t)(k / cols) * row_bytes, k % cols));
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

/* Weight rows per warp of gemv_vec_kernel for 2 or more activation rows: MM_VEC_ROWS while that
 * still gives every SM a block, else 2, else 1, so that a small matrix (a k / v projection) does
 * not leave SMs idle. Every choice gives the same bits. */
static int gemv_rows_per_warp(const struct cuda_impl *impl, int rows)
{
    for (int r = MM_VEC_ROWS; r > 1; r /= 2)
        if ((rows + MM_ROWS_WARPS * r - 1) / (MM_ROWS_WARPS * r) >= impl->sm_count)
            return r;
    return 1;
}

static int cuda_matmul(struct skv_backend *be, float *out, const struct skv_tensor *w,
                       const float *bias, const float *x, int n)
{
    prof_scope prof_(be, P_MATMUL, n);
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
        const bool wide = w->type == SKV_DTYPE_F32 || w->type == SKV_DTYPE_F16 || w->type == SKV_DTYPE_BF16;
        const int epl = w->type == SKV_DTYPE_F32 ? 4 : 8;
        if (wide && cols % epl == 0 && row_bytes % 16 == 0 && (uintptr_t)wd % 16 == 0 && (uintptr_t)x % 16 == 0) {
            const int rpw = gemv_rows_per_warp(impl, rows), per_block = MM_ROWS_WARPS * rpw;
            const unsigned rgrid = (unsigned)((rows + per_block - 1) / per_block);
#define MV_ROWS_LAUNCH(T, R)                                                                                \
    gemv_vec_kernel<T, R, MM_ROWS_WARPS><<<rgrid, MM_ROWS_WARPS * 32, 0, impl->stream>>>(out, wd, row_bytes, \
                                                                                         bias, x, rows, cols, n)
#define MV_VEC_LAUNCH(T)                                                                                     \
    do {                                                                                                     \
        if (n == 1)                                                                                          \
            gemv_vec_kernel<T, 1, MM_GEMV_WARPS><<<grid, MM_GEMV_WARPS * 32, 0, impl->stream>>>(             \
                out, wd, row_bytes, bias, x, rows, cols, n);                                                 \
        else if (rpw == MM_VEC_ROWS)                                                                         \
            MV_ROWS_LAUNCH(T, MM_VEC_ROWS);                                                                  \
        else if (rpw == 2)                                                                                   \
            MV_ROWS_LAUNCH(T, 2);                                                                            \
        else                                                                                                 \
            MV_ROWS_LAUNCH(T, 1);                                                                            \
    } while (0)
            if (w->type == SKV_DTYPE_F32)
                MV_VEC_LAUNCH(SKV_DTYPE_F32);
            else if (w->type == SKV_DTYPE_F16)
                MV_VEC_LAUNCH(SKV_DTYPE_F16);
            else
                MV_VEC_LAUNCH(SKV_DTYPE_BF16);
#undef MV_VEC_LAUNCH
#undef MV_ROWS_LAUNCH
            SKV_CUDA_CHECK(cudaGetLastError());
            return SKV_OK;
        }
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
        /* quantized: x once to bf16, then row tiles dequantized to bf16 and one tensor-core
         * GemmEx per tile (bf16 inputs, fp32 accumulate and output), as the F16/BF16 path */
        const int64_t xcount = (int64_t)n * cols;
        const size_t xbytes = ((size_t)xcount * 2 + 255) / 256 * 256;
        int64_t tr = (int64_t)(MM_TILE_BYTES / ((size_t)cols * 2));
        tr = tr < 1 ? 1 : tr > rows ? rows : tr;
        void *scratch = NULL;
        if ((rc = scratch_get(impl, xbytes + (size_t)tr * cols * 2, &scratch)) < 0)
            return rc;
        __nv_bfloat16 *xs = (__nv_bfloat16 *)scratch;
        __nv_bfloat16 *tile = (__nv_bfloat16 *)((char *)scratch + xbytes);
        to_bf16_kernel<<<grid_for(xcount, EW_THREADS), EW_THREADS, 0, impl->stream>>>(xs, x, xcount);
        SKV_CUDA_CHECK(cudaGetLastError());
        for (int64_t r0 = 0; r0 < rows; r0 += tr) {
            const int64_t m = rows - r0 < tr ? rows - r0 : tr;
            const unsigned grid = grid_for(m * cols, EW_THREADS);
            const uint8_t *src = wd + (size_t)r0 * row_bytes;
#define DQ_LAUNCH(T)                                                                              \
    dequant_tile_bf16_kernel<T><<<grid, EW_THREADS, 0, impl->stream>>>(tile, src, row_bytes, m, (int64_t)cols)
            DISPATCH_TYPE(w->type, DQ_LAUNCH)
#undef DQ_LAUNCH
            SKV_CUDA_CHECK(cudaGetLastError());
            SKV_CUBLAS_CHECK(cublasGemmEx(impl->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)m, n, cols, &one, tile,
                                          CUDA_R_16BF, cols, xs, CUDA_R_16BF, cols, &zero, out + r0, CUDA_R_32F,
                                          rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
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
    prof_scope prof_(be, P_MATMUL_MULTI, n);
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

/* One row per block (rms_threads). Each thread loads its RMS_PER_THREAD elements at once and
 * keeps them for the output pass (dims up to RMS_THREADS * RMS_PER_THREAD; the rest are read
 * again): a 256-thread loop that loaded one element after another took 16 us for one
 * 4096-wide row on the H200 (ncu, 725344a), a memory latency per element. */
__global__ void __launch_bounds__(RMS_THREADS) rmsnorm_kernel(float *out, const float *x, const float *w, int dim,
                                                               float eps)
{
    __shared__ double red[33];
    const float *xr = x + (size_t)blockIdx.x * dim;
    float *o = out + (size_t)blockIdx.x * dim;
    const int held = RMS_PER_THREAD * blockDim.x;
    float v[RMS_PER_THREAD];
#pragma unroll
    for (int u = 0; u < RMS_PER_THREAD; u++) {
        const int i = threadIdx.x + u * blockDim.x;
        v[u] = i < dim ? xr[i] : 0.0f;
    }
    double ss = 0.0;
#pragma unroll
    for (int u = 0; u < RMS_PER_THREAD; u++)
        ss += (double)v[u] * v[u];
    for (int i = threadIdx.x + held; i < dim; i += blockDim.x)
        ss += (double)xr[i] * xr[i];
    ss = block_sum_d(ss, red);
    const float s = (float)(1.0 / sqrt(ss / dim + (double)eps));
#pragma unroll
    for (int u = 0; u < RMS_PER_THREAD; u++) {
        const int i = threadIdx.x + u * blockDim.x;
        if (i < dim)
            o[i] = v[u] * s * w[i];
    }
    for (int i = threadIdx.x + held; i < dim; i += blockDim.x)
        o[i] = xr[i] * s * w[i];
}

/* rmsnorm_kernel's threads for rows of dim: enough warps that each thread holds at most
 * RMS_PER_THREAD elements (a prefill's many rows then keep more blocks per SM), up to
 * RMS_THREADS. */
static int rms_threads(int dim)
{
    int64_t t = ((int64_t)dim + RMS_PER_THREAD - 1) / RMS_PER_THREAD;
    t = (t + 31) / 32 * 32;
    return (int)(t < 32 ? 32 : t > RMS_THREADS ? RMS_THREADS : t);
}

static int cuda_rmsnorm(struct skv_backend *be, float *out, const float *x, const float *w, int n,
                        int dim, float eps)
{
    prof_scope prof_(be, P_RMSNORM, n);
    if (n < 0 || dim <= 0 || !(eps >= 0.0f))
        return skv_errorf(SKV_E_INVAL, "rmsnorm: bad shape n=%d dim=%d eps=%g", n, dim,
                          (double)eps);
    if (n == 0)
        return SKV_OK;
    if (!out || !x || !w)
        return skv_errorf(SKV_E_INVAL, "rmsnorm: NULL buffer");
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    rmsnorm_kernel<<<(unsigned)n, rms_threads(dim), 0, impl->stream>>>(out, x, w, dim, eps);
    SKV_CUDA_CHECK(cudaGetLastError());
    return SKV_OK;
}

/* One thread per (token, head, rotated pair): the angle and its cos / sin in double, the
 * rotation in float, as the CPU does. The heads of a token recompute their shared angle: a
 * thread per (token, pair) that rotated every head in turn waited a load and a store per
 * head, 11 us for one token's 32 heads on the H200 (ncu, 725344a). */
__global__ void rope_kernel(float *x, const int32_t *pos, const double *inv_freq, int n,
                            int n_heads, int head_dim, int half, int neox, double freq_scale)
{
    const int64_t total = (int64_t)n * n_heads * half;
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < total;
         k += (int64_t)gridDim.x * blockDim.x) {
        const int64_t th = k / half; /* token * n_heads + head */
        const int j = (int)(k % half);
        const double ang = (double)pos[th / n_heads] * freq_scale * inv_freq[j];
        double sd, cd;
        sincos(ang, &sd, &cd);
        const float c = (float)cd, s = (float)sd;
        const int i0 = neox ? j : 2 * j, i1 = neox ? j + half : 2 * j + 1;
        float *xh = x + th * (int64_t)head_dim;
        const float v0 = xh[i0], v1 = xh[i1];
        xh[i0] = v0 * c - v1 * s;
        xh[i1] = v0 * s + v1 * c;
    }
}



/* Makes impl->rope_freq hold inv_freq[0, half) and, for host positions pos (NULL: the caller
 * has them on the device), impl->rope_pos hold pos[0, n), uploading only what differs from
 * the last upload: the q and k of every layer of a decode step share both. A later upload
 * into the same buffers is stream-ordered after the kernels that read them. */
static int rope_tables(struct cuda_impl *impl, const double *inv_freq, int half, const int32_t *pos, int n)
{
    if (!impl->rope_freq)
        SKV_CUDA_CHECK(cudaMalloc((void **)&impl->rope_freq, sizeof impl->rope_freq_host));
    if (half != impl->rope_half || memcmp(inv_freq, impl->rope_freq_host, (size_t)half * sizeof(double))) {
        memcpy(impl->rope_freq_host, inv_freq, (size_t)half * sizeof(double));
        impl->rope_half = 0; /* until the copy is queued */
        int rc = upload_table(impl, impl->rope_freq, inv_freq, (size_t)half * sizeof(double));
        if (rc < 0)
            return rc;
        impl->rope_half = half;
    }
    if (!pos)
        return SKV_OK;
    if (n > impl->rope_pos_cap) {
        int cap = impl->rope_pos_cap > 0 ? impl->rope_pos_cap : 256;
        while (cap < n)
            cap *= 2;
        int32_t *host = (int32_t *)realloc(impl->rope_pos_host, (size_t)cap * sizeof(int32_t));
        if (!host)
            return skv_errorf(SKV_E_NOMEM, "rope: %d positions", n);
        impl->rope_pos_host = host;
        impl->rope_pos_n = 0;
        if (impl->rope_pos)
            SKV_CUDA_CHECK(cudaFree(impl->rope_pos)); /* waits for the kernels reading it */
        impl->rope_pos = NULL;
        impl->rope_pos_cap = 0;
        SKV_CUDA_CHECK(cudaMalloc((void **)&impl->rope_pos, (size_t)cap * sizeof(int32_t)));
        impl->rope_pos_cap = cap;
    }
    if (n != impl->rope_pos_n || memcmp(pos, impl->rope_pos_host, (size_t)n * sizeof(int32_t))) {
        memcpy(impl->rope_pos_host, pos, (size_t)n * sizeof(int32_t));
        impl->rope_pos_n = 0;
        int rc = upload_table(impl, impl->rope_pos, pos, (size_t)n * sizeof(int32_t));
        if (rc < 0)
            return rc;
        impl->rope_pos_n = n;
    }
    return SKV_OK;
}

static int cuda_rope(struct skv_backend *be, float *x, int n, int n_heads, int head_dim,
                     const int32_t *pos, const struct skv_rope *rope)
{
    prof_scope prof_(be, P_ROPE, n);
    if (n < 0 || n_heads <= 0 || head_dim <= 0 || !rope)
        return skv_errorf(SKV_E_INVAL, "rope: bad shape n=%d heads=%d head_dim=%d", n, n_heads,
                          head_dim);
    int rc = skv_rope_check(rope, head_dim);
    if (rc < 0)
        return rc;
    if (n == 0)
        return SKV_OK;
    if (!x || !pos)
        return skv_errorf(SKV_E_INVAL, "rope: NULL buffer");
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    const int half = rope->rot_dim / 2;
    double inv_freq[SKV_ROPE_MAX_DIM / 2];
    skv_rope_inv_freq(rope, half, inv_freq);

    const bool pos_dev = is_device_ptr(pos);
    if ((rc = rope_tables(impl, inv_freq, half, pos_dev ? NULL : pos, n)) < 0)
        return rc;
    const int32_t *dpos = pos_dev ? pos : impl->rope_pos;
    rope_kernel<<<grid_for((int64_t)n * n_heads * half, EW_THREADS), EW_THREADS, 0, impl->stream>>>(
        x, dpos, impl->rope_freq, n, n_heads, head_dim, half, rope->mode == SKV_ROPE_NEOX,
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
    prof_scope prof_(be, P_SWIGLU, -1);
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
    prof_scope prof_(be, P_ADD, -1);
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

enum { KVT_F32, KVT_F16, KVT_Q8_0 }; /* att_params.kvt */

/* The KV view as a kernel argument (about 1.8 KB, under the parameter limit). A paged view's
 * block tables are host memory: each call copies them into device scratch (att_stage, one
 * copy with the window bounds), a few KB per layer, and blk[g] points there. */
struct att_params {
    const char *k[SKV_MAX_KV_HEADS];
    const char *v[SKV_MAX_KV_HEADS];
    const char *const *blk[SKV_MAX_KV_HEADS]; /* device [blocks of head g]; block_rows > 0 */
    int block_rows;                           /* 0: contiguous k / v */
    int kvt;                                  /* the rows' type: KVT_F32, KVT_F16 or KVT_Q8_0 */
    int row_bytes;                            /* of one K or V row of d elements */
    int prefix[SKV_MAX_KV_HEADS];
    int n, n_heads, group, d;
    float scale;
    const int32_t *first; /* device [n_kv][n]: sliding window's first row per query; NULL: 0 */
};

static void att_params_fill(struct att_params *p, const struct skv_kv_view *kv, int n,
                            int n_heads)
{
    for (int g = 0; g < kv->n_kv_heads; g++) {
        p->k[g] = (const char *)kv->k[g];
        p->v[g] = (const char *)kv->v[g];
        p->prefix[g] = kv->prefix_len[g];
    }
    p->n = n;
    p->n_heads = n_heads;
    p->group = n_heads / kv->n_kv_heads;
    p->d = kv->head_dim;
    p->scale = 1.0f / sqrtf((float)kv->head_dim);
    p->first = NULL;
    p->block_rows = kv->block_rows > 0 ? kv->block_rows : 0;
    p->kvt = kv->kv_type == SKV_DTYPE_F16 ? KVT_F16 : kv->kv_type == SKV_DTYPE_Q8_0 ? KVT_Q8_0 : KVT_F32;
    p->row_bytes = (int)skv_kv_row_bytes(kv->kv_type, kv->head_dim);
    for (int g = 0; g < SKV_MAX_KV_HEADS; g++)
        p->blk[g] = NULL;
}

/* Blocks of head g a paged view's call reads (its prefix and the n new rows). */
static size_t view_blocks(const struct skv_kv_view *kv, int g, int n)
{
    return ((size_t)kv->prefix_len[g] + n + kv->block_rows - 1) / kv->block_rows;
}

/* Bytes of a paged view's block tables on the device: 0 for a contiguous view. */
static size_t tables_bytes(const struct skv_kv_view *kv, int n)
{
    if (kv->block_rows <= 0)
        return 0;
    size_t count = 0;
    for (int g = 0; g < kv->n_kv_heads; g++)
        count += view_blocks(kv, g, n);
    return align_up(count * sizeof(void *));
}

/* Row j of KV head g: K (which == 0) or V, in either layout, as p.row_bytes bytes of its type
 * (skv_kv_view_row_raw's twin). */
__device__ __forceinline__ const char *kv_row(const struct att_params &p, int g, int which,
                                              int j)
{
    const size_t row = (size_t)p.row_bytes;
    if (p.block_rows <= 0)
        return (which ? p.v[g] : p.k[g]) + (size_t)j * row;
    const int t = p.block_rows;
    return p.blk[g][j / t] + ((size_t)which * t + j % t) * row;
}

/* Element t of a row kv_row() gave, as f32 (an f16 row's widened exactly; a q8_0 row's value is
 * d * q, the one product skv_dequantize_row computes too). */
__device__ __forceinline__ float kv_at(const struct att_params &p, const char *row, int t)
{
    if (p.kvt == KVT_Q8_0) {
        const char *b = row + (t >> 5) * 34;
        return __fmul_rn(__half2float(*(const __half *)b), (float)((const signed char *)b)[2 + (t & 31)]);
    }
    return p.kvt == KVT_F16 ? __half2float(((const __half *)row)[t]) : ((const float *)row)[t];
}

/* Address bits that must be 0 for kv_at4 (4 elements): 16 bytes (f32), 8 (f16), 2 (q8_0: two
 * 2-byte loads inside one block of 32 values). */
__device__ __forceinline__ uintptr_t kv_align4(const struct att_params &p)
{
    return p.kvt == KVT_F32 ? 15 : p.kvt == KVT_F16 ? 7 : 1;
}

/* Elements e .. e + 3 (e a multiple of 4) of such a row, aligned as kv_align4 asks. */
__device__ __forceinline__ float4 kv_at4(const struct att_params &p, const char *row, int e)
{
    if (p.kvt == KVT_F32)
        return *(const float4 *)((const float *)row + e);
    if (p.kvt == KVT_Q8_0) {
        const char *b = row + (e >> 5) * 34;
        const float d = __half2float(*(const __half *)b);
        const unsigned short *w = (const unsigned short *)(b + 2 + (e & 31));
        const unsigned short lo = w[0], hi = w[1];
        float4 r;
        r.x = __fmul_rn(d, (float)(signed char)(lo & 0xff));
        r.y = __fmul_rn(d, (float)(signed char)(lo >> 8));
        r.z = __fmul_rn(d, (float)(signed char)(hi & 0xff));
        r.w = __fmul_rn(d, (float)(signed char)(hi >> 8));
        return r;
    }
    const uint2 u = *(const uint2 *)((const __half *)row + e); /* one 8-byte load */
    const float2 a = __half22float2(*(const __half2 *)&u.x), b = __half22float2(*(const __half2 *)&u.y);
    float4 r;
    r.x = a.x;
    r.y = a.y;
    r.z = b.x;
    r.w = b.y;
    return r;
}

/* Bytes of the window bounds on the device: 0 without a sliding window. */
static size_t first_bytes(const struct skv_kv_view *kv, int n)
{
    return kv->window > 0 ? align_up((size_t)kv->n_kv_heads * n * sizeof(int32_t)) : 0;
}

/* Bytes att_stage() writes: the window bounds, then the block tables; 0 for a contiguous
 * view without a window (nothing is uploaded then). */
static size_t stage_bytes(const struct skv_kv_view *kv, int n)
{
    return first_bytes(kv, n) + tables_bytes(kv, n);
}

/* Writes to host what the kernels need besides the view's pointers (stage_bytes() of it), to
 * be uploaded to dst (device) in one copy: with a sliding window the first row each (KV head,
 * query) sees (skv_kv_view_first, from the host positions), p->first then pointing there; for
 * a paged view every head's block table, p->blk[] then pointing there. */
static void att_stage_fill(const struct skv_kv_view *kv, int n, void *host, void *dst, struct att_params *p)
{
    const size_t fb = first_bytes(kv, n);
    if (fb > 0) {
        int32_t *first = (int32_t *)host;
        for (int g = 0; g < kv->n_kv_heads; g++)
            for (int i = 0; i < n; i++)
                first[(size_t)g * n + i] = skv_kv_view_first(kv, g, i);
        p->first = (const int32_t *)dst;
    }
    if (kv->block_rows > 0) {
        void **ht = (void **)((char *)host + fb);
        const char **dt = (const char **)((char *)dst + fb);
        for (int g = 0; g < kv->n_kv_heads; g++) {
            const size_t nb = view_blocks(kv, g, n);
            memcpy(ht, kv->blocks[g], nb * sizeof(void *));
            p->blk[g] = dt;
            ht += nb;
            dt += nb;
        }
    }
}

/* att_stage_fill through the reused host staging buffer (no allocation per call), uploaded
 * to dst (device, stage_bytes() long) in stream order. */
static int att_stage(struct cuda_impl *impl, const struct skv_kv_view *kv, int n, void *dst,
                     struct att_params *p)
{
    const size_t total = stage_bytes(kv, n);
    if (total == 0)
        return SKV_OK;
    void *host = NULL;
    int rc = stage_get(impl, total, &host);
    if (rc < 0)
        return rc;
    att_stage_fill(kv, n, host, dst, p);
    return upload_table(impl, dst, host, total);
}

/* Scores of keys j0 .. j0+tn-1 of KV head g against the query in shared memory: one warp
 * per key, lanes over the head dimension. */
__device__ __forceinline__ void att_scores(float *sc, const float *qs, const struct att_params &p,
                                           int g, int j0, int tn, int d, float scale)
{
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    for (int jj = warp; jj < tn; jj += nw) {
        const char *kr = kv_row(p, g, 0, j0 + jj);
        float s = 0.0f;
        for (int t = lane; t < d; t += 32)
            s = fmaf(qs[t], kv_at(p, kr, t), s);
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
                a += (double)sc[jj] * kv_at(p, kv_row(p, g, 1, j0 + jj), t);
            acc[t] = a;
        }
        __syncthreads();
    }
    float *o = out + ((size_t)i * p.n_heads + h) * d;
    const double inv = 1.0 / s_l;
    for (int t = threadIdx.x; t < d; t += blockDim.x)
        o[t] = (float)(acc[t] * inv);
}

/* Shared memory of att_decode_kernel for rb rows of head_dim d: the queries, a tile of K rows
 * padded to d + 1 floats (lanes read different keys' same element without bank conflicts) and
 * a tile of V rows. */
static size_t decode_smem(int rb, int d)
{
    return ((size_t)rb * d + (size_t)ATT_TK * (d + 1) + (size_t)ATT_TK * d) * sizeof(float);
}

/* Split-K decode attention (n <= ATT_SPLIT_MAX_N queries). Block (g * slices + slice) *
 * nchunks + chunk holds rb of KV head g's n x group (query, head) rows, ATT_DEC_RPW per warp,
 * over the keys of one chunk. Each tile of ATT_TK keys is loaded once into shared memory for
 * all the rows; lane j of a warp scores key j of the tile against each of the warp's rows (a
 * whole dot product per lane, no shuffles), the row's online softmax takes one warp max and
 * one warp sum per tile, and each lane accumulates its d / 32 output elements from the V tile.
 * Writes part[row][chunk] = (max, sum, acc[d]) for att_combine_kernel. */
/* probs (one query, p.n = 1; NULL: none): each visible key's scaled score goes to
 * probs[h * pstride + j] for query head h, for att_combine_batch_kernel to finish. */
__device__ __forceinline__ void att_decode_block(float *dsm, float *part, const float *q, const struct att_params &p,
                                                 int rb, int slices, int chunk, int nchunks, int bid,
                                                 float *probs = NULL, int64_t pstride = 0)
{
    const int d = p.d, dp = d + 1, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    float *qs = dsm;                     /* [rb][d] */
    float *kt = qs + (size_t)rb * d;     /* [ATT_TK][d + 1] */
    float *vt = kt + (size_t)ATT_TK * dp; /* [ATT_TK][d] */
    const int gs = bid / nchunks, c = bid % nchunks;
    const int g = gs / slices, r0 = (gs % slices) * rb, rows = p.n * p.group;
    for (int k = tid; k < rb * d; k += blockDim.x) {
        const int rg = r0 + k / d;
        qs[k] = rg < rows ? q[((size_t)(rg / p.group) * p.n_heads + g * p.group + rg % p.group) * d + k % d] : 0.0f;
    }
    /* the warp's rows: r = warp + ATT_DEC_WARPS * u */
    float m[ATT_DEC_RPW], l[ATT_DEC_RPW], acc[ATT_DEC_RPW][ATT_MAX_D / 32];
    int lo[ATT_DEC_RPW], hi[ATT_DEC_RPW];
#pragma unroll
    for (int u = 0; u < ATT_DEC_RPW; u++) {
        const int r = warp + ATT_DEC_WARPS * u, rg = r0 + r;
        const bool valid = r < rb && rg < rows;
        const int i = rg / p.group;
        lo[u] = valid && p.first ? p.first[(size_t)g * p.n + i] : 0;
        hi[u] = valid ? p.prefix[g] + i + 1 : 0;
        m[u] = -INFINITY;
        l[u] = 0.0f;
#pragma unroll
        for (int e = 0; e < ATT_MAX_D / 32; e++)
            acc[u][e] = 0.0f;
    }
    const int64_t c0 = (int64_t)c * chunk;
    const int ks = (int)c0, ke_all = p.prefix[g] + p.n;
    const int ke = c0 + chunk < ke_all ? (int)(c0 + chunk) : ke_all;
    for (int j0 = ks; j0 < ke; j0 += ATT_TK) {
        const int tn = ke - j0 < ATT_TK ? ke - j0 : ATT_TK;
        __syncthreads(); /* the last tile is consumed (and, the first time, qs written) */
        /* warp w loads rows w, w + ATT_DEC_WARPS, ... of the tile, ATT_DEC_LROWS at a time: a
         * row's two addresses once, its elements by the lanes, 16 bytes a load where the row
         * allows, every load of the batch in flight before any is stored. (Element by element,
         * each with its row's block looked up again, the H200 took 58 us per layer of the 8B
         * shape at 1K context: ncu, 725344a.) */
        for (int b0 = 0; b0 < ATT_TK / ATT_DEC_WARPS; b0 += ATT_DEC_LROWS) {
            float4 kr[ATT_DEC_LROWS][ATT_MAX_D / 128], vr[ATT_DEC_LROWS][ATT_MAX_D / 128];
            const char *kp[ATT_DEC_LROWS], *vp[ATT_DEC_LROWS];
            bool vec[ATT_DEC_LROWS];
#pragma unroll
            for (int u = 0; u < ATT_DEC_LROWS; u++) {
                const int r = warp + (b0 + u) * ATT_DEC_WARPS;
                kp[u] = vp[u] = NULL;
                vec[u] = false;
                if (r >= tn)
                    continue;
                kp[u] = kv_row(p, g, 0, j0 + r);
                vp[u] = kv_row(p, g, 1, j0 + r);
                const uintptr_t al = kv_align4(p); /* 4 elements: 16, 8 or 2 bytes */
                vec[u] = (d & 3) == 0 && ((uintptr_t)kp[u] & al) == 0 && ((uintptr_t)vp[u] & al) == 0;
                if (!vec[u])
                    continue;
#pragma unroll
                for (int s4 = 0; s4 < ATT_MAX_D / 128; s4++) {
                    const int e = 4 * lane + 128 * s4;
                    if (e < d) {
                        kr[u][s4] = kv_at4(p, kp[u], e);
                        vr[u][s4] = kv_at4(p, vp[u], e);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < ATT_DEC_LROWS; u++) {
                const int r = warp + (b0 + u) * ATT_DEC_WARPS;
                if (r >= tn)
                    continue;
                float *kd = kt + (size_t)r * dp, *vd = vt + (size_t)r * d;
                if (!vec[u]) {
                    for (int e = lane; e < d; e += 32) {
                        kd[e] = kv_at(p, kp[u], e);
                        vd[e] = kv_at(p, vp[u], e);
                    }
                    continue;
                }
#pragma unroll
                for (int s4 = 0; s4 < ATT_MAX_D / 128; s4++) {
                    const int e = 4 * lane + 128 * s4;
                    if (e < d) {
                        kd[e] = kr[u][s4].x;
                        kd[e + 1] = kr[u][s4].y;
                        kd[e + 2] = kr[u][s4].z;
                        kd[e + 3] = kr[u][s4].w;
                        *(float4 *)(vd + e) = vr[u][s4];
                    }
                }
            }
        }
        __syncthreads();
        const int j = j0 + lane;
#pragma unroll
        for (int u = 0; u < ATT_DEC_RPW; u++) {
            const int r = warp + ATT_DEC_WARPS * u;
            if (r >= rb || hi[u] == 0) /* the same for the whole warp */
                continue;
            const bool vis = lane < tn && j >= lo[u] && j < hi[u];
            float sc = -INFINITY;
            if (vis) {
                const float *qr = qs + (size_t)r * d, *kr = kt + (size_t)lane * dp;
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
                int e = 0;
                for (; e + 4 <= d; e += 4) {
                    s0 = fmaf(qr[e], kr[e], s0);
                    s1 = fmaf(qr[e + 1], kr[e + 1], s1);
                    s2 = fmaf(qr[e + 2], kr[e + 2], s2);
                    s3 = fmaf(qr[e + 3], kr[e + 3], s3);
                }
                for (; e < d; e++)
                    s0 = fmaf(qr[e], kr[e], s0);
                sc = ((s0 + s1) + (s2 + s3)) * p.scale;
                if (probs) /* (n = 1: row r0 + r is head g * group + its index in the group) */
                    probs[(size_t)(g * p.group + r0 + r) * pstride + j] = sc;
            }
            const float m_new = fmaxf(m[u], warp_max(sc));
            if (m_new == -INFINITY) /* nothing visible yet */
                continue;
            const float pe = vis ? expf(sc - m_new) : 0.0f;
            const float a = expf(m[u] - m_new); /* 0 while m[u] is -inf */
            l[u] = l[u] * a + warp_sum(pe);
            m[u] = m_new;
#pragma unroll
            for (int e = 0; e < ATT_MAX_D / 32; e++)
                acc[u][e] *= a;
            for (int jj = 0; jj < tn; jj++) {
                const float pj = __shfl_sync(0xffffffffu, pe, jj);
#pragma unroll
                for (int e = 0; e < ATT_MAX_D / 32; e++)
                    if (lane + 32 * e < d)
                        acc[u][e] = fmaf(pj, vt[jj * d + lane + 32 * e], acc[u][e]);
            }
        }
    }
#pragma unroll
    for (int u = 0; u < ATT_DEC_RPW; u++) {
        const int r = warp + ATT_DEC_WARPS * u, rg = r0 + r;
        if (r >= rb || rg >= rows)
            continue;
        const size_t row = (size_t)(rg / p.group) * p.n_heads + g * p.group + rg % p.group;
        float *pp = part + (row * nchunks + c) * (d + 2);
        if (lane == 0) {
            pp[0] = m[u];
            pp[1] = l[u];
        }
#pragma unroll
        for (int e = 0; e < ATT_MAX_D / 32; e++)
            if (lane + 32 * e < d)
                pp[2 + lane + 32 * e] = acc[u][e];
    }
}

__global__ void __launch_bounds__(ATT_DEC_WARPS * 32)
att_decode_kernel(float *part, const float *q, struct att_params p, int rb, int slices, int chunk, int nchunks)
{
    extern __shared__ float4 dsm4[]; /* 16-byte aligned: the V tile takes float4 stores */
    att_decode_block((float *)dsm4, part, q, p, rb, slices, chunk, nchunks, blockIdx.x);
}

/* One sequence of a batched decode call (cuda_attention_batch) as the device reads it: its
 * view's parameters, its first block in the joint grid, its key chunks, and where its
 * partials start (floats from the call's partials). */
struct att_seq {
    struct att_params p;
    int block0, chunk, nchunks;
    size_t part0;
    float *probs;                /* attention_batch_probs: [n_heads][pstride] (NULL: none) */
    int64_t pstride;
};

/* The sequence whose blocks hold block b: the last with block0 <= b (block0 ascending). */
__device__ __forceinline__ int att_seq_of(const struct att_seq *seqs, int n_seq, int b)
{
    int lo = 0, hi = n_seq - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (seqs[mid].block0 <= b)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* att_decode_kernel for n_seq sequences of one query each in one grid: each block runs as
 * block (b - block0) of its own sequence's att_decode_kernel, so every sequence gets what its
 * own call gives. Sequence s's query is at q + s * qstride floats. */
__global__ void __launch_bounds__(ATT_DEC_WARPS * 32)
att_decode_batch_kernel(float *part, const float *q, const struct att_seq *seqs, int n_seq, int rb, int slices,
                        int qstride)
{
    extern __shared__ float4 dsm4[];
    const int s = att_seq_of(seqs, n_seq, (int)blockIdx.x);
    const struct att_seq &sq = seqs[s];
    att_decode_block((float *)dsm4, part + sq.part0, q + (size_t)s * qstride, sq.p, rb, slices, sq.chunk, sq.nchunks,
                     (int)blockIdx.x - sq.block0, sq.probs, sq.pstride);
}

/* Merges the nchunks split-K partials at base (each (max, sum, acc[d])) into out[d], in chunk
 * order: weights exp(m_c - max), chunks that saw no key (m_c = -inf) skipped. w: shared
 * [nchunks]. The row's max and sum go to *m_out and *l_out (NULL: not wanted). */
__device__ __forceinline__ void att_combine_row(float *out, const float *base, int nchunks, int d, float *w,
                                                float *m_out = NULL, float *l_out = NULL)
{
    __shared__ float s_l, s_m;
    if (threadIdx.x == 0) {
        float mx = -INFINITY;
        for (int c = 0; c < nchunks; c++)
            mx = fmaxf(mx, base[(size_t)c * (d + 2)]);
        float sum = 0.0f;
        for (int c = 0; c < nchunks; c++) {
            const float mc = base[(size_t)c * (d + 2)];
            w[c] = mc == -INFINITY ? 0.0f : expf(mc - mx);
            sum = fmaf(base[(size_t)c * (d + 2) + 1], w[c], sum);
        }
        s_l = sum;
        s_m = mx;
    }
    __syncthreads();
    const float inv = 1.0f / s_l;
    if (m_out) {
        *m_out = s_m;
        *l_out = s_l;
    }
    for (int t = threadIdx.x; t < d; t += blockDim.x) {
        float o = 0.0f;
        for (int c = 0; c < nchunks; c++)
            if (w[c] != 0.0f)
                o = fmaf(base[(size_t)c * (d + 2) + 2 + t], w[c], o);
        out[t] = o * inv;
    }
}

/* Query row blockIdx.x (query i, head h at i * n_heads + h) from its split-K partials. */
__global__ void att_combine_kernel(float *out, const float *part, int nchunks, int d)
{
    extern __shared__ float w[]; /* [nchunks] */
    att_combine_row(out + (size_t)blockIdx.x * d, part + (size_t)blockIdx.x * nchunks * (d + 2), nchunks, d, w);
}

/* att_combine_kernel for a batched call: block s * n_heads + h merges head h of sequence s. */
__global__ void att_combine_batch_kernel(float *out, const float *part, const struct att_seq *seqs, int n_heads,
                                         int d)
{
    extern __shared__ float w[]; /* [the largest nchunks] */
    const int s = (int)blockIdx.x / n_heads, h = (int)blockIdx.x % n_heads;
    const struct att_seq &sq = seqs[s];
    float mx, l;
    att_combine_row(out + (size_t)blockIdx.x * d, part + sq.part0 + (size_t)h * sq.nchunks * (d + 2), sq.nchunks, d,
                    w, &mx, &l);
    if (!sq.probs)
        return;
    /* the head's scores (att_decode_block) become probabilities, the rows before its window 0 */
    float *pr = sq.probs + (size_t)h * sq.pstride;
    const int g = h / sq.p.group, len = sq.p.prefix[g] + 1, lo = sq.p.first ? sq.p.first[(size_t)g * sq.p.n] : 0;
    const float inv = 1.0f / l;
    for (int j = threadIdx.x; j < len; j += blockDim.x)
        pr[j] = j < lo ? 0.0f : expf(pr[j] - mx) * inv;
}



/* K and V rows [0, rows) of KV head g of a paged view into contiguous [rows][d] copies. */
__global__ void att_gather_kernel(float *kd, float *vd, struct att_params p, int g, int rows)
{
    const int64_t total = (int64_t)rows * p.d;
    for (int64_t x = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; x < total;
         x += (int64_t)gridDim.x * blockDim.x) {
        const int j = (int)(x / p.d), t = (int)(x % p.d);
        kd[x] = kv_at(p, kv_row(p, g, 0, j), t);
        vd[x] = kv_at(p, kv_row(p, g, 1, j), t);
    }
}

/* Row r = hh * m + i of the scores s ([group][m][lk], scaled dot products of query i0 + i,
 * query head g * group + hh, with keys [0, lk) of KV head g) becomes its softmax over the keys
 * that query sees, [first, prefix + i0 + i + 1), and 0 at every other key. */
__global__ void att_softmax_rows_kernel(float *s, int lk, int m, int i0, int g, struct att_params p)
{
    __shared__ float red[33];
    __shared__ double redd[33];
    const int i = (int)(blockIdx.x % m);
    float *row = s + (size_t)blockIdx.x * lk;
    const int hi = p.prefix[g] + i0 + i + 1;
    const int lo = p.first ? p.first[(size_t)g * p.n + i0 + i] : 0;
    float mx = -INFINITY;
    for (int j = lo + threadIdx.x; j < hi; j += blockDim.x)
        mx = fmaxf(mx, row[j]);
    mx = block_reduce<true>(mx, red);
    double sum = 0.0;
    if (mx != -INFINITY)
        for (int j = lo + threadIdx.x; j < hi; j += blockDim.x)
            sum += (double)expf(row[j] - mx);
    sum = block_sum_d(sum, redd);
    const float inv = sum > 0.0 ? (float)(1.0 / sum) : 0.0f;
    for (int j = threadIdx.x; j < lk; j += blockDim.x)
        row[j] = j >= lo && j < hi && inv > 0.0f ? expf(row[j] - mx) * inv : 0.0f;
}

/* out[hh][j] += sum over the m rows of batch hh of p ([group][m][lk], probabilities), for the
 * group's query heads hh (rows out_stride floats apart) and keys j < lk. */
__global__ void att_colsum_add_kernel(float *out, int64_t out_stride, const float *p, int lk, int m, int group)
{
    const int64_t total = (int64_t)group * lk;
    for (int64_t x = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; x < total;
         x += (int64_t)gridDim.x * blockDim.x) {
        const int hh = (int)(x / lk), j = (int)(x % lk);
        const float *col = p + (size_t)hh * m * lk + j;
        double sum = 0.0;
        for (int i = 0; i < m; i++)
            sum += col[(size_t)i * lk];
        out[(size_t)hh * out_stride + j] += (float)sum;
    }
}

/* Prefill attention (n > ATT_SPLIT_MAX_N queries) as two cuBLAS fp32 GEMMs per KV head and
 * batch of queries: S = scale * Q K^T for the group's query heads (one strided batch, K shared),
 * a masked softmax over each row of S, then out = P V. A paged view's rows, and f16 rows, are
 * first gathered into contiguous f32 K and V. Queries go in batches of m whose scores fit ATT_GEMM_S_BYTES; a
 * batch's keys end at its last query's causal end, so the masked work is at most m x m / 2 per
 * head. (The flash-style kernel this replaced, with warp-wide dot products per key and query,
 * ran a 32K-token prefill of an 8B-shaped model at 2.8 TFLOP/s.) With out_stride > 0 it is
 * attention_colsum instead: queries q_first..n-1 only, and each batch's probabilities summed
 * per key into out[h][j] (rows out_stride apart, zeroed first) in place of the P V product.
 * Returns 1 without doing anything when its scratch would pass ATT_GEMM_MAX_BYTES: the
 * per-query kernels then serve the call. */
static int att_gemm_rows(struct cuda_impl *impl, float *out, int64_t out_stride, const float *q, int n,
                         int n_heads, const struct skv_kv_view *kv, struct att_params *p, size_t sb,
                         int q_first)
{
    const int d = p->d, group = p->group, w = n - q_first;
    const bool colsum = out_stride > 0;
    int lmax = 0;
    for (int g = 0; g < kv->n_kv_heads; g++)
        lmax = p->prefix[g] + n > lmax ? p->prefix[g] + n : lmax;
    const bool paged = p->block_rows > 0 || p->kvt != KVT_F32; /* f16 / q8_0 rows: gathered (widened) too */
    const size_t kv_bytes = paged ? align_up((size_t)lmax * d * sizeof(float)) : 0;
    int64_t mq = (int64_t)(ATT_GEMM_S_BYTES / ((size_t)group * lmax * sizeof(float)));
    mq = mq < 1 ? 1 : mq > w ? w : mq;
    const size_t s_bytes = (size_t)group * mq * lmax * sizeof(float);
    if (2 * kv_bytes + s_bytes > ATT_GEMM_MAX_BYTES)
        return 1;
    void *s = NULL;
    int rc = scratch_get(impl, align_up(sb) + 2 * kv_bytes + s_bytes, &s);
    if (rc < 0 || (rc = att_stage(impl, kv, n, s, p)) < 0)
        return rc;
    float *kd = (float *)((char *)s + align_up(sb));
    float *vd = (float *)((char *)kd + kv_bytes);
    float *sc = (float *)((char *)vd + kv_bytes);
    const float zero = 0.0f, one = 1.0f;
    const int ldq = n_heads * d;
    for (int g = 0; g < kv->n_kv_heads; g++) {
        const int rows = p->prefix[g] + n;
        const float *kg = (const float *)p->k[g], *vg = (const float *)p->v[g];
        if (paged) {
            att_gather_kernel<<<grid_for((int64_t)rows * d, EW_THREADS), EW_THREADS, 0, impl->stream>>>(
                kd, vd, *p, g, rows);
            SKV_CUDA_CHECK(cudaGetLastError());
            kg = kd;
            vg = vd;
        }
        if (colsum)
            SKV_CUDA_CHECK(cudaMemset2DAsync(out + (size_t)g * group * out_stride, (size_t)out_stride * sizeof(float),
                                             0, (size_t)rows * sizeof(float), (size_t)group, impl->stream));
        for (int i0 = q_first; i0 < n; i0 += (int)mq) {
            const int m = n - i0 < mq ? n - i0 : (int)mq;
            const int lk = p->prefix[g] + i0 + m;
            const size_t at = ((size_t)i0 * n_heads + (size_t)g * group) * d;
            SKV_CUBLAS_CHECK(cublasSgemmStridedBatched(impl->blas, CUBLAS_OP_T, CUBLAS_OP_N, lk, m, d, &p->scale,
                                                       kg, d, 0, q + at, ldq, d, &zero, sc, lk,
                                                       (long long)lk * m, group));
            att_softmax_rows_kernel<<<(unsigned)(group * m), ATT_THREADS, 0, impl->stream>>>(sc, lk, m, i0, g, *p);
            SKV_CUDA_CHECK(cudaGetLastError());
            if (colsum) {
                att_colsum_add_kernel<<<grid_for((int64_t)group * lk, EW_THREADS), EW_THREADS, 0, impl->stream>>>(
                    out + (size_t)g * group * out_stride, out_stride, sc, lk, m, group);
                SKV_CUDA_CHECK(cudaGetLastError());
            } else {
                SKV_CUBLAS_CHECK(cublasSgemmStridedBatched(impl->blas, CUBLAS_OP_N, CUBLAS_OP_N, d, m, lk, &one, vg,
                                                           d, 0, sc, lk, (long long)lk * m, &zero, out + at, ldq, d,
                                                           group));
            }
        }
    }
    return SKV_OK;
}

static int att_gemm(struct cuda_impl *impl, float *out, const float *q, int n, int n_heads,
                    const struct skv_kv_view *kv, struct att_params *p, size_t sb)
{
    return att_gemm_rows(impl, out, 0, q, n, n_heads, kv, p, sb, 0);
}

/* Split-K's key chunks for n queries over kv, per_chunk blocks a chunk: sized from the
 * longest head so that about ATT_DEC_BLOCKS_PER_SM blocks per SM run. A call's chunks depend
 * on its own view only, so a sequence of a batched call (cuda_attention_batch) is cut as its
 * own call would be. */
static void att_split_plan(const struct cuda_impl *impl, const struct skv_kv_view *kv, int n, int64_t per_chunk,
                           int *chunk_out, int *nchunks_out)
{
    int max_keys = 0;
    for (int g = 0; g < kv->n_kv_heads; g++)
        max_keys = kv->prefix_len[g] + n > max_keys ? kv->prefix_len[g] + n : max_keys;
    int64_t want = (ATT_DEC_BLOCKS_PER_SM * (int64_t)impl->sm_count + per_chunk - 1) / per_chunk;
    want = want < 1 ? 1 : (want > ATT_MAX_CHUNKS ? ATT_MAX_CHUNKS : want);
    int64_t chunk = (max_keys + want - 1) / want;
    chunk = (chunk + ATT_TK - 1) / ATT_TK * ATT_TK;
    chunk = chunk < ATT_CHUNK_MIN ? ATT_CHUNK_MIN : chunk;
    *chunk_out = (int)chunk;
    *nchunks_out = (int)((max_keys + chunk - 1) / chunk);
}

/* Which kernel runs:
 *  - n > ATT_SPLIT_MAX_N (prefill, long appends): att_gemm, cuBLAS GEMMs around a masked
 *    softmax;
 *  - n <= ATT_SPLIT_MAX_N (decode, short appends): split-K. att_decode_kernel over (KV head,
 *    slice of its group's n x group (query, head) rows, key chunk), the chunk sized from the
 *    longest head so that about ATT_DEC_BLOCKS_PER_SM blocks per SM run, then
 *    att_combine_kernel per (query, head);
 *  - head_dim > ATT_MAX_D in decode, or a prefill whose GEMM scratch would pass
 *    ATT_GEMM_MAX_BYTES: attention_kernel, one block per (query, head), double accumulators
 *    (the first kernel written; kept as the fallback).
 * The choice depends on shapes (and, for a prefill's scratch, on whether rows are gathered: paged
 * or f16 views) and every path computes the same f32 values, so a paged or f16 view gives the
 * contiguous f32 result. */
static int cuda_attention(struct skv_backend *be, float *out, const float *q, int n, int n_heads,
                          const struct skv_kv_view *kv)
{
    prof_scope prof_(be, P_ATTENTION, n);
    int rc = skv_attention_check("attention", out, q, n, n_heads, kv);
    if (rc < 0)
        return rc;
    if (n == 0)
        return SKV_OK;
    if ((int64_t)n * n_heads > INT_MAX)
        return skv_errorf(SKV_E_INVAL, "attention: %d queries x %d heads", n, n_heads);
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    const int d = kv->head_dim;
    struct att_params p;
    att_params_fill(&p, kv, n, n_heads);
    void *s = NULL;
    const size_t sb = stage_bytes(kv, n);

    if (n > ATT_SPLIT_MAX_N && (rc = att_gemm(impl, out, q, n, n_heads, kv, &p, sb)) <= 0)
        return rc;
    if (d > ATT_MAX_D || n > ATT_SPLIT_MAX_N) {
        const size_t smem = (size_t)d * (sizeof(double) + sizeof(float)) + ATT_TILE * sizeof(float);
        if (smem > 48 * 1024)
            return skv_errorf(SKV_E_UNSUPPORTED, "attention: head_dim %d too large", d);
        if (sb > 0 && ((rc = scratch_get(impl, sb, &s)) < 0 || (rc = att_stage(impl, kv, n, s, &p)) < 0))
            return rc;
        attention_kernel<<<(unsigned)(n * n_heads), ATT_THREADS, smem, impl->stream>>>(out, q, p);
        SKV_CUDA_CHECK(cudaGetLastError());
        return SKV_OK;
    }

    if (!impl->att_smem_set) {
        SKV_CUDA_CHECK(cudaFuncSetAttribute(att_decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)decode_smem(ATT_DEC_WARPS * ATT_DEC_RPW, ATT_MAX_D)));
        impl->att_smem_set = true;
    }
    /* split-K: slices of the group's rows, then chunks of the longest head's keys */
    const int rows = n * p.group, dcap = ATT_DEC_WARPS * ATT_DEC_RPW;
    const int slices = (rows + dcap - 1) / dcap, rb = (rows + slices - 1) / slices;
    const int64_t per_chunk = (int64_t)kv->n_kv_heads * slices;
    int chunk = 0, nchunks = 0;
    att_split_plan(impl, kv, n, per_chunk, &chunk, &nchunks);
    const size_t part_bytes = (size_t)n * n_heads * nchunks * (d + 2) * sizeof(float);
    if ((rc = scratch_get(impl, align_up(sb) + part_bytes, &s)) < 0 ||
        (rc = att_stage(impl, kv, n, s, &p)) < 0)
        return rc;
    float *part = (float *)((char *)s + align_up(sb));
    att_decode_kernel<<<(unsigned)(per_chunk * nchunks), ATT_DEC_WARPS * 32, decode_smem(rb, d), impl->stream>>>(
        part, q, p, rb, slices, chunk, nchunks);
    SKV_CUDA_CHECK(cudaGetLastError());
    att_combine_kernel<<<(unsigned)(n * n_heads), ATT_THREADS, (size_t)nchunks * sizeof(float),
                         impl->stream>>>(out, part, nchunks, d);
    SKV_CUDA_CHECK(cudaGetLastError());
    return SKV_OK;
}

static int cuda_attention_colsum(struct skv_backend *be, float *out, int64_t out_stride, const float *q, int n,
                                 int n_heads, const struct skv_kv_view *kv, int q_first);

/* Decode attention of n_seq sequences, one query each (the op's attention_batch): every
 * sequence is planned as cuda_attention plans n = 1 (the same slices and key chunks), its
 * parameters, window bounds and block tables go up in one copy for all, then one
 * att_decode_batch_kernel grid and one att_combine_batch_kernel grid run every sequence's
 * blocks. Against one call per sequence: one upload and two launches per layer of a decode
 * group instead of n_seq of each. A head_dim past ATT_MAX_D, or one sequence without
 * probabilities, takes cuda_attention once per sequence. With probs (attention_batch_probs),
 * each asking sequence's probabilities: its scores written by the decode grid, finished by the
 * combine grid (past ATT_MAX_D: cuda_attention_colsum). */
static int attention_batch_run(struct skv_backend *be, float *out, const float *q, int n_seq, int n_heads,
                               const struct skv_kv_view *kv, float *const *probs, const int64_t *stride)
{
    int rc = SKV_OK;
    if (n_seq == 0)
        return SKV_OK;
    if ((int64_t)n_seq * n_heads * kv[0].head_dim > INT_MAX)
        return skv_errorf(SKV_E_INVAL, "attention_batch: %d sequences x %d heads x %d", n_seq, n_heads,
                          kv[0].head_dim);
    const int d = kv[0].head_dim, qstride = n_heads * d;
    if ((n_seq == 1 && !probs) || d > ATT_MAX_D) { /* (past ATT_MAX_D: the probabilities by colsum) */
        for (int s = 0; s < n_seq; s++) {
            if ((rc = cuda_attention(be, out + (size_t)s * qstride, q + (size_t)s * qstride, 1, n_heads, &kv[s])) < 0)
                return rc;
            if (probs && probs[s] &&
                (rc = cuda_attention_colsum(be, probs[s], stride[s], q + (size_t)s * qstride, 1, n_heads, &kv[s], 0)) < 0)
                return rc;
        }
        return SKV_OK;
    }
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    if (!impl->att_batch_smem_set) {
        SKV_CUDA_CHECK(cudaFuncSetAttribute(att_decode_batch_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)decode_smem(ATT_DEC_WARPS * ATT_DEC_RPW, ATT_MAX_D)));
        impl->att_batch_smem_set = true;
    }
    const int group = n_heads / kv[0].n_kv_heads, dcap = ATT_DEC_WARPS * ATT_DEC_RPW;
    const int slices = (group + dcap - 1) / dcap, rb = (group + slices - 1) / slices;
    const int64_t per_chunk = (int64_t)kv[0].n_kv_heads * slices;
    /* scratch: every sequence's staged tables, then the sequences (planned into the host
     * staging first), then the partials */
    size_t tables = 0;
    for (int s = 0; s < n_seq; s++)
        tables += stage_bytes(&kv[s], 1);
    const size_t seq_bytes = align_up((size_t)n_seq * sizeof(struct att_seq)), up = tables + seq_bytes;
    void *dev = NULL, *host = NULL;
    if ((rc = stage_get(impl, up, &host)) < 0)
        return rc;
    struct att_seq *seqs = (struct att_seq *)((char *)host + tables);
    size_t parts = 0;
    int64_t blocks = 0;
    int max_chunks = 0;
    for (int s = 0; s < n_seq; s++) {
        struct att_seq *sq = &seqs[s];
        att_split_plan(impl, &kv[s], 1, per_chunk, &sq->chunk, &sq->nchunks);
        sq->block0 = (int)blocks; /* past INT_MAX: refused below, before any use */
        sq->part0 = parts;
        sq->probs = probs ? probs[s] : NULL;
        sq->pstride = probs ? stride[s] : 0;
        blocks += per_chunk * sq->nchunks;
        parts += (size_t)n_heads * sq->nchunks * (d + 2);
        max_chunks = sq->nchunks > max_chunks ? sq->nchunks : max_chunks;
    }
    if (blocks > INT_MAX)
        return skv_errorf(SKV_E_INVAL, "attention_batch: %lld blocks", (long long)blocks);
    if ((rc = scratch_get(impl, up + parts * sizeof(float), &dev)) < 0)
        return rc;
    for (size_t s = 0, at = 0; s < (size_t)n_seq; at += stage_bytes(&kv[s], 1), s++) {
        att_params_fill(&seqs[s].p, &kv[s], 1, n_heads);
        att_stage_fill(&kv[s], 1, (char *)host + at, (char *)dev + at, &seqs[s].p);
    }
    if ((rc = upload_table(impl, dev, host, up)) < 0)
        return rc;
    const struct att_seq *dseqs = (const struct att_seq *)((char *)dev + tables);
    float *part = (float *)((char *)dev + up);
    att_decode_batch_kernel<<<(unsigned)blocks, ATT_DEC_WARPS * 32, decode_smem(rb, d), impl->stream>>>(
        part, q, dseqs, n_seq, rb, slices, qstride);
    SKV_CUDA_CHECK(cudaGetLastError());
    att_combine_batch_kernel<<<(unsigned)(n_seq * n_heads), ATT_THREADS, (size_t)max_chunks * sizeof(float),
                               impl->stream>>>(out, part, dseqs, n_heads, d);
    SKV_CUDA_CHECK(cudaGetLastError());
    return SKV_OK;
}

static int cuda_attention_batch(struct skv_backend *be, float *out, const float *q, int n_seq, int n_heads,
                                const struct skv_kv_view *kv)
{
    prof_scope prof_(be, P_ATT_BATCH, 1);
    int rc = skv_attention_batch_check(out, q, n_seq, n_heads, kv);
    return rc < 0 ? rc : attention_batch_run(be, out, q, n_seq, n_heads, kv, NULL, NULL);
}

static int cuda_attention_batch_probs(struct skv_backend *be, float *out, const float *q, int n_seq, int n_heads,
                                      const struct skv_kv_view *kv, float *const *probs, const int64_t *stride)
{
    prof_scope prof_(be, P_ATT_BATCH, 1);
    int rc = skv_attention_batch_probs_check(out, q, n_seq, n_heads, kv, probs, stride);
    return rc < 0 ? rc : attention_batch_run(be, out, q, n_seq, n_heads, kv, probs, stride);
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
    const char *kr = kv_row(p, g, 0, j);
    int i0 = j - p.prefix[g];
    i0 = i0 > q_first ? i0 : q_first;
    double sum = 0.0;
    for (int i = i0; i < p.n; i++) {
        if (p.first && j < p.first[(size_t)g * p.n + i])
            continue;   /* outside query i's sliding window */
        const float *qi = q + ((size_t)i * p.n_heads + h) * d;
        float s = 0.0f;
        for (int t = 0; t < d; t++)
            s = fmaf(qi[t], kv_at(p, kr, t), s);
        const int si = (i - q_first) * p.n_heads + h;
        sum += (double)expf(s * p.scale - m_in[si]) / l_in[si];
    }
    out[(size_t)h * out_stride + j] = (float)sum;
}

static int cuda_attention_colsum(struct skv_backend *be, float *out, int64_t out_stride,
                                 const float *q, int n, int n_heads,
                                 const struct skv_kv_view *kv, int q_first)
{
    prof_scope prof_(be, P_COLSUM, n);
    if (!be || !out || !q || !kv || n <= 0 || n_heads <= 0 || kv->n_kv_heads <= 0 ||
        kv->n_kv_heads > SKV_MAX_KV_HEADS || n_heads % kv->n_kv_heads || q_first < 0 ||
        q_first >= n || kv->head_dim <= 0)
        return skv_errorf(SKV_E_INVAL, "attention_colsum: bad shape");
    if (skv_kv_row_bytes(kv->kv_type, kv->head_dim) == 0)
        return skv_errorf(SKV_E_UNSUPPORTED, "attention_colsum: kv type %d of head_dim %d (f32, f16, q8_0 of a "
                          "multiple of 32)", kv->kv_type, kv->head_dim);
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
    if ((rc = att_gemm_rows(impl, out, out_stride, q, n, n_heads, kv, &p, stage_bytes(kv, n), q_first)) <= 0)
        return rc;
    /* the fallback: softmax statistics per (query, head), then a thread per key */
    att_params_fill(&p, kv, n, n_heads);
    const int64_t nq = (int64_t)(n - q_first) * n_heads;
    void *s = NULL;
    const size_t m_bytes = align_up((size_t)nq * sizeof(float));
    const size_t l_bytes = align_up((size_t)nq * sizeof(double));
    rc = scratch_get(impl, m_bytes + l_bytes + stage_bytes(kv, n), &s);
    if (rc < 0)
        return rc;
    float *m = (float *)s;
    double *l = (double *)((char *)s + m_bytes);
    if ((rc = att_stage(impl, kv, n, (char *)s + m_bytes + l_bytes, &p)) < 0)
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
    prof_scope prof_(be, P_COSINE, -1);
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

/* The end of a row op: its copies to the host waited for; or the first error of its launch and
 * copies (err, or the wait's) as SKV_E_DEVICE, cleared (it is not the next op's). */
static int row_op_finish(struct cuda_impl *impl, cudaError_t err, const char *op)
{
    if (err == cudaSuccess)
        err = cudaStreamSynchronize(impl->stream);
    if (err == cudaSuccess)
        return SKV_OK;
    (void)cudaGetLastError();
    return skv_errorf(SKV_E_DEVICE, "%s: %s: %s", op, cudaGetErrorName(err), cudaGetErrorString(err));
}

/* The largest of a row's n_vocab logits, over the block (red: block_reduce's); a NaN never is,
 * -inf when none is larger. */
__device__ float block_row_max(const float *x, int n_vocab, float *red)
{
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < n_vocab; j += blockDim.x)
        mx = fmaxf(mx, x[j]);
    return block_reduce<true>(mx, red);
}

/* One block a row: the log-probability of the row's target under the softmax of its n_vocab
 * logits, as the CPU op defines it (a NaN counts as -inf; +inf logits share the mass; none
 * finite: -inf), and the row's most likely token into top (the lowest id of the largest logit;
 * 0 when every logit is NaN). The exponentials in single precision, each thread's in a float,
 * the block's sum in double. */
__global__ void row_logprobs_kernel(float *out, int32_t *top, const float *logits, const int32_t *targets,
                                    int n_vocab)
{
    __shared__ float redf[33];
    __shared__ double redd[33];
    const float *x = logits + (size_t)blockIdx.x * n_vocab;
    const float mx = block_row_max(x, n_vocab, redf);
    float first = -INFINITY; /* -(the lowest id whose logit is mx), as a float: exact below 2^24 */
    for (int j = threadIdx.x; j < n_vocab; j += blockDim.x)
        if (x[j] == mx) {
            first = -(float)j;
            break;
        }
    first = block_reduce<true>(first, redf);
    if (threadIdx.x == 0)
        top[blockIdx.x] = first == -INFINITY ? 0 : (int32_t)-first;
    const float xt = x[targets[blockIdx.x]];
    if (mx == INFINITY) { /* the same for every thread of the block, as below */
        double k = 0;
        for (int j = threadIdx.x; j < n_vocab; j += blockDim.x)
            k += x[j] == INFINITY;
        k = block_sum_d(k, redd);
        if (threadIdx.x == 0)
            out[blockIdx.x] = xt == INFINITY ? (float)-log(k) : -INFINITY;
        return;
    }
    if (mx == -INFINITY || isnan(xt)) {
        if (threadIdx.x == 0)
            out[blockIdx.x] = -INFINITY;
        return;
    }
    float acc = 0.0f;
    for (int j = threadIdx.x; j < n_vocab; j += blockDim.x)
        acc += isnan(x[j]) ? 0.0f : expf(x[j] - mx);
    const double s = block_sum_d((double)acc, redd);
    if (threadIdx.x == 0)
        out[blockIdx.x] = (float)((double)xt - ((double)mx + log(s)));
}

static int cuda_row_logprobs(struct skv_backend *be, float *out, int32_t *top, const float *logits,
                             const int32_t *targets, int n, int n_vocab)
{
    prof_scope prof_(be, P_ROW_LOGPROBS, n);
    if (!be || n < 0 || n_vocab <= 0 || (n && (!out || !logits || !targets)))
        return skv_errorf(SKV_E_INVAL, "row_logprobs: bad shape n=%d n_vocab=%d, or a NULL buffer", n, n_vocab);
    for (int r = 0; r < n; r++)
        if (targets[r] < 0 || targets[r] >= n_vocab)
            return skv_errorf(SKV_E_INVAL, "row_logprobs: target %d of row %d is outside [0, %d)", targets[r], r,
                              n_vocab);
    if (n == 0)
        return SKV_OK;
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    void *s = NULL;
    int rc = scratch_get(impl, (size_t)n * (sizeof(float) + 2 * sizeof(int32_t)), &s);
    if (rc < 0)
        return rc;
    float *dout = (float *)s;
    int32_t *dt = (int32_t *)(dout + n), *dtop = dt + n;
    cudaError_t err = cudaMemcpyAsync(dt, targets, (size_t)n * sizeof(int32_t), cudaMemcpyHostToDevice, impl->stream);
    if (err == cudaSuccess) {
        row_logprobs_kernel<<<(unsigned)n, EW_THREADS, 0, impl->stream>>>(dout, dtop, logits, dt, n_vocab);
        err = cudaGetLastError();
    }
    if (err == cudaSuccess)
        err = cudaMemcpyAsync(out, dout, (size_t)n * sizeof(float), cudaMemcpyDeviceToHost, impl->stream);
    if (err == cudaSuccess && top)
        err = cudaMemcpyAsync(top, dtop, (size_t)n * sizeof(int32_t), cudaMemcpyDeviceToHost, impl->stream);
    return row_op_finish(impl, err, "row_logprobs");
}

/* A top list's order: the larger key first (keys are logits, a NaN taken as -inf), equal ones by
 * the lower id; id INT32_MAX is no item and comes after every item. */
__device__ __forceinline__ bool rank_before(float ka, int32_t ia, float kb, int32_t ib)
{
    return ia != INT32_MAX && (ib == INT32_MAX || ka > kb || (ka == kb && ia < ib));
}

/* The first (rank_before) of the warp's (key, id) pairs, by butterfly: the order is total, so
 * every lane gets the same. */
__device__ __forceinline__ void warp_first(float &key, int32_t &id)
{
    for (int o = 16; o > 0; o >>= 1) {
        const float k2 = __shfl_xor_sync(0xffffffffu, key, o);
        const int32_t i2 = __shfl_xor_sync(0xffffffffu, id, o);
        if (rank_before(k2, i2, key, id)) {
            key = k2;
            id = i2;
        }
    }
}

/* The first of the block's (key, id) pairs, with redk[33] and redi[33] of shared memory; every
 * thread gets it. */
__device__ void block_first(float &key, int32_t &id, float *redk, int32_t *redi)
{
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    warp_first(key, id);
    __syncthreads();
    if (lane == 0) {
        redk[warp] = key;
        redi[warp] = id;
    }
    __syncthreads();
    if (warp == 0) {
        float k = lane < nw ? redk[lane] : -INFINITY;
        int32_t i = lane < nw ? redi[lane] : INT32_MAX;
        warp_first(k, i);
        if (lane == 0) {
            redk[32] = k;
            redi[32] = i;
        }
    }
    __syncthreads();
    key = redk[32];
    id = redi[32];
}

/* One block a row: the target's log-probability as row_logprobs_kernel gives it, and the row's k
 * most likely tokens (ids[row][k]) with theirs (lps[row][k]), in rank_before's order: k rounds,
 * each the first item after the one the round before picked. The log-probabilities all from the
 * row's one log-sum-exp, so the target's, where it is listed, is out's. */
__global__ void row_top_logprobs_kernel(float *out, int32_t *ids, float *lps, int k, const float *logits,
                                        const int32_t *targets, int n_vocab)
{
    __shared__ float redf[33];
    __shared__ double redd[33];
    __shared__ int32_t redi[33];
    const float *x = logits + (size_t)blockIdx.x * n_vocab;
    const float mx = block_row_max(x, n_vocab, redf);
    double n_inf = 0, lse = 0; /* the same for every thread of the block */
    if (mx == INFINITY) { /* the +inf logits share the mass */
        for (int j = threadIdx.x; j < n_vocab; j += blockDim.x)
            n_inf += x[j] == INFINITY;
        n_inf = block_sum_d(n_inf, redd);
    } else if (mx > -INFINITY) {
        float acc = 0.0f;
        for (int j = threadIdx.x; j < n_vocab; j += blockDim.x)
            acc += isnan(x[j]) ? 0.0f : expf(x[j] - mx);
        lse = (double)mx + log(block_sum_d((double)acc, redd));
    }
#define ROW_LP(v) (n_inf > 0 ? ((v) == INFINITY ? (float)-log(n_inf) : -INFINITY) \
                             : mx == -INFINITY || isnan(v) ? -INFINITY : (float)((double)(v) - lse))
    if (threadIdx.x == 0)
        out[blockIdx.x] = ROW_LP(x[targets[blockIdx.x]]);
    float pk = INFINITY; /* the last pick; (+inf, -1) ranks before every item */
    int32_t pi = -1;
    for (int r = 0; r < k; r++) {
        float bk = -INFINITY;
        int32_t bi = INT32_MAX;
        for (int j = threadIdx.x; j < n_vocab; j += blockDim.x) {
            const float kx = isnan(x[j]) ? -INFINITY : x[j];
            if (rank_before(pk, pi, kx, j) && rank_before(kx, j, bk, bi)) {
                bk = kx;
                bi = j;
            }
        }
        block_first(bk, bi, redf, redi);
        if (threadIdx.x == 0) {
            ids[(size_t)blockIdx.x * k + r] = bi;
            lps[(size_t)blockIdx.x * k + r] = ROW_LP(x[bi]);
        }
        pk = bk;
        pi = bi;
    }
#undef ROW_LP
}

static int cuda_row_top_logprobs(struct skv_backend *be, float *out, int32_t *ids, float *lps, int k,
                                 const float *logits, const int32_t *targets, int n, int n_vocab)
{
    prof_scope prof_(be, P_ROW_TOP_LOGPROBS, n);
    if (!be || n < 0 || n_vocab <= 0 || k < 1 || k > n_vocab || !ids || !lps || (n && (!out || !logits || !targets)))
        return skv_errorf(SKV_E_INVAL, "row_top_logprobs: bad shape n=%d n_vocab=%d k=%d, or a NULL buffer", n,
                          n_vocab, k);
    for (int r = 0; r < n; r++)
        if (targets[r] < 0 || targets[r] >= n_vocab)
            return skv_errorf(SKV_E_INVAL, "row_top_logprobs: target %d of row %d is outside [0, %d)", targets[r],
                              r, n_vocab);
    if (n == 0)
        return SKV_OK;
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    const size_t nk = (size_t)n * (size_t)k;
    void *s = NULL;
    int rc = scratch_get(impl, (size_t)n * (sizeof(float) + sizeof(int32_t)) + nk * (sizeof(float) + sizeof(int32_t)),
                         &s);
    if (rc < 0)
        return rc;
    float *dout = (float *)s, *dlps = dout + n;
    int32_t *dt = (int32_t *)(dlps + nk), *dids = dt + n;
    cudaError_t err = cudaMemcpyAsync(dt, targets, (size_t)n * sizeof(int32_t), cudaMemcpyHostToDevice, impl->stream);
    if (err == cudaSuccess) {
        row_top_logprobs_kernel<<<(unsigned)n, EW_THREADS, 0, impl->stream>>>(dout, dids, dlps, k, logits, dt,
                                                                              n_vocab);
        err = cudaGetLastError();
    }
    if (err == cudaSuccess)
        err = cudaMemcpyAsync(out, dout, (size_t)n * sizeof(float), cudaMemcpyDeviceToHost, impl->stream);
    if (err == cudaSuccess)
        err = cudaMemcpyAsync(ids, dids, nk * sizeof(int32_t), cudaMemcpyDeviceToHost, impl->stream);
    if (err == cudaSuccess)
        err = cudaMemcpyAsync(lps, dlps, nk * sizeof(float), cudaMemcpyDeviceToHost, impl->stream);
    return row_op_finish(impl, err, "row_top_logprobs");
}

/* Per-KV-head lengths of the group_scores op, passed by value. */
struct group_params {
    int len[SKV_MAX_KV_HEADS], pooled[SKV_MAX_KV_HEADS];
};

/* Row j of KV head h reduced over its group's colsum rows, in the CPU op's order. */
__device__ __forceinline__ float group_reduced(const float *in, int64_t stride, int g, int j, bool gqa_max,
                                               float div)
{
    float acc = in[j];
    for (int r = 1; r < g; r++) {
        const float v = in[(int64_t)r * stride + j];
        acc = gqa_max ? (v > acc ? v : acc) : acc + v;
    }
    return (gqa_max ? acc : acc / (float)g) / div;
}

/* One thread per (KV head, row): pooled rows re-reduce their kernel's neighbours (k * g reads). */
__global__ void group_scores_kernel(float *out, const float *colsum, int64_t stride, int g, struct group_params p,
                                    float div, int kernel, bool pool_max, bool gqa_max)
{
    const int h = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    const int n = p.len[h], np = p.pooled[h], half = kernel / 2;
    if (j >= n)
        return;
    const float *in = colsum + (int64_t)h * g * stride;
    float v;
    if (j >= np) {
        v = group_reduced(in, stride, g, j, gqa_max, div);
    } else {
        const int lo = j - half < 0 ? 0 : j - half, hi = j + half >= np ? np - 1 : j + half;
        if (pool_max) {
            v = -INFINITY;
            for (int t = lo; t <= hi; t++) {
                const float x = group_reduced(in, stride, g, t, gqa_max, div);
                v = x > v ? x : v;
            }
        } else {
            double sum = 0.0;
            for (int t = lo; t <= hi; t++)
                sum += group_reduced(in, stride, g, t, gqa_max, div);
            v = (float)(sum / kernel);
        }
    }
    out[(int64_t)h * stride + j] = v;
}

static int cuda_group_scores(struct skv_backend *be, float *out, const float *colsum, int64_t stride, int n_heads,
                             int n_kv, const int *len, const int *pooled, float div, int kernel, bool pool_max,
                             bool gqa_max)
{
    prof_scope prof_(be, P_GROUP_SCORES, -1);
    int rc = skv_group_scores_check(out, colsum, stride, n_heads, n_kv, len, pooled, div, kernel);
    if (rc < 0)
        return rc;
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    struct group_params p;
    int max_len = 0;
    for (int h = 0; h < n_kv; h++) {
        p.len[h] = len[h];
        p.pooled[h] = pooled[h];
        max_len = len[h] > max_len ? len[h] : max_len;
    }
    if (max_len == 0)
        return SKV_OK;
    dim3 grid((unsigned)((max_len + EW_THREADS - 1) / EW_THREADS), (unsigned)n_kv);
    group_scores_kernel<<<grid, EW_THREADS, 0, impl->stream>>>(out, colsum, stride, n_heads / n_kv, p, div, kernel,
                                                               pool_max, gqa_max);
    SKV_CUDA_CHECK(cudaGetLastError());
    return SKV_OK;
}

#define TOPK_THREADS 512

/* Segments of the topk_rows op, passed by value; off[b]: where block b's rows go in idx. */
struct topk_params {
    int n[SKV_MAX_KV_HEADS];
    int64_t off[SKV_MAX_KV_HEADS];
    int64_t stride;
    int n_seg, k;
    bool joint;
};

/* Keys as unsigned integers in the same order (NaN lowest, -0 as +0), as the CPU op maps them. */
__device__ __forceinline__ uint32_t order_key(float f)
{
    if (f != f)
        return 0;
    if (f == 0.0f)
        f = 0.0f;
    const uint32_t u = __float_as_uint(f);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

/* Exclusive prefix count of `flag` over the block in thread order; *total gets the block's
 * count. Every thread of the block calls it. */
__device__ int block_count_before(bool flag, int *sums, int *total)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const unsigned bits = __ballot_sync(0xffffffffu, flag);
    if (lane == 0)
        sums[wid] = __popc(bits);
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int w = 0; w < (int)blockDim.x / 32; w++) {
            const int t = sums[w];
            sums[w] = acc;
            acc += t;
        }
        sums[32] = acc;
    }
    __syncthreads();
    const int before = sums[wid] + __popc(bits & ((1u << lane) - 1u));
    *total = sums[32];
    __syncthreads();
    return before;
}

/* One block per segment, or one for all segments (joint): a radix select finds the k-th
 * largest key (four 8-bit digits through a shared histogram), then one ordered pass keeps every
 * larger key and the first equal ones, each kept row written at its rank. */
__global__ void __launch_bounds__(TOPK_THREADS)
    topk_kernel(int32_t *idx, int *cnt, const float *keys, struct topk_params p)
{
    __shared__ unsigned int hist[256];
    __shared__ uint32_t s_thr;
    __shared__ long long s_want;
    __shared__ int sums[33];
    const int s0 = p.joint ? 0 : (int)blockIdx.x, s1 = p.joint ? p.n_seg : s0 + 1;
    long long total = 0;
    for (int s = s0; s < s1; s++)
        total += p.n[s];
    const bool all = total <= p.k;
    if (threadIdx.x == 0) {
        s_thr = 0;
        s_want = p.k;
    }
    __syncthreads();
    if (!all && p.k > 0) {
        uint32_t mask = 0;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = threadIdx.x; b < 256; b += blockDim.x)
                hist[b] = 0;
            __syncthreads();
            const uint32_t thr = s_thr;
            for (int s = s0; s < s1; s++)
                for (int j = threadIdx.x; j < p.n[s]; j += blockDim.x) {
                    const uint32_t u = order_key(keys[s * p.stride + j]);
                    if ((u & mask) == thr)
                        atomicAdd(&hist[(u >> shift) & 255u], 1u);
                }
            __syncthreads();
            if (threadIdx.x == 0) {
                long long want = s_want;
                int b = 255;
                for (; b > 0 && (long long)hist[b] < want; b--)
                    want -= hist[b];
                s_want = want;
                s_thr = thr | (uint32_t)b << shift;
            }
            __syncthreads();
            mask |= 255u << shift;
        }
    }
    const uint32_t thr = s_thr;
    const long long ties = s_want;
    int32_t *out = idx + (p.joint ? 0 : p.off[blockIdx.x]);
    long long kept = 0, tied = 0;
    for (int s = s0; s < s1; s++) {
        const long long first = kept;
        for (int j0 = 0; j0 < p.n[s] && (all || p.k > 0); j0 += blockDim.x) {
            const int j = j0 + (int)threadIdx.x;
            const bool valid = j < p.n[s];
            const uint32_t u = valid ? order_key(keys[s * p.stride + j]) : 0u;
            const bool tie = valid && !all && u == thr;
            int n_tie, n_keep;
            const int tie_rank = block_count_before(tie, sums, &n_tie);
            const bool keep = valid && (all || u > thr || (tie && tied + tie_rank < ties));
            const int rank = block_count_before(keep, sums, &n_keep);
            if (keep)
                out[kept + rank] = j;
            kept += n_keep;
            tied += n_tie;
        }
        if (threadIdx.x == 0)
            cnt[s] = (int)(kept - first);
    }
}

static int cuda_topk_rows(struct skv_backend *be, int32_t *idx, int *cnt, const float *keys, int64_t stride,
                          const int *n, int n_seg, int k, bool joint)
{
    prof_scope prof_(be, P_TOPK, -1);
    int rc = skv_topk_check(idx, cnt, keys, stride, n, n_seg, k);
    if (rc < 0)
        return rc;
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    struct topk_params p;
    memset(&p, 0, sizeof p);
    p.stride = stride;
    p.n_seg = n_seg;
    p.k = k;
    p.joint = joint;
    int64_t at = 0;
    for (int s = 0; s < n_seg; s++) {
        p.n[s] = n[s];
        p.off[s] = at;
        at += n[s] < k ? n[s] : k;
    }
    const int64_t total = skv_topk_total(n, n_seg, k, joint);
    void *buf = NULL;
    const size_t cnt_bytes = align_up((size_t)n_seg * sizeof(int));
    if ((rc = scratch_get(impl, cnt_bytes + (size_t)(total > 0 ? total : 1) * sizeof(int32_t), &buf)) < 0)
        return rc;
    int *dcnt = (int *)buf;
    int32_t *didx = (int32_t *)((char *)buf + cnt_bytes);
    topk_kernel<<<joint ? 1u : (unsigned)n_seg, TOPK_THREADS, 0, impl->stream>>>(didx, dcnt, keys, p);
    SKV_CUDA_CHECK(cudaGetLastError());
    SKV_CUDA_CHECK(cudaMemcpyAsync(cnt, dcnt, (size_t)n_seg * sizeof(int), cudaMemcpyDeviceToHost, impl->stream));
    if (total > 0)
        SKV_CUDA_CHECK(cudaMemcpyAsync(idx, didx, (size_t)total * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                       impl->stream));
    SKV_CUDA_CHECK(cudaStreamSynchronize(impl->stream));
    return SKV_OK;
}

/* f16 KV rows: row i of n, dst[i] <- src[i] (d f32 values) as f16, nearest even, magnitudes
 * past 65504 saturating (skv_f32_to_fp16_sat's twin; NaN stays NaN). */
__global__ void store_rows_f16_kernel(__half *const *dst, const float *const *src, int d, int n)
{
    const int64_t total = (int64_t)n * d;
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < total;
         k += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = k / d, e = k % d;
        const float x = src[i][e];
        dst[i][e] = __float2half_rn(x > 65504.0f ? 65504.0f : x < -65504.0f ? -65504.0f : x);
    }
}

/* A store op's checks (op: its name; d a multiple of `multiple`), then its two pointer tables in
 * device scratch (one upload): *ddst, *dsrc; SKV_OK with nothing to do when n is 0 (*ddst NULL). */
static int store_rows_tables(struct skv_backend *be, const char *op, void *const *dst, const float *const *src,
                             int d, int multiple, int n, void ***ddst, const float ***dsrc)
{
    *ddst = NULL;
    *dsrc = NULL;
    if (n < 0 || d <= 0 || d % multiple != 0 || (n > 0 && (!dst || !src)))
        return skv_errorf(SKV_E_INVAL, "%s: bad arguments (n = %d, d = %d, a multiple of %d)", op, n, d, multiple);
    for (int i = 0; i < n; i++)
        if (!dst[i] || !src[i])
            return skv_errorf(SKV_E_INVAL, "%s: row %d has no %s", op, i, dst[i] ? "source" : "destination");
    if (n == 0)
        return SKV_OK;
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    const size_t table = (size_t)n * sizeof(void *);
    void *s = NULL, *host = NULL;
    int rc = scratch_get(impl, 2 * align_up(table), &s);
    if (rc < 0 || (rc = stage_get(impl, 2 * align_up(table), &host)) < 0)
        return rc;
    memcpy(host, dst, table);
    memcpy((char *)host + align_up(table), src, table);
    if ((rc = upload_table(impl, s, host, align_up(table) + table)) < 0)
        return rc;
    *ddst = (void **)s;
    *dsrc = (const float **)((char *)s + align_up(table));
    return SKV_OK;
}

/* The pointer tables to the device, then one kernel stores every row. */
static int cuda_store_rows_f16(struct skv_backend *be, void *const *dst, const float *const *src, int d, int n)
{
    prof_scope prof_(be, P_COPY_ROWS, -1);
    void **ddst;
    const float **dsrc;
    int rc = store_rows_tables(be, "store_rows_f16", dst, src, d, 1, n, &ddst, &dsrc);
    if (rc < 0 || !ddst)
        return rc;
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    store_rows_f16_kernel<<<grid_for((int64_t)n * d, EW_THREADS), EW_THREADS, 0, impl->stream>>>((__half **)ddst, dsrc,
                                                                                                  d, n);
    SKV_CUDA_CHECK(cudaGetLastError());
    return SKV_OK;
}

/* q8_0 KV rows: one thread per block of 32 values (d a multiple of 32), rows as dst[i] <- src[i],
 * quantized as skv_quantize_row_q8_0 does, bit for bit: d = amax / 127 (NaN ignored; 65504 when
 * it is 65520 or more, which f16 cannot hold), stored as f16 (nearest even), q = roundf(x * (1 /
 * d)) within +-127, NaN as 0. */
__global__ void store_rows_q8_0_kernel(unsigned char *const *dst, const float *const *src, int d, int n)
{
    const int per = d / 32;
    const int64_t total = (int64_t)n * per;
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < total;
         k += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = k / per, b = k % per;
        const float *x = src[i] + 32 * b;
        unsigned char *o = dst[i] + 34 * b;
        float amax = 0.0f;
        for (int t = 0; t < 32; t++) {
            const float a = fabsf(x[t]);
            amax = a > amax ? a : amax;
        }
        float dq = __fdiv_rn(amax, 127.0f);
        dq = dq >= 65520.0f ? 65504.0f : dq; /* below 65520 it rounds to 65504 as an f16 by itself */
        const float id = dq != 0.0f ? __fdiv_rn(1.0f, dq) : 0.0f;
        const unsigned short h = __half_as_ushort(__float2half_rn(dq));
        o[0] = (unsigned char)(h & 0xff);
        o[1] = (unsigned char)(h >> 8);
        for (int t = 0; t < 32; t++) {
            const float v = __fmul_rn(x[t], id);
            const float r = v >= 127.0f ? 127.0f : v <= -127.0f ? -127.0f : v == v ? roundf(v) : 0.0f;
            o[2 + t] = (unsigned char)(signed char)r;
        }
    }
}

/* As cuda_store_rows_f16, one thread per block of 32. */
static int cuda_store_rows_q8_0(struct skv_backend *be, void *const *dst, const float *const *src, int d, int n)
{
    prof_scope prof_(be, P_COPY_ROWS, -1);
    void **ddst;
    const float **dsrc;
    int rc = store_rows_tables(be, "store_rows_q8_0", dst, src, d, 32, n, &ddst, &dsrc);
    if (rc < 0 || !ddst)
        return rc;
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    store_rows_q8_0_kernel<<<grid_for((int64_t)n * (d / 32), EW_THREADS), EW_THREADS, 0, impl->stream>>>(
        (unsigned char **)ddst, dsrc, d, n);
    SKV_CUDA_CHECK(cudaGetLastError());
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
    prof_scope prof_(be, P_COPY_ROWS, -1);
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
    /* both tables in one copy, through the host staging buffer */
    void *host = NULL;
    if ((rc = stage_get(impl, 2 * align_up(table), &host)) < 0)
        return rc;
    memcpy(host, dst, table);
    memcpy((char *)host + align_up(table), src, table);
    if ((rc = upload_table(impl, ddst, host, align_up(table) + table)) < 0)
        return rc;
    const int64_t total = (int64_t)n * (int64_t)(words ? row_bytes / 4 : row_bytes);
    copy_rows_kernel<<<grid_for(total, EW_THREADS), EW_THREADS, 0, impl->stream>>>(ddst, dsrc, row_bytes, n,
                                                                                   words);
    SKV_CUDA_CHECK(cudaGetLastError());
    return SKV_OK;
}

/* ---- construction ------------------------------------------------------------------- */

/* SKV_CUDA_PROFILE's tables, to stderr when the backend goes: per op its calls, the host time
 * inside them (mode 2: up to the end of their device work) and the mean per call; decode-sized
 * calls first, then the rest. */
static void prof_report(const struct cuda_impl *impl)
{
    fprintf(stderr, "cuda op profile (SKV_CUDA_PROFILE=%d: %s)\n", impl->prof_mode,
            impl->prof_mode == 2 ? "each op synchronized, so device time included"
                                 : "host time inside each op, device work not waited for");
    for (int ph = 1; ph >= 0; ph--) {
        uint64_t total = 0;
        for (int i = 0; i < P_OPS; i++)
            total += impl->prof[ph][i].ns;
        fprintf(stderr, "%s\n", ph ? "decode-sized calls (at most 8 rows, and the row-less ops after them):"
                                   : "the rest (prefill, weight copies):");
        fprintf(stderr, "%-18s %10s %12s %10s %7s\n", "op", "calls", "total ms", "us/call", "share");
        for (int i = 0; i < P_OPS; i++) {
            const struct cuda_impl::prof_acc *a = &impl->prof[ph][i];
            if (a->calls)
                fprintf(stderr, "%-18s %10llu %12.3f %10.2f %6.1f%%\n", prof_names[i],
                        (unsigned long long)a->calls, (double)a->ns / 1e6, (double)a->ns / 1e3 / (double)a->calls,
                        total ? 100.0 * (double)a->ns / (double)total : 0.0);
        }
        fprintf(stderr, "%-18s %10s %12.3f\n", "all ops", "", (double)total / 1e6);
    }
}

static void cuda_destroy(struct skv_backend *be)
{
    if (!be)
        return;
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    if (impl) {
        if (impl->prof_mode)
            prof_report(impl);
        if (impl->stream)
            cudaStreamSynchronize(impl->stream);
        if (impl->scratch)
            cudaFree(impl->scratch);
        free(impl->stage);
        cudaFree(impl->rope_freq);
        cudaFree(impl->rope_pos);
        free(impl->rope_pos_host);
        if (impl->blas)
            cublasDestroy(impl->blas);
        if (impl->stream)
            cudaStreamDestroy(impl->stream);
        free(impl);
    }
    free(be);
}

/* ---- IPC ---------------------------------------------------------------------------- */

/* The driver's cuMemGetAddressRange (the runtime has no counterpart), looked up through the
 * runtime so the daemon does not link libcuda itself. */
typedef CUresult (*mem_range_fn)(CUdeviceptr *base, size_t *size, CUdeviceptr p);

static int allocation_end(const void *p, uint64_t *bytes_out)
{
    static mem_range_fn range;
    if (!range) {
        void *fn = NULL;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &q) !=
                cudaSuccess ||
            q != cudaDriverEntryPointSuccess || !fn) {
            (void)cudaGetLastError();
            return skv_errorf(SKV_E_UNSUPPORTED, "ipc_open: the driver has no cuMemGetAddressRange, so a CUDA "
                                                 "buffer's size cannot be checked: refused");
        }
        range = (mem_range_fn)fn;
    }
    CUdeviceptr base = 0;
    size_t size = 0;
    CUresult r = range(&base, &size, (CUdeviceptr)(uintptr_t)p);
    if (r != CUDA_SUCCESS || (uintptr_t)p < base || (uintptr_t)p - base > size)
        return skv_errorf(SKV_E_DEVICE, "ipc_open: the opened buffer's extent is unknown (CUresult %d)", (int)r);
    *bytes_out = (uint64_t)(size - ((uintptr_t)p - base));
    return SKV_OK;
}

static int cuda_ipc_open(struct skv_backend *be, const void *handle, size_t handle_len, void **out,
                         uint64_t *bytes_out)
{
    if (be == NULL || handle == NULL || out == NULL || bytes_out == NULL)
        return skv_errorf(SKV_E_INVAL, "ipc_open: bad arguments");
    if (handle_len != sizeof(cudaIpcMemHandle_t))
        return skv_errorf(SKV_E_INVAL, "ipc_open: a CUDA IPC handle of %zu bytes: it has %zu", handle_len,
                          sizeof(cudaIpcMemHandle_t));
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof h);
    void *p = NULL;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        /* the handle is the client's: one that names nothing open (freed, never a handle, or
         * another device's) is the client's mistake, not the device's failure */
        bool clients = e == cudaErrorInvalidValue || e == cudaErrorInvalidResourceHandle ||
                       e == cudaErrorInvalidDevice || e == cudaErrorInvalidDevicePointer ||
                       e == cudaErrorPeerAccessUnsupported;
        /* (a mapping that failed is room: NOMEM, which a closed buffer may give back) */
        bool room = e == cudaErrorMemoryAllocation || e == cudaErrorMapBufferObjectFailed;
        return skv_errorf(clients ? SKV_E_INVAL : room ? SKV_E_NOMEM : SKV_E_DEVICE,
                          "ipc_open: the CUDA IPC handle could not be opened%s: %s: %s",
                          clients ? " (a buffer freed, not a handle, or another device's)" : "",
                          cudaGetErrorName(e), cudaGetErrorString(e));
    }
    int rc = allocation_end(p, bytes_out);
    if (rc) {
        cudaIpcCloseMemHandle(p);
        (void)cudaGetLastError();
        return rc;
    }
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

/* Up to MM_GEMV_MAX_N rows take the GEMV kernels, which compute each row on its own; more go
 * to cuBLAS. */
static int cuda_matmul_rows_as_one(struct skv_backend *be, const struct skv_tensor *w)
{
    (void)be;
    (void)w;
    return MM_GEMV_MAX_N;
}

static bool cuda_device_lost(struct skv_backend *be)
{
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    (void)cudaGetLastError(); /* a launch error of its own is cleared; a sticky one stays */
    cudaError_t err = cudaStreamSynchronize(impl->stream);
    if (err == cudaSuccess)
        return false;
    (void)cudaGetLastError();
    return cudaStreamSynchronize(impl->stream) != cudaSuccess;
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
    /* matmul_rows_as_one */ cuda_matmul_rows_as_one,
    /* matmul_multi */ cuda_matmul_multi,
    /* rmsnorm */ cuda_rmsnorm,
    /* rope */ cuda_rope,
    /* swiglu */ cuda_swiglu,
    /* add */ cuda_add,
    /* attention */ cuda_attention,
    /* attention_colsum */ cuda_attention_colsum,
    /* group_scores */ cuda_group_scores,
    /* topk_rows */ cuda_topk_rows,
    /* cosine_mean */ cuda_cosine_mean,
    /* copy_rows */ cuda_copy_rows,
    /* ipc_open */ cuda_ipc_open,
    /* ipc_close */ cuda_ipc_close,
    /* attention_split_rows */ NULL, /* cuBLAS picks kernels by shape: not known to be exact */
    /* weight_type_ok */ cuda_type_supported, /* K-quants and q5: converted to f16 at load */
    /* device_lost */ cuda_device_lost,
    /* attention_batch */ cuda_attention_batch,
    /* attention_batch_probs */ cuda_attention_batch_probs,
    /* store_rows_f16 */ cuda_store_rows_f16,
    /* store_rows_q8_0 */ cuda_store_rows_q8_0,
    /* row_logprobs */ cuda_row_logprobs,
    /* row_top_logprobs */ cuda_row_top_logprobs,
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
    const char *prof = getenv("SKV_CUDA_PROFILE");
    impl->prof_mode = prof && (prof[0] == '1' || prof[0] == '2') && !prof[1] ? prof[0] - '0' : 0;
    cudaError_t err = cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking);
    cublasStatus_t bst = err == cudaSuccess ? cublasCreate(&impl->blas) : CUBLAS_STATUS_NOT_INITIALIZED;
    if (bst == CUBLAS_STATUS_SUCCESS)
        bst = cublasSetStream(impl->blas, impl->stream);
    if (err == cudaSuccess && bst == CUBLAS_STATUS_SUCCESS)
        err = cudaDeviceGetAttribute(&impl->sm_count, cudaDevAttrMultiProcessorCount, device);
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
