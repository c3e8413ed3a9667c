/* libsnapkv core: one DEALER socket per client, the HELLO handshake, request/reply envelopes
 * from proto/snapkv.proto (request ids, stale and streamed replies, timeouts, version checks),
 * the thread-local last error and session id helpers. Never logs. */
#include "libclient/client_internal.h"
#include "common/keyfile.h"
#include "common/status.h"
#include "common/utf8.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <fcntl.h>
#include <unistd.h>
#include <zmq.h>

_Static_assert((int)SNAPKV_E_INTERNAL == (int)SKV_E_INTERNAL, "client and daemon status codes differ");
_Static_assert((int)SNAPKV_E_UNAVAILABLE == (int)SKV_E_UNAVAILABLE, "client and daemon status codes differ");
_Static_assert((int)SNAPKV_E_POOL_FULL == (int)SKV_E_POOL_FULL, "client and daemon status codes differ");
_Static_assert((int)SNAPKV_E_CANCELLED == (int)SKV_E_CANCELLED, "client and daemon status codes differ");

_Static_assert(SNAPKV_CURVE_KEY_SIZE == SKV_KEY_Z85_LEN + 1, "CURVE key sizes differ");

#define DEFAULT_TIMEOUT_MS 30000
#define TCP_HEARTBEAT_IVL_MS 5000      /* ZMTP pings on a tcp:// connection ... */
#define TCP_HEARTBEAT_TIMEOUT_MS 15000 /* ... and the silence that closes it */
#define CLIENT_NAME_MAX 4096 /* bytes of snapkv_connect_opts.name */
#define MONITOR_ENDPOINT "inproc://snapkv-handshake" /* one context per client: no clash */
#define HANDSHAKE_FAILURES \
    (ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)

static _Thread_local char last_error[512];

int skv_client_fail(int status, const char *fmt, ...)
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

int64_t skv_client_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Receives one message (the caller saw it waiting); a multi-part message (a REQ-style empty
 * delimiter) counts by its last part. On success *out owns the unpacked reply. */
static int recv_reply(snapkv_client_t *c, Snapkv__Reply **out)
{
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    for (;;) {
        if (zmq_msg_recv(&msg, c->sock, 0) < 0) {
            int err = zmq_errno();
            if (err == EINTR) /* a signal: the message is still there */
                continue;
            zmq_msg_close(&msg);
            return skv_client_fail(SNAPKV_E_IO, "recv: %s", zmq_strerror(err));
        }
        if (!zmq_msg_more(&msg))
            break;
    }
    Snapkv__Reply *rep = snapkv__reply__unpack(NULL, zmq_msg_size(&msg), zmq_msg_data(&msg));
    zmq_msg_close(&msg);
    if (!rep)
        return skv_client_fail(SNAPKV_E_PROTO, "malformed reply from the daemon");
    *out = rep;
    return SNAPKV_OK;
}

/* The failure a handshake event reports, as a status with its message (SNAPKV_OK: the event is
 * not a failed handshake). */
static int handshake_failure(const snapkv_client_t *c, uint16_t event, uint32_t value)
{
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)
        return skv_client_fail(SNAPKV_E_PERM,
                               "the daemon refused this client's CURVE key (ZAP status %u): its public key must be "
                               "listed in the daemon's authorized keys file",
                               value);
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL && value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
        return c->curve ? skv_client_fail(SNAPKV_E_PERM, "handshake refused: this endpoint does not use CURVE")
                        : skv_client_fail(SNAPKV_E_PERM,
                                          "handshake refused: the daemon requires CURVE on this endpoint; give "
                                          "its public key and a client key pair");
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL && value == ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC)
        return skv_client_fail(SNAPKV_E_PERM, "CURVE handshake failed: the messages do not decrypt (wrong keys?)");
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL)
        return skv_client_fail(SNAPKV_E_PROTO, "handshake failed: ZMTP protocol error 0x%08x", value);
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL && c->curve)
        return skv_client_fail(SNAPKV_E_PERM,
                               "CURVE handshake failed (%s): is the server public key the daemon's, and does the "
                               "endpoint use CURVE?",
                               zmq_strerror((int)value));
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        return skv_client_fail(SNAPKV_E_PERM,
                               "handshake failed (%s): the daemon closed the connection: it holds its "
                               "max-connections, or this user's (or address's) max-connections-per-peer, already; "
                               "or a tcp:// endpoint requires CURVE (give its public key and a client key pair)",
                               zmq_strerror((int)value));
    return SNAPKV_OK;
}

/* Reads the connection events libzmq reported: a failed handshake fails the call at once (the
 * daemon sends nothing to a refused client) unless `past` (events from before the call, a later
 * handshake may have worked: only kept in c->refused until one does); a closed connection is
 * counted and sets *lost (NULL: ignored); c->down follows closes and handshakes. */
static int check_events(snapkv_client_t *c, bool *lost, bool past)
{
    int rc = SNAPKV_OK;
    while (!rc) {
        zmq_msg_t head, addr;
        zmq_msg_init(&head);
        zmq_msg_init(&addr);
        if (zmq_msg_recv(&head, c->monitor, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&head);
            zmq_msg_close(&addr);
            break;
        }
        if (zmq_msg_more(&head))
            zmq_msg_recv(&addr, c->monitor, 0);
        uint16_t event = 0;
        uint32_t value = 0;
        if (zmq_msg_size(&head) == 6) {
            memcpy(&event, zmq_msg_data(&head), sizeof event);
            memcpy(&value, (const char *)zmq_msg_data(&head) + 2, sizeof value);
        }
        zmq_msg_close(&head);
        zmq_msg_close(&addr);
        if (event == ZMQ_EVENT_DISCONNECTED) {
            c->disconnects++;
            c->down = true;
            c->up = false;
        } else if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
            c->down = false;
            c->up = true;
            c->refused_event = 0;
        }
        if (event == ZMQ_EVENT_DISCONNECTED && lost) {
            *lost = true;
        } else if (event & HANDSHAKE_FAILURES) {
            c->refused_event = event; /* the next call fails at once too */
            c->refused_value = value;
            if (!past)
                rc = handshake_failure(c, event, value);
        } else if (!past) {
            rc = handshake_failure(c, event, value);
        }
    }
    return rc;
}

