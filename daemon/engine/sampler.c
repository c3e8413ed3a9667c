/* Sampling: logit bias and penalties, then a temperature-scaled softmax, top-k, top-p and min-p
 * truncation, one uniform draw from a splitmix64 stream seeded by the request. */
#include "daemon/engine/sampler.h"
#include "common/status.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int32_t skv_argmax(const float *logits, int n)
{
    int32_t best = -1; /* a NaN is never the best (it compares false to all: one at 0 stayed) */
    for (int i = 0; i < n; i++)
        if (!isnan(logits[i]) && (best < 0 || logits[i] > logits[best]))
            best = i;
    return best < 0 ? 0 : best;
}

/* log(sum exp(x)) of n finite-or--inf logits in double; SKV_E_INVAL for a NaN or +inf one, or
 * when every one is -inf. */
static int logsumexp(const float *x, int n, const char *which, double *out)
{
    double m = -INFINITY;
    for (int j = 0; j < n; j++) {
        if (isnan(x[j]) || x[j] == INFINITY)
            return skv_errorf(SKV_E_INVAL, "KL: %s's logit %d is %s", which, j, isnan(x[j]) ? "NaN" : "+inf");
        m = x[j] > m ? x[j] : m;
    }
    if (m == -INFINITY)
        return skv_errorf(SKV_E_INVAL, "KL: every logit of %s is -inf", which);
    double s = 0;
    for (int j = 0; j < n; j++)
        s += exp((double)x[j] - m);
    *out = m + log(s);
    return SKV_OK;
}

int skv_kl_logits(const float *p, const float *q, int n, double *out)
{
    double lp, lq;
    int rc = logsumexp(p, n, "P", &lp);
    if (!rc)
        rc = logsumexp(q, n, "Q", &lq);
    if (rc)
        return rc;
    double s = 0;
    for (int j = 0; j < n; j++) {
        if (p[j] == -INFINITY)
            continue; /* 0 * log(0 / q): nothing */
        if (q[j] == -INFINITY)
            return skv_errorf(SKV_E_INVAL, "KL: token %d has probability under P and none under Q (the divergence "
                              "is infinite)", j);
        double a = (double)p[j] - lp;
        s += exp(a) * (a - ((double)q[j] - lq));
    }
    *out = s > 0 ? s : 0; /* (a rounding below 0 when they are equal) */
    return SKV_OK;
}

int skv_logprobs(const float *logits, int n, int32_t token, int top_n, float *token_lp, int32_t *top_ids,
                 float *top_lp)
{
    float mx = -INFINITY;
    int n_inf = 0;
    for (int i = 0; i < n; i++) {
        mx = logits[i] > mx ? logits[i] : mx; /* a NaN never passes */
        n_inf += logits[i] == INFINITY;
    }
    double lse = INFINITY; /* what every finite logit's log-probability is taken from */
    if (mx > -INFINITY && mx < INFINITY) {
        double sum = 0;
        for (int i = 0; i < n; i++)
            sum += isnan(logits[i]) ? 0.0 : exp((double)logits[i] - mx);
        lse = mx + log(sum);
    }
    /* the log-probability of logit x */
#define LP(x) ((x) == INFINITY ? (float)-log((double)n_inf) : isnan(x) || n_inf ? -INFINITY \
                                                                            : (float)((double)(x) - lse))
    if (token_lp)
        *token_lp = token >= 0 && token < n ? LP(logits[token]) : -INFINITY;
    /* the top_n by insertion, ids in ascending order: an equal one already kept stays first */
#define KEY(i) (isnan(logits[i]) ? -INFINITY : logits[i])
    int m = 0;
    for (int i = 0; i < n && top_n > 0; i++) {
        const float x = KEY(i);
        if (m == top_n && !(x > KEY(top_ids[m - 1])))
            continue;
        int at = m < top_n ? m++ : top_n - 1;
        for (; at > 0 && KEY(top_ids[at - 1]) < x; at--)
            top_ids[at] = top_ids[at - 1];
        top_ids[at] = i;
    }
#undef KEY
    for (int j = 0; j < m; j++)
        top_lp[j] = LP(logits[top_ids[j]]);
