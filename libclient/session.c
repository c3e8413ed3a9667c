/* libsnapkv client commands on sessions: PREFILL (with progress), APPEND, DECODE (collected or
 * streamed), COMPRESS, FORK, RELEASE, and K/V exchange through POSIX shared memory (the shm
 * helpers, EXPORT_KV, IMPORT_KV and the layout arithmetic). Never logs. */
#include "libclient/client_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/acl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Token input shared by PREFILL and APPEND: exactly one of tokens and text, ids in range. */
static int check_input(const snapkv_client_t *c, const uint32_t *tokens, size_t n_tokens, const char *text,
                       const char *what)
{
    bool have_tokens = n_tokens > 0;
    bool have_text = text && *text;
    if (have_tokens == have_text)
        return skv_client_fail(SNAPKV_E_INVAL, "%s: give either tokens or text", what);
    if (have_tokens && !tokens)
        return skv_client_fail(SNAPKV_E_INVAL, "%s: n_tokens is %zu but tokens is NULL", what, n_tokens);
    uint32_t n_vocab = c->hello->n_vocab;
    for (size_t i = 0; have_tokens && n_vocab && i < n_tokens; i++)
        if (tokens[i] >= n_vocab)
            return skv_client_fail(SNAPKV_E_INVAL, "%s: token %u at %zu is outside the vocabulary (%u)", what,
                                   tokens[i], i, n_vocab);
    return SNAPKV_OK;
}

/* ---- PREFILL ------------------------------------------------------------------------------------ */

static int prefill_progress(void *user, const Snapkv__Reply *rep)
{
    const struct snapkv_prefill_opts *o = user;
    if (o->progress)
        o->progress(o->progress_user, rep->prefill->tokens_done, rep->prefill->n_tokens);
    return SNAPKV_OK;
}

int snapkv_prefill(snapkv_client_t *c, const struct snapkv_prefill_opts *opts, struct snapkv_prefill_result *out)
{
    return snapkv_prefill_flags(c, opts, 0, out, NULL);
}

/* Whether the daemon c talks to listed feature in its HELLO. */
static bool has_feature(const snapkv_client_t *c, const char *feature)
{
    for (size_t i = 0; i < c->hello->n_features; i++)
        if (strcmp(c->hello->features[i], feature) == 0)
            return true;
    return false;
}

/* A reply's prompt scores into *out: n_lp log-probabilities and most likely tokens (top), n_tok
 * token ids. */
static int copy_scores(const float *lp, const uint32_t *top, size_t n_lp, const uint32_t *tok, size_t n_tok,
                       const char *what, struct snapkv_scores *out)
{
    struct snapkv_scores sc = {.n_logprobs = n_lp, .n_tokens = n_tok};
    if (!skv_client_dup_f32(lp, n_lp, &sc.logprobs) || !skv_client_dup_u32(tok, n_tok, &sc.tokens) ||
        !skv_client_dup_u32(top, n_lp, &sc.top_tokens)) {
        snapkv_scores_free(&sc);
        return skv_client_fail(SNAPKV_E_NOMEM, "%s: out of memory for %zu scores", what, n_lp);
    }
    *out = sc;
    return SNAPKV_OK;
}

/* The most likely tokens a position may ask for (the daemon's SKV_TOP_LOGPROBS_MAX). */
#define TOP_N_MAX 20u

/* A reply's prompt_top_logprobs (n lists, each n_top long) into *out, beside the n scores lp. */
static int copy_top(Snapkv__TopLogprobs *const *t, size_t n_t, size_t n, uint32_t n_top, const float *lp,
                    const char *what, struct snapkv_logprobs *out)
{
    if (n_t != n)
        return skv_client_fail(SNAPKV_E_PROTO, "%s: %zu lists of most likely tokens for %zu scores", what, n_t, n);
    for (size_t i = 0; i < n; i++)
        if (t[i]->n_tokens != n_top || t[i]->n_logprobs != n_top)
            return skv_client_fail(SNAPKV_E_PROTO, "%s: a list of %zu most likely tokens and %zu log-probabilities, "
                                   "not %u", what, t[i]->n_tokens, t[i]->n_logprobs, n_top);
    struct snapkv_logprobs r = {.n = n, .n_top = n_top};
    size_t m = n * n_top;
    if (!skv_client_dup_f32(lp, n, &r.logprobs) || (m && (!(r.top_tokens = malloc(m * sizeof *r.top_tokens)) ||
                                                          !(r.top_logprobs = malloc(m * sizeof *r.top_logprobs))))) {
        snapkv_logprobs_free(&r);
        return skv_client_fail(SNAPKV_E_NOMEM, "%s: out of memory for %zu lists of most likely tokens", what, n);
    }
    for (size_t i = 0; i < n; i++) {
        memcpy(r.top_tokens + i * n_top, t[i]->tokens, n_top * sizeof *r.top_tokens);
        memcpy(r.top_logprobs + i * n_top, t[i]->logprobs, n_top * sizeof *r.top_logprobs);
    }
    *out = r;
    return SNAPKV_OK;
}

/* Scores asked of a daemon: one that does not list prompt-logprobs (prompt-top-logprobs for
 * top_n > 0) would ignore the field. top_n above the limit: SNAPKV_E_LIMIT. */
static int check_scores_feature(const snapkv_client_t *c, uint32_t top_n, const char *what)
{
    if (top_n > TOP_N_MAX)
        return skv_client_fail(SNAPKV_E_LIMIT, "%s: top_n %u is above the limit of %u", what, top_n,
                               TOP_N_MAX);
    const char *feature = top_n ? "prompt-top-logprobs" : "prompt-logprobs";
    if (has_feature(c, feature))
        return SNAPKV_OK;
    return skv_client_fail(SNAPKV_E_UNSUPPORTED, "%s: the daemon (snapkvd %s) does not %s: it is older than %s", what,
                           c->hello->server_version ? c->hello->server_version : "?",
                           top_n ? "give each scored position's most likely tokens" : "score prompts",
                           top_n ? "prompt_top_logprobs" : "prompt_logprobs");
}

/* The top list's length a daemon gives for top_n: fewer only with a smaller vocabulary */
static uint32_t top_len(const snapkv_client_t *c, uint32_t top_n)
{
    return c->hello->n_vocab && top_n > c->hello->n_vocab ? c->hello->n_vocab : top_n;
}

/* What a scoring call asks for and where it goes: scores (NULL: no scoring), and with top_n > 0
 * each position's most likely tokens into top. */
struct score_ask {
    struct snapkv_scores *scores;
    uint32_t top_n;
    struct snapkv_logprobs *top;
};

/* The arguments of a scoring call, checked; the outputs zeroed. */
static int score_ask(struct snapkv_scores *scores, uint32_t top_n, struct snapkv_logprobs *top, const char *what,
                     struct score_ask *ask)
{
    if (scores)
        memset(scores, 0, sizeof *scores);
    if (top)
        memset(top, 0, sizeof *top);
    if (!scores)
        return skv_client_fail(SNAPKV_E_INVAL, "%s: scores is required", what);
    if (top_n && !top)
        return skv_client_fail(SNAPKV_E_INVAL, "%s: top_n %u with nowhere to put them", what, top_n);
    *ask = (struct score_ask){scores, top_n, top_n ? top : NULL};
    return SNAPKV_OK;
}

/* A reply's logits: n_vocab of them when asked (the daemon's HELLO says how many), none when
 * not, so a caller may read n_vocab floats. */
static int check_logits(const snapkv_client_t *c, bool asked, size_t n, const char *what)
{
    size_t want = asked ? c->hello->n_vocab : 0;
    if (n != want && (!asked || c->hello->n_vocab))
        return skv_client_fail(SNAPKV_E_PROTO, "%s: %zu logits in the reply, %zu asked", what, n, want);
    return SNAPKV_OK;
}

static int prefill_call(snapkv_client_t *c, const struct snapkv_prefill_opts *opts, unsigned flags,
                        struct snapkv_prefill_result *out, uint32_t *reused_tokens, const struct score_ask *ask);

int snapkv_prefill_flags(snapkv_client_t *c, const struct snapkv_prefill_opts *opts, unsigned flags,
                         struct snapkv_prefill_result *out, uint32_t *reused_tokens)
{
    return prefill_call(c, opts, flags, out, reused_tokens, NULL);
}

int snapkv_prefill_scored(snapkv_client_t *c, const struct snapkv_prefill_opts *opts, unsigned flags,
                          struct snapkv_prefill_result *out, struct snapkv_scores *scores)
{
    return snapkv_prefill_scored_top(c, opts, flags, 0, out, scores, NULL);
}