void skv_client_look(snapkv_client_t *c)
{
    if (c->monitor)
        check_events(c, NULL, true);
}

/* How long replies already on their way may take to come after the connection closed. */
#define LOST_GRACE_MS 200

long skv_client_wait_ms(int64_t deadline)
{
    if (deadline < 0)
        return -1;
    int64_t left = deadline - skv_client_now_ms();
    return left > 0 ? (long)left : 0;
}

/* Why an ipc:// daemon may not answer, for a message: its socket file missing, not ours to
 * open, or there with nobody answering; "not running?" for other transports. */
static void ipc_diagnosis(const snapkv_client_t *c, char *out, size_t cap)
{
    if (!c->ipc_path)
        snprintf(out, cap, "not running?");
    else if (faccessat(AT_FDCWD, c->ipc_path, F_OK, AT_EACCESS) != 0 && errno == ENOENT)
        snprintf(out, cap, "no socket file %s: is snapkvd running, with this endpoint?", c->ipc_path);
    else if (faccessat(AT_FDCWD, c->ipc_path, W_OK, AT_EACCESS) != 0 && errno == EACCES)
        snprintf(out, cap, "%s: permission denied", c->ipc_path);
    else
        snprintf(out, cap, "%s is there and nothing answered: a daemon still loading its model, or one that "
                 "is gone", c->ipc_path);
}

/* Hands one packed request to libzmq by the deadline. The socket (ZMQ_IMMEDIATE) takes
 * messages only while a daemon is connected, and no more than its high-water mark: for a
 * daemon that is not running, gone or no longer reading, the call times out here instead of
 * blocking, and nothing is queued to run when a daemon comes back. */
static int send_request(snapkv_client_t *c, const void *buf, size_t len, int64_t deadline, const char *what)
{
    for (;;) {
        /* after a close, until the next handshake, only the connection's events are awaited:
         * libzmq may not have dropped the closed connection's pipe yet, and a message sent now
         * could go into it and be lost unnoticed (the close was seen already), so the call would
         * wait out its timeout */
        bool down = c->monitor && c->down;
        /* the daemon there now refused the handshake (a restart that requires CURVE, or no
         * longer lists this client's key): say so, not "not running" at the timeout */
        if (down && c->refused_event) {
            c->unanswered++;
            return handshake_failure(c, c->refused_event, c->refused_value);
        }
        if (!down) {
            if (zmq_send(c->sock, buf, len, ZMQ_DONTWAIT) >= 0)
                return SNAPKV_OK;
            int err = zmq_errno();
            if (err == EINTR)
                continue;
            if (err != EAGAIN)
                return skv_client_fail(SNAPKV_E_IO, "send: %s", zmq_strerror(err));
        }
        zmq_pollitem_t items[2] = {{.socket = c->sock, .events = down ? 0 : ZMQ_POLLOUT},
                                   {.socket = c->monitor, .events = ZMQ_POLLIN}};
        int n = zmq_poll(items, c->monitor ? 2 : 1, skv_client_wait_ms(deadline));
        if (n < 0 && zmq_errno() == EINTR)
            continue; /* a signal: wait on for what is left of the timeout */
        if (n < 0)
            return skv_client_fail(SNAPKV_E_IO, "poll: %s", zmq_strerror(zmq_errno()));
        if (c->monitor && (items[1].revents & ZMQ_POLLIN)) {
            int rc = check_events(c, NULL, false);
            if (rc) {
                c->unanswered++;
                return rc;
            }
        }
        if (n == 0)
            c->unanswered++;
        if (n == 0 && c->monitor && c->up)
            return skv_client_fail(SNAPKV_E_TIMEOUT, "could not send the %s request within %d ms: the daemon is "
                                   "connected and has stopped reading requests", what, c->timeout_ms);
        if (n == 0) {
            char why[1200];
            ipc_diagnosis(c, why, sizeof why);
            return skv_client_fail(SNAPKV_E_TIMEOUT,
                                   "could not send the %s request within %d ms: the daemon is not connected "
                                   "(%s)%s",
                                   what, c->timeout_ms, why,
                                   down || c->monitor ? "" : " or has stopped reading requests");
        }
    }
}

static int say_hello(snapkv_client_t *c);

/* Connections closed before this call (a daemon restart between two calls) are past: the next
 * request goes out on the connection there is now. That may be another daemon, with another
 * model and other limits, so HELLO is asked again first (not for a HELLO: `hello`). */
static int refresh(snapkv_client_t *c, bool hello, const char *what)
{
    int rc = c->monitor ? check_events(c, NULL, true) : SNAPKV_OK;
    if (rc || hello || !c->hello || c->disconnects == c->hello_disconnects)
        return rc;
    if ((rc = say_hello(c))) {
        char why[sizeof last_error];
        memcpy(why, last_error, sizeof why);
        skv_client_fail(rc, "%s: the connection to the daemon closed since the last call, and HELLO on the new one "
                        "failed: %s", what, why);
    }
    return rc;
}

