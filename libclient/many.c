/* Several daemons behind one handle (docs/SCALING.md section 1): new sessions placed by
 * rendezvous hashing over the endpoints that are up, a connection per endpoint made when it is
 * first needed, an endpoint whose connection failed, closed or went unanswered skipped for
 * down_ms; and session references ("endpoint#id") that name the daemon holding a session. */
#include "libclient/client_internal.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MANY_NAME_MAX 1023
#define MANY_DOWN_MS_MAX 3600000

struct many_endpoint {
    char *name;
    snapkv_client_t *client;  /* NULL: not connected yet, or its last connect failed */
    int64_t down_until;       /* skv_client_now_ms time it is down until; 0: not marked */
    uint64_t unanswered_seen; /* the client's unanswered count when last looked at */
    char why[200];            /* why it was marked down last */
};

struct snapkv_many {
    struct many_endpoint *ep;
    size_t n;
    int down_ms;
    struct snapkv_connect_opts opts; /* its strings are the copies below */
    char *tenant, *name, *server_key, *secret_key, *public_key;
};

int snapkv_session_ref(const char *endpoint, const struct snapkv_session_id *id, char *buf, size_t cap)
{
    if (!endpoint || !id || !buf)
        return skv_client_fail(SNAPKV_E_INVAL, "snapkv_session_ref: NULL argument");
    if (!*endpoint)
        return skv_client_fail(SNAPKV_E_INVAL, "snapkv_session_ref: empty endpoint");
    size_t len = strlen(endpoint);
    if (cap < len + 1 + SNAPKV_SESSION_ID_HEX_SIZE)
        return skv_client_fail(SNAPKV_E_LIMIT, "snapkv_session_ref: a reference to %s needs %zu bytes, not %zu",
                               endpoint, len + 1 + SNAPKV_SESSION_ID_HEX_SIZE, cap);
    memcpy(buf, endpoint, len);
    buf[len] = '#';
    return snapkv_session_id_to_hex(id, buf + len + 1, cap - len - 1);
}

int snapkv_session_ref_parse(const char *ref, char *endpoint, size_t cap, struct snapkv_session_id *id)
{
    if (!ref || !endpoint || !id)
        return skv_client_fail(SNAPKV_E_INVAL, "snapkv_session_ref_parse: NULL argument");
    const char *hash = strrchr(ref, '#');
    if (!hash || hash == ref)
        return skv_client_fail(SNAPKV_E_INVAL, "'%.80s' is not a session reference (ENDPOINT#ID)", ref);
    struct snapkv_session_id parsed;
    if (snapkv_session_id_from_hex(hash + 1, &parsed) != SNAPKV_OK)
        return skv_client_fail(SNAPKV_E_INVAL, "'%.80s' is not a session reference: the id after '#' is not 32 hex "
                               "digits", ref);
    size_t len = (size_t)(hash - ref);
    if (len + 1 > cap)
        return skv_client_fail(SNAPKV_E_LIMIT, "session reference: its endpoint is %zu bytes, the buffer holds %zu",
                               len, cap ? cap - 1 : 0);
    memcpy(endpoint, ref, len);
    endpoint[len] = '\0';
    *id = parsed;
    return SNAPKV_OK;
}

/* A copy of s (NULL stays NULL); false when out of memory. */
static bool copy_opt(const char *s, char **out)
{
    *out = NULL;
    return !s || (*out = strdup(s)) != NULL;
}

void snapkv_close_many(snapkv_many_t **many_p)
{
    if (!many_p || !*many_p)
        return;
    snapkv_many_t *m = *many_p;
    for (size_t i = 0; i < m->n; i++) {
        snapkv_close(&m->ep[i].client);
        free(m->ep[i].name);
    }
    free(m->ep);
    free(m->tenant);
    free(m->name);
    if (m->secret_key)
        sodium_memzero(m->secret_key, strlen(m->secret_key));
    free(m->server_key);
    free(m->secret_key);
    free(m->public_key);
    free(m);
    *many_p = NULL;
}

