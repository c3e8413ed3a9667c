#!/bin/bash
# Kept prefixes with several documents: one-shot clients ask about three documents in turn
# (the first 6,000 bytes of the Apache-2.0, GPL-3 and MPL-2.0 texts in /usr/share/common-licenses,
# about 1,300 tokens each), four rounds of a different question each: PREFILL of the document
# and the question (full cache), then RELEASE, which keeps the prompt's blocks
# (prefix-retain-bytes = 256M). Prints each PREFILL's reused tokens and wall time, and the kept
# prefixes and their bytes at the end (STATS).
# Usage (from the repository root): docs/perf/retain-docs.sh [BUILD_DIR (default build)]
set -eu
cd "$(dirname "$0")/../.."
b=${1:-build}
ctl=$b/snapkvctl
d=$(mktemp -d /tmp/skv-rdocs-XXXXXX)
for doc in Apache-2.0 GPL-3 MPL-2.0; do head -c 6000 "/usr/share/common-licenses/$doc" >"$d/$doc"; done
"$b/snapkvd" --model models/SmolLM2-135M-Instruct.Q4_1.gguf --endpoint "ipc://$d/c.sock" \
    --admin-endpoint "ipc://$d/a.sock" --state-dir "$d" --log-file "$d/log" --threads 2 \
    --prefix-retain-bytes 256M &
pid=$!
for _ in $(seq 100); do "$ctl" -e "ipc://$d/c.sock" --timeout 200 info >/dev/null 2>&1 && break; sleep 0.2; done
total=0
for round in 1 2 3 4; do
    for doc in Apache-2.0 GPL-3 MPL-2.0; do
        { cat "$d/$doc"; printf '\n\nQuestion %d: what does this text allow?\n' "$round"; } >"$d/q.txt"
        t0=$(date +%s%N)
        out=$("$ctl" -e "ipc://$d/c.sock" --timeout 300000 --json prefill --file "$d/q.txt")
        t1=$(date +%s%N)
        sid=$(echo "$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["session"])')
        reused=$(echo "$out" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["reused_tokens"], "of", d["n_tokens"])')
        "$ctl" -e "ipc://$d/c.sock" release "$sid" >/dev/null
        total=$((total + (t1 - t0) / 1000000))
        printf 'round %d %-10s %5d ms  reused %s\n' "$round" "$doc" $(((t1 - t0) / 1000000)) "$reused"
    done
done
echo "all 12 PREFILLs: $total ms"
"$ctl" -a "ipc://$d/a.sock" stats | grep -E "^snapkv_prefix_retained"
kill -TERM "$pid"; wait "$pid" || true
rm -rf "$d"
