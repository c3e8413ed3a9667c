/* Request strings checked on the wire (daemon/proto_text.c), on requests packed by protobuf-c
 * and then patched, since protobuf-c itself cannot pack a NUL inside a string:
 * - text in every script passes, and so do bytes fields, packed numbers and unknown fields
 *   holding any bytes;
 * - a NUL, ill-formed UTF-8 (a stray byte, a surrogate, an overlong form) and a character cut at
 *   the end are refused with SKV_E_INVAL, naming the field's path and the byte;
 * - a repeated string's second element and a field three messages deep are found;
 * - bytes that are not a message are SKV_E_PROTO. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "daemon/proto_text.h"
#include "proto/snapkv.pb-c.h"

/* A PREFILL of `text` for `tenant`, packed into buf; its length. */
static size_t pack_prefill(const char *tenant, const char *text, uint8_t *buf)
{
    Snapkv__CompressSpec spec = SNAPKV__COMPRESS_SPEC__INIT;
    spec.spec = "policy=snapkv,ratio=0.1";
    Snapkv__PrefillRequest p = SNAPKV__PREFILL_REQUEST__INIT;
    p.text = (char *)text;
    p.compress = &spec;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.version = 1;
    req.request_id = 7;
    req.tenant = (char *)tenant;
    req.command_case = SNAPKV__REQUEST__COMMAND_PREFILL;
    req.prefill = &p;
    assert_true(snapkv__request__get_packed_size(&req) < 4096);
    return snapkv__request__pack(&req, buf);
}

/* Overwrites the packed `marker` (found once) with `with`, as many bytes. */
static void patch(uint8_t *buf, size_t len, const char *marker, const char *with, size_t n)
{
    assert_int_equal(strlen(marker), n);
    uint8_t *at = memmem(buf, len, marker, n);
    assert_non_null(at);
    assert_null(memmem(at + 1, len - (size_t)(at + 1 - buf), marker, n));
    memcpy(at, with, n);
}

static int check(const uint8_t *buf, size_t len)
{
    skv_error_clear();
    return skv_proto_text_check(&snapkv__request__descriptor, buf, len);
}

static void expect_refused(const uint8_t *buf, size_t len, const char *message)
{
    assert_int_equal(check(buf, len), SKV_E_INVAL);
    if (!strstr(skv_error_msg(), message))
        fail_msg("message \"%s\" lacks \"%s\"", skv_error_msg(), message);
}

static void test_text_passes(void **state)
{
    (void)state;
    uint8_t buf[4096];
    /* Latin, Greek, CJK, an emoji (4 bytes), U+FFFD, U+10FFFF */
    size_t len = pack_prefill("tenant-é", "héllo κόσμε 世界 \xf0\x9f\x98\x80 \xef\xbf\xbd \xf4\x8f\xbf\xbf", buf);
    assert_int_equal(check(buf, len), SKV_OK);
    len = pack_prefill("", "", buf); /* empty strings are not packed at all */
    assert_int_equal(check(buf, len), SKV_OK);
    assert_int_equal(check(buf, 0), SKV_OK); /* an empty message */

    /* a bytes field holding NUL and 0xff, and packed tokens holding them too */
    uint8_t id[16] = {0x00, 0xff, 0xc0, 0x80, 0xed, 0xa0, 0x80};
    uint32_t tokens[3] = {0, 255, 0xffffffffu};
    Snapkv__AppendRequest a = SNAPKV__APPEND_REQUEST__INIT;
    a.session_id = (ProtobufCBinaryData){sizeof id, id};
    a.tokens = tokens;
    a.n_tokens = 3;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.version = 1;
    req.command_case = SNAPKV__REQUEST__COMMAND_APPEND;
    req.append = &a;
    len = snapkv__request__pack(&req, buf);
    /* and an unknown field 1000, length-delimited, of bytes that are not text */
    buf[len++] = 0xc2; /* key (1000 << 3 | 2) as a varint: 0xc2 0x3e */
    buf[len++] = 0x3e;
    buf[len++] = 3;
    buf[len++] = 0x00;
    buf[len++] = 0xff;
    buf[len++] = 0xfe;
    assert_int_equal(check(buf, len), SKV_OK);
    Snapkv__Request *back = snapkv__request__unpack(NULL, len, buf); /* protobuf-c agrees it is a request */
    assert_non_null(back);
    snapkv__request__free_unpacked(back, NULL);
}

