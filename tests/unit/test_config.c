/* The option table: defaults, parsing of sizes / integers / booleans, range checks, the
 * config file reader with its error positions, and CONFIG GET formatting. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/status.h"
#include "daemon/config.h"

static void test_defaults(void **state)
{
    (void)state;
    struct skv_config cfg;
    assert_int_equal(skv_config_init(&cfg), SKV_OK);
    assert_string_equal(cfg.backend, "auto");
    assert_int_equal(cfg.pool_size, INT64_C(1) << 30);
    assert_int_equal(cfg.max_prompt_tokens, 8192);
    assert_int_equal(cfg.max_lease_seconds, 86400);
    assert_int_equal(cfg.max_decodes, 256);
    assert_int_equal(cfg.max_decodes_per_tenant, 32);
    assert_int_equal(skv_config_check(&cfg), SKV_OK);
    assert_true(cfg.foreground);
    assert_true(cfg.prefix_reuse);
    assert_int_equal(cfg.prefix_retain_bytes, 0);
    /* production-sane network defaults: tcp:// needs CURVE, no HTTP metrics */
    assert_false(cfg.allow_insecure_tcp);
    assert_string_equal(cfg.curve_secret_key, "");
    assert_string_equal(cfg.metrics_listen, "");
    assert_int_equal(cfg.health_stall_seconds, 60);
    assert_int_equal(strncmp(cfg.endpoint, "ipc://", 6), 0);
    assert_int_equal(strncmp(cfg.admin_endpoint, "ipc://", 6), 0);
    char buf[256];
    assert_int_equal(skv_config_get(&cfg, "pool-size", buf, sizeof buf), SKV_OK);
    assert_string_equal(buf, "1073741824");
    assert_int_equal(skv_config_get(&cfg, "foreground", buf, sizeof buf), SKV_OK);
    assert_string_equal(buf, "yes");
    assert_int_equal(skv_config_get(&cfg, "nope", buf, sizeof buf), SKV_E_NOT_FOUND);
    skv_config_free(&cfg);
}

static void test_sizes(void **state)
{
    (void)state;
    int64_t v;
    assert_int_equal(skv_parse_size("4G", &v), SKV_OK);
    assert_int_equal(v, INT64_C(4) << 30);
    assert_int_equal(skv_parse_size("512M", &v), SKV_OK);
    assert_int_equal(v, INT64_C(512) << 20);
    assert_int_equal(skv_parse_size("1.5K", &v), SKV_OK);
    assert_int_equal(v, 1536);
    assert_int_equal(skv_parse_size("2GiB", &v), SKV_OK);
    assert_int_equal(v, INT64_C(2) << 30);
    assert_int_equal(skv_parse_size("12", &v), SKV_OK);
    assert_int_equal(v, 12);
    assert_int_equal(skv_parse_size("x", &v), SKV_E_INVAL);
    assert_int_equal(skv_parse_size("-1G", &v), SKV_E_INVAL);
    assert_int_equal(skv_parse_size("4Q", &v), SKV_E_INVAL);
    assert_int_equal(skv_parse_size("99999999T", &v), SKV_E_INVAL);
    /* strtod reads these; none is a size (NaN once reached an int64 conversion: found by fuzz_config) */
    const char *not_sizes[] = {"nan", "NaN", "-nan", "nanG", "inf", "infinity", "-inf", "1e400"};
    for (size_t i = 0; i < sizeof not_sizes / sizeof not_sizes[0]; i++) {
        v = 7;
        assert_int_equal(skv_parse_size(not_sizes[i], &v), SKV_E_INVAL);
        assert_int_equal(v, 7);
    }
}

