#!/usr/bin/env bash
# GPU acceptance check for the CUDA backend (issue 6), one command on a machine with a device:
# configure --with-cuda=yes in a fresh build dir and build (or unpack tests/gpu/bundle.sh's
# bundle); the CUDA op tests; the tiny fixture models against transformers on the GPU
# (test_model's CUDA group); CUDA vs CPU logits on the default model (or a random model of its
# shapes); a session exchanged between two processes through CUDA IPC; the
# device's copy bandwidth; then every figure the issue's goals need: snapkv-bench speed (prefill
# and decode t/s at 1K/8K/16K/32K, full cache and SnapKV budget 1024) on the default model and on
# a random-weight model of Llama-3-8B's shapes (tests/gpu/random_gguf), the bandwidth roofline,
# the cost of context, sessions and aggregate decode in a 60 GiB pool (snapkv-bench serve),
# transformers + kvpress SnapKVPress decode on the same GPU (tests/gpu/kvpress_speed.py, when
# torch imports), the SnapKV compressor's share of prefill at 16K; a table last.
#
# Usage: tests/gpu/check.sh [--dry-run] [BUILD_DIR]   (default: ./build-gpu-check)
#   --dry-run or SKV_GPU_CHECK_CPU=1: the same steps on the CPU backend with tiny sizes (a
#   2-layer random model, contexts 128..512, budget 64), skipping the CUDA-only checks; reuses
#   BUILD_DIR if it is configured already. Tests the script's logic on a host without a GPU.
# Environment: SKV_MODEL (default model), SKV_PYTHON (python with torch; default python3),
#   SKV_GPU_CHECK_LIMIT (seconds for the whole run, default 470: steps that would pass it are
#   skipped and say so), SKV_GPU_CHECK_WTYPE (f16 or q8_0 for the 8B-shaped model; default f16,
#   the bytes of transformers' bf16), SKV_GPU_CHECK_SCRATCH (where the 16 GB model is written;
#   default /dev/shm when it has 24 GB free, else BUILD_DIR). Wheels in .whl/ at the repository
#   root (tests/gpu/fetch-wheels.sh) are installed into BUILD_DIR/pysite for kvpress_speed.py;
#   SKV_GPU_CHECK_KVPRESS=0 skips that step, SKV_GPU_CHECK_BIG=0 the 8B-shaped model's.
# Every command is echoed ("+ ...") before it runs; outputs land in BUILD_DIR (*.json, *.log).
# Exits non-zero when the build fails (at once) or any later step fails (after the table).
set -euo pipefail

SRC=$(cd "$(dirname "$0")/../.." && pwd)
DRY=${SKV_GPU_CHECK_CPU:-0}
if [ "${1:-}" = "--dry-run" ]; then
    DRY=1
    shift
fi
BUILD=${1:-$SRC/build-gpu-check}
MODEL=${SKV_MODEL:-$SRC/models/SmolLM2-135M-Instruct.Q4_1.gguf}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
PY=${SKV_PYTHON:-python3}
LIMIT=${SKV_GPU_CHECK_LIMIT:-470}
WTYPE=${SKV_GPU_CHECK_WTYPE:-f16}
export SKV_SRCDIR=$SRC SKV_MODEL=$MODEL

if [ "$DRY" = 1 ]; then
    BACKEND=cpu BIG_SHAPE=tiny KVP_BIG=tiny KVP_DEFAULT=smollm2-135m
    C1=128 C8=256 C16=384 C32=512 BUDGET=64 DTOK=4 POOL_GIB=0.01 SERVE_DTOK=4 KVP_DTOK=4 JOBS=2
    NICE="nice -n 10" THREADS="--threads 2" PYDEV=cpu
