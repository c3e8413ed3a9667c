/* snapkv-bench serve: measures snapkvd through libsnapkv — no-op round trips, N client
 * processes against the same work in-process, how many long sessions a 1 GiB pool holds per
 * compression spec (computed, then checked by importing copies until the pool evicts), and
 * aggregate decode throughput of concurrent long sessions (forks of one prefill), and how long
 * a streaming decode stalls while another client prefills a long prompt, and how long a tenant's
 * short request waits behind another tenant's backlog of long prompts. Starts its
 * own snapkvd unless given one. */
#include "build-config.h"

#include "tools/bench_serve.h"

#include "common/status.h"
#include "daemon/compress/spec.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/model.h"
#include "daemon/engine/sampler.h"
#include "libclient/snapkv.h"
#include "proto/snapkv.pb-c.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sodium.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#define GIB (UINT64_C(1) << 30)
#define CAPACITY_POOL GIB          /* the pool the capacity question is about (--pool-gib) */
#define MAX_FIT_SESSIONS 1024      /* --sessions fit: at most this many client processes */
#define ROUNDTRIP_CALLS 2000
#define ROUNDTRIP_WARMUP 100
#define TP_PROMPT_TOKENS 128       /* throughput run: prompt and greedy decode per request */
#define TP_DECODE_TOKENS 16
#define LONG_TIMEOUT_MS 900000     /* a 4096-token prefill on a shared CPU */
#define MAX_REPORT_TOKENS 64
#define STALL_SESSION_TOKENS 64    /* stall run: the decoding session's prompt */
#define STALL_WARM_TOKENS 16       /* tokens it makes alone before the long prefill starts */
#define STALL_MAX_TOKENS 2048      /* its DECODE's max_tokens (the daemon's max-new-tokens default) */
#define STALL_YIELD_OFF 3600000    /* decode-yield-ms that never yields: the daemon before it could */

enum { N_DEFAULT_SPECS = 3, MAX_SPECS = 8, N_PARTS = 11 };
static const char *const default_spec_text[N_DEFAULT_SPECS] = {"", "policy=snapkv,ratio=0.1",
                                                               "policy=snapkv,alloc=squeeze,ratio=0.1"};
static const char *const default_spec_name[N_DEFAULT_SPECS] = {"full", "snapkv 10%", "squeeze+snapkv 10%"};

/* A snapkvd this benchmark started (pid 0: none). */
struct daemon_child {
    pid_t pid;
    char dir[64];
    char endpoint[128];
    char admin[128];
    char log[128];
    uint64_t pool_bytes;
};

struct serve_ctx {
    const struct skv_serve_opts *o;
    struct skv_engine *e;
    struct skv_model *m;
    struct daemon_child d;
    const char *endpoint, *admin_endpoint;
    snapkv_client_t *admin;          /* on the admin endpoint */
    snapkv_client_t *cl;             /* on the client endpoint */
    uint64_t pool_bytes;             /* of the daemon in use */
    uint64_t capacity_pool;          /* the pool the capacity part asks about */
    uint32_t block_rows;             /* rows of one pool block (of the daemon in use) */
    int clients, requests, context, sessions, decode_tokens;
    int n_specs;                     /* compression specs compared; the first is the baseline */
    char spec_text[MAX_SPECS][256];  /* "" = full cache */
    char spec_name[MAX_SPECS][256];
    bool default_specs;              /* the built-in three (their goals apply) */
    int64_t yield_ms;                /* our daemon's --decode-yield-ms (< 0: its default) */
    const char *queue_order;         /* our daemon's --queue-order (NULL: its default) */
    int64_t slice_ms;                /* our daemon's --fair-slice-ms (< 0: its default) */
    int64_t share;                   /* our daemon's --decode-share (< 0: its default) */
    int persist_interval;            /* our daemon's --persist-interval-seconds (0: persist off) */
    bool events;                     /* our daemon's --events-endpoint (ipc://<its dir>/e.sock) */
    const char *store;               /* our daemons' --store (NULL: none) */
    bool store_signed;               /* --store-signed */
    const char *store_secret;        /* our daemons' --store-secret-file (NULL: none) */
};

/* What one client process sends back (followed by n_lat doubles). */
struct child_report {
    int32_t status;
    uint32_t n_lat;
    uint32_t n_tokens;               /* tokens of the first request's decode */
    uint32_t tokens[MAX_REPORT_TOKENS];
    double t_start, t_end;           /* CLOCK_MONOTONIC, comparable across processes */
    char err[256];
};

/* The work each client process does once connected. */
struct child_job {
    int (*run)(snapkv_client_t *c, const struct child_job *j, int idx, struct child_report *r, double *lat);
    const char *endpoint;
    int max_lat;
    int requests, prompt_tokens, decode_tokens, n_vocab;
    const struct snapkv_session_id *ids;  /* decode run: one session per process */
};

static double load_1min(void);
static double rss_mib(pid_t pid);

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int client_fail(const char *what, int rc)
{
    return skv_errorf(rc < 0 && rc >= SKV_STATUS_MIN ? rc : SKV_E_INTERNAL, "%s: %s (%s)", what,
                      snapkv_last_error(), snapkv_status_str(rc));
}

/* Deterministic pseudo-random prompt ids (the same generator as snapkv-bench speed). */
static void fill_ids(uint32_t *ids, int n, int n_vocab, uint64_t seed)
{
    for (int i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (uint32_t)((seed >> 33) % (uint64_t)n_vocab);
    }
}

static uint64_t request_seed(int client, int request)
{
    return UINT64_C(1000003) * (uint64_t)(client + 1) + (uint64_t)request;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* A PREFILL that computes every token: the parts that time prefills, or count what sessions
 * hold, measure the model, not a prefix another of their sessions holds (--parts prefix does). */
static int prefill_computed(snapkv_client_t *c, const struct snapkv_prefill_opts *po, struct snapkv_prefill_result *pr)
{
    return snapkv_prefill_flags(c, po, SNAPKV_PREFILL_NO_PREFIX_REUSE, pr, NULL);
}

/* Nearest-rank percentiles, mean, min and max of v (sorted in place), scaled by `scale`. */
static json_t *summary_json(double *v, size_t n, double scale)
{
    json_t *j = json_object();
    if (n == 0)
        return j;
    qsort(v, n, sizeof *v, cmp_double);
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += v[i];
    size_t i50 = (size_t)ceil(0.50 * (double)n) - 1, i99 = (size_t)ceil(0.99 * (double)n) - 1;
    json_object_set_new(j, "n", json_integer((json_int_t)n));
    json_object_set_new(j, "p50", json_real(v[i50] * scale));
    json_object_set_new(j, "p99", json_real(v[i99] * scale));
    json_object_set_new(j, "mean", json_real(sum / (double)n * scale));
    json_object_set_new(j, "min", json_real(v[0] * scale));
    json_object_set_new(j, "max", json_real(v[n - 1] * scale));
    return j;
}

static double jnum(const json_t *o, const char *key)
{
    return json_number_value(json_object_get(o, key));
}

static long long jint(const json_t *o, const char *key)
{
    return (long long)json_integer_value(json_object_get(o, key));
}

/* Whether a part's table is done with: the part was not asked for (o NULL), or it was skipped
 * (said here, under its title). false: the caller prints the table. */
static bool part_skipped(FILE *f, const json_t *o, const char *title)
{
    if (!o)
        return true;
    if (!json_object_get(o, "skipped"))
        return false;
    fprintf(f, "\n%s: skipped (%s)\n", title, json_string_value(json_object_get(o, "skipped")));
    return true;
}

static int stat_get(snapkv_client_t *admin, const char *name, double *out)
{
    struct snapkv_stats st;
    int rc = snapkv_admin_stats(admin, false, &st);
    if (rc)
        return client_fail("STATS", rc);
    rc = skv_errorf(SKV_E_NOT_FOUND, "the daemon reports no %s", name);
    for (size_t i = 0; i < st.n; i++)
        if (strcmp(st.stats[i].name, name) == 0) {
            *out = st.stats[i].value;
            rc = SKV_OK;
        }
    snapkv_stats_free(&st);
    return rc;
}

static int evict_all(struct serve_ctx *x)
{
    int rc = snapkv_admin_evict(x->admin, NULL, NULL, true, NULL, NULL);
    return rc ? client_fail("EVICT", rc) : SKV_OK;
}

/* ---- the snapkvd child ------------------------------------------------------------------------- */

static bool is_executable(const char *path)
{
    return access(path, X_OK) == 0;
}

/* <directory of argv0>/snapkvd; a libtool wrapper runs us from .libs/, so also its parent. */
static int find_daemon(const char *argv0, char *out, size_t cap)
{
    char dir[3072];
    if (argv0 && strchr(argv0, '/')) {
        snprintf(dir, sizeof dir, "%s", argv0);
    } else {
        ssize_t n = readlink("/proc/self/exe", dir, sizeof dir - 1);
        if (n <= 0)
            return skv_errorf(SKV_E_IO, "cannot find the running binary (/proc/self/exe)");
        dir[n] = '\0';
    }
    char *slash = strrchr(dir, '/');
    *slash = '\0';
    snprintf(out, cap, "%s/snapkvd", *dir ? dir : "/");
    if (is_executable(out))
        return SKV_OK;
    size_t len = strlen(dir);
    if (len >= 5 && strcmp(dir + len - 5, ".libs") == 0) {
        if (len == 5)
            snprintf(out, cap, "./snapkvd");
        else {
            dir[len - 6] = '\0';
            snprintf(out, cap, "%s/snapkvd", *dir ? dir : "/");
        }
        if (is_executable(out))
            return SKV_OK;
    }
    return skv_errorf(SKV_E_NOT_FOUND, "no snapkvd next to %s (give --endpoint and --admin-endpoint)",
                      argv0 ? argv0 : "snapkv-bench");
}

static void remove_dir(const char *path)
{
    DIR *dir = opendir(path);
    if (dir) {
        struct dirent *de;
        char p[512];
        while ((de = readdir(dir)))
            if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) {
                snprintf(p, sizeof p, "%s/%s", path, de->d_name);
                if (unlink(p) != 0 && errno == EISDIR)
                    remove_dir(p); /* the persist directory of the checkpoint part */
            }
        closedir(dir);
    }
    rmdir(path);
}

static void print_log_tail(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    char buf[4096];
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, size > (long)sizeof buf - 1 ? size - (long)sizeof buf + 1 : 0, SEEK_SET);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    fprintf(stderr, "--- end of the snapkvd log (%s) ---\n%s\n---\n", path, buf);
}

/* SIGTERM, up to 60 s for a clean exit, then SIGKILL. Returns the exit status (-1: killed). */
static int daemon_stop(struct daemon_child *d, bool keep_log)
{
    int code = -1;
    if (d->pid > 0) {
        kill(d->pid, SIGTERM);
        int st;
        double t0 = now_s();
        pid_t got;
        while ((got = waitpid(d->pid, &st, WNOHANG)) == 0 && now_s() - t0 < 60)
            usleep(20000);
        if (got == 0) {
            kill(d->pid, SIGKILL);
            waitpid(d->pid, &st, 0);
        } else if (got == d->pid && WIFEXITED(st)) {
            code = WEXITSTATUS(st);
        }
        d->pid = 0;
    }
    if (*d->dir) {
        if (keep_log)
            print_log_tail(d->log);
        remove_dir(d->dir);
        *d->dir = '\0';
    }
    return code;
}

static int daemon_start(const struct serve_ctx *x, uint64_t pool_bytes, struct daemon_child *d)
{
    char exe[4096];
    int rc = find_daemon(x->o->argv0, exe, sizeof exe);
    if (rc)
        return rc;
    memset(d, 0, sizeof *d);
    snprintf(d->dir, sizeof d->dir, "/tmp/snapkv-bench-XXXXXX");
    if (!mkdtemp(d->dir))
        return skv_errorf(SKV_E_IO, "mkdtemp: %s", strerror(errno));
    snprintf(d->endpoint, sizeof d->endpoint, "ipc://%s/c.sock", d->dir);
    snprintf(d->admin, sizeof d->admin, "ipc://%s/a.sock", d->dir);
    snprintf(d->log, sizeof d->log, "%s/snapkvd.log", d->dir);
    d->pool_bytes = pool_bytes;
    int max_prompt = x->context > 8192 ? x->context : 8192;
    char a[28][4200];
    snprintf(a[0], sizeof a[0], "--model=%s", x->o->model_path);
    snprintf(a[1], sizeof a[1], "--backend=%s", x->m->be->name);
    snprintf(a[2], sizeof a[2], "--threads=%d", x->o->threads);
    snprintf(a[3], sizeof a[3], "--pool-size=%llu", (unsigned long long)pool_bytes);
    snprintf(a[4], sizeof a[4], "--endpoint=%s", d->endpoint);
    snprintf(a[5], sizeof a[5], "--admin-endpoint=%s", d->admin);
    snprintf(a[6], sizeof a[6], "--state-dir=%s", d->dir);
    snprintf(a[7], sizeof a[7], "--log-level=warn");
    /* the tenant quotas must not bind before the pool does */
    snprintf(a[8], sizeof a[8], "--max-bytes-per-tenant=%llu", (unsigned long long)pool_bytes);
    snprintf(a[9], sizeof a[9], "--max-sessions-per-tenant=100000");
    snprintf(a[10], sizeof a[10], "--max-prompt-tokens=%d", max_prompt);
    snprintf(a[11], sizeof a[11], "--lease-seconds=3600");
    /* the concurrent-decode run starts one decode per session of one tenant: the decode limits
     * must not bind before the pool does either */
    snprintf(a[12], sizeof a[12], "--max-decodes=65536");
    snprintf(a[13], sizeof a[13], "--max-decodes-per-tenant=65536");
    /* and its client processes, all of this user, take a connection each: nor the per-user cap */
    snprintf(a[14], sizeof a[14], "--max-connections-per-peer=%d", 1 << 20);
    /* and their requests all wait for the engine at once (the H200 run at 04aee5c: 225
     * SnapKV sessions' DECODEs against the default 64 waiting a tenant) */
    snprintf(a[15], sizeof a[15], "--queue-depth=%d", 1 << 16);
    snprintf(a[16], sizeof a[16], "--queue-depth-per-tenant=%d", 1 << 16);
    snprintf(a[17], sizeof a[17], "--max-sessions=%d", 1 << 24); /* (nor all tenants' sessions) */
    int n_args = 18; /* (28 at most: a[] and argv[] hold them) */
    if (x->o->kv_type)
        snprintf(a[n_args++], sizeof a[0], "--kv-type=%s", x->o->kv_type);
    if (x->yield_ms >= 0)
        snprintf(a[n_args++], sizeof a[0], "--decode-yield-ms=%lld", (long long)x->yield_ms);
    if (x->queue_order)
        snprintf(a[n_args++], sizeof a[0], "--queue-order=%s", x->queue_order);
    if (x->slice_ms >= 0)
        snprintf(a[n_args++], sizeof a[0], "--fair-slice-ms=%lld", (long long)x->slice_ms);
    if (x->share >= 0)
        snprintf(a[n_args++], sizeof a[0], "--decode-share=%lld", (long long)x->share);
    if (x->persist_interval > 0) {
        snprintf(a[n_args++], sizeof a[0], "--persist=yes");
        snprintf(a[n_args++], sizeof a[0], "--persist-interval-seconds=%d", x->persist_interval);
    }
    if (x->events)
        snprintf(a[n_args++], sizeof a[0], "--events-endpoint=ipc://%s/e.sock", d->dir);
    if (x->store)
        snprintf(a[n_args++], sizeof a[0], "--store=%s", x->store);
    if (x->store_secret)
        snprintf(a[n_args++], sizeof a[0], "--store-secret-file=%s", x->store_secret);
    char *argv[30] = {exe};
    for (int i = 0; i < n_args; i++)
        argv[i + 1] = a[i];
    argv[n_args + 1] = NULL;
    fflush(NULL);
    d->pid = fork();
    if (d->pid < 0) {
        d->pid = 0;
        remove_dir(d->dir);
        return skv_errorf(SKV_E_IO, "fork: %s", strerror(errno));
    }
    if (d->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (!freopen(d->log, "a", stderr) || !freopen("/dev/null", "w", stdout))
            _exit(126);
        execv(exe, argv);
        _exit(127);
    }
    double t0 = now_s();
    for (;;) {
        int st;
        if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
            d->pid = 0;
            daemon_stop(d, true);
            return skv_errorf(SKV_E_IO, "snapkvd (%s) exited during start-up", exe);
        }
        snapkv_client_t *c = NULL;
        struct snapkv_connect_opts co = {.name = "snapkv-bench", .timeout_ms = 300};
        if (snapkv_connect(d->admin, &co, &c) == SNAPKV_OK) {
            snapkv_close(&c);
            break;
        }
        if (now_s() - t0 > 120) {
            daemon_stop(d, true);
            return skv_errorf(SKV_E_TIMEOUT, "snapkvd did not answer on %s within 120 s", d->admin);
        }
        usleep(100000);
    }
    fprintf(stderr, "serve: started %s (pid %d, pool %.2f GiB) in %.1f s\n", exe, (int)d->pid,
            (double)pool_bytes / GIB, now_s() - t0);
    return SKV_OK;
}

static void disconnect(struct serve_ctx *x)
{
    snapkv_close(&x->cl);
    snapkv_close(&x->admin);
}

static int connect_both(struct serve_ctx *x)
{
    struct snapkv_connect_opts co = {.name = "snapkv-bench", .timeout_ms = LONG_TIMEOUT_MS};
    int rc = snapkv_connect(x->admin_endpoint, &co, &x->admin);
    if (rc)
        return client_fail(x->admin_endpoint, rc);
    if ((rc = snapkv_connect(x->endpoint, &co, &x->cl))) {
        snapkv_close(&x->admin);
        return client_fail(x->endpoint, rc);
    }
    struct snapkv_status_info st;
    if ((rc = snapkv_admin_status(x->admin, &st))) {
        disconnect(x);
        return client_fail("STATUS", rc);
    }
    x->pool_bytes = st.pool_bytes_total;
    x->block_rows = st.pool_block_rows;
    return SKV_OK;
}

/* Starts (or restarts) our daemon with a pool of pool_bytes and connects to it. */
static int use_own_daemon(struct serve_ctx *x, uint64_t pool_bytes)
{
    disconnect(x);
    if (x->d.pid) {
        int code = daemon_stop(&x->d, false);
        if (code != 0)
            fprintf(stderr, "serve: warning: snapkvd exited with status %d on SIGTERM\n", code);
    }
    int rc = daemon_start(x, pool_bytes, &x->d);
    if (rc)
        return rc;
    x->endpoint = x->d.endpoint;
    x->admin_endpoint = x->d.admin;
    if ((rc = connect_both(x)))
        daemon_stop(&x->d, true);
    return rc;
}

/* ---- client processes ---------------------------------------------------------------------------- */

static int write_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n > 0) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

static size_t read_all(int fd, void *p, size_t n)
{
    char *c = p;
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, c + got, n - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    return got;
}

