/* Implementation of skv_log(): level names, the output stream and its reopening. */
#include "common/log.h"
#include "common/status.h"
#include "common/utf8.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int skv_log_level_current = SKV_LOG_INFO;

static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static FILE *log_stream;
static char *log_path;

static const char *const level_names[] = {"error", "warn", "info", "debug"};

int skv_log_level_parse(const char *name)
{
    for (int i = 0; i < 4; i++)
        if (name && strcmp(name, level_names[i]) == 0)
            return i;
    return -1;
}

const char *skv_log_level_name(int level)
{
    return level >= 0 && level < 4 ? level_names[level] : "?";
}

void skv_log_set_level(int level)
{
    if (level >= SKV_LOG_ERROR && level <= SKV_LOG_DEBUG)
        skv_log_level_current = level;
}

int skv_log_open(const char *path)
{
    pthread_mutex_lock(&log_lock);
    free(log_path);
    log_path = path ? strdup(path) : NULL;
    pthread_mutex_unlock(&log_lock);
    return skv_log_reopen();
}

/* The new file is opened before the old one is closed: when it cannot be, logging goes on
 * to the old one and the caller reports why. */
int skv_log_reopen(void)
{
    int rc = SKV_OK;
    pthread_mutex_lock(&log_lock);
    FILE *f = NULL;
    /* a new file is the daemon user's alone (the service's umask lets its group, every client,
     * read): the log names tenants and sessions; a file that is there keeps its mode */
    int fd = log_path ? open(log_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600) : -1;
    int err = errno;
    if (fd >= 0 && !(f = fdopen(fd, "a"))) {
        err = errno;
        close(fd);
    }
    if (log_path && !f)
        rc = skv_errorf(SKV_E_IO, "%s: %s", log_path, strerror(err));
    else {
        if (f)
            setvbuf(f, NULL, _IOLBF, 0);
        if (log_stream && log_stream != stderr)
            fclose(log_stream);
        log_stream = f;
    }
    pthread_mutex_unlock(&log_lock);
    return rc;
}

void skv_log_write(int level, const char *file, int line, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* one line per message: a control character in what a message quotes (a client's name, a
     * path) cannot start a line that looks like another message; and a line of text: bytes
     * that are not UTF-8 (a client's name, a character the 1024 bytes cut) became a line
     * journald keeps as "[blob data]", out of sight */
    size_t n = strlen(msg);
    for (size_t i = 0; i < n;) {
        unsigned char *p = (unsigned char *)msg + i;
        bool partial = false;
        size_t bad = 0, k = skv_utf8_char(p, n - i, &partial, &bad);
        if (k == 0 && partial) { /* cut at the end */
            *p = '\0';
            break;
        }
        bool ill = k == 0; /* (bad is set on success too) */
        if (ill)
            k = bad;
        if (ill || *p < 0x20 || *p == 0x7f || (k == 2 && *p == 0xc2 && p[1] < 0xa0)) /* C1 controls too */
            memset(p, '?', k);
        i += k;
    }

    pthread_mutex_lock(&log_lock);
    FILE *out = log_stream ? log_stream : stderr;
    if (log_stream) {
        char ts[32];
        time_t now = time(NULL);
        struct tm tm;
        localtime_r(&now, &tm);
        strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
        fprintf(out, "%s ", ts);
    }
    /* sd-daemon priority prefix so journald keeps the level */
    static const int prio[] = {3, 4, 6, 7};
    if (!log_stream)
        fprintf(out, "<%d>", prio[level < 0 ? 0 : level > 3 ? 3 : level]);
    if (level == SKV_LOG_DEBUG)
        fprintf(out, "%s: %s (%s:%d)\n", level_names[level], msg, file, line);
    else
        fprintf(out, "%s: %s\n", skv_log_level_name(level), msg);
    pthread_mutex_unlock(&log_lock);
}

int skv_log_allow(struct skv_log_limit *l, unsigned long long now_ms, unsigned long long *suppressed)
{
    if (l->started && now_ms - l->last_ms < SKV_LOG_LIMIT_MS) {
        l->held++;
        return 0;
    }
    *suppressed = l->held;
    l->held = 0;
    l->last_ms = now_ms;
    l->started = 1;
    return 1;
}
