/* libFuzzer target for the engine worker: any snapkv.Request a client or admin can send,
 * run by the real worker thread on the tiny model, as the socket thread would hand it over.
 * Properties: every request gets exactly one final reply that unpacks, with SKV_OK or an
 * error code and a message; the worker then still answers STATS; pool and tenant limits keep
 * memory bounded across inputs (sessions live on between inputs, as in a daemon).
 *
 * Input: byte 0 is the routing id (clients 0..3), the rest a packed snapkv.Request; or byte 0
 * is 0xFE and the rest a saved session's file, which an admin LOADs (the saved format's reader,
 * and the pass over the rows that makes room before it, on hostile bytes: the checksum is
 * checked only at the end). A
 * session_id of one byte k names the k-th newest session the worker created (so the fuzzer
 * can chain PREFILL, FORK, DECODE, COMPRESS, EXPORT, ... without guessing 16 random bytes); a
 * shm_name "@" names a 1 MiB shared-memory buffer the harness made. The version is set to 1 and
 * admin commands go to the admin endpoint, which is what the socket thread checks first; HELLO,
 * STATUS and CONFIG_GET never reach the worker and are skipped.
 *
 * `fuzz_worker -seeds DIR` writes a seed corpus (one valid request per command, and two files
 * SAVE wrote: a full and a compressed session) and exits.
 * Build and run with scripts/fuzz, from the source tree (it stages tests/fixtures/tiny-llama). */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/status.h"
#include "daemon/config.h"
#include "daemon/worker.h"
#include "proto/snapkv.pb-c.h"
#include "tests/common/tiny.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define REPLIES "inproc://fuzz-worker-replies"
#define N_IDS 16          /* newest session ids remembered */
#define SHM_BYTES (1 << 20)
#define MAX_REPLIES 4096  /* a streamed DECODE sends one per token; max-new-tokens bounds it */

static struct {
    struct tiny *tiny;
    struct skv_config cfg;
    void *zctx, *pull;
    struct skv_worker *w;
    char shm_name[64];
    char state_dir[64];
    uint8_t ids[N_IDS][16];
    int n_ids, next_id;
} g;

static void remember(const ProtobufCBinaryData *sid)
{
    if (sid->len != 16)
        return;
    memcpy(g.ids[g.next_id], sid->data, 16);
    g.next_id = (g.next_id + 1) % N_IDS;
    if (g.n_ids < N_IDS)
        g.n_ids++;
}

/* The field `name` of message m as bytes, or NULL. */
static ProtobufCBinaryData *bytes_field(ProtobufCMessage *m, const char *name)
{
    const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field_by_name(m->descriptor, name);
    if (!f || f->type != PROTOBUF_C_TYPE_BYTES || f->label == PROTOBUF_C_LABEL_REPEATED)
        return NULL;
    return (ProtobufCBinaryData *)((char *)m + f->offset);
}

/* The message a oneof case points to (request command or reply result), or NULL. */
static ProtobufCMessage *oneof_message(ProtobufCMessage *m, uint32_t field_number)
{
    const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field(m->descriptor, field_number);
    if (!f || f->type != PROTOBUF_C_TYPE_MESSAGE)
        return NULL;
    return *(ProtobufCMessage **)((char *)m + f->offset);
}

/* One-byte session ids become remembered ones; "@" becomes the harness's buffer. */
static void rewrite(Snapkv__Request *req)
{
    ProtobufCMessage *cmd = oneof_message(&req->base, req->command_case);
    if (!cmd)
        return;
    ProtobufCBinaryData *sid = bytes_field(cmd, "session_id");
    if (sid && sid->len == 1 && g.n_ids > 0) {
        uint8_t *d = malloc(16);
        if (!d)
            __builtin_trap();
        memcpy(d, g.ids[(g.next_id + N_IDS - 1 - sid->data[0] % g.n_ids) % N_IDS], 16);
        free(sid->data);
        sid->data = d;
        sid->len = 16;
    }
    Snapkv__BufferRef *buf = NULL;
    if (req->command_case == SNAPKV__REQUEST__COMMAND_EXPORT_KV)
        buf = req->export_kv->buffer;
    else if (req->command_case == SNAPKV__REQUEST__COMMAND_IMPORT_KV)
        buf = req->import_kv->buffer;
    if (buf && buf->kind_case == SNAPKV__BUFFER_REF__KIND_SHM_NAME && strcmp(buf->shm_name, "@") == 0) {
        char *name = strdup(g.shm_name);
        if (!name)
            __builtin_trap();
        free(buf->shm_name);
        buf->shm_name = name;
    }
}

