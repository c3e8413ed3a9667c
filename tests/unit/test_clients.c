/* The client endpoint's connection table (daemon/clients.c): a client is gone when its fd's
 * connection closes (once), messages read after that are late, a reused fd belongs to the new
 * connection only, a missed DISCONNECTED is caught by the next ACCEPTED on the fd, one client's
 * disconnect leaves the others alone, and the table stays within its size. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "common/status.h"
#include "daemon/clients.h"

/* What gone() reported: the first byte of each routing id, in order. */
struct gone_log {
    uint8_t ids[16];
    int n;
};

static void on_gone(void *user, const uint8_t *identity, size_t identity_len)
{
    struct gone_log *g = user;
    assert_int_equal(identity_len, 5);
    assert_true(g->n < 16);
    g->ids[g->n++] = identity[0];
}

static const uint8_t X[5] = {'x', 1, 2, 3, 4}, Y[5] = {'y', 1, 2, 3, 4}, Z[5] = {'z', 1, 2, 3, 4};

static struct skv_clients_count count(const struct skv_clients *t)
{
    struct skv_clients_count c;
    skv_clients_count(t, &c);
    return c;
}

static void test_disconnect_and_late_messages(void **state)
{
    (void)state;
    struct skv_clients *t = NULL;
    assert_int_equal(skv_clients_new(16, &t), SKV_OK);
    struct gone_log g = {0};
    assert_int_equal(skv_clients_accepted(t, 20, 1, on_gone, &g), 0);
    assert_int_equal(skv_clients_seen(t, X, 5, 20, 1), SKV_CLIENT_LIVE);
    assert_int_equal(skv_clients_seen(t, X, 5, 20, 2), SKV_CLIENT_LIVE);
    assert_int_equal(skv_clients_disconnected(t, 20, 3, on_gone, &g), 1);
    assert_int_equal(g.n, 1);
    assert_int_equal(g.ids[0], 'x');
    /* what X sent before it closed is read afterwards: late, and X is not gone twice */
    assert_int_equal(skv_clients_seen(t, X, 5, 20, 4), SKV_CLIENT_LATE);
    assert_int_equal(skv_clients_disconnected(t, 20, 5, on_gone, &g), 0);
    assert_int_equal(g.n, 1);
    /* a client that sent one message and closed before it was read: late, counted once */
    assert_int_equal(skv_clients_accepted(t, 21, 6, on_gone, &g), 0);
    assert_int_equal(skv_clients_disconnected(t, 21, 7, on_gone, &g), 0);
    assert_int_equal(skv_clients_seen(t, Z, 5, 21, 8), SKV_CLIENT_LATE_FIRST);
    assert_int_equal(skv_clients_seen(t, Z, 5, 21, 9), SKV_CLIENT_LATE);
    struct skv_clients_count c = count(t);
    assert_int_equal(c.live, 0);
    assert_int_equal(c.gone, 2);
    assert_int_equal(c.closed_fds, 2);
    skv_clients_free(&t);
    assert_null(t);
    skv_clients_free(&t);
    skv_clients_free(NULL);
}

/* fd 20 closes and a new connection gets it: only the new client is there. */
static void test_reused_fd(void **state)
{
    (void)state;
    struct skv_clients *t = NULL;
    assert_int_equal(skv_clients_new(16, &t), SKV_OK);
    struct gone_log g = {0};
    assert_int_equal(skv_clients_seen(t, X, 5, 20, 1), SKV_CLIENT_LIVE);
    assert_int_equal(skv_clients_disconnected(t, 20, 2, on_gone, &g), 1);
    assert_int_equal(skv_clients_accepted(t, 20, 3, on_gone, &g), 0);
    assert_int_equal(skv_clients_seen(t, Y, 5, 20, 4), SKV_CLIENT_LIVE);
    assert_int_equal(skv_clients_disconnected(t, 20, 5, on_gone, &g), 1);
    assert_int_equal(g.n, 2);
    assert_memory_equal(g.ids, "xy", 2);
    /* a DISCONNECTED that never came: the next connection on the fd ends the old one */
    assert_int_equal(skv_clients_accepted(t, 22, 6, on_gone, &g), 0);
    assert_int_equal(skv_clients_seen(t, Z, 5, 22, 7), SKV_CLIENT_LIVE);
    assert_int_equal(skv_clients_accepted(t, 22, 8, on_gone, &g), 1);
    assert_int_equal(g.ids[2], 'z');
    /* a routing id back on another connection is live there */
    assert_int_equal(skv_clients_seen(t, X, 5, 23, 9), SKV_CLIENT_LIVE);
    assert_int_equal(skv_clients_disconnected(t, 23, 10, on_gone, &g), 1);
    assert_int_equal(g.n, 4);
    assert_int_equal(g.ids[3], 'x');
    skv_clients_free(&t);
}

