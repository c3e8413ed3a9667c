/* libsnapkv: the C client of the snapkvd daemon.
 *
 * Thread safety: a snapkv_client_t is NOT safe to use from several threads at once; use one
 * client per thread (they are cheap: one ZeroMQ DEALER socket each) or serialize calls.
 * Callbacks (snapkv_token_fn, snapkv_progress_fn) run inside a call of their client. There a
 * call that sends a request to the daemon (every command, admin ones too) fails with
 * SNAPKV_E_BUSY (use another client), and closing the client is undefined. Local calls work:
 * snapkv_server_info, and snapkv_set_timeout, which sets how long the running call waits for
 * its next reply (-1: for ever) as well as later calls' timeouts. A signal does not end a call:
 * it waits on for what is left of its timeout (a streaming callback can stop a decode). A call
 * whose connection closes while it waits (the daemon stopped or restarted) fails with
 * SNAPKV_E_IO within 200 ms (replies already on their way are taken meanwhile; never later than
 * its own timeout): whether it ran is not known; the next call goes out on the connection
 * there is then.
 * Different clients may be used concurrently, and several threads may connect at once (each
 * client has its own ZeroMQ context and CURVE keys). Result structs (snapkv_*_result, lists, stats)
 * belong to the caller, do not refer to the client and may outlive it.
 * The library never logs: every function returns a status (SNAPKV_OK = 0 or a negative
 * SNAPKV_E_* code, the same codes the daemon sends) and snapkv_last_error() gives the detail
 * message of this thread's last failure. Out-parameters are written only on success.
 *
 * Compression specs are plain strings of comma-separated key=value pairs, the same the daemon's
 * config file and snapkvctl take, e.g. "policy=snapkv,ratio=0.1" or
 * "policy=snapkv,alloc=squeeze,budget=512,window=32". For a PREFILL NULL or "" means the
 * daemon's default-compress (policy=full, no compression, unless its operator set another);
 * snapkv_compress needs one. The
 * daemon parses and validates them (unknown keys and bad values are errors).
 *
 * Every string a call sends (text, specs, stop sequences, names, the tenant and the client's
 * name at connect) must be well-formed UTF-8: the daemon answers one that is not SNAPKV_E_INVAL,
 * naming the field ("request field prefill.text is not text: ill-formed UTF-8 at byte 3").
 *
 * ABI: the shared library is libsnapkv.so.N, N = current - age of its libtool version
 * (LIBSNAPKV_LT_VERSION in configure.ac, current:revision:age). A release that only changes code
 * bumps revision. One that adds functions bumps current and age (programs built against the
 * older library still run). One that removes or changes a function, or adds, removes, reorders or
 * resizes a field of a struct the caller allocates or the library fills (the *_opts structs,
 * snapkv_sampling, the results, ...), or renumbers an enum, sets current + 1, revision 0, age 0:
 * N changes and programs must be rebuilt. 2:0:0 (libsnapkv.so.2) is the first such bump: structs
 * grew fields after 1.0 (snapkv_import_opts.cuda, the CURVE keys of snapkv_connect_opts).
 * 3:0:0 (libsnapkv.so.3): snapkv_kv_layout grew original_length.
 * 4:0:0 (libsnapkv.so.4): snapkv_sampling grew stop and n_stop (stop sequences); snapkv_cancel.
 * 5:0:1 (still libsnapkv.so.4): the KV events subscriber (snapkv_events_*) and
 * snapkv_admin_session_hashes, added.
 * 6:0:2 (still libsnapkv.so.4): snapkv_events_replay added.
 * 6:1:2: a failed running DECODE is cancelled, lost streamed replies fail it, a callback's call
 * of its own client fails BUSY, signals do not end calls; the same interface.
 * 6:2:2: a daemon restart shows in the events stream as a CLEARED of sequence 0; after a replay,
 * an earlier daemon's queued events are told from a later one's by their time.
 * 6:3:2: after the connection closed, the next call asks HELLO again (snapkv_server_info and the
 * library's checks follow a restarted daemon's model and limits).
 * 6:4:2: the events stream's heartbeats are read (a restart's CLEARED of sequence 0 comes with
 * the new daemon's first heartbeat); snapkv_connect refuses a tenant name the daemon would
 * refuse; chat with token ids, and stop tokens outside the vocabulary, are refused (INVAL);
 * snapkv_set_timeout(-1) in a callback makes the running call wait for ever (it timed out); an
 * ipc:// socket this user may not open fails connect at once (PERM), and a timeout's message
 * says whether the socket file is there; a CURVE client public key that is not the secret
 * key's is refused at connect (INVAL).
 * 6:5:2: after a replay, a daemon started since is told from an earlier one by the stream's order
 * once the replayed daemon's own messages came (a clock stepped back between them dropped its
 * events); snapkv_shm_create makes 0600 objects with an ACL entry for the daemon's user.
 * 6:6:2: snapkv_connect asks HELLO again when the connection closed before its answer (a daemon
 * past a connection limit closes a connection whose handshake finished first).
 * 7:0:3 (still libsnapkv.so.4): snapkv_events_published and snapkv_place added.
 * 8:0:4 (still libsnapkv.so.4): several daemons behind one handle (snapkv_connect_many,
 * snapkv_many_*), session references (snapkv_session_ref*), SNAPKV_E_UNAVAILABLE added.
 * 9:0:5 (still libsnapkv.so.4): snapkv_decode_logprobs and snapkv_logprobs_free added.
 * 10:0:6 (still libsnapkv.so.4): snapkv_prefill_flags (prefix reuse: how many tokens were
 * reused, or none asked) added.
 * 11:0:7 (still libsnapkv.so.4): struct snapkv_event grew kept_prefix, in the padding after
 * compressed (its size and every other field's offset are as before).
 * 12:0:8 (still libsnapkv.so.4): snapkv_admin_list_kept and snapkv_kept_list_free added;
 * snapkv_admin_evict takes a kept prefix's id.
 * 13:0:9 (still libsnapkv.so.4): struct snapkv_sampling_ext (min-p, repetition, frequency and
 * presence penalties, logit bias), snapkv_decode_ext and snapkv_sampling_ext_defaults added;
 * snapkv_tokenize, snapkv_tokens_free and snapkv_detokenize added.
 * 14:0:10 (still libsnapkv.so.4): struct snapkv_scores, snapkv_prefill_scored,
 * snapkv_append_scored and snapkv_scores_free added.
 * 15:0:11 (still libsnapkv.so.4): snapkv_prefill_scored_top and snapkv_append_scored_top added.
 * 16:0:12 (still libsnapkv.so.4): snapkv_server_legacy_fingerprint added.
 * 17:0:13 (still libsnapkv.so.4): snapkv_session_list_spec added.
 * 18:0:14 (still libsnapkv.so.4): snapkv_events_quiet_ms added.
 * SNAPKV_PROTOCOL_VERSION is the wire protocol's, versioned on its own. */
#ifndef SNAPKV_H
#define SNAPKV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SNAPKV_API __attribute__((visibility("default")))

#define SNAPKV_PROTOCOL_VERSION 1

/* Status codes: identical values to the daemon's SKV_* codes. */
enum snapkv_status {
    SNAPKV_OK = 0,
    SNAPKV_E_NOMEM = -1,
    SNAPKV_E_INVAL = -2,
    SNAPKV_E_DEVICE = -3,
    SNAPKV_E_BUSY = -4,
    SNAPKV_E_PROTO = -5,
    SNAPKV_E_IO = -6,
    SNAPKV_E_POOL_FULL = -7,
    SNAPKV_E_NOT_FOUND = -8,
    SNAPKV_E_UNSUPPORTED = -9,
    SNAPKV_E_FORMAT = -10,
    SNAPKV_E_LIMIT = -11,
    SNAPKV_E_PERM = -12,
    SNAPKV_E_VERSION = -13,
    SNAPKV_E_CANCELLED = -14,
    SNAPKV_E_TIMEOUT = -15,
    SNAPKV_E_EXISTS = -16,
    SNAPKV_E_INTERNAL = -17,
    SNAPKV_E_UNAVAILABLE = -18, /* the daemon a snapkv_many_t was asked for, or every one a placement
                                 * could use, is down (never sent by a daemon) */
};

