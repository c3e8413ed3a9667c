/* Byte-level BPE tokenizer matching Hugging Face `tokenizers`: added/special tokens split out
 * first (leftmost-longest), the pre-tokenizer's regex splits (PCRE2, Unicode properties),
 * GPT-2 byte-to-unicode spelling and merges by rank; decoding and ChatML / Llama 3 chat
 * rendering. Built from GGUF `tokenizer.ggml.*` metadata or a HF tokenizer.json. */
#include "daemon/engine/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unictype.h>
#include <uninorm.h>
#include <unistd.h>

#include "common/status.h"
#include "daemon/engine/gguf.h"

#define TOK_MAX_VOCAB (1 << 24)
#define TOK_MAX_STEPS 8
#define TOK_ALPHABET_CPS 324 /* byte_to_unicode maps into [0, 324) */

/* Token attributes (bit flags). */
enum {
    ATTR_CONTROL = 1 << 0, /* special added token: matched only when parse_special */
    ATTR_USER = 1 << 1,    /* non-special added token: always matched */
    ATTR_LSTRIP = 1 << 2,  /* the match swallows whitespace on its left */
    ATTR_RSTRIP = 1 << 3,  /* ... and on its right */
    ATTR_UNUSED = 1 << 4,  /* an id no vocabulary entry names */
    ATTR_SINGLE_WORD = 1 << 5, /* matched only with no word character (alphanumeric, '_') beside it */
};

enum split_behavior {
    SPLIT_REMOVED,
    SPLIT_ISOLATED,
    SPLIT_MERGED_PREV,
    SPLIT_MERGED_NEXT,
    SPLIT_CONTIGUOUS,
};

struct pre_step {
    pcre2_code *re;
    int behavior; /* enum split_behavior */
    bool invert;
};

struct strbuf {
    char *p;
    size_t len, cap;
};

struct merge_slot {
    uint64_t key; /* (left id << 32) | right id; UINT64_MAX when empty */
    int32_t rank;
    int32_t result;
};

struct skv_tokenizer {
    int n_vocab;
    struct strbuf keys;  /* byte-level spelled token text (BPE vocabulary keys) */
    struct strbuf bytes; /* decoded bytes of each token (added tokens: their content) */
    uint32_t *key_off, *key_len;     /* (n_vocab) */
    uint32_t *bytes_off, *bytes_len; /* (n_vocab) */
    uint8_t *attr;                   /* (n_vocab) ATTR_* */
    bool *in_vocab;                  /* (n_vocab) entry of the BPE vocabulary */

    int32_t *vocab_slots; /* open addressing: spelled key -> id, -1 empty */
    size_t vocab_cap;     /* power of two */
    struct merge_slot *merge_slots;
    size_t merge_cap; /* power of two */
    int n_merges;

    uint16_t byte_cp[256];             /* GPT-2 bytes_to_unicode */
    int16_t cp_byte[TOK_ALPHABET_CPS]; /* its inverse, -1 outside the alphabet */
    int32_t byte_tok[256];             /* token of each single byte, -1 when missing */

    int32_t *added;         /* added token ids sorted by (first byte, length desc) */
    int n_added;
    uint32_t added_at[257]; /* bucket of first byte b: added[added_at[b] .. added_at[b+1]) */
    /* the same for the user (non-control) ones alone: the only ones text outside a mark can
     * hold, so plain text is not scanned against Llama 3's 256 control tokens at every '<' */
    int32_t *user_added;
    uint32_t user_at[257];

    struct pre_step steps[TOK_MAX_STEPS];
    int n_steps;
    bool ignore_merges;
    bool nfc;      /* tokenizer.json's normalizer is NFC (Qwen2's): text between added tokens is
                      put in Unicode's composed form before the pre-tokenizer (libunistring) */
    int32_t unk;   /* used for bytes the vocabulary lacks; -1: such bytes are dropped */
    bool fuse_unk;

    int32_t bos, eos, eot;
    bool add_bos;
    char *chat_template; /* NUL-terminated or NULL */
    size_t max_token_bytes; /* the longest token's bytes (the socket thread reads it per request) */
    /* the most characters of one BPE key: no token of a word merges more symbols (0: no bound) */
    size_t max_key_chars;
};

/* ---------------------------------------------------------------------------------------- */
/* small helpers */

static int sb_reserve(struct strbuf *b, size_t extra)
{
    if (extra > SIZE_MAX - b->len - 1)
        return SKV_E_NOMEM;
    size_t need = b->len + extra + 1;
    if (need <= b->cap)
        return SKV_OK;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < need)
        cap = cap > SIZE_MAX / 2 ? need : cap * 2;
    char *p = realloc(b->p, cap);
    if (p == NULL)
        return SKV_E_NOMEM;
    b->p = p;
    b->cap = cap;
    return SKV_OK;
}

static int sb_add(struct strbuf *b, const void *s, size_t n)
{
    if (sb_reserve(b, n) != SKV_OK)
        return skv_errorf(SKV_E_NOMEM, "tokenizer: no memory for %zu bytes of text", n);
    if (n > 0)
        memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
    return SKV_OK;
}

static int sb_adds(struct strbuf *b, const char *s)
{
    return sb_add(b, s, strlen(s));
}

/* NUL-terminated copy of n bytes, or NULL. */
static char *dup_text(const char *s, size_t n)
{
    char *p = n < SIZE_MAX ? malloc(n + 1) : NULL;
    if (p != NULL) {
        memcpy(p, s, n);
        p[n] = '\0';
    }
    return p;
}

/* Length of the valid UTF-8 sequence at p (strict: no overlongs, surrogates or > U+10FFFF),
 * 0 when invalid. */
static size_t utf8_next(const uint8_t *p, size_t len, uint32_t *cp)
{
    uint8_t c = p[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    size_t n;
    uint32_t v, min;
    if (c >= 0xc2 && c <= 0xdf) {
        n = 2;
        v = c & 0x1f;
        min = 0x80;
    } else if (c >= 0xe0 && c <= 0xef) {
        n = 3;
        v = c & 0x0f;
        min = 0x800;
    } else if (c >= 0xf0 && c <= 0xf4) {
        n = 4;
        v = c & 0x07;
        min = 0x10000;
    } else {
        return 0;
    }
    if (len < n)
        return 0;
    for (size_t i = 1; i < n; i++) {
        if ((p[i] & 0xc0) != 0x80)
            return 0;
        v = (v << 6) | (p[i] & 0x3f);
    }
    if (v < min || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff))
        return 0;
    *cp = v;
    return n;
}

static size_t utf8_put(uint32_t cp, char *out)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* Unicode White_Space (Rust char::is_whitespace, used by HF lstrip/rstrip). */
static bool is_unicode_space(uint32_t c)
{
    return (c >= 0x09 && c <= 0x0d) || c == 0x20 || c == 0x85 || c == 0xa0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
           c == 0x205f || c == 0x3000;
}

/* Python str.isspace (what Jinja's `trim` strips). */
static bool is_py_space(uint32_t c)
{
    return (c >= 0x1c && c <= 0x1f) || is_unicode_space(c);
}

static uint64_t hash_bytes(const void *s, size_t n)
{
    const uint8_t *p = s;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static size_t pow2_at_least(size_t n)
{
    size_t c = 16;
    while (c < n)
        c *= 2;
    return c;
}

/* ---------------------------------------------------------------------------------------- */
/* vocabulary and merges */

static const char *tok_key(const struct skv_tokenizer *t, int32_t id)
{
    return t->keys.p + t->key_off[id];
}

static int32_t vocab_find(const struct skv_tokenizer *t, const char *s, size_t n)
{
    if (t->vocab_slots == NULL)
        return -1;
    size_t mask = t->vocab_cap - 1;
    for (size_t i = hash_bytes(s, n) & mask;; i = (i + 1) & mask) {
        int32_t id = t->vocab_slots[i];
        if (id < 0)
            return -1;
        if (t->key_len[id] == n && memcmp(tok_key(t, id), s, n) == 0)
            return id;
    }
}

/* Indexes every in_vocab token; a later duplicate key wins (as a Python dict built in
 * order would). */
static int vocab_index(struct skv_tokenizer *t)
{
    t->vocab_cap = pow2_at_least((size_t)t->n_vocab * 2);
    t->vocab_slots = malloc(t->vocab_cap * sizeof *t->vocab_slots);
    if (t->vocab_slots == NULL)
        return skv_errorf(SKV_E_NOMEM, "tokenizer: no memory for the vocabulary index");
    memset(t->vocab_slots, 0xff, t->vocab_cap * sizeof *t->vocab_slots);
    size_t mask = t->vocab_cap - 1;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        if (!t->in_vocab[id])
            continue;
        const char *s = tok_key(t, id);
        size_t n = t->key_len[id];
        for (size_t i = hash_bytes(s, n) & mask;; i = (i + 1) & mask) {
            int32_t o = t->vocab_slots[i];
            if (o < 0 || (t->key_len[o] == n && memcmp(tok_key(t, o), s, n) == 0)) {
                t->vocab_slots[i] = id;
                break;
            }
        }
    }
    return SKV_OK;
}

static const struct merge_slot *merge_find(const struct skv_tokenizer *t, int32_t a, int32_t b)
{
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t mask = t->merge_cap - 1;
    for (size_t i = hash_u64(key) & mask;; i = (i + 1) & mask) {
        const struct merge_slot *s = &t->merge_slots[i];
        if (s->key == key)
            return s;
        if (s->key == UINT64_MAX)
            return NULL;
    }
}

static int merges_init(struct skv_tokenizer *t, size_t n)
{
    if (n > INT32_MAX / 2)
        return skv_errorf(SKV_E_LIMIT, "tokenizer: %zu merges", n);
    t->merge_cap = pow2_at_least(n * 2 + 1);
    t->merge_slots = malloc(t->merge_cap * sizeof *t->merge_slots);
    if (t->merge_slots == NULL)
        return skv_errorf(SKV_E_NOMEM, "tokenizer: no memory for %zu merges", n);
    for (size_t i = 0; i < t->merge_cap; i++)
        t->merge_slots[i].key = UINT64_MAX;
    return SKV_OK;
}

