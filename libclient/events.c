/* libsnapkv's KV events subscriber: a SUB socket on the daemon's events-endpoint, each message
 * [topic][sequence, big-endian u64][KvEventBatch] read into a struct snapkv_event. */
#include "libclient/client_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#define TOPIC "snapkv.kv."

struct snapkv_events {
    void *zctx;
    void *sub;
    Snapkv__KvEventBatch *batch;  /* the message being read, and the next event in it */
    size_t next;
    uint64_t sequence;
    Snapkv__KvReplayReply **parts; /* a replay's snapshot, returned before the stream */
    size_t n_parts, part, part_next;
    uint64_t replayed;            /* the snapshot's sequence: stream events up to it are dropped */
    bool skip;                    /* until one above it, or a restart of the daemon, comes */
    bool seen;                    /* a stream message was read since the last replay (sequence is its) */
    uint64_t boot_id;             /* the replayed daemon's (KvEventBatch.boot_id) */
};

int snapkv_events_open(const char *endpoint, snapkv_events_t **out)
{
    if (!endpoint || !out)
        return skv_client_fail(SNAPKV_E_INVAL, "snapkv_events_open: NULL argument");
    struct snapkv_events *ev = calloc(1, sizeof *ev);
    if (!ev)
        return skv_client_fail(SNAPKV_E_NOMEM, "out of memory");
    int linger = 0;
    if (!(ev->zctx = zmq_ctx_new()) || !(ev->sub = zmq_socket(ev->zctx, ZMQ_SUB)) ||
        zmq_setsockopt(ev->sub, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_setsockopt(ev->sub, ZMQ_SUBSCRIBE, TOPIC, strlen(TOPIC)) != 0 || zmq_connect(ev->sub, endpoint) != 0) {
        int rc = skv_client_fail(SNAPKV_E_IO, "events %s: %s", endpoint, zmq_strerror(zmq_errno()));
        snapkv_events_close(&ev);
        return rc;
    }
    *out = ev;
    return SNAPKV_OK;
}

/* Reads every frame of one waiting message, however many there are, keeping the first max in
 * f (*got: how many it had; the caller closes min(*got, max) of them). */
static int recv_frames(void *sock, zmq_msg_t *f, int max, int *got, const char *what)
{
    *got = 0;
    for (int more = 1; more; (*got)++) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, sock, 0) < 0) {
            zmq_msg_close(&m);
            for (int i = 0; i < *got && i < max; i++)
                zmq_msg_close(&f[i]);
            return skv_client_fail(SNAPKV_E_IO, "%s: %s", what, zmq_strerror(zmq_errno()));
        }
        more = zmq_msg_more(&m);
        if (*got < max)
            f[*got] = m;
        else
            zmq_msg_close(&m);
    }
    return SNAPKV_OK;
}

/* A big-endian uint64 (the sequence frame). */
static uint64_t be64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int k = 0; k < 8; k++)
        v = v << 8 | p[k];
    return v;
}

/* Reads the next message into ev->batch (the earlier one freed). */
static int read_batch(struct snapkv_events *ev, int timeout_ms)
{
    zmq_pollitem_t it = {ev->sub, 0, ZMQ_POLLIN, 0};
    int n = zmq_poll(&it, 1, timeout_ms);
    if (n < 0)
        return skv_client_fail(SNAPKV_E_IO, "events: %s", zmq_strerror(zmq_errno()));
    if (n == 0)
        return skv_client_fail(SNAPKV_E_TIMEOUT, "no event within %d ms", timeout_ms);
    zmq_msg_t parts[3];
    int got;
    int rc = recv_frames(ev->sub, parts, 3, &got, "events");
    if (rc)
        return rc;
    if (got != 3 || zmq_msg_size(&parts[1]) != 8) {
        rc = skv_client_fail(SNAPKV_E_PROTO, "events: a message of %d frames is not an event", got);
    } else {
        uint64_t seq = be64(zmq_msg_data(&parts[1]));
        if (ev->batch)
            snapkv__kv_event_batch__free_unpacked(ev->batch, NULL);
        ev->next = 0;
        /* after a replay, a batch at or below its number is one the snapshot holds: dropped;
         * unless the daemon restarted since (numbers start again at 1 with an AllCleared): another
         * boot id, a number below the last one seen, or an AllCleared ends the dropping */
        bool restarted = ev->skip && ev->seen && seq < ev->sequence;
        ev->sequence = seq;
        ev->seen = true;
        ev->batch = snapkv__kv_event_batch__unpack(NULL, zmq_msg_size(&parts[2]), zmq_msg_data(&parts[2]));
        if (!ev->batch) {
            rc = skv_client_fail(SNAPKV_E_PROTO, "events: a batch that does not decode");
        } else if (ev->skip) {
            restarted |= ev->batch->boot_id != ev->boot_id; /* (a daemon of before boot ids sends 0) */
            for (size_t k = 0; k < ev->batch->n_events && !restarted; k++)
                restarted = ev->batch->events[k]->kind_case == SNAPKV__KV_EVENT__KIND_CLEARED;
            if (restarted || seq > ev->replayed) {
                ev->skip = false;
            } else {
                snapkv__kv_event_batch__free_unpacked(ev->batch, NULL);
                ev->batch = NULL;
            }
        }
    }
    for (int i = 0; i < got && i < 3; i++)
        zmq_msg_close(&parts[i]);
    return rc;
}

