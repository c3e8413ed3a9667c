/* CPU causal GQA attention over a struct skv_kv_view: query blocks x key blocks with an
 * online softmax (running max and sum, never an n x n matrix), with the view's sliding window
 * as a per-row lower key bound. The queries of one KV group
 * share every key block they load. Prefill splits work over (KV head, query block); short
 * batches (decode) split the keys into fixed chunks and merge the partial softmaxes.
 * Every split and kernel choice depends on shapes only, so results are bitwise the same for
 * any thread count. */
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "common/status.h"
#include "kernels/cpu/cpu.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "kernels/cpu/vdot.h"
#include "kernels/cpu/vexp.h"
#endif


#define ATT_BK 64            /* keys per block: one K and one V block stay in L1/L2 */
#define ATT_ROWS 64          /* target rows (queries x heads of a group) per query block */
#define ATT_CHUNK_MIN 256    /* split-K: fewest keys per chunk (a multiple of ATT_BK) */
#define ATT_MAX_TASKS 128    /* split-K: most (KV head, chunk) tasks, bounds the partials */
/* A call of at most this many queries (decode steps, short appends) may take split-K, and its
 * blocks the row kernels when they have fewer than ATT_WIDE_MIN_ROWS rows; a call of more takes
 * neither: the wide kernels for every query block. So a query's kernels do not depend on where
 * its call starts once the call has more: a PREFILL after a reused prefix computes more tokens
 * than the engine's small-batch size (at least 9), and a prefill of the whole prompt has them in
 * the same kernels (it gets the bits of the whole prompt's). */
#define ATT_SMALL_CALL 8
#define ATT_LOG2E 1.4426950408889634
/* Below this many multiply-adds (queries x heads x keys x head_dim) a call runs on the
 * calling thread: waking the pool costs more than the work (a decode step at small depth). */
#define ATT_INLINE_MACS (1 << 17)
/* Tiles of at least this many rows take the "wide" kernels, which keep rows in the SIMD
 * lanes (q, scores and output transposed): register-blocked and free of horizontal sums.
 * Fewer rows (decode) take the row kernels, which vectorize along head_dim. */
#define ATT_WIDE_MIN_ROWS 16
#define ATT_RT 16            /* rows per wide tile: two vectors of 8 */

/* One call's shapes and buffers. Scores are kept in base 2 (q is pre-scaled by
 * log2(e)/sqrt(d)), so the softmax uses exp2. */
struct att_ctx {
    float *out;                  /* [n][n_heads][d] */
    const float *q;              /* [n][n_heads][d] */
    const struct skv_kv_view *kv;
    const int32_t *first;        /* [n_kv][n]: first key row each query sees; NULL: 0 */
    int n, n_heads, n_kv, group, d;
    float qscale;
    int bq, nqb;                 /* queries per block, query blocks */
    bool wide_all;               /* more than ATT_SMALL_CALL queries: the wide kernels for every block */
    int64_t max_len;             /* rows of the longest head, the call's n new ones included */
    int64_t chunk;               /* split-K: keys per chunk */
    int nchunks;                 /* split-K: chunks per KV head (0: no split) */
    float *part;                 /* split-K partials: [n_kv][nchunks][rows][d + 2] */
    float *thread_mem;           /* per thread: see get_row_bufs() and get_wide_bufs() */
    size_t thread_floats;
    size_t rows_max;             /* rows of the largest task */
    size_t kvt_floats;           /* per thread, first: an f16 / q8_0 view's key block widened (else 0) */
    size_t memo_cap;             /* a batch over an f16 / q8_0 view with split-K: the key rows a thread's
                                    memo holds widened (its last task's range, att_memo); 0: none */
    size_t memo_floats;          /* per thread, after kvt: the memo (else 0) */
    float *probs;                /* one query (n = 1): [n_heads][probs_stride], each head's scores of its rows
                                    (base 2), then their probabilities (probs_finish); NULL: none */
    int64_t probs_stride;
};

#define ATT_MEMO_ROWS 1024     /* the longest key chunk a memo holds (a call's keys / (128 tasks / KV heads)) */
#define ATT_MEMO_KEY_MAX (ATT_MEMO_ROWS + 4)

/* A thread's memo, in a batch of sequences over an f16 or q8_0 view: the key range of its last
 * split-K task, K and V rows widened, with the raw rows they came from. Sessions forked from one
 * prompt share its blocks, and the batch runs the same (KV head, key chunk) of each back to back
 * on one thread (att_batch_task), so the next task finds its rows widened already: widening is
 * exact, the kernels read the same floats either way. Valid within one call (cleared at its
 * start: the blocks do not change while it runs). */
struct att_memo {
    int64_t n;                   /* rows held (0: none) */
    int64_t n_key;               /* of key: what names those rows (memo_key) */
    const void *key[];           /* [memo_cap + 4] */
};

/* Working set of the row kernels: row r is query i0 + r / group, head g * group + r % group. */
struct row_bufs {
    float *kvt;                  /* f16 / q8_0 view: [2][ATT_BK][d], a block's K and V rows as f32; else NULL */
    struct att_memo *memo;       /* the thread's memo (att_ctx.memo_cap), else NULL */
    float *qs, *acc;             /* [rows][d]: scaled q, unnormalized output */
    float *m, *l;                /* [rows]: running max (base 2) and sum */
    float *s;                    /* [ATT_BK]: one row's scores */
};

/* Working set of the wide kernels, rows padded to rp (a multiple of ATT_RT). */
struct wide_bufs {
    float *kvt;                  /* as in row_bufs */
    size_t rp;
    float *qt;                   /* [d][rp]: scaled q, transposed */
    float *st;                   /* [ATT_BK][rp]: scores, then probabilities */
    float *acct;                 /* [d][rp]: unnormalized output, transposed */
    float *m, *l;                /* [rp] */
    int32_t *lim;                /* [rp]: keys [lo, lim) are visible to the row (0: padding) */
    int32_t *lo;                 /* [rp]: sliding-window start (INT32_MAX: padding) */
};

static size_t round16(size_t x)
{
    return (x + 15) & ~(size_t)15;
}

/* ---- row kernels ------------------------------------------------------------------ */

#if defined(__AVX2__) && defined(__FMA__)

/* s[j] = q . k[j] for the nv key rows k[0..nv). */
static void att_scores(const float *q, const float *const *k, int nv, int d, float *s)
{
    int j = 0;
    for (; j + 8 <= nv; j += 8)
        dot8(q, k + j, d, s + j);
    for (; j < nv; j++)
        s[j] = dot1(q, k[j], d);
}

static float max_of(const float *s, int nv)
{
    int j = 0;
    float m = -INFINITY;
    if (nv >= 8) {
        __m256 mv = _mm256_loadu_ps(s);
        for (j = 8; j + 8 <= nv; j += 8)
            mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        m = _mm_cvtss_f32(h);
    }
    for (; j < nv; j++)
        m = s[j] > m ? s[j] : m;
    return m;
}

