/* The daemon's metrics: the counters the engine worker keeps, the rows STATS reports and their
 * Prometheus text exposition (one formatter for admin STATS --prometheus and HTTP /metrics). */
#ifndef SKV_STATS_H
#define SKV_STATS_H

#include <stddef.h>
#include <stdint.h>

/* Counters kept by the engine worker thread. */
struct skv_metrics {
    uint64_t requests, errors;
    uint64_t prefill_tokens, decode_tokens, decode_batches;
    uint64_t prefix_reused_tokens, prefix_reuse_hits; /* prompt tokens PREFILLs took from other sessions */
    uint64_t scored_tokens;       /* tokens PREFILLs and APPENDs scored (prompt_logprobs) */
    double prefill_seconds, decode_seconds;
    uint64_t bytes_before, bytes_after; /* over all PREFILLs (whole pool blocks) */
    uint64_t ipc_closed_lru;      /* CUDA buffers closed to make room for another (SKV_IPC_* limits) */
    uint64_t ipc_closed_gone;     /* CUDA buffers closed because their client's connection closed */
    uint64_t decodes_cancelled_gone; /* running DECODEs ended because their client's connection closed */
    uint64_t decodes_cancelled;   /* running DECODEs ended by a CANCEL */
    uint64_t upkeep_cuts_failed;  /* layers a decode's upkeep left over budget (its cut failed) */
    uint64_t decode_rounds_yielded; /* decode rounds run between the layers of a long forward */
    uint64_t requests_overtook;   /* short requests run inside a long forward, ahead of it */
    uint64_t requests_reordered;  /* requests run before an older one (queue-order = fair) */
    uint64_t requests_nested;     /* another tenant's requests run inside a long forward (fair-slice-ms) */
    uint64_t requests_dropped_gone; /* of clients whose connection closed: dropped queued, or PREFILLs stopped */
    uint64_t requests_past_deadline; /* answered TIMEOUT unrun, or PREFILLs stopped, past the client's deadline */
    uint64_t persist_checkpoints; /* checkpoints written (persist-interval-seconds) */
    uint64_t persist_bytes;       /* bytes saves and checkpoints wrote (session files and new KV blocks) */
    uint64_t persist_failures;    /* checkpoints that failed (not those that gave way to a request) */
    double persist_last_seconds;  /* how long the last save or checkpoint that ended held the engine */
    double store_spill_seconds;   /* the engine's time writing sessions to the store (store = ...) */
    double store_load_seconds;    /* and taking them back (a miss included) */
    uint64_t store_refused;       /* values taken that store-secret-file's signature refused */
};

/* Everything the rows are computed from (a plain copy: any thread may format one). */
struct skv_stats_input {
    struct skv_metrics metrics;
    uint64_t n_sessions;
    uint64_t pool_bytes_used, pool_bytes_total;
    uint64_t pool_blocks_used, pool_blocks_shared;
    uint64_t prefix_retained, prefix_retained_bytes; /* released sessions' KV kept for prefix reuse */
    uint64_t prefix_retained_host_bytes; /* their own memory beside the blocks */
    uint64_t prefix_retained_dropped; /* kept ones dropped (room, the cap, unused, covered by a newer one) */
    uint64_t evictions;
    uint64_t client_disconnects;  /* clients (that sent a request) whose connection closed */
    uint64_t n_decodes;           /* DECODEs running */
    uint64_t queue_requests;      /* requests waiting for the engine (queue-depth) */
    uint64_t queue_bytes;         /* the memory they hold (max-queued-bytes) */
    uint64_t reply_bytes_unread;  /* replies sent and not taken by their clients yet */
    uint64_t replies_dropped;     /* replies dropped for max-reply-bytes(-per-client) */
    uint64_t replies_closed;      /* replies not sent: their request's connection had closed */
    uint64_t engine_scratch_bytes; /* activation buffers the worker's engines hold */
    double persist_age_seconds;   /* since the sessions were last saved (the start, when none was); 0: persist off */
    uint64_t store_spills, store_spill_bytes, store_spill_failures; /* store = ...: sessions written there */
    uint64_t store_loads, store_misses, store_load_failures;        /* and asked for */
};

struct skv_stat {
    const char *name;             /* Prometheus metric name; "_total" ones are counters */
    const char *help;
    double value;
};

#define SKV_N_STATS 54

void skv_stats_rows(const struct skv_stats_input *in, struct skv_stat rows[SKV_N_STATS]);

/* One tenant's figures. Tenants are counted by name, the first SKV_TENANT_STATS valid names
 * seen since the start; the requests of any later one (and of names a tenant cannot have)
 * count together as "(other)", the admin endpoint's as "(admin)", so a client inventing
 * tenant names cannot grow the table or the exposition. */
#define SKV_TENANT_STATS 128
#define SKV_TENANT_ROWS (SKV_TENANT_STATS + 2)
#define SKV_TENANT_ADMIN "(admin)"
#define SKV_TENANT_OTHER "(other)"
struct skv_tenant_stats {
    char name[64];
    uint64_t requests, errors;    /* counters: requests run, failed */
    uint64_t prefill_tokens, decode_tokens;
    double engine_seconds;        /* the engine's time on its requests and decode rounds */
    uint64_t sessions, bytes;     /* gauges: sessions held, their bytes (max-bytes-per-tenant counts) */
    uint64_t queued, decodes;     /* requests waiting, DECODEs running */
    uint64_t kept_bytes;          /* gauge: its kept prefixes' blocks no session shares (max-bytes-per-tenant counts) */
};
struct skv_tenant_table {         /* a plain copy */
    int n;
    struct skv_tenant_stats t[SKV_TENANT_ROWS];
};

#define SKV_N_TENANT_STATS 10     /* metrics per tenant */
#define SKV_STAT_NAME_MAX 112     /* a row's name with its label: snapkv_tenant_x{tenant="..."} */
/* The per-tenant rows, metric by metric and tenant by tenant (SKV_N_TENANT_STATS x t->n rows),
 * each named with its label (snapkv_tenant_sessions{tenant="a"}), the names written to
 * names[]. Returns how many. */
size_t skv_stats_tenant_rows(const struct skv_tenant_table *t, struct skv_stat *rows,
                             char (*names)[SKV_STAT_NAME_MAX]);

/* Room for the whole exposition: the daemon's rows and every tenant's. */
#define SKV_PROMETHEUS_MAX (256 * 1024)
/* Prometheus text format 0.0.4 into buf: HELP and TYPE once per metric (a row's name up to its
 * '{'), then each row's sample; NUL-terminated and truncated to cap - 1; returns the length
 * written. */
size_t skv_stats_prometheus(const struct skv_stat *rows, size_t n, char *buf, size_t cap);

#endif
