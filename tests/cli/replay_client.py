#!/usr/bin/python3
"""The client side of the kill-a-rank tests (coordinator_replay_test.sh,
serve_replay_test.sh), over exl3serve's public gRPC API.

Run with Debian's /usr/bin/python3 and the stubs the build generates into
BUILD/python. Subcommands (all take --addr and --stubs):

  refs     --out FILE         the reference: every stream's prompt run alone,
                              one at a time, through the same server, every
                              prompt token computed (no_prefix_cache) (JSON)
  streams  --refs FILE --kill-pid PID --expect same|unavailable
                              all streams at once; once every stream has its
                              first chunk, SIGKILL the rank PID and write
                              --killed-file. same: every stream completes
                              with exactly its reference tokens. unavailable:
                              every stream ends UNAVAILABLE within
                              --within-s of the kill, its tokens a prefix of
                              the reference
  info     [--ready 0|1] [--min-replays N] [--up R,..] [--down R,..]
           [--min-preemptions N] [--min-drafts N] [--min-accepted N]
                              GetServerInfo answers, with that readiness, at
                              least N replays and those ranks up / down, at
                              least N preemptions, speculative drafts verified
                              and draft tokens accepted
  one      --refs FILE [--min-cached N]
                              stream 0 alone again equals its reference (and
                              reports at least N prompt tokens cached)
  same     A.json B.json      two reference files hold the same tokens

--repetitive (before the subcommand): each prompt repeats a span of its own
three times after the shared prefix (what n-gram drafts are for).
--sampled (before the subcommand): every request samples (temperature 0.8,
top-p 0.9, top-k 50, repetition 1.1, presence 0.3, frequency 0.2) with seed
1000 + its stream index instead of greedy decoding. --kill-pid 0: no kill
(all streams at once only, the "inside a batch" check).

Prints one line per check; exits 1 on the first failure.
"""
import argparse
import json
import os
import signal
import sys
import threading
import time

import grpc

CALL_TIMEOUT_S = 300  # a gRPC deadline on every call: no client waits forever


def fail(msg):
    print(f"FAIL: {msg}", flush=True)
    sys.exit(1)


SHARED_PREFIX = [1 + (k * 53) % 997 for k in range(21)]


REPETITIVE = False


def prompts(n):
    """n prompts: a shared 21-token prefix (a full KV block the server's
    prefix cache shares, also across a replay) then 3..15 tokens of their
    own, ids in [1, 998); with --repetitive those tokens three times."""
    out = []
    for i in range(n):
        own = [1 + (i * 37 + j * 11 + i * j) % 997 for j in range(3 + (i * 5) % 13)]
        out.append(SHARED_PREFIX + own * (3 if REPETITIVE else 1))
    return out


class Stream:
    """One Generate call on a thread of its own."""

    def __init__(self, client, index, ids, max_tokens, no_prefix_cache=False):
        self.index = index
        self.req = client.request(ids, max_tokens, request_id=f"replay-{index}-{time.time_ns()}",
                                  seed=1000 + index, no_prefix_cache=no_prefix_cache)
        self.client = client
        self.first = threading.Event()
        self.ids = []
        self.complete = None
        self.error_message = None  # a GenerateError message, if any
        self.code = None  # final gRPC status code
        self.details = ""
        self.ended_at = None
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        try:
            for r in self.client.stub.Generate(self.req, timeout=CALL_TIMEOUT_S):
                kind = r.WhichOneof("response")
                if kind == "chunk":
                    self.ids.extend(r.chunk.token_ids)
                    self.first.set()
                elif kind == "complete":
                    self.complete = r.complete
                elif kind == "error":
                    self.error_message = r.error.message
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code = e.code()
            self.details = e.details()
        finally:
            self.ended_at = time.monotonic()
            self.first.set()


class Client:
    def __init__(self, addr, stubs, sampled=False):
        self.sampled = sampled
        sys.path.insert(0, stubs)
        from exl3serve.v1 import generation_pb2 as pb
        from exl3serve.v1 import generation_pb2_grpc as pb_grpc
        self.pb = pb
        self.channel = grpc.insecure_channel(addr)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def request(self, ids, max_tokens, request_id="", seed=0, no_prefix_cache=False):
        req = self.pb.GenerateRequest(request_id=request_id, no_prefix_cache=no_prefix_cache)
        req.tokenized.input_ids.extend(ids)
        req.sampling_params.max_tokens = max_tokens
        req.sampling_params.ignore_eos = True
        if self.sampled:
            sp = req.sampling_params
            sp.temperature, sp.top_p, sp.top_k = 0.8, 0.9, 50
            sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty = 1.1, 0.3, 0.2
            sp.seed = seed
        else:
            req.sampling_params.temperature = 0.0  # greedy
        return req

    def solo(self, ids, max_tokens, index=0, no_prefix_cache=False):
        s = Stream(self, index, ids, max_tokens, no_prefix_cache)
        s.run()
        if s.code != grpc.StatusCode.OK or s.complete is None:
            fail(f"solo stream {ids}: {s.code} {s.details} {s.error_message}")
        if list(s.complete.output_ids) != s.ids:
            fail(f"solo stream {ids}: complete.output_ids != streamed ids")
        return s.ids

    def info(self):
        return self.stub.GetServerInfo(self.pb.GetServerInfoRequest(), timeout=30)


