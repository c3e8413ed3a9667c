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

#include "common/log.h"
#include "common/utf8.h"

#include <stdio.h>
#include <unistd.h>

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

/* skv_log_allow: the first line goes, the next ones within 10 s are held and counted, the first
 * after the window goes with their count; each limit on its own. */
static void test_log_limit(void **state)
{
    (void)state;
    struct skv_log_limit a = {0}, b = {0};
    unsigned long long more = 99;
    assert_true(skv_log_allow(&a, 5000, &more));
    assert_int_equal(more, 0);
    more = 99;
    for (int i = 1; i <= 3; i++)
        assert_false(skv_log_allow(&a, 5000 + 3000 * (unsigned long long)i, &more));
    assert_int_equal(more, 99); /* not touched while held */
    assert_true(skv_log_allow(&b, 6000, &more)); /* another limit */
    assert_int_equal(more, 0);
    assert_false(skv_log_allow(&a, 14999, &more));
    assert_true(skv_log_allow(&a, 15000, &more));
    assert_int_equal(more, 4);
    assert_false(skv_log_allow(&a, 15001, &more));
    assert_true(skv_log_allow(&a, 25000, &more));
    assert_int_equal(more, 1);
}

/* The log's lines are text: bytes that are not UTF-8, C0 and C1 controls become '?', and a
 * character the 1024-byte message cuts is dropped, not left half (journald keeps a line that
 * is not UTF-8 as "[blob data]"). Well-formed characters stay. */
static void test_log_lines(void **state)
{
    (void)state;
    char path[] = "/tmp/skv-log-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(skv_log_open(path), 0);
    skv_log(SKV_LOG_ERROR, "name '%s'", "a\xff" "b\xc3\xa9\x01\xc2\x85" "c\xe2\x82");
    char longer[1100];
    memset(longer, 'x', sizeof longer);
    for (int i = 1000; i + 3 <= 1090; i += 3)
        memcpy(longer + i, "\xe2\x82\xac", 3); /* the euro sign, cut somewhere past 1023 bytes */
    longer[1090] = '\0';
    skv_log(SKV_LOG_ERROR, "%s", longer);
    assert_int_equal(skv_log_open(NULL), 0);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char line[2048];
    int lines = 0;
    while (fgets(line, sizeof line, f)) {
        size_t n = strlen(line);
        assert_true(n > 0 && line[n - 1] == '\n');
        for (size_t i = 0; i < n - 1;) {
            bool partial = false;
            size_t bad = 0, k = skv_utf8_char((const unsigned char *)line + i, n - 1 - i, &partial, &bad);
            assert_true(k > 0);
            assert_true((unsigned char)line[i] >= 0x20);
            i += k;
        }
        if (lines == 0)
            assert_non_null(strstr(line, "name 'a?b\xc3\xa9?" "?" "?c?" "?'")); /* (no trigraphs) */
        lines++;
    }
    assert_int_equal(lines, 2);
    fclose(f);
    unlink(path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_char),
        cmocka_unit_test(test_fix),
        cmocka_unit_test(test_log_lines),
        cmocka_unit_test(test_log_limit),
    };
    return cmocka_run_group_tests_name("utf8", tests, NULL, NULL);
}
