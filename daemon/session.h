/* Sessions: one sequence's KV cache, token history, compression state and bookkeeping
 * (tenant, owner, times, pin, lease), in a table with per-tenant limits, pool byte
 * accounting and LRU eviction of idle, unpinned sessions. Knows no socket, no protobuf.
 * Not thread-safe: the engine worker thread owns the table.
 * Accounting over the model's KV block pool (daemon/engine/kv_pool.h), where forks share
 * blocks copy-on-write: the pool limit counts unique blocks (a block shared by a document
 * and its forks counts once, so forks of a pinned document cost only the blocks they
 * write); a session's bytes, and so its tenant's quota, count every block its tables hold,
 * shared or not (a tenant cannot exceed its quota through forks, and releasing the
 * document never pushes the forks over it). */
#ifndef SKV_SESSION_H
#define SKV_SESSION_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/compress/compress.h"
#include "daemon/engine/engine.h"

#define SKV_SESSION_ID_BYTES 16
#define SKV_TENANT_MAX 64
#define SKV_TENANT_DEFAULT "default"  /* requests that name no tenant */

struct skv_session {
    uint8_t id[SKV_SESSION_ID_BYTES];
    char tenant[SKV_TENANT_MAX];
    char owner[SKV_TENANT_MAX];
    int32_t *tokens;              /* token history (prompt, appends, generated) */
    int n_tokens, cap_tokens;
    int32_t prompt_len;           /* original prompt length */
    int32_t computed_rows;        /* its first rows a prefix reuse may take: computed here from its tokens
                                     by forwards of more than the engine's small-batch size (PREFILL,
                                     APPEND), the kernels a prefill of a long prompt takes; 0 after
                                     IMPORT_KV, LOAD, a restore; rows of decode steps never count */
    struct skv_kv_cache *cache;
    struct skv_kv_cache *side[2]; /* while a request runs on it: its cache before an APPEND or COMPRESS
                                     on a copy, and a PREFILL's prompt rows kept for reuse; blocks they
                                     hold stay when other sessions are evicted (not the sessions' to free) */
    struct skv_compressor *comp;  /* NULL for policy=full */
    char spec[256];
    uint64_t created_ms, last_used_ms;
    bool pinned;
    uint32_t lease_seconds;       /* released when idle this long (unless pinned) */
    uint64_t bytes;               /* blocks its tables hold x block bytes (shared ones too) */
    uint64_t compressor_bytes;    /* memory its compressor may hold outside the pool (tenant quota) */
    float *logits;                /* [n_vocab] after the last forward (DECODE samples from it) */
    int busy;                     /* a decode in flight: never evicted */
    bool announced;               /* a KV event said it is stored (its removal is announced too) */
    char text_pending[8];         /* the start of a character the last DECODE's text stopped inside: */
    uint8_t n_text_pending;       /* the next DECODE's text begins with it (APPEND drops it) */
    uint64_t persist_gen;         /* the persist generation whose file the manifest on disk names for it
                                     (0: none) ... */
    unsigned char persist_sum[32]; /* ... and that file's checksum: a save whose bytes match keeps it */
    struct skv_session *next;     /* table chain */
};

struct skv_session_limits {
    uint64_t pool_bytes;
    int max_sessions_per_tenant;
    int max_sessions;             /* all tenants together (0: no limit) */
    uint64_t max_bytes_per_tenant;
};

struct skv_session_table;

/* A tenant name is 1..SKV_TENANT_MAX-1 letters, digits and . _ - @ (SKV_E_INVAL otherwise). */
int skv_session_check_tenant(const char *tenant);

int skv_session_table_new(const struct skv_session_limits *lim, struct skv_session_table **out);
void skv_session_table_free(struct skv_session_table **t_p);

/* A new, empty session (random 128-bit id) charged to nobody yet. SKV_E_LIMIT when the
 * tenant holds max_sessions_per_tenant already, or the table max_sessions. */
int skv_session_create(struct skv_session_table *t, const struct skv_model *m, const char *tenant, const char *owner,
                       struct skv_session **out);
/* Gives s the id `id` (a session persisted across a restart keeps its id); SKV_E_EXISTS when
 * another session has it. */
int skv_session_set_id(struct skv_session_table *t, struct skv_session *s, const uint8_t *id);
/* NULL when unknown or of another tenant (tenant NULL: any; used by admins). */
struct skv_session *skv_session_find(struct skv_session_table *t, const uint8_t *id, const char *tenant);
void skv_session_destroy(struct skv_session_table *t, struct skv_session *s);
/* Calls fn(user, s) for each session skv_session_destroy() destroys (not at the table's free),
 * before it goes: how its removal is announced (KV events). */
void skv_session_table_on_destroy(struct skv_session_table *t, void (*fn)(void *user, struct skv_session *s),
                                  void *user);
/* Calls fn(user, s) before the table itself drops s: an eviction (skv_session_charge,
 * skv_session_reserve) or a lease that ran out (skv_session_expire), not a destroy the caller
 * asks for. How an evicted session is kept elsewhere (store = ...). */
void skv_session_table_on_evict(struct skv_session_table *t, void (*fn)(void *user, struct skv_session *s),
                                void *user);
