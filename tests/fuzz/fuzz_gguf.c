/* libFuzzer target for the GGUF loader: opens the input with skv_gguf_open_buffer and, when
 * it loads, reads back every key, array element and tensor byte range it exposes, so any
 * pointer the validator let through is touched. Build:
 *   clang -fsanitize=fuzzer,address,undefined -I. tests/fuzz/fuzz_gguf.c \
 *         daemon/engine/gguf.c kernels/dtype.c common/status.c common/utf8.c -o fuzz_gguf
 * Seed with tests/fixtures/types.gguf. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "daemon/engine/gguf.h"
#include "kernels/backend.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Sums bytes so the reads cannot be optimized away. */
static unsigned touch(const void *p, uint64_t n)
{
    const uint8_t *b = p;
    unsigned acc = 0;
    if (n > 0)
        acc = b[0] + b[n - 1] + b[n / 2];
    return acc;
}

static unsigned walk_key(const struct skv_gguf *g, int idx, char *key, size_t key_cap)
{
    struct skv_gguf_str name = skv_gguf_key_name(g, idx);
    unsigned acc = touch(name.ptr, name.len);
    if (name.len >= key_cap || memchr(name.ptr, '\0', name.len) != NULL)
        return acc; /* not addressable by a C string */
    memcpy(key, name.ptr, name.len);
    key[name.len] = '\0';
    /* the index finds the first key of this name, which must be this one */
    if (skv_gguf_find_key(g, key) != idx)
        __builtin_trap();

    uint32_t u32;
    int64_t i64;
    float f32;
    bool b;
    struct skv_gguf_str s;
    int et;
    uint64_t count;
    acc += skv_gguf_get_u32(g, key, &u32) ? u32 : 0;
    acc += skv_gguf_get_i64(g, key, &i64) ? (unsigned)i64 : 0;
    acc += skv_gguf_get_f32(g, key, &f32) ? (f32 > 0) : 0;
    acc += skv_gguf_get_bool(g, key, &b) ? b : 0;
    if (skv_gguf_get_str(g, key, &s))
        acc += touch(s.ptr, s.len);
    if (skv_gguf_get_arr(g, key, &et, &count)) {
        if (skv_gguf_key_type(g, idx) != SKV_GGUF_ARRAY)
            __builtin_trap();
        for (uint64_t i = 0; i <= count; i++) { /* one past the end must fail */
            double f64;
            bool got = false;
            if (skv_gguf_get_arr_str(g, key, i, &s)) {
                acc += touch(s.ptr, s.len);
                got = true;
            }
            if (skv_gguf_get_arr_i64(g, key, i, &i64)) {
                acc += (unsigned)i64;
                got = true;
            }
            if (skv_gguf_get_arr_f64(g, key, i, &f64)) {
                acc += f64 > 0;
                got = true;
            }
            if (got && i == count)
                __builtin_trap();
        }
    }
    return acc;
}

static unsigned walk_tensor(const struct skv_gguf *g, int64_t i)
{
    const struct skv_tensor *t = skv_gguf_tensor(g, i);
    if (t == NULL || t->name == NULL || skv_gguf_find_tensor(g, t->name) != t)
        __builtin_trap();
    if (t->ndim < 1 || t->ndim > 4 || skv_dtype_name(t->type) == NULL)
        __builtin_trap();
    int64_t rows = 1;
    for (int d = 0; d < 4; d++) {
        if (t->ne[d] < 1)
            __builtin_trap();
        if (d > 0)
            rows *= t->ne[d];
    }
    if (t->nbytes != skv_dtype_row_bytes(t->type, t->ne[0]) * (size_t)rows)
        __builtin_trap();
    return touch(t->name, strlen(t->name)) + touch(t->data, t->nbytes);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct skv_gguf *g = NULL;
    int rc = skv_gguf_open_buffer(data, size, &g);
    if (rc != SKV_OK) {
        if (g != NULL || skv_error_msg()[0] == '\0')
            __builtin_trap();
        return 0;
    }
    volatile unsigned acc = skv_gguf_version(g) + (unsigned)skv_gguf_alignment(g);
    char *key = malloc(4096);
    if (key != NULL) {
        for (int64_t i = 0; i < skv_gguf_n_keys(g); i++)
            acc += walk_key(g, (int)i, key, 4096);
        free(key);
    }
    for (int64_t i = 0; i < skv_gguf_n_tensors(g); i++)
        acc += walk_tensor(g, i);
    (void)acc;
    skv_gguf_close(&g);
    return 0;
}
