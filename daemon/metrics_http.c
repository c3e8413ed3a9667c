/* HTTP GET /metrics, /healthz and /readyz (see metrics_http.h): listening socket, its thread, and a deliberately
 * small HTTP/1.x subset (request line and headers read, body never; Connection: close). */
#include "daemon/metrics_http.h"
#include "common/log.h"
#include "common/status.h"
#include "common/thread.h"
#include "daemon/stats.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
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

/* A connection: its request head arriving, or, answered, what it still sends drained until it
 * closes (closing with unread bytes would send a reset that can destroy the answer in the
 * client's buffers). Slots are served together, so a silent client delays no other. */
enum slot_state { SLOT_FREE, SLOT_READING, SLOT_DRAINING };

struct slot {
    enum slot_state st;
    int fd;
    int64_t deadline;             /* READING: the head's; DRAINING: the drain's */
    size_t len;                   /* READING: head bytes so far; DRAINING: bytes drained */
    uint8_t peer[17];             /* the client's address (family, then its bytes): whose it is */
    char buf[SKV_METRICS_MAX_REQUEST];
};

struct skv_metrics_http {
    int listen_fd;
    int wake[2];                  /* a byte on wake[1] stops the thread */
    pthread_t thread;
    bool started;
    skv_metrics_render_fn render;
    skv_metrics_health_fn health;
    void *user;
    char addr[128];
    char *body;                   /* [BODY_CAP] */
    struct slot *slots;           /* [SKV_METRICS_CONNECTIONS] */
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
    /* the whole answer into the kernel's buffer at once where its limit allows: a client that
     * reads slowly then holds no other connection up while this thread waits to send */
    int want = (int)(body_len + (size_t)n + 4096);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &want, sizeof want);
    int64_t deadline = mono_ms() + SKV_METRICS_TIMEOUT_MS;
    if (send_all(h, fd, hdr, (size_t)n, deadline) && !head_only)
        send_all(h, fd, body, body_len, deadline);
}

/* An answer of its status line's text; head_only (a HEAD request): its headers alone, as HTTP
 * asks of every answer to HEAD (before, a HEAD of an unknown path had the body too). */
static void respond_text(const struct skv_metrics_http *h, int fd, int code, const char *reason, bool head_only,
                         const char *extra_header)
{
    char body[128];
    int n = snprintf(body, sizeof body, "%d %s\n", code, reason);
    respond(h, fd, code, reason, "text/plain; charset=utf-8", body, (size_t)n, head_only, extra_header);
}

/* Answers the request whose head is req (NUL-terminated). */
static void serve_request(struct skv_metrics_http *h, int fd, char *req)
{
    /* request line: METHOD SP TARGET SP HTTP/1.x */
    char method[16], target[1024], version[16];
    if (sscanf(req, "%15s %1023s %15s", method, target, version) != 3 || strncmp(version, "HTTP/1.", 7) != 0) {
        respond_text(h, fd, 400, "Bad Request", false, NULL);
        return;
    }
    bool head = strcmp(method, "HEAD") == 0;
    if (strcmp(method, "GET") != 0 && !head) {
        respond_text(h, fd, 405, "Method Not Allowed", false, "Allow: GET, HEAD\r\n");
        return;
    }
    char *query = strchr(target, '?');
    if (query)
        *query = '\0';
    bool ready = strcmp(target, "/readyz") == 0;
    if (ready || strcmp(target, "/healthz") == 0) {
        char text[256];
        int code = h->health(h->user, ready, text, sizeof text);
        respond(h, fd, code, code == 200 ? "OK" : "Service Unavailable", "text/plain; charset=utf-8", text,
                strlen(text), head, "Cache-Control: no-store\r\n");
        return;
    }
    if (strcmp(target, "/metrics") != 0) {
        respond_text(h, fd, 404, "Not Found", head, NULL);
        return;
    }
    size_t len = h->render(h->user, h->body, BODY_CAP);
    if (len == 0) { /* the exposition could not be made (no memory): not an empty 200 */
        respond_text(h, fd, 503, "Service Unavailable", head, NULL);
        return;
    }
    respond(h, fd, 200, "OK", "text/plain; version=0.0.4; charset=utf-8", h->body, len, head, NULL);
}