/* skv_client_call, less the check that no other call of c is waiting. */
static int call(snapkv_client_t *c, Snapkv__Request *req, Snapkv__Reply__ResultCase want, const char *what,
                skv_partial_fn partial, void *user, bool *in_flight, Snapkv__Reply **reply_out)
{
    c->lost = false;
    int rc = refresh(c, req->command_case == SNAPKV__REQUEST__COMMAND_HELLO, what);
    if (rc)
        return rc;
    req->version = SNAPKV_PROTOCOL_VERSION;
    req->request_id = ++c->next_request_id;
    req->tenant = c->tenant;
    /* what the daemon needs not start, or finish, once this call has given up on it */
    req->deadline_ms = c->timeout_ms > 0 ? (uint32_t)c->timeout_ms : 0;
    size_t len = snapkv__request__get_packed_size(req);
    if (c->hello && c->hello->max_message_bytes && len > c->hello->max_message_bytes)
        return skv_client_fail(SNAPKV_E_LIMIT, "%s request is %zu bytes, the daemon takes at most %llu", what,
                               len, (unsigned long long)c->hello->max_message_bytes);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf)
        return skv_client_fail(SNAPKV_E_NOMEM, "out of memory packing a %s request", what);
    snapkv__request__pack(req, buf);
    /* the timeout bounds sending the request and the wait for each of its replies; stale
     * replies do not extend it */
    int64_t deadline = c->timeout_ms < 0 ? -1 : skv_client_now_ms() + c->timeout_ms;
    rc = send_request(c, buf, len, deadline, what);
    free(buf);
    if (rc)
        return rc;
    if (req->command_case == SNAPKV__REQUEST__COMMAND_HELLO)
        c->hello_sent_disconnects = c->disconnects; /* closes up to here are before its connection */
    c->sent_disconnects = c->disconnects;
    *in_flight = true;

    /* the connection closing while the reply is awaited (the daemon stopped or restarted) loses
     * the request: the call fails then, after a moment for replies already on their way,
     * instead of waiting out its timeout (for ever at -1) */
    bool lost = false;
    int64_t lost_deadline = -1;
    for (;;) {
        zmq_pollitem_t items[2] = {{.socket = c->sock, .events = ZMQ_POLLIN},
                                   {.socket = c->monitor, .events = ZMQ_POLLIN}};
        int64_t until = lost && (deadline < 0 || lost_deadline < deadline) ? lost_deadline : deadline;
        int n = zmq_poll(items, c->monitor ? 2 : 1, skv_client_wait_ms(until));
        if (n < 0 && zmq_errno() == EINTR)
            continue; /* a signal: wait on for what is left of the timeout */
        if (n < 0)
            return skv_client_fail(SNAPKV_E_IO, "poll: %s", zmq_strerror(zmq_errno()));
        if (c->monitor && (items[1].revents & ZMQ_POLLIN)) {
            bool was_lost = lost;
            if ((rc = check_events(c, &lost, false))) {
                /* refused: no connection carries the request, nor a reply (the daemon drops, or
                 * cancels, what a closed connection asked): nothing to CANCEL */
                *in_flight = false;
                c->unanswered++;
                return rc;
            }
            if (lost && !was_lost)
                lost_deadline = skv_client_now_ms() + LOST_GRACE_MS;
        }
        if (!(items[0].revents & ZMQ_POLLIN)) {
            int64_t now = skv_client_now_ms();
            /* (the grace within the call's own timeout) */
            if (lost && (now >= lost_deadline || (deadline >= 0 && now >= deadline))) {
                *in_flight = false; /* the daemon drops, or cancels, what a gone client asked */
                c->lost = true;
                c->unanswered++;
                return skv_client_fail(SNAPKV_E_IO,
                                       "the connection to the daemon closed while the %s reply was awaited (the "
                                       "daemon stopped or restarted): whether it ran is not known",
                                       what);
            }
            if (n > 0 || lost)
                continue;
            c->unanswered++;
            return skv_client_fail(SNAPKV_E_TIMEOUT, "no %s reply from the daemon within %d ms", what,
                                   c->timeout_ms);
        }
        Snapkv__Reply *rep = NULL;
        rc = recv_reply(c, &rep);
        if (rc)
            return rc;
        if (rep->request_id != req->request_id) {
            /* a late reply to an earlier request that timed out or was cancelled */
            snapkv__reply__free_unpacked(rep, NULL);
            continue;
        }
        if (rep->final || rep->status != SNAPKV_OK)
            *in_flight = false; /* the daemon is done with it */
        if (rep->version != SNAPKV_PROTOCOL_VERSION) {
            rc = skv_client_fail(SNAPKV_E_VERSION, "daemon speaks protocol %u, this library %d", rep->version,
                                 SNAPKV_PROTOCOL_VERSION);
            goto out_free_reply;
        }
        if (rep->status != SNAPKV_OK) {
            /* an error ends the request, streamed or not */
            rc = rep->status > 0 ? SNAPKV_E_PROTO : rep->status; /* newer negative codes pass through */
            skv_client_fail(rc, "%s", rep->message && *rep->message ? rep->message : skv_status_str(rc));
            goto out_free_reply;
        }
        /* a streamed reply may carry no result; so may the final one of a command whose result
         * is an empty message (RELEASE, PIN) */
        bool empty_ok = !rep->final || want == SNAPKV__REPLY__RESULT_RELEASE || want == SNAPKV__REPLY__RESULT_PIN;
        if (rep->result_case != want && !(rep->result_case == SNAPKV__REPLY__RESULT__NOT_SET && empty_ok)) {
            rc = skv_client_fail(SNAPKV_E_PROTO, "%s answered with the wrong reply type (%d)", what,
                                 (int)rep->result_case);
            goto out_free_reply;
        }
        if (!rep->final) {
            rc = partial && rep->result_case == want ? partial(user, rep) : SNAPKV_OK;
            snapkv__reply__free_unpacked(rep, NULL);
            if (rc)
                return rc;
            /* each reply restarts the wait, with the timeout set now (a callback may set it) */
            deadline = c->timeout_ms < 0 ? -1 : skv_client_now_ms() + c->timeout_ms;
            continue;
        }
        *reply_out = rep;
        return SNAPKV_OK;

    out_free_reply:
        snapkv__reply__free_unpacked(rep, NULL);
        return rc;
    }
}

