/* Host emulation of the CUDA backend's attention, compression-score and top-k kernels (see
 * run.sh): one std::thread per CUDA thread, real barriers for __syncthreads, warp shuffles and
 * ballots; each case compares the kernels' host launcher with the CPU backend's op on the same
 * data. Dynamic shared memory starts as garbage, as on a device. */
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <climits>
#include <cstdint>
#include <thread>
#include <vector>
#include <type_traits>
#include <memory>
#include <algorithm>
extern "C" {
#include "common/status.h"
#include "kernels/backend.h"
}
struct dim3 { unsigned x = 1, y = 1, z = 1; dim3() {} dim3(unsigned a, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
static char *g_dyn;
static std::barrier<> *g_bar;
struct warpbuf { double v[32]; unsigned flags[32]; std::barrier<> *bar; };
static warpbuf g_warps[32];
#define __global__
#define __device__
#define __forceinline__
#define __launch_bounds__(x)
#define __shared__ static
static inline void __syncthreads() { g_bar->arrive_and_wait(); }
/* Every lane publishes v and reads lane from(lane)'s */
template <class T, class F> T warp_exchange(T v, F from)
{
    warpbuf &w = g_warps[threadIdx.x / 32];
    int lane = threadIdx.x % 32;
    w.v[lane] = (double)v;
    w.bar->arrive_and_wait();
    T r = (T)w.v[from(lane)];
    w.bar->arrive_and_wait();
    return r;
}
template <class T> T __shfl_down_sync(unsigned, T v, int o) { return warp_exchange(v, [o](int l) { return l + o < 32 ? l + o : l; }); }
template <class T> T __shfl_xor_sync(unsigned, T v, int o) { return warp_exchange(v, [o](int l) { return l ^ o; }); }
template <class T> T __shfl_sync(unsigned, T v, int src) { return warp_exchange(v, [src](int) { return src; }); }
static unsigned __ballot_sync(unsigned, bool f)
{
    warpbuf &w = g_warps[threadIdx.x / 32];
    int lane = threadIdx.x % 32;
    w.flags[lane] = f;
    w.bar->arrive_and_wait();
    unsigned m = 0;
    for (int i = 0; i < 32; i++)
        m |= (w.flags[i] ? 1u : 0u) << i;
    w.bar->arrive_and_wait();
    return m;
}
static int __popc(unsigned v) { return __builtin_popcount(v); }
static unsigned atomicAdd(unsigned *p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
struct __half { unsigned short x; };
struct __half2 { unsigned short x, y; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
static uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
template <class T> static T __ldg(const T *p) { return *p; }
static __half __ushort_as_half(unsigned short u) { return {u}; }
static float __half2float(__half h) { return skv_fp16_to_f32(h.x); }
static __half __float2half_rn(float f) { return {skv_f32_to_fp16(f)}; }
static float2 __half22float2(__half2 h) { return {skv_fp16_to_f32(h.x), skv_fp16_to_f32(h.y)}; }
static unsigned short __half_as_ushort(__half h) { return h.x; }
static float __fmul_rn(float a, float b) { return a * b; }
static float __fdiv_rn(float a, float b) { return a / b; }
static float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
typedef int cudaError_t;
typedef void *cudaStream_t;
typedef void *cublasHandle_t;
#define cudaSuccess 0
#define cudaMemcpyHostToDevice 1
#define cudaMemcpyDeviceToHost 2
#define cudaFuncAttributeMaxDynamicSharedMemorySize 0
static cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, int, cudaStream_t) { memcpy(d, s, n); return 0; }
static cudaError_t cudaStreamSynchronize(cudaStream_t) { return 0; }
static cudaError_t cudaMemset2DAsync(void *p, size_t pitch, int v, size_t w, size_t h, cudaStream_t)
{
    for (size_t r = 0; r < h; r++)
        memset((char *)p + r * pitch, v, w);
    return 0;
}
static cudaError_t cudaMalloc(void **p, size_t n) { *p = malloc(n); return 0; }
static cudaError_t cudaFree(void *p) { free(p); return 0; }
static cudaError_t cudaGetLastError() { return 0; }
static const char *cudaGetErrorName(cudaError_t) { return "?"; }
static const char *cudaGetErrorString(cudaError_t) { return "?"; }
template <class F> cudaError_t cudaFuncSetAttribute(F, int, int v) { if (v > 227 * 1024) abort(); return 0; }
#define SKV_CUDA_CHECK(expr) do { if ((expr) != 0) return SKV_E_DEVICE; } while (0)
typedef int cublasStatus_t;
typedef int cublasOperation_t;
#define CUBLAS_STATUS_SUCCESS 0
#define CUBLAS_OP_N 0
#define CUBLAS_OP_T 1
#define SKV_CUBLAS_CHECK(expr) do { if ((expr) != CUBLAS_STATUS_SUCCESS) return SKV_E_DEVICE; } while (0)
/* cuBLAS's column-major C = alpha op(A) op(B) + beta C for each of `batch` strided triples */
static cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m,
                                                int n, int k, const float *alpha, const float *A, int lda,
                                                long long sa, const float *B, int ldb, long long sb,
                                                const float *beta, float *C, int ldc, long long sc, int batch)
{
    for (int b = 0; b < batch; b++)
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) {
                double acc = 0.0;
                for (int l = 0; l < k; l++) {
                    const float a = ta == CUBLAS_OP_N ? A[b * sa + i + (size_t)l * lda] : A[b * sa + l + (size_t)i * lda];
                    const float v = tb == CUBLAS_OP_N ? B[b * sb + l + (size_t)j * ldb] : B[b * sb + j + (size_t)l * ldb];
                    acc += (double)a * v;
                }
                float *c = &C[b * sc + i + (size_t)j * ldc];
                *c = (float)(*alpha * acc + (*beta != 0.0f ? *beta * *c : 0.0f));
            }
    return CUBLAS_STATUS_SUCCESS;
}

static size_t g_max_smem;
template <class... KA>
void emu_launch(void (*k)(KA...), dim3 grid, int threads, size_t smem, std::type_identity_t<KA>... args)
{
    if (smem > g_max_smem) g_max_smem = smem;
    if (smem > 96 * 1024) { fprintf(stderr, "smem %zu\n", smem); abort(); }
    std::vector<char> dyn(smem + 64, (char)0xff); /* garbage, like the device */
    blockDim = dim3(threads);
    gridDim = grid;
    for (unsigned b = 0; b < grid.x * grid.y; b++) {
        g_dyn = dyn.data();
        std::barrier<> bar(threads);
        g_bar = &bar;
        std::vector<std::unique_ptr<std::barrier<>>> wb;
        for (int w = 0; w < threads / 32; w++) {
            wb.emplace_back(new std::barrier<>(32));
            g_warps[w].bar = wb.back().get();
        }
        std::vector<std::thread> th;
        for (int t = 0; t < threads; t++)
            th.emplace_back([&, t] { threadIdx = dim3(t); blockIdx = dim3(b % grid.x, b / grid.x); k(args...); });
        for (auto &x : th) x.join();
    }
}
/* no device memory here: every pointer is a host one */
static bool is_device_ptr(const void *) { return false; }
#define SCRATCH_ROUND ((size_t)1 << 20)
#define ATT_GEMM_S_BYTES ((size_t)64 << 10) /* prefill attention in several query batches */
#define EW_THREADS 256
namespace emu {
using std::isinf; /* the device code's isnan and isinf, C++ style */
using std::isnan;
#include "kern.inc"
}
using namespace emu;

static uint64_t rs = 88172645463325252ULL;
static float rnd() { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return (float)((rs >> 11) * (1.0 / 9007199254740992.0) * 2 - 1) * 1.7f; }

/* The KV type of the kernels' rows in cases made while set (kv-type f16 or q8_0): the CPU's view
 * holds the same values as f32. */
static int g_kv_type = SKV_DTYPE_F32;

/* A random KV cache of n_kv heads (prefix p0 / p1 rows before the batch's n, positions with a
 * gap so that a sliding window cuts inside the prefix), its contiguous view for the CPU and a
 * paged copy (blocks of block_rows, unused rows NaN) for the kernels when block_rows > 0. With
 * g_kv_type f16 or q8_0 the kernels' view holds rows of that type (paged, or contiguous copies
 * when block_rows is 0). */
struct kv_case {
    struct skv_kv_view kv, paged;
    std::vector<std::vector<float>> K, V;
    std::vector<std::vector<unsigned char>> Kt, Vt; /* the rows as g_kv_type bytes */
    std::vector<std::vector<int32_t>> pos;
    std::vector<std::vector<void *>> tbl;
    int max_rows = 0;

