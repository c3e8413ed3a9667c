/* libFuzzer target for the tokenizer on a real model's vocabulary (what a client's PREFILL
 * text goes through). The first input byte picks the options, the rest is the text, any bytes.
 * Properties: encoding never fails on any bytes (invalid UTF-8 goes through byte tokens);
 * every id is in the vocabulary; decoding the ids gives back exactly the input bytes (the
 * vocabulary is byte-level), less the bytes that have no token of their own (SmolLM2's lacks
 * 0x04, 0xC0, 0xF5..0xFF and a few more, which Hugging Face tokenizers drops too); the count does not depend on the output capacity; a too-small
 * output gives SKV_E_LIMIT with the full count. Option bit 1 also renders the input as a chat
 * message and encodes that with special tokens. Build (and run) with scripts/fuzz; the model is
 * $SKV_FUZZ_MODEL, default models/SmolLM2-135M-Instruct.Q4_1.gguf. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "daemon/engine/gguf.h"
#include "daemon/engine/tokenizer.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_TEXT 4096

static struct skv_tokenizer *g_tok;
static bool g_dropped[256]; /* bytes the vocabulary has no token for */

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    const char *path = getenv("SKV_FUZZ_MODEL");
    if (!path || !*path)
        path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    struct skv_gguf *g = NULL;
    if (skv_gguf_open(path, &g) != SKV_OK || skv_tokenizer_from_gguf(g, &g_tok) != SKV_OK) {
        fprintf(stderr, "fuzz_tokenizer: %s: %s\n", path, skv_error_msg());
        exit(1);
    }
    skv_gguf_close(&g);
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        int32_t id;
        int n = -1;
        if (skv_tokenizer_encode(g_tok, &c, 1, false, false, &id, 1, &n) != SKV_OK || n > 1)
            __builtin_trap();
        g_dropped[b] = n == 0;
    }
    return 0;
}

/* Encodes text and checks the properties above; returns the ids (malloc'd) in *ids_out. */
static int encode_checked(const char *text, size_t len, bool special, int32_t **ids_out)
{
    int cap = (int)len + 8;
    int32_t *ids = malloc((size_t)cap * sizeof *ids);
    int n = -1;
    if (!ids)
        __builtin_trap();
    if (skv_tokenizer_encode(g_tok, text, len, false, special, ids, cap, &n) != SKV_OK)
        __builtin_trap(); /* any bytes encode */
    if (n < 0 || n > (int)len)
        __builtin_trap();
    int vocab = skv_tokenizer_n_vocab(g_tok);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab)
            __builtin_trap();
    if (n > 1) {
        int32_t small[1];
        int n2 = -1;
        if (skv_tokenizer_encode(g_tok, text, len, false, special, small, 1, &n2) != SKV_E_LIMIT || n2 != n)
            __builtin_trap();
    }
    *ids_out = ids;
    return n;
}

static void check_roundtrip(const char *text, size_t len, bool special)
{
    int32_t *ids = NULL;
    int n = encode_checked(text, len, special, &ids);
    char *back = NULL;
    if (skv_tokenizer_decode(g_tok, ids, n, &back) != SKV_OK)
        __builtin_trap();
    /* decode gives a NUL-terminated string: compare up to the input's first NUL */
    char *want = malloc(len + 1);
    size_t k = 0;
    if (!want)
        __builtin_trap();
    for (size_t i = 0; i < len && text[i]; i++)
        if (!g_dropped[(uint8_t)text[i]])
            want[k++] = text[i];
    if (strlen(back) != k || memcmp(back, want, k) != 0)
        __builtin_trap();
    free(want);
    free(back);
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size - 1 > MAX_TEXT)
        return 0;
    uint8_t opt = data[0];
    const char *text = (const char *)data + 1;
    size_t len = size - 1;

    check_roundtrip(text, len, false);
    if (opt & 1) {
        /* parse_special turns "<|im_start|>" etc. into one token, decoded as the same text */
        check_roundtrip(text, len, true);
    }
    if (opt & 2) {
        char *content = strndup(text, len);
        if (!content)
            __builtin_trap();
        struct skv_chat_msg msg[2] = {{"system", "You are terse."}, {"user", content}};
        char *rendered = NULL;
        if (skv_tokenizer_chat_render(g_tok, msg + ((opt & 4) ? 0 : 1), (opt & 4) ? 2 : 1, opt & 8,
                                      &rendered) != SKV_OK)
            __builtin_trap();
        if (!strstr(rendered, content))
            __builtin_trap();
        int32_t *ids = NULL;
        encode_checked(rendered, strlen(rendered), true, &ids);
        free(ids);
        free(rendered);
        free(content);
    }
    return 0;
}
