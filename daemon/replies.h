/* Replies snapkvd has handed to libzmq that their client has not taken yet. libzmq bounds a
 * peer's queue by messages (1000), not bytes, so a client that sends requests and never reads
 * (with logits a reply is up to n_vocab floats) could make the daemon hold gigabytes. Each
 * reply is sent from a buffer libzmq frees through a callback once the connection took it (or
 * dropped it), which gives the bytes still held per client exactly; a reply that would pass a
 * client's bound or the bound over all clients is dropped, as libzmq drops one past its queue. */
#ifndef SKV_REPLIES_H
#define SKV_REPLIES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct skv_replies;

/* What a reply costs beyond its body and routing id, counted with them against the bounds: its
 * tracking record (the routing id's room in it) and libzmq's two messages. Counted as the body
 * alone, a client's never-read stream of small replies (thousands a connection, libzmq's queue
 * allows) held about 30 times the bytes the bounds saw. */
#define SKV_REPLY_OVERHEAD 384

/* Bounds in bytes: one client's replies not taken yet, one owner's (a peer: all the clients of
 * one user or address), and all clients' together. */
int skv_replies_new(uint64_t max_per_client, uint64_t max_per_owner, uint64_t max_total, struct skv_replies **out);
/* Call after zmq_ctx_term(): libzmq may free a queued reply until then. Accepts NULL. */
void skv_replies_free(struct skv_replies **r_p);

/* Sends [identity][body] on a ROUTER without blocking (socket thread). A client is the socket
 * index `sock_idx` (0 client endpoint, 1 admin) and its routing id; `owner` (0: none known) the
 * peer it belongs to. A reply counts len + identity_len + SKV_REPLY_OVERHEAD bytes. Returns
 * SKV_OK when libzmq took the reply, SKV_E_BUSY when it was dropped because the client's bytes
 * not taken yet, its owner's, or all clients', plus the reply's would pass
 * their bound (counted; a reply finding nothing held by its client or owner always goes,
 * however large; the admin endpoint's are not held to the bound over all clients, so clients
 * that do not read cannot make the operator's replies go) or because the client's queue in
 * libzmq is full (EAGAIN, with ZMQ_ROUTER_MANDATORY), SKV_E_IO when libzmq refused it
 * otherwise (the client gone: errno-style reason in the message). */
int skv_replies_send(struct skv_replies *r, void *sock, int sock_idx, uint64_t owner, const void *identity,
                     size_t identity_len, const void *body, size_t len);
/* One owner's bytes not taken yet (socket thread; for tests). */
uint64_t skv_replies_unread_bytes_of_owner(struct skv_replies *r, uint64_t owner);

/* Bytes handed to libzmq and not taken yet, all clients (any thread). */
uint64_t skv_replies_unread_bytes(const struct skv_replies *r);
/* One client's (socket thread; for tests). */
uint64_t skv_replies_unread_bytes_of(struct skv_replies *r, int sock_idx, const void *identity, size_t identity_len);
/* Replies dropped for the bounds or a full queue since the start (any thread). */
uint64_t skv_replies_dropped(const struct skv_replies *r);
/* A reply not sent because its request's connection had closed (socket thread), and how many
 * since the start (any thread). */
void skv_replies_note_closed(struct skv_replies *r);
uint64_t skv_replies_closed(const struct skv_replies *r);

/* True when a ZeroMQ socket (NULL: none) has a message to read now (its ZMQ_EVENTS). */
bool skv_zmq_has_input(void *sock);

#endif
