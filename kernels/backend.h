/* The backend op table: everything the engine and the compression policies compute goes
 * through these function pointers, so the same forward pass runs on the CPU (reference) and
 * on CUDA. Ops know tensors and shapes, never models or sessions.
 * Activations are contiguous row-major f32; weights keep their file dtype (quantized or not). */
#ifndef SKV_BACKEND_H
#define SKV_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Values match GGML's type ids so GGUF tensors map one to one. */
enum skv_dtype {
    SKV_DTYPE_F32 = 0,
    SKV_DTYPE_F16 = 1,
    SKV_DTYPE_Q4_0 = 2,
    SKV_DTYPE_Q4_1 = 3,
    SKV_DTYPE_Q5_0 = 6,
    SKV_DTYPE_Q5_1 = 7,
    SKV_DTYPE_Q8_0 = 8,
    SKV_DTYPE_Q8_1 = 9,
    SKV_DTYPE_Q2_K = 10,
    SKV_DTYPE_Q3_K = 11,
    SKV_DTYPE_Q4_K = 12,
    SKV_DTYPE_Q5_K = 13,
    SKV_DTYPE_Q6_K = 14,
    SKV_DTYPE_Q8_K = 15,
    SKV_DTYPE_I8 = 24,
    SKV_DTYPE_I16 = 25,
    SKV_DTYPE_I32 = 26,
    SKV_DTYPE_I64 = 27,
    SKV_DTYPE_F64 = 28,
    SKV_DTYPE_BF16 = 30,
    SKV_DTYPE_COUNT = 31,
};

/* "f32", "q4_1", ...; NULL when the id is not a known type. */
const char *skv_dtype_name(int type);
/* Elements per block (1 for plain types) and bytes per block; 0 when unknown. */
int64_t skv_dtype_block_elems(int type);
size_t skv_dtype_block_bytes(int type);
/* Bytes of a row of n elements; 0 when n is not a multiple of the block or type unknown. */
size_t skv_dtype_row_bytes(int type, int64_t n);
/* True when the CPU backend can dequantize and multiply with this type. */
bool skv_dtype_supported(int type);

/* A weight or table. ne[0] is the innermost (contiguous) dimension, GGUF order:
 * a matrix mapping cols -> rows has ne[0] = cols (input features), ne[1] = rows. */
struct skv_tensor {
    int type;           /* enum skv_dtype */
    int ndim;
    int64_t ne[4];
    void *data;         /* backend memory (host memory or an mmap on the CPU backend) */
    size_t nbytes;
    const char *name;   /* for error messages; may be NULL */
};

enum skv_rope_mode {
    SKV_ROPE_NORM = 0, /* rotate adjacent pairs (x[2i], x[2i+1]): GGUF llama */
    SKV_ROPE_NEOX = 2, /* rotate halves (x[i], x[i+d/2]): HF checkpoints, Qwen2 */
};

struct skv_rope {
    int mode;            /* enum skv_rope_mode */
    int rot_dim;         /* leading dims of each head that rotate (usually head_dim) */
    float theta;         /* base frequency, e.g. 10000 or 100000 */
    float freq_scale;    /* linear scaling: position * freq_scale (1 = none) */
    /* Llama 3 "llama3" scaling (factor 0 = off) */
    float l3_factor, l3_low_freq_factor, l3_high_freq_factor;
    int l3_original_ctx;
    /* Per-pair frequency factors (GGUF rope_freqs.weight, llama.cpp's freq_factors): pair j's
     * inverse frequency is divided by freq_factors[j]. Host memory, rot_dim / 2 values, each
     * finite and > 0; NULL = none. */
    const float *freq_factors;
};

