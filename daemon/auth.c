/* CURVE on tcp:// endpoints (see auth.h): endpoint policy, the daemon's key pair, the
 * authorized keys lists, the ZAP handler (RFC 27) and handshake-failure logging. */
#include "daemon/auth.h"
#include "common/keyfile.h"
#include "common/log.h"
#include "common/status.h"
#include "daemon/replies.h"
#include "daemon/session.h"

#include <errno.h>
#include <sodium.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#define ZAP_ENDPOINT "inproc://zeromq.zap.01"
#define LOG_INTERVAL_MS 10000    /* one warning per 10 s for a repeated failure */
#define MAX_AUTHORIZED_KEYS 65536

enum endpoint_mode { MODE_IPC, MODE_CURVE, MODE_INSECURE_TCP };

static const char *const endpoint_names[2] = {"client", "admin"};
static const char *const list_options[2] = {"curve-authorized-keys", "admin-authorized-keys"};

struct authorized_key {
    unsigned char key[SKV_KEY_BYTES];
    char tenant[SKV_TENANT_MAX];  /* "" when the key may act for any tenant */
};

struct key_list {
    char *path;
    struct authorized_key *keys;
    size_t n;
};

/* Rate limit for a log line: the same `what` at most once per LOG_INTERVAL_MS, and at most
 * LOG_BURST lines of any `what` per LOG_INTERVAL_MS (alternating two refused keys logged every
 * attempt before, and journald's rate limit then dropped the service's other lines). */
struct log_limit {
    uint64_t last_ms, last_what;
    uint64_t window_ms; /* the current window's start */
    unsigned in_window;
    unsigned suppressed;
};

#define LOG_BURST 5

struct skv_auth {
    enum endpoint_mode mode[2];
    char *endpoint[2];
    char secret_z85[SKV_KEY_Z85_LEN + 1];
    char public_z85[SKV_KEY_Z85_LEN + 1];
    struct key_list lists[2];       /* authorized keys per CURVE endpoint */
    void *zctx;
    void *zap;                      /* REP bound on ZAP_ENDPOINT */
    struct log_limit refused, handshake[2];
};

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* True when a warning about `what` may be logged now; otherwise counts it as suppressed. */
static bool log_allowed(struct log_limit *l, uint64_t what)
{
    uint64_t now = mono_ms();
    if (!l->window_ms || now - l->window_ms >= LOG_INTERVAL_MS) {
        l->window_ms = now;
        l->in_window = 0;
    }
    if ((l->last_ms && what == l->last_what && now - l->last_ms < LOG_INTERVAL_MS) || l->in_window >= LOG_BURST) {
        l->suppressed++;
        return false;
    }
    l->in_window++;
    l->last_ms = now;
    l->last_what = what;
    return true;
}

static void key_list_free(struct key_list *l)
{
    free(l->path);
    free(l->keys);
    *l = (struct key_list){0};
}

static int by_key(const void *x, const void *y)
{
    return memcmp(((const struct authorized_key *)x)->key, ((const struct authorized_key *)y)->key, SKV_KEY_BYTES);
}