/* Two clients: one closing leaves the other live, and each goes once, with its own fd. */
static void test_clients_apart(void **state)
{
    (void)state;
    struct skv_clients *t = NULL;
    assert_int_equal(skv_clients_new(16, &t), SKV_OK);
    struct gone_log g = {0};
    assert_int_equal(skv_clients_seen(t, X, 5, 30, 1), SKV_CLIENT_LIVE);
    assert_int_equal(skv_clients_seen(t, Y, 5, 31, 1), SKV_CLIENT_LIVE);
    assert_int_equal(skv_clients_disconnected(t, 30, 2, on_gone, &g), 1);
    assert_int_equal(skv_clients_seen(t, Y, 5, 31, 3), SKV_CLIENT_LIVE);
    assert_int_equal(count(t).live, 1);
    assert_int_equal(skv_clients_disconnected(t, 31, 4, on_gone, &g), 1);
    assert_int_equal(g.n, 2);
    assert_memory_equal(g.ids, "xy", 2);
    skv_clients_free(&t);
}

/* The table keeps its size: the least recently active client is forgotten; gone clients and
 * closed fds are forgotten after SKV_CLIENTS_GONE_KEEP_MS. */
/* A full table forgets a gone client before an idle live one (whose time is older): the live
 * one's disconnect is still noticed (it was forgotten first before, and its decodes ran on). */
static void test_full_forgets_gone_first(void **state)
{
    (void)state;
    struct skv_clients *t = NULL;
    assert_int_equal(skv_clients_new(2, &t), SKV_OK);
    struct gone_log g = {0};
    assert_int_equal(skv_clients_seen(t, X, 5, 40, 1), SKV_CLIENT_LIVE); /* idle from here */
    assert_int_equal(skv_clients_seen(t, Y, 5, 41, 2), SKV_CLIENT_LIVE);
    assert_int_equal(skv_clients_disconnected(t, 41, 5, on_gone, &g), 1); /* Y gone at 5 */
    assert_int_equal(skv_clients_seen(t, Z, 5, 42, 6), SKV_CLIENT_LIVE);    /* full: Y goes */
    assert_int_equal(skv_clients_disconnected(t, 40, 7, on_gone, &g), 1);
    assert_int_equal(g.n, 2);
    assert_int_equal(g.ids[1], 'x');
    skv_clients_free(&t);
}

static void test_bounds(void **state)
{
    (void)state;
    struct skv_clients *t = NULL;
    assert_int_equal(skv_clients_new(0, &t), SKV_E_INVAL);
    assert_int_equal(skv_clients_new(2, &t), SKV_OK);
    struct gone_log g = {0};
    assert_int_equal(skv_clients_seen(t, X, 5, 40, 1), SKV_CLIENT_LIVE);
    assert_int_equal(skv_clients_seen(t, Y, 5, 41, 2), SKV_CLIENT_LIVE);
    assert_int_equal(skv_clients_seen(t, X, 5, 40, 3), SKV_CLIENT_LIVE); /* Y is now the oldest */
    assert_int_equal(skv_clients_seen(t, Z, 5, 42, 4), SKV_CLIENT_LIVE);
    assert_int_equal(count(t).live, 2);
    assert_int_equal(skv_clients_disconnected(t, 41, 5, on_gone, &g), 0); /* Y was forgotten */
    assert_int_equal(skv_clients_disconnected(t, 40, 6, on_gone, &g), 1);
    assert_int_equal(g.ids[0], 'x');
    /* a routing id longer than ZeroMQ's 255 bytes is not recorded */
    uint8_t long_id[256] = {'l'};
    assert_int_equal(skv_clients_seen(t, long_id, sizeof long_id, 43, 7), SKV_CLIENT_LIVE);
    assert_int_equal(count(t).live, 1);
    /* closed fds too stay within the size */
    for (int fd = 50; fd < 60; fd++)
        skv_clients_disconnected(t, fd, 8, on_gone, &g);
    assert_int_equal(count(t).closed_fds, 2);
    skv_clients_expire(t, 6 + SKV_CLIENTS_GONE_KEEP_MS);
    struct skv_clients_count c = count(t);
    assert_int_equal(c.gone, 1);
    assert_int_equal(c.closed_fds, 2);
    skv_clients_expire(t, 9 + SKV_CLIENTS_GONE_KEEP_MS);
    c = count(t);
    assert_int_equal(c.live, 1);
    assert_int_equal(c.gone, 0);
    assert_int_equal(c.closed_fds, 0);
    /* X's late message after it was forgotten: only a live client now */
    assert_int_equal(skv_clients_seen(t, X, 5, 40, 10), SKV_CLIENT_LIVE);
    skv_clients_free(&t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_disconnect_and_late_messages),
        cmocka_unit_test(test_reused_fd),
        cmocka_unit_test(test_clients_apart),
        cmocka_unit_test(test_bounds),
        cmocka_unit_test(test_full_forgets_gone_first),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
