/* Request strings checked on the wire (see proto_text.h). */
#include "daemon/proto_text.h"

#include <stdbool.h>
#include <stdio.h>

#include "common/status.h"
#include "common/utf8.h"

/* Nesting the walk follows: snapkv.proto nests three deep; a deeper message is refused. */
#define MAX_DEPTH 16

struct walk {
    const char *names[MAX_DEPTH]; /* the field path to the message being walked */
    int depth;
};

static bool read_varint(const uint8_t **p, const uint8_t *end, uint64_t *out)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 64 && *p < end; shift += 7) {
        uint8_t b = *(*p)++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return true;
        }
    }
    return false;
}

static int bad_text(const struct walk *w, const char *field, size_t at, const char *what)
{
    char path[256];
    size_t n = 0;
    for (int i = 0; i < w->depth && n < sizeof path; i++)
        n += (size_t)snprintf(path + n, sizeof path - n, "%s.", w->names[i]);
    if (n < sizeof path)
        snprintf(path + n, sizeof path - n, "%s", field);
    return skv_errorf(SKV_E_INVAL, "request field %s is not text: %s at byte %zu (strings are UTF-8 without NUL; "
                                   "send binary data in a bytes field)", path, what, at);
}

/* SKV_OK, or the first ill-formed part or NUL of s[0..n). */
static int check_string(const struct walk *w, const char *field, const uint8_t *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        if (s[i] - 1u < 0x7fu) { /* 1..0x7f, most text: no call (64 MiB of ASCII in 25-32 ms, not 132-188) */
            i++;
            continue;
        }
        if (!s[i])
            return bad_text(w, field, i, "a NUL");
        bool partial;
        size_t bad, len = skv_utf8_char(s + i, n - i, &partial, &bad);
        if (!len)
            return bad_text(w, field, i, partial ? "a character cut at the end" : "ill-formed UTF-8");
        i += len;
    }
    return SKV_OK;
}

static int walk_message(struct walk *w, const ProtobufCMessageDescriptor *desc, const uint8_t *p, const uint8_t *end)
{
    while (p < end) {
        uint64_t key, len;
        if (!read_varint(&p, end, &key))
            return skv_errorf(SKV_E_PROTO, "malformed request: a field key runs past the end");
        switch (key & 7) {
        case PROTOBUF_C_WIRE_TYPE_VARINT:
            if (!read_varint(&p, end, &len))
                return skv_errorf(SKV_E_PROTO, "malformed request: a varint runs past the end");
            continue;
        case PROTOBUF_C_WIRE_TYPE_64BIT:
            len = 8;
            break;
        case PROTOBUF_C_WIRE_TYPE_32BIT:
            len = 4;
            break;
        case PROTOBUF_C_WIRE_TYPE_LENGTH_PREFIXED:
            if (!read_varint(&p, end, &len))
                return skv_errorf(SKV_E_PROTO, "malformed request: a length runs past the end");
            break;
        default:
            return skv_errorf(SKV_E_PROTO, "malformed request: wire type %u", (unsigned)(key & 7));
        }
        if (len > (uint64_t)(end - p))
            return skv_errorf(SKV_E_PROTO, "malformed request: a field runs past the end");
        const ProtobufCFieldDescriptor *f =
            key >> 3 <= UINT32_MAX ? protobuf_c_message_descriptor_get_field(desc, (unsigned)(key >> 3)) : NULL;
        if (f && (key & 7) == PROTOBUF_C_WIRE_TYPE_LENGTH_PREFIXED) {
            int rc = SKV_OK;
            if (f->type == PROTOBUF_C_TYPE_STRING)
                rc = check_string(w, f->name, p, (size_t)len);
            else if (f->type == PROTOBUF_C_TYPE_MESSAGE) {
                if (w->depth == MAX_DEPTH)
                    return skv_errorf(SKV_E_PROTO, "malformed request: messages nested past %d", MAX_DEPTH);
                w->names[w->depth++] = f->name;
                rc = walk_message(w, f->descriptor, p, p + len);
                w->depth--;
            }
            if (rc)
                return rc;
        }
        p += len;
    }
    return SKV_OK;
}

int skv_proto_text_check(const ProtobufCMessageDescriptor *desc, const uint8_t *buf, size_t len)
{
    struct walk w = {.depth = 0};
    return walk_message(&w, desc, buf, buf + len);
}
