#!/usr/bin/env bash
# GPU acceptance check for the CUDA backend, one command on a machine with a device:
# configure --with-cuda=yes in a fresh build dir, build, run the CUDA op tests, compare CUDA
# and CPU logits on the default model, time speed, exchange a session between two processes
# through CUDA IPC, measure device copy bandwidth; a table last.
# Usage: tests/gpu/check.sh [BUILD_DIR]   (default: ./build-gpu-check). Exits non-zero on any failure.
set -euo pipefail

SRC=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$SRC/build-gpu-check}
MODEL=${SKV_MODEL:-$SRC/models/SmolLM2-135M-Instruct.Q4_1.gguf}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
export SKV_SRCDIR=$SRC SKV_MODEL=$MODEL

declare -a ROWS=()
row() { ROWS+=("$(printf '| %-28s | %-10s | %s' "$1" "$2" "$3")"); }
fail() {
    echo "check.sh: FAIL: $*" >&2
    row "FAILED" "-" "$*"
    printf '%s\n' "${ROWS[@]}" >&2
    exit 1
}

command -v "$NVCC" >/dev/null || fail "nvcc not found at $NVCC"

# 1. fresh configure + build
rm -rf "$BUILD"
mkdir -p "$BUILD"
( cd "$SRC" && { [ -x configure ] || autoreconf -fi; } ) >"$BUILD/autoreconf.log" 2>&1 ||
    fail "autoreconf (see $BUILD/autoreconf.log)"
( cd "$BUILD" && "$SRC/configure" --with-cuda=yes ) >"$BUILD/configure.log" 2>&1 ||
    fail "configure --with-cuda=yes (see $BUILD/configure.log)"
t0=$(date +%s)
make -C "$BUILD" -j16 >"$BUILD/make.log" 2>&1 || { tail -30 "$BUILD/make.log" >&2; fail "make"; }
make -C "$BUILD" -j16 tests/backend/test_ops >>"$BUILD/make.log" 2>&1 ||
    { tail -30 "$BUILD/make.log" >&2; fail "make tests/backend/test_ops"; }
row "build (configure+make)" "ok" "$(( $(date +%s) - t0 )) s"

# 2. op tests: the CUDA group must run (a device must answer), and all groups must pass
OPS_LOG=$BUILD/test_ops.log
if ! timeout 300 "$BUILD/tests/backend/test_ops" >"$OPS_LOG" 2>&1; then
    grep -E "FAILED|ERROR|NMSE|nmse" "$OPS_LOG" | head -40 >&2 || true
    fail "test_ops (see $OPS_LOG)"
fi
grep -q "backend_ops_cuda" "$OPS_LOG" || fail "test_ops ran no CUDA group"
if sed -n '/backend_ops_cuda/,$p' "$OPS_LOG" | grep -q "SKIPPED"; then
    fail "test_ops skipped the CUDA group: skv_backend_cuda_new(0) failed"
fi
cuda_passed=$(sed -n '/backend_ops_cuda/,$p' "$OPS_LOG" | grep -oE "PASSED +\] +[0-9]+" | grep -oE "[0-9]+$" | tail -1 || true)
row "test_ops (CUDA group)" "ok" "${cuda_passed:-?} tests passed"

# 3. logits: CUDA vs CPU on the default model, top-5 ids must agree as a set, top-1 exactly
BENCH=$BUILD/snapkv-bench
[ -x "$BENCH" ] || BENCH=$BUILD/tools/snapkv-bench
[ -x "$BENCH" ] || fail "snapkv-bench not built"
[ -f "$MODEL" ] || fail "model $MODEL missing"
PROMPT="The capital of France is Paris. The capital of Germany is"
"$BENCH" logits --model "$MODEL" --backend cpu --prompt "$PROMPT" --top 5 --json \
    >"$BUILD/logits_cpu.json" 2>"$BUILD/logits_cpu.err" || fail "logits --backend cpu"
"$BENCH" logits --model "$MODEL" --backend cuda --prompt "$PROMPT" --top 5 --json \
    >"$BUILD/logits_cuda.json" 2>"$BUILD/logits_cuda.err" ||
    { cat "$BUILD/logits_cuda.err" >&2; fail "logits --backend cuda"; }
