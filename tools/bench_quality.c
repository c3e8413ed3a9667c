/* snapkv-bench quality: passkey retrieval accuracy and next-token fidelity of compressed KV
 * caches against the full cache, with every spec fed from one shared forward ("fan-out"),
 * and the JSON / markdown / gnuplot outputs. */
#include "tools/bench_quality.h"

#include "common/status.h"
#include "common/utf8.h"
#include "daemon/compress/compress.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/model.h"
#include "daemon/engine/sampler.h"
#include "daemon/engine/tokenizer.h"
#include "kernels/backend.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_LIST 32
/* passkey counts are [length][spec][depth], so the lengths done so far are a prefix */
#define CIDX(i, l, d) (((l) * q->n_specs + (i)) * nd + (d))
#define VERIFY_TOKENS 1024  /* prompt length of the fan-out / reuse equivalence check */

/* ---- passkey prompt text --------------------------------------------------------------------- */

/* The filler and key sentence of the passkey literature (Mohtashami & Jaggi 2023). */
static const char FILLER[] = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
static const char INTRO[] = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
                            "it. I will quiz you about the important information there.";

struct passkey_style {
    const char *intro;      /* before the filler ("" for none) */
    const char *question;   /* after the filler, in the user message */
    const char *prefix;     /* start of the assistant's answer ("" for none) */
};

static const struct passkey_style STYLES[] = {
    {INTRO, "What is the pass key? The pass key is", ""},
    {INTRO, "What is the pass key?", "The pass key is"},
    {INTRO, "What is the pass key? Answer with the 5-digit number only.", ""},
    {"", "What is the pass key?", "The pass key is"},
    {INTRO, "What is the pass key? Remember, the pass key is a 5-digit number.", "The pass key is"},
    {INTRO, "What is the pass key? Answer with the 5-digit number only.", "The pass key is"},
    {"", "What is the pass key? Answer with the 5-digit number only.", "The pass key is"},
};
#define N_STYLES ((int)(sizeof STYLES / sizeof STYLES[0]))
#define DEFAULT_STYLE 5

json_t *skv_bench_json_text(const char *s, size_t n)
{
    char *fixed = skv_utf8_fix(s ? s : "", s ? n : 0, &n);
    json_t *j = fixed ? json_stringn(fixed, n) : NULL;
    free(fixed);
    return j;
}

int skv_bench_quality_n_styles(void)
{
    return N_STYLES;
}

const char *skv_bench_quality_style_desc(int style)
{
    static const char *const desc[] = {
        "intro; question \"What is the pass key? The pass key is\" in the user turn",
        "intro; question \"What is the pass key?\"; assistant turn starts \"The pass key is\"",
        "intro; \"What is the pass key? Answer with the 5-digit number only.\"",
        "no intro; \"What is the pass key?\"; assistant turn starts \"The pass key is\"",
        "intro; \"What is the pass key? Remember, the pass key is a 5-digit number.\"; assistant "
        "starts \"The pass key is\"",
        "intro; \"What is the pass key? Answer with the 5-digit number only.\"; assistant starts \"The pass "
        "key is\"",
        "no intro; \"What is the pass key? Answer with the 5-digit number only.\"; assistant starts \"The "
        "pass key is\"",
    };
    return style >= 0 && style < N_STYLES ? desc[style] : "?";
}

/* ---- small helpers ------------------------------------------------------------------------- */

struct strbuf {
    char *s;
    size_t len, cap;
    int err;
};

static void sb_add(struct strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_add(struct strbuf *b, const char *fmt, ...)
{
    if (b->err)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->s ? b->s + b->len : NULL, b->s ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->err = SKV_E_INVAL;
            return;
        }
        if (b->s && b->len + (size_t)n < b->cap) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap ? b->cap : 4096;
        while (cap <= b->len + (size_t)n)
            cap *= 2;
        char *ns = realloc(b->s, cap);
        if (!ns) {
            b->err = SKV_E_NOMEM;
            return;
        }
        b->s = ns;
        b->cap = cap;
    }
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t splitmix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static int parse_ints(const char *s, const char *what, int *vals, int max, int lo, int hi, int *n_out)
{
    int n = 0;
    while (s && *s) {
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || errno || v < lo || v > hi || (*end && *end != ','))
            return skv_errorf(SKV_E_INVAL, "%s: expected comma-separated integers in [%d, %d]", what, lo, hi);
        if (n == max)
            return skv_errorf(SKV_E_LIMIT, "%s: at most %d values", what, max);
        vals[n++] = (int)v;
        s = *end ? end + 1 : end;
    }
    if (n == 0)
        return skv_errorf(SKV_E_INVAL, "%s: empty list", what);
    *n_out = n;
    return SKV_OK;
}

static int mkdir_p(const char *path)
{
    char buf[1024];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
        return skv_errorf(SKV_E_LIMIT, "--out-dir: path too long");
    for (char *p = buf + 1;; p++) {
        if (*p == '/' || *p == '\0') {
            char c = *p;
            *p = '\0';
            if (mkdir(buf, 0777) && errno != EEXIST)
                return skv_errorf(SKV_E_IO, "cannot create %s: %s", buf, strerror(errno));
            *p = c;
            if (!c)
                break;
        }
    }
    return SKV_OK;
}

static int write_file(const char *dir, const char *name, const char *data, size_t len)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f)
        return skv_errorf(SKV_E_IO, "cannot write %s: %s", path, strerror(errno));
    size_t w = fwrite(data, 1, len, f);
    int bad = fclose(f) != 0 || w != len;
    return bad ? skv_errorf(SKV_E_IO, "short write to %s", path) : SKV_OK;
}

static int write_json(const char *dir, const char *name, json_t *j)
{
    char *s = json_dumps(j, JSON_INDENT(1) | JSON_REAL_PRECISION(6));
    if (!s)
        return SKV_E_NOMEM;
    int rc = write_file(dir, name, s, strlen(s));
    free(s);
    return rc;
}

static int read_text(const char *path, char **out, size_t *len_out)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return skv_errorf(SKV_E_IO, "cannot open %s: %s", path, strerror(errno));
    struct strbuf b = {0};
    char chunk[8192];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0)
        sb_add(&b, "%.*s", (int)n, chunk);
    fclose(f);
    if (b.err || !b.s) {
        free(b.s);
        return b.err ? b.err : skv_errorf(SKV_E_FORMAT, "%s is empty", path);
    }
    *out = b.s;
    *len_out = b.len;
    return SKV_OK;
}

static int encode(const struct skv_tokenizer *tok, const char *text, bool add_bos, bool special, int32_t **ids_out,
                  int *n_out)
{
    size_t len = strlen(text);
    int n = 0;
    int rc = skv_tokenizer_encode(tok, text, len, add_bos, special, NULL, 0, &n);
    if (rc && rc != SKV_E_LIMIT)
        return rc;
    int32_t *ids = malloc((size_t)(n > 0 ? n : 1) * sizeof *ids);
    if (!ids)
        return SKV_E_NOMEM;
    rc = skv_tokenizer_encode(tok, text, len, add_bos, special, ids, n, &n);
    if (rc) {
        free(ids);
        return rc;
    }
    *ids_out = ids;
    *n_out = n;
    return SKV_OK;
}

/* ---- specs ----------------------------------------------------------------------------------- */

struct qspec {
    char text[256];        /* as written ("policy=full" for the baseline) */
    char group[256];       /* the text without its ratio= / budget= item (plot series) */
    struct skv_compress_spec spec;
};

/* "SPEC;SPEC" -> specs[1..], specs[0] the full cache. Specs with policy=full are dropped. */
static int parse_specs(const char *list, struct qspec *specs, int max, int *n_out)
{
    int n = 0;
    snprintf(specs[0].text, sizeof specs[0].text, "policy=full");
    snprintf(specs[0].group, sizeof specs[0].group, "policy=full");
    skv_compress_spec_default(&specs[0].spec);
    n = 1;
    const char *p = list ? list : "";
    while (*p) {
        const char *end = strchr(p, ';');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        while (len && (*p == ' ' || *p == '\t'))
            p++, len--;
        while (len && (p[len - 1] == ' ' || p[len - 1] == '\t'))
            len--;
        if (len) {
            if (n == max)
                return skv_errorf(SKV_E_LIMIT, "--specs: at most %d specs", max - 1);
            if (len >= sizeof specs[n].text)
                return skv_errorf(SKV_E_LIMIT, "--specs: spec too long");
            struct qspec *q = &specs[n];
            memcpy(q->text, p, len);
            q->text[len] = '\0';
            int rc = skv_compress_spec_parse(q->text, &q->spec);
            if (rc) {
                char why[256]; /* skv_errorf() rewrites the buffer skv_error_msg() returns */
                snprintf(why, sizeof why, "%s", skv_error_msg());
                return skv_errorf(rc, "--specs '%s': %s", q->text, why);
            }
            if (q->spec.policy != SKV_POLICY_FULL) {
                /* series label: every item but ratio= and budget= (the plots' x axis) */
                q->group[0] = '\0';
                char tmp[256];
                snprintf(tmp, sizeof tmp, "%s", q->text);
                char *save = NULL;
                for (char *it = strtok_r(tmp, ",", &save); it; it = strtok_r(NULL, ",", &save)) {
                    while (*it == ' ' || *it == '\t') /* blanks around an item, as the parser takes them */
                        it++;
                    for (size_t il = strlen(it); il && (it[il - 1] == ' ' || it[il - 1] == '\t');)
                        it[--il] = '\0';
                    if (!*it || strncmp(it, "ratio=", 6) == 0 || strncmp(it, "budget=", 7) == 0)
                        continue;
                    size_t gl = strlen(q->group);
                    snprintf(q->group + gl, sizeof q->group - gl, "%s%s", gl ? "," : "", it);
                }
                n++;
            }
        }
        p = end ? end + 1 : p + strlen(p);
    }
    *n_out = n;
    return SKV_OK;
}

