/* Tests of the GGUF loader (daemon/engine/gguf.c) and the dtype table (kernels/dtype.c):
 * the gguf-py fixture (every metadata type, one tensor per dtype, values dequantized by
 * gguf-py), crafted corrupt files, every truncation point, and the real model when present. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <math.h>

#include "common/status.h"
#include "daemon/engine/gguf.h"
#include "kernels/backend.h"

/* ---- helpers ---- */

static const char *srcdir(void)
{
    const char *s = getenv("SKV_SRCDIR");
    return s && *s ? s : ".";
}

static void src_path(char *out, size_t n, const char *rel)
{
    snprintf(out, n, "%s/%s", srcdir(), rel);
}

/* Whole file into a malloc'd buffer of exactly its size; NULL when missing. */
static uint8_t *slurp(const char *path, size_t *size)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc(n > 0 ? (size_t)n : 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *size = (size_t)n;
    return buf;
}

static bool str_eq(struct skv_gguf_str s, const char *c)
{
    return s.ptr != NULL && s.len == strlen(c) && memcmp(s.ptr, c, s.len) == 0;
}

/* Opens a private exact-size copy of buf[0..size) (so sanitizers see any over-read). */
static int open_copy(const uint8_t *buf, size_t size)
{
    uint8_t *copy = malloc(size ? size : 1);
    assert_non_null(copy);
    memcpy(copy, buf, size);
    struct skv_gguf *g = NULL;
    skv_error_clear();
    int rc = skv_gguf_open_buffer(copy, size, &g);
    if (rc == SKV_OK) {
        assert_non_null(g);
        skv_gguf_close(&g);
        assert_null(g);
    } else {
        assert_null(g);
        assert_true(strlen(skv_error_msg()) > 0);
    }
    free(copy);
    return rc;
}

/* ---- dtype table and conversions ---- */

static void test_dtype_table(void **state)
{
    (void)state;
    static const struct {
        int type;
        const char *name;
        int64_t elems;
        size_t bytes;
        bool supported;
    } want[] = {
        {SKV_DTYPE_F32, "f32", 1, 4, true},       {SKV_DTYPE_F16, "f16", 1, 2, true},
        {SKV_DTYPE_BF16, "bf16", 1, 2, true},     {SKV_DTYPE_Q4_0, "q4_0", 32, 18, true},
        {SKV_DTYPE_Q4_1, "q4_1", 32, 20, true},   {SKV_DTYPE_Q5_0, "q5_0", 32, 22, true},
        {SKV_DTYPE_Q5_1, "q5_1", 32, 24, true},   {SKV_DTYPE_Q8_0, "q8_0", 32, 34, true},
        {SKV_DTYPE_Q8_1, "q8_1", 32, 36, false},  {SKV_DTYPE_Q2_K, "q2_K", 256, 84, true},
        {SKV_DTYPE_Q3_K, "q3_K", 256, 110, true}, {SKV_DTYPE_Q4_K, "q4_K", 256, 144, true},
        {SKV_DTYPE_Q5_K, "q5_K", 256, 176, true}, {SKV_DTYPE_Q6_K, "q6_K", 256, 210, true},
        {SKV_DTYPE_Q8_K, "q8_K", 256, 292, true}, {SKV_DTYPE_I8, "i8", 1, 1, false},
        {SKV_DTYPE_I16, "i16", 1, 2, false},      {SKV_DTYPE_I32, "i32", 1, 4, false},
        {SKV_DTYPE_I64, "i64", 1, 8, false},      {SKV_DTYPE_F64, "f64", 1, 8, false},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        assert_string_equal(skv_dtype_name(want[i].type), want[i].name);
        assert_int_equal(skv_dtype_block_elems(want[i].type), want[i].elems);
        assert_int_equal(skv_dtype_block_bytes(want[i].type), want[i].bytes);
        assert_int_equal(skv_dtype_supported(want[i].type), want[i].supported);
        assert_int_equal(skv_dtype_row_bytes(want[i].type, want[i].elems * 3), want[i].bytes * 3);
    }
    static const int unknown[] = {-1, 4, 5, 16, 23, 29, 31, 1000};
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        assert_null(skv_dtype_name(unknown[i]));
        assert_int_equal(skv_dtype_block_elems(unknown[i]), 0);
        assert_int_equal(skv_dtype_block_bytes(unknown[i]), 0);
        assert_int_equal(skv_dtype_row_bytes(unknown[i], 256), 0);
        assert_false(skv_dtype_supported(unknown[i]));
    }
    assert_int_equal(skv_dtype_row_bytes(SKV_DTYPE_Q4_0, 33), 0);
    assert_int_equal(skv_dtype_row_bytes(SKV_DTYPE_Q4_K, 128), 0);
    assert_int_equal(skv_dtype_row_bytes(SKV_DTYPE_Q4_1, 576), 18 * 20);
    assert_int_equal(skv_dtype_row_bytes(SKV_DTYPE_F32, -4), 0);
    assert_int_equal(skv_dtype_row_bytes(SKV_DTYPE_F64, INT64_MAX), 0); /* overflow */
}

