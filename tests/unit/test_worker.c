/* The engine worker's client-gone notice, without a GPU: the tiny model's CPU backend gets an
 * ipc_open that hands out host buffers (the CPU copy ops take them as device memory), so
 * EXPORT_KV over "CUDA" buffers runs through the real worker thread and queue. A notice for
 * client X closes X's buffers, also one opened by a request queued just before the notice,
 * and leaves client Y's and the admin endpoint's (same routing id as X) open until the worker
 * stops; STATS counts the disconnect once and the buffers it closed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/status.h"
#include "daemon/config.h"
#include "daemon/worker.h"
#include "kernels/backend.h"
#include "proto/snapkv.pb-c.h"
#include "tests/common/tiny.h"

#define REPLIES "inproc://test-worker-replies"
#define N_FAKE 8
#define FAKE_BYTES (1 << 20)

/* The fake device: buffer k (handle byte 0 == k, 1..N_FAKE-1), opens and closes per buffer. */
static char g_mem[N_FAKE][FAKE_BYTES];
static int g_opened[N_FAKE], g_closed[N_FAKE];
static struct skv_backend_ops g_ops;

static int fake_ipc_open(struct skv_backend *be, const void *handle, size_t handle_len, void **out)
{
    (void)be;
    int k = ((const uint8_t *)handle)[0];
    if (handle_len != 64 || k < 1 || k >= N_FAKE)
        return skv_errorf(SKV_E_INVAL, "fake ipc_open: no buffer %d", k);
    g_opened[k]++;
    *out = g_mem[k];
    return SKV_OK;
}

static void fake_ipc_close(struct skv_backend *be, void *ptr)
{
    (void)be;
    for (int k = 1; k < N_FAKE; k++)
        if (ptr == g_mem[k])
            g_closed[k]++;
}

struct fixture {
    struct tiny *tiny;
    struct skv_config cfg;
    void *zctx, *pull;
    struct skv_worker *w;
};

static const uint8_t ID_X[5] = {0, 0x6b, 0x8b, 0x45, 0x67}, ID_Y[5] = {0, 0x6b, 0x8b, 0x45, 0x68};

/* A job for (sock, identity) from a packed request: the worker frees what unpack allocated. */
static struct skv_job *job_new(int sock, const uint8_t *id, size_t id_len, Snapkv__Request *req)
{
    req->version = 1;
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
    memcpy(job->identity, id, id_len);
    job->identity_len = id_len;
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
    assert_int_equal(skv_worker_submit(f->w, job_new(sock, id, 5, req)), SKV_OK);
    return next_reply(f, sock, id, 5);
}

/* EXPORT_KV of layer 0 into fake buffer k, queued (the reply is read by the caller). */
static void submit_export(struct fixture *f, int sock, const uint8_t *id, const uint8_t sid[16], int k)
{
    uint8_t handle[64] = {(uint8_t)k};
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
    assert_int_equal(skv_worker_submit(f->w, job_new(sock, id, 5, &req)), SKV_OK);
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

/* STATS from the admin endpoint: the value of metric `name`. */
static double stat(struct fixture *f, const char *name)
{
    static const uint8_t admin[5] = {0, 1, 2, 3, 4};
    Snapkv__StatsRequest sr = SNAPKV__STATS_REQUEST__INIT;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_STATS;
    req.stats = &sr;
    Snapkv__Reply *rep = call(f, 1, admin, &req);
    assert_int_equal(rep->status, SKV_OK);
    double v = -1;
    for (size_t i = 0; i < rep->stats->n_stats; i++)
        if (strcmp(rep->stats->stats[i]->name, name) == 0)
            v = rep->stats->stats[i]->value;
    snapkv__reply__free_unpacked(rep, NULL);
    if (v < 0)
        fail_msg("no metric %s", name);
    return v;
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
    be->ops = &g_ops;
    if (skv_config_init(&f->cfg))
        return -1;
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
    for (int i = 0; i < 8; i++)
        tokens[i] = (uint32_t)f->tiny->ids[i];
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
    assert_memory_equal(g_opened, want_opened, sizeof want_opened);
    assert_memory_equal(g_closed, want_closed, sizeof want_closed);
    static const char zero[256];
    assert_true(memcmp(g_mem[2], zero, sizeof zero) != 0); /* the export really wrote buffer 2 */

    /* a later notice for X (a request read after its connection closed) is not counted again */
    assert_int_equal(skv_worker_client_gone(f->w, ID_X, sizeof ID_X, false), SKV_OK);
    assert_int_equal(stat(f, "snapkv_client_disconnects_total"), 1);
    assert_int_equal(stat(f, "snapkv_cuda_buffers_closed_on_disconnect_total"), 2);

    /* Y's and the admin endpoint's stay until the worker stops */
    assert_int_equal(g_closed[3] + g_closed[4], 0);
    skv_worker_stop(&f->w);
    int want_end[N_FAKE] = {0, 1, 1, 1, 1};
    assert_memory_equal(g_closed, want_end, sizeof want_end);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_client_gone, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
