#!/usr/bin/python3
"""A Python client of exl3serve's public gRPC API, as a test.

Run with Debian's /usr/bin/python3 (python3-grpcio, python3-protobuf) and the
stubs the build generates into BUILD/python (tests/CMakeLists.txt):

  /usr/bin/python3 tests/cli/grpc_client.py --addr 127.0.0.1:PORT --stubs BUILD/python

Checks, against a running `exl3serve serve` on a test model with peaked
logits (greedy decoding has clear margins, so batching cannot flip a token):
  structure   chunks then exactly one complete; ids, counts and request_id agree
  concurrent  N streams at once (mixed prompt lengths) each equal their run alone
  cancel      streams cancelled mid-stream end CANCELLED, the others are
              unaffected, and GetServerInfo shows every KV block free afterwards
  abort       the Abort RPC ends a live stream with FINISH_REASON_ABORT
  malformed   empty input, negative / huge max_tokens, top_p > 1, unknown stop
              token, token id outside the vocabulary, oversize prompt:
              INVALID_ARGUMENT with a message, and the server keeps serving
  health      grpc.health.v1.Health/Check says SERVING; HealthCheck (shallow, deep)
Prints one line per check; exits 1 on the first failure.
"""
import argparse
import random
import sys
import threading
import time

import grpc

TIMEOUT_S = 120  # per call; generous for a loaded CI machine


def fail(msg):
    print(f"FAIL: {msg}", flush=True)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


class Client:
    def __init__(self, addr, pb, pb_grpc):
        self.pb = pb
        self.channel = grpc.insecure_channel(addr)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def request(self, ids, max_tokens, request_id="", **sampling):
        req = self.pb.GenerateRequest(request_id=request_id)
        req.tokenized.input_ids.extend(ids)
        req.sampling_params.max_tokens = max_tokens
        req.sampling_params.ignore_eos = True
        for k, v in sampling.items():
            setattr(req.sampling_params, k, v)
        return req

    def generate(self, req):
        """Runs one stream; returns (responses, ids from chunks)."""
        responses = list(self.stub.Generate(req, timeout=TIMEOUT_S))
        ids = [t for r in responses if r.WhichOneof("response") == "chunk" for t in r.chunk.token_ids]
        return responses, ids

    def server_info(self):
        return self.stub.GetServerInfo(self.pb.GetServerInfoRequest(), timeout=TIMEOUT_S)

    def model_info(self):
        return self.stub.GetModelInfo(self.pb.GetModelInfoRequest(), timeout=TIMEOUT_S)


def check_structure(c, vocab):
    req = c.request([1, 42, 7, 311], 16, request_id="py-structure")
    responses, ids = c.generate(req)
    kinds = [r.WhichOneof("response") for r in responses]
    check(kinds and kinds[-1] == "complete", f"last message is {kinds[-1:]}, want complete")
    check(kinds.count("complete") == 1 and "error" not in kinds, f"messages: {kinds}")
    check(all(k == "chunk" for k in kinds[:-1]), f"messages before the complete: {kinds}")
    check(all(r.request_id == "py-structure" for r in responses), "request_id differs on a response")
    done = responses[-1].complete
    check(list(done.output_ids) == ids, f"complete.output_ids {list(done.output_ids)} != streamed {ids}")
    check(len(ids) == 16 and done.completion_tokens == 16, f"{len(ids)} tokens, completion_tokens {done.completion_tokens}")
    check(done.prompt_tokens == 4, f"prompt_tokens {done.prompt_tokens}")
    check(done.finish_reason == c.pb.FINISH_REASON_LENGTH, f"finish {done.finish_reason}")
    check(all(0 <= t < vocab for t in ids), "a token outside the vocabulary")
    counts = [r.chunk.completion_tokens for r in responses[:-1]]
    check(counts == sorted(counts) and counts[-1] == 16, f"chunk completion counts {counts}")
    print(f"structure: OK ({len(responses) - 1} chunks, tokens {ids[:8]}...)", flush=True)
    return ids


