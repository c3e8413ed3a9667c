/* The shared store's connection and its calls (see store.h): hiredis makes the connection; the
 * commands and their replies are written and read here, each command under one deadline. */
#include "daemon/store.h"
#include "common/log.h"
#include "common/status.h"
#include "common/thread.h"
#include "daemon/config.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <limits.h>
#include <netdb.h>
#include <poll.h>
#include <sodium.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define STORE_RECV_BUF 16384 /* a reply's lines and small strings come through this many bytes a recv */
#define STORE_RETRY_MS 1000      /* no new connection within this of a failed one ... */
#define STORE_RETRY_MAX_MS 30000 /* ... doubled at each failure in a row, up to this */
#define STORE_SEND_BUF (256 << 10) /* a streamed value goes out in pieces of this */
#define STORE_LINE_MAX (64 << 10)  /* a reply's header line, an error message's included */
#define STORE_PASSWORD_MAX 4096    /* store-password-file's password, in bytes, and one */
#define STORE_MIB_STEP (1u << 20)  /* each MiB of a value gives its command store-timeout-ms more */

struct host_lookup;
static void lookup_unref(struct host_lookup *lk);

struct skv_store {
    char url[512];
    char host[256];           /* a host name or address, or a socket path (unix) */
    int port;                 /* 0: unix socket */
    int db;
    struct timeval timeout;
    char user[256];           /* store-user: "" Redis's default one */
    char password_file[4096]; /* store-password-file: "" no AUTH */
    uint64_t max_value;       /* a take refuses a value larger than this */
    struct host_lookup *lookup; /* a lookup of host that outlived a connect's wait, or NULL */
    redisContext *c;          /* NULL: not connected */
    char rbuf[STORE_RECV_BUF];  /* bytes received on c and not read yet: rbuf[roff .. rlen) */
    size_t roff, rlen;
    uint64_t deadline_ms;     /* the running command's (now_ms's clock): deadline_start */
    uint64_t down_until_ms;   /* a connection failed: none is tried before this */
    uint64_t retry_ms;        /* the wait after the next failure */
    char why[512];            /* and why */
    bool refused;             /* the last command's answer was NOPERM (skv_store_refused) */
    bool no_script;           /* EVAL refused (an ACL, scripting off): takes are plain GETDELs */
    struct skv_store_stats stats;
    void (*progress)(void *);  /* skv_store_on_progress: each time bytes may move */
    void *progress_user;
};

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static uint64_t store_timeout_ms(const struct skv_store *st)
{
    return (uint64_t)st->timeout.tv_sec * 1000 + (uint64_t)st->timeout.tv_usec / 1000;
}

static int parse_uint(const char *p, const char *end, long max, long *out)
{
    long v = 0;
    if (p == end)
        return -1;
    for (; p < end; p++) {
        if (*p < '0' || *p > '9' || (v = v * 10 + (*p - '0')) > max)
            return -1;
    }
    *out = v;
    return 0;
}

int skv_store_new(const char *url, int timeout_ms, uint64_t max_value, struct skv_store **out)
{
    struct skv_store *st = calloc(1, sizeof *st);
    if (!st)
        return SKV_E_NOMEM;
    if (strpbrk(url, "@?")) { /* (not echoed: it may hold a password; the url is in every store message) */
        free(st);
        return skv_errorf(SKV_E_INVAL, "store: a url with a user, a password or options (USER:PASSWORD@, ?...) "
                          "is refused: give them in store-user and store-password-file");
    }
    if (strlen(url) >= sizeof st->url) {
        free(st);
        return skv_errorf(SKV_E_INVAL, "store: a url of at most %zu characters", sizeof st->url - 1);
    }
    snprintf(st->url, sizeof st->url, "%s", url);
    st->timeout = (struct timeval){.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    st->retry_ms = STORE_RETRY_MS;
    st->max_value = max_value;
    const char *p;
    long v;
    if (strncmp(url, "unix://", 7) == 0) {
        p = url + 7;
        if (*p != '/' || strlen(p) >= sizeof st->host) {
            free(st);
            return skv_errorf(SKV_E_INVAL, "store '%s': unix:// takes an absolute socket path", url);
        }
        snprintf(st->host, sizeof st->host, "%s", p);
        *out = st;
        return SKV_OK;
    }
    if (strncmp(url, "redis://", 8) != 0) {
        free(st);
        return skv_errorf(SKV_E_INVAL, "store '%s': redis://HOST[:PORT][/DB] or unix://PATH", url);
    }
    p = url + 8;
    const char *host_end, *rest;
    if (*p == '[') { /* an IPv6 address */
        host_end = strchr(p, ']');
        rest = host_end ? host_end + 1 : NULL;
        p++;
    } else {
        host_end = p + strcspn(p, ":/");
        rest = host_end;
    }
    if (!host_end || host_end == p || (size_t)(host_end - p) >= sizeof st->host) {
        free(st);
        return skv_errorf(SKV_E_INVAL, "store '%s': no host", url);
    }
    memcpy(st->host, p, (size_t)(host_end - p));
    st->port = 6379;
    if (*rest == ':') {
        const char *pe = rest + 1 + strcspn(rest + 1, "/");
        if (parse_uint(rest + 1, pe, 65535, &v) || v == 0) {
            free(st);
            return skv_errorf(SKV_E_INVAL, "store '%s': the port is 1..65535", url);
        }
        st->port = (int)v;
        rest = pe;
    }
    if (*rest == '/' && rest[1]) {
        if (parse_uint(rest + 1, rest + strlen(rest), 1 << 20, &v)) {
            free(st);
            return skv_errorf(SKV_E_INVAL, "store '%s': the database is a number", url);
        }
        st->db = (int)v;
    } else if (*rest && strcmp(rest, "/") != 0) {
        free(st);
        return skv_errorf(SKV_E_INVAL, "store '%s': redis://HOST[:PORT][/DB]", url);
    }
    *out = st;
    return SKV_OK;
}

/* skv_store_read_password's checks and reading, for option's file (named in messages). */
static int read_secret(const char *option, const char *path, char *out, size_t cap)
{
    /* O_NONBLOCK: a FIFO at the path would block the open (the engine thread's, at a connect) */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0)
        return skv_errorf(errno == EACCES ? SKV_E_PERM : SKV_E_IO, "%s %s: %s", option, path,
                          strerror(errno));
    struct stat sb;
    int rc = SKV_OK;
    size_t n = 0;
    if (fstat(fd, &sb) != 0)
        rc = skv_errorf(SKV_E_IO, "%s %s: %s", option, path, strerror(errno));
    else if (!S_ISREG(sb.st_mode))
        rc = skv_errorf(SKV_E_INVAL, "%s %s: not a regular file", option, path);
    else if (sb.st_mode & S_IRWXO)
        rc = skv_errorf(SKV_E_PERM, "%s %s: other users may read it (mode %04o): chmod o-rwx it",
                        option, path, (unsigned)(sb.st_mode & 07777));
    else if ((sb.st_mode & (S_IRGRP | S_IWGRP)) && sb.st_gid != 0) /* (root's group: systemd's credentials) */
        rc = skv_errorf(SKV_E_PERM, "%s %s: its group may read it (mode %04o), and the clients "
                        "share the daemon's group: chmod g-rwx it", option, path, (unsigned)(sb.st_mode & 07777));
    else if (sb.st_uid != 0 && sb.st_uid != geteuid()) /* (root reads it whatever it is) */
        rc = skv_errorf(SKV_E_PERM, "%s %s: it belongs to uid %lu, neither root nor the daemon's user (uid %lu), "
                        "who could read it: chown it", option, path, (unsigned long)sb.st_uid,
                        (unsigned long)geteuid());
    while (!rc) { /* (read to its end: its size may have changed since the fstat) */
        char more;
        ssize_t m = n < cap - 1 ? read(fd, out + n, cap - 1 - n) : read(fd, &more, 1);
        if (m < 0 && errno == EINTR)
            continue;
        if (m < 0)
            rc = skv_errorf(SKV_E_IO, "%s %s: %s", option, path, strerror(errno));
        else if (m == 0)
            break;
        else if (n == cap - 1)
            rc = skv_errorf(SKV_E_INVAL, "%s %s: more than %zu bytes", option, path, cap - 1);
        else
            n += (size_t)m;
    }
    close(fd);
    if (!rc) {
        if (n > 0 && out[n - 1] == '\n')
            n--;
        if (n > 0 && out[n - 1] == '\r')
            n--;
        out[n] = '\0';
        if (n == 0)
            rc = skv_errorf(SKV_E_INVAL, "%s %s: empty", option, path);
        else if (strlen(out) != n || strpbrk(out, "\r\n"))
            rc = skv_errorf(SKV_E_INVAL, "%s %s: one line of text", option, path);
    }
    if (rc)
        explicit_bzero(out, cap);
    return rc;
}