int snapkv_prefill_scored_top(snapkv_client_t *c, const struct snapkv_prefill_opts *opts, unsigned flags,
                              uint32_t top_n, struct snapkv_prefill_result *out, struct snapkv_scores *scores,
                              struct snapkv_logprobs *top)
{
    struct score_ask ask;
    int rc = score_ask(scores, top_n, top, "prefill", &ask);
    return rc ? rc : prefill_call(c, opts, flags, out, NULL, &ask);
}

static int prefill_call(snapkv_client_t *c, const struct snapkv_prefill_opts *opts, unsigned flags,
                        struct snapkv_prefill_result *out, uint32_t *reused_tokens, const struct score_ask *ask)
{
    struct snapkv_scores *scores = ask ? ask->scores : NULL;
    unsigned unknown = flags & ~(unsigned)SNAPKV_PREFILL_NO_PREFIX_REUSE;
    if (unknown)
        return skv_client_fail(SNAPKV_E_INVAL, "prefill: unknown flags 0x%x", unknown);
    int rc = skv_client_check(c, opts, "prefill");
    if (rc)
        return rc;
    if (!out)
        return skv_client_fail(SNAPKV_E_INVAL, "prefill: out is required");
    rc = check_input(c, opts->tokens, opts->n_tokens, opts->text, "prefill");
    if (rc)
        return rc;
    if (opts->chat && opts->n_tokens)
        return skv_client_fail(SNAPKV_E_INVAL, "prefill: chat renders text with the chat template; token ids "
                               "go in as they are (clear chat, or send text)");
    uint32_t max_prompt = c->hello->max_prompt_tokens;
    if (max_prompt && opts->n_tokens > max_prompt)
        return skv_client_fail(SNAPKV_E_LIMIT, "prefill: %zu tokens, the daemon takes at most %u", opts->n_tokens,
                               max_prompt);
    if (scores && (rc = check_scores_feature(c, ask->top_n, "prefill")))
        return rc;

    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__PrefillRequest p = SNAPKV__PREFILL_REQUEST__INIT;
    Snapkv__CompressSpec spec = SNAPKV__COMPRESS_SPEC__INIT;
    p.n_tokens = opts->n_tokens;
    p.tokens = (uint32_t *)opts->tokens;
    p.text = (char *)(opts->text ? opts->text : "");
    p.chat = opts->chat;
    if (opts->compress && *opts->compress) {
        spec.spec = (char *)opts->compress;
        p.compress = &spec;
    }
    p.return_logits = opts->return_logits;
    p.lease_seconds = opts->lease_seconds;
    p.progress = opts->progress != NULL;
    p.no_prefix_reuse = (flags & SNAPKV_PREFILL_NO_PREFIX_REUSE) != 0;
    p.prompt_logprobs = scores != NULL;
    p.prompt_top_logprobs = scores ? ask->top_n : 0;
    req.command_case = SNAPKV__REQUEST__COMMAND_PREFILL;
    req.prefill = &p;
    Snapkv__Reply *rep = NULL;
    rc = skv_client_call(c, &req, SNAPKV__REPLY__RESULT_PREFILL, "PREFILL", prefill_progress, (void *)opts, NULL,
                         &rep);
    if (rc)
        return rc;

    const Snapkv__PrefillReply *r = rep->prefill;
    struct snapkv_prefill_result res = {
        .n_tokens = r->n_tokens,
        .bytes_before = r->bytes_before,
        .bytes_after = r->bytes_after,
        .next_token = r->next_token,
        .n_layers = r->n_kept,
        .n_logits = r->n_logits,
    };
    rc = skv_client_id_parse(&r->session_id, "PREFILL", &res.id);
    if (rc)
        goto out_free_reply;
    if ((rc = check_logits(c, opts->return_logits, r->n_logits, "PREFILL")))
        goto out_free_reply;
    rc = skv_client_layers(c, r->kept, r->n_kept, NULL, 0, &res.layers);
    if (rc)
        goto out_free_reply;
    if (!skv_client_dup_f32(r->logits, r->n_logits, &res.logits)) {
        rc = skv_client_fail(SNAPKV_E_NOMEM, "prefill: out of memory for %zu logits", r->n_logits);
        goto out_free_result;
    }
    if (scores && (r->n_prompt_tokens != r->n_tokens || r->n_prompt_logprobs + 1 != r->n_tokens ||
                   r->n_prompt_top_tokens != r->n_prompt_logprobs)) {
        rc = skv_client_fail(SNAPKV_E_PROTO, "PREFILL: %zu scores, %zu most likely tokens and %zu token ids for a "
                             "prompt of %u tokens", r->n_prompt_logprobs, r->n_prompt_top_tokens, r->n_prompt_tokens,
                             r->n_tokens);
        goto out_free_result;
    }
    if (scores && ask->top_n &&
        (rc = copy_top(r->prompt_top_logprobs, r->n_prompt_top_logprobs, r->n_prompt_logprobs,
                       top_len(c, ask->top_n), r->prompt_logprobs, "PREFILL", ask->top)))
        goto out_free_result;
    if (scores && (rc = copy_scores(r->prompt_logprobs, r->prompt_top_tokens, r->n_prompt_logprobs, r->prompt_tokens,
                                    r->n_prompt_tokens, "prefill", scores))) {
        if (ask->top)
            snapkv_logprobs_free(ask->top);
        goto out_free_result;
    }
    *out = res;
    if (reused_tokens)
        *reused_tokens = r->reused_tokens;
    snapkv__reply__free_unpacked(rep, NULL);
    return SNAPKV_OK;

out_free_result:
    snapkv_prefill_result_free(&res);
out_free_reply:
    snapkv__reply__free_unpacked(rep, NULL);
    return rc;
}

void snapkv_prefill_result_free(struct snapkv_prefill_result *r)
{
    if (!r)
        return;
    free(r->layers);
    free(r->logits);
    memset(r, 0, sizeof *r);
}

/* ---- APPEND ------------------------------------------------------------------------------------- */

static int append_call(snapkv_client_t *c, const struct snapkv_session_id *id, const struct snapkv_append_opts *opts,
                       struct snapkv_append_result *out, const struct score_ask *ask);

int snapkv_append(snapkv_client_t *c, const struct snapkv_session_id *id, const struct snapkv_append_opts *opts,
                  struct snapkv_append_result *out)
{
    return append_call(c, id, opts, out, NULL);
}

int snapkv_append_scored(snapkv_client_t *c, const struct snapkv_session_id *id,
                         const struct snapkv_append_opts *opts, struct snapkv_append_result *out,
                         struct snapkv_scores *scores)
{
    return snapkv_append_scored_top(c, id, opts, 0, out, scores, NULL);
}

int snapkv_append_scored_top(snapkv_client_t *c, const struct snapkv_session_id *id,
                             const struct snapkv_append_opts *opts, uint32_t top_n, struct snapkv_append_result *out,
                             struct snapkv_scores *scores, struct snapkv_logprobs *top)
{
    struct score_ask ask;
    int rc = score_ask(scores, top_n, top, "append", &ask);
    return rc ? rc : append_call(c, id, opts, out, &ask);
}

