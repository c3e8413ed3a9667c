/* libsnapkv admin commands (sent on a client connected to the daemon's admin endpoint):
 * STATUS, CONFIG GET, LIST, INSPECT, EVICT, PIN/UNPIN, SAVE/LOAD and STATS. Never logs. */
#include "libclient/client_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int snapkv_admin_status(snapkv_client_t *c, struct snapkv_status_info *out)
{
    if (!c || !out)
        return skv_client_fail(SNAPKV_E_INVAL, "client and out are required");
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__StatusRequest sreq = SNAPKV__STATUS_REQUEST__INIT;
    req.command_case = SNAPKV__REQUEST__COMMAND_STATUS;
    req.status = &sreq;
    Snapkv__Reply *rep = NULL;
    int rc = skv_client_call(c, &req, SNAPKV__REPLY__RESULT_STATUS_REPLY, "STATUS", NULL, NULL, NULL, &rep);
    if (rc)
        return rc;
    const Snapkv__StatusReply *s = rep->status_reply;
    struct snapkv_status_info info = {
        .uptime_seconds = s->uptime_seconds,
        .n_sessions = s->n_sessions,
        .n_clients = s->n_clients,
        .queue_depth = s->queue_depth,
        .threads = s->threads,
        .pool_bytes_total = s->pool_bytes_total,
        .pool_bytes_used = s->pool_bytes_used,
        .pool_blocks_used = s->pool_blocks_used,
        .pool_blocks_shared = s->pool_blocks_shared,
        .pool_block_rows = s->pool_block_rows,
        .pool_block_bytes = s->pool_block_bytes,
    };
    snprintf(info.server_version, sizeof info.server_version, "%s", s->server_version);
    snprintf(info.model_name, sizeof info.model_name, "%s", s->model_name);
    snprintf(info.backend, sizeof info.backend, "%s", s->backend);
    *out = info;
    snapkv__reply__free_unpacked(rep, NULL);
    return SNAPKV_OK;
}

int snapkv_admin_config_get(snapkv_client_t *c, const char *key, snapkv_config_fn fn, void *user)
{
    if (!c || !fn)
        return skv_client_fail(SNAPKV_E_INVAL, "client and fn are required");
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__ConfigGetRequest creq = SNAPKV__CONFIG_GET_REQUEST__INIT;
    creq.key = (char *)(key ? key : "");
    req.command_case = SNAPKV__REQUEST__COMMAND_CONFIG_GET;
    req.config_get = &creq;
    Snapkv__Reply *rep = NULL;
    int rc = skv_client_call(c, &req, SNAPKV__REPLY__RESULT_CONFIG_GET, "CONFIG GET", NULL, NULL, NULL, &rep);
    if (rc)
        return rc;
    for (size_t i = 0; i < rep->config_get->n_entries; i++) {
        const Snapkv__ConfigEntry *e = rep->config_get->entries[i];
        fn(user, e->key, e->value, e->help);
    }
    snapkv__reply__free_unpacked(rep, NULL);
    return SNAPKV_OK;
}

/* ---- LIST, INSPECT ---------------------------------------------------------------------------- */

static int session_info(const Snapkv__SessionInfo *s, const char *what, struct snapkv_session_info *out)
{
    struct snapkv_session_info info = {
        .n_tokens = s->n_tokens,
        .kept_tokens = s->kept_tokens,
        .bytes = s->bytes,
        .shared_bytes = s->shared_bytes,
        .created_unix_ms = s->created_unix_ms,
        .last_used_unix_ms = s->last_used_unix_ms,
        .lease_seconds = s->lease_seconds,
        .pinned = s->pinned,
    };
    int rc = skv_client_id_parse(&s->session_id, what, &info.id);
    if (rc)
        return rc;
    snprintf(info.tenant, sizeof info.tenant, "%s", s->tenant ? s->tenant : "");
    snprintf(info.owner, sizeof info.owner, "%s", s->owner ? s->owner : "");
    snprintf(info.policy, sizeof info.policy, "%s", s->policy ? s->policy : "");
    *out = info;
    return SNAPKV_OK;
}