/* The keys and values one layer's attention reads: per KV head a contiguous [len][d] run
 * of rows of kv_type: f32; f16 (IEEE half, the KV pool's `kv-type f16`: half the bytes); or
 * q8_0 (GGUF's Q8_0 blocks: per 32 values an f16 scale d and 32 int8 q, x = d * q; `kv-type
 * q8_0`, 34 bytes per 32 values; head_dim a multiple of 32). Ops that read f16 or q8_0 rows
 * widen each one to f32 exactly, so attention over them gives bit for bit what it gives over an
 * f32 view of the same values. Query i of a batch of n new tokens sees the
 * first prefix_len[h] + i + 1 rows of head h: the cache before the batch, then the batch
 * causally. So one op serves a fresh prefill (prefix 0), an append and a decode step (n = 1),
 * with per-head lengths after head-wise compression.
 * Sliding window (window > 0, Mistral / Qwen2): the query at original position p sees, of
 * those rows, only the ones whose original position is > p - window. pos[h] gives head h's
 * row positions (host memory, ascending, prefix_len[h] + n of them; query i is at
 * pos[h][prefix_len[h] + i]). Rows that compression dropped are simply absent, so the rows a
 * query sees are always one contiguous range: see skv_kv_view_first().
 * Two layouts of the rows. Contiguous (block_rows == 0: what tests and benchmarks build):
 * k[h] and v[h] each point at [prefix_len[h] + n][head_dim]. Paged (block_rows > 0: what
 * the engine's block pool passes): row j of head h is row j % block_rows of block
 * blocks[h][j / block_rows], one backend allocation holding K [block_rows][head_dim] then
 * V [block_rows][head_dim]; the table itself is host memory. Ops read a row through
 * skv_kv_view_row() (or its device twin) and give bitwise the same results for both. */
#define SKV_MAX_KV_HEADS 64
struct skv_kv_view {
    int n_kv_heads;
    int head_dim;
    int kv_type;                          /* SKV_DTYPE_F32, SKV_DTYPE_F16 or SKV_DTYPE_Q8_0 */
    const void *k[SKV_MAX_KV_HEADS];      /* head h: [prefix_len[h] + n][head_dim] */
    const void *v[SKV_MAX_KV_HEADS];
    int32_t prefix_len[SKV_MAX_KV_HEADS];
    int32_t window;                       /* 0: full causal attention */
    const int32_t *pos[SKV_MAX_KV_HEADS]; /* read only when window > 0 */
    int32_t block_rows;                   /* 0: contiguous k / v; > 0: paged blocks */
    void *const *blocks[SKV_MAX_KV_HEADS]; /* head h: [ceil(rows / block_rows)] blocks */
};

/* Bytes of one row of head_dim elements of a KV type (0 for a type a KV view cannot hold, or
 * q8_0 rows of a head_dim that is not a multiple of 32). */
static inline size_t skv_kv_row_bytes(int kv_type, int64_t head_dim)
{
    if (head_dim <= 0)
        return 0;
    switch (kv_type) {
    case SKV_DTYPE_F32: return (size_t)head_dim * 4;
    case SKV_DTYPE_F16: return (size_t)head_dim * 2;
    case SKV_DTYPE_Q8_0: return head_dim % 32 ? 0 : (size_t)head_dim / 32 * 34;
    default: return 0;
    }
}

/* Row j of head h: K (which == 0) or V (which == 1), in either layout, as raw bytes of
 * kv_type. */
static inline const void *skv_kv_view_row_raw(const struct skv_kv_view *kv, int h, int which, int64_t j)
{
    const size_t row = skv_kv_row_bytes(kv->kv_type, kv->head_dim);
    if (kv->block_rows <= 0)
        return (const char *)(which ? kv->v[h] : kv->k[h]) + (size_t)j * row;
    const int64_t t = kv->block_rows;
    return (const char *)kv->blocks[h][j / t] + (size_t)(which * t + j % t) * row;
}

/* The same row of an f32 view. */
static inline const float *skv_kv_view_row(const struct skv_kv_view *kv, int h, int which, int64_t j)
{
    return (const float *)skv_kv_view_row_raw(kv, h, which, j);
}

