#!/bin/bash
# One-shot clients over one document: each asks a question as a whole prompt (PREFILL of the
# document and its question, a few greedy tokens, RELEASE), the way `snapkvctl generate` does,
# so no session outlives its request. With prefix-retain-bytes the daemon keeps a RELEASEd
# full-cache prompt's blocks, or a SnapKV PREFILL's prompt rows before it cuts them, and the
# next client's PREFILL takes them.
# Usage (from the repository root, build/ built): docs/perf/prefix-retain.sh [QUESTIONS]
# Prints each PREFILL's time and reused tokens: full cache with prefix-retain-bytes 0 and 256M,
# SnapKV 10% with 0 and 256M.
set -eu
questions=${1:-4}
cd "$(dirname "$0")/../.."
ctl=./build/snapkvctl
for run in "0 policy=full" "256M policy=full" "0 policy=snapkv,ratio=0.1" "256M policy=snapkv,ratio=0.1"; do
    retain=${run% *} spec=${run#* }
    d=$(mktemp -d /tmp/skv-retain-XXXXXX)
    ./build/snapkvd --model models/SmolLM2-135M-Instruct.Q4_1.gguf --endpoint "ipc://$d/c.sock" \
        --admin-endpoint "ipc://$d/a.sock" --state-dir "$d" --log-file "$d/log" --threads 2 \
        --prefix-retain-bytes "$retain" &
    pid=$!
    for _ in $(seq 100); do "$ctl" -e "ipc://$d/c.sock" --timeout 200 info >/dev/null 2>&1 && break; sleep 0.2; done
    for q in $(seq "$questions"); do
        { cat tests/fixtures/golden/long_prompt.txt; printf '\n\nQuestion %d: who may copy this program?\n' "$q"; } >"$d/q.txt"
        # --json: the reply's reused_tokens; the first client computes every token
        t0=$(date +%s%N)
        out=$("$ctl" -e "ipc://$d/c.sock" --timeout 300000 --json prefill --file "$d/q.txt" --compress "$spec")
        t1=$(date +%s%N)
        sid=$(echo "$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["session"])')
        reused=$(echo "$out" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["reused_tokens"], "of", d["n_tokens"])')
        "$ctl" -e "ipc://$d/c.sock" decode "$sid" --max-tokens 8 >/dev/null
        "$ctl" -e "ipc://$d/c.sock" release "$sid"
        echo "$spec, prefix-retain-bytes $retain, client $q: PREFILL $(( (t1 - t0) / 1000000 )) ms, $reused tokens reused"
    done
    kill "$pid"; wait "$pid" 2>/dev/null || true
    rm -rf "$d"
done
