#!/bin/bash
# The round trips of `snapkv-bench serve --parts roundtrip` while three DEALERs flood the client
# endpoint with malformed requests (each answered by the socket thread), for each snapkvd given.
# Usage (from the repository root, build/ built): docs/perf/flood-roundtrip.sh SNAPKVD [SNAPKVD...]
set -u
top=$(cd "$(dirname "$0")/../.." && pwd)
gcc -O2 "$top/docs/perf/flood.c" -o /tmp/skv-flood -lzmq || exit 1
cd "$top/build"
for b in "$@"; do
    d=$(mktemp -d /tmp/skv-fl-XXXXXX)
    "$b" --model ../models/SmolLM2-135M-Instruct.Q4_1.gguf --endpoint "ipc://$d/c.sock" \
        --admin-endpoint "ipc://$d/a.sock" --state-dir "$d" --log-file "$d/log" --threads 2 --log-level warn &
    pid=$!
    sleep 1
    /tmp/skv-flood "ipc://$d/c.sock" 25 3 2>"$d/flood.txt" &
    fp=$!
    sleep 1
    out=$(timeout 120 ./snapkv-bench serve --model ../models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --endpoint "ipc://$d/c.sock" --admin-endpoint "ipc://$d/a.sock" --parts roundtrip 2>&1)
    wait "$fp"
    echo "== $b: $(cat "$d/flood.txt")"
    echo "$out" | grep -E "STATUS|RELEASE|transport"
    kill "$pid"; wait "$pid" 2>/dev/null
    rm -rf "$d"
done
