/* Hugging Face safetensors reader: maps model.safetensors or the shards of an index, checks
 * every header entry against its file (dtype, shape, offsets, overlap, alignment) and keeps
 * the tensors as skv_tensor views with a by-name index. */
#include "daemon/engine/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/status.h"

#define SINGLE_FILE "model.safetensors"
#define INDEX_FILE "model.safetensors.index.json"

struct st_file {
    char *path;           /* dir/name */
    const char *name;     /* the file name inside path */
    const uint8_t *map;   /* whole file, PROT_READ */
    size_t size;
};

struct st_name_ref {
    const char *name;
    int64_t idx;
};

struct skv_safetensors {
    struct st_file *files;
    int n_files;
    struct skv_tensor *tensors;      /* [n_tensors] */
    char **names;                    /* [n_tensors]: tensors[i].name == names[i], owned */
    int *file_of;                    /* [n_tensors]: index into files */
    int64_t n_tensors;
    int64_t cap;
    struct st_name_ref *by_name;     /* [n_tensors] sorted by name */
};

/* One header entry while its file is parsed. */
struct st_entry {
    const char *key;   /* owned by the JSON object */
    int type;
    int ndim;
    int64_t ne[4];
    uint64_t begin, end;
};

static const struct {
    const char *name;
    int type;      /* enum skv_dtype, or -1 for a known safetensors dtype we do not serve */
    size_t size;
} dtypes[] = {
    {"F32", SKV_DTYPE_F32, 4}, {"F16", SKV_DTYPE_F16, 2}, {"BF16", SKV_DTYPE_BF16, 2},
    {"F64", -1, 8}, {"I64", -1, 8}, {"U64", -1, 8}, {"I32", -1, 4}, {"U32", -1, 4},
    {"I16", -1, 2}, {"U16", -1, 2}, {"I8", -1, 1}, {"U8", -1, 1}, {"BOOL", -1, 1},
    {"F8_E4M3", -1, 1}, {"F8_E5M2", -1, 1}, {"F8_E8M0", -1, 1}, {"F6_E2M3", -1, 1},
    {"F6_E3M2", -1, 1}, {"F4", -1, 1}, {"C64", -1, 8},
};

static char *path_join(const char *dir, const char *name)
{
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p)
        return NULL;
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

static uint64_t read_le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static int map_file(const char *path, struct st_file *f)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT)
            return skv_errorf(SKV_E_NOT_FOUND, "%s: no such file", path);
        return skv_errorf(SKV_E_IO, "%s: %s", path, strerror(errno));
    }
    struct stat sb;
    int rc = SKV_OK;
    if (fstat(fd, &sb) != 0) {
        rc = skv_errorf(SKV_E_IO, "%s: %s", path, strerror(errno));
        goto out_close;
    }
    if (!S_ISREG(sb.st_mode)) {
        rc = skv_errorf(SKV_E_IO, "%s: not a regular file", path);
        goto out_close;
    }
    if (sb.st_size < 8) {
        rc = skv_errorf(SKV_E_FORMAT, "%s: truncated: %lld bytes, no header length", path,
                        (long long)sb.st_size);
        goto out_close;
    }
    void *map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
        rc = skv_errorf(SKV_E_IO, "%s: mmap: %s", path, strerror(errno));
        goto out_close;
    }
    f->map = map;
    f->size = (size_t)sb.st_size;
out_close:
    close(fd);
    return rc;
}

static int grow_tensors(struct skv_safetensors *st, int64_t extra)
{
    if (st->n_tensors + extra <= st->cap)
        return SKV_OK;
    int64_t cap = st->cap ? st->cap : 64;
    while (cap < st->n_tensors + extra)
        cap *= 2;
    struct skv_tensor *t = realloc(st->tensors, (size_t)cap * sizeof *t);
    if (!t)
        return skv_errorf(SKV_E_NOMEM, "safetensors: out of memory for %lld tensors",
                          (long long)cap);
    st->tensors = t;
    char **n = realloc(st->names, (size_t)cap * sizeof *n);
    if (!n)
        return skv_errorf(SKV_E_NOMEM, "safetensors: out of memory for %lld tensors",
                          (long long)cap);
    st->names = n;
    int *fo = realloc(st->file_of, (size_t)cap * sizeof *fo);
    if (!fo)
        return skv_errorf(SKV_E_NOMEM, "safetensors: out of memory for %lld tensors",
                          (long long)cap);
    st->file_of = fo;
    st->cap = cap;
    return SKV_OK;
}

