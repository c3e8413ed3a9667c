/* Retained prefixes (prefix-retain-bytes): the KV of released full-cache sessions, kept as
 * copy-on-write references to their blocks so that a later PREFILL of the same tenant can take
 * their prompt's start (prefix reuse) although nobody holds the session any more. They are the
 * first to go when the pool needs room, and go after lease-seconds unused. Owned by the engine
 * worker thread. */
#ifndef SKV_PREFIX_CACHE_H
#define SKV_PREFIX_CACHE_H

#include "daemon/engine/engine.h"
#include "daemon/session.h"

#include <stdbool.h>
#include <stdint.h>

struct skv_prefix_entry {
    uint8_t id[SKV_SESSION_ID_BYTES]; /* random: what its KV events call it (no request takes it) */
    char tenant[SKV_TENANT_MAX];
    int32_t *tokens;              /* the first n_rows tokens of the session's history */
    int n_rows;                   /* its computed_rows, in whole blocks */
    struct skv_kv_cache *cache;   /* their rows, shared with the session's */
    uint64_t bytes;               /* its blocks x block bytes (shared ones too) */
    uint64_t host_bytes;          /* its own memory beside the blocks: tokens, positions, scores, block
                                     tables (skv_kv_cache_host_bytes), which no sharing makes smaller */
    uint64_t last_used_ms;        /* lease-seconds unused: it goes */
    uint64_t used;                /* the cache's count of uses when it was last used (LRU order) */
    bool announced;               /* on_add was called for it (on_drop will be) */
    uint64_t persist_gen;         /* the persist generation whose file the manifest on disk names for it
                                     (0: none), and that file's checksum: as a session's */
    unsigned char persist_sum[32];
    struct skv_prefix_entry *next;
};

struct skv_prefix_cache {
    struct skv_prefix_entry *head;
    int n;
    uint64_t bytes;               /* the bytes of the blocks the entries hold, each block once (entries
                                     that share a document's start share its blocks) */
    uint64_t host_bytes;          /* the entries' host_bytes together: held to cap too (entries sharing a
                                     document's start add few blocks each, but each its whole index) */
    uint64_t cap;                 /* prefix-retain-bytes; 0: nothing is kept */
    uint64_t uses;                /* entries made or used so far */
    uint64_t dropped;             /* entries dropped for room, for the cap, unused or covered (not cleared) */
    uint64_t marks;               /* walks over the entries' blocks so far (the marks they leave) */
    /* called for each entry made, and for each entry before it goes (dropped or cleared): how
     * they are announced (KV events); NULL: not called */
    void (*on_add)(void *user, const struct skv_prefix_entry *e);
    void (*on_drop)(void *user, const struct skv_prefix_entry *e);
    void *hook_user;
};

/* Whether cache holds every row of a history of n_tokens tokens (no row compressed or evicted)
 * and no forward is half way through it (its done layers would hold more rows than n_past, once
 * the first has run). */
bool skv_prefix_cache_whole(const struct skv_kv_cache *cache, int n_tokens);

/* Keeps the whole blocks of s's rows that prefix reuse may take (its computed_rows) and their
 * tokens, when s is a full-cache session and they are at least a block (s stays as it is; the
 * caller destroys it), as skv_prefix_cache_add does. */
int skv_prefix_cache_keep(struct skv_prefix_cache *pc, const struct skv_session *s, uint64_t tenant_room,
                          uint64_t now_ms);

/* Bytes of the blocks `rows` rows of every layer and KV head of c take. */
uint64_t skv_prefix_cache_rows_bytes(const struct skv_kv_cache *c, int rows);

/* Keeps the first `rows` rows of cache (a whole number of blocks, at least one; every row of
 * those positions, computed here) and their tokens for the tenant (the cache stays the
 * caller's: the entry shares its blocks), under id (NULL: a random one; a persist restore gives
 * back the one it had), last used at now_ms. Entries of the tenant whose tokens start these are
 * dropped (the new one covers them); when one holds these already, that one is kept instead.
 * tenant_room is the most the tenant's entries may hold together (max-bytes-per-tenant less
 * what its sessions hold): its least recently used go to make room, and rows over it, or over
 * the cap, on their own are not kept. Past the cap, entries go as skv_prefix_cache_drop_lru(pc,
 * NULL) picks them; when that is the new one, it is not kept (and not announced). */
int skv_prefix_cache_add(struct skv_prefix_cache *pc, const char *tenant, const int32_t *tokens, int rows,
                         const struct skv_kv_cache *cache, uint64_t tenant_room, uint64_t now_ms, const uint8_t *id);
/* The entry of that id (NULL: none). */
struct skv_prefix_entry *skv_prefix_cache_find_id(struct skv_prefix_cache *pc, const uint8_t *id);

/* Marks e used now (a PREFILL took its rows): the last to go of the least recently used. */
void skv_prefix_cache_touch(struct skv_prefix_cache *pc, struct skv_prefix_entry *e, uint64_t now_ms);
/* With alone, the bytes of the blocks the tenant's entries hold and no session holds, each
 * once (a session that took an entry's rows holds them too, and counts them for the tenant;
 * entries that share a document's start hold its blocks once): what max-bytes-per-tenant
 * counts of them (a walk of their blocks). Without alone, a bound of it, cheaper: their sizes
 * added up, at most pc->bytes. tenant NULL: every tenant's. */
uint64_t skv_prefix_cache_tenant_bytes(struct skv_prefix_cache *pc, const char *tenant, bool alone);
/* Drops the least recently used entry of the tenant; with tenant NULL (room for the pool or the
 * cap), of the tenants holding more than an equal share of the entries' bytes first, so that a
 * tenant within its share loses nothing while another holds more (then anyone's). False when
 * there is none. */
bool skv_prefix_cache_drop_lru(struct skv_prefix_cache *pc, const char *tenant);
/* Bytes of the blocks e holds that no session holds (a block another entry holds too counts in
 * each). */
uint64_t skv_prefix_entry_alone_bytes(struct skv_prefix_cache *pc, const struct skv_prefix_entry *e);
/* Drops the entry of that id (EVICT; not counted in dropped); false when there is none. */
bool skv_prefix_cache_drop_id(struct skv_prefix_cache *pc, const uint8_t *id);
/* Drops the entries unused for idle_ms; returns how many. */
int skv_prefix_cache_expire(struct skv_prefix_cache *pc, uint64_t now_ms, uint64_t idle_ms);
/* Drops the tenant's entries (NULL: every entry); returns how many. */
int skv_prefix_cache_clear(struct skv_prefix_cache *pc, const char *tenant);

#endif
