/* The engine worker thread (see worker.h): a bounded FIFO of requests, plus the set of
 * running DECODEs advanced one token each per round between queued requests. */
#include "daemon/worker_impl.h"
#include "daemon/replies.h"
#include "common/log.h"
#include "common/status.h"
#include "common/thread.h"
#include "daemon/compress/spec.h"
#include "daemon/engine/model.h"
#include "daemon/store.h"

#include <errno.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

/* One frame to the socket thread; a blocking send that a signal interrupted goes again (the
 * thread blocks signals, skv_thread_create; this is the second guard), so a message's frames
 * never go out in part. */
static void send_frame(void *push, const void *data, size_t len, int flags)
{
    while (zmq_send(push, data, len, flags) < 0 && zmq_errno() == EINTR)
        ;
}

/* Packs a message (reply or event batch) and hands [sock][identity][body] to the socket thread;
 * a reply's first frame names its request's connection too (route). */
static void push_out(struct skv_worker *w, int sock, const struct skv_job *route, const void *identity,
                     size_t identity_len, const ProtobufCMessage *msg)
{
    size_t len = protobuf_c_message_get_packed_size(msg);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf) {
        skv_log(SKV_LOG_ERROR, "out of memory packing a message for the socket thread");
        return;
    }
    protobuf_c_message_pack(msg, buf);
    struct skv_worker_route r;
    memset(&r, 0, sizeof r); /* (its padding too: the bytes go through the pipe) */
    r.sock = (uint8_t)sock;
    r.conn = route ? route->conn : -1;
    r.serial = route ? route->conn_serial : 0;
    if (route)
        send_frame(w->push, &r, sizeof r, ZMQ_SNDMORE);
    else
        send_frame(w->push, &r.sock, 1, ZMQ_SNDMORE);
    send_frame(w->push, identity, identity_len, ZMQ_SNDMORE);
    send_frame(w->push, buf, len, 0);
    free(buf);
}

void skv_worker_reply(struct skv_worker *w, const struct skv_job *job, Snapkv__Reply *rep)
{
    push_out(w, job->sock, job, job->identity, job->identity_len, &rep->base);
}

/* ---- KV events (events-endpoint; docs/SCALING.md §2) --------------------------------------------
 * One message per event through the reply pipe, under socket index SKV_WORKER_EVENTS_SOCK; the socket
 * thread publishes it with its topic and sequence number. */

/* The chained block hashes of a token history (whole SKV_EVENT_BLOCK_TOKENS blocks); on no
 * memory an event goes without them. */
static size_t block_hashes(const int32_t *tokens, int n_tokens, uint64_t **out)
{
    size_t n = (size_t)n_tokens / SKV_EVENT_BLOCK_TOKENS;
    *out = n ? malloc(n * sizeof **out) : NULL;
    if (!*out)
        return 0;
    uint8_t in[8 + 4 * SKV_EVENT_BLOCK_TOKENS], h[8] = {0};
    for (size_t b = 0; b < n; b++) {
        memcpy(in, h, 8);
        for (int i = 0; i < SKV_EVENT_BLOCK_TOKENS; i++) {
            uint32_t t = (uint32_t)tokens[b * SKV_EVENT_BLOCK_TOKENS + (size_t)i];
            for (int k = 0; k < 4; k++)
                in[8 + 4 * i + k] = (uint8_t)(t >> (8 * k));
        }
        crypto_generichash(h, sizeof h, in, sizeof in, NULL, 0);
        uint64_t v = 0;
        for (int k = 0; k < 8; k++)
            v |= (uint64_t)h[k] << (8 * k);
        (*out)[b] = v;
    }
    return n;
}

size_t skv_worker_block_hashes(const struct skv_session *s, uint64_t **out)
{
    return block_hashes(s->tokens, s->n_tokens, out);
}

static void event_send(struct skv_worker *w, Snapkv__KvEvent *ev)
{
    if (!w->events || !w->push)
        return;
    Snapkv__KvEventBatch b;
    skv_worker_event_batch(w, &b);
    b.n_events = 1;
    b.events = &ev;
    push_out(w, SKV_WORKER_EVENTS_SOCK, NULL, "", 0, &b.base);
}

/* True when the session holds fewer rows than its tokens in some head: compressed, also when
 * it has no compressor now (an import of a compressed export, or one made full again). */
static bool rows_dropped(const struct skv_session *s)
{
    const struct skv_kv_cache *c = s->cache;
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++)
        if (c->heads[i].len < c->n_past)
            return true;
    return false;
}

/* Publishes a SessionStored of what `id` names: the hashes of its n_tokens tokens, st's other
 * fields as the caller set them. */
static void send_stored(struct skv_worker *w, Snapkv__SessionStored *st, const uint8_t *id, const char *tenant,
                        const int32_t *tokens, int n_tokens)
{
    uint64_t *hashes;
    st->session_id = (ProtobufCBinaryData){SKV_SESSION_ID_BYTES, (uint8_t *)id};
    st->tenant = (char *)tenant;
    st->block_size = SKV_EVENT_BLOCK_TOKENS;
    st->n_block_hashes = block_hashes(tokens, n_tokens, &hashes);
    st->block_hashes = hashes;
    Snapkv__KvEvent ev = SNAPKV__KV_EVENT__INIT;
    ev.kind_case = SNAPKV__KV_EVENT__KIND_STORED;
    ev.stored = st;
    event_send(w, &ev);
    free(hashes);
}

void skv_worker_event_stored(struct skv_worker *w, struct skv_session *s)
{
    if (!w->events)
        return;
    s->announced = true;
    Snapkv__SessionStored st = SNAPKV__SESSION_STORED__INIT;
    st.n_tokens = (uint32_t)s->cache->n_past;
    st.bytes = s->bytes;
    st.compressed = s->comp != NULL || rows_dropped(s);
    send_stored(w, &st, s->id, s->tenant, s->tokens, s->n_tokens);
}

/* Publishes the removal of what `id` named: its tenant and the hashes of its n_tokens tokens. */
static void send_removed(struct skv_worker *w, const uint8_t *id, const char *tenant, const int32_t *tokens,
                         int n_tokens)
{
    uint64_t *hashes;
    Snapkv__SessionRemoved rm = SNAPKV__SESSION_REMOVED__INIT;
    rm.session_id = (ProtobufCBinaryData){SKV_SESSION_ID_BYTES, (uint8_t *)id};
    rm.tenant = (char *)tenant;
    rm.n_block_hashes = block_hashes(tokens, n_tokens, &hashes);
    rm.block_hashes = hashes;
    Snapkv__KvEvent ev = SNAPKV__KV_EVENT__INIT;
    ev.kind_case = SNAPKV__KV_EVENT__KIND_REMOVED;
    ev.removed = &rm;
    event_send(w, &ev);
    free(hashes);
}

/* The session table's destroy hook: an announced session's removal. */
static void event_removed(void *user, struct skv_session *s)
{
    struct skv_worker *w = user;
    if (w->events && s->announced)
        send_removed(w, s->id, s->tenant, s->tokens, s->n_tokens);
}

/* The kept prefixes' hooks (prefix-retain-bytes): one is announced as a SessionStored of its
 * own id with kept_prefix set, and removed when it goes. */
static void event_prefix_kept(void *user, const struct skv_prefix_entry *e)
{
    struct skv_worker *w = user;
    if (!w->events)
        return;
    Snapkv__SessionStored st = SNAPKV__SESSION_STORED__INIT;
    st.n_tokens = (uint32_t)e->n_rows;
    st.bytes = e->bytes;
    st.kept_prefix = true;
    send_stored(w, &st, e->id, e->tenant, e->tokens, e->n_rows);
}

static void event_prefix_dropped(void *user, const struct skv_prefix_entry *e)
{
    struct skv_worker *w = user;
    if (w->events)
        send_removed(w, e->id, e->tenant, e->tokens, e->n_rows);
}

static void job_free(struct skv_job *job)
{
    if (job->req)
        snapkv__request__free_unpacked(job->req, NULL);
    free(job);
}

