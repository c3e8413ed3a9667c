/* A loaded Llama-family model: hyper-parameters, weights (views into the mapped GGUF or
 * safetensors files, or dequantized copies in reference mode) and the tokenizer.
 * Architectures: llama (Llama 2/3, SmolLM2, Mistral with its sliding window) and qwen2
 * (q/k/v bias, optional sliding-window layers). */
#ifndef SKV_MODEL_H
#define SKV_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "kernels/backend.h"

struct skv_tokenizer;

struct skv_model_config {
    char arch[32];          /* "llama", "qwen2" */
    int n_layers;           /* L */
    int dim;                /* hidden size */
    int n_heads;            /* H */
    int n_kv_heads;         /* Hkv */
    int head_dim;           /* d */
    int ffn_dim;
    int n_vocab;
    int max_ctx;            /* trained context length */
    float norm_eps;
    struct skv_rope rope;
    int sliding_window;     /* W of the sliding-window layers (0: none); see layer window */
    bool tied_output;       /* output matrix is the token embedding */
    bool qkv_bias;
};

struct skv_layer_weights {
    struct skv_tensor attn_norm;   /* (dim) f32 */
    struct skv_tensor wq;          /* (dim -> n_heads * head_dim) */
    struct skv_tensor wk;          /* (dim -> n_kv_heads * head_dim) */
    struct skv_tensor wv;          /* (dim -> n_kv_heads * head_dim) */
    struct skv_tensor wo;          /* (n_heads * head_dim -> dim) */
    struct skv_tensor bq, bk, bv;  /* biases (qwen2), data NULL when absent; f32 */
    struct skv_tensor ffn_norm;    /* (dim) f32 */
    struct skv_tensor w_gate;      /* (dim -> ffn_dim) */
    struct skv_tensor w_up;        /* (dim -> ffn_dim) */
    struct skv_tensor w_down;      /* (ffn_dim -> dim) */
    int window;                    /* this layer's sliding window: a query at position p sees
                                    * keys at positions > p - window; 0: full causal */
};

struct skv_model {
    struct skv_model_config cfg;
    struct skv_backend *be;        /* not owned */
    struct skv_tensor tok_embd;    /* (dim) x n_vocab rows */
    struct skv_tensor output_norm; /* (dim) f32 */
    struct skv_tensor output;      /* (dim -> n_vocab); == tok_embd when tied */
    struct skv_layer_weights *layers; /* [n_layers] */
    struct skv_tokenizer *tok;     /* NULL when the file has no tokenizer, or one of a kind not
                                      supported (tok_note then says which: requests carry ids) */
    char tok_note[256];
    char name[128];
    char fingerprint[65];          /* sha256 hex of what makes its KV: the tensors (names, shapes,
                                    * types, offsets, first bytes), the file size and, for GGUF,
                                    * the config its metadata gives (rope, eps, heads, windows) */
    char legacy_fingerprint[65];   /* the same without that config, as daemons before the
                                    * forty-fifth session named GGUF models (for HF folders, whose
                                    * config.json was always in it: the fingerprint): their SAVE
                                    * files, block stores and store keys are still taken */
    char path[1024];
    bool reference;                /* weights dequantized to f32 */
    void *impl;                    /* loader state (mapped files, owned buffers) */
    struct skv_kv_pool *kv_pool;      /* KV blocks of this model's caches (daemon/engine/kv_pool.h) */
};

struct skv_model_opts {
    bool reference;                /* dequantize every weight to f32 at load */
};

/* Loads a GGUF file or a Hugging Face folder (config.json + *.safetensors [+ tokenizer.json]).
 * opts may be NULL (fast mode). Returns SKV_OK or a status with skv_error_msg() set. */
int skv_model_load(const char *path, struct skv_backend *be, const struct skv_model_opts *opts,
                   struct skv_model **out);
void skv_model_free(struct skv_model **model_p);
/* Gives the model a new KV pool of `rows` rows per block (> 0) for the caches made from now
 * on; caches made before keep the pool they hold. */
int skv_model_set_kv_block_rows(struct skv_model *m, int rows);
/* The same with the KV type of its rows too: SKV_DTYPE_F32 (the default), SKV_DTYPE_F16 (half
 * the bytes) or SKV_DTYPE_Q8_0 (17/64 of the bytes; head_dim a multiple of 32): SKV_E_UNSUPPORTED
 * on a backend without the type's store op. */
int skv_model_set_kv_pool(struct skv_model *m, int rows, int kv_type);

static inline const struct skv_model_config *skv_model_config(const struct skv_model *m)
{
    return &m->cfg;
}
static inline const char *skv_model_name(const struct skv_model *m)
{
    return m->name;
}

#endif
