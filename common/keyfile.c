/* CURVE key files (see keyfile.h): the mode check, Z85 validation and line splitting that
 * snapkvd and libsnapkv share. Reports through skv_errorf, never logs. */
#include "common/keyfile.h"
#include "common/status.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

static const char z85_alphabet[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";

bool skv_key_z85_decode(const char *text, unsigned char key[SKV_KEY_BYTES])
{
    unsigned char tmp[SKV_KEY_BYTES];
    if (strlen(text) != SKV_KEY_Z85_LEN || strspn(text, z85_alphabet) != SKV_KEY_Z85_LEN)
        return false;
    if (!zmq_z85_decode(tmp, text))
        return false;
    if (key)
        memcpy(key, tmp, sizeof tmp);
    explicit_bzero(tmp, sizeof tmp);
    return true;
}

int skv_keyfile_open(const char *path, enum skv_keyfile_kind kind, FILE **out)
{
    /* O_NONBLOCK: a FIFO at the path would block the open (the socket thread's, at SIGHUP) */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0)
        return skv_errorf(errno == EACCES ? SKV_E_PERM : SKV_E_IO, "key file %s: %s", path, strerror(errno));
    struct stat sb;
    int rc = SKV_OK;
    if (fstat(fd, &sb) < 0)
        rc = skv_errorf(SKV_E_IO, "key file %s: %s", path, strerror(errno));
    else if (!S_ISREG(sb.st_mode))
        rc = skv_errorf(SKV_E_INVAL, "key file %s is not a regular file", path);
    else if (sb.st_size > SKV_KEYFILE_MAX_BYTES)
        rc = skv_errorf(SKV_E_LIMIT, "key file %s is larger than %d bytes", path, SKV_KEYFILE_MAX_BYTES);
    else if (kind != SKV_KEYFILE_PUBLIC && (sb.st_mode & (S_IROTH | S_IWOTH)))
        rc = skv_errorf(SKV_E_PERM, "key file %s is %s by others (mode %04o): refusing it; run 'chmod o-rw %s'",
                        path, sb.st_mode & S_IROTH ? "readable" : "writable", (unsigned)(sb.st_mode & 07777), path);
    else if (kind == SKV_KEYFILE_DAEMON_SECRET && (sb.st_mode & (S_IRGRP | S_IWGRP)))
        rc = skv_errorf(SKV_E_PERM,
                        "key file %s is %s by its group (mode %04o): the daemon's secret key must be its user's "
                        "alone, the clients share its group; refusing it: run 'chown snapkv %s; chmod 0600 %s'",
                        path, sb.st_mode & S_IRGRP ? "readable" : "writable", (unsigned)(sb.st_mode & 07777), path,
                        path);
    else if (kind == SKV_KEYFILE_LIST && (sb.st_mode & S_IWGRP))
        rc = skv_errorf(SKV_E_PERM,
                        "key file %s is writable by its group (mode %04o): a client of the group could add its "
                        "own key; refusing it: run 'chmod g-w %s'",
                        path, (unsigned)(sb.st_mode & 07777), path);
    else if ((kind == SKV_KEYFILE_LIST || kind == SKV_KEYFILE_DAEMON_SECRET) && sb.st_uid != 0 &&
             sb.st_uid != geteuid()) /* its owner may change its mode, and then what it says */
        rc = skv_errorf(SKV_E_PERM,
                        "key file %s belongs to uid %lu, neither root nor the daemon's user (uid %lu): its owner "
                        "could give itself a key; refusing it: run 'chown root %s' (or the daemon's user)",
                        path, (unsigned long)sb.st_uid, (unsigned long)geteuid(), path);
    FILE *f = rc ? NULL : fdopen(fd, "r");
    if (!rc && !f)
        rc = skv_errorf(SKV_E_NOMEM, "key file %s: %s", path, strerror(errno));
    if (rc) {
        close(fd);
        return rc;
    }
    *out = f;
    return SKV_OK;
}

char *skv_keyfile_words(char *line, char **rest)
{
    char *s = line;
    while (isspace((unsigned char)*s))
        s++;
    if (*s == '#') /* only whole-line comments: '#' is a Z85 digit */
        *s = '\0';
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1]))
        *--e = '\0';
    if (!*s) {
        *rest = s;
        return NULL;
    }
    char *w = s;
    while (*s && !isspace((unsigned char)*s))
        s++;
    if (*s) {
        *s++ = '\0';
        while (isspace((unsigned char)*s))
            s++;
    }
    *rest = s;
    return w;
}

int skv_keyfile_next(FILE *f, const char *path, char *line, size_t cap, int *lineno, char **word, char **rest)
{
    while (fgets(line, (int)cap, f)) {
        ++*lineno;
        if (!strchr(line, '\n') && !feof(f))
            return skv_errorf(SKV_E_FORMAT, "%s:%d: line too long", path, *lineno);
        if ((*word = skv_keyfile_words(line, rest)))
            return 1;
    }
    return 0;
}

int skv_keyfile_read(const char *path, enum skv_keyfile_kind kind, char z85[SKV_KEY_Z85_LEN + 1])
{
    FILE *f;
    int rc = skv_keyfile_open(path, kind, &f);
    if (rc)
        return rc;
    char line[512], found[SKV_KEY_Z85_LEN + 1] = "", *word, *rest;
    int lineno = 0, more;
    if (kind != SKV_KEYFILE_PUBLIC) /* a secret key: no copy in stdio's buffer */
        setvbuf(f, NULL, _IONBF, 0);
    while (!rc && (more = skv_keyfile_next(f, path, line, sizeof line, &lineno, &word, &rest)) != 0) {
        if (more < 0) {
            rc = more;
            break;
        }
        if (*found)
            rc = skv_errorf(SKV_E_FORMAT, "%s:%d: more than one key in the file", path, lineno);
        else if (*rest || !skv_key_z85_decode(word, NULL))
            rc = skv_errorf(SKV_E_FORMAT, "%s:%d: not a Z85 CURVE key (40 characters)", path, lineno);
        else
            memcpy(found, word, sizeof found);
    }
    fclose(f);
    explicit_bzero(line, sizeof line); /* the caller's copy is the only one left */
    if (!rc && !*found)
        rc = skv_errorf(SKV_E_FORMAT, "%s: no key in the file", path);
    if (!rc)
        memcpy(z85, found, sizeof found);
    explicit_bzero(found, sizeof found);
    return rc;
}
