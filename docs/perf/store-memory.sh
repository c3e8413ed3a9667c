#!/bin/bash
# The daemons' peak memory in `snapkv-bench serve --parts store` (a full-cache session of
# CONTEXT tokens, default 4096, spilled by daemon A and loaded by daemon B): VmHWM of every
# snapkvd, sampled every 50 ms while the bench runs. Run from the repository root after a build
# (BUILD=dir: another build directory, e.g. of an older commit in a git worktree).
set -e
B=${BUILD:-build}
CONTEXT=${CONTEXT:-4096}
LOG=$(mktemp)
(while true; do
    for p in $(pgrep -x snapkvd); do
        echo "$p $(awk '/VmHWM/ {print $2}' /proc/$p/status 2>/dev/null)"
    done >>"$LOG"
    sleep 0.05
done) &
SAMPLER=$!
$B/snapkv-bench serve --model models/SmolLM2-135M-Instruct.Q4_1.gguf --threads 2 --parts store \
    --context "$CONTEXT" --specs "policy=full" 2>&1 | grep -E "started|stored;"
kill $SAMPLER
# the daemons in the order they started (the bench's idle one, A, B): their last VmHWM
awk 'NF == 2 && $2 > 0 { if (!($1 in h)) order[n++] = $1; h[$1] = $2 }
     END { for (i = 0; i < n; i++) printf "snapkvd pid %s: VmHWM %.0f MB\n", order[i], h[order[i]] / 1024 }' "$LOG"
rm -f "$LOG"