/* Detail message of this thread's last failed call ("" when none; a later successful call
 * does not clear it). */
SNAPKV_API const char *snapkv_last_error(void);
/* Short text of a status code ("invalid argument", ...); never NULL. */
SNAPKV_API const char *snapkv_status_str(int status);

/* ---- connection ---------------------------------------------------------------------------- */

typedef struct snapkv_client snapkv_client_t;

struct snapkv_connect_opts {
    const char *tenant;     /* NULL: "default"; 1 to 63 of letters, digits and . _ - @ (else
                             * SNAPKV_E_INVAL at connect) */
    const char *name;       /* client name, in the daemon's log at log-level = debug; NULL: "libsnapkv";
                             * at most 4096 bytes of well-formed UTF-8 (else SNAPKV_E_INVAL at connect) */
    int timeout_ms;         /* send each request and wait for each reply; 0: 30000, -1: forever.
                             * Each request tells the daemon this as its deadline: one still
                             * queued when it passes is answered TIMEOUT unrun (but a CANCEL
                             * or RELEASE, which run late), and a PREFILL without progress
                             * replies stops at its next layer */
    /* CURVE, which a daemon's tcp:// endpoint requires: Z85 keys (40 characters, e.g. read with
     * snapkv_curve_key_load). All NULL: no CURVE (ipc://, or a daemon run with
     * allow-insecure-tcp). The strings are copied during snapkv_connect. */
    const char *curve_server_key;  /* the daemon's public key */
    const char *curve_secret_key;  /* this client's secret key */
    const char *curve_public_key;  /* this client's public key; NULL: derived from the secret (one
                                      that is not the secret's: SNAPKV_E_INVAL) */
};

/* Connects to `endpoint` ("ipc:///run/snapkvd/snapkvd.sock", "tcp://host:port") and does the
 * HELLO handshake (protocol version check). Admin commands need a client connected to the
 * daemon's admin endpoint. *out is written only on success.
 * A refused connection fails as soon as libzmq reports the failed handshake, not at the
 * timeout: SNAPKV_E_PERM when the daemon does not authorize this client's CURVE key, when it
 * requires CURVE and none was given (or the reverse), or when the server key is wrong; a
 * client key bound to a tenant by the daemon gets SNAPKV_E_PERM for any other tenant. An
 * ipc:// socket file this user may not open fails at once with SNAPKV_E_PERM (the client
 * socket is for the daemon's group, the admin socket for its user); one that is not there, or
 * where nothing answers, fails at the timeout with a message that says which. A daemon past
 * its max-connections, or this user's (or address's) max-connections-per-peer, closes the
 * connection as it comes: SNAPKV_E_PERM, naming them. When that close came after the handshake
 * and lost the HELLO, HELLO is asked again on the next connection within the timeout; a daemon
 * that closes every one fails the connect with SNAPKV_E_IO, naming the limits. */
SNAPKV_API int snapkv_connect(const char *endpoint, const struct snapkv_connect_opts *opts,
                              snapkv_client_t **out);
/* Accepts NULL and *client_p == NULL; sets *client_p to NULL. */
SNAPKV_API void snapkv_close(snapkv_client_t **client_p);

/* ---- CURVE keys ------------------------------------------------------------------------------
 * Both functions are thread-safe (no shared state). SNAPKV_E_UNSUPPORTED when the libzmq in
 * use has no CURVE. */

#define SNAPKV_CURVE_KEY_SIZE 41 /* 40 Z85 characters and the NUL */

/* A new random key pair in Z85 (what `snapkvctl keygen` writes). */
SNAPKV_API int snapkv_curve_keypair(char public_key[SNAPKV_CURVE_KEY_SIZE], char secret_key[SNAPKV_CURVE_KEY_SIZE]);
/* Reads a key file: exactly one Z85 key on a line; blank lines and lines starting with '#'
 * are skipped.
 * secret: the file must not be readable or writable by others (SNAPKV_E_PERM otherwise). */
SNAPKV_API int snapkv_curve_key_load(const char *path, bool secret, char key[SNAPKV_CURVE_KEY_SIZE]);

/* Changes how long each later call may take to send its request and to get each reply (0: 30000,
 * -1: forever). The timeout restarts with every streamed reply, so a long prefill either asks
 * for progress or needs a longer timeout. A reply that arrives after its call timed out is
 * discarded by later calls. Requests are not queued for a daemon that is not connected (not
 * running yet, gone): such a call fails with SNAPKV_E_TIMEOUT ("could not send ...") at its
 * timeout, and a daemon that comes back sees only later calls. A daemon still connected that
 * has stopped reading (hung, or stopped with SIGSTOP) is different: up to libzmq's send
 * high-water mark (1000) of requests wait in the socket, each call failing with "no ... reply"
 * at its timeout, and when the daemon reads again it runs them, each with its whole deadline (a
 * PREFILL so retried makes sessions the client never learned, until their lease ends); past
 * that mark calls fail with "could not send ...".
 * The first call after the connection closed asks HELLO again (see snapkv_server_info), which
 * has its own timeout, so that call may take up to twice it. */
SNAPKV_API int snapkv_set_timeout(snapkv_client_t *client, int timeout_ms);

/* What HELLO told us about the daemon and its model. After the connection closed (the daemon
 * restarted, maybe with another model or other limits), the next call asks HELLO again before
 * its request, so these are the facts of the daemon that answered the last call. Strings live
 * as long as the client. */
struct snapkv_server_info {
    const char *server_version;
    const char *model_name;
    const char *model_fingerprint;
    const char *backend;
    uint32_t n_layers, n_heads, n_kv_heads, head_dim, n_vocab;
    uint32_t max_prompt_tokens, max_new_tokens;
    uint64_t max_message_bytes;
    uint32_t max_sessions_per_tenant;
    uint64_t max_bytes_per_tenant;
    uint32_t kv_block_tokens;
    uint32_t bos_token, eos_token; /* SNAPKV_NO_TOKEN: the model has none, or the daemon no tokenizer */
};
#define SNAPKV_NO_TOKEN UINT32_MAX
SNAPKV_API int snapkv_server_info(snapkv_client_t *client, struct snapkv_server_info *out);
/* The model's fingerprint as daemons before 2026-12-06 named it (HelloReply's
 * legacy_model_fingerprint: a GGUF file's without its config), which exports and SAVE files of
 * such a daemon carry and this one still takes; "" when the daemon does not say (an older one)
 * or the handle is not connected. Valid until the handle is closed. */
SNAPKV_API const char *snapkv_server_legacy_fingerprint(snapkv_client_t *client);

/* ---- sessions -------------------------------------------------------------------------------- */

/* A session's 128-bit id (random, chosen by the daemon). */
struct snapkv_session_id {
    uint8_t bytes[16];
};
#define SNAPKV_SESSION_ID_HEX_SIZE 33 /* 32 lower-case hex digits and the NUL */

/* Which of several daemons a key belongs to, for a client that spreads its sessions over them
 * (docs/SCALING.md): rendezvous (highest random weight) hashing. *index is the i in
 * endpoints[0..n) whose weight for the key is the highest (equal weights: the lower name by
 * strcmp). Every process given the same endpoint names, in any order, places a key on the same
 * name, and when one name leaves the list only the keys that were on it move. The key is any
 * bytes the client chooses: a document id, or, for a prompt, its first 64 token ids as
 * little-endian uint32 (fewer when shorter), so prompts sharing a system prompt or a document
 * meet on one daemon, where FORK shares their blocks. The weight, for other languages: the first
 * 8 bytes, as a little-endian uint64, of the 16-byte BLAKE2b (no key) of the endpoint name, one
 * NUL byte and the key; in Python int.from_bytes(hashlib.blake2b(name + b"\0" + key,
 * digest_size=16).digest()[:8], "little"). SNAPKV_E_INVAL: no endpoints or more than 4096, an empty
 * or NULL name, a name listed twice. It connects to nothing. */
SNAPKV_API int snapkv_place(const char *const *endpoints, size_t n, const void *key, size_t key_len, size_t *index);

