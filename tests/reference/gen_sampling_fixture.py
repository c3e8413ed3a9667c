#!/usr/bin/env python3
"""What transformers' logits processors make of next-token logits, for the sampler's logit bias,
repetition penalty and min-p (tests/fixtures/sampling/).

1. processors.json + processors.f32: random logits (a 256-token vocabulary) through
   SequenceBiasLogitsProcessor (single-token biases), RepetitionPenaltyLogitsProcessor,
   TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper, in the
   order generate() applies them. Per case the f32 file holds three [256] rows: the logits, the
   logits after the bias and the penalty, and the final probabilities (softmax of the warped
   scores; 0 for tokens the warpers removed, "kept" lists the others). A repetition_last_n case gives the processor only
   the history's last n ids (the processor has no such option; that is what it means).
   tests/unit/test_sampler.c compares skv_sampler_adjust and skv_sampler_candidates with them.
2. greedy.json: transformers' generate(do_sample=False) on the default model (SmolLM2-135M
   Q4_1) with repetition_penalty and sequence_bias, its tokens and each step's margin (top-1 minus
   top-2 of the processed scores), and the plain greedy tokens without them.
   tests/integration/test_sessions.c decodes the same through the daemon.

Deterministic (fixed seed; CPU, float32, eager attention, one thread). Needs torch, transformers,
gguf, accelerate, numpy (tests/reference/README.md has the versions). Usage:
    /opt/refvenv/bin/python tests/reference/gen_sampling_fixture.py [--model PATH]
"""

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.generation.logits_process import (  # noqa: E402
    MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.join(REPO, "tests", "fixtures", "sampling")
DEFAULT_MODEL = os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
VOCAB = 256

# temperature > 0 in every case: the warpers only run when sampling
CASES = [
    {"name": "bias", "temperature": 0.8, "bias": {3: 7.5, 17: -100.0, 40: 2.25, 41: -3.5, 255: 0.5}},
    {"name": "repetition", "temperature": 1.0, "top_p": 0.9, "repetition_penalty": 1.3,
     "history": [5, 9, 9, 100, 7, 5, 200, 31, 77, 64]},
    {"name": "boost_last_n", "temperature": 0.7, "top_k": 40, "repetition_penalty": 0.7,
     "repetition_last_n": 5, "history": [1, 2, 3, 4, 5, 6, 7, 8, 2, 60, 61]},
    {"name": "min_p", "temperature": 1.3, "min_p": 0.1},
    {"name": "min_p_after_top_p", "temperature": 2.5, "top_p": 0.8, "min_p": 0.3},
    {"name": "everything", "temperature": 0.9, "top_k": 50, "top_p": 0.95, "min_p": 0.05,
     "repetition_penalty": 1.2, "history": [10, 11, 12, 13, 14, 15, 10, 11, 250, 251],
     "bias": {12: 1.5, 99: 4.0, 250: -2.0}},
]


def processors_fixture():
    rng = np.random.default_rng(20261205)
    rows, cases = [], []
    for c in CASES:
        logits = (rng.standard_normal(VOCAB) * 3.0).astype(np.float32)
        scores = torch.from_numpy(logits.copy())[None, :]
        hist = c.get("history", [])
        last_n = c.get("repetition_last_n", 0)
        seen = hist[-last_n:] if last_n else hist
        ids = torch.tensor([seen if seen else [0]], dtype=torch.long)
        if c.get("bias"):
            bias = {(int(t),): float(b) for t, b in c["bias"].items()}
            scores = SequenceBiasLogitsProcessor(sequence_bias=bias)(ids, scores)
        if c.get("repetition_penalty", 1.0) != 1.0 and seen:
            scores = RepetitionPenaltyLogitsProcessor(c["repetition_penalty"])(ids, scores)
        adjusted = scores[0].numpy().astype(np.float32).copy()
        scores = TemperatureLogitsWarper(c["temperature"])(ids, scores)
        if c.get("top_k"):
            scores = TopKLogitsWarper(c["top_k"])(ids, scores)
        if c.get("top_p"):
            scores = TopPLogitsWarper(c["top_p"])(ids, scores)
        if c.get("min_p"):
            scores = MinPLogitsWarper(c["min_p"])(ids, scores)
        probs = torch.softmax(scores, dim=-1)[0].numpy().astype(np.float32)
        rows += [logits, adjusted, probs]
        entry = {k: v for k, v in c.items() if k != "bias"}
        if c.get("bias"):
            entry["bias_tokens"] = sorted(int(t) for t in c["bias"])
            entry["bias_values"] = [float(c["bias"][t]) for t in sorted(c["bias"])]
        kept = torch.isfinite(scores[0]).numpy()
        entry["n_kept"] = int(kept.sum())
        entry["kept"] = [int(t) for t in np.nonzero(kept)[0]]  # those the warpers left (-inf: removed)
        cases.append(entry)
    np.stack(rows).astype("<f4").tofile(os.path.join(OUT, "processors.f32"))
    with open(os.path.join(OUT, "processors.json"), "w") as f:
        json.dump({"vocab": VOCAB, "rows_per_case": ["logits", "adjusted", "probs"], "cases": cases}, f,
                  indent=1)
        f.write("\n")


@torch.no_grad()
def generate(model, ids, n_new, **kw):
    x = torch.tensor([ids], dtype=torch.long)
    g = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, num_beams=1,
                       max_new_tokens=n_new, output_scores=True, return_dict_in_generate=True, **kw)
    out = g.sequences[0, len(ids):].tolist()
    margins = []
    for s in g.scores:
        t = torch.topk(s[0].float(), 2)
        margins.append(float(t.values[0] - t.values[1]))
    return out, margins