/* One weight of a matmul_multi: out[n][rows] = x . w^T (+ bias[rows] when bias != NULL). */
struct skv_matmul_part {
    float *out;
    const struct skv_tensor *w;
    const float *bias;
};

/* First row of head h that query i (of the batch) sees: 0 without a window, else the first
 * row whose position is > the query's position - window (never past the query's own row). */
int32_t skv_kv_view_first(const struct skv_kv_view *kv, int h, int i);
/* SKV_OK when the window fields are usable (window >= 0; a position array per head when
 * window > 0), else SKV_E_INVAL with a message naming op. */
int skv_kv_view_check_window(const struct skv_kv_view *kv, const char *op);
/* SKV_OK when every head of the view has its rows (k and v, or a block table and
 * block_rows > 0), else SKV_E_INVAL with a message naming op. */
int skv_kv_view_check_rows(const struct skv_kv_view *kv, const char *op);
/* The arguments of `attention` (n queries of n_heads over kv: buffers, head counts, an f32, f16
 * or q8_0 view (a backend without the store op of a type refuses views of it itself), lengths,
 * the window's positions, every head's rows), SKV_E_INVAL or SKV_E_UNSUPPORTED with a
 * message naming op otherwise. Every backend's attention checks through it. */
int skv_attention_check(const char *op, const float *out, const float *q, int n, int n_heads,
                        const struct skv_kv_view *kv);
/* The arguments of `attention_batch`: skv_attention_check of each sequence's one query (the
 * message then names the sequence) and views of one shape. */
int skv_attention_batch_check(const float *out, const float *q, int n_seq, int n_heads,
                              const struct skv_kv_view *kv);
/* The arguments of `attention_batch_probs`: those of attention_batch, and for each sequence
 * with a probs buffer a stride past every head's rows (prefix_len + 1). */
int skv_attention_batch_probs_check(const float *out, const float *q, int n_seq, int n_heads,
                                    const struct skv_kv_view *kv, float *const *probs, const int64_t *stride);

struct skv_backend;

struct skv_backend_ops {
    void (*destroy)(struct skv_backend *be);

    /* Memory the ops read and write. On the CPU backend this is host memory. */
    int (*alloc)(struct skv_backend *be, size_t bytes, void **out);
    void (*free)(struct skv_backend *be, void *ptr);
    int (*upload)(struct skv_backend *be, void *dst, const void *src, size_t bytes);
    int (*download)(struct skv_backend *be, void *dst, const void *src, size_t bytes);
    /* Strided copy inside backend memory: rows of row_bytes from src (rows src_stride bytes
     * apart) to dst (dst_stride apart). Regions must not overlap. */
    int (*copy_2d)(struct skv_backend *be, void *dst, size_t dst_stride, const void *src,
                   size_t src_stride, size_t row_bytes, int64_t n_rows);
    /* Block until queued work is done (no-op on the CPU). */
    int (*sync)(struct skv_backend *be);

