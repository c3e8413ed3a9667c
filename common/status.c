/* Status names and the thread-local error detail behind skv_errorf(). */
#include "common/status.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "common/utf8.h"

static const struct {
    int code;
    const char *name;
    const char *text;
} status_table[] = {
    {SKV_OK, "SKV_OK", "ok"},
    {SKV_E_NOMEM, "SKV_E_NOMEM", "out of memory"},
    {SKV_E_INVAL, "SKV_E_INVAL", "invalid argument"},
    {SKV_E_DEVICE, "SKV_E_DEVICE", "device error"},
    {SKV_E_BUSY, "SKV_E_BUSY", "busy"},
    {SKV_E_PROTO, "SKV_E_PROTO", "protocol error"},
    {SKV_E_IO, "SKV_E_IO", "i/o error"},
    {SKV_E_POOL_FULL, "SKV_E_POOL_FULL", "kv pool full"},
    {SKV_E_NOT_FOUND, "SKV_E_NOT_FOUND", "not found"},
    {SKV_E_UNSUPPORTED, "SKV_E_UNSUPPORTED", "unsupported"},
    {SKV_E_FORMAT, "SKV_E_FORMAT", "bad format"},
    {SKV_E_LIMIT, "SKV_E_LIMIT", "limit exceeded"},
    {SKV_E_PERM, "SKV_E_PERM", "permission denied"},
    {SKV_E_VERSION, "SKV_E_VERSION", "version mismatch"},
    {SKV_E_CANCELLED, "SKV_E_CANCELLED", "cancelled"},
    {SKV_E_TIMEOUT, "SKV_E_TIMEOUT", "timed out"},
    {SKV_E_EXISTS, "SKV_E_EXISTS", "already exists"},
    {SKV_E_INTERNAL, "SKV_E_INTERNAL", "internal error"},
    {SKV_E_UNAVAILABLE, "SKV_E_UNAVAILABLE", "unavailable"},
};

static _Thread_local char error_msg[512];

const char *skv_status_str(int status)
{
    for (size_t i = 0; i < sizeof status_table / sizeof status_table[0]; i++)
        if (status_table[i].code == status)
            return status_table[i].text;
    return "unknown status";
}

const char *skv_status_name(int status)
{
    for (size_t i = 0; i < sizeof status_table / sizeof status_table[0]; i++)
        if (status_table[i].code == status)
            return status_table[i].name;
    return "SKV_E_UNKNOWN";
}

/* The message goes out in replies' `string` fields, which must be UTF-8: a name a client or a
 * file gave (a GGUF's metadata, a path) may not be, and %.64s or the buffer's end may cut a
 * character. Each byte of an ill-formed part becomes '?', a character cut at the end is dropped. */
static void make_text(char *s)
{
    size_t n = strlen(s);
    for (size_t i = 0; i < n;) {
        bool partial;
        size_t bad, len = skv_utf8_char((const unsigned char *)s + i, n - i, &partial, &bad);
        if (len) {
            i += len;
        } else if (partial) {
            s[i] = '\0';
            return;
        } else {
            memset(s + i, '?', bad);
            i += bad;
        }
    }
}

int skv_verrorf(int status, const char *fmt, va_list ap)
{
    vsnprintf(error_msg, sizeof error_msg, fmt, ap);
    make_text(error_msg);
    return status;
}

int skv_errorf(int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    skv_verrorf(status, fmt, ap);
    va_end(ap);
    return status;
}

const char *skv_error_msg(void)
{
    return error_msg;
}

void skv_error_clear(void)
{
    error_msg[0] = '\0';
}
