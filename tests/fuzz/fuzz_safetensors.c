/* libFuzzer target for the safetensors reader: the input is written as model.safetensors in
 * a scratch directory (under /dev/shm when it exists) and opened. It either opens or fails with
 * a message; when it opens, every tensor's bytes are read (so any range the validator let
 * through is touched), lookups by name find the same tensor, and the byte count is dtype x
 * shape. Build and run with scripts/fuzz; seed with tests/fixtures/tiny-llama. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/status.h"
#include "daemon/engine/safetensors.h"
#include "kernels/backend.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char g_dir[64], g_file[96];

static void cleanup(void)
{
    unlink(g_file);
    rmdir(g_dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    snprintf(g_dir, sizeof g_dir, "%s/skv-fuzz-st-XXXXXX", access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp");
    if (!mkdtemp(g_dir))
        exit(1);
    snprintf(g_file, sizeof g_file, "%s/model.safetensors", g_dir);
    atexit(cleanup);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    FILE *f = fopen(g_file, "wb");
    if (!f || fwrite(data, 1, size, f) != size || fclose(f) != 0)
        __builtin_trap();
    struct skv_safetensors *st = NULL;
    int rc = skv_safetensors_open_dir(g_dir, &st);
    if (rc != SKV_OK) {
        if (rc > 0 || !*skv_error_msg() || st)
            __builtin_trap();
        return 0;
    }
    unsigned acc = 0;
    for (int64_t i = 0; i < skv_safetensors_n_tensors(st); i++) {
        const struct skv_tensor *t = skv_safetensors_tensor(st, i);
        if (!t || skv_safetensors_find(st, t->name) != t)
            __builtin_trap();
        int64_t rows = t->ne[1] * t->ne[2] * t->ne[3];
        size_t bytes = (size_t)rows * skv_dtype_row_bytes(t->type, t->ne[0]);
        if (bytes != t->nbytes)
            __builtin_trap();
        const uint8_t *p = t->data;
        if (bytes)
            acc += p[0] + p[bytes - 1];
    }
    if (skv_safetensors_tensor(st, skv_safetensors_n_tensors(st)) != NULL)
        __builtin_trap();
    skv_safetensors_close(&st);
    if (st)
        __builtin_trap();
    return (int)(acc & 0);
}