static void child_main(const struct child_job *j, int idx, int ready_fd, int go_fd, int out_fd)
{
    struct child_report r = {0};
    double *lat = calloc((size_t)(j->max_lat > 0 ? j->max_lat : 1), sizeof *lat);
    snapkv_client_t *c = NULL;
    struct snapkv_connect_opts co = {.name = "snapkv-bench-client", .timeout_ms = LONG_TIMEOUT_MS};
    int rc = lat ? snapkv_connect(j->endpoint, &co, &c) : SNAPKV_E_NOMEM;
    if (rc)
        snprintf(r.err, sizeof r.err, "connect: %s (%s)", snapkv_last_error(), snapkv_status_str(rc));
    char b = 'r';
    write_all(ready_fd, &b, 1);
    while (read(go_fd, &b, 1) > 0) /* EOF: go */
        ;
    r.t_start = now_s();
    if (!rc)
        rc = j->run(c, j, idx, &r, lat);
    r.t_end = now_s();
    r.status = rc;
    snapkv_close(&c);
    write_all(out_fd, &r, sizeof r);
    if (r.n_lat)
        write_all(out_fd, lat, r.n_lat * sizeof *lat);
    _exit(rc ? 1 : 0);
}

/* Forks n client processes that connect, wait for a common start, run j->run and report.
 * reports[n], lat[n * j->max_lat]; *t_go: when they were let go. Fails only when the
 * processes cannot be started; each report's status says how its process fared. */
static int run_children(const struct child_job *j, int n, struct child_report *reports, double *lat, double *t_go)
{
    int ready[2], go[2];
    pid_t *pids = calloc((size_t)n, sizeof *pids);
    int *res = calloc((size_t)n, sizeof *res);
    if (!pids || !res) {
        free(pids);
        free(res);
        return SKV_E_NOMEM;
    }
    if (pipe(ready) || pipe(go)) {
        free(pids);
        free(res);
        return skv_errorf(SKV_E_IO, "pipe: %s", strerror(errno));
    }
    int started = 0, rc = SKV_OK;
    fflush(NULL);
    for (; started < n; started++) {
        int out[2];
        if (pipe(out)) {
            rc = skv_errorf(SKV_E_IO, "pipe: %s", strerror(errno));
            break;
        }
        pid_t pid = fork();
        if (pid < 0) {
            close(out[0]);
            close(out[1]);
            rc = skv_errorf(SKV_E_IO, "fork: %s", strerror(errno));
            break;
        }
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            close(ready[0]);
            close(go[1]);
            close(out[0]);
            for (int i = 0; i < started; i++)
                close(res[i]);
            child_main(j, started, ready[1], go[0], out[1]);
        }
        close(out[1]);
        pids[started] = pid;
        res[started] = out[0];
    }
    close(ready[1]);
    close(go[0]);
    /* every process connected (or gave up), at most 120 s */
    int n_ready = 0;
    double t0 = now_s();
    while (n_ready < started && now_s() - t0 < 120) {
        struct pollfd pfd = {ready[0], POLLIN, 0};
        if (poll(&pfd, 1, 1000) > 0) {
            char buf[64];
            ssize_t r = read(ready[0], buf, sizeof buf);
            if (r <= 0)
                break;
            n_ready += (int)r;
        }
    }
    close(ready[0]);
    *t_go = now_s();
    close(go[1]);
    for (int i = 0; i < started; i++) {
        struct child_report *r = &reports[i];
        if (read_all(res[i], r, sizeof *r) != sizeof *r) {
            memset(r, 0, sizeof *r);
            r->status = SKV_E_IO;
            snprintf(r->err, sizeof r->err, "client process %d died without a report", i);
        } else if (r->n_lat > (uint32_t)j->max_lat ||
                   read_all(res[i], lat + (size_t)i * (size_t)j->max_lat, r->n_lat * sizeof *lat) !=
                       r->n_lat * sizeof *lat) {
            r->n_lat = 0;
            r->status = SKV_E_IO;
            snprintf(r->err, sizeof r->err, "client process %d sent a short report", i);
        }
        close(res[i]);
        int st;
        waitpid(pids[i], &st, 0);
    }
    for (int i = started; i < n; i++) {
        memset(&reports[i], 0, sizeof reports[i]);
        reports[i].status = rc;
        snprintf(reports[i].err, sizeof reports[i].err, "not started");
    }
    free(pids);
    free(res);
    return rc;
}

/* The first failed report as an error status (SKV_OK when all succeeded). */
static int children_status(const struct child_report *reports, int n, const char *what)
{
    for (int i = 0; i < n; i++)
        if (reports[i].status)
            return skv_errorf(reports[i].status < 0 && reports[i].status >= SKV_STATUS_MIN ? reports[i].status
                                                                                           : SKV_E_INTERNAL,
                              "%s: client process %d: %s", what, i, reports[i].err);
    return SKV_OK;
}

static int child_fail(struct child_report *r, const char *what, int rc)
{
    snprintf(r->err, sizeof r->err, "%s: %s (%s)", what, snapkv_last_error(), snapkv_status_str(rc));
    return rc;
}

static void sampling_greedy(struct snapkv_sampling *s, int max_tokens)
{
    snapkv_sampling_defaults(s);
    s->max_tokens = (uint32_t)max_tokens;
    s->stop_at_eos = false;
}

/* Throughput run, in a client process: prefill + greedy decode + release, j->requests times. */
static int child_requests(snapkv_client_t *c, const struct child_job *j, int idx, struct child_report *r, double *lat)
{
    uint32_t *ids = malloc((size_t)j->prompt_tokens * sizeof *ids);
    if (!ids)
        return SNAPKV_E_NOMEM;
    int rc = SNAPKV_OK;
    for (int q = 0; q < j->requests && !rc; q++) {
        fill_ids(ids, j->prompt_tokens, j->n_vocab, request_seed(idx, q));
        double t0 = now_s();
        struct snapkv_prefill_opts po = {.tokens = ids, .n_tokens = (size_t)j->prompt_tokens};
        struct snapkv_prefill_result pr = {0};
        struct snapkv_decode_result dr = {0};
        struct snapkv_sampling s;
        sampling_greedy(&s, j->decode_tokens);
        if ((rc = prefill_computed(c, &po, &pr))) {
            child_fail(r, "PREFILL", rc);
            break;
        }
        if ((rc = snapkv_decode(c, &pr.id, &s, NULL, NULL, &dr)))
            child_fail(r, "DECODE", rc);
        else if (dr.n_tokens != (size_t)j->decode_tokens)
            snprintf(r->err, sizeof r->err, "DECODE gave %zu tokens, not %d", dr.n_tokens, j->decode_tokens),
                rc = SNAPKV_E_INTERNAL;
        int rc2 = snapkv_release(c, &pr.id);
        if (!rc && rc2)
            rc = child_fail(r, "RELEASE", rc2);
        lat[r->n_lat++] = now_s() - t0;
        if (!rc && q == 0) {
            r->n_tokens = dr.n_tokens < MAX_REPORT_TOKENS ? (uint32_t)dr.n_tokens : MAX_REPORT_TOKENS;
            memcpy(r->tokens, dr.tokens, r->n_tokens * sizeof *r->tokens);
        }
        snapkv_prefill_result_free(&pr);
        snapkv_decode_result_free(&dr);
    }
    free(ids);
    return rc;
}

/* Decode run, in a client process: one greedy decode of its own long session. */
static int child_decode(snapkv_client_t *c, const struct child_job *j, int idx, struct child_report *r, double *lat)
{
    struct snapkv_sampling s;
    sampling_greedy(&s, j->decode_tokens);
    struct snapkv_decode_result dr = {0};
    double t0 = now_s();
    int rc = snapkv_decode(c, &j->ids[idx], &s, NULL, NULL, &dr);
    lat[r->n_lat++] = now_s() - t0;
    if (rc)
        return child_fail(r, "DECODE", rc);
    if (dr.n_tokens != (size_t)j->decode_tokens) {
        snprintf(r->err, sizeof r->err, "DECODE gave %zu tokens, not %d", dr.n_tokens, j->decode_tokens);
        rc = SNAPKV_E_INTERNAL;
    }
    r->n_tokens = dr.n_tokens < MAX_REPORT_TOKENS ? (uint32_t)dr.n_tokens : MAX_REPORT_TOKENS;
    memcpy(r->tokens, dr.tokens, r->n_tokens * sizeof *r->tokens);
    snapkv_decode_result_free(&dr);
    return rc;
}

/* ---- 1. round trips ------------------------------------------------------------------------------- */

/* The transport's own round trip, for scale: a child process echoes on a plain ROUTER over an
 * ipc:// socket, with none of the daemon's work (no protobuf, no poll over several sockets), and
 * a DEALER here sends it a STATUS-sized message. What the STATUS round trip takes beyond this is
 * the daemon's and libsnapkv's share. */
struct zmq_echo {
    char dir[64];
    char endpoint[96];
    pid_t pid;
    void *ctx, *sock;
};

static void zmq_echo_serve(const char *endpoint)
{
    void *ctx = zmq_ctx_new();
    void *sock = ctx ? zmq_socket(ctx, ZMQ_ROUTER) : NULL;
    if (!sock || zmq_bind(sock, endpoint) < 0)
        _exit(1);
    int timeout_ms = 120000; /* a parent that died without saying so */
    zmq_setsockopt(sock, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms);
    for (;;) {
        zmq_msg_t id, body;
        zmq_msg_init(&id);
        zmq_msg_init(&body);
        if (zmq_msg_recv(&id, sock, 0) < 0 || zmq_msg_recv(&body, sock, 0) < 0 || zmq_msg_size(&body) == 0)
            break;
        if (zmq_msg_send(&id, sock, ZMQ_SNDMORE) < 0 || zmq_msg_send(&body, sock, 0) < 0)
            break;
    }
    _exit(0);
}

static void zmq_echo_stop(struct zmq_echo *e)
{
    if (e->sock) {
        zmq_send(e->sock, "", 0, ZMQ_DONTWAIT); /* an empty message ends the echo */
        zmq_close(e->sock);
    }
    if (e->ctx)
        zmq_ctx_term(e->ctx);
    if (e->pid > 0) {
        double t0 = now_s();
        while (waitpid(e->pid, NULL, WNOHANG) == 0) {
            if (now_s() - t0 > 5) {
                kill(e->pid, SIGKILL);
                waitpid(e->pid, NULL, 0);
                break;
            }
            usleep(10000);
        }
    }
    if (*e->dir)
        remove_dir(e->dir);
    memset(e, 0, sizeof *e);
}

static int zmq_echo_start(struct zmq_echo *e)
{
    memset(e, 0, sizeof *e);
    snprintf(e->dir, sizeof e->dir, "/tmp/snapkv-bench-XXXXXX");
    if (!mkdtemp(e->dir))
        return skv_errorf(SKV_E_IO, "mkdtemp: %s", strerror(errno));
    snprintf(e->endpoint, sizeof e->endpoint, "ipc://%s/echo.sock", e->dir);
    if ((e->pid = fork()) < 0) {
        int err = errno;
        zmq_echo_stop(e);
        return skv_errorf(SKV_E_IO, "fork: %s", strerror(err));
    }
    if (e->pid == 0)
        zmq_echo_serve(e->endpoint);
    int timeout_ms = 5000, linger_ms = 1000; /* the stop message may find the child gone */
    if (!(e->ctx = zmq_ctx_new()) || !(e->sock = zmq_socket(e->ctx, ZMQ_DEALER)) ||
        zmq_setsockopt(e->sock, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms) < 0 ||
        zmq_setsockopt(e->sock, ZMQ_LINGER, &linger_ms, sizeof linger_ms) < 0 ||
        zmq_connect(e->sock, e->endpoint) < 0) {
        int rc = skv_errorf(SKV_E_IO, "echo socket: %s", zmq_strerror(zmq_errno()));
        zmq_echo_stop(e);
        return rc;
    }
    return SKV_OK;
}

/* One echo of `len` bytes; the child binds asynchronously, so the first ones may wait for it. */
static int zmq_echo_call(struct zmq_echo *e, const uint8_t *msg, size_t len)
{
    uint8_t back[256];
    if (zmq_send(e->sock, msg, len, 0) < 0 || zmq_recv(e->sock, back, sizeof back, 0) != (int)len)
        return skv_errorf(SKV_E_IO, "echo round trip: %s", zmq_strerror(zmq_errno()));
    return SKV_OK;
}

/* STATUS and the bare transport alternate in blocks, so that this host's drift between minutes
 * (tens of µs) falls on both alike. */
#define ROUNDTRIP_BLOCK 200

static int bench_roundtrip(struct serve_ctx *x, json_t *out)
{
    double *lat = malloc(ROUNDTRIP_CALLS * sizeof *lat), *floor_lat = malloc(ROUNDTRIP_CALLS * sizeof *floor_lat);
    struct zmq_echo echo;
    int rc = lat && floor_lat ? zmq_echo_start(&echo) : SKV_E_NOMEM;
    if (rc) {
        free(lat);
        free(floor_lat);
        return rc;
    }
    /* a STATUS request as libsnapkv packs it, for the echo's message size */
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__StatusRequest sreq = SNAPKV__STATUS_REQUEST__INIT;
    req.version = SNAPKV_PROTOCOL_VERSION;
    req.request_id = 123456;
    req.deadline_ms = 30000;
    req.command_case = SNAPKV__REQUEST__COMMAND_STATUS;
    req.status = &sreq;
    uint8_t msg[256];
    size_t msg_len = snapkv__request__pack(&req, msg);
    struct snapkv_status_info st;
    for (int i = 0; i < ROUNDTRIP_WARMUP && !rc; i++)
        if ((rc = snapkv_admin_status(x->admin, &st)))
            rc = client_fail("STATUS", rc);
        else
            rc = zmq_echo_call(&echo, msg, msg_len);
    for (int b = 0; b < ROUNDTRIP_CALLS && !rc; b += ROUNDTRIP_BLOCK) {
        for (int i = b; i < b + ROUNDTRIP_BLOCK && i < ROUNDTRIP_CALLS && !rc; i++) {
            double t0 = now_s();
            if ((rc = snapkv_admin_status(x->admin, &st)))
                rc = client_fail("STATUS", rc);
            lat[i] = now_s() - t0;
        }
        for (int i = b; i < b + ROUNDTRIP_BLOCK && i < ROUNDTRIP_CALLS && !rc; i++) {
            double t0 = now_s();
            rc = zmq_echo_call(&echo, msg, msg_len);
            floor_lat[i] = now_s() - t0;
        }
    }
    zmq_echo_stop(&echo);
    if (!rc) {
        json_t *j = summary_json(lat, ROUNDTRIP_CALLS, 1e6);
        json_object_set_new(j, "what", json_string("admin STATUS, answered by the socket thread"));
        json_object_set_new(out, "admin_status_us", j);
        j = summary_json(floor_lat, ROUNDTRIP_CALLS, 1e6);
        json_object_set_new(j, "what", json_string("the transport alone: a STATUS-sized message echoed by a plain "
                                                   "ZeroMQ ROUTER in another process over ipc://, in blocks "
                                                   "alternating with the STATUS calls"));
        json_object_set_new(j, "message_bytes", json_integer((json_int_t)msg_len));
        json_object_set_new(out, "zmq_echo_us", j);
    }
    free(floor_lat);
    /* an unknown id: the request crosses to the engine worker and back as NOT_FOUND */
    struct snapkv_session_id unknown;
    memset(unknown.bytes, 0xa5, sizeof unknown.bytes);
    for (int i = 0; i < ROUNDTRIP_WARMUP + ROUNDTRIP_CALLS && !rc; i++) {
        double t0 = now_s();
        int r = snapkv_release(x->cl, &unknown);
        if (r != SNAPKV_E_NOT_FOUND)
            rc = r ? client_fail("RELEASE of an unknown id", r)
                   : skv_errorf(SKV_E_INTERNAL, "RELEASE of an unknown id succeeded");
        else if (i >= ROUNDTRIP_WARMUP)
            lat[i - ROUNDTRIP_WARMUP] = now_s() - t0;
    }
    if (!rc) {
        json_t *j = summary_json(lat, ROUNDTRIP_CALLS, 1e6);
        json_object_set_new(j, "what", json_string("RELEASE of an unknown id (NOT_FOUND) through the engine worker"));
        json_object_set_new(out, "engine_release_not_found_us", j);
    }
    free(lat);
    return rc;
}

/* ---- 2. throughput: N client processes vs the in-process engine --------------------------------------- */

/* One request in-process: a fresh cache, the prompt, greedy decode as the daemon does it. */
static int inproc_request(struct skv_engine *e, const struct skv_model *m, const int32_t *ids, int n, int dtok,
                          float *logits, int32_t *out)
{
    struct skv_kv_cache *cache = NULL;
    int rc = skv_kv_cache_new(m, &cache);
    if (!rc)
        rc = skv_engine_forward(e, cache, ids, n, NULL, logits);
    for (int k = 0; k < dtok && !rc; k++) {
        int32_t t = skv_argmax(logits, m->cfg.n_vocab);
        out[k] = t;
        rc = skv_engine_forward(e, cache, &t, 1, NULL, logits);
    }
    skv_kv_cache_free(&cache);
    return rc;
}

/* The same requests in-process as the daemon could at best order them: each round's n prompts
 * (request q of every client) prefilled one after another, then their greedy decodes batched
 * (skv_engine_decode_batch: one forward a step for up to SKV_ENGINE_MAX_BATCH of them), then
 * released. The tokens into toks ([client][request][dtok]); each request's latency, its round's
 * time, into lat; *wall the whole. */
static int inproc_batched(struct serve_ctx *x, int n, int reqs, int dtok, int32_t *toks, double *lat, double *wall)
{
    const struct skv_model *m = x->m;
    const size_t nv = (size_t)m->cfg.n_vocab;
    struct skv_kv_cache **caches = calloc((size_t)n, sizeof *caches);
    struct skv_batch_seq *seqs = calloc((size_t)n, sizeof *seqs);
    float *lg = malloc((size_t)n * nv * sizeof *lg);
    uint32_t *uids = malloc(TP_PROMPT_TOKENS * sizeof *uids);
    int32_t *ids = malloc(TP_PROMPT_TOKENS * sizeof *ids);
    int rc = caches && seqs && lg && uids && ids ? SKV_OK : SKV_E_NOMEM;
    double t0 = now_s();
    for (int q = 0; q < reqs && !rc; q++) {
        double tq = now_s();
        for (int c = 0; c < n && !rc; c++) {
            fill_ids(uids, TP_PROMPT_TOKENS, m->cfg.n_vocab, request_seed(c, q));
            for (int i = 0; i < TP_PROMPT_TOKENS; i++)
                ids[i] = (int32_t)uids[i];
            rc = skv_kv_cache_new(m, &caches[c]);
            if (!rc)
                rc = skv_engine_forward(x->e, caches[c], ids, TP_PROMPT_TOKENS, NULL, lg + (size_t)c * nv);
        }
        for (int k = 0; k < dtok && !rc; k++) {
            for (int c = 0; c < n; c++) {
                int32_t t = skv_argmax(lg + (size_t)c * nv, m->cfg.n_vocab);
                toks[((size_t)c * reqs + q) * dtok + k] = t;
                seqs[c] = (struct skv_batch_seq){.cache = caches[c], .token = t, .logits = lg + (size_t)c * nv};
            }
            for (int c0 = 0; c0 < n && !rc; c0 += SKV_ENGINE_MAX_BATCH)
                rc = skv_engine_decode_batch(x->e, seqs + c0, n - c0 < SKV_ENGINE_MAX_BATCH ? n - c0
                                                                                           : SKV_ENGINE_MAX_BATCH);
        }
        for (int c = 0; c < n; c++) {
            skv_kv_cache_free(&caches[c]);
            lat[c * reqs + q] = now_s() - tq;
        }
    }
    *wall = now_s() - t0;
    free(caches);
    free(seqs);
    free(lg);
    free(uids);
    free(ids);
    return rc;
}

