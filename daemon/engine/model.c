/* Model loading: GGUF files and Hugging Face folders become one struct skv_model.
 * Maps each format's tensor names and hyper-parameters onto the Llama-family layout the
 * engine runs, checks every shape, and in reference mode dequantizes weights to f32. */
#include "daemon/engine/model.h"
#include "common/status.h"
#include "common/utf8.h"
#include "daemon/engine/gguf.h"
#include "daemon/engine/kv_pool.h"
#include "daemon/engine/safetensors.h"
#include "daemon/engine/tokenizer.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* Loader state behind model->impl. */
struct model_impl {
    struct skv_gguf *gguf;
    struct skv_safetensors *st;
    void **owned;        /* backend buffers this model allocated (f32 copies) */
    int n_owned, cap_owned;
    float *rope_factors; /* [rot_dim / 2] host copy of GGUF rope_freqs.weight, or NULL */
    const struct skv_tensor **taken; /* the file's tensors the weights use (map_weights) */
    int n_taken, cap_taken;
};

static int own(struct skv_model *m, void *ptr)
{
    struct model_impl *impl = m->impl;
    if (impl->n_owned == impl->cap_owned) {
        int cap = impl->cap_owned ? impl->cap_owned * 2 : 64;
        void **p = realloc(impl->owned, (size_t)cap * sizeof *p);
        if (!p)
            return SKV_E_NOMEM;
        impl->owned = p;
        impl->cap_owned = cap;
    }
    impl->owned[impl->n_owned++] = ptr;
    return SKV_OK;
}

/* Backend memory the model made for a weight: kept (own) when rc is SKV_OK, else freed;
 * returns the status. */
static int keep_or_free(struct skv_model *m, void *dev, int rc)
{
    if (!rc)
        rc = own(m, dev);
    if (rc && dev)
        m->be->ops->free(m->be, dev);
    return rc;
}

static int64_t tensor_elems(const struct skv_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->ne[i];
    return n;
}

/* Replaces t's data by an f32 copy in backend memory (dequantizing / widening). */
static int to_f32(struct skv_model *m, struct skv_tensor *t)
{
    if (t->type == SKV_DTYPE_F32 && !m->reference && strcmp(m->be->name, "cpu") == 0)
        return SKV_OK; /* the CPU reads f32 straight from the mapped file */
    if (!skv_dtype_supported(t->type))
        return skv_errorf(SKV_E_UNSUPPORTED, "tensor %s: type %s is not supported", t->name,
                          skv_dtype_name(t->type) ? skv_dtype_name(t->type) : "?");
    int64_t n = tensor_elems(t);
    int64_t row = t->ne[0];
    float *host = malloc((size_t)n * sizeof *host);
    if (!host)
        return SKV_E_NOMEM;
    size_t row_bytes = skv_dtype_row_bytes(t->type, row);
    int rc = SKV_OK;
    for (int64_t r = 0; r < n / row && rc == SKV_OK; r++)
        rc = skv_dequantize_row(t->type, (const char *)t->data + r * row_bytes, host + r * row, row);
    void *dev = NULL;
    if (rc == SKV_OK)
        rc = m->be->ops->alloc(m->be, (size_t)n * sizeof(float), &dev);
    if (rc == SKV_OK)
        rc = m->be->ops->upload(m->be, dev, host, (size_t)n * sizeof(float));
    free(host);
    if ((rc = keep_or_free(m, dev, rc)))
        return rc;
    t->type = SKV_DTYPE_F32;
    t->data = dev;
    t->nbytes = (size_t)n * sizeof(float);
    return SKV_OK;
}

/* Copies a matrix of a type the backend does not multiply with into backend memory as f16,
 * some rows at a time; a value past f16's range (65504: a quantized block's scale can reach
 * millions) is refused, which would be infinite there and NaN every row it touches. */
static int to_device_f16(struct skv_model *m, struct skv_tensor *t)
{
    const int64_t cols = t->ne[0], rows = t->ndim > 1 ? t->ne[1] : 1;
    const size_t row_bytes = skv_dtype_row_bytes(t->type, cols);
    if (!row_bytes || row_bytes * (size_t)rows != t->nbytes)
        return skv_errorf(SKV_E_FORMAT, "tensor %s: %zu bytes for %lld rows of %lld %s", t->name ? t->name : "?",
                          t->nbytes, (long long)rows, (long long)cols, skv_dtype_name(t->type));
    const int64_t chunk = cols > 0 && cols < (1 << 18) ? (1 << 18) / cols + 1 : 1; /* rows a step */
    float *f = malloc((size_t)cols * sizeof *f);
    uint16_t *h = malloc((size_t)(chunk * cols) * sizeof *h);
    void *dev = NULL;
    int rc = f && h ? m->be->ops->alloc(m->be, (size_t)(rows * cols) * sizeof *h, &dev)
                    : skv_errorf(SKV_E_NOMEM, "tensor %s: no memory to convert it to f16", t->name ? t->name : "?");
    for (int64_t r0 = 0; !rc && r0 < rows; r0 += chunk) {
        int64_t n = rows - r0 < chunk ? rows - r0 : chunk;
        for (int64_t r = 0; !rc && r < n; r++) {
            rc = skv_dequantize_row(t->type, (const uint8_t *)t->data + (size_t)(r0 + r) * row_bytes, f, cols);
            for (int64_t i = 0; !rc && i < cols; i++) {
                if (!(fabsf(f[i]) <= 65504.0f))
                    rc = skv_errorf(SKV_E_FORMAT,
                                    "tensor %s: a weight of %g (row %lld) is past f16's range, to which the %s "
                                    "backend's copy of a %s matrix is converted",
                                    t->name ? t->name : "?", (double)f[i], (long long)(r0 + r), m->be->name,
                                    skv_dtype_name(t->type));
                h[r * cols + i] = skv_f32_to_fp16(f[i]);
            }
        }
        if (!rc)
            rc = m->be->ops->upload(m->be, (uint16_t *)dev + r0 * cols, h, (size_t)(n * cols) * sizeof *h);
    }
    free(h);
    free(f);
    if ((rc = keep_or_free(m, dev, rc)))
        return rc;
    t->type = SKV_DTYPE_F16;
    t->data = dev;
    t->nbytes = (size_t)(rows * cols) * sizeof(uint16_t);
    return SKV_OK;
}

/* Copies t's bytes (any dtype) into backend memory: weights live on the device for every
 * backend but the CPU, which reads the mapped file directly. A type the backend does not take
 * is converted to f16 on the way. */
