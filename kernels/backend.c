/* Backend selection by name ("auto", "cpu", "cuda") and the one destructor every backend
 * shares. The chosen backend's name is in be->name; callers that want the reason CUDA was
 * not taken call skv_backend_cuda_new() themselves. */
#include <string.h>

#include "common/status.h"
#include "kernels/backend.h"

int skv_backend_open(const char *name, int n_threads, struct skv_backend **out)
{
    if (!name || !out)
        return skv_errorf(SKV_E_INVAL, "backend: NULL name or out");
    if (strcmp(name, "cpu") == 0)
        return skv_backend_cpu_new(n_threads, out);
    if (strcmp(name, "cuda") == 0)
        return skv_backend_cuda_new(0, out);
    if (strcmp(name, "auto") == 0) {
        if (skv_backend_cuda_compiled() && skv_backend_cuda_new(0, out) == SKV_OK)
            return SKV_OK;
        skv_error_clear();
        return skv_backend_cpu_new(n_threads, out);
    }
    return skv_errorf(SKV_E_INVAL, "unknown backend '%s' (auto, cpu or cuda)", name);
}

void skv_backend_destroy(struct skv_backend **be_p)
{
    if (!be_p || !*be_p)
        return;
    (*be_p)->ops->destroy(*be_p);
    *be_p = NULL;
}
