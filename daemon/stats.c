/* Metric rows and their Prometheus text (see stats.h). */
#include "daemon/stats.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

void skv_stats_rows(const struct skv_stats_input *in, struct skv_stat rows[SKV_N_STATS])
{
    const struct skv_metrics *m = &in->metrics;
    uint64_t free_bytes = in->pool_bytes_total > in->pool_bytes_used ? in->pool_bytes_total - in->pool_bytes_used : 0;
    const struct skv_stat r[SKV_N_STATS] = {
        {"snapkv_requests_total", "requests handled by the engine worker", (double)m->requests},
        {"snapkv_errors_total", "requests answered with an error, and decodes a failure ended after some tokens "
                                "(finish_reason error)", (double)m->errors},
        {"snapkv_prefill_tokens_total", "prompt tokens prefilled (computed: a reused prefix is not)",
         (double)m->prefill_tokens},
        {"snapkv_prefix_reused_tokens_total",
         "prompt tokens whose KV a PREFILL shared from another session of its tenant instead of computing it "
         "(prefix-reuse)",
         (double)m->prefix_reused_tokens},
        {"snapkv_prefix_reuse_hits_total", "PREFILLs that reused a prefix", (double)m->prefix_reuse_hits},
        {"snapkv_prefix_retained", "released full-cache sessions whose KV is kept for prefix reuse "
         "(prefix-retain-bytes)", (double)in->prefix_retained},
        {"snapkv_prefix_retained_bytes", "their blocks' bytes, each block once (kept prefixes that share a "
         "document's start share its blocks), what prefix-retain-bytes caps", (double)in->prefix_retained_bytes},
        {"snapkv_prefix_retained_host_bytes", "their host memory beside the blocks (token ids, each KV head's "
         "positions, scores and block table), which sharing does not make smaller: prefix-retain-bytes caps it too",
         (double)in->prefix_retained_host_bytes},
        {"snapkv_prefix_retained_dropped_total",
         "kept prefixes dropped: for pool room, past prefix-retain-bytes, unused for lease-seconds, or covered by "
         "a longer one of the tenant (not those EVICT drops)",
         (double)in->prefix_retained_dropped},
        {"snapkv_prompt_scored_tokens_total", "tokens PREFILLs and APPENDs scored (prompt_logprobs)",
         (double)m->scored_tokens},
        {"snapkv_decode_tokens_total", "tokens generated", (double)m->decode_tokens},
        {"snapkv_decode_batches_total", "decode forwards (tokens / batches = mean batch size)",
         (double)m->decode_batches},
        {"snapkv_prefill_tokens_per_second", "prefill throughput since start",
         m->prefill_seconds > 0 ? (double)m->prefill_tokens / m->prefill_seconds : 0},
        {"snapkv_decode_tokens_per_second", "decode throughput since start",
         m->decode_seconds > 0 ? (double)m->decode_tokens / m->decode_seconds : 0},
        {"snapkv_sessions", "sessions held", (double)in->n_sessions},
        {"snapkv_pool_bytes_used", "KV bytes held by sessions (a shared block once)",
         (double)in->pool_bytes_used},
        {"snapkv_pool_bytes_free", "KV bytes left in the pool", (double)free_bytes},
        {"snapkv_pool_blocks_used", "unique KV blocks held by sessions", (double)in->pool_blocks_used},
        {"snapkv_pool_blocks_shared", "KV blocks shared copy-on-write by more than one session",
         (double)in->pool_blocks_shared},
        {"snapkv_compression_ratio", "KV bytes kept / full-cache bytes over all prefills",
         m->bytes_before ? (double)m->bytes_after / (double)m->bytes_before : 1.0},
        {"snapkv_evictions_total", "sessions evicted under pool pressure", (double)in->evictions},
        {"snapkv_client_disconnects_total", "clients whose connection closed after they sent a request",
         (double)in->client_disconnects},
        {"snapkv_cuda_buffers_closed_on_disconnect_total",
         "CUDA IPC buffers closed when their client's connection closed", (double)m->ipc_closed_gone},
        {"snapkv_cuda_buffers_closed_for_room_total",
         "CUDA IPC buffers closed, least recently used first, to open another (8 per client, 256 in all)",
         (double)m->ipc_closed_lru},
        {"snapkv_decodes_cancelled_on_disconnect_total",
         "running DECODEs cancelled when their client's connection closed", (double)m->decodes_cancelled_gone},
        {"snapkv_decodes_cancelled_total", "running DECODEs ended by a CANCEL request", (double)m->decodes_cancelled},
        {"snapkv_upkeep_cuts_failed_total",
         "layers whose cut to the budget after a decode step or short APPEND failed (no memory, a device error); "
         "each stays valid, over its budget, until a later step cuts it",
         (double)m->upkeep_cuts_failed},
        {"snapkv_decode_rounds_in_forwards_total",
         "decode rounds run inside a long PREFILL, APPEND or COMPRESS (decode-yield-ms)",
         (double)m->decode_rounds_yielded},
        {"snapkv_requests_inside_forwards_total",
         "short requests (DECODE start, CANCEL, reads, small PREFILL / APPEND ...) run inside a long forward, "
         "ahead of it",
         (double)m->requests_overtook},
        {"snapkv_requests_reordered_total",
         "requests run before an older waiting one, because their tenant had less engine time (queue-order = fair)",
         (double)m->requests_reordered},
        {"snapkv_reply_bytes_unread",
         "bytes of replies handed to clients' connections and not taken yet (max-reply-bytes)",
         (double)in->reply_bytes_unread},
        {"snapkv_replies_dropped_unread_total",
         "replies dropped because their client, or all clients, held too many bytes of replies not read yet, "
         "or the client's queue in libzmq was full",
         (double)in->replies_dropped},
        {"snapkv_replies_dropped_closed_total",
         "replies not sent because the connection their request came over had closed (another connection may "
         "hold its routing id now)",
         (double)in->replies_closed},
        {"snapkv_requests_nested_total",
         "requests of a tenant with less engine time run inside another tenant's long forward (fair-slice-ms)",
         (double)m->requests_nested},
        {"snapkv_requests_dropped_on_disconnect_total",
         "requests of clients whose connection closed that were dropped while queued (PREFILL, FORK, IMPORT_KV) "
         "or stopped inside a PREFILL's forward",
         (double)m->requests_dropped_gone},
        {"snapkv_requests_past_deadline_total",
         "requests answered TIMEOUT without running because they waited past their client's deadline (its "
         "timeout), or PREFILLs and APPENDs stopped inside their forward once it passed",
         (double)m->requests_past_deadline},
        {"snapkv_decodes_running", "DECODEs running (max-decodes)", (double)in->n_decodes},
        {"snapkv_queue_requests", "requests waiting for the engine (queue-depth)", (double)in->queue_requests},
        {"snapkv_queue_bytes", "memory the waiting requests hold (max-queued-bytes)", (double)in->queue_bytes},
        {"snapkv_engine_scratch_bytes",
         "activation buffers of the engines (the main one, the one decodes and short requests run on, the "
         "nested one, which gives its buffers back after each request), with the decode groups' logits on the "
         "host, beside the KV pool",
         (double)in->engine_scratch_bytes},
        {"snapkv_persist_checkpoints_total",
         "checkpoints of every session written while serving (persist-interval-seconds)",
         (double)m->persist_checkpoints},
        {"snapkv_persist_written_bytes_total",
         "bytes saves and checkpoints wrote: the files of sessions that changed and the KV blocks the block store "
         "did not hold",
         (double)m->persist_bytes},
        {"snapkv_persist_failures_total",
         "checkpoints that failed (a full disk, a directory that cannot be written; the last checkpoint stays); "
         "the next try comes an interval later, and at least 30 s",
         (double)m->persist_failures},
        {"snapkv_persist_last_seconds",
         "how long the last save or checkpoint held the engine (requests and decodes wait meanwhile)",
         m->persist_last_seconds},
        {"snapkv_persist_age_seconds",
         "seconds since the sessions were last saved (a checkpoint; the start when none was yet): what a crash "
         "would lose; 0 without persist",
         in->persist_age_seconds},
        {"snapkv_store_spills_total", "sessions evicted or past their lease written to the store (store)",
         (double)in->store_spills},
        {"snapkv_store_spilled_bytes_total", "bytes of the sessions written to the store",
         (double)in->store_spill_bytes},
        {"snapkv_store_spill_failures_total",
         "sessions evicted or past their lease that could not be written to the store, and were dropped",
         (double)in->store_spill_failures},
        {"snapkv_store_loads_total",
         "sessions a request named that were not here, taken from the store (one that does not load is dropped "
         "or put back)",
         (double)in->store_loads},
        {"snapkv_store_misses_total", "sessions a request named that were neither here nor in the store",
         (double)in->store_misses},
        {"snapkv_store_load_failures_total",
         "sessions a request named that were not here, when the store could not be asked",
         (double)in->store_load_failures},
        {"snapkv_store_spill_seconds_total",
         "the engine's time writing sessions to the store, their encoding included (requests wait meanwhile)",
         m->store_spill_seconds},
        {"snapkv_store_load_seconds_total",
         "the engine's time taking sessions from the store and loading them, misses included",
         m->store_load_seconds},
        {"snapkv_store_refused_total",
         "values taken from the store that store-secret-file's signature refused (not signed: put back; a "
         "signature that does not match, or past its time: dropped)",
         (double)m->store_refused},
    };
    memcpy(rows, r, sizeof r);
}

