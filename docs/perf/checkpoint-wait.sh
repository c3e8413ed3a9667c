#!/usr/bin/env bash
# How long a request waits behind a checkpoint: four different 3428-token full-cache documents
# (600 MB of KV, a checkpoint of about a second on this host) and persist-interval-seconds=1
# (INTERVAL=0: no checkpoint, the baseline). 30 times: an APPEND of a few tokens to one session
# (a change, so a checkpoint follows once the engine is idle), then after a random 0-1.5 s a
# LIST, timed as snapkvctl sees it. Prints the LIST times' median and maximum and the
# checkpoints written, and (from the debug log) how long the checkpoints took and what they
# wrote. Run from the repository root after a build (BUILD=dir: another build).
set -e
B=${BUILD:-build}
D=$(mktemp -d)
$B/snapkvd --model models/SmolLM2-135M-Instruct.Q4_1.gguf --threads 2 --pool-size 2G \
    --max-bytes-per-tenant 2G --persist=yes --persist-interval-seconds=${INTERVAL:-1} --log-level debug \
    --endpoint ipc://$D/c --admin-endpoint ipc://$D/a --state-dir $D 2>>$D/log &
pid=$!
for _ in $(seq 100); do $B/snapkvctl -e ipc://$D/c --timeout 200 info >/dev/null 2>&1 && break; sleep 0.2; done
ctl() { $B/snapkvctl -e ipc://$D/c -a ipc://$D/a --timeout 600000 "$@"; }
for i in 0 1 2 3; do
    tail -c +$((i * 8000 + 1)) /usr/share/common-licenses/GPL-3 | head -c 16000 > $D/doc.txt
    s=$(ctl prefill --file $D/doc.txt 2>/dev/null)
done
RANDOM=7
for i in $(seq 30); do
    ctl append $s " and" >/dev/null
    sleep $(printf '0.%03d' $((RANDOM % 1000))); sleep $((RANDOM % 2 ? 0 : 0))
    sleep $(awk -v r=$((RANDOM % 500)) 'BEGIN { printf "%.3f", r / 1000 }')
    t0=$(date +%s%N)
    ctl list >/dev/null
    t1=$(date +%s%N)
    echo $(( (t1 - t0) / 1000000 ))
done > $D/ms
echo "persist-interval-seconds=${INTERVAL:-1}: LIST ms: median $(sort -n $D/ms | sed -n 15p), max $(sort -n $D/ms | tail -1)"
echo "checkpoints: $(ctl stats | awk '/snapkv_persist_checkpoints_total/ {print $2}')"
kill -TERM $pid; wait $pid || true
echo "each checkpoint: bytes written/seconds:" $(grep -E "persist: checkpoint:" $D/log |
    sed -E 's/.* ([0-9]+) bytes written .* in ([0-9.]+) s .*/\1\/\2/')
grep -E "persist: saved" $D/log | tail -1
rm -rf $D
