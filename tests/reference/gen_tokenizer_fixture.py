#!/usr/bin/env python3
"""Reference token ids for tests/unit/test_tokenizer.c, from Hugging Face `tokenizers` /
`transformers`, built from the SAME GGUF the daemon loads.

Writes (all under tests/fixtures/):
  smollm2_tokenizer.json      the default model's tokenizer as a HF tokenizer.json: vocabulary,
                              merges and special tokens exactly as transformers builds them from
                              the GGUF, with the pre-tokenizer of SmolLM2's own tokenizer.json
                              (Digits(individual_digits) then ByteLevel(use_regex)); see NOTE.
  tokenizer_ids.json          for every string of tests/reference/tokenizer_strings.json: ids with
                              special tokens parsed and with them as plain text, whether HF's decode
                              gives the text back, transformers-from-GGUF ids where they differ;
                              chat renderings (transformers apply_chat_template) and their ids.
  tok_tiny/tokenizer.json     a small byte-level BPE (trained here, Llama 3 style: Split regex +
  tok_tiny/tokenizer_config.json  ByteLevel(use_regex=false), ignore_merges, special and
                              non-special added tokens, Llama 3 chat template).
  tokenizer_tiny_ids.json     ids of every string under the tiny vocabulary for each GGUF
                              pre-tokenizer family (llama-bpe, qwen2 with its NFC normalizer, gpt2,
                              smollm, tekken), for
                              tokenizer.json variants ("v:*": Split behaviors, invert, grouped
                              Digits, lstrip/rstrip added token) and Llama 3 chat renderings.

NOTE: transformers (5.x) has no entry for tokenizer.ggml.pre = "smollm" and falls back to plain
GPT-2 ByteLevel splitting, which drops the Digits pre-tokenizer of SmolLM2's tokenizer.json (and of
llama.cpp's "smollm" pre-tokenizer). The model's own behaviour decides, so the reference ids are
computed with the Digits+ByteLevel pipeline; strings where transformers-from-GGUF differs are
recorded under "hf_gguf_ids" for information.

Usage: gen_tokenizer_fixture.py [--model PATH] [--srcdir DIR] | --unicode-table
Needs transformers, tokenizers, gguf (e.g. /opt/refvenv/bin/python). Deterministic.
"""
import argparse
import json
import os
import sys

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

SMOLLM_PRE = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Meta's Llama 3 (3.0) Instruct chat template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

CHATS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}],
     "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "You are a terse assistant. Answer in one word."},
                  {"role": "user", "content": "Capital of Japan?"},
                  {"role": "assistant", "content": "Tokyo."},
                  {"role": "user", "content": "  And of Italy?\n"}],
     "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Write 3 emoji: 😀👍🏽👨‍👩‍👧"},
                  {"role": "assistant", "content": "😀 👍🏽 👨‍👩‍👧 done\n\n"}],
     "add_generation_prompt": False},
    {"messages": [{"role": "system", "content": "Only a system prompt."}],
     "add_generation_prompt": False},
]

TINY_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>"]
TINY_USER_DEFINED = ["<tool>"]


def encode(tok, text, parse_special):
    tok.encode_special_tokens = not parse_special
    ids = tok.encode(text, add_special_tokens=False).ids
    tok.encode_special_tokens = False
    return ids