int skv_client_call(snapkv_client_t *c, Snapkv__Request *req, Snapkv__Reply__ResultCase want, const char *what,
                    skv_partial_fn partial, void *user, bool *in_flight, Snapkv__Reply **reply_out)
{
    bool running = false;
    if (in_flight)
        *in_flight = false;
    /* a callback that used its own client would read (and drop) the replies its caller waits for */
    if (c->in_call)
        return skv_client_fail(SNAPKV_E_BUSY,
                               "%s: this client is inside another of its calls (a callback must not use its own "
                               "client: open another)",
                               what);
    c->in_call = true;
    int rc = call(c, req, want, what, partial, user, &running, reply_out);
    c->in_call = false;
    if (in_flight)
        *in_flight = running;
    return rc;
}

struct skv_client_string {
    struct skv_client_string *next;
    char text[];
};

/* s ("" for NULL) kept until the client closes: the copy kept already, or a new one (NULL: out
 * of memory). A daemon's facts take a few distinct strings, however often it restarts. */
static const char *keep_string(snapkv_client_t *c, const char *s)
{
    if (!s)
        s = "";
    for (struct skv_client_string *k = c->strings; k; k = k->next)
        if (!strcmp(k->text, s))
            return k->text;
    size_t n = strlen(s) + 1;
    struct skv_client_string *k = malloc(sizeof *k + n);
    if (!k)
        return NULL;
    memcpy(k->text, s, n);
    k->next = c->strings;
    c->strings = k;
    return k->text;
}

/* HELLO: checks the protocol version and keeps the daemon's facts for snapkv_server_info and
 * the library's own checks. */
static int say_hello(snapkv_client_t *c)
{
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__HelloRequest hello = SNAPKV__HELLO_REQUEST__INIT;
    hello.client_name = c->name;
    hello.tenant = c->tenant;
    hello.pid = (uint32_t)getpid();
    req.command_case = SNAPKV__REQUEST__COMMAND_HELLO;
    req.hello = &hello;
    Snapkv__Reply *rep = NULL;
    bool in_flight = false;
    int rc = call(c, &req, SNAPKV__REPLY__RESULT_HELLO, "HELLO", NULL, NULL, &in_flight, &rep);
    if (rc)
        return rc;
    Snapkv__HelloReply *h = rep->hello;
    rep->hello = NULL;
    rep->result_case = SNAPKV__REPLY__RESULT__NOT_SET;
    snapkv__reply__free_unpacked(rep, NULL);
    /* the shape a caller indexes shared memory and sizes buffers by: a daemon's that no model has
     * is refused (0: not said) */
    if (h->n_layers > 4096 || h->n_kv_heads > 4096 || h->n_heads > 65536 || h->head_dim > 65536 ||
        h->n_vocab > (1u << 24) || (h->n_kv_heads && h->n_heads && h->n_heads % h->n_kv_heads)) {
        rc = skv_client_fail(SNAPKV_E_PROTO, "the daemon's HELLO gives a model shape no model has: %u layers, %u "
                             "heads, %u KV heads, head size %u, %u tokens", h->n_layers, h->n_heads, h->n_kv_heads,
                             h->head_dim, h->n_vocab);
        snapkv__hello_reply__free_unpacked(h, NULL);
        return rc;
    }
    const char *info[5] = {keep_string(c, h->server_version), keep_string(c, h->model_name),
                           keep_string(c, h->model_fingerprint), keep_string(c, h->backend),
                           keep_string(c, h->legacy_model_fingerprint)};
    if (!info[0] || !info[1] || !info[2] || !info[3] || !info[4]) {
        snapkv__hello_reply__free_unpacked(h, NULL);
        return skv_client_fail(SNAPKV_E_NOMEM, "out of memory keeping the daemon's HELLO");
    }
    if (c->hello)
        snapkv__hello_reply__free_unpacked(c->hello, NULL);
    c->hello = h;
    memcpy(c->info, info, sizeof info);
    c->hello_disconnects = c->hello_sent_disconnects;
    return SNAPKV_OK;
}

/* HELLO at connect. A daemon closes a connection past its max-connections, or past the user's
 * (or address's) max-connections-per-peer, as it comes; when the handshake finished first, the
 * HELLO sent on it is lost with it. HELLO changes nothing in the daemon, so it is asked again on
 * the next connection while the connect's timeout lasts: a refused handshake then fails with
 * SNAPKV_E_PERM, saying why, and a daemon that restarted answers. */
