/* The option table and the three ways into it: command line, config file, CONFIG GET. */
#include "daemon/config.h"
#include "common/log.h"
#include "common/status.h"
#include "daemon/compress/spec.h"
#include "kernels/backend.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OPT(field) offsetof(struct skv_config, field)

static const struct skv_config_option options[] = {
    {"config", SKV_CFG_STRING, OPT(config_file), "", 0, 0, "configuration file to read first"},
    {"model", SKV_CFG_STRING, OPT(model), "/var/lib/snapkvd/models/SmolLM2-135M-Instruct.Q4_1.gguf", 0, 0,
     "model: a GGUF file or a Hugging Face folder (config.json + *.safetensors)"},
    {"backend", SKV_CFG_STRING, OPT(backend), "auto", 0, 0, "compute backend: auto, cpu or cuda"},
    {"threads", SKV_CFG_INT, OPT(threads), "0", 0, 256, "CPU threads (0: all online CPUs)"},
    {"pool-size", SKV_CFG_SIZE, OPT(pool_size), "1G", 1 << 20, INT64_C(1) << 42, "bytes of KV pool"},
    {"kv-block-tokens", SKV_CFG_INT, OPT(kv_block_tokens), "16", 1, 4096,
     "tokens of one KV head of one layer per pool block (smaller: less rounding of small budgets)"},
    {"kv-type", SKV_CFG_STRING, OPT(kv_type), "f32", 0, 0,
     "what a KV pool block holds its K and V rows in: f32; f16 (half the bytes, so twice the tokens in a "
     "pool-size; every value rounded to the nearest half, magnitudes past 65504 saturating); or q8_0 (GGUF's "
     "Q8_0: 34 bytes per 32 values, 3.76 times the tokens of f32; per 32 values an f16 scale and 8-bit integers; "
     "a head_dim that is a multiple of 32)"},
    {"pool-prealloc", SKV_CFG_BOOL, OPT(pool_prealloc), "no", 0, 0,
     "take the whole pool-size of KV blocks at start (fails to start when the memory is not there)"},
    {"endpoint", SKV_CFG_STRING, OPT(endpoint), "ipc:///run/snapkvd/snapkvd.sock", 0, 0,
     "client endpoint (ipc:// or tcp://)"},
    {"admin-endpoint", SKV_CFG_STRING, OPT(admin_endpoint), "ipc:///run/snapkvd/admin.sock", 0, 0,
     "admin endpoint (ipc://, or tcp:// with admin-authorized-keys; with allow-insecure-tcp and no "
     "curve-secret-key, plain tcp:// that anyone reaching it may use)"},
    {"curve-secret-key", SKV_CFG_STRING, OPT(curve_secret_key), "", 0, 0,
     "file holding the daemon's CURVE secret key ('snapkvctl keygen'); needed by tcp:// endpoints"},
    {"curve-authorized-keys", SKV_CFG_STRING, OPT(curve_authorized_keys), "", 0, 0,
     "file of client public keys allowed on a tcp:// endpoint, one per line: KEY [TENANT]"},
    {"admin-authorized-keys", SKV_CFG_STRING, OPT(admin_authorized_keys), "", 0, 0,
     "file of admin public keys allowed on a tcp:// admin endpoint, one per line"},
    {"allow-insecure-tcp", SKV_CFG_BOOL, OPT(allow_insecure_tcp), "no", 0, 0,
     "serve tcp:// endpoints without CURVE (no authentication, no encryption)"},
    {"tcp-user-timeout-seconds", SKV_CFG_INT, OPT(tcp_user_timeout_seconds), "60", 0, 86400,
     "a tcp:// client or admin connection whose replies stay unacknowledged, or that takes none (its "
     "receive window full: its process stopped, or its libzmq queue full), this long is closed and its "
     "work stops as a client gone (TCP_USER_TIMEOUT); covers a host gone while replies streamed to it, "
     "which the 15 s ZMTP heartbeat cannot (its pings wait behind the replies); 0: none (a host gone: the "
     "kernel's retransmission limit, tcp_retries2, about 15 minutes; a live peer whose window stays full: "
     "no limit)"},
    {"metrics-listen", SKV_CFG_STRING, OPT(metrics_listen), "", 0, 0,
     "HOST:PORT for plain-HTTP GET /metrics (Prometheus text) and the probes /healthz and /readyz; empty: off"},
    {"health-stall-seconds", SKV_CFG_INT, OPT(health_stall_seconds), "60", 1, 86400,
     "/healthz and /readyz answer 503 once the engine thread, with work to do, shows no progress this long"},
    {"state-dir", SKV_CFG_STRING, OPT(state_dir), "/var/lib/snapkvd", 0, 0, "where saved sessions live"},
    {"events-endpoint", SKV_CFG_STRING, OPT(events_endpoint), "", 0, 0,
     "ipc:// endpoint of a ZeroMQ PUB socket announcing each session stored, changed (APPEND, COMPRESS, a "
     "DECODE's end) and removed, with its token history's block hashes, for a KV-aware router "
     "(docs/SCALING.md); empty: off"},
    {"events-replay-endpoint", SKV_CFG_STRING, OPT(events_replay_endpoint), "", 0, 0,
     "ipc:// endpoint of a ZeroMQ ROUTER that answers a KvReplayRequest with every session the "
     "events-endpoint has announced and not removed, and the sequence number they stand at, so a "
     "subscriber that starts late or missed events catches up without the admin endpoint; needs "
     "events-endpoint; empty: off"},
    {"events-heartbeat-seconds", SKV_CFG_INT, OPT(events_heartbeat_seconds), "2", 0, 3600,
     "an events stream idle this long gets a heartbeat, a batch of no events under the last event's number, "
     "so a subscriber learns of a restarted daemon (its boot id) without waiting for an event; 0: none (a "
     "reader that takes every message for one event)"},
    {"prefix-reuse", SKV_CFG_BOOL, OPT(prefix_reuse), "yes", 0, 0,
     "a PREFILL whose prompt begins with whole KV blocks (kv-block-tokens) another full-cache session of the "
     "same tenant holds, computed by its PREFILLs or APPENDs, shares those blocks copy-on-write and computes "
     "only the rest, as a prefill of the whole prompt would (a PREFILL may opt out)"},
    {"prefix-retain-bytes", SKV_CFG_SIZE, OPT(prefix_retain_bytes), "0", 0, INT64_C(1) << 42,
     "with prefix-reuse, a full-cache session RELEASEd is kept for it (its blocks, copy-on-write: what other "
     "sessions share costs nothing more), and so are a compressing PREFILL's prompt rows before it cuts them "
     "(when the pool has free room for them), up to this many bytes together (a block several share counts "
     "once; and apart from the blocks, their own host memory, token ids and each head's positions and scores, "
     "up to as many), least recently used going first, of the tenants holding more than an equal share first; kept "
     "ones are the first to go when the "
     "pool needs room, count with their tenant's sessions against max-bytes-per-tenant (going before any of "
     "them), and go after lease-seconds unused; 0: none"},
    {"persist", SKV_CFG_BOOL, OPT(persist), "no", 0, 0,
     "save every session (and the kept prefixes of prefix-retain-bytes) to <state-dir>/persist at stop and "
     "restore them, with their ids, tenants, pins and leases, at start, so a restart loses no cache"},
    {"persist-max-seconds", SKV_CFG_INT, OPT(persist_max_seconds), "30", 1, 3600,
     "the longest the save at stop may take (pinned sessions first, then the most recently used; the rest "
     "are lost; keep it under the unit's TimeoutStopSec)"},
    {"persist-interval-seconds", SKV_CFG_INT, OPT(persist_interval_seconds), "0", 0, 86400,
     "with persist, also save the sessions (a checkpoint, which writes only the sessions and KV blocks that "
     "changed since the last) when the engine is idle and this long has passed since the last, so a crash "
     "loses only what changed since; a request that arrives meanwhile stops the checkpoint (the last one "
     "stays), three times in a row at most; past twice the interval one runs even while busy; 0: at stop only"},
    {"log-level", SKV_CFG_STRING, OPT(log_level), "info", 0, 0, "error, warn, info or debug"},
    {"log-file", SKV_CFG_STRING, OPT(log_file), "", 0, 0, "log file (empty: stderr / journald)"},
    {"foreground", SKV_CFG_BOOL, OPT(foreground), "yes", 0, 0,
     "stays in the foreground, always (yes only: it does not detach itself; systemd runs it so)"},
    {"max-prompt-tokens", SKV_CFG_INT, OPT(max_prompt_tokens), "8192", 1, 1 << 24, "longest prompt accepted"},
    {"max-new-tokens", SKV_CFG_INT, OPT(max_new_tokens), "2048", 1, 1 << 24, "most tokens one DECODE may generate"},
    {"max-decodes", SKV_CFG_INT, OPT(max_decodes), "256", 1, 1 << 16,
     "DECODEs running at once over the daemon (one more is refused: busy)"},
    {"decode-yield-ms", SKV_CFG_INT, OPT(decode_yield_ms), "100", 0, 3600000,
     "a PREFILL, APPEND or COMPRESS of 64 tokens or more stops inside its layers to give every "
     "running DECODE its next token once this many ms passed since their last one (0: at every point it can)"},
    {"decode-share", SKV_CFG_INT, OPT(decode_share), "25", 0, 100,
     "while such a forward runs, running DECODEs get up to this percent of the engine's time: their next "
     "round comes once the time since the last one is (100 - share) / share of that round's own, if that is "
     "sooner than decode-yield-ms (0: every decode-yield-ms only)"},
    {"max-decodes-per-tenant", SKV_CFG_INT, OPT(max_decodes_per_tenant), "32", 1, 1 << 16,
     "DECODEs one tenant may run at once (one more is refused: busy)"},
    {"max-sessions-per-tenant", SKV_CFG_INT, OPT(max_sessions_per_tenant), "64", 1, 1 << 20,
     "sessions one tenant may hold"},
    {"max-sessions", SKV_CFG_INT, OPT(max_sessions), "16384", 1, 1 << 24,
     "sessions all tenants together may hold (each holds its next-token logits in host memory, also a FORK "
     "that shares every KV block)"},
    {"max-bytes-per-tenant", SKV_CFG_SIZE, OPT(max_bytes_per_tenant), "512M", 1 << 16, INT64_C(1) << 42,
     "bytes one tenant's sessions may hold (KV blocks and SnapKV re-scoring's query rings)"},
    {"max-message-bytes", SKV_CFG_SIZE, OPT(max_message_bytes), "16M", 1024, INT64_C(1) << 31,
     "largest request message (ZMQ_MAXMSGSIZE)"},
    {"max-reply-bytes-per-client", SKV_CFG_SIZE, OPT(max_reply_bytes_per_client), "64M", 1 << 20, INT64_C(1) << 42,
     "bytes of replies a client has not read yet that the daemon holds; past it its replies are dropped "
     "(libzmq's own bound is queue-depth + 5096 messages a client, whatever their size)"},
    {"max-reply-bytes-per-peer", SKV_CFG_SIZE, OPT(max_reply_bytes_per_peer), "256M", 1 << 20, INT64_C(1) << 42,
     "bytes of replies not read yet the daemon holds for all the clients of one user (ipc://) or address "
     "(tcp://); past it their replies are dropped, so one user's clients cannot fill max-reply-bytes"},
    {"max-reply-bytes", SKV_CFG_SIZE, OPT(max_reply_bytes), "1G", 1 << 20, INT64_C(1) << 42,
     "bytes of replies not read yet the daemon holds for all clients together; past it replies are dropped "
     "(the admin endpoint's are not held to it)"},
    {"max-connections", SKV_CFG_INT, OPT(max_connections), "1024", 1, 1 << 20,
     "open connections on the client endpoint; more are closed as they come"},
    {"max-connections-per-peer", SKV_CFG_INT, OPT(max_connections_per_peer), "256", 1, 1 << 20,
     "open connections one peer may hold on the client endpoint: a user on ipc:// (its uid), an address on "
     "tcp:// (IPv6: its /64); more are closed as they come (a service running more clients as one user raises "
     "it). With max-message-bytes it bounds the whole requests libzmq may buffer "
     "for one peer: 5 x max-message-bytes a connection (a multipart message's frames before its last are not "
     "bounded by libzmq: see MemoryMax in the systemd unit)"},
    {"queue-depth", SKV_CFG_INT, OPT(queue_depth), "256", 1, 1 << 16, "requests waiting for the engine"},
    {"max-queued-bytes", SKV_CFG_SIZE, OPT(max_queued_bytes), "256M", 1 << 16, INT64_C(1) << 42,
     "memory the requests waiting for the engine may hold together (their unpacked size)"},
    {"queue-depth-per-tenant", SKV_CFG_INT, OPT(queue_depth_per_tenant), "64", 1, 1 << 16,
     "requests of one tenant waiting for the engine (the admin endpoint's are not counted)"},
    {"max-queued-bytes-per-tenant", SKV_CFG_SIZE, OPT(max_queued_bytes_per_tenant), "64M", 1 << 16, INT64_C(1) << 42,
     "memory one tenant's waiting requests may hold together"},
    {"max-text-bytes", SKV_CFG_SIZE, OPT(max_text_bytes), "0", 0, INT64_C(1) << 31,
     "longest PREFILL / APPEND text; 0: the token limit times the model's longest token, which no "
     "text that fits the limit is longer than"},
    {"lease-seconds", SKV_CFG_INT, OPT(lease_seconds), "600", 1, INT64_C(1) << 31,
     "an unpinned session idle this long is released (when its PREFILL names no lease)"},
    {"max-lease-seconds", SKV_CFG_INT, OPT(max_lease_seconds), "86400", 1, INT32_MAX,
     "longest lease a PREFILL may ask for (at least lease-seconds)"},
    {"store", SKV_CFG_STRING, OPT(store), "", 0, 0,
     "a shared store for cold sessions, redis://HOST[:PORT][/DB] or unix://PATH (Redis or Valkey): a session "
     "evicted or past its lease is written there instead of dropped, and a request naming a session this "
     "daemon does not hold takes it from there, on this host or another with the same model; \"\" off"},
    {"store-keep-seconds", SKV_CFG_INT, OPT(store_keep_seconds), "3600", 1, INT32_MAX,
     "how long the store keeps a spilled session nobody takes back"},
    {"store-max-bytes", SKV_CFG_SIZE, OPT(store_max_bytes), "512M", 1 << 20, INT64_C(1) << 40,
     "the largest session spilled to the store (a larger one is dropped, as without a store); Redis refuses "
     "values over its proto-max-bulk-len, 512M by default"},
    {"store-max-bytes-per-tenant", SKV_CFG_SIZE, OPT(store_max_bytes_per_tenant), "2G", 1 << 20, INT64_C(1) << 42,
     "the bytes one tenant's sessions this daemon spilled may hold in the store until taken back, released or "
     "expired (store-keep-seconds); past it an evicted session of the tenant is dropped, not spilled"},
    {"store-user", SKV_CFG_STRING, OPT(store_user), "", 0, 0,
     "the user the daemon logs in to the store as (Redis 6 ACL); \"\": the default user. Needs "
     "store-password-file"},
    {"store-password-file", SKV_CFG_STRING, OPT(store_password_file), "", 0, 0,
     "a file holding the store's password (one line), sent with AUTH on each new connection and read "
     "then, so a rotated password is used from the next connection; neither other users nor its group (the "
     "clients share the daemon's) may read it, root's group excepted (chmod 0600; systemd's LoadCredential= "
     "gives such a file). \"\": no AUTH"},
    {"store-secret-file", SKV_CFG_STRING, OPT(store_secret_file), "", 0, 0,
     "a file holding a secret (one line, at least 16 bytes; the same on every daemon sharing the store) "
     "with which spilled sessions are signed, bound to their tenant and id: a value not signed with it "
     "(written by someone else, or moved to another tenant's key) does not load. Checked as "
     "store-password-file, and not the password; read at start (a new secret needs a restart). \"\": values "
     "are not signed, and signatures are not checked"},
    {"store-accept-secret-file", SKV_CFG_STRING, OPT(store_accept_secret_file), "", 0, 0,
     "a second secret, checked as store-secret-file, whose signatures a take accepts too (values are signed "
     "with store-secret-file only), for a rotation without dropping what is stored: give every daemon the new "
     "secret here and restart them one by one, then swap the two files and restart them again, then empty this "
     "one once no value signed with the old secret is left (store-keep-seconds). Needs store-secret-file. \"\": "
     "only store-secret-file's signatures load"},
    {"store-timeout-ms", SKV_CFG_INT, OPT(store_timeout_ms), "1000", 10, 60000,
     "the longest the engine waits for the store: for a connect, and for a command with its reply, plus as "
     "much again for each MiB of the value it sends or receives; after a failed "
     "connect none is tried for 1 s, then 2, 4, ... 30 s while it fails, and sessions evicted meanwhile are "
     "dropped; keep it below half the unit's WatchdogSec (one wait on the store is at most this long)"},
    {"default-compress", SKV_CFG_STRING, OPT(default_compress), "policy=full", 0, 0,
     "compression spec used when a request names none"},
    {"ipc-tenant", SKV_CFG_STRING, OPT(ipc_tenant), "claimed", 0, 0,
     "on an ipc:// client endpoint, the tenant a client names (claimed) or its user's (uid: \"uid-1000\")"},
    {"queue-order", SKV_CFG_STRING, OPT(queue_order), "fair", 0, 0,
     "which waiting request the engine runs next: fair (the one of the tenant that had the least engine "
     "time, so one tenant's backlog does not hold up the others) or fifo (the oldest)"},
    {"tenant-weights", SKV_CFG_STRING, OPT(tenant_weights), "", 0, 0,
     "with queue-order = fair, tenants' shares of the engine's time: NAME:W,... (W 1..100; others 1); "
     "a tenant of weight 4 gets four times the time of one of weight 1 while both wait"},
    {"fair-slice-ms", SKV_CFG_INT, OPT(fair_slice_ms), "200", 0, 3600000,
     "with queue-order = fair, a PREFILL, APPEND or COMPRESS of 64 tokens or more that has had this much "
     "engine time (divided by its tenant's weight) more than another tenant lets that tenant's waiting "
     "request run inside it, at its next tick, on an engine of its own (0: never; the request waits for it)"},
};

