/* The real daemon on temporary ipc endpoints with the default model, driven by several
 * client processes through libsnapkv: handshake, admin commands, errors, a second daemon
 * on the same endpoint, malformed frames, the HTTP /metrics endpoint, and SIGTERM. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "libclient/snapkv.h"
#include "tests/common/fixture.h"

struct daemon {
    pid_t pid;
    char dir[64];
    char endpoint[128];
    char admin[128];
    char log[128];
    int metrics_port;
};

static char *model_path(void)
{
    const char *env = getenv("SKV_MODEL");
    const char *src = getenv("SKV_SRCDIR") ? getenv("SKV_SRCDIR") : ".";
    char *p = malloc(4096);
    if (env && *env)
        snprintf(p, 4096, "%s", env);
    else
        snprintf(p, 4096, "%s/models/SmolLM2-135M-Instruct.Q4_1.gguf", src);
    struct stat sb;
    if (stat(p, &sb) != 0) {
        free(p);
        return NULL;
    }
    return p;
}

/* extra, extra2: more options for this daemon, or NULL. */
static pid_t spawn_daemon(const struct daemon *d, const char *model, const char *extra, const char *extra2)
{
    const char *build = getenv("SKV_BUILDDIR") ? getenv("SKV_BUILDDIR") : ".";
    char exe[4096];
    snprintf(exe, sizeof exe, "%s/snapkvd", build);
    pid_t pid = fork();
    if (pid == 0) {
        char ep[160], aep[160], mo[4200], sd[120], ml[64];
        snprintf(ep, sizeof ep, "--endpoint=%s", d->endpoint);
        snprintf(ml, sizeof ml, "--metrics-listen=127.0.0.1:%d", d->metrics_port);
        snprintf(aep, sizeof aep, "--admin-endpoint=%s", d->admin);
        snprintf(mo, sizeof mo, "--model=%s", model);
        snprintf(sd, sizeof sd, "--state-dir=%s", d->dir);
        FILE *f = freopen(d->log, "a", stderr);
        (void)f;
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* a test that dies leaves no daemon behind */
        execl(exe, exe, ep, aep, mo, sd, ml, "--threads=1", "--backend=cpu", "--log-level=debug", "--kv-block-tokens=8",
              extra, extra2, (char *)NULL);
        _exit(127);
    }
    return pid;
}

/* Waits until HELLO answers (the model is loaded); false after ~60 s or if the daemon died. */
static bool wait_ready(struct daemon *d)
{
    for (int i = 0; i < 600; i++) {
        int st;
        if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
            d->pid = 0;
            return false;
        }
        snapkv_client_t *c = NULL;
        struct snapkv_connect_opts o = {.timeout_ms = 200};
        if (snapkv_connect(d->endpoint, &o, &c) == SNAPKV_OK) {
            snapkv_close(&c);
            return true;
        }
        usleep(100 * 1000);
    }
    return false;
}

static int setup(void **state)
{
    char *model = model_path();
    if (!model) {
        *state = NULL;
        return 0;
    }
    struct daemon *d = calloc(1, sizeof *d);
    snprintf(d->dir, sizeof d->dir, "/tmp/skv-it-XXXXXX");
    if (!mkdtemp(d->dir))
        return -1;
    snprintf(d->endpoint, sizeof d->endpoint, "ipc://%s/c.sock", d->dir);
    snprintf(d->admin, sizeof d->admin, "ipc://%s/a.sock", d->dir);
    snprintf(d->log, sizeof d->log, "%s/daemon.log", d->dir);
    if ((d->metrics_port = fixture_free_port()) < 0)
        return -1;
    d->pid = spawn_daemon(d, model, NULL, NULL);
    free(model);
    if (!wait_ready(d)) {
        fprintf(stderr, "daemon did not come up; see %s\n", d->log);
        return -1;
    }
    *state = d;
    return 0;
}

static int teardown(void **state)
{
    struct daemon *d = *state;
    if (!d)
        return 0;
    if (d->pid > 0) {
        kill(d->pid, SIGKILL);
        waitpid(d->pid, NULL, 0);
    }
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf %s", d->dir);
    if (system(cmd) != 0)
        return -1;
    free(d);
    return 0;
}

#define NEED_DAEMON(d)                                                                             \
    struct daemon *d = *state;                                                                     \
    if (!d)                                                                                        \
        skip();

static void test_hello(void **state)
{
    NEED_DAEMON(d);
    snapkv_client_t *c = NULL;
    assert_int_equal(snapkv_connect(d->endpoint, NULL, &c), SNAPKV_OK);
    struct snapkv_server_info in;
    assert_int_equal(snapkv_server_info(c, &in), SNAPKV_OK);
    assert_int_equal(in.n_layers, 30);
    assert_int_equal(in.n_heads, 9);
    assert_int_equal(in.n_kv_heads, 3);
    assert_int_equal(in.head_dim, 64);
    assert_int_equal(in.n_vocab, 49152);
    assert_string_equal(in.backend, "cpu");
    assert_int_equal(strlen(in.model_fingerprint), 64);
    assert_int_equal(in.kv_block_tokens, 8); /* as configured */
    snapkv_close(&c);
    assert_null(c);
    snapkv_close(&c); /* NULL is fine */

    /* the client's name is in the log (at debug) as one line: a newline in it cannot start a
     * line that looks like the daemon's own, nor a quote end the name's */
    struct snapkv_connect_opts o = {.name = "probe\nerror: \"fake\""};
    assert_int_equal(snapkv_connect(d->endpoint, &o, &c), SNAPKV_OK);
    snapkv_close(&c);
    static char text[1 << 20];
    FILE *f = fopen(d->log, "r");
    assert_non_null(f);
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    assert_non_null(strstr(text, "hello from client \"probe?error: 'fake'\" (tenant \"default\""));
    assert_null(strstr(text, "\nerror: \"fake"));
}

static void test_admin(void **state)
{
    NEED_DAEMON(d);
    snapkv_client_t *a = NULL;
    assert_int_equal(snapkv_connect(d->admin, NULL, &a), SNAPKV_OK);
    struct snapkv_status_info s;
    assert_int_equal(snapkv_admin_status(a, &s), SNAPKV_OK);
    assert_string_equal(s.backend, "cpu");
    assert_int_equal(s.threads, 1);
    assert_int_equal(s.pool_bytes_total, UINT64_C(1) << 30);
    /* clients: those of the client endpoint whose connection is open (it was always 0) */
    snapkv_client_t *c1 = NULL, *c2 = NULL;
    assert_int_equal(snapkv_connect(d->endpoint, NULL, &c1), SNAPKV_OK);
    assert_int_equal(snapkv_connect(d->endpoint, NULL, &c2), SNAPKV_OK);
    assert_int_equal(snapkv_admin_status(a, &s), SNAPKV_OK);
    assert_true(s.n_clients >= 2);
    snapkv_close(&c1);
    snapkv_close(&c2);
    snapkv_close(&a);
}

static void count_entries(void *user, const char *key, const char *value, const char *help)
{
    int *n = user;
    (*n)++;
    assert_non_null(help);
    if (strcmp(key, "threads") == 0)
        assert_string_equal(value, "1");
}

