/* GGUF v2/v3 reader: maps the file (or takes a caller's buffer), validates every byte of the
 * header, metadata and tensor table against the file size before anything is exposed, and
 * indexes keys and tensors by name. Errors name the key or tensor and the file offset. */
#include "daemon/engine/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/status.h"

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_ENTRIES (1u << 20)       /* keys and tensors, each */
#define GGUF_MAX_DIMS 4
#define GGUF_MAX_ELEMS ((uint64_t)1 << 40) /* elements in one tensor */
#define GGUF_MAX_ARRAY_DEPTH 8            /* arrays of arrays of ... */
#define GGUF_NAME_SHOWN 80                /* characters of a name quoted in a message */

/* One metadata entry; every pointer points into the validated file. */
struct gguf_kv {
    struct skv_gguf_str key;
    int type;                 /* enum skv_gguf_type */
    uint64_t offset;          /* where the entry starts, for messages */
    const uint8_t *val;       /* scalar value; STRING: its u64 length; ARRAY: first element */
    int arr_type;             /* ARRAY only: element type */
    uint64_t arr_count;       /* ARRAY only */
    const uint8_t **arr_str;  /* ARRAY of STRING: each element's u64 length field */
};

/* Open-addressing hash index over names: slot holds entry index + 1, 0 is empty. */
struct name_index {
    uint32_t *slots;
    size_t mask;
};

struct skv_gguf {
    const uint8_t *base;
    size_t size;
    void *map;                /* non-NULL when we mmapped the file */
    uint32_t version;
    size_t alignment;
    size_t data_start;        /* file offset of the tensor data section */

    int64_t n_kv;
    struct gguf_kv *kv;       /* [n_kv] */
    const uint8_t **str_elems; /* backing store of every string array's arr_str */
    struct name_index kv_index;

    int64_t n_tensors;
    struct skv_tensor *tensors; /* [n_tensors], names point into `names` */
    char *names;
    struct name_index tensor_index;
};

/* A bounds-checked cursor over the file. */
struct reader {
    const uint8_t *p;
    size_t size;
    size_t pos;
};

static bool rd_has(const struct reader *r, uint64_t n)
{
    return n <= (uint64_t)(r->size - r->pos);
}

static uint64_t rd_left(const struct reader *r)
{
    return r->size - r->pos;
}

static uint32_t load_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t load_u64(const uint8_t *p)
{
    return (uint64_t)load_u32(p) | (uint64_t)load_u32(p + 4) << 32;
}

static bool rd_u32(struct reader *r, uint32_t *v)
{
    if (!rd_has(r, 4))
        return false;
    *v = load_u32(r->p + r->pos);
    r->pos += 4;
    return true;
}

static bool rd_u64(struct reader *r, uint64_t *v)
{
    if (!rd_has(r, 8))
        return false;
    *v = load_u64(r->p + r->pos);
    r->pos += 8;
    return true;
}

/* Bytes of one value of a fixed-size type; 0 for STRING, ARRAY and unknown types. */
static size_t scalar_size(int type)
{
    switch (type) {
    case SKV_GGUF_UINT8:
    case SKV_GGUF_INT8:
    case SKV_GGUF_BOOL:
        return 1;
    case SKV_GGUF_UINT16:
    case SKV_GGUF_INT16:
        return 2;
    case SKV_GGUF_UINT32:
    case SKV_GGUF_INT32:
    case SKV_GGUF_FLOAT32:
        return 4;
    case SKV_GGUF_UINT64:
    case SKV_GGUF_INT64:
    case SKV_GGUF_FLOAT64:
        return 8;
    default:
        return 0;
    }
}

static int shown_len(uint64_t len)
{
    return len > GGUF_NAME_SHOWN ? GGUF_NAME_SHOWN : (int)len;
}

/* Reads a u64 length and checks that many bytes follow; leaves the cursor after them. */
static int read_str(struct reader *r, struct skv_gguf_str *s, const char *what,
                    struct skv_gguf_str owner)
{
    size_t at = r->pos;
    uint64_t len;
    if (!rd_u64(r, &len))
        return skv_errorf(SKV_E_FORMAT, "gguf: %s%s%.*s%s: truncated at offset %zu reading a string length",
                          what, owner.ptr ? " '" : "", shown_len(owner.len),
                          owner.ptr ? owner.ptr : "", owner.ptr ? "'" : "", at);
    if (!rd_has(r, len))
        return skv_errorf(SKV_E_FORMAT,
                          "gguf: %s%s%.*s%s: string length %llu at offset %zu exceeds the %llu bytes left",
                          what, owner.ptr ? " '" : "", shown_len(owner.len),
                          owner.ptr ? owner.ptr : "", owner.ptr ? "'" : "",
                          (unsigned long long)len, at, (unsigned long long)rd_left(r));
    s->ptr = (const char *)r->p + r->pos;
    s->len = len;
    r->pos += len;
    return SKV_OK;
}

