/* Replies handed to libzmq, counted in bytes per client until the connection takes them (see
 * replies.h). The counts are changed by the socket thread (send) and by libzmq's threads (the
 * free callback), under one mutex. */
#include "daemon/replies.h"
#include "common/status.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#define BUCKETS 1024
#define ID_MAX 256                /* a ZeroMQ routing id is at most 255 bytes */

/* A client with replies not taken yet (absent when it has none). */
struct peer {
    int sock;
    size_t id_len;
    uint8_t id[ID_MAX];
    uint64_t bytes;
    uint32_t msgs;
    struct peer *next;
};

/* An owner (a user or an address) with replies not taken yet. */
struct owner {
    uint64_t key;
    uint64_t bytes;
    uint32_t msgs;
    struct owner *next;
};

struct skv_replies {
    pthread_mutex_t mu;
    struct peer *bucket[BUCKETS];
    struct owner *owners[BUCKETS];
    uint64_t max_per_client, max_per_owner, max_total;
    atomic_ullong total;          /* bytes of every client's replies not taken yet */
    atomic_ullong dropped;        /* replies dropped for a bound */
    atomic_ullong closed;         /* replies not sent: their request's connection had closed */
};

/* One reply's buffer: what the free callback needs, then the reply's bytes. */
struct tracked {
    struct skv_replies *r;
    int sock;
    uint64_t owner;
    size_t id_len;
    uint8_t id[ID_MAX];
    size_t len;
    uint64_t cost; /* what it counts against the bounds (skv_replies_send) */
    uint8_t data[];
};

static unsigned peer_hash(int sock, const uint8_t *id, size_t len)
{
    uint32_t h = 2166136261u ^ (uint32_t)sock; /* FNV-1a */
    for (size_t i = 0; i < len; i++)
        h = (h ^ id[i]) * 16777619u;
    return h % BUCKETS;
}

/* The client's entry (r->mu held); create: add one when it has none (NULL: no memory). */
static struct peer *peer_find_locked(struct skv_replies *r, int sock, const uint8_t *id, size_t len, bool create)
{
    unsigned b = peer_hash(sock, id, len);
    for (struct peer *p = r->bucket[b]; p; p = p->next)
        if (p->sock == sock && p->id_len == len && memcmp(p->id, id, len) == 0)
            return p;
    struct peer *p = create ? calloc(1, sizeof *p) : NULL;
    if (p) {
        p->sock = sock;
        p->id_len = len;
        memcpy(p->id, id, len);
        p->next = r->bucket[b];
        r->bucket[b] = p;
    }
    return p;
}

static void peer_remove_locked(struct skv_replies *r, struct peer *gone)
{
    for (struct peer **pp = &r->bucket[peer_hash(gone->sock, gone->id, gone->id_len)]; *pp; pp = &(*pp)->next)
        if (*pp == gone) {
            *pp = gone->next;
            free(gone);
            return;
        }
}

/* The owner's entry (r->mu held); create: add one when it has none (NULL: no memory). */
static struct owner *owner_find_locked(struct skv_replies *r, uint64_t key, bool create)
{
    struct owner **head = &r->owners[key % BUCKETS];
    for (struct owner *o = *head; o; o = o->next)
        if (o->key == key)
            return o;
    struct owner *o = create ? calloc(1, sizeof *o) : NULL;
    if (o) {
        o->key = key;
        o->next = *head;
        *head = o;
    }
    return o;
}

static void owner_remove_locked(struct skv_replies *r, struct owner *gone)
{
    for (struct owner **pp = &r->owners[gone->key % BUCKETS]; *pp; pp = &(*pp)->next)
        if (*pp == gone) {
            *pp = gone->next;
            free(gone);
            return;
        }
}

/* libzmq's free callback: the connection took the reply (or it was dropped). */
static void tracked_free(void *data, void *hint)
{
    (void)data;
    struct tracked *t = hint;
    struct skv_replies *r = t->r;
    pthread_mutex_lock(&r->mu);
    struct peer *p = peer_find_locked(r, t->sock, t->id, t->id_len, false);
    if (p) {
        p->bytes -= t->cost;
        if (--p->msgs == 0)
            peer_remove_locked(r, p);
    }
    struct owner *o = t->owner ? owner_find_locked(r, t->owner, false) : NULL;
    if (o) {
        o->bytes -= t->cost;
        if (--o->msgs == 0)
            owner_remove_locked(r, o);
    }
    atomic_fetch_sub(&r->total, t->cost);
    pthread_mutex_unlock(&r->mu);
    free(t);
}

int skv_replies_new(uint64_t max_per_client, uint64_t max_per_owner, uint64_t max_total, struct skv_replies **out)
{
    struct skv_replies *r = calloc(1, sizeof *r);
    if (!r)
        return SKV_E_NOMEM;
    pthread_mutex_init(&r->mu, NULL);
    r->max_per_client = max_per_client;
    r->max_per_owner = max_per_owner;
    r->max_total = max_total;
    *out = r;
    return SKV_OK;
}

void skv_replies_free(struct skv_replies **r_p)
{
    if (!r_p || !*r_p)
        return;
    struct skv_replies *r = *r_p;
    for (int b = 0; b < BUCKETS; b++) {
        for (struct peer *p = r->bucket[b], *next; p; p = next) {
            next = p->next;
            free(p);
        }
        for (struct owner *o = r->owners[b], *next; o; o = next) {
            next = o->next;
            free(o);
        }
    }
    pthread_mutex_destroy(&r->mu);
    free(r);
    *r_p = NULL;
}

