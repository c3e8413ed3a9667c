/* UTF-8 well-formedness (Unicode table 3-7) and U+FFFD replacement. */
#include "common/utf8.h"

#include <stdlib.h>
#include <string.h>

size_t skv_utf8_char(const unsigned char *p, size_t avail, bool *partial, size_t *bad)
{
    *partial = false;
    *bad = 1;
    unsigned char c = p[0], lo = 0x80, hi = 0xBF; /* the second byte's range */
    size_t need;
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF)
        need = 2;
    else if (c >= 0xE0 && c <= 0xEF)
        need = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF; /* not overlong, no surrogate */
    else if (c >= 0xF0 && c <= 0xF4)
        need = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF; /* not overlong, <= U+10FFFF */
    else
        return 0;
    for (size_t k = 1; k < need; k++) {
        if (k >= avail) {
            *partial = true;
            return 0;
        }
        if (k == 1 ? p[k] < lo || p[k] > hi : (p[k] & 0xC0) != 0x80) {
            *bad = k;
            return 0;
        }
    }
    return need;
}

char *skv_utf8_fix(const char *s, size_t n, size_t *len_out)
{
    char *out = malloc(3 * n + 1); /* U+FFFD is 3 bytes and replaces at least 1 */
    if (!out)
        return NULL;
    const unsigned char *p = (const unsigned char *)s;
    size_t len = 0;
    for (size_t i = 0; i < n;) {
        bool partial;
        size_t bad, k = skv_utf8_char(p + i, n - i, &partial, &bad);
        if (k && p[i]) {
            memcpy(out + len, p + i, k);
            len += k;
            i += k;
        } else {
            memcpy(out + len, "\xEF\xBF\xBD", 3);
            len += 3;
            i += partial ? n - i : bad;
        }
    }
    out[len] = '\0';
    if (len_out)
        *len_out = len;
    return out;
}
