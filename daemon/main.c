/* snapkvd's entry point: options (table in config.c), logging, signals, backend and model
 * start-up, sd_notify, then the server loop until SIGTERM. */
#include "build-config.h"

#include "common/cpu.h"
#include "common/log.h"
#include "common/status.h"
#include "daemon/auth.h"
#include "daemon/config.h"
#include "daemon/engine/kv_pool.h"
#include "daemon/engine/model.h"
#include "daemon/server.h"
#include "daemon/store.h"
#include "kernels/backend.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <stdint.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#else
/* Built without libsystemd: the two calls snapkvd makes, speaking the notify protocol itself
 * (the installed unit is Type=notify with a watchdog, so doing nothing would leave start-up
 * hanging and the watchdog firing). Same returns as libsystemd's: > 0 done, 0 not run by a
 * service manager that asked for it, negative errno on failure. */
#include <stddef.h>
#include <sys/socket.h>
#include <sys/un.h>

/* One datagram of "KEY=value" lines to $NOTIFY_SOCKET: a path, or an abstract name written
 * with a leading '@'. */
static int sd_notify(int unset_environment, const char *state)
{
    const char *path = getenv("NOTIFY_SOCKET");
    int rc = 0;
    if (path && *path) {
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        size_t len = strlen(path);
        int fd = -1;
        if ((path[0] != '/' && path[0] != '@') || len < 2 || len > sizeof sa.sun_path)
            rc = -EINVAL;
        else if ((fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0)) < 0)
            rc = -errno;
        else {
            memcpy(sa.sun_path, path, len);
            if (path[0] == '@')
                sa.sun_path[0] = '\0';
            socklen_t sa_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len);
            rc = sendto(fd, state, strlen(state), MSG_NOSIGNAL, (struct sockaddr *)&sa, sa_len) < 0 ? -errno : 1;
            close(fd);
        }
    }
    if (unset_environment)
        unsetenv("NOTIFY_SOCKET");
    return rc;
}

/* WatchdogSec= from $WATCHDOG_USEC, when $WATCHDOG_PID (if set) is this process. */
static int sd_watchdog_enabled(int unset_environment, uint64_t *usec)
{
    const char *s = getenv("WATCHDOG_USEC"), *pid = getenv("WATCHDOG_PID");
    int rc = 0;
    if (s && *s) {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(s, &end, 10);
        if (*s < '0' || *s > '9' || *end || errno || v == 0)
            rc = -EINVAL;
        else if (!pid || !*pid || strtoll(pid, NULL, 10) == (long long)getpid()) {
            if (usec)
                *usec = v;
            rc = 1;
        }
    }
    if (unset_environment) {
        unsetenv("WATCHDOG_USEC");
        unsetenv("WATCHDOG_PID");
    }
    return rc;
}
#endif

#include <time.h>

static uint64_t watchdog_usec; /* WatchdogSec from systemd, 0 when off */

/* Pings the systemd watchdog at half its interval, but only while the engine thread shows
 * progress: the socket loop keeps turning when the engine hangs in a device call or a lock,
 * and then systemd should restart the daemon. */
static void watchdog_tick(struct skv_server *srv)
{
    static struct timespec last;
    static bool withheld;
    struct timespec now;
    if (!watchdog_usec)
        return;
    clock_gettime(CLOCK_MONOTONIC, &now);
    uint64_t since = (uint64_t)(now.tv_sec - last.tv_sec) * 1000000u + (uint64_t)((now.tv_nsec - last.tv_nsec) / 1000);
    if (since < watchdog_usec / 2)
        return;
    if (!skv_server_engine_alive(srv, watchdog_usec / 1000)) {
        if (!withheld)
            skv_log(SKV_LOG_WARN, "the engine thread has made no progress for %.1f s: watchdog pings withheld "
                                  "(systemd restarts snapkvd unless it moves again)",
                    (double)watchdog_usec / 2e6);
        withheld = true;
        return;
    }
    if (withheld)
        skv_log(SKV_LOG_INFO, "the engine thread moves again: watchdog pings resumed");
    withheld = false;
    sd_notify(0, "WATCHDOG=1");
    last = now;
}