def run_parallel(fn, items):
    results = [None] * len(items)
    errors = []

    def run(i):
        try:
            results[i] = fn(items[i])
        except Exception as e:  # reported below, after every thread ended
            errors.append(f"{i}: {e}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        fail("; ".join(errors[:3]))
    return results


def check_concurrent(c, vocab, n, rng):
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.choice([1, 3, 8, 17, 40, 70]))] for _ in range(n)]
    gens = [rng.choice([8, 16, 32]) for _ in range(n)]
    alone = [c.generate(c.request(p, g))[1] for p, g in zip(prompts, gens)]
    together = run_parallel(lambda i: c.generate(c.request(prompts[i], gens[i]))[1], list(range(n)))
    for i in range(n):
        check(together[i] == alone[i], f"stream {i} (prompt {len(prompts[i])} tokens): concurrent {together[i]} != alone {alone[i]}")
        check(len(alone[i]) == gens[i], f"stream {i}: {len(alone[i])} tokens, want {gens[i]}")
    print(f"concurrent: OK ({n} streams, prompt lengths {sorted(len(p) for p in prompts)})", flush=True)
    return prompts, gens, alone


def wait_all_blocks_free(c, what):
    info = None
    for _ in range(200):  # each try is an RPC; the engine frees blocks at its next step
        info = c.server_info()
        if info.kv_blocks_free == info.kv_blocks_total and info.num_requests_running == 0 and info.num_requests_waiting == 0:
            return info
        time.sleep(0.05)
    fail(f"{what}: KV blocks not all free: {info.kv_blocks_free} of {info.kv_blocks_total} free, "
         f"{info.num_requests_running} running, {info.num_requests_waiting} waiting")


def check_prefix_cache(c, vocab, rng, n, expect_disk):
    """Branching multi-turn chats with a shared system prompt, n in flight:
    every turn's answer equals the same request computed without the prefix
    cache (no_prefix_cache), greedy and seeded; later turns report cached
    tokens, opted-out requests none."""
    before = c.server_info()
    if not before.prefix_cache_enabled:
        for ids, g in [([rng.randrange(3, vocab) for _ in range(40)], 4)] * 2:
            done = c.generate(c.request(ids, g))[0][-1].complete
            check(done.cached_tokens == 0, f"prefix cache off, yet cached_tokens {done.cached_tokens}")
        print("prefix cache: off on this server; cached_tokens 0", flush=True)
        return
    system = [rng.randrange(3, vocab) for _ in range(37)]
    chats = [list(system) for _ in range(n)]
    cached_total = 0
    for turn in range(4):
        if turn == 1:  # branch: half the chats continue the history of chat 0
            for i in range(1, n, 2):
                chats[i] = list(chats[0])
        for i in range(n):
            chats[i] += [rng.randrange(3, vocab) for _ in range(rng.choice([5, 9, 16]))]
        seeded = dict(temperature=0.8, seed=1000 + turn)
        reqs = [(list(h), 8, (seeded if i % 3 == 0 else {})) for i, h in enumerate(chats)]
        got = run_parallel(lambda r: c.generate(c.request(r[0], r[1], **r[2]))[0], reqs)
        for i, (ids, g, sp) in enumerate(reqs):
            uncached = c.request(ids, g, **sp)
            uncached.no_prefix_cache = True
            ref_done = c.generate(uncached)[0][-1].complete
            done = got[i][-1].complete
            check(ref_done.cached_tokens == 0, f"turn {turn} chat {i}: opted out, cached {ref_done.cached_tokens}")
            check(list(done.output_ids) == list(ref_done.output_ids),
                  f"turn {turn} chat {i}: cached {list(done.output_ids)} != computed {list(ref_done.output_ids)}")
            cached_total += done.cached_tokens
            check(done.cached_tokens < len(ids), f"turn {turn} chat {i}: cached {done.cached_tokens} of {len(ids)}")
            chats[i] = ids + list(done.output_ids)
    check(cached_total > 0, "no request reported cached tokens")
    opt_out = c.request(chats[0], 4)
    opt_out.no_prefix_cache = True
    done = c.generate(opt_out)[0][-1].complete
    check(done.cached_tokens == 0, f"no_prefix_cache request reports cached_tokens {done.cached_tokens}")
    after = wait_all_blocks_free(c, "after the prefix-cache chats")
    hits = after.prefix_cache_hits_tokens - before.prefix_cache_hits_tokens
    check(hits >= cached_total, f"server info: {hits} hit tokens < {cached_total} reported cached")
    disk = (after.prefix_cache_disk_saved_blocks - before.prefix_cache_disk_saved_blocks,
            after.prefix_cache_disk_hit_blocks - before.prefix_cache_disk_hit_blocks)
    if expect_disk:
        check(disk[0] > 0 and disk[1] > 0, f"disk tier: {disk[0]} blocks saved, {disk[1]} hit; want both > 0")
    print(f"prefix cache: OK ({n} branching chats x 4 turns equal their uncached runs; "
          f"{cached_total} tokens cached, disk {disk[0]} saved / {disk[1]} hit)", flush=True)


