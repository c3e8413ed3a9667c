/* libsnapkv's KV events subscriber: a SUB socket on the daemon's events-endpoint, each message
 * [topic][sequence, big-endian u64][KvEventBatch] read into a struct snapkv_event. */
#include "libclient/client_internal.h"

#include <errno.h>
#include <stddef.h>
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
    uint64_t boot_id;             /* the replayed daemon's (KvEventBatch.boot_id; 0: a daemon of before them) */
    double replayed_ts;           /* when the snapshot was taken (the daemon's clock) */
    bool replayed_streamed;       /* a stream message of the replayed daemon came since the replay */
    uint64_t last_streamed;       /* the boot id of the last stream message read, kept or dropped */
    uint64_t stream_boot;         /* the boot id of the daemon whose events were returned last (0: none yet) */
    bool restarted;               /* return a CLEARED of sequence 0 before the message being read */
    uint64_t published;           /* the newest event number the stream's daemon announced: the last kept
                                   * message's (an event's, or a heartbeat's last event), or a replay's */
    int64_t heard_ms;             /* when the stream last brought a message (or the subscriber opened) */
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
    ev->heard_ms = skv_client_now_ms();
    *out = ev;
    return SNAPKV_OK;
}

/* Reads every frame of one waiting message, however many there are, keeping the first max in
 * f (*got: how many it had; the caller closes min(*got, max) of them). */
static int recv_frames(void *sock, zmq_msg_t *f, int max, int *got, const char *what)
{
    *got = 0;
    for (int more = 1; more;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, sock, 0) < 0) {
            int err = zmq_errno();
            zmq_msg_close(&m);
            if (err == EINTR)
                continue; /* a signal: the frame is still there */
            for (int i = 0; i < *got && i < max; i++)
                zmq_msg_close(&f[i]);
            return skv_client_fail(SNAPKV_E_IO, "%s: %s", what, zmq_strerror(err));
        }
        more = zmq_msg_more(&m);
        if (*got < max)
            f[*got] = m;
        else
            zmq_msg_close(&m);
        (*got)++;
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

/* Waits until deadline (-1: none) for sock to have a message: 1, 0 when none came, or a status. */
static int wait_input(void *sock, int64_t deadline, const char *what)
{
    for (;;) {
        zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
        int n = zmq_poll(&it, 1, skv_client_wait_ms(deadline));
        if (n >= 0)
            return n > 0;
        if (zmq_errno() == EINTR)
            continue; /* a signal: wait on for what is left */
        return skv_client_fail(SNAPKV_E_IO, "%s: %s", what, zmq_strerror(zmq_errno()));
    }
}

/* Notes that stream batch b was read (kept or dropped). */
static void note_streamed(struct snapkv_events *ev, const Snapkv__KvEventBatch *b)
{
    if (ev->boot_id && b->boot_id == ev->boot_id)
        ev->replayed_streamed = true;
    ev->last_streamed = b->boot_id;
}

/* Reads the next stream message that came by deadline: *seq its number, *out its batch.
 * SNAPKV_E_TIMEOUT (no message set) when none came. */
static int recv_batch(struct snapkv_events *ev, int64_t deadline, uint64_t *seq, Snapkv__KvEventBatch **out)
{
    int rc = wait_input(ev->sub, deadline, "events");
    if (rc <= 0)
        return rc ? rc : SNAPKV_E_TIMEOUT;
    zmq_msg_t parts[3];
    int got;
    rc = recv_frames(ev->sub, parts, 3, &got, "events");
    if (rc)
        return rc;
    ev->heard_ms = skv_client_now_ms(); /* whatever it is: something is there */
    if (got != 3 || zmq_msg_size(&parts[1]) != 8) {
        rc = skv_client_fail(SNAPKV_E_PROTO, "events: a message of %d frames is not an event", got);
    } else {
        *seq = be64(zmq_msg_data(&parts[1]));
        *out = snapkv__kv_event_batch__unpack(NULL, zmq_msg_size(&parts[2]), zmq_msg_data(&parts[2]));
        if (!*out)
            rc = skv_client_fail(SNAPKV_E_PROTO, "events: a batch that does not decode");
        else
            note_streamed(ev, *out); /* (before whether to keep it is decided: the same either way) */
    }
    for (int i = 0; i < got && i < 3; i++)
        zmq_msg_close(&parts[i]);
    return rc;
}