static void throughput_json(json_t *o, double wall, int n_req, double *lat, size_t n_lat)
{
    json_object_set_new(o, "wall_s", json_real(wall));
    json_object_set_new(o, "requests", json_integer(n_req));
    json_object_set_new(o, "requests_per_s", json_real(n_req / wall));
    json_object_set_new(o, "tokens_per_s", json_real((double)n_req * (TP_PROMPT_TOKENS + TP_DECODE_TOKENS) / wall));
    json_object_set_new(o, "generated_tokens_per_s", json_real((double)n_req * TP_DECODE_TOKENS / wall));
    json_object_set_new(o, "latency_ms", summary_json(lat, n_lat, 1e3));
}

static int bench_throughput(struct serve_ctx *x, json_t *out)
{
    const struct skv_model *m = x->m;
    int n = x->clients, reqs = x->requests, total = n * reqs;
    struct child_job j = {.run = child_requests, .endpoint = x->endpoint, .max_lat = reqs, .requests = reqs,
                          .prompt_tokens = TP_PROMPT_TOKENS, .decode_tokens = TP_DECODE_TOKENS,
                          .n_vocab = m->cfg.n_vocab};
    struct child_report *reports = calloc((size_t)n, sizeof *reports);
    double *lat = calloc((size_t)total, sizeof *lat);
    double *lat_in = calloc((size_t)total, sizeof *lat_in);
    uint32_t *uids = malloc(TP_PROMPT_TOKENS * sizeof *uids);
    int32_t *ids = malloc(TP_PROMPT_TOKENS * sizeof *ids);
    int32_t *toks = malloc((size_t)total * TP_DECODE_TOKENS * sizeof *toks);
    int32_t *toks_b = malloc((size_t)total * TP_DECODE_TOKENS * sizeof *toks_b);
    double *lat_b = calloc((size_t)total, sizeof *lat_b);
    float *logits = malloc((size_t)m->cfg.n_vocab * sizeof *logits);
    int rc = SKV_OK;
    if (!reports || !lat || !lat_in || !uids || !ids || !toks || !toks_b || !lat_b || !logits) {
        rc = SKV_E_NOMEM;
        goto out;
    }
    fprintf(stderr, "serve: throughput: %d client processes x %d requests (prefill %d + decode %d) ...\n", n, reqs,
            TP_PROMPT_TOKENS, TP_DECODE_TOKENS);
    double t_go;
    if ((rc = run_children(&j, n, reports, lat, &t_go)) || (rc = children_status(reports, n, "throughput")))
        goto out;
    double t_end = t_go;
    for (int i = 0; i < n; i++)
        t_end = reports[i].t_end > t_end ? reports[i].t_end : t_end;
    double wall_d = t_end - t_go;

    fprintf(stderr, "serve: throughput: the same %d requests in-process, one after another ...\n", total);
    double t0 = now_s();
    for (int c = 0; c < n && !rc; c++)
        for (int q = 0; q < reqs && !rc; q++) {
            fill_ids(uids, TP_PROMPT_TOKENS, m->cfg.n_vocab, request_seed(c, q));
            for (int i = 0; i < TP_PROMPT_TOKENS; i++)
                ids[i] = (int32_t)uids[i];
            double t1 = now_s();
            rc = inproc_request(x->e, m, ids, TP_PROMPT_TOKENS, TP_DECODE_TOKENS, logits,
                                toks + (size_t)(c * reqs + q) * TP_DECODE_TOKENS);
            lat_in[c * reqs + q] = now_s() - t1;
        }
    double wall_i = now_s() - t0, wall_b = 0;
    if (rc)
        goto out;
    fprintf(stderr, "serve: throughput: the same %d requests in-process, %d at a time, decodes batched ...\n", total,
            n);
    if ((rc = inproc_batched(x, n, reqs, TP_DECODE_TOKENS, toks_b, lat_b, &wall_b)))
        goto out;
    int same_b = 0; /* batched decodes give what separate forwards give */
    for (int r = 0; r < total; r++)
        same_b += memcmp(toks + (size_t)r * TP_DECODE_TOKENS, toks_b + (size_t)r * TP_DECODE_TOKENS,
                         TP_DECODE_TOKENS * sizeof *toks) == 0;
    /* the daemon's greedy tokens against in-process ones (first request of each client) */
    int match = 0;
    for (int c = 0; c < n; c++)
        match += reports[c].n_tokens == TP_DECODE_TOKENS &&
                 memcmp(reports[c].tokens, toks + (size_t)c * reqs * TP_DECODE_TOKENS,
                        TP_DECODE_TOKENS * sizeof *toks) == 0;
    size_t n_lat = 0;
    for (int i = 0; i < n; i++) {
        memmove(lat + n_lat, lat + (size_t)i * reqs, reports[i].n_lat * sizeof *lat);
        n_lat += reports[i].n_lat;
    }
    json_t *jd = json_object(), *ji = json_object(), *jb = json_object();
    throughput_json(jd, wall_d, total, lat, n_lat);
    throughput_json(ji, wall_i, total, lat_in, (size_t)total);
    throughput_json(jb, wall_b, total, lat_b, (size_t)total);
    json_object_set_new(out, "clients", json_integer(n));
    json_object_set_new(out, "requests_per_client", json_integer(reqs));
    json_object_set_new(out, "prompt_tokens", json_integer(TP_PROMPT_TOKENS));
    json_object_set_new(out, "decode_tokens", json_integer(TP_DECODE_TOKENS));
    json_object_set_new(out, "daemon", jd);
    json_object_set_new(out, "in_process", ji);
    json_object_set_new(out, "in_process_batched", jb);
    json_object_set_new(out, "ratio", json_real(wall_i / wall_d));
    json_object_set_new(out, "ratio_batched", json_real(wall_b / wall_d));
    json_object_set_new(out, "batched_tokens_match", json_integer(same_b));
    json_object_set_new(out, "batched_tokens_compared", json_integer(total));
    json_object_set_new(out, "greedy_tokens_match", json_integer(match));
    json_object_set_new(out, "greedy_tokens_compared", json_integer(n));
out:
    free(reports);
    free(lat);
    free(lat_in);
    free(uids);
    free(ids);
    free(toks);
    free(toks_b);
    free(lat_b);
    free(logits);
    return rc;
}

/* ---- 3. pool capacity and 4. concurrent decode ---------------------------------------------------- */

static int prefill_long(struct serve_ctx *x, int spec, struct snapkv_session_id *id, uint64_t *bytes_before,
                        uint64_t *bytes_after, double *seconds)
{
    int n = x->context;
    uint32_t *ids = malloc((size_t)n * sizeof *ids);
    if (!ids)
        return SKV_E_NOMEM;
    fill_ids(ids, n, x->m->cfg.n_vocab, 7);
    struct snapkv_prefill_opts po = {.tokens = ids, .n_tokens = (size_t)n,
                                     .compress = *x->spec_text[spec] ? x->spec_text[spec] : NULL};
    struct snapkv_prefill_result pr;
    fprintf(stderr, "serve: prefill %d tokens, %s ...\n", n, x->spec_name[spec]);
    double t0 = now_s();
    int rc = prefill_computed(x->cl, &po, &pr);
    *seconds = now_s() - t0;
    free(ids);
    if (rc)
        return client_fail("PREFILL", rc);
    *id = pr.id;
    *bytes_before = pr.bytes_before;
    *bytes_after = pr.bytes_after;
    snapkv_prefill_result_free(&pr);
    fprintf(stderr, "serve:   %.1f s, %.2f MiB of KV kept of %.2f MiB\n", *seconds, *bytes_after / 1048576.0,
            *bytes_before / 1048576.0);
    return SKV_OK;
}

/* Private copies of `src` (EXPORT_KV once, then IMPORT_KV: each copy holds its own blocks, as
 * a separately prefilled session would; a FORK shares src's blocks copy-on-write and costs the
 * pool nothing) until the pool evicts; *held: sessions held before the first eviction.
 * buffer_bytes: at least src's KV rows as f32, EXPORT_KV's form (its full-cache f32 size does). */
static int fill_pool(struct serve_ctx *x, const struct snapkv_session_id *src, uint64_t buffer_bytes,
                     int64_t expected, int64_t *held)
{
    struct snapkv_shm shm;
    struct snapkv_kv_layout lay;
    double ev0, ev;
    int rc = snapkv_shm_create("serve-cap", (size_t)buffer_bytes, &shm);
    if (rc)
        return client_fail("shared memory", rc);
    if ((rc = snapkv_export_kv(x->cl, src, &shm, 0, &lay))) {
        snapkv_shm_destroy(&shm);
        return client_fail("EXPORT_KV", rc);
    }
    struct snapkv_import_opts io = {.shm = &shm, .layers = lay.layers, .n_layers = lay.n_layers,
                                    .positions = lay.positions, .n_positions = lay.n_positions,
                                    .original_length = (uint32_t)x->context};
    rc = stat_get(x->admin, "snapkv_evictions_total", &ev0);
    int64_t n = 1;
    while (!rc) {
        struct snapkv_session_id copy;
        if ((rc = snapkv_import_kv(x->cl, &io, &copy))) {
            if (rc == SNAPKV_E_LIMIT && strstr(snapkv_last_error(), "max-sessions-per-tenant")) {
                rc = SKV_OK; /* the tenant's session count is what holds them: n is the fit */
                break;
            }
            rc = client_fail("IMPORT_KV", rc);
            break;
        }
        if ((rc = stat_get(x->admin, "snapkv_evictions_total", &ev)))
            break;
        if (ev > ev0)
            break;
        if (++n > expected + 8) {
            rc = skv_errorf(SKV_E_INTERNAL, "%lld sessions held and still no eviction (expected %lld)",
                            (long long)n, (long long)expected);
            break;
        }
    }
    if (!rc)
        *held = n;
    snapkv_kv_layout_free(&lay);
    snapkv_shm_destroy(&shm);
    int rc2 = evict_all(x);
    return rc ? rc : rc2;
}

static int bench_capacity(struct serve_ctx *x, json_t *out, uint64_t bytes_after_out[MAX_SPECS],
                          int64_t held_out[MAX_SPECS], uint64_t *bytes_before_out)
{
    int rc = evict_all(x);
    if (rc)
        return rc;
    json_t *arr = json_array();
    json_object_set_new(out, "pool_bytes", json_integer((json_int_t)x->pool_bytes));
    json_object_set_new(out, "context_tokens", json_integer(x->context));
    json_object_set_new(out, "specs", arr);
    int64_t cap[MAX_SPECS] = {0};
    for (int s = 0; s < x->n_specs && !rc; s++) {
        struct snapkv_session_id id;
        uint64_t before, after;
        double secs, used;
        if ((rc = stat_get(x->admin, "snapkv_pool_bytes_used", &used)))
            break;
        if (used != 0) {
            rc = skv_errorf(SKV_E_INTERNAL, "the pool holds %.0f bytes before the capacity run", used);
            break;
        }
        if ((rc = prefill_long(x, s, &id, &before, &after, &secs)))
            break;
        cap[s] = after ? (int64_t)(x->pool_bytes / after) : 0;
        /* a daemon this run did not start keeps its own tenant limits: the first eviction may be
         * the tenant's quota, not the pool (the counter is the same), so the fit is the smaller */
        struct snapkv_server_info si;
        if (after && snapkv_server_info(x->cl, &si) == SNAPKV_OK) {
            int64_t by_bytes = si.max_bytes_per_tenant ? (int64_t)(si.max_bytes_per_tenant / after) : cap[s];
            int64_t by_count = si.max_sessions_per_tenant ? (int64_t)si.max_sessions_per_tenant : cap[s];
            int64_t quota = by_bytes < by_count ? by_bytes : by_count;
            if (quota < cap[s]) {
                fprintf(stderr, "serve:   note: the tenant's limits (max-bytes-per-tenant %llu, "
                        "max-sessions-per-tenant %u) hold %lld of the pool's %lld: measuring those\n",
                        (unsigned long long)si.max_bytes_per_tenant, si.max_sessions_per_tenant, (long long)quota,
                        (long long)cap[s]);
                cap[s] = quota;
            }
        }
        int64_t held = -1;
        fprintf(stderr, "serve:   %lld sessions should fit; copying until the pool evicts ...\n", (long long)cap[s]);
        /* EXPORT_KV's rows are f32 whatever the pool holds: a full cache's f32 bytes */
        const struct skv_model_config *mc = &x->m->cfg;
        const uint64_t exchange = (uint64_t)x->context * mc->n_layers * mc->n_kv_heads * 2 * mc->head_dim * sizeof(float);
        if ((rc = fill_pool(x, &id, exchange, cap[s], &held)))
            break;
        fprintf(stderr, "serve:   %lld sessions held before the first eviction\n", (long long)held);
        bytes_after_out[s] = after;
        held_out[s] = held;
        *bytes_before_out = before;
        json_t *o = json_object();
        json_object_set_new(o, "name", json_string(x->spec_name[s]));
        json_object_set_new(o, "spec", json_string(*x->spec_text[s] ? x->spec_text[s] : "policy=full"));
        json_object_set_new(o, "prefill_s", json_real(secs));
        json_object_set_new(o, "prefill_tokens_per_s", json_real(x->context / secs));
        json_object_set_new(o, "bytes_before", json_integer((json_int_t)before));
        json_object_set_new(o, "bytes_after", json_integer((json_int_t)after));
        json_object_set_new(o, "sessions_fit", json_integer(cap[s]));
        json_object_set_new(o, "sessions_held_before_eviction", json_integer(held));
        json_object_set_new(o, "verified", json_boolean(llabs(held - cap[s]) <= 1));
        json_object_set_new(o, "ratio_vs_full", json_real(cap[0] ? (double)cap[s] / (double)cap[0] : 0));
        /* the session-count ratio carries the floor of each count; this one does not */
        json_object_set_new(o, "kv_bytes_ratio_vs_full", json_real(after ? (double)before / (double)after : 0));
        json_array_append_new(arr, o);
    }
    return rc;
}

/* n concurrent sessions of spec `spec` (forks of one prefill), each decoding in its own client
 * process. */
static int bench_decode(struct serve_ctx *x, json_t *out, int spec, int n, double *wall_out)
{
    struct snapkv_session_id *ids = calloc((size_t)n, sizeof *ids);
    struct child_report *reports = calloc((size_t)n, sizeof *reports);
    double *lat = calloc((size_t)n, sizeof *lat);
    int rc = SKV_OK, held = 0;
    if (!ids || !reports || !lat) {
        rc = SKV_E_NOMEM;
        goto out;
    }
    uint64_t before, after;
    double secs, ev0, ev1, rss0 = x->d.pid ? rss_mib(x->d.pid) : -1;
    if ((rc = evict_all(x)) || (rc = stat_get(x->admin, "snapkv_evictions_total", &ev0)) ||
        (rc = prefill_long(x, spec, &ids[0], &before, &after, &secs)))
        goto out;
    for (held = 1; held < n; held++)
        if ((rc = snapkv_fork(x->cl, &ids[0], &ids[held], NULL))) {
            rc = client_fail("FORK", rc);
            goto out;
        }
    if ((rc = stat_get(x->admin, "snapkv_evictions_total", &ev1)))
        goto out;
    if (ev1 > ev0) {
        rc = skv_errorf(SKV_E_POOL_FULL, "%d sessions of %s do not fit in the pool (%.0f evicted)", n,
                        x->spec_name[spec], ev1 - ev0);
        goto out;
    }
    fprintf(stderr, "serve:   %d client processes decode %d tokens each, concurrently ...\n", n, x->decode_tokens);
    struct child_job j = {.run = child_decode, .endpoint = x->endpoint, .max_lat = 1,
                          .decode_tokens = x->decode_tokens, .n_vocab = x->m->cfg.n_vocab, .ids = ids};
    double t_go;
    if ((rc = run_children(&j, n, reports, lat, &t_go)) || (rc = children_status(reports, n, "decode")))
        goto out;
    double t_end = t_go;
    for (int i = 0; i < n; i++)
        t_end = reports[i].t_end > t_end ? reports[i].t_end : t_end;
    double wall = t_end - t_go;
    int same = 0;
    for (int i = 1; i < n; i++)
        same += reports[i].n_tokens == reports[0].n_tokens &&
                memcmp(reports[i].tokens, reports[0].tokens, reports[0].n_tokens * sizeof *reports[0].tokens) == 0;
    fprintf(stderr, "serve:   %.1f s, %.1f tokens/s\n", wall, n * x->decode_tokens / wall);
    json_object_set_new(out, "name", json_string(x->spec_name[spec]));
    json_object_set_new(out, "spec", json_string(*x->spec_text[spec] ? x->spec_text[spec] : "policy=full"));
    json_object_set_new(out, "sessions", json_integer(n));
    json_object_set_new(out, "bytes_per_session", json_integer((json_int_t)after));
    json_object_set_new(out, "prefill_s", json_real(secs));
    json_object_set_new(out, "wall_s", json_real(wall));
    json_object_set_new(out, "tokens_per_s", json_real(n * x->decode_tokens / wall));
    json_object_set_new(out, "session_decode_s", summary_json(lat, (size_t)n, 1.0));
    json_object_set_new(out, "forks_agree_with_first", json_integer(same));
    if (x->d.pid) {
        json_object_set_new(out, "daemon_rss_mib_before", json_real(rss0));
        json_object_set_new(out, "daemon_rss_mib_after", json_real(rss_mib(x->d.pid)));
    }
    json_object_set_new(out, "load_1min_after", json_real(load_1min()));
    *wall_out = wall;
out:
    if (held > 0) {
        int rc2 = evict_all(x);
        rc = rc ? rc : rc2;
    }
    free(ids);
    free(reports);
    free(lat);
    return rc;
}

/* Concurrent decodes per spec: --sessions N of each, or (--sessions fit) as many as the
 * capacity run held, less those whose decoded rows would not fit the pool. */