static int to_device(struct skv_model *m, struct skv_tensor *t)
{
    if (!t->data || strcmp(m->be->name, "cpu") == 0)
        return SKV_OK;
    if (m->be->ops->weight_type_ok && !m->be->ops->weight_type_ok(t->type))
        return to_device_f16(m, t);
    void *dev = NULL;
    int rc = m->be->ops->alloc(m->be, t->nbytes, &dev);
    if (!rc)
        rc = m->be->ops->upload(m->be, dev, t->data, t->nbytes);
    if ((rc = keep_or_free(m, dev, rc)))
        return rc;
    t->data = dev;
    return SKV_OK;
}

/* Checks t's shape: ne0 x ne1 (ne1 == 0: a vector of ne0). */
static int check_shape(const struct skv_tensor *t, int64_t ne0, int64_t ne1)
{
    bool ok = ne1 ? (t->ndim == 2 && t->ne[0] == ne0 && t->ne[1] == ne1)
                  : (t->ndim == 1 && t->ne[0] == ne0);
    if (!ok)
        return skv_errorf(SKV_E_FORMAT, "tensor %s: shape [%lld, %lld] where [%lld, %lld] was expected",
                          t->name ? t->name : "?", (long long)t->ne[0],
                          (long long)(t->ndim > 1 ? t->ne[1] : 0), (long long)ne0, (long long)ne1);
    if (!skv_dtype_supported(t->type))
        return skv_errorf(SKV_E_UNSUPPORTED, "tensor %s: type %s is not supported", t->name,
                          skv_dtype_name(t->type) ? skv_dtype_name(t->type) : "?");
    return SKV_OK;
}

/* The model's name goes out in HELLO and STATUS replies, UTF-8 `string` fields, but comes from
 * a GGUF's metadata or a path: ill-formed parts and NUL become U+FFFD, and it is cut at a
 * character's end within the field. */
static void set_name(struct skv_model *m, const char *s, size_t n)
{
    if (n > sizeof m->name + 3)
        n = sizeof m->name + 3; /* a part gives at least its bytes, and a character is at most 4 */
    size_t len;
    char *fixed = skv_utf8_fix(s, n, &len);
    if (!fixed) {
        snprintf(m->name, sizeof m->name, "model");
        return;
    }
    if (len >= sizeof m->name)
        len = sizeof m->name - 1;
    while (len && ((unsigned char)fixed[len] & 0xC0) == 0x80)
        len--; /* back to a character's first byte within the field */
    memcpy(m->name, fixed, len);
    m->name[len] = '\0';
    free(fixed);
}

typedef const struct skv_tensor *(*find_fn)(const struct skv_model *m, const char *name);

static const struct skv_tensor *find_gguf(const struct skv_model *m, const char *name)
{
    return skv_gguf_find_tensor(((struct model_impl *)m->impl)->gguf, name);
}

static const struct skv_tensor *find_st(const struct skv_model *m, const char *name)
{
    return skv_safetensors_find(((struct model_impl *)m->impl)->st, name);
}

/* Tensor names of one format: printf patterns with the layer number. */
struct name_map {
    const char *tok_embd, *output_norm, *output;
    const char *attn_norm, *wq, *wk, *wv, *wo, *bq, *bk, *bv, *ffn_norm, *w_gate, *w_up, *w_down;
};

static const struct name_map gguf_names = {
    "token_embd.weight", "output_norm.weight", "output.weight",
    "blk.%d.attn_norm.weight", "blk.%d.attn_q.weight", "blk.%d.attn_k.weight",
    "blk.%d.attn_v.weight", "blk.%d.attn_output.weight", "blk.%d.attn_q.bias",
    "blk.%d.attn_k.bias", "blk.%d.attn_v.bias", "blk.%d.ffn_norm.weight",
    "blk.%d.ffn_gate.weight", "blk.%d.ffn_up.weight", "blk.%d.ffn_down.weight",
};

static const struct name_map hf_names = {
    "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
    "model.layers.%d.input_layernorm.weight", "model.layers.%d.self_attn.q_proj.weight",
    "model.layers.%d.self_attn.k_proj.weight", "model.layers.%d.self_attn.v_proj.weight",
    "model.layers.%d.self_attn.o_proj.weight", "model.layers.%d.self_attn.q_proj.bias",
    "model.layers.%d.self_attn.k_proj.bias", "model.layers.%d.self_attn.v_proj.bias",
    "model.layers.%d.post_attention_layernorm.weight", "model.layers.%d.mlp.gate_proj.weight",
    "model.layers.%d.mlp.up_proj.weight", "model.layers.%d.mlp.down_proj.weight",
};

/* Finds a tensor by pattern and layer, copies its descriptor into *dst and checks the shape.
 * optional: a missing tensor leaves dst zeroed and returns SKV_OK. */
static int take(struct skv_model *m, find_fn find, const char *pattern, int layer, struct skv_tensor *dst,
                int64_t ne0, int64_t ne1, bool optional)
{
    char name[256];
    snprintf(name, sizeof name, pattern, layer);
    const struct skv_tensor *t = find(m, name);
    memset(dst, 0, sizeof *dst);
    if (!t)
        return optional ? SKV_OK : skv_errorf(SKV_E_NOT_FOUND, "tensor %s is missing", name);
    struct model_impl *impl = m->impl;
    if (impl->n_taken == impl->cap_taken) {
        int cap = impl->cap_taken ? 2 * impl->cap_taken : 64;
        const struct skv_tensor **more = realloc(impl->taken, (size_t)cap * sizeof *more);
        if (!more)
            return skv_errorf(SKV_E_NOMEM, "out of memory for the tensor list");
        impl->taken = more;
        impl->cap_taken = cap;
    }
    impl->taken[impl->n_taken++] = t;
    *dst = *t;
    return check_shape(dst, ne0, ne1);
}

static int by_address(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t)*(const struct skv_tensor *const *)a, y = (uintptr_t)*(const struct skv_tensor *const *)b;
    return x < y ? -1 : x > y;
}

/* Refuses a file with a tensor the engine would not use (an o_proj or MLP bias, experts, a
 * norm this architecture does not have...): the weights it holds change what the model
 * computes, and leaving them out would give other logits without a word. `ignore`: name
 * endings that carry nothing the forward needs (or that the loader read itself). */
