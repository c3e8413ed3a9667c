#!/usr/bin/env python3
"""Golden references for the engine tests, computed with Hugging Face transformers.

Writes the default model's logits, top-10s and greedy text (tests/fixtures/golden/) and the
tiny random-weight HF checkpoints with their logits (tests/fixtures/tiny-*/). Everything runs
on the CPU in float32 with eager attention on one thread, so a re-run reproduces the files
byte for byte with the versions recorded in golden/meta.json. See tests/reference/README.md.

Run from anywhere:
    /opt/refvenv/bin/python tests/reference/gen_model_reference.py
"""

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import transformers  # noqa: E402
from transformers import (AutoModelForCausalLM, AutoTokenizer,  # noqa: E402
                          LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM)

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEFAULT_MODEL = os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
FIXTURES = os.path.join(REPO, "tests", "fixtures")
GOLDEN = os.path.join(FIXTURES, "golden")

LONG_SOURCE = "/usr/share/common-licenses/GPL-3"
FIDELITY_SOURCE = "/usr/share/common-licenses/Apache-2.0"
LONG_MIN_TOKENS = 1536
FIDELITY_MIN_TOKENS = 1000
TOPK = 10
TOPK_STRIDE = 64
GREEDY_TOKENS = 64
TINY_SEQ = 40
TINY_GREEDY = 16
LLAMA3_SEQ = 200

SHORT_PROMPT = "The quick brown fox jumps over the lazy dog."
PARAGRAPH_PROMPT = (
    "The lighthouse keeper climbed the spiral stairs every evening just before sunset. "
    "He checked the oil in the lamp, wiped the salt from the thick glass lenses, and wound "
    "the clockwork that turned the great light. From the gallery at the top he could see "
    "the fishing boats returning to the harbour, their sails catching the last orange glow "
    "of the day. Some nights the fog rolled in so thickly that he could not see the rocks "
    "below, and on those nights he sounded the horn every thirty seconds until dawn, "
    "counting the hours by the cups of tea he drank."
)
CODE_PROMPT = (
    "def fibonacci(n):\n"
    "    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    "    a, b = 0, 1\n"
    "    for _ in range(n):\n"
    "        a, b = b, a + b\n"
    "    return a\n"
    "\n"
    "\n"
    "def is_prime(n):\n"
    "    if n < 2:\n"
    "        return False\n"
    "    for d in range(2, int(n ** 0.5) + 1):\n"
    "        if n % d == 0:\n"
    "            return False\n"
    "    return True\n"
    "\n"
    "\n"
    "def main():\n"
)
CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France, and why is it famous?"}]


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def write_f32(path, array):
    np.ascontiguousarray(np.asarray(array, dtype="<f4")).tofile(path)


def floats(t):
    """float32 tensor -> list of Python floats (exact: a float32 is exactly a double)."""
    return [float(x) for x in t.reshape(-1).tolist()]


def versions():
    import safetensors
    import tokenizers
    from importlib.metadata import version
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gguf": version("gguf"),
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
        "accelerate": version("accelerate"),
    }


def prompt_text_file(path, source, tok, min_tokens, refresh):
    """The committed prompt text; made once from a license file (whole paragraphs until the
    text reaches min_tokens), and kept as committed afterwards so re-runs do not depend on
    the host's copy of the license."""
    if os.path.exists(path) and not refresh:
        with open(path, encoding="utf-8") as f:
            return f.read()
    with open(source, encoding="utf-8") as f:
        paragraphs = f.read().split("\n\n")
    text = ""
    for p in paragraphs:
        text += p.rstrip() + "\n\n"
        if len(tok(text.rstrip() + "\n").input_ids) >= min_tokens:
            break
    text = text.rstrip() + "\n"
    if len(tok(text).input_ids) < min_tokens:
        raise SystemExit(f"{source}: not enough text for {min_tokens} tokens")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text


@torch.no_grad()
def full_logits(model, ids):
    """Logits [n][vocab] of one forward over the whole sequence, no cache."""
    x = torch.tensor([ids], dtype=torch.long)
    return model(input_ids=x, use_cache=False).logits[0].float()


@torch.no_grad()
def greedy(model, ids, n_new):
    """Plain argmax decoding without a cache or any stop token: each step re-runs the whole
    sequence, so every token is the argmax of the same computation as full_logits(). Records
    top1 - top2 per step so a test can tell near-ties from real disagreements."""
    seq = list(ids)
    out, margins = [], []
    for _ in range(n_new):
        last = full_logits(model, seq)[-1]
        top2 = torch.topk(last, 2)
        nxt = int(top2.indices[0])
        out.append(nxt)
        margins.append(float(top2.values[0] - top2.values[1]))
        seq.append(nxt)
    return out, margins


