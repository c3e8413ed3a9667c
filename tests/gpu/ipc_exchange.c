/* Two processes exchange a session through CUDA IPC with a snapkvd on the CUDA backend
 * (tests/gpu/check.sh runs it; built only when CUDA is, never run in CI).
 *
 * The parent cudaMallocs a buffer and hands its IPC handle to the child. The parent prefills a
 * prompt (SnapKV) and exports the session into its CUDA buffer and into shared memory. The
 * child opens the parent's buffer with cudaIpcOpenMemHandle and checks it holds exactly what
 * the shared-memory export holds; then it imports a new session from the parent's buffer (the
 * daemon opens the handle), appends the same token to both sessions and decodes both greedily:
 * the tokens must be equal.
 * Usage: ipc_exchange ENDPOINT. Exit 0 on success; a message on stderr otherwise. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "snapkv.h"

#define PROMPT_TOKENS 600
#define DECODE_TOKENS 16
#define BUF_BYTES (64u << 20)

struct handoff {
    cudaIpcMemHandle_t handle;
    struct snapkv_session_id id;
    char shm_name[64];
    unsigned long long bytes;
};

static int die(const char *who, const char *what)
{
    fprintf(stderr, "ipc_exchange %s: %s: %s\n", who, what, snapkv_last_error());
    return 1;
}

static int read_all(int fd, void *p, size_t n)
{
    for (size_t got = 0; got < n;) {
        ssize_t r = read(fd, (char *)p + got, n - got);
        if (r <= 0)
            return -1;
        got += (size_t)r;
    }
    return 0;
}

static int decode_after(snapkv_client_t *c, const struct snapkv_session_id *id, uint32_t token, uint32_t *out)
{
    struct snapkv_append_opts ao = {.tokens = &token, .n_tokens = 1};
    if (snapkv_append(c, id, &ao, NULL))
        return -1;
    struct snapkv_sampling sp;
    snapkv_sampling_defaults(&sp);
    sp.max_tokens = DECODE_TOKENS;
    sp.stop_at_eos = false;
    struct snapkv_decode_result dr;
    if (snapkv_decode(c, id, &sp, NULL, NULL, &dr))
        return -1;
    int ok = dr.n_tokens == DECODE_TOKENS;
    if (ok)
        memcpy(out, dr.tokens, DECODE_TOKENS * sizeof *out);
    snapkv_decode_result_free(&dr);
    return ok ? 0 : -1;
}

/* The child: no CUDA before the fork, its own context after. */
static int child(const char *endpoint, int rfd, int wfd)
{
    struct handoff h;
    if (read_all(rfd, &h, sizeof h))
        return die("child", "reading the handoff");
    void *dev = NULL;
    if (cudaIpcOpenMemHandle(&dev, h.handle, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
        fprintf(stderr, "ipc_exchange child: cudaIpcOpenMemHandle failed\n");
        return 1;
    }
    char *mine = malloc(h.bytes);
    if (!mine || cudaMemcpy(mine, dev, h.bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
        fprintf(stderr, "ipc_exchange child: reading the parent's buffer failed\n");
        return 1;
    }
    cudaIpcCloseMemHandle(dev);
    /* what the daemon wrote into the parent's GPU buffer == its shared-memory export */
    snapkv_client_t *c = NULL;
    struct snapkv_connect_opts co = {.tenant = "ipc"};
    if (snapkv_connect(endpoint, &co, &c))
        return die("child", "connect");
    struct snapkv_shm shm;
    if (snapkv_shm_create("ipcchk", h.bytes + 4096, &shm))
        return die("child", "shm");
    struct snapkv_kv_layout lay;
    if (snapkv_export_kv(c, &h.id, &shm, 0, &lay))
        return die("child", "export to shared memory");
    if (lay.bytes_written != h.bytes || memcmp(mine, shm.addr, h.bytes) != 0) {
        fprintf(stderr, "ipc_exchange child: the CUDA export differs from the shared-memory export\n");
        return 1;
    }
    /* a new session from the parent's CUDA buffer */
    struct snapkv_cuda_ipc_buffer cb = {.size = BUF_BYTES};
    memcpy(cb.handle, &h.handle, sizeof cb.handle);
    struct snapkv_import_opts io = {.cuda = &cb, .layers = lay.layers, .n_layers = lay.n_layers,
                                    .positions = lay.positions, .n_positions = lay.n_positions,
                                    .original_length = PROMPT_TOKENS};
    struct snapkv_session_id imported;
    if (snapkv_import_kv(c, &io, &imported))
        return die("child", "import from the parent's CUDA buffer");
    uint32_t a[DECODE_TOKENS], b[DECODE_TOKENS];
    if (decode_after(c, &h.id, 42, a) || decode_after(c, &imported, 42, b))
        return die("child", "append + decode");
    if (memcmp(a, b, sizeof a) != 0) {
        fprintf(stderr, "ipc_exchange child: the imported session decodes differently\n");
        return 1;
    }
    /* a stated size past the allocation: the daemon checks the device's own extent and refuses
     * a range beyond it, copying nothing (before, it read wherever the offset pointed) */
    struct snapkv_cuda_ipc_buffer liar = cb;
    liar.size = (uint64_t)BUF_BYTES << 8;
    struct snapkv_import_opts il = io;
    il.cuda = &liar;
    il.offset = (uint64_t)BUF_BYTES * 4;
    struct snapkv_session_id never;
    if (snapkv_import_kv(c, &il, &never) != SNAPKV_E_LIMIT || !strstr(snapkv_last_error(), "allocation holds")) {
        fprintf(stderr, "ipc_exchange child: a stated size past the allocation was not refused: %s\n",
                snapkv_last_error());
        return 1;
    }
    snapkv_kv_layout_free(&lay);
    snapkv_shm_destroy(&shm);
    snapkv_release(c, &imported);
    snapkv_close(&c);
    free(mine);
    char ok = 1;
    return write(wfd, &ok, 1) == 1 ? 0 : 1;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: ipc_exchange ENDPOINT\n");
        return 2;
    }
    int to_child[2], from_child[2];
    if (pipe(to_child) || pipe(from_child))
        return 1;
    pid_t pid = fork();
    if (pid == 0) {
        close(to_child[1]);
        close(from_child[0]);
        _exit(child(argv[1], to_child[0], from_child[1]));
    }
    close(to_child[0]);
    close(from_child[1]);

    struct handoff h;
    memset(&h, 0, sizeof h);
    void *buf = NULL;
    if (cudaMalloc(&buf, BUF_BYTES) != cudaSuccess || cudaIpcGetMemHandle(&h.handle, buf) != cudaSuccess) {
        fprintf(stderr, "ipc_exchange: cudaMalloc / cudaIpcGetMemHandle failed\n");
        return 1;
    }
    snapkv_client_t *c = NULL;
    struct snapkv_connect_opts co = {.tenant = "ipc"};
    if (snapkv_connect(argv[1], &co, &c))
        return die("parent", "connect");
    uint32_t ids[PROMPT_TOKENS];
    for (int i = 0; i < PROMPT_TOKENS; i++)
        ids[i] = (uint32_t)(100 + (i * 7919) % 40000);
    struct snapkv_prefill_opts po = {.tokens = ids, .n_tokens = PROMPT_TOKENS, .compress = "policy=snapkv,ratio=0.1",
                                     .lease_seconds = 120};
    struct snapkv_prefill_result pr;
    if (snapkv_prefill(c, &po, &pr))
        return die("parent", "prefill");
    struct snapkv_cuda_ipc_buffer cb = {.size = BUF_BYTES};
    memcpy(cb.handle, &h.handle, sizeof cb.handle);
    struct snapkv_kv_layout lay;
    if (snapkv_export_kv_cuda(c, &pr.id, &cb, 0, 0, 0, &lay))
        return die("parent", "export into the CUDA buffer");
    h.id = pr.id;
    h.bytes = lay.bytes_written;
    snapkv_kv_layout_free(&lay);
    if (write(to_child[1], &h, sizeof h) != (ssize_t)sizeof h)
        return 1;
    char ok = 0;
    int st = 0;
    int got = read_all(from_child[0], &ok, 1);
    waitpid(pid, &st, 0);
    snapkv_release(c, &pr.id);
    snapkv_prefill_result_free(&pr);
    snapkv_close(&c);
    cudaFree(buf);
    if (got || !ok || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "ipc_exchange: the child failed\n");
        return 1;
    }
    printf("ipc_exchange: ok (%llu bytes of K/V through the parent's GPU buffer, %d decoded tokens equal)\n",
           h.bytes, DECODE_TOKENS);
    return 0;
}