    /* x's rows of d as bytes of g_kv_type into out, and x replaced by the values they hold */
    static void typed(std::vector<float> &x, int d, std::vector<unsigned char> &out)
    {
        const size_t row = skv_kv_row_bytes(g_kv_type, d), rows = x.size() / d;
        out.assign(rows * row, 0);
        for (size_t i = 0; i < rows; i++) {
            float *xi = x.data() + i * d;
            if (g_kv_type == SKV_DTYPE_F16) {
                for (int t = 0; t < d; t++) {
                    uint16_t h = skv_f32_to_fp16(xi[t]);
                    memcpy(out.data() + i * row + 2 * t, &h, 2);
                    xi[t] = skv_fp16_to_f32(h);
                }
            } else {
                skv_quantize_row_q8_0(out.data() + i * row, xi, d);
                skv_dequantize_row(SKV_DTYPE_Q8_0, out.data() + i * row, xi, d);
            }
        }
    }

    kv_case(int n, int n_kv, int d, int p0, int p1, int window, int block_rows)
        : K(n_kv), V(n_kv), Kt(n_kv), Vt(n_kv), pos(n_kv), tbl(n_kv)
    {
        const bool raw = g_kv_type != SKV_DTYPE_F32;
        memset(&kv, 0, sizeof kv);
        kv.n_kv_heads = n_kv; kv.head_dim = d; kv.kv_type = SKV_DTYPE_F32; kv.window = window;
        for (int g = 0; g < n_kv; g++) {
            int pre = g == 0 ? p0 : p1, rows = pre + n;
            max_rows = rows > max_rows ? rows : max_rows;
            kv.prefix_len[g] = pre;
            K[g].resize((size_t)rows * d); V[g].resize((size_t)rows * d);
            for (auto &x : K[g]) x = rnd();
            for (auto &x : V[g]) x = rnd();
            if (raw) {
                typed(K[g], d, Kt[g]);
                typed(V[g], d, Vt[g]);
            }
            kv.k[g] = K[g].data(); kv.v[g] = V[g].data();
            pos[g].resize(rows);
            for (int j = 0; j < rows; j++) pos[g][j] = j < pre ? 2 * j : 2 * pre + (j - pre);
            kv.pos[g] = pos[g].data();
        }
        paged = kv;
        paged.block_rows = block_rows;
        if (raw) {
            paged.kv_type = g_kv_type;
            for (int g = 0; g < n_kv; g++) {
                paged.k[g] = Kt[g].data();
                paged.v[g] = Vt[g].data();
            }
        }
        const size_t row = skv_kv_row_bytes(g_kv_type, d); /* blocks of typed rows, unused rows NaN */
        for (int g = 0; g < n_kv && block_rows > 0; g++) {
            int rows = kv.prefix_len[g] + n, nb = (rows + block_rows - 1) / block_rows;
            const char *ks = raw ? (const char *)Kt[g].data() : (const char *)K[g].data();
            const char *vs = raw ? (const char *)Vt[g].data() : (const char *)V[g].data();
            for (int b = 0; b < nb; b++) {
                char *blk = (char *)malloc((size_t)2 * block_rows * row);
                if (g_kv_type == SKV_DTYPE_F32)
                    for (int x = 0; x < 2 * block_rows * d; x++) ((float *)blk)[x] = NAN;
                else if (g_kv_type == SKV_DTYPE_F16)
                    for (int x = 0; x < 2 * block_rows * d; x++) ((uint16_t *)blk)[x] = 0x7e00;
                else
                    memset(blk, 0xff, (size_t)2 * block_rows * row); /* scale NaN */
                for (int r = 0; r < block_rows && b * block_rows + r < rows; r++) {
                    const size_t at = (size_t)(b * block_rows + r) * row;
                    memcpy(blk + (size_t)r * row, ks + at, row);
                    memcpy(blk + (size_t)(block_rows + r) * row, vs + at, row);
                }
                tbl[g].push_back(blk);
            }
            paged.blocks[g] = tbl[g].data();
            paged.k[g] = paged.v[g] = NULL;
        }
    }
    ~kv_case()
    {
        for (auto &t : tbl)
            for (void *b : t) free(b);
    }
};

/* An emulated CUDA backend (no device: the mocks above stand in for the runtime). */
struct emu_backend {
    struct cuda_impl impl;
    struct skv_backend be;
    explicit emu_backend(int sms = 4)
    {
        memset(&impl, 0, sizeof impl);
        impl.sm_count = sms;
        memset(&be, 0, sizeof be);
        be.impl = &impl;
    }
    ~emu_backend()
    {
        free(impl.scratch);
        free(impl.stage);
        free(impl.rope_freq);
        free(impl.rope_pos);
        free(impl.rope_pos_host);
    }
};

static int run(int n, int n_kv, int group, int d, int p0, int p1, int window, int block_rows, int sms)
{
    const int n_heads = n_kv * group;
    kv_case c(n, n_kv, d, p0, p1, window, block_rows);
    std::vector<float> q((size_t)n * n_heads * d), got(q.size(), NAN), want(q.size(), NAN);
    for (auto &x : q) x = rnd();
    struct skv_backend *cpu = NULL;
    skv_backend_cpu_new(1, &cpu);
    if (cpu->ops->attention(cpu, want.data(), q.data(), n, n_heads, &c.kv) != 0) { printf("cpu fail\n"); return 1; }
    skv_backend_destroy(&cpu);
    emu_backend e(sms);
    int rc = cuda_attention(&e.be, got.data(), q.data(), n, n_heads, &c.paged);
    double num = 0, den = 0;
    for (size_t i = 0; i < q.size(); i++) {
        double err = (double)got[i] - want[i];
        if (!std::isfinite(got[i])) num = INFINITY;
        num += err * err; den += (double)want[i] * want[i];
    }
    double nm = num / den;
    printf("%s n=%d kv=%d group=%d d=%d prefix=%d,%d window=%d block_rows=%d sms=%d rc=%d nmse=%.3g smem=%zu\n",
           nm < 1e-10 && rc == 0 ? "ok  " : "FAIL", n, n_kv, group, d, p0, p1, window, block_rows, sms, rc, nm, g_max_smem);
    return !(nm < 1e-10 && rc == 0);
}

/* cuda_attention_batch over n_seq sequences (one query each, their own prefixes and block
 * tables) against cuda_attention once per sequence: bit for bit, and against the CPU op. */
static int run_batch(int n_seq, int n_kv, int group, int d, int max_prefix, int window, int block_rows, int sms)
{
    const int n_heads = n_kv * group;
    const size_t qdim = (size_t)n_heads * d;
    std::vector<std::unique_ptr<kv_case>> cases;
    std::vector<struct skv_kv_view> views;
    for (int s = 0; s < n_seq; s++) {
        int p0 = (int)((s * 7919u) % (unsigned)(max_prefix + 1));
        int p1 = (int)((s * 104729u + 13) % (unsigned)(max_prefix + 1));
        cases.emplace_back(new kv_case(1, n_kv, d, p0, p1, window, block_rows));
        views.push_back(cases.back()->paged);
    }
    std::vector<float> q(n_seq * qdim), want(q.size(), NAN), got(q.size(), NAN), cpu(q.size(), NAN);
    for (auto &x : q) x = rnd();
    struct skv_backend *cb = NULL;
    skv_backend_cpu_new(1, &cb);
    for (int s = 0; s < n_seq; s++)
        if (cb->ops->attention(cb, cpu.data() + s * qdim, q.data() + s * qdim, 1, n_heads, &cases[s]->kv) != 0) {
            printf("cpu fail\n");
            return 1;
        }
    skv_backend_destroy(&cb);
    emu_backend e(sms);
    int rc = 0;
    for (int s = 0; s < n_seq; s++)
        rc |= cuda_attention(&e.be, want.data() + s * qdim, q.data() + s * qdim, 1, n_heads, &views[s]);
    rc |= cuda_attention_batch(&e.be, got.data(), q.data(), n_seq, n_heads, views.data());
    size_t differ = 0;
    double num = 0, den = 0;
    for (size_t i = 0; i < q.size(); i++) {
        differ += memcmp(&got[i], &want[i], sizeof(float)) != 0;
        double err = (double)got[i] - cpu[i];
        num += std::isfinite(got[i]) ? err * err : INFINITY;
        den += (double)cpu[i] * cpu[i];
    }
    bool ok = rc == 0 && differ == 0 && num / den < 1e-10;
    printf("%s batch seqs=%d kv=%d group=%d d=%d prefix<=%d window=%d block_rows=%d sms=%d rc=%d: %zu of %zu differ "
           "from one call each (bitwise), nmse vs cpu %.3g\n",
           ok ? "ok  " : "FAIL", n_seq, n_kv, group, d, max_prefix, window, block_rows, sms, rc, differ, q.size(),
           num / den);
    /* attention_batch_probs: the same output bits, and each asking sequence's probabilities the
     * CPU's column sums of its one query (within rounding; the rows past each head's untouched) */
    std::vector<std::vector<float>> pr(n_seq), want_p(n_seq);
    std::vector<float *> pp(n_seq, nullptr);
    std::vector<int64_t> stride(n_seq);
    skv_backend_cpu_new(1, &cb);
    for (int s = 0; s < n_seq; s++) {
        stride[s] = cases[s]->max_rows + s % 3; /* (n = 1: the longest head's rows) */
        if (n_seq > 1 && s == 1)
            continue; /* one that does not ask */
        pr[s].assign((size_t)n_heads * stride[s], NAN);
        want_p[s].assign(pr[s].size(), NAN);
        pp[s] = pr[s].data();
        rc |= cb->ops->attention_colsum(cb, want_p[s].data(), stride[s], q.data() + s * qdim, 1, n_heads,
                                        &cases[s]->kv, 0);
    }
    skv_backend_destroy(&cb);
    std::vector<float> got_p(q.size(), NAN);
    rc |= cuda_attention_batch_probs(&e.be, got_p.data(), q.data(), n_seq, n_heads, views.data(), pp.data(),
                                     stride.data());
    size_t pdiffer = memcmp(got_p.data(), got.data(), q.size() * sizeof(float)) != 0, bad = 0;
    double worst = 0;
    for (int s = 0; s < n_seq; s++)
        for (size_t i = 0; i < pr[s].size(); i++) {
            const float g = pr[s][i], w = want_p[s][i];
            if (std::isnan(w) || std::isnan(g)) {
                bad += std::isnan(w) != std::isnan(g);
                continue;
            }
            const double e = fabs((double)g - w);
            worst = std::max(worst, e / (w > 0 ? w : 1));
            bad += !(e <= 1e-5 * w + 1e-12);
        }
    const bool pok = rc == 0 && pdiffer == 0 && bad == 0;
    printf("%s batch_probs seqs=%d kv=%d group=%d d=%d: output %s attention_batch's, %zu probabilities off "
           "(largest relative difference %.3g)\n",
           pok ? "ok  " : "FAIL", n_seq, n_kv, group, d, pdiffer ? "differs from" : "equals", bad, worst);
    return !ok + !pok;
}

static int run_colsum(int n, int n_kv, int group, int d, int p0, int p1, int window, int block_rows, int q_first)
{
    const int n_heads = n_kv * group;
    kv_case c(n, n_kv, d, p0, p1, window, block_rows);
    const int stride = c.max_rows + 3;
    std::vector<float> q((size_t)n * n_heads * d);
    for (auto &x : q) x = rnd();
    std::vector<float> got((size_t)stride * n_heads, NAN), want((size_t)stride * n_heads, NAN);
    struct skv_backend *cpu = NULL;
    skv_backend_cpu_new(1, &cpu);
    if (cpu->ops->attention_colsum(cpu, want.data(), stride, q.data(), n, n_heads, &c.kv, q_first) != 0) { printf("cpu fail\n"); return 1; }
    skv_backend_destroy(&cpu);
    emu_backend e;
    int rc = cuda_attention_colsum(&e.be, got.data(), stride, q.data(), n, n_heads, &c.paged, q_first);
    double num = 0, den = 0;
    int layout = 0;
    for (size_t i = 0; i < got.size(); i++) {
        if (std::isnan(want[i]) != std::isnan(got[i])) { layout++; continue; }
        if (std::isnan(want[i])) continue;
        double err = (double)got[i] - want[i];
        num += err * err; den += (double)want[i] * want[i];
    }
    double nm = num / (den > 0 ? den : 1);
    bool ok = rc == 0 && layout == 0 && nm < 1e-10;
    printf("%s colsum n=%d kv=%d group=%d d=%d prefix=%d,%d window=%d block_rows=%d q_first=%d rc=%d nmse=%.3g layout_diffs=%d\n",
           ok ? "ok  " : "FAIL", n, n_kv, group, d, p0, p1, window, block_rows, q_first, rc, nm, layout);
    return !ok;
}

static int run_cosine(int n, int dim)
{
    std::vector<float> a((size_t)n * dim), b((size_t)n * dim);
    for (auto &x : a) x = rnd();
    for (size_t i = 0; i < b.size(); i++) b[i] = a[i] * 0.5f + rnd();
    float want = 0, got = 0;
    struct skv_backend *cpu = NULL;
    skv_backend_cpu_new(1, &cpu);
    cpu->ops->cosine_mean(cpu, &want, a.data(), b.data(), n, dim);
    skv_backend_destroy(&cpu);
    emu_backend e;
    int rc = cuda_cosine_mean(&e.be, &got, a.data(), b.data(), n, dim);
    bool ok = rc == 0 && fabsf(got - want) <= 1e-6f * fabsf(want);
    printf("%s cosine n=%d dim=%d %.9g vs %.9g\n", ok ? "ok  " : "FAIL", n, dim, got, want);
    return !ok;
}

/* row_top_logprobs against the CPU op: random rows, a NaN, two +inf, every logit -inf, two equal
 * largest, four values only (most equal to others), every logit NaN; the same ids, the values
 * within row_logprobs' tolerance, the target's the same bits as out. */
static int run_row_top_logprobs(int n, int nv, int k)
{
    std::vector<float> x((size_t)n * nv);
    for (auto &v : x) v = rnd() * 4.0f;
    std::vector<int32_t> t(n);
    for (int r = 0; r < n; r++) t[r] = (int32_t)((r * 7919 + 3) % nv);
    if (n >= 7) {
        x[(size_t)nv + 1] = NAN;
        x[2 * (size_t)nv + 1] = INFINITY;
        x[2 * (size_t)nv + t[2]] = INFINITY;
        for (int j = 0; j < nv; j++) x[3 * (size_t)nv + j] = -INFINITY;
        x[4 * (size_t)nv + 9] = x[4 * (size_t)nv + 3] = 50.0f;
        for (int j = 0; j < nv; j++) x[5 * (size_t)nv + j] = (float)(j % 4);
        for (int j = 0; j < nv; j++) x[6 * (size_t)nv + j] = NAN;
    }
    std::vector<float> want(n), got(n), want_lp((size_t)n * k), got_lp((size_t)n * k);
    std::vector<int32_t> want_ids((size_t)n * k), got_ids((size_t)n * k);
    struct skv_backend *cpu = NULL;
    if (skv_backend_cpu_new(1, &cpu) || cpu->ops->row_top_logprobs(cpu, want.data(), want_ids.data(), want_lp.data(),
                                                                   k, x.data(), t.data(), n, nv)) {
        printf("FAIL row_top_logprobs: the CPU op\n");
        skv_backend_destroy(&cpu);
        return 1;
    }
    skv_backend_destroy(&cpu);
    emu_backend e;
    int rc = cuda_row_top_logprobs(&e.be, got.data(), got_ids.data(), got_lp.data(), k, x.data(), t.data(), n, nv);
    bool ok = rc == 0 && want_ids == got_ids;
    double worst = 0;
    auto close = [&](float g, float w, bool exact) {
        if (isinf(w) || isinf(g) || exact)
            ok = ok && g == w;
        else
            worst = fmax(worst, fabs((double)g - w) - 1e-7 * fabs(w));
    };
    for (int r = 0; ok && r < n; r++) {
        close(got[r], want[r], n >= 7 && r == 2);
        for (int j = 0; j < k; j++) {
            close(got_lp[(size_t)r * k + j], want_lp[(size_t)r * k + j], n >= 7 && r == 2);
            if (got_ids[(size_t)r * k + j] == t[r])
                ok = ok && got_lp[(size_t)r * k + j] == got[r];
        }
    }
    ok = ok && worst <= 1e-5;
    printf("%s row_top_logprobs n=%d n_vocab=%d k=%d max |diff| %.3g\n", ok ? "ok  " : "FAIL", n, nv, k, worst);
    return !ok;
}

/* row_logprobs against the CPU op: random rows, a NaN, two +inf, every logit -inf. */
static int run_row_logprobs(int n, int nv)
{
    std::vector<float> x((size_t)n * nv);
    for (auto &v : x) v = rnd() * 4.0f;
    std::vector<int32_t> t(n);
    for (int r = 0; r < n; r++) t[r] = (int32_t)((r * 7919 + 3) % nv);
    if (n >= 4) {
        x[(size_t)nv + 1] = NAN;
        x[2 * (size_t)nv + 1] = INFINITY;
        x[2 * (size_t)nv + t[2]] = INFINITY;
        for (int j = 0; j < nv; j++) x[3 * (size_t)nv + j] = -INFINITY;
    }
    if (n >= 5)
        x[4 * (size_t)nv + 9] = x[4 * (size_t)nv + 3] = 50.0f; /* two equal largest: the lower id */
    std::vector<float> want(n), got(n);
    std::vector<int32_t> want_top(n), got_top(n);
    struct skv_backend *cpu = NULL;
    if (skv_backend_cpu_new(1, &cpu) ||
        cpu->ops->row_logprobs(cpu, want.data(), want_top.data(), x.data(), t.data(), n, nv)) {
        printf("FAIL row_logprobs: the CPU op\n");
        skv_backend_destroy(&cpu);
        return 1;
    }
    skv_backend_destroy(&cpu);
    emu_backend e;
    int rc = cuda_row_logprobs(&e.be, got.data(), got_top.data(), x.data(), t.data(), n, nv);
    bool ok = rc == 0 && want_top == got_top && (n < 5 || got_top[4] == 3);
    double worst = 0;
    for (int r = 0; ok && r < n; r++) {
        if (isinf(want[r]) || isinf(got[r]) || (n >= 4 && r == 2))
            ok = got[r] == want[r];
        else
            worst = fmax(worst, fabs((double)got[r] - want[r]) - 1e-7 * fabs(want[r]));
    }
    ok = ok && worst <= 1e-5;
    printf("%s row_logprobs n=%d n_vocab=%d max |diff| %.3g\n", ok ? "ok  " : "FAIL", n, nv, worst);
    return !ok;
}

static int run_group(int n_heads, int n_kv, int64_t stride, const int *len, const int *pooled, float div, int kernel,
                     bool pmax, bool gmax)
{
    std::vector<float> cs((size_t)stride * n_heads), want((size_t)stride * n_kv, NAN), got((size_t)stride * n_kv, NAN);
    for (auto &x : cs) x = fabsf(rnd());
    struct skv_backend *cpu = NULL;
    skv_backend_cpu_new(1, &cpu);
    int rc_cpu = cpu->ops->group_scores(cpu, want.data(), cs.data(), stride, n_heads, n_kv, len, pooled, div, kernel,
                                        pmax, gmax);
    skv_backend_destroy(&cpu);
    emu_backend e;
    int rc = cuda_group_scores(&e.be, got.data(), cs.data(), stride, n_heads, n_kv, len, pooled, div, kernel, pmax, gmax);
    bool ok = rc == 0 && rc_cpu == 0 && memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0;
    printf("%s group_scores heads=%d kv=%d kernel=%d pool=%s gqa=%s (bitwise)\n", ok ? "ok  " : "FAIL", n_heads, n_kv,
           kernel, pmax ? "max" : "avg", gmax ? "max" : "mean");
    return !ok;
}

static int run_topk(const std::vector<float> &keys, int64_t stride, const int *n, int n_seg, int k, bool joint)
{
    std::vector<int32_t> want(keys.size() + 1, -7), got(keys.size() + 1, -7);
    std::vector<int> cw(n_seg, -1), cg(n_seg, -1);
    struct skv_backend *cpu = NULL;
    skv_backend_cpu_new(1, &cpu);
    int rc_cpu = cpu->ops->topk_rows(cpu, want.data(), cw.data(), keys.data(), stride, n, n_seg, k, joint);
    skv_backend_destroy(&cpu);
    emu_backend e;
    int rc = cuda_topk_rows(&e.be, got.data(), cg.data(), keys.data(), stride, n, n_seg, k, joint);
    bool ok = rc == 0 && rc_cpu == 0 && got == want && cg == cw;
    printf("%s topk_rows segments=%d rows0=%d k=%d %s\n", ok ? "ok  " : "FAIL", n_seg, n[0], k,
           joint ? "joint" : "per segment");
    return !ok;
}

/* The decode GEMV: the 16-byte-load kernel and the element kernel on the same rows, both
 * against a double product of the stored (rounded) weights; with n >= 2 also the 16-byte-load
 * kernel's multi-row forms (1, 2 and 4 weight rows a warp, 4 warps a block), which must give bit
 * for bit its one-row form's output, and that output must be each activation row's alone. */
static int run_gemv(int type, int rows, int cols, int n)
{
    const size_t esz = type == SKV_DTYPE_F32 ? 4 : 2, rb = (size_t)cols * esz;
    std::vector<uint8_t> w(rb * rows + 16);
    std::vector<float> wf((size_t)rows * cols), x((size_t)n * cols);
    for (size_t i = 0; i < wf.size(); i++) {
        float v = rnd();
        if (type == SKV_DTYPE_F32) {
            memcpy(&w[i * 4], &v, 4);
            wf[i] = v;
        } else {
            uint16_t h = type == SKV_DTYPE_F16 ? skv_f32_to_fp16(v) : skv_f32_to_bf16(v);
            memcpy(&w[i * 2], &h, 2);
            wf[i] = type == SKV_DTYPE_F16 ? skv_fp16_to_f32(h) : skv_bf16_to_f32(h);
        }
    }
    for (auto &v : x) v = rnd();
    std::vector<float> vec((size_t)n * rows, NAN), ele((size_t)n * rows, NAN), bias(rows);
    for (auto &v : bias) v = rnd();
    unsigned grid = (unsigned)((rows + MM_GEMV_WARPS - 1) / MM_GEMV_WARPS);
    auto both = [&](auto vec_kernel, auto element_kernel) {
        emu_launch(vec_kernel, grid, MM_GEMV_WARPS * 32, 0, vec.data(), (const uint8_t *)w.data(), rb,
                   (const float *)bias.data(), (const float *)x.data(), rows, cols, n);
        emu_launch(element_kernel, grid, MM_GEMV_WARPS * 32, 0, ele.data(), (const uint8_t *)w.data(), rb,
                   (const float *)bias.data(), (const float *)x.data(), rows, cols, n);
    };
    if (type == SKV_DTYPE_F32)
        both(gemv_vec_kernel<SKV_DTYPE_F32, 1, MM_GEMV_WARPS>, gemv_kernel<SKV_DTYPE_F32>);
    else if (type == SKV_DTYPE_F16)
        both(gemv_vec_kernel<SKV_DTYPE_F16, 1, MM_GEMV_WARPS>, gemv_kernel<SKV_DTYPE_F16>);
    else
        both(gemv_vec_kernel<SKV_DTYPE_BF16, 1, MM_GEMV_WARPS>, gemv_kernel<SKV_DTYPE_BF16>);
    size_t rows_differ = 0;
    if (n >= 2) { /* every rows-per-warp choice */
        auto check = [&](int r, auto kernel) {
            std::vector<float> mr((size_t)n * rows, NAN);
            unsigned rgrid = (unsigned)((rows + MM_ROWS_WARPS * r - 1) / (MM_ROWS_WARPS * r));
            emu_launch(kernel, rgrid, MM_ROWS_WARPS * 32, 0, mr.data(), (const uint8_t *)w.data(), rb,
                       (const float *)bias.data(), (const float *)x.data(), rows, cols, n);
            for (size_t i = 0; i < mr.size(); i++)
                rows_differ += memcmp(&mr[i], &vec[i], sizeof(float)) != 0;
        };
        /* and each activation row alone through the one-row form (n = 1): the decode promise */
        auto alone = [&](auto kernel) {
            for (int j = 0; j < n; j++) {
                std::vector<float> one(rows, NAN);
                const float *xj = x.data() + (size_t)j * cols;
                emu_launch(kernel, grid, MM_GEMV_WARPS * 32, 0, one.data(), (const uint8_t *)w.data(), rb,
                           (const float *)bias.data(), xj, rows, cols, 1);
                for (int r = 0; r < rows; r++)
                    rows_differ += memcmp(&one[r], &vec[(size_t)j * rows + r], sizeof(float)) != 0;
            }
        };
        if (type == SKV_DTYPE_F32) {
            check(1, gemv_vec_kernel<SKV_DTYPE_F32, 1, MM_ROWS_WARPS>);
            check(2, gemv_vec_kernel<SKV_DTYPE_F32, 2, MM_ROWS_WARPS>);
            check(MM_VEC_ROWS, gemv_vec_kernel<SKV_DTYPE_F32, MM_VEC_ROWS, MM_ROWS_WARPS>);
            alone(gemv_vec_kernel<SKV_DTYPE_F32, 1, MM_GEMV_WARPS>);
        } else if (type == SKV_DTYPE_F16) {
            check(1, gemv_vec_kernel<SKV_DTYPE_F16, 1, MM_ROWS_WARPS>);
            check(2, gemv_vec_kernel<SKV_DTYPE_F16, 2, MM_ROWS_WARPS>);
            check(MM_VEC_ROWS, gemv_vec_kernel<SKV_DTYPE_F16, MM_VEC_ROWS, MM_ROWS_WARPS>);
            alone(gemv_vec_kernel<SKV_DTYPE_F16, 1, MM_GEMV_WARPS>);
        } else {
            check(1, gemv_vec_kernel<SKV_DTYPE_BF16, 1, MM_ROWS_WARPS>);
            check(2, gemv_vec_kernel<SKV_DTYPE_BF16, 2, MM_ROWS_WARPS>);
            check(MM_VEC_ROWS, gemv_vec_kernel<SKV_DTYPE_BF16, MM_VEC_ROWS, MM_ROWS_WARPS>);
            alone(gemv_vec_kernel<SKV_DTYPE_BF16, 1, MM_GEMV_WARPS>);
        }
    }
    double num_v = 0, num_e = 0, den = 0;
    for (int j = 0; j < n; j++)
        for (int r = 0; r < rows; r++) {
            double ref = bias[r];
            for (int c = 0; c < cols; c++)
                ref += (double)wf[(size_t)r * cols + c] * x[(size_t)j * cols + c];
            double gv = vec[(size_t)j * rows + r], ge = ele[(size_t)j * rows + r];
            num_v += std::isfinite(gv) ? (gv - ref) * (gv - ref) : INFINITY;
            num_e += std::isfinite(ge) ? (ge - ref) * (ge - ref) : INFINITY;
            den += ref * ref;
        }
    bool ok = num_v / den < 1e-11 && num_e / den < 1e-11 && rows_differ == 0;
    printf("%s gemv type=%d rows=%d cols=%d n=%d nmse vec %.3g element %.3g; "
           "multi-row forms and rows alone: %zu differ (bitwise)\n",
           ok ? "ok  " : "FAIL", type, rows, cols, n, num_v / den, num_e / den, rows_differ);
    return !ok;
}

/* rmsnorm on n rows of dim (in place when in_place), against the CPU op: the sum of squares
 * in double either way, so only its order differs. */
static int run_rmsnorm(int n, int dim, bool in_place)
{
    std::vector<float> x((size_t)n * dim), w(dim), want(x.size(), NAN), got(x.size(), NAN);
    for (auto &v : x) v = rnd() * 3;
    for (auto &v : w) v = rnd();
    struct skv_backend *cpu = NULL;
    skv_backend_cpu_new(1, &cpu);
    int rc_cpu = cpu->ops->rmsnorm(cpu, want.data(), x.data(), w.data(), n, dim, 1e-5f);
    skv_backend_destroy(&cpu);
    emu_backend e;
    int rc;
    if (in_place) {
        got = x;
        rc = cuda_rmsnorm(&e.be, got.data(), got.data(), w.data(), n, dim, 1e-5f);
    } else {
        rc = cuda_rmsnorm(&e.be, got.data(), x.data(), w.data(), n, dim, 1e-5f);
    }
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); i++) {
        double err = (double)got[i] - want[i];
        num += std::isfinite(got[i]) ? err * err : INFINITY;
        den += (double)want[i] * want[i];
    }
    bool ok = rc == 0 && rc_cpu == 0 && num / den < 1e-13;
    printf("%s rmsnorm n=%d dim=%d threads=%d%s nmse=%.3g\n", ok ? "ok  " : "FAIL", n, dim, rms_threads(dim),
           in_place ? " in place" : "", num / den);
    return !ok;
}

