/* The block store (see kv_store.h): a header, then one record per block and count of its rows
 * in use (K rows, V rows, zero rows past those in use, and a BLAKE2b-128 of them), appended in
 * the order blocks are first put, across saves. Blocks already written are found by their
 * stamp and count (block_key, in this save's map or the last one's), and blocks of equal bytes
 * by their BLAKE2b (read back and compared). */
#include "daemon/engine/kv_store.h"
#include "common/status.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
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

/* uint64 keys (never 0) to block indices, open addressing */
struct map {
    uint64_t *keys;
    uint32_t *vals;
    size_t cap, n;
};

struct loaded {              /* the reader's block of an index (not held: checked by its stamp), and whose */
    struct skv_kv_block *b;
    uint64_t stamp;
    uint64_t group;
};

struct skv_kv_store {
    int fd;
    bool writing;
    bool broken;             /* writer: a write failed, where the file ends is unknown */
    struct store_header hd;
    size_t rows_bytes;       /* block_rows * head_dim * 4: K or V of one block */
    struct skv_kv_pool *pool; /* writer: where the blocks are; reader: where the loaded ones are (pinned) */
    struct map now, last;    /* stamps named by this save, and by the last one that ended well */
    struct map by_content;   /* the first block of each key of bytes in the file */
    uint8_t *live;           /* [n_blocks] bits: named by this save */
    size_t live_cap;         /* bytes of live */
    uint32_t n_live, n_live_last, n_appended;
    char *wbuf;              /* writer: records not yet written, from index flushed on */
    size_t wlen;
    uint64_t flushed;        /* records in the file */
    struct loaded *loaded;   /* reader: [n_blocks] */
    bool pinned;             /* reader: the pool's slabs, while loaded[] names blocks */
    float *buf;              /* one record (K, V, sum) */
    float *pad;              /* writer: a partly filled block's K and V rows, then zero rows */
};

/* A block's key in the stamp maps: its stamp when all block_rows rows are in use. Forks that
 * share a partly filled block may use different numbers of its rows, so such a block's first
 * `rows` rows have a key of their own: the stamp below PART_STAMP_BITS bits, the count above
 * them and the top bit set (a full block's stamp never reaches it). 0: no key (a stamp too
 * large to mix with a count; the block is then found by its bytes only). */
#define PART_STAMP_BITS 47
static uint64_t block_key(const struct skv_kv_store *st, const struct skv_kv_block *b, int rows)
{
    if ((uint32_t)rows == st->hd.block_rows)
        return b->stamp;
    if (b->stamp >> PART_STAMP_BITS)
        return 0;
    return 1ull << 63 | (uint64_t)rows << PART_STAMP_BITS | b->stamp;
}

static size_t record_bytes(const struct skv_kv_store *st)
{
    return 2 * st->rows_bytes + STORE_SUM;
}

static off_t record_at(const struct skv_kv_store *st, uint64_t idx)
{
    return (off_t)(sizeof st->hd + idx * record_bytes(st));
}

static void record_sum(const void *k, const void *v, size_t n, unsigned char out[STORE_SUM])
{
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, STORE_SUM);
    crypto_generichash_update(&h, k, n);
    crypto_generichash_update(&h, v, n);
    crypto_generichash_final(&h, out, STORE_SUM);
}

static uint64_t sum_key(const unsigned char sum[STORE_SUM])
{
    uint64_t key;
    memcpy(&key, sum, sizeof key);
    return key ? key : 1;
}

static uint64_t map_slot(const struct map *m, uint64_t key)
{
    return (key * 0x9E3779B97F4A7C15ull >> 17) & (m->cap - 1);
}

static bool map_get(const struct map *m, uint64_t key, uint32_t *val)
{
    if (!m->cap)
        return false;
    for (uint64_t i = map_slot(m, key);; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == key) {
            *val = m->vals[i];
            return true;
        }
        if (!m->keys[i])
            return false;
    }
}

static int map_grow(struct map *m);

/* Room for one more key: the next map_set cannot fail. */
static int map_room(struct map *m)
{
    return 2 * (m->n + 1) > m->cap ? map_grow(m) : SKV_OK;
}

