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
    int got = 0, more = 1;
    for (; more; got++) { /* every frame of the message, however many there are */
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, ev->sub, 0) < 0) {
            zmq_msg_close(&m);
            for (int i = 0; i < got && i < 3; i++)
                zmq_msg_close(&parts[i]);
            return skv_client_fail(SNAPKV_E_IO, "events: %s", zmq_strerror(zmq_errno()));
        }
        more = zmq_msg_more(&m);
        if (got < 3)
            parts[got] = m;
        else
            zmq_msg_close(&m);
    }
    int rc = SNAPKV_OK;
    if (got != 3 || zmq_msg_size(&parts[1]) != 8) {
        rc = skv_client_fail(SNAPKV_E_PROTO, "events: a message of %d frames is not an event", got);
    } else {
        const uint8_t *be = zmq_msg_data(&parts[1]);
        uint64_t seq = 0;
        for (int k = 0; k < 8; k++)
            seq = seq << 8 | be[k];
        if (ev->batch)
            snapkv__kv_event_batch__free_unpacked(ev->batch, NULL);
        ev->batch = snapkv__kv_event_batch__unpack(NULL, zmq_msg_size(&parts[2]), zmq_msg_data(&parts[2]));
        ev->next = 0;
        ev->sequence = seq;
        if (!ev->batch)
            rc = skv_client_fail(SNAPKV_E_PROTO, "events: a batch that does not decode");
    }
    for (int i = 0; i < got && i < 3; i++)
        zmq_msg_close(&parts[i]);
    return rc;
}

int snapkv_events_next(snapkv_events_t *ev, int timeout_ms, struct snapkv_event *out)
{
    if (!ev || !out)
        return skv_client_fail(SNAPKV_E_INVAL, "snapkv_events_next: NULL argument");
    while (!ev->batch || ev->next >= ev->batch->n_events) {
        int rc = read_batch(ev, timeout_ms);
        if (rc)
            return rc;
    }
    const Snapkv__KvEvent *e = ev->batch->events[ev->next++];
    struct snapkv_event r = {.sequence = ev->sequence, .ts = ev->batch->ts};
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

void snapkv_events_close(snapkv_events_t **ev_p)
{
    if (!ev_p || !*ev_p)
        return;
    struct snapkv_events *ev = *ev_p;
    if (ev->batch)
        snapkv__kv_event_batch__free_unpacked(ev->batch, NULL);
    if (ev->sub)
        zmq_close(ev->sub);
    if (ev->zctx)
        zmq_ctx_term(ev->zctx);
    free(ev);
    *ev_p = NULL;
}
