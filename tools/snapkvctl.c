/* snapkvctl: the command line of snapkvd for users (generate, chat, prefill, ...) and admins
 * (status, list, inspect, evict, ...). Talks only through libsnapkv. */
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "libclient/snapkv.h"

#define DEFAULT_ENDPOINT "ipc:///run/snapkvd/snapkvd.sock"
#define DEFAULT_ADMIN_ENDPOINT "ipc:///run/snapkvd/admin.sock"

struct ctl {
    const char *endpoint;
    const char *admin_endpoint;
    const char *tenant;
    bool json;
    int timeout_ms;
};

static void usage(FILE *out)
{
    fprintf(out,
            "usage: snapkvctl [-e URL] [-a URL] [--tenant T] [--json] [--timeout MS] COMMAND [ARGS]\n"
            "  -e, --endpoint URL        client endpoint (default %s, or $SNAPKV_ENDPOINT)\n"
            "  -a, --admin-endpoint URL  admin endpoint (default %s, or $SNAPKV_ADMIN_ENDPOINT)\n"
            "commands:\n"
            "  info                      what the daemon serves (HELLO)\n"
            "  status                    daemon status (admin)\n"
            "  config [KEY]              options in force (admin)\n"
            "not yet in this version: generate, chat, prefill, append, decode, compress, fork, export,\n"
            "  release, list, inspect, evict, pin, unpin, save, load, stats\n",
            DEFAULT_ENDPOINT, DEFAULT_ADMIN_ENDPOINT);
}

static int connect_to(const struct ctl *c, bool admin, snapkv_client_t **out)
{
    struct snapkv_connect_opts o = {.tenant = c->tenant, .name = "snapkvctl", .timeout_ms = c->timeout_ms};
    const char *ep = admin ? c->admin_endpoint : c->endpoint;
    int rc = snapkv_connect(ep, &o, out);
    if (rc)
        fprintf(stderr, "snapkvctl: %s: %s (%s)\n", ep, snapkv_last_error(), snapkv_status_str(rc));
    return rc;
}

static void print_json(json_t *j)
{
    char *s = json_dumps(j, JSON_INDENT(2));
    if (s)
        puts(s);
    free(s);
    json_decref(j);
}

static int cmd_info(const struct ctl *c)
{
    snapkv_client_t *cl = NULL;
    if (connect_to(c, false, &cl))
        return 1;
    struct snapkv_server_info in;
    snapkv_server_info(cl, &in);
    if (c->json) {
        print_json(json_pack("{s:s, s:s, s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i}", "server_version",
                             in.server_version, "model", in.model_name, "fingerprint", in.model_fingerprint,
                             "backend", in.backend, "layers", in.n_layers, "heads", in.n_heads, "kv_heads",
                             in.n_kv_heads, "head_dim", in.head_dim, "vocab", in.n_vocab, "max_prompt_tokens",
                             in.max_prompt_tokens, "max_new_tokens", in.max_new_tokens));
    } else {
        printf("server      snapkvd %s (%s backend)\n", in.server_version, in.backend);
        printf("model       %s\n", in.model_name);
        printf("fingerprint %s\n", in.model_fingerprint);
        printf("shape       %u layers, %u heads, %u kv heads, head dim %u, vocab %u\n", in.n_layers, in.n_heads,
               in.n_kv_heads, in.head_dim, in.n_vocab);
        printf("limits      prompt %u tokens, %u new tokens\n", in.max_prompt_tokens, in.max_new_tokens);
    }
    snapkv_close(&cl);
    return 0;
}

static int cmd_status(const struct ctl *c)
{
    snapkv_client_t *cl = NULL;
    if (connect_to(c, true, &cl))
        return 1;
    struct snapkv_status_info s;
    int rc = snapkv_admin_status(cl, &s);
    snapkv_close(&cl);
    if (rc) {
        fprintf(stderr, "snapkvctl: status: %s\n", snapkv_last_error());
        return 1;
    }
    if (c->json) {
        print_json(json_pack("{s:s, s:s, s:s, s:I, s:i, s:i, s:I, s:I, s:i, s:i}", "server_version",
                             s.server_version, "model", s.model_name, "backend", s.backend, "uptime_seconds",
                             (json_int_t)s.uptime_seconds, "sessions", s.n_sessions, "clients", s.n_clients,
                             "pool_bytes_total", (json_int_t)s.pool_bytes_total, "pool_bytes_used",
                             (json_int_t)s.pool_bytes_used, "queue_depth", s.queue_depth, "threads", s.threads));
    } else {
        printf("snapkvd %s, model %s, backend %s (%u threads)\n", s.server_version, s.model_name, s.backend,
               s.threads);
        printf("uptime %llu s, %u sessions, %u clients, queue %u\n", (unsigned long long)s.uptime_seconds,
               s.n_sessions, s.n_clients, s.queue_depth);
        printf("pool %.1f MiB used of %.1f MiB\n", s.pool_bytes_used / 1048576.0, s.pool_bytes_total / 1048576.0);
    }
    return 0;
}

static void config_row(void *user, const char *key, const char *value, const char *help)
{
    json_t *arr = user;
    if (arr)
        json_array_append_new(arr, json_pack("{s:s, s:s, s:s}", "key", key, "value", value, "help", help));
    else
        printf("%-26s %-40s # %s\n", key, value, help);
}

static int cmd_config(const struct ctl *c, const char *key)
{
    snapkv_client_t *cl = NULL;
    if (connect_to(c, true, &cl))
        return 1;
    json_t *arr = c->json ? json_array() : NULL;
    int rc = snapkv_admin_config_get(cl, key, config_row, arr);
    snapkv_close(&cl);
    if (rc) {
        json_decref(arr);
        fprintf(stderr, "snapkvctl: config: %s\n", snapkv_last_error());
        return 1;
    }
    if (arr)
        print_json(arr);
    return 0;
}

int main(int argc, char **argv)
{
    struct ctl c = {
        .endpoint = getenv("SNAPKV_ENDPOINT") ? getenv("SNAPKV_ENDPOINT") : DEFAULT_ENDPOINT,
        .admin_endpoint = getenv("SNAPKV_ADMIN_ENDPOINT") ? getenv("SNAPKV_ADMIN_ENDPOINT") : DEFAULT_ADMIN_ENDPOINT,
        .tenant = "default",
        .timeout_ms = 30000,
    };
    static const struct option opts[] = {
        {"endpoint", required_argument, NULL, 'e'}, {"admin-endpoint", required_argument, NULL, 'a'},
        {"tenant", required_argument, NULL, 't'},   {"json", no_argument, NULL, 'j'},
        {"timeout", required_argument, NULL, 'T'},  {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int o;
    while ((o = getopt_long(argc, argv, "+e:a:t:jh", opts, NULL)) != -1) {
        switch (o) {
        case 'e': c.endpoint = optarg; break;
        case 'a': c.admin_endpoint = optarg; break;
        case 't': c.tenant = optarg; break;
        case 'j': c.json = true; break;
        case 'T': c.timeout_ms = atoi(optarg); break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind >= argc) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[optind];
    if (strcmp(cmd, "info") == 0)
        return cmd_info(&c);
    if (strcmp(cmd, "status") == 0)
        return cmd_status(&c);
    if (strcmp(cmd, "config") == 0)
        return cmd_config(&c, optind + 1 < argc ? argv[optind + 1] : NULL);
    fprintf(stderr, "snapkvctl: '%s' is not available in this version\n", cmd);
    usage(stderr);
    return 2;
}
