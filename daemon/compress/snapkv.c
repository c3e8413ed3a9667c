/* SnapKV's scoring pieces: GQA aggregation of per-query-head window scores into one score
 * per KV head row, and 1-D pooling that keeps neighbours of important tokens together
 * (FasterDecoding/SnapKV; the GQA-aware variant of DESIGN §3). */
#include "daemon/compress/compress.h"

#include <math.h>

void skv_gqa_reduce(const float *in, int64_t stride, int g, int n, enum skv_gqa how, float *out)
{
    for (int j = 0; j < n; j++) {
        float acc = in[j];
        for (int r = 1; r < g; r++) {
            float v = in[r * stride + j];
            acc = how == SKV_GQA_MAX ? (v > acc ? v : acc) : acc + v;
        }
        out[j] = how == SKV_GQA_MAX ? acc : acc / (float)g;
    }
}

void skv_pool1d(const float *scores, float *out, int n, int k, enum skv_pool pool)
{
    int half = k / 2;
    for (int j = 0; j < n; j++) {
        int lo = j - half < 0 ? 0 : j - half, hi = j + half >= n ? n - 1 : j + half;
        if (pool == SKV_POOL_MAX) {
            float m = -INFINITY;
            for (int t = lo; t <= hi; t++)
                m = scores[t] > m ? scores[t] : m;
            out[j] = m;
        } else {
            double s = 0;
            for (int t = lo; t <= hi; t++)
                s += scores[t];
            out[j] = (float)(s / k);
        }
    }
}