static int check_all_used(struct skv_model *m, int64_t n, const struct skv_tensor *(*tensor)(const void *, int64_t),
                          const void *file, const char *const *ignore, const char *what)
{
    struct model_impl *impl = m->impl;
    qsort(impl->taken, (size_t)impl->n_taken, sizeof *impl->taken, by_address);
    int64_t unused = 0;
    const char *first = NULL;
    for (int64_t i = 0; i < n; i++) {
        const struct skv_tensor *t = tensor(file, i);
        if (bsearch(&t, impl->taken, (size_t)impl->n_taken, sizeof *impl->taken, by_address))
            continue;
        bool skip = false;
        const char *name = t->name ? t->name : "";
        for (const char *const *ig = ignore; *ig && !skip; ig++) {
            size_t a = strlen(name), b = strlen(*ig);
            skip = a >= b && strcmp(name + a - b, *ig) == 0;
        }
        if (!skip && !unused++)
            first = name;
    }
    free(impl->taken);
    impl->taken = NULL;
    impl->n_taken = impl->cap_taken = 0;
    if (unused)
        return skv_errorf(SKV_E_UNSUPPORTED, "%s: tensor %s%s is not one this engine computes with (e.g. an "
                          "output-projection or MLP bias, or experts): refused rather than run without it", what,
                          first ? first : "?", unused > 1 ? " and others" : "");
    return SKV_OK;
}

static const struct skv_tensor *gguf_tensor_at(const void *g, int64_t i)
{
    return skv_gguf_tensor(g, i);
}

static const struct skv_tensor *st_tensor_at(const void *st, int64_t i)
{
    return skv_safetensors_tensor(st, i);
}

static int map_weights(struct skv_model *m, find_fn find, const struct name_map *nm)
{
    const struct skv_model_config *c = &m->cfg;
    int64_t q_dim = (int64_t)c->n_heads * c->head_dim, kv_dim = (int64_t)c->n_kv_heads * c->head_dim;
    int rc;
    if ((rc = take(m, find, nm->tok_embd, 0, &m->tok_embd, c->dim, c->n_vocab, false)))
        return rc;
    if ((rc = take(m, find, nm->output_norm, 0, &m->output_norm, c->dim, 0, false)))
        return rc;
    if ((rc = take(m, find, nm->output, 0, &m->output, c->dim, c->n_vocab, true)))
        return rc;
    m->cfg.tied_output = m->output.data == NULL;
    if (m->cfg.tied_output)
        m->output = m->tok_embd;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers)
        return SKV_E_NOMEM;
    bool any_bias = false;
    for (int l = 0; l < c->n_layers; l++) {
        struct skv_layer_weights *w = &m->layers[l];
        if ((rc = take(m, find, nm->attn_norm, l, &w->attn_norm, c->dim, 0, false)) ||
            (rc = take(m, find, nm->wq, l, &w->wq, c->dim, q_dim, false)) ||
            (rc = take(m, find, nm->wk, l, &w->wk, c->dim, kv_dim, false)) ||
            (rc = take(m, find, nm->wv, l, &w->wv, c->dim, kv_dim, false)) ||
            (rc = take(m, find, nm->wo, l, &w->wo, q_dim, c->dim, false)) ||
            (rc = take(m, find, nm->bq, l, &w->bq, q_dim, 0, true)) ||
            (rc = take(m, find, nm->bk, l, &w->bk, kv_dim, 0, true)) ||
            (rc = take(m, find, nm->bv, l, &w->bv, kv_dim, 0, true)) ||
            (rc = take(m, find, nm->ffn_norm, l, &w->ffn_norm, c->dim, 0, false)) ||
            (rc = take(m, find, nm->w_gate, l, &w->w_gate, c->dim, c->ffn_dim, false)) ||
            (rc = take(m, find, nm->w_up, l, &w->w_up, c->dim, c->ffn_dim, false)) ||
            (rc = take(m, find, nm->w_down, l, &w->w_down, c->ffn_dim, c->dim, false)))
            return rc;
        any_bias |= w->bq.data || w->bk.data || w->bv.data;
    }
    m->cfg.qkv_bias = any_bias;
    return SKV_OK;
}

/* Norm weights and biases always become f32 (the ops take float vectors); in reference mode
 * every matrix is dequantized too. */
static int prepare_weights(struct skv_model *m)
{
    int rc;
    if ((rc = to_f32(m, &m->output_norm)))
        return rc;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        struct skv_layer_weights *w = &m->layers[l];
        struct skv_tensor *vecs[] = {&w->attn_norm, &w->ffn_norm, &w->bq, &w->bk, &w->bv};
        for (size_t i = 0; i < sizeof vecs / sizeof vecs[0]; i++)
            if (vecs[i]->data && (rc = to_f32(m, vecs[i])))
                return rc;
        if (m->reference) {
            struct skv_tensor *mats[] = {&w->wq, &w->wk, &w->wv, &w->wo, &w->w_gate, &w->w_up, &w->w_down};
            for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++)
                if ((rc = to_f32(m, mats[i])))
                    return rc;
        }
    }
    if (m->reference) {
        if ((rc = to_f32(m, &m->tok_embd)))
            return rc;
        if (m->cfg.tied_output)
            m->output = m->tok_embd;
        else if ((rc = to_f32(m, &m->output)))
            return rc;
    }
    /* quantized / f16 matrices still in the mapped file go to the device (f32 copies already are) */
    for (int l = 0; l < m->cfg.n_layers && !m->reference; l++) {
        struct skv_layer_weights *w = &m->layers[l];
        struct skv_tensor *mats[] = {&w->wq, &w->wk, &w->wv, &w->wo, &w->w_gate, &w->w_up, &w->w_down};
        for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++)
            if ((rc = to_device(m, mats[i])))
                return rc;
    }
    if (!m->reference) {
        if ((rc = to_device(m, &m->tok_embd)))
            return rc;
        if (m->cfg.tied_output)
            m->output = m->tok_embd;
        else if ((rc = to_device(m, &m->output)))
            return rc;
    }
    return SKV_OK;
}

static int validate_config(const struct skv_model_config *c)
{
    if (c->n_layers < 1 || c->n_layers > 1024 || c->dim < 1 || c->dim > (1 << 16) || c->n_heads < 1 ||
        c->n_heads > 1024 || c->n_kv_heads < 1 || c->n_kv_heads > SKV_MAX_KV_HEADS ||
        c->n_heads % c->n_kv_heads || c->head_dim < 2 || c->head_dim > 1024 || c->head_dim % 2 ||
        c->ffn_dim < 1 || c->ffn_dim > (1 << 20) || c->n_vocab < 1 || c->n_vocab > (1 << 24))
        return skv_errorf(SKV_E_FORMAT,
                          "implausible hyper-parameters: %d layers, dim %d, %d heads, %d kv heads, "
                          "head dim %d, ffn %d, vocab %d",
                          c->n_layers, c->dim, c->n_heads, c->n_kv_heads, c->head_dim, c->ffn_dim, c->n_vocab);
    if (c->rope.rot_dim < 2 || c->rope.rot_dim > c->head_dim || c->rope.rot_dim % 2)
        return skv_errorf(SKV_E_FORMAT, "rope dimension %d does not fit head dim %d", c->rope.rot_dim,
                          c->head_dim);
    if (!(c->rope.theta > 0) || !(c->norm_eps > 0))
        return skv_errorf(SKV_E_FORMAT, "rope theta %g / norm eps %g must be positive", c->rope.theta,
                          c->norm_eps);
    /* the rope op's own rules (finite theta and scale, consistent Llama 3 scaling, frequency
     * factors), so a bad file fails here rather than at its first forward */
    if (skv_rope_check(&c->rope, c->head_dim) != SKV_OK) {
        char why[256]; /* skv_errorf() rewrites the buffer skv_error_msg() returns */
        snprintf(why, sizeof why, "%s", skv_error_msg());
        return skv_errorf(SKV_E_FORMAT, "bad rope parameters: %s", why);
    }
    return SKV_OK;
}