    /* out[i][:] = dequant(table row ids[i]); out is [n][table->ne[0]]. ids are host memory
     * (the CUDA backend also accepts device pointers), validated by the caller. */
    int (*get_rows)(struct skv_backend *be, float *out, const struct skv_tensor *table,
                    const int32_t *ids, int n);
    /* out[n][rows] = x[n][cols] . W^T (+ bias[rows] when bias != NULL), W = w (ne[0] = cols,
     * ne[1] = rows), any supported dtype. Small n uses quantized GEMV, large n a GEMM. */
    int (*matmul)(struct skv_backend *be, float *out, const struct skv_tensor *w,
                  const float *bias, const float *x, int n);
    /* Optional (NULL: any n): the most rows n for which matmul with w gives each row exactly
     * what it gives that row alone (the kernel a batch of one takes). Batched decode cuts its
     * sessions into groups of this size, so a session's tokens do not depend on how many
     * others decode with it. */
    int (*matmul_rows_as_one)(struct skv_backend *be, const struct skv_tensor *w);
    /* count matmuls of the same x (q/k/v, gate/up), each exactly as `matmul` computes it;
     * the CPU backend quantizes x once and runs all their rows as one parallel job. The
     * weights must share ne[0]; outputs must not overlap x. */
    int (*matmul_multi)(struct skv_backend *be, const struct skv_matmul_part *parts, int count,
                        const float *x, int n);
    /* out[i] = x[i] / rms(x[i]) * w, rows of `dim`; out may alias x. */
    int (*rmsnorm)(struct skv_backend *be, float *out, const float *x, const float *w, int n,
                   int dim, float eps);
    /* In place on x [n][n_heads][head_dim], token i at position pos[i] (pos: host memory; the
     * CUDA backend also accepts device pointers). */
    int (*rope)(struct skv_backend *be, float *x, int n, int n_heads, int head_dim,
                const int32_t *pos, const struct skv_rope *rope);
    /* out = silu(gate) * up, elementwise over count; out may alias gate. */
    int (*swiglu)(struct skv_backend *be, float *out, const float *gate, const float *up,
                  int64_t count);
    /* out = a + b elementwise; out may alias a. */
    int (*add)(struct skv_backend *be, float *out, const float *a, const float *b, int64_t count);
    /* Causal GQA attention of n queries q [n][n_heads][head_dim] over kv (see skv_kv_view,
     * sliding window included); query head h reads KV head h / (n_heads / n_kv_heads). out is
     * [n][n_heads][head_dim]. Tiled by query blocks with an online softmax: never an n x n
     * matrix. scale = 1/sqrt(d). */
    int (*attention)(struct skv_backend *be, float *out, const float *q, int n, int n_heads,
                     const struct skv_kv_view *kv);

    /* Compression scoring. Column sums of the causal attention probabilities the queries
     * q_first..n-1 of the batch give each key: out[h][j] (row stride out_stride floats) for
     * query head h and key row j of its KV head, summed over those queries (a query that
     * cannot see row j adds 0). Same masking and scale as `attention`. */
    int (*attention_colsum)(struct skv_backend *be, float *out, int64_t out_stride, const float *q,
                            int n, int n_heads, const struct skv_kv_view *kv, int q_first);
    /* SnapKV's and H2O's per-KV-head scores from column sums (DESIGN §3). For KV head h of
     * n_kv (g = n_heads / n_kv query heads each) and row j < len[h]: the group's rows
     * colsum[h*g + r][j] (row stride `stride`) reduced over r in order (a float sum divided by
     * g, or the max when gqa_max), then divided by `div`; rows j < pooled[h] are then pooled
     * over rows [0, pooled[h]) with an odd kernel k, stride 1, same padding (max pooling
     * ignores the padding; avg pooling sums in double and divides by k, the padding counting
     * as zeros, as torch's avg_pool1d does); rows from pooled[h] on keep the reduced score.
     * out [n_kv][stride] (backend memory); rows from len[h] on are left alone. */
    int (*group_scores)(struct skv_backend *be, float *out, const float *colsum, int64_t stride,
                        int n_heads, int n_kv, const int *len, const int *pooled, float div,
                        int kernel, bool pool_max, bool gqa_max);
    /* Top-k rows by key. keys [n_seg][stride] (backend memory); segment s has rows
     * [0, n[s]). Keeps the k largest keys of each segment, or with `joint` the k largest over
     * all segments together; equal keys go to the lower segment, then the lower row; NaN ranks
     * below every number. Writes each segment's kept rows in ascending order to idx (host),
     * segment after segment, and their counts to cnt[n_seg] (host). The whole selection runs
     * where the keys are: only the kept rows' indices come back. */
    int (*topk_rows)(struct skv_backend *be, int32_t *idx, int *cnt, const float *keys, int64_t stride,
                     const int *n, int n_seg, int k, bool joint);
    /* Mean over the n rows of cos(a[i], b[i]) (rows of dim); written to *out (host). */
    int (*cosine_mean)(struct skv_backend *be, float *out, const float *a, const float *b, int n,
                       int dim);
    /* n rows of row_bytes, each from its own place to its own place: dst[i] <- src[i] (host
     * arrays of backend pointers; what a paged KV compaction moves between blocks in one
     * call). No destination row may overlap a source row or another destination. */
    int (*copy_rows)(struct skv_backend *be, void *const *dst, const void *const *src, size_t row_bytes,
                     int n);

