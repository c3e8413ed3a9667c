/* Retained prefixes: released full-cache sessions' KV kept for prefix reuse (see prefix_cache.h). */
#include "daemon/prefix_cache.h"
#include "common/status.h"
#include "daemon/engine/kv_pool.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool skv_prefix_cache_whole(const struct skv_kv_cache *c, int n_tokens)
{
    if (!c || n_tokens != c->n_past)
        return false;
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++)
        if (c->heads[i].len != c->n_past || (c->n_past > 0 && c->heads[i].pos[c->n_past - 1] != c->n_past - 1))
            return false;
    return true;
}

/* The cache's own marks in the blocks' scratch (skv_kv_block.mark; the session table's are
 * small numbers): the high bit and a count of walks. */
static uint64_t next_mark(struct skv_prefix_cache *pc)
{
    return (UINT64_C(1) << 63) | ++pc->marks;
}

static uint64_t block_bytes(const struct skv_prefix_cache *pc)
{
    return pc->head ? skv_kv_pool_block_bytes(pc->head->cache->pool) : 0;
}

/* Counts e's blocks as the entries' (skv_kv_block.kept): pc->bytes has each block the entries
 * hold once (entries that share a document's start share its blocks), by = +1 when e comes, -1
 * when it goes. */
static void count_blocks(struct skv_prefix_cache *pc, const struct skv_prefix_entry *e, int by)
{
    const uint64_t bb = skv_kv_pool_block_bytes(e->cache->pool);
    for (int i = 0; i < e->cache->n_layers * e->cache->n_kv_heads; i++)
        for (int b = 0; b < e->cache->heads[i].n_blocks; b++) {
            struct skv_kv_block *blk = e->cache->heads[i].blk[b];
            if (by > 0 && blk->kept++ == 0)
                pc->bytes += bb;
            else if (by < 0 && --blk->kept == 0)
                pc->bytes -= bb;
        }
}

/* Takes the entry at *link out of the list and the counts (it stays whole). */
static struct skv_prefix_entry *entry_unlink(struct skv_prefix_cache *pc, struct skv_prefix_entry **link)
{
    struct skv_prefix_entry *e = *link;
    *link = e->next;
    e->next = NULL;
    pc->n--;
    pc->host_bytes -= e->host_bytes;
    count_blocks(pc, e, -1);
    return e;
}

/* Puts an unlinked entry back first in the list and into the counts. */
static void entry_link(struct skv_prefix_cache *pc, struct skv_prefix_entry *e)
{
    e->next = pc->head;
    pc->head = e;
    pc->n++;
    pc->host_bytes += e->host_bytes;
    count_blocks(pc, e, +1);
}

/* Frees an unlinked entry, announcing it gone when it was announced. */
static void entry_destroy(struct skv_prefix_cache *pc, struct skv_prefix_entry *e)
{
    if (pc->on_drop && e->announced)
        pc->on_drop(pc->hook_user, e);
    skv_kv_cache_free(&e->cache);
    free(e->tokens);
    free(e);
}

static void entry_free(struct skv_prefix_cache *pc, struct skv_prefix_entry **link)
{
    entry_destroy(pc, entry_unlink(pc, link));
}

/* Puts back the entries of `list` (unlinked, chained by next). */
static void relink_all(struct skv_prefix_cache *pc, struct skv_prefix_entry *list)
{
    while (list) {
        struct skv_prefix_entry *next = list->next;
        entry_link(pc, list);
        list = next;
    }
}

/* Takes the entries of `list` (out of the list already, chained by next) out of the counts:
 * relink_all puts them back in both. */
static void uncount_all(struct skv_prefix_cache *pc, struct skv_prefix_entry *list)
{
    for (struct skv_prefix_entry *v = list; v; v = v->next) {
        pc->host_bytes -= v->host_bytes;
        count_blocks(pc, v, -1);
    }
}