#undef LP
    return m;
}

/* A float parameter in [lo, hi] (NaN is not). */
static int check_range(const char *name, float v, float lo, float hi)
{
    if (isnan(v) || v < lo || v > hi)
        return skv_errorf(SKV_E_INVAL, "%s %g is outside [%g, %g]", name, v, lo, hi);
    return SKV_OK;
}

/* The bias entries: tokens in the vocabulary, each once, values in [-100, 100]. */
static int check_bias(const struct skv_sampler_params *p, int n_vocab)
{
    if (p->n_bias > SKV_LOGIT_BIAS_MAX)
        return skv_errorf(SKV_E_LIMIT, "at most %u logit_bias entries, not %zu", SKV_LOGIT_BIAS_MAX, p->n_bias);
    if (p->n_bias && (!p->bias_ids || !p->bias))
        return skv_errorf(SKV_E_INVAL, "logit_bias has no tokens or no values");
    for (size_t i = 0; i < p->n_bias; i++) {
        if (p->bias_ids[i] < 0 || p->bias_ids[i] >= n_vocab)
            return skv_errorf(SKV_E_INVAL, "logit_bias token %d is outside the vocabulary (%d tokens)",
                              p->bias_ids[i], n_vocab);
        if (isnan(p->bias[i]) || p->bias[i] < -100 || p->bias[i] > 100)
            return skv_errorf(SKV_E_INVAL, "logit_bias %g for token %d is outside [-100, 100]", p->bias[i],
                              p->bias_ids[i]);
        for (size_t j = 0; j < i; j++)
            if (p->bias_ids[j] == p->bias_ids[i])
                return skv_errorf(SKV_E_INVAL, "logit_bias names token %d twice", p->bias_ids[i]);
    }
    return SKV_OK;
}

int skv_sampler_init(struct skv_sampler *s, const struct skv_sampler_params *p, int n_vocab)
{
    memset(s, 0, sizeof *s);
    if (n_vocab <= 0)
        return skv_errorf(SKV_E_INVAL, "vocabulary is empty");
    int rc = check_range("temperature", p->temperature, 0, 100);
    if (!rc)
        rc = check_range("top_p", p->top_p, 0, 1);
    if (!rc && p->top_k < 0)
        rc = skv_errorf(SKV_E_INVAL, "top_k %d is negative", p->top_k);
    if (!rc)
        rc = check_range("min_p", p->min_p, 0, 1);
    if (!rc && p->repetition_penalty != 0) /* 0: off; below 0.01 a logit / penalty overflows */
        rc = check_range("repetition_penalty", p->repetition_penalty, 0.01f, 100);
    if (!rc && p->repetition_last_n < 0)
        rc = skv_errorf(SKV_E_INVAL, "repetition_last_n %d is negative", p->repetition_last_n);
    if (!rc)
        rc = check_range("frequency_penalty", p->frequency_penalty, -2, 2);
    if (!rc)
        rc = check_range("presence_penalty", p->presence_penalty, -2, 2);
    if (!rc)
        rc = check_bias(p, n_vocab);
    if (rc)
        return rc;
    s->p = *p;
    s->p.bias_ids = NULL;
    s->p.bias = NULL;
    s->state = p->seed ^ 0x9E3779B97F4A7C15ull;
    s->n_vocab = n_vocab;
    s->adjusts = p->n_bias || (p->repetition_penalty > 0 && p->repetition_penalty != 1) ||
                 p->frequency_penalty != 0 || p->presence_penalty != 0;
    bool ok = true;
    if (p->temperature > 0)
        ok = (s->idx = malloc((size_t)n_vocab * sizeof *s->idx)) &&
             (s->prob = malloc((size_t)n_vocab * sizeof *s->prob));
    if (ok && s->adjusts)
        ok = (s->adj = malloc((size_t)n_vocab * sizeof *s->adj)) &&
             (s->count = calloc((size_t)n_vocab, sizeof *s->count));
    if (ok && p->n_bias) {
        int32_t *ids = malloc(p->n_bias * sizeof *ids);
        float *bias = malloc(p->n_bias * sizeof *bias);
        if (ids && bias) {
            memcpy(ids, p->bias_ids, p->n_bias * sizeof *ids);
            memcpy(bias, p->bias, p->n_bias * sizeof *bias);
        }
        s->p.bias_ids = ids;
        s->p.bias = bias;
        ok = ids && bias;
    }
    if (!ok) {
        skv_sampler_fini(s);
        return SKV_E_NOMEM;
    }
    return SKV_OK;
}

