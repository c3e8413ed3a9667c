/* CURVE key files: one Z85 key (40 characters) on a line; blank lines and lines starting
 * with '#' are skipped ('#' is also a Z85 digit, so there are no end-of-line comments). Shared by snapkvd (its secret key, the authorized client keys) and libsnapkv
 * (a client's keys, the server's public key). */
#ifndef SKV_KEYFILE_H
#define SKV_KEYFILE_H

#include <stdbool.h>
#include <stdio.h>

#define SKV_KEY_Z85_LEN 40           /* a 32-byte CURVE key in Z85 */
#define SKV_KEY_BYTES 32
#define SKV_KEYFILE_MAX_BYTES (1 << 20)

/* Who may not read or write a key file, beyond its owner. */
enum skv_keyfile_kind {
    SKV_KEYFILE_PUBLIC,        /* anyone may read it (a public key) */
    SKV_KEYFILE_PRIVATE,       /* others (not owner, not group) may neither read nor write it */
    SKV_KEYFILE_LIST,          /* as PRIVATE, and the group may not write it (authorized keys:
                                * the clients share the daemon's group) */
    SKV_KEYFILE_DAEMON_SECRET, /* the owner's alone: the daemon's secret key (its group holds
                                * every client) */
};

/* Opens a key file for reading and checks it is a regular file no bigger than
 * SKV_KEYFILE_MAX_BYTES, with a mode `kind` allows (and, for the daemon's LIST and
 * DAEMON_SECRET, owned by root or the process's user). Errors name the path and say how to fix
 * the mode. On success *out is the open stream. */
int skv_keyfile_open(const char *path, enum skv_keyfile_kind kind, FILE **out);

/* True when text is exactly one Z85-encoded 32-byte key; key (may be NULL) gets the bytes. */
bool skv_key_z85_decode(const char *text, unsigned char key[SKV_KEY_BYTES]);

/* Reads a file holding exactly one key and copies its 40 characters and a NUL into z85
 * (kind: as for skv_keyfile_open). */
int skv_keyfile_read(const char *path, enum skv_keyfile_kind kind, char z85[SKV_KEY_Z85_LEN + 1]);

/* Splits a key-file line in place: skips a comment line, strips surrounding blanks, returns the
 * first word (NULL for a blank line) and points *rest at what follows it ("" when nothing). */
char *skv_keyfile_words(char *line, char **rest);
/* The next line of f that holds a word (blank and comment lines skipped; *lineno counts every
 * line): 1 with *word and *rest as skv_keyfile_words sets them, 0 at the end of the file, or
 * SKV_E_FORMAT for a line longer than cap - 1. */
int skv_keyfile_next(FILE *f, const char *path, char *line, size_t cap, int *lineno, char **word, char **rest);

#endif