/* Validates one header entry against the data area [0, data_size) starting at file offset
 * data_start. */
static int parse_entry(const char *path, const char *key, json_t *val, uint64_t data_start,
                       uint64_t data_size, struct st_entry *e)
{
    if (!json_is_object(val))
        return skv_errorf(SKV_E_FORMAT, "%s: tensor %s: entry is not an object", path, key);

    json_t *jd = json_object_get(val, "dtype");
    if (!json_is_string(jd))
        return skv_errorf(SKV_E_FORMAT, "%s: tensor %s: missing dtype", path, key);
    const char *dname = json_string_value(jd);
    size_t esize = 0;
    e->type = -2;
    for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++) {
        if (strcmp(dname, dtypes[i].name) == 0) {
            e->type = dtypes[i].type;
            esize = dtypes[i].size;
            break;
        }
    }
    if (e->type == -2)
        return skv_errorf(SKV_E_FORMAT, "%s: tensor %s: unknown dtype \"%.32s\"", path, key,
                          dname);
    if (e->type < 0)
        return skv_errorf(SKV_E_UNSUPPORTED,
                          "%s: tensor %s: dtype %s not supported (F32, F16, BF16 only)", path,
                          key, dname);

    json_t *js = json_object_get(val, "shape");
    if (!json_is_array(js))
        return skv_errorf(SKV_E_FORMAT, "%s: tensor %s: missing shape", path, key);
    size_t nd = json_array_size(js);
    if (nd > 4)
        return skv_errorf(SKV_E_UNSUPPORTED, "%s: tensor %s: %zu dims (at most 4)", path, key,
                          nd);
    uint64_t nelem = 1;
    e->ndim = nd ? (int)nd : 1;
    for (int i = 0; i < 4; i++)
        e->ne[i] = 1;
    for (size_t i = 0; i < nd; i++) {
        json_t *jv = json_array_get(js, i);
        if (!json_is_integer(jv) || json_integer_value(jv) < 0)
            return skv_errorf(SKV_E_FORMAT, "%s: tensor %s: shape[%zu] is not a size", path,
                              key, i);
        uint64_t d = (uint64_t)json_integer_value(jv);
        if (d != 0 && nelem > UINT64_MAX / d)
            return skv_errorf(SKV_E_FORMAT, "%s: tensor %s: shape overflows", path, key);
        nelem *= d;
        e->ne[nd - 1 - i] = (int64_t)d;   /* innermost first */
    }
    if (nelem > UINT64_MAX / esize)
        return skv_errorf(SKV_E_FORMAT, "%s: tensor %s: shape overflows", path, key);
    uint64_t nbytes = nelem * esize;

    json_t *jo = json_object_get(val, "data_offsets");
    if (!json_is_array(jo) || json_array_size(jo) != 2 ||
        !json_is_integer(json_array_get(jo, 0)) || !json_is_integer(json_array_get(jo, 1)))
        return skv_errorf(SKV_E_FORMAT, "%s: tensor %s: data_offsets is not [begin, end]", path,
                          key);
    json_int_t b = json_integer_value(json_array_get(jo, 0));
    json_int_t en = json_integer_value(json_array_get(jo, 1));
    if (b < 0 || en < b)
        return skv_errorf(SKV_E_FORMAT, "%s: tensor %s: data_offsets [%lld, %lld] invalid", path,
                          key, (long long)b, (long long)en);
    if ((uint64_t)en > data_size)
        return skv_errorf(SKV_E_FORMAT,
                          "%s: tensor %s: data ends at %lld, past the end of the file "
                          "(%llu data bytes)", path, key, (long long)en,
                          (unsigned long long)data_size);
    if ((uint64_t)(en - b) != nbytes)
        return skv_errorf(SKV_E_FORMAT,
                          "%s: tensor %s: data_offsets span %lld bytes, dtype and shape need "
                          "%llu", path, key, (long long)(en - b), (unsigned long long)nbytes);
    if ((data_start + (uint64_t)b) % esize != 0)
        return skv_errorf(SKV_E_UNSUPPORTED,
                          "%s: tensor %s: data not aligned to its %zu-byte elements", path, key,
                          esize);
    e->key = key;
    e->begin = (uint64_t)b;
    e->end = (uint64_t)en;
    return SKV_OK;
}

static int cmp_entry(const void *a, const void *b)
{
    const struct st_entry *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return strcmp(x->key, y->key);
}