int skv_store_read_password(const char *path, char *out, size_t cap)
{
    return read_secret("store-password-file", path, out, cap);
}

/* skv_store_read_key for the file of option (store-secret-file or store-accept-secret-file) */
static int read_key(const char *option, const char *path, const char *password_file,
                    unsigned char key[SKV_STORE_KEY_BYTES])
{
    static const unsigned char personal[16] = {'s', 'n', 'a', 'p', 'k', 'v', '-', 's',
                                               't', 'o', 'r', 'e', '-', 'm', 'a', 'c'};
    char secret[STORE_PASSWORD_MAX], pw[STORE_PASSWORD_MAX];
    int rc = read_secret(option, path, secret, sizeof secret);
    size_t n = rc ? 0 : strlen(secret);
    if (!rc && n < 16)
        rc = skv_errorf(SKV_E_INVAL, "%s %s: %zu bytes, at least 16 ((umask 077; head -c 32 "
                        "/dev/urandom | base64 > it))", option, path, n);
    /* the password goes over the wire at each AUTH, and a client of the store may read it */
    if (!rc && password_file && *password_file && !read_secret("store-password-file", password_file, pw, sizeof pw)) {
        if (strcmp(pw, secret) == 0)
            rc = skv_errorf(SKV_E_INVAL, "%s %s holds the store's password: the secret must be "
                            "another (the password goes to the store; a secret never leaves the daemons)", option,
                            path);
        explicit_bzero(pw, sizeof pw);
    }
    if (!rc)
        crypto_generichash_blake2b_salt_personal(key, SKV_STORE_KEY_BYTES, (const unsigned char *)secret, n, NULL, 0,
                                                 NULL, personal);
    explicit_bzero(secret, sizeof secret);
    return rc;
}

int skv_store_read_key(const char *path, const char *password_file, unsigned char key[SKV_STORE_KEY_BYTES])
{
    return read_key("store-secret-file", path, password_file, key);
}

int skv_store_auth(struct skv_store *st, const char *user, const char *password_file)
{
    user = user ? user : "";
    password_file = password_file ? password_file : "";
    if (*user && !*password_file)
        return skv_errorf(SKV_E_INVAL, "store-user %s needs store-password-file", user);
    if (strlen(user) >= sizeof st->user || strpbrk(user, " \t\r\n"))
        return skv_errorf(SKV_E_INVAL, "store-user: a name of at most %zu characters, without spaces",
                          sizeof st->user - 1);
    if (strlen(password_file) >= sizeof st->password_file)
        return skv_errorf(SKV_E_INVAL, "store-password-file: a path of at most %zu characters",
                          sizeof st->password_file - 1);
    char pw[STORE_PASSWORD_MAX];
    if (*password_file) {
        int rc = skv_store_read_password(password_file, pw, sizeof pw);
        explicit_bzero(pw, sizeof pw);
        if (rc)
            return rc;
    }
    snprintf(st->user, sizeof st->user, "%s", user);
    snprintf(st->password_file, sizeof st->password_file, "%s", password_file);
    return SKV_OK;
}

int skv_store_open(const struct skv_config *cfg, struct skv_store **out, unsigned char key[SKV_STORE_KEY_BYTES],
                   bool *is_signed, unsigned char accept[SKV_STORE_KEY_BYTES], bool *has_accept)
{
    *is_signed = *cfg->store_secret_file != '\0';
    *has_accept = *is_signed && cfg->store_accept_secret_file && *cfg->store_accept_secret_file;
    int rc = skv_store_new(cfg->store, (int)cfg->store_timeout_ms, (uint64_t)cfg->store_max_bytes, out);
    if (!rc)
        rc = skv_store_auth(*out, cfg->store_user, cfg->store_password_file);
    if (!rc && *is_signed)
        rc = skv_store_read_key(cfg->store_secret_file, cfg->store_password_file, key);
    if (!rc && *has_accept)
        rc = read_key("store-accept-secret-file", cfg->store_accept_secret_file, cfg->store_password_file, accept);
    if (!rc && *has_accept && sodium_memcmp(key, accept, SKV_STORE_KEY_BYTES) == 0)
        rc = skv_errorf(SKV_E_INVAL, "store-accept-secret-file %s holds the secret store-secret-file %s holds: "
                        "a rotation's second secret is another", cfg->store_accept_secret_file,
                        cfg->store_secret_file);
    if (rc) {
        skv_store_free(out);
        explicit_bzero(key, SKV_STORE_KEY_BYTES);
        explicit_bzero(accept, SKV_STORE_KEY_BYTES);
    }
    return rc;
}

void skv_store_on_progress(struct skv_store *st, void (*fn)(void *user), void *user)
{
    st->progress = fn;
    st->progress_user = user;
}

void skv_store_free(struct skv_store **st_p)
{
    if (!st_p || !*st_p)
        return;
    if ((*st_p)->c)
        redisFree((*st_p)->c);
    if ((*st_p)->lookup)
        lookup_unref((*st_p)->lookup); /* its thread frees it when the resolver answers */
    free(*st_p);
    *st_p = NULL;
}

const char *skv_store_url(const struct skv_store *st)
{
    return st->url;
}

void skv_store_target(const struct skv_store *st, const char **host, int *port, int *db)
{
    *host = st->host;
    *port = st->port;
    *db = st->db;
}

void skv_store_stats(const struct skv_store *st, struct skv_store_stats *out)
{
    *out = st->stats;
}

void skv_store_count_spill_failure(struct skv_store *st)
{
    st->stats.spill_failures++;
}

/* Drops the connection after a failure: the next call connects again, after a wait that doubles
 * with each failure in a row (a store that is down costs each spill nothing but this check
 * meanwhile, and one that hangs costs a connect timeout at most every 30 s). */
static int store_failed(struct skv_store *st, const char *what)
{
    snprintf(st->why, sizeof st->why, "%s", what);
    if (st->c) {
        redisFree(st->c);
        st->c = NULL;
    }
    st->down_until_ms = now_ms() + st->retry_ms;
    st->retry_ms = st->retry_ms * 2 < STORE_RETRY_MAX_MS ? st->retry_ms * 2 : STORE_RETRY_MAX_MS;
    return skv_errorf(SKV_E_IO, "store %s: %s", st->url, st->why);
}