@torch.no_grad()
def hf_generate_agrees(model, ids, expected):
    """Cross-check against transformers' own greedy generate() (KV cache, may stop at EOS):
    its tokens must be a prefix of ours."""
    x = torch.tensor([ids], dtype=torch.long)
    gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                         max_new_tokens=len(expected), num_beams=1, repetition_penalty=1.0)
    got = gen[0, len(ids):].tolist()
    return got == expected[:len(got)], len(got)


def topk_at(logits, positions):
    rows = []
    for p in positions:
        t = torch.topk(logits[p], TOPK)
        rows.append({"pos": p, "ids": [int(i) for i in t.indices], "values": floats(t.values)})
    return rows


def golden(args):
    out_dir = os.path.abspath(args.golden_dir)
    os.makedirs(out_dir, exist_ok=True)
    if out_dir != GOLDEN:
        # another model: the same prompt texts as the default model's, copied, not re-cut
        for name in ("long_prompt.txt", "fidelity_prompt.txt"):
            shutil.copyfile(os.path.join(GOLDEN, name), os.path.join(out_dir, name))
    logits_for = set(args.last_logits.split(",")) if args.last_logits else None
    model_dir, model_file = os.path.split(os.path.abspath(args.model))
    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=model_file)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=model_file,
                                                 dtype=torch.float32, attn_implementation="eager")
    model.eval()

    long_text = prompt_text_file(os.path.join(out_dir, "long_prompt.txt"), LONG_SOURCE, tok,
                                 LONG_MIN_TOKENS, args.refresh_texts)
    fid_text = prompt_text_file(os.path.join(out_dir, "fidelity_prompt.txt"), FIDELITY_SOURCE, tok,
                                FIDELITY_MIN_TOKENS, args.refresh_texts)

    chat_text = tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)
    prompts = [
        {"name": "short", "text": SHORT_PROMPT, "greedy": True},
        {"name": "paragraph", "text": PARAGRAPH_PROMPT, "greedy": False},
        {"name": "code", "text": CODE_PROMPT, "greedy": True},
        {"name": "chat", "text": chat_text, "messages": CHAT_MESSAGES, "greedy": True},
        {"name": "long", "text_file": "long_prompt.txt", "text": long_text, "greedy": False},
    ]

    out_prompts = []
    for p in prompts:
        if p["name"] == "chat":
            # the template already holds the special tokens: do not add any more
            ids = tok(p["text"], add_special_tokens=False).input_ids
            templ = tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True,
                                            tokenize=True)
            templ = templ["input_ids"] if hasattr(templ, "keys") else templ
            assert list(templ) == ids, "chat template ids differ from tokenizing its text"
        else:
            ids = tok(p["text"]).input_ids
        logits = full_logits(model, ids)
        n = len(ids)
        positions = list(range(0, n, TOPK_STRIDE))
        if positions[-1] != n - 1:
            positions.append(n - 1)
        entry = {"name": p["name"], "ids": ids, "n_tokens": n}
        if logits_for is None or p["name"] in logits_for:
            logits_file = f"logits_{p['name']}_last.f32"
            write_f32(os.path.join(out_dir, logits_file), logits[-1])
            entry["last_logits_file"] = logits_file
        entry["topk"] = topk_at(logits, positions)
        if "text_file" in p:
            entry["text_file"] = p["text_file"]
        else:
            entry["text"] = p["text"]
        if "messages" in p:
            entry["messages"] = p["messages"]
            entry["add_generation_prompt"] = True
        if p["greedy"]:
            gen, margins = greedy(model, ids, GREEDY_TOKENS)
            agrees, hf_len = hf_generate_agrees(model, ids, gen)
            entry["greedy"] = {
                "n_new": GREEDY_TOKENS,
                "ids": gen,
                "text": tok.decode(gen, skip_special_tokens=False),
                "margins": margins,
                "hf_generate_prefix_agrees": agrees,
                "hf_generate_len": hf_len,
            }
        out_prompts.append(entry)
        print(f"golden: {p['name']}: {n} tokens", file=sys.stderr)

    fid_ids = tok(fid_text).input_ids
    ref = {
        "model_file": os.path.basename(args.model),
        "vocab_size": int(model.config.vocab_size),
        "logits_format": "little-endian float32, vocab_size values, last prompt position"
                         + ("" if logits_for is None else
                            f" (only for {', '.join(sorted(logits_for))}; the others: top-k)"),
        "topk_positions": f"every {TOPK_STRIDE}th position (0, {TOPK_STRIDE}, ...) and the last",
        "prompts": out_prompts,
        "fidelity": {"text_file": "fidelity_prompt.txt", "ids": fid_ids, "n_tokens": len(fid_ids)},
    }
    write_json(os.path.join(out_dir, "reference.json"), ref)

    meta = {
        "generator": "tests/reference/gen_model_reference.py",
        "command": " ".join([sys.executable, "tests/reference/gen_model_reference.py"] + sys.argv[1:]),
        "versions": versions(),
        "model": {"file": os.path.basename(args.model), "sha256": sha256_file(args.model)},
        "tokenizer": type(tok).__name__ + " from the GGUF (AutoTokenizer gguf_file=...)",
        "dtype": "float32",
        "attn_implementation": "eager",
        "torch_threads": torch.get_num_threads(),
        "sources": {"long_prompt.txt": LONG_SOURCE, "fidelity_prompt.txt": FIDELITY_SOURCE},
    }
    write_json(os.path.join(out_dir, "meta.json"), meta)


