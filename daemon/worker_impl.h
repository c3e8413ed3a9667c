/* Internals shared by worker.c (thread, queue, decode scheduling) and requests.c (the
 * command handlers that run on the worker thread). */
#ifndef SKV_WORKER_IMPL_H
#define SKV_WORKER_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "daemon/engine/sampler.h"
#include "daemon/prefix_cache.h"
#include "common/log.h"
#include "daemon/session.h"
#include "daemon/stats.h"
#include "daemon/worker.h"

struct skv_kv_store;
struct skv_store;

/* A DECODE in progress: one token per scheduling round. */
struct skv_decode {
    struct skv_job *job;
    struct skv_session *session;
    struct skv_sampler sampler;
    uint32_t max_tokens, produced;
    uint32_t *stop;
    size_t n_stop;
    bool stop_at_eos, stream;
    int32_t *out;             /* generated ids (non-streaming reply) */
    float *logits;            /* [n_vocab] */
    int32_t token;            /* the token of the current round */
    const char *reason;       /* why it is the last one ("stop", "eos", "length") or NULL */
    char error[256];          /* finish_reason "error": what failed (the final reply's message) */
    bool picked;              /* the round's token was sampled (counted in produced) */
    char pending[8];          /* bytes of an incomplete UTF-8 character (from the session at the start) */
    size_t n_pending;
    char *text;               /* the text of every token so far (non-streaming reply) */
    size_t text_len, text_cap;
    struct skv_stop_text stops; /* the request's stop sequences and the text they hold back */
    bool logprobs;            /* Sampling.logprobs (or top_logprobs > 0) */
    uint32_t top_n;           /* Sampling.top_logprobs, at most SKV_TOP_LOGPROBS_MAX */
    uint32_t lp_cap;          /* tokens the three below have room for (grown with produced, at most
                                 max_tokens; 1 when streamed: each reply carries its token's) */
    float *lp;                /* [produced] (streamed: [1]): the tokens' log-probabilities */
    int32_t *top_ids;         /* [produced][top_n]: each step's most likely tokens */
    float *top_lp;            /* [produced][top_n]: and theirs */
    struct skv_decode *next;
};

/* A client's CUDA buffer the worker opened (ipc_open), kept for the client's next transfers. */
#define SKV_IPC_HANDLE_BYTES 64
#define SKV_IPC_PER_CLIENT 8   /* CUDA buffers kept open for one client (more: its LRU one closes) */
#define SKV_IPC_MAX 256        /* and for all clients together (more: the LRU one closes) */
struct skv_ipc_buf {
    int sock;                 /* the endpoint the client came through (skv_job.sock) */
    uint8_t identity[256];    /* the client's ZeroMQ routing id */
    size_t identity_len;
    uint8_t handle[SKV_IPC_HANDLE_BYTES];
    void *ptr;
    uint64_t bytes;           /* from ptr to the allocation's end, as the device knows it */
    uint64_t last_used_ms;
    uint64_t use;             /* w->ipc_uses at its last use: LRU order */
};

/* A tenant's engine time for queue-order = fair: start-time fair queueing, in microseconds of
 * virtual time. A tenant absent from the table, or behind the clock, stands at the clock. */
#define SKV_FAIR_TENANTS 1024 /* tenants ahead of the clock remembered (more: the nearest is dropped) */
#define SKV_FAIR_WINDOW 256   /* the oldest waiting requests fair order chooses among */
struct skv_tenant_clock {
    char name[64];
    uint64_t vt_us;
};

#define PERSIST_STORE_NAME_MAX 48 /* a block store's file name, blocks-<generation>.skvb, its NUL included */

/* A session this daemon spilled to the store: its bytes count against its tenant's
 * store-max-bytes-per-tenant until it is taken back, released or its time there passes. */
struct skv_spill_rec {
    char tenant[SKV_TENANT_MAX];
    uint8_t id[SKV_SESSION_ID_BYTES];
    uint64_t bytes;
    uint64_t expires_ms; /* skv_now_ms */
};

