/* snapkvd's socket loop: one ROUTER for clients and one for admins, polled together.
 * Each request frame is decoded, checked (version, size, which socket may send it) and
 * dispatched; every request gets exactly one final reply with a status and message. A monitor
 * of the client ROUTER's connections tells the worker when a client goes away. */
#include "build-config.h"

#include "daemon/server.h"
#include "daemon/auth.h"
#include "daemon/clients.h"
#include "daemon/events_replay.h"
#include "daemon/metrics_http.h"
#include "daemon/proto_text.h"
#include "daemon/replies.h"
#include "daemon/session.h"
#include "daemon/worker.h"
#include "common/log.h"
#include "common/status.h"
#include "daemon/engine/kv_pool.h"
#include "daemon/engine/model.h"
#include "daemon/engine/tokenizer.h"
#include "kernels/backend.h"
#include "proto/snapkv.pb-c.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#define PROTOCOL_VERSION 1
#define RCVHWM 4                  /* requests libzmq reads ahead on one connection */
#define HANDSHAKE_MS 10000        /* ZMQ_HANDSHAKE_IVL of the client and admin endpoints */
#define TCP_HEARTBEAT_IVL_MS 5000      /* ZMTP pings on tcp:// client and admin connections ... */
#define TCP_HEARTBEAT_TIMEOUT_MS 15000 /* ... and the silence that closes one */
#define SMALL_REQUEST_MAX 65536   /* bytes of a request other than PREFILL, APPEND, IMPORT_KV, TOKENIZE,
                                     DETOKENIZE */

/* What the socket thread knows of a client connection, by its fd. */
struct conn_fd {
    uint64_t peer;                /* its peer's key (peer_key), 0: none known or no longer counted */
    uint8_t open;                 /* ACCEPTED seen, DISCONNECTED not yet */
    uint8_t closing;              /* shut down here (no longer counted), its DISCONNECTED not seen yet */
    uint8_t refused;              /* shut down here for a limit: what it sent is dropped, also after its
                                   * DISCONNECTED, until a connection is accepted on the fd again */
    uint64_t serial;              /* the connection's number (ACCEPTED's order; never 0): a reply goes
                                   * only over the connection its request came over (reply_out) */
};

/* A peer (a user on ipc://, an address on tcp://) and its open client connections. */
struct peer_conns {
    uint64_t key;
    int n;
};

struct skv_server {
    struct skv_server_env env;
    void *zctx;
    struct skv_auth *auth;        /* CURVE policy and the ZAP handler */
    void *client_sock;
    void *admin_sock;
    void *connections;            /* PAIR: client_sock's monitor (ACCEPTED, DISCONNECTED, CURVE handshakes) */
    struct skv_clients *clients;  /* client routing id -> connection, for client-gone notices */
    int open_connections;         /* on the client endpoint: ACCEPTED less DISCONNECTED */
    int max_connections;          /* max-connections, lowered to what the open-file limit allows */
    uint64_t refused_connections; /* closed as they came, over max_connections, since last logged */
    uint64_t refused_peer;        /* closed as they came, over max_per_peer, since last logged */
    uint64_t refused_requests;    /* requests of such connections libzmq had read, dropped, since last logged */
    uint64_t conn_serials;        /* connections accepted on the client endpoint (conn_fd.serial) */
    uint64_t refused_logged_ms;
    struct conn_fd *fds;          /* [fds_cap] by connection fd */
    int fds_cap;
    struct peer_conns *peers;     /* [n_peers] peers with connections open, and how many */
    int n_peers, peers_cap;
    int max_per_peer;             /* max-connections-per-peer */
    uint16_t client_port;         /* a tcp:// client endpoint's port (0: ipc://) */
    uint16_t admin_port;          /* the same of the admin endpoint */
    void *admin_connections;      /* PAIR: admin_sock's monitor (ACCEPTED, DISCONNECTED) */
    uint8_t *admin_fds;           /* [admin_fds_cap] by fd: open on the admin endpoint */
    int admin_fds_cap;
    int admin_open;               /* admin connections open: ACCEPTED less DISCONNECTED */
    uint64_t admin_refused;       /* closed as they came, over ADMIN_CONNECTIONS_MAX, since last logged */
    uint64_t admin_refused_logged_ms;
    uint64_t clients_expired_ms;
    int lock_fds[4];              /* flock()ed next to ipc sockets: one daemon per endpoint */
    char *ipc_paths[4];           /* unlinked at exit (client, admin, events, events replay) */
    void *events;                 /* PUB: KV events (events-endpoint), or NULL */
    void *replay;                 /* ROUTER: KV events replay (events-replay-endpoint), or NULL */
    struct skv_events_mirror *mirror; /* what the events announced and did not remove, with replay */
    uint64_t events_seq;          /* the last event's sequence number */
    uint64_t events_sent_ms;      /* when the last event or heartbeat went out */
    char events_topic[32];        /* "snapkv.kv." + the model fingerprint's first 16 hex digits */
    void *replies;                /* inproc PULL: replies from the engine worker */
    struct skv_replies *unread;   /* replies sent and not taken yet, bounded in bytes */
    uint64_t unread_dropped_logged; /* replies dropped for those bounds, when last logged */
    uint64_t unread_logged_ms;
    struct skv_worker *worker;
    bool worker_done;             /* its last message (SKV_WORKER_DONE_SOCK) was read: at a stop */
    struct skv_metrics_http *metrics;  /* NULL unless metrics-listen is set */
    time_t started;
    uint64_t n_requests;
};

#define REPLY_ENDPOINT "inproc://snapkvd-replies"
#define CONNECTIONS_ENDPOINT "inproc://snapkvd-client-connections"
#define ADMIN_CONNECTIONS_ENDPOINT "inproc://snapkvd-admin-connections"
/* Connections the admin endpoint keeps open at most (operators' tools need a few); more are
 * closed as they come. They fit in the descriptors FD_RESERVE keeps besides max-connections:
 * before, a tcp:// admin endpoint took any number, and a flood of bare connects (no key needed
 * to hold one through its 10 s handshake) ran the daemon out of descriptors, where libzmq aborts
 * on the client endpoint's next accept. */
#define ADMIN_CONNECTIONS_MAX 64
#define CLIENTS_MAX 4096          /* client routing ids remembered for disconnect notices */

/* For ipc:// endpoints: hold an exclusive lock on "<path>.lock"; a second daemon fails here
 * instead of silently stealing the socket file. */
static int lock_endpoint(struct skv_server *srv, int idx, const char *endpoint)
{
    srv->lock_fds[idx] = -1;
    if (strncmp(endpoint, "ipc://", 6) != 0)
        return SKV_OK;
    const char *path = endpoint + 6;
    if (*path == '@') /* Linux's abstract names: any local user may connect */
        return skv_errorf(SKV_E_INVAL, "endpoint %s: an abstract ipc://@ name has no file mode to keep other users "
                          "out: give a path", endpoint);
    char lock_path[4096];
    if (snprintf(lock_path, sizeof lock_path, "%s.lock", path) >= (int)sizeof lock_path)
        return skv_errorf(SKV_E_INVAL, "endpoint path too long: %s", path);
    int fd = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0 && errno == ENOENT)
        return skv_errorf(SKV_E_IO, "endpoint %s: its directory is not there (%s: %s; under systemd the unit's "
                          "RuntimeDirectory= makes /run/snapkvd)", endpoint, lock_path, strerror(errno));
    if (fd < 0)
        return skv_errorf(SKV_E_IO, "endpoint %s: %s: %s", endpoint, lock_path, strerror(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
        close(fd);
        return skv_errorf(SKV_E_EXISTS, "another snapkvd already serves %s", endpoint);
    }
    srv->lock_fds[idx] = fd;
    srv->ipc_paths[idx] = strdup(path);
    unlink(path); /* a stale socket file from a crashed daemon */
    return SKV_OK;
}

/* Binds sock to endpoint; an ipc:// socket file is made 0600 from the start (a umask around
 * the bind) and then given `mode`. Made with the service's umask and loosened after, the admin
 * socket was open to the clients' group between the two, and a connection made then stays. */
static int bind_ipc_mode(struct skv_server *srv, int idx, void *sock, const char *endpoint, mode_t mode)
{
    mode_t old = umask(0177);
    int rc = zmq_bind(sock, endpoint);
    int err = zmq_errno();
    umask(old);
    if (rc < 0) {
        errno = err;
        return -1;
    }
    if (srv->ipc_paths[idx] && mode != 0600 && chmod(srv->ipc_paths[idx], mode) < 0) {
        err = errno;
        zmq_unbind(sock, endpoint);
        errno = err;
        return -1;
    }
    return 0;
}

/* Monitors endpoint idx's ROUTER's connections (before it binds, so no connection is missed)
 * into a PAIR (srv->connections, read_connections; srv->admin_connections,
 * read_admin_connections): ACCEPTED and DISCONNECTED carry the connection's fd (ZMQ_SRCFD ties
 * a client's to its routing id). With CURVE the same monitor carries the handshake failures
 * auth.c logs (libzmq allows one monitor per socket). */
static int monitor_connections(struct skv_server *srv, int idx, void *sock, int auth_events)
{
    const char *endpoint = idx ? ADMIN_CONNECTIONS_ENDPOINT : CONNECTIONS_ENDPOINT;
    void **pair = idx ? &srv->admin_connections : &srv->connections;
    int events = ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED | auth_events, linger = 0;
    if (zmq_socket_monitor(sock, endpoint, events) < 0 || !(*pair = zmq_socket(srv->zctx, ZMQ_PAIR)) ||
        zmq_setsockopt(*pair, ZMQ_LINGER, &linger, sizeof linger) < 0 || zmq_connect(*pair, endpoint) < 0)
        return skv_errorf(SKV_E_IO, "%s endpoint: connection monitor: %s", idx ? "admin" : "client",
                          zmq_strerror(zmq_errno()));
    return SKV_OK;
}

