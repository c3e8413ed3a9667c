/* snapkvctl: the command line of snapkvd for users (generate, chat, prefill, append, decode,
 * compress, fork, export/import, release, cancel) and admins (status, list, inspect, evict, pin, save,
 * load, stats, config). Talks only through libsnapkv; human tables by default, --json for scripts. */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/utf8.h"
#include "libclient/snapkv.h"

#define DEFAULT_ENDPOINT "ipc:///run/snapkvd/snapkvd.sock"
#define SNAPKV_MAX_STOP 16 /* stop sequences a DECODE may name */
#define DEFAULT_ADMIN_ENDPOINT "ipc:///run/snapkvd/admin.sock"
#define DEFAULT_MAX_TOKENS 256
#define MAX_INPUT_BYTES (64u << 20)

/* Later chat turns go through APPEND, which takes raw text: this wraps each user line in the
 * model's turn markup (%s: the line). The default is ChatML (SmolLM2, Qwen2); it closes the
 * previous assistant turn, whose end-of-turn token the daemon does not feed back. */
#define DEFAULT_TURN_TEMPLATE "<|im_end|>\n<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n"

/* The file `export` writes and `import` reads, all integers in host byte order:
 *   header (struct export_header), then per layer: u32 layer, u32 kept, u32 kept_per_head[n_kv_heads],
 *   then u32 positions[n_positions], then data_bytes of K/V in the daemon's export layout
 *   (per layer K then V, each [n_kv_heads][kept][head_dim] float32). */
#define EXPORT_MAGIC "SNAPKVKV"
#define EXPORT_VERSION 2u   /* 1 cut the 64-character fingerprint to 63, so no version-1 file imported */
struct export_header {
    char magic[8];
    uint32_t version;
    uint32_t n_layers;
    uint32_t n_kv_heads;
    uint32_t head_dim;
    uint32_t original_length;     /* the session's length (its next position); never 0 */
    uint32_t n_positions;
    uint64_t data_bytes;
    char model_fingerprint[80];   /* NUL-terminated and NUL-padded */
};

struct ctl {
    const char *endpoint;
    const char *admin_endpoint;
    const char *server_key;       /* file: the daemon's CURVE public key */
    const char *client_key;       /* file: this client's CURVE secret key */
    const char *tenant;
    bool tenant_given; /* -t: list, evict and load take it as their tenant */
    bool json;
    int timeout_ms;
};

static void usage(FILE *out)
{
    fprintf(out,
            "usage: snapkvctl [-e URL] [-a URL] [--server-key F --client-key F] [--tenant T] [--json] [--timeout MS]\n"
            "                 COMMAND [ARGS]\n"
            "  -e, --endpoint URL        client endpoint (default %s, or $SNAPKV_ENDPOINT unless empty)\n"
            "  -a, --admin-endpoint URL  admin endpoint (default %s, or $SNAPKV_ADMIN_ENDPOINT unless empty)\n"
            "      --server-key FILE     CURVE: the daemon's public key file, for tcp:// (or $SNAPKV_SERVER_KEY)\n"
            "      --client-key FILE     CURVE: this client's secret key file (or $SNAPKV_CLIENT_KEY)\n"
            "  -t, --tenant T            tenant of the client commands' sessions (default \"default\"); also\n"
            "                            list's, evict's and load's (the other admin commands, and evict\n"
            "                            SESSION, act on any tenant's; -t with evict --all is refused)\n"
            "  -j, --json                JSON output for scripts\n"
            "      --timeout MS          wait for each reply this long (default 30000; -1 forever)\n"
            "client commands:\n"
            "  info                                   what the daemon serves (HELLO)\n"
            "  generate (--prompt TEXT | --file F) [--question TEXT] [SAMPLING] [--compress SPEC] [--stats]\n"
            "                                         one-shot: prefill as a chat turn, stream the answer, release\n"
            "  chat [--compress SPEC] [SAMPLING] [--turn-template T] [--stats]\n"
            "                                         interactive: one line per turn, answers streamed\n"
            "                                         (Ctrl-C stops an answer; at the prompt, ends the chat)\n"
            "  prefill (--prompt TEXT | --file F) [--chat] [--compress SPEC] [--lease S] [--ref] [--no-reuse]\n"
            "          [--score] [--top N]            prints the new session id (--ref: as ENDPOINT#ID);\n"
            "                                         --no-reuse: compute every token (no prefix reuse);\n"
            "                                         --score: the prompt tokens' log-probabilities (each\n"
            "                                         given those before it): their sum, nats a token and\n"
            "                                         perplexity (--json: each token's too); --top N (1-20,\n"
            "                                         implies --score): each token's line with the N most\n"
            "                                         likely tokens there (on stderr; --json: top_logprobs)\n"
            "  append SESSION (TEXT | --file F) [--score] [--top N]   (-- before a TEXT that begins with -)\n"
            "                                         run more text through a session; --score, --top: as\n"
            "                                         prefill's, each token given the session before it\n"
            "  tokenize (TEXT | --file F) [--chat] [--append]   (-- before a TEXT that begins with -)\n"
            "                                         the token ids a prefill (--append: an append) of the\n"
            "                                         text runs, without running them\n"
            "  detokenize ID... [--skip-special]      the text of token ids\n"
            "  decode SESSION [SAMPLING] [--logprobs N]\n"
            "                                         generate, streamed to stdout; --logprobs: each token's\n"
            "                                         log-probability and N (0-20) most likely tokens after it\n"
            "  compress SESSION SPEC [--window-from N]\n"
            "  fork SESSION                           copy-on-write copy; prints the new id\n"
            "  export SESSION [--out FILE] [--size BYTES]\n"
            "                                         K/V through shared memory into FILE (default SESSION.skvkv);\n"
            "                                         without --size, asks the admin endpoint for the session's size\n"
            "  import FILE                            a session from an exported file; prints its id\n"
            "  release SESSION\n"
            "  cancel SESSION [--admin]               end the session's running decode (it keeps its tokens);\n"
            "                                         --admin: through the admin endpoint, any tenant's session\n"
            "  SESSION: an id (32 hex digits); the client commands also take a reference ENDPOINT#ID and go\n"
            "           to its endpoint, not -e's (fork then prints a reference too; export then needs\n"
            "           --size; cancel --admin, like the admin commands, takes only an id)\n"
            "  SAMPLING: [--max-tokens N (256)] [--temperature T] [--top-p P] [--top-k K] [--seed S] [--no-eos]\n"
            "            [--stop TEXT]... (up to 16 stop sequences: the answer ends before the first one)\n"
            "            [--min-p P] [--repetition-penalty R (1: off)] [--repetition-last-n N (0: all)]\n"
            "            [--frequency-penalty F] [--presence-penalty F] [--logit-bias TOKEN=BIAS]...\n"
            "admin commands (admin endpoint):\n"
            "  status | list [--kept] [TENANT] | inspect SESSION [--positions] [--hashes]\n"
            "  evict (SESSION | --tenant T | --all) | pin SESSION | unpin SESSION\n"
            "                                         (list --kept: the kept prefixes, prefix-retain-bytes;\n"
            "                                         evict takes their ids too; it drops what this daemon\n"
            "                                         holds, --tenant / --all the sessions neither pinned nor\n"
            "                                         decoding, and deletes them from the store: a session's\n"
            "                                         or a tenant's whoever spilled them, --all's what this\n"
            "                                         daemon spilled)\n"
            "  save SESSION NAME | load NAME [--tenant T] | stats [--prometheus] | config [KEY]\n"
            "  tenants                                each tenant's sessions, bytes, waiting requests, running\n"
            "                                         decodes, requests, errors, tokens, engine time and kept\n"
            "                                         prefixes' bytes\n"
            "  events ENDPOINT [--count N] [--replay R] the KV events of a daemon's events-endpoint, one per line,\n"
            "                                         until N came (default: for ever); --replay: first the\n"
            "                                         sessions it holds now, from its events-replay-endpoint R\n"
            "                                         (and again when it finds events were missed); says on\n"
            "                                         stderr when nothing, not even a heartbeat, came for\n"
            "                                         --timeout, and waits on\n"
            "other:\n"
            "  keygen NAME                            CURVE key pair: NAME.pub (public) and NAME.key (secret, 0600)\n"
            "  place KEY ENDPOINT...                  which of the endpoints KEY belongs to (rendezvous hashing,\n"
            "                                         snapkv_place): printed, to give as -e; connects to none\n"
            "SPEC: a compression spec, e.g. policy=snapkv,ratio=0.1 or policy=snapkv,alloc=squeeze,budget=512\n"
            "exit status: 0 done, 1 failed (the reason on stderr), 2 usage, 3 a decode or generate cut short\n"
            "(by CANCEL, the daemon's stop, no room for another token: max-bytes-per-tenant or the pool, or a\n"
            "later token failed; the tokens printed are in the session; chat ends there, Ctrl-C stopping\n"
            "an answer only),\n"
            "130 generate or chat interrupted (Ctrl-C)\n",
            DEFAULT_ENDPOINT, DEFAULT_ADMIN_ENDPOINT);
}

/* Whether usage line `text` (len bytes) names command cmd: "  cmd ..." or "... | cmd ..." (the
 * admin lines). */
static bool names_command(const char *text, size_t len, const char *cmd)
{
    char line[256];
    snprintf(line, sizeof line, "%.*s", (int)len, text);
    size_t n = strlen(cmd);
    if (strncmp(line, "  ", 2) != 0 || line[2] == ' ')
        return false;
    for (const char *p = line + 2; (p = strstr(p, cmd)); p += n) {
        bool starts = p == line + 2 || (p >= line + 2 && p[-1] == ' ' && p[-2] == '|');
        if (starts && (p[n] == ' ' || p[n] == '\n' || p[n] == '\0'))
            return true;
    }
    return false;
}

/* `snapkvctl CMD --help`: the usage lines of CMD (with their continuation lines, and SESSION,
 * SAMPLING or SPEC when they name them); the whole text for a command it does not know. */
static int command_usage(const char *cmd)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f)
        return usage(stdout), 0;
    usage(f);
    fclose(f);
    bool found = false, in = false, sampling = false, spec = false, session = false;
    for (char *line = text; line && *line;) {
        char *end = strchr(line, '\n');
        size_t n = end ? (size_t)(end - line + 1) : strlen(line);
        bool cont = strncmp(line, "          ", 10) == 0; /* a line that goes on the one above */
        in = cont ? in : names_command(line, n, cmd);
        if (in) {
            fwrite(line, 1, n, stdout);
            found = true;
            sampling |= memmem(line, n, "SAMPLING", 8) != NULL;
            spec |= memmem(line, n, "SPEC", 4) != NULL;
            session |= memmem(line, n, "SESSION", 7) != NULL;
        }
        line += n;
    }
    for (char *line = text; found && line && *line;) {
        char *end = strchr(line, '\n');
        size_t n = end ? (size_t)(end - line + 1) : strlen(line);
        bool cont = strncmp(line, "          ", 10) == 0;
        in = cont ? in
                  : (sampling && strncmp(line, "  SAMPLING:", 11) == 0) || (spec && strncmp(line, "SPEC:", 5) == 0) ||
                        (session && strncmp(line, "  SESSION:", 10) == 0);
        if (in)
            fwrite(line, 1, n, stdout);
        line += n;
    }
    if (found)
        printf("(snapkvctl --help: every command, the global options and the exit statuses)\n");
    else
        fputs(text, stdout);
    free(text);
    return 0;
}

/* ---- small helpers ---------------------------------------------------------------------------- */

static int usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int usage_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "snapkvctl %s: ", cmd);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n(see snapkvctl --help)\n");
    va_end(ap);
    return 2;
}

/* The tenant an admin command that takes one (list, evict, load) acts on: its own (*tenant, or
 * NULL), or -t's when it names none; false (said on stderr) when the two differ. */
static bool admin_tenant(const struct ctl *c, const char *cmd, const char **tenant)
{
    if (!c->tenant_given)
        return true;
    if (*tenant && strcmp(*tenant, c->tenant) != 0) {
        usage_error(cmd, "-t %s and %s name two tenants", c->tenant, *tenant);
        return false;
    }
    *tenant = c->tenant;
    return true;
}

/* Reports a failed library call; returns the exit status 1. */
static int failed(const char *what, int rc)
{
    fprintf(stderr, "snapkvctl: %s: %s (%s)\n", what, snapkv_last_error(), snapkv_status_str(rc));
    return 1;
}

/* The endpoint a session reference (ENDPOINT#ID) named, when the command's session was given
 * as one: the client commands connect there instead of to -e. */
static char g_ref_endpoint[1024];

static int connect_to(const struct ctl *c, bool admin, snapkv_client_t **out)
{
    struct snapkv_connect_opts o = {.tenant = c->tenant, .name = "snapkvctl", .timeout_ms = c->timeout_ms};
    const char *ep = admin ? c->admin_endpoint : *g_ref_endpoint ? g_ref_endpoint : c->endpoint;
    char server_key[SNAPKV_CURVE_KEY_SIZE], client_key[SNAPKV_CURVE_KEY_SIZE];
    int rc = SNAPKV_OK;
    if (!c->server_key != !c->client_key) {
        fprintf(stderr, "snapkvctl: CURVE needs both --server-key and --client-key\n");
        return SNAPKV_E_INVAL;
    }
    if (c->server_key) {
        if ((rc = snapkv_curve_key_load(c->server_key, false, server_key)) ||
            (rc = snapkv_curve_key_load(c->client_key, true, client_key))) {
            fprintf(stderr, "snapkvctl: %s (%s)\n", snapkv_last_error(), snapkv_status_str(rc));
            return rc;
        }
        o.curve_server_key = server_key;
        o.curve_secret_key = client_key;
    }
    rc = snapkv_connect(ep, &o, out);
    if (rc)
        fprintf(stderr, "snapkvctl: %s: %s (%s)\n", ep, snapkv_last_error(), snapkv_status_str(rc));
    return rc;
}

/* Prints j (the reference is taken) and returns the exit status. NULL j: building the output
 * failed (out of memory, or a helper below gave NULL), which is an error, not an empty output. */
static int print_json(json_t *j)
{
    char *s = j ? json_dumps(j, JSON_INDENT(2)) : NULL;
    json_decref(j);
    if (!s) {
        fprintf(stderr, "snapkvctl: could not build the JSON output\n");
        return 1;
    }
    int ret = puts(s) < 0 ? 1 : 0;
    free(s);
    return ret;
}

/* Appends v to *arr, taking the reference. When that fails (v NULL: it could not be built) the
 * whole array goes and *arr becomes NULL, so no row is silently missing from an output. */
static void json_push(json_t **arr, json_t *v)
{
    if (json_array_append_new(*arr, v) != 0) {
        json_decref(*arr);
        *arr = NULL;
    }
}

/* Sets key in *obj to v, the same way: on failure the object goes and *obj becomes NULL. */
static void json_put(json_t **obj, const char *key, json_t *v)
{
    if (json_object_set_new(*obj, key, v) != 0) {
        json_decref(*obj);
        *obj = NULL;
    }
}

/* s (NULL: "") as a JSON string. Text from the daemon need not be valid UTF-8 (a decode that
 * stopped inside a character, a name cut to fit a field), and jansson refuses such strings:
 * each ill-formed sequence becomes U+FFFD. NULL only when out of memory. */
static json_t *json_text(const char *s)
{
    if (!s)
        s = "";
    json_t *j = json_string(s);
    if (j)
        return j;
    size_t len = 0;
    char *fixed = skv_utf8_fix(s, strlen(s), &len);
    j = fixed ? json_stringn(fixed, len) : NULL;
    free(fixed);
    return j;
}

/* v as a JSON number; null when it is not finite (JSON has no NaN or infinity). */
static json_t *json_number(double v)
{
    return isfinite(v) ? json_real(v) : json_null();
}