static void test_set(void **state)
{
    (void)state;
    struct skv_config cfg;
    assert_int_equal(skv_config_init(&cfg), SKV_OK);
    assert_int_equal(skv_config_set(&cfg, "threads", "4"), SKV_OK);
    assert_int_equal(cfg.threads, 4);
    assert_int_equal(skv_config_set(&cfg, "threads", "-1"), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "threads"));
    assert_int_equal(skv_config_set(&cfg, "threads", "4x"), SKV_E_INVAL);
    assert_int_equal(skv_config_set(&cfg, "pool-size", "10"), SKV_E_INVAL); /* below 1 MiB */
    /* it never detaches itself: foreground = no was accepted and did nothing */
    assert_int_equal(skv_config_set(&cfg, "foreground", "no"), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "does not detach itself"));
    assert_true(cfg.foreground);
    assert_int_equal(skv_config_set(&cfg, "foreground", "yes"), SKV_OK);
    assert_int_equal(skv_config_set(&cfg, "foreground", "maybe"), SKV_E_INVAL);
    assert_int_equal(skv_config_set(&cfg, "prefix-reuse", "no"), SKV_OK);
    assert_false(cfg.prefix_reuse);
    assert_int_equal(skv_config_set(&cfg, "prefix-reuse", "sometimes"), SKV_E_INVAL);
    assert_false(cfg.prefix_reuse);
    assert_int_equal(skv_config_set(&cfg, "prefix-retain-bytes", "64M"), SKV_OK);
    assert_int_equal(cfg.prefix_retain_bytes, INT64_C(64) << 20);
    assert_int_equal(skv_config_set(&cfg, "prefix-retain-bytes", "-1"), SKV_E_INVAL);
    assert_int_equal(skv_config_set(&cfg, "model", "/x/y.gguf"), SKV_OK);
    assert_string_equal(cfg.model, "/x/y.gguf");
    assert_int_equal(skv_config_set(&cfg, "unknown-key", "1"), SKV_E_NOT_FOUND);
    skv_config_free(&cfg);
}

/* Every client-controlled resource has a limit with a range; lease-seconds, the lease of a
 * session whose PREFILL names none, may not exceed max-lease-seconds. */
