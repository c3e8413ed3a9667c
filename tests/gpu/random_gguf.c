/* random_gguf: writes a llama-architecture GGUF (v3) of a given shape with random F16, Q8_0 or
 * Q4_1 weights and no tokenizer, for speed runs that need a model's shapes but not its weights
 * (tests/gpu/check.sh: Llama-3-8B's shapes without downloading 16 GB). Plain C, no project code. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { GGUF_U32 = 4, GGUF_F32 = 6, GGUF_STRING = 8 };
enum { GGML_F32 = 0, GGML_F16 = 1, GGML_Q4_1 = 3, GGML_Q8_0 = 8 };
#define ALIGN 32

struct shape {
    const char *name;
    int layers, dim, heads, kv_heads, head_dim, ffn, vocab;
    float rope_theta;
};

static const struct shape presets[] = {
    /* meta-llama/Meta-Llama-3-8B config.json */
    {"llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 500000.0f},
    /* HuggingFaceTB/SmolLM2-135M-Instruct (the default model's shapes, when its file is absent) */
    {"smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, 100000.0f},
    /* small enough for a CPU run of tests/gpu/check.sh's dry mode */
    {"tiny", 2, 256, 8, 2, 32, 512, 2048, 10000.0f},
};

struct tensor {
    char name[64];
    int64_t ne0, ne1;   /* ne0: row length (input features); ne1: rows (1 for a vector) */
    int type;
    uint64_t offset;
};

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng_next(void)
{
    /* xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717ull;
}

static uint64_t row_bytes(int type, int64_t ne0)
{
    return type == GGML_F32   ? (uint64_t)ne0 * 4
           : type == GGML_F16 ? (uint64_t)ne0 * 2
           : type == GGML_Q4_1 ? (uint64_t)ne0 / 32 * 20
                               : (uint64_t)ne0 / 32 * 34;
}

static int put(FILE *f, const void *p, size_t n)
{
    return fwrite(p, 1, n, f) == n ? 0 : -1;
}

static int put_u32(FILE *f, uint32_t v) { return put(f, &v, 4); }
static int put_u64(FILE *f, uint64_t v) { return put(f, &v, 8); }

static int put_str(FILE *f, const char *s)
{
    return put_u64(f, strlen(s)) || put(f, s, strlen(s));
}

static int kv_u32(FILE *f, const char *key, uint32_t v)
{
    return put_str(f, key) || put_u32(f, GGUF_U32) || put_u32(f, v);
}

static int kv_f32(FILE *f, const char *key, float v)
{
    return put_str(f, key) || put_u32(f, GGUF_F32) || put(f, &v, 4);
}

static int kv_str(FILE *f, const char *key, const char *v)
{
    return put_str(f, key) || put_u32(f, GGUF_STRING) || put_str(f, v);
}

/* Random weights with a standard deviation near the usual initializer's 0.02 (Q8_0, Q4_1;
 * 0.012 for F16), so activations stay finite through every layer; norm weights are ones. */
static void fill_row(uint8_t *dst, int type, int64_t ne0)
{
    if (type == GGML_F32) {
        float one = 1.0f;
        for (int64_t i = 0; i < ne0; i++)
            memcpy(dst + 4 * i, &one, 4);
    } else if (type == GGML_F16) {
        /* |x| in [2^-7, 2^-6): biased exponent 8, random mantissa and sign */
        for (int64_t i = 0; i < ne0; i += 4) {
            uint64_t r = rng_next();
            for (int k = 0; k < 4 && i + k < ne0; k++) {
                uint16_t bits = (uint16_t)(((r >> (16 * k)) & 0x83ff) | (8u << 10));
                memcpy(dst + 2 * (i + k), &bits, 2);
            }
        }
    } else if (type == GGML_Q4_1) {
        /* scale 0.00433 (0x1c6f) and minimum -7.5 * scale (0xa828) as f16, 4-bit quants
         * uniform in [0, 15]: mean 0, std ~0.02 */
        const uint16_t dm[2] = {0x1c6f, 0xa828};
        for (int64_t b = 0; b < ne0 / 32; b++) {
            uint8_t *blk = dst + 20 * b;
            memcpy(blk, dm, 4);
            uint64_t r0 = rng_next(), r1 = rng_next();
            memcpy(blk + 4, &r0, 8);
            memcpy(blk + 12, &r1, 8);
        }
    } else {
        /* scale 2.7e-4 as f16 (0x0c6c), quants uniform in [-128, 127]: std ~0.02 */
        const uint16_t d = 0x0c6c;
        for (int64_t b = 0; b < ne0 / 32; b++) {
            uint8_t *blk = dst + 34 * b;
            memcpy(blk, &d, 2);
            for (int k = 0; k < 32; k += 8) {
                uint64_t r = rng_next();
                memcpy(blk + 2 + k, &r, 8);
            }
        }
    }
}

static void usage(FILE *out)
{
    fprintf(out, "usage: random_gguf --out FILE [--shape llama3-8b|smollm2-135m|tiny] [--type f16|q8_0|q4_1]\n"
                 "                   [--seed N]\n"
                 "                   [--layers N] [--dim N] [--heads N] [--kv-heads N] [--ffn N] [--vocab N]\n"
                 "Writes a llama GGUF of that shape with random weights (no tokenizer).\n");
}

int main(int argc, char **argv)
{
    struct shape s = presets[0];
    const char *out = NULL, *type_name = "f16";
    uint64_t seed = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int *field = !strcmp(a, "--layers") ? &s.layers : !strcmp(a, "--dim") ? &s.dim
                   : !strcmp(a, "--heads") ? &s.heads : !strcmp(a, "--kv-heads") ? &s.kv_heads
                   : !strcmp(a, "--ffn") ? &s.ffn : !strcmp(a, "--vocab") ? &s.vocab : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        }
        if (!v) {
            usage(stderr);
            return 2;
        }
        i++;
        if (field) {
            *field = atoi(v);
        } else if (!strcmp(a, "--out")) {
            out = v;
        } else if (!strcmp(a, "--type")) {
            type_name = v;
        } else if (!strcmp(a, "--seed")) {
            seed = strtoull(v, NULL, 10);
        } else if (!strcmp(a, "--shape")) {
            size_t k = 0;
            while (k < sizeof presets / sizeof presets[0] && strcmp(presets[k].name, v))
                k++;
            if (k == sizeof presets / sizeof presets[0]) {
                fprintf(stderr, "random_gguf: unknown shape '%s' (llama3-8b, smollm2-135m, tiny)\n", v);
                return 2;
            }
            s = presets[k];
        } else {
            usage(stderr);
            return 2;
        }
    }
    int wtype = !strcmp(type_name, "f16")    ? GGML_F16
                : !strcmp(type_name, "q8_0") ? GGML_Q8_0
                : !strcmp(type_name, "q4_1") ? GGML_Q4_1
                                             : -1;
    if (!out || wtype < 0) {
        fprintf(stderr, "random_gguf: give --out FILE and --type f16, q8_0 or q4_1\n");
        return 2;
    }
    s.head_dim = s.heads > 0 ? s.dim / s.heads : 0;
    if (s.layers < 1 || s.dim < 32 || s.heads < 1 || s.kv_heads < 1 || s.heads % s.kv_heads ||
        s.dim % s.heads || s.head_dim % 2 || s.ffn < 32 || s.ffn % 32 || s.dim % 32 || s.vocab < 1 ||
        s.layers > 1024) {
        fprintf(stderr, "random_gguf: bad shape: layers %d dim %d heads %d/%d ffn %d vocab %d (dim and ffn "
                        "multiples of 32, heads dividing dim, kv heads dividing heads)\n",
                s.layers, s.dim, s.heads, s.kv_heads, s.ffn, s.vocab);
        return 2;
    }
    rng_state ^= seed * 0x2545f4914f6cdd1dull;

    int nt = 3 + 9 * s.layers;
    struct tensor *ts = calloc((size_t)nt, sizeof *ts);
    if (!ts)
        return 1;
    int64_t q = (int64_t)s.heads * s.head_dim, kv = (int64_t)s.kv_heads * s.head_dim;
    int k = 0;
    /* "%.0d" prints nothing: the names without a layer number take the same path */
#define T(fmt, layer, a, b, ty) (snprintf(ts[k].name, sizeof ts[k].name, fmt, layer), \
                                 ts[k].ne0 = (a), ts[k].ne1 = (b), ts[k].type = (ty), k++)
    /* Q4_1 files (llama.cpp's quantize) keep the embedding and output in Q8_0 */
    int etype = wtype == GGML_Q4_1 ? GGML_Q8_0 : wtype;
    T("token_embd.weight%.0d", 0, s.dim, s.vocab, etype);
    T("output_norm.weight%.0d", 0, s.dim, 1, GGML_F32);
    T("output.weight%.0d", 0, s.dim, s.vocab, etype);
    for (int l = 0; l < s.layers; l++) {
        T("blk.%d.attn_norm.weight", l, s.dim, 1, GGML_F32);
        T("blk.%d.attn_q.weight", l, s.dim, q, wtype);
        T("blk.%d.attn_k.weight", l, s.dim, kv, wtype);
        T("blk.%d.attn_v.weight", l, s.dim, kv, wtype);
        T("blk.%d.attn_output.weight", l, q, s.dim, wtype);
        T("blk.%d.ffn_norm.weight", l, s.dim, 1, GGML_F32);
        T("blk.%d.ffn_gate.weight", l, s.dim, s.ffn, wtype);
        T("blk.%d.ffn_up.weight", l, s.dim, s.ffn, wtype);
        T("blk.%d.ffn_down.weight", l, s.ffn, s.dim, wtype);
    }
