/* snapkv-bench serve: the daemon benchmark — round-trip latency, N client processes through
 * snapkvd against the in-process engine, KV pool capacity per compression spec, and aggregate
 * decode throughput of concurrent long sessions. One entry point that tools/snapkv-bench.c calls. */
#ifndef SKV_BENCH_SERVE_H
#define SKV_BENCH_SERVE_H

#include <stdbool.h>

struct skv_engine;
struct skv_model;

struct skv_serve_opts {
    const char *endpoint;        /* client endpoint; NULL: start a snapkvd child */
    const char *admin_endpoint;  /* admin endpoint (required with endpoint) */
    const char *argv0;           /* the child is <dir of argv0>/snapkvd */
    const char *model_path;      /* the child's --model */
    int threads;                 /* the child's --threads (0: all online CPUs) */
    const char *kv_type;         /* the child's --kv-type (NULL: its default, f32) */
    int clients;                 /* client processes of the throughput run; <= 0: 8 */
    int requests;                /* requests per client; <= 0: 4 */
    int context;                 /* long-session prompt tokens; <= 0: 4096 */
    int sessions;                /* concurrent long sessions decoding; <= 0: 16 */
    int decode_tokens;           /* tokens each long session decodes; <= 0: 32 */
    bool sessions_fit;           /* decode as many sessions per spec as the capacity run held */
    double pool_gib;             /* the capacity part's pool; <= 0: 1 GiB */
    const char *specs;           /* "SPEC;SPEC;..." compared (first: baseline); NULL: full,
                                  * snapkv 10%, squeeze+snapkv 10% */
    const char *parts;           /* comma list of roundtrip,throughput,capacity,decode,stall; NULL: all */
    bool store_signed;           /* the store part's daemons sign their values (store-secret-file) */
    bool json_stdout;            /* JSON on stdout, the table on stderr */
    int argc;                    /* the command line, recorded in the JSON */
    char **argv;
};

/* Runs the benchmark; progress goes to stderr. Returns SKV_OK or a status with
 * skv_error_msg() set. */
int skv_bench_serve(struct skv_engine *e, struct skv_model *m, const struct skv_serve_opts *o);

#endif
