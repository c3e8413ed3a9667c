/* RoPE's per-pair inverse frequencies, computed on the host in double precision; every
 * backend builds its rotation from this one function. */
#include <math.h>

#include "kernels/backend.h"

#define ROPE_TWO_PI 6.283185307179586476925286766559

/* Llama 3 scaling as HF transformers' _compute_llama3_parameters defines it: long
 * wavelengths divided by the factor, short ones kept, the band between interpolated
 * smoothly. */
static void llama3_scale(const struct skv_rope *r, int half, double *inv_freq)
{
    const double factor = r->l3_factor, lo = r->l3_low_freq_factor, hi = r->l3_high_freq_factor;
    const double old_ctx = r->l3_original_ctx;
    const double low_freq_wavelen = old_ctx / lo, high_freq_wavelen = old_ctx / hi;
    for (int j = 0; j < half; j++) {
        const double f = inv_freq[j], wavelen = ROPE_TWO_PI / f;
        if (wavelen > low_freq_wavelen) {
            inv_freq[j] = f / factor;
        } else if (wavelen >= high_freq_wavelen) {
            const double smooth = (old_ctx / wavelen - lo) / (hi - lo);
            inv_freq[j] = (1.0 - smooth) * f / factor + smooth * f;
        }
    }
}

/* Inverse frequencies theta^(-2j/rot_dim), then Llama 3 scaling, then per-pair factors as
 * llama.cpp's ggml_rope_ext applies rope_freqs.weight (the angle of pair j is
 * p * inv_freq_j / freq_factors[j]; llama.cpp's Llama 3.1 converter stores the llama3 rule
 * as these factors instead of scaling keys). */
void skv_rope_inv_freq(const struct skv_rope *r, int half, double *inv_freq)
{
    for (int j = 0; j < half; j++)
        inv_freq[j] = pow((double)r->theta, -2.0 * j / (2.0 * half));
    if (r->l3_factor != 0.0f)
        llama3_scale(r, half, inv_freq);
    if (r->freq_factors)
        for (int j = 0; j < half; j++)
            inv_freq[j] /= (double)r->freq_factors[j];
}

bool skv_rope_factors_valid(const struct skv_rope *r, int half)
{
    for (int j = 0; r->freq_factors && j < half; j++)
        if (!isfinite(r->freq_factors[j]) || !(r->freq_factors[j] > 0.0f))
            return false;
    return true;
}