/* n integers as a JSON array; NULL when out of memory. */
static json_t *u32_json(const uint32_t *v, size_t n)
{
    json_t *arr = json_array();
    for (size_t i = 0; arr && i < n; i++)
        json_push(&arr, json_integer(v[i]));
    return arr;
}

static bool parse_u64(const char *s, uint64_t max, uint64_t *out)
{
    if (!s || !isdigit((unsigned char)*s)) /* strtoull would take " -1" as 2^64 - 1 */
        return false;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v > max)
        return false;
    *out = v;
    return true;
}

static bool parse_u32(const char *s, uint32_t *out)
{
    uint64_t v;
    if (!parse_u64(s, UINT32_MAX, &v))
        return false;
    *out = (uint32_t)v;
    return true;
}

/* --top N: the most likely tokens a scored position lists, 1 to 20 */
static bool parse_top(const char *s, uint32_t *out)
{
    return parse_u32(s, out) && *out >= 1 && *out <= 20;
}

static bool parse_float(const char *s, float *out)
{
    if (!s || !*s)
        return false;
    errno = 0;
    char *end;
    float v = strtof(s, &end);
    if (errno || *end || !isfinite(v))
        return false;
    *out = v;
    return true;
}

/* 1536 -> "1.5 KiB" */
static const char *fmt_bytes(uint64_t n, char *buf, size_t cap)
{
    static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)n;
    size_t u = 0;
    while (v >= 1024.0 && u + 1 < sizeof units / sizeof units[0]) {
        v /= 1024.0;
        u++;
    }
    if (u == 0)
        snprintf(buf, cap, "%llu B", (unsigned long long)n);
    else
        snprintf(buf, cap, "%.1f %s", v, units[u]);
    return buf;
}

/* A session id (32 hex digits), or, for a client command (not `admin`), a reference
 * ENDPOINT#ID: its endpoint is then the one the command connects to (g_ref_endpoint). */
static bool parse_session_for(const char *cmd, const char *arg, bool admin, struct snapkv_session_id *out)
{
    if (snapkv_session_id_from_hex(arg, out) == SNAPKV_OK)
        return true;
    if (arg && strchr(arg, '#')) {
        if (admin)
            fprintf(stderr, "snapkvctl %s: '%s' is a session reference, which names a client endpoint: an admin "
                    "command takes the bare id, and the daemon's admin endpoint with -a\n", cmd, arg);
        else if (snapkv_session_ref_parse(arg, g_ref_endpoint, sizeof g_ref_endpoint, out) == SNAPKV_OK)
            return true; /* (g_ref_endpoint is written only then) */
        else
            fprintf(stderr, "snapkvctl %s: %s\n", cmd, snapkv_last_error());
        return false;
    }
    fprintf(stderr, "snapkvctl %s: '%s' is not a session id (32 hex digits)%s\n", cmd, arg ? arg : "",
            admin ? "" : " or reference (ENDPOINT#ID)");
    return false;
}

static bool parse_session(const char *cmd, const char *arg, struct snapkv_session_id *out)
{
    return parse_session_for(cmd, arg, false, out);
}

static bool parse_admin_session(const char *cmd, const char *arg, struct snapkv_session_id *out)
{
    return parse_session_for(cmd, arg, true, out);
}

static void id_hex(const struct snapkv_session_id *id, char hex[SNAPKV_SESSION_ID_HEX_SIZE])
{
    snapkv_session_id_to_hex(id, hex, SNAPKV_SESSION_ID_HEX_SIZE);
}

/* A reference to session id on the daemon at endpoint ep (ENDPOINT#ID), in ref (cap bytes; an
 * endpoint too long for it leaves just the id). */
static void id_ref(const char *ep, const struct snapkv_session_id *id, char *ref, size_t cap)
{
    if (snapkv_session_ref(ep, id, ref, cap) != SNAPKV_OK) {
        fprintf(stderr, "snapkvctl: the endpoint is too long for a session reference: the bare id instead\n");
        id_hex(id, ref);
    }
}

/* Reads a whole file ("-": stdin) of at most MAX_INPUT_BYTES as a NUL-terminated string; text
 * with a NUL in it (UTF-16, a binary file) is refused, since the NUL would end it there. */
static char *read_text(const char *path)
{
    FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "snapkvctl: %s: %s\n", path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    while (buf) {
        if (len + 1 == cap) {
            if (len > MAX_INPUT_BYTES) { /* the buffer holds one byte more than the limit */
                fprintf(stderr, "snapkvctl: %s: larger than %u bytes\n", path, MAX_INPUT_BYTES);
                free(buf);
                buf = NULL;
                break;
            }
            size_t more = cap * 2 > (size_t)MAX_INPUT_BYTES + 2 ? (size_t)MAX_INPUT_BYTES + 2 : cap * 2;
            char *grown = realloc(buf, more);
            if (!grown) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = grown;
            cap = more;
        }
        size_t n = fread(buf + len, 1, cap - 1 - len, f);
        len += n;
        if (n == 0) {
            if (ferror(f)) {
                fprintf(stderr, "snapkvctl: %s: read error\n", path);
                free(buf);
                buf = NULL;
            }
            break;
        }
    }
    if (buf && len > MAX_INPUT_BYTES) {
        fprintf(stderr, "snapkvctl: %s: larger than %u bytes\n", path, MAX_INPUT_BYTES);
        free(buf);
        buf = NULL;
    } else if (buf && memchr(buf, '\0', len)) {
        fprintf(stderr, "snapkvctl: %s: a NUL byte at %zu: the text must be UTF-8 (UTF-16? binary?)\n", path,
                (size_t)((char *)memchr(buf, '\0', len) - buf));
        free(buf);
        buf = NULL;
    }
    if (buf)
        buf[len] = '\0';
    if (f != stdin)
        fclose(f);
    return buf;
}

/* Options of a subcommand (argv[0] is its name); they may follow the positional arguments. */
static int next_opt(int argc, char **argv, const struct option *opts)
{
    return getopt_long(argc, argv, "", opts, NULL);
}

static void reset_getopt(void)
{
    optind = 0; /* glibc: full re-initialisation */
}

/* One row per layer; NULL when out of memory. */
static json_t *layers_json(const struct snapkv_layer_kept *layers, size_t n, const float *similarity,
                           size_t n_similarity)
{
    json_t *arr = json_array();
    for (size_t i = 0; arr && i < n; i++) {
        const struct snapkv_layer_kept *l = &layers[i];
        json_t *row = json_pack("{s:i, s:i, s:o, s:I}", "layer", (int)l->layer, "kept", (int)l->kept,
                                "kept_per_head", u32_json(l->kept_per_head, l->n_heads), "bytes",
                                (json_int_t)l->bytes);
        if (row && l->positions) {
            json_t *per_head = json_array();
            const uint32_t *p = l->positions;
            for (uint32_t h = 0; per_head && h < l->n_heads; h++) {
                json_push(&per_head, u32_json(p, l->kept_per_head[h]));
                p += l->kept_per_head[h];
            }
            json_put(&row, "positions", per_head);
        }
        if (row && l->blocks_per_head && l->shared_blocks_per_head) {
            json_put(&row, "blocks_per_head", u32_json(l->blocks_per_head, l->n_heads));
            json_put(&row, "shared_blocks_per_head", u32_json(l->shared_blocks_per_head, l->n_heads));
        }
        if (row && similarity && i < n_similarity)
            json_put(&row, "similarity", json_number(similarity[i]));
        json_push(&arr, row);
    }
    return arr;
}

static void print_ratio(const char *what, uint64_t before, uint64_t after)
{
    char a[32], b[32];
    double pct = before ? 100.0 * (double)after / (double)before : 100.0;
    fprintf(stderr, "%s: kv %s of %s (%.1f%%)\n", what, fmt_bytes(after, a, sizeof a), fmt_bytes(before, b, sizeof b),
            pct);
}

/* ---- sampling options shared by generate, chat and decode ------------------------------------------ */

enum {
    OPT_MAX_TOKENS = 1000,
    OPT_TEMPERATURE,
    OPT_TOP_P,
    OPT_TOP_K,
    OPT_SEED,
    OPT_NO_EOS,
    OPT_COMPRESS,
    OPT_PROMPT,
    OPT_FILE,
    OPT_QUESTION,
    OPT_STATS,
    OPT_CHAT,
    OPT_LEASE,
    OPT_REF,
    OPT_NO_REUSE,
    OPT_TURN_TEMPLATE,
    OPT_WINDOW_FROM,
    OPT_OUT,
    OPT_SIZE,
    OPT_POSITIONS,
    OPT_HASHES,
    OPT_TENANT,
    OPT_ALL,
    OPT_PROMETHEUS,
    OPT_STOP,
    OPT_LOGPROBS,
    OPT_TOP,
    OPT_MIN_P,
    OPT_REP_PENALTY,
    OPT_REP_LAST_N,
    OPT_FREQ_PENALTY,
    OPT_PRES_PENALTY,
    OPT_LOGIT_BIAS,
    OPT_APPEND,
    OPT_SKIP_SPECIAL,
    OPT_SCORE,
};

/* --stop TEXT, repeated: the sequences snapkv_sampling.stop points at (optarg stays valid). */
static const char *g_stop[SNAPKV_MAX_STOP];
/* --min-p, the penalties and --logit-bias TOKEN=BIAS (repeated): what snapkv_decode_ext takes
 * besides struct snapkv_sampling */
#define MAX_LOGIT_BIAS 1024
static struct snapkv_sampling_ext g_ext;
static uint32_t g_bias_tokens[MAX_LOGIT_BIAS];
static float g_bias[MAX_LOGIT_BIAS];

#define SAMPLING_OPTIONS                                                                                  \
    {"max-tokens", required_argument, NULL, OPT_MAX_TOKENS},                                              \
        {"temperature", required_argument, NULL, OPT_TEMPERATURE},                                        \
        {"top-p", required_argument, NULL, OPT_TOP_P}, {"top-k", required_argument, NULL, OPT_TOP_K},     \
        {"seed", required_argument, NULL, OPT_SEED}, {"no-eos", no_argument, NULL, OPT_NO_EOS},           \
        {"stop", required_argument, NULL, OPT_STOP}, {"min-p", required_argument, NULL, OPT_MIN_P},        \
        {"repetition-penalty", required_argument, NULL, OPT_REP_PENALTY},                                 \
        {"repetition-last-n", required_argument, NULL, OPT_REP_LAST_N},                                   \
        {"frequency-penalty", required_argument, NULL, OPT_FREQ_PENALTY},                                 \
        {"presence-penalty", required_argument, NULL, OPT_PRES_PENALTY},                                  \
        {"logit-bias", required_argument, NULL, OPT_LOGIT_BIAS}

/* Applies one sampling option; returns 1 when o is one, 0 when not, 2 on a bad value. */
static int sampling_opt(const char *cmd, int o, struct snapkv_sampling *s)
{
    uint64_t seed;
    switch (o) {
    case OPT_MAX_TOKENS:
        if (!parse_u32(optarg, &s->max_tokens) || s->max_tokens == 0)
            return usage_error(cmd, "--max-tokens wants a positive integer, not '%s'", optarg);
        return 1;
    case OPT_TEMPERATURE:
        if (!parse_float(optarg, &s->temperature) || !(s->temperature >= 0.0f && s->temperature <= 100.0f))
            return usage_error(cmd, "--temperature wants a number in [0, 100], not '%s'", optarg);
        return 1;
    case OPT_TOP_P:
        if (!parse_float(optarg, &s->top_p) || s->top_p < 0.0f || s->top_p > 1.0f)
            return usage_error(cmd, "--top-p wants a number in [0, 1], not '%s'", optarg);
        return 1;
    case OPT_TOP_K:
        if (!parse_u32(optarg, &s->top_k))
            return usage_error(cmd, "--top-k wants an integer, not '%s'", optarg);
        return 1;
    case OPT_SEED:
        if (!parse_u64(optarg, UINT64_MAX, &seed))
            return usage_error(cmd, "--seed wants an integer, not '%s'", optarg);
        s->seed = seed;
        return 1;
    case OPT_NO_EOS:
        s->stop_at_eos = false;
        return 1;
    case OPT_STOP:
        if (!*optarg || strlen(optarg) > 256)
            return usage_error(cmd, "--stop wants 1 to 256 bytes of text");
        if (s->n_stop == SNAPKV_MAX_STOP)
            return usage_error(cmd, "at most %d --stop sequences", SNAPKV_MAX_STOP);
        g_stop[s->n_stop++] = optarg;
        s->stop = g_stop;
        return 1;
    case OPT_MIN_P:
        if (!parse_float(optarg, &g_ext.min_p) || !(g_ext.min_p >= 0.0f && g_ext.min_p <= 1.0f))
            return usage_error(cmd, "--min-p wants a number in [0, 1], not '%s'", optarg);
        return 1;
    case OPT_REP_PENALTY:
        if (!parse_float(optarg, &g_ext.repetition_penalty) ||
            !(g_ext.repetition_penalty >= 0.01f && g_ext.repetition_penalty <= 100.0f))
            return usage_error(cmd, "--repetition-penalty wants a number from 0.01 to 100, not '%s'", optarg);
        return 1;
    case OPT_REP_LAST_N:
        if (!parse_u32(optarg, &g_ext.repetition_last_n))
            return usage_error(cmd, "--repetition-last-n wants an integer, not '%s'", optarg);
        return 1;
    case OPT_FREQ_PENALTY:
    case OPT_PRES_PENALTY: {
        float *v = o == OPT_FREQ_PENALTY ? &g_ext.frequency_penalty : &g_ext.presence_penalty;
        if (!parse_float(optarg, v) || !(*v >= -2.0f && *v <= 2.0f))
            return usage_error(cmd, "--%s wants a number in [-2, 2], not '%s'",
                               o == OPT_FREQ_PENALTY ? "frequency-penalty" : "presence-penalty", optarg);
        return 1;
    }
    case OPT_LOGIT_BIAS: {
        if (g_ext.n_bias == MAX_LOGIT_BIAS)
            return usage_error(cmd, "at most %d --logit-bias", MAX_LOGIT_BIAS);
        const char *eq = strchr(optarg, '=');
        char tok[16];
        size_t n = eq ? (size_t)(eq - optarg) : 0;
        if (n)
            snprintf(tok, sizeof tok, "%.*s", (int)(n < sizeof tok ? n : sizeof tok - 1), optarg);
        float b;
        if (!n || n >= sizeof tok || !parse_u32(tok, &g_bias_tokens[g_ext.n_bias]) || !parse_float(eq + 1, &b) ||
            !(b >= -100.0f && b <= 100.0f))
            return usage_error(cmd, "--logit-bias wants TOKEN=BIAS (a token id, a number in [-100, 100]), not '%s'",
                               optarg);
        g_bias[g_ext.n_bias++] = b;
        g_ext.bias_tokens = g_bias_tokens;
        g_ext.bias = g_bias;
        return 1;
    }
    default:
        return 0;
    }
}

static void sampling_init(struct snapkv_sampling *s)
{
    snapkv_sampling_defaults(s);
    snapkv_sampling_ext_defaults(&g_ext);
    s->max_tokens = DEFAULT_MAX_TOKENS;
    s->seed = (uint64_t)time(NULL);
}

/* Set by SIGINT (Ctrl-C) while generate or chat runs: a running answer stops (libsnapkv
 * cancels it in the daemon) and the session is released before the command ends, instead of
 * staying for its lease and counting against the tenant's limits. libsnapkv's calls are not
 * ended by signals, so a prefill finishes first; a second Ctrl-C before that ends the program
 * at once. */
static volatile sig_atomic_t g_interrupted;

static void on_sigint(int sig)
{
    if (g_interrupted) { /* a second Ctrl-C before the first took effect (a hung daemon): now */
        signal(sig, SIG_DFL);
        raise(sig);
    }
    g_interrupted = 1;
}