def greedy_fixture(model_path):
    model_dir, model_file = os.path.split(os.path.abspath(model_path))
    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=model_file)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=model_file, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    n_new = 40
    short = tok("The quick brown fox jumps over the lazy dog.")["input_ids"]
    chat = tok.apply_chat_template([{"role": "user", "content": "List five colours, one per line."}],
                                   add_generation_prompt=True, tokenize=False)
    chat_ids = tok(chat)["input_ids"]
    plain_short, _ = generate(model, short, n_new, repetition_penalty=1.0)
    plain_chat, _ = generate(model, chat_ids, n_new, repetition_penalty=1.0)
    # ban the plain answer's first token, favour another
    bias = {plain_chat[0]: -100.0, plain_chat[2]: 3.0}
    cases = []
    for name, ids, plain, kw in (
            ("short_repetition", short, plain_short, {"repetition_penalty": 1.3}),
            ("chat_repetition_bias", chat_ids, plain_chat,
             {"repetition_penalty": 1.15, "sequence_bias": {(t,): b for t, b in bias.items()}})):
        out, margins = generate(model, ids, n_new, **kw)
        entry = {"name": name, "ids": ids, "plain": plain, "tokens": out, "margins": margins,
                 "repetition_penalty": kw["repetition_penalty"]}
        if "sequence_bias" in kw:
            entry["bias_tokens"] = [int(t) for t in bias]
            entry["bias_values"] = [float(b) for b in bias.values()]
        entry["text"] = tok.decode(out)
        cases.append(entry)
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "model": model_file,
            "eos_stops": "generate() stops at the model's EOS, so a list may be shorter than max_new_tokens"}
    with open(os.path.join(OUT, "greedy.json"), "w") as f:
        json.dump({"meta": meta, "max_new_tokens": n_new, "cases": cases}, f, indent=1)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.environ.get("SKV_MODEL", DEFAULT_MODEL))
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.makedirs(OUT, exist_ok=True)
    processors_fixture()
    greedy_fixture(args.model)


if __name__ == "__main__":
    main()
