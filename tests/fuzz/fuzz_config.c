/* libFuzzer target for the config file (/etc/snapkvd.conf): the input is written as a file and
 * loaded over the defaults. It loads, or fails with a message that names the file. After a
 * load, every option formats (CONFIG GET), and setting each option back from its own text
 * gives the same text, so what `snapkvctl config` shows can be pasted into a config file.
 * Build and run with scripts/fuzz; seeded with systemd/snapkvd.conf. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/status.h"
#include "daemon/config.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char g_path[64];

static void cleanup(void)
{
    unlink(g_path);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    snprintf(g_path, sizeof g_path, "%s/skv-fuzz-conf-%d", access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp",
             (int)getpid());
    atexit(cleanup);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    FILE *f = fopen(g_path, "wb");
    if (!f || fwrite(data, 1, size, f) != size || fclose(f) != 0)
        __builtin_trap();
    struct skv_config cfg, again;
    if (skv_config_init(&cfg) != SKV_OK || skv_config_init(&again) != SKV_OK)
        __builtin_trap();
    int rc = skv_config_load_file(&cfg, g_path);
    if (rc != SKV_OK) {
        if (rc > 0 || !strstr(skv_error_msg(), g_path))
            __builtin_trap(); /* the message names the file */
    } else {
        size_t n;
        const struct skv_config_option *opt = skv_config_options(&n);
        for (size_t i = 0; i < n; i++) {
            char text[4096], back[4096];
            if (skv_config_get(&cfg, opt[i].name, text, sizeof text) != SKV_OK)
                __builtin_trap();
            if (skv_config_set(&again, opt[i].name, text) != SKV_OK)
                __builtin_trap(); /* a value the daemon holds is a value it accepts */
            if (skv_config_get(&again, opt[i].name, back, sizeof back) != SKV_OK || strcmp(text, back) != 0)
                __builtin_trap();
        }
    }
    skv_config_free(&again);
    skv_config_free(&cfg);
    return 0;
}
