#!/bin/sh
# The engines' activation buffers after a request ran nested (fair-slice-ms) inside another
# tenant's long prefill: STATS snapkv_engine_scratch_bytes and snapkv_requests_nested_total.
set -e
D=$(mktemp -d)
build/snapkvd --model models/SmolLM2-135M-Instruct.Q4_1.gguf --threads 2 --pool-size 2G \
  --endpoint ipc://$D/c --admin-endpoint ipc://$D/a --state-dir $D 2>$D/log & pid=$!
sleep 2
head -c 24000 /usr/share/common-licenses/GPL-3 > $D/bulk.txt
head -c 12000 /usr/share/common-licenses/Apache-2.0 > $D/small.txt
build/snapkvctl -e ipc://$D/c -t bulk prefill --file $D/bulk.txt --compress policy=snapkv,ratio=0.1 > $D/bulk.id &
b=$!
sleep 1
build/snapkvctl -e ipc://$D/c -t small prefill --file $D/small.txt --compress policy=snapkv,ratio=0.1 > $D/small.id
wait $b
build/snapkvctl -a ipc://$D/a list
build/snapkvctl -a ipc://$D/a stats | grep -E "scratch|nested"
kill -TERM $pid; wait $pid || true
rm -rf $D
