/* libsnapkv: one DEALER socket per client, request/reply envelopes from proto/snapkv.proto,
 * status codes and the thread-local last error. Never logs. */
#include "libclient/snapkv.h"
#include "common/status.h"
#include "proto/snapkv.pb-c.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

_Static_assert((int)SNAPKV_E_INTERNAL == (int)SKV_E_INTERNAL, "client and daemon status codes differ");
_Static_assert((int)SNAPKV_E_POOL_FULL == (int)SKV_E_POOL_FULL, "client and daemon status codes differ");

struct snapkv_client {
    void *zctx;
    void *sock;
    char *tenant;
    int timeout_ms;
    uint64_t next_request_id;
    Snapkv__HelloReply *hello;   /* kept for snapkv_server_info */
};

static _Thread_local char last_error[512];

static int fail(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

const char *snapkv_last_error(void)
{
    return last_error;
}

const char *snapkv_status_str(int status)
{
    return skv_status_str(status);
}

/* Sends req (version, id and tenant filled in here) and waits for its final reply.
 * On success *reply_out owns the reply (free with snapkv__reply__free_unpacked). */
static int call(snapkv_client_t *c, Snapkv__Request *req, Snapkv__Reply **reply_out)
{
    req->version = SNAPKV_PROTOCOL_VERSION;
    req->request_id = ++c->next_request_id;
    req->tenant = c->tenant;
    size_t len = snapkv__request__get_packed_size(req);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf)
        return fail(SNAPKV_E_NOMEM, "out of memory packing a request");
    snapkv__request__pack(req, buf);
    int rc = zmq_send(c->sock, buf, len, 0);
    free(buf);
    if (rc < 0)
        return fail(SNAPKV_E_IO, "send: %s", zmq_strerror(zmq_errno()));

    for (;;) {
        zmq_pollitem_t item = {.socket = c->sock, .events = ZMQ_POLLIN};
        rc = zmq_poll(&item, 1, c->timeout_ms);
        if (rc < 0)
            return fail(SNAPKV_E_IO, "poll: %s", zmq_strerror(zmq_errno()));
        if (rc == 0)
            return fail(SNAPKV_E_TIMEOUT, "no reply from the daemon within %d ms", c->timeout_ms);
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, c->sock, 0) < 0) {
            zmq_msg_close(&msg);
            return fail(SNAPKV_E_IO, "recv: %s", zmq_strerror(zmq_errno()));
        }
        Snapkv__Reply *rep = snapkv__reply__unpack(NULL, zmq_msg_size(&msg), zmq_msg_data(&msg));
        zmq_msg_close(&msg);
        if (!rep)
            return fail(SNAPKV_E_PROTO, "malformed reply from the daemon");
        if (rep->request_id != req->request_id || !rep->final) {
            /* a late reply to an earlier, timed-out request, or progress we do not show */
            snapkv__reply__free_unpacked(rep, NULL);
            continue;
        }
        if (rep->status != SNAPKV_OK) {
            int status = rep->status;
            fail(status, "%s", rep->message && *rep->message ? rep->message : skv_status_str(status));
            snapkv__reply__free_unpacked(rep, NULL);
            return status;
        }
        *reply_out = rep;
        return SNAPKV_OK;
    }
}

int snapkv_connect(const char *endpoint, const struct snapkv_connect_opts *opts, snapkv_client_t **out)
{
    if (!endpoint || !out)
        return fail(SNAPKV_E_INVAL, "endpoint and out are required");
    snapkv_client_t *c = calloc(1, sizeof *c);
    if (!c)
        return fail(SNAPKV_E_NOMEM, "out of memory");
    int rc;
    const char *tenant = opts && opts->tenant ? opts->tenant : "default";
    c->timeout_ms = opts && opts->timeout_ms ? opts->timeout_ms : 30000;
    c->tenant = strdup(tenant);
    c->zctx = zmq_ctx_new();
    if (!c->tenant || !c->zctx) {
        rc = fail(SNAPKV_E_NOMEM, "out of memory");
        goto out_free;
    }
    c->sock = zmq_socket(c->zctx, ZMQ_DEALER);
    if (!c->sock) {
        rc = fail(SNAPKV_E_IO, "socket: %s", zmq_strerror(zmq_errno()));
        goto out_free;
    }
    int linger = 0;
    zmq_setsockopt(c->sock, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_connect(c->sock, endpoint) < 0) {
        rc = fail(SNAPKV_E_INVAL, "connect %s: %s", endpoint, zmq_strerror(zmq_errno()));
        goto out_free;
    }

    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__HelloRequest hello = SNAPKV__HELLO_REQUEST__INIT;
    hello.client_name = (char *)(opts && opts->name ? opts->name : "libsnapkv");
    hello.tenant = c->tenant;
    hello.pid = (uint32_t)getpid();
    req.command_case = SNAPKV__REQUEST__COMMAND_HELLO;
    req.hello = &hello;
    Snapkv__Reply *rep = NULL;
    rc = call(c, &req, &rep);
    if (rc)
        goto out_free;
    if (rep->version != SNAPKV_PROTOCOL_VERSION || rep->result_case != SNAPKV__REPLY__RESULT_HELLO) {
        rc = fail(SNAPKV_E_VERSION, "daemon speaks protocol %u, this library %d", rep->version,
                  SNAPKV_PROTOCOL_VERSION);
        snapkv__reply__free_unpacked(rep, NULL);
        goto out_free;
    }
    c->hello = rep->hello;
    rep->hello = NULL;
    rep->result_case = SNAPKV__REPLY__RESULT__NOT_SET;
    snapkv__reply__free_unpacked(rep, NULL);
    *out = c;
    return SNAPKV_OK;

out_free:
    snapkv_close(&c);
    return rc;
}

