/* snapkvd's options: one table row per option drives the command line, /etc/snapkvd.conf
 * and the admin CONFIG GET command (the redis config.c idea). */
#ifndef SKV_CONFIG_H
#define SKV_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct skv_config {
    char *config_file;
    char *model;
    char *backend;            /* auto | cpu | cuda */
    int64_t threads;          /* 0: all online CPUs */
    int64_t pool_size;        /* bytes of KV pool */
    int64_t kv_block_tokens;  /* rows per KV pool block */
    char *kv_type;            /* f32 | f16 | q8_0: the KV pool's rows */
    bool pool_prealloc;       /* take pool-size bytes of KV blocks at start */
    char *endpoint;           /* client socket */
    char *admin_endpoint;     /* admin socket */
    char *curve_secret_key;   /* file: the daemon's CURVE secret key (tcp:// endpoints) */
    char *curve_authorized_keys;  /* file: client public keys allowed on a tcp:// endpoint */
    char *admin_authorized_keys;  /* file: admin public keys allowed on a tcp:// admin endpoint */
    bool allow_insecure_tcp;  /* serve tcp:// without CURVE (trusted networks only) */
    char *metrics_listen;     /* HOST:PORT of the HTTP /metrics endpoint; "" = off */
    int64_t health_stall_seconds; /* /healthz: the engine with work and no progress this long is stalled */
    char *state_dir;          /* saved sessions */
    char *log_level;
    char *log_file;           /* empty: stderr (journald) */
    bool foreground;
    int64_t max_prompt_tokens;
    int64_t max_new_tokens;
    int64_t queue_depth_per_tenant;      /* requests of one tenant waiting for the engine */
    int64_t max_queued_bytes_per_tenant; /* and the memory they hold */
    int64_t decode_yield_ms;  /* a long forward gives running DECODEs a token at least this often */
    int64_t decode_share;     /* and their rounds up to this percent of the engine's time */
    int64_t max_decodes;      /* DECODEs running at once, all tenants */
    int64_t max_decodes_per_tenant;
    int64_t max_sessions_per_tenant;
    int64_t max_sessions;
    int64_t max_bytes_per_tenant;
    int64_t max_message_bytes;
    int64_t max_connections;
    int64_t max_connections_per_peer;
    int64_t max_reply_bytes_per_peer;
    int64_t queue_depth;
    int64_t max_queued_bytes; /* memory the requests waiting for the engine may hold */
    int64_t max_text_bytes;   /* longest request text; 0: derived from the token limits */
    int64_t lease_seconds;    /* the lease of a session whose PREFILL names none */
    int64_t max_lease_seconds; /* the longest lease a PREFILL may name */
    char *store;              /* redis://HOST[:PORT][/DB] or unix://PATH: spilled sessions; "" off */
    int64_t store_keep_seconds; /* a spilled session's time to live there */
    int64_t store_timeout_ms; /* connect, spill and load */
    int64_t store_max_bytes;  /* the largest session spilled */
    int64_t store_max_bytes_per_tenant; /* what one tenant's spills this daemon made may hold there */
    char *store_user;         /* AUTH as this user ("": Redis's default one) ... */
    char *store_password_file; /* ... with the password in this file ("": no AUTH) */
    char *store_secret_file;  /* values signed with the secret in this file ("": not signed) */
    char *store_accept_secret_file; /* values signed with this one load too (a rotation; "": none) */
    char *default_compress;   /* spec used when a PREFILL names none */
    char *ipc_tenant;         /* "claimed" or "uid": where an ipc client's tenant comes from */
    char *queue_order;        /* "fair" (tenants share the engine's time) or "fifo" */
    char *tenant_weights;     /* "NAME:W,..." shares of the engine's time under fair order; "" all 1 */
    int64_t max_reply_bytes_per_client; /* replies a client has not taken yet (more are dropped) */
    int64_t max_reply_bytes;  /* and all clients' together */
    char *events_endpoint;    /* KV events PUB socket (ipc:// only); "" off */
    char *events_replay_endpoint; /* ROUTER answering KvReplayRequest (ipc:// only); "" off */
    int64_t events_heartbeat_seconds; /* an idle events stream's heartbeat; 0 none */
    int64_t tcp_user_timeout_seconds; /* tcp:// connections: unacknowledged or untaken replies this long close it */
    bool prefix_reuse;        /* a PREFILL shares the KV of a prompt prefix another of the tenant's sessions holds */
    int64_t prefix_retain_bytes; /* released full-cache sessions' KV kept for that, up to this; 0 none */
    bool persist;             /* sessions saved at stop and restored, with their ids, at start */
    int64_t persist_max_seconds; /* the time the save at stop may take */
    int64_t persist_interval_seconds; /* also saved (a checkpoint) this often when idle; 0: at stop only */
    int64_t fair_slice_ms;    /* fair order: a long forward's own time before another tenant's request
                               * may run inside it; 0: never */
};

enum skv_config_type { SKV_CFG_STRING, SKV_CFG_INT, SKV_CFG_SIZE, SKV_CFG_BOOL };

struct skv_config_option {
    const char *name;         /* long option and config-file key */
    enum skv_config_type type;
    size_t offset;            /* into struct skv_config */
    const char *default_value;
    int64_t min, max;         /* for INT and SIZE */
    const char *help;
};

/* The table and its length. */
const struct skv_config_option *skv_config_options(size_t *n);

/* Fills every field with its default. Returns SKV_OK or SKV_E_NOMEM. */
int skv_config_init(struct skv_config *cfg);
void skv_config_free(struct skv_config *cfg);
/* Sets one option from text ("4G", "yes", "12"); SKV_E_INVAL / SKV_E_NOT_FOUND with a message. */
int skv_config_set(struct skv_config *cfg, const char *name, const char *value);
/* Reads `key = value` lines ('#' comments, blank lines); errors name the file and line. */
int skv_config_load_file(struct skv_config *cfg, const char *path);
/* The rules that tie options together, checked once every source was read (an option's own
 * range is checked when it is set): SKV_OK, or SKV_E_INVAL with a message naming the options
 * and their values. */
int skv_config_check(const struct skv_config *cfg);
/* Formats an option's current value into buf. Returns SKV_OK or SKV_E_NOT_FOUND. */
int skv_config_get(const struct skv_config *cfg, const char *name, char *buf, size_t cap);
/* Whether a tenant name is 1..63 letters, digits and . _ - @ (no error message is set: a caller
 * may run while a failure's message waits to be sent; skv_session_check_tenant says why). */
bool skv_tenant_name_ok(const char *name);

/* One tenant's share of the engine's time under queue-order = fair (tenant-weights). */
#define SKV_TENANT_WEIGHTS_MAX 64
#define SKV_TENANT_WEIGHT_MAX 100
struct skv_tenant_weight {
    char name[64];
    int weight;               /* 1..SKV_TENANT_WEIGHT_MAX */
};
/* Parses tenant-weights text ("alice:4,bob:2"; "" none) into out[] (at most
 * SKV_TENANT_WEIGHTS_MAX); SKV_E_INVAL with a message naming the bad entry. */
int skv_tenant_weights_parse(const char *text, struct skv_tenant_weight *out, int *n);

/* "4G", "512M", "1024" -> bytes. */
int skv_parse_size(const char *text, int64_t *out);

#endif
