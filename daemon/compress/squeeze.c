/* SqueezeAttention's layer allocator: layers whose attention changes the hidden state least
 * (highest input/output cosine similarity) form one KMeans cluster and get p times the rows
 * they would choose; the others share what they give up, so the total stays L * B
 * (hetailang/SqueezeAttention). */
#include "daemon/compress/compress.h"
#include "common/status.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

struct valued {
    float v;
    int i;
};

static int by_value(const void *a, const void *b)
{
    const struct valued *x = a, *y = b;
    if (x->v != y->v)
        return x->v < y->v ? -1 : 1;
    return x->i - y->i;
}

/* KMeans with k = 3 on scalars, solved exactly: in one dimension the optimal clusters are
 * contiguous runs of the sorted values, so trying every pair of split points finds the
 * global minimum of the within-cluster sum of squares (what Lloyd's iterations only
 * approach, and deterministic). label[i] in 0..2 by increasing centroid. */
static int kmeans3(const float *x, int n, int *label)
{
    struct valued *s = malloc((size_t)n * sizeof *s);
    double *pre = malloc((size_t)(n + 1) * sizeof *pre), *pre2 = malloc((size_t)(n + 1) * sizeof *pre2);
    if (!s || !pre || !pre2) {
        free(s);
        free(pre);
        free(pre2);
        return SKV_E_NOMEM;
    }
    /* NaN (no valid order for qsort): a layer whose change is unknown counts as changing the
     * hidden state most (kept fullest): -2, below any cosine (-INFINITY made every sum of
     * squares NaN, and the first split won whatever the values) */
    for (int i = 0; i < n; i++)
        s[i] = (struct valued){isnan(x[i]) ? -2.0f : x[i] < -2.0f ? -2.0f : x[i] > 2.0f ? 2.0f : x[i], i};
    qsort(s, (size_t)n, sizeof *s, by_value);
    pre[0] = pre2[0] = 0;
    for (int i = 0; i < n; i++) {
        pre[i + 1] = pre[i] + s[i].v;
        pre2[i + 1] = pre2[i] + (double)s[i].v * s[i].v;
    }
#define SSE(a, b) (pre2[b] - pre2[a] - (pre[b] - pre[a]) * (pre[b] - pre[a]) / ((b) - (a)))
    /* splits only between distinct values, so equal layers share a cluster; with two distinct
     * values the middle cluster is empty (b1 = b2), with one all layers are alike (uniform) */
    double best = INFINITY;
    int b1 = 0, b2 = 0, cuts = 0;
    for (int i = 1; i < n; i++)
        if (s[i].v != s[i - 1].v) {
            cuts++;
            b1 = b2 = i;
        }
    if (cuts < 2) {
        for (int r = 0; r < n; r++)
            label[s[r].i] = r < b1 ? 0 : 2;
        free(s);
        free(pre);
        free(pre2);
        return SKV_OK;
    }
    for (int i = 1; i < n - 1; i++)
        for (int j = i + 1; j < n; j++) {
            if (s[i].v == s[i - 1].v || s[j].v == s[j - 1].v)
                continue;
            double cost = SSE(0, i) + SSE(i, j) + SSE(j, n);
            if (cost < best - 1e-12) {
                best = cost;
                b1 = i;
                b2 = j;
            }
        }
#undef SSE
    for (int r = 0; r < n; r++)
        label[s[r].i] = r < b1 ? 0 : r < b2 ? 1 : 2;
    free(s);
    free(pre);
    free(pre2);
    return SKV_OK;
}

void skv_squeeze_budgets(const float *sim, int n_layers, int budget, int window, double p, int n, int *out)
{
    int *label = calloc((size_t)n_layers, sizeof *label);
    if (!label || n_layers < 3) {
        for (int l = 0; l < n_layers; l++)
            out[l] = budget;
        free(label);
        return;
    }
    if (kmeans3(sim, n_layers, label) != SKV_OK) {
        for (int l = 0; l < n_layers; l++)
            out[l] = budget;
        free(label);
        return;
    }
    int n_low = 0;
    for (int l = 0; l < n_layers; l++)
        n_low += label[l] == 2;
    if (n_low == 0 || n_low == n_layers) {
        for (int l = 0; l < n_layers; l++)
            out[l] = budget;
        free(label);
        return;
    }
    long total = (long)n_layers * budget;
    /* p scales the rows a layer chooses; the rows the policy always keeps (SnapKV's
     * observation window, H2O's recent window) stay on top, so no layer is left with its
     * window alone. Without such a window this is SqueezeAttention's p * B. */
    int w = window < budget ? window : budget;
    int low = w + (int)floor(p * (budget - w));
    if (low < 1)
        low = 1;
    long rest = total - (long)n_low * low;
    int n_high = n_layers - n_low;
    for (int l = 0, k = 0; l < n_layers; l++) {
        if (label[l] == 2) {
            out[l] = low;
        } else {
            /* spread the remainder over the first layers so the sum is exact */
            long share = rest / n_high + (k < rest % n_high ? 1 : 0);
            out[l] = (int)share;
            k++;
        }
        if (out[l] > n)
            out[l] = n;
    }
    /* A layer holds at most the whole prompt: what the important layers cannot take goes back
     * to the others, so the total stays L * B whenever the prompt allows it. */
    long used = 0;
    for (int l = 0; l < n_layers; l++)
        used += out[l];
    /* water-filling: every layer under the cap gets the same share of what is left (the last
     * rows one each, earlier layers first), so the passes are few whatever the budget */
    while (used < total) {
        int open = 0;
        for (int l = 0; l < n_layers; l++)
            open += out[l] < n;
        if (open == 0)
            break;
        long share = (total - used) / open;
        share = share > 0 ? share : 1;
        for (int l = 0; l < n_layers && used < total; l++) {
            long room = (long)n - out[l], give = share < room ? share : room;
            give = give < total - used ? give : total - used;
            out[l] += (int)give;
            used += give;
        }
    }
    free(label);
}