/* SIGINT sets g_interrupted from now on (no SA_RESTART: a read of the terminal returns). */
static void catch_sigint(void)
{
    struct sigaction sa = {.sa_handler = on_sigint};
    sigemptyset(&sa.sa_mask);
    g_interrupted = 0;
    sigaction(SIGINT, &sa, NULL);
}

/* Streams decoded text to stdout. */
static int print_tokens(void *user, const uint32_t *tokens, size_t n, const char *text)
{
    (void)user;
    (void)tokens;
    (void)n;
    fputs(text, stdout);
    fflush(stdout);
    return g_interrupted ? 1 : 0; /* libsnapkv then ends the decode in the daemon (CANCEL) */
}

/* The same without printing (--json collects the text). */
static int until_interrupted(void *user, const uint32_t *tokens, size_t n, const char *text)
{
    (void)user;
    (void)tokens;
    (void)n;
    (void)text;
    return g_interrupted ? 1 : 0;
}

/* Prefill progress, on a terminal only. */
static void show_progress(void *user, uint32_t done, uint32_t total)
{
    (void)user;
    if (!isatty(STDERR_FILENO))
        return;
    if (total)
        fprintf(stderr, "\rprefill %u / %u tokens", done, total);
    else
        fprintf(stderr, "\rprefill %u tokens", done);
    fflush(stderr);
}

static void end_progress(void)
{
    if (isatty(STDERR_FILENO))
        fputs("\r\033[K", stderr);
}

/* ---- info, status, config --------------------------------------------------------------------------------- */

/* A token id of HELLO's; null for SNAPKV_NO_TOKEN (the model has none; before, -1 came out). */
static json_t *token_json(uint32_t id)
{
    return id == SNAPKV_NO_TOKEN ? json_null() : json_integer((json_int_t)id);
}

static int cmd_info(const struct ctl *c)
{
    snapkv_client_t *cl = NULL;
    if (connect_to(c, false, &cl))
        return 1;
    struct snapkv_server_info in;
    snapkv_server_info(cl, &in);
    int ret = 0;
    if (c->json) {
        ret = print_json(json_pack(
            "{s:o, s:o, s:o, s:o, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:o, s:o, s:I, s:I, s:i, s:i}", "server_version",
            json_text(in.server_version), "model", json_text(in.model_name), "fingerprint",
            json_text(in.model_fingerprint), "backend", json_text(in.backend), "layers", in.n_layers, "heads",
            in.n_heads, "kv_heads", in.n_kv_heads, "head_dim", in.head_dim, "vocab", in.n_vocab, "max_prompt_tokens",
            in.max_prompt_tokens, "max_new_tokens", in.max_new_tokens, "bos_token", token_json(in.bos_token),
            "eos_token", token_json(in.eos_token), "max_message_bytes", (json_int_t)in.max_message_bytes,
            "max_bytes_per_tenant",
            (json_int_t)in.max_bytes_per_tenant, "max_sessions_per_tenant", in.max_sessions_per_tenant,
            "kv_block_tokens", in.kv_block_tokens));
    } else {
        char b[32];
        printf("server      snapkvd %s (%s backend)\n", in.server_version, in.backend);
        printf("model       %s\n", in.model_name);
        printf("fingerprint %s\n", in.model_fingerprint);
        printf("shape       %u layers, %u heads, %u kv heads, head dim %u, vocab %u\n", in.n_layers, in.n_heads,
               in.n_kv_heads, in.head_dim, in.n_vocab);
        printf("limits      prompt %u tokens, %u new tokens, %u sessions and %s per tenant\n", in.max_prompt_tokens,
               in.max_new_tokens, in.max_sessions_per_tenant, fmt_bytes(in.max_bytes_per_tenant, b, sizeof b));
    }
    snapkv_close(&cl);
    return ret;
}

static int cmd_status(const struct ctl *c)
{
    snapkv_client_t *cl = NULL;
    if (connect_to(c, true, &cl))
        return 1;
    struct snapkv_status_info s;
    int rc = snapkv_admin_status(cl, &s);
    /* what the pool holds besides sessions: the kept prefixes (STATS; 0 from a daemon without) */
    double kept = 0, kept_bytes = 0;
    struct snapkv_stats st;
    bool kept_known = false; /* a STATS that failed says nothing of them (not 0) */
    if (!rc && snapkv_admin_stats(cl, false, &st) == SNAPKV_OK) {
        kept_known = true;
        for (size_t i = 0; i < st.n; i++)
            if (strcmp(st.stats[i].name, "snapkv_prefix_retained") == 0)
                kept = st.stats[i].value;
            else if (strcmp(st.stats[i].name, "snapkv_prefix_retained_bytes") == 0)
                kept_bytes = st.stats[i].value;
        snapkv_stats_free(&st);
    } else if (!rc) {
        fprintf(stderr, "snapkvctl: status: the kept prefixes are not known: STATS failed: %s\n",
                snapkv_last_error());
    }
    snapkv_close(&cl);
    if (rc)
        return failed("status", rc);
    if (c->json) {
        json_t *o = json_pack(
            "{s:o, s:o, s:o, s:I, s:i, s:i, s:I, s:I, s:I, s:I, s:i, s:I, s:i, s:i}", "server_version",
            json_text(s.server_version), "model", json_text(s.model_name), "backend", json_text(s.backend),
            "uptime_seconds", (json_int_t)s.uptime_seconds, "sessions", s.n_sessions, "clients", s.n_clients,
            "pool_bytes_total", (json_int_t)s.pool_bytes_total, "pool_bytes_used", (json_int_t)s.pool_bytes_used,
            "pool_blocks_used", (json_int_t)s.pool_blocks_used, "pool_blocks_shared", (json_int_t)s.pool_blocks_shared,
            "pool_block_rows", (int)s.pool_block_rows, "pool_block_bytes", (json_int_t)s.pool_block_bytes,
            "queue_depth", s.queue_depth, "threads", s.threads);
        json_put(&o, "kept_prefixes", kept_known ? json_integer((json_int_t)kept) : json_null());
        json_put(&o, "kept_prefix_bytes", kept_known ? json_integer((json_int_t)kept_bytes) : json_null());
        return print_json(o);
    } else {
        char a[32], b[32];
        printf("snapkvd %s, model %s, backend %s (%u threads)\n", s.server_version, s.model_name, s.backend,
               s.threads);
        printf("uptime %llu s, %u sessions, %u clients, queue %u\n", (unsigned long long)s.uptime_seconds,
               s.n_sessions, s.n_clients, s.queue_depth);
        printf("pool %s used of %s: %llu blocks of %u tokens (%llu shared copy-on-write)\n",
               fmt_bytes(s.pool_bytes_used, a, sizeof a), fmt_bytes(s.pool_bytes_total, b, sizeof b),
               (unsigned long long)s.pool_blocks_used, s.pool_block_rows,
               (unsigned long long)s.pool_blocks_shared);
        if (kept > 0)
            printf("kept prefixes %.0f, %s of blocks (prefix-retain-bytes; list --kept)\n", kept,
                   fmt_bytes((uint64_t)kept_bytes, a, sizeof a));
    }
    return 0;
}

struct config_rows {
    bool json;
    json_t *arr;    /* --json: the rows so far; NULL once one could not be added */
};

static void config_row(void *user, const char *key, const char *value, const char *help)
{
    struct config_rows *rows = user;
    if (rows->json)
        json_push(&rows->arr, json_pack("{s:o, s:o, s:o}", "key", json_text(key), "value", json_text(value),
                                        "help", json_text(help)));
    else
        printf("%-26s %-40s # %s\n", key, value, help);
}

static int cmd_config(const struct ctl *c, const char *key)
{
    snapkv_client_t *cl = NULL;
    if (connect_to(c, true, &cl))
        return 1;
    struct config_rows rows = {.json = c->json, .arr = c->json ? json_array() : NULL};
    int rc = snapkv_admin_config_get(cl, key, config_row, &rows);
    snapkv_close(&cl);
    if (rc) {
        json_decref(rows.arr);
        return failed("config", rc);
    }
    return c->json ? print_json(rows.arr) : 0;
}

/* ---- generate, chat ------------------------------------------------------------------------------------------- */

/* A decode that another client's CANCEL or the daemon's stop ended, or that had no room for
 * another token: said on stderr, exit status 3, so that a script tells a cut answer from a
 * finished one (the JSON's finish_reason says it too). */
static int decode_cut(const char *cmd, const struct snapkv_decode_result *dr)
{
    bool limit = strcmp(dr->finish_reason, "limit") == 0;
    if (strcmp(dr->finish_reason, "error") == 0) {
        fprintf(stderr, "snapkvctl %s: %s\n", cmd, snapkv_last_error());
        return 3;
    }
    if (!limit && strcmp(dr->finish_reason, "cancelled") != 0)
        return 0;
    fprintf(stderr, "snapkvctl %s: the decode %s after %zu token(s) (%s)%s\n", cmd, limit ? "stopped" : "was cancelled",
            dr->n_tokens,
            limit ? "the tenant's max-bytes-per-tenant or the pool had no room for another" : "a CANCEL, or the daemon "
                                                                                               "stopping",
            strcmp(cmd, "decode") == 0 ? "; the session keeps them" : "");
    return 3;
}

static int cmd_generate(const struct ctl *c, int argc, char **argv)
{
    static const struct option opts[] = {
        {"prompt", required_argument, NULL, OPT_PROMPT}, {"file", required_argument, NULL, OPT_FILE},
        {"question", required_argument, NULL, OPT_QUESTION}, {"compress", required_argument, NULL, OPT_COMPRESS},
        {"stats", no_argument, NULL, OPT_STATS}, SAMPLING_OPTIONS, {NULL, 0, NULL, 0},
    };
    const char *prompt = NULL, *file = NULL, *question = NULL, *spec = NULL;
    bool stats = false;
    struct snapkv_sampling s;
    sampling_init(&s);
    int o;
    reset_getopt();
    while ((o = next_opt(argc, argv, opts)) != -1) {
        int r = sampling_opt("generate", o, &s);
        if (r == 2)
            return 2;
        if (r == 1)
            continue;
        switch (o) {
        case OPT_PROMPT: prompt = optarg; break;
        case OPT_FILE: file = optarg; break;
        case OPT_QUESTION: question = optarg; break;
        case OPT_COMPRESS: spec = optarg; break;
        case OPT_STATS: stats = true; break;
        default: return usage_error("generate", "unknown option");
        }
    }
    if (optind != argc)
        return usage_error("generate", "unexpected argument '%s'", argv[optind]);
    if (!prompt == !file)
        return usage_error("generate", "give exactly one of --prompt and --file");

    int ret = 1;
    char *doc = file ? read_text(file) : strdup(prompt);
    char *text = NULL;
    snapkv_client_t *cl = NULL;
    if (!doc)
        return 1;
    /* the document and the question go in as one user turn */
    size_t len = strlen(doc) + (question ? strlen(question) + 2 : 0) + 1;
    text = malloc(len);
    if (!text) {
        fprintf(stderr, "snapkvctl: out of memory\n");
        goto out_free;
    }
    snprintf(text, len, "%s%s%s", doc, question ? "\n\n" : "", question ? question : "");
    if (connect_to(c, false, &cl))
        goto out_free;

    catch_sigint();
    struct snapkv_prefill_opts po = {.text = text, .chat = true, .compress = spec, .progress = show_progress};
    struct snapkv_prefill_result pr;
    int rc = snapkv_prefill(cl, &po, &pr);
    end_progress();
    if (rc) {
        failed("prefill", rc);
        goto out_close;
    }
    struct snapkv_decode_result dr;
    rc = g_interrupted ? SNAPKV_E_CANCELLED
                       : snapkv_decode_ext(cl, &pr.id, &s, &g_ext, 0, c->json ? until_interrupted : print_tokens,
                                           NULL, &dr, NULL);
    if (rc == SNAPKV_E_CANCELLED && g_interrupted) { /* another error after Ctrl-C is that error */
        if (!c->json)
            putchar('\n');
        fprintf(stderr, "snapkvctl generate: interrupted\n");
        ret = 130; /* as a shell reports a command SIGINT ended */
    } else if (rc) {
        if (!c->json)
            putchar('\n');
        failed("decode", rc);
    } else {
        ret = 0;
        if (c->json) {
            char hex[SNAPKV_SESSION_ID_HEX_SIZE];
            id_hex(&pr.id, hex);
            ret = print_json(json_pack("{s:s, s:o, s:o, s:o, s:i, s:I, s:I, s:o}", "session", hex, "text",
                                       json_text(dr.text), "tokens", u32_json(dr.tokens, dr.n_tokens),
                                       "finish_reason", json_text(dr.finish_reason), "prompt_tokens", pr.n_tokens,
                                       "kv_bytes_before", (json_int_t)pr.bytes_before, "kv_bytes_after",
                                       (json_int_t)pr.bytes_after, "compress", json_text(spec)));
        } else {
            putchar('\n');
            if (stats) {
                fprintf(stderr, "prompt %u tokens, generated %zu (%s)\n", pr.n_tokens, dr.n_tokens,
                        dr.finish_reason);
                print_ratio("compression", pr.bytes_before, pr.bytes_after);
            }
        }
        ret = ret ? ret : decode_cut("generate", &dr);
        snapkv_decode_result_free(&dr);
    }
    rc = snapkv_release(cl, &pr.id);
    if (rc) {
        failed("release", rc);
        ret = ret ? ret : 1;
    }
    snapkv_prefill_result_free(&pr);

out_close:
    snapkv_close(&cl);
out_free:
    free(text);
    free(doc);
    return ret;
}

/* Appends a later chat turn: the template's markup around its first %s (parsed: <|im_start|>
 * ... are special tokens) and the typed line in its place as plain text, so a line that holds
 * markup cannot end the turn or open a system one (sent whole with markup parsing, it could). */
static int append_turn(snapkv_client_t *cl, const struct snapkv_session_id *id, const char *tmpl, const char *line)
{
    const char *at = strstr(tmpl, "%s");
    size_t head = at ? (size_t)(at - tmpl) : strlen(tmpl);
    char *markup = strndup(tmpl, head);
    if (!markup) {
        fprintf(stderr, "snapkvctl: out of memory\n");
        return SNAPKV_E_NOMEM;
    }
    const char *parts[3] = {markup, line, at ? at + 2 : ""};
    int rc = SNAPKV_OK;
    for (int i = 0; i < 3 && !rc; i++)
        if (*parts[i])
            rc = snapkv_append(cl, id, &(struct snapkv_append_opts){.text = parts[i], .chat = i != 1}, NULL);
    free(markup);
    return rc;
}

