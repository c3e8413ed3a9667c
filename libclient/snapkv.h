/* libsnapkv: the C client of the snapkvd daemon.
 *
 * Thread safety: a snapkv_client_t is NOT safe to use from several threads at once; use one
 * client per thread (they are cheap: one ZeroMQ DEALER socket each) or serialize calls.
 * Different clients may be used concurrently. The library never logs: every function returns
 * a status (SNAPKV_OK = 0 or a negative SNAPKV_E_* code, the same codes the daemon sends)
 * and snapkv_last_error() gives the detail message of this thread's last failure. */
#ifndef SNAPKV_H
#define SNAPKV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SNAPKV_API __attribute__((visibility("default")))

#define SNAPKV_PROTOCOL_VERSION 1

/* Status codes: identical values to the daemon's SKV_* codes. */
enum snapkv_status {
    SNAPKV_OK = 0,
    SNAPKV_E_NOMEM = -1,
    SNAPKV_E_INVAL = -2,
    SNAPKV_E_DEVICE = -3,
    SNAPKV_E_BUSY = -4,
    SNAPKV_E_PROTO = -5,
    SNAPKV_E_IO = -6,
    SNAPKV_E_POOL_FULL = -7,
    SNAPKV_E_NOT_FOUND = -8,
    SNAPKV_E_UNSUPPORTED = -9,
    SNAPKV_E_FORMAT = -10,
    SNAPKV_E_LIMIT = -11,
    SNAPKV_E_PERM = -12,
    SNAPKV_E_VERSION = -13,
    SNAPKV_E_CANCELLED = -14,
    SNAPKV_E_TIMEOUT = -15,
    SNAPKV_E_EXISTS = -16,
    SNAPKV_E_INTERNAL = -17,
};

typedef struct snapkv_client snapkv_client_t;

struct snapkv_connect_opts {
    const char *tenant;     /* NULL: "default" */
    const char *name;       /* client name shown to admins; NULL: "libsnapkv" */
    int timeout_ms;         /* per reply; 0: 30000, -1: wait forever */
};

/* Connects to `endpoint` ("ipc:///run/snapkvd/snapkvd.sock", "tcp://host:port") and does the
 * HELLO handshake (protocol version check). *out is written only on success. */
SNAPKV_API int snapkv_connect(const char *endpoint, const struct snapkv_connect_opts *opts,
                              snapkv_client_t **out);
/* Accepts NULL and *client_p == NULL; sets *client_p to NULL. */
SNAPKV_API void snapkv_close(snapkv_client_t **client_p);

/* What HELLO told us about the daemon and its model. Strings live as long as the client. */
struct snapkv_server_info {
    const char *server_version;
    const char *model_name;
    const char *model_fingerprint;
    const char *backend;
    uint32_t n_layers, n_heads, n_kv_heads, head_dim, n_vocab;
    uint32_t max_prompt_tokens, max_new_tokens;
    uint64_t max_message_bytes;
};
SNAPKV_API int snapkv_server_info(snapkv_client_t *client, struct snapkv_server_info *out);

/* Admin: STATUS (on an admin endpoint). */
struct snapkv_status_info {
    char server_version[32];
    char model_name[128];
    char backend[16];
    uint64_t uptime_seconds;
    uint32_t n_sessions, n_clients, queue_depth, threads;
    uint64_t pool_bytes_total, pool_bytes_used;
};
SNAPKV_API int snapkv_admin_status(snapkv_client_t *client, struct snapkv_status_info *out);

/* Admin: CONFIG GET. key NULL or "": all options. Calls fn once per entry. */
typedef void (*snapkv_config_fn)(void *user, const char *key, const char *value, const char *help);
SNAPKV_API int snapkv_admin_config_get(snapkv_client_t *client, const char *key, snapkv_config_fn fn,
                                       void *user);

/* Detail message of this thread's last failed call ("" when none). */
SNAPKV_API const char *snapkv_last_error(void);
/* Short text of a status code. */
SNAPKV_API const char *snapkv_status_str(int status);

#ifdef __cplusplus
}
#endif
#endif
