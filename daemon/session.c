/* The session table: a hash of sessions by id, per-tenant counts, pool accounting and
 * LRU eviction (see session.h for the rules). */
#include "daemon/session.h"
#include "daemon/config.h"
#include "common/status.h"

#include <ctype.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BUCKETS 1024

struct skv_session_table {
    struct skv_session_limits lim;
    struct skv_session *bucket[BUCKETS];
    int n_sessions;
    struct skv_kv_pool *pool;     /* the model's block pool (from the first session) */
    void (*on_destroy)(void *user, struct skv_session *s);
    void *on_destroy_user;
    void (*on_evict)(void *user, struct skv_session *s);
    void *on_evict_user;
    uint64_t (*cache_held)(void *user, const char *tenant, bool alone);
    bool (*cache_drop)(void *user, const char *tenant);
    void *cache_user;
    uint64_t evictions;
    uint64_t mark; /* the last mark_kept's (blocks carry it: skv_kv_block.mark) */
    uint64_t tally; /* the last tenant_blocks' tallies are above it (blocks carry them: skv_kv_block.tally) */
    /* the room the running forward reserved (skv_session_hold_room), [0] the request's, [1] one
     * nested in it: what it has not taken yet counts as used for requests run inside it */
    struct {
        struct skv_session *s;
        uint64_t held, unique, base; /* base: s's bytes when reserved */
    } hold[2];
};

/* Added to CLOCK_MONOTONIC (which starts near 0 at boot), so that a time an idle span before now
 * (a restored session's last use) never falls below 0 and is cut short (2^40 ms: 34 years). */
#define CLOCK_BASE_MS (UINT64_C(1) << 40)

