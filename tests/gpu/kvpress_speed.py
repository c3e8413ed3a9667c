#!/usr/bin/env python3
"""Decode speed of PyTorch + transformers + NVIDIA kvpress (SnapKVPress) on a random-weight
Llama of a given shape: the baseline tests/gpu/check.sh compares snapkv-bench with.

One prompt of --context random tokens is prefilled (with SnapKVPress keeping --budget tokens
per layer and KV head, and once more with the full cache), then --decode-tokens greedy tokens
are decoded one at a time; decode tokens/s is the figure. Random weights: speed needs only the
shapes (the same as snapkv-bench's run on tests/gpu/random_gguf's model).

Usage: kvpress_speed.py --shape llama3-8b|smollm2-135m|tiny [--context N] [--budget B]
                        [--decode-tokens D] [--device cuda|cpu] [--json OUT]
Exit status 0 with a JSON line on stdout; 3 when torch, transformers or kvpress is missing.
"""
import argparse
import importlib
import json
import sys
import time
import types

SHAPES = {
    # meta-llama/Meta-Llama-3-8B config.json
    "llama3-8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
    # HuggingFaceTB/SmolLM2-135M-Instruct config.json (the project's default model)
    "smollm2-135m": dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    # tests/gpu/random_gguf.c's "tiny" shape, for a CPU dry run
    "tiny": dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=512, vocab_size=2048, rope_theta=10000.0, tie_word_embeddings=False),
}


def stub_unused_imports():
    """kvpress imports datasets, fire and cachetools at package import for presses this script
    does not use (DuoAttention, LUKV, expected-attention statistics). Where they are missing
    (the device image lacks them), empty stand-ins let `import kvpress` succeed; SnapKVPress
    touches none of them."""
    for name in ("datasets", "fire", "cachetools"):
        try:
            importlib.import_module(name)
        except ImportError:
            m = types.ModuleType(name)
            m.load_dataset = lambda *a, **k: (_ for _ in ()).throw(ImportError(name + " is stubbed"))
            m.LRUCache = lambda *a, **k: None
            m.cached = lambda *a, **k: (lambda f: f)
            m.Fire = lambda *a, **k: None
            sys.modules[name] = m
            print(f"kvpress_speed: note: {name} missing, stubbed (unused by SnapKVPress)", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--json", default=None, help="also write the JSON here")
    a = ap.parse_args()
    if a.context < 2 or not 0 < a.budget < a.context or a.decode_tokens < 1:
        ap.error("need 0 < --budget < --context and --decode-tokens >= 1")
    try:
        import torch
        import transformers
        stub_unused_imports()
        import kvpress
        from kvpress import SnapKVPress
    except ImportError as e:
        print(f"kvpress_speed: skipped: {e}", file=sys.stderr)
        return 3
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("kvpress_speed: skipped: torch sees no CUDA device", file=sys.stderr)
        return 3
    dtype = getattr(torch, a.dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
    cfg = LlamaConfig(**SHAPES[a.shape], head_dim=SHAPES[a.shape]["hidden_size"] // SHAPES[a.shape]["num_attention_heads"],
                      max_position_embeddings=max(131072, a.context + a.decode_tokens), rms_norm_eps=1e-5,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    # built in its dtype on the device (an 8B model never exists in f32)
    torch.set_default_dtype(dtype)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.eval()
    t_init = time.perf_counter() - t0
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    g = torch.Generator(device="cpu").manual_seed(42)
    ids = torch.randint(0, cfg.vocab_size, (1, a.context), generator=g).to(dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def run(press):
        cache = DynamicCache()
        with torch.no_grad():
            sync()
            t0 = time.perf_counter()
            if press is not None:
                with press(model):
                    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            else:
                out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            sync()
            t_prefill = time.perf_counter() - t0
            kept = cache.get_seq_length()
            tok = out.logits[:, -1:].argmax(-1)
            pos = a.context
            # one untimed step (kernel selection, allocator), then the timed ones
            out = model(input_ids=tok, past_key_values=cache, use_cache=True,
                        cache_position=torch.tensor([pos], device=dev))
            tok = out.logits[:, -1:].argmax(-1)
            pos += 1
            sync()
            t0 = time.perf_counter()
            for _ in range(a.decode_tokens):
                out = model(input_ids=tok, past_key_values=cache, use_cache=True,
                            cache_position=torch.tensor([pos], device=dev))
                tok = out.logits[:, -1:].argmax(-1)
                pos += 1
            sync()
            t_decode = time.perf_counter() - t0
        del cache, out
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return dict(prefill_s=t_prefill, kept_tokens=kept, decode_s=t_decode,
                    decode_tokens_per_s=a.decode_tokens / t_decode)

    # kvpress keeps int(n * (1 - ratio)) tokens: half a token of slack so that is exactly budget
    ratio = 1.0 - (a.budget + 0.5) / a.context
    press = SnapKVPress(compression_ratio=ratio)
    snap = run(press)
    full = run(None)
    res = dict(
        tool="kvpress_speed.py", shape=a.shape, context=a.context, budget=a.budget, decode_tokens=a.decode_tokens,
        compression_ratio=ratio, window_size=press.window_size, kernel_size=press.kernel_size,
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", dtype=str(dtype).replace("torch.", ""),
        weight_bytes=weight_bytes, init_s=t_init, torch=torch.__version__, transformers=transformers.__version__,
        kvpress=getattr(kvpress, "__version__", None) or importlib.metadata.version("kvpress"),
        snapkv=snap, full=full, command=" ".join(sys.argv))
    line = json.dumps(res)
    print(line)
    if a.json:
        with open(a.json, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