/* ---- fan-out prefill ------------------------------------------------------------------------- */

/* One forward, every spec: the engine fills the full cache (specs[0]); right after each
 * layer's attention the hook copies that layer's rows into each compressed cache and runs the
 * spec's compressor hook on them. Compressing layer l never changes the forward's activations
 * (the batch already attended to the layer's full rows), so each cache ends exactly as its
 * own compressed prefill would leave it, at the cost of one forward. */
struct fan_run {
    int n;
    struct skv_kv_cache **cache;   /* [n]; cache[0] the full cache */
    struct skv_compressor **comp;  /* [n]; comp[0] NULL */
};

static void fan_free(struct fan_run *r)
{
    for (int i = 0; i < r->n; i++) {
        if (r->cache)
            skv_kv_cache_free(&r->cache[i]);
        if (r->comp)
            skv_compressor_free(&r->comp[i]);
    }
    free(r->cache);
    free(r->comp);
    memset(r, 0, sizeof *r);
}

static int fan_hook(void *user, const struct skv_layer_view *v)
{
    struct fan_run *r = user;
    for (int i = 1; i < r->n; i++) {
        struct skv_kv_cache *dst = r->cache[i];
        int rc = skv_kv_cache_copy_layer(dst, v->cache, v->layer);
        if (rc)
            return rc;
        struct skv_layer_view dv = *v;
        dv.cache = dst;
        dv.probs = NULL; /* (v->cache's) */
        rc = skv_compressor_hook(r->comp[i], &dv);
        if (!rc)
            rc = skv_kv_cache_fit(dst, v->layer, 0);
        if (rc)
            return rc;
    }
    return SKV_OK;
}

/* Prefills ids[0..n) once into fresh caches for every spec; logits: the last position's
 * (the same for every spec: a compressing prefill never changes its own forward). */
static int fan_prefill(struct skv_engine *e, struct skv_model *m, const struct qspec *specs, int n_specs,
                       const int32_t *ids, int n, float *logits, struct fan_run *r)
{
    memset(r, 0, sizeof *r);
    r->cache = calloc((size_t)n_specs, sizeof *r->cache);
    r->comp = calloc((size_t)n_specs, sizeof *r->comp);
    int rc = r->cache && r->comp ? SKV_OK : SKV_E_NOMEM;
    if (!rc)
        r->n = n_specs;
    for (int i = 0; i < n_specs && !rc; i++) {
        rc = skv_kv_cache_new(m, &r->cache[i]);
        if (!rc && i > 0)
            rc = skv_compressor_new(&specs[i].spec, m, &r->comp[i]);
        if (!rc && i > 0)
            rc = skv_compressor_begin(r->comp[i], r->cache[i], n);
    }
    if (!rc) {
        struct skv_forward_opts fo = {.hook = n_specs > 1 ? fan_hook : NULL, .hook_user = r};
        rc = skv_engine_forward(e, r->cache[0], ids, n, &fo, logits);
    }
    for (int i = 1; i < n_specs && !rc; i++) {
        r->cache[i]->n_past = r->cache[0]->n_past;
        rc = skv_compressor_finish(r->comp[i], r->cache[i]);
    }
    if (rc)
        fan_free(r);
    return rc;
}

/* One spec's own compressed prefill (the reference the fan-out is checked against). */
static int oneshot_prefill(struct skv_engine *e, struct skv_model *m, const struct skv_compress_spec *spec,
                           const int32_t *ids, int n, float *logits, struct skv_kv_cache **cache_out)
{
    struct skv_kv_cache *cache = NULL;
    struct skv_compressor *comp = NULL;
    int rc = skv_kv_cache_new(m, &cache);
    if (!rc)
        rc = skv_compressor_new(spec, m, &comp);
    if (!rc)
        rc = skv_compressor_begin(comp, cache, n);
    if (!rc) {
        struct skv_forward_opts fo = {.hook = skv_compressor_hook, .hook_user = comp};
        rc = skv_engine_forward(e, cache, ids, n, &fo, logits);
    }
    if (!rc)
        rc = skv_compressor_finish(comp, cache);
    skv_compressor_free(&comp);
    if (rc)
        skv_kv_cache_free(&cache);
    else
        *cache_out = cache;
    return rc;
}

/* Compares two caches head by head: kept positions and K/V values. */
struct cache_diff {
    long rows;            /* rows compared */
    int heads_len;        /* heads whose lengths differ */
    int heads_pos;        /* heads (same length) whose kept positions differ */
    long pos_sym_diff;    /* positions kept by one cache and not the other (over all heads) */
    double kv_max_abs;    /* over heads with identical positions */
};

static int cache_compare(struct skv_kv_cache *a, struct skv_kv_cache *b, struct cache_diff *d)
{
    memset(d, 0, sizeof *d);
    size_t row = (size_t)a->head_dim;
    float *ha = NULL, *hb = NULL;
    size_t cap = 0;
    int rc = SKV_OK;
    for (int i = 0; i < a->n_layers * a->n_kv_heads && !rc; i++) {
        const struct skv_kv_head *x = &a->heads[i], *y = &b->heads[i];
        /* symmetric difference of the sorted position lists */
        int p = 0, q = 0;
        while (p < x->len || q < y->len) {
            if (q == y->len || (p < x->len && x->pos[p] < y->pos[q]))
                p++, d->pos_sym_diff++;
            else if (p == x->len || y->pos[q] < x->pos[p])
                q++, d->pos_sym_diff++;
            else
                p++, q++;
        }
        if (x->len != y->len) {
            d->heads_len++;
            continue;
        }
        if (memcmp(x->pos, y->pos, (size_t)x->len * sizeof *x->pos)) {
            d->heads_pos++;
            continue;
        }
        size_t need = (size_t)x->len * row;
        if (need > cap) {
            float *na = realloc(ha, need * sizeof *na), *nb = na ? realloc(hb, need * sizeof *nb) : NULL;
            if (na)
                ha = na;
            if (nb)
                hb = nb;
            if (!na || !nb) {
                rc = SKV_E_NOMEM;
                break;
            }
            cap = need;
        }
        for (int kv = 0; kv < 2 && !rc; kv++) {
            int l = i / a->n_kv_heads, h = i % a->n_kv_heads;
            rc = skv_kv_cache_read_rows(a, l, h, kv, 0, x->len, ha);
            if (!rc)
                rc = skv_kv_cache_read_rows(b, l, h, kv, 0, y->len, hb);
            for (size_t j = 0; j < need && !rc; j++) {
                double df = fabs((double)ha[j] - hb[j]);
                if (df > d->kv_max_abs)
                    d->kv_max_abs = df;
            }
        }
        d->rows += x->len;
    }
    free(ha);
    free(hb);
    return rc;
}

static json_t *diff_json(const char *spec, const char *mode, const struct cache_diff *d)
{
    json_t *j = json_object();
    json_object_set_new(j, "spec", json_string(spec));
    json_object_set_new(j, "against", json_string(mode));
    json_object_set_new(j, "identical_positions", json_boolean(!d->heads_len && !d->heads_pos));
    json_object_set_new(j, "heads_len_differ", json_integer(d->heads_len));
    json_object_set_new(j, "heads_pos_differ", json_integer(d->heads_pos));
    json_object_set_new(j, "positions_sym_diff", json_integer(d->pos_sym_diff));
    json_object_set_new(j, "rows_compared", json_integer(d->rows));
    json_object_set_new(j, "kv_max_abs_diff", json_real(d->kv_max_abs));
    return j;
}

/* ---- greedy decoding ------------------------------------------------------------------------- */

/* Greedy tokens from `first` (the prefill's logits) on one cache, with decode upkeep.
 * Stops at max tokens, at end-of-turn when stop_eot, or once `key` appears in the text with a
 * character after it (so that answer_is_key sees whether the number goes on: the tokenizers
 * give digits one token each, and the key's last digit may be followed by more). */
