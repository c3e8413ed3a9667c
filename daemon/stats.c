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
        {"snapkv_errors_total", "requests answered with an error", (double)m->errors},
        {"snapkv_prefill_tokens_total", "prompt tokens prefilled", (double)m->prefill_tokens},
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
        {"snapkv_decodes_running", "DECODEs running (max-decodes)", (double)in->n_decodes},
        {"snapkv_queue_requests", "requests waiting for the engine (queue-depth)", (double)in->queue_requests},
        {"snapkv_queue_bytes", "memory the waiting requests hold (max-queued-bytes)", (double)in->queue_bytes},
    };
    memcpy(rows, r, sizeof r);
}

size_t skv_stats_prometheus(const struct skv_stat *rows, size_t n, char *buf, size_t cap)
{
    size_t at = 0;
    if (cap == 0)
        return 0;
    buf[0] = '\0';
    for (size_t i = 0; i < n && at < cap - 1; i++) {
        bool counter = strstr(rows[i].name, "_total") != NULL;
        int k = snprintf(buf + at, cap - at, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", rows[i].name, rows[i].help,
                         rows[i].name, counter ? "counter" : "gauge", rows[i].name, rows[i].value);
        if (k < 0)
            break;
        at += (size_t)k;
    }
    return at < cap ? at : cap - 1;
}