static void test_limits(void **state)
{
    (void)state;
    struct skv_config cfg;
    assert_int_equal(skv_config_init(&cfg), SKV_OK);
    assert_int_equal(skv_config_set(&cfg, "max-lease-seconds", "0"), SKV_E_INVAL);
    assert_int_equal(skv_config_set(&cfg, "max-lease-seconds", "2147483648"), SKV_E_INVAL);
    assert_int_equal(skv_config_set(&cfg, "max-lease-seconds", "2147483647"), SKV_OK);
    assert_int_equal(cfg.max_lease_seconds, INT32_MAX);
    assert_int_equal(skv_config_set(&cfg, "max-decodes", "0"), SKV_E_INVAL);
    assert_int_equal(skv_config_set(&cfg, "max-decodes-per-tenant", "0"), SKV_E_INVAL);
    assert_int_equal(skv_config_set(&cfg, "max-decodes", "4"), SKV_OK);
    assert_int_equal(skv_config_set(&cfg, "max-decodes-per-tenant", "2"), SKV_OK);
    assert_int_equal(cfg.max_decodes, 4);
    assert_int_equal(cfg.max_decodes_per_tenant, 2);

    assert_int_equal(skv_config_set(&cfg, "max-lease-seconds", "3600"), SKV_OK);
    assert_int_equal(skv_config_set(&cfg, "lease-seconds", "3600"), SKV_OK);
    assert_int_equal(skv_config_check(&cfg), SKV_OK);
    assert_int_equal(skv_config_set(&cfg, "lease-seconds", "3601"), SKV_OK);
    assert_int_equal(skv_config_check(&cfg), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "lease-seconds is 3601"));
    assert_non_null(strstr(skv_error_msg(), "max-lease-seconds (3600)"));
    assert_int_equal(skv_config_set(&cfg, "lease-seconds", "600"), SKV_OK);

    /* store-user and store-password-file are the store's: refused while store is off */
    assert_int_equal(skv_config_set(&cfg, "store-password-file", "/etc/snapkvd/store.pass"), SKV_OK);
    assert_int_equal(skv_config_check(&cfg), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "store-password-file is the shared store's"));
    assert_int_equal(skv_config_set(&cfg, "store", "redis://cache"), SKV_OK);
    assert_int_equal(skv_config_set(&cfg, "store-user", "snapkv"), SKV_OK);
    assert_int_equal(skv_config_check(&cfg), SKV_OK);
    assert_int_equal(skv_config_set(&cfg, "store", ""), SKV_OK);
    assert_int_equal(skv_config_check(&cfg), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "store-user is the shared store's"));
    assert_int_equal(skv_config_set(&cfg, "store-user", ""), SKV_OK);
    assert_int_equal(skv_config_set(&cfg, "store-password-file", ""), SKV_OK);
    assert_int_equal(skv_config_check(&cfg), SKV_OK);
    assert_int_equal(skv_config_set(&cfg, "store-secret-file", "/etc/snapkvd/store.key"), SKV_OK);
    assert_int_equal(skv_config_check(&cfg), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "store-secret-file is the shared store's"));
    assert_int_equal(skv_config_set(&cfg, "store-secret-file", ""), SKV_OK);
    /* store-accept-secret-file: the store's too, and only next to store-secret-file */
    assert_int_equal(skv_config_set(&cfg, "store-accept-secret-file", "/etc/snapkvd/store-old.key"), SKV_OK);
    assert_int_equal(skv_config_check(&cfg), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "store-accept-secret-file is the shared store's"));
    assert_int_equal(skv_config_set(&cfg, "store", "redis://cache"), SKV_OK);
    assert_int_equal(skv_config_check(&cfg), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "store-accept-secret-file is a second secret next to store-secret-file"));
    assert_int_equal(skv_config_set(&cfg, "store-secret-file", "/etc/snapkvd/store.key"), SKV_OK);
    assert_int_equal(skv_config_check(&cfg), SKV_OK);
    assert_int_equal(skv_config_set(&cfg, "store-accept-secret-file", ""), SKV_OK);
    assert_int_equal(skv_config_set(&cfg, "store-secret-file", ""), SKV_OK);
    assert_int_equal(skv_config_set(&cfg, "store", ""), SKV_OK);

    /* queue-order: fair by default, or fifo; anything else is refused where it is set, naming it */
    assert_string_equal(cfg.queue_order, "fair");
    assert_int_equal(skv_config_set(&cfg, "queue-order", "fifo"), SKV_OK);
    assert_int_equal(skv_config_check(&cfg), SKV_OK);
    assert_int_equal(skv_config_set(&cfg, "queue-order", "lifo"), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "queue-order: 'lifo' is not fair or fifo"));
    assert_string_equal(cfg.queue_order, "fifo"); /* unchanged */
    assert_int_equal(skv_config_set(&cfg, "queue-order", "fair"), SKV_OK);

    /* kv-type: f32 by default, f16 or q8_0; anything else is refused where it is set */
    assert_string_equal(cfg.kv_type, "f32");
    assert_int_equal(skv_config_set(&cfg, "kv-type", "q8_0"), SKV_OK);
    assert_int_equal(skv_config_set(&cfg, "kv-type", "f16"), SKV_OK);
    assert_int_equal(skv_config_set(&cfg, "kv-type", "bf16"), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "kv-type: 'bf16' is not f32, f16 or q8_0"));
    assert_int_equal(skv_config_set(&cfg, "kv-type", "q8"), SKV_E_INVAL);
    assert_string_equal(cfg.kv_type, "f16"); /* unchanged */
    assert_int_equal(skv_config_set(&cfg, "kv-type", "f32"), SKV_OK);

    /* tenant-weights: NAME:W (1..100), each name once, at most 64 */
    struct skv_tenant_weight tw[SKV_TENANT_WEIGHTS_MAX];
    int n = -1;
    assert_int_equal(skv_tenant_weights_parse("", tw, &n), SKV_OK);
    assert_int_equal(n, 0);
    assert_int_equal(skv_tenant_weights_parse("alice:4,bob@x.y:100,c_d-1:1", tw, &n), SKV_OK);
    assert_int_equal(n, 3);
    assert_string_equal(tw[1].name, "bob@x.y");
    assert_int_equal(tw[0].weight, 4);
    assert_int_equal(tw[1].weight, 100);
    static const struct {
        const char *text, *msg;
    } bad[] = {
        {"alice", "'alice' is not NAME:WEIGHT"},
        {":3", "':3' is not NAME:WEIGHT"},
        {"alice:0", "the weight of 'alice' is an integer from 1 to 100, not '0'"},
        {"alice:101", "not '101'"},
        {"alice:4x", "not '4x'"},
        {"alice:", "not ''"},
        {"al ice:2", "'al ice' is not a tenant name"},
        {"alice:2,alice:3", "'alice' is named twice"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(skv_tenant_weights_parse(bad[i].text, tw, &n), SKV_E_INVAL);
        if (!strstr(skv_error_msg(), bad[i].msg))
            fail_msg("'%s': '%s', want '%s'", bad[i].text, skv_error_msg(), bad[i].msg);
    }
    char many[1024] = "";
    for (int i = 0; i < 65; i++)
        snprintf(many + strlen(many), sizeof many - strlen(many), "%st%d:1", i ? "," : "", i);
    assert_int_equal(skv_tenant_weights_parse(many, tw, &n), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), "more than 64 tenants"));
    assert_int_equal(skv_config_set(&cfg, "tenant-weights", "alice:0"), SKV_E_INVAL); /* names the entry */
    assert_non_null(strstr(skv_error_msg(), "tenant-weights: the weight of 'alice'"));
    skv_config_free(&cfg);
}