/* rope over n tokens of n_heads x head_dim (rot_dim rotated), positions from p0 on (twice:
 * the second call reuses the uploaded positions), against the CPU op: bitwise, as both take
 * the same double angle and cos / sin and rotate in float. */
static int run_rope(int n, int n_heads, int head_dim, int rot_dim, int mode, int p0, float l3_factor)
{
    struct skv_rope r;
    memset(&r, 0, sizeof r);
    r.mode = mode;
    r.rot_dim = rot_dim;
    r.theta = 500000.0f;
    r.freq_scale = 1.0f;
    if (l3_factor > 0) {
        r.l3_factor = l3_factor;
        r.l3_low_freq_factor = 1.0f;
        r.l3_high_freq_factor = 4.0f;
        r.l3_original_ctx = 8192;
    }
    std::vector<int32_t> pos(n);
    for (int i = 0; i < n; i++) pos[i] = p0 + 3 * i;
    std::vector<float> x((size_t)n * n_heads * head_dim);
    for (auto &v : x) v = rnd();
    std::vector<float> want = x, got = x;
    struct skv_backend *cpu = NULL;
    skv_backend_cpu_new(1, &cpu);
    int rc_cpu = cpu->ops->rope(cpu, want.data(), n, n_heads, head_dim, pos.data(), &r);
    rc_cpu |= cpu->ops->rope(cpu, want.data(), n, n_heads, head_dim, pos.data(), &r);
    skv_backend_destroy(&cpu);
    emu_backend e;
    int rc = cuda_rope(&e.be, got.data(), n, n_heads, head_dim, pos.data(), &r);
    rc |= cuda_rope(&e.be, got.data(), n, n_heads, head_dim, pos.data(), &r);
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); i++)
        bad += memcmp(&got[i], &want[i], sizeof(float)) != 0;
    bool ok = rc == 0 && rc_cpu == 0 && bad == 0;
    printf("%s rope n=%d heads=%d head_dim=%d rot_dim=%d %s from %d%s: %zu of %zu differ (bitwise)\n",
           ok ? "ok  " : "FAIL", n, n_heads, head_dim, rot_dim, mode == SKV_ROPE_NEOX ? "neox" : "norm", p0,
           l3_factor > 0 ? " llama3" : "", bad, got.size());
    return !ok;
}