static int cmd_chat(const struct ctl *c, int argc, char **argv)
{
    static const struct option opts[] = {
        {"compress", required_argument, NULL, OPT_COMPRESS},
        {"turn-template", required_argument, NULL, OPT_TURN_TEMPLATE},
        {"stats", no_argument, NULL, OPT_STATS},
        SAMPLING_OPTIONS,
        {NULL, 0, NULL, 0},
    };
    const char *spec = NULL, *tmpl = DEFAULT_TURN_TEMPLATE;
    bool stats = false;
    struct snapkv_sampling s;
    sampling_init(&s);
    int o;
    reset_getopt();
    while ((o = next_opt(argc, argv, opts)) != -1) {
        int r = sampling_opt("chat", o, &s);
        if (r == 2)
            return 2;
        if (r == 1)
            continue;
        switch (o) {
        case OPT_COMPRESS: spec = optarg; break;
        case OPT_TURN_TEMPLATE: tmpl = optarg; break;
        case OPT_STATS: stats = true; break;
        default: return usage_error("chat", "unknown option");
        }
    }
    if (optind != argc)
        return usage_error("chat", "unexpected argument '%s'", argv[optind]);
    if (c->json) /* its turns are text as they come */
        return usage_error("chat", "--json is not for chat (generate --json answers one prompt in JSON)");
    if (!strstr(tmpl, "%s"))
        return usage_error("chat", "--turn-template needs a %%s for the user's line");

    snapkv_client_t *cl = NULL;
    if (connect_to(c, false, &cl))
        return 1;
    bool tty = isatty(STDIN_FILENO);
    if (tty)
        fprintf(stderr, "chat with snapkvd: one line per turn, Ctrl-C stops an answer (at the prompt: the chat), "
                        "end with Ctrl-D\n");
    bool have_session = false;
    struct snapkv_session_id id;
    int ret = 0;
    char *line = NULL;
    size_t cap = 0;
    /* Ctrl-C: during a turn, stops its answer (the session keeps what was said); at the prompt,
     * ends the chat, its session released */
    catch_sigint();
    for (;;) {
        if (tty)
            fputs("> ", stderr);
        g_interrupted = 0;
        ssize_t n = getline(&line, &cap, stdin);
        if (n < 0) {
            if (g_interrupted) {
                fputc('\n', stderr);
                ret = 130;
            }
            break;
        }
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
            line[--n] = '\0';
        if (n == 0)
            continue;
        if (strcmp(line, "/quit") == 0 || strcmp(line, "/exit") == 0)
            break;
        int rc;
        if (!have_session) {
            struct snapkv_prefill_opts po = {.text = line, .chat = true, .compress = spec, .progress = show_progress};
            struct snapkv_prefill_result pr;
            rc = snapkv_prefill(cl, &po, &pr);
            end_progress();
            if (rc) {
                ret = failed("prefill", rc);
                break;
            }
            id = pr.id;
            have_session = true;
            if (stats)
                print_ratio("prefill", pr.bytes_before, pr.bytes_after);
            snapkv_prefill_result_free(&pr);
        } else {
            rc = append_turn(cl, &id, tmpl, line);
            if (rc) {
                ret = failed("append", rc);
                break;
            }
        }
        if (g_interrupted) { /* during the prefill or append: no answer */
            fprintf(stderr, "[stopped]\n");
            continue;
        }
        struct snapkv_decode_result dr;
        rc = snapkv_decode_ext(cl, &id, &s, &g_ext, 0, print_tokens, NULL, &dr, NULL);
        putchar('\n');
        fflush(stdout);
        if (rc == SNAPKV_E_CANCELLED && g_interrupted) {
            /* print_tokens stopped the answer at the token after Ctrl-C, and libsnapkv ended it in
             * the daemon (a signal no longer ends libsnapkv's waits: before the first token, Ctrl-C
             * takes effect when it comes) */
            fprintf(stderr, "[stopped]\n");
            continue;
        }
        if (rc) {
            ret = failed("decode", rc);
            break;
        }
        if (stats)
            fprintf(stderr, "[%zu tokens, %s]\n", dr.n_tokens, dr.finish_reason);
        int cut = decode_cut("chat", &dr); /* the daemon stopping, or no room: no next turn */
        snapkv_decode_result_free(&dr);
        if (cut) {
            ret = cut;
            break;
        }
    }
    free(line);
    if (have_session) {
        int rc = snapkv_release(cl, &id);
        if (rc)
            ret = failed("release", rc);
    }
    snapkv_close(&cl);
    return ret;
}

/* ---- prefill, append, decode, compress, fork, release ------------------------------------------------------- */

/* The scores' sum, in nats. */
static double scores_sum(const struct snapkv_scores *sc)
{
    double sum = 0;
    for (size_t i = 0; i < sc->n_logprobs; i++)
        sum += sc->logprobs[i];
    return sum;
}

/* How many scored tokens were the model's most likely there. */
static size_t scores_greedy(const struct snapkv_scores *sc)
{
    size_t skip = sc->n_tokens - sc->n_logprobs, k = 0; /* 1 for a prefill: its first token has none */
    for (size_t i = 0; i < sc->n_logprobs; i++)
        k += sc->top_tokens[i] == sc->tokens[skip + i];
    return k;
}

static json_t *top_logprobs_json(const struct snapkv_logprobs *lp);
static json_t *logprob_json(float x);

/* x as a JSON number; null when it is not finite (JSON has no infinity: a token of probability
 * 0 scored, and the sum and perplexity then). */
static json_t *finite_json(double x)
{
    return isfinite(x) ? json_real(x) : json_null();
}

/* A prompt's scores in a JSON reply j (taken): prompt_logprobs, scored_tokens (a prefill's from
 * the second on), top_tokens (the most likely there), their sum, how many were the most likely
 * (greedy) and the perplexity exp(-sum / n); with best (n_top > 0), top_logprobs: each scored
 * position's most likely tokens. A log-probability that is not finite is null, in its place
 * (before, jansson refused it and the list came out shorter than scored_tokens, the sum and
 * perplexity gone); NULL when out of memory. */
static json_t *scores_json(json_t *j, const struct snapkv_scores *sc, const struct snapkv_logprobs *best)
{
    json_t *lp = json_array(), *tok = json_array(), *top = json_array();
    const double sum = scores_sum(sc);
    size_t skip = sc->n_tokens - sc->n_logprobs; /* 1 for a prefill: its first token has none */
    for (size_t i = 0; i < sc->n_logprobs && lp && tok && top; i++) {
        json_push(&lp, logprob_json(sc->logprobs[i]));
        json_push(&tok, json_integer(sc->tokens[skip + i]));
        json_push(&top, json_integer(sc->top_tokens[i]));
    }
    json_put(&j, "prompt_logprobs", lp);
    if (j)
        json_put(&j, "scored_tokens", tok);
    else
        json_decref(tok);
    if (j)
        json_put(&j, "top_tokens", top);
    else
        json_decref(top);
    if (j)
        json_put(&j, "greedy", json_integer((json_int_t)scores_greedy(sc)));
    if (j)
        json_put(&j, "sum_logprob", finite_json(sum));
    if (j)
        json_put(&j, "perplexity", sc->n_logprobs ? finite_json(exp(-sum / (double)sc->n_logprobs)) : json_null());
    if (j && best->n_top)
        json_put(&j, "top_logprobs", top_logprobs_json(best));
    return j;
}

static void print_logprob_lines(FILE *f, const uint32_t *tokens, const struct snapkv_logprobs *lp);

/* The scores' sum and perplexity, on stderr; with top (n_top > 0), a line for each scored token
 * there too. */
static void print_scores(const struct snapkv_scores *sc, const struct snapkv_logprobs *top)
{
    const double sum = scores_sum(sc);
    if (top->n_top)
        print_logprob_lines(stderr, sc->tokens + (sc->n_tokens - sc->n_logprobs), top);
    if (sc->n_logprobs)
        fprintf(stderr, "scored %zu tokens: sum log-probability %.4f, %.4f nats a token, perplexity %.4f; %zu were "
                "the model's most likely\n", sc->n_logprobs, sum, -sum / (double)sc->n_logprobs,
                exp(-sum / (double)sc->n_logprobs), scores_greedy(sc));
    else
        fprintf(stderr, "scored no token (a one-token prompt has none to score)\n");
}

static int cmd_prefill(const struct ctl *c, int argc, char **argv)
{
    static const struct option opts[] = {
        {"prompt", required_argument, NULL, OPT_PROMPT}, {"file", required_argument, NULL, OPT_FILE},
        {"compress", required_argument, NULL, OPT_COMPRESS}, {"chat", no_argument, NULL, OPT_CHAT},
        {"lease", required_argument, NULL, OPT_LEASE}, {"ref", no_argument, NULL, OPT_REF},
        {"no-reuse", no_argument, NULL, OPT_NO_REUSE}, {"score", no_argument, NULL, OPT_SCORE},
        {"top", required_argument, NULL, OPT_TOP}, {NULL, 0, NULL, 0},
    };
    const char *prompt = NULL, *file = NULL, *spec = NULL;
    bool chat = false, as_ref = false, no_reuse = false, score = false;
    uint32_t lease = 0, top_n = 0;
    int o;
    reset_getopt();
    while ((o = next_opt(argc, argv, opts)) != -1) {
        switch (o) {
        case OPT_PROMPT: prompt = optarg; break;
        case OPT_FILE: file = optarg; break;
        case OPT_COMPRESS: spec = optarg; break;
        case OPT_CHAT: chat = true; break;
        case OPT_REF: as_ref = true; break;
        case OPT_NO_REUSE: no_reuse = true; break;
        case OPT_SCORE: score = true; break;
        case OPT_TOP:
            if (!parse_top(optarg, &top_n))
                return usage_error("prefill", "--top wants an integer from 1 to 20, not '%s'", optarg);
            score = true;
            break;
        case OPT_LEASE:
            if (!parse_u32(optarg, &lease))
                return usage_error("prefill", "--lease wants seconds, not '%s'", optarg);
            break;
        default: return usage_error("prefill", "unknown option");
        }
    }
    if (optind != argc)
        return usage_error("prefill", "unexpected argument '%s'", argv[optind]);
    if (!prompt == !file)
        return usage_error("prefill", "give exactly one of --prompt and --file");
    char *text = file ? read_text(file) : strdup(prompt);
    if (!text)
        return 1;
    snapkv_client_t *cl = NULL;
    int ret = 1;
    if (connect_to(c, false, &cl))
        goto out_free;
    struct snapkv_prefill_opts po = {
        .text = text, .chat = chat, .compress = spec, .lease_seconds = lease, .progress = show_progress};
    struct snapkv_prefill_result pr;
    struct snapkv_scores sc = {0};
    struct snapkv_logprobs top = {0};
    uint32_t reused = 0;
    unsigned flags = no_reuse ? SNAPKV_PREFILL_NO_PREFIX_REUSE : 0;
    int rc = score ? snapkv_prefill_scored_top(cl, &po, flags, top_n, &pr, &sc, &top)
                   : snapkv_prefill_flags(cl, &po, flags, &pr, &reused);
    end_progress();
    if (rc) {
        failed("prefill", rc);
        goto out_close;
    }
    char hex[SNAPKV_SESSION_ID_HEX_SIZE], ref[sizeof g_ref_endpoint + SNAPKV_SESSION_ID_HEX_SIZE];
    id_hex(&pr.id, hex);
    id_ref(c->endpoint, &pr.id, ref, sizeof ref);
    ret = 0;
    if (c->json) {
        json_t *j = json_pack("{s:s, s:s, s:i, s:i, s:I, s:I, s:i, s:o}", "session", hex, "ref", ref, "n_tokens",
                              pr.n_tokens, "reused_tokens", reused, "bytes_before", (json_int_t)pr.bytes_before,
                              "bytes_after", (json_int_t)pr.bytes_after, "next_token", pr.next_token, "layers",
                              layers_json(pr.layers, pr.n_layers, NULL, 0));
        ret = print_json(score ? scores_json(j, &sc, &top) : j);
    } else {
        puts(as_ref ? ref : hex);
        if (reused)
            fprintf(stderr, "%u prompt tokens (%u of them reused from another session)\n", pr.n_tokens, reused);
        else
            fprintf(stderr, "%u prompt tokens\n", pr.n_tokens);
        print_ratio("prefill", pr.bytes_before, pr.bytes_after);
        if (score)
            print_scores(&sc, &top);
    }
    snapkv_logprobs_free(&top);
    snapkv_scores_free(&sc);
    snapkv_prefill_result_free(&pr);
out_close:
    snapkv_close(&cl);
out_free:
    free(text);
    return ret;
}

static int cmd_append(const struct ctl *c, int argc, char **argv)
{
    static const struct option opts[] = {
        {"file", required_argument, NULL, OPT_FILE}, {"score", no_argument, NULL, OPT_SCORE},
        {"top", required_argument, NULL, OPT_TOP}, {NULL, 0, NULL, 0}};
    const char *file = NULL;
    bool score = false;
    uint32_t top_n = 0;
    int o;
    reset_getopt();
    while ((o = next_opt(argc, argv, opts)) != -1) {
        switch (o) {
        case OPT_FILE: file = optarg; break;
        case OPT_SCORE: score = true; break;
        case OPT_TOP:
            if (!parse_top(optarg, &top_n))
                return usage_error("append", "--top wants an integer from 1 to 20, not '%s'", optarg);
            score = true;
            break;
        default: return usage_error("append", "unknown option");
        }
    }
    if (argc - optind != (file ? 1 : 2))
        return usage_error("append", "usage: append SESSION (TEXT | --file F) [--score] [--top N]");
    struct snapkv_session_id id;
    if (!parse_session("append", argv[optind], &id))
        return 2;
    char *text = file ? read_text(file) : strdup(argv[optind + 1]);
    if (!text)
        return 1;
    snapkv_client_t *cl = NULL;
    if (connect_to(c, false, &cl)) {
        free(text);
        return 1;
    }
    struct snapkv_append_result ar;
    struct snapkv_scores sc = {0};
    struct snapkv_logprobs top = {0};
    const struct snapkv_append_opts ao = {.text = text};
    int rc = score ? snapkv_append_scored_top(cl, &id, &ao, top_n, &ar, &sc, &top) : snapkv_append(cl, &id, &ao, &ar);
    snapkv_close(&cl);
    free(text);
    if (rc)
        return failed("append", rc);
    int ret = 0;
    if (c->json) {
        json_t *j = json_pack("{s:s, s:i, s:i}", "session", argv[optind], "n_tokens", ar.n_tokens, "next_token",
                              ar.next_token);
        ret = print_json(score ? scores_json(j, &sc, &top) : j);
    } else {
        printf("session length %u tokens\n", ar.n_tokens);
        if (score)
            print_scores(&sc, &top);
    }
    snapkv_logprobs_free(&top);
    snapkv_scores_free(&sc);
    snapkv_append_result_free(&ar);
    return ret;
}

/* tokenize (TEXT | --file F) [--chat] [--append]: the ids, space-separated (JSON: tokens, n_tokens). */
static int cmd_tokenize(const struct ctl *c, int argc, char **argv)
{
    static const struct option opts[] = {{"file", required_argument, NULL, OPT_FILE},
                                         {"chat", no_argument, NULL, OPT_CHAT},
                                         {"append", no_argument, NULL, OPT_APPEND},
                                         {NULL, 0, NULL, 0}};
    const char *file = NULL;
    struct snapkv_tokenize_opts to = {0};
    int o;
    reset_getopt();
    while ((o = next_opt(argc, argv, opts)) != -1) {
        switch (o) {
        case OPT_FILE: file = optarg; break;
        case OPT_CHAT: to.chat = true; break;
        case OPT_APPEND: to.append = true; break;
        default: return usage_error("tokenize", "unknown option");
        }
    }
    if ((file != NULL) == (optind + 1 == argc) || optind + 1 < argc)
        return usage_error("tokenize", "usage: tokenize (TEXT | --file F) [--chat] [--append]");
    char *text = file ? read_text(file) : strdup(argv[optind]);
    if (!text) {
        if (!file)
            fprintf(stderr, "snapkvctl: out of memory\n");
        return 1;
    }
    snapkv_client_t *cl = NULL;
    if (connect_to(c, false, &cl)) {
        free(text);
        return 1;
    }
    struct snapkv_tokens t;
    int rc = snapkv_tokenize(cl, text, &to, &t);
    snapkv_close(&cl);
    free(text);
    if (rc)
        return failed("tokenize", rc);
    int ret = 0;
    if (c->json) {
        ret = print_json(json_pack("{s:o, s:I}", "tokens", u32_json(t.tokens, t.n_tokens), "n_tokens",
                                   (json_int_t)t.n_tokens));
    } else {
        for (size_t i = 0; i < t.n_tokens; i++)
            printf("%s%u", i ? " " : "", t.tokens[i]);
        putchar('\n');
    }
    snapkv_tokens_free(&t);
    return ret;
}