int skv_replies_send(struct skv_replies *r, void *sock, int sock_idx, uint64_t owner, const void *identity,
                     size_t identity_len, const void *body, size_t len)
{
    if (identity_len > ID_MAX)
        return skv_errorf(SKV_E_INVAL, "a routing id of %zu bytes", identity_len);
    struct tracked *t = malloc(sizeof *t + (len ? len : 1));
    if (!t)
        return SKV_E_NOMEM;
    const uint64_t cost = len + identity_len + SKV_REPLY_OVERHEAD;
    *t = (struct tracked){.r = r, .sock = sock_idx, .owner = owner, .id_len = identity_len, .len = len, .cost = cost};
    memcpy(t->id, identity, identity_len);
    memcpy(t->data, body, len);
    /* count the bytes before libzmq has them: its threads may free the reply at once */
    pthread_mutex_lock(&r->mu);
    uint64_t total = atomic_load(&r->total);
    struct peer *p = peer_find_locked(r, sock_idx, identity, identity_len, true);
    struct owner *o = p && owner ? owner_find_locked(r, owner, true) : NULL;
    /* one reply always goes when nothing is held: a bound smaller than a reply delays, never
     * starves, it */
    if (!p || (owner && !o) || (p->bytes && p->bytes + cost > r->max_per_client) ||
        (o && o->bytes && o->bytes + cost > r->max_per_owner) ||
        (sock_idx == 0 && total && total + cost > r->max_total)) {
        uint64_t held = p ? p->bytes : 0, owned = o ? o->bytes : 0;
        if (p && p->msgs == 0)
            peer_remove_locked(r, p);
        if (o && o->msgs == 0)
            owner_remove_locked(r, o);
        pthread_mutex_unlock(&r->mu);
        free(t);
        if (!p || (owner && !o))
            return SKV_E_NOMEM;
        atomic_fetch_add(&r->dropped, 1);
        return skv_errorf(SKV_E_BUSY, "the client holds %llu bytes of replies it has not read, its user or address "
                          "%llu, all clients %llu; this one's %llu would pass max-reply-bytes-per-client (%llu), "
                          "max-reply-bytes-per-peer (%llu) or max-reply-bytes (%llu)",
                          (unsigned long long)held, (unsigned long long)owned, (unsigned long long)total,
                          (unsigned long long)cost,
                          (unsigned long long)r->max_per_client, (unsigned long long)r->max_per_owner,
                          (unsigned long long)r->max_total);
    }
    p->bytes += cost;
    p->msgs++;
    if (o) {
        o->bytes += cost;
        o->msgs++;
    }
    atomic_fetch_add(&r->total, cost);
    pthread_mutex_unlock(&r->mu);

    zmq_msg_t id, msg;
    if (zmq_msg_init_size(&id, identity_len) != 0) {
        tracked_free(NULL, t); /* gives the bytes back */
        return SKV_E_NOMEM;
    }
    memcpy(zmq_msg_data(&id), identity, identity_len);
    if (zmq_msg_init_data(&msg, t->data, len, tracked_free, t) != 0) {
        zmq_msg_close(&id);
        tracked_free(NULL, t);
        return SKV_E_NOMEM;
    } /* t is libzmq's now: the callback frees it */
    int rc = SKV_OK;
    if (zmq_msg_send(&id, sock, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 || zmq_msg_send(&msg, sock, ZMQ_DONTWAIT) < 0) {
        int err = zmq_errno();
        if (err == EAGAIN) { /* ROUTER_MANDATORY: the client's queue is full (its SNDHWM) */
            atomic_fetch_add(&r->dropped, 1);
            rc = skv_errorf(SKV_E_BUSY, "the client's queue in libzmq is full of replies it has not read");
        } else {
            rc = skv_errorf(SKV_E_IO, "%s", zmq_strerror(err));
        }
    }
    zmq_msg_close(&id);
    zmq_msg_close(&msg); /* nothing after a send; after a refusal it frees the reply */
    return rc;
}

uint64_t skv_replies_unread_bytes(const struct skv_replies *r)
{
    return r ? atomic_load(&r->total) : 0;
}

uint64_t skv_replies_unread_bytes_of(struct skv_replies *r, int sock_idx, const void *identity, size_t identity_len)
{
    if (!r || identity_len > ID_MAX)
        return 0;
    pthread_mutex_lock(&r->mu);
    struct peer *p = peer_find_locked(r, sock_idx, identity, identity_len, false);
    uint64_t b = p ? p->bytes : 0;
    pthread_mutex_unlock(&r->mu);
    return b;
}

uint64_t skv_replies_unread_bytes_of_owner(struct skv_replies *r, uint64_t owner)
{
    if (!r || !owner)
        return 0;
    pthread_mutex_lock(&r->mu);
    struct owner *o = owner_find_locked(r, owner, false);
    uint64_t b = o ? o->bytes : 0;
    pthread_mutex_unlock(&r->mu);
    return b;
}

uint64_t skv_replies_dropped(const struct skv_replies *r)
{
    return r ? atomic_load(&r->dropped) : 0;
}

bool skv_zmq_has_input(void *sock)
{
    int events = 0;
    size_t sz = sizeof events;
    return sock && zmq_getsockopt(sock, ZMQ_EVENTS, &events, &sz) == 0 && (events & ZMQ_POLLIN);
}

void skv_replies_note_closed(struct skv_replies *r)
{
    if (r)
        atomic_fetch_add(&r->closed, 1);
}

uint64_t skv_replies_closed(const struct skv_replies *r)
{
    return r ? atomic_load(&r->closed) : 0;
}