static uint32_t fbits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bitsf(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void test_fp16(void **state)
{
    (void)state;
    /* every half survives the round trip; NaNs stay NaN */
    for (uint32_t h = 0; h < 65536; h++) {
        float f = skv_fp16_to_f32((uint16_t)h);
        bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0;
        if (nan) {
            assert_true(isnan(f));
            assert_true(isnan(skv_fp16_to_f32(skv_f32_to_fp16(f))));
        } else {
            assert_int_equal(skv_f32_to_fp16(f), h);
        }
    }
    static const struct {
        float f;
        uint16_t h;
    } cases[] = {
        {0.0f, 0x0000},          {-0.0f, 0x8000},          {1.0f, 0x3c00},
        {-2.0f, 0xc000},         {65504.0f, 0x7bff},       {65519.99f, 0x7bff},
        {65520.0f, 0x7c00},      {1e9f, 0x7c00},           {-1e9f, 0xfc00},
        {0x1p-24f, 0x0001},      {0x1p-25f, 0x0000},       {0x1.8p-25f, 0x0001},
        {0x1.8p-24f, 0x0002},    {0x1p-14f, 0x0400},       {0x1.ff8p-15f, 0x03ff},
        {1.0f + 0x1p-11f, 0x3c00}, {1.0f + 0x3p-11f, 0x3c02}, {1.0f + 0x1.2p-11f, 0x3c01},
        {0x1.ffcp-15f, 0x0400}, /* 1023.5 * 2^-24: the tie carries into the smallest normal */
        {0x1.ff4p-15f, 0x03fe}, /* 1022.5 * 2^-24: tie to even, down */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        assert_int_equal(skv_f32_to_fp16(cases[i].f), cases[i].h);
    assert_int_equal(skv_f32_to_fp16(bitsf(0x7f800000)), 0x7c00);
    assert_int_equal(skv_f32_to_fp16(bitsf(0xff800000)), 0xfc00);
    assert_true((skv_f32_to_fp16(bitsf(0x7fc00000)) & 0x7fff) > 0x7c00);
    assert_true((skv_f32_to_fp16(bitsf(0x7f800001)) & 0x7fff) > 0x7c00); /* sNaN, low payload */
    assert_true(skv_fp16_to_f32(0x0001) == 0x1p-24f);
    assert_true(skv_fp16_to_f32(0x03ff) == 0x1.ff8p-15f);
    assert_true(isinf(skv_fp16_to_f32(0x7c00)) && skv_fp16_to_f32(0x7c00) > 0);
    assert_int_equal(fbits(skv_fp16_to_f32(0x8000)), 0x80000000u);
}

static void test_bf16(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = skv_bf16_to_f32((uint16_t)h);
        assert_int_equal(fbits(f), h << 16);
        if (!isnan(f))
            assert_int_equal(skv_f32_to_bf16(f), h);
        else
            assert_true(isnan(skv_bf16_to_f32(skv_f32_to_bf16(f))));
    }
    assert_int_equal(skv_f32_to_bf16(bitsf(0x3f808000)), 0x3f80); /* tie to even (down) */
    assert_int_equal(skv_f32_to_bf16(bitsf(0x3f818000)), 0x3f82); /* tie to even (up) */
    assert_int_equal(skv_f32_to_bf16(bitsf(0x3f808001)), 0x3f81);
    assert_int_equal(skv_f32_to_bf16(bitsf(0x7f7fffff)), 0x7f80);  /* rounds to inf */
    assert_int_equal(skv_f32_to_bf16(bitsf(0xff800000)), 0xff80);
    assert_true(isnan(skv_bf16_to_f32(skv_f32_to_bf16(bitsf(0x7f800001)))));
}

/* ---- the gguf-py fixture ---- */

static struct skv_gguf *open_fixture(void)
{
    char path[4096];
    struct skv_gguf *g = NULL;
    src_path(path, sizeof path, "tests/fixtures/types.gguf.fixture");
    int rc = skv_gguf_open(path, &g);
    if (rc != SKV_OK)
        fail_msg("%s: %s", path, skv_error_msg());
    return g;
}

static void test_fixture_metadata(void **state)
{
    (void)state;
    struct skv_gguf *g = open_fixture();
    uint32_t u32;
    int64_t i64;
    float f32;
    bool b;
    double f64;
    struct skv_gguf_str s;
    int et;
    uint64_t count;

    assert_int_equal(skv_gguf_version(g), 3);
    assert_int_equal(skv_gguf_alignment(g), 64);
    assert_int_equal(skv_gguf_n_keys(g), 21);
    assert_int_equal(skv_gguf_n_tensors(g), 19);

    /* every key is found at its own index with its type */
    static const struct {
        const char *key;
        int type;
    } keys[] = {
        {"general.architecture", SKV_GGUF_STRING}, {"general.alignment", SKV_GGUF_UINT32},
        {"test.u8", SKV_GGUF_UINT8},               {"test.i8", SKV_GGUF_INT8},
        {"test.u16", SKV_GGUF_UINT16},             {"test.i16", SKV_GGUF_INT16},
        {"test.u32", SKV_GGUF_UINT32},             {"test.i32", SKV_GGUF_INT32},
        {"test.f32", SKV_GGUF_FLOAT32},            {"test.bool_true", SKV_GGUF_BOOL},
        {"test.bool_false", SKV_GGUF_BOOL},        {"test.string", SKV_GGUF_STRING},
        {"test.u64", SKV_GGUF_UINT64},             {"test.i64", SKV_GGUF_INT64},
        {"test.f64", SKV_GGUF_FLOAT64},            {"test.arr_u32", SKV_GGUF_ARRAY},
        {"test.arr_i16", SKV_GGUF_ARRAY},          {"test.arr_f32", SKV_GGUF_ARRAY},
        {"test.arr_str", SKV_GGUF_ARRAY},          {"test.arr_nested", SKV_GGUF_ARRAY},
        {"test.arr_nested_str", SKV_GGUF_ARRAY},
    };
    for (int i = 0; i < (int)(sizeof keys / sizeof keys[0]); i++) {
        assert_int_equal(skv_gguf_find_key(g, keys[i].key), i);
        assert_true(str_eq(skv_gguf_key_name(g, i), keys[i].key));
        assert_int_equal(skv_gguf_key_type(g, i), keys[i].type);
    }
    assert_int_equal(skv_gguf_find_key(g, "test.missing"), -1);
    assert_int_equal(skv_gguf_find_key(g, "test.u"), -1);
    assert_int_equal(skv_gguf_find_key(g, ""), -1);
    assert_null(skv_gguf_key_name(g, 21).ptr);
    assert_null(skv_gguf_key_name(g, -1).ptr);
    assert_int_equal(skv_gguf_key_type(g, 99), -1);

    assert_true(skv_gguf_get_str(g, "general.architecture", &s) && str_eq(s, "test"));
    assert_true(skv_gguf_get_u32(g, "test.u8", &u32) && u32 == 200);
    assert_true(skv_gguf_get_i64(g, "test.i8", &i64) && i64 == -100);
    assert_false(skv_gguf_get_u32(g, "test.i8", &u32)); /* negative */
    assert_true(skv_gguf_get_u32(g, "test.u16", &u32) && u32 == 60000);
    assert_true(skv_gguf_get_i64(g, "test.i16", &i64) && i64 == -30000);
    assert_true(skv_gguf_get_u32(g, "test.u32", &u32) && u32 == 4000000000u);
    assert_true(skv_gguf_get_i64(g, "test.u32", &i64) && i64 == 4000000000ll);
    assert_true(skv_gguf_get_i64(g, "test.i32", &i64) && i64 == -2000000000ll);
    assert_true(skv_gguf_get_f32(g, "test.f32", &f32) && f32 == 3.25f);
    assert_true(skv_gguf_get_f32(g, "test.u8", &f32) && f32 == 200.0f);
    assert_true(skv_gguf_get_f32(g, "test.i32", &f32) && f32 == -2e9f);
    assert_false(skv_gguf_get_i64(g, "test.f32", &i64)); /* floats do not become integers */
    assert_true(skv_gguf_get_bool(g, "test.bool_true", &b) && b);
    assert_true(skv_gguf_get_bool(g, "test.bool_false", &b) && !b);
    assert_false(skv_gguf_get_bool(g, "test.u8", &b));
    assert_false(skv_gguf_get_u32(g, "test.bool_true", &u32));
    assert_true(skv_gguf_get_str(g, "test.string", &s) && str_eq(s, "h\xc3\xa9llo, gguf"));
    assert_false(skv_gguf_get_str(g, "test.u8", &s));
    assert_false(skv_gguf_get_u32(g, "test.string", &u32));
    assert_false(skv_gguf_get_u32(g, "test.u64", &u32));  /* out of range */
    assert_false(skv_gguf_get_i64(g, "test.u64", &i64));  /* 2^63 + 5 > INT64_MAX */
    assert_true(skv_gguf_get_f32(g, "test.u64", &f32) && f32 == 0x1p63f);
    assert_true(skv_gguf_get_i64(g, "test.i64", &i64) && i64 == -(1ll << 62) - 7);
    assert_true(skv_gguf_get_f32(g, "test.f64", &f32) && f32 == 0.1f);
    assert_false(skv_gguf_get_u32(g, "test.missing", &u32));
    assert_false(skv_gguf_get_f32(g, "test.arr_f32", &f32));

    /* arrays */
    assert_true(skv_gguf_get_arr(g, "test.arr_u32", &et, &count));
    assert_int_equal(et, SKV_GGUF_UINT32);
    assert_int_equal(count, 4);
    static const int64_t arr_u32[] = {1, 2, 3, 4000000000ll};
    for (uint64_t i = 0; i < 4; i++) {
        assert_true(skv_gguf_get_arr_i64(g, "test.arr_u32", i, &i64));
        assert_int_equal(i64, arr_u32[i]);
        assert_true(skv_gguf_get_arr_f64(g, "test.arr_u32", i, &f64));
        assert_true(f64 == (double)arr_u32[i]);
    }
    assert_false(skv_gguf_get_arr_i64(g, "test.arr_u32", 4, &i64));
    assert_false(skv_gguf_get_arr_str(g, "test.arr_u32", 0, &s));
    assert_false(skv_gguf_get_arr(g, "test.u32", &et, &count));

    assert_true(skv_gguf_get_arr(g, "test.arr_i16", &et, &count));
    assert_int_equal(et, SKV_GGUF_INT16);
    assert_int_equal(count, 3);
    assert_true(skv_gguf_get_arr_i64(g, "test.arr_i16", 0, &i64) && i64 == -5);
    assert_true(skv_gguf_get_arr_i64(g, "test.arr_i16", 2, &i64) && i64 == 32767);

    assert_true(skv_gguf_get_arr(g, "test.arr_f32", &et, &count));
    assert_int_equal(et, SKV_GGUF_FLOAT32);
    assert_int_equal(count, 3);
    assert_true(skv_gguf_get_arr_f64(g, "test.arr_f32", 0, &f64) && f64 == 0.5);
    assert_true(skv_gguf_get_arr_f64(g, "test.arr_f32", 1, &f64) && f64 == -1.5);
    assert_true(skv_gguf_get_arr_f64(g, "test.arr_f32", 2, &f64) && f64 == (double)1e-3f);
    assert_false(skv_gguf_get_arr_i64(g, "test.arr_f32", 0, &i64));

    assert_true(skv_gguf_get_arr(g, "test.arr_str", &et, &count));
    assert_int_equal(et, SKV_GGUF_STRING);
    assert_int_equal(count, 4);
    static const char *arr_str[] = {"alpha", "", "\xce\xb3\xce\xac\xce\xbc\xce\xbc\xce\xb1", "delta"};
    for (uint64_t i = 0; i < 4; i++) {
        assert_true(skv_gguf_get_arr_str(g, "test.arr_str", i, &s));
        assert_true(str_eq(s, arr_str[i]));
    }
    assert_false(skv_gguf_get_arr_str(g, "test.arr_str", 4, &s));
    assert_false(skv_gguf_get_arr_i64(g, "test.arr_str", 0, &i64));

    /* arrays of arrays are validated and reported, not readable element-wise */
    assert_true(skv_gguf_get_arr(g, "test.arr_nested", &et, &count));
    assert_int_equal(et, SKV_GGUF_ARRAY);
    assert_int_equal(count, 2);
    assert_false(skv_gguf_get_arr_i64(g, "test.arr_nested", 0, &i64));
    assert_true(skv_gguf_get_arr(g, "test.arr_nested_str", &et, &count));
    assert_int_equal(et, SKV_GGUF_ARRAY);
    assert_int_equal(count, 2);
    assert_false(skv_gguf_get_arr_str(g, "test.arr_nested_str", 0, &s));

    skv_gguf_close(&g);
    assert_null(g);
    skv_gguf_close(&g); /* NULL is fine */
    skv_gguf_close(NULL);
}

/* One tensor of types_expected.bin. */
struct expected_tensor {
    char name[64];
    int type;
    int ndim;
    int64_t ne[4];
    uint64_t offset;
    uint64_t n;
    float *values;
};

static int load_expected(struct expected_tensor *out, int max)
{
    char path[4096];
    size_t size;
    src_path(path, sizeof path, "tests/fixtures/types_expected.bin");
    uint8_t *buf = slurp(path, &size);
    assert_non_null(buf);
    assert_memory_equal(buf, "SKVGX001", 8);
    size_t pos = 8;
    uint32_t n, u;
    memcpy(&n, buf + pos, 4);
    pos += 4;
    assert_true((int)n <= max);
    for (uint32_t i = 0; i < n; i++) {
        struct expected_tensor *e = &out[i];
        memcpy(&u, buf + pos, 4);
        pos += 4;
        assert_true(u < sizeof e->name);
        memcpy(e->name, buf + pos, u);
        e->name[u] = '\0';
        pos += u;
        memcpy(&u, buf + pos, 4);
        e->type = (int)u;
        memcpy(&u, buf + pos + 4, 4);
        e->ndim = (int)u;
        pos += 8;
        memcpy(e->ne, buf + pos, 32);
        memcpy(&e->offset, buf + pos + 32, 8);
        memcpy(&e->n, buf + pos + 40, 8);
        pos += 48;
        e->values = malloc(e->n * sizeof(float));
        assert_non_null(e->values);
        memcpy(e->values, buf + pos, e->n * sizeof(float));
        pos += e->n * sizeof(float);
        assert_true(pos <= size);
    }
    assert_int_equal(pos, size);
    free(buf);
    return (int)n;
}

/* Raw values of the plain integer / f64 types as float. */
static float plain_value(int type, const uint8_t *p, uint64_t i)
{
    switch (type) {
    case SKV_DTYPE_I8: return (float)((const int8_t *)p)[i];
    case SKV_DTYPE_I16: { int16_t v; memcpy(&v, p + 2 * i, 2); return (float)v; }
    case SKV_DTYPE_I32: { int32_t v; memcpy(&v, p + 4 * i, 4); return (float)v; }
    case SKV_DTYPE_I64: { int64_t v; memcpy(&v, p + 8 * i, 8); return (float)v; }
    case SKV_DTYPE_F64: { double v; memcpy(&v, p + 8 * i, 8); return (float)v; }
    default: fail_msg("type %d is not plain", type); return 0;
    }
}

static void test_fixture_tensors(void **state)
{
    (void)state;
    struct expected_tensor exp[32];
    int n = load_expected(exp, 32);
    assert_int_equal(n, 19);

    char path[4096];
    size_t size;
    src_path(path, sizeof path, "tests/fixtures/types.gguf.fixture");
    uint8_t *buf = slurp(path, &size);
    assert_non_null(buf);
    struct skv_gguf *g = NULL;
    assert_int_equal(skv_gguf_open_buffer(buf, size, &g), SKV_OK);
    assert_int_equal(skv_gguf_n_tensors(g), n);
    struct skv_gguf *gm = open_fixture(); /* the mmap path agrees */

    int n_dequant = 0;
    for (int i = 0; i < n; i++) {
        const struct expected_tensor *e = &exp[i];
        const struct skv_tensor *t = skv_gguf_tensor(g, i);
        assert_non_null(t);
        assert_string_equal(t->name, e->name);
        assert_ptr_equal(skv_gguf_find_tensor(g, e->name), t);
        assert_int_equal(t->type, e->type);
        assert_int_equal(t->ndim, e->ndim);
        for (int d = 0; d < 4; d++)
            assert_int_equal(t->ne[d], e->ne[d]);
        assert_int_equal((const uint8_t *)t->data - buf, e->offset);
        assert_int_equal(e->offset % 64, 0);
        int64_t rows = t->ne[1] * t->ne[2] * t->ne[3];
        assert_int_equal(t->nbytes, skv_dtype_row_bytes(t->type, t->ne[0]) * (size_t)rows);
        assert_int_equal((uint64_t)(t->ne[0] * rows), e->n);

        const struct skv_tensor *tm = skv_gguf_find_tensor(gm, e->name);
        assert_non_null(tm);
        assert_int_equal(tm->nbytes, t->nbytes);
        assert_memory_equal(tm->data, t->data, t->nbytes);

        if (!skv_dtype_supported(t->type)) {
            for (uint64_t k = 0; k < e->n; k++)
                assert_true(plain_value(t->type, t->data, k) == e->values[k]);
            continue;
        }
        /* row by row, as the kernels see them */
        float *row = malloc((size_t)t->ne[0] * sizeof *row);
        assert_non_null(row);
        size_t row_bytes = skv_dtype_row_bytes(t->type, t->ne[0]);
        for (int64_t r = 0; r < rows; r++) {
            const float *want = e->values + r * t->ne[0];
            int rc = skv_dequantize_row(t->type, (const uint8_t *)t->data + r * row_bytes, row,
                                        t->ne[0]);
            if (rc != SKV_OK)
                fail_msg("%s: %s", t->name, skv_error_msg());
            float amax = 0;
            for (int64_t k = 0; k < t->ne[0]; k++)
                amax = fmaxf(amax, fabsf(want[k]));
            for (int64_t k = 0; k < t->ne[0]; k++) {
                assert_true(isfinite(want[k]));
                /* gguf-py computes in float32 too; only the operation order may differ */
                if (fabsf(row[k] - want[k]) > 1e-6f * amax)
                    fail_msg("%s row %lld elem %lld: %.9g, gguf-py %.9g", t->name, (long long)r,
                             (long long)k, row[k], want[k]);
            }
        }
        free(row);
        n_dequant++;
    }
    assert_int_equal(n_dequant, 14); /* f32 x2, f16, bf16, 5 legacy quants, 5 K-quants */
    assert_null(skv_gguf_find_tensor(g, "t.missing"));
    assert_null(skv_gguf_find_tensor(g, "t."));
    assert_null(skv_gguf_find_tensor(g, NULL));
    assert_null(skv_gguf_tensor(g, -1));
    assert_null(skv_gguf_tensor(g, n));

    skv_gguf_close(&gm);
    skv_gguf_close(&g);
    free(buf);
    for (int i = 0; i < n; i++)
        free(exp[i].values);
}

/* Every cut of the fixture fails with SKV_E_FORMAT until all tensor data is inside. */
static void test_truncation(void **state)
{
    (void)state;
    char path[4096];
    size_t size;
    src_path(path, sizeof path, "tests/fixtures/types.gguf.fixture");
    uint8_t *buf = slurp(path, &size);
    assert_non_null(buf);
    struct skv_gguf *g = NULL;
    assert_int_equal(skv_gguf_open_buffer(buf, size, &g), SKV_OK);
    size_t needed = 0;
    for (int64_t i = 0; i < skv_gguf_n_tensors(g); i++) {
        const struct skv_tensor *t = skv_gguf_tensor(g, i);
        size_t end = (size_t)((const uint8_t *)t->data - buf) + t->nbytes;
        needed = end > needed ? end : needed;
    }
    skv_gguf_close(&g);
    assert_true(needed > 512 && needed <= size);

    int n_cuts = 0;
    for (size_t cut = 0; cut <= size; cut += cut < 512 ? 1 : 7) {
        int rc = open_copy(buf, cut);
        if (cut < needed) {
            if (rc != SKV_E_FORMAT)
                fail_msg("cut at %zu: %s (%s)", cut, skv_status_name(rc), skv_error_msg());
        } else {
            assert_int_equal(rc, SKV_OK);
        }
        n_cuts++;
    }
    assert_int_equal(open_copy(buf, size), SKV_OK);
    assert_true(n_cuts > 1000);
    free(buf);
}

static void test_open_errors(void **state)
{
    (void)state;
    struct skv_gguf *g = NULL;
    assert_int_equal(skv_gguf_open("/nonexistent/dir/model.gguf", &g), SKV_E_NOT_FOUND);
    assert_non_null(strstr(skv_error_msg(), "/nonexistent/dir/model.gguf"));
    assert_null(g);
    assert_int_equal(skv_gguf_open(srcdir(), &g), SKV_E_IO); /* a directory */
    assert_int_equal(skv_gguf_open(NULL, &g), SKV_E_INVAL);
    assert_int_equal(skv_gguf_open_buffer(NULL, 10, &g), SKV_E_INVAL);
    assert_int_equal(skv_gguf_open_buffer("GGUF", 4, NULL), SKV_E_INVAL);
    assert_int_equal(skv_gguf_open_buffer("", 0, &g), SKV_E_FORMAT);

    char path[] = "/tmp/skv_test_gguf_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "wb");
    fputs("GGUF\x03", f);
    fclose(f);
    assert_int_equal(skv_gguf_open(path, &g), SKV_E_FORMAT);
    assert_non_null(strstr(skv_error_msg(), path));
    remove(path);
    assert_null(g);
}

/* ---- crafted files ---- */

struct buf {
    uint8_t *p;
    size_t len, cap;
};

static void put(struct buf *b, const void *src, size_t n)
{
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        assert_non_null(b->p);
    }
    memcpy(b->p + b->len, src, n);
    b->len += n;
}