static void parts_free(struct snapkv_events *ev)
{
    for (size_t i = 0; i < ev->n_parts; i++)
        snapkv__kv_replay_reply__free_unpacked(ev->parts[i], NULL);
    free(ev->parts);
    ev->parts = NULL;
    ev->n_parts = ev->part = ev->part_next = 0;
}

/* The next event of a replay's snapshot, or NULL once it is all returned (then freed). */
static const Snapkv__KvEvent *next_replayed(struct snapkv_events *ev, double *ts)
{
    while (ev->part < ev->n_parts) {
        const Snapkv__KvEventBatch *b = ev->parts[ev->part]->batch;
        if (b && ev->part_next < b->n_events) {
            *ts = b->ts;
            return b->events[ev->part_next++];
        }
        ev->part++;
        ev->part_next = 0;
    }
    parts_free(ev);
    return NULL;
}

int snapkv_events_next(snapkv_events_t *ev, int timeout_ms, struct snapkv_event *out)
{
    if (!ev || !out)
        return skv_client_fail(SNAPKV_E_INVAL, "snapkv_events_next: NULL argument");
    double ts = 0;
    uint64_t sequence = ev->replayed;
    const Snapkv__KvEvent *e = ev->n_parts ? next_replayed(ev, &ts) : NULL;
    if (!e) {
        while (!ev->batch || ev->next >= ev->batch->n_events) {
            int rc = read_batch(ev, timeout_ms);
            if (rc)
                return rc;
        }
        e = ev->batch->events[ev->next++];
        ts = ev->batch->ts;
        sequence = ev->sequence;
    }
    struct snapkv_event r = {.sequence = sequence, .ts = ts};
    const ProtobufCBinaryData *id = NULL;
    const char *tenant = NULL;
    const uint64_t *hashes = NULL;
    switch (e->kind_case) {
    case SNAPKV__KV_EVENT__KIND_STORED:
        r.kind = SNAPKV_EVENT_STORED;
        id = &e->stored->session_id;
        tenant = e->stored->tenant;
        r.n_tokens = e->stored->n_tokens;
        r.bytes = e->stored->bytes;
        r.compressed = e->stored->compressed;
        r.block_size = e->stored->block_size;
        r.n_block_hashes = e->stored->n_block_hashes;
        hashes = e->stored->block_hashes;
        break;
    case SNAPKV__KV_EVENT__KIND_REMOVED:
        r.kind = SNAPKV_EVENT_REMOVED;
        id = &e->removed->session_id;
        tenant = e->removed->tenant;
        r.n_block_hashes = e->removed->n_block_hashes;
        hashes = e->removed->block_hashes;
        break;
    case SNAPKV__KV_EVENT__KIND_CLEARED:
        r.kind = SNAPKV_EVENT_CLEARED;
        break;
    default:
        return skv_client_fail(SNAPKV_E_PROTO, "events: an event of an unknown kind");
    }
    if (id) {
        int rc = skv_client_id_parse(id, "event", &r.id);
        if (rc)
            return rc;
    }
    snprintf(r.tenant, sizeof r.tenant, "%s", tenant ? tenant : "");
    if (r.n_block_hashes) {
        if (!(r.block_hashes = malloc(r.n_block_hashes * sizeof *r.block_hashes)))
            return skv_client_fail(SNAPKV_E_NOMEM, "out of memory");
        memcpy(r.block_hashes, hashes, r.n_block_hashes * sizeof *r.block_hashes);
    }
    *out = r;
    return SNAPKV_OK;
}

void snapkv_event_free(struct snapkv_event *e)
{
    if (!e)
        return;
    free(e->block_hashes);
    e->block_hashes = NULL;
    e->n_block_hashes = 0;
}

