/* The shared store's connection and its calls (see store.h): hiredis does the protocol. */
#include "daemon/store.h"
#include "common/status.h"

#include <errno.h>
#include <hiredis/hiredis.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define STORE_RETRY_MS 1000      /* no new connection within this of a failed one ... */
#define STORE_RETRY_MAX_MS 30000 /* ... doubled at each failure in a row, up to this */

struct skv_store {
    char url[512];
    char host[256];           /* a host name or address, or a socket path (unix) */
    int port;                 /* 0: unix socket */
    int db;
    struct timeval timeout;
    redisContext *c;          /* NULL: not connected */
    uint64_t down_until_ms;   /* a connection failed: none is tried before this */
    uint64_t retry_ms;        /* the wait after the next failure */
    char why[256];            /* and why */
    struct skv_store_stats stats;
};

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static int parse_uint(const char *p, const char *end, long max, long *out)
{
    long v = 0;
    if (p == end)
        return -1;
    for (; p < end; p++) {
        if (*p < '0' || *p > '9' || (v = v * 10 + (*p - '0')) > max)
            return -1;
    }
    *out = v;
    return 0;
}

int skv_store_new(const char *url, int timeout_ms, struct skv_store **out)
{
    struct skv_store *st = calloc(1, sizeof *st);
    if (!st)
        return SKV_E_NOMEM;
    if (strlen(url) >= sizeof st->url) {
        free(st);
        return skv_errorf(SKV_E_INVAL, "store: a url of at most %zu characters", sizeof st->url - 1);
    }
    snprintf(st->url, sizeof st->url, "%s", url);
    st->timeout = (struct timeval){.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    st->retry_ms = STORE_RETRY_MS;
    const char *p;
    long v;
    if (strncmp(url, "unix://", 7) == 0) {
        p = url + 7;
        if (*p != '/' || strlen(p) >= sizeof st->host) {
            free(st);
            return skv_errorf(SKV_E_INVAL, "store '%s': unix:// takes an absolute socket path", url);
        }
        snprintf(st->host, sizeof st->host, "%s", p);
        *out = st;
        return SKV_OK;
    }
    if (strncmp(url, "redis://", 8) != 0) {
        free(st);
        return skv_errorf(SKV_E_INVAL, "store '%s': redis://HOST[:PORT][/DB] or unix://PATH", url);
    }
    p = url + 8;
    const char *host_end, *rest;
    if (*p == '[') { /* an IPv6 address */
        host_end = strchr(p, ']');
        rest = host_end ? host_end + 1 : NULL;
        p++;
    } else {
        host_end = p + strcspn(p, ":/");
        rest = host_end;
    }
    if (!host_end || host_end == p || (size_t)(host_end - p) >= sizeof st->host) {
        free(st);
        return skv_errorf(SKV_E_INVAL, "store '%s': no host", url);
    }
    memcpy(st->host, p, (size_t)(host_end - p));
    st->port = 6379;
    if (*rest == ':') {
        const char *pe = rest + 1 + strcspn(rest + 1, "/");
        if (parse_uint(rest + 1, pe, 65535, &v) || v == 0) {
            free(st);
            return skv_errorf(SKV_E_INVAL, "store '%s': the port is 1..65535", url);
        }
        st->port = (int)v;
        rest = pe;
    }
    if (*rest == '/' && rest[1]) {
        if (parse_uint(rest + 1, rest + strlen(rest), 1 << 20, &v)) {
            free(st);
            return skv_errorf(SKV_E_INVAL, "store '%s': the database is a number", url);
        }
        st->db = (int)v;
    } else if (*rest && strcmp(rest, "/") != 0) {
        free(st);
        return skv_errorf(SKV_E_INVAL, "store '%s': redis://HOST[:PORT][/DB]", url);
    }
    *out = st;
    return SKV_OK;
}

void skv_store_free(struct skv_store **st_p)
{
    if (!st_p || !*st_p)
        return;
    if ((*st_p)->c)
        redisFree((*st_p)->c);
    free(*st_p);
    *st_p = NULL;
}

const char *skv_store_url(const struct skv_store *st)
{
    return st->url;
}

void skv_store_target(const struct skv_store *st, const char **host, int *port, int *db)
{
    *host = st->host;
    *port = st->port;
    *db = st->db;
}

void skv_store_stats(const struct skv_store *st, struct skv_store_stats *out)
{
    *out = st->stats;
}

void skv_store_count_spill_failure(struct skv_store *st)
{
    st->stats.spill_failures++;
}

/* Drops the connection after a failure: the next call connects again, after a wait that doubles
 * with each failure in a row (a store that is down costs each spill nothing but this check
 * meanwhile, and one that hangs costs a connect timeout at most every 30 s). */
static int store_failed(struct skv_store *st, const char *what)
{
    snprintf(st->why, sizeof st->why, "%s", what);
    if (st->c) {
        redisFree(st->c);
        st->c = NULL;
    }
    st->down_until_ms = now_ms() + st->retry_ms;
    st->retry_ms = st->retry_ms * 2 < STORE_RETRY_MAX_MS ? st->retry_ms * 2 : STORE_RETRY_MAX_MS;
    return skv_errorf(SKV_E_IO, "store %s: %s", st->url, st->why);
}

static int store_connect(struct skv_store *st)
{
    if (st->c)
        return SKV_OK;
    uint64_t now = now_ms();
    if (now < st->down_until_ms)
        return skv_errorf(SKV_E_IO, "store %s: %s (tried again in %.1f s)", st->url, st->why,
                          (double)(st->down_until_ms - now) / 1000.0);
    st->c = st->port ? redisConnectWithTimeout(st->host, st->port, st->timeout)
                     : redisConnectUnixWithTimeout(st->host, st->timeout);
    if (!st->c)
        return store_failed(st, "no memory for a connection");
    if (st->c->err)
        return store_failed(st, st->c->errstr);
    if (redisSetTimeout(st->c, st->timeout) != REDIS_OK)
        return store_failed(st, "cannot set the timeout");
    if (st->port && redisEnableKeepAlive(st->c) != REDIS_OK) /* a peer gone quiet is found */
        return store_failed(st, "cannot enable TCP keep-alive");
    if (st->db) {
        redisReply *r = redisCommand(st->c, "SELECT %d", st->db);
        bool ok = r && r->type == REDIS_REPLY_STATUS;
        char why[200];
        snprintf(why, sizeof why, "SELECT %d: %s", st->db,
                 !r ? st->c->errstr : r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
        if (r)
            freeReplyObject(r);
        if (!ok)
            return store_failed(st, why);
    }
    return SKV_OK;
}

/* One command's reply, or NULL after store_failed (a connection that failed is dropped). A
 * connection that worked before and turns out closed (EOF, EPIPE, ECONNRESET: closed while idle)
 * is made again and the command sent once more at once; only a new connection's failure counts
 * as the store being down. A timeout is not retried: the store may still run the command (a
 * GETDEL would then take the value twice over). */
static redisReply *store_command(struct skv_store *st, int argc, const char **argv, const size_t *lens)
{
    for (int attempt = 0;; attempt++) {
        bool reused = st->c != NULL;
        if (store_connect(st))
            return NULL;
        redisReply *r = redisCommandArgv(st->c, argc, argv, lens);
        int err = errno;
        bool closed = st->c->err == REDIS_ERR_EOF ||
                      (st->c->err == REDIS_ERR_IO && (err == EPIPE || err == ECONNRESET));
        if (!r && reused && attempt == 0 && closed) {
            redisFree(st->c);
            st->c = NULL;
            continue;
        }
        if (!r) {
            store_failed(st, st->c->errstr[0] ? st->c->errstr : "the connection failed");
            return NULL;
        }
        st->retry_ms = STORE_RETRY_MS; /* it answered */
        if (r->type == REDIS_REPLY_ERROR) { /* the store answered: the connection is fine */
            skv_errorf(SKV_E_IO, "store %s: %s: %s", st->url, argv[0], r->str);
            freeReplyObject(r);
            return NULL;
        }
        return r;
    }
}

static int store_set(struct skv_store *st, const char *key, const void *data, size_t n, int64_t ttl_s, bool spill)
{
    char ttl[24];
    snprintf(ttl, sizeof ttl, "%lld", (long long)ttl_s);
    const char *argv[] = {"SET", key, data, "EX", ttl};
    const size_t lens[] = {3, strlen(key), n, 2, strlen(ttl)};
    redisReply *r = store_command(st, 5, argv, lens);
    if (!r) {
        st->stats.spill_failures += spill;
        return SKV_E_IO;
    }
    freeReplyObject(r);
    st->stats.spills += spill;
    st->stats.spill_bytes += spill ? n : 0;
    return SKV_OK;
}

int skv_store_put(struct skv_store *st, const char *key, const void *data, size_t n, int64_t ttl_s)
{
    return store_set(st, key, data, n, ttl_s, true);
}

int skv_store_put_back(struct skv_store *st, const char *key, const void *data, size_t n, int64_t ttl_s)
{
    return store_set(st, key, data, n, ttl_s, false);
}

int skv_store_take(struct skv_store *st, const char *key, const void **data, size_t *n, void **value)
{
    const char *argv[] = {"GETDEL", key};
    const size_t lens[] = {6, strlen(key)};
    redisReply *r = store_command(st, 2, argv, lens);
    if (!r) {
        st->stats.load_failures++;
        return SKV_E_IO;
    }
    if (r->type == REDIS_REPLY_NIL) {
        freeReplyObject(r);
        st->stats.misses++;
        return skv_errorf(SKV_E_NOT_FOUND, "not in the store");
    }
    if (r->type != REDIS_REPLY_STRING) {
        freeReplyObject(r);
        st->stats.load_failures++;
        return skv_errorf(SKV_E_IO, "store %s: GETDEL: an answer that is not a string", st->url);
    }
    *data = r->str;
    *n = r->len;
    *value = r;
    st->stats.loads++;
    return SKV_OK;
}

void skv_store_value_free(void *value)
{
    if (value)
        freeReplyObject(value);
}

int skv_store_delete(struct skv_store *st, const char *key)
{
    const char *argv[] = {"DEL", key};
    const size_t lens[] = {3, strlen(key)};
    redisReply *r = store_command(st, 2, argv, lens);
    if (!r) {
        st->stats.load_failures++; /* a RELEASE of a session not here */
        return SKV_E_IO;
    }
    bool there = r->type == REDIS_REPLY_INTEGER && r->integer > 0;
    freeReplyObject(r);
    return there ? SKV_OK : skv_errorf(SKV_E_NOT_FOUND, "not in the store");
}
