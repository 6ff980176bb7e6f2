#!/usr/bin/python3
"""An independent fp32 reference forward written with PyTorch (Debian's
python3-torch) from the published Llama / Qwen3 model equations, reading the
HF safetensors directly (no exl3serve code). Prints the logits of the last
prompt position as JSON.

usage: torch_forward.py MODEL_DIR ID,ID,...
"""
import json
import struct
import sys

import numpy as np
import torch


def load_safetensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        buf = raw[base + b:base + e]
        if t["dtype"] == "BF16":
            a = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif t["dtype"] == "F16":
            a = np.frombuffer(buf, dtype="<f2").astype(np.float32)
        elif t["dtype"] == "F32":
            a = np.frombuffer(buf, dtype="<f4")
        else:
            raise SystemExit(f"unsupported dtype {t['dtype']} for {name}")
        out[name] = torch.from_numpy(a.reshape(t["shape"]).copy())
    return out


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def main():
    model_dir, ids_text = sys.argv[1], sys.argv[2]
    ids = [int(t) for t in ids_text.split(",")]
    cfg = json.load(open(f"{model_dir}/config.json"))
    w = load_safetensors(f"{model_dir}/model.safetensors")
    arch = cfg["architectures"][0]
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim", hidden // heads)
    eps = cfg.get("rms_norm_eps", 1e-6)
    theta = cfg.get("rope_theta", 10000.0)
    qk_norm = arch == "Qwen3ForCausalLM"
    if arch not in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        raise SystemExit(f"reference covers Llama and Qwen3, not {arch}")
    T = len(ids)
    h = w["model.embed_tokens.weight"][ids]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cat((ang.cos(), ang.cos()), -1).float()[:, None, :]
    sin = torch.cat((ang.sin(), ang.sin()), -1).float()[:, None, :]
    mask = torch.full((T, T), float("-inf")).triu(1)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(T, heads, head_dim)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(T, kv_heads, head_dim)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(T, kv_heads, head_dim)
        if qk_norm:
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        group = heads // kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) / (head_dim ** 0.5) + mask
        attn = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v).reshape(T, -1)
        h = h + attn @ w[p + "self_attn.o_proj.weight"].T
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        gate = x @ w[p + "mlp.gate_proj.weight"].T
        up = x @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    h = rms_norm(h, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    logits = h[-1] @ head.T
    print(json.dumps(logits.tolist()))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
