/* snapkv-bench: the in-process engine from the command line — tokenize, logits, generate —
 * and the speed benchmark (prefill and decode tokens/s, peak memory) as JSON and a table.
 * Tests and users drive the engine through the same subcommands. */
#include "build-config.h"

#include "common/cpu.h"
#include "common/status.h"
#include "daemon/compress/compress.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/model.h"
#include "daemon/engine/sampler.h"
#include "daemon/engine/tokenizer.h"
#include "kernels/backend.h"
#include "tools/bench_quality.h"
#include "tools/bench_serve.h"

#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

struct args {
    const char *cmd;
    const char *model;
    const char *backend;
    const char *kv_type;       /* f32 | f16 | q8_0: the model's KV pool (and a serve daemon's kv-type) */
    int threads;
    bool json;
    bool reference;
    const char *prompt;
    const char *prompt_file;
    const char *tokens;
    bool chat;
    const char *assistant;     /* with --chat: the text the assistant turn starts with */
    bool special;
    bool bos;
    int cap; /* tokenize --cap: -1 unset */
    int top;
    bool all_logits;
    int max_tokens;
    float temperature, top_p;
    int top_k;
    float min_p, repetition_penalty, frequency_penalty, presence_penalty; /* generate: skv_sampler_params */
    int repetition_last_n;
    uint64_t seed;
    const char *prefill_sizes;
    const char *decode_depths;
    const char *append_sizes; /* speed: forwards of these many tokens at each depth (an APPEND's) */
    int decode_tokens;
    int batch; /* speed: sequences decoded together (skv_engine_decode_batch); 0: 1 */
    bool private_rows; /* speed --private: each sequence of a batch its own copy of the rows */
    int repeat;
    const char *compress;
    struct skv_quality_opts quality;
    struct skv_serve_opts serve;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double peak_rss_mib(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss / 1024.0;
}

static void usage(FILE *out)
{
    fprintf(out,
            "usage: snapkv-bench COMMAND --model PATH [--threads N] [--backend auto|cpu|cuda] [--json]\n"
            "                    [--reference] [--kv-type f32|f16|q8_0]\n"
            "commands:\n"
            "  tokenize [--special] [--bos] [--cap N] stdin text -> token ids; --cap: the count a\n"
            "                                        request's limit of N tokens stops at, and its time\n"
            "  logits (--prompt T | --prompt-file F | --tokens 1,2,3) [--chat] [--top N] [--all]\n"
            "                                        last-position logits (--all: every value)\n"
            "  generate (--prompt T | --prompt-file F | --tokens ...) [--chat] [--max-tokens N]\n"
            "           [--temperature T] [--top-k K] [--top-p P] [--seed S] [--compress SPEC] [--min-p P]\n"
            "           [--repetition-penalty R] [--repetition-last-n N] [--frequency-penalty F]\n"
            "           [--presence-penalty F]\n"
            "  select (--prompt T | --prompt-file F | --tokens ...) [--chat] [--compress SPEC (policy=full)]\n"
            "                                        kept original positions per layer and KV head\n"
            "  (logits, generate, select: --chat --assistant T starts the assistant turn with T, as\n"
            "   quality's passkey prompts do: \"The pass key is\")\n"
            "  speed [--prefill 512,2048,8192|none] [--decode-depth 0,512,4096,8192] [--decode-tokens N]\n"
            "        [--batch B [--private]]        (B sequences at each depth decoded together, one\n"
            "                                        forward a step: tokens/s over all of them; forks\n"
            "                                        sharing the prefilled rows, --private: each its own)\n"
            "        [--repeat R] [--compress SPEC]  prefill / decode tokens/s and peak memory; with\n"
            "                                        SPEC every prefill compresses (its scoring +\n"
            "                                        compaction timed) and decode runs on the kept KV\n"
            "        [--append 9,16,21]              also one forward of each many tokens at each depth\n"
            "                                        (an APPEND's, on a copy of the depth's cache)\n"
            "  gemv [--repeat R]                     decode's weight traffic: every weight matrix\n"
            "                                        times one row, GB/s per dtype, and the host's\n"
            "                                        read bandwidth with the same threads\n"
            "  quality [--task passkey|fidelity|all] [--specs \"SPEC;SPEC;...\"] [--out-dir DIR]\n"
            "          [--lengths 512,1024,...] [--depths 0,25,50,75,100] [--trials N] [--seed S]\n"
            "          [--max-tokens N] [--passkey-style K] [--texts F1,F2] [--fid-prefill N]\n"
            "          [--fid-tokens M]              compression quality vs the full cache (always the\n"
            "                                        baseline): passkey accuracy, next-token KL; JSON,\n"
            "                                        markdown and PNGs into DIR (default ./quality-out)\n"
            "  serve [--endpoint URL --admin-endpoint URL] [--clients N] [--requests R] [--sessions S|fit]\n"
            "        [--context T] [--decode-tokens D] [--pool-gib G] [--specs \"SPEC;SPEC\"]\n"
            "        [--parts roundtrip,throughput,capacity,decode,stall,fair,checkpoint,events,spread,store,\n"
            "                 prefix]\n"
            "        [--store-signed]                (the store part's daemons sign values: store-secret-file)\n"
            "                                        snapkvd: round trips, N client processes vs in-process,\n"
            "                                        sessions per G GiB pool (default 1), S concurrent\n"
            "                                        T-token decodes (fit: as many as the pool held), a\n"
            "                                        streaming decode's gaps while a T-token prefill runs,\n"
            "                                        a tenant's short request behind another's T-token\n"
            "                                        prefills (queue-order fifo, fair); checkpoint (only\n"
            "                                        when named): what checkpoints write and how long\n"
            "                                        they take once sessions change (persist-interval 1);\n"
            "                                        events (only when named): FORK + RELEASE round\n"
            "                                        trips with no KV events subscriber, one that never\n"
            "                                        reads and one that reads; spread (only when named):\n"
            "                                        questions on documents over three daemons, placed\n"
            "                                        round robin and by document (snapkv_many_place);\n"
            "                                        store (only when named; redis-server): a T-token\n"
            "                                        session spilled by one daemon and taken by another;\n"
            "                                        prefix (only when named): PREFILLs of one document\n"
            "                                        and a question each, computed or with prefix reuse\n"
            "                                        specs: first is the baseline (default full, SnapKV\n"
            "                                        10%%, squeeze+SnapKV 10%%); starts its own snapkvd\n"
            "                                        unless given the endpoints\n"
            "                                        (--json: JSON on stdout, the table on stderr)\n"
            "--reference: weights dequantized to f32 (the numerical reference mode).\n");
}

static char *read_all(FILE *f, size_t *len_out)
{
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    size_t n;
    while (buf && (n = fread(buf + len, 1, cap - len - 1, f)) > 0) {
        len += n;
        if (cap - len < 2) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                return NULL;
            }
            buf = nb;
            cap *= 2;
        }
    }
    if (buf) {
        buf[len] = '\0';
        *len_out = len;
    }
    return buf;
}

static int fail(const char *what, int rc)
{
    fprintf(stderr, "snapkv-bench: %s: %s (%s)\n", what, skv_error_msg(), skv_status_str(rc));
    return 1;
}

