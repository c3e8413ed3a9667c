/* The command handlers, run on the engine worker thread: PREFILL, APPEND, DECODE (streamed,
 * one token per scheduling round), COMPRESS, FORK, RELEASE, EXPORT_KV / IMPORT_KV through
 * POSIX shared memory, and the admin commands LIST, INSPECT, EVICT, PIN, SAVE, LOAD, STATS.
 * Every request ends in exactly one final reply with a status and a message. */
#include "daemon/worker_impl.h"
#include "build-config.h"
#include "common/log.h"
#include "common/status.h"
#include "common/utf8.h"
#include "daemon/compress/spec.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/kv_pool.h"
#include "daemon/engine/kv_store.h"
#include "daemon/engine/model.h"
#include "daemon/engine/tokenizer.h"
#include "daemon/store.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <link.h> /* dl_iterate_phdr */
#include <math.h>
#include <sodium.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h> /* shm_open */
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_TENANT SKV_TENANT_DEFAULT
#define DEFAULT_MAX_TOKENS 64
/* what every shared-memory buffer a client names starts with (libsnapkv names them so) */
#define SKV_SHM_PREFIX "/snapkv-"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void reply_init(Snapkv__Reply *rep, const struct skv_job *job)
{
    snapkv__reply__init(rep);
    rep->version = 1;
    rep->request_id = job->req->request_id;
    rep->final = true;
}

/* A request that failed (or a decode a failure ended), in the daemon's and its tenant's counts. */
static void count_error(struct skv_worker *w, const struct skv_job *job)
{
    w->metrics.errors++;
    skv_worker_tenant(w, job->tenant)->errors++;
}

void skv_requests_fail(struct skv_worker *w, const struct skv_job *job, int status, const char *msg)
{
    Snapkv__Reply rep;
    reply_init(&rep, job);
    rep.status = status;
    rep.message = (char *)(msg && *msg ? msg : skv_status_str(status));
    count_error(w, job);
    skv_log(SKV_LOG_DEBUG, "request %llu: %s: %s", (unsigned long long)rep.request_id, skv_status_name(status),
            rep.message);
    skv_worker_note_failure(w, status); /* before the reply: the stop is decided when the client learns */
    skv_worker_reply(w, job, &rep);
}

static void fail_rc(struct skv_worker *w, const struct skv_job *job, int rc)
{
    skv_requests_fail(w, job, rc, skv_error_msg());
}

static const char *tenant_of(const struct skv_job *job)
{
    const char *t = job->req->tenant;
    return t && *t ? t : DEFAULT_TENANT;
}

static int store_load(struct skv_worker *w, const char *tenant, const uint8_t *id, struct skv_session **out);

/* The session named by `id` for this tenant (admins: any tenant). One this daemon does not
 * hold comes from the store (store = ...) when it is there, unless `here_only` (admins, CANCEL:
 * the store holds sessions of a tenant, and nothing runs on them). */
static int find_session_in(struct skv_worker *w, const struct skv_job *job, ProtobufCBinaryData id, bool admin,
                           bool here_only, struct skv_session **out)
{
    if (id.len != SKV_SESSION_ID_BYTES)
        return skv_errorf(SKV_E_INVAL, "a session id is %d bytes, got %zu", SKV_SESSION_ID_BYTES, id.len);
    struct skv_session *s = skv_session_find(w->sessions, id.data, admin ? NULL : tenant_of(job));
    if (!s) {
        char hex[2 * SKV_SESSION_ID_BYTES + 1];
        skv_session_id_hex(id.data, hex);
        int rc = admin || here_only || !w->store ? SKV_E_NOT_FOUND : store_load(w, tenant_of(job), id.data, &s);
        if (rc == SKV_E_NOT_FOUND)
            return skv_errorf(SKV_E_NOT_FOUND, "no session %s%s", hex, admin ? "" : " for this tenant");
        if (rc) {
            char why[256]; /* skv_errorf() rewrites the buffer skv_error_msg() returns */
            snprintf(why, sizeof why, "%s", skv_error_msg());
            return skv_errorf(rc, "session %s is not here, and taking it from the store failed: %s", hex, why);
        }
    }
    *out = s;
    return SKV_OK;
}

static int find_session(struct skv_worker *w, const struct skv_job *job, ProtobufCBinaryData id, bool admin,
                        struct skv_session **out)
{
    return find_session_in(w, job, id, admin, false, out); /* (admins never load) */
}

/* The most bytes of one token's text a decode emits (a longer one is cut there). */
#define TOKEN_TEXT_MAX 1024

/* One encoding of a request's text (ids NULL and max 0: a count), stopped once it passes cap
 * tokens (SKV_E_LIMIT, *n = cap + 1). chat: one user turn of the chat template, which owns BOS
 * and is the only source of control tokens, never the client's text. special: the text carries
 * its own markup (and its own BOS). Otherwise plain text, with BOS as the model asks when it
 * is the first text of a session (first: a PREFILL's, not an APPEND's). */
static int encode_request_text(const struct skv_tokenizer *tok, const char *text, bool chat, bool special, bool first,
                               int cap, int32_t *ids, int max, int *n)
{
    if (chat) {
        struct skv_chat_msg msg = {"user", text};
        return skv_tokenizer_chat_encode_capped(tok, &msg, 1, true, cap, ids, max, n);
    }
    /* BOS starts a session's text only (an APPEND's plain text is tokenized as is, as HF's
     * add_special_tokens=False: a BOS mid-sequence changes what the model makes) */
    bool bos = first && skv_tokenizer_add_bos(tok) && !special;
    return skv_tokenizer_encode_capped(tok, text, strlen(text), bos, special, cap, ids, max, n);
}

/* Token ids from a request: explicit ids, or text (rendered as one chat turn when chat;
 * markup parsed as control tokens when special; first as above). malloc'd. Text is tokenized only up to
 * limit + 1 tokens: a text over the limit costs the engine thread no more than one that fits. */
static int request_tokens(struct skv_worker *w, const uint32_t *ids, size_t n_ids, const char *text, bool chat,
                          bool special, bool first, int limit, int32_t **out, int *n_out)
{
    const struct skv_model *m = w->m;
    if (n_ids && text && *text)
        return skv_errorf(SKV_E_INVAL, "give tokens or text, not both");
    if (n_ids) {
        if (n_ids > (size_t)limit)
            return skv_errorf(SKV_E_LIMIT, "%zu tokens: more than the limit of %d", n_ids, limit);
        int32_t *v = malloc(n_ids * sizeof *v);
        if (!v)
            return SKV_E_NOMEM;
        for (size_t i = 0; i < n_ids; i++) {
            if (ids[i] >= (uint32_t)m->cfg.n_vocab) {
                free(v);
                return skv_errorf(SKV_E_INVAL, "token %u at index %zu is outside the vocabulary [0, %d)", ids[i], i,
                                  m->cfg.n_vocab);
            }
            v[i] = (int32_t)ids[i];
        }
        *out = v;
        *n_out = (int)n_ids;
        return SKV_OK;
    }
    if (!text || !*text)
        return skv_errorf(SKV_E_INVAL, "no tokens and no text");
    if (!m->tok)
        return skv_errorf(SKV_E_UNSUPPORTED, "the model has no tokenizer: send token ids");
    if (limit < 0)
        limit = 0;
    int n = 0;
    int rc = encode_request_text(m->tok, text, chat, special, first, limit, NULL, 0, &n);
    if (rc && rc != SKV_E_LIMIT)
        return rc;
    if (n > limit)
        return skv_errorf(SKV_E_LIMIT, "the text is more than %d tokens, the limit (tokenizing stopped there)", limit);
    int32_t *v = malloc((size_t)(n > 0 ? n : 1) * sizeof *v);
    rc = v ? encode_request_text(m->tok, text, chat, special, first, limit, v, n, &n) : SKV_E_NOMEM;
    if (rc || n == 0) {
        free(v);
        return rc ? rc : skv_errorf(SKV_E_INVAL, "the text encodes to no tokens");
    }
    *out = v;
    *n_out = n;
    return SKV_OK;
}

static int import_check(const struct skv_config *cfg, const struct skv_model *m, const Snapkv__ImportKvRequest *im,
                        uint64_t *need_out);

/* The longest text a request may carry when `limit` tokens are allowed: max-text-bytes, or (0)
 * limit times the model's longest token, the most bytes `limit` tokens can span. */
static uint64_t text_bytes_limit(const struct skv_config *cfg, const struct skv_model *m, int64_t limit)
{
    if (cfg->max_text_bytes > 0)
        return (uint64_t)cfg->max_text_bytes;
    return (uint64_t)limit * (uint64_t)skv_tokenizer_max_token_bytes(m->tok);
}

/* The counts of a PREFILL or APPEND: ids or text, not both; ids within limit; text within its
 * byte bound (which the tokenizer's cap would refuse anyway, but only after the queue held it). */
static int admit_tokens(const struct skv_config *cfg, const struct skv_model *m, size_t n_ids, const char *text,
                        int64_t limit)
{
    size_t len = text ? strlen(text) : 0;
    if (n_ids && len)
        return skv_errorf(SKV_E_INVAL, "give tokens or text, not both");
    if (n_ids > (uint64_t)limit)
        return skv_errorf(SKV_E_LIMIT, "%zu tokens: more than the limit of %d", n_ids, (int)limit);
    if (!len)
        return SKV_OK;
    if (!m->tok)
        return skv_errorf(SKV_E_UNSUPPORTED, "the model has no tokenizer: send token ids");
    uint64_t max = text_bytes_limit(cfg, m, limit);
    if (len > max)
        return cfg->max_text_bytes > 0
                   ? skv_errorf(SKV_E_LIMIT, "the text is %zu bytes: more than max-text-bytes (%llu)", len,
                                (unsigned long long)max)
                   : skv_errorf(SKV_E_LIMIT,
                                "the text is %zu bytes: more than the limit of %d tokens can span (%llu bytes at "
                                "%zu bytes for the model's longest token; max-text-bytes = 0)",
                                len, (int)limit, (unsigned long long)max, skv_tokenizer_max_token_bytes(m->tok));
    return SKV_OK;
}

static int admit_spec(const Snapkv__CompressSpec *cs)
{
    if (cs && cs->spec && strlen(cs->spec) > SKV_SPEC_MAX_CHARS)
        return skv_errorf(SKV_E_INVAL, "compression spec: longer than %d characters", SKV_SPEC_MAX_CHARS);
    return SKV_OK;
}

/* prompt_top_logprobs: as many as a DECODE's top_logprobs */
static int check_prompt_top(uint32_t top_n)
{
    return top_n > SKV_TOP_LOGPROBS_MAX ? skv_errorf(SKV_E_LIMIT, "prompt_top_logprobs %u is above the limit of %u",
                                                     top_n, SKV_TOP_LOGPROBS_MAX)
                                        : SKV_OK;
}

int skv_requests_admit(const struct skv_config *cfg, const struct skv_model *m, const Snapkv__Request *req)
{
    int64_t room = cfg->max_prompt_tokens + cfg->max_new_tokens;
    int rc = SKV_OK;
    switch (req->command_case) {
    case SNAPKV__REQUEST__COMMAND_PREFILL: {
        const Snapkv__PrefillRequest *p = req->prefill;
        if (!(rc = admit_tokens(cfg, m, p->n_tokens, p->text, cfg->max_prompt_tokens)) &&
            !(rc = admit_spec(p->compress)))
            rc = check_prompt_top(p->prompt_top_logprobs);
        break;
    }
    case SNAPKV__REQUEST__COMMAND_APPEND: /* the worker's limit is the session's room, at most this */
        if (!(rc = admit_tokens(cfg, m, req->append->n_tokens, req->append->text, room)))
            rc = check_prompt_top(req->append->prompt_top_logprobs);
        break;
    case SNAPKV__REQUEST__COMMAND_TOKENIZE:
        rc = admit_tokens(cfg, m, 0, req->tokenize->text, cfg->max_prompt_tokens);
        break;
    case SNAPKV__REQUEST__COMMAND_DETOKENIZE:
        if (req->detokenize->n_tokens > (uint64_t)room)
            rc = skv_errorf(SKV_E_LIMIT, "%zu tokens: more than the limit of %lld", req->detokenize->n_tokens,
                            (long long)room);
        break;
    case SNAPKV__REQUEST__COMMAND_DECODE: {
        const Snapkv__Sampling *sp = req->decode->sampling;
        if (sp && sp->max_tokens > (uint64_t)cfg->max_new_tokens)
            rc = skv_errorf(SKV_E_LIMIT, "max_tokens %u is above the limit of %lld", sp->max_tokens,
                            (long long)cfg->max_new_tokens);
        else if (sp && sp->n_stop_tokens > SKV_STOP_TOKENS_MAX)
            rc = skv_errorf(SKV_E_LIMIT, "at most %d stop tokens", SKV_STOP_TOKENS_MAX);
        else if (sp && sp->top_logprobs > SKV_TOP_LOGPROBS_MAX)
            rc = skv_errorf(SKV_E_LIMIT, "top_logprobs %u is above the limit of %u", sp->top_logprobs,
                            SKV_TOP_LOGPROBS_MAX);
        else if (sp && sp->n_logit_bias > SKV_LOGIT_BIAS_MAX)
            rc = skv_errorf(SKV_E_LIMIT, "at most %u logit_bias entries, not %zu", SKV_LOGIT_BIAS_MAX,
                            sp->n_logit_bias);
        else if (sp)
            rc = skv_stop_text_check((const char *const *)sp->stop, sp->n_stop);
        break;
    }
    case SNAPKV__REQUEST__COMMAND_COMPRESS: {
        const Snapkv__CompressSpec *cs = req->compress->compress;
        /* no spec would read as policy=full: the session silently stops evicting */
        if (!cs || !cs->spec || !*cs->spec)
            rc = skv_errorf(SKV_E_INVAL, "COMPRESS needs a spec (policy=full keeps every row from now on)");
        else
            rc = admit_spec(cs);
        break;
    }
    case SNAPKV__REQUEST__COMMAND_IMPORT_KV: {
        uint64_t need;
        rc = import_check(cfg, m, req->import_kv, &need);
        break;
    }
    default:
        break;
    }
    return rc;
}

/* Per-layer kept counts for a reply: arrays malloc'd into *arena (free with free_kept). */
struct kept_arena {
    Snapkv__LayerKept *layers;
    Snapkv__LayerKept **ptrs;
    uint32_t *per_head;       /* [3][L * H]: kept rows, then (with blocks) blocks and shared blocks */
};

/* with_blocks (INSPECT): also each head's blocks and shared blocks. */
static int fill_kept(const struct skv_kv_cache *c, struct kept_arena *a, bool with_blocks, size_t *n_out,
                     Snapkv__LayerKept ***out)
{
    int L = c->n_layers, H = c->n_kv_heads;
    a->layers = calloc((size_t)L, sizeof *a->layers);
    a->ptrs = calloc((size_t)L, sizeof *a->ptrs);
    a->per_head = calloc((size_t)3 * L * H, sizeof *a->per_head);
    if (!a->layers || !a->ptrs || !a->per_head)
        return SKV_E_NOMEM;
    for (int l = 0; l < L; l++) {
        Snapkv__LayerKept *k = &a->layers[l];
        snapkv__layer_kept__init(k);
        k->layer = (uint32_t)l;
        k->n_kept_per_head = (size_t)H;
        k->kept_per_head = a->per_head + (size_t)l * H;
        for (int h = 0; h < H; h++) {
            int len = c->heads[l * H + h].len;
            k->kept_per_head[h] = (uint32_t)len;
            k->kept = (uint32_t)len > k->kept ? (uint32_t)len : k->kept;
            k->bytes += (uint64_t)len * 2 * c->row_bytes;
        }
        if (with_blocks) {
            k->n_blocks_per_head = k->n_shared_blocks_per_head = (size_t)H;
            k->blocks_per_head = a->per_head + (size_t)(L + l) * H;
            k->shared_blocks_per_head = a->per_head + (size_t)(2 * L + l) * H;
            for (int h = 0; h < H; h++) {
                struct skv_kv_blocks b;
                skv_kv_head_blocks(c, &c->heads[l * H + h], &b);
                k->blocks_per_head[h] = (uint32_t)b.held;
                k->shared_blocks_per_head[h] = (uint32_t)b.shared;
            }
        }
        a->ptrs[l] = k;
    }
    *n_out = (size_t)L;
    *out = a->ptrs;
    return SKV_OK;
}

static void free_kept(struct kept_arena *a)
{
    free(a->layers);
    free(a->ptrs);
    free(a->per_head);
}

/* What a full cache of n_tokens holds in the pool: each layer's KV heads in whole blocks, as a
 * session's bytes are counted (a 1-token prompt's full cache is its blocks, not 1/16 of them:
 * its ratio 100%, not 1600%). */
static uint64_t full_bytes(const struct skv_model *m, int n_tokens)
{
    uint64_t rows = (uint64_t)skv_kv_pool_block_rows(m->kv_pool), blocks = ((uint64_t)n_tokens + rows - 1) / rows;
    return blocks * m->cfg.n_layers * m->cfg.n_kv_heads * skv_kv_pool_block_bytes(m->kv_pool);
}

/* Progress of a long prefill: one non-final PREFILL reply per layer done. */
struct progress {
    struct skv_worker *w;
    const struct skv_job *job;   /* NULL: no progress replies */
    struct skv_compressor *comp;
    int base, n, n_layers;      /* the forward runs tokens base .. base + n - 1 */
};

static int progress_hook(void *user, const struct skv_layer_view *v)
{
    struct progress *p = user;
    skv_worker_beat(p->w); /* a long forward is alive: the watchdog goes on being fed */
    int rc = p->comp ? skv_compressor_hook(p->comp, v) : SKV_OK;
    if (!rc && p->job) {
        Snapkv__Reply rep;
        Snapkv__PrefillReply pr = SNAPKV__PREFILL_REPLY__INIT;
        reply_init(&rep, p->job);
        rep.final = false;
        pr.n_tokens = (uint32_t)(p->base + p->n); /* a reused prefix counts as done */
        pr.tokens_done = (uint32_t)(p->base + (int64_t)p->n * (v->layer + 1) / p->n_layers);
        rep.result_case = SNAPKV__REPLY__RESULT_PREFILL;
        rep.prefill = &pr;
        skv_worker_reply(p->w, p->job, &rep);
    }
    if (!rc) /* this layer is done (and compressed): running decodes may take a token */
        skv_worker_yield(p->w);
    if (!rc && skv_worker_running_stoppable(p->w)) {
        /* a PREFILL whose client is gone (nobody takes its session), or one (when it gets no
         * progress replies, which would keep it waiting), an APPEND or a COMPRESS past the time
         * it waits: an APPEND's session is left as it was (the engine undoes the forward), and a
         * COMPRESS ran on a copy of the cache, so the rest of the work goes. A gone client's
         * APPEND and COMPRESS run on, as its queued ones do: another client may count on the
         * session they change (before, one of 64 tokens or more stopped at its first layer,
         * since the notice is queued behind it, and a shorter one went in) */
        int cmd = p->w->running->req->command_case;
        bool prefill = cmd == SNAPKV__REQUEST__COMMAND_PREFILL, append = cmd == SNAPKV__REQUEST__COMMAND_APPEND;
        if (prefill && skv_worker_running_gone(p->w)) {
            atomic_fetch_add(&p->w->dropped_gone, 1);
            rc = skv_errorf(SKV_E_CANCELLED, "the client's connection closed");
        } else if (atomic_load(&p->w->stop_asked) && v->layer + 1 < p->n_layers) { /* (the last: it is done) */
            /* a stop does not wait for the rest of a long forward: the save after it must fit
             * the service manager's stop timeout */
            rc = skv_errorf(SKV_E_CANCELLED, "snapkvd is shutting down: the %s stopped at layer %d of %d%s",
                            prefill ? "PREFILL" : append ? "APPEND" : "COMPRESS", v->layer + 1, p->n_layers,
                            append ? ", the session as it was before it" : "");
        } else if (!p->job && skv_worker_running_late(p->w)) {
            p->w->metrics.requests_past_deadline++;
            rc = skv_errorf(SKV_E_TIMEOUT, "the %s passed its deadline of %u ms (the client's timeout) at layer "
                            "%d of %d: stopped%s",
                            prefill ? "PREFILL" : append ? "APPEND" : "COMPRESS", p->w->running->req->deadline_ms,
                            v->layer + 1, p->n_layers, append ? ", the session as it was before it" : "");
        }
    }
    return rc;
}

static void forward_tick(void *user)
{
    skv_worker_yield(user);
}

#define APPEND_COPY_MIN 64 /* an APPEND of this many tokens or more on an evicting policy runs on a copy */

/* Readies s's compressor for a forward of n tokens (compress: a compressing one; else decode
 * upkeep) and points fo at its hook; nothing to do without a compressor. Decode upkeep takes its
 * memory now (in the forward, a failure would fail a whole decode group) and cuts the layers
 * (H2O, StreamingLLM, window; SnapKV's re-scoring) at the forward's end (fo's done), so that a
 * forward failing part way (a device error, no memory) leaves every layer as it was. */
static int session_hook(struct skv_session *s, int n, bool compress, struct skv_forward_opts *fo)
{
    if (!s->comp)
        return SKV_OK;
    fo->hook = skv_compressor_hook;
    fo->hook_user = s->comp;
    fo->attention_probs = skv_compressor_wants_probs(s->comp);
    if (compress)
        return skv_compressor_begin(s->comp, s->cache, n);
    int rc = skv_compressor_begin_decode(s->comp, s->cache);
    /* (deferred for forwards that do not run on an undo copy: a long APPEND's copy puts the
     * session back whole, and its cut keeps its per-layer yields, and scores of a layer's
     * rows for one layer at a time) */
    if (!rc)
        rc = skv_compressor_decode_reserve(s->comp, s->cache, n, n < APPEND_COPY_MIN);
    fo->done = skv_compressor_hook_done;
    fo->done_user = s->comp;
    return rc;
}

/* The cuts s's last forward's upkeep could not make (skv_compressor_take_cut_failures): counted,
 * and logged at most once a window. */
static void note_cut_failures(struct skv_worker *w, struct skv_session *s)
{
    int n = s->comp ? skv_compressor_take_cut_failures(s->comp) : 0;
    if (!n)
        return;
    w->metrics.upkeep_cuts_failed += (uint64_t)n;
    unsigned long long more = 0;
    if (skv_log_allow(&w->log_cut, skv_now_ms(), &more))
        skv_log(SKV_LOG_WARN, "decode upkeep: %d layer(s) of a session stay over their budget until a later step "
                "cuts them (no memory or a device error; %llu more since the last such line)", n, more);
}

/* A compressing PREFILL's hook when it also keeps its prompt's rows (prefix-retain-bytes): each
 * layer's rows, whole, go into `keep` (shared blocks) before the layer's own hook cuts them. */
struct keep_rows {
    struct skv_kv_cache *keep;
    skv_layer_hook_fn inner;
    void *inner_user;
};

static int keep_rows_hook(void *user, const struct skv_layer_view *v)
{
    struct keep_rows *k = user;
    int rc = skv_kv_cache_copy_layer(k->keep, v->cache, v->layer);
    return rc ? rc : k->inner ? k->inner(k->inner_user, v) : SKV_OK;
}

/* Runs tokens through the session's model and cache. compress: a compressing forward with
 * comp (prefill / compress); else decode-time upkeep when the session has a compressor. A long
 * one of the running request may stop part way (a deadline, a client gone): what it leaves is
 * nobody's (a PREFILL's session), the engine's undo restores it, or it runs on a copy
 * (session_undo). progress_job: send per-layer progress replies for it (may be NULL). keep
 * (NULL: none): a copy of s's cache that takes each layer's rows before the compressor cuts
 * them. sc (NULL: none): the log-probabilities of ids[1..n), each at the position before it,
 * and the most likely tokens there (with top_n, the top_n most likely and theirs), into sc's
 * arrays from their start. */
struct prompt_scores {
    float *logprobs;
    int32_t *top;
    int top_n;        /* prompt_top_logprobs (at most the vocabulary), 0: none */
    int32_t *top_ids; /* [][top_n] */
    float *top_lps;   /* [][top_n] */
};

/* Room for n positions' scores in one block (free(sc->logprobs)), with the `asked` most likely
 * tokens of each (fewer only with a smaller vocabulary, n_vocab). */
static int prompt_scores_alloc(struct prompt_scores *sc, int n, uint32_t asked, int n_vocab)
{
    int top_n = asked < (uint32_t)n_vocab ? (int)asked : n_vocab;
    size_t k = (size_t)top_n;
    float *mem = malloc((size_t)n * (sizeof(float) + sizeof(int32_t)) * (1 + k));
    if (!mem)
        return skv_errorf(SKV_E_NOMEM, "no memory to score %d tokens", n);
    int32_t *ids = (int32_t *)(mem + (size_t)n * (1 + k));
    *sc = (struct prompt_scores){mem, ids, top_n, top_n ? ids + n : NULL, top_n ? mem + n : NULL};
    return SKV_OK;
}

/* sc's scores from position i on */
static struct prompt_scores prompt_scores_from(const struct prompt_scores *sc, int i)
{
    size_t at = (size_t)i * (size_t)sc->top_n;
    return (struct prompt_scores){sc->logprobs + i, sc->top + i, sc->top_n, sc->top_n ? sc->top_ids + at : NULL,
                                  sc->top_n ? sc->top_lps + at : NULL};
}

/* A reply's prompt_top_logprobs: n messages over sc's arrays, in *tops (free it and *ptrs). */
static int prompt_top_reply(const struct prompt_scores *sc, size_t n, Snapkv__TopLogprobs **tops,
                            Snapkv__TopLogprobs ***ptrs)
{
    *tops = NULL;
    *ptrs = NULL;
    if (!sc->top_n || !n)
        return SKV_OK;
    if (!(*tops = malloc(n * sizeof **tops)) || !(*ptrs = malloc(n * sizeof **ptrs))) {
        free(*tops);
        *tops = NULL;
        return skv_errorf(SKV_E_NOMEM, "no memory for the reply's prompt_top_logprobs");
    }
    for (size_t i = 0; i < n; i++) {
        Snapkv__TopLogprobs *t = &(*tops)[i];
        snapkv__top_logprobs__init(t);
        t->n_tokens = t->n_logprobs = (size_t)sc->top_n;
        t->tokens = (uint32_t *)sc->top_ids + i * (size_t)sc->top_n; /* ids of the vocabulary */
        t->logprobs = sc->top_lps + i * (size_t)sc->top_n;
        (*ptrs)[i] = t;
    }
    return SKV_OK;
}
static int session_forward_progress(struct skv_worker *w, struct skv_session *s, const int32_t *ids, int n,
                                    bool compress, const struct skv_job *progress_job, struct skv_kv_cache *keep,
                                    const struct prompt_scores *sc)
{
    bool had_logits = s->logits != NULL;
    if (!s->logits && !(s->logits = malloc((size_t)w->m->cfg.n_vocab * sizeof *s->logits)))
        return SKV_E_NOMEM;
    struct skv_forward_opts fo = {0};
    struct progress prog = {w, progress_job, s->comp, s->cache->n_past, n, w->m->cfg.n_layers};
    int rc = session_hook(s, n, compress, &fo);
    /* progress replies, and per layer of a long forward a heartbeat and a turn for the running
     * decodes (a short one beats when done, and they wait for it) */
    if (progress_job || n >= 64) {
        fo.hook = progress_hook;
        fo.hook_user = &prog;
        fo.tick = forward_tick; /* and between the chunks of a layer's projections and MLP */
        fo.tick_user = w;
    }
    if (sc && n > 1) {
        fo.targets = ids + 1;
        fo.n_targets = n - 1;
        fo.target_logprobs = sc->logprobs;
        fo.target_top = sc->top;
        fo.target_top_n = sc->top_n;
        fo.target_top_ids = sc->top_ids;
        fo.target_top_logprobs = sc->top_lps;
    }
    struct keep_rows kr = {keep, fo.hook, fo.hook_user};
    if (keep) {
        fo.hook = keep_rows_hook;
        fo.hook_user = &kr;
    }
    int was_busy = s->busy;
    s->busy = 1; /* decode rounds may run inside the forward: they must not evict s */
    const struct skv_session *outer = w->forward_session;
    if (!w->yielding)
        w->forward_session = s; /* and the short requests run there must not touch it */
    /* inside another forward's yield the main engine is that forward's: a short request runs on
     * the decode engine, a request run nested (fair-slice-ms) on its own */
    struct skv_engine *e = w->yielding ? w->decode_engine : w->nesting ? w->nested_engine : w->engine;
    int from = s->cache->n_past;
    if (s->computed_rows > from) /* rows from `from` on are written again */
        s->computed_rows = from;
    if (!rc)
        rc = skv_session_reserve_tokens(s, n); /* the push after the forward cannot fail */
    if (!rc)
        rc = skv_engine_forward(e, s->cache, ids, n, &fo, s->logits);
    note_cut_failures(w, s);
    s->busy = was_busy;
    w->forward_session = outer;
    if (!rc && s->comp && compress)
        rc = skv_compressor_finish(s->comp, s->cache);
    if (!rc)
        rc = skv_session_push_tokens(s, ids, n);
    if (!rc && s->computed_rows == from && n > skv_engine_small_forward(e))
        s->computed_rows = from + n;
    if (rc && !had_logits) { /* a failed first forward (of a loaded or imported session) wrote none */
        free(s->logits);
        s->logits = NULL;
    }
    s->last_used_ms = skv_now_ms();
    return rc;
}

static int session_forward(struct skv_worker *w, struct skv_session *s, const int32_t *ids, int n, bool compress)
{
    return session_forward_progress(w, s, ids, n, compress, NULL, NULL, NULL);
}

/* What a request that runs on a copy of a session's cache (sharing every block) keeps to put
 * the session back as it was when it fails part way: its own cache, and a copy of its
 * compressor as it was (the session's own runs on: its buffers are warm). */
struct session_undo {
    struct skv_kv_cache *cache;
    struct skv_compressor *comp;
    char spec[sizeof ((struct skv_session *)0)->spec];
    int32_t n_tokens, computed_rows;
    uint64_t bytes, compressor_bytes; /* the session's counts (a reserve on the copy sets them) */
    float *logits; /* a copy of the next-token logits (NULL: it had none) */
};

/* Puts s on a copy of its cache, keeping its own and a copy of its compressor in u. */
static int undo_begin(struct skv_worker *w, struct skv_session *s, struct session_undo *u)
{
    size_t nl = (size_t)w->m->cfg.n_vocab * sizeof *u->logits;
    struct skv_kv_cache *cache = NULL;
    struct skv_compressor *comp = NULL;
    *u = (struct session_undo){0};
    int rc = s->logits && !(u->logits = malloc(nl)) ? SKV_E_NOMEM : skv_kv_cache_clone(s->cache, &cache);
    if (!rc && s->comp)
        rc = skv_compressor_clone(s->comp, &comp);
    if (rc) {
        skv_kv_cache_free(&cache);
        free(u->logits);
        return rc;
    }
    if (u->logits)
        memcpy(u->logits, s->logits, nl);
    u->cache = s->cache;
    s->side[0] = u->cache; /* what evicting others leaves */
    u->comp = comp;
    memcpy(u->spec, s->spec, sizeof u->spec);
    u->n_tokens = s->n_tokens;
    u->computed_rows = s->computed_rows;
    u->bytes = s->bytes;
    u->compressor_bytes = s->compressor_bytes;
    s->cache = cache;
    return SKV_OK;
}

/* failed: s exactly as at undo_begin (the copy of its cache, and its compressor as the request
 * left it, go); else s keeps what it has now, and its old cache and compressor go. */
static void undo_end(struct skv_worker *w, struct skv_session *s, struct session_undo *u, bool failed)
{
    s->side[0] = NULL;
    if (failed) {
        skv_kv_cache_free(&s->cache);
        skv_compressor_free(&s->comp);
        s->cache = u->cache;
        s->comp = u->comp;
        memcpy(s->spec, u->spec, sizeof s->spec);
        s->n_tokens = u->n_tokens; /* the tokens up to it are as they were */
        s->computed_rows = u->computed_rows;
        s->bytes = u->bytes;
        s->compressor_bytes = u->compressor_bytes;
        if (u->logits && s->logits)
            memcpy(s->logits, u->logits, (size_t)w->m->cfg.n_vocab * sizeof *s->logits);
    } else {
        skv_kv_cache_free(&u->cache);
        skv_compressor_free(&u->comp);
    }
    free(u->logits);
    u->logits = NULL;
}

/* A compressor for spec text (NULL for policy=full), and the spec's canonical form; saved: the
 * text of a SAVE file, parsed as skv_compress_spec_parse_saved does. */
static int parse_spec(struct skv_worker *w, const char *text, bool saved, struct skv_compressor **comp, char *canon,
                      size_t cap)
{
    struct skv_compress_spec spec;
    int rc = saved ? skv_compress_spec_parse_saved(text, &spec) : skv_compress_spec_parse(text, &spec);
    if (rc)
        return rc;
    *comp = NULL;
    if (spec.policy != SKV_POLICY_FULL && (rc = skv_compressor_new(&spec, w->m, comp)))
        return rc;
    skv_compress_spec_format(&spec, canon, cap);
    return SKV_OK;
}

static int set_spec(struct skv_worker *w, struct skv_session *s, const char *text, bool saved)
{
    struct skv_compressor *comp = NULL;
    char canon[sizeof s->spec] = {0}; /* all of it goes into the session, and into SAVE files */
    int rc = parse_spec(w, text, saved, &comp, canon, sizeof canon);
    if (rc)
        return rc;
    skv_compressor_free(&s->comp);
    s->comp = comp;
    memcpy(s->spec, canon, sizeof s->spec);
    return SKV_OK;
}

/* Whether a forward without compression (APPEND, a decode step) may compact s's cache: its
 * policy evicts while decoding (h2o, streaming, window) or SnapKV re-scores (decode_budget). */
static bool forward_compacts(const struct skv_session *s)
{
    const struct skv_compress_spec *sp = s->comp ? skv_compressor_spec(s->comp) : NULL;
    return sp && (sp->policy != SKV_POLICY_SNAPKV || sp->decode_budget > 0);
}

/* Gives back the blocks a skv_kv_cache_prepare took past each head's rows, for a token that
 * will not come. */
static void release_prepared(struct skv_kv_cache *c)
{
    for (int k = 0; k < c->n_layers * c->n_kv_heads; k++)
        skv_kv_cache_truncate(c, k / c->n_kv_heads, k % c->n_kv_heads, c->heads[k].len);
}

/* Bytes of the pool's blocks in use now (every session's, a shared block once). */
static uint64_t pool_in_use_bytes(const struct skv_worker *w)
{
    struct skv_kv_pool_stats ps;
    skv_kv_pool_stats(w->m->kv_pool, &ps);
    return ps.blocks_in_use * ps.block_bytes;
}

/* Room for a forward of n more tokens on s (skv_kv_cache_growth's bound, plus what earlier
 * sessions of the same decode round took: *round_held for s's tenant, *round_unique for the
 * pool), made before the forward so that a request that cannot fit changes nothing. */
static int reserve_rows(struct skv_worker *w, struct skv_session *s, int n, bool compacts, uint64_t round_held,
                        uint64_t round_unique, uint64_t *held_out, uint64_t *unique_out)
{
    uint64_t held, unique;
    skv_kv_cache_growth(s->cache, n, compacts, &held, &unique);
    if (held_out)
        *held_out = held;
    if (unique_out)
        *unique_out = unique;
    return skv_session_reserve(w->sessions, s, held + round_held, unique + round_unique, NULL);
}

/* The same for the forward of a request that may run others inside it (PREFILL, APPEND,
 * COMPRESS: short requests and decode rounds, and when not nested itself a nested request): the
 * room stays the forward's until the request ends (skv_session_hold_room, at level 1 for a
 * nested request; the dispatcher clears it). undo: the session's undo copy (NULL:
 * none), whose compressor's query ring, allocated beside the session's own until the request
 * ends, counts for the tenant too (outside the pool, as the session's own ring). */