/* ---- GGUF -------------------------------------------------------------------------------- */

static bool gguf_u32(const struct skv_gguf *g, const char *arch, const char *key, int *out)
{
    char full[128];
    uint32_t v;
    snprintf(full, sizeof full, "%s.%s", arch, key);
    if (!skv_gguf_get_u32(g, full, &v) || v > INT32_MAX)
        return false;
    *out = (int)v;
    return true;
}

static bool gguf_f32(const struct skv_gguf *g, const char *arch, const char *key, float *out)
{
    char full[128];
    snprintf(full, sizeof full, "%s.%s", arch, key);
    return skv_gguf_get_f32(g, full, out);
}

/* An optional key that was read (ok) or is absent: SKV_OK; one that is present but not what
 * it should be (a string where a number belongs, an array of per-layer values) is refused
 * rather than replaced by the default without a word. */
static int gguf_optional(const struct skv_gguf *g, const char *arch, const char *key, bool ok, const char *path)
{
    char full[128];
    snprintf(full, sizeof full, "%s.%s", arch, key);
    if (ok || skv_gguf_find_key(g, full) < 0)
        return SKV_OK;
    return skv_errorf(SKV_E_UNSUPPORTED, "%s: %s is present but not a single number this engine reads", path, full);
}

/* One tensor in a fingerprint: its name, shape, type, offset in its file (off NULL: not hashed)
 * and first bytes. */
static void fingerprint_tensor(crypto_hash_sha256_state *st, const struct skv_tensor *t, const int64_t *off)
{
    crypto_hash_sha256_update(st, (const unsigned char *)t->name, strlen(t->name));
    crypto_hash_sha256_update(st, (const unsigned char *)t->ne, sizeof t->ne);
    crypto_hash_sha256_update(st, (const unsigned char *)&t->type, sizeof t->type);
    if (off)
        crypto_hash_sha256_update(st, (const unsigned char *)off, sizeof *off);
    crypto_hash_sha256_update(st, t->data, t->nbytes < 64 ? t->nbytes : 64);
}

/* What shapes a GGUF model's KV besides its tensors, from its metadata: the heads, the norms'
 * epsilon, the rope (its mode, dimensions, base, scalings and every rope_freqs factor) and the
 * layers' sliding windows. Without it two files that differ only there (rope.freq_base edited in
 * place, another rope scaling, rope_freqs past the 16 factors its first bytes hold) had one
 * fingerprint, and a restore, LOAD or the store took one's KV for the other's. */
static void fingerprint_config(crypto_hash_sha256_state *st, const struct skv_model *m)
{
    const struct skv_model_config *c = &m->cfg;
    const struct skv_rope *r = &c->rope;
    char text[512]; /* hex floats: exact */
    int n = snprintf(text, sizeof text,
                     "kv-config arch=%s layers=%d dim=%d heads=%d kv_heads=%d head_dim=%d eps=%a rope=%d,%d,%a,%a,"
                     "%a,%a,%a,%d sliding=%d qkv_bias=%d",
                     c->arch, c->n_layers, c->dim, c->n_heads, c->n_kv_heads, c->head_dim, (double)c->norm_eps, r->mode,
                     r->rot_dim, (double)r->theta, (double)r->freq_scale, (double)r->l3_factor,
                     (double)r->l3_low_freq_factor, (double)r->l3_high_freq_factor, r->l3_original_ctx,
                     c->sliding_window, c->qkv_bias);
    crypto_hash_sha256_update(st, (const unsigned char *)text, n > 0 && (size_t)n < sizeof text ? (size_t)n : 0);
    for (int l = 0; l < c->n_layers; l++)
        crypto_hash_sha256_update(st, (const unsigned char *)&m->layers[l].window, sizeof m->layers[l].window);
    if (r->freq_factors)
        crypto_hash_sha256_update(st, (const unsigned char *)r->freq_factors, (size_t)(r->rot_dim / 2) * sizeof(float));
}

/* Ends a fingerprint hash with a trailing count (file size, tensor count) and writes its hex
 * into out[65]. */
static void fingerprint_finish(char *out, crypto_hash_sha256_state *st, uint64_t trailer)
{
    unsigned char digest[crypto_hash_sha256_BYTES];
    crypto_hash_sha256_update(st, (const unsigned char *)&trailer, sizeof trailer);
    crypto_hash_sha256_final(st, digest);
    for (int i = 0; i < 32; i++)
        snprintf(out + 2 * i, 3, "%02x", digest[i]);
}

/* <arch>.rope.scaling.type as llama.cpp reads it: "none", or "linear" (also when the key is
 * absent) with <arch>.rope.scaling.factor (or the older rope.scale_linear; absent or 0: no
 * scaling) dividing positions. llama.cpp's Llama 3.1 converter writes neither key but
 * rope_freqs.weight. Other types (yarn, longrope) change the rotation in ways this engine
 * does not implement: refused rather than run without them. */
static int gguf_rope_scaling(struct skv_model *m, const char *path)
{
    const struct skv_gguf *g = ((struct model_impl *)m->impl)->gguf;
    struct skv_model_config *c = &m->cfg;
    char key[128], fkey[128];
    struct skv_gguf_str type = {.ptr = "linear", .len = 6};
    snprintf(key, sizeof key, "%s.rope.scaling.type", c->arch);
    if (skv_gguf_find_key(g, key) >= 0 && !skv_gguf_get_str(g, key, &type))
        return skv_errorf(SKV_E_FORMAT, "%s: %s is not a string", path, key);
    bool linear = type.len == 6 && memcmp(type.ptr, "linear", 6) == 0;
    if (!linear && !(type.len == 4 && memcmp(type.ptr, "none", 4) == 0))
        return skv_errorf(SKV_E_UNSUPPORTED, "%s: %s '%.*s' is not supported (none, linear)", path, key,
                          (int)(type.len > 64 ? 64 : type.len), type.ptr);
    if (!linear)
        return SKV_OK;
    float factor = 0.0f;
    snprintf(fkey, sizeof fkey, "%s.rope.scaling.factor", c->arch);
    if (skv_gguf_find_key(g, fkey) < 0)
        snprintf(fkey, sizeof fkey, "%s.rope.scale_linear", c->arch);
    if (skv_gguf_find_key(g, fkey) >= 0 && !skv_gguf_get_f32(g, fkey, &factor))
        return skv_errorf(SKV_E_FORMAT, "%s: %s is not a float", path, fkey);
    if (factor == 0.0f)
        return SKV_OK;
    if (!(factor > 0.0f) || !isfinite(factor))
        return skv_errorf(SKV_E_FORMAT, "%s: %s = %g must be a finite value > 0", path, fkey, (double)factor);
    c->rope.freq_scale = 1.0f / factor;
    return SKV_OK;
}