/* Prompt ids from --tokens, or text (--prompt / --prompt-file, optionally as one chat turn). */
static int prompt_ids(const struct args *a, const struct skv_model *m, int32_t **ids_out, int *n_out)
{
    if (a->tokens) {
        int cap = 16, n = 0;
        int32_t *ids = malloc((size_t)cap * sizeof *ids);
        const char *p = a->tokens;
        while (ids && *p) {
            char *end;
            long v = strtol(p, &end, 10);
            if (end == p)
                return free(ids), skv_errorf(SKV_E_INVAL, "--tokens: expected comma-separated ids");
            if (n == cap && !(ids = realloc(ids, (size_t)(cap *= 2) * sizeof *ids)))
                return SKV_E_NOMEM;
            ids[n++] = (int32_t)v;
            p = *end == ',' ? end + 1 : end;
        }
        *ids_out = ids;
        *n_out = n;
        return ids ? SKV_OK : SKV_E_NOMEM;
    }
    char *text = NULL;
    size_t len = 0;
    if (a->prompt_file) {
        FILE *f = fopen(a->prompt_file, "rb");
        if (!f)
            return skv_errorf(SKV_E_IO, "cannot open %s", a->prompt_file);
        text = read_all(f, &len);
        fclose(f);
    } else if (a->prompt) {
        text = strdup(a->prompt);
        len = text ? strlen(text) : 0;
    } else {
        return skv_errorf(SKV_E_INVAL, "give --prompt, --prompt-file or --tokens");
    }
    if (!text)
        return SKV_E_NOMEM;
    if (!m->tok)
        return free(text), skv_errorf(SKV_E_UNSUPPORTED, "the model has no tokenizer; use --tokens");
    /* --chat: one user turn of the chat template, which owns BOS and the control tokens; with
     * --assistant, the template's text and T after it, encoded as quality's passkey prompts are
     * (the markup parsed) */
    struct skv_chat_msg msg = {"user", text};
    if (a->assistant && !a->chat)
        return free(text), skv_errorf(SKV_E_INVAL, "--assistant needs --chat");
    if (a->assistant) {
        char *rendered = NULL;
        int rc = skv_tokenizer_chat_render(m->tok, &msg, 1, true, &rendered);
        free(text);
        if (rc)
            return rc;
        size_t rl = strlen(rendered), al = strlen(a->assistant);
        if (!(text = malloc(rl + al + 1)))
            return free(rendered), SKV_E_NOMEM;
        memcpy(text, rendered, rl);
        memcpy(text + rl, a->assistant, al + 1);
        free(rendered);
        len = rl + al;
    }
    const bool chat = a->chat && !a->assistant, markup = a->assistant != NULL;
    bool bos = skv_tokenizer_add_bos(m->tok);
    int n = 0;
    int rc = chat ? skv_tokenizer_chat_encode(m->tok, &msg, 1, true, NULL, 0, &n)
                  : skv_tokenizer_encode(m->tok, text, len, bos && !markup, markup, NULL, 0, &n);
    if (rc && rc != SKV_E_LIMIT)
        return free(text), rc;
    int32_t *ids = malloc((size_t)(n > 0 ? n : 1) * sizeof *ids);
    if (!ids)
        return free(text), SKV_E_NOMEM;
    rc = chat ? skv_tokenizer_chat_encode(m->tok, &msg, 1, true, ids, n, &n)
              : skv_tokenizer_encode(m->tok, text, len, bos && !markup, markup, ids, n, &n);
    free(text);
    if (rc)
        return free(ids), rc;
    *ids_out = ids;
    *n_out = n;
    return SKV_OK;
}

/* A prefill that compresses with `spec_text` (NULL or "": none), tracking peak KV bytes
 * (measured right before each layer is cut: earlier layers compressed, this one whole). */
struct prefill_run {
    struct skv_compressor *comp;
    uint64_t peak_kv_bytes;
    struct skv_backend *timed;  /* non-NULL: time the compressor (synchronizing this backend) */
    double compress_seconds;    /* scoring + compaction, all layers (when timed) */
};

static int peak_hook(void *user, const struct skv_layer_view *v)
{
    struct prefill_run *r = user;
    uint64_t b = skv_kv_cache_bytes(v->cache);
    if (b > r->peak_kv_bytes)
        r->peak_kv_bytes = b;
    if (!r->comp)
        return SKV_OK;
    if (!r->timed)
        return skv_compressor_hook(r->comp, v);
    /* the layer's queued work first, so only the compressor's own work lands in the timer */
    int rc = r->timed->ops->sync(r->timed);
    double t0 = now_s();
    if (!rc)
        rc = skv_compressor_hook(r->comp, v);
    if (!rc)
        rc = r->timed->ops->sync(r->timed);
    r->compress_seconds += now_s() - t0;
    return rc;
}

static int compressed_forward(struct skv_engine *e, struct skv_model *m, struct skv_kv_cache *cache,
                              const int32_t *ids, int n, const char *spec_text, float *logits,
                              struct prefill_run *run)
{
    struct skv_backend *timed = run->timed;
    memset(run, 0, sizeof *run);
    run->timed = timed;
    if (spec_text && *spec_text) {
        struct skv_compress_spec spec;
        int rc = skv_compress_spec_parse(spec_text, &spec);
        if (!rc)
            rc = skv_compressor_new(&spec, m, &run->comp);
        if (!rc)
            rc = skv_compressor_begin(run->comp, cache, n);
        if (rc)
            return rc;
    }
    struct skv_forward_opts fo = {.hook = peak_hook, .hook_user = run};
    int rc = skv_engine_forward(e, cache, ids, n, &fo, logits);
    if (!rc && run->comp) { /* finish cuts every layer under alloc=squeeze: it counts too */
        double t0 = now_s();
        rc = skv_compressor_finish(run->comp, cache);
        if (!rc && run->timed)
            rc = run->timed->ops->sync(run->timed);
        run->compress_seconds += now_s() - t0;
    }
    return rc;
}

static json_t *ids_json(const int32_t *ids, int n)
{
    json_t *arr = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(arr, json_integer(ids[i]));
    return arr;
}

static void emit(json_t *j)
{
    char *s = json_dumps(j, JSON_INDENT(1) | JSON_REAL_PRECISION(9));
    if (!s) { /* no output that looks like a result with nothing in it */
        fprintf(stderr, "snapkv-bench: the JSON output could not be written (out of memory)\n");
        exit(1);
    }
    puts(s);
    free(s);
}

static int cmd_tokenize(const struct args *a, struct skv_model *m)
{
    size_t len;
    char *text = read_all(stdin, &len);
    if (!text)
        return 1;
    if (a->cap >= 0) { /* the daemon's first pass over a request's text: a count that stops past the limit */
        int n = 0;
        double t0 = now_s();
        int rc = skv_tokenizer_encode_capped(m->tok, text, len, a->bos, a->special, a->cap, NULL, 0, &n);
        double dt = now_s() - t0;
        free(text);
        if (rc && rc != SKV_E_LIMIT)
            return fail("tokenize", rc);
        bool over = n > a->cap;
        if (a->json) {
            json_t *j = json_pack("{s:I, s:i, s:i, s:b, s:f, s:f}", "bytes", (json_int_t)len, "cap", a->cap,
                                  "tokens", over ? a->cap + 1 : n, "over_cap", over, "seconds", dt,
                                  "peak_rss_mib", peak_rss_mib());
            emit(j);
            json_decref(j);
        } else {
            printf("%zu bytes: %s%d tokens (cap %d) in %.3f s, peak RSS %.0f MiB\n", len, over ? "over the cap, > " : "",
                   over ? a->cap : n, a->cap, dt, peak_rss_mib());
        }
        return 0;
    }
    int n = 0, rc = skv_tokenizer_encode(m->tok, text, len, a->bos, a->special, NULL, 0, &n);
    int32_t *ids = malloc((size_t)(n > 0 ? n : 1) * sizeof *ids);
    rc = ids ? skv_tokenizer_encode(m->tok, text, len, a->bos, a->special, ids, n, &n) : SKV_E_NOMEM;
    free(text);
    if (rc)
        return free(ids), fail("tokenize", rc);
    if (a->json) {
        json_t *j = ids_json(ids, n);
        emit(j);
        json_decref(j);
    } else {
        for (int i = 0; i < n; i++)
            printf("%s%d", i ? " " : "", ids[i]);
        printf("\n");
    }
    free(ids);
    return 0;
}

/* Top-n entries of logits by value (ties: lower id). */
static void top_n(const float *logits, int n_vocab, int n, int32_t *ids)
{
    for (int k = 0; k < n; k++) {
        int32_t best = -1;
        for (int i = 0; i < n_vocab; i++) {
            bool taken = false;
            for (int j = 0; j < k && !taken; j++)
                taken = ids[j] == i;
            if (!taken && (best < 0 || logits[i] > logits[best]))
                best = i;
        }
        ids[k] = best;
    }
}

static json_t *token_text_json(const struct skv_model *m, int32_t id)
{
    if (!m->tok)
        return json_null();
    char buf[256];
    size_t len = 0;
    if (skv_tokenizer_token_bytes(m->tok, id, buf, sizeof buf, &len))
        return json_null();
    return skv_bench_json_text(buf, len < sizeof buf ? len : sizeof buf);
}

