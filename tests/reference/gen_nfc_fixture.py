#!/usr/bin/env python3
"""Reference ids of a tokenizer.json whose normalizer is NFC (Qwen2 / Qwen2.5's), from Hugging Face
`tokenizers` alone, for tests/unit/test_tokenizer.c `test_tiny_nfc`.

The tokenizer is tests/fixtures/tok_tiny/tokenizer.json (made by gen_tokenizer_fixture.py) with
"normalizer": {"type": "NFC"}. The strings are those of tests/fixtures/tokenizer_tiny_ids.json
that NFC changes, and a few more written here: combining marks that compose, singletons NFC maps
(Angstrom sign, Ohm sign, a CJK compatibility ideograph), Hangul jamo, and text NFC leaves alone.
Each is encoded with special tokens parsed, and as plain text (add_special_tokens=False both).

Writes tests/fixtures/tokenizer_nfc_ids.json. Usage: gen_nfc_fixture.py [--srcdir DIR]
Needs `tokenizers` (pip install tokenizers). Deterministic.
"""
import argparse
import json
import os
import unicodedata

from tokenizers import Tokenizer

EXTRA = [
    "e\u0301",                        # e + combining acute -> U+00E9
    "Cafe\u0301 cre\u0300me bru\u0302le\u0301e",
    "\u212b and \u2126",              # Angstrom sign, Ohm sign -> A with ring, Greek capital omega
    "\uf900 \uf901",                  # CJK compatibility ideographs -> their unified ones
    "\u1100\u1161\u11a8",             # Hangul jamo -> one syllable
    "A\u030a\u0323 q\u0307\u0323",   # marks reordered and composed
    "already NFC: \u00e9t\u00e9",
    "<|eot_id|>e\u0301<|eot_id|>",    # around a special token
    "\u00e9" * 3 + "e\u0301" * 3,
]


def encode(tok, text, parse_special):
    tok.encode_special_tokens = not parse_special
    ids = tok.encode(text, add_special_tokens=False).ids
    tok.encode_special_tokens = False
    return ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--srcdir", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    a = ap.parse_args()
    fixtures = os.path.join(a.srcdir, "tests", "fixtures")
    with open(os.path.join(fixtures, "tok_tiny", "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    tj["normalizer"] = {"type": "NFC"}
    tok = Tokenizer.from_str(json.dumps(tj))
    with open(os.path.join(fixtures, "tokenizer_tiny_ids.json"), encoding="utf-8") as f:
        tiny = json.load(f)
    strings = [e["text"] for e in tiny["strings"] if unicodedata.normalize("NFC", e["text"]) != e["text"]]
    strings += EXTRA
    entries = [{"text": s, "ids": encode(tok, s, True), "plain": encode(tok, s, False)} for s in strings]
    import tokenizers
    out = {"source": "tok_tiny/tokenizer.json with normalizer NFC, tokenizers %s" % tokenizers.__version__,
           "strings": entries}
    with open(os.path.join(fixtures, "tokenizer_nfc_ids.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=True, indent=0)
    print("%d strings" % len(entries))


if __name__ == "__main__":
    main()