static void put_u32(struct buf *b, uint32_t v)
{
    put(b, &v, 4);
}

static void put_u64(struct buf *b, uint64_t v)
{
    put(b, &v, 8);
}

static void put_str(struct buf *b, const char *s)
{
    put_u64(b, strlen(s));
    put(b, s, strlen(s));
}

struct tspec {
    const char *name;
    uint32_t n_dims;
    uint64_t dims[5];
    uint32_t type;
    uint64_t offset;
};

struct fspec {
    const char *magic;      /* NULL: "GGUF" */
    uint32_t version;       /* 0: 3 */
    int n_kv;               /* entries in kv */
    struct buf kv;          /* raw key/value entries */
    uint64_t n_kv_field;    /* 0: n_kv */
    int n_tensors;
    struct tspec t[4];
    uint64_t n_tensors_field; /* 0: n_tensors */
    size_t alignment;       /* of the data section start; 0: 32 */
    size_t data_bytes;
};

/* A valid base: an f32 [8, 2] and a q4_0 [32] tensor. */
static struct fspec base_spec(void)
{
    struct fspec s = {0};
    s.n_tensors = 2;
    s.t[0] = (struct tspec){"a", 2, {8, 2}, SKV_DTYPE_F32, 0};
    s.t[1] = (struct tspec){"b", 1, {32}, SKV_DTYPE_Q4_0, 64};
    s.data_bytes = 96;
    put_str(&s.kv, "general.architecture");
    put_u32(&s.kv, SKV_GGUF_STRING);
    put_str(&s.kv, "test");
    s.n_kv = 1;
    return s;
}

