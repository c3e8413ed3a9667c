#!/usr/bin/env bash
# Kernel by kernel, where a decoded token's device time goes: Nsight Compute (ncu) times
# LAUNCHES consecutive kernels well inside a batch-1 decode at depth 1024 (snapkv-bench speed
# --prefill none: the prefill and a 64-token warm-up come first, then DECODE_TOKENS tokens;
# the first SKIP launches are passed over, so the ones timed are decode steps), with the DRAM
# bytes each one moved, then sums them per kernel name: calls, total and mean microseconds,
# GB/s. Run on the device, after check.sh or tests/gpu/bundle.sh's build is unpacked.
# Usage: tests/gpu/ncu_decode.sh BENCH MODEL OUT_PREFIX   (writes OUT_PREFIX.csv and .txt)
# Environment: NCU (default: ncu on the PATH, else the newest /opt/nvidia/nsight-compute/*/ncu),
#   SKIP (default 12000), LAUNCHES (default 400), DECODE_TOKENS (default 40), BATCH (sequences
#   decoded together, snapkv-bench speed --batch; default 1).
set -euo pipefail
[ $# = 3 ] || { echo "usage: tests/gpu/ncu_decode.sh BENCH MODEL OUT_PREFIX" >&2; exit 2; }
BENCH=$1 MODEL=$2 PREFIX=$3
SKIP=${SKIP:-12000} LAUNCHES=${LAUNCHES:-400} DECODE_TOKENS=${DECODE_TOKENS:-40}
NCU=${NCU:-$(command -v ncu || ls -d /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | sort -V | tail -1 || true)}
NCU=$(command -v "$NCU" || true)
[ -n "$NCU" ] || { echo "ncu_decode.sh: no ncu found (set NCU)" >&2; exit 3; }
"$NCU" --csv --print-units base --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    --launch-skip "$SKIP" --launch-count "$LAUNCHES" \
    "$BENCH" speed --model "$MODEL" --backend cuda --prefill none --decode-depth 1024 \
    --decode-tokens "$DECODE_TOKENS" --batch "${BATCH:-1}" >"$PREFIX.csv" 2>"$PREFIX.log" ||
    { tail -5 "$PREFIX.log" >&2; echo "ncu_decode.sh: ncu or snapkv-bench failed (see $PREFIX.log)" >&2; exit 1; }
python3 - "$PREFIX.csv" >"$PREFIX.txt" <<'EOF'
import csv, io, re, sys
text = open(sys.argv[1]).read()
if '"ID"' not in text:
    sys.exit("ncu_decode.sh: no kernel was timed (fewer launches than SKIP?)")
rows = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))
k = {}
units = {"ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "nsecond": 1e-3,
         "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9, "B": 1.0}
for r in rows:
    try:
        v = float(r["Metric Value"].replace(",", "")) * units.get(r["Metric Unit"], 1.0)
    except ValueError:  # "n/a"
        continue
    e = k.setdefault((r["ID"], r["Kernel Name"]), {})
    e[r["Metric Name"]] = v
per = {}
for (_, name), m in k.items():
    mt = re.match(r"(?:void )?([\w:]+(?:<[^>]*>)?)", name)
    short = mt.group(1) if mt else name[:40]
    p = per.setdefault(short, [0, 0.0, 0.0])
    p[0] += 1
    p[1] += m.get("gpu__time_duration.sum", 0.0)
    p[2] += m.get("dram__bytes_read.sum", 0.0) + m.get("dram__bytes_write.sum", 0.0)
total = sum(p[1] for p in per.values())
print(f"{len(k)} kernels timed, {total:.1f} us in all")
print(f"{'kernel':40s} {'calls':>6s} {'total us':>10s} {'mean us':>9s} {'share':>7s} {'GB/s':>8s}")
for name, (n, us, by) in sorted(per.items(), key=lambda x: -x[1][1]):
    print(f"{name[:40]:40s} {n:6d} {us:10.1f} {us / n:9.2f} {100 * us / total:6.1f}% {by / (us * 1e3) if us else 0:8.1f}")
EOF
cat "$PREFIX.txt"