static void test_config_get(void **state)
{
    NEED_DAEMON(d);
    snapkv_client_t *a = NULL;
    assert_int_equal(snapkv_connect(d->admin, NULL, &a), SNAPKV_OK);
    int n = 0;
    assert_int_equal(snapkv_admin_config_get(a, NULL, count_entries, &n), SNAPKV_OK);
    assert_true(n >= 15);
    n = 0;
    assert_int_equal(snapkv_admin_config_get(a, "threads", count_entries, &n), SNAPKV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(snapkv_admin_config_get(a, "no-such-key", count_entries, &n), SNAPKV_E_NOT_FOUND);
    assert_non_null(strstr(snapkv_last_error(), "no-such-key"));
    snapkv_close(&a);
}

static void test_admin_on_client_socket_refused(void **state)
{
    NEED_DAEMON(d);
    snapkv_client_t *c = NULL;
    assert_int_equal(snapkv_connect(d->endpoint, NULL, &c), SNAPKV_OK);
    struct snapkv_status_info s;
    assert_int_equal(snapkv_admin_status(c, &s), SNAPKV_E_PERM);
    assert_non_null(strstr(snapkv_last_error(), "admin"));
    snapkv_close(&c);
}

/* A raw DEALER on the client endpoint (no libsnapkv): option `opt` set to `value`. */
static void *raw_socket(const struct daemon *d, void *ctx, int opt, int value)
{
    void *s = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(s, opt, &value, sizeof value);
    assert_int_equal(zmq_connect(s, d->endpoint), 0);
    return s;
}

/* True when a raw reply holds status field 3 (sint32) with the zigzag value `zigzag`. */
static bool has_status(const char *buf, int n, char zigzag)
{
    for (int i = 0; i + 1 < n; i++)
        if (buf[i] == 0x18 && buf[i + 1] == zigzag)
            return true;
    return false;
}

/* Writes v as a protobuf varint at msg + *len. */
static void put_varint(uint8_t *msg, size_t *len, size_t v)
{
    for (;; v >>= 7) {
        msg[(*len)++] = (uint8_t)(v & 0x7f) | (v >> 7 ? 0x80 : 0);
        if (!(v >> 7))
            break;
    }
}

/* Raw frames that are not requests get a PROTO reply, strings that are not text an INVAL one;
 * the daemon keeps serving. */
static void test_malformed(void **state)
{
    NEED_DAEMON(d);
    void *ctx = zmq_ctx_new();
    void *s = raw_socket(d, ctx, ZMQ_RCVTIMEO, 5000);
    const char junk[] = "\xff\xff\xff\xff this is not protobuf";
    assert_true(zmq_send(s, junk, sizeof junk, 0) >= 0);
    char buf[4096];
    int n = zmq_recv(s, buf, sizeof buf, 0);
    assert_true(n > 0);
    /* field 3 (status, sint32 zigzag) = SKV_E_PROTO (-5) -> zigzag 9: bytes 0x18 0x09 */
    assert_true(has_status(buf, n, 0x09));
    /* a PREFILL whose text holds a NUL (protobuf-c would cut it there) or a byte that is not
     * UTF-8: SKV_E_INVAL (zigzag 3: bytes 0x18 0x03), naming the field */
    static const struct {
        uint8_t bytes[24];
        size_t len;
        const char *says;
    } texts[] = {
        /* version 1, prefill (field 11) { text (field 2) "hello\0world" } */
        {{0x08, 1, 0x5a, 13, 0x12, 11, 'h', 'e', 'l', 'l', 'o', 0, 'w', 'o', 'r', 'l', 'd'}, 17,
         "prefill.text is not text: a NUL at byte 5"},
        /* version 1, tenant (field 3) "t\xff", prefill { text "hi" } */
        {{0x08, 1, 0x1a, 2, 't', 0xff, 0x5a, 4, 0x12, 2, 'h', 'i'}, 12,
         "tenant is not text: ill-formed UTF-8 at byte 1"},
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        assert_true(zmq_send(s, texts[i].bytes, texts[i].len, 0) >= 0);
        n = zmq_recv(s, buf, sizeof buf, 0);
        assert_true(n > 0);
        assert_true(has_status(buf, n, 0x03));
        assert_non_null(memmem(buf, (size_t)n, texts[i].says, strlen(texts[i].says)));
    }
    /* an IMPORT_KV of a million empty layer entries (2 MB on the wire, some 100 MB unpacked):
     * refused while unpacking, SKV_E_LIMIT (zigzag 21: bytes 0x18 0x15), before it is queued */
    enum { N_EMPTY = 1000000 };
    size_t inner = 2 * (size_t)N_EMPTY, len = 0;
    uint8_t *msg = malloc(inner + 16);
    assert_non_null(msg);
    msg[len++] = 0x08; /* version */
    msg[len++] = (uint8_t)SNAPKV_PROTOCOL_VERSION;
    msg[len++] = 0x8a; /* field 17 (import_kv), length-delimited */
    msg[len++] = 0x01;
    put_varint(msg, &len, inner);
    for (int i = 0; i < N_EMPTY; i++) { /* kept (field 2): empty LayerKept */
        msg[len++] = 0x12;
        msg[len++] = 0x00;
    }
    assert_true(zmq_send(s, msg, len, 0) >= 0);
    free(msg);
    n = zmq_recv(s, buf, sizeof buf, 0);
    assert_true(n > 0);
    assert_true(has_status(buf, n, 0x15));
    assert_non_null(memmem(buf, (size_t)n, "unpacks to more than", 20));
    /* a DECODE padded with an unknown field of 70000 bytes: SKV_E_LIMIT, before it is queued
     * (a running DECODE holds its request for as long as it runs) */
    enum { PAD = 70000 };
    msg = malloc(PAD + 32);
    assert_non_null(msg);
    len = 0;
    msg[len++] = 0x08;
    msg[len++] = (uint8_t)SNAPKV_PROTOCOL_VERSION;
    msg[len++] = 0x6a; /* field 13 (decode), length-delimited */
    put_varint(msg, &len, 2 + 3 + PAD); /* field 99 (unknown): tag 0x9a 0x06, a 3-byte length, the bytes */
    msg[len++] = 0x9a;
    msg[len++] = 0x06;
    put_varint(msg, &len, PAD);
    memset(msg + len, 'p', PAD);
    len += PAD;
    assert_true(zmq_send(s, msg, len, 0) >= 0);
    free(msg);
    n = zmq_recv(s, buf, sizeof buf, 0);
    assert_true(n > 0);
    assert_true(has_status(buf, n, 0x15));
    assert_non_null(memmem(buf, (size_t)n, "a decode request of", 19));
    zmq_close(s);
    zmq_ctx_term(ctx);
    /* still serving */
    snapkv_client_t *c = NULL;
    assert_int_equal(snapkv_connect(d->endpoint, NULL, &c), SNAPKV_OK);
    snapkv_close(&c);
}

static void test_many_clients(void **state)
{
    NEED_DAEMON(d);
    enum { N = 8 };
    pid_t kids[N];
    for (int i = 0; i < N; i++) {
        kids[i] = fork();
        if (kids[i] == 0) {
            int bad = 0;
            for (int k = 0; k < 20; k++) {
                snapkv_client_t *c = NULL;
                char tenant[32];
                snprintf(tenant, sizeof tenant, "tenant-%d", i);
                struct snapkv_connect_opts o = {.tenant = tenant};
                if (snapkv_connect(k % 2 ? d->admin : d->endpoint, &o, &c) != SNAPKV_OK) {
                    bad++;
                    continue;
                }
                struct snapkv_status_info s;
                if (k % 2 && snapkv_admin_status(c, &s) != SNAPKV_OK)
                    bad++;
                snapkv_close(&c);
            }
            _exit(bad ? 1 : 0);
        }
    }
    for (int i = 0; i < N; i++) {
        int st;
        assert_int_equal(waitpid(kids[i], &st, 0), kids[i]);
        assert_true(WIFEXITED(st));
        assert_int_equal(WEXITSTATUS(st), 0);
    }
}

/* Starts `second` and expects it to exit with a failure status and a log line holding both
 * `what` and `and` (NULL: only what). */
/* A daemon started as `second` (with one more option `extra`, or NULL) exits non-zero and logs
 * a line with `what` (and `and`). */
static void expect_start_refused_with(const struct daemon *second, const char *extra, const char *what,
                                      const char *and)
{
    char *model = model_path();
    pid_t pid = spawn_daemon(second, model, extra, NULL);
    free(model);
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st));
    assert_int_not_equal(WEXITSTATUS(st), 0);
    FILE *f = fopen(second->log, "r");
    assert_non_null(f);
    char line[1024];
    bool said = false;
    while (fgets(line, sizeof line, f))
        said |= strstr(line, what) != NULL && (!and || strstr(line, and) != NULL);
    fclose(f);
    assert_true(said);
}

static void expect_start_refused(const struct daemon *second, const char *what, const char *and)
{
    expect_start_refused_with(second, NULL, what, and);
}

