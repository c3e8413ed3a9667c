/* example_client.c: a small program using libsnapkv. It prefills a prompt with SnapKV
 * compression, reads the K/V of the compressed cache through shared memory, forks the session,
 * scores two candidate answers on forks (how likely the compressed cache finds each), streams a
 * greedy answer, samples another from the fork, and releases everything.
 *
 *   cc example_client.c $(pkg-config --cflags --libs snapkv) -o example_client
 *   ./example_client [ENDPOINT]        (default ipc:///run/snapkvd/snapkvd.sock)
 *
 * The user running it must be allowed on the daemon's socket (group snapkv in production) and,
 * for the shared-memory export, share a group with the daemon (see snapkv_shm_create). */
#include <snapkv.h>

#include <stdio.h>
#include <stdlib.h>

static const char *document =
    "The Zephyr-7 probe left orbit on a Tuesday. Its mission controllers had named the star tracker "
    "'Margaret' after the engineer who calibrated it, and the probe's passkey for the deep-space "
    "relay was 48213. Three weeks later the probe crossed the orbit of Mars.";

/* Prints the answer as it is generated. Returning nonzero would cancel the decode: snapkv_decode
 * then fails with SNAPKV_E_CANCELLED, and the session keeps the tokens made so far. */
static int on_tokens(void *user, const uint32_t *tokens, size_t n_tokens, const char *text)
{
    (void)user;
    (void)tokens;
    (void)n_tokens;
    fputs(text, stdout);
    fflush(stdout);
    return 0;
}

static int check(int rc, const char *what)
{
    if (rc != SNAPKV_OK)
        fprintf(stderr, "%s: %s (%s)\n", what, snapkv_last_error(), snapkv_status_str(rc));
    return rc;
}

int main(int argc, char **argv)
{
    const char *endpoint = argc > 1 ? argv[1] : "ipc:///run/snapkvd/snapkvd.sock";
    struct snapkv_connect_opts copts = {.tenant = "example", .name = "example_client", .timeout_ms = 120000};
    snapkv_client_t *client = NULL;
    if (check(snapkv_connect(endpoint, &copts, &client), "connect"))
        return 1;

    struct snapkv_server_info info;
    snapkv_server_info(client, &info);
    printf("model %s on %s: %u layers, %u KV heads of %u\n", info.model_name, info.backend, info.n_layers,
           info.n_kv_heads, info.head_dim);

    /* 1. prefill: one chat turn; keep 25% of each layer's KV entries, chosen by SnapKV */
    char prompt[1024];
    snprintf(prompt, sizeof prompt, "%s\n\nWhat was the relay passkey?", document);
    struct snapkv_prefill_opts popts = {
        .text = prompt,
        .chat = true,
        .compress = "policy=snapkv,ratio=0.25,window=16",
    };
    struct snapkv_prefill_result pre;
    int status = 1;
    if (check(snapkv_prefill(client, &popts, &pre), "prefill"))
        goto out_close;
    char hex[SNAPKV_SESSION_ID_HEX_SIZE];
    snapkv_session_id_to_hex(&pre.id, hex, sizeof hex);
    printf("session %s: %u prompt tokens, KV %llu -> %llu bytes\n", hex, pre.n_tokens,
           (unsigned long long)pre.bytes_before, (unsigned long long)pre.bytes_after);

    /* 2. the compressed K/V, read through a shared-memory buffer sized from the prefill's kept
     *    lengths (before decoding grows the cache) */
    uint64_t need = snapkv_kv_bytes(pre.layers, pre.n_layers, info.n_kv_heads, info.head_dim);
    struct snapkv_shm shm;
    if (need && !check(snapkv_shm_create("example", (size_t)need, &shm), "shm")) {
        struct snapkv_kv_layout layout = {0};
        if (!check(snapkv_export_kv(client, &pre.id, &shm, 0, &layout), "export") && layout.n_layers &&
            layout.layers[0].kept) {
            const float *k0 = (const float *)((const char *)shm.addr +
                                              snapkv_kv_offset(&layout, 0, 0, false, info.n_kv_heads, info.head_dim));
            printf("layer %u keeps %u entries; head 0, first kept key (position %u): %.4f %.4f %.4f ...\n",
                   layout.layers[0].layer, layout.layers[0].kept,
                   layout.layers[0].positions ? layout.layers[0].positions[0] : 0, k0[0], k0[1], k0[2]);
        }
        snapkv_kv_layout_free(&layout);
        snapkv_shm_destroy(&shm);
    }

    /* 3. fork before answering, so that a second question starts from the same cache */
    struct snapkv_session_id second;
    if (check(snapkv_fork(client, &pre.id, &second, NULL), "fork"))
        goto out_release;

    /* 4. score two candidate answers, each appended to a fork of its own: the log-probability
     * of each token given the compressed cache and the tokens before it (a daemon older than
     * prompt scores: SNAPKV_E_UNSUPPORTED) */
    static const char *const candidates[] = {"The relay passkey was 48213.", "The relay passkey was 12345."};
    for (int i = 0; i < 2; i++) {
        struct snapkv_session_id probe;
        struct snapkv_scores sc;
        struct snapkv_append_opts ao = {.text = candidates[i]};
        if (check(snapkv_fork(client, &pre.id, &probe, NULL), "fork"))
            goto out_release_both;
        int rc = snapkv_append_scored(client, &probe, &ao, NULL, &sc);
        check(snapkv_release(client, &probe), "release");
        if (check(rc, "append (scored)"))
            goto out_release_both;
        double sum = 0;
        for (size_t k = 0; k < sc.n_logprobs; k++)
            sum += sc.logprobs[k];
        printf("candidate \"%s\": %zu tokens, log-probability %.2f\n", candidates[i], sc.n_logprobs, sum);
        snapkv_scores_free(&sc);
    }

    /* 5. stream a greedy answer (NULL sampling: greedy, stop at end of turn) */
    struct snapkv_sampling sampling;
    snapkv_sampling_defaults(&sampling);
    sampling.max_tokens = 48;
    printf("answer: ");
    struct snapkv_decode_result answer;
    if (check(snapkv_decode(client, &pre.id, &sampling, on_tokens, NULL, &answer), "decode"))
        goto out_release_both;
    printf("\n(%zu tokens, %s)\n", answer.n_tokens, answer.finish_reason);
    snapkv_decode_result_free(&answer);

    /* 6. the fork answers the same question again, sampled this time, collected in one reply */
    struct snapkv_sampling warm = sampling;
    warm.temperature = 0.8f;
    warm.top_p = 0.95f;
    warm.seed = 7;
    if (check(snapkv_decode(client, &second, &warm, NULL, NULL, &answer), "decode"))
        goto out_release_both;
    printf("fork, sampled: %s\n", answer.text);
    snapkv_decode_result_free(&answer);

    status = 0;

out_release_both:
    check(snapkv_release(client, &second), "release");
out_release:
    check(snapkv_release(client, &pre.id), "release");
    snapkv_prefill_result_free(&pre);
out_close:
    snapkv_close(&client);
    return status;
}