static bool has_cleared(const Snapkv__KvEventBatch *b)
{
    for (size_t k = 0; k < b->n_events; k++)
        if (b->events[k]->kind_case == SNAPKV__KV_EVENT__KIND_CLEARED)
            return true;
    return false;
}

/* Whether stream batch b (numbered seq) is newer than the replay's snapshot: its daemon's above
 * the snapshot's number, or another daemon's published after the snapshot was taken (one that
 * started since, not one that ran before it). */
static bool newer_than_snapshot(const struct snapkv_events *ev, uint64_t seq, const Snapkv__KvEventBatch *b)
{
    if (b->boot_id == ev->boot_id)
        return seq > ev->replayed;
    /* the stream brings one endpoint's daemons in the order they ran: after one of the replayed
     * daemon's own messages, another daemon's is of one started since, even when its clock was
     * stepped back between the two; before, only the time tells it from an earlier daemon's */
    return ev->replayed_streamed || b->ts >= ev->replayed_ts;
}

/* After a replay, whether a stream batch that came after the snapshot (the replay dropped those
 * queued before it: drop_queued) is one to return: one of the snapshot's daemon numbered above
 * the snapshot, or any of a daemon started since (another boot id: it numbers from 1 again,
 * and its first event, AllCleared, went out before this subscriber had reconnected). */
static bool after_snapshot(const struct snapkv_events *ev, uint64_t seq, const Snapkv__KvEventBatch *b)
{
    if (newer_than_snapshot(ev, seq, b))
        return true;
    if (b->boot_id != ev->boot_id)
        return false;
    /* a daemon of before boot ids: a restart shows only as a number below the last one seen,
     * or an AllCleared */
    return !ev->boot_id && ((ev->seen && seq < ev->sequence) || has_cleared(b));
}

/* Makes b (numbered seq; NULL: one dropped) the message being read. One of another daemon than
 * the last one returned (the daemon restarted) is preceded by a CLEARED of sequence 0, unless
 * it begins with the new daemon's own (its sequence 1): the subscriber missed the events the
 * new daemon published before the subscription reached it (its AllCleared, a restore's).
 * A kept message's number is the newest the daemon published (snapkv_events_published): one
 * daemon's messages come in order, and another's, or a restarted daemon of before boot ids,
 * number from 1 again. */
static void set_batch(struct snapkv_events *ev, uint64_t seq, Snapkv__KvEventBatch *b)
{
    if (b)
        ev->published = seq;
    if (b && b->boot_id) {
        if (ev->stream_boot && b->boot_id != ev->stream_boot && !(seq == 1 && has_cleared(b)))
            ev->restarted = true;
        ev->stream_boot = b->boot_id;
    }
    if (ev->batch)
        snapkv__kv_event_batch__free_unpacked(ev->batch, NULL);
    ev->batch = b;
    ev->next = 0;
    ev->sequence = seq;
    ev->seen = true;
}

/* Reads the next message into ev->batch (the earlier one freed); after a replay, one the
 * snapshot holds is dropped (ev->batch NULL). */
static int read_batch(struct snapkv_events *ev, int64_t deadline, int timeout_ms)
{
    uint64_t seq = 0;
    Snapkv__KvEventBatch *b = NULL;
    int rc = recv_batch(ev, deadline, &seq, &b);
    if (rc == SNAPKV_E_TIMEOUT)
        return skv_client_fail(SNAPKV_E_TIMEOUT, "no event within %d ms", timeout_ms);
    if (rc)
        return rc;
    bool keep = !ev->skip || after_snapshot(ev, seq, b);
    if (!keep) {
        snapkv__kv_event_batch__free_unpacked(b, NULL);
        b = NULL;
    }
    set_batch(ev, seq, b);
    ev->skip = !keep;
    return SNAPKV_OK;
}

