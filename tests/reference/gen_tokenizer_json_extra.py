#!/usr/bin/env python3
"""Reference ids of tokenizer.json features beyond gen_tokenizer_fixture.py's, from Hugging Face
`tokenizers` alone, for tests/unit/test_tokenizer.c `test_tiny_nfc`, `test_tiny_split_empty` and
`test_tiny_single_word`.
Each tokenizer is tests/fixtures/tok_tiny/tokenizer.json (made by gen_tokenizer_fixture.py) with:

- "nfc": "normalizer": {"type": "NFC"} (Qwen2 / Qwen2.5's). The strings are those of
  tests/fixtures/tokenizer_tiny_ids.json that NFC changes, and a few more written here: combining
  marks that compose, singletons NFC maps (Angstrom sign, Ohm sign, a CJK compatibility
  ideograph), Hangul jamo, and text NFC leaves alone. Each is encoded with special tokens parsed
  ("ids"), and as plain text ("plain"); add_special_tokens=False both.
- "split_empty": a Split pre-tokenizer whose regex matches the empty string (\d*), under each
  behavior, then ByteLevel, and two tokens ("1a", "2 ") whose merges span where such a match
  would cut: Oniguruma's iterator skips an empty match that ends where the last match ended.
  The strings: SPLIT_STRINGS and the first 80 tiny strings.
- "single_word": the added token "<tool>" with single_word set: it matches only with no word
  character (Rust regex's Unicode \w: Alphabetic, marks, decimal digits, connector punctuation,
  join controls) beside it. The strings: SINGLE_WORD_STRINGS and the
  tiny strings holding "<tool>".

Writes tests/fixtures/tokenizer_json_extra_ids.json. Usage: gen_tokenizer_json_extra.py [--srcdir DIR]
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


SPLIT_STRINGS = ["1a", "12ab3", "a1", "x", "12 34", "a 1 b 22 c", "99 bottles", "x1y2z3", "", " 7"]
BEHAVIORS = ["Isolated", "Removed", "MergedWithPrevious", "MergedWithNext", "Contiguous"]
SINGLE_WORD_STRINGS = ["<tool>", "x<tool>", "<tool>y", " <tool> ", "\u00e9<tool>", "_<tool>", "1<tool>",
                       "-<tool>-", "\u01c5<tool>", "\u0663<tool>", "<tool><tool>", "a<tool><tool>",
                       "<tool><tool>b", "a <tool>b", "call <tool> now", "\u4e2d<tool>\u6587",
                       # Rust regex's \w beyond letters and digits: marks, connector punctuation,
                       # join controls; numbers that are not decimal digits (No) are not in it
                       "<tool>\u00b2", "\u00bd<tool>", "<tool>\u0301", "\u0301<tool>", "\u203f<tool>",
                       "<tool>\u200d", "\u2160<tool>"]


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
    base = json.dumps(tj)
    tj["normalizer"] = {"type": "NFC"}
    tok = Tokenizer.from_str(json.dumps(tj))
    with open(os.path.join(fixtures, "tokenizer_tiny_ids.json"), encoding="utf-8") as f:
        tiny = json.load(f)
    strings = [e["text"] for e in tiny["strings"] if unicodedata.normalize("NFC", e["text"]) != e["text"]]
    strings += EXTRA
    nfc = [{"text": s, "ids": encode(tok, s, True), "plain": encode(tok, s, False)} for s in strings]

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    split_strings = SPLIT_STRINGS + [e["text"] for e in tiny["strings"][:80]]
    split_empty = {}
    # tokens across where an empty match cut the text: "1a" and "2 " only merge when one piece
    add_vocab = {"1a": 1201, "2\u0120": 1202}
    add_merges = [["1", "a"], ["2", "\u0120"]]
    for behavior in BEHAVIORS:
        v = json.loads(base)
        v["model"]["vocab"].update(add_vocab)
        v["model"]["merges"] = add_merges + v["model"]["merges"]
        v["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\d*"}, "behavior": behavior, "invert": False},
            byte_level]}
        t = Tokenizer.from_str(json.dumps(v))
        split_empty[behavior] = {"pre_tokenizer": v["pre_tokenizer"],
                                 "strings": [{"text": s, "ids": encode(t, s, True)} for s in split_strings]}
    v = json.loads(base)
    for a in v["added_tokens"]:
        if a["content"] == "<tool>":
            a["single_word"] = True
    t = Tokenizer.from_str(json.dumps(v))
    sw_strings = SINGLE_WORD_STRINGS + [e["text"] for e in tiny["strings"] if "<tool>" in e["text"]]
    single_word = [{"text": s, "ids": encode(t, s, True)} for s in sw_strings]
    import tokenizers
    out = {"source": "tok_tiny/tokenizer.json, tokenizers %s" % tokenizers.__version__,
           "nfc": nfc, "split_empty": split_empty, "split_empty_vocab": add_vocab,
           "split_empty_merges": add_merges, "single_word": single_word}
    with open(os.path.join(fixtures, "tokenizer_json_extra_ids.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=True, separators=(",", ":"))
    print("%d NFC strings, %d split strings x %d behaviors" % (len(nfc), len(split_strings), len(BEHAVIORS)))


if __name__ == "__main__":
    main()
