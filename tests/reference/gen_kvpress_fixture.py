#!/usr/bin/env python3
"""External SnapKV reference: which KV entries NVIDIA kvpress's SnapKVPress keeps on the default model.

Runs kvpress (unmodified, from PyPI) on SmolLM2-135M-Instruct (GGUF, float32, eager attention, one
thread) for three prompts and two compression ratios, and records per layer and per KV head the
original positions the press keeps (plus, for the smallest prompt, the raw pre-top-k scores).
The selection is also recomputed here in float64 from the written description in
tests/reference/README.md ("kvpress" section) as a check that the description is exact.

kvpress 0.5.5 pins transformers<5.3 and does not run on transformers 5.24 (its hook reads
kwargs["past_key_values"], which 5.24 renamed to "cache"), so this runs from its own venv:
    /opt/kvpvenv/bin/python tests/reference/gen_kvpress_fixture.py
(made with: python3.11 -m venv /opt/kvpvenv && /opt/kvpvenv/bin/pip install kvpress==0.5.5 gguf accelerate)
"""

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

from kvpress import SnapKVPress  # noqa: E402
from kvpress.utils import compute_n_kept  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEFAULT_MODEL = os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
GOLDEN = os.path.join(REPO, "tests", "fixtures", "golden")
OUT_DIR = os.path.join(REPO, "tests", "fixtures", "kvpress")

WINDOW = 32
KERNEL = 5
RATIOS = (0.5, 0.9)
SMALL_SOURCE = "/usr/share/common-licenses/BSD"

# name, text file (relative to the repo), whether raw scores are stored
PROMPTS = (
    ("small", "tests/fixtures/kvpress/small_prompt.txt", True),
    ("fidelity", "tests/fixtures/golden/fidelity_prompt.txt", False),
    ("long", "tests/fixtures/golden/long_prompt.txt", False),
)


def sig6(x):
    return float(f"{float(x):.6g}")


def f32(x):
    """A float32 value as the exact double (same convention as the golden fixtures)."""
    return float(np.float32(x))


class RecordingSnapKV(SnapKVPress):
    """SnapKVPress that keeps, per layer, the scores it computed and the keys it got and returned."""

    def __post_init__(self):
        super().__post_init__()
        self.records = {}

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        scores = super().score(module, hidden_states, keys, values, attentions, kwargs)
        cos, sin = kwargs["position_embeddings"]
        self.records[module.layer_idx] = {
            "scores": scores.detach().clone(),
            "keys_in": keys.detach().clone(),
            "used_model_attentions": attentions is not None,
            # what the float64 re-derivation needs: window queries before RoPE, and RoPE tables
            "q_pre": module.q_proj(hidden_states[:, -self.window_size:]).detach().clone(),
            "cos": cos[:, -self.window_size:].detach().clone(),
            "sin": sin[:, -self.window_size:].detach().clone(),
        }
        return scores

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        k_out, v_out = super().compress(module, hidden_states, keys, values, attentions, kwargs)
        self.records[module.layer_idx]["keys_out"] = k_out.detach().clone()
        return k_out, v_out