/* s[j] = 2^(s[j] - m); returns the sum. */
static float exp2_sub_sum(float *s, int nv, float m)
{
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= nv; j += 8) {
        const __m256 e = skv_exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum8(acc);
    for (; j < nv; j++) {
        s[j] = exp2f(s[j] - m);
        sum += s[j];
    }
    return sum;
}

static void scale_row(float *acc, int d, float alpha)
{
    const __m256 av = _mm256_set1_ps(alpha);
    int t = 0;
    for (; t + 8 <= d; t += 8)
        _mm256_storeu_ps(acc + t, _mm256_mul_ps(_mm256_loadu_ps(acc + t), av));
    for (; t < d; t++)
        acc[t] *= alpha;
}

/* acc[0..d) += sum_j p[j] * v[j] over the nv value rows v[0..nv). */
static void att_accum(float *acc, const float *p, const float *const *v, int nv, int d)
{
    int t = 0;
    for (; t + 64 <= d; t += 64) {
        float *a = acc + t;
        __m256 c0 = _mm256_loadu_ps(a), c1 = _mm256_loadu_ps(a + 8),
               c2 = _mm256_loadu_ps(a + 16), c3 = _mm256_loadu_ps(a + 24),
               c4 = _mm256_loadu_ps(a + 32), c5 = _mm256_loadu_ps(a + 40),
               c6 = _mm256_loadu_ps(a + 48), c7 = _mm256_loadu_ps(a + 56);
        for (int j = 0; j < nv; j++) {
            const __m256 pj = _mm256_broadcast_ss(p + j);
            const float *vr = v[j] + t;
            c0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr), c0);
            c1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8), c1);
            c2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 16), c2);
            c3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 24), c3);
            c4 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 32), c4);
            c5 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 40), c5);
            c6 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 48), c6);
            c7 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 56), c7);
        }
        _mm256_storeu_ps(a, c0);
        _mm256_storeu_ps(a + 8, c1);
        _mm256_storeu_ps(a + 16, c2);
        _mm256_storeu_ps(a + 24, c3);
        _mm256_storeu_ps(a + 32, c4);
        _mm256_storeu_ps(a + 40, c5);
        _mm256_storeu_ps(a + 48, c6);
        _mm256_storeu_ps(a + 56, c7);
    }
    for (; t + 8 <= d; t += 8) {
        __m256 c = _mm256_loadu_ps(acc + t);
        for (int j = 0; j < nv; j++)
            c = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), _mm256_loadu_ps(v[j] + t), c);
        _mm256_storeu_ps(acc + t, c);
    }
    for (; t < d; t++) {
        float c = acc[t];
        for (int j = 0; j < nv; j++)
            c += p[j] * v[j][t];
        acc[t] = c;
    }
}


/* ---- wide kernels (AVX2 only) ----------------------------------------------------- */

#define ATT_HAVE_WIDE 1

/* Scores of one ATT_RT-row tile (rows r0..) against the key rows k[0..nk) of the block:
 * st[j][r] = sum_t qt[t][r] * k[j][t]. 4 keys x 16 rows per register tile. */
static void wide_scores(const struct wide_bufs *w, size_t r0, const float *const *k, int nk,
                        int d)
{
    const size_t rp = w->rp;
    const float *qt = w->qt + r0;
    float *st = w->st + r0;
    int j = 0;
    for (; j + 4 <= nk; j += 4) {
        const float *k0 = k[j], *k1 = k[j + 1], *k2 = k[j + 2], *k3 = k[j + 3];
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00,
               a21 = a00, a30 = a00, a31 = a00;
        for (int t = 0; t < d; t++) {
            const __m256 q0 = _mm256_loadu_ps(qt + t * rp), q1 = _mm256_loadu_ps(qt + t * rp + 8);
            __m256 b = _mm256_broadcast_ss(k0 + t);
            a00 = _mm256_fmadd_ps(b, q0, a00);
            a01 = _mm256_fmadd_ps(b, q1, a01);
            b = _mm256_broadcast_ss(k1 + t);
            a10 = _mm256_fmadd_ps(b, q0, a10);
            a11 = _mm256_fmadd_ps(b, q1, a11);
            b = _mm256_broadcast_ss(k2 + t);
            a20 = _mm256_fmadd_ps(b, q0, a20);
            a21 = _mm256_fmadd_ps(b, q1, a21);
            b = _mm256_broadcast_ss(k3 + t);
            a30 = _mm256_fmadd_ps(b, q0, a30);
            a31 = _mm256_fmadd_ps(b, q1, a31);
        }
        float *s = st + j * rp;
        _mm256_storeu_ps(s, a00);
        _mm256_storeu_ps(s + 8, a01);
        _mm256_storeu_ps(s + rp, a10);
        _mm256_storeu_ps(s + rp + 8, a11);
        _mm256_storeu_ps(s + 2 * rp, a20);
        _mm256_storeu_ps(s + 2 * rp + 8, a21);
        _mm256_storeu_ps(s + 3 * rp, a30);
        _mm256_storeu_ps(s + 3 * rp + 8, a31);
    }
    for (; j < nk; j++) {
        const float *kj = k[j];
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        for (int t = 0; t < d; t++) {
            const __m256 b = _mm256_broadcast_ss(kj + t);
            a0 = _mm256_fmadd_ps(b, _mm256_loadu_ps(qt + t * rp), a0);
            a1 = _mm256_fmadd_ps(b, _mm256_loadu_ps(qt + t * rp + 8), a1);
        }
        _mm256_storeu_ps(st + j * rp, a0);
        _mm256_storeu_ps(st + j * rp + 8, a1);
    }
}

/* Online softmax for 8 rows (r0..) over nk scores of the block starting at key kb:
 * masks keys outside each row's [lo, lim) when `mask`, turns scores into probabilities,
 * updates m and l and rescales the rows' output. */
static void wide_softmax8(const struct wide_bufs *w, size_t r0, int64_t kb, int nk, bool mask,
                          int d)
{
    const size_t rp = w->rp;
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256i limv = _mm256_loadu_si256((const __m256i *)(w->lim + r0));
    const __m256i lov = _mm256_loadu_si256((const __m256i *)(w->lo + r0));
    float *st = w->st + r0;
    __m256 mx = ninf;

    if (mask) {
        for (int j = 0; j < nk; j++) {
            const __m256i key = _mm256_set1_epi32((int32_t)(kb + j));
            const __m256i keep = _mm256_andnot_si256(_mm256_cmpgt_epi32(lov, key),
                                                     _mm256_cmpgt_epi32(limv, key));
            const __m256 s = _mm256_blendv_ps(ninf, _mm256_loadu_ps(st + j * rp),
                                              _mm256_castsi256_ps(keep));
            _mm256_storeu_ps(st + j * rp, s);
            mx = _mm256_max_ps(mx, s);
        }
    } else {
        for (int j = 0; j < nk; j++)
            mx = _mm256_max_ps(mx, _mm256_loadu_ps(st + j * rp));
    }
    const __m256 m_old = _mm256_loadu_ps(w->m + r0);
    const __m256 m_new = _mm256_max_ps(m_old, mx);
    /* rows that have seen no key yet keep m = -inf; subtract 0 instead of -inf for them */
    const __m256 m_use =
        _mm256_blendv_ps(m_new, _mm256_setzero_ps(), _mm256_cmp_ps(m_new, ninf, _CMP_EQ_OQ));
    const __m256 alpha = skv_exp2_ps(_mm256_sub_ps(m_old, m_use));
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < nk; j++) {
        const __m256 p = skv_exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(st + j * rp), m_use));
        _mm256_storeu_ps(st + j * rp, p);
        sum = _mm256_add_ps(sum, p);
    }
    _mm256_storeu_ps(w->l + r0, _mm256_fmadd_ps(_mm256_loadu_ps(w->l + r0), alpha, sum));
    _mm256_storeu_ps(w->m + r0, m_new);
    if (_mm256_movemask_ps(_mm256_cmp_ps(alpha, _mm256_set1_ps(1.0f), _CMP_NEQ_UQ)) != 0) {
        float *a = w->acct + r0;
        for (int t = 0; t < d; t++)
            _mm256_storeu_ps(a + t * rp, _mm256_mul_ps(_mm256_loadu_ps(a + t * rp), alpha));
    }
}

