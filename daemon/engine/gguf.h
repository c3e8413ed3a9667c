/* GGUF v3 reader: mmaps the file, validates the header, metadata and tensor table against
 * the file size, and exposes metadata by key and tensors as skv_tensor views into the map.
 * Corrupt input (truncation, wrong magic, absurd counts, dims or offsets, unknown types)
 * is an SKV_E_FORMAT / SKV_E_UNSUPPORTED status with skv_error_msg() set, never a crash. */
#ifndef SKV_GGUF_H
#define SKV_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

enum skv_gguf_type {
    SKV_GGUF_UINT8 = 0,
    SKV_GGUF_INT8 = 1,
    SKV_GGUF_UINT16 = 2,
    SKV_GGUF_INT16 = 3,
    SKV_GGUF_UINT32 = 4,
    SKV_GGUF_INT32 = 5,
    SKV_GGUF_FLOAT32 = 6,
    SKV_GGUF_BOOL = 7,
    SKV_GGUF_STRING = 8,
    SKV_GGUF_ARRAY = 9,
    SKV_GGUF_UINT64 = 10,
    SKV_GGUF_INT64 = 11,
    SKV_GGUF_FLOAT64 = 12,
};

/* A string inside the mapped file: not NUL-terminated. */
struct skv_gguf_str {
    const char *ptr;
    uint64_t len;
};

struct skv_gguf;

/* Opens and validates `path`. Limits: at most 1<<20 metadata keys and tensors, 4 dims,
 * keys/strings shorter than the file, every tensor's data inside the file. */
int skv_gguf_open(const char *path, struct skv_gguf **out);
/* Same over a caller-owned buffer (used by the fuzzer and tests); buf must outlive g. */
int skv_gguf_open_buffer(const void *buf, size_t size, struct skv_gguf **out);
void skv_gguf_close(struct skv_gguf **g_p);

uint32_t skv_gguf_version(const struct skv_gguf *g);
size_t skv_gguf_alignment(const struct skv_gguf *g);

/* Metadata. find returns the key index or -1. Typed getters return false when the key is
 * missing or its type does not convert (integers convert between widths when in range;
 * get_f32 accepts f32/f64 and integers). */
int64_t skv_gguf_n_keys(const struct skv_gguf *g);
int skv_gguf_find_key(const struct skv_gguf *g, const char *key);
struct skv_gguf_str skv_gguf_key_name(const struct skv_gguf *g, int idx);
int skv_gguf_key_type(const struct skv_gguf *g, int idx); /* enum skv_gguf_type */
bool skv_gguf_get_u32(const struct skv_gguf *g, const char *key, uint32_t *out);
bool skv_gguf_get_i64(const struct skv_gguf *g, const char *key, int64_t *out);
bool skv_gguf_get_f32(const struct skv_gguf *g, const char *key, float *out);
bool skv_gguf_get_bool(const struct skv_gguf *g, const char *key, bool *out);
bool skv_gguf_get_str(const struct skv_gguf *g, const char *key, struct skv_gguf_str *out);
/* Arrays: element type and count; then elements by index. */
bool skv_gguf_get_arr(const struct skv_gguf *g, const char *key, int *elem_type, uint64_t *count);
bool skv_gguf_get_arr_str(const struct skv_gguf *g, const char *key, uint64_t i,
                          struct skv_gguf_str *out);
/* Numeric array element i converted to int64 / double; false when out of range or not numeric. */
bool skv_gguf_get_arr_i64(const struct skv_gguf *g, const char *key, uint64_t i, int64_t *out);
bool skv_gguf_get_arr_f64(const struct skv_gguf *g, const char *key, uint64_t i, double *out);
/* Bool array element i; false when out of range or the array is not of bools. */
bool skv_gguf_get_arr_bool(const struct skv_gguf *g, const char *key, uint64_t i, bool *out);

/* Tensors: views into the map (data points into the file). */
int64_t skv_gguf_n_tensors(const struct skv_gguf *g);
const struct skv_tensor *skv_gguf_tensor(const struct skv_gguf *g, int64_t i);
const struct skv_tensor *skv_gguf_find_tensor(const struct skv_gguf *g, const char *name);

#endif