static void add_kv_u32(struct fspec *s, const char *key, uint32_t v)
{
    put_str(&s->kv, key);
    put_u32(&s->kv, SKV_GGUF_UINT32);
    put_u32(&s->kv, v);
    s->n_kv++;
}

static struct buf build(const struct fspec *s)
{
    struct buf b = {0};
    put(&b, s->magic ? s->magic : "GGUF", 4);
    put_u32(&b, s->version ? s->version : 3);
    put_u64(&b, s->n_tensors_field ? s->n_tensors_field : (uint64_t)s->n_tensors);
    put_u64(&b, s->n_kv_field ? s->n_kv_field : (uint64_t)s->n_kv);
    put(&b, s->kv.p, s->kv.len);
    for (int i = 0; i < s->n_tensors; i++) {
        const struct tspec *t = &s->t[i];
        put_u64(&b, strlen(t->name) + (t->name[0] == '\0' ? 2 : 0)); /* "" -> "\0x" */
        put(&b, t->name[0] ? t->name : "\0x", strlen(t->name) + (t->name[0] == '\0' ? 2 : 0));
        put_u32(&b, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims && d < 5; d++)
            put_u64(&b, t->dims[d]);
        put_u32(&b, t->type);
        put_u64(&b, t->offset);
    }
    size_t align = s->alignment ? s->alignment : 32;
    static const uint8_t zeros[4096];
    put(&b, zeros, (align - b.len % align) % align);
    for (size_t left = s->data_bytes; left > 0;) {
        size_t n = left < sizeof zeros ? left : sizeof zeros;
        put(&b, zeros, n);
        left -= n;
    }
    return b;
}