else
    BACKEND=cuda BIG_SHAPE=llama3-8b KVP_BIG=llama3-8b KVP_DEFAULT=smollm2-135m
    C1=1024 C8=8192 C16=16384 C32=32768 BUDGET=1024 DTOK=64 POOL_GIB=60 SERVE_DTOK=32 KVP_DTOK=32 JOBS=16
    NICE="" THREADS="" PYDEV=cuda
    # the serve step holds the 8B-shaped weights twice (its own engine's and its daemon's, 15 GiB
    # each) beside the pool: 60 GiB fits an H200's 139 GiB, not an H100's 79 (a read of the
    # card's size; nothing set)
    MEM_GIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null |
              awk 'NR == 1 {print int($1 / 1024)}')
    if [ -n "$MEM_GIB" ] && [ "$MEM_GIB" -gt 40 ] && [ $((MEM_GIB - 36)) -lt "$POOL_GIB" ]; then
        POOL_GIB=$((MEM_GIB - 36))
    fi
fi
SNAP="policy=snapkv,budget=$BUDGET"
# the 8B-shaped model (16 GB) in RAM where /dev/shm has room: writing it to a VM's disk took
# 90 s of a short device lease
SCRATCH=${SKV_GPU_CHECK_SCRATCH:-$BUILD}
if [ -z "${SKV_GPU_CHECK_SCRATCH:-}" ] && [ "$DRY" != 1 ] &&
   [ "$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')" -gt $((24 << 20)) ] 2>/dev/null; then
    SCRATCH=/dev/shm
fi

declare -a ROWS=()
BAD=0
row() { ROWS+=("$(printf '| %-36s | %-10s | %s' "$1" "$2" "$3")"); }
table() {
    echo
    echo "| check                                | result     | detail"
    echo "|--------------------------------------|------------|-------"
    printf '%s\n' "${ROWS[@]}"
}
fatal() {
    echo "check.sh: FAIL: $*" >&2
    row "FAILED" "-" "$*"
    table
    exit 1
}
bad() {
    echo "check.sh: FAIL: $2" >&2
    row "$1" "FAILED" "$2"
    BAD=$((BAD + 1))
}
say() { echo "[check $(date -u +%T) +${SECONDS}s] $*"; }
# seconds a step may take: its own cap, or what is left of LIMIT (0: skip it)
budget() {
    local left=$((LIMIT - SECONDS - 5))
    local t=$(( $1 < left ? $1 : left ))
    echo $(( t < 10 ? 0 : t ))
}
# run NAME CAP CMD...: echo the command, run it under a timeout, stdout to NAME.json (or
# .out), stderr to NAME.log; 0 on success
run() {
    local name=$1 cap=$2 ext=json
    shift 2
    case "$name" in *.out) ext=out; name=${name%.out} ;; esac
    local t
    t=$(budget "$cap")
    if [ "$t" = 0 ]; then
        say "skip $name: the ${LIMIT} s limit is spent"
        row "$name" "skipped" "no time left under SKV_GPU_CHECK_LIMIT=$LIMIT"
        return 2
    fi
    say "+ $*    (timeout ${t}s -> $BUILD/$name.$ext, $BUILD/$name.log)"
    local t0=$SECONDS rc=0
    timeout "$t" $NICE "$@" >"$BUILD/$name.$ext" 2>"$BUILD/$name.log" || rc=$?
    say "  $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || tail -5 "$BUILD/$name.log" | sed 's/^/    /' >&2
    return "$rc"
}

say "mode: $([ "$DRY" = 1 ] && echo "dry run (CPU, tiny sizes)" || echo GPU), source $SRC ($(git -C "$SRC" rev-parse --short HEAD 2>/dev/null || echo '?')), build $BUILD"
[ "$DRY" = 1 ] || command -v "$NVCC" >/dev/null || fatal "nvcc not found at $NVCC"