static int reserve_forward(struct skv_worker *w, struct skv_session *s, int n, bool compacts,
                           const struct session_undo *undo)
{
    uint64_t held, unique, ring = undo ? skv_compressor_ring_bytes(undo->comp) : 0;
    int rc = reserve_rows(w, s, n, compacts, ring, 0, &held, &unique);
    held += ring;
    if (!rc && !w->yielding) /* a short request in a yield holds nothing; a nested one its own level */
        skv_session_hold_room(w->sessions, w->nesting, s, held, unique);
    return rc;
}

/* Room for a compressing PREFILL of n tokens into s's cache (empty, or a reused prefix): the
 * blocks its layers hold once each is cut (skv_compressor_prefill_blocks), held like
 * reserve_forward's. The tenant holds the prefix's blocks already (s's bytes), which the cut
 * layers give back: what they keep past those is new to it; to the pool all of it is. */
static int reserve_compressing(struct skv_worker *w, struct skv_session *s, int n, uint64_t *held_out,
                               uint64_t *bytes_out)
{
    uint64_t bytes =
        (uint64_t)skv_compressor_prefill_blocks(s->comp, s->cache, n) * skv_kv_pool_block_bytes(s->cache->pool);
    uint64_t prefix = skv_kv_cache_bytes(s->cache), held = bytes > prefix ? bytes - prefix : 0;
    int rc = skv_session_reserve(w->sessions, s, held, bytes, NULL);
    if (!rc && !w->yielding)
        skv_session_hold_room(w->sessions, w->nesting, s, held, bytes);
    *held_out = held;
    *bytes_out = bytes;
    return rc;
}

/* prefix-retain-bytes: a compressing PREFILL of ids[0..n) into s (its room reserved: held for the
 * tenant, room for the pool) also keeps its prompt's rows, whole, for the tenant's next
 * PREFILLs, when they are rows prefix reuse may take, fit the cap, and fit the pool's free room
 * besides (no session is evicted for a cache). *keep: the copy of s's cache that will take them
 * (NULL: not kept); the room they take is held for the forward too. */
static void keep_prompt_rows(struct skv_worker *w, struct skv_session *s, int n, uint64_t held, uint64_t room,
                             struct skv_kv_cache **keep)
{
    const struct skv_kv_cache *c = s->cache;
    uint64_t bytes = skv_prefix_cache_rows_bytes(c, n);
    *keep = NULL;
    if (!w->prefix.cap || n - c->n_past <= skv_engine_small_forward(w->engine) || n < c->block_rows ||
        bytes > w->prefix.cap ||
        pool_in_use_bytes(w) + skv_session_room_held(w->sessions, s) + room + bytes > (uint64_t)w->cfg->pool_size ||
        skv_kv_cache_clone(c, keep))
        return; /* (a copy without memory: not kept) */
    s->side[1] = *keep; /* until the PREFILL is done with it */
    if (!w->yielding)
        skv_session_hold_room(w->sessions, w->nesting, s, held, room + bytes);
}

/* What s's tenant's kept prefixes may hold together: its max-bytes-per-tenant less what its
 * sessions hold, s at its bytes now, or none of them when s is going (RELEASE). */
static uint64_t kept_room(struct skv_worker *w, const struct skv_session *s, bool going)
{
    uint64_t quota = (uint64_t)w->cfg->max_bytes_per_tenant,
             held = skv_session_tenant_bytes(w->sessions, s->tenant, s) +
                    (going ? 0 : skv_session_block_bytes(s) + s->compressor_bytes);
    return held < quota ? quota - held : 0;
}

/* ---- PREFILL / APPEND / COMPRESS / FORK / RELEASE ---------------------------------------------- */

/* Prefix reuse: the session of the tenant, or the prefix it RELEASEd and the daemon kept
 * (prefix-retain-bytes), whose token history begins with the longest run of whole blocks of the
 * prompt, among those whose KV is every row the daemon computed for that history (policy full,
 * no row evicted) and that no forward is half way through. */
struct prefix_find {
    const struct skv_session *self, *in_forward;
    const char *tenant;
    const int32_t *ids;
    int limit;                  /* reuse at most this many tokens */
    int best;
    const struct skv_kv_cache *cache; /* best's */
    struct skv_session *src;          /* a session's, or ... */
    struct skv_prefix_entry *entry;   /* ... a kept prefix's */
};

/* How many tokens of f's prompt a history serves whose first `exact` rows may be reused (its
 * computed_rows): their common start, in whole blocks of block_rows, when that beats f's best so
 * far (else 0). */
static int prefix_match(const struct prefix_find *f, const int32_t *tokens, int exact, int block_rows)
{
    int cap = exact < f->limit ? exact : f->limit, k = 0;
    while (k < cap && tokens[k] == f->ids[k])
        k++;
    k -= k % block_rows;
    return k > f->best ? k : 0;
}

static bool prefix_visit(void *user, struct skv_session *s)
{
    struct prefix_find *f = user;
    if (s == f->self || s == f->in_forward || s->comp || !s->cache || strcmp(s->tenant, f->tenant) != 0)
        return false;
    int exact = s->computed_rows < s->n_tokens ? s->computed_rows : s->n_tokens;
    int k = prefix_match(f, s->tokens, exact, s->cache->block_rows);
    if (k && skv_prefix_cache_whole(s->cache, s->n_tokens)) {
        f->best = k;
        f->cache = s->cache;
        f->src = s;
    }
    return false;
}

/* The tokens a PREFILL of ids[0..n) into s (its spec set, its cache empty) can take from
 * another session. It computes more than `small` tokens (the engine's small-batch size), so its
 * rows come from the batched kernels a prefill of the whole prompt takes (the same bits where
 * the kernels do not depend on where the call starts: ARCHITECTURE.md "Prefix reuse"); a
 * compressing one also its whole observation window (the rows it scores are then what a
 * prefill of the whole prompt scores). H2O's scores and SqueezeAttention's similarities need
 * every query: they take none. */
static int prefix_limit(const struct skv_session *s, int n, int small)
{
    const struct skv_compress_spec *sp = s->comp ? skv_compressor_spec(s->comp) : NULL;
    if (sp && (sp->policy == SKV_POLICY_H2O || sp->alloc == SKV_ALLOC_SQUEEZE))
        return 0;
    int run = sp && sp->window > small ? sp->window : small + 1;
    return n - run;
}

/* Puts into s (its cache empty) the longest whole-block prefix of ids another session of its
 * tenant, or a kept prefix, holds (copy-on-write: the blocks are shared), and those tokens into
 * its history. *reused: how many (0: none found, or no memory for the copy; s unchanged). */
static int reuse_prefix(struct skv_worker *w, struct skv_session *s, const int32_t *ids, int n, int *reused)
{
    int small = skv_engine_small_forward(w->engine);
    struct prefix_find f = {s, w->forward_session, s->tenant, ids, prefix_limit(s, n, small), 0, NULL, NULL, NULL};
    *reused = 0;
    if (f.limit < s->cache->block_rows)
        return SKV_OK;
    skv_session_foreach(w->sessions, prefix_visit, &f);
    for (struct skv_prefix_entry *e = w->prefix.head; e; e = e->next) {
        int k = strcmp(e->tenant, s->tenant) == 0 ? prefix_match(&f, e->tokens, e->n_rows, e->cache->block_rows) : 0;
        if (k) {
            f.best = k;
            f.cache = e->cache;
            f.entry = e;
            f.src = NULL;
        }
    }
    if (!f.cache)
        return SKV_OK;
    struct skv_kv_cache *c = NULL;
    int rc = skv_kv_cache_clone_rows(f.cache, f.best, &c);
    if (!rc && (rc = skv_session_push_tokens(s, ids, f.best))) {
        skv_kv_cache_free(&c);
        s->n_tokens = 0;
    }
    if (rc)
        return rc;
    skv_kv_cache_free(&s->cache);
    s->cache = c;
    s->computed_rows = f.best;
    /* a kept prefix in use stays longer in the LRU order (a session's lease and idle time are
     * its clients' to keep) */
    if (f.entry)
        skv_prefix_cache_touch(&w->prefix, f.entry, skv_now_ms());
    *reused = f.best;
    return SKV_OK;
}

static void handle_prefill(struct skv_worker *w, struct skv_job *job)
{
    const Snapkv__PrefillRequest *p = job->req->prefill;
    const struct skv_config *cfg = w->cfg;
    const char *tenant = tenant_of(job);
    int32_t *ids = NULL;
    struct prompt_scores sc = {0}; /* prompt_logprobs: sc.logprobs holds them all */
    float *scores = NULL;
    Snapkv__TopLogprobs *tops = NULL, **top_ptrs = NULL;
    int n = 0, rc;
    struct skv_session *s = NULL;
    struct skv_kv_cache *keep = NULL; /* the prompt's rows, whole, kept for reuse (prefix-retain-bytes) */
    /* a lease is how a session of a client that went away is given back: one longer than
     * max-lease-seconds would hold pool memory for as long as the client liked */
    if (p->lease_seconds > cfg->max_lease_seconds) {
        rc = skv_errorf(SKV_E_LIMIT, "a lease of %u seconds is longer than max-lease-seconds (%lld)",
                        p->lease_seconds, (long long)cfg->max_lease_seconds);
        goto fail;
    }
    if ((rc = skv_session_check_tenant(tenant)) ||
        (rc = request_tokens(w, p->tokens, p->n_tokens, p->text, p->chat, false, true, (int)cfg->max_prompt_tokens,
                             &ids, &n)))
        goto fail;
    if ((rc = check_prompt_top(p->prompt_top_logprobs)))
        goto fail;
    if (p->prompt_logprobs || p->prompt_top_logprobs) {
        /* the reply's messages too, before the work: they point into sc's arrays */
        if ((rc = prompt_scores_alloc(&sc, n, p->prompt_top_logprobs, w->m->cfg.n_vocab)))
            goto fail;
        scores = sc.logprobs;
        if ((rc = prompt_top_reply(&sc, (size_t)n - 1, &tops, &top_ptrs)))
            goto fail;
    }
    const char *spec = p->compress && p->compress->spec && *p->compress->spec ? p->compress->spec
                                                                                : cfg->default_compress;
    int reused = 0; /* a scored prompt computes every token: a reused row has no output to score */
    if ((rc = skv_session_create(w->sessions, w->m, tenant, job->req->tenant, &s)) ||
        (rc = set_spec(w, s, spec, false)) ||
        (cfg->prefix_reuse && !p->no_prefix_reuse && !scores && (rc = reuse_prefix(w, s, ids, n, &reused)) &&
         rc != SKV_E_NOMEM)) /* without the copy, every token is computed */
        goto fail;
    /* the bytes are known before the forward: a cache that cannot fit is refused (or room
     * made) before the work, not after it with the pool already past its size. A compressing
     * prefill keeps each layer's budget (a budget at or above the prompt, ratio=1 or
     * SqueezeAttention's cap of 4 B keep layers whole): room for that; it also holds one layer
     * in full while that layer runs, which is not counted. A reused prefix's blocks count for
     * the tenant (in s's bytes, which the reserve takes) and not again for the pool (a
     * compressing prefill's room counts the rows it keeps as new) */
    uint64_t held = 0, room = 0;
    if ((rc = s->comp ? reserve_compressing(w, s, n - reused, &held, &room)
                      : reserve_forward(w, s, n - reused, false, NULL)))
        goto fail;
    if (s->comp && cfg->prefix_reuse)
        keep_prompt_rows(w, s, n, held, room, &keep);
    s->lease_seconds = p->lease_seconds ? p->lease_seconds : (uint32_t)cfg->lease_seconds;
    double t0 = now_s();
    uint64_t inside0 = w->nested_us; /* what runs inside the forward is not its time */
    rc = session_forward_progress(w, s, ids + reused, n - reused, true, p->progress ? job : NULL, keep,
                                  scores ? &sc : NULL);
    if (rc)
        goto fail;
    if (keep) {
        keep->n_past = n;
        int rows = s->computed_rows < n ? s->computed_rows : n;
        rows -= rows % keep->block_rows;
        if (skv_prefix_cache_whole(keep, n) &&
            skv_prefix_cache_add(&w->prefix, s->tenant, ids, rows, keep, kept_room(w, s, false), skv_now_ms(),
                                 NULL))
            skv_log(SKV_LOG_WARN, "PREFILL: no memory to keep the prompt's rows"); /* the session is made */
        s->side[1] = NULL;
        skv_kv_cache_free(&keep);
    }
    w->metrics.prefill_tokens += (uint64_t)(n - reused);
    w->metrics.prefix_reused_tokens += (uint64_t)reused;
    w->metrics.scored_tokens += scores ? (uint64_t)n - 1 : 0;
    w->metrics.prefix_reuse_hits += reused > 0;
    skv_worker_tenant(w, job->tenant)->prefill_tokens += (uint64_t)(n - reused);
    w->metrics.prefill_seconds += now_s() - t0 - (double)(w->nested_us - inside0) * 1e-6;
    s->prompt_len = n;
    int evicted = 0;
    if ((rc = skv_session_charge(w->sessions, s, &evicted)))
        goto fail;
    unsigned long long more = 0;
    if (evicted && skv_log_allow(&w->log_evicted, skv_now_ms(), &more))
        skv_log(SKV_LOG_INFO, "evicted %d idle session(s) to make room (%llu more requests evicted since the last "
                "such line)", evicted, more);
    skv_worker_event_stored(w, s);

    Snapkv__Reply rep;
    Snapkv__PrefillReply pr = SNAPKV__PREFILL_REPLY__INIT;
    struct kept_arena arena = {0};
    reply_init(&rep, job);
    pr.session_id = (ProtobufCBinaryData){SKV_SESSION_ID_BYTES, s->id};
    pr.n_tokens = (uint32_t)n;
    pr.bytes_before = full_bytes(w->m, n);
    pr.bytes_after = s->bytes;
    pr.next_token = (uint32_t)skv_argmax(s->logits, w->m->cfg.n_vocab);
    pr.reused_tokens = (uint32_t)reused;
    if (p->return_logits) {
        pr.n_logits = (size_t)w->m->cfg.n_vocab;
        pr.logits = s->logits;
    }
    if (scores) {
        pr.n_prompt_logprobs = (size_t)n - 1;
        pr.prompt_logprobs = scores;
        pr.n_prompt_tokens = (size_t)n;
        pr.prompt_tokens = (uint32_t *)ids; /* ids of the vocabulary: none is negative */
        pr.n_prompt_top_tokens = (size_t)n - 1;
        pr.prompt_top_tokens = (uint32_t *)sc.top;
        pr.n_prompt_top_logprobs = tops ? (size_t)n - 1 : 0;
        pr.prompt_top_logprobs = top_ptrs;
    }
    w->metrics.bytes_before += pr.bytes_before;
    w->metrics.bytes_after += pr.bytes_after;
    if ((rc = fill_kept(s->cache, &arena, false, &pr.n_kept, &pr.kept))) {
        free_kept(&arena);
        goto fail;
    }
    rep.result_case = SNAPKV__REPLY__RESULT_PREFILL;
    rep.prefill = &pr;
    skv_worker_reply(w, job, &rep);
    free_kept(&arena);
    free(tops);
    free(top_ptrs);
    free(scores);
    free(ids);
    return;
fail:
    if (s)
        s->side[1] = NULL;
    skv_kv_cache_free(&keep);
    fail_rc(w, job, rc);
    if (s)
        skv_session_destroy(w->sessions, s);
    free(tops);
    free(top_ptrs);
    free(scores);
    free(ids);
}

static void handle_append(struct skv_worker *w, struct skv_job *job)
{
    const Snapkv__AppendRequest *a = job->req->append;
    struct skv_session *s = NULL;
    int32_t *ids = NULL;
    struct prompt_scores all = {0}; /* prompt_logprobs: all.logprobs holds them all */
    float *scores = NULL;
    Snapkv__TopLogprobs *tops = NULL, **top_ptrs = NULL;
    int n = 0, rc;
    int room = (int)(w->cfg->max_prompt_tokens + w->cfg->max_new_tokens);
    if ((rc = find_session(w, job, a->session_id, false, &s)))
        goto fail;
    if (s->busy) {
        rc = skv_errorf(SKV_E_BUSY, "the session is decoding");
        goto fail;
    }
    if ((rc = request_tokens(w, a->tokens, a->n_tokens, a->text, false, a->chat, false, room - s->cache->n_past, &ids,
                             &n)))
        goto fail;
    if ((rc = check_prompt_top(a->prompt_top_logprobs)))
        goto fail;
    if (a->prompt_logprobs || a->prompt_top_logprobs) {
        if (!s->logits) {
            rc = skv_errorf(SKV_E_INVAL, "prompt_logprobs: the session has no next-token logits to score the "
                            "first token with (an imported session, or one loaded from a save of before version "
                            "3, gets them from its first APPEND)");
            goto fail;
        }
        if ((rc = prompt_scores_alloc(&all, n, a->prompt_top_logprobs, w->m->cfg.n_vocab)))
            goto fail;
        scores = all.logprobs;
        if ((rc = prompt_top_reply(&all, (size_t)n, &tops, &top_ptrs)))
            goto fail;
        skv_logprobs(s->logits, w->m->cfg.n_vocab, ids[0], all.top_n, &scores[0], all.top_ids, all.top_lps);
        /* as the forward gives the others */
        all.top[0] = all.top_n ? all.top_ids[0] : skv_argmax(s->logits, w->m->cfg.n_vocab);
    }
    const struct prompt_scores sc = scores ? prompt_scores_from(&all, 1) : all;
    /* a long one may stop part way: the engine's undo drops the rows it added, and where the
     * session's upkeep evicts or re-scores rows too, it runs on a copy. A short one does not:
     * on a copy every block is shared, so its room would count the whole cache again (a
     * one-token APPEND near a full pool evicting others); its upkeep cuts at the forward's end
     * (session_hook), so one that fails part way is undone whole */
    struct session_undo u;
    bool copy = n >= APPEND_COPY_MIN && s->comp && !skv_compressor_decode_keeps_rows(s->comp);
    if (copy && (rc = undo_begin(w, s, &u)))
        goto fail;
    /* the room, counted on the cache the forward writes: on a copy every block is shared with
     * the old cache until undo_end, so a compaction's fresh blocks count in full */
    if ((rc = reserve_forward(w, s, n, forward_compacts(s), copy ? &u : NULL))) {
        if (copy)
            undo_end(w, s, &u, true);
        goto fail;
    }
    rc = session_forward_progress(w, s, ids, n, false, NULL, NULL, scores ? &sc : NULL);
    /* on a copy, charged before it is kept: a charge that fails leaves the session as it was
     * (it failed after the copy was kept, and the client was told so of an APPEND that took) */
    if (!rc)
        rc = skv_session_charge(w->sessions, s, NULL);
    if (copy)
        undo_end(w, s, &u, rc != SKV_OK);
    if (rc)
        goto fail;
    skv_worker_event_stored(w, s); /* announced again: its blocks as they are now */
    w->metrics.scored_tokens += scores ? (uint64_t)n : 0;
    s->n_text_pending = 0; /* the client's text follows: a generated character it cut stays cut */
    Snapkv__Reply rep;
    Snapkv__AppendReply ar = SNAPKV__APPEND_REPLY__INIT;
    reply_init(&rep, job);
    ar.n_tokens = (uint32_t)s->cache->n_past;
    ar.next_token = (uint32_t)skv_argmax(s->logits, w->m->cfg.n_vocab);
    if (a->return_logits) {
        ar.n_logits = (size_t)w->m->cfg.n_vocab;
        ar.logits = s->logits;
    }
    if (scores) {
        ar.n_prompt_logprobs = (size_t)n;
        ar.prompt_logprobs = scores;
        ar.n_prompt_tokens = (size_t)n;
        ar.prompt_tokens = (uint32_t *)ids; /* ids of the vocabulary: none is negative */
        ar.n_prompt_top_tokens = (size_t)n;
        ar.prompt_top_tokens = (uint32_t *)all.top;
        ar.n_prompt_top_logprobs = tops ? (size_t)n : 0;
        ar.prompt_top_logprobs = top_ptrs;
    }
    rep.result_case = SNAPKV__REPLY__RESULT_APPEND;
    rep.append = &ar;
    skv_worker_reply(w, job, &rep);
    free(tops);
    free(top_ptrs);
    free(scores);
    free(ids);
    return;
fail:
    fail_rc(w, job, rc);
    free(tops);
    free(top_ptrs);
    free(scores);
    free(ids);
}

/* COMPRESS's re-run of s's tokens from `cut` on under comp (taken; spec canon), on a copy of
 * its cache that shares every block: the rows from `cut` on are cut from the copy and run
 * again, so the new compressor scores the prompt with them as its window. On success the
 * copy, the compressor and the spec become s's; on failure (the pool, a deadline, a client
 * gone) s is exactly as it was. */
static int compress_rerun(struct skv_worker *w, struct skv_session *s, struct skv_compressor *comp,
                          const char *canon, int cut, bool was_h2o)
{
    int window = s->cache->n_past - cut;
    int32_t *redo = malloc((size_t)window * sizeof *redo);
    struct session_undo u;
    int rc = redo ? undo_begin(w, s, &u) : SKV_E_NOMEM;
    if (rc) {
        skv_compressor_free(&comp);
        free(redo);
        return rc;
    }
    memcpy(redo, s->tokens + cut, (size_t)window * sizeof *redo);
    skv_compressor_free(&s->comp); /* the old one (u keeps a copy): the new one takes its place */
    s->comp = comp;
    memcpy(s->spec, canon, sizeof s->spec);
    struct skv_kv_cache *work = s->cache;
    int H = work->n_kv_heads;
    for (int i = 0; i < work->n_layers * H && !rc; i++) {
        const struct skv_kv_head *kh = &work->heads[i];
        int len = kh->len;
        while (len > 0 && kh->pos[len - 1] >= cut)
            len--;
        rc = skv_kv_cache_truncate(work, i / H, i % H, len);
    }
    /* room for the re-run, counted on the copy: every block it keeps is shared with the old
     * cache, which holds them until undo_end, so the compaction's fresh blocks count in full */
    if (!rc)
        rc = reserve_forward(w, s, window, true, &u);
    if (!rc && s->comp)
        skv_compressor_rerun(s->comp, work, was_h2o, cut);
    if (!rc) {
        work->n_past = cut;
        s->n_tokens = cut;
        rc = session_forward(w, s, redo, window, true);
    }
    if (!rc) /* before the copy is kept (as APPEND's) */
        rc = skv_session_charge(w->sessions, s, NULL);
    free(redo);
    undo_end(w, s, &u, rc != SKV_OK);
    return rc;
}

/* Re-compression: the tokens from window_from on (default: the spec's last `window` tokens)
 * are taken off the cache and run again with the new spec, so they serve as the observation
 * window exactly as at prefill. Refused, changing nothing, for a session whose tokens are not
 * all known (an IMPORT without them) or that cannot have the room the re-run may take; one
 * that fails part way leaves the session as it was (compress_rerun). */
static void handle_compress(struct skv_worker *w, struct skv_job *job)
{
    const Snapkv__CompressRequest *c = job->req->compress;
    struct skv_session *s = NULL;
    struct skv_compressor *comp = NULL;
    char canon[sizeof s->spec] = {0}; /* all of it goes into the session, and into SAVE files */
    int rc;
    if ((rc = find_session(w, job, c->session_id, false, &s)))
        goto fail;
    if (s->busy) {
        rc = skv_errorf(SKV_E_BUSY, "the session is decoding");
        goto fail;
    }
    uint64_t before = full_bytes(w->m, s->cache->n_past);
    if ((rc = parse_spec(w, c->compress && c->compress->spec ? c->compress->spec : "", false, &comp, canon,
                         sizeof canon)))
        goto fail;
    int n_past = s->cache->n_past;
    int cut = n_past - (comp ? skv_compressor_spec(comp)->window : 1);
    if (c->window_from) {
        if (c->window_from >= (uint32_t)n_past) {
            rc = skv_errorf(SKV_E_INVAL, "window_from %u is not below the session's %d tokens", c->window_from,
                            n_past);
            goto fail;
        }
        cut = (int)c->window_from;
    }
    if (cut < 0)
        cut = 0;
    int window = n_past - cut;
    if (window > 0 && s->n_tokens != n_past) {
        rc = skv_errorf(SKV_E_INVAL,
                        "the session knows %d of its %d tokens (an import without them), so its window cannot be "
                        "run again",
                        s->n_tokens, n_past);
        goto fail;
    }
    bool was_h2o = s->comp && skv_compressor_spec(s->comp)->policy == SKV_POLICY_H2O;
    /* the rows the re-run cuts (by position) must be the last ones: heads out of position order
     * (StreamingLLM's, window's, H2O's decode) are gathered in order first, once the checks
     * passed (a refused COMPRESS leaves a fork's blocks shared), on the session's own cache, each
     * head's old blocks going as its new ones come (the rows stay the same if the re-run fails).
     * A fork's shared blocks become its own, which a re-run refused then could not give back:
     * room for them and for the re-run (what compress_rerun reserves after its cut) first, in
     * one reservation, so that one refused takes nothing and evicts no one */
    int shared = 0, most = 0;
    if (window > 0 && skv_kv_cache_order_blocks(s->cache, &shared, &most)) {
        uint64_t held, unique, bb = skv_kv_pool_block_bytes(s->cache->pool);
        skv_kv_cache_cut_growth(s->cache, cut, window, &held, &unique);
        held += skv_compressor_ring_bytes(s->comp); /* the undo copy's ring */
        /* the shared blocks the order takes stay; its transient goes before the re-run starts */
        unique = (uint64_t)shared * bb + ((uint64_t)most * bb > unique ? (uint64_t)most * bb : unique);
        if ((rc = skv_session_reserve(w->sessions, s, held, unique, NULL)))
            goto fail;
    }
    if (window > 0 && (rc = skv_kv_cache_order(s->cache)))
        goto fail;
    rc = window > 0 ? compress_rerun(w, s, comp, canon, cut, was_h2o) : SKV_OK;
    if (window > 0)
        comp = NULL; /* taken */
    if (rc) {
        char why[512]; /* skv_errorf() rewrites the buffer skv_error_msg() returns */
        snprintf(why, sizeof why, "%s", skv_error_msg());
        skv_errorf(rc, "%s; the session is as it was", why); /* cut at a character's end */
        skv_requests_fail(w, job, rc, skv_error_msg());
        return;
    }
    if (window <= 0) {
        skv_compressor_free(&s->comp);
        s->comp = comp;
        comp = NULL;
        memcpy(s->spec, canon, sizeof s->spec);
    }
    if ((rc = skv_session_charge(w->sessions, s, NULL)))
        goto fail;
    skv_worker_event_stored(w, s); /* announced again: compressed, its bytes fewer */
    Snapkv__Reply rep;
    Snapkv__CompressReply cr = SNAPKV__COMPRESS_REPLY__INIT;
    struct kept_arena arena = {0};
    reply_init(&rep, job);
    cr.bytes_before = before;
    cr.bytes_after = s->bytes;
    if ((rc = fill_kept(s->cache, &arena, false, &cr.n_kept, &cr.kept))) {
        free_kept(&arena);
        goto fail;
    }
    rep.result_case = SNAPKV__REPLY__RESULT_COMPRESS;
    rep.compress = &cr;
    skv_worker_reply(w, job, &rep);
    free_kept(&arena);
    return;
fail:
    skv_compressor_free(&comp);
    fail_rc(w, job, rc);
}

/* The start of a character s's text stopped inside: its running DECODE's when one runs (the
 * session gets it back only when the decode ends), else the session's. out: 8 bytes. */
static size_t text_pending(const struct skv_worker *w, const struct skv_session *s, char *out)
{
    for (const struct skv_decode *d = w->decodes; d; d = d->next)
        if (d->session == s) {
            memcpy(out, d->pending, d->n_pending);
            return d->n_pending;
        }
    memcpy(out, s->text_pending, s->n_text_pending);
    return s->n_text_pending;
}

static void handle_fork(struct skv_worker *w, struct skv_job *job)
{
    struct skv_session *src = NULL, *s = NULL;
    int rc;
    if ((rc = find_session(w, job, job->req->fork->session_id, false, &src)) ||
        (rc = skv_session_create(w->sessions, w->m, src->tenant, job->req->tenant, &s)))
        goto fail;
    skv_kv_cache_free(&s->cache);
    if ((rc = skv_kv_cache_clone(src->cache, &s->cache)) ||
        (src->comp && (rc = skv_compressor_clone(src->comp, &s->comp))) ||
        (rc = skv_session_push_tokens(s, src->tokens, src->n_tokens)))
        goto fail;
    if (src->logits) {
        s->logits = malloc((size_t)w->m->cfg.n_vocab * sizeof *s->logits);
        if (!s->logits) {
            rc = SKV_E_NOMEM;
            goto fail;
        }
        memcpy(s->logits, src->logits, (size_t)w->m->cfg.n_vocab * sizeof *s->logits);
    }
    memcpy(s->spec, src->spec, sizeof s->spec);
    s->n_text_pending = (uint8_t)text_pending(w, src, s->text_pending);
    s->prompt_len = src->prompt_len;
    s->computed_rows = src->computed_rows;
    s->lease_seconds = src->lease_seconds;
    src->last_used_ms = skv_now_ms();
    bool src_busy = src->busy; /* the fork's charge may evict the tenant's idle sessions, not its source */
    src->busy = true;
    rc = skv_session_charge(w->sessions, s, NULL);
    src->busy = src_busy;
    if (rc)
        goto fail;
    skv_worker_event_stored(w, s);
    Snapkv__Reply rep;
    Snapkv__ForkReply fr = SNAPKV__FORK_REPLY__INIT;
    reply_init(&rep, job);
    fr.session_id = (ProtobufCBinaryData){SKV_SESSION_ID_BYTES, s->id};
    fr.shared_bytes = skv_session_shared_bytes(s); /* every block, until one side writes */
    rep.result_case = SNAPKV__REPLY__RESULT_FORK;
    rep.fork = &fr;
    skv_worker_reply(w, job, &rep);
    return;
fail:
    fail_rc(w, job, rc);
    if (s)
        skv_session_destroy(w->sessions, s);
}

static int store_release(struct skv_worker *w, const char *tenant, const uint8_t *id);

static void handle_release(struct skv_worker *w, struct skv_job *job)
{
    struct skv_session *s = NULL;
    ProtobufCBinaryData sid = job->req->release->session_id;
    int rc = find_session_in(w, job, sid, false, true, &s);
    if (rc == SKV_E_NOT_FOUND && w->store) /* one in the store is deleted there, not loaded first */
        rc = store_release(w, tenant_of(job), sid.data);
    if (!rc && s && s->busy)
        rc = skv_errorf(SKV_E_BUSY, "the session is decoding");
    if (rc) {
        fail_rc(w, job, rc);
        return;
    }
    if (s && w->cfg->prefix_reuse && skv_prefix_cache_keep(&w->prefix, s, kept_room(w, s, true), skv_now_ms()))
        skv_log(SKV_LOG_WARN, "RELEASE: no memory to keep the session's prefix"); /* released all the same */
    if (s)
        skv_session_destroy(w->sessions, s);
    Snapkv__Reply rep;
    Snapkv__ReleaseReply rr = SNAPKV__RELEASE_REPLY__INIT;
    reply_init(&rep, job);
    rep.result_case = SNAPKV__REPLY__RESULT_RELEASE;
    rep.release = &rr;
    skv_worker_reply(w, job, &rep);
}

/* ---- EXPORT_KV / IMPORT_KV through a client's buffer ------------------------------------------- */

/* Whether every one of x[0..n) is finite (KV rows from outside: an IMPORT_KV's, a saved file's). */
static bool all_finite(const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return false;
    return true;
}

/* Opens the client's shared-memory object. It is never mapped: the client owns it and may
 * shrink it at any time, and a mapping would then fault (SIGBUS) in the daemon. Transfers go
 * through pread / pwrite, which report a short count instead. The object must belong to the
 * client's own user (an ipc:// connection's): the daemon can open every client's objects, and
 * without the check a client could have it write into another's buffer (EXPORT_KV) or read
 * another's exported cache into a session of its own (IMPORT_KV), names being listed in
 * /dev/shm for all to see. A tcp:// client's user is not known: it may not name one. */
static int open_buffer(const struct skv_job *job, const Snapkv__BufferRef *b, uint64_t need, bool writing,
                       int *fd_out)
{
    if (job->uid < 0)
        return skv_errorf(SKV_E_PERM, "a shared-memory buffer may be named only over an ipc:// endpoint, whose "
                          "connection tells snapkvd the client's user (to check the object is the client's own)");
    const char *name = b->shm_name;
    size_t len = strlen(name);
    if (len <= strlen(SKV_SHM_PREFIX) || len > 200 || strncmp(name, SKV_SHM_PREFIX, strlen(SKV_SHM_PREFIX)) != 0)
        return skv_errorf(SKV_E_INVAL, "shared-memory name '%s' must be '%s' and then 1..%zu characters", name,
                          SKV_SHM_PREFIX, 200 - strlen(SKV_SHM_PREFIX));
    for (size_t i = 1; i < len; i++)
        if (!isalnum((unsigned char)name[i]) && !strchr("._-", name[i]))
            return skv_errorf(SKV_E_INVAL, "shared-memory name '%s': only letters, digits and . _ -", name);
    int fd = shm_open(name, O_RDWR, 0);
    if (fd < 0) {
        int err = errno;
        int st = err == ENOENT ? SKV_E_NOT_FOUND : err == EACCES || err == EPERM ? SKV_E_PERM : SKV_E_IO;
        return skv_errorf(st, "shm_open %s: %s%s", name, strerror(err),
                          err != EACCES ? ""
                                          : " (snapkvd opens it as its own user, snapkv: libsnapkv gives that "
                                            "user an ACL entry on the buffer; without ACLs the buffer's group must "
                                            "be snapkvd's: join group snapkv, or run the client with it as primary "
                                            "group, `sg snapkv -c CMD`)");
    }
    struct stat sb;
    if (fstat(fd, &sb) < 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return skv_errorf(SKV_E_IO, "%s is not a shared-memory object", name);
    }
    if ((long)sb.st_uid != job->uid) {
        close(fd);
        return skv_errorf(SKV_E_PERM, "shared-memory object %s belongs to uid %lu, not to this client's user "
                          "(uid %ld): a client may name only its own buffers", name, (unsigned long)sb.st_uid, job->uid);
    }
    uint64_t size = (uint64_t)sb.st_size;
    if (b->offset > size || need > size - b->offset || b->offset + need > (uint64_t)INT64_MAX) {
        close(fd);
        return skv_errorf(SKV_E_LIMIT, "%s holds %llu bytes; %llu are needed from offset %llu", name,
                          (unsigned long long)size, (unsigned long long)need, (unsigned long long)b->offset);
    }
    /* pages the daemon's writes allocate in a tmpfs object are charged to the daemon (its
     * cgroup's memory), not to the client that made the object: an EXPORT_KV writes only into
     * pages the client allocated (posix_fallocate, as snapkv_shm_create does), else a client
     * could grow the daemon's memory with sparse objects it never unlinks */
    if (writing && (uint64_t)sb.st_blocks * 512 < size) { /* (SEEK_HOLE sees fallocated tmpfs pages as holes) */
        close(fd);
        return skv_errorf(SKV_E_INVAL, "%s has %llu of its %llu bytes allocated: allocate the whole buffer before "
                          "an EXPORT_KV (posix_fallocate; snapkv_shm_create does)", name,
                          (unsigned long long)sb.st_blocks * 512, (unsigned long long)size);
    }
    *fd_out = fd;
    return SKV_OK;
}

/* True when a was used before b (the table's LRU order). */
static bool ipc_older(const struct skv_ipc_buf *a, const struct skv_ipc_buf *b)
{
    return a->use < b->use;
}

/* True when e was opened for the client behind job (same endpoint, same routing id). */
static bool ipc_owned_by(const struct skv_ipc_buf *e, const struct skv_job *job)
{
    return e->sock == job->sock && e->identity_len == job->identity_len &&
           memcmp(e->identity, job->identity, job->identity_len) == 0;
}

static void ipc_close_at(struct skv_worker *w, int i);