/* Parses files[fi] and appends its tensors in data-offset order. */
static int parse_file(struct skv_safetensors *st, int fi)
{
    const struct st_file *f = &st->files[fi];
    const char *path = f->path;
    uint64_t hlen = read_le64(f->map);
    if (hlen > f->size - 8)
        return skv_errorf(SKV_E_FORMAT,
                          "%s: header length %llu runs past the end of the file (%zu bytes)",
                          path, (unsigned long long)hlen, f->size);
    if (hlen > SKV_SAFETENSORS_MAX_HEADER)
        return skv_errorf(SKV_E_LIMIT, "%s: header of %llu bytes (limit %llu)", path,
                          (unsigned long long)hlen,
                          (unsigned long long)SKV_SAFETENSORS_MAX_HEADER);
    uint64_t data_start = 8 + hlen;
    uint64_t data_size = f->size - data_start;

    json_error_t jerr;
    json_t *root = json_loadb((const char *)f->map + 8, (size_t)hlen, JSON_REJECT_DUPLICATES,
                              &jerr);
    if (!root)
        return skv_errorf(SKV_E_FORMAT, "%s: bad JSON header: %s (at byte %d)", path, jerr.text,
                          jerr.position);
    int rc = SKV_OK;
    struct st_entry *ents = NULL;
    size_t n = 0;
    if (!json_is_object(root)) {
        rc = skv_errorf(SKV_E_FORMAT, "%s: JSON header is not an object", path);
        goto out_root;
    }
    ents = calloc(json_object_size(root) + 1, sizeof *ents);
    if (!ents) {
        rc = skv_errorf(SKV_E_NOMEM, "%s: out of memory", path);
        goto out_root;
    }
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (strcmp(key, "__metadata__") == 0)
            continue;
        rc = parse_entry(path, key, val, data_start, data_size, &ents[n]);
        if (rc < 0)
            goto out_ents;
        n++;
    }
    qsort(ents, n, sizeof *ents, cmp_entry);
    for (size_t i = 1; i < n; i++) {
        if (ents[i].begin < ents[i - 1].end) {
            rc = skv_errorf(SKV_E_FORMAT, "%s: tensors %s and %s overlap", path,
                            ents[i - 1].key, ents[i].key);
            goto out_ents;
        }
    }
    rc = grow_tensors(st, (int64_t)n);
    if (rc < 0)
        goto out_ents;
    for (size_t i = 0; i < n; i++) {
        char *name = strdup(ents[i].key);
        if (!name) {
            rc = skv_errorf(SKV_E_NOMEM, "%s: out of memory", path);
            goto out_ents;
        }
        struct skv_tensor *t = &st->tensors[st->n_tensors];
        memset(t, 0, sizeof *t);
        t->type = ents[i].type;
        t->ndim = ents[i].ndim;
        memcpy(t->ne, ents[i].ne, sizeof t->ne);
        t->data = (void *)(f->map + data_start + ents[i].begin);
        t->nbytes = (size_t)(ents[i].end - ents[i].begin);
        t->name = name;
        st->names[st->n_tensors] = name;
        st->file_of[st->n_tensors] = fi;
        st->n_tensors++;
    }
out_ents:
    free(ents);
out_root:
    json_decref(root);
    return rc;
}

static int cmp_name_ref(const void *a, const void *b)
{
    const struct st_name_ref *x = a, *y = b;
    return strcmp(x->name, y->name);
}

/* Sorted by-name index; a name that occurs twice is a format error. */
static int build_index(struct skv_safetensors *st)
{
    st->by_name = malloc((size_t)(st->n_tensors ? st->n_tensors : 1) * sizeof *st->by_name);
    if (!st->by_name)
        return skv_errorf(SKV_E_NOMEM, "safetensors: out of memory");
    for (int64_t i = 0; i < st->n_tensors; i++) {
        st->by_name[i].name = st->names[i];
        st->by_name[i].idx = i;
    }
    qsort(st->by_name, (size_t)st->n_tensors, sizeof *st->by_name, cmp_name_ref);
    for (int64_t i = 1; i < st->n_tensors; i++) {
        if (strcmp(st->by_name[i - 1].name, st->by_name[i].name) == 0) {
            int64_t a = st->by_name[i - 1].idx, b = st->by_name[i].idx;
            return skv_errorf(SKV_E_FORMAT, "tensor %s is in both %s and %s", st->names[a],
                              st->files[st->file_of[a]].path, st->files[st->file_of[b]].path);
        }
    }
    return SKV_OK;
}

