/* The KV events replay's mirror (daemon/events_replay.c) against a plain list, through a real
 * ROUTER and DEALER on inproc:
 * - 3000 random stored / removed events (ids reused, so entries are replaced and removed from
 *   the middle of probe runs) and two AllCleared: after each phase the mirror holds exactly the
 *   sessions the list holds, each as its last stored event said;
 * - the snapshot: parts of at most 64 events, numbered, the last one final, part 0 led by
 *   AllCleared, every part under the sequence it was asked at;
 * - an empty mirror's snapshot is one part, AllCleared alone, and one that fills its last part
 *   exactly ends there;
 * - a request that is not one, or of another version, gets a status and a message. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/status.h"
#include "daemon/events_replay.h"
#include "proto/snapkv.pb-c.h"

#define ENDPOINT "inproc://test-events-replay"
#define N_IDS 700

struct fixture {
    void *ctx, *router, *dealer;
    struct skv_events_mirror *m;
    uint8_t ids[N_IDS][16];
    int64_t tokens[N_IDS]; /* the last stored n_tokens, -1: not held */
};

static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof *f);
    if (!f)
        return -1;
    *state = f;
    int linger = 0, mandatory = 1;
    f->ctx = zmq_ctx_new();
    f->router = zmq_socket(f->ctx, ZMQ_ROUTER);
    f->dealer = zmq_socket(f->ctx, ZMQ_DEALER);
    zmq_setsockopt(f->router, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(f->router, ZMQ_ROUTER_MANDATORY, &mandatory, sizeof mandatory);
    zmq_setsockopt(f->dealer, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_bind(f->router, ENDPOINT) || zmq_connect(f->dealer, ENDPOINT))
        return -1;
    srand(7);
    for (int i = 0; i < N_IDS; i++) {
        for (int k = 0; k < 16; k++)
            f->ids[i][k] = (uint8_t)rand();
        f->ids[i][0] = (uint8_t)(i & 7); /* many ids whose first bytes collide a little */
        f->tokens[i] = -1;
    }
    return skv_events_mirror_new(&f->m) ? -1 : 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    skv_events_mirror_free(&f->m);
    skv_events_mirror_free(&f->m); /* NULL-safe */
    zmq_close(f->dealer);
    zmq_close(f->router);
    zmq_ctx_term(f->ctx);
    free(f);
    return 0;
}

/* Publishes one event (a batch of one, as the worker sends them) into the mirror. */
static void publish(struct fixture *f, int kind, int i, uint32_t n_tokens)
{
    Snapkv__SessionStored st = SNAPKV__SESSION_STORED__INIT;
    Snapkv__SessionRemoved rm = SNAPKV__SESSION_REMOVED__INIT;
    Snapkv__AllCleared cl = SNAPKV__ALL_CLEARED__INIT;
    uint64_t hashes[3] = {n_tokens, 2, 3};
    Snapkv__KvEvent ev = SNAPKV__KV_EVENT__INIT, *evp = &ev;
    ev.kind_case = kind;
    if (kind == SNAPKV__KV_EVENT__KIND_STORED) {
        st.session_id = (ProtobufCBinaryData){16, f->ids[i]};
        st.tenant = "t";
        st.n_tokens = n_tokens;
        st.block_size = 16;
        st.n_block_hashes = 3;
        st.block_hashes = hashes;
        ev.stored = &st;
    } else if (kind == SNAPKV__KV_EVENT__KIND_REMOVED) {
        rm.session_id = (ProtobufCBinaryData){16, f->ids[i]};
        rm.tenant = "t";
        ev.removed = &rm;
    } else {
        ev.cleared = &cl;
    }
    Snapkv__KvEventBatch b = SNAPKV__KV_EVENT_BATCH__INIT;
    b.version = 1;
    b.n_events = 1;
    b.events = &evp;
    uint8_t buf[512];
    size_t len = snapkv__kv_event_batch__pack(&b, buf);
    skv_events_mirror_apply(f->m, buf, len);
}

