/* The KV events replay (see events_replay.h): an open-addressing table from session id to the
 * last SessionStored the stream published for it, and the ROUTER side of a replay. */
#include "daemon/events_replay.h"
#include "common/log.h"
#include "common/status.h"
#include "proto/snapkv.pb-c.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#define ID_BYTES 16
#define REPLAY_VERSION 1

struct entry {
    uint8_t id[ID_BYTES];
    Snapkv__KvEvent *ev;          /* its SessionStored, unpacked on its own; NULL: an empty slot */
};

struct skv_events_mirror {
    struct entry *tab;            /* cap a power of two, at most half full */
    size_t cap, n;
};

int skv_events_mirror_new(struct skv_events_mirror **out)
{
    struct skv_events_mirror *m = calloc(1, sizeof *m);
    if (!m || !(m->tab = calloc(64, sizeof *m->tab))) {
        free(m);
        return SKV_E_NOMEM;
    }
    m->cap = 64;
    *out = m;
    return SKV_OK;
}

static void clear(struct skv_events_mirror *m)
{
    for (size_t i = 0; i < m->cap; i++)
        if (m->tab[i].ev) {
            snapkv__kv_event__free_unpacked(m->tab[i].ev, NULL);
            m->tab[i].ev = NULL;
        }
    m->n = 0;
}

void skv_events_mirror_free(struct skv_events_mirror **m_p)
{
    struct skv_events_mirror *m = m_p ? *m_p : NULL;
    if (!m)
        return;
    clear(m);
    free(m->tab);
    free(m);
    *m_p = NULL;
}

size_t skv_events_mirror_count(const struct skv_events_mirror *m)
{
    return m->n;
}

static size_t slot_of(const struct skv_events_mirror *m, const uint8_t *id)
{
    uint64_t h; /* ids are random: their first bytes are a hash already */
    memcpy(&h, id, sizeof h);
    return (size_t)(h * 0x9E3779B97F4A7C15ull >> 20) & (m->cap - 1);
}

/* The slot holding id, or the empty one where it would go. */
static size_t find(const struct skv_events_mirror *m, const uint8_t *id)
{
    size_t i = slot_of(m, id);
    while (m->tab[i].ev && memcmp(m->tab[i].id, id, ID_BYTES) != 0)
        i = (i + 1) & (m->cap - 1);
    return i;
}

static int grow(struct skv_events_mirror *m)
{
    struct skv_events_mirror big = {.cap = 2 * m->cap};
    if (!(big.tab = calloc(big.cap, sizeof *big.tab)))
        return SKV_E_NOMEM;
    for (size_t i = 0; i < m->cap; i++)
        if (m->tab[i].ev)
            big.tab[find(&big, m->tab[i].id)] = m->tab[i];
    free(m->tab);
    m->tab = big.tab;
    m->cap = big.cap;
    return SKV_OK;
}

/* Empties slot i and moves back the entries after it that probed past it (linear probing
 * without tombstones). */
static void remove_at(struct skv_events_mirror *m, size_t i)
{
    snapkv__kv_event__free_unpacked(m->tab[i].ev, NULL);
    m->tab[i].ev = NULL;
    m->n--;
    for (size_t j = (i + 1) & (m->cap - 1); m->tab[j].ev; j = (j + 1) & (m->cap - 1)) {
        size_t home = slot_of(m, m->tab[j].id);
        /* j's entry may fill the hole at i unless its home lies cyclically in (i, j] */
        bool stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (stays)
            continue;
        m->tab[i] = m->tab[j];
        m->tab[j].ev = NULL;
        i = j;
    }
}

/* A copy of ev of its own (packed and read back), for the mirror to keep. */
static Snapkv__KvEvent *own_copy(const Snapkv__KvEvent *ev)
{
    size_t len = snapkv__kv_event__get_packed_size(ev);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf)
        return NULL;
    snapkv__kv_event__pack(ev, buf);
    Snapkv__KvEvent *copy = snapkv__kv_event__unpack(NULL, len, buf);
    free(buf);
    return copy;
}

static void apply_stored(struct skv_events_mirror *m, const Snapkv__KvEvent *ev)
{
    const ProtobufCBinaryData *id = &ev->stored->session_id;
    if (id->len != ID_BYTES)
        return;
    Snapkv__KvEvent *copy = own_copy(ev);
    if (!copy || (2 * (m->n + 1) > m->cap && grow(m))) {
        if (copy)
            snapkv__kv_event__free_unpacked(copy, NULL);
        size_t i = find(m, id->data); /* rather absent than stale */
        if (m->tab[i].ev)
            remove_at(m, i);
        skv_log(SKV_LOG_WARN, "events replay: no memory for a session: replays leave it out");
        return;
    }
    size_t i = find(m, id->data);
    if (m->tab[i].ev) {
        snapkv__kv_event__free_unpacked(m->tab[i].ev, NULL);
    } else {
        memcpy(m->tab[i].id, id->data, ID_BYTES);
        m->n++;
    }
    m->tab[i].ev = copy;
}

void skv_events_mirror_apply(struct skv_events_mirror *m, const void *body, size_t len)
{
    Snapkv__KvEventBatch *b = snapkv__kv_event_batch__unpack(NULL, len, body);
    if (!b) {
        skv_log(SKV_LOG_WARN, "events replay: a published batch that does not decode: not mirrored");
        return;
    }
    for (size_t k = 0; k < b->n_events; k++) {
        const Snapkv__KvEvent *ev = b->events[k];
        if (ev->kind_case == SNAPKV__KV_EVENT__KIND_STORED) {
            apply_stored(m, ev);
        } else if (ev->kind_case == SNAPKV__KV_EVENT__KIND_REMOVED && ev->removed->session_id.len == ID_BYTES) {
            size_t i = find(m, ev->removed->session_id.data);
            if (m->tab[i].ev)
                remove_at(m, i);
        } else if (ev->kind_case == SNAPKV__KV_EVENT__KIND_CLEARED) {
            clear(m);
        }
    }
    snapkv__kv_event_batch__free_unpacked(b, NULL);
}