/* acct[t][r] += sum_j st[j][r] * v[j][t] for one tile (value rows v[0..nk)): 4 dims x 16
 * rows per register tile. */
static void wide_accum(const struct wide_bufs *w, size_t r0, const float *const *v, int nk,
                       int d)
{
    const size_t rp = w->rp;
    const float *st = w->st + r0;
    float *acct = w->acct + r0;
    int t = 0;
    for (; t + 4 <= d; t += 4) {
        float *a = acct + t * rp;
        __m256 c00 = _mm256_loadu_ps(a), c01 = _mm256_loadu_ps(a + 8);
        __m256 c10 = _mm256_loadu_ps(a + rp), c11 = _mm256_loadu_ps(a + rp + 8);
        __m256 c20 = _mm256_loadu_ps(a + 2 * rp), c21 = _mm256_loadu_ps(a + 2 * rp + 8);
        __m256 c30 = _mm256_loadu_ps(a + 3 * rp), c31 = _mm256_loadu_ps(a + 3 * rp + 8);
        for (int j = 0; j < nk; j++) {
            const __m256 p0 = _mm256_loadu_ps(st + j * rp), p1 = _mm256_loadu_ps(st + j * rp + 8);
            const float *vj = v[j] + t;
            __m256 b = _mm256_broadcast_ss(vj);
            c00 = _mm256_fmadd_ps(b, p0, c00);
            c01 = _mm256_fmadd_ps(b, p1, c01);
            b = _mm256_broadcast_ss(vj + 1);
            c10 = _mm256_fmadd_ps(b, p0, c10);
            c11 = _mm256_fmadd_ps(b, p1, c11);
            b = _mm256_broadcast_ss(vj + 2);
            c20 = _mm256_fmadd_ps(b, p0, c20);
            c21 = _mm256_fmadd_ps(b, p1, c21);
            b = _mm256_broadcast_ss(vj + 3);
            c30 = _mm256_fmadd_ps(b, p0, c30);
            c31 = _mm256_fmadd_ps(b, p1, c31);
        }
        _mm256_storeu_ps(a, c00);
        _mm256_storeu_ps(a + 8, c01);
        _mm256_storeu_ps(a + rp, c10);
        _mm256_storeu_ps(a + rp + 8, c11);
        _mm256_storeu_ps(a + 2 * rp, c20);
        _mm256_storeu_ps(a + 2 * rp + 8, c21);
        _mm256_storeu_ps(a + 3 * rp, c30);
        _mm256_storeu_ps(a + 3 * rp + 8, c31);
    }
    for (; t < d; t++) {
        float *a = acct + t * rp;
        __m256 c0 = _mm256_loadu_ps(a), c1 = _mm256_loadu_ps(a + 8);
        for (int j = 0; j < nk; j++) {
            const __m256 b = _mm256_broadcast_ss(v[j] + t);
            c0 = _mm256_fmadd_ps(b, _mm256_loadu_ps(st + j * rp), c0);
            c1 = _mm256_fmadd_ps(b, _mm256_loadu_ps(st + j * rp + 8), c1);
        }
        _mm256_storeu_ps(a, c0);
        _mm256_storeu_ps(a + 8, c1);
    }
}

#else /* portable kernels */

/* Without AVX2 every tile takes the row kernels. */
#define ATT_HAVE_WIDE 0

static void wide_scores(const struct wide_bufs *w, size_t r0, const float *const *k, int nk,
                        int d)
{
    (void)w, (void)r0, (void)k, (void)nk, (void)d;
}

static void wide_softmax8(const struct wide_bufs *w, size_t r0, int64_t kb, int nk, bool mask,
                          int d)
{
    (void)w, (void)r0, (void)kb, (void)nk, (void)mask, (void)d;
}

static void wide_accum(const struct wide_bufs *w, size_t r0, const float *const *v, int nk,
                       int d)
{
    (void)w, (void)r0, (void)v, (void)nk, (void)d;
}


static void att_scores(const float *q, const float *const *k, int nv, int d, float *s)
{
    for (int j = 0; j < nv; j++) {
        const float *kr = k[j];
        float acc = 0.0f;
        for (int t = 0; t < d; t++)
            acc += q[t] * kr[t];
        s[j] = acc;
    }
}

static float max_of(const float *s, int nv)
{
    float m = -INFINITY;
    for (int j = 0; j < nv; j++)
        m = s[j] > m ? s[j] : m;
    return m;
}

static float exp2_sub_sum(float *s, int nv, float m)
{
    float sum = 0.0f;
    for (int j = 0; j < nv; j++) {
        s[j] = exp2f(s[j] - m);
        sum += s[j];
    }
    return sum;
}

static void scale_row(float *acc, int d, float alpha)
{
    for (int t = 0; t < d; t++)
        acc[t] *= alpha;
}

static void att_accum(float *acc, const float *p, const float *const *v, int nv, int d)
{
    for (int j = 0; j < nv; j++) {
        const float *vr = v[j];
        for (int t = 0; t < d; t++)
            acc[t] += p[j] * vr[t];
    }
}

#endif

/* One query row against the nv key / value rows k[], v[]: online-softmax update of its
 * running max m, sum l and unnormalized output acc. s is [ATT_BK] scratch; raw (NULL: none)
 * gets the nv scores. */
static void att_row(const float *q, const float *const *k, const float *const *v, int nv, int d,
                    float *m, float *l, float *acc, float *s, float *raw)
{
    att_scores(q, k, nv, d, s);
    if (raw)
        memcpy(raw, s, (size_t)nv * sizeof *s);
    const float mb = max_of(s, nv);
    const float m_new = mb > *m ? mb : *m;
    const float alpha = exp2f(*m - m_new);
    const float sum = exp2_sub_sum(s, nv, m_new);
    *l = *l * alpha + sum;
    *m = m_new;
    if (alpha != 1.0f)
        scale_row(acc, d, alpha);
    att_accum(acc, s, v, nv, d);
}

/* ---- tiles ------------------------------------------------------------------------ */

/* Keys [kb, kb + nk) of KV head g of an f16 / q8_0 view as f32: K rows into k, V rows into v
 * ([nk][head_dim] each). */