/* rope_freqs.weight (llama.cpp's Llama 3.1 converter: the llama3 scaling as one factor per
 * rotated pair, dividing that pair's frequency): a host f32 copy the rope op reads. */
static int gguf_rope_factors(struct skv_model *m, const char *path)
{
    struct model_impl *impl = m->impl;
    const struct skv_tensor *t = skv_gguf_find_tensor(impl->gguf, "rope_freqs.weight");
    if (!t)
        return SKV_OK;
    const int half = m->cfg.rope.rot_dim / 2;
    if (half < 1 || t->ndim != 1 || t->ne[0] != half)
        return skv_errorf(SKV_E_FORMAT, "%s: rope_freqs.weight has %lld values where rope dimension %d needs %d",
                          path, (long long)t->ne[0], m->cfg.rope.rot_dim, half);
    if (t->type != SKV_DTYPE_F32 && t->type != SKV_DTYPE_F16 && t->type != SKV_DTYPE_BF16)
        return skv_errorf(SKV_E_UNSUPPORTED, "%s: rope_freqs.weight of type %s (f32, f16 or bf16)", path,
                          skv_dtype_name(t->type) ? skv_dtype_name(t->type) : "?");
    impl->rope_factors = malloc((size_t)half * sizeof *impl->rope_factors);
    if (!impl->rope_factors)
        return SKV_E_NOMEM;
    int rc = skv_dequantize_row(t->type, t->data, impl->rope_factors, half);
    if (rc)
        return rc;
    m->cfg.rope.freq_factors = impl->rope_factors;
    if (!skv_rope_factors_valid(&m->cfg.rope, half))
        return skv_errorf(SKV_E_FORMAT, "%s: rope_freqs.weight holds a value that is not finite and > 0", path);
    return SKV_OK;
}

/* <arch>.attention.sliding_window (0 or absent: none), in every layer unless
 * <arch>.attention.sliding_window_pattern (one bool per layer, llama.cpp's converter) says
 * which layers slide. */
static int gguf_sliding_window(struct skv_model *m, const char *path)
{
    const struct skv_gguf *g = ((struct model_impl *)m->impl)->gguf;
    struct skv_model_config *c = &m->cfg;
    char key[128], pkey[128];
    snprintf(key, sizeof key, "%s.attention.sliding_window", c->arch);
    snprintf(pkey, sizeof pkey, "%s.attention.sliding_window_pattern", c->arch);
    if (skv_gguf_find_key(g, key) < 0)
        return SKV_OK;
    int w = 0;
    if (!gguf_u32(g, c->arch, "attention.sliding_window", &w))
        return skv_errorf(SKV_E_FORMAT, "%s: %s is not an unsigned integer", path, key);
    c->sliding_window = w;
    if (w == 0)
        return SKV_OK;
    int type;
    uint64_t count;
    bool has_pattern = skv_gguf_find_key(g, pkey) >= 0;
    if (has_pattern && (!skv_gguf_get_arr(g, pkey, &type, &count) || type != SKV_GGUF_BOOL ||
                        count != (uint64_t)c->n_layers))
        return skv_errorf(SKV_E_UNSUPPORTED, "%s: %s is not one bool per layer (%d layers)", path, pkey,
                          c->n_layers);
    for (int l = 0; l < c->n_layers; l++) {
        bool slides = true;
        if (has_pattern)
            skv_gguf_get_arr_bool(g, pkey, (uint64_t)l, &slides);
        m->layers[l].window = slides ? w : 0;
    }
    return SKV_OK;
}

/* A tokenizer of a kind this one does not implement (SentencePiece-style byte fallback: Llama 2,
 * Mistral v0.x) leaves the weights usable with token ids: noted in m->tok_note, not an error.
 * Other failures (a damaged file) stay errors. */
static int tokenizer_unsupported(struct skv_model *m, int rc)
{
    if (rc != SKV_E_UNSUPPORTED)
        return rc;
    snprintf(m->tok_note, sizeof m->tok_note, "%s", skv_error_msg());
    skv_error_clear();
    return SKV_OK;
}

