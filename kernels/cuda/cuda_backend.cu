/* The CUDA backend's entry points: device probing, device memory, copies. The op table's
 * compute entries are not implemented yet (issue 6), so a probe that finds a device still
 * returns SKV_E_UNSUPPORTED and `--backend auto` falls back to the CPU, saying why. */
#include "kernels/cuda/common.cuh"

extern "C" {
#include "kernels/backend.h"
}

#include <stdlib.h>

struct cuda_impl {
    int device;
    cudaStream_t stream;
    cublasHandle_t blas;
};

static int cuda_alloc(struct skv_backend *be, size_t bytes, void **out)
{
    (void)be;
    void *p = NULL;
    SKV_CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 1));
    *out = p;
    return SKV_OK;
}

static void cuda_free(struct skv_backend *be, void *ptr)
{
    (void)be;
    if (ptr)
        cudaFree(ptr);
}

static int cuda_upload(struct skv_backend *be, void *dst, const void *src, size_t bytes)
{
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    SKV_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, impl->stream));
    return SKV_OK;
}

static int cuda_download(struct skv_backend *be, void *dst, const void *src, size_t bytes)
{
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    SKV_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, impl->stream));
    SKV_CUDA_CHECK(cudaStreamSynchronize(impl->stream));
    return SKV_OK;
}

static int cuda_copy_2d(struct skv_backend *be, void *dst, size_t dst_stride, const void *src,
                        size_t src_stride, size_t row_bytes, int64_t n_rows)
{
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    SKV_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_stride, src, src_stride, row_bytes, (size_t)n_rows,
                                     cudaMemcpyDeviceToDevice, impl->stream));
    return SKV_OK;
}

static int cuda_sync(struct skv_backend *be)
{
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    SKV_CUDA_CHECK(cudaStreamSynchronize(impl->stream));
    return SKV_OK;
}

static void cuda_destroy(struct skv_backend *be)
{
    struct cuda_impl *impl = (struct cuda_impl *)be->impl;
    if (impl) {
        if (impl->blas)
            cublasDestroy(impl->blas);
        if (impl->stream)
            cudaStreamDestroy(impl->stream);
        free(impl);
    }
    free(be);
}

static const struct skv_backend_ops cuda_ops = {
    /* destroy */ cuda_destroy,
    /* alloc */ cuda_alloc,
    /* free */ cuda_free,
    /* upload */ cuda_upload,
    /* download */ cuda_download,
    /* copy_2d */ cuda_copy_2d,
    /* sync */ cuda_sync,
};

/* Probes the device and sets up a stream and cuBLAS handle; *out gets a backend whose
 * compute ops are still missing, so callers must not run a model on it yet. */
static int cuda_probe(int device, struct skv_backend **out)
{
    int count = 0;
    SKV_CUDA_CHECK(cudaGetDeviceCount(&count));
    if (device < 0 || device >= count)
        return skv_errorf(SKV_E_DEVICE, "CUDA device %d not present (%d found)", device, count);
    SKV_CUDA_CHECK(cudaSetDevice(device));
    struct skv_backend *be = (struct skv_backend *)calloc(1, sizeof *be);
    struct cuda_impl *impl = (struct cuda_impl *)calloc(1, sizeof *impl);
    if (!be || !impl) {
        free(be);
        free(impl);
        return SKV_E_NOMEM;
    }
    be->name = "cuda";
    be->ops = &cuda_ops;
    be->impl = impl;
    impl->device = device;
    cudaError_t err = cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking);
    cublasStatus_t bst = err == cudaSuccess ? cublasCreate(&impl->blas) : CUBLAS_STATUS_NOT_INITIALIZED;
    if (err != cudaSuccess || bst != CUBLAS_STATUS_SUCCESS) {
        cuda_destroy(be);
        return err != cudaSuccess
                   ? skv_errorf(SKV_E_DEVICE, "%s:%d: %s", __FILE__, __LINE__, cudaGetErrorName(err))
                   : skv_errorf(SKV_E_DEVICE, "%s:%d: cuBLAS: %s", __FILE__, __LINE__, cublasGetStatusName(bst));
    }
    cublasSetStream(impl->blas, impl->stream);
    *out = be;
    return SKV_OK;
}

extern "C" int skv_backend_cuda_new(int device, struct skv_backend **out)
{
    struct skv_backend *be = NULL;
    int rc = cuda_probe(device, &be);
    if (rc)
        return rc;
    cuda_destroy(be);
    return skv_errorf(SKV_E_UNSUPPORTED, "CUDA device %d answers, but the CUDA op table is not "
                                         "implemented in this build yet", device);
}

extern "C" bool skv_backend_cuda_compiled(void)
{
    return true;
}