/* Sends a request body and serves it; returns the parts, *n of them (each checked for its
 * frames and sequence). */
static Snapkv__KvReplayReply **ask(struct fixture *f, const void *req, size_t len, uint64_t seq, size_t *n)
{
    assert_int_equal(zmq_send(f->dealer, req, len, 0), (int)len);
    bool served = false;
    for (int i = 0; i < 100 && !served; i++) { /* inproc: the request is in the pipe at once, or nearly */
        served = skv_events_mirror_serve(f->m, f->router, seq, 77);
        if (!served)
            zmq_poll(&(zmq_pollitem_t){f->router, 0, ZMQ_POLLIN, 0}, 1, 10);
    }
    assert_true(served);
    assert_false(skv_events_mirror_serve(f->m, f->router, seq, 77)); /* nothing more waits */
    Snapkv__KvReplayReply **parts = NULL;
    *n = 0;
    for (bool final = false; !final;) {
        uint8_t be[8];
        zmq_msg_t body;
        zmq_msg_init(&body);
        assert_int_equal(zmq_recv(f->dealer, be, sizeof be, 0), 8);
        uint64_t s = 0;
        for (int k = 0; k < 8; k++)
            s = s << 8 | be[k];
        assert_int_equal(s, seq);
        assert_true(zmq_msg_recv(&body, f->dealer, 0) >= 0);
        assert_false(zmq_msg_more(&body));
        Snapkv__KvReplayReply *p = snapkv__kv_replay_reply__unpack(NULL, zmq_msg_size(&body), zmq_msg_data(&body));
        zmq_msg_close(&body);
        assert_non_null(p);
        parts = realloc(parts, (*n + 1) * sizeof *parts);
        assert_non_null(parts);
        parts[(*n)++] = p;
        final = p->final;
    }
    return parts;
}

static void parts_free(Snapkv__KvReplayReply **parts, size_t n)
{
    for (size_t i = 0; i < n; i++)
        snapkv__kv_replay_reply__free_unpacked(parts[i], NULL);
    free(parts);
}

/* The mirror's snapshot equals the list. */
static void expect_mirror(struct fixture *f, uint64_t seq)
{
    size_t want = 0;
    for (int i = 0; i < N_IDS; i++)
        want += f->tokens[i] >= 0;
    assert_int_equal(skv_events_mirror_count(f->m), want);
    Snapkv__KvReplayRequest rq = SNAPKV__KV_REPLAY_REQUEST__INIT;
    rq.version = 1;
    uint8_t buf[16];
    size_t n_parts;
    Snapkv__KvReplayReply **parts = ask(f, buf, snapkv__kv_replay_request__pack(&rq, buf), seq, &n_parts);
    assert_int_equal(n_parts, (want + 1 + SKV_REPLAY_PART_EVENTS - 1) / SKV_REPLAY_PART_EVENTS);
    bool *seen = calloc(N_IDS, sizeof *seen);
    assert_non_null(seen);
    size_t got = 0;
    for (size_t p = 0; p < n_parts; p++) {
        const Snapkv__KvReplayReply *r = parts[p];
        assert_int_equal(r->status, 0);
        assert_int_equal(r->part, p);
        assert_int_equal(r->final, p + 1 == n_parts);
        assert_non_null(r->batch);
        assert_true(r->batch->n_events >= 1 && r->batch->n_events <= SKV_REPLAY_PART_EVENTS);
        assert_int_equal(r->batch->boot_id, 77);
        for (size_t k = 0; k < r->batch->n_events; k++) {
            const Snapkv__KvEvent *e = r->batch->events[k];
            if (p == 0 && k == 0) {
                assert_int_equal(e->kind_case, SNAPKV__KV_EVENT__KIND_CLEARED);
                continue;
            }
            assert_int_equal(e->kind_case, SNAPKV__KV_EVENT__KIND_STORED);
            assert_int_equal(e->stored->session_id.len, 16);
            int i = 0;
            while (i < N_IDS && memcmp(f->ids[i], e->stored->session_id.data, 16) != 0)
                i++;
            assert_true(i < N_IDS);
            assert_false(seen[i]);
            seen[i] = true;
            assert_int_equal(e->stored->n_tokens, f->tokens[i]);
            assert_int_equal(e->stored->n_block_hashes, 3);
            assert_int_equal(e->stored->block_hashes[0], f->tokens[i]);
            got++;
        }
    }
    assert_int_equal(got, want);
    free(seen);
    parts_free(parts, n_parts);
}