const struct skv_config_option *skv_config_options(size_t *n)
{
    *n = sizeof options / sizeof options[0];
    return options;
}

static const struct skv_config_option *find_option(const char *name)
{
    for (size_t i = 0; i < sizeof options / sizeof options[0]; i++)
        if (strcmp(options[i].name, name) == 0)
            return &options[i];
    return NULL;
}

int skv_parse_size(const char *text, int64_t *out)
{
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (end == text || errno || !(v >= 0)) /* NaN fails every comparison */
        return skv_errorf(SKV_E_INVAL, "'%s' is not a size", text);
    double mul = 1;
    switch (toupper((unsigned char)*end)) {
    case 'K': mul = 1024.0; end++; break;
    case 'M': mul = 1024.0 * 1024; end++; break;
    case 'G': mul = 1024.0 * 1024 * 1024; end++; break;
    case 'T': mul = 1024.0 * 1024 * 1024 * 1024; end++; break;
    default: break;
    }
    if (*end == 'i' || *end == 'B')
        end += (*end == 'i' && end[1] == 'B') ? 2 : 1;
    if (*end != '\0')
        return skv_errorf(SKV_E_INVAL, "'%s' is not a size (use e.g. 512M, 4G)", text);
    v *= mul;
    if (!(v <= 9.0e18))
        return skv_errorf(SKV_E_INVAL, "'%s' is too large", text);
    *out = (int64_t)v;
    return SKV_OK;
}

