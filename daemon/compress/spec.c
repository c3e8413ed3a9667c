/* Parsing and formatting of compression specs (see spec.h). */
#include "daemon/compress/spec.h"
#include "common/status.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const policy_names[] = {"full", "snapkv", "h2o", "streaming", "window"};
static const char *const alloc_names[] = {"uniform", "squeeze", "pyramid"};
static const char *const pool_names[] = {"max", "avg"};
static const char *const gqa_names[] = {"mean", "max"};
static const char *const gran_names[] = {"layer", "head"};

const char *skv_policy_name(enum skv_policy p)
{
    return (unsigned)p < 5 ? policy_names[p] : "?";
}

const char *skv_alloc_name(enum skv_alloc a)
{
    return (unsigned)a < 3 ? alloc_names[a] : "?";
}

void skv_compress_spec_default(struct skv_compress_spec *s)
{
    memset(s, 0, sizeof *s); /* the padding too: specs are compared with memcmp */
    s->policy = SKV_POLICY_FULL;
    s->alloc = SKV_ALLOC_UNIFORM;
    s->ratio = 1.0;
    s->window = 32;
    s->kernel = 7;
    s->pool = SKV_POOL_MAX;
    s->gqa = SKV_GQA_MEAN;
    s->granularity = SKV_GRAN_LAYER;
    s->sinks = 4;
    s->p = 0.3;
    s->pyramid_beta = 20;
    s->interval = 64;
}

static int parse_enum(const char *key, const char *val, const char *const *names, int n, int *out)
{
    for (int i = 0; i < n; i++)
        if (strcmp(val, names[i]) == 0)
            return *out = i, SKV_OK;
    char allowed[128] = "";
    for (int i = 0; i < n; i++)
        snprintf(allowed + strlen(allowed), sizeof allowed - strlen(allowed), "%s%s", i ? "|" : "", names[i]);
    return skv_errorf(SKV_E_INVAL, "compression spec: %s=%s: expected %s", key, val, allowed);
}

static int parse_int(const char *key, const char *val, long lo, long hi, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(val, &end, 10);
    if (end == val || *end || errno || v < lo || v > hi)
        return skv_errorf(SKV_E_INVAL, "compression spec: %s=%s: expected an integer in [%ld, %ld]", key, val, lo,
                          hi);
    *out = (int)v;
    return SKV_OK;
}

static int parse_real(const char *key, const char *val, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(val, &end);
    if (end == val || *end || errno || !(v >= lo && v <= hi))
        return skv_errorf(SKV_E_INVAL, "compression spec: %s=%s: expected a number in [%g, %g]", key, val, lo, hi);
    *out = v;
    return SKV_OK;
}

/* A key given a value other than its default where the spec's policy and allocator never read
 * it (policy=full reads none): refused, naming what reads it (before, `policy=h2o,kernel=11` or
 * `alloc=uniform,p=0.5` was taken and changed nothing, without a word). window is read by every
 * policy (COMPRESS runs its last `window` tokens again) and granularity by every compressor, so
 * neither is refused. false: every key given is read. */
static bool ignored_key(const struct skv_compress_spec *s, const char **key, const char **reader)
{
    struct skv_compress_spec d;
    skv_compress_spec_default(&d);
    const bool snapkv = s->policy == SKV_POLICY_SNAPKV, h2o = s->policy == SKV_POLICY_H2O;
    const struct {
        bool ignored;
        const char *key, *reader;
    } keys[] = {
        {s->kernel != d.kernel && !snapkv, "kernel", "policy=snapkv (its pooling of scores)"},
        {s->pool != d.pool && !snapkv, "pool", "policy=snapkv (its pooling of scores)"},
        {s->gqa != d.gqa && !snapkv && !h2o, "gqa", "policy=snapkv and policy=h2o (their scores over a KV group)"},
        {s->sinks != d.sinks && s->policy != SKV_POLICY_STREAMING, "sinks", "policy=streaming"},
        {s->p != d.p && s->alloc != SKV_ALLOC_SQUEEZE, "p", "alloc=squeeze"},
        {s->pyramid_beta != d.pyramid_beta && s->alloc != SKV_ALLOC_PYRAMID, "beta", "alloc=pyramid"},
        {s->interval != d.interval && !(snapkv && s->decode_budget > 0), "interval",
         "policy=snapkv with decode_budget=N (its re-scoring while decoding)"},
    };
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (keys[i].ignored) {
            *key = keys[i].key;
            *reader = keys[i].reader;
            return true;
        }
    return false;
}