static void widen_rows(const struct skv_kv_view *kv, int g, int64_t kb, int nk, float *k, float *v)
{
    const int64_t d = kv->head_dim;
    for (int j = 0; j < nk; j++) {
        skv_cpu_kv_widen(k + j * d, skv_kv_view_row_raw(kv, g, 0, kb + j), kv->kv_type, d);
        skv_cpu_kv_widen(v + j * d, skv_kv_view_row_raw(kv, g, 1, kb + j), kv->kv_type, d);
    }
}

/* Row pointers of keys [kb, kb + nk) of KV head g (nk <= ATT_BK), in either view layout:
 * the kernels read rows through these, so a paged view computes exactly what the
 * contiguous one does (same tiles, same order). An f16 or q8_0 view's rows are widened into kvt
 * ([2][ATT_BK][d]) first, exactly, so the kernels see the f32 view of the same values. */
static void tile_rows(const struct skv_kv_view *kv, int g, int64_t kb, int nk,
                      const float **krow, const float **vrow, float *kvt)
{
    const int64_t d = kv->head_dim;
    if (kv->kv_type != SKV_DTYPE_F32) {
        widen_rows(kv, g, kb, nk, kvt, kvt + (size_t)ATT_BK * d);
        for (int j = 0; j < nk; j++) {
            krow[j] = kvt + (size_t)j * d;
            vrow[j] = kvt + ((size_t)ATT_BK + j) * d;
        }
        return;
    }
    if (kv->block_rows <= 0) {
        const float *K = (const float *)kv->k[g] + kb * d, *V = (const float *)kv->v[g] + kb * d;
        for (int j = 0; j < nk; j++) {
            krow[j] = K + j * d;
            vrow[j] = V + j * d;
        }
        return;
    }
    const int64_t t = kv->block_rows;
    int64_t b = kb / t, off = kb % t;
    for (int j = 0; j < nk; b++, off = 0) { /* one run of rows per block */
        const float *K = (const float *)kv->blocks[g][b] + off * d, *V = K + t * d;
        const int m = t - off < nk - j ? (int)(t - off) : nk - j;
        for (int i = 0; i < m; i++) {
            krow[j + i] = K + i * d;
            vrow[j + i] = V + i * d;
        }
        j += m;
    }
}

/* Row layout: row r of queries [i0, i1) is query i0 + r / group, head g * group + r % group. */
static const float *q_row(const struct att_ctx *c, int g, int i0, size_t r)
{
    const int i = i0 + (int)(r / c->group), h = g * c->group + (int)(r % c->group);
    return c->q + ((int64_t)i * c->n_heads + h) * c->d;
}

static float *out_row(const struct att_ctx *c, int g, int i0, size_t r)
{
    const int i = i0 + (int)(r / c->group), h = g * c->group + (int)(r % c->group);
    return c->out + ((int64_t)i * c->n_heads + h) * c->d;
}

static size_t rows_padded(size_t rows)
{
    return (rows + ATT_RT - 1) / ATT_RT * ATT_RT;
}

/* The per-thread region serves either working set; sizes from the largest task's rows. */
static size_t thread_floats_for(size_t rows_max, int d)
{
    const size_t rp = rows_padded(rows_max);
    const size_t row = 2 * round16(rows_max * d) + 2 * round16(rows_max) + ATT_BK;
    const size_t wide = 2 * round16(rp * d) + round16((size_t)ATT_BK * rp) + 4 * round16(rp);
    return row > wide ? row : wide;
}

static struct row_bufs get_row_bufs(const struct att_ctx *c, int tid)
{
    float *kvt = c->thread_mem + (size_t)tid * c->thread_floats, *base = kvt + c->kvt_floats + c->memo_floats;
    const size_t rd = round16(c->rows_max * c->d), rr = round16(c->rows_max);
    struct row_bufs b = {
        .kvt = c->kvt_floats ? kvt : NULL,
        .memo = c->memo_cap ? (struct att_memo *)(kvt + c->kvt_floats) : NULL,
        .qs = base,
        .acc = base + rd,
        .m = base + 2 * rd,
        .l = base + 2 * rd + rr,
        .s = base + 2 * rd + 2 * rr,
    };
    return b;
}

static struct wide_bufs get_wide_bufs(const struct att_ctx *c, int tid, size_t rows)
{
    float *kvt = c->thread_mem + (size_t)tid * c->thread_floats, *base = kvt + c->kvt_floats + c->memo_floats;
    const size_t rp = rows_padded(rows), rpd = round16(rp * c->d), r16 = round16(rp);
    struct wide_bufs b = {
        .kvt = c->kvt_floats ? kvt : NULL,
        .rp = rp,
        .qt = base,
        .acct = base + rpd,
        .st = base + 2 * rpd,
        .m = base + 2 * rpd + round16((size_t)ATT_BK * rp),
    };
    b.l = b.m + r16;
    b.lim = (int32_t *)(b.l + r16);
    b.lo = b.lim + r16;
    return b;
}

static size_t memo_head_floats(size_t cap)
{
    return round16((sizeof(struct att_memo) + (cap + 4) * sizeof(const void *) + sizeof(float) - 1) / sizeof(float));
}

/* What names keys [ks, ke) of KV head g in c's view (at most memo_cap + 4 entries): the KV type
 * and block size, then a paged view's blocks and where in the first one the range starts, or a
 * contiguous view's first K and V row. Returns the entries. */
static int64_t memo_key(const struct att_ctx *c, int g, int64_t ks, int64_t ke, const void **key)
{
    const struct skv_kv_view *kv = c->kv;
    int64_t n = 0;
    key[n++] = (const void *)(intptr_t)kv->kv_type;
    key[n++] = (const void *)(intptr_t)kv->block_rows;
    if (kv->block_rows <= 0) {
        key[n++] = skv_kv_view_row_raw(kv, g, 0, ks);
        key[n++] = skv_kv_view_row_raw(kv, g, 1, ks);
        return n;
    }
    key[n++] = (const void *)(intptr_t)(ks % kv->block_rows);
    for (int64_t b = ks / kv->block_rows; b <= (ke - 1) / kv->block_rows; b++)
        key[n++] = kv->blocks[g][b];
    return n;
}

static size_t memo_floats_for(size_t cap, int d)
{
    return memo_head_floats(cap) + round16(2 * cap * (size_t)d);
}

/* The memo's rows for keys [ks, ke) of KV head g (cap rows at most): *k its K rows, *v its V
 * rows ([ke - ks][d] each). Returns whether it holds them widened already; if not, it is named
 * for them now and the caller widens them in, tile by tile as it reads them (widen_rows), so a
 * miss reads its rows as the tile path does. */
