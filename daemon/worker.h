/* The engine worker: one thread that owns the model, the engine and the session table and
 * executes queued requests in order, interleaving the decode steps of every streaming
 * DECODE round-robin so one long generation never starves other sessions. Replies go back
 * to the socket thread over an inproc ZeroMQ pair; the worker never touches the ROUTERs. */
#ifndef SKV_WORKER_H
#define SKV_WORKER_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/config.h"
#include "proto/snapkv.pb-c.h"

struct skv_worker;
struct skv_model;
struct skv_backend;

struct skv_job {
    int sock;                 /* 0: client endpoint, 1: admin endpoint */
    uint8_t identity[256];    /* ZeroMQ routing id */
    size_t identity_len;
    Snapkv__Request *req;     /* owned by the job */
    struct skv_job *next;
};

/* Starts the thread; replies are pushed to `reply_endpoint` (an inproc:// PULL the caller bound
 * on context zctx) as [sock byte][identity][reply]. */
int skv_worker_start(void *zctx, const char *reply_endpoint, const struct skv_config *cfg, struct skv_model *m,
                     struct skv_worker **out);
/* Queues a job (ownership passes on success). SKV_E_BUSY when queue-depth jobs wait. */
int skv_worker_submit(struct skv_worker *w, struct skv_job *job);
/* Cancels what is queued and in flight (each gets a final reply), then joins the thread. */
void skv_worker_stop(struct skv_worker **w_p);

/* Snapshot for STATUS (any thread). */
struct skv_worker_stats {
    uint32_t n_sessions;
    uint32_t queue_depth;
    uint64_t pool_bytes_used;
};
void skv_worker_stats(struct skv_worker *w, struct skv_worker_stats *out);
/* The STATS metrics as Prometheus text (what admin STATS --prometheus sends), from the snapshot
 * the worker publishes after every round (any thread). Returns the length written. */
size_t skv_worker_prometheus(struct skv_worker *w, char *buf, size_t cap);

/* Packs and sends a reply for job (worker thread only). */
void skv_worker_reply(struct skv_worker *w, const struct skv_job *job, Snapkv__Reply *rep);

#endif
