/* The ZeroMQ side of snapkvd: client and admin ROUTER sockets (CURVE on tcp://, see auth.h),
 * request decoding and validation, dispatch, replies. Nothing below this file knows ZeroMQ
 * or protobuf. */
#ifndef SKV_SERVER_H
#define SKV_SERVER_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "daemon/config.h"

struct skv_server;
struct skv_auth;
struct skv_backend;
struct skv_model;

struct skv_server_env {
    const struct skv_config *cfg;
    struct skv_backend *backend;
    struct skv_model *model;          /* may be NULL while no model is loaded */
    volatile sig_atomic_t *stop;      /* set by SIGTERM / SIGINT */
    volatile sig_atomic_t *reopen;    /* set by SIGHUP */
    void (*tick)(struct skv_server *srv); /* called from the socket loop at least every 200 ms (watchdog) */
};

/* Binds both endpoints (refusing when another daemon holds them), secured as *auth_p decided,
 * and starts the metrics endpoint when metrics-listen is set. Takes *auth_p (sets it to NULL),
 * also on failure. */
int skv_server_new(const struct skv_server_env *env, struct skv_auth **auth_p, struct skv_server **out);
/* Serves until *env->stop; answers every queued request before returning. SIGHUP (*env->reopen)
 * reopens the log and re-reads the authorized keys files. */
int skv_server_run(struct skv_server *srv);
void skv_server_destroy(struct skv_server **srv_p);
/* Whether the engine thread behind the socket loop looks alive to a watchdog of interval_ms
 * (see skv_worker_alive): what the loop turning says nothing about. */
bool skv_server_engine_alive(struct skv_server *srv, uint64_t interval_ms);

#endif
