/* The engine worker on the tiny model, through its real thread and queue.
 * - The client-gone notice, without a GPU: the CPU backend gets an ipc_open that hands out
 *   host buffers (the CPU copy ops take them as device memory), so EXPORT_KV over "CUDA"
 *   buffers runs. A notice for client X closes X's buffers, also one opened by a request
 *   queued just before the notice, and leaves client Y's and the admin endpoint's (same
 *   routing id as X) open until the worker stops; STATS counts the disconnect once and the
 *   buffers it closed.
 * - The opened CUDA buffers are a cache, 8 per client and 256 in all, least recently used
 *   closed first: every transfer is served, whoever holds many connections.
 * - Quotas: an APPEND, DECODE or COMPRESS that cannot have room fails before it changes the
 *   session, and evicts nothing unless evicting could make room.
 * - Shared-memory buffers: only /snapkv-* names; a client shrinking its buffer during
 *   transfers gets errors, never a daemon killed by SIGBUS.
 * - Admission: a request whose counts break a limit the worker checks is refused by submit
 *   (on the socket thread) with the worker's status and message, never queued; the queued
 *   requests' memory stays within max-queued-bytes (SKV_E_BUSY past it, SKV_E_LIMIT for one
 *   request larger than it), and goes back as they run; one tenant's requests are capped below
 *   that (queue-depth-per-tenant, max-queued-bytes-per-tenant), the admin endpoint's not counted.
 * - Watchdog: a worker waiting for work is alive; one stuck in a device call (a fake ipc_open
 *   that blocks) stops being alive once half the watchdog interval passed, and is alive again
 *   when it moves on.
 * - Limits: a PREFILL's lease past max-lease-seconds is refused; a DECODE past
 *   max-decodes-per-tenant or max-decodes running ones is refused at its start (requests queued
 *   behind a worker held in that fake device call start one per turn, so the order is fixed).
 * - A client-gone notice cancels that client's running decodes, between two rounds: the session
 *   keeps the tokens and decodes on exactly as an uninterrupted one; other clients' go on.
 * - A long PREFILL gives running decodes a token between its layers (decode-yield-ms); both
 *   come out as when each runs alone.
 * - CANCEL ends a running decode between two rounds, its final reply before CANCEL's.
 * - Short requests queued behind a long forward run inside it when nothing ahead of them is
 *   from their sender or about their session. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <glob.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <netdb.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/status.h"
#include "daemon/config.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/kv_pool.h"
#include "daemon/engine/tokenizer.h"
#include "daemon/prefix_cache.h"
#include "daemon/session.h"
#include "daemon/store.h"
#include "daemon/worker.h"
#include "kernels/backend.h"
#include "proto/snapkv.pb-c.h"
#include "tests/common/fixture.h"
#include "tests/common/tiny.h"

#define REPLIES "inproc://test-worker-replies"
#define N_FAKE 8
#define FAKE_BYTES (1 << 20)

/* The fake device: buffer k (handle byte 0 == k, 1..N_FAKE-1), opens and closes per buffer. */
static char g_mem[N_FAKE][FAKE_BYTES];
static int g_opened[N_FAKE], g_closed[N_FAKE]; /* under g_counts_mu: the worker thread counts */
static pthread_mutex_t g_counts_mu = PTHREAD_MUTEX_INITIALIZER;
static struct skv_backend_ops g_ops;
/* A wedged device: ipc_open of buffer g_stuck_k waits until g_stuck_k changes. */
static pthread_mutex_t g_stuck_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_stuck_cv = PTHREAD_COND_INITIALIZER;
static int g_stuck_k;
static bool g_stuck;
/* A slow device: once armed, the first rmsnorm of 64 rows or more waits until the gate opens. */
static pthread_mutex_t g_gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_gate_cv = PTHREAD_COND_INITIALIZER;
static int g_gate; /* 0 open, 1 armed, 2 a call waits */
static int (*g_real_rmsnorm)(struct skv_backend *be, float *out, const float *x, const float *w, int n, int dim,
                             float eps);

/* When set: the most blocks the pool had in use at any rmsnorm (each layer's start) or upload
 * (rows written from the host: IMPORT_KV, LOAD, a restore) since. */
static struct skv_kv_pool *_Atomic g_track_pool; /* set by the test, read by the worker */
static _Atomic uint64_t g_pool_peak;

static void track_pool_peak(void)
{
    struct skv_kv_pool *track = atomic_load(&g_track_pool);
    if (track) { /* the worker thread writes the peak, the test reads it after */
        struct skv_kv_pool_stats ps;
        skv_kv_pool_stats(track, &ps);
        if (ps.blocks_in_use > atomic_load(&g_pool_peak))
            atomic_store(&g_pool_peak, ps.blocks_in_use);
    }
}

static int (*g_real_upload)(struct skv_backend *be, void *dst, const void *src, size_t bytes);
static int tracked_upload(struct skv_backend *be, void *dst, const void *src, size_t bytes)
{
    track_pool_peak();
    return g_real_upload(be, dst, src, bytes);
}

/* When set: every rmsnorm waits this long (a decode that lasts, whatever the machine's speed). */
static atomic_int g_slow_rmsnorm_us;

/* When set: a backend allocation of exactly this many bytes fails (out of device memory). */
static atomic_size_t g_fail_alloc_bytes;
static int (*g_real_alloc)(struct skv_backend *be, size_t bytes, void **out);

static int failing_alloc(struct skv_backend *be, size_t bytes, void **out)
{
    if (bytes && bytes == atomic_load(&g_fail_alloc_bytes))
        return skv_errorf(SKV_E_NOMEM, "test: no device memory for %zu bytes", bytes);
    return g_real_alloc(be, bytes, out);
}

/* When set: every attention column sum (the compressor's scores) fails with a device error. */
static atomic_int g_fail_colsum;
static int (*g_real_colsum)(struct skv_backend *be, float *out, int64_t out_stride, const float *q, int nq,
                            int n_heads, const struct skv_kv_view *kv, int q_first);

static int failing_colsum(struct skv_backend *be, float *out, int64_t out_stride, const float *q, int nq,
                          int n_heads, const struct skv_kv_view *kv, int q_first)
{
    if (atomic_load(&g_fail_colsum))
        return skv_errorf(SKV_E_DEVICE, "test: the device failed scoring");
    return g_real_colsum(be, out, out_stride, q, nq, n_heads, kv, q_first);
}

/* rmsnorm calls so far, and the one that fails with a device error (0: none) */
static atomic_long g_rmsnorm_calls, g_fail_rmsnorm_at;

static int gated_rmsnorm(struct skv_backend *be, float *out, const float *x, const float *w, int n, int dim, float eps)
{
    long call = atomic_fetch_add(&g_rmsnorm_calls, 1) + 1;
    if (call == atomic_load(&g_fail_rmsnorm_at))
        return skv_errorf(SKV_E_DEVICE, "test: the device failed");
    int slow = atomic_load(&g_slow_rmsnorm_us);
    if (slow)
        usleep((useconds_t)slow);
    track_pool_peak();
    if (n >= 64) {
        pthread_mutex_lock(&g_gate_mu);
        if (g_gate == 1) {
            g_gate = 2;
            pthread_cond_broadcast(&g_gate_cv);
            while (g_gate == 2)
                pthread_cond_wait(&g_gate_cv, &g_gate_mu);
        }
        pthread_mutex_unlock(&g_gate_mu);
    }
    return g_real_rmsnorm(be, out, x, w, n, dim, eps);
}

/* Waits (g_gate_mu held; released here) until a forward waits at the gate; a request that
 * never reaches it fails the test after 120 s instead of hanging it. */
static void gate_wait_locked(void)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 120;
    int rc = 0;
    while (g_gate != 2 && rc == 0)
        rc = pthread_cond_timedwait(&g_gate_cv, &g_gate_mu, &until);
    bool reached = g_gate == 2;
    pthread_mutex_unlock(&g_gate_mu);
    if (!reached)
        fail_msg("the request did not reach the gate within 120 s");
}

/* Arms the gate; returns once a forward of 64+ tokens waits at it. */
static void gate_hold(void (*submit)(void *), void *arg)
{
    pthread_mutex_lock(&g_gate_mu);
    g_gate = 1;
    pthread_mutex_unlock(&g_gate_mu);
    submit(arg);
    pthread_mutex_lock(&g_gate_mu);
    gate_wait_locked();
}

/* Lets the forward waiting at the gate go on to its next rmsnorm of 64+ rows and waits there
 * again (a tick, with the yield's short requests, runs between). */
static void gate_step(void)
{
    pthread_mutex_lock(&g_gate_mu);
    g_gate = 1;
    pthread_cond_broadcast(&g_gate_cv);
    gate_wait_locked();
}

static void gate_open(void)
{
    pthread_mutex_lock(&g_gate_mu);
    g_gate = 0;
    pthread_cond_broadcast(&g_gate_cv);
    pthread_mutex_unlock(&g_gate_mu);
}

/* The first download of g_slow_download_bytes (rows of a head's K or V, a size only a save
 * reads) waits g_slow_download_ms: a checkpoint that runs out of time. */
static atomic_int g_slow_download_ms;
static size_t g_slow_download_bytes;
static int (*g_real_download)(struct skv_backend *be, void *dst, const void *src, size_t bytes);
static int slow_download(struct skv_backend *be, void *dst, const void *src, size_t bytes)
{
    int ms = bytes == g_slow_download_bytes ? atomic_exchange(&g_slow_download_ms, 0) : 0;
    if (ms)
        usleep((useconds_t)ms * 1000);
    return g_real_download(be, dst, src, bytes);
}

static int fake_ipc_open(struct skv_backend *be, const void *handle, size_t handle_len, void **out,
                         uint64_t *bytes_out)
{
    (void)be;
    int k = ((const uint8_t *)handle)[0];
    if (handle_len != 64 || k < 1 || k >= N_FAKE)
        return skv_errorf(SKV_E_INVAL, "fake ipc_open: no buffer %d", k);
    if (((const uint8_t *)handle)[1] == 0xDE && ((const uint8_t *)handle)[2] == 0xAD) /* variant 0xADDE */
        return skv_errorf(SKV_E_DEVICE, "fake ipc_open: the device failed");
    static atomic_bool roomless; /* variant 0xEFBE: no room the first time, then room */
    const uint8_t *hb = handle;
    if (hb[1] == 0xBE && hb[2] == 0xEF && !atomic_exchange(&roomless, true))
        return skv_errorf(SKV_E_NOMEM, "fake ipc_open: no room to map it");
    pthread_mutex_lock(&g_stuck_mu);
    while (k == g_stuck_k) {
        g_stuck = true;
        pthread_cond_broadcast(&g_stuck_cv);
        pthread_cond_wait(&g_stuck_cv, &g_stuck_mu);
    }
    g_stuck = false;
    pthread_mutex_unlock(&g_stuck_mu);
    pthread_mutex_lock(&g_counts_mu);
    g_opened[k]++;
    pthread_mutex_unlock(&g_counts_mu);
    *out = g_mem[k];
    *bytes_out = FAKE_BYTES;
    return SKV_OK;
}

/* The fake device's answer to device_lost: whether it can run nothing more. */
static atomic_bool g_device_gone;
static bool fake_device_lost(struct skv_backend *be)
{
    (void)be;
    return atomic_load(&g_device_gone);
}

static void fake_ipc_close(struct skv_backend *be, void *ptr)
{
    (void)be;
    for (int k = 1; k < N_FAKE; k++)
        if (ptr == g_mem[k]) {
            pthread_mutex_lock(&g_counts_mu);
            g_closed[k]++;
            pthread_mutex_unlock(&g_counts_mu);
        }
}

/* The fake device's counts of buffer k so far (read under the lock the worker counts with). */
static int opened(int k)
{
    pthread_mutex_lock(&g_counts_mu);
    int n = g_opened[k];
    pthread_mutex_unlock(&g_counts_mu);
    return n;
}

static int closed(int k)
{
    pthread_mutex_lock(&g_counts_mu);
    int n = g_closed[k];
    pthread_mutex_unlock(&g_counts_mu);
    return n;
}

struct fixture {
    struct tiny *tiny;
    struct skv_config cfg;
    void *zctx, *pull;
    struct skv_worker *w;
};

static const uint8_t ID_X[5] = {0, 0x6b, 0x8b, 0x45, 0x67}, ID_Y[5] = {0, 0x6b, 0x8b, 0x45, 0x68},
                     ID_Z[5] = {0, 0x6b, 0x8b, 0x45, 0x69}, ID_F[5] = {0, 0x6b, 0x8b, 0x45, 0x6a};

/* A job for (sock, identity) from a packed request (tenant "t" unless it names one): the worker
 * frees what unpack allocated. */
static struct skv_job *job_new(int sock, const uint8_t *id, size_t id_len, Snapkv__Request *req)
{
    req->version = 1;
    if (!req->tenant || !*req->tenant)
        req->tenant = "t";
    size_t len = snapkv__request__get_packed_size(req);
    uint8_t *buf = malloc(len ? len : 1);
    assert_non_null(buf);
    snapkv__request__pack(req, buf);
    struct skv_job *job = calloc(1, sizeof *job);
    assert_non_null(job);
    job->req = snapkv__request__unpack(NULL, len, buf);
    assert_non_null(job->req);
    free(buf);
    job->sock = sock;
    job->uid = (long)geteuid(); /* an ipc:// client of this process's user */
    memcpy(job->identity, id, id_len);
    job->identity_len = id_len;
    job->conn = 40 + id[0]; /* its connection, which every reply names (next_reply) */
    job->conn_serial = 1000 + id[0];
    return job;
}

/* The next reply the worker pushed; checks it went to (sock, identity). */
static Snapkv__Reply *next_reply(struct fixture *f, int sock, const uint8_t *id, size_t id_len)
{
    zmq_msg_t parts[3];
    for (int i = 0; i < 3; i++) {
        zmq_msg_init(&parts[i]);
        assert_true(zmq_msg_recv(&parts[i], f->pull, 0) >= 0);
    }
    assert_int_equal(*(const uint8_t *)zmq_msg_data(&parts[0]), sock);
    struct skv_worker_route route;
    assert_int_equal(zmq_msg_size(&parts[0]), sizeof route); /* the connection of the request */
    memcpy(&route, zmq_msg_data(&parts[0]), sizeof route);
    assert_int_equal(route.conn, 40 + id[0]);
    assert_int_equal(route.serial, 1000 + id[0]);
    assert_int_equal(zmq_msg_size(&parts[1]), id_len);
    assert_memory_equal(zmq_msg_data(&parts[1]), id, id_len);
    Snapkv__Reply *rep = snapkv__reply__unpack(NULL, zmq_msg_size(&parts[2]), zmq_msg_data(&parts[2]));
    assert_non_null(rep);
    for (int i = 0; i < 3; i++)
        zmq_msg_close(&parts[i]);
    return rep;
}

static Snapkv__Reply *call(struct fixture *f, int sock, const uint8_t *id, Snapkv__Request *req)
{
    int rc = skv_worker_submit(f->w, job_new(sock, id, 5, req));
    if (rc)
        fail_msg("submit: %d %s", rc, skv_error_msg());
    return next_reply(f, sock, id, 5);
}

/* EXPORT_KV of layer 0 into fake buffer k through handle variant v (the fake maps every handle
 * with first byte k to buffer k; the daemon tells handles apart whole), queued (the reply is
 * read by the caller). */
static void submit_export_tenant(struct fixture *f, int sock, const uint8_t *id, const char *tenant,
                                 const uint8_t sid[16], int k, int v)
{
    uint8_t handle[64] = {(uint8_t)k, (uint8_t)v, (uint8_t)(v >> 8)};
    Snapkv__BufferRef buf = SNAPKV__BUFFER_REF__INIT;
    buf.kind_case = SNAPKV__BUFFER_REF__KIND_CUDA_IPC_HANDLE;
    buf.cuda_ipc_handle = (ProtobufCBinaryData){sizeof handle, handle};
    buf.size = FAKE_BYTES;
    Snapkv__ExportKvRequest e = SNAPKV__EXPORT_KV_REQUEST__INIT;
    e.session_id = (ProtobufCBinaryData){16, (uint8_t *)sid};
    e.buffer = &buf;
    e.layer_count = 1;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_EXPORT_KV;
    req.export_kv = &e;
    req.tenant = (char *)tenant; /* NULL: "t" */
    assert_int_equal(skv_worker_submit(f->w, job_new(sock, id, 5, &req)), SKV_OK);
}

static void submit_export_variant(struct fixture *f, int sock, const uint8_t *id, const uint8_t sid[16], int k,
                                  int v)
{
    submit_export_tenant(f, sock, id, NULL, sid, k, v);
}

static void submit_export(struct fixture *f, int sock, const uint8_t *id, const uint8_t sid[16], int k)
{
    submit_export_variant(f, sock, id, sid, k, 0);
}

static void expect_exported(struct fixture *f, int sock, const uint8_t *id)
{
    Snapkv__Reply *rep = next_reply(f, sock, id, 5);
    if (rep->status)
        fail_msg("EXPORT_KV: %d %s", rep->status, rep->message);
    assert_int_equal(rep->result_case, SNAPKV__REPLY__RESULT_EXPORT_KV);
    assert_true(rep->export_kv->bytes_written > 0);
    snapkv__reply__free_unpacked(rep, NULL);
}

/* An admin request (the admin endpoint, routing id 0 1 2 3 4) that must succeed. */
static Snapkv__Reply *admin_call(struct fixture *f, Snapkv__Request *req)
{
    static const uint8_t admin[5] = {0, 1, 2, 3, 4};
    Snapkv__Reply *rep = call(f, 1, admin, req);
    if (rep->status)
        fail_msg("admin request: %d %s", rep->status, rep->message);
    return rep;
}

/* Queues a STATS from the admin endpoint (routing id 0 1 2 3 4) naming tenant (NULL: "t"; an
 * admin request is no tenant's whatever it names); the caller reads the reply. */
static void submit_admin_stats(struct fixture *f, const char *tenant)
{
    static const uint8_t admin[5] = {0, 1, 2, 3, 4};
    Snapkv__StatsRequest sr = SNAPKV__STATS_REQUEST__INIT;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_STATS;
    req.stats = &sr;
    req.tenant = (char *)tenant;
    assert_int_equal(skv_worker_submit(f->w, job_new(1, admin, 5, &req)), SKV_OK);
}

/* Queues a FORK of session sid by client id. */
static void submit_fork(struct fixture *f, const uint8_t *id, const uint8_t sid[16])
{
    Snapkv__ForkRequest fk = SNAPKV__FORK_REQUEST__INIT;
    fk.session_id = (ProtobufCBinaryData){16, (uint8_t *)sid};
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_FORK;
    req.fork = &fk;
    assert_int_equal(skv_worker_submit(f->w, job_new(0, id, 5, &req)), SKV_OK);
}

/* The tiny fixture's first n prompt ids. */
static void fixed_ids(const struct fixture *f, uint32_t *tokens, int n)
{
    for (int i = 0; i < n; i++)
        tokens[i] = (uint32_t)f->tiny->ids[i];
}

/* STATS from the admin endpoint: whether it has metric `name`, and its value into *v. */
static bool stat_find(struct fixture *f, const char *name, double *v)
{
    Snapkv__StatsRequest sr = SNAPKV__STATS_REQUEST__INIT;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_STATS;
    req.stats = &sr;
    Snapkv__Reply *rep = admin_call(f, &req);
    bool found = false;
    for (size_t i = 0; i < rep->stats->n_stats; i++)
        if (strcmp(rep->stats->stats[i]->name, name) == 0) {
            *v = rep->stats->stats[i]->value;
            found = true;
        }
    snapkv__reply__free_unpacked(rep, NULL);
    return found;
}

/* The value of metric `name` (it must be there). */
static double stat(struct fixture *f, const char *name)
{
    double v = 0;
    if (!stat_find(f, name, &v))
        fail_msg("no metric %s", name);
    return v;
}

/* The value of metric `name`, 0 when there is none (a tenant's row before its first request). */
static double stat_or_0(struct fixture *f, const char *name)
{
    double v = 0;
    return stat_find(f, name, &v) ? v : 0;
}

static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof *f);
    if (!f)
        return -1;
    *state = f;
    void *tiny = NULL;
    if (tiny_setup(&tiny)) {
        f->tiny = tiny;
        return -1;
    }
    f->tiny = tiny;
    struct skv_backend *be = f->tiny->be;
    g_ops = *be->ops;
    g_ops.ipc_open = fake_ipc_open;
    g_ops.ipc_close = fake_ipc_close;
    g_ops.device_lost = fake_device_lost;
    atomic_store(&g_device_gone, false);
    atomic_store(&g_slow_rmsnorm_us, 0);
    atomic_store(&g_fail_rmsnorm_at, 0);
    atomic_store(&g_fail_alloc_bytes, 0);
    g_real_alloc = g_ops.alloc;
    g_ops.alloc = failing_alloc;
    g_real_rmsnorm = g_ops.rmsnorm;
    g_ops.rmsnorm = gated_rmsnorm;
    atomic_store(&g_fail_colsum, 0);
    g_real_colsum = g_ops.attention_colsum;
    g_ops.attention_colsum = failing_colsum;
    g_real_download = g_ops.download;
    g_ops.download = slow_download;
    g_real_upload = g_ops.upload;
    g_ops.upload = tracked_upload;
    be->ops = &g_ops;
    if (skv_config_init(&f->cfg))
        return -1;
    /* these tests prefill the same ids again and again and count, time and compare what each
     * computes: a test of prefix reuse turns it on */
    f->cfg.prefix_reuse = false;
    f->zctx = zmq_ctx_new();
    f->pull = zmq_socket(f->zctx, ZMQ_PULL);
    if (!f->pull || zmq_bind(f->pull, REPLIES) < 0)
        return -1;
    return skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w) ? -1 : 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    if (!f)
        return 0;
    pthread_mutex_lock(&g_stuck_mu); /* a test that failed while the worker was wedged */
    g_stuck_k = 0;
    pthread_cond_broadcast(&g_stuck_cv);
    pthread_mutex_unlock(&g_stuck_mu);
    gate_open();
    skv_worker_stop(&f->w);
    if (f->pull)
        zmq_close(f->pull);
    if (f->zctx)
        zmq_ctx_term(f->zctx);
    skv_config_free(&f->cfg);
    void *tiny = f->tiny;
    tiny_teardown(&tiny);
    free(f);
    return 0;
}

static void test_client_gone(void **state)
{
    struct fixture *f = *state;
    uint32_t tokens[8];
    fixed_ids(f, tokens, 8);
    Snapkv__PrefillRequest p = SNAPKV__PREFILL_REQUEST__INIT;
    p.tokens = tokens;
    p.n_tokens = 8;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_PREFILL;
    req.prefill = &p;
    Snapkv__Reply *rep = call(f, 0, ID_X, &req);
    if (rep->status)
        fail_msg("PREFILL: %d %s", rep->status, rep->message);
    uint8_t sid[16];
    assert_int_equal(rep->prefill->session_id.len, 16);
    memcpy(sid, rep->prefill->session_id.data, 16);
    snapkv__reply__free_unpacked(rep, NULL);

    /* X opens buffer 1 (once, then reuses it), Y buffer 3, the admin endpoint (X's routing id) buffer 4 */
    submit_export(f, 0, ID_X, sid, 1);
    expect_exported(f, 0, ID_X);
    submit_export(f, 0, ID_X, sid, 1); /* reused, not opened again */
    expect_exported(f, 0, ID_X);
    submit_export(f, 0, ID_Y, sid, 3);
    expect_exported(f, 0, ID_Y);
    submit_export(f, 1, ID_X, sid, 4);
    expect_exported(f, 1, ID_X);
    /* X's last request is still queued when its connection closes: the notice comes after it */
    submit_export(f, 0, ID_X, sid, 2);
    assert_int_equal(skv_worker_client_gone(f->w, ID_X, sizeof ID_X, true), SKV_OK);
    expect_exported(f, 0, ID_X);
    assert_int_equal(stat(f, "snapkv_client_disconnects_total"), 1);
    assert_int_equal(stat(f, "snapkv_cuda_buffers_closed_on_disconnect_total"), 2);
    int want_opened[N_FAKE] = {0, 1, 1, 1, 1}, want_closed[N_FAKE] = {0, 1, 1, 0, 0};
    for (int k = 0; k < N_FAKE; k++) {
        assert_int_equal(opened(k), want_opened[k]);
        assert_int_equal(closed(k), want_closed[k]);
    }
    static const char zero[256];
    assert_true(memcmp(g_mem[2], zero, sizeof zero) != 0); /* the export really wrote buffer 2 */

    /* a later notice for X (a request read after its connection closed) is not counted again */
    assert_int_equal(skv_worker_client_gone(f->w, ID_X, sizeof ID_X, false), SKV_OK);
    assert_int_equal(stat(f, "snapkv_client_disconnects_total"), 1);
    assert_int_equal(stat(f, "snapkv_cuda_buffers_closed_on_disconnect_total"), 2);

    /* Y's and the admin endpoint's stay until the worker stops */
    assert_int_equal(closed(3) + closed(4), 0);
    skv_worker_stop(&f->w);
    int want_end[N_FAKE] = {0, 1, 1, 1, 1};
    for (int k = 0; k < N_FAKE; k++)
        assert_int_equal(closed(k), want_end[k]);
}

static void prefill(struct fixture *f, int n, const char *spec, uint8_t sid[16]);
static void restart_fifo(struct fixture *f);

/* EXPORT_KV of layer 0 by client `id` through handle variant v of buffer k, and its reply. */
static void export_variant(struct fixture *f, const uint8_t id[5], const uint8_t sid[16], int k, int v)
{
    submit_export_variant(f, 0, id, sid, k, v);
    expect_exported(f, 0, id);
}

/* The opened CUDA buffers are a cache: a client's ninth closes its least recently used one
 * once it opened (a handle that does not open closes none), and past 256 in all the least
 * recently used of anyone's closes; every transfer succeeds
 * (before, the ninth of a client was refused, and 32 connections could take all 256 slots
 * from every other client). A closed one opens again when used again. */
static void test_ipc_lru(void **state)
{
    struct fixture *f = *state;
    uint8_t sid[16];
    prefill(f, 8, "policy=full", sid);
    const int o1 = opened(1), c1 = closed(1), o2 = opened(2), c2 = closed(2);
    for (int v = 0; v < 9; v++)
        export_variant(f, ID_X, sid, 1, v);
    assert_int_equal(opened(1) - o1, 9);
    assert_int_equal(closed(1) - c1, 1); /* variant 0 */
    assert_int_equal(stat(f, "snapkv_cuda_buffers_closed_for_room_total"), 1);
    /* a handle that does not open closes none (before, the oldest went first) */
    submit_export_variant(f, 0, ID_X, sid, 0, 0);
    Snapkv__Reply *rep = next_reply(f, 0, ID_X, 5);
    assert_int_equal(rep->status, SKV_E_INVAL);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(closed(1) - c1, 1);
    assert_int_equal(stat(f, "snapkv_cuda_buffers_closed_for_room_total"), 1);

    export_variant(f, ID_X, sid, 1, 1); /* still open */
    assert_int_equal(opened(1) - o1, 9);
    export_variant(f, ID_X, sid, 1, 0); /* opened again; variant 2 is now the oldest, and goes */
    assert_int_equal(opened(1) - o1, 10);
    assert_int_equal(closed(1) - c1, 2);
    /* 32 more clients with 8 each: 264 wanted, so the 8 oldest (all X's) close */
    for (int client = 0; client < 32; client++) {
        const uint8_t id[5] = {9, 8, 7, 6, (uint8_t)client};
        for (int v = 0; v < 8; v++)
            export_variant(f, id, sid, 2, client * 8 + v);
    }
    assert_int_equal(opened(2) - o2, 256);
    assert_int_equal(closed(2) - c2, 0);
    assert_int_equal(closed(1) - c1, 10);
    assert_int_equal(stat(f, "snapkv_cuda_buffers_closed_for_room_total"), 10);
    export_variant(f, ID_X, sid, 1, 5); /* X is served again, at the oldest other's cost */
    assert_int_equal(opened(1) - o1, 11);
    assert_int_equal(closed(2) - c2, 1);
    /* one that does not open for want of room (256 open) opens once the oldest is closed; before,
     * the open failed first and the request with it */
    const double room = stat(f, "snapkv_cuda_buffers_closed_for_room_total");
    export_variant(f, ID_X, sid, 3, 0xEFBE);
    assert_int_equal(stat(f, "snapkv_cuda_buffers_closed_for_room_total"), room + 1);
    skv_worker_stop(&f->w); /* every one still open closes */
    assert_int_equal(opened(1) - o1, closed(1) - c1);
    assert_int_equal(opened(2) - o2, closed(2) - c2);
}

/* A CUDA buffer's stated size is not trusted: a range past the allocation as the device knows
 * it (the fake's FAKE_BYTES) is refused before anything is copied, whatever size the client
 * states (the daemon read and wrote wherever `offset` pointed before). */
static void test_ipc_stated_size(void **state)
{
    struct fixture *f = *state;
    uint8_t sid[16];
    prefill(f, 8, "policy=full", sid);
    uint8_t handle[64] = {3};
    Snapkv__BufferRef buf = SNAPKV__BUFFER_REF__INIT;
    buf.kind_case = SNAPKV__BUFFER_REF__KIND_CUDA_IPC_HANDLE;
    buf.cuda_ipc_handle = (ProtobufCBinaryData){sizeof handle, handle};
    buf.size = UINT64_C(1) << 40;
    buf.offset = FAKE_BYTES - 64;
    Snapkv__ExportKvRequest e = SNAPKV__EXPORT_KV_REQUEST__INIT;
    e.session_id = (ProtobufCBinaryData){16, sid};
    e.buffer = &buf;
    e.layer_count = 1;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_EXPORT_KV;
    req.export_kv = &e;
    static char before[FAKE_BYTES];
    memcpy(before, g_mem[3], FAKE_BYTES);
    Snapkv__Reply *rep = call(f, 0, ID_X, &req);
    assert_int_equal(rep->status, SKV_E_LIMIT);
    assert_non_null(strstr(rep->message, "allocation holds 1048576 bytes"));
    snapkv__reply__free_unpacked(rep, NULL);
    assert_memory_equal(before, g_mem[3], FAKE_BYTES); /* nothing written */
    buf.offset = 0; /* the same stated size, a range inside: served */
    rep = call(f, 0, ID_X, &req);
    assert_int_equal(rep->status, SKV_OK);
    snapkv__reply__free_unpacked(rep, NULL);
}

/* ---- quotas ---------------------------------------------------------------------------------- */

/* Restarts the worker with the tenant quota at `blocks` blocks per KV head of the model. */
static void restart_with_quota(struct fixture *f, int blocks)
{
    skv_worker_stop(&f->w);
    const struct skv_model_config *mc = &f->tiny->m->cfg;
    f->cfg.max_bytes_per_tenant =
        (int64_t)blocks * mc->n_layers * mc->n_kv_heads * (int64_t)skv_kv_pool_block_bytes(f->tiny->m->kv_pool);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
}

/* The reply to a PREFILL of the first n fixed ids by client X for tenant ("t" when NULL), with
 * the lease it asks for (0: the daemon's). */
static Snapkv__Reply *prefill_reply(struct fixture *f, const char *tenant, int n, const char *spec, uint32_t lease)
{
    uint32_t tokens[64];
    fixed_ids(f, tokens, n);
    Snapkv__CompressSpec cs = SNAPKV__COMPRESS_SPEC__INIT;
    cs.spec = (char *)spec;
    Snapkv__PrefillRequest p = SNAPKV__PREFILL_REQUEST__INIT;
    p.tokens = tokens;
    p.n_tokens = (size_t)n;
    p.compress = &cs;
    p.lease_seconds = lease;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_PREFILL;
    req.prefill = &p;
    if (tenant)
        req.tenant = (char *)tenant;
    return call(f, 0, ID_X, &req);
}

static void prefill_for(struct fixture *f, const char *tenant, int n, const char *spec, uint8_t sid[16])
{
    Snapkv__Reply *rep = prefill_reply(f, tenant, n, spec, 0);
    if (rep->status)
        fail_msg("PREFILL: %d %s", rep->status, rep->message);
    memcpy(sid, rep->prefill->session_id.data, 16);
    snapkv__reply__free_unpacked(rep, NULL);
}

static void prefill(struct fixture *f, int n, const char *spec, uint8_t sid[16])
{
    prefill_for(f, NULL, n, spec, sid);
}

/* The blocks of one unit, a block for each layer and KV head, and *bb a block's bytes. */
static uint64_t kv_unit(const struct fixture *f, uint64_t *bb)
{
    const struct skv_model_config *mc = &f->tiny->m->cfg;
    *bb = skv_kv_pool_block_bytes(f->tiny->m->kv_pool);
    return (uint64_t)mc->n_layers * mc->n_kv_heads;
}

/* Restarts the worker with a pool of `blocks` KV blocks per layer and KV head; returns the
 * blocks of one such unit (layers x KV heads). */
static uint64_t restart_with_pool(struct fixture *f, int blocks)
{
    skv_worker_stop(&f->w);
    const struct skv_model_config *mc = &f->tiny->m->cfg;
    const uint64_t unit = (uint64_t)mc->n_layers * mc->n_kv_heads;
    f->cfg.pool_size = (int64_t)((uint64_t)blocks * unit * skv_kv_pool_block_bytes(f->tiny->m->kv_pool));
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    return unit;
}

/* FORK of sid by client X; its new session's id in out. */
static void fork_session(struct fixture *f, const uint8_t sid[16], uint8_t out[16])
{
    submit_fork(f, ID_X, sid);
    Snapkv__Reply *rep = next_reply(f, 0, ID_X, 5);
    if (rep->status)
        fail_msg("FORK: %d %s", rep->status, rep->message);
    memcpy(out, rep->fork->session_id.data, 16);
    snapkv__reply__free_unpacked(rep, NULL);
}

/* APPEND of the n last fixed ids to sid, queued by client id for tenant (NULL: "t"). */
static void submit_append_for(struct fixture *f, const uint8_t *id, const char *tenant, const uint8_t sid[16], int n)
{
    uint32_t tokens[64];
    for (int i = 0; i < n; i++)
        tokens[i] = (uint32_t)f->tiny->ids[63 - i];
    Snapkv__AppendRequest a = SNAPKV__APPEND_REQUEST__INIT;
    a.session_id = (ProtobufCBinaryData){16, (uint8_t *)sid};
    a.tokens = tokens;
    a.n_tokens = (size_t)n;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_APPEND;
    req.append = &a;
    req.tenant = (char *)tenant;
    assert_int_equal(skv_worker_submit(f->w, job_new(0, id, 5, &req)), SKV_OK);
}

static void submit_append(struct fixture *f, const uint8_t *id, const uint8_t sid[16], int n)
{
    submit_append_for(f, id, NULL, sid, n);
}

/* APPENDs n tokens; returns the status (and the reply's length when it succeeds). */
static int append(struct fixture *f, const uint8_t sid[16], int n, int *n_tokens)
{
    submit_append(f, ID_X, sid, n);
    Snapkv__Reply *rep = next_reply(f, 0, ID_X, 5);
    int status = rep->status;
    if (!status && n_tokens)
        *n_tokens = (int)rep->append->n_tokens;
    snapkv__reply__free_unpacked(rep, NULL);
    return status;
}

/* The admin view of session sid: its length, bytes and lease, or -1 when it is gone; *n_sessions
 * counts all. */
static int listed_lease(struct fixture *f, const uint8_t sid[16], uint64_t *bytes, int *n_sessions, uint32_t *lease)
{
    Snapkv__ListRequest lr = SNAPKV__LIST_REQUEST__INIT;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_LIST;
    req.list = &lr;
    Snapkv__Reply *rep = admin_call(f, &req);
    int n = -1;
    for (size_t i = 0; i < rep->list->n_sessions; i++)
        if (memcmp(rep->list->sessions[i]->session_id.data, sid, 16) == 0) {
            n = (int)rep->list->sessions[i]->n_tokens;
            if (bytes)
                *bytes = rep->list->sessions[i]->bytes;
            if (lease)
                *lease = rep->list->sessions[i]->lease_seconds;
        }
    if (n_sessions)
        *n_sessions = (int)rep->list->n_sessions;
    snapkv__reply__free_unpacked(rep, NULL);
    return n;
}

/* The admin view of session sid: its length and bytes, or -1 when it is gone; *n_sessions counts all. */
static int listed(struct fixture *f, const uint8_t sid[16], uint64_t *bytes, int *n_sessions)
{
    return listed_lease(f, sid, bytes, n_sessions, NULL);
}

static void test_append_over_quota(void **state)
{
    struct fixture *f = *state;
    restart_with_quota(f, 2); /* two blocks (32 rows) per head for the tenant */
    uint8_t a[16], b[16];
    prefill(f, 8, "policy=full", a);
    prefill(f, 8, "policy=full", b);
    uint64_t bytes_b = 0;
    int n = 0, count = 0;
    /* b at 48 rows would need 3 blocks: with a evicted the tenant still holds 3 > 2 */
    assert_int_equal(append(f, b, 40, NULL), SKV_E_LIMIT);
    assert_int_equal(listed(f, b, &bytes_b, &count), 8); /* b unchanged */
    assert_int_equal(count, 2);                          /* and a not evicted for nothing */
    assert_int_equal(listed(f, a, NULL, NULL), 8);
    /* b at 18 rows needs 2 blocks: evicting a (least recently used) makes room */
    assert_int_equal(append(f, b, 10, &n), SKV_OK);
    assert_int_equal(n, 18);
    assert_int_equal(listed(f, a, NULL, &count), -1);
    assert_int_equal(count, 1);
    assert_int_equal(stat(f, "snapkv_evictions_total"), 1);
    /* 32 rows fit exactly; one more does not, and the session stays at 32 */
    assert_int_equal(append(f, b, 14, &n), SKV_OK);
    assert_int_equal(n, 32);
    assert_int_equal(listed(f, b, &bytes_b, NULL), 32);
    assert_int_equal(append(f, b, 1, NULL), SKV_E_LIMIT);
    uint64_t after = 0;
    assert_int_equal(listed(f, b, &after, NULL), 32);
    assert_int_equal(after, bytes_b);
}

/* RELEASE of sid by client X for tenant (NULL: "t"): SKV_OK or its status. */
static int release_for(struct fixture *f, const char *tenant, const uint8_t sid[16])
{
    Snapkv__ReleaseRequest rr = SNAPKV__RELEASE_REQUEST__INIT;
    rr.session_id = (ProtobufCBinaryData){16, (uint8_t *)sid};
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_RELEASE;
    req.release = &rr;
    req.tenant = (char *)tenant;
    Snapkv__Reply *rep = call(f, 0, ID_X, &req);
    int rc = rep->status;
    snapkv__reply__free_unpacked(rep, NULL);
    return rc;
}

/* The same for tenant "t". */
static int release_by_x(struct fixture *f, const uint8_t sid[16])
{
    return release_for(f, NULL, sid);
}

/* max-sessions bounds every tenant's sessions together: with 3, a fourth tenant's PREFILL and a
 * FORK (which costs the pool nothing) are refused with LIMIT naming it, the three stay; one
 * released makes room again (before, a client naming new tenants held sessions without end). */
static void test_max_sessions(void **state)
{
    struct fixture *f = *state;
    skv_worker_stop(&f->w);
    f->cfg.max_sessions = 3;
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    uint8_t s[3][16];
    prefill_for(f, "t", 8, "policy=full", s[0]); /* (the tenant submit_fork asks for) */
    prefill_for(f, "t2", 8, "policy=full", s[1]);
    prefill_for(f, "t3", 8, "policy=full", s[2]);
    Snapkv__Reply *rep = prefill_reply(f, "t4", 8, "policy=full", 0);
    assert_int_equal(rep->status, SKV_E_LIMIT);
    assert_string_equal(rep->message, "the daemon holds 3 sessions (max-sessions)");
    snapkv__reply__free_unpacked(rep, NULL);
    submit_fork(f, ID_X, s[0]);
    rep = next_reply(f, 0, ID_X, 5);
    assert_int_equal(rep->status, SKV_E_LIMIT);
    assert_non_null(strstr(rep->message, "(max-sessions)"));
    snapkv__reply__free_unpacked(rep, NULL);
    int n_sessions = 0;
    for (int i = 0; i < 3; i++)
        assert_int_equal(listed(f, s[i], NULL, &n_sessions), 8);
    assert_int_equal(n_sessions, 3);
    assert_int_equal(release_by_x(f, s[0]), SKV_OK);
    uint8_t s4[16];
    prefill_for(f, "t4", 8, "policy=full", s4);
}

/* The tokens a PREFILL of the first n fixed ids reused (it must succeed); its id into sid. */
static uint32_t prefill_reused(struct fixture *f, const char *tenant, int n, uint8_t sid[16])
{
    Snapkv__Reply *rep = prefill_reply(f, tenant, n, "policy=full", 0);
    if (rep->status)
        fail_msg("PREFILL: %d %s", rep->status, rep->message);
    uint32_t reused = rep->prefill->reused_tokens;
    memcpy(sid, rep->prefill->session_id.data, 16);
    snapkv__reply__free_unpacked(rep, NULL);
    return reused;
}

static void pin(struct fixture *f, const uint8_t sid[16])
{
    Snapkv__PinRequest pq = SNAPKV__PIN_REQUEST__INIT;
    pq.session_id = (ProtobufCBinaryData){16, (uint8_t *)sid};
    pq.pin = true;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_PIN;
    req.pin = &pq;
    Snapkv__Reply *rep = admin_call(f, &req);
    assert_int_equal(rep->status, 0);
    snapkv__reply__free_unpacked(rep, NULL);
}

/* A request the pool cannot take even with its kept prefixes dropped and every session that may
 * go evicted is refused with them kept: 8 blocks a layer and head, t's 2 kept, 5 in pinned
 * sessions, and w's 64-token PREFILL needs 4 (before, every tenant's kept prefixes were
 * dropped first, and the request refused all the same). */
static void test_refusal_keeps_prefixes(void **state)
{
    struct fixture *f = *state;
    f->cfg.prefix_reuse = true;
    uint64_t bb;
    f->cfg.prefix_retain_bytes = (int64_t)(4 * kv_unit(f, &bb) * bb);
    restart_with_pool(f, 8);
    uint8_t a[16], v1[16], v2[16];
    assert_int_equal(prefill_reused(f, NULL, 32, a), 0);
    assert_int_equal(release_by_x(f, a), SKV_OK);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 1);
    prefill_for(f, "v", 64, "policy=full", v1);
    prefill_for(f, "v", 16, "policy=full", v2);
    pin(f, v1);
    pin(f, v2);
    Snapkv__Reply *r = prefill_reply(f, "w", 64, "policy=full", 0);
    assert_int_equal(r->status, SKV_E_POOL_FULL);
    assert_non_null(strstr(r->message, "kept prefixes"));
    snapkv__reply__free_unpacked(r, NULL);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 1);
    assert_int_equal(stat(f, "snapkv_prefix_retained_dropped_total"), 0);
    /* one that fits once they go: 2 of w's blocks are theirs */
    r = prefill_reply(f, "w", 16, "policy=full", 0);
    assert_int_equal(r->status, 0);
    snapkv__reply__free_unpacked(r, NULL);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 1);
    r = prefill_reply(f, "w", 32, "policy=full", 0);
    assert_int_equal(r->status, 0);
    snapkv__reply__free_unpacked(r, NULL);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 0);
}

/* prefix-retain-bytes: a RELEASEd full-cache session's KV stays for prefix reuse; a longer
 * history of the tenant replaces the one it covers; under pool pressure kept prefixes go before
 * any session; EVICT drops them; unused for lease-seconds they go. */
static void test_prefix_retain(void **state)
{
    struct fixture *f = *state;
    f->cfg.prefix_reuse = true;
    const uint64_t bb = skv_kv_pool_block_bytes(f->tiny->m->kv_pool);
    const uint64_t unit = restart_with_pool(f, 8); /* 8 blocks a layer and head (f->cfg.prefix_retain_bytes 0) */
    uint8_t a[16], b[16], c[16];
    assert_int_equal(prefill_reused(f, NULL, 32, a), 0);
    assert_int_equal(release_by_x(f, a), SKV_OK);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 0); /* off */
    assert_int_equal(prefill_reused(f, NULL, 48, b), 0);
    assert_int_equal(release_by_x(f, b), SKV_OK);
    f->cfg.prefix_retain_bytes = (int64_t)(4 * unit * bb);
    restart_with_pool(f, 8);
    assert_int_equal(prefill_reused(f, NULL, 32, a), 0);
    assert_int_equal(release_by_x(f, a), SKV_OK);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 1);
    assert_int_equal(stat(f, "snapkv_prefix_retained_bytes"), 2 * unit * bb);
    assert_int_equal(stat(f, "snapkv_pool_blocks_used"), 2 * unit);
    assert_int_equal(listed(f, a, NULL, NULL), -1); /* released: no session */
    /* a's 32 tokens come back; another tenant's do not */
    assert_int_equal(prefill_reused(f, NULL, 48, b), 32);
    assert_int_equal(prefill_reused(f, "u", 48, c), 0);
    assert_int_equal(release_by_x(f, c), SKV_E_NOT_FOUND); /* u's: X asks as t */
    /* b's history covers a's: a's entry goes, b's stays (3 blocks a head, 2 still shared) */
    assert_int_equal(release_by_x(f, b), SKV_OK);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 1);
    assert_int_equal(stat(f, "snapkv_prefix_retained_bytes"), 3 * unit * bb);
    assert_int_equal(stat(f, "snapkv_prefix_retained_dropped_total"), 1);
    /* b's 3 and u's 3 blocks in use; 32 tokens of another tenant take 2 more (8 of 8), then
     * 48 of a third need 3: the kept prefix goes, and no session */
    uint8_t d[16], e[16];
    assert_int_equal(prefill_reused(f, "v", 32, d), 0);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 1);
    assert_int_equal(prefill_reused(f, "w", 48, e), 0);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 0);
    assert_int_equal(stat(f, "snapkv_evictions_total"), 0);
    assert_int_equal(stat(f, "snapkv_pool_blocks_used"), 8 * unit);
    assert_int_equal(stat(f, "snapkv_prefix_retained_dropped_total"), 2);
    /* a cap of 2 blocks a head: b's rows (3) are not kept, a's (2) are */
    f->cfg.prefix_retain_bytes = (int64_t)(2 * unit * bb);
    restart_with_pool(f, 8);
    assert_int_equal(prefill_reused(f, NULL, 48, b), 0);
    assert_int_equal(release_by_x(f, b), SKV_OK);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 0);
    assert_int_equal(prefill_reused(f, NULL, 32, a), 0);
    assert_int_equal(release_by_x(f, a), SKV_OK);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 1);
    assert_int_equal(stat(f, "snapkv_prefix_retained_dropped_total"), 0);
    /* EVICT of every unpinned session drops it */
    Snapkv__EvictRequest er = SNAPKV__EVICT_REQUEST__INIT;
    er.all_unpinned = true;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_EVICT;
    req.evict = &er;
    Snapkv__Reply *rep = admin_call(f, &req);
    assert_int_equal(rep->status, SKV_OK);
    assert_int_equal(rep->evict->bytes_freed, 2 * unit * bb);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 0);
    assert_int_equal(stat(f, "snapkv_pool_blocks_used"), 0);
    /* a compressing PREFILL keeps its prompt's rows too, whole (3 blocks a head), taken before
     * each layer is cut: a full-cache PREFILL of 64 tokens then reuses 48; with no pool room
     * for them besides what the session keeps (a pool of 3 blocks a head), they are not kept */
    f->cfg.prefix_retain_bytes = (int64_t)(4 * unit * bb);
    for (int blocks = 8; blocks >= 3; blocks -= 5) {
        restart_with_pool(f, blocks);
        Snapkv__Reply *cr = prefill_reply(f, NULL, 48, "policy=snapkv,budget=16,window=4", 0);
        if (cr->status)
            fail_msg("PREFILL: %d %s", cr->status, cr->message);
        assert_int_equal(cr->prefill->bytes_after, 1 * unit * bb); /* 16 rows a head */
        snapkv__reply__free_unpacked(cr, NULL);
        assert_int_equal(stat(f, "snapkv_prefix_retained"), blocks == 8);
        if (blocks == 8) {
            assert_int_equal(stat(f, "snapkv_prefix_retained_bytes"), 3 * unit * bb);
            assert_int_equal(stat(f, "snapkv_pool_blocks_used"), 4 * unit);
            assert_int_equal(prefill_reused(f, NULL, 64, b), 48);
        } else {
            assert_int_equal(stat(f, "snapkv_pool_blocks_used"), 1 * unit);
        }
    }
    /* unused for lease-seconds (2 s here; the session asks for its own lease), it goes at one of
     * the worker's ticks (every second) */
    f->cfg.lease_seconds = 2;
    restart_with_pool(f, 8);
    Snapkv__Reply *pr = prefill_reply(f, NULL, 32, "policy=full", 600);
    assert_int_equal(pr->status, SKV_OK);
    memcpy(a, pr->prefill->session_id.data, 16);
    snapkv__reply__free_unpacked(pr, NULL);
    assert_int_equal(release_by_x(f, a), SKV_OK);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 1);
    double left = 1;
    for (int i = 0; i < 100 && left > 0; i++) {
        usleep(100 * 1000);
        left = stat(f, "snapkv_prefix_retained");
    }
    assert_int_equal(left, 0);
    assert_int_equal(stat(f, "snapkv_prefix_retained_dropped_total"), 1);
    assert_int_equal(stat(f, "snapkv_pool_blocks_used"), 0);
}

/* A full-cache PREFILL for tenant of the first n fixed ids with the first replaced by `first`
 * (another history for each), then its RELEASE, which keeps its rows (prefix-retain-bytes);
 * returns the tokens the PREFILL reused. */
static uint32_t prefill_release_ids(struct fixture *f, const char *tenant, uint32_t *tokens, int n);

static uint32_t prefill_release(struct fixture *f, const char *tenant, uint32_t first, int n)
{
    uint32_t tokens[64];
    fixed_ids(f, tokens, n);
    tokens[0] = first % (uint32_t)f->tiny->m->cfg.n_vocab;
    return prefill_release_ids(f, tenant, tokens, n);
}

/* The same for tokens[0..n). */
static uint32_t prefill_release_ids(struct fixture *f, const char *tenant, uint32_t *tokens, int n)
{
    Snapkv__PrefillRequest p = SNAPKV__PREFILL_REQUEST__INIT;
    p.tokens = tokens;
    p.n_tokens = (size_t)n;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_PREFILL;
    req.prefill = &p;
    req.tenant = (char *)tenant;
    Snapkv__Reply *rep = call(f, 0, ID_X, &req);
    if (rep->status)
        fail_msg("PREFILL: %d %s", rep->status, rep->message);
    uint32_t reused = rep->prefill->reused_tokens;
    Snapkv__ReleaseRequest rr = SNAPKV__RELEASE_REQUEST__INIT;
    rr.session_id = rep->prefill->session_id;
    Snapkv__Request rel = SNAPKV__REQUEST__INIT;
    rel.command_case = SNAPKV__REQUEST__COMMAND_RELEASE;
    rel.release = &rr;
    rel.tenant = (char *)tenant;
    Snapkv__Reply *done = call(f, 0, ID_X, &rel);
    assert_int_equal(done->status, SKV_OK);
    snapkv__reply__free_unpacked(done, NULL);
    snapkv__reply__free_unpacked(rep, NULL);
    return reused;
}

/* Kept prefixes that share a document's start (one-shot clients asking different questions
 * about one document) hold its blocks once, and count them once: against prefix-retain-bytes,
 * in STATS, and for the tenant's max-bytes-per-tenant, where the blocks no session holds count
 * (before, each entry counted them against the cap, so a cap of 4 blocks a head kept one of
 * two such entries, and none counted them for the tenant). */
static void test_prefix_retain_shared(void **state)
{
    struct fixture *f = *state;
    f->cfg.prefix_reuse = true;
    uint64_t bb;
    const uint64_t unit = kv_unit(f, &bb);
    const uint32_t n_vocab = (uint32_t)f->tiny->m->cfg.n_vocab;
    f->cfg.prefix_retain_bytes = (int64_t)(4 * unit * bb);
    restart_with_pool(f, 16);
    uint32_t doc[48];
    fixed_ids(f, doc, 48);
    assert_int_equal(prefill_release_ids(f, NULL, doc, 48), 0);
    for (int i = 32; i < 48; i++) /* another question after the same 32 tokens */
        doc[i] = (doc[i] + 7) % n_vocab;
    assert_int_equal(prefill_release_ids(f, NULL, doc, 48), 32);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 2);
    assert_int_equal(stat(f, "snapkv_prefix_retained_bytes"), 4 * unit * bb);
    assert_int_equal(stat(f, "snapkv_pool_blocks_used"), 4 * unit);
    assert_int_equal(stat(f, "snapkv_prefix_retained_dropped_total"), 0);
    assert_int_equal(stat(f, "snapkv_tenant_prefix_retained_bytes{tenant=\"t\"}"), 4 * unit * bb);
    /* a session that takes the shared blocks holds them: they count in it, not again */
    uint8_t a[16];
    assert_int_equal(prefill_reused(f, NULL, 48, a), 32);
    assert_int_equal(stat(f, "snapkv_tenant_prefix_retained_bytes{tenant=\"t\"}"), 2 * unit * bb);
    /* a third question: 5 distinct blocks a head, past the cap: the least recently used goes
     * and frees its own block alone */
    for (int i = 32; i < 48; i++)
        doc[i] = (doc[i] + 7) % n_vocab;
    assert_int_equal(prefill_release_ids(f, NULL, doc, 48), 32);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 2);
    assert_int_equal(stat(f, "snapkv_prefix_retained_bytes"), 4 * unit * bb);
    assert_int_equal(stat(f, "snapkv_prefix_retained_dropped_total"), 1);
}

/* Kept prefixes that share a long document's start add a block a head each, but each holds its
 * own index of every row (token ids, each head's positions, scores and block table): the cap
 * holds their host memory too (snapkv_prefix_retained_host_bytes). 50 questions of 16 tokens
 * after one 448-token start, a cap of 100 blocks a head: the blocks alone would keep all 50
 * (28 + 50 blocks a head), whose host memory passed the cap. */
static void test_prefix_retain_host(void **state)
{
    struct fixture *f = *state;
    f->cfg.prefix_reuse = true;
    uint64_t bb;
    const uint64_t unit = kv_unit(f, &bb), cap = 100 * unit * bb;
    const uint32_t n_vocab = (uint32_t)f->tiny->m->cfg.n_vocab;
    f->cfg.prefix_retain_bytes = (int64_t)cap;
    restart_with_pool(f, 160);
    enum { START = 448, N = START + 16, QUESTIONS = 50 };
    uint32_t doc[N];
    for (int i = 0; i < N; i++)
        doc[i] = (uint32_t)(i * 37 + 11) % n_vocab;
    uint64_t most = 0;
    for (int q = 0; q < QUESTIONS; q++) {
        for (int i = START; i < N; i++)
            doc[i] = (uint32_t)(q * 53 + i * 11 + 5) % n_vocab;
        assert_int_equal(prefill_release_ids(f, NULL, doc, N), q ? START : 0);
        uint64_t host = (uint64_t)stat(f, "snapkv_prefix_retained_host_bytes");
        assert_true(host > 0 && host <= cap);
        assert_true((uint64_t)stat(f, "snapkv_prefix_retained_bytes") <= cap);
        most = host > most ? host : most;
    }
    int kept = (int)stat(f, "snapkv_prefix_retained");
    printf("# %d of %d kept prefixes kept; their host memory at most %llu bytes, their blocks %.0f, the cap %llu\n",
           kept, QUESTIONS, (unsigned long long)most, stat(f, "snapkv_prefix_retained_bytes"),
           (unsigned long long)cap);
    assert_true(kept > 1 && kept < QUESTIONS);
}

/* A kept prefix that a new one covers goes only once the new one is in: tenant b keeps 5 blocks
 * a head, a keeps document D (5, its own), then D and a question (6, sharing D's 5) under a cap
 * of 10: a is then over its share and its new entry is the one the cap drops, so D's entry stays
 * and a's next question reuses D (before, D's entry was dropped first as covered, and a kept
 * nothing: its next PREFILL reused 0 tokens). */
static void test_prefix_retain_covered(void **state)
{
    struct fixture *f = *state;
    f->cfg.prefix_reuse = true;
    uint64_t bb;
    const uint64_t unit = kv_unit(f, &bb);
    const uint32_t n_vocab = (uint32_t)f->tiny->m->cfg.n_vocab;
    f->cfg.prefix_retain_bytes = (int64_t)(10 * unit * bb);
    restart_with_pool(f, 48);
    uint32_t b[80], d[96];
    for (int i = 0; i < 80; i++)
        b[i] = (uint32_t)(i * 7 + 3) % n_vocab;
    for (int i = 0; i < 96; i++)
        d[i] = (uint32_t)(i * 37 + 11) % n_vocab;
    assert_int_equal(prefill_release_ids(f, "b", b, 80), 0);
    assert_int_equal(prefill_release_ids(f, "a", d, 80), 0);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 2);
    assert_int_equal(prefill_release_ids(f, "a", d, 96), 80); /* D + a question: its entry is dropped */
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 2);
    assert_true(stat(f, "snapkv_prefix_retained_bytes") <= 10 * unit * bb);
    for (int i = 80; i < 96; i++) /* another question */
        d[i] = (uint32_t)(i * 17 + 1) % n_vocab;
    assert_int_equal(prefill_release_ids(f, "a", d, 96), 80);
}

/* A prefix the cap then drops itself (its tenant over its share with nothing older) drops no
 * other on its way: with a cap of 10 blocks a layer and head, b's 4 and a's 3 kept, a's new 7
 * push out a's 3 first, and are then the cap's own choice; a's 3 come back (before, they were
 * gone, and the new 7 not kept either). */
static void test_prefix_keep_refused(void **state)
{
    struct fixture *f = *state;
    f->cfg.prefix_reuse = true;
    uint64_t bb;
    const uint64_t unit = kv_unit(f, &bb);
    const uint32_t n_vocab = (uint32_t)f->tiny->m->cfg.n_vocab;
    f->cfg.prefix_retain_bytes = (int64_t)(10 * unit * bb);
    restart_with_pool(f, 48);
    uint32_t b[64], a1[48], e[112];
    for (int i = 0; i < 64; i++)
        b[i] = (uint32_t)(i * 7 + 3) % n_vocab;
    for (int i = 0; i < 48; i++)
        a1[i] = (uint32_t)(i * 37 + 11) % n_vocab;
    for (int i = 0; i < 112; i++)
        e[i] = (uint32_t)(i * 13 + 5) % n_vocab;
    assert_int_equal(prefill_release_ids(f, "b", b, 64), 0);
    assert_int_equal(prefill_release_ids(f, "a", a1, 48), 0);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 2);
    assert_int_equal(stat(f, "snapkv_prefix_retained_bytes"), 7 * unit * bb);
    assert_int_equal(prefill_release_ids(f, "a", e, 112), 0);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 2);
    assert_int_equal(stat(f, "snapkv_prefix_retained_bytes"), 7 * unit * bb);
    assert_int_equal(stat(f, "snapkv_prefix_retained_dropped_total"), 0);
    assert_int_equal(prefill_release_ids(f, "a", a1, 48), 32); /* a's 3 serve it still (one token computed) */
}

/* The entries a new one pushes out for its tenant's room keep their blocks in the counts until
 * they go: X (a document's 4 blocks and a question's 1) and Y (the document and another
 * question) share the document's; a new 7-block entry with room 8 pushes out X, then Y (Y's
 * 5 blocks still count: X's going leaves the document's to Y), and the tenant ends within 8
 * (before, X's going took the document's blocks out of the count, Y stayed, and the tenant
 * held 12). */
static void test_prefix_keep_room_shared(void **state)
{
    struct fixture *f = *state;
    struct skv_model *m = f->tiny->m;
    uint64_t bb;
    const uint64_t unit = kv_unit(f, &bb);
    struct skv_kv_pool_stats ps;
    skv_kv_pool_stats(m->kv_pool, &ps);
    const int br = ps.block_rows;
    assert_true(br <= 16);
    struct skv_prefix_cache pc = {.cap = 100 * unit * bb};
    int32_t x[8 * 16], y[8 * 16], z[8 * 16];
    for (int i = 0; i < 8 * br; i++) {
        x[i] = y[i] = (int32_t)((i * 37 + 11) % m->cfg.n_vocab);
        z[i] = (int32_t)((i * 13 + 5) % m->cfg.n_vocab);
    }
    for (int i = 4 * br; i < 5 * br; i++)
        y[i] = (int32_t)((i * 7 + 3) % m->cfg.n_vocab);
    struct skv_kv_cache *cx = NULL, *cy = NULL, *cz = NULL;
    assert_int_equal(skv_kv_cache_new(m, &cx), SKV_OK);
    assert_int_equal(skv_engine_forward(f->tiny->e, cx, x, 5 * br, NULL, NULL), SKV_OK);
    assert_int_equal(skv_kv_cache_clone_rows(cx, 4 * br, &cy), SKV_OK);
    assert_int_equal(skv_engine_forward(f->tiny->e, cy, y + 4 * br, br, NULL, NULL), SKV_OK);
    assert_int_equal(skv_prefix_cache_add(&pc, "t", x, 5 * br, cx, UINT64_MAX, 1, NULL), SKV_OK);
    assert_int_equal(skv_prefix_cache_add(&pc, "t", y, 5 * br, cy, UINT64_MAX, 2, NULL), SKV_OK);
    skv_kv_cache_free(&cx);
    skv_kv_cache_free(&cy);
    assert_int_equal(pc.n, 2);
    assert_int_equal(skv_prefix_cache_tenant_bytes(&pc, "t", true), 6 * unit * bb);
    assert_int_equal(skv_kv_cache_new(m, &cz), SKV_OK);
    assert_int_equal(skv_engine_forward(f->tiny->e, cz, z, 7 * br, NULL, NULL), SKV_OK);
    assert_int_equal(skv_prefix_cache_add(&pc, "t", z, 7 * br, cz, 8 * unit * bb, 3, NULL), SKV_OK);
    skv_kv_cache_free(&cz);
    printf("# the tenant's entries: %d, %llu blocks a layer and head\n", pc.n,
           (unsigned long long)(skv_prefix_cache_tenant_bytes(&pc, "t", true) / (unit * bb)));
    assert_true(skv_prefix_cache_tenant_bytes(&pc, "t", true) <= 8 * unit * bb);
    assert_int_equal(pc.n, 1);
    skv_prefix_cache_clear(&pc, NULL);
}

static void persist_on(struct fixture *f, char *dir, const char *interval);
static void only_match(const char *dir, const char *pattern, char *path, size_t cap);
static void rewrite_saved(const char *path, long at, const void *bytes, size_t n);
static void persist_off(struct fixture *f, const char *dir);
static void restart(struct fixture *f);

/* Kept prefixes under a random mix of one-shot clients of two tenants (three documents' starts,
 * questions from a random token on, 16 to 64 tokens), EVICTs of a tenant and restarts with
 * persist: with no session held, the pool's blocks in use are the kept prefixes' and
 * snapkv_prefix_retained_bytes counts each once, never past the cap, and the tenants' counts
 * (what their quotas count) add up to it. A count of kept holders that drifted (an entry's
 * blocks counted on the way in and not out) would break the first. */
static void test_prefix_retain_random(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX";
    f->cfg.prefix_reuse = true;
    uint64_t bb;
    const uint64_t unit = kv_unit(f, &bb), cap = 10 * unit * bb;
    const uint32_t n_vocab = (uint32_t)f->tiny->m->cfg.n_vocab;
    f->cfg.prefix_retain_bytes = (int64_t)cap;
    persist_on(f, dir, "0");
    uint64_t x = 12345, most = 0;
    int restarts = 0, evicts = 0;
    for (int it = 0; it < 150; it++) {
        x = x * UINT64_C(6364136223846793005) + UINT64_C(1442695040888963407);
        const unsigned r = (unsigned)(x >> 33);
        const char *tenant = r & 1 ? "t" : "u";
        if (r % 23 == 0) {
            restart(f);
            restarts++;
        } else if (r % 13 == 0) {
            Snapkv__EvictRequest er = SNAPKV__EVICT_REQUEST__INIT;
            er.tenant = (char *)tenant;
            Snapkv__Request req = SNAPKV__REQUEST__INIT;
            req.command_case = SNAPKV__REQUEST__COMMAND_EVICT;
            req.evict = &er;
            Snapkv__Reply *rep = admin_call(f, &req);
            assert_int_equal(rep->status, SKV_OK);
            snapkv__reply__free_unpacked(rep, NULL);
            evicts++;
        } else {
            uint32_t tokens[64];
            fixed_ids(f, tokens, 64);
            tokens[0] = 1 + (r >> 3) % 3; /* the document */
            const int n = 16 * (1 + (int)((r >> 5) % 4)), from = (int)((r >> 7) % (unsigned)n);
            for (int i = from; i < n; i++) /* the question */
                tokens[i] = (tokens[i] + 1 + (r >> 11) % 5) % n_vocab;
            prefill_release_ids(f, tenant, tokens, n);
        }
        const double kept = stat(f, "snapkv_prefix_retained_bytes");
        assert_int_equal(stat(f, "snapkv_sessions"), 0);
        assert_int_equal(stat(f, "snapkv_pool_blocks_used") * (double)bb, kept);
        assert_true(kept <= (double)cap);
        assert_int_equal(stat_or_0(f, "snapkv_tenant_prefix_retained_bytes{tenant=\"t\"}") +
                             stat_or_0(f, "snapkv_tenant_prefix_retained_bytes{tenant=\"u\"}"),
                         kept);
        most = kept > (double)most ? (uint64_t)kept : most;
    }
    printf("# %d restarts, %d EVICTs; at most %llu of %llu bytes kept, %.0f kept prefixes at the end\n", restarts,
           evicts, (unsigned long long)most, (unsigned long long)cap, stat(f, "snapkv_prefix_retained"));
    assert_true(restarts > 2 && evicts > 2 && most > cap / 2);
    persist_off(f, dir);
}

/* Kept prefixes and tenants: past the cap, those of a tenant holding more than an equal share
 * go first, even when another tenant's is older; a tenant's kept prefixes count with its
 * sessions against max-bytes-per-tenant and go before any of its sessions. */
static void test_prefix_retain_tenants(void **state)
{
    struct fixture *f = *state;
    f->cfg.prefix_reuse = true;
    uint64_t bb;
    const uint64_t unit = kv_unit(f, &bb);
    f->cfg.prefix_retain_bytes = (int64_t)(6 * unit * bb); /* 3 prefixes of 32 tokens */
    restart_with_pool(f, 16);
    assert_int_equal(prefill_release(f, "u", 1, 32), 0); /* the oldest */
    assert_int_equal(prefill_release(f, "t", 2, 32), 0);
    assert_int_equal(prefill_release(f, "t", 3, 32), 0);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 3);
    /* t's third: t would hold 6 of 8 blocks a head, more than half: t's oldest goes, not u's */
    assert_int_equal(prefill_release(f, "t", 4, 32), 0);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 3);
    assert_int_equal(stat(f, "snapkv_prefix_retained_dropped_total"), 1);
    /* each prompt's first block is computed again (more than the small-batch size) */
    assert_int_equal(prefill_release(f, "u", 1, 32), 16);
    assert_int_equal(prefill_release(f, "t", 3, 32), 16);
    assert_int_equal(prefill_release(f, "t", 4, 32), 16);
    assert_int_equal(prefill_release(f, "t", 2, 32), 0); /* t's oldest went; now t's 3 goes */
    assert_int_equal(stat(f, "snapkv_prefix_retained_dropped_total"), 2);
    assert_int_equal(prefill_release(f, "u", 1, 32), 16);
    assert_int_equal(prefill_release(f, "t", 4, 32), 16);
    /* a quota of 5 blocks a head: kept prefixes and sessions together */
    f->cfg.prefix_retain_bytes = (int64_t)(16 * unit * bb);
    restart_with_quota(f, 5);
    assert_int_equal(prefill_release(f, NULL, 1, 32), 0);
    assert_int_equal(prefill_release(f, NULL, 2, 32), 0);
    assert_int_equal(stat(f, "snapkv_prefix_retained_bytes"), 4 * unit * bb);
    assert_int_equal(prefill_release(f, NULL, 3, 32), 0); /* its session + 4 > 5: the oldest goes */
    assert_int_equal(stat(f, "snapkv_prefix_retained_bytes"), 4 * unit * bb);
    assert_int_equal(prefill_release(f, NULL, 1, 32), 0); /* 2's goes for its session */
    /* 48 tokens take 32 from 3's, whose blocks then count once (in the session): nothing goes
     * for the session (3 + 1's 2 = 5); its release keeps 3 blocks, covering 3's */
    assert_int_equal(stat(f, "snapkv_prefix_retained_dropped_total"), 2);
    assert_int_equal(prefill_release(f, NULL, 3, 48), 32);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 2);
    assert_int_equal(stat(f, "snapkv_prefix_retained_bytes"), 5 * unit * bb);
    assert_int_equal(stat(f, "snapkv_prefix_retained_dropped_total"), 3);
    /* a session of 3 blocks a head: the kept go (oldest first) before it is refused or any session evicted */
    uint8_t a[16];
    prefill(f, 48, "policy=full", a);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 0);
    assert_int_equal(stat(f, "snapkv_prefix_retained_dropped_total"), 5);
    assert_int_equal(stat(f, "snapkv_evictions_total"), 0);
    assert_int_equal(listed(f, a, NULL, NULL), 48);
    /* another tenant's are its own: u keeps 2 blocks a head beside t's session */
    assert_int_equal(prefill_release(f, "u", 9, 32), 0);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 1);
    assert_int_equal(listed(f, a, NULL, NULL), 48);
    /* beside t's idle session of 3, a release keeps 2 (room 2); the next PREFILL's room takes
     * them (3 + 2 + 2 > 5), not the idle session */
    assert_int_equal(prefill_release(f, NULL, 5, 32), 0);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 2);
    assert_int_equal(prefill_release(f, NULL, 6, 32), 0);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 2); /* u's, and t's 6 */
    assert_int_equal(stat(f, "snapkv_prefix_retained_dropped_total"), 6);
    assert_int_equal(stat(f, "snapkv_evictions_total"), 0);
    assert_int_equal(listed(f, a, NULL, NULL), 48);
    /* rows over the room on their own are not kept: a compressing PREFILL of 48 tokens keeps 1
     * block a head, beside the idle 3 that leaves 1 for its prompt's 3 (t's 6 goes for it) */
    Snapkv__Reply *cr = prefill_reply(f, NULL, 48, "policy=snapkv,budget=16,window=4", 0);
    if (cr->status)
        fail_msg("PREFILL: %d %s", cr->status, cr->message);
    snapkv__reply__free_unpacked(cr, NULL);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 1); /* u's */
    assert_int_equal(stat(f, "snapkv_prefix_retained_bytes"), 2 * unit * bb);
    assert_int_equal(stat(f, "snapkv_tenant_prefix_retained_bytes{tenant=\"u\"}"), 2 * unit * bb);
    assert_int_equal(stat(f, "snapkv_tenant_prefix_retained_bytes{tenant=\"t\"}"), 0);
    assert_int_equal(stat(f, "snapkv_evictions_total"), 0);
    assert_int_equal(listed(f, a, NULL, NULL), 48);
}

/* Prefix reuse and the tenant's bytes: the blocks a PREFILL takes from another session count
 * for its tenant in each session holding them (as a FORK's), once for the pool; past the
 * tenant's quota its idle sessions go first, the source too (the blocks stay, shared). */
static void test_prefix_reuse_quota(void **state)
{
    struct fixture *f = *state;
    f->cfg.prefix_reuse = true;
    const struct skv_model_config *mc = &f->tiny->m->cfg;
    const double unit = mc->n_layers * mc->n_kv_heads; /* a block per layer and KV head */
    for (int quota = 5; quota >= 4; quota--) {
        restart_with_quota(f, quota); /* 80, then 64 rows per head */
        uint8_t a[16], b[16];
        prefill(f, 32, "policy=full", a); /* 2 blocks a head */
        Snapkv__Reply *rep = prefill_reply(f, NULL, 48, "policy=full", 0); /* computes more than 8 */
        if (rep->status)
            fail_msg("PREFILL: %d %s", rep->status, rep->message);
        assert_int_equal(rep->prefill->reused_tokens, 32);
        assert_int_equal(rep->prefill->n_tokens, 48);
        memcpy(b, rep->prefill->session_id.data, 16);
        snapkv__reply__free_unpacked(rep, NULL);
        uint64_t bytes = 0;
        assert_int_equal(listed(f, b, &bytes, NULL), 48);
        assert_int_equal(bytes, 3 * unit * skv_kv_pool_block_bytes(f->tiny->m->kv_pool));
        assert_int_equal(stat(f, "snapkv_prefill_tokens_total"), 32 + 16);
        assert_int_equal(stat(f, "snapkv_prefix_reused_tokens_total"), 32);
        assert_int_equal(stat(f, "snapkv_pool_blocks_used"), 3 * unit);
        if (quota == 5) { /* a 2 + b 3 blocks a head */
            assert_int_equal(listed(f, a, NULL, NULL), 32);
            assert_int_equal(stat(f, "snapkv_pool_blocks_shared"), 2 * unit);
            assert_int_equal(stat(f, "snapkv_evictions_total"), 0);
        } else { /* 5 > 4: a, idle, went; its blocks are b's alone now */
            assert_int_equal(listed(f, a, NULL, NULL), -1);
            assert_int_equal(stat(f, "snapkv_pool_blocks_shared"), 0);
            assert_int_equal(stat(f, "snapkv_evictions_total"), 1);
        }
        /* another tenant's session takes nothing from these */
        rep = prefill_reply(f, "u", 48, "policy=full", 0);
        assert_int_equal(rep->status, SKV_OK);
        assert_int_equal(rep->prefill->reused_tokens, 0);
        snapkv__reply__free_unpacked(rep, NULL);
    }
}

/* A full-cache PREFILL that cannot fit is refused before its forward (before, after it, with
 * the pool past its size meanwhile): no prompt token counted as prefilled, the tenant's other
 * session kept; one that fits once the idle session goes evicts it. */
static void test_prefill_over_quota(void **state)
{
    struct fixture *f = *state;
    restart_with_quota(f, 2); /* 32 rows per head */
    uint8_t a[16];
    prefill(f, 8, "policy=full", a);
    uint32_t tokens[40];
    fixed_ids(f, tokens, 40);
    Snapkv__PrefillRequest p = SNAPKV__PREFILL_REQUEST__INIT;
    p.tokens = tokens;
    p.n_tokens = 40; /* 3 blocks per head */
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_PREFILL;
    req.prefill = &p;
    Snapkv__Reply *rep = call(f, 0, ID_X, &req);
    assert_int_equal(rep->status, SKV_E_LIMIT);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(stat(f, "snapkv_prefill_tokens_total"), 8);
    int count = 0;
    assert_int_equal(listed(f, a, NULL, &count), 8);
    assert_int_equal(count, 1);
    p.n_tokens = 30; /* 2 blocks per head: a goes */
    rep = call(f, 0, ID_X, &req);
    assert_int_equal(rep->status, SKV_OK);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(listed(f, a, NULL, &count), -1);
    assert_int_equal(count, 1);
    assert_int_equal(stat(f, "snapkv_prefill_tokens_total"), 8 + 30);
    /* so is a compressing one that keeps its layers whole (ratio=1; SqueezeAttention's cap of
     * 4 B above the prompt): before, it ran, held 3 blocks a head past the quota, and was
     * refused when charged; one keeping 16 rows fits */
    Snapkv__CompressSpec cs = SNAPKV__COMPRESS_SPEC__INIT;
    p.compress = &cs;
    p.n_tokens = 40;
    static const char *const whole[] = {"policy=snapkv,ratio=1", "policy=snapkv,alloc=squeeze,budget=16,window=4"};
    for (int k = 0; k < 2; k++) {
        cs.spec = (char *)whole[k];
        rep = call(f, 0, ID_X, &req);
        assert_int_equal(rep->status, SKV_E_LIMIT);
        assert_non_null(strstr(rep->message, "max-bytes-per-tenant"));
        snapkv__reply__free_unpacked(rep, NULL);
        assert_int_equal(stat(f, "snapkv_prefill_tokens_total"), 8 + 30);
    }
    cs.spec = "policy=snapkv,budget=16,window=4";
    rep = call(f, 0, ID_X, &req);
    if (rep->status)
        fail_msg("PREFILL: %d %s", rep->status, rep->message);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(stat(f, "snapkv_prefill_tokens_total"), 8 + 30 + 40);
    /* PyramidKV over 48 tokens keeps 36 and 4 rows (3 + 1 blocks a head: the quota, once the
     * idle sessions go); room counted as its largest layer in every layer (6) refused it */
    uint32_t more[48];
    fixed_ids(f, more, 48);
    p.tokens = more;
    p.n_tokens = 48;
    cs.spec = "policy=snapkv,alloc=pyramid,budget=20,window=4";
    rep = call(f, 0, ID_X, &req);
    if (rep->status)
        fail_msg("PREFILL: %d %s", rep->status, rep->message);
    assert_int_equal(rep->prefill->kept[0]->kept, 36);
    assert_int_equal(rep->prefill->kept[1]->kept, 4);
    snapkv__reply__free_unpacked(rep, NULL);
}

/* SnapKV re-scoring's query ring (L + 1 rows of min(window, decode_budget) queries) counts
 * against the tenant's quota from the PREFILL on: with room for the cache alone, a spec that
 * re-scores is refused and the same spec without decode_budget fits. */
static void test_ring_counts_in_quota(void **state)
{
    struct fixture *f = *state;
    restart_with_quota(f, 1); /* 16 rows per head */
    uint32_t tokens[8];
    fixed_ids(f, tokens, 8);
    Snapkv__CompressSpec cs = SNAPKV__COMPRESS_SPEC__INIT;
    cs.spec = "policy=snapkv,budget=8,window=4,decode_budget=8";
    Snapkv__PrefillRequest p = SNAPKV__PREFILL_REQUEST__INIT;
    p.tokens = tokens;
    p.n_tokens = 8;
    p.compress = &cs;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_PREFILL;
    req.prefill = &p;
    Snapkv__Reply *rep = call(f, 0, ID_X, &req);
    assert_int_equal(rep->status, SKV_E_LIMIT);
    const struct skv_model_config *mc = &f->tiny->m->cfg;
    uint64_t kv = (uint64_t)mc->n_layers * mc->n_kv_heads * skv_kv_pool_block_bytes(f->tiny->m->kv_pool);
    uint64_t ring = (uint64_t)(mc->n_layers + 1) * 4 * mc->n_heads * mc->head_dim * sizeof(float);
    char want[128];
    snprintf(want, sizeof want, "would hold %llu bytes", (unsigned long long)(kv + ring));
    assert_non_null(strstr(rep->message, want));
    snapkv__reply__free_unpacked(rep, NULL);
    cs.spec = "policy=snapkv,budget=8,window=4";
    rep = call(f, 0, ID_X, &req);
    assert_int_equal(rep->status, SKV_OK);
    snapkv__reply__free_unpacked(rep, NULL);
}

static void submit_decode(struct fixture *f, const uint8_t *id, const char *tenant, const uint8_t sid[16],
                          uint32_t max_tokens, bool stream);
static Snapkv__Reply *decode_final(struct fixture *f, const uint8_t *id, uint32_t *toks, int *n, int cap);

/* A collected DECODE of max_tokens in session sid of tenant (NULL: the default; client ID_X):
 * its reply. */
static Snapkv__Reply *decode_call(struct fixture *f, const char *tenant, const uint8_t sid[16], uint32_t max_tokens)
{
    Snapkv__Sampling sm = SNAPKV__SAMPLING__INIT;
    sm.max_tokens = max_tokens;
    Snapkv__DecodeRequest d = SNAPKV__DECODE_REQUEST__INIT;
    d.session_id = (ProtobufCBinaryData){16, (uint8_t *)sid};
    d.sampling = &sm;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_DECODE;
    req.decode = &d;
    req.tenant = (char *)tenant;
    return call(f, 0, ID_X, &req);
}

/* One forward in session sid: a one-token DECODE (decode) or a 4-token APPEND; its status. */
static int upkeep_step(struct fixture *f, const uint8_t sid[16], bool decode)
{
    if (!decode)
        return append(f, sid, 4, NULL);
    Snapkv__Reply *rep = decode_call(f, NULL, sid, 1);
    int rc = rep->status;
    snapkv__reply__free_unpacked(rep, NULL);
    return rc;
}

/* The tenant bytes an APPEND of 64 ids to a fresh session of spec (decoded `decoded` tokens
 * first) says it would hold when the quota of `blocks` refuses it. */
static unsigned long long append_would_hold(struct fixture *f, int blocks, const char *spec, int decoded)
{
    restart_with_quota(f, blocks);
    uint8_t sid[16];
    prefill(f, 8, spec, sid);
    if (decoded) {
        submit_decode(f, ID_X, NULL, sid, (uint32_t)decoded, false);
        uint32_t toks[8];
        int n = 0;
        Snapkv__Reply *rep = decode_final(f, ID_X, toks, &n, 8);
        if (rep->status)
            fail_msg("DECODE: %d %s", rep->status, rep->message);
        snapkv__reply__free_unpacked(rep, NULL);
    }
    submit_append(f, ID_X, sid, 64);
    Snapkv__Reply *rep = next_reply(f, 0, ID_X, 5);
    assert_int_equal(rep->status, SKV_E_LIMIT);
    const char *at = strstr(rep->message, "would hold ");
    assert_non_null(at);
    unsigned long long bytes = strtoull(at + strlen("would hold "), NULL, 10);
    snapkv__reply__free_unpacked(rep, NULL);
    return bytes;
}

/* A long APPEND whose policy re-scores runs on a copy of the session, whose compressor's query
 * ring is a second one beside the session's until the APPEND ends: it counts for the tenant
 * (before, the quota counted one ring and the tenant held two). Before the first decoded token
 * the ring is not allocated and its copy holds none: the two counts differ by one ring. */
static void test_append_copy_ring(void **state)
{
    struct fixture *f = *state;
    const char *spec = "policy=snapkv,budget=8,window=4,decode_budget=8";
    unsigned long long before = append_would_hold(f, 3, spec, 0), after = append_would_hold(f, 3, spec, 1);
    const struct skv_model_config *mc = &f->tiny->m->cfg;
    uint64_t ring = (uint64_t)(mc->n_layers + 1) * 4 * mc->n_heads * mc->head_dim * sizeof(float);
    printf("# an APPEND of 64: would hold %llu bytes with no ring allocated, %llu with one (a ring: %llu)\n", before,
           after, (unsigned long long)ring);
    assert_int_equal(after - before, ring);
}

/* A collected DECODE whose 5th token's forward fails (a device error, in its second layer's
 * norm) after 4 tokens went in: an OK reply with those 4, finish_reason "error" and the reason in
 * its message; the session holds them (before: an error reply with no token, the session 4 tokens
 * longer than its client knew). Streamed: the same final reply after 4 token replies. */
static void test_decode_fails_midway(void **state)
{
    struct fixture *f = *state;
    uint8_t sid[16];
    prefill(f, 8, "policy=full", sid);
    Snapkv__Sampling sm = SNAPKV__SAMPLING__INIT;
    sm.max_tokens = 1;
    Snapkv__DecodeRequest d = SNAPKV__DECODE_REQUEST__INIT;
    d.session_id = (ProtobufCBinaryData){16, sid};
    d.sampling = &sm;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_DECODE;
    req.decode = &d;
    long c0 = atomic_load(&g_rmsnorm_calls);
    Snapkv__Reply *rep = call(f, 0, ID_X, &req); /* one token's forward: its rmsnorm calls */
    assert_int_equal(rep->status, SKV_OK);
    snapkv__reply__free_unpacked(rep, NULL);
    long per_token = atomic_load(&g_rmsnorm_calls) - c0;
    assert_true(per_token > 3);
    for (int stream = 0; stream < 2; stream++) {
        uint8_t s2[16];
        prefill(f, 8, "policy=full", s2);
        d.session_id = (ProtobufCBinaryData){16, s2};
        d.stream = stream;
        sm.max_tokens = 12;
        atomic_store(&g_fail_rmsnorm_at, atomic_load(&g_rmsnorm_calls) + 4 * per_token + 3);
        const double errors0 = stat(f, "snapkv_errors_total");
        rep = call(f, 0, ID_X, &req);
        int n_streamed = 0;
        while (rep->status == SKV_OK && !rep->final) {
            n_streamed += (int)rep->decode->n_tokens;
            snapkv__reply__free_unpacked(rep, NULL);
            rep = next_reply(f, 0, ID_X, 5);
        }
        atomic_store(&g_fail_rmsnorm_at, 0);
        if (rep->status)
            fail_msg("DECODE (stream %d): %d %s", stream, rep->status, rep->message);
        assert_string_equal(rep->decode->finish_reason, "error");
        assert_int_equal(rep->decode->n_generated, 4);
        assert_int_equal(rep->decode->n_tokens, stream ? 0 : 4);
        assert_int_equal(n_streamed, stream ? 4 : 0);
        assert_non_null(strstr(rep->message, "the decode failed after 4 token(s), which are in the session: test: "
                                             "the device failed"));
        snapkv__reply__free_unpacked(rep, NULL);
        assert_int_equal(listed(f, s2, NULL, NULL), 12);
        assert_true(stat(f, "snapkv_errors_total") == errors0 + 1); /* a failure, counted as one */
    }
}

static uint32_t *inspect_positions(struct fixture *f, const uint8_t sid[16], size_t *n);

/* A forward on a session whose policy evicts as it goes, failing in its last norm after every
 * layer's upkeep ran: a short APPEND (4 tokens) and a one-token DECODE, for StreamingLLM, H2O,
 * window and SnapKV re-scoring (decode_budget; every token, every second), as the session's
 * first such forward and as its second. An error, and the session as it was, every layer's positions; the retry gives
 * what a twin that never failed got (before, the layers cut as the forward went and kept their
 * cuts: the session lost a row in every layer but the failed one's). */
static void test_upkeep_failure_keeps_rows(void **state)
{
    struct fixture *f = *state;
    static const char *const specs[] = {"policy=streaming,budget=16,sinks=2", "policy=h2o,budget=16,window=4",
                                        "policy=window,budget=16",
                                        "policy=snapkv,budget=16,window=4,decode_budget=16,interval=1",
                                        "policy=snapkv,budget=16,window=4,decode_budget=16,interval=2"};
    for (int k = 0; k < 5; k++)
        for (int run = 0; run < 4; run++) {
            int decode = run & 1, second = run >= 2; /* second: the failure in the session's second forward */
            uint8_t twin[16], sid[16];
            prefill(f, 16, specs[k], twin);
            prefill(f, 16, specs[k], sid);
            if (second)
                for (int t = 0; t < 2; t++)
                    assert_int_equal(append(f, t ? sid : twin, decode ? 1 : 4, NULL), SKV_OK);
            long c0 = atomic_load(&g_rmsnorm_calls);
            assert_int_equal(upkeep_step(f, twin, decode), SKV_OK);
            long per_forward = atomic_load(&g_rmsnorm_calls) - c0; /* its rmsnorm calls */
            assert_true(per_forward > 3);
            size_t n0, n1;
            uint32_t *p0 = inspect_positions(f, sid, &n0);
            atomic_store(&g_fail_rmsnorm_at, atomic_load(&g_rmsnorm_calls) + per_forward); /* the final norm */
            int rc = upkeep_step(f, sid, decode);
            atomic_store(&g_fail_rmsnorm_at, 0);
            assert_int_equal(rc, SKV_E_DEVICE);
            uint32_t *p1 = inspect_positions(f, sid, &n1);
            if (n1 != n0 || memcmp(p1, p0, n0 * sizeof *p0) != 0)
                fail_msg("%s, %s%s: the failed forward changed the rows (%zu positions, %zu before)", specs[k],
                         decode ? "DECODE" : "APPEND", second ? " (second)" : "", n1, n0);
            assert_int_equal(listed(f, sid, NULL, NULL), 16 + (second ? (decode ? 1 : 4) : 0));
            free(p0);
            free(p1);
            assert_int_equal(upkeep_step(f, sid, decode), SKV_OK); /* the retry: the twin's rows */
            p0 = inspect_positions(f, twin, &n0);
            p1 = inspect_positions(f, sid, &n1);
            if (n1 != n0 || memcmp(p1, p0, n0 * sizeof *p0) != 0)
                fail_msg("%s, %s%s: the retry kept other rows than the twin (%zu positions, the twin's %zu)",
                         specs[k], decode ? "DECODE" : "APPEND", second ? " (second)" : "", n1, n0);
            free(p0);
            free(p1);
        }
}

/* SnapKV's re-scoring at a DECODE step's end fails in every layer (the device fails scoring):
 * the token still goes in, every layer keeps its rows whole (one more per head) and the failures
 * are counted; the next step's re-scoring cuts every layer to its decode budget. */
static void test_upkeep_cut_fails(void **state)
{
    struct fixture *f = *state;
    const struct skv_model_config *mc = &f->tiny->m->cfg;
    uint8_t sid[16];
    prefill(f, 16, "policy=snapkv,budget=16,window=4,decode_budget=12,interval=1", sid);
    size_t n0, n1, n2;
    free(inspect_positions(f, sid, &n0));
    assert_int_equal(n0, (size_t)mc->n_layers * mc->n_kv_heads * 16);
    atomic_store(&g_fail_colsum, 1);
    Snapkv__Reply *rep = decode_call(f, NULL, sid, 1);
    atomic_store(&g_fail_colsum, 0);
    assert_int_equal(rep->status, SKV_OK);
    assert_int_equal(rep->decode->n_tokens, 1);
    snapkv__reply__free_unpacked(rep, NULL);
    free(inspect_positions(f, sid, &n1));
    assert_int_equal(n1, (size_t)mc->n_layers * mc->n_kv_heads * 17);
    assert_int_equal(stat(f, "snapkv_upkeep_cuts_failed_total"), mc->n_layers);
    assert_int_equal(listed(f, sid, NULL, NULL), 17);
    assert_int_equal(upkeep_step(f, sid, true), SKV_OK);
    free(inspect_positions(f, sid, &n2));
    assert_int_equal(n2, (size_t)mc->n_layers * mc->n_kv_heads * 12);
    assert_int_equal(stat(f, "snapkv_upkeep_cuts_failed_total"), mc->n_layers);
}

static void test_decode_over_quota(void **state)
{
    struct fixture *f = *state;
    restart_with_quota(f, 1);
    uint8_t sid[16];
    prefill(f, 16, "policy=full", sid); /* one full block per head: the next token needs another */
    Snapkv__Sampling sm = SNAPKV__SAMPLING__INIT;
    sm.max_tokens = 4;
    Snapkv__DecodeRequest d = SNAPKV__DECODE_REQUEST__INIT;
    d.session_id = (ProtobufCBinaryData){16, sid};
    d.sampling = &sm;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_DECODE;
    req.decode = &d;
    const double tokens0 = stat(f, "snapkv_decode_tokens_total");
    Snapkv__Reply *rep = call(f, 0, ID_X, &req);
    assert_int_equal(rep->status, SKV_E_LIMIT);
    assert_non_null(strstr(rep->message, "max-bytes-per-tenant"));
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(listed(f, sid, NULL, NULL), 16); /* the refused token never entered */
    /* nor is it counted generated (it was, in both counters) */
    if (stat(f, "snapkv_decode_tokens_total") != tokens0)
        fail_msg("%g tokens counted, %g before", stat(f, "snapkv_decode_tokens_total"), tokens0);
    /* a policy that keeps 16 rows fits: streaming evicts as it goes */
    uint8_t s2[16];
    restart_with_quota(f, 2);
    prefill(f, 16, "policy=streaming,budget=16,sinks=4", s2);
    d.session_id = (ProtobufCBinaryData){16, s2};
    rep = call(f, 0, ID_X, &req);
    if (rep->status)
        fail_msg("DECODE: %d %s", rep->status, rep->message);
    assert_string_equal(rep->decode->finish_reason, "length");
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(listed(f, s2, NULL, NULL), 20);
    /* refused after 8 tokens went in (8 prompt rows and 8 more fill the one block): the decode
     * ends with them, finish_reason "limit", so a collected decode's client learns what its
     * session now holds (before: an error with no token, and the session 8 tokens longer) */
    uint8_t s3[16];
    restart_with_quota(f, 1);
    prefill(f, 8, "policy=full", s3);
    sm.max_tokens = 12;
    d.session_id = (ProtobufCBinaryData){16, s3};
    rep = call(f, 0, ID_X, &req);
    if (rep->status)
        fail_msg("DECODE: %d %s", rep->status, rep->message);
    assert_string_equal(rep->decode->finish_reason, "limit");
    assert_int_equal(rep->decode->n_generated, 8);
    assert_int_equal(rep->decode->n_tokens, 8);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(listed(f, s3, NULL, NULL), 16);
    assert_true(stat(f, "snapkv_decode_tokens_total") == 8); /* the 8 that went in, not the 9th */
    /* and streamed: eight replies of a token, then the final one with none */
    d.stream = true;
    restart_with_quota(f, 1);
    prefill(f, 8, "policy=full", s3);
    d.session_id = (ProtobufCBinaryData){16, s3};
    Snapkv__Reply *r1 = call(f, 0, ID_X, &req);
    int n_streamed = 0;
    while (r1->status == SKV_OK && !r1->final) {
        n_streamed += (int)r1->decode->n_tokens;
        snapkv__reply__free_unpacked(r1, NULL);
        r1 = next_reply(f, 0, ID_X, 5);
    }
    assert_int_equal(r1->status, SKV_OK);
    assert_string_equal(r1->decode->finish_reason, "limit");
    assert_int_equal(r1->decode->n_generated, 8);
    assert_int_equal(n_streamed + (int)r1->decode->n_tokens, 8);
    snapkv__reply__free_unpacked(r1, NULL);
    /* the first token refused: nothing went in, an error as before */
    rep = call(f, 0, ID_X, &req);
    assert_int_equal(rep->status, SKV_E_LIMIT);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(listed(f, s3, NULL, NULL), 16);
}

/* A DECODE's stop token or logit-bias token outside the vocabulary: INVAL naming the id as sent
 * (a stop token was taken before and could never match; a bias id above INT32_MAX was named as
 * 2147483647). The session is as it was. */
static void test_decode_ids_outside_vocab(void **state)
{
    struct fixture *f = *state;
    uint8_t sid[16];
    prefill(f, 8, "policy=full", sid);
    uint32_t stop[2] = {1, (uint32_t)f->tiny->m->cfg.n_vocab};
    Snapkv__Sampling sm = SNAPKV__SAMPLING__INIT;
    sm.max_tokens = 2;
    sm.stop_tokens = stop;
    sm.n_stop_tokens = 2;
    Snapkv__DecodeRequest d = SNAPKV__DECODE_REQUEST__INIT;
    d.session_id = (ProtobufCBinaryData){16, sid};
    d.sampling = &sm;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_DECODE;
    req.decode = &d;
    Snapkv__Reply *rep = call(f, 0, ID_X, &req);
    char want[96];
    snprintf(want, sizeof want, "stop token %d at index 1 is outside the vocabulary", f->tiny->m->cfg.n_vocab);
    assert_int_equal(rep->status, SKV_E_INVAL);
    assert_non_null(strstr(rep->message, want));
    snapkv__reply__free_unpacked(rep, NULL);
    sm.n_stop_tokens = 0;
    Snapkv__LogitBias b = SNAPKV__LOGIT_BIAS__INIT, *bl[1] = {&b};
    b.token = UINT32_MAX;
    b.bias = 1.0f;
    sm.logit_bias = bl;
    sm.n_logit_bias = 1;
    rep = call(f, 0, ID_X, &req);
    assert_int_equal(rep->status, SKV_E_INVAL);
    assert_non_null(strstr(rep->message, "logit_bias token 4294967295 is outside the vocabulary"));
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(listed(f, sid, NULL, NULL), 8);
}

/* ---- shared-memory buffers ------------------------------------------------------------------- */

/* EXPORT_KV of sid into the shared-memory object `name`, from a client of user uid (-1: a
 * tcp:// client, whose user the daemon does not know). */
static Snapkv__Reply *export_shm_as(struct fixture *f, const uint8_t sid[16], const char *name, long uid)
{
    Snapkv__BufferRef buf = SNAPKV__BUFFER_REF__INIT;
    buf.kind_case = SNAPKV__BUFFER_REF__KIND_SHM_NAME;
    buf.shm_name = (char *)name;
    Snapkv__ExportKvRequest e = SNAPKV__EXPORT_KV_REQUEST__INIT;
    e.session_id = (ProtobufCBinaryData){16, (uint8_t *)sid};
    e.buffer = &buf;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_EXPORT_KV;
    req.export_kv = &e;
    struct skv_job *job = job_new(0, ID_X, 5, &req);
    job->uid = uid;
    assert_int_equal(skv_worker_submit(f->w, job), SKV_OK);
    return next_reply(f, 0, ID_X, 5);
}

static Snapkv__Reply *export_shm(struct fixture *f, const uint8_t sid[16], const char *name)
{
    return export_shm_as(f, sid, name, (long)geteuid());
}

struct shrinker {
    int fd;
    off_t size;
    atomic_int stop;
};

static void *shrink_loop(void *arg)
{
    struct shrinker *k = arg;
    while (!atomic_load(&k->stop)) {
        if (ftruncate(k->fd, 0) != 0 || posix_fallocate(k->fd, 0, k->size) != 0)
            break;
    }
    return NULL;
}

static void expect_refused(struct fixture *f, Snapkv__Request *req, int want, const char *msg);

/* An IMPORT_KV of what the EXPORT_KV reply ex wrote into the shared-memory object `name`. */
static void import_request(const Snapkv__Reply *ex, char *name, Snapkv__BufferRef *buf, Snapkv__ImportKvRequest *im,
                           Snapkv__Request *req)
{
    *buf = (Snapkv__BufferRef)SNAPKV__BUFFER_REF__INIT;
    buf->kind_case = SNAPKV__BUFFER_REF__KIND_SHM_NAME;
    buf->shm_name = name;
    *im = (Snapkv__ImportKvRequest)SNAPKV__IMPORT_KV_REQUEST__INIT;
    im->buffer = buf;
    im->n_kept = ex->export_kv->n_kept;
    im->kept = ex->export_kv->kept;
    im->n_positions = ex->export_kv->n_positions;
    im->positions = ex->export_kv->positions;
    im->original_length = ex->export_kv->original_length;
    *req = (Snapkv__Request)SNAPKV__REQUEST__INIT;
    req->command_case = SNAPKV__REQUEST__COMMAND_IMPORT_KV;
    req->import_kv = im;
}

static void expect_refused(struct fixture *f, Snapkv__Request *req, int want, const char *msg);

/* An IMPORT_KV whose rows hold a NaN or an infinity is refused (INVAL, naming where), as LOAD,
 * the store and persist refuse them: before, it was taken, every attention over the head read
 * the NaN, and the session could then not be saved and loaded again, nor come back from the
 * store (FORMAT: lost). The same layout with finite rows is taken. */
static void test_import_not_finite(void **state)
{
    struct fixture *f = *state;
    restart_with_pool(f, 2); /* full with an idle session and a: the import needs one gone */
    uint8_t idle[16], a[16];
    prefill_for(f, "t2", 16, "policy=full", idle);
    usleep(5000); /* the idle one the least recently used */
    prefill(f, 8, "policy=full", a);
    char name[64];
    snprintf(name, sizeof name, "/snapkv-test-nan-%ld", (long)getpid());
    shm_unlink(name);
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    assert_true(fd >= 0);
    assert_int_equal(posix_fallocate(fd, 0, 1 << 20), 0);
    Snapkv__Reply *ex = export_shm(f, a, name);
    if (ex->status)
        fail_msg("EXPORT_KV: %d %s", ex->status, ex->message);
    Snapkv__BufferRef buf;
    Snapkv__ImportKvRequest im;
    Snapkv__Request req;
    import_request(ex, name, &buf, &im, &req);
    float good, odd[2] = {NAN, INFINITY};
    assert_int_equal(pread(fd, &good, sizeof good, 0), (ssize_t)sizeof good);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(pwrite(fd, &odd[k], sizeof odd[k], 0), (ssize_t)sizeof odd[k]);
        Snapkv__Reply *rep = call(f, 0, ID_X, &req);
        assert_int_equal(rep->status, SKV_E_INVAL);
        assert_non_null(strstr(rep->message, "IMPORT_KV: a key of layer 0, KV head 0 is not finite"));
        snapkv__reply__free_unpacked(rep, NULL);
        /* refused before its room was made: the idle session was not evicted for it */
        assert_int_equal(listed(f, idle, NULL, NULL), 16);
    }
    assert_int_equal(pwrite(fd, &good, sizeof good, 0), (ssize_t)sizeof good);
    /* a length past max-prompt-tokens + max-new-tokens: LIMIT naming them (INVAL before) */
    uint32_t length = im.original_length;
    im.original_length = (uint32_t)(f->cfg.max_prompt_tokens + f->cfg.max_new_tokens + 1);
    expect_refused(f, &req, SKV_E_LIMIT, "max-prompt-tokens + max-new-tokens"); /* on the socket thread */
    im.original_length = length;
    /* no rows at all: a session that would hold no block, refused (taken before) */
    uint32_t kept0[64], kept_l[64];
    size_t n_pos = im.n_positions;
    assert_true(im.kept[0]->n_kept_per_head <= 64 && im.n_kept <= 64);
    memcpy(kept0, im.kept[0]->kept_per_head, im.kept[0]->n_kept_per_head * sizeof *kept0);
    for (size_t l = 0; l < im.n_kept; l++) {
        kept_l[l] = im.kept[l]->kept;
        for (size_t h = 0; h < im.kept[l]->n_kept_per_head; h++)
            im.kept[l]->kept_per_head[h] = 0;
        im.kept[l]->kept = 0;
    }
    im.n_positions = 0;
    expect_refused(f, &req, SKV_E_INVAL, "keeps no rows");
    for (size_t l = 0; l < im.n_kept; l++) { /* every layer kept the same 8 rows a head */
        memcpy(im.kept[l]->kept_per_head, kept0, im.kept[l]->n_kept_per_head * sizeof *kept0);
        im.kept[l]->kept = kept_l[l];
    }
    im.n_positions = n_pos;
    Snapkv__Reply *rep = call(f, 0, ID_X, &req);
    assert_int_equal(rep->status, SKV_OK);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(listed(f, idle, NULL, NULL), -1); /* evicted for the import that was taken */
    snapkv__reply__free_unpacked(ex, NULL);
    close(fd);
    shm_unlink(name);
}

/* A CUDA IPC handle from a tcp:// client (its user unknown) is refused before the handle is
 * opened, as a shared-memory name is: a handle learnt elsewhere would name another client's
 * device memory. */
static void test_ipc_handle_tcp_refused(void **state)
{
    struct fixture *f = *state;
    uint8_t sid[16];
    prefill(f, 8, "policy=full", sid);
    uint8_t handle[64] = {2};
    Snapkv__BufferRef buf = SNAPKV__BUFFER_REF__INIT;
    buf.kind_case = SNAPKV__BUFFER_REF__KIND_CUDA_IPC_HANDLE;
    buf.cuda_ipc_handle = (ProtobufCBinaryData){sizeof handle, handle};
    buf.size = FAKE_BYTES;
    Snapkv__ExportKvRequest e = SNAPKV__EXPORT_KV_REQUEST__INIT;
    e.session_id = (ProtobufCBinaryData){16, sid};
    e.buffer = &buf;
    e.layer_count = 1;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_EXPORT_KV;
    req.export_kv = &e;
    int before = opened(2);
    struct skv_job *job = job_new(0, ID_X, 5, &req);
    job->uid = -1; /* a tcp:// client */
    assert_int_equal(skv_worker_submit(f->w, job), SKV_OK);
    Snapkv__Reply *rep = next_reply(f, 0, ID_X, 5);
    assert_int_equal(rep->status, SKV_E_PERM);
    assert_non_null(strstr(rep->message, "only over an ipc:// endpoint"));
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(opened(2), before);
}

/* A FORK whose charge passes the tenant's quota does not evict its own source (the fork's
 * blocks are the source's: nothing would be freed, and the client's next use of the source
 * would find it gone): LIMIT, the source stays. */
static void test_fork_keeps_source(void **state)
{
    struct fixture *f = *state;
    restart_with_quota(f, 4);
    uint8_t src[16];
    prefill(f, 48, "policy=full", src); /* 3 blocks a head; a fork counts 3 more */
    submit_fork(f, ID_X, src);
    Snapkv__Reply *rep = next_reply(f, 0, ID_X, 5);
    assert_int_equal(rep->status, SKV_E_LIMIT);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(listed(f, src, NULL, NULL), 48);
}

/* An IMPORT_KV that cannot fit the tenant's quota is refused before a row is written (its
 * blocks are counted first), and the tenant's sessions stay; one that fits once the idle one
 * goes evicts it. */
static void test_import_over_quota(void **state)
{
    struct fixture *f = *state;
    restart_with_quota(f, 3); /* 48 rows per head */
    uint8_t a[16], b[16];
    prefill(f, 40, "policy=full", a); /* 3 blocks per head */
    char name[64];
    snprintf(name, sizeof name, "/snapkv-test-import-%ld", (long)getpid());
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    assert_true(fd >= 0);
    assert_int_equal(posix_fallocate(fd, 0, 1 << 20), 0);
    Snapkv__Reply *ex = export_shm(f, a, name);
    if (ex->status)
        fail_msg("EXPORT_KV: %d %s", ex->status, ex->message);
    prefill(f, 8, "policy=full", b); /* a and b: 4 blocks per head, a evicted for b */
    int count = 0;
    assert_int_equal(listed(f, a, NULL, &count), -1);
    assert_int_equal(listed(f, b, NULL, &count), 8);
    Snapkv__BufferRef buf;
    Snapkv__ImportKvRequest im;
    Snapkv__Request req;
    import_request(ex, name, &buf, &im, &req);
    /* positions out of order in the last head, a kept entry naming another layer or a kept
     * count not its longest head's: refused before room is made (at submit), so b stays (the
     * positions were checked after the eviction before) */
    size_t np = im.n_positions;
    uint32_t *bad = malloc(np * sizeof *bad);
    assert_non_null(bad);
    memcpy(bad, im.positions, np * sizeof *bad);
    uint32_t t = bad[np - 1];
    bad[np - 1] = bad[np - 2];
    bad[np - 2] = t;
    im.positions = bad;
    expect_refused(f, &req, SKV_E_INVAL, "positions must increase");
    im.positions = ex->export_kv->positions;
    free(bad);
    im.kept[1]->layer = 0;
    expect_refused(f, &req, SKV_E_INVAL, "in order");
    im.kept[1]->layer = 1;
    im.kept[0]->kept += 1;
    expect_refused(f, &req, SKV_E_INVAL, "longest head");
    im.kept[0]->kept -= 1;
    assert_int_equal(listed(f, b, NULL, &count), 8);
    /* 3 blocks per head and b's 1 fit 3 only without b: b is idle, so it goes */
    Snapkv__Reply *rep = call(f, 0, ID_X, &req);
    assert_int_equal(rep->status, SKV_OK);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(listed(f, b, NULL, &count), -1);
    assert_int_equal(count, 1);
    /* with 2 blocks per head, the import cannot fit whatever goes: refused, nothing evicted
     * (its rows alone pass the quota: at submit, before the layout is read) */
    restart_with_quota(f, 2);
    prefill(f, 8, "policy=full", b);
    expect_refused(f, &req, SKV_E_LIMIT, "max-bytes-per-tenant");
    assert_int_equal(listed(f, b, NULL, &count), 8);
    assert_int_equal(count, 1);
    snapkv__reply__free_unpacked(ex, NULL);
    close(fd);
    shm_unlink(name);
}

static void test_shm_buffers(void **state)
{
    struct fixture *f = *state;
    uint8_t sid[16];
    prefill(f, 40, "policy=full", sid);
    /* names outside /snapkv-* are refused before anything is opened */
    char other[64];
    snprintf(other, sizeof other, "/skvtest-%ld", (long)getpid());
    int ofd = shm_open(other, O_RDWR | O_CREAT | O_EXCL, 0600);
    assert_true(ofd >= 0);
    assert_int_equal(posix_fallocate(ofd, 0, 1 << 20), 0);
    Snapkv__Reply *rep = export_shm(f, sid, other);
    assert_int_equal(rep->status, SKV_E_INVAL);
    assert_non_null(strstr(rep->message, "/snapkv-"));
    snapkv__reply__free_unpacked(rep, NULL);
    char probe[4096];
    assert_int_equal(pread(ofd, probe, sizeof probe, 0), (ssize_t)sizeof probe);
    static const char zero[4096];
    assert_memory_equal(probe, zero, sizeof zero); /* untouched */
    close(ofd);
    shm_unlink(other);

    /* another user's object (every object's name is listed in /dev/shm) is refused, and so is
     * any from a tcp:// client, whose user is not known: the daemon, which can open them all,
     * would write one client's cache into another's buffer (or read it into a session by
     * IMPORT_KV) */
    char mine[64];
    snprintf(mine, sizeof mine, "/snapkv-test-owner-%ld", (long)getpid());
    ofd = shm_open(mine, O_RDWR | O_CREAT | O_EXCL, 0600);
    assert_true(ofd >= 0);
    assert_int_equal(posix_fallocate(ofd, 0, 1 << 20), 0);
    rep = export_shm_as(f, sid, mine, (long)geteuid() + 1);
    assert_int_equal(rep->status, SKV_E_PERM);
    assert_non_null(strstr(rep->message, "a client may name only its own buffers"));
    snapkv__reply__free_unpacked(rep, NULL);
    rep = export_shm_as(f, sid, mine, -1);
    assert_int_equal(rep->status, SKV_E_PERM);
    assert_non_null(strstr(rep->message, "only over an ipc:// endpoint"));
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(pread(ofd, probe, sizeof probe, 0), (ssize_t)sizeof probe);
    assert_memory_equal(probe, zero, sizeof zero); /* untouched */
    rep = export_shm_as(f, sid, mine, (long)geteuid()); /* its owner's: written */
    assert_int_equal(rep->status, SKV_OK);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(pread(ofd, probe, sizeof probe, 0), (ssize_t)sizeof probe);
    assert_memory_not_equal(probe, zero, sizeof zero);
    close(ofd);
    shm_unlink(mine);

    /* a sparse object (ftruncate alone): the pages the EXPORT would write are not the client's
     * yet, and would be allocated on the daemon's memory: refused, nothing allocated */
    ofd = shm_open(mine, O_RDWR | O_CREAT | O_EXCL, 0600);
    assert_true(ofd >= 0);
    assert_int_equal(ftruncate(ofd, 1 << 20), 0);
    rep = export_shm(f, sid, mine);
    assert_int_equal(rep->status, SKV_E_INVAL);
    assert_non_null(strstr(rep->message, "has 0 of its 1048576 bytes allocated"));
    assert_non_null(strstr(rep->message, "posix_fallocate"));
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(lseek(ofd, 0, SEEK_DATA), -1); /* no page allocated */
    assert_int_equal(posix_fallocate(ofd, 0, 4096), 0); /* the first page only: refused */
    rep = export_shm(f, sid, mine);
    assert_int_equal(rep->status, SKV_E_INVAL);
    assert_non_null(strstr(rep->message, "has 4096 of its 1048576 bytes allocated"));
    snapkv__reply__free_unpacked(rep, NULL);
    close(ofd);
    shm_unlink(mine);

    /* pages allocated past the object's end (fallocate FALLOC_FL_KEEP_SIZE) count in its blocks
     * as the range's would: the object looks whole, its range is holes. The writes that allocated
     * them are undone (the range punched out again) and the EXPORT refused. Before, it was done:
     * 1 MiB more of the daemon's memory for each such object left behind */
    ofd = shm_open(mine, O_RDWR | O_CREAT | O_EXCL, 0600);
    assert_true(ofd >= 0);
    assert_int_equal(ftruncate(ofd, 1 << 20), 0);
    assert_int_equal(fallocate(ofd, FALLOC_FL_KEEP_SIZE, 1 << 20, 1 << 20), 0);
    assert_int_equal(lseek(ofd, 0, SEEK_DATA), -1); /* the range: holes */
    rep = export_shm(f, sid, mine);
    if (rep->status != SKV_E_INVAL || !strstr(rep->message, "were not allocated"))
        fail_msg("EXPORT_KV into holes: %d '%s'", rep->status, rep->message);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(lseek(ofd, 0, SEEK_DATA), -1); /* the pages written: given back */
    close(ofd);
    shm_unlink(mine);

    /* a buffer the client keeps shrinking and growing: each export answers, ok or an error */
    char name[64];
    snprintf(name, sizeof name, "/snapkv-test-worker-%ld", (long)getpid());
    struct shrinker k = {.size = 1 << 20};
    k.fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    assert_true(k.fd >= 0);
    assert_int_equal(posix_fallocate(k.fd, 0, k.size), 0);
    rep = export_shm(f, sid, name);
    if (rep->status)
        fail_msg("EXPORT_KV: %d %s", rep->status, rep->message);
    snapkv__reply__free_unpacked(rep, NULL);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, shrink_loop, &k), 0);
    int ok = 0, refused = 0;
    for (int i = 0; i < 200; i++) {
        rep = export_shm(f, sid, name);
        if (rep->status == SKV_OK)
            ok++;
        else if (rep->status == SKV_E_LIMIT || rep->status == SKV_E_IO || rep->status == SKV_E_INVAL)
            refused++; /* (INVAL: truncated and not yet allocated again when it looked) */
        else
            fail_msg("EXPORT_KV: unexpected %d %s", rep->status, rep->message);
        snapkv__reply__free_unpacked(rep, NULL);
    }
    atomic_store(&k.stop, 1);
    pthread_join(th, NULL);
    assert_int_equal(ok + refused, 200);
    close(k.fd);
    shm_unlink(name);
}

/* Holds the worker in a device call (an EXPORT_KV of session sid into fake buffer 5, from
 * client id) until the stuck call is released: what is submitted meanwhile queues, and then
 * runs one request per turn of the worker's loop, each turn followed by one decode round. */
static void freeze_as(struct fixture *f, const uint8_t *id, const uint8_t sid[16])
{
    pthread_mutex_lock(&g_stuck_mu);
    g_stuck_k = 5;
    pthread_mutex_unlock(&g_stuck_mu);
    submit_export(f, 0, id, sid, 5);
    pthread_mutex_lock(&g_stuck_mu);
    while (!g_stuck)
        pthread_cond_wait(&g_stuck_cv, &g_stuck_mu);
    pthread_mutex_unlock(&g_stuck_mu);
}

static void freeze(struct fixture *f, const uint8_t sid[16])
{
    freeze_as(f, ID_F, sid);
}

/* ---- admission: limits checked before queueing ------------------------------------------------ */

static void job_drop(struct skv_job *job)
{
    snapkv__request__free_unpacked(job->req, NULL);
    free(job);
}

/* Wedges the worker in a fake ipc_open (an EXPORT_KV of session sid into buffer 5), so whatever
 * is submitted next stays queued until unstick(). */
static void stick(struct fixture *f, const uint8_t sid[16])
{
    freeze_as(f, ID_X, sid);
}

static void unstick(void)
{
    pthread_mutex_lock(&g_stuck_mu);
    g_stuck_k = 0;
    pthread_cond_broadcast(&g_stuck_cv);
    pthread_mutex_unlock(&g_stuck_mu);
}

static Snapkv__Request prefill_req(Snapkv__PrefillRequest *p, uint32_t *tokens, size_t n)
{
    snapkv__prefill_request__init(p);
    p->tokens = tokens;
    p->n_tokens = n;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_PREFILL;
    req.prefill = p;
    return req;
}

/* Submits req; expects it refused with status `want` and a message containing `msg`. */
static void expect_refused(struct fixture *f, Snapkv__Request *req, int want, const char *msg)
{
    struct skv_job *job = job_new(0, ID_Y, 5, req);
    int rc = skv_worker_submit(f->w, job);
    if (rc != want || !strstr(skv_error_msg(), msg))
        fail_msg("submit: %d '%s', want %d '%s'", rc, skv_error_msg(), want, msg);
    job_drop(job);
}

static void expect_reply(struct fixture *f, int want, const char *msg)
{
    Snapkv__Reply *rep = next_reply(f, 0, ID_Y, 5);
    if (rep->status != want || (msg && !strstr(rep->message, msg)))
        fail_msg("reply: %d '%s', want %d '%s'", rep->status, rep->message, want, msg ? msg : "");
    snapkv__reply__free_unpacked(rep, NULL);
}

static void test_admit(void **state)
{
    struct fixture *f = *state;
    skv_worker_stop(&f->w);
    f->cfg.max_prompt_tokens = 32;
    f->cfg.max_new_tokens = 16;
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    uint8_t sid[16];
    prefill(f, 8, "policy=full", sid);
    stick(f, sid);
    uint32_t tokens[64];
    fixed_ids(f, tokens, 64);

    /* refused at submit while the worker is busy: nothing of these waits in the queue */
    Snapkv__PrefillRequest p;
    Snapkv__Request req = prefill_req(&p, tokens, 33);
    expect_refused(f, &req, SKV_E_LIMIT, "33 tokens: more than the limit of 32");
    p.text = "some text";
    expect_refused(f, &req, SKV_E_INVAL, "give tokens or text, not both");
    p.n_tokens = 0;
    expect_refused(f, &req, SKV_E_UNSUPPORTED, "no tokenizer"); /* the tiny model has none */
    p.text = "";
    char spec[1100];
    memset(spec, 'x', sizeof spec - 1);
    spec[sizeof spec - 1] = '\0';
    Snapkv__CompressSpec cs = SNAPKV__COMPRESS_SPEC__INIT;
    cs.spec = spec;
    p.compress = &cs;
    p.n_tokens = 8;
    expect_refused(f, &req, SKV_E_INVAL, "longer than 1024 characters");
    /* a COMPRESS without a spec (it read as policy=full, and the session stopped evicting) */
    Snapkv__CompressRequest cr = SNAPKV__COMPRESS_REQUEST__INIT;
    cr.session_id = (ProtobufCBinaryData){16, sid};
    Snapkv__Request creq = SNAPKV__REQUEST__INIT;
    creq.command_case = SNAPKV__REQUEST__COMMAND_COMPRESS;
    creq.compress = &cr;
    expect_refused(f, &creq, SKV_E_INVAL, "needs a spec");
    Snapkv__CompressSpec empty = SNAPKV__COMPRESS_SPEC__INIT;
    empty.spec = "";
    cr.compress = &empty;
    expect_refused(f, &creq, SKV_E_INVAL, "needs a spec");

    Snapkv__AppendRequest a = SNAPKV__APPEND_REQUEST__INIT;
    a.session_id = (ProtobufCBinaryData){16, sid};
    a.tokens = tokens;
    a.n_tokens = 49; /* max-prompt-tokens + max-new-tokens = 48 */
    Snapkv__Request areq = SNAPKV__REQUEST__INIT;
    areq.command_case = SNAPKV__REQUEST__COMMAND_APPEND;
    areq.append = &a;
    expect_refused(f, &areq, SKV_E_LIMIT, "49 tokens: more than the limit of 48");

    uint32_t stops[65] = {0};
    Snapkv__Sampling sp = SNAPKV__SAMPLING__INIT;
    sp.stop_tokens = stops;
    sp.n_stop_tokens = 65;
    Snapkv__DecodeRequest d = SNAPKV__DECODE_REQUEST__INIT;
    d.session_id = (ProtobufCBinaryData){16, sid};
    d.sampling = &sp;
    Snapkv__Request dreq = SNAPKV__REQUEST__INIT;
    dreq.command_case = SNAPKV__REQUEST__COMMAND_DECODE;
    dreq.decode = &d;
    expect_refused(f, &dreq, SKV_E_LIMIT, "at most 64 stop tokens");
    sp.n_stop_tokens = 1;
    sp.max_tokens = 17;
    expect_refused(f, &dreq, SKV_E_LIMIT, "max_tokens 17 is above the limit of 16");

    Snapkv__LayerKept k0 = SNAPKV__LAYER_KEPT__INIT, *kept[1] = {&k0};
    uint32_t *positions = calloc(1 << 20, sizeof *positions);
    Snapkv__ImportKvRequest im = SNAPKV__IMPORT_KV_REQUEST__INIT;
    im.kept = kept;
    im.n_kept = 1;
    im.positions = positions;
    im.n_positions = 1 << 20;
    im.original_length = 8;
    Snapkv__Request ireq = SNAPKV__REQUEST__INIT;
    ireq.command_case = SNAPKV__REQUEST__COMMAND_IMPORT_KV;
    ireq.import_kv = &im;
    char want[96];
    snprintf(want, sizeof want, "kept lists 1 layers; the model has %d", f->tiny->m->cfg.n_layers);
    expect_refused(f, &ireq, SKV_E_INVAL, want);
    free(positions);

    struct skv_worker_stats st;
    skv_worker_stats(f->w, &st);
    assert_int_equal(st.queue_depth, 0);
    assert_int_equal(st.queue_bytes, 0);

    /* at the limits they are queued; the APPEND then meets the session's own room (48 - 8) */
    p.compress = NULL;
    p.n_tokens = 32;
    assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_Y, 5, &req)), SKV_OK);
    a.n_tokens = 48;
    assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_Y, 5, &areq)), SKV_OK);
    skv_worker_stats(f->w, &st);
    assert_int_equal(st.queue_depth, 2);
    assert_true(st.queue_bytes > 80 * sizeof(uint32_t));
    unstick();
    expect_exported(f, 0, ID_X);
    expect_reply(f, SKV_OK, NULL);
    expect_reply(f, SKV_E_LIMIT, "48 tokens: more than the limit of 40");
}

/* The bytes a queued job of req holds (what max-queued-bytes counts). */
static size_t queued_size(int sock, Snapkv__Request *req)
{
    struct skv_job *probe = job_new(sock, ID_Y, 5, req);
    size_t n = sizeof *probe + skv_request_bytes(probe->req);
    job_drop(probe);
    return n;
}

static void test_queued_bytes(void **state)
{
    struct fixture *f = *state;
    uint32_t tokens[64];
    fixed_ids(f, tokens, 64);
    Snapkv__PrefillRequest p;
    Snapkv__Request req = prefill_req(&p, tokens, 40);
    /* what a queued job holds: at least its ids unpacked, 4 bytes each however small their varints */
    size_t one = queued_size(0, &req);
    assert_true(one >= sizeof(struct skv_job) + sizeof(Snapkv__Request) + sizeof p + 40 * sizeof(uint32_t));
    uint32_t *many = calloc(100000, sizeof *many); /* token 0: one byte each packed */
    Snapkv__PrefillRequest pm;
    Snapkv__Request big = prefill_req(&pm, many, 100000);
    struct skv_job *probe = job_new(0, ID_Y, 5, &big);
    assert_true(snapkv__request__get_packed_size(probe->req) < 100100);
    assert_true(skv_request_bytes(probe->req) >= 400000);
    job_drop(probe);
    free(many);

    /* a STATS request too (from the admin endpoint), queued first below */
    Snapkv__StatsRequest sr = SNAPKV__STATS_REQUEST__INIT;
    Snapkv__Request sreq = SNAPKV__REQUEST__INIT;
    sreq.command_case = SNAPKV__REQUEST__COMMAND_STATS;
    sreq.stats = &sr;
    static const uint8_t admin[5] = {0, 1, 2, 3, 4};
    size_t s_one = queued_size(1, &sreq);

    skv_worker_stop(&f->w);
    f->cfg.max_queued_bytes = (int64_t)(3 * one + s_one + one / 2);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    uint8_t sid[16];
    prefill(f, 8, "policy=full", sid);
    stick(f, sid);
    /* the STATS first: when it runs, the three behind it still wait */
    assert_int_equal(skv_worker_submit(f->w, job_new(1, admin, 5, &sreq)), SKV_OK);
    for (int i = 0; i < 3; i++)
        assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_Y, 5, &req)), SKV_OK);
    struct skv_worker_stats st;
    skv_worker_stats(f->w, &st);
    assert_int_equal(st.queue_depth, 4);
    assert_int_equal(st.queue_bytes, 3 * one + s_one);
    char want[128];
    snprintf(want, sizeof want, "the request queue holds %zu bytes in 4 requests; this one's %zu", 3 * one + s_one,
             one);
    expect_refused(f, &req, SKV_E_BUSY, want);
    /* one request larger than the whole bound can never wait: a limit, not busy */
    uint32_t more[64 * 40];
    for (size_t i = 0; i < sizeof more / sizeof *more; i++)
        more[i] = tokens[i % 64];
    Snapkv__PrefillRequest pl;
    Snapkv__Request large = prefill_req(&pl, more, sizeof more / sizeof *more);
    expect_refused(f, &large, SKV_E_LIMIT, "more than max-queued-bytes");
    unstick();
    expect_exported(f, 0, ID_X);
    Snapkv__Reply *rep = next_reply(f, 1, admin, 5);
    assert_int_equal(rep->status, SKV_OK);
    double queued = -1, held = -1;
    for (size_t i = 0; i < rep->stats->n_stats; i++) {
        if (strcmp(rep->stats->stats[i]->name, "snapkv_queue_requests") == 0)
            queued = rep->stats->stats[i]->value;
        if (strcmp(rep->stats->stats[i]->name, "snapkv_queue_bytes") == 0)
            held = rep->stats->stats[i]->value;
    }
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(queued, 3);
    assert_int_equal(held, 3 * one);
    for (int i = 0; i < 3; i++)
        expect_reply(f, SKV_OK, NULL);
    skv_worker_stats(f->w, &st);
    assert_int_equal(st.queue_depth, 0);
    assert_int_equal(st.queue_bytes, 0);
    /* drained: room again */
    assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_Y, 5, &req)), SKV_OK);
    expect_reply(f, SKV_OK, NULL);
}

/* One tenant's share of the queue: past queue-depth-per-tenant requests, or
 * max-queued-bytes-per-tenant bytes, waiting, its next is BUSY while another tenant's and the
 * admin endpoint's are still queued; once they run, the tenant has room again. */
static void test_tenant_queue_share(void **state)
{
    struct fixture *f = *state;
    uint32_t tokens[64];
    fixed_ids(f, tokens, 64);
    Snapkv__PrefillRequest p;
    Snapkv__Request req = prefill_req(&p, tokens, 8);
    size_t one = queued_size(0, &req);
    skv_worker_stop(&f->w);
    f->cfg.queue_depth_per_tenant = 3;
    assert_int_equal(skv_config_set(&f->cfg, "queue-order", "fifo"), SKV_OK); /* replies in queue order */
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    uint8_t sid[16];
    prefill(f, 8, "policy=full", sid);
    stick(f, sid); /* X's EXPORT for tenant "t" runs, so it is not waiting */
    for (int i = 0; i < 3; i++)
        assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_Y, 5, &req)), SKV_OK); /* tenant "t" */
    expect_refused(f, &req, SKV_E_BUSY, "tenant 't' already has 3 requests waiting (queue-depth-per-tenant)");
    req.tenant = "u";
    assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_Z, 5, &req)), SKV_OK);
    static const uint8_t admin[5] = {0, 1, 2, 3, 4};
    submit_admin_stats(f, "t"); /* not the tenant's */
    unstick();
    expect_exported(f, 0, ID_X);
    for (int i = 0; i < 3; i++)
        expect_reply(f, SKV_OK, NULL);
    Snapkv__Reply *rep = next_reply(f, 0, ID_Z, 5);
    assert_int_equal(rep->status, SKV_OK);
    snapkv__reply__free_unpacked(rep, NULL);
    rep = next_reply(f, 1, admin, 5);
    assert_int_equal(rep->status, SKV_OK);
    snapkv__reply__free_unpacked(rep, NULL);
    req.tenant = "t";
    assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_Y, 5, &req)), SKV_OK); /* room again */
    expect_reply(f, SKV_OK, NULL);

    /* a name the worker would refuse is refused before it takes a place */
    req.tenant = "no spaces";
    expect_refused(f, &req, SKV_E_INVAL, "tenant 'no spaces': only letters, digits");
    req.tenant = "t";

    /* bytes: two requests' worth per tenant */
    skv_worker_stop(&f->w);
    f->cfg.queue_depth_per_tenant = 64;
    f->cfg.max_queued_bytes_per_tenant = (int64_t)(2 * one + one / 2);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    prefill(f, 8, "policy=full", sid);
    stick(f, sid);
    for (int i = 0; i < 2; i++)
        assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_Y, 5, &req)), SKV_OK);
    expect_refused(f, &req, SKV_E_BUSY, "would pass max-queued-bytes-per-tenant");
    unstick();
    expect_exported(f, 0, ID_X);
    for (int i = 0; i < 2; i++)
        expect_reply(f, SKV_OK, NULL);
}

/* ---- watchdog --------------------------------------------------------------------------------- */

static void test_watchdog(void **state)
{
    struct fixture *f = *state;
    /* the rule: idle, or a heartbeat younger than half the interval (60 s here) */
    assert_true(skv_watchdog_ok(100000, 100000, false, 60000));
    assert_true(skv_watchdog_ok(129999, 100000, false, 60000));
    assert_false(skv_watchdog_ok(130000, 100000, false, 60000));
    assert_true(skv_watchdog_ok(900000, 100000, true, 60000));
    assert_true(skv_watchdog_ok(99000, 100000, false, 60000)); /* beat after the caller's clock read */

    /* waiting for work: alive however long ago it beat (it beats about once a second then,
     * so 500 ms of answers within a 200 ms interval come from the idle rule) */
    for (int i = 0; i < 200 && !skv_worker_alive(f->w, 200); i++)
        usleep(10000);
    int n_alive = 0; /* (a sample may meet the worker descheduled in its once-a-second beat) */
    for (int i = 0; i < 25; i++) {
        n_alive += skv_worker_alive(f->w, 200);
        usleep(20000);
    }
    assert_true(n_alive >= 15); /* without the idle rule, about 2 of 25 (one stall may miss 6) */

    uint8_t sid[16];
    prefill(f, 8, "policy=full", sid);
    freeze_as(f, ID_X, sid);
    bool fresh = skv_worker_alive(f->w, 60000);
    usleep(100000);
    bool stuck = !skv_worker_alive(f->w, 100); /* stuck for 100 ms > 50 ms */
    bool long_interval = skv_worker_alive(f->w, 60000);
    pthread_mutex_lock(&g_stuck_mu); /* released before any assert: teardown joins the worker */
    g_stuck_k = 0;
    pthread_cond_broadcast(&g_stuck_cv);
    pthread_mutex_unlock(&g_stuck_mu);
    assert_true(fresh);
    assert_true(stuck);
    assert_true(long_interval);
    expect_exported(f, 0, ID_X);
    bool alive = false;
    for (int i = 0; i < 200 && !alive; i++) { /* the worker beats right after the reply */
        alive = skv_worker_alive(f->w, 100);
        if (!alive)
            usleep(10000);
    }
    assert_true(alive);
}

/* ---- leases and decodes ---------------------------------------------------------------------- */

static void test_lease_limit(void **state)
{
    struct fixture *f = *state;
    /* 136 years: refused before anything is made, the message names both numbers */
    Snapkv__Reply *rep = prefill_reply(f, NULL, 8, "policy=full", UINT32_MAX);
    assert_int_equal(rep->status, SKV_E_LIMIT);
    assert_non_null(strstr(rep->message, "4294967295"));
    assert_non_null(strstr(rep->message, "86400"));
    assert_non_null(strstr(rep->message, "max-lease-seconds"));
    snapkv__reply__free_unpacked(rep, NULL);
    rep = prefill_reply(f, NULL, 8, "policy=full", 86401);
    assert_int_equal(rep->status, SKV_E_LIMIT);
    snapkv__reply__free_unpacked(rep, NULL);
    uint8_t none[16] = {0};
    int count = -1;
    listed(f, none, NULL, &count);
    assert_int_equal(count, 0);
    /* max-lease-seconds itself is allowed; no lease asked for gets lease-seconds */
    uint8_t a[16], b[16];
    rep = prefill_reply(f, NULL, 8, "policy=full", 86400);
    if (rep->status)
        fail_msg("PREFILL: %d %s", rep->status, rep->message);
    memcpy(a, rep->prefill->session_id.data, 16);
    snapkv__reply__free_unpacked(rep, NULL);
    prefill(f, 8, "policy=full", b);
    uint32_t lease = 0;
    assert_int_equal(listed_lease(f, a, NULL, NULL, &lease), 8);
    assert_int_equal(lease, 86400);
    assert_int_equal(listed_lease(f, b, NULL, NULL, &lease), 8);
    assert_int_equal(lease, 600);
}


static void thaw(struct fixture *f)
{
    pthread_mutex_lock(&g_stuck_mu);
    g_stuck_k = 0;
    pthread_cond_broadcast(&g_stuck_cv);
    pthread_mutex_unlock(&g_stuck_mu);
    expect_exported(f, 0, ID_F);
}

/* Queues a greedy DECODE of max_tokens tokens of session sid by client id for tenant. */
static void submit_decode(struct fixture *f, const uint8_t *id, const char *tenant, const uint8_t sid[16],
                          uint32_t max_tokens, bool stream)
{
    Snapkv__Sampling sm = SNAPKV__SAMPLING__INIT;
    sm.max_tokens = max_tokens;
    Snapkv__DecodeRequest d = SNAPKV__DECODE_REQUEST__INIT;
    d.session_id = (ProtobufCBinaryData){16, (uint8_t *)sid};
    d.sampling = &sm;
    d.stream = stream;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_DECODE;
    req.decode = &d;
    req.tenant = (char *)tenant;
    assert_int_equal(skv_worker_submit(f->w, job_new(0, id, 5, &req)), SKV_OK);
}

/* Reads client id's replies up to the final one, which it returns; the tokens of every reply
 * (streamed, or the collected ones of the final) go to toks[*n], at most cap. */
static Snapkv__Reply *decode_final(struct fixture *f, const uint8_t *id, uint32_t *toks, int *n, int cap)
{
    *n = 0;
    for (;;) {
        Snapkv__Reply *rep = next_reply(f, 0, id, 5);
        if (rep->status == SKV_OK) {
            assert_int_equal(rep->result_case, SNAPKV__REPLY__RESULT_DECODE);
            for (size_t i = 0; i < rep->decode->n_tokens && *n < cap; i++)
                toks[(*n)++] = rep->decode->tokens[i];
        }
        if (rep->final)
            return rep;
        snapkv__reply__free_unpacked(rep, NULL);
    }
}

/* Two decodes in one group: B's (streaming) runs while A's first step (SnapKV re-scoring while
 * decoding) finds no memory for its query ring. A fails alone, before the group's forward; B
 * goes on to its 8 tokens (before, the ring was allocated in the forward's hook: the group
 * failed, and B ended part way). */
static void test_decode_group_alloc_fails_alone(void **state)
{
    struct fixture *f = *state;
    const struct skv_model_config *mc = &f->tiny->m->cfg;
    uint8_t a[16], b[16];
    prefill(f, 16, "policy=snapkv,budget=8,window=4,decode_budget=6,interval=2", a);
    prefill(f, 16, "policy=streaming,budget=12,sinks=2", b);
    /* A's ring: the newest min(window, decode_budget) = 4 queries of every layer */
    atomic_store(&g_fail_alloc_bytes, (size_t)mc->n_layers * 4 * mc->n_heads * mc->head_dim * sizeof(float));
    freeze(f, b);
    submit_decode(f, ID_X, "t", b, 8, false);
    submit_decode(f, ID_Y, "t", a, 8, false);
    thaw(f);
    uint32_t toks[16];
    int n = 0;
    Snapkv__Reply *rep = decode_final(f, ID_Y, toks, &n, 16);
    assert_int_equal(rep->status, SKV_E_NOMEM);
    assert_non_null(strstr(rep->message, "test: no device memory"));
    snapkv__reply__free_unpacked(rep, NULL);
    rep = decode_final(f, ID_X, toks, &n, 16);
    atomic_store(&g_fail_alloc_bytes, 0);
    if (rep->status)
        fail_msg("B's DECODE: %d %s", rep->status, rep->message);
    assert_string_equal(rep->decode->finish_reason, "length");
    assert_int_equal(n, 8);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(listed(f, a, NULL, NULL), 16); /* A as it was */
    assert_int_equal(listed(f, b, NULL, NULL), 24);
}

/* A DECODE past max-decodes-per-tenant or max-decodes running ones is refused at its start with
 * SKV_E_BUSY naming the limit; once one ends, the next is accepted. */
static void test_decode_limits(void **state)
{
    struct fixture *f = *state;
    skv_worker_stop(&f->w);
    f->cfg.max_decodes = 2;
    f->cfg.max_decodes_per_tenant = 1;
    assert_int_equal(skv_config_set(&f->cfg, "queue-order", "fifo"), SKV_OK); /* turns in queue order */
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    uint8_t t1[16], t2[16], u[16], v[16];
    prefill_for(f, "t", 8, "policy=full", t1);
    prefill_for(f, "t", 8, "policy=full", t2);
    prefill_for(f, "u", 8, "policy=full", u);
    prefill_for(f, "v", 8, "policy=full", v);
    /* queued together, they start one per turn: t's first and u's run while t's second and v's
     * come (16 tokens outlast the four turns) */
    freeze(f, t1);
    submit_decode(f, ID_X, "t", t1, 16, false);
    submit_decode(f, ID_Y, "t", t2, 16, false);
    submit_decode(f, ID_Z, "u", u, 16, false);
    submit_decode(f, ID_F, "v", v, 16, false);
    thaw(f);
    Snapkv__Reply *rep = next_reply(f, 0, ID_Y, 5);
    assert_int_equal(rep->status, SKV_E_BUSY);
    assert_non_null(strstr(rep->message, "max-decodes-per-tenant = 1"));
    snapkv__reply__free_unpacked(rep, NULL);
    rep = next_reply(f, 0, ID_F, 5);
    assert_int_equal(rep->status, SKV_E_BUSY);
    assert_non_null(strstr(rep->message, "max-decodes = 2"));
    snapkv__reply__free_unpacked(rep, NULL);
    uint32_t toks[16];
    int n = 0;
    const uint8_t *ids[2] = {ID_X, ID_Z};
    for (int i = 0; i < 2; i++) {
        rep = decode_final(f, ids[i], toks, &n, 16);
        if (rep->status)
            fail_msg("DECODE: %d %s", rep->status, rep->message);
        assert_string_equal(rep->decode->finish_reason, "length");
        assert_int_equal(n, 16);
        snapkv__reply__free_unpacked(rep, NULL);
    }
    assert_int_equal(listed(f, t2, NULL, NULL), 8); /* the refused ones never started */
    assert_int_equal(listed(f, v, NULL, NULL), 8);
    assert_int_equal(stat(f, "snapkv_decodes_running"), 0);
    /* nothing runs now: t's second and v's are accepted */
    submit_decode(f, ID_Y, "t", t2, 4, false);
    submit_decode(f, ID_F, "v", v, 4, false);
    const uint8_t *again[2] = {ID_Y, ID_F};
    for (int i = 0; i < 2; i++) {
        rep = decode_final(f, again[i], toks, &n, 16);
        if (rep->status)
            fail_msg("DECODE: %d %s", rep->status, rep->message);
        assert_int_equal(n, 4);
        snapkv__reply__free_unpacked(rep, NULL);
    }
}

/* A client-gone notice cancels the client's running decodes and no other client's; the
 * cancelled session keeps what was generated and decodes on as if never interrupted. */
static void test_decode_client_gone(void **state)
{
    struct fixture *f = *state;
    restart_fifo(f); /* the notice in its place in the queue (fair order: test_fair_order) */
    uint8_t a[16], b[16], ref[16];
    prefill(f, 8, "policy=full", a);
    prefill(f, 8, "policy=full", b);
    prefill(f, 8, "policy=full", ref);
    /* the reference: six tokens in one go */
    uint32_t want[6], got[8];
    int n_want = 0, n = 0;
    submit_decode(f, ID_Z, "t", ref, 6, false);
    Snapkv__Reply *rep = decode_final(f, ID_Z, want, &n_want, 6);
    assert_int_equal(rep->status, SKV_OK);
    assert_int_equal(n_want, 6);
    snapkv__reply__free_unpacked(rep, NULL);

    /* X's decode starts and takes a token, Y's starts and both take one, then X's notice */
    freeze(f, a);
    submit_decode(f, ID_X, "t", a, 1000, true);
    submit_decode(f, ID_Y, "t", b, 8, false);
    assert_int_equal(skv_worker_client_gone(f->w, ID_X, sizeof ID_X, true), SKV_OK);
    thaw(f);
    rep = decode_final(f, ID_X, got, &n, 8);
    assert_int_equal(rep->status, SKV_OK);
    assert_string_equal(rep->decode->finish_reason, "cancelled");
    assert_int_equal(rep->decode->n_generated, 2);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(n, 2);
    /* Y's runs to its end (read before STATS: its reply may come first) */
    uint32_t other[8];
    int n_other = 0;
    rep = decode_final(f, ID_Y, other, &n_other, 8);
    assert_int_equal(rep->status, SKV_OK);
    assert_string_equal(rep->decode->finish_reason, "length");
    assert_int_equal(n_other, 8);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(stat(f, "snapkv_decodes_cancelled_on_disconnect_total"), 1);

    /* the session stays, with the two tokens, and goes on with the reference's next four */
    assert_int_equal(listed(f, a, NULL, NULL), 10);
    submit_decode(f, ID_Y, "t", a, 4, false);
    int n_more = 0;
    rep = decode_final(f, ID_Y, got + 2, &n_more, 4);
    if (rep->status)
        fail_msg("DECODE: %d %s", rep->status, rep->message);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(n_more, 4);
    assert_memory_equal(got, want, sizeof want);
    assert_int_equal(listed(f, a, NULL, NULL), 14);
}

/* The next reply the worker pushed, to whichever client: its routing id goes to id[5]. */
static Snapkv__Reply *any_reply(struct fixture *f, uint8_t id[5])
{
    zmq_msg_t parts[3];
    for (int i = 0; i < 3; i++) {
        zmq_msg_init(&parts[i]);
        assert_true(zmq_msg_recv(&parts[i], f->pull, 0) >= 0);
    }
    assert_int_equal(zmq_msg_size(&parts[1]), 5);
    memcpy(id, zmq_msg_data(&parts[1]), 5);
    Snapkv__Reply *rep = snapkv__reply__unpack(NULL, zmq_msg_size(&parts[2]), zmq_msg_data(&parts[2]));
    assert_non_null(rep);
    for (int i = 0; i < 3; i++)
        zmq_msg_close(&parts[i]);
    return rep;
}

/* A PREFILL of the 64 fixed ids by client X with SnapKV, its logits returned (and progress
 * replies when asked), queued. */
static void submit_long_prefill(struct fixture *f, bool progress)
{
    uint32_t tokens[64];
    fixed_ids(f, tokens, 64);
    Snapkv__CompressSpec cs = SNAPKV__COMPRESS_SPEC__INIT;
    cs.spec = "policy=snapkv,budget=16,window=8";
    Snapkv__PrefillRequest p;
    Snapkv__Request req = prefill_req(&p, tokens, 64);
    p.compress = &cs;
    p.return_logits = true;
    p.progress = progress;
    assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_X, 5, &req)), SKV_OK);
}

/* Restarts the worker with decode-yield-ms = 0: a long forward yields at every tick. */
/* Restarts the worker with queue-order = fifo: tests of other things whose requests of several
 * tenants wait together and whose turns the comments count in queue order. */
static void restart_fifo(struct fixture *f)
{
    skv_worker_stop(&f->w);
    assert_int_equal(skv_config_set(&f->cfg, "queue-order", "fifo"), SKV_OK);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
}

static void restart_yielding_always(struct fixture *f)
{
    skv_worker_stop(&f->w);
    f->cfg.decode_yield_ms = 0;
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
}

/* A PREFILL of 64 tokens or more stops inside its layers to give running decodes their next
 * token (decode-yield-ms = 0: at every point: after a layer's projections, its attention and
 * its MLP), and both come out exactly as when each runs alone: the same tokens, the same
 * logits and kept rows. */
static void test_decode_yield(void **state)
{
    struct fixture *f = *state;
    restart_yielding_always(f);
    const int L = f->tiny->m->cfg.n_layers, n_vocab = f->tiny->m->cfg.n_vocab;
    enum { MORE = 6 };
    uint8_t a[16], ref[16];
    prefill(f, 8, "policy=full", a);
    prefill(f, 8, "policy=full", ref);
    /* each alone: the decode, then the prefill */
    uint32_t want[64], got[64];
    int n_want = 0, n_got = 0;
    const int N = 3 * L + MORE; /* the decode outlasts the prefill's 3 L rounds */
    assert_true(N <= 64);
    submit_decode(f, ID_Z, "t", ref, (uint32_t)N, false);
    Snapkv__Reply *rep = decode_final(f, ID_Z, want, &n_want, 64);
    assert_int_equal(rep->status, SKV_OK);
    assert_int_equal(n_want, N);
    snapkv__reply__free_unpacked(rep, NULL);
    submit_long_prefill(f, false);
    Snapkv__Reply *alone = next_reply(f, 0, ID_X, 5);
    if (alone->status)
        fail_msg("PREFILL: %d %s", alone->status, alone->message);
    assert_int_equal(alone->prefill->n_logits, n_vocab);
    assert_int_equal(stat(f, "snapkv_decode_rounds_in_forwards_total"), 0);

    /* together: Y's decode starts (one round), then X's prefill runs with the decode going on */
    freeze(f, a);
    submit_decode(f, ID_Y, "t", a, (uint32_t)N, true);
    submit_long_prefill(f, true);
    thaw(f);
    int progress = 0, during = 0;
    bool prefilled = false, decoded = false;
    Snapkv__Reply *together = NULL;
    while (!prefilled || !decoded) {
        uint8_t id[5];
        rep = any_reply(f, id);
        if (rep->status)
            fail_msg("reply: %d %s", rep->status, rep->message);
        if (memcmp(id, ID_X, 5) == 0) {
            assert_int_equal(rep->result_case, SNAPKV__REPLY__RESULT_PREFILL);
            if (rep->final) {
                prefilled = true;
                together = rep;
                continue;
            }
            progress++;
        } else {
            assert_memory_equal(id, ID_Y, 5);
            assert_int_equal(rep->result_case, SNAPKV__REPLY__RESULT_DECODE);
            for (size_t i = 0; i < rep->decode->n_tokens && n_got < 64; i++)
                got[n_got++] = rep->decode->tokens[i];
            during += progress > 0 && !prefilled;
            decoded = rep->final;
        }
        snapkv__reply__free_unpacked(rep, NULL);
    }
    /* a round after each layer's projections, its attention (and progress reply) and its MLP
     * (64 tokens: one chunk each); all but the first layer's first come after a progress reply */
    assert_int_equal(progress, L);
    assert_int_equal(during, 3 * L - 1);
    assert_int_equal(stat(f, "snapkv_decode_rounds_in_forwards_total"), 3 * L);
    assert_int_equal(n_got, N);
    assert_memory_equal(got, want, sizeof got[0] * (size_t)n_want);
    assert_int_equal(together->prefill->next_token, alone->prefill->next_token);
    assert_int_equal(together->prefill->n_logits, n_vocab);
    assert_memory_equal(together->prefill->logits, alone->prefill->logits, sizeof(float) * (size_t)n_vocab);
    assert_int_equal(together->prefill->bytes_after, alone->prefill->bytes_after);
    assert_int_equal(together->prefill->n_kept, alone->prefill->n_kept);
    for (size_t l = 0; l < alone->prefill->n_kept; l++) {
        const Snapkv__LayerKept *x = together->prefill->kept[l], *y = alone->prefill->kept[l];
        assert_int_equal(x->n_kept_per_head, y->n_kept_per_head);
        assert_memory_equal(x->kept_per_head, y->kept_per_head, sizeof(uint32_t) * y->n_kept_per_head);
    }
    snapkv__reply__free_unpacked(together, NULL);
    snapkv__reply__free_unpacked(alone, NULL);
}

/* CANCEL of sid by client id for tenant; own: only a decode of its own connection (libsnapkv's
 * after its DECODE failed); deadline_ms (0: none). */
static void submit_cancel_opts(struct fixture *f, int sock, const uint8_t *id, const char *tenant,
                               const uint8_t sid[16], bool own, uint32_t deadline_ms)
{
    Snapkv__CancelRequest c = SNAPKV__CANCEL_REQUEST__INIT;
    c.session_id = (ProtobufCBinaryData){16, (uint8_t *)sid};
    c.own = own;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_CANCEL;
    req.cancel = &c;
    req.tenant = (char *)tenant;
    req.deadline_ms = deadline_ms;
    assert_int_equal(skv_worker_submit(f->w, job_new(sock, id, 5, &req)), SKV_OK);
}

static void submit_cancel(struct fixture *f, int sock, const uint8_t *id, const char *tenant, const uint8_t sid[16])
{
    submit_cancel_opts(f, sock, id, tenant, sid, false, 0);
}

/* CANCEL ends the session's running decode between two rounds: its final reply ("cancelled",
 * with the tokens so far) comes first, then CANCEL's with how many it made; the session takes
 * the next DECODE at once and goes on as an uninterrupted decode would. Another tenant gets
 * NOT_FOUND, and a session with no decode running answers cancelled = false. */
static void test_cancel_decode(void **state)
{
    struct fixture *f = *state;
    uint8_t a[16], ref[16];
    prefill(f, 8, "policy=full", a);
    prefill(f, 8, "policy=full", ref);
    uint32_t want[6], got[8];
    int n_want = 0, n = 0;
    submit_decode(f, ID_Z, "t", ref, 6, false);
    Snapkv__Reply *rep = decode_final(f, ID_Z, want, &n_want, 6);
    assert_int_equal(rep->status, SKV_OK);
    snapkv__reply__free_unpacked(rep, NULL);

    /* X's decode starts and takes a token; U's CANCEL is refused; Y's (same tenant) ends it */
    freeze(f, a);
    submit_decode(f, ID_X, "t", a, 1000, true);
    submit_cancel(f, 0, ID_Z, "u", a);
    submit_cancel(f, 0, ID_Y, "t", a);
    thaw(f);
    rep = next_reply(f, 0, ID_X, 5); /* the first round's token */
    assert_int_equal(rep->status, SKV_OK);
    assert_false(rep->final);
    got[n++] = rep->decode->tokens[0];
    snapkv__reply__free_unpacked(rep, NULL);
    rep = next_reply(f, 0, ID_Z, 5);
    assert_int_equal(rep->status, SKV_E_NOT_FOUND);
    snapkv__reply__free_unpacked(rep, NULL);
    rep = next_reply(f, 0, ID_X, 5); /* the second round's */
    assert_false(rep->final);
    got[n++] = rep->decode->tokens[0];
    snapkv__reply__free_unpacked(rep, NULL);
    rep = next_reply(f, 0, ID_X, 5);
    assert_true(rep->final);
    assert_string_equal(rep->decode->finish_reason, "cancelled");
    assert_int_equal(rep->decode->n_generated, 2);
    snapkv__reply__free_unpacked(rep, NULL);
    rep = next_reply(f, 0, ID_Y, 5);
    assert_int_equal(rep->status, SKV_OK);
    assert_int_equal(rep->result_case, SNAPKV__REPLY__RESULT_CANCEL);
    assert_true(rep->cancel->cancelled);
    assert_int_equal(rep->cancel->n_generated, 2);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(stat(f, "snapkv_decodes_cancelled_total"), 1);
    assert_int_equal(stat(f, "snapkv_decodes_running"), 0);

    /* nothing runs now: the admin endpoint's CANCEL (any tenant) answers false */
    static const uint8_t admin[5] = {0, 1, 2, 3, 4};
    submit_cancel(f, 1, admin, "someone", a);
    rep = next_reply(f, 1, admin, 5);
    assert_int_equal(rep->status, SKV_OK);
    assert_false(rep->cancel->cancelled);
    snapkv__reply__free_unpacked(rep, NULL);
    submit_decode(f, ID_Y, "t", a, 4, false);
    int n_more = 0;
    rep = decode_final(f, ID_Y, got + 2, &n_more, 4);
    if (rep->status)
        fail_msg("DECODE: %d %s", rep->status, rep->message);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(n_more, 4);
    assert_memory_equal(got, want, sizeof want);
}

/* The session X decodes behind a frozen worker (decode_behind_freeze). */
static uint8_t g_decoded[16];

/* Two sessions of 8 tokens; the worker frozen on the second's export; X's DECODE of the first
 * (g_decoded), 1000 tokens, queued behind it. */
static void decode_behind_freeze(struct fixture *f)
{
    uint8_t b[16];
    prefill(f, 8, "policy=full", g_decoded);
    prefill(f, 8, "policy=full", b);
    freeze(f, b);
    submit_decode(f, ID_X, "t", g_decoded, 1000, false);
}

/* Client id's next reply: a CANCEL's, OK, saying whether it ended a decode. */
static void expect_cancel_reply(struct fixture *f, const uint8_t *id, bool cancelled)
{
    Snapkv__Reply *rep = next_reply(f, 0, id, 5);
    assert_int_equal(rep->status, SKV_OK);
    assert_int_equal(rep->result_case, SNAPKV__REPLY__RESULT_CANCEL);
    assert_int_equal(rep->cancel->cancelled, cancelled);
    snapkv__reply__free_unpacked(rep, NULL);
}

/* Client id's next reply: its DECODE's final, cancelled before max_tokens. */
static void expect_decode_cancelled(struct fixture *f, const uint8_t *id, uint32_t max_tokens)
{
    Snapkv__Reply *rep = next_reply(f, 0, id, 5);
    assert_int_equal(rep->status, SKV_OK);
    assert_true(rep->final);
    assert_string_equal(rep->decode->finish_reason, "cancelled");
    assert_true(rep->decode->n_generated < max_tokens);
    snapkv__reply__free_unpacked(rep, NULL);
}

/* A CANCEL runs when its turn comes whatever its deadline (other requests past theirs are
 * answered TIMEOUT unrun): it ends work its client gave up on. Dropped, the DECODE it named
 * ran on to its max_tokens (CI under TSan: a client's 300 ms timeout passed for its DECODE and
 * then for the CANCEL libsnapkv sent, and the decode went on for 2000 tokens). Run late, it
 * ends only a decode of its own connection: another connection's DECODE of the session may
 * have started since (a review of the change). */
static void test_cancel_past_deadline(void **state)
{
    struct fixture *f = *state;
    /* behind a frozen worker: X's DECODE, then late CANCELs from Y (whose connection did not
     * start that decode: it stays) and from X (it ends) */
    decode_behind_freeze(f);
    submit_cancel_opts(f, 0, ID_Y, "t", g_decoded, false, 5);
    submit_cancel_opts(f, 0, ID_X, "t", g_decoded, false, 5);
    usleep(30000); /* past the CANCELs' deadlines, in the queue */
    thaw(f);
    expect_cancel_reply(f, ID_Y, false);
    expect_decode_cancelled(f, ID_X, 1000); /* well before its 1000 tokens */
    expect_cancel_reply(f, ID_X, true);
    assert_int_equal(stat(f, "snapkv_requests_past_deadline_total"), 0);
    assert_int_equal(stat(f, "snapkv_decodes_cancelled_total"), 1);
    assert_int_equal(stat(f, "snapkv_decodes_running"), 0);
}

/* A CANCEL that asks for its own decode (own: what libsnapkv sends after its DECODE failed, a
 * timeout) ends only a decode of its sender's connection, on time too: the decode it meant may
 * have ended and another client's DECODE of the session begun since, which it ended before (a
 * review: X's decode finished as X's client timed out, Y's began, X's CANCEL ended Y's). */
static void test_cancel_own(void **state)
{
    struct fixture *f = *state;
    decode_behind_freeze(f);
    submit_cancel_opts(f, 0, ID_Y, "t", g_decoded, true, 0);
    thaw(f);
    expect_cancel_reply(f, ID_Y, false); /* X's decode runs on */
    submit_cancel_opts(f, 0, ID_X, "t", g_decoded, true, 0);
    expect_decode_cancelled(f, ID_X, 1000);
    expect_cancel_reply(f, ID_X, true);
    assert_int_equal(stat(f, "snapkv_decodes_cancelled_total"), 1);
}

/* COMPRESS of session sid with `spec`, queued by client id. */
static void submit_compress_from(struct fixture *f, const uint8_t *id, const uint8_t sid[16], const char *spec,
                                 uint32_t window_from)
{
    Snapkv__CompressSpec cs = SNAPKV__COMPRESS_SPEC__INIT;
    cs.spec = (char *)spec;
    Snapkv__CompressRequest c = SNAPKV__COMPRESS_REQUEST__INIT;
    c.session_id = (ProtobufCBinaryData){16, (uint8_t *)sid};
    c.compress = &cs;
    c.window_from = window_from;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_COMPRESS;
    req.compress = &c;
    assert_int_equal(skv_worker_submit(f->w, job_new(0, id, 5, &req)), SKV_OK);
}

static void submit_compress(struct fixture *f, const uint8_t *id, const uint8_t sid[16], const char *spec)
{
    submit_compress_from(f, id, sid, spec, 0);
}

/* Session sid's kept positions (INSPECT), malloc'd; *n: how many. */
static uint32_t *inspect_positions(struct fixture *f, const uint8_t sid[16], size_t *n)
{
    Snapkv__InspectRequest ir = SNAPKV__INSPECT_REQUEST__INIT;
    ir.session_id = (ProtobufCBinaryData){16, (uint8_t *)sid};
    ir.with_positions = true;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_INSPECT;
    req.inspect = &ir;
    Snapkv__Reply *rep = admin_call(f, &req);
    *n = rep->inspect->n_positions;
    uint32_t *pos = malloc(*n * sizeof *pos + 1);
    assert_non_null(pos);
    memcpy(pos, rep->inspect->positions, *n * sizeof *pos);
    snapkv__reply__free_unpacked(rep, NULL);
    return pos;
}

/* The logits an APPEND of the fixed token ids[5] to session sid gives (malloc'd, n_vocab). */
static float *next_logits(struct fixture *f, const uint8_t sid[16])
{
    uint32_t tok = (uint32_t)f->tiny->ids[5];
    Snapkv__AppendRequest a = SNAPKV__APPEND_REQUEST__INIT;
    a.session_id = (ProtobufCBinaryData){16, (uint8_t *)sid};
    a.tokens = &tok;
    a.n_tokens = 1;
    a.return_logits = true;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_APPEND;
    req.append = &a;
    Snapkv__Reply *rep = call(f, 0, ID_X, &req);
    if (rep->status)
        fail_msg("APPEND: %d %s", rep->status, rep->message);
    size_t n = rep->append->n_logits;
    assert_int_equal(n, f->tiny->m->cfg.n_vocab);
    float *out = malloc(n * sizeof *out);
    assert_non_null(out);
    memcpy(out, rep->append->logits, n * sizeof *out);
    snapkv__reply__free_unpacked(rep, NULL);
    return out;
}

/* Short requests queued behind a long forward run inside it, at its ticks, unless a request
 * ahead of them is from the same sender (the running one's included) or names the same
 * session, or their session is the running forward's: a small APPEND of another session and
 * an admin STATS answer before the long COMPRESS does; a FORK of the session being compressed
 * and the compressing client's own next request wait for it. The COMPRESS keeps what it keeps
 * when it runs alone. */
static void test_overtake(void **state)
{
    struct fixture *f = *state;
    assert_int_equal(skv_config_set(&f->cfg, "queue-order", "fifo"), SKV_OK); /* STATS behind the COMPRESS */
    restart_yielding_always(f);
    /* a window below the budget, so that the scores choose rows */
    const char *spec = "policy=snapkv,budget=16,window=8";
    uint8_t a[16], ref[16], b[16];
    prefill(f, 64, "policy=full", a);
    prefill(f, 64, "policy=full", ref);
    prefill(f, 8, "policy=full", b);
    assert_int_equal(append(f, a, 8, NULL), SKV_OK); /* 72 tokens: the last 64 run again */
    assert_int_equal(append(f, ref, 8, NULL), SKV_OK);
    submit_compress_from(f, ID_X, ref, spec, 8); /* alone */
    Snapkv__Reply *alone = next_reply(f, 0, ID_X, 5);
    if (alone->status)
        fail_msg("COMPRESS: %d %s", alone->status, alone->message);

    freeze(f, b);
    submit_compress_from(f, ID_X, a, spec, 8); /* re-runs 64 tokens: a long forward with ticks */
    submit_fork(f, ID_Y, a);
    submit_append(f, ID_Z, b, 3);
    submit_append(f, ID_X, b, 2);
    static const uint8_t admin[5] = {0, 1, 2, 3, 4};
    submit_admin_stats(f, NULL);
    thaw(f);

    const uint8_t *order[5] = {ID_Z, admin, ID_X, ID_Y, ID_X};
    Snapkv__Reply *reps[5];
    for (int i = 0; i < 5; i++) {
        uint8_t id[5];
        reps[i] = any_reply(f, id);
        if (memcmp(id, order[i], 5) != 0)
            fail_msg("reply %d came from client %02x, not %02x", i, id[4], order[i][4]);
        if (reps[i]->status)
            fail_msg("reply %d: %d %s", i, reps[i]->status, reps[i]->message);
    }
    assert_int_equal(reps[0]->append->n_tokens, 11);
    assert_int_equal(reps[1]->result_case, SNAPKV__REPLY__RESULT_STATS);
    const Snapkv__CompressReply *c = reps[2]->compress, *r = alone->compress;
    assert_non_null(c);
    assert_int_equal(c->bytes_after, r->bytes_after);
    assert_int_equal(c->n_kept, r->n_kept);
    for (size_t l = 0; l < r->n_kept; l++)
        assert_memory_equal(c->kept[l]->kept_per_head, r->kept[l]->kept_per_head,
                            sizeof(uint32_t) * r->kept[l]->n_kept_per_head);
    assert_int_equal(reps[3]->result_case, SNAPKV__REPLY__RESULT_FORK);
    assert_int_equal(reps[4]->append->n_tokens, 13);
    for (int i = 0; i < 5; i++)
        snapkv__reply__free_unpacked(reps[i], NULL);
    snapkv__reply__free_unpacked(alone, NULL);
    assert_int_equal(stat(f, "snapkv_requests_inside_forwards_total"), 2);
    /* the COMPRESS that let others in keeps the rows the one alone kept (not only the newest),
     * and gives the same next logits, bit for bit */
    size_t na = 0, nr = 0, older = 0;
    uint32_t *pa = inspect_positions(f, a, &na), *pr = inspect_positions(f, ref, &nr);
    assert_int_equal(na, nr);
    assert_int_equal(na, (size_t)f->tiny->m->cfg.n_layers * f->tiny->m->cfg.n_kv_heads * 16);
    assert_memory_equal(pa, pr, na * sizeof *pa);
    for (size_t i = 0; i < na; i++)
        older += pa[i] < 72 - 8;
    assert_true(older > 0);
    float *la = next_logits(f, a), *lr = next_logits(f, ref);
    assert_memory_equal(la, lr, (size_t)f->tiny->m->cfg.n_vocab * sizeof *la);
    free(pa);
    free(pr);
    free(la);
    free(lr);
}

/* The fair-order scenario: while the worker is held in a request of tenant t, client X queues
 * two APPENDs to session b for t, Y a DECODE of 1000 tokens for t, Z an APPEND to c for tenant
 * u, X one to c for u (behind its own two, and behind Z's on the same session), then Y's
 * connection closes. Writes the clients the five replies went to, in order, and the sessions'
 * lengths the APPEND replies name; returns snapkv_requests_reordered_total, and the tokens Y's
 * decode made before the notice ended it in *y_tokens. */
static int fair_scenario(struct fixture *f, char order[6], int lens[5], int *y_tokens)
{
    uint8_t a[16], b[16], c[16];
    prefill_for(f, "t", 8, "policy=full", a);
    prefill_for(f, "t", 8, "policy=full", b);
    prefill_for(f, "u", 8, "policy=full", c);
    freeze(f, a);
    usleep(200000); /* t's time: 200 ms and more, against well under 1 ms for u's prefill (and a
                     * few ms on a loaded host under a sanitizer) */
    submit_append_for(f, ID_X, "t", b, 2);
    submit_append_for(f, ID_X, "t", b, 2);
    submit_decode(f, ID_Y, "t", a, 1000, false);
    submit_append_for(f, ID_Z, "u", c, 2);
    submit_append_for(f, ID_X, "u", c, 1);
    assert_int_equal(skv_worker_client_gone(f->w, ID_Y, sizeof ID_Y, true), SKV_OK);
    thaw(f);
    for (int i = 0; i < 5; i++) {
        uint8_t id[5];
        Snapkv__Reply *rep = any_reply(f, id);
        if (rep->status)
            fail_msg("reply %d: %d %s", i, rep->status, rep->message);
        order[i] = id[4] == ID_X[4] ? 'X' : id[4] == ID_Y[4] ? 'Y' : id[4] == ID_Z[4] ? 'Z' : '?';
        bool decode = rep->result_case == SNAPKV__REPLY__RESULT_DECODE;
        lens[i] = decode ? 0 : (int)rep->append->n_tokens;
        if (decode) {
            assert_string_equal(rep->decode->finish_reason, "cancelled");
            *y_tokens = (int)rep->decode->n_generated;
        }
        snapkv__reply__free_unpacked(rep, NULL);
    }
    order[5] = '\0';
    return (int)stat(f, "snapkv_requests_reordered_total");
}

/* queue-order = fair (the default): the tenant with the least engine time goes first, so u's
 * APPEND runs before t's backlog, while each client's requests and each session's still run in
 * the order sent, and a client-gone notice runs as soon as its client's queued requests did.
 * queue-order = fifo: the order they came in. */
static void test_fair_order(void **state)
{
    struct fixture *f = *state;
    char order[6];
    int lens[5], y_tokens = -1;
    int reordered = fair_scenario(f, order, lens, &y_tokens);
    /* Z's (u) first; X's for u waits for X's two for t, then goes before Y's (t); the notice
     * right after Y's DECODE started: one round */
    assert_string_equal(order, "ZXXXY");
    int want[5] = {10, 10, 12, 11, 0};
    assert_memory_equal(lens, want, sizeof want);
    assert_int_equal(reordered, 2);
    assert_int_equal(y_tokens, 1);

    restart_fifo(f);
    reordered = fair_scenario(f, order, lens, &y_tokens);
    assert_string_equal(order, "XXZXY"); /* Y's decode: a token with each of the three turns after it */
    int want_fifo[5] = {10, 12, 10, 11, 0};
    assert_memory_equal(lens, want_fifo, sizeof want_fifo);
    assert_int_equal(reordered, 0);
    assert_int_equal(y_tokens, 3);
}

/* STATS --prometheus from the admin endpoint (the caller frees it). */
static char *prometheus_text(struct fixture *f)
{
    Snapkv__StatsRequest sr = SNAPKV__STATS_REQUEST__INIT;
    sr.prometheus = true;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_STATS;
    req.stats = &sr;
    Snapkv__Reply *rep = admin_call(f, &req);
    char *text = strdup(rep->stats->prometheus_text);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_non_null(text);
    return text;
}

/* A RELEASE of a session nobody has, for tenant (rr: its command's storage). */
static Snapkv__Request release_nobody_req(Snapkv__ReleaseRequest *rr, const char *tenant)
{
    static const uint8_t nobody[16] = {0xee};
    snapkv__release_request__init(rr);
    rr->session_id = (ProtobufCBinaryData){16, (uint8_t *)nobody};
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_RELEASE;
    req.release = rr;
    req.tenant = (char *)tenant;
    return req;
}

/* A RELEASE of a session nobody has, for tenant: a request that fails (not found), with a
 * message that says so, whatever the tenant's name. */
static void release_unknown(struct fixture *f, const char *tenant)
{
    Snapkv__ReleaseRequest rr;
    Snapkv__Request req = release_nobody_req(&rr, tenant);
    Snapkv__Reply *rep = call(f, 0, ID_Y, &req);
    assert_int_equal(rep->status, SKV_E_NOT_FOUND);
    /* counting the failure under "(other)" keeps the message (it once cleared it) */
    if (!strstr(rep->message, "no session"))
        fail_msg("RELEASE for tenant '%s': '%s', want 'no session ...'", tenant, rep->message);
    snapkv__reply__free_unpacked(rep, NULL);
}

/* Per-tenant figures in STATS: each tenant's sessions and bytes, waiting requests, running
 * decodes, requests, errors, tokens and engine time, as rows labelled with the tenant; the
 * admin endpoint's requests as "(admin)"; past 128 tenant names, and for names no tenant can
 * have, "(other)". The exposition names each metric once. */
static void test_tenant_stats(void **state)
{
    struct fixture *f = *state;
    uint8_t a[16], b[16], c[16];
    prefill_for(f, "t", 8, "policy=full", a);
    prefill_for(f, "t", 16, "policy=full", b);
    prefill_for(f, "u", 8, "policy=full", c);
    release_unknown(f, "u");
    uint64_t bytes_a = 0, bytes_b = 0;
    listed(f, a, &bytes_a, NULL);
    listed(f, b, &bytes_b, NULL);
    assert_true(stat(f, "snapkv_tenant_sessions{tenant=\"t\"}") == 2);
    assert_true(stat(f, "snapkv_tenant_sessions{tenant=\"u\"}") == 1);
    assert_true(stat(f, "snapkv_tenant_bytes{tenant=\"t\"}") == (double)(bytes_a + bytes_b));
    assert_true(stat(f, "snapkv_tenant_prefill_tokens_total{tenant=\"t\"}") == 24);
    assert_true(stat(f, "snapkv_tenant_prefill_tokens_total{tenant=\"u\"}") == 8);
    assert_true(stat(f, "snapkv_tenant_requests_total{tenant=\"t\"}") == 2);
    assert_true(stat(f, "snapkv_tenant_requests_total{tenant=\"u\"}") == 2);
    assert_true(stat(f, "snapkv_tenant_errors_total{tenant=\"u\"}") == 1);
    assert_true(stat(f, "snapkv_tenant_errors_total{tenant=\"t\"}") == 0);
    assert_true(stat(f, "snapkv_tenant_engine_seconds_total{tenant=\"t\"}") > 0);
    /* the admin reads so far: two LISTs and ten STATS, this one counted before it answers */
    assert_true(stat(f, "snapkv_tenant_requests_total{tenant=\"(admin)\"}") == 13);

    /* a running decode (not streamed: no reply before its end; slowed to seconds, so that it
     * still runs when the CANCEL comes however slow this thread is), then a waiting request */
    atomic_store(&g_slow_rmsnorm_us, 2000);
    submit_decode(f, ID_Z, "u", c, 1000, false);
    for (int i = 0; i < 1000 && stat(f, "snapkv_tenant_decodes_running{tenant=\"u\"}") == 0; i++)
        usleep(1000);
    assert_true(stat(f, "snapkv_tenant_decodes_running{tenant=\"u\"}") == 1);
    submit_cancel(f, 0, ID_X, "u", c);
    uint32_t toks[4];
    int n_toks = 0;
    Snapkv__Reply *rep = decode_final(f, ID_Z, toks, &n_toks, 4);
    assert_string_equal(rep->decode->finish_reason, "cancelled");
    snapkv__reply__free_unpacked(rep, NULL);
    atomic_store(&g_slow_rmsnorm_us, 0);
    rep = next_reply(f, 0, ID_X, 5);
    assert_int_equal(rep->status, SKV_OK);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_true(stat(f, "snapkv_tenant_decodes_running{tenant=\"u\"}") == 0);
    assert_true(stat(f, "snapkv_tenant_decode_tokens_total{tenant=\"u\"}") >= 1);
    /* while t's two COMPRESSes wait, the admin's STATS runs first (the admin endpoint had less
     * engine time than t, held 200 ms) and counts them */
    freeze(f, a);
    usleep(200000);
    submit_compress(f, ID_X, a, "policy=snapkv,budget=4,window=4");
    submit_compress(f, ID_Y, b, "policy=snapkv,budget=4,window=4");
    submit_admin_stats(f, NULL);
    thaw(f);
    double queued = -1;
    for (int i = 0; i < 3; i++) {
        uint8_t id[5];
        rep = any_reply(f, id);
        if (rep->status)
            fail_msg("reply %d: %d %s", i, rep->status, rep->message);
        if (i == 0)
            assert_int_equal(rep->result_case, SNAPKV__REPLY__RESULT_STATS);
        for (size_t k = 0; rep->result_case == SNAPKV__REPLY__RESULT_STATS && k < rep->stats->n_stats; k++)
            if (strcmp(rep->stats->stats[k]->name, "snapkv_tenant_queue_requests{tenant=\"t\"}") == 0)
                queued = rep->stats->stats[k]->value;
        snapkv__reply__free_unpacked(rep, NULL);
    }
    assert_true(queued == 2);

    /* 128 names: t, u and 126 more (the admin's row is not one); then "(other)". A name no
     * tenant can have is refused before it queues, counted for no tenant */
    char name[32];
    for (int i = 0; i < 127; i++) {
        snprintf(name, sizeof name, "tenant-%03d", i);
        release_unknown(f, name);
    }
    Snapkv__ReleaseRequest rr;
    Snapkv__Request bad = release_nobody_req(&rr, "no spaces allowed");
    expect_refused(f, &bad, SKV_E_INVAL, "tenant 'no spaces allowed': only letters, digits");
    assert_true(stat(f, "snapkv_tenant_requests_total{tenant=\"tenant-125\"}") == 1);
    assert_true(stat(f, "snapkv_tenant_requests_total{tenant=\"(other)\"}") == 1); /* tenant-126 */
    assert_true(stat(f, "snapkv_tenant_errors_total{tenant=\"(other)\"}") == 1);

    char *text = prometheus_text(f);
    const char *want = "# TYPE snapkv_tenant_sessions gauge\nsnapkv_tenant_sessions{tenant=\"t\"} 2\n";
    assert_non_null(strstr(text, want));
    assert_non_null(strstr(text, "# TYPE snapkv_tenant_engine_seconds_total counter\n"));
    int types = 0;
    for (const char *p = text; (p = strstr(p, "# TYPE snapkv_tenant_")); p++)
        types++;
    assert_int_equal(types, 10);
    assert_non_null(strstr(text, "# TYPE snapkv_tenant_prefix_retained_bytes gauge\n"));
    free(text);
}

/* A client-gone notice drops the client's queued requests whose only outcome was for it
 * (PREFILL, FORK: no reply, no new session), while its EXPORT_KV, APPEND, DECODE and RELEASE
 * still run (the DECODE ends at once, cancelled by the notice after it), and another client's
 * PREFILL too. */
static void test_gone_drops_queued(void **state)
{
    struct fixture *f = *state;
    uint8_t a[16], b[16], c[16];
    prefill(f, 8, "policy=full", a);
    prefill(f, 8, "policy=full", b);
    prefill(f, 8, "policy=full", c);
    int n_sessions = 0;
    listed(f, a, NULL, &n_sessions);
    assert_int_equal(n_sessions, 3);
    int opened0 = opened(2), closed0 = closed(2); /* the fake's counts run over every test */
    freeze(f, a);
    uint32_t tokens[8];
    fixed_ids(f, tokens, 8);
    Snapkv__PrefillRequest p;
    Snapkv__Request req = prefill_req(&p, tokens, 8);
    assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_Y, 5, &req)), SKV_OK);
    submit_fork(f, ID_Y, b);
    submit_export(f, 0, ID_Y, b, 2);
    submit_append(f, ID_Y, b, 2);      /* runs: another client may count on b's new tokens */
    submit_decode(f, ID_Y, "t", b, 1000, false);
    Snapkv__ReleaseRequest rr = SNAPKV__RELEASE_REQUEST__INIT;
    rr.session_id = (ProtobufCBinaryData){16, c};
    Snapkv__Request rq = SNAPKV__REQUEST__INIT;
    rq.command_case = SNAPKV__REQUEST__COMMAND_RELEASE;
    rq.release = &rr;
    assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_Y, 5, &rq)), SKV_OK); /* runs */
    assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_Z, 5, &req)), SKV_OK); /* another client's */
    assert_int_equal(skv_worker_client_gone(f->w, ID_Y, sizeof ID_Y, true), SKV_OK);
    thaw(f);
    /* Y's EXPORT, APPEND and RELEASE answer (the socket thread would drop these), then Z's PREFILL */
    expect_exported(f, 0, ID_Y);
    Snapkv__Reply *rep = next_reply(f, 0, ID_Y, 5);
    assert_int_equal(rep->status, SKV_OK);
    assert_int_equal(rep->result_case, SNAPKV__REPLY__RESULT_APPEND);
    assert_int_equal(rep->append->n_tokens, 10);
    snapkv__reply__free_unpacked(rep, NULL);
    rep = next_reply(f, 0, ID_Y, 5);
    assert_int_equal(rep->status, SKV_OK);
    assert_int_equal(rep->result_case, SNAPKV__REPLY__RESULT_RELEASE);
    snapkv__reply__free_unpacked(rep, NULL);
    /* the decode: a round after its own turn and the RELEASE's; then the notice goes before
     * Z's PREFILL (a notice goes first once its client's requests ran) */
    rep = next_reply(f, 0, ID_Y, 5);
    assert_int_equal(rep->status, SKV_OK);
    assert_int_equal(rep->result_case, SNAPKV__REPLY__RESULT_DECODE);
    assert_string_equal(rep->decode->finish_reason, "cancelled");
    assert_int_equal(rep->decode->n_generated, 2);
    snapkv__reply__free_unpacked(rep, NULL);
    rep = next_reply(f, 0, ID_Z, 5);
    assert_int_equal(rep->status, SKV_OK);
    assert_int_equal(rep->result_case, SNAPKV__REPLY__RESULT_PREFILL);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(listed(f, b, NULL, &n_sessions), 12);
    assert_int_equal(n_sessions, 3); /* a, b and Z's: no fork, no Y prefill; c released */
    assert_int_equal(stat(f, "snapkv_requests_dropped_on_disconnect_total"), 2);
    assert_int_equal(opened(2) - opened0, 1); /* the EXPORT wrote Y's buffer, and the notice closed it */
    assert_int_equal(closed(2) - closed0, 1);
}

/* A request still waiting when its deadline (the client's timeout) passes is answered TIMEOUT
 * without running: no session for a PREFILL, no tokens for an APPEND; one with no deadline, or
 * a later one, runs, and so does a late RELEASE (its cache freed now, not at its lease's end). */
static void test_deadline(void **state)
{
    struct fixture *f = *state;
    uint8_t a[16], b[16], c[16];
    prefill(f, 8, "policy=full", a);
    prefill(f, 8, "policy=full", b);
    prefill(f, 8, "policy=full", c);
    freeze(f, a);
    uint32_t tokens[8];
    fixed_ids(f, tokens, 8);
    Snapkv__PrefillRequest p;
    Snapkv__Request req = prefill_req(&p, tokens, 8);
    req.deadline_ms = 5;
    assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_Y, 5, &req)), SKV_OK);
    uint32_t more[2] = {tokens[0], tokens[1]};
    Snapkv__AppendRequest ap = SNAPKV__APPEND_REQUEST__INIT;
    ap.session_id = (ProtobufCBinaryData){16, b};
    ap.tokens = more;
    ap.n_tokens = 2;
    Snapkv__Request aq = SNAPKV__REQUEST__INIT;
    aq.command_case = SNAPKV__REQUEST__COMMAND_APPEND;
    aq.append = &ap;
    aq.deadline_ms = 5;
    assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_Y, 5, &aq)), SKV_OK);
    aq.deadline_ms = 0; /* the same APPEND, waiting as long as it takes */
    assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_Y, 5, &aq)), SKV_OK);
    aq.deadline_ms = 600000; /* and one whose client waits ten minutes */
    assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_Y, 5, &aq)), SKV_OK);
    Snapkv__ReleaseRequest rr = SNAPKV__RELEASE_REQUEST__INIT;
    rr.session_id = (ProtobufCBinaryData){16, c};
    Snapkv__Request rq = SNAPKV__REQUEST__INIT;
    rq.command_case = SNAPKV__REQUEST__COMMAND_RELEASE;
    rq.release = &rr;
    rq.deadline_ms = 5;
    assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_Y, 5, &rq)), SKV_OK);
    usleep(30000);
    thaw(f);
    expect_reply(f, SKV_E_TIMEOUT, "past its deadline of 5 ms (the client's timeout): not run");
    expect_reply(f, SKV_E_TIMEOUT, "past its deadline of 5 ms");
    Snapkv__Reply *rep = next_reply(f, 0, ID_Y, 5);
    assert_int_equal(rep->status, SKV_OK);
    assert_int_equal(rep->append->n_tokens, 10);
    snapkv__reply__free_unpacked(rep, NULL);
    rep = next_reply(f, 0, ID_Y, 5);
    assert_int_equal(rep->status, SKV_OK);
    assert_int_equal(rep->append->n_tokens, 12);
    snapkv__reply__free_unpacked(rep, NULL);
    rep = next_reply(f, 0, ID_Y, 5);
    assert_int_equal(rep->status, SKV_OK);
    assert_int_equal(rep->result_case, SNAPKV__REPLY__RESULT_RELEASE);
    snapkv__reply__free_unpacked(rep, NULL);
    int n_sessions = 0;
    listed(f, a, NULL, &n_sessions);
    assert_int_equal(n_sessions, 2); /* a and b: no PREFILL's, c released */
    assert_int_equal(stat(f, "snapkv_requests_past_deadline_total"), 2);
}

/* Holds the worker in an EXPORT_KV of tenant's session sid by client id (its first use of fake
 * buffer 5, so the open blocks) for `ms`, queueing `then` (APPENDs of 1 token to b by client X
 * for tenant "t", and to c by Z for "u") meanwhile; returns after the export's reply. */
static void hold_for(struct fixture *f, const uint8_t *id, const char *tenant, const uint8_t sid[16], int ms,
                     const uint8_t b[16], const uint8_t c[16])
{
    pthread_mutex_lock(&g_stuck_mu);
    g_stuck_k = 5;
    pthread_mutex_unlock(&g_stuck_mu);
    submit_export_tenant(f, 0, id, tenant, sid, 5, 0);
    pthread_mutex_lock(&g_stuck_mu);
    while (!g_stuck)
        pthread_cond_wait(&g_stuck_cv, &g_stuck_mu);
    pthread_mutex_unlock(&g_stuck_mu);
    usleep((useconds_t)ms * 1000);
    if (b) {
        submit_append_for(f, ID_X, "t", b, 1);
        submit_append_for(f, ID_Z, "u", c, 1);
    }
    pthread_mutex_lock(&g_stuck_mu);
    g_stuck_k = 0;
    pthread_cond_broadcast(&g_stuck_cv);
    pthread_mutex_unlock(&g_stuck_mu);
    expect_exported(f, 0, id);
}

/* The tenant whose APPEND runs first after u held the engine 200 ms and t 400 ms (each request's
 * time, divided by its tenant's weight, is its tenant's virtual time). */
static char first_after_holds(struct fixture *f)
{
    uint8_t a[16], b[16], c[16], d[16];
    prefill_for(f, "u", 8, "policy=full", a);
    prefill_for(f, "t", 8, "policy=full", b);
    prefill_for(f, "u", 8, "policy=full", c);
    prefill_for(f, "t", 8, "policy=full", d);
    hold_for(f, ID_Y, "u", a, 200, NULL, NULL);
    hold_for(f, ID_F, "t", d, 400, b, c);
    uint8_t first[5], second[5];
    Snapkv__Reply *rep = any_reply(f, first);
    assert_int_equal(rep->status, SKV_OK);
    snapkv__reply__free_unpacked(rep, NULL);
    rep = any_reply(f, second);
    assert_int_equal(rep->status, SKV_OK);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_true(first[4] != second[4]);
    return first[4] == ID_X[4] ? 't' : first[4] == ID_Z[4] ? 'u' : '?';
}

/* tenant-weights: a tenant's engine time counts divided by its weight. With equal weights u,
 * which held the engine 200 ms, goes before t, which held it 400 ms; with t's weight 4, t's
 * 400 ms count as 100 and t goes first. The gaps (100 ms and more) are wider than the delays a
 * loaded host puts on the 8-token prefills either tenant also ran. */
static void test_tenant_weights(void **state)
{
    struct fixture *f = *state;
    assert_int_equal(first_after_holds(f), 'u');
    skv_worker_stop(&f->w);
    assert_int_equal(skv_config_set(&f->cfg, "tenant-weights", "t:4"), SKV_OK);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    assert_int_equal(first_after_holds(f), 't');
    /* a bad entry: refused where it is set; and a worker given one anyway does not start, and
     * says why */
    skv_worker_stop(&f->w);
    assert_int_equal(skv_config_set(&f->cfg, "tenant-weights", "t:x"), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "the weight of 't'"));
    free(f->cfg.tenant_weights);
    f->cfg.tenant_weights = strdup("t:x");
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "the weight of 't'"));
    assert_int_equal(skv_config_set(&f->cfg, "tenant-weights", ""), SKV_OK);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
}

/* A PREFILL of the first n fixed ids (full cache, logits returned) by client id for tenant,
 * queued. */
static void submit_prefill_as(struct fixture *f, const uint8_t *id, const char *tenant, int n)
{
    uint32_t tokens[64];
    fixed_ids(f, tokens, n);
    Snapkv__PrefillRequest p;
    Snapkv__Request req = prefill_req(&p, tokens, (size_t)n);
    p.return_logits = true;
    req.tenant = (char *)tenant;
    assert_int_equal(skv_worker_submit(f->w, job_new(0, id, 5, &req)), SKV_OK);
}

static void submit_long_prefill_cb(void *f)
{
    submit_long_prefill(f, false);
}

/* The nested scenario: X's 64-token PREFILL for tenant t waits at the gate in its first layer;
 * meanwhile Z queues a 48-token PREFILL for u, X one for u, Y one for t; 250 ms later the gate
 * opens. Writes the four final replies' clients in order (A: X's for t, E: X's for u), and
 * returns them in reps[] as A, B (Z's), E, D (Y's); returns snapkv_requests_nested_total. */
static int nested_scenario(struct fixture *f, char order[5], Snapkv__Reply *reps[4])
{
    gate_hold(submit_long_prefill_cb, f);
    submit_prefill_as(f, ID_Z, "u", 48);
    submit_prefill_as(f, ID_X, "u", 48);
    submit_prefill_as(f, ID_Y, "t", 48);
    /* t's request has had 250 ms: more than a slice of 1, and, on a loaded host too, more than
     * the 16-token difference of u's and t's prefills, so that after A u's E goes before t's D */
    usleep(250000);
    gate_open();
    for (int i = 0; i < 4; i++) {
        uint8_t id[5];
        Snapkv__Reply *rep = any_reply(f, id);
        if (rep->status)
            fail_msg("reply %d: %d %s", i, rep->status, rep->message);
        assert_int_equal(rep->result_case, SNAPKV__REPLY__RESULT_PREFILL);
        bool x = id[4] == ID_X[4], a = x && rep->prefill->n_tokens == 64;
        order[i] = a ? 'A' : x ? 'E' : id[4] == ID_Z[4] ? 'B' : id[4] == ID_Y[4] ? 'D' : '?';
        reps[a ? 0 : x ? 2 : id[4] == ID_Z[4] ? 1 : 3] = rep;
    }
    order[4] = '\0';
    return (int)stat(f, "snapkv_requests_nested_total");
}

/* fair-slice-ms: once t's long PREFILL has had a slice of engine time, u's waiting PREFILL runs
 * inside it, at its next tick, on the nested engine, and both come out as when each runs alone
 * (the same logits and kept rows, bit for bit). A request of the running one's sender (X's for
 * u) or of its tenant (Y's for t) does not: each client's order is kept, and a tenant does not
 * overtake itself. The nested engine gives its buffers back after the request (the engines'
 * scratch is what it was before). With fair-slice-ms = 0 u's PREFILL waits for t's. */
static void test_nested(void **state)
{
    struct fixture *f = *state;
    const int n_vocab = f->tiny->m->cfg.n_vocab;
    skv_worker_stop(&f->w);
    f->cfg.decode_yield_ms = 0;
    assert_int_equal(skv_config_set(&f->cfg, "fair-slice-ms", "1"), SKV_OK);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    /* each alone */
    submit_long_prefill(f, false);
    Snapkv__Reply *alone_a = next_reply(f, 0, ID_X, 5);
    submit_prefill_as(f, ID_Z, "u", 48);
    Snapkv__Reply *alone_b = next_reply(f, 0, ID_Z, 5);
    assert_int_equal(alone_a->status, SKV_OK);
    assert_int_equal(alone_b->status, SKV_OK);
    assert_int_equal(stat(f, "snapkv_requests_nested_total"), 0);

    char order[5];
    Snapkv__Reply *reps[4];
    double scratch = stat(f, "snapkv_engine_scratch_bytes"); /* the main engine's, for 64 tokens */
    assert_true(scratch > 0);
    assert_int_equal(nested_scenario(f, order, reps), 1);
    /* B inside A; then E (u: less time than t) and D */
    assert_string_equal(order, "BAED");
    /* the nested engine gave back the buffers B's 48 tokens took */
    assert_true(stat(f, "snapkv_engine_scratch_bytes") == scratch);
    const Snapkv__PrefillReply *a = reps[0]->prefill, *b = reps[1]->prefill;
    assert_int_equal(a->n_logits, n_vocab);
    assert_memory_equal(a->logits, alone_a->prefill->logits, sizeof(float) * (size_t)n_vocab);
    assert_int_equal(a->bytes_after, alone_a->prefill->bytes_after);
    assert_int_equal(a->n_kept, alone_a->prefill->n_kept);
    for (size_t l = 0; l < a->n_kept; l++)
        assert_memory_equal(a->kept[l]->kept_per_head, alone_a->prefill->kept[l]->kept_per_head,
                            sizeof(uint32_t) * a->kept[l]->n_kept_per_head);
    assert_int_equal(b->n_logits, n_vocab);
    assert_memory_equal(b->logits, alone_b->prefill->logits, sizeof(float) * (size_t)n_vocab);
    assert_int_equal(b->bytes_after, alone_b->prefill->bytes_after);
    for (int i = 0; i < 4; i++)
        snapkv__reply__free_unpacked(reps[i], NULL);

    skv_worker_stop(&f->w);
    assert_int_equal(skv_config_set(&f->cfg, "fair-slice-ms", "0"), SKV_OK);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    assert_int_equal(nested_scenario(f, order, reps), 0);
    assert_string_equal(order, "ABED");
    assert_memory_equal(reps[1]->prefill->logits, alone_b->prefill->logits, sizeof(float) * (size_t)n_vocab);
    for (int i = 0; i < 4; i++)
        snapkv__reply__free_unpacked(reps[i], NULL);
    snapkv__reply__free_unpacked(alone_a, NULL);
    snapkv__reply__free_unpacked(alone_b, NULL);
}

/* restart_with_pool for the nesting tests: no decode yield, a 1 ms fair slice */
static uint64_t restart_nesting(struct fixture *f, int blocks)
{
    f->cfg.decode_yield_ms = 0;
    assert_int_equal(skv_config_set(&f->cfg, "fair-slice-ms", "1"), SKV_OK);
    return restart_with_pool(f, blocks);
}

/* The next n replies, whoever's: each must be ok. */
static void expect_ok(struct fixture *f, int n)
{
    for (int i = 0; i < n; i++) {
        uint8_t id[5];
        Snapkv__Reply *rep = any_reply(f, id);
        if (rep->status)
            fail_msg("reply %d: %d %s", i, rep->status, rep->message);
        snapkv__reply__free_unpacked(rep, NULL);
    }
}

static void submit_full_64_cb(void *f)
{
    submit_prefill_as(f, ID_X, "t", 64);
}

/* A request nested in a forward cannot take the room that forward reserved: with the pool at
 * 7 blocks per layer and head, t's 64-token full PREFILL (4) reserves its room with an idle
 * session of 1 in the pool; u's 48-token one (3) runs inside it and has to evict the idle one
 * to fit, so the pool never holds more than its size (before, u's took the room as free, the
 * pool reached 8, and t's forward ran past the pool: on a GPU, device memory the pool-size
 * never allowed). */
static void test_nested_room(void **state)
{
    struct fixture *f = *state;
    const uint64_t unit = restart_nesting(f, 7); /* one block per layer and head */
    uint8_t idle[16];
    prefill_for(f, "v", 16, "policy=full", idle);
    atomic_store(&g_pool_peak, 0);
    atomic_store(&g_track_pool, f->tiny->m->kv_pool);
    gate_hold(submit_full_64_cb, f);
    /* a short request runs in a yield first: it must leave the forward's hold alone (it
     * cleared it, and the nested PREFILL then took the room again) */
    submit_admin_stats(f, NULL);
    gate_step();
    uint8_t admin_id[5];
    Snapkv__Reply *st = any_reply(f, admin_id);
    assert_int_equal(st->result_case, SNAPKV__REPLY__RESULT_STATS);
    snapkv__reply__free_unpacked(st, NULL);
    submit_prefill_as(f, ID_Z, "u", 48);
    usleep(100000); /* past t's slice */
    gate_open();
    expect_ok(f, 2);
    atomic_store(&g_track_pool, NULL);
    assert_int_equal(stat(f, "snapkv_requests_nested_total"), 1);
    int count = 0;
    assert_int_equal(listed(f, idle, NULL, &count), -1); /* evicted, for u's */
    assert_true(atomic_load(&g_pool_peak) <= 7 * unit);
}

/* u's compressing 48-token PREFILL (snapkv, 16 rows kept) for client Z, run nested in t's. */
static void submit_compressing_48(struct fixture *f)
{
    uint32_t tokens[64];
    fixed_ids(f, tokens, 48);
    Snapkv__CompressSpec cs = SNAPKV__COMPRESS_SPEC__INIT;
    cs.spec = "policy=snapkv,budget=16,window=4";
    Snapkv__PrefillRequest p;
    Snapkv__Request req = prefill_req(&p, tokens, 48);
    p.compress = &cs;
    req.tenant = "u";
    assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_Z, 5, &req)), SKV_OK);
}

/* The prompt rows a compressing PREFILL keeps for reuse (prefix-retain-bytes) take room only
 * when the pool has it past what the forward it runs in holds: with the pool at 7 blocks per
 * layer and head, t's 64-token full PREFILL holds 4; u's 48-token one, nested, keeps 1 and
 * would retain its 3 prompt blocks. They are not retained, and the pool stays within its size
 * (before, they were, on room t's forward held, and t's charge dropped them again). */
static void test_nested_keep(void **state)
{
    struct fixture *f = *state;
    uint64_t bb;
    const uint64_t unit = kv_unit(f, &bb);
    f->cfg.prefix_retain_bytes = (int64_t)(4 * unit * bb);
    f->cfg.prefix_reuse = true;
    restart_nesting(f, 7);
    atomic_store(&g_pool_peak, 0);
    atomic_store(&g_track_pool, f->tiny->m->kv_pool);
    gate_hold(submit_full_64_cb, f);
    submit_compressing_48(f);
    usleep(100000); /* past t's slice */
    gate_open();
    expect_ok(f, 2);
    atomic_store(&g_track_pool, NULL);
    assert_int_equal(stat(f, "snapkv_requests_nested_total"), 1);
    printf("# pool peak %.2f blocks a layer and head; retained %.0f, dropped %.0f\n",
           (double)atomic_load(&g_pool_peak) / (double)unit, stat(f, "snapkv_prefix_retained"),
           stat(f, "snapkv_prefix_retained_dropped_total"));
    assert_int_equal(stat(f, "snapkv_prefix_retained_dropped_total"), 0);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 0);
    assert_true(atomic_load(&g_pool_peak) <= 7 * unit);
}

/* A running request's other caches hold blocks too (an APPEND or COMPRESS on a copy keeps the
 * session's cache until it ends; a PREFILL keeps its prompt's rows): evicting an idle session
 * whose blocks they share frees nothing. With a pool of 4 blocks per layer and head, D (tenant
 * a, 2) idle, and S (a, busy) whose side cache shares D's blocks, tenant b's 3 do not fit:
 * refused with nothing evicted (before, D was evicted for nothing, then the refusal). Without
 * the side cache, evicting D makes the room. */
static void test_evict_side_cache(void **state)
{
    struct fixture *f = *state;
    struct skv_model *m = f->tiny->m;
    uint64_t bb;
    const uint64_t unit = kv_unit(f, &bb);
    struct skv_kv_pool_stats ps;
    skv_kv_pool_stats(m->kv_pool, &ps);
    const int rows = ps.block_rows;
    struct skv_session_stats ss;
    struct skv_session_limits lim = {.pool_bytes = 4 * unit * bb, .max_sessions_per_tenant = 16,
                                     .max_bytes_per_tenant = UINT64_MAX};
    struct skv_session_table *t = NULL;
    struct skv_session *d = NULL, *s = NULL, *n = NULL;
    assert_int_equal(skv_session_table_new(&lim, &t), SKV_OK);
    assert_int_equal(skv_session_create(t, m, "a", "a", &d), SKV_OK);
    int32_t ids[64];
    for (int i = 0; i < 2 * rows; i++)
        ids[i] = (int32_t)((i * 37 + 11) % m->cfg.n_vocab);
    assert_int_equal(skv_engine_forward(f->tiny->e, d->cache, ids, 2 * rows, NULL, NULL), SKV_OK);
    assert_int_equal(skv_session_charge(t, d, NULL), SKV_OK);
    assert_int_equal(skv_session_create(t, m, "a", "a", &s), SKV_OK);
    s->busy = 1;
    struct skv_kv_cache *side = NULL;
    assert_int_equal(skv_kv_cache_clone(d->cache, &side), SKV_OK);
    s->side[0] = side;
    assert_int_equal(skv_session_create(t, m, "b", "b", &n), SKV_OK);
    int evicted = -1;
    assert_int_equal(skv_session_reserve(t, n, 3 * unit * bb, 3 * unit * bb, &evicted), SKV_E_POOL_FULL);
    assert_int_equal(evicted, 0);
    skv_session_stats(t, &ss);
    assert_int_equal(ss.n_sessions, 3); /* D is still there */
    s->side[0] = NULL;
    skv_kv_cache_free(&side);
    assert_int_equal(skv_session_reserve(t, n, 3 * unit * bb, 3 * unit * bb, &evicted), SKV_OK);
    assert_int_equal(evicted, 1);
    skv_session_stats(t, &ss);
    assert_int_equal(ss.n_sessions, 2);
    skv_session_table_free(&t);
}

/* The same one level down: a request nested in a forward holds its own room against the short
 * requests and decode rounds that run inside its forward. With the pool at 8 blocks per layer
 * and head, t's 64-token PREFILL (4) holds its room and u's (4) runs nested in it; w's 16-token
 * one (1), a short request, runs inside u's forward and is refused, POOL_FULL, with nothing
 * evicted (before, u's room was free to w: w got its session, and u's charge evicted it right
 * after its client was told it was made). */
static void test_nested_room_inner(void **state)
{
    struct fixture *f = *state;
    const uint64_t unit = restart_nesting(f, 8);
    atomic_store(&g_pool_peak, 0);
    atomic_store(&g_track_pool, f->tiny->m->kv_pool);
    gate_hold(submit_full_64_cb, f);
    submit_prefill_as(f, ID_Z, "u", 64);
    submit_prefill_as(f, ID_Y, "w", 16);
    usleep(100000); /* past t's slice */
    gate_open();
    int w_status = -1000, order = 0, w_at = -1, u_at = -1;
    for (int i = 0; i < 3; i++) {
        uint8_t id[5];
        Snapkv__Reply *rep = any_reply(f, id);
        if (memcmp(id, ID_Y, 5) == 0) {
            w_status = rep->status;
            w_at = order;
        } else if (rep->status) {
            fail_msg("reply %d: %d %s", i, rep->status, rep->message);
        } else if (memcmp(id, ID_Z, 5) == 0) {
            u_at = order;
        }
        order++;
        snapkv__reply__free_unpacked(rep, NULL);
    }
    atomic_store(&g_track_pool, NULL);
    assert_int_equal(stat(f, "snapkv_requests_nested_total"), 1);
    assert_true(w_at < u_at); /* w ran inside u's forward */
    assert_int_equal(w_status, SKV_E_POOL_FULL);
    assert_int_equal(stat(f, "snapkv_evictions_total"), 0);
    assert_true(atomic_load(&g_pool_peak) <= 8 * unit);
}

/* A 64-token APPEND to session sid by client Y, with a deadline (0: none), asking for the
 * logits when `logits`. */
struct long_append {
    struct fixture *f;
    const uint8_t *sid;
    uint32_t deadline_ms;
    bool logits;
};

static void submit_long_append(void *arg)
{
    const struct long_append *la = arg;
    uint32_t tokens[64];
    fixed_ids(la->f, tokens, 64);
    Snapkv__AppendRequest ap = SNAPKV__APPEND_REQUEST__INIT;
    ap.session_id = (ProtobufCBinaryData){16, (uint8_t *)la->sid};
    ap.tokens = tokens;
    ap.n_tokens = 64;
    ap.return_logits = la->logits;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_APPEND;
    req.append = &ap;
    req.deadline_ms = la->deadline_ms;
    assert_int_equal(skv_worker_submit(la->f->w, job_new(0, ID_Y, 5, &req)), SKV_OK);
}

/* sid, left as it was by a stopped request, and twin, which never had that request, take the
 * same 2-token APPEND and 64-token APPEND (from n tokens): the logits must be the same, bit
 * for bit. */
static void expect_as_twin(struct fixture *f, const uint8_t *sid, const uint8_t *twin, int n, const char *what)
{
    const int n_vocab = f->tiny->m->cfg.n_vocab;
    Snapkv__Reply *got[2];
    const uint8_t *pair[2] = {sid, twin};
    for (int j = 0; j < 2; j++) {
        assert_int_equal(append(f, pair[j], 2, NULL), SKV_OK);
        struct long_append full = {f, pair[j], 0, true};
        submit_long_append(&full);
        got[j] = next_reply(f, 0, ID_Y, 5);
        assert_int_equal(got[j]->status, SKV_OK);
        assert_int_equal(got[j]->append->n_tokens, n + 2 + 64);
        assert_int_equal(got[j]->append->n_logits, n_vocab);
    }
    if (memcmp(got[0]->append->logits, got[1]->append->logits, sizeof(float) * (size_t)n_vocab) != 0)
        fail_msg("%s: the logits differ from the twin's", what);
    snapkv__reply__free_unpacked(got[0], NULL);
    snapkv__reply__free_unpacked(got[1], NULL);
}

/* A running APPEND stops at its next layer once its deadline passes (not when its client's
 * connection closes: it runs on, as a gone client's queued one does), and its session is as it was: the engine undoes the rows it added when the session
 * keeps every row while decoding (no compressor, or snapkv without a decode_budget), and a
 * session whose upkeep evicts or re-scores rows (streaming, h2o, snapkv with a decode_budget)
 * ran it on a copy of its cache (its compressor backed up). Each then goes on exactly as a twin session
 * that never had the APPEND (the same logits, bit for bit, after the same next requests). */
static void test_append_stops(void **state)
{
    struct fixture *f = *state;
    const char *specs[] = {"policy=full", "policy=snapkv,budget=16,window=4", "policy=streaming,budget=16,sinks=2",
                           "policy=h2o,budget=16", "policy=snapkv,budget=16,window=4,decode_budget=24,interval=4"};
    enum { N_SPECS = sizeof specs / sizeof *specs };
    uint8_t sid[N_SPECS][16], twin[N_SPECS][16];
    for (int k = 0; k < N_SPECS; k++) {
        prefill(f, 8, specs[k], sid[k]);
        prefill(f, 8, specs[k], twin[k]);
    }
    for (int k = 0; k < N_SPECS; k++) {
        uint64_t bytes_before = 0, bytes = 0;
        assert_int_equal(listed(f, sid[k], &bytes_before, NULL), 8);
        struct long_append la = {f, sid[k], 400, false}; /* long enough to reach the gate */
        gate_hold(submit_long_append, &la);
        usleep(500000); /* past its 400 ms while it waits inside its first layer */
        gate_open();
        expect_reply(f, SKV_E_TIMEOUT, "the APPEND passed its deadline of 400 ms (the client's timeout) at layer 1");
        assert_int_equal(listed(f, sid[k], &bytes, NULL), 8);
        assert_int_equal(bytes, bytes_before);
        expect_as_twin(f, sid[k], twin[k], 8, specs[k]); /* it goes on from there, as its twin does */
    }
    assert_int_equal(stat(f, "snapkv_requests_past_deadline_total"), N_SPECS);
    /* its client gone (the last use of Y here): it runs to its end, as a gone client's queued
     * APPEND does, since another client may count on the session (before, one of 64 tokens or
     * more stopped at its first layer and a shorter one went in) */
    struct long_append la = {f, sid[2], 0, false};
    gate_hold(submit_long_append, &la);
    assert_int_equal(skv_worker_client_gone(f->w, ID_Y, sizeof ID_Y, true), SKV_OK);
    gate_open();
    expect_reply(f, SKV_OK, NULL);
    assert_int_equal(listed(f, sid[2], NULL, NULL), 74 + 64); /* all of its 64 tokens */
    assert_int_equal(stat(f, "snapkv_requests_dropped_on_disconnect_total"), 0);
}

/* A client-gone notice that waits behind a long forward ends its client's decode at the next
 * yield, not when the forward ends: X decodes a (streamed), Y's 64-token APPEND of b is held at
 * its layers' gate, 20 clients without a decode and then X's connection close, and after three
 * of the APPEND's yields X's final "cancelled" is out with the APPEND still held. Before, each
 * yield gave X's decode another round, tokens nobody read, and a stayed busy until the APPEND
 * ended (and with the first version of the change, which took the first 16 notices whatever
 * their clients, X's, the 21st, was never reached). */
static void test_gone_decode_in_yield(void **state)
{
    struct fixture *f = *state;
    restart_yielding_always(f);
    uint8_t a[16], b[16];
    prefill(f, 8, "policy=full", a);
    prefill(f, 8, "policy=full", b);
    submit_decode(f, ID_X, "t", a, 1000, true);
    Snapkv__Reply *rep = next_reply(f, 0, ID_X, 5);
    assert_int_equal(rep->status, SKV_OK);
    assert_false(rep->final);
    snapkv__reply__free_unpacked(rep, NULL);
    struct long_append la = {f, b, 0, false};
    gate_hold(submit_long_append, &la);
    for (int k = 0; k < 20; k++) { /* clients without a decode, gone first (a yield takes 16 notices) */
        const uint8_t id[5] = {9, 9, 9, 9, (uint8_t)k};
        assert_int_equal(skv_worker_client_gone(f->w, id, sizeof id, true), SKV_OK);
    }
    assert_int_equal(skv_worker_client_gone(f->w, ID_X, sizeof ID_X, true), SKV_OK);
    for (int i = 0; i < 3; i++)
        gate_step();
    for (;;) { /* the tokens streamed before, then the final */
        zmq_pollitem_t item = {.socket = f->pull, .events = ZMQ_POLLIN};
        if (zmq_poll(&item, 1, 10000) != 1) { /* none: the decode waits for the APPEND's end */
            gate_open();
            fail_msg("no final reply for the gone client's decode while the APPEND was held");
        }
        rep = next_reply(f, 0, ID_X, 5);
        assert_int_equal(rep->status, SKV_OK);
        bool final = rep->final;
        if (final)
            assert_string_equal(rep->decode->finish_reason, "cancelled");
        snapkv__reply__free_unpacked(rep, NULL);
        if (final)
            break;
    }
    gate_open();
    expect_reply(f, SKV_OK, NULL);
    assert_int_equal(stat(f, "snapkv_decodes_running"), 0);
}

/* Inside a long forward, the short requests it lets through go in fair order too: tenant u's 16
 * short requests (RELEASEs of sessions it does not have) queued before tenant v's DECODE, while
 * tenant t's 64-token APPEND is held at its layers' gate. v has had less of the engine than u
 * (a PREFILL of 8 tokens to u's 64, and a weight of 100), so its DECODE goes first: its first token comes at that
 * yield's decode round, before u's 8th reply. Before, the yields took them in the queue's
 * order, 8 a yield, and the DECODE began after all 16. */
static void test_overtake_fair(void **state)
{
    struct fixture *f = *state;
    /* t's and v's engine time counted a hundredth: u's is the most whatever the machine's noise
     * (the config written while the worker is stopped: its thread reads it) */
    skv_worker_stop(&f->w);
    assert_int_equal(skv_config_set(&f->cfg, "tenant-weights", "t:100,v:100"), SKV_OK);
    restart_yielding_always(f);
    uint8_t a[16], b[16], c[16], none[16] = {1, 2, 3};
    prefill_for(f, "v", 8, "policy=full", a);
    prefill_for(f, "u", 64, "policy=full", c); /* u has had more of the engine than v */
    prefill(f, 8, "policy=full", b);
    struct long_append la = {f, b, 0, false};
    gate_hold(submit_long_append, &la);
    static const uint8_t ID_U[5] = {0, 1, 2, 3, 0x55}, ID_V[5] = {0, 1, 2, 3, 0x56};
    for (int i = 0; i < 16; i++) {
        Snapkv__ReleaseRequest rr = SNAPKV__RELEASE_REQUEST__INIT;
        none[15] = (uint8_t)i;
        rr.session_id = (ProtobufCBinaryData){16, none};
        Snapkv__Request req = SNAPKV__REQUEST__INIT;
        req.command_case = SNAPKV__REQUEST__COMMAND_RELEASE;
        req.release = &rr;
        req.tenant = "u";
        assert_int_equal(skv_worker_submit(f->w, job_new(0, ID_U, 5, &req)), SKV_OK);
    }
    submit_decode(f, ID_V, "v", a, 4, true);
    gate_step();
    int u_before = 0;
    for (;;) {
        uint8_t id[5];
        Snapkv__Reply *rep = any_reply(f, id);
        snapkv__reply__free_unpacked(rep, NULL);
        uint8_t who = id[4];
        if (who == 0x56)
            break;
        assert_int_equal(who, 0x55);
        u_before++;
        if (u_before == 16)
            break;
    }
    gate_open();
    if (u_before >= 8)
        fail_msg("v's DECODE came after %d of u's short requests", u_before);
    for (int i = 0; i < 1000; i++) { /* the rest: u's, v's tokens, then Y's APPEND */
        uint8_t id[5];
        Snapkv__Reply *rep = any_reply(f, id);
        bool done = id[4] == ID_Y[4];
        snapkv__reply__free_unpacked(rep, NULL);
        if (done)
            break;
    }
    skv_worker_stop(&f->w);
    assert_int_equal(skv_config_set(&f->cfg, "tenant-weights", ""), SKV_OK);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
}

/* A stop asked while a long APPEND runs ends it at its next layer, not after its last: the
 * session is as it was (the stop's save writes its 8 tokens, the next start restores them), and
 * the worker's last message follows. Before, the stop waited for the whole forward, so a long
 * PREFILL on a CPU host plus the save could pass the unit's TimeoutStopSec. */
static void test_stop_ends_forward(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX";
    persist_on(f, dir, "0");
    uint8_t sid[16];
    prefill(f, 8, "policy=full", sid);
    struct long_append la = {f, sid, 0, false};
    gate_hold(submit_long_append, &la);
    skv_worker_request_stop(f->w);
    gate_open();
    char want[96];
    snprintf(want, sizeof want, "snapkvd is shutting down: the APPEND stopped at layer 1 of %d, the session as it "
             "was before it", f->tiny->m->cfg.n_layers);
    expect_reply(f, SKV_E_CANCELLED, want);
    zmq_msg_t part;
    zmq_msg_init(&part);
    assert_true(zmq_msg_recv(&part, f->pull, 0) >= 0);
    assert_int_equal(*(const uint8_t *)zmq_msg_data(&part), SKV_WORKER_DONE_SOCK);
    for (int i = 0; i < 2; i++)
        assert_true(zmq_msg_recv(&part, f->pull, 0) >= 0);
    zmq_msg_close(&part);
    restart(f);
    assert_int_equal(listed(f, sid, NULL, NULL), 8);
    /* asked once the last layer's attention runs: its work is done but for the logits, and it
     * ends as asked (a stop found at the last layer's hook threw it all away) */
    gate_hold(submit_long_append, &la);
    for (int k = 1; k < 2 * f->tiny->m->cfg.n_layers - 1; k++) /* to the last layer's first norm */
        gate_step();
    skv_worker_request_stop(f->w);
    gate_open();
    expect_reply(f, SKV_OK, NULL);
    zmq_msg_init(&part);
    assert_true(zmq_msg_recv(&part, f->pull, 0) >= 0);
    assert_int_equal(*(const uint8_t *)zmq_msg_data(&part), SKV_WORKER_DONE_SOCK);
    for (int i = 0; i < 2; i++)
        assert_true(zmq_msg_recv(&part, f->pull, 0) >= 0);
    zmq_msg_close(&part);
    restart(f);
    assert_int_equal(listed(f, sid, NULL, NULL), 8 + 64);
    persist_off(f, dir);
}

/* A COMPRESS by client Y of session sid that runs its tokens from the second on again (71 of
 * 72: a forward long enough to stop), with a deadline (0: none). */
struct long_compress {
    struct fixture *f;
    const uint8_t *sid;
    uint32_t deadline_ms;
};

static void submit_long_compress(void *arg)
{
    const struct long_compress *lc = arg;
    Snapkv__CompressSpec cs = SNAPKV__COMPRESS_SPEC__INIT;
    cs.spec = "policy=snapkv,budget=16,window=8";
    Snapkv__CompressRequest c = SNAPKV__COMPRESS_REQUEST__INIT;
    c.session_id = (ProtobufCBinaryData){16, (uint8_t *)lc->sid};
    c.compress = &cs;
    c.window_from = 1;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_COMPRESS;
    req.compress = &c;
    req.deadline_ms = lc->deadline_ms;
    assert_int_equal(skv_worker_submit(lc->f->w, job_new(0, ID_Y, 5, &req)), SKV_OK);
}

/* A COMPRESS's room is counted on the copy it runs on: with 72 rows per head (5 blocks) under
 * policy=full and a re-compression to 64 rows that runs the last 8 tokens again, the copy keeps
 * 4 shared blocks, the 8 tokens take a new one and the compaction gathers the 64 kept rows into
 * 4 fresh blocks while the old cache still holds its 5: the pool needs 5 more for a moment.
 * Counted on the session's own cache the forward "grew" into its last block: no room asked,
 * the idle session stayed and the pool passed its size (11 of 10 blocks per layer and head);
 * now the idle one is evicted first and the pool never holds more than 10. */
static void test_compress_room(void **state)
{
    struct fixture *f = *state;
    const uint64_t unit = restart_with_pool(f, 10);
    uint8_t idle[16], a[16];
    prefill_for(f, "v", 16, "policy=full", idle);
    prefill(f, 8, "policy=full", a);
    struct long_append la = {f, a, 0, false};
    submit_long_append(&la);
    expect_reply(f, SKV_OK, NULL);
    assert_int_equal(listed(f, a, NULL, NULL), 72);
    atomic_store(&g_pool_peak, 0);
    atomic_store(&g_track_pool, f->tiny->m->kv_pool);
    submit_compress(f, ID_Y, a, "policy=snapkv,budget=64,window=8");
    expect_reply(f, SKV_OK, NULL);
    atomic_store(&g_track_pool, NULL);
    uint64_t bytes = 0;
    assert_int_equal(listed(f, a, &bytes, NULL), 72); /* its tokens; its rows are 64 a head: */
    assert_int_equal(bytes, 4 * unit * skv_kv_pool_block_bytes(f->tiny->m->kv_pool));
    assert_int_equal(listed(f, idle, NULL, NULL), -1); /* evicted, for the copy's room */
    uint64_t peak = atomic_load(&g_pool_peak);
    if (peak > 10 * unit)
        fail_msg("the pool held %llu blocks, %llu per layer and head: more than its 10", (unsigned long long)peak,
                 (unsigned long long)(peak / unit));
}

/* Makes the directory `dir` (a mkdtemp template) the worker's state-dir, and restarts it. */
static void state_dir_new(struct fixture *f, char *dir)
{
    assert_non_null(mkdtemp(dir));
    assert_int_equal(skv_config_set(&f->cfg, "state-dir", dir), SKV_OK);
    restart(f);
}

/* Restarts the worker with max-prompt-tokens and max-new-tokens set (written while it is stopped:
 * the worker thread reads its config). */
static void restart_with_limits(struct fixture *f, int64_t max_prompt, int64_t max_new)
{
    skv_worker_stop(&f->w);
    f->cfg.max_prompt_tokens = max_prompt;
    f->cfg.max_new_tokens = max_new;
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
}

/* SAVE of sid as `name` by client X for tenant "t"; the reply's status. */
static int save_as(struct fixture *f, const uint8_t sid[16], const char *name)
{
    Snapkv__SaveRequest sq = SNAPKV__SAVE_REQUEST__INIT;
    sq.session_id = (ProtobufCBinaryData){16, (uint8_t *)sid};
    sq.name = (char *)name;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_SAVE;
    req.save = &sq;
    req.tenant = "t";
    Snapkv__Reply *rep = call(f, 0, ID_X, &req);
    int status = rep->status;
    snapkv__reply__free_unpacked(rep, NULL);
    return status;
}

/* LOAD of `name` for tenant "t": the reply. */
static Snapkv__Reply *load_reply(struct fixture *f, const char *name)
{
    Snapkv__LoadRequest lq = SNAPKV__LOAD_REQUEST__INIT;
    lq.name = (char *)name;
    lq.tenant = "t";
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_LOAD;
    req.load = &lq;
    req.tenant = "t";
    return call(f, 0, ID_X, &req);
}

/* LOAD of `name` for tenant "t"; the reply's status, and the new session's id in sid. */
static int load_as(struct fixture *f, const char *name, uint8_t sid[16])
{
    Snapkv__Reply *rep = load_reply(f, name);
    int status = rep->status;
    if (!status)
        memcpy(sid, rep->load->session_id.data, 16);
    snapkv__reply__free_unpacked(rep, NULL);
    return status;
}

/* A LOAD makes its room before it takes a block: with the pool full (two sessions of 4 blocks
 * per layer and head in a pool of 8), loading a third evicts the least recently used and the
 * pool never holds more than 8 (it held 12 before the charge after the load evicted one). One
 * that could not fit even with every candidate gone is refused and evicts nothing. */
static void test_load_room(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-load-XXXXXX", cmd[300];
    assert_non_null(mkdtemp(dir));
    assert_int_equal(skv_config_set(&f->cfg, "state-dir", dir), SKV_OK);
    const uint64_t unit = restart_with_pool(f, 8);
    uint8_t a[16], b[16], c[16], d[16];
    prefill_for(f, "t", 64, "policy=full", a);
    assert_int_equal(save_as(f, a, "room"), SKV_OK);
    prefill_for(f, "t", 64, "policy=full", b);
    atomic_store(&g_pool_peak, 0);
    atomic_store(&g_track_pool, f->tiny->m->kv_pool);
    assert_int_equal(load_as(f, "room", c), SKV_OK);
    atomic_store(&g_track_pool, NULL);
    uint64_t peak = atomic_load(&g_pool_peak);
    if (peak > 8 * unit)
        fail_msg("the pool held %llu blocks, %llu per layer and head: more than its 8", (unsigned long long)peak,
                 (unsigned long long)(peak / unit));
    assert_int_equal(listed(f, a, NULL, NULL), -1); /* the least recently used, evicted */
    assert_int_equal(listed(f, b, NULL, NULL), 64);
    assert_int_equal(listed(f, c, NULL, NULL), 64);
    /* a file refused before its rows (a spec this daemon does not know: a newer daemon's)
     * evicts nothing for its room: the room is made once all but the rows is read and checked */
    char path[300];
    snprintf(path, sizeof path, "%s/room.skv", dir);
    FILE *fp = fopen(path, "r+b");
    assert_non_null(fp);
    assert_int_equal(fseek(fp, 101, SEEK_SET), 0); /* struct save_header's spec */
    assert_int_equal(fwrite("policy=bogus", 1, 13, fp), 13);
    assert_int_equal(fclose(fp), 0);
    uint64_t ev0 = (uint64_t)stat(f, "snapkv_evictions_total");
    assert_int_equal(load_as(f, "room", d), SKV_E_VERSION);
    assert_int_equal((uint64_t)stat(f, "snapkv_evictions_total"), ev0);
    assert_int_equal(listed(f, b, NULL, NULL), 64);
    assert_int_equal(listed(f, c, NULL, NULL), 64);
    /* nor one whose last V row holds a NaN, nor one whose checksum is off (the last bytes
     * before the 48-byte trailer): the whole file is read and checked before the room is made
     * (before, such a file had evicted b for a load that then failed) */
    for (int k = 0; k < 2; k++) {
        assert_int_equal(save_as(f, b, "room"), SKV_OK);
        fp = fopen(path, "r+b");
        assert_non_null(fp);
        assert_int_equal(fseek(fp, 0, SEEK_END), 0);
        const long size = ftell(fp);
        const float nan_row = NAN;
        unsigned char flipped = 0;
        assert_int_equal(fseek(fp, size - 48 - 32, SEEK_SET), 0);
        assert_int_equal(fread(&flipped, 1, 1, fp), 1);
        flipped ^= 0xff;
        assert_int_equal(fseek(fp, k ? size - 48 - 32 : size - 48 - 32 - 4, SEEK_SET), 0);
        assert_int_equal(k ? fwrite(&flipped, 1, 1, fp) : fwrite(&nan_row, 4, 1, fp), 1);
        assert_int_equal(fclose(fp), 0);
        assert_int_equal(load_as(f, "room", d), SKV_E_FORMAT);
        assert_int_equal((uint64_t)stat(f, "snapkv_evictions_total"), ev0);
        assert_int_equal(listed(f, b, NULL, NULL), 64);
        assert_int_equal(listed(f, c, NULL, NULL), 64);
    }
    /* nor one whose compressor state does not fit its spec (checksum whole): a snapkv spec over
     * policy=full's empty state, refused before the room is made (it was after the rows) */
    assert_int_equal(save_as(f, b, "room"), SKV_OK);
    char spec[256] = "policy=snapkv,budget=16";
    rewrite_saved(path, 101, spec, sizeof spec);
    assert_int_equal(load_as(f, "room", d), SKV_E_FORMAT);
    assert_int_equal((uint64_t)stat(f, "snapkv_evictions_total"), ev0);
    assert_int_equal(listed(f, b, NULL, NULL), 64);
    assert_int_equal(listed(f, c, NULL, NULL), 64);
    assert_int_equal(save_as(f, b, "room"), SKV_OK); /* (the file again, for what follows) */
    /* 4 blocks a layer and head in a pool of 3 (a restart: no session): refused before any
     * block is taken, and the session there kept */
    restart_with_pool(f, 3);
    atomic_store(&g_pool_peak, 0);
    atomic_store(&g_track_pool, f->tiny->m->kv_pool);
    prefill_for(f, "t", 16, "policy=full", d);
    uint8_t e[16];
    assert_int_equal(load_as(f, "room", e), SKV_E_POOL_FULL);
    atomic_store(&g_track_pool, NULL);
    assert_true(atomic_load(&g_pool_peak) <= 3 * unit);
    assert_int_equal(listed(f, d, NULL, NULL), 16);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

/* Rewrites n bytes at `at` of the saved session at path and its checksum after them (the 32
 * bytes before the 48-byte trailer), as a daemon that wrote those bytes would have. */
static void rewrite_saved(const char *path, long at, const void *bytes, size_t n)
{
    FILE *fp = fopen(path, "r+b");
    assert_non_null(fp);
    assert_int_equal(fseek(fp, 0, SEEK_END), 0);
    const long size = ftell(fp), body = size - 48 - 32;
    assert_true(at >= 0 && at + (long)n <= body);
    unsigned char *file = malloc((size_t)size);
    assert_non_null(file);
    assert_int_equal(fseek(fp, 0, SEEK_SET), 0);
    assert_int_equal(fread(file, 1, (size_t)size, fp), (size_t)size);
    memcpy(file + at, bytes, n);
    crypto_generichash(file + body, 32, file, (size_t)body, NULL, 0);
    assert_int_equal(fseek(fp, 0, SEEK_SET), 0);
    assert_int_equal(fwrite(file, 1, (size_t)size, fp), (size_t)size);
    assert_int_equal(fclose(fp), 0);
    free(file);
}

/* Writes the 64 hex digits fp at `at` of the file at path (a block store's header). */
static void rewrite_at(const char *path, long at, const char *fp)
{
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    assert_int_equal(fseek(f, at, SEEK_SET), 0);
    assert_int_equal(fwrite(fp, 1, 64, f), 64);
    assert_int_equal(fclose(f), 0);
}

/* A GGUF model's fingerprint covers its config since the forty-fifth session; what an earlier
 * daemon wrote under the legacy one (the tensors only) still loads: a SAVE file, and a persist
 * block store at a restart. Another fingerprint is refused (the file), set aside (the store's
 * sessions). The tiny model is an HF folder (both fingerprints one): its legacy one is set
 * apart here, as a GGUF model's is. */
static void test_load_legacy_fingerprint(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-legacy-XXXXXX", pdir[] = "/tmp/skv-legacy-persist-XXXXXX", cmd[300], path[512];
    assert_non_null(mkdtemp(dir));
    assert_int_equal(skv_config_set(&f->cfg, "state-dir", dir), SKV_OK);
    struct skv_model *m = f->tiny->m;
    char fp[65];
    memcpy(fp, m->fingerprint, sizeof fp);
    assert_string_equal(m->legacy_fingerprint, fp);
    snprintf(m->legacy_fingerprint, sizeof m->legacy_fingerprint, "%064d", 7);
    const char other[] = "0000000000000000000000000000000000000000000000000000000000000008";
    restart(f);
    uint8_t a[16], b[16];
    prefill_for(f, "t", 16, "policy=full", a);
    assert_int_equal(save_as(f, a, "legacy"), SKV_OK);
    snprintf(path, sizeof path, "%s/legacy.skv", dir);
    rewrite_saved(path, 36, m->legacy_fingerprint, 64); /* struct save_header's fingerprint */
    assert_int_equal(load_as(f, "legacy", b), SKV_OK);
    assert_int_equal(listed(f, b, NULL, NULL), 16);
    rewrite_saved(path, 36, other, 64);
    assert_int_equal(load_as(f, "legacy", b), SKV_E_INVAL);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);

    persist_on(f, pdir, "0");
    prefill_for(f, "t", 40, "policy=full", a);
    skv_worker_stop(&f->w); /* saved */
    char store[512], ppath[300];
    snprintf(ppath, sizeof ppath, "%s/persist", pdir);
    only_match(ppath, "blocks-*.skvb", store, sizeof store);
    rewrite_at(store, 32, m->legacy_fingerprint); /* struct store_header's fingerprint */
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, m, &f->w), SKV_OK);
    assert_int_equal(listed(f, a, NULL, NULL), 40);
    skv_worker_stop(&f->w);
    only_match(ppath, "blocks-*.skvb", store, sizeof store);
    rewrite_at(store, 32, other);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, m, &f->w), SKV_OK);
    assert_int_equal(listed(f, a, NULL, NULL), -1); /* its blocks are another model's */
    memcpy(m->legacy_fingerprint, fp, sizeof fp);
    persist_off(f, pdir);
}

/* One DECODE token in session sid of tenant "t"; its status. */
static int decode_t(struct fixture *f, const uint8_t sid[16])
{
    Snapkv__Reply *rep = decode_call(f, "t", sid, 1);
    int rc = rep->status;
    snapkv__reply__free_unpacked(rep, NULL);
    return rc;
}

/* A SnapKV session re-scoring while decoding (decode_budget, every second token) SAVEd right
 * after a DECODE step failed, then LOADed: its next steps keep the rows of a twin that neither
 * failed nor was saved (before, the save held no observation, since the failed step's was only
 * rolled back by the next step, and the loaded session re-scored on another schedule). */
static void test_saved_after_failed_step(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-obs-XXXXXX", cmd[300];
    state_dir_new(f, dir);
    const char *spec = "policy=snapkv,budget=16,window=4,decode_budget=16,interval=2";
    uint8_t a[16], twin[16], b[16];
    prefill_for(f, "t", 16, spec, a);
    prefill_for(f, "t", 16, spec, twin);
    assert_int_equal(decode_t(f, a), SKV_OK);
    long c0 = atomic_load(&g_rmsnorm_calls);
    assert_int_equal(decode_t(f, twin), SKV_OK);
    long per_forward = atomic_load(&g_rmsnorm_calls) - c0;
    atomic_store(&g_fail_rmsnorm_at, atomic_load(&g_rmsnorm_calls) + per_forward); /* the final norm */
    assert_int_equal(decode_t(f, a), SKV_E_DEVICE);
    atomic_store(&g_fail_rmsnorm_at, 0);
    assert_int_equal(save_as(f, a, "obs"), SKV_OK);
    assert_int_equal(load_as(f, "obs", b), SKV_OK);
    for (int step = 0; step < 4; step++) {
        assert_int_equal(decode_t(f, twin), SKV_OK);
        assert_int_equal(decode_t(f, b), SKV_OK);
        size_t n0, n1;
        uint32_t *p0 = inspect_positions(f, twin, &n0), *p1 = inspect_positions(f, b, &n1);
        if (n1 != n0 || memcmp(p1, p0, n0 * sizeof *p0) != 0)
            fail_msg("step %d after the LOAD: %zu positions, the twin's %zu, or other ones", step, n1, n0);
        free(p0);
        free(p1);
    }
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

/* A saved spec with a key its policy does not read (a daemon before that check took
 * `policy=h2o,kernel=9` and wrote it into SAVE files and checkpoints) still loads, under that
 * spec; a client's spec with it is refused. */
static void test_load_saved_spec(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-spec-XXXXXX", cmd[300], path[300];
    state_dir_new(f, dir);
    uint8_t a[16], b[16];
    prefill_for(f, "t", 24, "policy=h2o,budget=16", a);
    assert_int_equal(save_as(f, a, "old"), SKV_OK);
    /* the header's spec as such a daemon wrote it, and the checksum over the file again */
    snprintf(path, sizeof path, "%s/old.skv", dir);
    char spec[256];
    FILE *fp = fopen(path, "rb");
    assert_non_null(fp);
    assert_int_equal(fseek(fp, 101, SEEK_SET), 0); /* struct save_header's spec */
    assert_int_equal(fread(spec, 1, sizeof spec, fp), sizeof spec);
    assert_int_equal(fclose(fp), 0);
    char *k = memmem(spec, sizeof spec, "kernel=7,", 9);
    assert_non_null(k);
    k[7] = '9';
    rewrite_saved(path, 101, spec, sizeof spec);
    assert_int_equal(load_as(f, "old", b), SKV_OK);
    assert_int_equal(listed(f, b, NULL, NULL), 24);
    Snapkv__Reply *rep = prefill_reply(f, "t", 8, "policy=h2o,budget=16,kernel=9", 0);
    assert_int_equal(rep->status, SKV_E_INVAL);
    assert_non_null(strstr(rep->message, "kernel does nothing with policy=h2o"));
    snapkv__reply__free_unpacked(rep, NULL);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

/* A COMPRESS runs on a copy of its session's cache that shares every block, so one stopped
 * part way (its deadline passed) leaves the session exactly as it was: its
 * rows, bytes and spec, and the next requests give the logits of a twin that never had the
 * COMPRESS, bit for bit. One that runs to its end replaces the cache. */
static void test_compress_stops(void **state)
{
    struct fixture *f = *state;
    uint8_t a[16], twin[16];
    const uint8_t *pair[2] = {a, twin};
    for (int j = 0; j < 2; j++) {
        prefill(f, 8, "policy=full", (uint8_t *)pair[j]);
        struct long_append la = {f, pair[j], 0, false};
        submit_long_append(&la);
        expect_reply(f, SKV_OK, NULL);
    }
    uint64_t bytes_before = 0, bytes = 0;
    assert_int_equal(listed(f, a, &bytes_before, NULL), 72);

    struct long_compress lc = {f, a, 400};
    gate_hold(submit_long_compress, &lc);
    usleep(500000); /* past its 400 ms while it waits inside its first layer */
    gate_open();
    expect_reply(f, SKV_E_TIMEOUT, "the COMPRESS passed its deadline of 400 ms (the client's timeout) at layer 1");
    assert_int_equal(listed(f, a, &bytes, NULL), 72);
    assert_int_equal(bytes, bytes_before);
    assert_int_equal(stat(f, "snapkv_requests_past_deadline_total"), 1);
    /* under policy=full still: every row kept, so equal logits mean equal rows */
    expect_as_twin(f, a, twin, 72, "COMPRESS");
    assert_int_equal(listed(f, a, &bytes, NULL), 138);
    assert_int_equal(listed(f, twin, &bytes_before, NULL), 138);
    assert_int_equal(bytes, bytes_before);

    /* run to its end: the session holds its compressed cache */
    lc = (struct long_compress){f, twin, 0};
    submit_long_compress(&lc);
    expect_reply(f, SKV_OK, NULL);
    assert_int_equal(listed(f, twin, &bytes, NULL), 138);
    assert_true(bytes < bytes_before);

    /* its client gone (the last use of Y here): it runs to its end, as a gone client's queued
     * COMPRESS does (another client may count on the session; before, it stopped) */
    lc = (struct long_compress){f, a, 0};
    gate_hold(submit_long_compress, &lc);
    assert_int_equal(skv_worker_client_gone(f->w, ID_Y, sizeof ID_Y, true), SKV_OK);
    gate_open();
    expect_reply(f, SKV_OK, NULL);
    uint64_t compressed = 0;
    assert_int_equal(listed(f, a, &compressed, NULL), 138);
    assert_int_equal(listed(f, twin, &bytes, NULL), 138);
    assert_int_equal(compressed, bytes); /* as its twin's, compressed to its end */
    assert_int_equal(stat(f, "snapkv_requests_dropped_on_disconnect_total"), 0);
}

/* Restarts the worker (a stop saves when persist is on; a start restores). */
static void restart(struct fixture *f)
{
    skv_worker_stop(&f->w);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
}

/* Whether the persist manifest in dir names session sid first (the first session saved). */
static bool saved_first(const char *dir, const uint8_t sid[16])
{
    char path[256], text[4096] = {0};
    snprintf(path, sizeof path, "%s/persist/sessions.json", dir);
    FILE *fp = fopen(path, "r");
    assert_non_null(fp);
    assert_true(fread(text, 1, sizeof text - 1, fp) > 0);
    fclose(fp);
    const char *id = strstr(text, "\"id\":\"");
    assert_non_null(id);
    char hex[33];
    for (int i = 0; i < 16; i++)
        snprintf(hex + 2 * i, 3, "%02x", sid[i]);
    return strncmp(id + 6, hex, 32) == 0;
}

/* The one file of dir matching pattern (a glob) into path. */
static void only_match(const char *dir, const char *pattern, char *path, size_t cap)
{
    char pat[512];
    snprintf(pat, sizeof pat, "%s/%s", dir, pattern);
    glob_t g;
    assert_int_equal(glob(pat, 0, NULL, &g), 0);
    assert_int_equal(g.gl_pathc, 1);
    snprintf(path, cap, "%s", g.gl_pathv[0]);
    globfree(&g);
}

static long file_size(const char *path)
{
    FILE *fp = fopen(path, "rb");
    assert_non_null(fp);
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fclose(fp);
    return n;
}

/* Flips a byte in the middle of a file. */
static void corrupt(const char *path)
{
    FILE *fp = fopen(path, "r+b");
    assert_non_null(fp);
    fseek(fp, 0, SEEK_END);
    long mid = ftell(fp) / 2;
    fseek(fp, mid, SEEK_SET);
    int ch = fgetc(fp);
    fseek(fp, mid, SEEK_SET);
    fputc(ch ^ 0x5a, fp);
    fclose(fp);
}

/* Restarts the worker with persist on, its state in dir (made here), checkpoints every
 * `interval` seconds (0: none). */
static void persist_on(struct fixture *f, char *dir, const char *interval)
{
    assert_non_null(mkdtemp(dir));
    skv_worker_stop(&f->w); /* the worker reads its config */
    assert_int_equal(skv_config_set(&f->cfg, "state-dir", dir), SKV_OK);
    assert_int_equal(skv_config_set(&f->cfg, "persist", "yes"), SKV_OK);
    assert_int_equal(skv_config_set(&f->cfg, "persist-interval-seconds", interval), SKV_OK);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
}

/* Restarts the worker with persist off and removes dir. */
static void persist_off(struct fixture *f, const char *dir)
{
    char cmd[300];
    skv_worker_stop(&f->w);
    assert_int_equal(skv_config_set(&f->cfg, "persist", "no"), SKV_OK);
    assert_int_equal(skv_config_set(&f->cfg, "persist-interval-seconds", "0"), SKV_OK);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

/* persist = yes through the real worker: a stop saves every session and a start brings them
 * back under their ids; a file that fails its checksum costs that session only, a manifest
 * that is not JSON restores nothing, and either way the directory is emptied. */
static void test_persist(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX", path[256], cmd[300];
    persist_on(f, dir, "0");
    uint8_t a[16], b[16];
    prefill_for(f, "t", 40, "policy=snapkv,budget=16,window=8", a);
    usleep(5000); /* b used after a, in another millisecond */
    prefill_for(f, "u", 8, "policy=full", b);
    /* the manifest lists the save's order: the most recently used first, b */
    skv_worker_stop(&f->w);
    assert_true(saved_first(dir, b));
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    /* and a pinned session before any other: a, although b was used more recently (a restart
     * keeps how long each had been idle) */
    Snapkv__PinRequest pq = SNAPKV__PIN_REQUEST__INIT;
    pq.session_id = (ProtobufCBinaryData){16, a};
    pq.pin = true;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_PIN;
    req.pin = &pq;
    snapkv__reply__free_unpacked(admin_call(f, &req), NULL);
    skv_worker_stop(&f->w);
    assert_true(saved_first(dir, a));
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    restart(f);
    int n = 0;
    assert_int_equal(listed(f, a, NULL, &n), 40);
    assert_int_equal(listed(f, b, NULL, NULL), 8);
    assert_int_equal(n, 2);
    assert_int_equal(append(f, a, 2, NULL), SKV_OK); /* it goes on */

    /* a's full blocks (16 rows a head) are in the block store, b's 8 rows in its file: a block
     * damaged in the store costs a alone */
    skv_worker_stop(&f->w);
    snprintf(cmd, sizeof cmd, "%s/persist", dir);
    only_match(cmd, "blocks-*.skvb", path, sizeof path);
    FILE *fp = fopen(path, "rb");
    assert_non_null(fp);
    fseek(fp, 0, SEEK_END);
    const struct skv_model_config *mc = &f->tiny->m->cfg;
    const long block = 2L * 16 * mc->head_dim * 4 + 16;
    assert_int_equal(ftell(fp), 96 + (long)mc->n_layers * mc->n_kv_heads * block);
    fclose(fp);
    corrupt(path);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    assert_int_equal(listed(f, a, NULL, &n), -1);
    assert_int_equal(listed(f, b, NULL, NULL), 8);
    assert_int_equal(n, 1);
    assert_int_equal(access(path, F_OK), -1);
    prefill_for(f, "t", 40, "policy=snapkv,budget=16,window=8", a);

    /* a's file corrupted between the stop and the start: b alone comes back */
    skv_worker_stop(&f->w);
    char hex[33];
    for (int i = 0; i < 16; i++)
        snprintf(hex + 2 * i, 3, "%02x", a[i]);
    char pattern[64];
    snprintf(cmd, sizeof cmd, "%s/persist", dir);
    snprintf(pattern, sizeof pattern, "%s-*.skv", hex);
    only_match(cmd, pattern, path, sizeof path);
    corrupt(path);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    assert_int_equal(listed(f, a, NULL, &n), -1);
    assert_int_equal(listed(f, b, NULL, NULL), 8);
    assert_int_equal(n, 1);
    assert_int_equal(access(path, F_OK), -1);
    /* the saved state is kept aside, a's file with it, in a second set: the first start's
     * (the damaged block) is kept too */
    snprintf(cmd, sizeof cmd, "%s/persist.unrestored.2", dir);
    only_match(cmd, pattern, path, sizeof path);
    snprintf(path, sizeof path, "%s/persist.unrestored/sessions.json", dir);
    assert_int_equal(access(path, F_OK), 0);

    /* a manifest that is not JSON: nothing restored, nothing left but the copy aside */
    skv_worker_stop(&f->w);
    snprintf(path, sizeof path, "%s/persist/sessions.json", dir);
    fp = fopen(path, "w");
    assert_non_null(fp);
    fputs("{not json", fp);
    fclose(fp);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    assert_int_equal(listed(f, b, NULL, &n), -1);
    assert_int_equal(n, 0);
    assert_int_equal(access(path, F_OK), -1);
    snprintf(path, sizeof path, "%s/persist.unrestored.3/sessions.json", dir);
    fp = fopen(path, "r");
    assert_non_null(fp);
    char text[16] = {0};
    assert_true(fread(text, 1, sizeof text - 1, fp) > 0);
    fclose(fp);
    assert_string_equal(text, "{not json"); /* a third set; the earlier two are kept */
    snprintf(path, sizeof path, "%s/persist.unrestored.2/sessions.json", dir);
    assert_int_equal(access(path, F_OK), 0);
    persist_off(f, dir);
}

/* kv-type f16 through the worker: a session holds half the bytes of its f32 twin; a restart
 * with persist brings it back (the block store holds rows as f32, exactly the f16 values), and it
 * decodes what a session prefilled after the restart decodes, token for token. */
static void test_kv_f16_persist(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-kvf16-XXXXXX";
    uint8_t a32[16], a[16], c[16];
    uint64_t bytes32 = 0, bytes16 = 0;
    prefill_for(f, "t", 40, "policy=full", a32);
    assert_int_equal(listed(f, a32, &bytes32, NULL), 40);
    skv_worker_stop(&f->w);
    assert_int_equal(skv_model_set_kv_pool(f->tiny->m, SKV_KV_BLOCK_ROWS, SKV_DTYPE_F16), SKV_OK);
    persist_on(f, dir, "0");
    /* the reply's figures in f16 rows: 48 rows a head (3 blocks), before and after alike */
    Snapkv__Reply *rep = prefill_reply(f, "t", 48, "policy=full", 0);
    assert_int_equal(rep->status, SKV_OK);
    const struct skv_model_config *mc = &f->tiny->m->cfg;
    assert_int_equal(rep->prefill->bytes_before, (uint64_t)48 * mc->n_layers * mc->n_kv_heads * 2 * mc->head_dim * 2);
    assert_int_equal(rep->prefill->bytes_after, rep->prefill->bytes_before);
    assert_int_equal(rep->prefill->kept[0]->bytes, (uint64_t)48 * mc->n_kv_heads * 2 * mc->head_dim * 2);
    snapkv__reply__free_unpacked(rep, NULL);
    /* a prompt shorter than a block: a full cache's bytes are its blocks too (before, the rows
     * alone: kept "1600%" of them) */
    rep = prefill_reply(f, "t", 1, "policy=full", 0);
    assert_int_equal(rep->status, SKV_OK);
    assert_int_equal(rep->prefill->bytes_before, (uint64_t)16 * mc->n_layers * mc->n_kv_heads * 2 * mc->head_dim * 2);
    assert_int_equal(rep->prefill->bytes_after, rep->prefill->bytes_before);
    snapkv__reply__free_unpacked(rep, NULL);
    prefill_for(f, "t", 40, "policy=full", a);
    assert_int_equal(listed(f, a, &bytes16, NULL), 40);
    assert_true(bytes16 > 0);
    assert_int_equal(bytes16 * 2, bytes32);
    restart(f);
    assert_int_equal(listed(f, a, NULL, NULL), 40);
    prefill_for(f, "t", 40, "policy=full", c);
    uint32_t ta[12], tc[12];
    int na = 0, nc = 0;
    submit_decode(f, ID_X, "t", a, 12, false);
    rep = decode_final(f, ID_X, ta, &na, 12);
    assert_int_equal(rep->status, SKV_OK);
    snapkv__reply__free_unpacked(rep, NULL);
    submit_decode(f, ID_X, "t", c, 12, false);
    rep = decode_final(f, ID_X, tc, &nc, 12);
    assert_int_equal(rep->status, SKV_OK);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(na, 12);
    assert_int_equal(nc, 12);
    assert_memory_equal(ta, tc, sizeof ta);
    persist_off(f, dir);
}

/* A start that cannot restore every session (here: max-sessions-per-tenant lowered below what
 * was saved) keeps the saved state in persist.unrestored, and moved back it restores all of it
 * once the limit is back (before, the files of the sessions not restored were removed). */
static void test_persist_set_aside(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX", cmd[700];
    persist_on(f, dir, "60");
    uint8_t a[16], b[16];
    prefill(f, 40, "policy=full", a);
    usleep(5000);
    prefill(f, 8, "policy=full", b);
    skv_worker_stop(&f->w);
    assert_int_equal(skv_config_set(&f->cfg, "max-sessions-per-tenant", "1"), SKV_OK);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    int n = 0;
    assert_int_equal(listed(f, b, NULL, &n), 8); /* the most recently used is what the limit keeps */
    assert_int_equal(n, 1);
    assert_int_equal(listed(f, a, NULL, NULL), -1);
    skv_worker_stop(&f->w); /* saves b alone */
    assert_int_equal(skv_config_set(&f->cfg, "max-sessions-per-tenant", "64"), SKV_OK);
    snprintf(cmd, sizeof cmd, "rm -r %s/persist && mv %s/persist.unrestored %s/persist", dir, dir, dir);
    assert_int_equal(system(cmd), 0);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    assert_int_equal(listed(f, a, NULL, &n), 40);
    assert_int_equal(listed(f, b, NULL, NULL), 8);
    assert_int_equal(n, 2);
    snprintf(cmd, sizeof cmd, "%s/persist.unrestored", dir);
    assert_int_equal(access(cmd, F_OK), -1); /* all came back: nothing set aside */

    /* a FIFO in place of b's file (and a link in place of the manifest's copy aside) costs b
     * alone: the start does not wait on it */
    skv_worker_stop(&f->w);
    char hex[33], pattern[64], path[256];
    for (int i = 0; i < 16; i++)
        snprintf(hex + 2 * i, 3, "%02x", b[i]);
    snprintf(cmd, sizeof cmd, "%s/persist", dir);
    snprintf(pattern, sizeof pattern, "%s-*.skv", hex);
    only_match(cmd, pattern, path, sizeof path);
    snprintf(cmd, sizeof cmd, "rm %s && mkfifo -m 600 %s", path, path);
    assert_int_equal(system(cmd), 0);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    assert_int_equal(listed(f, a, NULL, &n), 40);
    assert_int_equal(listed(f, b, NULL, NULL), -1);
    assert_int_equal(n, 1);
    persist_off(f, dir);
}

/* A manifest of another version (a newer daemon's, met in a downgrade), or one without its
 * list of sessions, is set aside as one that does not parse, with the files it names, and
 * restores nothing. Before, it parsed as a save of no session, and the start swept every file:
 * moved back under the daemon that wrote it, nothing was left to restore. */
static void test_persist_other_version(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX", path[256], hex[33], pattern[64];
    persist_on(f, dir, "60");
    uint8_t a[16];
    prefill(f, 40, "policy=full", a);
    skv_worker_stop(&f->w); /* saves a */
    snprintf(path, sizeof path, "%s/persist/sessions.json", dir);
    FILE *m = fopen(path, "w");
    assert_non_null(m);
    assert_true(fputs("{\"version\": 2, \"sessions\": {\"new\": \"layout\"}}", m) >= 0);
    assert_int_equal(fclose(m), 0);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    assert_int_equal(listed(f, a, NULL, NULL), -1);
    snprintf(path, sizeof path, "%s/persist.unrestored/sessions.json", dir);
    assert_int_equal(access(path, F_OK), 0);
    for (int i = 0; i < 16; i++)
        snprintf(hex + 2 * i, 3, "%02x", a[i]);
    snprintf(path, sizeof path, "%s/persist.unrestored", dir);
    snprintf(pattern, sizeof pattern, "%s-*.skv", hex);
    char file[256];
    only_match(path, pattern, file, sizeof file); /* a's file, kept */
    persist_off(f, dir);
}

/* A restart with max-sessions below what was saved (two tenants' sessions, one allowed): the
 * most recently used comes back (before, the restore, least recently used first, kept the
 * oldest and refused the newest); the other's file is set aside. */
static void test_persist_max_sessions(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX", path[256];
    persist_on(f, dir, "60");
    uint8_t a[16], b[16];
    prefill_for(f, "t", 40, "policy=full", a);
    usleep(5000);
    prefill_for(f, "u", 8, "policy=full", b);
    skv_worker_stop(&f->w);
    f->cfg.max_sessions = 1;
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    int n = 0;
    assert_int_equal(listed(f, b, NULL, &n), 8);
    assert_int_equal(n, 1);
    assert_int_equal(listed(f, a, NULL, NULL), -1);
    snprintf(path, sizeof path, "%s/persist.unrestored/sessions.json", dir);
    assert_int_equal(access(path, F_OK), 0);
    persist_off(f, dir);
}

/* A restart with a pool that holds less than was saved: the least recently used sessions go,
 * and only as many as the room needs. The blocks a restore reads stay in its block store only
 * as long as a session holds them: an evicted session's blocks leave the pool with it, so
 * that one eviction is enough for the next session (before, the store kept every block it
 * had given a session, each eviction freed nothing, and the restore evicted every session it
 * had restored and then failed the rest). */
static void test_persist_smaller_pool(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX";
    const int64_t pool_size = f->cfg.pool_size;
    for (int interval = 0; interval <= 1; interval++) {
        persist_on(f, dir, interval ? "3600" : "0");
        uint8_t sid[4][16];
        uint64_t bytes = 0;
        for (int i = 0; i < 4; i++) {
            char tenant[8];
            snprintf(tenant, sizeof tenant, "t%d", i); /* tenants of their own: no block shared */
            prefill_for(f, tenant, 48, "policy=full", sid[i]);
            usleep(5000); /* used one after the other, in different milliseconds */
        }
        assert_int_equal(listed(f, sid[0], &bytes, NULL), 48);
        assert_true(bytes > 0);
        skv_worker_stop(&f->w);
        f->cfg.pool_size = (int64_t)(bytes * 5 / 2); /* room for two and a half */
        assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
        int n = 0;
        assert_int_equal(listed(f, sid[3], NULL, &n), 48);
        assert_int_equal(listed(f, sid[2], NULL, NULL), 48);
        assert_int_equal(n, 2);
        skv_worker_stop(&f->w); /* the worker reads its config */
        f->cfg.pool_size = pool_size;
        assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
        persist_off(f, dir);
        memcpy(dir + strlen(dir) - 6, "XXXXXX", 6);
    }
}

/* Whether the manifest on disk in dir names session sid. */
/* The manifest's text (it is renamed into place whole), in buf. */
static const char *manifest_text(const char *dir, char *buf, size_t cap)
{
    char path[256];
    snprintf(path, sizeof path, "%s/persist/sessions.json", dir);
    FILE *fp = fopen(path, "r");
    assert_non_null(fp);
    size_t n = fread(buf, 1, cap - 1, fp);
    assert_true(n > 0);
    buf[n] = '\0';
    fclose(fp);
    return buf;
}

static bool manifest_names(const char *dir, const uint8_t sid[16])
{
    char text[8192], hex[33];
    manifest_text(dir, text, sizeof text);
    for (int i = 0; i < 16; i++)
        snprintf(hex + 2 * i, 3, "%02x", sid[i]);
    return strstr(text, hex) != NULL;
}

/* APPENDs 16 tokens to tenant t's session sid, then waits for the worker's n-th checkpoint. */
static void append_then_checkpoint(struct fixture *f, const uint8_t sid[16], int n)
{
    submit_append_for(f, ID_X, "t", sid, 16);
    Snapkv__Reply *rep = next_reply(f, 0, ID_X, 5);
    assert_int_equal(rep->status, SKV_OK);
    snapkv__reply__free_unpacked(rep, NULL);
    for (int i = 0; i < 300 && stat(f, "snapkv_persist_checkpoints_total") < n; i++)
        usleep(100000);
    assert_int_equal(stat(f, "snapkv_persist_checkpoints_total"), n);
}

/* persist-interval-seconds: once sessions changed and the interval passed, the idle worker
 * writes a checkpoint (the manifest naming the files); reads alone (STATS, LIST) bring none;
 * the next change brings the next, which writes only what changed: the files of sessions that
 * changed, and blocks the store does not hold, appended to it. After a restart the store goes
 * on the same way; a store whose file was removed is replaced by a new one. */
static void test_persist_checkpoint(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX", pdir[128], path[256], cmd[300];
    persist_on(f, dir, "1");
    snprintf(pdir, sizeof pdir, "%s/persist", dir);
    uint8_t a[16], b[16];
    prefill_for(f, "t", 40, "policy=snapkv,budget=16,window=8", a);
    for (int i = 0; i < 300 && stat(f, "snapkv_persist_checkpoints_total") < 1; i++)
        usleep(100000);
    assert_int_equal(stat(f, "snapkv_persist_checkpoints_total"), 1);
    assert_true(stat(f, "snapkv_persist_age_seconds") < 2);
    only_match(pdir, "blocks-*.skvb", path, sizeof path);
    char hex[33], pattern[64];
    for (int i = 0; i < 16; i++)
        snprintf(hex + 2 * i, 3, "%02x", a[i]);
    snprintf(pattern, sizeof pattern, "%s-*.skv", hex);
    only_match(pdir, pattern, path, sizeof path);
    /* reads only, for 2.5 s: no checkpoint */
    for (int i = 0; i < 10; i++) {
        assert_int_equal(listed(f, a, NULL, NULL), 40);
        usleep(250000);
    }
    assert_int_equal(stat(f, "snapkv_persist_checkpoints_total"), 1);
    assert_true(stat(f, "snapkv_persist_age_seconds") >= 2);
    char store1[256], a1[256], store[256], a2[256], bfile[256];
    only_match(pdir, "blocks-*.skvb", store1, sizeof store1);
    only_match(pdir, pattern, a1, sizeof a1);
    const long size1 = file_size(store1);
    const struct skv_model_config *mc = &f->tiny->m->cfg;
    const long rec = 2L * 16 * mc->head_dim * 4 + 16, heads = mc->n_layers * mc->n_kv_heads;
    assert_int_equal(size1, 96 + heads * rec); /* a: 16 rows a head, one block */
    const double written1 = stat(f, "snapkv_persist_written_bytes_total");
    assert_true(written1 == (double)(heads * rec + file_size(a1)));
    assert_true(stat(f, "snapkv_persist_last_seconds") >= 0 && stat(f, "snapkv_persist_last_seconds") < 10);
    /* a change: the next checkpoint writes b (8 rows a head: no block) and keeps a's file and
     * the store as they were */
    prefill_for(f, "u", 8, "policy=full", b);
    for (int i = 0; i < 300 && stat(f, "snapkv_persist_checkpoints_total") < 2; i++)
        usleep(100000);
    assert_int_equal(stat(f, "snapkv_persist_checkpoints_total"), 2);
    only_match(pdir, "blocks-*.skvb", store, sizeof store);
    only_match(pdir, pattern, a2, sizeof a2);
    assert_string_equal(store, store1);
    assert_string_equal(a2, a1);
    assert_int_equal(file_size(store), size1);
    glob_t g;
    snprintf(cmd, sizeof cmd, "%s/*.skv", pdir);
    assert_int_equal(glob(cmd, 0, NULL, &g), 0);
    assert_int_equal(g.gl_pathc, 2);
    globfree(&g);
    for (int i = 0; i < 16; i++)
        snprintf(hex + 2 * i, 3, "%02x", b[i]);
    snprintf(cmd, sizeof cmd, "%s-*.skv", hex);
    only_match(pdir, cmd, bfile, sizeof bfile);
    assert_true(stat(f, "snapkv_persist_written_bytes_total") == written1 + (double)file_size(bfile));
    /* a grows by a block: the third checkpoint appends that block alone and writes a's file
     * again, b's kept */
    append_then_checkpoint(f, a, 3);
    only_match(pdir, "blocks-*.skvb", store, sizeof store);
    assert_string_equal(store, store1);
    assert_int_equal(file_size(store), size1 + heads * rec);
    only_match(pdir, pattern, a2, sizeof a2);
    assert_string_not_equal(a2, a1);
    only_match(pdir, cmd, path, sizeof path);
    assert_string_equal(path, bfile);
    assert_true(stat(f, "snapkv_persist_written_bytes_total") ==
                written1 + (double)(file_size(bfile) + heads * rec + file_size(a2)));
    /* a restart restores both from those files, and the stop saves nothing new */
    skv_worker_stop(&f->w);
    assert_int_equal(file_size(store), size1 + heads * rec);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    assert_int_equal(listed(f, a, NULL, NULL), 56);
    assert_int_equal(listed(f, b, NULL, NULL), 8);
    /* after the start the store goes on: a's next block appends one more */
    append_then_checkpoint(f, a, 1);
    only_match(pdir, "blocks-*.skvb", store, sizeof store);
    assert_string_equal(store, store1);
    assert_int_equal(file_size(store), size1 + 2 * heads * rec);
    only_match(pdir, cmd, path, sizeof path);
    assert_string_equal(path, bfile);
    /* an admin clears the directory: the next checkpoint writes everything again, in a new
     * store, and a restart restores from it */
    snprintf(path, sizeof path, "rm -rf %s", pdir);
    assert_int_equal(system(path), 0);
    append_then_checkpoint(f, a, 2);
    only_match(pdir, "blocks-*.skvb", store, sizeof store);
    assert_string_not_equal(store, store1);
    assert_int_equal(file_size(store), 96 + 4 * heads * rec); /* a's 4 blocks a head; b has none */
    only_match(pdir, cmd, path, sizeof path);
    assert_string_not_equal(path, bfile);
    skv_worker_stop(&f->w);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    assert_int_equal(listed(f, a, NULL, NULL), 88);
    assert_int_equal(listed(f, b, NULL, NULL), 8);
    persist_off(f, dir);
}

/* An APPEND of 16 tokens to a (tenant t) whose rows the next checkpoint reads slowly (the first
 * read of `rows` rows of a head waits 1.2 s), and that checkpoint's manifest, other than m0, into
 * m1 (no request is sent until it is there: the checkpoint would give way to one). */
static void append_slow_checkpoint(struct fixture *f, const char *dir, const uint8_t a[16], int rows, const char *m0,
                                   char *m1)
{
    g_slow_download_bytes = (size_t)rows * f->tiny->m->cfg.head_dim * sizeof(float);
    atomic_store(&g_slow_download_ms, 1200);
    submit_append_for(f, ID_X, "t", a, 16);
    Snapkv__Reply *rep = next_reply(f, 0, ID_X, 5);
    assert_int_equal(rep->status, SKV_OK);
    snapkv__reply__free_unpacked(rep, NULL);
    for (int i = 0; i < 600 && strcmp(manifest_text(dir, m1, 8192), m0) == 0; i++)
        usleep(100000);
    assert_string_not_equal(m1, m0);
    assert_int_equal(atomic_load(&g_slow_download_ms), 0); /* the checkpoint read a's rows */
}

/* A checkpoint that runs past persist-max-seconds before it reaches a session keeps that
 * session's file of the checkpoint before (it was removed, and the session lost to a crash):
 * a's APPEND makes it the first to save, a slow read of its rows takes the second, and b,
 * unchanged, is past the limit. The manifest still names b, its file is there, and a restart
 * restores both. The stop, which writes what it reaches, is not carried over. */
static void test_persist_checkpoint_late(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX", pdir[128], bfile[256], pattern[64], hex[33];
    assert_int_equal(skv_config_set(&f->cfg, "persist-max-seconds", "1"), SKV_OK);
    persist_on(f, dir, "1");
    snprintf(pdir, sizeof pdir, "%s/persist", dir);
    uint8_t a[16], b[16];
    prefill_for(f, "t", 40, "policy=full", a);
    usleep(5000);
    prefill_for(f, "u", 8, "policy=full", b);
    for (int i = 0; i < 300 && stat(f, "snapkv_persist_checkpoints_total") < 1; i++)
        usleep(100000);
    assert_int_equal(stat(f, "snapkv_persist_checkpoints_total"), 1);
    assert_true(manifest_names(dir, b));
    for (int i = 0; i < 16; i++)
        snprintf(hex + 2 * i, 3, "%02x", b[i]);
    snprintf(pattern, sizeof pattern, "%s-*.skv", hex);
    only_match(pdir, pattern, bfile, sizeof bfile);
    static char m0[8192], m1[8192];
    manifest_text(dir, m0, sizeof m0);
    /* a's rows 32..55 after the APPEND: its new block and the 8 rows past it, read at once */
    append_slow_checkpoint(f, dir, a, 24, m0, m1);
    assert_int_equal(stat(f, "snapkv_persist_checkpoints_total"), 2);
    assert_true(manifest_names(dir, b));
    char path[256];
    only_match(pdir, pattern, path, sizeof path);
    assert_string_equal(path, bfile);
    skv_worker_stop(&f->w);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    assert_int_equal(listed(f, a, NULL, NULL), 56);
    assert_int_equal(listed(f, b, NULL, NULL), 8);
    skv_worker_stop(&f->w);
    assert_int_equal(skv_config_set(&f->cfg, "persist-max-seconds", "30"), SKV_OK);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    persist_off(f, dir);
}

static int append_as(struct fixture *f, const char *tenant, const uint8_t sid[16], int n, int *n_tokens);

/* A crash and a start: the device lost (a 1-token session's export fails so), so the stop saves
 * nothing, as a SIGKILL would; then the worker starts again. */
static void crash_and_start(struct fixture *f)
{
    uint8_t e[16];
    prefill(f, 1, "policy=full", e);
    atomic_store(&g_device_gone, true);
    submit_export_variant(f, 0, ID_X, e, 1, 0xADDE);
    Snapkv__Reply *rep = next_reply(f, 0, ID_X, 5);
    assert_int_equal(rep->status, SKV_E_DEVICE);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_true(skv_worker_device_lost(f->w));
    skv_worker_stop(&f->w);
    atomic_store(&g_device_gone, false);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
}

/* Persist on (checkpoints every second, persist-max-seconds 1) with a's 40 tokens (tenant t)
 * and b's 8 (tenant u) in a block store that is mostly blocks no session holds: 18 sessions of
 * 64 tokens, each of its own ids, checkpointed and then released (288 of the store's 296
 * blocks). The next checkpoint starts a new store. *m0: the manifest then, *store0 the store. */
static void fresh_store_ahead(struct fixture *f, char *dir, char *pdir, uint8_t a[16], uint8_t b[16], char *m0,
                              char *store0)
{
    char tenant[8];
    assert_int_equal(skv_config_set(&f->cfg, "persist-max-seconds", "1"), SKV_OK);
    persist_on(f, dir, "1");
    sprintf(pdir, "%s/persist", dir);
    enum { N_GONE = 18 };
    uint8_t gone[N_GONE][16];
    prefill_for(f, "t", 40, "policy=full", a);
    usleep(5000);
    prefill_for(f, "u", 8, "policy=full", b);
    for (int k = 0; k < N_GONE; k++) { /* ids of its own: no block equal to another's */
        uint32_t tokens[64];
        fixed_ids(f, tokens, 64);
        for (int i = 0; i < 64; i++)
            tokens[i] = (tokens[i] + 1 + (uint32_t)k) % (uint32_t)f->tiny->m->cfg.n_vocab;
        Snapkv__PrefillRequest p;
        Snapkv__Request req = prefill_req(&p, tokens, 64);
        snprintf(tenant, sizeof tenant, "g%d", k);
        req.tenant = tenant;
        Snapkv__Reply *rep = call(f, 0, ID_X, &req);
        assert_int_equal(rep->status, SKV_OK);
        memcpy(gone[k], rep->prefill->session_id.data, 16);
        snapkv__reply__free_unpacked(rep, NULL);
    }
    double n = 0;
    for (int i = 0; i < 300 && (n = stat(f, "snapkv_persist_checkpoints_total")) < 1; i++)
        usleep(100000);
    assert_true(n >= 1);
    for (int k = 0; k < N_GONE; k++) {
        snprintf(tenant, sizeof tenant, "g%d", k);
        assert_int_equal(release_for(f, tenant, gone[k]), SKV_OK);
    }
    for (int i = 0; i < 300 && stat(f, "snapkv_persist_checkpoints_total") < n + 1; i++)
        usleep(100000);
    assert_int_equal(stat(f, "snapkv_persist_checkpoints_total"), n + 1);
    only_match(pdir, "blocks-*.skvb", store0, 256);
    manifest_text(dir, m0, 8192);
}

/* Persist off again, persist-max-seconds back at 30. */
static void fresh_store_done(struct fixture *f, const char *dir)
{
    skv_worker_stop(&f->w);
    assert_int_equal(skv_config_set(&f->cfg, "persist-max-seconds", "30"), SKV_OK);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    persist_off(f, dir);
}

/* A checkpoint into a new block store writes every session the last checkpoint holds, past
 * persist-max-seconds too: their files there name blocks of the store it replaces, so it cannot
 * carry one over (fresh_store_ahead). a's APPEND makes a the first it writes, a slow read of a's
 * rows takes the second, and b, unchanged, comes past the limit. Before, b was left out of that
 * checkpoint, whose sweep then removed its file and the old store: a crash lost it. A restart
 * restores both. */
static void test_persist_fresh_store_late(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX", pdir[128], store0[256], store1[256];
    static char m0[8192], m1[8192];
    uint8_t a[16], b[16];
    fresh_store_ahead(f, dir, pdir, a, b, m0, store0);
    const double n = stat(f, "snapkv_persist_checkpoints_total");
    append_slow_checkpoint(f, dir, a, 56, m0, m1); /* a's rows, all of them at once */
    for (int i = 0; i < 100 && stat(f, "snapkv_persist_checkpoints_total") == n; i++) /* (after the sweep) */
        usleep(100000);
    only_match(pdir, "blocks-*.skvb", store1, sizeof store1);
    assert_string_not_equal(store1, store0); /* a new store */
    assert_true(manifest_names(dir, a));
    assert_true(manifest_names(dir, b));
    restart(f);
    assert_int_equal(listed(f, a, NULL, NULL), 56);
    assert_int_equal(listed(f, b, NULL, NULL), 8);
    fresh_store_done(f, dir);
}

/* A checkpoint into a new block store that cannot write a session the last checkpoint holds
 * fails, and that checkpoint stays: a directory where b's next file goes makes its write fail.
 * Before, the checkpoint left b out and its sweep removed b's file and the old store: after a
 * crash (a lost device: no save at the stop) b was gone. The next try appends to the last store
 * instead, carrying b's file over, and lands; after a crash a comes back as it wrote it, b as
 * before. The save at the stop does not start a new store (it would have met the same
 * failure, and lost b). */
static void test_persist_fresh_store_fails(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX", pdir[128], store0[256], blocked[300], hex[33];
    static char m0[8192], m1[8192];
    uint8_t a[16], b[16];
    fresh_store_ahead(f, dir, pdir, a, b, m0, store0);
    const char *g = strstr(m0, "\"generation\":");
    assert_non_null(g);
    for (int i = 0; i < 16; i++)
        snprintf(hex + 2 * i, 3, "%02x", b[i]);
    snprintf(blocked, sizeof blocked, "%s/%s-%lld.skv", pdir, hex, atoll(g + strlen("\"generation\":")) + 1);
    char cmd[320];
    snprintf(cmd, sizeof cmd, "mkdir %s", blocked);
    assert_int_equal(system(cmd), 0);
    const double failures = stat(f, "snapkv_persist_failures_total");
    assert_int_equal(append_as(f, "t", a, 16, NULL), SKV_OK);
    for (int i = 0; i < 300 && stat(f, "snapkv_persist_failures_total") == failures; i++)
        usleep(100000);
    assert_int_equal(stat(f, "snapkv_persist_failures_total"), failures + 1);
    assert_string_equal(manifest_text(dir, m1, sizeof m1), m0); /* the last checkpoint stays */
    char path[256];
    only_match(pdir, "blocks-*.skvb", path, sizeof path);
    assert_string_equal(path, store0);
    /* the next try (30 s on) appends to the last store, and carries b's file over: it lands
     * (before the review of the change, each try started a new store and failed on b again) */
    const double checkpoints = stat(f, "snapkv_persist_checkpoints_total");
    for (int i = 0; i < 600 && stat(f, "snapkv_persist_checkpoints_total") == checkpoints; i++)
        usleep(100000);
    assert_int_equal(stat(f, "snapkv_persist_checkpoints_total"), checkpoints + 1);
    assert_true(manifest_names(dir, a));
    assert_true(manifest_names(dir, b));
    only_match(pdir, "blocks-*.skvb", path, sizeof path);
    assert_string_equal(path, store0);
    crash_and_start(f);
    assert_int_equal(listed(f, a, NULL, NULL), 56);
    assert_int_equal(listed(f, b, NULL, NULL), 8);
    /* the stop's save keeps the store, with the directory still there: b is kept, not written */
    assert_int_equal(append_as(f, "t", a, 16, NULL), SKV_OK);
    restart(f);
    assert_int_equal(listed(f, a, NULL, NULL), 72);
    assert_int_equal(listed(f, b, NULL, NULL), 8);
    assert_int_equal(rmdir(blocked), 0);
    fresh_store_done(f, dir);
}

/* After a restart: each saved session sid[k] (40 tokens under specs[k], then an APPEND of 6)
 * is listed and goes on exactly as a twin prefilled now. */
static void expect_restored_as_twins(struct fixture *f, const char *const *specs, int n, uint8_t (*sid)[16])
{
    for (int k = 0; k < n; k++) {
        uint8_t twin[16];
        assert_int_equal(listed(f, sid[k], NULL, NULL), 46);
        prefill(f, 40, specs[k], twin);
        assert_int_equal(append(f, twin, 6, NULL), SKV_OK);
        expect_as_twin(f, sid[k], twin, 46, specs[k]);
    }
}

/* Persist files (version 5: a head's positions as runs when that is shorter, its scores behind
 * a flag; version 6: a count of the head's blocks in the store before their indices) bring back
 * every spec's positions and scores: after a restart, sessions under full (one run, zero
 * scores), snapkv (kept rows scattered) and h2o (scores that decide its evictions) go on
 * exactly as twins prefilled after the start, which never went through a
 * file: the same logits, bit for bit, after an APPEND that makes h2o evict. */
static void test_persist_rows_meta(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX", path[256], pattern[64];
    persist_on(f, dir, "0");
    const char *specs[] = {"policy=full", "policy=snapkv,budget=16,window=4", "policy=h2o,budget=16,window=4"};
    enum { N_SPECS = sizeof specs / sizeof *specs };
    uint8_t sid[N_SPECS][16];
    for (int k = 0; k < N_SPECS; k++) { /* an APPEND: h2o's rows now hold scores */
        prefill(f, 40, specs[k], sid[k]);
        assert_int_equal(append(f, sid[k], 6, NULL), SKV_OK);
    }
    skv_worker_stop(&f->w);
    char hex[33];
    for (int i = 0; i < 16; i++)
        snprintf(hex + 2 * i, 3, "%02x", sid[0][i]);
    snprintf(path, sizeof path, "%s/persist", dir);
    snprintf(pattern, sizeof pattern, "%s-*.skv", hex);
    only_match(path, pattern, path, sizeof path);
    FILE *fp = fopen(path, "rb");
    assert_non_null(fp);
    uint32_t head[3];
    assert_int_equal(fread(head, 4, 3, fp), 3);
    fclose(fp);
    assert_int_equal(head[2], 6); /* the version, after the 8-byte magic */
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    expect_restored_as_twins(f, specs, N_SPECS, sid);
    persist_off(f, dir);
}

/* A session whose heads are out of position order (StreamingLLM's and H2O's decode put their
 * newest rows in the places of the rows they drop) comes back from persist. Such a head is
 * written whole, in position order, with no block-store references; before, the restore refused
 * it ("head 0 of 20 rows names 0 blocks of 16") and set the whole saved state aside. The restored
 * session goes on exactly as a LOAD of a SAVE taken at the same point, whose rows are in the same
 * order: the same logits, bit for bit. A FORK of it, written whole too, shares its full blocks
 * again after the restart, by their contents (before, each held copies of its own). And a
 * COMPRESS of the fork that is refused leaves its blocks shared. */
static void test_persist_unordered(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX", name[32];
    persist_on(f, dir, "0");
    const char *specs[] = {"policy=streaming,budget=20,sinks=2", "policy=h2o,budget=20,window=4"};
    enum { N_SPECS = sizeof specs / sizeof *specs };
    uint8_t sid[N_SPECS][16], loaded[16];
    Snapkv__Reply *rep;
    for (int k = 0; k < N_SPECS; k++) {
        prefill(f, 40, specs[k], sid[k]);
        for (int i = 0; i < 6; i++) /* each step drops a row below the newest: out of order */
            assert_int_equal(upkeep_step(f, sid[k], true), SKV_OK);
        snprintf(name, sizeof name, "unordered-%d", k);
        assert_int_equal(save_as(f, sid[k], name), SKV_OK);
    }
    uint8_t forked[16];
    fork_session(f, sid[0], forked); /* every block shared */
    const struct skv_model_config *mc = &f->tiny->m->cfg;
    const int units = mc->n_layers * mc->n_kv_heads;
    assert_int_equal(stat(f, "snapkv_pool_blocks_shared"), 2 * units); /* 20 rows: 16 and 4 a head */
    /* a COMPRESS refused changes nothing: it gathers the heads in order only once its checks
     * passed (before, first, unsharing every block of the fork) */
    submit_compress_from(f, ID_X, forked, "policy=streaming,budget=16,sinks=2", 1000);
    rep = next_reply(f, 0, ID_X, 5);
    assert_int_equal(rep->status, SKV_E_INVAL);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(stat(f, "snapkv_pool_blocks_shared"), 2 * units);
    restart(f);
    assert_int_equal(listed(f, forked, NULL, NULL), 46);
    /* the full block of each head shared again (a partly filled one is not looked up) */
    assert_int_equal(stat(f, "snapkv_pool_blocks_shared"), units);
    for (int k = 0; k < N_SPECS; k++) {
        assert_int_equal(listed(f, sid[k], NULL, NULL), 46);
        snprintf(name, sizeof name, "unordered-%d", k);
        assert_int_equal(load_as(f, name, loaded), SKV_OK);
        expect_as_twin(f, sid[k], loaded, 46, specs[k]);
    }
    persist_off(f, dir);
}

/* COMPRESS of a fork of a session decoded out of position order reserves the blocks that putting
 * its rows in order makes its own, and its re-run's, in one reservation before it takes any. The
 * pool holds 8 blocks a layer and head: 2 that a StreamingLLM session shares with its fork, 4 of a
 * pinned session, 2 of an idle one. The COMPRESS needs 2 for the order and 2 for the re-run's copy,
 * more than evicting the idle session gives: it is refused and evicts no one. Before, it ordered
 * the fork with no room asked (each of its blocks unshared, the pool 2 blocks a layer and head
 * past its size, `7579555` asking room for the order alone and evicting the idle session for it),
 * and its re-run was then refused with the fork's blocks its own. With the pinned session gone,
 * it is done, evicting no one. */
static void test_compress_order_room(void **state)
{
    struct fixture *f = *state;
    const uint64_t unit = restart_with_pool(f, 8);
    const char *spec = "policy=streaming,budget=20,sinks=2";
    uint8_t a[16], forked[16], other[16], idle[16];
    prefill(f, 40, spec, a);
    for (int i = 0; i < 6; i++) /* each step drops a row below the newest: out of order */
        assert_int_equal(upkeep_step(f, a, true), SKV_OK);
    pin(f, a);
    fork_session(f, a, forked);
    prefill(f, 64, "policy=full", other);
    pin(f, other);
    prefill(f, 32, "policy=full", idle);
    const double pool = (double)f->cfg.pool_size;
    assert_true(stat(f, "snapkv_pool_bytes_used") == pool);
    assert_int_equal(stat(f, "snapkv_pool_blocks_shared"), 2 * unit);
    submit_compress_from(f, ID_X, forked, "policy=streaming,budget=16,sinks=2", 44);
    Snapkv__Reply *rep = next_reply(f, 0, ID_X, 5);
    if (rep->status != SKV_E_POOL_FULL)
        fail_msg("COMPRESS: %d '%s', want POOL_FULL", rep->status, rep->message);
    snapkv__reply__free_unpacked(rep, NULL);
    assert_int_equal(stat(f, "snapkv_pool_blocks_shared"), 2 * unit);
    assert_true(stat(f, "snapkv_pool_bytes_used") == pool);
    assert_int_equal(listed(f, idle, NULL, NULL), 32); /* not evicted */
    assert_int_equal(listed(f, forked, NULL, NULL), 46);
    /* with room, it is done */
    assert_int_equal(release_by_x(f, other), SKV_OK);
    submit_compress_from(f, ID_Y, forked, "policy=streaming,budget=16,sinks=2", 44);
    expect_reply(f, SKV_OK, NULL);
    assert_true(stat(f, "snapkv_pool_bytes_used") <= pool);
    assert_int_equal(listed(f, idle, NULL, NULL), 32);
    assert_int_equal(listed(f, forked, NULL, NULL), 46);
}

/* SAVE writes through a temporary file of a name of its own (mkostemps: two daemons sharing the
 * state directory, each pid 1 in its container, would otherwise write one file), which it
 * renames; one a crash left is removed by a start's first SAVE an hour on, not a newer one
 * (another daemon may be writing it). */
static void test_save_tmp(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-savetmp-XXXXXX", cmd[600], path[300];
    state_dir_new(f, dir);
    uint8_t a[16];
    prefill(f, 8, "policy=full", a);
    assert_int_equal(save_as(f, a, "s"), SKV_OK);
    snprintf(cmd, sizeof cmd, "ls %s | grep -c tmp", dir);
    assert_int_not_equal(system(cmd), 0); /* none left */
    snprintf(cmd, sizeof cmd, "cd %s && echo x > old.skv.Ab12Cd.tmp && touch -d '2 hours ago' old.skv.Ab12Cd.tmp && "
             "echo x > new.skv.Ef34Gh.tmp && echo x > other.tmp && touch -d '2 hours ago' other.tmp", dir);
    assert_int_equal(system(cmd), 0);
    restart(f);
    prefill(f, 8, "policy=full", a);
    assert_int_equal(save_as(f, a, "s"), SKV_OK); /* the start's first SAVE sweeps */
    snprintf(path, sizeof path, "%s/old.skv.Ab12Cd.tmp", dir);
    assert_int_equal(access(path, F_OK), -1);
    snprintf(path, sizeof path, "%s/new.skv.Ef34Gh.tmp", dir);
    assert_int_equal(access(path, F_OK), 0);
    snprintf(path, sizeof path, "%s/other.tmp", dir); /* not a SAVE's */
    assert_int_equal(access(path, F_OK), 0);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

/* A saved session longer than this daemon's max-prompt-tokens + max-new-tokens (it was started
 * with lower limits than the one that saved it) is refused as LIMIT, naming them (before: FORMAT,
 * "implausible lengths", which the store also took for a damaged value and dropped rather than
 * leave it for a daemon that can take it); with the limits back, it loads. */
static void test_load_past_limits(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-limits-XXXXXX", cmd[64];
    state_dir_new(f, dir);
    uint8_t a[16], b[16];
    prefill_for(f, "t", 40, "policy=full", a);
    assert_int_equal(save_as(f, a, "long"), SKV_OK);
    const int64_t max_prompt = f->cfg.max_prompt_tokens, max_new = f->cfg.max_new_tokens;
    restart_with_limits(f, 24, 8);
    Snapkv__Reply *rep = load_reply(f, "long");
    assert_int_equal(rep->status, SKV_E_LIMIT);
    assert_non_null(strstr(rep->message, "40 tokens, more than max-prompt-tokens + max-new-tokens (32)"));
    snapkv__reply__free_unpacked(rep, NULL);
    restart_with_limits(f, max_prompt, max_new);
    assert_int_equal(load_as(f, "long", b), SKV_OK);
    assert_int_equal(listed(f, b, NULL, NULL), 40);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

/* The kept prefixes LIST shows (at most 8): their ids, tenants' first letters and tokens, in
 * the order listed; returns how many. */
static int kept_listed(struct fixture *f, uint8_t ids[8][16], char tenants[8], uint32_t tokens[8])
{
    Snapkv__ListRequest lr = SNAPKV__LIST_REQUEST__INIT;
    lr.kept_prefixes = true;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_LIST;
    req.list = &lr;
    Snapkv__Reply *rep = admin_call(f, &req);
    assert_int_equal(rep->status, SKV_OK);
    int n = (int)rep->list->n_kept;
    assert_true(n <= 8);
    for (int i = 0; i < n; i++) {
        assert_int_equal(rep->list->kept[i]->id.len, 16);
        memcpy(ids[i], rep->list->kept[i]->id.data, 16);
        tenants[i] = rep->list->kept[i]->tenant[0];
        tokens[i] = rep->list->kept[i]->n_tokens;
    }
    snapkv__reply__free_unpacked(rep, NULL);
    return n;
}

/* The index in ids[0..n) of id (-1: none). */
static int kept_index(uint8_t ids[8][16], int n, const uint8_t id[16])
{
    for (int i = 0; i < n; i++)
        if (memcmp(ids[i], id, 16) == 0)
            return i;
    return -1;
}

/* Changes the first hex digit of the rows_id the persist manifest under dir names (as a daemon
 * that computes rows otherwise would have written it). */
static void manifest_rows_id_flip(const char *dir)
{
    char path[256], text[16384] = {0};
    snprintf(path, sizeof path, "%s/persist/sessions.json", dir);
    FILE *fp = fopen(path, "r+");
    assert_non_null(fp);
    size_t n = fread(text, 1, sizeof text - 1, fp);
    assert_true(n > 0 && n < sizeof text - 1);
    char *at = strstr(text, "\"rows_id\":\"");
    assert_non_null(at);
    at += strlen("\"rows_id\":\"");
    *at = *at == '0' ? '1' : '0';
    rewind(fp);
    assert_int_equal(fwrite(text, 1, n, fp), n);
    fclose(fp);
}

/* persist keeps the kept prefixes (prefix-retain-bytes) across a restart: under their ids and
 * tenants, serving prefix reuse as before, with the sessions; with checkpoints on, a save that
 * finds one unchanged names its file of before and writes none. A start with another kv-type,
 * with prefix reuse off or with no prefix-retain-bytes restores none of them, and every
 * session all the same. */
static void test_persist_kept(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX", pdir[300], path[512], again[512], pattern[64];
    f->cfg.prefix_reuse = true;
    f->cfg.prefix_retain_bytes = INT64_C(1) << 26;
    persist_on(f, dir, "3600"); /* checkpoints keep the files they name; none comes in this test */
    snprintf(pdir, sizeof pdir, "%s/persist", dir);
    uint8_t ids[8][16], after[8][16], s[16];
    char tenants[8], tenants_after[8];
    uint32_t tokens[8], tokens_after[8];
    assert_int_equal(prefill_release(f, "t", 3, 32), 0);
    assert_int_equal(prefill_release(f, "u", 5, 48), 0);
    /* a compressing PREFILL keeps its prompt's 32 rows too */
    prefill_for(f, "t", 40, "policy=snapkv,budget=16,window=8", s);
    assert_int_equal(kept_listed(f, ids, tenants, tokens), 3);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 3);
    restart(f);
    assert_int_equal(kept_listed(f, after, tenants_after, tokens_after), 3);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 3);
    assert_int_equal(listed(f, s, NULL, NULL), 40);
    for (int i = 0; i < 3; i++) {
        int k = kept_index(after, 3, ids[i]);
        assert_true(k >= 0);
        assert_int_equal(tenants_after[k], tenants[i]);
        assert_int_equal(tokens_after[k], tokens[i]);
    }
    /* the restored rows serve: 48 tokens of u's history of 48 reuse 32 (whole blocks but the
     * last token's); t's 32 serve t, not u */
    assert_int_equal(prefill_release(f, "u", 5, 48), 32);
    assert_int_equal(prefill_release(f, "u", 3, 48), 0);
    assert_int_equal(prefill_release(f, "t", 3, 48), 32);
    /* t's 48 now cover its 32; u's kept rows were used, not changed: the next save keeps
     * their file of before */
    int n = kept_listed(f, after, tenants_after, tokens_after);
    assert_int_equal(n, 4); /* t's 48 and 32 (the compressed session's prompt), u's 48 and u's other 48 */
    int ku = -1;
    for (int i = 0; i < 3; i++)
        if (tenants[i] == 'u')
            ku = kept_index(after, n, ids[i]);
    assert_true(ku >= 0);
    char hex[33];
    for (int i = 0; i < 16; i++)
        snprintf(hex + 2 * i, 3, "%02x", after[ku][i]);
    snprintf(pattern, sizeof pattern, "%s-*.skv", hex);
    only_match(pdir, pattern, path, sizeof path);
    restart(f);
    only_match(pdir, pattern, again, sizeof again);
    assert_string_equal(path, again);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 4);
    /* none comes back with another kv-type, without prefix reuse, without a cap, from a daemon
     * that computes rows otherwise (its rows_id in the manifest changed); the session does (each
     * round saves its kept prefix under the usual settings first) */
    uint8_t full[16], x[16];
    for (int k = 0; k < 4; k++) {
        skv_worker_stop(&f->w);
        assert_int_equal(skv_config_set(&f->cfg, "kv-type", "f32"), SKV_OK);
        f->cfg.prefix_reuse = true;
        f->cfg.prefix_retain_bytes = INT64_C(1) << 26;
        assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
        if (!stat(f, "snapkv_prefix_retained"))
            prefill_release(f, "t", 3, 32);
        assert_true(stat(f, "snapkv_prefix_retained") >= 1);
        if (k == 3) /* a full-cache session: its rows serve no reuse after the restart either */
            prefill_for(f, "v", 48, "policy=full", full);
        skv_worker_stop(&f->w);
        if (k == 0)
            assert_int_equal(skv_config_set(&f->cfg, "kv-type", "f16"), SKV_OK);
        if (k == 3)
            manifest_rows_id_flip(dir);
        f->cfg.prefix_reuse = k != 1;
        f->cfg.prefix_retain_bytes = k == 2 ? 0 : INT64_C(1) << 26;
        assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
        assert_int_equal(stat(f, "snapkv_prefix_retained"), 0);
        assert_int_equal(listed(f, s, NULL, NULL), 40);
        if (k == 3) {
            assert_int_equal(listed(f, full, NULL, NULL), 48);
            assert_int_equal(prefill_reused(f, "v", 64, x), 0);
        }
    }
    persist_off(f, dir);
}

/* The bytes of one store block for every layer and KV head of the tiny model (a block store
 * file's record: 16 rows of K and V in f32 and its 16-byte header). */
static long store_block_units(const struct fixture *f)
{
    const struct skv_model_config *mc = &f->tiny->m->cfg;
    return (2L * 16 * mc->head_dim * 4 + 16) * mc->n_layers * mc->n_kv_heads;
}

/* Stops the worker (its persist save) with files limited to `limit` bytes (RLIMIT_FSIZE,
 * SIGXFSZ ignored: the write fails instead), then lifts the limit. */
static void stop_with_file_limit(struct fixture *f, long limit)
{
    struct rlimit old, lim;
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &old), 0);
    lim = old;
    lim.rlim_cur = (rlim_t)limit;
    void (*was)(int) = signal(SIGXFSZ, SIG_IGN);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    skv_worker_stop(&f->w);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &old), 0);
    signal(SIGXFSZ, was);
}

/* A save whose block store fails on the kept prefixes' blocks (here a file size limit the
 * sessions' blocks fit under and the kept prefix's do not) saves the sessions all the same,
 * without the kept prefixes: the restart restores the session and no kept prefix. */
static void test_persist_kept_store_fails(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX", pdir[300], path[512];
    f->cfg.prefix_reuse = true;
    f->cfg.prefix_retain_bytes = INT64_C(1) << 26;
    persist_on(f, dir, "0");
    snprintf(pdir, sizeof pdir, "%s/persist", dir);
    uint8_t a[16];
    prefill_for(f, "t", 32, "policy=full", a);   /* 2 blocks a layer and KV head */
    assert_int_equal(prefill_release(f, "u", 5, 48), 0); /* 3 of u's, kept */
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 1);
    const long limit = 96 + 3 * store_block_units(f); /* the sessions' 2 fit, their 2 and the kept 3 do not */
    stop_with_file_limit(f, limit);
    only_match(pdir, "blocks-*.skvb", path, sizeof path);
    assert_true(file_size(path) >= 2 * store_block_units(f)); /* the session's blocks went in */
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    assert_int_equal(listed(f, a, NULL, NULL), 32);
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 0);
    persist_off(f, dir);
}

/* A save whose block store fails on a kept prefix's new blocks keeps the kept prefixes the
 * store held before: with checkpoints on the store goes on across the restart, so the one
 * restored from it is named again, the one added since (written first: the most recently
 * used) fails, and the restart brings back the first and not the second. */
static void test_persist_kept_store_fails_later(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX", pdir[300], path[512];
    f->cfg.prefix_reuse = true;
    f->cfg.prefix_retain_bytes = INT64_C(1) << 26;
    persist_on(f, dir, "3600"); /* the store goes on; no checkpoint comes in this test */
    snprintf(pdir, sizeof pdir, "%s/persist", dir);
    uint8_t first[8][16], ids[8][16];
    char tenants[8];
    uint32_t tokens[8];
    assert_int_equal(prefill_release(f, "u", 5, 48), 0); /* 3 blocks a layer and KV head */
    restart(f);
    assert_int_equal(kept_listed(f, first, tenants, tokens), 1);
    assert_int_equal(prefill_release(f, "t", 7, 64), 0); /* 4 more, never written */
    assert_int_equal(stat(f, "snapkv_prefix_retained"), 2);
    only_match(pdir, "blocks-*.skvb", path, sizeof path);
    stop_with_file_limit(f, file_size(path) + 2 * store_block_units(f)); /* t's 4 do not fit */
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    assert_int_equal(kept_listed(f, ids, tenants, tokens), 1);
    assert_memory_equal(ids[0], first[0], 16);
    assert_int_equal(tokens[0], 48);
    assert_int_equal(prefill_release(f, "u", 5, 48), 32); /* its rows serve */
    persist_off(f, dir);
}

/* The entry of a persist manifest's list (sessions or kept) whose id is hex, or NULL. */
static json_t *manifest_find(json_t *doc, const char *list, const char *hex)
{
    json_t *l = json_object_get(doc, list);
    for (size_t i = 0; i < json_array_size(l); i++) {
        json_t *e = json_array_get(l, i);
        if (strcmp(json_string_value(json_object_get(e, "id")), hex) == 0)
            return e;
    }
    return NULL;
}

/* Kept prefixes a manifest names that do not come back: one idle past lease-seconds (it would
 * expire at the first second), and one under the id of a session the manifest also names (the
 * session comes back, and stays itself across the next restart: before, the kept prefix's file
 * took the name of the session's at the next save); a third comes back as saved. */
static void test_persist_kept_manifest(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX", path[512], moved[512], mpath[300];
    f->cfg.prefix_reuse = true;
    f->cfg.prefix_retain_bytes = INT64_C(1) << 26;
    persist_on(f, dir, "0");
    uint8_t s[16], ids[8][16];
    char tenants[8];
    uint32_t tokens[8];
    assert_int_equal(prefill_release(f, "t", 3, 32), 0);
    assert_int_equal(prefill_release(f, "u", 5, 48), 0);
    assert_int_equal(prefill_release(f, "w", 7, 32), 0);
    prefill_for(f, "v", 40, "policy=full", s);
    assert_int_equal(kept_listed(f, ids, tenants, tokens), 3);
    skv_worker_stop(&f->w);
    snprintf(mpath, sizeof mpath, "%s/persist/sessions.json", dir);
    json_error_t err;
    json_t *doc = json_load_file(mpath, 0, &err);
    assert_non_null(doc);
    char hex[3][33], shex[33];
    for (int k = 0; k < 16; k++)
        snprintf(shex + 2 * k, 3, "%02x", s[k]);
    for (int i = 0; i < 3; i++)
        for (int k = 0; k < 16; k++)
            snprintf(hex[i] + 2 * k, 3, "%02x", ids[i][k]);
    int kt = tenants[0] == 't' ? 0 : tenants[1] == 't' ? 1 : 2, ku = tenants[0] == 'u' ? 0 : tenants[1] == 'u' ? 1 : 2;
    json_t *et = manifest_find(doc, "kept", hex[kt]), *eu = manifest_find(doc, "kept", hex[ku]);
    assert_non_null(et);
    assert_non_null(eu);
    json_object_set_new(et, "idle_ms", json_integer((json_int_t)f->cfg.lease_seconds * 1000 + 1000));
    /* u's under v's id, its file renamed to match, under a generation of its own */
    json_int_t gen = json_integer_value(json_object_get(eu, "file_generation"));
    snprintf(path, sizeof path, "%s/persist/%s-%lld.skv", dir, hex[ku], (long long)gen);
    snprintf(moved, sizeof moved, "%s/persist/%s-%lld.skv", dir, shex, (long long)gen + 100);
    assert_int_equal(rename(path, moved), 0);
    json_object_set_new(eu, "id", json_string(shex));
    json_object_set_new(eu, "file_generation", json_integer(gen + 100));
    assert_int_equal(json_dump_file(doc, mpath, JSON_COMPACT), 0);
    json_decref(doc);
    for (int round = 0; round < 2; round++) {
        assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
        uint8_t after[8][16];
        assert_int_equal(kept_listed(f, after, tenants, tokens), 1);
        assert_int_equal(tenants[0], 'w');
        assert_int_equal(tokens[0], 32);
        assert_int_equal(listed(f, s, NULL, NULL), 40);
        skv_worker_stop(&f->w);
    }
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    persist_off(f, dir);
}

/* Rewrites the version-6 persist file at path as the version 5 that daemons wrote before it:
 * each head's count of store blocks goes (it must be its full blocks: no partly filled one
 * shared), the version field says 5 and the BLAKE2b after it is computed again. The layout
 * is requests.c's SAVE format: a 360-byte header, the tokens, the compressor state, the
 * logits, a cut character, then per head its length, positions, scores, count, store indices
 * and rows. */
static void persist_file_to_v5(const char *path, int br)
{
    FILE *fp = fopen(path, "rb");
    assert_non_null(fp);
    static uint8_t in[1 << 20], out[1 << 20];
    size_t n = fread(in, 1, sizeof in, fp), i = 0, o = 0;
    fclose(fp);
    assert_true(n > 360 + 32 && n < sizeof in);
    uint32_t u[4];
    memcpy(u, in + 8, sizeof u); /* version, layers, KV heads, head_dim */
    assert_int_equal(u[0], 6);
    int32_t n_tokens, v;
    memcpy(&n_tokens, in + 32, 4);
#define TAKE(k)                                                                                                        \
    do {                                                                                                               \
        size_t k_ = (size_t)(k);                                                                                       \
        assert_true(i + k_ <= n - 32);                                                                                 \
        memcpy(out + o, in + i, k_);                                                                                   \
        o += k_;                                                                                                       \
        i += k_;                                                                                                       \
    } while (0)
#define PEEK(x) (assert_true(i + 4 <= n - 32), memcpy(&(x), in + i, 4))
    TAKE(360);
    out[8] = 5;
    TAKE((size_t)n_tokens * 4);
    for (int k = 0; k < 3; k++) { /* compressor state bytes, logits (floats), a cut character's bytes */
        PEEK(v);
        TAKE(4 + (size_t)v * (k == 1 ? 4 : 1));
    }
    for (uint32_t h = 0; h < u[1] * u[2]; h++) {
        int32_t len, runs, flag, refs;
        PEEK(len);
        TAKE(4);
        PEEK(runs);
        TAKE(4 + (runs < 0 ? (size_t)len * 4 : (size_t)runs * 8));
        PEEK(flag);
        TAKE(4 + (flag ? (size_t)len * 4 : 0));
        PEEK(refs);
        assert_int_equal(refs, len / br);
        i += 4; /* the count goes */
        TAKE((size_t)refs * 4);
        TAKE((size_t)(len - refs * br) * u[3] * 4 * 2);
    }
#undef TAKE
#undef PEEK
    assert_int_equal(i, n - 32);
    crypto_generichash(out + o, 32, out, o, NULL, 0);
    fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(out, 1, o + 32, fp), o + 32);
    fclose(fp);
}

/* A persist directory of version-5 files (what the daemon wrote before version 6), as an
 * upgrade finds it: every session comes back and goes on exactly as its twin prefilled after
 * the start. */
static void test_persist_version5(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX", path[256], pattern[64];
    persist_on(f, dir, "0");
    const char *specs[] = {"policy=full", "policy=snapkv,budget=20,window=4"};
    enum { N_SPECS = sizeof specs / sizeof *specs };
    uint8_t sid[N_SPECS][16];
    for (int k = 0; k < N_SPECS; k++) { /* rows past the full blocks: in the file, as version 5 had them */
        prefill(f, 40, specs[k], sid[k]);
        assert_int_equal(append(f, sid[k], 6, NULL), SKV_OK);
    }
    skv_worker_stop(&f->w);
    char pdir[256];
    snprintf(pdir, sizeof pdir, "%s/persist", dir);
    for (int k = 0; k < N_SPECS; k++) {
        char hex[33];
        for (int i = 0; i < 16; i++)
            snprintf(hex + 2 * i, 3, "%02x", sid[k][i]);
        snprintf(pattern, sizeof pattern, "%s-*.skv", hex);
        only_match(pdir, pattern, path, sizeof path);
        persist_file_to_v5(path, skv_kv_pool_block_rows(f->tiny->m->kv_pool));
    }
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    expect_restored_as_twins(f, specs, N_SPECS, sid);
    persist_off(f, dir);
}

/* A checkpoint that fails (here the persist directory's place holds a file) is counted, the
 * last checkpoint stays, and the next try waits at least 30 s rather than writing (and holding
 * the engine) every second; the save at stop still runs, and the start restores from it. */
static void test_persist_checkpoint_fails(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX", path[256];
    persist_on(f, dir, "1");
    snprintf(path, sizeof path, "%s/persist", dir);
    FILE *fp = fopen(path, "w");
    assert_non_null(fp);
    fclose(fp);
    uint8_t a[16];
    prefill_for(f, "t", 40, "policy=full", a);
    for (int i = 0; i < 50 && stat(f, "snapkv_persist_failures_total") < 1; i++)
        usleep(100000);
    assert_int_equal(stat(f, "snapkv_persist_failures_total"), 1);
    unlink(path); /* fixed; the next try is still 30 s away */
    usleep(2500000);
    assert_int_equal(stat(f, "snapkv_persist_failures_total"), 1);
    assert_int_equal(stat(f, "snapkv_persist_checkpoints_total"), 0);
    skv_worker_stop(&f->w);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    assert_int_equal(listed(f, a, NULL, NULL), 40);
    persist_off(f, dir);
}

/* A persist directory written before the block store (version-3 files, each session's rows
 * whole, as an upgrade finds it): both sessions come back, and the full blocks they hold the
 * same are shared again by their contents. */
static void test_persist_older_files(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/skv-persist-XXXXXX", path[300], cmd[700];
    persist_on(f, dir, "0");
    uint8_t a[16], b[16];
    prefill_for(f, "t", 40, "policy=full", a); /* 2 full blocks of 16 rows a head, and 8 rows */
    Snapkv__SaveRequest sq = SNAPKV__SAVE_REQUEST__INIT;
    sq.session_id = (ProtobufCBinaryData){16, a};
    sq.name = "old";
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_SAVE;
    req.save = &sq;
    req.tenant = "t";
    Snapkv__Reply *rep = call(f, 0, ID_X, &req);
    assert_int_equal(rep->status, SKV_OK);
    snapkv__reply__free_unpacked(rep, NULL);
    skv_worker_stop(&f->w);

    memcpy(b, a, 16);
    b[0] ^= 0xff;
    char ha[33], hb[33];
    for (int i = 0; i < 16; i++) {
        snprintf(ha + 2 * i, 3, "%02x", a[i]);
        snprintf(hb + 2 * i, 3, "%02x", b[i]);
    }
    snprintf(cmd, sizeof cmd, "rm -f %s/persist/* && cp %s/old.skv %s/persist/%s.skv && cp %s/old.skv %s/persist/%s.skv",
             dir, dir, dir, ha, dir, dir, hb);
    assert_int_equal(system(cmd), 0);
    snprintf(path, sizeof path, "%s/persist/sessions.json", dir);
    FILE *fp = fopen(path, "w");
    assert_non_null(fp);
    fprintf(fp, "{\"version\": 1, \"sessions\": [");
    for (int k = 0; k < 2; k++)
        fprintf(fp, "%s{\"id\": \"%s\", \"tenant\": \"t\", \"owner\": \"x\", \"pinned\": false, "
                    "\"lease_seconds\": 60, \"idle_ms\": 0}", k ? ", " : "", k ? hb : ha);
    fprintf(fp, "]}");
    fclose(fp);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
    int n = 0;
    assert_int_equal(listed(f, a, NULL, &n), 40);
    assert_int_equal(listed(f, b, NULL, NULL), 40);
    assert_int_equal(n, 2);
    const struct skv_model_config *mc = &f->tiny->m->cfg;
    assert_int_equal(stat(f, "snapkv_pool_blocks_shared"), 2 * mc->n_layers * mc->n_kv_heads);
    assert_int_equal(stat(f, "snapkv_pool_blocks_used"), 4 * mc->n_layers * mc->n_kv_heads);

    persist_off(f, dir);
}

/* Text is tokenized with the model's BOS only where a session begins: with the tiny tokenizer
 * (add_bos_token true; single characters are ids below the tiny model's 320 rows) a PREFILL of
 * text gets BOS and its characters, an APPEND of text its characters alone. */
static void test_append_text_no_bos(void **state)
{
    struct fixture *f = *state;
    char *path = fixture_path("tests/fixtures/tok_tiny/tokenizer.json");
    struct skv_tokenizer *tok = NULL;
    assert_int_equal(skv_tokenizer_from_json(path, &tok), SKV_OK);
    free(path);
    assert_true(skv_tokenizer_add_bos(tok));
    int32_t ids[16];
    int n_first = 0, n_next = 0;
    assert_int_equal(skv_tokenizer_encode(tok, "Qx", 2, true, false, ids, 16, &n_first), SKV_OK);
    assert_int_equal(n_first, 3);
    assert_int_equal(ids[0], skv_tokenizer_bos(tok));
    assert_int_equal(skv_tokenizer_encode(tok, "Zq!", 3, false, false, ids, 16, &n_next), SKV_OK);
    assert_int_equal(n_next, 3);
    for (int i = 0; i < n_next; i++)
        assert_true(ids[i] < f->tiny->m->cfg.n_vocab);
    struct skv_tokenizer *own = f->tiny->m->tok;
    skv_worker_stop(&f->w); /* swapped while no worker thread runs (joined: no race for TSan) */
    f->tiny->m->tok = tok;
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);

    Snapkv__PrefillRequest p = SNAPKV__PREFILL_REQUEST__INIT;
    p.text = "Qx";
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_PREFILL;
    req.prefill = &p;
    Snapkv__Reply *rep = call(f, 0, ID_X, &req);
    if (rep->status)
        fail_msg("PREFILL: %d %s", rep->status, rep->message);
    assert_int_equal(rep->prefill->n_tokens, n_first);
    uint8_t sid[16];
    memcpy(sid, rep->prefill->session_id.data, 16);
    snapkv__reply__free_unpacked(rep, NULL);

    for (int chat = 0; chat < 2; chat++) {
        Snapkv__AppendRequest a = SNAPKV__APPEND_REQUEST__INIT;
        a.session_id = (ProtobufCBinaryData){16, sid};
        a.text = "Zq!";
        a.chat = chat;
        Snapkv__Request areq = SNAPKV__REQUEST__INIT;
        areq.command_case = SNAPKV__REQUEST__COMMAND_APPEND;
        areq.append = &a;
        rep = call(f, 0, ID_X, &areq);
        if (rep->status)
            fail_msg("APPEND: %d %s", rep->status, rep->message);
        assert_int_equal(rep->append->n_tokens, n_first + (chat + 1) * n_next);
        snapkv__reply__free_unpacked(rep, NULL);
    }
    skv_worker_stop(&f->w);
    f->tiny->m->tok = own;
    skv_tokenizer_free(&tok);
    assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
}

/* Pool pressure evicts a session only when that frees a block: a fork's document whose every
 * block the fork shares frees nothing while the fork lives, so the next least recently used
 * goes instead (before, the document went first, for nothing, and then that one too). */
static void test_evict_frees(void **state)
{
    struct fixture *f = *state;
    assert_int_equal(skv_kv_pool_block_rows(f->tiny->m->kv_pool), 16);
    restart_with_pool(f, 4);
    uint8_t doc[16], fork[16], other[16];
    prefill(f, 32, "policy=full", doc); /* two full blocks a layer and head */
    fork_session(f, doc, fork);
    usleep(5000); /* the document is the least recently used by some milliseconds */
    prefill(f, 16, "policy=full", other); /* one block: three of four in use */
    usleep(5000);
    int n = 0;
    assert_int_equal(append(f, fork, 17, &n), SKV_OK); /* two more blocks: one must go */
    assert_int_equal(n, 49);
    assert_int_equal(listed(f, doc, NULL, NULL), 32);
    assert_int_equal(listed(f, other, NULL, NULL), -1);
    assert_int_equal(listed(f, fork, NULL, NULL), 49);
    assert_int_equal(stat(f, "snapkv_evictions_total"), 1);
}

/* A tenant's share of the pool counts the blocks its sessions share once: a document of 4
 * blocks a layer and head with two forks of one more block each holds 6, not the 14 its
 * sessions' tables name. With another tenant at 9 in a pool of 16 (a share of 8 each), the
 * other's new session evicts the other's own least recently used, not one of the forks (before,
 * the forks' tenant was "over its share" and its older fork went). */
static void test_fair_share_forks(void **state)
{
    struct fixture *f = *state;
    restart_with_pool(f, 16);
    uint8_t doc[16], fork1[16], fork2[16], b[4][16];
    prefill(f, 64, "policy=full", doc);
    fork_session(f, doc, fork1);
    fork_session(f, doc, fork2);
    assert_int_equal(append(f, fork1, 16, NULL), SKV_OK);
    assert_int_equal(append(f, fork2, 16, NULL), SKV_OK);
    for (int i = 0; i < 3; i++) {
        usleep(5000); /* used one after the other, in different milliseconds */
        prefill_for(f, "b", 48, "policy=full", b[i]);
    }
    assert_int_equal(stat(f, "snapkv_evictions_total"), 0);
    prefill_for(f, "b", 32, "policy=full", b[3]); /* 17 of 16: one must go */
    assert_int_equal(stat(f, "snapkv_evictions_total"), 1);
    assert_int_equal(listed(f, b[0], NULL, NULL), -1);
    assert_int_equal(listed(f, fork1, NULL, NULL), 80);
    assert_int_equal(listed(f, fork2, NULL, NULL), 80);
    assert_int_equal(listed(f, doc, NULL, NULL), 64);
    assert_int_equal(listed(f, b[3], NULL, NULL), 32);
}

/* A tenant over its share whose sessions free a block only together (a document and its idle
 * forks) loses them before a tenant within its share loses its session: pool of 8 blocks a
 * layer and head, t's 64-token document (4) and two idle forks, b's 32 tokens (2); c's 48 need
 * 3 (9 of 8): t's go (before, b's went, the only session that freed a block alone). */
static void test_fair_share_idle_forks(void **state)
{
    struct fixture *f = *state;
    restart_with_pool(f, 8);
    uint8_t doc[16], fork1[16], fork2[16], b[16], c[16];
    prefill(f, 64, "policy=full", doc);
    fork_session(f, doc, fork1);
    fork_session(f, doc, fork2);
    usleep(5000);
    prefill_for(f, "b", 32, "policy=full", b);
    usleep(5000);
    prefill_for(f, "c", 48, "policy=full", c);
    assert_int_equal(listed(f, b, NULL, NULL), 32);
    assert_int_equal(listed(f, c, NULL, NULL), 48);
    assert_int_equal(listed(f, doc, NULL, NULL), -1);
    assert_int_equal(stat(f, "snapkv_evictions_total"), 3); /* the document freed its blocks with its forks */
}

/* A request that fails with SKV_E_DEVICE asks the backend whether the device is lost: a failure
 * the device recovers from changes nothing; once it is lost, skv_worker_device_lost says so
 * (the socket loop then stops the daemon with an error, for systemd to restart it). */
static void test_device_lost(void **state)
{
    struct fixture *f = *state;
    uint8_t a[16];
    prefill(f, 8, "policy=full", a);
    for (int lost = 0; lost < 2; lost++) {
        atomic_store(&g_device_gone, lost == 1);
        submit_export_variant(f, 0, ID_X, a, 1, 0xADDE);
        Snapkv__Reply *rep = next_reply(f, 0, ID_X, 5);
        assert_int_equal(rep->status, SKV_E_DEVICE);
        snapkv__reply__free_unpacked(rep, NULL);
        assert_int_equal(skv_worker_device_lost(f->w), lost == 1);
    }
    atomic_store(&g_device_gone, false);
}

/* The same with the fork idle: a document and its fork that share every block free nothing one
 * at a time, so under pool pressure from another session the one that frees a block alone goes
 * (before, the least recently used, the document, went for nothing). */
static void test_evict_idle_fork(void **state)
{
    struct fixture *f = *state;
    restart_with_pool(f, 4);
    uint8_t doc[16], fork[16], other[16], busy[16];
    prefill(f, 32, "policy=full", doc);
    fork_session(f, doc, fork);
    usleep(5000);
    prefill(f, 16, "policy=full", other);
    usleep(5000);
    prefill(f, 8, "policy=full", busy); /* four of four blocks in use */
    int n = 0;
    assert_int_equal(append(f, busy, 17, &n), SKV_OK); /* one more block: one session must go */
    assert_int_equal(n, 25);
    assert_int_equal(listed(f, doc, NULL, NULL), 32);
    assert_int_equal(listed(f, fork, NULL, NULL), 32);
    assert_int_equal(listed(f, other, NULL, NULL), -1);
    assert_int_equal(stat(f, "snapkv_evictions_total"), 1);
}

/* Two decodes in one round that each cross a block boundary take exactly the blocks the pool
 * has left: the second's room counts the block the first's prepare took once (it was counted
 * twice, in the pool and as the round's, and an idle session was evicted for room that was
 * there). */
static void test_decode_round_room(void **state)
{
    struct fixture *f = *state;
    restart_with_pool(f, 5);
    uint8_t a[16], b[16], idle[16];
    prefill(f, 16, "policy=full", idle);
    usleep(5000);
    /* three of five blocks a layer and head; a runs one round alone before b's first (the
     * worker starts one request between two rounds), so a reaches its 17th row in b's first */
    prefill(f, 15, "policy=full", a);
    prefill(f, 16, "policy=full", b);
    freeze(f, idle);
    submit_decode(f, ID_Y, "t", a, 3, false);
    submit_decode(f, ID_Z, "t", b, 3, false);
    thaw(f);
    const uint8_t *clients[2] = {ID_Y, ID_Z};
    for (int i = 0; i < 2; i++) {
        uint32_t toks[4];
        int n = 0;
        Snapkv__Reply *rep = decode_final(f, clients[i], toks, &n, 4);
        assert_int_equal(rep->status, SKV_OK);
        assert_int_equal(n, 3);
        snapkv__reply__free_unpacked(rep, NULL);
    }
    assert_int_equal(listed(f, idle, NULL, NULL), 16);
    assert_int_equal(stat(f, "snapkv_evictions_total"), 0);
    assert_true(listed(f, a, NULL, NULL) > 16 && listed(f, b, NULL, NULL) > 16);
}

/* decode-share: with a decode-yield-ms that never comes, a share of 100 gives the running decode
 * a round at every tick of a long prefill (after each layer's projections, attention and MLP: 3
 * per layer, as decode-yield-ms = 0 does), and a share of 0 none (the decode waits for the
 * prefill). */
static void test_decode_share(void **state)
{
    struct fixture *f = *state;
    const int L = f->tiny->m->cfg.n_layers;
    const char *shares[2] = {"100", "0"};
    const int want[2] = {3 * L, 0};
    for (int k = 0; k < 2; k++) {
        skv_worker_stop(&f->w);
        f->cfg.decode_yield_ms = 3600000;
        assert_int_equal(skv_config_set(&f->cfg, "decode-share", shares[k]), SKV_OK);
        assert_int_equal(skv_worker_start(f->zctx, REPLIES, &f->cfg, f->tiny->m, &f->w), SKV_OK);
        uint8_t a[16];
        prefill(f, 8, "policy=full", a);
        freeze(f, a);
        submit_decode(f, ID_Y, "t", a, (uint32_t)(3 * L + 6), false);
        submit_long_prefill(f, false);
        thaw(f);
        Snapkv__Reply *rep = next_reply(f, 0, ID_X, 5);
        assert_int_equal(rep->status, SKV_OK);
        snapkv__reply__free_unpacked(rep, NULL);
        rep = next_reply(f, 0, ID_Y, 5);
        assert_int_equal(rep->status, SKV_OK);
        assert_int_equal(rep->decode->n_tokens, 3 * L + 6);
        snapkv__reply__free_unpacked(rep, NULL);
        assert_int_equal(stat(f, "snapkv_decode_rounds_in_forwards_total"), want[k]);
    }
}

/* What a test writer (skv_store_writer) writes: `n` bytes of a pattern in pieces of uneven
 * sizes, or it fails with SKV_E_NOMEM after `fail_at` of them; `calls` counts its runs. */
struct pattern_writer {
    size_t n, fail_at;
    int calls;
};

static unsigned char pattern_byte(size_t i)
{
    return (unsigned char)(i * 2654435761u >> 13);
}

static int pattern_write(void *user, FILE *f)
{
    struct pattern_writer *pw = user;
    pw->calls++;
    static const size_t pieces[] = {1, 7, 4096, 300001, 3, 1 << 20};
    static unsigned char buf[1 << 20];
    for (size_t at = 0, k = 0; at < pw->n; k++) {
        size_t m = pieces[k % 6] < pw->n - at ? pieces[k % 6] : pw->n - at;
        if (at + m > pw->fail_at)
            return skv_errorf(SKV_E_NOMEM, "the test writer fails at %zu", pw->fail_at);
        for (size_t i = 0; i < m; i++)
            buf[i] = pattern_byte(at + i);
        if (fwrite(buf, 1, m, f) != m)
            return skv_errorf(SKV_E_IO, "write: %s", strerror(errno));
        at += m;
    }
    return SKV_OK;
}

/* The redis-server test_store_stream runs (killed by its teardown whatever happened) */
static pid_t g_stream_redis;
static char g_stream_dir[64];
static char g_auth_dir[64]; /* test_store_auth's password files */

/* Removes the test's directory dir names, if any, and forgets it. */
static void remove_test_dir(char *dir)
{
    if (!dir[0])
        return;
    char cmd[200];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    dir[0] = '\0';
}

static int stream_teardown(void **state)
{
    (void)state;
    unsetenv("REDISCLI_AUTH");
    remove_test_dir(g_auth_dir);
    if (g_stream_redis > 0) {
        kill(g_stream_redis, SIGKILL);
        waitpid(g_stream_redis, NULL, 0);
        g_stream_redis = 0;
    }
    remove_test_dir(g_stream_dir);
    return 0;
}

/* Starts the test's redis-server in a new g_stream_dir, on a unix socket (*sock) and on TCP port
 * port ("0": none), with redis-server options extra (NULL-terminated, or NULL); redis-cli finds
 * it answering before this returns (REDISCLI_AUTH set when it needs a password). */
static void stream_redis_start(const char *port, const char *const *extra, char *sock, size_t cap)
{
    if (system("command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1") != 0)
        skip();
    snprintf(g_stream_dir, sizeof g_stream_dir, "/tmp/skv-test-stream-XXXXXX");
    assert_non_null(mkdtemp(g_stream_dir));
    snprintf(sock, cap, "%s/redis.sock", g_stream_dir);
    const char *argv[32] = {"redis-server", "--port", port, "--bind", "127.0.0.1", "--unixsocket", sock,
                            "--save", "", "--appendonly", "no", "--dir", g_stream_dir};
    int argc = 13;
    for (; extra && *extra && argc < 31; extra++)
        argv[argc++] = *extra;
    argv[argc] = NULL;
    fflush(NULL);
    g_stream_redis = fork();
    assert_true(g_stream_redis >= 0);
    if (g_stream_redis == 0) {
        if (!freopen("/dev/null", "w", stdout) || !freopen("/dev/null", "w", stderr))
            _exit(126);
        execvp("redis-server", (char *const *)argv);
        _exit(127);
    }
    char out[200] = "";
    for (int i = 0; i < 300 && strcmp(out, "PONG") != 0; i++) {
        usleep(50 * 1000);
        fixture_redis_cli(sock, "PING", out, sizeof out);
    }
    assert_string_equal(out, "PONG");
}

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* getaddrinfo as this program sees it (store.c is linked into it, so the store's lookup
 * thread calls this one): a name under ".slow.test" is answered as "localhost" after
 * SLOW_LOOKUP_MS, a resolver that takes longer than store-timeout-ms; every other name goes to
 * the next getaddrinfo (libc's, or a sanitizer's in front of it). */
#define SLOW_LOOKUP_MS 1500
int getaddrinfo(const char *node, const char *service, const struct addrinfo *hints, struct addrinfo **res)
{
    typedef int (*gai_fn)(const char *, const char *, const struct addrinfo *, struct addrinfo **);
    gai_fn next = (gai_fn)dlsym(RTLD_NEXT, "getaddrinfo");
    if (!next)
        return EAI_FAIL;
    size_t len = node ? strlen(node) : 0, tail = strlen(".slow.test");
    if (len > tail && strcmp(node + len - tail, ".slow.test") == 0) {
        usleep(SLOW_LOOKUP_MS * 1000);
        node = "localhost";
    }
    return next(node, service, hints, res);
}

/* A lookup that outlasts store-timeout-ms: the connect gives up at its deadline with an error
 * naming the host, and the lookup goes on; the next connect, once it has answered, takes its
 * answer instead of looking up again (within 300 ms, which a new lookup could not meet). A
 * store freed while its lookup runs leaves the lookup to finish and free itself (ASan and TSan
 * runs check that). */
static void test_store_slow_lookup(void **state)
{
    (void)state;
    char sock[200], port[16], url[96];
    int port_n = fixture_free_port();
    assert_true(port_n > 0);
    snprintf(port, sizeof port, "%d", port_n);
    stream_redis_start(port, NULL, sock, sizeof sock);
    snprintf(url, sizeof url, "redis://cache.slow.test:%s", port);
    struct skv_store *st = NULL;
    assert_int_equal(skv_store_new(url, 300, 1 << 30, &st), SKV_OK);
    struct pattern_writer pw = {.n = 10, .fail_at = SIZE_MAX};
    uint64_t t0 = mono_ms();
    assert_int_equal(skv_store_put_stream(st, "k", 10, 60, pattern_write, &pw), SKV_E_IO);
    uint64_t waited = mono_ms() - t0;
    assert_non_null(strstr(skv_error_msg(), "looking up cache.slow.test takes longer than store-timeout-ms"));
    assert_true(waited >= 250 && waited < SLOW_LOOKUP_MS); /* its deadline, not the resolver's time */
    usleep((SLOW_LOOKUP_MS + 300) * 1000); /* the lookup answers; the retry wait (1 s) passes */
    pw = (struct pattern_writer){.n = 10, .fail_at = SIZE_MAX};
    assert_int_equal(skv_store_put_stream(st, "k", 10, 60, pattern_write, &pw), SKV_OK);
    const void *data = NULL;
    void *value = NULL;
    size_t got = 0;
    assert_int_equal(skv_store_take(st, "k", &data, &got, &value), SKV_OK);
    assert_int_equal(got, 10);
    skv_store_value_free(value);
    skv_store_free(&st);

    /* freed while its lookup runs */
    assert_int_equal(skv_store_new(url, 300, 1 << 30, &st), SKV_OK);
    pw = (struct pattern_writer){.n = 10, .fail_at = SIZE_MAX};
    assert_int_equal(skv_store_put_stream(st, "k", 10, 60, pattern_write, &pw), SKV_E_IO);
    skv_store_free(&st);
    usleep((SLOW_LOOKUP_MS + 300) * 1000); /* it ends before the program does */
}

/* A spill's value is streamed onto the connection (skv_store_put_stream), against a real
 * redis-server on a unix socket and on TCP (skipped when it is not installed): a 3 MB value
 * written in uneven pieces comes back whole; a writer that writes fewer or more bytes than
 * announced, or fails, leaves nothing stored and the store usable at once; a connection the
 * server closed while idle is made again before the command is sent (over TCP too, where a send
 * would still go out: a GETDEL on it would find the connection closed only when the reply was
 * due); a store that stops reading is a timeout, and the half-sent value is not stored. Takes
 * read the value straight from the socket (an empty one, none, the store's error for a key
 * that is not a string). */
static void test_store_stream(void **state)
{
    (void)state;
    char sock[200], url[220], tcp[64], port[16], out[200] = "";
    int port_n = fixture_free_port();
    assert_true(port_n > 0);
    snprintf(port, sizeof port, "%d", port_n);
    stream_redis_start(port, NULL, sock, sizeof sock);
    snprintf(url, sizeof url, "unix://%s", sock);
    snprintf(tcp, sizeof tcp, "redis://127.0.0.1:%s", port);
    struct skv_store *st = NULL, *st_tcp = NULL;
    assert_int_equal(skv_store_new(url, 5000, 1 << 30, &st), SKV_OK);
    assert_int_equal(skv_store_new(tcp, 5000, 1 << 30, &st_tcp), SKV_OK);
    const size_t n = 3000017;
    struct pattern_writer pw = {.n = n, .fail_at = SIZE_MAX};
    assert_int_equal(skv_store_put_stream(st, "a", n, 60, pattern_write, &pw), SKV_OK);
    assert_int_equal(pw.calls, 1);
    const void *data = NULL;
    void *value = NULL;
    size_t got = 0;
    assert_int_equal(skv_store_take(st, "a", &data, &got, &value), SKV_OK);
    assert_int_equal(got, n);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += ((const unsigned char *)data)[i] != pattern_byte(i);
    assert_int_equal(bad, 0);
    skv_store_value_free(value);
    fixture_redis_cli(sock, "TTL a", out, sizeof out);
    assert_string_equal(out, "-2"); /* taken */

    /* a host name: looked up on a thread of its own within store-timeout-ms, its IPv4 addresses
     * tried first (the server listens on 127.0.0.1 only) */
    char named[80];
    snprintf(named, sizeof named, "redis://localhost:%s", port);
    struct skv_store *st_named = NULL;
    assert_int_equal(skv_store_new(named, 5000, 1 << 30, &st_named), SKV_OK);
    pw = (struct pattern_writer){.n = 1000, .fail_at = SIZE_MAX};
    assert_int_equal(skv_store_put_stream(st_named, "named", 1000, 60, pattern_write, &pw), SKV_OK);
    assert_int_equal(skv_store_take(st_named, "named", &data, &got, &value), SKV_OK);
    assert_int_equal(got, 1000);
    assert_int_equal(((const unsigned char *)data)[999], pattern_byte(999));
    skv_store_value_free(value);
    skv_store_free(&st_named);
    /* a name no resolver knows (.invalid, RFC 6761): a clear error naming it, whether the
     * resolver says so, or the 300 ms run out first, or a resolver that makes up an address for
     * unknown names sends the connect nowhere; the store then goes while its lookup may run */
    snprintf(named, sizeof named, "redis://no-such-host.invalid:%s", port);
    assert_int_equal(skv_store_new(named, 300, 1 << 30, &st_named), SKV_OK);
    pw = (struct pattern_writer){.n = 10, .fail_at = SIZE_MAX};
    assert_int_equal(skv_store_put_stream(st_named, "x", 10, 60, pattern_write, &pw), SKV_E_IO);
    assert_non_null(strstr(skv_error_msg(), "no-such-host.invalid"));
    skv_store_free(&st_named);

    /* fewer bytes, more bytes, a failing writer: nothing stored, and the next call works */
    const struct {
        size_t written, fail_at;
        int rc;
    } wrong[] = {{n - 5, SIZE_MAX, SKV_E_INTERNAL}, {n + 5, SIZE_MAX, SKV_E_INTERNAL}, {n, n / 2, SKV_E_NOMEM}};
    for (size_t k = 0; k < sizeof wrong / sizeof *wrong; k++) {
        pw = (struct pattern_writer){.n = wrong[k].written, .fail_at = wrong[k].fail_at};
        assert_int_equal(skv_store_put_stream(st, "b", n, 60, pattern_write, &pw), wrong[k].rc);
        assert_int_equal(pw.calls, 1);
        pw = (struct pattern_writer){.n = 10, .fail_at = SIZE_MAX};
        assert_int_equal(skv_store_put_stream(st, "c", 10, 60, pattern_write, &pw), SKV_OK);
        fixture_redis_cli(sock, "EXISTS b", out, sizeof out);
        assert_string_equal(out, "0");
        fixture_redis_cli(sock, "STRLEN c", out, sizeof out);
        assert_string_equal(out, "10");
    }
    fixture_redis_cli(sock, "TTL c", out, sizeof out);
    assert_true(atoi(out) > 50 && atoi(out) <= 60);
    fixture_redis_cli(sock, "INFO stats | grep -c total_error_replies:0", out, sizeof out);
    assert_string_equal(out, "1"); /* no byte past the value went out: the store saw no bad command */

    /* closed by the server while idle, on the socket and over TCP: made again before the
     * command, the value written once */
    for (int t = 0; t < 2; t++) {
        struct skv_store *s = t ? st_tcp : st;
        pw = (struct pattern_writer){.n = n, .fail_at = SIZE_MAX};
        assert_int_equal(skv_store_put_stream(s, "d", n, 60, pattern_write, &pw), SKV_OK);
        fixture_redis_cli(sock, "CLIENT KILL TYPE normal SKIPME yes", out, sizeof out);
        assert_true(atoi(out) >= 1);
        usleep(100 * 1000); /* the close reaches the client's side */
        assert_int_equal(skv_store_take(s, "d", &data, &got, &value), SKV_OK);
        assert_int_equal(got, n);
        assert_int_equal(((const unsigned char *)data)[n - 1], pattern_byte(n - 1));
        skv_store_value_free(value);
        fixture_redis_cli(sock, "CLIENT KILL TYPE normal SKIPME yes", out, sizeof out);
        usleep(100 * 1000);
        pw = (struct pattern_writer){.n = n, .fail_at = SIZE_MAX};
        assert_int_equal(skv_store_put_stream(s, "d", n, 60, pattern_write, &pw), SKV_OK);
        assert_int_equal(pw.calls, 1);
        fixture_redis_cli(sock, "STRLEN d", out, sizeof out);
        assert_int_equal(atol(out), (long)n);
    }

    /* takes: none, an empty value, a value that is not a string (the store's error, the
     * connection kept) */
    assert_int_equal(skv_store_take(st, "none", &data, &got, &value), SKV_E_NOT_FOUND);
    fixture_redis_cli(sock, "SET z ''", out, sizeof out);
    assert_int_equal(skv_store_take(st, "z", &data, &got, &value), SKV_OK);
    assert_int_equal(got, 0);
    skv_store_value_free(value);
    fixture_redis_cli(sock, "RPUSH l x", out, sizeof out);
    assert_int_equal(skv_store_take(st, "l", &data, &got, &value), SKV_E_IO);
    assert_non_null(strstr(skv_error_msg(), "WRONGTYPE"));
    assert_non_null(strstr(skv_error_msg(), url));
    assert_int_equal(skv_store_take(st, "c", &data, &got, &value), SKV_OK);
    assert_int_equal(got, 10);
    assert_memory_equal(data, "\x00", 1); /* pattern_byte(0) */
    skv_store_value_free(value);
    struct skv_store_stats ss;
    skv_store_stats(st, &ss);
    assert_int_equal(ss.spills, 1 + 3 + 2);
    assert_int_equal(ss.spill_bytes, 3 * n + 3 * 10);
    assert_int_equal(ss.spill_failures, 3);
    assert_int_equal(ss.loads, 1 + 1 + 2);
    assert_int_equal(ss.misses, 1);
    assert_int_equal(ss.load_failures, 1);

    /* a value larger than the store's max_value: refused, and left in the store for a daemon
     * whose max_value is higher (the take is a script: STRLEN, then GETDEL; before, a GETDEL,
     * and the value was lost); with scripts refused by the store's ACL, a plain GETDEL, and
     * such a value is lost as before; the next take works */
    struct skv_store *st_small = NULL;
    assert_int_equal(skv_store_new(url, 5000, 1 << 20, &st_small), SKV_OK);
    pw = (struct pattern_writer){.n = n, .fail_at = SIZE_MAX};
    assert_int_equal(skv_store_put_stream(st_small, "big", n, 60, pattern_write, &pw), SKV_OK);
    assert_int_equal(skv_store_take(st_small, "big", &data, &got, &value), SKV_E_LIMIT);
    assert_non_null(strstr(skv_error_msg(), "stays in the store"));
    fixture_redis_cli(sock, "EXISTS big", out, sizeof out);
    assert_string_equal(out, "1");
    fixture_redis_cli(sock, "ACL SETUSER default -@scripting", out, sizeof out);
    assert_string_equal(out, "OK");
    assert_int_equal(skv_store_take(st_small, "big", &data, &got, &value), SKV_E_LIMIT);
    assert_non_null(strstr(skv_error_msg(), "is lost"));
    fixture_redis_cli(sock, "ACL SETUSER default +@all", out, sizeof out);
    fixture_redis_cli(sock, "EXISTS big", out, sizeof out);
    assert_string_equal(out, "0");
    fixture_redis_cli(sock, "SET small 12345", out, sizeof out);
    assert_int_equal(skv_store_take(st_small, "small", &data, &got, &value), SKV_OK);
    assert_int_equal(got, 5);
    assert_memory_equal(data, "12345", 5);
    skv_store_value_free(value);
    skv_store_free(&st_small);

    /* a store that stops reading: the send times out (300 ms, and as much again a MiB of the
     * value), the connection is dropped */
    struct skv_store *st_short = NULL;
    assert_int_equal(skv_store_new(url, 300, 1 << 30, &st_short), SKV_OK);
    assert_int_equal(kill(g_stream_redis, SIGSTOP), 0);
    pw = (struct pattern_writer){.n = 8 * n, .fail_at = SIZE_MAX};
    assert_int_equal(skv_store_put_stream(st_short, "e", 8 * n, 60, pattern_write, &pw), SKV_E_IO);
    assert_non_null(strstr(skv_error_msg(), "timed out"));
    assert_int_equal(kill(g_stream_redis, SIGCONT), 0);
    fixture_redis_cli(sock, "EXISTS e", out, sizeof out);
    assert_string_equal(out, "0");
    skv_store_stats(st_short, &ss);
    assert_int_equal(ss.spill_failures, 1);
    skv_store_free(&st_short);
    /* a database the store does not have: SELECT's refusal says why, whole */
    char db99[96];
    snprintf(db99, sizeof db99, "%s/99", tcp);
    struct skv_store *st_db = NULL;
    assert_int_equal(skv_store_new(db99, 5000, 1 << 30, &st_db), SKV_OK);
    pw = (struct pattern_writer){.n = 10, .fail_at = SIZE_MAX};
    assert_int_equal(skv_store_put_stream(st_db, "f", 10, 60, pattern_write, &pw), SKV_E_IO);
    assert_non_null(strstr(skv_error_msg(), "SELECT refused (ERR DB index is out of range)"));
    skv_store_free(&st_db);
    skv_store_free(&st_tcp);
    skv_store_free(&st);
}

/* store = ...: the urls taken and refused, and a store nobody answers at: an I/O error naming it,
 * and no new connection tried within a second of the failure. */
static void test_store_urls(void **state)
{
    (void)state;
    const char *good[] = {"redis://localhost", "redis://10.0.0.7:6380", "redis://cache.example:6379/3",
                          "redis://[::1]:7000/1", "redis://h/", "unix:///run/redis/redis.sock"};
    const char *bad[] = {"", "localhost:6379", "redis://", "redis://:6379", "redis://h:0", "redis://h:65536",
                         "redis://h:x", "redis://h/db", "redis://h:6379/1/2", "unix://relative.sock",
                         "redis://[::1", "http://h"};
    const struct {
        const char *host;
        int port, db;
    } want[] = {{"localhost", 6379, 0}, {"10.0.0.7", 6380, 0}, {"cache.example", 6379, 3},
                {"::1", 7000, 1},       {"h", 6379, 0},        {"/run/redis/redis.sock", 0, 0}};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
        struct skv_store *st = NULL;
        assert_int_equal(skv_store_new(good[i], 100, 1 << 30, &st), SKV_OK);
        assert_string_equal(skv_store_url(st), good[i]);
        const char *host;
        int port, db;
        skv_store_target(st, &host, &port, &db);
        assert_string_equal(host, want[i].host);
        assert_int_equal(port, want[i].port);
        assert_int_equal(db, want[i].db);
        skv_store_free(&st);
        assert_null(st);
    }
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        struct skv_store *st = NULL;
        assert_int_equal(skv_store_new(bad[i], 100, 1 << 30, &st), SKV_E_INVAL);
        assert_null(st);
        assert_non_null(strstr(skv_error_msg(), "store"));
    }
    struct skv_store *st = NULL;
    assert_int_equal(skv_store_new("unix:///nonexistent/redis.sock", 100, 1 << 30, &st), SKV_OK);
    const void *data = NULL;
    void *value = NULL;
    size_t n = 0;
    assert_int_equal(skv_store_take(st, "k", &data, &n, &value), SKV_E_IO);
    assert_null(value);
    assert_non_null(strstr(skv_error_msg(), "unix:///nonexistent/redis.sock"));
    struct pattern_writer pw = {.n = 1, .fail_at = SIZE_MAX};
    assert_int_equal(skv_store_put_stream(st, "k", 1, 60, pattern_write, &pw), SKV_E_IO);
    assert_int_equal(pw.calls, 0);
    assert_non_null(strstr(skv_error_msg(), "tried again in"));
    struct skv_store_stats ss;
    skv_store_stats(st, &ss);
    assert_int_equal(ss.spill_failures, 1);
    assert_int_equal(ss.load_failures, 1);
    assert_int_equal(ss.spills + ss.loads + ss.misses, 0);
    assert_int_equal(skv_store_delete(st, "k"), SKV_E_IO);
    skv_store_free(&st);
}

/* Writes text to path with mode (the test's password files). */
static void write_file_mode(const char *path, const char *text, mode_t mode)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    assert_int_equal(fclose(f), 0);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "chmod %o %s", (unsigned)mode, path); /* (this file's stat() is STATS') */
    assert_int_equal(system(cmd), 0);
}

/* A store that does not behave (a thread of the test on a unix socket): each connection's first
 * read of a command gets the answer of `mode`. */
enum hostile_mode { HOSTILE_TRICKLE, HOSTILE_HUGE_REPLY, HOSTILE_QUOTE, HOSTILE_SCRIPT };
struct hostile_store {
    enum hostile_mode mode;
    int listen_fd;
    char path[108];
    const char *quote;        /* HOSTILE_QUOTE: the start of the password it quotes */
    const char *script;       /* HOSTILE_SCRIPT: the answer, script_n bytes */
    size_t script_n;
    _Atomic uint64_t sent;    /* bytes of its answer that went out */
    atomic_bool done;         /* its connection closed */
    pthread_t thread;
};

static void *hostile_main(void *arg)
{
    struct hostile_store *h = arg;
    int fd = accept(h->listen_fd, NULL, NULL);
    if (fd < 0)
        return NULL;
    char buf[4096];
    if (recv(fd, buf, sizeof buf, 0) <= 0) {
        close(fd);
        return NULL;
    }
    char head[512];
    if (h->mode == HOSTILE_TRICKLE) { /* a 50-byte string, a byte every 100 ms */
        send(fd, "$50\r\n", 5, MSG_NOSIGNAL);
        for (int i = 0; i < 50 && send(fd, "x", 1, MSG_NOSIGNAL) == 1; i++) {
            atomic_fetch_add(&h->sent, 1);
            usleep(100 * 1000);
        }
    } else if (h->mode == HOSTILE_HUGE_REPLY) { /* SET answered with a 200 MB string, all sent */
        static char zeros[1 << 16];
        send(fd, "$200000000\r\n", 13, MSG_NOSIGNAL);
        for (uint64_t at = 0; at < 200000000;) {
            ssize_t k = send(fd, zeros, sizeof zeros, MSG_NOSIGNAL);
            if (k <= 0)
                break;
            at += (uint64_t)k;
            atomic_fetch_add(&h->sent, (uint64_t)k);
        }
    } else if (h->mode == HOSTILE_SCRIPT) {
        if (send(fd, h->script, h->script_n, MSG_NOSIGNAL) > 0)
            atomic_fetch_add(&h->sent, h->script_n);
        while (recv(fd, buf, sizeof buf, 0) > 0) /* until the client closes (a batch's other commands) */
            ;
    } else { /* as Redis answers a command it does not know: its arguments quoted, cut */
        int n = snprintf(head, sizeof head, "-ERR unknown command `AUTH`, with args beginning with: `%s`, \r\n",
                         h->quote);
        send(fd, head, (size_t)n, MSG_NOSIGNAL);
        recv(fd, buf, sizeof buf, 0); /* until the client closes */
    }
    close(fd);
    atomic_store(&h->done, true);
    return NULL;
}

static void hostile_start(struct hostile_store *h, enum hostile_mode mode, const char *dir)
{
    h->mode = mode;
    atomic_store(&h->sent, 0);
    atomic_store(&h->done, false);
    snprintf(h->path, sizeof h->path, "%s/hostile.sock", dir);
    unlink(h->path);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", h->path);
    h->listen_fd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_true(h->listen_fd >= 0);
    assert_int_equal(bind(h->listen_fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(h->listen_fd, 4), 0);
    assert_int_equal(pthread_create(&h->thread, NULL, hostile_main, h), 0);
}

static void hostile_stop(struct hostile_store *h)
{
    pthread_join(h->thread, NULL);
    close(h->listen_fd);
    unlink(h->path);
}

static void count_progress(void *user)
{
    ++*(int *)user;
}

/* APPEND of n tokens to session sid of tenant; the status, and the length in *n_tokens. */
static int append_as(struct fixture *f, const char *tenant, const uint8_t sid[16], int n, int *n_tokens)
{
    submit_append_for(f, ID_X, tenant, sid, n);
    Snapkv__Reply *rep = next_reply(f, 0, ID_X, 5);
    int status = rep->status;
    if (!status && n_tokens)
        *n_tokens = (int)rep->append->n_tokens;
    snapkv__reply__free_unpacked(rep, NULL);
    return status;
}

/* A restart after a crash, with persist and a store: a session spilled to the store after the
 * last save is left there (before, its older file was restored while the store held it too,
 * where another host could take it: two copies); one spilled and taken back since is restored
 * from its file; a save removes the record (<state-dir>/persist/spilled). The crash: a lost
 * device, whose stop saves nothing. Each session its own tenant: equal prompts share no block. */
static void test_persist_spilled(void **state)
{
    struct fixture *f = *state;
    char sock[200], url[220], dir[] = "/tmp/skv-spilled-XXXXXX", rec[300];
    stream_redis_start("0", NULL, sock, sizeof sock);
    snprintf(url, sizeof url, "unix://%s", sock);
    assert_int_equal(skv_config_set(&f->cfg, "store", url), SKV_OK);
    persist_on(f, dir, "3600"); /* no checkpoint comes in this test */
    snprintf(rec, sizeof rec, "%s/persist/spilled", dir);
    restart_with_pool(f, 8);
    uint8_t a[16], b[16], c[16], d[16];
    prefill_for(f, "a", 64, "policy=full", a); /* 4 blocks a layer and head: two fill the pool */
    usleep(5000);
    prefill_for(f, "d", 64, "policy=full", d);
    restart(f); /* saved: a and d, restored */
    assert_int_equal(listed(f, a, NULL, NULL), 64);
    assert_int_equal(access(rec, F_OK), -1);
    /* a record past 256 KiB is written again, short, at the next spill: 8000 records of
     * sessions the manifest does not name go, those spilled ('S') too */
    FILE *jf = fopen(rec, "w");
    assert_non_null(jf);
    for (int i = 0; i < 8000; i++)
        fprintf(jf, "%c%032x\n", i % 2 ? 'S' : 'T', i);
    assert_int_equal(fclose(jf), 0);
    prefill_for(f, "b", 64, "policy=full", b); /* a, the least recently used, spilled */
    assert_int_equal(file_size(rec), 34);     /* S a */
    usleep(5000);
    prefill_for(f, "c", 64, "policy=full", c); /* d spilled */
    assert_int_equal(file_size(rec), 2 * 34);
    assert_int_equal(listed(f, a, NULL, NULL), -1);
    assert_int_equal(listed(f, d, NULL, NULL), -1);
    assert_non_null(jf = fopen(rec, "a")); /* a torn record (a host's crash): the next still counts */
    assert_true(fputs("S12", jf) >= 0);
    assert_int_equal(fclose(jf), 0);
    int n = 0;
    assert_int_equal(append_as(f, "d", d, 1, &n), SKV_OK); /* d taken back (b, c spilled for its room) */
    assert_int_equal(n, 65);
    assert_true(file_size(rec) >= 4 * 34); /* S a, S d, S b, T d, ... */
    crash_and_start(f);
    assert_int_equal(listed(f, a, NULL, NULL), -1); /* left in the store */
    assert_int_equal(listed(f, d, NULL, NULL), 64); /* its file, from before the take */
    assert_int_equal(append_as(f, "a", a, 1, &n), SKV_OK); /* from the store, as it was spilled */
    assert_int_equal(n, 65);
    restart(f); /* a save: the record goes */
    assert_int_equal(access(rec, F_OK), -1);
    assert_int_equal(listed(f, a, NULL, NULL), 65);
    persist_off(f, dir);
}

/* A session in the store longer than this daemon's max-prompt-tokens + max-new-tokens (one with
 * higher limits spilled it) is refused as LIMIT, naming them, and stays in the store for a daemon
 * that can take it (before: FORMAT, "implausible lengths", and the value was dropped as damaged);
 * with the limits back, it is taken. */
static void test_store_past_limits(void **state)
{
    struct fixture *f = *state;
    char sock[200], url[220], out[64] = "";
    stream_redis_start("0", NULL, sock, sizeof sock);
    snprintf(url, sizeof url, "unix://%s", sock);
    assert_int_equal(skv_config_set(&f->cfg, "store", url), SKV_OK);
    restart_with_pool(f, 8);
    uint8_t a[16], b[16], c[16];
    prefill_for(f, "a", 64, "policy=full", a); /* 4 blocks a layer and head: two fill the pool */
    usleep(5000);
    prefill_for(f, "b", 64, "policy=full", b);
    prefill_for(f, "c", 64, "policy=full", c); /* a, the least recently used, spilled */
    assert_int_equal(listed(f, a, NULL, NULL), -1);
    const int64_t max_prompt = f->cfg.max_prompt_tokens, max_new = f->cfg.max_new_tokens;
    restart_with_limits(f, 32, 16); /* (its stop spills b and c too) */
    submit_append_for(f, ID_X, "a", a, 1);
    Snapkv__Reply *rep = next_reply(f, 0, ID_X, 5);
    assert_int_equal(rep->status, SKV_E_LIMIT);
    assert_non_null(strstr(rep->message, "64 tokens, more than max-prompt-tokens + max-new-tokens (48)"));
    assert_non_null(strstr(rep->message, "it stays in the store"));
    snapkv__reply__free_unpacked(rep, NULL);
    fixture_redis_cli(sock, "DBSIZE", out, sizeof out);
    assert_string_equal(out, "3");
    restart_with_limits(f, max_prompt, max_new);
    int n = 0;
    assert_int_equal(append_as(f, "a", a, 1, &n), SKV_OK);
    assert_int_equal(n, 65);
}

/* A tenant at its store cap (store-max-bytes-per-tenant, 1 MiB) counts again which of its
 * spilled sessions the store still holds before it refuses a spill: its 64-token sessions are
 * spilled one by one as the next evicts them (a pool of two) until one is refused, past the cap;
 * then the store is emptied (other hosts took them) and the next eviction's spill goes through,
 * the records of those gone forgotten. The count goes by batches of keys pipelined (a key's
 * last byte, none when it has no value), where it went by an EXISTS and its round trip a
 * record, at every spill of a tenant at its cap. */
static void test_store_recount(void **state)
{
    struct fixture *f = *state;
    char sock[200], url[220], out[64] = "";
    stream_redis_start("0", NULL, sock, sizeof sock);
    snprintf(url, sizeof url, "unix://%s", sock);
    skv_worker_stop(&f->w); /* (its thread reads the config) */
    assert_int_equal(skv_config_set(&f->cfg, "store", url), SKV_OK);
    assert_int_equal(skv_config_set(&f->cfg, "store-max-bytes-per-tenant", "1M"), SKV_OK);
    restart_with_pool(f, 8);
    uint8_t sid[16];
    int spilled = 0;
    for (int i = 0; i < 100 && stat(f, "snapkv_store_spill_failures_total") == 0; i++) {
        prefill_for(f, "p", 64, "policy=full", sid); /* 4 blocks a layer and head: two fill the pool */
        fixture_redis_cli(sock, "DBSIZE", out, sizeof out);
        spilled = atoi(out);
    }
    assert_int_equal(stat(f, "snapkv_store_spill_failures_total"), 1); /* refused at the cap */
    assert_true(spilled >= 8);
    fixture_redis_cli(sock, "FLUSHALL", out, sizeof out); /* other hosts took them */
    prefill_for(f, "p", 64, "policy=full", sid);
    fixture_redis_cli(sock, "DBSIZE", out, sizeof out);
    assert_string_equal(out, "1"); /* spilled: the cap's room counted again */
    assert_int_equal(stat(f, "snapkv_store_spill_failures_total"), 1);
}

static int teardown_with_redis(void **state)
{
    stream_teardown(state);
    return teardown(state);
}

/* A store that does not behave holds the engine no longer than store-timeout-ms a command (and
 * as much again a MiB of value) and makes it hold no more than it allows:
 * - a GETDEL answered a byte every 100 ms (each within the 300 ms timeout, which the socket's
 *   own timeout restarted at each byte): an error after 600 ms, not after the 5 s of its 50 bytes,
 *   with the progress callback run before each wait (the watchdog's beat);
 * - a SET answered with a 200 MB string (hiredis read what it was sent, without bound): the
 *   connection is dropped at its first line;
 * - an AUTH answered as Redis answers a command it does not know, quoting the arguments cut to
 *   their first 117 bytes: nothing of a 128-byte password reaches the log or the message (a check
 *   for the whole password in the answer let its start into the log). */
static void test_store_hostile(void **state)
{
    (void)state;
    char dir[] = "/tmp/skv-hostile-XXXXXX", url[160], log[160];
    assert_non_null(mkdtemp(dir));
    struct hostile_store h = {0};
    struct skv_store *st = NULL;
    const void *data = NULL;
    void *value = NULL;
    size_t got = 0;

    hostile_start(&h, HOSTILE_TRICKLE, dir);
    snprintf(url, sizeof url, "unix://%s", h.path);
    assert_int_equal(skv_store_new(url, 300, 1 << 30, &st), SKV_OK);
    int progress = 0; /* the worker beats for the watchdog there: a value moving slowly is alive */
    skv_store_on_progress(st, count_progress, &progress);
    uint64_t t0 = mono_ms();
    assert_int_equal(skv_store_take(st, "k", &data, &got, &value), SKV_E_IO);
    uint64_t took = mono_ms() - t0;
    assert_non_null(strstr(skv_error_msg(), "timed out"));
    assert_true(progress >= 4); /* each byte of the trickle came after a wait */
    skv_store_free(&st);
    hostile_stop(&h);
    printf("# a GETDEL answered a byte every 100 ms (timeout 300 ms): an error after %llu ms, %llu bytes read\n",
           (unsigned long long)took, (unsigned long long)atomic_load(&h.sent));
    /* the client gave up before the 50-byte value ended: the trickle stops at the first byte
     * it cannot send to the closed connection (no clock in the assertion) */
    assert_true(atomic_load(&h.sent) < 50);

    /* a value's length, then nothing: a failure after one wait (store-timeout-ms, 200 ms), not
     * after the time the value's size was given (512 MiB: 512 times 200 ms), which held the
     * engine past the watchdog's window. The bound is 150 times the timeout, to tell the two
     * apart on any machine, not a measure of speed */
    static const char silent[] = "$536870912\r\nxxxx";
    h.script = silent;
    h.script_n = sizeof silent - 1;
    hostile_start(&h, HOSTILE_SCRIPT, dir);
    assert_int_equal(skv_store_new(url, 200, 1 << 30, &st), SKV_OK);
    t0 = mono_ms();
    assert_int_equal(skv_store_take(st, "k", &data, &got, &value), SKV_E_IO);
    took = mono_ms() - t0;
    assert_non_null(strstr(skv_error_msg(), "timed out"));
    skv_store_free(&st);
    hostile_stop(&h);
    printf("# a GETDEL answered with a 512 MiB length and 4 bytes, then nothing (timeout 200 ms): an error after "
           "%llu ms\n", (unsigned long long)took);
    assert_true(took < 30000); /* before: 102 s */

    /* READONLY (the server a replica now, after a failover): the connection is dropped, so the
     * next command connects again (before, it stayed, and every command failed on it) */
    static const char readonly[] = "-READONLY You can't write against a read only replica.\r\n";
    h.script = readonly;
    h.script_n = sizeof readonly - 1;
    hostile_start(&h, HOSTILE_SCRIPT, dir);
    assert_int_equal(skv_store_new(url, 2000, 1 << 30, &st), SKV_OK);
    struct pattern_writer ro = {.n = 10, .fail_at = SIZE_MAX};
    assert_int_equal(skv_store_put_stream(st, "k", 10, 60, pattern_write, &ro), SKV_E_IO);
    assert_non_null(strstr(skv_error_msg(), "READONLY"));
    for (int i = 0; i < 100 && !atomic_load(&h.done); i++) /* (the store still open) */
        usleep(50 * 1000);
    assert_true(atomic_load(&h.done));
    skv_store_free(&st);
    hostile_stop(&h);

    hostile_start(&h, HOSTILE_HUGE_REPLY, dir);
    assert_int_equal(skv_store_new(url, 5000, 1 << 30, &st), SKV_OK);
    struct pattern_writer pw = {.n = 10, .fail_at = SIZE_MAX};
    assert_int_equal(skv_store_put_stream(st, "k", 10, 60, pattern_write, &pw), SKV_E_IO);
    assert_non_null(strstr(skv_error_msg(), "SET: an answer of a kind it does not have ('$')"));
    skv_store_free(&st);
    hostile_stop(&h);
    printf("# a SET answered with a 200 MB string: %llu bytes of it went out before the connection closed\n",
           (unsigned long long)atomic_load(&h.sent));
    assert_true(atomic_load(&h.sent) < (32u << 20));

    char pw128[129], pass[160];
    for (int i = 0; i < 128; i++)
        pw128[i] = (char)('A' + (i * 7) % 26);
    pw128[128] = '\0';
    char quoted[118];
    memcpy(quoted, pw128, 117);
    quoted[117] = '\0';
    h.quote = quoted;
    snprintf(pass, sizeof pass, "%s/pass", dir);
    write_file_mode(pass, pw128, 0600);
    snprintf(log, sizeof log, "%s/log", dir);
    assert_int_equal(skv_log_open(log), SKV_OK);
    hostile_start(&h, HOSTILE_QUOTE, dir);
    assert_int_equal(skv_store_new(url, 5000, 1 << 30, &st), SKV_OK);
    assert_int_equal(skv_store_auth(st, "", pass), SKV_OK);
    pw = (struct pattern_writer){.n = 10, .fail_at = SIZE_MAX};
    assert_int_equal(skv_store_put_stream(st, "k", 10, 60, pattern_write, &pw), SKV_E_IO);
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", skv_error_msg());
    skv_store_free(&st);
    hostile_stop(&h);
    assert_int_equal(skv_log_open(NULL), SKV_OK);
    FILE *f = fopen(log, "r");
    assert_non_null(f);
    char text[8192];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    assert_non_null(strstr(text, "AUTH refused (ERR)"));
    for (int i = 0; i + 16 <= 128; i++) {
        char piece[17];
        memcpy(piece, pw128 + i, 16);
        piece[16] = '\0';
        assert_null(strstr(text, piece));
        assert_null(strstr(msg, piece));
    }
    char cmd[200];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

/* SCAN, as EVICT walks the store with it: against a store that answers what it likes, a key
 * longer than 1024 bytes and one holding a NUL are read past and left out, and an array of more
 * keys than a page may have, or of another shape, is refused without being read on (and a
 * number with a sign or a space in any reply, which strtoll alone took); against
 * redis-server (skipped without it), a walk of 2500 keys of ours among 300 others finds each
 * of ours (a key may come twice in a walk) and no other, page by page, and GETRANGE gives a
 * value's last bytes (and none of a key with no value), 1200 keys pipelined in one batch; a
 * batch's answers that are errors (NOPERM, another, not a string) are each its key's, and a
 * batch whose answers stop coming times out, once for the whole batch. */
static void test_store_scan(void **state)
{
    (void)state;
    char dir[] = "/tmp/skv-scan-XXXXXX", url[240];
    assert_non_null(mkdtemp(dir));
    struct hostile_store h = {0};
    struct skv_store *st = NULL;
    char *keys = NULL;
    int n = 0;
    uint64_t cursor = 0;
    static char reply[8192];
    char longkey[2001];
    memset(longkey, 'k', 2000);
    longkey[2000] = '\0';
    int len = snprintf(reply, sizeof reply, "*2\r\n$2\r\n17\r\n*4\r\n$5\r\nfirst\r\n$2000\r\n%s\r\n$3\r\na", longkey);
    static const char rest[] = "\0b\r\n$6\r\nsecond\r\n"; /* the key "a\0b", then one more */
    memcpy(reply + len, rest, sizeof rest - 1);
    h.script = reply;
    h.script_n = (size_t)len + sizeof rest - 1;
    hostile_start(&h, HOSTILE_SCRIPT, dir);
    snprintf(url, sizeof url, "unix://%s", h.path);
    assert_int_equal(skv_store_new(url, 2000, 1 << 30, &st), SKV_OK);
    assert_int_equal(skv_store_scan(st, &cursor, "snapkv:*", &keys, &n), SKV_OK);
    assert_int_equal(n, 2);
    assert_int_equal(cursor, 17);
    assert_string_equal(keys, "first");
    assert_string_equal(keys + 6, "second");
    skv_store_value_free(keys);
    skv_store_free(&st);
    hostile_stop(&h);
    const char *bad[][2] = {
        {"*2\r\n$1\r\n0\r\n*20001\r\n", "('*20001')"},
        {"*3\r\n$1\r\n0\r\n*0\r\n", "('*3')"},
        {"*2\r\n$1\r\nx\r\n*0\r\n", "a cursor that is not one"},
        {"*2\r\n$2\r\n+1\r\n*0\r\n", "a cursor that is not one"},
        {"*2\r\n$1\r\n0ab*0\r\n", "a cursor that is not one"},
        {"* 2\r\n", "('* 2')"},
        {"*2\r\n$1\r\n0\r\n*1\r\n$3\r\nabcde\r\n", "a string not ended as it should be"},
        {"+OK\r\n", "an unexpected answer ('+')"},
        {"-ERR unknown command 'SCAN'\r\n", "SCAN: ERR unknown command"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        h.script = bad[i][0];
        h.script_n = strlen(bad[i][0]);
        hostile_start(&h, HOSTILE_SCRIPT, dir);
        assert_int_equal(skv_store_new(url, 2000, 1 << 30, &st), SKV_OK);
        cursor = 0;
        assert_int_equal(skv_store_scan(st, &cursor, "snapkv:*", &keys, &n), SKV_E_IO);
        if (!strstr(skv_error_msg(), bad[i][1]))
            fail_msg("answer %zu: %s", i, skv_error_msg());
        assert_null(keys);
        assert_int_equal(n, 0);
        skv_store_free(&st);
        hostile_stop(&h);
    }
    /* a number of another form in any reply (strtoll alone takes a sign and spaces) */
    const char *loose[] = {"$+3\r\nabc\r\n", "$ 3\r\nabc\r\n", ": 1\r\n", ":+1\r\n"};
    for (size_t i = 0; i < sizeof loose / sizeof *loose; i++) {
        h.script = loose[i];
        h.script_n = strlen(loose[i]);
        hostile_start(&h, HOSTILE_SCRIPT, dir);
        assert_int_equal(skv_store_new(url, 2000, 1 << 30, &st), SKV_OK);
        const void *data = NULL;
        void *value = NULL;
        size_t got = 0;
        int rc = i < 2 ? skv_store_take(st, "k", &data, &got, &value) : skv_store_exists(st, "k");
        assert_int_equal(rc, SKV_E_IO);
        if (!strstr(skv_error_msg(), "an answer of a kind it does not have"))
            fail_msg("answer '%s': %s", loose[i], skv_error_msg());
        skv_store_free(&st);
        hostile_stop(&h);
    }
    /* GETRANGEs pipelined: each key's answer is its own, an error's too, and the connection
     * stays in step (the next batch reads its own answers) */
    const struct {
        const char *script, *why;
        int rc;
        bool refused;
        signed char state[3];
        size_t got[3];
    } tails[] = {
        {"$2\r\nab\r\n$-1\r\n$4\r\nwxyz\r\n", NULL, SKV_OK, false,
         {SKV_TAIL_VALUE, SKV_TAIL_VALUE, SKV_TAIL_VALUE}, {2, 0, 4}},
        {"$2\r\nab\r\n-NOPERM no\r\n$-1\r\n", "GETRANGE: NOPERM no", SKV_E_IO, true,
         {SKV_TAIL_VALUE, SKV_TAIL_REFUSED, SKV_TAIL_VALUE}, {2, 0, 0}},
        {"-NOPERM first\r\n-ERR other\r\n$1\r\na\r\n", "GETRANGE: ERR other", SKV_E_IO, false,
         {SKV_TAIL_REFUSED, SKV_TAIL_ERROR, SKV_TAIL_VALUE}, {0, 0, 1}},
        {"$2\r\nab\r\n:3\r\n$1\r\na\r\n", "an unexpected answer (':')", SKV_E_IO, false,
         {SKV_TAIL_VALUE, SKV_TAIL_ERROR, SKV_TAIL_VALUE}, {2, 0, 1}},
        {"$2\r\nab\r\n", "timed out", SKV_E_IO, false, {0}, {0}}, /* two answers never come */
    };
    for (size_t i = 0; i < sizeof tails / sizeof *tails; i++) {
        h.script = tails[i].script;
        h.script_n = strlen(tails[i].script);
        hostile_start(&h, HOSTILE_SCRIPT, dir);
        assert_int_equal(skv_store_new(url, 500, 1 << 30, &st), SKV_OK);
        const char *tk[3] = {"snapkv:a", "snapkv:b", "snapkv:c"};
        unsigned char out[3 * 4];
        size_t got[3];
        signed char tstate[3];
        int rc = skv_store_tails(st, tk, 3, 4, out, got, tstate);
        if (rc != tails[i].rc || (rc && !strstr(skv_error_msg(), tails[i].why)))
            fail_msg("tails %zu: %d %s", i, rc, skv_error_msg());
        assert_int_equal(skv_store_refused(st), tails[i].refused);
        for (int j = 0; i < 4 && j < 3; j++) {
            assert_int_equal(tstate[j], tails[i].state[j]);
            assert_int_equal(got[j], tails[i].got[j]);
        }
        if (i == 0)
            assert_memory_equal(out, "ab", 2);
        if (i == 0)
            assert_memory_equal(out + 8, "wxyz", 4);
        skv_store_free(&st);
        hostile_stop(&h);
    }
    /* a batch whose answers stop after 20 of its 25: one store-timeout-ms (300) for all of it
     * (before, each answer read gave it one more: 6.3 s) */
    static char twenty[20 * 7 + 1];
    for (int i = 0; i < 20; i++)
        memcpy(twenty + 7 * i, "$1\r\nx\r\n", 7);
    h.script = twenty;
    h.script_n = 20 * 7;
    hostile_start(&h, HOSTILE_SCRIPT, dir);
    assert_int_equal(skv_store_new(url, 300, 1 << 30, &st), SKV_OK);
    const char *tk25[25];
    for (int i = 0; i < 25; i++)
        tk25[i] = "snapkv:k";
    unsigned char out25[25 * 4];
    size_t got25[25];
    signed char state25[25];
    uint64_t t0 = mono_ms();
    assert_int_equal(skv_store_tails(st, tk25, 25, 4, out25, got25, state25), SKV_E_IO);
    uint64_t took = mono_ms() - t0;
    if (!strstr(skv_error_msg(), "timed out") || took > 3000)
        fail_msg("a batch whose answers stopped: %llu ms, %s", (unsigned long long)took, skv_error_msg());
    skv_store_free(&st);
    hostile_stop(&h);
    char cmd[100];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);

    char sock[200];
    stream_redis_start("0", NULL, sock, sizeof sock);
    snprintf(url, sizeof url, "unix://%s", sock);
    assert_int_equal(skv_store_new(url, 5000, 1 << 30, &st), SKV_OK);
    char key[64];
    for (int i = 0; i < 2800; i++) {
        snprintf(key, sizeof key, i < 2500 ? "snapkv:fp:t:%04d" : "other:%04d", i);
        assert_int_equal(skv_store_put_back(st, key, "0123456789", 10, 600), SKV_OK);
    }
    static bool seen[2500];
    int pages = 0, found = 0;
    cursor = 0;
    do {
        assert_int_equal(skv_store_scan(st, &cursor, "snapkv:fp:t:*", &keys, &n), SKV_OK);
        const char *k = keys;
        for (int i = 0; i < n; i++, k += strlen(k) + 1) {
            int at = -1;
            assert_int_equal(sscanf(k, "snapkv:fp:t:%d", &at), 1);
            assert_true(at >= 0 && at < 2500);
            found += !seen[at];
            seen[at] = true;
        }
        skv_store_value_free(keys);
        pages++;
    } while (cursor);
    assert_int_equal(found, 2500);
    assert_true(pages >= 2); /* (1000 keys looked at a page) */
    /* 1200 GETRANGEs in one batch (every fifth key has no value), then a batch of one on the
     * same connection */
    enum { NT = 1200 };
    static char tkey[NT][32];
    static const char *tk[NT];
    static unsigned char tail[NT * 4];
    static size_t got[NT];
    static signed char tstate[NT];
    for (int i = 0; i < NT; i++) {
        snprintf(tkey[i], sizeof tkey[i], i % 5 == 4 ? "snapkv:fp:t:none%d" : "snapkv:fp:t:%04d", i);
        tk[i] = tkey[i];
    }
    assert_int_equal(skv_store_tails(st, tk, NT, 4, tail, got, tstate), SKV_OK);
    for (int i = 0; i < NT; i++) {
        assert_int_equal(tstate[i], SKV_TAIL_VALUE);
        assert_int_equal(got[i], i % 5 == 4 ? 0 : 4);
        if (i % 5 != 4)
            assert_memory_equal(tail + (size_t)i * 4, "6789", 4);
    }
    tk[0] = "snapkv:fp:t:0007";
    assert_int_equal(skv_store_tails(st, tk, 1, 8, tail, got, tstate), SKV_OK);
    assert_int_equal(got[0], 8);
    assert_memory_equal(tail, "23456789", 8);
    skv_store_free(&st);
}

/* store-user and store-password-file: the file's checks (one line, not empty, a regular file
 * that other users, and a group but root's, cannot read); a url that could hold a password is
 * refused without echoing it; against a redis-server that asks for a password (skipped when it
 * is not installed): no AUTH is the store's NOAUTH, a wrong password its WRONGPASS (the message
 * says so, never the password), the right one for the default user and for an ACL user works,
 * and a password changed in the store and in the file is used from the next connection. */
static void test_store_auth(void **state)
{
    (void)state;
    char pass[128], cmd[300];
    snprintf(g_auth_dir, sizeof g_auth_dir, "/tmp/skv-test-auth-XXXXXX");
    assert_non_null(mkdtemp(g_auth_dir));
    snprintf(pass, sizeof pass, "%s/pass", g_auth_dir);
    char pw[64];
    const char *longest = "01234567890123456789012345678901234567890123456789012345678901\n"; /* 63 bytes */
    const struct {
        const char *text;
        mode_t mode;
        bool other_group; /* the file's group is not root's */
        bool other_owner; /* it belongs to another user (as root only) */
        int rc;
        const char *said; /* in the message, or the password read */
    } files[] = {
        {"s3cret\n", 0600, true, false, SKV_OK, "s3cret"},
        {"s3cret\n", 0600, false, true, SKV_E_PERM, "belongs to uid 65534"},
        {"s3cret\r\n", 0600, false, false, SKV_OK, "s3cret"},
        {"s3cret", 0400, false, false, SKV_OK, "s3cret"},
        {longest, 0600, false, false, SKV_OK, "01234567890123456789012345678901234567890123456789012345678901"},
        {"s3cret\n", 0644, false, false, SKV_E_PERM, "chmod o-rwx"},
        {"s3cret\n", 0604, false, false, SKV_E_PERM, "chmod o-rwx"},
        {"s3cret\n", 0640, true, false, SKV_E_PERM, "its group may read it"},
        {"", 0600, false, false, SKV_E_INVAL, "empty"},
        {"\n", 0600, false, false, SKV_E_INVAL, "empty"},
        {"one\ntwo\n", 0600, false, false, SKV_E_INVAL, "one line"},
        {"0123456789012345678901234567890123456789012345678901234567890123", 0600, false, false, SKV_E_INVAL,
         "more than 63"},
    };
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        write_file_mode(pass, files[i].text, files[i].mode);
        if (files[i].other_group && geteuid() == 0) { /* (not root: the file's group is the user's) */
            snprintf(cmd, sizeof cmd, "chgrp 65534 %s", pass);
            assert_int_equal(system(cmd), 0);
        }
        if (files[i].other_owner && geteuid() != 0) {
            assert_int_equal(unlink(pass), 0);
            continue;
        }
        if (files[i].other_owner)
            assert_int_equal(chown(pass, 65534, (gid_t)-1), 0);
        memset(pw, 'x', sizeof pw);
        assert_int_equal(skv_store_read_password(pass, pw, sizeof pw), files[i].rc);
        if (files[i].rc == SKV_OK) {
            assert_string_equal(pw, files[i].said);
        } else {
            assert_non_null(strstr(skv_error_msg(), files[i].said));
            assert_non_null(strstr(skv_error_msg(), pass));
            assert_int_equal(pw[0], 0); /* nothing of it left behind */
        }
        assert_int_equal(unlink(pass), 0);
    }
    /* store-secret-file: read as a password file, at least 16 bytes, its BLAKE2b-256 the key */
    unsigned char key[SKV_STORE_KEY_BYTES], key2[SKV_STORE_KEY_BYTES];
    write_file_mode(pass, "fifteen bytes!!\n", 0600);
    assert_int_equal(skv_store_read_key(pass, NULL, key), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "store-secret-file"));
    assert_non_null(strstr(skv_error_msg(), "at least 16"));
    write_file_mode(pass, "sixteen bytes!!!\n", 0644);
    assert_int_equal(skv_store_read_key(pass, NULL, key), SKV_E_PERM);
    assert_non_null(strstr(skv_error_msg(), "store-secret-file"));
    write_file_mode(pass, "sixteen bytes!!!\n", 0600);
    assert_int_equal(skv_store_read_key(pass, NULL, key), SKV_OK);
    write_file_mode(pass, "sixteen bytes!!!", 0600); /* the newline is not the secret's */
    assert_int_equal(skv_store_read_key(pass, NULL, key2), SKV_OK);
    assert_memory_equal(key, key2, sizeof key);
    write_file_mode(pass, "sixteen bytes!!?", 0600);
    assert_int_equal(skv_store_read_key(pass, NULL, key2), SKV_OK);
    assert_memory_not_equal(key, key2, sizeof key);
    char pass2[160];
    snprintf(pass2, sizeof pass2, "%s/pass2", g_auth_dir); /* the store's password: refused */
    write_file_mode(pass2, "sixteen bytes!!?\n", 0600);
    assert_int_equal(skv_store_read_key(pass, pass2, key2), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "holds the store's password"));
    write_file_mode(pass2, "another password\n", 0600);
    assert_int_equal(skv_store_read_key(pass, pass2, key2), SKV_OK);
    /* store-accept-secret-file (a rotation's second secret): checked as the first, another one */
    struct skv_config cfg;
    assert_int_equal(skv_config_init(&cfg), SKV_OK);
    assert_int_equal(skv_config_set(&cfg, "store", "redis://127.0.0.1:1"), SKV_OK); /* (not connected) */
    assert_int_equal(skv_config_set(&cfg, "store-secret-file", pass), SKV_OK);
    assert_int_equal(skv_config_set(&cfg, "store-accept-secret-file", pass2), SKV_OK);
    struct skv_store *sto = NULL;
    unsigned char acc[SKV_STORE_KEY_BYTES];
    bool is_signed = false, has_accept = false;
    write_file_mode(pass2, "sixteen bytes!!?\n", 0600); /* the same secret */
    assert_int_equal(skv_store_open(&cfg, &sto, key, &is_signed, acc, &has_accept), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "holds the secret store-secret-file"));
    assert_null(sto);
    write_file_mode(pass2, "short\n", 0600);
    assert_int_equal(skv_store_open(&cfg, &sto, key, &is_signed, acc, &has_accept), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "store-accept-secret-file"));
    assert_non_null(strstr(skv_error_msg(), "at least 16"));
    write_file_mode(pass2, "the secret before this one\n", 0600);
    assert_int_equal(skv_store_open(&cfg, &sto, key, &is_signed, acc, &has_accept), SKV_OK);
    assert_true(is_signed && has_accept);
    assert_memory_equal(key, key2, sizeof key); /* pass's */
    assert_memory_not_equal(key, acc, sizeof key);
    skv_store_free(&sto);
    assert_int_equal(skv_config_set(&cfg, "store-accept-secret-file", ""), SKV_OK);
    assert_int_equal(skv_store_open(&cfg, &sto, key, &is_signed, acc, &has_accept), SKV_OK);
    assert_true(is_signed && !has_accept);
    skv_store_free(&sto);
    skv_config_free(&cfg);
    assert_int_equal(unlink(pass2), 0);
    assert_int_equal(unlink(pass), 0);
    if (geteuid() == 0) { /* root's group may read it: systemd's credentials */
        write_file_mode(pass, "s3cret\n", 0440);
        assert_int_equal(skv_store_read_password(pass, pw, sizeof pw), SKV_OK);
        assert_int_equal(unlink(pass), 0);
    }
    assert_int_equal(skv_store_read_password(pass, pw, sizeof pw), SKV_E_IO); /* none */
    assert_non_null(strstr(skv_error_msg(), "No such file"));
    assert_int_equal(skv_store_read_password(g_auth_dir, pw, sizeof pw), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "not a regular file"));
    snprintf(cmd, sizeof cmd, "mkfifo -m 0600 %s", pass); /* not opened to wait for a writer */
    assert_int_equal(system(cmd), 0);
    assert_int_equal(skv_store_read_password(pass, pw, sizeof pw), SKV_E_INVAL);
    assert_int_equal(unlink(pass), 0);

    /* a url that could hold a password: refused, and the password is not in the message */
    struct skv_store *st = NULL;
    const char *secret_urls[] = {"redis://alice:hunter2@cache:6379", "redis://:hunter2@cache",
                                 "rediss://alice:hunter2@cache", "unix://:hunter2@/run/redis.sock",
                                 "redis://cache/0?password=hunter2", "unix:///run/redis.sock?password=hunter2"};
    for (size_t i = 0; i < sizeof secret_urls / sizeof *secret_urls; i++) {
        assert_int_equal(skv_store_new(secret_urls[i], 100, 1 << 30, &st), SKV_E_INVAL);
        assert_null(st);
        assert_null(strstr(skv_error_msg(), "hunter2"));
        assert_non_null(strstr(skv_error_msg(), "store-password-file"));
    }
    assert_int_equal(skv_store_new("unix:///run/redis/redis.sock", 100, 1 << 30, &st), SKV_OK);
    assert_int_equal(skv_store_auth(st, "alice", NULL), SKV_E_INVAL); /* a user needs a password */
    assert_non_null(strstr(skv_error_msg(), "store-password-file"));
    assert_int_equal(skv_store_auth(st, "al ice", pass), SKV_E_INVAL);
    assert_int_equal(skv_store_auth(st, NULL, pass), SKV_E_IO); /* no such file */
    write_file_mode(pass, "s3cret\n", 0604);
    assert_int_equal(skv_store_auth(st, NULL, pass), SKV_E_PERM);
    assert_int_equal(skv_store_auth(st, NULL, NULL), SKV_OK);
    skv_store_free(&st);

    /* a redis-server with a password for its default user and an ACL user */
    char sock[200], url[220], out[200] = "";
    const char *extra[] = {"--requirepass", "s3cret", "--user", "alice", "on", ">wonder", "~*", "+@all", NULL};
    setenv("REDISCLI_AUTH", "s3cret", 1);
    stream_redis_start("0", extra, sock, sizeof sock);
    snprintf(url, sizeof url, "unix://%s", sock);
    struct pattern_writer pwr = {.n = 10, .fail_at = SIZE_MAX};
    const void *data = NULL;
    void *value = NULL;
    size_t got = 0;
    assert_int_equal(skv_store_new(url, 5000, 1 << 30, &st), SKV_OK); /* no AUTH */
    assert_int_equal(skv_store_put_stream(st, "k", 10, 60, pattern_write, &pwr), SKV_E_IO);
    assert_non_null(strstr(skv_error_msg(), "NOAUTH"));
    skv_store_free(&st);

    write_file_mode(pass, "not-it\n", 0600); /* wrong: the store's answer; the store is down */
    assert_int_equal(skv_store_new(url, 5000, 1 << 30, &st), SKV_OK);
    assert_int_equal(skv_store_auth(st, NULL, pass), SKV_OK);
    assert_int_equal(skv_store_take(st, "k", &data, &got, &value), SKV_E_IO);
    assert_non_null(strstr(skv_error_msg(), "AUTH refused (WRONGPASS)"));
    assert_null(strstr(skv_error_msg(), "not-it"));
    assert_int_equal(skv_store_take(st, "k", &data, &got, &value), SKV_E_IO);
    assert_non_null(strstr(skv_error_msg(), "tried again in"));
    skv_store_free(&st);

    write_file_mode(pass, "s3cret\n", 0600); /* the default user's */
    assert_int_equal(skv_store_new(url, 5000, 1 << 30, &st), SKV_OK);
    assert_int_equal(skv_store_auth(st, "", pass), SKV_OK);
    pwr = (struct pattern_writer){.n = 10, .fail_at = SIZE_MAX};
    assert_int_equal(skv_store_put_stream(st, "k", 10, 60, pattern_write, &pwr), SKV_OK);
    fixture_redis_cli(sock, "STRLEN k", out, sizeof out);
    assert_string_equal(out, "10");
    skv_store_free(&st);

    write_file_mode(pass, "s3cret\n", 0600); /* alice with the default user's password */
    assert_int_equal(skv_store_new(url, 5000, 1 << 30, &st), SKV_OK);
    assert_int_equal(skv_store_auth(st, "alice", pass), SKV_OK);
    assert_int_equal(skv_store_take(st, "k", &data, &got, &value), SKV_E_IO);
    assert_non_null(strstr(skv_error_msg(), "AUTH refused (WRONGPASS)"));
    skv_store_free(&st);

    write_file_mode(pass, "wonder\n", 0600); /* alice's own */
    assert_int_equal(skv_store_new(url, 5000, 1 << 30, &st), SKV_OK);
    assert_int_equal(skv_store_auth(st, "alice", pass), SKV_OK);
    assert_int_equal(skv_store_take(st, "k", &data, &got, &value), SKV_OK);
    assert_int_equal(got, 10);
    skv_store_value_free(value);
    fixture_redis_cli(sock, "CLIENT LIST | grep -c user=alice", out, sizeof out);
    assert_string_equal(out, "1");

    /* the password rotated: in the store, then in the file; the connection made with the old one
     * goes on, and the next connection (this one closed by the server) logs in with the new */
    fixture_redis_cli(sock, "ACL SETUSER alice resetpass '>rabbit'", out, sizeof out);
    assert_string_equal(out, "OK");
    write_file_mode(pass, "rabbit\n", 0600);
    pwr = (struct pattern_writer){.n = 10, .fail_at = SIZE_MAX};
    assert_int_equal(skv_store_put_stream(st, "k2", 10, 60, pattern_write, &pwr), SKV_OK);
    fixture_redis_cli(sock, "CLIENT KILL USER alice", out, sizeof out);
    assert_string_equal(out, "1");
    usleep(100 * 1000); /* the close reaches the client's side */
    assert_int_equal(skv_store_take(st, "k2", &data, &got, &value), SKV_OK);
    assert_int_equal(got, 10);
    skv_store_value_free(value);
    struct skv_store_stats ss;
    skv_store_stats(st, &ss);
    assert_int_equal(ss.loads, 2);
    assert_int_equal(ss.load_failures, 0);
    skv_store_free(&st);

    /* a store that does not know AUTH quotes its arguments in its answer: not in the message */
    kill(g_stream_redis, SIGKILL);
    waitpid(g_stream_redis, NULL, 0);
    g_stream_redis = 0;
    remove_test_dir(g_stream_dir);
    unsetenv("REDISCLI_AUTH");
    const char *no_auth[] = {"--rename-command", "AUTH", "", NULL};
    stream_redis_start("0", no_auth, sock, sizeof sock);
    snprintf(url, sizeof url, "unix://%s", sock);
    write_file_mode(pass, "quoted-secret\n", 0600);
    assert_int_equal(skv_store_new(url, 5000, 1 << 30, &st), SKV_OK);
    assert_int_equal(skv_store_auth(st, NULL, pass), SKV_OK);
    assert_int_equal(skv_store_take(st, "k", &data, &got, &value), SKV_E_IO);
    assert_non_null(strstr(skv_error_msg(), "AUTH refused (ERR)"));
    assert_null(strstr(skv_error_msg(), "quoted-secret"));
    skv_store_free(&st);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_client_gone, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ipc_lru, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ipc_stated_size, setup, teardown),
        cmocka_unit_test_setup_teardown(test_device_lost, setup, teardown),
        cmocka_unit_test_setup_teardown(test_append_over_quota, setup, teardown),
        cmocka_unit_test_setup_teardown(test_append_text_no_bos, setup, teardown),
        cmocka_unit_test_setup_teardown(test_prefill_over_quota, setup, teardown),
        cmocka_unit_test_setup_teardown(test_prefix_reuse_quota, setup, teardown),
        cmocka_unit_test_setup_teardown(test_prefix_retain, setup, teardown),
        cmocka_unit_test_setup_teardown(test_refusal_keeps_prefixes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_prefix_retain_tenants, setup, teardown),
        cmocka_unit_test_setup_teardown(test_prefix_retain_shared, setup, teardown),
        cmocka_unit_test_setup_teardown(test_prefix_retain_host, setup, teardown),
        cmocka_unit_test_setup_teardown(test_prefix_retain_covered, setup, teardown),
        cmocka_unit_test_setup_teardown(test_prefix_keep_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_prefix_keep_room_shared, setup, teardown),
        cmocka_unit_test_setup_teardown(test_prefix_retain_random, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ring_counts_in_quota, setup, teardown),
        cmocka_unit_test_setup_teardown(test_decode_over_quota, setup, teardown),
        cmocka_unit_test_setup_teardown(test_decode_fails_midway, setup, teardown),
        cmocka_unit_test_setup_teardown(test_upkeep_failure_keeps_rows, setup, teardown),
        cmocka_unit_test_setup_teardown(test_upkeep_cut_fails, setup, teardown),
        cmocka_unit_test_setup_teardown(test_decode_group_alloc_fails_alone, setup, teardown),
        cmocka_unit_test_setup_teardown(test_max_sessions, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_max_sessions, setup, teardown),
        cmocka_unit_test_setup_teardown(test_decode_ids_outside_vocab, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gone_decode_in_yield, setup, teardown),
        cmocka_unit_test_setup_teardown(test_overtake_fair, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stop_ends_forward, setup, teardown),
        cmocka_unit_test_setup_teardown(test_import_not_finite, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ipc_handle_tcp_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fork_keeps_source, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shm_buffers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_import_over_quota, setup, teardown),
        cmocka_unit_test_setup_teardown(test_admit, setup, teardown),
        cmocka_unit_test_setup_teardown(test_queued_bytes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_tenant_queue_share, setup, teardown),
        cmocka_unit_test_setup_teardown(test_watchdog, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lease_limit, setup, teardown),
        cmocka_unit_test_setup_teardown(test_decode_limits, setup, teardown),
        cmocka_unit_test_setup_teardown(test_decode_client_gone, setup, teardown),
        cmocka_unit_test_setup_teardown(test_decode_yield, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cancel_decode, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cancel_past_deadline, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cancel_own, setup, teardown),
        cmocka_unit_test_setup_teardown(test_overtake, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fair_order, setup, teardown),
        cmocka_unit_test_setup_teardown(test_tenant_stats, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gone_drops_queued, setup, teardown),
        cmocka_unit_test_setup_teardown(test_deadline, setup, teardown),
        cmocka_unit_test_setup_teardown(test_tenant_weights, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nested, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nested_room, setup, teardown),
        cmocka_unit_test_setup_teardown(test_evict_side_cache, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nested_keep, setup, teardown),
        cmocka_unit_test_setup_teardown(test_compress_stops, setup, teardown),
        cmocka_unit_test_setup_teardown(test_compress_room, setup, teardown),
        cmocka_unit_test_setup_teardown(test_load_room, setup, teardown),
        cmocka_unit_test_setup_teardown(test_load_saved_spec, setup, teardown),
        cmocka_unit_test_setup_teardown(test_saved_after_failed_step, setup, teardown),
        cmocka_unit_test_setup_teardown(test_load_legacy_fingerprint, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_spilled, setup, teardown_with_redis),
        cmocka_unit_test_setup_teardown(test_store_past_limits, setup, teardown_with_redis),
        cmocka_unit_test_setup_teardown(test_store_recount, setup, teardown_with_redis),
        cmocka_unit_test_setup_teardown(test_nested_room_inner, setup, teardown),
        cmocka_unit_test_setup_teardown(test_append_copy_ring, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fair_share_forks, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fair_share_idle_forks, setup, teardown),
        cmocka_unit_test_setup_teardown(test_evict_frees, setup, teardown),
        cmocka_unit_test_setup_teardown(test_evict_idle_fork, setup, teardown),
        cmocka_unit_test_setup_teardown(test_decode_round_room, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist, setup, teardown),
        cmocka_unit_test_setup_teardown(test_kv_f16_persist, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_older_files, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_checkpoint, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_checkpoint_fails, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_smaller_pool, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_set_aside, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_other_version, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_checkpoint_late, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_fresh_store_late, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_fresh_store_fails, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_rows_meta, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_unordered, setup, teardown),
        cmocka_unit_test_setup_teardown(test_compress_order_room, setup, teardown),
        cmocka_unit_test_setup_teardown(test_load_past_limits, setup, teardown),
        cmocka_unit_test_setup_teardown(test_save_tmp, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_version5, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_kept, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_kept_store_fails, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_kept_store_fails_later, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_kept_manifest, setup, teardown),
        cmocka_unit_test_setup_teardown(test_decode_share, setup, teardown),
        cmocka_unit_test_setup_teardown(test_append_stops, setup, teardown),
        cmocka_unit_test(test_store_urls),
        cmocka_unit_test_teardown(test_store_stream, stream_teardown),
        cmocka_unit_test_teardown(test_store_slow_lookup, stream_teardown),
        cmocka_unit_test_teardown(test_store_auth, stream_teardown),
        cmocka_unit_test(test_store_hostile),
        cmocka_unit_test_teardown(test_store_scan, stream_teardown),
    };
    if (getenv("SKV_TEST_FILTER")) /* e.g. SKV_TEST_FILTER=test_persist: one test */
        cmocka_set_test_filter(getenv("SKV_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
