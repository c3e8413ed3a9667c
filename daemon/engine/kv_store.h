/* The block store of a persist save: one file holding every full KV block the saved caches
 * hold, and the partly filled last blocks the caller gives it (a record per count of rows in
 * use), each written once however many caches share it (and once for blocks of equal bytes),
 * so a document and its forks are saved (and read back) at the document's size. Saved caches
 * name those blocks by their index in the store; a restore gives caches of one group that
 * named the same record one block again, shared as before the stop. Checkpoints append to the
 * store they wrote before and write only blocks they have not written (found by the blocks'
 * stamps and rows in use). Knows caches and the pool, no session. */
#ifndef SKV_KV_STORE_H
#define SKV_KV_STORE_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/engine/engine.h"

struct skv_kv_store;

/* A new store at `path` (created or truncated) for the blocks of `pool` (which must outlive
 * it), of the model with fingerprint (64 hex digits). A store lives across saves: each save
 * appends the blocks it has not written before (checkpoints write what changed). */
int skv_kv_store_create(const char *path, const char *fingerprint, struct skv_kv_pool *pool,
                        struct skv_kv_store **out);
/* Starts a save: the blocks it names (skv_kv_store_find, skv_kv_store_put) are its live ones. */
void skv_kv_store_begin(struct skv_kv_store *st);
/* True, with its index, when the store holds b's first `rows` rows (1..block_rows: a head's
 * last block may be partly filled) already: b was named with that count in this save, or in
 * the last one that ended well, and has not been written since (its stamp, kv_pool.h). */
bool skv_kv_store_find(struct skv_kv_store *st, const struct skv_kv_block *b, int rows, uint32_t *idx);
/* The index of b's first `rows` rows (b of the store's pool) in the store: as
 * skv_kv_store_find, or that of a record with the same bytes (checked byte for byte);
 * otherwise k and v (those rows of K and of V, host memory) are appended as a new record,
 * zero rows after them up to block_rows. */
int skv_kv_store_put(struct skv_kv_store *st, const struct skv_kv_block *b, int rows, const float *k, const float *v,
                     uint32_t *idx);
/* Writes what is buffered and the header, and fsyncs: every block named so far is on disk. */
int skv_kv_store_finish(struct skv_kv_store *st);
/* The save ends: ok (its manifest is on disk): the blocks it named are the ones later saves
 * find; otherwise those of both the last save and this one. */
void skv_kv_store_end(struct skv_kv_store *st, bool ok);
/* Blocks in the file, blocks this save appended, and distinct blocks the last save that ended
 * well named (the rest of the file is blocks no session holds any more). */
uint32_t skv_kv_store_blocks(const struct skv_kv_store *st);
uint32_t skv_kv_store_appended(const struct skv_kv_store *st);
uint32_t skv_kv_store_live(const struct skv_kv_store *st);
/* The file's bytes with its blocks; those this save appended. */
uint64_t skv_kv_store_bytes(const struct skv_kv_store *st);
uint64_t skv_kv_store_appended_bytes(const struct skv_kv_store *st);
/* Rows per block of the store (a reader: as it was written). */
int skv_kv_store_block_rows(const struct skv_kv_store *st);
/* True when more of the store's blocks are no session's (not named by the last save that ended
 * well) than are, and at least min_garbage of them: a new store would be smaller. */
bool skv_kv_store_mostly_garbage(const struct skv_kv_store *st, uint32_t min_garbage);
/* False after a write failed (the file's end is unknown) or once the file was removed: the
 * store must not be used again. */
bool skv_kv_store_usable(const struct skv_kv_store *st);

/* Opens the store at `path` to read; SKV_E_FORMAT / SKV_E_INVAL when it is not one, is cut
 * short, or was written for another model: one whose fingerprint is neither `fingerprint` nor
 * `legacy` (NULL: none; the model's name as an earlier daemon wrote it), and the store, written
 * on, says `fingerprint` from then on. n_named: the blocks the manifest says it holds
 * (what a save appended after them, cut short by a crash, is ignored); -1: the header's count,
 * which must fill the file. Blocks of another block_rows than the caches' (kv-block-tokens
 * changed across the restart) are read as rows, never shared. */
int skv_kv_store_open(const char *path, const char *fingerprint, const char *legacy, int block_rows, int head_dim,
                      int64_t n_named, struct skv_kv_store **out);
/* Appends the first `rows` rows of block idx (1..the store's block_rows: a head's last block
 * may be partly filled) to head h of `layer` as its next rows. The first cache of `group` to
 * name idx gets it read from the file (its checksum and finite values checked) into a block of
 * its own, which the store then holds; later caches of that group share that block (*shared
 * set), partly filled too, as forks did before the save. Caches of other groups (tenants,
 * which must not share) get their own copies, and so do caches whose blocks have another size. */
int skv_kv_store_get(struct skv_kv_store *st, uint32_t idx, int rows, uint64_t group, struct skv_kv_cache *c,
                     int layer, int h, bool *shared);
/* A store read by a restore goes on as a writer (at `path`, for `pool`): the blocks the restore
 * gave caches count as written, so the next save appends only what changed after the start.
 * Drops the blocks it held. SKV_E_INVAL when its blocks have another size than the pool's. */
int skv_kv_store_continue(struct skv_kv_store *st, const char *path, struct skv_kv_pool *pool);
/* Closes the file and drops the blocks the store holds. Accepts NULL and *st_p == NULL. */
void skv_kv_store_close(struct skv_kv_store **st_p);

#endif