# 1. configure + build (a fresh dir with CUDA; the dry run reuses a configured one, less the
# outputs of an earlier run, which the report would otherwise read)
mkdir -p "$BUILD"
rm -f "$BUILD"/speed_*.json "$BUILD"/kvpress_*.json "$BUILD"/serve_*.json "$BUILD"/gemv.json
t0=$SECONDS
# A bundle from tests/gpu/bundle.sh (built on a host with the dependencies; carried as
# .gpubundle) replaces configure + make: the binaries at their build-tree paths, the
# libraries the device image lacks beside them.
BUNDLE=$SRC/.gpubundle/bundle.tar.xz
if [ "$DRY" != 1 ] && [ -f "$BUNDLE" ]; then
    rm -rf "$BUILD"
    mkdir -p "$BUILD"
    say "+ tar -xJf $BUNDLE -C $BUILD ($(tr '\n' ' ' <<<"$(tar -xJOf "$BUNDLE" ./BUNDLE 2>/dev/null)"))"
    tar -xJf "$BUNDLE" -C "$BUILD" || fatal "unpacking $BUNDLE"
    export LD_LIBRARY_PATH=$BUILD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
        [ -d "$d" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
    done
    "$BUILD/snapkvd" --help >/dev/null 2>&1 || { ldd "$BUILD/snapkvd" | grep "not found" >&2; fatal "bundled snapkvd does not start (libraries above)"; }
    row "build (prebuilt bundle)" "ok" "$(tar -xJOf "$BUNDLE" ./BUNDLE | head -1)"
    PREBUILT=1
else
    PREBUILT=0
fi
# what the build needs, named at once (a device image may lack the project's dependencies)
if [ "$PREBUILT" = 0 ]; then
    missing=""
    for tool in make cc pkg-config protoc-c python3; do
        command -v "$tool" >/dev/null || missing="$missing $tool"
    done
    [ -x "$SRC/configure" ] || command -v autoreconf >/dev/null || missing="$missing autoreconf"
    if command -v pkg-config >/dev/null; then
        for mod in libzmq libprotobuf-c cmocka jansson libsodium libpcre2-8; do
            pkg-config --exists "$mod" || missing="$missing $mod"
        done
        pkg-config --exists openblas || compgen -G "/usr/lib/*/libopenblas.so*" >/dev/null ||
            missing="$missing openblas"
        [ -f /usr/include/uninorm.h ] || missing="$missing libunistring-dev"
    fi
    [ -z "$missing" ] || fatal "missing build dependencies:$missing (see README.md; scripts/setup installs them)"
    if [ "$DRY" = 1 ] && [ -f "$BUILD/Makefile" ]; then
        say "dry run: reusing the configured $BUILD"
    else
        [ "$DRY" = 1 ] || { rm -rf "$BUILD"; mkdir -p "$BUILD"; }
        ( cd "$SRC" && { [ -x configure ] || autoreconf -fi; } ) >"$BUILD/autoreconf.log" 2>&1 ||
            fatal "autoreconf (see $BUILD/autoreconf.log)"
        cuda=$([ "$DRY" = 1 ] && echo no || echo yes)
        say "+ $SRC/configure --with-cuda=$cuda"
        ( cd "$BUILD" && "$SRC/configure" --with-cuda="$cuda" ) >"$BUILD/configure.log" 2>&1 ||
            fatal "configure --with-cuda=$cuda (see $BUILD/configure.log)"
    fi
    say "+ make -j$JOBS all tests/backend/test_ops tests/model/test_model"
    $NICE make -C "$BUILD" -j"$JOBS" all tests/backend/test_ops tests/model/test_model >"$BUILD/make.log" 2>&1 ||
        { tail -30 "$BUILD/make.log" >&2; fatal "make (see $BUILD/make.log)"; }
    row "build (configure+make)" "ok" "$((SECONDS - t0)) s"
fi
BENCH=$BUILD/snapkv-bench
RGGUF=$BUILD/tests/gpu/random_gguf
[ -x "$BENCH" ] || fatal "snapkv-bench not built"
# The default model's file (98 MB) is larger than what a device call carries (64 MiB): where it
# is absent, a random model of its shapes and types stands in for the speed figures and the CUDA
# vs CPU logits (the golden check against transformers then rests on the tiny fixture models).
REAL_MODEL=1
if [ ! -f "$MODEL" ]; then
    REAL_MODEL=0
    MODEL=$BUILD/random-smollm2-135m-q4_1.gguf
    say "+ $RGGUF --shape smollm2-135m --type q4_1 --out $MODEL    (the default model's file is absent)"
    "$RGGUF" --shape smollm2-135m --type q4_1 --out "$MODEL" >"$BUILD/random_default.log" 2>&1 ||
        fatal "random_gguf for the default model's shapes (see $BUILD/random_default.log)"
    row "default model" "random" "$SKV_MODEL absent: $(tail -1 "$BUILD/random_default.log")"
fi

# the 8B-shaped random model is written while the correctness checks run (SKV_GPU_CHECK_BIG=0:
# not at all, and its steps are skipped)
BIG=$SCRATCH/random-$BIG_SHAPE-$WTYPE.gguf
RGGUF_PID=""
if [ "${SKV_GPU_CHECK_BIG:-1}" != 0 ]; then
    say "+ $RGGUF --shape $BIG_SHAPE --type $WTYPE --out $BIG    (background -> $BUILD/random_gguf.log)"
    "$RGGUF" --shape "$BIG_SHAPE" --type "$WTYPE" --out "$BIG" >"$BUILD/random_gguf.log" 2>&1 &
    RGGUF_PID=$!
fi

if [ "$DRY" != 1 ]; then
    # 2. op tests: the CUDA group must run (a device must answer), and all groups must pass
    if run test_ops.out 300 "$BUILD/tests/backend/test_ops"; then
        # cmocka names no group on stdout: the CUDA group is the second "Running N test(s)"
        cuda_part=$(awk '/Running [0-9]+ test/ {g++} g == 2' "$BUILD/test_ops.out")
        if [ -z "$cuda_part" ]; then
            bad "test_ops (CUDA group)" "test_ops ran no CUDA group"
        elif grep -q "SKIPPED" <<<"$cuda_part"; then
            bad "test_ops (CUDA group)" "skipped the CUDA group: skv_backend_cuda_new(0) failed"
        else
            row "test_ops (CUDA group)" "ok" "$(grep -c '^\[       OK \]' <<<"$cuda_part") tests passed, against the CPU backend"
        fi
    else
        grep -E "FAILED|ERROR|NMSE|nmse" "$BUILD/test_ops.out" | head -40 >&2 || true
        bad "test_ops (CUDA group)" "test_ops failed (see $BUILD/test_ops.out)"
    fi

    # 2b. golden: the tiny fixture models' forwards on the GPU against transformers' logits and
    # greedy tokens (tests/fixtures/tiny-*, test_model's CUDA group)
    if run test_model.out 120 "$BUILD/tests/model/test_model"; then
        if grep -q "CUDA group skipped" "$BUILD/test_model.out"; then
            bad "golden: tiny models on CUDA" "test_model skipped its CUDA group: $(grep -m1 "CUDA group skipped" "$BUILD/test_model.out")"
        else
            n=$(grep -c "^\[       OK \] .*_cuda$" "$BUILD/test_model.out" || true)
            worst=$(grep "\[cuda\]" "$BUILD/test_model.out" | sed 's/.*max |diff| \([^ ]*\) (bound \([^)]*\)).*/\1 of \2/' | sort -g | tail -1)
            row "golden: tiny models on CUDA" "ok" "$n tests vs transformers ($(grep "^\[  SKIPPED \] .*_cuda$" "$BUILD/test_model.out" | sort -u | wc -l) skipped: no default model); largest max|dlogit| $worst"
        fi
    else
        grep -E "FAILED|\[cuda\]|Assert|Error" "$BUILD/test_model.out" | head -20 >&2 || true
        bad "golden: tiny models on CUDA" "test_model failed (see $BUILD/test_model.out)"
    fi

    # 3. logits: CUDA vs CPU on the default model (or, where its file is absent, on the random
    # model of its shapes and types): top-1 equal unless the CPU's top-2 margin is within the
    # largest difference; on the real model also the top-5 ids as a set
    # (the random model has no tokenizer: 64 fixed token ids instead of the text)
    PROMPT=(--prompt "The capital of France is Paris. The capital of Germany is")
    [ "$REAL_MODEL" = 1 ] || PROMPT=(--tokens "$(seq -s, 1000 37 3331)")
    if run logits_cpu 120 "$BENCH" logits --model "$MODEL" --backend cpu "${PROMPT[@]}" --top 20 --json &&
       run logits_cuda 120 "$BENCH" logits --model "$MODEL" --backend cuda "${PROMPT[@]}" --top 20 --json; then
        if cmp_out=$(python3 - "$BUILD/logits_cpu.json" "$BUILD/logits_cuda.json" "$REAL_MODEL" <<'EOF'
import json, sys
a = json.load(open(sys.argv[1]))["top"]
b = json.load(open(sys.argv[2]))["top"]
real = sys.argv[3] == "1"
ia, ib = [t["id"] for t in a], [t["id"] for t in b]
lb = {t["id"]: t["logit"] for t in b}
# the same ids' logits where CUDA's list holds them, else rank for rank
dmax = max(abs(x["logit"] - lb.get(x["id"], y["logit"])) for x, y in zip(a, b))
margin = a[0]["logit"] - a[1]["logit"]
ok = (ia[0] == ib[0] or margin <= dmax) and (set(ia[:5]) == set(ib[:5]) or not real)
print(("ok" if ok else "MISMATCH") + f" {'' if real else '(random weights) '}cpu={ia[:5]} cuda={ib[:5]} "
      f"max|dlogit|={dmax:.4f} cpu top-2 margin={margin:.4f}")
sys.exit(0 if ok else 1)
EOF
        ); then
            row "logits cuda vs cpu" "ok" "$cmp_out"
        else
            bad "logits cuda vs cpu" "top-5 differ: $cmp_out"
        fi
    else
        bad "logits cuda vs cpu" "snapkv-bench logits failed (see $BUILD/logits_*.log)"
    fi

    # 4. device-to-device copy bandwidth: 1 GiB cudaMemcpy, best of 10
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
    BW_GBS=""
    if "$NVCC" -O2 -o "$BUILD/bw" "$BW_SRC" >"$BUILD/bw_build.log" 2>&1 && run bw.out 60 "$BUILD/bw"; then
        bw=$(cat "$BUILD/bw.out")
        BW_GBS=${bw%% GB/s*}
        BW_WHAT="device D2D copy"
        row "D2D copy bandwidth" "ok" "$bw"
    else
        bad "D2D copy bandwidth" "nvcc bw.cu or the program failed (see $BUILD/bw_build.log, bw.log)"
    fi
else
    # the dry run's bandwidth: the host's read bandwidth (snapkv-bench gemv)
    BW_GBS=""
    if run gemv 120 "$BENCH" gemv --model "$MODEL" --backend cpu $THREADS --repeat 2 --json; then
        BW_GBS=$(python3 -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["host_read_gb_per_second"], 2))' "$BUILD/gemv.json")
        BW_WHAT="host read"
        row "host read bandwidth" "ok" "$BW_GBS GB/s (snapkv-bench gemv)"
    else
        bad "host read bandwidth" "snapkv-bench gemv failed"
    fi