/* The CUDA buffer `handle` of the client behind `job`, opened on first use and kept until the
 * client's connection closes (skv_requests_client_gone), it has been idle for a lease
 * (skv_requests_ipc_expire), room is needed or the worker stops. The table is a cache of
 * mappings, not something a client holds: one more than SKV_IPC_PER_CLIENT for a client, or
 * than SKV_IPC_MAX in all, closes the least recently used one (the client's own, or anyone's),
 * which a later transfer through it opens again. So clients with many connections cannot
 * take every slot from the others. Safe between requests: a transfer uses one buffer, and no
 * other request runs while it does. */
static int ipc_buffer(struct skv_worker *w, const struct skv_job *job, const ProtobufCBinaryData *handle,
                      void **out, uint64_t *bytes_out)
{
    if (handle->len != SKV_IPC_HANDLE_BYTES)
        return skv_errorf(SKV_E_INVAL, "a CUDA IPC handle of %zu bytes: it has %d", handle->len, SKV_IPC_HANDLE_BYTES);
    int mine = 0, mine_lru = -1, lru = -1;
    uint64_t now = skv_now_ms();
    for (int i = 0; i < w->n_ipc; i++) {
        struct skv_ipc_buf *e = &w->ipc[i];
        if (lru < 0 || ipc_older(e, &w->ipc[lru]))
            lru = i;
        if (!ipc_owned_by(e, job))
            continue;
        if (!memcmp(e->handle, handle->data, SKV_IPC_HANDLE_BYTES)) {
            e->last_used_ms = now;
            e->use = ++w->ipc_uses;
            *out = e->ptr;
            *bytes_out = e->bytes;
            return SKV_OK;
        }
        if (mine_lru < 0 || ipc_older(e, &w->ipc[mine_lru]))
            mine_lru = i;
        mine++;
    }
    void *ptr = NULL;
    uint64_t bytes = 0;
    /* the one that goes for room goes once this one opened (a handle that does not open closes
     * no one's; the driver counts a handle opened twice, and unmaps it at its last close), or
     * first when the open failed for want of room its mapping would give back */
    int victim = mine >= SKV_IPC_PER_CLIENT ? mine_lru : w->n_ipc >= SKV_IPC_MAX ? lru : -1;
    int rc = w->m->be->ops->ipc_open(w->m->be, handle->data, handle->len, &ptr, &bytes);
    if (rc == SKV_E_NOMEM && victim >= 0) {
        ipc_close_at(w, victim);
        w->metrics.ipc_closed_lru++;
        victim = -1;
        rc = w->m->be->ops->ipc_open(w->m->be, handle->data, handle->len, &ptr, &bytes);
    }
    if (rc)
        return rc;
    if (victim >= 0) {
        ipc_close_at(w, victim);
        w->metrics.ipc_closed_lru++;
    }
    struct skv_ipc_buf *e = &w->ipc[w->n_ipc++];
    e->sock = job->sock;
    memcpy(e->identity, job->identity, job->identity_len);
    e->identity_len = job->identity_len;
    memcpy(e->handle, handle->data, SKV_IPC_HANDLE_BYTES);
    e->ptr = ptr;
    e->bytes = bytes;
    e->last_used_ms = now;
    e->use = ++w->ipc_uses;
    *out = ptr;
    *bytes_out = bytes;
    return SKV_OK;
}

static void ipc_close_at(struct skv_worker *w, int i)
{
    w->m->be->ops->ipc_close(w->m->be, w->ipc[i].ptr);
    w->ipc[i] = w->ipc[--w->n_ipc];
}

int skv_requests_ipc_expire(struct skv_worker *w, uint64_t now_ms)
{
    int n = 0;
    uint64_t idle = (uint64_t)w->cfg->lease_seconds * 1000;
    for (int i = w->n_ipc - 1; i >= 0; i--)
        if (now_ms - w->ipc[i].last_used_ms > idle) {
            ipc_close_at(w, i);
            n++;
        }
    return n;
}

int skv_requests_client_gone(struct skv_worker *w, const struct skv_job *job)
{
    int n = 0;
    for (int i = w->n_ipc - 1; i >= 0; i--) /* ipc_close_at moves the last entry into i */
        if (ipc_owned_by(&w->ipc[i], job)) {
            ipc_close_at(w, i);
            n++;
        }
    w->metrics.ipc_closed_gone += (uint64_t)n;
    return n;
}

void skv_requests_ipc_close_all(struct skv_worker *w)
{
    while (w->n_ipc > 0)
        ipc_close_at(w, w->n_ipc - 1);
}

/* Where an export writes or an import reads `need` bytes of the layout, piece by piece
 * (xfer_put / xfer_get at offsets into the layout). A shared-memory object is read and written
 * with pread / pwrite. A CUDA buffer goes through a host copy of the whole layout that
 * xfer_close uploads (export) or that xfer_open filled by download (import). */
struct xfer {
    int fd;                    /* shm: the object, -1 otherwise */
    uint64_t base;             /* shm: the buffer's offset in the object */
    int64_t blocks;            /* shm export: the object's st_blocks when opened (-1: an import) */
    char *host;                /* CUDA: the staged layout */
    char *dev;                 /* CUDA: the opened buffer + offset */
    uint64_t need;
};

static int xfer_open(struct skv_worker *w, const struct skv_job *job, const Snapkv__BufferRef *b, uint64_t need,
                     bool import, struct xfer *x)
{
    *x = (struct xfer){.fd = -1, .blocks = -1, .need = need};
    if (!b)
        return skv_errorf(SKV_E_INVAL, "a buffer is required");
    if (b->kind_case == SNAPKV__BUFFER_REF__KIND_SHM_NAME) {
        x->base = b->offset;
        int rc = open_buffer(job, b, need, !import, &x->fd);
        struct stat sb;
        if (!rc && !import) {
            if (fstat(x->fd, &sb) != 0)
                return skv_errorf(SKV_E_IO, "fstat %s: %s", b->shm_name, strerror(errno));
            x->blocks = (int64_t)sb.st_blocks;
        }
        return rc;
    }
    if (b->kind_case != SNAPKV__BUFFER_REF__KIND_CUDA_IPC_HANDLE)
        return skv_errorf(SKV_E_INVAL, "the buffer is neither a shared-memory object nor a CUDA IPC handle");
    if (job->uid < 0) /* (a handle is usable on this host only; one learnt elsewhere names another's memory) */
        return skv_errorf(SKV_E_PERM, "a CUDA IPC handle may be named only over an ipc:// endpoint");
    /* the client states the size; the range must also lie in the allocation as the device
     * knows it (below), or the copy would reach any of the daemon's device memory */
    if (b->offset > b->size || need > b->size - b->offset)
        return skv_errorf(SKV_E_LIMIT, "the CUDA buffer holds %llu bytes; %llu are needed from offset %llu",
                          (unsigned long long)b->size, (unsigned long long)need, (unsigned long long)b->offset);
    if (need > (uint64_t)SIZE_MAX)
        return skv_errorf(SKV_E_LIMIT, "%llu bytes do not fit in memory", (unsigned long long)need);
    void *base = NULL;
    uint64_t real = 0;
    int rc = ipc_buffer(w, job, &b->cuda_ipc_handle, &base, &real);
    if (rc)
        return rc;
    if (b->offset > real || need > real - b->offset)
        return skv_errorf(SKV_E_LIMIT, "the CUDA buffer's allocation holds %llu bytes, not the %llu stated; %llu are "
                          "needed from offset %llu",
                          (unsigned long long)real, (unsigned long long)b->size, (unsigned long long)need,
                          (unsigned long long)b->offset);
    x->dev = (char *)base + b->offset;
    if (!(x->host = malloc(need ? (size_t)need : 1)))
        return skv_errorf(SKV_E_NOMEM, "no host memory to stage %llu bytes", (unsigned long long)need);
    struct skv_backend *be = w->m->be;
    if (import && need && ((rc = be->ops->download(be, x->host, x->dev, (size_t)need)) || (rc = be->ops->sync(be)))) {
        free(x->host);
        x->host = NULL;
    }
    return rc;
}

/* Writes len bytes of the layout at offset at. */
static int xfer_put(struct xfer *x, uint64_t at, const void *src, size_t len)
{
    if (x->fd < 0) {
        memcpy(x->host + at, src, len);
        return SKV_OK;
    }
    for (size_t done = 0; done < len;) {
        ssize_t k = pwrite(x->fd, (const char *)src + done, len - done, (off_t)(x->base + at + done));
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return skv_errorf(SKV_E_IO, "writing the shared-memory buffer: %s", k < 0 ? strerror(errno) : "no room");
        done += (size_t)k;
    }
    return SKV_OK;
}

/* Reads len bytes of the layout from offset at. */
static int xfer_get(struct xfer *x, uint64_t at, void *dst, size_t len)
{
    if (x->fd < 0) {
        memcpy(dst, x->host + at, len);
        return SKV_OK;
    }
    for (size_t done = 0; done < len;) {
        ssize_t k = pread(x->fd, (char *)dst + done, len - done, (off_t)(x->base + at + done));
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return skv_errorf(SKV_E_IO, "reading the shared-memory buffer: %s", strerror(errno));
        if (k == 0)
            return skv_errorf(SKV_E_INVAL, "the shared-memory buffer shrank during the transfer");
        done += (size_t)k;
    }
    return SKV_OK;
}

/* After an export's writes to a shared-memory object: pages they allocated (the object's
 * st_blocks grew) would be charged to the daemon's memory for as long as the client keeps the
 * object. open_buffer's count missed the holes they filled when the client allocated pages
 * past the object's end instead (fallocate FALLOC_FL_KEEP_SIZE), which count in st_blocks as
 * the range's would: the range is punched out again, giving them back, and the export fails. */
static int xfer_check_allocated(const struct xfer *x)
{
    struct stat sb;
    if (fstat(x->fd, &sb) != 0)
        return skv_errorf(SKV_E_IO, "fstat of the shared-memory buffer: %s", strerror(errno));
    if ((int64_t)sb.st_blocks <= x->blocks)
        return SKV_OK;
    unsigned long long grown = (unsigned long long)((int64_t)sb.st_blocks - x->blocks) * 512;
    if (fallocate(x->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)x->base, (off_t)x->need) != 0)
        return skv_errorf(SKV_E_INVAL, "the EXPORT_KV's writes allocated %llu bytes of the buffer's range that were "
                          "not allocated, and giving them back failed: %s", grown, strerror(errno));
    return skv_errorf(SKV_E_INVAL, "the EXPORT_KV's writes allocated %llu bytes of the buffer's range that were not "
                      "allocated (pages allocated past the object's end do not count): allocate the range itself "
                      "(posix_fallocate; snapkv_shm_create does). The range was cleared", grown);
}

/* Ends a transfer; an export's staged layout (rc == SKV_OK) goes to the CUDA buffer. */
static int xfer_close(struct skv_worker *w, struct xfer *x, bool export_ok)
{
    int rc = SKV_OK;
    if (x->fd >= 0) {
        if (x->blocks >= 0)
            rc = xfer_check_allocated(x);
        close(x->fd);
    } else if (x->dev && x->host) {
        struct skv_backend *be = w->m->be;
        if (export_ok && x->need && !(rc = be->ops->upload(be, x->dev, x->host, (size_t)x->need)))
            rc = be->ops->sync(be);
        free(x->host);
    }
    *x = (struct xfer){.fd = -1, .blocks = -1};
    return rc;
}

static int by_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* Head kh's rows as read into rows[len][row bytes], in position order (kh's rows are not). */
static int rows_in_order(const struct skv_kv_head *kh, char *rows, size_t row)
{
    int32_t *perm = malloc((size_t)(kh->len ? kh->len : 1) * sizeof *perm);
    char *copy = malloc((size_t)(kh->len ? kh->len : 1) * row);
    int rc = perm && copy ? SKV_OK : skv_errorf(SKV_E_NOMEM, "no memory to put %d rows in order", kh->len);
    if (!rc) {
        memcpy(copy, rows, (size_t)kh->len * row);
        skv_kv_head_argsort(kh, perm);
        for (int j = 0; j < kh->len; j++)
            memcpy(rows + (size_t)j * row, copy + (size_t)perm[j] * row, row);
    }
    free(perm);
    free(copy);
    return rc;
}

static void handle_export(struct skv_worker *w, struct skv_job *job)
{
    const Snapkv__ExportKvRequest *e = job->req->export_kv;
    struct skv_session *s = NULL;
    int rc = find_session(w, job, e->session_id, false, &s);
    if (rc) {
        fail_rc(w, job, rc);
        return;
    }
    const struct skv_kv_cache *c = s->cache;
    int L = c->n_layers, H = c->n_kv_heads, d = c->head_dim;
    uint32_t first = e->layer_first, count = e->layer_count ? e->layer_count : (uint32_t)L - first;
    if (first >= (uint32_t)L || count > (uint32_t)L - first) {
        skv_requests_fail(w, job, SKV_E_INVAL, "layer range outside the model");
        return;
    }
    uint64_t need = 0, n_pos = 0;
    for (uint32_t l = first; l < first + count; l++) {
        int mx = 0;
        for (int h = 0; h < H; h++) {
            int len = c->heads[l * H + h].len;
            mx = len > mx ? len : mx;
            n_pos += (uint64_t)len;
        }
        need += (uint64_t)2 * H * mx * d * sizeof(float);
    }
    struct xfer x;
    if ((rc = xfer_open(w, job, e->buffer, need, false, &x))) {
        xfer_close(w, &x, false);
        fail_rc(w, job, rc);
        return;
    }
    uint32_t *positions = malloc((size_t)(n_pos ? n_pos : 1) * sizeof *positions);
    if (!positions) {
        xfer_close(w, &x, false);
        skv_requests_fail(w, job, SKV_E_NOMEM, NULL);
        return;
    }
    /* per layer: K then V, each [Hkv][max kept][d] f32, heads padded with zeros; one head's
     * block at a time through a scratch of the longest head */
    size_t row = (size_t)d * sizeof(float), at_pos = 0;
    int longest = 0;
    for (int i = 0; i < L * H; i++)
        longest = c->heads[i].len > longest ? c->heads[i].len : longest;
    char *scratch = calloc(longest ? (size_t)longest : 1, row);
    if (!scratch)
        rc = skv_errorf(SKV_E_NOMEM, "no memory for a %d-row export scratch", longest);
    uint64_t at = 0;
    for (uint32_t l = first; l < first + count && !rc; l++) {
        int mx = 0;
        for (int h = 0; h < H; h++)
            mx = c->heads[l * H + h].len > mx ? c->heads[l * H + h].len : mx;
        for (int kv = 0; kv < 2 && !rc; kv++)
            for (int h = 0; h < H && !rc; h++) {
                const struct skv_kv_head *kh = &c->heads[l * H + h];
                rc = skv_kv_cache_read_rows(c, (int)l, h, kv, 0, kh->len, (float *)scratch);
                if (!rc && c->unordered && !skv_kv_head_in_order(kh))
                    rc = rows_in_order(kh, scratch, row); /* as every reader wants them */
                memset(scratch + (size_t)kh->len * row, 0, (size_t)(mx - kh->len) * row);
                if (!rc)
                    rc = xfer_put(&x, at, scratch, (size_t)mx * row);
                at += (uint64_t)mx * row;
            }
        for (int h = 0; h < H; h++) {
            const struct skv_kv_head *kh = &c->heads[l * H + h];
            for (int j = 0; j < kh->len; j++)
                positions[at_pos++] = (uint32_t)kh->pos[j];
            if (c->unordered)
                qsort(positions + at_pos - kh->len, (size_t)kh->len, sizeof *positions, by_u32);
        }
    }
    free(scratch);
    int rc_close = xfer_close(w, &x, rc == SKV_OK);
    rc = rc ? rc : rc_close;
    if (rc) {
        free(positions);
        fail_rc(w, job, rc);
        return;
    }
    Snapkv__Reply rep;
    Snapkv__ExportKvReply er = SNAPKV__EXPORT_KV_REPLY__INIT;
    struct kept_arena arena = {0};
    reply_init(&rep, job);
    er.bytes_written = need;
    er.n_positions = (size_t)n_pos;
    er.original_length = (uint32_t)c->n_past;
    er.positions = positions;
    if ((rc = fill_kept(c, &arena, false, &er.n_kept, &er.kept))) {
        fail_rc(w, job, rc);
    } else {
        er.kept += first;
        er.n_kept = count;
        rep.result_case = SNAPKV__REPLY__RESULT_EXPORT_KV;
        rep.export_kv = &er;
        skv_worker_reply(w, job, &rep);
    }
    free_kept(&arena);
    free(positions);
    s->last_used_ms = skv_now_ms();
}

/* IMPORT_KV's shapes against the model and the limits (no buffer, no session): what the socket
 * thread checks before queueing and the worker again. *need: the buffer bytes the layout takes. */
static int import_check(const struct skv_config *cfg, const struct skv_model *m, const Snapkv__ImportKvRequest *im,
                        uint64_t *need_out)
{
    const struct skv_model_config *mc = &m->cfg;
    int L = mc->n_layers, H = mc->n_kv_heads, d = mc->head_dim;
    if (im->n_kept != (size_t)L)
        return skv_errorf(SKV_E_INVAL, "kept lists %zu layers; the model has %d", im->n_kept, L);
    uint64_t need = 0, n_pos = 0;
    for (int l = 0; l < L; l++) {
        const Snapkv__LayerKept *k = im->kept[l];
        if (k->n_kept_per_head != (size_t)H)
            return skv_errorf(SKV_E_INVAL, "layer %d lists %zu heads; the model has %d", l, k->n_kept_per_head, H);
        if (k->layer != (uint32_t)l)
            return skv_errorf(SKV_E_INVAL, "kept entry %d names layer %u: the layers must come in order", l, k->layer);
        uint32_t mx = 0;
        for (int h = 0; h < H; h++) {
            if (k->kept_per_head[h] > im->original_length)
                return skv_errorf(SKV_E_INVAL, "layer %d head %d keeps more rows than the sequence has", l, h);
            mx = k->kept_per_head[h] > mx ? k->kept_per_head[h] : mx;
            n_pos += k->kept_per_head[h];
        }
        /* the layout's offsets follow the longest head (as snapkv_kv_offset's `kept`) */
        if (k->kept != 0 && k->kept != mx)
            return skv_errorf(SKV_E_INVAL, "layer %d: kept is %u, but its longest head keeps %u (0: not given)", l,
                              k->kept, mx);
        need += (uint64_t)2 * H * mx * d * sizeof(float);
    }
    const int64_t max_len = (int64_t)cfg->max_prompt_tokens + cfg->max_new_tokens;
    if ((int64_t)im->original_length > max_len) /* as every other length past the limits */
        return skv_errorf(SKV_E_LIMIT, "original length %u is past max-prompt-tokens + max-new-tokens (%lld)",
                          im->original_length, (long long)max_len);
    /* a session of no rows would hold no block: nothing (not the pool, not the tenant's
     * quota) would bound how many of them a client makes */
    if (n_pos == 0)
        return skv_errorf(SKV_E_INVAL, "the import keeps no rows: every KV head is empty");
    if (im->n_positions != n_pos || im->original_length == 0 || im->n_tokens > im->original_length)
        return skv_errorf(SKV_E_INVAL, "positions (%zu, expected %llu), tokens (%zu) or original length (%u) do not fit",
                          im->n_positions, (unsigned long long)n_pos, im->n_tokens, im->original_length);
    /* each head's positions increase below the length: checked before any session is evicted
     * to make room (a request's own data, so on the socket thread too) */
    size_t at = 0;
    for (int l = 0; l < L; l++)
        for (int h = 0; h < H; h++) {
            uint32_t n = im->kept[l]->kept_per_head[h];
            for (uint32_t j = 0; j < n; j++, at++)
                if (im->positions[at] >= im->original_length || (j > 0 && im->positions[at] <= im->positions[at - 1]))
                    return skv_errorf(SKV_E_INVAL,
                                      "layer %d head %d: position %u at %u; positions must increase below the "
                                      "length (%u)",
                                      l, h, im->positions[at], j, im->original_length);
        }
    /* the rows' bytes alone (in the pool's KV type) past the tenant's quota or the pool: refused
     * before the layout is read (a CUDA buffer's is staged whole in host memory, at most
     * n_kv_heads times this) */
    uint64_t row_bytes = (uint64_t)2 * skv_kv_pool_row_bytes(m->kv_pool);
    uint64_t have = (uint64_t)n_pos * row_bytes;
    if ((cfg->max_bytes_per_tenant > 0 && have > (uint64_t)cfg->max_bytes_per_tenant) ||
        have > (uint64_t)cfg->pool_size)
        return skv_errorf(SKV_E_LIMIT, "the import's %llu rows take %llu bytes: more than max-bytes-per-tenant "
                          "(%lld) or pool-size (%lld)", (unsigned long long)n_pos, (unsigned long long)have,
                          (long long)cfg->max_bytes_per_tenant, (long long)cfg->pool_size);
    *need_out = need;
    return SKV_OK;
}

/* Every row of the import's layout finite, read once before any room is made for them, so a
 * refused import has evicted no session (the rows are read again into the blocks). */
static int import_rows_finite(struct xfer *x, const struct skv_model_config *mc, const Snapkv__ImportKvRequest *im)
{
    const int L = mc->n_layers, H = mc->n_kv_heads;
    const size_t row = (size_t)mc->head_dim * sizeof(float);
    uint32_t most = 0;
    for (int l = 0; l < L; l++)
        for (int h = 0; h < H; h++)
            most = im->kept[l]->kept_per_head[h] > most ? im->kept[l]->kept_per_head[h] : most;
    float *rows = malloc(most ? most * row : 1);
    if (!rows)
        return skv_errorf(SKV_E_NOMEM, "no memory for a %u-row import scratch", most);
    int rc = SKV_OK;
    uint64_t at = 0;
    for (int l = 0; l < L && !rc; l++) {
        uint32_t mx = 0;
        for (int h = 0; h < H; h++)
            mx = im->kept[l]->kept_per_head[h] > mx ? im->kept[l]->kept_per_head[h] : mx;
        for (int kv = 0; kv < 2 && !rc; kv++)
            for (int h = 0; h < H && !rc; h++, at += (uint64_t)mx * row) {
                uint32_t len = im->kept[l]->kept_per_head[h];
                if (!(rc = xfer_get(x, at, rows, len * row)) && !all_finite(rows, len * (row / sizeof(float))))
                    rc = skv_errorf(SKV_E_INVAL, "IMPORT_KV: a %s of layer %d, KV head %d is not finite",
                                    kv ? "value" : "key", l, h);
            }
    }
    free(rows);
    return rc;
}

static void handle_import(struct skv_worker *w, struct skv_job *job)
{
    const Snapkv__ImportKvRequest *im = job->req->import_kv;
    const struct skv_model_config *mc = &w->m->cfg;
    int L = mc->n_layers, H = mc->n_kv_heads, d = mc->head_dim, rc;
    struct skv_session *s = NULL;
    struct xfer x = {.fd = -1};
    char *scratch = NULL;
    uint64_t need = 0;
    if ((rc = import_check(w->cfg, w->m, im, &need)))
        goto fail;
    for (size_t i = 0; i < im->n_tokens; i++)
        if (im->tokens[i] >= (uint32_t)mc->n_vocab) {
            rc = skv_errorf(SKV_E_INVAL, "token %u outside the vocabulary", im->tokens[i]);
            goto fail;
        }
    if ((rc = skv_session_check_tenant(tenant_of(job))) || (rc = xfer_open(w, job, im->buffer, need, true, &x)) ||
        (rc = import_rows_finite(&x, mc, im)) ||
        (rc = skv_session_create(w->sessions, w->m, tenant_of(job), job->req->tenant, &s)) ||
        (rc = set_spec(w, s, "policy=full", false)))
        goto fail;
    int max_len = 0;
    uint64_t bytes = 0; /* the blocks the imported rows take: room made (or refused) before any is written */
    for (int l = 0; l < L; l++)
        for (int h = 0; h < H; h++) {
            int len = (int)im->kept[l]->kept_per_head[h];
            max_len = len > max_len ? len : max_len;
            bytes += (uint64_t)((len + s->cache->block_rows - 1) / s->cache->block_rows) *
                     skv_kv_pool_block_bytes(s->cache->pool);
        }
    if ((rc = skv_session_reserve(w->sessions, s, bytes, bytes, NULL)) ||
        (rc = skv_kv_cache_reserve(s->cache, max_len)))
        goto fail;
    size_t row = (size_t)d * sizeof(float), at_pos = 0;
    if (!(scratch = malloc(max_len ? (size_t)max_len * row : 1))) {
        rc = skv_errorf(SKV_E_NOMEM, "no memory for a %d-row import scratch", max_len);
        goto fail;
    }
    uint64_t at = 0;
    for (int l = 0; l < L; l++) {
        uint32_t mx = 0;
        for (int h = 0; h < H; h++)
            mx = im->kept[l]->kept_per_head[h] > mx ? im->kept[l]->kept_per_head[h] : mx;
        for (int kv = 0; kv < 2; kv++)
            for (int h = 0; h < H; h++) {
                int len = (int)im->kept[l]->kept_per_head[h];
                if ((rc = xfer_get(&x, at, scratch, (size_t)len * row)))
                    goto fail;
                if (!all_finite((const float *)scratch, (size_t)len * (row / sizeof(float)))) { /* as LOAD */
                    rc = skv_errorf(SKV_E_INVAL, "IMPORT_KV: a %s of layer %d, KV head %d is not finite",
                                    kv ? "value" : "key", l, h);
                    goto fail;
                }
                if ((rc = skv_kv_cache_write_rows(s->cache, l, h, kv, 0, len, (const float *)scratch)))
                    goto fail;
                at += (uint64_t)mx * row;
            }
        for (int h = 0; h < H; h++) {
            struct skv_kv_head *kh = skv_kv_cache_head(s->cache, l, h);
            for (int j = 0; j < kh->len; j++) { /* import_check: they increase below the length */
                kh->pos[j] = (int32_t)im->positions[at_pos++];
                kh->score[j] = 0;
            }
        }
    }
    xfer_close(w, &x, false);
    free(scratch);
    scratch = NULL;
    s->cache->n_past = (int32_t)im->original_length;
    s->prompt_len = (int32_t)im->original_length;
    s->lease_seconds = (uint32_t)w->cfg->lease_seconds;
    for (size_t i = 0; i < im->n_tokens && !rc; i++) {
        int32_t t = (int32_t)im->tokens[i];
        rc = skv_session_push_tokens(s, &t, 1);
    }
    if (rc || (rc = skv_session_charge(w->sessions, s, NULL)))
        goto fail;
    skv_worker_event_stored(w, s);
    Snapkv__Reply rep;
    Snapkv__ImportKvReply ir = SNAPKV__IMPORT_KV_REPLY__INIT;
    reply_init(&rep, job);
    ir.session_id = (ProtobufCBinaryData){SKV_SESSION_ID_BYTES, s->id};
    rep.result_case = SNAPKV__REPLY__RESULT_IMPORT_KV;
    rep.import_kv = &ir;
    skv_worker_reply(w, job, &rep);
    return;
fail:
    fail_rc(w, job, rc);
    xfer_close(w, &x, false);
    free(scratch);
    if (s)
        skv_session_destroy(w->sessions, s);
}

/* ---- DECODE ------------------------------------------------------------------------------------ */

void skv_requests_decode_end(struct skv_worker *w, struct skv_decode *d)
{
    if (d->session && d->produced > 0)
        skv_worker_event_stored(w, d->session); /* announced again: the tokens it decoded */
    skv_requests_decode_free(d);
}

void skv_requests_decode_free(struct skv_decode *d)
{
    if (!d)
        return;
    if (d->session) {
        d->session->busy = 0;
        memcpy(d->session->text_pending, d->pending, d->n_pending);
        d->session->n_text_pending = (uint8_t)d->n_pending;
    }
    skv_sampler_fini(&d->sampler);
    skv_stop_text_fini(&d->stops);
    free(d->lp);
    free(d->top_ids);
    free(d->top_lp);
    free(d->stop);
    free(d->out);
    free(d->text);
    if (d->job) {
        snapkv__request__free_unpacked(d->job->req, NULL);
        free(d->job);
    }
    free(d);
}

/* Room for one more running decode of `tenant`. Every round takes one token of every running
 * decode, so each one more slows all the others: without a bound one client's many decodes
 * would make every other client's wait (max-decodes-per-tenant first: it names the limit the
 * asking tenant can do something about). */
static int decode_room(const struct skv_worker *w, const char *tenant)
{
    int64_t all = 0, mine = 0;
    for (const struct skv_decode *d = w->decodes; d; d = d->next) {
        all++;
        mine += strcmp(d->session->tenant, tenant) == 0;
    }
    if (mine >= w->cfg->max_decodes_per_tenant)
        return skv_errorf(SKV_E_BUSY,
                          "this tenant already runs %lld decode(s), its limit (max-decodes-per-tenant = %lld)",
                          (long long)mine, (long long)w->cfg->max_decodes_per_tenant);
    if (all >= w->cfg->max_decodes)
        return skv_errorf(SKV_E_BUSY, "%lld decode(s) are running, the daemon's limit (max-decodes = %lld)",
                          (long long)all, (long long)w->cfg->max_decodes);
    return SKV_OK;
}

/* d's sampler from the request's Sampling (NULL: greedy). */
static int sampler_start(struct skv_worker *w, const Snapkv__Sampling *sp, struct skv_sampler *out)
{
    struct skv_sampler_params p = {0};
    if (!sp)
        return skv_sampler_init(out, &p, w->m->cfg.n_vocab);
    p.temperature = sp->temperature;
    p.top_k = (int)(sp->top_k > 1000000 ? 1000000 : sp->top_k);
    p.top_p = sp->top_p;
    p.seed = sp->seed;
    p.min_p = sp->min_p;
    p.repetition_penalty = sp->repetition_penalty;
    p.repetition_last_n = (int)(sp->repetition_last_n > INT32_MAX ? INT32_MAX : sp->repetition_last_n);
    p.frequency_penalty = sp->frequency_penalty;
    p.presence_penalty = sp->presence_penalty;
    if (sp->n_logit_bias > SKV_LOGIT_BIAS_MAX)
        return skv_errorf(SKV_E_LIMIT, "at most %u logit_bias entries, not %zu", SKV_LOGIT_BIAS_MAX,
                          sp->n_logit_bias);
    int32_t ids[SKV_LOGIT_BIAS_MAX];
    float bias[SKV_LOGIT_BIAS_MAX];
    for (size_t i = 0; i < sp->n_logit_bias; i++) {
        const Snapkv__LogitBias *b = sp->logit_bias[i];
        if (b->token >= (uint32_t)w->m->cfg.n_vocab) /* named here as sent, before the int32 below */
            return skv_errorf(SKV_E_INVAL, "logit_bias token %u is outside the vocabulary [0, %d)", b->token,
                              w->m->cfg.n_vocab);
        ids[i] = (int32_t)b->token;
        bias[i] = b->bias;
    }
    p.bias_ids = ids;
    p.bias = bias;
    p.n_bias = sp->n_logit_bias;
    return skv_sampler_init(out, &p, w->m->cfg.n_vocab);
}

struct skv_decode *skv_requests_decode_start(struct skv_worker *w, struct skv_job *job)
{
    const Snapkv__DecodeRequest *q = job->req->decode;
    struct skv_session *s = NULL;
    int rc = find_session(w, job, q->session_id, false, &s);
    if (!rc && s->busy)
        rc = skv_errorf(SKV_E_BUSY, "the session is already decoding");
    if (!rc)
        rc = decode_room(w, s->tenant);
    if (!rc && !s->logits)
        rc = skv_errorf(SKV_E_INVAL, "the session has no next-token logits (an imported session, or one "
                                     "loaded from a save of before version 3): "
                                     "APPEND the next token first");
    const Snapkv__Sampling *sp = q->sampling;
    uint32_t max = sp && sp->max_tokens ? sp->max_tokens : DEFAULT_MAX_TOKENS;
    if (!rc && max > (uint32_t)w->cfg->max_new_tokens)
        rc = skv_errorf(SKV_E_LIMIT, "max_tokens %u is above the limit of %lld", max,
                        (long long)w->cfg->max_new_tokens);
    if (!rc && (int64_t)s->cache->n_past + max > w->cfg->max_prompt_tokens + w->cfg->max_new_tokens)
        rc = skv_errorf(SKV_E_LIMIT, "the session would grow past %lld tokens",
                        (long long)(w->cfg->max_prompt_tokens + w->cfg->max_new_tokens));
    struct skv_decode *d = NULL;
    if (!rc && !(d = calloc(1, sizeof *d)))
        rc = SKV_E_NOMEM;
    if (!rc) {
        rc = sampler_start(w, sp, &d->sampler);
        if (sp && sp->n_stop_tokens > SKV_STOP_TOKENS_MAX && !rc)
            rc = skv_errorf(SKV_E_LIMIT, "at most %d stop tokens", SKV_STOP_TOKENS_MAX);
        if (sp && sp->top_logprobs > SKV_TOP_LOGPROBS_MAX && !rc)
            rc = skv_errorf(SKV_E_LIMIT, "top_logprobs %u is above the limit of %u", sp->top_logprobs,
                            SKV_TOP_LOGPROBS_MAX);
    }
    if (!rc && !(d->out = malloc((size_t)max * sizeof *d->out)))
        rc = SKV_E_NOMEM;
    if (!rc && sp && sp->n_stop)
        rc = skv_stop_text_init(&d->stops, (const char *const *)sp->stop, sp->n_stop);
    for (size_t i = 0; !rc && sp && i < sp->n_stop_tokens; i++)
        if (sp->stop_tokens[i] >= (uint32_t)w->m->cfg.n_vocab)
            rc = skv_errorf(SKV_E_INVAL, "stop token %u at index %zu is outside the vocabulary [0, %d)",
                            sp->stop_tokens[i], i, w->m->cfg.n_vocab);
    if (!rc && sp && sp->n_stop_tokens) {
        if (!(d->stop = malloc(sp->n_stop_tokens * sizeof *d->stop)))
            rc = SKV_E_NOMEM;
        else {
            memcpy(d->stop, sp->stop_tokens, sp->n_stop_tokens * sizeof *d->stop);
            d->n_stop = sp->n_stop_tokens;
        }
    }
    if (rc) {
        fail_rc(w, job, rc);
        if (d) {
            d->job = NULL;
            skv_requests_decode_free(d);
        }
        return NULL; /* the caller frees the job */
    }
    d->job = job;
    d->session = s;
    d->max_tokens = max;
    d->stop_at_eos = sp && sp->stop_at_eos;
    d->stream = q->stream;
    d->top_n = sp ? sp->top_logprobs : 0;
    d->logprobs = sp && (sp->logprobs || sp->top_logprobs > 0);
    memcpy(d->pending, s->text_pending, s->n_text_pending);
    d->n_pending = s->n_text_pending;
    s->busy = 1;
    return d;
}

/* Text of the new token, as valid UTF-8 in buf (cap bytes, NUL-terminated): the bytes held
 * from the last token, then this token's; a character it starts and does not finish is held
 * for the next one; bytes that are not UTF-8 (byte tokens out of order, a stray continuation)
 * become U+FFFD, one for each maximal ill-formed part as Hugging Face's decode makes them
 * (skv_utf8_char), and so does a NUL, which would cut the reply's C string. Before, only the
 * last character was looked at: a held byte the next token did not continue went out as it
 * was, and the reply was not UTF-8. */
