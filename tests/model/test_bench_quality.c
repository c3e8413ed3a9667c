/* `snapkv-bench quality` as a user runs it, on the default model: a passkey run and a fidelity
 * run end to end (the process, its JSON, markdown, gnuplot scripts and PNGs), with the values
 * they must report, and argument errors. Also `snapkv-bench select --json` (kept positions,
 * the prompt's ids, bytes). Skips without the model. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/common/fixture.h"

/* Bytes of one cached row of the default model: 30 layers x 3 KV heads x 64 x (K + V) x f32. */
#define ROW_BYTES (30 * 3 * 64 * 2 * 4)

struct run {
    char dir[64];   /* temporary folder: out/ is --out-dir, stdout and stderr the streams */
    char out[96];
    int status;     /* exit status, or -1 when it did not exit */
};

/* Runs snapkv-bench CMD --model M --threads 2 ARGS... (quality: also --out-dir R->out) */
static void bench_cmd(struct run *r, const char *cmd, const char *const *args)
{
    char *model = fixture_model_path();
    if (!model)
        skip();
    snprintf(r->dir, sizeof r->dir, "/tmp/skv-quality-XXXXXX");
    assert_non_null(mkdtemp(r->dir));
    snprintf(r->out, sizeof r->out, "%s/out", r->dir);
    const char *build = getenv("SKV_BUILDDIR") ? getenv("SKV_BUILDDIR") : ".";
    char exe[4096];
    snprintf(exe, sizeof exe, "%s/snapkv-bench", build);
    const char *argv[40] = {exe, cmd, "--model", model, "--threads", "2", "--out-dir", r->out};
    int n = strcmp(cmd, "quality") == 0 ? 8 : 6;
    for (int i = 0; args[i]; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        char path[128];
        snprintf(path, sizeof path, "%s/stdout", r->dir);
        if (!freopen(path, "w", stdout))
            _exit(126);
        snprintf(path, sizeof path, "%s/stderr", r->dir);
        if (!freopen(path, "w", stderr))
            _exit(126);
        execv(exe, (char *const *)argv);
        _exit(127);
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    r->status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    free(model);
}

static void bench(struct run *r, const char *const *args)
{
    bench_cmd(r, "quality", args);
}

static void cleanup(struct run *r)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", r->dir);
    assert_int_equal(system(cmd), 0);
}