struct skv_worker {
    const struct skv_config *cfg;
    struct skv_model *m;
    struct skv_engine *engine;
    struct skv_engine *decode_engine; /* decode rounds' own buffers (they may run inside a forward of engine) */
    struct skv_engine *nested_engine; /* a request run inside a long forward of engine (fair-slice-ms) */
    struct skv_session_table *sessions;
    struct skv_prefix_cache prefix; /* released sessions' KV kept for prefix reuse (prefix-retain-bytes) */
    struct skv_store *store;  /* store = ...: where evicted sessions go and missing ones come from (NULL: none) */
    struct skv_spill_rec *spills; /* what this daemon spilled and the store still holds, per tenant */
    struct skv_log_limit log_evicted, log_gone, log_spill, log_cut; /* lines clients can cause, one per 10 s */
    size_t n_spills, cap_spills;
    bool store_draining;      /* skv_requests_store_drain runs: spills pass the tenant's cap */
    bool store_signed;        /* store-secret-file: values are signed, and only signed ones load */
    unsigned char rows_id[16]; /* what computes this daemon's rows (requests.c rows_id; zero: unknown) */
    bool rows_id_known;       /* rows_id was worked out (on the worker thread, at the first use) */
    unsigned char store_mac_key[32]; /* (SKV_STORE_KEY_BYTES) */
    bool store_accept;        /* store-accept-secret-file: its signatures load too */
    unsigned char store_accept_key[32]; /* (SKV_STORE_KEY_BYTES) */
    void *push;               /* inproc PUSH to the socket thread (worker thread only) */
    void *zctx;
    char endpoint[64];
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct skv_job *head, *tail;
    int queued;               /* requests waiting (queue-depth applies) */
    uint64_t queued_bytes;    /* the memory they hold (max-queued-bytes applies) */
    int notices;              /* SKV_JOB_CLIENT_GONE jobs waiting (SKV_WORKER_NOTICES_MAX) */
    bool stopping;
    uint64_t boot_id;         /* random at start: KV events' sequence numbers count within one */
    bool done_marker;         /* skv_worker_request_stop: the last message is SKV_WORKER_DONE_SOCK's */
    struct skv_decode *decodes;
    uint64_t last_round_us;   /* CLOCK_MONOTONIC us when the last decode round or yield ended */
    uint64_t round_cost_us;   /* how long the last decode round (all its forwards) took */
    bool yielding;            /* inside a forward's yield: short requests and decode rounds run */
    const struct skv_job *running; /* the request the worker runs (not inside a yield) */
    const struct skv_job *outer;  /* while a request runs nested: the one whose forward it runs inside */
    bool nesting;             /* running is nested: its forwards use nested_engine, its yields nest nothing */
    uint64_t run_vt_us;       /* where running's tenant stood when running was chosen (virtual time) */
    uint64_t run_t0_us;       /* when running started (CLOCK_MONOTONIC) */
    const struct skv_session *forward_session; /* the session of the forward that yields */
    bool fair;                /* queue-order = fair */
    bool events;              /* events-endpoint set: KV events go to the socket thread */
    struct skv_tenant_weight weights[SKV_TENANT_WEIGHTS_MAX]; /* tenant-weights */
    int n_weights;
    uint64_t vclock_us;       /* virtual time: the start of the request last chosen */
    struct skv_tenant_clock *clocks; /* tenants ahead of the clock */
    int n_clocks;
    uint64_t nested_us;       /* engine time inside the running request's yields (not its own) */
    uint64_t persist_gen;     /* the generation of the persist files on disk (0: none, or unnumbered) */
    uint64_t persist_ms;      /* when the last save or checkpoint was written (or the start) */
    bool persist_dirty;       /* sessions may have changed since */
    int persist_gave_way;     /* checkpoints in a row stopped by a request */
    uint64_t persist_failed_ms; /* when the last checkpoint failed (0: the last one ended well) */
    bool saves_swept;         /* this start's first SAVE removed what crashes left (sweep_saves) */
    bool persist_keep_store;  /* a checkpoint into a new store failed on a session it could not
                               * carry: the next appends to the last store when it can */
    struct skv_kv_store *persist_store; /* the block store saves append to (NULL: the next save starts one) */
    char persist_store_name[PERSIST_STORE_NAME_MAX]; /* its file in <state-dir>/persist */
    char **persist_files;     /* the files the manifest on disk names, sorted: what sweeps keep */
    int n_persist_files;      /* -1: not known (no memory for the list): sweeps remove nothing */
    uint64_t spilled_compacted; /* the spilled record's bytes after its last compaction (requests.c) */
    struct skv_tenant_table tenants; /* each tenant's counters (gauges filled in by snapshots) */
    atomic_ullong dropped_gone;   /* requests of gone clients dropped (socket thread) or stopped (worker) */
    atomic_bool device_lost;      /* the backend can run nothing more (skv_worker_device_lost) */
    struct skv_tenant_table tenant_snap; /* published about once a second, for HTTP /metrics (snap_mu) */
    struct skv_ipc_buf ipc[SKV_IPC_MAX];
    int n_ipc;
    uint64_t ipc_uses;        /* uses of the table's buffers so far */
    struct skv_metrics metrics;
    _Atomic(const struct skv_replies *) replies; /* the socket thread's unread replies (STATS), or NULL */
    atomic_uint st_sessions, st_queue;
    atomic_ullong st_queue_bytes;
    atomic_ullong st_pool_used;
    atomic_ullong st_disconnects; /* clients gone (first notices, dropped ones too) */
    atomic_ullong heartbeat_ms;   /* CLOCK_MONOTONIC ms of the thread's last sign of progress (watchdog) */
    atomic_bool idle;             /* the thread waits for work: nothing queued, no decode */
    atomic_bool serving;          /* past start-up (persist restore): its loop takes requests */
    atomic_bool stop_asked;       /* stopping, for readers that must not take mu (the probes) */
    pthread_mutex_t snap_mu;
    struct skv_stats_input snap;  /* published after every round, for HTTP /metrics */
    int start_rc;
    bool started;
};

