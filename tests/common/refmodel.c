/* See refmodel.h. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>

#include "common/status.h"
#include "tests/common/fixture.h"
#include "tests/common/refmodel.h"

void refmodel_load(struct refmodel *r)
{
    refmodel_load_path(r, fixture_model_path());
}

static void load(struct refmodel *r, char *path, bool reference)
{
    if (!path)
        skip();
    *r = (struct refmodel){0};
    struct skv_model_opts mo = {.reference = reference};
    assert_int_equal(skv_backend_cpu_new(0, &r->be), SKV_OK);
    assert_int_equal(skv_model_load(path, r->be, &mo, &r->m), SKV_OK);
    assert_int_equal(skv_engine_new(r->m, &r->e), SKV_OK);
    free(path);
}

void refmodel_load_path(struct refmodel *r, char *path)
{
    load(r, path, true);
}

void refmodel_load_fast(struct refmodel *r, char *path)
{
    load(r, path, false);
}

void refmodel_free(struct refmodel *r)
{
    skv_engine_free(&r->e);
    skv_model_free(&r->m);
    skv_backend_destroy(&r->be);
}

int32_t *refmodel_ids(const json_t *array, int *n)
{
    *n = (int)json_array_size(array);
    int32_t *ids = malloc((size_t)(*n > 0 ? *n : 1) * sizeof *ids);
    assert_non_null(ids);
    for (int i = 0; i < *n; i++)
        ids[i] = (int32_t)json_integer_value(json_array_get(array, (size_t)i));
    return ids;
}

void refmodel_prefill(struct refmodel *r, const char *spec_text, const int32_t *ids, int n,
                      struct skv_kv_cache **cache, struct skv_compressor **comp)
{
    struct skv_compress_spec spec;
    assert_int_equal(skv_compress_spec_parse(spec_text, &spec), SKV_OK);
    assert_int_equal(skv_compressor_new(&spec, r->m, comp), SKV_OK);
    assert_int_equal(skv_kv_cache_new(r->m, cache), SKV_OK);
    assert_int_equal(skv_compressor_begin(*comp, *cache, n), SKV_OK);
    struct skv_forward_opts fo = {.hook = skv_compressor_hook, .hook_user = *comp};
    assert_int_equal(skv_engine_forward(r->e, *cache, ids, n, &fo, NULL), SKV_OK);
    assert_int_equal(skv_compressor_finish(*comp, *cache), SKV_OK);
}