static int parse_bool(const char *text, bool *out)
{
    static const char *const yes[] = {"1", "yes", "true", "on"};
    static const char *const no[] = {"0", "no", "false", "off"};
    for (int i = 0; i < 4; i++) {
        if (strcasecmp(text, yes[i]) == 0)
            return *out = true, SKV_OK;
        if (strcasecmp(text, no[i]) == 0)
            return *out = false, SKV_OK;
    }
    return skv_errorf(SKV_E_INVAL, "'%s' is not a boolean (yes/no)", text);
}

/* HOST:PORT, [V6]:PORT: the form metrics-listen binds (the address itself is resolved then). */
static bool listen_form_ok(const char *v)
{
    const char *colon = strrchr(v, ':');
    if (!colon || colon == v || (*v == '[' && (colon[-1] != ']' || colon == v + 2)))
        return false;
    size_t digits = strspn(colon + 1, "0123456789");
    long port = digits && digits <= 5 && !colon[1 + digits] ? strtol(colon + 1, NULL, 10) : 0;
    return port >= 1 && port <= 65535;
}

/* Options whose value has a form of its own, checked where it is set, so that a config file's
 * mistake names its line and stops the start before the model loads. */
static int check_value(const char *name, const char *v)
{
    if (strcmp(name, "log-level") == 0 && skv_log_level_parse(v) < 0)
        return skv_errorf(SKV_E_INVAL, "'%s' is not error, warn, info or debug", v);
    if (strcmp(name, "ipc-tenant") == 0 && strcmp(v, "claimed") != 0 && strcmp(v, "uid") != 0)
        return skv_errorf(SKV_E_INVAL, "'%s' is not claimed or uid", v);
    if (strcmp(name, "kv-type") == 0 && skv_kv_type_parse(v) < 0)
        return skv_errorf(SKV_E_INVAL, "'%s' is not f32, f16 or q8_0", v);
    if (strcmp(name, "queue-order") == 0 && strcmp(v, "fair") != 0 && strcmp(v, "fifo") != 0)
        return skv_errorf(SKV_E_INVAL, "'%s' is not fair or fifo", v);
    if (strcmp(name, "metrics-listen") == 0 && *v && !listen_form_ok(v))
        return skv_errorf(SKV_E_INVAL, "'%s' is not HOST:PORT (e.g. 127.0.0.1:9464), port 1..65535", v);
    if (strcmp(name, "tenant-weights") == 0) {
        struct skv_tenant_weight tw[SKV_TENANT_WEIGHTS_MAX];
        int n;
        return skv_tenant_weights_parse(v, tw, &n);
    }
    if (strcmp(name, "default-compress") == 0 && *v) {
        struct skv_compress_spec spec;
        return skv_compress_spec_parse(v, &spec);
    }
    bool yes;
    if (strcmp(name, "foreground") == 0 && parse_bool(v, &yes) == SKV_OK && !yes)
        return skv_errorf(SKV_E_INVAL, "snapkvd does not detach itself: run it under systemd (Type=notify), or "
                          "with & from a shell");
    return SKV_OK;
}