/* Validates and skips one value of `type` (arrays recursively, up to a depth). */
static int skip_value(struct reader *r, int type, int depth, struct skv_gguf_str key)
{
    size_t at = r->pos;
    size_t sz = scalar_size(type);
    if (sz != 0) {
        if (!rd_has(r, sz))
            return skv_errorf(SKV_E_FORMAT, "gguf: key '%.*s': truncated at offset %zu reading a value",
                              shown_len(key.len), key.ptr, at);
        r->pos += sz;
        return SKV_OK;
    }
    if (type == SKV_GGUF_STRING) {
        struct skv_gguf_str s;
        return read_str(r, &s, "value of key", key);
    }
    if (type != SKV_GGUF_ARRAY)
        return skv_errorf(SKV_E_FORMAT, "gguf: key '%.*s': unknown value type %d at offset %zu",
                          shown_len(key.len), key.ptr, type, at);
    if (depth >= GGUF_MAX_ARRAY_DEPTH)
        return skv_errorf(SKV_E_FORMAT, "gguf: key '%.*s': arrays nested deeper than %d at offset %zu",
                          shown_len(key.len), key.ptr, GGUF_MAX_ARRAY_DEPTH, at);

    uint32_t elem_type;
    uint64_t count;
    if (!rd_u32(r, &elem_type) || !rd_u64(r, &count))
        return skv_errorf(SKV_E_FORMAT, "gguf: key '%.*s': truncated at offset %zu reading an array header",
                          shown_len(key.len), key.ptr, at);
    /* smallest encoding of one element, so absurd counts fail before any loop */
    size_t esz = scalar_size((int)elem_type);
    uint64_t min_elem = esz ? esz : elem_type == SKV_GGUF_STRING ? 8 : elem_type == SKV_GGUF_ARRAY ? 12 : 0;
    if (min_elem == 0)
        return skv_errorf(SKV_E_FORMAT, "gguf: key '%.*s': unknown array element type %u at offset %zu",
                          shown_len(key.len), key.ptr, elem_type, at);
    if (count > rd_left(r) / min_elem)
        return skv_errorf(SKV_E_FORMAT,
                          "gguf: key '%.*s': array of %llu elements at offset %zu does not fit in the %llu bytes left",
                          shown_len(key.len), key.ptr, (unsigned long long)count, at,
                          (unsigned long long)rd_left(r));
    if (esz != 0) {
        r->pos += count * esz;
        return SKV_OK;
    }
    for (uint64_t i = 0; i < count; i++) {
        int rc = skip_value(r, (int)elem_type, depth + 1, key);
        if (rc != SKV_OK)
            return rc;
    }
    return SKV_OK;
}

/* Re-raises the current error with text around it (the message buffer is reused, so the
 * old text is copied first). */
static int error_wrap(int rc, const char *before, const char *after)
{
    char msg[512];
    snprintf(msg, sizeof msg, "%s", skv_error_msg());
    return skv_errorf(rc, "%s%s%s", before, msg, after);
}