static void slot_close(struct slot *sl)
{
    close(sl->fd);
    sl->st = SLOT_FREE;
}

/* Answered: the write side closes, and what the client still sends is read for a while. */
static void slot_drain(struct slot *sl)
{
    shutdown(sl->fd, SHUT_WR);
    sl->st = SLOT_DRAINING;
    sl->deadline = mono_ms() + LINGER_MS;
    sl->len = 0;
}

/* The slot's fd is readable (or hung up). */
static void slot_input(struct skv_metrics_http *h, struct slot *sl)
{
    if (sl->st == SLOT_DRAINING) {
        ssize_t k = recv(sl->fd, sl->buf, sizeof sl->buf, MSG_DONTWAIT);
        if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        if (k <= 0 || (sl->len += (size_t)k) >= LINGER_MAX_BYTES)
            slot_close(sl);
        return;
    }
    ssize_t k = recv(sl->fd, sl->buf + sl->len, sizeof sl->buf - 1 - sl->len, MSG_DONTWAIT);
    if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
        return;
    if (k <= 0) { /* gone before a whole head */
        slot_close(sl);
        return;
    }
    /* the head's end looked for in what came now and the 3 bytes before (the whole head again
     * at each recv was quadratic: 33 M comparisons for 8 KiB sent a byte at a time) */
    const char *from = sl->buf + (sl->len > 3 ? sl->len - 3 : 0);
    sl->len += (size_t)k;
    sl->buf[sl->len] = '\0';
    if (strstr(from, "\r\n\r\n") || strstr(from, "\n\n")) {
        serve_request(h, sl->fd, sl->buf);
        slot_drain(sl);
    } else if (sl->len == sizeof sl->buf - 1) {
        respond_text(h, sl->fd, 431, "Request Header Fields Too Large", false, NULL);
        slot_drain(sl);
    }
}

/* Past its deadline: a head not complete gets 408, a drain ends. */
static void slot_expire(struct skv_metrics_http *h, struct slot *sl, int64_t now)
{
    if (sl->st == SLOT_FREE || now < sl->deadline)
        return;
    if (sl->st == SLOT_READING) {
        respond_text(h, sl->fd, 408, "Request Timeout", false, NULL);
        slot_drain(sl);
    } else {
        slot_close(sl);
    }
}

/* The address of the client connected on fd, as a key: its family, then its bytes (an IPv4
 * client of an IPv6 socket, ::ffff:a.b.c.d, is keyed as the IPv4 one). */
static void peer_key(int fd, uint8_t key[17])
{
    struct sockaddr_storage a;
    socklen_t len = sizeof a;
    memset(key, 0, 17);
    if (getpeername(fd, (struct sockaddr *)&a, &len) != 0)
        return;
    if (a.ss_family == AF_INET6) {
        const uint8_t *b = ((const struct sockaddr_in6 *)&a)->sin6_addr.s6_addr;
        static const uint8_t v4mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        if (memcmp(b, v4mapped, 12) == 0) {
            key[0] = AF_INET;
            memcpy(key + 1, b + 12, 4);
        } else {
            key[0] = AF_INET6;
            memcpy(key + 1, b, 16);
        }
    } else if (a.ss_family == AF_INET) {
        key[0] = AF_INET;
        memcpy(key + 1, &((const struct sockaddr_in *)&a)->sin_addr, 4);
    }
}

/* A new connection's slot: a free one, or, all taken, one of the client addresses that hold the
 * most (a flood from one address pushes out its own connections, not a scraper's from
 * another): of theirs, the one reading longest (silent the most) or failing that draining
 * longest, closed without an answer. */
static struct slot *slot_take(struct skv_metrics_http *h)
{
    int count[SKV_METRICS_CONNECTIONS], most = 0;
    for (int i = 0; i < SKV_METRICS_CONNECTIONS; i++) {
        const struct slot *sl = &h->slots[i];
        if (sl->st == SLOT_FREE)
            return &h->slots[i];
        count[i] = 0;
        for (int j = 0; j < SKV_METRICS_CONNECTIONS; j++)
            count[i] += memcmp(h->slots[j].peer, sl->peer, sizeof sl->peer) == 0;
        most = count[i] > most ? count[i] : most;
    }
    struct slot *oldest = NULL;
    for (int i = 0; i < SKV_METRICS_CONNECTIONS; i++) {
        struct slot *sl = &h->slots[i];
        if (count[i] != most)
            continue;
        if (!oldest || (sl->st == SLOT_READING && oldest->st != SLOT_READING) ||
            (sl->st == oldest->st && sl->deadline < oldest->deadline))
            oldest = sl;
    }
    slot_close(oldest);
    return oldest;
}