/* Values with a form of their own are refused where they are set, so a config file's mistake
 * names its line and stops the start before the model loads (they were found after it, some
 * without the line). */
static void test_forms_at_their_line(void **state)
{
    (void)state;
    static const struct {
        const char *line, *msg;
    } bad[] = {
        {"log-level = verbose", "x.conf:2: log-level: 'verbose' is not error, warn, info or debug"},
        {"ipc-tenant = user", "x.conf:2: ipc-tenant: 'user' is not claimed or uid"},
        {"queue-order = lifo", "x.conf:2: queue-order: 'lifo' is not fair or fifo"},
        {"metrics-listen = 127.0.0.1", "x.conf:2: metrics-listen: '127.0.0.1' is not HOST:PORT"},
        {"metrics-listen = :9464", "is not HOST:PORT"},
        {"metrics-listen = 127.0.0.1:70000", "is not HOST:PORT"},
        {"metrics-listen = host:+80", "is not HOST:PORT"},
        {"metrics-listen = []:80", "is not HOST:PORT"},
        {"tenant-weights = a:0", "x.conf:2: tenant-weights: the weight of 'a'"},
        {"default-compress = policy=snapkv,ratio=2", "x.conf:2: default-compress: "},
        {"foreground = no", "x.conf:2: foreground: snapkvd does not detach itself"},
    };
    char dir[] = "/tmp/skv-conf-XXXXXX", path[64];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/x.conf", dir);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        FILE *f = fopen(path, "w");
        fprintf(f, "threads = 2\n%s\n", bad[i].line);
        fclose(f);
        struct skv_config cfg;
        assert_int_equal(skv_config_init(&cfg), SKV_OK);
        assert_int_equal(skv_config_load_file(&cfg, path), SKV_E_INVAL);
        if (!strstr(skv_error_msg(), bad[i].msg))
            fail_msg("'%s': '%s', want '%s'", bad[i].line, skv_error_msg(), bad[i].msg);
        skv_config_free(&cfg);
    }
    static const char *const good[] = {"metrics-listen = [::1]:9464", "metrics-listen = localhost:9464",
                                       "metrics-listen = ", "default-compress = policy=snapkv,ratio=0.2",
                                       "log-level = debug", "ipc-tenant = uid", "foreground = yes"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        FILE *f = fopen(path, "w");
        fprintf(f, "%s\n", good[i]);
        fclose(f);
        struct skv_config cfg;
        assert_int_equal(skv_config_init(&cfg), SKV_OK);
        if (skv_config_load_file(&cfg, path) != SKV_OK)
            fail_msg("'%s': %s", good[i], skv_error_msg());
        skv_config_free(&cfg);
    }
    unlink(path);
    rmdir(dir);
}

