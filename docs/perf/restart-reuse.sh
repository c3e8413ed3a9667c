#!/usr/bin/env bash
# A 1639-token document prefilled, the daemon restarted (persist = yes), then the document plus
# a question prefilled twice: computing every token (--no-reuse) and taking the restored rows.
set -euo pipefail
B=/work/main/build; M=/work/main/models/SmolLM2-135M-Instruct.Q4_1.gguf
D=$(mktemp -d /tmp/rr-XXXXXX); EP=ipc://$D/c.sock; AD=ipc://$D/a.sock
DOC=/work/main/tests/fixtures/golden/long_prompt.txt
{ cat $DOC; printf '\n\nWhat is this text about? Answer in one line.'; } > $D/q.txt
start() { $B/snapkvd --model $M --endpoint $EP --admin-endpoint $AD --state-dir $D --persist=yes --threads 2 \
  --log-level warn > $D/log 2>&1 & echo $! > $D/pid; for i in $(seq 100); do [ -S $D/a.sock ] && $B/snapkvctl -a $AD status >/dev/null 2>&1 && break; sleep 0.2; done; }
start
$B/snapkvctl -e $EP --tenant t prefill --file $DOC >/dev/null
kill -TERM $(cat $D/pid); wait $(cat $D/pid) 2>/dev/null || true
while kill -0 $(cat $D/pid) 2>/dev/null; do sleep 0.1; done
start
for mode in --no-reuse "" --no-reuse ""; do
  s=$(date +%s.%N); $B/snapkvctl -e $EP --tenant t --json prefill --file $D/q.txt $mode > $D/out.json; e=$(date +%s.%N)
  python3 -c "import json,sys; d=json.load(open('$D/out.json')); print('%-11s n_tokens %d reused %d  %.3f s' % (sys.argv[1] or '(reuse)', d['n_tokens'], d['reused_tokens'], float(sys.argv[3])-float(sys.argv[2])))" "$mode" $s $e
done
kill -TERM $(cat $D/pid); wait 2>/dev/null || true; rm -rf $D