static int append_call(snapkv_client_t *c, const struct snapkv_session_id *id, const struct snapkv_append_opts *opts,
                       struct snapkv_append_result *out, const struct score_ask *ask)
{
    struct snapkv_scores *scores = ask ? ask->scores : NULL;
    int rc = skv_client_check(c, id, "append");
    if (rc)
        return rc;
    if (!opts)
        return skv_client_fail(SNAPKV_E_INVAL, "append: opts is required");
    rc = check_input(c, opts->tokens, opts->n_tokens, opts->text, "append");
    if (rc)
        return rc;
    if (opts->chat && opts->n_tokens)
        return skv_client_fail(SNAPKV_E_INVAL, "append: chat parses markup in text; token ids go in as they are "
                               "(clear chat, or send text)");
    if (scores && (rc = check_scores_feature(c, ask->top_n, "append")))
        return rc;

    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__AppendRequest a = SNAPKV__APPEND_REQUEST__INIT;
    a.session_id = skv_client_id_wire(id);
    a.n_tokens = opts->n_tokens;
    a.tokens = (uint32_t *)opts->tokens;
    a.text = (char *)(opts->text ? opts->text : "");
    a.return_logits = opts->return_logits;
    a.chat = opts->chat;
    a.prompt_logprobs = scores != NULL;
    a.prompt_top_logprobs = scores ? ask->top_n : 0;
    req.command_case = SNAPKV__REQUEST__COMMAND_APPEND;
    req.append = &a;
    Snapkv__Reply *rep = NULL;
    rc = skv_client_call(c, &req, SNAPKV__REPLY__RESULT_APPEND, "APPEND", NULL, NULL, NULL, &rep);
    if (rc)
        return rc;
    const Snapkv__AppendReply *sr = rep->append;
    if (scores && (sr->n_prompt_logprobs != sr->n_prompt_tokens || !sr->n_prompt_tokens ||
                   sr->n_prompt_top_tokens != sr->n_prompt_logprobs ||
                   (opts->n_tokens && sr->n_prompt_tokens != opts->n_tokens))) {
        snapkv__reply__free_unpacked(rep, NULL);
        return skv_client_fail(SNAPKV_E_PROTO, "APPEND: %zu scores and %zu most likely tokens for %zu token ids",
                               sr->n_prompt_logprobs, sr->n_prompt_top_tokens, sr->n_prompt_tokens);
    }
    if (scores && ask->top_n &&
        (rc = copy_top(sr->prompt_top_logprobs, sr->n_prompt_top_logprobs, sr->n_prompt_logprobs,
                       top_len(c, ask->top_n), sr->prompt_logprobs, "APPEND", ask->top))) {
        snapkv__reply__free_unpacked(rep, NULL);
        return rc;
    }
    if (scores && (rc = copy_scores(sr->prompt_logprobs, sr->prompt_top_tokens, sr->n_prompt_logprobs,
                                    sr->prompt_tokens, sr->n_prompt_tokens, "append", scores))) {
        snapkv__reply__free_unpacked(rep, NULL);
        if (ask->top)
            snapkv_logprobs_free(ask->top);
        return rc;
    }
    if ((rc = check_logits(c, opts->return_logits, sr->n_logits, "APPEND"))) {
        snapkv__reply__free_unpacked(rep, NULL);
        snapkv_scores_free(scores);
        if (ask && ask->top)
            snapkv_logprobs_free(ask->top);
        return rc;
    }
    if (out) {
        struct snapkv_append_result res = {.n_tokens = sr->n_tokens, .next_token = sr->next_token,
                                           .n_logits = sr->n_logits};
        if (!skv_client_dup_f32(sr->logits, sr->n_logits, &res.logits)) {
            snapkv__reply__free_unpacked(rep, NULL);
            snapkv_scores_free(scores);
            if (ask && ask->top)
                snapkv_logprobs_free(ask->top);
            return skv_client_fail(SNAPKV_E_NOMEM, "append: out of memory for %zu logits", sr->n_logits);
        }
        *out = res;
    }
    snapkv__reply__free_unpacked(rep, NULL);
    return SNAPKV_OK;
}

void snapkv_append_result_free(struct snapkv_append_result *r)
{
    if (!r)
        return;
    free(r->logits);
    memset(r, 0, sizeof *r);
}

void snapkv_scores_free(struct snapkv_scores *s)
{
    if (!s)
        return;
    free(s->logprobs);
    free(s->tokens);
    free(s->top_tokens);
    memset(s, 0, sizeof *s);
}

/* ---- DECODE ------------------------------------------------------------------------------------- */

void snapkv_sampling_defaults(struct snapkv_sampling *s)
{
    if (s)
        *s = (struct snapkv_sampling){.temperature = 0.0f, .top_p = 1.0f, .stop_at_eos = true};
}

/* Everything a decode produced so far, and who wants to see it as it comes. */
struct decode_acc {
    snapkv_token_fn fn;
    void *user;
    bool stopped;                 /* the callback asked to stop */
    uint32_t *tokens;
    size_t n_tokens, cap_tokens;
    char *text;
    size_t len_text, cap_text;
    struct snapkv_logprobs *lp;   /* asked for: what came so far (lp->n of them), else NULL */
    uint32_t n_top;               /* the top list's length each reply must give */
    size_t cap_lp;
};

/* d's log-probabilities, which must be one per token (and each top list n_top long). */
static int acc_logprobs(struct decode_acc *a, const Snapkv__DecodeReply *d)
{
    struct snapkv_logprobs *lp = a->lp;
    if (d->n_logprobs != d->n_tokens || (a->n_top && d->n_top_logprobs != d->n_tokens))
        return skv_client_fail(SNAPKV_E_PROTO, "decode: %zu log-probabilities and %zu top lists came for %zu tokens "
                               "(a daemon that does not know logprobs sends none)",
                               d->n_logprobs, d->n_top_logprobs, d->n_tokens);
    for (size_t i = 0; i < d->n_top_logprobs && a->n_top; i++)
        if (d->top_logprobs[i]->n_tokens != a->n_top || d->top_logprobs[i]->n_logprobs != a->n_top)
            return skv_client_fail(SNAPKV_E_PROTO, "decode: a top list of %zu tokens and %zu values, not %u",
                                   d->top_logprobs[i]->n_tokens, d->top_logprobs[i]->n_logprobs, a->n_top);
    if (lp->n + d->n_tokens > a->cap_lp) {
        size_t cap = a->cap_lp ? a->cap_lp : 64;
        while (cap < lp->n + d->n_tokens)
            cap *= 2;
        float *v = realloc(lp->logprobs, cap * sizeof *v);
        if (v)
            lp->logprobs = v;
        uint32_t *tt = a->n_top ? realloc(lp->top_tokens, cap * a->n_top * sizeof *tt) : NULL;
        if (tt)
            lp->top_tokens = tt;
        float *tv = a->n_top ? realloc(lp->top_logprobs, cap * a->n_top * sizeof *tv) : NULL;
        if (tv)
            lp->top_logprobs = tv;
        if (!v || (a->n_top && (!tt || !tv)))
            return skv_client_fail(SNAPKV_E_NOMEM, "decode: out of memory for %zu log-probabilities", cap);
        a->cap_lp = cap;
    }
    for (size_t i = 0; i < d->n_tokens; i++) {
        lp->logprobs[lp->n + i] = d->logprobs[i];
        for (uint32_t j = 0; j < a->n_top; j++) {
            lp->top_tokens[(lp->n + i) * a->n_top + j] = d->top_logprobs[i]->tokens[j];
            lp->top_logprobs[(lp->n + i) * a->n_top + j] = d->top_logprobs[i]->logprobs[j];
        }
    }
    lp->n += d->n_tokens;
    return SNAPKV_OK;
}

/* Every DECODE reply counts the tokens generated so far (n_generated): with d's tokens the
 * accumulated ones must come to it, or the daemon dropped replies (it drops what a client that
 * reads too slowly leaves queued beyond its bounds). */
static int check_count(const struct decode_acc *a, const Snapkv__DecodeReply *d)
{
    size_t have = a->n_tokens + d->n_tokens;
    if (have < d->n_generated)
        return skv_client_fail(SNAPKV_E_IO,
                               "decode: lost %zu streamed tokens (the daemon generated %u, %zu came): it dropped "
                               "replies this client did not read in time",
                               (size_t)d->n_generated - have, d->n_generated, have);
    if (have > d->n_generated)
        return skv_client_fail(SNAPKV_E_PROTO, "decode: %zu tokens came for the %u the daemon generated", have,
                               d->n_generated);
    return SNAPKV_OK;
}

static int acc_add(struct decode_acc *a, const Snapkv__DecodeReply *d)
{
    if (a->n_tokens + d->n_tokens > a->cap_tokens) {
        size_t cap = a->cap_tokens ? a->cap_tokens : 64;
        while (cap < a->n_tokens + d->n_tokens)
            cap *= 2;
        uint32_t *t = realloc(a->tokens, cap * sizeof *t);
        if (!t)
            return skv_client_fail(SNAPKV_E_NOMEM, "decode: out of memory for %zu tokens", cap);
        a->tokens = t;
        a->cap_tokens = cap;
    }
    if (d->n_tokens)
        memcpy(a->tokens + a->n_tokens, d->tokens, d->n_tokens * sizeof *d->tokens);
    a->n_tokens += d->n_tokens;

    size_t len = d->text ? strlen(d->text) : 0;
    if (!a->text || a->len_text + len + 1 > a->cap_text) {
        size_t cap = a->cap_text ? a->cap_text : 256;
        while (cap < a->len_text + len + 1)
            cap *= 2;
        char *t = realloc(a->text, cap);
        if (!t)
            return skv_client_fail(SNAPKV_E_NOMEM, "decode: out of memory for %zu bytes of text", cap);
        a->text = t;
        a->cap_text = cap;
    }
    memcpy(a->text + a->len_text, d->text ? d->text : "", len);
    a->len_text += len;
    a->text[a->len_text] = '\0';
    return a->lp ? acc_logprobs(a, d) : SNAPKV_OK;
}

