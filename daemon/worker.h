/* The engine worker: one thread that owns the model, the engine and the session table and
 * executes queued requests in order, interleaving the decode steps of every streaming
 * DECODE round-robin so one long generation never starves other sessions. Replies go back
 * to the socket thread over an inproc ZeroMQ pair; the worker never touches the ROUTERs. */
#ifndef SKV_WORKER_H
#define SKV_WORKER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "daemon/config.h"
#include "proto/snapkv.pb-c.h"

struct skv_worker;
struct skv_model;
struct skv_backend;

enum skv_job_kind {
    SKV_JOB_REQUEST = 0,      /* req: a command to run and answer */
    SKV_JOB_CLIENT_GONE,      /* no req, no reply: the client's connection closed */
};

struct skv_job {
    enum skv_job_kind kind;
    int sock;                 /* 0: client endpoint, 1: admin endpoint */
    uint8_t identity[256];    /* ZeroMQ routing id */
    size_t identity_len;
    Snapkv__Request *req;     /* owned by the job; NULL for SKV_JOB_CLIENT_GONE */
    size_t bytes;             /* memory it holds while queued (set by skv_worker_submit) */
    size_t unpacked_bytes;    /* what unpacking req allocated, when the caller counted it (0: not) */
    const uint8_t *session;   /* the session id its command names, in req, or NULL (set by submit) */
    uint64_t deadline_ms;     /* CLOCK_MONOTONIC ms past which its client no longer waits, or 0
                               * (the request's deadline_ms from when submit read it) */
    char tenant[64];          /* whose engine time it spends (queue-order = fair; set by submit):
                               * its tenant, "(admin)" on the admin endpoint */
    bool late;                /* run past its deadline (a CANCEL or RELEASE: the others are not run) */
    int conn;                 /* the client connection it came over: its fd and number (the socket
                               * thread's; serial 0: not known, a notice, the admin endpoint), so its
                               * replies go over that connection only */
    uint64_t conn_serial;
    long uid;                 /* the client process's user, as its ipc:// connection's Peer-Address
                               * gives it (SO_PEERCRED when it connected); -1 on tcp:// and for
                               * notices: whose shared-memory objects it may name (open_buffer) */
    struct skv_job *next;
};

/* Whether two jobs came from one client connection: the same endpoint and routing id (the
 * identity a reply is routed to), as a client-gone notice names its client. */
static inline bool skv_job_same_sender(const struct skv_job *a, const struct skv_job *b)
{
    return a->sock == b->sock && a->identity_len == b->identity_len &&
           memcmp(a->identity, b->identity, a->identity_len) == 0;
}

/* Starts the thread; replies are pushed to `reply_endpoint` (an inproc:// PULL the caller bound
 * on context zctx) as [route][identity][reply] (struct skv_worker_route, below). */
int skv_worker_start(void *zctx, const char *reply_endpoint, const struct skv_config *cfg, struct skv_model *m,
                     struct skv_worker **out);
/* Queues a job (ownership passes on success). Refused first, with the worker's status and
 * message, when its counts alone break a limit (skv_requests_admit); SKV_E_LIMIT when it holds
 * more memory than max-queued-bytes by itself; SKV_E_BUSY when queue-depth jobs wait or the
 * queued jobs' memory and its own would pass max-queued-bytes. Called on the socket thread. */
int skv_worker_submit(struct skv_worker *w, struct skv_job *job);
/* The memory an unpacked request holds: every structure, array, string and byte string
 * protobuf-c allocated for it, each with malloc's overhead. */
size_t skv_request_bytes(const Snapkv__Request *req);
/* Notice that the client behind `identity` on the client endpoint closed its connection. Its
 * queued requests whose only outcome was for the client go at once, unanswered: PREFILL, FORK
 * and IMPORT_KV (a session whose id nobody would learn); its APPEND, COMPRESS, RELEASE, CANCEL,
 * DECODE and EXPORT_KV still run (other clients may count on what they do to a session, or
 * read the buffer).
 * A PREFILL of the client's that is running stops at its next layer, and its session goes.
 * After the client's requests still queued, the worker cancels its running DECODEs (their
 * sessions keep the tokens so far and wait for their lease) and closes its CUDA buffers. `first` says it is the
 * client's first notice (counted in snapkv_client_disconnects_total); a later one follows a request
 * read after the connection had closed. Never refused for queue-depth and never waits; past
 * SKV_WORKER_NOTICES_MAX pending notices one is dropped (SKV_E_LIMIT; the decodes then run to
 * their end and the buffers close when the lease runs out). SKV_E_CANCELLED while stopping
 * (every decode and buffer ends then anyway). */
