/* The CPU backend object: its persistent thread pool (skv_cpu_parallel_for), per-thread
 * scratch buffers, host memory ops and the op table pointing at the kernels in ops.c,
 * attention.c and matmul.c. All state lives in struct skv_cpu, reached through be->impl. */
#include "kernels/cpu/cpu.h"

#include <assert.h>
#include <cblas.h>
#include <pthread.h>
#include <sched.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/status.h"
#include "common/thread.h"


#define CPU_MAX_THREADS 256
#define CPU_ALIGN 64
/* How long an idle worker spins for the next job before it sleeps on the condition
 * variable: decode issues a parallel_for every few tens of microseconds. */
#define CPU_SPIN_NS 100000L
/* Caller-side spins on completion before it starts yielding the core. */
#define CPU_WAIT_SPINS 4096

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* The work word packs the job generation (bits 32..63), its chunk count (16..31) and the
 * next unclaimed chunk (0..15): a worker claims a chunk with one CAS that also proves the
 * job is still the one it read, so a late worker can never run a chunk of a finished job. */
#define WORK_GEN(w) ((uint32_t)((w) >> 32))
#define WORK_NCHUNKS(w) ((uint32_t)(((w) >> 16) & 0xffffu))
#define WORK_NEXT(w) ((uint32_t)((w)&0xffffu))
#define WORK_MAX_CHUNKS 0xffff

struct cpu_scratch {
    alignas(CPU_ALIGN) void *ptr;
    size_t cap;
};

struct cpu_worker {
    struct skv_cpu *cpu;
    int tid;
    pthread_t thread;
};

struct skv_cpu {
    struct skv_backend be;
    int n_threads;

    /* The current job: written by the caller before it publishes a new generation in
     * `work`, read by a worker only after it claimed a chunk of that generation. */
    skv_cpu_task_fn job_fn;
    void *job_arg;
    int64_t job_n;
    int64_t job_grain;
    int64_t job_ngrains;
    uint32_t gen;                         /* caller side copy of the last generation */

    alignas(CPU_ALIGN) _Atomic uint64_t work;
    alignas(CPU_ALIGN) atomic_int done;   /* chunks of the current job finished */
    alignas(CPU_ALIGN) atomic_int n_sleeping;
    atomic_bool stop;
    atomic_bool busy;                     /* a parallel_for is running (not reentrant) */

    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct cpu_worker *workers;           /* [n_threads - 1], thread ids 1.. */
    int n_started;
    struct cpu_scratch *scratch;          /* [n_threads] */
};