static int cmd_logits(const struct args *a, struct skv_engine *e, struct skv_model *m)
{
    int32_t *ids = NULL;
    int n = 0, rc = prompt_ids(a, m, &ids, &n);
    if (rc)
        return fail("prompt", rc);
    struct skv_kv_cache *cache = NULL;
    int nv = m->cfg.n_vocab;
    float *logits = malloc((size_t)nv * sizeof *logits);
    rc = logits ? skv_kv_cache_new(m, &cache) : SKV_E_NOMEM;
    double t0 = now_s();
    if (!rc)
        rc = skv_engine_forward(e, cache, ids, n, NULL, logits);
    double dt = now_s() - t0;
    skv_kv_cache_free(&cache);
    if (rc) {
        free(ids);
        free(logits);
        return fail("forward", rc);
    }
    int top = a->top > 0 ? (a->top < nv ? a->top : nv) : 10;
    int32_t *tids = malloc((size_t)top * sizeof *tids);
    top_n(logits, nv, top, tids);
    if (a->json) {
        json_t *j = json_object(), *arr = json_array();
        json_object_set_new(j, "n_tokens", json_integer(n));
        json_object_set_new(j, "seconds", json_real(dt));
        for (int k = 0; k < top; k++) {
            json_t *t = json_object();
            json_object_set_new(t, "id", json_integer(tids[k]));
            json_object_set_new(t, "logit", json_real(logits[tids[k]]));
            json_object_set_new(t, "text", token_text_json(m, tids[k]));
            json_array_append_new(arr, t);
        }
        json_object_set_new(j, "top", arr);
        if (a->all_logits) {
            json_t *all = json_array();
            for (int i = 0; i < nv; i++)
                json_array_append_new(all, json_real(logits[i]));
            json_object_set_new(j, "logits", all);
        }
        emit(j);
        json_decref(j);
    } else {
        printf("%d prompt tokens, %.3f s\n%6s  %10s  %s\n", n, dt, "id", "logit", "token");
        for (int k = 0; k < top; k++) {
            char buf[64];
            size_t len = 0;
            if (!m->tok || skv_tokenizer_token_bytes(m->tok, tids[k], buf, sizeof buf - 1, &len))
                len = 0;
            buf[len < sizeof buf - 1 ? len : sizeof buf - 1] = '\0';
            printf("%6d  %10.4f  %s\n", tids[k], logits[tids[k]], buf);
        }
    }
    free(tids);
    free(ids);
    free(logits);
    return 0;
}

static int cmd_generate(const struct args *a, struct skv_engine *e, struct skv_model *m)
{
    int32_t *ids = NULL;
    int n = 0, rc = prompt_ids(a, m, &ids, &n);
    if (rc)
        return fail("prompt", rc);
    int nv = m->cfg.n_vocab, max = a->max_tokens > 0 ? a->max_tokens : 64;
    float *logits = malloc((size_t)nv * sizeof *logits);
    /* the prompt, then what is generated: the history the repetition penalty looks at */
    int32_t *seq = malloc((size_t)(n + max) * sizeof *seq), *out = seq ? seq + n : NULL;
    struct skv_kv_cache *cache = NULL;
    struct skv_sampler s;
    struct skv_sampler_params sp = {.temperature = a->temperature,
                                    .top_k = a->top_k,
                                    .top_p = a->top_p,
                                    .seed = a->seed,
                                    .min_p = a->min_p,
                                    .repetition_penalty = a->repetition_penalty,
                                    .repetition_last_n = a->repetition_last_n,
                                    .frequency_penalty = a->frequency_penalty,
                                    .presence_penalty = a->presence_penalty};
    rc = logits && seq ? skv_sampler_init(&s, &sp, nv) : SKV_E_NOMEM;
    if (rc) {
        free(ids);
        free(logits);
        free(seq);
        return fail("sampler", rc);
    }
    memcpy(seq, ids, (size_t)n * sizeof *seq);
    rc = skv_kv_cache_new(m, &cache);
    struct prefill_run run = {0};
    double t0 = now_s();
    if (!rc)
        rc = compressed_forward(e, m, cache, ids, n, a->compress, logits, &run);
    double t_prefill = now_s() - t0;
    uint64_t kv_after = cache ? skv_kv_cache_bytes(cache) : 0;
    struct skv_forward_opts dec = {.hook = skv_compressor_hook, .hook_user = run.comp,
                                   .attention_probs = skv_compressor_wants_probs(run.comp)};
    int produced = 0;
    const char *finish = "length";
    t0 = now_s();
    while (!rc && produced < max) {
        int32_t t = skv_sampler_next(&s, logits, seq, n + produced, out, produced);
        out[produced++] = t;
        if (a->chat && m->tok && (t == skv_tokenizer_eot(m->tok) || t == skv_tokenizer_eos(m->tok))) {
            finish = "stop";
            break;
        }
        if (produced < max) {
            if (run.comp) /* as the daemon decodes: the upkeep at the forward's end */
                rc = skv_compressor_begin_step(run.comp, cache, 1, true, &dec);
            if (!rc)
                rc = skv_engine_forward(e, cache, &t, 1, run.comp ? &dec : NULL, logits);
        }
    }
    double t_decode = now_s() - t0;
    skv_sampler_fini(&s);
    skv_kv_cache_free(&cache);
    skv_compressor_free(&run.comp);
    if (rc) {
        free(ids);
        free(logits);
        free(seq);
        return fail("generate", rc);
    }
    char *text = NULL;
    if (m->tok && skv_tokenizer_decode(m->tok, out, produced, &text))
        text = NULL;
    if (a->json) {
        json_t *j = json_object();
        json_object_set_new(j, "prompt_tokens", json_integer(n));
        json_object_set_new(j, "tokens", ids_json(out, produced));
        json_object_set_new(j, "text", text ? skv_bench_json_text(text, strlen(text)) : json_null());
        json_object_set_new(j, "finish_reason", json_string(finish));
        json_object_set_new(j, "prefill_seconds", json_real(t_prefill));
        json_object_set_new(j, "decode_seconds", json_real(t_decode));
        json_object_set_new(j, "kv_bytes_after_prefill", json_integer((json_int_t)kv_after));
        json_object_set_new(j, "peak_kv_bytes_prefill", json_integer((json_int_t)run.peak_kv_bytes));
        emit(j);
        json_decref(j);
    } else {
        printf("%s\n", text ? text : "");
        fprintf(stderr, "[%d prompt tokens in %.2f s (%.1f t/s); %d tokens in %.2f s (%.1f t/s)]\n", n, t_prefill,
                n / t_prefill, produced, t_decode, produced > 1 ? (produced - 1) / t_decode : 0.0);
    }
    free(text);
    free(ids);
    free(logits);
    free(seq);
    return 0;
}

/* The bytes the rows of `cache` take when stored at query-head width, as a cache that does not
 * share a KV head among its query heads holds them: each KV head's rows written once for each
 * of its n_heads / n_kv_heads query heads into a cache of n_heads heads in the same pool (rows
 * in use, and blocks held). */
static int wide_bytes(const struct skv_model *m, const struct skv_kv_cache *cache, uint64_t *rows_bytes,
                      uint64_t *blocks)
{
    struct skv_model wm = *m; /* (only its shape is read: a cache of n_heads KV heads) */
    wm.cfg.n_kv_heads = m->cfg.n_heads;
    if (m->cfg.n_heads > SKV_MAX_KV_HEADS)
        return skv_errorf(SKV_E_UNSUPPORTED, "%d query heads: more than a cache holds", m->cfg.n_heads);
    struct skv_kv_cache *wide = NULL;
    int rc = skv_kv_cache_new(&wm, &wide), g = m->cfg.n_heads / m->cfg.n_kv_heads;
    float *buf = NULL;
    for (int l = 0; l < m->cfg.n_layers && !rc; l++)
        for (int h = 0; h < m->cfg.n_kv_heads && !rc; h++) {
            int len = skv_kv_cache_head((struct skv_kv_cache *)cache, l, h)->len;
            float *grown = realloc(buf, (size_t)(len ? len : 1) * m->cfg.head_dim * sizeof *buf);
            if (!grown) {
                rc = SKV_E_NOMEM;
                break;
            }
            buf = grown;
            for (int kv = 0; kv < 2 && !rc; kv++) {
                rc = skv_kv_cache_read_rows(cache, l, h, kv, 0, len, buf);
                for (int q = 0; q < g && !rc; q++)
                    rc = skv_kv_cache_write_rows(wide, l, h * g + q, kv, 0, len, buf);
            }
        }
    if (!rc) {
        struct skv_kv_blocks b;
        skv_kv_cache_blocks(wide, &b);
        *rows_bytes = skv_kv_cache_bytes(wide);
        *blocks = b.held;
    } else {
        fprintf(stderr, "select: query-head width not measured: %s\n", skv_error_msg());
    }
    free(buf);
    skv_kv_cache_free(&wide);
    return rc;
}