static int load_gguf(struct skv_model *m, const char *path)
{
    struct model_impl *impl = m->impl;
    int rc = skv_gguf_open(path, &impl->gguf);
    if (rc)
        return rc;
    const struct skv_gguf *g = impl->gguf;
    struct skv_gguf_str s;
    if (!skv_gguf_get_str(g, "general.architecture", &s) || s.len == 0 || s.len >= sizeof m->cfg.arch)
        return skv_errorf(SKV_E_FORMAT, "%s: general.architecture is missing", path);
    memcpy(m->cfg.arch, s.ptr, s.len);
    m->cfg.arch[s.len] = '\0';
    const char *arch = m->cfg.arch;
    bool is_qwen2 = strcmp(arch, "qwen2") == 0;
    if (strcmp(arch, "llama") != 0 && !is_qwen2)
        return skv_errorf(SKV_E_UNSUPPORTED, "%s: architecture '%s' is not supported (llama, qwen2)", path,
                          arch);
    if (skv_gguf_get_str(g, "general.name", &s) && s.len)
        set_name(m, s.ptr, s.len);

    struct skv_model_config *c = &m->cfg;
    if (!gguf_u32(g, arch, "block_count", &c->n_layers) || !gguf_u32(g, arch, "embedding_length", &c->dim) ||
        !gguf_u32(g, arch, "feed_forward_length", &c->ffn_dim) ||
        !gguf_u32(g, arch, "attention.head_count", &c->n_heads))
        return skv_errorf(SKV_E_FORMAT, "%s: missing %s.block_count / embedding_length / "
                                        "feed_forward_length / attention.head_count", path, arch);
    int experts = 0;
    if (gguf_u32(g, arch, "expert_count", &experts) && experts > 0)
        return skv_errorf(SKV_E_UNSUPPORTED, "%s: a mixture of experts (%d experts) is not supported", path, experts);
    c->n_kv_heads = c->n_heads;
    c->head_dim = c->n_heads ? c->dim / c->n_heads : 0;
    c->max_ctx = 4096;
    c->rope.theta = 10000.0f;
    int v_dim = -1;
    if ((rc = gguf_optional(g, arch, "attention.head_count_kv", gguf_u32(g, arch, "attention.head_count_kv",
                                                                          &c->n_kv_heads), path)) ||
        (rc = gguf_optional(g, arch, "attention.key_length", gguf_u32(g, arch, "attention.key_length", &c->head_dim),
                            path)) ||
        (rc = gguf_optional(g, arch, "attention.value_length",
                            gguf_u32(g, arch, "attention.value_length", &v_dim), path)) ||
        (rc = gguf_optional(g, arch, "context_length", gguf_u32(g, arch, "context_length", &c->max_ctx), path)) ||
        (rc = gguf_optional(g, arch, "rope.freq_base", gguf_f32(g, arch, "rope.freq_base", &c->rope.theta), path)))
        return rc;
    /* required, as llama.cpp requires it: a default would differ from the model's own (1e-5 for
     * Llama 2, 1e-6 for Qwen2) without a word */
    const bool has_eps = gguf_f32(g, arch, "attention.layer_norm_rms_epsilon", &c->norm_eps);
    if ((rc = gguf_optional(g, arch, "attention.layer_norm_rms_epsilon", has_eps, path)))
        return rc;
    if (!has_eps)
        return skv_errorf(SKV_E_FORMAT, "%s: missing %s.attention.layer_norm_rms_epsilon", path, arch);
    if (v_dim >= 0 && v_dim != c->head_dim)
        return skv_errorf(SKV_E_UNSUPPORTED, "%s: value heads of %d and key heads of %d (one size is supported)", path,
                          v_dim, c->head_dim);
    c->rope.mode = is_qwen2 ? SKV_ROPE_NEOX : SKV_ROPE_NORM;
    c->rope.rot_dim = c->head_dim;
    if ((rc = gguf_optional(g, arch, "rope.dimension_count",
                            gguf_u32(g, arch, "rope.dimension_count", &c->rope.rot_dim), path)))
        return rc;
    c->rope.freq_scale = 1.0f;
    if ((rc = gguf_rope_scaling(m, path)))
        return rc;
    if ((rc = gguf_rope_factors(m, path)))
        return rc;
    const struct skv_tensor *embd = skv_gguf_find_tensor(g, "token_embd.weight");
    if (!embd || embd->ndim != 2)
        return skv_errorf(SKV_E_FORMAT, "%s: token_embd.weight is missing", path);
    c->n_vocab = (int)embd->ne[1];
    if ((rc = validate_config(c)))
        return rc;
    static const char *const gguf_ignore[] = {"rope_freqs.weight", NULL};
    if ((rc = map_weights(m, find_gguf, &gguf_names)) || (rc = gguf_sliding_window(m, path)) ||
        (rc = check_all_used(m, skv_gguf_n_tensors(g), gguf_tensor_at, g, gguf_ignore, path)))
        return rc;
    /* a GGUF without tokenizer.ggml.model (a test checkpoint) loads with no tokenizer, as an
     * HF folder without tokenizer.json does */
    if (skv_gguf_find_key(g, "tokenizer.ggml.model") >= 0 && (rc = skv_tokenizer_from_gguf(g, &m->tok)) &&
        (rc = tokenizer_unsupported(m, rc)))
        return rc;

    const char *lo = NULL;
    for (int64_t i = 0; i < skv_gguf_n_tensors(g); i++) {
        const char *d = skv_gguf_tensor(g, i)->data;
        if (!lo || d < lo)
            lo = d;
    }
    /* Fingerprint: every tensor's name, shape, type, relative offset and first bytes, the
     * config the metadata gives, and the file size, so the same model hashes the same wherever
     * the file lives; the legacy one without the config (before the forty-fifth session). */
    struct stat sb;
    if (stat(path, &sb) != 0)
        sb.st_size = 0;
    crypto_hash_sha256_state st;
    crypto_hash_sha256_init(&st);
    for (int64_t i = 0; i < skv_gguf_n_tensors(g); i++) {
        const struct skv_tensor *t = skv_gguf_tensor(g, i);
        int64_t off = (const char *)t->data - lo;
        fingerprint_tensor(&st, t, &off);
    }
    crypto_hash_sha256_state legacy = st;
    fingerprint_finish(m->legacy_fingerprint, &legacy, (uint64_t)sb.st_size);
    fingerprint_config(&st, m);
    fingerprint_finish(m->fingerprint, &st, (uint64_t)sb.st_size);
    return SKV_OK;
}

/* ---- Hugging Face folder ------------------------------------------------------------------ */

static int json_int(json_t *root, const char *key, int *out, bool required)
{
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v))
        return required ? skv_errorf(SKV_E_FORMAT, "config.json: '%s' is missing", key) : SKV_OK;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX)
        return skv_errorf(SKV_E_FORMAT, "config.json: '%s' is not a non-negative integer", key);
    *out = (int)json_integer_value(v);
    return SKV_OK;
}

static int json_float(json_t *root, const char *key, float *out)
{
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v))
        return SKV_OK;
    if (!json_is_number(v))
        return skv_errorf(SKV_E_FORMAT, "config.json: '%s' is not a number", key);
    *out = (float)json_number_value(v);
    return SKV_OK;
}

/* Sliding-window attention as transformers reads config.json: Mistral slides in every layer
 * (sliding_window; 4096 when the key is absent, as MistralConfig defaults; null: off). Qwen2
 * only with use_sliding_window, in the layers layer_types marks "sliding_attention" (without
 * layer_types: from max_window_layers on, 28 by default). */
static int hf_sliding_window(struct skv_model *m, json_t *root, const char *mt, const char *path)
{
    struct skv_model_config *c = &m->cfg;
    bool mistral = strcmp(mt, "mistral") == 0;
    if (!mistral && !(strcmp(mt, "qwen2") == 0 && json_is_true(json_object_get(root, "use_sliding_window"))))
        return SKV_OK;
    json_t *sw = json_object_get(root, "sliding_window");
    int w = 4096, from = 0, rc;
    if (sw && json_is_null(sw))
        return SKV_OK;
    if ((rc = json_int(root, "sliding_window", &w, false)))
        return rc;
    if (w < 1)
        return skv_errorf(SKV_E_FORMAT, "%s: sliding_window %d must be at least 1", path, w);
    c->sliding_window = w;
    json_t *types = mistral ? NULL : json_object_get(root, "layer_types");
    if (types && !json_is_null(types)) {
        if (!json_is_array(types) || json_array_size(types) != (size_t)c->n_layers)
            return skv_errorf(SKV_E_FORMAT, "%s: layer_types is not a list of %d layer types", path,
                              c->n_layers);
        for (int l = 0; l < c->n_layers; l++) {
            const char *t = json_string_value(json_array_get(types, (size_t)l));
            if (!t || (strcmp(t, "sliding_attention") != 0 && strcmp(t, "full_attention") != 0))
                return skv_errorf(SKV_E_UNSUPPORTED, "%s: layer %d has layer type '%s' (full_attention, "
                                  "sliding_attention)", path, l, t ? t : "?");
            m->layers[l].window = strcmp(t, "sliding_attention") == 0 ? w : 0;
        }
        return SKV_OK;
    }
    if (!mistral) {
        from = 28;
        if ((rc = json_int(root, "max_window_layers", &from, false)))
            return rc;
    }
    for (int l = from; l < c->n_layers; l++)
        m->layers[l].window = w;
    return SKV_OK;
}

