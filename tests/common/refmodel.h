/* Test helpers for the model tests that compare compression with external references: the
 * default model in reference mode (weights dequantized to f32) on the CPU, token ids stored in
 * JSON fixtures, and one compressed prefill. */
#ifndef SKV_TEST_REFMODEL_H
#define SKV_TEST_REFMODEL_H

#include <jansson.h>
#include <stdint.h>

#include "daemon/compress/compress.h"
#include "daemon/engine/engine.h"
#include "kernels/backend.h"

struct refmodel {
    struct skv_backend *be;
    struct skv_model *m;
    struct skv_engine *e;
};

/* Loads the default model (fixture_model_path()) in reference mode; skips the test when the
 * model is not there. */
void refmodel_load(struct refmodel *r);
/* The same for the model at path (malloc'd, taken over; NULL: skip the test). */
void refmodel_load_path(struct refmodel *r, char *path);
/* The same in the engine's fast mode (the serving path: lower-precision activations), not its
 * reference mode. */
void refmodel_load_fast(struct refmodel *r, char *path);
void refmodel_free(struct refmodel *r);
/* The integers of a JSON array as token ids (malloc'd); *n gets the count. */
int32_t *refmodel_ids(const json_t *array, int *n);
/* Prefills ids into a new cache compressed with spec_text (begin, forward with the hook,
 * finish); the cache and the compressor are the caller's. */
void refmodel_prefill(struct refmodel *r, const char *spec_text, const int32_t *ids, int n,
                      struct skv_kv_cache **cache, struct skv_compressor **comp);

#endif