static int greedy(struct skv_engine *e, struct skv_model *m, struct skv_kv_cache *cache, struct skv_compressor *comp,
                  const float *first, float *logits, int max, bool stop_eot, const char *key, int32_t *out, int *n_out)
{
    int nv = m->cfg.n_vocab, n = 0, rc = SKV_OK;
    memcpy(logits, first, (size_t)nv * sizeof *logits);
    struct skv_forward_opts dec = {.hook = skv_compressor_hook, .hook_user = comp,
                                   .attention_probs = skv_compressor_wants_probs(comp)};
    while (n < max) {
        int32_t t = skv_argmax(logits, nv);
        if (stop_eot && (t == skv_tokenizer_eot(m->tok) || t == skv_tokenizer_eos(m->tok)))
            break;
        out[n++] = t;
        if (key) {
            char *text = NULL;
            rc = skv_tokenizer_decode(m->tok, out, n, &text);
            const char *at = rc ? NULL : strstr(text, key);
            bool found = at && at[strlen(key)] != '\0';
            free(text);
            if (rc || found)
                break;
        }
        if (n == max)
            break;
        if (comp) /* as the daemon decodes: the upkeep at the forward's end */
            rc = skv_compressor_begin_step(comp, cache, 1, true, &dec);
        if (!rc)
            rc = skv_engine_forward(e, cache, &t, 1, comp ? &dec : NULL, logits);
        if (rc)
            break;
    }
    *n_out = n;
    return rc;
}

/* ---- the benchmark context ------------------------------------------------------------------- */

struct qctx {
    struct skv_engine *e;
    struct skv_model *m;
    const struct skv_quality_opts *o;
    const char *out_dir;
    int pk_plots_failed, fid_plots_failed; /* plots the last writes could not draw */
    struct qspec specs[MAX_LIST + 1];
    int n_specs;
    char cmdline[4096];
};

/* The model's file name (what the reader recognises), else its general.name. */
static const char *model_label(const struct qctx *q)
{
    const char *slash = strrchr(q->m->path, '/');
    const char *base = slash ? slash + 1 : q->m->path;
    return *base ? base : q->m->name;
}

static json_t *meta_json(const struct qctx *q)
{
    json_t *j = json_object();
    json_object_set_new(j, "command", json_string(q->cmdline));
    json_object_set_new(j, "model", json_string(q->m->name));
    json_object_set_new(j, "model_path", json_string(q->m->path));
    json_object_set_new(j, "model_fingerprint", json_string(q->m->fingerprint));
    json_object_set_new(j, "backend", json_string(q->m->be->name));
    json_object_set_new(j, "threads", json_integer(q->m->be->n_threads));
    json_object_set_new(j, "kv_type", json_string(skv_dtype_name(skv_kv_pool_kv_type(q->m->kv_pool))));
    json_object_set_new(j, "mode", json_string(q->m->reference ? "reference" : "fast"));
    json_object_set_new(j, "seed", json_integer((json_int_t)q->o->seed));
    time_t t = time(NULL);
    char buf[64];
    strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", gmtime(&t));
    json_object_set_new(j, "date", json_string(buf));
    return j;
}

static json_t *specs_json(const struct qctx *q)
{
    json_t *a = json_array();
    for (int i = 0; i < q->n_specs; i++) {
        char canon[512];
        if (skv_compress_spec_format(&q->specs[i].spec, canon, sizeof canon))
            canon[0] = '\0';
        json_t *s = json_object();
        json_object_set_new(s, "spec", json_string(q->specs[i].text));
        json_object_set_new(s, "canonical", json_string(canon));
        json_array_append_new(a, s);
    }
    return a;
}

/* Markdown-safe short name of a spec for tables. */
static const char *spec_name(const struct qctx *q, int i)
{
    return i == 0 ? "full cache (baseline)" : q->specs[i].text;
}

/* ---- passkey --------------------------------------------------------------------------------- */

/* Builds the chat prompt with `reps` filler sentences, the key after round(depth% * reps). */
static int passkey_text(const struct qctx *q, const struct passkey_style *st, int reps, int depth, int key,
                        char **out)
{
    struct strbuf doc = {0};
    int at = (int)lround(reps * (depth / 100.0));
    if (st->intro[0])
        sb_add(&doc, "%s", st->intro);
    for (int i = 0; i <= reps; i++) {
        if (i == at)
            sb_add(&doc, "%sThe pass key is %05d. Remember it. %05d is the pass key.", doc.len ? " " : "", key, key);
        if (i < reps)
            sb_add(&doc, "%s%s", doc.len ? " " : "", FILLER);
    }
    sb_add(&doc, "\n\n%s", st->question);
    if (doc.err)
        return free(doc.s), doc.err;
    struct skv_chat_msg msg = {"user", doc.s};
    char *rendered = NULL;
    int rc = skv_tokenizer_chat_render(q->m->tok, &msg, 1, true, &rendered);
    free(doc.s);
    if (rc)
        return rc;
    struct strbuf all = {0};
    sb_add(&all, "%s%s", rendered, st->prefix);
    free(rendered);
    if (all.err)
        return free(all.s), all.err;
    *out = all.s;
    return SKV_OK;
}

static int passkey_count(const struct qctx *q, const struct passkey_style *st, int reps, int depth, int key,
                         int32_t **ids, int *n)
{
    char *text = NULL;
    int rc = passkey_text(q, st, reps, depth, key, &text);
    if (rc)
        return rc;
    /* the chat template owns BOS: the encoder adds none (the text is ours, its markup parsed) */
    rc = encode(q->m->tok, text, false, true, ids, n);
    free(text);
    return rc;
}

/* The prompt with the most filler whose token count is <= target. */
static int passkey_prompt(const struct qctx *q, const struct passkey_style *st, int target, int depth, int key,
                          int32_t **ids_out, int *n_out)
{
    int32_t *ids = NULL;
    int n0 = 0, n1 = 0, rc;
    const int probe = 40;
    if ((rc = passkey_count(q, st, 0, depth, key, &ids, &n0)))
        return rc;
    free(ids);
    if (n0 > target)
        return skv_errorf(SKV_E_INVAL, "passkey: length %d is below the %d-token prompt without filler", target, n0);
    if ((rc = passkey_count(q, st, probe, depth, key, &ids, &n1)))
        return rc;
    free(ids);
    double per = (double)(n1 - n0) / probe;
    int reps = (int)((target - n0) / per);
    int n = 0;
    if ((rc = passkey_count(q, st, reps, depth, key, &ids, &n)))
        return rc;
    while (n > target && reps > 0) {
        free(ids);
        if ((rc = passkey_count(q, st, --reps, depth, key, &ids, &n)))
            return rc;
    }
    for (;;) {
        int32_t *next = NULL;
        int nn = 0;
        if ((rc = passkey_count(q, st, reps + 1, depth, key, &next, &nn)))
            return free(ids), rc;
        if (nn > target) {
            free(next);
            break;
        }
        free(ids);
        ids = next;
        n = nn;
        reps++;
    }
    *ids_out = ids;
    *n_out = n;
    return SKV_OK;
}

/* Prompt indices of the key's digit tokens (every occurrence): tokens whose bytes spell
 * the key when concatenated over a run. Returns the count written to pos (<= max). */
static int key_token_positions(const struct skv_tokenizer *tok, const int32_t *ids, int n, const char *key,
                               int32_t *pos, int max)
{
    size_t klen = strlen(key);
    int found = 0;
    for (int i = 0; i < n && found < max; i++) {
        char buf[64];
        size_t at = 0;
        int j = i;
        while (j < n && at < klen) {
            size_t len = 0;
            if (skv_tokenizer_token_bytes(tok, ids[j], buf, sizeof buf, &len) || len == 0 || len > sizeof buf ||
                at + len > klen || memcmp(buf, key + at, len))
                break;
            at += len;
            j++;
        }
        if (at == klen) {
            for (int k = i; k < j && found < max; k++)
                pos[found++] = k;
            i = j - 1;
        }
    }
    return found;
}

/* Exact match: the answer's first number (run of digits) is the key, no digit more or less. */
static bool answer_is_key(const char *answer, const char *key)
{
    const char *d = answer;
    while (*d && (*d < '0' || *d > '9'))
        d++;
    size_t run = 0;
    while (d[run] >= '0' && d[run] <= '9')
        run++;
    return run == strlen(key) && strncmp(d, key, run) == 0;
}

/* Fraction of (layer, KV head, key token) rows a cache kept. */
static double key_rows_kept(const struct skv_kv_cache *c, const int32_t *kpos, int nk)
{
    long kept = 0, total = 0;
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++) {
        const struct skv_kv_head *h = &c->heads[i];
        for (int k = 0; k < nk; k++) {
            int lo = 0, hi = h->len; /* positions are sorted */
            while (lo < hi) {
                int mid = (lo + hi) / 2;
                if (h->pos[mid] < kpos[k])
                    lo = mid + 1;
                else
                    hi = mid;
            }
            kept += lo < h->len && h->pos[lo] == kpos[k];
            total++;
        }
    }
    return total ? (double)kept / total : 0.0;
}

static int passkey_key(uint64_t seed, int length, int depth, int trial)
{
    uint64_t h = splitmix64(seed ^ splitmix64((uint64_t)length * 1000003u + (uint64_t)depth * 101u + (uint64_t)trial));
    return 10000 + (int)(h % 90000u);
}

/* Checks the fan-out against each spec's own prefill, and snapkv's reuse path (document
 * minus the window prefilled full, then clone + compressed append) against one-shot. */