/* Adds merge `rank`: the pair (a, b) of spelled tokens. A later duplicate pair wins, as in HF. */
static int merge_add(struct skv_tokenizer *t, int rank, const char *a, size_t na, const char *b,
                     size_t nb, struct strbuf *scratch)
{
    int32_t ia = vocab_find(t, a, na), ib = vocab_find(t, b, nb);
    if (ia < 0 || ib < 0)
        return skv_errorf(SKV_E_FORMAT, "tokenizer: merge %d ('%.*s' '%.*s') names a token not in the vocabulary",
                          rank, (int)(na > 64 ? 64 : na), a, (int)(nb > 64 ? 64 : nb), b);
    scratch->len = 0;
    int rc = sb_add(scratch, a, na);
    if (rc == SKV_OK)
        rc = sb_add(scratch, b, nb);
    if (rc != SKV_OK)
        return rc;
    int32_t r = vocab_find(t, scratch->p, scratch->len);
    if (r < 0)
        return skv_errorf(SKV_E_FORMAT, "tokenizer: merge %d: '%.*s' is not in the vocabulary", rank,
                          (int)(scratch->len > 64 ? 64 : scratch->len), scratch->p);
    uint64_t key = ((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib;
    size_t mask = t->merge_cap - 1;
    for (size_t i = hash_u64(key) & mask;; i = (i + 1) & mask) {
        struct merge_slot *s = &t->merge_slots[i];
        if (s->key == key || s->key == UINT64_MAX) {
            if (s->key == UINT64_MAX)
                t->n_merges++;
            s->key = key;
            s->rank = rank;
            s->result = r;
            return SKV_OK;
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* construction */

static void init_alphabet(struct skv_tokenizer *t)
{
    int extra = 0;
    for (int i = 0; i < TOK_ALPHABET_CPS; i++)
        t->cp_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
        uint16_t cp = printable ? (uint16_t)b : (uint16_t)(256 + extra++);
        t->byte_cp[b] = cp;
        t->cp_byte[cp] = (int16_t)b;
    }
}

static int tok_alloc(int n_vocab, struct skv_tokenizer **out)
{
    if (n_vocab <= 0 || n_vocab > TOK_MAX_VOCAB)
        return skv_errorf(SKV_E_FORMAT, "tokenizer: vocabulary of %d tokens (limit %d)", n_vocab,
                          TOK_MAX_VOCAB);
    struct skv_tokenizer *t = calloc(1, sizeof *t);
    if (t == NULL)
        return skv_errorf(SKV_E_NOMEM, "tokenizer: no memory");
    t->n_vocab = n_vocab;
    t->key_off = calloc((size_t)n_vocab, sizeof *t->key_off);
    t->key_len = calloc((size_t)n_vocab, sizeof *t->key_len);
    t->bytes_off = calloc((size_t)n_vocab, sizeof *t->bytes_off);
    t->bytes_len = calloc((size_t)n_vocab, sizeof *t->bytes_len);
    t->attr = calloc((size_t)n_vocab, sizeof *t->attr);
    t->in_vocab = calloc((size_t)n_vocab, sizeof *t->in_vocab);
    t->bos = t->eos = t->eot = t->unk = -1;
    init_alphabet(t);
    if (t->key_off == NULL || t->key_len == NULL || t->bytes_off == NULL || t->bytes_len == NULL ||
        t->attr == NULL || t->in_vocab == NULL || sb_reserve(&t->keys, 0) != SKV_OK ||
        sb_reserve(&t->bytes, 0) != SKV_OK) {
        skv_tokenizer_free(&t);
        return skv_errorf(SKV_E_NOMEM, "tokenizer: no memory for %d tokens", n_vocab);
    }
    *out = t;
    return SKV_OK;
}

void skv_tokenizer_free(struct skv_tokenizer **tok_p)
{
    if (tok_p == NULL || *tok_p == NULL)
        return;
    struct skv_tokenizer *t = *tok_p;
    for (int i = 0; i < t->n_steps; i++)
        pcre2_code_free(t->steps[i].re);
    free(t->keys.p);
    free(t->bytes.p);
    free(t->key_off);
    free(t->key_len);
    free(t->bytes_off);
    free(t->bytes_len);
    free(t->attr);
    free(t->in_vocab);
    free(t->vocab_slots);
    free(t->merge_slots);
    free(t->added);
    free(t->user_added);
    free(t->chat_template);
    free(t);
    *tok_p = NULL;
}

static bool in_alphabet(const struct skv_tokenizer *t, const char *s, size_t n)
{
    const uint8_t *p = (const uint8_t *)s;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t k = utf8_next(p + i, n - i, &cp);
        if (k == 0 || cp >= TOK_ALPHABET_CPS || t->cp_byte[cp] < 0)
            return false;
        i += k;
    }
    return true;
}

/* Appends the byte-level spelling of n bytes to b. */
static int spell(const struct skv_tokenizer *t, const void *s, size_t n, struct strbuf *b)
{
    if (n > SIZE_MAX / 2 || sb_reserve(b, 2 * n) != SKV_OK)
        return skv_errorf(SKV_E_NOMEM, "tokenizer: no memory to spell %zu bytes", n);
    const uint8_t *p = s;
    char *o = b->p + b->len;
    for (size_t i = 0; i < n; i++)
        o += utf8_put(t->byte_cp[p[i]], o);
    b->len = (size_t)(o - b->p);
    b->p[b->len] = '\0';
    return SKV_OK;
}

/* Appends the bytes a spelled string stands for; characters outside the alphabet are kept as
 * their own UTF-8 (and invalid bytes as themselves). */
static int unspell(const struct skv_tokenizer *t, const char *s, size_t n, struct strbuf *b)
{
    if (sb_reserve(b, n) != SKV_OK)
        return skv_errorf(SKV_E_NOMEM, "tokenizer: no memory");
    const uint8_t *p = (const uint8_t *)s;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t k = utf8_next(p + i, n - i, &cp);
        if (k == 0) {
            b->p[b->len++] = (char)p[i++];
        } else if (cp < TOK_ALPHABET_CPS && t->cp_byte[cp] >= 0) {
            b->p[b->len++] = (char)t->cp_byte[cp];
            i += k;
        } else {
            memcpy(b->p + b->len, p + i, k);
            b->len += k;
            i += k;
        }
    }
    b->p[b->len] = '\0';
    return SKV_OK;
}

static int set_key(struct skv_tokenizer *t, int32_t id, const char *s, size_t n)
{
    if (t->keys.len > UINT32_MAX - n)
        return skv_errorf(SKV_E_LIMIT, "tokenizer: vocabulary text over 4 GiB");
    t->key_off[id] = (uint32_t)t->keys.len;
    t->key_len[id] = (uint32_t)n;
    return sb_add(&t->keys, s, n);
}

static int set_bytes_raw(struct skv_tokenizer *t, int32_t id, const char *s, size_t n)
{
    if (t->bytes.len > UINT32_MAX - n)
        return skv_errorf(SKV_E_LIMIT, "tokenizer: vocabulary text over 4 GiB");
    t->bytes_off[id] = (uint32_t)t->bytes.len;
    t->bytes_len[id] = (uint32_t)n;
    return sb_add(&t->bytes, s, n);
}

static int set_bytes_unspelled(struct skv_tokenizer *t, int32_t id)
{
    size_t start = t->bytes.len;
    int rc = unspell(t, tok_key(t, id), t->key_len[id], &t->bytes);
    if (rc != SKV_OK)
        return rc;
    if (start > UINT32_MAX || t->bytes.len - start > UINT32_MAX)
        return skv_errorf(SKV_E_LIMIT, "tokenizer: vocabulary text over 4 GiB");
    t->bytes_off[id] = (uint32_t)start;
    t->bytes_len[id] = (uint32_t)(t->bytes.len - start);
    return SKV_OK;
}

struct added_key {
    uint8_t first; /* first byte of the token text */
    uint32_t len;
    int32_t id;
};

static int cmp_added(const void *pa, const void *pb)
{
    const struct added_key *a = pa, *b = pb;
    if (a->first != b->first)
        return a->first < b->first ? -1 : 1;
    if (a->len != b->len)
        return a->len > b->len ? -1 : 1; /* longest first */
    return a->id < b->id ? -1 : (a->id > b->id);
}

/* After keys, bytes, attributes and merges: byte tokens and the added-token buckets. */
static int finish_build(struct skv_tokenizer *t)
{
    char sp[4];
    for (int b = 0; b < 256; b++) {
        size_t n = utf8_put(t->byte_cp[b], sp);
        t->byte_tok[b] = vocab_find(t, sp, n);
    }
    int n_added = 0;
    for (int32_t id = 0; id < t->n_vocab; id++)
        if ((t->attr[id] & (ATTR_CONTROL | ATTR_USER)) && t->bytes_len[id] > 0)
            n_added++;
    struct added_key *keys = malloc((size_t)(n_added ? n_added : 1) * sizeof *keys);
    t->added = malloc((size_t)(n_added ? n_added : 1) * sizeof *t->added);
    t->user_added = malloc((size_t)(n_added ? n_added : 1) * sizeof *t->user_added);
    if (keys == NULL || t->added == NULL || t->user_added == NULL) {
        free(keys);
        return skv_errorf(SKV_E_NOMEM, "tokenizer: no memory for %d added tokens", n_added);
    }
    t->n_added = 0;
    for (int32_t id = 0; id < t->n_vocab; id++)
        if ((t->attr[id] & (ATTR_CONTROL | ATTR_USER)) && t->bytes_len[id] > 0)
            keys[t->n_added++] = (struct added_key){(uint8_t)t->bytes.p[t->bytes_off[id]],
                                                    t->bytes_len[id], id};
    qsort(keys, (size_t)t->n_added, sizeof *keys, cmp_added);
    for (int i = 0; i < t->n_added; i++)
        t->added[i] = keys[i].id;
    free(keys);
    int k = 0;
    for (int b = 0; b <= 256; b++) {
        while (b < 256 && k < t->n_added &&
               (uint8_t)t->bytes.p[t->bytes_off[t->added[k]]] < (uint8_t)b)
            k++;
        t->added_at[b] = (uint32_t)k;
    }
    t->added_at[256] = (uint32_t)t->n_added;
    int n_user = 0;
    for (int b = 0; b < 256; b++) {
        t->user_at[b] = (uint32_t)n_user;
        for (uint32_t i = t->added_at[b]; i < t->added_at[b + 1]; i++)
            if (!(t->attr[t->added[i]] & ATTR_CONTROL))
                t->user_added[n_user++] = t->added[i];
    }
    t->user_at[256] = (uint32_t)n_user;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        t->max_token_bytes = t->bytes_len[id] > t->max_token_bytes ? t->bytes_len[id] : t->max_token_bytes;
        if (t->in_vocab[id]) {
            size_t chars = 0;
            for (uint32_t c = 0; c < t->key_len[id]; c++)
                chars += ((uint8_t)t->keys.p[t->key_off[id] + c] & 0xc0) != 0x80;
            t->max_key_chars = chars > t->max_key_chars ? chars : t->max_key_chars;
        }
    }
    return SKV_OK;
}

/* PCRE2 10.42 knows Unicode 14, HF's Oniguruma a newer Unicode: the characters Oniguruma puts in
 * a property that Unicode 14 does not (added to the property in every pattern; harmless when the
 * PCRE2 in use already knows them). */
static const struct unicode_extra {
    const char *prop;
    const char *ranges; /* PCRE2 class items */
} UNICODE_EXTRA[] = {
    /* generated by tests/reference/gen_tokenizer_fixture.py --unicode-table (tokenizers 0.23.3) */
    {"L",
     "\\x{1c89}-\\x{1c8a}\\x{a7cb}-\\x{a7cd}\\x{a7da}-\\x{a7dc}\\x{105c0}-\\x{105f3}"
     "\\x{10d4a}-\\x{10d65}\\x{10d6f}-\\x{10d85}\\x{10ec2}-\\x{10ec4}\\x{1123f}-\\x{11240}"
     "\\x{11380}-\\x{11389}\\x{1138b}\\x{1138e}\\x{11390}-\\x{113b5}\\x{113b7}\\x{113d1}"
     "\\x{113d3}\\x{11bc0}-\\x{11be0}\\x{11f02}\\x{11f04}-\\x{11f10}\\x{11f12}-\\x{11f33}"
     "\\x{1342f}\\x{13441}-\\x{13446}\\x{13460}-\\x{143fa}\\x{16100}-\\x{1611d}"
     "\\x{16d40}-\\x{16d6c}\\x{18cff}\\x{1b132}\\x{1b155}\\x{1df25}-\\x{1df2a}"
     "\\x{1e030}-\\x{1e06d}\\x{1e4d0}-\\x{1e4eb}\\x{1e5d0}-\\x{1e5ed}\\x{1e5f0}\\x{2b739}"
     "\\x{2ebf0}-\\x{2ee5d}\\x{31350}-\\x{323af}"},
    {"N",
     "\\x{10d40}-\\x{10d49}\\x{116d0}-\\x{116e3}\\x{11bf0}-\\x{11bf9}\\x{11f50}-\\x{11f59}"
     "\\x{16130}-\\x{16139}\\x{16d70}-\\x{16d79}\\x{1ccf0}-\\x{1ccf9}\\x{1d2c0}-\\x{1d2d3}"
     "\\x{1e4f0}-\\x{1e4f9}\\x{1e5f1}-\\x{1e5fa}"},
    {"M",
     "\\x{897}\\x{cf3}\\x{ece}\\x{10d69}-\\x{10d6d}\\x{10efc}-\\x{10eff}\\x{11241}"
     "\\x{113b8}-\\x{113c0}\\x{113c2}\\x{113c5}\\x{113c7}-\\x{113ca}\\x{113cc}-\\x{113d0}"
     "\\x{113d2}\\x{113e1}-\\x{113e2}\\x{11f00}-\\x{11f01}\\x{11f03}\\x{11f34}-\\x{11f3a}"
     "\\x{11f3e}-\\x{11f42}\\x{11f5a}\\x{13440}\\x{13447}-\\x{13455}\\x{1611e}-\\x{1612f}"
     "\\x{1e08f}\\x{1e4ec}-\\x{1e4ef}\\x{1e5ee}-\\x{1e5ef}"},
    {"Lu",
     "\\x{1c89}\\x{a7cb}-\\x{a7cc}\\x{a7da}\\x{a7dc}\\x{10d50}-\\x{10d65}"},
    {"Ll",
     "\\x{1c8a}\\x{a7cd}\\x{a7db}\\x{10d70}-\\x{10d85}\\x{1df25}-\\x{1df2a}"},
    {"Lt",
     ""},
    {"Lm",
     "\\x{10d4e}\\x{10d6f}\\x{16d40}-\\x{16d42}\\x{16d6b}-\\x{16d6c}\\x{1e030}-\\x{1e06d}"
     "\\x{1e4eb}"},
    {"Lo",
     "\\x{105c0}-\\x{105f3}\\x{10d4a}-\\x{10d4d}\\x{10d4f}\\x{10ec2}-\\x{10ec4}"
     "\\x{1123f}-\\x{11240}\\x{11380}-\\x{11389}\\x{1138b}\\x{1138e}\\x{11390}-\\x{113b5}"
     "\\x{113b7}\\x{113d1}\\x{113d3}\\x{11bc0}-\\x{11be0}\\x{11f02}\\x{11f04}-\\x{11f10}"
     "\\x{11f12}-\\x{11f33}\\x{1342f}\\x{13441}-\\x{13446}\\x{13460}-\\x{143fa}"
     "\\x{16100}-\\x{1611d}\\x{16d43}-\\x{16d6a}\\x{18cff}\\x{1b132}\\x{1b155}"
     "\\x{1e4d0}-\\x{1e4ea}\\x{1e5d0}-\\x{1e5ed}\\x{1e5f0}\\x{2b739}\\x{2ebf0}-\\x{2ee5d}"
     "\\x{31350}-\\x{323af}"},
    {"P",
     "\\x{1b4e}-\\x{1b4f}\\x{1b7f}\\x{10d6e}\\x{113d4}-\\x{113d5}\\x{113d7}-\\x{113d8}"
     "\\x{11b00}-\\x{11b09}\\x{11be1}\\x{11f43}-\\x{11f4f}\\x{16d6d}-\\x{16d6f}\\x{1e5ff}"},
};

/* Oniguruma's \s: Unicode White_Space (PCRE2's also has U+180E). */
static const char WHITE_SPACE[] =
    "\\t\\n\\x0b\\f\\r\\x20\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}"
    "\\x{205f}\\x{3000}";

static const char *unicode_extra(const char *name, size_t n)
{
    for (size_t i = 0; i < sizeof UNICODE_EXTRA / sizeof UNICODE_EXTRA[0]; i++)
        if (strlen(UNICODE_EXTRA[i].prop) == n && memcmp(UNICODE_EXTRA[i].prop, name, n) == 0)
            return UNICODE_EXTRA[i].ranges[0] ? UNICODE_EXTRA[i].ranges : NULL;
    return NULL;
}

/* Rewrites a tokenizer.json (Oniguruma) pattern so PCRE2 classifies characters as Oniguruma
 * does: \p{X} gains UNICODE_EXTRA's characters, \s and \S use WHITE_SPACE. (\P{X} and \S
 * inside a character class are left as they are.) */
static int rewrite_pattern(const char *src, size_t len, struct strbuf *out)
{
    bool in_class = false;
    int rc = SKV_OK;
    for (size_t i = 0; i < len && rc == SKV_OK;) {
        char c = src[i];
        if (c == '\\' && i + 1 < len) {
            char n = src[i + 1];
            const char *close = (n == 'p' || n == 'P') && i + 2 < len && src[i + 2] == '{'
                                    ? memchr(src + i + 3, '}', len - i - 3)
                                    : NULL;
            const char *extra = close ? unicode_extra(src + i + 3, (size_t)(close - src - i - 3)) : NULL;
            size_t esc_len = close ? (size_t)(close - src - i + 1) : 2;
            if (extra != NULL && !(in_class && n == 'P')) {
                if (!in_class)
                    rc = sb_adds(out, n == 'p' ? "[" : "[^");
                if (rc == SKV_OK)
                    rc = sb_add(out, "\\p", 2);
                if (rc == SKV_OK)
                    rc = sb_add(out, src + i + 2, esc_len - 2);
                if (rc == SKV_OK)
                    rc = sb_adds(out, extra);
                if (rc == SKV_OK && !in_class)
                    rc = sb_adds(out, "]");
            } else if (n == 's' || (n == 'S' && !in_class)) {
                if (!in_class)
                    rc = sb_adds(out, n == 's' ? "[" : "[^");
                if (rc == SKV_OK)
                    rc = sb_adds(out, WHITE_SPACE);
                if (rc == SKV_OK && !in_class)
                    rc = sb_adds(out, "]");
            } else {
                rc = sb_add(out, src + i, esc_len);
            }
            i += esc_len;
            continue;
        }
        if (!in_class && c == '[') {
            /* "[", "[^", then a leading ']' is a literal member */
            size_t k = i + 1;
            if (k < len && src[k] == '^')
                k++;
            if (k < len && src[k] == ']')
                k++;
            rc = sb_add(out, src + i, k - i);
            in_class = true;
            i = k;
            continue;
        }
        if (in_class && c == '[' && i + 1 < len && src[i + 1] == ':') { /* [:alpha:] */
            const char *e = NULL;
            for (size_t k = i + 2; k + 1 < len && e == NULL; k++)
                if (src[k] == ':' && src[k + 1] == ']')
                    e = src + k + 2;
            size_t n = e ? (size_t)(e - src - i) : 1;
            rc = sb_add(out, src + i, n);
            i += n;
            continue;
        }
        if (in_class && c == ']')
            in_class = false;
        rc = sb_add(out, &c, 1);
        i++;
    }
    return rc;
}

static int add_step(struct skv_tokenizer *t, const char *pattern, size_t len, bool literal,
                    int behavior, bool invert)
{
    if (t->n_steps >= TOK_MAX_STEPS)
        return skv_errorf(SKV_E_UNSUPPORTED, "tokenizer: more than %d pre-tokenizer splits",
                          TOK_MAX_STEPS);
    int err;
    PCRE2_SIZE at;
    struct strbuf pat = {0};
    uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    int rc = literal ? sb_add(&pat, pattern, len) : rewrite_pattern(pattern, len, &pat);
    if (rc != SKV_OK) {
        free(pat.p);
        return skv_errorf(SKV_E_NOMEM, "tokenizer: no memory for a regex");
    }
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat.p, pat.len, opts, &err, &at, NULL);
    free(pat.p);
    if (re == NULL) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(err, msg, sizeof msg);
        return skv_errorf(SKV_E_UNSUPPORTED, "tokenizer: pre-tokenizer regex '%.*s' at %zu: %s",
                          (int)(len > 120 ? 120 : len), pattern, (size_t)at, (const char *)msg);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* interpreter when JIT is unavailable */
    t->steps[t->n_steps].re = re;
    t->steps[t->n_steps].behavior = behavior;
    t->steps[t->n_steps].invert = invert;
    t->n_steps++;
    return SKV_OK;
}