def cmd_refs(c, a):
    refs = []
    for i, p in enumerate(prompts(a.streams)):
        ids = c.solo(p, a.max_tokens, index=i, no_prefix_cache=True)  # every token computed
        if len(ids) != a.max_tokens:
            fail(f"reference {i}: {len(ids)} tokens, want {a.max_tokens}")
        refs.append({"prompt": p, "ids": ids})
    with open(a.out, "w") as f:
        json.dump({"max_tokens": a.max_tokens, "refs": refs}, f)
    print(f"refs: {len(refs)} streams run alone, {a.max_tokens} tokens each", flush=True)


def cmd_streams(c, a):
    ref = json.load(open(a.refs))
    refs = ref["refs"]
    streams = [Stream(c, i, r["prompt"], ref["max_tokens"]) for i, r in enumerate(refs)]
    for s in streams:
        s.thread.start()
    deadline = time.monotonic() + 120
    for s in streams:
        if not s.first.wait(max(0.0, deadline - time.monotonic())):
            if a.kill_pid:
                os.kill(a.kill_pid, signal.SIGKILL)  # do not leave the group half-tested
            fail(f"stream {s.index}: no first chunk in 120 s")
    early = [s.index for s in streams if s.ended_at is not None]
    if early and a.kill_pid:
        fail(f"streams {early} ended before the kill: {[streams[i].code for i in early]}")
    if a.kill_pid:
        os.kill(a.kill_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    progress = sum(len(s.ids) for s in streams)
    print(f"streams: all {len(streams)} have their first chunk ({progress} tokens so far); "
          + (f"SIGKILL rank pid {a.kill_pid}" if a.kill_pid else "no kill"), flush=True)
    if a.killed_file:
        with open(a.killed_file, "w") as f:
            f.write(f"{a.kill_pid}\n")
    for s in streams:  # the gRPC deadline bounds each; this bounds the join
        s.thread.join(CALL_TIMEOUT_S + 30)
        if s.thread.is_alive():
            fail(f"stream {s.index}: the client hangs")
    took = max(s.ended_at for s in streams) - killed_at
    if a.expect == "same":
        for s, r in zip(streams, refs):
            if s.code != grpc.StatusCode.OK or s.complete is None:
                fail(f"stream {s.index}: ended {s.code} {s.details!r} {s.error_message!r}, want complete")
            if s.ids != r["ids"]:
                diff = next((k for k, (x, y) in enumerate(zip(s.ids, r["ids"])) if x != y), None)
                fail(f"stream {s.index}: {len(s.ids)} tokens differ from its run alone "
                     f"({len(r['ids'])} tokens; first difference at {diff})")
            if list(s.complete.output_ids) != s.ids:
                fail(f"stream {s.index}: complete.output_ids != streamed ids")
        print(f"streams: all {len(streams)} completed with their solo tokens, "
              f"{took:.1f} s after the kill", flush=True)
    else:
        for s, r in zip(streams, refs):
            if s.code != grpc.StatusCode.UNAVAILABLE:
                fail(f"stream {s.index}: ended {s.code} {s.details!r}, want UNAVAILABLE")
            if s.ids != r["ids"][:len(s.ids)]:
                fail(f"stream {s.index}: its {len(s.ids)} tokens are not a prefix of its solo run")
            if s.ended_at - killed_at > a.within_s:
                fail(f"stream {s.index}: ended {s.ended_at - killed_at:.1f} s after the kill, "
                     f"want <= {a.within_s} s")
        print(f"streams: all {len(streams)} ended UNAVAILABLE within {took:.1f} s of the kill "
              f"(bound {a.within_s} s): {streams[0].details!r}", flush=True)


def cmd_info(c, a):
    info = c.info()
    if a.ready is not None and bool(info.ready) != bool(a.ready):
        fail(f"GetServerInfo.ready = {info.ready}, want {bool(a.ready)}")
    if info.num_replays < a.min_replays:
        fail(f"GetServerInfo.num_replays = {info.num_replays}, want >= {a.min_replays}")
    up = {r.rank: r.up for r in info.ranks}
    for want, ranks in ((True, a.up), (False, a.down)):
        for rank in filter(None, ranks.split(",")):
            if up.get(int(rank)) is not want:
                fail(f"GetServerInfo.ranks: rank {rank} is {up.get(int(rank))}, want up={want}")
    for field, want in (("num_preemptions", a.min_preemptions), ("spec_decode_num_drafts", a.min_drafts),
                        ("spec_decode_num_accepted_tokens", a.min_accepted)):
        if getattr(info, field) < want:
            fail(f"GetServerInfo.{field} = {getattr(info, field)}, want >= {want}")
    ranks = ", ".join(f"{r.rank}:{'up' if r.up else 'down'}" for r in info.ranks)
    print(f"info: ready {info.ready}, replays {info.num_replays}, running "
          f"{info.num_requests_running}, ranks [{ranks}], preemptions {info.num_preemptions}, "
          f"speculative '{info.speculative_method}': {info.spec_decode_num_drafts} drafts, "
          f"{info.spec_decode_num_draft_tokens} draft tokens, "
          f"{info.spec_decode_num_accepted_tokens} accepted", flush=True)


def cmd_same(c, a):
    x, y = json.load(open(a.a)), json.load(open(a.b))
    if len(x["refs"]) != len(y["refs"]):
        fail(f"{a.a} has {len(x['refs'])} streams, {a.b} {len(y['refs'])}")
    for i, (p, q) in enumerate(zip(x["refs"], y["refs"])):
        if p["prompt"] != q["prompt"] or p["ids"] != q["ids"]:
            diff = next((k for k, (u, v) in enumerate(zip(p["ids"], q["ids"])) if u != v), None)
            fail(f"stream {i}: {a.a} and {a.b} differ (first difference at token {diff})")
    print(f"same: {len(x['refs'])} streams hold the same tokens in {a.a} and {a.b}", flush=True)


def cmd_one(c, a):
    ref = json.load(open(a.refs))
    r = ref["refs"][0]
    s = Stream(c, 0, r["prompt"], ref["max_tokens"])
    s.run()
    if s.code != grpc.StatusCode.OK or s.complete is None:
        fail(f"one: {s.code} {s.details} {s.error_message}")
    if s.ids != r["ids"]:
        fail("a new request after re-formation differs from its reference")
    if s.complete.cached_tokens < a.min_cached:
        fail(f"one: {s.complete.cached_tokens} prompt tokens from the prefix cache, want >= {a.min_cached}")
    print(f"one: a new request returns its {len(s.ids)} reference tokens "
          f"({s.complete.cached_tokens} prompt tokens cached)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", required=True)
    ap.add_argument("--stubs", required=True)
    ap.add_argument("--sampled", action="store_true", help="seeded sampling instead of greedy")
    ap.add_argument("--repetitive", action="store_true", help="prompts repeat a span (n-gram drafts)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("refs")
    p.add_argument("--out", required=True)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=120)
    p = sub.add_parser("streams")
    p.add_argument("--refs", required=True)
    p.add_argument("--kill-pid", type=int, required=True)
    p.add_argument("--killed-file", default="")
    p.add_argument("--expect", choices=["same", "unavailable"], required=True)
    p.add_argument("--within-s", type=float, default=0)
    p = sub.add_parser("info")
    p.add_argument("--ready", type=int, choices=[0, 1])
    p.add_argument("--min-replays", type=int, default=0)
    p.add_argument("--up", default="", help="ranks GetServerInfo must list as up (1,2)")
    p.add_argument("--down", default="", help="ranks it must list as down")
    p.add_argument("--min-preemptions", type=int, default=0)
    p.add_argument("--min-drafts", type=int, default=0, help="speculative drafts verified")
    p.add_argument("--min-accepted", type=int, default=0, help="draft tokens accepted")
    p = sub.add_parser("one")
    p.add_argument("--refs", required=True)
    p.add_argument("--min-cached", type=int, default=0, help="prompt tokens the prefix cache must serve")
    p = sub.add_parser("same")
    p.add_argument("a")
    p.add_argument("b")
    a = ap.parse_args()
    global REPETITIVE
    REPETITIVE = a.repetitive
    c = Client(a.addr, a.stubs, sampled=a.sampled) if a.cmd != "same" else None
    {"refs": cmd_refs, "streams": cmd_streams, "info": cmd_info, "one": cmd_one,
     "same": cmd_same}[a.cmd](c, a)


if __name__ == "__main__":
    main()