/* FNV-1a over the name bytes. */
static uint64_t name_hash(const char *s, uint64_t len)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint64_t i = 0; i < len; i++) {
        h ^= (uint8_t)s[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static int index_init(struct name_index *ix, int64_t n)
{
    size_t cap = 16;
    while (cap < (size_t)n * 2)
        cap *= 2;
    ix->slots = calloc(cap, sizeof *ix->slots);
    if (ix->slots == NULL)
        return skv_errorf(SKV_E_NOMEM, "gguf: no memory for a %zu-slot name index", cap);
    ix->mask = cap - 1;
    return SKV_OK;
}

/* Name of entry `idx` for the index (keys or tensors). */
typedef struct skv_gguf_str (*name_of_fn)(const struct skv_gguf *g, uint32_t idx);

static struct skv_gguf_str kv_name_of(const struct skv_gguf *g, uint32_t idx)
{
    return g->kv[idx].key;
}

static struct skv_gguf_str tensor_name_of(const struct skv_gguf *g, uint32_t idx)
{
    struct skv_gguf_str s = {g->tensors[idx].name, strlen(g->tensors[idx].name)};
    return s;
}

/* Index of the entry called (name, len), or -1. */
static int64_t index_find(const struct skv_gguf *g, const struct name_index *ix, name_of_fn name_of,
                          const char *name, uint64_t len)
{
    if (ix->slots == NULL)
        return -1;
    for (size_t i = name_hash(name, len) & ix->mask;; i = (i + 1) & ix->mask) {
        uint32_t slot = ix->slots[i];
        if (slot == 0)
            return -1;
        struct skv_gguf_str s = name_of(g, slot - 1);
        if (s.len == len && memcmp(s.ptr, name, len) == 0)
            return slot - 1;
    }
}

/* Adds entry idx; returns the index of an earlier entry of the same name, or -1. */
static int64_t index_add(const struct skv_gguf *g, struct name_index *ix, name_of_fn name_of,
                         uint32_t idx)
{
    struct skv_gguf_str name = name_of(g, idx);
    size_t i = name_hash(name.ptr, name.len) & ix->mask;
    for (; ix->slots[i] != 0; i = (i + 1) & ix->mask) {
        struct skv_gguf_str s = name_of(g, ix->slots[i] - 1);
        if (s.len == name.len && memcmp(s.ptr, name.ptr, name.len) == 0)
            return ix->slots[i] - 1;
    }
    ix->slots[i] = idx + 1;
    return -1;
}

static int parse_kv(struct skv_gguf *g, struct reader *r)
{
    uint64_t n_str_elems = 0;
    int rc = index_init(&g->kv_index, g->n_kv);
    if (rc != SKV_OK)
        return rc;

    for (int64_t i = 0; i < g->n_kv; i++) {
        struct gguf_kv *kv = &g->kv[i];
        struct skv_gguf_str none = {NULL, 0};
        uint32_t type;

        kv->offset = r->pos;
        rc = read_str(r, &kv->key, "metadata key name", none);
        if (rc != SKV_OK) {
            char where[64];
            snprintf(where, sizeof where, " (key %lld of %lld)", (long long)i, (long long)g->n_kv);
            return error_wrap(rc, "", where);
        }
        if (!rd_u32(r, &type))
            return skv_errorf(SKV_E_FORMAT, "gguf: key '%.*s': truncated at offset %zu reading its type",
                              shown_len(kv->key.len), kv->key.ptr, r->pos);
        kv->type = (int)type;
        kv->val = r->p + r->pos;
        if (type == SKV_GGUF_ARRAY && rd_has(r, 12)) {
            kv->arr_type = (int)load_u32(kv->val);
            kv->arr_count = load_u64(kv->val + 4);
        }
        rc = skip_value(r, (int)type, 0, kv->key);
        if (rc != SKV_OK)
            return rc;
        if (type == SKV_GGUF_ARRAY) {
            kv->val += 12;
            if (kv->arr_type == SKV_GGUF_STRING)
                n_str_elems += kv->arr_count;
        }
        int64_t dup = index_add(g, &g->kv_index, kv_name_of, (uint32_t)i);
        if (dup >= 0)
            return skv_errorf(SKV_E_FORMAT, "gguf: key '%.*s' at offset %llu duplicates key %lld at offset %llu",
                              shown_len(kv->key.len), kv->key.ptr, (unsigned long long)kv->offset,
                              (long long)dup, (unsigned long long)g->kv[dup].offset);
    }

    /* Random access into string arrays (the tokenizer reads every token by index): one
     * pointer per element; each element took >= 8 validated bytes, so this is bounded. */
    if (n_str_elems == 0)
        return SKV_OK;
    g->str_elems = malloc(n_str_elems * sizeof *g->str_elems);
    if (g->str_elems == NULL)
        return skv_errorf(SKV_E_NOMEM, "gguf: no memory to index %llu array strings",
                          (unsigned long long)n_str_elems);
    const uint8_t **next = g->str_elems;
    for (int64_t i = 0; i < g->n_kv; i++) {
        struct gguf_kv *kv = &g->kv[i];
        if (kv->type != SKV_GGUF_ARRAY || kv->arr_type != SKV_GGUF_STRING)
            continue;
        kv->arr_str = next;
        const uint8_t *p = kv->val;
        for (uint64_t j = 0; j < kv->arr_count; j++) {
            *next++ = p;
            p += 8 + load_u64(p);
        }
    }
    return SKV_OK;
}

/* general.alignment when present: an integer, a power of two. */
static int parse_alignment(struct skv_gguf *g)
{
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    int idx = skv_gguf_find_key(g, "general.alignment");
    if (idx < 0)
        return SKV_OK;
    int64_t v;
    if (!skv_gguf_get_i64(g, "general.alignment", &v))
        return skv_errorf(SKV_E_FORMAT, "gguf: key 'general.alignment' at offset %llu: type %d is not an integer",
                          (unsigned long long)g->kv[idx].offset, g->kv[idx].type);
    if (v <= 0 || v > (1 << 30) || (v & (v - 1)) != 0)
        return skv_errorf(SKV_E_FORMAT,
                          "gguf: key 'general.alignment' at offset %llu: %lld is not a power of two up to 2^30",
                          (unsigned long long)g->kv[idx].offset, (long long)v);
    g->alignment = (size_t)v;
    return SKV_OK;
}

static bool mul_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    if (a != 0 && b > UINT64_MAX / a)
        return false;
    *out = a * b;
    return true;
}

/* Reads the tensor table; data offsets are checked once the data section is known. */
static int parse_tensor_infos(struct skv_gguf *g, struct reader *r, uint64_t *info_offsets,
                              uint64_t *data_offsets, struct skv_gguf_str *names)
{
    for (int64_t i = 0; i < g->n_tensors; i++) {
        struct skv_tensor *t = &g->tensors[i];
        struct skv_gguf_str none = {NULL, 0};
        struct skv_gguf_str name;
        uint32_t n_dims, type;
        size_t at = r->pos;

        info_offsets[i] = at;
        int rc = read_str(r, &name, "tensor name", none);
        if (rc != SKV_OK) {
            char where[64];
            snprintf(where, sizeof where, " (tensor %lld of %lld)", (long long)i,
                     (long long)g->n_tensors);
            return error_wrap(rc, "", where);
        }
        names[i] = name;
        if (memchr(name.ptr, '\0', name.len) != NULL)
            return skv_errorf(SKV_E_FORMAT, "gguf: tensor %lld at offset %zu: name contains a NUL byte",
                              (long long)i, at);
#define TNAME shown_len(name.len), name.ptr
        if (!rd_u32(r, &n_dims))
            return skv_errorf(SKV_E_FORMAT, "gguf: tensor '%.*s' at offset %zu: truncated reading n_dims",
                              TNAME, at);
        if (n_dims == 0 || n_dims > GGUF_MAX_DIMS)
            return skv_errorf(SKV_E_FORMAT, "gguf: tensor '%.*s' at offset %zu: %u dims (1 to %d allowed)",
                              TNAME, at, n_dims, GGUF_MAX_DIMS);
        t->ndim = (int)n_dims;
        uint64_t n_elems = 1;
        for (int d = 0; d < GGUF_MAX_DIMS; d++) {
            uint64_t ne = 1;
            if (d < (int)n_dims && !rd_u64(r, &ne))
                return skv_errorf(SKV_E_FORMAT, "gguf: tensor '%.*s' at offset %zu: truncated reading dim %d",
                                  TNAME, at, d);
            if (ne == 0 || ne > GGUF_MAX_ELEMS)
                return skv_errorf(SKV_E_FORMAT,
                                  "gguf: tensor '%.*s' at offset %zu: dim %d is %lld (1 to 2^40 allowed)",
                                  TNAME, at, d, (long long)ne);
            if (!mul_u64(n_elems, ne, &n_elems) || n_elems > GGUF_MAX_ELEMS)
                return skv_errorf(SKV_E_FORMAT,
                                  "gguf: tensor '%.*s' at offset %zu: more than 2^40 elements", TNAME, at);
            t->ne[d] = (int64_t)ne;
        }
        if (!rd_u32(r, &type))
            return skv_errorf(SKV_E_FORMAT, "gguf: tensor '%.*s' at offset %zu: truncated reading its type",
                              TNAME, at);
        if (skv_dtype_name((int)type) == NULL)
            return skv_errorf(SKV_E_UNSUPPORTED, "gguf: tensor '%.*s' at offset %zu: unknown type id %u",
                              TNAME, at, type);
        t->type = (int)type;
        int64_t blk = skv_dtype_block_elems(t->type);
        if (t->ne[0] % blk != 0)
            return skv_errorf(SKV_E_FORMAT,
                              "gguf: tensor '%.*s' at offset %zu: row of %lld is not a multiple of the %s block (%lld)",
                              TNAME, at, (long long)t->ne[0], skv_dtype_name(t->type), (long long)blk);
        uint64_t nbytes;
        if (!mul_u64(skv_dtype_row_bytes(t->type, t->ne[0]),
                     (uint64_t)(t->ne[1] * t->ne[2] * t->ne[3]), &nbytes) || nbytes > SIZE_MAX)
            return skv_errorf(SKV_E_FORMAT, "gguf: tensor '%.*s' at offset %zu: size overflows",
                              TNAME, at);
        t->nbytes = (size_t)nbytes;
        if (!rd_u64(r, &data_offsets[i]))
            return skv_errorf(SKV_E_FORMAT, "gguf: tensor '%.*s' at offset %zu: truncated reading its data offset",
                              TNAME, at);
        if (data_offsets[i] % g->alignment != 0)
            return skv_errorf(SKV_E_FORMAT,
                              "gguf: tensor '%.*s' at offset %zu: data offset %llu is not a multiple of the alignment %zu",
                              TNAME, at, (unsigned long long)data_offsets[i], g->alignment);
#undef TNAME
    }
    return SKV_OK;
}

struct placed {
    uint64_t at;  /* data offset */
    int64_t i;    /* tensor index */
};

static int by_data_offset(const void *a, const void *b)
{
    uint64_t x = ((const struct placed *)a)->at, y = ((const struct placed *)b)->at;
    return x < y ? -1 : x > y;
}

/* Refuses tensors whose data overlap (one tensor's bytes read as another's weights: ggml
 * places each after the last). */
static int no_overlap(const struct skv_gguf *g, const uint64_t *info_offsets, const uint64_t *data_offsets)
{
    if (g->n_tensors < 2)
        return SKV_OK;
    struct placed *order = malloc((size_t)g->n_tensors * sizeof *order);
    if (!order)
        return skv_errorf(SKV_E_NOMEM, "gguf: no memory to order %lld tensors", (long long)g->n_tensors);
    for (int64_t i = 0; i < g->n_tensors; i++)
        order[i] = (struct placed){data_offsets[i], i};
    qsort(order, (size_t)g->n_tensors, sizeof *order, by_data_offset);
    int rc = SKV_OK;
    for (int64_t k = 1; k < g->n_tensors && !rc; k++) {
        const struct skv_tensor *a = &g->tensors[order[k - 1].i], *b = &g->tensors[order[k].i];
        if (order[k - 1].at + a->nbytes > order[k].at)
            rc = skv_errorf(SKV_E_FORMAT,
                            "gguf: tensor '%s' at offset %llu: its data [%llu, +%zu) overlap tensor '%s''s [%llu, +%zu)",
                            b->name, (unsigned long long)info_offsets[order[k].i], (unsigned long long)order[k].at,
                            b->nbytes, a->name, (unsigned long long)order[k - 1].at, a->nbytes);
    }
    free(order);
    return rc;
}

/* Copies the names (NUL-terminated), checks duplicates and places each tensor's data. */
static int place_tensors(struct skv_gguf *g, const uint64_t *info_offsets,
                         const uint64_t *data_offsets, const struct skv_gguf_str *names)
{
    size_t total = 0;
    for (int64_t i = 0; i < g->n_tensors; i++)
        total += names[i].len + 1; /* names lie inside the file: no overflow */
    g->names = malloc(total ? total : 1);
    if (g->names == NULL)
        return skv_errorf(SKV_E_NOMEM, "gguf: no memory for %zu bytes of tensor names", total);
    int rc = index_init(&g->tensor_index, g->n_tensors);
    if (rc != SKV_OK)
        return rc;

    char *next = g->names;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        struct skv_tensor *t = &g->tensors[i];
        memcpy(next, names[i].ptr, names[i].len);
        next[names[i].len] = '\0';
        t->name = next;
        next += names[i].len + 1;

        int64_t dup = index_add(g, &g->tensor_index, tensor_name_of, (uint32_t)i);
        if (dup >= 0)
            return skv_errorf(SKV_E_FORMAT,
                              "gguf: tensor '%.*s' at offset %llu duplicates tensor %lld at offset %llu",
                              shown_len(names[i].len), t->name, (unsigned long long)info_offsets[i],
                              (long long)dup, (unsigned long long)info_offsets[dup]);
        uint64_t avail = g->size - g->data_start;
        if (data_offsets[i] > avail || t->nbytes > avail - data_offsets[i])
            return skv_errorf(SKV_E_FORMAT,
                              "gguf: tensor '%.*s' at offset %llu: data [%llu, +%zu) past the end of the file (%zu bytes, data at %zu)",
                              shown_len(names[i].len), t->name, (unsigned long long)info_offsets[i],
                              (unsigned long long)data_offsets[i], t->nbytes, g->size, g->data_start);
        /* weights are read through float and block pointers: at least 4-byte aligned (an
         * alignment of 1 or 2 could put them anywhere) */
        if ((g->data_start + data_offsets[i]) % 4 != 0)
            return skv_errorf(SKV_E_FORMAT,
                              "gguf: tensor '%.*s' at offset %llu: data at byte %llu of the file is not 4-byte aligned",
                              shown_len(names[i].len), t->name, (unsigned long long)info_offsets[i],
                              (unsigned long long)(g->data_start + data_offsets[i]));
        /* the map is read-only; skv_tensor.data is not const only for device buffers */
        t->data = (void *)(g->base + g->data_start + data_offsets[i]);
    }
    return no_overlap(g, info_offsets, data_offsets);
}

