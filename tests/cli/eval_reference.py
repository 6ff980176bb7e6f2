#!/usr/bin/python3
"""Independent float64 reference for `exl3serve eval` (tests/cli/eval_test.sh):
the perplexity of a llama2.c checkpoint over sliding windows of a token stream,
computed with NumPy straight from the llama2.c file layout (stories260K README):
RMSNorm (eps 1e-5), RoPE on adjacent pairs (2i, 2i+1) with theta 10000, causal
GQA attention, SiLU-gated MLP, tied classifier.

  eval_reference.py MODEL.bin IDS.json CONTEXT STRIDE   -> prints the perplexity
  eval_reference.py --greedy MODEL.bin 1,403,407 N      -> N greedy ids after the prompt
"""
import json
import struct
import sys

import numpy as np


def load(path):
    raw = open(path, "rb").read()
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = struct.unpack_from("<7i", raw, 0)
    shared = vocab > 0
    vocab = abs(vocab)
    f = np.frombuffer(raw, dtype="<f4", offset=28).astype(np.float64)
    hd = dim // heads
    kv_dim = kv_heads * hd
    at = 0

    def take(*shape):
        nonlocal at
        n = int(np.prod(shape))
        out = f[at:at + n].reshape(shape)
        at += n
        return out

    w = {"emb": take(vocab, dim), "att_norm": take(layers, dim), "wq": take(layers, dim, dim),
         "wk": take(layers, kv_dim, dim), "wv": take(layers, kv_dim, dim), "wo": take(layers, dim, dim),
         "ffn_norm": take(layers, dim), "w1": take(layers, hidden, dim), "w2": take(layers, dim, hidden),
         "w3": take(layers, hidden, dim), "final_norm": take(dim)}
    take(seq_len, hd // 2)
    take(seq_len, hd // 2)
    w["cls"] = w["emb"] if shared else take(vocab, dim)
    return w, dict(dim=dim, layers=layers, heads=heads, kv_heads=kv_heads, hd=hd)


def rmsnorm(x, g):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * g


def rope(x, hd):  # x [T, H, hd], adjacent pairs
    T = x.shape[0]
    i = np.arange(hd // 2)
    freq = 10000.0 ** (-2.0 * i / hd)
    ang = np.arange(T)[:, None] * freq[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def logits(w, cfg, ids):
    T = len(ids)
    H, KH, hd = cfg["heads"], cfg["kv_heads"], cfg["hd"]
    x = w["emb"][ids]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(cfg["layers"]):
        a = rmsnorm(x, w["att_norm"][l])
        q = rope((a @ w["wq"][l].T).reshape(T, H, hd), hd)
        k = rope((a @ w["wk"][l].T).reshape(T, KH, hd), hd)
        v = (a @ w["wv"][l].T).reshape(T, KH, hd)
        rep = H // KH
        k = np.repeat(k, rep, axis=1)
        v = np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask[None]
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, v).reshape(T, H * hd)
        x = x + o @ w["wo"][l].T
        m = rmsnorm(x, w["ffn_norm"][l])
        g = m @ w["w1"][l].T
        x = x + ((g / (1 + np.exp(-g))) * (m @ w["w3"][l].T)) @ w["w2"][l].T
    return rmsnorm(x, w["final_norm"]) @ w["cls"].T


def greedy(path, prompt, n):
    w, cfg = load(path)
    ids = [int(t) for t in prompt.split(",")]
    out = []
    for _ in range(n):
        z = logits(w, cfg, ids)[-1]
        nxt = int(np.argmax(z))  # lowest id on ties, as the engine
        out.append(nxt)
        ids.append(nxt)
    print(" ".join(map(str, out)))


def main():
    if sys.argv[1] == "--greedy":
        greedy(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    w, cfg = load(sys.argv[1])
    ids = json.load(open(sys.argv[2]))
    context, stride = int(sys.argv[3]), int(sys.argv[4])
    n = len(ids)
    nll, scored, prev_end, begin = 0.0, 0, 1, 0
    while prev_end < n:
        end = min(begin + context, n)
        if end <= prev_end:
            break
        z = logits(w, cfg, ids[begin:end])
        z = z - z.max(-1, keepdims=True)
        lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        for t in range(prev_end, end):  # absolute target positions
            nll -= lp[t - 1 - begin, ids[t]]
            scored += 1
        prev_end = end
        begin += stride
    print(f"{np.exp(nll / scored):.8f} {scored}")


if __name__ == "__main__":
    main()