/* A session reference: the endpoint of the daemon that holds it, '#', and its id in hex
 * ("ipc:///run/snapkvd/snapkvd.sock#0123...ef"), for handing a session to another process
 * when sessions are spread over several daemons. snapkv_session_ref writes one into buf
 * (SNAPKV_E_LIMIT when cap is too small: it needs strlen(endpoint) + 34). snapkv_session_ref_parse
 * splits one at its last '#': the endpoint (copied into endpoint, cap bytes; SNAPKV_E_LIMIT when
 * it does not fit) must not be empty and the id must be exactly 32 hex digits (SNAPKV_E_INVAL).
 * A bare id, with no '#', is SNAPKV_E_INVAL too. */
SNAPKV_API int snapkv_session_ref(const char *endpoint, const struct snapkv_session_id *id, char *buf, size_t cap);
SNAPKV_API int snapkv_session_ref_parse(const char *ref, char *endpoint, size_t cap, struct snapkv_session_id *id);

/* ---- several daemons ------------------------------------------------------------------------
 * One handle over the connections to several daemons (docs/SCALING.md section 1). A new
 * session goes to the daemon snapkv_place gives for its key, or, when that one is down, to the
 * next in the key's order of weights, so that every process with the same endpoints sends a
 * key to the same daemon while they are all up, and a daemon's keys, only its keys, move while
 * it is down. A session stays on the daemon that made it: its reference (snapkv_session_ref)
 * names that endpoint, and snapkv_many_client gives the connection to it.
 * The handle connects to an endpoint when it is first needed, with the options given here
 * (every endpoint shares the tenant, the name, the timeout and the CURVE keys, so daemons
 * reached with CURVE must share a server key); snapkv_connect_many checks those options as
 * snapkv_connect does. Connecting to a daemon that does not answer takes the timeout, so a
 * placement may wait that long for each endpoint it tries that was never connected or whose
 * down_ms has passed. An endpoint is marked down for down_ms when connecting to it fails (no
 * daemon, an endpoint libzmq does not take, a refused or failed HELLO), when its connection
 * has closed (the daemon stopped; libzmq keeps trying to reconnect), or when a call on its
 * client went unanswered since the last look (a send or a reply that timed out, a refused
 * handshake, a connection that closed during a call; an error the daemon answered to a call
 * does not count); the caller may also mark it (snapkv_many_mark_down). Once down_ms have
 * passed, the next use looks again. Like a client, a handle is not safe to use from several
 * threads at once, and the clients it returns belong to it (do not close them). A callback of
 * a call may place keys and get clients, but never the client running that call (a placement
 * skips it, snapkv_many_client and snapkv_many_session fail with SNAPKV_E_BUSY), and must not
 * close the handle. SNAPKV_E_UNAVAILABLE: the endpoint asked for, or every endpoint of a
 * placement, is down; the message says why (for a placement, for as many endpoints as it
 * holds). */
typedef struct snapkv_many snapkv_many_t;
#define SNAPKV_MANY_MAX 64            /* endpoints of one handle */
#define SNAPKV_MANY_DOWN_MS 5000      /* down_ms when 0 is given */

/* Checks the endpoints (1 to SNAPKV_MANY_MAX, none empty, longer than 1023 bytes or listed
 * twice: SNAPKV_E_INVAL) and opts (NULL: the defaults; what snapkv_connect refuses before it
 * connects, SNAPKV_E_INVAL or SNAPKV_E_UNSUPPORTED), and copies both. down_ms: 0 for
 * SNAPKV_MANY_DOWN_MS, at most 3600000. Connects to none yet. */
SNAPKV_API int snapkv_connect_many(const char *const *endpoints, size_t n, const struct snapkv_connect_opts *opts,
                                   int down_ms, snapkv_many_t **out);
/* Closes every connection; accepts NULL and *many_p == NULL; sets *many_p to NULL. */
SNAPKV_API void snapkv_close_many(snapkv_many_t **many_p);
/* The client for a new session with this key (see snapkv_place): the highest-weight endpoint
 * that is up, connected now if it was not. *index (may be NULL) is its place in the list.
 * SNAPKV_E_UNAVAILABLE: every endpoint is down; SNAPKV_E_BUSY: none is up but the client(s)
 * running the call this callback comes from. */
SNAPKV_API int snapkv_many_place(snapkv_many_t *many, const void *key, size_t key_len, snapkv_client_t **client,
                                 size_t *index);
/* The client of endpoint `index` (connected now if it was not); SNAPKV_E_UNAVAILABLE while it
 * is down, SNAPKV_E_BUSY while it runs the call this callback comes from, SNAPKV_E_INVAL for an
 * index past the list. */
SNAPKV_API int snapkv_many_client(snapkv_many_t *many, size_t index, snapkv_client_t **client);
/* The client of the daemon a reference names, and the session's id: SNAPKV_E_INVAL for a
 * malformed reference, SNAPKV_E_NOT_FOUND when its endpoint is not one of the handle's, else as
 * snapkv_many_client. */
SNAPKV_API int snapkv_many_session(snapkv_many_t *many, const char *ref, snapkv_client_t **client,
                                   struct snapkv_session_id *id);
/* Marks endpoint `index` down for the handle's down_ms from now: placements skip it and
 * snapkv_many_client refuses it until then. */
SNAPKV_API int snapkv_many_mark_down(snapkv_many_t *many, size_t index);
/* Endpoint `index`'s name as given (NULL past the list); the handle owns it. */
SNAPKV_API const char *snapkv_many_endpoint(const snapkv_many_t *many, size_t index);

/* Writes 32 lower-case hex digits and a NUL into buf (cap >= SNAPKV_SESSION_ID_HEX_SIZE). */
SNAPKV_API int snapkv_session_id_to_hex(const struct snapkv_session_id *id, char *buf, size_t cap);
/* Parses exactly 32 hex digits (either case); anything else is SNAPKV_E_INVAL. */
SNAPKV_API int snapkv_session_id_from_hex(const char *hex, struct snapkv_session_id *out);

/* How many KV entries one layer of a session keeps. The library fills kept_per_head with one
 * entry per KV head even when the daemon sent only the layer's count. */
struct snapkv_layer_kept {
    uint32_t layer;
    uint32_t kept;                /* max over heads */
    uint32_t n_heads;             /* entries in kept_per_head */
    const uint32_t *kept_per_head;
    uint64_t bytes;
    /* Original positions this layer keeps, head after head (kept_per_head[h] each, not
     * padded), when the call returned positions; else NULL. Points into the owning result. */
    const uint32_t *positions;
    /* INSPECT: per head, the KV pool blocks the session holds and how many of them it shares
     * copy-on-write with other sessions (forks of one document); else NULL. */
    const uint32_t *blocks_per_head;
    const uint32_t *shared_blocks_per_head;
};

/* Called for each progress reply of a prefill (tokens_done of n_tokens; n_tokens may be 0 when
 * the daemon did not say). */
typedef void (*snapkv_progress_fn)(void *user, uint32_t tokens_done, uint32_t n_tokens);

struct snapkv_prefill_opts {
    const uint32_t *tokens;       /* either token ids ... */
    size_t n_tokens;
    const char *text;             /* ... or UTF-8 text, tokenized by the daemon (ill-formed: SNAPKV_E_INVAL) */
    bool chat;                    /* render text as one user turn with the model's chat template */
    const char *compress;         /* compression spec; NULL or "": the daemon's default-compress */
    bool return_logits;           /* the last position's logits in the result */
    uint32_t lease_seconds;       /* released when idle this long; 0: the daemon's default;
                                   * above the daemon's max-lease-seconds: SNAPKV_E_LIMIT */
    snapkv_progress_fn progress;  /* NULL: no progress replies */
    void *progress_user;
};

struct snapkv_prefill_result {
    struct snapkv_session_id id;
    uint32_t n_tokens;            /* prompt length */
    uint64_t bytes_before;        /* KV bytes a full cache would hold, in whole pool blocks */
    uint64_t bytes_after;         /* KV bytes kept, in whole pool blocks */
    uint32_t next_token;          /* greedy next token */
    size_t n_layers;
    struct snapkv_layer_kept *layers;
    size_t n_logits;              /* n_vocab when return_logits, else 0 */
    float *logits;
};

/* Runs the prompt and creates a session (compressed during the prefill, layer by layer, under
 * opts->compress or the daemon's default-compress). Call snapkv_prefill_result_free() on *out afterwards. */