static size_t token_text(struct skv_worker *w, struct skv_decode *d, int32_t t, char *buf, size_t cap)
{
    unsigned char raw[TOKEN_TEXT_MAX + sizeof d->pending];
    size_t len = 0, have = d->n_pending;
    memcpy(raw, d->pending, d->n_pending);
    /* control tokens (<|im_end|> ...) carry no text for the reader; their ids still stream */
    size_t room = sizeof raw - have;
    int trc = w->m->tok && !skv_tokenizer_is_special(w->m->tok, t)
                  ? skv_tokenizer_token_bytes(w->m->tok, t, (char *)raw + have, room, &len)
                  : SKV_E_NOT_FOUND;
    if (trc == SKV_OK || trc == SKV_E_LIMIT) /* a longer token: its first TOKEN_TEXT_MAX bytes */
        have += len < room ? len : room;
    static const char replacement[] = "\xEF\xBF\xBD";
    size_t out = 0, i = 0;
    bool partial = false;
    while (i < have) {
        size_t skip, n = skv_utf8_char(raw + i, have - i, &partial, &skip);
        if (partial)
            break;
        bool bad = n == 0 || raw[i] == 0;
        const void *from = bad ? (const void *)replacement : (const void *)(raw + i);
        size_t put = bad ? 3 : n;
        if (out + put > cap - 1)
            break; /* (cap holds 3 bytes per raw byte: not reached) */
        memcpy(buf + out, from, put);
        out += put;
        i += bad ? skip : n;
    }
    d->n_pending = partial ? have - i : 0;
    memcpy(d->pending, raw + i, d->n_pending);
    buf[out] = '\0';
    return out;
}

/* Where d keeps token k's log-probabilities: a streamed decode only the current token's (each
 * reply carries its own), a collected one every token's. */
static uint32_t lp_slot(const struct skv_decode *d, uint32_t k)
{
    return d->stream ? 0 : k;
}

/* The reply of d's last n tokens (tokens: those n); false when it could not be made (the job
 * then got its final error reply instead, and the decode must end). */
static bool decode_reply(struct skv_worker *w, struct skv_decode *d, bool final, const char *reason,
                         int32_t *tokens, size_t n, const char *text)
{
    Snapkv__Reply rep;
    Snapkv__DecodeReply dr = SNAPKV__DECODE_REPLY__INIT;
    reply_init(&rep, d->job);
    rep.final = final;
    dr.n_tokens = n;
    /* token ids are never negative, and a signed and an unsigned type of one size may alias:
     * no copy (a copy on the stack was max-new-tokens ids long: 64 MiB at its limit) */
    dr.tokens = (uint32_t *)tokens;
    dr.text = (char *)text;
    dr.n_generated = d->produced;
    dr.finish_reason = (char *)(reason ? reason : "");
    if (reason && strcmp(reason, "error") == 0)
        rep.message = d->error; /* what ended it; the status is OK: the tokens so far went in */
    const size_t first = n ? lp_slot(d, d->produced - (uint32_t)n) : 0; /* the reply's first token's slot */
    Snapkv__TopLogprobs one, *one_ptr = &one, *tops = NULL, **top_ptrs = NULL;
    if (d->logprobs && n) {
        dr.n_logprobs = n;
        dr.logprobs = d->lp + first;
    }
    if (d->top_n && n) {
        tops = n == 1 ? &one : malloc(n * sizeof *tops); /* a streamed token's on the stack */
        top_ptrs = n == 1 ? &one_ptr : malloc(n * sizeof *top_ptrs);
        if (!tops || !top_ptrs) {
            free(tops);
            free(top_ptrs);
            skv_requests_fail(w, d->job, SKV_E_NOMEM, "no memory for the reply's top log-probabilities");
            return false;
        }
        const uint32_t m = d->top_n < (uint32_t)w->m->cfg.n_vocab ? d->top_n : (uint32_t)w->m->cfg.n_vocab;
        for (size_t i = 0; i < n; i++) {
            snapkv__top_logprobs__init(&tops[i]);
            tops[i].n_tokens = tops[i].n_logprobs = m;
            tops[i].tokens = (uint32_t *)d->top_ids + (first + i) * d->top_n;
            tops[i].logprobs = d->top_lp + (first + i) * d->top_n;
            top_ptrs[i] = &tops[i];
        }
        dr.n_top_logprobs = n;
        dr.top_logprobs = top_ptrs;
    }
    rep.result_case = SNAPKV__REPLY__RESULT_DECODE;
    rep.decode = &dr;
    skv_worker_reply(w, d->job, &rep);
    if (n > 1) {
        free(tops);
        free(top_ptrs);
    }
    return true;
}

/* Room in d's log-probability arrays for one more token; SKV_E_NOMEM when there is none. */
static int logprobs_room(struct skv_decode *d)
{
    if (lp_slot(d, d->produced) < d->lp_cap)
        return SKV_OK;
    uint32_t cap = d->stream ? 1 : d->lp_cap ? 2 * d->lp_cap : 64;
    cap = cap > d->max_tokens ? d->max_tokens : cap;
    float *lp = realloc(d->lp, (size_t)cap * sizeof *lp);
    if (lp)
        d->lp = lp;
    int32_t *ids = d->top_n ? realloc(d->top_ids, (size_t)cap * d->top_n * sizeof *ids) : NULL;
    if (ids)
        d->top_ids = ids;
    float *tlp = d->top_n ? realloc(d->top_lp, (size_t)cap * d->top_n * sizeof *tlp) : NULL;
    if (tlp)
        d->top_lp = tlp;
    if (!lp || (d->top_n && (!ids || !tlp)))
        return skv_errorf(SKV_E_NOMEM, "no memory for the log-probabilities of %u tokens", cap);
    d->lp_cap = cap;
    return SKV_OK;
}

/* Samples d's next token from its session's logits (with its log-probabilities when asked) and
 * decides whether it is the last; SKV_E_NOMEM (nothing changed) when the log-probabilities have
 * no room. */
static int decode_pick(struct skv_worker *w, struct skv_decode *d)
{
    struct skv_session *s = d->session;
    d->picked = false;
    if (d->logprobs) {
        int rc = logprobs_room(d);
        if (rc)
            return rc;
    }
    int32_t t = skv_sampler_next(&d->sampler, s->logits, s->tokens, s->n_tokens, d->out, (int)d->produced);
    if (d->logprobs) {
        const size_t k = lp_slot(d, d->produced);
        (void)skv_logprobs(s->logits, w->m->cfg.n_vocab, t, (int)d->top_n, &d->lp[k],
                           d->top_n ? d->top_ids + k * d->top_n : NULL, d->top_n ? d->top_lp + k * d->top_n : NULL);
    }
    d->out[d->produced++] = t;
    d->picked = true;
    d->token = t;
    d->reason = NULL;
    for (size_t i = 0; i < d->n_stop && !d->reason; i++)
        if ((uint32_t)t == d->stop[i])
            d->reason = "stop";
    if (!d->reason && d->stop_at_eos && w->m->tok &&
        (t == skv_tokenizer_eos(w->m->tok) || t == skv_tokenizer_eot(w->m->tok)))
        d->reason = "eos";
    if (!d->reason && d->produced >= d->max_tokens)
        d->reason = "length";
    return SKV_OK;
}

/* Ends d before its next token with its final reply, finish_reason `reason`: what a collected
 * decode produced (streamed ones had theirs), and the text held back for stop sequences. */
static void decode_end_early(struct skv_worker *w, struct skv_decode *d, const char *reason)
{
    char held[SKV_STOP_STRING_BYTES + 1];
    size_t n_held = skv_stop_text_flush(&d->stops, held);
    char *all = NULL;
    if (!d->stream && n_held && (all = malloc(d->text_len + n_held + 1))) {
        memcpy(all, d->text ? d->text : "", d->text_len);
        memcpy(all + d->text_len, held, n_held + 1);
    }
    (void)decode_reply(w, d, true, reason, d->stream ? NULL : d->out, d->stream ? 0 : d->produced,
                       d->stream ? held : all ? all : d->text ? d->text : ""); /* final either way */
    free(all);
}

/* After the token's forward (rc): charge the session and reply; true when d is finished. A
 * token that fails after others went in ends the decode with them, so that a collected decode's
 * client learns what its session now holds (an error reply carries no token): refused room (the
 * tenant's quota, the pool), finish_reason "limit"; any other failure (out of memory, the
 * device), finish_reason "error" and the reason in the reply's message, status OK. */
static bool decode_done(struct skv_worker *w, struct skv_decode *d, int rc)
{
    struct skv_session *s = d->session;
    int32_t t = d->token;
    if (!rc)
        rc = skv_session_push_tokens(s, &t, 1);
    const bool in = !rc; /* the token is in the session (its charge may still fail) */
    s->last_used_ms = skv_now_ms();
    if (!rc)
        rc = skv_session_charge(w->sessions, s, NULL);
    /* the tokens in the session: a token that failed was counted if it was sampled (a failure
     * of its log-probabilities' room comes before) */
    const uint32_t in_session = d->produced - (!in && d->picked ? 1u : 0u);
    if (rc && in_session > 0) {
        const bool limit = rc == SKV_E_LIMIT || rc == SKV_E_POOL_FULL;
        skv_log(limit ? SKV_LOG_DEBUG : SKV_LOG_WARN, "a decode ends after %u tokens: %s", in_session,
                skv_error_msg());
        if (!limit) { /* a failure as any request's: counted, and a device lost stops the daemon */
            snprintf(d->error, sizeof d->error, "the decode failed after %u token(s), which are in the session: %s",
                     in_session, skv_error_msg());
            count_error(w, d->job);
            skv_worker_note_failure(w, rc);
        }
        if (!in) {
            d->produced = in_session; /* the failed one never entered */
            decode_end_early(w, d, limit ? "limit" : "error");
            return true;
        }
        if (!d->reason || !limit) /* in, its charge refused: the last (an eos, a stop, the length stand) */
            d->reason = limit ? "limit" : "error";
        rc = SKV_OK;
    }
    if (rc) {
        fail_rc(w, d->job, rc);
        return true;
    }
    /* generated: the token stays in the session (one refused room, or whose forward failed, is
     * not counted: it was, in both counters) */
    w->metrics.decode_tokens++;
    skv_worker_tenant(w, d->job->tenant)->decode_tokens++;
    /* the same text streamed or collected: each token's bytes, control tokens none, a
     * character cut by the end held for the session's next DECODE; with stop sequences, up to
     * the first one, and what may begin one held back until it cannot or the decode ends */
    char tok_text[3 * (TOKEN_TEXT_MAX + 8) + 1], text[sizeof tok_text + SKV_STOP_STRING_BYTES + 1];
    size_t len = token_text(w, d, t, tok_text, sizeof tok_text);
    if (skv_stop_text_feed(&d->stops, tok_text, len, text, &len)) {
        d->reason = "stop";
        d->n_pending = 0; /* bytes after the sequence: not the session's text */
    } else if (d->reason) {
        len += skv_stop_text_flush(&d->stops, text + len);
    }
    if (d->stream)
        return !decode_reply(w, d, d->reason != NULL, d->reason, &t, 1, text) || d->reason != NULL;
    if (d->text_len + len + 1 > d->text_cap) {
        size_t cap = d->text_cap ? d->text_cap : 256;
        while (cap < d->text_len + len + 1)
            cap *= 2;
        char *grown = realloc(d->text, cap);
        if (!grown) { /* the token is in: the decode ends with its tokens, the text as far as it got */
            if (!d->reason || strcmp(d->reason, "error") != 0) { /* (a failure counted once, its first cause) */
                snprintf(d->error, sizeof d->error, "the decode failed after %u token(s), which are in the session: "
                         "no memory for the decoded text (the reply's ends before the last token's)", d->produced);
                count_error(w, d->job);
            }
            d->reason = "error";
            (void)decode_reply(w, d, true, d->reason, d->out, d->produced, d->text ? d->text : "");
            return true;
        }
        d->text = grown;
        d->text_cap = cap;
    }
    memcpy(d->text + d->text_len, text, len + 1);
    d->text_len += len;
    if (d->reason)
        (void)decode_reply(w, d, true, d->reason, d->out, d->produced, d->text); /* final either way */
    return d->reason != NULL;
}

int skv_requests_decode_round(struct skv_worker *w, struct skv_decode **ds, int n, bool *finished)
{
    /* a token enters the cache, or (its room refused) the decode ends with an error and the
     * session stays as it was before the token */
    struct skv_batch_seq seqs[SKV_ENGINE_MAX_BATCH];
    struct skv_forward_opts opts[SKV_ENGINE_MAX_BATCH];
    int rcs[SKV_ENGINE_MAX_BATCH];
    if (n > SKV_ENGINE_MAX_BATCH)
        n = SKV_ENGINE_MAX_BATCH;
    uint64_t held[SKV_ENGINE_MAX_BATCH], unique[SKV_ENGINE_MAX_BATCH];
    uint64_t taken[SKV_ENGINE_MAX_BATCH]; /* of unique, what its prepare took (in the pool's count now) */
    int32_t before[SKV_ENGINE_MAX_BATCH]; /* n_past before: a session whose token went in has more */
    double t0 = now_s();
    int nb = 0;
    for (int i = 0; i < n; i++) {
        struct skv_session *s = ds[i]->session;
        before[i] = s->cache->n_past;
        opts[i] = (struct skv_forward_opts){0};
        taken[i] = held[i] = unique[i] = 0;
        if ((rcs[i] = decode_pick(w, ds[i])))
            continue; /* no room for its log-probabilities: it ends, nothing changed */
        /* room for the token in the pool and the tenant's quota, counting what the round's
         * earlier sessions took: a session that cannot have it ends here, its cache unchanged */
        uint64_t round_held = 0, round_unique = 0;
        for (int j = 0; j < i; j++)
            if (!rcs[j]) { /* what j's prepare took is in the pool's count already */
                round_unique += unique[j] > taken[j] ? unique[j] - taken[j] : 0;
                round_held += strcmp(ds[j]->session->tenant, s->tenant) == 0 ? held[j] : 0;
            }
        taken[i] = 0;
        rcs[i] = reserve_rows(w, s, 1, forward_compacts(s), round_held, round_unique, &held[i], &unique[i]);
        /* this session's memory for the token first: out of memory fails it alone */
        uint64_t in_use0 = pool_in_use_bytes(w);
        if (!rcs[i])
            rcs[i] = skv_kv_cache_prepare(s->cache, 1);
        uint64_t in_use1 = pool_in_use_bytes(w);
        taken[i] = in_use1 > in_use0 ? in_use1 - in_use0 : 0;
        if (!rcs[i])
            rcs[i] = session_hook(s, 1, false, &opts[i]);
        if (!rcs[i]) /* the token's place in the history: its push after the forward cannot fail */
            rcs[i] = skv_session_reserve_tokens(s, 1);
        if (rcs[i])
            release_prepared(s->cache);
        if (!rcs[i])
            seqs[nb++] = (struct skv_batch_seq){s->cache, ds[i]->token, &opts[i], s->logits};
    }
    int rc = nb ? skv_engine_decode_batch(w->decode_engine, seqs, nb) : SKV_OK;
    for (int i = 0; i < n && rc; i++) /* a failed batch: the sessions whose token did not go in */
        if (!rcs[i] && ds[i]->session->cache->n_past == before[i])
            release_prepared(ds[i]->session->cache);
    w->metrics.decode_seconds += now_s() - t0;
    w->metrics.decode_batches += nb > 0;
    /* when the batch failed, a session whose token went in (another decode group) goes on */
    for (int i = 0; i < n; i++) {
        if (!rcs[i])
            note_cut_failures(w, ds[i]->session);
        finished[i] = decode_done(w, ds[i], rcs[i] ? rcs[i] : ds[i]->session->cache->n_past > before[i] ? SKV_OK : rc);
    }
    return n;
}

void skv_requests_decode_cancel(struct skv_worker *w, struct skv_decode *d)
{
    decode_end_early(w, d, "cancelled"); /* text held back for the stop sequences is the decode's too */
}

/* CANCEL: the session's running decode ends here, between two of its rounds (this request runs
 * between rounds), with its own final reply first; the session keeps its tokens. A CANCEL run
 * past its deadline (it waited behind other work) ends only a decode its own connection
 * started: that is the one its client gave up on, and another connection's DECODE of the
 * session may have started since. */
static void handle_cancel(struct skv_worker *w, struct skv_job *job)
{
    struct skv_session *s = NULL;
    int rc = find_session_in(w, job, job->req->cancel->session_id, job->sock == 1, true, &s);
    if (rc) {
        fail_rc(w, job, rc);
        return;
    }
    Snapkv__Reply rep;
    Snapkv__CancelReply cr = SNAPKV__CANCEL_REPLY__INIT;
    for (struct skv_decode **pp = &w->decodes; *pp; pp = &(*pp)->next) {
        struct skv_decode *d = *pp;
        /* a late one, or one that asks (own), ends only its sender's decode: the one it meant
         * may have ended, another client's begun on the session since */
        if (d->session != s || ((job->late || job->req->cancel->own) && !skv_job_same_sender(d->job, job)))
            continue;
        *pp = d->next;
        cr.cancelled = true;
        cr.n_generated = d->produced;
        skv_requests_decode_cancel(w, d);
        skv_requests_decode_end(w, d);
        w->metrics.decodes_cancelled++;
        break;
    }
    reply_init(&rep, job);
    rep.result_case = SNAPKV__REPLY__RESULT_CANCEL;
    rep.cancel = &cr;
    skv_worker_reply(w, job, &rep);
}

/* TOKENIZE: the ids a PREFILL of the text runs (chat: one user turn of the template), or with
 * append an APPEND's (no BOS; chat: its markup parsed), within a PREFILL's limit. */
static void handle_tokenize(struct skv_worker *w, struct skv_job *job)
{
    const Snapkv__TokenizeRequest *q = job->req->tokenize;
    int32_t *ids = NULL;
    int n = 0;
    int rc = *q->text ? request_tokens(w, NULL, 0, q->text, q->chat && !q->append, q->chat && q->append, !q->append,
                                       (int)w->cfg->max_prompt_tokens, &ids, &n)
                      : skv_errorf(SKV_E_INVAL, "the text to tokenize is empty");
    if (rc) {
        fail_rc(w, job, rc);
        return;
    }
    Snapkv__Reply rep;
    Snapkv__TokenizeReply tr = SNAPKV__TOKENIZE_REPLY__INIT;
    tr.n_tokens = (size_t)n;
    tr.tokens = (uint32_t *)ids; /* ids in [0, n_vocab): the same bits */
    reply_init(&rep, job);
    rep.result_case = SNAPKV__REPLY__RESULT_TOKENIZE;
    rep.tokenize = &tr;
    skv_worker_reply(w, job, &rep);
    free(ids);
}

/* DETOKENIZE: the ids' bytes (control tokens' text unless skip_special; ids outside the
 * tokenizer's vocabulary none), made well-formed UTF-8 (skv_utf8_fix: each ill-formed part and
 * each NUL becomes U+FFFD). */
static void handle_detokenize(struct skv_worker *w, struct skv_job *job)
{
    const Snapkv__DetokenizeRequest *q = job->req->detokenize;
    int rc = w->m->tok ? SKV_OK : skv_errorf(SKV_E_UNSUPPORTED, "the model has no tokenizer");
    for (size_t i = 0; i < q->n_tokens && !rc; i++)
        if (q->tokens[i] >= (uint32_t)w->m->cfg.n_vocab)
            rc = skv_errorf(SKV_E_INVAL, "token %u at index %zu is outside the vocabulary [0, %d)", q->tokens[i], i,
                            w->m->cfg.n_vocab);
    /* ids the model has rows for and the tokenizer no text (a padded embedding) give none, as
     * Hugging Face's decode skips unknown ids; the ids are below n_vocab, so int32 as they are
     * (admission kept their count within an int) */
    char *raw = NULL, *text = NULL;
    size_t len = 0;
    if (!rc)
        rc = skv_tokenizer_decode_bytes(w->m->tok, (const int32_t *)q->tokens, (int)q->n_tokens, q->skip_special,
                                        &raw, &len);
    if (!rc && !(text = skv_utf8_fix(raw, len, NULL)))
        rc = skv_errorf(SKV_E_NOMEM, "no memory for the text");
    free(raw);
    if (rc) {
        fail_rc(w, job, rc);
        return;
    }
    Snapkv__Reply rep;
    Snapkv__DetokenizeReply dr = SNAPKV__DETOKENIZE_REPLY__INIT;
    dr.text = text;
    reply_init(&rep, job);
    rep.result_case = SNAPKV__REPLY__RESULT_DETOKENIZE;
    rep.detokenize = &dr;
    skv_worker_reply(w, job, &rep);
    free(text);
}

/* ---- admin ------------------------------------------------------------------------------------ */

/* A listing's spec: the keys that differ from the defaults (libsnapkv's summary field holds 64
 * bytes of it, snapkv_session_list_spec all); INSPECT's spec is the whole canonical one. */
#define INFO_POLICY_BYTES 256 /* a short spec fits (a session's spec is at most 255) */

struct info_arena {
    Snapkv__SessionInfo *infos;
    Snapkv__SessionInfo **ptrs;
    char (*policies)[INFO_POLICY_BYTES];
    int n, cap;
};

/* policy: INFO_POLICY_BYTES for the short spec (the canonical one when it does not fit). */
static void fill_info(Snapkv__SessionInfo *in, struct skv_session *s, char *policy)
{
    snapkv__session_info__init(in);
    in->session_id = (ProtobufCBinaryData){SKV_SESSION_ID_BYTES, s->id};
    in->tenant = s->tenant;
    in->owner = s->owner;
    in->n_tokens = (uint32_t)s->cache->n_past;
    uint32_t kept = 0;
    for (int l = 0; l < s->cache->n_layers; l++) {
        int mx = 0;
        for (int h = 0; h < s->cache->n_kv_heads; h++)
            mx = skv_kv_cache_head(s->cache, l, h)->len > mx ? skv_kv_cache_head(s->cache, l, h)->len : mx;
        kept += (uint32_t)mx;
    }
    in->kept_tokens = kept;
    in->bytes = s->bytes;
    in->shared_bytes = skv_session_shared_bytes(s);
    struct skv_compress_spec spec;
    bool short_ok = skv_compress_spec_parse_saved(s->spec, &spec) == SKV_OK &&
                    skv_compress_spec_format_short(&spec, policy, INFO_POLICY_BYTES) == SKV_OK;
    in->policy = short_ok ? policy : s->spec;
    in->created_unix_ms = skv_unix_ms(s->created_ms);
    in->last_used_unix_ms = skv_unix_ms(s->last_used_ms);
    in->pinned = s->pinned;
    in->lease_seconds = s->lease_seconds;
}

struct list_ctx {
    struct info_arena *a;
    const char *tenant;
};

static bool list_visit(void *user, struct skv_session *s)
{
    struct list_ctx *ctx = user;
    struct info_arena *a = ctx->a;
    if (ctx->tenant && *ctx->tenant && strcmp(ctx->tenant, s->tenant) != 0)
        return false;
    if (a->n < a->cap) {
        fill_info(&a->infos[a->n], s, a->policies[a->n]);
        a->n++;
    }
    return false;
}

/* The kept prefixes of `tenant` (NULL or "": all) as LIST shows them, in one allocation. */
struct kept_list {
    Snapkv__KeptPrefixInfo **ptrs;
    Snapkv__KeptPrefixInfo infos[];
};

static struct kept_list *list_kept(struct skv_worker *w, const char *tenant, size_t *n_out)
{
    size_t n = (size_t)w->prefix.n;
    struct kept_list *k = malloc(sizeof *k + (n ? n : 1) * (sizeof *k->infos + sizeof *k->ptrs));
    *n_out = 0;
    if (!k)
        return NULL;
    k->ptrs = (Snapkv__KeptPrefixInfo **)(k->infos + (n ? n : 1));
    for (const struct skv_prefix_entry *e = w->prefix.head; e; e = e->next) {
        if (tenant && *tenant && strcmp(e->tenant, tenant) != 0)
            continue;
        Snapkv__KeptPrefixInfo *x = &k->infos[*n_out];
        snapkv__kept_prefix_info__init(x);
        x->id = (ProtobufCBinaryData){sizeof e->id, (uint8_t *)e->id};
        x->tenant = (char *)e->tenant;
        x->n_tokens = (uint32_t)e->n_rows;
        x->bytes = e->bytes;
        x->alone_bytes = skv_prefix_entry_alone_bytes(&w->prefix, e);
        x->last_used_unix_ms = skv_unix_ms(e->last_used_ms);
        k->ptrs[(*n_out)++] = x;
    }
    return k;
}

static void handle_list(struct skv_worker *w, struct skv_job *job)
{
    struct kept_list *kept = NULL;
    struct skv_session_stats st;
    skv_session_stats(w->sessions, &st);
    struct info_arena a = {.cap = st.n_sessions};
    a.infos = calloc((size_t)(a.cap ? a.cap : 1), sizeof *a.infos);
    a.ptrs = calloc((size_t)(a.cap ? a.cap : 1), sizeof *a.ptrs);
    a.policies = calloc((size_t)(a.cap ? a.cap : 1), sizeof *a.policies);
    if (!a.infos || !a.ptrs || !a.policies) {
        skv_requests_fail(w, job, SKV_E_NOMEM, NULL);
        goto out;
    }
    struct list_ctx ctx = {&a, job->req->list->tenant};
    if (!job->req->list->kept_prefixes)
        skv_session_foreach(w->sessions, list_visit, &ctx);
    for (int i = 0; i < a.n; i++)
        a.ptrs[i] = &a.infos[i];
    Snapkv__Reply rep;
    Snapkv__ListReply lr = SNAPKV__LIST_REPLY__INIT;
    reply_init(&rep, job);
    lr.n_sessions = (size_t)a.n;
    lr.sessions = a.ptrs;
    if (job->req->list->kept_prefixes && (kept = list_kept(w, job->req->list->tenant, &lr.n_kept)) == NULL &&
        w->prefix.n) {
        skv_requests_fail(w, job, SKV_E_NOMEM, NULL);
        goto out;
    }
    lr.kept = kept ? kept->ptrs : NULL;
    rep.result_case = SNAPKV__REPLY__RESULT_LIST;
    rep.list = &lr;
    skv_worker_reply(w, job, &rep);
out:
    free(kept);
    free(a.infos);
    free(a.ptrs);
    free(a.policies);
}

static void handle_inspect(struct skv_worker *w, struct skv_job *job)
{
    const Snapkv__InspectRequest *q = job->req->inspect;
    struct skv_session *s = NULL;
    int rc = find_session(w, job, q->session_id, true, &s);
    if (rc) {
        fail_rc(w, job, rc);
        return;
    }
    Snapkv__Reply rep;
    Snapkv__InspectReply ir = SNAPKV__INSPECT_REPLY__INIT;
    Snapkv__SessionInfo info;
    struct kept_arena arena = {0};
    uint32_t *positions = NULL;
    char policy[INFO_POLICY_BYTES];
    fill_info(&info, s, policy);
    reply_init(&rep, job);
    ir.info = &info;
    ir.spec = s->spec;
    if ((rc = fill_kept(s->cache, &arena, true, &ir.n_kept, &ir.kept))) {
        fail_rc(w, job, rc);
        goto out;
    }
    if (q->with_positions) {
        size_t n = 0;
        for (int i = 0; i < s->cache->n_layers * s->cache->n_kv_heads; i++)
            n += (size_t)s->cache->heads[i].len;
        positions = malloc((n ? n : 1) * sizeof *positions);
        if (!positions) {
            skv_requests_fail(w, job, SKV_E_NOMEM, NULL);
            goto out;
        }
        size_t at = 0;
        for (int i = 0; i < s->cache->n_layers * s->cache->n_kv_heads; i++) {
            for (int j = 0; j < s->cache->heads[i].len; j++)
                positions[at++] = (uint32_t)s->cache->heads[i].pos[j];
            if (s->cache->unordered) /* in position order, as the rows of a SAVE or an EXPORT */
                qsort(positions + at - s->cache->heads[i].len, (size_t)s->cache->heads[i].len, sizeof *positions,
                      by_u32);
        }
        ir.n_positions = n;
        ir.positions = positions;
    }
    const float *sim = s->comp ? skv_compressor_similarity(s->comp) : NULL;
    if (sim) {
        ir.n_layer_similarity = (size_t)s->cache->n_layers;
        ir.layer_similarity = (float *)sim;
    }
    uint64_t *hashes = NULL;
    ir.block_size = SKV_EVENT_BLOCK_TOKENS;
    ir.n_block_hashes = skv_worker_block_hashes(s, &hashes);
    ir.block_hashes = hashes;
    rep.result_case = SNAPKV__REPLY__RESULT_INSPECT;
    rep.inspect = &ir;
    skv_worker_reply(w, job, &rep);
    free(hashes);
out:
    free_kept(&arena);
    free(positions);
}

struct evict_ctx {
    const char *tenant;
    bool all;
    uint32_t count;
};

static bool evict_visit(void *user, struct skv_session *s)
{
    struct evict_ctx *e = user;
    if (s->pinned || s->busy)
        return false;
    if (!e->all && strcmp(s->tenant, e->tenant) != 0)
        return false;
    e->count++;
    return true;
}

static int store_evict(struct skv_worker *w, const char *tenant, const uint8_t *id, uint32_t *count);

static void handle_evict(struct skv_worker *w, struct skv_job *job)
{
    const Snapkv__EvictRequest *q = job->req->evict;
    struct evict_ctx e = {.tenant = q->tenant, .all = q->all_unpinned};
    struct skv_session_stats before, after; /* freed: pool bytes, so blocks forks still hold do not count */
    skv_session_stats(w->sessions, &before);
    uint32_t stored = 0; /* sessions this daemon spilled, deleted from the store */
    if (q->session_id.len) {
        struct skv_session *s = NULL;
        int rc = find_session(w, job, q->session_id, true, &s);
        if (!rc && s->busy)
            rc = skv_errorf(SKV_E_BUSY, "the session is decoding");
        bool whole_id = q->session_id.len == SKV_SESSION_ID_BYTES;
        if (rc == SKV_E_NOT_FOUND && whole_id && skv_prefix_cache_drop_id(&w->prefix, q->session_id.data)) {
            rc = SKV_OK; /* a kept prefix's id */
        } else if (rc == SKV_E_NOT_FOUND && whole_id && w->store) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", skv_error_msg()); /* (the answer when the store has none) */
            rc = store_evict(w, NULL, q->session_id.data, &stored);
            if (!rc && !stored)
                rc = skv_errorf(SKV_E_NOT_FOUND, "%s", msg);
        } else if (!rc) {
            skv_session_destroy(w->sessions, s);
        }
        if (rc) {
            fail_rc(w, job, rc);
            return;
        }
        e.count = stored ? 0 : 1;
    } else if (q->all_unpinned || (q->tenant && *q->tenant)) {
        int rc = q->all_unpinned ? SKV_OK : skv_session_check_tenant(q->tenant);
        if (rc) { /* (a name of other characters would be a pattern of the store's SCAN: '*') */
            fail_rc(w, job, rc);
            return;
        }
        skv_session_foreach(w->sessions, evict_visit, &e);
        skv_prefix_cache_clear(&w->prefix, q->all_unpinned ? NULL : q->tenant); /* counted in bytes_freed */
        rc = w->store ? store_evict(w, q->all_unpinned ? NULL : q->tenant, NULL, &stored) : SKV_OK;
        if (rc) { /* what went is gone: the admin learns that too, and what is left */
            char why[512];
            snprintf(why, sizeof why, "%s", skv_error_msg());
            skv_session_stats(w->sessions, &after);
            skv_log(SKV_LOG_WARN, "evict: %s", why);
            char msg[700];
            snprintf(msg, sizeof msg, "%u session(s) evicted here (%llu bytes freed); %s", e.count,
                     (unsigned long long)(before.bytes_used - after.bytes_used), why);
            skv_requests_fail(w, job, rc, msg);
            return;
        }
    } else {
        skv_requests_fail(w, job, SKV_E_INVAL, "EVICT needs a session id, a tenant or all_unpinned");
        return;
    }
    Snapkv__Reply rep;
    Snapkv__EvictReply er = SNAPKV__EVICT_REPLY__INIT;
    reply_init(&rep, job);
    skv_session_stats(w->sessions, &after);
    er.evicted = e.count + stored;
    if (stored)
        skv_log(SKV_LOG_INFO, "evict: %u session(s) deleted from the store", stored);
    er.bytes_freed = before.bytes_used - after.bytes_used;
    rep.result_case = SNAPKV__REPLY__RESULT_EVICT;
    rep.evict = &er;
    skv_worker_reply(w, job, &rep);
}

static void handle_pin(struct skv_worker *w, struct skv_job *job)
{
    struct skv_session *s = NULL;
    int rc = find_session(w, job, job->req->pin->session_id, true, &s);
    if (rc) {
        fail_rc(w, job, rc);
        return;
    }
    if (s->pinned && !job->req->pin->pin) /* unpinned: a whole lease from now, not from its last use */
        s->last_used_ms = skv_now_ms();
    s->pinned = job->req->pin->pin;
    Snapkv__Reply rep;
    Snapkv__PinReply pr = SNAPKV__PIN_REPLY__INIT;
    reply_init(&rep, job);
    rep.result_case = SNAPKV__REPLY__RESULT_PIN;
    rep.pin = &pr;
    skv_worker_reply(w, job, &rep);
}

/* Saved sessions: "<state-dir>/<name>.skv" = header, tokens, the compressor's state (int32
 * length, then skv_compressor_state_write's bytes; length 0 without a compressor), the
 * next-token logits (int32 count, n_vocab or 0, then the floats), the start of a character
 * the last DECODE's text cut (int32 count < 8, then the bytes), per head (len, positions,
 * scores, K, V), then a BLAKE2b checksum of everything before it. Version 2 (no logits: the
 * loaded session APPENDs before DECODE) and version 1 (no compressor state, no scores: it
 * decodes with the full cache) still load. A persist save writes version 4: per head the
 * block store indices of its full blocks (uint32 each) stand for their K and V rows, and only
 * the rows past them follow; it loads only with that store (kv_store.h). Version 5 (what a
 * persist save writes now) is version 4 with each head's positions as runs of consecutive ones
 * when that is shorter (int32 count of runs, then start and length per run; -1: the list) and
 * its scores behind a flag (int32 0: all zero; 1: the list): a session that changed is written
 * again at each checkpoint, and a full-cache head's positions are one run and its scores zero.
 * Version 6 (what a persist save writes now) is version 5 with an int32 count of store indices
 * before each head's: its full blocks, and its partly filled last block too when other sessions
 * hold that block (forks that have not written it), so that a restore shares it again. */
#define SAVE_MAGIC "SKVSESS1"
/* After the checksum of a SAVE file or a stored value (not of a persist block-store file),
 * what prefix reuse may take of its rows: the session's computed_rows and what computed them
 * (skv_requests_rows_id). A daemon from before stops reading at the checksum, so the trailer costs it
 * nothing; one without the trailer (older files) serves no prefix. */
#define ROWS_MAGIC "SKVROWS1"
#define ROWS_ID_BYTES 16
struct save_rows {
    char magic[8];
    int32_t computed_rows;
    uint32_t zero;
    unsigned char rows_id[ROWS_ID_BYTES];
    unsigned char sum[16]; /* BLAKE2b-128 of the file's checksum, then the fields above */
};
_Static_assert(sizeof(struct save_rows) == 48, "the rows trailer is 48 bytes on disk");
#define SAVE_VERSION 3
#define SAVE_VERSION_STORE 4
#define SAVE_VERSION_RUNS 5
#define SAVE_VERSION_PARTIAL 6

struct save_header {
    char magic[8];
    uint32_t version;
    uint32_t n_layers, n_kv_heads, head_dim;
    int32_t n_past, prompt_len, n_tokens;
    char fingerprint[65];
    char spec[256];
    char pad[3];
};

/* Hashes the file at path into h; false when it cannot be read whole. */
static bool hash_file(crypto_generichash_state *h, const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return false;
    unsigned char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0)
        crypto_generichash_update(h, buf, n);
    bool ok = !ferror(f);
    fclose(f);
    return ok;
}

/* One string into h, its length first (no two lists hash alike). */
static void hash_str(crypto_generichash_state *h, const char *s)
{
    uint32_t n = (uint32_t)strlen(s);
    crypto_generichash_update(h, (const unsigned char *)&n, sizeof n);
    crypto_generichash_update(h, (const unsigned char *)s, n);
}

/* dl_iterate_phdr's visit: each shared object's path, size and modification time into h (an
 * upgraded OpenBLAS or libm is another file; the same package on another host is the same). */