static int decode_partial(void *user, const Snapkv__Reply *rep)
{
    struct decode_acc *a = user;
    const Snapkv__DecodeReply *d = rep->decode;
    size_t first = a->n_tokens;
    int rc = check_count(a, d);
    if (!rc)
        rc = acc_add(a, d);
    if (rc)
        return rc;
    if (a->fn && (d->n_tokens || (d->text && *d->text)) &&
        a->fn(a->user, a->tokens + first, d->n_tokens, d->text ? d->text : "") != 0) {
        a->stopped = true;
        return skv_client_fail(SNAPKV_E_CANCELLED, "decode: stopped by the caller");
    }
    return SNAPKV_OK;
}

/* The most a CANCEL after a failed DECODE (not one the callback stopped) waits for its reply. */
#define CANCEL_WAIT_MS 1000
/* ... and after one the callback stopped, when the client waits for ever (timeout -1) */
#define CANCEL_STOP_WAIT_MS 30000

static int cancel_call(snapkv_client_t *c, const struct snapkv_session_id *id, bool own, bool *cancelled,
                       uint32_t *n_generated);

/* After a DECODE call ended while the decode still ran in the daemon (the callback stopped it,
 * or a timeout, no memory, lost replies): ends it there too, so that the session, and the
 * daemon's decode slot, are free when snapkv_decode returns (the decode's remaining replies come
 * before the CANCEL's and are dropped as stale). Best effort, waiting wait_ms at most (-1: the
 * client's timeout): returns rc, the call's own status, whose message says when the CANCEL
 * failed as well. */
static int cancel_decode(snapkv_client_t *c, const struct snapkv_session_id *id, int rc, int wait_ms)
{
    char why[512], cancel_why[256]; /* copies: the last error is rewritten below */
    snprintf(why, sizeof why, "%s", snapkv_last_error());
    /* the connection the DECODE went out on closed since (the daemon stopped, or restarted, while
     * the callback ran): the daemon dropped, or cancels, a gone client's decode, and a CANCEL
     * would wait for a new connection to say HELLO on (for ever at a timeout of -1) */
    skv_client_look(c);
    if (c->disconnects != c->sent_disconnects)
        return skv_client_fail(rc, "%s", why);
    int timeout_ms = c->timeout_ms;
    if (wait_ms >= 0 && (timeout_ms < 0 || timeout_ms > wait_ms))
        c->timeout_ms = wait_ms;
    else if (wait_ms < 0 && timeout_ms < 0) /* (a close the check above had not seen yet would wait for ever) */
        c->timeout_ms = CANCEL_STOP_WAIT_MS;
    /* its own decode only: the one it meant may have ended, and another client's begun since */
    int crc = cancel_call(c, id, true, NULL, NULL);
    c->timeout_ms = timeout_ms;
    if (!crc)
        return skv_client_fail(rc, "%s", why);
    snprintf(cancel_why, sizeof cancel_why, "%s", snapkv_last_error());
    return skv_client_fail(rc, "%s (and CANCEL failed: %s)", why, cancel_why);
}

int snapkv_decode(snapkv_client_t *c, const struct snapkv_session_id *id, const struct snapkv_sampling *sampling,
                  snapkv_token_fn on_tokens, void *user, struct snapkv_decode_result *out)
{
    return snapkv_decode_logprobs(c, id, sampling, 0, on_tokens, user, out, NULL);
}

int snapkv_decode_logprobs(snapkv_client_t *c, const struct snapkv_session_id *id,
                           const struct snapkv_sampling *sampling, uint32_t top_logprobs, snapkv_token_fn on_tokens,
                           void *user, struct snapkv_decode_result *out, struct snapkv_logprobs *logprobs)
{
    return snapkv_decode_ext(c, id, sampling, NULL, top_logprobs, on_tokens, user, out, logprobs);
}

void snapkv_sampling_ext_defaults(struct snapkv_sampling_ext *ext)
{
    if (ext)
        memset(ext, 0, sizeof *ext);
}

/* The most logit biases one DECODE may carry (the daemon's SKV_LOGIT_BIAS_MAX). */
#define LOGIT_BIAS_MAX 1024u

/* ext's checks the library can make (the daemon checks the ranges) and its wire form in ws: the
 * bias entries in *b_out and pointers to them in *pb_out (malloc'd, the caller frees both, also
 * on failure). */
static int ext_wire(const snapkv_client_t *c, const struct snapkv_sampling_ext *ext, Snapkv__Sampling *ws,
                    Snapkv__LogitBias **b_out, Snapkv__LogitBias ***pb_out)
{
    if (!ext)
        return SNAPKV_OK;
    for (size_t i = 0; i < sizeof ext->reserved / sizeof ext->reserved[0]; i++)
        if (ext->reserved[i])
            return skv_client_fail(SNAPKV_E_INVAL, "decode: snapkv_sampling_ext.reserved[%zu] is not zero", i);
    bool used = ext->min_p != 0 || (ext->repetition_penalty != 0 && ext->repetition_penalty != 1) ||
                ext->frequency_penalty != 0 || ext->presence_penalty != 0 || ext->n_bias;
    if (used && !has_feature(c, "sampling-ext"))
        return skv_client_fail(SNAPKV_E_UNSUPPORTED, "decode: the daemon (snapkvd %s) would ignore min_p, the "
                               "penalties and logit biases: it is older than they are",
                               c->hello->server_version ? c->hello->server_version : "?");
    if (ext->n_bias > LOGIT_BIAS_MAX)
        return skv_client_fail(SNAPKV_E_LIMIT, "decode: at most %u logit biases, not %zu", LOGIT_BIAS_MAX,
                               ext->n_bias);
    if (ext->n_bias && (!ext->bias_tokens || !ext->bias))
        return skv_client_fail(SNAPKV_E_INVAL, "decode: n_bias is %zu but bias_tokens or bias is NULL", ext->n_bias);
    for (size_t i = 0; i < ext->n_bias; i++)
        if (c->hello->n_vocab && ext->bias_tokens[i] >= c->hello->n_vocab)
            return skv_client_fail(SNAPKV_E_INVAL, "decode: bias token %u at index %zu is outside the vocabulary "
                                   "[0, %u)", ext->bias_tokens[i], i, c->hello->n_vocab);
    Snapkv__LogitBias *b = NULL, **pb = NULL;
    if (ext->n_bias && (!(b = *b_out = malloc(ext->n_bias * sizeof *b)) ||
                        !(pb = *pb_out = malloc(ext->n_bias * sizeof *pb))))
        return skv_client_fail(SNAPKV_E_NOMEM, "decode: out of memory for %zu logit biases", ext->n_bias);
    for (size_t i = 0; i < ext->n_bias; i++) {
        snapkv__logit_bias__init(&b[i]);
        b[i].token = ext->bias_tokens[i];
        b[i].bias = ext->bias[i];
        pb[i] = &b[i];
    }
    ws->min_p = ext->min_p;
    ws->repetition_penalty = ext->repetition_penalty;
    ws->repetition_last_n = ext->repetition_last_n;
    ws->frequency_penalty = ext->frequency_penalty;
    ws->presence_penalty = ext->presence_penalty;
    ws->n_logit_bias = ext->n_bias;
    ws->logit_bias = ext->n_bias ? pb : NULL;
    return SNAPKV_OK;
}