/* Sends LIST for tenant (NULL: all), with the kept prefixes when kept; *rep owns the reply. */
static int list_call(snapkv_client_t *c, const char *tenant, bool kept, Snapkv__Reply **rep)
{
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__ListRequest l = SNAPKV__LIST_REQUEST__INIT;
    l.tenant = (char *)(tenant ? tenant : "");
    l.kept_prefixes = kept;
    req.command_case = SNAPKV__REQUEST__COMMAND_LIST;
    req.list = &l;
    return skv_client_call(c, &req, SNAPKV__REPLY__RESULT_LIST, "LIST", NULL, NULL, NULL, rep);
}

int snapkv_admin_list(snapkv_client_t *c, const char *tenant, struct snapkv_session_list *out)
{
    if (!c || !out)
        return skv_client_fail(SNAPKV_E_INVAL, "client and out are required");
    Snapkv__Reply *rep = NULL;
    int rc = list_call(c, tenant, false, &rep);
    if (rc)
        return rc;
    struct snapkv_session_list res = {.n = rep->list->n_sessions};
    /* one allocation: the sessions, then a pointer to each one's whole spec, then the specs'
     * text (snapkv_session_list_spec) */
    size_t text = 0;
    for (size_t i = 0; i < res.n; i++)
        text += strlen(rep->list->sessions[i]->policy ? rep->list->sessions[i]->policy : "") + 1;
    if (res.n) {
        res.sessions = calloc(1, res.n * (sizeof *res.sessions + sizeof(char *)) + text);
        if (!res.sessions) {
            rc = skv_client_fail(SNAPKV_E_NOMEM, "list: out of memory for %zu sessions", res.n);
            goto out_free_reply;
        }
    }
    char **specs = res.n ? (char **)(res.sessions + res.n) : NULL, *at = res.n ? (char *)(specs + res.n) : NULL;
    for (size_t i = 0; i < res.n; i++) {
        rc = session_info(rep->list->sessions[i], "LIST", &res.sessions[i]);
        if (rc) {
            free(res.sessions);
            goto out_free_reply;
        }
        const char *p = rep->list->sessions[i]->policy ? rep->list->sessions[i]->policy : "";
        size_t len = strlen(p) + 1;
        specs[i] = memcpy(at, p, len);
        at += len;
    }
    *out = res;

out_free_reply:
    snapkv__reply__free_unpacked(rep, NULL);
    return rc;
}

const char *snapkv_session_list_spec(const struct snapkv_session_list *l, size_t i)
{
    if (!l || !l->sessions || i >= l->n)
        return NULL;
    return ((char *const *)(l->sessions + l->n))[i];
}

void snapkv_session_list_free(struct snapkv_session_list *l)
{
    if (!l)
        return;
    free(l->sessions);
    memset(l, 0, sizeof *l);
}

int snapkv_admin_list_kept(snapkv_client_t *c, const char *tenant, struct snapkv_kept_list *out)
{
    if (!c || !out)
        return skv_client_fail(SNAPKV_E_INVAL, "client and out are required");
    Snapkv__Reply *rep = NULL;
    int rc = list_call(c, tenant, true, &rep);
    if (rc)
        return rc;
    struct snapkv_kept_list res = {.n = rep->list->n_kept};
    if (res.n && !(res.kept = calloc(res.n, sizeof *res.kept))) {
        rc = skv_client_fail(SNAPKV_E_NOMEM, "list: out of memory for %zu kept prefixes", res.n);
        goto out;
    }
    for (size_t i = 0; i < res.n; i++) {
        const Snapkv__KeptPrefixInfo *k = rep->list->kept[i];
        struct snapkv_kept_prefix *x = &res.kept[i];
        if ((rc = skv_client_id_parse(&k->id, "LIST", &x->id))) {
            free(res.kept);
            goto out;
        }
        snprintf(x->tenant, sizeof x->tenant, "%s", k->tenant ? k->tenant : "");
        x->n_tokens = k->n_tokens;
        x->bytes = k->bytes;
        x->alone_bytes = k->alone_bytes;
        x->last_used_unix_ms = k->last_used_unix_ms;
    }
    *out = res;
out:
    snapkv__reply__free_unpacked(rep, NULL);
    return rc;
}