static int hash_object(struct dl_phdr_info *info, size_t size, void *user)
{
    (void)size;
    struct stat st;
    if (info->dlpi_name && *info->dlpi_name && stat(info->dlpi_name, &st) == 0) {
        crypto_generichash_state *h = user;
        int64_t meta[3] = {(int64_t)st.st_size, (int64_t)st.st_mtim.tv_sec, (int64_t)st.st_mtim.tv_nsec};
        hash_str(h, info->dlpi_name);
        crypto_generichash_update(h, (const unsigned char *)meta, sizeof meta);
    }
    return 0;
}

/* What computes this daemon's rows, as far as their bits go: its executable's bytes (the
 * engine's kernels are linked in), the shared objects it runs with (OpenBLAS: path, size,
 * time), the CPU's model and features (which kernels OpenBLAS and the CPU backend pick: x86's
 * "model name" and "flags", ARM's "CPU implementer", "CPU part" and "Features"), the model, the
 * KV type and the block size. A session saved by a daemon of the same rows_id holds the rows
 * this one would compute for its tokens, so they may serve prefix reuse. Zero (matching
 * nothing) on a backend other than the CPU (cuBLAS picks its kernels by shape and device: bits
 * not promised) and when the executable cannot be read. Worked out once, when the worker starts
 * (skv_requests_rows_id), so no request waits for the executable's hash. */
const unsigned char *skv_requests_rows_id(struct skv_worker *w)
{
    if (w->rows_id_known)
        return w->rows_id;
    w->rows_id_known = true;
    memset(w->rows_id, 0, sizeof w->rows_id);
    if (strcmp(w->m->be->name, "cpu") != 0)
        return w->rows_id;
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, sizeof w->rows_id);
    bool ok = hash_file(&h, "/proc/self/exe");
    dl_iterate_phdr(hash_object, &h);
    hash_str(&h, PACKAGE_VERSION);
    FILE *ci = fopen("/proc/cpuinfo", "r");
    static const char *const keys[] = {"model name", "flags", "CPU implementer", "CPU part", "Features"};
    char line[8192];
    /* the first CPU's lines (each key once: the next processor repeats them) */
    for (unsigned seen = 0; ci && fgets(line, sizeof line, ci);)
        for (unsigned k = 0; k < sizeof keys / sizeof keys[0]; k++)
            if (!(seen & 1u << k) && strncmp(line, keys[k], strlen(keys[k])) == 0) {
                hash_str(&h, line);
                seen |= 1u << k;
            }
    if (ci)
        fclose(ci);
    hash_str(&h, w->m->fingerprint);
    hash_str(&h, w->cfg->kv_type ? w->cfg->kv_type : "f32");
    int64_t br = w->cfg->kv_block_tokens;
    crypto_generichash_update(&h, (const unsigned char *)&br, sizeof br);
    crypto_generichash_final(&h, w->rows_id, sizeof w->rows_id);
    if (!ok)
        memset(w->rows_id, 0, sizeof w->rows_id);
    return w->rows_id;
}

/* skv_requests_rows_id in hex (what a persist manifest records). */
static void rows_id_hex(struct skv_worker *w, char out[2 * ROWS_ID_BYTES + 1])
{
    sodium_bin2hex(out, 2 * ROWS_ID_BYTES + 1, skv_requests_rows_id(w), ROWS_ID_BYTES);
}

/* The trailer's sum: over the file's checksum and the trailer before its own sum. */
static void rows_sum(const unsigned char file_sum[32], const struct save_rows *t, unsigned char out[16])
{
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, 16);
    crypto_generichash_update(&h, file_sum, 32);
    crypto_generichash_update(&h, (const unsigned char *)t, offsetof(struct save_rows, sum));
    crypto_generichash_final(&h, out, 16);
}

static int save_path(struct skv_worker *w, const char *name, char *out, size_t cap)
{
    size_t n = strlen(name);
    if (n == 0 || n > 64 || name[0] == '.')
        return skv_errorf(SKV_E_INVAL, "save names are 1..64 characters and do not start with '.'");
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)name[i]) && !strchr("._-", name[i]))
            return skv_errorf(SKV_E_INVAL, "save name '%s': only letters, digits and . _ -", name);
    if ((size_t)snprintf(out, cap, "%s/%s.skv", w->cfg->state_dir, name) >= cap)
        return skv_errorf(SKV_E_INVAL, "state directory path too long");
    return SKV_OK;
}

static int write_all(FILE *f, crypto_generichash_state *h, const void *p, size_t n)
{
    if (n == 0) /* an imported session's token history: nothing, and no array */
        return SKV_OK;
    if (h) /* (NULL: session_write counts) */
        crypto_generichash_update(h, p, n);
    return fwrite(p, 1, n, f) == n ? SKV_OK : skv_errorf(SKV_E_IO, "write: %s", strerror(errno));
}

/* Renames a written and fsynced tmp over path, then fsyncs dir so the rename survives a crash
 * (the file is complete either way; a failing directory fsync is not an error). */
static int rename_durable(const char *tmp, const char *path, const char *dir)
{
    if (rename(tmp, path) != 0)
        return skv_errorf(SKV_E_IO, "rename %s: %s", path, strerror(errno));
    int dfd = open(dir, O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    return SKV_OK;
}

/* A head's positions and scores: the lists, or from version 5 the positions as runs when
 * that is shorter and the scores behind a flag (see SAVE_VERSION_RUNS). */
static int write_rows_meta(FILE *f, crypto_generichash_state *h, const struct skv_kv_head *kh, uint32_t version)
{
    int32_t len = kh->len, runs = 0, none = -1, zero = 0, some = 1;
    if (version < SAVE_VERSION_RUNS) {
        int rc = write_all(f, h, kh->pos, (size_t)len * 4);
        return rc ? rc : write_all(f, h, kh->score, (size_t)len * sizeof *kh->score);
    }
    for (int j = 0; j < len; j++)
        runs += j == 0 || kh->pos[j] != kh->pos[j - 1] + 1;
    int rc = SKV_OK;
    if (2 * runs >= len) {
        if (!(rc = write_all(f, h, &none, sizeof none)))
            rc = write_all(f, h, kh->pos, (size_t)len * 4);
    } else if (!(rc = write_all(f, h, &runs, sizeof runs))) {
        for (int j = 0; j < len && !rc;) {
            int32_t run[2] = {kh->pos[j], 1};
            while (j + run[1] < len && kh->pos[j + run[1]] == run[0] + run[1])
                run[1]++;
            rc = write_all(f, h, run, sizeof run);
            j += run[1];
        }
    }
    bool zeros = true;
    for (int j = 0; j < len && zeros; j++)
        zeros = kh->score[j] == 0.0f && !signbit(kh->score[j]);
    if (!rc)
        rc = write_all(f, h, zeros ? &zero : &some, sizeof zero);
    if (!rc && !zeros)
        rc = write_all(f, h, kh->score, (size_t)len * sizeof *kh->score);
    return rc;
}

/* Writes session s to f, and the checksum of what it wrote after it (also into sum). With sum
 * NULL it counts: no checksum is computed and no row read, f is seeked over the rows and over
 * the checksum (a stream that counts, as the spill's). With a
 * block store, full blocks and a shared partly filled last block go to the store (once however
 * many sessions hold them, and once across saves: blocks the store holds already are not read
 * out of the cache) and f names them (version 6). */
static int session_write(struct skv_worker *w, struct skv_session *s, FILE *f, struct skv_kv_store *store,
                         unsigned char sum[32])
{
    int rc = SKV_OK;
    crypto_generichash_state h, *hp = sum ? &h : NULL; /* no sum: a count of the bytes */
    if (hp)
        crypto_generichash_init(&h, NULL, 0, 32);
    struct save_header hd = {.version = store ? SAVE_VERSION_PARTIAL : SAVE_VERSION};
    memcpy(hd.magic, SAVE_MAGIC, 8);
    hd.n_layers = (uint32_t)s->cache->n_layers;
    hd.n_kv_heads = (uint32_t)s->cache->n_kv_heads;
    hd.head_dim = (uint32_t)s->cache->head_dim;
    hd.n_past = s->cache->n_past;
    hd.prompt_len = s->prompt_len;
    hd.n_tokens = s->n_tokens;
    memcpy(hd.fingerprint, w->m->fingerprint, sizeof hd.fingerprint);
    /* a session without a compressor keeps every row, whatever spec it shows (one loaded from a
     * version-1 file shows the spec it was saved with): it is saved as what it does */
    snprintf(hd.spec, sizeof hd.spec, "%s", s->comp ? s->spec : "policy=full");
    rc = write_all(f, hp, &hd, sizeof hd);
    if (!rc)
        rc = write_all(f, hp, s->tokens, (size_t)s->n_tokens * sizeof *s->tokens);
    size_t state_size = s->comp ? skv_compressor_state_size(s->comp, s->cache->n_past) : 0;
    int32_t state_len = (int32_t)state_size;
    void *state = NULL;
    if (!rc && state_size > INT32_MAX)
        rc = skv_errorf(SKV_E_LIMIT, "the compressor's state (%zu bytes) is too large to save", state_size);
    if (!rc && state_len && !(state = malloc((size_t)state_len)))
        rc = SKV_E_NOMEM;
    if (!rc && state)
        rc = skv_compressor_state_write(s->comp, s->cache->n_past, state);
    if (!rc)
        rc = write_all(f, hp, &state_len, sizeof state_len);
    if (!rc && state_len)
        rc = write_all(f, hp, state, (size_t)state_len);
    free(state);
    int32_t n_logits = s->logits ? w->m->cfg.n_vocab : 0;
    if (!rc)
        rc = write_all(f, hp, &n_logits, sizeof n_logits);
    if (!rc && n_logits)
        rc = write_all(f, hp, s->logits, (size_t)n_logits * sizeof *s->logits);
    char pending[sizeof s->text_pending];
    int32_t n_pending = (int32_t)text_pending(w, s, pending);
    if (!rc)
        rc = write_all(f, hp, &n_pending, sizeof n_pending);
    if (!rc && n_pending)
        rc = write_all(f, hp, pending, (size_t)n_pending);
    size_t dim = (size_t)s->cache->head_dim;
    float *rows = NULL;   /* one head's K rows, then its V rows, from row r0 on, read out of its blocks */
    uint32_t *refs = NULL; /* the store indices of its blocks there */
    /* a head whose rows are out of position order (StreamingLLM's, window's and H2O's decode
     * move their newest rows into the places of those they drop) is written in position order,
     * as every reader wants it, all of its rows in the file (no block-store references): its
     * positions and scores through `sorted`, its rows through `perm` */
    struct skv_kv_head sorted = {0};
    int32_t *perm = NULL;
    float *permuted = NULL;
    int H = s->cache->n_kv_heads, br = s->cache->block_rows;
    for (int i = 0; !rc && i < s->cache->n_layers * H; i++) {
        skv_worker_beat(w); /* a large session written slowly (a SAVE, a spill to the store) is alive */
        const struct skv_kv_head *kh = &s->cache->heads[i];
        int32_t len = kh->len;
        bool in_order = !s->cache->unordered || skv_kv_head_in_order(kh);
        if (!in_order) {
            int32_t *p = realloc(perm, (size_t)len * sizeof *perm);
            int32_t *sp = p ? realloc(sorted.pos, (size_t)len * sizeof *sp) : NULL;
            float *ss = sp ? realloc(sorted.score, (size_t)len * sizeof *ss) : NULL;
            perm = p ? p : perm;
            sorted.pos = sp ? sp : sorted.pos;
            sorted.score = ss ? ss : sorted.score;
            if (!ss) {
                rc = SKV_E_NOMEM;
                break;
            }
            skv_kv_head_argsort(kh, perm);
            for (int j = 0; j < len; j++) {
                sorted.pos[j] = kh->pos[perm[j]];
                sorted.score[j] = kh->score[perm[j]];
            }
            sorted.len = len;
        }
        int n_full = store && in_order ? len / br : 0, tail = len - n_full * br, known = 0;
        /* a partly filled last block goes to the store when other sessions hold it too (one of
         * this session's own is written again at each save it changed by: the file holds it) */
        int32_t n_refs = n_full + (store && in_order && tail &&
                                   skv_kv_pool_is_shared(s->cache->pool, kh->blk[n_full]));
        int row0 = n_refs * br < len ? n_refs * br : len;
        uint32_t *more_refs = realloc(refs, (size_t)(n_refs ? n_refs : 1) * sizeof *refs);
        if (!more_refs) {
            rc = SKV_E_NOMEM;
            break;
        }
        refs = more_refs;
        while (known < n_refs && skv_kv_store_find(store, kh->blk[known], known < n_full ? br : tail, &refs[known]))
            known++; /* written by an earlier save, unchanged since */
        int r0 = known * br < len ? known * br : len, n = len - r0;
        /* (a count reads no row) */
        float *more = hp ? realloc(rows, 2 * (size_t)(n ? n : 1) * dim * sizeof *rows) : NULL;
        if (hp && !more) {
            rc = SKV_E_NOMEM;
            break;
        }
        rows = more;
        float *k = rows, *v = rows ? rows + (size_t)n * dim : NULL;
        if ((rc = write_all(f, hp, &len, sizeof len)) ||
            (rc = write_rows_meta(f, hp, in_order ? kh : &sorted, hd.version)) ||
            (hp && (rc = skv_kv_cache_read_rows(s->cache, i / H, i % H, 0, r0, n, k))) ||
            (hp && (rc = skv_kv_cache_read_rows(s->cache, i / H, i % H, 1, r0, n, v))))
            break;
        if (hp && !in_order) { /* (r0 = 0, n = len: every row) */
            float *p = realloc(permuted, 2 * (size_t)(n ? n : 1) * dim * sizeof *p);
            if (!p) {
                rc = SKV_E_NOMEM;
                break;
            }
            permuted = p;
            for (int j = 0; j < n; j++) {
                memcpy(p + (size_t)j * dim, k + (size_t)perm[j] * dim, dim * sizeof *p);
                memcpy(p + (size_t)(n + j) * dim, v + (size_t)perm[j] * dim, dim * sizeof *p);
            }
            memcpy(rows, p, 2 * (size_t)n * dim * sizeof *p);
        }
        for (int b = known; b < n_refs && !rc; b++)
            rc = skv_kv_store_put(store, kh->blk[b], b < n_full ? br : tail, k + (size_t)(b - known) * br * dim,
                                  v + (size_t)(b - known) * br * dim, &refs[b]);
        if (!rc && store)
            rc = write_all(f, hp, &n_refs, sizeof n_refs);
        if (!rc)
            rc = write_all(f, hp, refs, (size_t)n_refs * sizeof *refs);
        size_t bytes = (size_t)(len - row0) * dim * sizeof *rows;
        if (!rc && !hp) /* a count */
            rc = fseeko(f, (off_t)(2 * bytes), SEEK_CUR) == 0 ? SKV_OK : SKV_E_IO;
        if (!rc && hp)
            rc = write_all(f, hp, k + (size_t)(row0 - r0) * dim, bytes);
        if (!rc && hp)
            rc = write_all(f, hp, v + (size_t)(row0 - r0) * dim, bytes);
    }
    free(rows);
    free(refs);
    free(perm);
    free(permuted);
    free(sorted.pos);
    free(sorted.score);
    const off_t trailer = store ? 0 : (off_t)sizeof(struct save_rows);
    if (!hp)
        return rc ? rc : fseeko(f, 32 + trailer, SEEK_CUR) == 0 ? SKV_OK : SKV_E_IO;
    crypto_generichash_final(&h, sum, 32);
    if (!rc && fwrite(sum, 1, 32, f) != 32)
        rc = skv_errorf(SKV_E_IO, "write: %s", strerror(errno));
    if (!rc && trailer) { /* what prefix reuse may take of its rows */
        int32_t served = s->computed_rows < s->n_tokens ? s->computed_rows : s->n_tokens;
        served = served < s->cache->n_past ? served : s->cache->n_past;
        struct save_rows t = {.computed_rows = served > 0 ? served : 0};
        memcpy(t.magic, ROWS_MAGIC, sizeof t.magic);
        memcpy(t.rows_id, skv_requests_rows_id(w), sizeof t.rows_id);
        rows_sum(sum, &t, t.sum);
        if (fwrite(&t, 1, sizeof t, f) != sizeof t)
            rc = skv_errorf(SKV_E_IO, "write: %s", strerror(errno));
    }
    return rc;
}

/* Writes `n` bytes, or session s when p is NULL, to `path` through path.tmp, fsynced, renamed,
 * and the rename made durable in `dir`; *bytes: the file's size. shared: a directory other
 * daemons may write too (SAVE's: the state directory's lock is persist's), where the
 * temporary file is path.XXXXXX.tmp, a name of its own, so that two SAVEs of one name do not
 * write into one file and rename it, their bytes mixed, over the good one (one a crash left is
 * removed an hour on by a later start's first SAVE, sweep_saves). */
static int file_write(struct skv_worker *w, struct skv_session *s, const void *p, size_t n, const char *dir,
                      const char *path, bool shared, long *bytes)
{
    char tmp[1300];
    int len = shared ? snprintf(tmp, sizeof tmp, "%s.XXXXXX.tmp", path) : snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if ((size_t)len >= sizeof tmp)
        return skv_errorf(SKV_E_INVAL, "state directory path too long");
    /* the daemon user's alone: the state directory is the service group's (every client's), and
     * a saved session holds a tenant's KV and token history. A shared one's name is made unique
     * (O_EXCL): a pid is not, in containers (each daemon pid 1) */
    int fd = shared ? mkostemps(tmp, 4, O_CLOEXEC)
                    : open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    FILE *f = fd < 0 || fchmod(fd, 0600) != 0 ? NULL : fdopen(fd, "wb");
    if (!f) {
        int err = errno;
        if (fd >= 0)
            close(fd);
        return skv_errorf(SKV_E_IO, "%s: %s", tmp, strerror(err));
    }
    unsigned char sum[32];
    int rc = p ? (fwrite(p, 1, n, f) == n ? SKV_OK : skv_errorf(SKV_E_IO, "write: %s", strerror(errno)))
               : session_write(w, s, f, NULL, sum);
    *bytes = ftell(f);
    /* on disk before it replaces an earlier save of the name, and the rename on disk too */
    if (!rc && (fflush(f) != 0 || fsync(fileno(f)) != 0))
        rc = skv_errorf(SKV_E_IO, "%s: %s", tmp, strerror(errno));
    if (fclose(f) != 0 && !rc)
        rc = skv_errorf(SKV_E_IO, "close: %s", strerror(errno));
    if (!rc)
        rc = rename_durable(tmp, path, dir);
    if (rc)
        unlink(tmp);
    return rc;
}

/* Writes session s to `path` whole (SAVE, and a persist save without a block store). */
static int session_save(struct skv_worker *w, struct skv_session *s, const char *dir, const char *path, bool shared,
                        long *bytes)
{
    return file_write(w, s, NULL, 0, dir, path, shared, bytes);
}

static bool ends_with(const char *s, const char *end);

/* Removes SAVE's temporary files a crash left in the state directory, an hour old or more
 * (another daemon sharing the directory may be writing a newer one): at a start's first SAVE. */
static void sweep_saves(struct skv_worker *w)
{
    if (w->saves_swept)
        return;
    w->saves_swept = true;
    DIR *d = opendir(w->cfg->state_dir);
    if (!d)
        return;
    time_t now = time(NULL);
    for (struct dirent *e; (e = readdir(d));) {
        const char *skv = strstr(e->d_name, ".skv.");
        struct stat sb;
        if (!skv || !ends_with(e->d_name, ".tmp") || fstatat(dirfd(d), e->d_name, &sb, AT_SYMLINK_NOFOLLOW) != 0 ||
            !S_ISREG(sb.st_mode) || now - sb.st_mtime < 3600)
            continue;
        if (unlinkat(dirfd(d), e->d_name, 0) == 0)
            skv_log(SKV_LOG_INFO, "a SAVE's temporary file a crash left removed: %s/%s", w->cfg->state_dir, e->d_name);
    }
    closedir(d);
}

static void handle_save(struct skv_worker *w, struct skv_job *job)
{
    const Snapkv__SaveRequest *q = job->req->save;
    struct skv_session *s = NULL;
    char path[1200];
    long bytes = 0;
    int rc = find_session(w, job, q->session_id, true, &s);
    if (!rc)
        rc = save_path(w, q->name, path, sizeof path);
    if (!rc) {
        sweep_saves(w);
        rc = session_save(w, s, w->cfg->state_dir, path, true, &bytes);
    }
    if (rc) {
        fail_rc(w, job, rc);
        return;
    }
    Snapkv__Reply rep;
    Snapkv__SaveReply sr = SNAPKV__SAVE_REPLY__INIT;
    reply_init(&rep, job);
    sr.bytes = (uint64_t)bytes;
    rep.result_case = SNAPKV__REPLY__RESULT_SAVE;
    rep.save = &sr;
    skv_worker_reply(w, job, &rep);
}

static int read_exact(FILE *f, crypto_generichash_state *h, void *p, size_t n)
{
    if (fread(p, 1, n, f) != n)
        return skv_errorf(SKV_E_FORMAT, "saved session is truncated");
    crypto_generichash_update(h, p, n);
    return SKV_OK;
}

/* A saved K or V that is not a finite number would poison every attention over its head. */
static int rows_finite(const float *x, size_t n, const char *path)
{
    return all_finite(x, n) ? SKV_OK : skv_errorf(SKV_E_FORMAT, "%s: a saved key or value is not finite", path);
}

/* A head's len positions and scores, as write_rows_meta wrote them for `version` (version 1: no
 * scores). The positions' order and range are checked by the caller. */
static int read_rows_meta(FILE *f, crypto_generichash_state *h, struct skv_kv_head *kh, int32_t len, uint32_t version,
                          const char *path)
{
    int32_t runs = -1, flag = 1;
    int rc = version >= SAVE_VERSION_RUNS ? read_exact(f, h, &runs, sizeof runs) : SKV_OK;
    if (!rc && runs == -1) {
        rc = read_exact(f, h, kh->pos, (size_t)len * 4);
    } else if (!rc && (runs < 0 || runs > len)) {
        rc = skv_errorf(SKV_E_FORMAT, "%s: %d runs of positions for %d rows", path, runs, len);
    } else {
        int32_t j = 0;
        for (int32_t r = 0; r < runs && !rc; r++) {
            int32_t run[2];
            if ((rc = read_exact(f, h, run, sizeof run)))
                break;
            if (run[1] <= 0 || run[1] > len - j || run[0] < 0 || run[0] > INT32_MAX - run[1])
                rc = skv_errorf(SKV_E_FORMAT, "%s: a run of positions is out of range", path);
            for (int32_t c = 0; !rc && c < run[1]; c++)
                kh->pos[j++] = run[0] + c;
        }
        if (!rc && j != len)
            rc = skv_errorf(SKV_E_FORMAT, "%s: runs of %d positions for %d rows", path, j, len);
    }
    if (!rc && version >= SAVE_VERSION_RUNS)
        rc = read_exact(f, h, &flag, sizeof flag);
    if (!rc && (flag != 0 && flag != 1))
        rc = skv_errorf(SKV_E_FORMAT, "%s: scores flag %d", path, flag);
    if (!rc && version >= 2 && flag)
        rc = read_exact(f, h, kh->score, (size_t)len * sizeof *kh->score);
    else if (!rc)
        memset(kh->score, 0, (size_t)len * sizeof *kh->score);
    return rc;
}

/* What a persist restore shares among the sessions it loads (LOAD has none). */
struct restore {
    struct skv_kv_store *store;   /* the blocks version-4 files name (NULL: none could be opened) */
    struct skv_kv_dedupe *dedupe; /* older files' full blocks, by content (NULL: not shared) */
    uint64_t n_shared;            /* blocks shared again */
    int evicted;                  /* sessions restored before, evicted for a later one's room */
    unsigned char sum[32];        /* the checksum of the file session_load read last */
};

/* Opens a file of the state directory to read: a regular file, not a link (the daemon's own
 * files are never links) and not a FIFO a restore would wait on for ever. */
static int open_state_file(const char *path)
{
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return skv_errorf(errno == ENOENT ? SKV_E_NOT_FOUND : SKV_E_IO, "%s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) < 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return skv_errorf(SKV_E_FORMAT, "%s is not a regular file", path);
    }
    return fd;
}

/* A saved head's len positions: each in [0, n_past), in increasing order (the read and
 * precheck_rows); SKV_E_FORMAT naming path when not. */
static int positions_ok(const int32_t *pos, int32_t len, int32_t n_past, const char *path)
{
    for (int32_t j = 0; j < len; j++)
        if (pos[j] < 0 || pos[j] >= n_past || (j && pos[j] <= pos[j - 1]))
            return skv_errorf(SKV_E_FORMAT, "%s: bad positions", path);
    return SKV_OK;
}

/* Reads n bytes of rows into buf, at most `cap` bytes at a time, into the checksum h (precheck_rows);
 * with check, each part's floats must be finite. */
static int precheck_bytes(FILE *f, crypto_generichash_state *h, void *buf, size_t cap, uint64_t n, bool check,
                          const char *path)
{
    int rc = SKV_OK;
    while (n && !rc) {
        size_t part = n < cap ? (size_t)n : cap;
        if (!(rc = read_exact(f, h, buf, part)) && check)
            rc = rows_finite(buf, part / sizeof(float), path);
        n -= part;
    }
    return rc;
}

/* The bytes of the blocks a saved session's rows will hold in cache c, read ahead from where f
 * stands (the first head's row count: the tokens, compressor state, logits and a cut character
 * read already into the checksum h, which this pass takes a copy of) and f put back there. It
 * reads the rest as the read that follows will and refuses what that read would refuse, with the
 * same message: a head's row count, its positions, a K or V that is not finite, the checksum.
 * So LOAD and the store make their room only for a file that loads (before, this pass stepped
 * over the rows and a file with a bad row or checksum had evicted sessions for a load that then
 * failed). It costs a second read of the file, from the page cache mostly. For the files LOAD and
 * the store take, versions 1..3 (SAVE_VERSION): each head's positions, from version 2 its
 * scores, then its K and V rows; the later versions, a persist save's, name a block store and are
 * refused before. */
static int precheck_rows(FILE *f, const crypto_generichash_state *h_read, const struct save_header *hd,
                         const char *path, const struct skv_kv_cache *c, uint64_t *bytes)
{
    *bytes = 0;
    if (hd->version > SAVE_VERSION)
        return skv_errorf(SKV_E_FORMAT, "%s: version %u names a block store", path, hd->version);
    off_t start = ftello(f);
    if (start < 0)
        return skv_errorf(SKV_E_IO, "%s: %s", path, strerror(errno));
    crypto_generichash_state h = *h_read;
    const size_t row = (size_t)c->head_dim * sizeof(float), cap = 256 * row;
    const uint64_t cbr = (uint64_t)c->block_rows;
    int32_t *pos = malloc((size_t)(hd->n_past ? hd->n_past : 1) * sizeof *pos);
    void *buf = malloc(cap);
    int rc = pos && buf ? SKV_OK : SKV_E_NOMEM;
    uint64_t blocks = 0;
    for (int i = 0; !rc && i < c->n_layers * c->n_kv_heads; i++) {
        int32_t len;
        if ((rc = read_exact(f, &h, &len, sizeof len)))
            break;
        if (len < 0 || len > hd->n_past) {
            rc = skv_errorf(SKV_E_FORMAT, "%s: head %d holds %d rows", path, i, len);
            break;
        }
        if ((rc = read_exact(f, &h, pos, (size_t)len * sizeof *pos)))
            break;
        rc = positions_ok(pos, len, hd->n_past, path);
        if (!rc && hd->version >= 2) /* the scores */
            rc = precheck_bytes(f, &h, buf, cap, (uint64_t)len * sizeof(float), false, path);
        for (int kv = 0; kv < 2 && !rc; kv++)
            rc = precheck_bytes(f, &h, buf, cap, (uint64_t)len * row, true, path);
        blocks += ((uint64_t)len + cbr - 1) / cbr;
    }
    unsigned char want[32], got[32];
    if (!rc) {
        crypto_generichash_final(&h, want, sizeof want);
        if (fread(got, 1, sizeof got, f) != sizeof got || memcmp(want, got, sizeof got) != 0)
            rc = skv_errorf(SKV_E_FORMAT, "%s: checksum mismatch", path);
    }
    free(pos);
    free(buf);
    if (fseeko(f, start, SEEK_SET) != 0 && !rc)
        rc = skv_errorf(SKV_E_IO, "%s: %s", path, strerror(errno));
    if (!rc)
        *bytes = blocks * skv_kv_pool_block_bytes(c->pool);
    return rc;
}

/* Reads a saved session from f (named `path` in messages; f stays open) into a new session of
 * tenant (owner: who made it), charged to the pool and the tenant; *out on success (nothing is
 * left behind on failure). With saved_rows (may be NULL): the trailer's computed_rows when it
 * is there, whole, and of a daemon that computes rows as this one does (skv_requests_rows_id),
 * else -1. */
static int session_read(struct skv_worker *w, FILE *f, const char *path, const char *tenant, const char *owner,
                        struct restore *r, struct skv_session **out, int32_t *saved_rows)
{
    if (saved_rows)
        *saved_rows = -1;
    struct skv_session *s = NULL;
    int rc = skv_session_check_tenant(tenant);
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, 32);
    struct save_header hd;
    if (!rc)
        rc = read_exact(f, &h, &hd, sizeof hd);
    const struct skv_model_config *mc = &w->m->cfg;
    if (!rc && (memcmp(hd.magic, SAVE_MAGIC, 8) != 0 || hd.version < 1 || hd.version > SAVE_VERSION_PARTIAL))
        rc = skv_errorf(SKV_E_VERSION, "%s is not a saved session of version 1..%d", path, SAVE_VERSION_PARTIAL);
    if (!rc && hd.version >= SAVE_VERSION_STORE && !(r && r->store))
        rc = skv_errorf(SKV_E_FORMAT, "%s names blocks of a persist block store, and there is none", path);
    /* the model's fingerprint, or the legacy one of a file an earlier daemon wrote */
    if (!rc && ((memcmp(hd.fingerprint, w->m->fingerprint, 64) != 0 &&
                 memcmp(hd.fingerprint, w->m->legacy_fingerprint, 64) != 0) ||
                hd.n_layers != (uint32_t)mc->n_layers ||
                hd.n_kv_heads != (uint32_t)mc->n_kv_heads || hd.head_dim != (uint32_t)mc->head_dim))
        rc = skv_errorf(SKV_E_INVAL, "%s was saved with another model", path);
    if (!rc && (hd.n_tokens < 0 || hd.n_past < 0 || hd.n_tokens > hd.n_past || hd.prompt_len < 0 ||
                hd.prompt_len > hd.n_past))
        rc = skv_errorf(SKV_E_FORMAT, "%s: implausible lengths", path);
    /* a session is never longer than this; a daemon started with lower limits refuses it */
    if (!rc && hd.n_past > w->cfg->max_prompt_tokens + w->cfg->max_new_tokens)
        rc = skv_errorf(SKV_E_LIMIT, "%s: %d tokens, more than max-prompt-tokens + max-new-tokens (%lld)", path,
                        hd.n_past, (long long)(w->cfg->max_prompt_tokens + w->cfg->max_new_tokens));
    hd.spec[sizeof hd.spec - 1] = '\0';
    if (!rc && !(rc = skv_session_create(w->sessions, w->m, tenant, owner, &s)))
        rc = set_spec(w, s, "policy=full", false);
    int32_t *tok = NULL;
    if (!rc && hd.n_tokens && !(tok = malloc((size_t)hd.n_tokens * sizeof *tok)))
        rc = SKV_E_NOMEM;
    if (!rc && hd.n_tokens && !(rc = read_exact(f, &h, tok, (size_t)hd.n_tokens * 4)))
        for (int32_t i = 0; i < hd.n_tokens && !rc; i++) /* COMPRESS would run them again */
            if (tok[i] < 0 || tok[i] >= mc->n_vocab)
                rc = skv_errorf(SKV_E_FORMAT, "%s: token %d is outside the vocabulary", path, tok[i]);
    if (!rc && hd.n_tokens)
        rc = skv_session_push_tokens(s, tok, hd.n_tokens);
    free(tok);
    /* the session goes on under its spec: the compressor that reads the state it had */
    if (!rc && hd.version >= 2 && (rc = set_spec(w, s, hd.spec, true))) {
        char why[256]; /* skv_errorf() rewrites the buffer skv_error_msg() returns */
        snprintf(why, sizeof why, "%s", skv_error_msg());
        rc = skv_errorf(SKV_E_VERSION, "%s: saved spec: %s", path, why); /* a newer daemon's policy */
    }
    int32_t state_len = 0;
    void *state = NULL;
    size_t state_max = s && s->comp ? skv_compressor_state_max(s->comp, hd.n_past) : 0;
    if (!rc && hd.version >= 2 && !(rc = read_exact(f, &h, &state_len, sizeof state_len))) {
        if (state_len < 0 || (size_t)state_len > state_max)
            rc = skv_errorf(SKV_E_FORMAT, "%s: compressor state of %d bytes", path, state_len);
        else if (state_len && !(state = malloc((size_t)state_len)))
            rc = SKV_E_NOMEM;
        else if (state_len)
            rc = read_exact(f, &h, state, (size_t)state_len);
    }
    int32_t n_logits = 0;
    float *logits = NULL;
    if (!rc && hd.version >= 3 && !(rc = read_exact(f, &h, &n_logits, sizeof n_logits))) {
        if (n_logits != 0 && n_logits != mc->n_vocab)
            rc = skv_errorf(SKV_E_FORMAT, "%s: %d logits for a vocabulary of %d", path, n_logits, mc->n_vocab);
        else if (n_logits && !(logits = malloc((size_t)n_logits * sizeof *logits)))
            rc = SKV_E_NOMEM;
        else if (n_logits)
            rc = read_exact(f, &h, logits, (size_t)n_logits * sizeof *logits);
        for (int32_t i = 0; !rc && i < n_logits; i++)
            if (isnan(logits[i]))
                rc = skv_errorf(SKV_E_FORMAT, "%s: a saved logit is NaN", path);
    }
    int32_t n_pending = 0;
    char pending[sizeof s->text_pending];
    if (!rc && hd.version >= 3 && !(rc = read_exact(f, &h, &n_pending, sizeof n_pending))) {
        if (n_pending < 0 || n_pending >= (int32_t)sizeof pending)
            rc = skv_errorf(SKV_E_FORMAT, "%s: %d bytes of a cut character", path, n_pending);
        else if (n_pending)
            rc = read_exact(f, &h, pending, (size_t)n_pending);
    }
    /* the compressor's state against its spec, before the room too */
    if (!rc && hd.version >= 2) {
        if (!s->comp != !state_len)
            rc = skv_errorf(SKV_E_FORMAT, "%s: compressor state does not match the spec", path);
        else if (s->comp)
            rc = skv_compressor_state_read(s->comp, state, (size_t)state_len, hd.n_past);
    }
    /* LOAD's and a stored session's room, made (or refused) before any block is taken, once
     * the whole file is read and checked (the rows by precheck_rows): nothing is evicted for a
     * file refused (a restore's files may share their blocks with sessions loaded before, which
     * an eviction for its room could take: its charge at the end counts it, so the pool may pass
     * its size by that session while it loads, at start) */
    if (!rc && !r) {
        uint64_t bytes = 0;
        if (!(rc = precheck_rows(f, &h, &hd, path, s->cache, &bytes)))
            rc = skv_session_reserve(w->sessions, s, bytes, bytes, NULL);
    }
    size_t row = (size_t)mc->head_dim * sizeof(float);
    float *rows = NULL;    /* one head's K or V rows on their way into its blocks */
    uint32_t *refs = NULL; /* the store indices of its blocks there (version 4 on) */
    uint64_t group = skv_kv_hash64(tenant, strlen(tenant)), n_shared = 0;
    int br = r && r->store ? skv_kv_store_block_rows(r->store) : 1; /* the saved blocks' rows */
    bool whole = false; /* a head of full blocks written whole (out of position order when saved) */
    for (int i = 0; !rc && i < mc->n_layers * mc->n_kv_heads; i++) {
        struct skv_kv_head *kh = &s->cache->heads[i];
        int32_t len;
        if ((rc = read_exact(f, &h, &len, sizeof len)))
            break;
        if (len < 0 || len > hd.n_past) {
            rc = skv_errorf(SKV_E_FORMAT, "%s: head %d holds %d rows", path, i, len);
            break;
        }
        if (len > kh->cap && (rc = skv_kv_cache_reserve(s->cache, len)))
            break; /* grows every head by len: heads not loaded yet are empty */
        float *more = realloc(rows, (size_t)(len ? len : 1) * row);
        if (!more) {
            rc = SKV_E_NOMEM;
            break;
        }
        rows = more;
        int32_t n_full = hd.version >= SAVE_VERSION_STORE ? len / br : 0, n_refs = n_full;
        if ((rc = read_rows_meta(f, &h, kh, len, hd.version, path)))
            break;
        if (hd.version >= SAVE_VERSION_PARTIAL && (rc = read_exact(f, &h, &n_refs, sizeof n_refs)))
            break;
        /* the full ones, or also the last; or none: a head out of position order is written whole */
        if (n_refs != n_full && !(n_refs == n_full + 1 && len % br) && n_refs != 0) {
            rc = skv_errorf(SKV_E_FORMAT, "%s: head %d of %d rows names %d blocks of %d", path, i, len, n_refs, br);
            break;
        }
        int row0 = n_refs * br < len ? n_refs * br : len;
        whole |= n_refs == 0 && n_full > 0;
        uint32_t *more_refs = realloc(refs, (size_t)(n_refs ? n_refs : 1) * sizeof *refs);
        if (!more_refs) {
            rc = SKV_E_NOMEM;
            break;
        }
        refs = more_refs;
        rc = read_exact(f, &h, refs, (size_t)n_refs * sizeof *refs);
        for (int b = 0; b < n_refs && !rc; b++) { /* the store checks its blocks' sums and values */
            bool shared;
            rc = skv_kv_store_get(r->store, refs[b], b < n_full ? br : len - n_full * br, group, s->cache,
                                  i / mc->n_kv_heads, i % mc->n_kv_heads, &shared);
            n_shared += shared;
        }
        for (int kv = 0; kv < 2 && !rc; kv++)
            if (!(rc = read_exact(f, &h, rows, (size_t)(len - row0) * row)) &&
                !(rc = rows_finite(rows, (size_t)(len - row0) * mc->head_dim, path)))
                rc = skv_kv_cache_write_rows(s->cache, i / mc->n_kv_heads, i % mc->n_kv_heads, kv, row0, len - row0,
                                             rows);
        if (rc)
            break;
        rc = positions_ok(kh->pos, len, hd.n_past, path);
    }
    free(rows);
    free(refs);
    unsigned char want[32], got[32];
    if (!rc) {
        crypto_generichash_final(&h, want, sizeof want);
        if (fread(got, 1, sizeof got, f) != sizeof got || memcmp(want, got, sizeof got) != 0)
            rc = skv_errorf(SKV_E_FORMAT, "%s: checksum mismatch", path);
        else if (r)
            memcpy(r->sum, got, sizeof got);
    }
    struct save_rows t;
    unsigned char tsum[16];
    if (!rc && saved_rows && fread(&t, 1, sizeof t, f) == sizeof t && memcmp(t.magic, ROWS_MAGIC, 8) == 0) {
        rows_sum(got, &t, tsum);
        const unsigned char *mine = skv_requests_rows_id(w);
        if (sodium_memcmp(tsum, t.sum, sizeof tsum) == 0 && t.zero == 0 && t.computed_rows >= 0 &&
            t.computed_rows <= hd.n_tokens && sodium_memcmp(t.rows_id, mine, sizeof t.rows_id) == 0 &&
            !sodium_is_zero(t.rows_id, sizeof t.rows_id))
            *saved_rows = t.computed_rows;
    }
    if (!rc) {
        s->cache->n_past = hd.n_past;
        s->prompt_len = hd.prompt_len;
        s->lease_seconds = (uint32_t)w->cfg->lease_seconds;
        if (hd.version < 2) /* (from version 2 the compressor's state was read before the rows) */
            snprintf(s->spec, sizeof s->spec, "%s", hd.spec); /* shown; decoding keeps every row */
    }
    free(state);
    if (!rc && logits) { /* DECODE goes on from where the saved session stood */
        free(s->logits);
        s->logits = logits;
        logits = NULL;
        memcpy(s->text_pending, pending, (size_t)n_pending);
        s->n_text_pending = (uint8_t)n_pending;
    }
    free(logits);
    /* a file older than the store, blocks of another size (kv-block-tokens changed), or a head
     * written whole (its rows were out of position order: a FORK of such a session is written
     * whole too): its blocks equal to those of a session of its tenant loaded before share
     * them, as a fork shared its document's before the stop (version-4 files otherwise name
     * their blocks, shared by the store above): the pool holds them once before it is charged */
    if (!rc && r && r->dedupe && (hd.version < SAVE_VERSION_STORE || br != s->cache->block_rows || whole))
        rc = skv_kv_cache_dedupe(s->cache, r->dedupe, group, &n_shared);
    int evicted = 0;
    if (!rc)
        rc = skv_session_charge(w->sessions, s, &evicted);
    if (r) {
        r->evicted += evicted;
        r->n_shared += rc ? 0 : n_shared;
    }
    if (rc) {
        if (s)
            skv_session_destroy(w->sessions, s);
        return rc;
    }
    *out = s;
    return SKV_OK;
}

