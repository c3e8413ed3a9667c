/* HTTP GET /metrics (see metrics_http.h): listening socket, its thread, and a deliberately
 * small HTTP/1.x subset (request line and headers read, body never; Connection: close). */
#include "daemon/metrics_http.h"
#include "common/log.h"
#include "common/status.h"
#include "common/thread.h"
#include "daemon/stats.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BODY_CAP SKV_PROMETHEUS_MAX
#define LINGER_MS 500                   /* drain what the client still sends, at most this long */
#define LINGER_MAX_BYTES (64 * 1024)

struct skv_metrics_http {
    int listen_fd;
    int wake[2];                  /* a byte on wake[1] stops the thread */
    pthread_t thread;
    bool started;
    skv_metrics_render_fn render;
    void *user;
    char addr[128];
    char *body;                   /* [BODY_CAP] */
};

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Waits until fd is ready for `events`, the deadline passes (0) or a stop is asked (-1). */
static int wait_fd(const struct skv_metrics_http *h, int fd, short events, int64_t deadline)
{
    for (;;) {
        int64_t left = deadline - mono_ms();
        if (left <= 0)
            return 0;
        struct pollfd p[2] = {{.fd = fd, .events = events}, {.fd = h->wake[0], .events = POLLIN}};
        int n = poll(p, 2, (int)left);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 || (p[1].revents & POLLIN))
            return -1;
        if (n > 0)
            return 1;
    }
}

/* Sends all of buf before the deadline; false when it could not. */
static bool send_all(const struct skv_metrics_http *h, int fd, const char *buf, size_t len, int64_t deadline)
{
    while (len) {
        ssize_t k = send(fd, buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
            buf += k;
            len -= (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && wait_fd(h, fd, POLLOUT, deadline) > 0)
            continue;
        return false;
    }
    return true;
}

static void respond(const struct skv_metrics_http *h, int fd, int code, const char *reason, const char *type,
                    const char *body, size_t body_len, bool head_only, const char *extra_header)
{
    char hdr[512];
    int n = snprintf(hdr, sizeof hdr,
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%sConnection: close\r\n\r\n",
                     code, reason, type, body_len, extra_header ? extra_header : "");
    int64_t deadline = mono_ms() + SKV_METRICS_TIMEOUT_MS;
    if (send_all(h, fd, hdr, (size_t)n, deadline) && !head_only)
        send_all(h, fd, body, body_len, deadline);
}

static void respond_text(const struct skv_metrics_http *h, int fd, int code, const char *reason,
                         const char *extra_header)
{
    char body[128];
    int n = snprintf(body, sizeof body, "%d %s\n", code, reason);
    respond(h, fd, code, reason, "text/plain; charset=utf-8", body, (size_t)n, false, extra_header);
}

/* Reads the request head (up to the blank line) into buf. Returns its length, 0 when the peer
 * went away or a stop was asked, -408 on timeout, -431 when it does not fit. */
static long read_head(const struct skv_metrics_http *h, int fd, char *buf, size_t cap)
{
    size_t len = 0;
    int64_t deadline = mono_ms() + SKV_METRICS_TIMEOUT_MS;
    for (;;) {
        buf[len] = '\0';
        if (strstr(buf, "\r\n\r\n") || strstr(buf, "\n\n"))
            return (long)len;
        if (len == cap - 1)
            return -431;
        int w = wait_fd(h, fd, POLLIN, deadline);
        if (w <= 0)
            return w == 0 ? -408 : 0;
        ssize_t k = recv(fd, buf + len, cap - 1 - len, MSG_DONTWAIT);
        if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
            continue;
        if (k <= 0)
            return 0;
        len += (size_t)k;
    }
}

static void serve_connection(struct skv_metrics_http *h, int fd)
{
    char req[SKV_METRICS_MAX_REQUEST];
    long n = read_head(h, fd, req, sizeof req);
    if (n == -408) {
        respond_text(h, fd, 408, "Request Timeout", NULL);
        return;
    }
    if (n == -431) {
        respond_text(h, fd, 431, "Request Header Fields Too Large", NULL);
        return;
    }
    if (n <= 0)
        return;
    /* request line: METHOD SP TARGET SP HTTP/1.x */
    char method[16], target[1024], version[16];
    if (sscanf(req, "%15s %1023s %15s", method, target, version) != 3 || strncmp(version, "HTTP/1.", 7) != 0) {
        respond_text(h, fd, 400, "Bad Request", NULL);
        return;
    }
    bool head = strcmp(method, "HEAD") == 0;
    if (strcmp(method, "GET") != 0 && !head) {
        respond_text(h, fd, 405, "Method Not Allowed", "Allow: GET, HEAD\r\n");
        return;
    }
    char *query = strchr(target, '?');
    if (query)
        *query = '\0';
    if (strcmp(target, "/metrics") != 0) {
        respond_text(h, fd, 404, "Not Found", NULL);
        return;
    }
    size_t len = h->render(h->user, h->body, BODY_CAP);
    if (len == 0) { /* the exposition could not be made (no memory): not an empty 200 */
        respond_text(h, fd, 503, "Service Unavailable", NULL);
        return;
    }
    respond(h, fd, 200, "OK", "text/plain; version=0.0.4; charset=utf-8", h->body, len, head, NULL);
}

/* Closes after the answer: unread request bytes would make close() send a reset that can
 * destroy the answer in the client's buffers, so drain them briefly (bounded) first. */
static void linger_close(const struct skv_metrics_http *h, int fd)
{
    char scratch[4096];
    size_t drained = 0;
    int64_t deadline = mono_ms() + LINGER_MS;
    shutdown(fd, SHUT_WR);
    while (drained < LINGER_MAX_BYTES && wait_fd(h, fd, POLLIN, deadline) > 0) {
        ssize_t k = recv(fd, scratch, sizeof scratch, MSG_DONTWAIT);
        if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
            continue;
        if (k <= 0)
            break;
        drained += (size_t)k;
    }
    close(fd);
}

static void *http_main(void *arg)
{
    struct skv_metrics_http *h = arg;
    for (;;) {
        struct pollfd p[2] = {{.fd = h->listen_fd, .events = POLLIN}, {.fd = h->wake[0], .events = POLLIN}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            skv_log(SKV_LOG_ERROR, "metrics %s: poll: %s", h->addr, strerror(errno));
            break;
        }
        if (p[1].revents & POLLIN)
            break;
        if (!(p[0].revents & POLLIN))
            continue;
        int fd = accept4(h->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                skv_log(SKV_LOG_WARN, "metrics %s: accept: %s", h->addr, strerror(errno));
                usleep(100 * 1000); /* do not spin while out of descriptors */
            }
            continue;
        }
        serve_connection(h, fd);
        linger_close(h, fd);
    }
    return NULL;
}