SNAPKV_API int snapkv_prefill(snapkv_client_t *client, const struct snapkv_prefill_opts *opts,
                              struct snapkv_prefill_result *out);
/* snapkv_prefill with flags (0 or SNAPKV_PREFILL_*; another bit: SNAPKV_E_INVAL). A daemon with
 * prefix-reuse (its default) takes the KV of the prompt's longest run of whole KV blocks (16
 * tokens by default) that another full-cache session of the same tenant holds (or, with
 * prefix-retain-bytes, held before its RELEASE), shared copy-on-write, and computes only the
 * rest, as a prefill of the whole prompt would; *reused_tokens (may be NULL) is how many tokens it took (0 from a
 * daemon older than protocol field PrefillReply.reused_tokens). */
#define SNAPKV_PREFILL_NO_PREFIX_REUSE 1u /* compute every token of the prompt */
SNAPKV_API int snapkv_prefill_flags(snapkv_client_t *client, const struct snapkv_prefill_opts *opts, unsigned flags,
                                    struct snapkv_prefill_result *out, uint32_t *reused_tokens);
/* Frees the arrays and zeroes *r; accepts NULL and a zeroed struct. */
SNAPKV_API void snapkv_prefill_result_free(struct snapkv_prefill_result *r);

struct snapkv_append_opts {
    const uint32_t *tokens;       /* either token ids ... */
    size_t n_tokens;
    const char *text;             /* ... or text (tokenized by the daemon as is) */
    bool return_logits;
    bool chat;                    /* text holds chat-template markup (<|im_start|> ...): parse it */
};
struct snapkv_append_result {
    uint32_t n_tokens;            /* session length after the append, in original positions */
    uint32_t next_token;
    size_t n_logits;
    float *logits;
};
/* Runs more tokens through a session (at positions after its original length). out may be
 * NULL; otherwise free it with snapkv_append_result_free(). */
SNAPKV_API int snapkv_append(snapkv_client_t *client, const struct snapkv_session_id *id,
                             const struct snapkv_append_opts *opts, struct snapkv_append_result *out);
SNAPKV_API void snapkv_append_result_free(struct snapkv_append_result *r);

/* What the model thought of a prompt's own tokens (perplexity, scoring candidate answers, what
 * compression costs a continuation): each token's log-probability given the tokens before it,
 * and the token ids (a text's as the daemon tokenized it). */
struct snapkv_scores {
    float *logprobs;              /* [n_logprobs], natural log */
    size_t n_logprobs;            /* prefill: n_tokens - 1 (logprobs[i] is tokens[i + 1]'s); append: n_tokens */
    uint32_t *tokens;             /* [n_tokens] */
    size_t n_tokens;
    uint32_t *top_tokens;         /* [n_logprobs]: the model's most likely token where each scored token
                                   * stands (the lowest id among equal largest logits): equal means greedy */
};
/* snapkv_prefill_flags that also scores the prompt. Every token is computed (no prefix reuse:
 * a reused row has no output to score), and the output layer runs at every position, which
 * costs about as much again as a forward of this model's dimension per token. A daemon without
 * the feature (HELLO "prompt-logprobs"): SNAPKV_E_UNSUPPORTED. Free *scores with
 * snapkv_scores_free(); it is zeroed on failure. */
SNAPKV_API int snapkv_prefill_scored(snapkv_client_t *client, const struct snapkv_prefill_opts *opts, unsigned flags,
                                     struct snapkv_prefill_result *out, struct snapkv_scores *scores);
/* snapkv_append that also scores the appended tokens, each given the session before it: the
 * first from the session's next-token logits (an imported session has none before its first
 * APPEND: SNAPKV_E_INVAL), which the forward that made them computed (a compressing PREFILL's
 * saw the whole prompt); from the second on, on a compressed session, the compressed cache's
 * predictions, so the same text appended to a full-cache and a compressed session of one
 * document tells what compression costs it. out may be NULL. */
SNAPKV_API int snapkv_append_scored(snapkv_client_t *client, const struct snapkv_session_id *id,
                                    const struct snapkv_append_opts *opts, struct snapkv_append_result *out,
                                    struct snapkv_scores *scores);
/* Frees the arrays and zeroes *s; accepts NULL and a zeroed struct. */
SNAPKV_API void snapkv_scores_free(struct snapkv_scores *s);
struct snapkv_logprobs;
/* snapkv_prefill_scored and snapkv_append_scored that also give, with top_n > 0 (at most 20:
 * SNAPKV_E_LIMIT, nothing sent), each scored position's top_n most likely tokens and their
 * log-probabilities, most likely first (equal ones by id), in *top (a struct snapkv_logprobs
 * whose n is scores->n_logprobs and whose logprobs are a copy of scores'; free it with
 * snapkv_logprobs_free(); zeroed on failure; NULL with top_n 0). A daemon without the feature
 * (HELLO "prompt-top-logprobs"): SNAPKV_E_UNSUPPORTED. Each position's logits then come to the
 * daemon's host to be ranked. */
SNAPKV_API int snapkv_prefill_scored_top(snapkv_client_t *client, const struct snapkv_prefill_opts *opts,
                                         unsigned flags, uint32_t top_n, struct snapkv_prefill_result *out,
                                         struct snapkv_scores *scores, struct snapkv_logprobs *top);
SNAPKV_API int snapkv_append_scored_top(snapkv_client_t *client, const struct snapkv_session_id *id,
                                        const struct snapkv_append_opts *opts, uint32_t top_n,
                                        struct snapkv_append_result *out, struct snapkv_scores *scores,
                                        struct snapkv_logprobs *top);

struct snapkv_sampling {
    float temperature;            /* 0: greedy; at most 100 */
    uint32_t top_k;               /* 0: off; tokens tied with the k-th stay (as transformers') */
    float top_p;                  /* 0 or 1: off */
    uint64_t seed;                /* 0 too is a seed: the same seed, session and settings give the
                                     same tokens; vary it for different samples */
    const uint32_t *stop_tokens;
    size_t n_stop_tokens;
    uint32_t max_tokens;          /* 0: 64 (at most the daemon's max-new-tokens: LIMIT above it) */
    bool stop_at_eos;             /* stop at the model's end-of-turn / eos token */
    /* stop sequences (text; at most 16, each 1 to 256 bytes): the decode ends when its text
     * contains one (finish_reason "stop"), its text ending just before it; streamed text that
     * may begin one is held back until it cannot. The tokens include the one that completed it,
     * and the session holds them all. */
    const char *const *stop;
    size_t n_stop;
};
/* Greedy, no stop tokens or sequences, max_tokens 0, stop_at_eos true: what a NULL sampling means. */
SNAPKV_API void snapkv_sampling_defaults(struct snapkv_sampling *s);

/* Called with each batch of new tokens while a decode streams, with their text (complete
 * UTF-8 only; may be ""). Streamed or collected, a decode's text is the same: each token's
 * bytes, none for control tokens (<|im_end|> ...), and a character the decode's end cuts is
 * held back and begins the session's next decode's text (an APPEND in between drops it).
 * Return 0 to go on; anything else ends the decode: the library sends CANCEL for the session
 * and waits until the daemon ended it, then snapkv_decode returns SNAPKV_E_CANCELLED and does
 * not write *out (except after the last batch, which comes with the decode's end: what the
 * callback answers to it is ignored and the call succeeds). The session keeps every token made so far and takes the next command at
 * once: those the callback saw, and any the daemon made before the CANCEL reached it, whose
 * replies the library drops. The caller cannot learn those extra tokens (no other call returns
 * a session's token ids), and there may be many more of them than the callback saw. The
 * session's length is the n_tokens of snapkv_admin_inspect() or snapkv_admin_list() (admin
 * calls: a client connected to the admin endpoint), or of the stored event the decode's end
 * publishes on an events-endpoint. A program that needs every token stops the decode with
 * snapkv_cancel() from another thread's client instead: snapkv_decode then returns SNAPKV_OK
 * with finish_reason "cancelled" and all its tokens and text. A decode that fails in any other
 * way while it runs (SNAPKV_E_TIMEOUT, SNAPKV_E_NOMEM, lost replies) is cancelled the same way,
 * waiting a second at most (two when the client must say HELLO again first); the message says
 * if that CANCEL failed too. No CANCEL is sent when the connection the DECODE went out on has
 * closed since (the daemon stopped or restarted: it drops a gone client's decode); the CANCEL
 * after a callback's stop waits the client's timeout, 30 s when that is -1. Closing the client (or
 * its process ending) cancels it too. Each reply counts the tokens made so far: a streaming
 * client that reads so slowly that the daemon dropped some of its replies gets SNAPKV_E_IO
 * ("lost N streamed tokens"). A DECODE past the daemon's max-decodes or max-decodes-per-tenant
 * running ones is refused at once with SNAPKV_E_BUSY. The callback must not send requests on
 * its own client (see the top of this file). */