fi

# 5. speed on the default model: full cache and SnapKV
# (--prefill none: the prefill that builds each decode depth is the timed prefill, so each
# context is prefilled once)
speed() {  # speed NAME MODEL [--compress SPEC]
    local name=$1 model=$2
    shift 2
    run "$name" 150 "$BENCH" speed --model "$model" --backend "$BACKEND" $THREADS --prefill none \
        --decode-depth "$C1,$C8,$C16,$C32" --decode-tokens "$DTOK" "$@" --json || [ $? = 2 ] ||
        bad "$name" "snapkv-bench speed failed or timed out (see $BUILD/$name.log)"
}
speed speed_default_full "$MODEL"
speed speed_default_snapkv "$MODEL" --compress "$SNAP"

# 6. two client processes exchange a session through CUDA IPC with snapkvd on the GPU
if [ "$DRY" != 1 ]; then
    IPC_DIR=$(mktemp -d)
    say "+ $BUILD/snapkvd --model $MODEL --backend cuda ... (background); $BUILD/tests/gpu/ipc_exchange"
    "$BUILD/snapkvd" --model "$MODEL" --backend cuda --endpoint "ipc://$IPC_DIR/client.sock" \
        --admin-endpoint "ipc://$IPC_DIR/admin.sock" --state-dir "$IPC_DIR" --pool-size 8G \
        >"$BUILD/snapkvd_ipc.log" 2>&1 &
    DPID=$!
    for _ in $(seq 1 100); do [ -S "$IPC_DIR/client.sock" ] && break; sleep 0.2; done
    if run ipc_exchange.out 120 "$BUILD/tests/gpu/ipc_exchange" "ipc://$IPC_DIR/client.sock"; then
        row "CUDA IPC, two processes" "ok" "$(tail -1 "$BUILD/ipc_exchange.out")"
        # the exchange's clients have exited: their buffers must close on disconnect, not at a lease
        for _ in $(seq 1 25); do
            grep -qE "[1-9][0-9]* CUDA buffer\(s\) closed" "$BUILD/snapkvd_ipc.log" && break
            sleep 0.2
        done
        if grep -qE "[1-9][0-9]* CUDA buffer\(s\) closed" "$BUILD/snapkvd_ipc.log"; then
            row "CUDA IPC closed on disconnect" "ok" "$(grep -E "[1-9][0-9]* CUDA buffer\(s\) closed" "$BUILD/snapkvd_ipc.log" | tail -1)"
        else
            bad "CUDA IPC closed on disconnect" "no client-gone close in snapkvd_ipc.log within 5 s"
        fi
    else
        tail -20 "$BUILD/snapkvd_ipc.log" >&2
        bad "CUDA IPC, two processes" "$(tail -3 "$BUILD/ipc_exchange.log" | tr '\n' ' ')"
    fi
    kill -TERM "$DPID" 2>/dev/null || true
    wait "$DPID" || true