void snapkv_kept_list_free(struct snapkv_kept_list *l)
{
    if (!l)
        return;
    free(l->kept);
    memset(l, 0, sizeof *l);
}

/* Sends INSPECT for id; *rep owns the reply (checked to carry an InspectReply). */
static int inspect_call(snapkv_client_t *c, const struct snapkv_session_id *id, bool with_positions,
                        Snapkv__Reply **rep)
{
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__InspectRequest in = SNAPKV__INSPECT_REQUEST__INIT;
    in.session_id = skv_client_id_wire(id);
    in.with_positions = with_positions;
    req.command_case = SNAPKV__REQUEST__COMMAND_INSPECT;
    req.inspect = &in;
    return skv_client_call(c, &req, SNAPKV__REPLY__RESULT_INSPECT, "INSPECT", NULL, NULL, NULL, rep);
}

int snapkv_admin_session_hashes(snapkv_client_t *c, const struct snapkv_session_id *id, uint32_t *block_size,
                                uint64_t **hashes, size_t *n)
{
    int rc = skv_client_check(c, id, "session hashes");
    if (rc)
        return rc;
    if (!block_size || !hashes || !n)
        return skv_client_fail(SNAPKV_E_INVAL, "session hashes: block_size, hashes and n are required");
    Snapkv__Reply *rep = NULL;
    if ((rc = inspect_call(c, id, false, &rep)))
        return rc;
    const Snapkv__InspectReply *r = rep->inspect;
    uint64_t *h = NULL;
    if (r->n_block_hashes && !(h = malloc(r->n_block_hashes * sizeof *h))) {
        snapkv__reply__free_unpacked(rep, NULL);
        return skv_client_fail(SNAPKV_E_NOMEM, "session hashes: out of memory");
    }
    if (h)
        memcpy(h, r->block_hashes, r->n_block_hashes * sizeof *h);
    *block_size = r->block_size;
    *hashes = h;
    *n = r->n_block_hashes;
    snapkv__reply__free_unpacked(rep, NULL);
    return SNAPKV_OK;
}

int snapkv_admin_inspect(snapkv_client_t *c, const struct snapkv_session_id *id, bool with_positions,
                         struct snapkv_inspect_result *out)
{
    int rc = skv_client_check(c, id, "inspect");
    if (rc)
        return rc;
    if (!out)
        return skv_client_fail(SNAPKV_E_INVAL, "inspect: out is required");
    Snapkv__Reply *rep = NULL;
    if ((rc = inspect_call(c, id, with_positions, &rep)))
        return rc;
    const Snapkv__InspectReply *r = rep->inspect;
    struct snapkv_inspect_result res = {.n_layers = r->n_kept, .n_positions = r->n_positions,
                                        .n_layer_similarity = r->n_layer_similarity};
    if (!r->info) {
        rc = skv_client_fail(SNAPKV_E_PROTO, "INSPECT reply carries no session info");
        goto out_free_reply;
    }
    rc = session_info(r->info, "INSPECT", &res.info);
    if (rc)
        goto out_free_reply;
    res.spec = strdup(r->spec ? r->spec : "");
    if (!res.spec || !skv_client_dup_u32(r->positions, r->n_positions, &res.positions) ||
        !skv_client_dup_f32(r->layer_similarity, r->n_layer_similarity, &res.layer_similarity)) {
        rc = skv_client_fail(SNAPKV_E_NOMEM, "inspect: out of memory");
        goto out_free_result;
    }
    rc = skv_client_layers(c, r->kept, r->n_kept, res.positions, res.n_positions, &res.layers);
    if (rc)
        goto out_free_result;
    *out = res;
    snapkv__reply__free_unpacked(rep, NULL);
    return SNAPKV_OK;

out_free_result:
    snapkv_inspect_result_free(&res);
out_free_reply:
    snapkv__reply__free_unpacked(rep, NULL);
    return rc;
}