typedef int (*snapkv_token_fn)(void *user, const uint32_t *tokens, size_t n_tokens, const char *text);

struct snapkv_decode_result {
    uint32_t *tokens;             /* every generated token, also when streamed */
    size_t n_tokens;
    char *text;                   /* their text, NUL-terminated, never NULL on success */
    uint32_t n_generated;         /* as the daemon counted */
    /* "length" | "stop" | "eos", or "cancelled": a CANCEL from another connection
     * (snapkv_cancel) or the daemon shutting down ended it; or "limit": the tenant's
     * max-bytes-per-tenant or the pool had no room for another token (a decode none of whose
     * tokens went in is an error, SNAPKV_E_LIMIT / SNAPKV_E_POOL_FULL); or "error": the daemon
     * failed a later token (out of memory, the device), snapkv_last_error() says how. With
     * "cancelled", "limit" and "error" the call still succeeds with the tokens made so far and
     * their text, all of them in the session; without a result (out NULL, the tokens seen by
     * on_tokens) "error" is SNAPKV_E_IO instead, with the same snapkv_last_error() */
    char finish_reason[16];
};
/* Generates tokens in a session. sampling NULL: snapkv_sampling_defaults(). With on_tokens the
 * daemon streams and on_tokens sees each batch as it comes; without, one reply carries all.
 * out may be NULL when on_tokens is given; free it with snapkv_decode_result_free(). */
SNAPKV_API int snapkv_decode(snapkv_client_t *client, const struct snapkv_session_id *id,
                             const struct snapkv_sampling *sampling, snapkv_token_fn on_tokens,
                             void *user, struct snapkv_decode_result *out);
SNAPKV_API void snapkv_decode_result_free(struct snapkv_decode_result *r);

/* Log-probabilities of a decode's tokens under the model's next-token distribution (the
 * log-softmax of the logits, before temperature, top_k and top_p), one per generated token, and
 * with n_top > 0 each step's n_top most likely tokens and theirs, most likely first (equal ones
 * by id). */
struct snapkv_logprobs {
    float *logprobs;              /* [n] */
    size_t n;                     /* the decode's n_tokens */
    uint32_t n_top;               /* top_logprobs asked for (fewer only with a smaller vocabulary) */
    uint32_t *top_tokens;         /* [n][n_top]; NULL when n * n_top is 0 */
    float *top_logprobs;          /* [n][n_top] */
};
/* snapkv_decode that also gives the tokens' log-probabilities (logprobs, non-NULL; written on
 * success, also when streamed: the callback gets tokens and text as before) and, with
 * top_logprobs > 0 (at most 20: SNAPKV_E_LIMIT above), each step's most likely tokens. Free it
 * with snapkv_logprobs_free(). */
SNAPKV_API int snapkv_decode_logprobs(snapkv_client_t *client, const struct snapkv_session_id *id,
                                      const struct snapkv_sampling *sampling, uint32_t top_logprobs,
                                      snapkv_token_fn on_tokens, void *user, struct snapkv_decode_result *out,
                                      struct snapkv_logprobs *logprobs);
SNAPKV_API void snapkv_logprobs_free(struct snapkv_logprobs *lp);

/* More of what picks a decode's tokens, apart from struct snapkv_sampling so that programs built
 * with an older snapkv.h keep working. Applied to the logits before each token (greedy too), in
 * this order (transformers' generate, with OpenAI's and vLLM's frequency and presence
 * penalties):
 * 1. logit bias: bias[i] is added to the logit of token bias_tokens[i] (at most 1024 distinct
 *    tokens, each bias in [-100, 100]; -100 all but bans a token);
 * 2. repetition penalty (0 or 1: off; else 0.01 to 100, as transformers'
 *    RepetitionPenaltyLogitsProcessor): the logit of each token the session holds (its prompt,
 *    appends and generated tokens, an imported session's from the import on; or only the last
 *    repetition_last_n of them; 0: all) is divided by it when positive and multiplied by it when
 *    negative; 1.1 to 1.3 are usual;
 * 3. frequency_penalty and presence_penalty (each in [-2, 2]): over this decode's tokens, a
 *    token's logit loses frequency_penalty for each time it came and presence_penalty once it
 *    came;
 * then, when sampling (temperature > 0), temperature, top_k, top_p and min_p ([0, 1], 0: off;
 * as transformers' MinPLogitsWarper: of the tokens top_k and top_p leave, those less likely than
 * min_p times the likeliest go). The log-probabilities snapkv_decode_ext gives are the model's,
 * before all of these. The daemon checks the ranges (SNAPKV_E_INVAL with a message); a daemon
 * older than these fields would ignore them, so with any of them on snapkv_decode_ext refuses
 * to send to one (SNAPKV_E_UNSUPPORTED). */
struct snapkv_sampling_ext {
    float min_p;
    float repetition_penalty;
    uint32_t repetition_last_n;
    float frequency_penalty;
    float presence_penalty;
    const uint32_t *bias_tokens;  /* [n_bias] */
    const float *bias;            /* [n_bias] */
    size_t n_bias;
    uint64_t reserved[6];         /* zero (snapkv_sampling_ext_defaults): room for later fields
                                     without another struct; non-zero is SNAPKV_E_INVAL */
};
/* All off (zero): what a NULL ext means. */
SNAPKV_API void snapkv_sampling_ext_defaults(struct snapkv_sampling_ext *ext);
/* snapkv_decode_logprobs with ext (NULL: none of it); logprobs may be NULL (then top_logprobs
 * must be 0). More than 1024 biases: SNAPKV_E_LIMIT; a bias token outside the vocabulary:
 * SNAPKV_E_INVAL. */
SNAPKV_API int snapkv_decode_ext(snapkv_client_t *client, const struct snapkv_session_id *id,
                                 const struct snapkv_sampling *sampling, const struct snapkv_sampling_ext *ext,
                                 uint32_t top_logprobs, snapkv_token_fn on_tokens, void *user,
                                 struct snapkv_decode_result *out, struct snapkv_logprobs *logprobs);

/* The token ids the daemon runs for a text, without running them (budgets, prompts sent as ids,
 * logit biases): as a PREFILL's text (BOS as the model asks; chat: one user turn of the chat
 * template) or, with append, as an APPEND's (no BOS; chat: the text's chat markup parsed). The
 * limits of a PREFILL's text apply (max-prompt-tokens: SNAPKV_E_LIMIT). out->tokens is malloc'd:
 * free it with snapkv_tokens_free(). Unlike other calls it writes *out on failure too: zeroed,
 * so that snapkv_tokens_free() is safe whatever the call returned. A daemon older than the command (its HELLO does not list
 * "tokenize"): SNAPKV_E_UNSUPPORTED. */
struct snapkv_tokenize_opts {
    bool chat;
    bool append;
    uint32_t reserved[7];         /* zero: room for later fields; non-zero is SNAPKV_E_INVAL */
};
struct snapkv_tokens {
    uint32_t *tokens;
    size_t n_tokens;
};
SNAPKV_API int snapkv_tokenize(snapkv_client_t *client, const char *text, const struct snapkv_tokenize_opts *opts,
                               struct snapkv_tokens *out);
SNAPKV_API void snapkv_tokens_free(struct snapkv_tokens *t);
/* The text of n token ids (each in the vocabulary; at most max_prompt_tokens + max_new_tokens of
 * them: SNAPKV_E_LIMIT): each token's bytes (none for ids the tokenizer does not know), control
 * tokens (<|im_end|>) as their own text unless skip_special, each ill-formed UTF-8 part and each
 * NUL as U+FFFD. *text is malloc'd (free()), NUL-terminated. */
