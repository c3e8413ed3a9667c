/* Next-token sampling from logits: greedy, temperature, top-k, top-p, seeded and
 * reproducible (the same seed and logits give the same tokens on every host). */
#ifndef SKV_SAMPLER_H
#define SKV_SAMPLER_H

#include <stdbool.h>
#include <stddef.h>
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

/* Log-probabilities under the distribution n logits give (their log-softmax in double: x - m -
 * log(sum exp(x - m)), m the largest; a NaN logit counts as -inf): *token_lp gets token's, and
 * with top_n > 0 top_ids / top_lp get the min(top_n, n) most likely tokens and theirs, most
 * likely first, equal ones by id; returns how many. When some logits are +inf those k tokens
 * share the mass (log(1 / k) each) and the rest get -inf; with every logit -inf or NaN there is
 * no distribution and every token gets -inf. */
#define SKV_TOP_LOGPROBS_MAX 20u /* top_logprobs one DECODE may ask for */
int skv_logprobs(const float *logits, int n, int32_t token, int top_n, float *token_lp, int32_t *top_ids,
                 float *top_lp);

/* Stop sequences over a decode's text: the text is fed as it is generated; what can no longer
 * begin a stop sequence is released, a suffix that still could is held back, and a complete
 * sequence ends the text just before it (the earliest one where several complete). */
#define SKV_STOP_STRINGS_MAX 16u   /* stop sequences one DECODE may name */
#define SKV_STOP_STRING_BYTES 256u /* the longest one */
struct skv_stop_text {
    char *stop[SKV_STOP_STRINGS_MAX];
    size_t len[SKV_STOP_STRINGS_MAX];
    size_t n;
    char hold[SKV_STOP_STRING_BYTES]; /* a suffix of the text that begins some sequence */
    size_t n_hold;
};
/* SKV_E_LIMIT past SKV_STOP_STRINGS_MAX sequences or SKV_STOP_STRING_BYTES bytes in one,
 * SKV_E_INVAL for an empty one, with a message; else SKV_OK. */
int skv_stop_text_check(const char *const *stop, size_t n);
/* Copies n sequences (refused as skv_stop_text_check refuses them). n = 0: nothing ever stops
 * or is held. */
int skv_stop_text_init(struct skv_stop_text *st, const char *const *stop, size_t n);
void skv_stop_text_fini(struct skv_stop_text *st);
/* Feeds len bytes of new text. out (room for n_hold + len + 1 bytes) receives the text
 * released, *n_out bytes, NUL-terminated. Returns true when a sequence completed: out is the
 * text before it, and nothing stays held. */
bool skv_stop_text_feed(struct skv_stop_text *st, const char *text, size_t len, char *out, size_t *n_out);
/* Appends the held-back text to out (room for SKV_STOP_STRING_BYTES bytes, NUL added) and
 * empties it: a decode that ends otherwise releases it. Returns its length. */
size_t skv_stop_text_flush(struct skv_stop_text *st, char *out);

#endif
