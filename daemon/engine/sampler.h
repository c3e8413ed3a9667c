/* Next-token sampling from logits: greedy, temperature, top-k, top-p, seeded and
 * reproducible (the same seed and logits give the same tokens on every host). */
#ifndef SKV_SAMPLER_H
#define SKV_SAMPLER_H

#include <stdbool.h>
#include <stdint.h>

struct skv_sampler_params {
    float temperature;  /* <= 0: greedy */
    int top_k;          /* <= 0: off */
    float top_p;        /* <= 0 or >= 1: off */
    uint64_t seed;
};

struct skv_sampler {
    struct skv_sampler_params p;
    uint64_t state;     /* xoshiro-style 64-bit state (splitmix64) */
    int n_vocab;
    int32_t *idx;       /* scratch [n_vocab] */
    float *prob;        /* scratch [n_vocab] */
};

/* Validates params (SKV_E_INVAL for NaN or negative values, top_p > 1). */
int skv_sampler_init(struct skv_sampler *s, const struct skv_sampler_params *p, int n_vocab);
void skv_sampler_fini(struct skv_sampler *s);
/* Picks a token; logits are not modified. Greedy ties go to the lowest id. */
int32_t skv_sampler_sample(struct skv_sampler *s, const float *logits);
/* argmax with ties to the lowest id. */
int32_t skv_argmax(const float *logits, int n);

#endif