/* Kept original positions per layer and KV head after a compressed prefill. */
static int cmd_select(const struct args *a, struct skv_engine *e, struct skv_model *m)
{
    int32_t *ids = NULL;
    int n = 0, rc = prompt_ids(a, m, &ids, &n);
    if (rc)
        return fail("prompt", rc);
    struct skv_kv_cache *cache = NULL;
    struct prefill_run run = {0};
    float *logits = malloc((size_t)m->cfg.n_vocab * sizeof *logits);
    rc = logits ? skv_kv_cache_new(m, &cache) : SKV_E_NOMEM;
    double t0 = now_s();
    if (!rc)
        rc = compressed_forward(e, m, cache, ids, n, a->compress ? a->compress : "policy=full", logits, &run);
    double dt = now_s() - t0;
    if (rc) {
        skv_kv_cache_free(&cache);
        skv_compressor_free(&run.comp);
        free(ids);
        free(logits);
        return fail("select", rc);
    }
    const struct skv_model_config *c = &m->cfg;
    uint64_t before = (uint64_t)n * c->n_layers * c->n_kv_heads * 2 * cache->row_bytes;
    uint64_t after = skv_kv_cache_bytes(cache);
    const uint64_t block_bytes = skv_kv_pool_block_bytes(m->kv_pool);
    struct skv_kv_blocks held;
    skv_kv_cache_blocks(cache, &held);
    /* query-head width measured: the kept rows stored as a cache without GQA would store them,
     * each KV head's rows once for each of its query heads, in the pool's own blocks */
    uint64_t wide_rows = 0, wide_blocks = 0;
    bool wide_ok = wide_bytes(m, cache, &wide_rows, &wide_blocks) == SKV_OK;
    json_t *j = json_object(), *layers = json_array();
    json_object_set_new(j, "n_tokens", json_integer(n));
    json_object_set_new(j, "spec", json_string(a->compress ? a->compress : "policy=full"));
    json_object_set_new(j, "bytes_before", json_integer((json_int_t)before));
    json_object_set_new(j, "bytes_after", json_integer((json_int_t)after));
    json_object_set_new(j, "bytes_after_blocks", json_integer((json_int_t)(held.held * block_bytes)));
    json_object_set_new(j, "bytes_query_head_width", wide_ok ? json_integer((json_int_t)wide_rows) : json_null());
    json_object_set_new(j, "bytes_query_head_width_blocks",
                        wide_ok ? json_integer((json_int_t)(wide_blocks * block_bytes)) : json_null());
    json_object_set_new(j, "peak_kv_bytes", json_integer((json_int_t)run.peak_kv_bytes));
    json_object_set_new(j, "seconds", json_real(dt));
    json_object_set_new(j, "ids", ids_json(ids, n));
    const float *sim = run.comp ? skv_compressor_similarity(run.comp) : NULL;
    for (int l = 0; l < c->n_layers; l++) {
        json_t *jl = json_object(), *heads = json_array();
        json_object_set_new(jl, "layer", json_integer(l));
        if (run.comp)
            json_object_set_new(jl, "budget", json_integer(skv_compressor_layer_budgets(run.comp)[l]));
        if (sim)
            json_object_set_new(jl, "similarity", json_real(sim[l]));
        for (int h = 0; h < c->n_kv_heads; h++) {
            const struct skv_kv_head *kh = skv_kv_cache_head(cache, l, h);
            json_array_append_new(heads, ids_json(kh->pos, kh->len));
        }
        json_object_set_new(jl, "kept", heads);
        json_array_append_new(layers, jl);
    }
    json_object_set_new(j, "layers", layers);
    if (a->json) {
        emit(j);
    } else {
        printf("%d tokens, spec %s: %.2f MiB -> %.2f MiB of KV (%.1f%%), peak %.2f MiB, %.2f s\n", n,
               a->compress ? a->compress : "policy=full", before / 1048576.0, after / 1048576.0,
               100.0 * after / (double)before, run.peak_kv_bytes / 1048576.0, dt);
        for (int l = 0; l < c->n_layers; l++) {
            printf("layer %2d:", l);
            for (int h = 0; h < c->n_kv_heads; h++)
                printf(" %5d", skv_kv_cache_head(cache, l, h)->len);
            if (sim)
                printf("   sim %.4f", sim[l]);
            printf("\n");
        }
    }
    json_decref(j);
    skv_kv_cache_free(&cache);
    skv_compressor_free(&run.comp);
    free(ids);
    free(logits);
    return 0;
}

/* A comma-separated list of at most max counts in [lo, hi]; -1 (with a message) when an entry
 * is not one or there are more. */
static int parse_list(const char *what, const char *s, int *vals, int max, int lo, int hi)
{
    int n = 0;
    while (*s) {
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || errno || v < lo || v > hi || (*end && *end != ',') || (*end == ',' && !end[1])) {
            fprintf(stderr, "snapkv-bench: --%s: '%s' is not a list of counts from %d to %d\n", what, s, lo, hi);
            return -1;
        }
        if (n == max) {
            fprintf(stderr, "snapkv-bench: --%s: more than %d values\n", what, max);
            return -1;
        }
        vals[n++] = (int)v;
        s = *end ? end + 1 : end;
    }
    return n;
}

/* Deterministic pseudo-random prompt ids (avoiding the first 256 byte tokens is not needed). */
static void fill_ids(int32_t *ids, int n, int n_vocab, uint64_t seed)
{
    for (int i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((seed >> 33) % (uint64_t)n_vocab);
    }
}

/* Bytes one decode step streams from weights: every matrix a token passes through (the
 * embedding is one row, left out). */
static uint64_t decode_weight_bytes(const struct skv_model *m)
{
    uint64_t b = m->output.nbytes;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const struct skv_layer_weights *w = &m->layers[l];
        b += w->wq.nbytes + w->wk.nbytes + w->wv.nbytes + w->wo.nbytes + w->w_gate.nbytes + w->w_up.nbytes +
             w->w_down.nbytes;
    }
    return b;
}

/* Gives cache a copy of each row it shares with another (speed --private: a batch of sessions
 * that share nothing, as independent clients' are): each head's rows read out and written
 * back, which copies the shared blocks. */
static int unshare_rows(struct skv_kv_cache *cache)
{
    float *rows = NULL;
    int rc = SKV_OK;
    for (int i = 0; i < cache->n_layers * cache->n_kv_heads && !rc; i++) {
        const int len = cache->heads[i].len;
        float *more = realloc(rows, (size_t)(len ? len : 1) * (size_t)cache->head_dim * sizeof *rows);
        if (!more) {
            rc = SKV_E_NOMEM;
            break;
        }
        rows = more;
        for (int which = 0; which < 2 && !rc; which++)
            if (!(rc = skv_kv_cache_read_rows(cache, i / cache->n_kv_heads, i % cache->n_kv_heads, which, 0, len,
                                              rows)))
                rc = skv_kv_cache_write_rows(cache, i / cache->n_kv_heads, i % cache->n_kv_heads, which, 0, len,
                                             rows);
    }
    free(rows);
    return rc;
}

/* Prefill and decode speed. With --compress SPEC every prefill (the timed ones and the one
 * that builds each decode depth) compresses as it goes, the compressor's share of the prefill
 * is timed (the backend synchronized around it), and decode runs with the decode-time hook. */
