/* The client endpoint's routing ids and connections (see clients.h): a flat table scanned by
 * a 64-bit hash of the routing id, and the fds whose connection closed. */
#include "daemon/clients.h"
#include "common/status.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define IDENTITY_MAX 255          /* ZeroMQ routing ids are 1 to 255 bytes */

struct client {
    int fd;                       /* its connection; -1: gone, and a new connection took the fd */
    bool live;
    uint64_t last_ms;             /* its last message, or when it went */
    size_t len;
    uint8_t identity[IDENTITY_MAX];
};

struct closed_fd {
    int fd;
    uint64_t at_ms;
};

struct skv_clients {
    int cap, n;
    uint64_t *keys;               /* [cap] hash of clients[i].identity, what lookups scan */
    struct client *clients;       /* [cap] */
    int n_closed;
    struct closed_fd *closed;     /* [cap] fds whose connection closed, none accepted on since */
};

static uint64_t identity_key(const uint8_t *id, size_t len)
{
    uint64_t h = 0xcbf29ce484222325u; /* FNV-1a */
    for (size_t i = 0; i < len; i++)
        h = (h ^ id[i]) * 0x100000001b3u;
    return h;
}

int skv_clients_new(int cap, struct skv_clients **out)
{
    if (cap < 1 || !out)
        return skv_errorf(SKV_E_INVAL, "a client table needs room for at least one client");
    struct skv_clients *t = calloc(1, sizeof *t);
    if (!t)
        return SKV_E_NOMEM;
    t->cap = cap;
    t->keys = calloc((size_t)cap, sizeof *t->keys);
    t->clients = calloc((size_t)cap, sizeof *t->clients);
    t->closed = calloc((size_t)cap, sizeof *t->closed);
    if (!t->keys || !t->clients || !t->closed) {
        skv_clients_free(&t);
        return SKV_E_NOMEM;
    }
    *out = t;
    return SKV_OK;
}

void skv_clients_free(struct skv_clients **t_p)
{
    if (!t_p || !*t_p)
        return;
    struct skv_clients *t = *t_p;
    free(t->keys);
    free(t->clients);
    free(t->closed);
    free(t);
    *t_p = NULL;
}

static int find(const struct skv_clients *t, const uint8_t *id, size_t len, uint64_t key)
{
    for (int i = 0; i < t->n; i++)
        if (t->keys[i] == key && t->clients[i].len == len && memcmp(t->clients[i].identity, id, len) == 0)
            return i;
    return -1;
}

int skv_clients_fd(const struct skv_clients *t, const uint8_t *identity, size_t identity_len)
{
    if (identity_len == 0 || identity_len > IDENTITY_MAX)
        return -1;
    int i = find(t, identity, identity_len, identity_key(identity, identity_len));
    return i >= 0 && t->clients[i].live ? t->clients[i].fd : -1;
}

static void remove_at(struct skv_clients *t, int i)
{
    t->n--;
    t->keys[i] = t->keys[t->n];
    t->clients[i] = t->clients[t->n];
}

/* A free row: when the table is full, a gone client is forgotten first (the longest gone),
 * else the least recently active live one (a gone one's time is when it went, so by time alone
 * churn forgot idle live clients, a long DECODE's among them, before the gone). */
static int take_row(struct skv_clients *t)
{
    if (t->n == t->cap) {
        int oldest = 0;
        for (int i = 1; i < t->n; i++) {
            const struct client *a = &t->clients[i], *o = &t->clients[oldest];
            if (a->live != o->live ? !a->live : a->last_ms < o->last_ms)
                oldest = i;
        }
        remove_at(t, oldest);
    }
    return t->n++;
}

static int closed_find(const struct skv_clients *t, int fd)
{
    for (int i = 0; i < t->n_closed; i++)
        if (t->closed[i].fd == fd)
            return i;
    return -1;
}

static void closed_remove_at(struct skv_clients *t, int i)
{
    t->closed[i] = t->closed[--t->n_closed];
}

enum skv_client_seen skv_clients_seen(struct skv_clients *t, const uint8_t *identity, size_t identity_len, int fd,
                                      uint64_t now_ms)
{
    if (identity_len == 0 || identity_len > IDENTITY_MAX)
        return SKV_CLIENT_LIVE;
    uint64_t key = identity_key(identity, identity_len);
    int i = find(t, identity, identity_len, key);
    if (i >= 0) {
        struct client *c = &t->clients[i];
        if (!c->live && c->fd == fd)
            return SKV_CLIENT_LATE; /* still reading what its closed connection sent */
        /* live (perhaps over a new connection), or a routing id the client chose itself back
         * on a new connection */
        c->live = true;
        c->fd = fd;
        c->last_ms = now_ms;
        return SKV_CLIENT_LIVE;
    }
    bool closed = closed_find(t, fd) >= 0;
    i = take_row(t);
    t->keys[i] = key;
    struct client *c = &t->clients[i];
    c->fd = fd;
    c->live = !closed;
    c->last_ms = now_ms;
    c->len = identity_len;
    memcpy(c->identity, identity, identity_len);
    return closed ? SKV_CLIENT_LATE_FIRST : SKV_CLIENT_LIVE;
}

int skv_clients_disconnected(struct skv_clients *t, int fd, uint64_t now_ms, skv_client_gone_fn *gone, void *user)
{
    int n = 0;
    for (int i = 0; i < t->n; i++) {
        struct client *c = &t->clients[i];
        if (c->live && c->fd == fd) {
            c->live = false;
            c->last_ms = now_ms;
            gone(user, c->identity, c->len);
            n++;
        }
    }
    int k = closed_find(t, fd);
    if (k < 0) {
        if (t->n_closed == t->cap) { /* forget the oldest */
            k = 0;
            for (int j = 1; j < t->n_closed; j++)
                if (t->closed[j].at_ms < t->closed[k].at_ms)
                    k = j;
        } else {
            k = t->n_closed++;
        }
    }
    t->closed[k] = (struct closed_fd){fd, now_ms};
    return n;
}

int skv_clients_accepted(struct skv_clients *t, int fd, uint64_t now_ms, skv_client_gone_fn *gone, void *user)
{
    int k = closed_find(t, fd);
    if (k >= 0)
        closed_remove_at(t, k);
    int n = 0;
    for (int i = 0; i < t->n; i++) {
        struct client *c = &t->clients[i];
        if (c->fd != fd)
            continue;
        if (c->live) {
            c->live = false;
            c->last_ms = now_ms;
            gone(user, c->identity, c->len);
            n++;
        }
        /* the fd is another connection's now: a message of this client read from it later is
         * taken as live (a routing id the client chose, back on a new connection) */
        c->fd = -1;
    }
    return n;
}

void skv_clients_expire(struct skv_clients *t, uint64_t now_ms)
{
    for (int i = t->n - 1; i >= 0; i--)
        if (!t->clients[i].live && now_ms - t->clients[i].last_ms > SKV_CLIENTS_GONE_KEEP_MS)
            remove_at(t, i);
    for (int i = t->n_closed - 1; i >= 0; i--)
        if (now_ms - t->closed[i].at_ms > SKV_CLIENTS_GONE_KEEP_MS)
            closed_remove_at(t, i);
}

void skv_clients_count(const struct skv_clients *t, struct skv_clients_count *out)
{
    *out = (struct skv_clients_count){.closed_fds = t->n_closed};
    for (int i = 0; i < t->n; i++) {
        if (t->clients[i].live)
            out->live++;
        else
            out->gone++;
    }
}