static int set_option(struct skv_config *cfg, const struct skv_config_option *o, const char *value)
{
    char *base = (char *)cfg + o->offset;
    int64_t v;
    int rc = check_value(o->name, value);
    if (rc) {
        char why[512];
        snprintf(why, sizeof why, "%s", skv_error_msg());
        size_t n = strlen(o->name); /* a message that names the option already is kept as it is */
        bool named = strncmp(why, o->name, n) == 0 && why[n] == ':';
        return skv_errorf(rc, "%s%s%s", named ? "" : o->name, named ? "" : ": ", why);
    }
    switch (o->type) {
    case SKV_CFG_STRING: {
        char *copy = strdup(value);
        if (!copy)
            return SKV_E_NOMEM;
        free(*(char **)base);
        *(char **)base = copy;
        return SKV_OK;
    }
    case SKV_CFG_BOOL:
        rc = parse_bool(value, (bool *)base);
        return rc ? skv_errorf(rc, "%s: '%s' is not a boolean (yes/no)", o->name, value) : SKV_OK;
    case SKV_CFG_INT: {
        char *end;
        errno = 0;
        long long ll = strtoll(value, &end, 10);
        if (end == value || *end || errno)
            return skv_errorf(SKV_E_INVAL, "%s: '%s' is not an integer", o->name, value);
        v = ll;
        break;
    }
    case SKV_CFG_SIZE:
        rc = skv_parse_size(value, &v);
        if (rc)
            return skv_errorf(rc, "%s: '%s' is not a size (e.g. 512M, 4G)", o->name, value);
        break;
    default:
        return SKV_E_INTERNAL;
    }
    if (v < o->min || v > o->max)
        return skv_errorf(SKV_E_INVAL, "%s: %" PRId64 " is outside [%" PRId64 ", %" PRId64 "]", o->name, v,
                          o->min, o->max);
    *(int64_t *)base = v;
    return SKV_OK;
}