/* detokenize ID... [--skip-special]: the ids' text (JSON: text). */
static int cmd_detokenize(const struct ctl *c, int argc, char **argv)
{
    static const struct option opts[] = {{"skip-special", no_argument, NULL, OPT_SKIP_SPECIAL},
                                         {NULL, 0, NULL, 0}};
    bool skip = false;
    int o;
    reset_getopt();
    while ((o = next_opt(argc, argv, opts)) != -1) {
        if (o != OPT_SKIP_SPECIAL)
            return usage_error("detokenize", "unknown option");
        skip = true;
    }
    size_t n = (size_t)(argc - optind);
    if (n == 0)
        return usage_error("detokenize", "usage: detokenize ID... [--skip-special]");
    uint32_t *ids = malloc(n * sizeof *ids);
    if (!ids) {
        fprintf(stderr, "snapkvctl: out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < n; i++)
        if (!parse_u32(argv[optind + (int)i], &ids[i])) {
            free(ids);
            return usage_error("detokenize", "'%s' is not a token id", argv[optind + (int)i]);
        }
    snapkv_client_t *cl = NULL;
    if (connect_to(c, false, &cl)) {
        free(ids);
        return 1;
    }
    char *text = NULL;
    int rc = snapkv_detokenize(cl, ids, n, skip, &text);
    snapkv_close(&cl);
    free(ids);
    if (rc)
        return failed("detokenize", rc);
    int ret = 0;
    if (c->json)
        ret = print_json(json_pack("{s:o}", "text", json_text(text)));
    else
        printf("%s\n", text);
    free(text);
    return ret;
}

/* The decode's log-probabilities: as JSON ("logprobs", and "top_logprobs" when lp->n_top > 0:
 * per token a list of {"token", "logprob"}), or as lines "i token logprob [top: token:logprob ...]". */
static json_t *logprob_json(float x) /* JSON has no -inf (a token of probability 0): null */
{
    return isfinite(x) ? json_real(x) : json_null();
}

/* Each position's most likely tokens: a list of {"token", "logprob"} per position. */
static json_t *top_logprobs_json(const struct snapkv_logprobs *lp)
{
    json_t *tops = json_array();
    for (size_t i = 0; i < lp->n; i++) {
        json_t *one = json_array();
        for (uint32_t j = 0; j < lp->n_top; j++)
            json_push(&one, json_pack("{s:I, s:o}", "token", (json_int_t)lp->top_tokens[i * lp->n_top + j], "logprob",
                                      logprob_json(lp->top_logprobs[i * lp->n_top + j])));
        json_push(&tops, one);
    }
    return tops;
}

static json_t *logprobs_json(const struct snapkv_logprobs *lp)
{
    json_t *o = json_object(), *all = json_array();
    for (size_t i = 0; i < lp->n; i++)
        json_push(&all, logprob_json(lp->logprobs[i]));
    json_put(&o, "logprobs", all);
    if (lp->n_top)
        json_put(&o, "top_logprobs", top_logprobs_json(lp));
    return o;
}

/* Lines "i token logprob [top: token:logprob ...]" for lp->n tokens. */
static void print_logprob_lines(FILE *f, const uint32_t *tokens, const struct snapkv_logprobs *lp)
{
    for (size_t i = 0; i < lp->n; i++) {
        fprintf(f, "%zu %u %.6f", i, tokens[i], (double)lp->logprobs[i]);
        for (uint32_t j = 0; j < lp->n_top; j++)
            fprintf(f, "%s%u:%.6f", j ? " " : " [top: ", lp->top_tokens[i * lp->n_top + j],
                    (double)lp->top_logprobs[i * lp->n_top + j]);
        fprintf(f, "%s\n", lp->n_top ? "]" : "");
    }
}

static void print_logprobs(const struct snapkv_decode_result *dr, const struct snapkv_logprobs *lp)
{
    struct snapkv_logprobs shown = *lp;
    shown.n = lp->n < dr->n_tokens ? lp->n : dr->n_tokens;
    print_logprob_lines(stdout, dr->tokens, &shown);
}

static int cmd_decode(const struct ctl *c, int argc, char **argv)
{
    static const struct option opts[] = {SAMPLING_OPTIONS, {"logprobs", required_argument, NULL, OPT_LOGPROBS},
                                         {NULL, 0, NULL, 0}};
    struct snapkv_sampling s;
    sampling_init(&s);
    int o;
    uint32_t top = 0;
    bool want_lp = false;
    reset_getopt();
    while ((o = next_opt(argc, argv, opts)) != -1) {
        if (o == OPT_LOGPROBS) {
            if (!parse_u32(optarg, &top) || top > 20)
                return usage_error("decode", "--logprobs wants an integer from 0 to 20, not '%s'", optarg);
            want_lp = true;
            continue;
        }
        int r = sampling_opt("decode", o, &s);
        if (r == 2)
            return 2;
        if (r == 0)
            return usage_error("decode", "unknown option");
    }
    if (optind + 1 != argc)
        return usage_error("decode", "usage: decode SESSION [SAMPLING]");
    struct snapkv_session_id id;
    if (!parse_session("decode", argv[optind], &id))
        return 2;
    snapkv_client_t *cl = NULL;
    if (connect_to(c, false, &cl))
        return 1;
    struct snapkv_decode_result dr;
    struct snapkv_logprobs lp = {0};
    int rc = snapkv_decode_ext(cl, &id, &s, &g_ext, top, c->json ? NULL : print_tokens, NULL, &dr,
                               want_lp ? &lp : NULL);
    snapkv_close(&cl);
    if (!c->json)
        putchar('\n');
    if (rc)
        return failed("decode", rc);
    int ret = 0;
    if (c->json) {
        json_t *j = json_pack("{s:o, s:o, s:i, s:o}", "text", json_text(dr.text), "tokens",
                              u32_json(dr.tokens, dr.n_tokens), "n_generated", dr.n_generated, "finish_reason",
                              json_text(dr.finish_reason));
        if (j && want_lp) {
            json_t *x = logprobs_json(&lp);
            if (!x || json_object_update(j, x) != 0) {
                json_decref(j);
                j = NULL; /* print_json reports it */
            }
            json_decref(x);
        }
        ret = print_json(j);
    } else if (want_lp) {
        print_logprobs(&dr, &lp);
    }
    ret = ret ? ret : decode_cut("decode", &dr);
    snapkv_decode_result_free(&dr);
    snapkv_logprobs_free(&lp);
    return ret;
}

static int cmd_compress(const struct ctl *c, int argc, char **argv)
{
    static const struct option opts[] = {{"window-from", required_argument, NULL, OPT_WINDOW_FROM},
                                         {NULL, 0, NULL, 0}};
    uint32_t window_from = 0;
    int o;
    reset_getopt();
    while ((o = next_opt(argc, argv, opts)) != -1) {
        if (o != OPT_WINDOW_FROM || !parse_u32(optarg, &window_from))
            return usage_error("compress", "usage: compress SESSION SPEC [--window-from N]");
    }
    if (optind + 2 != argc)
        return usage_error("compress", "usage: compress SESSION SPEC [--window-from N]");
    struct snapkv_session_id id;
    if (!parse_session("compress", argv[optind], &id))
        return 2;
    snapkv_client_t *cl = NULL;
    if (connect_to(c, false, &cl))
        return 1;
    struct snapkv_compress_result cr;
    int rc = snapkv_compress(cl, &id, argv[optind + 1], window_from, &cr);
    snapkv_close(&cl);
    if (rc)
        return failed("compress", rc);
    int ret = 0;
    if (c->json) {
        ret = print_json(json_pack("{s:s, s:I, s:I, s:o}", "session", argv[optind], "bytes_before",
                                   (json_int_t)cr.bytes_before, "bytes_after", (json_int_t)cr.bytes_after, "layers",
                                   layers_json(cr.layers, cr.n_layers, NULL, 0)));
    } else {
        char a[32], b[32];
        printf("kv %s of %s (%.1f%%)\n", fmt_bytes(cr.bytes_after, a, sizeof a),
               fmt_bytes(cr.bytes_before, b, sizeof b),
               cr.bytes_before ? 100.0 * (double)cr.bytes_after / (double)cr.bytes_before : 100.0);
    }
    snapkv_compress_result_free(&cr);
    return ret;
}

static int cmd_fork(const struct ctl *c, int argc, char **argv)
{
    if (argc != 2)
        return usage_error("fork", "usage: fork SESSION");
    struct snapkv_session_id id, new_id;
    if (!parse_session("fork", argv[1], &id))
        return 2;
    snapkv_client_t *cl = NULL;
    if (connect_to(c, false, &cl))
        return 1;
    uint64_t shared = 0;
    int rc = snapkv_fork(cl, &id, &new_id, &shared);
    snapkv_close(&cl);
    if (rc)
        return failed("fork", rc);
    char hex[SNAPKV_SESSION_ID_HEX_SIZE], ref[sizeof g_ref_endpoint + SNAPKV_SESSION_ID_HEX_SIZE];
    id_hex(&new_id, hex);
    id_ref(*g_ref_endpoint ? g_ref_endpoint : c->endpoint, &new_id, ref, sizeof ref);
    if (c->json)
        return print_json(json_pack("{s:s, s:s, s:I}", "session", hex, "ref", ref, "shared_bytes", (json_int_t)shared));
    else
        puts(*g_ref_endpoint ? ref : hex); /* given a reference, one back */
    return 0;
}

static int cmd_release(const struct ctl *c, int argc, char **argv)
{
    if (argc != 2)
        return usage_error("release", "usage: release SESSION");
    struct snapkv_session_id id;
    if (!parse_session("release", argv[1], &id))
        return 2;
    snapkv_client_t *cl = NULL;
    if (connect_to(c, false, &cl))
        return 1;
    int rc = snapkv_release(cl, &id);
    snapkv_close(&cl);
    if (rc)
        return failed("release", rc);
    if (c->json)
        return print_json(json_pack("{s:s, s:b}", "session", argv[1], "released", 1));
    return 0;
}

static int cmd_cancel(const struct ctl *c, int argc, char **argv)
{
    /* --admin before or after the session, as other commands take their options */
    int at = 1; /* the session's argument */
    bool admin = false;
    if (argc == 3 && strcmp(argv[1], "--admin") == 0) {
        admin = true;
        at = 2;
    } else if (argc == 3 && strcmp(argv[2], "--admin") == 0) {
        admin = true;
    }
    if (argc != 2 && !admin)
        return usage_error("cancel", "usage: cancel SESSION [--admin]");
    struct snapkv_session_id id;
    if (!parse_session_for("cancel", argv[at], admin, &id))
        return 2;
    snapkv_client_t *cl = NULL;
    if (connect_to(c, admin, &cl))
        return 1;
    bool cancelled = false;
    uint32_t n = 0;
    int rc = snapkv_cancel(cl, &id, &cancelled, &n);
    snapkv_close(&cl);
    if (rc)
        return failed("cancel", rc);
    if (c->json)
        return print_json(json_pack("{s:s, s:b, s:I}", "session", argv[at], "cancelled", cancelled, "n_generated",
                                    (json_int_t)n));
    if (cancelled)
        printf("cancelled a decode after %u token(s)\n", n);
    else
        printf("no decode was running\n");
    return 0;
}

/* ---- export, import ------------------------------------------------------------------------------------------ */

static bool write_all(FILE *f, const void *p, size_t n)
{
    return n == 0 || fwrite(p, 1, n, f) == n;
}

static int cmd_export(const struct ctl *c, int argc, char **argv)
{
    static const struct option opts[] = {{"out", required_argument, NULL, OPT_OUT},
                                         {"size", required_argument, NULL, OPT_SIZE},
                                         {NULL, 0, NULL, 0}};
    const char *out_path = NULL;
    uint64_t size = 0;
    int o;
    reset_getopt();
    while ((o = next_opt(argc, argv, opts)) != -1) {
        switch (o) {
        case OPT_OUT: out_path = optarg; break;
        case OPT_SIZE:
            if (!parse_u64(optarg, SIZE_MAX, &size) || size == 0)
                return usage_error("export", "--size wants a positive byte count, not '%s'", optarg);
            break;
        default: return usage_error("export", "usage: export SESSION [--out FILE] [--size BYTES]");
        }
    }
    if (optind + 1 != argc)
        return usage_error("export", "usage: export SESSION [--out FILE] [--size BYTES]");
    struct snapkv_session_id id;
    if (!parse_session("export", argv[optind], &id))
        return 2;
    if (*g_ref_endpoint && !size)
        return usage_error("export", "with a session reference give --size: the admin endpoint of the daemon it "
                           "names, which sizes the buffer, is not known");
    char default_path[SNAPKV_SESSION_ID_HEX_SIZE + 8];
    if (!out_path) {
        char hex[SNAPKV_SESSION_ID_HEX_SIZE];
        id_hex(&id, hex);
        snprintf(default_path, sizeof default_path, "%s.skvkv", hex);
        out_path = default_path;
    }

    int ret = 1, rc;
    snapkv_client_t *cl = NULL;
    struct snapkv_shm shm = {.fd = -1};
    struct snapkv_kv_layout lay = {0};
    FILE *f = NULL;
    if (connect_to(c, false, &cl))
        return 1;
    struct snapkv_server_info si;
    snapkv_server_info(cl, &si);
    const bool sized = size != 0; /* --size: the caller's, used as given */
    for (int attempt = 0;; attempt++) {
        if (!sized) {
            /* size the buffer from what the session keeps (INSPECT is an admin command) */
            snapkv_client_t *admin = NULL;
            if (connect_to(c, true, &admin)) {
                fprintf(stderr, "snapkvctl export: sizing the buffer needs the admin endpoint, or give --size\n");
                goto out_close;
            }
            struct snapkv_inspect_result in;
            rc = snapkv_admin_inspect(admin, &id, false, &in);
            snapkv_close(&admin);
            if (rc) {
                failed("inspect", rc);
                goto out_close;
            }
            size = snapkv_kv_bytes(in.layers, in.n_layers, si.n_kv_heads, si.head_dim);
            snapkv_inspect_result_free(&in);
            size += attempt ? size / 4 : 0; /* room for the rows its decode adds meanwhile */
        }
        if (size == 0)
            size = 4096; /* an empty session still needs a buffer to name */
        rc = snapkv_shm_create("export", (size_t)size, &shm);
        if (rc) {
            failed("shared memory", rc);
            goto out_close;
        }
        rc = snapkv_export_kv(cl, &id, &shm, 0, &lay);
        /* the session grew between its size and the export (a decode running in it adds a row
         * a round): sized again, with room to spare */
        if (rc != SNAPKV_E_LIMIT || sized || attempt == 2)
            break;
        snapkv_shm_destroy(&shm);
    }
    if (rc) {
        failed("export", rc);
        goto out_shm;
    }
    for (size_t i = 0; i < lay.n_layers; i++)
        if (lay.layers[i].n_heads != si.n_kv_heads) {
            fprintf(stderr, "snapkvctl export: layer %u has %u heads, the model %u\n", lay.layers[i].layer,
                    lay.layers[i].n_heads, si.n_kv_heads);
            goto out_layout;
        }
    /* an import needs the session's length (its next position), which the export reply carries */
    uint32_t original_length = lay.original_length;
    if (original_length == 0) {
        fprintf(stderr, "snapkvctl export: the daemon did not report session %s's length (a daemon older than "
                        "this snapkvctl?)\n", argv[optind]);
        goto out_layout;
    }
    for (size_t i = 0; i < lay.n_positions; i++)
        if (lay.positions[i] >= original_length) {
            fprintf(stderr, "snapkvctl export: position %u is past the session's length %u\n", lay.positions[i],
                    original_length);
            goto out_layout;
        }
    if (strlen(si.model_fingerprint) >= sizeof(((struct export_header *)0)->model_fingerprint) ||
        !si.model_fingerprint[0]) { /* (import refuses a file that names no model) */
        fprintf(stderr, "snapkvctl export: the daemon's model fingerprint is %s\n",
                si.model_fingerprint[0] ? "longer than an export holds" : "empty");
        goto out_layout;
    }
    /* a session's K/V is the tenant's data: the file is its owner's alone (mkstemp's 0600, not
     * the umask's 0644). It is written beside its name and renamed there once whole, so one that
     * fails part way leaves no file and a file that was there as it was; a name that is not a
     * regular file (/dev/null, a FIFO) is refused, not replaced. */
    struct stat sb;
    if (lstat(out_path, &sb) == 0 && !S_ISREG(sb.st_mode)) {
        fprintf(stderr, "snapkvctl export: %s is there and is not a regular file (a link, a device, a FIFO): "
                        "give another --out\n", out_path);
        goto out_layout;
    }
    size_t tmp_len = strlen(out_path) + sizeof ".XXXXXX";
    char *tmp = malloc(tmp_len);
    int ofd = -1;
    if (tmp) {
        snprintf(tmp, tmp_len, "%s.XXXXXX", out_path);
        ofd = mkstemp(tmp);
    }
    if (ofd < 0 || !(f = fdopen(ofd, "wb"))) {
        fprintf(stderr, "snapkvctl export: cannot make a file beside %s: %s\n", out_path,
                tmp ? strerror(errno) : "out of memory");
        if (ofd >= 0) {
            close(ofd);
            unlink(tmp);
        }
        free(tmp);
        goto out_layout;
    }
    struct export_header h = {
        .version = EXPORT_VERSION,
        .n_layers = (uint32_t)lay.n_layers,
        .n_kv_heads = si.n_kv_heads,
        .head_dim = si.head_dim,
        .original_length = original_length,
        .n_positions = (uint32_t)lay.n_positions,
        .data_bytes = lay.bytes_written,
    };
    memcpy(h.magic, EXPORT_MAGIC, sizeof h.magic);
    memcpy(h.model_fingerprint, si.model_fingerprint, strlen(si.model_fingerprint));
    bool ok = write_all(f, &h, sizeof h);
    for (size_t i = 0; ok && i < lay.n_layers; i++) {
        uint32_t two[2] = {lay.layers[i].layer, lay.layers[i].kept};
        ok = write_all(f, two, sizeof two) &&
             write_all(f, lay.layers[i].kept_per_head, lay.layers[i].n_heads * sizeof(uint32_t));
    }
    ok = ok && write_all(f, lay.positions, lay.n_positions * sizeof(uint32_t)) &&
         write_all(f, shm.addr, (size_t)lay.bytes_written);
    ok = ok && fflush(f) == 0 && fsync(fileno(f)) == 0;
    if (fclose(f) != 0 || !ok || rename(tmp, out_path) != 0) {
        fprintf(stderr, "snapkvctl export: writing %s failed: %s\n", out_path, strerror(errno));
        unlink(tmp);
        free(tmp);
        goto out_layout;
    }
    free(tmp);
    ret = 0;
    if (c->json) {
        ret = print_json(json_pack("{s:s, s:o, s:I, s:i, s:o}", "session", argv[optind], "file",
                                   json_text(out_path), "bytes_written", (json_int_t)lay.bytes_written,
                                   "n_positions", (int)lay.n_positions, "layers",
                                   layers_json(lay.layers, lay.n_layers, NULL, 0)));
    } else {
        char b[32];
        printf("%s: %zu layers, %s of K/V\n", out_path, lay.n_layers, fmt_bytes(lay.bytes_written, b, sizeof b));
    }

out_layout:
    snapkv_kv_layout_free(&lay);
out_shm:
    snapkv_shm_destroy(&shm);
out_close:
    snapkv_close(&cl);
    return ret;
}

static bool read_all(FILE *f, void *p, size_t n)
{
    return n == 0 || fread(p, 1, n, f) == n;
}

static int cmd_import(const struct ctl *c, int argc, char **argv)
{
    if (argc != 2)
        return usage_error("import", "usage: import FILE");
    const char *path = argv[1];
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "snapkvctl import: %s: %s\n", path, strerror(errno));
        return 1;
    }
    int ret = 1, rc;
    struct snapkv_layer_kept *layers = NULL;
    uint32_t *heads = NULL, *positions = NULL;
    snapkv_client_t *cl = NULL;
    struct snapkv_shm shm = {.fd = -1};
    struct export_header h;
    if (read_all(f, &h, offsetof(struct export_header, n_layers)) &&
        memcmp(h.magic, EXPORT_MAGIC, sizeof h.magic) == 0 && h.version != EXPORT_VERSION) {
        fprintf(stderr, "snapkvctl import: %s is a version %u export; this snapkvctl reads version %u: export the "
                "session again\n", path, h.version, EXPORT_VERSION);
        goto out_close_file;
    }
    rewind(f);
    if (!read_all(f, &h, sizeof h) || memcmp(h.magic, EXPORT_MAGIC, sizeof h.magic) != 0 ||
        h.version != EXPORT_VERSION || h.n_layers == 0 || h.n_layers > 4096 || h.n_kv_heads > 4096 ||
        h.model_fingerprint[sizeof h.model_fingerprint - 1] != '\0') {
        fprintf(stderr, "snapkvctl import: %s is not a snapkvctl export (version %u)\n", path, EXPORT_VERSION);
        goto out_close_file;
    }
    if (!h.model_fingerprint[0]) { /* every export names it: the check below would let any model take it */
        fprintf(stderr, "snapkvctl import: %s does not say which model it was exported from\n", path);
        goto out_close_file;
    }
    if (h.original_length == 0) {
        fprintf(stderr, "snapkvctl import: %s does not say how long the session was (an export made with --size "
                "by an older snapkvctl); export the session again\n", path);
        goto out_close_file;
    }
    /* the header's counts must add up to the file's size before anything is sized by them */
    struct stat sb = {0};
    uint64_t want = (uint64_t)sizeof h + (uint64_t)h.n_layers * (8 + 4 * (uint64_t)h.n_kv_heads) +
                    4 * (uint64_t)h.n_positions + h.data_bytes;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode) || h.data_bytes > ((uint64_t)1 << 50) ||
        want != (uint64_t)sb.st_size) {
        fprintf(stderr, "snapkvctl import: %s is truncated or inconsistent (%lld bytes; its header says %llu)\n",
                path, (long long)sb.st_size, (unsigned long long)want);
        goto out_close_file;
    }
    layers = calloc(h.n_layers, sizeof *layers);
    heads = calloc((size_t)h.n_layers * h.n_kv_heads + 1, sizeof *heads);
    positions = calloc((size_t)h.n_positions + 1, sizeof *positions);
    if (!layers || !heads || !positions) {
        fprintf(stderr, "snapkvctl import: out of memory\n");
        goto out_free;
    }
    bool ok = true;
    for (uint32_t i = 0; ok && i < h.n_layers; i++) {
        uint32_t two[2];
        uint32_t *kh = heads + (size_t)i * h.n_kv_heads;
        ok = read_all(f, two, sizeof two) && read_all(f, kh, h.n_kv_heads * sizeof *kh);
        layers[i] = (struct snapkv_layer_kept){
            .layer = two[0], .kept = two[1], .n_heads = h.n_kv_heads, .kept_per_head = kh};
    }
    ok = ok && read_all(f, positions, h.n_positions * sizeof *positions);
    for (uint32_t i = 0; ok && i < h.n_positions; i++)
        ok = positions[i] < h.original_length;
    uint64_t expect = snapkv_kv_bytes(layers, h.n_layers, h.n_kv_heads, h.head_dim);
    if (!ok || h.data_bytes != expect) {
        fprintf(stderr, "snapkvctl import: %s is truncated or inconsistent\n", path);
        goto out_free;
    }
    if (connect_to(c, false, &cl))
        goto out_free;
    struct snapkv_server_info si;
    snapkv_server_info(cl, &si);
    const char *legacy = snapkv_server_legacy_fingerprint(cl); /* an export from before 2026-12-06 */
    if (si.n_kv_heads != h.n_kv_heads || si.head_dim != h.head_dim ||
        (strcmp(si.model_fingerprint, h.model_fingerprint) != 0 &&
         (!legacy[0] || strcmp(legacy, h.model_fingerprint) != 0))) {
        fprintf(stderr, "snapkvctl import: %s was exported from another model (%s)\n", path, h.model_fingerprint);
        goto out_close;
    }
    rc = snapkv_shm_create("import", h.data_bytes ? (size_t)h.data_bytes : 4096, &shm);
    if (rc) {
        failed("shared memory", rc);
        goto out_close;
    }
    if (!read_all(f, shm.addr, (size_t)h.data_bytes)) {
        fprintf(stderr, "snapkvctl import: %s is truncated\n", path);
        goto out_shm;
    }
    struct snapkv_import_opts io = {
        .shm = &shm,
        .layers = layers,
        .n_layers = h.n_layers,
        .positions = positions,
        .n_positions = h.n_positions,
        .original_length = h.original_length,
    };
    struct snapkv_session_id id;
    rc = snapkv_import_kv(cl, &io, &id);
    if (rc) {
        failed("import", rc);
        goto out_shm;
    }
    char hex[SNAPKV_SESSION_ID_HEX_SIZE];
    id_hex(&id, hex);
    ret = 0;
    if (c->json)
        ret = print_json(json_pack("{s:s, s:o}", "session", hex, "file", json_text(path)));
    else
        puts(hex);

