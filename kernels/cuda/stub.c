/* Stands in for the CUDA backend when the build has no CUDA: the constructor reports that
 * it is not compiled in, so "auto" falls back to the CPU and "cuda" fails clearly. */
#include <stdbool.h>

#include "common/status.h"
#include "kernels/backend.h"

int skv_backend_cuda_new(int device, struct skv_backend **out)
{
    (void)device;
    (void)out;
    return skv_errorf(SKV_E_UNSUPPORTED, "CUDA backend not compiled in (configure --with-cuda)");
}

bool skv_backend_cuda_compiled(void)
{
    return false;
}
