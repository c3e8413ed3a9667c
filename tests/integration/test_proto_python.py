"""A client written from proto/snapkv.proto alone, in Python, against a real snapkvd.

Google's protobuf (Debian's python3-protobuf, the C++ implementation), not protobuf-c, encodes
every request and decodes every reply: a reply that is not valid proto3 (a `string` that is not
UTF-8, a bad length, a wrong wire type) fails its parse here. Run by tests/integration/
test_proto_python.sh (it picks a python3 that has the modules) from `make check`; exits 77
(skipped) without protoc, python3-protobuf, python3-zmq or the default model.

What it checks, with values from references no one here wrote:
- HELLO: the model's shape as its config (SmolLM2-135M: 30 layers, 9 heads, 3 KV heads, 64 wide,
  49152 tokens);
- PREFILL of the golden fixture's texts (tests/fixtures/golden, Hugging Face transformers): the
  token counts, the last position's logits and the greedy continuation, plain and streamed, and
  a chat turn rendered as apply_chat_template does;
- INSPECT's block hashes against Python's hashlib BLAKE2b-64 chain over the token history, and
  the KV events (a SUB socket) carrying the same;
- EXPORT_KV into a POSIX shared-memory object this process made, IMPORT_KV of it as a new
  session, and both sessions decoding the same tokens; as root, an object of another user's
  refused;
- COMPRESS, FORK, RELEASE, CANCEL; STATUS, LIST, STATS, CONFIG_GET on the admin socket;
- errors: a bad spec (INVAL), an unknown session (NOT_FOUND), a wrong protocol version
  (VERSION), each with its message, the daemon serving on; a SIGTERM ends it with status 0.
"""
import hashlib
import json
import math
import mmap
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

SKIP = 77
OK, E_INVAL, E_NOT_FOUND, E_LIMIT, E_PERM, E_VERSION = 0, -2, -8, -11, -12, -13


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(SKIP)


try:
    import zmq
    from google.protobuf import __version__ as pb_version
    from google.protobuf.internal import api_implementation
except ImportError as e:
    skip(f"{e.name} is missing (Debian: python3-zmq, python3-protobuf; scripts/setup installs them)")

SRC = os.environ.get("SKV_SRCDIR", ".")
BUILD = os.environ.get("SKV_BUILDDIR", ".")
MODEL = os.environ.get("SKV_MODEL") or f"{SRC}/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if not os.path.exists(MODEL):
    skip(f"no model at {MODEL} (scripts/fetch-model)")
if not shutil.which("protoc"):
    skip("protoc is missing (Debian: protobuf-compiler; scripts/setup installs it)")

TMP = tempfile.mkdtemp(prefix="skv-py-")
subprocess.run(["protoc", f"--proto_path={SRC}/proto", f"--python_out={TMP}", "snapkv.proto"], check=True)
sys.path.insert(0, TMP)
import snapkv_pb2 as pb  # noqa: E402

GOLDEN = json.load(open(f"{SRC}/tests/fixtures/golden/reference.json"))
PROMPTS = {p["name"]: p for p in GOLDEN["prompts"]}
failures = 0


def check(cond, what):
    global failures
    print(("ok     " if cond else "FAILED ") + what)
    if not cond:
        failures += 1
    return cond


class Conn:
    """A DEALER: one request at a time, its replies read until the final one."""

    def __init__(self, ctx, endpoint, tenant="py"):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.tenant = tenant
        self.next_id = 1

    def send(self, field, msg, version=pb.PROTOCOL_VERSION_CURRENT):
        req = pb.Request(version=version, request_id=self.next_id, tenant=self.tenant)
        getattr(req, field).CopyFrom(msg)
        self.next_id += 1
        self.sock.send(req.SerializeToString())
        return req.request_id

    def replies(self, request_id, timeout_s=120):
        """Every reply to request_id up to the final one, each parsed by Google's protobuf."""
        out = []
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise TimeoutError(f"no final reply to request {request_id} in {timeout_s} s")
            rep = pb.Reply()
            rep.ParseFromString(self.sock.recv())  # raises DecodeError on anything not proto3
            if rep.request_id != request_id or rep.version != pb.PROTOCOL_VERSION_CURRENT:
                raise AssertionError(f"reply for request {rep.request_id} v{rep.version}, "
                                     f"waiting for {request_id}")
            out.append(rep)
            if rep.final or rep.status != OK:
                return out

    def call(self, field, msg, **kw):
        return self.replies(self.send(field, msg, **kw))[-1]


