/* The socket thread's text check (daemon/proto_text.c) on a PREFILL of 64 MiB of ASCII text.
 * Build and run from the source tree, after a build in build/:
 *   gcc -O2 -I. -Ibuild docs/perf/proto-text.c daemon/proto_text.c common/utf8.c common/status.c \
 *       build/libskvproto.a -lprotobuf-c -o /tmp/proto-text && /tmp/proto-text */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "daemon/proto_text.h"
#include "proto/snapkv.pb-c.h"
int main(void)
{
    size_t n = 64u<<20; char *t = malloc(n+1); memset(t,'a',n); t[n]=0;
    for (size_t i=0;i<n;i+=100) t[i]=' ';
    Snapkv__PrefillRequest p = SNAPKV__PREFILL_REQUEST__INIT; p.text=t;
    Snapkv__Request r = SNAPKV__REQUEST__INIT; r.version=1; r.command_case=SNAPKV__REQUEST__COMMAND_PREFILL; r.prefill=&p;
    size_t len = snapkv__request__get_packed_size(&r); uint8_t *b = malloc(len); snapkv__request__pack(&r,b);
    struct timespec a,c; clock_gettime(CLOCK_MONOTONIC,&a);
    int rc = skv_proto_text_check(&snapkv__request__descriptor,b,len);
    clock_gettime(CLOCK_MONOTONIC,&c);
    printf("rc %d, %.1f ms for %zu bytes\n", rc, (c.tv_sec-a.tv_sec)*1e3+(c.tv_nsec-a.tv_nsec)/1e6, len);
    return 0;}
