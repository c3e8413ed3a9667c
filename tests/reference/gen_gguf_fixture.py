#!/usr/bin/env python3
"""Writes tests/fixtures/types.gguf and tests/fixtures/types_expected.bin with gguf-py.

types.gguf: a small GGUF v3 file with one metadata key of every value type (including an
array of arrays) and one small tensor per dtype, from a fixed seed. Tensors gguf-py can
quantize (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are quantized from random floats;
gguf-py cannot quantize K-quants, so Q2_K..Q6_K tensors are random block bytes (with sane
fp16 scales) whose reference values still come from gguf-py's dequantizer.

types_expected.bin (little-endian), read back with gguf-py's GGUFReader:
    "SKVGX001", u32 n_tensors, then per tensor:
    u32 name_len, name, u32 type, u32 n_dims, u64 ne[4] (unused dims 1),
    u64 absolute file offset of the data, u64 n, f32 values[n] (gguf.quants.dequantize)

Usage: python3 tests/reference/gen_gguf_fixture.py [SRCDIR]   (needs: pip install gguf numpy)
The test (tests/unit/test_gguf.c) hard-codes the metadata values below: keep them in sync.
"""
import os
import struct
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

SEED = 20240611

# Offsets of the fp16 scale fields inside one K-quant block (GGML's layouts).
K_FP16_FIELDS = {
    Q.Q2_K: (84, [80, 82]),    # scales[16] qs[64] d dmin
    Q.Q3_K: (110, [108]),      # hmask[32] qs[64] scales[12] d
    Q.Q4_K: (144, [0, 2]),     # d dmin scales[12] qs[128]
    Q.Q5_K: (176, [0, 2]),     # d dmin scales[12] qh[32] qs[128]
    Q.Q6_K: (210, [208]),      # ql[128] qh[64] scales[16] d
}


def write_metadata(w):
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_float32("test.f32", 3.25)
    w.add_bool("test.bool_true", True)
    w.add_bool("test.bool_false", False)
    w.add_string("test.string", "h\u00e9llo, gguf")
    w.add_uint64("test.u64", (1 << 63) + 5)
    w.add_int64("test.i64", -(1 << 62) - 7)
    w.add_float64("test.f64", 0.1)
    w.add_key_value("test.arr_u32", [1, 2, 3, 4000000000], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.UINT32)
    w.add_key_value("test.arr_i16", [-5, 7, 32767], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.INT16)
    w.add_key_value("test.arr_f32", [0.5, -1.5, 1e-3], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.FLOAT32)
    w.add_array("test.arr_str", ["alpha", "", "\u03b3\u03ac\u03bc\u03bc\u03b1", "delta"])
    w.add_array("test.arr_nested", [[1, 2], [3, 4, 5]])        # array of arrays of int32
    w.add_array("test.arr_nested_str", [["a"], ["bb", "ccc"]])  # array of arrays of strings


def tensors(rng):
    """(name, array, raw_dtype or None) in file order."""
    out = []
    out.append(("t.f32", rng.standard_normal((3, 8)).astype(np.float32), None))
    out.append(("t.f32_4d", rng.standard_normal((2, 3, 4, 8)).astype(np.float32), None))
    out.append(("t.f16", rng.standard_normal((2, 16)).astype(np.float16), None))
    for qt in (Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        x = rng.standard_normal((2, 64)).astype(np.float32)
        x[0, :32] *= 4.0  # blocks of different scale
        out.append(("t." + qt.name.lower(), quantize(x, qt), qt))
    for qt, (bsize, fields) in K_FP16_FIELDS.items():
        blocks = rng.integers(0, 256, size=(2, bsize), dtype=np.uint8)  # 2 rows of 256
        for off in fields:
            d = rng.uniform(0.002, 0.05, size=2).astype(np.float16)
            blocks[:, off:off + 2] = d.view(np.uint8).reshape(2, 2)
        out.append(("t." + qt.name.lower(), blocks, qt))
    out.append(("t.i8", np.arange(-4, 4, dtype=np.int8), None))
    out.append(("t.i16", np.array([-300, 0, 300, 32767], dtype=np.int16), None))
    out.append(("t.i32", np.array([-70000, 1, 70000, 5], dtype=np.int32), None))
    out.append(("t.i64", np.array([-(1 << 20), 3], dtype=np.int64), None))
    out.append(("t.f64", np.array([0.25, -2.5, 1e6], dtype=np.float64), None))
    return out


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    fixtures = os.path.join(src, "tests", "fixtures")
    os.makedirs(fixtures, exist_ok=True)
    path = os.path.join(fixtures, "types.gguf.fixture")  # no model inside: not named *.gguf

    rng = np.random.default_rng(SEED)
    w = gguf.GGUFWriter(path, "test")  # writes general.architecture = "test"
    w.data_alignment = 64
    w.add_custom_alignment(64)         # general.alignment (u32)
    write_metadata(w)
    for name, arr, qt in tensors(rng):
        w.add_tensor(name, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    # Read back with gguf-py's reader (an independent path) for the expected values.
    r = gguf.GGUFReader(path)
    blob = bytearray(b"SKVGX001")
    blob += struct.pack("<I", len(r.tensors))
    for t in r.tensors:
        name = t.name.encode()
        ne = [int(d) for d in t.shape] + [1] * (4 - len(t.shape))
        if t.tensor_type in (Q.F32, Q.F16, Q.F64, Q.I8, Q.I16, Q.I32, Q.I64):
            vals = np.asarray(t.data, dtype=np.float64).astype(np.float32).reshape(-1)
        else:
            vals = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        assert vals.size == int(np.prod(ne)), (t.name, vals.size, ne)
        blob += struct.pack("<I", len(name)) + name
        blob += struct.pack("<II", int(t.tensor_type), len(t.shape))
        blob += struct.pack("<4Q", *ne)
        blob += struct.pack("<QQ", int(t.data_offset), vals.size)
        blob += vals.astype("<f4").tobytes()
    with open(os.path.join(fixtures, "types_expected.bin"), "wb") as f:
        f.write(blob)
    print(f"wrote {path} ({os.path.getsize(path)} bytes, {len(r.tensors)} tensors, "
          f"{len(r.fields)} fields) and types_expected.bin ({len(blob)} bytes)")


if __name__ == "__main__":
    main()