size_t skv_stats_tenant_rows(const struct skv_tenant_table *t, struct skv_stat *rows,
                             char (*names)[SKV_STAT_NAME_MAX])
{
    static const struct {
        const char *name, *help;
    } m[SKV_N_TENANT_STATS] = {
        {"snapkv_tenant_sessions", "sessions the tenant holds (max-sessions-per-tenant)"},
        {"snapkv_tenant_bytes", "bytes the tenant's sessions hold (max-bytes-per-tenant)"},
        {"snapkv_tenant_queue_requests", "the tenant's requests waiting for the engine (queue-depth-per-tenant)"},
        {"snapkv_tenant_decodes_running", "the tenant's DECODEs running (max-decodes-per-tenant)"},
        {"snapkv_tenant_requests_total", "the tenant's requests the engine ran"},
        {"snapkv_tenant_errors_total", "the tenant's requests that failed in the engine"},
        {"snapkv_tenant_prefill_tokens_total", "prompt tokens the tenant's PREFILLs ran"},
        {"snapkv_tenant_decode_tokens_total", "tokens the tenant's DECODEs generated"},
        {"snapkv_tenant_engine_seconds_total",
         "the engine's time on the tenant's requests (what queue-order = fair evens out) and an even share of "
         "each decode round its DECODEs were in"},
        {"snapkv_tenant_prefix_retained_bytes",
         "bytes of the tenant's kept prefixes (prefix-retain-bytes) in blocks no session shares, each block "
         "once, which max-bytes-per-tenant counts with snapkv_tenant_bytes"},
    };
    size_t n = 0;
    for (int k = 0; k < SKV_N_TENANT_STATS; k++)
        for (int i = 0; i < t->n; i++, n++) {
            const struct skv_tenant_stats *x = &t->t[i];
            double v[SKV_N_TENANT_STATS] = {
                (double)x->sessions, (double)x->bytes, (double)x->queued, (double)x->decodes,
                (double)x->requests, (double)x->errors, (double)x->prefill_tokens, (double)x->decode_tokens,
                x->engine_seconds, (double)x->kept_bytes,
            };
            snprintf(names[n], SKV_STAT_NAME_MAX, "%s{tenant=\"%s\"}", m[k].name, x->name);
            rows[n] = (struct skv_stat){names[n], m[k].help, v[k]};
        }
    return n;
}

size_t skv_stats_prometheus(const struct skv_stat *rows, size_t n, char *buf, size_t cap)
{
    size_t at = 0;
    if (cap == 0)
        return 0;
    buf[0] = '\0';
    for (size_t i = 0; i < n && at < cap - 1; i++) {
        const char *name = rows[i].name;
        size_t base = strcspn(name, "{");
        bool first = i == 0 || strncmp(rows[i - 1].name, name, base) != 0 ||
                     (rows[i - 1].name[base] != '\0' && rows[i - 1].name[base] != '{');
        int k = 0;
        if (first) {
            bool counter = base > 6 && strncmp(name + base - 6, "_total", 6) == 0;
            k = snprintf(buf + at, cap - at, "# HELP %.*s %s\n# TYPE %.*s %s\n", (int)base, name, rows[i].help,
                         (int)base, name, counter ? "counter" : "gauge");
            if (k < 0 || (size_t)k >= cap - at)
                break;
            at += (size_t)k;
        }
        k = snprintf(buf + at, cap - at, "%s %.17g\n", name, rows[i].value);
        if (k < 0)
            break;
        at += (size_t)k;
    }
    return at < cap ? at : cap - 1;
}
