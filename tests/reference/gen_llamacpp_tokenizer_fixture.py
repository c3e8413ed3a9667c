#!/usr/bin/env python3
"""llama.cpp's token ids for the tokenizer cross-check in tests/unit/test_tokenizer.c.

Runs llama.cpp's own tokenizer (llama_tokenize, vocab-only load) on the SAME GGUF the daemon
loads, over every string of tests/reference/tokenizer_strings.json (the strings of the Hugging Face
fixture), with special tokens parsed and as plain text, and writes
tests/fixtures/tokenizer_llamacpp_ids.json.

llama.cpp is not vendored here. It comes from the PyPI source distribution of llama-cpp-python
(which vendors llama.cpp under vendor/llama.cpp) and is built with CMake; only the shared library
libllama is needed:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/llamacpp
    tar -xzf /tmp/llamacpp/llama_cpp_python-0.3.36.tar.gz -C /tmp/llamacpp
    cmake -S /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp -B /tmp/llamacpp/build \\
          -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build /tmp/llamacpp/build --target llama -j2

This script then compiles a 40-line C driver of its own (below) against llama.h and that
libllama, feeds it the strings and reads the ids back.

Where llama.cpp and the reference (HF tokenizers on the model's tokenizer.json, the ids of
tests/fixtures/tokenizer_ids.json, which our tokenizer reproduces) disagree, the model's own rules
decide; every such string must be listed in DISAGREEMENTS with the reason, and the script fails if
the set of disagreeing strings is not exactly that list.

Usage: gen_llamacpp_tokenizer_fixture.py [--model PATH] [--srcdir DIR]
           [--llama-src DIR] [--llama-lib DIR] [--cc CC]
Needs only the Python standard library and a C compiler. Deterministic.
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

DRIVER_C = r"""
/* Reads strings (u32 little-endian length, then the bytes) from stdin and prints llama.cpp's
 * token ids of each: one line with special tokens parsed, one with them as plain text. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "llama.h"

static void quiet(enum ggml_log_level level, const char *text, void *user)
{
    (void)level, (void)text, (void)user;
}

int main(int argc, char **argv)
{
    if (argc != 2)
        return 2;
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model)
        return 1;
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    uint32_t len;
    while (fread(&len, 4, 1, stdin) == 1) {
        char *text = malloc(len + 1);
        if (!text || (len && fread(text, 1, len, stdin) != len))
            return 1;
        int cap = (int)len + 8;
        llama_token *ids = malloc((size_t)cap * sizeof *ids);
        for (int special = 1; special >= 0; special--) {
            int n = llama_tokenize(vocab, text, (int32_t)len, ids, cap, false, special);
            if (n < 0)
                return 1;
            for (int i = 0; i < n; i++)
                printf(i ? " %d" : "%d", ids[i]);
            printf("\n");
        }
        free(ids);
        free(text);
    }
    llama_model_free(model);
    return 0;
}
"""

# Strings where llama.cpp's ids differ from the reference, and why the reference is right.
DISAGREEMENTS = {
    "!\u0004!": (
        "BPE over a character with no vocabulary entry (no unk token, no byte fallback). Both "
        "pre-tokenize the string into ONE piece: the model's ByteLevel/GPT-2 rule "
        "' ?[^\\s\\p{L}\\p{N}]+' takes U+0004 (a control character: not space, letter or number) "
        "with the two '!' (llama.cpp's 'smollm' splitter agrees). The byte 0x04 maps to 'Ą', which "
        "the 49152-token vocabulary lacks. HF tokenizers' BPE model (the model's tokenizer.json: "
        "BPE, unk_token null, byte_fallback false) leaves such a character out of the word before "
        "merging, so the two '!' become neighbours and merge into '!!' (10095). llama.cpp merges "
        "with the unknown symbol still in place (it blocks the '!'+'!' merge) and drops it only "
        "when mapping symbols to ids, giving '!' '!' (17 17). The tokenizer.json semantics are "
        "HF tokenizers' (the format's reference implementation), so [10095] is the model's "
        "tokenization; ours gives [10095]."),
}


def run_llamacpp(args, model, strings):
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "driver.c")
        exe = os.path.join(tmp, "driver")
        with open(src, "w") as f:
            f.write(DRIVER_C)
        subprocess.run([args.cc, "-O1", "-o", exe, src,
                        "-I" + os.path.join(args.llama_src, "include"),
                        "-I" + os.path.join(args.llama_src, "ggml", "include"),
                        "-L" + args.llama_lib, "-lllama", "-Wl,-rpath," + args.llama_lib],
                       check=True)
        data = b"".join(struct.pack("<I", len(b)) + b for b in (s.encode("utf-8") for s in strings))
        r = subprocess.run([exe, model], input=data, capture_output=True, check=True)
    lines = r.stdout.decode("ascii").split("\n")
    if len(lines) != 2 * len(strings) + 1:
        sys.exit("driver printed %d lines for %d strings" % (len(lines), len(strings)))
    return [([int(x) for x in lines[2 * i].split()], [int(x) for x in lines[2 * i + 1].split()])
            for i in range(len(strings))]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("--srcdir", default=os.path.normpath(os.path.join(here, "..", "..")))
    ap.add_argument("--model", default=None)
    ap.add_argument("--llama-src",
                    default="/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp",
                    help="llama.cpp source tree (for llama.h)")
    ap.add_argument("--llama-lib", default="/tmp/llamacpp/build/bin",
                    help="folder holding libllama.so")
    ap.add_argument("--cc", default="cc")
    a = ap.parse_args()
    model = a.model or os.environ.get("SKV_MODEL") or os.path.join(
        a.srcdir, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    with open(os.path.join(a.srcdir, "tests", "reference", "tokenizer_strings.json"),
              encoding="utf-8") as f:
        strings = json.load(f)
    with open(os.path.join(a.srcdir, "tests", "fixtures", "tokenizer_ids.json"),
              encoding="utf-8") as f:
        ref = json.load(f)["strings"]
    if [e["text"] for e in ref] != strings:
        sys.exit("tests/fixtures/tokenizer_ids.json is not of tokenizer_strings.json: regenerate it")

    got = run_llamacpp(a, model, strings)
    entries, disagree = [], []
    for i, (s, (ids, plain), r) in enumerate(zip(strings, got, ref)):
        entries.append({"ids": ids, "ids_plain": plain})
        if ids != r["ids"] or plain != r["ids_plain"]:
            if s not in DISAGREEMENTS:
                sys.exit("string %d %r: llama.cpp %s / %s, reference %s / %s: undocumented "
                         "disagreement" % (i, s, ids, plain, r["ids"], r["ids_plain"]))
            disagree.append({"index": i, "text": s, "llama_cpp": ids, "llama_cpp_plain": plain,
                             "reference": r["ids"], "reference_plain": r["ids_plain"],
                             "reason": DISAGREEMENTS[s]})
    missing = set(DISAGREEMENTS) - {d["text"] for d in disagree}
    if missing:
        sys.exit("documented disagreements that no longer occur: %r" % sorted(missing))

    version = "?"
    pkg = os.path.join(a.llama_src, "..", "..", "llama_cpp", "__init__.py")
    if os.path.exists(pkg):
        for line in open(pkg):
            if line.startswith("__version__"):
                version = line.split("=")[1].strip().strip('"')
    out = {"model": os.path.basename(model),
           "source": "llama.cpp vendored in llama-cpp-python %s (PyPI sdist), llama_tokenize("
                     "add_special=false, parse_special=true/false), vocab_only load" % version,
           "n_strings": len(strings), "strings": entries, "disagreements": disagree}
    path = os.path.join(a.srcdir, "tests", "fixtures", "tokenizer_llamacpp_ids.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=True, separators=(",", ":"))
    print("%d strings, %d disagreement(s) with the reference: %s"
          % (len(strings), len(disagree), [d["index"] for d in disagree]))


if __name__ == "__main__":
    main()
