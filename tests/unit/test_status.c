/* Status codes: names, texts, the thread-local detail message, and that the public client
 * codes equal the daemon's. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "common/status.h"
#include "libclient/snapkv.h"

static void test_names(void **state)
{
    (void)state;
    assert_string_equal(skv_status_str(SKV_OK), "ok");
    assert_string_equal(skv_status_name(SKV_E_POOL_FULL), "SKV_E_POOL_FULL");
    assert_string_equal(skv_status_str(SKV_E_INVAL), "invalid argument");
    assert_string_equal(skv_status_str(12345), "unknown status");
    for (int s = SKV_STATUS_MIN; s <= 0; s++) {
        assert_non_null(skv_status_str(s));
        assert_string_not_equal(skv_status_str(s), "unknown status");
    }
}

static void test_error_message(void **state)
{
    (void)state;
    skv_error_clear();
    assert_string_equal(skv_error_msg(), "");
    int rc = skv_errorf(SKV_E_FORMAT, "tensor %s at %d", "blk.0", 42);
    assert_int_equal(rc, SKV_E_FORMAT);
    assert_string_equal(skv_error_msg(), "tensor blk.0 at 42");
    char big[2000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    skv_errorf(SKV_E_IO, "%s", big); /* truncated, never overflows */
    assert_true(strlen(skv_error_msg()) < sizeof big);
}

/* The message goes out in replies' UTF-8 `string` fields: a name that is not UTF-8 shows '?' per
 * ill-formed byte; a character cut by %.Ns or by the buffer's end is dropped. */
static void test_error_message_is_text(void **state)
{
    (void)state;
    skv_errorf(SKV_E_INVAL, "tenant '%s'", "a\xff\xfe" "b\xed\xa0\x80" "c");
    assert_string_equal(skv_error_msg(), "tenant 'a??b???c'");
    skv_errorf(SKV_E_INVAL, "name '%.3s'", "ab\xc3\xa9"); /* é cut after its first byte */
    assert_string_equal(skv_error_msg(), "name 'ab?'");
    skv_errorf(SKV_E_INVAL, "%.3s", "ab\xc3\xa9"); /* ... at the end: dropped */
    assert_string_equal(skv_error_msg(), "ab");
    skv_errorf(SKV_E_INVAL, "caf\xc3\xa9 \xe2\x82\xac"); /* well-formed: kept */
    assert_string_equal(skv_error_msg(), "caf\xc3\xa9 \xe2\x82\xac");
    char big[2000] = "";
    for (size_t n = 0; n + 3 < sizeof big; n += 3)
        strcat(big, "\xe2\x82\xac"); /* the buffer's end falls inside a character or not */
    for (int pad = 0; pad < 3; pad++) {
        skv_errorf(SKV_E_IO, "%.*s%s", pad, "xx", big);
        size_t n = strlen(skv_error_msg());
        assert_int_equal((n - (size_t)pad) % 3, 0);
        assert_true(n + 3 >= 511);
    }
}

static void test_client_codes_match(void **state)
{
    (void)state;
    assert_int_equal(SNAPKV_OK, SKV_OK);
    assert_int_equal(SNAPKV_E_NOMEM, SKV_E_NOMEM);
    assert_int_equal(SNAPKV_E_INVAL, SKV_E_INVAL);
    assert_int_equal(SNAPKV_E_DEVICE, SKV_E_DEVICE);
    assert_int_equal(SNAPKV_E_BUSY, SKV_E_BUSY);
    assert_int_equal(SNAPKV_E_PROTO, SKV_E_PROTO);
    assert_int_equal(SNAPKV_E_IO, SKV_E_IO);
    assert_int_equal(SNAPKV_E_POOL_FULL, SKV_E_POOL_FULL);
    assert_int_equal(SNAPKV_E_NOT_FOUND, SKV_E_NOT_FOUND);
    assert_int_equal(SNAPKV_E_UNSUPPORTED, SKV_E_UNSUPPORTED);
    assert_int_equal(SNAPKV_E_FORMAT, SKV_E_FORMAT);
    assert_int_equal(SNAPKV_E_LIMIT, SKV_E_LIMIT);
    assert_int_equal(SNAPKV_E_PERM, SKV_E_PERM);
    assert_int_equal(SNAPKV_E_VERSION, SKV_E_VERSION);
    assert_int_equal(SNAPKV_E_CANCELLED, SKV_E_CANCELLED);
    assert_int_equal(SNAPKV_E_TIMEOUT, SKV_E_TIMEOUT);
    assert_int_equal(SNAPKV_E_EXISTS, SKV_E_EXISTS);
    assert_int_equal(SNAPKV_E_INTERNAL, SKV_E_INTERNAL);
    assert_int_equal(SNAPKV_E_UNAVAILABLE, SKV_E_UNAVAILABLE);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_error_message),
        cmocka_unit_test(test_error_message_is_text),
        cmocka_unit_test(test_client_codes_match),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