static int passkey_verify(struct qctx *q, const int32_t *ids, int n, json_t *out)
{
    int nv = q->m->cfg.n_vocab;
    float *logits = malloc((size_t)nv * sizeof *logits);
    if (!logits)
        return SKV_E_NOMEM;
    struct fan_run r;
    int rc = fan_prefill(q->e, q->m, q->specs, q->n_specs, ids, n, logits, &r);
    int snap = -1;
    for (int i = 1; i < q->n_specs && !rc; i++) {
        struct skv_kv_cache *one = NULL;
        struct cache_diff d;
        rc = oneshot_prefill(q->e, q->m, &q->specs[i].spec, ids, n, logits, &one);
        if (!rc)
            rc = cache_compare(r.cache[i], one, &d);
        if (!rc) {
            json_array_append_new(out, diff_json(q->specs[i].text, "own one-shot prefill (fan-out)", &d));
            fprintf(stderr, "verify %-45s fan-out vs one-shot: %s (sym diff %ld, kv max diff %g)\n",
                    q->specs[i].text, !d.heads_len && !d.heads_pos ? "identical" : "DIFFERENT", d.pos_sym_diff,
                    d.kv_max_abs);
        }
        const struct skv_compress_spec *s = &q->specs[i].spec;
        if (!rc && snap < 0 && s->policy == SKV_POLICY_SNAPKV && s->alloc == SKV_ALLOC_UNIFORM &&
            s->granularity == SKV_GRAN_LAYER && s->window > 0 && s->window < n) {
            snap = i;
            /* reuse path: full prefill of the document minus the window, clone, compressed append */
            struct skv_kv_cache *doc = NULL, *cl = NULL;
            struct skv_compressor *comp = NULL;
            int w = s->window;
            rc = skv_kv_cache_new(q->m, &doc);
            if (!rc)
                rc = skv_engine_forward(q->e, doc, ids, n - w, NULL, NULL);
            if (!rc)
                rc = skv_kv_cache_clone(doc, &cl);
            if (!rc)
                rc = skv_compressor_new(s, q->m, &comp);
            if (!rc)
                rc = skv_compressor_begin(comp, cl, w);
            if (!rc) {
                struct skv_forward_opts fo = {.hook = skv_compressor_hook, .hook_user = comp};
                rc = skv_engine_forward(q->e, cl, ids + n - w, w, &fo, logits);
            }
            if (!rc)
                rc = skv_compressor_finish(comp, cl);
            if (!rc)
                rc = cache_compare(cl, one, &d);
            if (!rc) {
                json_array_append_new(out, diff_json(q->specs[i].text, "reuse: full prefill of n-window, clone, "
                                                                       "compressed append of the window", &d));
                fprintf(stderr, "verify %-45s reuse vs one-shot:   %s (sym diff %ld, kv max diff %g)\n",
                        q->specs[i].text, !d.heads_len && !d.heads_pos ? "identical" : "DIFFERENT",
                        d.pos_sym_diff, d.kv_max_abs);
            }
            skv_compressor_free(&comp);
            skv_kv_cache_free(&cl);
            skv_kv_cache_free(&doc);
        }
        skv_kv_cache_free(&one);
    }
    fan_free(&r);
    free(logits);
    return rc;
}

/* The rest of a markdown header row after its first cell: one column per prompt length, then
 * the separator row (numbers right-aligned). */
static void md_length_columns(struct strbuf *md, const int *lengths, int nl)
{
    for (int l = 0; l < nl; l++)
        sb_add(md, " %d |", lengths[l]);
    sb_add(md, "\n|---|");
    for (int l = 0; l < nl; l++)
        sb_add(md, "---:|");
    sb_add(md, "\n");
}

static void md_passkey(const struct qctx *q, struct strbuf *md, const int *lengths, int nl, const int *depths, int nd,
                       int trials, const int *correct, int style, int max_tokens, double seconds, json_t *verify)
{
    /* correct[CIDX(spec, length, depth)]: keys found out of `trials` */
    sb_add(md, "## Passkey retrieval\n\n");
    sb_add(md, "Command: `%s`  \n", q->cmdline);
    sb_add(md, "Model %s, backend %s, %d threads; %d keys per (length, depth), greedy, at most %d answer "
               "tokens, found = the answer's first number is the key; prompt style %d (%s); %.0f s.\n\n",
           model_label(q), q->m->be->name, q->m->be->n_threads, trials, max_tokens, style,
           skv_bench_quality_style_desc(style), seconds);
    sb_add(md, "Accuracy (%%) per prompt length in tokens, averaged over depths");
    for (int d = 0; d < nd; d++)
        sb_add(md, "%s%d", d ? "," : " ", depths[d]);
    sb_add(md, " %% and %d keys each:\n\n| spec |", trials);
    for (int l = 0; l < nl; l++)
        sb_add(md, " %d |", lengths[l]);
    sb_add(md, " mean |\n|---|");
    for (int l = 0; l <= nl; l++)
        sb_add(md, "---:|");
    sb_add(md, "\n");
    int per = nd * trials;
    for (int i = 0; i < q->n_specs; i++) {
        sb_add(md, "| %s |", spec_name(q, i));
        long tot = 0;
        for (int l = 0; l < nl; l++) {
            int c = 0;
            for (int d = 0; d < nd; d++)
                c += correct[CIDX(i, l, d)];
            tot += c;
            sb_add(md, " %.0f |", 100.0 * c / per);
        }
        sb_add(md, " %.1f |\n", 100.0 * tot / (per * nl));
    }
    if (q->n_specs > 1) {
        sb_add(md, "\nRetained accuracy: keys found by the spec / keys found by the full cache, per length "
                   "(\"-\" where the full cache finds none):\n\n| spec |");
        md_length_columns(md, lengths, nl);
        for (int i = 1; i < q->n_specs; i++) {
            sb_add(md, "| %s |", spec_name(q, i));
            for (int l = 0; l < nl; l++) {
                int c = 0, f = 0;
                for (int d = 0; d < nd; d++) {
                    c += correct[CIDX(i, l, d)];
                    f += correct[CIDX(0, l, d)];
                }
                if (f)
                    sb_add(md, " %.0f%% |", 100.0 * c / f);
                else
                    sb_add(md, " - |");
            }
            sb_add(md, "\n");
        }
    }
    sb_add(md, "\nKeys found per depth (rows, %% of the filler) and length (columns), out of %d:\n", trials);
    for (int i = 0; i < q->n_specs; i++) {
        sb_add(md, "\n**%s**\n\n| depth \\ tokens |", spec_name(q, i));
        md_length_columns(md, lengths, nl);
        for (int d = 0; d < nd; d++) {
            sb_add(md, "| %d%% |", depths[d]);
            for (int l = 0; l < nl; l++)
                sb_add(md, " %d/%d |", correct[CIDX(i, l, d)], trials);
            sb_add(md, "\n");
        }
    }
    if (json_array_size(verify)) {
        sb_add(md, "\nEquivalence checks (kept positions per layer and KV head, and K/V values):\n\n"
                   "| spec | against | positions identical | positions differing | K/V max abs diff |\n"
                   "|---|---|---|---:|---:|\n");
        size_t k;
        json_t *v;
        json_array_foreach(verify, k, v) {
            sb_add(md, "| %s | %s | %s | %lld | %g |\n", json_string_value(json_object_get(v, "spec")),
                   json_string_value(json_object_get(v, "against")),
                   json_is_true(json_object_get(v, "identical_positions")) ? "yes" : "NO",
                   (long long)json_integer_value(json_object_get(v, "positions_sym_diff")),
                   json_real_value(json_object_get(v, "kv_max_abs_diff")));
        }
    }
    sb_add(md, "\n");
}

static const char GP_TERM[] = "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
                              "    set terminal pngcairo size %d,%d font ',9'\n"
                              "} else {\n"
                              "    set terminal png size %d,%d\n"
                              "}\n"
                              "set termoption noenhanced\n";

/* Runs gnuplot on a script written into the output folder (in that folder, no shell: any
 * folder name works); false, said on stderr, when no plot came of it. */
static bool run_gnuplot(const char *dir, const char *script_name, const char *script)
{
    if (write_file(dir, script_name, script, strlen(script))) {
        fprintf(stderr, "quality: %s\n", skv_error_msg());
        return false;
    }
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        if (chdir(dir) != 0)
            _exit(126);
        execlp("gnuplot", "gnuplot", script_name, (char *)NULL);
        _exit(127);
    }
    int st = -1;
    while (pid > 0 && waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    if (pid > 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0)
        return true;
    int code = pid > 0 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    fprintf(stderr, "quality: no plot from %s/%s: %s; the data is in the JSON and the markdown\n", dir, script_name,
            code == 127 ? "gnuplot is not installed (apt install gnuplot-nox)"
                        : code == 126 ? "cannot enter the folder" : "gnuplot failed");
    return false;
}

