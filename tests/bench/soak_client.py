#!/usr/bin/python3
"""Soak load for a running exl3serve (tests/bench/soak.sh): N concurrent
streams of mixed prompt / output lengths and sampling settings, back to back,
for a fixed duration, over the public gRPC API; every stream must complete
with exactly the tokens it asked for (ignore_eos), and the RSS of the given
processes is sampled every --rss-every-s seconds.

Prints a summary line and the RSS slope (least squares over the samples after
--warmup-s) in MiB per minute per process; exits 1 on any error or lost stream.
"""
import argparse
import random
import sys
import threading
import time

import grpc


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def slope(points):
    """Least-squares slope of (t, y) points, in y per second."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (y - my) for t, y in points) / den if den else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", required=True)
    ap.add_argument("--stubs", required=True)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--duration-s", type=float, default=600)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--pids", default="", help="comma-separated pids whose RSS to sample")
    ap.add_argument("--rss-every-s", type=float, default=10)
    ap.add_argument("--warmup-s", type=float, default=60)
    a = ap.parse_args()
    sys.path.insert(0, a.stubs)
    from exl3serve.v1 import generation_pb2 as pb
    from exl3serve.v1 import generation_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(a.addr, options=[("grpc.max_concurrent_streams", 1024)])
    stub = pb_grpc.GenerationStub(channel)
    stop_at = time.monotonic() + a.duration_s
    lock = threading.Lock()
    stats = {"ok": 0, "errors": 0, "lost": 0, "tokens": 0, "first_error": ""}

    def worker(index):
        rng = random.Random(index)
        n = 0
        while time.monotonic() < stop_at:
            n += 1
            req = pb.GenerateRequest(request_id=f"soak-{index}-{n}")
            req.tokenized.input_ids.extend(rng.randrange(a.vocab) for _ in range(rng.randint(1, 200)))
            sp = req.sampling_params
            want = rng.randint(1, 96)
            sp.max_tokens = want
            sp.ignore_eos = True
            kind = rng.randrange(4)
            if kind == 0:
                sp.temperature = 0.0
            else:
                sp.temperature = rng.choice([0.7, 0.8, 1.0, 1.3])
                sp.seed = rng.randrange(1 << 62)
                if kind >= 2:
                    sp.top_p, sp.top_k = rng.choice([0.8, 0.9, 0.95]), rng.choice([0, 20, 50])
                if kind == 3:
                    sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty = 1.1, 0.3, 0.2
                    sp.logprobs = True
                    sp.top_logprobs = rng.choice([0, 5])
            got, complete = 0, None
            try:
                for r in stub.Generate(req, timeout=300):
                    if r.HasField("chunk"):
                        got += len(r.chunk.token_ids)
                    elif r.HasField("complete"):
                        complete = r.complete
                    elif r.HasField("error"):
                        raise RuntimeError(f"GenerateError {r.error.code}: {r.error.message}")
                with lock:
                    if complete is None or got != want or len(complete.output_ids) != want:
                        stats["lost"] += 1
                    else:
                        stats["ok"] += 1
                        stats["tokens"] += got
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    stats["errors"] += 1
                    if not stats["first_error"]:
                        stats["first_error"] = str(e)[:300]

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(a.streams)]
    start = time.monotonic()
    for t in threads:
        t.start()
    pids = [int(p) for p in a.pids.split(",") if p]
    samples = {p: [] for p in pids}
    while time.monotonic() < stop_at:
        now = time.monotonic() - start
        for p in pids:
            v = rss_mib(p)
            if v is not None:
                samples[p].append((now, v))
        with lock:
            print(f"t={now:5.0f}s ok={stats['ok']} errors={stats['errors']} lost={stats['lost']} "
                  f"tokens={stats['tokens']} " +
                  " ".join(f"rss[{p}]={samples[p][-1][1]:.1f}MiB" for p in pids if samples[p]),
                  flush=True)
        time.sleep(a.rss_every_s)
    for t in threads:
        t.join(400)
    alive = sum(t.is_alive() for t in threads)
    elapsed = time.monotonic() - start
    print(f"soak: {a.streams} streams, {elapsed:.0f} s: {stats['ok']} requests ok, {stats['errors']} errors, "
          f"{stats['lost']} lost, {alive} hung clients, {stats['tokens']} tokens "
          f"({stats['tokens'] / elapsed:.0f} tok/s)", flush=True)
    for p in pids:
        pts = [(t, y) for t, y in samples[p] if t >= a.warmup_s]
        if pts:
            print(f"rss pid {p}: {pts[0][1]:.1f} -> {pts[-1][1]:.1f} MiB after warm-up, slope "
                  f"{slope(pts) * 60:+.3f} MiB/min over {len(pts)} samples", flush=True)
    if stats["first_error"]:
        print(f"first error: {stats['first_error']}")
    sys.exit(0 if stats["errors"] == 0 and stats["lost"] == 0 and alive == 0 else 1)


if __name__ == "__main__":
    main()