/* The regex ByteLevel(use_regex=true) applies: GPT-2's. */
static const char PAT_GPT2[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char PAT_LLAMA3[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char PAT_QWEN2[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char PAT_QWEN35[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}"
    "| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char PAT_TEKKEN[] =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
    "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char PAT_GPT4O[] =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char PAT_DIGIT[] = "\\p{N}";

/* GGUF tokenizer.ggml.pre -> the splits of that family's tokenizer.json, and the flags
 * llama.cpp's llama-vocab.cpp gives the family: ignore_merges, and add_bos when the file has no
 * tokenizer.ggml.add_bos_token. */
static const struct pre_family {
    const char *names; /* '|'-separated */
    const char *pat1, *pat2;
    bool ignore_merges;
    bool add_bos;
    bool nfc; /* NFC before the pre-tokenizer: Qwen2's tokenizer.json, and transformers' GGUF
               * converter for Qwen2 (a GGUF keeps no normalizer: a Qwen2 file lost it here) */
    bool qwen; /* QWEN_USER_ADDED are not control tokens */
} PRE_FAMILIES[] = {
    {"default|gpt2|gpt-2", PAT_GPT2, NULL, false, false, false, false},
    /* SmolLM2 / StarCoder: Digits(individual_digits) then ByteLevel(use_regex) */
    {"smollm|starcoder|refact", PAT_DIGIT, PAT_GPT2, false, false, false, false},
    {"llama3|llama-v3|llama-bpe|falcon3|falcon-h1|pixtral", PAT_LLAMA3, NULL, true, true, false, false},
    {"dbrx|smaug-bpe", PAT_LLAMA3, NULL, false, false, false, false},
    {"qwen2|deepseek-r1-qwen", PAT_QWEN2, NULL, false, false, true, true},
    {"megrez", PAT_QWEN2, NULL, false, false, false, false},
    {"qwen35", PAT_QWEN35, NULL, false, false, true, true},
    {"tekken", PAT_TEKKEN, NULL, true, true, false, false},
    {"gpt-4o|llama4", PAT_GPT4O, NULL, false, false, false, false},
};

/* Qwen2.5's added tokens that its tokenizer.json says are not special (fill-in-the-middle and
 * repository markup: matched in any text, kept by skip_special), which llama.cpp's converter
 * writes as control tokens (type 3) like every <|...|> name */
static const char *const QWEN_USER_ADDED[] = {"<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                                              "<|fim_pad|>",    "<|repo_name|>",  "<|file_sep|>"};

static bool qwen_user_added(const char *s, size_t n)
{
    for (size_t i = 0; i < sizeof QWEN_USER_ADDED / sizeof QWEN_USER_ADDED[0]; i++)
        if (strlen(QWEN_USER_ADDED[i]) == n && memcmp(QWEN_USER_ADDED[i], s, n) == 0)
            return true;
    return false;
}

static bool name_in_list(const char *list, const char *name, size_t n)
{
    for (const char *p = list;;) {
        const char *e = strchr(p, '|');
        size_t k = e ? (size_t)(e - p) : strlen(p);
        if (k == n && memcmp(p, name, n) == 0)
            return true;
        if (e == NULL)
            return false;
        p = e + 1;
    }
}

static int32_t find_added_by_text(const struct skv_tokenizer *t, const char *s)
{
    size_t n = strlen(s);
    for (int i = 0; i < t->n_added; i++) {
        int32_t id = t->added[i];
        if (t->bytes_len[id] == n && memcmp(t->bytes.p + t->bytes_off[id], s, n) == 0)
            return id;
    }
    return -1;
}

static int32_t find_first_added(const struct skv_tokenizer *t, const char *const *names)
{
    for (; *names != NULL; names++) {
        int32_t id = find_added_by_text(t, *names);
        if (id >= 0)
            return id;
    }
    return -1;
}

static const char *const EOT_NAMES[] = {"<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", NULL};

/* ---------------------------------------------------------------------------------------- */
/* from GGUF */

static int gguf_opt_id(const struct skv_gguf *g, const char *key, int n_vocab, int32_t *out)
{
    int64_t v;
    if (skv_gguf_find_key(g, key) < 0)
        return SKV_OK;
    if (!skv_gguf_get_i64(g, key, &v))
        return skv_errorf(SKV_E_FORMAT, "tokenizer: %s is not an integer", key);
    if (v < 0 || v >= n_vocab)
        return skv_errorf(SKV_E_FORMAT, "tokenizer: %s = %lld outside the vocabulary (%d)", key,
                          (long long)v, n_vocab);
    *out = (int32_t)v;
    return SKV_OK;
}

int skv_tokenizer_from_gguf(const struct skv_gguf *g, struct skv_tokenizer **out)
{
    struct skv_tokenizer *t = NULL;
    struct strbuf scratch = {0};
    struct skv_gguf_str s;
    int type, rc;
    uint64_t n_tok, n_merges = 0, n_types = 0;

    if (g == NULL || out == NULL)
        return skv_errorf(SKV_E_INVAL, "tokenizer: NULL argument");
    if (!skv_gguf_get_str(g, "tokenizer.ggml.model", &s))
        return skv_errorf(SKV_E_NOT_FOUND, "tokenizer: no tokenizer.ggml.model in the GGUF");
    if (!(s.len == 4 && memcmp(s.ptr, "gpt2", 4) == 0))
        return skv_errorf(SKV_E_UNSUPPORTED, "tokenizer: tokenizer.ggml.model '%.*s' (only byte-level BPE 'gpt2')",
                          (int)(s.len > 64 ? 64 : s.len), s.ptr);
    const char *pre = "default";
    size_t pre_len = strlen(pre);
    if (skv_gguf_find_key(g, "tokenizer.ggml.pre") >= 0) {
        if (!skv_gguf_get_str(g, "tokenizer.ggml.pre", &s))
            return skv_errorf(SKV_E_FORMAT, "tokenizer: tokenizer.ggml.pre is not a string");
        pre = s.ptr;
        pre_len = (size_t)s.len;
    }
    const struct pre_family *fam = NULL;
    for (size_t i = 0; i < sizeof PRE_FAMILIES / sizeof PRE_FAMILIES[0]; i++)
        if (name_in_list(PRE_FAMILIES[i].names, pre, pre_len))
            fam = &PRE_FAMILIES[i];
    if (fam == NULL)
        return skv_errorf(SKV_E_UNSUPPORTED, "tokenizer: unknown pre-tokenizer tokenizer.ggml.pre = '%.*s'",
                          (int)(pre_len > 64 ? 64 : pre_len), pre);

    if (!skv_gguf_get_arr(g, "tokenizer.ggml.tokens", &type, &n_tok) || type != SKV_GGUF_STRING)
        return skv_errorf(SKV_E_FORMAT, "tokenizer: tokenizer.ggml.tokens missing or not a string array");
    if (n_tok == 0 || n_tok > TOK_MAX_VOCAB)
        return skv_errorf(SKV_E_FORMAT, "tokenizer: %llu tokens (limit %d)", (unsigned long long)n_tok,
                          TOK_MAX_VOCAB);
    if (skv_gguf_find_key(g, "tokenizer.ggml.token_type") >= 0 &&
        (!skv_gguf_get_arr(g, "tokenizer.ggml.token_type", &type, &n_types) || n_types != n_tok))
        return skv_errorf(SKV_E_FORMAT, "tokenizer: tokenizer.ggml.token_type has %llu entries for %llu tokens",
                          (unsigned long long)n_types, (unsigned long long)n_tok);
    if (skv_gguf_find_key(g, "tokenizer.ggml.merges") >= 0 &&
        (!skv_gguf_get_arr(g, "tokenizer.ggml.merges", &type, &n_merges) || type != SKV_GGUF_STRING))
        return skv_errorf(SKV_E_FORMAT, "tokenizer: tokenizer.ggml.merges is not a string array");

    rc = tok_alloc((int)n_tok, &t);
    if (rc != SKV_OK)
        return rc;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        int64_t tt = 1;
        if (!skv_gguf_get_arr_str(g, "tokenizer.ggml.tokens", (uint64_t)id, &s)) {
            rc = skv_errorf(SKV_E_FORMAT, "tokenizer: token %d unreadable", id);
            goto out_free;
        }
        if (n_types > 0 && !skv_gguf_get_arr_i64(g, "tokenizer.ggml.token_type", (uint64_t)id, &tt)) {
            rc = skv_errorf(SKV_E_FORMAT, "tokenizer: token_type %d is not an integer", id);
            goto out_free;
        }
        if (s.len > UINT32_MAX) {
            rc = skv_errorf(SKV_E_FORMAT, "tokenizer: token %d longer than 4 GiB", id);
            goto out_free;
        }
        /* As transformers builds it: text outside the byte alphabet is respelled byte-level;
         * control (3) and user-defined (4) tokens become added tokens when they are spelled in
         * the alphabet (otherwise they are llama.cpp mislabels and stay plain vocabulary). */
        bool alpha = in_alphabet(t, s.ptr, (size_t)s.len);
        if (alpha) {
            rc = set_key(t, id, s.ptr, (size_t)s.len);
        } else {
            scratch.len = 0;
            rc = spell(t, s.ptr, (size_t)s.len, &scratch);
            if (rc == SKV_OK)
                rc = set_key(t, id, scratch.p, scratch.len);
        }
        if (rc != SKV_OK)
            goto out_free;
        t->in_vocab[id] = true;
        if (alpha && (tt == 3 || tt == 4)) {
            t->attr[id] = tt == 3 && !(fam->qwen && qwen_user_added(s.ptr, (size_t)s.len)) ? ATTR_CONTROL : ATTR_USER;
            rc = set_bytes_raw(t, id, s.ptr, (size_t)s.len);
        } else if (tt == 5) { /* unused: llama.cpp's "[PAD151665]" rows past Qwen2.5's tokenizer.json,
                                 which decode to nothing there (and in llama.cpp), not to their name */
            rc = set_bytes_raw(t, id, "", 0);
        } else {
            rc = set_bytes_unspelled(t, id);
        }
        if (rc != SKV_OK)
            goto out_free;
    }
    rc = vocab_index(t);
    if (rc != SKV_OK)
        goto out_free;
    rc = merges_init(t, (size_t)n_merges);
    if (rc != SKV_OK)
        goto out_free;
    for (uint64_t i = 0; i < n_merges; i++) {
        if (!skv_gguf_get_arr_str(g, "tokenizer.ggml.merges", i, &s)) {
            rc = skv_errorf(SKV_E_FORMAT, "tokenizer: merge %llu unreadable", (unsigned long long)i);
            goto out_free;
        }
        const char *sp = s.len > 0 ? memchr(s.ptr + 1, ' ', (size_t)s.len - 1) : NULL;
        if (sp == NULL) {
            rc = skv_errorf(SKV_E_FORMAT, "tokenizer: merge %llu '%.*s' is not 'a b'",
                            (unsigned long long)i, (int)(s.len > 64 ? 64 : s.len), s.ptr);
            goto out_free;
        }
        size_t na = (size_t)(sp - s.ptr);
        rc = merge_add(t, (int)i, s.ptr, na, sp + 1, (size_t)s.len - na - 1, &scratch);
        if (rc != SKV_OK)
            goto out_free;
    }
    rc = finish_build(t);
    if (rc != SKV_OK)
        goto out_free;

    rc = add_step(t, fam->pat1, strlen(fam->pat1), false, SPLIT_ISOLATED, false);
    if (rc == SKV_OK && fam->pat2 != NULL)
        rc = add_step(t, fam->pat2, strlen(fam->pat2), false, SPLIT_ISOLATED, false);
    if (rc != SKV_OK)
        goto out_free;
    t->ignore_merges = fam->ignore_merges;
    t->nfc = fam->nfc;

    rc = gguf_opt_id(g, "tokenizer.ggml.bos_token_id", t->n_vocab, &t->bos);
    if (rc == SKV_OK)
        rc = gguf_opt_id(g, "tokenizer.ggml.eos_token_id", t->n_vocab, &t->eos);
    if (rc == SKV_OK)
        rc = gguf_opt_id(g, "tokenizer.ggml.eot_token_id", t->n_vocab, &t->eot);
    if (rc != SKV_OK)
        goto out_free;
    if (t->eot < 0)
        t->eot = find_first_added(t, EOT_NAMES);
    if (t->eot < 0)
        t->eot = t->eos;
    t->add_bos = fam->add_bos;
    if (skv_gguf_find_key(g, "tokenizer.ggml.add_bos_token") >= 0 &&
        !skv_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &t->add_bos)) {
        rc = skv_errorf(SKV_E_FORMAT, "tokenizer: tokenizer.ggml.add_bos_token is not a bool");
        goto out_free;
    }
    if (skv_gguf_get_str(g, "tokenizer.chat_template", &s)) {
        t->chat_template = dup_text(s.ptr, (size_t)s.len);
        if (t->chat_template == NULL) {
            rc = skv_errorf(SKV_E_NOMEM, "tokenizer: no memory for the chat template");
            goto out_free;
        }
    }
    free(scratch.p);
    *out = t;
    return SKV_OK;

out_free:
    free(scratch.p);
    skv_tokenizer_free(&t);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* from tokenizer.json */

static bool jbool(const json_t *o, const char *key, bool dflt)
{
    const json_t *v = json_object_get(o, key);
    return json_is_boolean(v) ? json_is_true(v) : dflt;
}

static bool jstr_is(const json_t *o, const char *key, const char *want)
{
    const json_t *v = json_object_get(o, key);
    return json_is_string(v) && strcmp(json_string_value(v), want) == 0;
}

/* A string field that must be absent, null or "". */
static bool jstr_empty(const json_t *o, const char *key)
{
    const json_t *v = json_object_get(o, key);
    return v == NULL || json_is_null(v) || (json_is_string(v) && json_string_length(v) == 0);
}

static int parse_pre(struct skv_tokenizer *t, const json_t *p, bool *byte_level)
{
    if (p == NULL || json_is_null(p))
        return SKV_OK;
    const json_t *type = json_object_get(p, "type");
    const char *ty = json_is_string(type) ? json_string_value(type) : "";
    if (*byte_level)
        return skv_errorf(SKV_E_UNSUPPORTED, "tokenizer.json: pre-tokenizer '%s' after ByteLevel", ty);
    if (strcmp(ty, "Sequence") == 0) {
        const json_t *list = json_object_get(p, "pretokenizers");
        size_t i;
        const json_t *e;
        if (!json_is_array(list))
            return skv_errorf(SKV_E_FORMAT, "tokenizer.json: Sequence without pretokenizers");
        json_array_foreach(list, i, e) {
            int rc = parse_pre(t, e, byte_level);
            if (rc != SKV_OK)
                return rc;
        }
        return SKV_OK;
    }
    if (strcmp(ty, "ByteLevel") == 0) {
        if (jbool(p, "add_prefix_space", false))
            return skv_errorf(SKV_E_UNSUPPORTED, "tokenizer.json: ByteLevel add_prefix_space");
        *byte_level = true;
        if (jbool(p, "use_regex", true))
            return add_step(t, PAT_GPT2, strlen(PAT_GPT2), false, SPLIT_ISOLATED, false);
        return SKV_OK;
    }
    if (strcmp(ty, "Digits") == 0) {
        if (jbool(p, "individual_digits", false))
            return add_step(t, PAT_DIGIT, strlen(PAT_DIGIT), false, SPLIT_ISOLATED, false);
        return add_step(t, "\\p{N}+", 6, false, SPLIT_ISOLATED, false);
    }
    if (strcmp(ty, "Split") == 0) {
        static const char *const behaviors[] = {"Removed", "Isolated", "MergedWithPrevious",
                                                "MergedWithNext", "Contiguous"};
        const json_t *pat = json_object_get(p, "pattern");
        const json_t *beh = json_object_get(p, "behavior");
        const json_t *re = json_object_get(pat, "Regex"), *lit = json_object_get(pat, "String");
        int behavior = -1;
        for (int i = 0; i < 5 && json_is_string(beh); i++)
            if (strcmp(json_string_value(beh), behaviors[i]) == 0)
                behavior = i;
        if (behavior < 0 || !(json_is_string(re) || json_is_string(lit)))
            return skv_errorf(SKV_E_FORMAT, "tokenizer.json: Split without a pattern or a known behavior");
        const json_t *src = json_is_string(re) ? re : lit;
        return add_step(t, json_string_value(src), json_string_length(src), src == lit, behavior,
                        jbool(p, "invert", false));
    }
    return skv_errorf(SKV_E_UNSUPPORTED, "tokenizer.json: pre-tokenizer type '%s'", ty);
}

static int json_token_id(const json_t *v, int64_t *id)
{
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= TOK_MAX_VOCAB)
        return skv_errorf(SKV_E_FORMAT, "tokenizer.json: token id missing or outside [0, %d)",
                          TOK_MAX_VOCAB);
    *id = json_integer_value(v);
    return SKV_OK;
}

/* The id of a token given as "text" or {"content": "text"} (tokenizer_config.json). */
static int32_t config_token(const struct skv_tokenizer *t, const json_t *v)
{
    if (json_is_object(v))
        v = json_object_get(v, "content");
    if (!json_is_string(v))
        return -1;
    int32_t id = find_added_by_text(t, json_string_value(v));
    return id >= 0 ? id : vocab_find(t, json_string_value(v), json_string_length(v));
}

/* tokenizer_config.json next to tokenizer.json: bos/eos, add_bos_token, chat_template. */
static int read_config(struct skv_tokenizer *t, const char *json_path)
{
    const char *slash = strrchr(json_path, '/');
    size_t dir_len = slash ? (size_t)(slash - json_path + 1) : 0;
    static const char name[] = "tokenizer_config.json";
    char *path = malloc(dir_len + sizeof name);
    if (path == NULL)
        return skv_errorf(SKV_E_NOMEM, "tokenizer: no memory");
    memcpy(path, json_path, dir_len);
    memcpy(path + dir_len, name, sizeof name);
    if (access(path, F_OK) != 0) {
        free(path);
        return SKV_OK;
    }
    json_error_t err;
    json_t *cfg = json_load_file(path, 0, &err);
    free(path);
    if (cfg == NULL)
        return skv_errorf(SKV_E_FORMAT, "tokenizer_config.json: line %d: %s", err.line, err.text);
    int rc = SKV_OK;
    int32_t id = config_token(t, json_object_get(cfg, "bos_token"));
    if (id >= 0)
        t->bos = id;
    id = config_token(t, json_object_get(cfg, "eos_token"));
    if (id >= 0)
        t->eos = id;
    t->add_bos = jbool(cfg, "add_bos_token", t->add_bos);
    const json_t *ct = json_object_get(cfg, "chat_template");
    if (json_is_array(ct)) { /* [{"name": "default", "template": "..."}, ...] */
        size_t i;
        const json_t *e, *pick = NULL;
        json_array_foreach(ct, i, e) if (jstr_is(e, "name", "default")) pick = e;
        ct = pick ? json_object_get(pick, "template") : NULL;
    }
    if (json_is_string(ct)) {
        t->chat_template = dup_text(json_string_value(ct), json_string_length(ct));
        if (t->chat_template == NULL)
            rc = skv_errorf(SKV_E_NOMEM, "tokenizer: no memory for the chat template");
    }
    json_decref(cfg);
    return rc;
}

/* post_processor: TemplateProcessing whose single template starts with a special token means
 * a BOS is added (Llama 3). Also looks inside a Sequence of processors. */
static void parse_post(struct skv_tokenizer *t, const json_t *pp)
{
    if (jstr_is(pp, "type", "Sequence")) {
        size_t i;
        const json_t *e;
        json_array_foreach(json_object_get(pp, "processors"), i, e) parse_post(t, e);
        return;
    }
    if (!jstr_is(pp, "type", "TemplateProcessing"))
        return;
    const json_t *first = json_array_get(json_object_get(pp, "single"), 0);
    const json_t *st = json_object_get(json_object_get(first, "SpecialToken"), "id");
    if (!json_is_string(st))
        return;
    const json_t *spec = json_object_get(json_object_get(pp, "special_tokens"), json_string_value(st));
    const json_t *ids = json_object_get(spec, "ids");
    if (json_array_size(ids) == 1 && json_is_integer(json_array_get(ids, 0))) {
        json_int_t id = json_integer_value(json_array_get(ids, 0));
        if (id >= 0 && id < t->n_vocab) {
            t->bos = (int32_t)id;
            t->add_bos = true;
        }
    }
}

int skv_tokenizer_from_json(const char *tokenizer_json_path, struct skv_tokenizer **out)
{
    struct skv_tokenizer *t = NULL;
    struct strbuf scratch = {0};
    json_error_t err;
    int rc;

    if (tokenizer_json_path == NULL || out == NULL)
        return skv_errorf(SKV_E_INVAL, "tokenizer: NULL argument");
    if (access(tokenizer_json_path, R_OK) != 0)
        return skv_errorf(errno == ENOENT ? SKV_E_NOT_FOUND : SKV_E_IO, "tokenizer: %s: %s",
                          tokenizer_json_path, strerror(errno));
    json_t *root = json_load_file(tokenizer_json_path, 0, &err);
    if (root == NULL)
        return skv_errorf(SKV_E_FORMAT, "tokenizer.json: %s: line %d: %s", tokenizer_json_path,
                          err.line, err.text);
    const json_t *model = json_object_get(root, "model");
    const json_t *vocab = json_object_get(model, "vocab");
    const json_t *merges = json_object_get(model, "merges");
    const json_t *added = json_object_get(root, "added_tokens");
    const json_t *norm = json_object_get(root, "normalizer");
    if (!json_is_object(vocab) || !(merges == NULL || json_is_array(merges)) ||
        !(added == NULL || json_is_array(added))) {
        rc = skv_errorf(SKV_E_FORMAT, "tokenizer.json: model.vocab / model.merges / added_tokens missing or mistyped");
        goto out_free;
    }
    if ((json_object_get(model, "type") != NULL && !jstr_is(model, "type", "BPE")) ||
        jbool(model, "byte_fallback", false) || !jstr_empty(model, "continuing_subword_prefix") ||
        !jstr_empty(model, "end_of_word_suffix")) {
        rc = skv_errorf(SKV_E_UNSUPPORTED, "tokenizer.json: only byte-level BPE without byte_fallback or affixes");
        goto out_free;
    }
    /* NFC is applied, as Hugging Face's tokenizers applies it (llama.cpp does not) */
    if (!(norm == NULL || json_is_null(norm) || jstr_is(norm, "type", "NFC"))) {
        rc = skv_errorf(SKV_E_UNSUPPORTED, "tokenizer.json: normalizer is not supported");
        goto out_free;
    }

    int64_t max_id = -1, id;
    const char *key;
    const json_t *v;
    size_t i;
    json_object_foreach((json_t *)vocab, key, v) {
        if ((rc = json_token_id(v, &id)) != SKV_OK)
            goto out_free;
        max_id = id > max_id ? id : max_id;
    }
    json_array_foreach(added, i, v) {
        if ((rc = json_token_id(json_object_get(v, "id"), &id)) != SKV_OK)
            goto out_free;
        if (!json_is_string(json_object_get(v, "content"))) {
            rc = skv_errorf(SKV_E_FORMAT, "tokenizer.json: added token %lld without content", (long long)id);
            goto out_free;
        }
        max_id = id > max_id ? id : max_id;
    }
    rc = tok_alloc((int)(max_id + 1), &t);
    if (rc != SKV_OK)
        goto out_free;
    memset(t->attr, ATTR_UNUSED, (size_t)t->n_vocab);
    json_object_foreach((json_t *)vocab, key, v) {
        id = json_integer_value(v);
        if (t->in_vocab[id]) {
            rc = skv_errorf(SKV_E_FORMAT, "tokenizer.json: id %lld appears twice in model.vocab", (long long)id);
            goto out_free;
        }
        if ((rc = set_key(t, (int32_t)id, key, strlen(key))) != SKV_OK)
            goto out_free;
        if ((rc = set_bytes_unspelled(t, (int32_t)id)) != SKV_OK)
            goto out_free;
        t->in_vocab[id] = true;
        t->attr[id] = 0;
    }
    json_array_foreach(added, i, v) {
        const json_t *c = json_object_get(v, "content");
        id = json_integer_value(json_object_get(v, "id"));
        if (!t->in_vocab[id] && (rc = set_key(t, (int32_t)id, json_string_value(c), json_string_length(c))) != SKV_OK)
            goto out_free;
        if ((rc = set_bytes_raw(t, (int32_t)id, json_string_value(c), json_string_length(c))) != SKV_OK)
            goto out_free;
        t->attr[id] = (uint8_t)((jbool(v, "special", false) ? ATTR_CONTROL : ATTR_USER) |
                                (jbool(v, "lstrip", false) ? ATTR_LSTRIP : 0) |
                                (jbool(v, "rstrip", false) ? ATTR_RSTRIP : 0) |
                                (jbool(v, "single_word", false) ? ATTR_SINGLE_WORD : 0));
    }
    rc = vocab_index(t);
    if (rc != SKV_OK)
        goto out_free;
    rc = merges_init(t, json_array_size(merges));
    if (rc != SKV_OK)
        goto out_free;
    json_array_foreach(merges, i, v) {
        const char *a, *b;
        size_t na, nb;
        if (json_is_string(v)) {
            a = json_string_value(v);
            const char *sp = strchr(a, ' ');
            if (sp == NULL || strchr(sp + 1, ' ') != NULL) {
                rc = skv_errorf(SKV_E_FORMAT, "tokenizer.json: merge %zu '%.64s' is not 'a b'", i, a);
                goto out_free;
            }
            na = (size_t)(sp - a);
            b = sp + 1;
            nb = strlen(b);
        } else if (json_array_size(v) == 2 && json_is_string(json_array_get(v, 0)) &&
                   json_is_string(json_array_get(v, 1))) {
            a = json_string_value(json_array_get(v, 0));
            na = json_string_length(json_array_get(v, 0));
            b = json_string_value(json_array_get(v, 1));
            nb = json_string_length(json_array_get(v, 1));
        } else {
            rc = skv_errorf(SKV_E_FORMAT, "tokenizer.json: merge %zu is neither 'a b' nor [a, b]", i);
            goto out_free;
        }
        rc = merge_add(t, (int)i, a, na, b, nb, &scratch);
        if (rc != SKV_OK)
            goto out_free;
    }
    rc = finish_build(t);
    if (rc != SKV_OK)
        goto out_free;

    bool byte_level = false;
    rc = parse_pre(t, json_object_get(root, "pre_tokenizer"), &byte_level);
    if (rc == SKV_OK && !byte_level)
        rc = skv_errorf(SKV_E_UNSUPPORTED, "tokenizer.json: no ByteLevel pre-tokenizer (not a byte-level BPE)");
    if (rc != SKV_OK)
        goto out_free;
    t->ignore_merges = jbool(model, "ignore_merges", false);
    t->nfc = json_is_object(norm); /* (checked above: NFC) */
    t->fuse_unk = jbool(model, "fuse_unk", false);
    const json_t *unk = json_object_get(model, "unk_token");
    if (json_is_string(unk)) {
        t->unk = find_added_by_text(t, json_string_value(unk));
        if (t->unk < 0)
            t->unk = vocab_find(t, json_string_value(unk), json_string_length(unk));
    }

    parse_post(t, json_object_get(root, "post_processor"));
    if (t->bos < 0) {
        static const char *const names[] = {"<|begin_of_text|>", "<s>", "<|startoftext|>", "<|im_start|>", NULL};
        t->bos = find_first_added(t, names);
    }
    static const char *const eos_names[] = {"<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>",
                                            "<|endoftext|>", NULL};
    t->eos = find_first_added(t, eos_names);
    rc = read_config(t, tokenizer_json_path);
    if (rc != SKV_OK)
        goto out_free;
    t->eot = find_first_added(t, EOT_NAMES);
    if (t->eot < 0)
        t->eot = t->eos;
    json_decref(root);
    free(scratch.p);
    *out = t;
    return SKV_OK;

out_free:
    free(scratch.p);
    skv_tokenizer_free(&t);
    json_decref(root);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* accessors */

int skv_tokenizer_n_vocab(const struct skv_tokenizer *tok)
{
    return tok ? tok->n_vocab : 0;
}

int32_t skv_tokenizer_bos(const struct skv_tokenizer *tok)
{
    return tok ? tok->bos : -1;
}

int32_t skv_tokenizer_eos(const struct skv_tokenizer *tok)
{
    return tok ? tok->eos : -1;
}

int32_t skv_tokenizer_eot(const struct skv_tokenizer *tok)
{
    return tok ? tok->eot : -1;
}

bool skv_tokenizer_add_bos(const struct skv_tokenizer *tok)
{
    return tok && tok->add_bos && tok->bos >= 0;
}

bool skv_tokenizer_is_special(const struct skv_tokenizer *tok, int32_t id)
{
    return tok && id >= 0 && id < tok->n_vocab && (tok->attr[id] & ATTR_CONTROL);
}

/* ---------------------------------------------------------------------------------------- */
/* encoding */

struct bpe_sym {
    int32_t id;
    int32_t prev, next; /* -1 at the ends */
};

struct heap_item {
    uint64_t order; /* rank << 32 | left position: lowest rank first, then leftmost */
    int32_t result;
};

struct enc {
    const struct skv_tokenizer *t;
    const char *text;
    int32_t *ids;
    int64_t max, n;
    int64_t cap; /* stop once more than cap ids came out (INT64_MAX: count them all) */
    bool over;   /* ... which happened: the text has more than cap tokens */
    pcre2_match_data *md;
    struct bpe_sym *sym;
    size_t sym_cap;
    struct heap_item *heap;
    size_t heap_len, heap_cap;
    struct strbuf spell;
};

static void emit(struct enc *e, int32_t id)
{
    if (e->n < e->max)
        e->ids[e->n] = id;
    e->n++;
    if (e->n > e->cap)
        e->over = true;
}

static void heap_push(struct enc *e, struct heap_item it)
{
    size_t i = e->heap_len++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (e->heap[p].order <= it.order)
            break;
        e->heap[i] = e->heap[p];
        i = p;
    }
    e->heap[i] = it;
}

static struct heap_item heap_pop(struct enc *e)
{
    struct heap_item top = e->heap[0], last = e->heap[--e->heap_len];
    size_t i = 0, n = e->heap_len;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && e->heap[c + 1].order < e->heap[c].order)
            c++;
        if (last.order <= e->heap[c].order)
            break;
        e->heap[i] = e->heap[c];
        i = c;
    }
    if (n > 0)
        e->heap[i] = last;
    return top;
}