/* Reads replies for (sock, id) until the final one; checks each. */
static void drain(int sock, uint8_t id)
{
    for (int n = 0;; n++) {
        if (n > MAX_REPLIES)
            __builtin_trap(); /* more partial replies than max-new-tokens allows */
        zmq_msg_t parts[3];
        for (int i = 0; i < 3; i++) {
            zmq_msg_init(&parts[i]);
            int rc;
            while ((rc = zmq_msg_recv(&parts[i], g.pull, 0)) < 0 && zmq_errno() == EINTR)
                ; /* libFuzzer's timeout alarm interrupts a blocking receive */
            if (rc < 0)
                __builtin_trap();
        }
        if (*(const uint8_t *)zmq_msg_data(&parts[0]) != sock || zmq_msg_size(&parts[1]) != 1 ||
            *(const uint8_t *)zmq_msg_data(&parts[1]) != id)
            __builtin_trap(); /* a reply to someone else */
        Snapkv__Reply *rep = snapkv__reply__unpack(NULL, zmq_msg_size(&parts[2]), zmq_msg_data(&parts[2]));
        if (!rep)
            __builtin_trap();
        if (rep->status > 0 || (rep->status < 0 && (!rep->message || !*rep->message)))
            __builtin_trap(); /* an error says what went wrong */
        if (rep->status < 0 && !rep->final)
            __builtin_trap();
        ProtobufCMessage *res = oneof_message(&rep->base, rep->result_case);
        ProtobufCBinaryData *sid = res ? bytes_field(res, "session_id") : NULL;
        if (rep->status == 0 && sid)
            remember(sid);
        bool final = rep->final;
        snapkv__reply__free_unpacked(rep, NULL);
        for (int i = 0; i < 3; i++)
            zmq_msg_close(&parts[i]);
        if (final)
            return;
    }
}

/* Queues req; false when submit refused it for its counts (the socket thread answers that). */
static bool submit(int sock, uint8_t id, Snapkv__Request *req)
{
    struct skv_job *job = calloc(1, sizeof *job);
    if (!job)
        __builtin_trap();
    job->sock = sock;
    job->uid = (long)geteuid();
    job->identity[0] = id;
    job->identity_len = 1;
    job->req = req;
    int rc = skv_worker_submit(g.w, job);
    if (rc == SKV_OK)
        return true;
    if (rc == SKV_E_BUSY)
        __builtin_trap(); /* one request at a time never fills the queue */
    snapkv__request__free_unpacked(req, NULL);
    free(job);
    return false;
}

/* Queues a heap copy of the small request q (version 1; its one-byte session id rewritten) as
 * the socket thread would hand it over. */
static bool submit_copy(int sock, uint8_t id, Snapkv__Request *q)
{
    uint8_t buf[1024];
    q->version = 1;
    if (snapkv__request__get_packed_size(q) > sizeof buf)
        __builtin_trap();
    size_t len = snapkv__request__pack(q, buf);
    Snapkv__Request *copy = snapkv__request__unpack(NULL, len, buf);
    rewrite(copy);
    return submit(sock, id, copy);
}

/* STATS from the admin endpoint must still succeed. */
static void check_alive(void)
{
    Snapkv__StatsRequest sr = SNAPKV__STATS_REQUEST__INIT;
    Snapkv__Request q = SNAPKV__REQUEST__INIT;
    q.command_case = SNAPKV__REQUEST__COMMAND_STATS;
    q.stats = &sr;
    if (!submit_copy(1, 200, &q))
        __builtin_trap();
    drain(1, 200);
}

/* Writes [id][packed request] with command `cmd` (a message of case cc) as dir/name. */
static void write_seed(const char *dir, const char *name, uint8_t id, Snapkv__Request__CommandCase cc, void *cmd)
{
    Snapkv__Request req = SNAPKV__REQUEST__INIT;
    const ProtobufCFieldDescriptor *fd = protobuf_c_message_descriptor_get_field(&snapkv__request__descriptor, cc);
    req.version = 1;
    req.command_case = cc;
    *(void **)((char *)&req + fd->offset) = cmd;
    size_t len = snapkv__request__get_packed_size(&req);
    uint8_t *buf = malloc(len + 1);
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!buf || !f)
        exit(1);
    buf[0] = id;
    snapkv__request__pack(&req, buf + 1);
    fwrite(buf, 1, len + 1, f);
    fclose(f);
    free(buf);
}