def rotate_half_np(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def rederive_scores(rec, n_heads, n_kv, head_dim, window, kernel):
    """The README description, in float64 numpy: returns [n_kv][n - window] prefix scores."""
    keys = rec["keys_in"][0].double().numpy()                  # [n_kv][n][hd], post-RoPE
    n = keys.shape[1]
    q = rec["q_pre"][0].double().numpy().reshape(window, n_heads, head_dim).transpose(1, 0, 2)
    cos = rec["cos"][0].double().numpy()[None]                 # [1][w][hd]
    sin = rec["sin"][0].double().numpy()[None]
    q = q * cos + rotate_half_np(q) * sin                      # RoPE at positions n-w .. n-1
    group = n_heads // n_kv
    m = n - window
    out = np.zeros((n_kv, m))
    for h in range(n_heads):
        logits = q[h] @ keys[h // group].T / math.sqrt(head_dim)   # [w][n]
        for i in range(window):
            logits[i, n - window + i + 1:] = -np.inf               # causal inside the window
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)                          # softmax over all n keys
        s = p[:, :m].mean(axis=0)                                  # mean over the w queries
        pad = kernel // 2
        sp = np.concatenate([np.zeros(pad), s, np.zeros(pad)])
        pooled = np.array([sp[j:j + kernel].sum() / kernel for j in range(m)])
        out[h // group] += pooled / group                          # mean over the group
    return out


def select(prefix_scores, n, window, n_kept):
    """Kept positions for one head from prefix scores: the window plus the best n_kept - window."""
    m = n - window
    order = sorted(range(m), key=lambda j: (-prefix_scores[j], j))
    return sorted(order[:n_kept - window] + list(range(m, n)))


def run_prompt(model, name, ids, ratio, want_scores):
    cfg = model.config
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // n_heads
    n = len(ids)
    n_kept = compute_n_kept(n, ratio)
    if n_kept < WINDOW:  # kvpress would drop part of the window, which our specs always keep
        print(f"{name} n={n} r={ratio}: n_kept {n_kept} < window {WINDOW}, case left out "
              "(window ties, see README)", flush=True)
        return None, None
    press = RecordingSnapKV(compression_ratio=ratio, window_size=WINDOW, kernel_size=KERNEL)
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    assert len(press.records) == cfg.num_hidden_layers, "press did not run on every layer"

    layers, raw, worst_diff, desc_mismatch = [], [], 0.0, 0
    for li in range(cfg.num_hidden_layers):
        rec = press.records[li]
        scores = rec["scores"][0]                                # [n_kv][n] incl. window pad
        keys_in, keys_out = rec["keys_in"][0], rec["keys_out"][0]
        # the indices kvpress used: same topk call on the same tensor ...
        idx = scores.topk(n_kept, dim=-1).indices                # [n_kv][n_kept]
        # ... and proven by the keys it actually left in the cache
        assert torch.equal(keys_out, keys_in.gather(1, idx[..., None].expand(-1, -1, head_dim)))
        assert torch.equal(cache.layers[li].keys[0], keys_out)
        pad_value = scores[:, n - WINDOW:]
        assert torch.all(pad_value == pad_value[0, 0])
        ref = rederive_scores(rec, n_heads, n_kv, head_dim, WINDOW, KERNEL)
        heads = []
        for kh in range(n_kv):
            kept = sorted(idx[kh].tolist())
            prefix = scores[kh, :n - WINDOW].double().numpy()
            worst_diff = max(worst_diff, float(np.max(np.abs(prefix - ref[kh]) / np.max(ref[kh]))))
            if select(ref[kh].tolist(), n, WINDOW, n_kept) != kept:
                desc_mismatch += 1
            desc = np.sort(prefix)[::-1]
            nk = n_kept - WINDOW
            heads.append({
                "kv_head": kh,
                "kept": kept,
                "last_kept_score": f32(desc[nk - 1]),
                "first_dropped_score": f32(desc[nk]) if nk < len(desc) else None,
                "boundary_tie": bool(nk < len(desc) and desc[nk - 1] == desc[nk]),
            })
            if want_scores:
                raw.append((li, kh, [sig6(v) for v in prefix]))
        layers.append({"layer": li, "used_model_attentions": rec["used_model_attentions"],
                       "heads": heads})
    case = {"compression_ratio": ratio, "n_kept": n_kept, "layers": layers,
            "check": {"max_rel_score_diff_vs_float64_description": sig6(worst_diff),
                      "heads_where_float64_description_selects_differently": desc_mismatch}}
    return case, raw


def load_prompts(golden_dir=GOLDEN):
    small = os.path.join(REPO, PROMPTS[0][1])
    if not os.path.exists(small):
        os.makedirs(os.path.dirname(small), exist_ok=True)
        shutil.copyfile(SMALL_SOURCE, small)
    ref = json.load(open(os.path.join(golden_dir, "reference.json"), encoding="utf-8"))
    stored = {"fidelity": ref["fidelity"]["ids"],
              "long": next(p for p in ref["prompts"] if p["name"] == "long")["ids"]}
    return stored


def tokenize(model_path, text):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.dirname(model_path),
                                        gguf_file=os.path.basename(model_path))
    return tok(text, add_special_tokens=False)["input_ids"]


def setup_torch():
    """One thread, deterministic kernels, no progress bars: the runs are reproducible."""
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)