/* Splits "host:port" / "[v6]:port" into host and port. */
static int split_listen(const char *address, char *host, size_t host_cap, char *port, size_t port_cap)
{
    const char *colon = strrchr(address, ':');
    const char *h = address, *h_end = colon;
    if (*address == '[') {
        const char *close_br = strchr(address, ']');
        if (!close_br || close_br[1] != ':')
            return skv_errorf(SKV_E_INVAL, "metrics-listen '%s': expected [IPv6]:PORT", address);
        h = address + 1;
        h_end = close_br;
        colon = close_br + 1;
    }
    if (!colon || h_end == h || (size_t)(h_end - h) >= host_cap || !colon[1] || strlen(colon + 1) >= port_cap ||
        strspn(colon + 1, "0123456789") != strlen(colon + 1))
        return skv_errorf(SKV_E_INVAL, "metrics-listen '%s': expected HOST:PORT (e.g. 127.0.0.1:9464)", address);
    long p = strtol(colon + 1, NULL, 10);
    if (p < 1 || p > 65535)
        return skv_errorf(SKV_E_INVAL, "metrics-listen '%s': port must be 1..65535", address);
    memcpy(host, h, (size_t)(h_end - h));
    host[h_end - h] = '\0';
    snprintf(port, port_cap, "%ld", p);
    return SKV_OK;
}

static int bind_listen(const char *address, int *fd_out)
{
    char host[256], port[8];
    int rc = split_listen(address, host, sizeof host, port, sizeof port);
    if (rc)
        return rc;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    int gai = getaddrinfo(host, port, &hints, &res);
    if (gai)
        return skv_errorf(SKV_E_INVAL, "metrics-listen '%s': %s", address, gai_strerror(gai));
    int err = 0, fd = -1;
    for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
        if (fd < 0) {
            err = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, 16) < 0) {
            err = errno;
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd < 0)
        return skv_errorf(err == EADDRINUSE ? SKV_E_EXISTS : SKV_E_IO, "metrics-listen %s: %s", address, strerror(err));
    *fd_out = fd;
    return SKV_OK;
}

int skv_metrics_http_start(const char *address, skv_metrics_render_fn render, void *user,
                           struct skv_metrics_http **out)
{
    struct skv_metrics_http *h = calloc(1, sizeof *h);
    if (!h)
        return SKV_E_NOMEM;
    h->listen_fd = h->wake[0] = h->wake[1] = -1;
    h->render = render;
    h->user = user;
    snprintf(h->addr, sizeof h->addr, "%s", address);
    int rc = (h->body = malloc(BODY_CAP)) ? SKV_OK : SKV_E_NOMEM;
    if (!rc)
        rc = bind_listen(address, &h->listen_fd);
    if (!rc && pipe2(h->wake, O_CLOEXEC | O_NONBLOCK) < 0)
        rc = skv_errorf(SKV_E_IO, "metrics: pipe: %s", strerror(errno));
    if (!rc && skv_thread_create(&h->thread, http_main, h) != 0)
        rc = skv_errorf(SKV_E_INTERNAL, "metrics: cannot start the HTTP thread");
    h->started = rc == SKV_OK;
    if (rc) {
        skv_metrics_http_stop(&h);
        return rc;
    }
    skv_log(SKV_LOG_INFO, "metrics on http://%s/metrics", address);
    *out = h;
    return SKV_OK;
}

void skv_metrics_http_stop(struct skv_metrics_http **http_p)
{
    if (!http_p || !*http_p)
        return;
    struct skv_metrics_http *h = *http_p;
    if (h->started) {
        ssize_t k;
        do
            k = write(h->wake[1], "x", 1);
        while (k < 0 && errno == EINTR);
        pthread_join(h->thread, NULL);
    }
    for (int i = 0; i < 2; i++)
        if (h->wake[i] >= 0)
            close(h->wake[i]);
    if (h->listen_fd >= 0)
        close(h->listen_fd);
    free(h->body);
    free(h);
    *http_p = NULL;
}
