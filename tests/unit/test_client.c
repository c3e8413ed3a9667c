/* libsnapkv without the daemon: argument checks, the thread-local last error, session ids,
 * shared memory, and every command against a fake ROUTER peer (a thread of this test answering
 * canned replies): request encoding, reply decoding, streaming, timeouts (a daemon that is gone
 * or no longer reading included), stale replies, version mismatches and malformed replies. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <grp.h>
#include <pwd.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "libclient/snapkv.h"
#include "proto/snapkv.pb-c.h"

/* ---- the fake daemon -------------------------------------------------------------------------- */

struct fake;
/* Answers one request (HELLO included when it returns true; false: use the default HELLO). */
typedef bool (*fake_handler)(struct fake *f, const Snapkv__Request *req);

struct fake {
    void *ctx;
    void *router;
    char endpoint[128];
    pthread_t thread;
    atomic_bool stop;
    atomic_bool deaf;               /* reads nothing more (a daemon that hangs or is stopped) */
    fake_handler handler;
    atomic_uint hello_version;      /* version in the HELLO reply (set by the test while the fake runs) */
    atomic_ullong max_message_bytes;
    atomic_uint n_vocab;            /* in the HELLO reply; another value also names another model */
    atomic_uint head_dim, n_kv_heads; /* in the HELLO reply when set (else 4 and 3; n_heads twice
                                       * n_kv_heads) */
    atomic_int close_hellos;        /* HELLOs whose connection is shut down unanswered (a daemon
                                     * past a connection limit whose handshake finished first) */

    /* the request being answered (fake thread only) */
    uint8_t ident[256];
    size_t ident_len;
    uint64_t request_id;

    pthread_mutex_t lock;           /* guards what the test reads back */
    int n_requests;                 /* every request, HELLO included */
    uint8_t last[1 << 16];          /* the last request, packed */
    size_t last_len;
    int step;                       /* per-test state, touched by the fake thread only */
};

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void fake_send_raw(struct fake *f, const void *data, size_t len, bool delimiter)
{
    zmq_send(f->router, f->ident, f->ident_len, ZMQ_SNDMORE);
    if (delimiter)
        zmq_send(f->router, "", 0, ZMQ_SNDMORE);
    zmq_send(f->router, data, len, 0);
}

/* Sends rep for the current request (version 1 and the request id unless set already). */
static void fake_send(struct fake *f, Snapkv__Reply *rep)
{
    if (!rep->version)
        rep->version = 1;
    if (!rep->request_id)
        rep->request_id = f->request_id;
    uint8_t buf[1 << 16];
    size_t len = snapkv__reply__get_packed_size(rep);
    if (len > sizeof buf)
        return; /* no cmocka asserts on this thread: the test sees a timeout instead */
    snapkv__reply__pack(rep, buf);
    fake_send_raw(f, buf, len, false);
}

static void fake_error(struct fake *f, int status, const char *message)
{
    Snapkv__Reply rep = SNAPKV__REPLY__INIT;
    rep.status = status;
    rep.message = (char *)message;
    rep.final = true;
    fake_send(f, &rep);
}

static void fake_hello(struct fake *f, const Snapkv__Request *req)
{
    (void)req;
    Snapkv__Reply rep = SNAPKV__REPLY__INIT;
    Snapkv__HelloReply h = SNAPKV__HELLO_REPLY__INIT;
    h.server_version = "0.1.0-fake";
    h.n_vocab = atomic_load(&f->n_vocab);
    h.model_name = h.n_vocab == 100 ? "tiny" : "other";
    h.model_fingerprint = h.n_vocab == 100 ? "abc123" : "def456";
    h.backend = "cpu";
    h.n_layers = 2;
    h.n_kv_heads = atomic_load(&f->n_kv_heads) ? atomic_load(&f->n_kv_heads) : 3;
    h.n_heads = 2 * h.n_kv_heads;
    h.head_dim = atomic_load(&f->head_dim) ? atomic_load(&f->head_dim) : 4;
    h.max_prompt_tokens = 50;
    h.max_new_tokens = 64;
    h.max_sessions_per_tenant = 8;
    h.max_bytes_per_tenant = 1 << 30;
    h.max_message_bytes = atomic_load(&f->max_message_bytes);
    h.kv_block_tokens = 16;
    h.bos_token = 1;
    h.eos_token = 2;
    rep.version = atomic_load(&f->hello_version);
    rep.final = true;
    rep.result_case = SNAPKV__REPLY__RESULT_HELLO;
    rep.hello = &h;
    fake_send(f, &rep);
}

static void *fake_main(void *arg)
{
    struct fake *f = arg;
    while (!atomic_load(&f->stop)) {
        if (atomic_load(&f->deaf)) {
            usleep(5 * 1000);
            continue;
        }
        zmq_pollitem_t item = {.socket = f->router, .events = ZMQ_POLLIN};
        if (zmq_poll(&item, 1, 20) <= 0)
            continue;
        int n = zmq_recv(f->router, f->ident, sizeof f->ident, 0);
        if (n < 0)
            continue;
        f->ident_len = (size_t)n;
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        zmq_msg_recv(&msg, f->router, 0);
        Snapkv__Request *req = snapkv__request__unpack(NULL, zmq_msg_size(&msg), zmq_msg_data(&msg));
        pthread_mutex_lock(&f->lock);
        f->n_requests++;
        f->last_len = zmq_msg_size(&msg) < sizeof f->last ? zmq_msg_size(&msg) : 0;
        memcpy(f->last, zmq_msg_data(&msg), f->last_len);
        pthread_mutex_unlock(&f->lock);
        if (req && req->command_case == SNAPKV__REQUEST__COMMAND_HELLO && atomic_load(&f->close_hellos) > 0) {
            atomic_fetch_sub(&f->close_hellos, 1);
            shutdown(zmq_msg_get(&msg, ZMQ_SRCFD), SHUT_RDWR);
            snapkv__request__free_unpacked(req, NULL);
            req = NULL;
        }
        zmq_msg_close(&msg);
        if (!req)
            continue;
        f->request_id = req->request_id;
        bool handled = f->handler && f->handler(f, req);
        if (!handled && req->command_case == SNAPKV__REQUEST__COMMAND_HELLO)
            fake_hello(f, req);
        snapkv__request__free_unpacked(req, NULL);
    }
    return NULL;
}

/* A fake bound to `endpoint` (NULL: a free loopback port); rcvhwm > 0 caps the requests its
 * socket buffers while the fake does not read them. */
static struct fake *fake_start_on(fake_handler handler, const char *endpoint, int rcvhwm)
{
    struct fake *f = calloc(1, sizeof *f);
    assert_non_null(f);
    f->handler = handler;
    f->hello_version = 1;
    f->max_message_bytes = 1 << 20;
    f->n_vocab = 100;
    pthread_mutex_init(&f->lock, NULL);
    f->ctx = zmq_ctx_new();
    f->router = zmq_socket(f->ctx, ZMQ_ROUTER);
    int linger = 0;
    zmq_setsockopt(f->router, ZMQ_LINGER, &linger, sizeof linger);
    if (rcvhwm > 0)
        zmq_setsockopt(f->router, ZMQ_RCVHWM, &rcvhwm, sizeof rcvhwm);
    assert_int_equal(zmq_bind(f->router, endpoint ? endpoint : "tcp://127.0.0.1:*"), 0);
    size_t len = sizeof f->endpoint;
    zmq_getsockopt(f->router, ZMQ_LAST_ENDPOINT, f->endpoint, &len);
    assert_int_equal(pthread_create(&f->thread, NULL, fake_main, f), 0);
    return f;
}

static struct fake *fake_start(fake_handler handler)
{
    return fake_start_on(handler, NULL, 0);
}

static void fake_stop(struct fake **fp)
{
    struct fake *f = *fp;
    atomic_store(&f->stop, true);
    pthread_join(f->thread, NULL);
    zmq_close(f->router);
    zmq_ctx_term(f->ctx);
    pthread_mutex_destroy(&f->lock);
    free(f);
    *fp = NULL;
}

static int fake_requests(struct fake *f)
{
    pthread_mutex_lock(&f->lock);
    int n = f->n_requests;
    pthread_mutex_unlock(&f->lock);
    return n;
}

/* Waits (up to 5 s) until the fake has read n requests, HELLO included: it reads them in its
 * own time. */
static void fake_await(struct fake *f, int n)
{
    for (int i = 0; i < 500 && fake_requests(f) < n; i++)
        usleep(10 * 1000);
}

/* The last request the fake received (free with snapkv__request__free_unpacked). */
static Snapkv__Request *fake_last(struct fake *f)
{
    pthread_mutex_lock(&f->lock);
    Snapkv__Request *req = snapkv__request__unpack(NULL, f->last_len, f->last);
    pthread_mutex_unlock(&f->lock);
    assert_non_null(req);
    return req;
}

static snapkv_client_t *connect_fake(struct fake *f, int timeout_ms)
{
    struct snapkv_connect_opts o = {.tenant = "acme", .name = "unit", .timeout_ms = timeout_ms};
    snapkv_client_t *c = NULL;
    int rc = snapkv_connect(f->endpoint, &o, &c);
    if (rc)
        fail_msg("connect: %s", snapkv_last_error());
    return c;
}

static const struct snapkv_session_id ID_A = {{0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa,
                                               0xbb, 0xcc, 0xdd, 0xee, 0xff}};
static const struct snapkv_session_id ID_B = {{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}};

static ProtobufCBinaryData wire_id(const struct snapkv_session_id *id)
{
    return (ProtobufCBinaryData){.len = 16, .data = (uint8_t *)id->bytes};
}

static void assert_wire_id(ProtobufCBinaryData b, const struct snapkv_session_id *id)
{
    assert_int_equal(b.len, 16);
    assert_memory_equal(b.data, id->bytes, 16);
}

/* ---- session ids, last error, argument checks -------------------------------------------------- */

static void test_session_id_hex(void **state)
{
    (void)state;
    char hex[SNAPKV_SESSION_ID_HEX_SIZE];
    assert_int_equal(snapkv_session_id_to_hex(&ID_A, hex, sizeof hex), SNAPKV_OK);
    assert_string_equal(hex, "00112233445566778899aabbccddeeff");
    struct snapkv_session_id back;
    assert_int_equal(snapkv_session_id_from_hex(hex, &back), SNAPKV_OK);
    assert_memory_equal(back.bytes, ID_A.bytes, 16);
    assert_int_equal(snapkv_session_id_from_hex("00112233445566778899AABBCCDDEEFF", &back), SNAPKV_OK);
    assert_memory_equal(back.bytes, ID_A.bytes, 16);

    struct snapkv_session_id untouched = ID_B;
    assert_int_equal(snapkv_session_id_from_hex("00112233445566778899aabbccddeef", &untouched), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_session_id_from_hex("00112233445566778899aabbccddeeff0", &untouched), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_session_id_from_hex("0011223344556677g899aabbccddeeff", &untouched), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_session_id_from_hex("", &untouched), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_session_id_from_hex(NULL, &untouched), SNAPKV_E_INVAL);
    assert_memory_equal(untouched.bytes, ID_B.bytes, 16);
    assert_non_null(strstr(snapkv_last_error(), "required"));
    assert_int_equal(snapkv_session_id_to_hex(&ID_A, hex, 32), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_session_id_to_hex(NULL, hex, sizeof hex), SNAPKV_E_INVAL);
}

static void *read_last_error(void *arg)
{
    (void)arg;
    return (void *)(strcmp(snapkv_last_error(), "") == 0 ? "empty" : "set");
}

static void test_last_error(void **state)
{
    (void)state;
    snapkv_client_t *c = (snapkv_client_t *)0x1;
    assert_int_equal(snapkv_connect(NULL, NULL, &c), SNAPKV_E_INVAL);
    assert_ptr_equal(c, (snapkv_client_t *)0x1); /* out untouched */
    assert_string_equal(snapkv_last_error(), "endpoint and out are required");
    /* thread-local: another thread has its own, empty message */
    pthread_t t;
    void *res = NULL;
    pthread_create(&t, NULL, read_last_error, NULL);
    pthread_join(t, &res);
    assert_string_equal((const char *)res, "empty");
    /* a later success does not clear it */
    char hex[SNAPKV_SESSION_ID_HEX_SIZE];
    assert_int_equal(snapkv_session_id_to_hex(&ID_A, hex, sizeof hex), SNAPKV_OK);
    assert_string_equal(snapkv_last_error(), "endpoint and out are required");
    assert_string_equal(snapkv_status_str(SNAPKV_E_POOL_FULL), "kv pool full");
    assert_string_equal(snapkv_status_str(SNAPKV_E_TIMEOUT), "timed out");
    /* a tenant the daemon would refuse on every call is refused at connect, before any I/O */
    char longname[70];
    memset(longname, 'a', 64);
    longname[64] = '\0';
    const char *bad[] = {"a b", "x/y", "\xc3\xbcn", "t\n", longname};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct snapkv_connect_opts o = {.tenant = bad[i]};
        assert_int_equal(snapkv_connect("ipc:///nonexistent/skv.sock", &o, &c), SNAPKV_E_INVAL);
        assert_non_null(strstr(snapkv_last_error(), "letters, digits and . _ - @"));
    }
    assert_ptr_equal(c, (snapkv_client_t *)0x1);
}