static int cmd_speed(const struct args *a, struct skv_engine *e, struct skv_model *m)
{
    int prefill[16], depth[16], append[16];
    /* --prefill none: only the prefills that build the decode depths (timed there too) */
    bool no_prefill = a->prefill_sizes && strcmp(a->prefill_sizes, "none") == 0;
    const char *sizes = a->prefill_sizes ? a->prefill_sizes : "512,2048,8192";
    const char *depths = a->decode_depths ? a->decode_depths : "0,512,4096,8192";
    int np = no_prefill ? 0 : parse_list("prefill", sizes, prefill, 16, 1, 1 << 24);
    int nd = parse_list("decode-depth", depths, depth, 16, 0, 1 << 24);
    int na = a->append_sizes ? parse_list("append", a->append_sizes, append, 16, 1, 1 << 20) : 0;
    if (np < 0 || nd < 0 || na < 0)
        return 2;
    int dtok = a->decode_tokens > 0 ? a->decode_tokens : 32;
    int batch = a->batch > 0 ? a->batch : 1;
    int rep = a->repeat > 0 ? a->repeat : 1;
    const char *spec = a->compress && *a->compress ? a->compress : NULL;
    int maxn = 1;
    for (int i = 0; i < np; i++)
        maxn = prefill[i] > maxn ? prefill[i] : maxn;
    for (int i = 0; i < nd; i++)
        maxn = depth[i] > maxn ? depth[i] : maxn;
    for (int i = 0; i < na; i++)
        maxn = append[i] > maxn ? append[i] : maxn;
    if (spec) {
        struct skv_compress_spec cs;
        int rc = skv_compress_spec_parse(spec, &cs);
        if (rc)
            return fail("--compress", rc);
    }
    int nv = m->cfg.n_vocab;
    int32_t *ids = malloc((size_t)maxn * sizeof *ids);
    float *logits = malloc((size_t)batch * nv * sizeof *logits); /* each sequence's, as a server samples */
    if (!ids || !logits) {
        free(ids);
        free(logits);
        return fail("speed", SKV_E_NOMEM);
    }
    fill_ids(ids, maxn, nv, 42);
    json_t *j = json_object(), *jp = json_array(), *jd = json_array(), *ja = json_array();
    /* one untimed forward first: one-time costs (device context, library handles, first-touch
     * pages) stay out of the first figure */
    struct skv_kv_cache *warm = NULL;
    int rc = skv_kv_cache_new(m, &warm);
    if (!rc)
        rc = skv_engine_forward(e, warm, ids, maxn < 64 ? maxn : 64, NULL, logits);
    skv_kv_cache_free(&warm);
    for (int i = 0; i < np && !rc; i++) {
        double best = 1e30, best_comp = 0, rate_sum = 0;
        int runs = 0;
        uint64_t kv_after = 0;
        for (int r = 0; r < rep && !rc; r++) {
            struct skv_kv_cache *cache = NULL;
            struct prefill_run run = {.timed = spec ? m->be : NULL};
            rc = skv_kv_cache_new(m, &cache);
            double t0 = now_s();
            if (!rc)
                rc = compressed_forward(e, m, cache, ids, prefill[i], spec, logits, &run);
            if (!rc)
                rc = m->be->ops->sync(m->be);
            double dt = now_s() - t0;
            if (rc) { /* a failed repeat is no figure */
                skv_compressor_free(&run.comp);
                skv_kv_cache_free(&cache);
                break;
            }
            rate_sum += prefill[i] / dt;
            runs++;
            if (dt < best) {
                best = dt;
                best_comp = run.compress_seconds;
                kv_after = cache ? skv_kv_cache_bytes(cache) : 0;
            }
            skv_compressor_free(&run.comp);
            skv_kv_cache_free(&cache);
        }
        json_t *o = json_object();
        json_object_set_new(o, "tokens", json_integer(prefill[i]));
        json_object_set_new(o, "seconds", json_real(best));
        json_object_set_new(o, "tokens_per_second", json_real(prefill[i] / best));
        /* the table quotes the best repeat; the mean of the repeats' rates is llama-bench's avg_ts */
        json_object_set_new(o, "mean_tokens_per_second", json_real(runs ? rate_sum / runs : 0));
        json_object_set_new(o, "repeats", json_integer(runs));
        json_object_set_new(o, "kv_bytes_after", json_integer((json_int_t)kv_after));
        if (spec) {
            json_object_set_new(o, "compress_seconds", json_real(best_comp));
            json_object_set_new(o, "compress_share", json_real(best_comp / best));
        }
        json_array_append_new(jp, o);
        if (!a->json)
            fprintf(stderr, "prefill %5d: %8.1f t/s%s\n", prefill[i], prefill[i] / best, spec ? " (compressed)" : "");
    }
    for (int i = 0; i < nd && !rc; i++) {
        struct skv_kv_cache *cache = NULL;
        /* the prefill that builds the depth is timed too (once: compare its compressor share) */
        struct prefill_run run = {.timed = spec ? m->be : NULL};
        rc = skv_kv_cache_new(m, &cache);
        double t_pre = now_s();
        if (!rc && depth[i] > 0)
            rc = compressed_forward(e, m, cache, ids, depth[i], spec, logits, &run);
        if (!rc)
            rc = m->be->ops->sync(m->be);
        t_pre = now_s() - t_pre;
        uint64_t kv_bytes = rc ? 0 : skv_kv_cache_bytes(cache); /* what a decode step reads */
        double best = 1e30, rate_sum = 0;
        int druns = 0;
        for (int r = 0; r < rep && !rc; r++) {
            /* every repeat decodes the same tokens from copies of the prefilled cache and of its
             * compressor (one per sequence of the batch): a policy that evicts or re-scores
             * while decoding changes both */
            struct skv_kv_cache *work[SKV_ENGINE_MAX_BATCH] = {0};
            struct skv_compressor *wc[SKV_ENGINE_MAX_BATCH] = {0};
            struct skv_forward_opts dec[SKV_ENGINE_MAX_BATCH];
            struct skv_batch_seq seqs[SKV_ENGINE_MAX_BATCH];
            for (int b = 0; b < batch && !rc; b++) {
                rc = skv_kv_cache_clone(cache, &work[b]);
                if (!rc && run.comp)
                    rc = skv_compressor_clone(run.comp, &wc[b]);
                if (!rc)
                    rc = skv_kv_cache_reserve(work[b], dtok + 1);
                if (!rc && a->private_rows)
                    rc = unshare_rows(work[b]);
                dec[b] = (struct skv_forward_opts){.hook = skv_compressor_hook, .hook_user = wc[b],
                                                   .attention_probs = skv_compressor_wants_probs(wc[b])};
            }
            int32_t t = 0;
            double t0 = now_s();
            for (int k = 0; k < dtok && !rc; k++) {
                t = (int32_t)(((int64_t)t * 7919 + 13) % nv);
                for (int b = 0; b < batch && !rc; b++) {
                    if (wc[b]) /* as the daemon decodes: the upkeep at the forward's end */
                        rc = skv_compressor_begin_step(wc[b], work[b], 1, true, &dec[b]);
                    seqs[b] = (struct skv_batch_seq){.cache = work[b], .token = t, .opts = wc[b] ? &dec[b] : NULL,
                                                     .logits = logits + (size_t)b * nv};
                }
                if (rc)
                    break;
                /* one sequence: the plain forward, as every figure before --batch */
                rc = batch == 1 ? skv_engine_forward(e, work[0], &t, 1, wc[0] ? &dec[0] : NULL, logits)
                                : skv_engine_decode_batch(e, seqs, batch);
            }
            if (!rc)
                rc = m->be->ops->sync(m->be);
            double dt = now_s() - t0;
            for (int b = 0; b < batch; b++) {
                skv_compressor_free(&wc[b]);
                skv_kv_cache_free(&work[b]);
            }
            if (rc)
                break;
            best = dt < best ? dt : best;
            rate_sum += (double)batch * dtok / dt;
            druns++;
        }
        /* appends: one forward of append[q] tokens on a copy of the cache (and its compressor's
         * decode upkeep, as an APPEND runs it), best of the repeats */
        for (int q = 0; q < na && !rc; q++) {
            double abest = 1e30;
            for (int r = 0; r < rep && !rc; r++) {
                struct skv_kv_cache *work = NULL;
                struct skv_compressor *wc = NULL;
                rc = skv_kv_cache_clone(cache, &work);
                if (!rc && run.comp)
                    rc = skv_compressor_clone(run.comp, &wc);
                if (!rc)
                    rc = skv_kv_cache_reserve(work, append[q]);
                struct skv_forward_opts ao = {0};
                if (!rc && wc) /* as the daemon runs an APPEND: deferred upkeep below 64 tokens */
                    rc = skv_compressor_begin_step(wc, work, append[q], append[q] < 64, &ao);
                double t0 = now_s();
                if (!rc)
                    rc = skv_engine_forward(e, work, ids, append[q], wc ? &ao : NULL, logits);
                if (!rc)
                    rc = m->be->ops->sync(m->be);
                double dt = now_s() - t0;
                skv_compressor_free(&wc);
                skv_kv_cache_free(&work);
                abest = !rc && dt < abest ? dt : abest;
            }
            if (rc)
                break;
            json_t *o = json_object();
            json_object_set_new(o, "depth", json_integer(depth[i]));
            json_object_set_new(o, "tokens", json_integer(append[q]));
            json_object_set_new(o, "seconds", json_real(abest));
            json_object_set_new(o, "tokens_per_second", json_real(append[q] / abest));
            json_array_append_new(ja, o);
            if (!a->json)
                fprintf(stderr, "append %4d @%5d: %8.3f ms\n", append[q], depth[i], abest * 1e3);
        }
        double run_comp_s = run.compress_seconds;
        skv_compressor_free(&run.comp);
        skv_kv_cache_free(&cache);
        json_t *o = json_object();
        json_object_set_new(o, "depth", json_integer(depth[i]));
        json_object_set_new(o, "batch", json_integer(batch));
        json_object_set_new(o, "private", json_boolean(a->private_rows));
        /* tokens: each sequence's; seconds: for all of them (a step each); tokens/s: over all */
        json_object_set_new(o, "tokens", json_integer(dtok));
        json_object_set_new(o, "seconds", json_real(best));
        json_object_set_new(o, "tokens_per_second", json_real((double)batch * dtok / best));
        json_object_set_new(o, "mean_tokens_per_second", json_real(druns ? rate_sum / druns : 0));
        json_object_set_new(o, "kv_read_bytes", json_integer((json_int_t)kv_bytes)); /* one sequence's */
        json_object_set_new(o, "prefill_seconds", json_real(depth[i] > 0 ? t_pre : 0));
        if (spec && depth[i] > 0) {
            json_object_set_new(o, "compress_seconds", json_real(run_comp_s));
            json_object_set_new(o, "compress_share", json_real(run_comp_s / t_pre));
        }
        json_array_append_new(jd, o);
        if (!a->json)
            fprintf(stderr, "decode @%5d: %8.1f t/s%s\n", depth[i], (double)batch * dtok / best,
                    spec ? " (compressed)" : "");
    }
    free(ids);
    free(logits);
    if (rc) {
        json_decref(j);
        json_decref(jp);
        json_decref(jd);
        json_decref(ja);
        return fail("speed", rc);
    }
    json_object_set_new(j, "model", json_string(m->name));
    json_object_set_new(j, "backend", json_string(m->be->name));
    json_object_set_new(j, "threads", json_integer(m->be->n_threads));
    json_object_set_new(j, "kv_type", json_string(skv_dtype_name(skv_kv_pool_kv_type(m->kv_pool))));
    json_object_set_new(j, "mode", json_string(m->reference ? "reference" : "fast"));
    json_object_set_new(j, "compress", spec ? json_string(spec) : json_null());
    json_object_set_new(j, "weight_bytes", json_integer((json_int_t)decode_weight_bytes(m)));
    json_object_set_new(j, "prefill", jp);
    json_object_set_new(j, "decode", jd);
    json_object_set_new(j, "append", ja);
    json_object_set_new(j, "peak_rss_mib", json_real(peak_rss_mib()));
    if (a->json) {
        emit(j);
    } else {
        printf("| %-8s | %-8s | %12s |\n|---|---|---|\n", "phase", "tokens", "tokens/s");
        size_t k;
        json_t *o;
        json_array_foreach(jp, k, o)
            printf("| prefill  | %8lld | %12.1f |\n", (long long)json_integer_value(json_object_get(o, "tokens")),
                   json_real_value(json_object_get(o, "tokens_per_second")));
        json_array_foreach(jd, k, o)
            printf("| decode @ | %8lld | %12.1f |\n", (long long)json_integer_value(json_object_get(o, "depth")),
                   json_real_value(json_object_get(o, "tokens_per_second")));
        json_array_foreach(ja, k, o)
            printf("| append %lld @ | %8lld | %12.1f |\n", (long long)json_integer_value(json_object_get(o, "tokens")),
                   (long long)json_integer_value(json_object_get(o, "depth")),
                   json_real_value(json_object_get(o, "tokens_per_second")));
        printf("threads %d, backend %s, mode %s, batch %d, peak RSS %.0f MiB\n", m->be->n_threads, m->be->name,
               m->reference ? "reference" : "fast", batch, peak_rss_mib());
    }
    json_decref(j);
    return 0;
}