/* Builds, opens an exact-size copy, frees; returns the status (and keeps the message). */
static int open_spec(struct fspec *s)
{
    struct buf b = build(s);
    int rc = open_copy(b.p, b.len);
    free(b.p);
    free(s->kv.p);
    s->kv.p = NULL;
    return rc;
}

static void expect(struct fspec s, int status, const char *in_msg)
{
    int rc = open_spec(&s);
    if (rc != status)
        fail_msg("want %s, got %s: %s", skv_status_name(status), skv_status_name(rc),
                 skv_error_msg());
    if (in_msg != NULL && strstr(skv_error_msg(), in_msg) == NULL)
        fail_msg("message \"%s\" lacks \"%s\"", skv_error_msg(), in_msg);
}

static void test_crafted_valid(void **state)
{
    (void)state;
    struct fspec s = base_spec();
    struct buf b = build(&s);
    struct skv_gguf *g = NULL;
    assert_int_equal(skv_gguf_open_buffer(b.p, b.len, &g), SKV_OK);
    assert_int_equal(skv_gguf_alignment(g), 32);
    assert_int_equal(skv_gguf_n_tensors(g), 2);
    const struct skv_tensor *t = skv_gguf_find_tensor(g, "b");
    assert_non_null(t);
    assert_int_equal(t->nbytes, 18);
    assert_int_equal(t->ndim, 1);
    assert_int_equal(t->ne[1], 1);
    assert_int_equal(t->ne[3], 1);
    skv_gguf_close(&g);
    free(b.p);
    free(s.kv.p);

    /* v2 reads like v3 */
    s = base_spec();
    s.version = 2;
    expect(s, SKV_OK, NULL);

    /* a known type the CPU cannot run still loads */
    s = base_spec();
    s.t[1] = (struct tspec){"b", 1, {32}, SKV_DTYPE_Q8_1, 64};
    s.data_bytes = 100;
    expect(s, SKV_OK, NULL);
    s = base_spec();
    s.t[1] = (struct tspec){"b", 1, {4}, SKV_DTYPE_I64, 64};
    expect(s, SKV_OK, NULL);

    /* a custom alignment moves the data section */
    s = base_spec();
    add_kv_u32(&s, "general.alignment", 128);
    s.alignment = 128;
    s.t[1].offset = 128;
    s.data_bytes = 160;
    expect(s, SKV_OK, NULL);

    /* no tensors, no padding at the end */
    s = base_spec();
    s.n_tensors = 0;
    s.data_bytes = 0;
    struct buf nb = build(&s);
    assert_int_equal(open_copy(nb.p, 24 + s.kv.len), SKV_OK);
    free(nb.p);
    free(s.kv.p);

    /* 4 dims */
    s = base_spec();
    s.t[0] = (struct tspec){"a", 4, {8, 1, 1, 2}, SKV_DTYPE_F32, 0};
    expect(s, SKV_OK, NULL);
}