static void test_nul_refused(void **state)
{
    (void)state;
    uint8_t buf[4096];
    size_t len = pack_prefill("t", "hello world", buf);
    patch(buf, len, "o w", "o\0w", 3);
    expect_refused(buf, len, "request field prefill.text is not text: a NUL at byte 5");
    /* what protobuf-c alone made of it: the text cut at the NUL, without a word */
    Snapkv__Request *req = snapkv__request__unpack(NULL, len, buf);
    assert_non_null(req);
    assert_string_equal(req->prefill->text, "hello");
    snapkv__request__free_unpacked(req, NULL);

    len = pack_prefill("t", "hello world", buf);
    patch(buf, len, "policy=snapkv", "policy=snap\0v", 13); /* three messages deep */
    expect_refused(buf, len, "request field prefill.compress.spec is not text: a NUL at byte 11");
}

static void test_ill_formed_refused(void **state)
{
    (void)state;
    uint8_t buf[4096];
    size_t len = pack_prefill("tenantX", "hello", buf);
    patch(buf, len, "tenantX", "tenant\xff", 7);
    expect_refused(buf, len, "request field tenant is not text: ill-formed UTF-8 at byte 6");
    len = pack_prefill("t", "a surrogate: XYZ.", buf);
    patch(buf, len, "XYZ", "\xed\xa0\x80", 3); /* U+D800 */
    expect_refused(buf, len, "prefill.text is not text: ill-formed UTF-8 at byte 13");
    len = pack_prefill("t", "overlong XY", buf);
    patch(buf, len, "XY", "\xc0\xaf", 2); /* '/' in two bytes */
    expect_refused(buf, len, "ill-formed UTF-8 at byte 9");
    len = pack_prefill("t", "cut at the end XY", buf);
    patch(buf, len, "XY", "\xe2\x82", 2); /* the first two bytes of U+20AC */
    expect_refused(buf, len, "prefill.text is not text: a character cut at the end at byte 15");
    /* the error message itself stays text: the field path is the schema's */
    assert_non_null(strstr(skv_error_msg(), "strings are UTF-8 without NUL"));

    /* a repeated string: the second stop sequence */
    char *stops[2] = {"fine", "bad:XY"};
    Snapkv__Sampling s = SNAPKV__SAMPLING__INIT;
    s.stop = stops;
    s.n_stop = 2;
    s.max_tokens = 4;
    Snapkv__DecodeRequest d = SNAPKV__DECODE_REQUEST__INIT;
    d.sampling = &s;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    req.version = 1;
    req.command_case = SNAPKV__REQUEST__COMMAND_DECODE;
    req.decode = &d;
    len = snapkv__request__pack(&req, buf);
    assert_int_equal(check(buf, len), SKV_OK);
    patch(buf, len, "XY", "\x80\x80", 2);
    expect_refused(buf, len, "request field decode.sampling.stop is not text: ill-formed UTF-8 at byte 4");
}

static void test_not_a_message(void **state)
{
    (void)state;
    uint8_t buf[4096];
    size_t len = pack_prefill("t", "hello world", buf);
    for (size_t cut = 1; cut < len; cut++) { /* every shorter prefix: OK or PROTO, never a read past */
        int rc = check(buf, cut);
        assert_true(rc == SKV_OK || rc == SKV_E_PROTO);
    }
    assert_int_equal(check(buf, len - 1), SKV_E_PROTO); /* the prefill runs past the end */
    const uint8_t group[] = {0x0b, 0x0c}; /* wire types 3 and 4: groups, which proto3 has not */
    assert_int_equal(check(group, sizeof group), SKV_E_PROTO);
    const uint8_t varint[] = {0x10, 0xff, 0xff}; /* a varint with no last byte */
    assert_int_equal(check(varint, sizeof varint), SKV_E_PROTO);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_text_passes),
        cmocka_unit_test(test_nul_refused),
        cmocka_unit_test(test_ill_formed_refused),
        cmocka_unit_test(test_not_a_message),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
