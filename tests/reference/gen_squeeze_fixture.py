#!/usr/bin/env python3
"""External SqueezeAttention reference: per-layer cosine similarities from transformers and
scikit-learn's KMeans(3) clusters of them, on the default model.

SqueezeAttention (arXiv 2404.04793, hetailang/SqueezeAttention) measures, for each decoder
layer during the prefill, the cosine similarity between the layer's input hidden state (the
residual stream before input_layernorm) and the residual stream right after the attention
block (input + self_attn output, before the MLP), per token over the hidden dimension, averaged
over the prompt's tokens. It then clusters the L values with sklearn.cluster.KMeans(n_clusters=3)
and gives the cluster with the highest centre the smaller budget.

This runs Hugging Face transformers (float32, eager attention, one thread) on
SmolLM2-135M-Instruct with hooks that read exactly those two tensors, for the three prompts of
the kvpress fixtures, and stores the 30 similarities (float64) and sklearn's labels (n_init=10,
random_state=0), ranked by centre (0 = lowest similarity ... 2 = highest), plus the global
optimum of the 1-D 3-clustering found by brute force over split points (to show that sklearn's
answer is the optimum). Same venv as the kvpress fixtures, with scikit-learn added:
    /opt/kvpvenv/bin/pip install scikit-learn
    /opt/kvpvenv/bin/python tests/reference/gen_squeeze_fixture.py
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sklearn.cluster import KMeans  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_kvpress_fixture as snap  # noqa: E402  (prompts, model, output helpers)

OUT = os.path.join(snap.REPO, "tests", "fixtures", "squeeze", "similarity.json")


def layer_similarities(model, ids):
    """Mean over tokens of cos(x_in, x_in + attn(x_in)) for every decoder layer, in float64."""
    layers = model.model.layers
    x_in, attn_out = {}, {}
    hooks = []
    for li, layer in enumerate(layers):
        def pre(mod, args, kwargs, li=li):
            hs = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            x_in[li] = hs.detach().double()

        def post(mod, args, kwargs, output, li=li):
            out = output[0] if isinstance(output, tuple) else output
            attn_out[li] = out.detach().double()

        hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(layer.self_attn.register_forward_hook(post, with_kwargs=True))
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    sims = []
    for li in range(len(layers)):
        a = x_in[li][0]
        b = a + attn_out[li][0]
        cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
        sims.append(float(cos.mean()))
    return sims


def ranked(labels, x):
    """Labels renumbered by increasing cluster centre."""
    centres = {c: np.mean([v for v, l in zip(x, labels) if l == c]) for c in set(labels)}
    order = sorted(centres, key=lambda c: centres[c])
    return [order.index(l) for l in labels]


def exact_1d(x):
    """Global minimum of the within-cluster sum of squares over contiguous splits of sorted x."""
    order = sorted(range(len(x)), key=lambda i: (x[i], i))
    v = [x[i] for i in order]

    def sse(a, b):
        seg = v[a:b]
        m = sum(seg) / len(seg)
        return sum((t - m) ** 2 for t in seg)

    best = None
    n = len(v)
    for i in range(1, n - 1):
        for j in range(i + 1, n):
            cost = sse(0, i) + sse(i, j) + sse(j, n)
            if best is None or cost < best[0]:
                best = (cost, i, j)
    labels = [0] * n
    for r, idx in enumerate(order):
        labels[idx] = 0 if r < best[1] else 1 if r < best[2] else 2
    return labels, best[0]


def main():
    args = snap.arg_parser(__doc__, OUT).parse_args()

    snap.setup_torch()
    model = snap.load_model(args.model, "eager")
    prompts = []
    for name, text_file, _, ids in snap.prompt_ids(args.model, args.golden):
        sims = layer_similarities(model, ids)
        km = KMeans(n_clusters=3, n_init=10, random_state=0).fit(np.array(sims)[:, None])
        labels = ranked(km.labels_.tolist(), sims)
        exact, exact_sse = exact_1d(sims)
        assert labels == exact, f"{name}: sklearn's clusters are not the 1-D optimum"
        print(f"{name} n={len(ids)} sims {min(sims):.4f}..{max(sims):.4f} "
              f"clusters {[labels.count(c) for c in range(3)]} inertia {km.inertia_:.6g} "
              f"exact {exact_sse:.6g}", flush=True)
        prompts.append({"prompt": name, "text_file": text_file, "n_tokens": len(ids), "ids": ids,
                        "similarity": sims, "kmeans_labels": labels,
                        "kmeans_inertia": float(km.inertia_), "exact_sse": exact_sse})

    model_info, versions = snap.provenance(args.model, "scikit-learn")
    doc = {
        "generator": "tests/reference/gen_squeeze_fixture.py",
        "command": " ".join(["/opt/kvpvenv/bin/python", "tests/reference/gen_squeeze_fixture.py"]
                            + sys.argv[1:]),
        "what": "per layer: mean over tokens of cos(layer input, input + self_attn output); "
                "kmeans_labels ranked by centre, 2 = highest similarity (least important)",
        "kmeans": "sklearn.cluster.KMeans(n_clusters=3, n_init=10, random_state=0)",
        "model": model_info,
        "dtype": "float32 (similarities accumulated in float64)", "attn_implementation": "eager",
        "versions": versions,
        "prompts": prompts,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    print(args.out, snap.write_compact(args.out, doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
