/* The CPU get_rows op: gathers rows of a table (the token embedding, any supported dtype)
 * into f32, out[i][:] = dequant(table row ids[i]); parallel over i for large batches. */
#include <stdint.h>

#include "common/status.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/quant.h"

/* Below this many output elements the gather runs on the calling thread. */
#define SKV_GET_ROWS_PARALLEL_MIN (64 * 1024)

struct gr_job {
    float *out;                  /* [n][cols] */
    const uint8_t *data;         /* the table, rows x row_bytes */
    const int32_t *ids;          /* [n], validated */
    size_t row_bytes;
    int64_t cols;
    int type;
};

static void gr_task(void *arg, int64_t begin, int64_t end, int thread_id)
{
    const struct gr_job *job = arg;
    (void)thread_id;
    for (int64_t i = begin; i < end; i++)
        skv_dequantize_row(job->type, job->data + (size_t)job->ids[i] * job->row_bytes,
                           job->out + i * job->cols, job->cols);
}

int skv_cpu_get_rows(struct skv_backend *be, float *out, const struct skv_tensor *table,
                     const int32_t *ids, int n)
{
    if (be == NULL || table == NULL || n < 0 || (n > 0 && (out == NULL || ids == NULL)))
        return skv_errorf(SKV_E_INVAL, "get_rows: bad arguments");
    const char *name = table->name != NULL ? table->name : "?";
    if (table->ndim < 1 || table->ndim > 4)
        return skv_errorf(SKV_E_INVAL, "get_rows: table %s has %d dimensions", name, table->ndim);
    const int64_t cols = table->ne[0];
    int64_t rows = 1;
    for (int d = 1; d < table->ndim && rows <= INT32_MAX; d++)
        rows = table->ne[d] > 0 && table->ne[d] <= INT32_MAX ? rows * table->ne[d] : 0;
    if (cols <= 0 || rows <= 0 || rows > INT32_MAX)
        return skv_errorf(SKV_E_INVAL, "get_rows: table %s has a bad shape", name);
    if (!skv_quant_supported(table->type))
        return skv_errorf(SKV_E_UNSUPPORTED, "get_rows: table %s has unsupported type %d", name,
                          table->type);
    const size_t row_bytes = skv_dtype_row_bytes(table->type, cols);
    if (row_bytes == 0)
        return skv_errorf(SKV_E_INVAL, "get_rows: table %s: %lld columns do not fill blocks",
                          name, (long long)cols);
    if (table->data == NULL || table->nbytes < (size_t)rows * row_bytes)
        return skv_errorf(SKV_E_INVAL, "get_rows: table %s holds %zu bytes, needs %zu", name,
                          table->nbytes, (size_t)rows * row_bytes);
    /* The caller validates ids; a bad one here would read outside the table, so check. */
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= rows)
            return skv_errorf(SKV_E_INVAL, "get_rows: id %d out of range [0, %lld) of %s",
                              (int)ids[i], (long long)rows, name);

    struct gr_job job = {
        .out = out, .data = table->data, .ids = ids, .row_bytes = row_bytes, .cols = cols,
        .type = table->type,
    };
    if ((int64_t)n * cols < SKV_GET_ROWS_PARALLEL_MIN)
        gr_task(&job, 0, n, 0);
    else
        skv_cpu_parallel_for(be, n, 1, gr_task, &job);
    return SKV_OK;
}