uint64_t skv_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return CLOCK_BASE_MS + (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

uint64_t skv_unix_ms(uint64_t at_ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t wall = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000, now = skv_now_ms();
    return now >= at_ms ? (wall > now - at_ms ? wall - (now - at_ms) : 0) : wall + (at_ms - now);
}

void skv_session_id_hex(const uint8_t *id, char out[2 * SKV_SESSION_ID_BYTES + 1])
{
    for (int i = 0; i < SKV_SESSION_ID_BYTES; i++)
        snprintf(out + 2 * i, 3, "%02x", id[i]);
}

int skv_session_check_tenant(const char *t)
{
    size_t n = strlen(t);
    if (n == 0 || n >= SKV_TENANT_MAX)
        return skv_errorf(SKV_E_INVAL, "tenant names are 1..%d characters", SKV_TENANT_MAX - 1);
    if (!skv_tenant_name_ok(t))
        return skv_errorf(SKV_E_INVAL, "tenant '%s': only letters, digits and . _ - @", t);
    return SKV_OK;
}

static unsigned bucket_of(const uint8_t *id)
{
    unsigned h;
    memcpy(&h, id, sizeof h);
    return h % BUCKETS;
}

int skv_session_table_new(const struct skv_session_limits *lim, struct skv_session_table **out)
{
    if (sodium_init() < 0)
        return skv_errorf(SKV_E_INTERNAL, "libsodium failed to initialize");
    struct skv_session_table *t = calloc(1, sizeof *t);
    if (!t)
        return SKV_E_NOMEM;
    t->lim = *lim;
    *out = t;
    return SKV_OK;
}

static void session_free(struct skv_session *s)
{
    skv_kv_cache_free(&s->cache);
    skv_compressor_free(&s->comp);
    free(s->tokens);
    free(s->logits);
    free(s);
}

void skv_session_table_free(struct skv_session_table **t_p)
{
    if (!t_p || !*t_p)
        return;
    struct skv_session_table *t = *t_p;
    for (int b = 0; b < BUCKETS; b++)
        for (struct skv_session *s = t->bucket[b], *next; s; s = next) {
            next = s->next;
            session_free(s);
        }
    free(t);
    *t_p = NULL;
}

static void tenant_usage(const struct skv_session_table *t, const char *tenant, int *count, uint64_t *bytes)
{
    *count = 0;
    *bytes = 0;
    for (int b = 0; b < BUCKETS; b++)
        for (struct skv_session *s = t->bucket[b]; s; s = s->next)
            if (strcmp(s->tenant, tenant) == 0) {
                (*count)++;
                *bytes += s->bytes + s->compressor_bytes;
            }
}

int skv_session_create(struct skv_session_table *t, const struct skv_model *m, const char *tenant, const char *owner,
                       struct skv_session **out)
{
    int count;
    uint64_t bytes;
    tenant_usage(t, tenant, &count, &bytes);
    if (count >= t->lim.max_sessions_per_tenant)
        return skv_errorf(SKV_E_LIMIT, "tenant '%s' already holds %d sessions (max-sessions-per-tenant)", tenant,
                          count);
    /* every tenant's together: a client that may name any tenant (ipc-tenant = claimed) would
     * otherwise hold sessions without end, each with its logits (a FORK costs the pool nothing) */
    if (t->lim.max_sessions > 0 && t->n_sessions >= t->lim.max_sessions)
        return skv_errorf(SKV_E_LIMIT, "the daemon holds %d sessions (max-sessions)", t->n_sessions);
    struct skv_session *s = calloc(1, sizeof *s);
    if (!s)
        return SKV_E_NOMEM;
    int rc = skv_kv_cache_new(m, &s->cache);
    if (rc) {
        free(s);
        return rc;
    }
    do
        randombytes_buf(s->id, sizeof s->id);
    while (skv_session_find(t, s->id, NULL));
    snprintf(s->tenant, sizeof s->tenant, "%s", tenant);
    snprintf(s->owner, sizeof s->owner, "%s", owner ? owner : "");
    s->created_ms = s->last_used_ms = skv_now_ms();
    if (!t->pool)
        t->pool = m->kv_pool;
    unsigned b = bucket_of(s->id);
    s->next = t->bucket[b];
    t->bucket[b] = s;
    t->n_sessions++;
    *out = s;
    return SKV_OK;
}

/* Takes s out of its id's chain. */
static void bucket_unlink(struct skv_session_table *t, struct skv_session *s)
{
    struct skv_session **pp = &t->bucket[bucket_of(s->id)];
    while (*pp && *pp != s)
        pp = &(*pp)->next;
    if (*pp)
        *pp = s->next;
}

int skv_session_set_id(struct skv_session_table *t, struct skv_session *s, const uint8_t *id)
{
    if (skv_session_find(t, id, NULL))
        return skv_errorf(SKV_E_EXISTS, "a session with that id exists");
    bucket_unlink(t, s);
    memcpy(s->id, id, SKV_SESSION_ID_BYTES);
    unsigned b = bucket_of(s->id);
    s->next = t->bucket[b];
    t->bucket[b] = s;
    return SKV_OK;
}

struct skv_session *skv_session_find(struct skv_session_table *t, const uint8_t *id, const char *tenant)
{
    for (struct skv_session *s = t->bucket[bucket_of(id)]; s; s = s->next)
        if (memcmp(s->id, id, SKV_SESSION_ID_BYTES) == 0)
            return !tenant || strcmp(s->tenant, tenant) == 0 ? s : NULL;
    return NULL;
}

void skv_session_table_on_destroy(struct skv_session_table *t, void (*fn)(void *user, struct skv_session *s),
                                  void *user)
{
    t->on_destroy = fn;
    t->on_destroy_user = user;
}

void skv_session_table_on_evict(struct skv_session_table *t, void (*fn)(void *user, struct skv_session *s),
                                void *user)
{
    t->on_evict = fn;
    t->on_evict_user = user;
}

void skv_session_table_on_pressure(struct skv_session_table *t,
                                   uint64_t (*held)(void *user, const char *tenant, bool alone),
                                   bool (*drop)(void *user, const char *tenant), void *user)
{
    t->cache_held = held;
    t->cache_drop = drop;
    t->cache_user = user;
}

uint64_t skv_session_tenant_bytes(const struct skv_session_table *t, const char *tenant,
                                  const struct skv_session *except)
{
    int count;
    uint64_t bytes;
    tenant_usage(t, tenant, &count, &bytes);
    uint64_t less = except && strcmp(except->tenant, tenant) == 0 ? except->bytes + except->compressor_bytes : 0;
    return bytes > less ? bytes - less : 0;
}

/* A session the table drops on its own (eviction, a lease that ran out): on_evict first. */
static void evict(struct skv_session_table *t, struct skv_session *s)
{
    if (t->on_evict)
        t->on_evict(t->on_evict_user, s);
    skv_session_destroy(t, s);
}

void skv_session_destroy(struct skv_session_table *t, struct skv_session *s)
{
    for (int l = 0; l < 2; l++)
        if (t->hold[l].s == s)
            t->hold[l].s = NULL;
    if (t->on_destroy)
        t->on_destroy(t->on_destroy_user, s);
    bucket_unlink(t, s);
    t->n_sessions--;
    session_free(s);
}

int skv_session_reserve_tokens(struct skv_session *s, int n)
{
    if (n > 0 && s->n_tokens + n > s->cap_tokens) {
        int cap = s->cap_tokens ? s->cap_tokens : 256;
        while (cap < s->n_tokens + n)
            cap *= 2;
        int32_t *p = realloc(s->tokens, (size_t)cap * sizeof *p);
        if (!p)
            return skv_errorf(SKV_E_NOMEM, "no memory for a token history of %d tokens", cap);
        s->tokens = p;
        s->cap_tokens = cap;
    }
    return SKV_OK;
}

int skv_session_push_tokens(struct skv_session *s, const int32_t *ids, int n)
{
    if (n <= 0) /* a fork of an imported session: no token history, and no array to copy into */
        return SKV_OK;
    int rc = skv_session_reserve_tokens(s, n);
    if (rc)
        return rc;
    memcpy(s->tokens + s->n_tokens, ids, (size_t)n * sizeof *ids);
    s->n_tokens += n;
    return SKV_OK;
}

/* Whether s may be evicted for `except`'s sake: idle, unpinned, not `except`. */
static bool may_evict(const struct skv_session *s, const struct skv_session *except)
{
    return s != except && !s->pinned && !s->busy;
}

/* Whether evicting s frees blocks of the pool (keep: the mark_kept that marked the blocks of
 * the sessions that stay; 0: not asked, as for a tenant's quota, which counts every block a
 * session holds). alone: s holds a block no other session holds, so evicting it alone frees
 * that; else: a block no session that stays holds, so evicting it with other candidates
 * (a document with its idle forks) does. */
static bool frees_blocks(const struct skv_session *s, uint64_t keep, bool alone)
{
    if (!keep)
        return true;
    if (!alone)
        return skv_kv_cache_holds_unmarked(s->cache, keep);
    struct skv_kv_blocks b;
    skv_kv_cache_blocks(s->cache, &b);
    return b.held > b.shared;
}

/* Least recently used session that may be evicted for `except`'s sake; `tenant` restricts
 * the choice to one tenant (quota pressure); keep and alone as for frees_blocks. */
static struct skv_session *lru_victim(struct skv_session_table *t, const struct skv_session *except, const char *tenant,
                                      uint64_t keep, bool alone)
{
    struct skv_session *best = NULL;
    for (int b = 0; b < BUCKETS; b++)
        for (struct skv_session *s = t->bucket[b]; s; s = s->next)
            if (may_evict(s, except) && (!tenant || strcmp(s->tenant, tenant) == 0) &&
                (!best || s->last_used_ms < best->last_used_ms) && frees_blocks(s, keep, alone))
                best = s;
    return best;
}

/* Each tenant's share of the pool in u: the bytes of the blocks its sessions hold, a block
 * its sessions share (a document and its forks) once; tenants never share blocks. */
static int tenant_blocks(struct skv_session_table *t, struct skv_tenant_tally *u)
{
    for (int b = 0; b < BUCKETS; b++)
        for (const struct skv_session *s = t->bucket[b]; s; s = s->next)
            if (skv_tenant_tally_add(u, s->tenant, 0))
                return SKV_E_NOMEM;
    const uint64_t bb = t->pool ? skv_kv_pool_block_bytes(t->pool) : 0;
    for (int b = 0; b < BUCKETS; b++)
        for (const struct skv_session *s = t->bucket[b]; s; s = s->next) {
            size_t i = 0;
            while (strcmp(u->u[i].tenant, s->tenant) != 0)
                i++;
            u->u[i].bytes += skv_kv_cache_tally(s->cache, t->tally + 1 + i) * bb;
        }
    t->tally += u->n + 1;
    return SKV_OK;
}

/* Pool pressure's victim for `except`'s sake: the least recently used session that may go,
 * taken first from the tenants that hold more than an equal share of the pool (the bytes of
 * their blocks, each once, over the tenants holding sessions now: tenant_blocks), so that a
 * tenant within its share loses nothing while another holds more; only when none of those has
 * a session that may go, from any tenant (with one tenant that is plain LRU). Within each, one
 * whose eviction alone frees a block first, so a document whose every block its forks share
 * stays while the forks live; only when none does, one that frees blocks together with other
 * candidates (the document, then its forks). An over-share tenant's document and idle forks go
 * before a session of a tenant within its share (which went first when it freed a block alone,
 * and the over-share tenant's none did). */
static struct skv_session *pool_victim(struct skv_session_table *t, const struct skv_session *except, uint64_t keep)
{
    struct skv_tenant_tally u = {0};
    bool tallied = tenant_blocks(t, &u) == SKV_OK;
    uint64_t share = u.n ? t->lim.pool_bytes / u.n : 0;
    struct skv_session *best = NULL;
    for (int pass = 0; pass < 2 && tallied && !best; pass++) /* the over-share tenants': alone, together */
        for (int b = 0; b < BUCKETS; b++)
            for (struct skv_session *s = t->bucket[b]; s; s = s->next)
                if (may_evict(s, except) && (!best || s->last_used_ms < best->last_used_ms) &&
                    skv_tenant_tally_bytes(&u, s->tenant) > share && frees_blocks(s, keep, pass == 0))
                    best = s;
    skv_tenant_tally_free(&u);
    if (!best)
        best = lru_victim(t, except, NULL, keep, true);
    return best ? best : lru_victim(t, except, NULL, keep, false);
}

/* Bytes of the unique blocks in use: what the pool limit counts. */
static uint64_t pool_bytes_used(const struct skv_session_table *t)
{
    if (!t->pool)
        return 0;
    struct skv_kv_pool_stats ps;
    skv_kv_pool_stats(t->pool, &ps);
    return ps.blocks_in_use * ps.block_bytes;
}

uint64_t skv_session_block_bytes(const struct skv_session *s)
{
    struct skv_kv_blocks b;
    skv_kv_cache_blocks(s->cache, &b);
    return b.held * skv_kv_pool_block_bytes(s->cache->pool);
}

int skv_tenant_tally_add(struct skv_tenant_tally *t, const char *tenant, uint64_t bytes)
{
    size_t i = 0;
    while (i < t->n && strcmp(t->u[i].tenant, tenant) != 0)
        i++;
    if (i == t->n) {
        if (t->n == t->cap) {
            size_t grown = t->cap ? 2 * t->cap : 16;
            struct skv_tenant_bytes *p = realloc(t->u, grown * sizeof *p);
            if (!p)
                return SKV_E_NOMEM;
            t->u = p;
            t->cap = grown;
        }
        t->u[t->n++] = (struct skv_tenant_bytes){tenant, 0};
    }
    t->u[i].bytes += bytes;
    return SKV_OK;
}

uint64_t skv_tenant_tally_bytes(const struct skv_tenant_tally *t, const char *tenant)
{
    for (size_t i = 0; i < t->n; i++)
        if (strcmp(t->u[i].tenant, tenant) == 0)
            return t->u[i].bytes;
    return 0;
}

void skv_tenant_tally_free(struct skv_tenant_tally *t)
{
    free(t->u);
    *t = (struct skv_tenant_tally){0};
}

uint64_t skv_session_shared_bytes(const struct skv_session *s)
{
    struct skv_kv_blocks b;
    skv_kv_cache_blocks(s->cache, &b);
    return b.shared * skv_kv_pool_block_bytes(s->cache->pool);
}

/* Bytes the sessions lru_victim may choose for `except` hold (tenant NULL: any tenant): an
 * upper bound on what evicting them all frees (a block another session shares stays). */
static uint64_t evictable_bytes(const struct skv_session_table *t, const struct skv_session *except,
                                const char *tenant)
{
    uint64_t sum = 0;
    for (int b = 0; b < BUCKETS; b++)
        for (const struct skv_session *s = t->bucket[b]; s; s = s->next)
            if (may_evict(s, except) && (!tenant || strcmp(s->tenant, tenant) == 0))
                sum += s->bytes + (tenant ? s->compressor_bytes : 0); /* the pool holds only KV blocks */
    return sum;
}

/* Marks the blocks that evicting sessions for `except` cannot free: those `except` and every
 * session that may not be evicted hold. Returns the mark (never 0). The kept prefixes' walks
 * (cache_held, cache_drop) write the same field, so none may run between this and the last use
 * of its mark: the pressure hooks run before it, and on_evict (a spill) walks no kept prefix. */
static void mark_session(const struct skv_session *s, uint64_t mark)
{
    skv_kv_cache_mark(s->cache, mark);
    for (int i = 0; i < 2; i++)
        if (s->side[i]) /* (evicting D freed nothing its fork's COMPRESS kept in its undo copy) */
            skv_kv_cache_mark(s->side[i], mark);
}

static uint64_t mark_kept(struct skv_session_table *t, const struct skv_session *except)
{
    t->mark += 2;
    mark_session(except, t->mark); /* a session being restored is in no bucket yet */
    for (int b = 0; b < BUCKETS; b++)
        for (const struct skv_session *s = t->bucket[b]; s; s = s->next)
            if (!may_evict(s, except))
                mark_session(s, t->mark);
    return t->mark;
}

/* What evicting every session that may go for `except` frees of the pool: the blocks they
 * hold that mark_kept left unmarked, each counted once. */
static uint64_t freeable_bytes(struct skv_session_table *t, const struct skv_session *except, uint64_t keep)
{
    uint64_t n = 0;
    for (int b = 0; b < BUCKETS; b++)
        for (const struct skv_session *s = t->bucket[b]; s; s = s->next)
            if (may_evict(s, except))
                n += skv_kv_cache_mark_new(s->cache, keep, keep + 1);
    return n * skv_kv_pool_block_bytes(except->cache->pool);
}

void skv_session_hold_room(struct skv_session_table *t, int level, struct skv_session *s, uint64_t held,
                           uint64_t unique)
{
    t->hold[level].s = s;
    t->hold[level].held = held;
    t->hold[level].unique = unique;
    t->hold[level].base = s ? skv_session_block_bytes(s) : 0;
}

/* What the forward of hold `level` may still take of the pool: its reservation less what its
 * session grew by since (an estimate: a compaction meanwhile gives the whole reservation back
 * to it); none for s's own. */
static uint64_t held_left(const struct skv_session_table *t, const struct skv_session *s, int level)
{
    const struct skv_session *h = t->hold[level].s;
    if (!h || h == s)
        return 0;
    uint64_t now = skv_session_block_bytes(h), grown = now > t->hold[level].base ? now - t->hold[level].base : 0;
    return grown < t->hold[level].unique ? t->hold[level].unique - grown : 0;
}

uint64_t skv_session_room_held(const struct skv_session_table *t, const struct skv_session *s)
{
    return held_left(t, s, 0) + held_left(t, s, 1);
}

static int tenant_refused(const struct skv_session_table *t, const struct skv_session *s, uint64_t tenant_bytes,
                          uint64_t t_free)
{
    return skv_errorf(SKV_E_LIMIT,
                      "tenant '%s' would hold %llu bytes (max-bytes-per-tenant %llu), %llu of them in sessions that "
                      "could be evicted",
                      s->tenant, (unsigned long long)tenant_bytes, (unsigned long long)t->lim.max_bytes_per_tenant,
                      (unsigned long long)t_free);
}

static int pool_refused(const struct skv_session_table *t, uint64_t used, uint64_t freed, const char *what)
{
    return skv_errorf(SKV_E_POOL_FULL, "KV pool full: %llu of %llu bytes would be in use, and %s %llu",
                      (unsigned long long)used, (unsigned long long)t->lim.pool_bytes, what,
                      (unsigned long long)freed);
}

int skv_session_reserve(struct skv_session_table *t, struct skv_session *s, uint64_t more_held, uint64_t more_unique,
                        int *evicted_out)
{
    s->bytes = skv_session_block_bytes(s);
    s->compressor_bytes = s->comp ? skv_compressor_bytes(s->comp) : 0;
    if (evicted_out)
        *evicted_out = 0;
    int count;
    uint64_t tenant_bytes;
    tenant_usage(t, s->tenant, &count, &tenant_bytes);
    tenant_bytes += more_held;
    /* a request run inside forwards that reserved room (the running one's, and one nested in
     * it): that room is theirs */
    for (int l = 0; l < 2; l++) {
        more_unique += held_left(t, s, l);
        /* the tenant's count has the holding session at its bytes when it reserved (s->bytes is
         * set there and not again until its charge), so all of its reservation is still to come */
        if (t->hold[l].s && t->hold[l].s != s && strcmp(t->hold[l].s->tenant, s->tenant) == 0)
            tenant_bytes += t->hold[l].held;
    }
    /* what the pool holds only for reuse counts for the tenant with its sessions, and goes
     * before any session, the tenant's own for its quota */
    if (t->cache_held) {
        /* their size bounds it; only past the quota are the blocks they alone hold counted */
        uint64_t kept = t->cache_held(t->cache_user, s->tenant, false);
        if (kept && tenant_bytes + kept > t->lim.max_bytes_per_tenant) {
            /* none go for a request that cannot fit with every one of them gone, and every
             * session of the tenant that may go (they all went before its refusal) */
            uint64_t t_free = evictable_bytes(t, s, s->tenant);
            if (tenant_bytes - (t_free < tenant_bytes ? t_free : tenant_bytes) > t->lim.max_bytes_per_tenant)
                return tenant_refused(t, s, tenant_bytes + kept, t_free);
            kept = t->cache_held(t->cache_user, s->tenant, true);
            while (kept && tenant_bytes + kept > t->lim.max_bytes_per_tenant &&
                   t->cache_drop(t->cache_user, s->tenant))
                kept = t->cache_held(t->cache_user, s->tenant, true);
        }
        tenant_bytes += kept;
    }
    uint64_t used = pool_bytes_used(t) + more_unique;
    if (used > t->lim.pool_bytes && t->cache_held && t->cache_drop) {
        /* the same for the pool: every tenant's kept prefixes went before a refusal that
         * evicting every candidate session could not have spared (a pool of pinned sessions) */
        uint64_t freed = t->cache_held(t->cache_user, NULL, true) + evictable_bytes(t, s, NULL);
        if (used - (freed < used ? freed : used) > t->lim.pool_bytes)
            return pool_refused(t, used, freed, "the sessions that could be evicted and the kept prefixes hold");
    }
    while (used > t->lim.pool_bytes && t->cache_drop && t->cache_drop(t->cache_user, NULL))
        used = pool_bytes_used(t) + more_unique;
    /* evict nothing for a request that cannot fit even with every candidate gone (the
     * candidates are counted only when a limit is passed: this runs for every decoded token) */
    if (tenant_bytes > t->lim.max_bytes_per_tenant) {
        uint64_t t_free = evictable_bytes(t, s, s->tenant);
        if (tenant_bytes - (t_free < tenant_bytes ? t_free : tenant_bytes) > t->lim.max_bytes_per_tenant)
            return tenant_refused(t, s, tenant_bytes, t_free);
    }
    uint64_t keep = 0;
    if (used > t->lim.pool_bytes) {
        /* a session's bytes bound what evicting it frees; only when that could be enough are
         * the blocks counted (those shared with `s` or a session that stays are not freed) */
        uint64_t p_free = evictable_bytes(t, s, NULL);
        if (used - (p_free < used ? p_free : used) <= t->lim.pool_bytes) {
            keep = mark_kept(t, s);
            p_free = freeable_bytes(t, s, keep);
        }
        if (used - (p_free < used ? p_free : used) > t->lim.pool_bytes)
            return pool_refused(t, used, p_free, "the sessions that could be evicted hold");
    }
    int evicted = 0; /* *evicted_out: those evicted before a refusal too */
    while (tenant_bytes > t->lim.max_bytes_per_tenant) {
        struct skv_session *v = lru_victim(t, s, s->tenant, 0, false);
        if (!v && evicted_out)
            *evicted_out = evicted;
        if (!v)
            return skv_errorf(SKV_E_LIMIT, "tenant '%s' would hold %llu bytes (max-bytes-per-tenant %llu)",
                              s->tenant, (unsigned long long)tenant_bytes,
                              (unsigned long long)t->lim.max_bytes_per_tenant);
        tenant_bytes -= v->bytes + v->compressor_bytes;
        evict(t, v);
        t->evictions++;
        evicted++;
    }
    /* evicting a session frees only the blocks no one else holds: re-count each time */
    while ((used = pool_bytes_used(t) + more_unique) > t->lim.pool_bytes) {
        if (!keep) /* the tenant's evictions brought it here */
            keep = mark_kept(t, s);
        struct skv_session *v = pool_victim(t, s, keep); /* one that frees a block: not a fork's document */
        if (!v && evicted_out)
            *evicted_out = evicted;
        if (!v)
            return skv_errorf(SKV_E_POOL_FULL, "KV pool full: %llu of %llu bytes in use and nothing can be evicted",
                              (unsigned long long)used, (unsigned long long)t->lim.pool_bytes);
        evict(t, v);
        t->evictions++;
        evicted++;
    }
    if (evicted_out)
        *evicted_out = evicted;
    return SKV_OK;
}

int skv_session_charge(struct skv_session_table *t, struct skv_session *s, int *evicted_out)
{
    return skv_session_reserve(t, s, 0, 0, evicted_out);
}

int skv_session_expire(struct skv_session_table *t, uint64_t now_ms)
{
    int n = 0;
    for (int b = 0; b < BUCKETS; b++)
        for (struct skv_session *s = t->bucket[b], *next; s; s = next) {
            next = s->next;
            if (!s->pinned && !s->busy && s->lease_seconds &&
                now_ms > s->last_used_ms + (uint64_t)s->lease_seconds * 1000) {
                evict(t, s);
                n++;
            }
        }
    return n;
}

int skv_session_foreach(struct skv_session_table *t, skv_session_visit_fn fn, void *user)
{
    int destroyed = 0;
    for (int b = 0; b < BUCKETS; b++)
        for (struct skv_session *s = t->bucket[b], *next; s; s = next) {
            next = s->next;
            if (fn(user, s)) {
                skv_session_destroy(t, s);
                destroyed++;
            }
        }
    return destroyed;
}

void skv_session_stats(const struct skv_session_table *t, struct skv_session_stats *out)
{
    struct skv_kv_pool_stats ps = {0};
    if (t->pool)
        skv_kv_pool_stats(t->pool, &ps);
    out->n_sessions = t->n_sessions;
    out->bytes_used = ps.blocks_in_use * ps.block_bytes;
    out->evictions = t->evictions;
    out->blocks_used = ps.blocks_in_use;
    out->blocks_shared = ps.blocks_shared;
    out->block_rows = ps.block_rows;
    out->block_bytes = ps.block_bytes;
}
