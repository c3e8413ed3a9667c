/* The shared store's connection and its two calls (see store.h): hiredis does the protocol. */
#include "daemon/store.h"
#include "common/status.h"

#include <hiredis/hiredis.h>
#include <sodium.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define STORE_RETRY_MS 1000 /* no new connection within this of a failed one */
#define STORE_MISS_MS 1000  /* a key that missed is not asked for again within this */
#define STORE_MISSES 256    /* the misses remembered */

struct store_miss {
    uint64_t hash; /* of the key (keyed: no one can choose keys that evict another's) */
    uint64_t at_ms;
};

struct skv_store {
    char url[512];
    char host[256];           /* a host name or address, or a socket path (unix) */
    int port;                 /* 0: unix socket */
    int db;
    struct timeval timeout;
    redisContext *c;          /* NULL: not connected */
    uint64_t down_until_ms;   /* a connection failed: none is tried before this */
    char why[256];            /* and why */
    unsigned char miss_key[crypto_shorthash_KEYBYTES];
    struct store_miss miss[STORE_MISSES];
    int miss_next;
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
    crypto_shorthash_keygen(st->miss_key);
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

void skv_store_stats(const struct skv_store *st, struct skv_store_stats *out)
{
    *out = st->stats;
}

/* Drops the connection after a failure: the next call connects again, a second later at the
 * earliest (a store that is down costs each spill nothing but this check meanwhile). */
static int store_failed(struct skv_store *st, const char *what)
{
    snprintf(st->why, sizeof st->why, "%s", what);
    if (st->c) {
        redisFree(st->c);
        st->c = NULL;
    }
    st->down_until_ms = now_ms() + STORE_RETRY_MS;
    return skv_errorf(SKV_E_IO, "store %s: %s", st->url, st->why);
}

static int store_connect(struct skv_store *st)
{
    if (st->c)
        return SKV_OK;
    if (now_ms() < st->down_until_ms)
        return skv_errorf(SKV_E_IO, "store %s: %s (tried again a second after)", st->url, st->why);
    st->c = st->port ? redisConnectWithTimeout(st->host, st->port, st->timeout)
                     : redisConnectUnixWithTimeout(st->host, st->timeout);
    if (!st->c)
        return store_failed(st, "no memory for a connection");
    if (st->c->err)
        return store_failed(st, st->c->errstr);
    if (redisSetTimeout(st->c, st->timeout) != REDIS_OK)
        return store_failed(st, "cannot set the timeout");
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

/* One command's reply, or NULL after store_failed (a connection that failed is dropped). */
static redisReply *store_command(struct skv_store *st, int argc, const char **argv, const size_t *lens)
{
    if (store_connect(st))
        return NULL;
    redisReply *r = redisCommandArgv(st->c, argc, argv, lens);
    if (!r) {
        store_failed(st, st->c->errstr[0] ? st->c->errstr : "the connection failed");
        return NULL;
    }
    if (r->type == REDIS_REPLY_ERROR) { /* the store answered: the connection is fine */
        skv_errorf(SKV_E_IO, "store %s: %s: %s", st->url, argv[0], r->str);
        freeReplyObject(r);
        return NULL;
    }
    return r;
}

static uint64_t key_hash(const struct skv_store *st, const char *key)
{
    uint8_t h8[crypto_shorthash_BYTES];
    crypto_shorthash(h8, (const unsigned char *)key, strlen(key), st->miss_key);
    uint64_t hash;
    memcpy(&hash, h8, sizeof hash);
    return hash;
}

int skv_store_put(struct skv_store *st, const char *key, const void *data, size_t n, int64_t ttl_s)
{
    uint64_t hash = key_hash(st, key);
    for (int i = 0; i < STORE_MISSES; i++) /* it is there now */
        if (st->miss[i].hash == hash)
            st->miss[i].at_ms = 0;
    char ttl[24];
    snprintf(ttl, sizeof ttl, "%lld", (long long)ttl_s);
    const char *argv[] = {"SET", key, data, "EX", ttl};
    const size_t lens[] = {3, strlen(key), n, 2, strlen(ttl)};
    redisReply *r = store_command(st, 5, argv, lens);
    if (!r) {
        st->stats.spill_failures++;
        return SKV_E_IO;
    }
    freeReplyObject(r);
    st->stats.spills++;
    st->stats.spill_bytes += n;
    return SKV_OK;
}

int skv_store_take(struct skv_store *st, const char *key, void **data, size_t *n)
{
    uint64_t hash = key_hash(st, key), now = now_ms();
    for (int i = 0; i < STORE_MISSES; i++)
        if (st->miss[i].hash == hash && st->miss[i].at_ms && now - st->miss[i].at_ms < STORE_MISS_MS) {
            st->stats.misses++;
            return skv_errorf(SKV_E_NOT_FOUND, "not in the store (asked within the last second)");
        }
    const char *argv[] = {"GETDEL", key};
    const size_t lens[] = {6, strlen(key)};
    redisReply *r = store_command(st, 2, argv, lens);
    if (!r) {
        st->stats.load_failures++;
        return SKV_E_IO;
    }
    if (r->type == REDIS_REPLY_NIL) {
        freeReplyObject(r);
        st->miss[st->miss_next] = (struct store_miss){hash, now ? now : 1};
        st->miss_next = (st->miss_next + 1) % STORE_MISSES;
        st->stats.misses++;
        return skv_errorf(SKV_E_NOT_FOUND, "not in the store");
    }
    if (r->type != REDIS_REPLY_STRING) {
        freeReplyObject(r);
        st->stats.load_failures++;
        return skv_errorf(SKV_E_IO, "store %s: GETDEL: an answer that is not a string", st->url);
    }
    void *p = malloc(r->len ? r->len : 1);
    if (!p) {
        freeReplyObject(r);
        st->stats.load_failures++;
        return skv_errorf(SKV_E_NOMEM, "no memory for a stored session of %zu bytes", (size_t)r->len);
    }
    memcpy(p, r->str, r->len);
    *n = r->len;
    *data = p;
    freeReplyObject(r);
    st->stats.loads++;
    return SKV_OK;
}