SNAPKV_API int snapkv_detokenize(snapkv_client_t *client, const uint32_t *tokens, size_t n, bool skip_special,
                                 char **text);

struct snapkv_compress_result {
    uint64_t bytes_before, bytes_after;
    size_t n_layers;
    struct snapkv_layer_kept *layers;
};
/* Re-compresses a session with `spec`: its last `window` tokens (the spec's), or with
 * window_from every token from there on, come off the cache and run again under the new spec;
 * the last `window` of them are the observation window (a question longer than `window` needs
 * a window as long to observe whole); 0: the last `window` tokens. out may be
 * NULL; free it with snapkv_compress_result_free(). When it fails (the pool is full, the
 * client's timeout passed while it ran) the session is as it was, under its old spec. */
SNAPKV_API int snapkv_compress(snapkv_client_t *client, const struct snapkv_session_id *id, const char *spec,
                               uint32_t window_from, struct snapkv_compress_result *out);
SNAPKV_API void snapkv_compress_result_free(struct snapkv_compress_result *r);

/* A copy-on-write copy of a session. shared_bytes may be NULL. */
SNAPKV_API int snapkv_fork(snapkv_client_t *client, const struct snapkv_session_id *id,
                           struct snapkv_session_id *out, uint64_t *shared_bytes);

/* Frees a session now. One that returns SNAPKV_E_TIMEOUT still frees it when its turn comes in
 * the daemon's queue. */
SNAPKV_API int snapkv_release(snapkv_client_t *client, const struct snapkv_session_id *id);

/* Ends the session's running DECODE between two tokens, e.g. from another thread's connection
 * while the decoding one waits (a connection of the same tenant, or an admin one: any
 * session). That decode's caller gets its tokens so far with finish_reason "cancelled"; the
 * session keeps them and takes the next command at once. A CANCEL still queued when its
 * deadline (this connection's timeout) passed runs all the same, but then ends only a decode
 * this same connection started. *cancelled (may be NULL): whether a decode was running (and
 * was ended); *n_generated (may be NULL): the tokens it had made. */
SNAPKV_API int snapkv_cancel(snapkv_client_t *client, const struct snapkv_session_id *id, bool *cancelled,
                             uint32_t *n_generated);

/* ---- tensor exchange through POSIX shared memory ---------------------------------------------
 * The daemon opens the object by name (O_RDWR) and writes (export) or reads (import) K/V at an
 * offset; the client reads or writes the same bytes through its mapping. snapkv_shm_create
 * lets only the caller and the daemon's user open the object: when user "snapkv" exists
 * (production: the service's User; the environment's SNAPKV_DAEMON_USER names another, and
 * SNAPKV_E_INVAL when it names no user), mode 0600 and, when that user is not the caller, a
 * POSIX ACL entry giving it read and write (`ls -l` shows rw-rw----+: the group bits are the
 * ACL's mask; the group itself has none), so other clients, of the daemon's group too, cannot
 * open it. Without that user, or on a file system without
 * ACLs, the object is mode 0660 (whatever the umask) and must belong to a group the daemon is
 * in: it gets group "snapkv" when that group exists and the caller is root or a member of it
 * (a supplementary group is enough); otherwise it keeps the caller's effective group, and the
 * daemon refuses it (SNAPKV_E_PERM) unless that group is the daemon's: join group snapkv, or
 * run the client with it as primary group (`sg snapkv -c CMD`), or fchown(shm.fd, -1, gid).
 * The daemon opens only objects owned by the connection's own user (an ipc:// endpoint tells it
 * that user; over tcp:// no object can be named): another user's is SNAPKV_E_PERM. */
struct snapkv_shm {
    char name[64];                /* "/snapkv-<hint>-<pid>-<random>" */
    void *addr;                   /* mapping of the whole object, read/write */
    size_t size;
    int fd;
};
/* Creates (O_EXCL), sizes and maps a new object. name_hint: a few [A-Za-z0-9_-] characters
 * for the name (others are replaced; NULL: "buf"). Pair with snapkv_shm_destroy(). Its memory
 * is taken at once (posix_fallocate): more than /dev/shm has room for is SNAPKV_E_LIMIT here,
 * not a SIGBUS at the first write past the room. */
SNAPKV_API int snapkv_shm_create(const char *name_hint, size_t size, struct snapkv_shm *out);
/* Unmaps, closes and unlinks; accepts NULL and a zeroed or already destroyed struct. */
SNAPKV_API void snapkv_shm_destroy(struct snapkv_shm *shm);

/* What an export wrote. Layout in the buffer from the offset: for each exported layer in order,
 * K then V, each [n_kv_heads][kept][head_dim] float32 (kept: the layer's max over heads; a head
 * with fewer entries is padded; kept_per_head says each head's real length). */
struct snapkv_kv_layout {
    uint64_t bytes_written;
    size_t n_layers;
    struct snapkv_layer_kept *layers;
    size_t n_positions;           /* original positions, per layer per head, concatenated */
    uint32_t *positions;
    uint32_t original_length;     /* the session's length (its next position): what an import gives back */
};
SNAPKV_API void snapkv_kv_layout_free(struct snapkv_kv_layout *l);

/* Bytes the export layout takes for `n` layers (2 * n_kv_heads * kept * head_dim * 4 each),
 * e.g. from snapkv_admin_inspect() to size a buffer. */
SNAPKV_API uint64_t snapkv_kv_bytes(const struct snapkv_layer_kept *layers, size_t n, uint32_t n_kv_heads,
                                    uint32_t head_dim);
/* Byte offset, from the start of the exported data, of layer index `i` (index into the layout,
 * not the model layer number) head `head`'s K (v = false) or V (v = true) rows. The indices
 * must be in range, and the result does not say when they are not: for i at or past
 * l->n_layers (or a NULL l) it is 0, the offset of the first layer's head 0 K rows; head is not
 * checked, and one at or past n_kv_heads gives another head's (or layer's) offset. n_kv_heads
 * and head_dim must be the model's (snapkv_server_info). */
SNAPKV_API uint64_t snapkv_kv_offset(const struct snapkv_kv_layout *l, size_t i, uint32_t head, bool v,
                                     uint32_t n_kv_heads, uint32_t head_dim);

/* Copies all layers of a session's K/V into shm at `offset`. Free *out with
 * snapkv_kv_layout_free(). A buffer too small for the session is an error from the daemon. A
 * reply whose layout snapkv_kv_offset() would read past what was written with (not the model's
 * heads, a layer's kept not the most of its heads', more bytes than written, a size past 64
 * bits) is SNAPKV_E_PROTO; so is, at connect, a HELLO whose model shape no model has (more than
 * 4096 layers or KV heads, 65536 heads or a head size past 65536, 2^24 tokens). */
SNAPKV_API int snapkv_export_kv(snapkv_client_t *client, const struct snapkv_session_id *id,
                                const struct snapkv_shm *shm, uint64_t offset, struct snapkv_kv_layout *out);
/* The same for layers [layer_first, layer_first + layer_count) (layer_count 0: to the end). */
SNAPKV_API int snapkv_export_kv_layers(snapkv_client_t *client, const struct snapkv_session_id *id,
                                       const struct snapkv_shm *shm, uint64_t offset, uint32_t layer_first,
                                       uint32_t layer_count, struct snapkv_kv_layout *out);

/* A CUDA buffer for EXPORT_KV / IMPORT_KV on a daemon that runs on a GPU: the bytes
 * cudaIpcGetMemHandle() gave for a cudaMalloc'd buffer of `size` bytes (libsnapkv does not link
 * CUDA; copy the cudaIpcMemHandle_t into `handle`). The daemon keeps a handle it opened open
 * for the client's next transfers, and closes it when the client's connection closes, when the
 * client has been idle for a lease, when the daemon stops, or when more handles are open (8 a
 * client, 256 in all: the least recently used closes, to be opened again on its next use);
 * keep the buffer allocated while the client is connected. A daemon on the CPU answers
 * SNAPKV_E_UNSUPPORTED. */
