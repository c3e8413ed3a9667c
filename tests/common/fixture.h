/* Test helpers: where fixtures and the model are, reading binary fixtures and JSON. */
#ifndef SKV_TEST_FIXTURE_H
#define SKV_TEST_FIXTURE_H

#include <jansson.h>
#include <stddef.h>

/* $SKV_SRCDIR/rel (SKV_SRCDIR defaults to "."); static buffer per call site is not needed:
 * returns a malloc'd string. */
char *fixture_path(const char *rel);
/* The default model ($SKV_MODEL or $SKV_SRCDIR/models/SmolLM2-135M-Instruct.Q4_1.gguf);
 * NULL when the file does not exist. malloc'd. */
char *fixture_model_path(void);
/* The second model of the quality runs ($SKV_MODEL_QWEN or
 * $SKV_SRCDIR/models/Qwen2.5-Coder-0.5B-Instruct-AWQ.Q4_K_M.gguf, `scripts/fetch-model
 * qwen2.5-coder-0.5b`); NULL when the file does not exist. malloc'd. */
char *fixture_qwen_model_path(void);
/* Reads a whole fixture file; NULL when missing. *size gets its length. */
void *fixture_read(const char *rel, size_t *size);
/* The same for any path (malloc'd). */
void *fixture_read_file(const char *path, size_t *size);
/* Loads a JSON fixture; NULL when missing or invalid. */
json_t *fixture_json(const char *rel);
/* Copies directory `rel` to a fresh temporary directory, renaming files that end in
 * ".fixture" to drop that suffix (weights-like fixtures are committed under that suffix).
 * Returns the temporary path (malloc'd) or NULL. */
char *fixture_stage_dir(const char *rel);
void fixture_remove_dir(char *path);
/* A loopback TCP port nobody listens on now, for a daemon the test is about to start. It is
 * drawn below the kernel's ephemeral range (ip_local_port_range), where no outgoing connection
 * of a test running beside this one can take it between this check and the daemon's bind;
 * -1 when none of a few hundred tries was free. */
int fixture_free_port(void);

/* What `redis-cli -s SOCK ARGS` prints (its first line, the newline cut; "" when it printed
 * nothing or could not run). ARGS is shell text: a pipe may follow. */
void fixture_redis_cli(const char *sock, const char *args, char *out, size_t cap);

/* A child process that will act as user nobody on the ipc:// endpoint of a daemon whose files
 * are in dir (the test's own directory: it and the socket are opened to others). It is forked
 * now, before the caller starts libzmq's threads (under ThreadSanitizer a child forked past a
 * parent's threads cannot start its own), and waits until fixture_other_user_go(). Returns 0 in
 * the child, once let go and running as nobody (it does its work and _exit()s); the child's pid
 * in the caller, with *go the pipe to let it go; -1 when this process is not root or there is no
 * user nobody (the caller skips that part). */
int fixture_other_user_fork(const char *dir, const char *endpoint, int *go);
/* Lets the child go, waits for it and returns its exit status (100 + signal if killed). */
int fixture_other_user_go(int pid, int go);

#endif