/* A command whose only field set is session_id (one byte: the newest session). */
static void write_session_seed(const char *dir, const char *name, uint8_t id, Snapkv__Request__CommandCase cc)
{
    static uint8_t newest[1] = {0};
    const ProtobufCFieldDescriptor *fd = protobuf_c_message_descriptor_get_field(&snapkv__request__descriptor, cc);
    const ProtobufCMessageDescriptor *md = fd->descriptor;
    ProtobufCMessage *m = calloc(1, md->sizeof_message);
    if (!m)
        exit(1);
    md->message_init(m);
    *bytes_field(m, "session_id") = (ProtobufCBinaryData){1, newest};
    write_seed(dir, name, id, cc, m);
    free(m);
}

/* One valid request per command the worker runs. */
static void write_seeds(const char *dir)
{
    static const struct {
        const char *name;
        Snapkv__Request__CommandCase cc;
        uint8_t id;
    } plain[] = {{"fork", SNAPKV__REQUEST__COMMAND_FORK, 0},          {"release", SNAPKV__REQUEST__COMMAND_RELEASE, 1},
                 {"inspect", SNAPKV__REQUEST__COMMAND_INSPECT, 3},    {"evict", SNAPKV__REQUEST__COMMAND_EVICT, 3},
                 {"pin", SNAPKV__REQUEST__COMMAND_PIN, 3},            {"cancel", SNAPKV__REQUEST__COMMAND_CANCEL, 2}};
    for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++)
        write_session_seed(dir, plain[i].name, plain[i].id, plain[i].cc);

    static uint8_t newest[1] = {0};
    ProtobufCBinaryData sid = {1, newest};
    uint32_t toks[12] = {11, 48, 85, 122, 159, 196, 233, 14, 51, 88, 125, 162};
    Snapkv__CompressSpec spec = SNAPKV__COMPRESS_SPEC__INIT;
    spec.spec = "policy=snapkv,budget=6,window=4";
    Snapkv__Sampling samp = SNAPKV__SAMPLING__INIT;
    samp.max_tokens = 3;
    Snapkv__BufferRef buf = SNAPKV__BUFFER_REF__INIT;
    buf.kind_case = SNAPKV__BUFFER_REF__KIND_SHM_NAME;
    buf.shm_name = "@";
    buf.size = SHM_BYTES;

    Snapkv__PrefillRequest p = SNAPKV__PREFILL_REQUEST__INIT;
    p.n_tokens = 12;
    p.tokens = toks;
    p.compress = &spec;
    write_seed(dir, "prefill", 0, SNAPKV__REQUEST__COMMAND_PREFILL, &p);
    Snapkv__PrefillRequest pt = SNAPKV__PREFILL_REQUEST__INIT;
    pt.text = "Hello world, the pass key is 12345.";
    write_seed(dir, "prefill-text", 1, SNAPKV__REQUEST__COMMAND_PREFILL, &pt);
    /* 40 tokens, full cache: past a block and the small-batch size, so the inputs made from it
     * reuse each other's prefixes, and RELEASEs keep them (prefix-retain-bytes); the same
     * compressed keeps its prompt's rows */
    uint32_t long_toks[40];
    for (int i = 0; i < 40; i++)
        long_toks[i] = (uint32_t)((i * 37 + 11) % 200);
    Snapkv__PrefillRequest pl = SNAPKV__PREFILL_REQUEST__INIT;
    pl.n_tokens = 40;
    pl.tokens = long_toks;
    write_seed(dir, "prefill-long", 0, SNAPKV__REQUEST__COMMAND_PREFILL, &pl);
    pl.compress = &spec; /* and compressed: its prompt rows kept before the cut */
    write_seed(dir, "prefill-long-snapkv", 1, SNAPKV__REQUEST__COMMAND_PREFILL, &pl);
    pl.prompt_logprobs = true; /* scored: every row's output, no prefix reuse */
    write_seed(dir, "prefill-long-scored", 0, SNAPKV__REQUEST__COMMAND_PREFILL, &pl);
    pl.prompt_top_logprobs = 5; /* and each position's 5 most likely, ranked on the host */
    write_seed(dir, "prefill-long-top", 0, SNAPKV__REQUEST__COMMAND_PREFILL, &pl);
    pl.prompt_top_logprobs = 0;

    Snapkv__AppendRequest a = SNAPKV__APPEND_REQUEST__INIT;
    a.session_id = sid;
    a.n_tokens = 3;
    a.tokens = toks;
    write_seed(dir, "append", 0, SNAPKV__REQUEST__COMMAND_APPEND, &a);
    a.prompt_logprobs = true; /* scored: the first from the session's logits */
    write_seed(dir, "append-scored", 0, SNAPKV__REQUEST__COMMAND_APPEND, &a);
    a.prompt_top_logprobs = 20; /* the most a position may ask for */
    write_seed(dir, "append-top", 0, SNAPKV__REQUEST__COMMAND_APPEND, &a);
    a.prompt_top_logprobs = 0;
    a.prompt_logprobs = false;

    Snapkv__DecodeRequest d = SNAPKV__DECODE_REQUEST__INIT;
    d.session_id = sid;
    d.sampling = &samp;
    write_seed(dir, "decode", 0, SNAPKV__REQUEST__COMMAND_DECODE, &d);
    static char *stops[2] = {", ", "e"};
    Snapkv__Sampling samp_stop = samp;
    samp_stop.max_tokens = 8;
    samp_stop.n_stop = 2;
    samp_stop.stop = stops;
    Snapkv__DecodeRequest ds = d;
    ds.sampling = &samp_stop;
    ds.stream = true;
    write_seed(dir, "decode-stop", 1, SNAPKV__REQUEST__COMMAND_DECODE, &ds);
    Snapkv__Sampling samp_lp = samp; /* log-probabilities, collected and streamed */
    samp_lp.logprobs = true;
    samp_lp.top_logprobs = 3;
    samp_lp.temperature = 0.8f;
    Snapkv__DecodeRequest dl = d;
    dl.sampling = &samp_lp;
    write_seed(dir, "decode-logprobs", 0, SNAPKV__REQUEST__COMMAND_DECODE, &dl);
    dl.stream = true;
    write_seed(dir, "decode-logprobs-stream", 1, SNAPKV__REQUEST__COMMAND_DECODE, &dl);
    static Snapkv__LogitBias lb[2] = {SNAPKV__LOGIT_BIAS__INIT, SNAPKV__LOGIT_BIAS__INIT};
    static Snapkv__LogitBias *lbs[2] = {&lb[0], &lb[1]};
    lb[0].token = 48;
    lb[0].bias = -100.0f;
    lb[1].token = 85;
    lb[1].bias = 3.5f;
    Snapkv__Sampling samp_pen = samp; /* min-p, the penalties, logit biases */
    samp_pen.max_tokens = 6;
    samp_pen.temperature = 0.9f;
    samp_pen.min_p = 0.05f;
    samp_pen.repetition_penalty = 1.3f;
    samp_pen.repetition_last_n = 8;
    samp_pen.frequency_penalty = 0.5f;
    samp_pen.presence_penalty = -0.5f;
    samp_pen.n_logit_bias = 2;
    samp_pen.logit_bias = lbs;
    Snapkv__DecodeRequest dp = d;
    dp.sampling = &samp_pen;
    write_seed(dir, "decode-penalties", 0, SNAPKV__REQUEST__COMMAND_DECODE, &dp);
    Snapkv__TokenizeRequest tk = SNAPKV__TOKENIZE_REQUEST__INIT; /* no session: id unused */
    tk.text = "<|im_start|>user\nHi, the pass key is 12345.<|im_end|>";
    write_seed(dir, "tokenize", 0, SNAPKV__REQUEST__COMMAND_TOKENIZE, &tk);
    tk.chat = true;
    tk.append = true;
    write_seed(dir, "tokenize-markup", 0, SNAPKV__REQUEST__COMMAND_TOKENIZE, &tk);
    Snapkv__DetokenizeRequest dt = SNAPKV__DETOKENIZE_REQUEST__INIT;
    dt.n_tokens = 12;
    dt.tokens = toks;
    dt.skip_special = true;
    write_seed(dir, "detokenize", 0, SNAPKV__REQUEST__COMMAND_DETOKENIZE, &dt);

    Snapkv__CompressRequest c = SNAPKV__COMPRESS_REQUEST__INIT;
    c.session_id = sid;
    c.compress = &spec;
    write_seed(dir, "compress", 0, SNAPKV__REQUEST__COMMAND_COMPRESS, &c);

    Snapkv__ExportKvRequest e = SNAPKV__EXPORT_KV_REQUEST__INIT;
    e.session_id = sid;
    e.buffer = &buf;
    write_seed(dir, "export", 0, SNAPKV__REQUEST__COMMAND_EXPORT_KV, &e);

    uint32_t kept_h[1] = {2};
    Snapkv__LayerKept lk[2];
    for (int l = 0; l < 2; l++) {
        snapkv__layer_kept__init(&lk[l]);
        lk[l].layer = (uint32_t)l;
        lk[l].kept = 2;
        lk[l].n_kept_per_head = 1;
        lk[l].kept_per_head = kept_h;
    }
    Snapkv__LayerKept *lks[2] = {&lk[0], &lk[1]};
    uint32_t pos[4] = {0, 1, 0, 1};
    Snapkv__ImportKvRequest im = SNAPKV__IMPORT_KV_REQUEST__INIT;
    im.buffer = &buf;
    im.n_kept = 2;
    im.kept = lks;
    im.n_positions = 4;
    im.positions = pos;
    im.n_tokens = 2;
    im.tokens = toks;
    im.original_length = 2;
    write_seed(dir, "import", 0, SNAPKV__REQUEST__COMMAND_IMPORT_KV, &im);

    Snapkv__ListRequest ls = SNAPKV__LIST_REQUEST__INIT;
    write_seed(dir, "list", 3, SNAPKV__REQUEST__COMMAND_LIST, &ls);
    Snapkv__SaveRequest sv = SNAPKV__SAVE_REQUEST__INIT;
    sv.session_id = sid;
    sv.name = "doc";
    write_seed(dir, "save", 3, SNAPKV__REQUEST__COMMAND_SAVE, &sv);
    Snapkv__LoadRequest ld = SNAPKV__LOAD_REQUEST__INIT;
    ld.name = "doc";
    write_seed(dir, "load", 3, SNAPKV__REQUEST__COMMAND_LOAD, &ld);
}