static void test_second_daemon_refused(void **state)
{
    NEED_DAEMON(d);
    struct daemon second = *d;
    snprintf(second.log, sizeof second.log, "%s/second.log", d->dir);
    expect_start_refused(&second, "another snapkvd", NULL);
    /* an abstract name (no file mode: any local user could connect) is refused */
    snprintf(second.admin, sizeof second.admin, "ipc://@skv-test-%d", (int)getpid());
    snprintf(second.endpoint, sizeof second.endpoint, "ipc://%s/c2.sock", d->dir);
    snprintf(second.log, sizeof second.log, "%s/third.log", d->dir);
    expect_start_refused(&second, "abstract", NULL);
    /* a default-compress that does not parse refuses the start (it failed each PREFILL before) */
    snprintf(second.admin, sizeof second.admin, "ipc://%s/a2.sock", d->dir);
    snprintf(second.log, sizeof second.log, "%s/fourth.log", d->dir);
    expect_start_refused_with(&second, "--default-compress=policy=snapk", "default-compress", "policy");
    /* a log file it makes is its user's alone, whatever the umask (the log names tenants) */
    char own_log[160], opt[200];
    snprintf(own_log, sizeof own_log, "%s/own.log", d->dir);
    snprintf(opt, sizeof opt, "--log-file=%s", own_log);
    snprintf(second.log, sizeof second.log, "%s/own-stderr.log", d->dir);
    snprintf(second.admin, sizeof second.admin, "ipc://%s/a.sock", d->dir); /* refused: in use */
    mode_t old_mask = umask(0);
    char *model = model_path();
    pid_t pid = spawn_daemon(&second, model, opt, NULL);
    free(model);
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    umask(old_mask);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) != 0);
    struct stat lst;
    assert_int_equal(stat(own_log, &lst), 0);
    assert_int_equal(lst.st_mode & 0777, 0600);
    FILE *lf = fopen(own_log, "r");
    char line[1024];
    bool said = false;
    while (lf && fgets(line, sizeof line, lf))
        said |= strstr(line, "another snapkvd") != NULL;
    if (lf)
        fclose(lf);
    assert_true(said);
    /* persist = yes with a state directory it cannot write: refused at start, not at the stop
     * that would lose every session */
    snprintf(second.admin, sizeof second.admin, "ipc://%s/a2.sock", d->dir);
    snprintf(second.log, sizeof second.log, "%s/fifth.log", d->dir);
    snprintf(second.dir, sizeof second.dir, "/nonexistent/state"); /* its --state-dir */
    expect_start_refused_with(&second, "--persist=yes", "persist = yes", "cannot be made");
    /* the first one still answers; its sockets were made 0600 (the admin one stays so, the
     * client one is then 0660), never with the service's umask */
    snapkv_client_t *c = NULL;
    assert_int_equal(snapkv_connect(d->endpoint, NULL, &c), SNAPKV_OK);
    snapkv_close(&c);
    struct stat sb;
    assert_int_equal(stat(d->admin + 6, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0600);
    assert_int_equal(stat(d->endpoint + 6, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0660);
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A connection to the daemon's HTTP port (10 s receive timeout), or -1 when none is taken. */
static int metrics_try_connect(const struct daemon *d)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)d->metrics_port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    struct timeval tv = {.tv_sec = 10};
    assert_true(fd >= 0);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int metrics_connect(const struct daemon *d)
{
    int fd = metrics_try_connect(d);
    assert_true(fd >= 0);
    return fd;
}

/* Reads until the server closes; returns the NUL-terminated length. */
static size_t read_all(int fd, char *buf, size_t cap)
{
    size_t len = 0;
    ssize_t k;
    while (len < cap - 1 && (k = recv(fd, buf + len, cap - 1 - len, 0)) > 0)
        len += (size_t)k;
    buf[len] = '\0';
    return len;
}

/* Sends a raw request and returns the whole answer (malloc'd). */
static char *http(const struct daemon *d, const char *request, size_t len)
{
    int fd = metrics_connect(d);
    assert_int_equal(send(fd, request, len, MSG_NOSIGNAL), (ssize_t)len);
    char *buf = malloc(1 << 16);
    read_all(fd, buf, 1 << 16);
    close(fd);
    return buf;
}

/* GET path: the HTTP status, and the body into body. */
static int probe(const struct daemon *d, const char *path, char *body, size_t cap)
{
    char req[256];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: localhost\r\n\r\n", path);
    char *r = http(d, req, (size_t)n);
    int code = 0;
    assert_int_equal(sscanf(r, "HTTP/1.1 %d", &code), 1);
    const char *b = strstr(r, "\r\n\r\n");
    snprintf(body, cap, "%s", b ? b + 4 : "");
    free(r);
    return code;
}

/* Asks path until its body holds `want` (and, when given, `also`), for at most 20 s; its status. */
static int probe_until(const struct daemon *d, const char *path, const char *want, const char *also, char *body,
                       size_t cap)
{
    int code = 0;
    for (int i = 0; i < 400; i++) {
        code = probe(d, path, body, cap);
        if (strstr(body, want) && (!also || strstr(body, also)))
            return code;
        usleep(50 * 1000);
    }
    fail_msg("%s never said '%s'%s%s: last %d '%s'", path, want, also ? " and " : "", also ? also : "", code, body);
    return code;
}

/* The "# TYPE" lines of a Prometheus text, in order. */
static void type_lines(const char *text, char *out, size_t cap)
{
    size_t at = 0;
    out[0] = '\0';
    for (const char *p = strstr(text, "# TYPE "); p && at < cap; p = strstr(p + 1, "# TYPE ")) {
        const char *nl = strchr(p, '\n');
        size_t n = nl ? (size_t)(nl - p + 1) : strlen(p);
        at += (size_t)snprintf(out + at, cap - at, "%.*s", (int)n, p);
    }
}

static double metric_value(const char *text, const char *name)
{
    char needle[96];
    snprintf(needle, sizeof needle, "\n%s ", name);
    const char *p = strstr(text, needle);
    assert_non_null(p);
    return strtod(p + strlen(needle), NULL);
}

/* GET /metrics answers the same exposition as admin STATS --prometheus. */
static void test_metrics_http(void **state)
{
    NEED_DAEMON(d);
    snapkv_client_t *a = NULL;
    assert_int_equal(snapkv_connect(d->admin, NULL, &a), SNAPKV_OK);
    struct snapkv_stats st;
    assert_int_equal(snapkv_admin_stats(a, true, &st), SNAPKV_OK);
    usleep(1100 * 1000); /* the worker publishes its snapshot at least once a second */

    const char get[] = "GET /metrics HTTP/1.1\r\nHost: localhost\r\nUser-Agent: test\r\n\r\n";
    char *r = http(d, get, sizeof get - 1);
    assert_true(strncmp(r, "HTTP/1.1 200 OK\r\n", 17) == 0);
    assert_non_null(strstr(r, "Content-Type: text/plain; version=0.0.4"));
    char *body = strstr(r, "\r\n\r\n");
    assert_non_null(body);
    body += 4;
    const char *cl = strstr(r, "Content-Length: ");
    assert_non_null(cl);
    assert_int_equal(strtoul(cl + 16, NULL, 10), strlen(body));
    char want[4096], got[4096];
    type_lines(st.prometheus_text, want, sizeof want);
    type_lines(body, got, sizeof got);
    assert_true(strlen(want) > 200);
    assert_string_equal(got, want);
    const char *gauges[] = {"snapkv_sessions", "snapkv_pool_bytes_used", "snapkv_pool_bytes_free"};
    for (int i = 0; i < 3; i++)
        assert_true(metric_value(body, gauges[i]) == metric_value(st.prometheus_text, gauges[i]));
    assert_true(metric_value(body, "snapkv_pool_bytes_free") == (double)(UINT64_C(1) << 30));
    /* STATS counted itself: the snapshot taken after it has it too */
    assert_true(metric_value(body, "snapkv_requests_total") >= metric_value(st.prometheus_text, "snapkv_requests_total"));
    snapkv_stats_free(&st);
    snapkv_close(&a);
    free(r);

    const char head[] = "HEAD /metrics?x=1 HTTP/1.0\r\n\r\n";
    r = http(d, head, sizeof head - 1);
    assert_true(strncmp(r, "HTTP/1.1 200 OK\r\n", 17) == 0);
    assert_string_equal(strstr(r, "\r\n\r\n"), "\r\n\r\n"); /* no body */
    free(r);
    const char other[] = "GET /other HTTP/1.1\r\n\r\n";
    r = http(d, other, sizeof other - 1);
    assert_true(strncmp(r, "HTTP/1.1 404 Not Found\r\n", 24) == 0);
    free(r);
    const char head_other[] = "HEAD /other HTTP/1.1\r\n\r\n"; /* the headers alone (it had the body) */
    r = http(d, head_other, sizeof head_other - 1);
    assert_true(strncmp(r, "HTTP/1.1 404 Not Found\r\n", 24) == 0);
    assert_non_null(strstr(r, "Content-Length: 14\r\n")); /* that of "404 Not Found\n", as GET's */
    assert_string_equal(strstr(r, "\r\n\r\n"), "\r\n\r\n");
    free(r);
    const char post[] = "POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc";
    r = http(d, post, sizeof post - 1);
    assert_true(strncmp(r, "HTTP/1.1 405 ", 13) == 0);
    assert_non_null(strstr(r, "Allow: GET, HEAD\r\n"));
    free(r);
    char text[512];
    assert_int_equal(probe(d, "/healthz", text, sizeof text), 200);
    assert_string_equal(text, "ok\n");
    assert_int_equal(probe(d, "/readyz?verbose=1", text, sizeof text), 200);
    assert_string_equal(text, "ready\n");
    const char head_ready[] = "HEAD /readyz HTTP/1.1\r\n\r\n";
    r = http(d, head_ready, sizeof head_ready - 1);
    assert_true(strncmp(r, "HTTP/1.1 200 OK\r\n", 17) == 0);
    assert_non_null(strstr(r, "Cache-Control: no-store\r\n"));
    assert_string_equal(strstr(r, "\r\n\r\n"), "\r\n\r\n");
    free(r);
    const char junk[] = "\x16\x03\x01 not http\r\n\r\n";
    r = http(d, junk, sizeof junk - 1);
    assert_true(strncmp(r, "HTTP/1.1 400 ", 13) == 0);
    free(r);
}

/* An oversized request gets 431; a silent connection gets 408 after the timeout, and while it
 * is held the ZeroMQ endpoints answer as usual. */
static void test_metrics_limits(void **state)
{
    NEED_DAEMON(d);
    char *big = malloc(20000);
    memcpy(big, "GET /metrics HTTP/1.1\r\nX-Pad: ", 31);
    memset(big + 31, 'a', 20000 - 31);
    int fd = metrics_connect(d);
    send(fd, big, 20000, MSG_NOSIGNAL); /* the daemon may close before reading it all */
    char buf[4096];
    read_all(fd, buf, sizeof buf);
    close(fd);
    free(big);
    assert_true(strncmp(buf, "HTTP/1.1 431 ", 13) == 0);

    int64_t t0 = now_ms();
    int silent = metrics_connect(d);
    snapkv_client_t *a = NULL;
    assert_int_equal(snapkv_connect(d->admin, NULL, &a), SNAPKV_OK);
    struct snapkv_status_info s;
    assert_int_equal(snapkv_admin_status(a, &s), SNAPKV_OK);
    snapkv_close(&a);
    /* served while the silent connection is still held (not yet answered 408; unless this took
     * most of the 2 s, as a loaded machine may) */
    struct pollfd pf = {.fd = silent, .events = POLLIN};
    if (now_ms() - t0 < 1500)
        assert_int_equal(poll(&pf, 1, 0), 0);
    read_all(silent, buf, sizeof buf);
    int64_t held = now_ms() - t0;
    close(silent);
    assert_true(strncmp(buf, "HTTP/1.1 408 ", 13) == 0);
    assert_true(held >= 1500 && held < 10000);
    printf("# silent HTTP connection closed after %lld ms\n", (long long)held);

    const char get[] = "GET /metrics HTTP/1.1\r\n\r\n";
    char *r = http(d, get, sizeof get - 1);
    assert_true(strncmp(r, "HTTP/1.1 200 OK\r\n", 17) == 0);
    free(r);

    /* 40 silent connections (more than the 32 served at once): a scrape is answered at once,
     * not after each of them timed out (one at a time, 2 s each, before); the silent one that
     * waited longest makes room */
    enum { N_IDLE = 40 };
    int idle[N_IDLE];
    int64_t opened = now_ms();
    for (int i = 0; i < N_IDLE; i++)
        idle[i] = metrics_connect(d);
    usleep(100 * 1000);
    t0 = now_ms();
    r = http(d, get, sizeof get - 1);
    int64_t took = now_ms() - t0, since_opened = now_ms() - opened;
    assert_true(strncmp(r, "HTTP/1.1 200 OK\r\n", 17) == 0);
    free(r);
    /* answered while silent connections are still held unanswered: served one at a time, each
     * would have had its 408 (or been closed) before the scrape was read */
    int unanswered = 0;
    for (int i = 0; i < N_IDLE; i++) {
        struct pollfd q = {.fd = idle[i], .events = POLLIN};
        unanswered += poll(&q, 1, 0) == 0;
    }
    printf("# a scrape behind %d silent connections: %lld ms, %d of them still unanswered\n", N_IDLE,
           (long long)took, unanswered);
    if (since_opened < 1500) /* (else the earliest may have had their 408 by now, rightly) */
        assert_true(unanswered > 0);
    for (int i = 0; i < N_IDLE; i++)
        close(idle[i]);
}

/* A flood of silent connections from one address (127.0.0.1) does not push out a scraper's from
 * another (127.0.0.2, connected before the flood and sending its request after it): the
 * connection closed to make room is the flood's own (before, the one silent the longest: the
 * scraper's, which read a close and no answer). */
static void test_metrics_flood(void **state)
{
    NEED_DAEMON(d);
    int scraper = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(scraper >= 0);
    struct sockaddr_in from = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000002)};
    assert_int_equal(bind(scraper, (struct sockaddr *)&from, sizeof from), 0);
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)d->metrics_port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    struct timeval tv = {.tv_sec = 10};
    setsockopt(scraper, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    assert_int_equal(connect(scraper, (struct sockaddr *)&to, sizeof to), 0);
    usleep(100 * 1000); /* accepted: the oldest silent connection there is */
    enum { N_FLOOD = 80 }; /* 2.5 x the 32 served at once */
    int flood[N_FLOOD];
    for (int i = 0; i < N_FLOOD; i++) {
        flood[i] = metrics_connect(d);
        usleep(2000); /* each accepted before the next: every one past the 32nd takes a slot */
    }
    usleep(100 * 1000);
    const char get[] = "GET /metrics HTTP/1.1\r\n\r\n";
    assert_int_equal(send(scraper, get, sizeof get - 1, MSG_NOSIGNAL), (ssize_t)(sizeof get - 1));
    char *buf = malloc(1 << 16);
    read_all(scraper, buf, 1 << 16);
    close(scraper);
    int closed = 0; /* the flood's connections closed to make room: read 0 bytes (no answer) */
    for (int i = 0; i < N_FLOOD; i++) {
        struct pollfd q = {.fd = flood[i], .events = POLLIN};
        char c;
        closed += poll(&q, 1, 0) == 1 && recv(flood[i], &c, 1, MSG_DONTWAIT) == 0;
        close(flood[i]);
    }
    printf("# a scrape from 127.0.0.2 behind %d silent connections from 127.0.0.1: %.17s; %d of them closed\n",
           N_FLOOD, buf, closed);
    assert_true(strncmp(buf, "HTTP/1.1 200 OK\r\n", 17) == 0);
    free(buf);
}