int snapkv_connect_many(const char *const *endpoints, size_t n, const struct snapkv_connect_opts *opts, int down_ms,
                        snapkv_many_t **out)
{
    if (!endpoints || !out)
        return skv_client_fail(SNAPKV_E_INVAL, "snapkv_connect_many: NULL argument");
    int rc = skv_client_check_names(endpoints, n, SNAPKV_MANY_MAX, "snapkv_connect_many");
    if (rc)
        return rc;
    for (size_t i = 0; i < n; i++)
        if (strlen(endpoints[i]) > MANY_NAME_MAX)
            return skv_client_fail(SNAPKV_E_INVAL, "snapkv_connect_many: endpoint %zu is %zu bytes, at most %d", i,
                                   strlen(endpoints[i]), MANY_NAME_MAX);
    if (down_ms < 0 || down_ms > MANY_DOWN_MS_MAX)
        return skv_client_fail(SNAPKV_E_INVAL, "snapkv_connect_many: down_ms %d (from 0 to %d)", down_ms,
                               MANY_DOWN_MS_MAX);
    /* options no daemon would take are refused now, so that a later failed connect is the
     * endpoint's, never the options' */
    if ((rc = skv_client_check_opts(opts)))
        return rc;
    if (sodium_init() < 0)
        return skv_client_fail(SNAPKV_E_INTERNAL, "snapkv_connect_many: libsodium did not start");
    snapkv_many_t *m = calloc(1, sizeof *m);
    if (!m)
        return skv_client_fail(SNAPKV_E_NOMEM, "snapkv_connect_many: out of memory");
    m->ep = calloc(n, sizeof *m->ep);
    m->n = m->ep ? n : 0;
    m->down_ms = down_ms ? down_ms : SNAPKV_MANY_DOWN_MS;
    bool ok = m->ep != NULL;
    for (size_t i = 0; ok && i < n; i++)
        ok = (m->ep[i].name = strdup(endpoints[i])) != NULL;
    if (opts) {
        m->opts = *opts;
        ok = ok && copy_opt(opts->tenant, &m->tenant) && copy_opt(opts->name, &m->name) &&
             copy_opt(opts->curve_server_key, &m->server_key) && copy_opt(opts->curve_secret_key, &m->secret_key) &&
             copy_opt(opts->curve_public_key, &m->public_key);
        m->opts.tenant = m->tenant;
        m->opts.name = m->name;
        m->opts.curve_server_key = m->server_key;
        m->opts.curve_secret_key = m->secret_key;
        m->opts.curve_public_key = m->public_key;
    }
    if (!ok) {
        snapkv_close_many(&m);
        return skv_client_fail(SNAPKV_E_NOMEM, "snapkv_connect_many: out of memory");
    }
    *out = m;
    return SNAPKV_OK;
}

static void mark_down(snapkv_many_t *m, struct many_endpoint *e, const char *why)
{
    e->down_until = skv_client_now_ms() + m->down_ms;
    snprintf(e->why, sizeof e->why, "%s", why);
}

/* SNAPKV_OK when endpoint e can take a call now: not marked down, connected (now, if it was
 * not), its connection not closed and no call on it unanswered since the last look.
 * SNAPKV_E_BUSY (e->why says so, nothing marked): its client is running a call, from one of
 * whose callbacks this comes. Anything else marks the endpoint down and is
 * SNAPKV_E_UNAVAILABLE, with e->why saying why (a connect that failed for want of memory too:
 * it is tried again after down_ms like any other). */
static int endpoint_up(snapkv_many_t *m, struct many_endpoint *e)
{
    int64_t now = skv_client_now_ms();
    if (e->down_until > now)
        return SNAPKV_E_UNAVAILABLE;
    e->down_until = 0;
    if (!e->client) {
        /* (the options were checked by snapkv_connect_many: a failure here is the endpoint's,
         * one libzmq does not take included) */
        int rc = snapkv_connect(e->name, &m->opts, &e->client);
        if (rc) {
            char why[sizeof e->why];
            snprintf(why, sizeof why, "connect: %s (%s)", snapkv_last_error(), snapkv_status_str(rc));
            mark_down(m, e, why);
            return SNAPKV_E_UNAVAILABLE;
        }
        e->unanswered_seen = e->client->unanswered;
        return SNAPKV_OK;
    }
    /* a callback of this client's running call: the call reads its connection events itself,
     * and the client takes no other call until it returns */
    if (e->client->in_call) {
        snprintf(e->why, sizeof e->why, "its client is running a call (this comes from one of its callbacks)");
        return SNAPKV_E_BUSY;
    }
    skv_client_look(e->client);
    uint64_t unanswered = e->client->unanswered;
    if (unanswered != e->unanswered_seen) {
        e->unanswered_seen = unanswered;
        mark_down(m, e, "a call went unanswered (a timeout, a refused handshake or a closed connection)");
        return SNAPKV_E_UNAVAILABLE;
    }
    if (e->client->down) {
        mark_down(m, e, "its connection closed (the daemon stopped?) and has not come back");
        return SNAPKV_E_UNAVAILABLE;
    }
    return SNAPKV_OK;
}

/* A failed placement: SNAPKV_E_BUSY when `busy` of the endpoints are running the call a
 * callback comes from (the others down), else SNAPKV_E_UNAVAILABLE; the message lists the
 * endpoints in the key's order, each with why it is down (or busy), as many as it holds (names
 * cut to 80 bytes, reasons to 120). */