#define SNAPKV_CUDA_IPC_HANDLE_BYTES 64
struct snapkv_cuda_ipc_buffer {
    unsigned char handle[SNAPKV_CUDA_IPC_HANDLE_BYTES];
    uint64_t size;
};
/* snapkv_export_kv_layers() into a CUDA buffer (device memory in the export layout). */
SNAPKV_API int snapkv_export_kv_cuda(snapkv_client_t *client, const struct snapkv_session_id *id,
                                     const struct snapkv_cuda_ipc_buffer *buf, uint64_t offset, uint32_t layer_first,
                                     uint32_t layer_count, struct snapkv_kv_layout *out);

struct snapkv_import_opts {
    const struct snapkv_shm *shm; /* K/V in the export layout (or in `cuda`, last field) ... */
    uint64_t offset;              /* ... from here */
    const struct snapkv_layer_kept *layers;  /* per layer kept lengths (e.g. an export's) */
    size_t n_layers;
    const uint32_t *positions;    /* per layer per head, concatenated */
    size_t n_positions;
    const uint32_t *tokens;       /* token history (inspection, re-compression); may be empty */
    size_t n_tokens;
    uint32_t original_length;     /* next position; 0: n_tokens */
    const struct snapkv_cuda_ipc_buffer *cuda; /* instead of shm, on a GPU daemon */
};
/* Creates a session from K/V in a buffer, for this client's tenant, with the daemon's default
 * lease. An import carries only the rows, their positions, the length and the tokens given:
 * - No next-token logits: a DECODE right after it fails with SNAPKV_E_INVAL ("the session has no
 *   next-token logits ... APPEND the next token first"); APPEND the next token first.
 * - No compression policy: the session's spec is "policy=full" whatever the exported session's
 *   was (INSPECT shows it). The imported rows stay as they are, later ones are all kept, and a
 *   COMPRESS sets a policy.
 * - Without tokens (fewer than original_length) the session does not know its token history,
 *   and a later COMPRESS fails with SNAPKV_E_INVAL ("the session knows N of its M tokens").
 *   No call returns a session's token ids (a text PREFILL or APPEND is tokenized by the daemon,
 *   and an export has none): to import a session with its tokens, prefill and append token ids
 *   the program keeps, and add the tokens its decodes returned. */
SNAPKV_API int snapkv_import_kv(snapkv_client_t *client, const struct snapkv_import_opts *opts,
                                struct snapkv_session_id *out);

/* ---- admin (a client connected to the admin endpoint) ----------------------------------------- */

struct snapkv_status_info {
    char server_version[32];
    char model_name[128];
    char backend[16];
    uint64_t uptime_seconds;
    uint32_t n_sessions, n_clients, queue_depth, threads;
    uint64_t pool_bytes_total, pool_bytes_used; /* used: unique blocks x block bytes */
    uint64_t pool_blocks_used, pool_blocks_shared; /* shared: held by more than one session */
    uint32_t pool_block_rows;     /* tokens of one KV head of one layer per block */
    uint64_t pool_block_bytes;
};
SNAPKV_API int snapkv_admin_status(snapkv_client_t *client, struct snapkv_status_info *out);

/* CONFIG GET. key NULL or "": all options. Calls fn once per entry. */
typedef void (*snapkv_config_fn)(void *user, const char *key, const char *value, const char *help);
SNAPKV_API int snapkv_admin_config_get(snapkv_client_t *client, const char *key, snapkv_config_fn fn,
                                       void *user);

/* One session as LIST and INSPECT show it (strings truncated to fit). */
struct snapkv_session_info {
    struct snapkv_session_id id;
    char tenant[128];
    char owner[128];
    char policy[64];              /* its spec, the keys that differ from the defaults ("policy=snapkv,
                                   * ratio=0.1"); the whole canonical one is snapkv_inspect_result's spec */
    uint32_t n_tokens;            /* original length */
    uint32_t kept_tokens;         /* sum over layers of max kept */
    uint64_t bytes;               /* KV blocks held x block bytes, shared ones included */
    uint64_t shared_bytes;        /* of bytes, those shared copy-on-write with other sessions */
    uint64_t created_unix_ms, last_used_unix_ms;
    uint32_t lease_seconds;
    bool pinned;
};
struct snapkv_session_list {
    size_t n;
    struct snapkv_session_info *sessions;
};
/* Sessions of `tenant` (NULL or "": all). Free with snapkv_session_list_free(). */
SNAPKV_API int snapkv_admin_list(snapkv_client_t *client, const char *tenant, struct snapkv_session_list *out);
SNAPKV_API void snapkv_session_list_free(struct snapkv_session_list *l);
/* Session i's spec whole (its policy field holds 63 bytes of it: a long spec is cut there), in
 * the short form (the keys that differ from the defaults); "" for a full cache. l must come
 * from snapkv_admin_list(); NULL when i is not below l->n. Freed with the list (17:0:13). */
SNAPKV_API const char *snapkv_session_list_spec(const struct snapkv_session_list *l, size_t i);

/* Rows the daemon keeps for prefix reuse (prefix-retain-bytes): not sessions; their ids are the
 * KV events' kept_prefix ids, and snapkv_admin_evict() takes one (12:0:8). */
struct snapkv_kept_prefix {
    struct snapkv_session_id id;
    char tenant[128];
    uint32_t n_tokens;            /* the prompt tokens whose rows it holds */
    uint64_t bytes;               /* KV blocks it holds x block bytes */
    uint64_t alone_bytes;         /* of bytes, those no session shares: what the tenant's quota counts */
    uint64_t last_used_unix_ms;   /* kept, or last taken by a PREFILL */
};
struct snapkv_kept_list {
    size_t n;
    struct snapkv_kept_prefix *kept;
};
/* The kept prefixes of `tenant` (NULL or "": all), most recently kept first. Free with
 * snapkv_kept_list_free(). */
SNAPKV_API int snapkv_admin_list_kept(snapkv_client_t *client, const char *tenant, struct snapkv_kept_list *out);
SNAPKV_API void snapkv_kept_list_free(struct snapkv_kept_list *l);

struct snapkv_inspect_result {
    struct snapkv_session_info info;
    char *spec;                   /* the compression spec in force ("" when none) */
    size_t n_layers;
    struct snapkv_layer_kept *layers;
    size_t n_positions;           /* with_positions: per layer per head, concatenated */
    uint32_t *positions;
    size_t n_layer_similarity;    /* SqueezeAttention cosine per layer, when measured */
    float *layer_similarity;
};
SNAPKV_API int snapkv_admin_inspect(snapkv_client_t *client, const struct snapkv_session_id *id,
                                    bool with_positions, struct snapkv_inspect_result *out);
SNAPKV_API void snapkv_inspect_result_free(struct snapkv_inspect_result *r);

/* Evicts exactly one of: the session `id` (pinned or not; SNAPKV_E_BUSY while it decodes; or the
 * kept prefix of that id, snapkv_admin_list_kept), every
 * unpinned session of `tenant`, or (all_unpinned) every unpinned session (these two skip sessions
 * that are decoding). With a store, what it holds goes too, counted in evicted (not in
 * bytes_freed, the pool's bytes): the session `id`, or `tenant`'s unpinned sessions, whichever
 * daemon spilled them (the store is walked with SCAN); for all_unpinned, the sessions this
 * daemon spilled since it started. When the store cannot be reached the call fails
 * (SNAPKV_E_IO) after the daemon's own sessions went, and snapkv_last_error() says what went.
 * When the store's user may not SCAN (its ACL; or GETRANGE, a tenant's), the entries this daemon
 * spilled since it started go, an id's EVICT of one of them succeeds, and the others fail
 * (SNAPKV_E_IO) saying so.
 * evicted and bytes_freed may be NULL. */
SNAPKV_API int snapkv_admin_evict(snapkv_client_t *client, const struct snapkv_session_id *id,
                                  const char *tenant, bool all_unpinned, uint32_t *evicted,
                                  uint64_t *bytes_freed);

/* A pinned session outlives its lease and is not evicted for room, nor by an EVICT of its tenant
 * or of all unpinned sessions; an EVICT that names it by id evicts it all the same. */