static int parse(struct skv_gguf *g)
{
    struct reader r = {g->base, g->size, 0};
    uint64_t n_tensors, n_kv;
    int rc;

    if (g->size < 4 || memcmp(g->base, GGUF_MAGIC, 4) != 0) {
        /* a .safetensors file starts with its header's length, then '{' */
        if (g->size > 9 && ((const char *)g->base)[8] == '{')
            return skv_errorf(SKV_E_FORMAT, "gguf: not a GGUF file but a safetensors one: give the folder that holds "
                              "it and its config.json");
        return skv_errorf(SKV_E_FORMAT, "gguf: bad magic at offset 0 (not a GGUF file, %zu bytes)",
                          g->size);
    }
    r.pos = 4;
    if (!rd_u32(&r, &g->version))
        return skv_errorf(SKV_E_FORMAT, "gguf: truncated at offset 4 reading the version");
    if (g->version == 1)
        return skv_errorf(SKV_E_VERSION, "gguf: version 1 at offset 4 (32-bit counts) is not supported; convert the file to v3");
    if (g->version != 2 && g->version != 3)
        return skv_errorf(SKV_E_VERSION, "gguf: version %u at offset 4 is not 2 or 3%s", g->version,
                          (g->version & 0xffff) == 0 ? " (big-endian file?)" : "");
    if (!rd_u64(&r, &n_tensors) || !rd_u64(&r, &n_kv))
        return skv_errorf(SKV_E_FORMAT, "gguf: truncated at offset %zu reading the header counts", r.pos);
    /* a key takes >= 13 bytes and a tensor info >= 32: reject counts the file cannot hold */
    if (n_kv > GGUF_MAX_ENTRIES || n_kv > rd_left(&r) / 13)
        return skv_errorf(SKV_E_FORMAT, "gguf: %llu metadata keys (count at offset 16) cannot fit in a %zu-byte file (truncated or corrupt; limit %u)",
                          (unsigned long long)n_kv, g->size, GGUF_MAX_ENTRIES);
    if (n_tensors > GGUF_MAX_ENTRIES || n_tensors > rd_left(&r) / 32)
        return skv_errorf(SKV_E_FORMAT, "gguf: %llu tensors (count at offset 8) cannot fit in a %zu-byte file (truncated or corrupt; limit %u)",
                          (unsigned long long)n_tensors, g->size, GGUF_MAX_ENTRIES);
    g->n_kv = (int64_t)n_kv;
    g->n_tensors = (int64_t)n_tensors;

    g->kv = calloc(n_kv ? n_kv : 1, sizeof *g->kv);
    g->tensors = calloc(n_tensors ? n_tensors : 1, sizeof *g->tensors);
    if (g->kv == NULL || g->tensors == NULL)
        return skv_errorf(SKV_E_NOMEM, "gguf: no memory for %llu keys and %llu tensors",
                          (unsigned long long)n_kv, (unsigned long long)n_tensors);
    rc = parse_kv(g, &r);
    if (rc != SKV_OK)
        return rc;
    rc = parse_alignment(g);
    if (rc != SKV_OK)
        return rc;

    uint64_t *info_offsets = malloc((n_tensors ? n_tensors : 1) * sizeof *info_offsets);
    uint64_t *data_offsets = malloc((n_tensors ? n_tensors : 1) * sizeof *data_offsets);
    struct skv_gguf_str *names = malloc((n_tensors ? n_tensors : 1) * sizeof *names);
    if (info_offsets == NULL || data_offsets == NULL || names == NULL) {
        rc = skv_errorf(SKV_E_NOMEM, "gguf: no memory for %llu tensor infos",
                        (unsigned long long)n_tensors);
        goto out_free_infos;
    }
    rc = parse_tensor_infos(g, &r, info_offsets, data_offsets, names);
    if (rc != SKV_OK)
        goto out_free_infos;
    /* the data section starts at the next multiple of the alignment */
    uint64_t pad = (g->alignment - r.pos % g->alignment) % g->alignment;
    if (n_tensors > 0 && pad > rd_left(&r)) {
        rc = skv_errorf(SKV_E_FORMAT, "gguf: data section at offset %llu is past the end of the file (%zu bytes)",
                        (unsigned long long)(r.pos + pad), g->size);
        goto out_free_infos;
    }
    g->data_start = r.pos + (pad > rd_left(&r) ? rd_left(&r) : pad);
    rc = place_tensors(g, info_offsets, data_offsets, names);

out_free_infos:
    free(names);
    free(data_offsets);
    free(info_offsets);
    return rc;
}

