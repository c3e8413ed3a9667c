#!/usr/bin/env python3
"""Writes tests/fixtures/dequant.bin: random blocks of every GGML type the CPU backend
dequantizes, with gguf-py's dequantization of them as the expected floats.

Re-runnable and deterministic (fixed seed). Needs `pip install gguf numpy`.
Usage: python3 tests/reference/gen_dequant_fixtures.py [SRCDIR]

Format (little endian): magic b"SKVDQ001", u32 record count; each record: u32 ggml type,
u32 element count, u32 byte count, the raw bytes, then the expected f32 values.
Q8_K has no dequantizer in gguf-py; its expected values are d * q computed here.
"""
import os
import struct
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

# fp16 scale fields (byte offsets inside one block) that must hold sane finite values
FP16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
BLOCKS = 8      # blocks per 32-element type
K_BLOCKS = 4    # super-blocks per K-quant
FLOATS = 256    # elements per plain float type


def random_blocks(rng, qtype, nblocks):
    bsize, tsize = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(nblocks, tsize), dtype=np.uint8)
    for off in FP16_FIELDS.get(qtype, []):
        mag = rng.uniform(1e-3, 0.5, size=nblocks) * rng.choice([-1.0, 1.0], size=nblocks)
        raw[:, off:off + 2] = mag.astype(np.float16).view(np.uint8).reshape(nblocks, 2)
    if qtype == T.Q8_K:
        raw[:, 0:4] = rng.uniform(1e-3, 0.05, size=nblocks).astype(np.float32) \
            .view(np.uint8).reshape(nblocks, 4)
    return raw.reshape(-1), nblocks * bsize


def main():
    srcdir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    rng = np.random.default_rng(20240531)
    records = []

    x = rng.standard_normal(FLOATS).astype(np.float32)
    records.append((T.F32, x.view(np.uint8), x))
    h = rng.standard_normal(FLOATS).astype(np.float16)
    records.append((T.F16, h.view(np.uint8), quants.dequantize(h.view(np.uint8), T.F16)))
    b = (rng.standard_normal(FLOATS).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    records.append((T.BF16, b.view(np.uint8), quants.dequantize(b.view(np.uint8), T.BF16)))

    for qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        raw, n = random_blocks(rng, qtype, BLOCKS)
        records.append((qtype, raw, quants.dequantize(raw, qtype)))
    for qtype in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):
        raw, n = random_blocks(rng, qtype, K_BLOCKS)
        records.append((qtype, raw, quants.dequantize(raw, qtype)))
    raw, n = random_blocks(rng, T.Q8_K, K_BLOCKS)
    blk = raw.reshape(K_BLOCKS, -1)
    d = blk[:, 0:4].copy().view(np.float32)
    q = blk[:, 4:4 + 256].copy().view(np.int8).astype(np.float32)
    records.append((T.Q8_K, raw, (d * q).reshape(-1)))

    out = bytearray(b"SKVDQ001")
    out += struct.pack("<I", len(records))
    for qtype, raw, expect in records:
        expect = np.asarray(expect, dtype=np.float32).reshape(-1)
        assert np.all(np.isfinite(expect)), qtype
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        out += struct.pack("<III", int(qtype), expect.size, raw.size)
        out += raw.tobytes()
        out += expect.astype("<f4").tobytes()
    path = os.path.normpath(os.path.join(srcdir, "tests", "fixtures", "dequant.bin"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(out)
    print(f"wrote {path}: {len(records)} records, {len(out)} bytes")


if __name__ == "__main__":
    main()
