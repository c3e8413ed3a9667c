/* Fixture lookup for the tests (see fixture.h). */
#include "tests/common/fixture.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <grp.h>
#include <pwd.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

char *fixture_path(const char *rel)
{
    const char *src = getenv("SKV_SRCDIR");
    if (!src || !*src)
        src = ".";
    size_t n = strlen(src) + strlen(rel) + 2;
    char *p = malloc(n);
    if (p)
        snprintf(p, n, "%s/%s", src, rel);
    return p;
}

static char *model_path(const char *env_name, const char *rel)
{
    const char *env = getenv(env_name);
    char *p = env && *env ? strdup(env) : fixture_path(rel);
    struct stat sb;
    if (p && stat(p, &sb) != 0) {
        free(p);
        return NULL;
    }
    return p;
}

char *fixture_model_path(void)
{
    return model_path("SKV_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf");
}

char *fixture_qwen_model_path(void)
{
    return model_path("SKV_MODEL_QWEN", "models/Qwen2.5-Coder-0.5B-Instruct-AWQ.Q4_K_M.gguf");
}

void *fixture_read_file(const char *path, size_t *size)
{
    FILE *f = path ? fopen(path, "rb") : NULL;
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *buf = malloc(len > 0 ? (size_t)len : 1);
    if (buf && fread(buf, 1, (size_t)len, f) != (size_t)len) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf && size)
        *size = (size_t)len;
    return buf;
}

void *fixture_read(const char *rel, size_t *size)
{
    char *path = fixture_path(rel);
    void *buf = fixture_read_file(path, size);
    free(path);
    return buf;
}

json_t *fixture_json(const char *rel)
{
    char *path = fixture_path(rel);
    json_error_t err;
    json_t *j = path ? json_load_file(path, 0, &err) : NULL;
    free(path);
    return j;
}

static int copy_file(const char *from, const char *to)
{
    FILE *in = fopen(from, "rb"), *out = in ? fopen(to, "wb") : NULL;
    char buf[65536];
    size_t n;
    int rc = in && out ? 0 : -1;
    while (rc == 0 && (n = fread(buf, 1, sizeof buf, in)) > 0)
        if (fwrite(buf, 1, n, out) != n)
            rc = -1;
    if (in)
        fclose(in);
    if (out)
        fclose(out);
    return rc;
}

char *fixture_stage_dir(const char *rel)
{
    char *src = fixture_path(rel);
    char tmpl[] = "/tmp/skv-fixture-XXXXXX";
    char *dst = mkdtemp(tmpl) ? strdup(tmpl) : NULL;
    DIR *d = src && dst ? opendir(src) : NULL;
    if (!d) {
        free(src);
        if (dst)
            rmdir(dst);
        free(dst);
        return NULL;
    }
    struct dirent *de;
    int rc = 0;
    while (rc == 0 && (de = readdir(d))) {
        if (de->d_name[0] == '.')
            continue;
        char from[4096], to[4096];
        snprintf(from, sizeof from, "%s/%s", src, de->d_name);
        snprintf(to, sizeof to, "%s/%s", dst, de->d_name);
        size_t len = strlen(to);
        if (len > 8 && strcmp(to + len - 8, ".fixture") == 0)
            to[len - 8] = '\0';
        rc = copy_file(from, to);
    }
    closedir(d);
    free(src);
    if (rc) {
        fixture_remove_dir(dst);
        return NULL;
    }
    return dst;
}

void fixture_remove_dir(char *path)
{
    if (!path)
        return;
    DIR *d = opendir(path);
    if (d) {
        struct dirent *de;
        while ((de = readdir(d))) {
            if (de->d_name[0] == '.')
                continue;
            char p[4096];
            snprintf(p, sizeof p, "%s/%s", path, de->d_name);
            unlink(p);
        }
        closedir(d);
    }
    rmdir(path);
    free(path);
}

/* The kernel's ephemeral ports start at the range's first number (32768 by default). */
static int ephemeral_low(void)
{
    int lo = 32768, hi = 0;
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
    if (f) {
        if (fscanf(f, "%d %d", &lo, &hi) != 2)
            lo = 32768;
        fclose(f);
    }
    return lo;
}

static bool port_free(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return false;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    bool ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
    close(fd);
    return ok;
}

int fixture_free_port(void)
{
    int hi = ephemeral_low();
    int lo = hi > 20000 ? 10000 : 1024;
    if (hi - lo < 1000)
        return -1;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    /* tests started together draw from different places */
    unsigned seed = (unsigned)getpid() * 2654435761u ^ (unsigned)ts.tv_nsec;
    for (int i = 0; i < 500; i++) {
        int port = lo + (int)(rand_r(&seed) % (unsigned)(hi - lo));
        if (port_free(port))
            return port;
    }
    return -1;
}

void fixture_redis_cli(const char *sock, const char *args, char *out, size_t cap)
{
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "redis-cli -s %s %s 2>/dev/null", sock, args);
    out[0] = '\0';
    FILE *p = popen(cmd, "r");
    if (!p)
        return;
    if (!fgets(out, (int)cap, p))
        out[0] = '\0';
    out[strcspn(out, "\n")] = '\0';
    pclose(p);
}

int fixture_other_user_fork(const char *dir, const char *endpoint, int *go)
{
    struct passwd *nobody = getpwnam("nobody");
    int fds[2];
    if (geteuid() != 0 || !nobody || nobody->pw_uid == 0 || strncmp(endpoint, "ipc://", 6) != 0 ||
        chmod(dir, 0711) != 0 || chmod(endpoint + 6, 0666) != 0 || pipe(fds) != 0)
        return -1;
    uid_t uid = nobody->pw_uid;
    gid_t gid = nobody->pw_gid;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        char byte;
        close(fds[1]);
        if (read(fds[0], &byte, 1) != 1)
            _exit(9);
        close(fds[0]);
        if (setgroups(0, NULL) != 0 || setgid(gid) != 0 || setuid(uid) != 0)
            _exit(10);
        return 0;
    }
    close(fds[0]);
    if (pid < 0) {
        close(fds[1]);
        return -1;
    }
    *go = fds[1];
    return (int)pid;
}

int fixture_other_user_go(int pid, int go)
{
    int st = 0;
    ssize_t w = write(go, "g", 1);
    close(go);
    if (w != 1 || waitpid(pid, &st, 0) != pid)
        return 200;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 100 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
}