/* The quality benchmark (tools/bench_quality.c) with the shared options filled in. */
/* The machine's read bandwidth, for comparison with the GEMV: threads summing their slices of
 * a 256 MiB buffer, best of 5 passes. */
struct read_slice {
    const uint64_t *p;
    size_t n;     /* 64-bit words */
    uint64_t sum;
};

static void *read_slice_run(void *arg)
{
    struct read_slice *r = arg;
#if defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    size_t i = 0;
    for (; i + 8 <= r->n; i += 8) {
        a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *)(r->p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *)(r->p + i + 4)));
    }
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(a0, a1));
    r->sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; i < r->n; i++)
        r->sum += r->p[i];
#else
    for (size_t i = 0; i < r->n; i++)
        r->sum += r->p[i];
#endif
    return NULL;
}

static double read_bandwidth(int threads)
{
    const size_t bytes = (size_t)256 << 20, words = bytes / 8;
    uint64_t *buf = aligned_alloc(64, bytes);
    if (!buf || threads < 1 || threads > 256) {
        free(buf);
        return 0;
    }
    memset(buf, 1, bytes);
    double best = 1e30;
    for (int rep = 0; rep < 5; rep++) {
        struct read_slice sl[256];
        pthread_t th[256];
        double t0 = now_s();
        for (int t = 0; t < threads; t++) {
            size_t a = words / threads * t / 4 * 4, b = t == threads - 1 ? words : words / threads * (t + 1) / 4 * 4;
            sl[t] = (struct read_slice){buf + a, b - a, 0};
            if (t > 0 && pthread_create(&th[t], NULL, read_slice_run, &sl[t]) != 0)
                read_slice_run(&sl[t]), th[t] = 0;
        }
        read_slice_run(&sl[0]);
        for (int t = 1; t < threads; t++)
            if (th[t])
                pthread_join(th[t], NULL);
        double dt = now_s() - t0;
        best = dt < best ? dt : best;
    }
    free(buf);
    return bytes / best / 1e9;
}

/* Decode's weight traffic alone: one matmul of a single activation row through every weight
 * matrix of the model (what a decode step streams from memory), best of --repeat passes, in
 * GB/s of weight bytes per dtype and in all. Compare with the machine's read bandwidth. */
static int cmd_gemv(const struct args *a, struct skv_model *m)
{
    const struct skv_model_config *c = &m->cfg;
    int nt = c->n_layers * 7 + 1, rep = a->repeat > 0 ? a->repeat : 5;
    const struct skv_tensor **ts = malloc((size_t)nt * sizeof *ts);
    if (!ts)
        return 1;
    int64_t maxr = 0, maxc = 0;
    nt = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const struct skv_layer_weights *w = &m->layers[l];
        const struct skv_tensor *lw[] = {&w->wq, &w->wk, &w->wv, &w->wo, &w->w_gate, &w->w_up, &w->w_down};
        for (int k = 0; k < 7; k++)
            ts[nt++] = lw[k];
    }
    ts[nt++] = &m->output;
    for (int i = 0; i < nt; i++) {
        maxc = ts[i]->ne[0] > maxc ? ts[i]->ne[0] : maxc;
        maxr = ts[i]->ne[1] > maxr ? ts[i]->ne[1] : maxr;
    }
    struct skv_backend *be = m->be;
    float *x = NULL, *out = NULL, *hx = calloc((size_t)maxc, sizeof *hx);
    int rc = hx ? SKV_OK : SKV_E_NOMEM;
    for (int64_t i = 0; hx && i < maxc; i++)
        hx[i] = (float)((i * 37) % 17 - 8) / 8.0f;
    if (!rc)
        rc = be->ops->alloc(be, (size_t)maxc * sizeof(float), (void **)&x);
    if (!rc)
        rc = be->ops->alloc(be, (size_t)maxr * sizeof(float), (void **)&out);
    if (!rc)
        rc = be->ops->upload(be, x, hx, (size_t)maxc * sizeof(float));
    double sec[SKV_DTYPE_COUNT] = {0}, bytes[SKV_DTYPE_COUNT] = {0}, best = 1e30, total = 0;
    for (int i = 0; i < nt; i++)
        bytes[ts[i]->type] += (double)ts[i]->nbytes;
    for (int r = 0; r < rep && !rc; r++) {
        double per[SKV_DTYPE_COUNT] = {0}, t_all = 0;
        for (int i = 0; i < nt && !rc; i++) {
            double t0 = now_s();
            rc = be->ops->matmul(be, out, ts[i], NULL, x, 1);
            if (!rc)
                rc = be->ops->sync(be);
            double dt = now_s() - t0;
            per[ts[i]->type] += dt;
            t_all += dt;
        }
        if (!rc && t_all < best) {
            best = t_all;
            memcpy(sec, per, sizeof sec);
        }
    }
    be->ops->free(be, x);
    be->ops->free(be, out);
    free(hx);
    free(ts);
    if (rc)
        return fail("gemv", rc);
    json_t *j = json_object(), *jt = json_array();
    for (int t = 0; t < SKV_DTYPE_COUNT; t++) {
        if (bytes[t] == 0)
            continue;
        total += bytes[t];
        json_t *o = json_object();
        json_object_set_new(o, "dtype", json_string(skv_dtype_name(t)));
        json_object_set_new(o, "bytes", json_integer((json_int_t)bytes[t]));
        json_object_set_new(o, "seconds", json_real(sec[t]));
        json_object_set_new(o, "gb_per_second", json_real(bytes[t] / sec[t] / 1e9));
        json_array_append_new(jt, o);
    }
    json_object_set_new(j, "types", jt);
    json_object_set_new(j, "bytes", json_integer((json_int_t)total));
    json_object_set_new(j, "seconds", json_real(best));
    json_object_set_new(j, "gb_per_second", json_real(total / best / 1e9));
    json_object_set_new(j, "threads", json_integer(be->n_threads));
    json_object_set_new(j, "backend", json_string(be->name));
    double rbw = read_bandwidth(be->n_threads);
    json_object_set_new(j, "host_read_gb_per_second", json_real(rbw));
    if (a->json) {
        json_dumpf(j, stdout, JSON_INDENT(2));
        putchar('\n');
    } else {
        printf("| dtype | MiB | GB/s |\n|---|---:|---:|\n");
        json_t *o;
        size_t k;
        json_array_foreach(jt, k, o)
            printf("| %s | %.1f | %.2f |\n", json_string_value(json_object_get(o, "dtype")),
                   json_integer_value(json_object_get(o, "bytes")) / 1048576.0,
                   json_real_value(json_object_get(o, "gb_per_second")));
        printf("| all | %.1f | %.2f |\n", total / 1048576.0, total / best / 1e9);
        printf("threads %d, backend %s: one pass = one decode step's weight traffic, %.2f ms\n", be->n_threads,
               be->name, best * 1e3);
        printf("host memory read with %d threads (256 MiB, best of 5): %.2f GB/s\n", be->n_threads, rbw);
    }
    json_decref(j);
    return 0;
}