fi

# 7. the 8B-shaped random model: speed, full cache and SnapKV
if [ -z "$RGGUF_PID" ]; then
    row "random model ($BIG_SHAPE)" "skipped" "SKV_GPU_CHECK_BIG=0"
elif say "waiting for $BIG ..." && wait "$RGGUF_PID"; then
    row "random model" "ok" "$(tail -1 "$BUILD/random_gguf.log") at +${SECONDS}s"
    speed speed_8b_full "$BIG"
    speed speed_8b_snapkv "$BIG" --compress "$SNAP"
else
    bad "random model" "random_gguf failed: $(tail -2 "$BUILD/random_gguf.log" | tr '\n' ' ')"
fi

# 8. sessions that fit a fixed pool at 16K, full vs SnapKV, and their aggregate decode
if [ -f "$BIG" ]; then
    run serve_8b 200 "$BENCH" serve --model "$BIG" --backend "$BACKEND" $THREADS --parts capacity,decode \
        --context "$C16" --pool-gib "$POOL_GIB" --specs "policy=full;$SNAP" --sessions fit \
        --decode-tokens "$SERVE_DTOK" --json || [ $? = 2 ] || bad "serve_8b" "snapkv-bench serve failed (see $BUILD/serve_8b.log)"
fi
# The decode-sized section of a SKV_CUDA_PROFILE table ($BUILD/$1.log, beside its JSON): the
# time per step and the largest ops, for the row
prof_summary() {
    python3 - "$BUILD/$1.json" "$BUILD/$1.log" <<'EOF2'
import json, re, sys
dec = json.load(open(sys.argv[1]))["decode"][0]
rows, on = [], False
for l in open(sys.argv[2]):
    if l.startswith("decode-sized calls") or l.startswith("the rest"):
        on = l.startswith("decode-sized")
    elif on and re.match(r"^[a-z_0-9]+ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+%", l):
        rows.append(l.split())
top = sorted(rows, key=lambda r: -float(r[2]))[:4]
if not top:
    sys.exit("no decode-sized section in " + sys.argv[2])
print(f"{1000 * dec['seconds'] / dec['tokens']:.2f} ms/step; largest: "
      + ", ".join(f"{r[0]} {r[4]} ({r[3]} us/call)" for r in top))
EOF2
}