static bool plot_passkey(const struct qctx *q, const int *lengths, int nl, int nd, int trials, const int *correct)
{
    bool ok = false;
    struct strbuf gp = {0};
    for (int i = 0; i < q->n_specs; i++) {
        sb_add(&gp, "$d%d << EOD\n", i);
        for (int l = 0; l < nl; l++) {
            int c = 0;
            for (int d = 0; d < nd; d++)
                c += correct[CIDX(i, l, d)];
            sb_add(&gp, "%d %.4f\n", lengths[l], (double)c / (nd * trials));
        }
        sb_add(&gp, "EOD\n");
    }
    sb_add(&gp, GP_TERM, 760, 460, 760, 460);
    sb_add(&gp, "set output 'passkey_accuracy.png'\n"
                "set title 'Passkey retrieval: %s'\n"
                "set logscale x 2\nset xtics (",
           model_label(q));
    for (int l = 0; l < nl; l++)
        sb_add(&gp, "%s'%d' %d", l ? ", " : "", lengths[l], lengths[l]);
    sb_add(&gp, ")\nset xlabel 'prompt length (tokens)'\nset ylabel 'accuracy'\nset yrange [-0.05:1.05]\n"
                "set grid\nset key below maxrows 4\nplot ");
    for (int i = 0; i < q->n_specs; i++)
        sb_add(&gp, "%s$d%d using ($1*(1+0.015*(%d-%d/2.0))):2 with linespoints lw %d title '%s'", i ? ", \\\n     " : "",
               i, i, q->n_specs, i == 0 ? 3 : 1, spec_name(q, i));
    sb_add(&gp, "\n");
    if (!gp.err)
        ok = run_gnuplot(q->out_dir, "passkey_accuracy.gp", gp.s);
    free(gp.s);
    return ok;
}

/* Series of the budget plots: each group (a spec without its ratio= / budget=) that has >= 2
 * specs, as spec indices by ascending key[spec] (the KV they kept). series[s][0..len[s]);
 * returns the number of series. */
static int budget_series(const struct qctx *q, const double *key, int series[][MAX_LIST + 1], int *len)
{
    bool done[MAX_LIST + 1] = {false};
    int ns = 0;
    for (int i = 1; i < q->n_specs; i++) {
        if (done[i])
            continue;
        int n = 0;
        for (;;) {
            int best = -1;
            for (int j = i; j < q->n_specs; j++)
                if (!done[j] && strcmp(q->specs[j].group, q->specs[i].group) == 0 &&
                    (best < 0 || key[j] < key[best]))
                    best = j;
            if (best < 0)
                break;
            done[best] = true;
            series[ns][n++] = best;
        }
        if (n >= 2)
            len[ns++] = n;
    }
    return ns;
}

/* One passkey run's state (what the outputs are written from). */
struct pk_run {
    int lengths[MAX_LIST], depths[MAX_LIST], nl, nd;
    int trials, max_tokens, style;
    int *correct;              /* [CIDX] */
    double *kv_frac;           /* [length][spec]: sum over prompts of KV bytes / the full cache's */
    int *prompts;              /* [length]: prompts run */
    json_t *results, *verify;
    double t_prefill, t_decode;
};

/* The KV spec i kept at length l: its mean fraction of the full cache over the prompts run. */
static double pk_kv_kept(const struct qctx *q, const struct pk_run *p, int i, int l)
{
    return p->prompts[l] ? p->kv_frac[l * q->n_specs + i] / p->prompts[l] : 0;
}

/* passkey_budget.png: accuracy against the KV kept (fraction of the full cache) per policy,
 * one panel per prompt length, the full cache's accuracy as a dashed line. Needs a group
 * with >= 2 budgets. */
static bool plot_passkey_budget(const struct qctx *q, const struct pk_run *p, int nl)
{
    const int *correct = p->correct;
    int nd = p->nd, trials = p->trials;
    double key[MAX_LIST + 1] = {0};
    for (int i = 0; i < q->n_specs; i++)
        for (int l = 0; l < nl; l++)
            key[i] += pk_kv_kept(q, p, i, l) / nl;
    int series[MAX_LIST + 1][MAX_LIST + 1], len[MAX_LIST + 1];
    int ns = budget_series(q, key, series, len);
    if (ns == 0 || nl == 0)
        return true; /* nothing to plot */
    struct strbuf gp = {0};
    for (int s = 0; s < ns; s++)
        for (int l = 0; l < nl; l++) {
            sb_add(&gp, "$s%dl%d << EOD\n", s, l);
            for (int k = 0; k < len[s]; k++) {
                int i = series[s][k], c = 0;
                for (int d = 0; d < nd; d++)
                    c += correct[CIDX(i, l, d)];
                sb_add(&gp, "%.4g %.4f\n", pk_kv_kept(q, p, i, l), (double)c / (nd * trials));
            }
            sb_add(&gp, "EOD\n");
        }
    double xmax = 0;
    for (int s = 0; s < ns; s++)
        xmax = fmax(xmax, key[series[s][len[s] - 1]]);
    /* panels on a grid with fixed margins; the legend in a band below them */
    int cols = nl < 3 ? nl : 3, rows = (nl + cols - 1) / cols;
    int w = 330 * cols + 40, h = 320 * rows + 90 + 16 * ns;
    sb_add(&gp, GP_TERM, w, h, w, h);
    sb_add(&gp,
           "set output 'passkey_budget.png'\n"
           "set multiplot layout %d,%d title 'Passkey accuracy vs budget: %s (dashed: full cache)' "
           "margins %.3f,0.98,%.3f,%.3f spacing %.3f,%.3f\n"
           "set grid\nset xlabel 'KV kept (fraction of the full cache)'\nset ylabel 'accuracy'\n"
           "set xrange [0:%.3g]\nset yrange [-0.05:1.05]\n"
           "set key at screen 0.5,0.01 center bottom vertical maxrows %d\n",
           rows, cols, model_label(q), 60.0 / w, (16.0 * ns + 60) / h, 1 - 60.0 / h, 70.0 / w, 95.0 / h,
           fmin(1.0, xmax * 1.1 + 0.01), ns);
    for (int l = 0; l < nl; l++) {
        int c = 0;
        for (int d = 0; d < nd; d++)
            c += correct[CIDX(0, l, d)];
        sb_add(&gp, "set title '%d tokens'\n%splot %.4f with lines dashtype 2 lc rgb 'black' notitle", p->lengths[l],
               l == 1 ? "unset key\n" : "", (double)c / (nd * trials));
        for (int s = 0; s < ns; s++)
            sb_add(&gp, ", \\\n     $s%dl%d using 1:2 with linespoints title '%s'", s, l, q->specs[series[s][0]].group);
        sb_add(&gp, "\n");
    }
    sb_add(&gp, "unset multiplot\n");
    bool ok = !gp.err && run_gnuplot(q->out_dir, "passkey_budget.gp", gp.s);
    free(gp.s);
    return ok;
}

/* Writes passkey.json / .md / .png for the first nl_done lengths (after each length, so a
 * run cut short keeps what it finished). *jp_out: the JSON (new reference). */
static int passkey_write(struct qctx *q, const struct pk_run *p, int nl_done, bool final, double seconds,
                         json_t **jp_out)
{
    const struct passkey_style *st = &STYLES[p->style];
    const int *lengths = p->lengths, *depths = p->depths, *correct = p->correct;
    int nd = p->nd, trials = p->trials;
    json_t *jp = json_object(), *acc = json_array(), *jl = json_array(), *jd = json_array();
    for (int l = 0; l < nl_done; l++)
        json_array_append_new(jl, json_integer(lengths[l]));
    for (int d = 0; d < nd; d++)
        json_array_append_new(jd, json_integer(depths[d]));
    for (int i = 0; i < q->n_specs; i++)
        for (int l = 0; l < nl_done; l++) {
            int c = 0;
            for (int d = 0; d < nd; d++) {
                int cd = correct[CIDX(i, l, d)];
                c += cd;
                json_t *a = json_object();
                json_object_set_new(a, "spec", json_string(q->specs[i].text));
                json_object_set_new(a, "length", json_integer(lengths[l]));
                json_object_set_new(a, "depth", json_integer(depths[d]));
                json_object_set_new(a, "accuracy", json_real((double)cd / trials));
                json_array_append_new(acc, a);
            }
            json_t *a = json_object();
            json_object_set_new(a, "spec", json_string(q->specs[i].text));
            json_object_set_new(a, "length", json_integer(lengths[l]));
            json_object_set_new(a, "depth", json_string("all"));
            json_object_set_new(a, "accuracy", json_real((double)c / (nd * trials)));
            json_array_append_new(acc, a);
        }
    json_t *jst = json_object();
    json_object_set_new(jst, "index", json_integer(p->style));
    json_object_set_new(jst, "intro", json_string(st->intro));
    json_object_set_new(jst, "filler", json_string(FILLER));
    json_object_set_new(jst, "question", json_string(st->question));
    json_object_set_new(jst, "assistant_prefix", json_string(st->prefix));
    json_object_set_new(jp, "meta", meta_json(q));
    json_object_set_new(jp, "complete", json_boolean(final));
    json_object_set_new(jp, "specs", specs_json(q));
    json_object_set_new(jp, "style", jst);
    json_object_set_new(jp, "lengths", jl);
    json_object_set_new(jp, "depths", jd);
    json_object_set_new(jp, "trials", json_integer(trials));
    json_object_set_new(jp, "max_tokens", json_integer(p->max_tokens));
    json_object_set_new(jp, "equivalence", json_incref(p->verify));
    json_object_set_new(jp, "accuracy", acc);
    json_object_set_new(jp, "results", json_incref(p->results));
    json_object_set_new(jp, "seconds", json_real(seconds));
    json_object_set_new(jp, "prefill_seconds", json_real(p->t_prefill));
    json_object_set_new(jp, "decode_seconds", json_real(p->t_decode));
    int rc = write_json(q->out_dir, "passkey.json", jp);
    struct strbuf md = {0};
    md_passkey(q, &md, lengths, nl_done, depths, nd, trials, correct, p->style, p->max_tokens, seconds, p->verify);
    if (!rc)
        rc = md.err ? md.err : write_file(q->out_dir, "passkey.md", md.s, md.len);
    if (!rc && final && !q->o->json_stdout)
        fputs(md.s, stdout);
    free(md.s);
    if (!rc) { /* (each write's plots replace the last's: the last says whether there are plots) */
        q->pk_plots_failed = !plot_passkey(q, lengths, nl_done, nd, trials, correct);
        q->pk_plots_failed += !plot_passkey_budget(q, p, nl_done);
    }
    if (rc)
        json_decref(jp);
    else
        *jp_out = jp;
    return rc;
}