# ---- tiny random-weight checkpoints ------------------------------------------------------

TINY_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=320,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2)


def reinit(model, seed):
    """Weights large enough that attention is far from uniform and every part of the block
    (norm gains, biases, RoPE) changes the logits: linear N(0, 0.15), embeddings N(0, 0.5),
    norm gains 1 + N(0, 0.2), biases N(0, 0.3). Drawn in named_parameters() order from one
    seeded generator (tied tensors appear once)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * r)
            elif name.endswith(".bias"):
                p.copy_(0.3 * r)
            elif "embed_tokens" in name or name == "lm_head.weight":
                p.copy_(0.5 * r)
            else:
                p.copy_(0.15 * r)


def legacy_config_keys(out_dir, rope_theta, rope_scaling=None):
    """transformers 5 writes rope settings only as "rope_parameters"; checkpoints on the Hub
    carry "rope_theta" (and "rope_scaling") at the top level. Write both so the fixtures look
    like either generation; the values agree."""
    path = os.path.join(out_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["rope_theta"] = rope_theta
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    cfg["torch_dtype"] = cfg.get("dtype", "float32")
    write_json(path, cfg)


def fresh_dir(path):
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)


def save_checkpoint(model, out_dir, rope_theta, rope_scaling=None, **kw):
    fresh_dir(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True, **kw)
    legacy_config_keys(out_dir, rope_theta, rope_scaling)
    gen_cfg = os.path.join(out_dir, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)  # holds only token ids already in config.json
    for fn in os.listdir(out_dir):
        os.chmod(os.path.join(out_dir, fn), 0o644)  # save_pretrained writes 0600


def tensor_samples(out_dir):
    """Every tensor's file, dtype and shape (safetensors order) and a few values read back
    with the safetensors library, for the C loader's unit test."""
    from safetensors import safe_open
    files = sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors"))
    tensors = {}
    for fn in files:
        with safe_open(os.path.join(out_dir, fn), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                flat = t.reshape(-1).float()
                n = flat.numel()
                idx = sorted({0, 1, n // 3, n // 2, n - 1})
                tensors[name] = {
                    "file": fn,
                    "dtype": {torch.float32: "F32", torch.bfloat16: "BF16",
                              torch.float16: "F16"}[t.dtype],
                    "shape": list(t.shape),
                    "samples": [[i, float(flat[i])] for i in idx],
                }
    write_json(os.path.join(out_dir, "tensors.json"),
               {"n_tensors": len(tensors), "files": files, "tensors": tensors})


def load_f32(out_dir):
    m = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                             attn_implementation="eager")
    m.eval()
    return m


def tiny_reference(out_dir, ids, n_greedy, all_positions=True):
    """Reloads the saved folder (so the reference is of the files as written) and writes
    logits (all positions, or only the last) and greedy tokens."""
    m = load_f32(out_dir)
    logits = full_logits(m, ids)
    ref = {"ids": ids, "n_tokens": len(ids), "vocab_size": int(logits.shape[-1])}
    if all_positions:
        write_f32(os.path.join(out_dir, "logits.f32"), logits)
        ref["logits_file"] = "logits.f32"
        ref["logits_shape"] = [len(ids), int(logits.shape[-1])]
    else:
        write_f32(os.path.join(out_dir, "logits_last.f32"), logits[-1])
        ref["logits_file"] = "logits_last.f32"
        ref["logits_shape"] = [int(logits.shape[-1])]
        ref["topk"] = topk_at(logits, sorted(set(list(range(0, len(ids), TOPK_STRIDE))
                                                 + [len(ids) - 1])))
    if n_greedy:
        gen, margins = greedy(m, ids, n_greedy)
        ref["greedy"] = {"n_new": n_greedy, "ids": gen, "margins": margins}
    write_json(os.path.join(out_dir, "reference.json"), ref)
    tensor_samples(out_dir)


def fixed_ids(n, seed, vocab):
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(0, vocab, (n,), generator=g)]


def tiny(args):
    ids40 = fixed_ids(TINY_SEQ, 40, TINY_SIZES["vocab_size"])

    # Llama: separate output matrix, float32; the same weights sharded and in bf16
    cfg = LlamaConfig(**TINY_SIZES, rope_theta=10000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False)
    torch.manual_seed(1)
    llama = LlamaForCausalLM(cfg)
    reinit(llama, 1)
    d = os.path.join(FIXTURES, "tiny-llama")
    save_checkpoint(llama, d, 10000.0)
    tiny_reference(d, ids40, TINY_GREEDY)

    d = os.path.join(FIXTURES, "tiny-llama-sharded")
    save_checkpoint(llama, d, 10000.0, max_shard_size="150KB")
    tiny_reference(d, ids40, TINY_GREEDY)

    d = os.path.join(FIXTURES, "tiny-llama-bf16")
    save_checkpoint(llama.to(torch.bfloat16), d, 10000.0)
    tiny_reference(d, ids40, TINY_GREEDY)

    # Qwen2: q/k/v biases, tied embeddings, theta 1e6
    cfg = Qwen2Config(**TINY_SIZES, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=True)
    torch.manual_seed(2)
    qwen = Qwen2ForCausalLM(cfg)
    reinit(qwen, 2)
    assert qwen.lm_head.weight.data_ptr() == qwen.model.embed_tokens.weight.data_ptr()
    d = os.path.join(FIXTURES, "tiny-qwen2")
    save_checkpoint(qwen, d, 1000000.0)
    tiny_reference(d, ids40, TINY_GREEDY)

    # Llama 3 rope scaling: 200 positions, past the 64-token original context
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = LlamaConfig(**TINY_SIZES, rope_theta=500000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, rope_scaling=dict(scaling))
    assert cfg.rope_parameters["rope_type"] == "llama3"
    torch.manual_seed(3)
    l3 = LlamaForCausalLM(cfg)
    reinit(l3, 3)
    d = os.path.join(FIXTURES, "tiny-llama3-rope")
    save_checkpoint(l3, d, 500000.0, rope_scaling=scaling)
    tiny_reference(d, fixed_ids(LLAMA3_SEQ, 200, TINY_SIZES["vocab_size"]), 0,
                   all_positions=False)
    # Committed as *.safetensors.fixture (random test weights, not a model to ship); the C tests
    # stage a copy under the real names (tests/common/fixture.c).
    for name in os.listdir(FIXTURES):
        sub = os.path.join(FIXTURES, name)
        if name.startswith("tiny-") and os.path.isdir(sub):
            for fn in os.listdir(sub):
                if fn.endswith(".safetensors"):
                    os.replace(os.path.join(sub, fn), os.path.join(sub, fn + ".fixture"))
    print("tiny: done", file=sys.stderr)


SWA_WINDOW = 16
QWEN2_SWA_WINDOW = 12


def rename_safetensors(folder):
    """Commits *.safetensors as *.safetensors.fixture (random test weights, not a model to
    ship); the C tests stage a copy under the real names (tests/common/fixture.c)."""
    for fn in os.listdir(folder):
        if fn.endswith(".safetensors"):
            os.replace(os.path.join(folder, fn), os.path.join(folder, fn + ".fixture"))


@torch.no_grad()
def tiny_swa(args):
    """Sliding-window attention: a Mistral with sliding_window 16 (every layer) and a Qwen2
    with use_sliding_window, sliding_window 12, max_window_layers 1 (layer 1 slides, layer 0
    does not), 40-token prompts and 16 greedy tokens, so every query past the window drops
    keys. transformers' rule (masking_utils.sliding_window_overlay): query position q sees key
    position k iff q - W < k <= q. reference.json also records how far full causal attention
    on the same weights is from the reference (max |diff| of the logits), to show the window
    matters."""
    from transformers import MistralConfig, MistralForCausalLM
    ids40 = fixed_ids(TINY_SEQ, 40, TINY_SIZES["vocab_size"])
    cases = [
        ("tiny-mistral-swa", MistralConfig, MistralForCausalLM, 5,
         dict(rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
              sliding_window=SWA_WINDOW)),
        ("tiny-qwen2-swa", Qwen2Config, Qwen2ForCausalLM, 6,
         dict(rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
              use_sliding_window=True, sliding_window=QWEN2_SWA_WINDOW, max_window_layers=1)),
    ]
    for name, config_cls, model_cls, seed, extra in cases:
        cfg = config_cls(**TINY_SIZES, **extra)
        torch.manual_seed(seed)
        model = model_cls(cfg)
        reinit(model, seed)
        d = os.path.join(FIXTURES, name)
        save_checkpoint(model, d, extra["rope_theta"])
        tiny_reference(d, ids40, TINY_GREEDY)
        m = load_f32(d)
        assert m.config.sliding_window == extra["sliding_window"], m.config.sliding_window
        swa = full_logits(m, ids40)
        layer_types = getattr(m.config, "layer_types", None)
        m.config.sliding_window = None  # the same weights with full causal attention
        if layer_types:
            m.config.layer_types = ["full_attention"] * len(layer_types)
        for layer in m.model.layers:
            layer.self_attn.sliding_window = None
            if hasattr(layer, "attention_type"):
                layer.attention_type = "full_attention"
        m.model.has_sliding_layers = False
        full = full_logits(m, ids40)
        ref_path = os.path.join(d, "reference.json")
        with open(ref_path, encoding="utf-8") as f:
            ref = json.load(f)
        ref["sliding_window"] = extra["sliding_window"]
        ref["layer_types"] = layer_types
        ref["full_attention_max_diff"] = float((swa - full).abs().max())
        ref["full_attention_same_before_window"] = bool(
            torch.equal(swa[:extra["sliding_window"]], full[:extra["sliding_window"]]))
        write_json(ref_path, ref)
        rename_safetensors(d)
        print("%s: layer_types %s, full attention differs by %.3g" %
              (name, layer_types, ref["full_attention_max_diff"]), file=sys.stderr)
    gguf_qwen2_swa()


# Hugging Face Llama / Qwen2 layer tensor names -> GGUF's (blk.N.<name>).
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_begin(folder, arch, name):
    """A GGUFWriter for tests/fixtures/<name>.gguf.fixture from the committed folder
    tests/fixtures/<folder>, with the hyper-parameters every converter writes. Returns
    (writer, config, weights, path)."""
    import gguf
    from safetensors.numpy import load_file
    src = os.path.join(FIXTURES, folder)
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    w = load_file(os.path.join(src, "model.safetensors.fixture"))
    out = os.path.join(FIXTURES, name + ".gguf.fixture")
    wr = gguf.GGUFWriter(out, arch)
    wr.add_name(name)
    wr.add_context_length(cfg["max_position_embeddings"])
    wr.add_embedding_length(cfg["hidden_size"])
    wr.add_block_count(cfg["num_hidden_layers"])
    wr.add_feed_forward_length(cfg["intermediate_size"])
    wr.add_head_count(cfg["num_attention_heads"])
    wr.add_head_count_kv(cfg["num_key_value_heads"])
    return wr, cfg, w, out


def gguf_layers(wr, cfg, w, permute=None):
    """Every layer's tensors under their GGUF names, in GGUF_LAYER_NAMES order (those the
    folder has); permute(hf_name, array) may rewrite one."""
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in GGUF_LAYER_NAMES.items():
            key = "model.layers.%d.%s" % (i, hf)
            if key in w:
                wr.add_tensor("blk.%d.%s" % (i, gg), permute(hf, w[key]) if permute else w[key])


def gguf_finish(wr, out, label):
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    os.chmod(out, 0o644)
    print("%s: %s (%d bytes)" % (label, os.path.relpath(out, REPO), os.path.getsize(out)), file=sys.stderr)


def gguf_qwen2_swa():
    """tiny-qwen2-swa as a GGUF the way llama.cpp's converter writes a Qwen2 with
    use_sliding_window (conversion/qwen.py): qwen2.attention.sliding_window and
    sliding_window_pattern (one bool per layer: [false, true]); f32 tensors, rotate-half
    Q/K rows left as they are (llama.cpp does not permute qwen2), q/k/v biases, tied output
    (no output.weight), no tokenizer. Its reference is the folder's transformers logits."""
    import gguf
    wr, cfg, w, out = gguf_begin("tiny-qwen2-swa", "qwen2", "tiny-qwen2-swa")
    wr.add_rope_freq_base(cfg["rope_theta"])
    wr.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    wr.add_sliding_window(cfg["sliding_window"])
    wr.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    wr.add_file_type(gguf.LlamaFileType.ALL_F32)
    wr.add_tensor("token_embd.weight", w["model.embed_tokens.weight"])
    gguf_layers(wr, cfg, w)
    wr.add_tensor("output_norm.weight", w["model.norm.weight"])
    assert "lm_head.weight" not in w
    gguf_finish(wr, out, "gguf-qwen2-swa")


def llama_cpp_permute(w, n_head):
    """Q/K rows in llama.cpp's GGUF layout (its converter's LlamaModel.permute): within each
    head, rotate-half pairs (i, i + d/2) become adjacent rows (2i, 2i + 1)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(theta, head_dim, scaling):
    """rope_freqs.weight as llama.cpp's converter (conversion/llama.py,
    generate_extra_tensors) computes it from a "llama3" rope_scaling: one factor per rotated
    pair that divides the pair's frequency."""
    import math
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    low_wl, high_wl = old_ctx / lo, old_ctx / hi
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1)
        elif wl > low_wl:
            out.append(factor)
        else:
            smooth = (old_ctx / wl - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def gguf_rope_freqs(args):
    """tiny-llama3-rope as a GGUF the way llama.cpp's converter writes a Llama 3.1 model: the
    rope scaling as a rope_freqs.weight tensor and no rope scaling keys; Q/K rows permuted to
    llama.cpp's layout; f32 tensors; no tokenizer. Read from the committed folder, so its
    logits are the folder's transformers reference (tiny-llama3-rope/logits_last.f32)."""
    import gguf
    wr, cfg, w, out = gguf_begin("tiny-llama3-rope", "llama", "tiny-llama3-rope-freqs")
    n_head, n_kv, hd = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])
    wr.add_key_length(hd)
    wr.add_value_length(hd)
    wr.add_rope_dimension_count(hd)
    wr.add_rope_freq_base(cfg["rope_theta"])
    wr.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    wr.add_file_type(gguf.LlamaFileType.ALL_F32)
    wr.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg["rope_theta"], hd, cfg["rope_scaling"]))
    wr.add_tensor("token_embd.weight", w["model.embed_tokens.weight"])
    heads = {"self_attn.q_proj.weight": n_head, "self_attn.k_proj.weight": n_kv}
    gguf_layers(wr, cfg, w, lambda hf, a: llama_cpp_permute(a, heads[hf]) if hf in heads else a)
    wr.add_tensor("output_norm.weight", w["model.norm.weight"])
    wr.add_tensor("output.weight", w["lm_head.weight"])
    gguf_finish(wr, out, "gguf-rope")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.environ.get("SKV_MODEL", DEFAULT_MODEL))
    ap.add_argument("--only", choices=["golden", "tiny", "gguf-rope", "swa", "all"], default="all")
    ap.add_argument("--golden-dir", default=GOLDEN,
                    help="where --only golden writes (another model: its own folder; the prompt "
                         "texts are copied from tests/fixtures/golden/)")
    ap.add_argument("--last-logits", default=None,
                    help="comma-separated prompt names whose whole last-position logits are "
                         "written (default: every prompt); the others keep their top-k only")
    ap.add_argument("--refresh-texts", action="store_true",
                    help="recreate long_prompt.txt / fidelity_prompt.txt from the license files")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    if args.only in ("tiny", "all"):
        tiny(args)
    if args.only in ("tiny", "gguf-rope", "all"):
        gguf_rope_freqs(args)
    if args.only in ("tiny", "swa", "all"):
        tiny_swa(args)
    if args.only in ("golden", "all"):
        if not os.path.exists(args.model):
            raise SystemExit(f"{args.model}: not found (scripts/fetch-model)")
        golden(args)


if __name__ == "__main__":
    main()