/* Suites: attention (the cuBLAS prefill, split-K decode and fallback paths, the batched decode), batch (the
 * batched decode alone), colsum (+ cosine), gemv, topk (+ group scores), norm (rmsnorm and rope), f16 and
 * q8_0 (the KV types); all of them without an argument. */
/* cuda_store_rows_f16 against skv_f32_to_fp16_sat: scattered rows, values past f16's range. */
static int run_store_f16(int n, int d)
{
    std::vector<float> src((size_t)n * d);
    for (size_t i = 0; i < src.size(); i++) src[i] = rnd() * (float)std::ldexp(1.0, (int)(i % 44) - 28);
    src[0] = 65519.0f; src[1] = 65520.0f; src[2] = -1e30f; src[3] = INFINITY;
    std::vector<uint16_t> got((size_t)n * d, 0xabab), want((size_t)n * d);
    std::vector<void *> to(n);
    std::vector<const float *> from(n);
    for (int i = 0; i < n; i++) {
        int j = (i * 7 + 3) % n;
        to[i] = got.data() + (size_t)i * d;
        from[i] = src.data() + (size_t)j * d;
        for (int t = 0; t < d; t++) want[(size_t)i * d + t] = skv_f32_to_fp16_sat(src[(size_t)j * d + t]);
    }
    emu_backend e;
    int rc = cuda_store_rows_f16(&e.be, to.data(), from.data(), d, n);
    bool ok = rc == 0 && got == want;
    printf("%s store_rows_f16 n=%d d=%d rc=%d\n", ok ? "ok  " : "FAIL", n, d, rc);
    return !ok;
}

