/* Replies counted in bytes until their client takes them (daemon/replies.c), over a real ROUTER
 * and DEALERs on inproc (a message stays in the pipe until the DEALER reads it):
 * - a client's replies go until its bytes not taken yet would pass its bound, then are dropped
 *   (counted), and go again once it reads;
 * - the bound over all clients, which the admin endpoint's replies are not held to;
 * - the bound over one owner's clients (a user's or an address's);
 * - a reply larger than the bound goes when the client holds nothing;
 * - a reply to a routing id nobody has is refused and holds nothing;
 * - a client that closes with replies unread: their bytes come back. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/status.h"
#include "daemon/replies.h"

#define ENDPOINT "inproc://test-replies"

struct fixture {
    void *ctx, *router, *a, *b;
    struct skv_replies *r;
};

/* A DEALER with routing id `id`, known to the router once its first message was read. */
static void *dealer(struct fixture *f, const char *id)
{
    void *s = zmq_socket(f->ctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(s, ZMQ_ROUTING_ID, id, strlen(id));
    assert_int_equal(zmq_connect(s, ENDPOINT), 0);
    assert_int_equal(zmq_send(s, "hi", 2, 0), 2);
    char buf[16];
    assert_true(zmq_recv(f->router, buf, sizeof buf, 0) >= 0); /* identity */
    assert_int_equal(zmq_recv(f->router, buf, sizeof buf, 0), 2);
    return s;
}

/* What a reply of n body bytes to "A" or "B" counts: its body, its 1-byte routing id and the
 * tracking record's and libzmq's overhead. */
#define COST(n) ((uint64_t)(n) + 1 + SKV_REPLY_OVERHEAD)
#define PER_CLIENT (3 * COST(300) + COST(100))
#define PER_OWNER (2 * COST(600))
#define TOTAL (5 * COST(300))

/* Bounds: three replies of 300 bytes and one of 100 per client, two of 600 per owner, five of
 * 300 in all. */
static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof *f);
    *state = f;
    f->ctx = zmq_ctx_new();
    f->router = zmq_socket(f->ctx, ZMQ_ROUTER);
    int mandatory = 1, linger = 0;
    zmq_setsockopt(f->router, ZMQ_ROUTER_MANDATORY, &mandatory, sizeof mandatory);
    zmq_setsockopt(f->router, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_bind(f->router, ENDPOINT) != 0)
        return -1;
    f->a = dealer(f, "A");
    f->b = dealer(f, "B");
    return skv_replies_new(PER_CLIENT, PER_OWNER, TOTAL, &f->r);
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    if (f->a)
        zmq_close(f->a);
    if (f->b)
        zmq_close(f->b);
    zmq_close(f->router);
    zmq_ctx_term(f->ctx);
    skv_replies_free(&f->r);
    skv_replies_free(&f->r); /* NULL-safe */
    free(f);
    return 0;
}

/* A reply of len bytes to client id of endpoint sock_idx, owned by owner (0: none). */
static int send_as(struct fixture *f, int sock_idx, uint64_t owner, const char *id, size_t len)
{
    static uint8_t body[8192];
    assert_true(len <= sizeof body);
    memset(body, 'x', len);
    return skv_replies_send(f->r, f->router, sock_idx, owner, id, strlen(id), body, len);
}

static int send_to(struct fixture *f, const char *id, size_t len)
{
    return send_as(f, 0, 0, id, len);
}

static uint64_t held(struct fixture *f, const char *id)
{
    return skv_replies_unread_bytes_of(f->r, 0, id, strlen(id));
}

/* Reads one reply on s; returns its size. */
static int take(void *s)
{
    char buf[8192];
    return zmq_recv(s, buf, sizeof buf, ZMQ_DONTWAIT);
}

/* A client's bound counts each reply's overhead with its bytes: of 40 replies of 10 bytes, 6 fit
 * a bound of 2540 (before, all 40: their bodies counted 400 bytes, and a client never reading a
 * stream of small replies held some 30 times what the bound said). */
static void test_overhead_counted(void **state)
{
    struct fixture *f = *state;
    int sent = 0;
    while (sent < 40 && send_to(f, "A", 10) == SKV_OK)
        sent++;
    assert_int_equal(sent, 6); /* 2540 / 395 */
    assert_int_equal(PER_CLIENT, 2540);
    assert_int_equal(held(f, "A"), sent * COST(10));
}

static void test_per_client(void **state)
{
    struct fixture *f = *state;
    for (int i = 0; i < 3; i++)
        assert_int_equal(send_to(f, "A", 300), SKV_OK);
    assert_int_equal(held(f, "A"), 3 * COST(300));
    assert_int_equal(send_to(f, "A", 300), SKV_E_BUSY); /* a fourth of 300 passes the bound */
    char want[64];
    snprintf(want, sizeof want, "max-reply-bytes-per-client (%llu)", (unsigned long long)PER_CLIENT);
    assert_non_null(strstr(skv_error_msg(), want));
    assert_int_equal(skv_replies_dropped(f->r), 1);
    assert_int_equal(held(f, "A"), 3 * COST(300));
    assert_int_equal(send_to(f, "A", 100), SKV_OK); /* exactly the bound */
    assert_int_equal(take(f->a), 300);
    assert_int_equal(held(f, "A"), 2 * COST(300) + COST(100));
    assert_int_equal(skv_replies_unread_bytes(f->r), 2 * COST(300) + COST(100));
    assert_int_equal(send_to(f, "A", 300), SKV_OK);
    while (take(f->a) >= 0)
        ;
    assert_int_equal(held(f, "A"), 0);
    assert_int_equal(skv_replies_unread_bytes(f->r), 0);
    assert_int_equal(take(f->b), -1); /* B got nothing */
}