/* The request-queue limits: sizes like the other size options; max-text-bytes 0 is "derived". */
static void test_queue_limits(void **state)
{
    (void)state;
    struct skv_config cfg;
    assert_int_equal(skv_config_init(&cfg), SKV_OK);
    assert_int_equal(cfg.max_queued_bytes, INT64_C(256) << 20);
    assert_int_equal(cfg.queue_depth, 256);
    assert_int_equal(cfg.max_text_bytes, 0);
    char buf[64];
    assert_int_equal(skv_config_get(&cfg, "max-queued-bytes", buf, sizeof buf), SKV_OK);
    assert_string_equal(buf, "268435456");
    assert_int_equal(skv_config_set(&cfg, "max-queued-bytes", "1G"), SKV_OK);
    assert_int_equal(cfg.max_queued_bytes, INT64_C(1) << 30);
    assert_int_equal(skv_config_set(&cfg, "max-queued-bytes", "1K"), SKV_E_INVAL); /* below 64 KiB */
    assert_non_null(strstr(skv_error_msg(), "max-queued-bytes"));
    assert_int_equal(skv_config_set(&cfg, "max-queued-bytes", "lots"), SKV_E_INVAL);
    assert_int_equal(cfg.max_queued_bytes, INT64_C(1) << 30);
    assert_int_equal(skv_config_set(&cfg, "max-text-bytes", "2M"), SKV_OK);
    assert_int_equal(cfg.max_text_bytes, INT64_C(2) << 20);
    assert_int_equal(skv_config_set(&cfg, "max-text-bytes", "0"), SKV_OK);
    assert_int_equal(cfg.max_text_bytes, 0);
    assert_int_equal(skv_config_set(&cfg, "max-text-bytes", "4G"), SKV_E_INVAL); /* above 2 GiB */
    skv_config_free(&cfg);
}

static char *write_temp(const char *text)
{
    char tmpl[] = "/tmp/skv-conf-XXXXXX";
    int fd = mkstemp(tmpl);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    return strdup(tmpl);
}

static void test_file(void **state)
{
    (void)state;
    struct skv_config cfg;
    assert_int_equal(skv_config_init(&cfg), SKV_OK);
    char *ok = write_temp("# comment\n\nthreads = 3   # trailing\npool-size=2G\n  backend = cpu\n"
                          "log-file = /tmp/skv#1.log #  a '#' in a value stays\n");
    assert_int_equal(skv_config_load_file(&cfg, ok), SKV_OK);
    assert_string_equal(cfg.log_file, "/tmp/skv#1.log");
    assert_int_equal(cfg.threads, 3);
    assert_int_equal(cfg.pool_size, INT64_C(2) << 30);
    assert_string_equal(cfg.backend, "cpu");
    char *bad = write_temp("threads = 2\nnot a pair\n");
    assert_int_equal(skv_config_load_file(&cfg, bad), SKV_E_INVAL);
    assert_non_null(strstr(skv_error_msg(), ":2:"));
    char *unknown = write_temp("colour = blue\n");
    assert_int_equal(skv_config_load_file(&cfg, unknown), SKV_E_NOT_FOUND);
    assert_non_null(strstr(skv_error_msg(), "colour"));
    assert_int_equal(skv_config_load_file(&cfg, "/nonexistent/snapkvd.conf"), SKV_E_IO);
    unlink(ok);
    unlink(bad);
    unlink(unknown);
    free(ok);
    free(bad);
    free(unknown);
    skv_config_free(&cfg);
}

/* The example config shipped in systemd/ parses and keeps the network defaults. */
static void test_example_config(void **state)
{
    (void)state;
    const char *src = getenv("SKV_SRCDIR") ? getenv("SKV_SRCDIR") : ".";
    char path[4096];
    snprintf(path, sizeof path, "%s/systemd/snapkvd.conf", src);
    struct skv_config cfg;
    assert_int_equal(skv_config_init(&cfg), SKV_OK);
    assert_int_equal(skv_config_load_file(&cfg, path), SKV_OK);
    assert_false(cfg.allow_insecure_tcp);
    assert_string_equal(cfg.metrics_listen, "");
    assert_string_equal(cfg.endpoint, "ipc:///run/snapkvd/snapkvd.sock");
    assert_int_equal(skv_config_check(&cfg), SKV_OK);
    skv_config_free(&cfg);
}

static void test_table_unique(void **state)
{
    (void)state;
    size_t n;
    const struct skv_config_option *o = skv_config_options(&n);
    assert_true(n >= 15);
    for (size_t i = 0; i < n; i++) {
        assert_non_null(o[i].help);
        for (size_t j = i + 1; j < n; j++)
            assert_string_not_equal(o[i].name, o[j].name);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults), cmocka_unit_test(test_sizes), cmocka_unit_test(test_set),
        cmocka_unit_test(test_file),     cmocka_unit_test(test_example_config), cmocka_unit_test(test_table_unique),
        cmocka_unit_test(test_limits), cmocka_unit_test(test_forms_at_their_line),
        cmocka_unit_test(test_queue_limits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