/* The whole of R->dir/rel, or NULL when it does not exist. */
static char *slurp(const struct run *r, const char *rel)
{
    char path[160];
    snprintf(path, sizeof path, "%s/%s", r->dir, rel);
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = calloc(1, 1 << 20);
    size_t n = fread(buf, 1, (1 << 20) - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static json_t *load_json(const struct run *r, const char *rel)
{
    char path[160];
    snprintf(path, sizeof path, "%s/%s", r->dir, rel);
    json_error_t err;
    json_t *j = json_load_file(path, 0, &err);
    if (!j)
        fail_msg("%s: %s", path, err.text);
    return j;
}

/* The file exists and contains `needle`. */
static void assert_file_has(const struct run *r, const char *rel, const char *needle)
{
    char *s = slurp(r, rel);
    if (!s)
        fail_msg("%s/%s was not written", r->dir, rel);
    if (!strstr(s, needle))
        fail_msg("%s/%s lacks \"%s\"", r->dir, rel, needle);
    free(s);
}

/* A quality run's status: 0, or without gnuplot on the PATH 1 for the plots it could not draw
 * (its JSON and markdown written all the same). */
static void assert_quality_ok(const struct run *r)
{
    if (system("command -v gnuplot >/dev/null 2>&1") == 0) {
        assert_int_equal(r->status, 0);
        return;
    }
    assert_int_equal(r->status, 1);
    char *err = slurp(r, "stderr");
    assert_non_null(err);
    assert_non_null(strstr(err, "gnuplot is not installed"));
    assert_non_null(strstr(err, "plot(s) not drawn"));
    free(err);
}

/* With gnuplot on the PATH the script's PNG exists and is a PNG. */
static void assert_png(const struct run *r, const char *rel)
{
    if (system("command -v gnuplot >/dev/null 2>&1") != 0)
        return;
    char *s = slurp(r, rel);
    if (!s)
        fail_msg("%s/%s was not written (gnuplot is installed)", r->dir, rel);
    assert_memory_equal(s, "\x89PNG", 4);
    free(s);
}

static json_t *result_of(json_t *results, const char *spec)
{
    size_t i;
    json_t *v;
    json_array_foreach(results, i, v) {
        if (strcmp(json_string_value(json_object_get(v, "spec")), spec) == 0)
            return v;
    }
    fail_msg("no result for %s", spec);
    return NULL;
}

/* Without gnuplot on the PATH (an empty folder) a run writes its JSON and markdown, says why
 * there is no plot, and exits 1 (before, status 0 and no PNG: a run that asked for plots got
 * none unnoticed). */
static void test_no_gnuplot(void **state)
{
    (void)state;
    char empty[] = "/tmp/skv-nognuplot-XXXXXX", *path = getenv("PATH") ? strdup(getenv("PATH")) : NULL;
    assert_non_null(mkdtemp(empty));
    setenv("PATH", empty, 1);
    struct run r;
    const char *args[] = {"--task", "passkey", "--lengths", "512", "--depths", "50", "--trials", "1",
                          "--specs", "policy=snapkv,ratio=0.4", NULL};
    bench(&r, args);
    if (path)
        setenv("PATH", path, 1);
    free(path);
    rmdir(empty);
    assert_int_equal(r.status, 1);
    char *err = slurp(&r, "stderr");
    assert_non_null(strstr(err, "passkey_accuracy.gp: gnuplot is not installed (apt install gnuplot-nox)"));
    assert_non_null(strstr(err, "1 plot(s) not drawn"));
    free(err);
    json_t *j = load_json(&r, "out/passkey.json");
    assert_true(json_is_true(json_object_get(j, "complete")));
    json_decref(j);
    cleanup(&r);
}

/* One key at half depth in a 512-token document. The full cache and SnapKV at 40% / 50% find
 * it (measured: 20 of 20 keys at 512 tokens, docs/QUALITY.md); StreamingLLM at 10% keeps only
 * sinks and the recent tail, so none of the key's rows, and misses it. Every spec's fan-out
 * cache equals its own one-shot compressed prefill. */
static void test_passkey_run(void **state)
{
    (void)state;
    struct run r;
    const char *args[] = {"--task", "passkey", "--lengths", "512", "--depths", "50", "--trials", "1",
                          "--specs",
                          "policy=snapkv,ratio=0.4;policy=snapkv,ratio=0.5;policy=streaming,ratio=0.1;"
                          "policy=streaming,budget=98;policy=h2o,ratio=0.1",
                          NULL};
    bench(&r, args);
    assert_quality_ok(&r);
    json_t *j = load_json(&r, "out/passkey.json");
    assert_true(json_is_true(json_object_get(j, "complete")));
    json_t *results = json_object_get(j, "results");
    assert_int_equal(json_array_size(results), 6);

    static const struct {
        const char *spec;
        bool found;
        long long rows; /* rows per layer and KV head after the prefill */
    } want[] = {
        {"policy=full", true, 490},
        {"policy=snapkv,ratio=0.4", true, 196},
        {"policy=snapkv,ratio=0.5", true, 245},
        {"policy=streaming,ratio=0.1", false, 49},
        {"policy=streaming,budget=98", false, 98},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        json_t *v = result_of(results, want[i].spec);
        assert_int_equal(json_integer_value(json_object_get(v, "prompt_tokens")), 490);
        /* the key is a function of (seed 0, length, depth, trial): the same for every spec */
        assert_string_equal(json_string_value(json_object_get(v, "key")), "41205");
        assert_int_equal(json_integer_value(json_object_get(v, "key_token_positions")), 10);
        assert_int_equal(json_is_true(json_object_get(v, "correct")), want[i].found);
        const char *out = json_string_value(json_object_get(v, "output"));
        assert_int_equal(strstr(out, "41205") != NULL, want[i].found);
        assert_int_equal(json_integer_value(json_object_get(v, "kv_bytes_after_prefill")), want[i].rows * ROW_BYTES);
    }
    assert_true(json_real_value(json_object_get(result_of(results, "policy=full"), "key_rows_kept")) == 1.0);
    assert_true(json_real_value(json_object_get(result_of(results, "policy=streaming,ratio=0.1"), "key_rows_kept")) ==
                0.0);

    /* accuracy entries agree with the results: per depth and "all" */
    size_t i;
    json_t *a;
    int seen = 0;
    json_array_foreach(json_object_get(j, "accuracy"), i, a) {
        json_t *v = result_of(results, json_string_value(json_object_get(a, "spec")));
        assert_true(json_real_value(json_object_get(a, "accuracy")) ==
                    (json_is_true(json_object_get(v, "correct")) ? 1.0 : 0.0));
        seen++;
    }
    assert_int_equal(seen, 12);

    json_t *eq = json_object_get(j, "equivalence");
    assert_true(json_array_size(eq) >= 5);
    json_array_foreach(eq, i, a) {
        assert_true(json_is_true(json_object_get(a, "identical_positions")));
        assert_int_equal(json_integer_value(json_object_get(a, "positions_sym_diff")), 0);
        if (strstr(json_string_value(json_object_get(a, "against")), "fan-out"))
            assert_true(json_real_value(json_object_get(a, "kv_max_abs_diff")) == 0.0);
    }
    json_decref(j);

    /* the command as one runs it again, command word first, the spec list quoted */
    assert_file_has(&r, "out/passkey.md", "Command: `snapkv-bench quality --model ");
    assert_file_has(&r, "out/passkey.md",
                    "--specs \"policy=snapkv,ratio=0.4;policy=snapkv,ratio=0.5;policy=streaming,ratio=0.1;"
                    "policy=streaming,budget=98;policy=h2o,ratio=0.1\"`");
    assert_file_has(&r, "out/passkey.md", "| full cache (baseline) | 100 |");
    assert_file_has(&r, "out/passkey.md", "| policy=streaming,ratio=0.1 | 0 |");
    assert_file_has(&r, "stdout", "## Passkey retrieval");
    /* accuracy vs the KV kept: SnapKV's two ratios make a series, and so do StreamingLLM's ratio
     * and token budget (10% and 20% of the 490 tokens); H2O's one spec does not */
    assert_file_has(&r, "out/passkey_budget.gp", "0.4 1.0000\n0.5 1.0000\n");
    assert_file_has(&r, "out/passkey_budget.gp", "0.1 0.0000\n0.2 0.0000\n");
    assert_file_has(&r, "out/passkey_budget.gp", "title 'policy=snapkv'");
    assert_file_has(&r, "out/passkey_budget.gp", "title 'policy=streaming'");
    char *gp = slurp(&r, "out/passkey_budget.gp");
    assert_null(strstr(gp, "title 'policy=h2o'"));
    free(gp);
    assert_png(&r, "out/passkey_budget.png");
    assert_png(&r, "out/passkey_accuracy.png");
    cleanup(&r);
}

/* 200 tokens of the Apache-2.0 text, 8 forced tokens. A budget that holds the whole prompt is
 * the full cache: KL exactly 0, every prediction and greedy token the same. Smaller budgets
 * keep exactly their rows, and 10% is further from the full cache than 30%. */
static void test_fidelity_run(void **state)
{
    (void)state;
    struct run r;
    char *text = fixture_path("tests/fixtures/golden/fidelity_prompt.txt");
    const char *args[] = {"--task", "fidelity", "--texts", text, "--fid-prefill", "200", "--fid-tokens", "8",
                          "--specs", "policy=snapkv,ratio=1.0;policy=snapkv,ratio=0.1;policy=snapkv,ratio=0.3",
                          NULL};
    bench(&r, args);
    free(text);
    assert_quality_ok(&r);
    json_t *j = load_json(&r, "out/fidelity.json");
    json_t *texts = json_object_get(j, "texts");
    assert_int_equal(json_array_size(texts), 1);
    json_t *t = json_array_get(texts, 0);
    assert_int_equal(json_integer_value(json_object_get(t, "text_tokens")), 1020);
    assert_int_equal(json_integer_value(json_object_get(t, "prefill_tokens")), 200);
    assert_int_equal(json_integer_value(json_object_get(t, "forced_tokens")), 8);
    json_t *specs = json_object_get(t, "specs");
    assert_int_equal(json_array_size(specs), 4);

    json_t *whole = result_of(specs, "policy=snapkv,ratio=1.0");
    assert_int_equal(json_integer_value(json_object_get(whole, "kv_bytes_after_prefill")), 200LL * ROW_BYTES);
    assert_true(json_real_value(json_object_get(whole, "kl_mean")) == 0.0);
    assert_true(json_real_value(json_object_get(whole, "top1_agreement")) == 1.0);
    assert_true(json_real_value(json_object_get(whole, "greedy_overall_fraction")) == 1.0);
    json_t *pk;
    size_t k;
    json_array_foreach(json_object_get(whole, "kl_per_step"), k, pk)
        assert_true(json_real_value(pk) == 0.0);
    assert_int_equal(k, 8);

    json_t *r10 = result_of(specs, "policy=snapkv,ratio=0.1"), *r30 = result_of(specs, "policy=snapkv,ratio=0.3");
    assert_int_equal(json_integer_value(json_object_get(r10, "budget")), 20);
    assert_int_equal(json_integer_value(json_object_get(r30, "budget")), 60);
    assert_int_equal(json_integer_value(json_object_get(r10, "kv_bytes_after_prefill")), 20LL * ROW_BYTES);
    assert_int_equal(json_integer_value(json_object_get(r30, "kv_bytes_after_prefill")), 60LL * ROW_BYTES);
    double kl10 = json_real_value(json_object_get(r10, "kl_mean"));
    double kl30 = json_real_value(json_object_get(r30, "kl_mean"));
    assert_true(kl10 > 0.1);
    assert_true(kl30 > 0.0 && kl30 < kl10);
    json_decref(j);

    assert_file_has(&r, "out/fidelity.md", "| policy=snapkv,ratio=1.0 | 100.0% | 0.0000 |");
    assert_file_has(&r, "out/fidelity_kl.gp", "title 'policy=snapkv'");
    assert_png(&r, "out/fidelity_kl.png");
    cleanup(&r);
}

/* Bad arguments: exit status 1, one line that names the argument, nothing written. */
static void test_bad_arguments(void **state)
{
    (void)state;
    static const struct {
        const char *args[6];
        const char *message;
    } cases[] = {
        {{"--task", "passkey", "--specs", "policy=snapkv,ratio=2", NULL}, "ratio=2: expected a number in [0, 1]"},
        {{"--task", "passkey", "--specs", "policy=snapkv,budget=64,frobnicate=1", NULL}, "frobnicate"},
        {{"--task", "passkey", "--lengths", "10", NULL}, "--lengths: expected comma-separated integers in [16,"},
        {{"--task", "passkey", "--depths", "150", NULL}, "--depths: expected comma-separated integers in [0, 100]"},
        {{"--task", "fidelity", "--texts", "/nonexistent/text.txt", NULL}, "cannot open /nonexistent/text.txt"},
        {{"--task", "haystack", NULL}, "--task 'haystack': expected passkey, fidelity or all"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct run r;
        bench(&r, cases[i].args);
        assert_int_equal(r.status, 1);
        assert_file_has(&r, "stderr", cases[i].message);
        char *json = slurp(&r, "out/passkey.json");
        assert_null(json);
        cleanup(&r);
    }
    /* options a command does not read, and lists or seeds that do not parse: refused, exit 2
     * (before, speed --specs ran uncompressed, --prefill abc ran no prefill, --seed abc was 0) */
    static const struct {
        const char *cmd, *args[4], *message;
    } usage[] = {
        {"speed", {"--specs", "policy=snapkv,ratio=0.1", NULL}, "speed does not take --specs (its own options:"},
        {"speed", {"--prefill", "abc", NULL}, "--prefill: 'abc' is not a list of counts"},
        {"speed", {"--decode-depth", "64,", NULL}, "--decode-depth: '64,' is not a list of counts"},
        {"speed", {"--batch", "65", NULL}, "--batch wants a whole number from 1 to 64, not '65'"},
        {"speed", {"--append", "0", NULL}, "--append: '0' is not a list of counts"},
        {"gemv", {"--batch", "2", NULL}, "gemv does not take --batch"},
        {"quality", {"--compress", "policy=snapkv,ratio=0.1", NULL}, "quality does not take --compress"},
        {"generate", {"--seed", "abc", NULL}, "--seed: 'abc' is not a number"},
    };
    for (size_t i = 0; i < sizeof usage / sizeof usage[0]; i++) {
        struct run r;
        bench_cmd(&r, usage[i].cmd, usage[i].args);
        assert_int_equal(r.status, 2);
        assert_file_has(&r, "stderr", usage[i].message);
        cleanup(&r);
    }
}

/* select --json on a 54-token prompt with budget=40: every (layer, KV head) keeps exactly
 * 40 sorted original positions, the last 32 (the window) among them; the JSON carries the
 * prompt's ids, the bytes of 40 rows, the 48 rows' blocks they hold, and the bytes of the same
 * rows stored at query-head width. */
static void test_select_json(void **state)
{
    (void)state;
    static const char *const args[] = {
        "--prompt", "The lighthouse keeper climbed the spiral stairs every evening just before sunset. He checked "
                    "the oil in the lamp, wiped the salt from the thick glass lenses, and wound the clockwork that "
                    "turned the great light. From the gallery he could see the boats returning to the harbour.",
        "--compress", "policy=snapkv,budget=40", "--json", NULL};
    struct run r;
    bench_cmd(&r, "select", args);
    assert_int_equal(r.status, 0);
    json_t *j = load_json(&r, "stdout");
    int n = (int)json_integer_value(json_object_get(j, "n_tokens"));
    assert_true(n > 40 && n < 120); /* 54 with SmolLM2 */
    assert_int_equal(json_array_size(json_object_get(j, "ids")), n);
    assert_int_equal(json_integer_value(json_object_get(j, "bytes_after")), 40 * ROW_BYTES);
    /* what the pool holds: 3 blocks of 16 rows a head */
    assert_int_equal(json_integer_value(json_object_get(j, "bytes_after_blocks")), 48 * ROW_BYTES);
    /* the same rows at query-head width, measured by storing them so (9 query heads, 3 KV
     * heads): 3 times, rows and blocks (before, this field was bytes_after * 9 / 3, computed) */
    assert_int_equal(json_integer_value(json_object_get(j, "bytes_query_head_width")), 3 * 40 * ROW_BYTES);
    assert_int_equal(json_integer_value(json_object_get(j, "bytes_query_head_width_blocks")), 3 * 48 * ROW_BYTES);
    assert_int_equal(json_integer_value(json_object_get(j, "bytes_before")), (json_int_t)n * ROW_BYTES);
    json_t *layers = json_object_get(j, "layers");
    assert_int_equal(json_array_size(layers), 30);
    size_t l, h;
    json_t *layer, *kept;
    json_array_foreach(layers, l, layer) {
        assert_int_equal(json_integer_value(json_object_get(layer, "budget")), 40);
        json_array_foreach(json_object_get(layer, "kept"), h, kept) {
            assert_int_equal(json_array_size(kept), 40);
            for (size_t i = 0; i < 40; i++) {
                json_int_t p = json_integer_value(json_array_get(kept, i));
                assert_true(p >= 0 && p < n);
                if (i > 0)
                    assert_true(p > json_integer_value(json_array_get(kept, i - 1)));
                if (i >= 8) /* the last 32 kept are the window */
                    assert_int_equal(p, n - 40 + (json_int_t)i);
            }
        }
        assert_int_equal(h, 3);
    }
    json_decref(j);
    cleanup(&r);
}

/* select --chat --assistant T: the chat prompt's ids, then T's, as quality's passkey prompts
 * end ("The pass key is" starts the assistant turn); without --chat it is refused. */
static void test_select_assistant(void **state)
{
    (void)state;
    static const char *const plain[] = {"--prompt", "Where is the key?", "--chat", "--json", NULL};
    static const char *const with[] = {"--prompt", "Where is the key?", "--chat", "--assistant", "The pass key is",
                                       "--json", NULL};
    static const char *const alone[] = {"--prompt", "Where is the key?", "--assistant", "The pass key is", NULL};
    struct run r, s, t;
    bench_cmd(&r, "select", plain);
    assert_int_equal(r.status, 0);
    bench_cmd(&s, "select", with);
    assert_int_equal(s.status, 0);
    json_t *a = load_json(&r, "stdout"), *b = load_json(&s, "stdout");
    json_t *ia = json_object_get(a, "ids"), *ib = json_object_get(b, "ids");
    size_t na = json_array_size(ia), nb = json_array_size(ib);
    assert_true(na > 10);
    assert_int_equal(nb, na + 4); /* " The", " pass", " key", " is" in SmolLM2's vocabulary: 4 */
    for (size_t i = 0; i < na; i++)
        assert_int_equal(json_integer_value(json_array_get(ia, i)), json_integer_value(json_array_get(ib, i)));
    json_decref(a);
    json_decref(b);
    cleanup(&r);
    cleanup(&s);
    bench_cmd(&t, "select", alone);
    assert_int_equal(t.status, 1);
    assert_file_has(&t, "stderr", "--assistant needs --chat");
    cleanup(&t);
}

/* speed --batch 3: three copies of the depth-64 cache decode 4 steps in one forward each; the
 * JSON names the batch, each sequence's tokens, and tokens/s over all three; with --compress
 * every copy keeps its own compressor (SnapKV re-scores while decoding). --append 9,21: a
 * forward of each many tokens on a copy of the depth's cache, timed. */
static void test_speed_batch(void **state)
{
    (void)state;
    static const char *const plain[] = {"--prefill", "none", "--decode-depth", "64", "--decode-tokens", "4",
                                        "--batch", "3", "--threads", "2", "--append", "9,21", "--json", NULL};
    static const char *const comp[] = {"--prefill", "none", "--decode-depth", "64", "--decode-tokens", "4",
                                       "--batch", "3", "--threads", "2", "--compress", "policy=snapkv,budget=40",
                                       "--json", NULL};
    const char *const *runs[] = {plain, comp};
    for (int k = 0; k < 2; k++) {
        struct run r;
        bench_cmd(&r, "speed", runs[k]);
        assert_int_equal(r.status, 0);
        json_t *j = load_json(&r, "stdout");
        json_t *d = json_array_get(json_object_get(j, "decode"), 0);
        assert_non_null(d);
        assert_int_equal(json_array_size(json_object_get(j, "decode")), 1);
        assert_int_equal(json_integer_value(json_object_get(d, "depth")), 64);
        assert_int_equal(json_integer_value(json_object_get(d, "batch")), 3);
        assert_int_equal(json_integer_value(json_object_get(d, "tokens")), 4);
        double secs = json_real_value(json_object_get(d, "seconds"));
        double tps = json_real_value(json_object_get(d, "tokens_per_second"));
        assert_true(secs > 0);
        assert_true(fabs(tps * secs - 12.0) < 1e-6);
        /* what a step reads: the cache of 64 rows (SnapKV: its 40), f32 K and V */
        assert_int_equal(json_integer_value(json_object_get(d, "kv_read_bytes")), (k ? 40 : 64) * ROW_BYTES);
        json_t *ap = json_object_get(j, "append");
        assert_int_equal(json_array_size(ap), k ? 0 : 2);
        for (size_t q = 0; q < json_array_size(ap); q++) {
            json_t *o = json_array_get(ap, q);
            assert_int_equal(json_integer_value(json_object_get(o, "depth")), 64);
            assert_int_equal(json_integer_value(json_object_get(o, "tokens")), q ? 21 : 9);
            assert_true(json_real_value(json_object_get(o, "seconds")) > 0);
        }
        json_decref(j);
        cleanup(&r);
    }
}

/* Token text that is not UTF-8 on its own (byte-level pieces of a character) goes into the JSON
 * as U+FFFD: before, jansson refused the string and `logits --json` printed nothing, exit 0. */
static void test_logits_json_text(void **state)
{
    (void)state;
    static const char *const args[] = {"--prompt", "\xE6\x9D\xB1\xE4\xBA\xAC\xE3\x81\xAF\xE6\x97\xA5\xE6\x9C\xAC"
                                                   "\xE3\x81\xAE\xE9\xA6\x96\xE9\x83\xBD\xE3\x81\xA7",
                                       "--top", "20", "--json", NULL};
    struct run r;
    bench_cmd(&r, "logits", args);
    assert_int_equal(r.status, 0);
    json_t *j = load_json(&r, "stdout");
    json_t *top = json_object_get(j, "top");
    assert_int_equal(json_array_size(top), 20);
    size_t i, replaced = 0;
    json_t *e;
    json_array_foreach(top, i, e) {
        const char *t = json_string_value(json_object_get(e, "text"));
        assert_non_null(t);
        replaced += strstr(t, "\xEF\xBF\xBD") != NULL;
    }
    assert_true(replaced > 0); /* this prompt's likely next tokens include pieces of characters */
    json_decref(j);
    cleanup(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_passkey_run),
        cmocka_unit_test(test_no_gnuplot),
        cmocka_unit_test(test_fidelity_run),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_select_json), cmocka_unit_test(test_select_assistant),
        cmocka_unit_test(test_speed_batch),
        cmocka_unit_test(test_logits_json_text),
    };
    return cmocka_run_group_tests_name("bench-quality", tests, NULL, NULL);
}