static int first_hello(snapkv_client_t *c)
{
    int timeout_ms = c->timeout_ms;
    int64_t deadline = timeout_ms < 0 ? -1 : skv_client_now_ms() + timeout_ms;
    int rc, tries = 0;
    for (;;) {
        rc = say_hello(c);
        tries++;
        long left = skv_client_wait_ms(deadline);
        if (rc != SNAPKV_E_IO || !c->lost || left == 0)
            break;
        if (deadline >= 0) /* (each try waits no longer than what is left of the connect's timeout) */
            c->timeout_ms = (int)left;
    }
    c->timeout_ms = timeout_ms;
    if (rc == SNAPKV_E_IO && c->lost)
        skv_client_fail(SNAPKV_E_IO,
                        "the daemon closed the connection before answering HELLO (%d tries within %d ms): it holds "
                        "its max-connections, or this user's (or address's) max-connections-per-peer, already, or "
                        "it is stopping",
                        tries, timeout_ms);
    else if (rc == SNAPKV_E_TIMEOUT && tries > 1)
        skv_client_fail(SNAPKV_E_TIMEOUT,
                        "the daemon closed the connection before answering HELLO, and no other answered it within "
                        "the connect's %d ms (%d tries)",
                        timeout_ms, tries);
    return rc;
}

/* The daemon's rule for tenant names (daemon/session.c skv_session_check_tenant), in ASCII
 * whatever the program's locale. */
static bool tenant_name_ok(const char *t)
{
    size_t n = strlen(t);
    if (n == 0 || n > 63)
        return false;
    for (size_t i = 0; i < n; i++) {
        char ch = t[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || strchr("._-@", ch)))
            return false;
    }
    return true;
}

/* The CURVE keys of opts checked (none given: *curve false), with the client public key derived
 * from the secret one into `derived`. */
static int curve_keys(const struct snapkv_connect_opts *opts, char derived[SNAPKV_CURVE_KEY_SIZE], bool *curve)
{
    *curve = false;
    if (!opts || (!opts->curve_server_key && !opts->curve_secret_key && !opts->curve_public_key))
        return SNAPKV_OK;
    if (!opts->curve_server_key || !opts->curve_secret_key)
        return skv_client_fail(SNAPKV_E_INVAL, "CURVE needs the server's public key and this client's secret key");
    const char *keys[3] = {opts->curve_server_key, opts->curve_secret_key, opts->curve_public_key};
    static const char *const names[3] = {"server public key", "client secret key", "client public key"};
    for (int i = 0; i < 3; i++)
        if (keys[i] && !skv_key_z85_decode(keys[i], NULL))
            return skv_client_fail(SNAPKV_E_INVAL, "the CURVE %s is not a Z85 key (40 characters)", names[i]);
    if (!zmq_has("curve"))
        return skv_client_fail(SNAPKV_E_UNSUPPORTED, "this libzmq was built without CURVE (zmq_has(\"curve\") is false)");
    if (zmq_curve_public(derived, keys[1]) != 0)
        return skv_client_fail(SNAPKV_E_INVAL, "cannot derive the CURVE public key: %s", zmq_strerror(zmq_errno()));
    /* a public key of another pair fails the handshake as if the server key were wrong (the
     * keys' bytes compared: one key has more than one Z85 text where libzmq is lax) */
    unsigned char given[SKV_KEY_BYTES], own[SKV_KEY_BYTES];
    if (keys[2] && (!skv_key_z85_decode(keys[2], given) || !skv_key_z85_decode(derived, own) ||
                    memcmp(given, own, sizeof own) != 0))
        return skv_client_fail(SNAPKV_E_INVAL, "the CURVE client public key is not the one of the client secret key "
                                               "(leave it out: it is derived from the secret key)");
    *curve = true;
    return SNAPKV_OK;
}

int skv_client_check_opts(const struct snapkv_connect_opts *opts)
{
    if (opts && opts->timeout_ms < -1)
        return skv_client_fail(SNAPKV_E_INVAL, "timeout_ms must be -1, 0 or positive");
    if (opts && opts->tenant && *opts->tenant && !tenant_name_ok(opts->tenant))
        return skv_client_fail(SNAPKV_E_INVAL, "tenant '%.63s%s': 1..63 letters, digits and . _ - @", opts->tenant,
                               strlen(opts->tenant) > 63 ? "..." : "");
    if (opts && opts->name) { /* (the daemon refuses a HELLO whose name is not text) */
        size_t n = strlen(opts->name);
        if (n > CLIENT_NAME_MAX)
            return skv_client_fail(SNAPKV_E_INVAL, "client name of %zu bytes: at most %d", n, CLIENT_NAME_MAX);
        for (size_t i = 0; i < n;) {
            bool partial;
            size_t bad, len = skv_utf8_char((const unsigned char *)opts->name + i, n - i, &partial, &bad);
            if (!len)
                return skv_client_fail(SNAPKV_E_INVAL, "client name: ill-formed UTF-8 at byte %zu", i);
            i += len;
        }
    }
    char derived[SNAPKV_CURVE_KEY_SIZE];
    bool curve;
    return curve_keys(opts, derived, &curve);
}

/* Sets the CURVE client options on c->sock from opts (nothing when no key is given). */
static int setup_curve(snapkv_client_t *c, const struct snapkv_connect_opts *opts)
{
    char derived[SNAPKV_CURVE_KEY_SIZE];
    bool curve;
    int rc = curve_keys(opts, derived, &curve);
    if (rc || !curve)
        return rc;
    if (zmq_setsockopt(c->sock, ZMQ_CURVE_SERVERKEY, opts->curve_server_key, SKV_KEY_Z85_LEN + 1) < 0 ||
        zmq_setsockopt(c->sock, ZMQ_CURVE_SECRETKEY, opts->curve_secret_key, SKV_KEY_Z85_LEN + 1) < 0 ||
        zmq_setsockopt(c->sock, ZMQ_CURVE_PUBLICKEY, derived, SKV_KEY_Z85_LEN + 1) < 0)
        return skv_client_fail(SNAPKV_E_INVAL, "CURVE options: %s", zmq_strerror(zmq_errno()));
    c->curve = true;
    return SNAPKV_OK;
}

