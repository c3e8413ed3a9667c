/* A compression spec: the key=value string users write (CLI, config file, protocol, client
 * helper) parsed into one validated struct, and formatted back. */
#ifndef SKV_COMPRESS_SPEC_H
#define SKV_COMPRESS_SPEC_H

#include <stdbool.h>
#include <stddef.h>

enum skv_policy { SKV_POLICY_FULL, SKV_POLICY_SNAPKV, SKV_POLICY_H2O, SKV_POLICY_STREAMING, SKV_POLICY_WINDOW };
enum skv_alloc { SKV_ALLOC_UNIFORM, SKV_ALLOC_SQUEEZE, SKV_ALLOC_PYRAMID };
enum skv_pool { SKV_POOL_MAX, SKV_POOL_AVG };
enum skv_gqa { SKV_GQA_MEAN, SKV_GQA_MAX };
enum skv_granularity { SKV_GRAN_LAYER, SKV_GRAN_HEAD };

struct skv_compress_spec {
    enum skv_policy policy;
    enum skv_alloc alloc;
    int budget;           /* tokens per layer and KV head; 0 when ratio is used */
    double ratio;         /* fraction of the prompt; < 0 when budget is used */
    int min_budget;       /* with ratio: at least this many tokens per layer and head (0: none) */
    int window;           /* observation window (snapkv), recent window (h2o) */
    int kernel;           /* pooling kernel (odd) */
    enum skv_pool pool;
    enum skv_gqa gqa;
    enum skv_granularity granularity;
    int sinks;            /* streaming */
    double p;             /* squeeze: budget fraction of the least important layer cluster */
    int pyramid_beta;     /* pyramid: min budget = (B - w) / beta */
    int decode_budget;    /* rows per head kept while decoding (0: policy default) */
    int interval;         /* decode: re-score every `interval` tokens */
};

#define SKV_SPEC_MAX_BUDGET (1 << 24)

/* Defaults: policy=full, alloc=uniform, ratio 1, window 32, kernel 7, pool max, gqa mean,
 * granularity layer, sinks 4, p 0.3, beta 20, interval 64. */
void skv_compress_spec_default(struct skv_compress_spec *spec);
/* Parses "policy=snapkv,ratio=0.1,..." over the defaults. Unknown keys, repeated keys, bad
 * values and a key set (to other than its default) that the policy and allocator do not read
 * are SKV_E_INVAL with skv_error_msg() naming the key; *spec is written only on success. */
/* The longest spec text skv_compress_spec_parse takes. */
#define SKV_SPEC_MAX_CHARS 1024
int skv_compress_spec_parse(const char *text, struct skv_compress_spec *spec);
/* The same, also taking a key the spec's policy and allocator do not read (which
 * skv_compress_spec_parse refuses: `policy=h2o,kernel=11`), as specs saved by a daemon from
 * before that check may hold: for the spec text of SAVE files and sessions, never a client's. */
int skv_compress_spec_parse_saved(const char *text, struct skv_compress_spec *spec);
/* Canonical text of a spec (every key); returns SKV_OK or SKV_E_LIMIT when cap is too small. */
int skv_compress_spec_format(const struct skv_compress_spec *spec, char *buf, size_t cap);
/* The same spec with only the keys that differ from the defaults (policy and size always), a
 * spec that parses back to it: short enough for a listing's column. SKV_E_LIMIT as above. */
int skv_compress_spec_format_short(const struct skv_compress_spec *spec, char *buf, size_t cap);
/* The per-layer-and-head budget for a prompt of n tokens: budget, or ceil(ratio * n) raised
 * to min_budget, at least 1, at most n. */
int skv_compress_spec_budget(const struct skv_compress_spec *spec, int n);

const char *skv_policy_name(enum skv_policy p);
const char *skv_alloc_name(enum skv_alloc a);

#endif