/* Reads "KEY [TENANT]" lines; admin lists take no tenants. */
static int key_list_load(const char *path, bool tenants_allowed, struct key_list *out)
{
    FILE *f;
    int rc = skv_keyfile_open(path, SKV_KEYFILE_LIST, &f);
    if (rc)
        return rc;
    struct key_list l = {.path = strdup(path)};
    size_t cap = 0;
    char line[512], *word, *rest;
    int lineno = 0, more;
    if (!l.path)
        rc = SKV_E_NOMEM;
    while (!rc && (more = skv_keyfile_next(f, path, line, sizeof line, &lineno, &word, &rest)) != 0) {
        if (more < 0) {
            rc = more;
            break;
        }
        struct authorized_key k = {0};
        char *tenant_end = rest;
        while (*tenant_end && *tenant_end != ' ' && *tenant_end != '\t')
            tenant_end++;
        if (!skv_key_z85_decode(word, k.key)) {
            rc = skv_errorf(SKV_E_FORMAT, "%s:%d: '%.48s' is not a Z85 CURVE public key (40 characters)", path,
                            lineno, word);
        } else if (*tenant_end) {
            rc = skv_errorf(SKV_E_FORMAT, "%s:%d: expected 'KEY [TENANT]'", path, lineno);
        } else if (*rest && !tenants_allowed) {
            rc = skv_errorf(SKV_E_FORMAT, "%s:%d: admin keys are not bound to a tenant", path, lineno);
        } else if (*rest && skv_session_check_tenant(rest)) {
            char msg[256];
            snprintf(msg, sizeof msg, "%s", skv_error_msg());
            rc = skv_errorf(SKV_E_FORMAT, "%s:%d: %s", path, lineno, msg);
        } else if (l.n == MAX_AUTHORIZED_KEYS) {
            rc = skv_errorf(SKV_E_LIMIT, "%s: more than %d keys", path, MAX_AUTHORIZED_KEYS);
        }
        if (rc)
            break;
        snprintf(k.tenant, sizeof k.tenant, "%s", rest);
        if (l.n == cap) {
            size_t ncap = cap ? 2 * cap : 16;
            struct authorized_key *grown = realloc(l.keys, ncap * sizeof *grown);
            if (!grown) {
                rc = SKV_E_NOMEM;
                break;
            }
            l.keys = grown;
            cap = ncap;
        }
        l.keys[l.n++] = k;
    }
    fclose(f);
    /* no keys is a list too: every client refused (one emptied to revoke its last key was
     * refused, and a reload kept the old one); sorted: looked up at every handshake and request
     * (bsearch) */
    if (!rc && l.n)
        qsort(l.keys, l.n, sizeof *l.keys, by_key);
    for (size_t i = 1; !rc && i < l.n; i++)
        if (memcmp(l.keys[i - 1].key, l.keys[i].key, SKV_KEY_BYTES) == 0) {
            char z85[SKV_KEY_Z85_LEN + 1];
            zmq_z85_encode(z85, l.keys[i].key, SKV_KEY_BYTES);
            rc = skv_errorf(SKV_E_FORMAT, "%s: key %s listed twice", path, z85);
        }
    if (rc) {
        key_list_free(&l);
        return rc;
    }
    *out = l;
    return SKV_OK;
}

static const struct authorized_key *key_find(const struct key_list *l, const unsigned char *key)
{
    struct authorized_key probe;
    memcpy(probe.key, key, SKV_KEY_BYTES);
    return l->n ? bsearch(&probe, l->keys, l->n, sizeof *l->keys, by_key) : NULL;
}

int skv_auth_key_check(const struct skv_auth *a, enum skv_auth_endpoint which, const char *z85, const char **tenant)
{
    unsigned char key[SKV_KEY_BYTES];
    const struct authorized_key *k =
        a->mode[which] == MODE_CURVE && skv_key_z85_decode(z85, key) ? key_find(&a->lists[which], key) : NULL;
    if (!k)
        return skv_errorf(SKV_E_PERM, "this client's CURVE key is no longer in %s (removed at a reload)",
                          a->lists[which].path ? a->lists[which].path : "the authorized keys");
    *tenant = k->tenant;
    return SKV_OK;
}

static const char *list_path(const struct skv_config *cfg, enum skv_auth_endpoint which)
{
    return which == SKV_AUTH_CLIENT ? cfg->curve_authorized_keys : cfg->admin_authorized_keys;
}

static int endpoint_mode(const struct skv_config *cfg, enum skv_auth_endpoint which, const char *endpoint,
                         enum endpoint_mode *out)
{
    const char *name = endpoint_names[which];
    if (strncmp(endpoint, "ipc://", 6) == 0) {
        *out = MODE_IPC;
        return SKV_OK;
    }
    if (strncmp(endpoint, "tcp://", 6) != 0)
        return skv_errorf(SKV_E_UNSUPPORTED, "%s endpoint %s: only ipc:// and tcp:// endpoints are served", name,
                          endpoint);
    if (*cfg->curve_secret_key) {
        if (!*list_path(cfg, which))
            return skv_errorf(SKV_E_INVAL, "%s endpoint %s uses CURVE: set %s (the public keys allowed to connect)",
                              name, endpoint, list_options[which]);
        *out = MODE_CURVE;
        return SKV_OK;
    }
    if (cfg->allow_insecure_tcp) {
        *out = MODE_INSECURE_TCP;
        return SKV_OK;
    }
    return skv_errorf(SKV_E_INVAL,
                      "%s endpoint %s: tcp:// needs CURVE: set curve-secret-key and %s ('snapkvctl keygen' makes "
                      "keys), or allow-insecure-tcp=yes on a trusted network",
                      name, endpoint, list_options[which]);
}