/* Requests read at a stop (answered SKV_E_CANCELLED), per socket. */
#define STOP_DRAIN_MAX 4096
/* How long the connections stay open after a stop's last reply (see skv_server_run). */
#define STOP_READ_GRACE_MS 300

static int bind_socket(struct skv_server *srv, int idx, const char *endpoint, void **sock_out)
{
    int rc = lock_endpoint(srv, idx, endpoint);
    if (rc)
        return rc;
    void *s = zmq_socket(srv->zctx, ZMQ_ROUTER);
    if (!s)
        return skv_errorf(SKV_E_IO, "zmq_socket: %s", zmq_strerror(zmq_errno()));
    int64_t maxmsg = srv->env.cfg->max_message_bytes;
    int linger = 1000, mandatory = 1;
    /* A client's replies in libzmq's queue, by count (their bytes: max-reply-bytes-per-client).
     * libzmq's 1000 is less than a stop answers at once with a deep queue (every queued request
     * and STOP_DRAIN_MAX more, CANCELLED): the rest were dropped (test_sigterm_full_queue). */
    int hwm = (int)(srv->env.cfg->queue_depth + STOP_DRAIN_MAX + 1000);
    zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof hwm);
    /* requests read from one connection and not yet taken by this thread: libzmq counts
     * messages, 1000 by default, which at max-message-bytes (16M) is 16 GB a connection; past
     * this many it stops reading that connection (the client waits, nothing is dropped). This
     * thread takes them as fast as they come, so a few are enough; with the one being read,
     * a peer can make libzmq hold (RCVHWM + 1) x max-message-bytes of whole messages for each
     * of its max-connections-per-peer connections. libzmq counts a message when its last frame
     * comes: the frames of one that never ends are held unbounded (docs/ARCHITECTURE.md,
     * "Request limits and the queue": the service's MemoryMax bounds that) */
    int rcvhwm = RCVHWM;
    zmq_setsockopt(s, ZMQ_RCVHWM, &rcvhwm, sizeof rcvhwm);
    /* a connection that has not finished its ZMTP (and CURVE) handshake by then is closed: an
     * idle one holds a connection slot only this long (libzmq's default is 30 s) */
    int handshake_ms = HANDSHAKE_MS;
    zmq_setsockopt(s, ZMQ_HANDSHAKE_IVL, &handshake_ms, sizeof handshake_ms);
    zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(s, ZMQ_ROUTER_MANDATORY, &mandatory, sizeof mandatory);
    if (strncmp(endpoint, "tcp://", 6) == 0) {
        /* a client whose host went away (no FIN) is closed after this much silence: its work
         * stops (client gone) and its connection slot is free, not held until TCP gives up */
        int ivl = TCP_HEARTBEAT_IVL_MS, timeout = TCP_HEARTBEAT_TIMEOUT_MS;
        zmq_setsockopt(s, ZMQ_HEARTBEAT_IVL, &ivl, sizeof ivl);
        zmq_setsockopt(s, ZMQ_HEARTBEAT_TIMEOUT, &timeout, sizeof timeout);
        /* a ping waits behind the replies queued before it: towards a host gone while replies
         * streamed, or a client that takes none, none goes out and the heartbeat never starts.
         * TCP_USER_TIMEOUT closes such a connection (its sent bytes unacknowledged, or its
         * receive window full, this long) */
        int maxrt = (int)(srv->env.cfg->tcp_user_timeout_seconds * 1000);
        if (maxrt > 0 && zmq_setsockopt(s, ZMQ_TCP_MAXRT, &maxrt, sizeof maxrt) < 0)
            skv_log(SKV_LOG_WARN, "%s: TCP_USER_TIMEOUT not set: %s", endpoint, zmq_strerror(zmq_errno()));
    }
    int auth_events = 0; /* the sockets' monitors are ours: they carry auth's events too */
    if ((rc = skv_auth_secure_socket(srv->auth, s, idx ? SKV_AUTH_ADMIN : SKV_AUTH_CLIENT, &auth_events)) ||
        (idx <= 1 && (rc = monitor_connections(srv, idx, s, auth_events)))) {
        zmq_close(s);
        return rc;
    }
    if (bind_ipc_mode(srv, idx, s, endpoint, idx == 0 ? 0660 : 0600) < 0) {
        int err = errno;
        zmq_close(s);
        return skv_errorf(err == EADDRINUSE ? SKV_E_EXISTS : SKV_E_IO, "bind %s: %s", endpoint, zmq_strerror(err));
    }
    char bound[256] = "";
    size_t blen = sizeof bound;
    if (idx <= 1 && strncmp(endpoint, "tcp://", 6) == 0 && zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, bound, &blen) == 0) {
        const char *colon = strrchr(bound, ':'); /* tcp://ADDRESS:PORT, the port it bound ("*": one) */
        *(idx ? &srv->admin_port : &srv->client_port) = colon ? (uint16_t)strtoul(colon + 1, NULL, 10) : 0;
    }
    *sock_out = s;
    return SKV_OK;
}

/* The KV events' PUB socket (ipc:// only, 0600 like the admin socket: the events name every
 * tenant's sessions). PUB never blocks: a subscriber that does not read loses events and sees a
 * gap in the sequence numbers. */
static int bind_events(struct skv_server *srv, const char *endpoint)
{
    int rc = lock_endpoint(srv, 2, endpoint);
    if (rc)
        return rc;
    int linger = 0;
    if (!(srv->events = zmq_socket(srv->zctx, ZMQ_PUB)) ||
        zmq_setsockopt(srv->events, ZMQ_LINGER, &linger, sizeof linger) < 0 ||
        bind_ipc_mode(srv, 2, srv->events, endpoint, 0600) < 0)
        return skv_errorf(SKV_E_IO, "events endpoint %s: %s", endpoint, zmq_strerror(errno));
    snprintf(srv->events_topic, sizeof srv->events_topic, "snapkv.kv.%.16s",
             srv->env.model ? srv->env.model->fingerprint : "");
    srv->events_sent_ms = skv_now_ms(); /* the first heartbeat after the worker's AllCleared */
    return SKV_OK;
}

/* [topic][sequence, big-endian][body] on the events socket. */
static void events_send(struct skv_server *srv, uint64_t seq, const void *body, size_t len)
{
    uint8_t be[8];
    for (int k = 0; k < 8; k++)
        be[k] = (uint8_t)(seq >> (56 - 8 * k));
    zmq_send(srv->events, srv->events_topic, strlen(srv->events_topic), ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(srv->events, be, sizeof be, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(srv->events, body, len, ZMQ_DONTWAIT);
    srv->events_sent_ms = skv_now_ms();
}

/* Publishes one KV event batch from the worker under the next sequence number. */
static void publish_event(struct skv_server *srv, const void *body, size_t len)
{
    if (!srv->events)
        return;
    events_send(srv, ++srv->events_seq, body, len);
    if (srv->mirror)
        skv_events_mirror_apply(srv->mirror, body, len);
}

/* A heartbeat when the stream was idle for events-heartbeat-seconds: a KvEventBatch of no
 * events, this daemon's boot id and the time, under the last event's number (it is no event: a
 * replay's sequence and the numbers after it do not move), so that a subscriber learns of a
 * restarted daemon though the new daemon's AllCleared went out before its subscription came. */
static void events_heartbeat(struct skv_server *srv, uint64_t now)
{
    uint64_t every = (uint64_t)srv->env.cfg->events_heartbeat_seconds * 1000;
    if (!srv->events || !every || now - srv->events_sent_ms < every)
        return;
    Snapkv__KvEventBatch b;
    skv_worker_event_batch(srv->worker, &b);
    uint8_t buf[64];
    events_send(srv, srv->events_seq, buf, snapkv__kv_event_batch__pack(&b, buf));
}

/* The events replay's ROUTER (ipc:// only, 0600 as the events): requests are a few bytes; a
 * part sent to a requester that is gone fails (ROUTER_MANDATORY) and ends that reply. */
static int bind_replay(struct skv_server *srv, const char *endpoint)
{
    int rc = lock_endpoint(srv, 3, endpoint);
    if (rc || (rc = skv_events_mirror_new(&srv->mirror)))
        return rc;
    int linger = 0, mandatory = 1;
    int64_t maxmsg = 4096;
    /* the parts of the largest snapshot the pool allows (every session holds at least a block
     * per layer and KV head): libzmq's 1000 cut one past about 64,000 sessions */
    int hwm = 1000;
    const struct skv_model *m = srv->env.model;
    if (m && m->kv_pool) {
        uint64_t least = (uint64_t)m->cfg.n_layers * m->cfg.n_kv_heads * skv_kv_pool_block_bytes(m->kv_pool);
        uint64_t parts = (uint64_t)srv->env.cfg->pool_size / (least ? least : 1) / SKV_REPLAY_PART_EVENTS + 16;
        hwm = parts > (uint64_t)hwm ? (parts < INT32_MAX ? (int)parts : INT32_MAX) : hwm;
    }
    if (!(srv->replay = zmq_socket(srv->zctx, ZMQ_ROUTER)) ||
        zmq_setsockopt(srv->replay, ZMQ_SNDHWM, &hwm, sizeof hwm) < 0 ||
        zmq_setsockopt(srv->replay, ZMQ_LINGER, &linger, sizeof linger) < 0 ||
        zmq_setsockopt(srv->replay, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg) < 0 ||
        zmq_setsockopt(srv->replay, ZMQ_ROUTER_MANDATORY, &mandatory, sizeof mandatory) < 0 ||
        bind_ipc_mode(srv, 3, srv->replay, endpoint, 0600) < 0)
        return skv_errorf(SKV_E_IO, "events replay endpoint %s: %s", endpoint, zmq_strerror(errno));
    return SKV_OK;
}

/* File descriptors the daemon keeps for itself beyond its client connections: the admin
 * endpoint's, libzmq's own, the log, metrics, shared-memory transfers, the model. */
#define FD_RESERVE 256

/* max-connections, or fewer when the open-file limit (main() raises it to the hard limit)
 * leaves no room for that many besides FD_RESERVE. */
static int connection_room(int64_t wanted)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY ||
        rl.rlim_cur >= (rlim_t)wanted + FD_RESERVE)
        return (int)wanted;
    int room = rl.rlim_cur > 2 * FD_RESERVE ? (int)(rl.rlim_cur - FD_RESERVE) : (int)(rl.rlim_cur / 2);
    room = room > 0 ? room : 1;
    skv_log(SKV_LOG_WARN, "max-connections %lld lowered to %d: the open-file limit is %llu (LimitNOFILE= in the "
            "unit, ulimit -n)", (long long)wanted, room, (unsigned long long)rl.rlim_cur);
    return room;
}