/* Whether history a (na tokens) begins with history b (nb). */
static bool starts_with(const int32_t *a, int na, const int32_t *b, int nb)
{
    return nb <= na && memcmp(a, b, (size_t)nb * sizeof *a) == 0;
}

uint64_t skv_prefix_cache_rows_bytes(const struct skv_kv_cache *c, int rows)
{
    return (uint64_t)((rows + c->block_rows - 1) / c->block_rows) * (uint64_t)(c->n_layers * c->n_kv_heads) *
           skv_kv_pool_block_bytes(c->pool);
}

void skv_prefix_cache_touch(struct skv_prefix_cache *pc, struct skv_prefix_entry *e, uint64_t now_ms)
{
    e->last_used_ms = now_ms;
    e->used = ++pc->uses;
}

/* e's blocks not marked `mark` yet whose every holder is a kept prefix; marks them. */
static uint64_t kept_only_blocks(const struct skv_prefix_entry *e, uint64_t mark)
{
    uint64_t n = 0;
    for (int i = 0; i < e->cache->n_layers * e->cache->n_kv_heads; i++)
        n += skv_kv_pool_count_kept_only(e->cache->pool, e->cache->heads[i].blk, e->cache->heads[i].n_blocks, mark);
    return n;
}

uint64_t skv_prefix_entry_alone_bytes(struct skv_prefix_cache *pc, const struct skv_prefix_entry *e)
{
    return kept_only_blocks(e, next_mark(pc)) * skv_kv_pool_block_bytes(e->cache->pool);
}

uint64_t skv_prefix_cache_tenant_bytes(struct skv_prefix_cache *pc, const char *tenant, bool alone)
{
    uint64_t bytes = 0;
    if (!alone) { /* a bound: shared blocks count for each entry */
        for (const struct skv_prefix_entry *e = pc->head; e; e = e->next)
            bytes += !tenant || strcmp(e->tenant, tenant) == 0 ? e->bytes : 0;
        return bytes < pc->bytes ? bytes : pc->bytes;
    }
    const uint64_t mark = next_mark(pc);
    for (const struct skv_prefix_entry *e = pc->head; e; e = e->next)
        if (!tenant || strcmp(e->tenant, tenant) == 0)
            bytes += kept_only_blocks(e, mark);
    return bytes * block_bytes(pc);
}

/* The link to the entry to drop for room: the least recently used of the tenants holding more
 * than an equal share of the entries' bytes (their bytes over the tenants holding entries), so
 * that a tenant within its share loses nothing while another holds more; when none does (one
 * tenant, equal shares, no memory to count), the least recently used of all. */
static struct skv_prefix_entry **fair_victim(struct skv_prefix_cache *pc)
{
    bool one_tenant = true; /* then the least recently used of all, without a walk */
    for (const struct skv_prefix_entry *e = pc->head; e && one_tenant; e = e->next)
        one_tenant = strcmp(e->tenant, pc->head->tenant) == 0;
    if (one_tenant)
        return NULL;
    struct skv_tenant_tally u = {0};
    int rc = SKV_OK;
    const uint64_t mark = next_mark(pc), bb = block_bytes(pc);
    /* each tenant's distinct blocks (tenants share none) and its entries' own memory */
    for (const struct skv_prefix_entry *e = pc->head; e && !rc; e = e->next)
        rc = skv_tenant_tally_add(&u, e->tenant, skv_kv_cache_mark_new(e->cache, mark, mark) * bb + e->host_bytes);
    struct skv_prefix_entry **oldest = NULL;
    for (struct skv_prefix_entry **link = &pc->head; !rc && u.n > 1 && *link; link = &(*link)->next)
        if ((!oldest || (*link)->used < (*oldest)->used) &&
            skv_tenant_tally_bytes(&u, (*link)->tenant) > (pc->bytes + pc->host_bytes) / (uint64_t)u.n)
            oldest = link;
    skv_tenant_tally_free(&u);
    return oldest;
}

