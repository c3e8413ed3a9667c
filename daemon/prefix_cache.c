/* Retained prefixes: released full-cache sessions' KV kept for prefix reuse (see prefix_cache.h). */
#include "daemon/prefix_cache.h"
#include "common/status.h"
#include "daemon/engine/kv_pool.h"

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

static void entry_free(struct skv_prefix_cache *pc, struct skv_prefix_entry **link)
{
    struct skv_prefix_entry *e = *link;
    *link = e->next;
    pc->n--;
    pc->bytes -= e->bytes;
    skv_kv_cache_free(&e->cache);
    free(e->tokens);
    free(e);
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

int skv_prefix_cache_add(struct skv_prefix_cache *pc, const char *tenant, const int32_t *tokens, int rows,
                         const struct skv_kv_cache *c, uint64_t now_ms)
{
    uint64_t bytes = skv_prefix_cache_rows_bytes(c, rows);
    if (!pc->cap || rows < c->block_rows || rows % c->block_rows || bytes > pc->cap)
        return SKV_OK;
    for (struct skv_prefix_entry **link = &pc->head; *link;) {
        struct skv_prefix_entry *e = *link;
        if (strcmp(e->tenant, tenant) != 0) {
            link = &e->next;
        } else if (starts_with(e->tokens, e->n_rows, tokens, rows)) {
            e->last_used_ms = now_ms; /* it holds these rows already */
            return SKV_OK;
        } else if (starts_with(tokens, rows, e->tokens, e->n_rows)) {
            entry_free(pc, link); /* the new one covers it */
            pc->dropped++;
        } else {
            link = &e->next;
        }
    }
    struct skv_prefix_entry *e = calloc(1, sizeof *e);
    if (!e || !(e->tokens = malloc((size_t)rows * sizeof *e->tokens))) {
        free(e);
        return SKV_E_NOMEM;
    }
    int rc = skv_kv_cache_clone_rows(c, rows, &e->cache);
    if (rc) {
        free(e->tokens);
        free(e);
        return rc;
    }
    snprintf(e->tenant, sizeof e->tenant, "%s", tenant);
    memcpy(e->tokens, tokens, (size_t)rows * sizeof *e->tokens);
    e->n_rows = rows;
    e->bytes = skv_kv_cache_bytes(e->cache);
    e->last_used_ms = now_ms;
    e->next = pc->head;
    pc->head = e;
    pc->n++;
    pc->bytes += e->bytes;
    while (pc->bytes > pc->cap && skv_prefix_cache_drop_lru(pc))
        ;
    return SKV_OK;
}

int skv_prefix_cache_keep(struct skv_prefix_cache *pc, const struct skv_session *s, uint64_t now_ms)
{
    int rows = s->computed_rows < s->n_tokens ? s->computed_rows : s->n_tokens;
    rows -= rows % s->cache->block_rows;
    if (s->comp || !skv_prefix_cache_whole(s->cache, s->n_tokens))
        return SKV_OK;
    return skv_prefix_cache_add(pc, s->tenant, s->tokens, rows, s->cache, now_ms);
}

bool skv_prefix_cache_drop_lru(struct skv_prefix_cache *pc)
{
    struct skv_prefix_entry **oldest = NULL;
    for (struct skv_prefix_entry **link = &pc->head; *link; link = &(*link)->next)
        if (!oldest || (*link)->last_used_ms <= (*oldest)->last_used_ms)
            oldest = link;
    if (!oldest)
        return false;
    entry_free(pc, oldest);
    pc->dropped++;
    return true;
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
