/* The shared store for cold sessions (store = redis://HOST[:PORT][/DB] or unix://PATH): one
 * connection to Redis or Valkey through hiredis, made when first needed, made again at once when
 * a reused one turns out closed (an idle connection the server or a proxy dropped; not after a
 * timeout), and after a
 * failure to connect not again for a second, then two, four, ... up to 30; a timeout on every
 * network step. Knows keys and bytes, not sessions (requests.c spills and loads them). Not
 * thread-safe: the worker thread owns it. */
#ifndef SKV_STORE_H
#define SKV_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

struct skv_store;

/* Parses url (SKV_E_INVAL with a message naming what is wrong); connects nothing yet. A take
 * refuses a value over max_value bytes (store-max-bytes). */
int skv_store_new(const char *url, int timeout_ms, uint64_t max_value, struct skv_store **out);
void skv_store_free(struct skv_store **st_p);
/* fn(user) runs on the calling thread before each wait for the store's socket: a command whose
 * value moves slowly, within its deadline, tells the daemon's watchdog its thread is alive. */
void skv_store_on_progress(struct skv_store *st, void (*fn)(void *user), void *user);
/* store-user and store-password-file: each new connection sends AUTH [user] password, the
 * password read from the file then (so a rotated one is used from the next connection). The file
 * is read now too: SKV_E_INVAL, SKV_E_PERM or SKV_E_IO naming it when it cannot serve (see
 * skv_store_read_password). user NULL or "": Redis's default user; password_file NULL or "":
 * no AUTH (then user must be empty too). */
int skv_store_auth(struct skv_store *st, const char *user, const char *password_file);
/* The password in path: one line (a final newline dropped), not empty, the file at most cap - 1
 * bytes; a regular file that neither other users nor its group (but root's) can read: the
 * clients share the daemon's group. */
int skv_store_read_password(const char *path, char *out, size_t cap);
/* store-secret-file: the secret the daemons sharing a store sign their values with, in a file
 * checked as the password's (at least 16 bytes, not the password in password_file, which may be
 * NULL); *key its BLAKE2b-256 (personal "snapkv-store-mac"), the MAC's key. */
#define SKV_STORE_KEY_BYTES 32
int skv_store_read_key(const char *path, const char *password_file, unsigned char key[SKV_STORE_KEY_BYTES]);
/* The store cfg names (store, its timeout, store-max-bytes, store-user, store-password-file),
 * with store-secret-file its key (*is_signed set), and with store-accept-secret-file (a
 * rotation's second secret, another than the first) that one's key in accept (*has_accept
 * set); every file read and checked. On an error, *out is NULL and the keys cleared. */
struct skv_config;
int skv_store_open(const struct skv_config *cfg, struct skv_store **out, unsigned char key[SKV_STORE_KEY_BYTES],
                   bool *is_signed, unsigned char accept[SKV_STORE_KEY_BYTES], bool *has_accept);

/* Writes exactly the n bytes of a value to f and returns SKV_OK, or an error status. */
typedef int (*skv_store_writer)(void *user, FILE *f);
/* SET key value EX ttl_s, a spill: the value is the n bytes fn writes, streamed onto the
 * connection as they come (no copy of it is made; fn may be called a second time, when a reused
 * connection turns out closed). SKV_E_IO when the store cannot be reached or refuses it; fn's
 * status when it fails; SKV_E_INTERNAL when it writes other than n bytes. */
int skv_store_put_stream(struct skv_store *st, const char *key, uint64_t n, int64_t ttl_s, skv_store_writer fn,
                         void *user);
/* SET key value EX ttl_s of a value skv_store_take took that did not load (not a spill). */
int skv_store_put_back(struct skv_store *st, const char *key, const void *data, size_t n, int64_t ttl_s);
/* GETDEL key: the value is removed from the store as it is read, so two hosts never take one.
 * *data and *n: the value, valid until skv_store_value_free(*value). SKV_E_NOT_FOUND when there
 * is none; SKV_E_IO as above; SKV_E_LIMIT for a value over max_value, which a script run in the
 * store (EVAL: STRLEN, then GETDEL) leaves there; when the store refuses scripts (an ACL), a
 * plain GETDEL, and such a value, or one SKV_E_NOMEM cannot hold, is lost. */