/* Records progress for the watchdog (worker thread only): the loop calls it each turn, after
 * each request and each decode round; a long forward may call it per layer. */
void skv_worker_beat(struct skv_worker *w);

/* Called at the ticks of a long forward (worker thread only): once decode-yield-ms passed since
 * the last decode round or yield, runs the request of another tenant that fair order puts ahead
 * of the running one by fair-slice-ms (on nested_engine; not inside a nested one), then up to 8
 * short queued requests that may go before the
 * ones ahead of them (no request ahead from the same sender or naming the same session, the
 * session not busy: see take_short), then gives every running DECODE its next token, all on the
 * decode engine, so that a long PREFILL, APPEND or COMPRESS stalls neither. The forward's own
 * session is busy meanwhile (never evicted, named by no request that runs). */
void skv_worker_yield(struct skv_worker *w);

/* KV events (events-endpoint; worker thread): s is stored, with its prompt's block hashes;
 * from now on its destruction is announced too. Nothing when events are off. */
#define SKV_EVENT_BLOCK_TOKENS 16  /* tokens per hashed block */
void skv_worker_event_stored(struct skv_worker *w, struct skv_session *s);
/* The chained block hashes of s's token history, as the events carry them; the caller frees
 * *out. Returns how many (0, *out NULL: none, or no memory). */
size_t skv_worker_block_hashes(const struct skv_session *s, uint64_t **out);

/* The live metrics (worker thread only). */
void skv_worker_stats_input(struct skv_worker *w, struct skv_stats_input *out);
/* Whether the running request's client closed its connection (its notice waits in the queue);
 * worker thread. */
bool skv_worker_running_gone(struct skv_worker *w);
/* Whether a request or notice waits in the queue; worker thread. */
bool skv_worker_has_queued(struct skv_worker *w);
/* Whether the forward in progress is the running request's and may stop part way: a PREFILL
 * (its session is its own), an APPEND (the engine's undo restores the session, or it runs on
 * a copy) or a COMPRESS (it runs on a copy of the session's cache). */
bool skv_worker_running_stoppable(const struct skv_worker *w);
/* Whether the running request's deadline passed (its client has stopped waiting). */
bool skv_worker_running_late(const struct skv_worker *w);
/* A tenant's counters (worker thread only): its own row, SKV_TENANT_ADMIN's, or, past
 * SKV_TENANT_STATS names and for names no tenant can have, SKV_TENANT_OTHER's. */
