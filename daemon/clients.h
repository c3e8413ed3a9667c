/* The client endpoint's connections, so the worker hears when a client goes away: which routing
 * id arrived over which connection (its socket fd, as ZMQ_SRCFD gives it) and the socket
 * monitor's ACCEPTED / DISCONNECTED events for those fds. Socket thread only; knows no ZeroMQ.
 *
 * The caller feeds every connection event it has before each message it records, so an fd closed
 * and reused by a new connection is seen closed before the new one's first message. Messages
 * that were already on their way when a connection closed can still be read after its
 * DISCONNECTED: they are reported late (the client is gone; its request is still served). */
#ifndef SKV_CLIENTS_H
#define SKV_CLIENTS_H

#include <stddef.h>
#include <stdint.h>

#define SKV_CLIENTS_GONE_KEEP_MS 10000  /* how long a gone client and a closed fd are remembered */

struct skv_clients;

/* What a message from a client means (skv_clients_seen). */
enum skv_client_seen {
    SKV_CLIENT_LIVE = 0,      /* its connection is open */
    SKV_CLIENT_LATE,          /* read after the client had gone: notify the worker again */
    SKV_CLIENT_LATE_FIRST,    /* the same, from a client gone before any message of it was read */
};

/* Called once for each client found gone: its routing id. */
typedef void skv_client_gone_fn(void *user, const uint8_t *identity, size_t identity_len);

/* A table of at most cap clients (live and recently gone; past it the least recently active is
 * forgotten, and a live one forgotten so goes unnoticed). SKV_OK, SKV_E_INVAL, SKV_E_NOMEM. */
int skv_clients_new(int cap, struct skv_clients **out);
/* Accepts NULL and *t_p == NULL; sets *t_p to NULL. */
void skv_clients_free(struct skv_clients **t_p);

/* A message from routing id `identity` read from connection fd at now_ms. Routing ids over
 * 255 bytes are not recorded (SKV_CLIENT_LIVE). */
enum skv_client_seen skv_clients_seen(struct skv_clients *t, const uint8_t *identity, size_t identity_len, int fd,
                                      uint64_t now_ms);
/* DISCONNECTED(fd): every client live on fd is gone (gone() for each); fd counts as closed until
 * a connection is accepted on it. Returns how many clients went. */
int skv_clients_disconnected(struct skv_clients *t, int fd, uint64_t now_ms, skv_client_gone_fn *gone, void *user);
/* ACCEPTED(fd): a new connection on fd. A client still live on fd missed its DISCONNECTED and is
 * gone (gone() for each). Returns how many clients went. */
int skv_clients_accepted(struct skv_clients *t, int fd, uint64_t now_ms, skv_client_gone_fn *gone, void *user);
/* The connection fd of live client `identity`, or -1 (unknown, gone). */
int skv_clients_fd(const struct skv_clients *t, const uint8_t *identity, size_t identity_len);
/* Forgets gone clients and closed fds older than SKV_CLIENTS_GONE_KEEP_MS. */
void skv_clients_expire(struct skv_clients *t, uint64_t now_ms);

/* Clients in the table: live ones, and gone ones still remembered. */
struct skv_clients_count {
    int live, gone, closed_fds;
};
void skv_clients_count(const struct skv_clients *t, struct skv_clients_count *out);

#endif