/* cuda_store_rows_q8_0 against skv_quantize_row_q8_0: scattered rows, blocks of every magnitude,
 * a zero block, a block of ties, one that x / d would round otherwise, a scale in (65504, 65520),
 * values past f16's range, inf and NaN (n * d > 160). */
static int run_store_q8_0(int n, int d)
{
    std::vector<float> src((size_t)n * d);
    for (size_t i = 0; i < src.size(); i++) src[i] = rnd() * (float)std::ldexp(1.0, (int)(i / 32 % 44) - 28);
    for (int t = 32; t < 64 && t < d; t++) src[t] = 0.0f;
    src[0] = 1e30f; src[1] = -INFINITY; src[2] = NAN; src[3] = 2.5f;
    for (int t = 64; t < 96; t++) src[t] = 0.0f; /* d = 1: ties that roundf takes away from zero */
    src[64] = 127.0f; src[65] = 2.5f; src[66] = -0.5f; src[67] = 126.5f; src[68] = -1.5f;
    for (int t = 96; t < 160; t++) src[t] = 0.0f;
    src[96] = 2.7805755f; src[97] = 2.2003765f;  /* x * (1 / d) = 100.5 -> 101; x / d would give 100 */
    src[128] = 8320024.0f; src[129] = 98262.0f;  /* d = 65512 stored as 65504; q from the f32 d: 1 */
    const size_t row = skv_kv_row_bytes(SKV_DTYPE_Q8_0, d);
    std::vector<unsigned char> got((size_t)n * row, 0xab), want((size_t)n * row);
    std::vector<void *> to(n);
    std::vector<const float *> from(n);
    for (int i = 0; i < n; i++) {
        int j = (i * 7 + 3) % n;
        to[i] = got.data() + (size_t)i * row;
        from[i] = src.data() + (size_t)j * d;
        skv_quantize_row_q8_0(want.data() + (size_t)i * row, from[i], d);
    }
    emu_backend e;
    int rc = cuda_store_rows_q8_0(&e.be, to.data(), from.data(), d, n);
    bool ok = rc == 0 && got == want && cuda_store_rows_q8_0(&e.be, to.data(), from.data(), 48, 1) == SKV_E_INVAL;
    printf("%s store_rows_q8_0 n=%d d=%d rc=%d\n", ok ? "ok  " : "FAIL", n, d, rc);
    return !ok;
}