int skv_auth_new(const struct skv_config *cfg, struct skv_auth **out)
{
    struct skv_auth *a = calloc(1, sizeof *a);
    if (!a)
        return SKV_E_NOMEM;
    const char *endpoints[2] = {cfg->endpoint, cfg->admin_endpoint};
    bool curve = false;
    int rc = SKV_OK;
    for (int i = 0; i < 2 && !rc; i++) {
        rc = endpoint_mode(cfg, (enum skv_auth_endpoint)i, endpoints[i], &a->mode[i]);
        if (!rc && !(a->endpoint[i] = strdup(endpoints[i])))
            rc = SKV_E_NOMEM;
        curve |= a->mode[i] == MODE_CURVE;
    }
    if (!rc && curve && !zmq_has("curve"))
        rc = skv_errorf(SKV_E_UNSUPPORTED, "this libzmq was built without CURVE (zmq_has(\"curve\") is false): "
                                           "tcp:// endpoints cannot be secured; use ipc:// or a libzmq with libsodium");
    if (!rc && curve && !(rc = skv_keyfile_read(cfg->curve_secret_key, SKV_KEYFILE_DAEMON_SECRET, a->secret_z85)) &&
        zmq_curve_public(a->public_z85, a->secret_z85) != 0)
        rc = skv_errorf(SKV_E_INVAL, "%s: cannot derive the public key: %s", cfg->curve_secret_key,
                        zmq_strerror(zmq_errno()));
    for (int i = 0; i < 2 && !rc; i++)
        if (a->mode[i] == MODE_CURVE)
            rc = key_list_load(list_path(cfg, (enum skv_auth_endpoint)i), i == SKV_AUTH_CLIENT, &a->lists[i]);
    if (rc) {
        skv_auth_destroy(&a);
        return rc;
    }
    *out = a;
    return SKV_OK;
}

void skv_auth_destroy(struct skv_auth **auth_p)
{
    if (!auth_p || !*auth_p)
        return;
    struct skv_auth *a = *auth_p;
    if (a->zap)
        zmq_close(a->zap);
    for (int i = 0; i < 2; i++) {
        key_list_free(&a->lists[i]);
        free(a->endpoint[i]);
    }
    sodium_memzero(a->secret_z85, sizeof a->secret_z85);
    free(a);
    *auth_p = NULL;
}

bool skv_auth_uses_curve(const struct skv_auth *a, enum skv_auth_endpoint which)
{
    return a->mode[which] == MODE_CURVE;
}

int skv_auth_start(struct skv_auth *a, void *zctx)
{
    a->zctx = zctx;
    for (int i = 0; i < 2; i++)
        if (a->mode[i] == MODE_INSECURE_TCP)
            skv_log(SKV_LOG_WARN, "%s endpoint %s: tcp:// WITHOUT CURVE (allow-insecure-tcp): anyone who can reach "
                                  "it is served, in clear text",
                    endpoint_names[i], a->endpoint[i]);
    if (!skv_auth_uses_curve(a, SKV_AUTH_CLIENT) && !skv_auth_uses_curve(a, SKV_AUTH_ADMIN))
        return SKV_OK;
    a->zap = zmq_socket(zctx, ZMQ_REP);
    if (!a->zap || zmq_bind(a->zap, ZAP_ENDPOINT) < 0)
        return skv_errorf(SKV_E_IO, "ZAP handler %s: %s", ZAP_ENDPOINT, zmq_strerror(zmq_errno()));
    int linger = 0;
    zmq_setsockopt(a->zap, ZMQ_LINGER, &linger, sizeof linger);
    skv_log(SKV_LOG_INFO, "CURVE server public key %s (give it to clients)", a->public_z85);
    return SKV_OK;
}

#define HANDSHAKE_EVENTS (ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL)