def smollm2(model_path, strings, fixtures):
    model_dir, model_file = os.path.split(os.path.abspath(model_path))
    tf = AutoTokenizer.from_pretrained(model_dir, gguf_file=model_file)
    tj = json.loads(tf.backend_tokenizer.to_str())
    tj["pre_tokenizer"] = SMOLLM_PRE
    tj_str = json.dumps(tj, ensure_ascii=False, separators=(",", ":"))
    with open(os.path.join(fixtures, "smollm2_tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tj_str)
    ref = Tokenizer.from_str(tj_str)

    entries = []
    n_diff = 0
    for s in strings:
        ids = encode(ref, s, True)
        plain = encode(ref, s, False)
        e = {"text": s, "ids": ids, "ids_plain": plain,
             "roundtrip": ref.decode(plain, skip_special_tokens=False) == s}
        tf_ids = tf.encode(s, add_special_tokens=False)
        if tf_ids != ids:
            e["hf_gguf_ids"] = tf_ids
            n_diff += 1
        entries.append(e)

    chats = []
    for c in CHATS:
        text = tf.apply_chat_template(c["messages"], tokenize=False,
                                      add_generation_prompt=c["add_generation_prompt"])
        chats.append({"messages": c["messages"], "add_generation_prompt": c["add_generation_prompt"],
                      "text": text, "ids": encode(ref, text, True)})

    out = {"model": model_file, "source": "tokenizers %s, pre_tokenizer Digits+ByteLevel; "
           "chat via transformers apply_chat_template" % sys.modules["tokenizers"].__version__,
           "n_vocab": ref.get_vocab_size(with_added_tokens=True),
           "n_strings_hf_gguf_differs": n_diff, "strings": entries, "chats": chats}
    with open(os.path.join(fixtures, "tokenizer_ids.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=True, separators=(",", ":"))
    return len(entries), n_diff


def tiny(strings, fixtures):
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, min_frequency=2, show_progress=False,
                                  special_tokens=TINY_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [s for s in strings if "<|" not in s] * 3
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens(TINY_USER_DEFINED)
    tj = json.loads(tok.to_str())
    tj["model"]["ignore_merges"] = True
    tj["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [0],
                                                 "tokens": ["<|begin_of_text|>"]}}}
    tdir = os.path.join(fixtures, "tok_tiny")
    os.makedirs(tdir, exist_ok=True)
    tj_str = json.dumps(tj, ensure_ascii=False, indent=1)
    with open(os.path.join(tdir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tj_str)
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True,
              "chat_template": LLAMA3_TEMPLATE}
    with open(os.path.join(tdir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)

    # The same vocabulary and merges under each GGUF pre-tokenizer family.
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False}

    def split(pattern):
        return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
                "invert": False}
    variants = {
        "llama-bpe": ({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level]}, True),
        "qwen2": ({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level]}, False),
        "tekken": ({"type": "Sequence", "pretokenizers": [split(TEKKEN_SPLIT), byte_level]}, True),
        "gpt2": (dict(byte_level, use_regex=True), False),
        "smollm": (SMOLLM_PRE, False),
    }
    # tokenizer.json features the GGUF families do not use: each is the tiny tokenizer.json with
    # its pre_tokenizer replaced (and "<tool>" given lstrip/rstrip in one).
    json_variants = {
        "split_removed": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r"\s+"}, "behavior": "Removed", "invert": False},
            byte_level]},
        "split_prev": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
             "invert": False}, byte_level]},
        "split_next": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "[,.!?]"}, "behavior": "MergedWithNext",
             "invert": False}, byte_level]},
        "split_contig": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r"\p{P}"}, "behavior": "Contiguous",
             "invert": False}, byte_level]},
        "split_invert": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r"\p{L}+"}, "behavior": "Isolated",
             "invert": True}, byte_level]},
        "digits_group": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": False}, dict(byte_level, use_regex=True)]},
        "strip_tool": split(LLAMA3_SPLIT),
    }
    refs = {}
    for name, pre in json_variants.items():
        v = json.loads(tj_str)
        v["pre_tokenizer"] = pre if name != "strip_tool" else {
            "type": "Sequence", "pretokenizers": [pre, byte_level]}
        if name == "strip_tool":
            for a in v["added_tokens"]:
                if a["content"] == "<tool>":
                    a["lstrip"] = a["rstrip"] = True
        refs["v:" + name] = Tokenizer.from_str(json.dumps(v))
    for name, (pre, ignore_merges) in variants.items():
        v = json.loads(tj_str)
        v["pre_tokenizer"] = pre
        if name == "qwen2":  # Qwen2's tokenizer.json, and transformers' GGUF Qwen2 converter: NFC
            v["normalizer"] = {"type": "NFC"}
        v["model"]["ignore_merges"] = ignore_merges
        v["post_processor"] = None
        refs[name] = Tokenizer.from_str(json.dumps(v))
    entries = []
    for s in strings:
        e = {"text": s}
        for name, ref in refs.items():
            e[name] = encode(ref, s, True)
        e["llama-bpe_plain"] = encode(refs["llama-bpe"], s, False)
        entries.append(e)

    tf = AutoTokenizer.from_pretrained(tdir)
    chats = []
    for c in CHATS:
        text = tf.apply_chat_template(c["messages"], tokenize=False,
                                      add_generation_prompt=c["add_generation_prompt"])
        chats.append({"messages": c["messages"], "add_generation_prompt": c["add_generation_prompt"],
                      "text": text, "ids": encode(refs["llama-bpe"], text, True)})
    # ids with the post-processor's BOS, as transformers adds it (add_special_tokens=True)
    with_bos = [{"text": s, "ids": tf.encode(s)} for s in strings[:20]]

    out = {"n_vocab": tok.get_vocab_size(with_added_tokens=True), "special": TINY_SPECIAL,
           "json_variants": json_variants,
           "user_defined": TINY_USER_DEFINED, "chat_template": LLAMA3_TEMPLATE,
           "strings": entries, "chats": chats, "with_bos": with_bos}
    with open(os.path.join(fixtures, "tokenizer_tiny_ids.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=True, separators=(",", ":"))
    return len(entries)


# Properties the pre-tokenizer regexes use. PCRE2 10.42 knows Unicode 14; HF `tokenizers` runs
# Oniguruma, which knows a newer Unicode. The characters Oniguruma puts in a property and Unicode
# 14 does not are added to the property by daemon/engine/tokenizer.c (UNICODE_EXTRA).
UNICODE_PROPS = ["L", "N", "M", "Lu", "Ll", "Lt", "Lm", "Lo", "P"]


def unicode_table():
    """Prints tokenizer.c's UNICODE_EXTRA table (needs Python's unicodedata at Unicode 14)."""
    import unicodedata
    if unicodedata.unidata_version != "14.0.0":
        sys.exit("--unicode-table needs Python's unicodedata at Unicode 14.0.0 (PCRE2 10.42's); "
                 "this one is %s" % unicodedata.unidata_version)
    chars = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    text = "".join(chr(c) for c in chars)
    print("/* generated by tests/reference/gen_tokenizer_fixture.py --unicode-table (tokenizers %s) */"
          % sys.modules["tokenizers"].__version__)
    for prop in UNICODE_PROPS:
        iso = pre_tokenizers.Split(Regex(r"\p{%s}" % prop), behavior="isolated")
        rem = pre_tokenizers.Split(Regex(r"\p{%s}" % prop), behavior="removed")
        onig = {ord(t) for t, (a, b) in iso.pre_tokenize_str(text)
                if b - a == 1 and rem.pre_tokenize_str(t) == []}
        extra = sorted(c for c in onig if not unicodedata.category(chr(c)).startswith(prop))
        ranges = []
        for c in extra:
            if ranges and ranges[-1][1] == c - 1:
                ranges[-1][1] = c
            else:
                ranges.append([c, c])
        items = [r"\\x{%x}" % a if a == b else r"\\x{%x}-\\x{%x}" % (a, b) for a, b in ranges]
        lines, cur = [], ""
        for it in items:  # C string pieces, broken between ranges
            if len(cur) + len(it) > 88:
                lines.append(cur)
                cur = ""
            cur += it
        lines.append(cur)
        print('    {"%s",' % prop)
        for k, line in enumerate(lines):
            print('     "%s"%s' % (line, "}," if k == len(lines) - 1 else ""))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("--srcdir", default=os.path.normpath(os.path.join(here, "..", "..")))
    ap.add_argument("--model", default=None)
    ap.add_argument("--unicode-table", action="store_true",
                    help="print tokenizer.c's UNICODE_EXTRA table instead")
    a = ap.parse_args()
    if a.unicode_table:
        unicode_table()
        return
    model = a.model or os.environ.get("SKV_MODEL") or os.path.join(
        a.srcdir, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    fixtures = os.path.join(a.srcdir, "tests", "fixtures")
    with open(os.path.join(a.srcdir, "tests", "reference", "tokenizer_strings.json"),
              encoding="utf-8") as f:
        strings = json.load(f)
    n, n_diff = smollm2(model, strings, fixtures)
    n_tiny = tiny(strings, fixtures)
    print("smollm2: %d strings (%d where transformers-from-GGUF differs); tiny: %d strings"
          % (n, n_diff, n_tiny))


if __name__ == "__main__":
    main()