static bool memo_rows(const struct att_ctx *c, int g, int64_t ks, int64_t ke, struct att_memo *memo,
                      float **k, float **v)
{
    const size_t cap = c->memo_cap, d = (size_t)c->d;
    const int64_t n = ke - ks;
    float *rows = (float *)memo + memo_head_floats(cap);
    const void *key[ATT_MEMO_KEY_MAX];
    const int64_t n_key = memo_key(c, g, ks, ke, key);
    *k = rows;
    *v = rows + cap * d;
    if (memo->n == n && memo->n_key == n_key && memcmp(memo->key, key, (size_t)n_key * sizeof *key) == 0)
        return true;
    memcpy(memo->key, key, (size_t)n_key * sizeof *key);
    memo->n_key = n_key;
    memo->n = 0; /* until the caller has widened every row */
    return false;
}


/* Row kernels: queries [i0, i1) of KV group g over keys [ks, ke), each row limited causally;
 * state in b (m, l, acc must be initialized). */
static void row_range(const struct att_ctx *c, int g, int i0, int i1, int64_t ks, int64_t ke,
                      const struct row_bufs *b)
{
    const int d = c->d, G = c->group;
    const int64_t prefix = c->kv->prefix_len[g];
    const float *krow[ATT_BK], *vrow[ATT_BK];
    float *mk = NULL, *mv = NULL;
    const bool memo = b->memo && ke - ks <= (int64_t)c->memo_cap, held = memo && memo_rows(c, g, ks, ke, b->memo,
                                                                                              &mk, &mv);

    for (int64_t kb = ks; kb < ke; kb += ATT_BK) {
        const int64_t nblk = ke - kb < ATT_BK ? ke - kb : ATT_BK;
        if (memo && !held)
            widen_rows(c->kv, g, kb, (int)nblk, mk + (size_t)(kb - ks) * d, mv + (size_t)(kb - ks) * d);
        if (memo)
            for (int j = 0; j < (int)nblk; j++) {
                krow[j] = mk + (size_t)(kb - ks + j) * d;
                vrow[j] = mv + (size_t)(kb - ks + j) * d;
            }
        else
            tile_rows(c->kv, g, kb, (int)nblk, krow, vrow, b->kvt);
        for (int i = i0; i < i1; i++) {
            const int64_t lim = prefix + i + 1 - kb;
            if (lim <= 0)
                continue;
            const int nv = (int)(lim < nblk ? lim : nblk);
            const int64_t skip = c->first ? c->first[(int64_t)g * c->n + i] - kb : 0;
            if (skip >= nv)
                continue;   /* the whole block is before the row's window */
            const int s0 = skip > 0 ? (int)skip : 0;
            for (int hh = 0; hh < G; hh++) {
                const size_t r = (size_t)(i - i0) * G + hh;
                float *raw = c->probs ? c->probs + (size_t)(g * G + hh) * c->probs_stride + kb + s0 : NULL;
                att_row(b->qs + r * d, krow + s0, vrow + s0, nv - s0, d, &b->m[r], &b->l[r],
                        b->acc + r * d, b->s, raw);
            }
        }
    }
    if (memo)
        b->memo->n = ke - ks; /* every row widened now */
}

/* Runs the row kernels over [ks, ke) from a fresh state left in b. */
static void row_run(const struct att_ctx *c, int g, int i0, int i1, int64_t ks, int64_t ke,
                    const struct row_bufs *b)
{
    const size_t rows = (size_t)(i1 - i0) * c->group;
    for (size_t r = 0; r < rows; r++) {
        const float *src = q_row(c, g, i0, r);
        for (int t = 0; t < c->d; t++)
            b->qs[r * c->d + t] = src[t] * c->qscale;
        b->m[r] = -INFINITY;
        b->l[r] = 0.0f;
    }
    memset(b->acc, 0, rows * c->d * sizeof(float));
    row_range(c, g, i0, i1, ks, ke, b);
}

/* Wide kernels over [ks, ke) from a fresh state left in w (transposed). */
static void wide_run(const struct att_ctx *c, int g, int i0, int i1, int64_t ks, int64_t ke,
                     const struct wide_bufs *w)
{
    const int d = c->d;
    const size_t rows = (size_t)(i1 - i0) * c->group, rp = w->rp;
    const int64_t prefix = c->kv->prefix_len[g];
    const float *krow[ATT_BK], *vrow[ATT_BK];

    for (size_t r = 0; r < rp; r++) {
        const float *src = r < rows ? q_row(c, g, i0, r) : NULL;
        for (int t = 0; t < d; t++)
            w->qt[t * rp + r] = src ? src[t] * c->qscale : 0.0f;
        const int i = i0 + (int)(r / c->group);
        w->lim[r] = src ? (int32_t)(prefix + i + 1) : 0;
        w->lo[r] = !src ? INT32_MAX : c->first ? c->first[(int64_t)g * c->n + i] : 0;
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    memset(w->acct, 0, (size_t)d * rp * sizeof(float));

    for (int64_t kb = ks; kb < ke; kb += ATT_BK) {
        const int nblk = (int)(ke - kb < ATT_BK ? ke - kb : ATT_BK);
        tile_rows(c->kv, g, kb, nblk, krow, vrow, w->kvt);
        for (size_t r0 = 0; r0 < rp; r0 += ATT_RT) {
            int32_t lo = INT32_MAX, hi = 0, first_lo = INT32_MAX, first_hi = 0;
            for (size_t r = r0; r < r0 + ATT_RT; r++) {
                lo = w->lim[r] < lo ? w->lim[r] : lo;
                hi = w->lim[r] > hi ? w->lim[r] : hi;
                if (w->lim[r] > 0) {
                    first_lo = w->lo[r] < first_lo ? w->lo[r] : first_lo;
                    first_hi = w->lo[r] > first_hi ? w->lo[r] : first_hi;
                }
            }
            if (hi <= kb || first_lo >= kb + nblk)
                continue;   /* no row of the tile sees this block */
            const int nk = hi - kb < nblk ? (int)(hi - kb) : nblk;
            const bool mask = lo < kb + nk || first_hi > kb;
            wide_scores(w, r0, krow, nk, d);
            for (size_t r = r0; c->probs && r < r0 + ATT_RT && r < rows; r++) { /* (one query: row r is head r) */
                float *raw = c->probs + (size_t)(g * c->group + (int)r) * c->probs_stride + kb;
                for (int j = 0; j < nk; j++)
                    raw[j] = w->st[(size_t)j * rp + r];
            }
            wide_softmax8(w, r0, kb, nk, mask, d);
            wide_softmax8(w, r0 + 8, kb, nk, mask, d);
            wide_accum(w, r0, vrow, nk, d);
        }
    }
}

static bool use_wide(size_t rows)
{
    return ATT_HAVE_WIDE && rows >= ATT_WIDE_MIN_ROWS;
}

/* Work order: the costliest query blocks (the latest, which see the most keys) first, so the
 * threads, each taking the next task as it finishes one, end on cheap ones together. */
static int latest_first(int j, int nqb)
{
    return nqb - 1 - j;
}

/* Start of the first key block any of queries [i0, i1) of KV head g sees (a multiple of
 * ATT_BK): 0 without a sliding window. */
static int64_t first_block(const struct att_ctx *c, int g, int i0, int i1)
{
    if (!c->first)
        return 0;
    int32_t lo = INT32_MAX;
    for (int i = i0; i < i1; i++)
        lo = c->first[(int64_t)g * c->n + i] < lo ? c->first[(int64_t)g * c->n + i] : lo;
    return (int64_t)lo / ATT_BK * ATT_BK;
}

/* One query's row r of KV group g (head g * group + r), once its softmax's max m and sum l
 * are known: its scores in c->probs become probabilities, 2^(score - m) / l, and the rows
 * before its sliding window's start 0. */
static void probs_finish(const struct att_ctx *c, int g, size_t r, float m, float l)
{
    float *p = c->probs + (size_t)(g * c->group + (int)r) * c->probs_stride;
    const int64_t len = c->kv->prefix_len[g] + 1, lo = c->first ? c->first[(int64_t)g * c->n] : 0;
    const float inv = 1.0f / l;
    memset(p, 0, (size_t)lo * sizeof *p);
    int64_t j = lo;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 mv = _mm256_set1_ps(m), iv = _mm256_set1_ps(inv);
    for (; j + 8 <= len; j += 8)
        _mm256_storeu_ps(p + j, _mm256_mul_ps(skv_exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv)), iv));