/* Drops the stream messages already queued when a replay's snapshot came: those of its daemon
 * numbered up to it (the snapshot holds what they said), and those of another daemon, one that
 * ran before it (the daemon restarted while they waited). The first one numbered above the
 * snapshot becomes ev->batch and ends the dropping. Messages that are not events go too; it
 * stops at any other error (snapkv_events_next meets it again). */
static void drop_queued(struct snapkv_events *ev)
{
    for (;;) {
        uint64_t seq = 0;
        Snapkv__KvEventBatch *b = NULL;
        int rc = recv_batch(ev, 0, &seq, &b); /* (deadline 0: passed, no wait) */
        if (rc == SNAPKV_E_PROTO)
            continue;
        if (rc)
            return;
        if (newer_than_snapshot(ev, seq, b)) {
            set_batch(ev, seq, b);
            ev->skip = false;
            return;
        }
        snapkv__kv_event_batch__free_unpacked(b, NULL);
    }
}

static void parts_free(struct snapkv_events *ev)
{
    for (size_t i = 0; i < ev->n_parts; i++)
        snapkv__kv_replay_reply__free_unpacked(ev->parts[i], NULL);
    free(ev->parts);
    ev->parts = NULL;
    ev->n_parts = ev->part = ev->part_next = 0;
}

/* The next event of a replay's snapshot, not yet taken (ev->part_next++ takes it), or NULL once
 * it is all returned (then freed). */
static const Snapkv__KvEvent *next_replayed(struct snapkv_events *ev, double *ts)
{
    while (ev->part < ev->n_parts) {
        const Snapkv__KvEventBatch *b = ev->parts[ev->part]->batch;
        if (b && ev->part_next < b->n_events) {
            *ts = b->ts;
            return b->events[ev->part_next];
        }
        ev->part++;
        ev->part_next = 0;
    }
    parts_free(ev);
    return NULL;
}

/* kept_prefix (11:0:7) took the padding right after compressed: block_size is where 5:0:1 had
 * it (compressed's offset + 1, rounded up to 4), and on LP64 the layout is 5:0:1's byte for byte */
_Static_assert(offsetof(struct snapkv_event, kept_prefix) == offsetof(struct snapkv_event, compressed) + 1 &&
                   offsetof(struct snapkv_event, block_size) ==
                       ((offsetof(struct snapkv_event, compressed) + 1 + 3) & ~(size_t)3),
               "struct snapkv_event's layout changed");
#if defined(__LP64__)
_Static_assert(offsetof(struct snapkv_event, compressed) == 184 && offsetof(struct snapkv_event, block_size) == 188 &&
                   sizeof(struct snapkv_event) == 208,
               "struct snapkv_event is not 5:0:1's layout");
#endif

/* Fills *out from e; SNAPKV_E_NOMEM leaves e to be read again. */
static int event_read(const Snapkv__KvEvent *e, struct snapkv_event *out)
{
    const ProtobufCBinaryData *id = NULL;
    const char *tenant = NULL;
    const uint64_t *hashes = NULL;
    switch (e->kind_case) {
    case SNAPKV__KV_EVENT__KIND_STORED:
        out->kind = SNAPKV_EVENT_STORED;
        id = &e->stored->session_id;
        tenant = e->stored->tenant;
        out->n_tokens = e->stored->n_tokens;
        out->bytes = e->stored->bytes;
        out->compressed = e->stored->compressed;
        out->kept_prefix = e->stored->kept_prefix;
        out->block_size = e->stored->block_size;
        out->n_block_hashes = e->stored->n_block_hashes;
        hashes = e->stored->block_hashes;
        break;
    case SNAPKV__KV_EVENT__KIND_REMOVED:
        out->kind = SNAPKV_EVENT_REMOVED;
        id = &e->removed->session_id;
        tenant = e->removed->tenant;
        out->n_block_hashes = e->removed->n_block_hashes;
        hashes = e->removed->block_hashes;
        break;
    case SNAPKV__KV_EVENT__KIND_CLEARED:
        out->kind = SNAPKV_EVENT_CLEARED;
        break;
    default:
        return skv_client_fail(SNAPKV_E_PROTO, "events: an event of an unknown kind");
    }
    if (id) {
        int rc = skv_client_id_parse(id, "event", &out->id);
        if (rc)
            return rc;
    }
    snprintf(out->tenant, sizeof out->tenant, "%s", tenant ? tenant : "");
    if (out->n_block_hashes) {
        if (!(out->block_hashes = malloc(out->n_block_hashes * sizeof *out->block_hashes)))
            return skv_client_fail(SNAPKV_E_NOMEM, "events: out of memory for %zu block hashes",
                                   out->n_block_hashes);
        memcpy(out->block_hashes, hashes, out->n_block_hashes * sizeof *out->block_hashes);
    }
    return SNAPKV_OK;
}