static int cmd_quality(struct args *a, struct skv_engine *e, struct skv_model *m, int argc, char **argv)
{
    struct skv_quality_opts *q = &a->quality;
    q->seed = a->seed;
    q->max_tokens = a->max_tokens;
    q->json_stdout = a->json;
    q->argc = argc;
    q->argv = argv;
    int rc = skv_bench_quality(e, m, q);
    return rc ? fail("quality", rc) : 0;
}

/* The daemon benchmark (tools/bench_serve.c) with the shared options filled in. */
static int cmd_serve(struct args *a, struct skv_engine *e, struct skv_model *m, int argc, char **argv)
{
    struct skv_serve_opts *s = &a->serve;
    s->argv0 = argv[0];
    s->model_path = a->model;
    s->threads = a->threads;
    s->kv_type = a->kv_type;
    s->decode_tokens = a->decode_tokens;
    s->specs = a->quality.specs;
    s->json_stdout = a->json;
    s->argc = argc;
    s->argv = argv;
    int rc = skv_bench_serve(e, m, s);
    return rc ? fail("serve", rc) : 0;
}

/* A whole number option in [lo, hi]: false (with a message) for anything else (atoi read
 * "abc" as 0 and --clients 65536 --requests 65536 overflowed a count). */
static bool int_opt(const char *name, const char *text, long lo, long hi, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (end == text || *end || errno || v < lo || v > hi) {
        fprintf(stderr, "snapkv-bench: --%s wants a whole number from %ld to %ld, not '%s'\n", name, lo, hi, text);
        return false;
    }
    *out = (int)v;
    return true;
}

/* A number option in [lo, hi] (the same for reals). */
static bool real_opt(const char *name, const char *text, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (end == text || *end || errno || !(v >= lo && v <= hi)) {
        fprintf(stderr, "snapkv-bench: --%s wants a number from %g to %g, not '%s'\n", name, lo, hi, text);
        return false;
    }
    *out = v;
    return true;
}

/* The options each command reads besides --model, --threads, --backend, --json and --reference:
 * any other is refused, not ignored (speed --specs ran uncompressed). */
static const struct {
    const char *cmd, *opts;
} cmd_opts[] = {
    {"tokenize", "special bos cap"},
    {"logits", "prompt prompt-file tokens chat assistant top all"},
    {"generate", "prompt prompt-file tokens chat assistant max-tokens temperature top-k top-p seed compress min-p "
                 "repetition-penalty repetition-last-n frequency-penalty presence-penalty"},
    {"select", "prompt prompt-file tokens chat assistant compress"},
    {"speed", "prefill decode-depth decode-tokens batch private repeat compress append"},
    {"gemv", "repeat"},
    {"quality", "task lengths depths specs trials out-dir passkey-style texts fid-prefill fid-tokens max-tokens seed"},
    {"serve", "endpoint admin-endpoint clients requests sessions context pool-gib parts decode-tokens specs "
              "store-signed"},
};

/* Whether command cmd reads option opt (SKV_OK), a message and 2 when not. */
static int check_option(const char *cmd, const char *opt)
{
    static const char common[] = " model threads backend json reference kv-type help ";
    char word[64];
    snprintf(word, sizeof word, " %s ", opt);
    if (strstr(common, word))
        return 0;
    for (size_t i = 0; i < sizeof cmd_opts / sizeof cmd_opts[0]; i++) {
        if (strcmp(cmd, cmd_opts[i].cmd) != 0)
            continue;
        char list[256];
        snprintf(list, sizeof list, " %s ", cmd_opts[i].opts);
        if (strstr(list, word))
            return 0;
        fprintf(stderr, "snapkv-bench: %s does not take --%s (its own options:", cmd, opt);
        for (const char *p = cmd_opts[i].opts; *p;) {
            size_t n = strcspn(p, " ");
            fprintf(stderr, " --%.*s", (int)n, p);
            p += n + (p[n] == ' ');
        }
        fprintf(stderr, ")\n");
        return 2;
    }
    return 0; /* an unknown command: usage() says so */
}