void skv_worker_stats_input(struct skv_worker *w, struct skv_stats_input *out)
{
    struct skv_session_stats st;
    skv_session_stats(w->sessions, &st);
    uint64_t n_decodes = 0;
    for (const struct skv_decode *d = w->decodes; d; d = d->next)
        n_decodes++;
    *out = (struct skv_stats_input){
        .metrics = w->metrics,
        .prefix_retained = (uint64_t)w->prefix.n,
        .prefix_retained_bytes = w->prefix.bytes,
        .prefix_retained_host_bytes = w->prefix.host_bytes,
        .prefix_retained_dropped = w->prefix.dropped,
        .n_sessions = (uint64_t)st.n_sessions,
        .pool_bytes_used = st.bytes_used,
        .pool_bytes_total = (uint64_t)w->cfg->pool_size,
        .pool_blocks_used = st.blocks_used,
        .pool_blocks_shared = st.blocks_shared,
        .evictions = st.evictions,
        .client_disconnects = atomic_load(&w->st_disconnects),
        .n_decodes = n_decodes,
        .queue_requests = atomic_load(&w->st_queue),
        .queue_bytes = atomic_load(&w->st_queue_bytes),
    };
    out->metrics.requests_dropped_gone = atomic_load(&w->dropped_gone);
    const struct skv_replies *r = atomic_load(&w->replies);
    out->reply_bytes_unread = skv_replies_unread_bytes(r);
    out->replies_dropped = skv_replies_dropped(r);
    out->replies_closed = skv_replies_closed(r);
    uint64_t now = skv_now_ms();
    out->persist_age_seconds = w->cfg->persist && now > w->persist_ms ? (double)(now - w->persist_ms) / 1000.0 : 0;
    if (w->store) {
        struct skv_store_stats ss;
        skv_store_stats(w->store, &ss);
        out->store_spills = ss.spills;
        out->store_spill_bytes = ss.spill_bytes;
        out->store_spill_failures = ss.spill_failures;
        out->store_loads = ss.loads;
        out->store_misses = ss.misses;
        out->store_load_failures = ss.load_failures;
    }
    out->engine_scratch_bytes = skv_engine_scratch_bytes(w->engine) + skv_engine_scratch_bytes(w->decode_engine) +
                                skv_engine_scratch_bytes(w->nested_engine);
}

void skv_worker_set_replies(struct skv_worker *w, const struct skv_replies *r)
{
    atomic_store(&w->replies, r);
}

struct skv_tenant_stats *skv_worker_tenant(struct skv_worker *w, const char *tenant)
{
    struct skv_tenant_table *t = &w->tenants;
    const char *name = tenant && *tenant ? tenant : SKV_TENANT_DEFAULT;
    if (strcmp(name, SKV_TENANT_ADMIN) != 0 && !skv_tenant_name_ok(name)) /* keeps a failure's message */
        name = SKV_TENANT_OTHER;
    for (int i = 0; i < t->n; i++)
        if (strcmp(t->t[i].name, name) == 0)
            return &t->t[i];
    int named = 0; /* rows of real tenants so far */
    for (int i = 0; i < t->n; i++)
        named += strcmp(t->t[i].name, SKV_TENANT_ADMIN) != 0 && strcmp(t->t[i].name, SKV_TENANT_OTHER) != 0;
    bool special = strcmp(name, SKV_TENANT_ADMIN) == 0 || strcmp(name, SKV_TENANT_OTHER) == 0;
    if (!special && named >= SKV_TENANT_STATS)
        return skv_worker_tenant(w, SKV_TENANT_OTHER);
    struct skv_tenant_stats *x = &t->t[t->n++]; /* room: SKV_TENANT_STATS named + the two */
    memset(x, 0, sizeof *x);
    snprintf(x->name, sizeof x->name, "%s", name);
    return x;
}

static bool count_session(void *user, struct skv_session *s)
{
    struct skv_worker *w = user;
    struct skv_tenant_stats *x = skv_worker_tenant(w, s->tenant);
    x->sessions++;
    x->bytes += s->bytes + s->compressor_bytes;
    return false;
}

void skv_worker_tenant_table(struct skv_worker *w, struct skv_tenant_table *out)
{
    for (int i = 0; i < w->tenants.n; i++) {
        struct skv_tenant_stats *x = &w->tenants.t[i];
        x->sessions = x->bytes = x->queued = x->decodes = x->kept_bytes = 0;
    }
    skv_session_foreach(w->sessions, count_session, w);
    struct skv_tenant_tally kept = {0}; /* the tenants with kept prefixes, each once */
    for (const struct skv_prefix_entry *e = w->prefix.head; e; e = e->next)
        if (skv_tenant_tally_add(&kept, e->tenant, 0))
            break; /* no memory: those counted so far */
    for (size_t i = 0; i < kept.n; i++)
        skv_worker_tenant(w, kept.u[i].tenant)->kept_bytes +=
            skv_prefix_cache_tenant_bytes(&w->prefix, kept.u[i].tenant, true);
    skv_tenant_tally_free(&kept);
    for (const struct skv_decode *d = w->decodes; d; d = d->next)
        skv_worker_tenant(w, d->job->tenant)->decodes++;
    pthread_mutex_lock(&w->mu);
    for (const struct skv_job *q = w->head; q; q = q->next)
        if (q->kind == SKV_JOB_REQUEST)
            skv_worker_tenant(w, q->tenant)->queued++;
    pthread_mutex_unlock(&w->mu);
    *out = w->tenants;
}

/* Ends the running decodes of the client a client-gone notice is about: nobody reads their
 * tokens any more, and every round they stay in slows the other decodes. They end between two
 * rounds, so each session holds every token generated so far, its n_past and the logits of its
 * next token; the final "cancelled" reply goes out (the socket thread drops it) and the session
 * waits for its lease like any other. The client's queued requests are served as they come.
 * Returns how many ended. */
static int cancel_decodes_of(struct skv_worker *w, const struct skv_job *notice)
{
    int n = 0;
    for (struct skv_decode **pp = &w->decodes; *pp;) {
        struct skv_decode *d = *pp;
        if (!skv_job_same_sender(d->job, notice)) {
            pp = &d->next;
            continue;
        }
        *pp = d->next;
        skv_requests_decode_cancel(w, d);
        skv_requests_decode_end(w, d);
        n++;
    }
    w->metrics.decodes_cancelled_gone += (uint64_t)n;
    return n;
}

/* The session table's pressure hooks: a retained prefix counts for its tenant and goes before
 * any session. */
static uint64_t retained_bytes(void *user, const char *tenant, bool alone)
{
    return skv_prefix_cache_tenant_bytes(user, tenant, alone);
}

static bool drop_retained(void *user, const char *tenant)
{
    return skv_prefix_cache_drop_lru(user, tenant);
}

static void publish_stats(struct skv_worker *w)
{
    struct skv_stats_input in;
    skv_worker_stats_input(w, &in);
    atomic_store(&w->st_sessions, (unsigned)in.n_sessions);
    atomic_store(&w->st_pool_used, (unsigned long long)in.pool_bytes_used);
    pthread_mutex_lock(&w->snap_mu);
    w->snap = in;
    pthread_mutex_unlock(&w->snap_mu);
}

/* The tenants' table for HTTP /metrics (the socket and HTTP threads read it under snap_mu). */
static void publish_tenants(struct skv_worker *w)
{
    struct skv_tenant_table t;
    skv_worker_tenant_table(w, &t);
    pthread_mutex_lock(&w->snap_mu);
    w->tenant_snap = t;
    pthread_mutex_unlock(&w->snap_mu);
}

static uint64_t monotonic_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static uint64_t monotonic_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

void skv_worker_beat(struct skv_worker *w)
{
    atomic_store(&w->heartbeat_ms, monotonic_ms());
}

static void store_progress(void *w)
{
    skv_worker_beat(w);
}

bool skv_watchdog_ok(uint64_t now_ms, uint64_t heartbeat_ms, bool idle, uint64_t interval_ms)
{
    return idle || now_ms < heartbeat_ms || now_ms - heartbeat_ms < interval_ms / 2;
}

bool skv_worker_alive(struct skv_worker *w, uint64_t interval_ms)
{
    /* idle first: the thread writes the heartbeat before it clears idle, so a cleared idle
     * comes with the heartbeat of that wake-up */
    bool idle = atomic_load(&w->idle);
    uint64_t beat = atomic_load(&w->heartbeat_ms);
    return skv_watchdog_ok(monotonic_ms(), beat, idle, interval_ms);
}

/* Appends one reason to a probe's text, after "; " when it holds one already. */
static void __attribute__((format(printf, 3, 4))) reason_add(char *buf, size_t cap, const char *fmt, ...)
{
    size_t len = strlen(buf);
    if (len && len + 2 < cap) {
        memcpy(buf + len, "; ", 3);
        len += 2;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + len, cap - len, fmt, ap);
    va_end(ap);
}