/* A value streamed onto the connection (skv_store_put_stream): n bytes that fn writes. */
struct store_value {
    uint64_t n;
    skv_store_writer fn;
    void *user;
    int rc;     /* what fn returned */
    int err;    /* the socket's errno when a send failed */
    uint64_t sent;
};

static int stream_command(struct skv_store *st, int argc, const char **argv, const size_t *lens, int vi,
                          struct store_value *v);

/* A reply as read_reply reads it. */
struct store_reply {
    char type;        /* '+' status, '-' error (line), ':' integer, '$' string (data, n; nil), '*' SCAN's */
    char line[512];   /* a status's or an error's text, cut there */
    long long integer;
    void *data;       /* malloc'ed */
    size_t n;         /* (a SCAN's: how many keys) */
    bool nil;
    uint64_t cursor;  /* a SCAN's next cursor */
    int rc;           /* read_reply's -1: the status (its message set) */
};

static int read_reply(struct skv_store *st, const char *command, bool string_ok, struct store_reply *r);
static void deadline_start(struct skv_store *st, uint64_t value_bytes);

/* A command of a new connection (AUTH, SELECT) and its reply, which must be a status: SKV_OK,
 * or SKV_E_IO with why set. A refusal's text goes into why whole, or (first_word: AUTH's) its
 * first word only: a store that does not know the command may quote its arguments, an AUTH's
 * password among them. */
static int setup_command(struct skv_store *st, int argc, const char **argv, const size_t *lens, bool first_word,
                         char *why, size_t cap)
{
    struct store_value none = {0};
    struct store_reply r = {0};
    deadline_start(st, 0);
    int e = 0;
    if (stream_command(st, argc, argv, lens, -1, &none) != 0)
        snprintf(why, cap, "%s: %s", argv[0], none.err == EAGAIN ? "timed out"
                                              : none.err ? strerror(none.err) : "no memory to send it");
    else if ((e = read_reply(st, argv[0], false, &r)) != 0)
        snprintf(why, cap, "%s: %s", argv[0], e < 0 ? skv_error_msg() : e == EAGAIN ? "timed out"
                                              : e == ECONNRESET ? "the connection closed" : strerror(e));
    else if (r.type == '-')
        snprintf(why, cap, "%s refused (%.*s)", argv[0], first_word ? (int)strcspn(r.line, " ") : (int)strlen(r.line),
                 r.line);
    else if (r.type != '+')
        snprintf(why, cap, "%s: an unexpected reply", argv[0]);
    else
        return SKV_OK;
    return SKV_E_IO;
}

/* AUTH [user] password on a new connection, the password read from its file now: SKV_OK, or
 * SKV_E_IO after store_failed (a refused password counts as a failed connection). The command is
 * written by stream_command, which clears its buffer. Neither st->why, which clients may see in
 * an error, nor the log has more of the store's answer than its first word: a store that does
 * not know AUTH quotes its arguments, cut (so a long password's start, which no search for the
 * whole password finds). */
static int store_auth(struct skv_store *st)
{
    char pw[STORE_PASSWORD_MAX], why[sizeof st->why];
    if (skv_store_read_password(st->password_file, pw, sizeof pw)) {
        skv_log(SKV_LOG_WARN, "store %s: %s", st->url, skv_error_msg());
        return store_failed(st, "AUTH: store-password-file cannot be read (the log says why)");
    }
    const char *argv[3] = {"AUTH"};
    size_t lens[3] = {4};
    int argc = 1;
    if (st->user[0]) {
        argv[argc] = st->user;
        lens[argc++] = strlen(st->user);
    }
    argv[argc] = pw;
    lens[argc++] = strlen(pw);
    int rc = setup_command(st, argc, argv, lens, true, why, sizeof why);
    explicit_bzero(pw, sizeof pw);
    if (!rc)
        return SKV_OK;
    skv_log(SKV_LOG_WARN, "store %s: AUTH%s%s with the password in %s: %s: check store-user and "
            "store-password-file", st->url, st->user[0] ? " as " : "", st->user, st->password_file, why);
    return store_failed(st, why);
}

/* ---- the host's lookup ------------------------------------------------------------- */

/* getaddrinfo of the store's host on a thread of its own: glibc's resolver has no time limit,
 * and a connect waits for it at most until its deadline. The thread and the store hold a
 * reference each; whichever lets go last frees it, so a lookup that outlives the wait (and the
 * store) finishes on its own, and the next connect takes its answer. */
struct host_lookup {
    pthread_mutex_t mu;
    pthread_cond_t cv; /* on CLOCK_MONOTONIC */
    int refs;
    bool done;
    uint64_t done_ms; /* when it was answered (now_ms) */
    int gai, err; /* getaddrinfo's result, and errno after it (EAI_SYSTEM) */
    struct addrinfo *res;
    char host[256], port[8];
};

static void lookup_unref(struct host_lookup *lk)
{
    pthread_mutex_lock(&lk->mu);
    bool last = --lk->refs == 0;
    pthread_mutex_unlock(&lk->mu);
    if (!last)
        return;
    if (lk->res)
        freeaddrinfo(lk->res);
    pthread_cond_destroy(&lk->cv);
    pthread_mutex_destroy(&lk->mu);
    free(lk);
}

static void *lookup_main(void *arg)
{
    struct host_lookup *lk = arg;
    const struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    int gai = getaddrinfo(lk->host, lk->port, &hints, &res);
    int err = errno;
    pthread_mutex_lock(&lk->mu);
    lk->gai = gai;
    lk->err = err;
    lk->res = gai ? NULL : res;
    lk->done = true;
    lk->done_ms = now_ms();
    pthread_cond_signal(&lk->cv);
    pthread_mutex_unlock(&lk->mu);
    lookup_unref(lk);
    return NULL;
}

/* Starts the lookup of st->host (a thread of its own, detached) into st->lookup. */
static int lookup_start(struct skv_store *st)
{
    struct host_lookup *lk = calloc(1, sizeof *lk);
    if (!lk)
        return store_failed(st, "no memory to look the host up");
    pthread_condattr_t ca;
    int rc = pthread_condattr_init(&ca);
    if (!rc && (rc = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC)) == 0 &&
        (rc = pthread_mutex_init(&lk->mu, NULL)) == 0 && (rc = pthread_cond_init(&lk->cv, &ca)) != 0)
        pthread_mutex_destroy(&lk->mu);
    pthread_condattr_destroy(&ca);
    if (rc) {
        free(lk);
        return store_failed(st, "cannot set up the host's lookup");
    }
    lk->refs = 2;
    snprintf(lk->host, sizeof lk->host, "%s", st->host);
    snprintf(lk->port, sizeof lk->port, "%d", st->port);
    pthread_t t;
    rc = skv_thread_create(&t, lookup_main, lk, "skv-lookup");
    if (rc) {
        lk->refs = 1;
        lookup_unref(lk);
        char why[300];
        snprintf(why, sizeof why, "cannot start the lookup of %s: %s", st->host, strerror(rc));
        return store_failed(st, why);
    }
    pthread_detach(t);
    st->lookup = lk;
    return SKV_OK;
}

/* A lookup kept from an earlier connect is used if it was answered this recently; an older
 * answer, or a failed one, is looked up again. */
#define STORE_LOOKUP_FRESH_MS 5000

/* The host's addresses, waited for until deadline_ms (CLOCK_MONOTONIC, now_ms's clock): a
 * lookup that is still running then stays in st->lookup for the next connect. *out is the
 * caller's to free. */