int snapkv_decode_ext(snapkv_client_t *c, const struct snapkv_session_id *id, const struct snapkv_sampling *sampling,
                      const struct snapkv_sampling_ext *ext, uint32_t top_logprobs, snapkv_token_fn on_tokens,
                      void *user, struct snapkv_decode_result *out, struct snapkv_logprobs *logprobs)
{
    int rc = skv_client_check(c, id, "decode");
    if (rc)
        return rc;
    if (!out && !on_tokens)
        return skv_client_fail(SNAPKV_E_INVAL, "decode: give on_tokens, out or both");
    if (top_logprobs && !logprobs)
        return skv_client_fail(SNAPKV_E_INVAL, "decode: top_logprobs %u with nowhere to put them", top_logprobs);
    struct snapkv_sampling s;
    if (sampling)
        s = *sampling;
    else
        snapkv_sampling_defaults(&s);
    if (s.n_stop_tokens && !s.stop_tokens)
        return skv_client_fail(SNAPKV_E_INVAL, "decode: n_stop_tokens is %zu but stop_tokens is NULL",
                               s.n_stop_tokens);
    for (size_t i = 0; i < s.n_stop_tokens; i++)
        if (c->hello->n_vocab && s.stop_tokens[i] >= c->hello->n_vocab)
            return skv_client_fail(SNAPKV_E_INVAL, "decode: stop token %u at index %zu is outside the vocabulary "
                                   "[0, %u)", s.stop_tokens[i], i, c->hello->n_vocab);
    if (s.n_stop && !s.stop)
        return skv_client_fail(SNAPKV_E_INVAL, "decode: n_stop is %zu but stop is NULL", s.n_stop);
    for (size_t i = 0; i < s.n_stop; i++)
        if (!s.stop[i] || !*s.stop[i])
            return skv_client_fail(SNAPKV_E_INVAL, "decode: stop sequence %zu is NULL or empty", i);
    if (s.temperature < 0.0f || s.temperature > 100.0f || s.top_p < 0.0f || s.top_p > 1.0f ||
        s.temperature != s.temperature || s.top_p != s.top_p)
        return skv_client_fail(SNAPKV_E_INVAL, "decode: temperature must be in [0, 100] and top_p in [0, 1]");

    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__DecodeRequest d = SNAPKV__DECODE_REQUEST__INIT;
    Snapkv__Sampling ws = SNAPKV__SAMPLING__INIT;
    ws.temperature = s.temperature;
    ws.top_k = s.top_k;
    ws.top_p = s.top_p;
    ws.seed = s.seed;
    ws.n_stop_tokens = s.n_stop_tokens;
    ws.stop_tokens = (uint32_t *)s.stop_tokens;
    ws.max_tokens = s.max_tokens;
    ws.stop_at_eos = s.stop_at_eos;
    ws.n_stop = s.n_stop;
    ws.stop = (char **)s.stop;
    ws.logprobs = logprobs != NULL;
    ws.top_logprobs = top_logprobs;
    Snapkv__LogitBias *bias = NULL, **pbias = NULL;
    rc = ext_wire(c, ext, &ws, &bias, &pbias);
    if (rc) {
        free(bias);
        free(pbias);
        return rc;
    }
    d.session_id = skv_client_id_wire(id);
    d.sampling = &ws;
    d.stream = on_tokens != NULL;
    req.command_case = SNAPKV__REQUEST__COMMAND_DECODE;
    req.decode = &d;

    struct snapkv_logprobs lp = {0};
    uint32_t n_top = top_logprobs < c->hello->n_vocab || !c->hello->n_vocab ? top_logprobs : c->hello->n_vocab;
    struct decode_acc acc = {.fn = on_tokens, .user = user, .lp = logprobs ? &lp : NULL, .n_top = n_top};
    Snapkv__Reply *rep = NULL;
    bool in_flight = false;
    rc = skv_client_call(c, &req, SNAPKV__REPLY__RESULT_DECODE, "DECODE", decode_partial, &acc, &in_flight, &rep);
    free(bias);
    free(pbias);
    if (rc && in_flight)
        rc = cancel_decode(c, id, rc, acc.stopped ? -1 : CANCEL_WAIT_MS);
    if (rc)
        goto out_free_acc;
    /* the final reply may carry the last batch (and, without streaming, all of them); what the
     * callback answers to it no longer matters: the decode is complete */
    const Snapkv__DecodeReply *r = rep->decode;
    size_t first = acc.n_tokens;
    rc = check_count(&acc, r);
    if (!rc)
        rc = acc_add(&acc, r);
    if (rc)
        goto out_free_reply;
    if (on_tokens && (r->n_tokens || (r->text && *r->text))) {
        c->in_call = true; /* inside the call, as every other batch's: its own client is refused */
        (void)on_tokens(user, acc.tokens + first, r->n_tokens, r->text ? r->text : "");
        c->in_call = false;
    }
    const bool failed = r->finish_reason && strcmp(r->finish_reason, "error") == 0;
    if (failed) /* why, for snapkv_last_error(); a caller without a result learns it by the status */
        rc = skv_client_fail(out ? SNAPKV_OK : SNAPKV_E_IO, "%s",
                             rep->message && *rep->message ? rep->message : "the decode failed");
    if (out) {
        struct snapkv_decode_result res = {
            .tokens = acc.tokens,
            .n_tokens = acc.n_tokens,
            .text = acc.text,
            .n_generated = r->n_generated,
        };
        snprintf(res.finish_reason, sizeof res.finish_reason, "%s", r->finish_reason ? r->finish_reason : "");
        acc.tokens = NULL;
        acc.text = NULL;
        *out = res;
    }
    if (logprobs && !rc) { /* (written on success only, as documented) */
        lp.n_top = n_top;
        *logprobs = lp;
        lp = (struct snapkv_logprobs){0};
    }

out_free_reply:
    snapkv__reply__free_unpacked(rep, NULL);
out_free_acc:
    free(acc.tokens);
    free(acc.text);
    snapkv_logprobs_free(&lp);
    return rc;
}

void snapkv_logprobs_free(struct snapkv_logprobs *lp)
{
    if (!lp)
        return;
    free(lp->logprobs);
    free(lp->top_tokens);
    free(lp->top_logprobs);
    memset(lp, 0, sizeof *lp);
}

void snapkv_decode_result_free(struct snapkv_decode_result *r)
{
    if (!r)
        return;
    free(r->tokens);
    free(r->text);
    memset(r, 0, sizeof *r);
}

/* ---- COMPRESS, FORK, RELEASE ---------------------------------------------------------------------- */

int snapkv_compress(snapkv_client_t *c, const struct snapkv_session_id *id, const char *spec, uint32_t window_from,
                    struct snapkv_compress_result *out)
{
    int rc = skv_client_check(c, id, "compress");
    if (rc)
        return rc;
    if (!spec || !*spec)
        return skv_client_fail(SNAPKV_E_INVAL, "compress: a compression spec is required");
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__CompressRequest cr = SNAPKV__COMPRESS_REQUEST__INIT;
    Snapkv__CompressSpec ws = SNAPKV__COMPRESS_SPEC__INIT;
    ws.spec = (char *)spec;
    cr.session_id = skv_client_id_wire(id);
    cr.compress = &ws;
    cr.window_from = window_from;
    req.command_case = SNAPKV__REQUEST__COMMAND_COMPRESS;
    req.compress = &cr;
    Snapkv__Reply *rep = NULL;
    rc = skv_client_call(c, &req, SNAPKV__REPLY__RESULT_COMPRESS, "COMPRESS", NULL, NULL, NULL, &rep);
    if (rc)
        return rc;
    if (out) {
        const Snapkv__CompressReply *r = rep->compress;
        struct snapkv_compress_result res = {
            .bytes_before = r->bytes_before,
            .bytes_after = r->bytes_after,
            .n_layers = r->n_kept,
        };
        rc = skv_client_layers(c, r->kept, r->n_kept, NULL, 0, &res.layers);
        if (!rc)
            *out = res;
    }
    snapkv__reply__free_unpacked(rep, NULL);
    return rc;
}

void snapkv_compress_result_free(struct snapkv_compress_result *r)
{
    if (!r)
        return;
    free(r->layers);
    memset(r, 0, sizeof *r);
}

int snapkv_fork(snapkv_client_t *c, const struct snapkv_session_id *id, struct snapkv_session_id *out,
                uint64_t *shared_bytes)
{
    int rc = skv_client_check(c, id, "fork");
    if (rc)
        return rc;
    if (!out)
        return skv_client_fail(SNAPKV_E_INVAL, "fork: out is required");
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__ForkRequest f = SNAPKV__FORK_REQUEST__INIT;
    f.session_id = skv_client_id_wire(id);
    req.command_case = SNAPKV__REQUEST__COMMAND_FORK;
    req.fork = &f;
    Snapkv__Reply *rep = NULL;
    rc = skv_client_call(c, &req, SNAPKV__REPLY__RESULT_FORK, "FORK", NULL, NULL, NULL, &rep);
    if (rc)
        return rc;
    struct snapkv_session_id new_id;
    rc = skv_client_id_parse(&rep->fork->session_id, "FORK", &new_id);
    if (!rc) {
        *out = new_id;
        if (shared_bytes)
            *shared_bytes = rep->fork->shared_bytes;
    }
    snapkv__reply__free_unpacked(rep, NULL);
    return rc;
}

/* The checks of a call that names no session: connected, arg given, the daemon's facts fresh,
 * and the daemon knowing the command (feature). */
static int check_call(snapkv_client_t *c, const void *arg, const char *what, const char *feature)
{
    if (!arg)
        return skv_client_fail(SNAPKV_E_INVAL, "%s: NULL argument", what);
    int rc = skv_client_check(c, arg, what);
    if (!rc && feature && !has_feature(c, feature))
        rc = skv_client_fail(SNAPKV_E_UNSUPPORTED, "%s: the daemon (snapkvd %s) is older than the command", what,
                             c->hello->server_version ? c->hello->server_version : "?");
    return rc;
}