/* HTTP /metrics: the same text as admin STATS --prometheus. */
static size_t render_metrics(void *server, char *buf, size_t cap)
{
    const struct skv_server *srv = server;
    return skv_worker_prometheus(srv->worker, buf, cap);
}

/* HTTP /healthz and /readyz. */
static int health_probe(void *server, bool ready, char *buf, size_t cap)
{
    const struct skv_server *srv = server;
    return skv_worker_health(srv->worker, ready, (uint64_t)srv->env.cfg->health_stall_seconds * 1000, buf, cap);
}

int skv_server_new(const struct skv_server_env *env, struct skv_auth **auth_p, struct skv_server **out)
{
    struct skv_server *srv = calloc(1, sizeof *srv);
    if (!srv) {
        skv_auth_destroy(auth_p);
        return SKV_E_NOMEM;
    }
    srv->auth = *auth_p;
    *auth_p = NULL;
    srv->env = *env;
    srv->lock_fds[0] = srv->lock_fds[1] = srv->lock_fds[2] = srv->lock_fds[3] = -1;
    srv->started = time(NULL);
    int rc;
    srv->zctx = zmq_ctx_new();
    if (!srv->zctx) {
        rc = SKV_E_NOMEM;
        goto out_destroy;
    }
    if ((rc = skv_auth_start(srv->auth, srv->zctx)) || (rc = skv_clients_new(CLIENTS_MAX, &srv->clients)))
        goto out_destroy;
    srv->max_connections = connection_room(env->cfg->max_connections);
    srv->max_per_peer = (int)env->cfg->max_connections_per_peer;
    if ((rc = bind_socket(srv, 0, env->cfg->endpoint, &srv->client_sock)))
        goto out_destroy;
    if ((rc = bind_socket(srv, 1, env->cfg->admin_endpoint, &srv->admin_sock)))
        goto out_destroy;
    if (*env->cfg->events_endpoint && (rc = bind_events(srv, env->cfg->events_endpoint)))
        goto out_destroy;
    if (*env->cfg->events_replay_endpoint && (rc = bind_replay(srv, env->cfg->events_replay_endpoint)))
        goto out_destroy;
    if (*env->cfg->metrics_listen && (rc = skv_metrics_http_bind(env->cfg->metrics_listen, &srv->metrics)))
        goto out_destroy;
    srv->replies = zmq_socket(srv->zctx, ZMQ_PULL);
    if (!srv->replies || zmq_bind(srv->replies, REPLY_ENDPOINT) < 0) {
        rc = skv_errorf(SKV_E_IO, "inproc reply socket: %s", zmq_strerror(zmq_errno()));
        goto out_destroy;
    }
    if ((rc = skv_replies_new((uint64_t)env->cfg->max_reply_bytes_per_client,
                              (uint64_t)env->cfg->max_reply_bytes_per_peer, (uint64_t)env->cfg->max_reply_bytes,
                              &srv->unread)) ||
        (rc = skv_worker_start(srv->zctx, REPLY_ENDPOINT, env->cfg, env->model, &srv->worker)))
        goto out_destroy;
    skv_worker_set_replies(srv->worker, srv->unread); /* STATS reports them */
    if (srv->metrics && (rc = skv_metrics_http_start(srv->metrics, render_metrics, health_probe, srv)))
        goto out_destroy;
    *out = srv;
    return SKV_OK;

out_destroy:
    skv_server_destroy(&srv);
    return rc;
}

static void drain_worker(struct skv_server *srv);

void skv_server_destroy(struct skv_server **srv_p)
{
    if (!srv_p || !*srv_p)
        return;
    struct skv_server *srv = *srv_p;
    skv_metrics_http_stop(&srv->metrics);
    /* a start that failed after the engine thread started (the HTTP thread): it may be blocked
     * on a full reply pipe (a restore's events); else the join below would wait for ever */
    if (srv->worker && !srv->worker_done) {
        skv_worker_request_stop(srv->worker);
        drain_worker(srv);
    }
    skv_worker_stop(&srv->worker);
    if (srv->replies)
        zmq_close(srv->replies);
    if (srv->connections)
        zmq_close(srv->connections);
    if (srv->admin_connections)
        zmq_close(srv->admin_connections);
    free(srv->admin_fds);
    if (srv->client_sock)
        zmq_close(srv->client_sock);
    skv_clients_free(&srv->clients);
    free(srv->fds);
    free(srv->peers);
    if (srv->admin_sock)
        zmq_close(srv->admin_sock);
    if (srv->events)
        zmq_close(srv->events);
    if (srv->replay)
        zmq_close(srv->replay);
    skv_events_mirror_free(&srv->mirror);
    skv_auth_destroy(&srv->auth);
    int term = 0;
    if (srv->zctx) /* restarted when a signal cuts its wait for the lingering replies */
        while ((term = zmq_ctx_term(srv->zctx)) != 0 && zmq_errno() == EINTR)
            ;
    if (term == 0) /* libzmq freed every reply it held by now (else left: the process ends) */
        skv_replies_free(&srv->unread);
    for (int i = 0; i < 4; i++) {
        if (srv->ipc_paths[i])
            unlink(srv->ipc_paths[i]);
        free(srv->ipc_paths[i]);
        if (srv->lock_fds[i] >= 0)
            close(srv->lock_fds[i]);
    }
    free(srv);
    *srv_p = NULL;
}

bool skv_server_engine_alive(struct skv_server *srv, uint64_t interval_ms)
{
    return !srv->worker || skv_worker_alive(srv->worker, interval_ms);
}

static void read_connections(struct skv_server *srv);

/* Hands a reply to the client's connection without blocking: a client that stops reading
 * fills its queue (libzmq's SNDHWM, or max-reply-bytes-per-client / max-reply-bytes of replies
 * it has not taken) and loses replies, and the socket thread goes on serving everyone else (and
 * SIGTERM). Drops for the byte bounds are logged at most every 10 s. A reply on the client
 * endpoint goes only over the connection its request came over (conn: its fd and serial; 0: not
 * known): once that one closed, libzmq would route it to whichever connection holds its routing
 * id now, and a client may choose its routing id (ZMQ_ROUTING_ID) and libzmq's own are a
 * counter, so another client could take the id of one that went and read its replies. */
static void reply_out(struct skv_server *srv, int idx, int conn, uint64_t serial, const void *identity,
                      size_t identity_len, const void *body, size_t len)
{
    if (!idx && serial) {
        read_connections(srv); /* a DISCONNECTED waiting there comes before any new owner's message */
        if (conn < 0 || conn >= srv->fds_cap || !srv->fds[conn].open || srv->fds[conn].serial != serial) {
            skv_replies_note_closed(srv->unread);
            skv_log(SKV_LOG_DEBUG, "reply dropped: its request's connection closed");
            return;
        }
    }
    void *sock = idx ? srv->admin_sock : srv->client_sock;
    /* whose replies these count among (max-reply-bytes-per-peer): the connection checked above,
     * else the one the routing id has (the clients table, which forgets past CLIENTS_MAX) */
    int fd = idx ? -1 : serial ? conn : skv_clients_fd(srv->clients, identity, identity_len);
    uint64_t owner = fd >= 0 && fd < srv->fds_cap ? srv->fds[fd].peer : 0;
    int rc = skv_replies_send(srv->unread, sock, idx, owner, identity, identity_len, body, len);
    if (rc == SKV_E_BUSY) {
        uint64_t now = skv_now_ms(), dropped = skv_replies_dropped(srv->unread);
        if (now - srv->unread_logged_ms >= 10000) {
            skv_log(SKV_LOG_WARN, "dropped %llu repl%s to clients that do not read them: %s",
                    (unsigned long long)(dropped - srv->unread_dropped_logged),
                    dropped - srv->unread_dropped_logged == 1 ? "y" : "ies", skv_error_msg());
            srv->unread_dropped_logged = dropped;
            srv->unread_logged_ms = now;
        }
    } else if (rc) {
        skv_log(SKV_LOG_DEBUG, "reply dropped: %s (client gone or not reading)", skv_error_msg());
    }
}

static void send_reply(struct skv_server *srv, int idx, int conn, uint64_t serial, zmq_msg_t *identity,
                       Snapkv__Reply *rep)
{
    size_t len = snapkv__reply__get_packed_size(rep);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf) {
        skv_log(SKV_LOG_ERROR, "out of memory packing a reply");
        return;
    }
    snapkv__reply__pack(rep, buf);
    reply_out(srv, idx, conn, serial, zmq_msg_data(identity), zmq_msg_size(identity), buf, len);
    free(buf);
}