static int store_lookup(struct skv_store *st, uint64_t deadline_ms, struct addrinfo **out)
{
    int rc;
    if (st->lookup) { /* from a connect that stopped waiting for it */
        struct host_lookup *old = st->lookup;
        pthread_mutex_lock(&old->mu);
        bool stale = old->done && (old->gai || now_ms() - old->done_ms > STORE_LOOKUP_FRESH_MS);
        pthread_mutex_unlock(&old->mu);
        if (stale) {
            st->lookup = NULL;
            lookup_unref(old);
        }
    }
    if (!st->lookup && (rc = lookup_start(st)) != SKV_OK)
        return rc;
    struct host_lookup *lk = st->lookup;
    struct timespec until = {.tv_sec = (time_t)(deadline_ms / 1000), .tv_nsec = (long)(deadline_ms % 1000) * 1000000};
    pthread_mutex_lock(&lk->mu);
    while (!lk->done && pthread_cond_timedwait(&lk->cv, &lk->mu, &until) == 0) {
    }
    bool done = lk->done;
    int gai = lk->gai, err = lk->err;
    struct addrinfo *res = lk->res;
    lk->res = NULL;
    pthread_mutex_unlock(&lk->mu);
    char why[400];
    if (!done) {
        snprintf(why, sizeof why, "looking up %s takes longer than store-timeout-ms (it goes on, and the next "
                 "try takes its answer)", st->host);
        return store_failed(st, why);
    }
    st->lookup = NULL;
    lookup_unref(lk);
    if (gai) {
        snprintf(why, sizeof why, "looking up %s: %s", st->host,
                 gai == EAI_SYSTEM && err ? strerror(err) : gai_strerror(gai));
        return store_failed(st, why);
    }
    *out = res;
    return SKV_OK;
}

/* A TCP connection to the host: an address as it is; a name's addresses, IPv4 ones first, each
 * tried in turn by its numeric form (so that hiredis looks nothing up), the lookup and the
 * connects together within one store-timeout-ms, each address given an equal share of what is
 * left (one that drops packets does not take the others' time). */
static int store_connect_tcp(struct skv_store *st)
{
    unsigned char bin[16];
    if (inet_pton(AF_INET, st->host, bin) == 1 || inet_pton(AF_INET6, st->host, bin) == 1) {
        st->c = redisConnectWithTimeout(st->host, st->port, st->timeout);
        return SKV_OK;
    }
    const uint64_t deadline = now_ms() + store_timeout_ms(st);
    struct addrinfo *res = NULL;
    int rc = store_lookup(st, deadline, &res);
    if (rc)
        return rc;
    char why[512];
    snprintf(why, sizeof why, "%s has no address", st->host);
    int left_n = 0; /* addresses not tried yet: each takes a share of the time left */
    for (const struct addrinfo *ai = res; ai; ai = ai->ai_next)
        left_n += ai->ai_family == AF_INET || ai->ai_family == AF_INET6;
    for (int pass = 0; pass < 2 && !st->c; pass++) /* IPv4, then IPv6 */
        for (const struct addrinfo *ai = res; ai && !st->c; ai = ai->ai_next) {
            char addr[64]; /* a numeric form: IPv6 with a scope at most 62 */
            if (ai->ai_family != (pass == 0 ? AF_INET : AF_INET6))
                continue;
            int this_n = left_n--;
            if (getnameinfo(ai->ai_addr, ai->ai_addrlen, addr, sizeof addr, NULL, 0, NI_NUMERICHOST) != 0)
                continue;
            uint64_t now = now_ms();
            if (now + 1 >= deadline) {
                size_t len = strlen(why);
                snprintf(why + len, sizeof why - len, "; no time left for %s", addr);
                pass = 2;
                break;
            }
            uint64_t share = (deadline - now) / (uint64_t)this_n;
            share = share < 1 ? 1 : share;
            struct timeval tv = {.tv_sec = (time_t)(share / 1000), .tv_usec = (suseconds_t)(share % 1000) * 1000};
            redisContext *c = redisConnectWithTimeout(addr, st->port, tv);
            if (c && !c->err) {
                st->c = c;
            } else {
                snprintf(why, sizeof why, "%s (%s, %s)", c ? c->errstr : "no memory for a connection", st->host,
                         addr);
                if (c)
                    redisFree(c);
            }
        }
    freeaddrinfo(res);
    return st->c ? SKV_OK : store_failed(st, why);
}

static int store_connect(struct skv_store *st)
{
    if (st->c)
        return SKV_OK;
    st->roff = st->rlen = 0; /* (what an earlier connection left is not this one's) */
    uint64_t now = now_ms();
    if (now < st->down_until_ms)
        return skv_errorf(SKV_E_IO, "store %s: %s (tried again in %.1f s)", st->url, st->why,
                          (double)(st->down_until_ms - now) / 1000.0);
    if (st->port) {
        int rc = store_connect_tcp(st);
        if (rc)
            return rc;
    } else {
        st->c = redisConnectUnixWithTimeout(st->host, st->timeout);
    }
    if (!st->c)
        return store_failed(st, "no memory for a connection");
    if (st->c->err)
        return store_failed(st, st->c->errstr);
    if (st->port && redisEnableKeepAlive(st->c) != REDIS_OK) /* a peer gone quiet is found */
        return store_failed(st, "cannot enable TCP keep-alive");
    if (st->password_file[0] && store_auth(st))
        return SKV_E_IO;
    if (st->db) {
        char db[16], why[300];
        snprintf(db, sizeof db, "%d", st->db);
        const char *argv[] = {"SELECT", db};
        const size_t lens[] = {6, strlen(db)};
        if (setup_command(st, 2, argv, lens, false, why, sizeof why))
            return store_failed(st, why);
    }
    return SKV_OK;
}

/* The time a value of `bytes` adds to its command's: store-timeout-ms for each MiB or part. */
static uint64_t value_ms(const struct skv_store *st, uint64_t bytes)
{
    return store_timeout_ms(st) * ((bytes + STORE_MIB_STEP - 1) / STORE_MIB_STEP);
}

/* Starts a command's clock: store-timeout-ms for the command and its reply's first line, and
 * value_ms for the value it sends (read_reply adds a received one's). A store that trickles its
 * bytes (each wait within the timeout) so cannot hold the engine past that. */
static void deadline_start(struct skv_store *st, uint64_t value_bytes)
{
    st->deadline_ms = now_ms() + store_timeout_ms(st) + value_ms(st, value_bytes);
}

/* Waits until fd is ready for `events` before the command's deadline, and at most
 * store-timeout-ms (one wait: a store that stops moving a large value's bytes fails after that,
 * not after the time the whole value was given, which held the engine past the watchdog's
 * window): 0, EAGAIN when either passed, or poll's errno. */
static int wait_ready(const struct skv_store *st, int fd, short events)
{
    if (st->progress) /* a value that moves slowly but moves: the engine is alive (the watchdog) */
        st->progress(st->progress_user);
    const uint64_t until = now_ms() + store_timeout_ms(st);
    for (;;) {
        uint64_t now = now_ms(), end = st->deadline_ms < until ? st->deadline_ms : until;
        if (now >= end)
            return EAGAIN;
        uint64_t left = end - now;
        struct pollfd p = {.fd = fd, .events = events};
        int n = poll(&p, 1, left > INT_MAX ? INT_MAX : (int)left);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return errno;
        if (n > 0) /* (an error or hang-up too: the send or recv says which) */
            return 0;
    }
}

struct value_sink {
    struct skv_store *st;
    int fd;
    struct store_value *v;
    uint64_t cap; /* no byte past this count goes out: the value's end while fn writes it */
    bool over;    /* fn wrote past it */
};