/* Reads a saved session from the file `path` (session_read). */
static int session_load(struct skv_worker *w, const char *path, const char *tenant, const char *owner,
                        struct restore *r, struct skv_session **out, int32_t *saved_rows)
{
    int rc = skv_session_check_tenant(tenant); /* before the file: a bad name says so */
    if (rc)
        return rc;
    int fd = open_state_file(path);
    if (fd < 0)
        return fd;
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        rc = skv_errorf(SKV_E_NOMEM, "%s: %s", path, strerror(errno));
        close(fd);
        return rc;
    }
    rc = session_read(w, f, path, tenant, owner, r, out, saved_rows);
    fclose(f);
    return rc;
}

/* ---- the shared store (store = ...) ------------------------------------------------------------
 * A session evicted or past its lease is written there in the SAVE format under
 * snapkv:<model fingerprint>:<tenant>:<id>, so that only this model and this tenant can read it,
 * and a request naming a session this daemon does not hold takes it back (GETDEL: one host at a
 * time holds it). After the SAVE bytes comes a store_meta: what a SAVE does not keep, the pin and
 * the lease. session_read stops at the checksum, so a daemon that knows no store_meta (an older
 * one, in a rolling upgrade) loads such a value as it did, and a value without one (an older
 * daemon's) loads with the default lease, unpinned. (Since 2026-12-06 a GGUF model's key has a
 * fingerprint that covers its config: a daemon from before looks under the legacy one and does
 * not find what an upgraded host spilled; this one finds both.) With store-secret-file the value is signed:
 * SAVE bytes, a MAC, the store_meta (flag STORE_SIGNED), the MAC a keyed BLAKE2b-256 of the key
 * (model, tenant, id), the SAVE bytes and the store_meta, so that neither the session, nor its
 * pin, lease and time, nor the tenant and id it is for can be changed by someone who can write
 * to the store but does not hold the secret. An old value of the session put back is not found
 * before its time (expires_unix) passes: a replay within store-keep-seconds is not prevented. */
#define STORE_META_MAGIC "SKVSTMD1"
#define STORE_SIGNED 1u /* store_meta.flags: a MAC comes before it */
#define STORE_MAC_BYTES 32

struct store_meta {
    char magic[8];
    uint32_t pinned; /* 0 or 1 */
    uint32_t lease_seconds;
    uint32_t flags;  /* STORE_SIGNED */
    uint32_t zero;   /* (room for more: 0 now) */
    uint64_t expires_unix; /* when it was spilled plus store-keep-seconds: a signed one is not taken after */
};
#define STORE_CLOCK_SKEW_S 300 /* the hosts' clocks may differ by this much */

/* legacy: under the model's legacy fingerprint, as a daemon before the forty-fifth session put
 * it there (false when that is the fingerprint: no other key) */
static bool store_key(const struct skv_worker *w, const char *tenant, const uint8_t *id, bool legacy, char *out,
                      size_t cap)
{
    char hex[2 * SKV_SESSION_ID_BYTES + 1];
    skv_session_id_hex(id, hex);
    snprintf(out, cap, "snapkv:%s:%s:%s", legacy ? w->m->legacy_fingerprint : w->m->fingerprint, tenant, hex);
    return !legacy || strcmp(w->m->legacy_fingerprint, w->m->fingerprint) != 0;
}

#define STORE_KEY_MAX (7 + 65 + SKV_TENANT_MAX + 2 * SKV_SESSION_ID_BYTES + 8)

/* fopencookie's write and seek for a count of bytes: where the stream stands */
static ssize_t count_write(void *cookie, const char *buf, size_t n)
{
    *(uint64_t *)cookie += n;
    return (ssize_t)n;
}

static int count_seek(void *cookie, off64_t *off, int whence)
{
    uint64_t *at = cookie;
    if (whence == SEEK_SET && *off >= 0)
        *at = (uint64_t)*off;
    else if (whence == SEEK_CUR && *off >= -(off64_t)*at)
        *at += (uint64_t)*off;
    else
        return -1;
    *off = (off64_t)*at;
    return 0;
}

struct spill {
    struct skv_worker *w;
    struct skv_session *s;
    const char *key; /* the store's key: a signed value is bound to it */
};

static struct store_meta store_meta_of(const struct skv_worker *w, const struct skv_session *s)
{
    struct store_meta m = {.pinned = s->pinned, .lease_seconds = s->lease_seconds,
                           .flags = w->store_signed ? STORE_SIGNED : 0,
                           .expires_unix = (uint64_t)time(NULL) + (uint64_t)w->cfg->store_keep_seconds};
    memcpy(m.magic, STORE_META_MAGIC, sizeof m.magic);
    return m;
}

/* The MAC's state under secret key mac_key (SKV_STORE_KEY_BYTES) after the store key it is
 * bound to (its length first: no two keys hash alike). */
static void store_mac_init(const unsigned char *mac_key, const char *key, crypto_generichash_state *h)
{
    uint32_t n = (uint32_t)strlen(key);
    crypto_generichash_init(h, mac_key, SKV_STORE_KEY_BYTES, STORE_MAC_BYTES);
    crypto_generichash_update(h, (const unsigned char *)&n, sizeof n);
    crypto_generichash_update(h, (const unsigned char *)key, n);
}

/* A stream that hashes what goes through it into `h` on its way to `to` (the signed spill's). */
struct mac_tee {
    crypto_generichash_state *h;
    FILE *to;
};

static ssize_t mac_tee_write(void *cookie, const char *buf, size_t n)
{
    struct mac_tee *t = cookie;
    crypto_generichash_update(t->h, (const unsigned char *)buf, n);
    return fwrite(buf, 1, n, t->to) == n ? (ssize_t)n : 0; /* (0: an error, to stdio) */
}

/* skv_store_writer: session s in the SAVE format, its MAC when signed, then its store_meta */
static int spill_write(void *user, FILE *f)
{
    struct spill *sp = user;
    unsigned char sum[32], mac[STORE_MAC_BYTES];
    struct store_meta m = store_meta_of(sp->w, sp->s);
    crypto_generichash_state h;
    struct mac_tee t = {&h, f};
    FILE *g = f; /* signed: the SAVE bytes go through the MAC on their way to f */
    if (sp->w->store_signed) {
        store_mac_init(sp->w->store_mac_key, sp->key, &h);
        if (!(g = fopencookie(&t, "w", (cookie_io_functions_t){.write = mac_tee_write})))
            return skv_errorf(SKV_E_NOMEM, "no memory to sign a session");
    }
    int rc = session_write(sp->w, sp->s, g, NULL, sum);
    if (g != f && fclose(g) != 0 && !rc)
        rc = skv_errorf(SKV_E_IO, "write: %s", strerror(errno));
    if (g != f) {
        crypto_generichash_update(&h, (const unsigned char *)&m, sizeof m);
        crypto_generichash_final(&h, mac, sizeof mac);
        if (!rc && fwrite(mac, sizeof mac, 1, f) != 1)
            rc = skv_errorf(SKV_E_IO, "write: %s", strerror(errno));
    }
    if (!rc && fwrite(&m, sizeof m, 1, f) != 1)
        rc = skv_errorf(SKV_E_IO, "write: %s", strerror(errno));
    return rc;
}

/* The store_meta at the end of a stored value: true when there is one that makes sense. */
static bool store_meta_read(const void *data, size_t n, struct store_meta *m)
{
    if (n < sizeof *m)
        return false;
    memcpy(m, (const char *)data + n - sizeof *m, sizeof *m);
    return memcmp(m->magic, STORE_META_MAGIC, sizeof m->magic) == 0 && m->pinned <= 1 && m->zero == 0 &&
           (m->flags & ~STORE_SIGNED) == 0 && m->lease_seconds > 0 &&
           (!(m->flags & STORE_SIGNED) || n >= sizeof *m + STORE_MAC_BYTES);
}

/* With store-secret-file: SKV_OK when the value (with store_meta m, or none) is signed with its
 * secret for this key and its time has not passed; otherwise SKV_E_PERM, the value not read, and
 * *drop set when no daemon should take it (its signature ours, its time past). One whose
 * signature does not match is put back: it may be another daemon's, signed with a secret this
 * one lacks (a rotation done out of order, a daemon given a wrong secret, which before deleted
 * every session it was asked for), and one not signed may be a daemon's without a secret during
 * a rollout; anyone who could forge a value could delete it as well. */
static int store_mac_check(const struct skv_worker *w, const char *key, const unsigned char *data, size_t n,
                           bool has_meta, const struct store_meta *m, bool *drop)
{
    *drop = false;
    if (!has_meta || !(m->flags & STORE_SIGNED))
        return skv_errorf(SKV_E_PERM, "the stored session is not signed, and this daemon takes only sessions "
                          "signed with its store-secret-file");
    size_t body = n - sizeof *m - STORE_MAC_BYTES;
    bool match = false;
    /* store-secret-file's key, then store-accept-secret-file's (a rotation's other secret) */
    for (int k = 0; k < (w->store_accept ? 2 : 1) && !match; k++) {
        crypto_generichash_state h;
        unsigned char mac[STORE_MAC_BYTES];
        store_mac_init(k ? w->store_accept_key : w->store_mac_key, key, &h);
        crypto_generichash_update(&h, data, body);
        crypto_generichash_update(&h, (const unsigned char *)m, sizeof *m);
        crypto_generichash_final(&h, mac, sizeof mac);
        match = sodium_memcmp(mac, data + body, sizeof mac) == 0;
    }
    if (!match)
        return skv_errorf(SKV_E_PERM, "the stored session's signature does not match: it was signed with another "
                          "secret than store-secret-file%s, changed, or written for another tenant or id",
                          w->store_accept ? " and store-accept-secret-file" : "");
    int64_t late = (int64_t)time(NULL) - (int64_t)m->expires_unix;
    *drop = late > STORE_CLOCK_SKEW_S;
    if (*drop)
        return skv_errorf(SKV_E_PERM, "the stored session's time passed %lld s ago (an old value put back?)",
                          (long long)late);
    return SKV_OK;
}

static void spilled_note(struct skv_worker *w, char what, const uint8_t *id);

#define SPILL_RECORDS_MAX (1 << 16) /* spills this daemon keeps count of (5 MB; a scan is one pass) */

/* The spill records past their time dropped (the store's copies expired with them). */
static void spill_prune(struct skv_worker *w)
{
    uint64_t now = skv_now_ms();
    for (size_t i = 0; i < w->n_spills;)
        if (w->spills[i].expires_ms <= now)
            w->spills[i] = w->spills[--w->n_spills];
        else
            i++;
}

/* The spill records past their time dropped; the bytes `tenant`'s records hold. */
static uint64_t spill_tenant_bytes(struct skv_worker *w, const char *tenant)
{
    spill_prune(w);
    uint64_t bytes = 0;
    for (size_t i = 0; i < w->n_spills; i++)
        if (strcmp(w->spills[i].tenant, tenant) == 0)
            bytes += w->spills[i].bytes;
    return bytes;
}

/* Session id of tenant is no longer in the store (taken back, released, dropped): its bytes no
 * longer count. */
static void spill_forget(struct skv_worker *w, const char *tenant, const uint8_t *id)
{
    for (size_t i = 0; i < w->n_spills; i++)
        if (memcmp(w->spills[i].id, id, SKV_SESSION_ID_BYTES) == 0 && strcmp(w->spills[i].tenant, tenant) == 0) {
            w->spills[i] = w->spills[--w->n_spills];
            return;
        }
}

/* The tenant's records whose sessions the store no longer holds (another host took them back,
 * the store lost them) forgotten; the bytes the others hold. */
#define RECOUNT_BATCH 512
static uint64_t spill_tenant_recount(struct skv_worker *w, const char *tenant)
{
    /* a batch of the tenant's keys at a time, pipelined (skv_store_tails: each key's last byte,
     * none when it has no value): before, an EXISTS and its round trip per record, up to 65536
     * one after the other on the engine thread at every spill of a tenant at its cap. A key whose
     * state is not known (an error answer, a batch that failed) keeps its record. */
    spill_prune(w);
    struct recount {
        char keys[RECOUNT_BATCH][STORE_KEY_MAX];
        const char *ptr[RECOUNT_BATCH];
        size_t at[RECOUNT_BATCH], got[RECOUNT_BATCH];
        unsigned char tail[RECOUNT_BATCH];
        signed char state[RECOUNT_BATCH];
    } *b = malloc(sizeof *b);
    bool *gone = calloc(w->n_spills ? w->n_spills : 1, sizeof *gone);
    bool ok = b && gone;
    for (size_t i = 0; ok && i < w->n_spills;) {
        int n = 0;
        for (; i < w->n_spills && n < RECOUNT_BATCH; i++)
            if (strcmp(w->spills[i].tenant, tenant) == 0) {
                store_key(w, tenant, w->spills[i].id, false, b->keys[n], sizeof b->keys[n]);
                b->ptr[n] = b->keys[n];
                b->at[n++] = i;
            }
        for (int k = 0; k < n; k++) { /* (what a batch that failed leaves: kept) */
            b->state[k] = SKV_TAIL_VALUE;
            b->got[k] = 1;
        }
        int rc = n ? skv_store_tails(w->store, b->ptr, n, 1, b->tail, b->got, b->state) : SKV_OK;
        if (rc == SKV_E_IO) { /* error answers (NOPERM too) set every state; a batch that failed none */
            bool known = false;
            for (int k = 0; k < n && !known; k++)
                known = b->state[k] != SKV_TAIL_VALUE;
            rc = known ? SKV_OK : rc;
        }
        ok = rc == SKV_OK;
        for (int k = 0; ok && k < n; k++)
            gone[b->at[k]] = b->state[k] == SKV_TAIL_VALUE && b->got[k] == 0;
    }
    for (size_t i = w->n_spills; gone && i-- > 0;) /* from the end: each moved record was looked at */
        if (gone[i])
            w->spills[i] = w->spills[--w->n_spills];
    free(gone);
    free(b);
    return spill_tenant_bytes(w, tenant);
}

/* Counts a spill of `bytes` for `tenant`; false when no record could be kept (it then counts
 * nothing: the store's time still bounds it). */
static bool spill_remember(struct skv_worker *w, const char *tenant, const uint8_t *id, uint64_t bytes)
{
    spill_forget(w, tenant, id);
    if (w->n_spills == w->cap_spills) {
        size_t cap = w->cap_spills ? 2 * w->cap_spills : 64;
        struct skv_spill_rec *p = cap <= SPILL_RECORDS_MAX ? realloc(w->spills, cap * sizeof *p) : NULL;
        if (!p)
            return false;
        w->spills = p;
        w->cap_spills = cap;
    }
    struct skv_spill_rec *r = &w->spills[w->n_spills++];
    snprintf(r->tenant, sizeof r->tenant, "%s", tenant);
    memcpy(r->id, id, SKV_SESSION_ID_BYTES);
    r->bytes = bytes;
    r->expires_ms = skv_now_ms() + (uint64_t)w->cfg->store_keep_seconds * 1000;
    return true;
}

/* Writes session s to the store, streamed: its size is counted first (the protocol announces
 * it), then it is written straight onto the connection, so a spill costs no memory however large
 * the session. */
void skv_requests_spill(void *user, struct skv_session *s)
{
    struct skv_worker *w = user; /* (registered, and called by the drain, only with a store) */
    double t0 = now_s();
    char key[STORE_KEY_MAX], hex[2 * SKV_SESSION_ID_BYTES + 1];
    store_key(w, s->tenant, s->id, false, key, sizeof key);
    skv_session_id_hex(s->id, hex);
    uint64_t n = 0;
    FILE *f = fopencookie(&n, "w", (cookie_io_functions_t){.write = count_write, .seek = count_seek});
    int rc = f ? session_write(w, s, f, NULL, NULL) : skv_errorf(SKV_E_NOMEM, "no memory to spill a session");
    if (f && fclose(f) != 0 && !rc)
        rc = skv_errorf(SKV_E_NOMEM, "no memory to spill a session");
    n += sizeof(struct store_meta) + (w->store_signed ? STORE_MAC_BYTES : 0);
    if (!rc && n > (uint64_t)w->cfg->store_max_bytes)
        rc = skv_errorf(SKV_E_LIMIT, "it takes %llu bytes, more than store-max-bytes (%lld)", (unsigned long long)n,
                        (long long)w->cfg->store_max_bytes);
    /* (at a stop every session goes, whatever the tenant's spills before: its live bytes are
     * bounded by its quota already) */
    uint64_t held = rc || w->store_draining ? 0 : spill_tenant_bytes(w, s->tenant);
    if (!rc && !w->store_draining && held + n > (uint64_t)w->cfg->store_max_bytes_per_tenant)
        held = spill_tenant_recount(w, s->tenant); /* are they all still there? */
    if (!rc && !w->store_draining && held + n > (uint64_t)w->cfg->store_max_bytes_per_tenant)
        rc = skv_errorf(SKV_E_LIMIT, "the tenant's sessions spilled here hold %llu bytes in the store, and %llu more "
                        "would pass store-max-bytes-per-tenant (%lld)", (unsigned long long)held,
                        (unsigned long long)n, (long long)w->cfg->store_max_bytes_per_tenant);
    struct spill sp = {w, s, key};
    if (rc)
        skv_store_count_spill_failure(w->store); /* (the store counts those it refuses) */
    else
        rc = skv_store_put_stream(w->store, key, n, w->cfg->store_keep_seconds, spill_write, &sp);
    unsigned long long more = 0;
    if (rc && skv_log_allow(&w->log_spill, skv_now_ms(), &more)) {
        skv_log(SKV_LOG_WARN, "session %s of tenant '%s' dropped, not spilled: %s (%llu more dropped since the last "
                "such line: snapkv_store_spill_failures_total)", hex, s->tenant, skv_error_msg(), more);
    } else if (!rc) {
        skv_log(SKV_LOG_DEBUG, "session %s of tenant '%s' spilled to the store (%llu bytes)", hex, s->tenant,
                (unsigned long long)n);
        spilled_note(w, 'S', s->id);
        (void)spill_remember(w, s->tenant, s->id, n);
    }
    w->metrics.store_spill_seconds += now_s() - t0;
}

/* Takes session `id` of `tenant` from the store into this daemon, under its id. NOT_FOUND when
 * the store has none; LIMIT, left there, when it is past store-max-bytes. A value that is not a
 * session of this model (FORMAT: cut, damaged; INVAL: another model's), or with
 * store-secret-file one signed with it whose time passed (PERM), is dropped (it was taken); one
 * that does not load here for any other reason (not signed, or signed with another secret, the
 * pool, the tenant's limits, memory, a newer format) goes back for what is left of its time, so
 * that it does not outlive it. */
static int store_take_session(struct skv_worker *w, const char *tenant, const uint8_t *id, struct skv_session **out);

/* store_take_session, its time counted (snapkv_store_load_seconds_total). */
static int store_load(struct skv_worker *w, const char *tenant, const uint8_t *id, struct skv_session **out)
{
    double t0 = now_s();
    int rc = store_take_session(w, tenant, id, out);
    w->metrics.store_load_seconds += now_s() - t0;
    return rc;
}

static int store_take_session(struct skv_worker *w, const char *tenant, const uint8_t *id, struct skv_session **out)
{
    char key[STORE_KEY_MAX], legacy[STORE_KEY_MAX];
    store_key(w, tenant, id, false, key, sizeof key);
    const bool has_legacy = store_key(w, tenant, id, true, legacy, sizeof legacy); /* an earlier daemon's */
    const void *data = NULL;
    void *value = NULL;
    size_t n = 0;
    bool took_legacy = false, stays = false;
    int rc = skv_store_take_either(w->store, key, has_legacy ? legacy : NULL, &data, &n, &value, &took_legacy,
                                   &stays);
    if (took_legacy) /* what its signature covers, and where a put back goes */
        memcpy(key, legacy, sizeof key);
    if (rc == SKV_E_NOT_FOUND) /* gone from the store (its time passed, another host took it) */
        spill_forget(w, tenant, id);
    if ((rc == SKV_E_LIMIT && !stays) || rc == SKV_E_NOMEM) { /* taken, and too large to hold */
        skv_log(SKV_LOG_WARN, "a stored session of tenant '%s' was dropped: %s", tenant, skv_error_msg());
        spilled_note(w, 'T', id);
        spill_forget(w, tenant, id);
    }
    if (rc)
        return rc;
    bool back = false; /* put back in the store */
    struct skv_session *s = NULL;
    struct store_meta m;
    int32_t saved_rows = -1;
    bool has_meta = store_meta_read(data, n, &m);
    FILE *f = NULL;
    /* one not signed as it should be is not read: it goes back (PERM), for a daemon that does
     * not check signatures, or until its TTL */
    bool drop = false;
    rc = w->store_signed ? store_mac_check(w, key, data, n, has_meta, &m, &drop) : SKV_OK;
    w->metrics.store_refused += rc != SKV_OK;
    if (rc && !drop) /* (one dropped is logged below) */
        skv_log(SKV_LOG_WARN, "a stored session of tenant '%s' (%s) refused: %s", tenant, key, skv_error_msg());
    if (!rc && !n)
        rc = skv_errorf(SKV_E_FORMAT, "the stored session is empty");
    else if (!rc && !(f = fmemopen((void *)data, n, "rb"))) /* read only */
        rc = skv_errorf(SKV_E_NOMEM, "no memory to read a stored session");
    else if (!rc)
        rc = session_read(w, f, "the stored session", tenant, "store", NULL, &s, &saved_rows);
    if (f)
        fclose(f);
    if (!rc && (rc = skv_session_set_id(w->sessions, s, id)))
        skv_session_destroy(w->sessions, s);
    /* its rows serve prefix reuse where a daemon of this one's rows_id computed them, and the
     * value is signed (one anybody could have put there would feed the tenant's other prompts) */
    if (!rc && saved_rows >= 0 && w->store_signed)
        s->computed_rows = saved_rows;
    if (!rc && has_meta) { /* its pin and lease, as persist restores them */
        s->pinned = m.pinned;
        s->lease_seconds = m.lease_seconds <= (uint64_t)w->cfg->max_lease_seconds ? m.lease_seconds
                                                                                 : (uint32_t)w->cfg->lease_seconds;
    }
    if (rc && !drop && rc != SKV_E_FORMAT && rc != SKV_E_INVAL) {
        char why[256];
        snprintf(why, sizeof why, "%s", skv_error_msg());
        /* for what is left of its time (plus the clocks' skew), not a new TTL: however often it
         * is put back, a value lives no longer than its spill's store-keep-seconds and 300 s */
        int64_t ttl = w->cfg->store_keep_seconds;
        if (has_meta) {
            /* (an unsigned value's time is the store's word: kept below what overflows) */
            int64_t exp = m.expires_unix > (uint64_t)INT64_MAX / 2 ? INT64_MAX / 2 : (int64_t)m.expires_unix;
            int64_t left = exp + STORE_CLOCK_SKEW_S - (int64_t)time(NULL);
            ttl = left < 1 ? 1 : left < ttl ? left : ttl;
        }
        if (skv_store_put_back(w->store, key, data, n, ttl)) {
            skv_log(SKV_LOG_WARN, "a stored session of tenant '%s' that did not load here is lost: %s", tenant,
                    skv_error_msg());
            rc = skv_errorf(rc, "%s (and putting it back in the store failed: it is lost)", why);
        } else {
            rc = skv_errorf(rc, "%s (it stays in the store)", why);
            back = true;
        }
    } else if (rc) {
        skv_log(SKV_LOG_WARN, "a stored session of tenant '%s' (%s) was dropped: %s", tenant, key, skv_error_msg());
    }
    skv_store_value_free(value);
    if (!back) { /* the store holds it no more: a restore after a crash takes its file (the newest left) */
        spilled_note(w, 'T', id);
        spill_forget(w, tenant, id);
    }
    if (rc)
        return rc;
    skv_worker_event_stored(w, s);
    *out = s;
    return SKV_OK;
}

/* RELEASE of a session this daemon does not hold: deleted from the store. SKV_OK when it was
 * there; otherwise a status with the message to answer. */
static int store_release(struct skv_worker *w, const char *tenant, const uint8_t *id)
{
    char key[STORE_KEY_MAX], hex[2 * SKV_SESSION_ID_BYTES + 1], why[256];
    store_key(w, tenant, id, false, key, sizeof key);
    skv_session_id_hex(id, hex);
    int rc = skv_store_delete(w->store, key);
    if (rc == SKV_E_NOT_FOUND && store_key(w, tenant, id, true, key, sizeof key)) /* an earlier daemon's */
        rc = skv_store_delete(w->store, key);
    if (rc == SKV_E_NOT_FOUND || !rc)
        spill_forget(w, tenant, id); /* (gone from the store either way) */
    if (rc == SKV_E_NOT_FOUND)
        return skv_errorf(SKV_E_NOT_FOUND, "no session %s for this tenant", hex);
    if (rc) {
        snprintf(why, sizeof why, "%s", skv_error_msg());
        return skv_errorf(rc, "session %s is not here, and deleting it from the store failed: %s", hex, why);
    }
    return SKV_OK;
}

/* EVICT in the store. Of a tenant or a session: every key of it the store holds under this
 * model (either fingerprint), found by SCAN, whoever spilled it (another daemon sharing the store,
 * this one before a restart, a stop's drain), and deleted EVICT_BATCH keys a command; a tenant's
 * pinned sessions stay there (their store_meta says so, read with a GETRANGE each) as its pinned
 * sessions here stay. Of every tenant (--all-unpinned): what this daemon spilled and the store
 * still holds, by its spill records (a record past its time dropped without a command). *count:
 * how many the store had. A command that fails stops there (the store is down, or refuses), and
 * the status says how many went. The spill records of what went are dropped; of a walk that
 * failed, kept (the store's time bounds them). A store user whose ACL refuses the walk (NOPERM:
 * SCAN, or a tenant's GETRANGE) leaves the spill records: the keys they name of the tenant or id
 * go, and a tenant's EVICT (or an id's no record names) fails saying the rest stays. */
#define EVICT_BATCH 512

static bool spill_matches(const struct skv_spill_rec *r, const char *tenant, const uint8_t *id)
{
    return (!tenant || strcmp(r->tenant, tenant) == 0) && (!id || memcmp(r->id, id, SKV_SESSION_ID_BYTES) == 0);
}

/* the keys batch[0 .. *n) deleted; *n back to 0 */
static int evict_batch(struct skv_worker *w, const char **batch, int *n, uint32_t *count)
{
    int deleted = 0, rc = skv_store_delete_many(w->store, batch, *n, &deleted);
    *count += (uint32_t)deleted;
    *n = 0;
    return rc;
}

/* An EVICT's working memory (one allocation): the keys of a batch to delete (batch[i] pointing
 * into key[i]), a SCAN page's next keys looked at (look), and the tails of up to EVICT_BATCH
 * entries (skv_store_tails: one round trip for all), for their store_meta. */
#define EVICT_TAIL (sizeof(struct store_meta) + STORE_MAC_BYTES)
struct evict_bufs {
    char key[EVICT_BATCH][STORE_KEY_MAX];
    const char *batch[EVICT_BATCH], *look[EVICT_BATCH];
    unsigned char tail[EVICT_BATCH * EVICT_TAIL];
    size_t got[EVICT_BATCH];
    signed char state[EVICT_BATCH];
};

/* Whether entry i of the tails read is a pinned session's (its store_meta says so). */
static bool tail_pinned(const struct evict_bufs *b, int i)
{
    struct store_meta meta;
    return b->state[i] == SKV_TAIL_VALUE && store_meta_read(b->tail + (size_t)i * EVICT_TAIL, b->got[i], &meta) &&
           meta.pinned;
}

/* By the spill records (this daemon's spills since it started): the store's keys of those of
 * tenant / id (NULL: any) deleted, and the records with them; without an id, an entry that is a
 * pinned session's now (another daemon took the session back, pinned it and its stop drained it
 * under the same key) stays. --all-unpinned, and a tenant's or an id's EVICT when the store may
 * not be searched. */
static int store_evict_records(struct skv_worker *w, const char *tenant, const uint8_t *id, uint32_t *count,
                               struct evict_bufs *b)
{
    const char **keys = b->batch;
    spill_prune(w);
    int rc = SKV_OK;
    size_t at[EVICT_BATCH];
    for (size_t end = w->n_spills; !rc && end > 0;) {
        int looked = 0;
        while (end > 0 && looked < EVICT_BATCH) {
            const struct skv_spill_rec *r = &w->spills[--end];
            if (!spill_matches(r, tenant, id))
                continue;
            at[looked] = end;
            keys[looked] = b->key[looked];
            store_key(w, r->tenant, r->id, false, b->key[looked], STORE_KEY_MAX);
            looked++;
        }
        if (!id) { /* one GETRANGE each, pipelined; a user that may not GETRANGE a key: not known to be pinned */
            rc = skv_store_tails(w->store, keys, looked, EVICT_TAIL, b->tail, b->got, b->state);
            if (rc && skv_store_refused(w->store))
                rc = SKV_OK;
        }
        if (rc) /* (this batch's records kept: nothing of it was deleted) */
            break;
        int n = 0;
        for (int j = 0; j < looked; j++)
            if (id || !tail_pinned(b, j))
                keys[n++] = keys[j];
        if ((rc = evict_batch(w, keys, &n, count)))
            break;
        for (int j = 0; j < looked; j++) /* (gone from the store, or another daemon's pinned session
                                           * now: at[] decreasing, so the last record, moved into
                                           * the place, was looked at already) */
            w->spills[at[j]] = w->spills[--w->n_spills];
    }
    if (!rc)
        return SKV_OK;
    char why[256]; /* (skv_errorf formats into the buffer skv_error_msg reads) */
    snprintf(why, sizeof why, "%s", rc == SKV_E_NOMEM ? "no memory" : skv_error_msg());
    size_t left = 0;
    for (size_t i = 0; i < w->n_spills; i++)
        left += spill_matches(&w->spills[i], tenant, id);
    return skv_errorf(rc, "%zu session(s) this daemon spilled are still in the store (%u deleted): %s", left, *count,
                      why);
}