/* Watches the connection for the client's life: a refused handshake fails a call at once
 * instead of at its timeout, and so does a connection that closes while a reply is awaited; a
 * connection that closed makes the next call ask HELLO again. */
static void monitor_start(snapkv_client_t *c)
{
    int events = HANDSHAKE_FAILURES | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED;
    if (zmq_socket_monitor(c->sock, MONITOR_ENDPOINT, events) < 0)
        return; /* without it a refusal still ends at the timeout */
    c->monitor = zmq_socket(c->zctx, ZMQ_PAIR);
    /* events are read only during calls: an idle client's must never fill the pipe, where
     * libzmq's I/O thread would block holding the lock zmq_socket_monitor() (at close) waits for
     * (a zero receive HWM lifts the inproc pipe's bound); reconnects back off to 2 s, so an
     * idle client whose connections keep closing queues few */
    int unbounded = 0;
    if (c->monitor && zmq_setsockopt(c->monitor, ZMQ_RCVHWM, &unbounded, sizeof unbounded) == 0 &&
        zmq_connect(c->monitor, MONITOR_ENDPOINT) == 0)
        return;
    if (c->monitor)
        zmq_close(c->monitor);
    c->monitor = NULL;
    zmq_socket_monitor(c->sock, NULL, 0);
}

static void monitor_stop(snapkv_client_t *c)
{
    if (!c->monitor)
        return;
    zmq_socket_monitor(c->sock, NULL, 0);
    zmq_close(c->monitor);
    c->monitor = NULL;
}

