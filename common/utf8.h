/* UTF-8 checks shared by the daemon (streamed token text) and the tools (JSON output): which
 * bytes are well-formed, and text made well-formed the way Hugging Face's decode makes it
 * (Rust's from_utf8_lossy: each maximal ill-formed part becomes one U+FFFD). */
#ifndef SKV_UTF8_H
#define SKV_UTF8_H

#include <stdbool.h>
#include <stddef.h>

/* The length (1..4) of the well-formed character at p, `avail` bytes there (avail >= 1). 0 when
 * the bytes there start none: then *bad is how many of them make the ill-formed part (at least
 * 1), or *partial is set when they are a valid start of a character that runs past avail. */
size_t skv_utf8_char(const unsigned char *p, size_t avail, bool *partial, size_t *bad);

/* n bytes of s as well-formed UTF-8 with no NUL inside: each ill-formed part, a character cut
 * at the end included, and each NUL becomes U+FFFD. malloc'd and NUL-terminated, *len_out (may
 * be NULL) its length; NULL when out of memory. */
char *skv_utf8_fix(const char *s, size_t n, size_t *len_out);

#endif