static void test_mirror(void **state)
{
    struct fixture *f = *state;
    expect_mirror(f, 0); /* empty: AllCleared alone */
    uint64_t seq = 0;
    for (int phase = 0; phase < 3; phase++) {
        for (int op = 0; op < 1000; op++) {
            int i = rand() % N_IDS;
            seq++;
            if (rand() % 3) {
                publish(f, SNAPKV__KV_EVENT__KIND_STORED, i, (uint32_t)(seq % 100000));
                f->tokens[i] = (int64_t)(seq % 100000);
            } else {
                publish(f, SNAPKV__KV_EVENT__KIND_REMOVED, i, 0);
                f->tokens[i] = -1;
            }
        }
        expect_mirror(f, seq);
        if (phase < 2) {
            publish(f, SNAPKV__KV_EVENT__KIND_CLEARED, 0, 0);
            for (int i = 0; i < N_IDS; i++)
                f->tokens[i] = -1;
            expect_mirror(f, ++seq);
        }
    }
    skv_events_mirror_apply(f->m, "\xff\xff", 2); /* a batch that does not decode: logged, nothing changes */
    expect_mirror(f, seq);
}

/* Snapshots that fill their last part exactly (63 sessions and AllCleared: one part; 127: two)
 * end there, with no empty part after; 64 take two parts. */
static void test_part_edges(void **state)
{
    struct fixture *f = *state;
    const int counts[] = {63, 127, 64, 1};
    uint64_t seq = 0;
    for (size_t c = 0; c < sizeof counts / sizeof *counts; c++) {
        publish(f, SNAPKV__KV_EVENT__KIND_CLEARED, 0, 0);
        for (int i = 0; i < N_IDS; i++)
            f->tokens[i] = -1;
        for (int i = 0; i < counts[c]; i++) {
            int at = (int)((size_t)i * 7 % N_IDS); /* spread over the table */
            publish(f, SNAPKV__KV_EVENT__KIND_STORED, at, (uint32_t)(i + 1));
            f->tokens[at] = i + 1;
        }
        expect_mirror(f, ++seq);
    }
}

static void test_refused(void **state)
{
    struct fixture *f = *state;
    size_t n;
    Snapkv__KvReplayReply **parts = ask(f, "\xff\xff\xff", 3, 5, &n);
    assert_int_equal(n, 1);
    assert_int_equal(parts[0]->status, SKV_E_PROTO);
    assert_non_null(strstr(parts[0]->message, "KvReplayRequest"));
    assert_null(parts[0]->batch);
    parts_free(parts, n);
    Snapkv__KvReplayRequest rq = SNAPKV__KV_REPLAY_REQUEST__INIT;
    rq.version = 9;
    uint8_t buf[16];
    parts = ask(f, buf, snapkv__kv_replay_request__pack(&rq, buf), 5, &n);
    assert_int_equal(n, 1);
    assert_int_equal(parts[0]->status, SKV_E_VERSION);
    parts_free(parts, n);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_mirror, setup, teardown),
        cmocka_unit_test_setup_teardown(test_part_edges, setup, teardown),
        cmocka_unit_test_setup_teardown(test_refused, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