out_shm:
    snapkv_shm_destroy(&shm);
out_close:
    snapkv_close(&cl);
out_free:
    free(positions);
    free(heads);
    free(layers);
out_close_file:
    fclose(f);
    return ret;
}

/* ---- admin: list, inspect, evict, pin, save, load, stats ------------------------------------------------------ */

/* s as JSON, its spec `policy` (LIST's whole one, or the info's) */
static json_t *info_json(const struct snapkv_session_info *s, const char *policy)
{
    char hex[SNAPKV_SESSION_ID_HEX_SIZE];
    id_hex(&s->id, hex);
    return json_pack("{s:s, s:o, s:o, s:i, s:i, s:I, s:I, s:o, s:I, s:I, s:b, s:i}", "session", hex, "tenant",
                     json_text(s->tenant), "owner", json_text(s->owner), "n_tokens", (int)s->n_tokens,
                     "kept_tokens", (int)s->kept_tokens, "bytes", (json_int_t)s->bytes, "shared_bytes",
                     (json_int_t)s->shared_bytes, "policy", json_text(policy),
                     "created_unix_ms", (json_int_t)s->created_unix_ms, "last_used_unix_ms",
                     (json_int_t)s->last_used_unix_ms, "pinned", s->pinned, "lease_seconds", (int)s->lease_seconds);
}

static long long idle_seconds(uint64_t last_used_ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long long now_ms = (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    long long idle = (now_ms - (long long)last_used_ms) / 1000;
    return idle < 0 ? 0 : idle;
}

/* list --kept [TENANT]: the kept prefixes (prefix-retain-bytes) */
static int list_kept(const struct ctl *c, const char *tenant)
{
    snapkv_client_t *cl = NULL;
    if (connect_to(c, true, &cl))
        return 1;
    struct snapkv_kept_list l;
    int rc = snapkv_admin_list_kept(cl, tenant, &l);
    snapkv_close(&cl);
    if (rc)
        return failed("list", rc);
    int ret = 0;
    if (c->json) {
        json_t *arr = json_array();
        for (size_t i = 0; arr && i < l.n; i++) {
            const struct snapkv_kept_prefix *k = &l.kept[i];
            char hex[SNAPKV_SESSION_ID_HEX_SIZE];
            id_hex(&k->id, hex);
            json_push(&arr, json_pack("{s:s, s:o, s:i, s:I, s:I, s:I}", "kept_prefix", hex, "tenant",
                                      json_text(k->tenant), "n_tokens", (int)k->n_tokens, "bytes",
                                      (json_int_t)k->bytes, "alone_bytes", (json_int_t)k->alone_bytes,
                                      "last_used_unix_ms", (json_int_t)k->last_used_unix_ms));
        }
        ret = print_json(arr);
    } else {
        printf("%-32s  %-12s %7s %10s %10s %6s\n", "KEPT PREFIX", "TENANT", "TOKENS", "BYTES", "ALONE", "IDLE");
        for (size_t i = 0; i < l.n; i++) {
            const struct snapkv_kept_prefix *k = &l.kept[i];
            char hex[SNAPKV_SESSION_ID_HEX_SIZE], b[32], ab[32];
            id_hex(&k->id, hex);
            printf("%-32s  %-12s %7u %10s %10s %6lld\n", hex, k->tenant, k->n_tokens, /* (the whole name) */
                   fmt_bytes(k->bytes, b, sizeof b), fmt_bytes(k->alone_bytes, ab, sizeof ab),
                   idle_seconds(k->last_used_unix_ms));
        }
    }
    snapkv_kept_list_free(&l);
    return ret;
}

static int cmd_list(const struct ctl *c, int argc, char **argv)
{
    int kept = argc >= 2 && strcmp(argv[1], "--kept") == 0 ? 1 : argc == 3 && strcmp(argv[2], "--kept") == 0 ? 2 : 0;
    if (kept && argc <= 3) { /* list --kept [TENANT], list TENANT --kept */
        const char *tenant = argc == 3 ? argv[3 - kept] : NULL;
        if (!tenant || tenant[0] != '-')
            return admin_tenant(c, "list", &tenant) ? list_kept(c, tenant) : 2;
    }
    if (argc > 2 || (argc == 2 && argv[1][0] == '-'))
        return usage_error("list", "usage: list [--kept] [TENANT] (other options go before the command)");
    const char *tenant = argc == 2 ? argv[1] : NULL;
    if (!admin_tenant(c, "list", &tenant))
        return 2;
    snapkv_client_t *cl = NULL;
    if (connect_to(c, true, &cl))
        return 1;
    struct snapkv_session_list l;
    int rc = snapkv_admin_list(cl, tenant, &l);
    snapkv_close(&cl);
    if (rc)
        return failed("list", rc);
    /* each spec whole (snapkv_session_list_spec): the info's 64 bytes cut a long one, printed
     * as a spec that did not parse */
    int ret = 0;
    if (c->json) {
        json_t *arr = json_array();
        for (size_t i = 0; arr && i < l.n; i++)
            json_push(&arr, info_json(&l.sessions[i], snapkv_session_list_spec(&l, i)));
        ret = print_json(arr);
    } else {
        /* the spec last, whole (the keys that differ from the defaults, without "policy=") */
        printf("%-32s  %-12s %7s %7s %10s %10s %3s %6s %6s  %s\n", "SESSION", "TENANT", "TOKENS", "KEPT", "BYTES",
               "SHARED", "PIN", "LEASE", "IDLE", "SPEC");
        for (size_t i = 0; i < l.n; i++) {
            const struct snapkv_session_info *s = &l.sessions[i];
            char hex[SNAPKV_SESSION_ID_HEX_SIZE], b[32], sb[32];
            id_hex(&s->id, hex);
            const char *whole = snapkv_session_list_spec(&l, i);
            const char *spec = strncmp(whole, "policy=", 7) == 0 ? whole + 7 : whole;
            printf("%-32s  %-12s %7u %7u %10s %10s %3s %6u %6lld  %s\n", hex, s->tenant, s->n_tokens,
                   s->kept_tokens, fmt_bytes(s->bytes, b, sizeof b), fmt_bytes(s->shared_bytes, sb, sizeof sb),
                   s->pinned ? "yes" : "", s->lease_seconds, idle_seconds(s->last_used_unix_ms),
                   *spec ? spec : "full");
        }
    }
    snapkv_session_list_free(&l);
    return ret;
}

/* A block hash as text: 16 hex digits (a uint64 is past JSON's exact integers). */
static void hash_hex(uint64_t h, char out[17])
{
    snprintf(out, 17, "%016llx", (unsigned long long)h);
}

/* Block hashes as a JSON array of hash_hex strings (NULL out of memory). */
static json_t *hashes_json(const uint64_t *hashes, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++) {
        char h[17];
        hash_hex(hashes[i], h);
        json_push(&a, json_string(h));
    }
    return a;
}