def blake2b_chain(tokens, block):
    """The SessionStored hashes (proto/snapkv.proto): h_i = BLAKE2b-64(h_{i-1} || block i)."""
    prev, out = bytes(8), []
    for b in range(len(tokens) // block):
        h = hashlib.blake2b(prev + struct.pack(f"<{block}I", *tokens[b * block:(b + 1) * block]), digest_size=8)
        prev = h.digest()
        out.append(struct.unpack("<Q", prev)[0])
    return out


def main():
    print(f"# protobuf {pb_version} ({api_implementation.Type()}), pyzmq {zmq.__version__}, libzmq "
          f"{zmq.zmq_version()}")
    ep, admin_ep, events_ep = (f"ipc://{TMP}/{n}.sock" for n in ("c", "a", "e"))
    log = open(f"{TMP}/daemon.log", "w")
    daemon = subprocess.Popen([f"{BUILD}/snapkvd", f"--endpoint={ep}", f"--admin-endpoint={admin_ep}",
                               f"--events-endpoint={events_ep}", f"--model={MODEL}", f"--state-dir={TMP}",
                               "--threads=1", "--backend=cpu", "--log-level=info"],
                              stdout=log, stderr=subprocess.STDOUT)
    ctx = zmq.Context()
    try:
        run(ctx, daemon, ep, admin_ep, events_ep)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        ctx.destroy(linger=0)
    if failures:
        print(f"# {failures} checks failed; the daemon's log: {TMP}/daemon.log")
        print(open(f"{TMP}/daemon.log").read()[-4000:])
        return 1
    shutil.rmtree(TMP, ignore_errors=True)
    return 0


def run(ctx, daemon, ep, admin_ep, events_ep):
    c = Conn(ctx, ep)
    admin = Conn(ctx, admin_ep)
    events = ctx.socket(zmq.SUB)
    events.setsockopt(zmq.SUBSCRIBE, b"")
    events.connect(events_ep)

    # HELLO waits in the DEALER's queue until the daemon binds and has loaded the model
    hello = c.call("hello", pb.HelloRequest(client_name="python", tenant="py", pid=os.getpid()))
    h = hello.hello
    check(hello.status == OK and hello.WhichOneof("result") == "hello", f"HELLO answered ({hello.message})")
    check((h.n_layers, h.n_heads, h.n_kv_heads, h.head_dim, h.n_vocab) == (30, 9, 3, 64, GOLDEN["vocab_size"]),
          f"HELLO: the model's shape {h.n_layers}x{h.n_heads}/{h.n_kv_heads}x{h.head_dim}, {h.n_vocab} tokens")
    check(h.backend == "cpu" and len(h.model_fingerprint) == 64 and h.kv_block_tokens == 16,
          f"HELLO: backend {h.backend}, fingerprint {h.model_fingerprint[:16]}…, blocks of {h.kv_block_tokens}")
    time.sleep(0.2)  # the SUB's subscription reaches the PUB before the first event

    # PREFILL of the short text: Hugging Face's token count, last logits and greedy tokens
    short = PROMPTS["short"]
    rep = c.call("prefill", pb.PrefillRequest(text=short["text"], return_logits=True))
    p = rep.prefill
    check(rep.status == OK and p.n_tokens == len(short["ids"]) and len(p.session_id) == 16,
          f"PREFILL text: {p.n_tokens} tokens, as the reference tokenizer's {len(short['ids'])}")
    want = struct.unpack(f"<{GOLDEN['vocab_size']}f",
                         open(f"{SRC}/tests/fixtures/golden/{short['last_logits_file']}", "rb").read())
    top = max(range(len(want)), key=want.__getitem__)
    diff = max(abs(a - b) for a, b in zip(p.logits, want)) if len(p.logits) == len(want) else float("inf")
    scale = max(abs(v) for v in want)
    check(diff <= 2e-3 * scale and p.next_token == top,
          f"PREFILL logits: max |diff| {diff:.3g} against transformers' (limit {2e-3 * scale:.3g}), "
          f"next token {p.next_token} = {top}")
    sid = p.session_id
    tk = c.call("tokenize", pb.TokenizeRequest(text=short["text"]))
    dt = c.call("detokenize", pb.DetokenizeRequest(tokens=short["ids"]))
    oov = c.call("detokenize", pb.DetokenizeRequest(tokens=[1, h.n_vocab]))
    check("tokenize" in h.features and tk.status == OK and list(tk.tokenize.tokens) == short["ids"]
          and dt.status == OK and dt.detokenize.text == short["text"] and oov.status == E_INVAL
          and "outside the vocabulary" in oov.message,
          f"TOKENIZE: transformers' {len(short['ids'])} ids; "
          f"DETOKENIZE: the text back ({dt.detokenize.text[:20]!r}…)")

    # the prompt scored: each token's log-probability as transformers' log_softmax gives it
    sc_want = json.load(open(f"{SRC}/tests/fixtures/golden/prompt_logprobs.json"))["prompts"][0]["logprobs"]
    rep = c.call("prefill", pb.PrefillRequest(text=short["text"], prompt_logprobs=True))
    sc = rep.prefill
    sc_diff = (max(abs(a - b) for a, b in zip(sc.prompt_logprobs, sc_want))
               if len(sc.prompt_logprobs) == len(sc_want) else float("inf"))
    check("prompt-logprobs" in h.features and rep.status == OK and list(sc.prompt_tokens) == short["ids"]
          and sc_diff <= 1e-2 and sc.reused_tokens == 0 and len(sc.prompt_top_tokens) == len(sc_want),
          f"PREFILL prompt_logprobs: {len(sc.prompt_logprobs)} scores, max |diff| {sc_diff:.3g} against transformers")
    c.call("release", pb.ReleaseRequest(session_id=sc.session_id))
    # with each position's 4 most likely tokens (prompt_top_logprobs implies prompt_logprobs)
    rep = c.call("prefill", pb.PrefillRequest(text=short["text"], prompt_top_logprobs=4))
    st = rep.prefill
    lists_ok = (len(st.prompt_top_logprobs) == len(sc_want)
                and all(len(t.tokens) == 4 and len(t.logprobs) == 4 and t.tokens[0] == st.prompt_top_tokens[i]
                        and list(t.logprobs) == sorted(t.logprobs, reverse=True)
                        for i, t in enumerate(st.prompt_top_logprobs)))
    check("prompt-top-logprobs" in h.features and rep.status == OK and len(st.prompt_logprobs) == len(sc_want)
          and lists_ok, f"PREFILL prompt_top_logprobs=4: {len(st.prompt_top_logprobs)} lists of 4, most likely first")
    c.call("release", pb.ReleaseRequest(session_id=st.session_id))
    rep = c.call("prefill", pb.PrefillRequest(text=short["text"], prompt_top_logprobs=21))
    check(rep.status == E_LIMIT and "prompt_top_logprobs" in rep.message,
          f"PREFILL prompt_top_logprobs=21: LIMIT, {rep.message!r}")

    greedy = short["greedy"]["ids"][:16]
    rep = c.call("decode", pb.DecodeRequest(session_id=sid, sampling=pb.Sampling(max_tokens=16, top_logprobs=3)))
    d = rep.decode
    check(rep.status == OK and list(d.tokens) == greedy and d.n_generated == 16 and d.finish_reason == "length",
          f"DECODE: 16 greedy tokens as transformers' generate ({list(d.tokens)[:4]}…), text {d.text[:24]!r}…")
    # its log-probabilities: the first step's against the log-softmax of the PREFILL logits and of
    # transformers' logits, its top 3 transformers' top 3; every step's top token the greedy one
    def log_softmax(xs):
        m = max(xs)
        lse = m + math.log(sum(math.exp(x - m) for x in xs))
        return [x - lse for x in xs]
    own, ref = log_softmax(list(p.logits)), log_softmax(list(want))
    top3 = sorted(range(len(want)), key=lambda i: -want[i])[:3]
    ok = len(d.logprobs) == 16 and len(d.top_logprobs) == 16 and all(len(t.tokens) == 3 for t in d.top_logprobs)
    check(ok and abs(d.logprobs[0] - own[greedy[0]]) < 1e-4 and abs(d.logprobs[0] - ref[greedy[0]]) < 4e-3 * scale
          and list(d.top_logprobs[0].tokens) == top3
          and all(t.tokens[0] == g and abs(t.logprobs[0] - lp) < 1e-7 for t, g, lp in zip(d.top_logprobs, greedy,
                                                                                          d.logprobs)),
          f"DECODE log-probabilities: step 0 {list(d.logprobs[:1])} (the PREFILL logits' {own[greedy[0]]:.5}, "
          f"transformers' {ref[greedy[0]]:.5}), top 3 {list(d.top_logprobs[0].tokens) if ok else None}"
          f" = transformers' {top3}")

    # a repetition penalty and logit biases (LogitBias messages): transformers' generate() with
    # repetition_penalty and sequence_bias, to its EOS (tests/fixtures/sampling/greedy.json)
    pen = json.load(open(f"{SRC}/tests/fixtures/sampling/greedy.json"))["cases"][1]
    psid = c.call("prefill", pb.PrefillRequest(tokens=pen["ids"])).prefill.session_id
    bias = [pb.LogitBias(token=t, bias=b) for t, b in zip(pen["bias_tokens"], pen["bias_values"])]
    rep = c.call("decode", pb.DecodeRequest(session_id=psid, sampling=pb.Sampling(
        max_tokens=40, stop_at_eos=True, repetition_penalty=pen["repetition_penalty"], logit_bias=bias)))
    c.call("release", pb.ReleaseRequest(session_id=psid))
    check("sampling-ext" in h.features and rep.status == OK and list(rep.decode.tokens) == pen["tokens"]
          and rep.decode.finish_reason == "eos",
          f"DECODE with repetition_penalty {pen['repetition_penalty']} and {len(bias)} logit biases: "
          f"{len(rep.decode.tokens)} tokens as transformers' generate, {rep.decode.text[:30]!r}…")
    rep = c.call("decode", pb.DecodeRequest(session_id=sid, sampling=pb.Sampling(max_tokens=2, min_p=1.5)))
    check(rep.status == E_INVAL and "min_p" in rep.message, f"DECODE min_p 1.5: INVAL, {rep.message!r}")

    # the code prompt as tokens (a packed repeated field), its decode streamed
    code = PROMPTS["code"]
    rep = c.call("prefill", pb.PrefillRequest(tokens=code["ids"]))
    csid, code_next = rep.prefill.session_id, rep.prefill.next_token
    check(rep.status == OK and rep.prefill.n_tokens == len(code["ids"]), f"PREFILL tokens: {len(code['ids'])}")
    parts = c.replies(c.send("decode", pb.DecodeRequest(session_id=csid, stream=True,
                                                        sampling=pb.Sampling(max_tokens=12))))
    streamed = [t for r in parts for t in r.decode.tokens]
    check(all(r.status == OK for r in parts) and len(parts) > 2 and not any(r.final for r in parts[:-1])
          and streamed == code["greedy"]["ids"][:12] and parts[-1].decode.n_generated == 12,
          f"DECODE stream: {len(parts)} replies, their tokens the 12 of transformers' generate")

    # the code prompt again: its whole 16-token blocks come from the first session (prefix reuse)
    # but for more than the CPU's small-batch size (32) computed, the next token the same; with
    # no_prefix_reuse, none
    n = len(code["ids"])
    for opt_out in (False, True):
        rep = c.call("prefill", pb.PrefillRequest(tokens=code["ids"], no_prefix_reuse=opt_out))
        want_reused = 0 if opt_out else (n - 33) // 16 * 16
        check(rep.status == OK and rep.prefill.reused_tokens == want_reused and rep.prefill.next_token == code_next,
              f"PREFILL again{' (no_prefix_reuse)' if opt_out else ''}: {rep.prefill.reused_tokens} of {n} tokens "
              f"reused, next token {rep.prefill.next_token}")
        rep = c.call("release", pb.ReleaseRequest(session_id=rep.prefill.session_id))
        check(rep.status == OK, "RELEASE")

    # a chat turn rendered with the model's template, as apply_chat_template(add_generation_prompt)
    chat = PROMPTS["chat"]
    rep = c.call("prefill", pb.PrefillRequest(text=chat["messages"][0]["content"], chat=True))
    check(rep.status == OK and rep.prefill.n_tokens == len(chat["ids"])
          and rep.prefill.next_token == chat["greedy"]["ids"][0],
          f"PREFILL chat: {rep.prefill.n_tokens} tokens as the template's {len(chat['ids'])}, next token "
          f"{rep.prefill.next_token}")
    chat_sid = rep.prefill.session_id

    # INSPECT: the token history's block hashes, as hashlib computes them
    history = short["ids"] + greedy
    rep = admin.call("inspect", pb.InspectRequest(session_id=sid, with_positions=True))
    ins = rep.inspect
    expect = blake2b_chain(history, ins.block_size)
    check(rep.status == OK and ins.info.n_tokens == len(history) and ins.info.tenant == "py"
          and len(ins.kept) == 30 and list(ins.block_hashes) == expect,
          f"INSPECT: {ins.info.n_tokens} tokens, {len(expect)} block hashes equal to hashlib's BLAKE2b-64 chain")

    # EXPORT_KV into shared memory made here, IMPORT_KV of it: two sessions decoding alike
    name = f"/snapkv-py-{os.getpid()}"
    size = 8 << 20
    fd = os.open(f"/dev/shm{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # the pages the client's, not the daemon's
        buf = mmap.mmap(fd, size)
        rep = c.call("export_kv", pb.ExportKvRequest(session_id=sid, buffer=pb.BufferRef(shm_name=name, size=size)))
        ex = rep.export_kv
        per_layer = 2 * 3 * len(history) * 64 * 4  # K and V, 3 KV heads, float32
        check(rep.status == OK and ex.bytes_written == 30 * per_layer and ex.original_length == len(history)
              and len(ex.positions) == 30 * 3 * len(history),
              f"EXPORT_KV: {ex.bytes_written} bytes into {name} (30 layers x {per_layer})")
        k0 = struct.unpack_from("<4f", buf, 0)
        check(any(v != 0.0 for v in k0), f"EXPORT_KV: layer 0's first K values {['%.3f' % v for v in k0]}")
        rep = c.call("import_kv", pb.ImportKvRequest(buffer=pb.BufferRef(shm_name=name, size=size), kept=ex.kept,
                                                     positions=ex.positions, tokens=history,
                                                     original_length=ex.original_length))
        check(rep.status == OK and len(rep.import_kv.session_id) == 16, f"IMPORT_KV ({rep.message})")
        isid = rep.import_kv.session_id
        buf.close()
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm{name}")
    if os.geteuid() == 0:  # another user's object, named by this client: refused, untouched
        other = f"/snapkv-py-other-{os.getpid()}"
        fd = os.open(f"/dev/shm{other}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
        try:
            os.ftruncate(fd, size)
            os.fchown(fd, 65534, 65534)
            rep = c.call("export_kv", pb.ExportKvRequest(session_id=sid, buffer=pb.BufferRef(shm_name=other, size=size)))
            check(rep.status == E_PERM and "only its own buffers" in rep.message and os.pread(fd, 4096, 0) == bytes(4096),
                  f"EXPORT_KV into another user's object: PERM, {rep.message[:60]!r}…")
        finally:
            os.close(fd)
            os.unlink(f"/dev/shm{other}")
    # an imported session has no next-token logits: the next token goes in by APPEND, to both
    nxt = short["greedy"]["ids"][16]
    a = c.call("append", pb.AppendRequest(session_id=sid, tokens=[nxt], return_logits=True))
    b = c.call("append", pb.AppendRequest(session_id=isid, tokens=[nxt], return_logits=True))
    check(a.status == OK and b.status == OK and len(a.append.logits) == GOLDEN["vocab_size"]
          and list(a.append.logits) == list(b.append.logits) and b.append.n_tokens == len(history) + 1,
          f"APPEND to the imported session and its original: the same logits ({a.message}{b.message})")
    a = c.call("decode", pb.DecodeRequest(session_id=sid, sampling=pb.Sampling(max_tokens=8)))
    b = c.call("decode", pb.DecodeRequest(session_id=isid, sampling=pb.Sampling(max_tokens=8)))
    check(a.status == OK and b.status == OK and list(a.decode.tokens) == list(b.decode.tokens)
          and list(a.decode.tokens) == short["greedy"]["ids"][17:25],
          f"the imported session decodes as its original: {list(b.decode.tokens)}")
    history.append(nxt)

    # COMPRESS, FORK, CANCEL (nothing running), RELEASE
    rep = c.call("compress", pb.CompressRequest(session_id=csid,
                                                compress=pb.CompressSpec(spec="policy=snapkv,budget=32,window=8")))
    cr = rep.compress
    check(rep.status == OK and len(cr.kept) == 30 and all(k.kept == 32 and len(k.kept_per_head) == 3 for k in cr.kept)
          and cr.bytes_after < cr.bytes_before,
          f"COMPRESS: 32 of {len(code['ids']) + 12} entries kept per layer, {cr.bytes_before} -> {cr.bytes_after} bytes")
    rep = c.call("fork", pb.ForkRequest(session_id=csid))
    check(rep.status == OK and len(rep.fork.session_id) == 16 and rep.fork.shared_bytes > 0,
          f"FORK: {rep.fork.shared_bytes} bytes shared")
    fsid = rep.fork.session_id
    rep = c.call("cancel", pb.CancelRequest(session_id=fsid))
    check(rep.status == OK and not rep.cancel.cancelled, "CANCEL with no decode running: cancelled = false")

    # errors: each a status and a message, the daemon serving on
    rep = c.call("prefill", pb.PrefillRequest(text="hi", compress=pb.CompressSpec(spec="policy=snapk")))
    check(rep.status == E_INVAL and "policy" in rep.message, f"a bad spec: INVAL, {rep.message!r}")
    rep = c.call("release", pb.ReleaseRequest(session_id=bytes(range(16))))
    check(rep.status == E_NOT_FOUND and rep.message, f"an unknown session: NOT_FOUND, {rep.message!r}")
    rep = c.call("status", pb.StatusRequest(), version=99)
    check(rep.status == E_VERSION and rep.message, f"protocol version 99: VERSION, {rep.message!r}")

    # the admin socket
    rep = admin.call("list", pb.ListRequest(tenant="py"))
    listed = {s.session_id for s in rep.list.sessions}
    check(rep.status == OK and listed == {sid, csid, chat_sid, isid, fsid}, f"LIST: {len(listed)} sessions of py")
    rep = admin.call("status", pb.StatusRequest())
    st = rep.status_reply
    check(rep.status == OK and st.n_sessions == 5 and st.backend == "cpu" and st.pool_bytes_used > 0,
          f"STATUS: {st.n_sessions} sessions, {st.pool_bytes_used} pool bytes used")
    rep = admin.call("stats", pb.StatsRequest(prometheus=True))
    stats = {s.name: s.value for s in rep.stats.stats}
    check(rep.status == OK and stats.get("snapkv_sessions") == 5
          and "snapkv_sessions 5" in rep.stats.prometheus_text,
          f"STATS: {len(stats)} rows, snapkv_sessions {stats.get('snapkv_sessions')}")
    rep = admin.call("config_get", pb.ConfigGetRequest(key="threads"))
    check(rep.status == OK and [(e.key, e.value) for e in rep.config_get.entries] == [("threads", "1")],
          "CONFIG_GET threads: 1")
    for s in (sid, csid, chat_sid, isid, fsid):
        rep = c.call("release", pb.ReleaseRequest(session_id=s))
        check(rep.status == OK and rep.WhichOneof("result") == "release", "RELEASE")
    rep = admin.call("list", pb.ListRequest(tenant="py"))
    check(rep.status == OK and len(rep.list.sessions) == 0, "LIST after the RELEASEs: none")

    # the KV events: [topic][sequence][batch], one announcing the short session with its hashes
    topic = f"snapkv.kv.{h.model_fingerprint[:16]}".encode()
    seqs, stored, removed = [], {}, set()
    while events.poll(1000):
        frames = events.recv_multipart()
        if not check(len(frames) == 3, f"an event message of {len(frames)} frames"):
            break
        batch = pb.KvEventBatch()
        batch.ParseFromString(frames[2])
        check(frames[0] == topic and batch.version == pb.PROTOCOL_VERSION_CURRENT,
              f"an event message: topic {frames[0][:26]!r}, {len(batch.events)} events") if not seqs else None
        if batch.events:
            seqs.append(struct.unpack(">Q", frames[1])[0])
        for ev in batch.events:
            if ev.WhichOneof("kind") == "stored":
                stored[ev.stored.session_id] = ev.stored
            elif ev.WhichOneof("kind") == "removed":
                removed.add(ev.removed.session_id)
    check(len(seqs) > 0 and seqs == list(range(seqs[0], seqs[0] + len(seqs))),
          f"events: {len(seqs)} messages, sequences {seqs[:1]}…{seqs[-1:]} without a gap")
    s = stored.get(sid)  # its last announcement: after the second DECODE
    full = history + list(a.decode.tokens)
    check(s is not None and s.tenant == "py" and list(s.block_hashes) == blake2b_chain(full, 16)
          and s.n_tokens == len(full) and not s.compressed,
          f"events: the short session stored with hashlib's hashes ({len(s.block_hashes) if s else 0} blocks)")
    check(removed >= {sid, csid, chat_sid, isid, fsid}, f"events: the 5 RELEASEs announced ({len(removed)})")

    # SIGTERM: a clean stop
    daemon.send_signal(signal.SIGTERM)
    try:
        rc = daemon.wait(timeout=60)
    except subprocess.TimeoutExpired:
        rc = None
    check(rc == 0, f"SIGTERM: the daemon exited with status {rc}")


if __name__ == "__main__":
    sys.exit(main())