int skv_config_set(struct skv_config *cfg, const char *name, const char *value)
{
    const struct skv_config_option *o = find_option(name);
    if (!o)
        return skv_errorf(SKV_E_NOT_FOUND, "unknown option '%s'", name);
    return set_option(cfg, o, value);
}

int skv_config_init(struct skv_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    for (size_t i = 0; i < sizeof options / sizeof options[0]; i++) {
        int rc = set_option(cfg, &options[i], options[i].default_value);
        if (rc) {
            skv_config_free(cfg);
            return rc;
        }
    }
    return SKV_OK;
}

void skv_config_free(struct skv_config *cfg)
{
    for (size_t i = 0; i < sizeof options / sizeof options[0]; i++)
        if (options[i].type == SKV_CFG_STRING) {
            char **p = (char **)((char *)cfg + options[i].offset);
            free(*p);
            *p = NULL;
        }
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1]))
        *--e = '\0';
    return s;
}

int skv_config_load_file(struct skv_config *cfg, const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return skv_errorf(SKV_E_IO, "%s: %s", path, strerror(errno));
    char line[4096];
    int lineno = 0, rc = SKV_OK;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        if (!strchr(line, '\n') && !feof(f)) {
            rc = skv_errorf(SKV_E_INVAL, "%s:%d: line too long", path, lineno);
            break;
        }
        /* a comment starts a line or follows a blank: a '#' inside a value (a path) stays */
        for (char *hash = line; (hash = strchr(hash, '#')); hash++)
            if (hash == line || *(hash - 1) == ' ' || *(hash - 1) == '\t') {
                *hash = '\0';
                break;
            }
        char *s = trim(line);
        if (!*s)
            continue;
        char *eq = strchr(s, '=');
        if (!eq) {
            rc = skv_errorf(SKV_E_INVAL, "%s:%d: expected 'key = value'", path, lineno);
            break;
        }
        *eq = '\0';
        char *key = trim(s), *value = trim(eq + 1);
        if (strcmp(key, "config") == 0) {
            rc = skv_errorf(SKV_E_INVAL, "%s:%d: 'config' cannot be set in a config file", path, lineno);
            break;
        }
        rc = skv_config_set(cfg, key, value);
        if (rc) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", skv_error_msg());
            rc = skv_errorf(rc, "%s:%d: %s", path, lineno, msg);
            break;
        }
    }
    fclose(f);
    return rc;
}