static int bench_decodes(struct serve_ctx *x, json_t *out, const uint64_t bytes_after[MAX_SPECS],
                         const int64_t held[MAX_SPECS], uint64_t bytes_before)
{
    /* bytes one session holds after decoding: kept entries plus the new tokens' rows, in whole
     * blocks and one more (a fork copies its partial last block; the tenant quota counts a
     * fork's shared blocks too) */
    uint64_t per_token = x->context ? bytes_before / (uint64_t)x->context : 0;
    uint64_t br = x->block_rows ? x->block_rows : 1;
    uint64_t grow_rows = ((uint64_t)x->decode_tokens + 1 + br - 1) / br * br + br;
    uint64_t need_max = 0;
    int n_sess[MAX_SPECS];
    for (int s = 0; s < x->n_specs; s++) {
        uint64_t each = bytes_after[s] + per_token * grow_rows;
        n_sess[s] = x->sessions;
        if (x->o->sessions_fit) {
            int64_t fit = each ? (int64_t)(x->pool_bytes / each) : 0;
            fit = fit < held[s] ? fit : held[s];
            n_sess[s] = (int)(fit < 1 ? 1 : fit > MAX_FIT_SESSIONS ? MAX_FIT_SESSIONS : fit);
        }
        uint64_t need = (uint64_t)n_sess[s] * each;
        need_max = need > need_max ? need : need_max;
    }
    if (x->d.pid && need_max > x->pool_bytes) {
        /* a 1 GiB pool cannot hold 16 full-cache sessions: run this part with a pool that can */
        uint64_t pool = (need_max + need_max / 16 + GIB - 1) / GIB * GIB;
        fprintf(stderr, "serve: restarting snapkvd with a %.0f GiB pool for %d full-cache sessions\n",
                (double)pool / GIB, x->sessions);
        int rc = use_own_daemon(x, pool);
        if (rc)
            return rc;
    }
    json_t *arr = json_array();
    json_object_set_new(out, "sessions", x->o->sessions_fit ? json_string("fit") : json_integer(x->sessions));
    json_object_set_new(out, "context_tokens", json_integer(x->context));
    json_object_set_new(out, "tokens_per_session", json_integer(x->decode_tokens));
    json_object_set_new(out, "pool_bytes", json_integer((json_int_t)x->pool_bytes));
    json_object_set_new(out, "specs", arr);
    double tps_base = 0;
    int rc = SKV_OK;
    for (int s = 0; s < x->n_specs && !rc; s++) {
        json_t *o = json_object();
        uint64_t need = (uint64_t)n_sess[s] * (bytes_after[s] + per_token * grow_rows);
        if (need > x->pool_bytes) {
            json_object_set_new(o, "name", json_string(x->spec_name[s]));
            json_object_set_new(o, "skipped", json_string("the sessions do not fit in the daemon's pool"));
            json_array_append_new(arr, o);
            continue;
        }
        double wall = 0;
        rc = bench_decode(x, o, s, n_sess[s], &wall);
        double tps = !rc && wall > 0 ? n_sess[s] * x->decode_tokens / wall : 0;
        if (s == 0)
            tps_base = tps;
        /* aggregate tokens/s against the baseline's (equal session counts: the wall-time ratio) */
        if (!rc && tps_base > 0)
            json_object_set_new(o, "ratio_vs_full", json_real(tps / tps_base));
        json_array_append_new(arr, o);
    }
    return rc;
}

/* ---- 5. decode stall: a streaming decode while another client prefills a long prompt ----------- */

struct stall_decode {
    const char *endpoint;
    struct snapkv_session_id id;
    double *t;                       /* when each token arrived */
    int cap;
    atomic_int n;                    /* tokens arrived */
    atomic_bool stop, done;
    int rc;
    char err[256];
};

static int stall_on_tokens(void *user, const uint32_t *tokens, size_t n_tokens, const char *text)
{
    (void)tokens;
    (void)text;
    struct stall_decode *s = user;
    double t = now_s();
    int n = atomic_load(&s->n);
    for (size_t i = 0; i < n_tokens && n < s->cap; i++)
        s->t[n++] = t;
    atomic_store(&s->n, n);
    return atomic_load(&s->stop) ? 1 : 0;
}

/* The decoding client, on its own thread and connection: one greedy streaming DECODE until told
 * to stop (then it closes its connection, which cancels the decode in the daemon). */
static void *stall_thread(void *arg)
{
    struct stall_decode *s = arg;
    snapkv_client_t *c = NULL;
    struct snapkv_connect_opts co = {.name = "snapkv-bench-stall", .timeout_ms = LONG_TIMEOUT_MS};
    int rc = snapkv_connect(s->endpoint, &co, &c);
    if (!rc) {
        struct snapkv_sampling sm;
        sampling_greedy(&sm, STALL_MAX_TOKENS);
        struct snapkv_decode_result dr = {0};
        rc = snapkv_decode(c, &s->id, &sm, stall_on_tokens, s, &dr);
        snapkv_decode_result_free(&dr);
        if (rc == SNAPKV_E_CANCELLED && atomic_load(&s->stop))
            rc = SNAPKV_OK;
    }
    if (rc)
        snprintf(s->err, sizeof s->err, "DECODE: %s (%s)", snapkv_last_error(), snapkv_status_str(rc));
    s->rc = rc;
    snapkv_close(&c);
    atomic_store(&s->done, true);
    return NULL;
}

/* A short request from a third client while the long prefill runs: APPEND 8 tokens to its own
 * session, then DECODE 4, started STALL_PROBE_DELAY s into the prefill. */
#define STALL_PROBE_DELAY 0.3
struct stall_probe {
    const char *endpoint;
    struct snapkv_session_id id;
    uint32_t ids[8];
    atomic_bool go;
    double t_start, t_end;
    int rc;
    char err[256];
};

static void *probe_thread(void *arg)
{
    struct stall_probe *p = arg;
    snapkv_client_t *c = NULL;
    struct snapkv_connect_opts co = {.name = "snapkv-bench-probe", .timeout_ms = LONG_TIMEOUT_MS};
    int rc = snapkv_connect(p->endpoint, &co, &c);
    while (!rc && !atomic_load(&p->go))
        usleep(1000);
    usleep((useconds_t)(STALL_PROBE_DELAY * 1e6));
    p->t_start = now_s();
    struct snapkv_append_opts ao = {.tokens = p->ids, .n_tokens = 8};
    struct snapkv_append_result ar = {0};
    if (!rc && (rc = snapkv_append(c, &p->id, &ao, &ar)))
        snprintf(p->err, sizeof p->err, "APPEND: %s (%s)", snapkv_last_error(), snapkv_status_str(rc));
    snapkv_append_result_free(&ar);
    struct snapkv_sampling sm;
    sampling_greedy(&sm, 4);
    struct snapkv_decode_result dr = {0};
    if (!rc && (rc = snapkv_decode(c, &p->id, &sm, NULL, NULL, &dr)))
        snprintf(p->err, sizeof p->err, "DECODE: %s (%s)", snapkv_last_error(), snapkv_status_str(rc));
    snapkv_decode_result_free(&dr);
    p->t_end = now_s();
    p->rc = rc;
    snapkv_close(&c);
    return NULL;
}

/* One stall run on the daemon in use: a session decodes (streaming) on one connection; once it
 * made STALL_WARM_TOKENS tokens, a --context-token PREFILL of spec `spec` runs on another. The
 * gaps between the decode's tokens while the prefill ran say how long it stalled them. */
static int stall_run(struct serve_ctx *x, int spec, json_t *out)
{
    struct stall_decode sd = {.endpoint = x->endpoint, .cap = STALL_MAX_TOKENS};
    uint32_t prompt[STALL_SESSION_TOKENS];
    fill_ids(prompt, STALL_SESSION_TOKENS, x->m->cfg.n_vocab, 11);
    struct snapkv_prefill_opts po = {.tokens = prompt, .n_tokens = STALL_SESSION_TOKENS};
    struct snapkv_prefill_result pr;
    int rc = prefill_computed(x->cl, &po, &pr);
    if (rc)
        return client_fail("PREFILL of the decoding session", rc);
    sd.id = pr.id;
    snapkv_prefill_result_free(&pr);
    if (!(sd.t = calloc(STALL_MAX_TOKENS, sizeof *sd.t)))
        return SKV_E_NOMEM;
    pthread_t th;
    if (pthread_create(&th, NULL, stall_thread, &sd) != 0) {
        free(sd.t);
        return skv_errorf(SKV_E_INTERNAL, "cannot start the decoding thread");
    }
    while (atomic_load(&sd.n) < STALL_WARM_TOKENS && !atomic_load(&sd.done))
        usleep(1000);
    struct stall_probe pb = {.endpoint = x->endpoint};
    fill_ids(prompt, STALL_SESSION_TOKENS, x->m->cfg.n_vocab, 13);
    fill_ids(pb.ids, 8, x->m->cfg.n_vocab, 17);
    pthread_t probe;
    bool probing = false;
    if (!(rc = prefill_computed(x->cl, &po, &pr))) {
        pb.id = pr.id;
        snapkv_prefill_result_free(&pr);
        probing = pthread_create(&probe, NULL, probe_thread, &pb) == 0;
    }
    struct snapkv_session_id long_id;
    uint64_t before = 0, after = 0;
    double secs = 0, t0 = now_s();
    atomic_store(&pb.go, true);
    if (!rc)
        rc = atomic_load(&sd.done) ? SKV_OK : prefill_long(x, spec, &long_id, &before, &after, &secs);
    double t1 = now_s();
    if (probing)
        pthread_join(probe, NULL);
    if (!rc && !probing)
        rc = skv_errorf(SKV_E_INTERNAL, "cannot start the probe thread");
    if (!rc && pb.rc)
        rc = skv_errorf(SKV_E_INTERNAL, "probe: %s", pb.err);
    /* the first token after the prefill ends the last gap */
    while (!rc && !atomic_load(&sd.done) && (atomic_load(&sd.n) == 0 || sd.t[atomic_load(&sd.n) - 1] < t1) &&
           now_s() - t1 < 60)
        usleep(1000);
    atomic_store(&sd.stop, true);
    pthread_join(th, NULL);
    int n = atomic_load(&sd.n);
    if (!rc && sd.rc)
        rc = skv_errorf(SKV_E_INTERNAL, "%s", sd.err);
    if (!rc && n >= STALL_MAX_TOKENS)
        rc = skv_errorf(SKV_E_INTERNAL, "the decode made all %d tokens before the prefill ended", n);
    if (rc) {
        free(sd.t);
        return rc;
    }
    /* gaps while the prefill ran: from its start to the first token after it, split by the
     * tokens that came in between; and the decode's own gaps before it started */
    double *gap = calloc((size_t)n + 2, sizeof *gap), *alone = calloc((size_t)n + 2, sizeof *alone);
    size_t n_gap = 0, n_alone = 0;
    int during = 0;
    double last = t0;
    for (int i = 0; i < n && gap && alone; i++) {
        if (sd.t[i] <= t0) {
            if (i > 0)
                alone[n_alone++] = sd.t[i] - sd.t[i - 1];
            continue;
        }
        gap[n_gap++] = sd.t[i] - last;
        last = sd.t[i];
        if (sd.t[i] >= t1)
            break;
        during++;
    }
    if (!gap || !alone) {
        free(gap);
        free(alone);
        free(sd.t);
        return SKV_E_NOMEM;
    }
    double max_gap = 0;
    for (size_t i = 0; i < n_gap; i++)
        max_gap = gap[i] > max_gap ? gap[i] : max_gap;
    json_object_set_new(out, "prefill_tokens", json_integer(x->context));
    json_object_set_new(out, "prefill_spec", json_string(*x->spec_text[spec] ? x->spec_text[spec] : "policy=full"));
    json_object_set_new(out, "prefill_s", json_real(secs));
    json_object_set_new(out, "tokens_during_prefill", json_integer(during));
    json_object_set_new(out, "max_gap_ms", json_real(max_gap * 1e3));
    json_object_set_new(out, "gap_ms", summary_json(gap, n_gap, 1e3));
    json_object_set_new(out, "alone_gap_ms", summary_json(alone, n_alone, 1e3));
    json_object_set_new(out, "probe_ms", json_real((pb.t_end - pb.t_start) * 1e3));
    json_object_set_new(out, "probe_done_during_prefill", json_boolean(pb.t_end < t1));
    json_object_set_new(out, "probe_what", json_string("a third client's APPEND of 8 tokens + DECODE of 4 to its "
                                                       "own session, sent 0.3 s into the prefill"));
    fprintf(stderr, "serve:   %d decode tokens during the %.1f s prefill, longest gap %.0f ms; a short "
                    "APPEND + DECODE took %.0f ms\n",
            during, secs, max_gap * 1e3, (pb.t_end - pb.t_start) * 1e3);
    free(gap);
    free(alone);
    free(sd.t);
    return evict_all(x);
}

/* The stall run with the daemon's decode-yield-ms (ours: its default, then never yielding, as
 * before decode-yield-ms existed; a daemon we did not start: as it is configured). */
static int bench_stall(struct serve_ctx *x, json_t *out)
{
    int spec = x->n_specs > 1 ? 1 : 0;
    json_t *runs = json_array();
    json_object_set_new(out, "runs", runs);
    /* the defaults; decode-share 0 (a round every decode-yield-ms only, as before decode-share);
     * never yielding (as before decode-yield-ms) */
    static const int64_t yields[3] = {-1, -1, STALL_YIELD_OFF}, shares[3] = {-1, 0, 0};
    static const char *const names[3] = {"defaults", "decode-share 0", "never"};
    int n_modes = x->d.pid ? 3 : 1;
    int rc = SKV_OK;
    for (int k = 0; k < n_modes && !rc; k++) {
        if (x->d.pid && (x->yield_ms != yields[k] || x->share != shares[k])) {
            x->yield_ms = yields[k];
            x->share = shares[k];
            if ((rc = use_own_daemon(x, x->pool_bytes)))
                break;
        }
        json_t *o = json_object();
        json_object_set_new(o, "decode_yield_ms",
                            x->d.pid ? (yields[k] < 0 ? json_string("default (100)") : json_integer(yields[k]))
                                     : json_string("as the daemon is configured"));
        json_object_set_new(o, "decode_share",
                            x->d.pid ? (shares[k] < 0 ? json_string("default (25)") : json_integer(shares[k]))
                                     : json_string("as the daemon is configured"));
        json_object_set_new(o, "mode", json_string(x->d.pid ? names[k] : "as the daemon is configured"));
        fprintf(stderr, "serve: decode stall during a %d-token prefill (%s) ...\n", x->context,
                x->d.pid ? names[k] : "as configured");
        rc = stall_run(x, spec, o);
        json_array_append_new(runs, o);
    }
    x->share = -1;
    return rc;
}

/* ---- 6. tenants sharing the engine: one's backlog of long prompts, another's short request ---------- */

#define FAIR_BULK 3                /* tenant "bulk": clients, each with one --context-token PREFILL */
#define FAIR_SMALL_TOKENS 256      /* tenant "small": a PREFILL this long (too long to run inside */
#define FAIR_SMALL_DECODE 8        /* another's forward), then a DECODE of this many tokens */
#define FAIR_SMALL_DELAY 0.3       /* s after the bulk clients sent theirs */

struct fair_client {
    const char *endpoint, *tenant, *spec;
    int n_tokens, decode_tokens, n_vocab, seed;
    double delay;                  /* s after go */
    atomic_bool *go;
    double t_go, t_start, t_end;
    int rc;
    char err[256];
};

/* One client on its own connection, for its tenant: PREFILL (then DECODE) once told to go. */
static void *fair_thread(void *arg)
{
    struct fair_client *fc = arg;
    snapkv_client_t *c = NULL;
    struct snapkv_connect_opts co = {.tenant = fc->tenant, .name = "snapkv-bench-fair", .timeout_ms = LONG_TIMEOUT_MS};
    uint32_t *ids = malloc((size_t)fc->n_tokens * sizeof *ids);
    int rc = ids ? snapkv_connect(fc->endpoint, &co, &c) : SNAPKV_E_NOMEM;
    if (ids)
        fill_ids(ids, fc->n_tokens, fc->n_vocab, (uint64_t)fc->seed);
    while (!rc && !atomic_load(fc->go))
        usleep(200);
    fc->t_go = now_s();
    if (fc->delay > 0)
        usleep((useconds_t)(fc->delay * 1e6));
    fc->t_start = now_s();
    struct snapkv_prefill_opts po = {.tokens = ids, .n_tokens = (size_t)fc->n_tokens, .compress = fc->spec};
    struct snapkv_prefill_result pr = {0};
    const char *what = "PREFILL";
    if (!rc && !(rc = prefill_computed(c, &po, &pr)) && fc->decode_tokens > 0) {
        struct snapkv_sampling sm;
        sampling_greedy(&sm, fc->decode_tokens);
        struct snapkv_decode_result dr = {0};
        what = "DECODE";
        rc = snapkv_decode(c, &pr.id, &sm, NULL, NULL, &dr);
        snapkv_decode_result_free(&dr);
    }
    fc->t_end = now_s();
    if (rc)
        snprintf(fc->err, sizeof fc->err, "%s for tenant %s: %s (%s)", what, fc->tenant, snapkv_last_error(),
                 snapkv_status_str(rc));
    snapkv_prefill_result_free(&pr);
    fc->rc = rc;
    snapkv_close(&c);
    free(ids);
    return NULL;
}

/* One run on the daemon in use: FAIR_BULK clients of tenant "bulk" each send a --context-token
 * PREFILL at once; FAIR_SMALL_DELAY s later a client of tenant "small" sends a
 * FAIR_SMALL_TOKENS-token PREFILL and a DECODE. How long the small one took says whether it
 * waited for the whole backlog or for the prefill running when it came. */
static int fair_run(struct serve_ctx *x, int spec, json_t *out)
{
    struct fair_client fc[FAIR_BULK + 1];
    pthread_t th[FAIR_BULK + 1];
    atomic_bool go = false;
    const char *spec_text = *x->spec_text[spec] ? x->spec_text[spec] : NULL;
    int started = 0, rc = SKV_OK;
    for (int i = 0; i <= FAIR_BULK; i++) {
        bool small = i == FAIR_BULK;
        fc[i] = (struct fair_client){
            .endpoint = x->endpoint, .tenant = small ? "small" : "bulk", .spec = spec_text,
            .n_tokens = small ? FAIR_SMALL_TOKENS : x->context, .decode_tokens = small ? FAIR_SMALL_DECODE : 0,
            .n_vocab = x->m->cfg.n_vocab, .seed = 31 + i, .delay = small ? FAIR_SMALL_DELAY : 0.01 * i, .go = &go,
        };
        if (pthread_create(&th[i], NULL, fair_thread, &fc[i]) != 0) {
            rc = skv_errorf(SKV_E_INTERNAL, "cannot start a client thread");
            break;
        }
        started++;
    }
    usleep(300000); /* every client connected */
    atomic_store(&go, true);
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < started && !rc; i++)
        if (fc[i].rc)
            rc = skv_errorf(SKV_E_INTERNAL, "%s", fc[i].err);
    if (rc)
        return rc;
    const struct fair_client *sm = &fc[FAIR_BULK];
    json_t *bulk = json_array();
    double bulk_last = 0;
    for (int i = 0; i < FAIR_BULK; i++) {
        double t = fc[i].t_end - fc[i].t_go;
        json_array_append_new(bulk, json_real(t));
        bulk_last = t > bulk_last ? t : bulk_last;
    }
    double small_ms = (sm->t_end - sm->t_start) * 1e3;
    int bulk_after = 0; /* bulk prefills that ended after the small request did */
    for (int i = 0; i < FAIR_BULK; i++)
        bulk_after += fc[i].t_end > sm->t_end;
    json_object_set_new(out, "bulk_clients", json_integer(FAIR_BULK));
    json_object_set_new(out, "bulk_prefill_tokens", json_integer(x->context));
    json_object_set_new(out, "prefill_spec", json_string(spec_text ? spec_text : "policy=full"));
    json_object_set_new(out, "bulk_done_s", bulk);
    json_object_set_new(out, "bulk_last_done_s", json_real(bulk_last));
    json_object_set_new(out, "small_ms", json_real(small_ms));
    json_object_set_new(out, "bulk_prefills_done_after_small", json_integer(bulk_after));
    json_object_set_new(out, "small_what",
                        json_string("tenant small: a PREFILL of 256 tokens + DECODE 8, sent 0.3 s after tenant "
                                    "bulk's prefills"));
    fprintf(stderr, "serve:   the small tenant's request took %.0f ms (%d of %d bulk prefills ended after it); the "
                    "last bulk prefill ended at %.1f s\n",
            small_ms, bulk_after, FAIR_BULK, bulk_last);
    return evict_all(x);
}

