/* A GGUF file built in memory by tests: gb_begin, keys (and tensor infos and data), gb_end.
 * Types are GGUF's value type ids (4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array). */
#ifndef SKV_TEST_GGUF_BUILD_H
#define SKV_TEST_GGUF_BUILD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct gguf_buf {
    uint8_t *p;
    size_t len, cap;
    uint64_t n_kv;
};

/* The header of a version-3 GGUF of n_tensors tensors; gb_end writes the key count into it. */
void gb_begin(struct gguf_buf *b, uint64_t n_tensors);
void gb_end(struct gguf_buf *b);
void gb_put(struct gguf_buf *b, const void *s, size_t n);
void gb_u32(struct gguf_buf *b, uint32_t v);
void gb_u64(struct gguf_buf *b, uint64_t v);
void gb_strn(struct gguf_buf *b, const char *s, size_t n); /* u64 length, then the bytes */
void gb_str(struct gguf_buf *b, const char *s);
void gb_key(struct gguf_buf *b, const char *key, uint32_t type);
void gb_kv_str(struct gguf_buf *b, const char *key, const char *v);
void gb_kv_u32(struct gguf_buf *b, const char *key, uint32_t v);
void gb_kv_f32(struct gguf_buf *b, const char *key, float v);
void gb_kv_bool(struct gguf_buf *b, const char *key, bool v);
/* A key holding an array of n strings. */
void gb_kv_strs(struct gguf_buf *b, const char *key, const char *const *v, uint64_t n);

#endif