static int all_down(const snapkv_many_t *m, const size_t *order, size_t busy)
{
    char msg[480];
    size_t at = busy ? (size_t)snprintf(msg, sizeof msg, "no endpoint can take a call (%zu, %zu of them running the "
                                        "call this callback comes from):", m->n, busy)
                     : (size_t)snprintf(msg, sizeof msg, "every endpoint is down (%zu):", m->n);
    for (size_t k = 0; k < m->n && at < sizeof msg; k++) {
        const struct many_endpoint *e = &m->ep[order[k]];
        at += (size_t)snprintf(msg + at, sizeof msg - at, "%s %.80s: %.120s", k ? ";" : "", e->name, e->why);
    }
    return skv_client_fail(busy ? SNAPKV_E_BUSY : SNAPKV_E_UNAVAILABLE, "%s", msg);
}

int snapkv_many_place(snapkv_many_t *m, const void *key, size_t key_len, snapkv_client_t **client, size_t *index)
{
    if (!m || !client || (!key && key_len))
        return skv_client_fail(SNAPKV_E_INVAL, "snapkv_many_place: NULL argument");
    uint64_t w[SNAPKV_MANY_MAX];
    size_t order[SNAPKV_MANY_MAX];
    for (size_t i = 0; i < m->n; i++) {
        w[i] = skv_client_place_weight(m->ep[i].name, key, key_len);
        order[i] = i;
    }
    /* the key's order: weight down, equal weights by name (insertion sort: n <= 64) */
    for (size_t i = 1; i < m->n; i++) {
        size_t x = order[i], j = i;
        for (; j > 0; j--) {
            size_t y = order[j - 1];
            if (skv_client_place_before(w[y], m->ep[y].name, w[x], m->ep[x].name))
                break;
            order[j] = y;
        }
        order[j] = x;
    }
    size_t busy = 0;
    for (size_t k = 0; k < m->n; k++) {
        int rc = endpoint_up(m, &m->ep[order[k]]);
        if (rc == SNAPKV_OK) {
            *client = m->ep[order[k]].client;
            if (index)
                *index = order[k];
            return SNAPKV_OK;
        }
        busy += rc == SNAPKV_E_BUSY;
    }
    return all_down(m, order, busy);
}

int snapkv_many_client(snapkv_many_t *m, size_t index, snapkv_client_t **client)
{
    if (!m || !client)
        return skv_client_fail(SNAPKV_E_INVAL, "snapkv_many_client: NULL argument");
    if (index >= m->n)
        return skv_client_fail(SNAPKV_E_INVAL, "snapkv_many_client: endpoint %zu of %zu", index, m->n);
    struct many_endpoint *e = &m->ep[index];
    int rc = endpoint_up(m, e);
    if (rc == SNAPKV_E_UNAVAILABLE)
        return skv_client_fail(SNAPKV_E_UNAVAILABLE, "%.200s is down for %lld ms more: %s", e->name,
                               (long long)(e->down_until - skv_client_now_ms()), e->why);
    if (rc == SNAPKV_E_BUSY)
        return skv_client_fail(SNAPKV_E_BUSY, "%.200s: %s", e->name, e->why);
    *client = e->client;
    return SNAPKV_OK;
}

int snapkv_many_session(snapkv_many_t *m, const char *ref, snapkv_client_t **client, struct snapkv_session_id *id)
{
    if (!m || !ref || !client || !id)
        return skv_client_fail(SNAPKV_E_INVAL, "snapkv_many_session: NULL argument");
    char endpoint[MANY_NAME_MAX + 1];
    struct snapkv_session_id parsed;
    int rc = snapkv_session_ref_parse(ref, endpoint, sizeof endpoint, &parsed);
    if (rc == SNAPKV_E_LIMIT)
        return skv_client_fail(SNAPKV_E_NOT_FOUND, "session reference: its endpoint is longer than any of this "
                               "handle's");
    if (rc)
        return rc;
    for (size_t i = 0; i < m->n; i++)
        if (strcmp(m->ep[i].name, endpoint) == 0) {
            if ((rc = snapkv_many_client(m, i, client)))
                return rc;
            *id = parsed;
            return SNAPKV_OK;
        }
    return skv_client_fail(SNAPKV_E_NOT_FOUND, "session reference: %.200s is not one of this handle's %zu endpoints",
                           endpoint, m->n);
}

int snapkv_many_mark_down(snapkv_many_t *m, size_t index)
{
    if (!m)
        return skv_client_fail(SNAPKV_E_INVAL, "snapkv_many_mark_down: NULL argument");
    if (index >= m->n)
        return skv_client_fail(SNAPKV_E_INVAL, "snapkv_many_mark_down: endpoint %zu of %zu", index, m->n);
    struct many_endpoint *e = &m->ep[index];
    if (e->client)
        e->unanswered_seen = e->client->unanswered; /* what made the caller mark it is counted here */
    mark_down(m, e, "marked down by the caller");
    return SNAPKV_OK;
}

const char *snapkv_many_endpoint(const snapkv_many_t *m, size_t index)
{
    return m && index < m->n ? m->ep[index].name : NULL;
}