/* The fair run on our daemon with queue-order fifo (the order before it existed), fair without
 * slices (fair-slice-ms = 0: the running prefill ends first, as before slices existed) and fair
 * with its defaults; on a daemon we did not start, as it is configured. */
static int bench_fair(struct serve_ctx *x, json_t *out)
{
    int spec = x->n_specs > 1 ? 1 : 0;
    json_t *runs = json_array();
    json_object_set_new(out, "runs", runs);
    static const char *const modes[3] = {"fifo", "fair", "fair"};
    static const char *const names[3] = {"fifo", "fair, fair-slice-ms 0", "fair (default fair-slice-ms)"};
    static const int64_t slices[3] = {-1, 0, -1};
    int n_modes = x->d.pid ? 3 : 1;
    int rc = SKV_OK;
    x->yield_ms = -1; /* the default, whatever the stall run left */
    for (int k = 0; k < n_modes && !rc; k++) {
        if (x->d.pid) {
            x->queue_order = modes[k];
            x->slice_ms = slices[k];
            if ((rc = use_own_daemon(x, x->pool_bytes)))
                break;
        }
        json_t *o = json_object();
        json_object_set_new(o, "queue_order", json_string(x->d.pid ? names[k] : "as the daemon is configured"));
        fprintf(stderr, "serve: %d prefills of %d tokens by one tenant, a short request by another (queue-order %s) ...\n",
                FAIR_BULK, x->context, x->d.pid ? names[k] : "as configured");
        rc = fair_run(x, spec, o);
        json_array_append_new(runs, o);
    }
    x->queue_order = NULL;
    x->slice_ms = -1;
    return rc;
}

/* ---- 7. checkpoints while serving (persist-interval-seconds) ------------------------------------- */

#define CKPT_SESSIONS 4           /* full-cache sessions of --context tokens each */
#define CKPT_ROUNDS 10            /* then this many times: an APPEND to one, and the next checkpoint */
#define CKPT_APPEND_TOKENS 8

/* Waits until the daemon's checkpoint count passes `before` (STATS), then reads the bytes all
 * saves wrote so far and how long the last one took. */
static int ckpt_wait(struct serve_ctx *x, double before, double *written, double *seconds)
{
    double count = before;
    int rc = SKV_OK;
    for (double t0 = now_s(); !rc && count <= before;) {
        if (now_s() - t0 > 120)
            return skv_errorf(SKV_E_TIMEOUT, "no checkpoint within 120 s");
        usleep(20000);
        rc = stat_get(x->admin, "snapkv_persist_checkpoints_total", &count);
    }
    if (!rc)
        rc = stat_get(x->admin, "snapkv_persist_written_bytes_total", written);
    if (!rc)
        rc = stat_get(x->admin, "snapkv_persist_last_seconds", seconds);
    if (!rc && count > before + 1)
        fprintf(stderr, "serve:   (%.0f checkpoints where one was expected)\n", count - before);
    return rc;
}

/* CKPT_SESSIONS full-cache sessions of --context tokens on a daemon with persist-interval-seconds
 * 1: the checkpoint that writes them, then CKPT_ROUNDS times an APPEND of a few tokens to one of
 * them and the checkpoint after it (which writes what changed: that session's file, and a KV
 * block when the APPEND filled one). Own daemon only. */
static int bench_checkpoint(struct serve_ctx *x, json_t *out)
{
    if (!x->d.pid) {
        json_object_set_new(out, "skipped", json_string("needs the daemon the bench starts (persist on)"));
        return SKV_OK;
    }
    x->persist_interval = 1;
    int rc = use_own_daemon(x, x->pool_bytes);
    x->persist_interval = 0;
    struct snapkv_session_id ids[CKPT_SESSIONS];
    uint32_t *tok = malloc((size_t)x->context * sizeof *tok);
    double bytes = 0, b_round[CKPT_ROUNDS], s_round[CKPT_ROUNDS];
    if (!rc && !tok)
        rc = SKV_E_NOMEM;
    for (int i = 0; i < CKPT_SESSIONS && !rc; i++) {
        fill_ids(tok, x->context, x->m->cfg.n_vocab, 100 + (uint64_t)i);
        struct snapkv_prefill_opts po = {.tokens = tok, .n_tokens = (size_t)x->context};
        struct snapkv_prefill_result pr;
        fprintf(stderr, "serve: checkpoints: prefill %d of %d (%d tokens) ...\n", i + 1, CKPT_SESSIONS, x->context);
        if ((rc = prefill_computed(x->cl, &po, &pr))) {
            rc = client_fail("PREFILL", rc);
            break;
        }
        ids[i] = pr.id;
        snapkv_prefill_result_free(&pr);
    }
    /* the checkpoints of the prefills: checkpoints come at the worker's one-second ticks while it
     * is idle, between the PREFILLs too; once the count stays for 3 s every session is saved */
    double count = -1, seen = 0, all_bytes = 0, all_s = 0;
    for (double t = now_s(); !rc && now_s() - t < 3; usleep(100000)) {
        if (!(rc = stat_get(x->admin, "snapkv_persist_checkpoints_total", &seen)) && seen != count) {
            count = seen;
            t = now_s();
        }
    }
    if (!rc)
        rc = stat_get(x->admin, "snapkv_persist_written_bytes_total", &all_bytes);
    if (!rc)
        rc = stat_get(x->admin, "snapkv_persist_last_seconds", &all_s);
    double n_first = count;
    for (int k = 0; k < CKPT_ROUNDS && !rc; k++) {
        fill_ids(tok, CKPT_APPEND_TOKENS, x->m->cfg.n_vocab, 200 + (uint64_t)k);
        struct snapkv_append_opts ao = {.tokens = tok, .n_tokens = CKPT_APPEND_TOKENS};
        double before = 0, written = 0;
        if ((rc = stat_get(x->admin, "snapkv_persist_checkpoints_total", &before)) ||
            (rc = stat_get(x->admin, "snapkv_persist_written_bytes_total", &bytes)))
            break;
        if ((rc = snapkv_append(x->cl, &ids[k % CKPT_SESSIONS], &ao, NULL))) {
            rc = client_fail("APPEND", rc);
            break;
        }
        rc = ckpt_wait(x, before, &written, &s_round[k]);
        b_round[k] = written - bytes;
    }
    free(tok);
    if (rc)
        return rc;
    json_object_set_new(out, "sessions", json_integer(CKPT_SESSIONS));
    json_object_set_new(out, "tokens_each", json_integer(x->context));
    json_object_set_new(out, "spec", json_string("full"));
    json_object_set_new(out, "checkpoints_until_all_saved", json_real(n_first));
    json_object_set_new(out, "written_until_all_saved_bytes", json_real(all_bytes));
    json_object_set_new(out, "last_of_those_s", json_real(all_s));
    json_object_set_new(out, "append_tokens", json_integer(CKPT_APPEND_TOKENS));
    json_object_set_new(out, "after_append_bytes", summary_json(b_round, CKPT_ROUNDS, 1));
    json_object_set_new(out, "after_append_s", summary_json(s_round, CKPT_ROUNDS, 1));
    return SKV_OK;
}

/* ---- 8. KV events: a subscriber that does not read does not slow the serving path ------------------- */

#define EVENTS_DOC_TOKENS 2048     /* the document each FORK copies: 128 block hashes in each stored event */
#define EVENTS_PAIRS 3000          /* FORK + RELEASE pairs a run: 6000 events, past what a stuck subscriber's
                                    * queues hold (libzmq's 1000 messages each side, and the socket's buffer) */
#define EVENTS_ROUNDS 3            /* each kind of subscriber this many times, interleaved */

enum events_mode { EVENTS_NONE, EVENTS_STUCK, EVENTS_READING, N_EVENTS_MODES };

/* A subscriber's count of the events it took: those of the run (sequence above `after`) and
 * the numbers it saw missing between them. */
struct events_count {
    uint64_t after, first, last;
    long got, missing;
};

static void events_count_one(struct events_count *c, const struct snapkv_event *e)
{
    if (e->sequence <= c->after) /* before the run (the priming pair), or the library's CLEARED of 0 */
        return;
    if (c->got == 0)
        c->first = e->sequence;
    else if (e->sequence > c->last + 1)
        c->missing += (long)(e->sequence - c->last - 1);
    c->last = e->sequence > c->last ? e->sequence : c->last;
    c->got++;
}

struct events_reader {
    snapkv_events_t *ev;
    struct events_count count;     /* the reader thread's own until it is joined */
    atomic_long taken;             /* count.got, for the main thread meanwhile */
    atomic_bool stop;
};

/* The reading subscriber's thread: takes every event as it comes until told to stop. */
static void *events_reader_thread(void *arg)
{
    struct events_reader *r = arg;
    while (!atomic_load(&r->stop)) {
        struct snapkv_event e;
        int rc = snapkv_events_next(r->ev, 50, &e);
        if (rc == SNAPKV_E_TIMEOUT)
            continue;
        if (rc)
            break;
        events_count_one(&r->count, &e);
        atomic_store(&r->taken, r->count.got);
        snapkv_event_free(&e);
    }
    return NULL;
}

/* Opens a subscriber and makes sure its subscription reached the daemon: FORK + RELEASE pairs
 * until it took an event. *last: the highest sequence number it took. */
static int events_subscribe(struct serve_ctx *x, const char *endpoint, const struct snapkv_session_id *doc,
                            snapkv_events_t **out, uint64_t *last)
{
    int rc = snapkv_events_open(endpoint, out);
    if (rc)
        return client_fail("events subscribe", rc);
    *last = 0;
    for (int k = 0; k < 100 && !rc; k++) {
        struct snapkv_session_id id;
        if ((rc = snapkv_fork(x->cl, doc, &id, NULL)) || (rc = snapkv_release(x->cl, &id)))
            return client_fail("FORK + RELEASE", rc);
        struct snapkv_event e;
        while (snapkv_events_next(*out, 50, &e) == SNAPKV_OK) {
            *last = e.sequence > *last ? e.sequence : *last;
            snapkv_event_free(&e);
        }
        if (*last)
            return SKV_OK;
    }
    return skv_errorf(SKV_E_TIMEOUT, "the events subscriber took no event in 100 FORK + RELEASE pairs");
}

/* One run: EVENTS_PAIRS FORK + RELEASE pairs of the document, each call timed, with the
 * subscriber of `mode` on the events endpoint. */
static int events_run(struct serve_ctx *x, const char *endpoint, const struct snapkv_session_id *doc,
                      enum events_mode mode, json_t *out)
{
    static const char *const names[N_EVENTS_MODES] = {"no subscriber", "a subscriber that never reads",
                                                      "a subscriber that reads every event"};
    struct events_reader r = {0};
    pthread_t th;
    bool reading = false;
    int rc = SKV_OK;
    if (mode != EVENTS_NONE && !(rc = events_subscribe(x, endpoint, doc, &r.ev, &r.count.after)) &&
        mode == EVENTS_READING) {
        if (pthread_create(&th, NULL, events_reader_thread, &r) != 0)
            rc = skv_errorf(SKV_E_INTERNAL, "cannot start the events reader");
        reading = rc == SKV_OK;
    }
    double *fork_s = calloc(EVENTS_PAIRS, sizeof *fork_s), *release_s = calloc(EVENTS_PAIRS, sizeof *release_s);
    if (!rc && (!fork_s || !release_s))
        rc = SKV_E_NOMEM;
    double t0 = now_s();
    for (int i = 0; i < EVENTS_PAIRS && !rc; i++) {
        struct snapkv_session_id id;
        double a = now_s();
        if ((rc = snapkv_fork(x->cl, doc, &id, NULL))) {
            rc = client_fail("FORK", rc);
            break;
        }
        double b = now_s();
        if ((rc = snapkv_release(x->cl, &id))) {
            rc = client_fail("RELEASE", rc);
            break;
        }
        fork_s[i] = b - a;
        release_s[i] = now_s() - b;
    }
    double wall = now_s() - t0;
    /* what the subscriber holds: the reader takes the rest as it comes; the stuck one now reads
     * what its queues kept */
    for (double t = now_s(); !rc && reading && atomic_load(&r.taken) < 2 * EVENTS_PAIRS && now_s() - t < 2;)
        usleep(10000);
    if (reading) {
        atomic_store(&r.stop, true);
        pthread_join(th, NULL);
    }
    uint64_t published = 0;
    if (!rc && mode == EVENTS_STUCK) {
        /* then waits for the daemon's heartbeat (every 2 s while no event goes out): its number
         * shows the events lost after the last one taken, which no later event shows */
        struct snapkv_event e;
        while (snapkv_events_next(r.ev, 2500, &e) == SNAPKV_OK) {
            events_count_one(&r.count, &e);
            snapkv_event_free(&e);
        }
        published = snapkv_events_published(r.ev);
    }
    snapkv_events_close(&r.ev);
    if (!rc) {
        json_object_set_new(out, "subscriber", json_string(names[mode]));
        json_object_set_new(out, "pairs", json_integer(EVENTS_PAIRS));
        json_object_set_new(out, "pairs_per_s", json_real(EVENTS_PAIRS / wall));
        json_object_set_new(out, "fork_us", summary_json(fork_s, EVENTS_PAIRS, 1e6));
        json_object_set_new(out, "release_us", summary_json(release_s, EVENTS_PAIRS, 1e6));
        json_object_set_new(out, "events_published", json_integer(2 * EVENTS_PAIRS));
        if (mode != EVENTS_NONE) {
            json_object_set_new(out, "events_taken", json_integer(r.count.got));
            /* the run's events the subscriber never took; those it saw missing are among them */
            json_object_set_new(out, "events_lost", json_integer(2 * EVENTS_PAIRS - r.count.got));
            json_object_set_new(out, "sequence_gaps_seen", json_integer(r.count.missing));
        }
        if (mode == EVENTS_STUCK) /* snapkv_events_published after the heartbeat, less the last event taken */
            json_object_set_new(out, "missed_shown_by_heartbeat",
                                json_integer((json_int_t)(published > r.count.last ? published - r.count.last : 0)));
        fprintf(stderr, "serve:   %s: %.0f FORK + RELEASE pairs/s%s\n", names[mode], EVENTS_PAIRS / wall,
                mode == EVENTS_NONE ? "" : mode == EVENTS_STUCK ? " (the subscriber read nothing meanwhile)" : "");
    }
    free(fork_s);
    free(release_s);
    return rc;
}

/* KV events with no subscriber, one that never reads, and one that reads (docs/SCALING.md: a
 * subscriber that does not read does not slow the serving path). On the bench's own daemon,
 * restarted with an events-endpoint. */
static int bench_events(struct serve_ctx *x, json_t *out)
{
    if (!x->d.pid) {
        json_object_set_new(out, "skipped", json_string("needs the daemon the bench starts (events-endpoint on)"));
        return SKV_OK;
    }
    x->events = true;
    int rc = use_own_daemon(x, x->pool_bytes);
    x->events = false;
    char endpoint[160];
    snprintf(endpoint, sizeof endpoint, "ipc://%s/e.sock", x->d.dir);
    uint32_t *tok = malloc(EVENTS_DOC_TOKENS * sizeof *tok);
    if (!rc && !tok)
        rc = SKV_E_NOMEM;
    struct snapkv_session_id doc;
    if (!rc) {
        fill_ids(tok, EVENTS_DOC_TOKENS, x->m->cfg.n_vocab, 300);
        struct snapkv_prefill_opts po = {.tokens = tok, .n_tokens = EVENTS_DOC_TOKENS};
        struct snapkv_prefill_result pr = {0};
        fprintf(stderr, "serve: KV events: prefill of the %d-token document ...\n", EVENTS_DOC_TOKENS);
        if ((rc = prefill_computed(x->cl, &po, &pr)))
            rc = client_fail("PREFILL", rc);
        else
            doc = pr.id;
        snapkv_prefill_result_free(&pr);
    }
    free(tok);
    json_t *runs = json_array();
    json_object_set_new(out, "document_tokens", json_integer(EVENTS_DOC_TOKENS));
    json_object_set_new(out, "block_hashes_per_stored_event", json_integer(EVENTS_DOC_TOKENS / x->block_rows));
    json_object_set_new(out, "runs", runs);
    for (int k = 0; k < EVENTS_ROUNDS * N_EVENTS_MODES && !rc; k++) {
        json_t *o = json_object();
        rc = events_run(x, endpoint, &doc, (enum events_mode)(k % N_EVENTS_MODES), o);
        json_array_append_new(runs, o);
    }
    return rc ? rc : evict_all(x);
}

/* ---- 11. Prefix reuse: one document, several questions, as separate PREFILLs ---------------------- */

#define PREFIX_DOC_TOKENS 2048
#define PREFIX_QUESTION_TOKENS 64
#define PREFIX_QUESTIONS 6        /* with the document, 7 full f32 sessions of ~100 MB: the 1 GiB pool */

/* The document PREFILLed alone (full cache), then PREFIX_QUESTIONS PREFILLs of the document
 * followed by a question each under spec `spec`, computing every token or with prefix reuse;
 * their times, the tokens reused and the pool's bytes with all of them held. */