int snapkv_tokenize(snapkv_client_t *c, const char *text, const struct snapkv_tokenize_opts *opts,
                    struct snapkv_tokens *out)
{
    if (!out)
        return skv_client_fail(SNAPKV_E_INVAL, "tokenize: out is required");
    *out = (struct snapkv_tokens){0}; /* snapkv_tokens_free is safe whatever comes */
    for (size_t i = 0; opts && i < sizeof opts->reserved / sizeof opts->reserved[0]; i++)
        if (opts->reserved[i])
            return skv_client_fail(SNAPKV_E_INVAL, "tokenize: snapkv_tokenize_opts.reserved[%zu] is not zero", i);
    if (text && !*text)
        return skv_client_fail(SNAPKV_E_INVAL, "tokenize: the text is empty");
    int rc = check_call(c, text, "tokenize", "tokenize");
    if (rc)
        return rc;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__TokenizeRequest t = SNAPKV__TOKENIZE_REQUEST__INIT;
    t.text = (char *)text;
    t.chat = opts && opts->chat;
    t.append = opts && opts->append;
    req.command_case = SNAPKV__REQUEST__COMMAND_TOKENIZE;
    req.tokenize = &t;
    Snapkv__Reply *rep = NULL;
    rc = skv_client_call(c, &req, SNAPKV__REPLY__RESULT_TOKENIZE, "TOKENIZE", NULL, NULL, NULL, &rep);
    if (rc)
        return rc;
    const Snapkv__TokenizeReply *r = rep->tokenize;
    uint32_t *ids = r->n_tokens ? malloc(r->n_tokens * sizeof *ids) : NULL;
    if (r->n_tokens && !ids) {
        rc = skv_client_fail(SNAPKV_E_NOMEM, "tokenize: out of memory for %zu tokens", r->n_tokens);
    } else {
        if (r->n_tokens)
            memcpy(ids, r->tokens, r->n_tokens * sizeof *ids);
        *out = (struct snapkv_tokens){ids, r->n_tokens};
    }
    snapkv__reply__free_unpacked(rep, NULL);
    return rc;
}

void snapkv_tokens_free(struct snapkv_tokens *t)
{
    if (!t)
        return;
    free(t->tokens);
    *t = (struct snapkv_tokens){0};
}

int snapkv_detokenize(snapkv_client_t *c, const uint32_t *tokens, size_t n, bool skip_special, char **text)
{
    int rc = check_call(c, text, "detokenize", "tokenize");
    if (rc)
        return rc;
    if (n && !tokens)
        return skv_client_fail(SNAPKV_E_INVAL, "detokenize: n is %zu but tokens is NULL", n);
    uint64_t most = (uint64_t)c->hello->max_prompt_tokens + c->hello->max_new_tokens;
    if (most && n > most)
        return skv_client_fail(SNAPKV_E_LIMIT, "detokenize: %zu tokens, more than the daemon's limit of %llu", n,
                               (unsigned long long)most);
    for (size_t i = 0; i < n; i++)
        if (c->hello->n_vocab && tokens[i] >= c->hello->n_vocab)
            return skv_client_fail(SNAPKV_E_INVAL, "detokenize: token %u at index %zu is outside the vocabulary "
                                   "[0, %u)", tokens[i], i, c->hello->n_vocab);
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__DetokenizeRequest d = SNAPKV__DETOKENIZE_REQUEST__INIT;
    d.n_tokens = n;
    d.tokens = (uint32_t *)tokens;
    d.skip_special = skip_special;
    req.command_case = SNAPKV__REQUEST__COMMAND_DETOKENIZE;
    req.detokenize = &d;
    Snapkv__Reply *rep = NULL;
    rc = skv_client_call(c, &req, SNAPKV__REPLY__RESULT_DETOKENIZE, "DETOKENIZE", NULL, NULL, NULL, &rep);
    if (rc)
        return rc;
    char *s = strdup(rep->detokenize->text ? rep->detokenize->text : "");
    if (!s)
        rc = skv_client_fail(SNAPKV_E_NOMEM, "detokenize: out of memory for the text");
    else
        *text = s;
    snapkv__reply__free_unpacked(rep, NULL);
    return rc;
}

int snapkv_release(snapkv_client_t *c, const struct snapkv_session_id *id)
{
    int rc = skv_client_check(c, id, "release");
    if (rc)
        return rc;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__ReleaseRequest r = SNAPKV__RELEASE_REQUEST__INIT;
    r.session_id = skv_client_id_wire(id);
    req.command_case = SNAPKV__REQUEST__COMMAND_RELEASE;
    req.release = &r;
    Snapkv__Reply *rep = NULL;
    rc = skv_client_call(c, &req, SNAPKV__REPLY__RESULT_RELEASE, "RELEASE", NULL, NULL, NULL, &rep);
    if (rc)
        return rc;
    snapkv__reply__free_unpacked(rep, NULL);
    return SNAPKV_OK;
}

/* CANCEL; own: only a decode of this connection's. */
static int cancel_call(snapkv_client_t *c, const struct snapkv_session_id *id, bool own, bool *cancelled,
                       uint32_t *n_generated)
{
    int rc = skv_client_check(c, id, "cancel");
    if (rc)
        return rc;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__CancelRequest r = SNAPKV__CANCEL_REQUEST__INIT;
    r.session_id = skv_client_id_wire(id);
    r.own = own;
    req.command_case = SNAPKV__REQUEST__COMMAND_CANCEL;
    req.cancel = &r;
    Snapkv__Reply *rep = NULL;
    rc = skv_client_call(c, &req, SNAPKV__REPLY__RESULT_CANCEL, "CANCEL", NULL, NULL, NULL, &rep);
    if (rc)
        return rc;
    if (cancelled)
        *cancelled = rep->cancel->cancelled;
    if (n_generated)
        *n_generated = rep->cancel->n_generated;
    snapkv__reply__free_unpacked(rep, NULL);
    return SNAPKV_OK;
}

int snapkv_cancel(snapkv_client_t *c, const struct snapkv_session_id *id, bool *cancelled, uint32_t *n_generated)
{
    return cancel_call(c, id, false, cancelled, n_generated);
}

/* ---- POSIX shared memory ---------------------------------------------------------------------------- */

/* The user and group snapkvd runs as (systemd/sysusers.d/snapkvd.conf); the environment's
 * SNAPKV_DAEMON_USER names another user. */
#define SHM_DAEMON_USER "snapkv"
#define SHM_DAEMON_GROUP "snapkv"

/* getpwnam_r / getgrnam_r of name into *out (a uid_t / gid_t): 0, ENOENT when there is no such
 * entry, or the lookup's error. */
static int pw_uid(const char *name, char *buf, size_t cap, void *out)
{
    struct passwd pw, *found = NULL;
    int err = getpwnam_r(name, &pw, buf, cap, &found);
    if (!err && found)
        *(uid_t *)out = pw.pw_uid;
    return err ? err : found ? 0 : ENOENT;
}

static int gr_gid(const char *name, char *buf, size_t cap, void *out)
{
    struct group gr, *found = NULL;
    int err = getgrnam_r(name, &gr, buf, cap, &found);
    if (!err && found)
        *(gid_t *)out = gr.gr_gid;
    return err ? err : found ? 0 : ENOENT;
}

/* Runs a lookup with a buffer grown until the entry fits (a group's lists every member). */
static int nss_lookup(int (*lookup)(const char *, char *, size_t, void *), const char *name, void *out)
{
    char *buf = NULL;
    int err;
    size_t cap = 1024;
    do {
        cap *= 4;
        char *bigger = realloc(buf, cap);
        if (!bigger) {
            err = ENOMEM;
            break;
        }
        buf = bigger;
        err = lookup(name, buf, cap, out);
    } while (err == ERANGE && cap < ((size_t)1 << 22));
    free(buf);
    return err;
}

/* The uid of the daemon's user: SNAPKV_OK; SNAPKV_E_NOT_FOUND when user snapkv does not exist
 * (a daemon run by hand); SNAPKV_E_INVAL when SNAPKV_DAEMON_USER names no user (a typo would
 * otherwise fall back to the group's access without a word). secure_getenv: a setuid client's
 * caller cannot name a user of its own choosing. */
static int daemon_uid(uid_t *out)
{
    const char *name = secure_getenv("SNAPKV_DAEMON_USER");
    bool named = name && *name;
    int err = nss_lookup(pw_uid, named ? name : SHM_DAEMON_USER, out);
    if (!err)
        return SNAPKV_OK;
    if (named)
        return skv_client_fail(SNAPKV_E_INVAL, "shm: SNAPKV_DAEMON_USER names '%.64s', %s", name,
                               err == ENOENT ? "no such user" : strerror(err));
    return SNAPKV_E_NOT_FOUND;
}

/* Gives the daemon's user, another user than the caller, read and write on a new object by a
 * POSIX ACL entry, and its group and everyone else nothing (tmpfs keeps ACLs): other clients,
 * of the daemon's group too, cannot open it. False when the file system takes no ACL. */