static int parse(const char *text, bool lenient, struct skv_compress_spec *out)
{
    struct skv_compress_spec s;
    skv_compress_spec_default(&s);
    if (!text)
        return skv_errorf(SKV_E_INVAL, "compression spec: missing");
    if (strlen(text) > SKV_SPEC_MAX_CHARS)
        return skv_errorf(SKV_E_INVAL, "compression spec: longer than %d characters", SKV_SPEC_MAX_CHARS);
    char buf[SKV_SPEC_MAX_CHARS + 1];
    snprintf(buf, sizeof buf, "%s", text);
    static const char *const keys[] = {"policy", "alloc", "budget", "ratio", "window", "kernel", "pool", "gqa",
                                       "granularity", "sinks", "p", "beta", "decode_budget", "interval", "min_budget"};
    enum { NKEYS = sizeof keys / sizeof keys[0] };
    bool seen[NKEYS] = {false};
    int rc = SKV_OK;
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ')
            tok++;
        for (size_t n = strlen(tok); n && tok[n - 1] == ' ';) /* blanks around a pair, not inside */
            tok[--n] = '\0';
        if (!*tok)
            continue;
        char *eq = strchr(tok, '=');
        if (!eq)
            return skv_errorf(SKV_E_INVAL, "compression spec: '%s' is not key=value", tok);
        *eq = '\0';
        const char *key = tok, *val = eq + 1;
        int k = -1;
        for (int i = 0; i < NKEYS; i++)
            if (strcmp(key, keys[i]) == 0)
                k = i;
        if (k < 0)
            return skv_errorf(SKV_E_INVAL, "compression spec: unknown key '%s'", key);
        if (seen[k])
            return skv_errorf(SKV_E_INVAL, "compression spec: '%s' given twice", key);
        seen[k] = true;
        int e;
        switch (k) {
        case 0: rc = parse_enum(key, val, policy_names, 5, &e); s.policy = e; break;
        case 1: rc = parse_enum(key, val, alloc_names, 3, &e); s.alloc = e; break;
        case 2: rc = parse_int(key, val, 1, SKV_SPEC_MAX_BUDGET, &s.budget); break;
        case 3: rc = parse_real(key, val, 0.0, 1.0, &s.ratio); break;
        case 4: rc = parse_int(key, val, 1, 4096, &s.window); break;
        case 5:
            rc = parse_int(key, val, 1, 255, &s.kernel);
            if (!rc && s.kernel % 2 == 0)
                rc = skv_errorf(SKV_E_INVAL, "compression spec: kernel=%d: must be odd", s.kernel);
            break;
        case 6: rc = parse_enum(key, val, pool_names, 2, &e); s.pool = e; break;
        case 7: rc = parse_enum(key, val, gqa_names, 2, &e); s.gqa = e; break;
        case 8: rc = parse_enum(key, val, gran_names, 2, &e); s.granularity = e; break;
        case 9: rc = parse_int(key, val, 0, 4096, &s.sinks); break;
        case 10: rc = parse_real(key, val, 0.0, 1.0, &s.p); break;
        case 11: rc = parse_int(key, val, 1, 1000, &s.pyramid_beta); break;
        case 12: rc = parse_int(key, val, 1, SKV_SPEC_MAX_BUDGET, &s.decode_budget); break;
        case 13: rc = parse_int(key, val, 1, 1 << 20, &s.interval); break;
        case 14: rc = parse_int(key, val, 1, SKV_SPEC_MAX_BUDGET, &s.min_budget); break;
        }
        if (rc)
            return rc;
    }
    if (seen[2] && seen[3])
        return skv_errorf(SKV_E_INVAL, "compression spec: give budget or ratio, not both");
    if (seen[2])
        s.ratio = -1;
    if (s.policy == SKV_POLICY_FULL && (seen[1] || seen[2] || seen[3] || seen[12] || seen[14]))
        return skv_errorf(SKV_E_INVAL, "compression spec: policy=full keeps everything; budget, ratio, min_budget, "
                                       "decode_budget and alloc do not apply");
    if (s.policy != SKV_POLICY_FULL && !seen[2] && !seen[3])
        return skv_errorf(SKV_E_INVAL, "compression spec: policy=%s needs budget=N or ratio=R",
                          policy_names[s.policy]);
    if (seen[14] && !seen[3])
        return skv_errorf(SKV_E_INVAL, "compression spec: min_budget is a floor under ratio=R; with budget=N "
                                       "give the tokens directly");
    const char *key = NULL, *reader = NULL;
    if (!lenient && ignored_key(&s, &key, &reader))
        return skv_errorf(SKV_E_INVAL, "compression spec: %s does nothing with policy=%s,alloc=%s; it is read by %s",
                          key, policy_names[s.policy], alloc_names[s.alloc], reader);
    *out = s;
    return SKV_OK;
}

int skv_compress_spec_parse(const char *text, struct skv_compress_spec *out)
{
    return parse(text, false, out);
}

int skv_compress_spec_parse_saved(const char *text, struct skv_compress_spec *out)
{
    return parse(text, true, out);
}

/* v as the shortest decimal that reads back as exactly v (the canonical spec is what SAVE
 * stores and LOAD parses again), e.g. "0.1", not "0.10000000000000001". */
