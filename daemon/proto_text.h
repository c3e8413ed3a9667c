/* The text in a request. protobuf-c hands a `string` field over as a C string, so a NUL inside
 * one cut it there without a word, and it never checks UTF-8, which proto3 asks of every
 * `string` (Python's and Go's protobuf refuse to read a reply that echoes ill-formed text, such
 * as an error message quoting a tenant's name). The packed bytes are walked once, by the
 * message's descriptor, before the request is served: every `string` field, nested messages and
 * repeated ones included, must be well-formed UTF-8 with no NUL. `bytes` fields and unknown fields are
 * skipped by their length. Every occurrence is checked, so a request carrying two members of a
 * oneof (protobuf-c keeps the last) has the first one's strings checked too. */
#ifndef SKV_PROTO_TEXT_H
#define SKV_PROTO_TEXT_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>
#include <stdint.h>

/* SKV_OK when every `string` field of the packed message buf[0..len) of type `desc` is text;
 * otherwise SKV_E_INVAL with a message naming the field's path ("prefill.text") and the byte
 * offset inside it, or SKV_E_PROTO when the bytes are not a message (callers unpack first, so
 * that is not expected). */
int skv_proto_text_check(const ProtobufCMessageDescriptor *desc, const uint8_t *buf, size_t len);

#endif
