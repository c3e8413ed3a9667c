/* The optional plain-HTTP metrics endpoint (metrics-listen = HOST:PORT): one thread of its own
 * answering GET /metrics with the Prometheus text, /healthz and /readyz with a probe's answer
 * (200 or 503 and one line saying why), 404 for other paths, up to
 * SKV_METRICS_CONNECTIONS connections at once (one more closes the one silent the longest among
 * the client addresses that hold the most),
 * each with bounded request size and time. It never touches the ZeroMQ sockets, so a slow or
 * hostile HTTP client cannot stall the daemon's request loop, and idle connections do not make
 * a scrape wait behind them. */
#ifndef SKV_METRICS_HTTP_H
#define SKV_METRICS_HTTP_H

#include <stdbool.h>
#include <stddef.h>

#define SKV_METRICS_MAX_REQUEST 8192    /* request line and headers */
#define SKV_METRICS_CONNECTIONS 32      /* served at once */
#define SKV_METRICS_TIMEOUT_MS 2000     /* to receive the request, and again to send the answer;
                                           closing drains the client for at most 0.5 s more */

struct skv_metrics_http;

/* Writes the metrics text into buf (NUL-terminated, at most cap - 1 bytes); returns its length.
 * Called on the HTTP thread. */
typedef size_t (*skv_metrics_render_fn)(void *user, char *buf, size_t cap);

/* Writes a probe's one-line answer into buf (NUL-terminated) and returns its HTTP status, 200
 * or 503: liveness for ready false (/healthz), readiness for ready true (/readyz). Called on the
 * HTTP thread. */
typedef int (*skv_metrics_health_fn)(void *user, bool ready, char *buf, size_t cap);

/* Binds `address` ("127.0.0.1:9464", "[::1]:9464", "localhost:9464"), so that a port in use
 * fails a start before the engine starts (and restores sessions). SKV_E_INVAL for a malformed
 * address, SKV_E_EXISTS when the port is in use, SKV_E_IO when it cannot be bound otherwise. */
int skv_metrics_http_bind(const char *address, struct skv_metrics_http **out);
/* Starts the thread that answers on the bound socket. */
int skv_metrics_http_start(struct skv_metrics_http *h, skv_metrics_render_fn render, skv_metrics_health_fn health,
                           void *user);
/* Stops the thread (an answer in progress is abandoned) and closes the socket. Accepts NULL. */
void skv_metrics_http_stop(struct skv_metrics_http **http_p);

#endif