static void test_total(void **state)
{
    struct fixture *f = *state;
    for (int i = 0; i < 3; i++)
        assert_int_equal(send_to(f, "A", 300), SKV_OK);
    assert_int_equal(send_to(f, "B", 300), SKV_OK);
    assert_int_equal(send_to(f, "B", 300), SKV_OK); /* the total bound exactly */
    assert_int_equal(send_to(f, "B", 1), SKV_E_BUSY);
    char want[64];
    snprintf(want, sizeof want, "max-reply-bytes (%llu)", (unsigned long long)TOTAL);
    assert_non_null(strstr(skv_error_msg(), want));
    assert_int_equal(held(f, "B"), 2 * COST(300));
    assert_int_equal(take(f->a), 300);
    assert_int_equal(send_to(f, "B", 300), SKV_OK); /* A's read made room */
    assert_int_equal(skv_replies_unread_bytes(f->r), TOTAL);
    assert_int_equal(skv_replies_dropped(f->r), 1);
    /* the admin endpoint's replies go past the total (its client's own bound still holds) */
    assert_int_equal(send_as(f, 1, 0, "A", 300), SKV_OK);
    assert_int_equal(skv_replies_unread_bytes(f->r), TOTAL + COST(300));
    assert_int_equal(skv_replies_unread_bytes_of(f->r, 1, "A", 1), COST(300));
    assert_int_equal(send_to(f, "A", 1), SKV_E_BUSY);
}

/* One owner's clients together: A and B of owner 7 hold 1200 at most; a client of another owner
 * still gets its replies; each reply's bytes come back to its owner when taken. */
static void test_per_owner(void **state)
{
    struct fixture *f = *state;
    assert_int_equal(send_as(f, 0, 7, "A", 600), SKV_OK);
    assert_int_equal(send_as(f, 0, 7, "B", 600), SKV_OK); /* the owner's bound exactly */
    assert_int_equal(skv_replies_unread_bytes_of_owner(f->r, 7), PER_OWNER);
    assert_int_equal(send_as(f, 0, 7, "B", 1), SKV_E_BUSY);
    char want[64];
    snprintf(want, sizeof want, "max-reply-bytes-per-peer (%llu)", (unsigned long long)PER_OWNER);
    assert_non_null(strstr(skv_error_msg(), want));
    assert_int_equal(send_as(f, 0, 9, "B", 200), SKV_OK); /* another owner's client */
    assert_int_equal(skv_replies_unread_bytes_of_owner(f->r, 9), COST(200));
    assert_int_equal(take(f->a), 600);
    assert_int_equal(skv_replies_unread_bytes_of_owner(f->r, 7), COST(600));
    assert_int_equal(send_as(f, 0, 7, "A", 500), SKV_OK);
    while (take(f->a) >= 0 || take(f->b) >= 0)
        ;
    assert_int_equal(skv_replies_unread_bytes_of_owner(f->r, 7), 0);
    assert_int_equal(skv_replies_unread_bytes_of_owner(f->r, 9), 0);
    assert_int_equal(skv_replies_unread_bytes(f->r), 0);
    assert_int_equal(skv_replies_dropped(f->r), 1);
}

static void test_large_reply(void **state)
{
    struct fixture *f = *state;
    assert_int_equal(send_to(f, "A", 5000), SKV_OK); /* over the bound, but A holds nothing */
    assert_int_equal(held(f, "A"), COST(5000));
    assert_int_equal(send_to(f, "A", 1), SKV_E_BUSY);
    assert_int_equal(send_to(f, "B", 1), SKV_E_BUSY); /* the total too */
    assert_int_equal(take(f->a), 5000);
    assert_int_equal(skv_replies_unread_bytes(f->r), 0);
    assert_int_equal(send_to(f, "B", 1), SKV_OK);
}

static void test_unknown_and_gone(void **state)
{
    struct fixture *f = *state;
    assert_int_equal(send_to(f, "nobody", 300), SKV_E_IO);
    assert_int_equal(skv_replies_unread_bytes(f->r), 0);
    assert_int_equal(skv_replies_dropped(f->r), 0);
    assert_int_equal(send_to(f, "A", 300), SKV_OK);
    assert_int_equal(send_to(f, "A", 300), SKV_OK);
    assert_int_equal(held(f, "A"), 2 * COST(300));
    zmq_close(f->a);
    f->a = NULL;
    /* libzmq drops what was in the closed connection's pipe as it tears it down */
    for (int i = 0; i < 500 && skv_replies_unread_bytes(f->r); i++) {
        int events;
        size_t sz = sizeof events;
        zmq_getsockopt(f->router, ZMQ_EVENTS, &events, &sz); /* lets the router process the close */
        usleep(10000);
    }
    assert_int_equal(held(f, "A"), 0);
    assert_int_equal(skv_replies_unread_bytes(f->r), 0);
    assert_int_equal(send_to(f, "A", 300), SKV_E_IO);
    assert_int_equal(send_to(f, "B", 300), SKV_OK);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_per_client, setup, teardown),
        cmocka_unit_test_setup_teardown(test_overhead_counted, setup, teardown),
        cmocka_unit_test_setup_teardown(test_total, setup, teardown),
        cmocka_unit_test_setup_teardown(test_per_owner, setup, teardown),
        cmocka_unit_test_setup_teardown(test_large_reply, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unknown_and_gone, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