int skv_worker_health(struct skv_worker *w, bool ready, uint64_t stall_ms, char *buf, size_t cap)
{
    /* atomics only: a probe must answer while the engine thread is wedged holding w->mu */
    buf[0] = '\0';
    if (skv_worker_device_lost(w))
        reason_add(buf, cap, "device lost: the backend can run nothing more");
    bool idle = atomic_load(&w->idle); /* first, as skv_worker_alive reads them */
    uint64_t beat = atomic_load(&w->heartbeat_ms), now = monotonic_ms();
    if (!skv_watchdog_ok(now, beat, idle, 2 * stall_ms))
        reason_add(buf, cap, "engine stalled: no progress for %.1f s (health-stall-seconds %llu)",
                   (double)(now - beat) / 1000, (unsigned long long)(stall_ms / 1000));
    if (ready) {
        unsigned queued = atomic_load(&w->st_queue);
        if (atomic_load(&w->stop_asked))
            reason_add(buf, cap, "stopping: new requests are refused");
        if (!atomic_load(&w->serving))
            reason_add(buf, cap, "starting: restoring persisted sessions");
        if (queued >= (unsigned)w->cfg->queue_depth)
            reason_add(buf, cap, "queue full: %u requests wait (queue-depth)", queued);
    }
    int code = buf[0] ? 503 : 200;
    if (!buf[0])
        reason_add(buf, cap, ready ? "ready" : "ok");
    size_t len = strlen(buf);
    if (len + 1 < cap)
        memcpy(buf + len, "\n", 2);
    return code;
}

bool skv_worker_device_lost(struct skv_worker *w)
{
    return atomic_load(&w->device_lost);
}

void skv_worker_note_failure(struct skv_worker *w, int status)
{
    struct skv_backend *be = w->m->be;
    if (status != SKV_E_DEVICE || atomic_load(&w->device_lost) || !be->ops->device_lost || !be->ops->device_lost(be))
        return;
    atomic_store(&w->device_lost, true);
    skv_log(SKV_LOG_ERROR, "the %s device can run nothing more (%s): snapkvd stops with an error so that its "
            "service manager starts a fresh one", be->name, skv_error_msg());
}

/* One token for every running decode, up to SKV_ENGINE_MAX_BATCH per forward; the finished
 * ones leave the list. */
static void decode_rounds(struct skv_worker *w)
{
    struct skv_decode *batch[SKV_ENGINE_MAX_BATCH];
    bool finished[SKV_ENGINE_MAX_BATCH];
    uint64_t start = monotonic_us();
    for (struct skv_decode *d = w->decodes; d;) {
        int n = 0;
        for (; d && n < SKV_ENGINE_MAX_BATCH; d = d->next)
            batch[n++] = d;
        uint64_t t0 = monotonic_us();
        skv_requests_decode_round(w, batch, n, finished);
        double share = (double)(monotonic_us() - t0) * 1e-6 / n;
        for (int i = 0; i < n; i++)
            skv_worker_tenant(w, batch[i]->job->tenant)->engine_seconds += share;
        skv_worker_beat(w);
        for (int i = 0; i < n; i++) {
            if (!finished[i])
                continue;
            struct skv_decode **pp = &w->decodes;
            while (*pp != batch[i])
                pp = &(*pp)->next;
            *pp = batch[i]->next;
            skv_requests_decode_end(w, batch[i]);
        }
    }
    w->last_round_us = monotonic_us();
    w->round_cost_us = w->last_round_us - start;
}

/* Takes job (after prev, or the head when prev is NULL) out of the queue and its counts (w->mu
 * held). */
static void dequeue_locked(struct skv_worker *w, struct skv_job *prev, struct skv_job *job)
{
    if (prev)
        prev->next = job->next;
    else
        w->head = job->next;
    if (w->tail == job)
        w->tail = prev;
    if (job->kind == SKV_JOB_CLIENT_GONE) {
        w->notices--;
    } else {
        w->queued--;
        w->queued_bytes -= job->bytes;
    }
    atomic_store(&w->st_queue, (unsigned)w->queued);
    atomic_store(&w->st_queue_bytes, (unsigned long long)w->queued_bytes);
}

/* ---- fair order between tenants (queue-order = fair) ------------------------------------------
 * Start-time fair queueing on the engine's time: each tenant has a virtual time, the engine time
 * its requests took, which starts at the clock when it comes (back) with work; the engine runs
 * the oldest eligible request of the tenant whose time is least, and the clock moves to that
 * time. A tenant with a backlog of long prompts then holds up another tenant's request for one
 * of them at most, not for all; alone, it has the engine to itself. Notices come first. */

/* The tenant's entry in the table of those ahead of the clock, or NULL. */
static struct skv_tenant_clock *clock_find(struct skv_worker *w, const char *tenant)
{
    for (int i = 0; i < w->n_clocks; i++)
        if (strcmp(w->clocks[i].name, tenant) == 0)
            return &w->clocks[i];
    return NULL;
}

/* Where a tenant stands: its virtual time, or the clock's when it is behind or unknown. */
static uint64_t clock_of(struct skv_worker *w, const char *tenant)
{
    const struct skv_tenant_clock *c = clock_find(w, tenant);
    return c && c->vt_us > w->vclock_us ? c->vt_us : w->vclock_us;
}

/* `us` of a tenant's engine time in virtual time: tenant-weights' weight of k makes it cost 1/k. */
static uint64_t weighted(const struct skv_worker *w, const char *tenant, uint64_t us)
{
    for (int i = 0; i < w->n_weights; i++)
        if (strcmp(w->weights[i].name, tenant) == 0)
            return us / (uint64_t)w->weights[i].weight;
    return us;
}

/* Charges a tenant `us` of engine time on a request it ran: to its engine seconds, and, divided
 * by its weight, to its virtual time from `start` (where it stood when the request was chosen),
 * or from where it stands now when that is later: its own short requests that ran inside this
 * one were charged meanwhile, and add up with it. The clock is not a floor here: a nested
 * request of a tenant ahead moved it while this one ran, and this one was chosen behind it.
 * The table keeps only tenants ahead of the clock; when it is full, the one nearest the clock
 * goes (it comes back at the clock, a small head start). */
static void charge(struct skv_worker *w, const char *tenant, uint64_t start, uint64_t us)
{
    skv_worker_tenant(w, tenant)->engine_seconds += (double)us * 1e-6;
    us = weighted(w, tenant, us);
    struct skv_tenant_clock *c = clock_find(w, tenant);
    uint64_t vt = (c && c->vt_us > start ? c->vt_us : start) + (us ? us : 1);
    if (!c) {
        int n = 0; /* drop those the clock passed */
        for (int i = 0; i < w->n_clocks; i++)
            if (w->clocks[i].vt_us > w->vclock_us)
                w->clocks[n++] = w->clocks[i];
        w->n_clocks = n;
        if (n == SKV_FAIR_TENANTS) {
            int low = 0;
            for (int i = 1; i < n; i++)
                low = w->clocks[i].vt_us < w->clocks[low].vt_us ? i : low;
            c = &w->clocks[low];
        } else {
            c = &w->clocks[w->n_clocks++];
        }
        snprintf(c->name, sizeof c->name, "%s", tenant);
        c->vt_us = 0;
    }
    if (vt > c->vt_us)
        c->vt_us = vt;
}

/* Whether q may run before every request ahead of it: none of them is from its sender or names
 * its session, so each client's requests, and each session's, still run in the order sent. */
static bool may_go_first(const struct skv_worker *w, const struct skv_job *q)
{
    for (const struct skv_job *a = w->head; a != q; a = a->next)
        if (skv_job_same_sender(a, q) ||
            (q->session && a->session && memcmp(q->session, a->session, SKV_SESSION_ID_BYTES) == 0))
            return false;
    return true;
}

/* Takes out of the queue the request to run next (w->mu held; the queue is not empty): with
 * fifo the oldest; with fair, among the oldest SKV_FAIR_WINDOW, a notice that may go first, or
 * the oldest that may go first of the tenant with the least time. *start: where its tenant
 * stood. */
static struct skv_job *take_next_locked(struct skv_worker *w, uint64_t *start)
{
    struct skv_job *best = w->head, *best_prev = NULL;
    uint64_t best_vt = w->head->kind == SKV_JOB_CLIENT_GONE ? 0 : clock_of(w, w->head->tenant);
    struct skv_job *prev = w->head;
    int k = 1;
    for (struct skv_job *q = w->head->next; w->fair && best_vt > 0 && q && k < SKV_FAIR_WINDOW;
         prev = q, q = q->next, k++) {
        uint64_t vt = q->kind == SKV_JOB_CLIENT_GONE ? 0 : clock_of(w, q->tenant);
        if (vt >= best_vt || !may_go_first(w, q))
            continue;
        best = q;
        best_prev = prev;
        best_vt = vt;
    }
    if (best != w->head)
        w->metrics.requests_reordered++;
    dequeue_locked(w, best_prev, best);
    if (best_vt > w->vclock_us)
        w->vclock_us = best_vt;
    *start = best_vt;
    return best;
}

/* Whether a request is short enough to run inside another's long forward: starting or ending a
 * decode, the admin reads, PIN, RELEASE, FORK, a PREFILL or APPEND of at most 32 token ids or
 * 128 bytes of text (its forward runs on the decode engine, without ticks of its own), and a
 * TOKENIZE or DETOKENIZE of at most 4096 bytes of text or 4096 ids (no forward: about a
 * millisecond). */
