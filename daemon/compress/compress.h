/* Compression of a sequence's KV cache, run as the engine's layer hook: right after a
 * layer's attention, the layer's rows are scored by the sequence policy (SnapKV, H2O,
 * StreamingLLM, sliding window) and cut to the layer's budget (uniform, PyramidKV or
 * SqueezeAttention allocation), per KV head or with one top-k over the layer's heads.
 * So at most one layer's full KV exists during a prefill (memory-lean). Knows no socket. */
#ifndef SKV_COMPRESS_H
#define SKV_COMPRESS_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/compress/spec.h"
#include "daemon/engine/engine.h"

struct skv_compressor;

/* A compressor for one sequence (a session): spec checked against the model. */
int skv_compressor_new(const struct skv_compress_spec *spec, const struct skv_model *m,
                       struct skv_compressor **out);
void skv_compressor_free(struct skv_compressor **c_p);
/* A copy with the same spec and decided budgets (for FORK). */
int skv_compressor_clone(const struct skv_compressor *src, struct skv_compressor **out);
const struct skv_compress_spec *skv_compressor_spec(const struct skv_compressor *c);

/* Prepares a compressing forward of n tokens onto `cache` (whose rows before the forward stay
 * candidates too: an appended question can re-compress a kept document). The budget comes
 * from the sequence length after the forward. Then run the engine with
 *     opts.hook = skv_compressor_hook, opts.hook_user = c
 * and call skv_compressor_finish() after it (SqueezeAttention trims there). */
/* Before COMPRESS runs the tokens from position `cut` on again with c: H2O must count each
 * query once, so when the session's previous spec was H2O too (was_h2o) the rows before `cut`
 * keep their sums and only the re-run rows gather the re-run queries' attention; after another
 * policy its scores mean something else and every row starts from 0. Others: nothing. */
void skv_compressor_rerun(struct skv_compressor *c, struct skv_kv_cache *cache, bool was_h2o, int cut);
int skv_compressor_begin(struct skv_compressor *c, struct skv_kv_cache *cache, int n);
/* The KV blocks an empty cache holds once a compressing forward of n tokens has cut each layer
 * to its budget (SqueezeAttention: the capped upper one it keeps until the allocation is known;
 * head granularity: the layer's rows over heads of any lengths; at most the tokens): what to
 * make room for before such a forward. */
int64_t skv_compressor_prefill_blocks(const struct skv_compressor *c, const struct skv_kv_cache *cache, int n);
int skv_compressor_hook(void *user, const struct skv_layer_view *view);
int skv_compressor_finish(struct skv_compressor *c, struct skv_kv_cache *cache);

/* Decode-time upkeep: call before each decoding forward (run with the hook too). H2O and
 * StreamingLLM / window keep evicting to their budget (or decode_budget) every token. SnapKV
 * with decode_budget keeps the post-RoPE queries of the newest min(window, decode_budget)
 * decoded tokens per layer; each time `interval` more tokens were decoded since the last
 * compressing forward, a layer holding more than decode_budget rows per head (head
 * granularity: decode_budget * Hkv over its heads) is re-scored by those queries exactly as a
 * prefill window scores the prompt and cut to decode_budget, the newest min(window,
 * decode_budget) rows always kept, and its memory beyond min(interval, decode_budget) rows of
 * room goes back. Right after a compression the window holds the tokens decoded so far (down
 * to one). SnapKV without decode_budget never evicts while decoding. decode_budget is the mean
 * over the layers: with a PyramidKV or SqueezeAttention allocation layer l keeps
 * decode_budget * b_l / mean(b) rows (b: the prefill's layer budgets; total conserved), so
 * the allocation holds while decoding (the window then min(window, decode_budget, that)). */
int skv_compressor_begin_decode(struct skv_compressor *c, struct skv_kv_cache *cache);
/* After skv_compressor_begin_decode, before a forward of n tokens: the memory the upkeep hook
 * needs (SnapKV's query ring, the scores, the selection's rows), so that none is allocated
 * inside the forward, where a failure would fail every session of a decode group. SKV_E_NOMEM
 * / the backend's status when there is none. */
int skv_compressor_decode_reserve(struct skv_compressor *c, const struct skv_kv_cache *cache, int n, bool defer);
/* With defer (H2O, StreamingLLM, window, SnapKV's re-scoring), the hook of the forward that
 * follows records each layer and cuts nothing: skv_compressor_hook_done (the forward's `done`,
 * with the compressor as its user) cuts them all once the whole forward succeeded, so that one
 * failing part way leaves every layer as it was; the same rows are kept as cut layer by layer.
 * A caller that sets defer must set that `done`. */