#undef T
    uint64_t off = 0, max_row = 0;
    for (int i = 0; i < nt; i++) {
        ts[i].offset = off;
        uint64_t rb = row_bytes(ts[i].type, ts[i].ne0);
        max_row = rb > max_row ? rb : max_row;
        off += (rb * (uint64_t)ts[i].ne1 + ALIGN - 1) / ALIGN * ALIGN;
    }

    FILE *f = fopen(out, "wb");
    if (!f) {
        fprintf(stderr, "random_gguf: %s: %s\n", out, strerror(errno));
        free(ts);
        return 1;
    }
    setvbuf(f, NULL, _IOFBF, (size_t)8 << 20); /* 16 GB in few large writes, not 8 KB rows */
    static char iobuf[1 << 22];
    setvbuf(f, iobuf, _IOFBF, sizeof iobuf);
    char name[96];
    snprintf(name, sizeof name, "random-%s-%s", s.name, type_name);
    int err = put_u32(f, 0x46554747u) || put_u32(f, 3) || put_u64(f, (uint64_t)nt) || put_u64(f, 13) ||
              kv_str(f, "general.architecture", "llama") || kv_str(f, "general.name", name) ||
              kv_u32(f, "general.alignment", ALIGN) || kv_u32(f, "llama.block_count", (uint32_t)s.layers) ||
              kv_u32(f, "llama.context_length", 131072) || kv_u32(f, "llama.embedding_length", (uint32_t)s.dim) ||
              kv_u32(f, "llama.feed_forward_length", (uint32_t)s.ffn) ||
              kv_u32(f, "llama.attention.head_count", (uint32_t)s.heads) ||
              kv_u32(f, "llama.attention.head_count_kv", (uint32_t)s.kv_heads) ||
              kv_u32(f, "llama.attention.key_length", (uint32_t)s.head_dim) ||
              kv_u32(f, "llama.rope.dimension_count", (uint32_t)s.head_dim) ||
              kv_f32(f, "llama.rope.freq_base", s.rope_theta) ||
              kv_f32(f, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    for (int i = 0; i < nt && !err; i++) {
        int two = ts[i].ne1 > 1;
        err = put_str(f, ts[i].name) || put_u32(f, two ? 2 : 1) || put_u64(f, (uint64_t)ts[i].ne0) ||
              (two && put_u64(f, (uint64_t)ts[i].ne1)) || put_u32(f, (uint32_t)ts[i].type) ||
              put_u64(f, ts[i].offset);
    }
    static const uint8_t zeros[ALIGN];
    long pos = err ? 0 : ftell(f);
    if (!err && pos % ALIGN)
        err = put(f, zeros, (size_t)(ALIGN - pos % ALIGN));
    uint8_t *row = malloc(max_row);
    err = err || !row;
    uint64_t written = 0;
    for (int i = 0; i < nt && !err; i++) {
        uint64_t rb = row_bytes(ts[i].type, ts[i].ne0);
        for (int64_t r = 0; r < ts[i].ne1 && !err; r++) {
            fill_row(row, ts[i].type, ts[i].ne0);
            err = put(f, row, rb);
        }
        uint64_t pad = (rb * (uint64_t)ts[i].ne1) % ALIGN;
        if (!err && pad)
            err = put(f, zeros, (size_t)(ALIGN - pad));
        written += rb * (uint64_t)ts[i].ne1;
    }
    free(row);
    free(ts);
    if (fclose(f) != 0 || err) {
        fprintf(stderr, "random_gguf: writing %s failed: %s\n", out, strerror(errno));
        remove(out);
        return 1;
    }
    printf("%s: %s, %d layers, dim %d, heads %d/%d (head_dim %d), ffn %d, vocab %d, %s weights, %.2f GB\n",
           out, name, s.layers, s.dim, s.heads, s.kv_heads, s.head_dim, s.ffn, s.vocab, type_name, written / 1e9);
    return 0;
}