    /* Tensor exchange with other processes. ipc_open maps another process's device buffer,
     * given the bytes of its IPC handle (CUDA: a 64-byte cudaIpcMemHandle_t), into memory the
     * other ops (upload, download, copy_2d) accept, and gives the bytes from *out to the end of
     * the allocation as the device knows it (the client's own figure is not to be trusted: the
     * copy engine would read or write any of the daemon's memory past it); SKV_E_UNSUPPORTED on
     * a backend without it (the CPU: clients use POSIX shared memory). ipc_close unmaps what
     * ipc_open returned. */
    int (*ipc_open)(struct skv_backend *be, const void *handle, size_t handle_len, void **out, uint64_t *bytes_out);
    void (*ipc_close)(struct skv_backend *be, void *ptr);

    /* Optional (NULL or 0: never): a count r of queries such that `attention` over n queries
     * gives every query bit for bit what it gives when the n are cut into calls of multiples of
     * r queries, each at least 2 r, the later ones with the earlier ones' rows as their prefix.
     * A long forward cuts its attention so, to do other work between the calls. */
    int (*attention_split_rows)(struct skv_backend *be, int n_heads, int n_kv_heads);

    /* Optional (NULL: every type skv_dtype_supported names): whether get_rows and matmul take
     * weights of this type. The model converts weights of other types to f16 as it copies them
     * into backend memory. */
    bool (*weight_type_ok)(int type);

    /* Optional (NULL: never): after an op failed with SKV_E_DEVICE, whether the device can run
     * nothing more (CUDA: a sticky error, an illegal address or a lost device, that every later
     * call returns). The daemon then stops with an error, so that its service manager starts a
     * fresh one, instead of failing every request while its watchdog sees progress. */
    bool (*device_lost)(struct skv_backend *be);

    /* Optional (NULL: `attention` once per sequence): the decode attention of n_seq
     * sequences, one new query each, in one call. Sequence s's query is q + s * n_heads *
     * head_dim, over kv[s] (prefix_len[h] rows before its one new row, as `attention` with
     * n = 1 reads a view), and its output goes to out + s * n_heads * head_dim. Every
     * sequence gets bit for bit what `attention` with n = 1 gives it, whatever else is in the
     * call. The views share n_kv_heads and head_dim. A decode group's attention as one call:
     * the CPU runs every sequence's tasks as one parallel job, the GPU uploads every block
     * table in one copy and launches one decode and one combine kernel for all. */
    int (*attention_batch)(struct skv_backend *be, float *out, const float *q, int n_seq, int n_heads,
                           const struct skv_kv_view *kv);
    /* Optional (NULL: none; a layer hook that wants a decode step's probabilities computes them
     * with attention_colsum): attention_batch that also gives, for each sequence s with
     * probs[s] != NULL (backend memory), the probability its query's head h gave each row j of
     * the head's KV head kvh = h / (n_heads / n_kv_heads): probs[s][h * stride[s] + j] for j <=
     * prefix_len[kvh], 0 before a sliding window's start, from the scores and the softmax's max
     * and sum the attention computed (what attention_colsum gives the one query, to within
     * rounding); the rest of each row is left alone; stride (host) > every prefix_len of the
     * sequence. out gets bit for bit what attention_batch gives. H2O's decode
     * upkeep scores a step's rows with them instead of computing every score again. */
    int (*attention_batch_probs)(struct skv_backend *be, float *out, const float *q, int n_seq, int n_heads,
                                 const struct skv_kv_view *kv, float *const *probs, const int64_t *stride);

