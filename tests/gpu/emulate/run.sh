#!/bin/sh
# Runs the CUDA backend's attention, compression-score and top-k kernels in a host emulation
# (one thread per CUDA thread, real barriers for __syncthreads, warp shuffles and ballots) and
# compares them with the CPU backend. A developer check for hosts without a GPU: it proves the
# kernels' logic (indexing, masking, tiling, reductions, ranks), not the device's behaviour or
# speed. Not part of `make check` (several minutes, thousands of threads).
# Usage: tests/gpu/emulate/run.sh [BUILD_DIR]   (a configured build with libskvcore.a; default build)
set -eu
top=$(cd "$(dirname "$0")/../../.." && pwd)
build=$(cd "${1:-$top/build}" && pwd)
[ $# -gt 0 ] && shift
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 "$top/tests/gpu/emulate/extract.py" "$top/kernels/cuda/cuda_backend.cu" "$work/kern.inc"
cuda=${CUDA_HOME:-/usr/local/cuda}
cudalibs=""
nm "$build/libskvcore.a" 2>/dev/null | grep -q "U cudaMalloc" && cudalibs="-L$cuda/lib64 -lcudart -lcublas -Wl,-rpath,$cuda/lib64"
g++ -std=c++20 -O1 -I"$top" -I"$build" -I"$work" "$top/tests/gpu/emulate/emu.cpp" "$build/libskvcore.a" \
    $cudalibs -lopenblas -lpthread -lm -o "$work/emu"
"$work/emu" "$@"