static int cmd_inspect(const struct ctl *c, int argc, char **argv)
{
    static const struct option opts[] = {{"positions", no_argument, NULL, OPT_POSITIONS},
                                         {"hashes", no_argument, NULL, OPT_HASHES},
                                         {NULL, 0, NULL, 0}};
    static const char *const use = "usage: inspect SESSION [--positions] [--hashes]";
    bool positions = false, with_hashes = false;
    int o;
    reset_getopt();
    while ((o = next_opt(argc, argv, opts)) != -1) {
        if (o == OPT_POSITIONS)
            positions = true;
        else if (o == OPT_HASHES)
            with_hashes = true;
        else
            return usage_error("inspect", use);
    }
    if (optind + 1 != argc)
        return usage_error("inspect", use);
    struct snapkv_session_id id;
    if (!parse_admin_session("inspect", argv[optind], &id))
        return 2;
    snapkv_client_t *cl = NULL;
    if (connect_to(c, true, &cl))
        return 1;
    struct snapkv_inspect_result in;
    int rc = snapkv_admin_inspect(cl, &id, positions, &in);
    /* the block hashes the session's KV events carry (a second INSPECT) */
    uint64_t *hashes = NULL;
    size_t n_hashes = 0;
    uint32_t block_size = 0;
    if (!rc && with_hashes && (rc = snapkv_admin_session_hashes(cl, &id, &block_size, &hashes, &n_hashes)))
        snapkv_inspect_result_free(&in);
    snapkv_close(&cl);
    if (rc)
        return failed("inspect", rc);
    int ret = 0;
    if (c->json) {
        json_t *j = info_json(&in.info, in.info.policy);
        json_put(&j, "spec", json_text(in.spec));
        json_put(&j, "layers", layers_json(in.layers, in.n_layers, in.layer_similarity, in.n_layer_similarity));
        if (with_hashes) {
            json_put(&j, "block_size", json_integer(block_size));
            json_put(&j, "block_hashes", hashes_json(hashes, n_hashes));
        }
        ret = print_json(j);
    } else {
        const struct snapkv_session_info *s = &in.info;
        char hex[SNAPKV_SESSION_ID_HEX_SIZE], b[32], sb[32];
        id_hex(&s->id, hex);
        printf("session  %s\n", hex);
        printf("tenant   %s (owner %s)%s\n", s->tenant, s->owner, s->pinned ? ", pinned" : "");
        printf("tokens   %u, kept %u over all layers\n", s->n_tokens, s->kept_tokens);
        printf("bytes    %s in whole pool blocks (%s shared); a layer's ROW BYTES below count its rows\n",
               fmt_bytes(s->bytes, b, sizeof b), fmt_bytes(s->shared_bytes, sb, sizeof sb));
        printf("policy   %s\n", in.spec[0] ? in.spec : (s->policy[0] ? s->policy : "full"));
        printf("lease    %u s, idle %lld s\n", s->lease_seconds, idle_seconds(s->last_used_unix_ms));
        printf("%5s %6s %10s %6s  %s\n", "LAYER", "KEPT", "ROW BYTES", "SIM",
               "KEPT PER HEAD [blocks/shared]");
        for (size_t i = 0; i < in.n_layers; i++) {
            const struct snapkv_layer_kept *l = &in.layers[i];
            char sim[16] = "-";
            if (i < in.n_layer_similarity)
                snprintf(sim, sizeof sim, "%.3f", in.layer_similarity[i]);
            printf("%5u %6u %10s %6s ", l->layer, l->kept, fmt_bytes(l->bytes, b, sizeof b), sim);
            for (uint32_t h = 0; h < l->n_heads; h++) {
                printf(" %u", l->kept_per_head[h]);
                if (l->blocks_per_head && l->shared_blocks_per_head)
                    printf(" [%u/%u]", l->blocks_per_head[h], l->shared_blocks_per_head[h]);
            }
            putchar('\n');
            const uint32_t *p = l->positions;
            for (uint32_t h = 0; p && h < l->n_heads; h++) {
                printf("      head %u:", h);
                for (uint32_t k = 0; k < l->kept_per_head[h]; k++)
                    printf(" %u", *p++);
                putchar('\n');
            }
        }
        /* a reply with positions but no layers (malformed) has nothing to match them to */
        if (positions && in.n_positions && (in.n_layers == 0 || !in.layers[0].positions))
            printf("(%zu positions did not match the kept lengths; see --json)\n", in.n_positions);
        if (with_hashes) {
            printf("hashes   %zu, of blocks of %u tokens (as the KV events carry them)\n", n_hashes, block_size);
            for (size_t i = 0; i < n_hashes; i++) {
                char h[17];
                hash_hex(hashes[i], h);
                printf("%s%s", i % 4 ? " " : "  ", h);
                if (i % 4 == 3 || i + 1 == n_hashes)
                    putchar('\n');
            }
        }
    }
    free(hashes);
    snapkv_inspect_result_free(&in);
    return ret;
}

static int cmd_evict(const struct ctl *c, int argc, char **argv)
{
    static const struct option opts[] = {{"tenant", required_argument, NULL, OPT_TENANT},
                                         {"all", no_argument, NULL, OPT_ALL},
                                         {NULL, 0, NULL, 0}};
    const char *tenant = NULL;
    bool all = false;
    int o;
    reset_getopt();
    while ((o = next_opt(argc, argv, opts)) != -1) {
        switch (o) {
        case OPT_TENANT: tenant = optarg; break;
        case OPT_ALL: all = true; break;
        default: return usage_error("evict", "usage: evict (SESSION | --tenant T | --all)");
        }
    }
    const char *session = optind < argc ? argv[optind] : NULL;
    if (c->tenant_given && all) /* `-t acme evict --all` evicted every tenant's */
        return usage_error("evict", "-t names one tenant, --all every tenant's: evict --tenant T for one tenant's");
    if (!session && !admin_tenant(c, "evict", &tenant))
        return 2;
    if (optind + (session != NULL) != argc || (session != NULL) + (tenant != NULL) + all != 1)
        return usage_error("evict", "usage: evict (SESSION | --tenant T | --all)");
    struct snapkv_session_id id;
    if (session && !parse_admin_session("evict", session, &id))
        return 2;
    snapkv_client_t *cl = NULL;
    if (connect_to(c, true, &cl))
        return 1;
    uint32_t evicted = 0;
    uint64_t freed = 0;
    int rc = snapkv_admin_evict(cl, session ? &id : NULL, tenant, all, &evicted, &freed);
    snapkv_close(&cl);
    if (rc)
        return failed("evict", rc);
    if (c->json) {
        return print_json(json_pack("{s:i, s:I}", "evicted", (int)evicted, "bytes_freed", (json_int_t)freed));
    } else {
        char b[32];
        printf("evicted %u session%s, freed %s\n", evicted, evicted == 1 ? "" : "s", fmt_bytes(freed, b, sizeof b));
    }
    return 0;
}

static int cmd_pin(const struct ctl *c, int argc, char **argv, bool on)
{
    const char *cmd = on ? "pin" : "unpin";
    if (argc != 2)
        return usage_error(cmd, "usage: %s SESSION", cmd);
    struct snapkv_session_id id;
    if (!parse_admin_session(cmd, argv[1], &id))
        return 2;
    snapkv_client_t *cl = NULL;
    if (connect_to(c, true, &cl))
        return 1;
    int rc = on ? snapkv_admin_pin(cl, &id) : snapkv_admin_unpin(cl, &id);
    snapkv_close(&cl);
    if (rc)
        return failed(cmd, rc);
    if (c->json)
        return print_json(json_pack("{s:s, s:b}", "session", argv[1], "pinned", on));
    return 0;
}

static int cmd_save(const struct ctl *c, int argc, char **argv)
{
    if (argc != 3)
        return usage_error("save", "usage: save SESSION NAME");
    struct snapkv_session_id id;
    if (!parse_admin_session("save", argv[1], &id))
        return 2;
    snapkv_client_t *cl = NULL;
    if (connect_to(c, true, &cl))
        return 1;
    uint64_t bytes = 0;
    int rc = snapkv_admin_save(cl, &id, argv[2], &bytes);
    snapkv_close(&cl);
    if (rc)
        return failed("save", rc);
    if (c->json) {
        return print_json(json_pack("{s:s, s:s, s:I}", "session", argv[1], "name", argv[2], "bytes",
                                    (json_int_t)bytes));
    } else {
        char b[32];
        printf("saved %s as %s (%s)\n", argv[1], argv[2], fmt_bytes(bytes, b, sizeof b));
    }
    return 0;
}

static int cmd_load(const struct ctl *c, int argc, char **argv)
{
    static const struct option opts[] = {{"tenant", required_argument, NULL, OPT_TENANT}, {NULL, 0, NULL, 0}};
    const char *tenant = NULL;
    int o;
    reset_getopt();
    while ((o = next_opt(argc, argv, opts)) != -1) {
        if (o != OPT_TENANT)
            return usage_error("load", "usage: load NAME [--tenant T]");
        tenant = optarg;
    }
    if (optind + 1 != argc)
        return usage_error("load", "usage: load NAME [--tenant T]");
    if (!admin_tenant(c, "load", &tenant))
        return 2;
    snapkv_client_t *cl = NULL;
    if (connect_to(c, true, &cl))
        return 1;
    struct snapkv_session_id id;
    int rc = snapkv_admin_load(cl, argv[optind], tenant, &id);
    snapkv_close(&cl);
    if (rc)
        return failed("load", rc);
    char hex[SNAPKV_SESSION_ID_HEX_SIZE];
    id_hex(&id, hex);
    if (c->json)
        return print_json(json_pack("{s:s, s:s}", "session", hex, "name", argv[optind]));
    else
        puts(hex);
    return 0;
}

/* STATS through the admin endpoint for command `cmd`; 0, or 1 once the failure is printed. */
static int fetch_stats(const struct ctl *c, const char *cmd, bool prometheus, struct snapkv_stats *st)
{
    snapkv_client_t *cl = NULL;
    if (connect_to(c, true, &cl))
        return 1;
    int rc = snapkv_admin_stats(cl, prometheus, st);
    snapkv_close(&cl);
    return rc ? failed(cmd, rc) : 0;
}

static int cmd_stats(const struct ctl *c, int argc, char **argv)
{
    static const struct option opts[] = {{"prometheus", no_argument, NULL, OPT_PROMETHEUS}, {NULL, 0, NULL, 0}};
    bool prometheus = false;
    int o;
    reset_getopt();
    while ((o = next_opt(argc, argv, opts)) != -1) {
        if (o != OPT_PROMETHEUS)
            return usage_error("stats", "usage: stats [--prometheus]");
        prometheus = true;
    }
    if (optind != argc)
        return usage_error("stats", "usage: stats [--prometheus]");
    struct snapkv_stats st;
    if (fetch_stats(c, "stats", prometheus, &st))
        return 1;
    int ret = 0;
    if (prometheus && !c->json) {
        fputs(st.prometheus_text, stdout);
    } else if (c->json) {
        json_t *arr = json_array();
        for (size_t i = 0; arr && i < st.n; i++)
            json_push(&arr, json_pack("{s:o, s:o, s:o}", "name", json_text(st.stats[i].name), "value",
                                      json_number(st.stats[i].value), "help", json_text(st.stats[i].help)));
        json_t *j = json_pack("{s:o}", "stats", arr);
        if (prometheus)
            json_put(&j, "prometheus", json_text(st.prometheus_text));
        ret = print_json(j);
    } else {
        for (size_t i = 0; i < st.n; i++) { /* counts and bytes whole, rates and ratios to 6 digits */
            double v = st.stats[i].value;
            if (v == floor(v) && fabs(v) < 1e15)
                printf("%-36s %16.0f  # %s\n", st.stats[i].name, v, st.stats[i].help);
            else
                printf("%-36s %16.6g  # %s\n", st.stats[i].name, v, st.stats[i].help);
        }
    }
    snapkv_stats_free(&st);
    return ret;
}

/* One tenant's row of `tenants`, gathered from the STATS rows labelled with it. */
#define TENANT_FIELDS 10
#define TENANT_SECONDS 8 /* engine_seconds_total: the one not a count */
static const char *const tenant_fields[TENANT_FIELDS] = {
    "sessions", "bytes", "queue_requests", "decodes_running", "requests_total",
    "errors_total", "prefill_tokens_total", "decode_tokens_total", "engine_seconds_total", "prefix_retained_bytes",
};
struct tenant_row {
    char name[72];
    double v[TENANT_FIELDS];
};

/* Files a snapkv_tenant_<field>{tenant="<name>"} row into rows[] (new names appended, up to
 * cap); other rows are skipped. */
static void file_tenant_stat(const struct snapkv_stat *st, struct tenant_row *rows, size_t *n, size_t cap)
{
    static const char prefix[] = "snapkv_tenant_";
    const char *label = strstr(st->name, "{tenant=\"");
    if (strncmp(st->name, prefix, sizeof prefix - 1) != 0 || !label)
        return;
    const char *field = st->name + sizeof prefix - 1, *name = label + 9;
    size_t name_len = strcspn(name, "\"");
    int k = 0;
    while (k < TENANT_FIELDS && !((size_t)(label - field) == strlen(tenant_fields[k]) &&
                                  strncmp(field, tenant_fields[k], (size_t)(label - field)) == 0))
        k++;
    if (k == TENANT_FIELDS || name_len >= sizeof rows->name)
        return;
    size_t i = 0;
    while (i < *n && !(strlen(rows[i].name) == name_len && strncmp(rows[i].name, name, name_len) == 0))
        i++;
    if (i == *n) {
        if (*n == cap)
            return;
        memset(&rows[i], 0, sizeof rows[i]);
        memcpy(rows[i].name, name, name_len);
        (*n)++;
    }
    rows[i].v[k] = st->value;
}

/* Each tenant's sessions, bytes, waiting requests, running decodes, requests, errors, tokens,
 * engine time and kept prefixes' bytes (the per-tenant STATS rows, as a table). */
static int cmd_tenants(const struct ctl *c, int argc, char **argv)
{
    (void)argv;
    if (argc != 1)
        return usage_error("tenants", "usage: tenants");
    struct snapkv_stats st;
    if (fetch_stats(c, "tenants", false, &st))
        return 1;
    struct tenant_row *rows = calloc(st.n ? st.n : 1, sizeof *rows);
    if (!rows) {
        snapkv_stats_free(&st);
        fprintf(stderr, "snapkvctl tenants: out of memory\n");
        return 1;
    }
    size_t n = 0;
    for (size_t i = 0; i < st.n; i++)
        file_tenant_stat(&st.stats[i], rows, &n, st.n);
    snapkv_stats_free(&st);
    int ret = 0;
    if (c->json) {
        json_t *arr = json_array();
        for (size_t i = 0; arr && i < n; i++) {
            json_t *o = json_pack("{s:o}", "tenant", json_text(rows[i].name));
            for (int k = 0; k < TENANT_FIELDS; k++) /* counts as integers; the seconds as they are */
                json_put(&o, tenant_fields[k],
                         k != TENANT_SECONDS ? json_integer((json_int_t)rows[i].v[k]) : json_number(rows[i].v[k]));
            json_push(&arr, o);
        }
        ret = print_json(json_pack("{s:o}", "tenants", arr));
    } else {
        printf("%-20s %8s %10s %6s %7s %9s %7s %12s %12s %9s %10s\n", "TENANT", "SESSIONS", "BYTES", "QUEUED",
               "DECODES", "REQUESTS", "ERRORS", "PREFILL_TOK", "DECODE_TOK", "ENGINE_S", "KEPT");
        for (size_t i = 0; i < n; i++) {
            char b[32], kb[32];
            const double *v = rows[i].v;
            printf("%-20.20s %8.0f %10s %6.0f %7.0f %9.0f %7.0f %12.0f %12.0f %9.2f %10s\n", rows[i].name, v[0],
                   fmt_bytes((uint64_t)v[1], b, sizeof b), v[2], v[3], v[4], v[5], v[6], v[7], v[8],
                   fmt_bytes((uint64_t)v[9], kb, sizeof kb));
        }
    }
    free(rows);
    return ret;
}

