/* The block store (see kv_store.h): a header, then one record per block (K rows, V rows and
 * a BLAKE2b-128 of them), written in the order blocks are first put; blocks already written
 * are found by their address, and blocks of equal bytes by their BLAKE2b, in two trees
 * (tsearch). */
#include "daemon/engine/kv_store.h"
#include "common/status.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <search.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define STORE_MAGIC "SKVBLKS1"
#define STORE_VERSION 1
#define STORE_SUM 16 /* BLAKE2b bytes after each record */
#define STORE_WBUF (1 << 20)

struct store_header {
    char magic[8];
    uint32_t version;
    uint32_t block_rows, head_dim;
    uint32_t reserved;
    uint64_t n_blocks;
    char fingerprint[64];
};

struct written {             /* a tree node of the writer: a block, its bytes' hash, its index */
    const struct skv_kv_block *b;
    uint64_t key;
    uint32_t idx;
};

struct loaded {              /* the reader's block of an index, held, and whose it is */
    struct skv_kv_block *b;
    uint64_t group;
};

struct skv_kv_store {
    int fd;                  /* reader */
    FILE *f;                 /* writer: records appended in order, the header last */
    bool writing;
    bool broken;             /* writer: a write failed, the records after it would be misplaced */
    struct store_header hd;
    size_t rows_bytes;       /* block_rows * head_dim * 4: K or V of one block */
    void *by_address;        /* writer: struct written of every block put (owns them) */
    void *by_content;        /* writer: those whose bytes were written, by key */
    struct skv_kv_pool *pool; /* writer: where the blocks are; reader: where the held ones go back */
    unsigned char *theirs;   /* writer: an earlier block's bytes, compared with a new one's */
    char *wbuf;              /* writer: f's buffer */
    struct loaded *loaded;   /* reader: [n_blocks] */
    float *buf;              /* reader: one record (K, V, sum) */
};

static size_t record_bytes(const struct skv_kv_store *st)
{
    return 2 * st->rows_bytes + STORE_SUM;
}

static void record_sum(const void *k, const void *v, size_t n, unsigned char out[STORE_SUM])
{
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, STORE_SUM);
    crypto_generichash_update(&h, k, n);
    crypto_generichash_update(&h, v, n);
    crypto_generichash_final(&h, out, STORE_SUM);
}

static int write_out(FILE *f, const void *p, size_t n)
{
    return fwrite(p, 1, n, f) == n ? SKV_OK : skv_errorf(SKV_E_IO, "block store: write: %s", strerror(errno));
}

static int read_at(int fd, void *p, size_t n, off_t at)
{
    for (char *c = p; n;) {
        ssize_t r = pread(fd, c, n, at);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return skv_errorf(SKV_E_IO, "block store: read: %s", strerror(errno));
        if (r == 0)
            return skv_errorf(SKV_E_FORMAT, "block store is truncated");
        c += r;
        n -= (size_t)r;
        at += r;
    }
    return SKV_OK;
}

static int store_new(const char *fingerprint, int block_rows, int head_dim, struct skv_kv_store **out)
{
    if (block_rows <= 0 || head_dim <= 0)
        return skv_errorf(SKV_E_INVAL, "block store: %d rows of %d", block_rows, head_dim);
    struct skv_kv_store *st = calloc(1, sizeof *st);
    if (!st)
        return SKV_E_NOMEM;
    st->fd = -1;
    memcpy(st->hd.magic, STORE_MAGIC, 8);
    st->hd.version = STORE_VERSION;
    st->hd.block_rows = (uint32_t)block_rows;
    st->hd.head_dim = (uint32_t)head_dim;
    memcpy(st->hd.fingerprint, fingerprint, sizeof st->hd.fingerprint);
    st->rows_bytes = (size_t)block_rows * (size_t)head_dim * sizeof(float);
    *out = st;
    return SKV_OK;
}