static const char *shortest(double v, char *buf, size_t cap)
{
    for (int digits = 6; digits <= 17; digits++) {
        snprintf(buf, cap, "%.*g", digits, v);
        if (strtod(buf, NULL) == v)
            break;
    }
    return buf;
}

int skv_compress_spec_format(const struct skv_compress_spec *s, char *buf, size_t cap)
{
    char size[48], p[32];
    if (s->ratio >= 0)
        snprintf(size, sizeof size, "ratio=%s", shortest(s->ratio, p, sizeof p));
    else
        snprintf(size, sizeof size, "budget=%d", s->budget);
    int n;
    if (s->policy == SKV_POLICY_FULL)
        n = snprintf(buf, cap, "policy=full");
    else
        n = snprintf(buf, cap,
                     "policy=%s,alloc=%s,%s,window=%d,kernel=%d,pool=%s,gqa=%s,granularity=%s,sinks=%d,p=%s,"
                     "beta=%d,interval=%d%s",
                     policy_names[s->policy], alloc_names[s->alloc], size, s->window, s->kernel, pool_names[s->pool],
                     gqa_names[s->gqa], gran_names[s->granularity], s->sinks, shortest(s->p, p, sizeof p),
                     s->pyramid_beta, s->interval,
                     "");
    if (n >= 0 && (size_t)n < cap && s->min_budget > 0 && s->policy != SKV_POLICY_FULL)
        n += snprintf(buf + n, cap - (size_t)n, ",min_budget=%d", s->min_budget);
    if (n >= 0 && (size_t)n < cap && s->decode_budget > 0)
        n += snprintf(buf + n, cap - (size_t)n, ",decode_budget=%d", s->decode_budget);
    return n < 0 || (size_t)n >= cap ? SKV_E_LIMIT : SKV_OK;
}

/* buf[*n ...] += the formatted text, while it fits (*n < 0 or >= cap: it did not). */
static void append(char *buf, size_t cap, int *n, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void append(char *buf, size_t cap, int *n, const char *fmt, ...)
{
    if (*n < 0 || (size_t)*n >= cap)
        return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(buf + *n, cap - (size_t)*n, fmt, ap);
    va_end(ap);
    *n = k < 0 ? k : *n + k;
}

int skv_compress_spec_format_short(const struct skv_compress_spec *s, char *buf, size_t cap)
{
    struct skv_compress_spec d;
    skv_compress_spec_default(&d);
    char p[32];
    int n = 0;
    append(buf, cap, &n, "policy=%s", policy_names[s->policy]);
    if (s->policy != SKV_POLICY_FULL) {
        if (s->alloc != d.alloc)
            append(buf, cap, &n, ",alloc=%s", alloc_names[s->alloc]);
        if (s->ratio >= 0)
            append(buf, cap, &n, ",ratio=%s", shortest(s->ratio, p, sizeof p));
        else
            append(buf, cap, &n, ",budget=%d", s->budget);
        if (s->min_budget > 0)
            append(buf, cap, &n, ",min_budget=%d", s->min_budget);
        if (s->window != d.window)
            append(buf, cap, &n, ",window=%d", s->window);
        if (s->kernel != d.kernel)
            append(buf, cap, &n, ",kernel=%d", s->kernel);
        if (s->pool != d.pool)
            append(buf, cap, &n, ",pool=%s", pool_names[s->pool]);
        if (s->gqa != d.gqa)
            append(buf, cap, &n, ",gqa=%s", gqa_names[s->gqa]);
        if (s->granularity != d.granularity)
            append(buf, cap, &n, ",granularity=%s", gran_names[s->granularity]);
        if (s->sinks != d.sinks)
            append(buf, cap, &n, ",sinks=%d", s->sinks);
        if (s->p != d.p)
            append(buf, cap, &n, ",p=%s", shortest(s->p, p, sizeof p));
        if (s->pyramid_beta != d.pyramid_beta)
            append(buf, cap, &n, ",beta=%d", s->pyramid_beta);
        if (s->interval != d.interval)
            append(buf, cap, &n, ",interval=%d", s->interval);
    }
    if (s->decode_budget > 0)
        append(buf, cap, &n, ",decode_budget=%d", s->decode_budget);
    return n < 0 || (size_t)n >= cap ? SKV_E_LIMIT : SKV_OK;
}

int skv_compress_spec_budget(const struct skv_compress_spec *s, int n)
{
    if (n <= 0)
        return 0;
    long b = s->ratio >= 0 ? (long)ceil(s->ratio * n - 1e-9) : s->budget;
    if (s->ratio >= 0 && b < s->min_budget)
        b = s->min_budget;
    if (s->policy == SKV_POLICY_FULL)
        b = n;
    return (int)(b < 1 ? 1 : b > n ? n : b);
}
