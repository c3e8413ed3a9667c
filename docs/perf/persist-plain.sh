#!/bin/sh
# Four full-cache sessions of the same 3428-token document, prefilled separately (no block
# shared while they run), across a restart with persist = yes: the daemon's own save / restore
# lines. DISTINCT=1: four different documents instead (16,000 bytes of the GPL-3 each, from
# offsets 0, 8000, 16000 and 24000), nothing equal. Run from the repository root after a build
# (BUILD=dir: another build directory).
set -e
B=${BUILD:-build}
D=$(mktemp -d)
start() {
    $B/snapkvd --model models/SmolLM2-135M-Instruct.Q4_1.gguf --threads 2 --pool-size 2G \
        --max-bytes-per-tenant 2G --persist=yes --endpoint ipc://$D/c --admin-endpoint ipc://$D/a \
        --state-dir $D 2>>$D/log &
    pid=$!
    for _ in $(seq 100); do $B/snapkvctl -e ipc://$D/c --timeout 200 info >/dev/null 2>&1 && break; sleep 0.2; done
}
ctl() { $B/snapkvctl -e ipc://$D/c -a ipc://$D/a --timeout 600000 "$@"; }
start
for i in 0 1 2 3; do
    skip=$((${DISTINCT:-0} * i * 8000))
    tail -c +$((skip + 1)) /usr/share/common-licenses/GPL-3 | head -c 16000 > $D/doc.txt
    ctl -t bulk prefill --file $D/doc.txt >/dev/null 2>&1
done
kill -TERM $pid; wait $pid || true
start
ctl list >/dev/null # answered once the engine thread has restored every session
kill -TERM $pid; wait $pid || true
grep -E "persist:" $D/log
rm -rf $D