/* fopencookie's write: every byte onto the socket before the command's deadline, or 0 (an
 * error) with v->err set (EAGAIN: the deadline passed), or with `over` set for bytes past the
 * cap. */
static ssize_t sink_write(void *cookie, const char *buf, size_t n)
{
    struct value_sink *k = cookie;
    if (k->v->sent + n > k->cap) {
        k->over = true;
        return 0; /* (an error, to stdio: never negative, fopencookie(3)) */
    }
    size_t off = 0;
    while (off < n && !k->v->err) {
        int w = wait_ready(k->st, k->fd, POLLOUT);
        if (w) {
            k->v->err = w;
            break;
        }
        ssize_t m = send(k->fd, buf + off, n - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (m < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
            continue;
        if (m <= 0)
            k->v->err = m < 0 ? errno : EPIPE;
        else
            off += (size_t)m;
    }
    k->v->sent += off;
    return k->v->err ? 0 : (ssize_t)n;
}

/* Sends argv as one command in the protocol's framing (an array of bulk strings), argument `vi`
 * (-1: none) being the n bytes v->fn writes straight onto the socket: no copy of the value is
 * made, whatever its size. What comes before the value is sent first, so that the value is
 * exactly the next n bytes: fn can send no more, and when it wrote fewer or failed, nothing more
 * goes out (the caller drops the connection, so the store never runs the half-sent command). 0
 * when all of it went out; otherwise v->err (the socket failed, or EAGAIN: the deadline passed)
 * or v->rc (fn did, or wrote other than n bytes: SKV_E_INTERNAL) says why. */
static int stream_command(struct skv_store *st, int argc, const char **argv, const size_t *lens, int vi,
                          struct store_value *v)
{
    v->sent = 0;
    v->err = 0;
    v->rc = SKV_OK;
    struct value_sink k = {.st = st, .fd = st->c->fd, .v = v, .cap = UINT64_MAX};
    char small[512]; /* a command without a value: a key */
    size_t size = vi >= 0 ? STORE_SEND_BUF : sizeof small;
    char *buf = vi >= 0 ? malloc(size) : small;
    FILE *f = buf ? fopencookie(&k, "w", (cookie_io_functions_t){.write = sink_write}) : NULL;
    if (!f || setvbuf(f, buf, _IOFBF, size) != 0) {
        if (f)
            fclose(f);
        if (buf != small)
            free(buf);
        return v->rc = skv_errorf(SKV_E_NOMEM, "no memory to stream a value");
    }
    fprintf(f, "*%d\r\n", argc);
    for (int i = 0; i < argc && !v->rc && !v->err; i++) {
        fprintf(f, "$%llu\r\n", (unsigned long long)(i == vi ? v->n : lens[i]));
        if (i != vi) {
            fwrite(argv[i], 1, lens[i], f);
        } else if (fflush(f) == 0) {
            k.cap = v->sent + v->n;
            v->rc = v->fn(v->user, f);
            if (!v->rc && fflush(f) != 0 && !v->err && !k.over)
                v->rc = skv_errorf(SKV_E_NOMEM, "a value could not be streamed");
            if (!v->err && (k.over || (!v->rc && v->sent != k.cap)))
                v->rc = skv_errorf(SKV_E_INTERNAL, "a value of %llu bytes was announced and %s written",
                                   (unsigned long long)v->n, k.over ? "more" : "fewer");
            k.cap = v->rc || v->err ? v->sent : UINT64_MAX;
        }
        fwrite("\r\n", 1, 2, f);
    }
    if (fclose(f) != 0 && !v->err && !v->rc)
        v->rc = skv_errorf(SKV_E_NOMEM, "a command could not be sent");
    if (buf != small)
        free(buf);
    else
        explicit_bzero(small, sizeof small); /* (an AUTH's password) */
    return v->err || v->rc ? -1 : 0;
}

/* Reads exactly n bytes before the command's deadline: 0, or an errno (ECONNRESET for an end of
 * stream; EAGAIN: the deadline passed). Through st->rbuf: a recv takes what has come, up to
 * STORE_RECV_BUF bytes, so a reply's lines (read a byte at a time) and a batch's small answers
 * cost a system call per buffer, not per byte; what is left of a large string is received
 * straight into p. Bytes past this reply stay in rbuf for the next (a pipelined batch's). */
static int recv_all(struct skv_store *st, void *p, size_t n)
{
    size_t off = st->rlen - st->roff < n ? st->rlen - st->roff : n;
    memcpy(p, st->rbuf + st->roff, off);
    st->roff += off;
    while (off < n) {
        bool direct = n - off >= sizeof st->rbuf;
        int w = wait_ready(st, st->c->fd, POLLIN);
        if (w)
            return w;
        ssize_t m = direct ? recv(st->c->fd, (char *)p + off, n - off, MSG_DONTWAIT)
                           : recv(st->c->fd, st->rbuf, sizeof st->rbuf, MSG_DONTWAIT);
        if (m < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
            continue;
        if (m <= 0)
            return m < 0 ? errno : ECONNRESET;
        if (direct) {
            off += (size_t)m;
            continue;
        }
        size_t take = (size_t)m < n - off ? (size_t)m : n - off;
        memcpy((char *)p + off, st->rbuf, take);
        off += take;
        st->roff = take;
        st->rlen = (size_t)m;
    }
    return 0;
}

/* Whether p is a number as the protocol writes one: an optional '-', then 1 to 19 digits (no
 * space, no '+': strtoll alone would take them). */
static bool resp_number(const char *p)
{
    p += *p == '-';
    size_t n = strspn(p, "0123456789");
    return n >= 1 && n <= 19 && !p[n];
}

/* One line of a reply into line (cap bytes: cut there, an error message's rest skipped), its
 * \r\n gone: 0, an errno, or -1 with r->rc (a line longer than STORE_LINE_MAX). */
static int read_line(struct skv_store *st, const char *command, char *line, size_t cap, struct store_reply *r)
{
    size_t k = 0;
    for (size_t total = 0;; total++) {
        char c;
        int err = recv_all(st, &c, 1);
        if (err)
            return err;
        if (c == '\n')
            break;
        if (total == STORE_LINE_MAX) {
            r->rc = skv_errorf(SKV_E_IO, "%s: a reply line longer than %d bytes", command, STORE_LINE_MAX);
            return -1;
        }
        if (k < cap - 1)
            line[k++] = c;
    }
    line[k && line[k - 1] == '\r' ? k - 1 : k] = '\0';
    return 0;
}

/* The reply to a command sent: a status, an error, an integer, or (string_ok: GETDEL's) a bulk
 * string or nil, read from the socket straight into one allocation of its size, its length
 * checked against store-max-bytes first, and its bytes given store-timeout-ms more for each MiB.
 * Any other reply (an array, a string where none is due) is not read on: nothing grows without
 * bound on what a store sends. 0, an errno (the socket failed; EAGAIN: the deadline passed), or
 * -1 with r->rc (not such a reply, a value too large, no memory: the connection must go). */
static int read_reply(struct skv_store *st, const char *command, bool string_ok, struct store_reply *r)
{
    char *line = r->line;
    int err = read_line(st, command, line, sizeof r->line, r);
    if (err)
        return err;
    r->type = line[0];
    if (r->type == '+' || r->type == '-') {
        memmove(line, line + 1, strlen(line));
        return 0;
    }
    char *end = NULL;
    errno = 0;
    bool number = (r->type == ':' || r->type == '$') && resp_number(line + 1);
    long long n = number ? strtoll(line + 1, &end, 10) : 0;
    number = number && !*end && errno != ERANGE;
    if (r->type == ':' && number) {
        r->integer = n;
        return 0;
    }
    if (r->type != '$' || !string_ok || !number || n < -1) {
        r->rc = skv_errorf(SKV_E_IO, "%s: an answer of a kind it does not have ('%c')", command,
                           r->type > ' ' && r->type < 127 ? r->type : '?');
        return -1;
    }
    if (n == -1) {
        r->nil = true;
        return 0;
    }
    if ((uint64_t)n > st->max_value) { /* (the caller drops the connection: the rest is not read) */
        r->rc = skv_errorf(SKV_E_LIMIT, "%s: a value of %lld bytes, more than store-max-bytes (%llu): it was taken "
                           "from the store and is lost", command, n, (unsigned long long)st->max_value);
        return -1;
    }
    if (!(r->data = malloc((size_t)n ? (size_t)n : 1))) {
        r->rc = skv_errorf(SKV_E_NOMEM, "%s: no memory for a value of %lld bytes: it was taken from the store and is "
                           "lost", command, n);
        return -1;
    }
    r->n = (size_t)n;
    st->deadline_ms += value_ms(st, (uint64_t)n);
    char crlf[2];
    err = recv_all(st, r->data, r->n);
    if (!err)
        err = recv_all(st, crlf, 2);
    if (!err && memcmp(crlf, "\r\n", 2) != 0) {
        r->rc = skv_errorf(SKV_E_IO, "%s: a string not ended as it should be", command);
        err = -1;
    }
    if (err) {
        free(r->data);
        r->data = NULL;
    }
    return err;
}

#define SCAN_KEYS_MAX 20000 /* a SCAN page with more keys is not read on (one asks for 1000) */
#define SCAN_KEY_MAX 1024   /* a longer key is read past and left out: no key of ours is that long */

/* A line `line` of type `type` ('*' an array's, '$' a string's) with a count in [lo, hi]: its
 * count, or -1 with r->rc set. */
static long long reply_count(const char *command, const char *line, char type, long long lo, long long hi,
                             struct store_reply *r)
{
    char *end = NULL;
    errno = 0;
    long long n = line[0] == type && resp_number(line + 1) ? strtoll(line + 1, &end, 10) : -1;
    if (!end || end == line + 1 || *end || errno == ERANGE || n < lo || n > hi) {
        r->rc = skv_errorf(SKV_E_IO, "%s: an answer of a kind it does not have ('%.20s')", command, line);
        return -1;
    }
    return n;
}

/* The reply to a SCAN: an error, or [cursor, [key ...]] read into r->cursor and r->data, the
 * keys one after the other each ended by a NUL (r->n of them; a key longer than SCAN_KEY_MAX or
 * holding a NUL is left out). 0, an errno, or -1 with r->rc, as read_reply. */
static int read_scan(struct skv_store *st, const char *command, struct store_reply *r)
{
    int err = read_line(st, command, r->line, sizeof r->line, r);
    if (err)
        return err;
    r->type = r->line[0];
    if (r->type == '-' || r->type == '+') {
        memmove(r->line, r->line + 1, strlen(r->line));
        return 0;
    }
    char line[64], num[24];
    long long n;
    if (reply_count(command, r->line, '*', 2, 2, r) < 0 || (err = read_line(st, command, line, sizeof line, r)) ||
        (n = reply_count(command, line, '$', 1, 20, r)) < 0 || (err = recv_all(st, num, (size_t)n + 2)))
        return err ? err : -1;
    bool crlf = num[n] == '\r' && num[n + 1] == '\n';
    num[n] = '\0';
    char *end = NULL;
    errno = 0;
    r->cursor = strspn(num, "0123456789") == (size_t)n ? strtoull(num, &end, 10) : 0;
    if (!crlf || !end || *end || errno == ERANGE) {
        r->rc = skv_errorf(SKV_E_IO, "%s: a cursor that is not one", command);
        return -1;
    }
    long long m;
    if ((err = read_line(st, command, line, sizeof line, r)) ||
        (m = reply_count(command, line, '*', 0, SCAN_KEYS_MAX, r)) < 0)
        return err ? err : -1;
    size_t used = 0, cap = 0;
    char *keys = NULL, skip[4096];
    for (long long i = 0; i < m && !err; i++) {
        if ((err = read_line(st, command, line, sizeof line, r)) ||
            (n = reply_count(command, line, '$', 0, STORE_LINE_MAX, r)) < 0) {
            err = err ? err : -1;
            break;
        }
        if (n >= SCAN_KEY_MAX) { /* read past it */
            for (long long left = n + 2; left > 0 && !err; left -= (long long)sizeof skip)
                err = recv_all(st, skip, left < (long long)sizeof skip ? (size_t)left : sizeof skip);
            continue;
        }
        if (used + (size_t)n + 2 > cap) {
            size_t want = cap ? cap * 2 : 16384;
            while (want < used + (size_t)n + 2)
                want *= 2;
            char *p = realloc(keys, want);
            if (!p) {
                r->rc = skv_errorf(SKV_E_NOMEM, "%s: no memory for its keys", command);
                err = -1;
                break;
            }
            keys = p;
            cap = want;
        }
        if ((err = recv_all(st, keys + used, (size_t)n + 2)))
            break;
        if (memcmp(keys + used + n, "\r\n", 2) != 0) {
            r->rc = skv_errorf(SKV_E_IO, "%s: a string not ended as it should be", command);
            err = -1;
            break;
        }
        keys[used + (size_t)n] = '\0';
        if (memchr(keys + used, '\0', (size_t)n))
            continue;
        used += (size_t)n + 1;
        r->n++;
    }
    if (err) {
        free(keys);
        r->n = 0;
        return err;
    }
    r->data = keys;
    return 0;
}

/* A command: argc arguments; with v, argument vi is the n bytes v->fn writes, streamed; its
 * reply goes into reply, which must be of the kind `want` ('+', ':', '$' or a SCAN's '*') or the
 * store's error. */
struct store_call {
    int argc;
    const char **argv;
    const size_t *lens;
    int vi;
    struct store_value *v;
    char want;
    bool int_ok;              /* an integer answers it too */
    struct store_reply reply;
};

/* Whether a reused connection can take a command: the server has not closed it (its `timeout`,
 * a proxy: over TCP a send would still go out and only the reply would find the connection
 * closed, too late to know whether the command ran) and nothing waits to be read on it. */
static bool store_usable(struct skv_store *st)
{
    if (st->roff < st->rlen) /* bytes no command asked for */
        return false;
    char c;
    ssize_t m = recv(st->c->fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return m < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

/* Drops the connection: the next command makes a new one. */
static void store_drop(struct skv_store *st)
{
    redisFree(st->c);
    st->c = NULL;
}

/* Whether an error answer says the connection goes to a server that is a replica now (a
 * failover: READONLY), or to a primary not serving yet (MASTERDOWN, LOADING): the caller drops
 * it, so the next command connects again, its address looked up again when old (before, the
 * connection stayed, and every spill and take failed on it until it broke). */
static bool store_moved(const char *line)
{
    return !strncmp(line, "READONLY", 8) || !strncmp(line, "MASTERDOWN", 10) || !strncmp(line, "LOADING", 7);
}

/* A connection for the next command: the one held when the server has not closed it and nothing
 * waits to be read on it (store_usable), else a new one; *reused: the one held. SKV_OK, or
 * store_connect's failure. */
static int store_ready(struct skv_store *st, bool *reused)
{
    if (st->c && !store_usable(st))
        store_drop(st);
    *reused = st->c != NULL;
    return store_connect(st);
}

/* A command's send or reply that failed with e (an errno, or -1 with the message set; sent: the
 * command went out): the connection dropped as store_failed drops it; SKV_E_IO. */
static int store_io_failed(struct skv_store *st, int e, bool sent)
{
    char why[300];
    snprintf(why, sizeof why, "%s",
             e < 0 ? skv_error_msg()
             : e == EAGAIN ? "timed out"
             : e == ECONNRESET && sent ? "the connection closed before the reply"
             : strerror(e));
    store_failed(st, why);
    return SKV_E_IO;
}

/* Runs a command, all of it (the send, the value, the reply) before its deadline (deadline_start):
 * SKV_OK with k->reply not an error, or SKV_E_IO after store_failed (a connection that failed is
 * dropped). A reused connection the server closed while idle is made again before the command is
 * sent (store_usable); one found closed while the command was sent (EPIPE, ECONNRESET) is made
 * again and the command sent once more, but never once the whole command went out: it may have
 * run, and running a GETDEL again would lose the value, a DEL again find nothing. Only a new
 * connection's failure counts as the store being down. A timeout is not retried either. When
 * v->fn fails, or a value does not fit, the connection is dropped (the store is not down) and
 * that status returned; a reply the command does not have (a store that does not speak the
 * protocol as it should) is a failure like a timeout. */
static int store_command(struct skv_store *st, struct store_call *k)
{
    st->refused = false;
    for (int attempt = 0;; attempt++) {
        bool reused;
        if (store_ready(st, &reused))
            return SKV_E_IO;
        struct store_value none = {0}, *v = k->v ? k->v : &none;
        deadline_start(st, v->n);
        bool sent = stream_command(st, k->argc, k->argv, k->lens, k->v ? k->vi : -1, v) == 0;
        int err = v->err;
        if (!sent && !err) { /* fn failed, or wrote other than it should, or memory */
            store_drop(st);
            return v->rc;
        }
        if (!sent && reused && attempt == 0 && (err == EPIPE || err == ECONNRESET)) {
            store_drop(st);
            continue;
        }
        k->reply = (struct store_reply){0};
        int e = !sent          ? err
                : k->want == '*' ? read_scan(st, k->argv[0], &k->reply)
                                 : read_reply(st, k->argv[0], k->want == '$', &k->reply);
        if (e < 0 && k->reply.rc != SKV_E_IO) { /* a value too large, or no memory for it */
            store_drop(st);
            return k->reply.rc;
        }
        if (e)
            return store_io_failed(st, e, sent);
        st->retry_ms = STORE_RETRY_MS; /* it answered */
        st->refused = k->reply.type == '-' && strncmp(k->reply.line, "NOPERM", 6) == 0;
        if (k->reply.type == '-') { /* the store answered: the connection is fine, */
            if (store_moved(k->reply.line)) /* unless it is not the primary's now */
                store_drop(st);
            return skv_errorf(SKV_E_IO, "store %s: %s: %s", st->url, k->argv[0], k->reply.line);
        }
        if (k->reply.type != k->want && !(k->int_ok && k->reply.type == ':')) /* in sync: one line */
            return skv_errorf(SKV_E_IO, "store %s: %s: an unexpected answer ('%c')", st->url, k->argv[0],
                              k->reply.type);
        return SKV_OK;
    }
}

/* SET key value EX ttl, the value streamed (a spill's, or the bytes of one put back). */
static int store_set(struct skv_store *st, const char *key, int64_t ttl_s, struct store_value *v, bool spill)
{
    char ttl[24];
    snprintf(ttl, sizeof ttl, "%lld", (long long)ttl_s);
    const char *argv[] = {"SET", key, NULL, "EX", ttl};
    const size_t lens[] = {3, strlen(key), 0, 2, strlen(ttl)};
    struct store_call k = {.argc = 5, .argv = argv, .lens = lens, .vi = 2, .v = v, .want = '+'};
    int rc = store_command(st, &k);
    if (rc) {
        st->stats.spill_failures += spill;
        return rc;
    }
    st->stats.spills += spill;
    st->stats.spill_bytes += spill ? v->n : 0;
    return SKV_OK;
}

int skv_store_put_stream(struct skv_store *st, const char *key, uint64_t n, int64_t ttl_s, skv_store_writer fn,
                         void *user)
{
    struct store_value v = {.n = n, .fn = fn, .user = user};
    return store_set(st, key, ttl_s, &v, true);
}

struct bytes_value {
    const void *data;
    size_t n;
};

static int write_bytes(void *user, FILE *f)
{
    const struct bytes_value *b = user;
    return fwrite(b->data, 1, b->n, f) == b->n ? SKV_OK : skv_errorf(SKV_E_IO, "a value could not be sent");
}

int skv_store_put_back(struct skv_store *st, const char *key, const void *data, size_t n, int64_t ttl_s)
{
    /* streamed from where it is: no copy (a put back follows a load that failed for memory) */
    struct bytes_value b = {data, n};
    struct store_value v = {.n = n, .fn = write_bytes, .user = &b};
    return store_set(st, key, ttl_s, &v, false);
}

int skv_store_take(struct skv_store *st, const char *key, const void **data, size_t *n, void **value)
{
    bool took_alt, left;
    return skv_store_take_either(st, key, NULL, data, n, value, &took_alt, &left);
}

/* A take that leaves a value this daemon cannot hold (past its store-max-bytes: another daemon's
 * may be higher) in the store: its length when too long, else GETDEL's answer. */
static const char TAKE_SCRIPT[] = "local n = redis.call('STRLEN', KEYS[1]) "
                                  "if n > tonumber(ARGV[1]) then return n end "
                                  "return redis.call('GETDEL', KEYS[1])";

/* GETDEL key, through TAKE_SCRIPT unless the store refused scripts: SKV_OK with k's reply a
 * value or nil, SKV_E_LIMIT for a value too long (left in the store), or store_command's
 * failure. */
static int take_one(struct skv_store *st, const char *key, struct store_call *k)
{
    char max[24];
    snprintf(max, sizeof max, "%llu", (unsigned long long)st->max_value);
    if (!st->no_script) {
        const char *argv[] = {"EVAL", TAKE_SCRIPT, "1", key, max};
        const size_t lens[] = {4, sizeof TAKE_SCRIPT - 1, 1, strlen(key), strlen(max)};
        *k = (struct store_call){.argc = 5, .argv = argv, .lens = lens, .vi = -1, .want = '$', .int_ok = true};
        int rc = store_command(st, k);
        const char *l = k->reply.line;
        if (rc && k->reply.type == '-' &&
            (!strncmp(l, "NOPERM", 6) || !strncmp(l, "NOSCRIPT", 8) || strstr(l, "unknown command"))) {
            st->no_script = true; /* (GETDEL alone from now on: a value too long is then lost) */
            skv_log(SKV_LOG_WARN, "store %s: EVAL refused (%.80s): a take is a plain GETDEL, and a value past "
                    "store-max-bytes is lost at it", st->url, l);
        } else if (!rc && k->reply.type == ':') {
            return skv_errorf(SKV_E_LIMIT, "store %s: a value of %lld bytes, more than store-max-bytes (%s): it stays "
                              "in the store", st->url, k->reply.integer, max);
        } else {
            return rc;
        }
    }
    const char *argv[] = {"GETDEL", key};
    const size_t lens[] = {6, strlen(key)};
    *k = (struct store_call){.argc = 2, .argv = argv, .lens = lens, .vi = -1, .want = '$'};
    return store_command(st, k);
}

int skv_store_take_either(struct skv_store *st, const char *key, const char *alt, const void **data, size_t *n,
                          void **value, bool *took_alt, bool *left)
{
    struct store_call k;
    int rc = SKV_OK;
    *took_alt = false;
    *left = false;
    for (int i = 0; i < (alt ? 2 : 1); i++) {
        if ((rc = take_one(st, i ? alt : key, &k)) || !k.reply.nil) {
            *took_alt = i == 1;
            break;
        }
    }
    if (rc) {
        *left = rc == SKV_E_LIMIT && !k.reply.data && k.reply.type == ':'; /* TAKE_SCRIPT's length */
        st->stats.load_failures++;
        return rc;
    }
    if (k.reply.nil) {
        st->stats.misses++;
        return skv_errorf(SKV_E_NOT_FOUND, "not in the store");
    }
    *data = k.reply.data;
    *n = k.reply.n;
    *value = k.reply.data;
    st->stats.loads++;
    return SKV_OK;
}

void skv_store_value_free(void *value)
{
    free(value);
}

int skv_store_exists(struct skv_store *st, const char *key)
{
    const char *argv[] = {"EXISTS", key};
    const size_t lens[] = {6, strlen(key)};
    struct store_call k = {.argc = 2, .argv = argv, .lens = lens, .vi = -1, .want = ':'};
    if (store_command(st, &k))
        return SKV_E_IO;
    return k.reply.integer > 0 ? SKV_OK : skv_errorf(SKV_E_NOT_FOUND, "not in the store");
}

int skv_store_delete_many(struct skv_store *st, const char *const *keys, int n, int *deleted)
{
    *deleted = 0;
    if (n <= 0)
        return SKV_OK;
    const char **argv = malloc((size_t)(n + 1) * sizeof *argv);
    size_t *lens = malloc((size_t)(n + 1) * sizeof *lens);
    if (!argv || !lens) {
        free(argv);
        free(lens);
        return SKV_E_NOMEM;
    }
    argv[0] = "DEL";
    lens[0] = 3;
    for (int i = 0; i < n; i++) {
        argv[i + 1] = keys[i];
        lens[i + 1] = strlen(keys[i]);
    }
    struct store_call k = {.argc = n + 1, .argv = argv, .lens = lens, .vi = -1, .want = ':'};
    int rc = store_command(st, &k);
    free(argv);
    free(lens);
    if (rc) {
        st->stats.load_failures++;
        return SKV_E_IO;
    }
    *deleted = k.reply.integer > 0 ? (int)k.reply.integer : 0;
    return SKV_OK;
}

int skv_store_delete(struct skv_store *st, const char *key)
{
    int deleted, rc = skv_store_delete_many(st, &key, 1, &deleted); /* (a RELEASE of a session not here) */
    if (rc)
        return rc;
    return deleted > 0 ? SKV_OK : skv_errorf(SKV_E_NOT_FOUND, "not in the store");
}

int skv_store_scan(struct skv_store *st, uint64_t *cursor, const char *match, char **keys, int *n)
{
    *keys = NULL;
    *n = 0;
    char at[24];
    snprintf(at, sizeof at, "%llu", (unsigned long long)*cursor);
    const char *argv[] = {"SCAN", at, "MATCH", match, "COUNT", "1000"};
    const size_t lens[] = {4, strlen(at), 5, strlen(match), 5, 4};
    struct store_call k = {.argc = 6, .argv = argv, .lens = lens, .vi = -1, .want = '*'};
    if (store_command(st, &k)) {
        st->stats.load_failures++;
        return SKV_E_IO;
    }
    *keys = k.reply.data ? k.reply.data : NULL;
    *n = (int)k.reply.n;
    *cursor = k.reply.cursor;
    return SKV_OK;
}

bool skv_store_refused(const struct skv_store *st)
{
    return st && st->refused;
}

/* The GETRANGEs of skv_store_tails sent one after the other, none waiting for its reply: 0, or
 * stream_command's -1 with v's err or rc. */
static int send_tails(struct skv_store *st, const char *const *keys, int n, const char *from, struct store_value *v)
{
    for (int i = 0; i < n; i++) {
        const char *argv[] = {"GETRANGE", keys[i], from, "-1"};
        const size_t lens[] = {8, strlen(keys[i]), strlen(from), 2};
        if (stream_command(st, 4, argv, lens, -1, v) != 0)
            return -1;
    }
    return 0;
}

int skv_store_tails(struct skv_store *st, const char *const *keys, int n, size_t cap, unsigned char *out,
                    size_t *got, signed char *state)
{
    for (int i = 0; i < n; i++) {
        got[i] = 0;
        state[i] = SKV_TAIL_VALUE;
    }
    st->refused = false;
    if (n <= 0)
        return SKV_OK;
    char from[24];
    snprintf(from, sizeof from, "-%zu", cap);
    for (int attempt = 0;; attempt++) {
        bool reused;
        if (store_ready(st, &reused)) {
            st->stats.load_failures++;
            return SKV_E_IO;
        }
        struct store_value v = {0};
        deadline_start(st, 0); /* one deadline for the whole batch: its replies are small */
        bool sent = send_tails(st, keys, n, from, &v) == 0;
        if (!sent && !v.err) { /* no memory */
            store_drop(st);
            st->stats.load_failures++;
            return v.rc;
        }
        if (!sent && reused && attempt == 0 && (v.err == EPIPE || v.err == ECONNRESET)) {
            store_drop(st); /* (a read: sent again, whatever of it went out) */
            continue;
        }
        /* every reply is read, an error's too, so the connection stays in step */
        int e = sent ? 0 : v.err;
        bool refused = false, other = false;
        char first_refused[300] = "", first_other[300] = "";
        const uint64_t deadline = st->deadline_ms;
        for (int i = 0; i < n && !e; i++) {
            struct store_reply r = {0};
            e = read_reply(st, "GETRANGE", true, &r);
            st->deadline_ms = deadline; /* (read_reply gives a string time of its own: not here) */
            if (e < 0 && r.rc != SKV_E_IO) { /* no memory, a tail past store-max-bytes */
                store_drop(st);
                st->stats.load_failures++;
                return r.rc;
            }
            if (e)
                break;
            if (r.type == '$' && !r.nil) {
                got[i] = r.n < cap ? r.n : cap;
                memcpy(out + (size_t)i * cap, r.data, got[i]);
            } else if (r.type != '$') {
                bool noperm = r.type == '-' && strncmp(r.line, "NOPERM", 6) == 0;
                state[i] = noperm ? SKV_TAIL_REFUSED : SKV_TAIL_ERROR;
                bool *seen = noperm ? &refused : &other;
                char *why = noperm ? first_refused : first_other;
                if (!*seen) {
                    *seen = true;
                    if (r.type == '-')
                        snprintf(why, sizeof first_refused, "%.256s", r.line);
                    else
                        snprintf(why, sizeof first_refused, "an unexpected answer ('%c')", r.type);
                }
            }
            free(r.data);
        }
        if (e) {
            st->stats.load_failures++;
            return store_io_failed(st, e, sent);
        }
        st->retry_ms = STORE_RETRY_MS; /* it answered */
        if (other && store_moved(first_other))
            store_drop(st);
        if (other || refused) { /* the first answer of another error, else the first NOPERM */
            st->refused = !other;
            st->stats.load_failures++;
            return skv_errorf(SKV_E_IO, "store %s: GETRANGE: %s", st->url, other ? first_other : first_refused);
        }
        return SKV_OK;
    }
}