static void push_pair(struct enc *e, int32_t left)
{
    int32_t right = e->sym[left].next;
    if (right < 0)
        return;
    const struct merge_slot *m = merge_find(e->t, e->sym[left].id, e->sym[right].id);
    if (m != NULL)
        heap_push(e, (struct heap_item){((uint64_t)(uint32_t)m->rank << 32) | (uint32_t)left, m->result});
}

/* The symbol a word's byte starts as: its byte token, else unk (once for a run of them with
 * fuse_unk), else none (-1: HF drops a character the vocabulary lacks when there is no unk). */
static int32_t start_symbol(const struct skv_tokenizer *t, uint8_t byte, bool *last_unk)
{
    int32_t id = t->byte_tok[byte];
    if (id >= 0) {
        *last_unk = false;
        return id;
    }
    if (t->unk < 0 || (t->fuse_unk && *last_unk))
        return -1;
    *last_unk = true;
    return t->unk;
}

/* BPE of one pre-token (raw bytes). */
static int bpe(struct enc *e, size_t off, size_t len)
{
    const struct skv_tokenizer *t = e->t;
    const uint8_t *p = (const uint8_t *)e->text + off;
    if (t->ignore_merges) {
        e->spell.len = 0;
        int rc = spell(t, p, len, &e->spell);
        if (rc != SKV_OK)
            return rc;
        int32_t id = vocab_find(t, e->spell.p, e->spell.len);
        if (id >= 0) {
            emit(e, id);
            return e->over ? SKV_E_LIMIT : SKV_OK;
        }
    }
    size_t n_syms = 0;
    bool last_unk = false;
    for (size_t i = 0; i < len; i++)
        n_syms += start_symbol(t, p[i], &last_unk) >= 0;
    if (n_syms == 0)
        return SKV_OK;
    /* A merge's key is its two sides' keys joined and a byte's key is one character (an unk
     * outside the vocabulary never merges), so no token of the word holds more than
     * max_key_chars symbols. When the fewest tokens the word can make pass the cap and no id
     * would be written any more (a count), it is over the cap without its merges: megabytes of
     * one letter cost one pass, not a heap of every pair (when the text limit lets them in). */
    bool unk_has_key = t->unk < 0 || !t->in_vocab[t->unk] || t->key_len[t->unk] > 0;
    if (e->n >= e->max && t->max_key_chars > 0 && unk_has_key &&
        (int64_t)((n_syms + t->max_key_chars - 1) / t->max_key_chars) > e->cap - e->n) {
        e->n = e->cap + 1;
        e->over = true;
        return SKV_E_LIMIT;
    }
    if (len > e->sym_cap) {
        size_t cap = len < 64 ? 64 : len;
        struct bpe_sym *s = realloc(e->sym, cap * sizeof *s);
        /* the heap holds the n-1 initial pairs plus at most 2 per merge (stale ones included) */
        struct heap_item *h = cap > SIZE_MAX / (3 * sizeof *h) ? NULL : realloc(e->heap, 3 * cap * sizeof *h);
        if (s != NULL)
            e->sym = s;
        if (h != NULL)
            e->heap = h;
        if (s == NULL || h == NULL)
            return skv_errorf(SKV_E_NOMEM, "tokenizer: no memory for a %zu-byte word", len);
        e->sym_cap = cap;
        e->heap_cap = 3 * cap;
    }
    int32_t n = 0;
    last_unk = false;
    for (size_t i = 0; i < len; i++) {
        int32_t id = start_symbol(t, p[i], &last_unk);
        if (id < 0)
            continue;
        e->sym[n] = (struct bpe_sym){id, n - 1, -1};
        if (n > 0)
            e->sym[n - 1].next = n;
        n++;
    }
    if (n == 0)
        return SKV_OK;
    e->heap_len = 0;
    for (int32_t i = 0; i + 1 < n; i++)
        push_pair(e, i);
    while (e->heap_len > 0) {
        struct heap_item it = heap_pop(e);
        int32_t left = (int32_t)(uint32_t)it.order;
        int32_t right = e->sym[left].next;
        if (e->sym[left].id < 0 || right < 0)
            continue;
        const struct merge_slot *m = merge_find(t, e->sym[left].id, e->sym[right].id);
        if (m == NULL || m->result != it.result)
            continue; /* stale: one side changed since it was queued */
        e->sym[left].id = m->result;
        e->sym[left].next = e->sym[right].next;
        if (e->sym[right].next >= 0)
            e->sym[e->sym[right].next].prev = left;
        e->sym[right].id = -1;
        if (e->sym[left].prev >= 0)
            push_pair(e, e->sym[left].prev);
        push_pair(e, left);
    }
    for (int32_t i = 0; i >= 0 && !e->over; i = e->sym[i].next)
        emit(e, e->sym[i].id);
    /* past the cap: every caller up to encode_marked stops on this */
    return e->over ? SKV_E_LIMIT : SKV_OK;
}