def check_cancel(c, vocab, rng, reference):
    prompts, gens, alone = reference
    long_prompts = [[rng.randrange(3, vocab) for _ in range(rng.choice([5, 30]))] for _ in range(6)]

    def cancelled(ids):
        call = c.stub.Generate(c.request(ids, 1000), timeout=TIMEOUT_S)
        got = 0
        for r in call:
            got += len(r.chunk.token_ids)
            if got >= 2:
                call.cancel()
                break
        try:
            for _ in call:
                pass
        except grpc.RpcError as e:
            return e.code()
        return None

    def normal(i):
        return c.generate(c.request(prompts[i], gens[i]))[1]

    jobs = [("cancel", p) for p in long_prompts] + [("normal", i) for i in range(len(prompts))]
    rng.shuffle(jobs)
    results = run_parallel(lambda job: cancelled(job[1]) if job[0] == "cancel" else normal(job[1]), jobs)
    for (kind, arg), result in zip(jobs, results):
        if kind == "cancel":
            check(result == grpc.StatusCode.CANCELLED, f"cancelled stream ended {result}, want CANCELLED")
        else:
            check(result == alone[arg], f"stream {arg} beside cancelled ones: {result} != alone {alone[arg]}")
    info = wait_all_blocks_free(c, "after cancelling")
    print(f"cancel: OK ({len(long_prompts)} cancelled mid-stream, {len(prompts)} unaffected, "
          f"{info.kv_blocks_free}/{info.kv_blocks_total} KV blocks free)", flush=True)


def check_abort(c, vocab):
    call = c.stub.Generate(c.request([5, 6, 7], 1000, request_id="py-abort"), timeout=TIMEOUT_S)
    responses = []
    for r in call:
        responses.append(r)
        if len(responses) == 1:
            n = c.stub.Abort(c.pb.AbortRequest(request_ids=["py-abort", "no-such-request"], reason="test"), timeout=TIMEOUT_S).aborted
            check(n == 1, f"Abort says {n} live requests, want 1")
    last = responses[-1]
    check(last.WhichOneof("response") == "complete", f"aborted stream ended with {last.WhichOneof('response')}")
    check(last.complete.finish_reason == c.pb.FINISH_REASON_ABORT, f"finish {last.complete.finish_reason}, want ABORT")
    wait_all_blocks_free(c, "after Abort")
    print(f"abort: OK (stream ended ABORT after {last.complete.completion_tokens} tokens)", flush=True)


