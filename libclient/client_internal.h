/* libsnapkv internals shared by client.c (connection, transport, errors, ids), session.c
 * (client commands, shared memory) and admin.c (admin commands). Not installed. */
#ifndef SKV_CLIENT_INTERNAL_H
#define SKV_CLIENT_INTERNAL_H

#include "libclient/snapkv.h"
#include "proto/snapkv.pb-c.h"

struct snapkv_client {
    void *zctx;
    void *sock;
    void *monitor;               /* connection events (handshakes, closes), read during calls */
    bool curve;                  /* CURVE keys were given */
    char *tenant;
    char *name;                  /* the client name HELLO gives */
    char *ipc_path;              /* an ipc:// endpoint's socket file (NULL: another transport) */
    int timeout_ms;
    uint64_t next_request_id;
    bool in_call;                /* a call is waiting for its replies (a callback runs inside it) */
    Snapkv__HelloReply *hello;   /* the latest HELLO's facts (snapkv_server_info reads them) */
    uint64_t disconnects;        /* connections closed so far */
    bool down;                   /* a connection closed and no handshake has worked since */
    bool up;                     /* a handshake worked and its connection has not closed */
    uint16_t refused_event;      /* a failed handshake seen between two calls, none since worked */
    uint32_t refused_value;
    uint64_t hello_sent_disconnects; /* c->disconnects when the last HELLO went out */
    uint64_t sent_disconnects;   /* c->disconnects when the last request went out */
    uint64_t hello_disconnects;  /* that count when `hello` was asked for: a later close is a new
                                  * connection, maybe to another daemon, so HELLO is asked again */
    bool lost;                   /* the last call failed because its connection closed before the
                                  * reply came */
    uint64_t unanswered;         /* calls that failed with no answer from the daemon: a send or a
                                  * reply that timed out, a handshake refused, a connection that
                                  * closed while the reply was awaited (snapkv_many_t reads it) */
    struct skv_client_string *strings; /* every server_info string returned so far, kept until
                                        * close (they must outlive a new HELLO) */
    const char *info[5];         /* server version, model name, fingerprint, backend, legacy
                                  * fingerprint: in strings */
};

/* Sets this thread's last error and returns status. */
int skv_client_fail(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* CLOCK_MONOTONIC in milliseconds. */
int64_t skv_client_now_ms(void);
/* Milliseconds zmq_poll may wait until deadline (a skv_client_now_ms time; -1: none, wait
 * forever). */
long skv_client_wait_ms(int64_t deadline);

/* Called for each streamed (final = false, status ok) reply of the current request: return 0
 * to go on, a negative status to stop waiting (the call returns it; set the message first). */
typedef int (*skv_partial_fn)(void *user, const Snapkv__Reply *rep);

/* Sends req (version, request id and tenant filled in here) and waits for its final reply,
 * skipping replies to earlier requests; the client's timeout bounds the send and each wait.
 * The final reply must be ok and carry result_case `want` (what: the command's name for
 * messages). On success *reply_out owns the reply (free with snapkv__reply__free_unpacked).
 * *in_flight (in_flight may be NULL) says whether the call failed after its request went out
 * and before the daemon ended it (a final reply, or an error): the command may still run there.
 * A call made while another of the same client waits (from one of its callbacks) fails with
 * SNAPKV_E_BUSY and sends nothing. */
int skv_client_call(snapkv_client_t *c, Snapkv__Request *req, Snapkv__Reply__ResultCase want, const char *what,
                    skv_partial_fn partial, void *user, bool *in_flight, Snapkv__Reply **reply_out);

/* Session ids on the wire: exactly 16 bytes. */
ProtobufCBinaryData skv_client_id_wire(const struct snapkv_session_id *id);
int skv_client_id_parse(const ProtobufCBinaryData *b, const char *what, struct snapkv_session_id *out);

/* Converts LayerKept messages into one allocation (layers, then their per-head counts) that
 * free() releases. Positions, when their count matches, are pointed at per layer. */
int skv_client_layers(const snapkv_client_t *c, Snapkv__LayerKept *const *kept, size_t n,
                      const uint32_t *positions, size_t n_positions, struct snapkv_layer_kept **out);

/* A copy of n uint32 / float values (NULL when n == 0); returns false when out of memory. */
bool skv_client_dup_u32(const uint32_t *src, size_t n, uint32_t **out);
bool skv_client_dup_f32(const float *src, size_t n, float **out);

/* Checks that c is connected and arg (the session id; prefill's and import's options) is
 * non-NULL (the "bad argument" message names `what`), then asks HELLO again when the connection
 * closed since the last (see snapkv_server_info), so the command's own checks see the facts of
 * the daemon it goes to. */
int skv_client_check(snapkv_client_t *c, const void *arg, const char *what);

/* The checks snapkv_connect makes of its options before connecting (timeout, tenant, CURVE
 * keys, CURVE in libzmq). */
int skv_client_check_opts(const struct snapkv_connect_opts *opts);

/* Reads the connection events libzmq reported since the last call, without waiting: c->down
 * then says whether the connection is closed now (and no handshake has worked since). */
void skv_client_look(snapkv_client_t *c);

/* Endpoint lists (snapkv_place, snapkv_connect_many): from 1 to max names, none NULL or empty,
 * none listed twice; SNAPKV_E_INVAL otherwise, with a message starting with what. */
int skv_client_check_names(const char *const *names, size_t n, size_t max, const char *what);
/* Endpoint e's rendezvous weight for key (snapkv_place). libsodium must have been started. */
uint64_t skv_client_place_weight(const char *e, const void *key, size_t key_len);
/* Whether endpoint a (weight wa) comes before b (weight wb) in a key's order: the higher
 * weight, equal weights by the lower name. */
bool skv_client_place_before(uint64_t wa, const char *a, uint64_t wb, const char *b);

#endif
