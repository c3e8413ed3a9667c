#!/usr/bin/env python3
"""Writes tests/fixtures/q8_0_kv.bin: f32 KV-like rows and gguf-py's Q8_0 quantization of them,
the bytes a pool of `kv-type q8_0` must store (tests/backend/test_ops.c test_kv_q8_0 checks every
backend's store_rows_q8_0 and skv_quantize_row_q8_0 against them).

Re-runnable and deterministic (fixed seed). Needs `pip install gguf numpy` (gguf 0.19.0 made the
committed file). Usage: python3 tests/reference/gen_q8_kv_fixture.py [SRCDIR]

Format (little endian): magic b"SKVQ8001", u32 rows, u32 row length d (a multiple of 32), then
rows * d f32 values, then rows * (d / 32 * 34) bytes: each row's Q8_0 blocks (f16 d, 32 int8).
"""
import os
import struct
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

D = 64


def recip_blocks(rng):
    """Two blocks of 32 in which gguf-py's q = roundf(x * (1 / d)) differs from roundf(x / d) for
    some value: a quantizer that divides gets them wrong."""
    out = []
    while len(out) < 2:
        b = (rng.standard_normal(32) * rng.uniform(0.1, 10.0)).astype(np.float32)
        d = np.float32(np.abs(b).max() / np.float32(127))
        by_recip = np.trunc(np.abs(b * (np.float32(1) / d)) + np.float32(0.5))
        by_div = np.trunc(np.abs(b / d) + np.float32(0.5))
        if (by_recip != by_div).any():
            out.append(b)
    return np.concatenate(out)


def main():
    srcdir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    rng = np.random.default_rng(20261205)
    rows = []
    for scale in (1.0, 0.05, 3.0, 20.0):              # K and V rows of different magnitudes
        rows.extend(rng.standard_normal((6, D)) * scale)
    for _ in range(4):                               # a few outlier channels, as keys have
        r = rng.standard_normal(D)
        r[rng.integers(0, D, 3)] *= 40.0
        rows.append(r)
    rows.append(np.zeros(D))                         # all zero: d = 0, every q 0
    r = np.zeros(D)
    r[:32] = rng.standard_normal(32) * 1e-6          # d (about 2e-8) underflows to an f16 0, q not 0
    rows.append(r)
    r = np.zeros(D)                                  # amax 127: d = 1, id = 1, so x.5 is a tie:
    r[:8] = [127.0, -127.0, 2.5, -2.5, 0.5, -0.5, 126.5, -126.5]   # roundf rounds it away from zero
    r[32:40] = [63.5, -63.5, 1.5, -1.5, 100.25, 3.75, -0.25, 1e-3]
    r[40] = 127.0
    rows.append(r)
    rows.append(rng.standard_normal(D) * 5000.0)    # large, still a finite f16 d
    r = np.zeros(D)                                  # row 32: d about 2e-6, a subnormal f16
    r[:32] = rng.standard_normal(32) * 1e-4
    r[32:] = rng.standard_normal(32) * 3e-3
    rows.append(r)
    rows.append(recip_blocks(rng))                   # row 33: x * (1 / d) and x / d round apart
    r = rng.standard_normal(D) * 1e5                 # row 34: d in (65504, 65520): an f16 of 65504,
    r[0], r[1] = 8320024.0, 98262.0                  # q from the f32 d (98262 -> 1, not 2)
    rows.append(r)
    x = np.asarray(rows, dtype=np.float32)
    q = quants.quantize(x, T.Q8_0)
    assert q.shape == (len(rows), D // 32 * 34), q.shape
    path = os.path.join(srcdir, "tests", "fixtures", "q8_0_kv.bin")
    with open(path, "wb") as f:
        f.write(b"SKVQ8001" + struct.pack("<II", len(rows), D))
        f.write(x.astype("<f4").tobytes())
        f.write(q.tobytes())
    print(f"{path}: {len(rows)} rows of {D}")


if __name__ == "__main__":
    main()
