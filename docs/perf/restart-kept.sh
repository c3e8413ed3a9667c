#!/bin/bash
# Kept prefixes across a restart (persist = yes, prefix-retain-bytes = 256M): a one-shot client
# PREFILLs a 1,637-token document and a question and RELEASEs it (the daemon keeps the prompt's
# blocks), the daemon stops (SIGTERM) and starts again, then another client's PREFILL of the
# document and another question, alternately computing every token (--no-reuse) and taking the
# kept rows. Prints each PREFILL's wall time (a `snapkvctl --json prefill` process) and reused
# tokens, and the daemon's own log lines of the save and the restore.
# Usage (from the repository root, build/ built): docs/perf/restart-kept.sh [SPEC]
set -eu
spec=${1:-policy=full}
cd "$(dirname "$0")/../.."
ctl=./build/snapkvctl
d=$(mktemp -d /tmp/skv-rkept-XXXXXX)
start() {
    ./build/snapkvd --model models/SmolLM2-135M-Instruct.Q4_1.gguf --endpoint "ipc://$d/c.sock" \
        --admin-endpoint "ipc://$d/a.sock" --state-dir "$d" --log-file "$d/log" --threads 2 \
        --persist=yes --prefix-retain-bytes 256M &
    pid=$!
    for _ in $(seq 100); do "$ctl" -e "ipc://$d/c.sock" --timeout 200 info >/dev/null 2>&1 && break; sleep 0.2; done
}
ask() { # question number, extra flag: one PREFILL timed, then its RELEASE
    { cat tests/fixtures/golden/long_prompt.txt; printf '\n\nQuestion %d: who may copy this program?\n' "$1"; } >"$d/q.txt"
    t0=$(date +%s%N)
    out=$("$ctl" -e "ipc://$d/c.sock" --timeout 300000 --json prefill --file "$d/q.txt" --compress "$spec" ${2:-})
    t1=$(date +%s%N)
    sid=$(echo "$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["session"])')
    reused=$(echo "$out" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["reused_tokens"], "of", d["n_tokens"])')
    "$ctl" -e "ipc://$d/c.sock" release "$sid" >/dev/null
    printf '%-28s %-11s %5d ms  reused %s\n' "$spec" "${2:-(reuse)}" $(((t1 - t0) / 1000000)) "$reused"
}
start
ask 1 --no-reuse
kill -TERM "$pid"; wait "$pid" || true
start
ask 2; ask 3 --no-reuse; ask 4; ask 5 --no-reuse # the first one after the restart takes the restored rows
kill -TERM "$pid"; wait "$pid" || true
grep -E "persist: (saved|restored)" "$d/log"
rm -rf "$d"
