/* Shared CUDA helpers: the check macro that turns every CUDA / cuBLAS failure into
 * SKV_E_DEVICE with file, line and the error's name. */
#ifndef SKV_CUDA_COMMON_CUH
#define SKV_CUDA_COMMON_CUH

#include <cublas_v2.h>
#include <cuda_runtime.h>

extern "C" {
#include "common/status.h"
}

#define SKV_CUDA_CHECK(expr)                                                                       \
    do {                                                                                           \
        cudaError_t err_ = (expr);                                                                 \
        if (err_ != cudaSuccess) {                                                                 \
            (void)cudaGetLastError(); /* not left for the next launch's check (another request) */ \
            return skv_errorf(err_ == cudaErrorMemoryAllocation ? SKV_E_NOMEM : SKV_E_DEVICE,   \
                              "%s:%d: %s: %s", __FILE__, __LINE__, cudaGetErrorName(err_),        \
                              cudaGetErrorString(err_));                                           \
        }                                                                                          \
    } while (0)

#define SKV_CUBLAS_CHECK(expr)                                                                     \
    do {                                                                                           \
        cublasStatus_t st_ = (expr);                                                               \
        if (st_ != CUBLAS_STATUS_SUCCESS) {                                                        \
            (void)cudaGetLastError(); /* a failed launch inside cuBLAS: not the next request's */  \
            return skv_errorf(SKV_E_DEVICE, "%s:%d: cuBLAS: %s", __FILE__, __LINE__,               \
                              cublasGetStatusName(st_));                                           \
        }                                                                                          \
    } while (0)

#endif
