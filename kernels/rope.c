/* RoPE's per-pair inverse frequencies, computed on the host in double precision; every
 * backend builds its rotation from this one function. */
#include <math.h>

#include "common/status.h"
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

int skv_rope_check(const struct skv_rope *r, int head_dim)
{
    if (r->mode != SKV_ROPE_NORM && r->mode != SKV_ROPE_NEOX)
        return skv_errorf(SKV_E_INVAL, "rope: unknown mode %d", r->mode);
    if (r->rot_dim <= 0 || r->rot_dim % 2 != 0 || r->rot_dim > head_dim || r->rot_dim > SKV_ROPE_MAX_DIM)
        return skv_errorf(SKV_E_INVAL, "rope: rot_dim %d with head_dim %d", r->rot_dim, head_dim);
    if (!(r->theta > 0.0f) || !isfinite(r->theta) || !(r->freq_scale > 0.0f) || !isfinite(r->freq_scale))
        return skv_errorf(SKV_E_INVAL, "rope: theta %g freq_scale %g", (double)r->theta, (double)r->freq_scale);
    if (r->l3_factor != 0.0f &&
        (!(r->l3_factor > 0.0f) || !(r->l3_low_freq_factor > 0.0f) ||
         !(r->l3_high_freq_factor > r->l3_low_freq_factor) || r->l3_original_ctx <= 0))
        return skv_errorf(SKV_E_INVAL, "rope: llama3 scaling factor %g low %g high %g original ctx %d",
                          (double)r->l3_factor, (double)r->l3_low_freq_factor, (double)r->l3_high_freq_factor,
                          r->l3_original_ctx);
    if (!skv_rope_factors_valid(r, r->rot_dim / 2))
        return skv_errorf(SKV_E_INVAL, "rope: a frequency factor is not a finite value > 0");
    return SKV_OK;
}