void skv_sampler_fini(struct skv_sampler *s)
{
    free(s->idx);
    free(s->prob);
    free(s->adj);
    free(s->count);
    free((void *)s->p.bias_ids);
    free((void *)s->p.bias);
    s->idx = NULL;
    s->prob = NULL;
    s->adj = NULL;
    s->count = NULL;
    s->p.bias_ids = NULL;
    s->p.bias = NULL;
}

static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

#define SWAP_I32(a, b)                                                                             \
    do {                                                                                           \
        int32_t t_ = (a);                                                                          \
        (a) = (b);                                                                                 \
        (b) = t_;                                                                                  \
    } while (0)

/* Sorts idx[0..n) by prob descending (ties: lower id first). */
static int by_prob_desc(const void *a, const void *b, void *arg)
{
    const float *prob = arg;
    int32_t ia = *(const int32_t *)a, ib = *(const int32_t *)b;
    float pa = prob[ia], pb = prob[ib];
    if (pa != pb)
        return pa > pb ? -1 : 1;
    return ia < ib ? -1 : ia > ib;
}

/* Moves the k candidates by_prob_desc puts first to idx[0..k), in no order (quickselect;
 * the order is strict, ties going to the lower id, so they are exactly the first k of a full
 * sort). */
static void select_first(int32_t *idx, int n, int k, const float *prob)
{
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        /* median of three as the pivot */
        if (by_prob_desc(&idx[mid], &idx[lo], (void *)prob) < 0)
            SWAP_I32(idx[mid], idx[lo]);
        if (by_prob_desc(&idx[hi], &idx[lo], (void *)prob) < 0)
            SWAP_I32(idx[hi], idx[lo]);
        if (by_prob_desc(&idx[hi], &idx[mid], (void *)prob) < 0)
            SWAP_I32(idx[hi], idx[mid]);
        int32_t pivot = idx[mid];
        int i = lo, j = hi;
        while (i <= j) {
            while (by_prob_desc(&idx[i], &pivot, (void *)prob) < 0)
                i++;
            while (by_prob_desc(&idx[j], &pivot, (void *)prob) > 0)
                j--;
            if (i <= j) {
                SWAP_I32(idx[i], idx[j]);
                i++;
                j--;
            }
        }
        if (k - 1 <= j)
            hi = j;
        else if (k - 1 >= i)
            lo = i;
        else
            break;
    }
}

const float *skv_sampler_adjust(struct skv_sampler *s, const float *logits, const int32_t *history,
                                int n_history, const int32_t *generated, int n_generated)
{
    if (!s->adjusts)
        return logits;
    const int n = s->n_vocab;
    float *a = s->adj;
    memcpy(a, logits, (size_t)n * sizeof *a);
    for (size_t i = 0; i < s->p.n_bias; i++)
        a[s->p.bias_ids[i]] += s->p.bias[i];
    const float rp = s->p.repetition_penalty;
    if (rp > 0 && rp != 1 && n_history > 0) {
        int from = s->p.repetition_last_n > 0 && s->p.repetition_last_n < n_history
                       ? n_history - s->p.repetition_last_n
                       : 0;
        /* count marks the tokens already penalized (each once, as transformers' gather does) */
        for (int i = from; i < n_history; i++) {
            int32_t t = history[i];
            if (t < 0 || t >= n || s->count[t])
                continue;
            s->count[t] = 1;
            a[t] = a[t] < 0 ? a[t] * rp : a[t] / rp;
        }
        for (int i = from; i < n_history; i++)
            if (history[i] >= 0 && history[i] < n)
                s->count[history[i]] = 0;
    }
    const float fp = s->p.frequency_penalty, pp = s->p.presence_penalty;
    if ((fp != 0 || pp != 0) && n_generated > 0) {
        for (int i = 0; i < n_generated; i++)
            if (generated[i] >= 0 && generated[i] < n)
                s->count[generated[i]]++;
        for (int i = 0; i < n_generated; i++) {
            int32_t t = generated[i];
            if (t < 0 || t >= n || !s->count[t])
                continue;
            a[t] -= (float)s->count[t] * fp; /* two steps, as vLLM takes them */
            a[t] -= pp;
            s->count[t] = 0;
        }
    }
    return a;
}

