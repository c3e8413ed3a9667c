/* Unit tests for the safetensors reader: the tiny HF fixtures (single file, sharded, bf16,
 * qwen2) against the values the generator read back with the safetensors library
 * (tests/fixtures/<dir>/tensors.json), and corrupt files and indexes made here. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/common/fixture.h"
#include "common/status.h"
#include "daemon/engine/safetensors.h"

/* ---- helpers ------------------------------------------------------------------------------ */

static const char *srcdir(void)
{
    const char *s = getenv("SKV_SRCDIR");
    return s && *s ? s : ".";
}

static void fixture_dir(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "%s/tests/fixtures/%s", srcdir(), name);
}

static float half_to_f32(uint16_t h)
{
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float v = e == 0 ? ldexpf((float)m, -24)
            : e == 31 ? (m ? NAN : INFINITY)
            : ldexpf((float)(m | 0x400), e - 25);
    return (h & 0x8000) ? -v : v;
}

static double value_at(const struct skv_tensor *t, int64_t i)
{
    if (t->type == SKV_DTYPE_F32) {
        float f;
        memcpy(&f, (const char *)t->data + 4 * i, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, (const char *)t->data + 2 * i, 2);
    if (t->type == SKV_DTYPE_F16)
        return half_to_f32(h);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static int dtype_of(const char *s)
{
    if (strcmp(s, "F32") == 0)
        return SKV_DTYPE_F32;
    if (strcmp(s, "F16") == 0)
        return SKV_DTYPE_F16;
    if (strcmp(s, "BF16") == 0)
        return SKV_DTYPE_BF16;
    return -1;
}

/* Every tensor in <fixture>/tensors.json: present, dtype, ne (shape reversed), bytes, and the
 * sampled values bit for bit. Returns the number of tensors checked. */
static int64_t check_fixture(const struct skv_safetensors *st, const char *fixture)
{
    char dir[1024], path[1100];
    fixture_dir(dir, sizeof dir, fixture);
    snprintf(path, sizeof path, "%s/tensors.json", dir);
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root)
        fail_msg("%s: %s", path, jerr.text);
    json_t *tensors = json_object_get(root, "tensors");
    assert_non_null(tensors);
    assert_int_equal(skv_safetensors_n_tensors(st),
                     json_integer_value(json_object_get(root, "n_tensors")));
    const char *name;
    json_t *exp;
    int64_t checked = 0;
    json_object_foreach(tensors, name, exp) {
        const struct skv_tensor *t = skv_safetensors_find(st, name);
        if (!t)
            fail_msg("%s: tensor %s not found", fixture, name);
        assert_string_equal(t->name, name);
        int type = dtype_of(json_string_value(json_object_get(exp, "dtype")));
        assert_int_equal(t->type, type);
        json_t *shape = json_object_get(exp, "shape");
        int nd = (int)json_array_size(shape);
        assert_int_equal(t->ndim, nd);
        int64_t nelem = 1;
        for (int i = 0; i < nd; i++) {
            int64_t d = json_integer_value(json_array_get(shape, (size_t)i));
            assert_int_equal(t->ne[nd - 1 - i], d);
            nelem *= d;
        }
        for (int i = nd; i < 4; i++)
            assert_int_equal(t->ne[i], 1);
        assert_int_equal(t->nbytes, (size_t)nelem * (type == SKV_DTYPE_F32 ? 4 : 2));
        size_t k;
        json_t *s;
        json_array_foreach(json_object_get(exp, "samples"), k, s) {
            int64_t idx = json_integer_value(json_array_get(s, 0));
            double want = json_real_value(json_array_get(s, 1));
            double got = value_at(t, idx);
            if (got != want)
                fail_msg("%s: %s[%lld] = %.9g, expected %.9g", fixture, name, (long long)idx,
                         got, want);
        }
        checked++;
    }
    json_decref(root);
    return checked;
}

/* Fixture weights are committed as "*.safetensors.fixture"; stage a copy under the real
 * names (the maps stay valid after the copy is removed). */
static struct skv_safetensors *open_fixture(const char *fixture)
{
    char rel[1024];
    snprintf(rel, sizeof rel, "tests/fixtures/%s", fixture);
    char *dir = fixture_stage_dir(rel);
    assert_non_null(dir);
    struct skv_safetensors *st = NULL;
    int rc = skv_safetensors_open_dir(dir, &st);
    if (rc != SKV_OK)
        fail_msg("%s: %s: %s", dir, skv_status_name(rc), skv_error_msg());
    fixture_remove_dir(dir);
    return st;
}

/* A scratch directory per test (cmocka state). */
static int tmp_setup(void **state)
{
    const char *base = getenv("TMPDIR");
    char tmpl[512];
    snprintf(tmpl, sizeof tmpl, "%s/skv_st_XXXXXX", base && *base ? base : "/tmp");
    char *d = mkdtemp(tmpl);
    if (!d)
        return -1;
    *state = strdup(d);
    return *state ? 0 : -1;
}

static void clear_dir(const char *dir)
{
    DIR *dp = opendir(dir);
    if (!dp)
        return;
    struct dirent *de;
    char p[1024];
    while ((de = readdir(dp)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        unlink(p);
    }
    closedir(dp);
}

static int tmp_teardown(void **state)
{
    clear_dir(*state);
    rmdir(*state);
    free(*state);
    return 0;
}

static void write_file(const char *dir, const char *name, const void *buf, size_t len)
{
    char p[1024];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    assert_non_null(f);
    if (len)
        assert_int_equal(fwrite(buf, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
}

/* A safetensors file: 8-byte LE header length (hlen, or strlen(header) when hlen < 0), the
 * header, then data_len bytes of data (byte i = i & 0xff). */
static void write_st(const char *dir, const char *name, const char *header, long long hlen,
                     size_t data_len)
{
    size_t hl = strlen(header);
    uint64_t v = hlen < 0 ? hl : (uint64_t)hlen;
    size_t len = 8 + hl + data_len;
    unsigned char *buf = malloc(len);
    assert_non_null(buf);
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)(v >> (8 * i));
    memcpy(buf + 8, header, hl);
    for (size_t i = 0; i < data_len; i++)
        buf[8 + hl + i] = (unsigned char)(i & 0xff);
    write_file(dir, name, buf, len);
    free(buf);
}

static int open_tmp(const char *dir)
{
    struct skv_safetensors *st = NULL;
    skv_error_clear();
    int rc = skv_safetensors_open_dir(dir, &st);
    if (rc == SKV_OK) {
        assert_non_null(st);
        skv_safetensors_close(&st);
        assert_null(st);
    } else {
        assert_null(st);   /* out written only on success */
        assert_true(skv_error_msg()[0] != '\0');
    }
    return rc;
}

/* Header of exactly 8-byte aligned length (spaces pad it, as the reference writer does). */
static void padded(char *out, size_t n, const char *json)
{
    size_t l = strlen(json);
    size_t p = (l + 7) / 8 * 8;
    assert_true(p < n);
    memcpy(out, json, l);
    memset(out + l, ' ', p - l);
    out[p] = '\0';
}

/* ---- the generated fixtures ----------------------------------------------------------------- */

static void test_single_f32(void **state)
{
    (void)state;
    struct skv_safetensors *st = open_fixture("tiny-llama");
    assert_int_equal(check_fixture(st, "tiny-llama"), 21);

    const struct skv_tensor *k = skv_safetensors_find(st, "model.layers.0.self_attn.k_proj.weight");
    assert_non_null(k);
    assert_int_equal(k->type, SKV_DTYPE_F32);
    assert_int_equal(k->ndim, 2);
    assert_int_equal(k->ne[0], 64);  /* input features innermost */
    assert_int_equal(k->ne[1], 32);  /* 2 kv heads x 16 */
    assert_non_null(skv_safetensors_find(st, "lm_head.weight"));
    assert_null(skv_safetensors_find(st, "model.layers.2.self_attn.k_proj.weight"));
    assert_null(skv_safetensors_find(st, NULL));

    /* index order: one file, ascending data offsets, each tensor findable by its own name */
    int64_t n = skv_safetensors_n_tensors(st);
    const char *prev_end = NULL;
    for (int64_t i = 0; i < n; i++) {
        const struct skv_tensor *t = skv_safetensors_tensor(st, i);
        assert_non_null(t);
        assert_ptr_equal(skv_safetensors_find(st, t->name), t);
        if (prev_end)
            assert_true((const char *)t->data >= prev_end);
        prev_end = (const char *)t->data + t->nbytes;
    }
    assert_null(skv_safetensors_tensor(st, -1));
    assert_null(skv_safetensors_tensor(st, n));
    skv_safetensors_close(&st);
    assert_null(st);
    skv_safetensors_close(&st);
    skv_safetensors_close(NULL);
}

static void test_sharded_matches_single(void **state)
{
    (void)state;
    struct skv_safetensors *sh = open_fixture("tiny-llama-sharded");
    struct skv_safetensors *one = open_fixture("tiny-llama");
    assert_int_equal(check_fixture(sh, "tiny-llama-sharded"), 21);
    assert_int_equal(skv_safetensors_n_tensors(sh), skv_safetensors_n_tensors(one));
    for (int64_t i = 0; i < skv_safetensors_n_tensors(one); i++) {
        const struct skv_tensor *a = skv_safetensors_tensor(one, i);
        const struct skv_tensor *b = skv_safetensors_find(sh, a->name);
        assert_non_null(b);
        assert_int_equal(a->type, b->type);
        assert_memory_equal(a->ne, b->ne, sizeof a->ne);
        assert_int_equal(a->nbytes, b->nbytes);
        assert_memory_equal(a->data, b->data, a->nbytes);
    }
    skv_safetensors_close(&sh);
    skv_safetensors_close(&one);
}

static void test_bf16(void **state)
{
    (void)state;
    struct skv_safetensors *bf = open_fixture("tiny-llama-bf16");
    struct skv_safetensors *f32 = open_fixture("tiny-llama");
    assert_int_equal(check_fixture(bf, "tiny-llama-bf16"), 21);
    for (int64_t i = 0; i < skv_safetensors_n_tensors(bf); i++) {
        const struct skv_tensor *b = skv_safetensors_tensor(bf, i);
        const struct skv_tensor *f = skv_safetensors_find(f32, b->name);
        assert_int_equal(b->type, SKV_DTYPE_BF16);
        assert_non_null(f);
        assert_memory_equal(b->ne, f->ne, sizeof b->ne);
        assert_int_equal(b->nbytes * 2, f->nbytes);
        /* the bf16 copy is the f32 weights rounded: within half a bf16 ulp (2^-8 relative) */
        int64_t n = (int64_t)b->nbytes / 2;
        for (int64_t j = 0; j < n; j += 7) {
            double x = value_at(f, j), y = value_at(b, j);
            assert_true(fabs(x - y) <= fabs(x) * (1.0 / 256) + 1e-30);
        }
    }
    skv_safetensors_close(&bf);
    skv_safetensors_close(&f32);
}

static void test_qwen2(void **state)
{
    (void)state;
    struct skv_safetensors *st = open_fixture("tiny-qwen2");
    /* per layer q/k/v weight + bias, o, gate, up, down, 2 norms; embeddings, final norm */
    assert_int_equal(check_fixture(st, "tiny-qwen2"), 2 * 12 + 2);
    const struct skv_tensor *qb = skv_safetensors_find(st, "model.layers.1.self_attn.q_proj.bias");
    const struct skv_tensor *kb = skv_safetensors_find(st, "model.layers.1.self_attn.k_proj.bias");
    assert_non_null(qb);
    assert_non_null(kb);
    assert_int_equal(qb->ndim, 1);
    assert_int_equal(qb->ne[0], 64);
    assert_int_equal(kb->ne[0], 32);
    assert_null(skv_safetensors_find(st, "lm_head.weight"));  /* tied to the embeddings */
    skv_safetensors_close(&st);
}

/* ---- arguments and missing files ------------------------------------------------------------ */

static void test_not_found(void **state)
{
    const char *dir = *state;
    struct skv_safetensors *st = NULL;
    assert_int_equal(skv_safetensors_open_dir(NULL, &st), SKV_E_INVAL);
    assert_int_equal(skv_safetensors_open_dir(dir, NULL), SKV_E_INVAL);
    assert_int_equal(open_tmp(dir), SKV_E_NOT_FOUND);   /* empty folder */
    char p[1024];
    snprintf(p, sizeof p, "%s/does-not-exist", dir);
    assert_int_equal(open_tmp(p), SKV_E_NOT_FOUND);
    assert_int_equal(skv_safetensors_n_tensors(NULL), 0);
    assert_null(skv_safetensors_tensor(NULL, 0));
    assert_null(skv_safetensors_find(NULL, "x"));
}

/* ---- hand-made valid file ------------------------------------------------------------------- */

static void test_valid_handmade(void **state)
{
    const char *dir = *state;
    char hdr[1024];
    /* data: f16 [2][3][4] at 0..48, scalar f32 at 48..52, empty f32 at 52..52, bf16 [2] at 52 */
    padded(hdr, sizeof hdr,
           "{\"__metadata__\":{\"format\":\"pt\"},"
           "\"w3\":{\"dtype\":\"F16\",\"shape\":[2,3,4],\"data_offsets\":[0,48]},"
           "\"s\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[48,52]},"
           "\"empty\":{\"dtype\":\"F32\",\"shape\":[0,5],\"data_offsets\":[52,52]},"
           "\"b\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[52,56]}}");
    write_st(dir, "model.safetensors", hdr, -1, 56);
    struct skv_safetensors *st = NULL;
    int rc = skv_safetensors_open_dir(dir, &st);
    if (rc != SKV_OK)
        fail_msg("%s", skv_error_msg());
    assert_int_equal(skv_safetensors_n_tensors(st), 4);
    /* file order by offset; the empty tensor (52..52) sorts before b (52..56) */
    assert_string_equal(skv_safetensors_tensor(st, 0)->name, "w3");
    assert_string_equal(skv_safetensors_tensor(st, 1)->name, "s");
    assert_string_equal(skv_safetensors_tensor(st, 2)->name, "empty");
    assert_string_equal(skv_safetensors_tensor(st, 3)->name, "b");
    const struct skv_tensor *w = skv_safetensors_find(st, "w3");
    assert_int_equal(w->type, SKV_DTYPE_F16);
    assert_int_equal(w->ndim, 3);
    assert_int_equal(w->ne[0], 4);
    assert_int_equal(w->ne[1], 3);
    assert_int_equal(w->ne[2], 2);
    assert_int_equal(w->ne[3], 1);
    assert_int_equal(w->nbytes, 48);
    /* data byte i = i: f16 element 0 is the bytes {0, 1} = 0x0100 */
    assert_true(value_at(w, 0) == half_to_f32(0x0100));
    const struct skv_tensor *s = skv_safetensors_find(st, "s");
    assert_int_equal(s->ndim, 1);
    assert_int_equal(s->ne[0], 1);
    assert_int_equal(s->nbytes, 4);
    const struct skv_tensor *e = skv_safetensors_find(st, "empty");
    assert_int_equal(e->ne[0], 5);
    assert_int_equal(e->ne[1], 0);
    assert_int_equal(e->nbytes, 0);
    skv_safetensors_close(&st);
}

/* ---- corrupt single files ------------------------------------------------------------------- */

struct bad_case {
    const char *what;
    const char *header;
    size_t data_len;
    int expect;
    const char *msg_has;   /* substring the error message must contain */
};

static void test_corrupt_headers(void **state)
{
    const char *dir = *state;
    static const struct bad_case cases[] = {
        {"bad JSON", "{\"a\": {\"dtype\": ", 0, SKV_E_FORMAT, "bad JSON"},
        {"not an object", "[1, 2]    ", 0, SKV_E_FORMAT, "not an object"},
        {"empty header", "", 0, SKV_E_FORMAT, "model.safetensors"},
        {"entry not an object", "{\"t\": 5}", 0, SKV_E_FORMAT, "tensor t"},
        {"missing dtype", "{\"t\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, SKV_E_FORMAT,
         "tensor t"},
        {"unsupported dtype", "{\"w.bad\":{\"dtype\":\"I64\",\"shape\":[1],"
         "\"data_offsets\":[0,8]}}", 8, SKV_E_UNSUPPORTED, "w.bad"},
        {"unknown dtype", "{\"w.bad\":{\"dtype\":\"Q9\",\"shape\":[1],\"data_offsets\":[0,4]}}",
         4, SKV_E_FORMAT, "w.bad"},
        {"5 dims", "{\"t5\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1],\"data_offsets\":[0,4]}}", 4,
         SKV_E_UNSUPPORTED, "t5"},
        {"negative dim", "{\"t\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4,
         SKV_E_FORMAT, "shape"},
        {"fractional dim", "{\"t\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}",
         4, SKV_E_FORMAT, "shape"},
        {"shape not array", "{\"t\":{\"dtype\":\"F32\",\"shape\":4,\"data_offsets\":[0,16]}}", 16,
         SKV_E_FORMAT, "shape"},
        {"huge shape", "{\"t\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,16],"
         "\"data_offsets\":[0,16]}}", 16, SKV_E_FORMAT, "overflow"},
        {"offsets past EOF", "{\"big\":{\"dtype\":\"F32\",\"shape\":[8],"
         "\"data_offsets\":[0,32]}}", 16, SKV_E_FORMAT, "past the end"},
        {"shape/offset mismatch", "{\"mm\":{\"dtype\":\"F32\",\"shape\":[3],"
         "\"data_offsets\":[0,16]}}", 16, SKV_E_FORMAT, "mm"},
        {"begin after end", "{\"t\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,4]}}",
         16, SKV_E_FORMAT, "data_offsets"},
        {"negative offset", "{\"t\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}",
         16, SKV_E_FORMAT, "data_offsets"},
        {"three offsets", "{\"t\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}",
         16, SKV_E_FORMAT, "data_offsets"},
        {"overlap", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 16, SKV_E_FORMAT,
         "overlap"},
        {"duplicate name", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 16, SKV_E_FORMAT,
         "bad JSON"},
        {"NUL in name", "{\"a\\u0000b\":{\"dtype\":\"F32\",\"shape\":[1],"
         "\"data_offsets\":[0,4]}}", 16, SKV_E_FORMAT, "bad JSON"},
        {"trailing garbage", "{}   x", 0, SKV_E_FORMAT, "bad JSON"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char hdr[512];
        padded(hdr, sizeof hdr, cases[i].header);
        write_st(dir, "model.safetensors", hdr, -1, cases[i].data_len);
        int rc = open_tmp(dir);
        if (rc != cases[i].expect || !strstr(skv_error_msg(), cases[i].msg_has) ||
            !strstr(skv_error_msg(), "model.safetensors"))
            fail_msg("%s: got %s \"%s\", expected %s containing \"%s\"", cases[i].what,
                     skv_status_name(rc), skv_error_msg(), skv_status_name(cases[i].expect),
                     cases[i].msg_has);
    }
}

static void test_misaligned(void **state)
{
    const char *dir = *state;
    /* an unpadded header puts the data area at an odd file offset: f32 data misaligned */
    const char *h = "{\"m\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}    ";
    assert_int_not_equal((8 + strlen(h)) % 4, 0);
    write_st(dir, "model.safetensors", h, -1, 4);
    assert_int_equal(open_tmp(dir), SKV_E_UNSUPPORTED);
    assert_non_null(strstr(skv_error_msg(), "aligned"));
}

static void test_header_length(void **state)
{
    const char *dir = *state;
    /* shorter than the length field */
    write_file(dir, "model.safetensors", "\x10\x00\x00", 3);
    assert_int_equal(open_tmp(dir), SKV_E_FORMAT);
    assert_non_null(strstr(skv_error_msg(), "truncated"));
    write_file(dir, "model.safetensors", "", 0);
    assert_int_equal(open_tmp(dir), SKV_E_FORMAT);
    /* header length past the end of the file, small and absurd */
    write_st(dir, "model.safetensors", "{}      ", 9, 0);
    assert_int_equal(open_tmp(dir), SKV_E_FORMAT);
    assert_non_null(strstr(skv_error_msg(), "past the end"));
    write_st(dir, "model.safetensors", "{}      ", (long long)0x7fffffffffffffffLL, 0);
    assert_int_equal(open_tmp(dir), SKV_E_FORMAT);
    write_st(dir, "model.safetensors", "{}      ", -1, 0);
    assert_int_equal(open_tmp(dir), SKV_OK);   /* an empty model is a valid file */

    /* a header over the limit (the file is sparse: nothing is written or read) */
    char p[1024];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    int fd = open(p, O_WRONLY | O_TRUNC);
    assert_true(fd >= 0);
    uint64_t hlen = SKV_SAFETENSORS_MAX_HEADER + 8;
    unsigned char le[8];
    for (int i = 0; i < 8; i++)
        le[i] = (unsigned char)(hlen >> (8 * i));
    assert_int_equal(write(fd, le, 8), 8);
    assert_int_equal(ftruncate(fd, (off_t)(hlen + 16)), 0);
    close(fd);
    assert_int_equal(open_tmp(dir), SKV_E_LIMIT);
}

/* Every prefix of a real file fails cleanly; the whole file opens. */
static void test_truncated_fixture(void **state)
{
    const char *dir = *state;
    char src[1100];
    fixture_dir(src, sizeof src, "tiny-llama/model.safetensors.fixture");
    FILE *f = fopen(src, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc((size_t)size);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)size, f), (size_t)size);
    fclose(f);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | buf[i];
    assert_true(hlen + 8 < (uint64_t)size);

    int n_checked = 0;
    for (long len = 0; len < size; len += (len < (long)hlen + 64 ? 1 : 997)) {
        write_file(dir, "model.safetensors", buf, (size_t)len);
        int rc = open_tmp(dir);
        if (rc != SKV_E_FORMAT)
            fail_msg("prefix of %ld bytes: %s \"%s\"", len, skv_status_name(rc),
                     skv_error_msg());
        n_checked++;
    }
    assert_true(n_checked > (int)hlen);
    write_file(dir, "model.safetensors", buf, (size_t)size);
    assert_int_equal(open_tmp(dir), SKV_OK);
    free(buf);
}

/* Random byte changes in a real header: every outcome is a status, never a crash (run it
 * under ASan/UBSan to see the point). */
static void test_mutated_fixture(void **state)
{
    const char *dir = *state;
    char src[1100];
    fixture_dir(src, sizeof src, "tiny-llama/model.safetensors.fixture");
    size_t fsize = 0;
    unsigned char *orig = fixture_read_file(src, &fsize), *buf = malloc(fsize);
    assert_non_null(orig);
    assert_non_null(buf);
    long size = (long)fsize;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | orig[i];

    static const char alphabet[] = "0123456789{}[]\",:- ae\\";
    uint64_t x = 0x9e3779b97f4a7c15ULL;
    int n_ok = 0, n_err = 0;
    for (int iter = 0; iter < 300; iter++) {
        memcpy(buf, orig, (size_t)size);
        int flips = 1 + iter % 3;
        for (int k = 0; k < flips; k++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            size_t pos = (size_t)(x % (hlen + 8));
            buf[pos] = (unsigned char)alphabet[(x >> 32) % (sizeof alphabet - 1)];
        }
        write_file(dir, "model.safetensors", buf, (size_t)size);
        int rc = open_tmp(dir);
        assert_true(rc == SKV_OK || rc == SKV_E_FORMAT || rc == SKV_E_UNSUPPORTED ||
                    rc == SKV_E_LIMIT);
        if (rc == SKV_OK)
            n_ok++;
        else
            n_err++;
    }
    assert_true(n_err > 0);
    free(orig);
    free(buf);
}

/* ---- sharded indexes ------------------------------------------------------------------------ */

#define SHARD_A "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}"
#define SHARD_B "{\"b\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,8]}}"

static void write_index(const char *dir, const char *weight_map_json)
{
    char buf[1024];
    snprintf(buf, sizeof buf, "{\"metadata\":{\"total_size\":16},\"weight_map\":%s}",
             weight_map_json);
    write_file(dir, "model.safetensors.index.json", buf, strlen(buf));
}

static void write_two_shards(const char *dir)
{
    char hdr[256];
    padded(hdr, sizeof hdr, SHARD_A);
    write_st(dir, "s-1.safetensors", hdr, -1, 8);
    padded(hdr, sizeof hdr, SHARD_B);
    write_st(dir, "s-2.safetensors", hdr, -1, 8);
}

static void test_index_valid(void **state)
{
    const char *dir = *state;
    write_two_shards(dir);
    write_index(dir, "{\"b\":\"s-2.safetensors\",\"a\":\"s-1.safetensors\"}");
    struct skv_safetensors *st = NULL;
    int rc = skv_safetensors_open_dir(dir, &st);
    if (rc != SKV_OK)
        fail_msg("%s", skv_error_msg());
    assert_int_equal(skv_safetensors_n_tensors(st), 2);
    /* shards in sorted name order */
    assert_string_equal(skv_safetensors_tensor(st, 0)->name, "a");
    assert_string_equal(skv_safetensors_tensor(st, 1)->name, "b");
    const struct skv_tensor *b = skv_safetensors_find(st, "b");
    assert_int_equal(b->type, SKV_DTYPE_BF16);
    assert_int_equal(b->ne[0], 2);
    assert_int_equal(b->ne[1], 2);
    /* data byte i = i: bf16 element 1 is the bytes {2, 3} = 0x0302 */
    uint16_t raw;
    memcpy(&raw, (const char *)b->data + 2, 2);
    assert_int_equal(raw, 0x0302);
    skv_safetensors_close(&st);
}

static void test_index_errors(void **state)
{
    const char *dir = *state;
    static const struct {
        const char *what;
        const char *weight_map;
        int expect;
        const char *msg_has;
    } cases[] = {
        {"dot-dot shard", "{\"a\":\"../s-1.safetensors\"}", SKV_E_FORMAT, "bad shard name"},
        {"dot-dot inside", "{\"a\":\"x..safetensors\"}", SKV_E_FORMAT, "bad shard name"},
        {"slash shard", "{\"a\":\"sub/s-1.safetensors\"}", SKV_E_FORMAT, "bad shard name"},
        {"absolute shard", "{\"a\":\"/etc/passwd\"}", SKV_E_FORMAT, "bad shard name"},
        {"empty shard", "{\"a\":\"\"}", SKV_E_FORMAT, "bad shard name"},
        {"shard not a string", "{\"a\":1}", SKV_E_FORMAT, "weight_map[a]"},
        {"missing shard", "{\"a\":\"s-1.safetensors\",\"c\":\"s-3.safetensors\"}",
         SKV_E_NOT_FOUND, "s-3.safetensors"},
        {"tensor not in shard", "{\"a\":\"s-1.safetensors\",\"zz\":\"s-2.safetensors\"}",
         SKV_E_FORMAT, "zz"},
        {"swapped shards", "{\"a\":\"s-2.safetensors\",\"b\":\"s-1.safetensors\"}",
         SKV_E_FORMAT, "found in"},
        {"empty weight_map", "{}", SKV_E_FORMAT, "empty weight_map"},
        {"weight_map not object", "[]", SKV_E_FORMAT, "weight_map"},
    };
    write_two_shards(dir);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_index(dir, cases[i].weight_map);
        int rc = open_tmp(dir);
        if (rc != cases[i].expect || !strstr(skv_error_msg(), cases[i].msg_has))
            fail_msg("%s: got %s \"%s\", expected %s containing \"%s\"", cases[i].what,
                     skv_status_name(rc), skv_error_msg(), skv_status_name(cases[i].expect),
                     cases[i].msg_has);
    }

    /* the index's JSON itself is broken */
    write_file(dir, "model.safetensors.index.json", "{\"weight_map\": {", 16);
    assert_int_equal(open_tmp(dir), SKV_E_FORMAT);
    assert_non_null(strstr(skv_error_msg(), "model.safetensors.index.json"));

    /* the same tensor name in two shards */
    char hdr[256];
    padded(hdr, sizeof hdr, SHARD_A);
    write_st(dir, "s-2.safetensors", hdr, -1, 8);
    write_index(dir, "{\"a\":\"s-1.safetensors\",\"b\":\"s-2.safetensors\"}");
    assert_int_equal(open_tmp(dir), SKV_E_FORMAT);
    assert_non_null(strstr(skv_error_msg(), "in both"));

    /* a corrupt shard is reported with its file name */
    write_st(dir, "s-2.safetensors", "{\"b\": ", -1, 0);
    assert_int_equal(open_tmp(dir), SKV_E_FORMAT);
    assert_non_null(strstr(skv_error_msg(), "s-2.safetensors"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_single_f32),
        cmocka_unit_test(test_sharded_matches_single),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_qwen2),
        cmocka_unit_test_setup_teardown(test_not_found, tmp_setup, tmp_teardown),
        cmocka_unit_test_setup_teardown(test_valid_handmade, tmp_setup, tmp_teardown),
        cmocka_unit_test_setup_teardown(test_corrupt_headers, tmp_setup, tmp_teardown),
        cmocka_unit_test_setup_teardown(test_misaligned, tmp_setup, tmp_teardown),
        cmocka_unit_test_setup_teardown(test_header_length, tmp_setup, tmp_teardown),
        cmocka_unit_test_setup_teardown(test_truncated_fixture, tmp_setup, tmp_teardown),
        cmocka_unit_test_setup_teardown(test_mutated_fixture, tmp_setup, tmp_teardown),
        cmocka_unit_test_setup_teardown(test_index_valid, tmp_setup, tmp_teardown),
        cmocka_unit_test_setup_teardown(test_index_errors, tmp_setup, tmp_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