#define FILE_INPUT 0xFE /* byte 0 of an input that is a saved session's file */

/* LOADs the file bytes data[0..size) as "fz" for tenant "t" on the admin endpoint. */
static void load_file(const uint8_t *data, size_t size)
{
    char path[160];
    snprintf(path, sizeof path, "%s/fz.skv", g.state_dir);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, size, f) != size || fclose(f) != 0)
        __builtin_trap();
    Snapkv__LoadRequest ld = SNAPKV__LOAD_REQUEST__INIT;
    ld.name = "fz";
    ld.tenant = "t";
    Snapkv__Request q = SNAPKV__REQUEST__INIT;
    q.command_case = SNAPKV__REQUEST__COMMAND_LOAD;
    q.load = &ld;
    if (submit_copy(1, 3, &q))
        drain(1, 3);
}

/* Runs req (a PREFILL, a SAVE) on the worker, on the admin endpoint when admin. */
static void run_seed_request(Snapkv__Request *req, bool admin)
{
    if (!submit_copy(admin, admin ? 3 : 0, req))
        exit(1);
    drain(admin, admin ? 3 : 0);
}

/* Two files SAVE wrote (a 3-token full session, and a 12-token one compressed to 6 rows a
 * head), each as an input: FILE_INPUT and the file. */