void snapkv_close(snapkv_client_t **client_p)
{
    if (!client_p || !*client_p)
        return;
    snapkv_client_t *c = *client_p;
    if (c->hello)
        snapkv__hello_reply__free_unpacked(c->hello, NULL);
    if (c->sock)
        zmq_close(c->sock);
    if (c->zctx)
        zmq_ctx_term(c->zctx);
    free(c->tenant);
    free(c);
    *client_p = NULL;
}

int snapkv_server_info(snapkv_client_t *c, struct snapkv_server_info *out)
{
    if (!c || !out || !c->hello)
        return fail(SNAPKV_E_INVAL, "not connected");
    const Snapkv__HelloReply *h = c->hello;
    *out = (struct snapkv_server_info){
        .server_version = h->server_version,
        .model_name = h->model_name,
        .model_fingerprint = h->model_fingerprint,
        .backend = h->backend,
        .n_layers = h->n_layers,
        .n_heads = h->n_heads,
        .n_kv_heads = h->n_kv_heads,
        .head_dim = h->head_dim,
        .n_vocab = h->n_vocab,
        .max_prompt_tokens = h->max_prompt_tokens,
        .max_new_tokens = h->max_new_tokens,
        .max_message_bytes = h->max_message_bytes,
    };
    return SNAPKV_OK;
}

int snapkv_admin_status(snapkv_client_t *c, struct snapkv_status_info *out)
{
    if (!c || !out)
        return fail(SNAPKV_E_INVAL, "client and out are required");
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__StatusRequest sreq = SNAPKV__STATUS_REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_STATUS;
    req.status = &sreq;
    Snapkv__Reply *rep = NULL;
    int rc = call(c, &req, &rep);
    if (rc)
        return rc;
    if (rep->result_case != SNAPKV__REPLY__RESULT_STATUS_REPLY) {
        snapkv__reply__free_unpacked(rep, NULL);
        return fail(SNAPKV_E_PROTO, "STATUS answered with the wrong reply type");
    }
    const Snapkv__StatusReply *s = rep->status_reply;
    struct snapkv_status_info info = {
        .uptime_seconds = s->uptime_seconds,
        .n_sessions = s->n_sessions,
        .n_clients = s->n_clients,
        .queue_depth = s->queue_depth,
        .threads = s->threads,
        .pool_bytes_total = s->pool_bytes_total,
        .pool_bytes_used = s->pool_bytes_used,
    };
    snprintf(info.server_version, sizeof info.server_version, "%s", s->server_version);
    snprintf(info.model_name, sizeof info.model_name, "%s", s->model_name);
    snprintf(info.backend, sizeof info.backend, "%s", s->backend);
    *out = info;
    snapkv__reply__free_unpacked(rep, NULL);
    return SNAPKV_OK;
}

int snapkv_admin_config_get(snapkv_client_t *c, const char *key, snapkv_config_fn fn, void *user)
{
    if (!c || !fn)
        return fail(SNAPKV_E_INVAL, "client and fn are required");
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__ConfigGetRequest creq = SNAPKV__CONFIG_GET_REQUEST__INIT;
    creq.key = (char *)(key ? key : "");
    req.command_case = SNAPKV__REQUEST__COMMAND_CONFIG_GET;
    req.config_get = &creq;
    Snapkv__Reply *rep = NULL;
    int rc = call(c, &req, &rep);
    if (rc)
        return rc;
    if (rep->result_case != SNAPKV__REPLY__RESULT_CONFIG_GET) {
        snapkv__reply__free_unpacked(rep, NULL);
        return fail(SNAPKV_E_PROTO, "CONFIG GET answered with the wrong reply type");
    }
    for (size_t i = 0; i < rep->config_get->n_entries; i++) {
        const Snapkv__ConfigEntry *e = rep->config_get->entries[i];
        fn(user, e->key, e->value, e->help);
    }
    snapkv__reply__free_unpacked(rep, NULL);
    return SNAPKV_OK;
}