static void test_crafted_header(void **state)
{
    (void)state;
    struct fspec s;

    s = base_spec();
    s.magic = "GGUG";
    expect(s, SKV_E_FORMAT, "magic");
    s = base_spec();
    s.magic = "FUGG";
    expect(s, SKV_E_FORMAT, "magic");
    s = base_spec();
    s.version = 1;
    expect(s, SKV_E_VERSION, "version 1");
    s = base_spec();
    s.version = 4;
    expect(s, SKV_E_VERSION, "version 4");
    s = base_spec();
    s.version = 0x03000000; /* a big-endian v3 file */
    expect(s, SKV_E_VERSION, "big-endian");
    s = base_spec();
    s.n_kv_field = UINT64_MAX;
    expect(s, SKV_E_FORMAT, "keys");
    s = base_spec();
    s.n_kv_field = 1000; /* plausible but not there */
    expect(s, SKV_E_FORMAT, NULL);
    s = base_spec();
    s.n_tensors_field = (uint64_t)1 << 40;
    expect(s, SKV_E_FORMAT, "tensors");
    s = base_spec();
    s.n_tensors_field = 3; /* one more than written */
    expect(s, SKV_E_FORMAT, NULL);
}

static void test_crafted_metadata(void **state)
{
    (void)state;
    struct fspec s;

    /* huge key name length */
    s = base_spec();
    put_u64(&s.kv, UINT64_MAX - 3);
    s.n_kv++;
    expect(s, SKV_E_FORMAT, "string length");

    /* huge string value length */
    s = base_spec();
    put_str(&s.kv, "test.s");
    put_u32(&s.kv, SKV_GGUF_STRING);
    put_u64(&s.kv, (uint64_t)1 << 62);
    s.n_kv++;
    expect(s, SKV_E_FORMAT, "'test.s'");

    /* huge array counts, of a fixed-size type (count * size overflows) and of strings */
    s = base_spec();
    put_str(&s.kv, "test.arr");
    put_u32(&s.kv, SKV_GGUF_ARRAY);
    put_u32(&s.kv, SKV_GGUF_UINT64);
    put_u64(&s.kv, (uint64_t)1 << 61);
    s.n_kv++;
    expect(s, SKV_E_FORMAT, "'test.arr'");
    s = base_spec();
    put_str(&s.kv, "test.arr");
    put_u32(&s.kv, SKV_GGUF_ARRAY);
    put_u32(&s.kv, SKV_GGUF_STRING);
    put_u64(&s.kv, UINT64_MAX);
    s.n_kv++;
    expect(s, SKV_E_FORMAT, "array of");

    /* unknown value type and unknown element type */
    s = base_spec();
    put_str(&s.kv, "test.x");
    put_u32(&s.kv, 13);
    put_u32(&s.kv, 0);
    s.n_kv++;
    expect(s, SKV_E_FORMAT, "unknown value type 13");
    s = base_spec();
    put_str(&s.kv, "test.x");
    put_u32(&s.kv, SKV_GGUF_ARRAY);
    put_u32(&s.kv, 77);
    put_u64(&s.kv, 1);
    s.n_kv++;
    expect(s, SKV_E_FORMAT, "element type 77");

    /* arrays nested 9 deep */
    s = base_spec();
    put_str(&s.kv, "test.deep");
    put_u32(&s.kv, SKV_GGUF_ARRAY);
    for (int i = 0; i < 9; i++) {
        put_u32(&s.kv, SKV_GGUF_ARRAY);
        put_u64(&s.kv, 1);
    }
    put_u32(&s.kv, SKV_GGUF_UINT8);
    put_u64(&s.kv, 0);
    s.n_kv++;
    expect(s, SKV_E_FORMAT, "nested");

    /* arrays nested 3 deep, with an inner string array: fine */
    s = base_spec();
    put_str(&s.kv, "test.nest");
    put_u32(&s.kv, SKV_GGUF_ARRAY);
    put_u32(&s.kv, SKV_GGUF_ARRAY);
    put_u64(&s.kv, 2);
    put_u32(&s.kv, SKV_GGUF_STRING);
    put_u64(&s.kv, 1);
    put_str(&s.kv, "x");
    put_u32(&s.kv, SKV_GGUF_ARRAY);
    put_u64(&s.kv, 1);
    put_u32(&s.kv, SKV_GGUF_UINT16);
    put_u64(&s.kv, 2);
    put_u32(&s.kv, 0);
    s.n_kv++;
    expect(s, SKV_OK, NULL);

    /* duplicate keys */
    s = base_spec();
    add_kv_u32(&s, "test.k", 1);
    add_kv_u32(&s, "test.k", 2);
    expect(s, SKV_E_FORMAT, "duplicates key");

    /* bad alignments: 0, not a power of two, not an integer */
    static const uint32_t bad_align[] = {0, 3, 48, 0x80000000u};
    for (size_t i = 0; i < sizeof bad_align / sizeof bad_align[0]; i++) {
        s = base_spec();
        add_kv_u32(&s, "general.alignment", bad_align[i]);
        expect(s, SKV_E_FORMAT, "general.alignment");
    }
    s = base_spec();
    put_str(&s.kv, "general.alignment");
    put_u32(&s.kv, SKV_GGUF_STRING);
    put_str(&s.kv, "32");
    s.n_kv++;
    expect(s, SKV_E_FORMAT, "general.alignment");
}