/* Two daemons with persist on one state-dir: the second is refused at start, naming the first's
 * pid (before, it started, restored the first one's sessions under their ids and deleted the
 * first one's files at its start and at each checkpoint); the first stops cleanly after. */
static void test_state_dir_locked(void **state)
{
    NEED_DAEMON(d);
    struct daemon first = *d, second;
    snprintf(first.endpoint, sizeof first.endpoint, "ipc://%s/c3.sock", d->dir);
    snprintf(first.admin, sizeof first.admin, "ipc://%s/a3.sock", d->dir);
    snprintf(first.log, sizeof first.log, "%s/locked-first.log", d->dir);
    assert_true((first.metrics_port = fixture_free_port()) > 0);
    assert_true(strlen(first.dir) + sizeof "/locked" <= sizeof first.dir);
    strcat(first.dir, "/locked");
    assert_int_equal(mkdir(first.dir, 0700), 0);
    char *model = model_path();
    first.pid = spawn_daemon(&first, model, "--persist=yes", NULL);
    free(model);
    assert_true(wait_ready(&first));
    second = first;
    snprintf(second.endpoint, sizeof second.endpoint, "ipc://%s/c4.sock", d->dir);
    snprintf(second.admin, sizeof second.admin, "ipc://%s/a4.sock", d->dir);
    snprintf(second.log, sizeof second.log, "%s/locked-second.log", d->dir);
    assert_true((second.metrics_port = fixture_free_port()) > 0);
    char pid[32];
    snprintf(pid, sizeof pid, "(pid %d)", (int)first.pid);
    expect_start_refused_with(&second, "--persist=yes", "another snapkvd", pid);
    assert_int_equal(kill(first.pid, SIGTERM), 0);
    int st;
    assert_int_equal(waitpid(first.pid, &st, 0), first.pid);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* The names, sizes and SHA-256 of the files under <dir>/persist but its lock (which a start
 * writes its pid in), into the file `out`. */
static void persist_digest(const char *dir, const char *out)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "cd '%s' && find persist -type f ! -name .lock -print0 | sort -z | xargs -0 -r sha256sum > '%s' && "
             "grep -q '\\.skv$' '%s'", dir, out, out);
    if (system(cmd) != 0)
        fail_msg("no saved session under %s/persist (%s)", dir, out);
}

/* A metrics port already taken stops the daemon from starting, with the reason, before its engine
 * starts: no restore of the persisted sessions first (minutes for a large pool; the state
 * directory holds a saved session, whose restore would say "persist: restored") and no save at
 * the stop after it (the files as they were). */