#endif
    for (; j < len; j++)
        p[j] = exp2f(p[j] - m) * inv;
}

/* Task t: (query block, KV head), whole causal key range, normalized output. */
static void att_task_blocks(void *p, int64_t begin, int64_t end, int tid)
{
    const struct att_ctx *c = p;
    const int d = c->d;

    for (int64_t t = begin; t < end; t++) {
        const int g = (int)(t % c->n_kv);
        const int qb = latest_first((int)(t / c->n_kv), c->nqb);
        const int i0 = qb * c->bq, i1 = i0 + c->bq < c->n ? i0 + c->bq : c->n;
        const size_t rows = (size_t)(i1 - i0) * c->group;
        const int64_t ke = c->kv->prefix_len[g] + (int64_t)i1;
        const int64_t ks = first_block(c, g, i0, i1);

        if (use_wide(rows) || (ATT_HAVE_WIDE && c->wide_all)) {
            const struct wide_bufs w = get_wide_bufs(c, tid, rows);
            wide_run(c, g, i0, i1, ks, ke, &w);
            for (size_t r = 0; r < rows; r++) {
                float *o = out_row(c, g, i0, r);
                for (int k = 0; k < d; k++)
                    o[k] = w.acct[k * w.rp + r] / w.l[r];
                if (c->probs)
                    probs_finish(c, g, r, w.m[r], w.l[r]);
            }
        } else {
            const struct row_bufs b = get_row_bufs(c, tid);
            row_run(c, g, i0, i1, ks, ke, &b);
            for (size_t r = 0; r < rows; r++) {
                float *o = out_row(c, g, i0, r);
                for (int k = 0; k < d; k++)
                    o[k] = b.acc[r * d + k] / b.l[r];
                if (c->probs)
                    probs_finish(c, g, r, b.m[r], b.l[r]);
            }
        }
    }
}

static float *part_of(const struct att_ctx *c, int g, int ch)
{
    const size_t rows = (size_t)c->n * c->group;
    return c->part + ((size_t)g * c->nchunks + ch) * rows * (c->d + 2);
}

/* Task t: (KV head, key chunk) for all n queries; unnormalized partials acc [rows][d],
 * m [rows], l [rows]. */
static void att_task_chunks(void *p, int64_t begin, int64_t end, int tid)
{
    const struct att_ctx *c = p;
    const int d = c->d;
    const size_t rows = (size_t)c->n * c->group;

    for (int64_t t = begin; t < end; t++) {
        const int g = (int)(t / c->nchunks), ch = (int)(t % c->nchunks);
        float *acc = part_of(c, g, ch), *m = acc + rows * d, *l = m + rows;
        const int64_t len = (int64_t)c->kv->prefix_len[g] + c->n;
        const int64_t ks0 = ch * c->chunk, lo = first_block(c, g, 0, c->n);
        const int64_t ks = ks0 > lo ? ks0 : lo;
        const int64_t ke = ks0 + c->chunk < len ? ks0 + c->chunk : len;

        if (ks >= ke) {
            for (size_t r = 0; r < rows; r++) {
                m[r] = -INFINITY;
                l[r] = 0.0f;
            }
        } else if (use_wide(rows)) {
            const struct wide_bufs w = get_wide_bufs(c, tid, rows);
            wide_run(c, g, 0, c->n, ks, ke, &w);
            for (size_t r = 0; r < rows; r++) {
                for (int k = 0; k < d; k++)
                    acc[r * d + k] = w.acct[k * w.rp + r];
                m[r] = w.m[r];
                l[r] = w.l[r];
            }
        } else {
            const struct row_bufs b = get_row_bufs(c, tid);
            row_run(c, g, 0, c->n, ks, ke, &b);
            memcpy(acc, b.acc, rows * d * sizeof(float));
            memcpy(m, b.m, rows * sizeof(float));
            memcpy(l, b.l, rows * sizeof(float));
        }
    }
}

/* Merges the chunks of each row in chunk order: out = sum_c 2^(m_c - M) acc_c / L. With probs,
 * M and L go to the first chunk's m and l of the row, for probs_task. */
static void att_combine(const struct att_ctx *c)
{
    const int d = c->d;
    const size_t rows = (size_t)c->n * c->group;

    for (int g = 0; g < c->n_kv; g++)
        for (size_t r = 0; r < rows; r++) {
            float mx = -INFINITY;
            for (int ch = 0; ch < c->nchunks; ch++) {
                const float *pm = part_of(c, g, ch) + rows * d;
                if (pm[rows + r] > 0.0f && pm[r] > mx)
                    mx = pm[r];
            }
            float *o = out_row(c, g, 0, r);
            float lsum = 0.0f;
            for (int t = 0; t < d; t++)
                o[t] = 0.0f;
            for (int ch = 0; ch < c->nchunks; ch++) {
                const float *acc = part_of(c, g, ch), *pm = acc + rows * d;
                if (!(pm[rows + r] > 0.0f))
                    continue;
                const float w = exp2f(pm[r] - mx);
                lsum += w * pm[rows + r];
                for (int t = 0; t < d; t++)
                    o[t] += w * acc[r * d + t];
            }
            for (int t = 0; t < d; t++)
                o[t] /= lsum;
            if (c->probs) {
                float *m0 = part_of(c, g, 0) + rows * d; /* (the row's chunks are read) */
                m0[r] = mx;
                m0[rows + r] = lsum;
            }
        }
}

/* Task t of a batch of split-K calls (t = call * n_kv + KV head, c[]: the calls): the
 * probabilities of the KV head's rows, once att_combine left each row's max and sum. */
static void probs_task(void *p, int64_t begin, int64_t end, int tid)
{
    (void)tid;
    const struct att_ctx *calls = p;
    for (int64_t t = begin; t < end; t++) {
        const struct att_ctx *c = &calls[t / calls[0].n_kv];
        const int g = (int)(t % calls[0].n_kv);
        if (!c->probs || c->nchunks == 0)
            continue; /* (finished in its own task) */
        const size_t rows = (size_t)c->n * c->group;
        const float *m0 = part_of(c, g, 0) + rows * c->d;
        for (size_t r = 0; r < rows; r++)
            probs_finish(c, g, r, m0[r], m0[rows + r]);
    }
}