void skv_gguf_close(struct skv_gguf **g_p)
{
    if (g_p == NULL || *g_p == NULL)
        return;
    struct skv_gguf *g = *g_p;
    free(g->tensor_index.slots);
    free(g->names);
    free(g->tensors);
    free(g->kv_index.slots);
    free(g->str_elems);
    free(g->kv);
    if (g->map != NULL)
        munmap(g->map, g->size);
    free(g);
    *g_p = NULL;
}

int skv_gguf_open_buffer(const void *buf, size_t size, struct skv_gguf **out)
{
    if ((buf == NULL && size != 0) || out == NULL)
        return skv_errorf(SKV_E_INVAL, "gguf: NULL buffer or output");
    struct skv_gguf *g = calloc(1, sizeof *g);
    if (g == NULL)
        return skv_errorf(SKV_E_NOMEM, "gguf: no memory");
    g->base = buf;
    g->size = size;
    int rc = parse(g);
    if (rc != SKV_OK) {
        skv_gguf_close(&g);
        return rc;
    }
    *out = g;
    return SKV_OK;
}

int skv_gguf_open(const char *path, struct skv_gguf **out)
{
    if (path == NULL || out == NULL)
        return skv_errorf(SKV_E_INVAL, "gguf: NULL path or output");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int err = errno;
        return skv_errorf(err == ENOENT ? SKV_E_NOT_FOUND : err == EACCES ? SKV_E_PERM : SKV_E_IO,
                          "gguf: cannot open %s: %s", path, strerror(err));
    }
    struct stat st;
    int rc;
    if (fstat(fd, &st) != 0) {
        rc = skv_errorf(SKV_E_IO, "gguf: cannot stat %s: %s", path, strerror(errno));
        goto out_close_fd;
    }
    if (!S_ISREG(st.st_mode)) {
        rc = skv_errorf(SKV_E_IO, "gguf: %s is not a regular file", path);
        goto out_close_fd;
    }
    if (st.st_size < 24) {
        rc = skv_errorf(SKV_E_FORMAT, "gguf: %s: %lld bytes is too short for a GGUF header", path,
                        (long long)st.st_size);
        goto out_close_fd;
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        rc = skv_errorf(SKV_E_LIMIT, "gguf: %s is too large to map", path);
        goto out_close_fd;
    }
    size_t size = (size_t)st.st_size;
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
        rc = skv_errorf(errno == ENOMEM ? SKV_E_NOMEM : SKV_E_IO, "gguf: cannot map %s: %s", path,
                        strerror(errno));
        goto out_close_fd;
    }
    struct skv_gguf *g = calloc(1, sizeof *g);
    if (g == NULL) {
        munmap(map, size);
        rc = skv_errorf(SKV_E_NOMEM, "gguf: no memory");
        goto out_close_fd;
    }
    g->base = map;
    g->size = size;
    g->map = map;
    rc = parse(g);
    if (rc != SKV_OK) {
        /* keep the parser's detail, add the path */
        char where[256];
        snprintf(where, sizeof where, "%s: ", path);
        rc = error_wrap(rc, where, "");
        skv_gguf_close(&g);
        goto out_close_fd;
    }
    *out = g;