static void write_file_seeds(const char *dir)
{
    uint32_t toks[12] = {11, 48, 85, 122, 159, 196, 233, 14, 51, 88, 125, 162};
    Snapkv__CompressSpec spec = SNAPKV__COMPRESS_SPEC__INIT;
    spec.spec = "policy=snapkv,budget=6,window=4";
    static uint8_t newest[1] = {0};
    for (int k = 0; k < 2; k++) {
        Snapkv__PrefillRequest p = SNAPKV__PREFILL_REQUEST__INIT;
        p.n_tokens = k ? 12 : 3;
        p.tokens = toks;
        p.compress = k ? &spec : NULL;
        Snapkv__Request req = SNAPKV__REQUEST__INIT;
        req.command_case = SNAPKV__REQUEST__COMMAND_PREFILL;
        req.prefill = &p;
        run_seed_request(&req, false);
        char path[512];
        snprintf(path, sizeof path, "%s/seed.skv", g.state_dir);
        unlink(path); /* a SAVE that failed leaves no file, not the one before (the next check exits) */
        Snapkv__SaveRequest sv = SNAPKV__SAVE_REQUEST__INIT;
        sv.session_id = (ProtobufCBinaryData){1, newest};
        sv.name = "seed";
        req = (Snapkv__Request)SNAPKV__REQUEST__INIT;
        req.command_case = SNAPKV__REQUEST__COMMAND_SAVE;
        req.save = &sv;
        run_seed_request(&req, true);
        FILE *f = fopen(path, "rb");
        uint8_t file[1 << 16];
        size_t n = f ? fread(file + 1, 1, sizeof file - 1, f) : 0;
        if (f)
            fclose(f);
        if (n == 0)
            exit(1);
        file[0] = FILE_INPUT;
        snprintf(path, sizeof path, "%s/file-%s", dir, k ? "snapkv" : "full");
        f = fopen(path, "wb");
        if (!f || fwrite(file, 1, n + 1, f) != n + 1 || fclose(f) != 0)
            exit(1);
    }
}