#define OVERTAKE_TOKENS 32
#define OVERTAKE_TEXT 128
#define OVERTAKE_TOKENIZE 4096 /* bytes of text a TOKENIZE, ids a DETOKENIZE may have to be short */
static bool job_short(const struct skv_job *job)
{
    const Snapkv__Request *r = job->req;
    switch (r->command_case) {
    case SNAPKV__REQUEST__COMMAND_DECODE:
    case SNAPKV__REQUEST__COMMAND_CANCEL:
    case SNAPKV__REQUEST__COMMAND_STATS:
    case SNAPKV__REQUEST__COMMAND_LIST:
    case SNAPKV__REQUEST__COMMAND_INSPECT:
    case SNAPKV__REQUEST__COMMAND_PIN:
    case SNAPKV__REQUEST__COMMAND_RELEASE:
    case SNAPKV__REQUEST__COMMAND_FORK:
        return true;
    case SNAPKV__REQUEST__COMMAND_PREFILL:
        return r->prefill->n_tokens <= OVERTAKE_TOKENS && strlen(r->prefill->text) <= OVERTAKE_TEXT;
    case SNAPKV__REQUEST__COMMAND_APPEND:
        return r->append->n_tokens <= OVERTAKE_TOKENS && strlen(r->append->text) <= OVERTAKE_TEXT;
    case SNAPKV__REQUEST__COMMAND_TOKENIZE: /* no forward: short unless it is long text */
        return strnlen(r->tokenize->text, OVERTAKE_TOKENIZE + 1) <= OVERTAKE_TOKENIZE;
    case SNAPKV__REQUEST__COMMAND_DETOKENIZE:
        return r->detokenize->n_tokens <= OVERTAKE_TOKENIZE;
    default:
        return false;
    }
}

/* Takes out of the queue a short request that may run before the ones ahead of it: none of them
 * is from its sender (the running request's sender counts as ahead) or names its session, and
 * that session is not busy (the running forward's, or decoding); the first such, or with
 * queue-order = fair the first of the tenant with the least engine time. NULL: none. */
static struct skv_job *take_short(struct skv_worker *w)
{
    pthread_mutex_lock(&w->mu);
    struct skv_job *prev = NULL, *found = NULL, *found_prev = NULL;
    uint64_t found_vt = 0;
    /* the oldest SKV_FAIR_WINDOW only, as fair order: the socket thread waits for this lock. With
     * queue-order = fair, of those that may run the one of the tenant with the least engine time
     * (the first of it), as take_next_locked chooses: before, the first in the queue, so a tenant's
     * backlog of short requests went before another tenant's DECODE queued after it */
    int k = 0;
    for (struct skv_job *q = w->head; q && !w->stopping && k < SKV_FAIR_WINDOW; prev = q, q = q->next, k++) {
        if (q->kind != SKV_JOB_REQUEST || !job_short(q))
            continue;
        uint64_t vt = w->fair ? clock_of(w, q->tenant) : 0;
        if (found && vt >= found_vt) /* (before the checks that cost: one no better than the one found) */
            continue;
        bool blocked = (w->running && skv_job_same_sender(w->running, q)) ||
                       (w->outer && skv_job_same_sender(w->outer, q)) || !may_go_first(w, q);
        const uint8_t *sid = q->session;
        struct skv_session *s = sid && !blocked ? skv_session_find(w->sessions, sid, NULL) : NULL;
        /* a CANCEL is for a decoding (busy) session; none may touch the running forward's */
        bool cancel = q->req->command_case == SNAPKV__REQUEST__COMMAND_CANCEL;
        if (blocked || (s && (s == w->forward_session || (s->busy && !cancel))))
            continue;
        /* one a client names that is not here for its tenant may come from the store (store =
         * ...): a load, and the evictions it may make, are not short */
        bool loads = w->store && sid && q->sock == 0 && !cancel &&
                     q->req->command_case != SNAPKV__REQUEST__COMMAND_RELEASE;
        if (loads && !skv_session_find(w->sessions, sid, q->tenant))
            continue;
        found = q;
        found_prev = prev;
        found_vt = vt;
        if (!w->fair)
            break;
    }
    if (found)
        dequeue_locked(w, found_prev, found);
    pthread_mutex_unlock(&w->mu);
    return found;
}

/* Runs a request (a DECODE starts: its tokens come with the rounds); one whose client stopped
 * waiting for it (its deadline passed in the queue) is answered TIMEOUT instead, but for a
 * CANCEL and a RELEASE: a CANCEL ends work its client gave up on, which dropped, would run on
 * (a DECODE to its max_tokens); a RELEASE frees a cache its client is done with, which dropped,
 * would hold its blocks until its lease ends (a retry gets NOT_FOUND). */
static void run_job(struct skv_worker *w, struct skv_job *job)
{
    w->metrics.requests++;
    skv_worker_tenant(w, job->tenant)->requests++;
    uint64_t now = monotonic_ms();
    bool always = job->req->command_case == SNAPKV__REQUEST__COMMAND_CANCEL ||
                  job->req->command_case == SNAPKV__REQUEST__COMMAND_RELEASE;
    job->late = job->deadline_ms && now > job->deadline_ms;
    if (job->late && !always) {
        w->metrics.requests_past_deadline++;
        char msg[160];
        snprintf(msg, sizeof msg, "the request waited %llu ms for the engine, past its deadline of %u ms (the "
                 "client's timeout): not run",
                 (unsigned long long)(now - job->deadline_ms + job->req->deadline_ms), job->req->deadline_ms);
        skv_requests_fail(w, job, SKV_E_TIMEOUT, msg);
        job_free(job);
        return;
    }
    if (job->req->command_case == SNAPKV__REQUEST__COMMAND_DECODE) {
        struct skv_decode *d = skv_requests_decode_start(w, job);
        if (d) {
            /* append at the tail: round-robin order */
            struct skv_decode **pp = &w->decodes;
            while (*pp)
                pp = &(*pp)->next;
            *pp = d;
            return; /* the decode owns the job now */
        }
    } else {
        skv_requests_execute(w, job);
    }
    job_free(job);
}

/* ---- another tenant's request inside a long forward (queue-order = fair, fair-slice-ms) --------
 * Fair order chooses between requests, so a tenant whose request comes while another's long
 * prefill runs would wait for all of it. Once the running request has had fair-slice-ms more
 * engine time than a waiting request's tenant (virtual time: its own time so far, divided by its
 * weight), that request runs at the forward's next tick, on an engine of its own (nested_engine),
 * as a request run from the loop would; the forward then goes on where it stopped, its results
 * the same bits. One level deep: inside the nested request's forward only short requests and
 * decode rounds run. */

/* Whether a request may run inside another tenant's forward: the commands that are not short
 * and need nothing the running request holds (its session stays busy, so none may name it). */
static bool job_nestable(const struct skv_job *job)
{
    switch (job->req->command_case) {
    case SNAPKV__REQUEST__COMMAND_PREFILL:
    case SNAPKV__REQUEST__COMMAND_APPEND:
    case SNAPKV__REQUEST__COMMAND_COMPRESS:
    case SNAPKV__REQUEST__COMMAND_EXPORT_KV:
    case SNAPKV__REQUEST__COMMAND_IMPORT_KV:
        return true;
    default:
        return false;
    }
}

/* Takes out of the queue the request fair order would run now instead of the running one, or
 * NULL: among the oldest SKV_FAIR_WINDOW waiting, the oldest of the tenant with the least time,
 * of another tenant than the running request's, whose time is at least fair-slice-ms behind the
 * running tenant's now; it may go first (below), is not from the running request's sender, and
 * names no busy session. *start: where its tenant stood. */
static struct skv_job *take_nested(struct skv_worker *w, uint64_t *start)
{
    const struct skv_job *r = w->running;
    uint64_t slice = (uint64_t)w->cfg->fair_slice_ms * 1000;
    if (!w->fair || !slice || w->nesting || !r || r->kind != SKV_JOB_REQUEST || atomic_load(&w->st_queue) == 0)
        return NULL;
    uint64_t took = monotonic_us() - w->run_t0_us;
    uint64_t now_vt = w->run_vt_us + weighted(w, r->tenant, took > w->nested_us ? took - w->nested_us : 0);
    if (now_vt < slice)
        return NULL;
    pthread_mutex_lock(&w->mu);
    struct skv_job *best = NULL, *best_prev = NULL, *prev = NULL;
    uint64_t best_vt = now_vt - slice + 1; /* a tenant must be at least a slice behind */
    int k = 0;
    for (struct skv_job *q = w->head; q && !w->stopping && k < SKV_FAIR_WINDOW; prev = q, q = q->next, k++) {
        if (q->kind != SKV_JOB_REQUEST || !job_nestable(q) || strcmp(q->tenant, r->tenant) == 0 ||
            skv_job_same_sender(r, q))
            continue;
        uint64_t vt = clock_of(w, q->tenant);
        if (vt >= best_vt || !may_go_first(w, q))
            continue;
        const struct skv_session *s = q->session ? skv_session_find(w->sessions, q->session, NULL) : NULL;
        if (s && (s->busy || s == w->forward_session))
            continue;
        best = q;
        best_prev = prev;
        best_vt = vt;
    }
    if (best) {
        dequeue_locked(w, best_prev, best);
        if (best_vt > w->vclock_us)
            w->vclock_us = best_vt;
        *start = best_vt;
    }
    pthread_mutex_unlock(&w->mu);
    return best;
}