/* The link to the entry skv_prefix_cache_drop_lru drops (NULL: none). */
static struct skv_prefix_entry **victim_of(struct skv_prefix_cache *pc, const char *tenant)
{
    struct skv_prefix_entry **victim = tenant ? NULL : fair_victim(pc);
    if (!victim) /* the tenant's (or anyone's) least recently used */
        for (struct skv_prefix_entry **link = &pc->head; *link; link = &(*link)->next)
            if ((!tenant || strcmp((*link)->tenant, tenant) == 0) && (!victim || (*link)->used < (*victim)->used))
                victim = link;
    return victim;
}

bool skv_prefix_cache_drop_lru(struct skv_prefix_cache *pc, const char *tenant)
{
    struct skv_prefix_entry **victim = victim_of(pc, tenant);
    if (!victim)
        return false;
    entry_free(pc, victim);
    pc->dropped++;
    return true;
}

int skv_prefix_cache_add(struct skv_prefix_cache *pc, const char *tenant, const int32_t *tokens, int rows,
                         const struct skv_kv_cache *c, uint64_t tenant_room, uint64_t now_ms, const uint8_t *id)
{
    uint64_t bytes = skv_prefix_cache_rows_bytes(c, rows);
    if (!pc->cap || rows < c->block_rows || rows % c->block_rows || bytes > pc->cap || bytes > tenant_room)
        return SKV_OK;
    for (struct skv_prefix_entry *e = pc->head; e; e = e->next)
        if (strcmp(e->tenant, tenant) == 0 && starts_with(e->tokens, e->n_rows, tokens, rows)) {
            skv_prefix_cache_touch(pc, e, now_ms); /* it holds these rows already */
            return SKV_OK;
        }
    /* the entries the new one covers are set aside, and go only once it is in: when it cannot
     * be kept (no memory, or it is the one the cap drops) they come back as they were. Out of
     * the list first, still in the blocks' kept counts: the tenant's count below then has the
     * blocks they share with its other entries (each block's holders all kept prefixes) and
     * not those only they hold, as once they are gone */
    struct skv_prefix_entry *covered = NULL;
    for (struct skv_prefix_entry **link = &pc->head; *link;) {
        if (strcmp((*link)->tenant, tenant) == 0 && starts_with(tokens, rows, (*link)->tokens, (*link)->n_rows)) {
            struct skv_prefix_entry *e = *link;
            *link = e->next;
            pc->n--;
            e->next = covered;
            covered = e;
        } else {
            link = &(*link)->next;
        }
    }
    /* the tenant's own make room within its quota (what they hold alone, as the quota counts
     * them); the cap's room goes by share (below). Those that make room are set aside too, out
     * of the list and the counts, and go only once the new one stays: a new one not kept (no
     * memory, or the cap's own choice) dropped them for nothing */
    struct skv_prefix_entry *pushed = NULL, **victim;
    while (skv_prefix_cache_tenant_bytes(pc, tenant, true) + bytes > tenant_room && (victim = victim_of(pc, tenant))) {
        struct skv_prefix_entry *v = *victim; /* out of the list, in the counts (as `covered`) */
        *victim = v->next;
        pc->n--;
        v->next = pushed;
        pushed = v;
    }
    uncount_all(pc, covered); /* now out of the counts too */
    uncount_all(pc, pushed);
    struct skv_prefix_entry *e = calloc(1, sizeof *e);
    if (!e || !(e->tokens = malloc((size_t)rows * sizeof *e->tokens))) {
        free(e);
        relink_all(pc, pushed);
        relink_all(pc, covered);
        return SKV_E_NOMEM;
    }
    int rc = skv_kv_cache_clone_rows(c, rows, &e->cache);
    if (rc) {
        free(e->tokens);
        free(e);
        relink_all(pc, pushed);
        relink_all(pc, covered);
        return rc;
    }
    if (id)
        memcpy(e->id, id, sizeof e->id);
    else
        randombytes_buf(e->id, sizeof e->id);
    snprintf(e->tenant, sizeof e->tenant, "%s", tenant);
    memcpy(e->tokens, tokens, (size_t)rows * sizeof *e->tokens);
    e->n_rows = rows;
    e->bytes = skv_kv_cache_bytes(e->cache);
    e->host_bytes = sizeof *e + (uint64_t)rows * sizeof *e->tokens + skv_kv_cache_host_bytes(e->cache);
    if (e->host_bytes > pc->cap) { /* alone past the cap: it would push out every other first */
        entry_destroy(pc, e);
        relink_all(pc, pushed);
        relink_all(pc, covered);
        return SKV_OK;
    }
    skv_prefix_cache_touch(pc, e, now_ms);
    entry_link(pc, e);
    /* past the cap (the blocks, each once, or apart from them the entries' own memory): when the
     * new one is the one to go (its tenant over its share with nothing older), it goes
     * unannounced and those it pushed out and covers stay */
    while (pc->bytes > pc->cap || pc->host_bytes > pc->cap) {
        victim = victim_of(pc, NULL);
        struct skv_prefix_entry *v = entry_unlink(pc, victim);
        if (v == e) {
            entry_destroy(pc, e);
            relink_all(pc, pushed);
            relink_all(pc, covered);
            return SKV_OK;
        }
        v->next = pushed;
        pushed = v;
    }
    while (pushed) {
        struct skv_prefix_entry *next = pushed->next;
        entry_destroy(pc, pushed);
        pc->dropped++;
        pushed = next;
    }
    while (covered) { /* gone before the new one is announced, as before */
        struct skv_prefix_entry *next = covered->next;
        entry_destroy(pc, covered);
        pc->dropped++;
        covered = next;
    }
    e->announced = true;
    if (pc->on_add)
        pc->on_add(pc->hook_user, e);
    return SKV_OK;
}