static int64_t find_idx(const struct skv_safetensors *st, const char *name)
{
    int64_t lo = 0, hi = st->n_tensors;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        int c = strcmp(st->by_name[mid].name, name);
        if (c == 0)
            return st->by_name[mid].idx;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return -1;
}

static int add_file(struct skv_safetensors *st, const char *dir, const char *name)
{
    struct st_file *f = &st->files[st->n_files];
    memset(f, 0, sizeof *f);
    f->path = path_join(dir, name);
    if (!f->path)
        return skv_errorf(SKV_E_NOMEM, "safetensors: out of memory");
    f->name = f->path + strlen(dir) + 1;
    st->n_files++;   /* counted now so close() frees the path even if mapping fails */
    int rc = map_file(f->path, f);
    if (rc < 0)
        return rc;
    return parse_file(st, st->n_files - 1);
}

static bool shard_name_ok(const char *s)
{
    return s[0] != '\0' && s[0] != '.' && !strchr(s, '/') && !strchr(s, '\\') &&
           !strstr(s, "..");
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int read_small_file(const char *path, uint64_t limit, char **buf_out, size_t *len_out)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return skv_errorf(errno == ENOENT ? SKV_E_NOT_FOUND : SKV_E_IO, "%s: %s", path,
                          strerror(errno));
    int rc = SKV_OK;
    struct stat sb;
    char *buf = NULL;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        rc = skv_errorf(SKV_E_IO, "%s: not a readable regular file", path);
        goto out_close;
    }
    if ((uint64_t)sb.st_size > limit) {
        rc = skv_errorf(SKV_E_LIMIT, "%s: %lld bytes (limit %llu)", path, (long long)sb.st_size,
                        (unsigned long long)limit);
        goto out_close;
    }
    size_t len = (size_t)sb.st_size, got = 0;
    buf = malloc(len + 1);
    if (!buf) {
        rc = skv_errorf(SKV_E_NOMEM, "%s: out of memory", path);
        goto out_close;
    }
    while (got < len) {
        ssize_t r = read(fd, buf + got, len - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            rc = skv_errorf(SKV_E_IO, "%s: short read", path);
            goto out_free;
        }
        got += (size_t)r;
    }
    buf[len] = '\0';
    *buf_out = buf;
    *len_out = len;
    buf = NULL;
out_free:
    free(buf);
out_close:
    close(fd);
    return rc;
}

/* Maps the shards of an index and checks its weight_map against what they hold. */
static int open_index(struct skv_safetensors *st, const char *dir, const char *index_path)
{
    char *text = NULL;
    size_t len = 0;
    int rc = read_small_file(index_path, SKV_SAFETENSORS_MAX_INDEX, &text, &len);
    if (rc < 0)
        return rc;
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    free(text);
    if (!root)
        return skv_errorf(SKV_E_FORMAT, "%s: bad JSON: %s (line %d)", index_path, jerr.text,
                          jerr.line);
    const char **shards = NULL;
    json_t *wm = json_object_get(root, "weight_map");
    if (!json_is_object(root) || !json_is_object(wm)) {
        rc = skv_errorf(SKV_E_FORMAT, "%s: no weight_map object", index_path);
        goto out_root;
    }
    size_t n_entries = json_object_size(wm);
    if (n_entries == 0) {
        rc = skv_errorf(SKV_E_FORMAT, "%s: empty weight_map", index_path);
        goto out_root;
    }
    shards = malloc(n_entries * sizeof *shards);
    if (!shards) {
        rc = skv_errorf(SKV_E_NOMEM, "%s: out of memory", index_path);
        goto out_root;
    }
    size_t n = 0;
    const char *key;
    json_t *val;
    json_object_foreach(wm, key, val) {
        if (!json_is_string(val)) {
            rc = skv_errorf(SKV_E_FORMAT, "%s: weight_map[%s] is not a file name", index_path,
                            key);
            goto out_shards;
        }
        const char *s = json_string_value(val);
        if (!shard_name_ok(s)) {
            rc = skv_errorf(SKV_E_FORMAT, "%s: weight_map[%s]: bad shard name \"%.64s\"",
                            index_path, key, s);
            goto out_shards;
        }
        shards[n++] = s;
    }
    qsort(shards, n, sizeof *shards, cmp_str);
    size_t u = 0;
    for (size_t i = 0; i < n; i++)
        if (u == 0 || strcmp(shards[u - 1], shards[i]) != 0)
            shards[u++] = shards[i];
    if (u > SKV_SAFETENSORS_MAX_SHARDS) {
        rc = skv_errorf(SKV_E_LIMIT, "%s: %zu shards (limit %d)", index_path, u,
                        SKV_SAFETENSORS_MAX_SHARDS);
        goto out_shards;
    }
    st->files = calloc(u, sizeof *st->files);
    if (!st->files) {
        rc = skv_errorf(SKV_E_NOMEM, "%s: out of memory", index_path);
        goto out_shards;
    }
    for (size_t i = 0; i < u; i++) {
        rc = add_file(st, dir, shards[i]);
        if (rc < 0)
            goto out_shards;
    }
    rc = build_index(st);
    if (rc < 0)
        goto out_shards;
    json_object_foreach(wm, key, val) {
        int64_t idx = find_idx(st, key);
        const char *want = json_string_value(val);
        if (idx < 0) {
            rc = skv_errorf(SKV_E_FORMAT, "%s: tensor %s is not in its shard %s", index_path,
                            key, want);
            goto out_shards;
        }
        const char *have = st->files[st->file_of[idx]].name;
        if (strcmp(have, want) != 0) {
            rc = skv_errorf(SKV_E_FORMAT, "%s: tensor %s is listed in %s but found in %s",
                            index_path, key, want, have);
            goto out_shards;
        }
    }
out_shards:
    free(shards);
out_root:
    json_decref(root);
    return rc;
}