static void run_job(struct skv_worker *w, struct skv_job *job);

/* Runs a request taken by take_nested inside the running request's forward: it is the running
 * one meanwhile (its client's notice or deadline stops its PREFILL, its sender's requests wait),
 * its forwards run on nested_engine, and its time, less what ran inside its own yields, is its
 * tenant's; all of it is outside the running request's own time. */
static void run_nested(struct skv_worker *w, struct skv_job *job, uint64_t start)
{
    const struct skv_job *outer = w->running;
    uint64_t outer_nested = w->nested_us, outer_vt = w->run_vt_us, outer_t0 = w->run_t0_us;
    char tenant[sizeof job->tenant];
    memcpy(tenant, job->tenant, sizeof tenant); /* run_job may free the job */
    w->metrics.requests_nested++;
    w->outer = outer;
    w->running = job;
    w->nesting = true;
    w->nested_us = 0;
    w->run_vt_us = start;
    w->run_t0_us = monotonic_us();
    run_job(w, job);
    /* nesting is the exception: its engine does not keep buffers as large as the longest
     * prompt it ran (a 32K-token one's are gigabytes on a large model) */
    skv_engine_release_scratch(w->nested_engine);
    uint64_t took = monotonic_us() - w->run_t0_us;
    charge(w, tenant, start, took > w->nested_us ? took - w->nested_us : 0);
    w->nesting = false;
    w->running = outer;
    w->outer = NULL;
    w->nested_us = outer_nested;
    w->run_vt_us = outer_vt;
    w->run_t0_us = outer_t0;
}

#define OVERTAKE_MAX 8 /* short requests one yield may run */

/* The decodes of clients whose client-gone notices wait in the queue behind a long forward end
 * now, not when the forward ends: until then each round the yields run gave them tokens nobody
 * read, slowing the forward, and held their sessions busy (a RELEASE refused, no eviction). The
 * notices stay queued, and run in their turn (their CUDA buffers close then). Only notices of
 * clients with a decode are taken (the others would fill the GONE_PER_YIELD a yield takes at
 * every yield), and the walk stops at the last notice. */
#define GONE_PER_YIELD 16
static void cancel_gone_decodes(struct skv_worker *w)
{
    struct skv_job gone[GONE_PER_YIELD];
    int n = 0;
    pthread_mutex_lock(&w->mu);
    int left = w->notices; /* (the decodes are this thread's: read under the lock too) */
    for (const struct skv_job *j = left ? w->head : NULL; j && left > 0 && n < GONE_PER_YIELD; j = j->next) {
        if (j->kind != SKV_JOB_CLIENT_GONE)
            continue;
        left--;
        bool decoding = false;
        for (const struct skv_decode *d = w->decodes; d && !decoding; d = d->next)
            decoding = skv_job_same_sender(d->job, j);
        if (!decoding)
            continue;
        gone[n].sock = j->sock;
        gone[n].identity_len = j->identity_len;
        memcpy(gone[n].identity, j->identity, j->identity_len);
        n++;
    }
    pthread_mutex_unlock(&w->mu);
    for (int i = 0; i < n && w->decodes; i++)
        cancel_decodes_of(w, &gone[i]);
}

void skv_worker_yield(struct skv_worker *w)
{
    /* the queue is the socket thread's too: its count, kept under the lock, is read atomically */
    if (w->yielding || (!w->decodes && atomic_load(&w->st_queue) == 0))
        return;
    /* running decodes wait at most decode-yield-ms, and less when their rounds are cheap:
     * decode-share of the engine's time is theirs while a long forward runs */
    uint64_t wait_us = (uint64_t)w->cfg->decode_yield_ms * 1000;
    int share = (int)w->cfg->decode_share;
    if (w->decodes && share > 0 && w->round_cost_us * (uint64_t)(100 - share) / (uint64_t)share < wait_us)
        wait_us = w->round_cost_us * (uint64_t)(100 - share) / (uint64_t)share;
    if (monotonic_us() - w->last_round_us < wait_us)
        return;
    uint64_t t0 = monotonic_us(), nested_start;
    struct skv_job *job = take_nested(w, &nested_start);
    if (job)
        run_nested(w, job, nested_start);
    w->yielding = true;
    for (int i = 0; i < OVERTAKE_MAX && (job = take_short(w)); i++) {
        w->metrics.requests_overtook++;
        uint64_t start = clock_of(w, job->tenant), t = monotonic_us();
        char tenant[sizeof job->tenant];
        memcpy(tenant, job->tenant, sizeof tenant); /* run_job may free the job */
        run_job(w, job);
        charge(w, tenant, start, monotonic_us() - t);
        skv_worker_beat(w);
    }
    pthread_mutex_lock(&w->mu);
    bool stopping = w->stopping;
    pthread_mutex_unlock(&w->mu);
    if (w->decodes && !stopping) /* at a stop they are cancelled when the forward ends */
        cancel_gone_decodes(w);
    if (w->decodes && !stopping) { /* (the gone clients' cancelled first) */
        decode_rounds(w);
        w->metrics.decode_rounds_yielded++;
    }
    w->last_round_us = monotonic_us();
    w->nested_us += monotonic_us() - t0; /* not the forward's tenant's time */
    w->yielding = false;
}

/* Whether a job may change what a checkpoint saves: not the reads (a monitor polling STATS would
 * otherwise bring a checkpoint every interval). */
static bool job_changes_sessions(const struct skv_job *job)
{
    if (job->kind != SKV_JOB_REQUEST)
        return true; /* a client gone: its decodes cancelled */
    switch (job->req->command_case) {
    case SNAPKV__REQUEST__COMMAND_STATUS:
    case SNAPKV__REQUEST__COMMAND_LIST:
    case SNAPKV__REQUEST__COMMAND_INSPECT:
    case SNAPKV__REQUEST__COMMAND_SAVE:
    case SNAPKV__REQUEST__COMMAND_STATS:
    case SNAPKV__REQUEST__COMMAND_CONFIG_GET:
    case SNAPKV__REQUEST__COMMAND_EXPORT_KV:
    case SNAPKV__REQUEST__COMMAND_REGISTER_BUFFER:
    case SNAPKV__REQUEST__COMMAND_TOKENIZE:
    case SNAPKV__REQUEST__COMMAND_DETOKENIZE:
        return false;
    default:
        return true;
    }
}

/* persist-interval-seconds: a checkpoint once the engine is idle (nothing queued, no decode
 * running), sessions may have changed, and the interval has passed since the last save. It
 * gives way to a request that arrives meanwhile, but not after CHECKPOINT_GIVE_WAY such times
 * in a row; and once twice the interval has passed it runs whatever waits (between two decode
 * rounds: a session being decoded is saved with the tokens it has). So a daemon that is never
 * idle for a whole checkpoint still gets one, its requests and decodes then waiting for it. */
#define CHECKPOINT_GIVE_WAY 3
/* A checkpoint that failed (a full disk, a directory that cannot be written) is tried again
 * after the interval, and never sooner than this: each try writes what it can and holds the
 * engine meanwhile, so a try every second would turn a full disk into a daemon that serves
 * little and writes much. */
#define CHECKPOINT_RETRY_MS 30000
static void maybe_checkpoint(struct skv_worker *w, uint64_t now)
{
    int64_t every = w->cfg->persist_interval_seconds;
    if (!w->cfg->persist || every <= 0 || !w->persist_dirty || now - w->persist_ms < (uint64_t)every * 1000)
        return;
    uint64_t retry = (uint64_t)every * 1000 > CHECKPOINT_RETRY_MS ? (uint64_t)every * 1000 : CHECKPOINT_RETRY_MS;
    if (w->persist_failed_ms && now - w->persist_failed_ms < retry)
        return;
    /* overdue: twice the interval since the last save, or since the last failure */
    uint64_t since = w->persist_failed_ms > w->persist_ms ? w->persist_failed_ms : w->persist_ms;
    bool overdue = now - since >= 2 * (uint64_t)every * 1000;
    if (!overdue && (w->decodes || skv_worker_has_queued(w)))
        return;
    if (atomic_load(&w->device_lost))
        return; /* the daemon is stopping; the last checkpoint stays as it is */
    w->persist_dirty = false; /* a request run during it sets it again */
    int rc = skv_requests_persist_checkpoint(w, !overdue && w->persist_gave_way < CHECKPOINT_GIVE_WAY);
    w->persist_gave_way = rc == SKV_E_CANCELLED ? w->persist_gave_way + 1 : 0;
    if (rc == SKV_OK) {
        w->metrics.persist_checkpoints++;
        w->persist_failed_ms = 0;
    } else {
        w->persist_dirty = true; /* tried again at the next idle second, or after a failure the retry time */
        if (rc != SKV_E_CANCELLED) {
            w->metrics.persist_failures++;
            w->persist_failed_ms = skv_now_ms();
            skv_log(SKV_LOG_WARN, "persist: checkpoint: %s; the next try in %llu s", skv_error_msg(),
                    (unsigned long long)(retry / 1000));
        }
    }
}

