/* common/utf8: which bytes are well-formed UTF-8 (Unicode 15, table 3-7), and the U+FFFD
 * replacement Rust's from_utf8_lossy (Hugging Face's decode) makes: one for each maximal
 * ill-formed part, the cases of Unicode's "U+FFFD substitution of maximal subparts" table. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "common/utf8.h"

#define R "\xEF\xBF\xBD"

static void expect_fixed(const char *in, size_t n, const char *want)
{
    size_t len = 0;
    char *got = skv_utf8_fix(in, n, &len);
    assert_non_null(got);
    assert_int_equal(len, strlen(want));
    assert_string_equal(got, want);
    free(got);
}

static void test_char(void **state)
{
    (void)state;
    bool partial;
    size_t bad;
    assert_int_equal(skv_utf8_char((const unsigned char *)"a", 1, &partial, &bad), 1);
    assert_int_equal(skv_utf8_char((const unsigned char *)"\xC3\xA9", 2, &partial, &bad), 2);
    assert_int_equal(skv_utf8_char((const unsigned char *)"\xE6\x9D\xB1", 3, &partial, &bad), 3);
    assert_int_equal(skv_utf8_char((const unsigned char *)"\xF0\x9F\x98\x80", 4, &partial, &bad), 4);
    assert_int_equal(skv_utf8_char((const unsigned char *)"\xE6\x9D", 2, &partial, &bad), 0);
    assert_true(partial); /* a valid start cut by the end of what is there */
    assert_int_equal(skv_utf8_char((const unsigned char *)"\xE6\x9D" "a", 3, &partial, &bad), 0);
    assert_false(partial);
    assert_int_equal(bad, 2);
    const char *one_bad[] = {"\x80", "\xC0\xAF", "\xC1\xBF", "\xE0\x80\x80", "\xED\xA0\x80", "\xF4\x90\x80\x80",
                             "\xF5\x80\x80\x80", "\xFF"};
    for (size_t i = 0; i < sizeof one_bad / sizeof one_bad[0]; i++) {
        assert_int_equal(skv_utf8_char((const unsigned char *)one_bad[i], strlen(one_bad[i]), &partial, &bad), 0);
        assert_false(partial);
        assert_int_equal(bad, 1); /* overlong, surrogate and out-of-range forms end at their first byte */
    }
}

static void test_fix(void **state)
{
    (void)state;
    expect_fixed("plain", 5, "plain");
    expect_fixed("\xE6\x9D\xB1\xE4\xBA\xAC", 6, "\xE6\x9D\xB1\xE4\xBA\xAC");
    /* Unicode's table: 61 F1 80 80 E1 80 C2 62 80 63 80 BF 64 -> a R R R b R c R R d */
    expect_fixed("\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64", 13, "a" R R R "b" R "c" R R "d");
    /* surrogates and overlongs: one each byte */
    expect_fixed("\xED\xA0\x80", 3, R R R);
    expect_fixed("\xC0\xAF", 2, R R);
    /* a character cut at the end: one */
    expect_fixed("ab\xF0\x9F\x98", 5, "ab" R);
    /* NUL would cut a C string: replaced */
    expect_fixed("a\0b", 3, "a" R "b");
    expect_fixed("", 0, "");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_char),
        cmocka_unit_test(test_fix),
    };
    return cmocka_run_group_tests_name("utf8", tests, NULL, NULL);
}