static const char *const event_kinds[] = {"?", "stored", "removed", "cleared"};

/* The KV events of a daemon's events-endpoint, one line (or one JSON object) per event. */
static int cmd_events(const struct ctl *c, int argc, char **argv)
{
    long count = -1;
    const char *replay = NULL;
    if (argc < 2 || argc % 2 != 0)
        return usage_error("events", "usage: events ENDPOINT [--count N] [--replay REPLAY_ENDPOINT]");
    for (int i = 2; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--count") == 0) {
            uint64_t v;
            if (!parse_u64(argv[i + 1], LONG_MAX, &v) || v < 1)
                return usage_error("events", "--count wants a positive number, not '%s'", argv[i + 1]);
            count = (long)v;
        } else if (strcmp(argv[i], "--replay") == 0) {
            replay = argv[i + 1];
        } else {
            return usage_error("events", "usage: events ENDPOINT [--count N] [--replay REPLAY_ENDPOINT]");
        }
    }
    snapkv_events_t *ev = NULL;
    if (snapkv_events_open(argv[1], &ev) || (replay && snapkv_events_replay(ev, replay, c->timeout_ms))) {
        fprintf(stderr, "snapkvctl events: %s\n", snapkv_last_error());
        snapkv_events_close(&ev);
        return 1;
    }
    int ret = 0;
    uint64_t last = 0; /* the last event's sequence, once there is one (have) */
    bool have = false, told = false; /* told: the silence below was said */
    for (long n = 0; count < 0 || n < count; n++) {
        struct snapkv_event e;
        int rc;
        while ((rc = snapkv_events_next(ev, 1000, &e)) == SNAPKV_E_TIMEOUT) {
            /* not even a heartbeat for --timeout: said once a silence, and waited on (a daemon
             * that restarts comes back on the same endpoint) */
            uint64_t quiet = snapkv_events_quiet_ms(ev);
            if (c->timeout_ms >= 0 && quiet >= (uint64_t)c->timeout_ms && !told)
                fprintf(stderr, "snapkvctl events: nothing from %s for %llu s, not even a heartbeat: is the "
                        "daemon up, and this its events-endpoint? (still waiting)\n", argv[1],
                        (unsigned long long)quiet / 1000);
            told = c->timeout_ms >= 0 && quiet >= (uint64_t)c->timeout_ms;
            /* a quiet stream: the daemon's heartbeat says whether events were missed at its end */
            uint64_t published = snapkv_events_published(ev);
            if (!have || published <= last)
                continue;
            fprintf(stderr, "snapkvctl events: events %llu..%llu missed%s\n", (unsigned long long)last + 1,
                    (unsigned long long)published, replay ? ": replaying" : " (--replay catches up)");
            last = published;
            if (replay && (rc = snapkv_events_replay(ev, replay, c->timeout_ms)))
                break;
            have = !replay;
        }
        if (rc) {
            fprintf(stderr, "snapkvctl events: %s\n", snapkv_last_error());
            ret = 1;
            break;
        }
        /* events missed: numbers that skip (the publisher's queue was full, or the subscription
         * reached the daemon late) or a daemon restarted (the library's CLEARED of sequence 0):
         * said on stderr, and with --replay caught up from a new snapshot */
        bool restart = e.kind == SNAPKV_EVENT_CLEARED && e.sequence == 0;
        bool reboot = e.kind == SNAPKV_EVENT_CLEARED && e.sequence == 1; /* a new daemon's own first */
        bool gap = have && !restart && !reboot && e.sequence != last && e.sequence != last + 1;
        if (restart)
            fprintf(stderr, "snapkvctl events: the daemon restarted; what it published before this subscriber "
                    "reconnected was missed%s\n", replay ? ": replaying" : " (--replay catches up)");
        else if (gap)
            fprintf(stderr, "snapkvctl events: events %llu..%llu missed%s\n", (unsigned long long)last + 1,
                    (unsigned long long)e.sequence - 1, replay ? ": replaying" : " (--replay catches up)");
        last = e.sequence;
        have = !restart;
        if ((restart || gap) && replay) {
            snapkv_event_free(&e);
            if (snapkv_events_replay(ev, replay, c->timeout_ms)) {
                fprintf(stderr, "snapkvctl events: %s\n", snapkv_last_error());
                ret = 1;
                break;
            }
            have = false;
            n--; /* not one of --count */
            continue;
        }
        char hex[SNAPKV_SESSION_ID_HEX_SIZE] = "";
        if (e.kind != SNAPKV_EVENT_CLEARED)
            id_hex(&e.id, hex);
        const char *kind = event_kinds[e.kind <= SNAPKV_EVENT_CLEARED ? e.kind : 0];
        if (c->json) {
            json_t *hashes = hashes_json(e.block_hashes, e.n_block_hashes);
            json_t *o = json_pack("{s:I, s:f, s:s}", "sequence", (json_int_t)e.sequence, "ts", e.ts, "kind", kind);
            if (e.kind != SNAPKV_EVENT_CLEARED) {
                json_put(&o, "session", json_string(hex));
                json_put(&o, "tenant", json_text(e.tenant));
                json_put(&o, "block_hashes", hashes);
                hashes = NULL;
            }
            if (e.kind == SNAPKV_EVENT_STORED) {
                json_put(&o, "n_tokens", json_integer(e.n_tokens));
                json_put(&o, "bytes", json_integer((json_int_t)e.bytes));
                json_put(&o, "compressed", json_boolean(e.compressed));
                json_put(&o, "kept_prefix", json_boolean(e.kept_prefix));
                json_put(&o, "block_size", json_integer(e.block_size));
            }
            json_decref(hashes);
            char *line = o ? json_dumps(o, JSON_COMPACT) : NULL;
            json_decref(o);
            if (line) {
                printf("%s\n", line);
            } else { /* a missing line is a failure, as everywhere else in the tool */
                fprintf(stderr, "snapkvctl events: out of memory for event %llu's JSON\n",
                        (unsigned long long)e.sequence);
                ret = 1;
            }
            free(line);
        } else if (e.kind == SNAPKV_EVENT_CLEARED) {
            printf("%llu cleared\n", (unsigned long long)e.sequence);
        } else {
            printf("%llu %s %s %s blocks=%zu", (unsigned long long)e.sequence, kind, hex, e.tenant, e.n_block_hashes);
            if (e.kind == SNAPKV_EVENT_STORED)
                printf(" tokens=%u bytes=%llu%s%s", e.n_tokens, (unsigned long long)e.bytes,
                       e.compressed ? " compressed" : "", e.kept_prefix ? " kept-prefix" : "");
            printf("\n");
        }
        fflush(stdout);
        snapkv_event_free(&e);
    }
    snapkv_events_close(&ev);
    return ret;
}

/* Writes one key file; O_EXCL: never replaces an existing key. */
static int write_key_file(const char *path, const char *what, const char *key, mode_t mode)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (fd < 0) {
        fprintf(stderr, "snapkvctl keygen: %s: %s%s\n", path, strerror(errno),
                errno == EEXIST ? " (remove it first; keys are never overwritten)" : "");
        return 1;
    }
    FILE *f = fdopen(fd, "w");
    if (!f) {
        close(fd);
        return 1;
    }
    fprintf(f, "# snapkv CURVE %s key (Z85), made by snapkvctl keygen%s\n%s\n", what,
            strcmp(what, "secret") == 0 ? "; keep it private" : "", key);
    if (fclose(f) != 0) {
        fprintf(stderr, "snapkvctl keygen: %s: %s\n", path, strerror(errno));
        unlink(path);
        return 1;
    }
    return 0;
}

/* Which of several daemons' endpoints a key belongs to (snapkv_place), for a client or script
 * that spreads its sessions over them. */
static int cmd_place(const struct ctl *c, int argc, char **argv)
{
    if (argc < 3)
        return usage_error("place", "usage: place KEY ENDPOINT... (at least one endpoint)");
    size_t at = 0;
    int rc = snapkv_place((const char *const *)argv + 2, (size_t)argc - 2, argv[1], strlen(argv[1]), &at);
    if (rc)
        return failed("place", rc);
    if (c->json)
        return print_json(json_pack("{s:o, s:o, s:I}", "key", json_text(argv[1]), "endpoint",
                                    json_text(argv[2 + at]), "index", (json_int_t)at));
    printf("%s\n", argv[2 + at]);
    return 0;
}

static int cmd_keygen(const struct ctl *c, int argc, char **argv)
{
    if (argc != 2 || !*argv[1])
        return usage_error("keygen", "usage: keygen NAME (writes NAME.pub and NAME.key)");
    char pub_path[4096], key_path[4096];
    if (snprintf(pub_path, sizeof pub_path, "%s.pub", argv[1]) >= (int)sizeof pub_path ||
        snprintf(key_path, sizeof key_path, "%s.key", argv[1]) >= (int)sizeof key_path)
        return usage_error("keygen", "NAME is too long");
    char pub[SNAPKV_CURVE_KEY_SIZE], sec[SNAPKV_CURVE_KEY_SIZE];
    int rc = snapkv_curve_keypair(pub, sec);
    if (rc)
        return failed("keygen", rc);
    /* the secret first: a public key without its secret is useless */
    if (write_key_file(key_path, "secret", sec, 0600))
        return 1;
    if (write_key_file(pub_path, "public", pub, 0644)) {
        unlink(key_path);
        return 1;
    }
    memset(sec, 0, sizeof sec);
    int ret = 0;
    if (c->json)
        ret = print_json(json_pack("{s:s, s:o, s:o}", "public_key", pub, "public_file", json_text(pub_path),
                                   "secret_file", json_text(key_path)));
    else
        printf("%s\n", pub);
    fprintf(stderr, "wrote %s (secret, mode 0600) and %s\n", key_path, pub_path);
    return ret;
}

/* An environment variable's value; NULL when it is unset or empty (as an env file writes an
 * unset one: `SNAPKV_ENDPOINT=`). */
static const char *env_or_null(const char *name)
{
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

static int run(int argc, char **argv)
{
    struct ctl c = {
        .endpoint = env_or_null("SNAPKV_ENDPOINT") ? env_or_null("SNAPKV_ENDPOINT") : DEFAULT_ENDPOINT,
        .admin_endpoint = env_or_null("SNAPKV_ADMIN_ENDPOINT") ? env_or_null("SNAPKV_ADMIN_ENDPOINT")
                                                              : DEFAULT_ADMIN_ENDPOINT,
        .server_key = env_or_null("SNAPKV_SERVER_KEY"),
        .client_key = env_or_null("SNAPKV_CLIENT_KEY"),
        .tenant = "default",
        .timeout_ms = 30000,
    };
    static const struct option opts[] = {
        {"endpoint", required_argument, NULL, 'e'}, {"admin-endpoint", required_argument, NULL, 'a'},
        {"tenant", required_argument, NULL, 't'},   {"json", no_argument, NULL, 'j'},
        {"timeout", required_argument, NULL, 'T'},  {"help", no_argument, NULL, 'h'},
        {"server-key", required_argument, NULL, 'S'}, {"client-key", required_argument, NULL, 'K'},
        {NULL, 0, NULL, 0},
    };
    int o;
    while ((o = getopt_long(argc, argv, "+e:a:t:jh", opts, NULL)) != -1) {
        switch (o) {
        case 'e': c.endpoint = optarg; break;
        case 'a': c.admin_endpoint = optarg; break;
        case 't':
            c.tenant = optarg;
            c.tenant_given = true;
            break;
        case 'S': c.server_key = optarg; break;
        case 'K': c.client_key = optarg; break;
        case 'j': c.json = true; break;
        case 'T': {
            char *end;
            long v = strtol(optarg, &end, 10);
            if (*end || v < -1 || v > INT_MAX || v == 0) {
                fprintf(stderr, "snapkvctl: --timeout wants milliseconds (or -1), not '%s'\n", optarg);
                return 2;
            }
            c.timeout_ms = (int)v;
            break;
        }
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind >= argc) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[optind];
    int sub_argc = argc - optind;
    char **sub_argv = argv + optind;
    /* the global options come before the command (getopt stops there): `list --json` listed a
     * tenant named "--json"; after `--` they are the command's text (`tokenize -- -j`) */
    for (int i = 1; i < sub_argc && strcmp(sub_argv[i], "--") != 0; i++)
        if (strcmp(sub_argv[i], "--json") == 0 || strcmp(sub_argv[i], "-j") == 0) {
            fprintf(stderr, "snapkvctl: %s goes before the command: snapkvctl --json %s ...\n", sub_argv[i], cmd);
            return 2;
        }
    if (sub_argc == 2 && (strcmp(sub_argv[1], "--help") == 0 || strcmp(sub_argv[1], "-h") == 0))
        return command_usage(cmd); /* `snapkvctl generate --help` */
    if ((strcmp(cmd, "info") == 0 || strcmp(cmd, "status") == 0) && sub_argc > 1)
        return usage_error(cmd, "usage: %s (options go before the command)", cmd);
    if (strcmp(cmd, "info") == 0)
        return cmd_info(&c);
    if (strcmp(cmd, "status") == 0)
        return cmd_status(&c);
    if (strcmp(cmd, "config") == 0) {
        if (sub_argc > 2)
            return usage_error("config", "usage: config [KEY]");
        return cmd_config(&c, sub_argc == 2 ? sub_argv[1] : NULL);
    }
    static const struct {
        const char *name;
        int (*fn)(const struct ctl *, int, char **);
    } cmds[] = {
        {"generate", cmd_generate}, {"chat", cmd_chat},       {"prefill", cmd_prefill}, {"append", cmd_append},
        {"decode", cmd_decode},     {"compress", cmd_compress}, {"fork", cmd_fork},     {"export", cmd_export},
        {"import", cmd_import},     {"release", cmd_release}, {"cancel", cmd_cancel}, {"list", cmd_list},       {"inspect", cmd_inspect},
        {"evict", cmd_evict},       {"save", cmd_save},       {"load", cmd_load},       {"stats", cmd_stats},       {"tenants", cmd_tenants},
        {"keygen", cmd_keygen},     {"events", cmd_events},   {"place", cmd_place},
        {"tokenize", cmd_tokenize}, {"detokenize", cmd_detokenize},
    };
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        if (strcmp(cmd, cmds[i].name) == 0)
            return cmds[i].fn(&c, sub_argc, sub_argv);
    if (strcmp(cmd, "pin") == 0 || strcmp(cmd, "unpin") == 0)
        return cmd_pin(&c, sub_argc, sub_argv, strcmp(cmd, "pin") == 0);
    fprintf(stderr, "snapkvctl: unknown command '%s'\n", cmd);
    usage(stderr);
    return 2;
}

int main(int argc, char **argv)
{
    int ret = run(argc, argv);
    /* what is still buffered for stdout (a file, a pipe) written now: a full disk or a closed
     * pipe is a failure, not a short output with status 0 */
    errno = 0;
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "snapkvctl: writing the output failed%s%s\n", errno ? ": " : "", errno ? strerror(errno) : "");
        if (ret == 0)
            ret = 1;
    }
    return ret;
}