/* What the pool holds besides sessions, only for reuse (retained prefixes, prefix_cache.h):
 * held(user, tenant, alone) is what a tenant holds of it (tenant NULL: every tenant), with
 * alone only what no session shares, which its max-bytes-per-tenant counts with its sessions (without alone, a bound of
 * it, cheaper); drop(user, tenant) frees a piece of the tenant's (tenant NULL: anyone's, while
 * the pool would be past its size) and returns false when there is none. skv_session_reserve
 * drops them before it evicts any session, for the tenant's quota or the pool. */
void skv_session_table_on_pressure(struct skv_session_table *t,
                                   uint64_t (*held)(void *user, const char *tenant, bool alone),
                                   bool (*drop)(void *user, const char *tenant), void *user);
/* The bytes the tenant's sessions hold (as skv_session_charge last counted them; their
 * compressors' too), less except's when it is the tenant's. */
uint64_t skv_session_tenant_bytes(const struct skv_session_table *t, const char *tenant,
                                  const struct skv_session *except);
int skv_session_push_tokens(struct skv_session *s, const int32_t *ids, int n);
/* Room in s's token history for n more, so that pushing them after a forward cannot fail for
 * memory (the rows would be in the cache and the tokens not: n_tokens behind n_past). */
int skv_session_reserve_tokens(struct skv_session *s, int n);

/* Re-counts s's KV bytes against its tenant and the pool's unique bytes. When the pool or
 * the tenant's quota would overflow, evicts idle, unpinned, not-busy sessions in LRU order (never `s`):
 * for the quota the tenant's own; for the pool first those of tenants holding more than an
 * equal share of it (pool bytes / tenants with sessions), then anyone's;
 * SKV_E_POOL_FULL / SKV_E_LIMIT when that is not enough (the caller then drops `s`, or undoes
 * what it added). Nothing is evicted when evicting every candidate could not make room.
 * *evicted_out (may be NULL) counts the sessions evicted, also when it then refuses. */
int skv_session_charge(struct skv_session_table *t, struct skv_session *s, int *evicted_out);
/* The same before a request adds to s: room for `more_held` more bytes of blocks held by s's
 * tenant and `more_unique` more unique bytes in the pool (skv_kv_cache_growth's bound), so that
 * a request that will not fit fails before it changes anything. */
/* The room a forward of s reserved (skv_session_reserve's more_held / more_unique) and that it
 * will take while it runs: a request nested in that forward (fair-slice-ms) counts what s has
 * not taken yet as in use, so it cannot take the room and leave the forward short. level 0: the
 * running request's; 1: a request nested in it, whose own forward runs short requests and decode
 * rounds inside it. NULL clears it; destroying s does too. */
void skv_session_hold_room(struct skv_session_table *t, int level, struct skv_session *s, uint64_t held,
                           uint64_t unique);
int skv_session_reserve(struct skv_session_table *t, struct skv_session *s, uint64_t more_held, uint64_t more_unique,
                        int *evicted_out);
/* What the forwards that hold room (skv_session_hold_room) but s's may still take of the pool:
 * room not free to anything else s's request does. */
uint64_t skv_session_room_held(const struct skv_session_table *t, const struct skv_session *s);

/* Releases every unpinned session idle past its lease; returns how many. */
int skv_session_expire(struct skv_session_table *t, uint64_t now_ms);

/* Iteration (admin LIST/EVICT): calls fn for each session; fn returns true to destroy it. */
typedef bool (*skv_session_visit_fn)(void *user, struct skv_session *s);
int skv_session_foreach(struct skv_session_table *t, skv_session_visit_fn fn, void *user);

struct skv_session_stats {
    int n_sessions;
    uint64_t bytes_used;          /* unique blocks in use x block bytes */
    uint64_t evictions;
    uint64_t blocks_used, blocks_shared;
    int block_rows;
    uint64_t block_bytes;
};
void skv_session_stats(const struct skv_session_table *t, struct skv_session_stats *out);
/* Bytes of s's blocks shared with another session. */
uint64_t skv_session_shared_bytes(const struct skv_session *s);
/* Bytes of every block s holds, shared ones too: what the quotas count of it (its compressor's
 * state aside). */
uint64_t skv_session_block_bytes(const struct skv_session *s);

/* Bytes per tenant, added up over a set (sessions, kept prefixes) to find who holds more than an
 * equal share. The names are not copied: they must outlive the tally. */
struct skv_tenant_tally {
    struct skv_tenant_bytes {
        const char *tenant;
        uint64_t bytes;
    } *u;
    size_t n, cap;
};
/* Adds bytes to tenant's (a new tenant at 0 first); SKV_E_NOMEM, nothing changed, without room. */
int skv_tenant_tally_add(struct skv_tenant_tally *t, const char *tenant, uint64_t bytes);
/* tenant's bytes (0 when absent). */
uint64_t skv_tenant_tally_bytes(const struct skv_tenant_tally *t, const char *tenant);
void skv_tenant_tally_free(struct skv_tenant_tally *t);

/* Milliseconds of CLOCK_MONOTONIC: leases, idle times and the LRU order go by it, so a step of
 * the wall clock (NTP, a VM resumed) neither expires sessions nor keeps them past their lease. */
uint64_t skv_now_ms(void);
/* The wall-clock time (Unix ms) of a skv_now_ms() value, for what clients see. */
uint64_t skv_unix_ms(uint64_t at_ms);
void skv_session_id_hex(const uint8_t *id, char out[2 * SKV_SESSION_ID_BYTES + 1]);

#endif