/* The attention, batch and colsum cases both KV types run (with g_kv_type set): decode tiles of
 * 4-value loads, paged and contiguous, windows, split-K, the prefill's gather, head_dim past
 * ATT_MAX_D, the batch kernel, colsum. */
static int run_typed_cases()
{
    int fails = 0;
    fails += run(1, 2, 3, 64, 62, 31, 0, 16, 4);
    fails += run(1, 2, 4, 128, 63, 31, 20, 0, 4);
    fails += run(1, 2, 3, 64, 4096, 2048, 0, 16, 4);
    fails += run(3, 2, 4, 64, 1000, 17, 0, 0, 8);
    fails += run(9, 2, 4, 128, 100, 37, 0, 16, 4);
    fails += run(63, 2, 3, 64, 0, 0, 0, 0, 4);
    fails += run(65, 1, 4, 128, 100, 37, 50, 16, 4);
    fails += run(12, 1, 2, 320, 5, 0, 0, 16, 4);     /* head_dim above ATT_MAX_D: prefill (cuBLAS) */
    fails += run(2, 2, 2, 320, 300, 30, 0, 16, 4);   /* and decode: attention_kernel */
    fails += run_batch(5, 3, 3, 64, 700, 0, 16, 4);
    fails += run_batch(2, 2, 2, 320, 50, 0, 16, 4);
    fails += run_batch(3, 2, 4, 128, 300, 40, 16, 8);
    fails += run_colsum(32, 3, 3, 64, 458, 400, 0, 16, 20);
    fails += run_colsum(1, 2, 4, 128, 1000, 17, 0, 16, 0);
    fails += run_colsum(40, 2, 2, 64, 0, 30, 25, 0, 8);
    return fails;
}