static void *http_main(void *arg)
{
    struct skv_metrics_http *h = arg;
    struct pollfd p[2 + SKV_METRICS_CONNECTIONS];
    int of[2 + SKV_METRICS_CONNECTIONS]; /* p[i]'s slot */
    for (;;) {
        int n = 0;
        int64_t now = mono_ms(), next = -1;
        p[n++] = (struct pollfd){.fd = h->listen_fd, .events = POLLIN};
        p[n++] = (struct pollfd){.fd = h->wake[0], .events = POLLIN};
        for (int i = 0; i < SKV_METRICS_CONNECTIONS; i++) {
            const struct slot *sl = &h->slots[i];
            if (sl->st == SLOT_FREE)
                continue;
            of[n] = i;
            p[n++] = (struct pollfd){.fd = sl->fd, .events = POLLIN};
            next = next < 0 || sl->deadline < next ? sl->deadline : next;
        }
        int wait = next < 0 ? -1 : next > now ? (int)(next - now) : 0;
        if (poll(p, (nfds_t)n, wait) < 0) {
            if (errno == EINTR)
                continue;
            skv_log(SKV_LOG_ERROR, "metrics %s: poll: %s", h->addr, strerror(errno));
            break;
        }
        if (p[1].revents & POLLIN)
            break;
        for (int k = 2; k < n; k++)
            if (p[k].revents)
                slot_input(h, &h->slots[of[k]]);
        now = mono_ms();
        for (int i = 0; i < SKV_METRICS_CONNECTIONS; i++)
            slot_expire(h, &h->slots[i], now);
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
        struct slot *sl = slot_take(h);
        sl->st = SLOT_READING;
        sl->fd = fd;
        sl->deadline = mono_ms() + SKV_METRICS_TIMEOUT_MS;
        sl->len = 0;
        peer_key(fd, sl->peer);
    }
    for (int i = 0; i < SKV_METRICS_CONNECTIONS; i++)
        if (h->slots[i].st != SLOT_FREE)
            slot_close(&h->slots[i]);
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

int skv_metrics_http_bind(const char *address, struct skv_metrics_http **out)
{
    struct skv_metrics_http *h = calloc(1, sizeof *h);
    if (!h)
        return SKV_E_NOMEM;
    h->listen_fd = h->wake[0] = h->wake[1] = -1;
    snprintf(h->addr, sizeof h->addr, "%s", address);
    int rc = (h->body = malloc(BODY_CAP)) && (h->slots = calloc(SKV_METRICS_CONNECTIONS, sizeof *h->slots))
                 ? SKV_OK
                 : SKV_E_NOMEM;
    if (!rc)
        rc = bind_listen(address, &h->listen_fd);
    if (!rc && pipe2(h->wake, O_CLOEXEC | O_NONBLOCK) < 0)
        rc = skv_errorf(SKV_E_IO, "metrics: pipe: %s", strerror(errno));
    if (rc) {
        skv_metrics_http_stop(&h);
        return rc;
    }
    *out = h;
    return SKV_OK;
}

int skv_metrics_http_start(struct skv_metrics_http *h, skv_metrics_render_fn render, skv_metrics_health_fn health,
                           void *user)
{
    h->render = render;
    h->health = health;
    h->user = user;
    if (skv_thread_create(&h->thread, http_main, h, "skv-metrics") != 0)
        return skv_errorf(SKV_E_INTERNAL, "metrics: cannot start the HTTP thread");
    h->started = true;
    skv_log(SKV_LOG_INFO, "metrics on http://%s/metrics (probes /healthz, /readyz)", h->addr);
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
    free(h->slots);
    free(h);
    *http_p = NULL;
}
