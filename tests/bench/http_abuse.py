#!/usr/bin/env python3
"""http_abuse.py: the hostile HTTP traffic of issue 41 against a running
server's OpenAI API, on raw sockets, for the soak's abuse phase: deep JSON in
every field (10^3..10^5), 8 MiB bodies, chunked bodies over the limit, bodies
to EOF, GET with bodies, pipelined requests, slow clients, bursts of
connects, Range on /metrics. Bounded in count and time; loopback only.
Prints what each probe got and exits non-zero when the server stopped
answering /health.

  http_abuse.py --port PORT [--rounds 3] [--streams 16] [--light]

--streams N: N SSE completions generate while the burst of 300 connects;
each must end with [DONE]. --light: no 8 MiB body (for CI). Exits non-zero
when /health stops answering, the burst is not answered 300/300 within 5 s,
or a stream fails.
"""
import argparse
import socket
import sys
import threading
import time


def exchange(port, data, timeout=10.0, half_close=False):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        try:
            s.sendall(data)
        except OSError:
            pass
        if half_close:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            try:
                b = s.recv(65536)
            except OSError:
                break
            if not b:
                break
            out += b
        return out
    finally:
        s.close()


def status(raw):
    try:
        return int(raw.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


def post(path, body, extra=b""):
    return (b"POST " + path + b" HTTP/1.1\r\nHost: a\r\nConnection: close\r\n" + extra +
            b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def nested(depth):
    return b"[" * depth + b"]" * depth


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=0)
    ap.add_argument("--light", action="store_true")
    a = ap.parse_args()
    failed = []
    port = a.port
    user = b'"messages":[{"role":"user","content":"hi"}]'
    seen = {}

    def note(name, st):
        seen.setdefault(name, {}).setdefault(st, 0)
        seen[name][st] += 1

    for _ in range(a.rounds):
        for depth in (1000, 10000, 100000):
            v = nested(depth)
            note("deep chat_template_kwargs", status(exchange(port, post(
                b"/v1/chat/completions", b"{" + user + b',"chat_template_kwargs":{"a":' + v + b"}}"))))
            note("deep tool parameters", status(exchange(port, post(
                b"/v1/chat/completions",
                b"{" + user + b',"tools":[{"type":"function","function":{"name":"f","parameters":{"a":' + v +
                b"}}}]}"))))
            note("deep guided_json", status(exchange(port, post(
                b"/v1/completions", b'{"prompt":"x","guided_json":{"a":' + v + b"}}"))))
        if not a.light:
            big = b'{"prompt":"' + b"x" * (8 * 1024 * 1024 - 40) + b'","max_tokens":1}'
            note("8 MiB body", status(exchange(port, post(b"/v1/completions", big), timeout=60)))
        chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n" +
                   (b"100000\r\n" + b"x" * 0x100000 + b"\r\n") * 12 + b"0\r\n\r\n")
        note("12 MiB chunked", status(exchange(port, chunked, timeout=30)))
        note("body to EOF", status(exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: a\r\n\r\n" + b"x" * 100000,
                                            half_close=True)))
        note("GET with a body", status(exchange(port, b"GET /health HTTP/1.1\r\nHost: a\r\nContent-Length: 36\r\n\r\n"
                                                      b"GET /v1/models HTTP/1.1\r\nHost: a\r\n\r\n")))
        note("Content-Length -1", status(exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: a\r\n"
                                                        b"Content-Length: -1\r\n\r\n")))
        raw = exchange(port, b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n" * 2 +
                       b"GET /health HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        note("3 pipelined", raw.count(b"HTTP/1.1 200"))
        ranges = b"bytes=0-1" + b",0-100000" * 1000
        raw = exchange(port, b"GET /metrics HTTP/1.1\r\nHost: a\r\nConnection: close\r\nRange: " + ranges + b"\r\n\r\n")
        note("Range x1000 bytes", len(raw) // 1024 * 1024)
        # Slow clients: 8 of them dribble a head for 3 s while a burst of 300 connects.
        slow = []
        for _ in range(8):
            s = socket.create_connection(("127.0.0.1", port))
            slow.append(s)
        results = []

        def one():
            t = time.time()
            try:
                st = status(exchange(port, b"GET /health HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
                                     timeout=10))
            except OSError:
                st = 0
            results.append((st, time.time() - t))
        streams_done = []

        def stream():
            body = b'{"prompt":"Once upon a time","max_tokens":400,"ignore_eos":true,"temperature":0,"stream":true}'
            raw = exchange(port, post(b"/v1/completions", body), timeout=120)
            streams_done.append(status(raw) == 200 and b"data: [DONE]" in raw)
        stream_threads = [threading.Thread(target=stream) for _ in range(a.streams)]
        for t in stream_threads:
            t.start()
        threads = [threading.Thread(target=one) for _ in range(300)]
        t0 = time.time()
        for t in threads:
            t.start()
        for i in range(15):
            for s in slow:
                try:
                    s.send(b"GET /health HTTP/1.1\r\n"[i % 22:i % 22 + 1])
                except OSError:
                    pass
            time.sleep(0.2)
        for t in threads:
            t.join()
        answered = sum(1 for st, dt in results if st == 200 and dt < 5.0)
        note("burst of 300: answered 200 within 5 s", answered)
        note("burst of 300: slowest answer (s)", round(max(dt for _, dt in results), 1))
        for t in stream_threads:
            t.join()
        if a.streams:
            note(f"{a.streams} streams during the burst: ended with [DONE]", sum(streams_done))
            if sum(streams_done) != a.streams:
                failed.append(f"{a.streams - sum(streams_done)} streams failed")
        if answered != 300:
            failed.append(f"the burst: {answered} of 300 answered 200 within 5 s")
        for s in slow:
            s.close()
    for name, counts in seen.items():
        print(f"http_abuse: {name}: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    alive = status(exchange(port, b"GET /health HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"))
    print(f"http_abuse: /health after the abuse: {alive}")
    if alive != 200:
        failed.append("/health stopped answering")
    for f in failed:
        print(f"http_abuse: FAIL: {f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