int skv_sampler_candidates(struct skv_sampler *s, const float *logits, double *mass)
{
    int n = s->n_vocab;
    float maxl = logits[skv_argmax(logits, n)];
    double sum = 0;
    for (int i = 0; i < n; i++) {
        s->prob[i] = isnan(logits[i]) ? 0.0f : expf((logits[i] - maxl) / s->p.temperature);
        sum += s->prob[i];
    }
    /* Candidates in by_prob_desc's order, as far as they are needed: the top k (selected, then
     * only those sorted: a full sort of a 152K vocabulary took some 10 ms a token); with top_p
     * alone, only tokens of at least (1 - top_p) * sum / n can be in the nucleus (the tokens
     * from one below that on hold less than 1 - top_p of the mass together), so the rest are
     * left out of the sort (not under top_k: the nucleus is then of the top k's mass, and the
     * bound does not hold). The same tokens, in the same order, as sorting all of them. */
    int k = s->p.top_k > 0 && s->p.top_k < n ? s->p.top_k : n;
    bool nucleus = s->p.top_p > 0 && s->p.top_p < 1;
    bool need_sort = k < n || nucleus;
    int m = 0;
    bool pruned = nucleus && k == n; /* then the nucleus is of all the mass, sum */
    if (pruned) {
        float least = (float)((1.0 - s->p.top_p) * sum / n);
        for (int i = 0; i < n; i++)
            if (s->prob[i] >= least)
                s->idx[m++] = i;
    } else {
        for (int i = 0; i < n; i++)
            s->idx[m++] = i;
    }
    if (k > m)
        k = m;
    if (need_sort) {
        if (k < m) {
            select_first(s->idx, m, k, s->prob);
            /* tokens tied with the k-th stay too, as transformers' TopKLogitsWarper leaves
             * every token not below the k-th logit (the least logit selected: selection went by
             * probability, which may make two logits one) */
            int32_t low = s->idx[0];
            for (int i = 1; i < k; i++)
                low = logits[s->idx[i]] < logits[low] ? s->idx[i] : low;
            const float least = logits[low];
            /* (none when the least selected has no probability: ties would add nothing, and
             * under a low temperature every token whose weight underflowed would come) */
            for (int i = k; i < m && s->prob[low] > 0; i++)
                if (logits[s->idx[i]] >= least) {
                    SWAP_I32(s->idx[i], s->idx[k]);
                    k++;
                }
        }
        qsort_r(s->idx, (size_t)k, sizeof *s->idx, by_prob_desc, s->prob);
    }
    double kept = 0;
    for (int i = 0; i < k && !pruned; i++)
        kept += s->prob[s->idx[i]];
    if (pruned)
        kept = sum;
    if (nucleus) {
        double acc = 0;
        for (int i = 0; i < k; i++) {
            acc += s->prob[s->idx[i]];
            if (acc >= s->p.top_p * kept) {
                k = i + 1;
                kept = acc;
                break;
            }
        }
    }
    if (!need_sort)
        kept = sum;
    /* min-p last: the likeliest token's weight is exp(0) = 1, so the bound is min_p itself; the
     * candidates are in order of likelihood, or all of them by id */
    if (s->p.min_p > 0) {
        int j = 0;
        kept = 0;
        for (int i = 0; i < k; i++) {
            if (s->prob[s->idx[i]] >= s->p.min_p) {
                s->idx[j++] = s->idx[i];
                kept += s->prob[s->idx[i]];
            } else if (need_sort) {
                break;
            }
        }
        k = j;
    }
    *mass = kept;
    return k;
}