static bool grant_daemon_user(int fd, uid_t uid)
{
    char text[96];
    snprintf(text, sizeof text, "u::rw-,u:%lu:rw-,g::---,m::rw-,o::---", (unsigned long)uid);
    acl_t acl = acl_from_text(text);
    if (!acl)
        return false;
    bool ok = acl_set_fd(fd, acl) == 0;
    acl_free(acl);
    return ok;
}

/* The gid of SHM_DAEMON_GROUP; false when there is no such group (or it cannot be read). */
static bool daemon_gid(gid_t *out)
{
    return nss_lookup(gr_gid, SHM_DAEMON_GROUP, out) == 0;
}

/* Hands a new object to the daemon's group when the caller belongs to that group only as a
 * supplementary one (or is root): a mode-0660 object of the caller's primary group is out of
 * the daemon's reach. Best effort: otherwise the daemon's refusal says what to do. */
static void share_with_daemon(int fd)
{
    gid_t gid;
    if (!daemon_gid(&gid) || gid == getegid())
        return;
    bool member = geteuid() == 0;
    int n = getgroups(0, NULL);
    gid_t *groups = !member && n > 0 ? malloc((size_t)n * sizeof *groups) : NULL;
    if (groups) {
        n = getgroups(n, groups);
        for (int i = 0; i < n && !member; i++)
            member = groups[i] == gid;
        free(groups);
    }
    if (member && fchown(fd, (uid_t)-1, gid) < 0) {
        /* left to the caller's group */
    }
}

int snapkv_shm_create(const char *name_hint, size_t size, struct snapkv_shm *out)
{
    if (!out)
        return skv_client_fail(SNAPKV_E_INVAL, "shm: out is required");
    if (size == 0 || size > (size_t)INT64_MAX)
        return skv_client_fail(SNAPKV_E_INVAL, "shm: size %zu is not usable", size);
    char hint[25];
    const char *h = name_hint && *name_hint ? name_hint : "buf";
    size_t n = 0;
    for (; h[n] && n < sizeof hint - 1; n++) {
        char ch = h[n];
        bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
                  ch == '-';
        hint[n] = ok ? ch : '_';
    }
    hint[n] = '\0';

    struct snapkv_shm shm = {.fd = -1, .size = size};
    int rc;
    for (int attempt = 0; attempt < 16 && shm.fd < 0; attempt++) {
        uint32_t rnd;
        if (getrandom(&rnd, sizeof rnd, GRND_NONBLOCK) != (ssize_t)sizeof rnd) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            rnd = (uint32_t)ts.tv_nsec ^ (uint32_t)attempt * 0x9e3779b9u;
        }
        snprintf(shm.name, sizeof shm.name, "/snapkv-%s-%ld-%08x", hint, (long)getpid(), rnd);
        shm.fd = shm_open(shm.name, O_RDWR | O_CREAT | O_EXCL, 0600);
        if (shm.fd < 0 && errno != EEXIST)
            return skv_client_fail(errno == EACCES ? SNAPKV_E_PERM : SNAPKV_E_IO, "shm_open %s: %s", shm.name,
                                   strerror(errno));
    }
    if (shm.fd < 0)
        return skv_client_fail(SNAPKV_E_EXISTS, "shm: no free name for '%s'", hint);
    /* The daemon's user alone may open it besides the caller: an ACL entry when it is another
     * user. Without that user (a daemon run by hand) or ACLs, group read/write whatever the
     * umask, the group the daemon's when the caller may give it */
    uid_t duid = 0;
    rc = daemon_uid(&duid);
    if (rc == SNAPKV_E_INVAL)
        goto out_unlink;
    bool own = rc == SNAPKV_OK && fchmod(shm.fd, 0600) == 0 && (duid == geteuid() || grant_daemon_user(shm.fd, duid));
    if (!own && fchmod(shm.fd, 0660) < 0) {
        rc = skv_client_fail(SNAPKV_E_IO, "fchmod %s: %s", shm.name, strerror(errno));
        goto out_unlink;
    }
    if (!own)
        share_with_daemon(shm.fd);
    if (ftruncate(shm.fd, (off_t)size) < 0) {
        rc = skv_client_fail(errno == ENOSPC || errno == EFBIG ? SNAPKV_E_LIMIT : SNAPKV_E_IO,
                             "ftruncate %s to %zu bytes: %s", shm.name, size, strerror(errno));
        goto out_unlink;
    }
    /* the pages taken now: a tmpfs without room for them took the ftruncate, and the caller's
     * first write past its room was a SIGBUS */
    int fa;
    while ((fa = posix_fallocate(shm.fd, 0, (off_t)size)) == EINTR) /* (a signal in a large one) */
        ;
    if (fa && fa != EOPNOTSUPP && fa != EINVAL) {
        rc = skv_client_fail(fa == ENOSPC || fa == EFBIG ? SNAPKV_E_LIMIT : SNAPKV_E_IO,
                             "shm %s: %zu bytes: %s", shm.name, size, strerror(fa));
        goto out_unlink;
    }
    shm.addr = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, shm.fd, 0);
    if (shm.addr == MAP_FAILED) {
        rc = skv_client_fail(errno == ENOMEM ? SNAPKV_E_NOMEM : SNAPKV_E_IO, "mmap %s (%zu bytes): %s", shm.name,
                             size, strerror(errno));
        goto out_unlink;
    }
    *out = shm;
    return SNAPKV_OK;

out_unlink:
    shm_unlink(shm.name);
    close(shm.fd);
    return rc;
}

void snapkv_shm_destroy(struct snapkv_shm *shm)
{
    if (!shm)
        return;
    if (shm->addr && shm->addr != MAP_FAILED)
        munmap(shm->addr, shm->size);
    if (shm->name[0])
        shm_unlink(shm->name);
    if (shm->name[0] && shm->fd >= 0)
        close(shm->fd);
    memset(shm, 0, sizeof *shm);
    shm->fd = -1;
}

static int check_shm(const struct snapkv_shm *shm, uint64_t offset, const char *what)
{
    if (!shm || !shm->name[0] || memchr(shm->name, '\0', sizeof shm->name) == NULL)
        return skv_client_fail(SNAPKV_E_INVAL, "%s: a created shared-memory buffer is required", what);
    if (offset >= shm->size)
        return skv_client_fail(SNAPKV_E_INVAL, "%s: offset %llu is past the buffer's %zu bytes", what,
                               (unsigned long long)offset, shm->size);
    return SNAPKV_OK;
}

/* ---- K/V layout ---------------------------------------------------------------------------------- */

/* snapkv_kv_bytes, false when it does not fit in 64 bits (what a daemon reports is checked so:
 * a wrapped size would pass the check against the bytes written, and every offset after it
 * would point past the buffer). */
static bool kv_bytes_checked(const struct snapkv_layer_kept *layers, size_t n, uint32_t n_kv_heads, uint32_t head_dim,
                             uint64_t *out)
{
    uint64_t total = 0, per_row = 2ull * n_kv_heads * head_dim * sizeof(float), layer; /* (< 2^37) */
    for (size_t i = 0; layers && i < n; i++)
        if (__builtin_mul_overflow(per_row, (uint64_t)layers[i].kept, &layer) ||
            __builtin_add_overflow(total, layer, &total))
            return false;
    *out = total;
    return true;
}

uint64_t snapkv_kv_bytes(const struct snapkv_layer_kept *layers, size_t n, uint32_t n_kv_heads, uint32_t head_dim)
{
    uint64_t total = 0;
    for (size_t i = 0; layers && i < n; i++)
        total += 2ull * n_kv_heads * layers[i].kept * head_dim * sizeof(float);
    return total;
}

uint64_t snapkv_kv_offset(const struct snapkv_kv_layout *l, size_t i, uint32_t head, bool v, uint32_t n_kv_heads,
                          uint32_t head_dim)
{
    if (!l || i >= l->n_layers)
        return 0;
    uint64_t off = snapkv_kv_bytes(l->layers, i, n_kv_heads, head_dim);
    uint64_t plane = (uint64_t)l->layers[i].kept * head_dim * sizeof(float); /* one head's rows */
    return off + (v ? plane * n_kv_heads : 0) + plane * head;
}

void snapkv_kv_layout_free(struct snapkv_kv_layout *l)
{
    if (!l)
        return;
    free(l->layers);
    free(l->positions);
    memset(l, 0, sizeof *l);
}

/* ---- EXPORT_KV, IMPORT_KV -------------------------------------------------------------------------- */