/* Sets key to val; replace: also when the key is there (otherwise its value stays). */
static int map_set(struct map *m, uint64_t key, uint32_t val, bool replace)
{
    int rc = map_room(m);
    if (rc)
        return rc;
    uint64_t i = map_slot(m, key);
    while (m->keys[i] && m->keys[i] != key)
        i = (i + 1) & (m->cap - 1);
    if (!m->keys[i]) {
        m->keys[i] = key;
        m->vals[i] = val;
        m->n++;
    } else if (replace) {
        m->vals[i] = val;
    }
    return SKV_OK;
}

static int map_grow(struct map *m)
{
    struct map bigger = {.cap = m->cap ? 2 * m->cap : 1024};
    bigger.keys = calloc(bigger.cap, sizeof *bigger.keys);
    bigger.vals = malloc(bigger.cap * sizeof *bigger.vals);
    if (!bigger.keys || !bigger.vals) {
        free(bigger.keys);
        free(bigger.vals);
        return skv_errorf(SKV_E_NOMEM, "block store: an index of %zu blocks", bigger.cap);
    }
    for (size_t i = 0; i < m->cap; i++)
        if (m->keys[i])
            map_set(&bigger, m->keys[i], m->vals[i], true);
    free(m->keys);
    free(m->vals);
    *m = bigger;
    return SKV_OK;
}

