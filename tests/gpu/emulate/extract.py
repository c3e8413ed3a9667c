#!/usr/bin/env python3
"""Cuts the kernels and their host launchers out of kernels/cuda/cuda_backend.cu for the host
emulation in emu.cpp: <<<grid, threads, smem, stream>>> becomes emu_launch(kernel, grid, threads,
smem, ...) and extern __shared__ arrays point at the emulated dynamic shared memory.
Usage: extract.py SRC/kernels/cuda/cuda_backend.cu OUT.inc"""
import re
import sys

src = open(sys.argv[1]).read()


def between(a, b):
    i = src.index(a)
    return src[i:src.index(b, i)]


parts = [
    between("/* Up to this many activation rows", "#define EW_THREADS"),
    between("/* the ops SKV_CUDA_PROFILE times", "/* ---- memory, copies"),
    between("/* A device scratch buffer of at least", "/* True when p is device"),
    between("static unsigned grid_for(int64_t count", "/* ---- device helpers"),
    between("/* Sum (MAX: max) over the warp by butterfly", "__device__ __forceinline__ float half_bits"),
    between("__device__ __forceinline__ float half_bits", "static bool cuda_type_supported"),
    between("/* A GEMV warp's row r", "/* Rows of a quantized weight dequantized"),
    between("/* ---- attention ----", "/* Row i of n: dst[i] <- src[i]"),
    between("/* One row per block (rms_threads)", "__global__ void swiglu_kernel"),
]
code = "\n".join(parts)
code = re.sub(r"extern __shared__ (\w+) (\w+)\[\];", r"\1 *\2 = (\1 *)g_dyn;", code)
code = re.sub(r"(\w+(?:<(?:true|false)>)?)<<<(.*?),\s*impl->stream>>>\(", r"emu_launch(\1, \2, ", code, flags=re.S)
open(sys.argv[2], "w").write(code)