/* A client's words made fit for a log line in place: quotes as ', control characters as ?. */
static void log_plain(char *s)
{
    for (; *s; s++)
        *s = *s == '"' ? '\'' : (unsigned char)*s < 0x20 || *s == 0x7f ? '?' : *s;
}

static int handle_hello(struct skv_server *srv, const Snapkv__Request *req, Snapkv__Reply *rep,
                        Snapkv__HelloReply *h)
{
    const struct skv_model *m = srv->env.model;
    const struct skv_config *cfg = srv->env.cfg;
    if (req->hello) { /* a name is the client's own words: bounded, quotes and control characters made
                       * plain (a newline would forge a log line) */
        char name[65], tenant[64];
        snprintf(name, sizeof name, "%s", req->hello->client_name ? req->hello->client_name : "");
        snprintf(tenant, sizeof tenant, "%s", req->tenant ? req->tenant : "");
        log_plain(name);
        log_plain(tenant);
        skv_log(SKV_LOG_DEBUG, "hello from client \"%s\" (tenant \"%s\", protocol %u)", name, tenant,
                req->version);
    }
    h->server_version = PACKAGE_VERSION;
    h->model_name = (char *)m->name;
    h->model_fingerprint = (char *)m->fingerprint;
    h->legacy_model_fingerprint = (char *)m->legacy_fingerprint;
    h->backend = (char *)srv->env.backend->name;
    h->n_layers = (uint32_t)m->cfg.n_layers;
    h->n_heads = (uint32_t)m->cfg.n_heads;
    h->n_kv_heads = (uint32_t)m->cfg.n_kv_heads;
    h->head_dim = (uint32_t)m->cfg.head_dim;
    h->n_vocab = (uint32_t)m->cfg.n_vocab;
    h->max_prompt_tokens = (uint32_t)cfg->max_prompt_tokens;
    h->max_new_tokens = (uint32_t)cfg->max_new_tokens;
    h->max_sessions_per_tenant = (uint32_t)cfg->max_sessions_per_tenant;
    h->max_bytes_per_tenant = (uint64_t)cfg->max_bytes_per_tenant;
    h->max_message_bytes = (uint64_t)cfg->max_message_bytes;
    h->kv_block_tokens = (uint32_t)cfg->kv_block_tokens;
    /* HelloReply.features; without a tokenizer, no TOKENIZE */
    static const char *const features[] = {"sampling-ext", "prompt-logprobs", "prompt-top-logprobs", "tokenize"};
    static const char *const no_tok[] = {"sampling-ext", "prompt-logprobs", "prompt-top-logprobs"};
    h->n_features = m->tok ? sizeof features / sizeof features[0] : sizeof no_tok / sizeof no_tok[0];
    h->features = (char **)(m->tok ? features : no_tok);
    /* none: UINT32_MAX (SNAPKV_NO_TOKEN; a tokenizer's -1; 0, what no tokenizer sent before, is a token) */
    h->bos_token = m->tok ? (uint32_t)skv_tokenizer_bos(m->tok) : UINT32_MAX;
    h->eos_token = m->tok ? (uint32_t)skv_tokenizer_eos(m->tok) : UINT32_MAX;
    rep->result_case = SNAPKV__REPLY__RESULT_HELLO;
    rep->hello = h;
    return SKV_OK;
}

static int handle_status(struct skv_server *srv, Snapkv__Reply *rep, Snapkv__StatusReply *s)
{
    s->server_version = PACKAGE_VERSION;
    s->model_name = srv->env.model->name;
    s->backend = (char *)srv->env.backend->name;
    s->uptime_seconds = (uint64_t)(time(NULL) - srv->started);
    s->pool_bytes_total = (uint64_t)srv->env.cfg->pool_size;
    s->threads = (uint32_t)srv->env.backend->n_threads;
    struct skv_worker_stats ws;
    skv_worker_stats(srv->worker, &ws);
    s->n_sessions = ws.n_sessions;
    struct skv_clients_count cc; /* the client endpoint's clients whose connection is open */
    skv_clients_count(srv->clients, &cc);
    s->n_clients = (uint32_t)cc.live;
    s->queue_depth = ws.queue_depth;
    s->pool_bytes_used = ws.pool_bytes_used;
    struct skv_kv_pool_stats ps; /* the pool is thread-safe: read it here, not via the worker */
    skv_kv_pool_stats(srv->env.model->kv_pool, &ps);
    s->pool_blocks_used = ps.blocks_in_use;
    s->pool_blocks_shared = ps.blocks_shared;
    s->pool_block_rows = (uint32_t)ps.block_rows;
    s->pool_block_bytes = ps.block_bytes;
    rep->result_case = SNAPKV__REPLY__RESULT_STATUS_REPLY;
    rep->status_reply = s;
    return SKV_OK;
}

/* CONFIG GET: entries point into one arena freed after the reply is sent. */
struct config_arena {
    Snapkv__ConfigEntry *entries;
    Snapkv__ConfigEntry **ptrs;
    char (*values)[8192]; /* the longest value (a path, 64 tenant weights) whole */
};

static int handle_config_get(struct skv_server *srv, const Snapkv__ConfigGetRequest *creq,
                             Snapkv__Reply *rep, Snapkv__ConfigGetReply *cr, struct config_arena *a)
{
    size_t n;
    const struct skv_config_option *o = skv_config_options(&n);
    a->entries = calloc(n, sizeof *a->entries);
    a->ptrs = calloc(n, sizeof *a->ptrs);
    a->values = calloc(n, sizeof *a->values);
    if (!a->entries || !a->ptrs || !a->values)
        return SKV_E_NOMEM;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (creq->key && *creq->key && strcmp(creq->key, o[i].name) != 0)
            continue;
        snapkv__config_entry__init(&a->entries[k]);
        skv_config_get(srv->env.cfg, o[i].name, a->values[k], sizeof a->values[k]);
        if (strcmp(o[i].name, "max-connections") == 0) /* in force: lowered to the open-file limit */
            snprintf(a->values[k], sizeof a->values[k], "%d", srv->max_connections);
        a->entries[k].key = (char *)o[i].name;
        a->entries[k].value = a->values[k];
        a->entries[k].help = (char *)o[i].help;
        a->ptrs[k] = &a->entries[k];
        k++;
    }
    if (k == 0)
        return skv_errorf(SKV_E_NOT_FOUND, "unknown option '%s'", creq->key);
    cr->n_entries = k;
    cr->entries = a->ptrs;
    rep->result_case = SNAPKV__REPLY__RESULT_CONFIG_GET;
    rep->config_get = cr;
    return SKV_OK;
}

/* protobuf-c's allocations while one request is unpacked, counted (with malloc's own header)
 * against a budget: a 16 MB message of empty submessages or unknown fields unpacked to about a
 * gigabyte on the socket thread before any limit looked at it, and queued as if it held a few
 * bytes (the worker's walk sees known fields only). Freed with free(), as protobuf-c's default
 * allocator does, so free_unpacked(req, NULL) stays right. */
struct unpack_budget {
    ProtobufCAllocator a;
    size_t used, max;
    bool refused;
};

static void *budget_alloc(void *data, size_t size)
{
    struct unpack_budget *b = data;
    size_t cost = size + 16;
    if (size > b->max || b->used + cost > b->max) {
        b->refused = true;
        return NULL;
    }
    void *p = malloc(size ? size : 1);
    if (p)
        b->used += cost;
    return p;
}

static void budget_free(void *data, void *p)
{
    (void)data;
    free(p);
}

/* What a request of len bytes may unpack to: packed token ids grow 4 times, a small
 * submessage (a layer's kept counts) some 10 times, and a model has few layers. */
static size_t unpack_limit(size_t len)
{
    return 8 * len + ((size_t)1 << 20);
}

/* The uid in an ipc:// message's Peer-Address: libzmq ends it with ":UID:GID:PID", read with
 * SO_PEERCRED when the connection was made. -1 when it has none. */
static long peer_uid(zmq_msg_t *body)
{
    const char *addr = zmq_msg_gets(body, "Peer-Address");
    const char *colon[3] = {NULL};
    for (const char *p = addr ? addr + strlen(addr) : NULL; p && p > addr && !colon[2];)
        if (*--p == ':')
            colon[colon[0] ? colon[1] ? 2 : 1 : 0] = p;
    if (!colon[2])
        return -1;
    char *end;
    errno = 0;
    long uid = strtol(colon[2] + 1, &end, 10);
    return end != colon[2] + 1 && end == colon[1] && !errno && uid >= 0 ? uid : -1;
}

/* With ipc-tenant = uid, the tenant of a client on an ipc:// client endpoint: its process's
 * user, "uid-<N>"; NULL otherwise. The uid is the connection's, fixed when it was made (its
 * Peer-Address), not SO_PEERCRED of the fd a message came over: a message read after its
 * connection closed carries a number the kernel may have given another user's new connection. */
static const char *peer_tenant(const struct skv_server *srv, zmq_msg_t *body, char *buf, size_t cap)
{
    if (strcmp(srv->env.cfg->ipc_tenant, "uid") != 0 || strncmp(srv->env.cfg->endpoint, "ipc://", 6) != 0)
        return NULL;
    long uid = peer_uid(body);
    if (uid < 0)
        return ""; /* refused below: no tenant can be vouched for */
    snprintf(buf, cap, "uid-%ld", uid);
    return buf;
}