static int task_passkey(struct qctx *q, json_t *root)
{
    const struct skv_quality_opts *o = q->o;
    struct pk_run pr = {0};
    int rc = parse_ints(o->lengths ? o->lengths : "512,1024,2048,4096", "--lengths", pr.lengths, MAX_LIST, 16,
                        1 << 20, &pr.nl);
    if (!rc)
        rc = parse_ints(o->depths ? o->depths : "0,50,100", "--depths", pr.depths, MAX_LIST, 0, 100, &pr.nd);
    if (rc)
        return rc;
    pr.trials = o->trials > 0 ? o->trials : 2;
    pr.max_tokens = o->max_tokens > 0 ? o->max_tokens : 8;
    pr.style = o->passkey_style >= 0 ? o->passkey_style : DEFAULT_STYLE;
    if (pr.style >= N_STYLES)
        return skv_errorf(SKV_E_INVAL, "--passkey-style: 0..%d", N_STYLES - 1);
    const struct passkey_style *st = &STYLES[pr.style];
    const int *lengths = pr.lengths, *depths = pr.depths;
    int nl = pr.nl, nd = pr.nd, trials = pr.trials, max_tokens = pr.max_tokens;
    int nv = q->m->cfg.n_vocab;
    pr.correct = calloc((size_t)q->n_specs * nl * nd, sizeof *pr.correct);
    pr.kv_frac = calloc((size_t)q->n_specs * nl, sizeof *pr.kv_frac);
    pr.prompts = calloc((size_t)nl, sizeof *pr.prompts);
    int *correct = pr.correct;
    float *first = malloc((size_t)nv * sizeof *first), *logits = malloc((size_t)nv * sizeof *logits);
    int32_t *out = malloc((size_t)max_tokens * sizeof *out);
    pr.results = json_array();
    pr.verify = json_array();
    json_t *jp = NULL;
    if (!correct || !pr.kv_frac || !pr.prompts || !first || !logits || !out || !pr.results || !pr.verify) {
        rc = SKV_E_NOMEM;
        goto out_free;
    }
    double t_start = now_s();
    for (int l = 0; l < nl && !rc; l++) {
        for (int d = 0; d < nd && !rc; d++) {
            for (int t = 0; t < trials && !rc; t++) {
                int key = passkey_key(o->seed, lengths[l], depths[d], t);
                int32_t *ids = NULL;
                int n = 0;
                rc = passkey_prompt(q, st, lengths[l], depths[d], key, &ids, &n);
                if (rc)
                    break;
                if (l == 0 && d == 0 && t == 0 && q->n_specs > 1) {
                    /* once, on a short prompt (at most VERIFY_TOKENS) */
                    int32_t *vids = NULL;
                    int vn = 0, vlen = lengths[0] < VERIFY_TOKENS ? lengths[0] : VERIFY_TOKENS;
                    double tv = now_s();
                    rc = passkey_prompt(q, st, vlen, 50, passkey_key(o->seed, vlen, 50, -1), &vids, &vn);
                    if (!rc)
                        rc = passkey_verify(q, vids, vn, pr.verify);
                    free(vids);
                    fprintf(stderr, "verify (%d tokens): %.1f s\n", vn, now_s() - tv);
                    if (rc) {
                        free(ids);
                        break;
                    }
                }
                struct fan_run r;
                double t0 = now_s();
                rc = fan_prefill(q->e, q->m, q->specs, q->n_specs, ids, n, first, &r);
                if (rc) { /* r was freed: no caches to answer with */
                    free(ids);
                    break;
                }
                double t1 = now_s();
                pr.t_prefill += t1 - t0;
                char keytxt[16];
                snprintf(keytxt, sizeof keytxt, "%05d", key);
                int32_t kpos[32];
                int nk = key_token_positions(q->m->tok, ids, n, keytxt, kpos, 32);
                fprintf(stderr, "passkey len %5d (%5d tok) depth %3d%% key %s prefill %6.1f s:", lengths[l], n,
                        depths[d], keytxt, t1 - t0);
                pr.prompts[l]++;
                double full_kv = (double)skv_kv_cache_bytes(r.cache[0]); /* before its answer grows it */
                for (int i = 0; i < q->n_specs && !rc; i++) {
                    uint64_t kv = skv_kv_cache_bytes(r.cache[i]);
                    pr.kv_frac[l * q->n_specs + i] += (double)kv / full_kv;
                    double kept = key_rows_kept(r.cache[i], kpos, nk);
                    int got = 0;
                    rc = greedy(q->e, q->m, r.cache[i], r.comp[i], first, logits, max_tokens, true, keytxt, out, &got);
                    char *text = NULL;
                    if (!rc)
                        rc = skv_tokenizer_decode(q->m->tok, out, got, &text);
                    if (rc)
                        break;
                    bool ok = answer_is_key(text, keytxt);
                    correct[CIDX(i, l, d)] += ok;
                    fprintf(stderr, " %c", ok ? '+' : '-');
                    json_t *jr = json_object();
                    json_object_set_new(jr, "spec", json_string(q->specs[i].text));
                    json_object_set_new(jr, "length", json_integer(lengths[l]));
                    json_object_set_new(jr, "prompt_tokens", json_integer(n));
                    json_object_set_new(jr, "depth", json_integer(depths[d]));
                    json_object_set_new(jr, "trial", json_integer(t));
                    json_object_set_new(jr, "key", json_string(keytxt));
                    json_object_set_new(jr, "output", skv_bench_json_text(text, strlen(text)));
                    json_object_set_new(jr, "correct", json_boolean(ok));
                    json_object_set_new(jr, "kv_bytes_after_prefill", json_integer((json_int_t)kv));
                    json_object_set_new(jr, "key_token_positions", json_integer(nk));
                    json_object_set_new(jr, "key_rows_kept", json_real(kept));
                    json_array_append_new(pr.results, jr);
                    free(text);
                }
                pr.t_decode += now_s() - t1;
                fprintf(stderr, "  (%.1f s)\n", now_s() - t1);
                fan_free(&r);
                free(ids);
            }
        }
        if (!rc && l + 1 < nl) {
            json_t *partial = NULL;
            rc = passkey_write(q, &pr, l + 1, false, now_s() - t_start, &partial);
            json_decref(partial);
        }
    }
    if (!rc)
        rc = passkey_write(q, &pr, nl, true, now_s() - t_start, &jp);
    if (!rc)
        json_object_set_new(root, "passkey", jp);
out_free:
    json_decref(pr.results);
    json_decref(pr.verify);
    free(correct);
    free(pr.kv_frac);
    free(pr.prompts);
    free(first);
    free(logits);
    free(out);
    return rc;
}

/* ---- fidelity -------------------------------------------------------------------------------- */

struct fid_stat {
    double kl_sum;        /* over steps */
    int top1;             /* steps whose argmax matches the full cache's */
    int steps;
    int greedy_prefix;    /* identical tokens before the first divergence */
    int greedy_same;      /* identical tokens at the same index */
    int greedy_n;
    double kv_frac_sum;   /* KV bytes after prefill / full cache's */
    int texts;
};

