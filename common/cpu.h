/* The CPU features the engine's kernels were compiled for (configure's SKV_SIMD_CFLAGS). */
#ifndef SKV_CPU_H
#define SKV_CPU_H

#include <stdbool.h>

/* Whether this CPU runs what the kernels were compiled for; when not, *missing names the first
 * feature it lacks. Always true where the kernels need nothing beyond the target's baseline.
 * Linking it (libskvcpu.a, built without those flags) also checks before main: a program on a
 * CPU without them exits 1 with the reason instead of stopping on SIGILL. */
bool skv_cpu_ok(const char **missing);

#endif