int skv_kv_store_create(const char *path, const char *fingerprint, struct skv_kv_pool *pool,
                        struct skv_kv_store **out)
{
    struct skv_kv_store *st;
    int rc = store_new(fingerprint, skv_kv_pool_block_rows(pool), skv_kv_pool_head_dim(pool), &st);
    if (rc)
        return rc;
    st->writing = true;
    st->pool = pool;
    if (!(st->theirs = malloc(2 * st->rows_bytes))) {
        skv_kv_store_close(&st);
        return SKV_E_NOMEM;
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || !(st->f = fdopen(fd, "wb")))
        rc = skv_errorf(SKV_E_IO, "%s: %s", path, strerror(errno));
    if (!rc && (!(st->wbuf = malloc(STORE_WBUF)) || setvbuf(st->f, st->wbuf, _IOFBF, STORE_WBUF) != 0))
        rc = SKV_E_NOMEM; /* records in few large writes (glibc sizes a buffer it makes itself to a page) */
    if (!rc) /* the header's place; written again when the count is known */
        rc = write_out(st->f, &st->hd, sizeof st->hd);
    if (rc) {
        if (fd >= 0 && !st->f)
            close(fd);
        skv_kv_store_close(&st);
        return rc;
    }
    *out = st;
    return SKV_OK;
}

static int by_address(const void *a, const void *b)
{
    const struct skv_kv_block *x = ((const struct written *)a)->b, *y = ((const struct written *)b)->b;
    return x < y ? -1 : x > y ? 1 : 0;
}

static int by_key(const void *a, const void *b)
{
    uint64_t x = ((const struct written *)a)->key, y = ((const struct written *)b)->key;
    return x < y ? -1 : x > y ? 1 : 0;
}

/* An earlier block of the same key whose bytes are k and v: its index in *idx. */
static int same_bytes(struct skv_kv_store *st, uint64_t key, const float *k, const float *v, uint32_t *idx,
                      bool *found)
{
    struct written probe = {.key = key};
    struct written **e = tfind(&probe, &st->by_content, by_key);
    *found = false;
    if (!e)
        return SKV_OK;
    int rc = skv_kv_pool_read_block(st->pool, (*e)->b, st->theirs);
    if (rc)
        return rc;
    *found = memcmp(st->theirs, k, st->rows_bytes) == 0 && memcmp(st->theirs + st->rows_bytes, v, st->rows_bytes) == 0;
    *idx = (*e)->idx;
    return SKV_OK;
}

int skv_kv_store_put(struct skv_kv_store *st, const struct skv_kv_block *b, const float *k, const float *v,
                     uint32_t *idx)
{
    if (!st->writing || st->broken)
        return skv_errorf(st->broken ? SKV_E_IO : SKV_E_INVAL, "block store: %s",
                          st->broken ? "an earlier write failed" : "opened to read");
    struct written probe = {.b = b};
    struct written **found = tfind(&probe, &st->by_address, by_address);
    if (found) {
        *idx = (*found)->idx;
        return SKV_OK;
    }
    /* blocks of equal bytes: forks that each wrote the same rows, documents prefilled twice */
    unsigned char sum[STORE_SUM];
    record_sum(k, v, st->rows_bytes, sum);
    uint64_t key;
    memcpy(&key, sum, sizeof key);
    bool same;
    uint32_t same_idx;
    int rc = same_bytes(st, key, k, v, &same_idx, &same);
    if (rc)
        return rc;
    if (!same && st->hd.n_blocks >= UINT32_MAX)
        return skv_errorf(SKV_E_LIMIT, "block store: more than %u blocks", UINT32_MAX - 1);
    struct written *w = malloc(sizeof *w);
    if (!w)
        return SKV_E_NOMEM;
    *w = (struct written){.b = b, .key = key, .idx = same ? same_idx : (uint32_t)st->hd.n_blocks};
    if (same) {
        if (!tsearch(w, &st->by_address, by_address)) {
            free(w);
            return SKV_E_NOMEM;
        }
        *idx = w->idx;
        return SKV_OK;
    }
    rc = write_out(st->f, k, st->rows_bytes);
    if (!rc)
        rc = write_out(st->f, v, st->rows_bytes);
    if (!rc)
        rc = write_out(st->f, sum, sizeof sum);
    if (!rc && !tsearch(w, &st->by_address, by_address))
        rc = SKV_E_NOMEM;
    if (!rc && !tsearch(w, &st->by_content, by_key)) { /* a key already there keeps its first block */
        tdelete(w, &st->by_address, by_address);
        rc = SKV_E_NOMEM;
    }
    if (rc) {
        st->broken = true;
        free(w);
        return rc;
    }
    st->hd.n_blocks++;
    *idx = w->idx;
    return SKV_OK;
}