#define SKV_WORKER_NOTICES_MAX 4096
int skv_worker_client_gone(struct skv_worker *w, const uint8_t *identity, size_t identity_len, bool first);
/* Cancels what is queued and in flight (each gets a final reply), then joins the thread. */
void skv_worker_stop(struct skv_worker **w_p);
/* Tells the worker to stop and returns at once: it refuses new work, answers what is queued,
 * cancels its decodes, saves (persist) and then sends one SKV_WORKER_DONE_SOCK message, its last.
 * The reply pipe must be read until that message (the worker blocks on a full pipe), then
 * skv_worker_stop joins the thread. */
void skv_worker_request_stop(struct skv_worker *w);
/* The KV events' boot id (KvEventBatch.boot_id): random, set at start; read-only after. */
uint64_t skv_worker_boot_id(const struct skv_worker *w);
/* A KV event batch of this daemon, stamped now (version, time, boot id), with no events yet:
 * an event's, or the socket thread's heartbeat. */
void skv_worker_event_batch(const struct skv_worker *w, Snapkv__KvEventBatch *b);

/* Snapshot for STATUS (any thread). */
struct skv_worker_stats {
    uint32_t n_sessions;
    uint32_t queue_depth;
    uint64_t queue_bytes;     /* what the queued requests hold (max-queued-bytes applies) */
    uint64_t pool_bytes_used;
};
void skv_worker_stats(struct skv_worker *w, struct skv_worker_stats *out);
/* The STATS metrics as Prometheus text (what admin STATS --prometheus sends), from the snapshot
 * the worker publishes after every round (any thread). Returns the length written. */
size_t skv_worker_prometheus(struct skv_worker *w, char *buf, size_t cap);
/* The socket thread's count of replies its clients have not read (replies.h), for STATS. */
struct skv_replies;
void skv_worker_set_replies(struct skv_worker *w, const struct skv_replies *r);

/* Whether the engine thread looks alive to a watchdog of interval_ms (any thread): it waits for
 * work, or it showed progress (a turn of its loop, a request done, a decode round) less than
 * interval_ms / 2 ago. A thread wedged in a forward, a device call or a lock reads as dead;
 * so does one forward that runs longer than interval_ms / 2. */
bool skv_worker_alive(struct skv_worker *w, uint64_t interval_ms);
/* HTTP health probes (any thread): writes a one-line text into buf and returns 200 or 503.
 * Liveness (ready false): 503 when the device is lost or the engine thread shows no progress
 * for stall_ms while it has work (skv_worker_alive's rule at twice stall_ms). Readiness (ready
 * true) adds: 503 while the daemon stops, while start-up restores persisted sessions, and while
 * queue-depth requests wait (a new one would get SKV_E_BUSY). */
int skv_worker_health(struct skv_worker *w, bool ready, uint64_t stall_ms, char *buf, size_t cap);
/* Whether a request failed with SKV_E_DEVICE and the backend then said the device can run
 * nothing more (its device_lost op): the daemon should stop with an error (any thread). */
bool skv_worker_device_lost(struct skv_worker *w);
/* After a request failed with `status` (the worker thread): SKV_E_DEVICE asks the backend. */
void skv_worker_note_failure(struct skv_worker *w, int status);
/* The rule skv_worker_alive applies; now_ms and heartbeat_ms on one clock (a heartbeat after
 * now counts as fresh). */
bool skv_watchdog_ok(uint64_t now_ms, uint64_t heartbeat_ms, bool idle, uint64_t interval_ms);

/* Packs and sends a reply for job (worker thread only). */
void skv_worker_reply(struct skv_worker *w, const struct skv_job *job, Snapkv__Reply *rep);
/* The reply pipe's messages are [socket index][routing id][body]; index 0 is the client
 * endpoint, 1 the admin one, and this one a KV event (empty routing id, body a KvEventBatch)
 * for the events endpoint. A reply's first frame is a struct skv_worker_route: the index and
 * the connection its request came over (skv_job.conn, conn_serial); the others' one byte. */
struct skv_worker_route {
    uint8_t sock;
    int32_t conn;
    uint64_t serial;
};
#define SKV_WORKER_EVENTS_SOCK 2
/* The worker's last message after skv_worker_request_stop (empty routing id and body): every
 * reply it sent is before it in the pipe. */
#define SKV_WORKER_DONE_SOCK 3

#endif