static void test_metrics_port_taken(void **state)
{
    NEED_DAEMON(d);
    struct daemon second = *d;
    snprintf(second.endpoint, sizeof second.endpoint, "ipc://%s/c2.sock", d->dir);
    snprintf(second.admin, sizeof second.admin, "ipc://%s/a2.sock", d->dir);
    snprintf(second.log, sizeof second.log, "%s/metrics-saved.log", d->dir);
    assert_true(strlen(second.dir) + sizeof "/taken" <= sizeof second.dir);
    strcat(second.dir, "/taken");
    assert_int_equal(mkdir(second.dir, 0700), 0);
    /* first a session saved there, by a daemon on a free port */
    assert_true((second.metrics_port = fixture_free_port()) > 0);
    char *model = model_path();
    second.pid = spawn_daemon(&second, model, "--persist=yes", NULL);
    free(model);
    assert_true(wait_ready(&second));
    snapkv_client_t *c = NULL;
    assert_int_equal(snapkv_connect(second.endpoint, NULL, &c), SNAPKV_OK);
    struct snapkv_prefill_result r = {0};
    assert_int_equal(snapkv_prefill(c, &(struct snapkv_prefill_opts){.text = "kept across the refused start"}, &r),
                     SNAPKV_OK);
    snapkv_prefill_result_free(&r);
    snapkv_close(&c);
    assert_int_equal(kill(second.pid, SIGTERM), 0);
    int st;
    assert_int_equal(waitpid(second.pid, &st, 0), second.pid);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    char before[512], after[512], cmd[1200];
    snprintf(before, sizeof before, "%s/persist-before.txt", d->dir);
    snprintf(after, sizeof after, "%s/persist-after.txt", d->dir);
    persist_digest(second.dir, before);
    /* then the start on the taken port */
    second.metrics_port = d->metrics_port;
    snprintf(second.log, sizeof second.log, "%s/metrics-taken.log", d->dir);
    expect_start_refused_with(&second, "--persist=yes", "metrics-listen", "in use");
    persist_digest(second.dir, after);
    snprintf(cmd, sizeof cmd, "cmp -s '%s' '%s'", before, after);
    assert_int_equal(system(cmd), 0);
    FILE *f = fopen(second.log, "r");
    assert_non_null(f);
    char line[1024];
    int engine_lines = 0;
    while (fgets(line, sizeof line, f))
        engine_lines += strstr(line, "persist:") != NULL;
    fclose(f);
    assert_int_equal(engine_lines, 0);
}

static void config_value(void *user, const char *key, const char *value, const char *help)
{
    (void)key;
    (void)help;
    snprintf(user, 64, "%s", value);
}

static void config_value_long(void *user, const char *key, const char *value, const char *help)
{
    (void)key;
    (void)help;
    snprintf(user, 4096, "%s", value);
}

/* A PREFILL of text: its status; the message must hold `msg` (and, when given, not `not`). */
static int prefill_text(snapkv_client_t *c, const char *text, const char *msg, const char *not)
{
    struct snapkv_prefill_opts o = {.text = text};
    struct snapkv_prefill_result r = {0};
    int rc = snapkv_prefill(c, &o, &r);
    if (rc == SNAPKV_OK)
        snapkv_release(c, &r.id);
    else if ((msg && !strstr(snapkv_last_error(), msg)) || (not && strstr(snapkv_last_error(), not)))
        fail_msg("PREFILL: %d '%s', want '%s'", rc, snapkv_last_error(), msg ? msg : "");
    snapkv_prefill_result_free(&r);
    return rc;
}

/* " x" n times: n + 1 tokens of the default model's vocabulary in 2n bytes. */
static char *xs(size_t n)
{
    char *t = malloc(2 * n + 1);
    for (size_t i = 0; i < n; i++)
        memcpy(t + 2 * i, " x", 2);
    t[2 * n] = '\0';
    return t;
}

/* Default limits: a text longer than 8192 tokens can span is refused for its bytes; one within
 * that but over 8192 tokens is refused once tokenizing reaches the limit (the message says so
 * rather than giving the whole count, which was never computed); the daemon serves on. */
static void test_text_limits(void **state)
{
    NEED_DAEMON(d);
    snapkv_client_t *c = NULL, *a = NULL;
    assert_int_equal(snapkv_connect(d->endpoint, NULL, &c), SNAPKV_OK);
    assert_int_equal(snapkv_connect(d->admin, NULL, &a), SNAPKV_OK);
    char v[64];
    assert_int_equal(snapkv_admin_config_get(a, "max-queued-bytes", config_value, v), SNAPKV_OK);
    assert_string_equal(v, "268435456");
    assert_int_equal(snapkv_admin_config_get(a, "max-text-bytes", config_value, v), SNAPKV_OK);
    assert_string_equal(v, "0");

    char *t = xs(10000);
    assert_int_equal(prefill_text(c, t, "the text is more than 8192 tokens", "10001"), SNAPKV_E_LIMIT);
    free(t);
    /* 8192 tokens span at most 8192 times the longest token: ask for a text far past any vocabulary's */
    size_t n = 8192 * 256 + 1;
    t = malloc(n + 1);
    memset(t, 'a', n);
    t[n] = '\0';
    assert_int_equal(prefill_text(c, t, "more than the limit of 8192 tokens can span", NULL), SNAPKV_E_LIMIT);
    free(t);
    t = xs(100); /* fits: served */
    assert_int_equal(prefill_text(c, t, NULL, NULL), SNAPKV_OK);
    free(t);
    snapkv_close(&a);
    snapkv_close(&c);
}

/* A second daemon with one or two more options (extra2 may be NULL), in a directory of its own;
 * true once it answers. */
static bool second_daemon(struct daemon *e, const char *extra, const char *extra2)
{
    *e = (struct daemon){0};
    snprintf(e->dir, sizeof e->dir, "/tmp/skv-it-XXXXXX");
    assert_non_null(mkdtemp(e->dir));
    snprintf(e->endpoint, sizeof e->endpoint, "ipc://%s/c.sock", e->dir);
    snprintf(e->admin, sizeof e->admin, "ipc://%s/a.sock", e->dir);
    snprintf(e->log, sizeof e->log, "%s/daemon.log", e->dir);
    e->metrics_port = fixture_free_port();
    char *model = model_path();
    e->pid = spawn_daemon(e, model, extra, extra2);
    free(model);
    return wait_ready(e);
}

static void stop_second(struct daemon *e)
{
    if (e->pid > 0) {
        kill(e->pid, SIGKILL);
        waitpid(e->pid, NULL, 0);
    }
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", e->dir);
    assert_int_equal(system(cmd), 0);
}

/* The thread of process pid named `name` (its comm), or 0. */
static pid_t thread_named(pid_t pid, const char *name)
{
    char path[96];
    snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
    DIR *dir = opendir(path);
    pid_t found = 0;
    struct dirent *de;
    while (dir && !found && (de = readdir(dir))) {
        char comm_path[400], comm[32] = "";
        snprintf(comm_path, sizeof comm_path, "%s/%s/comm", path, de->d_name);
        FILE *f = fopen(comm_path, "r");
        if (f && fgets(comm, sizeof comm, f))
            comm[strcspn(comm, "\n")] = '\0';
        if (f)
            fclose(f);
        if (strcmp(comm, name) == 0)
            found = (pid_t)atoi(de->d_name);
    }
    if (dir)
        closedir(dir);
    return found;
}

/* A thread's CPU time in clock ticks (utime + stime), -1 when it cannot be read. */
static long thread_ticks(pid_t pid, pid_t tid)
{
    char path[96], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/task/%d/stat", (int)pid, (int)tid);
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f)
        fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')'); /* then: state, and utime, stime are fields 14, 15 */
    unsigned long ut, st;
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2)
        return -1;
    return (long)(ut + st);
}

/* Stops the seized thread tid where it computes (not in a system call such as a futex wait: it
 * might hold a lock the socket thread needs): tried again after a moment, up to 200 times. */
static void thread_stop_computing(pid_t pid, pid_t tid)
{
    for (int k = 0; k < 200; k++) {
        int st = 0;
        assert_int_equal(ptrace(PTRACE_INTERRUPT, tid, NULL, NULL), 0);
        assert_int_equal(waitpid(tid, &st, __WALL), tid);
        while (st >> 16 != PTRACE_EVENT_STOP) { /* a signal's delivery stop came first: passed on */
            assert_int_equal(ptrace(PTRACE_CONT, tid, NULL, (void *)(intptr_t)WSTOPSIG(st)), 0);
            assert_int_equal(waitpid(tid, &st, __WALL), tid);
        }
        char path[96], sys[64] = "";
        snprintf(path, sizeof path, "/proc/%d/task/%d/syscall", (int)pid, (int)tid);
        FILE *f = fopen(path, "r");
        if (f && !fgets(sys, sizeof sys, f))
            sys[0] = '\0';
        if (f)
            fclose(f);
        if (!f || strncmp(sys, "-1 ", 3) == 0) /* stopped outside a system call */
            return;
        assert_int_equal(ptrace(PTRACE_CONT, tid, NULL, NULL), 0);
        usleep(2000);
    }
    fail_msg("the engine thread was never stopped while computing");
}