int skv_auth_secure_socket(struct skv_auth *a, void *sock, enum skv_auth_endpoint which, int *monitor_events)
{
    *monitor_events = 0;
    if (a->mode[which] != MODE_CURVE)
        return SKV_OK;
    int one = 1;
    const char *domain = endpoint_names[which];
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVER, &one, sizeof one) < 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, a->secret_z85, SKV_KEY_Z85_LEN + 1) < 0 ||
        zmq_setsockopt(sock, ZMQ_ZAP_DOMAIN, domain, strlen(domain)) < 0)
        return skv_errorf(SKV_E_IO, "%s endpoint: CURVE options: %s", domain, zmq_strerror(zmq_errno()));
    *monitor_events = HANDSHAKE_EVENTS; /* the caller monitors the socket */
    skv_log(a->lists[which].n ? SKV_LOG_INFO : SKV_LOG_WARN, "%s endpoint %s: CURVE, %zu authorized key(s) from %s%s",
            domain, a->endpoint[which], a->lists[which].n, a->lists[which].path,
            a->lists[which].n ? "" : ": every client is refused");
    return SKV_OK;
}

size_t skv_auth_sockets(const struct skv_auth *a, void **socks)
{
    size_t n = 0;
    if (a->zap)
        socks[n++] = a->zap;
    return n;
}

static bool frame_is(zmq_msg_t *m, const char *text)
{
    size_t n = strlen(text);
    return zmq_msg_size(m) == n && memcmp(zmq_msg_data(m), text, n) == 0;
}

/* Copies a frame into a NUL-terminated string (truncated to cap). */
static void frame_text(zmq_msg_t *m, char *buf, size_t cap)
{
    size_t n = zmq_msg_size(m) < cap - 1 ? zmq_msg_size(m) : cap - 1;
    memcpy(buf, zmq_msg_data(m), n);
    buf[n] = '\0';
}

/* The decision on one ZAP request; *user_id is the bound tenant ("" when none). */
static const char *zap_decide(struct skv_auth *a, zmq_msg_t *f, int n, const char **user_id)
{
    enum { VERSION, REQUEST_ID, DOMAIN, ADDRESS, IDENTITY, MECHANISM, CREDENTIALS };
    char domain[16] = "", address[64] = "", key_z85[SKV_KEY_Z85_LEN + 1] = "?";
    *user_id = "";
    if (n != 7 || !frame_is(&f[VERSION], "1.0"))
        return "malformed ZAP request";
    frame_text(&f[DOMAIN], domain, sizeof domain);
    frame_text(&f[ADDRESS], address, sizeof address);
    int which = strcmp(domain, "client") == 0 ? SKV_AUTH_CLIENT : strcmp(domain, "admin") == 0 ? SKV_AUTH_ADMIN : -1;
    if (which < 0 || a->mode[which] != MODE_CURVE)
        return "unknown domain";
    if (!frame_is(&f[MECHANISM], "CURVE") || zmq_msg_size(&f[CREDENTIALS]) != SKV_KEY_BYTES)
        return "not a CURVE handshake";
    const unsigned char *key = zmq_msg_data(&f[CREDENTIALS]);
    zmq_z85_encode(key_z85, key, SKV_KEY_BYTES);
    const struct key_list *l = &a->lists[which];
    const struct authorized_key *k = key_find(l, key);
    if (k) {
        *user_id = k->tenant;
        skv_log(SKV_LOG_DEBUG, "%s endpoint: CURVE key %s from %s accepted%s%s", domain, key_z85, address,
                **user_id ? " for tenant " : "", *user_id);
        return NULL;
    }
    uint64_t key_prefix;
    memcpy(&key_prefix, key, sizeof key_prefix);
    if (log_allowed(&a->refused, key_prefix)) {
        skv_log(SKV_LOG_WARN, "%s endpoint: refused CURVE key %s from %s: not in %s%s", domain, key_z85, address,
                l->path, a->refused.suppressed ? " (and earlier refusals not logged)" : "");
        a->refused.suppressed = 0;
    }
    return "key not authorized";
}