static void test_crafted_tensors(void **state)
{
    (void)state;
    struct fspec s;

    s = base_spec();
    s.t[1].offset = 4096; /* beyond EOF */
    expect(s, SKV_E_FORMAT, "'b'");
    s = base_spec();
    s.t[1].offset = UINT64_MAX - 31; /* offset + size wraps */
    expect(s, SKV_E_FORMAT, "'b'");
    s = base_spec();
    s.t[1].dims[0] = 64; /* 36 bytes at 64: past the 96 */
    expect(s, SKV_E_FORMAT, "past the end");
    s = base_spec();
    s.t[1].offset = 48; /* not a multiple of 32 */
    expect(s, SKV_E_FORMAT, "alignment");
    s = base_spec();
    s.t[0].n_dims = 5;
    s.t[0].dims[2] = s.t[0].dims[3] = s.t[0].dims[4] = 1;
    expect(s, SKV_E_FORMAT, "5 dims");
    s = base_spec();
    s.t[0].n_dims = 0;
    expect(s, SKV_E_FORMAT, "'a'");
    s = base_spec();
    s.t[0].dims[1] = 0;
    expect(s, SKV_E_FORMAT, "dim 1");
    s = base_spec();
    s.t[0].dims[0] = UINT64_MAX; /* "-1" */
    expect(s, SKV_E_FORMAT, "dim 0");
    s = base_spec();
    s.t[0].dims[0] = (uint64_t)1 << 32; /* 2^32 * 2^32 overflows 64 bits */
    s.t[0].dims[1] = (uint64_t)1 << 32;
    expect(s, SKV_E_FORMAT, "2^40");
    s = base_spec();
    s.t[0].n_dims = 4;
    s.t[0].dims[0] = s.t[0].dims[1] = s.t[0].dims[2] = s.t[0].dims[3] = 1u << 11;
    expect(s, SKV_E_FORMAT, "2^40"); /* 2^44 elements */
    s = base_spec();
    s.t[0].dims[0] = ((uint64_t)1 << 40) + 1;
    s.t[0].dims[1] = 1;
    expect(s, SKV_E_FORMAT, "dim 0");
    s = base_spec();
    s.t[1].dims[0] = 33; /* not a multiple of the q4_0 block */
    expect(s, SKV_E_FORMAT, "block");
    s = base_spec();
    s.t[1].offset = 32; /* b's 18 bytes inside a's [0, 64): V read as K */
    expect(s, SKV_E_FORMAT, "overlap tensor 'a'");
    s = base_spec();
    s.t[0].offset = 64; /* the same bytes for both */
    s.data_bytes = 128;
    expect(s, SKV_E_FORMAT, "overlap");
    s = base_spec(); /* an alignment of 2 that leaves the weights at an odd 2: f32 rows read unaligned */
    add_kv_u32(&s, "general.alignment", 2);
    s.alignment = 2;
    s.t[1].offset = 66;
    s.data_bytes = 96;
    expect(s, SKV_E_FORMAT, "4-byte aligned");

    /* unknown types: removed ids, IQ types, far out */
    static const uint32_t unknown[] = {4, 5, 16, 29, 31, 1000, 0xffffffffu};
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        s = base_spec();
        s.t[1].type = unknown[i];
        expect(s, SKV_E_UNSUPPORTED, "'b'");
    }

    /* duplicate names, names with a NUL */
    s = base_spec();
    s.t[1].name = "a";
    expect(s, SKV_E_FORMAT, "duplicates tensor");
    s = base_spec();
    s.t[1].name = "";
    expect(s, SKV_E_FORMAT, "NUL");

    /* huge tensor name length */
    s = base_spec();
    s.n_tensors = 0;
    s.n_tensors_field = 1;
    put_u64(&s.kv, 0); /* nothing: the name length is read past the kv */
    s.data_bytes = 64;
    {
        struct buf b = build(&s);
        /* overwrite the bytes after the kvs with a huge name length */
        size_t at = 24 + s.kv.len - 8;
        uint64_t huge = (uint64_t)1 << 60;
        memcpy(b.p + at, &huge, 8);
        int rc = open_copy(b.p, b.len);
        assert_int_equal(rc, SKV_E_FORMAT);
        assert_non_null(strstr(skv_error_msg(), "tensor name"));
        free(b.p);
        free(s.kv.p);
    }
}

/* Many tensors and keys: the index is exercised past its initial size. */
static void test_crafted_many(void **state)
{
    (void)state;
    struct buf b = {0};
    const int n_t = 3000, n_kv = 2000;
    put(&b, "GGUF", 4);
    put_u32(&b, 3);
    put_u64(&b, (uint64_t)n_t);
    put_u64(&b, (uint64_t)n_kv);
    char name[32];
    for (int i = 0; i < n_kv; i++) {
        snprintf(name, sizeof name, "k.%d", i);
        put_str(&b, name);
        put_u32(&b, SKV_GGUF_INT32);
        put_u32(&b, (uint32_t)(i * 7));
    }
    for (int i = 0; i < n_t; i++) {
        snprintf(name, sizeof name, "t.%d", i);
        put_str(&b, name);
        put_u32(&b, 1);
        put_u64(&b, 8);
        put_u32(&b, SKV_DTYPE_F32);
        put_u64(&b, (uint64_t)i * 32);
    }
    static const uint8_t zeros[32];
    put(&b, zeros, (32 - b.len % 32) % 32);
    for (int i = 0; i < n_t; i++)
        put(&b, zeros, 32);

    struct skv_gguf *g = NULL;
    assert_int_equal(skv_gguf_open_buffer(b.p, b.len, &g), SKV_OK);
    int64_t v;
    for (int i = 0; i < n_kv; i++) {
        snprintf(name, sizeof name, "k.%d", i);
        assert_int_equal(skv_gguf_find_key(g, name), i);
        assert_true(skv_gguf_get_i64(g, name, &v) && v == i * 7);
    }
    for (int i = 0; i < n_t; i++) {
        snprintf(name, sizeof name, "t.%d", i);
        assert_ptr_equal(skv_gguf_find_tensor(g, name), skv_gguf_tensor(g, i));
    }
    skv_gguf_close(&g);
    free(b.p);
}