static struct skv_cpu *cpu_of(struct skv_backend *be)
{
    return (struct skv_cpu *)be->impl;
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Chunk c of nch over ng grains, balanced to within one grain. */
static void chunk_range(const struct skv_cpu *cpu, int64_t c, int64_t nch, int64_t *begin,
                        int64_t *end)
{
    int64_t ng = cpu->job_ngrains, base = ng / nch, rem = ng % nch;
    int64_t gb = c * base + (c < rem ? c : rem);
    int64_t ge = gb + base + (c < rem ? 1 : 0);
    int64_t e = ge * cpu->job_grain;
    *begin = gb * cpu->job_grain;
    *end = e < cpu->job_n ? e : cpu->job_n;
}

/* Claims and runs chunks of generation `gen` until none is left (or a newer job exists). */
static void run_chunks(struct skv_cpu *cpu, uint32_t gen, int tid)
{
    for (;;) {
        uint64_t w = atomic_load_explicit(&cpu->work, memory_order_acquire);
        if (WORK_GEN(w) != gen || WORK_NEXT(w) >= WORK_NCHUNKS(w))
            return;
        if (!atomic_compare_exchange_weak_explicit(&cpu->work, &w, w + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        int64_t begin, end;
        chunk_range(cpu, WORK_NEXT(w), WORK_NCHUNKS(w), &begin, &end);
        cpu->job_fn(cpu->job_arg, begin, end, tid);
        atomic_fetch_add_explicit(&cpu->done, 1, memory_order_release);
    }
}

static void *worker_main(void *p)
{
    struct cpu_worker *wk = p;
    struct skv_cpu *cpu = wk->cpu;
    uint32_t seen = WORK_GEN(atomic_load(&cpu->work));

    for (;;) {
        bool ready = false;
        int64_t t0 = now_ns();
        for (int spins = 0;; spins++) {
            if (atomic_load_explicit(&cpu->stop, memory_order_relaxed) ||
                WORK_GEN(atomic_load_explicit(&cpu->work, memory_order_relaxed)) != seen) {
                ready = true;
                break;
            }
            cpu_relax();
            if ((spins & 63) == 63 && now_ns() - t0 > CPU_SPIN_NS)
                break;
        }
        if (!ready) {
            /* n_sleeping is raised before the generation is re-read (both seq_cst), and
             * the caller stores the generation before reading n_sleeping: one of the two
             * always sees the other, so no wake-up is lost. */
            pthread_mutex_lock(&cpu->mu);
            atomic_fetch_add(&cpu->n_sleeping, 1);
            while (!atomic_load(&cpu->stop) && WORK_GEN(atomic_load(&cpu->work)) == seen)
                pthread_cond_wait(&cpu->cv, &cpu->mu);
            atomic_fetch_sub(&cpu->n_sleeping, 1);
            pthread_mutex_unlock(&cpu->mu);
        }
        if (atomic_load(&cpu->stop))
            break;
        seen = WORK_GEN(atomic_load_explicit(&cpu->work, memory_order_acquire));
        run_chunks(cpu, seen, wk->tid);
    }
    return NULL;
}

/* Runs fn over [0, n) in grains of `grain`, split into `most` chunks or fewer (one per grain
 * at most), which the threads claim one at a time. */
static void parallel_run(struct skv_cpu *cpu, int64_t n, int64_t grain, int64_t most, skv_cpu_task_fn fn,
                         void *arg)
{
    if (n <= 0)
        return;
    if (grain < 1)
        grain = 1;
    int64_t ngrains = (n - 1) / grain + 1;
    int64_t nch = ngrains < most ? ngrains : most;
    if (cpu->n_threads <= 1 || nch <= 1) {
        fn(arg, 0, n, 0);
        return;
    }

    bool was_busy = atomic_exchange(&cpu->busy, true);
    assert(!was_busy && "skv_cpu_parallel_for is not reentrant");
    (void)was_busy;

    cpu->job_fn = fn;
    cpu->job_arg = arg;
    cpu->job_n = n;
    cpu->job_grain = grain;
    cpu->job_ngrains = ngrains;
    cpu->gen++;
    atomic_store_explicit(&cpu->done, 0, memory_order_relaxed);
    atomic_store(&cpu->work, ((uint64_t)cpu->gen << 32) | ((uint64_t)nch << 16));
    if (atomic_load(&cpu->n_sleeping) > 0) {
        pthread_mutex_lock(&cpu->mu);
        pthread_cond_broadcast(&cpu->cv);
        pthread_mutex_unlock(&cpu->mu);
    }

    run_chunks(cpu, cpu->gen, 0);
    for (int spins = 0; atomic_load_explicit(&cpu->done, memory_order_acquire) < nch; spins++) {
        if (spins < CPU_WAIT_SPINS)
            cpu_relax();
        else
            sched_yield();
    }
    atomic_store(&cpu->busy, false);
}

void skv_cpu_parallel_for(struct skv_backend *be, int64_t n, int64_t grain, skv_cpu_task_fn fn,
                          void *arg)
{
    struct skv_cpu *cpu = cpu_of(be);
    parallel_run(cpu, n, grain, cpu->n_threads, fn, arg);
}

void skv_cpu_parallel_tasks(struct skv_backend *be, int64_t n, skv_cpu_task_fn fn, void *arg)
{
    struct skv_cpu *cpu = cpu_of(be);
    parallel_run(cpu, n, 1, WORK_MAX_CHUNKS, fn, arg);
}

void *skv_cpu_scratch(struct skv_backend *be, int thread_id, size_t bytes)
{
    struct skv_cpu *cpu = cpu_of(be);

    assert(thread_id >= 0 && thread_id < cpu->n_threads);
    if (thread_id < 0 || thread_id >= cpu->n_threads)
        return NULL;
    struct cpu_scratch *s = &cpu->scratch[thread_id];
    if (bytes <= s->cap && s->ptr)
        return s->ptr;

    size_t want = bytes + bytes / 4;   /* some headroom so slowly growing sizes settle */
    if (want < bytes || want > SIZE_MAX - CPU_ALIGN)
        return NULL;
    want = (want + CPU_ALIGN - 1) / CPU_ALIGN * CPU_ALIGN;
    if (want == 0)
        want = CPU_ALIGN;
    void *p = aligned_alloc(CPU_ALIGN, want);
    if (!p)
        return NULL;
    free(s->ptr);
    s->ptr = p;
    s->cap = want;
    return p;
}

static int cpu_alloc(struct skv_backend *be, size_t bytes, void **out)
{
    (void)be;
    if (!out)
        return skv_errorf(SKV_E_INVAL, "cpu alloc: NULL out");
    if (bytes > SIZE_MAX - CPU_ALIGN)
        return skv_errorf(SKV_E_NOMEM, "cpu alloc: %zu bytes", bytes);
    size_t sz = (bytes + CPU_ALIGN - 1) / CPU_ALIGN * CPU_ALIGN;
    void *p = aligned_alloc(CPU_ALIGN, sz ? sz : CPU_ALIGN);
    if (!p)
        return skv_errorf(SKV_E_NOMEM, "cpu alloc: %zu bytes", bytes);
    *out = p;
    return SKV_OK;
}

static void cpu_free(struct skv_backend *be, void *ptr)
{
    (void)be;
    free(ptr);
}

static int cpu_copy(struct skv_backend *be, void *dst, const void *src, size_t bytes)
{
    (void)be;
    if (bytes == 0)
        return SKV_OK;
    if (!dst || !src)
        return skv_errorf(SKV_E_INVAL, "cpu copy: NULL buffer");
    memcpy(dst, src, bytes);
    return SKV_OK;
}

static int cpu_sync(struct skv_backend *be)
{
    (void)be;
    return SKV_OK;
}

static void stop_workers(struct skv_cpu *cpu)
{
    pthread_mutex_lock(&cpu->mu);
    atomic_store(&cpu->stop, true);
    pthread_cond_broadcast(&cpu->cv);
    pthread_mutex_unlock(&cpu->mu);
    for (int i = 0; i < cpu->n_started; i++)
        pthread_join(cpu->workers[i].thread, NULL);
    cpu->n_started = 0;
}

static void cpu_destroy(struct skv_backend *be)
{
    if (!be)
        return;
    struct skv_cpu *cpu = cpu_of(be);

    stop_workers(cpu);
    for (int t = 0; t < cpu->n_threads; t++)
        free(cpu->scratch[t].ptr);
    free(cpu->scratch);
    free(cpu->workers);
    pthread_cond_destroy(&cpu->cv);
    pthread_mutex_destroy(&cpu->mu);
    free(cpu);
}

static int cpu_copy_2d(struct skv_backend *be, void *dst, size_t dst_stride, const void *src,
                       size_t src_stride, size_t row_bytes, int64_t n_rows)
{
    (void)be;
    if (n_rows <= 0 || row_bytes == 0)
        return SKV_OK;
    if (!dst || !src)
        return skv_errorf(SKV_E_INVAL, "cpu copy_2d: NULL buffer");
    for (int64_t r = 0; r < n_rows; r++)
        memcpy((char *)dst + r * dst_stride, (const char *)src + r * src_stride, row_bytes);
    return SKV_OK;
}

static int cpu_ipc_open(struct skv_backend *be, const void *handle, size_t handle_len, void **out,
                        uint64_t *bytes_out)
{
    (void)be;
    (void)handle;
    (void)handle_len;
    (void)out;
    (void)bytes_out;
    return skv_errorf(SKV_E_UNSUPPORTED,
                      "CUDA IPC buffers need a daemon on the CUDA backend; this one runs on the CPU: "
                      "register a POSIX shared-memory buffer");
}

static void cpu_ipc_close(struct skv_backend *be, void *ptr)
{
    (void)be;
    (void)ptr;
}

static const struct skv_backend_ops cpu_ops = {
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .copy_2d = cpu_copy_2d,
    .sync = cpu_sync,
    .get_rows = skv_cpu_get_rows,
    .matmul = skv_cpu_matmul,
    .matmul_rows_as_one = skv_cpu_matmul_rows_as_one,
    .matmul_multi = skv_cpu_matmul_multi,
    .rmsnorm = skv_cpu_rmsnorm,
    .rope = skv_cpu_rope,
    .swiglu = skv_cpu_swiglu,
    .add = skv_cpu_add,
    .attention = skv_cpu_attention,
    .attention_colsum = skv_cpu_attention_colsum,
    .group_scores = skv_cpu_group_scores,
    .topk_rows = skv_cpu_topk_rows,
    .cosine_mean = skv_cpu_cosine_mean,
    .copy_rows = skv_cpu_copy_rows,
    .store_rows_f16 = skv_cpu_store_rows_f16,
    .store_rows_q8_0 = skv_cpu_store_rows_q8_0,
    .row_logprobs = skv_cpu_row_logprobs,
    .row_top_logprobs = skv_cpu_row_top_logprobs,
    .ipc_open = cpu_ipc_open,
    .ipc_close = cpu_ipc_close,
    .attention_split_rows = skv_cpu_attention_split_rows,
    .attention_batch = skv_cpu_attention_batch,
    .attention_batch_probs = skv_cpu_attention_batch_probs,
};

int skv_backend_cpu_new(int n_threads, struct skv_backend **out)
{
    int rc;

    if (!out)
        return skv_errorf(SKV_E_INVAL, "cpu backend: NULL out");
    if (n_threads <= 0) {
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = online > 0 ? (int)(online < CPU_MAX_THREADS ? online : CPU_MAX_THREADS) : 1;
    }
    if (n_threads > CPU_MAX_THREADS)
        n_threads = CPU_MAX_THREADS;

    size_t sz = (sizeof(struct skv_cpu) + CPU_ALIGN - 1) / CPU_ALIGN * CPU_ALIGN;
    struct skv_cpu *cpu = aligned_alloc(CPU_ALIGN, sz);
    if (!cpu)
        return skv_errorf(SKV_E_NOMEM, "cpu backend: out of memory");
    memset(cpu, 0, sizeof *cpu);
    cpu->be.name = "cpu";
    cpu->be.ops = &cpu_ops;
    cpu->be.n_threads = n_threads;
    cpu->be.impl = cpu;
    cpu->n_threads = n_threads;
    atomic_init(&cpu->work, 0);
    atomic_init(&cpu->done, 0);
    atomic_init(&cpu->n_sleeping, 0);
    atomic_init(&cpu->stop, false);
    atomic_init(&cpu->busy, false);

    if (pthread_mutex_init(&cpu->mu, NULL) != 0) {
        rc = skv_errorf(SKV_E_NOMEM, "cpu backend: mutex init failed");
        goto out_free_cpu;
    }
    if (pthread_cond_init(&cpu->cv, NULL) != 0) {
        rc = skv_errorf(SKV_E_NOMEM, "cpu backend: condvar init failed");
        goto out_destroy_mutex;
    }
    cpu->scratch = aligned_alloc(CPU_ALIGN, sizeof(struct cpu_scratch) * (size_t)n_threads);
    cpu->workers = calloc((size_t)n_threads, sizeof(struct cpu_worker));
    if (!cpu->scratch || !cpu->workers) {
        rc = skv_errorf(SKV_E_NOMEM, "cpu backend: out of memory");
        goto out_free_arrays;
    }
    memset(cpu->scratch, 0, sizeof(struct cpu_scratch) * (size_t)n_threads);

    /* Our pool parallelizes; OpenBLAS threads on top would oversubscribe the cores. */
    openblas_set_num_threads(1);

    for (int i = 0; i < n_threads - 1; i++) {
        struct cpu_worker *wk = &cpu->workers[i];
        wk->cpu = cpu;
        wk->tid = i + 1;
        /* named, and taking none of the daemon's signals (they go to its socket thread) */
        if (skv_thread_create(&wk->thread, worker_main, wk, "skv-cpu") != 0) {
            rc = skv_errorf(SKV_E_NOMEM, "cpu backend: cannot start thread %d of %d", i + 1,
                            n_threads);
            goto out_stop_threads;
        }
        cpu->n_started++;
    }
    *out = &cpu->be;
    return SKV_OK;

out_stop_threads:
    stop_workers(cpu);
out_free_arrays:
    free(cpu->workers);
    free(cpu->scratch);
    pthread_cond_destroy(&cpu->cv);
out_destroy_mutex:
    pthread_mutex_destroy(&cpu->mu);
out_free_cpu:
    free(cpu);
    return rc;
}
