/* The check behind common/cpu.h. Built on its own (libskvcpu.a) without the kernels' AVX2 /
 * FMA / F16C flags, so that it runs on any x86-64 before anything that needs them. */
#include "build-config.h"
#include "common/cpu.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#ifdef SKV_NEEDS_AVX2
#include <cpuid.h>
#endif

bool skv_cpu_ok(const char **missing)
{
    *missing = NULL;
#ifdef SKV_NEEDS_AVX2
    __builtin_cpu_init();
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__builtin_cpu_supports("avx2")) /* (this one also asks whether the OS saves the YMM registers) */
        *missing = "AVX2";
    else if (!__builtin_cpu_supports("fma"))
        *missing = "FMA";
    else if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_F16C)) /* (older compilers' builtin lacks "f16c") */
        *missing = "F16C";
#endif
    return *missing == NULL;
}

__attribute__((constructor)) static void check_at_start(void)
{
    const char *missing;
    if (!skv_cpu_ok(&missing)) {
        fprintf(stderr, "%s: this CPU lacks %s, which this build's CPU kernels use (AVX2, FMA, F16C)\n",
                program_invocation_short_name, missing);
        exit(1);
    }
}