static int store_evict(struct skv_worker *w, const char *tenant, const uint8_t *id, uint32_t *count)
{
    *count = 0;
    struct evict_bufs *b = malloc(sizeof *b);
    if (!b)
        return skv_errorf(SKV_E_NOMEM, "no memory for the store's keys: nothing deleted there");
    int rc = SKV_OK;
    if (!tenant && !id) {
        rc = store_evict_records(w, NULL, NULL, count, b);
        free(b);
        return rc;
    }
    char hex[2 * SKV_SESSION_ID_BYTES + 1];
    if (id)
        skv_session_id_hex(id, hex);
    int n = 0;
    for (int legacy = 0; legacy < 2 && !rc; legacy++) {
        const char *fp = legacy ? w->m->legacy_fingerprint : w->m->fingerprint;
        if (legacy && strcmp(fp, w->m->fingerprint) == 0)
            break;
        char match[STORE_KEY_MAX];
        snprintf(match, sizeof match, "snapkv:%s:%s:%s", fp, id ? "*" : tenant, id ? hex : "*");
        uint64_t cursor = 0;
        do {
            char *keys = NULL;
            int m = 0;
            if ((rc = skv_store_scan(w->store, &cursor, match, &keys, &m)))
                break;
            const char *k = keys;
            for (int i = 0; i < m && !rc;) {
                int nl = 0; /* the page's next keys of ours, up to EVICT_BATCH */
                for (; i < m && nl < EVICT_BATCH; k += strlen(k) + 1, i++)
                    if (strlen(k) < STORE_KEY_MAX) /* (a longer one is not one of ours) */
                        b->look[nl++] = k;
                if (n + nl > EVICT_BATCH && (rc = evict_batch(w, b->batch, &n, count)))
                    break; /* (room for all of them first: no command between a refused read and the
                            * fallback below, which reads its message) */
                int ok = nl; /* the keys before the first whose read failed (all: no read failed) */
                if (!id && (rc = skv_store_tails(w->store, b->look, nl, EVICT_TAIL, b->tail, b->got, b->state))) {
                    ok = 0; /* (a failed connection, or another error: none of them) */
                    while (skv_store_refused(w->store) && ok < nl && b->state[ok] == SKV_TAIL_VALUE)
                        ok++;
                }
                for (int j = 0; j < ok; j++) {
                    if (!id && tail_pinned(b, j))
                        continue;
                    b->batch[n] = b->key[n];
                    snprintf(b->key[n++], STORE_KEY_MAX, "%s", b->look[j]);
                }
            }
            skv_store_value_free(keys);
        } while (!rc && cursor);
    }
    if (!rc && n)
        rc = evict_batch(w, b->batch, &n, count);
    if (rc && skv_store_refused(w->store)) {
        /* a store user whose ACL lacks SCAN or GETRANGE: what this daemon spilled is what it can
         * name (the keys found before the refusal first) */
        char refused[160]; /* (cut: the message below fits the error buffer with its advice) */
        snprintf(refused, sizeof refused, "%s", skv_error_msg());
        uint32_t found = *count;
        rc = n ? evict_batch(w, b->batch, &n, count) : SKV_OK;
        if (!rc)
            rc = store_evict_records(w, tenant, id, count, b);
        free(b);
        if (!rc && id && *count > found)
            return SKV_OK; /* the id's entry was one of this daemon's */
        if (!rc)
            rc = skv_errorf(SKV_E_IO, "the store refused the search (%s): %u of %s%s%s deleted there, by this "
                            "daemon's spill records; the rest there stays until store-keep-seconds: give the store "
                            "user SCAN and GETRANGE", refused, *count, id ? "session " : "tenant ", id ? hex : tenant,
                            id ? "'s entries" : "'s sessions");
        return rc;
    }
    free(b);
    if (rc) {
        char why[256];
        snprintf(why, sizeof why, "%s", rc == SKV_E_NOMEM ? "no memory" : skv_error_msg());
        return skv_errorf(rc, "%u session(s) deleted from the store; the rest of %s%s%s there could not be reached: "
                          "%s", *count, id ? "session " : "tenant ", id ? hex : tenant, id ? "" : "'s sessions",
                          why);
    }
    for (size_t i = 0; i < w->n_spills;)
        if (spill_matches(&w->spills[i], tenant, id))
            w->spills[i] = w->spills[--w->n_spills];
        else
            i++;
    return SKV_OK;
}

static void handle_load(struct skv_worker *w, struct skv_job *job)
{
    const Snapkv__LoadRequest *q = job->req->load;
    char path[1200];
    const char *tenant = q->tenant && *q->tenant ? q->tenant : DEFAULT_TENANT;
    struct skv_session *s = NULL;
    int32_t saved_rows = -1;
    int rc = save_path(w, q->name, path, sizeof path);
    if (!rc)
        rc = session_load(w, path, tenant, "load", NULL, &s, &saved_rows);
    if (rc) {
        fail_rc(w, job, rc);
        return;
    }
    if (saved_rows >= 0) /* rows computed as this daemon computes them serve prefix reuse */
        s->computed_rows = saved_rows;
    skv_worker_event_stored(w, s);
    Snapkv__Reply rep;
    Snapkv__LoadReply lr = SNAPKV__LOAD_REPLY__INIT;
    reply_init(&rep, job);
    lr.session_id = (ProtobufCBinaryData){SKV_SESSION_ID_BYTES, s->id};
    rep.result_case = SNAPKV__REPLY__RESULT_LOAD;
    rep.load = &lr;
    skv_worker_reply(w, job, &rep);
}

/* ---- sessions kept across a restart (persist = yes) ---------------------------------------------
 * A save writes, under <state-dir>/persist, every session (the SAVE format, version 6: its full
 * KV blocks, and a partly filled last one other sessions hold too, named by their index in one
 * block store) most recently used first and within
 * persist-max-seconds, then the kept prefixes (prefix-retain-bytes) as full-cache sessions of
 * their own, and sessions.json, the manifest: the generation, the block store and
 * how many blocks of it count, and per session its file's generation, id, tenant, owner, pin,
 * lease and how long it had been idle. Saves are numbered (generations) and each one leaves the
 * last one's files until its manifest replaces the last one's, so a crash in the middle of one
 * leaves the last intact. A save appends to the block store of the last one only the blocks
 * that store does not hold (a new store when most of it is blocks no session holds), and
 * writes only the sessions whose file would differ from the one the last manifest names:
 * a checkpoint after one session changed writes that session. At start the sessions are
 * loaded under their ids, least recently used first (so when the pool is smaller than before,
 * eviction takes the least recently used). */
#define PERSIST_MANIFEST "sessions.json"
#define PERSIST_SPILLED "spilled"
#define SPILLED_RECORD (2 + 2 * SKV_SESSION_ID_BYTES) /* 'S' or 'T', the id's hex, '\n' */
#define SPILLED_MAX_BYTES (64 << 20)
#define PERSIST_BLOCKS "blocks" /* the block store the sessions' files name: blocks-<gen>.skvb */
/* a new block store when more of the last one's blocks are no session's than are, and at least
 * this many (8 MiB of blocks of 64 rows of 128 at f32 and 16 rows) */
#define PERSIST_STORE_GARBAGE 256

/* The name of a file of generation gen: "<name>-<gen><ext>" ("<name><ext>" for 0: a save before
 * generations were numbered). */
static void persist_name(char *out, size_t cap, const char *name, uint64_t gen, const char *ext)
{
    if (gen)
        snprintf(out, cap, "%s-%llu%s", name, (unsigned long long)gen, ext);
    else
        snprintf(out, cap, "%s%s", name, ext);
}

static int persist_dir(const struct skv_worker *w, char *out, size_t cap)
{
    if ((size_t)snprintf(out, cap, "%s/persist", w->cfg->state_dir) >= cap)
        return skv_errorf(SKV_E_INVAL, "state directory path too long");
    return SKV_OK;
}

/* With persist and a store, the sessions handed to the store since the manifest was written:
 * <state-dir>/persist/spilled, a line each, 'S' and the id's hex when one is spilled, 'T' when
 * the store no longer holds it (taken back, or dropped as it was taken). A restore after a crash
 * leaves a session whose last record is 'S' in the store instead of bringing back its checkpoint
 * (before, both were there: the checkpoint older, and the store's copy taken by another host
 * meanwhile, or spilled over by the older one later); a save that writes the manifest removes
 * the file. It is kept short: past twice its size after the last compaction (and 256 KiB) it
 * is written again with only the ids the manifest names whose last record is 'S'. */
#define SPILLED_COMPACT_BYTES (256 << 10)

struct spilled_rec {
    char hex[2 * SKV_SESSION_ID_BYTES + 1];
    char what;
    size_t at; /* its place in the file */
};

static int spilled_order(const void *a, const void *b)
{
    const struct spilled_rec *x = a, *y = b;
    int c = strcmp(x->hex, y->hex);
    return c ? c : x->at < y->at ? -1 : x->at > y->at;
}

static int hex_order(const void *a, const void *b)
{
    return strcmp(a, ((const struct spilled_rec *)b)->hex);
}

/* The ids in the spilled file at path whose last record is 'S' (in the store now), sorted; *n
 * of them (NULL, 0 without the file; *ok false when it is there and could not be read). A line
 * that is not a whole record is skipped, the next read from after its newline. */
static struct spilled_rec *spilled_read(const char *path, size_t *n, bool *ok)
{
    *n = 0;
    *ok = true;
    int fd = open_state_file(path);
    if (fd < 0) {
        *ok = fd == SKV_E_NOT_FOUND;
        return NULL;
    }
    struct stat sb = {0};
    char *text = NULL;
    struct spilled_rec *r = NULL;
    size_t len = 0, m = 0;
    if (fstat(fd, &sb) != 0 || sb.st_size > SPILLED_MAX_BYTES ||
        !(text = malloc((size_t)sb.st_size + 1)) || !(r = calloc((size_t)sb.st_size / SPILLED_RECORD + 1, sizeof *r)))
        *ok = false;
    for (ssize_t k; *ok && len < (size_t)sb.st_size && (k = read(fd, text + len, (size_t)sb.st_size - len)) > 0;)
        len += (size_t)k;
    close(fd);
    for (size_t at = 0; *ok && at < len;) {
        const char *p = text + at, *nl = memchr(p, '\n', len - at);
        size_t line = nl ? (size_t)(nl - p) + 1 : len - at;
        if (nl && line > SPILLED_RECORD) /* a record after a torn one (a host's crash): its end */
            p += line - SPILLED_RECORD;
        bool whole = nl && line >= SPILLED_RECORD && (p[0] == 'S' || p[0] == 'T');
        for (int i = 1; whole && i < SPILLED_RECORD - 1; i++)
            whole = isxdigit((unsigned char)p[i]) && !isupper((unsigned char)p[i]);
        if (whole) {
            memcpy(r[m].hex, p + 1, 2 * SKV_SESSION_ID_BYTES);
            r[m].hex[2 * SKV_SESSION_ID_BYTES] = '\0';
            r[m].what = p[0];
            r[m++].at = (size_t)(p - text);
        }
        at += line;
    }
    free(text);
    if (!*ok) {
        free(r);
        return NULL;
    }
    if (m)
        qsort(r, m, sizeof *r, spilled_order);
    size_t out = 0;
    for (size_t i = 0; i < m; i++) /* each id's last record */
        if ((i + 1 == m || strcmp(r[i].hex, r[i + 1].hex) != 0) && r[i].what == 'S')
            r[out++] = r[i];
    *n = out;
    if (!out) {
        free(r);
        return NULL;
    }
    return r;
}

/* Whether the manifest on disk names session hex (persist_keep's list; not known, as before the
 * restore's persist_keep, when its list is empty: yes). */
static bool manifest_names(const struct skv_worker *w, const char *hex)
{
    if (w->n_persist_files <= 0)
        return true;
    int lo = 0, hi = w->n_persist_files; /* the first name >= hex: "<hex>-<gen>.skv" sorts right there */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (strcmp(w->persist_files[mid], hex) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    size_t n = strlen(hex);
    return lo < w->n_persist_files && strncmp(w->persist_files[lo], hex, n) == 0 &&
           (w->persist_files[lo][n] == '-' || w->persist_files[lo][n] == '.');
}

/* The spilled file written again with what a restore needs of it; false when that failed
 * (errno says why). */
static bool spilled_compact(struct skv_worker *w, const char *path)
{
    size_t n = 0, kept = 0;
    bool ok = true;
    struct spilled_rec *r = spilled_read(path, &n, &ok);
    char tmp[1300];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int fd = ok ? open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600) : -1;
    ok = fd >= 0;
    int err = ok ? 0 : errno ? errno : EIO;
    for (size_t i = 0; ok && i < n; i++) {
        if (!manifest_names(w, r[i].hex))
            continue;
        char rec[SPILLED_RECORD + 1];
        snprintf(rec, sizeof rec, "S%s\n", r[i].hex);
        errno = EIO; /* (a short write sets none) */
        if (!(ok = write(fd, rec, SPILLED_RECORD) == SPILLED_RECORD))
            err = errno;
        kept++;
    }
    if (ok && fsync(fd) != 0) { /* its records on disk before its name replaces the file's */
        ok = false;
        err = errno;
    }
    if (fd >= 0 && close(fd) != 0 && ok) {
        ok = false;
        err = errno;
    }
    char dir[1300];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash)
        *slash = '\0';
    if (ok && rename_durable(tmp, path, slash ? dir : ".") != SKV_OK) {
        ok = false;
        err = errno;
    }
    if (!ok)
        unlink(tmp);
    free(r);
    errno = err;
    w->spilled_compacted = ok ? (uint64_t)kept * SPILLED_RECORD : w->spilled_compacted;
    return ok;
}

/* <dir>/spilled into out[cap] (dir: the persist directory). */
static void spilled_path(const char *dir, char *out, size_t cap)
{
    snprintf(out, cap, "%s/%s", dir, PERSIST_SPILLED);
}

static void spilled_note(struct skv_worker *w, char what, const uint8_t *id)
{
    char dir[1100], path[1200], rec[SPILLED_RECORD + 1], msg[512];
    if (!w->cfg->persist || !w->store || persist_dir(w, dir, sizeof dir))
        return;
    snprintf(msg, sizeof msg, "%s", skv_error_msg()); /* the request's message, kept for its reply */
    spilled_path(dir, path, sizeof path);
    rec[0] = what;
    skv_session_id_hex(id, rec + 1);
    rec[SPILLED_RECORD - 1] = '\n';
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600);
    struct stat sb = {0};
    errno = EIO; /* (a short write sets none) */
    /* on disk before the reply: a 'T' lost to a power cut left the session neither in the
     * store nor restored from its file (the 'S' before it said the store had it) */
    bool ok = fd >= 0 && fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode) &&
              write(fd, rec, SPILLED_RECORD) == SPILLED_RECORD && fdatasync(fd) == 0 && fstat(fd, &sb) == 0;
    int err = errno;
    if (fd >= 0)
        close(fd);
    if (ok && sb.st_size == SPILLED_RECORD) { /* made now: its name too */
        int dfd = open(dir, O_RDONLY | O_DIRECTORY);
        if (dfd >= 0) {
            fsync(dfd);
            close(dfd);
        }
    }
    uint64_t limit = 2 * w->spilled_compacted > SPILLED_COMPACT_BYTES ? 2 * w->spilled_compacted
                                                                       : SPILLED_COMPACT_BYTES;
    if (ok && (uint64_t)sb.st_size > limit && !(ok = spilled_compact(w, path)))
        err = errno;
    if (!ok) { /* without it a restore brings back every file, as before it (a record lost could lose a session) */
        unlink(path);
        skv_log(SKV_LOG_WARN, "persist: %s: %s: the record of the sessions handed to the store is dropped: a restore "
                "after a crash brings back their files, older than the store's copies", path, strerror(err));
    }
    skv_errorf(SKV_OK, "%s", msg);
}

static bool ends_with(const char *s, const char *end)
{
    size_t n = strlen(s), m = strlen(end);
    return n >= m && strcmp(s + n - m, end) == 0;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The manifest's generation (0: written before generations were numbered). */
static uint64_t manifest_gen(const json_t *doc)
{
    const json_t *g = json_object_get(doc, "generation");
    return json_is_integer(g) && json_integer_value(g) > 0 ? (uint64_t)json_integer_value(g) : 0;
}

/* The file name of the manifest's block store ("" when it names one that is not a store's name). */
static void manifest_store(const json_t *doc, char *out, size_t cap)
{
    const char *name = json_string_value(json_object_get(doc, "store"));
    if (!name) { /* before stores lived across saves: the generation's */
        persist_name(out, cap, PERSIST_BLOCKS, manifest_gen(doc), ".skvb");
        return;
    }
    size_t n = strlen(name), pre = strlen(PERSIST_BLOCKS "-");
    bool ok = n > pre + 5 && n < cap && n < PERSIST_STORE_NAME_MAX && strncmp(name, PERSIST_BLOCKS "-", pre) == 0 &&
              ends_with(name, ".skvb") && strspn(name + pre, "0123456789") == n - pre - 5;
    snprintf(out, cap, "%s", ok ? name : "");
}

/* The generation of the file of manifest entry e (its own, or the manifest's). */
static uint64_t entry_gen(const json_t *doc, const json_t *e)
{
    const json_t *g = json_object_get(e, "file_generation");
    return json_is_integer(g) && json_integer_value(g) > 0 ? (uint64_t)json_integer_value(g) : manifest_gen(doc);
}

/* Replaces the worker's list of the files a manifest names (doc NULL: none). */
static void persist_keep(struct skv_worker *w, const json_t *doc)
{
    for (int i = 0; i < w->n_persist_files; i++)
        free(w->persist_files[i]);
    free(w->persist_files);
    w->persist_files = NULL;
    w->n_persist_files = 0;
    if (!doc) /* keep nothing: the next sweep empties the directory */
        return;
    const json_t *sessions = json_object_get(doc, "sessions"), *kept = json_object_get(doc, "kept");
    size_t n_sessions = json_array_size(sessions), n = n_sessions + json_array_size(kept);
    char **files = calloc(n + 2, sizeof *files);
    if (!files)
        goto none;
    char name[128];
    int k = 0;
    files[k++] = strdup(PERSIST_MANIFEST);
    manifest_store(doc, name, sizeof name);
    files[k++] = strdup(name);
    for (size_t i = 0; i < n; i++) { /* the sessions' files, then the kept prefixes' */
        const json_t *e = i < n_sessions ? json_array_get(sessions, i) : json_array_get(kept, i - n_sessions);
        const char *hex = json_string_value(json_object_get(e, "id"));
        if (!hex || strlen(hex) != 2 * SKV_SESSION_ID_BYTES)
            continue;
        persist_name(name, sizeof name, hex, entry_gen(doc, e), ".skv");
        files[k++] = strdup(name);
    }
    for (int i = 0; i < k; i++)
        if (!files[i]) { /* no memory: no list */
            for (int j = 0; j < k; j++)
                free(files[j]);
            free(files);
            goto none;
        }
    qsort(files, (size_t)k, sizeof *files, by_name);
    w->persist_files = files;
    w->n_persist_files = k;
    return;
none: /* what the manifest on disk names is not known: sweeps remove nothing until a save knows again */
    w->n_persist_files = -1;
}

/* Whether f is a file saves leave (sessions, block stores, their temporary files, manifests). */
static bool persist_ours(const char *f)
{
    return ends_with(f, ".skv") || ends_with(f, ".skv.tmp") || ends_with(f, ".skvb") ||
           strncmp(f, PERSIST_MANIFEST, strlen(PERSIST_MANIFEST)) == 0;
}

/* Removes what saves left in dir except the files the manifest on disk names (persist_keep). */
static void persist_sweep(struct skv_worker *w, const char *dir)
{
    DIR *d = w->n_persist_files >= 0 ? opendir(dir) : NULL;
    if (!d)
        return;
    for (struct dirent *e; (e = readdir(d));) {
        const char *f = e->d_name;
        bool ours = persist_ours(f);
        bool kept = w->n_persist_files > 0 &&
                    bsearch(&f, w->persist_files, (size_t)w->n_persist_files, sizeof *w->persist_files, by_name);
        if (ours && !kept)
            unlinkat(dirfd(d), f, 0);
    }
    closedir(d);
}

static void persist_wipe(struct skv_worker *w, const char *dir)
{
    persist_keep(w, NULL);
    persist_sweep(w, dir);
}

#define PERSIST_ASIDE_SETS 4 /* persist.unrestored, .2, .3, .4 */

/* Copies the file `name` of directory sfd into directory dfd under that name; 0, or -1 with
 * errno. */
static int copy_at(int sfd, const char *name, int dfd)
{
    int in = openat(sfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC), err = 0;
    struct stat sb;
    if (in >= 0 && (fstat(in, &sb) != 0 || !S_ISREG(sb.st_mode))) { /* no FIFO to wait on */
        close(in);
        in = -1;
        errno = EINVAL;
    }
    int out = in >= 0 ? openat(dfd, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600) : -1;
    char buf[65536];
    ssize_t k = out >= 0 ? 1 : -1;
    while (k > 0 && (k = read(in, buf, sizeof buf)) > 0) {
        errno = EIO; /* (a short write sets none) */
        if (write(out, buf, (size_t)k) != k)
            k = -1;
    }
    if (k < 0)
        err = errno ? errno : EIO;
    if (out >= 0 && close(out) != 0 && !err)
        err = errno;
    if (in >= 0)
        close(in);
    errno = err;
    return err ? -1 : 0;
}

/* The state files in directory fd dfd (what a set aside holds): how many, removed unless
 * count_only. */
static int aside_files(int dfd, bool count_only)
{
    int n = 0;
    DIR *d = fdopendir(dup(dfd));
    if (!d)
        return 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (!persist_ours(e->d_name) && strcmp(e->d_name, PERSIST_SPILLED) != 0)
            continue;
        n++;
        if (!count_only)
            unlinkat(dfd, e->d_name, 0);
    }
    closedir(d);
    return n;
}

/* What a start could not restore is not lost: before the restore removes those files from dir,
 * every file of the saved state (manifest, session files, block store; no temporary file) is
 * linked into dir.unrestored, or dir.unrestored.2 ... .4 when the earlier ones hold a set (an
 * earlier start's: it is never replaced, since the later set may be the lesser, e.g. a session
 * made under a wrong model while the right one's sessions wait aside). Nothing is copied but the
 * spilled record (appended to from then on: a copy of it, dropped alone when that fails), and
 * the daemon writes none of those files again (a save writes new session files, and a store is
 * not continued after this), so a set stays as its stop left it: stop the daemon and move it
 * back to restore it. At most four sets (the disk of four saves); with four there, or when a
 * link fails, this start's is not kept. Returns the files linked (-1 when none could be). */
static int persist_set_aside(const char *dir, const char *why)
{
    char aside[1200];
    int afd = -1;
    for (int k = 1; k <= PERSIST_ASIDE_SETS && afd < 0; k++) {
        if ((size_t)snprintf(aside, sizeof aside, k == 1 ? "%s.unrestored" : "%s.unrestored.%d", dir, k) >=
            sizeof aside)
            return -1;
        if (mkdir(aside, 0700) < 0 && errno != EEXIST)
            break;
        afd = open(aside, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (afd >= 0 && aside_files(afd, true) > 0) { /* an earlier start's set: kept */
            close(afd);
            afd = -1;
        }
    }
    DIR *d = afd >= 0 ? opendir(dir) : NULL;
    if (!d) {
        skv_log(SKV_LOG_WARN, "persist: %s; the saved state could not be kept aside (%s: %s, or %d sets are kept "
                "already): the sessions not restored are lost", why, afd >= 0 ? dir : aside, strerror(errno),
                PERSIST_ASIDE_SETS);
        if (afd >= 0)
            close(afd);
        return -1;
    }
    int n = 0, failed = 0;
    for (struct dirent *e; (e = readdir(d));) {
        /* the files, and a copy of the spilled record (appended to from now on; without it a
         * recovery from the set would restore sessions the store holds) */
        if (strcmp(e->d_name, PERSIST_SPILLED) == 0) {
            if (copy_at(dirfd(d), e->d_name, afd) == 0) {
                n++;
            } else { /* the set without it: a recovery from it restores every file, as before it */
                unlinkat(afd, e->d_name, 0);
                skv_log(SKV_LOG_WARN, "persist: %s/%s could not be copied into the set aside: %s", dir, e->d_name,
                        strerror(errno));
            }
            continue;
        }
        if (!persist_ours(e->d_name) || ends_with(e->d_name, ".tmp"))
            continue;
        if (linkat(dirfd(d), e->d_name, afd, e->d_name, 0) == 0)
            n++;
        else
            failed = errno;
    }
    closedir(d);
    if (failed) { /* a set without all its files (the store, say) restores nothing: none */
        aside_files(afd, false);
        close(afd);
        skv_log(SKV_LOG_WARN, "persist: %s; linking the saved state into %s failed (%s): the sessions not restored "
                "are lost", why, aside, strerror(failed));
        return -1;
    }
    close(afd);
    skv_log(SKV_LOG_WARN, "persist: %s; the %d file(s) of the saved state are kept in %s (stop the daemon and "
            "move them back to persist/ to restore them)", why, n, aside);
    return n;
}

void skv_requests_persist_close(struct skv_worker *w)
{
    skv_kv_store_close(&w->persist_store);
    persist_keep(w, NULL);
}

struct persist_list {
    struct skv_session **s;
    int n, cap;
};

static bool persist_collect(void *user, struct skv_session *s)
{
    struct persist_list *l = user;
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 64;
        struct skv_session **more = realloc(l->s, (size_t)cap * sizeof *more);
        if (!more)
            return false;
        l->s = more;
        l->cap = cap;
    }
    l->s[l->n++] = s;
    return false;
}

/* The order of a save: pinned sessions first (an admin asked to keep them; a pinned document
 * is often the least recently used, its forks doing the work), then the most recently used. */
static int by_save_order(const void *a, const void *b)
{
    const struct skv_session *s = *(struct skv_session *const *)a, *t = *(struct skv_session *const *)b;
    if (s->pinned != t->pinned)
        return s->pinned ? -1 : 1;
    return s->last_used_ms < t->last_used_ms ? 1 : s->last_used_ms > t->last_used_ms ? -1 : 0;
}

/* The block store a save of generation gen appends to: the last save's, unless a write to it
 * failed or, at a checkpoint, most of it is blocks no session held at that save; then a new one
 * (*fresh), which the worker takes when the save ends well. NULL when none can be made (each file
 * then holds its rows whole). The save at a stop does not start a new store for its garbage: a
 * session it then failed to write would be lost (its last file names the old store's blocks);
 * nor does the checkpoint after one into a new store failed on a session it could not carry
 * over (persist_keep_store): appending to the last store, it can carry that session, where a new
 * store each time would fail on it at every try. */
static struct skv_kv_store *persist_store(struct skv_worker *w, const char *dir, uint64_t gen, bool checkpoint,
                                          char *name, size_t cap, bool *fresh)
{
    struct skv_kv_store *st = w->persist_store;
    *fresh = false;
    if (st && skv_kv_store_usable(st)) {
        if (!checkpoint || w->persist_keep_store || !skv_kv_store_mostly_garbage(st, PERSIST_STORE_GARBAGE)) {
            snprintf(name, cap, "%s", w->persist_store_name);
            return st;
        }
        uint32_t n = skv_kv_store_blocks(st);
        skv_log(SKV_LOG_INFO, "persist: a new block store: %u of the last one's %u blocks are no session's",
                n - skv_kv_store_live(st), n);
    }
    char path[1300];
    persist_name(name, cap, PERSIST_BLOCKS, gen, ".skvb");
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (skv_kv_store_create(path, w->m->fingerprint, w->m->kv_pool, &st)) {
        skv_log(SKV_LOG_WARN, "persist: no block store (%s): each session's file holds its rows whole",
                skv_error_msg());
        name[0] = '\0';
        return NULL;
    }
    /* its name on disk before a manifest names it (the manifest's rename syncs the directory
     * too, but POSIX does not promise that one sync covers an entry made before) */
    int dfd = open(dir, O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    *fresh = true;
    return st;
}

/* Session s's file of a save of generation gen, as hex's: with a block store, written only
 * when its bytes differ from those of the file the last manifest names for it (kept then:
 * *file_gen is its generation, *bytes 0); sum: its checksum. */
static int persist_session(struct skv_worker *w, struct skv_session *s, const char *dir, const char *hex,
                           uint64_t gen, struct skv_kv_store *store, bool fresh, uint64_t *file_gen,
                           unsigned char sum[32], long *bytes)
{
    char path[1300], name[128];
    persist_name(name, sizeof name, hex, gen, ".skv");
    snprintf(path, sizeof path, "%s/%s", dir, name);
    *file_gen = gen;
    if (!store) {
        memset(sum, 0, 32); /* never matched: such a file is written at every save */
        return session_save(w, s, dir, path, false, bytes);
    }
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f)
        return skv_errorf(SKV_E_NOMEM, "persist: a session's file in memory");
    int rc = session_write(w, s, f, store, sum);
    if (fclose(f) != 0 && !rc)
        rc = skv_errorf(SKV_E_NOMEM, "persist: a session's file in memory");
    if (!rc && !fresh && s->persist_gen && memcmp(sum, s->persist_sum, 32) == 0) {
        *file_gen = s->persist_gen; /* unchanged since */
        *bytes = 0;
    } else if (!rc) {
        rc = file_write(w, s, buf, len, dir, path, false, bytes);
    }
    free(buf);
    return rc;
}

struct persist_saved { /* a session a save wrote or kept, recorded in it when the manifest is on disk */
    struct skv_session *s;
    uint64_t gen;
    unsigned char sum[32];
};

/* Writes every session as generation persist_gen + 1 (see above) and, when all went to disk, a
 * manifest naming it, then removes the files no manifest names. give_way: stop at the first
 * request that arrives (SKV_E_CANCELLED, the last generation left as it was). */
/* Session s's entry in a manifest: its file of generation gen, and how many of the first rows
 * that file holds prefix reuse may take (computed: s's computed_rows when the file was written
 * now; 0 for a file of an earlier checkpoint, whose rows then may have been others). */
static json_t *manifest_entry(const char *hex, uint64_t gen, const struct skv_session *s, int32_t computed,
                              uint64_t now)
{
    return json_pack("{s:s, s:I, s:s, s:s, s:b, s:I, s:I, s:i}", "id", hex, "file_generation", (json_int_t)gen,
                     "tenant", s->tenant, "owner", s->owner, "pinned", s->pinned, "lease_seconds",
                     (json_int_t)s->lease_seconds, "idle_ms",
                     (json_int_t)(now > s->last_used_ms ? now - s->last_used_ms : 0), "computed_rows", (int)computed);
}

/* A checkpoint that does not write session s (past persist-max-seconds, or its write failed)
 * names the file the last manifest named for it, when it has one in this same store (which has
 * only grown since): a crash then restores s as that earlier checkpoint saw it, where before
 * this checkpoint removed the file and s was lost. At a stop such a session is left out: a
 * client would find it restored older than it left it. Its blocks are not marked live in the
 * store, so the store may be replaced sooner; a new store carries nothing over. */
static bool persist_carry(struct skv_session *s, const char *hex, const struct skv_kv_store *store, bool fresh,
                          json_t *list, struct persist_saved *p, uint64_t now)
{
    if (!store || fresh || !s->persist_gen)
        return false;
    json_t *entry = manifest_entry(hex, s->persist_gen, s, 0, now);
    if (!entry || json_array_append_new(list, entry))
        return false;
    p->s = s;
    p->gen = s->persist_gen;
    memcpy(p->sum, s->persist_sum, sizeof p->sum);
    return true;
}

/* Kept prefix e (prefix-retain-bytes) as the session its persist file holds: its tokens and
 * their rows, every one computed here, policy full, owned by its tenant. The shell owns
 * nothing: its tokens and cache are e's. */
static void kept_shell(const struct skv_prefix_entry *e, struct skv_session *s)
{
    memset(s, 0, sizeof *s);
    memcpy(s->id, e->id, sizeof s->id);
    snprintf(s->tenant, sizeof s->tenant, "%s", e->tenant);
    snprintf(s->owner, sizeof s->owner, "%s", e->tenant);
    s->tokens = e->tokens;
    s->n_tokens = s->cap_tokens = s->prompt_len = s->computed_rows = e->n_rows;
    s->cache = e->cache;
    snprintf(s->spec, sizeof s->spec, "policy=full");
    s->last_used_ms = e->last_used_ms;
    s->persist_gen = e->persist_gen;
    memcpy(s->persist_sum, e->persist_sum, sizeof s->persist_sum);
}

static int by_recent_use(const void *a, const void *b)
{
    const struct skv_prefix_entry *x = *(struct skv_prefix_entry *const *)a, *y = *(struct skv_prefix_entry *const *)b;
    return x->used < y->used ? 1 : x->used > y->used ? -1 : 0;
}

struct kept_saved { /* a kept prefix a save wrote or kept, recorded in it when the manifest is on disk */
    struct skv_prefix_entry *e;
    uint64_t gen;
    unsigned char sum[32];
};

/* A save that does not write kept prefix `shell` (past persist-max-seconds, a request waiting,
 * the store broken, its write failed) names its file of before where it has one in this same
 * store, as persist_carry does a session's at a checkpoint; at a stop too, since a kept prefix
 * never changes: that file holds it as it is. */
static bool kept_carry(const struct skv_session *shell, const char *hex, const struct skv_kv_store *store,
                       bool fresh, json_t *list, struct kept_saved *p, struct skv_prefix_entry *e, uint64_t now)
{
    if (!store || fresh || !shell->persist_gen)
        return false;
    json_t *entry = manifest_entry(hex, shell->persist_gen, shell, shell->computed_rows, now);
    if (!entry || json_array_append_new(list, entry))
        return false;
    *p = (struct kept_saved){e, shell->persist_gen, {0}};
    memcpy(p->sum, shell->persist_sum, sizeof p->sum);
    return true;
}

/* The kept prefixes' files of a save of generation gen and their manifest entries (into
 * list), the most recently used first, after the sessions: they are a cache, so they take what
 * time the sessions left (persist-max-seconds from t0) and, at a checkpoint, give way to a
 * client's request; one not written then, or once the store breaks, or whose write fails, keeps
 * its file of before where it has one (kept_carry). A failure of one costs that one (the block
 * store's costs those written now: persist_write, kept_keep_older). Returns how many were saved
 * into saved[] (n_kept entries of room); *bytes and *written get their files'. */
static int persist_kept(struct skv_worker *w, const char *dir, uint64_t gen, struct skv_kv_store *store, bool fresh,
                        bool give_way, uint64_t t0, json_t *list, struct skv_prefix_entry **kept, int n_kept,
                        struct kept_saved *saved, uint64_t *bytes, int *written)
{
    int n = 0, late = 0, failed = 0;
    bool waiting = false, broken = false;
    uint64_t now = skv_now_ms();
    for (int i = 0; i < n_kept; i++) {
        waiting = waiting || (give_way && skv_worker_has_queued(w));
        struct skv_session shell;
        kept_shell(kept[i], &shell);
        char hex[2 * SKV_SESSION_ID_BYTES + 1];
        skv_session_id_hex(shell.id, hex);
        struct kept_saved *p = &saved[n];
        if (waiting || broken || skv_now_ms() - t0 >= (uint64_t)w->cfg->persist_max_seconds * 1000) {
            if (kept_carry(&shell, hex, store, fresh, list, p, kept[i], now))
                n++;
            else
                late++;
            continue;
        }
        long size = 0;
        if (persist_session(w, &shell, dir, hex, gen, store, fresh, &p->gen, p->sum, &size)) {
            skv_log(SKV_LOG_WARN, "persist: kept prefix %s not written: %s", hex, skv_error_msg());
            broken = store && !skv_kv_store_usable(store); /* its end unknown: none is written after */
            if (kept_carry(&shell, hex, store, fresh, list, p, kept[i], now))
                n++;
            else
                failed++;
            continue;
        }
        skv_worker_beat(w);
        json_t *entry = manifest_entry(hex, p->gen, &shell, shell.computed_rows, now);
        if (!entry || json_array_append_new(list, entry)) { /* its file is no save's */
            skv_log(SKV_LOG_WARN, "persist: kept prefix %s not saved: no memory for its manifest entry", hex);
            failed++;
            continue;
        }
        p->e = kept[i];
        *bytes += (uint64_t)size;
        *written += p->gen == gen;
        n++;
    }
    if (late || failed)
        skv_log(SKV_LOG_INFO, "persist: %d of %d kept prefix(es) not saved: %d failed, %d not written (%s)",
                late + failed, n_kept, failed, late,
                broken ? "the block store failed" : waiting ? "a request waits" : "persist-max-seconds passed");
    return n;
}

/* The block store broke on the kept prefixes' blocks: of saved[0, n) (entries of list in order)
 * keeps those whose file is of an earlier save than gen, whose blocks were in the store before
 * this one. Returns how many. */
static int kept_keep_older(json_t *list, struct kept_saved *saved, int n, uint64_t gen)
{
    int k = 0;
    for (int i = 0; i < n; i++)
        if (saved[i].gen != gen)
            saved[k++] = saved[i];
        else
            json_array_remove(list, (size_t)k);
    return k;
}