int snapkv_events_next(snapkv_events_t *ev, int timeout_ms, struct snapkv_event *out)
{
    if (!ev || !out)
        return skv_client_fail(SNAPKV_E_INVAL, "snapkv_events_next: NULL argument");
    /* one deadline however many messages are read (and dropped) meanwhile */
    int64_t deadline = timeout_ms < 0 ? -1 : skv_client_now_ms() + timeout_ms;
    double ts = 0;
    uint64_t sequence = ev->replayed;
    const Snapkv__KvEvent *e = ev->n_parts ? next_replayed(ev, &ts) : NULL;
    size_t *taken = &ev->part_next;
    if (!e) {
        /* a batch of no events is the daemon's heartbeat: read for its boot id alone */
        while (!ev->restarted && (!ev->batch || ev->next >= ev->batch->n_events)) {
            int rc = read_batch(ev, deadline, timeout_ms);
            if (rc)
                return rc;
        }
        if (ev->restarted) { /* the daemon restarted: what came before is gone */
            ev->restarted = false;
            *out = (struct snapkv_event){.kind = SNAPKV_EVENT_CLEARED, .sequence = 0, .ts = ev->batch->ts};
            return SNAPKV_OK;
        }
        e = ev->batch->events[ev->next];
        ts = ev->batch->ts;
        sequence = ev->sequence;
        taken = &ev->next;
    }
    struct snapkv_event r = {.sequence = sequence, .ts = ts};
    int rc = event_read(e, &r);
    if (rc != SNAPKV_E_NOMEM)
        ++*taken; /* an event that is not one is not read again */
    if (rc)
        return rc;
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
    int n = wait_input(sock, deadline, "events replay");
    if (n < 0)
        return n;
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
    ev->replayed_ts = parts[0]->batch ? parts[0]->batch->ts : 0;
    /* a stream message of that daemon read last before the replay counts: the stream's order is
     * the same (not one a replay only named: another's may still be on its way) */
    ev->replayed_streamed = ev->boot_id && ev->last_streamed == ev->boot_id;
    ev->stream_boot = ev->boot_id; /* the snapshot begins with its daemon's AllCleared */
    ev->restarted = false;
    /* the snapshot's number, or that of a stream message above it already read (of a daemon with
     * boot ids: one of before them that restarted since also numbers below) */
    bool above = ev->boot_id && ev->batch && ev->batch->boot_id == ev->boot_id && ev->sequence > seq;
    ev->published = above ? ev->sequence : seq;
    if (above) {
        ev->skip = false; /* the rest of a stream message above the snapshot: the stream goes on */
        return SNAPKV_OK;
    }
    if (ev->batch) { /* the rest of one the snapshot holds, or of an earlier daemon's */
        snapkv__kv_event_batch__free_unpacked(ev->batch, NULL);
        ev->batch = NULL;
    }
    drop_queued(ev);
    return SNAPKV_OK;
}

uint64_t snapkv_events_published(const snapkv_events_t *ev)
{
    return ev ? ev->published : 0;
}

uint64_t snapkv_events_quiet_ms(const snapkv_events_t *ev)
{
    if (!ev)
        return 0;
    int64_t now = skv_client_now_ms();
    return now > ev->heard_ms ? (uint64_t)(now - ev->heard_ms) : 0;
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