static volatile sig_atomic_t stop_flag;
static volatile sig_atomic_t reopen_flag;

static void on_signal(int sig)
{
    if (sig == SIGHUP)
        reopen_flag = 1;
    else
        stop_flag = 1;
}

/* SIGTERM / SIGINT during start-up: honoured after the stage that was running (a model load
 * is not interrupted), with a clean exit. */
static bool stop_requested(const char *stage)
{
    if (!stop_flag)
        return false;
    sd_notify(0, "STOPPING=1");
    skv_log(SKV_LOG_INFO, "stopped during start-up, after %s", stage);
    return true;
}

static void usage(FILE *out)
{
    size_t n;
    const struct skv_config_option *o = skv_config_options(&n);
    fprintf(out, "usage: snapkvd [OPTION]...\n\nOptions (also keys of the config file, shown by "
                 "'snapkvctl config'):\n");
    for (size_t i = 0; i < n; i++)
        fprintf(out, "  --%-26s %s (default: %s)\n", o[i].name, o[i].help,
                *o[i].default_value ? o[i].default_value : "\"\"");
    fprintf(out, "  --%-26s %s\n  --%-26s %s\n", "help", "this text", "version", "print the version");
}

/* With persist = yes every session is written to <state-dir>/persist at a stop: a directory
 * that cannot be made or written refuses the start, rather than a stop that loses them all
 * while it exits 0. */
/* Checks that <state-dir>/persist can be written and takes its lock (*lock_fd, held until the
 * process ends): a second daemon on the same state-dir would restore the first one's sessions
 * under the same ids and delete its files at its start and checkpoints. */
static int persist_dir_check(const char *state_dir, int *lock_fd)
{
    char dir[1100], probe[1200];
    if ((size_t)snprintf(dir, sizeof dir, "%s/persist", state_dir) >= sizeof dir)
        return skv_errorf(SKV_E_INVAL, "state-dir: path too long");
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return skv_errorf(SKV_E_IO, "persist = yes, but %s cannot be made: %s (set state-dir to a writable "
                          "directory, or persist = no)", dir, strerror(errno));
    snprintf(probe, sizeof probe, "%s/.probe-XXXXXX", dir);
    int fd = mkstemp(probe);
    if (fd < 0)
        return skv_errorf(SKV_E_IO, "persist = yes, but %s is not writable: %s (set state-dir to a writable "
                          "directory, or persist = no)", dir, strerror(errno));
    close(fd);
    unlink(probe);
    snprintf(probe, sizeof probe, "%s/.lock", dir);
    if ((fd = open(probe, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600)) < 0)
        return skv_errorf(SKV_E_IO, "persist: %s: %s", probe, strerror(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int err = errno;
        char pid[32] = "";
        ssize_t n = pread(fd, pid, sizeof pid - 1, 0);
        pid[n > 0 ? n : 0] = '\0';
        pid[strcspn(pid, "\n")] = '\0';
        close(fd);
        if (err == EWOULDBLOCK)
            return skv_errorf(SKV_E_BUSY, "persist = yes, but another snapkvd (pid %s) keeps its sessions in %s: "
                              "give each daemon a state-dir of its own", *pid ? pid : "?", dir);
        return skv_errorf(SKV_E_IO, "persist: locking %s: %s", probe, strerror(err));
    }
    char pid[32];
    int n = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)n, 0) != n)
        skv_log(SKV_LOG_WARN, "persist: %s: cannot write the pid: %s", probe, strerror(errno)); /* the lock holds */
    *lock_fd = fd;
    return SKV_OK;
}

/* The bytes of a regular file, or of a folder's regular files (an HF model folder); 0 when
 * neither. */