out_close_fd:
    close(fd);
    return rc;
}

uint32_t skv_gguf_version(const struct skv_gguf *g)
{
    return g->version;
}

size_t skv_gguf_alignment(const struct skv_gguf *g)
{
    return g->alignment;
}

int64_t skv_gguf_n_keys(const struct skv_gguf *g)
{
    return g->n_kv;
}

int skv_gguf_find_key(const struct skv_gguf *g, const char *key)
{
    if (key == NULL)
        return -1;
    return (int)index_find(g, &g->kv_index, kv_name_of, key, strlen(key));
}

struct skv_gguf_str skv_gguf_key_name(const struct skv_gguf *g, int idx)
{
    struct skv_gguf_str none = {NULL, 0};
    if (idx < 0 || idx >= g->n_kv)
        return none;
    return g->kv[idx].key;
}

int skv_gguf_key_type(const struct skv_gguf *g, int idx)
{
    if (idx < 0 || idx >= g->n_kv)
        return -1;
    return g->kv[idx].type;
}

static const struct gguf_kv *find_kv(const struct skv_gguf *g, const char *key)
{
    int idx = skv_gguf_find_key(g, key);
    return idx < 0 ? NULL : &g->kv[idx];
}

/* A value of an integer type: as int64 when signed, else as uint64 with *is_unsigned. */
static bool load_int(int type, const uint8_t *p, int64_t *s, uint64_t *u, bool *is_unsigned)
{
    *is_unsigned = false;
    switch (type) {
    case SKV_GGUF_UINT8:
        *u = p[0];
        *is_unsigned = true;
        return true;
    case SKV_GGUF_INT8:
        *s = (int8_t)p[0];
        return true;
    case SKV_GGUF_UINT16:
        *u = (uint16_t)(p[0] | p[1] << 8);
        *is_unsigned = true;
        return true;
    case SKV_GGUF_INT16:
        *s = (int16_t)(uint16_t)(p[0] | p[1] << 8);
        return true;
    case SKV_GGUF_UINT32:
        *u = load_u32(p);
        *is_unsigned = true;
        return true;
    case SKV_GGUF_INT32:
        *s = (int32_t)load_u32(p);
        return true;
    case SKV_GGUF_UINT64:
        *u = load_u64(p);
        *is_unsigned = true;
        return true;
    case SKV_GGUF_INT64:
        *s = (int64_t)load_u64(p);
        return true;
    default:
        return false;
    }
}

