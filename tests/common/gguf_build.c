/* See gguf_build.h. */
#include "tests/common/gguf_build.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void gb_put(struct gguf_buf *b, const void *s, size_t n)
{
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2;
        b->p = realloc(b->p, b->cap);
        if (!b->p) {
            fprintf(stderr, "gguf_build: out of memory\n");
            abort();
        }
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
}

void gb_u32(struct gguf_buf *b, uint32_t v) { gb_put(b, &v, 4); }
void gb_u64(struct gguf_buf *b, uint64_t v) { gb_put(b, &v, 8); }

void gb_strn(struct gguf_buf *b, const char *s, size_t n)
{
    gb_u64(b, n);
    gb_put(b, s, n);
}

void gb_str(struct gguf_buf *b, const char *s) { gb_strn(b, s, strlen(s)); }

void gb_key(struct gguf_buf *b, const char *key, uint32_t type)
{
    gb_str(b, key);
    gb_u32(b, type);
    b->n_kv++;
}

void gb_kv_str(struct gguf_buf *b, const char *key, const char *v)
{
    gb_key(b, key, 8);
    gb_str(b, v);
}

void gb_kv_u32(struct gguf_buf *b, const char *key, uint32_t v)
{
    gb_key(b, key, 4);
    gb_u32(b, v);
}

void gb_kv_f32(struct gguf_buf *b, const char *key, float v)
{
    gb_key(b, key, 6);
    gb_put(b, &v, 4);
}

void gb_kv_bool(struct gguf_buf *b, const char *key, bool v)
{
    uint8_t x = v;
    gb_key(b, key, 7);
    gb_put(b, &x, 1);
}

void gb_kv_strs(struct gguf_buf *b, const char *key, const char *const *v, uint64_t n)
{
    gb_key(b, key, 9);
    gb_u32(b, 8);
    gb_u64(b, n);
    for (uint64_t i = 0; i < n; i++)
        gb_str(b, v[i]);
}

void gb_begin(struct gguf_buf *b, uint64_t n_tensors)
{
    gb_put(b, "GGUF", 4);
    gb_u32(b, 3);
    gb_u64(b, n_tensors);
    gb_u64(b, 0); /* the key count: gb_end */
}

void gb_end(struct gguf_buf *b) { memcpy(b->p + 16, &b->n_kv, 8); }
