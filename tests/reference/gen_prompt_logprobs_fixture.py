#!/usr/bin/env python3
"""Prompt scores from transformers, for PREFILL's and APPEND's prompt_logprobs
(tests/fixtures/golden/prompt_logprobs.json).

For each golden prompt (the token ids of tests/fixtures/golden/reference.json), one forward of the
whole prompt and, at every position i, log_softmax(logits[i])[ids[i + 1]]: the log-probability
the model gives the next prompt token. An "append" case splits one prompt in two: the scores of
the second part's tokens given the first are the same numbers, which is what an APPEND of the
second part to a session of the first must return (its first one from the session's next-token
logits). A "top" case gives one prompt's TOP most likely tokens at every position and their
log-probabilities (prompt_top_logprobs), most likely first.

Deterministic (CPU, float32, eager attention, one thread). Needs torch, transformers, gguf,
accelerate, numpy (tests/reference/README.md has the versions). Usage:
    /opt/refvenv/bin/python tests/reference/gen_prompt_logprobs_fixture.py [--model PATH]
tests/model/test_golden.c (the engine) and tests/integration/test_sessions.c (the daemon) read it.
"""

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GOLDEN = os.path.join(REPO, "tests", "fixtures", "golden")
DEFAULT_MODEL = os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


@torch.no_grad()
def scores(model, ids):
    x = torch.tensor([ids], dtype=torch.long)
    logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    nxt = torch.tensor(ids[1:], dtype=torch.long)
    picked = lp[:-1].gather(1, nxt[:, None])[:, 0]
    best = lp[:-1].argmax(dim=-1)
    return [float(v) for v in picked], int((best == nxt).sum())


TOP = 5


@torch.no_grad()
def top_scores(model, ids):
    x = torch.tensor([ids], dtype=torch.long)
    lp = torch.log_softmax(model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0].float(), dim=-1)
    vals, idx = lp[:-1].topk(TOP, dim=-1)
    return [[int(t) for t in row] for row in idx], [[float(v) for v in row] for row in vals]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.environ.get("SKV_MODEL", DEFAULT_MODEL))
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    model_dir, model_file = os.path.split(os.path.abspath(args.model))
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=model_file, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    with open(os.path.join(GOLDEN, "reference.json")) as f:
        ref = json.load(f)
    prompts = []
    for p in ref["prompts"]:
        lp, top1 = scores(model, p["ids"])
        prompts.append({"name": p["name"], "n_tokens": len(p["ids"]), "logprobs": lp,
                        "sum": sum(lp), "top1_matches": top1})
    # the paragraph prompt as a session of its first 40 tokens and an APPEND of the rest
    para = next(p for p in ref["prompts"] if p["name"] == "paragraph")
    split = 40
    lp, _ = scores(model, para["ids"])
    append = {"prompt": "paragraph", "split": split, "logprobs": lp[split - 1:]}
    tok, tlp = top_scores(model, para["ids"])
    top = {"prompt": "paragraph", "n": TOP, "tokens": tok, "logprobs": tlp}
    meta = {"generator": "tests/reference/gen_prompt_logprobs_fixture.py", "model": model_file,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "ids": "reference.json's prompts", "logprobs": "[i]: log_softmax(logits at i)[ids[i + 1]], natural log",
            "append": "the scores of ids[split:] given ids[:split] (logprobs[split - 1:] of the whole prompt)",
            "top": "at each position i < n_tokens - 1, the n largest of log_softmax(logits at i), largest first: "
                   "tokens[i] their ids, logprobs[i] the values"}
    with open(os.path.join(GOLDEN, "prompt_logprobs.json"), "w") as f:
        json.dump({"meta": meta, "prompts": prompts, "append": append, "top": top}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