static int load_hf(struct skv_model *m, const char *dir)
{
    struct model_impl *impl = m->impl;
    char path[1200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    struct stat cs;
    if (stat(path, &cs) != 0)
        return skv_errorf(SKV_E_NOT_FOUND, "%s: a folder without config.json (a model is a GGUF file or a Hugging "
                          "Face folder holding config.json and its *.safetensors)", dir);
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root)
        return skv_errorf(SKV_E_FORMAT, "%s:%d: %s", path, jerr.line, jerr.text);
    struct skv_model_config *c = &m->cfg;
    int rc = SKV_OK;
    const char *mt = json_string_value(json_object_get(root, "model_type"));
    if (!mt || (strcmp(mt, "llama") != 0 && strcmp(mt, "qwen2") != 0 && strcmp(mt, "mistral") != 0)) {
        rc = skv_errorf(SKV_E_UNSUPPORTED, "%s: model_type '%s' is not supported (llama, mistral, qwen2)",
                        path, mt ? mt : "(none)");
        goto out;
    }
    snprintf(c->arch, sizeof c->arch, "%s", strcmp(mt, "qwen2") == 0 ? "qwen2" : "llama");
    const char *slash = strrchr(dir, '/');
    const char *base = slash && slash[1] ? slash + 1 : dir;
    set_name(m, base, strlen(base));
    c->norm_eps = 1e-6f;
    c->rope.theta = 10000.0f;
    c->max_ctx = 4096;
    if ((rc = json_int(root, "num_hidden_layers", &c->n_layers, true)) ||
        (rc = json_int(root, "hidden_size", &c->dim, true)) ||
        (rc = json_int(root, "intermediate_size", &c->ffn_dim, true)) ||
        (rc = json_int(root, "num_attention_heads", &c->n_heads, true)) ||
        (rc = json_int(root, "vocab_size", &c->n_vocab, true)) ||
        (rc = json_int(root, "max_position_embeddings", &c->max_ctx, false)) ||
        (rc = json_float(root, "rms_norm_eps", &c->norm_eps)) ||
        (rc = json_float(root, "rope_theta", &c->rope.theta)))
        goto out;
    c->n_kv_heads = c->n_heads;
    if ((rc = json_int(root, "num_key_value_heads", &c->n_kv_heads, false)))
        goto out;
    c->head_dim = c->n_heads ? c->dim / c->n_heads : 0;
    if ((rc = json_int(root, "head_dim", &c->head_dim, false)))
        goto out;
    c->rope.mode = SKV_ROPE_NEOX;
    c->rope.rot_dim = c->head_dim;
    c->rope.freq_scale = 1.0f;
    const char *act = json_string_value(json_object_get(root, "hidden_act"));
    if (act && strcmp(act, "silu") != 0) {
        rc = skv_errorf(SKV_E_UNSUPPORTED, "%s: hidden_act '%s' is not supported (silu)", path, act);
        goto out;
    }
    json_t *rs = json_object_get(root, "rope_scaling");
    /* transformers 5 writes rope_theta and the scaling together, as rope_parameters (read as
     * rope_scaling is; one per layer type is not supported) */
    json_t *rp = json_object_get(root, "rope_parameters");
    if (rp && json_is_object(rp)) {
        const char *key;
        json_t *v;
        json_object_foreach(rp, key, v) {
            if (json_is_object(v)) {
                rc = skv_errorf(SKV_E_UNSUPPORTED, "%s: rope_parameters per layer type ('%s') are not supported",
                                path, key);
                goto out;
            }
        }
        float theta = c->rope.theta;
        if ((rc = json_float(rp, "rope_theta", &theta)))
            goto out;
        if (json_object_get(root, "rope_theta") && theta != c->rope.theta) {
            rc = skv_errorf(SKV_E_FORMAT, "%s: rope_theta %g and rope_parameters.rope_theta %g disagree", path,
                            (double)c->rope.theta, (double)theta);
            goto out;
        }
        c->rope.theta = theta;
        if (rs && json_is_object(rs) && json_object_get(rp, "rope_type") &&
            !json_equal(json_object_get(rp, "rope_type"), json_object_get(rs, "rope_type"))) {
            rc = skv_errorf(SKV_E_FORMAT, "%s: rope_scaling and rope_parameters name different rope types", path);
            goto out;
        }
        if (!rs || !json_is_object(rs))
            rs = rp;
    }
    if (rs && json_is_object(rs)) {
        const char *type = json_string_value(json_object_get(rs, "rope_type"));
        if (!type)
            type = json_string_value(json_object_get(rs, "type"));
        if (!type) { /* transformers refuses it too: no scaling would be a guess */
            rc = skv_errorf(SKV_E_FORMAT, "%s: rope_scaling names no rope_type (or type)", path);
            goto out;
        }
        float factor = 1.0f;
        bool scales = strcmp(type, "linear") == 0 || strcmp(type, "llama3") == 0;
        /* the keys transformers requires of the type: a default would scale positions unseen */
        static const char *const l3_keys[] = {"factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings"};
        for (size_t k = 0; scales && k < (strcmp(type, "llama3") == 0 ? 4u : 1u); k++)
            if (!json_object_get(rs, l3_keys[k])) {
                rc = skv_errorf(SKV_E_FORMAT, "%s: rope_scaling of type %s has no %s", path, type, l3_keys[k]);
                goto out;
            }
        if ((rc = json_float(rs, "factor", &factor)))
            goto out;
        if (scales && (!(factor > 0) || !isfinite(factor))) {
            /* 0 would turn llama3 scaling off unseen (the rope op reads 0 as "none") */
            rc = skv_errorf(SKV_E_FORMAT, "%s: rope_scaling %s factor %g must be a finite value > 0", path,
                            type, (double)factor);
            goto out;
        }
        if (strcmp(type, "linear") == 0) {
            c->rope.freq_scale = 1.0f / factor;
        } else if (strcmp(type, "llama3") == 0) {
            c->rope.l3_factor = factor;
            c->rope.l3_low_freq_factor = 1.0f;
            c->rope.l3_high_freq_factor = 4.0f;
            c->rope.l3_original_ctx = 8192;
            if ((rc = json_float(rs, "low_freq_factor", &c->rope.l3_low_freq_factor)) ||
                (rc = json_float(rs, "high_freq_factor", &c->rope.l3_high_freq_factor)) ||
                (rc = json_int(rs, "original_max_position_embeddings", &c->rope.l3_original_ctx, false)))
                goto out;
        } else if (strcmp(type, "default") != 0) {
            rc = skv_errorf(SKV_E_UNSUPPORTED, "%s: rope_scaling type '%s' is not supported", path, type);
            goto out;
        }
    }
    if ((rc = validate_config(c)))
        goto out;
    if ((rc = skv_safetensors_open_dir(dir, &impl->st)))
        goto out;
    static const char *const hf_ignore[] = {"rotary_emb.inv_freq", NULL};
    if ((rc = map_weights(m, find_st, &hf_names)) || (rc = hf_sliding_window(m, root, mt, path)) ||
        (rc = check_all_used(m, skv_safetensors_n_tensors(impl->st), st_tensor_at, impl->st, hf_ignore, dir)))
        goto out;
    json_t *tie = json_object_get(root, "tie_word_embeddings");
    if (json_is_false(tie) && m->cfg.tied_output) {
        rc = skv_errorf(SKV_E_FORMAT, "%s: lm_head.weight is missing and tie_word_embeddings is false", dir);
        goto out;
    }
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    struct stat sb;
    if (stat(path, &sb) == 0 && (rc = skv_tokenizer_from_json(path, &m->tok)) && (rc = tokenizer_unsupported(m, rc)))
        goto out;
    /* Fingerprint: config.json's text plus every tensor's name, shape, type and first bytes
     * (before, only the config and the tensor count: two fine-tunes sharing a config.json got
     * one fingerprint, and a restore would take one's KV for the other's) */
    char *text = json_dumps(root, JSON_SORT_KEYS | JSON_COMPACT);
    if (text) {
        crypto_hash_sha256_state st;
        crypto_hash_sha256_init(&st);
        crypto_hash_sha256_update(&st, (const unsigned char *)text, strlen(text));
        for (int64_t i = 0; i < skv_safetensors_n_tensors(impl->st); i++)
            fingerprint_tensor(&st, skv_safetensors_tensor(impl->st, i), NULL);
        fingerprint_finish(m->fingerprint, &st, (uint64_t)skv_safetensors_n_tensors(impl->st));
        memcpy(m->legacy_fingerprint, m->fingerprint, sizeof m->fingerprint);
        free(text);
    }
out:
    json_decref(root);
    return rc;
}

