#!/bin/bash
# The STATUS round trip of two snapkvd builds, alternately, against the transport alone.
# Usage (from the repository root, build/ built): docs/perf/roundtrip-ab.sh OLD_SNAPKVD NEW_SNAPKVD [ROUNDS]
# Each round starts each daemon in turn on the default model and runs
# `snapkv-bench serve --parts roundtrip` against it (the same bench binary for both), which
# interleaves blocks of admin STATUS calls with a plain ZeroMQ echo of the same size; prints
# the p50s and STATUS minus the echo, the daemon's and libsnapkv's share.
set -eu
old=$1 new=$2 rounds=${3:-5}
cd "$(dirname "$0")/../../build"
for r in $(seq "$rounds"); do
    for b in old new; do
        bin=$old; [ "$b" = new ] && bin=$new
        d=$(mktemp -d /tmp/skv-rt-XXXXXX)
        "$bin" --model ../models/SmolLM2-135M-Instruct.Q4_1.gguf --endpoint "ipc://$d/c.sock" \
            --admin-endpoint "ipc://$d/a.sock" --state-dir "$d" --log-file "$d/log" --threads 2 &
        pid=$!
        sleep 1
        out=$(./snapkv-bench serve --model ../models/SmolLM2-135M-Instruct.Q4_1.gguf --endpoint "ipc://$d/c.sock" \
            --admin-endpoint "ipc://$d/a.sock" --parts roundtrip 2>&1)
        kill "$pid"; wait "$pid" 2>/dev/null || true
        rm -rf "$d"
        st=$(echo "$out" | awk -F'|' '/admin STATUS/ {print $3+0}')
        rl=$(echo "$out" | awk -F'|' '/RELEASE unknown/ {print $3+0}')
        tr=$(echo "$out" | awk -F'|' '/transport alone/ {print $3+0}')
        echo "round $r $b: STATUS p50 $st us, transport $tr us, STATUS - transport $(awk -v a="$st" -v b="$tr" 'BEGIN { printf "%.1f", a - b }') us, RELEASE (worker) $rl us"
    done
done