/* Sends [sequence][reply] to identity; false when the socket did not take it. */
static bool send_part(void *sock, const zmq_msg_t *identity, uint64_t sequence, const Snapkv__KvReplayReply *rep)
{
    uint8_t be[8];
    for (int k = 0; k < 8; k++)
        be[k] = (uint8_t)(sequence >> (56 - 8 * k));
    size_t len = snapkv__kv_replay_reply__get_packed_size(rep);
    zmq_msg_t id, body;
    if (zmq_msg_init_size(&body, len) != 0)
        return false;
    snapkv__kv_replay_reply__pack(rep, zmq_msg_data(&body));
    zmq_msg_init(&id);
    zmq_msg_copy(&id, (zmq_msg_t *)identity);
    bool ok = zmq_msg_send(&id, sock, ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0 &&
              zmq_send(sock, be, sizeof be, ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0 &&
              zmq_msg_send(&body, sock, ZMQ_DONTWAIT) >= 0;
    zmq_msg_close(&id);
    zmq_msg_close(&body);
    return ok;
}

static void refuse(void *sock, const zmq_msg_t *identity, uint64_t sequence, int status, const char *why)
{
    Snapkv__KvReplayReply rep = SNAPKV__KV_REPLAY_REPLY__INIT;
    rep.version = REPLAY_VERSION;
    rep.status = status;
    rep.message = (char *)why;
    rep.final = true;
    if (!send_part(sock, identity, sequence, &rep))
        skv_log(SKV_LOG_DEBUG, "events replay: a refusal not sent (the requester is gone)");
}

/* The snapshot in parts of SKV_REPLAY_PART_EVENTS events, part 0 led by AllCleared. */
static void send_snapshot(struct skv_events_mirror *m, void *sock, const zmq_msg_t *identity, uint64_t sequence,
                          uint64_t boot_id)
{
    Snapkv__KvEvent *events[SKV_REPLAY_PART_EVENTS];
    Snapkv__AllCleared cleared_msg = SNAPKV__ALL_CLEARED__INIT;
    Snapkv__KvEvent cleared = SNAPKV__KV_EVENT__INIT;
    cleared.kind_case = SNAPKV__KV_EVENT__KIND_CLEARED;
    cleared.cleared = &cleared_msg;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    size_t n = 0, i = 0, sent = 0, placed = 0; /* placed: sessions put in a part so far */
    events[n++] = &cleared;
    for (uint32_t part = 0;; part++) {
        while (n < SKV_REPLAY_PART_EVENTS && placed < m->n) {
            if (m->tab[i].ev) {
                events[n++] = m->tab[i].ev;
                placed++;
            }
            i++;
        }
        Snapkv__KvEventBatch batch = SNAPKV__KV_EVENT_BATCH__INIT;
        batch.version = REPLAY_VERSION;
        batch.ts = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
        batch.boot_id = boot_id;
        batch.n_events = n;
        batch.events = events;
        Snapkv__KvReplayReply rep = SNAPKV__KV_REPLAY_REPLY__INIT;
        rep.version = REPLAY_VERSION;
        rep.part = part;
        rep.final = placed == m->n; /* (no empty part after the last session) */
        rep.batch = &batch;
        if (!send_part(sock, identity, sequence, &rep)) {
            skv_log(SKV_LOG_DEBUG, "events replay: cut after %zu of %zu sessions (the requester is gone or does not "
                    "read)", sent, m->n);
            return;
        }
        sent += n - (part == 0);
        if (rep.final)
            break;
        n = 0;
    }
    skv_log(SKV_LOG_DEBUG, "events replay: %zu session(s) at sequence %llu", sent, (unsigned long long)sequence);
}

bool skv_events_mirror_serve(struct skv_events_mirror *m, void *sock, uint64_t sequence, uint64_t boot_id)
{
    zmq_msg_t identity, body;
    zmq_msg_init(&identity);
    zmq_msg_init(&body);
    if (zmq_msg_recv(&identity, sock, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&identity);
        zmq_msg_close(&body);
        return false;
    }
    int frames = 1;
    bool more = zmq_msg_more(&identity);
    for (; more; frames++) { /* every frame of the message; the second is the request */
        zmq_msg_t extra;
        zmq_msg_t *into = frames == 1 ? &body : &extra;
        if (frames > 1)
            zmq_msg_init(&extra);
        if (zmq_msg_recv(into, sock, 0) < 0)
            break;
        more = zmq_msg_more(into);
        if (frames > 1)
            zmq_msg_close(&extra);
    }
    Snapkv__KvReplayRequest *req =
        frames == 2 ? snapkv__kv_replay_request__unpack(NULL, zmq_msg_size(&body), zmq_msg_data(&body)) : NULL;
    if (!req)
        refuse(sock, &identity, sequence, SKV_E_PROTO, "not a KvReplayRequest: send one frame, a packed KvReplayRequest");
    else if (req->version != REPLAY_VERSION)
        refuse(sock, &identity, sequence, SKV_E_VERSION, "replay protocol version not supported (this daemon speaks 1)");
    else
        send_snapshot(m, sock, &identity, sequence, boot_id);
    if (req)
        snapkv__kv_replay_request__free_unpacked(req, NULL);
    zmq_msg_close(&identity);
    zmq_msg_close(&body);
    return true;
}