/* A CURVE key bound to a tenant (its ZAP User-Id) acts only for that tenant, and so does a
 * local user with ipc-tenant = uid: a request naming no tenant or the default one gets the
 * bound tenant, one naming another tenant is refused. */
static int bind_tenant(const struct skv_server *srv, Snapkv__Request *req, zmq_msg_t *body, bool admin)
{
    /* over CURVE, the connection's key must still be listed: a reload that removed it stops
     * its open connections too, not only new handshakes; its binding is the list's now */
    const char *key_tenant = NULL;
    enum skv_auth_endpoint which = admin ? SKV_AUTH_ADMIN : SKV_AUTH_CLIENT;
    if (skv_auth_uses_curve(srv->auth, which)) {
        const char *key = zmq_msg_gets(body, "X-Key");
        int rc = key ? skv_auth_key_check(srv->auth, which, key, &key_tenant)
                     : skv_errorf(SKV_E_PERM, "this connection has no CURVE key");
        if (rc)
            return rc;
    }
    char uid_tenant[32];
    const char *bound = admin ? NULL : peer_tenant(srv, body, uid_tenant, sizeof uid_tenant);
    if (bound && !*bound)
        return skv_errorf(SKV_E_PERM, "ipc-tenant is uid, and this connection's user could not be read");
    if (!bound)
        bound = key_tenant ? key_tenant : zmq_msg_gets(body, "User-Id");
    if (!bound || !*bound)
        return SKV_OK;
    const char *claims[2] = {req->tenant,
                             req->command_case == SNAPKV__REQUEST__COMMAND_HELLO && req->hello ? req->hello->tenant : NULL};
    for (int i = 0; i < 2; i++)
        if (claims[i] && *claims[i] && strcmp(claims[i], SKV_TENANT_DEFAULT) != 0 && strcmp(claims[i], bound) != 0)
            return skv_errorf(SKV_E_PERM, "this client is bound to tenant '%s' (%s); it cannot act for '%.64s'",
                              bound, bound == uid_tenant ? "its user, ipc-tenant = uid" : "its CURVE key", claims[i]);
    char *copy = strdup(bound);
    if (!copy)
        return SKV_E_NOMEM;
    if (req->tenant != protobuf_c_empty_string)
        free(req->tenant); /* free_unpacked frees the replacement */
    req->tenant = copy;
    return SKV_OK;
}

static bool is_admin_command(Snapkv__Request__CommandCase c)
{
    return c >= SNAPKV__REQUEST__COMMAND_STATUS;
}

/* The fd of the connection a received message came over. ZMQ_SRCFD is deprecated in libzmq
 * 4.3 (for ZMQ_ROUTER_NOTIFY, a draft API stable builds lack) but still answered; zmq.h marks
 * it only in a comment, so no compiler warning names it. Kept to this one place. */
static int message_fd(zmq_msg_t *msg)
{
    return zmq_msg_get(msg, ZMQ_SRCFD);
}

static void notify_gone(void *user, const uint8_t *identity, size_t identity_len)
{
    struct skv_server *srv = user;
    int rc = skv_worker_client_gone(srv->worker, identity, identity_len, true);
    if (rc)
        skv_log(SKV_LOG_DEBUG, "client-gone notice not queued: %s", skv_error_msg());
}

/* Feeds every connection event the client socket's monitor holds to the client table (and
 * CURVE handshake failures to auth). Called before each client message is read: a connection
 * that closed and one that took its fd are both known before that fd's next message.
 * A connection accepted past max-connections is shut down at once (libzmq then closes it and
 * reports DISCONNECTED), so idle connections cannot take every file descriptor: libzmq aborts
 * the process when an ipc accept fails with EMFILE, and on tcp the clients with keys could no
 * longer get in. So is one that takes its peer (its user on ipc://, its address on tcp://) past
 * max-connections-per-peer: one user cannot hold every connection, nor make libzmq buffer
 * requests for more than that many. Only a connection still open at the end of the batch read
 * is shut down, so a fd that closed (and may have been reused) within the batch is left alone. */
#define CONNECTION_BATCH 256

/* fd's entry, the table grown to hold it (NULL: a bad fd, or no memory: then the connection is
 * left open rather than counted wrong). */
/* Entry fd of a table of entries of `size` bytes indexed by fd (*table, *cap entries), grown
 * zeroed as needed; NULL for a negative fd or no memory. */
static void *fd_slot(void **table, int *cap, size_t size, int fd)
{
    if (fd < 0)
        return NULL;
    if (fd >= *cap) {
        int grown_cap = *cap ? *cap : 1024;
        while (grown_cap <= fd)
            grown_cap *= 2;
        char *grown = realloc(*table, (size_t)grown_cap * size);
        if (!grown)
            return NULL;
        memset(grown + (size_t)*cap * size, 0, (size_t)(grown_cap - *cap) * size);
        *table = grown;
        *cap = grown_cap;
    }
    return (char *)*table + (size_t)fd * size;
}

static struct conn_fd *conn_slot(struct skv_server *srv, int fd)
{
    void *table = srv->fds;
    struct conn_fd *slot = fd_slot(&table, &srv->fds_cap, sizeof *srv->fds, fd);
    srv->fds = table;
    return slot;
}

/* Who is at the other end of accepted connection fd: on a Unix socket its user (SO_PEERCRED),
 * on TCP its address; 0 when that cannot be read (the connection already gone). */
static uint64_t peer_key(int fd)
{
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0)
        return 0;
    if (ss.ss_family == AF_UNIX) {
        struct ucred cr;
        socklen_t cl = sizeof cr;
        return getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) == 0 ? (UINT64_C(1) << 62) | (uint32_t)cr.uid : 0;
    }
    len = sizeof ss;
    if (getpeername(fd, (struct sockaddr *)&ss, &len) != 0)
        return 0;
    const uint8_t *a = NULL;
    size_t n = 0;
    if (ss.ss_family == AF_INET) {
        a = (const uint8_t *)&((struct sockaddr_in *)&ss)->sin_addr;
        n = 4;
    } else if (ss.ss_family == AF_INET6) {
        a = (const uint8_t *)&((struct sockaddr_in6 *)&ss)->sin6_addr;
        /* one host may hold a whole /64: its prefix is the peer (an IPv4-mapped address: all) */
        static const uint8_t v4mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        n = memcmp(a, v4mapped, sizeof v4mapped) == 0 ? 16 : 8;
    }
    uint64_t h = UINT64_C(14695981039346656037); /* FNV-1a of the address, tagged apart from users */
    for (size_t i = 0; i < n; i++)
        h = (h ^ a[i]) * UINT64_C(1099511628211);
    return n ? (h | (UINT64_C(1) << 63)) & ~(UINT64_C(1) << 62) : 0;
}

/* key's entry in the peers table, added (with no connections) when absent; NULL: no memory. */
static struct peer_conns *peer_find(struct skv_server *srv, uint64_t key)
{
    for (int i = 0; i < srv->n_peers; i++)
        if (srv->peers[i].key == key)
            return &srv->peers[i];
    if (srv->n_peers == srv->peers_cap) {
        int cap = srv->peers_cap ? 2 * srv->peers_cap : 16;
        struct peer_conns *grown = realloc(srv->peers, (size_t)cap * sizeof *grown);
        if (!grown)
            return NULL;
        srv->peers = grown;
        srv->peers_cap = cap;
    }
    srv->peers[srv->n_peers] = (struct peer_conns){key, 0};
    return &srv->peers[srv->n_peers++];
}

/* Takes connection fd off its peer's count (it closed, or is being shut down here). */
static void peer_gone(struct skv_server *srv, int fd)
{
    if (fd < 0 || fd >= srv->fds_cap || !srv->fds[fd].peer)
        return;
    uint64_t key = srv->fds[fd].peer;
    srv->fds[fd].peer = 0;
    for (int i = 0; i < srv->n_peers; i++)
        if (srv->peers[i].key == key) {
            if (--srv->peers[i].n <= 0)
                srv->peers[i] = srv->peers[--srv->n_peers];
            return;
        }
}

/* Counts connection fd (just accepted; c its entry) under its peer; true when its peer now
 * holds more than max-connections-per-peer. */
static bool peer_accepted(struct skv_server *srv, struct conn_fd *c, int fd)
{
    uint64_t key = peer_key(fd);
    struct peer_conns *p = key ? peer_find(srv, key) : NULL;
    if (!p)
        return false; /* not counted under a peer: the total bound still holds */
    c->peer = key;
    return ++p->n > srv->max_per_peer;
}

/* The open connections of fd's peer (0: none counted). */
static int peer_open(const struct skv_server *srv, int fd)
{
    if (fd < 0 || fd >= srv->fds_cap || !srv->fds[fd].peer)
        return 0;
    for (int i = 0; i < srv->n_peers; i++)
        if (srv->peers[i].key == srv->fds[fd].peer)
            return srv->peers[i].n;
    return 0;
}

/* Connection fd closed (its DISCONNECTED), or an ACCEPTED came for fd while it was still open
 * (the DISCONNECTED was missed): it is no longer counted. */
static void conn_closed(struct skv_server *srv, int fd)
{
    if (fd < 0 || fd >= srv->fds_cap || !srv->fds[fd].open)
        return;
    peer_gone(srv, fd);
    if (srv->fds[fd].closing)
        srv->fds[fd].closing = 0; /* no longer counted since it was shut down */
    else
        srv->open_connections -= srv->open_connections > 0;
    srv->fds[fd].open = 0;
}

/* Whether fd is a connection accepted on endpoint idx (0 client, 1 admin: its local address is
 * that endpoint's): a fd read from a monitor may since have closed and been reused. */
