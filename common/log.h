/* Daemon-side logging: a level check before any argument is evaluated, one line per call,
 * to stderr (journald adds the timestamp) or to a file reopened on SIGHUP.
 * Library code (libclient, engine, kernels) never logs; it returns a status instead. */
#ifndef SKV_LOG_H
#define SKV_LOG_H

enum skv_log_level {
    SKV_LOG_ERROR = 0,
    SKV_LOG_WARN = 1,
    SKV_LOG_INFO = 2,
    SKV_LOG_DEBUG = 3,
};

extern int skv_log_level_current;

#define skv_log(level, ...)                                                                   \
    do {                                                                                      \
        if ((level) <= skv_log_level_current)                                                 \
            skv_log_write((level), __FILE__, __LINE__, __VA_ARGS__);                          \
    } while (0)

void skv_log_write(int level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* "error", "warn", "info", "debug" -> level; returns -1 when unknown. */
int skv_log_level_parse(const char *name);
const char *skv_log_level_name(int level);
void skv_log_set_level(int level);
/* Lines a client can cause (an eviction per PREFILL, a spill that failed per eviction, a
 * connection closed): one a window at most, the others counted and named in the next.
 * skv_log_allow: whether a line goes now (at now_ms, any clock that does not go back); when it
 * does, *suppressed gets how many were held back since the last one. Zero-initialised. */
#define SKV_LOG_LIMIT_MS 10000
struct skv_log_limit {
    unsigned long long last_ms;
    unsigned long long held;
    int started;
};
int skv_log_allow(struct skv_log_limit *l, unsigned long long now_ms, unsigned long long *suppressed);

/* Log to `path` (NULL: stderr). Returns SKV_OK or SKV_E_IO (skv_error_msg() says why). */
int skv_log_open(const char *path);
/* Reopens the log file (SIGHUP, after logrotate moved it): SKV_E_IO when the file cannot be
 * opened, and logging goes on to the file already open. */
int skv_log_reopen(void);

#endif
