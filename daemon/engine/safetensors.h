/* Hugging Face safetensors reader, the tensor side of the HF folder loader: mmaps
 * dir/model.safetensors, or every shard named by dir/model.safetensors.index.json, validates
 * each JSON header against its file and exposes the tensors as skv_tensor views into the maps.
 * Corrupt input is an SKV_E_FORMAT (or _UNSUPPORTED / _LIMIT) status naming the file and the
 * tensor, never a crash. config.json and tokenizer.json are read elsewhere. */
#ifndef SKV_SAFETENSORS_H
#define SKV_SAFETENSORS_H

#include <stdint.h>

#include "kernels/backend.h"

/* Limits on what a file may ask for. */
#define SKV_SAFETENSORS_MAX_HEADER ((uint64_t)100 << 20) /* JSON header bytes per file */
#define SKV_SAFETENSORS_MAX_INDEX ((uint64_t)100 << 20)  /* model.safetensors.index.json */
#define SKV_SAFETENSORS_MAX_SHARDS 4096

struct skv_safetensors;

/* Opens dir/model.safetensors when it exists, else dir/model.safetensors.index.json and the
 * shards its weight_map names (plain file names in dir: no '/' and no ".."). Each tensor
 * must have dtype F32, F16 or BF16 (others: SKV_E_UNSUPPORTED naming the tensor), at most 4
 * dims, data_offsets inside the file that match dtype x shape, no overlap with another tensor,
 * and data aligned to its element size. A name in two shards, or an index entry whose shard
 * does not hold it, is SKV_E_FORMAT. Neither file in dir: SKV_E_NOT_FOUND.
 * "__metadata__" is ignored. *out is written only on success. */
int skv_safetensors_open_dir(const char *dir, struct skv_safetensors **out);
/* Unmaps everything; accepts NULL and *st_p == NULL; sets *st_p to NULL. */
void skv_safetensors_close(struct skv_safetensors **st_p);

/* Tensors in file order: shard by shard (shard names sorted), by data offset within a file.
 * ne[] is in GGUF order (innermost first: the safetensors shape reversed; unused dims are 1,
 * a 0-dim scalar has ndim 1, ne[0] 1); data points into the read-only map (never write
 * through it); name is a NUL-terminated copy owned by st. Valid until close.
 * skv_safetensors_tensor returns NULL when i is out of range; find returns NULL for an
 * unknown name. */
int64_t skv_safetensors_n_tensors(const struct skv_safetensors *st);
const struct skv_tensor *skv_safetensors_tensor(const struct skv_safetensors *st, int64_t i);
const struct skv_tensor *skv_safetensors_find(const struct skv_safetensors *st, const char *name);

#endif