int snapkv_connect(const char *endpoint, const struct snapkv_connect_opts *opts, snapkv_client_t **out)
{
    if (!endpoint || !*endpoint || !out)
        return skv_client_fail(SNAPKV_E_INVAL, "endpoint and out are required");
    int rc = skv_client_check_opts(opts);
    if (rc)
        return rc;
    snapkv_client_t *c = calloc(1, sizeof *c);
    if (!c)
        return skv_client_fail(SNAPKV_E_NOMEM, "out of memory");
    const char *tenant = opts && opts->tenant && *opts->tenant ? opts->tenant : "default";
    c->timeout_ms = opts && opts->timeout_ms ? opts->timeout_ms : DEFAULT_TIMEOUT_MS;
    c->tenant = strdup(tenant);
    c->name = strdup(opts && opts->name ? opts->name : "libsnapkv");
    c->zctx = zmq_ctx_new();
    if (!c->tenant || !c->name || !c->zctx) {
        rc = skv_client_fail(SNAPKV_E_NOMEM, "out of memory");
        goto out_close;
    }
    c->sock = zmq_socket(c->zctx, ZMQ_DEALER);
    if (!c->sock) {
        rc = skv_client_fail(SNAPKV_E_IO, "socket: %s", zmq_strerror(zmq_errno()));
        goto out_close;
    }
    /* immediate: requests wait for a connected daemon (see send_request), never in a queue */
    int linger = 0, immediate = 1;
    zmq_setsockopt(c->sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(c->sock, ZMQ_IMMEDIATE, &immediate, sizeof immediate);
    int backoff_ms = 2000; /* reconnects start at 100 ms and double up to this */
    zmq_setsockopt(c->sock, ZMQ_RECONNECT_IVL_MAX, &backoff_ms, sizeof backoff_ms);
    if (strncmp(endpoint, "tcp://", 6) == 0) {
        /* a daemon's host that went away (no FIN: power, network) closes the connection after
         * TCP_HEARTBEAT_TIMEOUT_MS of silence, so a call waiting on it fails as for a daemon
         * that stopped, not at its timeout (never at -1); libzmq's threads answer the pings,
         * so a busy daemon is not taken for a gone one */
        int ivl = TCP_HEARTBEAT_IVL_MS, timeout = TCP_HEARTBEAT_TIMEOUT_MS;
        zmq_setsockopt(c->sock, ZMQ_HEARTBEAT_IVL, &ivl, sizeof ivl);
        zmq_setsockopt(c->sock, ZMQ_HEARTBEAT_TIMEOUT, &timeout, sizeof timeout);
    }
    if ((rc = setup_curve(c, opts)))
        goto out_close;
    /* an ipc:// socket file this user may not open fails now, saying so, not at the timeout as
     * a daemon that does not answer (an abstract name, ipc://@, has no file); the effective ids
     * decide, as they do connect(2)'s (a setgid helper) */
    if (strncmp(endpoint, "ipc://", 6) == 0 && endpoint[6] && endpoint[6] != '@') {
        if (!(c->ipc_path = strdup(endpoint + 6))) {
            rc = skv_client_fail(SNAPKV_E_NOMEM, "out of memory");
            goto out_close;
        }
        if (faccessat(AT_FDCWD, c->ipc_path, W_OK, AT_EACCESS) != 0 && errno == EACCES) {
            rc = skv_client_fail(SNAPKV_E_PERM, "%s: permission denied (a daemon's client socket is open to its "
                                 "group, snapkv as installed: join it; its admin socket to its user alone: sudo)",
                                 c->ipc_path);
            goto out_close;
        }
    }
    monitor_start(c);
    if (zmq_connect(c->sock, endpoint) < 0) {
        rc = skv_client_fail(SNAPKV_E_INVAL, "connect %s: %s", endpoint, zmq_strerror(zmq_errno()));
        goto out_close;
    }
    if ((rc = first_hello(c)))
        goto out_close;
    *out = c;
    return SNAPKV_OK;

out_close:
    snapkv_close(&c);
    return rc;
}

int snapkv_curve_keypair(char public_key[SNAPKV_CURVE_KEY_SIZE], char secret_key[SNAPKV_CURVE_KEY_SIZE])
{
    if (!public_key || !secret_key)
        return skv_client_fail(SNAPKV_E_INVAL, "public_key and secret_key are required");
    if (!zmq_has("curve"))
        return skv_client_fail(SNAPKV_E_UNSUPPORTED, "this libzmq was built without CURVE (zmq_has(\"curve\") is false)");
    char pub[SNAPKV_CURVE_KEY_SIZE], sec[SNAPKV_CURVE_KEY_SIZE];
    if (zmq_curve_keypair(pub, sec) != 0)
        return skv_client_fail(SNAPKV_E_INTERNAL, "zmq_curve_keypair: %s", zmq_strerror(zmq_errno()));
    memcpy(public_key, pub, sizeof pub);
    memcpy(secret_key, sec, sizeof sec);
    return SNAPKV_OK;
}

int snapkv_curve_key_load(const char *path, bool secret, char key[SNAPKV_CURVE_KEY_SIZE])
{
    if (!path || !key)
        return skv_client_fail(SNAPKV_E_INVAL, "path and key are required");
    char z85[SNAPKV_CURVE_KEY_SIZE];
    int rc = skv_keyfile_read(path, secret ? SKV_KEYFILE_PRIVATE : SKV_KEYFILE_PUBLIC, z85);
    if (rc)
        return skv_client_fail(rc, "%s", skv_error_msg());
    memcpy(key, z85, sizeof z85);
    return SNAPKV_OK;
}

void snapkv_close(snapkv_client_t **client_p)
{
    if (!client_p || !*client_p)
        return;
    snapkv_client_t *c = *client_p;
    if (c->hello)
        snapkv__hello_reply__free_unpacked(c->hello, NULL);
    monitor_stop(c);
    if (c->sock)
        zmq_close(c->sock);
    if (c->zctx)
        zmq_ctx_term(c->zctx);
    while (c->strings) {
        struct skv_client_string *next = c->strings->next;
        free(c->strings);
        c->strings = next;
    }
    free(c->tenant);
    free(c->name);
    free(c->ipc_path);
    free(c);
    *client_p = NULL;
}

int snapkv_set_timeout(snapkv_client_t *c, int timeout_ms)
{
    if (!c)
        return skv_client_fail(SNAPKV_E_INVAL, "client is required");
    if (timeout_ms < -1)
        return skv_client_fail(SNAPKV_E_INVAL, "timeout_ms must be -1, 0 or positive");
    c->timeout_ms = timeout_ms ? timeout_ms : DEFAULT_TIMEOUT_MS;
    return SNAPKV_OK;
}

const char *snapkv_server_legacy_fingerprint(snapkv_client_t *c)
{
    return c && c->hello && c->info[4] ? c->info[4] : ""; /* kept until the handle closes */
}

int snapkv_server_info(snapkv_client_t *c, struct snapkv_server_info *out)
{
    if (!c || !out)
        return skv_client_fail(SNAPKV_E_INVAL, "snapkv_server_info: NULL argument");
    if (!c->hello)
        return skv_client_fail(SNAPKV_E_INVAL, "not connected");
    const Snapkv__HelloReply *h = c->hello;
    *out = (struct snapkv_server_info){
        .server_version = c->info[0],
        .model_name = c->info[1],
        .model_fingerprint = c->info[2],
        .backend = c->info[3],
        .n_layers = h->n_layers,
        .n_heads = h->n_heads,
        .n_kv_heads = h->n_kv_heads,
        .head_dim = h->head_dim,
        .n_vocab = h->n_vocab,
        .max_prompt_tokens = h->max_prompt_tokens,
        .max_new_tokens = h->max_new_tokens,
        .max_message_bytes = h->max_message_bytes,
        .max_sessions_per_tenant = h->max_sessions_per_tenant,
        .max_bytes_per_tenant = h->max_bytes_per_tenant,
        .kv_block_tokens = h->kv_block_tokens,
        .bos_token = h->bos_token,
        .eos_token = h->eos_token,
    };
    return SNAPKV_OK;
}

/* ---- session ids ------------------------------------------------------------------------------ */

int snapkv_session_id_to_hex(const struct snapkv_session_id *id, char *buf, size_t cap)
{
    static const char digits[] = "0123456789abcdef";
    if (!id || !buf || cap < SNAPKV_SESSION_ID_HEX_SIZE)
        return skv_client_fail(SNAPKV_E_INVAL, "session id and a buffer of %d bytes are required",
                               SNAPKV_SESSION_ID_HEX_SIZE);
    for (size_t i = 0; i < sizeof id->bytes; i++) {
        buf[2 * i] = digits[id->bytes[i] >> 4];
        buf[2 * i + 1] = digits[id->bytes[i] & 15];
    }
    buf[2 * sizeof id->bytes] = '\0';
    return SNAPKV_OK;
}

static int hex_digit(char ch)
{
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F')
        return ch - 'A' + 10;
    return -1;
}

int snapkv_session_id_from_hex(const char *hex, struct snapkv_session_id *out)
{
    if (!hex || !out)
        return skv_client_fail(SNAPKV_E_INVAL, "hex and out are required");
    struct snapkv_session_id id;
    for (size_t i = 0; i < sizeof id.bytes; i++) {
        int hi = hex_digit(hex[2 * i]);
        int lo = hi < 0 ? -1 : hex_digit(hex[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return skv_client_fail(SNAPKV_E_INVAL, "session id '%.40s' is not 32 hex digits", hex);
        id.bytes[i] = (uint8_t)(hi << 4 | lo);
    }
    if (hex[2 * sizeof id.bytes] != '\0')
        return skv_client_fail(SNAPKV_E_INVAL, "session id '%.40s' is not 32 hex digits", hex);
    *out = id;
    return SNAPKV_OK;
}

ProtobufCBinaryData skv_client_id_wire(const struct snapkv_session_id *id)
{
    return (ProtobufCBinaryData){.len = sizeof id->bytes, .data = (uint8_t *)id->bytes};
}

int skv_client_id_parse(const ProtobufCBinaryData *b, const char *what, struct snapkv_session_id *out)
{
    if (b->len != sizeof out->bytes)
        return skv_client_fail(SNAPKV_E_PROTO, "%s reply carries a %zu-byte session id, not 16", what, b->len);
    memcpy(out->bytes, b->data, sizeof out->bytes);
    return SNAPKV_OK;
}

int skv_client_check(snapkv_client_t *c, const void *arg, const char *what)
{
    if (!c || !c->hello)
        return skv_client_fail(SNAPKV_E_INVAL, "%s: not connected", what);
    if (!arg) /* prefill and import take their options there, every other command a session id */
        return skv_client_fail(SNAPKV_E_INVAL, "%s: %s required", what,
                               strcmp(what, "prefill") == 0 || strcmp(what, "import") == 0 ? "options are"
                                                                                           : "a session id is");
    /* the command's own checks use the facts of the daemon it goes to (inside another call the
     * command fails BUSY anyway) */
    return c->in_call ? SNAPKV_OK : refresh(c, false, what);
}

/* ---- shared conversions ------------------------------------------------------------------------ */

/* A malloc'd copy of n elements of `size` bytes (NULL and true for n == 0). */
static bool dup_array(const void *src, size_t n, size_t size, void **out)
{
    *out = NULL;
    if (n == 0)
        return true;
    if (n > SIZE_MAX / size || !(*out = malloc(n * size)))
        return false;
    memcpy(*out, src, n * size);
    return true;
}

bool skv_client_dup_u32(const uint32_t *src, size_t n, uint32_t **out)
{
    void *p;
    bool ok = dup_array(src, n, sizeof *src, &p);
    *out = p;
    return ok;
}

bool skv_client_dup_f32(const float *src, size_t n, float **out)
{
    void *p;
    bool ok = dup_array(src, n, sizeof *src, &p);
    *out = p;
    return ok;
}

int skv_client_layers(const snapkv_client_t *c, Snapkv__LayerKept *const *kept, size_t n,
                      const uint32_t *positions, size_t n_positions, struct snapkv_layer_kept **out)
{
    *out = NULL;
    if (n == 0)
        return SNAPKV_OK;
    uint32_t n_kv_heads = c->hello ? c->hello->n_kv_heads : 0;
    size_t n_heads_total = 0, n_kept_total = 0;
    for (size_t i = 0; i < n; i++) {
        size_t nh = kept[i]->n_kept_per_head ? kept[i]->n_kept_per_head : n_kv_heads;
        /* what a caller indexes shared memory with (snapkv_kv_offset): the model's heads, and a
         * layer's kept the most of its heads' */
        if (nh > 4096 || (n_kv_heads && nh != n_kv_heads))
            return skv_client_fail(SNAPKV_E_PROTO, "layer %u reports %zu heads (the model has %u)", kept[i]->layer,
                                   nh, n_kv_heads);
        n_heads_total += nh;
        uint32_t most = 0;
        if (kept[i]->n_kept_per_head)
            for (size_t h = 0; h < nh; h++) {
                n_kept_total += kept[i]->kept_per_head[h];
                most = kept[i]->kept_per_head[h] > most ? kept[i]->kept_per_head[h] : most;
            }
        else
            n_kept_total += nh * (size_t)kept[i]->kept;
        if (kept[i]->n_kept_per_head && most != kept[i]->kept)
            return skv_client_fail(SNAPKV_E_PROTO, "layer %u reports %u kept, its heads at most %u", kept[i]->layer,
                                   kept[i]->kept, most);
    }
    /* one allocation: the layer array, then every layer's per-head counts, then (INSPECT)
     * its per-head blocks and shared blocks */
    struct snapkv_layer_kept *layers = calloc(1, n * sizeof *layers + 3 * n_heads_total * sizeof(uint32_t));
    if (!layers)
        return skv_client_fail(SNAPKV_E_NOMEM, "out of memory for %zu layers", n);
    uint32_t *heads = (uint32_t *)(layers + n);
    const uint32_t *pos = positions && n_positions == n_kept_total ? positions : NULL;
    for (size_t i = 0; i < n; i++) {
        const Snapkv__LayerKept *k = kept[i];
        size_t nh = k->n_kept_per_head ? k->n_kept_per_head : n_kv_heads;
        size_t layer_entries = 0;
        for (size_t h = 0; h < nh; h++) {
            heads[h] = k->n_kept_per_head ? k->kept_per_head[h] : k->kept;
            layer_entries += heads[h];
        }
        layers[i] = (struct snapkv_layer_kept){
            .layer = k->layer,
            .kept = k->kept,
            .n_heads = (uint32_t)nh,
            .kept_per_head = heads,
            .bytes = k->bytes,
            .positions = pos,
        };
        if (k->n_blocks_per_head == nh && k->n_shared_blocks_per_head == nh) {
            uint32_t *blocks = heads + n_heads_total, *shared = blocks + n_heads_total;
            memcpy(blocks, k->blocks_per_head, nh * sizeof *blocks);
            memcpy(shared, k->shared_blocks_per_head, nh * sizeof *shared);
            layers[i].blocks_per_head = blocks;
            layers[i].shared_blocks_per_head = shared;
        }
        heads += nh;
        if (pos)
            pos += layer_entries;
    }
    *out = layers;
    return SNAPKV_OK;
}