int skv_store_take(struct skv_store *st, const char *key, const void **data, size_t *n, void **value);
/* The same, and when key has no value, GETDEL alt (NULL: none; a key an earlier daemon named the
 * value by): one miss when neither has one. *took_alt: whether it was alt's; *left: an
 * SKV_E_LIMIT whose value stays in the store. */
int skv_store_take_either(struct skv_store *st, const char *key, const char *alt, const void **data, size_t *n,
                          void **value, bool *took_alt, bool *left);
void skv_store_value_free(void *value);
/* EXISTS key: SKV_OK when the store holds it, SKV_E_NOT_FOUND when not; SKV_E_IO as above. */
int skv_store_exists(struct skv_store *st, const char *key);
/* DEL key: SKV_OK when there was one, SKV_E_NOT_FOUND when not; SKV_E_IO as above (counted as a
 * load failure), SKV_E_NOMEM (skv_store_delete_many of one key). */
int skv_store_delete(struct skv_store *st, const char *key);
/* DEL of n keys in one command: *deleted how many the store had; SKV_E_IO as above (counted as
 * a load failure), SKV_E_NOMEM. */
int skv_store_delete_many(struct skv_store *st, const char *const *keys, int n, int *deleted);
/* SCAN *cursor MATCH match COUNT 1000, one page: the keys into *keys, *n of them one after the
 * other each ended by a NUL (NULL when none; free with skv_store_value_free), and the next
 * cursor into *cursor (0: the walk is over). A key may come twice in one walk. SKV_E_IO as
 * above (counted as a load failure); a reply of more than 20000 keys is refused as one the
 * command does not have. */
int skv_store_scan(struct skv_store *st, uint64_t *cursor, const char *match, char **keys, int *n);
/* GETRANGE key -cap -1 of n keys, pipelined: every command sent, then every reply read, all
 * before one store-timeout-ms (one round trip for the batch, not n). Key i's last (up to) cap bytes
 * into out + i * cap, got[i] of them (0: no value); state[i] SKV_TAIL_VALUE (a value or none),
 * SKV_TAIL_REFUSED (the store's ACL refused the key: NOPERM) or SKV_TAIL_ERROR (another error
 * answer). SKV_OK when every key's state is SKV_TAIL_VALUE; SKV_E_IO naming the first other
 * error answer, else the first NOPERM (skv_store_refused: only NOPERMs), with every state
 * set; SKV_E_IO (the connection failed, the deadline passed: no state is known), SKV_E_NOMEM (or
 * SKV_E_LIMIT: an answer past store-max-bytes), the connection dropped. A failure is counted as
 * a load failure. */
enum { SKV_TAIL_VALUE = 0, SKV_TAIL_REFUSED = 1, SKV_TAIL_ERROR = 2 };
int skv_store_tails(struct skv_store *st, const char *const *keys, int n, size_t cap, unsigned char *out,
                    size_t *got, signed char *state);
/* True when the last command failed because the store's ACL refused it (an error reply that
 * starts "NOPERM": the connection is fine, the user may not run that command or touch that key). */
bool skv_store_refused(const struct skv_store *st);
/* A spill that failed before it reached the store (counted with those the store refused). */
void skv_store_count_spill_failure(struct skv_store *st);

struct skv_store_stats {
    uint64_t spills, spill_bytes, spill_failures; /* puts that took, their bytes, spills that failed */
    uint64_t loads, misses, load_failures;        /* takes that found a value, none, or failed */
};
void skv_store_stats(const struct skv_store *st, struct skv_store_stats *out);
/* The url as given (for messages), and what it names: a host and port, or a socket path and
 * port 0; the database. */
const char *skv_store_url(const struct skv_store *st);
void skv_store_target(const struct skv_store *st, const char **host, int *port, int *db);

#endif