int skv_prefix_cache_keep(struct skv_prefix_cache *pc, const struct skv_session *s, uint64_t tenant_room,
                          uint64_t now_ms)
{
    int rows = s->computed_rows < s->n_tokens ? s->computed_rows : s->n_tokens;
    rows -= rows % s->cache->block_rows;
    if (s->comp || !skv_prefix_cache_whole(s->cache, s->n_tokens))
        return SKV_OK;
    return skv_prefix_cache_add(pc, s->tenant, s->tokens, rows, s->cache, tenant_room, now_ms, NULL);
}

int skv_prefix_cache_expire(struct skv_prefix_cache *pc, uint64_t now_ms, uint64_t idle_ms)
{
    int n = 0;
    for (struct skv_prefix_entry **link = &pc->head; *link;)
        if (now_ms > (*link)->last_used_ms + idle_ms) {
            entry_free(pc, link);
            pc->dropped++;
            n++;
        } else {
            link = &(*link)->next;
        }
    return n;
}

struct skv_prefix_entry *skv_prefix_cache_find_id(struct skv_prefix_cache *pc, const uint8_t *id)
{
    for (struct skv_prefix_entry *e = pc->head; e; e = e->next)
        if (memcmp(e->id, id, sizeof e->id) == 0)
            return e;
    return NULL;
}

bool skv_prefix_cache_drop_id(struct skv_prefix_cache *pc, const uint8_t *id)
{
    for (struct skv_prefix_entry **link = &pc->head; *link; link = &(*link)->next)
        if (memcmp((*link)->id, id, sizeof (*link)->id) == 0) {
            entry_free(pc, link);
            return true;
        }
    return false;
}

int skv_prefix_cache_clear(struct skv_prefix_cache *pc, const char *tenant)
{
    int n = 0;
    for (struct skv_prefix_entry **link = &pc->head; *link;)
        if (!tenant || strcmp((*link)->tenant, tenant) == 0) {
            entry_free(pc, link);
            n++;
        } else {
            link = &(*link)->next;
        }
    return n;
}