static int pretok(struct enc *e, int step, size_t off, size_t len);

/* The fold of HF's NormalizedString::split over (segment, is_match) pairs, streaming. */
struct fold {
    struct enc *e;
    int step; /* the step producing the segments */
    int behavior;
    bool have, last_match;
    size_t off, len; /* the held piece */
};

static int fold_out(struct fold *f, size_t off, size_t len)
{
    return len > 0 ? pretok(f->e, f->step + 1, off, len) : SKV_OK;
}

static int fold_flush(struct fold *f)
{
    int rc = SKV_OK;
    if (f->have)
        rc = fold_out(f, f->off, f->len);
    f->have = false;
    return rc;
}

static int fold_seg(struct fold *f, size_t off, size_t len, bool match)
{
    int rc = SKV_OK;
    switch (f->behavior) {
    case SPLIT_REMOVED:
        return match ? SKV_OK : fold_out(f, off, len);
    case SPLIT_ISOLATED:
        return fold_out(f, off, len);
    case SPLIT_MERGED_PREV: /* a match joins the piece before it (unless that was a match) */
        if (match && !f->last_match && f->have) {
            f->len = off + len - f->off;
        } else {
            rc = fold_flush(f);
            f->have = true;
            f->off = off;
            f->len = len;
        }
        break;
    case SPLIT_MERGED_NEXT: /* a match joins the piece after it (unless that is a match) */
        if (f->have && !match) {
            f->len = off + len - f->off;
            rc = fold_flush(f);
        } else {
            rc = fold_flush(f);
            if (match) {
                f->have = true;
                f->off = off;
                f->len = len;
            } else if (rc == SKV_OK) {
                rc = fold_out(f, off, len);
            }
        }
        break;
    default: /* SPLIT_CONTIGUOUS: runs of matches / non-matches */
        if (f->have && match == f->last_match) {
            f->len = off + len - f->off;
        } else {
            rc = fold_flush(f);
            f->have = true;
            f->off = off;
            f->len = len;
        }
        break;
    }
    f->last_match = match;
    return rc;
}