static bool is_endpoint_conn(const struct skv_server *srv, int idx, int fd)
{
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0)
        return false;
    if (ss.ss_family == AF_UNIX)
        return srv->ipc_paths[idx] && strncmp(((struct sockaddr_un *)&ss)->sun_path, srv->ipc_paths[idx],
                                              sizeof ((struct sockaddr_un *)&ss)->sun_path) == 0;
    if (ss.ss_family != AF_INET && ss.ss_family != AF_INET6)
        return false;
    uint16_t port = ss.ss_family == AF_INET ? ((struct sockaddr_in *)&ss)->sin_port
                                            : ((struct sockaddr_in6 *)&ss)->sin6_port;
    uint16_t ours = idx ? srv->admin_port : srv->client_port;
    return ours && ntohs(port) == ours;
}

static bool is_client_conn(const struct skv_server *srv, int fd)
{
    return is_endpoint_conn(srv, 0, fd);
}

/* One event of a socket monitor: its kind, and its value (the fd for ACCEPTED / DISCONNECTED,
 * an errno for a handshake failure). */
struct monitor_event {
    uint16_t event;
    int fd;
};

/* Reads up to CONNECTION_BATCH events waiting on monitor into ev; *more is cleared once none is
 * left. Returns how many. */
static int read_monitor_batch(void *monitor, struct monitor_event *ev, bool *more)
{
    int n = 0;
    while (n < CONNECTION_BATCH) {
        zmq_msg_t head, addr;
        zmq_msg_init(&head);
        zmq_msg_init(&addr);
        if (zmq_msg_recv(&head, monitor, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&head);
            zmq_msg_close(&addr);
            *more = false;
            break;
        }
        if (zmq_msg_more(&head))
            zmq_msg_recv(&addr, monitor, 0);
        if (zmq_msg_size(&head) == 6) { /* u16 event, u32 value */
            uint32_t value;
            memcpy(&ev[n].event, zmq_msg_data(&head), sizeof ev[n].event);
            memcpy(&value, (const char *)zmq_msg_data(&head) + 2, sizeof value);
            ev[n++].fd = (int)value;
        }
        zmq_msg_close(&head);
        zmq_msg_close(&addr);
    }
    return n;
}

/* Marks fd open (or not) on the admin endpoint (not counted when it cannot be recorded). */
static void admin_fd_set(struct skv_server *srv, int fd, bool open)
{
    void *table = srv->admin_fds;
    uint8_t *slot = fd_slot(&table, &srv->admin_fds_cap, 1, fd);
    srv->admin_fds = table;
    if (!slot)
        return;
    if (open && !*slot) /* (an ACCEPTED for a fd still open: its DISCONNECTED never came) */
        srv->admin_open++;
    else if (!open && *slot)
        srv->admin_open -= srv->admin_open > 0;
    *slot = open;
}

/* The admin endpoint's monitor: connections counted, the newest past ADMIN_CONNECTIONS_MAX shut
 * down when still open after the batch of events read (and its fd still the admin endpoint's),
 * as read_connections does for max-connections; CURVE handshake failures to auth.c. */
static void read_admin_connections(struct skv_server *srv)
{
    for (bool more = true; more;) {
        struct monitor_event ev[CONNECTION_BATCH];
        int n = read_monitor_batch(srv->admin_connections, ev, &more);
        for (int i = 0; i < n; i++) {
            if (ev[i].event == ZMQ_EVENT_ACCEPTED || ev[i].event == ZMQ_EVENT_DISCONNECTED)
                admin_fd_set(srv, ev[i].fd, ev[i].event == ZMQ_EVENT_ACCEPTED);
            else
                skv_auth_handshake_event(srv->auth, SKV_AUTH_ADMIN, ev[i].event, (uint32_t)ev[i].fd);
        }
        for (int i = n - 1; i >= 0 && srv->admin_open > ADMIN_CONNECTIONS_MAX; i--) {
            if (ev[i].event != ZMQ_EVENT_ACCEPTED)
                continue;
            bool closed_since = false; /* (a handshake event's value is an errno) */
            for (int j = i + 1; j < n && !closed_since; j++)
                closed_since = ev[j].event == ZMQ_EVENT_DISCONNECTED && ev[j].fd == ev[i].fd;
            if (closed_since || ev[i].fd < 0 || ev[i].fd >= srv->admin_fds_cap || !srv->admin_fds[ev[i].fd] ||
                !is_endpoint_conn(srv, 1, ev[i].fd) || shutdown(ev[i].fd, SHUT_RDWR) != 0)
                continue;
            admin_fd_set(srv, ev[i].fd, false); /* its DISCONNECTED follows and is not counted again */
            srv->admin_refused++;
        }
    }
    if (srv->admin_refused && skv_now_ms() - srv->admin_refused_logged_ms >= 10000) {
        skv_log(SKV_LOG_WARN, "%d connections are open on the admin endpoint (at most %d): %llu more were closed "
                "as they came", srv->admin_open, ADMIN_CONNECTIONS_MAX, (unsigned long long)srv->admin_refused);
        srv->admin_refused_logged_ms = skv_now_ms();
        srv->admin_refused = 0;
    }
}

static void read_connections(struct skv_server *srv)
{
    for (bool more = true; more;) {
        struct monitor_event ev[CONNECTION_BATCH];
        int n = read_monitor_batch(srv->connections, ev, &more);
        if (n == 0) /* the common case: called for every client message and reply */
            break;
        uint64_t now = skv_now_ms();
        bool any_over = false;
        for (int i = 0; i < n; i++) {
            if (ev[i].event == ZMQ_EVENT_ACCEPTED) {
                skv_clients_accepted(srv->clients, ev[i].fd, now, notify_gone, srv);
                conn_closed(srv, ev[i].fd); /* (a DISCONNECTED of the fd's last connection that never came) */
                srv->open_connections++;
                struct conn_fd *c = conn_slot(srv, ev[i].fd);
                if (c) {
                    c->open = 1;
                    c->refused = 0;
                    c->serial = ++srv->conn_serials;
                    any_over |= peer_accepted(srv, c, ev[i].fd);
                }
            } else if (ev[i].event == ZMQ_EVENT_DISCONNECTED) {
                skv_clients_disconnected(srv->clients, ev[i].fd, now, notify_gone, srv);
                conn_closed(srv, ev[i].fd);
            } else {
                skv_auth_handshake_event(srv->auth, SKV_AUTH_CLIENT, ev[i].event, (uint32_t)ev[i].fd);
            }
        }
        /* the newest connections past a limit go, when still open after this batch */
        for (int i = n - 1; i >= 0 && (any_over || srv->open_connections > srv->max_connections); i--) {
            if (ev[i].event != ZMQ_EVENT_ACCEPTED)
                continue;
            bool closed_since = false;
            for (int j = i + 1; j < n && !closed_since; j++) /* (a handshake event's value is an errno) */
                closed_since = ev[j].event == ZMQ_EVENT_DISCONNECTED && ev[j].fd == ev[i].fd;
            bool peer_over = peer_open(srv, ev[i].fd) > srv->max_per_peer;
            if (closed_since || (!peer_over && srv->open_connections <= srv->max_connections))
                continue;
            struct conn_fd *c = conn_slot(srv, ev[i].fd);
            /* the fd must still be this connection: a client endpoint's, of the same peer (one
             * that closed after the batch was read may have been reused by any other) */
            if (!c || !c->open || !is_client_conn(srv, ev[i].fd) || (c->peer && peer_key(ev[i].fd) != c->peer) ||
                shutdown(ev[i].fd, SHUT_RDWR) != 0)
                continue;
            c->closing = 1;
            c->refused = 1;
            peer_gone(srv, ev[i].fd);
            srv->open_connections--; /* its DISCONNECTED follows and is not counted again */
            if (peer_over)
                srv->refused_peer++;
            else
                srv->refused_connections++;
        }
    }
    if ((srv->refused_connections || srv->refused_peer || srv->refused_requests) &&
        skv_now_ms() - srv->refused_logged_ms >= 10000) {
        if (srv->refused_connections)
            skv_log(SKV_LOG_WARN, "%d connections are open on the client endpoint (max-connections %d): %llu more "
                    "were closed as they came", srv->open_connections, srv->max_connections,
                    (unsigned long long)srv->refused_connections);
        if (srv->refused_peer)
            skv_log(SKV_LOG_WARN, "%llu connections were closed as they came: their user (ipc://) or address "
                    "(tcp://) held max-connections-per-peer (%d) already", (unsigned long long)srv->refused_peer,
                    srv->max_per_peer);
        if (srv->refused_requests)
            skv_log(SKV_LOG_WARN, "%llu requests that connections closed for those limits had sent were dropped",
                    (unsigned long long)srv->refused_requests);
        srv->refused_logged_ms = skv_now_ms();
        srv->refused_connections = srv->refused_peer = srv->refused_requests = 0;
    }
}