int main(int argc, char **argv)
{
    bool all = argc < 2;
    auto want = [&](const char *s) { return all || strcmp(argv[1], s) == 0; };
    int fails = 0;
    if (want("attention")) {
        /* n kv group d p0 p1 window block_rows sms */
        fails += run(1, 2, 1, 64, 0, 0, 0, 0, 4);
        fails += run(1, 2, 3, 64, 62, 31, 0, 16, 4);
        fails += run(1, 2, 4, 128, 63, 31, 20, 0, 4);
        fails += run(1, 2, 4, 128, 64, 2, 0, 100, 4);
        fails += run(1, 2, 3, 64, 4096, 2048, 0, 16, 4);
        fails += run(3, 2, 4, 64, 1000, 17, 0, 0, 8);
        fails += run(8, 2, 8, 256, 700, 20, 300, 100, 4);
        fails += run(9, 2, 4, 128, 100, 37, 0, 16, 4);
        fails += run(63, 2, 3, 64, 0, 0, 0, 0, 4);
        fails += run(65, 1, 4, 128, 100, 37, 50, 16, 4);
        fails += run(130, 2, 1, 18, 10, 0, 0, 0, 4);
        fails += run(2, 2, 2, 320, 300, 30, 0, 16, 4);
        fails += run(5, 2, 3, 18, 40, 7, 0, 16, 4);      /* decode kernel: odd head_dim */
        fails += run(4, 1, 8, 96, 300, 0, 100, 16, 4);   /* 32 rows in two slices, a window */
        fails += run(12, 1, 2, 320, 5, 0, 0, 16, 4);     /* prefill of a head_dim above ATT_MAX_D */
    }
    if (want("attention") || want("batch")) {
        /* seqs kv group d max_prefix window block_rows sms */
        fails += run_batch(5, 3, 3, 64, 700, 0, 16, 4);
        fails += run_batch(3, 2, 4, 128, 300, 40, 16, 8);  /* a sliding window */
        fails += run_batch(4, 2, 20, 64, 90, 0, 7, 4);     /* 20 rows: two slices */
        fails += run_batch(2, 2, 2, 320, 50, 0, 16, 4);    /* head_dim above ATT_MAX_D: one call each */
        fails += run_batch(1, 2, 3, 64, 200, 0, 16, 4);
    }
    if (want("f16")) { /* kv-type f16: the kernels read f16 rows, the CPU the same values as f32 */
        g_kv_type = SKV_DTYPE_F16;
        fails += run_typed_cases();
        fails += run(5, 2, 3, 18, 40, 7, 0, 16, 4);      /* odd head_dim: element loads */
        fails += run_store_f16(29, 64);
        fails += run_store_f16(7, 13);
        g_kv_type = SKV_DTYPE_F32;
    }
    if (want("q8_0")) { /* kv-type q8_0: the kernels read q8_0 rows, the CPU the values they hold */
        g_kv_type = SKV_DTYPE_Q8_0;
        fails += run_typed_cases();
        fails += run(4, 1, 8, 96, 300, 0, 100, 16, 4);   /* head_dim 96: 3 blocks a row */
        fails += run_store_q8_0(29, 64);
        fails += run_store_q8_0(7, 96);
        g_kv_type = SKV_DTYPE_F32;
    }
    if (want("colsum")) {
        /* n kv group d p0 p1 window block_rows q_first */
        fails += run_colsum(32, 3, 3, 64, 458, 458, 0, 0, 0);
        fails += run_colsum(32, 3, 3, 64, 458, 400, 0, 16, 20);
        fails += run_colsum(1, 2, 4, 128, 1000, 17, 0, 16, 0);
        fails += run_colsum(40, 2, 2, 64, 0, 30, 25, 0, 8);
        fails += run_colsum(17, 1, 4, 128, 300, 0, 100, 100, 0);
        fails += run_colsum(5, 2, 1, 18, 3, 0, 0, 0, 4);
        fails += run_cosine(7, 576);
        fails += run_cosine(300, 64);
        fails += run_row_logprobs(5, 49152);
        fails += run_row_logprobs(3, 37);
        fails += run_row_logprobs(2, 151936); /* Qwen2's vocabulary: 594 logits a thread */
        fails += run_row_top_logprobs(7, 49152, 5);
        fails += run_row_top_logprobs(7, 37, 37); /* the whole vocabulary, fewer logits than threads */
        fails += run_row_top_logprobs(2, 1000, 20);
    }
    if (want("gemv")) {
        const int types[] = {SKV_DTYPE_F32, SKV_DTYPE_F16, SKV_DTYPE_BF16};
        for (int t : types) {
            fails += run_gemv(t, 37, 576, 1);
            fails += run_gemv(t, 9, 4096, 3);
            fails += run_gemv(t, 17, 136, 8);
            fails += run_gemv(t, 8, 2056, 2); /* chunks not a multiple of 32 x unroll */
            fails += run_gemv(t, 35, 1024, 8); /* rows not a multiple of a block's (16) or a warp's (4) */
            fails += run_gemv(t, 6, 4096, 5);
        }
    }
    if (want("topk")) {
        int len[4] = {700, 0, 1, 513}, pooled[4] = {668, 0, 0, 513};
        for (int m = 0; m < 4; m++)
            fails += run_group(12, 4, 701, len, pooled, 7.0f, m < 2 ? 7 : 5, m & 1, m >= 2);
        int l2[2] = {40, 9}, p2[2] = {8, 9};
        fails += run_group(8, 2, 41, l2, p2, 3.0f, 31, false, false);
        std::vector<float> keys(8 * 3000);
        for (auto &x : keys) {
            unsigned v = (unsigned)(fabsf(rnd()) * 30);
            x = v < 10 ? (float)(v % 4) * 0.25f : v == 10 ? -0.0f : v == 11 ? NAN : v == 12 ? -INFINITY : rnd();
        }
        int ns[8] = {3000, 2048, 1, 0, 33, 2999, 512, 700};
        const int ks[] = {0, 1, 7, 40, 511, 1000, 2999, 3000, 40000};
        for (int k : ks)
            for (int j = 0; j < 2; j++) {
                fails += run_topk(keys, 3000, ns, 8, k, j);
                fails += run_topk(keys, 3000, ns, 3, k, j);
            }
        for (auto &x : keys) x = 0.5f;
        fails += run_topk(keys, 3000, ns, 8, 2048, true);
        fails += run_topk(keys, 3000, ns, 8, 100, false);
    }
    if (want("norm")) {
        fails += run_rmsnorm(1, 4096, false);  /* 512 threads, 8 elements each */
        fails += run_rmsnorm(3, 576, true);    /* 96 threads, 6 of each thread's 8 slots used */
        fails += run_rmsnorm(2, 8192 + 77, false); /* past what the registers hold */
        fails += run_rmsnorm(1, 5, false);
        fails += run_rope(1, 32, 128, 128, SKV_ROPE_NORM, 32767, 0);
        fails += run_rope(5, 9, 64, 64, SKV_ROPE_NEOX, 0, 0);
        fails += run_rope(3, 4, 80, 64, SKV_ROPE_NEOX, 1000, 8.0f); /* part of each head rotated */
        fails += run_rope(2, 3, 18, 18, SKV_ROPE_NORM, 5, 0);
    }
    printf("%d failed\n", fails);
    return fails != 0;
}
