#!/usr/bin/env python3
"""The figures of issue 6's goals from the JSON that tests/gpu/check.sh collects in its build
directory: speed (snapkv-bench speed, full cache and SnapKV), the bandwidth roofline, the cost of
context, sessions and aggregate decode in a fixed pool (snapkv-bench serve), ours vs
transformers + kvpress, and the SnapKV compressor's share of prefill.

Prints one row per figure as three tab-separated fields (check, result, detail) for check.sh's
table; result is a number, "met"/"NOT met" for a goal, or "missing". Reads only python3's
standard library (the device image and CI hosts both have it).

Usage: check_report.py DIR --bw-gbs X --ctx 1024,8192,16384,32768 [--models default,8b]
"""
import argparse
import json
import os
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def by_key(entries, key, value):
    for e in entries or []:
        if e.get(key) == value:
            return e
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--bw-gbs", type=float, required=True, help="measured bandwidth, GB/s")
    ap.add_argument("--bw-what", default="device copy")
    ap.add_argument("--ctx", required=True, help="the contexts standing for 1K,8K,16K,32K")
    ap.add_argument("--models", default="default,8b")
    ap.add_argument("--budget", type=int, default=1024)
    a = ap.parse_args()
    c1, c8, c16, c32 = (int(v) for v in a.ctx.split(","))
    rows = []

    def row(check, result, detail=""):
        rows.append((check, result, detail))

    def goal(check, value, ok, detail):
        row(check, "met" if ok else "NOT met", f"{value} ({detail})")

    speed = {}
    for m in a.models.split(","):
        for spec in ("full", "snapkv"):
            j = load(os.path.join(a.dir, f"speed_{m}_{spec}.json"))
            speed[m, spec] = j
            name = f"speed {m} {spec}"
            if not j:
                row(name, "missing", f"see speed_{m}_{spec}.log")
                continue
            # prefill t/s: the prefill runs, else the prefills that built the decode depths
            pre = ", ".join(f"{p['tokens']}: {p['tokens_per_second']:.0f}" for p in j["prefill"]) or ", ".join(
                f"{d['depth']}: {d['depth'] / d['prefill_seconds']:.0f}" for d in j["decode"] if d["depth"] > 0)
            dec = ", ".join(f"@{d['depth']}: {d['tokens_per_second']:.1f}" for d in j["decode"])
            row(name, "ok", f"{j['model']} ({j['backend']}), prefill t/s {pre}; decode t/s {dec}")

    # 2. roofline: ideal time per token = (weights + KV read) / bandwidth, against the measured one
    for m in a.models.split(","):
        for spec in ("full", "snapkv"):
            j = speed.get((m, spec))
            for depth in (c1, c32):
                d = by_key(j and j["decode"], "depth", depth)
                if not d:
                    continue
                t = 1.0 / d["tokens_per_second"]
                b = j["weight_bytes"] + d["kv_read_bytes"]
                ideal = b / (a.bw_gbs * 1e9)
                goal(f"roofline {m} {spec} @{depth}", f"{ideal / t:.2f}", ideal / t >= 0.8,
                     f"ideal/measured >= 0.8; {t * 1e3:.3f} ms/token measured, {b / 1e9:.3f} GB "
                     f"(weights {j['weight_bytes'] / 1e9:.3f} + KV {d['kv_read_bytes'] / 1e9:.3f}) / "
                     f"{a.bw_gbs:.0f} GB/s {a.bw_what} = {ideal * 1e3:.3f} ms")

    # 3. the cost of context: time per token at 16K and 32K over 1K
    for m in a.models.split(","):
        tpt = {}
        for spec in ("full", "snapkv"):
            j = speed.get((m, spec))
            for depth in (c1, c16, c32):
                d = by_key(j and j["decode"], "depth", depth)
                if d:
                    tpt[spec, depth] = 1.0 / d["tokens_per_second"]
        for depth in (c16, c32):
            if ("snapkv", depth) in tpt and ("snapkv", c1) in tpt:
                r = tpt["snapkv", depth] / tpt["snapkv", c1]
                goal(f"context cost {m} snapkv @{depth}/@{c1}", f"{r:.2f}x", r <= 1.1,
                     f"SnapKV-{a.budget} time per token <= 1.1x of @{c1}")
            if ("full", depth) in tpt and ("full", c1) in tpt:
                row(f"context cost {m} full @{depth}/@{c1}", f"{tpt['full', depth] / tpt['full', c1]:.2f}x",
                    f"full-cache time per token over the time @{c1}")
        if ("full", c16) in tpt and ("snapkv", c16) in tpt:
            row(f"speedup {m} snapkv vs full @{c16}", f"{tpt['full', c16] / tpt['snapkv', c16]:.2f}x",
                "full-cache / SnapKV time per token; the SnapKV paper: 3.6x (16K input, HF, A100)")

    # 4. sessions in a fixed pool and their aggregate decode
    j = load(os.path.join(a.dir, "serve_8b.json")) or load(os.path.join(a.dir, "serve_default.json"))
    if not j:
        row("pool sessions", "missing", "see serve_*.log")
    else:
        cap = {o["name"]: o for o in j.get("capacity", {}).get("specs", [])}
        dec = j.get("decode", {}).get("specs", [])
        pool = j.get("capacity", {}).get("pool_bytes", 0) / 2**30
        for o in cap.values():
            row(f"pool {pool:.2f} GiB: {o['name']}", str(o["sessions_held_before_eviction"]),
                f"{j['model']}: {j['capacity']['context_tokens']}-token sessions held before eviction "
                f"(computed {o['sessions_fit']}), {o['bytes_after'] / 2**20:.1f} MiB each")
        for o in dec:
            if "skipped" in o:
                row(f"aggregate decode {o['name']}", "skipped", o["skipped"])
            else:
                row(f"aggregate decode {o['name']}", f"{o['tokens_per_s']:.1f} t/s",
                    f"{o['sessions']} concurrent sessions x {j['decode']['tokens_per_session']} tokens, "
                    f"{o['wall_s']:.2f} s")
        if len(dec) >= 2 and "tokens_per_s" in dec[0] and "tokens_per_s" in dec[1]:
            r = dec[1]["tokens_per_s"] / dec[0]["tokens_per_s"]
            goal("aggregate decode snapkv / full", f"{r:.2f}x", r >= 5, "goal >= 5x, same pool")

    # 5. ours vs transformers + kvpress (SnapKVPress, same budget, same shapes)
    for m in a.models.split(","):
        k = load(os.path.join(a.dir, f"kvpress_{m}.json"))
        ours = speed.get((m, "snapkv"))
        d = by_key(ours and ours["decode"], "depth", k["context"]) if k else None
        if not k:
            row(f"kvpress {m}", "missing", f"see kvpress_{m}.log (skipped when torch or kvpress is absent)")
            continue
        shape = k["shape"]
        theirs = k["snapkv"]["decode_tokens_per_s"]
        row(f"kvpress {m} ({shape})", f"{theirs:.1f} t/s",
            f"SnapKVPress ratio {k['compression_ratio']:.4f} (kept {k['snapkv']['kept_tokens']}) @{k['context']}, "
            f"full cache {k['full']['decode_tokens_per_s']:.1f} t/s; {k['dtype']}, torch {k['torch']}, "
            f"transformers {k['transformers']}, kvpress {k['kvpress']}, {k['device']}")
        if d:
            r = d["tokens_per_second"] / theirs
            goal(f"ours / kvpress {m} ({shape}) decode", f"{r:.2f}x", r >= 3,
                 f"goal >= 3x; ours {d['tokens_per_second']:.1f} t/s SnapKV-{a.budget} @{k['context']}")

    # 6. the compressor's share of prefill at 16K
    for m in a.models.split(","):
        d = by_key(speed.get((m, "snapkv")) and speed[m, "snapkv"]["decode"], "depth", c16)
        if d and "compress_share" in d:
            goal(f"snapkv scoring+compaction {m} @{c16}", f"{100 * d['compress_share']:.2f}%",
                 d["compress_share"] <= 0.05,
                 f"goal <= 5% of prefill; {d['compress_seconds']:.3f} s of {d['prefill_seconds']:.3f} s")

    for r in rows:
        print("\t".join(s.replace("\t", " ") for s in r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