int skv_config_check(const struct skv_config *cfg)
{
    /* a default lease no client could ask for would make the limit a lie for every session
     * that names none */
    if (cfg->lease_seconds > cfg->max_lease_seconds)
        return skv_errorf(SKV_E_INVAL,
                          "lease-seconds is %" PRId64 ", more than max-lease-seconds (%" PRId64
                          "): raise max-lease-seconds or lower lease-seconds",
                          cfg->lease_seconds, cfg->max_lease_seconds);
    if (*cfg->events_endpoint && strncmp(cfg->events_endpoint, "ipc://", 6) != 0)
        return skv_errorf(SKV_E_INVAL, "events-endpoint is ipc:// only (the events name every tenant's sessions, "
                          "and a tcp:// one would need CURVE): '%s'", cfg->events_endpoint);
    if (*cfg->events_replay_endpoint && strncmp(cfg->events_replay_endpoint, "ipc://", 6) != 0)
        return skv_errorf(SKV_E_INVAL, "events-replay-endpoint is ipc:// only, as events-endpoint: '%s'",
                          cfg->events_replay_endpoint);
    if (*cfg->events_replay_endpoint && !*cfg->events_endpoint)
        return skv_errorf(SKV_E_INVAL, "events-replay-endpoint replays what events-endpoint publishes: set "
                          "events-endpoint too");
    if ((*cfg->store_user || *cfg->store_password_file || *cfg->store_secret_file ||
         *cfg->store_accept_secret_file) && !*cfg->store)
        return skv_errorf(SKV_E_INVAL, "%s is the shared store's, and store is off: set store too",
                          *cfg->store_user            ? "store-user"
                          : *cfg->store_password_file ? "store-password-file"
                          : *cfg->store_secret_file   ? "store-secret-file"
                                                      : "store-accept-secret-file");
    if (*cfg->store_accept_secret_file && !*cfg->store_secret_file)
        return skv_errorf(SKV_E_INVAL, "store-accept-secret-file is a second secret next to store-secret-file, "
                          "which is not set: set store-secret-file too");
    return SKV_OK; /* single values (ipc-tenant, queue-order, tenant-weights ...): check_value */
}