static int prefix_run(struct serve_ctx *x, int spec, bool reuse, json_t *out)
{
    enum { N = PREFIX_DOC_TOKENS + PREFIX_QUESTION_TOKENS };
    uint32_t *tok = malloc(N * sizeof *tok);
    if (!tok)
        return SKV_E_NOMEM;
    int nv = x->m->cfg.n_vocab, rc = evict_all(x);
    fill_ids(tok, PREFIX_DOC_TOKENS, nv, 4242);
    fprintf(stderr, "serve: prefix, %s, %s ...\n", x->spec_name[spec], reuse ? "reused" : "computed");
    struct snapkv_prefill_opts po = {.tokens = tok, .n_tokens = PREFIX_DOC_TOKENS};
    struct snapkv_prefill_result pr = {0};
    double t0 = now_s(), lat[PREFIX_QUESTIONS], used = 0;
    if (!rc && (rc = prefill_computed(x->cl, &po, &pr)))
        rc = client_fail("PREFILL", rc);
    double doc_s = now_s() - t0;
    snapkv_prefill_result_free(&pr);
    po.n_tokens = N;
    po.compress = x->spec_text[spec][0] ? x->spec_text[spec] : NULL;
    uint64_t reused_sum = 0, kept = 0;
    for (int q = 0; q < PREFIX_QUESTIONS && !rc; q++) {
        fill_ids(tok + PREFIX_DOC_TOKENS, PREFIX_QUESTION_TOKENS, nv, 9000 + (uint64_t)q);
        uint32_t reused = 0;
        t0 = now_s();
        if ((rc = snapkv_prefill_flags(x->cl, &po, reuse ? 0 : SNAPKV_PREFILL_NO_PREFIX_REUSE, &pr, &reused)))
            rc = client_fail("PREFILL", rc);
        lat[q] = now_s() - t0;
        reused_sum += reused;
        kept += pr.bytes_after;
        snapkv_prefill_result_free(&pr);
    }
    if (!rc)
        rc = stat_get(x->admin, "snapkv_pool_bytes_used", &used);
    free(tok);
    if (rc)
        return rc;
    json_object_set_new(out, "spec", json_string(x->spec_name[spec]));
    json_object_set_new(out, "reuse", json_boolean(reuse));
    json_object_set_new(out, "document_prefill_s", json_real(doc_s));
    json_object_set_new(out, "prefill_s", summary_json(lat, PREFIX_QUESTIONS, 1.0));
    json_object_set_new(out, "reused_tokens_mean", json_real((double)reused_sum / PREFIX_QUESTIONS));
    json_object_set_new(out, "sessions_bytes", json_integer((json_int_t)kept));
    json_object_set_new(out, "pool_bytes_used", json_integer((json_int_t)used));
    return evict_all(x);
}

static int bench_prefix(struct serve_ctx *x, json_t *out)
{
    json_object_set_new(out, "document_tokens", json_integer(PREFIX_DOC_TOKENS));
    json_object_set_new(out, "question_tokens", json_integer(PREFIX_QUESTION_TOKENS));
    json_object_set_new(out, "questions", json_integer(PREFIX_QUESTIONS));
    json_t *runs = json_array();
    json_object_set_new(out, "runs", runs);
    int rc = SKV_OK;
    for (int s = 0; s < x->n_specs && !rc; s++)
        for (int k = 0; k < 2 && !rc; k++) {
            json_t *o = json_object();
            json_array_append_new(runs, o);
            rc = prefix_run(x, s, k == 1, o);
        }
    return rc;
}

/* ---- 9. Several daemons: sessions placed by document, or round robin ----------------------------- */

#define SPREAD_DAEMONS 3
#define SPREAD_KEYS 3000           /* keys placed for the balance figure (no daemon asked) */
#define SPREAD_DOCS 8              /* documents, each asked SPREAD_QUESTIONS questions */
#define SPREAD_QUESTIONS 6
#define SPREAD_DOC_TOKENS 1024
#define SPREAD_QUESTION_TOKENS 16
#define SPREAD_DECODE_TOKENS 4
#define SPREAD_POOL (UINT64_C(512) << 20) /* each daemon's: all documents fit on one (47 MB each) */

enum spread_mode { SPREAD_ROUND_ROBIN, SPREAD_BY_DOCUMENT, N_SPREAD_MODES };

/* One question: the document's session on the daemon chosen (prefilled there first when that
 * daemon does not hold it yet), a FORK of it, the question APPENDed, a few greedy tokens, the
 * fork RELEASEd. *prefilled says whether the document had to be prefilled. */
static int spread_request(snapkv_client_t *cl, struct snapkv_session_id *doc, bool *held, int d, int q,
                          int n_vocab, bool *prefilled)
{
    int rc;
    *prefilled = !*held;
    if (!*held) {
        uint32_t *tok = malloc(SPREAD_DOC_TOKENS * sizeof *tok);
        if (!tok)
            return SKV_E_NOMEM;
        fill_ids(tok, SPREAD_DOC_TOKENS, n_vocab, 1000 + (uint64_t)d);
        struct snapkv_prefill_opts po = {.tokens = tok, .n_tokens = SPREAD_DOC_TOKENS};
        struct snapkv_prefill_result pr = {0};
        rc = prefill_computed(cl, &po, &pr);
        free(tok);
        if (rc)
            return client_fail("PREFILL", rc);
        *doc = pr.id;
        *held = true;
        snapkv_prefill_result_free(&pr);
    }
    struct snapkv_session_id fork;
    if ((rc = snapkv_fork(cl, doc, &fork, NULL)))
        return client_fail("FORK", rc);
    uint32_t question[SPREAD_QUESTION_TOKENS];
    fill_ids(question, SPREAD_QUESTION_TOKENS, n_vocab, 5000 + (uint64_t)(d * SPREAD_QUESTIONS + q));
    struct snapkv_append_opts ao = {.tokens = question, .n_tokens = SPREAD_QUESTION_TOKENS};
    struct snapkv_append_result ar = {0};
    if ((rc = snapkv_append(cl, &fork, &ao, &ar)))
        rc = client_fail("APPEND", rc);
    snapkv_append_result_free(&ar);
    if (!rc) {
        struct snapkv_sampling sp;
        sampling_greedy(&sp, SPREAD_DECODE_TOKENS);
        struct snapkv_decode_result dr = {0};
        if ((rc = snapkv_decode(cl, &fork, &sp, NULL, NULL, &dr)))
            rc = client_fail("DECODE", rc);
        snapkv_decode_result_free(&dr);
    }
    int rel = snapkv_release(cl, &fork);
    return rc ? rc : rel ? client_fail("RELEASE", rel) : SKV_OK;
}

/* One mode's run on SPREAD_DAEMONS fresh daemons. */
static int spread_run(struct serve_ctx *x, enum spread_mode mode, json_t *out)
{
    static const char *const names[N_SPREAD_MODES] = {"round robin", "by document (snapkv_many_place)"};
    json_object_set_new(out, "placement", json_string(names[mode]));
    struct daemon_child dd[SPREAD_DAEMONS] = {0};
    const char *eps[SPREAD_DAEMONS];
    int rc = SKV_OK;
    for (int i = 0; i < SPREAD_DAEMONS && !rc; i++) {
        rc = daemon_start(x, SPREAD_POOL, &dd[i]);
        eps[i] = dd[i].endpoint;
    }
    snapkv_many_t *many = NULL;
    struct snapkv_connect_opts co = {.name = "snapkv-bench-spread", .timeout_ms = LONG_TIMEOUT_MS};
    if (!rc && (rc = snapkv_connect_many(eps, SPREAD_DAEMONS, &co, 0, &many)))
        rc = client_fail("snapkv_connect_many", rc);
    struct snapkv_session_id doc[SPREAD_DAEMONS][SPREAD_DOCS];
    bool held[SPREAD_DAEMONS][SPREAD_DOCS] = {{false}};
    int per_daemon[SPREAD_DAEMONS] = {0}, prefills = 0, n = 0;
    double lat[SPREAD_DOCS * SPREAD_QUESTIONS];
    double t0 = now_s();
    /* the questions arrive interleaved: each document's first, then each one's second, ... */
    for (int q = 0; q < SPREAD_QUESTIONS && !rc; q++)
        for (int d = 0; d < SPREAD_DOCS && !rc; d++) {
            char key[32];
            snprintf(key, sizeof key, "doc-%d", d);
            snapkv_client_t *cl = NULL;
            size_t at = (size_t)(n % SPREAD_DAEMONS);
            if (mode == SPREAD_BY_DOCUMENT)
                rc = snapkv_many_place(many, key, strlen(key), &cl, &at);
            else
                rc = snapkv_many_client(many, at, &cl);
            if (rc) {
                rc = client_fail("placement", rc);
                break;
            }
            double t = now_s();
            bool prefilled = false;
            rc = spread_request(cl, &doc[at][d], &held[at][d], d, q, (int)x->m->cfg.n_vocab, &prefilled);
            lat[n++] = now_s() - t;
            prefills += prefilled;
            per_daemon[at]++;
        }
    double wall = now_s() - t0;
    snapkv_close_many(&many);
    for (int i = 0; i < SPREAD_DAEMONS; i++)
        if (dd[i].pid || *dd[i].dir) {
            int code = daemon_stop(&dd[i], rc != 0);
            if (code != 0)
                fprintf(stderr, "serve: warning: a spread snapkvd exited with status %d on SIGTERM\n", code);
        }
    if (rc)
        return rc;
    json_t *pd = json_array();
    for (int i = 0; i < SPREAD_DAEMONS; i++)
        json_array_append_new(pd, json_integer(per_daemon[i]));
    json_object_set_new(out, "requests", json_integer(n));
    json_object_set_new(out, "requests_per_daemon", pd);
    json_object_set_new(out, "document_prefills", json_integer(prefills));
    json_object_set_new(out, "prefill_tokens", json_integer((json_int_t)prefills * SPREAD_DOC_TOKENS));
    json_object_set_new(out, "document_hit_rate", json_real((double)(n - prefills) / (double)n));
    json_object_set_new(out, "wall_s", json_real(wall));
    json_object_set_new(out, "request_s", summary_json(lat, (size_t)n, 1.0));
    fprintf(stderr, "serve: spread, %s: %d requests, %d document prefills, %.1f s\n", names[mode], n, prefills,
            wall);
    return SKV_OK;
}

static int bench_spread(struct serve_ctx *x, json_t *out)
{
    if (!x->d.pid) {
        json_object_set_new(out, "skipped", json_string("needs the daemons the bench starts"));
        return SKV_OK;
    }
    /* balance: where SPREAD_KEYS document keys go over three endpoint names (placement asks no
     * daemon) */
    const char *names[SPREAD_DAEMONS] = {"ipc:///run/snapkvd/a.sock", "ipc:///run/snapkvd/b.sock",
                                         "ipc:///run/snapkvd/c.sock"};
    int count[SPREAD_DAEMONS] = {0};
    for (int i = 0; i < SPREAD_KEYS; i++) {
        char key[32];
        snprintf(key, sizeof key, "doc-%d", i);
        size_t at = 0;
        int rc = snapkv_place(names, SPREAD_DAEMONS, key, strlen(key), &at);
        if (rc)
            return client_fail("snapkv_place", rc);
        count[at]++;
    }
    json_t *bal = json_array();
    for (int i = 0; i < SPREAD_DAEMONS; i++)
        json_array_append_new(bal, json_integer(count[i]));
    json_object_set_new(out, "daemons", json_integer(SPREAD_DAEMONS));
    json_object_set_new(out, "balance_keys", json_integer(SPREAD_KEYS));
    json_object_set_new(out, "balance_names", json_pack("[sss]", names[0], names[1], names[2]));
    json_object_set_new(out, "balance_per_daemon", bal);
    json_object_set_new(out, "documents", json_integer(SPREAD_DOCS));
    json_object_set_new(out, "questions_per_document", json_integer(SPREAD_QUESTIONS));
    json_object_set_new(out, "document_tokens", json_integer(SPREAD_DOC_TOKENS));
    json_object_set_new(out, "question_tokens", json_integer(SPREAD_QUESTION_TOKENS));
    json_object_set_new(out, "decode_tokens", json_integer(SPREAD_DECODE_TOKENS));
    json_t *runs = json_array();
    json_object_set_new(out, "runs", runs);
    int rc = SKV_OK;
    for (int k = 0; k < N_SPREAD_MODES && !rc; k++) {
        json_t *o = json_object();
        rc = spread_run(x, (enum spread_mode)k, o);
        json_array_append_new(runs, o);
    }
    return rc;
}

/* ---- sessions through a shared store (store = ...) -------------------------------------------------- */

#define STORE_POOL GIB /* each daemon's: a full-cache session of --context tokens fits */

/* One command to redis-server on sock in the protocol's framing; its answer's first line (up to
 * cap - 1 bytes, its \r\n gone) into out. */