# prof_run NAME MODE ARGS...: snapkv-bench speed ARGS on CUDA at depth C1 with SKV_CUDA_PROFILE=MODE,
# and its row from prof_summary
prof_run() {
    local name=$1 mode=$2
    shift 2
    if run "$name" 60 env SKV_CUDA_PROFILE="$mode" "$BENCH" speed --backend cuda --prefill none \
           --decode-depth "$C1" --json "$@"; then
        local sum
        if sum=$(prof_summary "$name"); then
            row "$name" "ok" "$sum"
        else
            bad "$name" "no profile table in $BUILD/$name.log"
        fi
    elif [ $? != 2 ]; then
        bad "$name" "snapkv-bench speed with SKV_CUDA_PROFILE=$mode failed (see $BUILD/$name.log)"
    fi
}

# 8b. where a decoded token's time goes: SKV_CUDA_PROFILE=1 (host time inside each backend op)
# and =2 (each op synchronized: its device time too), 128 tokens at depth 1024 on each model;
# the tables land in prof{1,2}_*.log (SKV_GPU_CHECK_PROFILE=0: not run)
PROFILE=${SKV_GPU_CHECK_PROFILE:-1}
if [ "$DRY" != 1 ] && [ "$PROFILE" != 0 ]; then
    for pm in "default:$MODEL" "8b:$BIG"; do
        [ -f "${pm#*:}" ] || continue
        for mode in 1 2; do
            prof_run "prof${mode}_${pm%%:*}" "$mode" --model "${pm#*:}" --decode-tokens 128
        done
    done