static int fidelity_text(struct qctx *q, const char *path, int N_max, int M, struct fid_stat *stat, json_t *jtexts)
{
    struct skv_model *m = q->m;
    int nv = m->cfg.n_vocab, S = q->n_specs;
    char *text = NULL;
    size_t len = 0;
    int32_t *ids = NULL;
    int ntok = 0;
    int rc = read_text(path, &text, &len);
    if (rc)
        return rc;
    rc = encode(m->tok, text, skv_tokenizer_add_bos(m->tok), false, &ids, &ntok);
    free(text);
    if (rc)
        return rc;
    int N = ntok - M < N_max ? ntok - M : N_max;
    if (N < 64) {
        free(ids);
        return skv_errorf(SKV_E_INVAL, "%s: %d tokens, too short for %d forced tokens", path, ntok, M);
    }
    float *first = malloc((size_t)nv * sizeof *first);
    float *lg = malloc((size_t)S * nv * sizeof *lg);
    int32_t *gen = malloc((size_t)S * M * sizeof *gen);
    double *kl = calloc((size_t)S * M, sizeof *kl);
    int *top1 = calloc((size_t)S, sizeof *top1);
    struct skv_kv_cache **clones = calloc((size_t)S, sizeof *clones);
    uint64_t *kvb = calloc((size_t)S, sizeof *kvb);
    int *budget = calloc((size_t)S, sizeof *budget);
    struct fan_run r = {0};
    double t0 = now_s(), t_prefill = 0, t_forced = 0, t_greedy = 0;
    if (!first || !lg || !gen || !kl || !top1 || !clones || !kvb || !budget) {
        rc = SKV_E_NOMEM;
        goto out_free;
    }
    if ((rc = fan_prefill(q->e, m, q->specs, S, ids, N, first, &r)))
        goto out_free;
    t_prefill = now_s() - t0;
    for (int i = 0; i < S && !rc; i++) {
        kvb[i] = skv_kv_cache_bytes(r.cache[i]);
        budget[i] = i ? skv_compressor_budget(r.comp[i]) : N;
        rc = skv_kv_cache_clone(r.cache[i], &clones[i]);
    }
    if (rc)
        goto out_free;
    /* teacher forcing: feed ids[N + t], compare the next-token distributions */
    t0 = now_s();
    for (int t = 0; t < M && !rc; t++) {
        int32_t tok = ids[N + t];
        for (int i = 0; i < S && !rc; i++) {
            struct skv_forward_opts dec = {.hook = skv_compressor_hook, .hook_user = r.comp[i]};
            if (r.comp[i]) /* as the daemon decodes: the upkeep at the forward's end */
                rc = skv_compressor_begin_step(r.comp[i], r.cache[i], 1, true, &dec);
            if (!rc)
                rc = skv_engine_forward(q->e, r.cache[i], &tok, 1, r.comp[i] ? &dec : NULL, lg + (size_t)i * nv);
        }
        if (rc)
            break;
        const float *f = lg;
        int32_t af = skv_argmax(f, nv);
        for (int i = 1; i < S && !rc; i++) {
            const float *c = lg + (size_t)i * nv;
            /* NaN logits or an infinite divergence fail the run: never a KL of 0 */
            if ((rc = skv_kl_logits(f, c, nv, &kl[(size_t)i * M + t]))) {
                char why[512]; /* (the message is formatted into the buffer it is read from) */
                snprintf(why, sizeof why, "%s", skv_error_msg());
                skv_errorf(rc, "fidelity %s, spec %d, forced token %d: %s", path, i, t, why);
            }
            top1[i] += skv_argmax(c, nv) == af;
        }
    }
    t_forced = now_s() - t0;
    /* free greedy continuation from the prefilled caches */
    t0 = now_s();
    for (int i = 0; i < S && !rc; i++) {
        int got = 0;
        rc = greedy(q->e, m, clones[i], r.comp[i], first, lg, M, false, NULL, gen + (size_t)i * M, &got);
    }
    t_greedy = now_s() - t0;
    if (rc)
        goto out_free;
    json_t *jt = json_object(), *js = json_array();
    json_object_set_new(jt, "file", json_string(path));
    json_object_set_new(jt, "text_tokens", json_integer(ntok));
    json_object_set_new(jt, "prefill_tokens", json_integer(N));
    json_object_set_new(jt, "forced_tokens", json_integer(M));
    json_object_set_new(jt, "prefill_seconds", json_real(t_prefill));
    json_object_set_new(jt, "forced_seconds", json_real(t_forced));
    json_object_set_new(jt, "greedy_seconds", json_real(t_greedy));
    fprintf(stderr, "fidelity %s: %d tokens, prefill %d (%.1f s), forced %d (%.1f s), greedy (%.1f s)\n", path, ntok,
            N, t_prefill, M, t_forced, t_greedy);
    for (int i = 0; i < S; i++) {
        const int32_t *g = gen + (size_t)i * M, *g0 = gen;
        int prefix = 0, same = 0;
        while (prefix < M && g[prefix] == g0[prefix])
            prefix++;
        for (int k = 0; k < M; k++)
            same += g[k] == g0[k];
        double ks = 0;
        json_t *steps = json_array();
        for (int t = 0; t < M; t++) {
            ks += kl[(size_t)i * M + t];
            json_array_append_new(steps, json_real(kl[(size_t)i * M + t]));
        }
        struct fid_stat *st = &stat[i];
        st->kl_sum += ks;
        st->top1 += i ? top1[i] : M;
        st->steps += M;
        st->greedy_prefix += prefix;
        st->greedy_same += same;
        st->greedy_n += M;
        st->kv_frac_sum += (double)kvb[i] / (double)kvb[0];
        st->texts++;
        char *gtext = NULL;
        if (skv_tokenizer_decode(m->tok, g, M, &gtext))
            gtext = NULL;
        json_t *o = json_object();
        json_object_set_new(o, "spec", json_string(q->specs[i].text));
        json_object_set_new(o, "budget", json_integer(budget[i]));
        json_object_set_new(o, "kv_bytes_after_prefill", json_integer((json_int_t)kvb[i]));
        json_object_set_new(o, "kv_fraction", json_real((double)kvb[i] / (double)kvb[0]));
        json_object_set_new(o, "kl_mean", json_real(ks / M));
        json_object_set_new(o, "kl_per_step", steps);
        json_object_set_new(o, "top1_agreement", json_real(i ? (double)top1[i] / M : 1.0));
        json_object_set_new(o, "greedy_prefix_fraction", json_real((double)prefix / M));
        json_object_set_new(o, "greedy_overall_fraction", json_real((double)same / M));
        json_object_set_new(o, "greedy_text", gtext ? skv_bench_json_text(gtext, strlen(gtext)) : json_null());
        json_array_append_new(js, o);
        free(gtext);
        if (i)
            fprintf(stderr, "  %-45s KL %.4f top1 %5.1f%% greedy prefix %2d/%d same %2d/%d kv %.1f%%\n",
                    q->specs[i].text, ks / M, 100.0 * top1[i] / M, prefix, M, same, M, 100.0 * kvb[i] / kvb[0]);
    }
    json_object_set_new(jt, "specs", js);
    json_array_append_new(jtexts, jt);
out_free:
    fan_free(&r);
    for (int i = 0; clones && i < S; i++)
        skv_kv_cache_free(&clones[i]);
    free(clones);
    free(kvb);
    free(budget);
    free(first);
    free(lg);
    free(gen);
    free(kl);
    free(top1);
    free(ids);
    return rc;
}

static bool plot_fidelity(const struct qctx *q, const struct fid_stat *stat)
{
    bool ok = false;
    /* one series per group (spec without its ratio / budget) with >= 2 specs; x is the KV
     * actually kept */
    int groups[MAX_LIST + 1][MAX_LIST + 1], len[MAX_LIST + 1];
    double key[MAX_LIST + 1];
    for (int i = 0; i < q->n_specs; i++)
        key[i] = stat[i].texts ? stat[i].kv_frac_sum / stat[i].texts : 0;
    int ns = budget_series(q, key, groups, len);
    struct strbuf gp = {0};
    for (int k = 0; k < ns; k++) {
        sb_add(&gp, "$s%d << EOD\n", k);
        for (int m = 0; m < len[k]; m++) {
            const struct fid_stat *s = &stat[groups[k][m]];
            sb_add(&gp, "%.4f %.6g %.4f %.4f\n", s->kv_frac_sum / s->texts, s->kl_sum / s->steps,
                   (double)s->top1 / s->steps, (double)s->greedy_same / s->greedy_n);
        }
        sb_add(&gp, "EOD\n");
    }
    if (ns == 0) {
        free(gp.s);
        return true; /* nothing to plot */
    }
    sb_add(&gp, GP_TERM, 960, 400, 960, 400);
    sb_add(&gp, "set output 'fidelity_kl.png'\nset multiplot layout 1,2 title 'Fidelity vs the full cache: %s'\n"
                "set grid\nset xlabel 'KV kept after prefill (fraction of the full cache)'\nset key bottom left\n"
                "set logscale y\n"
                "set ylabel 'mean KL(full || compressed), nats'\nplot ",
           model_label(q));
    for (int k = 0; k < ns; k++)
        sb_add(&gp, "%s$s%d using 1:2 with linespoints title '%s'", k ? ", " : "", k, q->specs[groups[k][0]].group);
    sb_add(&gp, "\nunset logscale y\nset key bottom right\nset yrange [0:1.02]\nset ylabel 'top-1 agreement'\nplot ");
    for (int k = 0; k < ns; k++)
        sb_add(&gp, "%s$s%d using 1:3 with linespoints title '%s'", k ? ", " : "", k, q->specs[groups[k][0]].group);
    sb_add(&gp, "\nunset multiplot\n");
    if (!gp.err)
        ok = run_gnuplot(q->out_dir, "fidelity_kl.gp", gp.s);
    free(gp.s);
    return ok;
}