static void *worker_main(void *arg)
{
    struct skv_worker *w = arg;
    w->push = zmq_socket(w->zctx, ZMQ_PUSH);
    int linger = 2000;
    zmq_setsockopt(w->push, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_connect(w->push, w->endpoint) < 0)
        skv_log(SKV_LOG_ERROR, "worker: connect %s: %s", w->endpoint, zmq_strerror(zmq_errno()));
    if (w->events) { /* whatever a subscriber knew of this host before is gone */
        Snapkv__AllCleared ac = SNAPKV__ALL_CLEARED__INIT;
        Snapkv__KvEvent ev = SNAPKV__KV_EVENT__INIT;
        ev.kind_case = SNAPKV__KV_EVENT__KIND_CLEARED;
        ev.cleared = &ac;
        event_send(w, &ev);
    }
    w->persist_ms = skv_now_ms();
    skv_requests_rows_id(w); /* the executable's hash, before any request waits for it */
    if (w->cfg->persist && skv_requests_persist_restore(w))
        skv_log(SKV_LOG_WARN, "persist: %s", skv_error_msg());
    publish_stats(w);
    atomic_store(&w->serving, true);
    uint64_t last_expire = skv_now_ms();
    for (;;) {
        pthread_mutex_lock(&w->mu);
        while (!w->head && !w->decodes && !w->stopping) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_sec += 1;
            atomic_store(&w->idle, true);
            pthread_cond_timedwait(&w->cv, &w->mu, &ts);
            if (!w->head && !w->decodes)
                break; /* a second passed: expire leases */
        }
        skv_worker_beat(w);
        atomic_store(&w->idle, false);
        uint64_t start = 0;
        struct skv_job *job = w->head ? take_next_locked(w, &start) : NULL;
        bool stopping = w->stopping;
        pthread_mutex_unlock(&w->mu);

        if (stopping) {
            if (job) { /* notices need nothing: every CUDA buffer closes below */
                if (job->kind == SKV_JOB_REQUEST)
                    skv_requests_fail(w, job, SKV_E_CANCELLED, "snapkvd is shutting down");
                job_free(job);
                continue;
            }
            while (w->decodes) {
                struct skv_decode *d = w->decodes;
                w->decodes = d->next;
                skv_requests_decode_cancel(w, d);
                skv_requests_decode_free(d);
            }
            /* a lost device: the save's reads would fail, and it would then sweep the files of
             * every session it could not read */
            if (w->cfg->persist && atomic_load(&w->device_lost))
                skv_log(SKV_LOG_WARN, "persist: the device is lost: no save at this stop (%s)",
                        w->cfg->persist_interval_seconds > 0
                            ? "the last checkpoint stays"
                            : "with no persist-interval-seconds there is no checkpoint: the sessions are lost");
            else if (w->cfg->persist && skv_requests_persist_save(w)) /* every session as it stands now */
                skv_log(SKV_LOG_ERROR, "persist: no session saved: %s", skv_error_msg());
            else if (!w->cfg->persist && !atomic_load(&w->device_lost)) /* store = ...: to the hosts that share it */
                skv_requests_store_drain(w);
            break;
        }
        if (job && job->kind == SKV_JOB_CLIENT_GONE) {
            int cancelled = cancel_decodes_of(w, job);
            int closed = skv_requests_client_gone(w, job);
            unsigned long long more = 0;
            if ((cancelled || closed) && skv_log_allow(&w->log_gone, skv_now_ms(), &more))
                skv_log(SKV_LOG_INFO, "a client whose connection closed: %d decode(s) cancelled, %d CUDA buffer(s) "
                        "closed (%llu more such clients since the last such line)", cancelled, closed, more);
            job_free(job);
        } else if (job) {
            char tenant[sizeof job->tenant];
            memcpy(tenant, job->tenant, sizeof tenant); /* run_job may free the job */
            uint64_t t = monotonic_us();
            w->nested_us = 0;
            w->run_vt_us = start;
            w->run_t0_us = t;
            w->running = job; /* short requests queued behind it may run inside its forward */
            w->persist_dirty |= job_changes_sessions(job); /* before run_job, which frees it */
            run_job(w, job);
            w->running = NULL;
            uint64_t took = monotonic_us() - t;
            charge(w, tenant, start, took > w->nested_us ? took - w->nested_us : 0);
        }
        skv_worker_beat(w);
        pthread_mutex_lock(&w->mu);
        bool stop_asked = w->stopping;
        pthread_mutex_unlock(&w->mu);
        if (stop_asked) /* no round nor checkpoint more: the top of the loop cancels and saves */
            continue;
        if (w->decodes)
            w->persist_dirty = true;
        decode_rounds(w);
        uint64_t now = skv_now_ms();
        if (now - last_expire >= 1000) {
            int closed = skv_requests_ipc_expire(w, now);
            if (closed)
                skv_log(SKV_LOG_INFO, "closed %d CUDA buffer(s) of clients idle past their lease", closed);
            int n = skv_session_expire(w->sessions, now);
            if (n)
                skv_log(SKV_LOG_INFO, "released %d session(s) past their lease", n);
            int dropped = skv_prefix_cache_expire(&w->prefix, now, (uint64_t)w->cfg->lease_seconds * 1000);
            w->persist_dirty |= n > 0 || dropped > 0; /* a checkpoint would restore them */
            last_expire = now;
            publish_tenants(w);
            maybe_checkpoint(w, now);
        }
        publish_stats(w);
    }
    skv_requests_ipc_close_all(w);
    skv_requests_persist_close(w);
    if (w->done_marker) { /* read under the lock with `stopping`, which request_stop set with it */
        uint8_t s = SKV_WORKER_DONE_SOCK;
        send_frame(w->push, &s, 1, ZMQ_SNDMORE);
        send_frame(w->push, "", 0, ZMQ_SNDMORE);
        send_frame(w->push, "", 0, 0);
    }
    zmq_close(w->push);
    w->push = NULL; /* no event after this */
    return NULL;
}