static int persist_write(struct skv_worker *w, bool checkpoint, bool give_way)
{
    char dir[1100], path[1200], tmp[1300], store_name[48];
    int rc = persist_dir(w, dir, sizeof dir);
    if (rc)
        return rc;
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return skv_errorf(SKV_E_IO, "%s: %s", dir, strerror(errno));
    uint64_t gen = w->persist_gen + 1;
    persist_sweep(w, dir); /* what an interrupted save left */
    struct persist_list l = {0};
    skv_session_foreach(w->sessions, persist_collect, &l);
    if (l.n)
        qsort(l.s, (size_t)l.n, sizeof *l.s, by_save_order);
    struct persist_saved *saved_list = calloc((size_t)(l.n ? l.n : 1), sizeof *saved_list);
    json_t *list = json_array();
    uint64_t t0 = skv_now_ms(), now = t0, bytes = 0;
    int saved = 0, written = 0, failed = 0, late = 0, carried = 0, dropped = 0;
    bool stopped = false, fresh = false;
    struct skv_kv_store *store = persist_store(w, dir, gen, checkpoint, store_name, sizeof store_name, &fresh);
    /* a checkpoint into a new block store (or none) cannot carry a session over: the files of
     * the last one name blocks of the store it replaces. It writes every session the last one
     * holds (its manifest names it: a save without a store leaves persist_gen 0), past
     * persist-max-seconds too, and one it cannot write fails it, that last one staying (before,
     * the session was left out and lost to the next crash; with no store on a full disk, every
     * one was); the next checkpoint then appends to the last store when it can */
    const bool whole = checkpoint && (fresh || !store);
    if (store)
        skv_kv_store_begin(store);
    if (!saved_list || !list)
        rc = SKV_E_NOMEM;
    for (int i = 0; i < l.n && !stopped && !rc; i++) {
        struct skv_session *s = l.s[i];
        if (give_way && skv_worker_has_queued(w)) {
            stopped = true; /* a client waits: its request before the checkpoint */
            break;
        }
        char hex[2 * SKV_SESSION_ID_BYTES + 1];
        skv_session_id_hex(s->id, hex);
        struct persist_saved *p = &saved_list[saved];
        const bool held = whole && manifest_names(w, hex); /* the last checkpoint holds it */
        if (skv_now_ms() - t0 >= (uint64_t)w->cfg->persist_max_seconds * 1000 && !held) {
            if (checkpoint && persist_carry(s, hex, store, fresh, list, p, now))
                saved++, carried++;
            else
                late++;
            continue;
        }
        long size = 0;
        if (persist_session(w, s, dir, hex, gen, store, fresh, &p->gen, p->sum, &size)) {
            skv_log(SKV_LOG_WARN, "persist: session %s not saved: %s", hex, skv_error_msg());
            if (store && !skv_kv_store_usable(store)) {
                failed++;
                break; /* the store's end is unknown: the sessions after would fail too */
            }
            if (checkpoint && persist_carry(s, hex, store, fresh, list, p, now)) {
                saved++, carried++;
            } else {
                failed++;
                dropped += held;
            }
            continue;
        }
        skv_worker_beat(w);
        json_t *entry = manifest_entry(hex, p->gen, s, s->computed_rows, now);
        if (!entry || json_array_append_new(list, entry)) { /* a file the manifest does not name is no save */
            skv_log(SKV_LOG_WARN, "persist: session %s not saved: no memory for its manifest entry", hex);
            failed++;
            continue;
        }
        p->s = s;
        bytes += (uint64_t)size;
        written += p->gen == gen;
        saved++;
    }
    int n_kept = w->prefix.n, kept_saved = 0;
    struct skv_prefix_entry **kept = calloc((size_t)(n_kept ? n_kept : 1), sizeof *kept);
    struct kept_saved *kept_list = calloc((size_t)(n_kept ? n_kept : 1), sizeof *kept_list);
    json_t *kept_json = json_array();
    bool kept_ran = false, kept_lost = false;
    uint64_t kept_bytes = 0;
    int kept_written = 0;
    uint32_t named = 0; /* the store's blocks with the sessions' on disk, before the kept prefixes' */
    if (n_kept && !stopped && !rc && kept && kept_list && kept_json) {
        /* the sessions' blocks on disk first: a failed write of the kept prefixes' costs them
         * alone (below), never the sessions */
        if (!store || !(rc = skv_kv_store_finish(store))) {
            named = store ? skv_kv_store_blocks(store) : 0;
            int i = 0;
            for (struct skv_prefix_entry *e = w->prefix.head; e && i < n_kept; e = e->next)
                kept[i++] = e;
            qsort(kept, (size_t)i, sizeof *kept, by_recent_use);
            kept_saved = persist_kept(w, dir, gen, store, fresh, give_way, t0, kept_json, kept, i, kept_list,
                                      &kept_bytes, &kept_written);
            kept_ran = true;
        }
    } else if (n_kept && !stopped && !rc) {
        skv_log(SKV_LOG_WARN, "persist: no memory to save the %d kept prefix(es)", n_kept);
    }
    uint32_t appended = store ? skv_kv_store_appended(store) : 0;
    bytes += store ? skv_kv_store_appended_bytes(store) : 0;
    if (!rc && store) /* on disk before the manifest names files that need it */
        rc = skv_kv_store_finish(store);
    if (rc && kept_ran && store) { /* the store broke on the kept prefixes' blocks */
        skv_log(SKV_LOG_WARN, "persist: the kept prefixes' blocks could not be written (%s): saved without those "
                "written now", skv_error_msg());
        rc = SKV_OK;
        kept_saved = kept_keep_older(kept_json, kept_list, kept_saved, gen);
        kept_lost = true;
        kept_bytes = 0;
        kept_written = 0;
    }
    bytes += kept_bytes;
    written += kept_written;
    uint32_t store_blocks = store ? (kept_lost ? named : skv_kv_store_blocks(store)) : 0;
    json_t *doc = json_pack("{s:i, s:I, s:o, s:s}", "version", 1, "generation", (json_int_t)gen, "sessions", list,
                            "kv_type", w->cfg->kv_type ? w->cfg->kv_type : "f32");
    if (doc && kept_saved > 0 && json_object_set_new(doc, "kept", json_incref(kept_json)))
        kept_saved = 0; /* no memory: the manifest names none of their files */
    char rows_id[2 * ROWS_ID_BYTES + 1];
    rows_id_hex(w, rows_id);
    if (doc) {
        json_object_set_new(doc, "rows_id", json_string(rows_id));
        json_object_set_new(doc, "backend", json_string(w->m->be->name));
    }
    if (doc && store) {
        json_object_set_new(doc, "store", json_string(store_name));
        json_object_set_new(doc, "store_blocks", json_integer(store_blocks));
    }
    snprintf(path, sizeof path, "%s/%s", dir, PERSIST_MANIFEST);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (!rc && stopped)
        rc = skv_errorf(SKV_E_CANCELLED, "a request arrived");
    if (!rc && dropped) {
        rc = skv_errorf(SKV_E_IO, "%d session(s) the last checkpoint holds could not be written to %s: that "
                        "checkpoint stays", dropped,
                        store ? "a new block store" : "files of their own (no block store)");
        w->persist_keep_store = true;
    }
    if (!rc)
        rc = doc && json_dump_file(doc, tmp, JSON_COMPACT) == 0 ? SKV_OK
                                                                : skv_errorf(SKV_E_IO, "%s: cannot write it", tmp);
    int fd = rc ? -1 : open(tmp, O_RDONLY);
    if (!rc && (fd < 0 || fsync(fd) != 0))
        rc = skv_errorf(SKV_E_IO, "%s: %s", tmp, strerror(errno));
    if (fd >= 0)
        close(fd);
    if (!rc)
        rc = rename_durable(tmp, path, dir);
    if (store) /* a new store goes on only when its manifest is on disk */
        skv_kv_store_end(store, rc == SKV_OK);
    if (rc) {
        if (store != w->persist_store)
            skv_kv_store_close(&store);
        json_decref(doc);
        json_decref(kept_json);
        free(l.s);
        free(saved_list);
        free(kept);
        free(kept_list);
        persist_sweep(w, dir); /* this generation's files; the last one's stay */
        return rc;
    }
    if (store != w->persist_store) {
        skv_kv_store_close(&w->persist_store);
        w->persist_store = store;
        snprintf(w->persist_store_name, sizeof w->persist_store_name, "%s", store_name);
    }
    for (int i = 0; i < l.n; i++) /* sessions left out have no file the manifest names */
        l.s[i]->persist_gen = 0;
    for (int i = 0; i < saved; i++) {
        saved_list[i].s->persist_gen = store ? saved_list[i].gen : 0;
        memcpy(saved_list[i].s->persist_sum, saved_list[i].sum, 32);
    }
    for (struct skv_prefix_entry *e = w->prefix.head; e; e = e->next)
        e->persist_gen = 0;
    for (int i = 0; i < kept_saved; i++) {
        kept_list[i].e->persist_gen = store ? kept_list[i].gen : 0;
        memcpy(kept_list[i].e->persist_sum, kept_list[i].sum, 32);
    }
    json_decref(kept_json);
    free(l.s);
    free(saved_list);
    free(kept);
    free(kept_list);
    w->persist_gen = gen;
    w->persist_keep_store = false;
    w->persist_ms = skv_now_ms();
    w->metrics.persist_bytes += bytes;
    w->metrics.persist_last_seconds = (double)(w->persist_ms - t0) / 1000.0;
    persist_keep(w, doc);
    json_decref(doc);
    persist_sweep(w, dir);
    char spilled[1200]; /* what it records the manifest now says */
    spilled_path(dir, spilled, sizeof spilled);
    if (unlink(spilled) != 0 && errno != ENOENT)
        skv_log(SKV_LOG_WARN, "persist: %s: %s", spilled, strerror(errno));
    w->spilled_compacted = 0;
    skv_log(checkpoint ? SKV_LOG_DEBUG : SKV_LOG_INFO,
            "persist: %s %d of %d session(s) and %d of %d kept prefix(es) (%d file(s) written, the others "
            "unchanged), %llu bytes written (%u new KV blocks; the store holds %u), in %.3f s to %s%s",
            checkpoint ? "checkpoint:" : "saved", saved, l.n, kept_saved, n_kept, written, (unsigned long long)bytes,
            appended, store_blocks, w->metrics.persist_last_seconds, dir,
            late ? " (persist-max-seconds passed: the least recently used unpinned ones were not saved)" : "");
    if (failed || late)
        skv_log(SKV_LOG_WARN, "persist: %d session(s) %s (%d failed, %d past persist-max-seconds)", failed + late,
                checkpoint ? "left out of a checkpoint" : "lost at this stop", failed, late);
    if (carried)
        skv_log(SKV_LOG_WARN, "persist: checkpoint: %d session(s) not written (failed or past persist-max-seconds) "
                "keep the file of an earlier checkpoint", carried);
    if (checkpoint && (failed || late || carried))
        w->persist_dirty = true; /* the next checkpoint tries them again, changed or not */
    return SKV_OK;
}

int skv_requests_store_drain(struct skv_worker *w)
{
    if (!w->store)
        return 0;
    struct persist_list l = {0};
    skv_session_foreach(w->sessions, persist_collect, &l);
    if (l.n)
        qsort(l.s, (size_t)l.n, sizeof *l.s, by_save_order);
    uint64_t t0 = skv_now_ms();
    struct skv_store_stats before, after;
    skv_store_stats(w->store, &before);
    int i = 0;
    w->store_draining = true; /* every session goes, past store-max-bytes-per-tenant too */
    for (; i < l.n && skv_now_ms() - t0 < (uint64_t)w->cfg->persist_max_seconds * 1000; i++)
        skv_requests_spill(w, l.s[i]);
    w->store_draining = false;
    skv_store_stats(w->store, &after);
    int spilled = (int)(after.spills - before.spills);
    skv_log(l.n > spilled ? SKV_LOG_WARN : SKV_LOG_INFO,
            "store: %d of %d session(s) spilled at the stop in %.1f s%s", spilled, l.n,
            (double)(skv_now_ms() - t0) / 1000.0, i < l.n ? " (persist-max-seconds ran out)" : "");
    free(l.s);
    return spilled;
}

int skv_requests_persist_save(struct skv_worker *w)
{
    return persist_write(w, false, false);
}

int skv_requests_persist_checkpoint(struct skv_worker *w, bool give_way)
{
    return persist_write(w, true, give_way);
}

/* One manifest entry: its id (32 hex digits), tenant, owner, pin, lease, idle time. */
static int persist_entry(const json_t *e, uint8_t id[SKV_SESSION_ID_BYTES], const char **tenant, const char **owner,
                         bool *pinned, uint32_t *lease, uint64_t *idle_ms)
{
    const char *hex = json_string_value(json_object_get(e, "id"));
    *tenant = json_string_value(json_object_get(e, "tenant"));
    *owner = json_string_value(json_object_get(e, "owner"));
    const json_t *l = json_object_get(e, "lease_seconds"), *i = json_object_get(e, "idle_ms");
    if (!hex || strlen(hex) != 2 * SKV_SESSION_ID_BYTES || !*tenant || !*owner || !json_is_integer(l) ||
        !json_is_integer(i) || json_integer_value(l) < 0 || json_integer_value(l) > UINT32_MAX ||
        json_integer_value(i) < 0)
        return skv_errorf(SKV_E_FORMAT, "an entry of the manifest is malformed");
    for (int k = 0; k < SKV_SESSION_ID_BYTES; k++) {
        unsigned v;
        if (!isxdigit((unsigned char)hex[2 * k]) || !isxdigit((unsigned char)hex[2 * k + 1]) ||
            sscanf(hex + 2 * k, "%2x", &v) != 1)
            return skv_errorf(SKV_E_FORMAT, "session id '%s' is not hex", hex);
        id[k] = (uint8_t)v;
    }
    *pinned = json_is_true(json_object_get(e, "pinned"));
    *lease = (uint32_t)json_integer_value(l);
    *idle_ms = (uint64_t)json_integer_value(i);
    return SKV_OK;
}

struct tenant_entry {
    const char *tenant;
    size_t k;
};

static int by_tenant_then_entry(const void *a, const void *b)
{
    const struct tenant_entry *x = a, *y = b;
    int c = strcmp(x->tenant, y->tenant);
    return c ? c : x->k < y->k ? -1 : x->k > y->k;
}

/* Which manifest entries a tenant's max-sessions-per-tenant (skip[k] 1) or max-sessions (2)
 * leaves out: when a tenant saved more sessions than it may now hold, its least recently used
 * unpinned ones, and when all tenants did, the least recently used unpinned ones of all, so that
 * what comes back is what the limits keep in service (pinned first, then the most recently
 * used: the manifest's order; the restore runs it backwards, and the limit met there would have
 * kept the oldest). Entries that do not parse are left to the restore to refuse. */
static uint8_t *persist_over_limit(const json_t *list, size_t n, int64_t max_sessions, int64_t max_total)
{
    uint8_t *skip = calloc(n ? n : 1, sizeof *skip);
    struct tenant_entry *e = malloc((n ? n : 1) * sizeof *e);
    if (!skip || !e) {
        free(e);
        free(skip);
        return NULL;
    }
    size_t m = 0;
    for (size_t k = 0; k < n; k++) {
        const char *tenant = json_string_value(json_object_get(json_array_get(list, k), "tenant"));
        if (tenant)
            e[m++] = (struct tenant_entry){tenant, k};
    }
    /* each tenant's entries in the manifest's order: pinned first, then the most recent first */
    qsort(e, m, sizeof *e, by_tenant_then_entry);
    for (size_t i = 0, run = 0; i < m; i++) {
        run = i && strcmp(e[i].tenant, e[i - 1].tenant) == 0 ? run + 1 : 0;
        skip[e[i].k] = (int64_t)run >= max_sessions;
    }
    for (size_t k = 0, kept = 0; k < n; k++)
        if (!skip[k] && json_string_value(json_object_get(json_array_get(list, k), "tenant")))
            skip[k] = kept++ >= (size_t)max_total ? 2 : 0;
    free(e);
    return skip;
}

/* Why the rows a manifest's files hold may not serve prefix reuse here (NULL: they may): the
 * daemon that saved them must compute rows as this one does, the same rows_id
 * (skv_requests_rows_id: executable, libraries, CPU, model, kv-type, block size; a manifest
 * without one is of a daemon from before, another build), or, where neither knows its rows_id
 * (a backend other than the CPU), the same backend and kv-type (a file holds f32; f16 rows come
 * back into an f32 pool rounded). A CPU daemon that could not work out its rows_id matches
 * nothing. */
static const char *manifest_rows_differ(struct skv_worker *w, const json_t *doc)
{
    const char *saved_type = json_string_value(json_object_get(doc, "kv_type"));
    const char *saved_id = json_string_value(json_object_get(doc, "rows_id"));
    char mine[2 * ROWS_ID_BYTES + 1];
    rows_id_hex(w, mine);
    if (!saved_type || strcmp(saved_type, w->cfg->kv_type ? w->cfg->kv_type : "f32") != 0)
        return "they were saved from another kv-type";
    if (!saved_id || strcmp(saved_id, mine) != 0)
        return "they were saved by a daemon that computes rows otherwise (another build, CPU, or kv-block-tokens)";
    const bool unknown = sodium_is_zero(skv_requests_rows_id(w), ROWS_ID_BYTES);
    const char *saved_be = json_string_value(json_object_get(doc, "backend"));
    if (unknown && strcmp(w->m->be->name, "cpu") == 0) /* its executable could not be read */
        return "this daemon cannot tell how it computes rows (its executable could not be read)";
    if (unknown && saved_be && strcmp(saved_be, w->m->be->name) != 0) /* (none: a manifest of before) */
        return "they were saved by a daemon on another backend";
    return NULL;
}

/* The kept prefixes (prefix-retain-bytes) a manifest names, least recently used first, each
 * loaded as a session and kept again under its id as RELEASE keeps one, idle as long as at the
 * stop. They come before the sessions: a cache, they go when a session needs their room, as
 * they would while serving. Only where their rows serve as they did: prefix reuse on, a cap,
 * rows_differ NULL (manifest_rows_differ). Returns how many came back (*n: how many were named). */
static int persist_restore_kept(struct skv_worker *w, const json_t *doc, const char *dir, struct restore *r,
                                const char *rows_differ, size_t *n)
{
    const json_t *list = json_object_get(doc, "kept");
    *n = json_array_size(list);
    const char *why = !w->cfg->prefix_reuse ? "prefix-reuse is off"
                      : !w->prefix.cap      ? "prefix-retain-bytes is 0"
                                            : rows_differ;
    if (*n && why) {
        skv_log(SKV_LOG_INFO, "persist: %zu kept prefix(es) not restored: %s", *n, why);
        return 0;
    }
    int restored = 0;
    for (size_t k = *n; k-- > 0;) {
        const json_t *e = json_array_get(list, k), *cr = json_object_get(e, "computed_rows");
        uint8_t id[SKV_SESSION_ID_BYTES];
        const char *tenant, *owner;
        bool pinned;
        uint32_t lease;
        uint64_t idle;
        char hex[2 * SKV_SESSION_ID_BYTES + 1] = "?", name[128], file[1300];
        struct skv_session *s = NULL;
        int rc = persist_entry(e, id, &tenant, &owner, &pinned, &lease, &idle);
        if (!rc)
            skv_session_id_hex(id, hex);
        if (!rc && skv_prefix_cache_find_id(&w->prefix, id))
            rc = skv_errorf(SKV_E_FORMAT, "the manifest names it twice");
        if (!rc && idle > (uint64_t)w->cfg->lease_seconds * 1000) /* it would expire at the first second */
            rc = skv_errorf(SKV_E_LIMIT, "idle past lease-seconds (%lld s)", (long long)w->cfg->lease_seconds);
        if (!rc) {
            persist_name(name, sizeof name, hex, entry_gen(doc, e), ".skv");
            snprintf(file, sizeof file, "%s/%s", dir, name);
            rc = session_load(w, file, tenant, tenant, r, &s, NULL);
        }
        int rows = s ? s->n_tokens - s->n_tokens % s->cache->block_rows : 0; /* kv-block-tokens may have changed */
        if (!rc && (s->comp || !skv_prefix_cache_whole(s->cache, s->n_tokens) || rows < s->cache->block_rows ||
                    !json_is_integer(cr) || json_integer_value(cr) != s->n_tokens))
            rc = skv_errorf(SKV_E_FORMAT, "its file holds no kept prefix's rows");
        struct skv_prefix_entry *kept = NULL;
        if (!rc) {
            uint64_t quota = (uint64_t)w->cfg->max_bytes_per_tenant,
                     held = skv_session_tenant_bytes(w->sessions, tenant, s), now = skv_now_ms();
            rc = skv_prefix_cache_add(&w->prefix, tenant, s->tokens, rows, s->cache, held < quota ? quota - held : 0,
                                      now > idle ? now - idle : 0, id);
            kept = rc ? NULL : skv_prefix_cache_find_id(&w->prefix, id);
            if (!rc && !kept)
                rc = skv_errorf(SKV_E_LIMIT, "not kept (prefix-retain-bytes, the tenant's max-bytes-per-tenant, "
                                "or a kept prefix of the tenant that holds these tokens already)");
        }
        if (kept && rows == s->n_tokens) { /* its file holds it as it is */
            kept->persist_gen = entry_gen(doc, e);
            memcpy(kept->persist_sum, r->sum, sizeof r->sum);
        }
        if (s) /* the entry holds its blocks now */
            skv_session_destroy(w->sessions, s);
        if (rc) {
            skv_log(SKV_LOG_INFO, "persist: kept prefix %s not restored: %s", hex, skv_error_msg());
            continue;
        }
        skv_worker_beat(w);
        restored++;
    }
    return restored;
}

/* How many of the kept prefixes a manifest names the daemon holds. */
static int kept_held(struct skv_worker *w, const json_t *doc)
{
    const json_t *list = json_object_get(doc, "kept");
    int n = 0;
    for (size_t k = 0; k < json_array_size(list); k++) {
        uint8_t id[SKV_SESSION_ID_BYTES];
        const char *tenant, *owner;
        bool pinned;
        uint32_t lease;
        uint64_t idle;
        n += !persist_entry(json_array_get(list, k), id, &tenant, &owner, &pinned, &lease, &idle) &&
             skv_prefix_cache_find_id(&w->prefix, id);
    }
    return n;
}

int skv_requests_persist_restore(struct skv_worker *w)
{
    char dir[1100], path[1300], name[128];
    int rc = persist_dir(w, dir, sizeof dir);
    if (rc)
        return rc;
    snprintf(path, sizeof path, "%s/%s", dir, PERSIST_MANIFEST);
    json_error_t jerr = {.text = ""};
    int mfd = open_state_file(path);
    json_t *doc = mfd >= 0 ? json_loadfd(mfd, 0, &jerr) : NULL;
    if (mfd >= 0)
        close(mfd);
    else if (mfd != SKV_E_NOT_FOUND)
        snprintf(jerr.text, sizeof jerr.text, "%s", skv_error_msg());
    /* one of another version (a newer daemon's, read in a downgrade) is set aside as one that
     * does not parse: its sessions read as none would have been swept with their files */
    const json_t *version = json_object_get(doc, "version");
    if (doc && (!json_is_integer(version) || json_integer_value(version) != 1 ||
                !json_is_array(json_object_get(doc, "sessions")))) {
        snprintf(jerr.text, sizeof jerr.text, "a manifest of another version (%s%lld) or without its list of sessions",
                 json_is_integer(version) ? "" : "none: ",
                 json_is_integer(version) ? (long long)json_integer_value(version) : 0LL);
        json_decref(doc);
        doc = NULL;
    }
    if (!doc) {
        if (access(path, F_OK) == 0) {
            skv_log(SKV_LOG_WARN, "persist: %s: %s; no session restored", path, jerr.text);
            persist_set_aside(dir, "the manifest does not parse, or is of another version");
        }
        persist_wipe(w, dir);
        return SKV_OK;
    }
    const json_t *list = json_object_get(doc, "sessions"), *count = json_object_get(doc, "store_blocks");
    size_t n = json_array_size(list);
    int restored = 0;
    uint64_t t0 = skv_now_ms();
    struct restore r = {0};
    manifest_store(doc, name, sizeof name);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    /* the count of blocks the manifest names (a save cut short may have appended more); a
     * manifest of before stores lived across saves has none: the store's own */
    int64_t n_named = json_is_integer(count) && json_integer_value(count) >= 0 ? (int64_t)json_integer_value(count)
                                                                               : -1;
    rc = name[0] ? skv_kv_store_open(path, w->m->fingerprint, w->m->legacy_fingerprint,
                                     skv_kv_pool_block_rows(w->m->kv_pool), w->m->cfg.head_dim, n_named, &r.store)
                 : skv_errorf(SKV_E_FORMAT, "the manifest names no block store");
    if (rc && rc != SKV_E_NOT_FOUND) /* the files that name its blocks fail; older ones load */
        skv_log(SKV_LOG_WARN, "persist: block store: %s", skv_error_msg());
    if (skv_kv_dedupe_new(w->m->kv_pool, &r.dedupe)) /* without it each older file keeps its own blocks */
        r.dedupe = NULL;
    size_t n_kept = 0;
    const char *rows_differ = manifest_rows_differ(w, doc);
    const bool rows_serve = !rows_differ;
    int kept = persist_restore_kept(w, doc, dir, &r, rows_differ, &n_kept);
    if (rows_differ && n)
        skv_log(SKV_LOG_INFO, "persist: the restored sessions' rows do not serve prefix reuse: %s", rows_differ);
    uint8_t *skip = persist_over_limit(list, n, w->cfg->max_sessions_per_tenant, w->cfg->max_sessions);
    size_t n_spilled = 0;
    bool spilled_ok = true;
    char spilled_file[1300];
    spilled_path(dir, spilled_file, sizeof spilled_file);
    /* (without a store now, those sessions' files are the only copies this host can reach) */
    struct spilled_rec *spilled = w->store ? spilled_read(spilled_file, &n_spilled, &spilled_ok) : NULL;
    if (!spilled_ok)
        skv_log(SKV_LOG_WARN, "persist: %s could not be read: sessions handed to the store after the last save may "
                "be restored from their older files", spilled_file);
    int left_in_store = 0;
    for (size_t k = n; k-- > 0;) { /* least recently used first: under pool pressure they go first */
        const json_t *e = json_array_get(list, k);
        uint8_t id[SKV_SESSION_ID_BYTES];
        const char *tenant, *owner;
        bool pinned = false;
        uint32_t lease = 0;
        uint64_t idle = 0;
        struct skv_session *s = NULL;
        char hex[2 * SKV_SESSION_ID_BYTES + 1] = "?", file[1300];
        rc = persist_entry(e, id, &tenant, &owner, &pinned, &lease, &idle);
        if (!rc)
            skv_session_id_hex(id, hex);
        if (!rc && skip && skip[k] == 1)
            rc = skv_errorf(SKV_E_LIMIT, "tenant '%s' saved more sessions than max-sessions-per-tenant (%lld) now "
                            "allows; its least recently used are left out", tenant,
                            (long long)w->cfg->max_sessions_per_tenant);
        if (!rc && skip && skip[k] == 2)
            rc = skv_errorf(SKV_E_LIMIT, "more sessions were saved than max-sessions (%lld) now allows; the least "
                            "recently used are left out", (long long)w->cfg->max_sessions);
        if (!rc && skv_session_find(w->sessions, id, NULL)) /* before its charge could evict another */
            rc = skv_errorf(SKV_E_FORMAT, "the manifest names it twice");
        if (!rc && n_spilled && bsearch(hex, spilled, n_spilled, sizeof *spilled, hex_order)) {
            left_in_store++; /* handed to the store after this manifest: the store's copy is the newer */
            continue;
        }
        if (!rc) {
            persist_name(name, sizeof name, hex, entry_gen(doc, e), ".skv");
            snprintf(file, sizeof file, "%s/%s", dir, name);
            rc = session_load(w, file, tenant, owner, &r, &s, NULL);
        }
        if (!rc && (rc = skv_session_set_id(w->sessions, s, id)))
            skv_session_destroy(w->sessions, s);
        if (rc) {
            skv_log(SKV_LOG_WARN, "persist: session %s not restored: %s", hex, skv_error_msg());
            continue;
        }
        if (skv_prefix_cache_drop_id(&w->prefix, id)) /* one id, one file: the session's */
            skv_log(SKV_LOG_WARN, "persist: kept prefix %s dropped: the manifest names a session of its id", hex);
        s->pinned = pinned;
        s->lease_seconds = lease && lease <= (uint64_t)w->cfg->max_lease_seconds ? lease
                                                                                : (uint32_t)w->cfg->lease_seconds;
        uint64_t now = skv_now_ms();
        s->created_ms = now;
        s->last_used_ms = now > idle ? now - idle : 0; /* idle as long as at the stop; the downtime not counted */
        s->persist_gen = entry_gen(doc, e); /* its file holds it as it is */
        memcpy(s->persist_sum, r.sum, sizeof r.sum);
        /* rows the daemon computed and saved as they were: prefix reuse may take them again, the
         * same bits as before the stop, when this daemon computes rows as the one that saved
         * them (manifest_rows_differ); an entry without the count: none */
        const json_t *cr = json_object_get(e, "computed_rows");
        if (json_is_integer(cr) && json_integer_value(cr) > 0 && json_integer_value(cr) <= s->n_tokens &&
            rows_serve)
            s->computed_rows = (int32_t)json_integer_value(cr);
        skv_worker_event_stored(w, s);
        skv_worker_beat(w);
        restored++;
    }
    free(skip);
    free(spilled);
    if (left_in_store)
        skv_log(SKV_LOG_INFO, "persist: %d session(s) handed to the store after the last save are left there, not "
                "restored from their older files", left_in_store);
    skv_kv_dedupe_free(&r.dedupe);
    kept = kept_held(w, doc); /* those the sessions' room or a later one's add dropped do not count */
    w->persist_gen = manifest_gen(doc);
    bool keep = w->cfg->persist_interval_seconds > 0, aside = false;
    if (restored + left_in_store - r.evicted < (int)n) {
        char why[96];
        snprintf(why, sizeof why, "%d of %zu session(s) not restored",
                 (int)n - (restored + left_in_store - r.evicted), n);
        aside = persist_set_aside(dir, why) >= 0;
    }
    /* checkpoints go on appending to the store the sessions came from: the blocks they
     * restored are written already */
    if (keep && r.store && !aside && !skv_kv_store_continue(r.store, path, w->m->kv_pool)) {
        w->persist_store = r.store;
        manifest_store(doc, w->persist_store_name, sizeof w->persist_store_name);
        r.store = NULL;
    } else if (keep && r.store && !aside) {
        skv_log(SKV_LOG_INFO, "persist: the next checkpoint writes a new block store (%s)", skv_error_msg());
    }
    skv_kv_store_close(&r.store); /* its blocks now held by the sessions alone */
    if (keep) { /* the last checkpoint until the next: a crash before it restores it again */
        persist_keep(w, doc);
        persist_sweep(w, dir);
    } else {
        persist_wipe(w, dir);
    }
    json_decref(doc);
    skv_log(SKV_LOG_INFO, "persist: restored %d of %zu session(s) and %d of %zu kept prefix(es) from %s in %.1f s; "
            "%llu KV block(s) shared again", restored - r.evicted, n, kept, n_kept, dir,
            (double)(skv_now_ms() - t0) / 1000.0, (unsigned long long)r.n_shared);
    if (r.evicted)
        skv_log(SKV_LOG_WARN, "persist: %d restored session(s) evicted again to make room: the pool holds less "
                "than what was saved", r.evicted);
    return SKV_OK;
}

static void handle_stats(struct skv_worker *w, struct skv_job *job)
{
    struct skv_stats_input in;
    skv_worker_stats_input(w, &in);
    enum { MAX_ROWS = SKV_N_STATS + SKV_N_TENANT_STATS * SKV_TENANT_ROWS };
    struct skv_tenant_table *t = malloc(sizeof *t);
    struct skv_stat *rows = malloc(MAX_ROWS * sizeof *rows);
    char (*names)[SKV_STAT_NAME_MAX] = malloc(SKV_N_TENANT_STATS * SKV_TENANT_ROWS * sizeof *names);
    Snapkv__Stat *stats = malloc(MAX_ROWS * sizeof *stats);
    Snapkv__Stat **ptrs = malloc(MAX_ROWS * sizeof *ptrs);
    char *prom = job->req->stats->prometheus ? malloc(SKV_PROMETHEUS_MAX) : NULL;
    if (!t || !rows || !names || !stats || !ptrs || (job->req->stats->prometheus && !prom)) {
        skv_requests_fail(w, job, SKV_E_NOMEM, "out of memory for the STATS reply");
        goto out;
    }
    skv_stats_rows(&in, rows);
    skv_worker_tenant_table(w, t);
    size_t n = SKV_N_STATS + skv_stats_tenant_rows(t, rows + SKV_N_STATS, names);
    for (size_t i = 0; i < n; i++) {
        snapkv__stat__init(&stats[i]);
        stats[i].name = (char *)rows[i].name;
        stats[i].help = (char *)rows[i].help;
        stats[i].value = rows[i].value;
        ptrs[i] = &stats[i];
    }
    if (prom)
        skv_stats_prometheus(rows, n, prom, SKV_PROMETHEUS_MAX);
    Snapkv__Reply rep;
    Snapkv__StatsReply sr = SNAPKV__STATS_REPLY__INIT;
    reply_init(&rep, job);
    sr.n_stats = n;
    sr.stats = ptrs;
    sr.prometheus_text = prom ? prom : "";
    rep.result_case = SNAPKV__REPLY__RESULT_STATS;
    rep.stats = &sr;
    skv_worker_reply(w, job, &rep);
out:
    free(t);
    free(rows);
    free(names);
    free(stats);
    free(ptrs);
    free(prom);
}

void skv_requests_execute(struct skv_worker *w, struct skv_job *job)
{
    skv_error_clear();
    switch (job->req->command_case) {
    case SNAPKV__REQUEST__COMMAND_PREFILL: handle_prefill(w, job); break;
    case SNAPKV__REQUEST__COMMAND_APPEND: handle_append(w, job); break;
    case SNAPKV__REQUEST__COMMAND_COMPRESS: handle_compress(w, job); break;
    case SNAPKV__REQUEST__COMMAND_FORK: handle_fork(w, job); break;
    case SNAPKV__REQUEST__COMMAND_RELEASE: handle_release(w, job); break;
    case SNAPKV__REQUEST__COMMAND_CANCEL: handle_cancel(w, job); break;
    case SNAPKV__REQUEST__COMMAND_TOKENIZE: handle_tokenize(w, job); break;
    case SNAPKV__REQUEST__COMMAND_DETOKENIZE: handle_detokenize(w, job); break;
    case SNAPKV__REQUEST__COMMAND_EXPORT_KV: handle_export(w, job); break;
    case SNAPKV__REQUEST__COMMAND_IMPORT_KV: handle_import(w, job); break;
    case SNAPKV__REQUEST__COMMAND_LIST: handle_list(w, job); break;
    case SNAPKV__REQUEST__COMMAND_INSPECT: handle_inspect(w, job); break;
    case SNAPKV__REQUEST__COMMAND_EVICT: handle_evict(w, job); break;
    case SNAPKV__REQUEST__COMMAND_PIN: handle_pin(w, job); break;
    case SNAPKV__REQUEST__COMMAND_SAVE: handle_save(w, job); break;
    case SNAPKV__REQUEST__COMMAND_LOAD: handle_load(w, job); break;
    case SNAPKV__REQUEST__COMMAND_STATS: handle_stats(w, job); break;
    default:
        skv_requests_fail(w, job, SKV_E_UNSUPPORTED, "this command is not served by the engine worker");
        break;
    }
    /* the request's forward is over: its room is no longer held for it (a request nested in a
     * forward holds at level 1 and leaves the running forward's alone; one in a yield holds none) */
    if (!w->yielding)
        skv_session_hold_room(w->sessions, w->nesting, NULL, 0, 0);
}