/* A client process sending a PREFILL of n + 1 tokens; it ends when answered. */
static pid_t prefill_process(const struct daemon *e, size_t n)
{
    pid_t pid = fork();
    if (pid == 0) {
        snapkv_client_t *c = NULL;
        struct snapkv_connect_opts o = {.timeout_ms = 120000};
        if (snapkv_connect(e->endpoint, &o, &c) == SNAPKV_OK) {
            char *t = xs(n);
            struct snapkv_prefill_result r = {0};
            snapkv_prefill(c, &(struct snapkv_prefill_opts){.text = t}, &r);
            snapkv_close(&c);
        }
        _exit(0);
    }
    return pid;
}

/* test_health_probes' daemon, engine thread and client processes, for its teardown */
static struct daemon g_probed;
static pid_t g_probed_engine, g_probe_kids[3];

/* After test_health_probes, failed or not: no daemon, client or traced thread left behind. */
static int health_teardown(void **state)
{
    (void)state;
    if (g_probed.pid > 0 && g_probed_engine > 0) { /* still traced: killed, its exit reaped here */
        kill(g_probed.pid, SIGKILL);
        waitpid(g_probed_engine, NULL, __WALL);
    }
    for (int i = 0; i < 3; i++)
        if (g_probe_kids[i] > 0) {
            kill(g_probe_kids[i], SIGKILL);
            waitpid(g_probe_kids[i], NULL, 0);
        }
    if (g_probed.dir[0])
        stop_second(&g_probed);
    memset(&g_probed, 0, sizeof g_probed);
    g_probed_engine = 0;
    memset(g_probe_kids, 0, sizeof g_probe_kids);
    return 0;
}

/* /healthz and /readyz of a daemon with health-stall-seconds 1 and queue-depth 2. Its engine
 * thread ("skv-engine") is held in a ptrace stop during a long PREFILL: both probes then say
 * "engine stalled" (503) after the second, and /readyz also "queue full" once two requests
 * wait; /healthz does not, it is about liveness. Let go, the engine shows progress again and
 * /healthz is 200. Held again and sent SIGTERM, /readyz says "stopping" at once, while the
 * engine cannot have answered (the probes read no lock the engine might hold); let go, and
 * asked every 2 ms while it stops, every answer is "stopping" until the listener closes, and
 * the daemon exits 0 (it crashed when the worker was freed before the HTTP thread stopped,
 * which answered /metrics from the freed worker too). Skipped where ptrace is not allowed. */
static void test_health_probes(void **state)
{
    NEED_DAEMON(d);
    (void)d;
    struct daemon *e = &g_probed;
    assert_true(second_daemon(e, "--health-stall-seconds=1", "--queue-depth=2"));
    char body[512];
    assert_int_equal(probe_until(e, "/readyz", "ready\n", NULL, body, sizeof body), 200); /* past start-up */
    assert_string_equal(body, "ready\n");
    assert_int_equal(probe(e, "/healthz", body, sizeof body), 200);
    assert_string_equal(body, "ok\n");
    pid_t engine = thread_named(e->pid, "skv-engine");
    assert_true(engine > 0);
    assert_true(thread_named(e->pid, "skv-metrics") > 0);
    if (ptrace(PTRACE_SEIZE, engine, NULL, NULL) != 0) {
        printf("# ptrace: %s\n", strerror(errno));
        skip();
    }
    g_probed_engine = engine;
    long t0 = thread_ticks(e->pid, engine);
    g_probe_kids[0] = prefill_process(e, 1500);
    for (int i = 0; i < 3000 && thread_ticks(e->pid, engine) - t0 < 20; i++) /* 0.2 s of its CPU: in the forward */
        usleep(10 * 1000);
    assert_true(thread_ticks(e->pid, engine) - t0 >= 20);
    thread_stop_computing(e->pid, engine);
    g_probe_kids[1] = prefill_process(e, 4);
    g_probe_kids[2] = prefill_process(e, 4);
    assert_int_equal(probe_until(e, "/readyz", "engine stalled: no progress for", "queue full: 2 requests wait",
                                 body, sizeof body), 503);
    printf("# /readyz: %s", body);
    assert_int_equal(probe(e, "/healthz", body, sizeof body), 503);
    const char *stalled = strstr(body, "engine stalled: no progress for ");
    assert_non_null(stalled);
    assert_true(strtod(stalled + strlen("engine stalled: no progress for "), NULL) >= 1.0); /* not before */
    assert_non_null(strstr(body, "(health-stall-seconds 1)"));
    assert_null(strstr(body, "queue"));

    assert_int_equal(ptrace(PTRACE_CONT, engine, NULL, NULL), 0);
    assert_int_equal(probe_until(e, "/healthz", "ok\n", NULL, body, sizeof body), 200);
    int code = probe(e, "/readyz", body, sizeof body); /* the long PREFILL may have ended */
    assert_true(code == 200 ? strcmp(body, "ready\n") == 0 : strstr(body, "queue full") && !strstr(body, "stalled"));

    thread_stop_computing(e->pid, engine);
    kill(g_probe_kids[0], SIGKILL); /* its PREFILL stops once the engine goes on: the stop is quick */
    waitpid(g_probe_kids[0], NULL, 0);
    g_probe_kids[0] = 0;
    assert_int_equal(kill(e->pid, SIGTERM), 0);
    assert_int_equal(probe_until(e, "/readyz", "stopping: new requests are refused", NULL, body, sizeof body), 503);
    printf("# /readyz after SIGTERM, the engine held: %s", body);
    probe(e, "/healthz", body, sizeof body); /* liveness is not about stopping */
    assert_null(strstr(body, "stopping"));
    assert_int_equal(ptrace(PTRACE_DETACH, engine, NULL, NULL), 0);
    g_probed_engine = 0;
    /* asked on and on while it stops (the running PREFILL may end first), every answer is
     * "stopping", until the listener closes: it never reads a worker already freed (a crash) */
    int st = 0, asked = 0;
    pid_t got = 0;
    for (int64_t end = now_ms() + 300000; got == 0 && now_ms() < end;) {
        int fd = metrics_try_connect(e);
        const char req[] = "GET /readyz HTTP/1.1\r\n\r\n";
        char ans[1024];
        if (fd >= 0 && send(fd, req, sizeof req - 1, MSG_NOSIGNAL) == (ssize_t)(sizeof req - 1) &&
            read_all(fd, ans, sizeof ans)) {
            assert_non_null(strstr(ans, "stopping"));
            asked++;
        }
        if (fd >= 0)
            close(fd);
        usleep(2000);
        got = waitpid(e->pid, &st, WNOHANG);
    }
    printf("# /readyz asked %d times while the daemon stopped\n", asked);
    assert_int_equal(got, e->pid);
    e->pid = 0;
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
}

/* Under a service manager ($NOTIFY_SOCKET), the start-up timeout is extended before the model
 * loads by what reading it may take (300 s and its size at 20 MB/s: a large model on a slow disk
 * was killed by the unit's TimeoutStartSec and restarted over and over), then READY=1. */
static void test_start_notify(void **state)
{
    NEED_DAEMON(d);
    (void)d;
    char dir[] = "/tmp/skv-notify-XXXXXX", path[64];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/notify.sock", dir);
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    assert_true(fd >= 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    setenv("NOTIFY_SOCKET", path, 1);
    struct daemon e;
    bool up = second_daemon(&e, NULL, NULL);
    unsetenv("NOTIFY_SOCKET");
    assert_true(up);
    static char all[16384];
    size_t n = 0;
    for (int i = 0; i < 300 && !strstr(all, "READY=1"); i++) { /* 30 s at most */
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 100) == 1) {
            ssize_t k = recv(fd, all + n, sizeof all - 1 - n, 0);
            if (k > 0) {
                n += (size_t)k;
                all[n++] = '\n';
                all[n] = '\0';
            }
        }
    }
    printf("# notify: %s", all);
    const char *ext = strstr(all, "EXTEND_TIMEOUT_USEC="), *ready = strstr(all, "READY=1");
    assert_non_null(ext);
    assert_non_null(ready);
    assert_true(ext < ready && ext < strstr(all, "STATUS=loading model"));
    char *model = model_path();
    struct stat sb;
    assert_int_equal(stat(model, &sb), 0);
    free(model);
    assert_int_equal(strtoull(ext + strlen("EXTEND_TIMEOUT_USEC="), NULL, 10),
                     (300 + (unsigned long long)sb.st_size / (20u << 20)) * 1000000ull);
    stop_second(&e);
    close(fd);
    unlink(path);
    rmdir(dir);
}