static int task_fidelity(struct qctx *q, json_t *root)
{
    const struct skv_quality_opts *o = q->o;
    int M = o->fid_tokens > 0 ? o->fid_tokens : 64;
    int N = o->fid_prefill > 0 ? o->fid_prefill : 4096;
    const char *src = o->srcdir ? o->srcdir : getenv("SKV_SRCDIR");
    if (!src || !*src)
        src = ".";
    char paths[MAX_LIST][1024];
    int np = 0;
    if (o->texts) {
        const char *p = o->texts;
        while (*p) { /* a file past the limits is refused, not left out of the means */
            const char *end = strchr(p, ',');
            size_t len = end ? (size_t)(end - p) : strlen(p);
            if (len && np == MAX_LIST)
                return skv_errorf(SKV_E_LIMIT, "--texts: at most %d files", MAX_LIST);
            if (len >= sizeof paths[0])
                return skv_errorf(SKV_E_LIMIT, "--texts: a path of %zu bytes (at most %zu)", len, sizeof paths[0] - 1);
            if (len) {
                memcpy(paths[np], p, len);
                paths[np++][len] = '\0';
            }
            p = end ? end + 1 : p + len;
        }
    } else {
        static const char *const defaults[] = {"tests/fixtures/golden/fidelity_prompt.txt",
                                               "tests/fixtures/golden/long_prompt.txt",
                                               "tests/fixtures/quality/gpl-2.0.txt"};
        for (int i = 0; i < 3; i++)
            snprintf(paths[np++], sizeof paths[0], "%s/%s", src, defaults[i]);
    }
    if (np == 0)
        return skv_errorf(SKV_E_INVAL, "--texts: no files");
    struct fid_stat *stat = calloc((size_t)q->n_specs, sizeof *stat);
    json_t *jf = json_object(), *jtexts = json_array();
    int rc = stat ? SKV_OK : SKV_E_NOMEM;
    double t0 = now_s();
    for (int k = 0; k < np && !rc; k++)
        rc = fidelity_text(q, paths[k], N, M, stat, jtexts);
    double seconds = now_s() - t0;
    if (rc)
        goto out_free;
    json_t *summary = json_array();
    for (int i = 0; i < q->n_specs; i++) {
        const struct fid_stat *s = &stat[i];
        json_t *o2 = json_object();
        json_object_set_new(o2, "spec", json_string(q->specs[i].text));
        json_object_set_new(o2, "ratio", json_real(q->specs[i].spec.ratio));
        json_object_set_new(o2, "kl_mean", json_real(s->kl_sum / s->steps));
        json_object_set_new(o2, "top1_agreement", json_real((double)s->top1 / s->steps));
        json_object_set_new(o2, "greedy_prefix_fraction", json_real((double)s->greedy_prefix / s->greedy_n));
        json_object_set_new(o2, "greedy_overall_fraction", json_real((double)s->greedy_same / s->greedy_n));
        json_object_set_new(o2, "kv_fraction", json_real(s->kv_frac_sum / s->texts));
        json_array_append_new(summary, o2);
    }
    json_object_set_new(jf, "meta", meta_json(q));
    json_object_set_new(jf, "specs", specs_json(q));
    json_object_set_new(jf, "prefill_tokens_max", json_integer(N));
    json_object_set_new(jf, "forced_tokens", json_integer(M));
    json_object_set_new(jf, "summary", summary);
    json_object_set_new(jf, "texts", json_incref(jtexts));
    json_object_set_new(jf, "seconds", json_real(seconds));
    rc = write_json(q->out_dir, "fidelity.json", jf);
    struct strbuf md = {0};
    sb_add(&md, "## Fidelity to the full cache\n\nCommand: `%s`  \n", q->cmdline);
    sb_add(&md, "Model %s, backend %s, %d threads; %.0f s. Each text: the first N tokens (at most %d, leaving "
                "%d) prefilled compressed, then %d tokens teacher-forced one at a time with decode upkeep; "
                "KL(full || compressed) and top-1 agreement of the next-token distribution after each forced "
                "token (the prefill's own logits are the full forward's for every spec and are not counted); "
                "then a %d-token greedy continuation from the prefilled cache compared with the full cache's: "
                "identical tokens before the first divergence (prefix) and at the same index (overall); its "
                "first token comes from those same prefill logits, so both are at least 1/%d.\n\n",
           model_label(q), q->m->be->name, q->m->be->n_threads, seconds, N, M, M, M, M);
    sb_add(&md, "Texts:");
    size_t k;
    json_t *jt;
    json_array_foreach(jtexts, k, jt)
        sb_add(&md, "%s %s (%lld tokens, N = %lld)", k ? ";" : "", json_string_value(json_object_get(jt, "file")),
               (long long)json_integer_value(json_object_get(jt, "text_tokens")),
               (long long)json_integer_value(json_object_get(jt, "prefill_tokens")));
    sb_add(&md, ".\n\nAll texts together:\n\n| spec | KV kept | mean KL | top-1 agree | greedy prefix | greedy "
                "overall |\n|---|---:|---:|---:|---:|---:|\n");
    for (int i = 1; i < q->n_specs; i++) {
        const struct fid_stat *s = &stat[i];
        sb_add(&md, "| %s | %.1f%% | %.4f | %.1f%% | %.1f%% | %.1f%% |\n", q->specs[i].text,
               100.0 * s->kv_frac_sum / s->texts, s->kl_sum / s->steps, 100.0 * s->top1 / s->steps,
               100.0 * s->greedy_prefix / s->greedy_n, 100.0 * s->greedy_same / s->greedy_n);
    }
    sb_add(&md, "\nPer text (mean KL / top-1 agreement / greedy overall):\n\n| spec |");
    json_array_foreach(jtexts, k, jt) {
        const char *f = json_string_value(json_object_get(jt, "file"));
        const char *slash = strrchr(f, '/');
        sb_add(&md, " %s |", slash ? slash + 1 : f);
    }
    sb_add(&md, "\n|---|");
    for (size_t t = 0; t < json_array_size(jtexts); t++)
        sb_add(&md, "---|");
    sb_add(&md, "\n");
    for (int i = 1; i < q->n_specs; i++) {
        sb_add(&md, "| %s |", q->specs[i].text);
        json_array_foreach(jtexts, k, jt) {
            json_t *o2 = json_array_get(json_object_get(jt, "specs"), (size_t)i);
            sb_add(&md, " %.4f / %.0f%% / %.0f%% |", json_real_value(json_object_get(o2, "kl_mean")),
                   100.0 * json_real_value(json_object_get(o2, "top1_agreement")),
                   100.0 * json_real_value(json_object_get(o2, "greedy_overall_fraction")));
        }
        sb_add(&md, "\n");
    }
    sb_add(&md, "\n");
    if (!rc)
        rc = md.err ? md.err : write_file(q->out_dir, "fidelity.md", md.s, md.len);
    if (!rc && !q->o->json_stdout)
        fputs(md.s, stdout);
    free(md.s);
    if (!rc)
        q->fid_plots_failed = !plot_fidelity(q, stat);
    json_object_set(root, "fidelity", jf);
out_free:
    json_decref(jf);
    json_decref(jtexts);
    free(stat);
    return rc;
}

/* ---- entry point ----------------------------------------------------------------------------- */

int skv_bench_quality(struct skv_engine *e, struct skv_model *m, const struct skv_quality_opts *o)
{
    if (!m->tok)
        return skv_errorf(SKV_E_UNSUPPORTED, "quality: the model has no tokenizer");
    const char *task = o->task ? o->task : "all";
    bool do_pk = strcmp(task, "passkey") == 0 || strcmp(task, "all") == 0;
    bool do_fid = strcmp(task, "fidelity") == 0 || strcmp(task, "all") == 0;
    if (!do_pk && !do_fid)
        return skv_errorf(SKV_E_INVAL, "--task '%s': expected passkey, fidelity or all", task);
    struct qctx *q = calloc(1, sizeof *q);
    if (!q)
        return SKV_E_NOMEM;
    q->e = e;
    q->m = m;
    q->o = o;
    q->out_dir = o->out_dir ? o->out_dir : "./quality-out";
    /* the command line as one can run it again: getopt moved the command word to the end */
    int word = o->argc - 1;
    while (word > 0 && strcmp(o->argv[word], "quality") != 0)
        word--;
    size_t at = (size_t)snprintf(q->cmdline, sizeof q->cmdline, "snapkv-bench quality");
    for (int i = 1; i < o->argc && at < sizeof q->cmdline - 1; i++) {
        const char *a = o->argv[i];
        if (i == word)
            continue;
        bool quote = strpbrk(a, " ;*?()") != NULL;
        int w = snprintf(q->cmdline + at, sizeof q->cmdline - at, quote ? " \"%s\"" : " %s", a);
        at += w > 0 ? (size_t)w : 0;
    }
    json_t *root = json_object();
    int rc = parse_specs(o->specs, q->specs, MAX_LIST + 1, &q->n_specs);
    if (!rc)
        rc = mkdir_p(q->out_dir);
    if (!rc && do_pk)
        rc = task_passkey(q, root);
    if (!rc && do_fid)
        rc = task_fidelity(q, root);
    if (!rc && o->json_stdout) {
        char *s = json_dumps(root, JSON_INDENT(1) | JSON_REAL_PRECISION(6));
        if (s)
            puts(s);
        free(s);
    }
    /* the figures are written (and printed) either way; a run asked for its plots too */
    int no_plot = q->pk_plots_failed + q->fid_plots_failed;
    if (!rc && no_plot)
        rc = skv_errorf(SKV_E_IO, "%d plot(s) not drawn (see above); the JSON and markdown in %s are complete", no_plot,
                        q->out_dir);
    json_decref(root);
    free(q);
    return rc;
}