    /* Optional (NULL: the backend keeps f32 KV only): n rows of d f32 values, each from its own
     * place to its own place as f16, rounded to nearest even and saturating at +-65504
     * (skv_f32_to_fp16_sat; a NaN stays a NaN, its bits may differ by backend) (host arrays of backend
     * pointers, as copy_rows). What the engine stores a forward's new K / V rows with in a
     * pool of `kv-type f16`; a backend that has it also reads f16 views in attention,
     * attention_batch and attention_colsum. */
    int (*store_rows_f16)(struct skv_backend *be, void *const *dst, const float *const *src, int d, int n);

    /* Optional (NULL: no q8_0 KV): the same as q8_0 rows (d a multiple of 32), each 32 values
     * quantized as skv_quantize_row_q8_0 does (GGUF's reference quantizer). What a pool of
     * `kv-type q8_0` stores rows with; a backend that has it also reads q8_0 views. */
    int (*store_rows_q8_0)(struct skv_backend *be, void *const *dst, const float *const *src, int d, int n);

    /* Optional (NULL: the engine downloads the logits and takes skv_logprobs of each row on the
     * host): the log-probability of one target per row, out[r] (host) = logits[r][targets[r]] -
     * log(sum_j exp(logits[r][j])) over n rows of n_vocab logits (backend memory; targets host,
     * each in [0, n_vocab), else SKV_E_INVAL), a NaN logit counting as -inf; where some logits
     * are +inf those k share the mass (log(1 / k) each, -inf for the rest); with none finite or
     * +inf, -inf. Within 1e-5 + 1e-7 |lp| of the log-softmax in double (the exponentials may be
     * single precision; the result is a float). top (host, may be NULL): each row's most likely
     * token, the lowest id among equal largest logits (a NaN is never the largest; 0 when every
     * logit is NaN). What scores a prompt's tokens (skv_forward_opts.targets). */
    int (*row_logprobs)(struct skv_backend *be, float *out, int32_t *top, const float *logits, const int32_t *targets,
                        int n, int n_vocab);

    /* Optional (NULL: the engine downloads the logits and ranks each row with skv_logprobs on
     * the host): row_logprobs' out, and each row's k most likely tokens (k in [1, n_vocab]) with
     * their log-probabilities, ids[r][k] and lps[r][k] (host), most likely first, equal ones by
     * the lower id, a NaN ranked as -inf (skv_logprobs' order; so ids[r][0] is row_logprobs'
     * top, but in a row without a finite or +inf logit where a NaN comes before the first
     * -inf: there it is that NaN's id). The values as out's, within its tolerance; the
     * target's, where it is listed, the same bits as out[r]. What prompt_top_logprobs ranks
     * with (skv_forward_opts.target_top_n), and the engine's target_top then. */
    int (*row_top_logprobs)(struct skv_backend *be, float *out, int32_t *ids, float *lps, int k, const float *logits,
                            const int32_t *targets, int n, int n_vocab);
};

struct skv_backend {
    const char *name;          /* "cpu", "cuda" */
    const struct skv_backend_ops *ops;
    int n_threads;
    void *impl;                /* the implementation's own state: no file-static globals */
};

/* Constructors. Each returns SKV_OK or a negative status with skv_error_msg() set. */
int skv_backend_cpu_new(int n_threads, struct skv_backend **out);
/* CUDA: SKV_E_UNSUPPORTED when not compiled in, SKV_E_DEVICE when no device answers. */
int skv_backend_cuda_new(int device, struct skv_backend **out);
bool skv_backend_cuda_compiled(void);
/* name: "auto" (CUDA when a device answers, else the CPU), "cpu" or "cuda". */
int skv_backend_open(const char *name, int n_threads, struct skv_backend **out);
/* Accepts NULL and *be_p == NULL; sets *be_p to NULL. */
void skv_backend_destroy(struct skv_backend **be_p);
/* A quick parity check of a few ops against the CPU reference (used before trusting a device
 * backend at start-up). SKV_OK or SKV_E_DEVICE with a message. */