/* CONFIG GET gives a long value whole: 64 tenant weights (about 1.4 KB) came back cut at 1023
 * bytes before. */
static void test_config_long_value(void **state)
{
    NEED_DAEMON(d);
    char weights[2048] = "--tenant-weights=", got[4096] = "";
    for (int i = 0; i < 64; i++)
        snprintf(weights + strlen(weights), sizeof weights - strlen(weights), "%stenant-%08d:%d", i ? "," : "",
                 i, i % 9 + 1);
    struct daemon e;
    bool up = second_daemon(&e, weights, NULL);
    int rc = -1;
    if (up) {
        snapkv_client_t *a = NULL;
        assert_int_equal(snapkv_connect(e.admin, NULL, &a), SNAPKV_OK);
        rc = snapkv_admin_config_get(a, "tenant-weights", config_value_long, got);
        snapkv_close(&a);
    }
    stop_second(&e);
    assert_true(up);
    assert_int_equal(rc, SNAPKV_OK);
    assert_true(strlen(weights + 17) > 1024);
    assert_string_equal(got, weights + 17);
}

/* max-text-bytes set: texts past it are refused for their bytes alone, whatever their tokens. */
static void test_text_bytes_option(void **state)
{
    NEED_DAEMON(d);
    struct daemon e;
    bool up = second_daemon(&e, "--max-text-bytes=1K", NULL);
    int rc_long = -1, rc_fits = -1;
    if (up) {
        snapkv_client_t *c = NULL;
        assert_int_equal(snapkv_connect(e.endpoint, NULL, &c), SNAPKV_OK);
        char *t = xs(513); /* 1026 bytes, far fewer tokens than max-prompt-tokens */
        rc_long = prefill_text(c, t, "the text is 1026 bytes: more than max-text-bytes (1024)", NULL);
        t[1024] = '\0';
        rc_fits = prefill_text(c, t, NULL, NULL);
        free(t);
        snapkv_close(&c);
    }
    stop_second(&e);
    assert_true(up);
    assert_int_equal(rc_long, SNAPKV_E_LIMIT);
    assert_int_equal(rc_fits, SNAPKV_OK);
}

/* A STATS value from the admin endpoint (-1 when it is not there). */
static double admin_stat(const char *admin, const char *name)
{
    snapkv_client_t *a = NULL;
    struct snapkv_stats st = {0};
    double v = -1;
    if (snapkv_connect(admin, NULL, &a) == SNAPKV_OK && snapkv_admin_stats(a, false, &st) == SNAPKV_OK)
        for (size_t i = 0; i < st.n; i++)
            if (strcmp(st.stats[i].name, name) == 0)
                v = st.stats[i].value;
    snapkv_stats_free(&st);
    snapkv_close(&a);
    return v;
}

/* A raw DEALER on d's client endpoint under routing id `id` (ZMQ_ROUTING_ID: a client may choose
 * its own), with a receive timeout. */
static void *routed_socket(const struct daemon *d, void *ctx, const char *id, int rcv_ms)
{
    void *s = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &rcv_ms, sizeof rcv_ms);
    zmq_setsockopt(s, ZMQ_ROUTING_ID, id, strlen(id));
    assert_int_equal(zmq_connect(s, d->endpoint), 0);
    return s;
}

/* Whether a raw reply's request_id (field 2, a varint under 128 here) is id. */
static bool has_request_id(const char *buf, int n, uint8_t id)
{
    for (int i = 0; i + 1 < n; i++)
        if (buf[i] == 0x10 && (uint8_t)buf[i + 1] == id)
            return true;
    return false;
}

/* A reply goes only over the connection its request came over. Client A, under a routing id it
 * chose, asks for an APPEND that waits behind another client's long PREFILL, and goes; client B
 * then connects under A's routing id. Before, libzmq routed A's reply to B (libzmq's own routing
 * ids are a counter, so B could have read another tenant's replies); now the daemon drops it
 * (snapkv_replies_dropped_closed_total) and B gets only its own. */
static void test_reply_not_to_new_owner(void **state)
{
    NEED_DAEMON(d);
    const double closed0 = admin_stat(d->admin, "snapkv_replies_dropped_closed_total");
    void *ctx = zmq_ctx_new();
    /* C: a PREFILL of 2000 token ids (version 1, request_id 1, prefill { tokens packed }) */
    enum { N = 2000 };
    static uint8_t msg[N + 32];
    size_t len = 0;
    msg[len++] = 0x08;
    msg[len++] = (uint8_t)SNAPKV_PROTOCOL_VERSION;
    msg[len++] = 0x10;
    msg[len++] = 1;
    msg[len++] = 0x5a;
    put_varint(msg, &len, 1 + 2 + N);
    msg[len++] = 0x0a;
    put_varint(msg, &len, N);
    for (int i = 0; i < N; i++)
        msg[len++] = (uint8_t)(5 + i % 120);
    void *c = routed_socket(d, ctx, "long-prefill", 120000);
    assert_int_equal(zmq_send(c, msg, len, 0), (int)len);
    usleep(300 * 1000);
    /* A: version 1, request_id 77, append { session_id: 16 zero bytes, text: 200 bytes } (not a
     * short request: it waits for the PREFILL; not one a gone client's drop takes off the queue) */
    len = 0;
    msg[len++] = 0x08;
    msg[len++] = (uint8_t)SNAPKV_PROTOCOL_VERSION;
    msg[len++] = 0x10;
    msg[len++] = 77;
    msg[len++] = 0x62;
    put_varint(msg, &len, 2 + 16 + 3 + 200);
    msg[len++] = 0x0a;
    msg[len++] = 16;
    memset(msg + len, 0, 16);
    len += 16;
    msg[len++] = 0x1a;
    put_varint(msg, &len, 200);
    memset(msg + len, 'a', 200);
    len += 200;
    void *a = routed_socket(d, ctx, "victim-0001", 1000);
    assert_int_equal(zmq_send(a, msg, len, 0), (int)len);
    usleep(300 * 1000);
    zmq_close(a);
    usleep(500 * 1000);
    /* B: A's routing id, a HELLO (request_id 88) of its own */
    void *b = routed_socket(d, ctx, "victim-0001", 2000);
    const uint8_t hello[] = {0x08, (uint8_t)SNAPKV_PROTOCOL_VERSION, 0x10, 88, 0x52, 0x00};
    assert_int_equal(zmq_send(b, hello, sizeof hello, 0), (int)sizeof hello);
    char buf[8192];
    int n = zmq_recv(c, buf, sizeof buf, 0); /* the PREFILL's reply: A's APPEND ran after it */
    assert_true(n > 0);
    int got_own = 0, got_other = 0;
    while ((n = zmq_recv(b, buf, sizeof buf, 0)) >= 0) {
        got_own += has_request_id(buf, n, 88);
        got_other += has_request_id(buf, n, 77);
    }
    zmq_close(b);
    zmq_close(c);
    zmq_ctx_term(ctx);
    const double closed = admin_stat(d->admin, "snapkv_replies_dropped_closed_total");
    fprintf(stderr, "routing id taken over: its own replies %d, the gone client's %d; dropped closed %.0f\n",
            got_own, got_other, closed - closed0);
    assert_int_equal(got_own, 1);
    assert_int_equal(got_other, 0);
    assert_true(closed - closed0 >= 1);
}

/* A client that sends PREFILLs asking for logits (196 KiB a reply) and does not read: the replies
 * it has not taken stay within max-reply-bytes-per-client (1M here) and the rest are dropped,
 * counted; another client is served meanwhile; once it reads, what it held comes back to 0.
 * Before, only libzmq's 1000 messages bounded them (196 MiB for this client). */
