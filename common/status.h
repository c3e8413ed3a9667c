/* The project's one status enum: every internal function, every protocol reply and the
 * client library speak these codes. Negative is an error; SKV_OK is 0. */
#ifndef SKV_STATUS_H
#define SKV_STATUS_H

#include <stdarg.h>

enum skv_status {
    SKV_OK = 0,
    SKV_E_NOMEM = -1,       /* allocation failed */
    SKV_E_INVAL = -2,       /* bad argument or value */
    SKV_E_DEVICE = -3,      /* CUDA / cuBLAS / device failure */
    SKV_E_BUSY = -4,        /* queue full or resource in use */
    SKV_E_PROTO = -5,       /* malformed or unexpected message */
    SKV_E_IO = -6,          /* file or socket I/O failed */
    SKV_E_POOL_FULL = -7,   /* KV pool exhausted and nothing evictable */
    SKV_E_NOT_FOUND = -8,   /* unknown session, file, tensor or key */
    SKV_E_UNSUPPORTED = -9, /* valid request this build or model cannot serve */
    SKV_E_FORMAT = -10,     /* corrupt or truncated file */
    SKV_E_LIMIT = -11,      /* a configured limit was exceeded */
    SKV_E_PERM = -12,       /* permission denied (tenant, path) */
    SKV_E_VERSION = -13,    /* protocol or file version mismatch */
    SKV_E_CANCELLED = -14,  /* shut down or cancelled before completion */
    SKV_E_TIMEOUT = -15,    /* no answer in time */
    SKV_E_EXISTS = -16,     /* already exists / already running */
    SKV_E_INTERNAL = -17,   /* a bug: should never happen */
    SKV_E_UNAVAILABLE = -18, /* libsnapkv: every daemon it could use is down (never on the wire) */
};

#define SKV_STATUS_MIN SKV_E_UNAVAILABLE

/* Short stable name of a status ("ok", "invalid argument", ...); never NULL. */
const char *skv_status_str(int status);
/* Upper-case identifier ("SKV_E_INVAL"); never NULL. */
const char *skv_status_name(int status);

/* Thread-local detail message for the last error raised on this thread.
 * skv_errorf() formats it and returns `status`, so callers write
 *     return skv_errorf(SKV_E_FORMAT, "tensor %s: offset past end of file", name);
 * Library code never logs; the daemon logs or sends skv_error_msg() to clients. */
int skv_errorf(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int skv_verrorf(int status, const char *fmt, va_list ap);
const char *skv_error_msg(void);
void skv_error_clear(void);

#endif