static uint64_t path_bytes(const char *path)
{
    struct stat sb;
    if (stat(path, &sb) != 0)
        return 0;
    if (S_ISREG(sb.st_mode))
        return (uint64_t)sb.st_size;
    if (!S_ISDIR(sb.st_mode))
        return 0;
    uint64_t total = 0;
    DIR *d = opendir(path);
    struct dirent *de;
    while (d && (de = readdir(d))) {
        char p[4096];
        if (snprintf(p, sizeof p, "%s/%s", path, de->d_name) < (int)sizeof p && stat(p, &sb) == 0 &&
            S_ISREG(sb.st_mode))
            total += (uint64_t)sb.st_size;
    }
    if (d)
        closedir(d);
    return total;
}

/* EXTEND_TIMEOUT_USEC: seconds more for the start, from now (a service manager that gave no
 * start timeout ignores it) */
static void extend_start_timeout(uint64_t seconds)
{
    char msg[64];
    snprintf(msg, sizeof msg, "EXTEND_TIMEOUT_USEC=%llu", (unsigned long long)seconds * 1000000ull);
    sd_notify(0, msg);
}

int main(int argc, char **argv)
{
    const char *missing; /* (libskvcpu.a checked already, before main: this links it in) */
    if (!skv_cpu_ok(&missing)) {
        fprintf(stderr, "snapkvd: this CPU lacks %s, which this build's CPU kernels use\n", missing);
        return 1;
    }
    struct skv_config cfg;
    if (skv_config_init(&cfg)) {
        fprintf(stderr, "snapkvd: out of memory\n");
        return 1;
    }
    size_t n_opts;
    const struct skv_config_option *opts = skv_config_options(&n_opts);
    struct option *longopts = calloc(n_opts + 3, sizeof *longopts);
    if (!longopts)
        return 1;
    for (size_t i = 0; i < n_opts; i++)
        longopts[i] = (struct option){opts[i].name, opts[i].type == SKV_CFG_BOOL ? optional_argument
                                                                                 : required_argument,
                                      NULL, (int)(256 + i)};
    longopts[n_opts] = (struct option){"help", no_argument, NULL, 'h'};
    longopts[n_opts + 1] = (struct option){"version", no_argument, NULL, 'V'};

    /* Pass 1: find --config so the file is read before command-line options override it. */
    int c, rc, exit_code = 1, persist_lock = -1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "hV", longopts, NULL)) != -1)
        if (c >= 256 && strcmp(opts[c - 256].name, "config") == 0)
            skv_config_set(&cfg, "config", optarg);
    if (*cfg.config_file && (rc = skv_config_load_file(&cfg, cfg.config_file))) {
        fprintf(stderr, "snapkvd: %s\n", skv_error_msg());
        goto out;
    }
    optind = 1;
    opterr = 1;
    while ((c = getopt_long(argc, argv, "hV", longopts, NULL)) != -1) {
        if (c == 'h') {
            usage(stdout);
            exit_code = 0;
            goto out;
        }
        if (c == 'V') {
            printf("snapkvd %s\n", PACKAGE_VERSION);
            exit_code = 0;
            goto out;
        }
        if (c < 256) {
            usage(stderr);
            goto out;
        }
        const struct skv_config_option *o = &opts[c - 256];
        rc = skv_config_set(&cfg, o->name, optarg ? optarg : "yes");
        if (rc) {
            fprintf(stderr, "snapkvd: %s\n", skv_error_msg());
            goto out;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "snapkvd: unexpected argument '%s'\n", argv[optind]);
        goto out;
    }
    if (skv_config_check(&cfg)) {
        fprintf(stderr, "snapkvd: %s\n", skv_error_msg());
        goto out;
    }
    skv_log_set_level(skv_log_level_parse(cfg.log_level)); /* a name the config checked where it was set */
    if (*cfg.log_file && skv_log_open(cfg.log_file)) {
        fprintf(stderr, "snapkvd: cannot open log file %s\n", skv_error_msg());
        goto out;
    }

    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    /* every client connection is a file descriptor: take all the hard limit allows (systemd's
     * soft default is 1024), so that max-connections holds rather than the process limit */
    struct rlimit nofile;
    if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
        nofile.rlim_cur = nofile.rlim_max;
        setrlimit(RLIMIT_NOFILE, &nofile);
    }

    struct skv_backend *be = NULL;
    struct skv_model *model = NULL;
    struct skv_server *srv = NULL;
    struct skv_auth *auth = NULL;
    /* endpoint security and key files: refuse a bad setup before the model loads */
    if ((rc = skv_auth_new(&cfg, &auth))) {
        skv_log(SKV_LOG_ERROR, "%s", skv_error_msg());
        goto out;
    }
    if (cfg.persist && (rc = persist_dir_check(cfg.state_dir, &persist_lock))) {
        skv_log(SKV_LOG_ERROR, "%s", skv_error_msg());
        goto out_auth;
    }
    if (*cfg.store) { /* the store's url and files, checked again when the engine starts */
        struct skv_store *st = NULL;
        unsigned char key[SKV_STORE_KEY_BYTES], accept[SKV_STORE_KEY_BYTES];
        bool is_signed, has_accept;
        rc = skv_store_open(&cfg, &st, key, &is_signed, accept, &has_accept);
        explicit_bzero(key, sizeof key);
        explicit_bzero(accept, sizeof accept);
        skv_store_free(&st);
        if (rc) {
            skv_log(SKV_LOG_ERROR, "%s", skv_error_msg());
            goto out_auth;
        }
    }
    if (strcmp(cfg.backend, "auto") == 0 && skv_backend_cuda_compiled()) {
        rc = skv_backend_cuda_new(0, &be);
        if (rc)
            skv_log(SKV_LOG_INFO, "no CUDA device answered (%s); using the CPU", skv_error_msg());
        else if ((rc = skv_backend_selftest(be))) {
            skv_log(SKV_LOG_WARN, "%s; using the CPU", skv_error_msg());
            skv_backend_destroy(&be);
        }
    }
    if (!be) {
        rc = skv_backend_open(strcmp(cfg.backend, "auto") == 0 ? "cpu" : cfg.backend, (int)cfg.threads, &be);
        if (rc) {
            skv_log(SKV_LOG_ERROR, "backend %s: %s", cfg.backend, skv_error_msg());
            goto out_auth;
        }
    }
    skv_log(SKV_LOG_INFO, "backend %s, %d threads", be->name, be->n_threads);
    if (stop_requested("the backend start")) {
        exit_code = 0;
        goto out_backend;
    }

    /* the unit's TimeoutStartSec (300 s) is for a start that hangs, not for a large model on a
     * slow disk, nor a large pool to reserve: extended by what they may take (systemd counts
     * from this message) */
    extend_start_timeout(300 + path_bytes(cfg.model) / (20u << 20)); /* 20 MB/s */
    sd_notify(0, "STATUS=loading model");
    skv_log(SKV_LOG_INFO, "loading model %s", cfg.model);
    rc = skv_model_load(cfg.model, be, NULL, &model);
    if (rc && access(cfg.model, F_OK) < 0 && errno == ENOENT) {
        const char *slash = strrchr(cfg.model, '/');
        int dir_len = !slash ? 1 : slash == cfg.model ? 1 : (int)(slash - cfg.model);
        skv_log(SKV_LOG_ERROR, "model %s: no such file; scripts/fetch-model (in the source tree) fetches the default "
                               "model: sudo env SKV_MODELS_DIR=%.*s scripts/fetch-model (README.md: Install as a "
                               "system service)",
                cfg.model, dir_len, slash ? cfg.model : ".");
        goto out_backend;
    }
    if (rc) {
        skv_log(SKV_LOG_ERROR, "model %s: %s", cfg.model, skv_error_msg());
        goto out_backend;
    }
    if (model->tok_note[0])
        skv_log(SKV_LOG_WARN, "model %s: no tokenizer (%s): requests must carry token ids", cfg.model,
                model->tok_note);
    if (stop_requested("loading the model")) {
        exit_code = 0;
        goto out_model;
    }
    if ((rc = skv_model_set_kv_pool(model, (int)cfg.kv_block_tokens, skv_kv_type_parse(cfg.kv_type)))) {
        skv_log(SKV_LOG_ERROR, "%s", skv_error_msg());
        goto out_model;
    }
    skv_log(SKV_LOG_INFO, "KV pool: %s rows, %lld tokens a block of %zu bytes", cfg.kv_type,
            (long long)cfg.kv_block_tokens, skv_kv_pool_block_bytes(model->kv_pool));
    if (cfg.pool_prealloc && strcmp(be->name, "cpu") == 0) {
        /* host memory is taken page by page: refuse what would end in the OOM killer */
        uint64_t phys = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
        if ((uint64_t)cfg.pool_size > phys / 10 * 9) {
            rc = SKV_E_LIMIT;
            skv_log(SKV_LOG_ERROR, "pool-prealloc: pool-size %lld bytes is more than 90%% of this host's %llu bytes",
                    (long long)cfg.pool_size, (unsigned long long)phys);
            goto out_model;
        }
    }
    if (cfg.pool_prealloc) {
        extend_start_timeout(60 + (uint64_t)cfg.pool_size / (256u << 20)); /* 256 MB/s */
        sd_notify(0, "STATUS=reserving the KV pool");
        if ((rc = skv_kv_pool_reserve(model->kv_pool, (uint64_t)cfg.pool_size))) {
            skv_log(SKV_LOG_ERROR, "pool-prealloc: %s", skv_error_msg());
            goto out_model;
        }
        skv_log(SKV_LOG_INFO, "KV pool: %lld bytes reserved at start", (long long)cfg.pool_size);
        if (stop_requested("reserving the KV pool")) {
            exit_code = 0;
            goto out_model;
        }
    }
    skv_log(SKV_LOG_INFO, "model %s: %d layers, %d heads (%d kv), dim %d, vocab %d", skv_model_name(model),
            skv_model_config(model)->n_layers, skv_model_config(model)->n_heads,
            skv_model_config(model)->n_kv_heads, skv_model_config(model)->dim,
            skv_model_config(model)->n_vocab);

    if (sd_watchdog_enabled(0, &watchdog_usec) <= 0)
        watchdog_usec = 0;
    struct skv_server_env env = {.cfg = &cfg,
                                 .backend = be,
                                 .model = model,
                                 .stop = &stop_flag,
                                 .reopen = &reopen_flag,
                                 .tick = watchdog_tick};
    rc = skv_server_new(&env, &auth, &srv);
    if (rc) {
        skv_log(SKV_LOG_ERROR, "%s", skv_error_msg());
        goto out_model;
    }
    skv_log(SKV_LOG_INFO, "serving clients on %s, admin on %s", cfg.endpoint, cfg.admin_endpoint);
    sd_notify(0, "READY=1\nSTATUS=serving clients");
    rc = skv_server_run(srv);
    sd_notify(0, "STOPPING=1");
    skv_log(SKV_LOG_INFO, "stopped (%s)", skv_status_str(rc));
    exit_code = rc ? 1 : 0;
    skv_server_destroy(&srv);
out_model:
    skv_model_free(&model);
out_backend:
    skv_backend_destroy(&be);
out_auth:
    skv_auth_destroy(&auth);
out:
    if (persist_lock >= 0)
        close(persist_lock); /* after the save at stop */
    free(longopts);
    skv_config_free(&cfg);
    return exit_code;
}