void skv_compressor_hook_done(void *user, struct skv_kv_cache *cache);
/* Whether the decode hook scores a step by the attention's probabilities (H2O): a decode
 * forward's skv_forward_opts.attention_probs, so that the engine hands them over instead of
 * the hook computing them again (attention_colsum). */
bool skv_compressor_wants_probs(const struct skv_compressor *c);
/* What the daemon runs before a decode forward of n tokens (one, or a short APPEND's):
 * skv_compressor_begin_decode, skv_compressor_decode_reserve(defer) and fo's hook, its
 * attention_probs and done.
 * For tools and tests, so that they decode as the daemon does. */
int skv_compressor_begin_step(struct skv_compressor *c, struct skv_kv_cache *cache, int n, bool defer,
                              struct skv_forward_opts *fo);
/* Layers whose cut at a forward's end failed (no memory for fresh blocks, a device error) since
 * the last call, which resets the count: each stays valid (whole, or some of its heads cut),
 * over its budget, until a later cut (the next token; SnapKV's next re-scoring). */
int skv_compressor_take_cut_failures(struct skv_compressor *c);
/* Whether a forward outside compression (APPEND, DECODE) leaves every row the cache holds as it
 * was: true for snapkv without a decode_budget (it keeps all until a COMPRESS), false when the
 * decode upkeep evicts rows or adds to their scores (h2o, streaming, window, decode_budget).
 * Such a forward can be undone (stopped part way) without changing the session. */
bool skv_compressor_decode_keeps_rows(const struct skv_compressor *c);

/* Backend memory the compressor may hold for its session beyond the cache: SnapKV re-scoring's
 * observation ring (L x min(window, decode_budget) queries at query-head width, allocated at
 * the first decoded token), counted whether allocated yet or not, so a tenant's quota holds it
 * from the PREFILL on. */
uint64_t skv_compressor_bytes(const struct skv_compressor *c);
/* The same, 0 while the ring is not allocated (c may be NULL): what a copy of the compressor
 * (skv_compressor_clone) holds besides its session's count. */
uint64_t skv_compressor_ring_bytes(const struct skv_compressor *c);

/* What the last compression decided: budget per layer (length n_layers) and SqueezeAttention
 * similarities (NULL unless alloc=squeeze). */
const int *skv_compressor_layer_budgets(const struct skv_compressor *c);
const float *skv_compressor_similarity(const struct skv_compressor *c);
int skv_compressor_budget(const struct skv_compressor *c);

/* A compressor's decided state as bytes, for SAVE / LOAD: the budget, the sequence length,
 * whether it is decoding, the layer budgets, the decode budgets and the SqueezeAttention
 * similarities (what decoding under the same spec needs), and for SnapKV re-scoring
 * (decode_budget) the queries of its observation window and where its `interval` count
 * stands, so a loaded session re-scores when and as the saved one would. The rows' scores
 * (H2O's accumulated attention) live in the cache. state_size: what state_write writes now for
 * the session's cache of n_past tokens; state_max: the most it can be for n_past tokens. */
size_t skv_compressor_state_size(const struct skv_compressor *c, int n_past);
size_t skv_compressor_state_max(const struct skv_compressor *c, int n_past);
int skv_compressor_state_write(struct skv_compressor *c, int n_past, void *buf);
/* Restores what state_write wrote for a compressor of the same spec and model, on a cache of
 * n_past tokens; SKV_E_FORMAT when the bytes do not fit them. A state without the observation
 * (written before it was saved) starts the window again with the next decoded token. */
int skv_compressor_state_read(struct skv_compressor *c, const void *buf, size_t len, int n_past);

/* ---- policy pieces (also unit-tested on their own) ---------------------------------------- */

/* Layer budgets for PyramidKV (KVCache-Factory's schedule): B per layer on average,
 * window w, beta; n prompt tokens. */
void skv_pyramid_budgets(int n_layers, int budget, int window, int beta, int n, int *out);
/* SqueezeAttention: KMeans(3) on sim[0..L); the cluster with the highest mean similarity
 * gets w + p * (B - w) per layer (w = min(window, B): the rows the sequence policy always
 * keeps, 0 for streaming / window), the others share the rest so that the total stays L * B;
 * a layer holds at most n, and what it cannot hold goes back to the others. */
void skv_squeeze_budgets(const float *sim, int n_layers, int budget, int window, double p, int n, int *out);

#endif