int skv_worker_start(void *zctx, const char *reply_endpoint, const struct skv_config *cfg, struct skv_model *m,
                     struct skv_worker **out)
{
    struct skv_worker *w = calloc(1, sizeof *w);
    if (!w)
        return SKV_E_NOMEM;
    w->cfg = cfg;
    w->m = m;
    w->zctx = zctx;
    w->fair = !cfg->queue_order || strcmp(cfg->queue_order, "fifo") != 0;
    w->events = cfg->events_endpoint && *cfg->events_endpoint;
    randombytes_buf(&w->boot_id, sizeof w->boot_id); /* the events' boot id (libsodium is initialised) */
    if (cfg->tenant_weights && skv_tenant_weights_parse(cfg->tenant_weights, w->weights, &w->n_weights)) {
        free(w);
        return SKV_E_INVAL; /* the message says which entry */
    }
    /* the spec of every PREFILL that names none: a bad one refuses the start, not each PREFILL */
    struct skv_compress_spec dflt;
    if (cfg->default_compress && *cfg->default_compress && skv_compress_spec_parse(cfg->default_compress, &dflt)) {
        char why[256];
        snprintf(why, sizeof why, "%s", skv_error_msg());
        free(w);
        return skv_errorf(SKV_E_INVAL, "default-compress: %s", why);
    }
    if (!(w->clocks = calloc(SKV_FAIR_TENANTS, sizeof *w->clocks))) {
        free(w);
        return SKV_E_NOMEM;
    }
    snprintf(w->endpoint, sizeof w->endpoint, "%s", reply_endpoint);
    pthread_mutex_init(&w->mu, NULL);
    pthread_mutex_init(&w->snap_mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->snap.pool_bytes_total = (uint64_t)cfg->pool_size;
    skv_worker_beat(w);
    struct skv_session_limits lim = {
        .pool_bytes = (uint64_t)cfg->pool_size,
        .max_sessions_per_tenant = (int)cfg->max_sessions_per_tenant,
        .max_sessions = (int)cfg->max_sessions,
        .max_bytes_per_tenant = (uint64_t)cfg->max_bytes_per_tenant,
    };
    int rc = skv_session_table_new(&lim, &w->sessions);
    w->prefix.cap = (uint64_t)cfg->prefix_retain_bytes;
    w->prefix.on_add = event_prefix_kept;
    w->prefix.on_drop = event_prefix_dropped;
    w->prefix.hook_user = w;
    if (!rc) {
        skv_session_table_on_destroy(w->sessions, event_removed, w);
        skv_session_table_on_pressure(w->sessions, retained_bytes, drop_retained, &w->prefix);
    }
    if (!rc && cfg->store && *cfg->store &&
        !(rc = skv_store_open(cfg, &w->store, w->store_mac_key, &w->store_signed, w->store_accept_key,
                              &w->store_accept))) {
        skv_session_table_on_evict(w->sessions, skv_requests_spill, w);
        skv_store_on_progress(w->store, store_progress, w);
    }
    if (!rc)
        rc = skv_engine_new(m, &w->engine);
    if (!rc) /* its own buffers: decode rounds run between the layers of w->engine's forwards */
        rc = skv_engine_new(m, &w->decode_engine);
    if (!rc) /* and a request of another tenant run inside one of them (fair-slice-ms) */
        rc = skv_engine_new(m, &w->nested_engine);
    if (!rc && skv_thread_create(&w->thread, worker_main, w, "skv-engine") != 0)
        rc = skv_errorf(SKV_E_INTERNAL, "cannot start the engine thread");
    if (rc) {
        skv_engine_free(&w->engine);
        skv_engine_free(&w->decode_engine);
        skv_engine_free(&w->nested_engine);
        skv_session_table_free(&w->sessions);
        skv_store_free(&w->store);
        explicit_bzero(w->store_mac_key, sizeof w->store_mac_key);
        explicit_bzero(w->store_accept_key, sizeof w->store_accept_key);
        free(w->clocks);
        free(w);
        return rc;
    }
    w->started = true;
    *out = w;
    return SKV_OK;
}

/* Appends job to the FIFO and wakes the thread (w->mu held). */
static void enqueue_locked(struct skv_worker *w, struct skv_job *job)
{
    job->next = NULL;
    if (w->tail)
        w->tail->next = job;
    else
        w->head = job;
    w->tail = job;
    pthread_cond_signal(&w->cv);
}

/* malloc's bookkeeping per allocation, counted with each piece of an unpacked request */
#define MALLOC_OVERHEAD 16

/* Bytes of one element of a repeated field's array (or of a singular field in place). */
static size_t field_elem_bytes(const ProtobufCFieldDescriptor *f)
{
    switch (f->type) {
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
    case PROTOBUF_C_TYPE_DOUBLE:
        return 8;
    case PROTOBUF_C_TYPE_BOOL:
        return sizeof(protobuf_c_boolean);
    case PROTOBUF_C_TYPE_STRING:
        return sizeof(char *);
    case PROTOBUF_C_TYPE_BYTES:
        return sizeof(ProtobufCBinaryData);
    case PROTOBUF_C_TYPE_MESSAGE:
        return sizeof(ProtobufCMessage *);
    default: /* 32-bit integers, float, enum */
        return 4;
    }
}

static size_t message_bytes(const ProtobufCMessage *msg);

/* What one element at `elem` points to: a string's, a byte string's or a message's own bytes. */
static size_t pointee_bytes(const ProtobufCFieldDescriptor *f, const char *elem)
{
    switch (f->type) {
    case PROTOBUF_C_TYPE_STRING: {
        const char *str = *(char *const *)elem;
        return str && *str ? strlen(str) + 1 + MALLOC_OVERHEAD : 0; /* "" is protobuf-c's static one */
    }
    case PROTOBUF_C_TYPE_BYTES: {
        const ProtobufCBinaryData *b = (const ProtobufCBinaryData *)elem;
        return b->len ? b->len + MALLOC_OVERHEAD : 0;
    }
    case PROTOBUF_C_TYPE_MESSAGE: {
        const ProtobufCMessage *sub = *(ProtobufCMessage *const *)elem;
        return sub ? message_bytes(sub) : 0;
    }
    default:
        return 0;
    }
}

static size_t message_bytes(const ProtobufCMessage *msg)
{
    const ProtobufCMessageDescriptor *d = msg->descriptor;
    size_t n = d->sizeof_message + MALLOC_OVERHEAD;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        const char *field = (const char *)msg + f->offset;
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t count = *(const size_t *)((const char *)msg + f->quantifier_offset), size = field_elem_bytes(f);
            const char *array = *(const char *const *)field;
            if (!count || !array)
                continue;
            n += count * size + MALLOC_OVERHEAD;
            if (f->type == PROTOBUF_C_TYPE_STRING || f->type == PROTOBUF_C_TYPE_BYTES ||
                f->type == PROTOBUF_C_TYPE_MESSAGE) /* scalars point to nothing: no walk over token ids */
                for (size_t k = 0; k < count; k++)
                    n += pointee_bytes(f, array + k * size);
        } else if (!(f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) ||
                   *(const uint32_t *)((const char *)msg + f->quantifier_offset) == f->id) {
            n += pointee_bytes(f, field);
        }
    }
    return n;
}

size_t skv_request_bytes(const Snapkv__Request *req)
{
    return message_bytes(&req->base);
}

/* The session a request names (its command's session_id field, pointing into req), or NULL. */
static const uint8_t *request_session(const Snapkv__Request *req)
{
    const ProtobufCFieldDescriptor *fd =
        protobuf_c_message_descriptor_get_field(&snapkv__request__descriptor, (unsigned)req->command_case);
    if (!fd || fd->type != PROTOBUF_C_TYPE_MESSAGE)
        return NULL;
    const ProtobufCMessage *cmd = *(ProtobufCMessage *const *)((const char *)req + fd->offset);
    const ProtobufCFieldDescriptor *sf =
        cmd ? protobuf_c_message_descriptor_get_field_by_name(cmd->descriptor, "session_id") : NULL;
    if (!sf || sf->type != PROTOBUF_C_TYPE_BYTES)
        return NULL;
    const ProtobufCBinaryData *b = (const ProtobufCBinaryData *)((const char *)cmd + sf->offset);
    return b->len == SKV_SESSION_ID_BYTES ? b->data : NULL;
}

/* The tenant a queued request is for ("default" when it names none). */
static const char *job_tenant(const struct skv_job *job)
{
    const char *t = job->req ? job->req->tenant : NULL;
    return t && *t ? t : SKV_TENANT_DEFAULT;
}

int skv_worker_submit(struct skv_worker *w, struct skv_job *job)
{
    /* what the worker would refuse for its counts alone never waits in the queue */
    int rc = skv_requests_admit(w->cfg, w->m, job->req);
    if (rc)
        return rc;
    /* a tenant the worker would refuse takes no place of a tenant's share (below) */
    if (job->req->tenant && *job->req->tenant && (rc = skv_session_check_tenant(job->req->tenant)))
        return rc;
    /* the walk of the known fields, or what the unpack really allocated (unknown fields, the
     * allocator's headers) when the socket thread counted it: the larger */
    size_t walked = skv_request_bytes(job->req);
    job->bytes = sizeof *job + (job->unpacked_bytes > walked ? job->unpacked_bytes : walked);
    job->session = request_session(job->req);
    job->deadline_ms = job->req->deadline_ms ? monotonic_ms() + job->req->deadline_ms : 0;
    snprintf(job->tenant, sizeof job->tenant, "%s", job->sock == 1 ? "(admin)" : job_tenant(job));
    uint64_t max = (uint64_t)w->cfg->max_queued_bytes;
    if (job->bytes > max)
        return skv_errorf(SKV_E_LIMIT, "the request takes %zu bytes unpacked: more than max-queued-bytes (%llu)",
                          job->bytes, (unsigned long long)max);
    pthread_mutex_lock(&w->mu);
    /* one tenant's share of the queue (the admin endpoint's requests are not a tenant's). With
     * ipc-tenant = claimed a tenant is the client's claim, so the share holds between tenants,
     * not between clients (ipc-tenant = uid, tenant-bound keys: between users) */
    if (job->sock != 1 && !w->stopping) {
        const char *tenant = job_tenant(job);
        int mine = 0;
        uint64_t mine_bytes = 0;
        for (const struct skv_job *q = w->head; q; q = q->next)
            if (q->kind == SKV_JOB_REQUEST && q->sock != 1 && strcmp(job_tenant(q), tenant) == 0) {
                mine++;
                mine_bytes += q->bytes;
            }
        int64_t depth = w->cfg->queue_depth_per_tenant, tmax = w->cfg->max_queued_bytes_per_tenant;
        if (mine >= depth || mine_bytes + job->bytes > (uint64_t)tmax) {
            pthread_mutex_unlock(&w->mu);
            if (mine >= depth)
                return skv_errorf(SKV_E_BUSY, "tenant '%s' already has %d requests waiting (queue-depth-per-tenant)",
                                  tenant, mine);
            if (job->bytes > (uint64_t)tmax) /* alone past it: retrying never helps */
                return skv_errorf(SKV_E_LIMIT,
                                  "the request takes %zu bytes unpacked: more than max-queued-bytes-per-tenant (%lld)",
                                  job->bytes, (long long)tmax);
            return skv_errorf(SKV_E_BUSY,
                              "tenant '%s' has %llu bytes in %d requests waiting; this one's %zu would pass "
                              "max-queued-bytes-per-tenant (%lld): retry when they drain",
                              tenant, (unsigned long long)mine_bytes, mine, job->bytes, (long long)tmax);
        }
    }
    if (w->stopping || w->queued >= w->cfg->queue_depth || w->queued_bytes + job->bytes > max) {
        bool stopping = w->stopping, full = w->queued >= w->cfg->queue_depth;
        int queued = w->queued;
        uint64_t held = w->queued_bytes;
        pthread_mutex_unlock(&w->mu);
        if (stopping)
            return skv_errorf(SKV_E_CANCELLED, "snapkvd is shutting down");
        if (full)
            return skv_errorf(SKV_E_BUSY, "%d requests already wait (queue-depth)", (int)w->cfg->queue_depth);
        return skv_errorf(SKV_E_BUSY,
                          "the request queue holds %llu bytes in %d requests; this one's %zu would pass "
                          "max-queued-bytes (%llu): retry when it drains",
                          (unsigned long long)held, queued, job->bytes, (unsigned long long)max);
    }
    enqueue_locked(w, job);
    w->queued++;
    w->queued_bytes += job->bytes;
    atomic_store(&w->st_queue, (unsigned)w->queued);
    atomic_store(&w->st_queue_bytes, (unsigned long long)w->queued_bytes);
    pthread_mutex_unlock(&w->mu);
    return SKV_OK;
}

