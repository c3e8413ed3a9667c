#!/bin/sh
# What running a long APPEND on a copy of the session costs: a 3428-token document prefilled
# under SPEC (default policy=h2o,ratio=0.1, whose upkeep evicts rows, so an APPEND of 64 tokens
# or more runs on a copy of its cache and compressor), then ten APPENDs of a 93-token question;
# prints each APPEND's wall time as snapkvctl sees it and their median. Run from the repository
# root after a build (BUILD=dir: another build directory, e.g. of an older commit).
set -e
B=${BUILD:-build}
SPEC=${SPEC:-policy=h2o,ratio=0.1}
D=$(mktemp -d)
$B/snapkvd --model models/SmolLM2-135M-Instruct.Q4_1.gguf --threads 2 --pool-size 2G \
    --endpoint ipc://$D/c --admin-endpoint ipc://$D/a --state-dir $D 2>>$D/log &
pid=$!
for _ in $(seq 100); do $B/snapkvctl -e ipc://$D/c --timeout 200 info >/dev/null 2>&1 && break; sleep 0.2; done
ctl() { $B/snapkvctl -e ipc://$D/c -a ipc://$D/a --timeout 600000 "$@"; }
head -c 16000 /usr/share/common-licenses/GPL-3 > $D/doc.txt
s=$(ctl prefill --compress "$SPEC" --file $D/doc.txt 2>/dev/null)
q="Question: which of the sections above says what a covered work is, what conveying means, how the source code must be offered to the recipients, and what happens to the licence when someone breaks its terms? Answer in one sentence."
for i in 1 2 3 4 5 6 7 8 9 10; do
    t0=$(date +%s%N)
    ctl append $s "$q" >/dev/null
    t1=$(date +%s%N)
    echo $(( (t1 - t0) / 1000000 ))
done > $D/ms
echo "$SPEC: APPEND ms: $(tr '\n' ' ' < $D/ms)"
echo "median: $(sort -n $D/ms | sed -n 5,6p | awk '{s+=$1} END {print s/2}') ms"
kill -TERM $pid; wait $pid || true
rm -rf $D
