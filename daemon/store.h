/* The shared store for cold sessions (store = redis://HOST[:PORT][/DB] or unix://PATH): one
 * connection to Redis or Valkey through hiredis, made when first needed and again after a
 * failure (not within a second of one), with a timeout on every call. Knows keys and bytes,
 * not sessions (requests.c spills and loads them). Not thread-safe: the worker thread owns it. */
#ifndef SKV_STORE_H
#define SKV_STORE_H

#include <stddef.h>
#include <stdint.h>

struct skv_store;

/* Parses url (SKV_E_INVAL with a message naming what is wrong); connects nothing yet. */
int skv_store_new(const char *url, int timeout_ms, struct skv_store **out);
void skv_store_free(struct skv_store **st_p);

/* SET key value EX ttl_s. SKV_E_IO when the store cannot be reached or refuses it. */
int skv_store_put(struct skv_store *st, const char *key, const void *data, size_t n, int64_t ttl_s);
/* GETDEL key: the value (malloc'd, the caller frees it) is removed from the store as it is read,
 * so two hosts never take one. SKV_E_NOT_FOUND when there is none, also without asking the
 * store when the same key missed within the last second; SKV_E_IO as above. */
int skv_store_take(struct skv_store *st, const char *key, void **data, size_t *n);

struct skv_store_stats {
    uint64_t spills, spill_bytes, spill_failures; /* puts that took, their bytes, puts that failed */
    uint64_t loads, misses, load_failures;        /* takes that found a value, none, or failed */
};
void skv_store_stats(const struct skv_store *st, struct skv_store_stats *out);
/* The url without what follows it (for messages). */
const char *skv_store_url(const struct skv_store *st);

#endif
