#!/usr/bin/env bash
# Builds, on a host with nvcc (no GPU needed), everything tests/gpu/check.sh runs, and packs it
# with the shared libraries the device image lacks (ZeroMQ, protobuf-c, jansson, PCRE2,
# libsodium, OpenBLAS, ...) into .gpubundle/bundle.tar.xz (git-ignored: name .gpubundle in the
# device call's `carry`). check.sh unpacks it instead of configuring and building when it is
# there, so a device session spends its minutes on the GPU, not on missing packages.
# Usage: tests/gpu/bundle.sh [BUILD_DIR]   (default: ./build-gpu-bundle)
set -euo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$SRC/build-gpu-bundle}
OUTDIR=$SRC/.gpubundle
command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || { echo "bundle.sh: nvcc not found" >&2; exit 1; }
grep -qx '/.gpubundle/' "$SRC/.git/info/exclude" 2>/dev/null || echo '/.gpubundle/' >>"$SRC/.git/info/exclude"

( cd "$SRC" && { [ -x configure ] || ./autogen.sh >/dev/null; } )
rm -rf "$BUILD"
mkdir -p "$BUILD"
# static libsnapkv: the programs are real binaries, not libtool wrappers that name this host's paths
( cd "$BUILD" && "$SRC/configure" -q --with-cuda=yes --disable-shared )
jobs=$(nproc 2>/dev/null || echo 2)
make -C "$BUILD" -j"$jobs" all tests/backend/test_ops tests/model/test_model >"$BUILD/make.log" 2>&1 ||
    { tail -30 "$BUILD/make.log" >&2; exit 1; }

progs="snapkvd snapkv-bench snapkvctl tests/backend/test_ops tests/model/test_model tests/gpu/random_gguf tests/gpu/ipc_exchange"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/lib"
for p in $progs; do
    [ -x "$BUILD/$p" ] && file -b "$BUILD/$p" | grep -q ELF || { echo "bundle.sh: $p is not a built binary" >&2; exit 1; }
    mkdir -p "$stage/$(dirname "$p")"
    cp "$BUILD/$p" "$stage/$p"
done
# every shared library the programs load, except the C runtime and CUDA (the device has its own)
for p in $progs; do ldd "$BUILD/$p"; done | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libpthread|libdl|librt|libresolv|libgcc_s|libstdc\+\+|ld-linux[^/]*)\.so|/libcu|/libnv' |
    while read -r lib; do cp -L "$lib" "$stage/lib/"; done
printf '%s\n' "commit $(git -C "$SRC" rev-parse --short HEAD)" "built $(date -u +%FT%TZ) on $(uname -srm)" \
    "nvcc $(/usr/local/cuda/bin/nvcc --version | tail -2 | head -1)" >"$stage/BUNDLE"
mkdir -p "$OUTDIR"
tar -C "$stage" -cJf "$OUTDIR/bundle.tar.xz" .
echo "bundle.sh: $OUTDIR/bundle.tar.xz ($(du -h "$OUTDIR/bundle.tar.xz" | cut -f1)); libraries: $(ls "$stage/lib" | tr '\n' ' ')"