static void zap_answer_one(struct skv_auth *a)
{
    enum { MAX_FRAMES = 7 };
    zmq_msg_t f[MAX_FRAMES], extra;
    int n = 0, total = 0;
    bool more;
    do { /* keep the first MAX_FRAMES frames, count and drop the rest */
        zmq_msg_t *m = n < MAX_FRAMES ? &f[n] : &extra;
        zmq_msg_init(m);
        if (zmq_msg_recv(m, a->zap, total ? 0 : ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(m);
            if (!total)
                return; /* nothing waiting */
            break;
        }
        more = zmq_msg_more(m);
        total++;
        if (m == &extra)
            zmq_msg_close(m);
        else
            n++;
    } while (more);
    const char *user_id;
    const char *refusal = zap_decide(a, f, total, &user_id);
    const char *text = refusal ? refusal : "OK";
    /* the connection's key as ZAP metadata ("X-Key", Z85): each request's key is looked up in
     * the list in force then (skv_auth_key_check), so a key removed at a reload stops acting */
    uint8_t meta[1 + 5 + 4 + SKV_KEY_Z85_LEN];
    size_t meta_len = 0;
    if (!refusal && total == 7 && zmq_msg_size(&f[6]) == SKV_KEY_BYTES) {
        meta[0] = 5;
        memcpy(meta + 1, "X-Key", 5);
        meta[6] = meta[7] = meta[8] = 0;
        meta[9] = SKV_KEY_Z85_LEN;
        char z85[SKV_KEY_Z85_LEN + 1];
        zmq_z85_encode(z85, zmq_msg_data(&f[6]), SKV_KEY_BYTES);
        memcpy(meta + 10, z85, SKV_KEY_Z85_LEN);
        meta_len = sizeof meta;
    }
    zmq_send(a->zap, "1.0", 3, ZMQ_SNDMORE);
    zmq_send(a->zap, n > 1 ? zmq_msg_data(&f[1]) : "", n > 1 ? zmq_msg_size(&f[1]) : 0, ZMQ_SNDMORE);
    zmq_send(a->zap, refusal ? "400" : "200", 3, ZMQ_SNDMORE);
    zmq_send(a->zap, text, strlen(text), ZMQ_SNDMORE);
    zmq_send(a->zap, user_id, strlen(user_id), ZMQ_SNDMORE);
    zmq_send(a->zap, meta, meta_len, 0);
    for (int i = 0; i < n; i++)
        zmq_msg_close(&f[i]);
}

static const char *handshake_reason(uint16_t event, uint32_t value, char *buf, size_t cap)
{
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL && value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
        return "the client does not use CURVE";
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL && value == ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC)
        return "the client's CURVE handshake does not decrypt (wrong server public key?)";
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL)
        snprintf(buf, cap, "ZMTP protocol error 0x%08x", value);
    else
        snprintf(buf, cap, "the connection closed during the handshake (%s): a client without CURVE?",
                 zmq_strerror((int)value));
    return buf;
}

void skv_auth_handshake_event(struct skv_auth *a, enum skv_auth_endpoint which, uint16_t event, uint32_t value)
{
    if (!(event & HANDSHAKE_EVENTS))
        return;
    char reason[128];
    if (log_allowed(&a->handshake[which], (uint64_t)event << 32 | value)) {
        skv_log(SKV_LOG_WARN, "%s endpoint %s: a handshake failed: %s%s", endpoint_names[which], a->endpoint[which],
                handshake_reason(event, value, reason, sizeof reason),
                a->handshake[which].suppressed ? " (and earlier failures not logged)" : "");
        a->handshake[which].suppressed = 0;
    }
}

void skv_auth_serve(struct skv_auth *a)
{
    /* bounded batches: the socket loop has other work */
    for (int k = 0; k < 64 && skv_zmq_has_input(a->zap); k++)
        zap_answer_one(a);
}

int skv_auth_reload(struct skv_auth *a)
{
    struct key_list fresh[2] = {{0}};
    int rc = SKV_OK;
    for (int i = 0; i < 2 && !rc; i++)
        if (a->mode[i] == MODE_CURVE)
            rc = key_list_load(a->lists[i].path, i == SKV_AUTH_CLIENT, &fresh[i]);
    if (rc) {
        key_list_free(&fresh[0]);
        key_list_free(&fresh[1]);
        return rc;
    }
    for (int i = 0; i < 2; i++)
        if (a->mode[i] == MODE_CURVE) {
            key_list_free(&a->lists[i]);
            a->lists[i] = fresh[i];
            skv_log(a->lists[i].n ? SKV_LOG_INFO : SKV_LOG_WARN, "%s endpoint: %zu authorized key(s) from %s%s",
                    endpoint_names[i], a->lists[i].n, a->lists[i].path,
                    a->lists[i].n ? "" : ": every client is refused");
        }
    return SKV_OK;
}