static bool value_i64(int type, const uint8_t *p, int64_t *out)
{
    int64_t s;
    uint64_t u;
    bool is_unsigned;
    if (!load_int(type, p, &s, &u, &is_unsigned))
        return false;
    if (is_unsigned) {
        if (u > INT64_MAX)
            return false;
        s = (int64_t)u;
    }
    *out = s;
    return true;
}

static bool value_f64(int type, const uint8_t *p, double *out)
{
    int64_t s;
    uint64_t u;
    bool is_unsigned;
    if (type == SKV_GGUF_FLOAT32) {
        uint32_t bits = load_u32(p);
        float f;
        memcpy(&f, &bits, sizeof f);
        *out = f;
        return true;
    }
    if (type == SKV_GGUF_FLOAT64) {
        uint64_t bits = load_u64(p);
        memcpy(out, &bits, sizeof *out);
        return true;
    }
    if (!load_int(type, p, &s, &u, &is_unsigned))
        return false;
    *out = is_unsigned ? (double)u : (double)s;
    return true;
}

bool skv_gguf_get_i64(const struct skv_gguf *g, const char *key, int64_t *out)
{
    const struct gguf_kv *kv = find_kv(g, key);
    return kv != NULL && value_i64(kv->type, kv->val, out);
}

bool skv_gguf_get_u32(const struct skv_gguf *g, const char *key, uint32_t *out)
{
    const struct gguf_kv *kv = find_kv(g, key);
    int64_t v;
    if (kv == NULL || !value_i64(kv->type, kv->val, &v) || v < 0 || v > UINT32_MAX)
        return false;
    *out = (uint32_t)v;
    return true;
}