/* Reads one replay part ([sequence][KvReplayReply]) from sock into *out. */
static int read_part(void *sock, int64_t deadline, uint64_t *seq, Snapkv__KvReplayReply **out)
{
    long wait = deadline < 0 ? -1 : (long)(deadline - skv_client_now_ms());
    zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
    int n = zmq_poll(&it, 1, deadline < 0 ? -1 : wait > 0 ? wait : 0);
    if (n < 0)
        return skv_client_fail(SNAPKV_E_IO, "events replay: %s", zmq_strerror(zmq_errno()));
    if (n == 0)
        return skv_client_fail(SNAPKV_E_TIMEOUT, "events replay: the snapshot did not come in time (is "
                               "events-replay-endpoint set on the daemon? A reply cut short: replay again)");
    zmq_msg_t f[2];
    int got;
    *out = NULL;
    int rc = recv_frames(sock, f, 2, &got, "events replay");
    if (rc)
        return rc;
    if (got != 2 || zmq_msg_size(&f[0]) != 8) {
        rc = skv_client_fail(SNAPKV_E_PROTO, "events replay: a message of %d frames is not a reply", got);
    } else {
        *seq = be64(zmq_msg_data(&f[0]));
        *out = snapkv__kv_replay_reply__unpack(NULL, zmq_msg_size(&f[1]), zmq_msg_data(&f[1]));
        if (!*out)
            rc = skv_client_fail(SNAPKV_E_PROTO, "events replay: a reply that does not decode");
    }
    for (int i = 0; i < got && i < 2; i++)
        zmq_msg_close(&f[i]);
    return rc;
}

int snapkv_events_replay(snapkv_events_t *ev, const char *replay_endpoint, int timeout_ms)
{
    if (!ev || !replay_endpoint)
        return skv_client_fail(SNAPKV_E_INVAL, "snapkv_events_replay: NULL argument");
    int64_t deadline = timeout_ms < 0 ? -1 : skv_client_now_ms() + timeout_ms;
    void *sock = zmq_socket(ev->zctx, ZMQ_DEALER);
    int linger = 0, rc = SNAPKV_OK;
    Snapkv__KvReplayRequest req = SNAPKV__KV_REPLAY_REQUEST__INIT;
    req.version = 1;
    uint8_t buf[16];
    size_t len = snapkv__kv_replay_request__pack(&req, buf);
    if (!sock || zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_connect(sock, replay_endpoint) != 0 || zmq_send(sock, buf, len, ZMQ_DONTWAIT) < 0) {
        rc = skv_client_fail(SNAPKV_E_IO, "events replay %s: %s", replay_endpoint, zmq_strerror(zmq_errno()));
        if (sock)
            zmq_close(sock);
        return rc;
    }
    Snapkv__KvReplayReply **parts = NULL;
    size_t n = 0;
    uint64_t seq = 0;
    for (bool final = false; !final && !rc;) {
        Snapkv__KvReplayReply *p = NULL;
        uint64_t s = 0;
        if ((rc = read_part(sock, deadline, &s, &p)))
            break;
        Snapkv__KvReplayReply **more = realloc(parts, (n + 1) * sizeof *parts);
        if (!more) {
            snapkv__kv_replay_reply__free_unpacked(p, NULL);
            rc = skv_client_fail(SNAPKV_E_NOMEM, "out of memory");
            break;
        }
        parts = more;
        parts[n++] = p;
        final = p->final;
        if (p->status != SNAPKV_OK)
            rc = skv_client_fail(p->status < 0 ? p->status : SNAPKV_E_PROTO, "events replay: %s",
                                 p->message && *p->message ? p->message : snapkv_status_str(p->status));
        else if (p->part != n - 1 || (n > 1 && s != seq))
            rc = skv_client_fail(SNAPKV_E_PROTO, "events replay: part %u of sequence %llu where part %zu of %llu "
                                 "was due", p->part, (unsigned long long)s, n - 1, (unsigned long long)seq);
        seq = s;
    }
    zmq_close(sock);
    if (rc) {
        for (size_t i = 0; i < n; i++)
            snapkv__kv_replay_reply__free_unpacked(parts[i], NULL);
        free(parts);
        return rc;
    }
    parts_free(ev); /* an earlier snapshot not yet returned is superseded */
    ev->parts = parts;
    ev->n_parts = n;
    ev->replayed = seq;
    ev->skip = true;
    ev->seen = false;
    ev->boot_id = parts[0]->batch ? parts[0]->batch->boot_id : 0;
    if (ev->batch && ev->sequence <= seq) { /* the rest of a stream message the snapshot holds */
        snapkv__kv_event_batch__free_unpacked(ev->batch, NULL);
        ev->batch = NULL;
    }
    return SNAPKV_OK;
}

void snapkv_events_close(snapkv_events_t **ev_p)
{
    if (!ev_p || !*ev_p)
        return;
    struct snapkv_events *ev = *ev_p;
    parts_free(ev);
    if (ev->batch)
        snapkv__kv_event_batch__free_unpacked(ev->batch, NULL);
    if (ev->sub)
        zmq_close(ev->sub);
    if (ev->zctx)
        zmq_ctx_term(ev->zctx);
    free(ev);
    *ev_p = NULL;
}
