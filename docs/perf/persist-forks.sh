#!/bin/sh
# A document shared by forks, across a restart with persist = yes: the pool's bytes before the
# stop and after the start (forks get their document's blocks back shared), and the daemon's
# own save / restore lines. Run from the repository root after a build (BUILD=dir: another
# build directory, e.g. of an older commit in a git worktree).
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
head -c 16000 /usr/share/common-licenses/GPL-3 > $D/doc.txt
doc=$(ctl prefill --file $D/doc.txt 2>/dev/null)
ctl pin $doc
for i in 1 2 3 4 5 6 7 8; do
    f=$(ctl fork $doc)
    ctl append $f "Question $i: what does section $i say about conveying copies?" >/dev/null
done
sleep 1.5
echo "before the stop:"; ctl status | grep -E "sessions|pool"
kill -TERM $pid; wait $pid || true
start
ctl list >/dev/null # answered once the engine thread has restored every session
sleep 1.5           # STATUS reads the snapshot the engine thread publishes every second
echo "after the start:"; ctl status | grep -E "sessions|pool"
kill -TERM $pid; wait $pid || true
grep -E "persist:" $D/log
rm -rf $D
