/* The tiny random-weight Llama fixture (tests/fixtures/tiny-llama) as a cmocka group state:
 * staged, loaded on a 2-thread CPU backend, with an engine and 64 fixed token ids. */
#ifndef SKV_TEST_TINY_H
#define SKV_TEST_TINY_H

#include <stdint.h>

#include "daemon/engine/engine.h"
#include "daemon/engine/model.h"
#include "kernels/backend.h"

struct tiny {
    char *dir;
    struct skv_backend *be;
    struct skv_model *m;
    struct skv_engine *e;
    int32_t ids[64];   /* (i * 37 + 11) % n_vocab */
    int n;             /* the group's prompt length (40) */
};

/* cmocka group setup / teardown: *state becomes / was a struct tiny. */
int tiny_setup(void **state);
int tiny_teardown(void **state);

#endif
