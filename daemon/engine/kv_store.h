/* The block store of a persist save: one file holding every full KV block the saved caches
 * hold, each written once however many caches share it (and once for blocks of equal bytes),
 * so a document and its forks are saved (and read back) at the document's size. Saved caches
 * name their full blocks by their index in the store; a restore gives caches of one group that
 * named the same block one block again, shared as before the stop. Knows caches and the pool,
 * no session. */
#ifndef SKV_KV_STORE_H
#define SKV_KV_STORE_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/engine/engine.h"

struct skv_kv_store;

/* A new store at `path` (created or truncated) for the blocks of `pool` (which must outlive
 * it), of the model with fingerprint (64 hex digits). */
int skv_kv_store_create(const char *path, const char *fingerprint, struct skv_kv_pool *pool,
                        struct skv_kv_store **out);
/* The index of block b (of the store's pool, alive until the store is finished) in the store:
 * when b was put before, or a block with the same bytes (checked byte for byte), that
 * block's index; otherwise k and v (b's block_rows rows of K and of V, host memory) are
 * written as a new block. */
int skv_kv_store_put(struct skv_kv_store *st, const struct skv_kv_block *b, const float *k, const float *v,
                     uint32_t *idx);
/* Blocks in the store so far (written or read), and the file's bytes with them. */
uint32_t skv_kv_store_blocks(const struct skv_kv_store *st);
uint64_t skv_kv_store_bytes(const struct skv_kv_store *st);
/* Rows per block of the store (a reader: as it was written). */
int skv_kv_store_block_rows(const struct skv_kv_store *st);
/* Writes the header, flushes and fsyncs: the store is complete. */
int skv_kv_store_finish(struct skv_kv_store *st);

/* Opens the store at `path` to read; SKV_E_FORMAT / SKV_E_INVAL when it is not one, is cut
 * short, or was written for another model. Blocks of another block_rows than the caches'
 * (kv-block-tokens changed across the restart) are read as rows, never shared. */
int skv_kv_store_open(const char *path, const char *fingerprint, int block_rows, int head_dim,
                      struct skv_kv_store **out);
/* Appends block idx to head h of `layer` as its next rows (the store's block_rows of them).
 * The first cache of `group` to name idx gets it read from the file (its checksum and finite
 * values checked) into a block of its own, which the store then holds; later caches of that
 * group share that block (*shared set). Caches of other groups (tenants, which must not share)
 * get their own copies, and so do caches whose blocks have another size. */
int skv_kv_store_get(struct skv_kv_store *st, uint32_t idx, uint64_t group, struct skv_kv_cache *c, int layer, int h,
                     bool *shared);
/* Closes the file and drops the blocks the store holds. Accepts NULL and *st_p == NULL. */
void skv_kv_store_close(struct skv_kv_store **st_p);

#endif