/* ---- the real model ---- */

static void model_path(char *out, size_t n)
{
    const char *m = getenv("SKV_MODEL");
    if (m && *m)
        snprintf(out, n, "%s", m);
    else
        src_path(out, n, "models/SmolLM2-135M-Instruct.Q4_1.gguf");
}

static void test_model(void **state)
{
    (void)state;
    char path[4096];
    model_path(path, sizeof path);
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        skip();
        return;
    }
    fclose(f);
    struct skv_gguf *g = NULL;
    if (skv_gguf_open(path, &g) != SKV_OK)
        fail_msg("%s", skv_error_msg());
    uint32_t u32;
    float f32;
    int et;
    uint64_t count;
    struct skv_gguf_str s;

    assert_int_equal(skv_gguf_version(g), 3);
    assert_int_equal(skv_gguf_n_tensors(g), 272);
    assert_int_equal(skv_gguf_n_keys(g), 33);
    assert_true(skv_gguf_get_str(g, "general.architecture", &s) && str_eq(s, "llama"));
    assert_true(skv_gguf_get_u32(g, "llama.block_count", &u32) && u32 == 30);
    assert_true(skv_gguf_get_u32(g, "llama.embedding_length", &u32) && u32 == 576);
    assert_true(skv_gguf_get_u32(g, "llama.attention.head_count", &u32) && u32 == 9);
    assert_true(skv_gguf_get_u32(g, "llama.attention.head_count_kv", &u32) && u32 == 3);
    assert_true(skv_gguf_get_u32(g, "llama.feed_forward_length", &u32) && u32 == 1536);
    assert_true(skv_gguf_get_f32(g, "llama.rope.freq_base", &f32) && f32 == 100000.0f);
    assert_true(skv_gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &f32) &&
                f32 == 1e-5f);
    assert_true(skv_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &count));
    assert_int_equal(et, SKV_GGUF_STRING);
    assert_int_equal(count, 49152);
    assert_true(skv_gguf_get_arr_str(g, "tokenizer.ggml.tokens", 0, &s));
    assert_true(skv_gguf_get_arr_str(g, "tokenizer.ggml.tokens", 49151, &s));
    assert_true(skv_gguf_get_arr(g, "tokenizer.ggml.merges", &et, &count));
    assert_int_equal(et, SKV_GGUF_STRING);
    assert_int_equal(count, 48900);
    assert_true(skv_gguf_get_arr(g, "tokenizer.ggml.token_type", &et, &count));
    assert_int_equal(et, SKV_GGUF_INT32);
    assert_int_equal(count, 49152);

    const struct skv_tensor *t = skv_gguf_find_tensor(g, "token_embd.weight");
    assert_non_null(t);
    assert_int_equal(t->type, SKV_DTYPE_Q8_0);
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->ne[0], 576);
    assert_int_equal(t->ne[1], 49152);
    assert_int_equal(t->nbytes, 49152 * 18 * 34);
    t = skv_gguf_find_tensor(g, "blk.0.attn_q.weight");
    assert_non_null(t);
    assert_int_equal(t->type, SKV_DTYPE_Q4_1);
    assert_int_equal(t->ne[0], 576);
    assert_int_equal(t->ne[1], 576);
    t = skv_gguf_find_tensor(g, "blk.29.ffn_down.weight");
    assert_non_null(t);
    assert_int_equal(t->ne[0], 1536);
    assert_int_equal(t->ne[1], 576);
    t = skv_gguf_find_tensor(g, "output_norm.weight");
    assert_non_null(t);
    assert_int_equal(t->type, SKV_DTYPE_F32);
    assert_null(skv_gguf_find_tensor(g, "output.weight")); /* tied embeddings */

    /* the dtype summary the docs record */
    int64_t per_type[SKV_DTYPE_COUNT] = {0};
    size_t bytes_per_type[SKV_DTYPE_COUNT] = {0};
    for (int64_t i = 0; i < skv_gguf_n_tensors(g); i++) {
        t = skv_gguf_tensor(g, i);
        per_type[t->type]++;
        bytes_per_type[t->type] += t->nbytes;
        assert_true(skv_dtype_supported(t->type));
    }
    assert_int_equal(per_type[SKV_DTYPE_Q4_1], 210);
    assert_int_equal(per_type[SKV_DTYPE_F32], 61);
    assert_int_equal(per_type[SKV_DTYPE_Q8_0], 1);
    for (int ty = 0; ty < SKV_DTYPE_COUNT; ty++)
        if (per_type[ty] > 0)
            print_message("[ model    ] %-5s %4lld tensors %10zu bytes\n", skv_dtype_name(ty),
                          (long long)per_type[ty], bytes_per_type[ty]);

    /* dequantize a row of each kind to check the data lands where expected */
    float row[1536];
    t = skv_gguf_find_tensor(g, "token_embd.weight");
    assert_int_equal(skv_dequantize_row(t->type, t->data, row, t->ne[0]), SKV_OK);
    float amax = 0;
    for (int k = 0; k < 576; k++) {
        assert_true(isfinite(row[k]));
        amax = fmaxf(amax, fabsf(row[k]));
    }
    assert_true(amax > 0.0f && amax < 100.0f);
    skv_gguf_close(&g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtype_table),
        cmocka_unit_test(test_fp16),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_fixture_metadata),
        cmocka_unit_test(test_fixture_tensors),
        cmocka_unit_test(test_truncation),
        cmocka_unit_test(test_open_errors),
        cmocka_unit_test(test_crafted_valid),
        cmocka_unit_test(test_crafted_header),
        cmocka_unit_test(test_crafted_metadata),
        cmocka_unit_test(test_crafted_tensors),
        cmocka_unit_test(test_crafted_many),
        cmocka_unit_test(test_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