def check_malformed(c, vocab, max_context):
    pb = c.pb
    cases = []
    cases.append(("empty input", pb.GenerateRequest()))
    cases.append(("empty token ids", c.request([], 8)))
    cases.append(("empty text", pb.GenerateRequest(text="")))
    cases.append(("negative max_tokens", c.request([1, 2], -5)))
    cases.append(("huge max_tokens", c.request([1, 2], 2**31 - 1)))
    cases.append(("top_p > 1", c.request([1, 2], 8, top_p=1.5)))
    cases.append(("negative temperature", c.request([1, 2], 8, temperature=-1.0)))
    r = c.request([1, 2], 8)
    r.sampling_params.stop_token_ids.append(vocab + 5)
    cases.append(("unknown stop token", r))
    cases.append(("token id outside the vocabulary", c.request([1, vocab + 1], 8)))
    cases.append(("oversize prompt", c.request([3] * (max_context + 1), 8)))
    for name, req in cases:
        try:
            responses = list(c.stub.Generate(req, timeout=TIMEOUT_S))
            fail(f"{name}: accepted ({len(responses)} responses), want INVALID_ARGUMENT")
        except grpc.RpcError as e:
            check(e.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {e.code()} {e.details()!r}, want INVALID_ARGUMENT")
            check(e.details(), f"{name}: INVALID_ARGUMENT without a message")
            print(f"  {name}: INVALID_ARGUMENT: {e.details()}", flush=True)
    # Still serving.
    _, ids = c.generate(c.request([1, 42, 7, 311], 4))
    check(len(ids) == 4, "the server no longer generates after the malformed requests")
    print(f"malformed: OK ({len(cases)} requests rejected)", flush=True)


def check_health(c):
    # grpc.health.v1 by hand (a generated grpc/health package would shadow
    # grpcio's own `grpc` package): HealthCheckRequest{service=""} is empty;
    # HealthCheckResponse{status=SERVING} is field 1, varint 1: b"\x08\x01".
    check_rpc = c.channel.unary_unary("/grpc.health.v1.Health/Check",
                                      request_serializer=lambda b: b, response_deserializer=lambda b: b)
    raw = check_rpc(b"", timeout=TIMEOUT_S)
    check(raw == b"\x08\x01", f"grpc.health.v1 Check returned {raw!r}, want SERVING (b'\\x08\\x01')")
    svc = b"exl3serve.v1.Generation"
    raw = check_rpc(b"\x0a" + bytes([len(svc)]) + svc, timeout=TIMEOUT_S)
    check(raw == b"\x08\x01", f"grpc.health.v1 Check(exl3serve.v1.Generation) returned {raw!r}")
    shallow = c.stub.HealthCheck(c.pb.HealthCheckRequest(deep=False), timeout=TIMEOUT_S)
    check(shallow.healthy, f"HealthCheck: {shallow.message}")
    deep = c.stub.HealthCheck(c.pb.HealthCheckRequest(deep=True), timeout=TIMEOUT_S)
    check(deep.healthy, f"deep HealthCheck: {deep.message}")
    print(f"health: OK (grpc.health.v1 SERVING; deep: {deep.message})", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--addr", required=True)
    ap.add_argument("--stubs", required=True, help="directory with exl3serve/v1/generation_pb2*.py")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--expect-disk-tier", action="store_true",
                    help="the server's pool is too small for the chats: blocks go to disk and come back")
    args = ap.parse_args()
    sys.path.insert(0, args.stubs)
    from exl3serve.v1 import generation_pb2 as pb
    from exl3serve.v1 import generation_pb2_grpc as pb_grpc

    c = Client(args.addr, pb, pb_grpc)
    model = c.model_info()
    vocab, max_context = model.vocab_size, model.max_context_tokens
    check(vocab > 0 and max_context > 0, f"GetModelInfo: vocab {vocab}, max context {max_context}")
    print(f"model: {model.architecture}, vocab {vocab}, max context {max_context}; "
          f"server: tp {c.server_info().tensor_parallel_size}", flush=True)
    rng = random.Random(args.seed)
    check_health(c)
    check_structure(c, vocab)
    reference = check_concurrent(c, vocab, args.concurrency, rng)
    check_prefix_cache(c, vocab, rng, args.concurrency, args.expect_disk_tier)
    check_cancel(c, vocab, rng, reference)
    check_abort(c, vocab)
    check_malformed(c, vocab, max_context)
    wait_all_blocks_free(c, "at the end")
    print("grpc_client.py: OK", flush=True)


if __name__ == "__main__":
    main()