int skv_backend_selftest(struct skv_backend *be);

/* RoPE inverse frequencies of the `half` rotated pairs (theta, then Llama 3 scaling as HF
 * transformers defines it, then division by freq_factors), in double; the position scale
 * (freq_scale) is not applied. */
void skv_rope_inv_freq(const struct skv_rope *rope, int half, double *inv_freq);
/* True when every one of the `half` frequency factors is finite and > 0 (or there are none). */
bool skv_rope_factors_valid(const struct skv_rope *rope, int half);
/* Largest rot_dim a rope op takes (its per-token angle tables live on the stack). */
#define SKV_ROPE_MAX_DIM 1024
/* The rope op's argument rules, shared by every backend: SKV_OK, or SKV_E_INVAL with a message
 * for an unknown mode, a rot_dim that is odd, above head_dim or SKV_ROPE_MAX_DIM, a bad theta /
 * freq_scale, inconsistent Llama 3 scaling or a frequency factor that is not finite and > 0. */
int skv_rope_check(const struct skv_rope *rope, int head_dim);

/* The group_scores and topk_rows ops' argument rules, shared by every backend: SKV_OK or
 * SKV_E_INVAL with a message (shapes, more than SKV_MAX_KV_HEADS KV heads or segments, lengths
 * above the stride, pooled rows above a length, an even or non-positive kernel, div not finite
 * and > 0, k < 0). */
int skv_group_scores_check(const float *out, const float *colsum, int64_t stride, int n_heads, int n_kv,
                           const int *len, const int *pooled, float div, int kernel);
int skv_topk_check(const int32_t *idx, const int *cnt, const float *keys, int64_t stride, const int *n,
                   int n_seg, int k);
/* Rows topk_rows keeps in all: min(k, n[s]) summed over segments, or min(k, sum of n[s]) when
 * joint (the capacity idx needs). */
int64_t skv_topk_total(const int *n, int n_seg, int k, bool joint);

/* Host-side dequantization of n elements (n a multiple of the block size) of `type`. */
int skv_dequantize_row(int type, const void *src, float *dst, int64_t n);

/* fp16 / bf16 scalar conversions (host). */
float skv_fp16_to_f32(uint16_t h);
uint16_t skv_f32_to_fp16(float f);
/* The same, saturating: magnitudes past 65504 (f16's largest) give +-65504, not inf; NaN stays
 * NaN. What f16 KV rows are stored with. */
static inline uint16_t skv_f32_to_fp16_sat(float f)
{
    return skv_f32_to_fp16(f > 65504.0f ? 65504.0f : f < -65504.0f ? -65504.0f : f);
}
float skv_bf16_to_f32(uint16_t h);
uint16_t skv_f32_to_bf16(float f);

/* n f32 values (n a multiple of 32) as Q8_0 blocks, as GGUF's reference quantizer (ggml's
 * quantize_row_q8_0_ref, gguf-py's Q8_0.quantize_blocks) makes them: per 32 values d = amax /
 * 127 (amax the largest magnitude), stored as f16, and q = roundf(x * (1 / d)) with the f32 d,
 * halves away from zero (all q 0 when d is 0). Past what the reference keeps finite, so that
 * every stored block is finite and every value in range: a d of 65520 or more (an infinite f16)
 * becomes 65504 (q then saturates at +-127), and NaN is ignored by amax and gives q = 0. What
 * q8_0 KV rows are stored with. */
void skv_quantize_row_q8_0(void *dst, const float *src, int64_t n);
/* A KV type's name (the config's kv-type: "f32", "f16", "q8_0") as its SKV_DTYPE_, or -1. */
int skv_kv_type_parse(const char *name);
/* Whether backend `be` stores (and so reads) KV rows of kv_type: f32 always, f16 and q8_0 with
 * their store op. */
bool skv_backend_kv_type_ok(const struct skv_backend *be, int kv_type);

#endif