struct skv_tenant_stats *skv_worker_tenant(struct skv_worker *w, const char *tenant);
/* Every tenant's counters with its gauges as they are now: sessions and bytes, waiting
 * requests, running DECODEs (worker thread only). */
void skv_worker_tenant_table(struct skv_worker *w, struct skv_tenant_table *out);

#define SKV_STOP_TOKENS_MAX 64  /* stop tokens one DECODE may name */

/* Refuses a request for what its counts alone break, with the status and message the worker
 * would answer: PREFILL / APPEND token ids over max-prompt-tokens (APPEND: plus max-new-tokens)
 * or text over its byte bound, DECODE max_tokens or stop tokens over their limits, a spec
 * longer than the parser takes, IMPORT_KV shapes the model or the limits refuse. Any thread:
 * it reads only cfg, the model's shapes and tokenizer, and req, so the socket thread refuses
 * these before they wait in the queue. */
int skv_requests_admit(const struct skv_config *cfg, const struct skv_model *m, const Snapkv__Request *req);

/* Runs one queued request (not DECODE) to completion and replies. */
void skv_requests_execute(struct skv_worker *w, struct skv_job *job);
/* Starts a DECODE (may reply at once on error: SKV_E_BUSY past max-decodes or
 * max-decodes-per-tenant running ones); returns the decode to schedule or NULL. */
struct skv_decode *skv_requests_decode_start(struct skv_worker *w, struct skv_job *job);
/* One token for each of the n decodes ds[] (at most SKV_ENGINE_MAX_BATCH are taken) in one
 * batched forward; finished[i] is set when ds[i] sent its final reply. Returns how many
 * decodes it advanced. */
int skv_requests_decode_round(struct skv_worker *w, struct skv_decode **ds, int n, bool *finished);
/* Ends a decode between two rounds (shutdown, its client gone): final reply with
 * finish_reason "cancelled"; the session keeps the tokens so far. */
void skv_requests_decode_cancel(struct skv_worker *w, struct skv_decode *d);
void skv_requests_decode_free(struct skv_decode *d);
/* A decode that ran ends: its session announced again (KV events) when it made a token, then
 * d freed. */
void skv_requests_decode_end(struct skv_worker *w, struct skv_decode *d);
/* Closes the CUDA buffers of clients idle for longer than a lease; returns how many. */
int skv_requests_ipc_expire(struct skv_worker *w, uint64_t now_ms);
/* A SKV_JOB_CLIENT_GONE notice: closes the CUDA buffers of the job's client (its endpoint and
 * routing id; other clients' stay); returns how many. */
int skv_requests_client_gone(struct skv_worker *w, const struct skv_job *job);
/* Closes every CUDA buffer (shutdown). */
void skv_requests_ipc_close_all(struct skv_worker *w);
/* persist = yes: saves every session to <state-dir>/persist at stop (most recently used first,
 * within persist-max-seconds), with a manifest of ids, tenants, pins and leases. */
int skv_requests_persist_save(struct skv_worker *w);
/* What computes this daemon's rows (requests.c): 16 bytes, zero when unknown; worked out at the
 * first call (worker thread only). */
const unsigned char *skv_requests_rows_id(struct skv_worker *w);

/* The same while serving (persist-interval-seconds). give_way: SKV_E_CANCELLED when a request
 * arrives meanwhile, the last save left as it was. */
int skv_requests_persist_checkpoint(struct skv_worker *w, bool give_way);
/* Restores what the last stop saved, under the same ids, and empties the directory. */
int skv_requests_persist_restore(struct skv_worker *w);
/* Closes the block store and forgets the files (the worker's end). */
void skv_requests_persist_close(struct skv_worker *w);
/* The session table's on_evict (store = ...): writes s to the store before the table drops it
 * (a warning when that fails: s is then lost, as without a store). */
void skv_requests_spill(void *user, struct skv_session *s);
/* At a stop without persist (store = ...): spills every session, pinned ones and then the most
 * recently used first, within persist-max-seconds, so that other daemons sharing the store can
 * take them; returns how many went. */
int skv_requests_store_drain(struct skv_worker *w);
/* Sends a status-only final reply. */
void skv_requests_fail(struct skv_worker *w, const struct skv_job *job, int status, const char *msg);

#endif