/* Reads one [identity][request] message from sock and answers it. */
static void serve_one(struct skv_server *srv, void *sock, bool admin)
{
    zmq_msg_t identity, body;
    Snapkv__Request *req = NULL;
    enum skv_client_seen seen = SKV_CLIENT_LIVE;
    zmq_msg_init(&identity);
    zmq_msg_init(&body);
    if (zmq_msg_recv(&identity, sock, ZMQ_DONTWAIT) < 0)
        goto out;
    if (!zmq_msg_more(&identity))
        goto out; /* nothing to answer */
    if (zmq_msg_recv(&body, sock, 0) < 0)
        goto out;
    while (zmq_msg_more(&body)) { /* drain unexpected extra frames */
        zmq_msg_t extra;
        zmq_msg_init(&extra);
        zmq_msg_recv(&extra, sock, 0);
        int more = zmq_msg_more(&extra);
        zmq_msg_close(&extra);
        if (!more)
            break;
    }
    /* from a connection closed for a limit (libzmq read it before this thread heard of the
     * connection): dropped unanswered, as if the connection had never been let in. The fd may
     * have been reused since the events were read: a new connection's ACCEPTED comes before its
     * first message, so the events are read again before the fd's mark is believed. (A request
     * of the closed connection still unread when a connection let in took its fd is served.) */
    int conn = admin ? -1 : message_fd(&body);
    if (conn >= 0) /* its connection's ACCEPTED came before it: read by now */
        read_connections(srv);
    if (conn >= 0 && conn < srv->fds_cap && srv->fds[conn].refused) {
        srv->refused_requests++;
        skv_log(SKV_LOG_DEBUG, "a request from a connection closed for a connection limit: dropped");
        goto out;
    }
    /* the number of the connection it came over, for its replies (reply_out) */
    uint64_t serial = conn >= 0 && conn < srv->fds_cap ? srv->fds[conn].serial : 0;
    srv->n_requests++;
    if (!admin &&
        (seen = skv_clients_seen(srv->clients, zmq_msg_data(&identity), zmq_msg_size(&identity), conn,
                                 skv_now_ms())) != SKV_CLIENT_LIVE)
        skv_log(SKV_LOG_DEBUG, "a request read after its client's connection closed: served, then a gone notice");

    Snapkv__Reply rep = SNAPKV__REPLY__INIT;
    rep.version = PROTOCOL_VERSION;
    rep.final = true;
    Snapkv__HelloReply hello = SNAPKV__HELLO_REPLY__INIT;
    Snapkv__StatusReply status = SNAPKV__STATUS_REPLY__INIT;
    Snapkv__ConfigGetReply config = SNAPKV__CONFIG_GET_REPLY__INIT;
    struct config_arena arena = {0};
    int rc;
    skv_error_clear();

    struct unpack_budget budget = {
        .a = {budget_alloc, budget_free, &budget}, .max = unpack_limit(zmq_msg_size(&body))};
    req = snapkv__request__unpack(&budget.a, zmq_msg_size(&body), zmq_msg_data(&body));
    if (!req) {
        rc = budget.refused ? skv_errorf(SKV_E_LIMIT,
                                         "the request (%zu bytes) unpacks to more than %zu bytes of structures: "
                                         "empty or unknown fields by the million are refused",
                                         zmq_msg_size(&body), budget.max)
                            : skv_errorf(SKV_E_PROTO, "malformed request (%zu bytes): not a snapkv.Request",
                                         zmq_msg_size(&body));
        goto reply;
    }
    rep.request_id = req->request_id;
    if (req->version != PROTOCOL_VERSION) {
        rc = skv_errorf(SKV_E_VERSION, "protocol version %u not supported (this daemon speaks %d)",
                        req->version, PROTOCOL_VERSION);
        goto reply;
    }
    if ((rc = skv_proto_text_check(&snapkv__request__descriptor, zmq_msg_data(&body), zmq_msg_size(&body))))
        goto reply; /* a NUL or ill-formed UTF-8 in a string: protobuf-c would have cut or kept it silently */
    if (is_admin_command(req->command_case) && !admin) {
        rc = skv_errorf(SKV_E_PERM, "admin commands are only accepted on the admin endpoint");
        goto reply;
    }
    /* only PREFILL, APPEND, TOKENIZE (tokens, text), DETOKENIZE (tokens) and IMPORT_KV (positions)
     * carry more than a few KiB;
     * a larger request of another command is padding (unknown fields), which a running DECODE
     * would hold for as long as it runs, outside the queue's bytes */
    Snapkv__Request__CommandCase cc = req->command_case;
    if (zmq_msg_size(&body) > SMALL_REQUEST_MAX && cc != SNAPKV__REQUEST__COMMAND_PREFILL &&
        cc != SNAPKV__REQUEST__COMMAND_APPEND && cc != SNAPKV__REQUEST__COMMAND_IMPORT_KV &&
        cc != SNAPKV__REQUEST__COMMAND_TOKENIZE && cc != SNAPKV__REQUEST__COMMAND_DETOKENIZE) {
        const ProtobufCFieldDescriptor *fd =
            protobuf_c_message_descriptor_get_field(&snapkv__request__descriptor, (unsigned)req->command_case);
        rc = skv_errorf(SKV_E_LIMIT,
                        "a %s request of %zu bytes: at most %d (only prefill, append, import_kv, tokenize and "
                        "detokenize carry more)",
                        fd ? fd->name : "command", zmq_msg_size(&body), SMALL_REQUEST_MAX);
        goto reply;
    }
    if ((rc = bind_tenant(srv, req, &body, admin)))
        goto reply;
    switch (req->command_case) {
    case SNAPKV__REQUEST__COMMAND_HELLO:
        rc = handle_hello(srv, req, &rep, &hello);
        break;
    case SNAPKV__REQUEST__COMMAND_STATUS:
        rc = handle_status(srv, &rep, &status);
        break;
    case SNAPKV__REQUEST__COMMAND_CONFIG_GET:
        rc = handle_config_get(srv, req->config_get, &rep, &config, &arena);
        break;
    case SNAPKV__REQUEST__COMMAND__NOT_SET:
        rc = skv_errorf(SKV_E_PROTO, "request names no command");
        break;
    case SNAPKV__REQUEST__COMMAND_REGISTER_BUFFER:
        rc = skv_errorf(SKV_E_UNSUPPORTED, "REGISTER_BUFFER is not needed: name the buffer in EXPORT_KV / IMPORT_KV");
        break;
    default: {
        /* session work runs on the engine worker, which sends the reply */
        struct skv_job *job = calloc(1, sizeof *job);
        size_t id_len = zmq_msg_size(&identity);
        if (!job || id_len > sizeof job->identity) {
            free(job);
            rc = skv_errorf(SKV_E_NOMEM, "cannot queue the request");
            break;
        }
        job->sock = admin ? 1 : 0;
        const char *ep = admin ? srv->env.cfg->admin_endpoint : srv->env.cfg->endpoint;
        job->uid = strncmp(ep, "ipc://", 6) == 0 ? peer_uid(&body) : -1;
        memcpy(job->identity, zmq_msg_data(&identity), id_len);
        job->identity_len = id_len;
        job->conn = conn;
        job->conn_serial = serial;
        job->req = req;
        job->unpacked_bytes = budget.used;
        rc = skv_worker_submit(srv->worker, job);
        if (rc == SKV_OK) {
            req = NULL; /* owned by the job */
            goto out;
        }
        job->req = NULL;
        free(job);
        break;
    }
    }

reply:
    rep.status = rc;
    if (rc) {
        rep.result_case = SNAPKV__REPLY__RESULT__NOT_SET;
        rep.message = (char *)(*skv_error_msg() ? skv_error_msg() : skv_status_str(rc));
        skv_log(SKV_LOG_DEBUG, "request %llu: %s: %s", (unsigned long long)rep.request_id,
                skv_status_name(rc), rep.message);
    }
    send_reply(srv, admin, conn, serial, &identity, &rep);
    free(arena.entries);
    free(arena.ptrs);
    free(arena.values);
out:
    /* read after its client had gone: what the request opened is closed right after it */
    if (seen != SKV_CLIENT_LIVE && skv_worker_client_gone(srv->worker, zmq_msg_data(&identity), zmq_msg_size(&identity),
                                                          seen == SKV_CLIENT_LATE_FIRST))
        skv_log(SKV_LOG_DEBUG, "client-gone notice not queued: %s", skv_error_msg());
    if (req)
        snapkv__request__free_unpacked(req, NULL);
    zmq_msg_close(&identity);
    zmq_msg_close(&body);
}

/* Forwards one [sock (+ connection)][identity][reply] message from the worker to its ROUTER. */
static bool forward_reply(struct skv_server *srv, int flags)
{
    zmq_msg_t parts[3];
    for (int i = 0; i < 3; i++)
        zmq_msg_init(&parts[i]);
    bool ok = zmq_msg_recv(&parts[0], srv->replies, flags) >= 0 && zmq_msg_recv(&parts[1], srv->replies, 0) >= 0 &&
              zmq_msg_recv(&parts[2], srv->replies, 0) >= 0;
    int idx = ok ? *(const uint8_t *)zmq_msg_data(&parts[0]) : 0;
    struct skv_worker_route route = {.sock = (uint8_t)idx, .conn = -1};
    if (ok && zmq_msg_size(&parts[0]) == sizeof route)
        memcpy(&route, zmq_msg_data(&parts[0]), sizeof route);
    if (ok && idx == SKV_WORKER_DONE_SOCK)
        srv->worker_done = true;
    else if (ok && idx == SKV_WORKER_EVENTS_SOCK)
        publish_event(srv, zmq_msg_data(&parts[2]), zmq_msg_size(&parts[2]));
    else if (ok)
        reply_out(srv, idx ? 1 : 0, route.conn, route.serial, zmq_msg_data(&parts[1]), zmq_msg_size(&parts[1]),
                  zmq_msg_data(&parts[2]), zmq_msg_size(&parts[2]));
    for (int i = 0; i < 3; i++)
        zmq_msg_close(&parts[i]);
    return ok;
}

/* After skv_worker_request_stop: forwards the worker's replies until its last message, so a
 * worker with more to send than the pipe holds is never left blocked on it before the join. */
static void drain_worker(struct skv_server *srv)
{
    while (!srv->worker_done) {
        zmq_pollitem_t it = {srv->replies, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 200) < 0 && zmq_errno() != EINTR)
            break;
        /* the connection limits hold while the save runs too: a flood of connections then
         * could take the file descriptors the save opens */
        read_connections(srv);
        while (!srv->worker_done && forward_reply(srv, ZMQ_DONTWAIT))
            ;
    }
}