/* A query block: each (KV head, query block) task sees the keys from the block's first visible
 * one to its last query's row, in ATT_BK blocks from a multiple of ATT_BK, and the kernel it
 * takes depends on its rows only; with at least 2 blocks a call never takes split-K. So calls
 * cut at multiples of a block, each of 2 blocks or more, compute every query as one call. */
int skv_cpu_attention_split_rows(struct skv_backend *be, int n_heads, int n_kv_heads)
{
    (void)be;
    if (n_kv_heads <= 0 || n_heads % n_kv_heads != 0)
        return 0;
    int group = n_heads / n_kv_heads;
    return ATT_ROWS / group > 0 ? ATT_ROWS / group : 1;
}

/* Plans one call of n queries over kv: every field of c but its scratch (part, first,
 * thread_mem, which att_bind sets). Returns the floats of scratch the call needs besides the
 * per-thread buffers: its split-K partials, then its window bounds. */
static size_t att_plan(struct att_ctx *c, float *out, const float *q, int n, int n_heads,
                       const struct skv_kv_view *kv)
{
    *c = (struct att_ctx){
        .out = out,
        .q = q,
        .kv = kv,
        .n = n,
        .n_heads = n_heads,
        .n_kv = kv->n_kv_heads,
        .group = n_heads / kv->n_kv_heads,
        .d = kv->head_dim,
        .qscale = (float)(ATT_LOG2E / sqrt((double)kv->head_dim)),
    };
    c->bq = ATT_ROWS / c->group > 0 ? ATT_ROWS / c->group : 1;
    c->nqb = (n + c->bq - 1) / c->bq;

    for (int g = 0; g < c->n_kv; g++)
        if (kv->prefix_len[g] + (int64_t)n > c->max_len)
            c->max_len = kv->prefix_len[g] + (int64_t)n;
    const int64_t max_len = c->max_len;
    c->wide_all = n > ATT_SMALL_CALL;
    if (c->nqb == 1 && !c->wide_all && max_len >= 2 * ATT_CHUNK_MIN) {
        const int64_t max_chunks = ATT_MAX_TASKS / c->n_kv > 1 ? ATT_MAX_TASKS / c->n_kv : 2;
        int64_t per = (max_len + max_chunks - 1) / max_chunks;
        per = (per + ATT_BK - 1) / ATT_BK * ATT_BK;
        c->chunk = per > ATT_CHUNK_MIN ? per : ATT_CHUNK_MIN;
        c->nchunks = (int)((max_len + c->chunk - 1) / c->chunk);
    }
    c->rows_max = (size_t)(c->nqb == 1 ? n : c->bq) * c->group;
    c->kvt_floats = kv->kv_type != SKV_DTYPE_F32 ? round16((size_t)2 * ATT_BK * c->d) : 0;
    c->thread_floats = c->kvt_floats + thread_floats_for(c->rows_max, c->d);
    return round16((size_t)c->n_kv * c->nchunks * c->rows_max * (c->d + 2)) +
           (kv->window > 0 ? round16((size_t)c->n_kv * n) : 0);
}

/* Points a planned call at its scratch (mem: the floats att_plan counted) and at the
 * per-thread buffers (thread_floats each, at least its own), and fills its window bounds. */
static void att_bind(struct att_ctx *c, float *mem, float *thread_mem, size_t thread_floats)
{
    c->part = mem;
    c->thread_mem = thread_mem;
    c->thread_floats = thread_floats;
    if (c->kv->window > 0) {
        int32_t *first = (int32_t *)(mem + round16((size_t)c->n_kv * c->nchunks * c->rows_max * (c->d + 2)));
        for (int g = 0; g < c->n_kv; g++)
            for (int i = 0; i < c->n; i++)
                first[(int64_t)g * c->n + i] = skv_kv_view_first(c->kv, g, i);
        c->first = first;
    }
}

/* A planned call's tasks: (KV head, key chunk) with split-K, else (query block, KV head). */
static int64_t att_tasks(const struct att_ctx *c)
{
    return (int64_t)c->n_kv * (c->nchunks > 0 ? c->nchunks : c->nqb);
}

static void att_run_tasks(const struct att_ctx *c, int64_t begin, int64_t end, int tid)
{
    if (c->nchunks > 0)
        att_task_chunks((void *)c, begin, end, tid);
    else
        att_task_blocks((void *)c, begin, end, tid);
}

/* Multiply-adds of a planned call (queries x heads x longest head x head_dim). */
static int64_t att_macs(const struct att_ctx *c)
{
    return (int64_t)c->n * c->n_heads * c->max_len * c->d;
}

int skv_cpu_attention(struct skv_backend *be, float *out, const float *q, int n, int n_heads,
                      const struct skv_kv_view *kv)
{
    int rc = skv_attention_check("attention", out, q, n, n_heads, kv);
    if (rc < 0)
        return rc;
    if (n == 0)
        return SKV_OK;

    struct att_ctx c;
    size_t own = att_plan(&c, out, q, n, n_heads, kv);
    size_t total = own + (size_t)be->n_threads * c.thread_floats;
    float *mem = skv_cpu_scratch(be, 0, total * sizeof(float));
    if (!mem)
        return skv_errorf(SKV_E_NOMEM, "attention: %zu bytes of scratch", total * sizeof(float));
    att_bind(&c, mem, mem + own, c.thread_floats);

    if (c.nchunks > 0) {
        skv_cpu_parallel_tasks(be, att_tasks(&c), att_task_chunks, &c);
        att_combine(&c);
    } else if (att_macs(&c) < ATT_INLINE_MACS) {
        att_task_blocks(&c, 0, att_tasks(&c), 0);
    } else {
        skv_cpu_parallel_tasks(be, att_tasks(&c), att_task_blocks, &c);
    }
    return SKV_OK;
}

/* Sequences a batched call plans at once (the ones past it go in further rounds). */
#define ATT_BATCH_MAX 64

/* The planned calls of a batch and their tasks in the joint order: task t is task order[t].task
 * of call order[t].seq. The order is by KV head, then key chunk (a call without split-K: query
 * block), then call: sessions forked from one prompt share its blocks, and the same (KV head,
 * key chunk) of each then runs back to back on one thread (a thread runs a contiguous range of
 * the order), which widens an f16 / q8_0 view's rows once for all of them (att_memo). */
struct att_batch_task {
    int32_t seq, task;
};
struct att_batch {
    const struct att_ctx *c;
    const struct att_batch_task *order;
};

static void att_task_batch(void *p, int64_t begin, int64_t end, int tid)
{
    const struct att_batch *b = p;
    for (int64_t t = begin; t < end; t++)
        att_run_tasks(&b->c[b->order[t].seq], b->order[t].task, b->order[t].task + 1, tid);
}

/* Whether sequence s shares its first key row with another of the batch's m (first[]: each
 * one's, NULL for none; forks of one prompt do: their first block): only then may its tasks find
 * their rows in a thread's memo, and widening into the memo costs a sequence that shares nothing
 * more than a tile does. */
