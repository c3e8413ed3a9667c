/* The tiny-llama fixture as a test group's state (tiny.h). */
#include "tests/common/tiny.h"

#include <stdlib.h>

#include "tests/common/fixture.h"

int tiny_setup(void **state)
{
    struct tiny *t = calloc(1, sizeof *t);
    if (!t)
        return -1;
    *state = t;
    t->dir = fixture_stage_dir("tests/fixtures/tiny-llama");
    if (!t->dir || skv_backend_cpu_new(2, &t->be) || skv_model_load(t->dir, t->be, NULL, &t->m) ||
        skv_engine_new(t->m, &t->e))
        return -1;
    t->n = 40;
    for (int i = 0; i < 64; i++)
        t->ids[i] = (int32_t)((i * 37 + 11) % t->m->cfg.n_vocab);
    return 0;
}

int tiny_teardown(void **state)
{
    struct tiny *t = *state;
    if (!t)
        return 0;
    skv_engine_free(&t->e);
    skv_model_free(&t->m);
    skv_backend_destroy(&t->be);
    if (t->dir)
        fixture_remove_dir(t->dir);
    free(t);
    return 0;
}