/* Whether a queued request only produces something for its client: a new session, whose id is
 * in the reply alone, or a TOKENIZE's or DETOKENIZE's answer, so once the client is gone nobody
 * could use it. Others still run: an
 * APPEND's or COMPRESS's session may be another client's too, an EXPORT_KV's buffer may be
 * another process's to read, and a DECODE starts and ends with the notice after it (one round). */
static bool only_for_client(const struct skv_job *job)
{
    switch (job->req->command_case) {
    case SNAPKV__REQUEST__COMMAND_PREFILL:
    case SNAPKV__REQUEST__COMMAND_FORK:
    case SNAPKV__REQUEST__COMMAND_IMPORT_KV:
    case SNAPKV__REQUEST__COMMAND_TOKENIZE:
    case SNAPKV__REQUEST__COMMAND_DETOKENIZE:
        return true;
    default:
        return false;
    }
}

bool skv_worker_running_stoppable(const struct skv_worker *w)
{
    if (!w->running || w->yielding)
        return false;
    switch (w->running->req->command_case) {
    case SNAPKV__REQUEST__COMMAND_PREFILL:
    case SNAPKV__REQUEST__COMMAND_APPEND:
    case SNAPKV__REQUEST__COMMAND_COMPRESS:
        return true;
    default:
        return false;
    }
}

bool skv_worker_has_queued(struct skv_worker *w)
{
    pthread_mutex_lock(&w->mu);
    bool queued = w->head != NULL;
    pthread_mutex_unlock(&w->mu);
    return queued;
}

bool skv_worker_running_late(const struct skv_worker *w)
{
    return w->running && w->running->deadline_ms && monotonic_ms() > w->running->deadline_ms;
}

bool skv_worker_running_gone(struct skv_worker *w)
{
    if (!w->running)
        return false;
    pthread_mutex_lock(&w->mu);
    bool gone = false;
    for (const struct skv_job *q = w->head; q && !gone; q = q->next)
        gone = q->kind == SKV_JOB_CLIENT_GONE && skv_job_same_sender(q, w->running);
    pthread_mutex_unlock(&w->mu);
    return gone;
}

int skv_worker_client_gone(struct skv_worker *w, const uint8_t *identity, size_t identity_len, bool first)
{
    if (identity_len > sizeof ((struct skv_job *)NULL)->identity)
        return skv_errorf(SKV_E_INVAL, "routing id of %zu bytes", identity_len);
    if (first) /* counted even when the notice cannot be queued */
        atomic_fetch_add(&w->st_disconnects, 1);
    struct skv_job *job = calloc(1, sizeof *job);
    if (!job)
        return SKV_E_NOMEM;
    job->kind = SKV_JOB_CLIENT_GONE;
    job->sock = 0;
    job->uid = -1;
    memcpy(job->identity, identity, identity_len);
    job->identity_len = identity_len;
    pthread_mutex_lock(&w->mu);
    if (w->stopping || w->notices >= SKV_WORKER_NOTICES_MAX) {
        bool stopping = w->stopping;
        pthread_mutex_unlock(&w->mu);
        free(job);
        return stopping ? skv_errorf(SKV_E_CANCELLED, "snapkvd is shutting down")
                        : skv_errorf(SKV_E_LIMIT, "%d client-gone notices already wait", SKV_WORKER_NOTICES_MAX);
    }
    struct skv_job *dropped = NULL;
    for (struct skv_job *q = w->head, *prev = NULL, *next; q; q = next) {
        next = q->next;
        if (q->kind != SKV_JOB_REQUEST || !skv_job_same_sender(q, job) || !only_for_client(q)) {
            prev = q;
            continue;
        }
        dequeue_locked(w, prev, q);
        q->next = dropped;
        dropped = q;
    }
    enqueue_locked(w, job);
    w->notices++;
    pthread_mutex_unlock(&w->mu);
    while (dropped) {
        struct skv_job *q = dropped;
        dropped = q->next;
        job_free(q);
        atomic_fetch_add(&w->dropped_gone, 1);
    }
    return SKV_OK;
}

uint64_t skv_worker_boot_id(const struct skv_worker *w)
{
    return w->boot_id;
}

void skv_worker_event_batch(const struct skv_worker *w, Snapkv__KvEventBatch *b)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    snapkv__kv_event_batch__init(b);
    b->version = 1;
    b->ts = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    b->boot_id = w->boot_id;
}

void skv_worker_request_stop(struct skv_worker *w)
{
    atomic_store(&w->stop_asked, true); /* the probes say so even while mu is held long */
    pthread_mutex_lock(&w->mu);
    w->stopping = true;
    w->done_marker = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

void skv_worker_stop(struct skv_worker **w_p)
{
    if (!w_p || !*w_p)
        return;
    struct skv_worker *w = *w_p;
    pthread_mutex_lock(&w->mu);
    w->stopping = true;
    atomic_store(&w->stop_asked, true);
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    if (w->started)
        pthread_join(w->thread, NULL);
    skv_engine_free(&w->engine);
    skv_engine_free(&w->decode_engine);
    skv_engine_free(&w->nested_engine);
    skv_prefix_cache_clear(&w->prefix, NULL); /* their blocks go back to the pool before it goes */
    skv_session_table_free(&w->sessions);
    skv_store_free(&w->store);
    free(w->spills);
    explicit_bzero(w->store_mac_key, sizeof w->store_mac_key);
    explicit_bzero(w->store_accept_key, sizeof w->store_accept_key);
    pthread_mutex_destroy(&w->mu);
    pthread_mutex_destroy(&w->snap_mu);
    pthread_cond_destroy(&w->cv);
    free(w->clocks);
    free(w);
    *w_p = NULL;
}

size_t skv_worker_prometheus(struct skv_worker *w, char *buf, size_t cap)
{
    struct skv_stats_input in;
    struct skv_tenant_table *t = malloc(sizeof *t);
    struct skv_stat *rows = malloc((SKV_N_STATS + SKV_N_TENANT_STATS * SKV_TENANT_ROWS) * sizeof *rows);
    char (*names)[SKV_STAT_NAME_MAX] = malloc(SKV_N_TENANT_STATS * SKV_TENANT_ROWS * sizeof *names);
    size_t len = 0;
    if (t && rows && names) {
        pthread_mutex_lock(&w->snap_mu);
        in = w->snap;
        *t = w->tenant_snap;
        pthread_mutex_unlock(&w->snap_mu);
        skv_stats_rows(&in, rows);
        size_t n = SKV_N_STATS + skv_stats_tenant_rows(t, rows + SKV_N_STATS, names);
        len = skv_stats_prometheus(rows, n, buf, cap);
    } else if (cap) {
        buf[0] = '\0';
    }
    free(t);
    free(rows);
    free(names);
    return len;
}

void skv_worker_stats(struct skv_worker *w, struct skv_worker_stats *out)
{
    out->n_sessions = atomic_load(&w->st_sessions);
    out->queue_depth = atomic_load(&w->st_queue);
    out->queue_bytes = atomic_load(&w->st_queue_bytes);
    out->pool_bytes_used = atomic_load(&w->st_pool_used);
}