/* Applies pre-tokenizer step `step` to text[off, off+len) (valid UTF-8), then BPE. */
static int pretok(struct enc *e, int step, size_t off, size_t len)
{
    const struct skv_tokenizer *t = e->t;
    if (step == t->n_steps)
        return bpe(e, off, len);
    const struct pre_step *ps = &t->steps[step];
    struct fold f = {.e = e, .step = step, .behavior = ps->behavior};
    const PCRE2_SPTR subj = (PCRE2_SPTR)e->text + off;
    size_t pos = 0, prev = 0;
    bool matched = false;
    int rc = SKV_OK;
    while (pos <= len && rc == SKV_OK) {
        int m = pcre2_match(ps->re, subj, len, pos, PCRE2_NO_UTF_CHECK, e->md, NULL);
        if (m == PCRE2_ERROR_JIT_STACKLIMIT)
            m = pcre2_match(ps->re, subj, len, pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, e->md, NULL);
        if (m == PCRE2_ERROR_NOMATCH)
            break;
        if (m < 0) {
            PCRE2_UCHAR msg[120];
            pcre2_get_error_message(m, msg, sizeof msg);
            return skv_errorf(SKV_E_LIMIT, "tokenizer: pre-tokenizer regex failed: %s", (const char *)msg);
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms && matched && ms == prev) { /* no match, as Oniguruma's iterator (HF's) skips
                                                  * an empty one where the last match ended */
            if (me >= len)
                break;
            uint32_t cp;
            size_t k = utf8_next(subj + me, len - me, &cp);
            pos = me + (k ? k : 1);
            continue;
        }
        matched = true;
        if (ms > prev)
            rc = fold_seg(&f, off + prev, ms - prev, ps->invert);
        if (rc == SKV_OK)
            rc = fold_seg(&f, off + ms, me - ms, !ps->invert);
        prev = me;
        if (me > ms) {
            pos = me;
        } else { /* empty match: step over one character */
            if (me >= len)
                break;
            uint32_t cp;
            size_t k = utf8_next(subj + me, len - me, &cp);
            pos = me + (k ? k : 1);
        }
    }
    if (rc == SKV_OK && prev < len)
        rc = fold_seg(&f, off + prev, len - prev, ps->invert);
    if (rc == SKV_OK)
        rc = fold_flush(&f);
    return rc;
}

/* A valid UTF-8 run through the pre-tokenizer, in NFC first when the tokenizer asks for it (as
 * HF's normalizer runs before its pre-tokenizer): the run is normalized into a buffer of its own,
 * which the pre-tokenizer reads in place of the text for the while. ASCII is NFC already. */