int main(int argc, char **argv)
{
    const char *missing; /* links libskvcpu.a, whose check ran before main (this file uses AVX2) */
    if (!skv_cpu_ok(&missing))
        return 1;
    struct args a = {.backend = "auto", .kv_type = "f32", .threads = 0, .cap = -1, .quality = {.passkey_style = -1}};
    enum { O_MODEL = 256, O_THREADS, O_BACKEND, O_JSON, O_REF, O_PROMPT, O_PFILE, O_TOKENS, O_CHAT, O_SPECIAL,
           O_BOS, O_TOP, O_ALL, O_MAXT, O_TEMP, O_TOPK, O_TOPP, O_SEED, O_PREFILL, O_DEPTH, O_DTOK, O_REPEAT,
           O_COMPRESS, O_TASK, O_LENGTHS, O_DEPTHS, O_SPECS, O_TRIALS, O_OUTDIR, O_PKSTYLE, O_TEXTS, O_FIDN,
           O_FIDM, O_CAP, O_BATCH, O_PRIVATE, O_KVTYPE, O_MINP, O_REPP, O_REPN, O_FREQP, O_PRESP, O_APPEND,
           O_ASSISTANT };
    enum { O_ENDPOINT = 512, O_ADMIN_EP, O_CLIENTS, O_REQUESTS, O_SESSIONS, O_CONTEXT, O_POOL_GIB, O_PARTS,
           O_STORE_SIGNED };
    static const struct option opts[] = {
        {"model", required_argument, NULL, O_MODEL},       {"threads", required_argument, NULL, O_THREADS},
        {"backend", required_argument, NULL, O_BACKEND},   {"json", no_argument, NULL, O_JSON},
        {"reference", no_argument, NULL, O_REF},           {"prompt", required_argument, NULL, O_PROMPT},
        {"prompt-file", required_argument, NULL, O_PFILE}, {"tokens", required_argument, NULL, O_TOKENS},
        {"chat", no_argument, NULL, O_CHAT},               {"special", no_argument, NULL, O_SPECIAL},
        {"assistant", required_argument, NULL, O_ASSISTANT},
        {"bos", no_argument, NULL, O_BOS},                 {"top", required_argument, NULL, O_TOP},
        {"cap", required_argument, NULL, O_CAP},
        {"all", no_argument, NULL, O_ALL},                 {"max-tokens", required_argument, NULL, O_MAXT},
        {"temperature", required_argument, NULL, O_TEMP},  {"top-k", required_argument, NULL, O_TOPK},
        {"top-p", required_argument, NULL, O_TOPP},        {"seed", required_argument, NULL, O_SEED},
        {"prefill", required_argument, NULL, O_PREFILL},   {"decode-depth", required_argument, NULL, O_DEPTH},
        {"decode-tokens", required_argument, NULL, O_DTOK}, {"repeat", required_argument, NULL, O_REPEAT},
        {"compress", required_argument, NULL, O_COMPRESS}, {"batch", required_argument, NULL, O_BATCH},
        {"private", no_argument, NULL, O_PRIVATE},
        {"task", required_argument, NULL, O_TASK},         {"lengths", required_argument, NULL, O_LENGTHS},
        {"depths", required_argument, NULL, O_DEPTHS},     {"specs", required_argument, NULL, O_SPECS},
        {"trials", required_argument, NULL, O_TRIALS},     {"out-dir", required_argument, NULL, O_OUTDIR},
        {"passkey-style", required_argument, NULL, O_PKSTYLE}, {"texts", required_argument, NULL, O_TEXTS},
        {"fid-prefill", required_argument, NULL, O_FIDN},  {"fid-tokens", required_argument, NULL, O_FIDM},
        {"endpoint", required_argument, NULL, O_ENDPOINT}, {"admin-endpoint", required_argument, NULL, O_ADMIN_EP},
        {"clients", required_argument, NULL, O_CLIENTS},   {"requests", required_argument, NULL, O_REQUESTS},
        {"sessions", required_argument, NULL, O_SESSIONS}, {"context", required_argument, NULL, O_CONTEXT},
        {"pool-gib", required_argument, NULL, O_POOL_GIB}, {"parts", required_argument, NULL, O_PARTS},
        {"store-signed", no_argument, NULL, O_STORE_SIGNED}, {"kv-type", required_argument, NULL, O_KVTYPE},
        {"min-p", required_argument, NULL, O_MINP},        {"repetition-penalty", required_argument, NULL, O_REPP},
        {"repetition-last-n", required_argument, NULL, O_REPN},
        {"frequency-penalty", required_argument, NULL, O_FREQP},
        {"presence-penalty", required_argument, NULL, O_PRESP},
        {"append", required_argument, NULL, O_APPEND},
        {"help", no_argument, NULL, 'h'},                  {NULL, 0, NULL, 0},
    };
    int c, li = -1, n_given = 0;
    const char *given[128];
    bool ok = true;
    double real = 0;
    while (ok && (c = getopt_long(argc, argv, "h", opts, &li)) != -1) {
        if (c != 'h' && c != '?' && li >= 0 && n_given < (int)(sizeof given / sizeof given[0]))
            given[n_given++] = opts[li].name;
        li = -1;
        switch (c) {
        case O_MODEL: a.model = optarg; break;
        case O_THREADS: ok = int_opt("threads", optarg, 0, 1024, &a.threads); break;
        case O_BACKEND: a.backend = optarg; break;
        case O_KVTYPE:
            a.kv_type = optarg;
            if (skv_kv_type_parse(optarg) < 0) {
                fprintf(stderr, "snapkv-bench: --kv-type: '%s' is not f32, f16 or q8_0\n", optarg);
                ok = false;
            }
            break;
        case O_JSON: a.json = true; break;
        case O_REF: a.reference = true; break;
        case O_PROMPT: a.prompt = optarg; break;
        case O_PFILE: a.prompt_file = optarg; break;
        case O_TOKENS: a.tokens = optarg; break;
        case O_CHAT: a.chat = true; break;
        case O_ASSISTANT: a.assistant = optarg; break;
        case O_SPECIAL: a.special = true; break;
        case O_BOS: a.bos = true; break;
        case O_CAP: ok = int_opt("cap", optarg, 0, INT_MAX - 1, &a.cap); break;
        case O_TOP: ok = int_opt("top", optarg, 0, 1 << 24, &a.top); break;
        case O_ALL: a.all_logits = true; break;
        case O_MAXT: ok = int_opt("max-tokens", optarg, 0, 1 << 24, &a.max_tokens); break;
        case O_TEMP: ok = real_opt("temperature", optarg, 0, 100, &real); a.temperature = (float)real; break;
        case O_TOPK: ok = int_opt("top-k", optarg, 0, 1 << 24, &a.top_k); break;
        case O_TOPP: ok = real_opt("top-p", optarg, 0, 1, &real); a.top_p = (float)real; break;
        case O_MINP: ok = real_opt("min-p", optarg, 0, 1, &real); a.min_p = (float)real; break;
        case O_REPP:
            ok = real_opt("repetition-penalty", optarg, 0, 100, &real);
            a.repetition_penalty = (float)real;
            break;
        case O_REPN: ok = int_opt("repetition-last-n", optarg, 0, INT_MAX, &a.repetition_last_n); break;
        case O_FREQP:
            ok = real_opt("frequency-penalty", optarg, -2, 2, &real);
            a.frequency_penalty = (float)real;
            break;
        case O_PRESP:
            ok = real_opt("presence-penalty", optarg, -2, 2, &real);
            a.presence_penalty = (float)real;
            break;
        case O_SEED: {
            char *end;
            errno = 0;
            a.seed = strtoull(optarg, &end, 10);
            if (errno || end == optarg || *end || *optarg == '-') {
                fprintf(stderr, "snapkv-bench: --seed: '%s' is not a number from 0 to 2^64-1\n", optarg);
                ok = false;
            }
            break;
        }
        case O_PREFILL: a.prefill_sizes = optarg; break;
        case O_DEPTH: a.decode_depths = optarg; break;
        case O_APPEND: a.append_sizes = optarg; break;
        case O_DTOK: ok = int_opt("decode-tokens", optarg, 1, 1 << 20, &a.decode_tokens); break;
        case O_BATCH: ok = int_opt("batch", optarg, 1, SKV_ENGINE_MAX_BATCH, &a.batch); break;
        case O_PRIVATE: a.private_rows = true; break;
        case O_REPEAT: ok = int_opt("repeat", optarg, 1, 1000000, &a.repeat); break;
        case O_COMPRESS: a.compress = optarg; break;
        case O_TASK: a.quality.task = optarg; break;
        case O_LENGTHS: a.quality.lengths = optarg; break;
        case O_DEPTHS: a.quality.depths = optarg; break;
        case O_SPECS: a.quality.specs = optarg; break;
        case O_TRIALS: ok = int_opt("trials", optarg, 1, 1000000, &a.quality.trials); break;
        case O_OUTDIR: a.quality.out_dir = optarg; break;
        case O_PKSTYLE: ok = int_opt("passkey-style", optarg, -1, 1000, &a.quality.passkey_style); break;
        case O_TEXTS: a.quality.texts = optarg; break;
        case O_FIDN: ok = int_opt("fid-prefill", optarg, 1, 1 << 24, &a.quality.fid_prefill); break;
        case O_FIDM: ok = int_opt("fid-tokens", optarg, 1, 1 << 20, &a.quality.fid_tokens); break;
        case O_ENDPOINT: a.serve.endpoint = optarg; break;
        case O_ADMIN_EP: a.serve.admin_endpoint = optarg; break;
        case O_CLIENTS: ok = int_opt("clients", optarg, 1, 4096, &a.serve.clients); break;
        case O_REQUESTS: ok = int_opt("requests", optarg, 1, 100000, &a.serve.requests); break;
        case O_SESSIONS:
            if (strcmp(optarg, "fit") == 0)
                a.serve.sessions_fit = true;
            else
                ok = int_opt("sessions", optarg, 1, 1000000, &a.serve.sessions);
            break;
        case O_POOL_GIB: ok = real_opt("pool-gib", optarg, 0, 1 << 20, &a.serve.pool_gib); break;
        case O_PARTS: a.serve.parts = optarg; break;
        case O_STORE_SIGNED: a.serve.store_signed = true; break;
        case O_CONTEXT: ok = int_opt("context", optarg, 1, 1 << 24, &a.serve.context); break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (!ok)
        return 2;
    if (optind >= argc || !a.model) {
        usage(stderr);
        return 2;
    }
    a.cmd = argv[optind];
    for (int i = 0; i < n_given; i++)
        if (check_option(a.cmd, given[i]))
            return 2;
    struct skv_backend *be = NULL;
    struct skv_model *m = NULL;
    struct skv_engine *e = NULL;
    int rc = skv_backend_open(a.backend, a.threads, &be); /* auto: CUDA when a device passes its self-test */
    if (rc)
        return fail("backend", rc);
    struct skv_model_opts mo = {.reference = a.reference};
    rc = skv_model_load(a.model, be, &mo, &m);
    if (!rc && skv_kv_type_parse(a.kv_type) != SKV_DTYPE_F32)
        rc = skv_model_set_kv_pool(m, SKV_KV_BLOCK_ROWS, skv_kv_type_parse(a.kv_type));
    if (rc) {
        skv_model_free(&m);
        skv_backend_destroy(&be);
        return fail(a.model, rc);
    }
    rc = skv_engine_new(m, &e);
    int exit_code = 2;
    if (rc)
        exit_code = fail("engine", rc);
    else if (strcmp(a.cmd, "tokenize") == 0)
        exit_code = m->tok ? cmd_tokenize(&a, m) : fail("tokenize", SKV_E_UNSUPPORTED);
    else if (strcmp(a.cmd, "logits") == 0)
        exit_code = cmd_logits(&a, e, m);
    else if (strcmp(a.cmd, "generate") == 0)
        exit_code = cmd_generate(&a, e, m);
    else if (strcmp(a.cmd, "select") == 0)
        exit_code = cmd_select(&a, e, m);
    else if (strcmp(a.cmd, "speed") == 0)
        exit_code = cmd_speed(&a, e, m);
    else if (strcmp(a.cmd, "gemv") == 0)
        exit_code = cmd_gemv(&a, m);
    else if (strcmp(a.cmd, "quality") == 0)
        exit_code = cmd_quality(&a, e, m, argc, argv);
    else if (strcmp(a.cmd, "serve") == 0)
        exit_code = cmd_serve(&a, e, m, argc, argv);
    else
        usage(stderr);
    skv_engine_free(&e);
    skv_model_free(&m);
    skv_backend_destroy(&be);
    return exit_code;
}