static void cleanup(void)
{
    char cmd[128];
    shm_unlink(g.shm_name);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g.state_dir);
    if (system(cmd) != 0)
        fprintf(stderr, "fuzz_worker: could not remove %s\n", g.state_dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    const char *seeds = NULL;
    for (int i = 1; i + 1 < *argc; i++)
        if (strcmp((*argv)[i], "-seeds") == 0)
            seeds = (*argv)[i + 1];
    if (seeds)
        write_seeds(seeds); /* the files SAVE writes after the worker starts, below */
    void *tiny = NULL;
    if (tiny_setup(&tiny)) {
        fprintf(stderr, "fuzz_worker: tiny model: %s (run from the source tree)\n", skv_error_msg());
        exit(1);
    }
    g.tiny = tiny;
    snprintf(g.state_dir, sizeof g.state_dir, "/tmp/skv-fuzz-state-%d", (int)getpid());
    snprintf(g.shm_name, sizeof g.shm_name, "/skv-fuzz-%d", (int)getpid());
    if (mkdir(g.state_dir, 0700) != 0 || skv_config_init(&g.cfg))
        exit(1);
    /* small limits, so memory stays bounded however many sessions the inputs make */
    const char *set[][2] = {{"state-dir", g.state_dir}, {"pool-size", "16M"}, {"max-prompt-tokens", "256"},
                            {"max-new-tokens", "8"}, {"max-sessions-per-tenant", "24"},
                            {"max-bytes-per-tenant", "8M"}, {"prefix-retain-bytes", "4M"}};
    for (size_t i = 0; i < sizeof set / sizeof set[0]; i++)
        if (skv_config_set(&g.cfg, set[i][0], set[i][1]) != SKV_OK) {
            fprintf(stderr, "fuzz_worker: %s: %s\n", set[i][0], skv_error_msg());
            exit(1);
        }
    int fd = shm_open(g.shm_name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 || posix_fallocate(fd, 0, SHM_BYTES) != 0) /* allocated: an EXPORT writes only into such */
        exit(1);
    close(fd);
    g.zctx = zmq_ctx_new();
    g.pull = zmq_socket(g.zctx, ZMQ_PULL);
    if (!g.pull || zmq_bind(g.pull, REPLIES) < 0 ||
        skv_worker_start(g.zctx, REPLIES, &g.cfg, g.tiny->m, &g.w) != SKV_OK) {
        fprintf(stderr, "fuzz_worker: worker: %s\n", skv_error_msg());
        exit(1);
    }
    atexit(cleanup);
    if (seeds) {
        write_file_seeds(seeds);
        exit(0);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    if (data[0] == FILE_INPUT) {
        load_file(data + 1, size - 1);
        check_alive();
        return 0;
    }
    Snapkv__Request *req = snapkv__request__unpack(NULL, size - 1, data + 1);
    if (!req)
        return 0; /* the socket thread answers SKV_E_PROTO */
    switch (req->command_case) {
    case SNAPKV__REQUEST__COMMAND__NOT_SET:
    case SNAPKV__REQUEST__COMMAND_HELLO:
    case SNAPKV__REQUEST__COMMAND_STATUS:
    case SNAPKV__REQUEST__COMMAND_CONFIG_GET:
    case SNAPKV__REQUEST__COMMAND_REGISTER_BUFFER:
        snapkv__request__free_unpacked(req, NULL);
        return 0; /* answered by the socket thread */
    default:
        break;
    }
    req->version = 1;
    rewrite(req);
    int sock = req->command_case >= SNAPKV__REQUEST__COMMAND_STATUS;
    uint8_t id = data[0] % 4;
    if (submit(sock, id, req))
        drain(sock, id);
    check_alive();
    return 0;
}
