#!/usr/bin/python3
"""The client side of tests/cli/drain_test.sh: SIGTERM during 16 streams.

  drain_client.py --addr HOST:PORT --stubs BUILD/python --server-pid PID
                  [--streams 16] [--max-tokens N]

Starts --streams greedy Generate calls at once; once every stream has its
first chunk, sends SIGTERM to the server. Then, while streams are still in
flight: a new Generate must end UNAVAILABLE ("draining"), grpc.health.v1
must say NOT_SERVING for "" and exl3serve.v1.Generation and SERVING for
"liveness". Finally every stream must complete normally with --max-tokens
tokens. Prints one line per check; exits 1 on the first failure.
"""
import argparse
import os
import signal
import sys
import threading
import time

import grpc

CALL_TIMEOUT_S = 120


def fail(msg):
    print(f"FAIL: {msg}", flush=True)
    sys.exit(1)


def health(channel, service):
    """grpc.health.v1.Health/Check without generated stubs: the request is
    field 1 (string), the response field 1 (enum: 1 SERVING, 2 NOT_SERVING)."""
    name = service.encode()
    check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                request_serializer=lambda s: s,
                                response_deserializer=lambda b: b)
    reply = check(b"\x0a" + bytes([len(name)]) + name, timeout=10)
    status = reply[1] if len(reply) >= 2 and reply[0] == 0x08 else 0
    return {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}.get(status, str(status))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", required=True)
    ap.add_argument("--stubs", required=True)
    ap.add_argument("--server-pid", type=int, required=True)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=200)
    a = ap.parse_args()
    sys.path.insert(0, a.stubs)
    from exl3serve.v1 import generation_pb2 as pb
    from exl3serve.v1 import generation_pb2_grpc as pb_grpc
    channel = grpc.insecure_channel(a.addr)
    stub = pb_grpc.GenerationStub(channel)

    def request(i):
        req = pb.GenerateRequest(request_id=f"drain-{i}-{time.time_ns()}")
        req.tokenized.input_ids.extend([1 + (i * 37 + j * 11) % 997 for j in range(3 + i % 7)])
        req.sampling_params.max_tokens = a.max_tokens
        req.sampling_params.temperature = 0.0
        req.sampling_params.ignore_eos = True
        return req

    class Stream:
        def __init__(self, i):
            self.i, self.ids, self.complete, self.code, self.details = i, [], None, None, ""
            self.first, self.ended_at = threading.Event(), None
            self.thread = threading.Thread(target=self.run, daemon=True)

        def run(self):
            try:
                for r in stub.Generate(request(self.i), timeout=CALL_TIMEOUT_S):
                    kind = r.WhichOneof("response")
                    if kind == "chunk":
                        self.ids.extend(r.chunk.token_ids)
                        self.first.set()
                    elif kind == "complete":
                        self.complete = r.complete
                self.code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                self.code, self.details = e.code(), e.details()
            finally:
                self.ended_at = time.monotonic()
                self.first.set()

    if health(channel, "") != "SERVING":
        fail("the server is not SERVING before the test")
    streams = [Stream(i) for i in range(a.streams)]
    for s in streams:
        s.thread.start()
    for s in streams:
        if not s.first.wait(60):
            fail(f"stream {s.i}: no first chunk in 60 s")
    if any(s.ended_at is not None for s in streams):
        fail("a stream ended before SIGTERM: make them longer (--max-tokens)")
    os.kill(a.server_pid, signal.SIGTERM)
    term_at = time.monotonic()
    print(f"drain: all {len(streams)} streams have their first chunk; SIGTERM pid {a.server_pid}",
          flush=True)
    # The drain has begun once health says NOT_SERVING (the server polls its
    # signal pipe); a fixed sleep here raced with short streams: at tp=2 they
    # had all ended and the server exited before the probe (CANCELLED).
    deadline = time.monotonic() + 10
    while health(channel, "") == "SERVING":
        if time.monotonic() > deadline:
            fail("health still SERVING 10 s after SIGTERM")

    try:
        for _ in stub.Generate(request(999), timeout=10):
            pass
        fail("a new Generate after SIGTERM was admitted")
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNAVAILABLE or "draining" not in (e.details() or ""):
            fail(f"a new Generate after SIGTERM ended {e.code()} {e.details()!r}, want UNAVAILABLE draining")
        refused_at = time.monotonic()
        print(f"drain: a new Generate is refused: UNAVAILABLE {e.details()!r}", flush=True)
    states = {svc: health(channel, svc) for svc in ("", "exl3serve.v1.Generation", "liveness")}
    want = {"": "NOT_SERVING", "exl3serve.v1.Generation": "NOT_SERVING", "liveness": "SERVING"}
    if states != want:
        fail(f"grpc.health.v1 while draining: {states}, want {want}")
    running = sum(1 for s in streams if s.ended_at is None or s.ended_at > refused_at)
    if running == 0:
        fail("every stream had ended before the refusal was seen: make them longer")
    print(f"drain: health while draining {states}; {running} streams still in flight", flush=True)

    for s in streams:
        s.thread.join(CALL_TIMEOUT_S + 10)
        if s.code != grpc.StatusCode.OK or s.complete is None:
            fail(f"stream {s.i}: ended {s.code} {s.details!r}, want a normal completion")
        if len(s.ids) != a.max_tokens or list(s.complete.output_ids) != s.ids:
            fail(f"stream {s.i}: {len(s.ids)} tokens, want {a.max_tokens}")
    took = max(s.ended_at for s in streams) - term_at
    print(f"drain: all {len(streams)} streams completed with {a.max_tokens} tokens, "
          f"the last {took:.1f} s after SIGTERM", flush=True)


if __name__ == "__main__":
    main()