/* Every id the tokenizer can produce must name a row of the embedding. The embedding may have
 * more rows than the tokenizer has tokens (Qwen2.5: 151936 for 151665); the decoder skips the
 * ids past the tokenizer. */
static int check_tokenizer(const struct skv_model *m)
{
    const int n_vocab = m->cfg.n_vocab, n_tok = skv_tokenizer_n_vocab(m->tok);
    if (n_tok > n_vocab)
        return skv_errorf(SKV_E_FORMAT, "%s: the tokenizer has %d tokens, the model's embedding only %d rows",
                          m->path, n_tok, n_vocab);
    const struct {
        const char *what;
        int32_t id;
    } ids[] = {
        {"BOS", skv_tokenizer_bos(m->tok)},
        {"EOS", skv_tokenizer_eos(m->tok)},
        {"end-of-turn", skv_tokenizer_eot(m->tok)},
    };
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++)
        if (ids[i].id >= n_vocab)
            return skv_errorf(SKV_E_FORMAT, "%s: the tokenizer's %s token %d is outside the model's %d rows",
                              m->path, ids[i].what, ids[i].id, n_vocab);
    return SKV_OK;
}

int skv_model_load(const char *path, struct skv_backend *be, const struct skv_model_opts *opts,
                   struct skv_model **out)
{
    if (!path || !be || !out)
        return skv_errorf(SKV_E_INVAL, "model path and backend are required");
    if (sodium_init() < 0)
        return skv_errorf(SKV_E_INTERNAL, "libsodium failed to initialize");
    struct stat sb;
    if (stat(path, &sb) != 0)
        return skv_errorf(SKV_E_NOT_FOUND, "%s: %s", path, strerror(errno));
    struct skv_model *m = calloc(1, sizeof *m);
    struct model_impl *impl = calloc(1, sizeof *impl);
    if (!m || !impl) {
        free(m);
        free(impl);
        return SKV_E_NOMEM;
    }
    m->impl = impl;
    m->be = be;
    m->reference = opts && opts->reference;
    snprintf(m->path, sizeof m->path, "%s", path);
    int rc = S_ISDIR(sb.st_mode) ? load_hf(m, path) : load_gguf(m, path);
    if (!rc && m->tok)
        rc = check_tokenizer(m);
    if (!rc)
        rc = prepare_weights(m);
    if (!rc)
        rc = skv_kv_pool_new(be, m->cfg.head_dim, SKV_KV_BLOCK_ROWS, SKV_DTYPE_F32, &m->kv_pool);
    if (rc) {
        skv_model_free(&m);
        return rc;
    }
    if (!m->name[0])
        set_name(m, path, strlen(path));
    *out = m;
    return SKV_OK;
}

int skv_model_set_kv_block_rows(struct skv_model *m, int rows)
{
    return skv_model_set_kv_pool(m, rows, skv_kv_pool_kv_type(m->kv_pool));
}

int skv_model_set_kv_pool(struct skv_model *m, int rows, int kv_type)
{
    struct skv_kv_pool *pool = NULL;
    int rc = skv_kv_pool_new(m->be, m->cfg.head_dim, rows, kv_type, &pool);
    if (rc)
        return rc;
    skv_kv_pool_unref(&m->kv_pool);
    m->kv_pool = pool;
    return SKV_OK;
}

void skv_model_free(struct skv_model **model_p)
{
    if (!model_p || !*model_p)
        return;
    struct skv_model *m = *model_p;
    struct model_impl *impl = m->impl;
    if (impl) {
        for (int i = 0; i < impl->n_owned; i++)
            m->be->ops->free(m->be, impl->owned[i]);
        free(impl->owned);
        skv_gguf_close(&impl->gguf);
        skv_safetensors_close(&impl->st);
        free(impl->rope_factors);
        free(impl->taken); /* a load that failed before its check */
        free(impl);
    }
    skv_tokenizer_free(&m->tok);
    skv_kv_pool_unref(&m->kv_pool); /* caches still open keep it (and its blocks) alive */
    free(m->layers);
    free(m);
    *model_p = NULL;
}