void snapkv_inspect_result_free(struct snapkv_inspect_result *r)
{
    if (!r)
        return;
    free(r->spec);
    free(r->layers);
    free(r->positions);
    free(r->layer_similarity);
    memset(r, 0, sizeof *r);
}

/* ---- EVICT, PIN ------------------------------------------------------------------------------------ */

int snapkv_admin_evict(snapkv_client_t *c, const struct snapkv_session_id *id, const char *tenant, bool all_unpinned,
                       uint32_t *evicted, uint64_t *bytes_freed)
{
    if (!c)
        return skv_client_fail(SNAPKV_E_INVAL, "client is required");
    bool by_tenant = tenant && *tenant;
    if ((id != NULL) + by_tenant + all_unpinned != 1)
        return skv_client_fail(SNAPKV_E_INVAL, "evict: give exactly one of a session, a tenant or all_unpinned");
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__EvictRequest e = SNAPKV__EVICT_REQUEST__INIT;
    if (id)
        e.session_id = skv_client_id_wire(id);
    e.tenant = (char *)(by_tenant ? tenant : "");
    e.all_unpinned = all_unpinned;
    req.command_case = SNAPKV__REQUEST__COMMAND_EVICT;
    req.evict = &e;
    Snapkv__Reply *rep = NULL;
    int rc = skv_client_call(c, &req, SNAPKV__REPLY__RESULT_EVICT, "EVICT", NULL, NULL, NULL, &rep);
    if (rc)
        return rc;
    if (evicted)
        *evicted = rep->evict->evicted;
    if (bytes_freed)
        *bytes_freed = rep->evict->bytes_freed;
    snapkv__reply__free_unpacked(rep, NULL);
    return SNAPKV_OK;
}

static int pin(snapkv_client_t *c, const struct snapkv_session_id *id, bool on)
{
    int rc = skv_client_check(c, id, on ? "pin" : "unpin");
    if (rc)
        return rc;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__PinRequest p = SNAPKV__PIN_REQUEST__INIT;
    p.session_id = skv_client_id_wire(id);
    p.pin = on;
    req.command_case = SNAPKV__REQUEST__COMMAND_PIN;
    req.pin = &p;
    Snapkv__Reply *rep = NULL;
    rc = skv_client_call(c, &req, SNAPKV__REPLY__RESULT_PIN, on ? "PIN" : "UNPIN", NULL, NULL, NULL, &rep);
    if (rc)
        return rc;
    snapkv__reply__free_unpacked(rep, NULL);
    return SNAPKV_OK;
}

int snapkv_admin_pin(snapkv_client_t *c, const struct snapkv_session_id *id)
{
    return pin(c, id, true);
}

int snapkv_admin_unpin(snapkv_client_t *c, const struct snapkv_session_id *id)
{
    return pin(c, id, false);
}

/* ---- SAVE, LOAD ------------------------------------------------------------------------------------ */

/* The daemon's rule for saved-session names: [A-Za-z0-9._-]{1,64}, not "." or "..". */
static int check_name(const char *name, const char *what)
{
    size_t n = name ? strlen(name) : 0;
    if (n == 0 || n > 64)
        return skv_client_fail(SNAPKV_E_INVAL, "%s: a name of 1 to 64 characters is required", what);
    if (name[0] == '.')
        return skv_client_fail(SNAPKV_E_INVAL, "%s: name '%s' may not start with '.'", what, name);
    for (size_t i = 0; i < n; i++) {
        char ch = name[i];
        bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' ||
                  ch == '_' || ch == '-';
        if (!ok)
            return skv_client_fail(SNAPKV_E_INVAL, "%s: name '%s' may hold only A-Z a-z 0-9 . _ -", what, name);
    }
    return SNAPKV_OK;
}

