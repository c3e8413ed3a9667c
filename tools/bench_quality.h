/* snapkv-bench quality: the compression quality benchmark (passkey retrieval and next-token
 * fidelity against the full cache), writing JSON, markdown and gnuplot PNGs. One entry point
 * that tools/snapkv-bench.c calls. */
#ifndef SKV_BENCH_QUALITY_H
#define SKV_BENCH_QUALITY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct skv_engine;
struct skv_model;

struct skv_quality_opts {
    const char *task;          /* "passkey", "fidelity" or "all" */
    const char *lengths;       /* passkey prompt lengths in tokens, "512,1024,..." */
    const char *depths;        /* passkey depth in percent of the filler, "0,50,100" */
    const char *specs;         /* "SPEC;SPEC;..."; the full cache is always the baseline */
    int trials;                /* keys per (length, depth); <= 0: 2 */
    uint64_t seed;
    int max_tokens;            /* passkey greedy answer tokens; <= 0: 8 */
    int passkey_style;         /* prompt phrasing (index, see --help); < 0: the default */
    const char *texts;         /* fidelity texts, comma-separated; NULL: the committed ones */
    const char *srcdir;        /* where the committed texts live (NULL: $SKV_SRCDIR or ".") */
    int fid_prefill;           /* N: prompt tokens prefilled compressed; <= 0: 4096 */
    int fid_tokens;            /* M: tokens teacher-forced and generated; <= 0: 64 */
    const char *out_dir;       /* NULL: ./quality-out */
    bool json_stdout;          /* the whole result as JSON on stdout */
    int argc;                  /* the command line, recorded in the outputs */
    char **argv;
};

/* Runs the benchmark; progress goes to stderr. Returns SKV_OK or a status with
 * skv_error_msg() set. */
int skv_bench_quality(struct skv_engine *e, struct skv_model *m, const struct skv_quality_opts *o);

/* n bytes of text (a model's, so not always UTF-8) as a JSON string: ill-formed parts become
 * U+FFFD (jansson refuses them, and a refused string dropped its key or the whole output). */
struct json_t;
struct json_t *skv_bench_json_text(const char *s, size_t n);

/* The passkey prompt phrasings (for --help and the report): count and a one-line summary. */
int skv_bench_quality_n_styles(void);
const char *skv_bench_quality_style_desc(int style);

#endif
