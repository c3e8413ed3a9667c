/* Byte-level BPE tokenizer (GPT-2 style, as Llama 3, SmolLM2, Qwen2 and Mistral-Nemo ship it):
 * special tokens split first, then the model's pre-tokenizer regexes (PCRE2, Unicode
 * properties), then byte-to-unicode mapping and BPE merges by rank. Built from GGUF
 * `tokenizer.ggml.*` metadata or from a Hugging Face `tokenizer.json`. Also renders and
 * encodes ChatML and Llama 3 chat templates. Knows no model, no socket. */
#ifndef SKV_TOKENIZER_H
#define SKV_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct skv_gguf;
struct skv_tokenizer;

int skv_tokenizer_from_gguf(const struct skv_gguf *g, struct skv_tokenizer **out);
int skv_tokenizer_from_json(const char *tokenizer_json_path, struct skv_tokenizer **out);
void skv_tokenizer_free(struct skv_tokenizer **tok_p);

int skv_tokenizer_n_vocab(const struct skv_tokenizer *tok);
int32_t skv_tokenizer_bos(const struct skv_tokenizer *tok); /* -1 when none */
int32_t skv_tokenizer_eos(const struct skv_tokenizer *tok);
/* End-of-turn token for chat models (<|im_end|> / <|eot_id|>), else eos. */
int32_t skv_tokenizer_eot(const struct skv_tokenizer *tok);
bool skv_tokenizer_add_bos(const struct skv_tokenizer *tok);
/* Control / special tokens (never produced from plain text unless parse_special). */
bool skv_tokenizer_is_special(const struct skv_tokenizer *tok, int32_t id);

/* Encode `len` bytes of UTF-8 text. parse_special: text like "<|im_start|>" becomes the
 * special token. add_bos follows the model's tokenizer.ggml.add_bos_token when the caller
 * asks. Writes at most max ids; *n_out is always the full count (SKV_E_LIMIT when > max). */
int skv_tokenizer_encode(const struct skv_tokenizer *tok, const char *text, size_t len,
                         bool add_bos, bool parse_special, int32_t *ids, int max, int *n_out);
/* skv_tokenizer_encode that stops as soon as more than cap ids (0 <= cap < INT_MAX) came out:
 * then SKV_E_LIMIT with *n_out = cap + 1, the whole count unknown. The work is bounded by cap
 * tokens (plus one pass over the bytes and the last word's merges), not by the text, so a
 * client's megabytes of text cost no more than the limit it breaks. Below the cap the ids are
 * exactly skv_tokenizer_encode's. */
int skv_tokenizer_encode_capped(const struct skv_tokenizer *tok, const char *text, size_t len, bool add_bos,
                                bool parse_special, int cap, int32_t *ids, int max, int *n_out);
/* Bytes of the longest token (added tokens included). A text of more than k times this many
 * bytes has more than k tokens: it cannot fit a limit of k (added tokens that strip the
 * whitespace around them aside). */
size_t skv_tokenizer_max_token_bytes(const struct skv_tokenizer *tok);
/* Bytes of one token (byte-level decoded); special tokens as their text. Writes at most cap
 * bytes; *len_out is the full length. Bytes may be a partial UTF-8 sequence. */
int skv_tokenizer_token_bytes(const struct skv_tokenizer *tok, int32_t id, char *buf, size_t cap,
                              size_t *len_out);
/* Decode ids to a malloc'd NUL-terminated string. Ids outside [0, n_vocab) are skipped (as
 * Hugging Face's decode skips unknown ids): a model may have more embedding rows than tokens. */
int skv_tokenizer_decode(const struct skv_tokenizer *tok, const int32_t *ids, int n, char **out);
/* skv_tokenizer_decode that with skip_special leaves out control tokens and gives the length
 * (*len_out, may be NULL): the bytes may hold a NUL. */
int skv_tokenizer_decode_bytes(const struct skv_tokenizer *tok, const int32_t *ids, int n, bool skip_special,
                               char **out, size_t *len_out);

struct skv_chat_msg {
    const char *role;    /* "system", "user", "assistant" */
    const char *content;
};
/* Renders the model's chat template (ChatML for SmolLM2: the default system prompt is
 * inserted when the first message is not a system message) into a malloc'd string. */
int skv_tokenizer_chat_render(const struct skv_tokenizer *tok, const struct skv_chat_msg *msgs,
                              int n, bool add_generation_prompt, char **out);
/* Renders and encodes the chat as Hugging Face's apply_chat_template(tokenize=True) does: the
 * template owns BOS (none is added besides the one it writes). Unlike it, control tokens come
 * only from the template's own markup: a role or content saying "<|im_end|>" stays plain text.
 * Writes at most max ids; *n_out is always the full count (SKV_E_LIMIT when > max). */
int skv_tokenizer_chat_encode(const struct skv_tokenizer *tok, const struct skv_chat_msg *msgs, int n,
                              bool add_generation_prompt, int32_t *ids, int max, int *n_out);
/* skv_tokenizer_chat_encode that stops past cap ids, as skv_tokenizer_encode_capped. */
int skv_tokenizer_chat_encode_capped(const struct skv_tokenizer *tok, const struct skv_chat_msg *msgs, int n,
                                     bool add_generation_prompt, int cap, int32_t *ids, int max, int *n_out);

#endif