SNAPKV_API int snapkv_admin_pin(snapkv_client_t *client, const struct snapkv_session_id *id);
SNAPKV_API int snapkv_admin_unpin(snapkv_client_t *client, const struct snapkv_session_id *id);

/* Saves a session under the daemon's state directory (<state-dir>/NAME.skv). name:
 * [A-Za-z0-9._-]{1,64}, not starting with '.'. bytes (file size) may be NULL. */
SNAPKV_API int snapkv_admin_save(snapkv_client_t *client, const struct snapkv_session_id *id, const char *name,
                                 uint64_t *bytes);
/* Loads a saved session as a new one: a new id, for `tenant` (NULL or "": "default"), with the
 * daemon's default lease and unpinned (a save keeps none of these). It goes on under the spec
 * it was saved with (the compressor's state, the rows' scores and the next-token logits come
 * back), so DECODE goes on from where the saved session stood. A session saved in an older
 * format has no logits (versions 1 and 2: APPEND the next token before DECODE), and one of
 * version 1 no compressor state either (it goes on uncompressed). */
SNAPKV_API int snapkv_admin_load(snapkv_client_t *client, const char *name, const char *tenant,
                                 struct snapkv_session_id *out);

struct snapkv_stat {
    char *name;
    double value;
    char *help;
};
struct snapkv_stats {
    size_t n;
    struct snapkv_stat *stats;
    char *prometheus_text;        /* when asked for ("" otherwise) */
};
/* Counters and gauges; prometheus: also (or, as the daemon chooses, only) the Prometheus text
 * exposition. Free with snapkv_stats_free(). */
SNAPKV_API int snapkv_admin_stats(snapkv_client_t *client, bool prometheus, struct snapkv_stats *out);
SNAPKV_API void snapkv_stats_free(struct snapkv_stats *s);

/* KV events: a subscriber to a daemon's events-endpoint (an ipc:// PUB socket, docs/SCALING.md),
 * which announces each session stored (PREFILL, FORK, IMPORT_KV, LOAD, a restore at start),
 * stored again when it changes (APPEND, COMPRESS, a DECODE's end: the same id, whose new event
 * replaces the last), removed (RELEASE, EVICT, eviction, lease expiry), and AllCleared when the
 * daemon starts. A subscriber that reads too slowly loses events: the sequence numbers then
 * jump. An idle daemon sends a heartbeat every 2 s (its events-heartbeat-seconds), which the
 * library reads and does not return (it carries the daemon's boot id: see CLEARED of sequence 0
 * below). Not thread-safe, like a client. */
typedef struct snapkv_events snapkv_events_t;
enum snapkv_event_kind { SNAPKV_EVENT_STORED = 1, SNAPKV_EVENT_REMOVED = 2, SNAPKV_EVENT_CLEARED = 3 };
struct snapkv_event {
    enum snapkv_event_kind kind;
    uint64_t sequence;            /* +1 per event since the daemon started */
    double ts;                    /* seconds since the epoch */
    struct snapkv_session_id id;  /* stored, removed */
    char tenant[128];
    uint32_t n_tokens;            /* stored: the session's length */
    uint64_t bytes;               /* stored: KV bytes it holds */
    bool compressed;              /* stored: rows kept by a compression policy */
    bool kept_prefix;             /* stored: not a session but rows kept for prefix reuse
                                     (prefix-retain-bytes), under an id no request takes (11:0:7) */
    uint32_t block_size;          /* stored: tokens per hashed block */
    size_t n_block_hashes;        /* chained hashes of the token history's whole blocks */
    uint64_t *block_hashes;       /* owned by the event: snapkv_event_free() */
};
/* Subscribes to endpoint (a subscription reaches the daemon a moment after this returns: events
 * published meanwhile are not seen). ZeroMQ connects in the background, so this returns SNAPKV_OK
 * for an endpoint where nothing listens (a wrong path, a daemon without events-endpoint): that
 * shows only as SNAPKV_E_TIMEOUT from snapkv_events_next(), the same as for a daemon with nothing
 * to announce. Only an endpoint ZeroMQ refuses (malformed, unknown transport) fails here, with
 * SNAPKV_E_IO. */
SNAPKV_API int snapkv_events_open(const char *endpoint, snapkv_events_t **out);
/* The next event, waiting up to timeout_ms (-1: for ever); SNAPKV_E_TIMEOUT when none came,
 * SNAPKV_E_PROTO for a message that is not one. Free *out with snapkv_event_free().
 * A CLEARED of sequence 0 is the library's own: the daemon restarted (its events carry another
 * boot id) and this subscriber missed what the new daemon published before the subscription
 * reached it (its AllCleared, a restore's sessions): what was held is gone, and a replay
 * catches up. The new daemon's numbers start again at 1. It comes within about 2 s of the new
 * daemon's start (its first heartbeat), also while no session changes (6:4:2); with
 * events-heartbeat-seconds = 0, with its first event. */
SNAPKV_API int snapkv_events_next(snapkv_events_t *ev, int timeout_ms, struct snapkv_event *out);
SNAPKV_API void snapkv_event_free(struct snapkv_event *e);
/* Catches up from the daemon's events-replay-endpoint (ipc://): asks it for every session its
 * events announced and did not remove, and the sequence number S of the last event published
 * before; the next events snapkv_events_next() returns are then an AllCleared and one stored
 * event per session, all with sequence S, and after them the stream's events above S only. So
 * a subscriber that started late, or saw a gap in the sequence numbers, ends up holding what one
 * that missed nothing holds. Call it after snapkv_events_open(): the first stream event after a
 * replay should be S + 1, and one above it is a gap again (the subscription reached the daemon
 * after the snapshot): replay once more. Stream events queued when the snapshot came are
 * dropped (they are the snapshot's, or an earlier daemon's: one of another boot id that came
 * before any of the snapshot's daemon and was published before the snapshot was taken); an event
 * of a daemon started since (another boot id after one of the snapshot's daemon, or published
 * after the snapshot: its numbers start again at 1) ends the dropping. Waits up to timeout_ms (-1:
 * for ever) for the whole snapshot; SNAPKV_E_TIMEOUT, or the daemon's status for a refused
 * request. The daemon queues the parts of the largest snapshot its pool allows; one is cut only
 * when its requester is gone. */
SNAPKV_API int snapkv_events_replay(snapkv_events_t *ev, const char *replay_endpoint, int timeout_ms);
/* The number of the newest event the daemon had published, as the stream messages this
 * subscriber read last said (an event's own number, or a heartbeat's: the daemon's last event),
 * or a replay's snapshot; 0 before any. Events are lost without a later one to show it when the
 * stream goes quiet after the loss; the daemon's heartbeat (every events-heartbeat-seconds, 2 s by
 * default, while no event goes out) still says how far it got. So after snapkv_events_next()
 * returned SNAPKV_E_TIMEOUT (which read every message that had come), a value above the
 * sequence of the last event taken means events were missed: replay (snapkv_events_replay).
 * It also is above 0 when the subscription came after events were published and no event was
 * taken yet. After a CLEARED of sequence 0 (another daemon) it is that daemon's number. */
SNAPKV_API uint64_t snapkv_events_published(const snapkv_events_t *ev);
/* Milliseconds since the stream last brought a message (an event, or the heartbeat the daemon
 * sends every events-heartbeat-seconds while it has none), as the snapkv_events_next() calls
 * so far read it; since snapkv_events_open() when none came. A stream quiet much longer than
 * the heartbeat's interval comes from no daemon: it is down, or the endpoint is not its
 * events-endpoint (or its heartbeat is off: events-heartbeat-seconds 0). 0 for NULL. */
SNAPKV_API uint64_t snapkv_events_quiet_ms(const snapkv_events_t *ev);
/* Accepts NULL and *ev == NULL; sets *ev to NULL. */
SNAPKV_API void snapkv_events_close(snapkv_events_t **ev);
/* A session's block hashes as its stored event carried them (through INSPECT on the admin
 * endpoint): how a subscriber that missed events rebuilds its view. *hashes: n values, free()
 * them (NULL when n is 0). */
SNAPKV_API int snapkv_admin_session_hashes(snapkv_client_t *client, const struct snapkv_session_id *id,
                                           uint32_t *block_size, uint64_t **hashes, size_t *n);

#ifdef __cplusplus
}
#endif
#endif