def load_model(model_path, attn):
    """The GGUF model through transformers, dequantized to float32."""
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(os.path.abspath(model_path)), gguf_file=os.path.basename(model_path),
        dtype=torch.float32, attn_implementation=attn)
    model.eval()
    return model


def prompt_ids(model_path, golden_dir=GOLDEN):
    """(name, text_file, want_scores, ids) for each prompt; ids checked against the golden ones
    of the same model (golden_dir: tests/fixtures/golden/ for the default model)."""
    stored = load_prompts(golden_dir)
    for name, text_file, want_scores in PROMPTS:
        text = open(os.path.join(REPO, text_file), encoding="utf-8").read()
        ids = tokenize(model_path, text)
        if name in stored:
            assert ids == stored[name], f"{name}: ids differ from golden/reference.json"
        yield name, text_file, want_scores, ids


def write_compact(path, doc):
    """Writes doc as one line of JSON; returns the file's size."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    return os.path.getsize(path)


def write_meta(path, meta):
    """Writes a fixture's provenance (indented, sorted keys)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.write("\n")


def arg_parser(doc, out_default):
    """The generators' common options: --model, --out and --golden (the model's golden fixture
    folder, whose token ids the prompts must match)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--model", default=os.environ.get("SKV_MODEL", DEFAULT_MODEL))
    ap.add_argument("--out", default=out_default)
    ap.add_argument("--golden", default=GOLDEN)
    return ap


def provenance(model_path, *extra_packages):
    """The model file and its sha256, and the versions of what produced a fixture."""
    with open(model_path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    versions = {pkg: __import__("importlib.metadata").metadata.version(pkg) for pkg in extra_packages}
    versions.update({"transformers": transformers.__version__, "torch": torch.__version__,
                     "numpy": np.__version__, "python": platform.python_version()})
    return {"file": os.path.basename(model_path), "sha256": sha}, versions


def main():
    ap = arg_parser(__doc__, OUT_DIR)
    ap.add_argument("--attn", default="eager", choices=("eager", "sdpa"),
                    help="sdpa makes kvpress recompute the window attention itself (cross-check)")
    args = ap.parse_args()

    setup_torch()
    model = load_model(args.model, args.attn)
    os.makedirs(args.out, exist_ok=True)
    sizes = {}
    for name, text_file, want_scores, ids in prompt_ids(args.model, args.golden):
        doc = {"prompt": name, "text_file": text_file, "n_tokens": len(ids), "ids": ids,
               "window_size": WINDOW, "kernel_size": KERNEL, "pooling": "avg",
               "group_reduce": "mean", "cases": []}
        raw = None
        for ratio in RATIOS:
            case, r = run_prompt(model, name, ids, ratio, want_scores and raw is None)
            if case is None:
                continue
            if r:
                raw = r
            doc["cases"].append(case)
            print(f"{name} n={len(ids)} r={ratio} kept={case['n_kept']} {case['check']}",
                  flush=True)
        if raw:
            doc["prefix_scores"] = {
                "what": "kvpress SnapKV scores of positions 0 .. n-window-1 before top-k, "
                        "6 significant digits; same for every ratio",
                "layers": [[s for (li2, kh, s) in raw if li2 == li]
                           for li in range(model.config.num_hidden_layers)]}
        sizes[f"snapkv_{name}.json"] = write_compact(os.path.join(args.out, f"snapkv_{name}.json"), doc)

    model_info, versions = provenance(args.model, "kvpress")
    meta = {
        "generator": "tests/reference/gen_kvpress_fixture.py",
        "command": " ".join(["/opt/kvpvenv/bin/python", "tests/reference/gen_kvpress_fixture.py"]
                            + sys.argv[1:]),
        "press": f"kvpress.SnapKVPress(compression_ratio=r, window_size={WINDOW}, "
                 f"kernel_size={KERNEL})",
        "ratios": list(RATIOS),
        "model": model_info,
        "dtype": "float32", "attn_implementation": args.attn, "torch_threads": 1,
        "small_prompt_source": SMALL_SOURCE,
        "versions": versions,
        "files": sizes,
    }
    write_meta(os.path.join(args.out, "meta.json"), meta)
    print(json.dumps(sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