int snapkv_admin_save(snapkv_client_t *c, const struct snapkv_session_id *id, const char *name, uint64_t *bytes)
{
    int rc = skv_client_check(c, id, "save");
    if (rc)
        return rc;
    rc = check_name(name, "save");
    if (rc)
        return rc;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__SaveRequest s = SNAPKV__SAVE_REQUEST__INIT;
    s.session_id = skv_client_id_wire(id);
    s.name = (char *)name;
    req.command_case = SNAPKV__REQUEST__COMMAND_SAVE;
    req.save = &s;
    Snapkv__Reply *rep = NULL;
    rc = skv_client_call(c, &req, SNAPKV__REPLY__RESULT_SAVE, "SAVE", NULL, NULL, NULL, &rep);
    if (rc)
        return rc;
    if (bytes)
        *bytes = rep->save->bytes;
    snapkv__reply__free_unpacked(rep, NULL);
    return SNAPKV_OK;
}

int snapkv_admin_load(snapkv_client_t *c, const char *name, const char *tenant, struct snapkv_session_id *out)
{
    if (!c || !out)
        return skv_client_fail(SNAPKV_E_INVAL, "client and out are required");
    int rc = check_name(name, "load");
    if (rc)
        return rc;
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__LoadRequest l = SNAPKV__LOAD_REQUEST__INIT;
    l.name = (char *)name;
    l.tenant = (char *)(tenant ? tenant : "");
    req.command_case = SNAPKV__REQUEST__COMMAND_LOAD;
    req.load = &l;
    Snapkv__Reply *rep = NULL;
    rc = skv_client_call(c, &req, SNAPKV__REPLY__RESULT_LOAD, "LOAD", NULL, NULL, NULL, &rep);
    if (rc)
        return rc;
    struct snapkv_session_id id;
    rc = skv_client_id_parse(&rep->load->session_id, "LOAD", &id);
    if (!rc)
        *out = id;
    snapkv__reply__free_unpacked(rep, NULL);
    return rc;
}

/* ---- STATS -------------------------------------------------------------------------------------------- */

int snapkv_admin_stats(snapkv_client_t *c, bool prometheus, struct snapkv_stats *out)
{
    if (!c || !out)
        return skv_client_fail(SNAPKV_E_INVAL, "client and out are required");
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    Snapkv__StatsRequest s = SNAPKV__STATS_REQUEST__INIT;
    s.prometheus = prometheus;
    req.command_case = SNAPKV__REQUEST__COMMAND_STATS;
    req.stats = &s;
    Snapkv__Reply *rep = NULL;
    int rc = skv_client_call(c, &req, SNAPKV__REPLY__RESULT_STATS, "STATS", NULL, NULL, NULL, &rep);
    if (rc)
        return rc;
    const Snapkv__StatsReply *r = rep->stats;
    struct snapkv_stats res = {0};
    res.prometheus_text = strdup(r->prometheus_text ? r->prometheus_text : "");
    if (!res.prometheus_text)
        goto out_nomem;
    if (r->n_stats) {
        res.stats = calloc(r->n_stats, sizeof *res.stats);
        if (!res.stats)
            goto out_nomem;
    }
    for (; res.n < r->n_stats; res.n++) {
        const Snapkv__Stat *st = r->stats[res.n];
        struct snapkv_stat *d = &res.stats[res.n];
        d->name = strdup(st->name ? st->name : "");
        d->help = strdup(st->help ? st->help : "");
        d->value = st->value;
        if (!d->name || !d->help) {
            res.n++; /* so that the free below sees this entry */
            goto out_nomem;
        }
    }
    *out = res;
    snapkv__reply__free_unpacked(rep, NULL);
    return SNAPKV_OK;

out_nomem:
    snapkv_stats_free(&res);
    snapkv__reply__free_unpacked(rep, NULL);
    return skv_client_fail(SNAPKV_E_NOMEM, "stats: out of memory");
}

void snapkv_stats_free(struct snapkv_stats *s)
{
    if (!s)
        return;
    for (size_t i = 0; i < s->n; i++) {
        free(s->stats[i].name);
        free(s->stats[i].help);
    }
    free(s->stats);
    free(s->prometheus_text);
    memset(s, 0, sizeof *s);
}