static int pretok_run(struct enc *e, size_t off, size_t len)
{
    const uint8_t *p = (const uint8_t *)e->text + off;
    size_t k = 0;
    if (e->t->nfc)
        while (k < len && p[k] < 0x80)
            k++;
    if (!e->t->nfc || k == len)
        return pretok(e, 0, off, len);
    size_t n = 0;
    uint8_t *nf = u8_normalize(UNINORM_NFC, p, len, NULL, &n);
    if (!nf)
        return errno == ENOMEM ? SKV_E_NOMEM : skv_errorf(SKV_E_INTERNAL, "tokenizer: NFC: %s", strerror(errno));
    const char *text = e->text;
    e->text = (const char *)nf;
    int rc = pretok(e, 0, 0, n);
    e->text = text;
    free(nf);
    return rc;
}

/* Text between added tokens: valid UTF-8 runs go through the pre-tokenizer; each invalid byte
 * is a word of its own (its byte token, or nothing when the vocabulary lacks it). */
static int encode_plain(struct enc *e, size_t off, size_t len)
{
    const uint8_t *p = (const uint8_t *)e->text;
    size_t run = off, end = off + len;
    int rc = SKV_OK;
    for (size_t i = off; i < end && rc == SKV_OK;) {
        uint32_t cp;
        size_t k = utf8_next(p + i, end - i, &cp);
        if (k > 0) {
            i += k;
            continue;
        }
        if (i > run)
            rc = pretok_run(e, run, i - run);
        if (rc == SKV_OK)
            rc = bpe(e, i, 1);
        run = ++i;
    }
    if (rc == SKV_OK && end > run)
        rc = pretok_run(e, run, end - run);
    return rc;
}

/* A byte range [off, end) of the text where control tokens are matched: all of it when the
 * caller asks for parse_special, a chat template's own markup in chat encoding. */
struct mark {
    size_t off, end;
};

/* Longest added token at text[i], or -1; a control token only when it ends by special_end
 * (the end of the mark holding i; 0 outside every mark). */
static int32_t match_added(const struct skv_tokenizer *t, const char *text, size_t i, size_t len,
                           size_t special_end)
{
    uint8_t b = (uint8_t)text[i];
    if (special_end <= i) { /* outside every mark: no control token can match */
        for (uint32_t k = t->user_at[b]; k < t->user_at[b + 1]; k++) {
            int32_t id = t->user_added[k];
            size_t n = t->bytes_len[id];
            if (n <= len - i && memcmp(text + i, t->bytes.p + t->bytes_off[id], n) == 0)
                return id;
        }
        return -1;
    }
    for (uint32_t k = t->added_at[b]; k < t->added_at[b + 1]; k++) {
        int32_t id = t->added[k];
        size_t n = t->bytes_len[id];
        if ((t->attr[id] & ATTR_CONTROL) && (special_end < i || special_end - i < n))
            continue;
        if (n <= len - i && memcmp(text + i, t->bytes.p + t->bytes_off[id], n) == 0)
            return id;
    }
    return -1;
}

/* Whitespace character ending right before `i` (not before `floor`): its start, else i. */
/* The character ending right before `i` (not before `floor`): its start, its code point in *cp;
 * i when there is none or its bytes are not one well-formed character. */
static size_t char_before(const char *text, size_t floor, size_t i, uint32_t *cp)
{
    if (i <= floor)
        return i;
    size_t s = i - 1;
    while (s > floor && i - s < 4 && ((uint8_t)text[s] & 0xc0) == 0x80)
        s--;
    return utf8_next((const uint8_t *)text + s, i - s, cp) == i - s ? s : i;
}

static size_t space_before(const char *text, size_t floor, size_t i)
{
    for (;;) {
        uint32_t cp;
        size_t s = char_before(text, floor, i, &cp);
        if (s == i || !is_unicode_space(cp))
            return i;
        i = s;
    }
}

/* HF's word character (Rust's char::is_alphanumeric, or '_'): Unicode Alphabetic or Numeric. */
/* Rust regex's Unicode \w, which Hugging Face's single_word check runs: Alphabetic, marks,
 * decimal digits, connector punctuation, join controls ('_' is Pc; a '\u00b2' or '\u00bd',
 * numbers but not decimal digits, is no word character, a combining mark is one) */
static bool is_word_char(uint32_t cp)
{
    return uc_is_property_alphabetic(cp) || uc_is_general_category(cp, UC_CATEGORY_M) ||
           uc_is_general_category(cp, UC_CATEGORY_Nd) || uc_is_general_category(cp, UC_CATEGORY_Pc) ||
           uc_is_property_join_control(cp);
}

/* Whether text[start, end) has a word character right before it or right after it (a
 * single_word added token does not match there). */
static bool word_beside(const char *text, size_t start, size_t end, size_t len)
{
    uint32_t cp;
    if (char_before(text, 0, start, &cp) != start && is_word_char(cp))
        return true;
    return end < len && utf8_next((const uint8_t *)text + end, len - end, &cp) > 0 && is_word_char(cp);
}

static size_t space_after(const char *text, size_t i, size_t len)
{
    while (i < len) {
        uint32_t cp;
        size_t k = utf8_next((const uint8_t *)text + i, len - i, &cp);
        if (k == 0 || !is_unicode_space(cp))
            break;
        i += k;
    }
    return i;
}

/* Encodes text with control tokens matched only inside `marks` (sorted, disjoint); arguments
 * already checked. Stops once more than cap ids came out (cap < 0: never): then SKV_E_LIMIT and
 * *n_out = cap + 1, so the work is bounded by cap tokens (and the scan for added tokens), not
 * by the text. Whatever cap, the ids written are those of the whole encoding's start. */
static int encode_marked(const struct skv_tokenizer *tok, const char *text, size_t len, bool add_bos,
                         const struct mark *marks, size_t n_marks, int32_t *ids, int max, int cap, int *n_out)
{
    struct enc e = {.t = tok, .text = text, .ids = ids, .max = max, .cap = cap < 0 ? INT64_MAX : cap};
    int rc = SKV_OK;
    if (tok->n_steps > 0) {
        e.md = pcre2_match_data_create(4, NULL);
        if (e.md == NULL)
            return skv_errorf(SKV_E_NOMEM, "tokenizer: no memory for regex match data");
    }
    if (add_bos && tok->add_bos && tok->bos >= 0)
        emit(&e, tok->bos);
    if (e.over)
        rc = SKV_E_LIMIT;
    size_t seg = 0; /* start of the pending plain text */
    size_t mk = 0;  /* the first mark not ending at or before i */
    for (size_t i = 0; i < len && rc == SKV_OK;) {
        while (mk < n_marks && marks[mk].end <= i)
            mk++;
        size_t special_end = mk < n_marks && marks[mk].off <= i ? marks[mk].end : 0;
        int32_t id = tok->n_added > 0 ? match_added(tok, text, i, len, special_end) : -1;
        if (id < 0) {
            i++;
            continue;
        }
        size_t start = i, end = i + tok->bytes_len[id];
        if ((tok->attr[id] & ATTR_SINGLE_WORD) && word_beside(text, start, end, len)) {
            i = end; /* plain text, as HF's matcher goes on after the match it set aside */
            continue;
        }
        if (tok->attr[id] & ATTR_LSTRIP)
            start = space_before(text, seg, start);
        if (tok->attr[id] & ATTR_RSTRIP)
            end = space_after(text, end, len);
        if (start > seg)
            rc = encode_plain(&e, seg, start - seg);
        if (rc != SKV_OK)
            break;
        emit(&e, id);
        if (e.over)
            rc = SKV_E_LIMIT;
        seg = i = end;
    }
    if (rc == SKV_OK && len > seg)
        rc = encode_plain(&e, seg, len - seg);
    pcre2_match_data_free(e.md);
    free(e.sym);
    free(e.heap);
    free(e.spell.p);
    if (rc == SKV_E_LIMIT && e.over) {
        *n_out = cap + 1;
        return skv_errorf(SKV_E_LIMIT, "tokenizer: more than %d tokens (stopped there)", cap);
    }
    if (rc != SKV_OK)
        return rc;
    if (e.n > INT_MAX)
        return skv_errorf(SKV_E_LIMIT, "tokenizer: %lld tokens do not fit in an int", (long long)e.n);
    *n_out = (int)e.n;
    if (e.n > max)
        return skv_errorf(SKV_E_LIMIT, "tokenizer: %lld tokens, room for %d", (long long)e.n, max);
    return SKV_OK;
}

int skv_tokenizer_encode(const struct skv_tokenizer *tok, const char *text, size_t len,
                         bool add_bos, bool parse_special, int32_t *ids, int max, int *n_out)
{
    if (tok == NULL || (text == NULL && len > 0) || n_out == NULL || max < 0 ||
        (ids == NULL && max > 0))
        return skv_errorf(SKV_E_INVAL, "tokenizer: bad encode arguments");
    const struct mark all = {0, len};
    return encode_marked(tok, text, len, add_bos, &all, parse_special ? 1 : 0, ids, max, -1, n_out);
}

int skv_tokenizer_encode_capped(const struct skv_tokenizer *tok, const char *text, size_t len, bool add_bos,
                                bool parse_special, int cap, int32_t *ids, int max, int *n_out)
{
    if (tok == NULL || (text == NULL && len > 0) || n_out == NULL || max < 0 || (ids == NULL && max > 0) ||
        cap < 0 || cap == INT_MAX)
        return skv_errorf(SKV_E_INVAL, "tokenizer: bad encode arguments");
    const struct mark all = {0, len};
    return encode_marked(tok, text, len, add_bos, &all, parse_special ? 1 : 0, ids, max, cap, n_out);
}

size_t skv_tokenizer_max_token_bytes(const struct skv_tokenizer *tok)
{
    return tok->max_token_bytes;
}

/* ---------------------------------------------------------------------------------------- */
/* decoding */

int skv_tokenizer_token_bytes(const struct skv_tokenizer *tok, int32_t id, char *buf, size_t cap,
                              size_t *len_out)
{
    if (tok == NULL || len_out == NULL || (buf == NULL && cap > 0))
        return skv_errorf(SKV_E_INVAL, "tokenizer: bad token_bytes arguments");
    if (id < 0 || id >= tok->n_vocab)
        return skv_errorf(SKV_E_INVAL, "tokenizer: token id %d outside [0, %d)", id, tok->n_vocab);
    size_t n = tok->bytes_len[id];
    if (cap > 0)
        memcpy(buf, tok->bytes.p + tok->bytes_off[id], n < cap ? n : cap);
    *len_out = n;
    if (n > cap)
        return skv_errorf(SKV_E_LIMIT, "tokenizer: token %d has %zu bytes, room for %zu", id, n, cap);
    return SKV_OK;
}

static bool known_id(const struct skv_tokenizer *tok, int32_t id)
{
    return id >= 0 && id < tok->n_vocab;
}

/* Ids outside the vocabulary are skipped, as Hugging Face's decode skips ids it does not know:
 * a model's embedding may have more rows than its tokenizer has tokens (Qwen2.5: 151936 for
 * 151665), and a sampler may pick one of those rows. */
int skv_tokenizer_decode(const struct skv_tokenizer *tok, const int32_t *ids, int n, char **out)
{
    return skv_tokenizer_decode_bytes(tok, ids, n, false, out, NULL);
}

