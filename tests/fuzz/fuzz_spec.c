/* libFuzzer target for compression specs and the layer allocators: any text either parses or
 * is refused with SKV_E_INVAL; a parsed spec formats to text that parses back to the same
 * canonical form; its budget for any prompt length is in [1, n]; PyramidKV's and
 * SqueezeAttention's layer budgets for it (similarities taken from the input) are in [1, n]
 * and SqueezeAttention keeps the total L * B whenever the prompt can hold it. Build:
 *   clang -fsanitize=fuzzer,address,undefined -I. tests/fuzz/fuzz_spec.c daemon/compress/spec.c \
 *         daemon/compress/pyramid.c daemon/compress/squeeze.c common/status.c common/utf8.c -lm -o fuzz_spec */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/status.h"
#include "daemon/compress/compress.h"
#include "daemon/compress/spec.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_LAYERS 64

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* input: spec text, a NUL, then bytes for the prompt length, layer count and similarities */
    const uint8_t *nul = memchr(data, '\0', size);
    size_t text_len = nul ? (size_t)(nul - data) : size;
    char text[1200];
    if (text_len >= sizeof text)
        return 0;
    memcpy(text, data, text_len);
    text[text_len] = '\0';
    const uint8_t *rest = nul ? nul + 1 : data + size;
    size_t rest_len = (size_t)(data + size - rest);

    struct skv_compress_spec spec, again;
    int rc = skv_compress_spec_parse(text, &spec);
    if (rc) {
        if (rc != SKV_E_INVAL || !*skv_error_msg())
            __builtin_trap();
        return 0;
    }
    char canon[512], canon2[512];
    if (skv_compress_spec_format(&spec, canon, sizeof canon) != SKV_OK)
        __builtin_trap();
    if (skv_compress_spec_parse(canon, &again) != SKV_OK)
        __builtin_trap();
    if (skv_compress_spec_format(&again, canon2, sizeof canon2) != SKV_OK || strcmp(canon, canon2) != 0)
        __builtin_trap();

    int n = 1;
    int L = 3;
    if (rest_len >= 4) {
        uint32_t v;
        memcpy(&v, rest, 4);
        n = (int)(v % (1u << 20)) + 1;
        rest += 4;
        rest_len -= 4;
    }
    if (rest_len >= 1) {
        L = rest[0] % MAX_LAYERS + 1;
        rest++;
        rest_len--;
    }
    int b = skv_compress_spec_budget(&spec, n);
    if (b < 1 || b > n)
        __builtin_trap();
    float sim[MAX_LAYERS];
    for (int l = 0; l < L; l++) {
        sim[l] = 0.5f;
        if (rest_len >= 4) {
            memcpy(&sim[l], rest, 4);
            rest += 4;
            rest_len -= 4;
        }
    }
    int out[MAX_LAYERS];
    skv_pyramid_budgets(L, b, spec.window, spec.pyramid_beta, n, out);
    for (int l = 0; l < L; l++)
        if (out[l] < 1 || out[l] > n)
            __builtin_trap();
    skv_squeeze_budgets(sim, L, b, spec.window, spec.p, n, out);
    long total = 0;
    for (int l = 0; l < L; l++) {
        if (out[l] < 1 || out[l] > n)
            __builtin_trap();
        total += out[l];
    }
    if (total != (long)L * b) /* L * b <= L * n always fits */
        __builtin_trap();
    return 0;
}