static void test_unread_replies_bounded(void **state)
{
    NEED_DAEMON(d);
    struct daemon e;
    bool up = second_daemon(&e, "--max-reply-bytes-per-client=1M", NULL);
    enum { N = 30 };
    double answered = -1, dropped = -1, unread = -1, unread_after = -1;
    int got = 0, served = -1;
    if (up) {
        void *ctx = zmq_ctx_new();
        void *s = raw_socket(&e, ctx, ZMQ_RCVHWM, 1);
        int rcvbuf = 4096;
        zmq_setsockopt(s, ZMQ_RCVBUF, &rcvbuf, sizeof rcvbuf);
        for (int i = 0; i < N; i++) {
            /* version 1, request_id i, prefill {tokens [1..8] packed, return_logits} */
            uint8_t req[] = {0x08, 0x01, 0x10, (uint8_t)(i + 1), 0x5a, 0x0c, 0x0a, 0x08, 1, 2, 3, 4, 5, 6, 7, 8, 0x28, 0x01};
            assert_int_equal(zmq_send(s, req, sizeof req, 0), (int)sizeof req);
        }
        for (int i = 0; i < 600 && answered < 8 * N; i++) {
            answered = admin_stat(e.admin, "snapkv_prefill_tokens_total");
            usleep(100 * 1000);
        }
        dropped = admin_stat(e.admin, "snapkv_replies_dropped_unread_total");
        unread = admin_stat(e.admin, "snapkv_reply_bytes_unread");
        snapkv_client_t *c = NULL;
        struct snapkv_server_info in;
        served = snapkv_connect(e.endpoint, NULL, &c);
        if (!served)
            served = snapkv_server_info(c, &in);
        snapkv_close(&c);
        int timeout = 2000;
        zmq_setsockopt(s, ZMQ_RCVTIMEO, &timeout, sizeof timeout);
        static char buf[1 << 20];
        while (zmq_recv(s, buf, sizeof buf, 0) >= 0)
            got++;
        for (int i = 0; i < 50 && unread_after != 0; i++) {
            unread_after = admin_stat(e.admin, "snapkv_reply_bytes_unread");
            usleep(100 * 1000);
        }
        dropped = admin_stat(e.admin, "snapkv_replies_dropped_unread_total"); /* the last reply's too */
        zmq_close(s);
        zmq_ctx_term(ctx);
    }
    stop_second(&e);
    assert_true(up);
    fprintf(stderr, "unread replies: %d sent, %.0f dropped, %.0f bytes held, %d read afterwards\n", N, dropped,
            unread, got);
    assert_true(answered >= 8 * N);
    assert_int_equal(served, SNAPKV_OK);
    assert_true(unread > 0 && unread <= 1024 * 1024);
    assert_true(dropped >= 10); /* at most 5 held here, a few in the kernel's and the client's buffers */
    assert_int_equal(got + (int)dropped, N);
    assert_true(unread_after == 0);
}

/* One user's clients together hold at most max-reply-bytes-per-peer of replies they have not
 * read: two connections of this user that send PREFILLs asking for logits (192 KiB replies) and
 * read nothing hold at most 1M between them, and the rest of their replies are dropped; a client
 * of another user is answered meanwhile (as root: it runs as nobody). Before, such clients
 * could fill max-reply-bytes (1G), past which every client's replies were dropped. */
static void test_unread_replies_per_peer(void **state)
{
    NEED_DAEMON(d);
    struct daemon e;
    bool up = second_daemon(&e, "--max-reply-bytes-per-peer=1M", NULL);
    enum { N = 12 };
    double answered = -1, dropped = -1, unread = -1;
    int other = -1, go = -1;
    int pid = up ? fixture_other_user_fork(e.dir, e.endpoint, &go) : -1; /* a client of nobody */
    if (pid == 0) {
        snapkv_client_t *c = NULL;
        struct snapkv_connect_opts o = {.timeout_ms = 60000};
        struct snapkv_server_info in;
        if (snapkv_connect(e.endpoint, &o, &c) != SNAPKV_OK || snapkv_server_info(c, &in) != SNAPKV_OK)
            _exit(11);
        snapkv_close(&c);
        _exit(0);
    }
    if (up) {
        void *ctx = zmq_ctx_new();
        void *s[2];
        for (int k = 0; k < 2; k++) {
            s[k] = raw_socket(&e, ctx, ZMQ_RCVHWM, 1);
            int rcvbuf = 4096;
            zmq_setsockopt(s[k], ZMQ_RCVBUF, &rcvbuf, sizeof rcvbuf);
            for (int i = 0; i < N; i++) {
                /* version 1, request_id i, prefill {tokens [1..8] packed, return_logits} */
                uint8_t req[] = {0x08, 0x01, 0x10, (uint8_t)(i + 1), 0x5a, 0x0c, 0x0a, 0x08, 1, 2, 3, 4, 5, 6, 7, 8,
                                 0x28, 0x01};
                assert_int_equal(zmq_send(s[k], req, sizeof req, 0), (int)sizeof req);
            }
        }
        for (int i = 0; i < 600 && answered < 2 * 8 * N; i++) {
            answered = admin_stat(e.admin, "snapkv_prefill_tokens_total");
            usleep(100 * 1000);
        }
        dropped = admin_stat(e.admin, "snapkv_replies_dropped_unread_total");
        unread = admin_stat(e.admin, "snapkv_reply_bytes_unread");
        if (pid > 0)
            other = fixture_other_user_go(pid, go);
        for (int k = 0; k < 2; k++)
            zmq_close(s[k]);
        zmq_ctx_term(ctx);
    }
    stop_second(&e);
    assert_true(up);
    fprintf(stderr, "unread replies of one user: %d sent, %.0f dropped, %.0f bytes held; another user's client: %d\n",
            2 * N, dropped, unread, other);
    assert_true(answered >= 2 * 8 * N);
    assert_true(unread > 0 && unread <= 1024 * 1024);
    assert_true(dropped >= 2 * N - 5 - 6); /* at most 5 held here, a few in the kernel's and the clients' buffers */
    if (pid > 0)
        assert_int_equal(other, 0);
}

/* A client that sends and never reads: its replies pile up and are dropped, and the daemon
 * goes on serving others and still stops on SIGTERM (test_sigterm, next). */
static void test_client_not_reading(void **state)
{
    NEED_DAEMON(d);
    void *ctx = zmq_ctx_new();
    void *s = raw_socket(d, ctx, ZMQ_RCVHWM, 1);
    static const unsigned char hello[] = {0x08, 0x01, 0x52, 0x00}; /* version 1, hello {} */
    int sent = 0;
    int64_t until = now_ms() + 120000; /* the count, not the tries (a slow daemon: TSan) */
    while (sent <= 20000 && now_ms() < until) {
        if (zmq_send(s, hello, sizeof hello, ZMQ_DONTWAIT) < 0) {
            if (zmq_errno() != EAGAIN)
                break;
            usleep(1000); /* the daemon reads on; its socket is only momentarily full */
            continue;
        }
        sent++;
    }
    assert_true(sent > 20000);
    snapkv_client_t *c = NULL;
    struct snapkv_connect_opts o = {.timeout_ms = 20000};
    assert_int_equal(snapkv_connect(d->endpoint, &o, &c), SNAPKV_OK);
    struct snapkv_server_info in;
    assert_int_equal(snapkv_server_info(c, &in), SNAPKV_OK);
    snapkv_close(&c);
    zmq_close(s);
    zmq_ctx_term(ctx);
}

static void test_sigterm(void **state)
{
    NEED_DAEMON(d);
    assert_int_equal(kill(d->pid, SIGTERM), 0);
    int st;
    assert_int_equal(waitpid(d->pid, &st, 0), d->pid);
    d->pid = 0;
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    struct stat sb;
    assert_int_not_equal(stat(d->endpoint + 6, &sb), 0); /* socket file removed */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hello),
        cmocka_unit_test(test_admin),
        cmocka_unit_test(test_config_get),
        cmocka_unit_test(test_admin_on_client_socket_refused),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_many_clients),
        cmocka_unit_test(test_second_daemon_refused),
        cmocka_unit_test(test_metrics_http),
        cmocka_unit_test(test_metrics_limits),
        cmocka_unit_test(test_metrics_flood),
        cmocka_unit_test(test_metrics_port_taken),
        cmocka_unit_test(test_state_dir_locked),
        cmocka_unit_test(test_text_limits),
        cmocka_unit_test(test_text_bytes_option),
        cmocka_unit_test(test_config_long_value),
        cmocka_unit_test(test_start_notify),
        cmocka_unit_test_teardown(test_health_probes, health_teardown),
        cmocka_unit_test(test_client_not_reading),
        cmocka_unit_test(test_unread_replies_bounded),
        cmocka_unit_test(test_unread_replies_per_peer),
        cmocka_unit_test(test_reply_not_to_new_owner),
        cmocka_unit_test(test_sigterm),
    };
    if (getenv("SKV_TEST_FILTER")) /* e.g. SKV_TEST_FILTER=test_health_probes: one test */
        cmocka_set_test_filter(getenv("SKV_TEST_FILTER"));
    return cmocka_run_group_tests(tests, setup, teardown);
}