static bool shares_rows(const void *const *first, int m, int s)
{
    for (int t = 0; first[s] && t < m; t++)
        if (t != s && first[t] == first[s])
            return true;
    return false;
}

/* Each sequence's call is planned as `attention` plans it and runs the same tasks, so it gets
 * the same bits; only the tasks of all of them share one parallel job (a decode group's
 * attention wakes the pool once per layer, not once per sequence). */
static int att_batch_run(struct skv_backend *be, float *out, const float *q, int n_seq, int n_heads,
                         const struct skv_kv_view *kv, float *const *probs, const int64_t *stride)
{
    const size_t qdim = n_seq > 0 ? (size_t)n_heads * kv[0].head_dim : 0;
    for (int s0 = 0; s0 < n_seq; s0 += ATT_BATCH_MAX) {
        const int m = n_seq - s0 < ATT_BATCH_MAX ? n_seq - s0 : ATT_BATCH_MAX;
        struct att_ctx c[ATT_BATCH_MAX];
        size_t own[ATT_BATCH_MAX], own_total = 0, thread_floats = 0;
        int64_t task0[ATT_BATCH_MAX + 1], macs = 0;
        task0[0] = 0;
        size_t memo_cap = 0; /* the longest key chunk of an f16 / q8_0 view sharing rows: the memo's rows */
        bool shared[ATT_BATCH_MAX];
        const void *first[ATT_BATCH_MAX];
        for (int s = 0; s < m; s++)
            first[s] = kv[s0 + s].n_kv_heads > 0 && kv[s0 + s].prefix_len[0] > 0
                           ? skv_kv_view_row_raw(&kv[s0 + s], 0, 0, 0)
                           : NULL;
        for (int s = 0; s < m; s++) {
            own[s] = att_plan(&c[s], out + (s0 + s) * qdim, q + (s0 + s) * qdim, 1, n_heads, &kv[s0 + s]);
            c[s].probs = probs ? probs[s0 + s] : NULL;
            c[s].probs_stride = probs ? stride[s0 + s] : 0;
            own_total += own[s];
            shared[s] = c[s].nchunks > 0 && kv[s0 + s].kv_type != SKV_DTYPE_F32 && !use_wide((size_t)c[s].group) &&
                        shares_rows(first, m, s); /* (the wide kernels read tiles) */
            if (shared[s] && (size_t)c[s].chunk > memo_cap)
                memo_cap = (size_t)c[s].chunk;
        }
        if (memo_cap > ATT_MEMO_ROWS) /* longer chunks widen tile by tile, as a single call does */
            memo_cap = ATT_MEMO_ROWS;
        for (int s = 0; s < m; s++) {
            task0[s + 1] = task0[s] + att_tasks(&c[s]);
            macs += att_macs(&c[s]);
        }
        const size_t memo_floats = m > 1 && memo_cap ? memo_floats_for(memo_cap, (int)kv[s0].head_dim) : 0;
        size_t kvt_floats = 0;
        for (int s = 0; s < m; s++)
            kvt_floats = c[s].kvt_floats > kvt_floats ? c[s].kvt_floats : kvt_floats;
        for (int s = 0; s < m; s++) {
            if (memo_floats) { /* every call's buffers where the memo stays out of their way */
                c[s].thread_floats += kvt_floats - c[s].kvt_floats + memo_floats;
                c[s].kvt_floats = kvt_floats;
                c[s].memo_floats = memo_floats;
                c[s].memo_cap = shared[s] ? memo_cap : 0;
            }
            thread_floats = c[s].thread_floats > thread_floats ? c[s].thread_floats : thread_floats;
        }
        const size_t order_floats = round16((size_t)task0[m] * sizeof(struct att_batch_task) / sizeof(float));
        size_t total = own_total + order_floats + (size_t)be->n_threads * thread_floats;
        float *mem = skv_cpu_scratch(be, 0, total * sizeof(float));
        if (!mem)
            return skv_errorf(SKV_E_NOMEM, "attention: %zu bytes of scratch", total * sizeof(float));
        float *at = mem;
        for (int s = 0; s < m; s++) {
            att_bind(&c[s], at, mem + own_total + order_floats, thread_floats);
            at += own[s];
        }
        if (memo_floats) /* nothing widened yet in this call */
            for (int t = 0; t < be->n_threads; t++) {
                float *kvt = mem + own_total + order_floats + (size_t)t * thread_floats;
                ((struct att_memo *)(kvt + kvt_floats))->n = 0;
            }
        struct att_batch_task *order = (struct att_batch_task *)(mem + own_total);
        /* by KV head, then key chunk (or query block), then call: the same chunk of forks back to
         * back although their calls have other counts of chunks */
        int64_t most = 0, t = 0;
        for (int s = 0; s < m; s++) {
            const int64_t per = c[s].nchunks > 0 ? c[s].nchunks : c[s].nqb; /* tasks a KV head */
            most = per > most ? per : most;
        }
        for (int g = 0; g < c[0].n_kv; g++)
            for (int64_t k = 0; k < most; k++)
                for (int s = 0; s < m; s++) {
                    if (c[s].nchunks > 0 && k < c[s].nchunks) /* att_task_chunks: g * nchunks + chunk */
                        order[t++] = (struct att_batch_task){s, (int32_t)(g * c[s].nchunks + k)};
                    else if (c[s].nchunks == 0 && k < c[s].nqb) /* att_task_blocks: block * n_kv + g */
                        order[t++] = (struct att_batch_task){s, (int32_t)(k * c[s].n_kv + g)};
                }
        struct att_batch b = {.c = c, .order = order};
        if (macs < ATT_INLINE_MACS)
            att_task_batch(&b, 0, task0[m], 0);
        else if (memo_floats) /* a thread's contiguous run of the order finds what it widened */
            skv_cpu_parallel_for(be, task0[m], 1, att_task_batch, &b);
        else
            skv_cpu_parallel_tasks(be, task0[m], att_task_batch, &b);
        bool finish = false;
        for (int s = 0; s < m; s++)
            if (c[s].nchunks > 0) {
                att_combine(&c[s]);
                finish |= c[s].probs != NULL;
            }
        if (finish) /* (the views share n_kv) */
            skv_cpu_parallel_tasks(be, (int64_t)m * c[0].n_kv, probs_task, c);
    }
    return SKV_OK;
}

int skv_cpu_attention_batch(struct skv_backend *be, float *out, const float *q, int n_seq, int n_heads,
                            const struct skv_kv_view *kv)
{
    int rc = skv_attention_batch_check(out, q, n_seq, n_heads, kv);
    return rc < 0 ? rc : att_batch_run(be, out, q, n_seq, n_heads, kv, NULL, NULL);
}

int skv_cpu_attention_batch_probs(struct skv_backend *be, float *out, const float *q, int n_seq, int n_heads,
                                  const struct skv_kv_view *kv, float *const *probs, const int64_t *stride)
{
    int rc = skv_attention_batch_probs_check(out, q, n_seq, n_heads, kv, probs, stride);
    return rc < 0 ? rc : att_batch_run(be, out, q, n_seq, n_heads, kv, probs, stride);
}