int32_t skv_sampler_next(struct skv_sampler *s, const float *logits, const int32_t *history, int n_history,
                         const int32_t *generated, int n_generated)
{
    const float *l = skv_sampler_adjust(s, logits, history, n_history, generated, n_generated);
    int32_t top = skv_argmax(l, s->n_vocab);
    /* +inf holds all the mass; NaN or -inf everywhere is no distribution: the lowest id */
    if (s->p.temperature <= 0 || !isfinite(l[top]))
        return top;
    double kept;
    int k = skv_sampler_candidates(s, l, &kept);
    double u = (double)(splitmix64(&s->state) >> 11) * (1.0 / 9007199254740992.0) * kept;
    double acc = 0;
    for (int i = 0; i < k; i++) {
        acc += s->prob[s->idx[i]];
        if (u < acc)
            return s->idx[i];
    }
    return s->idx[k - 1];
}

int32_t skv_sampler_sample(struct skv_sampler *s, const float *logits)
{
    return skv_sampler_next(s, logits, NULL, 0, NULL, 0);
}

/* ---- stop sequences ------------------------------------------------------------------------- */

int skv_stop_text_check(const char *const *stop, size_t n)
{
    if (n > SKV_STOP_STRINGS_MAX)
        return skv_errorf(SKV_E_LIMIT, "at most %u stop sequences, not %zu", SKV_STOP_STRINGS_MAX, n);
    for (size_t i = 0; i < n; i++) {
        size_t len = stop[i] ? strlen(stop[i]) : 0;
        if (len == 0)
            return skv_errorf(SKV_E_INVAL, "stop sequence %zu is empty", i);
        if (len > SKV_STOP_STRING_BYTES)
            return skv_errorf(SKV_E_LIMIT, "stop sequence %zu has %zu bytes (at most %u)", i, len,
                              SKV_STOP_STRING_BYTES);
    }
    return SKV_OK;
}

int skv_stop_text_init(struct skv_stop_text *st, const char *const *stop, size_t n)
{
    memset(st, 0, sizeof *st);
    int rc = skv_stop_text_check(stop, n);
    for (size_t i = 0; i < n && !rc; i++) {
        size_t len = strlen(stop[i]);
        if (!(st->stop[i] = malloc(len))) {
            skv_stop_text_fini(st);
            return SKV_E_NOMEM;
        }
        memcpy(st->stop[i], stop[i], len);
        st->len[i] = len;
        st->n = i + 1;
    }
    return rc;
}

void skv_stop_text_fini(struct skv_stop_text *st)
{
    for (size_t i = 0; i < st->n; i++)
        free(st->stop[i]);
    memset(st, 0, sizeof *st);
}

bool skv_stop_text_feed(struct skv_stop_text *st, const char *text, size_t len, char *out, size_t *n_out)
{
    memcpy(out, st->hold, st->n_hold);
    memcpy(out + st->n_hold, text, len);
    size_t total = st->n_hold + len;
    st->n_hold = 0;
    /* the earliest complete sequence */
    size_t at = total;
    for (size_t i = 0; i < st->n; i++)
        for (size_t p = 0; p + st->len[i] <= total && p < at; p++)
            if (memcmp(out + p, st->stop[i], st->len[i]) == 0) {
                at = p;
                break;
            }
    if (at < total) {
        out[at] = '\0';
        *n_out = at;
        return true;
    }
    /* the longest suffix that is a proper prefix of a sequence stays */
    size_t keep = 0;
    for (size_t i = 0; i < st->n; i++)
        for (size_t j = st->len[i] - 1 < total ? st->len[i] - 1 : total; j > keep; j--)
            if (memcmp(out + total - j, st->stop[i], j) == 0) {
                keep = j;
                break;
            }
    memcpy(st->hold, out + total - keep, keep);
    st->n_hold = keep;
    out[total - keep] = '\0';
    *n_out = total - keep;
    return false;
}

size_t skv_stop_text_flush(struct skv_stop_text *st, char *out)
{
    size_t n = st->n_hold;
    memcpy(out, st->hold, n);
    out[n] = '\0';
    st->n_hold = 0;
    return n;
}