uint32_t skv_kv_store_blocks(const struct skv_kv_store *st)
{
    return (uint32_t)st->hd.n_blocks;
}

int skv_kv_store_block_rows(const struct skv_kv_store *st)
{
    return (int)st->hd.block_rows;
}

uint64_t skv_kv_store_bytes(const struct skv_kv_store *st)
{
    return sizeof st->hd + st->hd.n_blocks * (uint64_t)record_bytes(st);
}

int skv_kv_store_finish(struct skv_kv_store *st)
{
    if (!st->writing || st->broken)
        return skv_errorf(st->broken ? SKV_E_IO : SKV_E_INVAL, "block store: %s",
                          st->broken ? "an earlier write failed" : "opened to read");
    int rc = fseek(st->f, 0, SEEK_SET) == 0 ? write_out(st->f, &st->hd, sizeof st->hd)
                                            : skv_errorf(SKV_E_IO, "block store: seek: %s", strerror(errno));
    if (!rc && (fflush(st->f) != 0 || fsync(fileno(st->f)) != 0))
        rc = skv_errorf(SKV_E_IO, "block store: write: %s", strerror(errno));
    return rc;
}

int skv_kv_store_open(const char *path, const char *fingerprint, int block_rows, int head_dim,
                      struct skv_kv_store **out)
{
    struct skv_kv_store *st;
    int rc = store_new(fingerprint, block_rows, head_dim, &st);
    if (rc)
        return rc;
    struct store_header hd;
    struct stat sb;
    if ((st->fd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
        rc = skv_errorf(errno == ENOENT ? SKV_E_NOT_FOUND : SKV_E_IO, "%s: %s", path, strerror(errno));
    if (!rc)
        rc = read_at(st->fd, &hd, sizeof hd, 0);
    if (!rc && (memcmp(hd.magic, STORE_MAGIC, 8) != 0 || hd.version != STORE_VERSION))
        rc = skv_errorf(SKV_E_FORMAT, "%s is not a block store of version %d", path, STORE_VERSION);
    if (!rc && memcmp(hd.fingerprint, fingerprint, sizeof hd.fingerprint) != 0)
        rc = skv_errorf(SKV_E_INVAL, "%s was written with another model", path);
    if (!rc && (hd.head_dim != st->hd.head_dim || hd.block_rows == 0 || hd.block_rows > 1u << 16))
        rc = skv_errorf(SKV_E_INVAL, "%s holds blocks of %u rows of %u, not rows of %d", path, hd.block_rows,
                        hd.head_dim, head_dim);
    if (!rc) { /* blocks of another size (kv-block-tokens changed) are read as rows */
        st->hd.block_rows = hd.block_rows;
        st->rows_bytes = (size_t)hd.block_rows * (size_t)head_dim * sizeof(float);
    }
    if (!rc && fstat(st->fd, &sb) != 0)
        rc = skv_errorf(SKV_E_IO, "%s: %s", path, strerror(errno));
    if (!rc && (hd.n_blocks >= UINT32_MAX ||
                (uint64_t)sb.st_size != sizeof hd + hd.n_blocks * (uint64_t)record_bytes(st)))
        rc = skv_errorf(SKV_E_FORMAT, "%s: %llu blocks do not fill its %lld bytes", path,
                        (unsigned long long)hd.n_blocks, (long long)sb.st_size);
    if (!rc) {
        st->hd.n_blocks = hd.n_blocks;
        st->loaded = calloc(hd.n_blocks ? hd.n_blocks : 1, sizeof *st->loaded);
        st->buf = malloc(record_bytes(st));
        if (!st->loaded || !st->buf)
            rc = SKV_E_NOMEM;
    }
    if (rc) {
        skv_kv_store_close(&st);
        return rc;
    }
    *out = st;
    return SKV_OK;
}

/* Reads block idx into st->buf (K then V), its checksum and values checked. */
static int store_read(struct skv_kv_store *st, uint32_t idx)
{
    unsigned char want[STORE_SUM];
    int rc = read_at(st->fd, st->buf, record_bytes(st), (off_t)(sizeof st->hd + (size_t)idx * record_bytes(st)));
    if (rc)
        return rc;
    record_sum(st->buf, (char *)st->buf + st->rows_bytes, st->rows_bytes, want);
    if (memcmp(want, (char *)st->buf + 2 * st->rows_bytes, sizeof want) != 0)
        return skv_errorf(SKV_E_FORMAT, "block store: block %u fails its checksum", idx);
    for (size_t i = 0; i < 2 * st->rows_bytes / sizeof(float); i++)
        if (!isfinite(st->buf[i]))
            return skv_errorf(SKV_E_FORMAT, "block store: block %u holds a value that is not finite", idx);
    return SKV_OK;
}

int skv_kv_store_get(struct skv_kv_store *st, uint32_t idx, uint64_t group, struct skv_kv_cache *c, int layer, int h,
                     bool *shared)
{
    *shared = false;
    if (st->writing)
        return skv_errorf(SKV_E_INVAL, "block store: opened to write");
    if (idx >= st->hd.n_blocks)
        return skv_errorf(SKV_E_FORMAT, "block store: no block %u (it holds %llu)", idx,
                          (unsigned long long)st->hd.n_blocks);
    if ((uint32_t)c->head_dim != st->hd.head_dim)
        return skv_errorf(SKV_E_INVAL, "block store: rows of %d, not %u", c->head_dim, st->hd.head_dim);
    struct skv_kv_head *hd = skv_kv_cache_head(c, layer, h);
    int row0 = hd->len, br = (int)st->hd.block_rows;
    /* a block of the cache's own size, at a block boundary of its head, from its pool */
    bool whole = c->block_rows == br && row0 % br == 0 && (!st->pool || st->pool == c->pool);
    struct loaded *l = &st->loaded[idx];
    if (whole && l->b && l->group == group) {
        int rc = skv_kv_cache_append_block(c, layer, h, l->b);
        *shared = !rc;
        return rc;
    }
    int rc = store_read(st, idx);
    if (!rc)
        rc = skv_kv_cache_write_rows(c, layer, h, 0, row0, br, st->buf);
    if (!rc)
        rc = skv_kv_cache_write_rows(c, layer, h, 1, row0, br, (const float *)((char *)st->buf + st->rows_bytes));
    if (rc || !whole || l->b)
        return rc; /* another group's block, or rows: this cache's own */
    st->pool = c->pool;
    l->b = hd->blk[row0 / br];
    l->group = group;
    skv_kv_pool_hold(c->pool, l->b);
    return SKV_OK;
}

static void nothing(void *p)
{
    (void)p;
}

void skv_kv_store_close(struct skv_kv_store **st_p)
{
    struct skv_kv_store *st = st_p ? *st_p : NULL;
    if (!st)
        return;
    if (st->fd >= 0)
        close(st->fd);
    if (st->f)
        fclose(st->f);
    free(st->wbuf);
    tdestroy(st->by_content, nothing); /* its nodes are by_address's */
    tdestroy(st->by_address, free);
    free(st->theirs);
    for (uint64_t i = 0; st->loaded && i < st->hd.n_blocks; i++)
        if (st->loaded[i].b)
            skv_kv_pool_put(st->pool, st->loaded[i].b);
    free(st->loaded);
    free(st->buf);
    free(st);
    *st_p = NULL;
}
