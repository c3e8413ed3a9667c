/* Who may talk to snapkvd over the network: a tcp:// endpoint is a CURVE server (the daemon's
 * secret key) whose clients are checked by a ZAP handler (inproc "zeromq.zap.01") against an
 * authorized keys file; a key may be bound to one tenant. ipc:// endpoints rely on file modes.
 * Lives on the socket thread: the server polls the sockets skv_auth_sockets() gives. */
#ifndef SKV_AUTH_H
#define SKV_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/config.h"

struct skv_auth;

enum skv_auth_endpoint { SKV_AUTH_CLIENT = 0, SKV_AUTH_ADMIN = 1 };

/* Decides how each endpoint is secured and reads the key files; refuses (SKV_E_INVAL,
 * SKV_E_PERM, SKV_E_UNSUPPORTED, ...) a tcp:// endpoint without curve-secret-key and its
 * authorized keys file unless allow-insecure-tcp, key files others can read, malformed keys,
 * a libzmq without CURVE, and transports other than ipc:// and tcp://. Touches no socket, so
 * main() calls it before loading the model. */
int skv_auth_new(const struct skv_config *cfg, struct skv_auth **out);
void skv_auth_destroy(struct skv_auth **auth_p);

/* Binds the ZAP handler on zctx; call before binding the endpoints. */
int skv_auth_start(struct skv_auth *auth, void *zctx);
/* Sets the CURVE server options on sock (a ROUTER not yet bound) when endpoint `which` uses
 * CURVE; does nothing for ipc:// and insecure tcp:// endpoints. libzmq allows one monitor per
 * socket, and the caller's monitors every endpoint's connections: *monitor_events gets the
 * events that monitor must include and pass to skv_auth_handshake_event (0 for an endpoint
 * without CURVE). */
int skv_auth_secure_socket(struct skv_auth *auth, void *sock, enum skv_auth_endpoint which, int *monitor_events);
/* Logs a handshake failure that the caller's monitor of endpoint `which` read (rate-limited);
 * other events are ignored. */
void skv_auth_handshake_event(struct skv_auth *auth, enum skv_auth_endpoint which, uint16_t event, uint32_t value);
bool skv_auth_uses_curve(const struct skv_auth *auth, enum skv_auth_endpoint which);

/* The ZAP socket to poll for input (n written, at most 3). */
size_t skv_auth_sockets(const struct skv_auth *auth, void **socks);
/* Answers every waiting ZAP request; never blocks. */
void skv_auth_serve(struct skv_auth *auth);

/* Whether the CURVE key z85 (a request's "X-Key" metadata, which the ZAP handler set for its
 * connection) is in endpoint which's list in force now, and the tenant it is bound to there
 * (*tenant: "" for any): SKV_E_PERM when a reload removed it. */
int skv_auth_key_check(const struct skv_auth *auth, enum skv_auth_endpoint which, const char *z85,
                       const char **tenant);

/* Re-reads the authorized keys files (SIGHUP). On an error the old lists stay in force. */
int skv_auth_reload(struct skv_auth *auth);

/* The ZAP User-Id of a key bound to a tenant is the tenant; unbound keys have none. */

#endif