cmp_out=$(python3 - "$BUILD/logits_cpu.json" "$BUILD/logits_cuda.json" <<'EOF'
import json, sys
a = json.load(open(sys.argv[1]))["top"]
b = json.load(open(sys.argv[2]))["top"]
ia, ib = [t["id"] for t in a], [t["id"] for t in b]
dmax = max(abs(x["logit"] - y["logit"]) for x, y in zip(a, b))
ok = ia[0] == ib[0] and set(ia) == set(ib)
print(("ok" if ok else "MISMATCH") + f" cpu={ia} cuda={ib} max|dlogit|={dmax:.4f}")
sys.exit(0 if ok else 1)
EOF
) || fail "logits top-5 differ: $cmp_out"
row "logits top-5 cuda vs cpu" "ok" "$cmp_out"

# 4. speed on CUDA
SPEED_LOG=$BUILD/speed_cuda.log
timeout 240 "$BENCH" speed --model "$MODEL" --backend cuda --prefill 512,2048 \
    --decode-depth 0,4096 --decode-tokens 64 >"$SPEED_LOG" 2>&1 ||
    { tail -20 "$SPEED_LOG" >&2; fail "speed --backend cuda"; }
while IFS= read -r l; do
    row "speed cuda" "ok" "$l"
done < <(grep -E "prefill|decode" "$SPEED_LOG" | grep -E "t/s" | head -6)

# 5. two client processes exchange a session through CUDA IPC with snapkvd on the GPU
IPC_DIR=$(mktemp -d)
"$BUILD/snapkvd" --model "$MODEL" --backend cuda --endpoint "ipc://$IPC_DIR/client.sock" \
    --admin-endpoint "ipc://$IPC_DIR/admin.sock" --state-dir "$IPC_DIR" --pool-size 8G \
    >"$BUILD/snapkvd_ipc.log" 2>&1 &
DPID=$!
for _ in $(seq 1 100); do [ -S "$IPC_DIR/client.sock" ] && break; sleep 0.2; done
ipc_out=$(timeout 120 "$BUILD/tests/gpu/ipc_exchange" "ipc://$IPC_DIR/client.sock" 2>&1) ||
    { kill "$DPID" 2>/dev/null; tail -20 "$BUILD/snapkvd_ipc.log" >&2; fail "CUDA IPC exchange: $ipc_out"; }
kill -TERM "$DPID"; wait "$DPID" || true
row "CUDA IPC, two processes" "ok" "$ipc_out"

# 6. device-to-device copy bandwidth: 1 GiB cudaMemcpy, best of 10
BW_SRC=$BUILD/bw.cu
cat >"$BW_SRC" <<'EOF'
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); return 1; } } while (0)
int main(void)
{
    const size_t bytes = (size_t)1 << 30;
    void *a, *b;
    cudaEvent_t t0, t1;
    CK(cudaMalloc(&a, bytes));
    CK(cudaMalloc(&b, bytes));
    CK(cudaMemset(a, 1, bytes));
    CK(cudaEventCreate(&t0));
    CK(cudaEventCreate(&t1));
    float best = 1e30f;
    for (int i = 0; i < 10; i++) {
        CK(cudaEventRecord(t0));
        CK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
        CK(cudaEventRecord(t1));
        CK(cudaEventSynchronize(t1));
        float ms;
        CK(cudaEventElapsedTime(&ms, t0, t1));
        best = ms < best ? ms : best;
    }
    /* read + write traffic */
    printf("%.1f GB/s (1 GiB D2D copy %.3f ms, read+write counted)\n",
           2.0 * bytes / (best * 1e-3) / 1e9, best);
    return 0;
}
EOF
"$NVCC" -O2 -o "$BUILD/bw" "$BW_SRC" >"$BUILD/bw_build.log" 2>&1 || fail "nvcc bw.cu"
bw=$("$BUILD/bw") || fail "bandwidth program"
row "D2D copy bandwidth" "ok" "$bw"

echo
echo "| check                        | result     | detail"
echo "|------------------------------|------------|-------"
printf '%s\n' "${ROWS[@]}"
