#!/usr/bin/env bash
# What prompt scores cost a PREFILL: two documents (1637 and 4039 tokens) prefilled with every
# token computed (--no-reuse), alternately unscored and scored (--score), twice each; wall time
# of snapkvctl's call. B (build folder) and M (model) may be set; MODES (default "plain --score
# plain --score") the prefill options of each run in turn, e.g. MODES="--score --top=20
# --score --top=20" ("plain": none).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
B=${B:-$ROOT/build}; M=${M:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}
D=$(mktemp -d /tmp/sc-XXXXXX); EP=ipc://$D/c.sock; AD=ipc://$D/a.sock
trap 'kill -TERM $(cat $D/pid 2>/dev/null) 2>/dev/null || true; sleep 0.5; rm -rf $D' EXIT
$B/snapkvd --model $M --endpoint $EP --admin-endpoint $AD --threads 2 --pool-size 2G --log-level warn > $D/log 2>&1 &
echo $! > $D/pid
for i in $(seq 100); do [ -S $D/a.sock ] && $B/snapkvctl -a $AD status >/dev/null 2>&1 && break; sleep 0.2; done
echo "# $(date -u +%FT%TZ) commit $(git -C "$ROOT" rev-parse --short HEAD), $(lscpu | sed -n 's/^Model name: *//p')"
for doc in tests/fixtures/golden/long_prompt.txt tests/fixtures/quality/gpl-2.0.txt; do
  for mode in ${MODES:-plain --score plain --score}; do
    [ "$mode" = plain ] && mode=""
    s=$(date +%s.%N)
    id=$($B/snapkvctl -e $EP --tenant t prefill --file $ROOT/$doc --no-reuse $mode 2> $D/err)
    e=$(date +%s.%N)
    $B/snapkvctl -e $EP --tenant t release $id > /dev/null
    printf '%-14s %-8s %5s tokens  %.3f s  %s\n' $(basename $doc) "${mode:-plain}" \
      "$(sed -n 's/^\([0-9]*\) prompt tokens.*/\1/p' $D/err)" $(echo "$e - $s" | bc) "$(grep scored $D/err || true)"
  done
done
