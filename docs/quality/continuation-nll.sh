#!/usr/bin/env bash
# What compression costs a continuation, through the daemon: for each text, a session of its
# beginning (the document) under each spec, then its last CONT characters appended with
# `snapkvctl append --score`; the table gives nats a token of the continuation (lower is
# better) and the difference to the full cache. Run from anywhere; B (build folder) and M
# (model) may be set. Usage: docs/quality/continuation-nll.sh [CONT_CHARS] (default 1200).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
B=${B:-$ROOT/build}; M=${M:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}
CONT=${1:-1200}
D=$(mktemp -d /tmp/cnll-XXXXXX); EP=ipc://$D/c.sock; AD=ipc://$D/a.sock
trap 'kill -TERM $(cat $D/pid 2>/dev/null) 2>/dev/null || true; sleep 0.5; rm -rf $D' EXIT
TEXTS="tests/fixtures/quality/gpl-2.0.txt tests/fixtures/golden/long_prompt.txt \
tests/fixtures/golden/fidelity_prompt.txt"
SPECS="policy=full policy=snapkv,ratio=0.1 policy=snapkv,ratio=0.2 policy=snapkv,ratio=0.5 policy=streaming,ratio=0.1 \
policy=h2o,ratio=0.1 policy=snapkv,alloc=pyramid,ratio=0.1 policy=snapkv,alloc=squeeze,ratio=0.1 \
policy=snapkv,granularity=head,ratio=0.1"
$B/snapkvd --model $M --endpoint $EP --admin-endpoint $AD --threads 2 --pool-size 2G --log-level warn > $D/log 2>&1 &
echo $! > $D/pid
for i in $(seq 100); do [ -S $D/a.sock ] && $B/snapkvctl -a $AD status >/dev/null 2>&1 && break; sleep 0.2; done
echo "# $(date -u +%FT%TZ) commit $(git -C "$ROOT" rev-parse --short HEAD) model $(basename $M)"
echo "# $(lscpu | sed -n 's/^Model name: *//p'), snapkvd --threads 2; continuation: the last $CONT characters"
for t in $TEXTS; do
  python3 - "$ROOT/$t" "$CONT" "$D" <<'EOF'
import sys
text = open(sys.argv[1], encoding="utf-8").read()
cut = len(text) - int(sys.argv[2])
while cut > 0 and not text[cut].isspace():  # the continuation starts at a word
    cut -= 1
open(sys.argv[3] + "/doc.txt", "w").write(text[:cut])
open(sys.argv[3] + "/cont.txt", "w").write(text[cut:])
EOF
  for s in $SPECS; do
    id=$($B/snapkvctl -e $EP --tenant q prefill --file $D/doc.txt --compress "$s" 2>$D/prefill.err)
    $B/snapkvctl -e $EP --tenant q --json append "$id" --file $D/cont.txt --score > $D/a.json
    $B/snapkvctl -e $EP --tenant q release "$id" > /dev/null
    python3 -c "import json,sys; d=json.load(open('$D/a.json')); n=len(d['prompt_logprobs']); \
print('%s\t%s\t%d\t%s\t%.4f' % (sys.argv[1], sys.argv[2], n, sys.argv[3], -d['sum_logprob'] / n))" \
      "$(basename $t)" "$s" "$(sed -n 's/^\([0-9]*\) prompt tokens.*/\1/p' $D/prefill.err)"
  done
done > $D/rows.tsv
python3 - "$D/rows.tsv" <<'EOF'
import sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
texts = list(dict.fromkeys(r[0] for r in rows))
specs = list(dict.fromkeys(r[1] for r in rows))
val = {(r[0], r[1]): float(r[4]) for r in rows}
meta = {r[0]: (r[3], r[2]) for r in rows}
print("| spec | " + " | ".join("%s (%s + %s tokens)" % (t, *meta[t]) for t in texts) + " | mean Δ vs full |")
print("|---|" + "---:|" * (len(texts) + 1))
for s in specs:
    cells = []
    for t in texts:
        v, d = val[(t, s)], val[(t, s)] - val[(t, "policy=full")]
        cells.append("%.4f" % v if s == "policy=full" else "%.4f (%+.4f)" % (v, d))
    mean = sum(val[(t, s)] - val[(t, "policy=full")] for t in texts) / len(texts)
    print("| `%s` | %s | %+.4f |" % (s, " | ".join(cells), mean))
EOF