bool skv_tenant_name_ok(const char *name)
{
    size_t n = strlen(name);
    if (n == 0 || n >= sizeof ((struct skv_tenant_weight *)NULL)->name)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)name[i]) && !strchr("._-@", name[i]))
            return false;
    return true;
}

int skv_tenant_weights_parse(const char *text, struct skv_tenant_weight *out, int *n)
{
    *n = 0;
    for (const char *p = text ? text : ""; *p;) {
        size_t len = strcspn(p, ",");
        const char *colon = memchr(p, ':', len);
        size_t name_len = colon ? (size_t)(colon - p) : len;
        if (*n == SKV_TENANT_WEIGHTS_MAX)
            return skv_errorf(SKV_E_INVAL, "tenant-weights: more than %d tenants", SKV_TENANT_WEIGHTS_MAX);
        struct skv_tenant_weight *w = &out[*n];
        if (!colon || name_len == 0 || name_len >= sizeof w->name)
            return skv_errorf(SKV_E_INVAL, "tenant-weights: '%.*s' is not NAME:WEIGHT", (int)len, p);
        memcpy(w->name, p, name_len);
        w->name[name_len] = '\0';
        if (!skv_tenant_name_ok(w->name))
            return skv_errorf(SKV_E_INVAL, "tenant-weights: '%s' is not a tenant name (letters, digits, . _ - @)",
                              w->name);
        char num[16] = "";
        size_t num_len = len - name_len - 1;
        char *end = NULL;
        long v = 0;
        if (num_len > 0 && num_len < sizeof num) {
            memcpy(num, colon + 1, num_len);
            num[num_len] = '\0';
            v = strtol(num, &end, 10);
        }
        if (!end || *end || v < 1 || v > SKV_TENANT_WEIGHT_MAX)
            return skv_errorf(SKV_E_INVAL, "tenant-weights: the weight of '%s' is an integer from 1 to %d, not '%.*s'",
                              w->name, SKV_TENANT_WEIGHT_MAX, (int)num_len, colon + 1);
        for (int i = 0; i < *n; i++)
            if (strcmp(out[i].name, w->name) == 0)
                return skv_errorf(SKV_E_INVAL, "tenant-weights: '%s' is named twice", w->name);
        w->weight = (int)v;
        (*n)++;
        p += len + (p[len] == ',');
    }
    return SKV_OK;
}

int skv_config_get(const struct skv_config *cfg, const char *name, char *buf, size_t cap)
{
    const struct skv_config_option *o = find_option(name);
    if (!o)
        return skv_errorf(SKV_E_NOT_FOUND, "unknown option '%s'", name);
    const char *base = (const char *)cfg + o->offset;
    switch (o->type) {
    case SKV_CFG_STRING:
        snprintf(buf, cap, "%s", *(char *const *)base ? *(char *const *)base : "");
        break;
    case SKV_CFG_BOOL:
        snprintf(buf, cap, "%s", *(const bool *)base ? "yes" : "no");
        break;
    case SKV_CFG_INT:
    case SKV_CFG_SIZE:
        snprintf(buf, cap, "%" PRId64, *(const int64_t *)base);
        break;
    }
    return SKV_OK;
}