/* The buffer of an export or import: a shared-memory object or a CUDA IPC handle. */
static int buffer_ref(const struct snapkv_shm *shm, const struct snapkv_cuda_ipc_buffer *cuda, uint64_t offset,
                      const char *what, Snapkv__BufferRef *buf)
{
    snapkv__buffer_ref__init(buf);
    if (shm && cuda)
        return skv_client_fail(SNAPKV_E_INVAL, "%s: give a shared-memory buffer or a CUDA buffer, not both", what);
    if (cuda) {
        if (cuda->size == 0 || offset >= cuda->size)
            return skv_client_fail(SNAPKV_E_INVAL, "%s: offset %llu is past the CUDA buffer's %llu bytes", what,
                                   (unsigned long long)offset, (unsigned long long)cuda->size);
        buf->kind_case = SNAPKV__BUFFER_REF__KIND_CUDA_IPC_HANDLE;
        buf->cuda_ipc_handle = (ProtobufCBinaryData){SNAPKV_CUDA_IPC_HANDLE_BYTES, (uint8_t *)cuda->handle};
        buf->size = cuda->size;
    } else {
        int rc = check_shm(shm, offset, what);
        if (rc)
            return rc;
        buf->kind_case = SNAPKV__BUFFER_REF__KIND_SHM_NAME;
        buf->shm_name = (char *)shm->name;
        buf->size = shm->size;
    }
    buf->offset = offset;
    return SNAPKV_OK;
}

static int export_kv(snapkv_client_t *c, const struct snapkv_session_id *id, const struct snapkv_shm *shm,
                     const struct snapkv_cuda_ipc_buffer *cuda, uint64_t offset, uint32_t layer_first,
                     uint32_t layer_count, struct snapkv_kv_layout *out)
{
    int rc = skv_client_check(c, id, "export");
    if (rc)
        return rc;
    if (!out)
        return skv_client_fail(SNAPKV_E_INVAL, "export: out is required");
    Snapkv__BufferRef buf;
    rc = buffer_ref(shm, cuda, offset, "export", &buf);
    if (rc)
        return rc;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__ExportKvRequest e = SNAPKV__EXPORT_KV_REQUEST__INIT;
    e.session_id = skv_client_id_wire(id);
    e.buffer = &buf;
    e.layer_first = layer_first;
    e.layer_count = layer_count;
    req.command_case = SNAPKV__REQUEST__COMMAND_EXPORT_KV;
    req.export_kv = &e;
    Snapkv__Reply *rep = NULL;
    rc = skv_client_call(c, &req, SNAPKV__REPLY__RESULT_EXPORT_KV, "EXPORT_KV", NULL, NULL, NULL, &rep);
    if (rc)
        return rc;
    const Snapkv__ExportKvReply *r = rep->export_kv;
    struct snapkv_kv_layout res = {.bytes_written = r->bytes_written, .n_layers = r->n_kept,
                                   .n_positions = r->n_positions, .original_length = r->original_length};
    if (r->bytes_written > buf.size - offset) {
        rc = skv_client_fail(SNAPKV_E_PROTO, "export: the daemon reports %llu bytes written into %llu",
                             (unsigned long long)r->bytes_written, (unsigned long long)(buf.size - offset));
        goto out_free_reply;
    }
    if (!skv_client_dup_u32(r->positions, r->n_positions, &res.positions)) {
        rc = skv_client_fail(SNAPKV_E_NOMEM, "export: out of memory for %zu positions", r->n_positions);
        goto out_free_reply;
    }
    rc = skv_client_layers(c, r->kept, r->n_kept, res.positions, res.n_positions, &res.layers);
    if (rc) {
        free(res.positions);
        goto out_free_reply;
    }
    uint64_t need = 0;
    if (c->hello && !kv_bytes_checked(res.layers, res.n_layers, c->hello->n_kv_heads, c->hello->head_dim, &need)) {
        rc = skv_client_fail(SNAPKV_E_PROTO, "export: the layout the daemon reports is larger than 2^64 bytes");
        free(res.layers);
        free(res.positions);
        goto out_free_reply;
    }
    if (need > res.bytes_written) { /* the layout would index past what was written */
        rc = skv_client_fail(SNAPKV_E_PROTO, "export: the layout the daemon reports takes %llu bytes, %llu written",
                             (unsigned long long)need, (unsigned long long)res.bytes_written);
        free(res.layers);
        free(res.positions);
        goto out_free_reply;
    }
    *out = res;

out_free_reply:
    snapkv__reply__free_unpacked(rep, NULL);
    return rc;
}


int snapkv_export_kv_layers(snapkv_client_t *c, const struct snapkv_session_id *id, const struct snapkv_shm *shm,
                            uint64_t offset, uint32_t layer_first, uint32_t layer_count, struct snapkv_kv_layout *out)
{
    if (!shm)
        return skv_client_fail(SNAPKV_E_INVAL, "export: a created shared-memory buffer is required");
    return export_kv(c, id, shm, NULL, offset, layer_first, layer_count, out);
}

int snapkv_export_kv_cuda(snapkv_client_t *c, const struct snapkv_session_id *id,
                          const struct snapkv_cuda_ipc_buffer *buf, uint64_t offset, uint32_t layer_first,
                          uint32_t layer_count, struct snapkv_kv_layout *out)
{
    if (!buf)
        return skv_client_fail(SNAPKV_E_INVAL, "export: a CUDA buffer is required");
    return export_kv(c, id, NULL, buf, offset, layer_first, layer_count, out);
}

int snapkv_export_kv(snapkv_client_t *c, const struct snapkv_session_id *id, const struct snapkv_shm *shm,
                     uint64_t offset, struct snapkv_kv_layout *out)
{
    return snapkv_export_kv_layers(c, id, shm, offset, 0, 0, out);
}

int snapkv_import_kv(snapkv_client_t *c, const struct snapkv_import_opts *opts, struct snapkv_session_id *out)
{
    int rc = skv_client_check(c, opts, "import");
    if (rc)
        return rc;
    if (!out)
        return skv_client_fail(SNAPKV_E_INVAL, "import: out is required");
    Snapkv__BufferRef buf;
    if (!opts->shm && !opts->cuda)
        return skv_client_fail(SNAPKV_E_INVAL, "import: a shared-memory or CUDA buffer is required");
    rc = buffer_ref(opts->shm, opts->cuda, opts->offset, "import", &buf);
    if (rc)
        return rc;
    if (opts->n_layers == 0 || !opts->layers)
        return skv_client_fail(SNAPKV_E_INVAL, "import: per-layer kept lengths are required");
    if ((opts->n_positions && !opts->positions) || (opts->n_tokens && !opts->tokens))
        return skv_client_fail(SNAPKV_E_INVAL, "import: a count is set but its array is NULL");
    for (size_t i = 0; i < opts->n_layers; i++)
        if (opts->layers[i].n_heads && !opts->layers[i].kept_per_head)
            return skv_client_fail(SNAPKV_E_INVAL, "import: layer %zu has n_heads but no kept_per_head", i);

    Snapkv__LayerKept *kept = calloc(opts->n_layers, sizeof *kept);
    Snapkv__LayerKept **kept_p = calloc(opts->n_layers, sizeof *kept_p);
    if (!kept || !kept_p) {
        rc = skv_client_fail(SNAPKV_E_NOMEM, "import: out of memory for %zu layers", opts->n_layers);
        goto out_free_kept;
    }
    for (size_t i = 0; i < opts->n_layers; i++) {
        const struct snapkv_layer_kept *l = &opts->layers[i];
        snapkv__layer_kept__init(&kept[i]);
        kept[i].layer = l->layer;
        kept[i].kept = l->kept;
        kept[i].n_kept_per_head = l->n_heads;
        kept[i].kept_per_head = (uint32_t *)l->kept_per_head;
        kept[i].bytes = l->bytes;
        kept_p[i] = &kept[i];
    }
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__ImportKvRequest im = SNAPKV__IMPORT_KV_REQUEST__INIT;
    im.buffer = &buf;
    im.n_kept = opts->n_layers;
    im.kept = kept_p;
    im.n_positions = opts->n_positions;
    im.positions = (uint32_t *)opts->positions;
    im.n_tokens = opts->n_tokens;
    im.tokens = (uint32_t *)opts->tokens;
    im.original_length = opts->original_length ? opts->original_length : (uint32_t)opts->n_tokens;
    req.command_case = SNAPKV__REQUEST__COMMAND_IMPORT_KV;
    req.import_kv = &im;
    Snapkv__Reply *rep = NULL;
    rc = skv_client_call(c, &req, SNAPKV__REPLY__RESULT_IMPORT_KV, "IMPORT_KV", NULL, NULL, NULL, &rep);
    if (rc)
        goto out_free_kept;
    struct snapkv_session_id new_id;
    rc = skv_client_id_parse(&rep->import_kv->session_id, "IMPORT_KV", &new_id);
    if (!rc)
        *out = new_id;
    snapkv__reply__free_unpacked(rep, NULL);

out_free_kept:
    free(kept_p);
    free(kept);
    return rc;
}