/* Serves up to `max` waiting requests of socket idx (0 client, 1 admin; max < 0: all), the
 * first without asking when `known_ready`. True when it stopped at `max` with more waiting
 * (the socket's readiness is not known then), false when the socket had no more. */
static bool serve_ready(struct skv_server *srv, int idx, int max, bool known_ready)
{
    void *sock = idx ? srv->admin_sock : srv->client_sock;
    for (int k = 0; max < 0 || k < max; k++) {
        if (!(k == 0 && known_ready) && !skv_zmq_has_input(sock))
            return false;
        serve_one(srv, sock, idx == 1); /* (which reads the connection events after the message) */
    }
    return true;
}

/* The socket thread's wait. zmq_poll() asks every socket for its events before and after each
 * poll(2), about 14 system calls a request with these sockets, which is most of what a STATUS
 * round trip takes here beyond the transport's own (snapkv-bench serve --parts roundtrip). So
 * the loop polls the sockets' ZMQ_FDs itself and asks a socket for its events only when its fd
 * woke, when it was used since it was last asked (a send or receive may take the notice its fd
 * would have given), or after a wait that timed out. The fd signals only new notices, so a
 * socket is asked until it says it has no input before the loop sleeps on its fd again. */
enum {
    WAIT_CLIENT,
    WAIT_ADMIN,
    WAIT_REPLIES,
    WAIT_CONNECTIONS,
    WAIT_ADMIN_CONNECTIONS,
    WAIT_REPLAY,
    WAIT_AUTH,
    WAIT_MAX = WAIT_AUTH + 3
};

struct waitset {
    int n;
    void *sock[WAIT_MAX];
    struct pollfd fds[WAIT_MAX];
    bool ask[WAIT_MAX];   /* readiness unknown: ask the socket */
    bool ready[WAIT_MAX]; /* has input */
};

static int waitset_init(struct skv_server *srv, struct waitset *ws)
{
    memset(ws, 0, sizeof *ws);
    ws->sock[WAIT_CLIENT] = srv->client_sock;
    ws->sock[WAIT_ADMIN] = srv->admin_sock;
    ws->sock[WAIT_REPLIES] = srv->replies;
    ws->sock[WAIT_CONNECTIONS] = srv->connections;
    ws->sock[WAIT_ADMIN_CONNECTIONS] = srv->admin_connections;
    ws->sock[WAIT_REPLAY] = srv->replay; /* NULL without events-replay-endpoint: never polled */
    ws->n = WAIT_AUTH + (int)skv_auth_sockets(srv->auth, &ws->sock[WAIT_AUTH]);
    for (int i = 0; i < ws->n; i++) {
        size_t sz = sizeof ws->fds[i].fd;
        ws->fds[i].fd = -1; /* poll(2) skips it */
        if (!ws->sock[i])
            continue;
        if (zmq_getsockopt(ws->sock[i], ZMQ_FD, &ws->fds[i].fd, &sz) < 0)
            return skv_errorf(SKV_E_IO, "ZMQ_FD: %s", zmq_strerror(zmq_errno()));
        ws->fds[i].events = POLLIN;
        ws->ask[i] = true;
    }
    return SKV_OK;
}

/* Asks the sockets whose readiness is not known; true when any has input. */
static bool waitset_ask(struct waitset *ws)
{
    bool any = false;
    for (int i = 0; i < ws->n; i++) {
        if (ws->ask[i] && ws->sock[i]) {
            ws->ready[i] = skv_zmq_has_input(ws->sock[i]);
            ws->ask[i] = false;
        }
        any |= ws->ready[i];
    }
    return any;
}

/* Fills ws->ready, sleeping up to timeout_ms when no socket has input. The fds are polled
 * even then (without waiting): a socket that always has input must not hide the others, whose
 * fds alone say they have some. */
static int waitset_wait(struct waitset *ws, int timeout_ms)
{
    bool any = waitset_ask(ws);
    int n = poll(ws->fds, (nfds_t)ws->n, any ? 0 : timeout_ms);
    if (n < 0 && errno != EINTR)
        return skv_errorf(SKV_E_IO, "poll: %s", strerror(errno));
    for (int i = 0; i < ws->n; i++) /* a wait that timed out or was interrupted: ask them all */
        ws->ask[i] |= n < 0 || (n == 0 && !any) || (ws->fds[i].revents & (POLLIN | POLLERR | POLLHUP | POLLNVAL));
    waitset_ask(ws);
    return SKV_OK;
}

/* Socket i was served: its readiness must be asked again. */
static void waitset_served(struct waitset *ws, int i)
{
    ws->ready[i] = false;
    ws->ask[i] = true;
}

int skv_server_run(struct skv_server *srv)
{
    struct waitset ws;
    int rc = waitset_init(srv, &ws);
    while (!rc && !*srv->env.stop) {
        if (skv_worker_device_lost(srv->worker)) { /* the stop below, without a save; exit 1 */
            rc = skv_errorf(SKV_E_DEVICE, "the device was lost");
            break;
        }
        if ((rc = waitset_wait(&ws, 200)))
            break; /* the stop below still runs: the worker must not be joined unread */
        if (*srv->env.reopen) {
            *srv->env.reopen = 0;
            /* SIGHUP (systemctl reload): the log file and the key lists; the config is read at start only */
            if (!*srv->env.cfg->log_file)
                skv_log(SKV_LOG_INFO, "SIGHUP: no log-file to reopen; re-reading the authorized keys (a changed "
                        "snapkvd.conf takes a restart)");
            else if (skv_log_reopen())
                skv_log(SKV_LOG_ERROR, "log file not reopened (still writing to the one open before): %s",
                        skv_error_msg());
            else
                skv_log(SKV_LOG_INFO, "SIGHUP: log reopened; re-reading the authorized keys (a changed snapkvd.conf "
                        "takes a restart)");
            if (skv_auth_reload(srv->auth))
                skv_log(SKV_LOG_ERROR, "authorized keys not reloaded (the old ones stay in force): %s",
                        skv_error_msg());
        }
        if (srv->env.tick)
            srv->env.tick(srv);
        bool auth = false;
        for (int i = WAIT_AUTH; i < ws.n; i++)
            auth |= ws.ready[i];
        if (auth) {
            skv_auth_serve(srv->auth);
            for (int i = WAIT_AUTH; i < ws.n; i++)
                waitset_served(&ws, i);
        }
        if (ws.ready[WAIT_REPLIES]) {
            while (forward_reply(srv, ZMQ_DONTWAIT))
                ;
            waitset_served(&ws, WAIT_REPLIES);
            ws.ask[WAIT_CLIENT] = ws.ask[WAIT_ADMIN] = true; /* replies went out on these */
        }
        if (ws.ready[WAIT_CONNECTIONS]) {
            read_connections(srv);
            waitset_served(&ws, WAIT_CONNECTIONS);
        }
        if (ws.ready[WAIT_ADMIN_CONNECTIONS]) {
            read_admin_connections(srv);
            waitset_served(&ws, WAIT_ADMIN_CONNECTIONS);
        }
        if (ws.ready[WAIT_REPLAY]) { /* a few per wake: each may send every session */
            for (int k = 0; k < 4 && skv_events_mirror_serve(srv->mirror, srv->replay, srv->events_seq,
                                                            skv_worker_boot_id(srv->worker));
                 k++)
                ;
            waitset_served(&ws, WAIT_REPLAY);
        }
        uint64_t now = skv_now_ms();
        events_heartbeat(srv, now);
        if (now - srv->clients_expired_ms >= 1000) {
            skv_clients_expire(srv->clients, now);
            srv->clients_expired_ms = now;
        }
        for (int i = WAIT_ADMIN; i >= WAIT_CLIENT; i--) {
            if (!ws.ready[i])
                continue;
            /* the admin endpoint first: an operator's STATUS or EVICT during a flood of client
             * requests waits for no batch of them. Fairness: a bounded batch per socket; a socket
             * left with input is asked again, one drained was asked last (nothing used it since) */
            bool more = serve_ready(srv, i, 64, true);
            ws.ready[i] = false;
            ws.ask[i] = more;
            if (i == WAIT_CLIENT)
                ws.ask[WAIT_CONNECTIONS] = true; /* read before each client request */
        }
    }
    /* Stop accepting: the worker refuses new work from now on, so what already arrived is
     * answered SKV_E_CANCELLED here (a bounded number: clients that keep sending do not hold
     * the stop up); it answers its queue, cancels its decodes and saves, and every reply is
     * forwarded until its last message. The pipe is read all along: a worker that filled it
     * (decodes streaming while a long forward ends, a long queue answered) would otherwise
     * block, and the stop with it, until systemd killed the daemon unsaved. */
    skv_worker_request_stop(srv->worker);
    for (int i = 0; i < 2; i++)
        serve_ready(srv, i, STOP_DRAIN_MAX, false);
    drain_worker(srv);
    /* the probes answered "stopping" through the drain; the worker they read goes now */
    skv_metrics_http_stop(&srv->metrics);
    skv_worker_stop(&srv->worker);
    /* the connections stay open a moment after the last replies went out: a client's libzmq
     * with ZMQ_IMMEDIATE (libsnapkv's) drops what its program has not read yet when the
     * connection closes, so a final "cancelled" reply could be lost to a slow reader (the ASan
     * run of test_sigterm_mid_decode at d244617) */
    if (rc == SKV_OK)
        usleep(STOP_READ_GRACE_MS * 1000);
    return rc;
}