int skv_tokenizer_decode_bytes(const struct skv_tokenizer *tok, const int32_t *ids, int n, bool skip_special,
                               char **out, size_t *len_out)
{
    if (tok == NULL || out == NULL || n < 0 || (ids == NULL && n > 0))
        return skv_errorf(SKV_E_INVAL, "tokenizer: bad decode arguments");
#define WANTED(id) (known_id(tok, (id)) && !(skip_special && (tok->attr[(id)] & ATTR_CONTROL)))
    size_t total = 0;
    for (int i = 0; i < n; i++)
        if (WANTED(ids[i]))
            total += tok->bytes_len[ids[i]];
    char *s = malloc(total + 1);
    if (s == NULL)
        return skv_errorf(SKV_E_NOMEM, "tokenizer: no memory for %zu decoded bytes", total);
    size_t k = 0;
    for (int i = 0; i < n; i++) {
        if (!WANTED(ids[i]))
            continue;
        memcpy(s + k, tok->bytes.p + tok->bytes_off[ids[i]], tok->bytes_len[ids[i]]);
        k += tok->bytes_len[ids[i]];
    }
#undef WANTED
    s[k] = '\0';
    *out = s;
    if (len_out)
        *len_out = k;
    return SKV_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* chat templates */

/* The default system prompt of a ChatML template: the text of a string literal
 * '<|im_start|>system\n...<|im_end|>' in the template source (Jinja escapes undone), or NULL. */
static int chatml_default_system(const char *tmpl, struct strbuf *out, bool *found)
{
    static const char head[] = "<|im_start|>system";
    static const char tail[] = "<|im_end|>";
    *found = false;
    for (const char *p = strstr(tmpl, head); p != NULL; p = strstr(p + 1, head)) {
        const char *q = p + sizeof head - 1;
        if (*q == '\n')
            q++;
        else if (q[0] == '\\' && q[1] == 'n')
            q += 2;
        else
            continue;
        out->len = 0;
        bool ok = false;
        while (*q != '\0') {
            if (strncmp(q, tail, sizeof tail - 1) == 0) {
                ok = true;
                break;
            }
            if (*q == '\'' || *q == '"')
                break; /* the literal ends first: the prompt is not a constant */
            char c = *q++;
            if (c == '\\' && *q != '\0') {
                c = *q++;
                c = c == 'n' ? '\n' : c == 't' ? '\t' : c == 'r' ? '\r' : c;
            }
            if (sb_add(out, &c, 1) != SKV_OK)
                return SKV_E_NOMEM;
        }
        if (ok) {
            *found = true;
            return SKV_OK;
        }
    }
    return SKV_OK;
}

/* Appends s with Python str.strip() whitespace removed from both ends. */
static int add_trimmed(struct strbuf *b, const char *s)
{
    const uint8_t *p = (const uint8_t *)s;
    size_t n = strlen(s), start = 0, end = n;
    while (start < n) {
        uint32_t cp;
        size_t k = utf8_next(p + start, n - start, &cp);
        if (k == 0 || !is_py_space(cp))
            break;
        start += k;
    }
    while (end > start) {
        size_t s0 = end - 1;
        while (s0 > start && end - s0 < 4 && (p[s0] & 0xc0) == 0x80)
            s0--;
        uint32_t cp;
        if (utf8_next(p + s0, end - s0, &cp) != end - s0 || !is_py_space(cp))
            break;
        end = s0;
    }
    return sb_add(b, s + start, end - start);
}

/* A rendered chat: its text, and the ranges of it the template wrote (its markup, where
 * control tokens are parsed) apart from the messages' roles and contents (plain text, so a
 * message saying "<|im_end|>" cannot end its turn). */
struct chat_text {
    struct strbuf b;
    struct mark *marks;
    size_t n_marks, cap_marks;
};

static int chat_markup(struct chat_text *c, const char *s, size_t n)
{
    size_t off = c->b.len;
    int rc = sb_add(&c->b, s, n);
    if (rc != SKV_OK || n == 0)
        return rc;
    if (c->n_marks > 0 && c->marks[c->n_marks - 1].end == off) {
        c->marks[c->n_marks - 1].end = c->b.len;
        return SKV_OK;
    }
    if (c->n_marks == c->cap_marks) {
        size_t cap = c->cap_marks ? 2 * c->cap_marks : 16;
        struct mark *m = realloc(c->marks, cap * sizeof *m);
        if (m == NULL)
            return skv_errorf(SKV_E_NOMEM, "tokenizer: no memory for the chat markup");
        c->marks = m;
        c->cap_marks = cap;
    }
    c->marks[c->n_marks++] = (struct mark){off, c->b.len};
    return SKV_OK;
}

static int chat_markups(struct chat_text *c, const char *s)
{
    return chat_markup(c, s, strlen(s));
}

/* A role or a message's content: plain text. */
static int chat_plain(struct chat_text *c, const char *s)
{
    return sb_adds(&c->b, s);
}

static int render_chatml(const struct skv_tokenizer *tok, const struct skv_chat_msg *msgs, int n,
                         bool gen, struct chat_text *c)
{
    struct strbuf sys = {0};
    bool has_default = false;
    int rc = chatml_default_system(tok->chat_template, &sys, &has_default);
    if (rc == SKV_OK && has_default && strcmp(msgs[0].role, "system") != 0) {
        rc = chat_markups(c, "<|im_start|>system\n");
        if (rc == SKV_OK)
            rc = chat_markup(c, sys.p, sys.len); /* the template's own text */
        if (rc == SKV_OK)
            rc = chat_markups(c, "<|im_end|>\n");
    }
    for (int i = 0; i < n && rc == SKV_OK; i++) {
        rc = chat_markups(c, "<|im_start|>");
        if (rc == SKV_OK)
            rc = chat_plain(c, msgs[i].role);
        if (rc == SKV_OK)
            rc = chat_markups(c, "\n");
        if (rc == SKV_OK)
            rc = chat_plain(c, msgs[i].content);
        if (rc == SKV_OK)
            rc = chat_markups(c, "<|im_end|>\n");
    }
    if (rc == SKV_OK && gen)
        rc = chat_markups(c, "<|im_start|>assistant\n");
    free(sys.p);
    return rc;
}

static int llama3_turn(struct chat_text *c, const char *role, const char *content)
{
    int rc = chat_markups(c, "<|start_header_id|>");
    if (rc == SKV_OK)
        rc = chat_plain(c, role);
    if (rc == SKV_OK)
        rc = chat_markups(c, "<|end_header_id|>\n\n");
    if (rc == SKV_OK)
        rc = add_trimmed(&c->b, content);
    if (rc == SKV_OK)
        rc = chat_markups(c, "<|eot_id|>");
    return rc;
}

/* The "Today Date" a Llama 3.1+ template writes: 3.1's fixed default, or, when the template asks
 * for strftime_now (3.2), today's date as transformers renders it (datetime.now(), local time,
 * "%d %b %Y"; English month names: snapkvd stays in the C locale). */
static void llama3_date(const char *tmpl, char out[32])
{
    time_t now = time(NULL);
    struct tm tm;
    if (strstr(tmpl, "strftime_now") == NULL || localtime_r(&now, &tm) == NULL ||
        strftime(out, 32, "%d %b %Y", &tm) == 0)
        snprintf(out, 32, "26 Jul 2024");
}

/* Llama 3: BOS text when the template writes bos_token; 3.1+ templates ("Cutting Knowledge
 * Date") always open with a system turn carrying their default date lines. */
static int render_llama3(const struct skv_tokenizer *tok, const struct skv_chat_msg *msgs, int n,
                         bool gen, struct chat_text *c)
{
    const char *tmpl = tok->chat_template;
    int rc = SKV_OK;
    if (strstr(tmpl, "bos_token") != NULL && tok->bos >= 0)
        rc = chat_markup(c, tok->bytes.p + tok->bytes_off[tok->bos], tok->bytes_len[tok->bos]);
    int first = 0;
    if (rc == SKV_OK && strstr(tmpl, "Cutting Knowledge Date") != NULL) {
        char date[32], lines[96];
        llama3_date(tmpl, date);
        snprintf(lines, sizeof lines, "Cutting Knowledge Date: December 2023\nToday Date: %s\n\n", date);
        rc = chat_markups(c, "<|start_header_id|>system<|end_header_id|>\n\n");
        if (rc == SKV_OK)
            rc = chat_markups(c, lines);
        if (rc == SKV_OK && strcmp(msgs[0].role, "system") == 0) {
            rc = add_trimmed(&c->b, msgs[0].content);
            first = 1;
        }
        if (rc == SKV_OK)
            rc = chat_markups(c, "<|eot_id|>");
    }
    for (int i = first; i < n && rc == SKV_OK; i++)
        rc = llama3_turn(c, msgs[i].role, msgs[i].content);
    if (rc == SKV_OK && gen)
        rc = chat_markups(c, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    return rc;
}

/* Renders the chat into c (its text always allocated on success). */
static int chat_build(const struct skv_tokenizer *tok, const struct skv_chat_msg *msgs, int n, bool gen,
                      struct chat_text *c)
{
    if (tok == NULL || n <= 0 || msgs == NULL)
        return skv_errorf(SKV_E_INVAL, "tokenizer: chat needs at least one message");
    for (int i = 0; i < n; i++)
        if (msgs[i].role == NULL || msgs[i].content == NULL)
            return skv_errorf(SKV_E_INVAL, "tokenizer: chat message %d has no role or content", i);
    if (tok->chat_template == NULL)
        return skv_errorf(SKV_E_UNSUPPORTED, "tokenizer: the model has no chat template");
    int rc;
    if (strstr(tok->chat_template, "<|im_start|>") != NULL)
        rc = render_chatml(tok, msgs, n, gen, c);
    else if (strstr(tok->chat_template, "<|start_header_id|>") != NULL)
        rc = render_llama3(tok, msgs, n, gen, c);
    else
        return skv_errorf(SKV_E_UNSUPPORTED, "tokenizer: chat template is neither ChatML nor Llama 3");
    if (rc == SKV_OK && sb_reserve(&c->b, 0) != SKV_OK)
        rc = SKV_E_NOMEM;
    return rc == SKV_E_NOMEM ? skv_errorf(rc, "tokenizer: no memory for the chat text") : rc;
}

int skv_tokenizer_chat_render(const struct skv_tokenizer *tok, const struct skv_chat_msg *msgs,
                              int n, bool add_generation_prompt, char **out)
{
    if (out == NULL)
        return skv_errorf(SKV_E_INVAL, "tokenizer: NULL chat output");
    struct chat_text c = {0};
    int rc = chat_build(tok, msgs, n, add_generation_prompt, &c);
    free(c.marks);
    if (rc != SKV_OK) {
        free(c.b.p);
        return rc;
    }
    *out = c.b.p;
    return SKV_OK;
}

/* skv_tokenizer_chat_encode and its capped form (cap < 0: no cap). */
static int chat_encode(const struct skv_tokenizer *tok, const struct skv_chat_msg *msgs, int n,
                       bool add_generation_prompt, int cap, int32_t *ids, int max, int *n_out)
{
    if (n_out == NULL || max < 0 || (ids == NULL && max > 0))
        return skv_errorf(SKV_E_INVAL, "tokenizer: bad chat encode arguments");
    struct chat_text c = {0};
    int rc = chat_build(tok, msgs, n, add_generation_prompt, &c);
    /* no BOS of the encoder's own: the template writes the one it wants */
    if (rc == SKV_OK)
        rc = encode_marked(tok, c.b.p, c.b.len, false, c.marks, c.n_marks, ids, max, cap, n_out);
    free(c.b.p);
    free(c.marks);
    return rc;
}

int skv_tokenizer_chat_encode(const struct skv_tokenizer *tok, const struct skv_chat_msg *msgs, int n,
                              bool add_generation_prompt, int32_t *ids, int max, int *n_out)
{
    return chat_encode(tok, msgs, n, add_generation_prompt, -1, ids, max, n_out);
}

int skv_tokenizer_chat_encode_capped(const struct skv_tokenizer *tok, const struct skv_chat_msg *msgs, int n,
                                     bool add_generation_prompt, int cap, int32_t *ids, int max, int *n_out)
{
    if (cap < 0 || cap == INT_MAX)
        return skv_errorf(SKV_E_INVAL, "tokenizer: bad chat encode arguments");
    return chat_encode(tok, msgs, n, add_generation_prompt, cap, ids, max, n_out);
}