bool skv_gguf_get_f32(const struct skv_gguf *g, const char *key, float *out)
{
    const struct gguf_kv *kv = find_kv(g, key);
    double v;
    if (kv == NULL || !value_f64(kv->type, kv->val, &v))
        return false;
    *out = (float)v;
    return true;
}

bool skv_gguf_get_bool(const struct skv_gguf *g, const char *key, bool *out)
{
    const struct gguf_kv *kv = find_kv(g, key);
    if (kv == NULL || kv->type != SKV_GGUF_BOOL)
        return false;
    *out = kv->val[0] != 0;
    return true;
}

static struct skv_gguf_str str_at(const uint8_t *p)
{
    struct skv_gguf_str s = {(const char *)p + 8, load_u64(p)};
    return s;
}

bool skv_gguf_get_str(const struct skv_gguf *g, const char *key, struct skv_gguf_str *out)
{
    const struct gguf_kv *kv = find_kv(g, key);
    if (kv == NULL || kv->type != SKV_GGUF_STRING)
        return false;
    *out = str_at(kv->val);
    return true;
}

bool skv_gguf_get_arr(const struct skv_gguf *g, const char *key, int *elem_type, uint64_t *count)
{
    const struct gguf_kv *kv = find_kv(g, key);
    if (kv == NULL || kv->type != SKV_GGUF_ARRAY)
        return false;
    if (elem_type != NULL)
        *elem_type = kv->arr_type;
    if (count != NULL)
        *count = kv->arr_count;
    return true;
}

bool skv_gguf_get_arr_str(const struct skv_gguf *g, const char *key, uint64_t i,
                          struct skv_gguf_str *out)
{
    const struct gguf_kv *kv = find_kv(g, key);
    if (kv == NULL || kv->type != SKV_GGUF_ARRAY || kv->arr_type != SKV_GGUF_STRING ||
        i >= kv->arr_count)
        return false;
    *out = str_at(kv->arr_str[i]);
    return true;
}

/* Element i of a numeric array, or NULL. */
static const uint8_t *arr_elem(const struct gguf_kv *kv, uint64_t i)
{
    size_t sz;
    if (kv == NULL || kv->type != SKV_GGUF_ARRAY || i >= kv->arr_count)
        return NULL;
    sz = scalar_size(kv->arr_type);
    if (sz == 0 || kv->arr_type == SKV_GGUF_BOOL)
        return NULL;
    return kv->val + i * sz;
}

bool skv_gguf_get_arr_i64(const struct skv_gguf *g, const char *key, uint64_t i, int64_t *out)
{
    const struct gguf_kv *kv = find_kv(g, key);
    const uint8_t *p = arr_elem(kv, i);
    return p != NULL && value_i64(kv->arr_type, p, out);
}

bool skv_gguf_get_arr_bool(const struct skv_gguf *g, const char *key, uint64_t i, bool *out)
{
    const struct gguf_kv *kv = find_kv(g, key);
    if (kv == NULL || kv->type != SKV_GGUF_ARRAY || kv->arr_type != SKV_GGUF_BOOL || i >= kv->arr_count)
        return false;
    *out = kv->val[i] != 0;
    return true;
}

bool skv_gguf_get_arr_f64(const struct skv_gguf *g, const char *key, uint64_t i, double *out)
{
    const struct gguf_kv *kv = find_kv(g, key);
    const uint8_t *p = arr_elem(kv, i);
    return p != NULL && value_f64(kv->arr_type, p, out);
}

int64_t skv_gguf_n_tensors(const struct skv_gguf *g)
{
    return g->n_tensors;
}

const struct skv_tensor *skv_gguf_tensor(const struct skv_gguf *g, int64_t i)
{
    if (i < 0 || i >= g->n_tensors)
        return NULL;
    return &g->tensors[i];
}

const struct skv_tensor *skv_gguf_find_tensor(const struct skv_gguf *g, const char *name)
{
    if (name == NULL)
        return NULL;
    int64_t i = index_find(g, &g->tensor_index, tensor_name_of, name, strlen(name));
    return i < 0 ? NULL : &g->tensors[i];
}