static int redis_call(const char *sock, int argc, const char *const *argv, char *out, size_t cap)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    size_t len = strlen(sock);
    if (len >= sizeof a.sun_path)
        return skv_errorf(SKV_E_INVAL, "socket path too long: %s", sock);
    memcpy(a.sun_path, sock, len + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return skv_errorf(SKV_E_IO, "socket: %s", strerror(errno));
    char cmd[4096];
    int n = snprintf(cmd, sizeof cmd, "*%d\r\n", argc);
    for (int i = 0; i < argc && n > 0 && (size_t)n < sizeof cmd; i++)
        n += snprintf(cmd + n, sizeof cmd - (size_t)n, "$%zu\r\n%s\r\n", strlen(argv[i]), argv[i]);
    bool ok = n > 0 && (size_t)n < sizeof cmd && connect(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
              write(fd, cmd, (size_t)n) == n;
    size_t got = 0;
    while (ok && got < cap - 1 && (got == 0 || out[got - 1] != '\n')) {
        ssize_t m = read(fd, out + got, 1);
        ok = m == 1;
        got += ok;
    }
    close(fd);
    out[got] = '\0';
    out[strcspn(out, "\r\n")] = '\0';
    return ok ? SKV_OK : skv_errorf(SKV_E_IO, "redis-server on %s: %s", sock, argv[0]);
}

/* Whether redis-server answers PING on the socket. */
static bool redis_pong(const char *sock)
{
    const char *argv[] = {"PING"};
    char out[16];
    return redis_call(sock, 1, argv, out, sizeof out) == SKV_OK && strcmp(out, "+PONG") == 0;
}

/* A redis-server of the benchmark's own on a socket in a new directory (no port, nothing saved);
 * *pid 0 and SKV_OK when none is installed. */
static int redis_start(char *dir, size_t dir_cap, char *sock, size_t sock_cap, pid_t *pid)
{
    *pid = 0;
    if (system("command -v redis-server >/dev/null 2>&1") != 0)
        return SKV_OK;
    snprintf(dir, dir_cap, "/tmp/snapkv-bench-redis-XXXXXX");
    if (!mkdtemp(dir))
        return skv_errorf(SKV_E_IO, "mkdtemp: %s", strerror(errno));
    snprintf(sock, sock_cap, "%s/redis.sock", dir);
    fflush(NULL);
    *pid = fork();
    if (*pid < 0) {
        *pid = 0;
        remove_dir(dir);
        return skv_errorf(SKV_E_IO, "fork: %s", strerror(errno));
    }
    if (*pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        char log[128];
        snprintf(log, sizeof log, "%s/redis.log", dir);
        if (!freopen(log, "a", stderr) || !freopen("/dev/null", "w", stdout))
            _exit(126);
        execlp("redis-server", "redis-server", "--port", "0", "--unixsocket", sock, "--save", "", "--appendonly",
               "no", "--dir", dir, (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 200; i++) {
        if (redis_pong(sock))
            return SKV_OK;
        usleep(50000);
    }
    kill(*pid, SIGKILL);
    waitpid(*pid, NULL, 0);
    *pid = 0;
    remove_dir(dir);
    return skv_errorf(SKV_E_TIMEOUT, "redis-server did not answer on %s within 10 s", sock);
}

/* The stat's change since *last (which it moves on). */
static int stat_delta(snapkv_client_t *admin, const char *name, double *last, double *delta)
{
    double v = 0;
    int rc = stat_get(admin, name, &v);
    if (!rc) {
        *delta = v - *last;
        *last = v;
    }
    return rc;
}

/* A 1-token greedy DECODE of id; *secs: how long it took. */
static int decode_one(snapkv_client_t *c, const struct snapkv_session_id *id, double *secs)
{
    struct snapkv_sampling sp;
    sampling_greedy(&sp, 1);
    struct snapkv_decode_result dr = {0};
    double t0 = now_s();
    int rc = snapkv_decode(c, id, &sp, NULL, NULL, &dr);
    *secs = now_s() - t0;
    snapkv_decode_result_free(&dr);
    return rc;
}

/* One spec: a --context-token session prefilled on daemon A with a 1 s lease, spilled when the
 * lease runs out, then a 1-token DECODE of it on daemon B (which takes it from the store) and a
 * second one (B holds it, pinned: it kept the 1 s lease). */
static int store_run(struct serve_ctx *x, snapkv_client_t *ca, snapkv_client_t *aa, snapkv_client_t *cb,
                     snapkv_client_t *ab, int spec, json_t *o)
{
    int n = x->context;
    uint32_t *ids = malloc((size_t)n * sizeof *ids);
    if (!ids)
        return SKV_E_NOMEM;
    fill_ids(ids, n, x->m->cfg.n_vocab, 7000 + (uint64_t)spec);
    struct snapkv_prefill_opts po = {.tokens = ids, .n_tokens = (size_t)n, .lease_seconds = 1,
                                     .compress = *x->spec_text[spec] ? x->spec_text[spec] : NULL};
    double spills = 0, spill_s = 0, spill_b = 0, load_s = 0;
    int rc = SKV_OK;
    if ((rc = stat_get(aa, "snapkv_store_spills_total", &spills)) ||
        (rc = stat_get(aa, "snapkv_store_spill_seconds_total", &spill_s)) ||
        (rc = stat_get(aa, "snapkv_store_spilled_bytes_total", &spill_b)) ||
        (rc = stat_get(ab, "snapkv_store_load_seconds_total", &load_s))) {
        free(ids);
        return rc;
    }
    fprintf(stderr, "serve: store, %s: prefill %d tokens on A ...\n", x->spec_name[spec], n);
    struct snapkv_prefill_result pr;
    double t0 = now_s();
    rc = prefill_computed(ca, &po, &pr);
    double prefill_s = now_s() - t0;
    free(ids);
    if (rc)
        return client_fail("PREFILL", rc);
    struct snapkv_session_id id = pr.id;
    uint64_t kv_bytes = pr.bytes_after;
    snapkv_prefill_result_free(&pr);
    double t_spill = now_s(), spilled = 0;
    while (!rc && spilled < 1) { /* the lease runs out within 2 s; the check runs each second */
        if (now_s() - t_spill > 120)
            return skv_errorf(SKV_E_TIMEOUT, "daemon A spilled nothing within 120 s of a 1 s lease");
        usleep(20000);
        double now_spills = spills;
        rc = stat_delta(aa, "snapkv_store_spills_total", &now_spills, &spilled);
    }
    double spill_secs = 0, bytes = 0, load_secs = 0;
    if (!rc)
        rc = stat_delta(aa, "snapkv_store_spill_seconds_total", &spill_s, &spill_secs);
    if (!rc)
        rc = stat_delta(aa, "snapkv_store_spilled_bytes_total", &spill_b, &bytes);
    double first_s = 0, next_s = 0;
    if (!rc && (rc = decode_one(cb, &id, &first_s)))
        return client_fail("DECODE on B (from the store)", rc);
    if (!rc)
        rc = stat_delta(ab, "snapkv_store_load_seconds_total", &load_s, &load_secs);
    if (!rc && (rc = snapkv_admin_pin(ab, &id))) /* B kept its 1 s lease: not spilled again meanwhile */
        return client_fail("PIN on B", rc);
    if (!rc && (rc = decode_one(cb, &id, &next_s)))
        return client_fail("DECODE on B", rc);
    if (!rc && (rc = snapkv_release(cb, &id)))
        return client_fail("RELEASE", rc);
    if (rc)
        return rc;
    json_object_set_new(o, "spec", json_string(x->spec_name[spec]));
    json_object_set_new(o, "tokens", json_integer(n));
    json_object_set_new(o, "kv_bytes", json_integer((json_int_t)kv_bytes));
    json_object_set_new(o, "stored_bytes", json_integer((json_int_t)bytes));
    json_object_set_new(o, "prefill_s", json_real(prefill_s));
    json_object_set_new(o, "spill_s", json_real(spill_secs));
    json_object_set_new(o, "load_s", json_real(load_secs));
    json_object_set_new(o, "first_decode_s", json_real(first_s));
    json_object_set_new(o, "next_decode_s", json_real(next_s));
    fprintf(stderr, "serve:   %.1f MB stored; prefill %.2f s, spill %.3f s, load %.3f s, decode %.3f s then %.3f s\n",
            bytes / 1e6, prefill_s, spill_secs, load_secs, first_s, next_s);
    return SKV_OK;
}

#define EVICT_ENTRIES 100000 /* a tenant's entries in the store for the EVICT timed */

/* An admin EVICT of a tenant whose EVICT_ENTRIES entries are in the store (small values under
 * this model's keys, as other daemons' spills would be): found by SCAN, each one's pin read
 * (GETRANGE), then deleted (DEL), all on daemon A's engine thread. */
static int evict_run(const char *sock, snapkv_client_t *ca, snapkv_client_t *aa, json_t *o)
{
    struct snapkv_server_info in;
    int rc = snapkv_server_info(ca, &in);
    if (rc)
        return client_fail("HELLO's model fingerprint", rc);
    char prefix[200], count[16], out[256];
    snprintf(prefix, sizeof prefix, "snapkv:%s:bench-evict:", in.model_fingerprint);
    snprintf(count, sizeof count, "%d", EVICT_ENTRIES);
    const char *argv[] = {"EVAL",
                          "for i = 1, tonumber(ARGV[2]) do redis.call('SET', ARGV[1] .. string.format('%032x', i), "
                          "'x') end return 1",
                          "0", prefix, count};
    rc = redis_call(sock, 5, argv, out, sizeof out);
    if (!rc && strcmp(out, ":1") != 0)
        rc = skv_errorf(SKV_E_IO, "redis-server did not make the entries: %s", out);
    if (rc)
        return rc;
    fprintf(stderr, "serve: store, EVICT of a tenant with %d entries in the store ...\n", EVICT_ENTRIES);
    uint32_t evicted = 0;
    double t0 = now_s();
    rc = snapkv_admin_evict(aa, NULL, "bench-evict", false, &evicted, NULL);
    double secs = now_s() - t0;
    if (rc)
        return client_fail("EVICT --tenant bench-evict", rc);
    if (evicted != EVICT_ENTRIES)
        return skv_errorf(SKV_E_INTERNAL, "EVICT --tenant bench-evict: %u evicted, not %d", evicted, EVICT_ENTRIES);
    json_object_set_new(o, "entries", json_integer(EVICT_ENTRIES));
    json_object_set_new(o, "evicted", json_integer(evicted));
    json_object_set_new(o, "evict_s", json_real(secs));
    fprintf(stderr, "serve:   %u evicted in %.3f s\n", evicted, secs);
    return SKV_OK;
}

static int bench_store(struct serve_ctx *x, json_t *out)
{
    if (!x->d.pid) {
        json_object_set_new(out, "skipped", json_string("needs the daemons the bench starts"));
        return SKV_OK;
    }
    char dir[64], sock[128], url[160];
    pid_t redis = 0;
    int rc = redis_start(dir, sizeof dir, sock, sizeof sock, &redis);
    if (!rc && !redis) {
        json_object_set_new(out, "skipped", json_string("redis-server is not installed (apt install redis-server)"));
        return SKV_OK;
    }
    if (rc)
        return rc;
    snprintf(url, sizeof url, "unix://%s", sock);
    x->store = url;
    char secret[200];
    snprintf(secret, sizeof secret, "%s/store.key", dir);
    if (x->store_signed) { /* a secret both daemons sign with */
        unsigned char raw[32];
        char b64[sodium_base64_ENCODED_LEN(sizeof raw, sodium_base64_VARIANT_ORIGINAL)];
        int fd = -1;
        if (sodium_init() < 0) {
            rc = skv_errorf(SKV_E_INTERNAL, "libsodium does not start");
        } else {
            randombytes_buf(raw, sizeof raw);
            sodium_bin2base64(b64, sizeof b64, raw, sizeof raw, sodium_base64_VARIANT_ORIGINAL);
            fd = open(secret, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        }
        if (!rc && (fd < 0 || write(fd, b64, strlen(b64)) != (ssize_t)strlen(b64)))
            rc = skv_errorf(SKV_E_IO, "%s: %s", secret, strerror(errno));
        if (fd >= 0)
            close(fd);
        x->store_secret = secret;
    }
    struct daemon_child da = {0}, db = {0};
    if (!rc)
        rc = daemon_start(x, STORE_POOL, &da);
    if (!rc)
        rc = daemon_start(x, STORE_POOL, &db);
    x->store = NULL;
    x->store_secret = NULL;
    snapkv_client_t *ca = NULL, *aa = NULL, *cb = NULL, *ab = NULL;
    struct snapkv_connect_opts co = {.name = "snapkv-bench-store", .timeout_ms = LONG_TIMEOUT_MS};
    if (!rc && ((rc = snapkv_connect(da.endpoint, &co, &ca)) || (rc = snapkv_connect(da.admin, &co, &aa)) ||
                (rc = snapkv_connect(db.endpoint, &co, &cb)) || (rc = snapkv_connect(db.admin, &co, &ab))))
        rc = client_fail("connect", rc);
    json_object_set_new(out, "store", json_string(x->store_signed ? "redis-server on a local unix socket, values "
                                                                    "signed (store-secret-file)"
                                                                  : "redis-server on a local unix socket"));
    json_object_set_new(out, "decode_tokens", json_integer(1));
    json_t *runs = json_array();
    json_object_set_new(out, "runs", runs);
    for (int s = 0; s < x->n_specs && !rc; s++) {
        json_t *o = json_object();
        rc = store_run(x, ca, aa, cb, ab, s, o);
        json_array_append_new(runs, o);
    }
    if (!rc) {
        json_t *ev = json_object();
        json_object_set_new(out, "evict", ev);
        rc = evict_run(sock, ca, aa, ev);
    }
    snapkv_close(&ca);
    snapkv_close(&aa);
    snapkv_close(&cb);
    snapkv_close(&ab);
    for (struct daemon_child *d = &da; d; d = d == &da ? &db : NULL)
        if (d->pid || *d->dir) {
            int code = daemon_stop(d, rc != 0);
            if (code != 0)
                fprintf(stderr, "serve: warning: a store snapkvd exited with status %d on SIGTERM\n", code);
        }
    kill(redis, SIGTERM);
    waitpid(redis, NULL, 0);
    remove_dir(dir);
    return rc;
}

/* ---- report ---------------------------------------------------------------------------------------- */

static void cpu_model(char *buf, size_t cap)
{
    snprintf(buf, cap, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "model name", 10) == 0) {
            char *p = strchr(line, ':');
            if (p) {
                p += 1 + (p[1] == ' ');
                p[strcspn(p, "\n")] = '\0';
                snprintf(buf, cap, "%s", p);
            }
            break;
        }
    fclose(f);
}

/* The 1-minute load average (the machine may be shared: it says how quiet it was). */
static double load_1min(void)
{
    double l[1] = {-1};
    return getloadavg(l, 1) == 1 ? l[0] : -1;
}

/* Resident MiB of a process (our snapkvd), -1 when unknown. */
static double rss_mib(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = pid > 0 ? fopen(path, "r") : NULL;
    double v = -1;
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "VmRSS:", 6) == 0)
            v = strtod(line + 6, NULL) / 1024.0;
    if (f)
        fclose(f);
    return v;
}

static const char *yes_no(bool ok)
{
    return ok ? "yes" : "NO";
}

static void print_table(FILE *f, const json_t *j)
{
    const json_t *rt = json_object_get(j, "roundtrip"), *tp = json_object_get(j, "throughput"),
                 *cp = json_object_get(j, "capacity"), *dc = json_object_get(j, "decode");
    fprintf(f, "snapkvd benchmark: %s, backend %s, %lld threads, %s (%lld online CPUs, load %.1f at start, "
               "%.1f at end, %.0f s)\n",
            json_string_value(json_object_get(j, "model")), json_string_value(json_object_get(j, "backend")),
            (long long)json_integer_value(json_object_get(j, "threads")), json_string_value(json_object_get(j, "cpu")),
            (long long)json_integer_value(json_object_get(j, "online_cpus")), jnum(j, "load_1min_start"),
            jnum(j, "load_1min_end"), jnum(j, "seconds"));
    if (rt) {
        const json_t *a = json_object_get(rt, "admin_status_us"), *r = json_object_get(rt, "engine_release_not_found_us");
        fprintf(f, "\n| round trip (%d calls)                 | p50 µs | p99 µs | mean µs |\n|---|---|---|---|\n",
                ROUNDTRIP_CALLS);
        fprintf(f, "| admin STATUS (socket thread)          | %6.1f | %6.1f | %7.1f |\n", jnum(a, "p50"), jnum(a, "p99"),
                jnum(a, "mean"));
        fprintf(f, "| RELEASE unknown id (engine worker)    | %6.1f | %6.1f | %7.1f |\n", jnum(r, "p50"), jnum(r, "p99"),
                jnum(r, "mean"));
        const json_t *z = json_object_get(rt, "zmq_echo_us");
        if (z)
            fprintf(f, "| transport alone (plain ZeroMQ echo)   | %6.1f | %6.1f | %7.1f |\n", jnum(z, "p50"),
                    jnum(z, "p99"), jnum(z, "mean"));
    }
    if (tp) {
        const json_t *d = json_object_get(tp, "daemon"), *i = json_object_get(tp, "in_process");
        const json_t *dl = json_object_get(d, "latency_ms"), *il = json_object_get(i, "latency_ms");
        fprintf(f,
                "\n%lld clients x %lld requests, each prefill %lld + greedy decode %lld + release\n"
                "| path                     | wall s | req/s | tokens/s | p50 ms | p99 ms |\n|---|---|---|---|---|---|\n",
                (long long)json_integer_value(json_object_get(tp, "clients")),
                (long long)json_integer_value(json_object_get(tp, "requests_per_client")),
                (long long)json_integer_value(json_object_get(tp, "prompt_tokens")),
                (long long)json_integer_value(json_object_get(tp, "decode_tokens")));
        fprintf(f, "| daemon, client processes | %6.2f | %5.2f | %8.1f | %6.1f | %6.1f |\n", jnum(d, "wall_s"),
                jnum(d, "requests_per_s"), jnum(d, "tokens_per_s"), jnum(dl, "p50"), jnum(dl, "p99"));
        fprintf(f, "| in-process, sequential   | %6.2f | %5.2f | %8.1f | %6.1f | %6.1f |\n", jnum(i, "wall_s"),
                jnum(i, "requests_per_s"), jnum(i, "tokens_per_s"), jnum(il, "p50"), jnum(il, "p99"));
        const json_t *b = json_object_get(tp, "in_process_batched"), *bl = json_object_get(b, "latency_ms");
        if (b)
            fprintf(f, "| in-process, %2lld at a time (latency: its round's) "
                       "| %6.2f | %5.2f | %8.1f | %6.1f | %6.1f |\n",
                    (long long)json_integer_value(json_object_get(tp, "clients")), jnum(b, "wall_s"),
                    jnum(b, "requests_per_s"), jnum(b, "tokens_per_s"), jnum(bl, "p50"), jnum(bl, "p99"));
        fprintf(f, "daemon / in-process throughput: %.3f; greedy tokens equal in %lld of %lld compared requests\n",
                jnum(tp, "ratio"), (long long)json_integer_value(json_object_get(tp, "greedy_tokens_match")),
                (long long)json_integer_value(json_object_get(tp, "greedy_tokens_compared")));
        if (b)
            fprintf(f, "daemon / in-process %lld at a time (each round's prompts one after another, their decodes "
                       "batched: the best the daemon's order can do): %.3f; its greedy tokens equal the sequential "
                       "run's in %lld of %lld\n",
                    (long long)json_integer_value(json_object_get(tp, "clients")), jnum(tp, "ratio_batched"),
                    (long long)json_integer_value(json_object_get(tp, "batched_tokens_match")),
                    (long long)json_integer_value(json_object_get(tp, "batched_tokens_compared")));
    }
    if (cp) {
        fprintf(f,
                "\n%lld-token sessions in a %.2f GiB pool\n"
                "| spec                 | KV MiB / session | prefill s | fit (computed) | held before eviction | x full |\n"
                "|---|---|---|---|---|---|\n",
                (long long)json_integer_value(json_object_get(cp, "context_tokens")), jnum(cp, "pool_bytes") / GIB);
        size_t k;
        const json_t *o;
        json_array_foreach(json_object_get(cp, "specs"), k, o)
            fprintf(f, "| %-20s | %16.2f | %9.1f | %14lld | %20lld | %6.2f |\n",
                    json_string_value(json_object_get(o, "name")), jnum(o, "bytes_after") / 1048576.0,
                    jnum(o, "prefill_s"), (long long)json_integer_value(json_object_get(o, "sessions_fit")),
                    (long long)json_integer_value(json_object_get(o, "sessions_held_before_eviction")),
                    jnum(o, "ratio_vs_full"));
    }
    if (dc) {
        fprintf(f,
                "\nconcurrent %lld-token sessions, %lld greedy tokens each (pool %.2f GiB)\n"
                "| spec                 | sessions | wall s | aggregate tokens/s | x full | session p50 s | snapkvd RSS MiB before -> after |\n"
                "|---|---|---|---|---|---|---|\n",
                (long long)json_integer_value(json_object_get(dc, "context_tokens")),
                (long long)json_integer_value(json_object_get(dc, "tokens_per_session")), jnum(dc, "pool_bytes") / GIB);
        size_t k;
        const json_t *o;
        json_array_foreach(json_object_get(dc, "specs"), k, o) {
            if (json_object_get(o, "skipped"))
                fprintf(f, "| %-20s | skipped: %s |\n", json_string_value(json_object_get(o, "name")),
                        json_string_value(json_object_get(o, "skipped")));
            else
                fprintf(f, "| %-20s | %8lld | %6.1f | %18.1f | %6.2f | %13.1f | %6.0f -> %6.0f |\n",
                        json_string_value(json_object_get(o, "name")),
                        (long long)json_integer_value(json_object_get(o, "sessions")), jnum(o, "wall_s"),
                        jnum(o, "tokens_per_s"),
                        jnum(o, "ratio_vs_full"), jnum(json_object_get(o, "session_decode_s"), "p50"),
                        jnum(o, "daemon_rss_mib_before"), jnum(o, "daemon_rss_mib_after"));
        }
    }
    const json_t *st = json_object_get(j, "stall");
    if (st) {
        fprintf(f, "\na streaming decode while another client prefills\n"
                   "| daemon | prefill | prefill s | decode tokens meanwhile | longest gap ms | gap p50 ms | "
                   "gap alone p50 ms | short APPEND + DECODE ms |\n|---|---|---|---|---|---|---|---|\n");
        size_t k;
        const json_t *o;
        json_array_foreach(json_object_get(st, "runs"), k, o)
            fprintf(f, "| %s | %lld tokens, %s | %.1f | %lld | %.0f | %.0f | %.1f | %.0f |\n",
                    json_string_value(json_object_get(o, "mode")),
                    (long long)json_integer_value(json_object_get(o, "prefill_tokens")),
                    json_string_value(json_object_get(o, "prefill_spec")), jnum(o, "prefill_s"),
                    (long long)json_integer_value(json_object_get(o, "tokens_during_prefill")), jnum(o, "max_gap_ms"),
                    jnum(json_object_get(o, "gap_ms"), "p50"), jnum(json_object_get(o, "alone_gap_ms"), "p50"),
                    jnum(o, "probe_ms"));
    }
    const json_t *fr = json_object_get(j, "fair");
    if (fr) {
        fprintf(f, "\none tenant's backlog of prefills and another tenant's short request\n"
                   "| queue-order | bulk prefills | small tenant's PREFILL 256 + DECODE 8, ms | bulk prefills ended "
                   "after it | last bulk prefill ended, s |\n|---|---|---|---|---|\n");
        size_t k;
        const json_t *o;
        json_array_foreach(json_object_get(fr, "runs"), k, o)
            fprintf(f, "| %s | %lld x %lld tokens, %s | %.0f | %lld | %.1f |\n",
                    json_string_value(json_object_get(o, "queue_order")),
                    (long long)json_integer_value(json_object_get(o, "bulk_clients")),
                    (long long)json_integer_value(json_object_get(o, "bulk_prefill_tokens")),
                    json_string_value(json_object_get(o, "prefill_spec")), jnum(o, "small_ms"),
                    (long long)json_integer_value(json_object_get(o, "bulk_prefills_done_after_small")),
                    jnum(o, "bulk_last_done_s"));
    }
    const json_t *ck = json_object_get(j, "checkpoint");
    if (!part_skipped(f, ck, "checkpoints")) {
        const json_t *b = json_object_get(ck, "after_append_bytes"), *t = json_object_get(ck, "after_append_s");
        fprintf(f, "\ncheckpoints (persist-interval-seconds 1), %lld full-cache sessions of %lld tokens\n"
                   "| checkpoint | bytes written | seconds |\n|---|---|---|\n"
                   "| until every session was saved (%.0f checkpoints) | %.0f | %.3f (the last) |\n"
                   "| after an APPEND of %lld tokens to one (%lld times): p50 / max | %.0f / %.0f | %.3f / %.3f |\n",
                (long long)json_integer_value(json_object_get(ck, "sessions")),
                (long long)json_integer_value(json_object_get(ck, "tokens_each")),
                jnum(ck, "checkpoints_until_all_saved"), jnum(ck, "written_until_all_saved_bytes"),
                jnum(ck, "last_of_those_s"),
                (long long)json_integer_value(json_object_get(ck, "append_tokens")),
                (long long)json_integer_value(json_object_get(b, "n")), jnum(b, "p50"), jnum(b, "max"),
                jnum(t, "p50"), jnum(t, "max"));
    }
    const json_t *ev = json_object_get(j, "events");
    if (!part_skipped(f, ev, "KV events")) {
        fprintf(f, "\nKV events: FORK + RELEASE of a %lld-token document (%lld block hashes a stored event)\n"
                   "| subscriber | pairs/s | FORK p50 / p99 us | RELEASE p50 / p99 us | events taken / lost |\n"
                   "|---|---|---|---|---|\n",
                (long long)json_integer_value(json_object_get(ev, "document_tokens")),
                (long long)json_integer_value(json_object_get(ev, "block_hashes_per_stored_event")));
        size_t k;
        const json_t *o;
        json_array_foreach(json_object_get(ev, "runs"), k, o) {
            const json_t *fk = json_object_get(o, "fork_us"), *rl = json_object_get(o, "release_us");
            char taken[64] = "-";
            if (json_object_get(o, "events_taken"))
                snprintf(taken, sizeof taken, "%lld / %lld",
                         (long long)json_integer_value(json_object_get(o, "events_taken")),
                         (long long)json_integer_value(json_object_get(o, "events_lost")));
            fprintf(f, "| %s | %.0f | %.0f / %.0f | %.0f / %.0f | %s |\n",
                    json_string_value(json_object_get(o, "subscriber")), jnum(o, "pairs_per_s"), jnum(fk, "p50"),
                    jnum(fk, "p99"), jnum(rl, "p50"), jnum(rl, "p99"), taken);
        }
    }
    const json_t *sp = json_object_get(j, "spread");
    if (!part_skipped(f, sp, "Several daemons")) {
        const json_t *bal = json_object_get(sp, "balance_per_daemon");
        fprintf(f, "\nSeveral daemons: %lld documents of %lld tokens, %lld questions each (%lld tokens APPENDed to a "
                   "FORK, %lld decoded), over %lld daemons; %lld keys placed %lld / %lld / %lld\n"
                   "| placement | requests per daemon | document prefills | hit rate | wall s | request p50 / p99 s |\n"
                   "|---|---|---|---|---|---|\n",
                jint(sp, "documents"), jint(sp, "document_tokens"), jint(sp, "questions_per_document"),
                jint(sp, "question_tokens"), jint(sp, "decode_tokens"), jint(sp, "daemons"), jint(sp, "balance_keys"),
                (long long)json_integer_value(json_array_get(bal, 0)),
                (long long)json_integer_value(json_array_get(bal, 1)),
                (long long)json_integer_value(json_array_get(bal, 2)));
        size_t k;
        const json_t *o;
        json_array_foreach(json_object_get(sp, "runs"), k, o) {
            const json_t *pd = json_object_get(o, "requests_per_daemon"), *rq = json_object_get(o, "request_s");
            if (!pd) /* a run that failed */
                continue;
            fprintf(f, "| %s | %lld / %lld / %lld | %lld | %.2f | %.1f | %.2f / %.2f |\n",
                    json_string_value(json_object_get(o, "placement")),
                    (long long)json_integer_value(json_array_get(pd, 0)),
                    (long long)json_integer_value(json_array_get(pd, 1)),
                    (long long)json_integer_value(json_array_get(pd, 2)), jint(o, "document_prefills"),
                    jnum(o, "document_hit_rate"), jnum(o, "wall_s"), jnum(rq, "p50"), jnum(rq, "p99"));
        }
    }
    const json_t *so = json_object_get(j, "store");
    if (!part_skipped(f, so, "Sessions through a shared store")) {
        fprintf(f, "\nSessions through a shared store (%s): prefilled on daemon A with a 1 s lease, spilled when it "
                   "ran out, then DECODEd (1 token) on daemon B, which takes them from the store, and once more\n"
                   "| spec | tokens | KV MB | stored MB | prefill s | spill s (A) | load s (B) | first decode s (B) | "
                   "next decode s (B) |\n|---|---|---|---|---|---|---|---|---|\n",
                json_string_value(json_object_get(so, "store")));
        size_t k;
        const json_t *o;
        json_array_foreach(json_object_get(so, "runs"), k, o) {
            if (!json_object_get(o, "prefill_s")) /* a run that failed */
                continue;
            fprintf(f, "| %s | %lld | %.1f | %.1f | %.2f | %.3f | %.3f | %.3f | %.3f |\n",
                    json_string_value(json_object_get(o, "spec")), jint(o, "tokens"), jnum(o, "kv_bytes") / 1e6,
                    jnum(o, "stored_bytes") / 1e6, jnum(o, "prefill_s"), jnum(o, "spill_s"), jnum(o, "load_s"),
                    jnum(o, "first_decode_s"), jnum(o, "next_decode_s"));
        }
        const json_t *evs = json_object_get(so, "evict");
        if (json_object_get(evs, "evict_s"))
            fprintf(f, "\nAn admin EVICT of a tenant with %lld entries in the store (SCAN, each entry's pin read with "
                       "GETRANGE, DEL), on daemon A's engine thread: %lld evicted in %.3f s\n",
                    jint(evs, "entries"), jint(evs, "evicted"), jnum(evs, "evict_s"));
    }
    const json_t *px = json_object_get(j, "prefix");
    if (!part_skipped(f, px, "Prefix reuse")) {
        fprintf(f, "\nPrefix reuse: a document of %lld tokens PREFILLed alone (full cache), then %lld PREFILLs of it "
                   "followed by a question of %lld tokens each\n"
                   "| spec | prefix | tokens reused | PREFILL p50 / max s | KV MB the sessions hold | pool MB used |\n"
                   "|---|---|---|---|---|---|\n",
                jint(px, "document_tokens"), jint(px, "questions"), jint(px, "question_tokens"));
        size_t k;
        const json_t *o;
        json_array_foreach(json_object_get(px, "runs"), k, o) {
            const json_t *ps = json_object_get(o, "prefill_s");
            if (!ps) /* a run that failed */
                continue;
            fprintf(f, "| %s | %s | %.0f | %.3f / %.3f | %.1f | %.1f |\n", json_string_value(json_object_get(o, "spec")),
                    json_is_true(json_object_get(o, "reuse")) ? "reused" : "computed", jnum(o, "reused_tokens_mean"),
                    jnum(ps, "p50"), jnum(ps, "max"), jnum(o, "sessions_bytes") / 1e6, jnum(o, "pool_bytes_used") / 1e6);
        }
    }
    const json_t *g = json_object_get(j, "goals");
    if (g && json_object_size(g)) {
        fprintf(f, "\n| goal | measured | met |\n|---|---|---|\n");
        const char *key;
        const json_t *o;
        json_object_foreach((json_t *)g, key, o)
            fprintf(f, "| %s | %.3f | %s |\n", json_string_value(json_object_get(o, "goal")), jnum(o, "measured"),
                    yes_no(json_is_true(json_object_get(o, "met"))));
    }
}

static void goal(json_t *goals, const char *key, const char *text, double measured, bool met)
{
    json_t *o = json_object();
    json_object_set_new(o, "goal", json_string(text));
    json_object_set_new(o, "measured", json_real(measured));
    json_object_set_new(o, "met", json_boolean(met));
    json_object_set_new(goals, key, o);
}

static void add_goals(json_t *j, bool default_specs)
{
    json_t *goals = json_object();
    const json_t *rt = json_object_get(j, "roundtrip"), *tp = json_object_get(j, "throughput"),
                 *cp = json_object_get(j, "capacity");
    if (rt) {
        double p50 = jnum(json_object_get(rt, "admin_status_us"), "p50");
        goal(goals, "noop_p50_us", "no-op round trip p50 < 100 us", p50, p50 < 100);
    }
    if (tp) {
        double r = jnum(tp, "ratio");
        char text[96];
        snprintf(text, sizeof text, "throughput with %lld clients >= 0.9x in-process",
                 (long long)json_integer_value(json_object_get(tp, "clients")));
        goal(goals, "throughput_ratio", text, r, r >= 0.9);
    }
    const json_t *specs = json_object_get(cp, "specs");
    for (size_t s = 1; default_specs && s < json_array_size(specs); s++) {
        const json_t *o = json_array_get(specs, s);
        double r = jnum(o, "ratio_vs_full");
        char key[48], text[128];
        snprintf(key, sizeof key, "capacity_ratio_%zu", s);
        snprintf(text, sizeof text, "%s: >= 9.5x the full-cache sessions in 1 GiB",
                 json_string_value(json_object_get(o, "name")));
        goal(goals, key, text, r, r >= 9.5);
    }
    for (size_t s = 0; s < json_array_size(specs); s++) {
        const json_t *o = json_array_get(specs, s);
        char key[48], text[128];
        snprintf(key, sizeof key, "capacity_verified_%zu", s);
        snprintf(text, sizeof text, "%s: sessions held before eviction = computed +-1",
                 json_string_value(json_object_get(o, "name")));
        goal(goals, key, text, (double)json_integer_value(json_object_get(o, "sessions_held_before_eviction")),
             json_is_true(json_object_get(o, "verified")));
    }
    json_object_set_new(j, "goals", goals);
}

/* --specs "SPEC;SPEC;..." into x (the first is the baseline the others are compared with),
 * or the built-in three. */
static int parse_specs(struct serve_ctx *x, const char *list)
{
    x->default_specs = !list || !*list;
    if (x->default_specs) {
        x->n_specs = N_DEFAULT_SPECS;
        for (int s = 0; s < N_DEFAULT_SPECS; s++) {
            snprintf(x->spec_text[s], sizeof x->spec_text[s], "%s", default_spec_text[s]);
            snprintf(x->spec_name[s], sizeof x->spec_name[s], "%s", default_spec_name[s]);
        }
        return SKV_OK;
    }
    x->n_specs = 0;
    for (const char *p = list; *p;) {
        size_t len = strcspn(p, ";"), skip = len + (p[len] == ';');
        while (len && (*p == ' ' || *p == '\t')) /* blanks around a spec (a blank one ran policy=full) */
            p++, len--, skip--;
        while (len && (p[len - 1] == ' ' || p[len - 1] == '\t'))
            len--;
        if (x->n_specs == MAX_SPECS)
            return skv_errorf(SKV_E_INVAL, "--specs: at most %d specs", MAX_SPECS);
        if (len == 0 || len >= sizeof x->spec_text[0])
            return skv_errorf(SKV_E_INVAL, "--specs: empty or overlong spec in '%s'", list);
        char *t = x->spec_text[x->n_specs];
        memcpy(t, p, len);
        t[len] = '\0';
        struct skv_compress_spec cs;
        int rc = skv_compress_spec_parse(t, &cs);
        if (rc)
            return rc;
        bool full = cs.policy == SKV_POLICY_FULL;
        strcpy(x->spec_name[x->n_specs], full ? "full" : t); /* both fit: t is shorter than 256 */
        if (full)
            t[0] = '\0';
        x->n_specs++;
        p += skip;
    }
    return SKV_OK;
}

/* --parts: which of roundtrip, throughput, capacity, decode, stall, fair, checkpoint, events,
 * spread, store, prefix run (NULL: all but checkpoint, events, spread, store and prefix). */
static int parse_parts(const char *list, bool on[N_PARTS])
{
    static const char *const names[N_PARTS] = {"roundtrip", "throughput", "capacity", "decode", "stall",
                                               "fair",      "checkpoint", "events",   "spread",     "store",
                                               "prefix"};
    for (int i = 0; i < N_PARTS; i++)
        on[i] = !list && i < 6; /* checkpoint, events, spread, store, prefix: only when asked for */
    for (const char *p = list; p && *p;) {
        size_t len = strcspn(p, ",");
        int i = 0;
        while (i < N_PARTS && !(strlen(names[i]) == len && memcmp(names[i], p, len) == 0))
            i++;
        if (i == N_PARTS)
            return skv_errorf(SKV_E_INVAL,
                              "--parts: unknown part '%.*s' (roundtrip, throughput, capacity, decode, stall, fair, "
                              "checkpoint, events, spread, store, prefix)",
                              (int)len, p);
        on[i] = true;
        p += len + (p[len] == ',');
    }
    return SKV_OK;
}

int skv_bench_serve(struct skv_engine *e, struct skv_model *m, const struct skv_serve_opts *o)
{
    struct serve_ctx x = {
        .o = o, .e = e, .m = m,
        .clients = o->clients > 0 ? o->clients : 8,
        .requests = o->requests > 0 ? o->requests : 4,
        .context = o->context > 0 ? o->context : 4096,
        .sessions = o->sessions > 0 ? o->sessions : 16,
        .decode_tokens = o->decode_tokens > 0 ? o->decode_tokens : 32,
        .store_signed = o->store_signed,
        .yield_ms = -1,
        .slice_ms = -1,
        .share = -1,
    };
    if (!o->endpoint != !o->admin_endpoint)
        return skv_errorf(SKV_E_INVAL, "give both --endpoint and --admin-endpoint, or neither");
    if (x.decode_tokens > MAX_REPORT_TOKENS)
        return skv_errorf(SKV_E_INVAL, "--decode-tokens: at most %d", MAX_REPORT_TOKENS);
    if (!(o->pool_gib >= 0 && o->pool_gib <= 65536))
        return skv_errorf(SKV_E_INVAL, "--pool-gib: between 0 and 65536");
    x.capacity_pool = o->pool_gib > 0 ? (uint64_t)(o->pool_gib * (double)GIB) : CAPACITY_POOL;
    bool part[N_PARTS];
    int rc = parse_specs(&x, o->specs);
    if (!rc)
        rc = parse_parts(o->parts, part);
    if (rc)
        return rc;
    if (o->sessions_fit && part[3] && !part[2])
        return skv_errorf(SKV_E_INVAL, "--sessions fit needs the capacity part (--parts ...,capacity,decode)");
    signal(SIGPIPE, SIG_IGN);
    if (o->endpoint) {
        x.endpoint = o->endpoint;
        x.admin_endpoint = o->admin_endpoint;
        rc = connect_both(&x);
    } else {
        rc = use_own_daemon(&x, x.capacity_pool);
    }
    if (rc)
        return rc;
    json_t *j = json_object(), *cmd = json_array();
    for (int i = 0; i < o->argc; i++)
        json_array_append_new(cmd, json_string(o->argv[i]));
    char cpu[256];
    cpu_model(cpu, sizeof cpu);
    json_object_set_new(j, "command", cmd);
    json_object_set_new(j, "model", json_string(m->name));
    json_object_set_new(j, "backend", json_string(m->be->name));
    json_object_set_new(j, "threads", json_integer(m->be->n_threads));
    json_object_set_new(j, "kv_type", json_string(skv_dtype_name(skv_kv_pool_kv_type(m->kv_pool))));
    json_object_set_new(j, "cpu", json_string(cpu));
    json_object_set_new(j, "online_cpus", json_integer(sysconf(_SC_NPROCESSORS_ONLN)));
    json_object_set_new(j, "daemon_started_by_bench", json_boolean(x.d.pid != 0));
    json_object_set_new(j, "notes",
                        json_string("snapkvd runs every request on one engine worker thread (the backend's thread "
                                    "pool inside it), so daemon throughput is bounded by the engine; every running "
                                    "decode advances one token per round, the round's sessions in one batched "
                                    "forward (up to 32 per forward with quantized weights on the CPU). The decode part runs on a pool large enough for all sessions of "
                                    "every spec (a 1 GiB pool holds only the computed number of full-cache "
                                    "sessions)."));
    double t_all = now_s();
    json_object_set_new(j, "load_1min_start", json_real(load_1min()));
    json_t *rt = json_object(), *tp = json_object(), *cp = json_object(), *dc = json_object(), *st = json_object(),
           *fr = json_object();
    uint64_t bytes_after[MAX_SPECS] = {0}, bytes_before = 0;
    int64_t held[MAX_SPECS] = {0};
    if (part[0]) {
        fprintf(stderr, "serve: round trips ...\n");
        rc = bench_roundtrip(&x, rt);
        json_object_set_new(j, "roundtrip", rt);
    } else {
        json_decref(rt);
    }
    if (!rc && part[1])
        rc = bench_throughput(&x, tp);
    if (part[1])
        json_object_set_new(j, "throughput", tp);
    else
        json_decref(tp);
    if (!rc && part[2]) {
        if (x.d.pid == 0 && x.pool_bytes != x.capacity_pool)
            fprintf(stderr, "serve: note: the daemon's pool is %.2f GiB, not %.2f GiB\n", (double)x.pool_bytes / GIB,
                    (double)x.capacity_pool / GIB);
        rc = bench_capacity(&x, cp, bytes_after, held, &bytes_before);
    }
    if (part[2])
        json_object_set_new(j, "capacity", cp);
    else
        json_decref(cp);
    if (!rc && part[3] && !part[2]) {
        /* without the capacity run: one prefill per spec says what a session keeps */
        for (int s = 0; s < x.n_specs && !rc; s++) {
            struct snapkv_session_id id;
            double secs;
            if (!(rc = prefill_long(&x, s, &id, &bytes_before, &bytes_after[s], &secs)))
                rc = evict_all(&x);
        }
    }
    if (!rc && part[3])
        rc = bench_decodes(&x, dc, bytes_after, held, bytes_before);
    if (part[3])
        json_object_set_new(j, "decode", dc);
    else
        json_decref(dc);
    if (!rc && part[4])
        rc = bench_stall(&x, st);
    if (part[4])
        json_object_set_new(j, "stall", st);
    else
        json_decref(st);
    if (!rc && part[5])
        rc = bench_fair(&x, fr);
    if (part[5])
        json_object_set_new(j, "fair", fr);
    else
        json_decref(fr);
    if (!rc && part[6]) {
        json_t *ck = json_object();
        rc = bench_checkpoint(&x, ck);
        json_object_set_new(j, "checkpoint", ck);
    }
    if (!rc && part[7]) {
        json_t *ev = json_object();
        rc = bench_events(&x, ev);
        json_object_set_new(j, "events", ev);
    }
    if (!rc && part[8]) {
        json_t *sp = json_object();
        rc = bench_spread(&x, sp);
        json_object_set_new(j, "spread", sp);
    }
    if (!rc && part[9]) {
        json_t *so = json_object();
        rc = bench_store(&x, so);
        json_object_set_new(j, "store", so);
    }
    if (!rc && part[10]) {
        json_t *px = json_object();
        rc = bench_prefix(&x, px);
        json_object_set_new(j, "prefix", px);
    }
    json_object_set_new(j, "seconds", json_real(now_s() - t_all));
    json_object_set_new(j, "load_1min_end", json_real(load_1min()));
    add_goals(j, x.default_specs);

    char saved_err[512];
    snprintf(saved_err, sizeof saved_err, "%s", rc ? skv_error_msg() : "");
    disconnect(&x);
    if (x.d.pid) {
        int code = daemon_stop(&x.d, rc != 0);
        if (code != 0)
            fprintf(stderr, "serve: warning: snapkvd exited with status %d on SIGTERM\n", code);
        json_object_set_new(j, "daemon_exit_status", json_integer(code));
    }
    if (rc) {
        json_object_set_new(j, "error", json_string(saved_err));
        print_table(stderr, j);
        json_decref(j);
        return skv_errorf(rc, "%s", saved_err);
    }
    print_table(o->json_stdout ? stderr : stdout, j);
    if (o->json_stdout) {
        char *s = json_dumps(j, JSON_INDENT(1) | JSON_REAL_PRECISION(6));
        if (s) {
            puts(s);
            free(s);
        }
    }
    json_decref(j);
    return SKV_OK;
}
