/* Rendezvous (highest random weight) placement of keys over several daemons (docs/SCALING.md
 * section 1): every process given the same endpoint names, in any order, sends a key to the
 * same daemon, and when one endpoint leaves the list only that endpoint's keys move. */
#include "libclient/client_internal.h"

#include <sodium.h>
#include <stdlib.h>
#include <string.h>

#define PLACE_MAX_ENDPOINTS 4096

/* Endpoint e's weight for key: the first 8 bytes, little-endian, of the 16-byte BLAKE2b of e,
 * a NUL byte and the key (snapkv.h gives the same in Python). */
uint64_t skv_client_place_weight(const char *e, const void *key, size_t key_len)
{
    crypto_generichash_state st;
    unsigned char out[16];
    crypto_generichash_init(&st, NULL, 0, sizeof out);
    crypto_generichash_update(&st, (const unsigned char *)e, strlen(e) + 1);
    if (key_len)
        crypto_generichash_update(&st, key, key_len);
    crypto_generichash_final(&st, out, sizeof out);
    uint64_t w = 0;
    for (int i = 7; i >= 0; i--)
        w = w << 8 | out[i];
    return w;
}

bool skv_client_place_before(uint64_t wa, const char *a, uint64_t wb, const char *b)
{
    /* (equal weights: the lower name, so that the order of the list does not matter) */
    return wa > wb || (wa == wb && strcmp(a, b) < 0);
}

static int name_cmp(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

int skv_client_check_names(const char *const *names, size_t n, size_t max, const char *what)
{
    if (n == 0 || n > max)
        return skv_client_fail(SNAPKV_E_INVAL, "%s: %zu endpoints (from 1 to %zu)", what, n, max);
    for (size_t i = 0; i < n; i++)
        if (!names[i] || !*names[i])
            return skv_client_fail(SNAPKV_E_INVAL, "%s: endpoint %zu is empty", what, i);
    /* a name twice: found among the names sorted (a copy) */
    const char **sorted = malloc(n * sizeof *sorted);
    if (!sorted)
        return skv_client_fail(SNAPKV_E_NOMEM, "%s: out of memory", what);
    memcpy(sorted, names, n * sizeof *sorted);
    qsort(sorted, n, sizeof *sorted, name_cmp);
    for (size_t i = 1; i < n; i++)
        if (strcmp(sorted[i], sorted[i - 1]) == 0) {
            int rc = skv_client_fail(SNAPKV_E_INVAL, "%s: endpoint '%s' is listed twice", what, sorted[i]);
            free(sorted);
            return rc;
        }
    free(sorted);
    return SNAPKV_OK;
}

int snapkv_place(const char *const *endpoints, size_t n, const void *key, size_t key_len, size_t *index)
{
    if (!endpoints || !index || (!key && key_len))
        return skv_client_fail(SNAPKV_E_INVAL, "snapkv_place: NULL argument");
    int rc = skv_client_check_names(endpoints, n, PLACE_MAX_ENDPOINTS, "snapkv_place");
    if (rc)
        return rc;
    if (sodium_init() < 0)
        return skv_client_fail(SNAPKV_E_INTERNAL, "snapkv_place: libsodium did not start");
    size_t best = 0;
    uint64_t best_w = skv_client_place_weight(endpoints[0], key, key_len);
    for (size_t i = 1; i < n; i++) {
        uint64_t w = skv_client_place_weight(endpoints[i], key, key_len);
        if (skv_client_place_before(w, endpoints[i], best_w, endpoints[best])) {
            best = i;
            best_w = w;
        }
    }
    *index = best;
    return SNAPKV_OK;
}
