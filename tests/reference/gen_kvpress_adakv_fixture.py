#!/usr/bin/env python3
"""External head-wise reference: which KV entries NVIDIA kvpress's AdaKVPress(SnapKVPress) keeps.

AdaKV (arXiv 2407.11550) makes one top-k over all KV heads of a layer, so heads keep different
counts: snapkvd's `granularity=head`. kvpress implements it as AdaKVPress wrapping a ScorerPress;
here the SnapKVPress of tests/reference/gen_kvpress_fixture.py (window 32, avg pooling kernel 5,
mean over the KV group) with alpha_safeguard = 0, i.e. no per-head minimum (snapkvd's head
granularity has none: every head keeps its window, the rest is one joint top-k).

kvpress runs unmodified from PyPI on SmolLM2-135M-Instruct (GGUF, float32, sdpa attention, which
AdaKVPress requires, one thread) over the same three prompts as the SnapKV fixture and two
compression ratios. AdaKVPress masks the pruned entries instead of removing them; the press
below records the mask kvpress computed (module.masked_key_indices) and the joint scores, and
the kept positions per layer and KV head are the complement. Same venv as the SnapKV fixture:
    /opt/kvpvenv/bin/python tests/reference/gen_kvpress_adakv_fixture.py
"""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

from transformers import DynamicCache  # noqa: E402

from kvpress import AdaKVPress, SnapKVPress  # noqa: E402
from kvpress.utils import compute_n_kept  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_kvpress_fixture as snap  # noqa: E402  (prompts, model, float32 and output helpers)

OUT_DIR = snap.OUT_DIR
RATIOS = (0.75, 0.9)


class RecordingAdaKV(AdaKVPress):
    """AdaKVPress that keeps, per layer, the joint scores and the entries it masked."""

    def __post_init__(self):
        super().__post_init__()
        self.records = {}

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        k_out, v_out = super().compress(module, hidden_states, keys, values, attentions, kwargs)
        assert k_out is keys and v_out is values, "AdaKVPress should mask, not prune"
        batch, head, seq = module.masked_key_indices
        assert torch.all(batch == 0)
        # the scores AdaKVPress ranked (SnapKV's, window padded with max + 1); recomputing them
        # is deterministic (one thread, deterministic algorithms)
        scores = self.press.score(module, hidden_states, keys, values, attentions, kwargs)[0]
        self.records[module.layer_idx] = {"head": head.tolist(), "seq": seq.tolist(),
                                          "scores": scores.detach().clone()}
        return k_out, v_out


def run_prompt(model, ids, ratio):
    cfg = model.config
    n_kv, n_layers = cfg.num_key_value_heads, cfg.num_hidden_layers
    n = len(ids)
    if compute_n_kept(n, ratio) < snap.WINDOW:  # as in gen_kvpress_fixture.py: left out
        print(f"n={n} r={ratio}: n_kept {compute_n_kept(n, ratio)} < window {snap.WINDOW}, "
              "case left out (window ties, see README)", flush=True)
        return None
    press = RecordingAdaKV(press=SnapKVPress(compression_ratio=ratio, window_size=snap.WINDOW,
                                             kernel_size=snap.KERNEL), alpha_safeguard=0.0)
    with torch.no_grad(), press(model):
        model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache(), use_cache=True)
    n_kept = compute_n_kept(n, ratio)
    assert n_kept >= snap.WINDOW
    assert len(press.records) == n_layers, "press did not run on every layer"
    layers = []
    for li in range(n_layers):
        rec = press.records[li]
        masked = [set() for _ in range(n_kv)]
        for h, s in zip(rec["head"], rec["seq"]):
            masked[h].add(s)
        assert sum(len(m) for m in masked) == n_kv * (n - n_kept)
        kept = [[j for j in range(n) if j not in masked[h]] for h in range(n_kv)]
        for h in range(n_kv):
            assert all(j in kept[h] for j in range(n - snap.WINDOW, n)), "a window entry was masked"
        # the joint cut: the lowest kept and the highest dropped score over the layer's heads
        sc = rec["scores"].double().numpy()
        kept_scores = [sc[h, j] for h in range(n_kv) for j in kept[h] if j < n - snap.WINDOW]
        dropped_scores = [sc[h, j] for h in range(n_kv) for j in masked[h]]
        last_kept = min(kept_scores) if kept_scores else None
        first_dropped = max(dropped_scores) if dropped_scores else None
        layers.append({
            "layer": li,
            "heads": [{"kv_head": h, "kept": kept[h]} for h in range(n_kv)],
            "last_kept_score": snap.f32(last_kept) if last_kept is not None else None,
            "first_dropped_score": snap.f32(first_dropped) if first_dropped is not None else None,
            "boundary_tie": bool(last_kept is not None and first_dropped is not None
                                 and last_kept == first_dropped),
        })
    return {"compression_ratio": ratio, "n_kept": n_kept, "layers": layers}


def main():
    args = snap.arg_parser(__doc__, OUT_DIR).parse_args()

    snap.setup_torch()
    model = snap.load_model(args.model, "sdpa")
    os.makedirs(args.out, exist_ok=True)
    sizes = {}
    for name, text_file, _, ids in snap.prompt_ids(args.model, args.golden):
        doc = {"prompt": name, "text_file": text_file, "n_tokens": len(ids), "ids": ids,
               "window_size": snap.WINDOW, "kernel_size": snap.KERNEL, "pooling": "avg",
               "group_reduce": "mean", "alpha_safeguard": 0.0, "cases": []}
        for ratio in RATIOS:
            case = run_prompt(model, ids, ratio)
            if case is None:
                continue
            counts = [[len(h["kept"]) for h in layer["heads"]] for layer in case["layers"]]
            spread = max(max(c) - min(c) for c in counts)
            ties = sum(layer["boundary_tie"] for layer in case["layers"])
            print(f"{name} n={len(ids)} r={ratio} kept/head={case['n_kept']} "
                  f"largest head spread in a layer {spread}, boundary ties {ties}", flush=True)
            doc["cases"].append(case)
        sizes[f"adakv_{name}.json"] = snap.write_compact(os.path.join(args.out, f"adakv_{name}.json"), doc)

    model_info, versions = snap.provenance(args.model, "kvpress")
    meta = {
        "generator": "tests/reference/gen_kvpress_adakv_fixture.py",
        "command": " ".join(["/opt/kvpvenv/bin/python", "tests/reference/gen_kvpress_adakv_fixture.py"]
                            + sys.argv[1:]),
        "press": f"kvpress.AdaKVPress(press=kvpress.SnapKVPress(compression_ratio=r, "
                 f"window_size={snap.WINDOW}, kernel_size={snap.KERNEL}), alpha_safeguard=0.0)",
        "ratios": list(RATIOS),
        "model": model_info,
        "dtype": "float32", "attn_implementation": "sdpa", "torch_threads": 1,
        "versions": versions,
        "files": sizes,
    }
    snap.write_meta(os.path.join(args.out, "meta_adakv.json"), meta)
    print(json.dumps(sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