int skv_safetensors_open_dir(const char *dir, struct skv_safetensors **out)
{
    if (!dir || !out)
        return skv_errorf(SKV_E_INVAL, "safetensors: NULL argument");
    struct skv_safetensors *st = calloc(1, sizeof *st);
    if (!st)
        return skv_errorf(SKV_E_NOMEM, "safetensors: out of memory");
    int rc;
    char *single = path_join(dir, SINGLE_FILE);
    char *index = path_join(dir, INDEX_FILE);
    if (!single || !index) {
        rc = skv_errorf(SKV_E_NOMEM, "safetensors: out of memory");
        goto out_fail;
    }
    struct stat sb;
    if (stat(single, &sb) == 0) {
        st->files = calloc(1, sizeof *st->files);
        if (!st->files) {
            rc = skv_errorf(SKV_E_NOMEM, "safetensors: out of memory");
            goto out_fail;
        }
        rc = add_file(st, dir, SINGLE_FILE);
        if (rc < 0)
            goto out_fail;
        rc = build_index(st);
        if (rc < 0)
            goto out_fail;
    } else if (stat(index, &sb) == 0) {
        rc = open_index(st, dir, index);
        if (rc < 0)
            goto out_fail;
    } else {
        rc = skv_errorf(SKV_E_NOT_FOUND, "%s: no %s or %s", dir, SINGLE_FILE, INDEX_FILE);
        goto out_fail;
    }
    free(single);
    free(index);
    *out = st;
    return SKV_OK;

out_fail:
    free(single);
    free(index);
    skv_safetensors_close(&st);
    return rc;
}

void skv_safetensors_close(struct skv_safetensors **st_p)
{
    if (!st_p || !*st_p)
        return;
    struct skv_safetensors *st = *st_p;
    for (int64_t i = 0; i < st->n_tensors; i++)
        free(st->names[i]);
    for (int i = 0; i < st->n_files; i++) {
        if (st->files[i].map)
            munmap((void *)st->files[i].map, st->files[i].size);
        free(st->files[i].path);
    }
    free(st->files);
    free(st->tensors);
    free(st->names);
    free(st->file_of);
    free(st->by_name);
    free(st);
    *st_p = NULL;
}

int64_t skv_safetensors_n_tensors(const struct skv_safetensors *st)
{
    return st ? st->n_tensors : 0;
}

const struct skv_tensor *skv_safetensors_tensor(const struct skv_safetensors *st, int64_t i)
{
    if (!st || i < 0 || i >= st->n_tensors)
        return NULL;
    return &st->tensors[i];
}

const struct skv_tensor *skv_safetensors_find(const struct skv_safetensors *st, const char *name)
{
    if (!st || !name)
        return NULL;
    int64_t i = find_idx(st, name);
    return i < 0 ? NULL : &st->tensors[i];
}