fi

# 8c. a decode group: 8 copies of one sequence decoded together (one forward a step, as the
# daemon batches concurrent sessions), full cache and SnapKV, on the 8B-shaped model; then the
# SnapKV group's ops with SKV_CUDA_PROFILE=2 (prof2_8b_batch8: each op synchronized)
if [ -f "$BIG" ]; then
    for sp in "full:" "snapkv:--compress $SNAP"; do
        name=speed_8b_batch8_${sp%%:*}
        # shellcheck disable=SC2086
        if run "$name" 120 "$BENCH" speed --model "$BIG" --backend "$BACKEND" $THREADS --prefill none \
               --decode-depth "$C1,$C16" --decode-tokens 32 --batch 8 ${sp#*:} --json; then
            row "$name" "ok" "$(python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))["decode"]
print("; ".join("@%d: %.1f t/s over 8, %.2f ms a step" % (x["depth"], x["tokens_per_second"],
                1000 * x["seconds"] / x["tokens"]) for x in d))
' "$BUILD/$name.json")"
        elif [ $? != 2 ]; then
            bad "$name" "snapkv-bench speed --batch 8 failed (see $BUILD/$name.log)"
        fi
        # what a step of the group costs against one token decoded alone (the speed step's JSON)
        one=$BUILD/speed_8b_${sp%%:*}.json
        if [ -f "$BUILD/$name.json" ] && [ -f "$one" ]; then
            row "group cost 8b ${sp%%:*}" "reported" "$(python3 -c '
import json, sys
grp = {x["depth"]: x for x in json.load(open(sys.argv[1]))["decode"]}
one = {x["depth"]: x for x in json.load(open(sys.argv[2]))["decode"]}
out = []
for d in sorted(grp):
    if d in one:
        g, o = grp[d]["seconds"] / grp[d]["tokens"], one[d]["seconds"] / one[d]["tokens"]
        out.append("@%d: a step of 8 = %.2fx a token alone (%.2f vs %.2f ms)" % (d, g / o, 1000 * g, 1000 * o))
print("; ".join(out) or "no common depth")
' "$BUILD/$name.json" "$one")"
        fi
    done
    if [ "$DRY" != 1 ] && [ "$PROFILE" != 0 ]; then
        prof_run prof2_8b_batch8 2 --model "$BIG" --decode-tokens 32 --batch 8 --compress "$SNAP"
    fi
fi

# 8d. kv-type f16 and q8_0 on the 8B-shaped model: the full cache's decode with f16 rows (half the
# bytes a step reads) and q8_0 rows (17/64 of them) against the f32 run of step 7
if [ -f "$BIG" ]; then
    for kvt in f16 q8_0; do
        speed "speed_8b_full_$kvt" "$BIG" --kv-type "$kvt"
        if [ -f "$BUILD/speed_8b_full_$kvt.json" ] && [ -f "$BUILD/speed_8b_full.json" ]; then
            row "kv $kvt vs f32 8b full" "reported" "$(python3 -c '
import json, sys
try:
    h = {x["depth"]: x["seconds"] / x["tokens"] for x in json.load(open(sys.argv[1]))["decode"]}
    f = {x["depth"]: x["seconds"] / x["tokens"] for x in json.load(open(sys.argv[2]))["decode"]}
except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
    sys.exit(print("no figures (a run failed or was cut: see speed_8b_full*.log): %s" % e))
out = ["@%d: %s %.2f vs f32 %.2f ms/token (f32 / %s = %.2f)" % (d, sys.argv[3], 1000 * h[d], 1000 * f[d],
       sys.argv[3], f[d] / h[d]) for d in sorted(h) if d in f]
print("; ".join(out) or "no common depth")
' "$BUILD/speed_8b_full_$kvt.json" "$BUILD/speed_8b_full.json" "$kvt")"
        fi
    done
fi

# 9. transformers + kvpress SnapKVPress on the same shapes and budget (when torch imports)
if compgen -G "$SRC/.whl/*.whl" >/dev/null; then
    say "+ $PY -m pip install --no-index --no-deps --target $BUILD/pysite $SRC/.whl/*.whl"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$BUILD/pysite" \
        "$SRC"/.whl/*.whl >"$BUILD/pip.log" 2>&1 && export PYTHONPATH=$BUILD/pysite${PYTHONPATH:+:$PYTHONPATH} ||
        say "  wheel install failed (see $BUILD/pip.log); trying the python as it is"
fi
if [ "${SKV_GPU_CHECK_KVPRESS:-1}" = 0 ]; then
    row "kvpress" "skipped" "SKV_GPU_CHECK_KVPRESS=0"
elif env -u LD_LIBRARY_PATH "$PY" -c "import torch" 2>/dev/null; then
    kvp() {  # kvp NAME SHAPE
        local rc=0
        run "$1" 150 env -u LD_LIBRARY_PATH PYTHONUNBUFFERED=1 "$PY" "$SRC/tests/gpu/kvpress_speed.py" --shape "$2" --context "$C16" \
            --budget "$BUDGET" --decode-tokens "$KVP_DTOK" --device "$PYDEV" || rc=$?
        case $rc in
            0) ;;
            3) row "$1" "skipped" "$(tail -1 "$BUILD/$1.log")" ;;
            *) bad "$1" "kvpress_speed.py failed (see $BUILD/$1.log)" ;;
        esac
    }
    [ -f "$BIG" ] && kvp kvpress_8b "$KVP_BIG"
    kvp kvpress_default "$KVP_DEFAULT"
else
    row "kvpress" "skipped" "$PY cannot import torch (SKV_PYTHON names one that can)"
fi

rm -f "$BIG"

# 10. the figures the goals need, from the JSON above
if [ -n "${BW_GBS:-}" ]; then
    say "+ python3 $SRC/tests/gpu/check_report.py $BUILD --bw-gbs $BW_GBS --ctx $C1,$C8,$C16,$C32 --budget $BUDGET"
    if report=$(python3 "$SRC/tests/gpu/check_report.py" "$BUILD" --bw-gbs "$BW_GBS" --bw-what "$BW_WHAT" \
                 --ctx "$C1,$C8,$C16,$C32" --budget "$BUDGET"); then
        while IFS=$'\t' read -r c r d; do
            row "$c" "$r" "$d"
        done <<<"$report"
    else
        bad "report" "check_report.py failed"
    fi
else
    bad "report" "no bandwidth measured: no roofline"
fi
row "total" "$([ "$BAD" = 0 ] && echo ok || echo "$BAD failed")" "$SECONDS s (limit $LIMIT s)"
table
[ "$BAD" = 0 ]