static void map_free(struct map *m)
{
    free(m->keys);
    free(m->vals);
    *m = (struct map){0};
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

static int write_at(int fd, const void *p, size_t n, off_t at)
{
    for (const char *c = p; n;) {
        ssize_t r = pwrite(fd, c, n, at);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return skv_errorf(SKV_E_IO, "block store: write: %s", r < 0 ? strerror(errno) : "nothing written");
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

/* The writer's buffers (st->fd open to write). */
static int writer_start(struct skv_kv_store *st, struct skv_kv_pool *pool)
{
    st->writing = true;
    st->pool = pool;
    st->wlen = 0;
    st->flushed = st->hd.n_blocks;
    if (!st->wbuf && !(st->wbuf = malloc(STORE_WBUF > record_bytes(st) ? STORE_WBUF : record_bytes(st))))
        return SKV_E_NOMEM;
    if (!st->buf && !(st->buf = malloc(record_bytes(st))))
        return SKV_E_NOMEM;
    if (!st->pad && !(st->pad = malloc(2 * st->rows_bytes)))
        return SKV_E_NOMEM;
    return SKV_OK;
}

int skv_kv_store_create(const char *path, const char *fingerprint, struct skv_kv_pool *pool,
                        struct skv_kv_store **out)
{
    struct skv_kv_store *st;
    int rc = store_new(fingerprint, skv_kv_pool_block_rows(pool), skv_kv_pool_head_dim(pool), &st);
    if (rc)
        return rc;
    if ((st->fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)) < 0)
        rc = skv_errorf(SKV_E_IO, "%s: %s", path, strerror(errno));
    if (!rc)
        rc = writer_start(st, pool);
    if (!rc) /* the header's place; written again with the count at each finish */
        rc = write_at(st->fd, &st->hd, sizeof st->hd, 0);
    if (rc) {
        skv_kv_store_close(&st);
        return rc;
    }
    *out = st;
    return SKV_OK;
}

static int writer_check(const struct skv_kv_store *st)
{
    if (!st->writing || st->broken)
        return skv_errorf(st->broken ? SKV_E_IO : SKV_E_INVAL, "block store: %s",
                          st->broken ? "an earlier write failed" : "opened to read");
    return SKV_OK;
}

void skv_kv_store_begin(struct skv_kv_store *st)
{
    st->now.n = 0;
    if (st->now.cap)
        memset(st->now.keys, 0, st->now.cap * sizeof *st->now.keys);
    if (st->live)
        memset(st->live, 0, st->live_cap);
    st->n_live = 0;
    st->n_appended = 0;
}

/* Room in the live bitmap for block idx: marking it cannot fail. */
static int live_room(struct skv_kv_store *st, uint32_t idx)
{
    if ((size_t)idx / 8 >= st->live_cap) {
        size_t cap = st->live_cap ? st->live_cap : 4096;
        while (cap <= (size_t)idx / 8)
            cap *= 2;
        uint8_t *more = realloc(st->live, cap);
        if (!more)
            return SKV_E_NOMEM;
        memset(more + st->live_cap, 0, cap - st->live_cap);
        st->live = more;
        st->live_cap = cap;
    }
    return SKV_OK;
}

/* Block idx is named by this save. */
static int mark_live(struct skv_kv_store *st, uint32_t idx)
{
    int rc = live_room(st, idx);
    if (rc)
        return rc;
    if (!(st->live[idx / 8] & (1u << (idx % 8)))) {
        st->live[idx / 8] |= (uint8_t)(1u << (idx % 8));
        st->n_live++;
    }
    return SKV_OK;
}

/* Names the block of key (block_key; 0: none) as block idx in this save: all of it or, out of
 * memory, nothing. */
static int named(struct skv_kv_store *st, uint64_t key, uint32_t idx)
{
    int rc = live_room(st, idx);
    if (!rc && key)
        rc = map_set(&st->now, key, idx, true);
    return rc ? rc : mark_live(st, idx);
}

static bool rows_valid(const struct skv_kv_store *st, int rows)
{
    return rows > 0 && (uint32_t)rows <= st->hd.block_rows;
}

bool skv_kv_store_find(struct skv_kv_store *st, const struct skv_kv_block *b, int rows, uint32_t *idx)
{
    uint64_t key = rows_valid(st, rows) ? block_key(st, b, rows) : 0;
    if (writer_check(st) || !key)
        return false;
    if (map_get(&st->now, key, idx))
        return true;
    return map_get(&st->last, key, idx) && named(st, key, *idx) == SKV_OK;
}

/* The bytes of block idx (K, V) into st->buf: from the write buffer or the file. */
static int record_read(struct skv_kv_store *st, uint32_t idx)
{
    if (idx >= st->flushed) {
        memcpy(st->buf, st->wbuf + (idx - st->flushed) * record_bytes(st), 2 * st->rows_bytes);
        return SKV_OK;
    }
    return read_at(st->fd, st->buf, 2 * st->rows_bytes, record_at(st, idx));
}

static int flush_records(struct skv_kv_store *st)
{
    int rc = st->wlen ? write_at(st->fd, st->wbuf, st->wlen, record_at(st, st->flushed)) : SKV_OK;
    if (rc) {
        st->broken = true;
        return rc;
    }
    st->flushed += st->wlen / record_bytes(st);
    st->wlen = 0;
    return SKV_OK;
}

int skv_kv_store_put(struct skv_kv_store *st, const struct skv_kv_block *b, int rows, const float *k, const float *v,
                     uint32_t *idx)
{
    int rc = writer_check(st);
    if (rc)
        return rc;
    if (!rows_valid(st, rows))
        return skv_errorf(SKV_E_INVAL, "block store: a block of %d rows of %u", rows, st->hd.block_rows);
    if (skv_kv_store_find(st, b, rows, idx))
        return SKV_OK;
    if ((uint32_t)rows < st->hd.block_rows) { /* the record: its rows, then zero rows */
        size_t n = (size_t)rows * st->hd.head_dim * sizeof(float);
        memcpy(st->pad, k, n);
        memset((char *)st->pad + n, 0, st->rows_bytes - n);
        memcpy((char *)st->pad + st->rows_bytes, v, n);
        memset((char *)st->pad + st->rows_bytes + n, 0, st->rows_bytes - n);
        k = st->pad;
        v = (const float *)((const char *)st->pad + st->rows_bytes);
    }
    uint64_t bkey = block_key(st, b, rows);
    /* blocks of equal bytes: forks that each wrote the same rows, documents prefilled twice */
    unsigned char sum[STORE_SUM];
    record_sum(k, v, st->rows_bytes, sum);
    uint64_t key = sum_key(sum);
    uint32_t same;
    if (map_get(&st->by_content, key, &same)) {
        if ((rc = record_read(st, same)))
            return rc;
        if (memcmp(st->buf, k, st->rows_bytes) == 0 &&
            memcmp((char *)st->buf + st->rows_bytes, v, st->rows_bytes) == 0) {
            *idx = same;
            return named(st, bkey, same);
        }
    }
    if (st->hd.n_blocks >= UINT32_MAX - 1)
        return skv_errorf(SKV_E_LIMIT, "block store: more than %u blocks", UINT32_MAX - 2);
    size_t rec = record_bytes(st);
    if (st->wlen + rec > (STORE_WBUF > rec ? STORE_WBUF : rec) && (rc = flush_records(st)))
        return rc;
    memcpy(st->wbuf + st->wlen, k, st->rows_bytes);
    memcpy(st->wbuf + st->wlen + st->rows_bytes, v, st->rows_bytes);
    memcpy(st->wbuf + st->wlen + 2 * st->rows_bytes, sum, STORE_SUM);
    uint32_t at = (uint32_t)st->hd.n_blocks;
    /* no index may name a record that was not appended: the room first, then the entries */
    if ((rc = map_room(&st->by_content)) || (rc = map_room(&st->now)) || (rc = live_room(st, at)))
        return rc;
    if ((rc = map_set(&st->by_content, key, at, false)) || (rc = named(st, bkey, at)))
        return rc; /* cannot happen: the room is there */
    st->wlen += rec;
    st->hd.n_blocks++;
    st->n_appended++;
    *idx = at;
    return SKV_OK;
}

uint32_t skv_kv_store_blocks(const struct skv_kv_store *st)
{
    return (uint32_t)st->hd.n_blocks;
}

uint32_t skv_kv_store_appended(const struct skv_kv_store *st)
{
    return st->n_appended;
}

uint32_t skv_kv_store_live(const struct skv_kv_store *st)
{
    return st->n_live_last;
}

int skv_kv_store_block_rows(const struct skv_kv_store *st)
{
    return (int)st->hd.block_rows;
}

uint64_t skv_kv_store_bytes(const struct skv_kv_store *st)
{
    return sizeof st->hd + st->hd.n_blocks * (uint64_t)record_bytes(st);
}

uint64_t skv_kv_store_appended_bytes(const struct skv_kv_store *st)
{
    return st->n_appended * (uint64_t)record_bytes(st);
}

bool skv_kv_store_mostly_garbage(const struct skv_kv_store *st, uint32_t min_garbage)
{
    uint64_t garbage = st->hd.n_blocks - st->n_live_last;
    return garbage > st->n_live_last && garbage >= min_garbage;
}

bool skv_kv_store_usable(const struct skv_kv_store *st)
{
    struct stat sb; /* a file someone removed (the state directory cleared) takes no more saves */
    return st->writing && !st->broken && fstat(st->fd, &sb) == 0 && sb.st_nlink > 0;
}

int skv_kv_store_finish(struct skv_kv_store *st)
{
    int rc = writer_check(st);
    if (!rc)
        rc = flush_records(st);
    if (!rc && fsync(st->fd) != 0) /* the records before the header that counts them */
        rc = skv_errorf(SKV_E_IO, "block store: write: %s", strerror(errno));
    if (!rc)
        rc = write_at(st->fd, &st->hd, sizeof st->hd, 0);
    if (!rc && fsync(st->fd) != 0)
        rc = skv_errorf(SKV_E_IO, "block store: write: %s", strerror(errno));
    if (rc)
        st->broken = true;
    return rc;
}

void skv_kv_store_end(struct skv_kv_store *st, bool ok)
{
    if (ok) { /* this save's names are the ones to find; the last one's blocks no session holds now */
        struct map t = st->last;
        st->last = st->now;
        st->now = t;
        st->n_live_last = st->n_live;
    } else {  /* a save that did not end: both sets may be on disk next time */
        for (size_t i = 0; i < st->now.cap; i++)
            if (st->now.keys[i] && map_set(&st->last, st->now.keys[i], st->now.vals[i], true))
                break; /* no memory: those blocks are written again */
    }
    skv_kv_store_begin(st);
}

int skv_kv_store_open(const char *path, const char *fingerprint, const char *legacy, int block_rows, int head_dim,
                      int64_t n_named, struct skv_kv_store **out)
{
    struct skv_kv_store *st;
    int rc = store_new(fingerprint, block_rows, head_dim, &st);
    if (rc)
        return rc;
    struct store_header hd;
    struct stat sb;
    /* not a link (the store is reopened to write later) and no FIFO to wait on */
    if ((st->fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)) < 0)
        rc = skv_errorf(errno == ENOENT ? SKV_E_NOT_FOUND : SKV_E_IO, "%s: %s", path, strerror(errno));
    if (!rc && (fstat(st->fd, &sb) < 0 || !S_ISREG(sb.st_mode)))
        rc = skv_errorf(SKV_E_FORMAT, "%s is not a regular file", path);
    if (!rc)
        rc = read_at(st->fd, &hd, sizeof hd, 0);
    if (!rc && (memcmp(hd.magic, STORE_MAGIC, 8) != 0 || hd.version != STORE_VERSION))
        rc = skv_errorf(SKV_E_FORMAT, "%s is not a block store of version %d", path, STORE_VERSION);
    if (!rc && memcmp(hd.fingerprint, fingerprint, sizeof hd.fingerprint) != 0 &&
        !(legacy && memcmp(hd.fingerprint, legacy, sizeof hd.fingerprint) == 0))
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
    uint64_t n = n_named < 0 ? hd.n_blocks : (uint64_t)n_named, need = sizeof hd + n * (uint64_t)record_bytes(st);
    /* a manifest's count: the header counts at least those, and the file holds them (a save cut
     * short may have appended more); the header's own: exactly the file */
    if (!rc && (n >= UINT32_MAX - 1 || hd.n_blocks < n || (uint64_t)sb.st_size < need ||
                (n_named < 0 && (uint64_t)sb.st_size != need)))
        rc = skv_errorf(SKV_E_FORMAT, "%s: %llu blocks do not fill its %lld bytes", path, (unsigned long long)n,
                        (long long)sb.st_size);
    if (!rc) {
        st->hd.n_blocks = n;
        st->loaded = calloc(n ? n : 1, sizeof *st->loaded);
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

/* Reads block idx into st->buf (K then V), its checksum and values checked; *key: of its bytes. */
static int store_read(struct skv_kv_store *st, uint32_t idx, uint64_t *key)
{
    unsigned char want[STORE_SUM];
    int rc = read_at(st->fd, st->buf, record_bytes(st), record_at(st, idx));
    if (rc)
        return rc;
    record_sum(st->buf, (char *)st->buf + st->rows_bytes, st->rows_bytes, want);
    if (memcmp(want, (char *)st->buf + 2 * st->rows_bytes, sizeof want) != 0)
        return skv_errorf(SKV_E_FORMAT, "block store: block %u fails its checksum", idx);
    for (size_t i = 0; i < 2 * st->rows_bytes / sizeof(float); i++)
        if (!isfinite(st->buf[i]))
            return skv_errorf(SKV_E_FORMAT, "block store: block %u holds a value that is not finite", idx);
    *key = sum_key(want);
    return SKV_OK;
}

/* Whether a block of kv_type (f16 or q8_0) holds the record in st->buf unchanged: every value
 * an f16 value, or every 32 values (a q8_0 block: rows are whole blocks) bit for bit what their
 * quantization dequantizes to. */
static bool record_is_exact(const struct skv_kv_store *st, int kv_type)
{
    const size_t n = 2 * st->rows_bytes / sizeof(float);
    if (kv_type == SKV_DTYPE_F16) {
        for (size_t i = 0; i < n; i++)
            if (skv_fp16_to_f32(skv_f32_to_fp16(st->buf[i])) != st->buf[i])
                return false;
        return true;
    }
    uint8_t q[34];
    float back[32];
    for (size_t i = 0; i + 32 <= n; i += 32) {
        skv_quantize_row_q8_0(q, st->buf + i, 32);
        if (skv_dequantize_row(SKV_DTYPE_Q8_0, q, back, 32) || memcmp(back, st->buf + i, sizeof back) != 0)
            return false;
    }
    return true;
}

int skv_kv_store_get(struct skv_kv_store *st, uint32_t idx, int rows, uint64_t group, struct skv_kv_cache *c,
                     int layer, int h, bool *shared)
{
    *shared = false;
    if (st->writing)
        return skv_errorf(SKV_E_INVAL, "block store: opened to write");
    if (!rows_valid(st, rows))
        return skv_errorf(SKV_E_FORMAT, "block store: %d rows of a block of %u", rows, st->hd.block_rows);
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
    if (whole && l->b && l->group == group && skv_kv_pool_hold_if(st->pool, l->b, l->stamp)) {
        /* still held by a cache, unchanged: the session that read it was not evicted since */
        int rc = skv_kv_cache_append_block(c, layer, h, l->b);
        skv_kv_pool_put(st->pool, l->b);
        *shared = !rc;
        /* a partly filled block: the head's rows are its first `rows` (the cut keeps the block
         * and its stamp) */
        return rc ? rc : skv_kv_cache_truncate(c, layer, h, row0 + rows);
    }
    uint64_t key = 0;
    int rc = store_read(st, idx, &key);
    if (!rc)
        rc = skv_kv_cache_write_rows(c, layer, h, 0, row0, br, st->buf);
    if (!rc)
        rc = skv_kv_cache_write_rows(c, layer, h, 1, row0, br, (const float *)((char *)st->buf + st->rows_bytes));
    if (!rc)
        rc = skv_kv_cache_truncate(c, layer, h, row0 + rows);
    if (rc || !whole)
        return rc; /* rows: this cache's own */
    /* the block now holds record idx: a save that goes on from this store need not write it
     * (unless the record holds values an f16 or q8_0 block rounded: the block's own rows differ) */
    struct skv_kv_block *b = hd->blk[row0 / br];
    uint64_t bkey = block_key(st, b, rows);
    if (bkey && c->kv_type != SKV_DTYPE_F32 && !record_is_exact(st, c->kv_type))
        bkey = 0;
    if ((bkey && map_set(&st->last, bkey, idx, true)) || map_set(&st->by_content, key, idx, false))
        return SKV_E_NOMEM;
    if (l->b && skv_kv_pool_hold_if(st->pool, l->b, l->stamp)) {
        skv_kv_pool_put(st->pool, l->b);
        return SKV_OK; /* another group's block, still there: this one is this cache's own */
    }
    if (!st->pinned) { /* until drop_loaded: the blocks loaded[] names stay readable */
        st->pool = c->pool;
        skv_kv_pool_pin_slabs(st->pool);
        st->pinned = true;
    }
    l->b = b;
    l->stamp = b->stamp; /* this cache's block, written above: no other thread writes it */
    l->group = group;
    return SKV_OK;
}

static void drop_loaded(struct skv_kv_store *st)
{
    if (st->pinned)
        skv_kv_pool_unpin_slabs(st->pool);
    st->pinned = false;
    free(st->loaded);
    st->loaded = NULL;
}

int skv_kv_store_continue(struct skv_kv_store *st, const char *path, struct skv_kv_pool *pool)
{
    if (st->writing)
        return skv_errorf(SKV_E_INVAL, "block store: already writing");
    if (st->hd.block_rows != (uint32_t)skv_kv_pool_block_rows(pool) || (st->pool && st->pool != pool))
        return skv_errorf(SKV_E_INVAL, "block store: blocks of %u rows, the pool's are of %d", st->hd.block_rows,
                          skv_kv_pool_block_rows(pool));
    int fd = open(path, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return skv_errorf(SKV_E_IO, "%s: %s", path, strerror(errno));
    struct stat was, now; /* the file the restore read, not one put under its name since */
    if (fstat(st->fd, &was) < 0 || fstat(fd, &now) < 0 || was.st_dev != now.st_dev || was.st_ino != now.st_ino) {
        close(fd);
        return skv_errorf(SKV_E_IO, "%s is no longer the file the restore read", path);
    }
    close(st->fd);
    st->fd = fd;
    drop_loaded(st);
    /* what a save cut short appended after the blocks the manifest names goes */
    int rc = ftruncate(fd, record_at(st, st->hd.n_blocks)) == 0
                 ? SKV_OK
                 : skv_errorf(SKV_E_IO, "%s: %s", path, strerror(errno));
    if (!rc)
        rc = writer_start(st, pool);
    skv_kv_store_begin(st);
    for (size_t i = 0; !rc && i < st->last.cap; i++) /* the restored blocks are the live ones */
        if (st->last.keys[i])
            rc = mark_live(st, st->last.vals[i]);
    st->n_live_last = st->n_live;
    skv_kv_store_begin(st);
    if (rc)
        st->broken = true;
    return rc;
}

void skv_kv_store_close(struct skv_kv_store **st_p)
{
    struct skv_kv_store *st = st_p ? *st_p : NULL;
    if (!st)
        return;
    if (st->fd >= 0)
        close(st->fd);
    drop_loaded(st);
    map_free(&st->now);
    map_free(&st->last);
    map_free(&st->by_content);
    free(st->live);
    free(st->wbuf);
    free(st->buf);
    free(st->pad);
    free(st);
    *st_p = NULL;
}