static void test_null_client(void **state)
{
    (void)state;
    struct snapkv_prefill_opts po = {.text = "hi"};
    struct snapkv_prefill_result pr;
    assert_int_equal(snapkv_prefill(NULL, &po, &pr), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_release(NULL, &ID_A), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_decode(NULL, &ID_A, NULL, NULL, NULL, NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_admin_evict(NULL, &ID_A, NULL, false, NULL, NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_set_timeout(NULL, 10), SNAPKV_E_INVAL);
    struct snapkv_server_info si;
    assert_int_equal(snapkv_server_info(NULL, &si), SNAPKV_E_INVAL);
    /* destructors accept NULL and zeroed structs */
    snapkv_close(NULL);
    snapkv_client_t *none = NULL;
    snapkv_close(&none);
    snapkv_prefill_result_free(NULL);
    struct snapkv_prefill_result zp = {0};
    snapkv_prefill_result_free(&zp);
    struct snapkv_decode_result zd = {0};
    snapkv_decode_result_free(&zd);
    struct snapkv_stats zs = {0};
    snapkv_stats_free(&zs);
    struct snapkv_shm zshm = {0};
    snapkv_shm_destroy(&zshm);
    snapkv_shm_destroy(NULL);
}

static void test_argument_checks(void **state)
{
    (void)state;
    struct fake *f = fake_start(NULL);
    snapkv_client_t *c = connect_fake(f, 2000);
    int before = fake_requests(f);
    assert_int_equal(before, 1);

    struct snapkv_prefill_result pr = {.n_tokens = 777};
    uint32_t toks[3] = {5, 6, 7};
    struct snapkv_prefill_opts both = {.tokens = toks, .n_tokens = 3, .text = "x"};
    assert_int_equal(snapkv_prefill(c, &both, &pr), SNAPKV_E_INVAL);
    struct snapkv_prefill_opts neither = {.text = ""};
    assert_int_equal(snapkv_prefill(c, &neither, &pr), SNAPKV_E_INVAL);
    struct snapkv_prefill_opts null_tokens = {.n_tokens = 3};
    assert_int_equal(snapkv_prefill(c, &null_tokens, &pr), SNAPKV_E_INVAL);
    uint32_t bad[2] = {5, 100};
    struct snapkv_prefill_opts out_of_vocab = {.tokens = bad, .n_tokens = 2};
    assert_int_equal(snapkv_prefill(c, &out_of_vocab, &pr), SNAPKV_E_INVAL);
    assert_non_null(strstr(snapkv_last_error(), "vocabulary"));
    uint32_t many[51] = {0};
    struct snapkv_prefill_opts too_long = {.tokens = many, .n_tokens = 51};
    assert_int_equal(snapkv_prefill(c, &too_long, &pr), SNAPKV_E_LIMIT);
    assert_int_equal(snapkv_prefill(c, NULL, &pr), SNAPKV_E_INVAL);
    assert_string_equal(snapkv_last_error(), "prefill: options are required");
    assert_int_equal(snapkv_prefill(c, &(struct snapkv_prefill_opts){.text = "x"}, NULL), SNAPKV_E_INVAL);
    struct snapkv_prefill_opts chat_tokens = {.tokens = toks, .n_tokens = 3, .chat = true};
    assert_int_equal(snapkv_prefill(c, &chat_tokens, &pr), SNAPKV_E_INVAL);
    assert_non_null(strstr(snapkv_last_error(), "chat renders text"));
    assert_int_equal(pr.n_tokens, 777);
    assert_int_equal(snapkv_import_kv(c, NULL, NULL), SNAPKV_E_INVAL);
    assert_string_equal(snapkv_last_error(), "import: options are required");
    assert_int_equal(snapkv_server_info(c, NULL), SNAPKV_E_INVAL);
    assert_string_equal(snapkv_last_error(), "snapkv_server_info: NULL argument");

    struct snapkv_append_opts ao = {0};
    assert_int_equal(snapkv_append(c, &ID_A, &ao, NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_append(c, NULL, &(struct snapkv_append_opts){.text = "x"}, NULL), SNAPKV_E_INVAL);
    assert_string_equal(snapkv_last_error(), "append: a session id is required");
    assert_int_equal(snapkv_append(c, &ID_A, &(struct snapkv_append_opts){.tokens = toks, .n_tokens = 3, .chat = true},
                                   NULL), SNAPKV_E_INVAL);

    assert_int_equal(snapkv_decode(c, &ID_A, NULL, NULL, NULL, NULL), SNAPKV_E_INVAL);
    struct snapkv_decode_result dr;
    struct snapkv_sampling s;
    snapkv_sampling_defaults(&s);
    s.top_p = 1.5f;
    assert_int_equal(snapkv_decode(c, &ID_A, &s, NULL, NULL, &dr), SNAPKV_E_INVAL);
    snapkv_sampling_defaults(&s);
    s.temperature = -1.0f;
    assert_int_equal(snapkv_decode(c, &ID_A, &s, NULL, NULL, &dr), SNAPKV_E_INVAL);
    s.temperature = 150.0f; /* the daemon's limit is 100: refused here, with the limit named */
    assert_int_equal(snapkv_decode(c, &ID_A, &s, NULL, NULL, &dr), SNAPKV_E_INVAL);
    assert_non_null(strstr(snapkv_last_error(), "temperature must be in [0, 100]"));
    snapkv_sampling_defaults(&s);
    s.n_stop_tokens = 2;
    assert_int_equal(snapkv_decode(c, &ID_A, &s, NULL, NULL, &dr), SNAPKV_E_INVAL);
    uint32_t stop_bad[2] = {2, 100}; /* the fake's vocabulary is 100 */
    s.stop_tokens = stop_bad;
    assert_int_equal(snapkv_decode(c, &ID_A, &s, NULL, NULL, &dr), SNAPKV_E_INVAL);
    assert_non_null(strstr(snapkv_last_error(), "stop token 100 at index 1 is outside the vocabulary"));
    /* min_p, penalties, biases: a daemon whose HELLO does not list "sampling-ext" (the fake's, as
     * an older daemon's) would ignore them: refused, nothing sent; all off goes through the checks */
    struct snapkv_sampling_ext ext;
    snapkv_sampling_ext_defaults(&ext);
    ext.repetition_penalty = 1.2f;
    snapkv_sampling_defaults(&s);
    int sent = fake_requests(f);
    assert_int_equal(snapkv_decode_ext(c, &ID_A, &s, &ext, 0, NULL, NULL, &dr, NULL), SNAPKV_E_UNSUPPORTED);
    assert_non_null(strstr(snapkv_last_error(), "snapkvd 0.1.0-fake"));
    snapkv_sampling_ext_defaults(&ext);
    ext.n_bias = 1;
    assert_int_equal(snapkv_decode_ext(c, &ID_A, &s, &ext, 0, NULL, NULL, &dr, NULL), SNAPKV_E_UNSUPPORTED);
    ext.repetition_penalty = 1.0f;
    ext.n_bias = 0;
    assert_int_equal(snapkv_decode_ext(c, &ID_A, &s, &ext, 3, NULL, NULL, &dr, NULL), SNAPKV_E_INVAL);
    ext.reserved[2] = 1;
    assert_int_equal(snapkv_decode_ext(c, &ID_A, &s, &ext, 0, NULL, NULL, &dr, NULL), SNAPKV_E_INVAL);
    assert_non_null(strstr(snapkv_last_error(), "reserved[2]"));
    struct snapkv_tokens tk; /* TOKENIZE, DETOKENIZE: not sent to a daemon without "tokenize" */
    assert_int_equal(snapkv_tokenize(c, "hi", NULL, &tk), SNAPKV_E_UNSUPPORTED);
    char *txt = NULL;
    assert_int_equal(snapkv_detokenize(c, stop_bad, 1, false, &txt), SNAPKV_E_UNSUPPORTED);
    assert_int_equal(snapkv_tokenize(c, NULL, NULL, &tk), SNAPKV_E_INVAL);
    /* prompt scores: not sent to a daemon without "prompt-logprobs"; scores required */
    struct snapkv_scores sc;
    struct snapkv_prefill_result pres;
    const uint32_t two[2] = {1, 2};
    struct snapkv_prefill_opts spo = {.tokens = two, .n_tokens = 2};
    assert_int_equal(snapkv_prefill_scored(c, &spo, 0, &pres, &sc), SNAPKV_E_UNSUPPORTED);
    assert_non_null(strstr(snapkv_last_error(), "does not score prompts"));
    assert_null(sc.logprobs);
    assert_int_equal(snapkv_prefill_scored(c, &spo, 0, &pres, NULL), SNAPKV_E_INVAL);
    assert_non_null(strstr(snapkv_last_error(), "scores is required"));
    struct snapkv_append_opts sao = {.tokens = two, .n_tokens = 2};
    assert_int_equal(snapkv_append_scored(c, &ID_A, &sao, NULL, &sc), SNAPKV_E_UNSUPPORTED);
    assert_int_equal(snapkv_append_scored(c, &ID_A, &sao, NULL, NULL), SNAPKV_E_INVAL);
    /* each position's most likely tokens: not sent without "prompt-top-logprobs"; at most 20,
     * and somewhere to put them */
    struct snapkv_logprobs top;
    assert_int_equal(snapkv_prefill_scored_top(c, &spo, 0, 3, &pres, &sc, &top), SNAPKV_E_UNSUPPORTED);
    assert_non_null(strstr(snapkv_last_error(), "prompt_top_logprobs"));
    assert_null(top.top_tokens);
    assert_int_equal(snapkv_append_scored_top(c, &ID_A, &sao, 21, NULL, &sc, &top), SNAPKV_E_LIMIT);
    assert_int_equal(snapkv_append_scored_top(c, &ID_A, &sao, 3, NULL, &sc, NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_prefill_scored_top(c, &spo, 0, 0, &pres, &sc, NULL), SNAPKV_E_UNSUPPORTED);
    assert_non_null(strstr(snapkv_last_error(), "does not score prompts"));
    snapkv_scores_free(&sc);
    snapkv_scores_free(NULL);
    assert_int_equal(fake_requests(f), sent);

    assert_int_equal(snapkv_compress(c, &ID_A, "", 0, NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_compress(c, &ID_A, NULL, 0, NULL), SNAPKV_E_INVAL);
    struct snapkv_session_id out;
    assert_int_equal(snapkv_fork(c, &ID_A, NULL, NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_fork(c, NULL, &out, NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_release(c, NULL), SNAPKV_E_INVAL);

    assert_int_equal(snapkv_admin_evict(c, NULL, NULL, false, NULL, NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_admin_evict(c, &ID_A, "t", false, NULL, NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_admin_evict(c, NULL, "t", true, NULL, NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_admin_evict(c, NULL, "", false, NULL, NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_admin_save(c, &ID_A, "../etc/passwd", NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_admin_save(c, &ID_A, "", NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_admin_save(c, &ID_A, "..", NULL), SNAPKV_E_INVAL);
    char longname[70];
    memset(longname, 'a', 65);
    longname[65] = '\0';
    assert_int_equal(snapkv_admin_save(c, &ID_A, longname, NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_admin_load(c, "a/b", NULL, &out), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_admin_load(c, "ok", NULL, NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_admin_inspect(c, &ID_A, false, NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_admin_list(c, NULL, NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_admin_stats(c, false, NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_set_timeout(c, -2), SNAPKV_E_INVAL);

    struct snapkv_shm shm;
    assert_int_equal(snapkv_shm_create("x", 64, &shm), SNAPKV_OK);
    struct snapkv_kv_layout lay;
    assert_int_equal(snapkv_export_kv(c, &ID_A, &shm, 64, &lay), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_export_kv(c, &ID_A, NULL, 0, &lay), SNAPKV_E_INVAL);
    struct snapkv_import_opts io = {.shm = &shm};
    assert_int_equal(snapkv_import_kv(c, &io, &out), SNAPKV_E_INVAL); /* no layers */
    snapkv_shm_destroy(&shm);

    /* none of these reached the daemon */
    assert_int_equal(fake_requests(f), before);
    snapkv_close(&c);
    assert_null(c);
    fake_stop(&f);
}

/* ---- connection ------------------------------------------------------------------------------------ */

static void test_connect_hello(void **state)
{
    (void)state;
    struct fake *f = fake_start(NULL);
    snapkv_client_t *c = connect_fake(f, 2000);
    Snapkv__Request *req = fake_last(f);
    assert_int_equal(req->version, 1);
    assert_int_equal(req->request_id, 1);
    assert_string_equal(req->tenant, "acme");
    assert_int_equal(req->command_case, SNAPKV__REQUEST__COMMAND_HELLO);
    assert_string_equal(req->hello->client_name, "unit");
    assert_string_equal(req->hello->tenant, "acme");
    assert_int_equal(req->hello->pid, (uint32_t)getpid());
    snapkv__request__free_unpacked(req, NULL);

    struct snapkv_server_info si;
    assert_int_equal(snapkv_server_info(c, &si), SNAPKV_OK);
    assert_string_equal(si.server_version, "0.1.0-fake");
    assert_string_equal(si.model_name, "tiny");
    assert_string_equal(si.model_fingerprint, "abc123");
    assert_string_equal(si.backend, "cpu");
    assert_int_equal(si.n_layers, 2);
    assert_int_equal(si.n_kv_heads, 3);
    assert_int_equal(si.head_dim, 4);
    assert_int_equal(si.n_vocab, 100);
    assert_int_equal(si.max_prompt_tokens, 50);
    assert_int_equal(si.kv_block_tokens, 16);
    assert_int_equal(si.eos_token, 2);
    assert_int_equal(si.max_sessions_per_tenant, 8);
    snapkv_close(&c);

    /* defaults: tenant "default", name "libsnapkv" */
    assert_int_equal(snapkv_connect(f->endpoint, NULL, &c), SNAPKV_OK);
    req = fake_last(f);
    assert_string_equal(req->tenant, "default");
    assert_string_equal(req->hello->client_name, "libsnapkv");
    snapkv__request__free_unpacked(req, NULL);
    snapkv_close(&c);
    fake_stop(&f);
}

static void test_version_mismatch(void **state)
{
    (void)state;
    struct fake *f = fake_start(NULL);
    atomic_store(&f->hello_version, 2);
    snapkv_client_t *c = NULL;
    struct snapkv_connect_opts o = {.timeout_ms = 2000};
    assert_int_equal(snapkv_connect(f->endpoint, &o, &c), SNAPKV_E_VERSION);
    assert_null(c);
    assert_non_null(strstr(snapkv_last_error(), "protocol 2"));
    fake_stop(&f);
}

static bool answer_nothing(struct fake *f, const Snapkv__Request *req)
{
    (void)f;
    return req->command_case == SNAPKV__REQUEST__COMMAND_HELLO;
}

static void test_connect_timeout(void **state)
{
    (void)state;
    struct fake *f = fake_start(answer_nothing);
    snapkv_client_t *c = NULL;
    struct snapkv_connect_opts o = {.timeout_ms = 150};
    int64_t t0 = now_ms();
    assert_int_equal(snapkv_connect(f->endpoint, &o, &c), SNAPKV_E_TIMEOUT);
    int64_t dt = now_ms() - t0;
    assert_true(dt >= 140 && dt < 2000);
    assert_null(c);
    assert_non_null(strstr(snapkv_last_error(), "150 ms"));
    fake_stop(&f);

    /* an ipc:// endpoint: the message says whether its socket file is there */
    assert_int_equal(snapkv_connect("ipc:///nonexistent-skv/c.sock", &o, &c), SNAPKV_E_TIMEOUT);
    assert_non_null(strstr(snapkv_last_error(), "no socket file /nonexistent-skv/c.sock"));
    char dir[] = "/tmp/skv-perm-XXXXXX", path[64], ep[80];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/c.sock", dir);
    snprintf(ep, sizeof ep, "ipc://%s", path);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0); /* a file, nobody listening */
    assert_int_equal(snapkv_connect(ep, &o, &c), SNAPKV_E_TIMEOUT);
    assert_non_null(strstr(snapkv_last_error(), "is there and nothing answered"));
    close(fd);
    unlink(path);
    rmdir(dir);
}

/* A daemon past a connection limit closes the connection as it comes; when the handshake
 * finished first, the HELLO sent on it is lost with it. snapkv_connect asks again on the next
 * connection (before, it failed with "closed while the HELLO reply was awaited"); a daemon that
 * closes every one fails it, naming the limits, within its timeout. */
static void test_connect_hello_lost(void **state)
{
    (void)state;
    struct fake *f = fake_start(NULL);
    atomic_store(&f->close_hellos, 2);
    snapkv_client_t *c = connect_fake(f, 5000);
    assert_int_equal(fake_requests(f), 3); /* two HELLOs lost, the third answered */
    struct snapkv_server_info info;
    assert_int_equal(snapkv_server_info(c, &info), SNAPKV_OK);
    assert_int_equal(info.n_vocab, 100);
    snapkv_close(&c);

    atomic_store(&f->close_hellos, 1000);
    struct snapkv_connect_opts o = {.timeout_ms = 1500};
    int64_t t0 = now_ms();
    int rc = snapkv_connect(f->endpoint, &o, &c);
    int64_t dt = now_ms() - t0;
    assert_null(c);
    if (rc != SNAPKV_E_IO && rc != SNAPKV_E_TIMEOUT) /* (lost last, or no reconnect before the end) */
        fail_msg("every HELLO lost: %d %s", rc, snapkv_last_error());
    assert_true(dt >= 1400 && dt < 4000);
    assert_non_null(strstr(snapkv_last_error(), rc == SNAPKV_E_IO ? "max-connections-per-peer" : "1500 ms"));
    printf("# every HELLO lost: %d tries in %lld ms: %s\n", fake_requests(f) - 3, (long long)dt, snapkv_last_error());
    assert_true(fake_requests(f) >= 3 + 2);
    fake_stop(&f);
}

/* An ipc:// socket this user may not open: PERM at once, saying why (run as another user than
 * root, which may open any file; skipped as root). */
static void test_connect_no_permission(void **state)
{
    (void)state;
    if (geteuid() == 0)
        skip();
    char dir[] = "/tmp/skv-perm-XXXXXX", ep[80];
    assert_non_null(mkdtemp(dir));
    assert_int_equal(chmod(dir, 0), 0); /* no search permission: the socket cannot be reached */
    snprintf(ep, sizeof ep, "ipc://%s/c.sock", dir);
    snapkv_client_t *c = NULL;
    struct snapkv_connect_opts o = {.timeout_ms = 5000};
    int64_t t0 = now_ms();
    assert_int_equal(snapkv_connect(ep, &o, &c), SNAPKV_E_PERM);
    assert_true(now_ms() - t0 < 4000);
    assert_non_null(strstr(snapkv_last_error(), "permission denied"));
    chmod(dir, 0700);
    rmdir(dir);
}

/* ---- PREFILL --------------------------------------------------------------------------------------------- */

static bool answer_prefill(struct fake *f, const Snapkv__Request *req)
{
    if (req->command_case != SNAPKV__REQUEST__COMMAND_PREFILL)
        return false;
    if (req->prefill->progress) {
        for (uint32_t done = 100; done <= 300; done += 100) {
            Snapkv__Reply rep = SNAPKV__REPLY__INIT;
            Snapkv__PrefillReply p = SNAPKV__PREFILL_REPLY__INIT;
            p.tokens_done = done;
            p.n_tokens = 350;
            rep.result_case = SNAPKV__REPLY__RESULT_PREFILL;
            rep.prefill = &p;
            fake_send(f, &rep);
        }
        /* a progress reply with no result at all is tolerated */
        Snapkv__Reply bare = SNAPKV__REPLY__INIT;
        fake_send(f, &bare);
    }
    Snapkv__Reply rep = SNAPKV__REPLY__INIT;
    Snapkv__PrefillReply p = SNAPKV__PREFILL_REPLY__INIT;
    Snapkv__LayerKept l0 = SNAPKV__LAYER_KEPT__INIT, l1 = SNAPKV__LAYER_KEPT__INIT;
    uint32_t heads0[3] = {10, 7, 9};
    l0.layer = 0;
    l0.kept = 10;
    l0.n_kept_per_head = 3;
    l0.kept_per_head = heads0;
    l0.bytes = 1234;
    l1.layer = 1;
    l1.kept = 5; /* no per-head counts: every head keeps 5 */
    l1.bytes = 555;
    Snapkv__LayerKept *kept[2] = {&l0, &l1};
    float logits[100] = {0.5f, -1.0f, 2.0f, 3.5f}; /* n_vocab of them; "short logits" sends 4 */
    p.session_id = wire_id(&ID_A);
    p.n_tokens = 350;
    p.n_kept = 2;
    p.kept = kept;
    p.bytes_before = 9000;
    p.bytes_after = 1789;
    p.next_token = 42;
    if (req->prefill->return_logits) {
        p.n_logits = req->prefill->text && strcmp(req->prefill->text, "short logits") == 0 ? 4 : 100;
        p.logits = logits;
    }
    rep.final = true;
    rep.result_case = SNAPKV__REPLY__RESULT_PREFILL;
    rep.prefill = &p;
    fake_send(f, &rep);
    return true;
}

static void test_prefill_text(void **state)
{
    (void)state;
    struct fake *f = fake_start(answer_prefill);
    snapkv_client_t *c = connect_fake(f, 2000);
    struct snapkv_prefill_opts o = {
        .text = "Summarize this.",
        .chat = true,
        .compress = "policy=snapkv,ratio=0.1",
        .return_logits = true,
        .lease_seconds = 90,
    };
    struct snapkv_prefill_result r;
    assert_int_equal(snapkv_prefill(c, &o, &r), SNAPKV_OK);

    Snapkv__Request *req = fake_last(f);
    assert_int_equal(req->version, 1);
    assert_int_equal(req->request_id, 2);
    assert_string_equal(req->tenant, "acme");
    assert_int_equal(req->command_case, SNAPKV__REQUEST__COMMAND_PREFILL);
    assert_string_equal(req->prefill->text, "Summarize this.");
    assert_int_equal(req->prefill->n_tokens, 0);
    assert_true(req->prefill->chat);
    assert_non_null(req->prefill->compress);
    assert_string_equal(req->prefill->compress->spec, "policy=snapkv,ratio=0.1");
    assert_true(req->prefill->return_logits);
    assert_int_equal(req->prefill->lease_seconds, 90);
    assert_false(req->prefill->progress);
    assert_int_equal(req->deadline_ms, 2000); /* the client's timeout: the daemon need not go on past it */
    snapkv__request__free_unpacked(req, NULL);

    assert_memory_equal(r.id.bytes, ID_A.bytes, 16);
    assert_int_equal(r.n_tokens, 350);
    assert_int_equal(r.bytes_before, 9000);
    assert_int_equal(r.bytes_after, 1789);
    assert_int_equal(r.next_token, 42);
    assert_int_equal(r.n_layers, 2);
    assert_int_equal(r.layers[0].layer, 0);
    assert_int_equal(r.layers[0].kept, 10);
    assert_int_equal(r.layers[0].n_heads, 3);
    assert_int_equal(r.layers[0].kept_per_head[1], 7);
    assert_int_equal(r.layers[0].bytes, 1234);
    assert_null(r.layers[0].positions);
    assert_int_equal(r.layers[1].n_heads, 3); /* filled from HELLO's n_kv_heads */
    assert_int_equal(r.layers[1].kept_per_head[0], 5);
    assert_int_equal(r.layers[1].kept_per_head[2], 5);
    assert_int_equal(r.n_logits, 100);
    assert_true(r.logits[3] == 3.5f);
    snapkv_prefill_result_free(&r);
    assert_null(r.layers);
    assert_int_equal(r.n_layers, 0);
    /* a reply with fewer logits than the vocabulary (a caller may read n_vocab of them) */
    o.text = "short logits";
    assert_int_equal(snapkv_prefill(c, &o, &r), SNAPKV_E_PROTO);
    assert_non_null(strstr(snapkv_last_error(), "4 logits in the reply, 100 asked"));
    snapkv_close(&c);
    fake_stop(&f);
}

struct progress_log {
    int n;
    uint32_t done[8];
    uint32_t total;
};

static void on_progress(void *user, uint32_t done, uint32_t total)
{
    struct progress_log *p = user;
    if (p->n < 8)
        p->done[p->n++] = done;
    p->total = total;
}

static void test_prefill_tokens_progress(void **state)
{
    (void)state;
    struct fake *f = fake_start(answer_prefill);
    snapkv_client_t *c = connect_fake(f, 2000);
    uint32_t toks[5] = {1, 20, 30, 40, 99};
    struct progress_log log = {0};
    struct snapkv_prefill_opts o = {.tokens = toks, .n_tokens = 5, .progress = on_progress, .progress_user = &log};
    struct snapkv_prefill_result r;
    assert_int_equal(snapkv_prefill(c, &o, &r), SNAPKV_OK);
    Snapkv__Request *req = fake_last(f);
    assert_int_equal(req->prefill->n_tokens, 5);
    assert_int_equal(req->prefill->tokens[4], 99);
    assert_string_equal(req->prefill->text, "");
    assert_null(req->prefill->compress);
    assert_true(req->prefill->progress);
    assert_false(req->prefill->chat);
    snapkv__request__free_unpacked(req, NULL);
    assert_int_equal(log.n, 3);
    assert_int_equal(log.done[0], 100);
    assert_int_equal(log.done[2], 300);
    assert_int_equal(log.total, 350);
    assert_int_equal(r.n_logits, 0);
    assert_null(r.logits);
    snapkv_prefill_result_free(&r);
    snapkv_close(&c);
    fake_stop(&f);
}

static bool answer_error(struct fake *f, const Snapkv__Request *req)
{
    if (req->command_case == SNAPKV__REQUEST__COMMAND_HELLO)
        return false;
    if (req->command_case == SNAPKV__REQUEST__COMMAND_RELEASE)
        fake_error(f, -8, "no session 0011...");
    else if (req->command_case == SNAPKV__REQUEST__COMMAND_PREFILL)
        fake_error(f, -7, "");
    else
        fake_error(f, 5, "a positive status is not a status");
    return true;
}

static void test_error_status(void **state)
{
    (void)state;
    struct fake *f = fake_start(answer_error);
    snapkv_client_t *c = connect_fake(f, 2000);
    assert_int_equal(snapkv_release(c, &ID_A), SNAPKV_E_NOT_FOUND);
    assert_string_equal(snapkv_last_error(), "no session 0011...");
    struct snapkv_prefill_result r = {.n_tokens = 3};
    assert_int_equal(snapkv_prefill(c, &(struct snapkv_prefill_opts){.text = "x"}, &r), SNAPKV_E_POOL_FULL);
    assert_string_equal(snapkv_last_error(), "kv pool full");
    assert_int_equal(r.n_tokens, 3);
    struct snapkv_session_id out;
    assert_int_equal(snapkv_fork(c, &ID_A, &out, NULL), SNAPKV_E_PROTO);
    snapkv_close(&c);
    fake_stop(&f);
}

/* ---- DECODE ------------------------------------------------------------------------------------------------ */

static void send_decode(struct fake *f, bool final, const uint32_t *toks, size_t n, const char *text,
                        uint32_t n_generated, const char *finish)
{
    Snapkv__Reply rep = SNAPKV__REPLY__INIT;
    Snapkv__DecodeReply d = SNAPKV__DECODE_REPLY__INIT;
    d.n_tokens = n;
    d.tokens = (uint32_t *)toks;
    d.text = (char *)text;
    d.n_generated = n_generated;
    d.finish_reason = (char *)finish;
    rep.final = final;
    rep.result_case = SNAPKV__REPLY__RESULT_DECODE;
    rep.decode = &d;
    fake_send(f, &rep);
}

static bool answer_decode(struct fake *f, const Snapkv__Request *req)
{
    if (req->command_case == SNAPKV__REQUEST__COMMAND_RELEASE) {
        Snapkv__Reply rep = SNAPKV__REPLY__INIT;
        Snapkv__ReleaseReply r = SNAPKV__RELEASE_REPLY__INIT;
        rep.final = true;
        rep.result_case = SNAPKV__REPLY__RESULT_RELEASE;
        rep.release = &r;
        fake_send(f, &rep);
        return true;
    }
    if (req->command_case == SNAPKV__REQUEST__COMMAND_CANCEL) {
        Snapkv__Reply rep = SNAPKV__REPLY__INIT;
        Snapkv__CancelReply r = SNAPKV__CANCEL_REPLY__INIT;
        r.cancelled = true;
        r.n_generated = 2;
        rep.final = true;
        rep.result_case = SNAPKV__REPLY__RESULT_CANCEL;
        rep.cancel = &r;
        fake_send(f, &rep);
        return true;
    }
    if (req->command_case != SNAPKV__REQUEST__COMMAND_DECODE)
        return false;
    static const uint32_t t[6] = {11, 12, 13, 14, 15, 2};
    if (!req->decode->stream) {
        send_decode(f, true, t, 6, "Hello, world!", 6, "eos");
        return true;
    }
    send_decode(f, false, t, 2, "Hel", 2, "");
    send_decode(f, false, t + 2, 1, "", 3, ""); /* a partial UTF-8 character: text waits */
    send_decode(f, false, t + 3, 2, "lo, world", 5, "");
    send_decode(f, true, t + 5, 1, "!", 6, "eos");
    return true;
}

struct timeout_cb {
    snapkv_client_t *c;
    int set;
};

/* A streamed decode whose last reply comes 1.5 s after its first. */
static bool answer_decode_pause(struct fake *f, const Snapkv__Request *req)
{
    if (req->command_case != SNAPKV__REQUEST__COMMAND_DECODE)
        return false;
    static const uint32_t t[2] = {11, 2};
    send_decode(f, false, t, 1, "Hi", 1, "");
    usleep(1500 * 1000);
    send_decode(f, true, t + 1, 1, "", 2, "eos");
    return true;
}

static int set_timeout_in_callback(void *user, const uint32_t *tokens, size_t n_tokens, const char *text)
{
    (void)tokens;
    (void)n_tokens;
    (void)text;
    struct timeout_cb *t = user;
    assert_int_equal(snapkv_set_timeout(t->c, t->set), SNAPKV_OK);
    return 0;
}

/* snapkv_set_timeout in a callback sets how long the running call waits for its next reply:
 * -1 waits for ever (it timed out at once before), a longer one waits longer, and one that
 * keeps the 1 s times out before the fake's 1.5 s pause ends. */
static void test_timeout_set_in_callback(void **state)
{
    (void)state;
    struct fake *f = fake_start(answer_decode_pause);
    snapkv_client_t *c = connect_fake(f, 2000);
    struct snapkv_decode_result r;
    int sets[] = {-1, 5000};
    for (int i = 0; i < 2; i++) { /* 1 s for the first reply, set in the callback for the last */
        assert_int_equal(snapkv_set_timeout(c, 1000), SNAPKV_OK);
        struct timeout_cb t = {c, sets[i]};
        assert_int_equal(snapkv_decode(c, &ID_B, NULL, set_timeout_in_callback, &t, &r), SNAPKV_OK);
        assert_int_equal(r.n_tokens, 2);
        snapkv_decode_result_free(&r);
    }
    assert_int_equal(snapkv_set_timeout(c, 1000), SNAPKV_OK);
    struct timeout_cb t = {c, 1000};
    assert_int_equal(snapkv_decode(c, &ID_B, NULL, set_timeout_in_callback, &t, &r), SNAPKV_E_TIMEOUT);
    snapkv_close(&c);
    fake_stop(&f);
}

static void test_decode_collect(void **state)
{
    (void)state;
    struct fake *f = fake_start(answer_decode);
    snapkv_client_t *c = connect_fake(f, 2000);
    uint32_t stops[2] = {7, 8};
    struct snapkv_sampling s = {.temperature = 0.7f, .top_k = 40, .top_p = 0.9f, .seed = 1234567890123ull,
                                .stop_tokens = stops, .n_stop_tokens = 2, .max_tokens = 32, .stop_at_eos = true};
    struct snapkv_decode_result r;
    assert_int_equal(snapkv_decode(c, &ID_B, &s, NULL, NULL, &r), SNAPKV_OK);
    Snapkv__Request *req = fake_last(f);
    assert_int_equal(req->command_case, SNAPKV__REQUEST__COMMAND_DECODE);
    assert_wire_id(req->decode->session_id, &ID_B);
    assert_false(req->decode->stream);
    assert_non_null(req->decode->sampling);
    assert_true(req->decode->sampling->temperature == 0.7f);
    assert_int_equal(req->decode->sampling->top_k, 40);
    assert_true(req->decode->sampling->top_p == 0.9f);
    assert_int_equal(req->decode->sampling->seed, 1234567890123ull);
    assert_int_equal(req->decode->sampling->n_stop_tokens, 2);
    assert_int_equal(req->decode->sampling->stop_tokens[1], 8);
    assert_int_equal(req->decode->sampling->max_tokens, 32);
    assert_true(req->decode->sampling->stop_at_eos);
    snapkv__request__free_unpacked(req, NULL);
    assert_int_equal(r.n_tokens, 6);
    assert_int_equal(r.tokens[0], 11);
    assert_int_equal(r.tokens[5], 2);
    assert_string_equal(r.text, "Hello, world!");
    assert_int_equal(r.n_generated, 6);
    assert_string_equal(r.finish_reason, "eos");
    snapkv_decode_result_free(&r);

    /* NULL sampling: greedy, stop at eos */
    assert_int_equal(snapkv_decode(c, &ID_B, NULL, NULL, NULL, &r), SNAPKV_OK);
    req = fake_last(f);
    assert_true(req->decode->sampling->temperature == 0.0f);
    assert_true(req->decode->sampling->stop_at_eos);
    assert_int_equal(req->decode->sampling->max_tokens, 0);
    snapkv__request__free_unpacked(req, NULL);
    snapkv_decode_result_free(&r);
    snapkv_close(&c);
    fake_stop(&f);
}

struct stream_log {
    int batches;
    size_t tokens;
    char text[128];
    int stop_after;     /* > 0: return nonzero after this many batches */
};

static int on_tokens(void *user, const uint32_t *toks, size_t n, const char *text)
{
    struct stream_log *l = user;
    l->batches++;
    for (size_t i = 0; i < n; i++)
        assert_true(toks[i] >= 11 || toks[i] == 2);
    l->tokens += n;
    strncat(l->text, text, sizeof l->text - strlen(l->text) - 1);
    return l->stop_after && l->batches >= l->stop_after;
}

static void test_decode_stream(void **state)
{
    (void)state;
    struct fake *f = fake_start(answer_decode);
    snapkv_client_t *c = connect_fake(f, 2000);
    struct stream_log log = {0};
    struct snapkv_decode_result r;
    assert_int_equal(snapkv_decode(c, &ID_B, NULL, on_tokens, &log, &r), SNAPKV_OK);
    Snapkv__Request *req = fake_last(f);
    assert_true(req->decode->stream);
    snapkv__request__free_unpacked(req, NULL);
    assert_int_equal(log.batches, 4);
    assert_int_equal(log.tokens, 6);
    assert_string_equal(log.text, "Hello, world!");
    assert_int_equal(r.n_tokens, 6);
    assert_int_equal(r.tokens[2], 13);
    assert_int_equal(r.tokens[5], 2);
    assert_string_equal(r.text, "Hello, world!");
    assert_string_equal(r.finish_reason, "eos");
    snapkv_decode_result_free(&r);

    /* out may be NULL when streaming */
    memset(&log, 0, sizeof log);
    assert_int_equal(snapkv_decode(c, &ID_B, NULL, on_tokens, &log, NULL), SNAPKV_OK);
    assert_string_equal(log.text, "Hello, world!");
    snapkv_close(&c);
    fake_stop(&f);
}

static void test_decode_cancel_skips_rest(void **state)
{
    (void)state;
    struct fake *f = fake_start(answer_decode);
    snapkv_client_t *c = connect_fake(f, 2000);
    struct stream_log log = {.stop_after = 1};
    struct snapkv_decode_result r = {.n_tokens = 99};
    assert_int_equal(snapkv_decode(c, &ID_B, NULL, on_tokens, &log, &r), SNAPKV_E_CANCELLED);
    assert_string_equal(snapkv_last_error(), "decode: stopped by the caller");
    assert_int_equal(log.batches, 1);
    assert_int_equal(r.n_tokens, 99); /* untouched */
    /* it ended the decode in the daemon with a CANCEL for the session, skipping the rest of
     * the stream (stale replies) to the CANCEL's reply */
    Snapkv__Request *cq = fake_last(f);
    assert_int_equal(cq->command_case, SNAPKV__REQUEST__COMMAND_CANCEL);
    assert_wire_id(cq->cancel->session_id, &ID_B);
    assert_true(cq->cancel->own); /* its own decode only: another client's may have begun since */
    snapkv__request__free_unpacked(cq, NULL);
    bool cancelled = false;
    uint32_t n_generated = 0;
    assert_int_equal(snapkv_cancel(c, &ID_B, &cancelled, &n_generated), SNAPKV_OK);
    assert_true(cancelled);
    assert_int_equal(n_generated, 2);
    /* and the next call goes through */
    assert_int_equal(snapkv_release(c, &ID_B), SNAPKV_OK);
    Snapkv__Request *req = fake_last(f);
    assert_int_equal(req->command_case, SNAPKV__REQUEST__COMMAND_RELEASE);
    assert_wire_id(req->release->session_id, &ID_B);
    snapkv__request__free_unpacked(req, NULL);
    snapkv_close(&c);
    fake_stop(&f);
}

/* The daemon gone while the callback runs (the fake stopped in it), and the callback then
 * stops the decode: no CANCEL is asked (the daemon drops a gone client's decode), so the call
 * ends at once, not after the client's timeout (5 s here; for ever at -1), which a CANCEL spent
 * waiting for a new connection to say HELLO on. */
struct stop_gone {
    struct fake *f;
};

static int on_tokens_daemon_gone(void *user, const uint32_t *toks, size_t n, const char *text)
{
    (void)toks;
    (void)n;
    (void)text;
    struct stop_gone *g = user;
    fake_stop(&g->f);
    usleep(300 * 1000); /* the close reaches the client's monitor */
    return 1;
}

static void test_decode_stopped_daemon_gone(void **state)
{
    (void)state;
    for (int k = 0; k < 2; k++) {
        struct stop_gone g = {fake_start(answer_decode)};
        snapkv_client_t *c = connect_fake(g.f, 5000);
        if (k == 1)
            assert_int_equal(snapkv_set_timeout(c, -1), SNAPKV_OK);
        alarm(20); /* (a hang fails the test, not the run) */
        struct snapkv_decode_result r = {.n_tokens = 99};
        int64_t t0 = now_ms();
        assert_int_equal(snapkv_decode(c, &ID_B, NULL, on_tokens_daemon_gone, &g, &r), SNAPKV_E_CANCELLED);
        int64_t dt = now_ms() - t0;
        alarm(0);
        printf("# the callback stopped the decode, the daemon gone: the call took %lld ms\n", (long long)dt);
        assert_true(dt < 2000);
        assert_string_equal(snapkv_last_error(), "decode: stopped by the caller");
        snapkv_close(&c);
    }
}

/* A DECODE the fake does not answer (a long one, or a daemon that is slow): the client's
 * timeout ends the call, and the library ends the decode in the daemon with a CANCEL. The
 * first CANCEL is answered, later ones not. */
static bool answer_decode_slow(struct fake *f, const Snapkv__Request *req)
{
    if (req->command_case == SNAPKV__REQUEST__COMMAND_DECODE)
        return true;
    if (req->command_case != SNAPKV__REQUEST__COMMAND_CANCEL)
        return false;
    if (f->step++ > 0)
        return true;
    Snapkv__Reply rep = SNAPKV__REPLY__INIT;
    Snapkv__CancelReply r = SNAPKV__CANCEL_REPLY__INIT;
    r.cancelled = true;
    rep.final = true;
    rep.result_case = SNAPKV__REPLY__RESULT_CANCEL;
    rep.cancel = &r;
    fake_send(f, &rep);
    return true;
}

/* A tcp:// daemon whose host goes away with no FIN (its process stopped here: nothing answers,
 * not even libzmq's pings): a DECODE waiting with no timeout fails with SNAPKV_E_IO once the
 * heartbeat closes the connection (15 s of silence), as for a daemon that stopped (it waited
 * for ever). */
static void test_tcp_daemon_gone_silent(void **state)
{
    (void)state;
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* stopped, and the test gone: killed still */
        struct fake *f = fake_start(answer_decode_slow);
        ssize_t w = write(pfd[1], f->endpoint, sizeof f->endpoint);
        (void)w;
        for (;;)
            pause();
    }
    char endpoint[128];
    assert_int_equal(read(pfd[0], endpoint, sizeof endpoint), (ssize_t)sizeof endpoint);
    close(pfd[0]);
    close(pfd[1]);
    struct snapkv_connect_opts o = {.tenant = "acme", .name = "unit", .timeout_ms = 5000};
    snapkv_client_t *c = NULL;
    assert_int_equal(snapkv_connect(endpoint, &o, &c), SNAPKV_OK);
    assert_int_equal(snapkv_set_timeout(c, -1), SNAPKV_OK);
    assert_int_equal(kill(pid, SIGSTOP), 0);
    alarm(90); /* (a hang fails the test, not the run) */
    struct snapkv_decode_result r = {.n_tokens = 99};
    int64_t t0 = now_ms();
    int rc = snapkv_decode(c, &ID_B, NULL, NULL, NULL, &r);
    int64_t dt = now_ms() - t0;
    alarm(0);
    printf("# a silent tcp:// daemon: %d after %lld ms: %s\n", rc, (long long)dt, snapkv_last_error());
    assert_int_equal(rc, SNAPKV_E_IO);
    assert_true(dt >= 10000 && dt < 60000);
    snapkv_close(&c);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

static void test_decode_timeout_cancels(void **state)
{
    (void)state;
    struct fake *f = fake_start(answer_decode_slow);
    snapkv_client_t *c = connect_fake(f, 2000);
    assert_int_equal(snapkv_set_timeout(c, 1000), SNAPKV_OK); /* the CANCEL's reply comes within it */
    struct snapkv_decode_result r = {.n_tokens = 99};
    assert_int_equal(snapkv_decode(c, &ID_B, NULL, NULL, NULL, &r), SNAPKV_E_TIMEOUT);
    const char *timed_out = "no DECODE reply from the daemon within 1000 ms";
    /* (a fake slower than the CANCEL's wait, on a loaded machine, adds that it failed) */
    assert_memory_equal(snapkv_last_error(), timed_out, strlen(timed_out));
    assert_int_equal(r.n_tokens, 99);
    fake_await(f, 3); /* HELLO, DECODE, CANCEL */
    Snapkv__Request *req = fake_last(f);
    assert_int_equal(req->command_case, SNAPKV__REQUEST__COMMAND_CANCEL);
    assert_wire_id(req->cancel->session_id, &ID_B);
    assert_true(req->cancel->own);
    snapkv__request__free_unpacked(req, NULL);
    int n = fake_requests(f);

    /* the CANCEL unanswered too: the timeout's status, and the message says both */
    assert_int_equal(snapkv_set_timeout(c, 150), SNAPKV_OK);
    int64_t t0 = now_ms();
    assert_int_equal(snapkv_decode(c, &ID_B, NULL, NULL, NULL, &r), SNAPKV_E_TIMEOUT);
    int64_t dt = now_ms() - t0;
    assert_true(dt >= 280 && dt < 5000);
    assert_string_equal(snapkv_last_error(), "no DECODE reply from the daemon within 150 ms (and CANCEL failed: no "
                                             "CANCEL reply from the daemon within 150 ms)");
    fake_await(f, n + 2);
    assert_int_equal(fake_requests(f), n + 2);

    /* a DECODE the daemon refused (it is not running): no CANCEL */
    snapkv_close(&c);
    fake_stop(&f);
    f = fake_start(answer_error);
    c = connect_fake(f, 2000);
    n = fake_requests(f);
    assert_int_equal(snapkv_decode(c, &ID_B, NULL, NULL, NULL, &r), SNAPKV_E_PROTO);
    usleep(100 * 1000);
    assert_int_equal(fake_requests(f), n + 1);
    snapkv_close(&c);
    fake_stop(&f);
}

/* A stream whose replies the daemon partly dropped (n_generated jumps by 3 where 1 came). */
static bool answer_decode_gap(struct fake *f, const Snapkv__Request *req)
{
    if (req->command_case == SNAPKV__REQUEST__COMMAND_CANCEL)
        return answer_decode(f, req);
    if (req->command_case != SNAPKV__REQUEST__COMMAND_DECODE)
        return false;
    static const uint32_t t[6] = {11, 12, 13, 14, 15, 2};
    if (!req->decode->stream) { /* the final reply's count disagrees */
        send_decode(f, true, t, 6, "Hello, world!", 8, "eos");
        return true;
    }
    send_decode(f, false, t, 2, "Hel", 2, "");
    send_decode(f, false, t + 2, 1, "lo", 5, ""); /* tokens 3 and 4 lost */
    send_decode(f, true, t + 5, 1, "!", 6, "eos");
    return true;
}

static void test_decode_lost_tokens(void **state)
{
    (void)state;
    struct fake *f = fake_start(answer_decode_gap);
    snapkv_client_t *c = connect_fake(f, 2000);
    struct stream_log log = {0};
    struct snapkv_decode_result r = {.n_tokens = 99};
    assert_int_equal(snapkv_decode(c, &ID_B, NULL, on_tokens, &log, &r), SNAPKV_E_IO);
    assert_non_null(strstr(snapkv_last_error(), "lost 2 streamed tokens"));
    assert_int_equal(log.batches, 1); /* the callback saw nothing after the gap */
    assert_int_equal(r.n_tokens, 99);
    fake_await(f, 3); /* HELLO, DECODE, CANCEL */
    Snapkv__Request *req = fake_last(f); /* and the decode was ended in the daemon */
    assert_int_equal(req->command_case, SNAPKV__REQUEST__COMMAND_CANCEL);
    assert_wire_id(req->cancel->session_id, &ID_B);
    snapkv__request__free_unpacked(req, NULL);

    /* collected: the one reply is final (the decode is over: no CANCEL) */
    int n = fake_requests(f);
    assert_int_equal(snapkv_decode(c, &ID_B, NULL, NULL, NULL, &r), SNAPKV_E_IO);
    assert_non_null(strstr(snapkv_last_error(), "lost 2 streamed tokens"));
    assert_int_equal(r.n_tokens, 99);
    usleep(100 * 1000);
    assert_int_equal(fake_requests(f), n + 1);
    snapkv_close(&c);
    fake_stop(&f);
}

/* A callback that uses its own client: refused, and the call it runs in goes on. */
struct reentry {
    snapkv_client_t *c;
    int batches;
    int rc;
    char error[256];
};

static int on_tokens_reenter(void *user, const uint32_t *toks, size_t n, const char *text)
{
    (void)toks;
    (void)n;
    (void)text;
    struct reentry *r = user;
    if (r->batches++ == 0) {
        r->rc = snapkv_release(r->c, &ID_A);
        snprintf(r->error, sizeof r->error, "%s", snapkv_last_error());
    }
    return 0;
}

static void test_callback_reentry(void **state)
{
    (void)state;
    struct fake *f = fake_start(answer_decode);
    snapkv_client_t *c = connect_fake(f, 5000);
    struct reentry re = {.c = c};
    struct snapkv_decode_result r;
    int n = fake_requests(f);
    assert_int_equal(snapkv_decode(c, &ID_B, NULL, on_tokens_reenter, &re, &r), SNAPKV_OK);
    assert_int_equal(re.rc, SNAPKV_E_BUSY);
    assert_non_null(strstr(re.error, "a callback must not use its own client"));
    assert_int_equal(re.batches, 4);
    assert_int_equal(r.n_tokens, 6);
    assert_string_equal(r.text, "Hello, world!");
    snapkv_decode_result_free(&r);
    assert_int_equal(fake_requests(f), n + 1); /* the RELEASE was not sent */
    /* after the call, the client takes calls again */
    assert_int_equal(snapkv_release(c, &ID_A), SNAPKV_OK);
    snapkv_close(&c);
    fake_stop(&f);
}

/* ---- timeouts, stale and malformed replies --------------------------------------------------------------- */

static bool answer_fork_late(struct fake *f, const Snapkv__Request *req)
{
    if (req->command_case != SNAPKV__REQUEST__COMMAND_FORK)
        return false;
    if (f->step++ == 0)
        usleep(400 * 1000); /* the client gives up first */
    Snapkv__Reply rep = SNAPKV__REPLY__INIT;
    Snapkv__ForkReply fr = SNAPKV__FORK_REPLY__INIT;
    fr.session_id = wire_id(f->step == 1 ? &ID_A : &ID_B);
    fr.shared_bytes = f->step == 1 ? 1 : 4096;
    rep.final = true;
    rep.result_case = SNAPKV__REPLY__RESULT_FORK;
    rep.fork = &fr;
    fake_send(f, &rep);
    return true;
}

static void test_timeout_then_stale_reply(void **state)
{
    (void)state;
    struct fake *f = fake_start(answer_fork_late);
    snapkv_client_t *c = connect_fake(f, 2000);
    assert_int_equal(snapkv_set_timeout(c, 100), SNAPKV_OK);
    struct snapkv_session_id out = ID_B;
    int64_t t0 = now_ms();
    assert_int_equal(snapkv_fork(c, &ID_A, &out, NULL), SNAPKV_E_TIMEOUT);
    int64_t dt = now_ms() - t0;
    assert_true(dt >= 90 && dt < 2000);
    assert_memory_equal(out.bytes, ID_B.bytes, 16);
    /* the late answer (ID_A) to the first fork arrives while we wait for the second */
    assert_int_equal(snapkv_set_timeout(c, 3000), SNAPKV_OK);
    uint64_t shared = 0;
    memset(&out, 0, sizeof out);
    assert_int_equal(snapkv_fork(c, &ID_A, &out, &shared), SNAPKV_OK);
    assert_memory_equal(out.bytes, ID_B.bytes, 16);
    assert_int_equal(shared, 4096);
    snapkv_close(&c);
    fake_stop(&f);
}

/* Signals for one thread: SIGUSR1 every 10 ms while `on`, for 1.5 s at most (the handler does
 * nothing, and is installed without SA_RESTART: each one interrupts a wait in that thread). */
struct pester {
    pthread_t target, thread;
    atomic_bool on;
};

static void on_usr1(int sig)
{
    (void)sig;
}

static void *pester_main(void *arg)
{
    struct pester *p = arg;
    for (int i = 0; i < 150 && atomic_load(&p->on); i++) { /* 1.5 s at most */
        pthread_kill(p->target, SIGUSR1);
        usleep(10 * 1000);
    }
    return NULL;
}

static void test_signals_do_not_end_calls(void **state)
{
    (void)state;
    struct sigaction sa = {.sa_handler = on_usr1}, old;
    sigemptyset(&sa.sa_mask);
    assert_int_equal(sigaction(SIGUSR1, &sa, &old), 0);
    struct fake *f = fake_start(answer_fork_late); /* its first FORK reply comes after 400 ms */
    snapkv_client_t *c = connect_fake(f, 3000);
    snapkv_events_t *ev = NULL;
    assert_int_equal(snapkv_events_open("tcp://127.0.0.1:1", &ev), SNAPKV_OK); /* nothing there */
    static struct pester p; /* outlives a failed assert */
    p.target = pthread_self();
    atomic_store(&p.on, true);
    assert_int_equal(pthread_create(&p.thread, NULL, pester_main, &p), 0);

    struct snapkv_session_id out;
    int64_t t0 = now_ms();
    assert_int_equal(snapkv_fork(c, &ID_A, &out, NULL), SNAPKV_OK);
    assert_true(now_ms() - t0 >= 390);
    assert_memory_equal(out.bytes, ID_A.bytes, 16);
    struct snapkv_event e;
    t0 = now_ms();
    assert_int_equal(snapkv_events_next(ev, 300, &e), SNAPKV_E_TIMEOUT);
    assert_true(now_ms() - t0 >= 290);

    atomic_store(&p.on, false);
    pthread_join(p.thread, NULL);
    sigaction(SIGUSR1, &old, NULL);
    snapkv_events_close(&ev);
    snapkv_close(&c);
    fake_stop(&f);
}

static bool answer_fork(struct fake *f, const Snapkv__Request *req)
{
    if (req->command_case != SNAPKV__REQUEST__COMMAND_FORK)
        return false;
    Snapkv__Reply rep = SNAPKV__REPLY__INIT;
    Snapkv__ForkReply fr = SNAPKV__FORK_REPLY__INIT;
    fr.session_id = wire_id(&ID_B);
    rep.final = true;
    rep.result_case = SNAPKV__REPLY__RESULT_FORK;
    rep.fork = &fr;
    fake_send(f, &rep);
    return true;
}

/* More calls than the socket's high-water mark (1000 messages) to a daemon that is gone: each
 * times out at its timeout instead of blocking in the send, and a daemon that comes back at the
 * same endpoint is sent none of them. */
static void test_send_timeout_daemon_gone(void **state)
{
    (void)state;
    struct fake *f = fake_start(NULL);
    char endpoint[sizeof f->endpoint];
    memcpy(endpoint, f->endpoint, sizeof endpoint);
    snapkv_client_t *c = connect_fake(f, 2000);
    fake_stop(&f);
    assert_int_equal(snapkv_set_timeout(c, 1), SNAPKV_OK);
    alarm(60); /* a send that blocks kills the test (SIGALRM) instead of hanging it */
    struct snapkv_session_id out = ID_A;
    for (int i = 0; i < 1100; i++) {
        int64_t t0 = now_ms();
        /* TIMEOUT at the send; or, when a request went out before the client's libzmq had seen
         * the connection close (a slow host: TSan), IO "closed" at once */
        int rc = snapkv_fork(c, &ID_A, &out, NULL);
        if (rc != SNAPKV_E_TIMEOUT && !(rc == SNAPKV_E_IO && strstr(snapkv_last_error(), "closed")))
            fail_msg("FORK to a gone daemon: %d %s", rc, snapkv_last_error());
        assert_true(now_ms() - t0 < 5000);
    }
    /* the connection closed, so each call first asks HELLO again */
    assert_non_null(strstr(snapkv_last_error(), "fork: the connection to the daemon closed since the last call"));
    assert_non_null(strstr(snapkv_last_error(), "could not send the HELLO request within 1 ms"));
    assert_memory_equal(out.bytes, ID_A.bytes, 16);

    f = fake_start_on(answer_fork, endpoint, 0);
    /* (libzmq's reconnect backoff may have grown to 2 s, and a loaded machine is slow) */
    assert_int_equal(snapkv_set_timeout(c, 15000), SNAPKV_OK);
    assert_int_equal(snapkv_fork(c, &ID_A, &out, NULL), SNAPKV_OK);
    assert_memory_equal(out.bytes, ID_B.bytes, 16);
    assert_int_equal(fake_requests(f), 2); /* HELLO again (a new connection), then the FORK */
    alarm(0);
    snapkv_close(&c);
    fake_stop(&f);
}

static bool answer_fork_prefill(struct fake *f, const Snapkv__Request *req)
{
    return answer_fork(f, req) || answer_prefill(f, req);
}

/* A FORK on a client whose daemon just restarted. The client learns of the close from libzmq in
 * its own time: a request sent before it did went into the closed connection and fails IO
 * ("closed"), as any call does whose daemon stops under it; the retry then goes to the new one. */
static int fork_past_close(snapkv_client_t *c, struct snapkv_session_id *out)
{
    int rc = SNAPKV_OK;
    for (int i = 0; i < 3; i++) {
        rc = snapkv_fork(c, &ID_A, out, NULL);
        if (!(rc == SNAPKV_E_IO && strstr(snapkv_last_error(), "closed")))
            break;
    }
    return rc;
}

static void fork_after_restart(snapkv_client_t *c, struct snapkv_session_id *out)
{
    int rc = fork_past_close(c, out);
    if (rc)
        fail_msg("fork after a restart: %d %s", rc, snapkv_last_error());
}

/* A daemon restarted with another model: the first call after the connection closed asks HELLO
 * again before its request, so snapkv_server_info and the library's own checks (token ids
 * against the vocabulary) follow the new daemon; strings returned before stay valid. */
static void test_hello_after_restart(void **state)
{
    (void)state;
    struct fake *f = fake_start(NULL);
    char endpoint[sizeof f->endpoint];
    memcpy(endpoint, f->endpoint, sizeof endpoint);
    snapkv_client_t *c = connect_fake(f, 5000);
    struct snapkv_server_info before, after;
    assert_int_equal(snapkv_server_info(c, &before), SNAPKV_OK);
    assert_int_equal(before.n_vocab, 100);
    struct snapkv_session_id out = ID_A;
    assert_int_equal(snapkv_set_timeout(c, 300), SNAPKV_OK);
    assert_int_equal(snapkv_fork(c, &ID_A, &out, NULL), SNAPKV_E_TIMEOUT); /* this fake answers no FORK */
    fake_await(f, 2);
    usleep(50 * 1000);
    assert_int_equal(fake_requests(f), 2); /* no HELLO again while the connection stays */
    assert_int_equal(snapkv_set_timeout(c, 5000), SNAPKV_OK);
    fake_stop(&f);

    f = fake_start_on(answer_fork_prefill, endpoint, 0);
    atomic_store(&f->n_vocab, 200);
    alarm(60);
    fork_after_restart(c, &out);
    assert_int_equal(fake_requests(f), 2); /* HELLO, then the FORK */
    Snapkv__Request *req = fake_last(f);
    assert_int_equal(req->command_case, SNAPKV__REQUEST__COMMAND_FORK);
    snapkv__request__free_unpacked(req, NULL);
    assert_int_equal(snapkv_server_info(c, &after), SNAPKV_OK);
    assert_int_equal(after.n_vocab, 200);
    assert_string_equal(after.model_name, "other");
    assert_string_equal(after.model_fingerprint, "def456");
    assert_string_equal(before.model_name, "tiny"); /* still readable */
    assert_string_equal(before.model_fingerprint, "abc123");
    assert_ptr_equal(before.backend, after.backend); /* an equal string is kept once */

    /* token 150 is outside the old vocabulary, inside the new one; on the same connection the
     * PREFILL goes alone */
    const uint32_t tokens[] = {5, 150};
    struct snapkv_prefill_opts po = {.tokens = tokens, .n_tokens = 2};
    struct snapkv_prefill_result pr;
    int rc = snapkv_prefill(c, &po, &pr);
    if (rc)
        fail_msg("prefill after the restart: %d %s", rc, snapkv_last_error());
    snapkv_prefill_result_free(&pr);
    assert_int_equal(fake_requests(f), 3);

    /* another restart, back to the first model: a token the new facts refuse is refused here */
    fake_stop(&f);
    f = fake_start_on(answer_fork_prefill, endpoint, 0);
    fork_after_restart(c, &out);
    assert_int_equal(snapkv_server_info(c, &after), SNAPKV_OK);
    assert_ptr_equal(after.model_name, before.model_name);
    assert_int_equal(snapkv_prefill(c, &po, &pr), SNAPKV_E_INVAL);
    assert_non_null(strstr(snapkv_last_error(), "outside the vocabulary (100)"));
    alarm(0);
    snapkv_close(&c);
    fake_stop(&f);
}

/* A daemon restarted so that it refuses this client (it now requires CURVE): the next call says
 * so (SNAPKV_E_PERM and why), not "not running" at its timeout, though the failed handshake
 * happened between two calls. */
static void test_refused_after_restart(void **state)
{
    (void)state;
    struct fake *f = fake_start(answer_fork);
    char endpoint[sizeof f->endpoint];
    memcpy(endpoint, f->endpoint, sizeof endpoint);
    snapkv_client_t *c = connect_fake(f, 10000); /* (the refusal ends the call well before) */
    fake_stop(&f);
    void *ctx = zmq_ctx_new(), *r = zmq_socket(ctx, ZMQ_ROUTER);
    char pub[41], sec[41];
    assert_int_equal(zmq_curve_keypair(pub, sec), 0);
    int one = 1, linger = 0;
    zmq_setsockopt(r, ZMQ_LINGER, &linger, sizeof linger);
    assert_int_equal(zmq_setsockopt(r, ZMQ_CURVE_SERVER, &one, sizeof one), 0);
    assert_int_equal(zmq_setsockopt(r, ZMQ_CURVE_SECRETKEY, sec, 40), 0);
    assert_int_equal(zmq_bind(r, endpoint), 0);
    usleep(300 * 1000); /* (the client's libzmq reconnects and fails its handshake meanwhile, mostly) */
    struct snapkv_session_id out;
    int rc = fork_past_close(c, &out);
    if (rc != SNAPKV_E_PERM)
        fail_msg("a call to a daemon that now refuses this client: %d %s", rc, snapkv_last_error());
    assert_non_null(strstr(snapkv_last_error(), "requires CURVE"));
    snapkv_close(&c);
    zmq_close(r);
    zmq_ctx_term(ctx);
}

/* A daemon still connected but no longer reading (hung, or stopped with SIGSTOP): requests fill
 * the socket's queue, then every call times out at the send instead of blocking. */
static void test_send_timeout_daemon_deaf(void **state)
{
    (void)state;
    struct fake *f = fake_start_on(NULL, NULL, 4);
    snapkv_client_t *c = connect_fake(f, 2000);
    atomic_store(&f->deaf, true);
    assert_int_equal(snapkv_set_timeout(c, 1), SNAPKV_OK);
    /* 16 KiB requests: the kernel's socket buffers hold few, the high-water mark most of them */
    static char text[16 * 1024];
    memset(text, 'a', sizeof text - 1);
    text[sizeof text - 1] = '\0';
    struct snapkv_prefill_opts po = {.text = text};
    struct snapkv_prefill_result pr = {.n_tokens = 777};
    alarm(60);
    int calls = 0, unsent = 0;
    while (calls < 5000 && unsent < 3) {
        int64_t t0 = now_ms();
        assert_int_equal(snapkv_prefill(c, &po, &pr), SNAPKV_E_TIMEOUT);
        assert_true(now_ms() - t0 < 5000);
        calls++;
        if (strstr(snapkv_last_error(), "could not send the PREFILL request"))
            unsent++;
    }
    alarm(0);
    printf("# %d requests queued for the deaf daemon, then sends timed out\n", calls - unsent);
    assert_int_equal(unsent, 3);
    assert_true(calls - unsent > 900); /* about the high-water mark went into the queue first */
    assert_int_equal(pr.n_tokens, 777);
    snapkv_close(&c);
    fake_stop(&f);
}

static bool answer_odd(struct fake *f, const Snapkv__Request *req)
{
    Snapkv__Reply rep = SNAPKV__REPLY__INIT;
    switch (req->command_case) {
    case SNAPKV__REQUEST__COMMAND_FORK: { /* wrong result type */
        Snapkv__ReleaseReply r = SNAPKV__RELEASE_REPLY__INIT;
        rep.final = true;
        rep.result_case = SNAPKV__REPLY__RESULT_RELEASE;
        rep.release = &r;
        fake_send(f, &rep);
        return true;
    }
    case SNAPKV__REQUEST__COMMAND_LOAD: { /* a 15-byte session id */
        Snapkv__LoadReply l = SNAPKV__LOAD_REPLY__INIT;
        l.session_id = (ProtobufCBinaryData){.len = 15, .data = (uint8_t *)ID_A.bytes};
        rep.final = true;
        rep.result_case = SNAPKV__REPLY__RESULT_LOAD;
        rep.load = &l;
        fake_send(f, &rep);
        return true;
    }
    case SNAPKV__REQUEST__COMMAND_PIN: /* garbage bytes */
        fake_send_raw(f, "\xff\xff\xff\xff\x0f", 5, false);
        return true;
    case SNAPKV__REQUEST__COMMAND_RELEASE: { /* REQ-style delimiter frame, empty result */
        rep.version = 1;
        rep.request_id = f->request_id;
        rep.final = true;
        uint8_t buf[64];
        size_t len = snapkv__reply__pack(&rep, buf);
        fake_send_raw(f, buf, len, true);
        return true;
    }
    case SNAPKV__REQUEST__COMMAND_STATUS: /* a later protocol version */
        rep.version = 2;
        rep.final = true;
        fake_send(f, &rep);
        return true;
    default:
        return false;
    }
}

static void test_odd_replies(void **state)
{
    (void)state;
    struct fake *f = fake_start(answer_odd);
    snapkv_client_t *c = connect_fake(f, 2000);
    struct snapkv_session_id out = ID_B;
    assert_int_equal(snapkv_fork(c, &ID_A, &out, NULL), SNAPKV_E_PROTO);
    assert_non_null(strstr(snapkv_last_error(), "wrong reply type"));
    assert_int_equal(snapkv_admin_load(c, "saved", NULL, &out), SNAPKV_E_PROTO);
    assert_non_null(strstr(snapkv_last_error(), "15-byte"));
    assert_memory_equal(out.bytes, ID_B.bytes, 16);
    assert_int_equal(snapkv_admin_pin(c, &ID_A), SNAPKV_E_PROTO);
    assert_non_null(strstr(snapkv_last_error(), "malformed"));
    assert_int_equal(snapkv_release(c, &ID_A), SNAPKV_OK);
    struct snapkv_status_info si;
    assert_int_equal(snapkv_admin_status(c, &si), SNAPKV_E_VERSION);
    snapkv_close(&c);
    fake_stop(&f);
}

static void test_message_size_limit(void **state)
{
    (void)state;
    struct fake *f = fake_start(NULL);
    atomic_store(&f->max_message_bytes, 256);
    snapkv_client_t *c = connect_fake(f, 2000);
    char text[600];
    memset(text, 'a', sizeof text - 1);
    text[sizeof text - 1] = '\0';
    struct snapkv_prefill_result r;
    assert_int_equal(snapkv_prefill(c, &(struct snapkv_prefill_opts){.text = text}, &r), SNAPKV_E_LIMIT);
    assert_non_null(strstr(snapkv_last_error(), "at most 256"));
    assert_int_equal(fake_requests(f), 1);
    snapkv_close(&c);
    fake_stop(&f);
}

/* ---- APPEND, COMPRESS, FORK, RELEASE ------------------------------------------------------------------------ */

static bool answer_session_cmds(struct fake *f, const Snapkv__Request *req)
{
    Snapkv__Reply rep = SNAPKV__REPLY__INIT;
    rep.final = true;
    switch (req->command_case) {
    case SNAPKV__REQUEST__COMMAND_APPEND: {
        Snapkv__AppendReply a = SNAPKV__APPEND_REPLY__INIT;
        float logits[100] = {1.0f, 2.0f};
        a.n_tokens = 360;
        a.next_token = 17;
        if (req->append->return_logits) {
            a.n_logits = 100;
            a.logits = logits;
        }
        rep.result_case = SNAPKV__REPLY__RESULT_APPEND;
        rep.append = &a;
        fake_send(f, &rep);
        return true;
    }
    case SNAPKV__REQUEST__COMMAND_COMPRESS: {
        Snapkv__CompressReply cr = SNAPKV__COMPRESS_REPLY__INIT;
        Snapkv__LayerKept l0 = SNAPKV__LAYER_KEPT__INIT;
        uint32_t heads[3] = {4, 4, 3};
        l0.layer = 1;
        l0.kept = 4;
        l0.n_kept_per_head = 3;
        l0.kept_per_head = heads;
        Snapkv__LayerKept *kept[1] = {&l0};
        cr.n_kept = 1;
        cr.kept = kept;
        cr.bytes_before = 800;
        cr.bytes_after = 200;
        rep.result_case = SNAPKV__REPLY__RESULT_COMPRESS;
        rep.compress = &cr;
        fake_send(f, &rep);
        return true;
    }
    case SNAPKV__REQUEST__COMMAND_RELEASE: /* an empty result may be left out */
        fake_send(f, &rep);
        return true;
    default:
        return false;
    }
}

static void test_append_compress_release(void **state)
{
    (void)state;
    struct fake *f = fake_start(answer_session_cmds);
    snapkv_client_t *c = connect_fake(f, 2000);

    struct snapkv_append_result ar;
    struct snapkv_append_opts ao = {.text = " and more", .return_logits = true};
    assert_int_equal(snapkv_append(c, &ID_A, &ao, &ar), SNAPKV_OK);
    Snapkv__Request *req = fake_last(f);
    assert_int_equal(req->command_case, SNAPKV__REQUEST__COMMAND_APPEND);
    assert_wire_id(req->append->session_id, &ID_A);
    assert_string_equal(req->append->text, " and more");
    assert_true(req->append->return_logits);
    snapkv__request__free_unpacked(req, NULL);
    assert_int_equal(ar.n_tokens, 360);
    assert_int_equal(ar.next_token, 17);
    assert_int_equal(ar.n_logits, 100);
    assert_true(ar.logits[1] == 2.0f);
    snapkv_append_result_free(&ar);

    uint32_t toks[2] = {3, 4};
    assert_int_equal(snapkv_append(c, &ID_A, &(struct snapkv_append_opts){.tokens = toks, .n_tokens = 2}, NULL),
                     SNAPKV_OK);
    req = fake_last(f);
    assert_int_equal(req->append->n_tokens, 2);
    assert_int_equal(req->append->tokens[1], 4);
    snapkv__request__free_unpacked(req, NULL);

    struct snapkv_compress_result cr;
    assert_int_equal(snapkv_compress(c, &ID_A, "policy=h2o,budget=64", 300, &cr), SNAPKV_OK);
    req = fake_last(f);
    assert_int_equal(req->command_case, SNAPKV__REQUEST__COMMAND_COMPRESS);
    assert_string_equal(req->compress->compress->spec, "policy=h2o,budget=64");
    assert_int_equal(req->compress->window_from, 300);
    snapkv__request__free_unpacked(req, NULL);
    assert_int_equal(cr.bytes_before, 800);
    assert_int_equal(cr.bytes_after, 200);
    assert_int_equal(cr.n_layers, 1);
    assert_int_equal(cr.layers[0].layer, 1);
    assert_int_equal(cr.layers[0].kept_per_head[2], 3);
    snapkv_compress_result_free(&cr);
    assert_int_equal(snapkv_compress(c, &ID_A, "policy=window,budget=8", 0, NULL), SNAPKV_OK);

    assert_int_equal(snapkv_release(c, &ID_A), SNAPKV_OK);
    snapkv_close(&c);
    fake_stop(&f);
}

/* ---- shared memory, EXPORT_KV, IMPORT_KV ------------------------------------------------------------------- */

/* Without the daemon's user snapkv (a daemon run by hand; test_shm_daemon_user has the other
 * case): group read/write. */
static void test_shm(void **state)
{
    (void)state;
    unsetenv("SNAPKV_DAEMON_USER");
    bool daemon_user = getpwnam("snapkv") != NULL;
    mode_t old = umask(077); /* mode must still come out 0660 */
    struct snapkv_shm shm;
    assert_int_equal(snapkv_shm_create("my buf/../x", 10000, &shm), SNAPKV_OK);
    umask(old);
    assert_true(strncmp(shm.name, "/snapkv-my_buf____x-", 20) == 0);
    assert_null(strchr(shm.name + 1, '/'));
    assert_int_equal(shm.size, 10000);
    assert_true(shm.fd >= 0);
    struct stat sb;
    assert_int_equal(fstat(shm.fd, &sb), 0);
    if (!daemon_user)
        assert_int_equal(sb.st_mode & 0777, 0660);
    assert_int_equal(sb.st_size, 10000);
    ((uint8_t *)shm.addr)[9999] = 0xab;
    /* another opener (the daemon) sees the same bytes */
    int fd = shm_open(shm.name, O_RDONLY, 0);
    assert_true(fd >= 0);
    uint8_t *view = mmap(NULL, 10000, PROT_READ, MAP_SHARED, fd, 0);
    assert_true(view != MAP_FAILED);
    assert_int_equal(view[9999], 0xab);
    munmap(view, 10000);
    close(fd);
    /* two buffers with one hint get different names */
    struct snapkv_shm other;
    assert_int_equal(snapkv_shm_create("my buf/../x", 16, &other), SNAPKV_OK);
    assert_string_not_equal(other.name, shm.name);
    snapkv_shm_destroy(&other);

    char name[64];
    snprintf(name, sizeof name, "%s", shm.name);
    snapkv_shm_destroy(&shm);
    assert_null(shm.addr);
    assert_int_equal(shm.fd, -1);
    errno = 0;
    assert_true(shm_open(name, O_RDONLY, 0) < 0 && errno == ENOENT);
    snapkv_shm_destroy(&shm); /* twice is fine */

    struct snapkv_shm untouched = {.size = 5};
    assert_int_equal(snapkv_shm_create(NULL, 0, &untouched), SNAPKV_E_INVAL);
    assert_int_equal(untouched.size, 5);
    assert_int_equal(snapkv_shm_create(NULL, 8, NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_shm_create(NULL, 8, &untouched), SNAPKV_OK);
    assert_true(strncmp(untouched.name, "/snapkv-buf-", 12) == 0);
    snapkv_shm_destroy(&untouched);
    /* more than /dev/shm can hold: refused here (a sparse object was made, and the caller's
     * writes past the room got SIGBUS) */
    struct statvfs vs;
    if (statvfs("/dev/shm", &vs) == 0 && vs.f_blocks > 0) {
        size_t too_big = (size_t)vs.f_blocks * vs.f_frsize + ((size_t)64 << 20);
        assert_int_equal(snapkv_shm_create("big", too_big, &untouched), SNAPKV_E_LIMIT);
        printf("# %zu bytes of shared memory: %s\n", too_big, snapkv_last_error());
    }
}

/* Whether a process of user uid, group gid (and no other) can open `name` read/write: 0 yes,
 * 1 refused (EACCES), 2 another error, 3 it could not become that user. */
static int open_as(const char *name, uid_t uid, gid_t gid)
{
    pid_t pid = fork();
    if (pid == 0) {
        if (setgroups(0, NULL) != 0 || setgid(gid) != 0 || setuid(uid) != 0)
            _exit(3);
        int fd = shm_open(name, O_RDWR, 0);
        _exit(fd >= 0 ? 0 : errno == EACCES ? 1 : 2);
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st));
    return WEXITSTATUS(st);
}

/* With the daemon's user known (user snapkv in production; SNAPKV_DAEMON_USER here), an object
 * is that user's and the caller's alone: mode 0600, and for another user than the caller an ACL
 * entry. A process of the daemon's user opens it; one of the caller's group, which mode 0660
 * let in, does not. As root (it acts as other users). */
static void test_shm_daemon_user(void **state)
{
    (void)state;
    struct passwd *nobody = getpwnam("nobody");
    if (geteuid() != 0 || !nobody)
        skip();
    uid_t nuid = nobody->pw_uid;
    gid_t ngid = nobody->pw_gid;
    if (open_as("/snapkv-test-no-such-object", 54321, ngid) == 3) {
        printf("# root here cannot act as other users: skipped\n");
        skip();
    }
    /* a name that is no user: an error, not a silent fall back to the group's access */
    setenv("SNAPKV_DAEMON_USER", "snapkv-test-no-such-user", 1);
    struct snapkv_shm none;
    assert_int_equal(snapkv_shm_create("none", 64, &none), SNAPKV_E_INVAL);
    assert_non_null(strstr(snapkv_last_error(), "SNAPKV_DAEMON_USER names 'snapkv-test-no-such-user'"));
    setenv("SNAPKV_DAEMON_USER", "root", 1); /* the caller's own user: 0600 is enough */
    struct snapkv_shm shm;
    assert_int_equal(snapkv_shm_create("own", 64, &shm), SNAPKV_OK);
    struct stat sb;
    assert_int_equal(fstat(shm.fd, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0600);
    assert_int_equal(open_as(shm.name, 54321, getegid()), 1);
    snapkv_shm_destroy(&shm);

    setenv("SNAPKV_DAEMON_USER", "nobody", 1);
    assert_int_equal(snapkv_shm_create("acl", 4096, &shm), SNAPKV_OK);
    unsetenv("SNAPKV_DAEMON_USER");
    if (fgetxattr(shm.fd, "system.posix_acl_access", NULL, 0) <= 0) {
        printf("# /dev/shm keeps no ACL here: the object is group read/write instead\n");
        snapkv_shm_destroy(&shm);
        skip();
    }
    assert_int_equal(open_as(shm.name, nuid, ngid), 0);          /* the daemon's user */
    assert_int_equal(open_as(shm.name, 54321, getegid()), 1);    /* another of the caller's group */
    assert_int_equal(open_as(shm.name, 54321, ngid), 1);         /* another of the daemon's group */
    snapkv_shm_destroy(&shm);
}

/* two layers (model layers 0 and 1), 3 KV heads, head_dim 4; layer 0 keeps {2, 1, 2} (max 2),
 * layer 1 keeps 1 per head: value of K/V element = layer*1000 + v*100 + head*10 + row + col/10 */
#define EXPORT_OFFSET 64

static float kv_value(int layer, int v, int head, int row, int col)
{
    return (float)(layer * 1000 + v * 100 + head * 10 + row) + (float)col / 10.0f;
}

/* answer_kv's EXPORT_KV layout, as a buggy or hostile daemon might report it: 0 as it is; 1 a
 * head's count past the layer's kept; 2 four heads for the model's three; 3 fewer bytes
 * written than the layout takes */
static atomic_int g_bad_layout; /* (the fake's thread reads it) */

/* An EXPORT_KV reply of 3 layers of 4096 heads keeping 2^32 - 1, 2^32 - 1 and 2 rows: at a
 * head size of 65536 a row of a layer's heads is 2^31 bytes, 2^33 rows wrap a 64-bit sum to 0,
 * under any bytes written. */
static void answer_wrapping_layout(struct fake *f)
{
    static uint32_t most[4096], two[4096];
    for (int h = 0; h < 4096; h++) {
        most[h] = UINT32_MAX;
        two[h] = 2;
    }
    Snapkv__LayerKept l[3], *k[3];
    for (int i = 0; i < 3; i++) {
        snapkv__layer_kept__init(&l[i]);
        l[i].layer = (uint32_t)i;
        l[i].kept = i < 2 ? UINT32_MAX : 2;
        l[i].n_kept_per_head = 4096;
        l[i].kept_per_head = i < 2 ? most : two;
        k[i] = &l[i];
    }
    Snapkv__ExportKvReply e = SNAPKV__EXPORT_KV_REPLY__INIT;
    e.bytes_written = 288;
    e.n_kept = 3;
    e.kept = k;
    Snapkv__Reply rep = SNAPKV__REPLY__INIT;
    rep.final = true;
    rep.result_case = SNAPKV__REPLY__RESULT_EXPORT_KV;
    rep.export_kv = &e;
    fake_send(f, &rep);
}

static bool answer_kv(struct fake *f, const Snapkv__Request *req)
{
    Snapkv__Reply rep = SNAPKV__REPLY__INIT;
    rep.final = true;
    if (req->command_case == SNAPKV__REQUEST__COMMAND_EXPORT_KV && g_bad_layout == 4) {
        answer_wrapping_layout(f);
        return true;
    }
    if (req->command_case == SNAPKV__REQUEST__COMMAND_EXPORT_KV) {
        const Snapkv__BufferRef *b = req->export_kv->buffer;
        if (!b || b->kind_case != SNAPKV__BUFFER_REF__KIND_SHM_NAME) {
            fake_error(f, -2, "no shm buffer");
            return true;
        }
        int fd = shm_open(b->shm_name, O_RDWR, 0);
        float *base = mmap(NULL, b->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        float *p = (float *)((uint8_t *)base + b->offset);
        const int kept[2] = {2, 1};
        for (int l = 0; l < 2; l++)
            for (int v = 0; v < 2; v++)
                for (int h = 0; h < 3; h++)
                    for (int r = 0; r < kept[l]; r++)
                        for (int col = 0; col < 4; col++)
                            *p++ = kv_value(l, v, h, r, col);
        uint64_t written = (uint64_t)((uint8_t *)p - (uint8_t *)base) - b->offset;
        munmap(base, b->size);

        Snapkv__ExportKvReply e = SNAPKV__EXPORT_KV_REPLY__INIT;
        Snapkv__LayerKept l0 = SNAPKV__LAYER_KEPT__INIT, l1 = SNAPKV__LAYER_KEPT__INIT;
        uint32_t h0[3] = {2, 1, 2}, h1[3] = {1, 1, 1};
        l0.layer = 0;
        l0.kept = 2;
        l0.n_kept_per_head = 3;
        l0.kept_per_head = h0;
        l1.layer = 1;
        l1.kept = 1;
        l1.n_kept_per_head = 3;
        l1.kept_per_head = h1;
        Snapkv__LayerKept *k[2] = {&l0, &l1};
        uint32_t pos[8] = {0, 9, 9, 3, 9, 7, 8, 9};
        uint32_t h4[4] = {2, 1, 2, 2};
        if (g_bad_layout == 1)
            h0[1] = 4000;
        if (g_bad_layout == 2) {
            l0.n_kept_per_head = 4;
            l0.kept_per_head = h4;
        }
        e.bytes_written = g_bad_layout == 3 ? written - 4 : written;
        e.n_kept = 2;
        e.kept = k;
        e.n_positions = 8;
        e.positions = pos;
        rep.result_case = SNAPKV__REPLY__RESULT_EXPORT_KV;
        rep.export_kv = &e;
        fake_send(f, &rep);
        return true;
    }
    if (req->command_case == SNAPKV__REQUEST__COMMAND_IMPORT_KV) {
        const Snapkv__ImportKvRequest *im = req->import_kv;
        /* check what arrived, and that the data in the buffer is there */
        int fd = shm_open(im->buffer->shm_name, O_RDONLY, 0);
        float *base = mmap(NULL, im->buffer->size, PROT_READ, MAP_SHARED, fd, 0);
        close(fd);
        const float *p = (const float *)((const uint8_t *)base + im->buffer->offset);
        bool ok = im->n_kept == 2 && im->kept[0]->n_kept_per_head == 3 && im->kept[0]->kept_per_head[1] == 1 &&
                  im->kept[1]->kept == 1 && im->n_positions == 8 && im->positions[3] == 3 && im->n_tokens == 3 &&
                  im->tokens[2] == 33 && im->original_length == 10 && p[0] == kv_value(0, 0, 0, 0, 0) &&
                  p[5] == kv_value(0, 0, 0, 1, 1);
        munmap(base, im->buffer->size);
        if (!ok) {
            fake_error(f, -2, "import request not as expected");
            return true;
        }
        Snapkv__ImportKvReply r = SNAPKV__IMPORT_KV_REPLY__INIT;
        r.session_id = wire_id(&ID_B);
        rep.result_case = SNAPKV__REPLY__RESULT_IMPORT_KV;
        rep.import_kv = &r;
        fake_send(f, &rep);
        return true;
    }
    return false;
}

static void test_export_import(void **state)
{
    (void)state;
    struct fake *f = fake_start(answer_kv);
    snapkv_client_t *c = connect_fake(f, 2000);
    struct snapkv_shm shm;
    assert_int_equal(snapkv_shm_create("kv", 4096, &shm), SNAPKV_OK);
    struct snapkv_kv_layout lay;
    assert_int_equal(snapkv_export_kv(c, &ID_A, &shm, EXPORT_OFFSET, &lay), SNAPKV_OK);
    Snapkv__Request *req = fake_last(f);
    assert_int_equal(req->command_case, SNAPKV__REQUEST__COMMAND_EXPORT_KV);
    assert_wire_id(req->export_kv->session_id, &ID_A);
    assert_string_equal(req->export_kv->buffer->shm_name, shm.name);
    assert_int_equal(req->export_kv->buffer->size, 4096);
    assert_int_equal(req->export_kv->buffer->offset, EXPORT_OFFSET);
    assert_int_equal(req->export_kv->layer_first, 0);
    assert_int_equal(req->export_kv->layer_count, 0);
    snapkv__request__free_unpacked(req, NULL);

    /* 2 * 3 heads * 4 dims * 4 bytes * (2 + 1) rows */
    assert_int_equal(lay.bytes_written, 288);
    assert_int_equal(snapkv_kv_bytes(lay.layers, lay.n_layers, 3, 4), 288);
    assert_int_equal(lay.n_layers, 2);
    assert_int_equal(lay.n_positions, 8);
    /* positions split per layer: layer 0 has 2 + 1 + 2, layer 1 has 3 */
    assert_ptr_equal(lay.layers[0].positions, lay.positions);
    assert_ptr_equal(lay.layers[1].positions, lay.positions + 5);
    assert_int_equal(lay.layers[1].positions[0], 7);
    const uint8_t *data = (const uint8_t *)shm.addr + EXPORT_OFFSET;
    for (size_t l = 0; l < 2; l++)
        for (uint32_t h = 0; h < 3; h++)
            for (int v = 0; v < 2; v++) {
                const float *rows = (const float *)(data + snapkv_kv_offset(&lay, l, h, v, 3, 4));
                for (uint32_t r = 0; r < lay.layers[l].kept; r++)
                    for (int col = 0; col < 4; col++)
                        assert_true(rows[r * 4 + col] == kv_value((int)l, v, (int)h, (int)r, col));
            }
    assert_int_equal(snapkv_kv_offset(&lay, 5, 0, false, 3, 4), 0); /* out of range */
    /* a layout that would index past what was written is refused, not handed on */
    for (g_bad_layout = 1; g_bad_layout <= 3; g_bad_layout++) {
        struct snapkv_kv_layout bad = {0};
        assert_int_equal(snapkv_export_kv(c, &ID_A, &shm, EXPORT_OFFSET, &bad), SNAPKV_E_PROTO);
        printf("# bad layout %d: %s\n", g_bad_layout, snapkv_last_error());
        assert_null(bad.layers);
    }
    g_bad_layout = 0;
    /* a layout whose size wraps 64 bits (to 0, under the bytes written): refused, not handed on
     * with offsets past the buffer (a daemon whose HELLO says head size 65536, 4096 KV heads) */
    atomic_store(&f->head_dim, 65536);
    atomic_store(&f->n_kv_heads, 4096);
    snapkv_client_t *wide = connect_fake(f, 2000);
    g_bad_layout = 4;
    struct snapkv_kv_layout wrapped = {0};
    assert_int_equal(snapkv_export_kv(wide, &ID_A, &shm, EXPORT_OFFSET, &wrapped), SNAPKV_E_PROTO);
    assert_string_equal(snapkv_last_error(), "export: the layout the daemon reports is larger than 2^64 bytes");
    assert_null(wrapped.layers);
    g_bad_layout = 0;
    snapkv_close(&wide);
    /* and a HELLO of a shape no model has (head size 2^20): the connect fails */
    atomic_store(&f->n_kv_heads, 0);
    atomic_store(&f->head_dim, 1u << 20);
    struct snapkv_connect_opts o = {.tenant = "acme", .name = "unit", .timeout_ms = 2000};
    assert_int_equal(snapkv_connect(f->endpoint, &o, &wide), SNAPKV_E_PROTO);
    assert_non_null(strstr(snapkv_last_error(), "a model shape no model has: 2 layers, 6 heads, 3 KV heads, head "
                                                "size 1048576"));
    atomic_store(&f->head_dim, 0);

    /* and back: the layout an export returned is what an import takes */
    uint32_t toks[3] = {11, 22, 33};
    struct snapkv_import_opts io = {
        .shm = &shm,
        .offset = EXPORT_OFFSET,
        .layers = lay.layers,
        .n_layers = lay.n_layers,
        .positions = lay.positions,
        .n_positions = lay.n_positions,
        .tokens = toks,
        .n_tokens = 3,
        .original_length = 10,
    };
    struct snapkv_session_id id;
    assert_int_equal(snapkv_import_kv(c, &io, &id), SNAPKV_OK);
    assert_memory_equal(id.bytes, ID_B.bytes, 16);

    /* a partial export names its layers */
    struct snapkv_kv_layout lay2;
    assert_int_equal(snapkv_export_kv_layers(c, &ID_A, &shm, 0, 1, 1, &lay2), SNAPKV_OK);
    req = fake_last(f);
    assert_int_equal(req->export_kv->layer_first, 1);
    assert_int_equal(req->export_kv->layer_count, 1);
    assert_int_equal(req->export_kv->buffer->offset, 0);
    snapkv__request__free_unpacked(req, NULL);
    snapkv_kv_layout_free(&lay2);

    snapkv_kv_layout_free(&lay);
    assert_null(lay.layers);
    snapkv_shm_destroy(&shm);
    snapkv_close(&c);
    fake_stop(&f);
}

/* ---- admin ---------------------------------------------------------------------------------------------------- */

static void fill_info(Snapkv__SessionInfo *s, const struct snapkv_session_id *id, const char *tenant, bool pinned)
{
    s->session_id = wire_id(id);
    s->tenant = (char *)tenant;
    s->owner = "unit:42";
    s->n_tokens = 350;
    s->kept_tokens = 15;
    s->bytes = 1789;
    s->policy = "snapkv";
    s->created_unix_ms = 1700000000000ull;
    s->last_used_unix_ms = 1700000001000ull;
    s->pinned = pinned;
    s->lease_seconds = 90;
    s->shared_bytes = 12;
}

static bool answer_admin(struct fake *f, const Snapkv__Request *req)
{
    Snapkv__Reply rep = SNAPKV__REPLY__INIT;
    rep.final = true;
    switch (req->command_case) {
    case SNAPKV__REQUEST__COMMAND_LIST: {
        Snapkv__ListReply l = SNAPKV__LIST_REPLY__INIT;
        Snapkv__SessionInfo a = SNAPKV__SESSION_INFO__INIT, b = SNAPKV__SESSION_INFO__INIT;
        fill_info(&a, &ID_A, "acme", false);
        fill_info(&b, &ID_B, "other", true);
        Snapkv__SessionInfo *all[2] = {&a, &b};
        bool one = req->list->tenant && strcmp(req->list->tenant, "acme") == 0;
        l.n_sessions = one ? 1 : 2;
        l.sessions = all;
        rep.result_case = SNAPKV__REPLY__RESULT_LIST;
        rep.list = &l;
        fake_send(f, &rep);
        return true;
    }
    case SNAPKV__REQUEST__COMMAND_INSPECT: {
        Snapkv__InspectReply in = SNAPKV__INSPECT_REPLY__INIT;
        Snapkv__SessionInfo info = SNAPKV__SESSION_INFO__INIT;
        fill_info(&info, &ID_A, "acme", false);
        Snapkv__LayerKept l0 = SNAPKV__LAYER_KEPT__INIT, l1 = SNAPKV__LAYER_KEPT__INIT;
        uint32_t h0[3] = {2, 2, 1}, h1[3] = {1, 0, 1};
        l0.layer = 0;
        l0.kept = 2;
        l0.n_kept_per_head = 3;
        l0.kept_per_head = h0;
        l1.layer = 1;
        l1.kept = 1;
        l1.n_kept_per_head = 3;
        l1.kept_per_head = h1;
        Snapkv__LayerKept *k[2] = {&l0, &l1};
        uint32_t pos[7] = {0, 5, 1, 5, 5, 4, 5};
        float sim[2] = {0.25f, 0.75f};
        in.info = &info;
        in.n_kept = 2;
        in.kept = k;
        if (req->inspect->with_positions) {
            in.n_positions = 7;
            in.positions = pos;
        }
        in.spec = "policy=snapkv,ratio=0.1";
        in.n_layer_similarity = 2;
        in.layer_similarity = sim;
        rep.result_case = SNAPKV__REPLY__RESULT_INSPECT;
        rep.inspect = &in;
        fake_send(f, &rep);
        return true;
    }
    case SNAPKV__REQUEST__COMMAND_EVICT: {
        Snapkv__EvictReply e = SNAPKV__EVICT_REPLY__INIT;
        e.evicted = req->evict->all_unpinned ? 5 : req->evict->tenant[0] ? 2 : 1;
        e.bytes_freed = 1000u * e.evicted;
        rep.result_case = SNAPKV__REPLY__RESULT_EVICT;
        rep.evict = &e;
        fake_send(f, &rep);
        return true;
    }
    case SNAPKV__REQUEST__COMMAND_PIN: {
        Snapkv__PinReply p = SNAPKV__PIN_REPLY__INIT;
        rep.result_case = SNAPKV__REPLY__RESULT_PIN;
        rep.pin = &p;
        fake_send(f, &rep);
        return true;
    }
    case SNAPKV__REQUEST__COMMAND_SAVE: {
        Snapkv__SaveReply s = SNAPKV__SAVE_REPLY__INIT;
        s.bytes = 65536;
        rep.result_case = SNAPKV__REPLY__RESULT_SAVE;
        rep.save = &s;
        fake_send(f, &rep);
        return true;
    }
    case SNAPKV__REQUEST__COMMAND_LOAD: {
        Snapkv__LoadReply l = SNAPKV__LOAD_REPLY__INIT;
        l.session_id = wire_id(&ID_B);
        rep.result_case = SNAPKV__REPLY__RESULT_LOAD;
        rep.load = &l;
        fake_send(f, &rep);
        return true;
    }
    case SNAPKV__REQUEST__COMMAND_STATS: {
        Snapkv__StatsReply s = SNAPKV__STATS_REPLY__INIT;
        Snapkv__Stat a = SNAPKV__STAT__INIT, b = SNAPKV__STAT__INIT;
        a.name = "snapkv_requests_total";
        a.value = 12;
        a.help = "requests served";
        b.name = "snapkv_pool_bytes_used";
        b.value = 1.5e9;
        b.help = "";
        Snapkv__Stat *all[2] = {&a, &b};
        s.n_stats = 2;
        s.stats = all;
        if (req->stats->prometheus)
            s.prometheus_text = "# HELP snapkv_requests_total requests served\nsnapkv_requests_total 12\n";
        rep.result_case = SNAPKV__REPLY__RESULT_STATS;
        rep.stats = &s;
        fake_send(f, &rep);
        return true;
    }
    case SNAPKV__REQUEST__COMMAND_STATUS: {
        Snapkv__StatusReply s = SNAPKV__STATUS_REPLY__INIT;
        s.server_version = "0.1.0-fake";
        s.model_name = "tiny";
        s.backend = "cpu";
        s.uptime_seconds = 77;
        s.n_sessions = 2;
        s.pool_bytes_total = 1 << 20;
        rep.result_case = SNAPKV__REPLY__RESULT_STATUS_REPLY;
        rep.status_reply = &s;
        fake_send(f, &rep);
        return true;
    }
    case SNAPKV__REQUEST__COMMAND_CONFIG_GET: {
        Snapkv__ConfigGetReply cg = SNAPKV__CONFIG_GET_REPLY__INIT;
        Snapkv__ConfigEntry e = SNAPKV__CONFIG_ENTRY__INIT;
        e.key = "threads";
        e.value = "4";
        e.help = "worker threads";
        Snapkv__ConfigEntry *all[1] = {&e};
        cg.n_entries = 1;
        cg.entries = all;
        rep.result_case = SNAPKV__REPLY__RESULT_CONFIG_GET;
        rep.config_get = &cg;
        fake_send(f, &rep);
        return true;
    }
    default:
        return false;
    }
}

static void config_row(void *user, const char *key, const char *value, const char *help)
{
    int *n = user;
    assert_string_equal(key, "threads");
    assert_string_equal(value, "4");
    assert_string_equal(help, "worker threads");
    (*n)++;
}

static void test_admin_list_inspect(void **state)
{
    (void)state;
    struct fake *f = fake_start(answer_admin);
    snapkv_client_t *c = connect_fake(f, 2000);

    struct snapkv_session_list l;
    assert_int_equal(snapkv_admin_list(c, NULL, &l), SNAPKV_OK);
    Snapkv__Request *req = fake_last(f);
    assert_int_equal(req->command_case, SNAPKV__REQUEST__COMMAND_LIST);
    assert_string_equal(req->list->tenant, "");
    snapkv__request__free_unpacked(req, NULL);
    assert_int_equal(l.n, 2);
    assert_memory_equal(l.sessions[0].id.bytes, ID_A.bytes, 16);
    assert_string_equal(l.sessions[0].tenant, "acme");
    assert_string_equal(l.sessions[0].owner, "unit:42");
    assert_string_equal(l.sessions[0].policy, "snapkv");
    assert_int_equal(l.sessions[0].n_tokens, 350);
    assert_int_equal(l.sessions[0].kept_tokens, 15);
    assert_int_equal(l.sessions[0].bytes, 1789);
    assert_int_equal(l.sessions[0].created_unix_ms, 1700000000000ull);
    assert_int_equal(l.sessions[0].lease_seconds, 90);
    assert_int_equal(l.sessions[0].shared_bytes, 12);
    assert_false(l.sessions[0].pinned);
    assert_true(l.sessions[1].pinned);
    assert_string_equal(l.sessions[1].tenant, "other");
    snapkv_session_list_free(&l);
    assert_int_equal(snapkv_admin_list(c, "acme", &l), SNAPKV_OK);
    assert_int_equal(l.n, 1);
    snapkv_session_list_free(&l);

    struct snapkv_inspect_result in;
    assert_int_equal(snapkv_admin_inspect(c, &ID_A, true, &in), SNAPKV_OK);
    req = fake_last(f);
    assert_wire_id(req->inspect->session_id, &ID_A);
    assert_true(req->inspect->with_positions);
    snapkv__request__free_unpacked(req, NULL);
    assert_memory_equal(in.info.id.bytes, ID_A.bytes, 16);
    assert_string_equal(in.spec, "policy=snapkv,ratio=0.1");
    assert_int_equal(in.n_layers, 2);
    assert_int_equal(in.layers[1].kept_per_head[1], 0);
    assert_int_equal(in.n_positions, 7);
    assert_ptr_equal(in.layers[0].positions, in.positions);
    assert_ptr_equal(in.layers[1].positions, in.positions + 5);
    assert_int_equal(in.layers[1].positions[0], 4);
    assert_int_equal(in.n_layer_similarity, 2);
    assert_true(in.layer_similarity[1] == 0.75f);
    snapkv_inspect_result_free(&in);
    assert_null(in.spec);

    assert_int_equal(snapkv_admin_inspect(c, &ID_A, false, &in), SNAPKV_OK);
    assert_int_equal(in.n_positions, 0);
    assert_null(in.positions);
    assert_null(in.layers[0].positions);
    snapkv_inspect_result_free(&in);

    struct snapkv_status_info si;
    assert_int_equal(snapkv_admin_status(c, &si), SNAPKV_OK);
    assert_string_equal(si.model_name, "tiny");
    assert_int_equal(si.uptime_seconds, 77);
    assert_int_equal(si.n_sessions, 2);
    int rows = 0;
    assert_int_equal(snapkv_admin_config_get(c, "threads", config_row, &rows), SNAPKV_OK);
    assert_int_equal(rows, 1);
    req = fake_last(f);
    assert_string_equal(req->config_get->key, "threads");
    snapkv__request__free_unpacked(req, NULL);
    snapkv_close(&c);
    fake_stop(&f);
}

static void test_admin_actions(void **state)
{
    (void)state;
    struct fake *f = fake_start(answer_admin);
    snapkv_client_t *c = connect_fake(f, 2000);
    uint32_t evicted = 0;
    uint64_t freed = 0;
    assert_int_equal(snapkv_admin_evict(c, &ID_A, NULL, false, &evicted, &freed), SNAPKV_OK);
    Snapkv__Request *req = fake_last(f);
    assert_wire_id(req->evict->session_id, &ID_A);
    assert_string_equal(req->evict->tenant, "");
    assert_false(req->evict->all_unpinned);
    snapkv__request__free_unpacked(req, NULL);
    assert_int_equal(evicted, 1);
    assert_int_equal(freed, 1000);
    assert_int_equal(snapkv_admin_evict(c, NULL, "acme", false, &evicted, NULL), SNAPKV_OK);
    req = fake_last(f);
    assert_int_equal(req->evict->session_id.len, 0);
    assert_string_equal(req->evict->tenant, "acme");
    snapkv__request__free_unpacked(req, NULL);
    assert_int_equal(evicted, 2);
    assert_int_equal(snapkv_admin_evict(c, NULL, NULL, true, NULL, &freed), SNAPKV_OK);
    req = fake_last(f);
    assert_true(req->evict->all_unpinned);
    snapkv__request__free_unpacked(req, NULL);
    assert_int_equal(freed, 5000);

    assert_int_equal(snapkv_admin_pin(c, &ID_B), SNAPKV_OK);
    req = fake_last(f);
    assert_int_equal(req->command_case, SNAPKV__REQUEST__COMMAND_PIN);
    assert_wire_id(req->pin->session_id, &ID_B);
    assert_true(req->pin->pin);
    snapkv__request__free_unpacked(req, NULL);
    assert_int_equal(snapkv_admin_unpin(c, &ID_B), SNAPKV_OK);
    req = fake_last(f);
    assert_false(req->pin->pin);
    snapkv__request__free_unpacked(req, NULL);

    uint64_t bytes = 0;
    assert_int_equal(snapkv_admin_save(c, &ID_A, "run-1.v2_x", &bytes), SNAPKV_OK);
    req = fake_last(f);
    assert_string_equal(req->save->name, "run-1.v2_x");
    assert_wire_id(req->save->session_id, &ID_A);
    snapkv__request__free_unpacked(req, NULL);
    assert_int_equal(bytes, 65536);
    struct snapkv_session_id id;
    assert_int_equal(snapkv_admin_load(c, "run-1.v2_x", "acme", &id), SNAPKV_OK);
    req = fake_last(f);
    assert_string_equal(req->load->name, "run-1.v2_x");
    assert_string_equal(req->load->tenant, "acme");
    snapkv__request__free_unpacked(req, NULL);
    assert_memory_equal(id.bytes, ID_B.bytes, 16);

    struct snapkv_stats st;
    assert_int_equal(snapkv_admin_stats(c, false, &st), SNAPKV_OK);
    assert_int_equal(st.n, 2);
    assert_string_equal(st.stats[0].name, "snapkv_requests_total");
    assert_true(st.stats[0].value == 12.0);
    assert_string_equal(st.stats[0].help, "requests served");
    assert_true(st.stats[1].value == 1.5e9);
    assert_string_equal(st.prometheus_text, "");
    snapkv_stats_free(&st);
    assert_int_equal(snapkv_admin_stats(c, true, &st), SNAPKV_OK);
    req = fake_last(f);
    assert_true(req->stats->prometheus);
    snapkv__request__free_unpacked(req, NULL);
    assert_non_null(strstr(st.prometheus_text, "snapkv_requests_total 12\n"));
    snapkv_stats_free(&st);
    assert_null(st.stats);
    snapkv_close(&c);
    fake_stop(&f);
}

/* ---- KV events: a fake publisher and replay endpoint ------------------------------------------------ */

struct fake_events {
    void *ctx, *pub, *replay;       /* XPUB (it sees the subscription), ROUTER */
    char pub_ep[128], replay_ep[128];
    /* the snapshot the replay answers: AllCleared and a stored event per id, under boot_id */
    uint64_t boot_id, sequence;
    const struct snapkv_session_id *ids[4];
    size_t n_ids;
    /* a publisher thread: stale events (boot_id, sequence) every 50 ms while `on` */
    pthread_t thread;
    atomic_bool on;
};

static struct fake_events *fake_events_start(void)
{
    struct fake_events *fe = calloc(1, sizeof *fe);
    assert_non_null(fe);
    fe->ctx = zmq_ctx_new();
    fe->pub = zmq_socket(fe->ctx, ZMQ_XPUB);
    fe->replay = zmq_socket(fe->ctx, ZMQ_ROUTER);
    int linger = 0, timeout = 5000;
    zmq_setsockopt(fe->pub, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(fe->pub, ZMQ_RCVTIMEO, &timeout, sizeof timeout);
    zmq_setsockopt(fe->replay, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(fe->replay, ZMQ_RCVTIMEO, &timeout, sizeof timeout);
    assert_int_equal(zmq_bind(fe->pub, "tcp://127.0.0.1:*"), 0);
    assert_int_equal(zmq_bind(fe->replay, "tcp://127.0.0.1:*"), 0);
    size_t len = sizeof fe->pub_ep;
    zmq_getsockopt(fe->pub, ZMQ_LAST_ENDPOINT, fe->pub_ep, &len);
    len = sizeof fe->replay_ep;
    zmq_getsockopt(fe->replay, ZMQ_LAST_ENDPOINT, fe->replay_ep, &len);
    return fe;
}

static void fake_events_stop(struct fake_events **fep)
{
    struct fake_events *fe = *fep;
    zmq_close(fe->pub);
    zmq_close(fe->replay);
    zmq_ctx_term(fe->ctx);
    free(fe);
    *fep = NULL;
}

/* Seconds the fake daemon's clock is off by (a clock stepped between two daemons). */
static double g_clock_step;

/* Now, as the daemon stamps its batches (CLOCK_REALTIME seconds). */
static double wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9 + g_clock_step;
}

/* [topic][seq, big-endian][b] on the fake publisher. */
static void fake_send_batch(void *pub, const Snapkv__KvEventBatch *b, uint64_t seq)
{
    uint8_t buf[256], be[8];
    size_t len = snapkv__kv_event_batch__pack(b, buf);
    for (int k = 0; k < 8; k++)
        be[k] = (uint8_t)(seq >> (56 - 8 * k));
    zmq_send(pub, "snapkv.kv.fake", 14, ZMQ_SNDMORE);
    zmq_send(pub, be, sizeof be, ZMQ_SNDMORE);
    zmq_send(pub, buf, len, 0);
}

/* Publishes one event as the daemon does: [topic][sequence, big-endian][a batch of one]. */
static void fake_publish(void *pub, uint64_t boot_id, uint64_t seq, enum snapkv_event_kind kind,
                         const struct snapkv_session_id *id)
{
    Snapkv__SessionStored st = SNAPKV__SESSION_STORED__INIT;
    Snapkv__AllCleared cl = SNAPKV__ALL_CLEARED__INIT;
    Snapkv__KvEvent e = SNAPKV__KV_EVENT__INIT, *ep = &e;
    if (kind == SNAPKV_EVENT_STORED) {
        st.session_id = wire_id(id);
        st.tenant = "t";
        e.kind_case = SNAPKV__KV_EVENT__KIND_STORED;
        e.stored = &st;
    } else {
        e.kind_case = SNAPKV__KV_EVENT__KIND_CLEARED;
        e.cleared = &cl;
    }
    Snapkv__KvEventBatch b = SNAPKV__KV_EVENT_BATCH__INIT;
    b.version = 1;
    b.ts = wall_now();
    b.boot_id = boot_id;
    b.n_events = 1;
    b.events = &ep;
    fake_send_batch(pub, &b, seq);
}

/* The daemon's heartbeat of an idle stream: a batch of no events. */
static void fake_heartbeat(void *pub, uint64_t boot_id, uint64_t seq)
{
    Snapkv__KvEventBatch b = SNAPKV__KV_EVENT_BATCH__INIT;
    b.version = 1;
    b.ts = wall_now();
    b.boot_id = boot_id;
    fake_send_batch(pub, &b, seq);
}

/* Answers one KvReplayRequest with fe's snapshot, in one part. */
static void *fake_replay_main(void *arg)
{
    struct fake_events *fe = arg;
    zmq_msg_t ident, body;
    zmq_msg_init(&ident);
    zmq_msg_init(&body);
    if (zmq_msg_recv(&ident, fe->replay, 0) < 0 || zmq_msg_recv(&body, fe->replay, 0) < 0)
        return NULL; /* the test sees the replay time out */
    Snapkv__AllCleared cl = SNAPKV__ALL_CLEARED__INIT;
    Snapkv__SessionStored st[4];
    Snapkv__KvEvent e[5], *ep[5];
    snapkv__kv_event__init(&e[0]);
    e[0].kind_case = SNAPKV__KV_EVENT__KIND_CLEARED;
    e[0].cleared = &cl;
    ep[0] = &e[0];
    for (size_t i = 0; i < fe->n_ids; i++) {
        snapkv__session_stored__init(&st[i]);
        st[i].session_id = wire_id(fe->ids[i]);
        st[i].tenant = "t";
        snapkv__kv_event__init(&e[i + 1]);
        e[i + 1].kind_case = SNAPKV__KV_EVENT__KIND_STORED;
        e[i + 1].stored = &st[i];
        ep[i + 1] = &e[i + 1];
    }
    Snapkv__KvEventBatch b = SNAPKV__KV_EVENT_BATCH__INIT;
    b.version = 1;
    b.ts = wall_now();
    b.boot_id = fe->boot_id;
    b.n_events = fe->n_ids + 1;
    b.events = ep;
    Snapkv__KvReplayReply rep = SNAPKV__KV_REPLAY_REPLY__INIT;
    rep.version = 1;
    rep.final = true;
    rep.batch = &b;
    uint8_t buf[1024], be[8];
    size_t len = snapkv__kv_replay_reply__pack(&rep, buf);
    for (int k = 0; k < 8; k++)
        be[k] = (uint8_t)(fe->sequence >> (56 - 8 * k));
    zmq_send(fe->replay, zmq_msg_data(&ident), zmq_msg_size(&ident), ZMQ_SNDMORE);
    zmq_send(fe->replay, be, sizeof be, ZMQ_SNDMORE);
    zmq_send(fe->replay, buf, len, 0);
    zmq_msg_close(&ident);
    zmq_msg_close(&body);
    return NULL;
}

/* A replay of a snapshot of `ids` at (boot_id, sequence). */
static void fake_replay(struct fake_events *fe, snapkv_events_t *ev, uint64_t boot_id, uint64_t sequence,
                        const struct snapkv_session_id *id)
{
    fe->boot_id = boot_id;
    fe->sequence = sequence;
    fe->n_ids = id != NULL;
    fe->ids[0] = id;
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, fake_replay_main, fe), 0);
    int rc = snapkv_events_replay(ev, fe->replay_ep, 5000);
    pthread_join(t, NULL);
    if (rc)
        fail_msg("replay: %s", snapkv_last_error());
}

/* A subscriber of fe's publisher, once its subscription reached it. */
static snapkv_events_t *subscribed(struct fake_events *fe)
{
    snapkv_events_t *ev = NULL;
    assert_int_equal(snapkv_events_open(fe->pub_ep, &ev), SNAPKV_OK);
    char sub[32];
    assert_true(zmq_recv(fe->pub, sub, sizeof sub, 0) > 0);
    assert_int_equal(sub[0], 1); /* a subscription */
    return ev;
}

static void expect_event(snapkv_events_t *ev, enum snapkv_event_kind kind, uint64_t seq,
                         const struct snapkv_session_id *id)
{
    struct snapkv_event e;
    int rc = snapkv_events_next(ev, 3000, &e);
    if (rc)
        fail_msg("events_next: %s", snapkv_last_error());
    assert_int_equal(e.kind, kind);
    assert_int_equal(e.sequence, seq);
    if (id)
        assert_memory_equal(e.id.bytes, id->bytes, 16);
    snapkv_event_free(&e);
}

/* No event comes within 200 ms. */
static void expect_quiet(snapkv_events_t *ev)
{
    struct snapkv_event e;
    assert_int_equal(snapkv_events_next(ev, 200, &e), SNAPKV_E_TIMEOUT);
}

static const struct snapkv_session_id ID_C = {{3}}, ID_D = {{4}}, ID_E = {{5}}, ID_F = {{6}}, ID_G = {{7}};

/* After a replay, what the stream had queued before the snapshot came is dropped: its own
 * daemon's events up to its number (AllCleared too), and any of a daemon that ran before it;
 * a daemon started after it gets through, its AllCleared missed or not. */
static void test_events_replay_filter(void **state)
{
    (void)state;
    struct fake_events *fe = fake_events_start();
    snapkv_events_t *ev = subscribed(fe);

    /* daemon 222 starts (the subscriber gets its AllCleared), then a replay of it at 2 */
    fake_publish(fe->pub, 222, 1, SNAPKV_EVENT_CLEARED, NULL);
    fake_publish(fe->pub, 222, 2, SNAPKV_EVENT_STORED, &ID_A);
    usleep(150 * 1000);
    fake_replay(fe, ev, 222, 2, &ID_A);
    fake_publish(fe->pub, 222, 3, SNAPKV_EVENT_STORED, &ID_C);
    expect_event(ev, SNAPKV_EVENT_CLEARED, 2, NULL);
    expect_event(ev, SNAPKV_EVENT_STORED, 2, &ID_A);
    expect_event(ev, SNAPKV_EVENT_STORED, 3, &ID_C); /* not 222's AllCleared at 1 */

    /* 222's events wait unread while it is replaced by 444; a replay of 444 at 5 */
    fake_publish(fe->pub, 222, 4, SNAPKV_EVENT_STORED, &ID_D);
    fake_publish(fe->pub, 222, 5, SNAPKV_EVENT_CLEARED, NULL);
    fake_publish(fe->pub, 222, 6, SNAPKV_EVENT_STORED, &ID_D);
    usleep(150 * 1000);
    fake_replay(fe, ev, 444, 5, &ID_E);
    fake_publish(fe->pub, 444, 5, SNAPKV_EVENT_STORED, &ID_E); /* still on its way: in the snapshot */
    /* 444 is replaced by 555 before it published more: 555's AllCleared went before this
     * subscriber reconnected, its next events come after a CLEARED of sequence 0 (a restart) */
    fake_publish(fe->pub, 555, 2, SNAPKV_EVENT_STORED, &ID_F);
    fake_publish(fe->pub, 555, 3, SNAPKV_EVENT_STORED, &ID_G);
    expect_event(ev, SNAPKV_EVENT_CLEARED, 5, NULL);
    expect_event(ev, SNAPKV_EVENT_STORED, 5, &ID_E);
    expect_event(ev, SNAPKV_EVENT_CLEARED, 0, NULL);
    expect_event(ev, SNAPKV_EVENT_STORED, 2, &ID_F);
    expect_event(ev, SNAPKV_EVENT_STORED, 3, &ID_G);
    expect_quiet(ev);

    snapkv_events_close(&ev);
    fake_events_stop(&fe);
}

/* Without a replay, a restart shows as a CLEARED of sequence 0 before the new daemon's first
 * event, when that is not its own AllCleared (sequence 1): before, a subscriber kept every
 * session of the old daemon, and a new daemon's numbers could even look continuous. After a
 * replay, events of a daemon that ran before the snapshot are dropped whatever they are
 * numbered, those of one started since are kept (the batches' times tell them apart). */
static void test_events_restart(void **state)
{
    (void)state;
    struct fake_events *fe = fake_events_start();
    snapkv_events_t *ev = subscribed(fe);
    fake_publish(fe->pub, 222, 1, SNAPKV_EVENT_CLEARED, NULL);
    fake_publish(fe->pub, 222, 2, SNAPKV_EVENT_STORED, &ID_A);
    fake_publish(fe->pub, 333, 3, SNAPKV_EVENT_STORED, &ID_C); /* 333's 1 and 2 missed: 3 looks next */
    fake_publish(fe->pub, 444, 1, SNAPKV_EVENT_CLEARED, NULL); /* 444's own first: no extra */
    fake_publish(fe->pub, 444, 2, SNAPKV_EVENT_STORED, &ID_D);
    expect_event(ev, SNAPKV_EVENT_CLEARED, 1, NULL);
    expect_event(ev, SNAPKV_EVENT_STORED, 2, &ID_A);
    expect_event(ev, SNAPKV_EVENT_CLEARED, 0, NULL);
    expect_event(ev, SNAPKV_EVENT_STORED, 3, &ID_C);
    expect_event(ev, SNAPKV_EVENT_CLEARED, 1, NULL);
    expect_event(ev, SNAPKV_EVENT_STORED, 2, &ID_D);

    /* 444's late events wait unread while 666 replaces it; a replay of 666 at 7; 444's stay
     * dropped however high their numbers, and 666's own above 7 come with no extra CLEARED */
    fake_publish(fe->pub, 444, 50, SNAPKV_EVENT_STORED, &ID_E);
    usleep(150 * 1000);
    fake_replay(fe, ev, 666, 7, &ID_F);
    fake_publish(fe->pub, 666, 8, SNAPKV_EVENT_STORED, &ID_G);
    expect_event(ev, SNAPKV_EVENT_CLEARED, 7, NULL);
    expect_event(ev, SNAPKV_EVENT_STORED, 7, &ID_F);
    expect_event(ev, SNAPKV_EVENT_STORED, 8, &ID_G);
    expect_quiet(ev);

    /* heartbeats: one of the same daemon is no event; one of a new daemon whose AllCleared was
     * missed is a CLEARED of sequence 0 at once, not only with that daemon's first event */
    fake_heartbeat(fe->pub, 666, 8);
    expect_quiet(ev);
    fake_heartbeat(fe->pub, 777, 2);
    expect_event(ev, SNAPKV_EVENT_CLEARED, 0, NULL);
    fake_heartbeat(fe->pub, 777, 2);
    fake_publish(fe->pub, 777, 3, SNAPKV_EVENT_STORED, &ID_A);
    expect_event(ev, SNAPKV_EVENT_STORED, 3, &ID_A);
    expect_quiet(ev);
    snapkv_events_close(&ev);
    fake_events_stop(&fe);
}

/* tests/reference/gen_place_vectors.py (Python's hashlib.blake2b): the index rendezvous hashing
 * picks for "key-0" .. "key-63" over PLACE_NAMES, and over its first three */
static const char PLACE_ALL5[] = "3033232120343442242433231010332313341330321113202234022032031213";
static const char PLACE_FIRST3[] = "2020212120101002212111211010222011001210221111202220022002021211";
static const size_t PLACE_EMPTY_KEY = 1; /* all five, a key of 0 bytes */
static const char *const PLACE_NAMES[5] = {"ipc:///run/snapkvd/a.sock", "ipc:///run/snapkvd/b.sock",
                                           "tcp://10.0.0.3:5555", "tcp://10.0.0.4:5555", "tcp://[fd00::5]:5555"};

static size_t placed(const char *const *names, size_t n, const char *key)
{
    size_t at = 99;
    assert_int_equal(snapkv_place(names, n, key, strlen(key), &at), SNAPKV_OK);
    assert_true(at < n);
    return at;
}

/* snapkv_place: the reference's choices; the same name whatever the list's order; one name
 * leaving moves only its keys; keys spread evenly; bad lists refused. */
static void test_place(void **state)
{
    (void)state;
    char key[32];
    for (int i = 0; i < 64; i++) {
        snprintf(key, sizeof key, "key-%d", i);
        assert_int_equal(placed(PLACE_NAMES, 5, key), (size_t)(PLACE_ALL5[i] - '0'));
        assert_int_equal(placed(PLACE_NAMES, 3, key), (size_t)(PLACE_FIRST3[i] - '0'));
    }
    size_t at = 99;
    assert_int_equal(snapkv_place(PLACE_NAMES, 5, NULL, 0, &at), SNAPKV_OK);
    assert_int_equal(at, PLACE_EMPTY_KEY);
    assert_int_equal(placed(PLACE_NAMES, 1, "anything"), 0);
    const char *reversed[5], *without2[4];
    for (int i = 0; i < 5; i++)
        reversed[i] = PLACE_NAMES[4 - i];
    for (int i = 0, k = 0; i < 5; i++)
        if (i != 2)
            without2[k++] = PLACE_NAMES[i];
    int count[5] = {0}, moved = 0;
    enum { KEYS = 1000 };
    for (int i = 0; i < KEYS; i++) {
        snprintf(key, sizeof key, "doc-%d", i);
        size_t a = placed(PLACE_NAMES, 5, key);
        count[a]++;
        assert_string_equal(reversed[placed(reversed, 5, key)], PLACE_NAMES[a]);
        const char *now = without2[placed(without2, 4, key)];
        if (a == 2)
            moved++;
        else
            assert_string_equal(now, PLACE_NAMES[a]); /* only the leaving name's keys move */
    }
    for (int i = 0; i < 5; i++) /* 200 expected each; a binomial's standard deviation is 12.6 */
        assert_true(count[i] > 120 && count[i] < 280);
    assert_int_equal(moved, count[2]);
    const char *twice[3] = {"ipc:///x", "ipc:///y", "ipc:///x"}, *empty[2] = {"ipc:///x", ""},
               *null[2] = {"ipc:///x", NULL};
    assert_int_equal(snapkv_place(PLACE_NAMES, 0, "k", 1, &at), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_place(NULL, 1, "k", 1, &at), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_place(PLACE_NAMES, 5, NULL, 1, &at), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_place(PLACE_NAMES, 5, "k", 1, NULL), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_place(twice, 3, "k", 1, &at), SNAPKV_E_INVAL);
    assert_non_null(strstr(snapkv_last_error(), "'ipc:///x' is listed twice"));
    assert_int_equal(snapkv_place(empty, 2, "k", 1, &at), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_place(null, 2, "k", 1, &at), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_place(PLACE_NAMES, 4097, "k", 1, &at), SNAPKV_E_INVAL);
}

/* Session references: written and read back, split at the last '#', bad ones refused. */
static void test_session_refs(void **state)
{
    (void)state;
    struct snapkv_session_id id, back;
    for (int i = 0; i < 16; i++)
        id.bytes[i] = (uint8_t)(0xf0 + i);
    char ref[128], ep[64];
    assert_int_equal(snapkv_session_ref("ipc:///run/a#b.sock", &id, ref, sizeof ref), SNAPKV_OK);
    assert_string_equal(ref, "ipc:///run/a#b.sock#f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff");
    assert_int_equal(snapkv_session_ref_parse(ref, ep, sizeof ep, &back), SNAPKV_OK);
    assert_string_equal(ep, "ipc:///run/a#b.sock");
    assert_memory_equal(back.bytes, id.bytes, 16);
    /* 19 + 1 + 32 + NUL = 53 bytes */
    assert_int_equal(snapkv_session_ref("ipc:///run/a#b.sock", &id, ref, 52), SNAPKV_E_LIMIT);
    assert_int_equal(snapkv_session_ref("ipc:///run/a#b.sock", &id, ref, 53), SNAPKV_OK);
    assert_int_equal(snapkv_session_ref("", &id, ref, sizeof ref), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_session_ref_parse(ref, ep, 19, &back), SNAPKV_E_LIMIT);
    assert_int_equal(snapkv_session_ref_parse(ref, ep, 20, &back), SNAPKV_OK);
    assert_int_equal(snapkv_session_ref_parse("f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff", ep, sizeof ep, &back),
                     SNAPKV_E_INVAL);
    assert_int_equal(snapkv_session_ref_parse("#f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff", ep, sizeof ep, &back),
                     SNAPKV_E_INVAL);
    assert_int_equal(snapkv_session_ref_parse("ipc:///x#f0f1f2f3", ep, sizeof ep, &back), SNAPKV_E_INVAL);
    assert_non_null(strstr(snapkv_last_error(), "not 32 hex digits"));
    assert_int_equal(snapkv_session_ref_parse("ipc:///x#f0f1f2f3f4f5f6f7f8f9fafbfcfdfeffg", ep, sizeof ep, &back),
                     SNAPKV_E_INVAL);
}

/* A key whose highest weight over names[0..n) is at index want ("k<i>" for the first such i). */
static void key_for(const char *const *names, size_t n, size_t want, char *key, size_t cap)
{
    for (int i = 0;; i++) {
        snprintf(key, cap, "k%d", i);
        if (placed(names, n, key) == want)
            return;
    }
}

/* snapkv_connect_many over three fakes: placements follow snapkv_place; an endpoint whose call
 * went unanswered, whose daemon stopped, or that the caller marked, is skipped for down_ms and
 * its keys, only its keys, go to their next endpoint; once down_ms passed it is looked at again;
 * references find their endpoint; every endpoint down is UNAVAILABLE; bad arguments refused. */
static bool answer_not_found(struct fake *f, const Snapkv__Request *req)
{
    if (req->command_case == SNAPKV__REQUEST__COMMAND_HELLO)
        return false;
    fake_error(f, SNAPKV_E_NOT_FOUND, "no such session");
    return true;
}

/* What a progress callback saw of the handle while endpoint 0's client ran a PREFILL. */
struct many_in_call {
    snapkv_many_t *m;
    const char *key0; /* a key of endpoint 0 */
    const char *ref0; /* a reference to a session at endpoint 0 */
    int calls, client0, client2, session0, place_rc;
    size_t placed_at;
    char place_error[512];
};

static void many_progress(void *user, uint32_t done, uint32_t total)
{
    (void)done;
    (void)total;
    struct many_in_call *u = user;
    snapkv_client_t *cl = NULL;
    struct snapkv_session_id id;
    if (u->calls++) /* the first progress reply's view */
        return;
    u->client0 = snapkv_many_client(u->m, 0, &cl);
    u->client2 = u->ref0 ? snapkv_many_client(u->m, 2, &cl) : SNAPKV_OK;
    u->session0 = u->ref0 ? snapkv_many_session(u->m, u->ref0, &cl, &id) : SNAPKV_OK;
    u->place_rc = snapkv_many_place(u->m, u->key0, strlen(u->key0), &cl, &u->placed_at);
    if (u->place_rc)
        snprintf(u->place_error, sizeof u->place_error, "%s", snapkv_last_error());
}

static void test_connect_many(void **state)
{
    (void)state;
    struct fake *f[3];
    const char *names[3];
    for (int i = 0; i < 3; i++) {
        /* 0 and 1 answer HELLO and PREFILL only (any other request goes unanswered), 2 answers
         * NOT_FOUND */
        f[i] = fake_start(i == 2 ? answer_not_found : answer_prefill);
        names[i] = f[i]->endpoint;
    }
    snapkv_many_t *m = NULL;
    struct snapkv_connect_opts o = {.timeout_ms = 5000, .tenant = "acme"};
    assert_int_equal(snapkv_connect_many(names, 3, &o, 1500, &m), SNAPKV_OK);
    assert_int_equal(fake_requests(f[0]) + fake_requests(f[1]) + fake_requests(f[2]), 0); /* none connected yet */
    assert_string_equal(snapkv_many_endpoint(m, 2), names[2]);
    assert_null(snapkv_many_endpoint(m, 3));
    char key[32];
    snapkv_client_t *cl = NULL, *first[3] = {NULL, NULL, NULL};
    size_t at = 99;
    for (int i = 0; i < 60; i++) {
        snprintf(key, sizeof key, "doc-%d", i);
        assert_int_equal(snapkv_many_place(m, key, strlen(key), &cl, &at), SNAPKV_OK);
        assert_int_equal(at, placed(names, 3, key));
        if (!first[at])
            first[at] = cl;
        assert_ptr_equal(cl, first[at]); /* one connection per endpoint */
    }
    for (int i = 0; i < 3; i++) {
        assert_non_null(first[i]);
        assert_int_equal(fake_requests(f[i]), 1); /* its HELLO */
    }
    Snapkv__Request *req = fake_last(f[1]);
    assert_string_equal(req->tenant, "acme");
    snapkv__request__free_unpacked(req, NULL);

    /* a callback of endpoint 0's running call: that client is busy (not down), placement skips it */
    char key0[32], ref0[200];
    key_for(names, 3, 0, key0, sizeof key0);
    const char *without0[2] = {names[1], names[2]};
    assert_int_equal(snapkv_session_ref(names[0], &ID_A, ref0, sizeof ref0), SNAPKV_OK);
    struct many_in_call u = {.m = m, .key0 = key0, .ref0 = ref0};
    uint32_t toks[3] = {5, 6, 7};
    struct snapkv_prefill_opts po = {.tokens = toks, .n_tokens = 3, .progress = many_progress, .progress_user = &u};
    struct snapkv_prefill_result pr;
    assert_int_equal(snapkv_prefill(first[0], &po, &pr), SNAPKV_OK);
    snapkv_prefill_result_free(&pr);
    assert_int_equal(u.calls, 3);
    assert_int_equal(u.client0, SNAPKV_E_BUSY);
    assert_int_equal(u.client2, SNAPKV_OK);
    assert_int_equal(u.session0, SNAPKV_E_BUSY);
    assert_int_equal(u.place_rc, SNAPKV_OK);
    assert_int_equal(u.placed_at, placed(without0, 2, key0) + 1); /* key0's second choice */
    assert_int_equal(snapkv_many_place(m, key0, strlen(key0), &cl, &at), SNAPKV_OK); /* and after it, 0 again */
    assert_int_equal(at, 0);

    /* a call to endpoint 1 goes unanswered: its keys go to their second choice for 1.5 s */
    const char *without1[2] = {names[0], names[2]};
    char key1[32];
    key_for(names, 3, 1, key1, sizeof key1);
    size_t second = placed(without1, 2, key1) == 0 ? 0 : 2;
    struct snapkv_session_id id = {{1}};
    /* an error the daemon answered leaves its endpoint up */
    assert_int_equal(snapkv_many_client(m, 2, &cl), SNAPKV_OK);
    assert_int_equal(snapkv_release(cl, &id), SNAPKV_E_NOT_FOUND);
    assert_int_equal(snapkv_many_client(m, 2, &cl), SNAPKV_OK);
    assert_int_equal(snapkv_many_client(m, 1, &cl), SNAPKV_OK);
    assert_int_equal(snapkv_set_timeout(cl, 300), SNAPKV_OK);
    assert_int_equal(snapkv_release(cl, &id), SNAPKV_E_TIMEOUT);
    assert_int_equal(snapkv_many_place(m, key1, strlen(key1), &cl, &at), SNAPKV_OK);
    assert_int_equal(at, second);
    for (int i = 0; i < 60; i++) { /* only endpoint 1's keys moved */
        snprintf(key, sizeof key, "doc-%d", i);
        size_t want = placed(names, 3, key);
        assert_int_equal(snapkv_many_place(m, key, strlen(key), &cl, &at), SNAPKV_OK);
        assert_int_equal(at, want == 1 ? (placed(without1, 2, key) == 0 ? 0 : 2) : want);
    }
    assert_int_equal(snapkv_many_client(m, 1, &cl), SNAPKV_E_UNAVAILABLE);
    assert_non_null(strstr(snapkv_last_error(), "went unanswered"));
    assert_non_null(strstr(snapkv_last_error(), names[1]));
    char ref[200];
    assert_int_equal(snapkv_session_ref(names[1], &id, ref, sizeof ref), SNAPKV_OK);
    struct snapkv_session_id got;
    assert_int_equal(snapkv_many_session(m, ref, &cl, &got), SNAPKV_E_UNAVAILABLE);
    usleep(1600 * 1000); /* down_ms passed: endpoint 1 is looked at again, and it is up */
    assert_int_equal(snapkv_many_place(m, key1, strlen(key1), &cl, &at), SNAPKV_OK);
    assert_int_equal(at, 1);
    assert_ptr_equal(cl, first[1]);
    assert_int_equal(snapkv_many_session(m, ref, &cl, &got), SNAPKV_OK);
    assert_ptr_equal(cl, first[1]);
    assert_memory_equal(got.bytes, id.bytes, 16);
    assert_int_equal(snapkv_session_ref("ipc:///elsewhere", &id, ref, sizeof ref), SNAPKV_OK);
    assert_int_equal(snapkv_many_session(m, ref, &cl, &got), SNAPKV_E_NOT_FOUND);
    assert_int_equal(snapkv_many_session(m, "not-a-ref", &cl, &got), SNAPKV_E_INVAL);

    /* the caller marks endpoint 1 down */
    assert_int_equal(snapkv_many_mark_down(m, 1), SNAPKV_OK);
    assert_int_equal(snapkv_many_place(m, key1, strlen(key1), &cl, &at), SNAPKV_OK);
    assert_int_equal(at, second);
    assert_int_equal(snapkv_many_mark_down(m, 3), SNAPKV_E_INVAL);

    /* endpoint 0's daemon stops: once its client sees the connection close, its keys move */
    fake_stop(&f[0]);
    bool moved = false;
    for (int i = 0; i < 100 && !moved; i++) {
        assert_int_equal(snapkv_many_place(m, key0, strlen(key0), &cl, &at), SNAPKV_OK);
        moved = at != 0;
        if (!moved)
            usleep(20 * 1000);
    }
    assert_true(moved);
    assert_int_equal(snapkv_many_client(m, 0, &cl), SNAPKV_E_UNAVAILABLE);
    assert_non_null(strstr(snapkv_last_error(), "connection closed"));

    /* every endpoint down */
    fake_stop(&f[2]);
    usleep(1600 * 1000); /* endpoint 1 (marked) is up again: mark it once more */
    assert_int_equal(snapkv_many_mark_down(m, 1), SNAPKV_OK);
    bool all = false;
    for (int i = 0; i < 100 && !all; i++) {
        int rc = snapkv_many_place(m, key0, strlen(key0), &cl, &at);
        all = rc == SNAPKV_E_UNAVAILABLE;
        if (!all) {
            assert_int_equal(rc, SNAPKV_OK);
            assert_int_equal(at, 2); /* (endpoint 2's close not seen yet) */
            usleep(20 * 1000);
        }
    }
    assert_true(all);
    assert_non_null(strstr(snapkv_last_error(), "every endpoint is down (3)"));
    assert_non_null(strstr(snapkv_last_error(), "marked down by the caller"));
    snapkv_close_many(&m);
    assert_null(m);
    snapkv_close_many(&m);
    snapkv_close_many(NULL);
    fake_stop(&f[1]);

    /* an endpoint nothing listens on, and one libzmq does not take: their connects fail and
     * both are marked down */
    const char *none[2] = {"ipc:///nonexistent/skv-many-test.sock", "tcp://no-port-here"};
    assert_int_equal(snapkv_connect_many(none, 2, &(struct snapkv_connect_opts){.timeout_ms = 1000}, 0, &m),
                     SNAPKV_OK);
    assert_int_equal(snapkv_many_place(m, "k", 1, &cl, &at), SNAPKV_E_UNAVAILABLE);
    assert_non_null(strstr(snapkv_last_error(), "connect: "));
    assert_non_null(strstr(snapkv_last_error(), "tcp://no-port-here: connect: "));
    int64_t t0 = now_ms();
    assert_int_equal(snapkv_many_client(m, 0, &cl), SNAPKV_E_UNAVAILABLE); /* within down_ms: no new connect */
    assert_true(now_ms() - t0 < 500);
    assert_non_null(strstr(snapkv_last_error(), "is down for"));
    snapkv_close_many(&m);

    /* a handle of one endpoint, placing from a callback of that endpoint's call: BUSY, not down */
    struct fake *solo = fake_start(answer_prefill);
    const char *solo_name[1] = {solo->endpoint};
    assert_int_equal(snapkv_connect_many(solo_name, 1, &(struct snapkv_connect_opts){.timeout_ms = 5000}, 0, &m),
                     SNAPKV_OK);
    assert_int_equal(snapkv_many_client(m, 0, &cl), SNAPKV_OK);
    u = (struct many_in_call){.m = m, .key0 = "k"}; /* (the callback asks endpoint 0 and places) */
    po.progress_user = &u;
    assert_int_equal(snapkv_prefill(cl, &po, &pr), SNAPKV_OK);
    snapkv_prefill_result_free(&pr);
    assert_int_equal(u.client0, SNAPKV_E_BUSY);
    assert_int_equal(u.place_rc, SNAPKV_E_BUSY);
    assert_non_null(strstr(u.place_error, "no endpoint can take a call (1, 1 of them running"));
    assert_int_equal(snapkv_many_place(m, "k", 1, &cl, &at), SNAPKV_OK); /* and after it, up */
    snapkv_close_many(&m);
    fake_stop(&solo);

    /* options no daemon takes: refused at once */
    const char *one[1] = {"ipc:///nonexistent/skv-many-test.sock"};
    assert_int_equal(snapkv_connect_many(one, 1, &(struct snapkv_connect_opts){.tenant = "bad tenant"}, 0, &m),
                     SNAPKV_E_INVAL);
    assert_non_null(strstr(snapkv_last_error(), "tenant 'bad tenant'"));
    char pub[SNAPKV_CURVE_KEY_SIZE], sec[SNAPKV_CURVE_KEY_SIZE];
    assert_int_equal(snapkv_curve_keypair(pub, sec), SNAPKV_OK);
    assert_int_equal(
        snapkv_connect_many(one, 1, &(struct snapkv_connect_opts){.curve_server_key = "short", .curve_secret_key = sec},
                            0, &m),
        SNAPKV_E_INVAL);
    assert_non_null(strstr(snapkv_last_error(), "not a Z85 key"));
    assert_int_equal(
        snapkv_connect_many(one, 1, &(struct snapkv_connect_opts){.curve_server_key = pub, .curve_secret_key = sec},
                            0, &m),
        SNAPKV_OK); /* good keys: taken */
    snapkv_close_many(&m);
    assert_int_equal(snapkv_connect_many(one, 1, &(struct snapkv_connect_opts){.name = "bad \xff name"}, 0, &m),
                     SNAPKV_E_INVAL);
    assert_non_null(strstr(snapkv_last_error(), "ill-formed UTF-8 at byte 4"));
    char long_name[4098];
    memset(long_name, 'n', sizeof long_name - 1);
    long_name[sizeof long_name - 1] = '\0';
    assert_int_equal(snapkv_connect(one[0], &(struct snapkv_connect_opts){.name = long_name}, &cl), SNAPKV_E_INVAL);
    assert_non_null(strstr(snapkv_last_error(), "client name of 4097 bytes"));
    assert_int_equal(snapkv_connect_many(one, 1, &(struct snapkv_connect_opts){.timeout_ms = -2}, 0, &m),
                     SNAPKV_E_INVAL);

    /* bad arguments */
    const char *twice[2] = {"ipc:///x", "ipc:///x"};
    char longname[1100];
    memset(longname, 'a', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    const char *toolong[1] = {longname};
    const char *many[SNAPKV_MANY_MAX + 1];
    char many_names[SNAPKV_MANY_MAX + 1][32];
    for (int i = 0; i <= SNAPKV_MANY_MAX; i++) {
        snprintf(many_names[i], sizeof many_names[i], "ipc:///x%d", i);
        many[i] = many_names[i];
    }
    assert_int_equal(snapkv_connect_many(twice, 2, NULL, 0, &m), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_connect_many(toolong, 1, NULL, 0, &m), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_connect_many(many, SNAPKV_MANY_MAX + 1, NULL, 0, &m), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_connect_many(many, 0, NULL, 0, &m), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_connect_many(many, 2, NULL, -1, &m), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_connect_many(many, 2, NULL, 3600001, &m), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_connect_many(many, SNAPKV_MANY_MAX, NULL, 3600000, &m), SNAPKV_OK);
    assert_int_equal(snapkv_many_client(m, SNAPKV_MANY_MAX, &cl), SNAPKV_E_INVAL);
    assert_int_equal(snapkv_many_place(m, NULL, 1, &cl, &at), SNAPKV_E_INVAL);
    snapkv_close_many(&m);
    assert_string_equal(snapkv_status_str(SNAPKV_E_UNAVAILABLE), "unavailable");
}

/* No event comes, and within 3 s snapkv_events_published says `want` (a heartbeat read). */
static void expect_quiet_published(snapkv_events_t *ev, uint64_t want)
{
    for (int i = 0; i < 15 && snapkv_events_published(ev) != want; i++)
        expect_quiet(ev);
    assert_int_equal(snapkv_events_published(ev), want);
}

/* snapkv_events_published: events lost at the end of a stream that then went quiet show only in
 * the heartbeat's number (no later event's number jumps); a replay's snapshot and another
 * daemon's numbers set it too. */
static void test_events_published(void **state)
{
    (void)state;
    struct fake_events *fe = fake_events_start();
    snapkv_events_t *ev = subscribed(fe);
    assert_int_equal(snapkv_events_published(ev), 0);
    assert_int_equal(snapkv_events_published(NULL), 0);
    fake_publish(fe->pub, 222, 1, SNAPKV_EVENT_CLEARED, NULL);
    fake_publish(fe->pub, 222, 2, SNAPKV_EVENT_STORED, &ID_A);
    expect_event(ev, SNAPKV_EVENT_CLEARED, 1, NULL);
    expect_event(ev, SNAPKV_EVENT_STORED, 2, &ID_A);
    assert_int_equal(snapkv_events_published(ev), 2);
    fake_heartbeat(fe->pub, 222, 2); /* nothing missed */
    expect_quiet_published(ev, 2);
    /* 3 and 4 went out and were lost (as a full queue drops them); then only the heartbeat */
    fake_heartbeat(fe->pub, 222, 4);
    expect_quiet_published(ev, 4);
    /* a replay at 4 catches up, and the stream goes on above it */
    fake_replay(fe, ev, 222, 4, &ID_C);
    assert_int_equal(snapkv_events_published(ev), 4);
    expect_event(ev, SNAPKV_EVENT_CLEARED, 4, NULL);
    expect_event(ev, SNAPKV_EVENT_STORED, 4, &ID_C);
    fake_heartbeat(fe->pub, 222, 3); /* queued before the snapshot: dropped, it says nothing */
    fake_publish(fe->pub, 222, 5, SNAPKV_EVENT_STORED, &ID_D);
    expect_event(ev, SNAPKV_EVENT_STORED, 5, &ID_D);
    assert_int_equal(snapkv_events_published(ev), 5);
    /* another daemon's heartbeat: a CLEARED of sequence 0, and its numbers from then on */
    fake_heartbeat(fe->pub, 333, 2);
    expect_event(ev, SNAPKV_EVENT_CLEARED, 0, NULL);
    assert_int_equal(snapkv_events_published(ev), 2);
    expect_quiet(ev);
    /* a daemon of before boot ids (0) that restarts numbers from 1 again: not the old number */
    fake_publish(fe->pub, 0, 7, SNAPKV_EVENT_STORED, &ID_E);
    expect_event(ev, SNAPKV_EVENT_STORED, 7, &ID_E);
    fake_publish(fe->pub, 0, 1, SNAPKV_EVENT_CLEARED, NULL);
    expect_event(ev, SNAPKV_EVENT_CLEARED, 1, NULL);
    assert_int_equal(snapkv_events_published(ev), 1);
    fake_heartbeat(fe->pub, 0, 1);
    expect_quiet(ev);
    assert_int_equal(snapkv_events_published(ev), 1);
    /* ... and a replay of it after it restarted again: the snapshot's number, not the one read */
    fake_publish(fe->pub, 0, 500, SNAPKV_EVENT_STORED, &ID_F);
    expect_event(ev, SNAPKV_EVENT_STORED, 500, &ID_F);
    fake_replay(fe, ev, 0, 3, &ID_G);
    assert_int_equal(snapkv_events_published(ev), 3);
    expect_event(ev, SNAPKV_EVENT_CLEARED, 3, NULL);
    expect_event(ev, SNAPKV_EVENT_STORED, 3, &ID_G);
    expect_quiet(ev);
    snapkv_events_close(&ev);
    fake_events_stop(&fe);
}

/* After a replay, a daemon started since whose clock was stepped back is still told from one
 * that ran before the snapshot, once the stream showed the replayed daemon's own messages:
 * before, its events were dropped until its clock passed the snapshot's time. */
static void test_events_clock_stepped_back(void **state)
{
    (void)state;
    struct fake_events *fe = fake_events_start();
    snapkv_events_t *ev = subscribed(fe);
    fake_publish(fe->pub, 111, 9, SNAPKV_EVENT_STORED, &ID_D); /* a daemon before 222: dropped */
    fake_publish(fe->pub, 222, 1, SNAPKV_EVENT_CLEARED, NULL);
    fake_publish(fe->pub, 222, 2, SNAPKV_EVENT_STORED, &ID_A);
    usleep(150 * 1000);
    fake_replay(fe, ev, 222, 2, &ID_A);
    g_clock_step = -3600; /* 333 starts an hour "earlier"; its AllCleared was missed */
    fake_publish(fe->pub, 333, 2, SNAPKV_EVENT_STORED, &ID_F);
    fake_heartbeat(fe->pub, 333, 2);
    fake_publish(fe->pub, 333, 3, SNAPKV_EVENT_STORED, &ID_G);
    g_clock_step = 0;
    expect_event(ev, SNAPKV_EVENT_CLEARED, 2, NULL);
    expect_event(ev, SNAPKV_EVENT_STORED, 2, &ID_A);
    expect_event(ev, SNAPKV_EVENT_CLEARED, 0, NULL);
    expect_event(ev, SNAPKV_EVENT_STORED, 2, &ID_F);
    expect_event(ev, SNAPKV_EVENT_STORED, 3, &ID_G);
    expect_quiet(ev);
    snapkv_events_close(&ev);
    fake_events_stop(&fe);

    /* a replay names its daemon, but only the stream's own messages tell the order: replayed
     * twice with none of 333's read between, a late message of an earlier daemon is dropped */
    fe = fake_events_start();
    ev = subscribed(fe);
    fake_replay(fe, ev, 333, 3, NULL);
    fake_replay(fe, ev, 333, 3, NULL);
    g_clock_step = -60; /* published before the snapshots, by a daemon before 333 */
    fake_publish(fe->pub, 111, 40, SNAPKV_EVENT_STORED, &ID_D);
    g_clock_step = 0;
    expect_event(ev, SNAPKV_EVENT_CLEARED, 3, NULL);
    expect_quiet(ev);
    snapkv_events_close(&ev);
    fake_events_stop(&fe);
}

static void *stale_publisher(void *arg)
{
    struct fake_events *fe = arg;
    for (uint64_t seq = 1; seq <= 24 && atomic_load(&fe->on); seq++) { /* 1.2 s at most */
        fake_publish(fe->pub, fe->boot_id, seq, SNAPKV_EVENT_STORED, &ID_A);
        usleep(50 * 1000);
    }
    return NULL;
}

/* Events dropped while snapkv_events_next waits do not extend its timeout. */
static void test_events_next_deadline(void **state)
{
    (void)state;
    struct fake_events *fe = fake_events_start();
    snapkv_events_t *ev = subscribed(fe);
    fake_replay(fe, ev, 777, 1000, NULL);
    expect_event(ev, SNAPKV_EVENT_CLEARED, 1000, NULL);
    atomic_store(&fe->on, true);
    assert_int_equal(pthread_create(&fe->thread, NULL, stale_publisher, fe), 0); /* 1, 2, ...: all dropped */
    struct snapkv_event e;
    int64_t t0 = now_ms();
    int rc = snapkv_events_next(ev, 300, &e);
    int64_t dt = now_ms() - t0;
    if (rc != SNAPKV_E_TIMEOUT)
        fail_msg("events_next: %d %s", rc, snapkv_last_error());
    atomic_store(&fe->on, false);
    pthread_join(fe->thread, NULL);
    assert_true(dt >= 290 && dt < 3000);
    assert_string_equal(snapkv_last_error(), "no event within 300 ms");
    snapkv_events_close(&ev);
    fake_events_stop(&fe);
}

static void test_kv_arithmetic(void **state)
{
    (void)state;
    uint32_t h[2] = {3, 3};
    struct snapkv_layer_kept layers[2] = {{.layer = 4, .kept = 3, .n_heads = 2, .kept_per_head = h},
                                          {.layer = 5, .kept = 10, .n_heads = 2, .kept_per_head = h}};
    /* 2 (K, V) * 2 heads * 3 rows * 64 dims * 4 bytes = 3072, then 10 rows: 10240 */
    assert_int_equal(snapkv_kv_bytes(layers, 1, 2, 64), 3072);
    assert_int_equal(snapkv_kv_bytes(layers, 2, 2, 64), 3072 + 10240);
    assert_int_equal(snapkv_kv_bytes(NULL, 2, 2, 64), 0);
    struct snapkv_kv_layout l = {.n_layers = 2, .layers = layers};
    assert_int_equal(snapkv_kv_offset(&l, 0, 0, false, 2, 64), 0);
    assert_int_equal(snapkv_kv_offset(&l, 0, 1, false, 2, 64), 768);
    assert_int_equal(snapkv_kv_offset(&l, 0, 0, true, 2, 64), 1536);
    assert_int_equal(snapkv_kv_offset(&l, 0, 1, true, 2, 64), 2304);
    assert_int_equal(snapkv_kv_offset(&l, 1, 1, true, 2, 64), 3072 + 5120 + 2560);
    struct snapkv_sampling s;
    memset(&s, 0x5a, sizeof s);
    snapkv_sampling_defaults(&s);
    assert_true(s.temperature == 0.0f && s.top_k == 0 && s.top_p == 1.0f && s.max_tokens == 0);
    assert_true(s.stop_at_eos);
    assert_null(s.stop_tokens);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_session_id_hex),
        cmocka_unit_test(test_last_error),
        cmocka_unit_test(test_null_client),
        cmocka_unit_test(test_argument_checks),
        cmocka_unit_test(test_connect_hello),
        cmocka_unit_test(test_version_mismatch),
        cmocka_unit_test(test_connect_timeout),
        cmocka_unit_test(test_connect_hello_lost),
        cmocka_unit_test(test_prefill_text),
        cmocka_unit_test(test_prefill_tokens_progress),
        cmocka_unit_test(test_error_status),
        cmocka_unit_test(test_decode_collect),
        cmocka_unit_test(test_decode_stream),
        cmocka_unit_test(test_decode_cancel_skips_rest),
        cmocka_unit_test(test_decode_stopped_daemon_gone),
        cmocka_unit_test(test_tcp_daemon_gone_silent),
        cmocka_unit_test(test_decode_timeout_cancels),
        cmocka_unit_test(test_decode_lost_tokens),
        cmocka_unit_test(test_callback_reentry),
        cmocka_unit_test(test_timeout_then_stale_reply),
        cmocka_unit_test(test_signals_do_not_end_calls),
        cmocka_unit_test(test_send_timeout_daemon_gone),
        cmocka_unit_test(test_send_timeout_daemon_deaf),
        cmocka_unit_test(test_hello_after_restart),
        cmocka_unit_test(test_refused_after_restart),
        cmocka_unit_test(test_odd_replies),
        cmocka_unit_test(test_message_size_limit),
        cmocka_unit_test(test_append_compress_release),
        cmocka_unit_test(test_shm),
        cmocka_unit_test(test_shm_daemon_user),
        cmocka_unit_test(test_export_import),
        cmocka_unit_test(test_admin_list_inspect),
        cmocka_unit_test(test_admin_actions),
        cmocka_unit_test(test_events_replay_filter),
        cmocka_unit_test(test_events_restart),
        cmocka_unit_test(test_events_clock_stepped_back),
        cmocka_unit_test(test_events_published),
        cmocka_unit_test(test_place),
        cmocka_unit_test(test_session_refs),
        cmocka_unit_test(test_connect_many),
        cmocka_unit_test(test_connect_no_permission),
        cmocka_unit_test(test_timeout_set_in_callback),
        cmocka_unit_test(test_events_next_deadline),
        cmocka_unit_test(test_kv_arithmetic),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
