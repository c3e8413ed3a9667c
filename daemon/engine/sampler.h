/* Next-token sampling from logits: logit bias and repetition / frequency / presence penalties,
 * then greedy or temperature, top-k, top-p, min-p; seeded and reproducible (the same seed and
 * logits give the same tokens on every host). */
#ifndef SKV_SAMPLER_H
#define SKV_SAMPLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SKV_LOGIT_BIAS_MAX 1024u /* logit_bias entries one DECODE may give */

/* What changes the logits before a token is picked, in this order (that of transformers'
 * generate, with vLLM's frequency and presence penalties; the history is what the caller knows,
 * for a daemon session its token history: an imported session's begins at the import):
 * 1. logit bias: bias[i] is added to the logit of token bias_ids[i];
 * 2. repetition penalty (transformers' RepetitionPenaltyLogitsProcessor, the CTRL paper): the
 *    logit of each token the history holds (its last repetition_last_n tokens; 0: all of it) is
 *    divided by the penalty when positive, multiplied by it when negative;
 * 3. frequency and presence penalties (OpenAI's and vLLM's), over the tokens this decode
 *    generated: logit -= count * frequency_penalty + (count > 0) * presence_penalty;
 * then, when sampling, temperature, top-k, top-p and min-p (transformers' MinPLogitsWarper:
 * of the tokens top-k and top-p left, those less likely than min_p times the likeliest go). */
struct skv_sampler_params {
    float temperature;  /* 0: greedy; at most 100 */
    int top_k;          /* 0: off; tokens tied with the k-th stay too (transformers' rule) */
    float top_p;        /* 0 or 1: off */
    uint64_t seed;      /* 0 too: the same seed gives the same stream */
    float min_p;                /* 0: off; at most 1 */
    float repetition_penalty;   /* 0 or 1: off; else 0.01 to 100 */
    int repetition_last_n;      /* 0: the whole history */
    float frequency_penalty;    /* 0: off; -2 to 2 */
    float presence_penalty;     /* 0: off; -2 to 2 */
    const int32_t *bias_ids;    /* [n_bias] distinct tokens (copied by skv_sampler_init) */
    const float *bias;          /* [n_bias] -100 to 100 */
    size_t n_bias;
};

struct skv_sampler {
    struct skv_sampler_params p; /* bias_ids and bias point at the sampler's copies */
    uint64_t state;     /* xoshiro-style 64-bit state (splitmix64) */
    int n_vocab;
    int32_t *idx;       /* scratch [n_vocab] */
    float *prob;        /* scratch [n_vocab] */
    bool adjusts;       /* some bias or penalty is on */
    float *adj;         /* [n_vocab] the adjusted logits (when adjusts) */
    uint32_t *count;    /* [n_vocab] zero between calls (when adjusts) */
};

/* Validates params (SKV_E_INVAL with a message for NaN values or values out of their ranges, a
 * bias for a token outside the vocabulary or two for one token; SKV_E_LIMIT past
 * SKV_LOGIT_BIAS_MAX biases). */
int skv_sampler_init(struct skv_sampler *s, const struct skv_sampler_params *p, int n_vocab);
void skv_sampler_fini(struct skv_sampler *s);
/* Picks a token from logits alone (no history: bias only, penalties see nothing); logits are
 * not modified. Greedy ties go to the lowest id. */
int32_t skv_sampler_sample(struct skv_sampler *s, const float *logits);
/* Picks a token after the bias and penalties: history is every token before the next one (a
 * session's prompt, appends and generated tokens; the repetition penalty's), generated this
 * decode's tokens so far (the frequency and presence penalties'). Ids outside the vocabulary
 * are ignored. logits are not modified. */
int32_t skv_sampler_next(struct skv_sampler *s, const float *logits, const int32_t *history, int n_history,
                         const int32_t *generated, int n_generated);
/* The logits after the bias and penalties (s's scratch, or logits itself when none is on). */
const float *skv_sampler_adjust(struct skv_sampler *s, const float *logits, const int32_t *history,
                                int n_history, const int32_t *generated, int n_generated);
/* The tokens temperature, top-k, top-p and min-p leave of (adjusted) logits when sampling:
 * returns how many; s->idx[0..n) holds them (most likely first when top-k or top-p is on, else
 * by id) and s->prob their weights (exp((logit - max) / temperature), not normalized), *mass
 * the weights' sum. Needs temperature > 0 and a finite largest logit. */
int skv_sampler_candidates(struct skv_sampler *s, const float *logits, double *mass);
/* argmax with ties to the lowest id. */
int32_t skv_argmax(const float *logits, int n);

/* Log-probabilities under the distribution n logits give (their log-softmax in double: x - m -
 * log(sum exp(x - m)), m the largest; a NaN logit counts as -inf): *token_lp gets token's, and
 * with top_n > 0 top_ids / top_lp get the min(top_n, n) most likely tokens and theirs, most
 * likely first, equal ones by id; returns how many. When some logits are +inf those k tokens
 * share the mass (log(1 / k) each) and the rest get -inf; with every logit -inf or NaN there is
 * no distribution and every token gets -inf. */
#define SKV_TOP_LOGPROBS_MAX 20u /* top_logprobs one DECODE may ask for */

/* KL(P || Q) in nats between the distributions two sets of n logits give (log-softmax in
 * double). Tokens P gives no probability (logit -inf) add nothing. SKV_E_INVAL when either is
 * no distribution (a NaN or +inf logit, or every logit -inf), or when Q gives no probability
 * to a token P does (the divergence is infinite): a broken cache is never scored as a perfect
 * one. */
int skv_kl_logits(const float *p, const float *q, int n, double *out);
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
