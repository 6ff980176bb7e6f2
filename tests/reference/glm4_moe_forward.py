#!/usr/bin/python3
"""An independent float64 NumPy reference forward of Glm4MoeForCausalLM
(GLM-4.5/4.6/4.7), written from the published transformers definition
(models/glm4_moe/modeling_glm4_moe.py: Glm4MoeAttention, Glm4MoeMoE,
Glm4MoeTopkRouter, Glm4MoeRotaryEmbedding) and ../shared/docs/architectures.md
section 1, reading the HF safetensors directly (no exl3serve code).

  glm4_moe_forward.py MODEL_DIR 1,2,3 N [--ablate WHAT] > out.json

prints {"ids": [N greedy ids after the prompt], "logits": [[vocab] x N]}:
row i holds the logits after prompt + ids[:i] (what `exl3serve generate
--logits-out` writes), computed by a full causal forward each step (no cache).

--ablate drops one feature (to show a test comparing against this reference
fails without it): correction_bias (select on the unbiased scores), groups
(no group limit), partial_rotary (rotate the whole head), qk_norm, bias
(no q/k/v bias), shared_expert, scaling (routed_scaling_factor 1).
"""
import json
import struct
import sys

import numpy as np


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
            a = np.frombuffer(buf, dtype="<f2")
        elif t["dtype"] == "F32":
            a = np.frombuffer(buf, dtype="<f4")
        else:
            raise SystemExit(f"unsupported dtype {t['dtype']} for {name}")
        out[name] = a.astype(np.float64).reshape(t["shape"])
    return out


def rms_norm(x, w, eps):
    # Glm4MoeRMSNorm: x * rsqrt(mean(x^2) + eps) * weight, over the last axis.
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate((-x[..., half:], x[..., :half]), axis=-1)


def silu(x):
    return x / (1.0 + np.exp(-x))


class Glm4Moe:
    def __init__(self, model_dir, ablate):
        self.cfg = cfg = json.load(open(f"{model_dir}/config.json"))
        assert cfg["architectures"][0] == "Glm4MoeForCausalLM", cfg["architectures"]
        self.w = load_safetensors(f"{model_dir}/model.safetensors")
        self.ablate = ablate
        self.hidden = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or self.hidden // self.heads
        self.eps = cfg["rms_norm_eps"]
        self.layers = cfg["num_hidden_layers"]
        factor = 1.0 if ablate == "partial_rotary" else cfg.get("partial_rotary_factor", 1.0)
        self.rotary_dim = int(self.head_dim * factor)
        self.theta = cfg["rope_theta"]
        self.qk_norm = cfg.get("use_qk_norm", False) and ablate != "qk_norm"
        self.experts = cfg["n_routed_experts"]
        self.top_k = cfg["num_experts_per_tok"]
        self.n_group = 1 if ablate == "groups" else cfg["n_group"]
        self.topk_group = 1 if ablate == "groups" else cfg["topk_group"]
        self.norm_topk = cfg["norm_topk_prob"]
        self.scale = 1.0 if ablate == "scaling" else cfg["routed_scaling_factor"]
        self.first_dense = cfg["first_k_dense_replace"]

    def mlp(self, p, x):
        w = self.w
        g = x @ w[p + "gate_proj.weight"].T
        u = x @ w[p + "up_proj.weight"].T
        return (silu(g) * u) @ w[p + "down_proj.weight"].T

    def route(self, p, x):
        """Glm4MoeTopkRouter + Glm4MoeMoE.route_tokens_to_experts."""
        scores = 1.0 / (1.0 + np.exp(-(x @ self.w[p + "gate.weight"].T)))  # [T, E]
        bias = self.w[p + "gate.e_score_correction_bias"]
        if self.ablate == "correction_bias":
            bias = np.zeros_like(bias)
        choice = scores + bias[None, :]
        T = x.shape[0]
        per_group = self.experts // self.n_group
        grouped = choice.reshape(T, self.n_group, per_group)
        group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1) if per_group >= 2 else grouped[..., 0]
        idx = np.empty((T, self.top_k), dtype=np.int64)
        for t in range(T):
            keep = np.argsort(-group_scores[t], kind="stable")[: self.topk_group]
            mask = np.zeros(self.n_group, dtype=bool)
            mask[keep] = True
            masked = np.where(np.repeat(mask, per_group), choice[t], 0.0)  # masked_fill(.., 0.0)
            idx[t] = np.argsort(-masked, kind="stable")[: self.top_k]
        weights = np.take_along_axis(scores, idx, axis=1)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return idx, weights * self.scale

    def moe(self, p, x):
        idx, weights = self.route(p, x)
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(self.top_k):
                e = idx[t, j]
                out[t] += weights[t, j] * self.mlp(f"{p}experts.{e}.", x[t:t + 1])[0]
        if self.ablate != "shared_expert":
            out += self.mlp(p + "shared_experts.", x)
        return out

    def forward(self, ids):
        w, hd = self.w, self.head_dim
        T = len(ids)
        h = w["model.embed_tokens.weight"][ids]
        inv_freq = 1.0 / (self.theta ** (np.arange(0, self.rotary_dim, 2, dtype=np.float64) / self.rotary_dim))
        ang = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]
        emb = np.concatenate((ang, ang), axis=-1)
        cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
        mask = np.triu(np.full((T, T), -np.inf), 1)
        group = self.heads // self.kv_heads
        r = self.rotary_dim
        for layer in range(self.layers):
            p = f"model.layers.{layer}."
            x = rms_norm(h, w[p + "input_layernorm.weight"], self.eps)
            proj = {}
            for name, n in (("q", self.heads), ("k", self.kv_heads), ("v", self.kv_heads)):
                y = x @ w[f"{p}self_attn.{name}_proj.weight"].T
                if self.ablate != "bias":
                    y = y + w.get(f"{p}self_attn.{name}_proj.bias", 0.0)
                proj[name] = y.reshape(T, n, hd)
            q, k, v = proj["q"], proj["k"], proj["v"]
            if self.qk_norm:
                q = rms_norm(q, w[p + "self_attn.q_norm.weight"], self.eps)
                k = rms_norm(k, w[p + "self_attn.k_norm.weight"], self.eps)
            # apply_rotary_pos_emb: only the first rotary_dim dims rotate.
            q = np.concatenate((q[..., :r] * cos + rotate_half(q[..., :r]) * sin, q[..., r:]), axis=-1)
            k = np.concatenate((k[..., :r] * cos + rotate_half(k[..., :r]) * sin, k[..., r:]), axis=-1)
            k = np.repeat(k, group, axis=1)
            v = np.repeat(v, group, axis=1)
            scores = np.einsum("thd,shd->hts", q, k) * hd ** -0.5 + mask
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            probs = scores / scores.sum(-1, keepdims=True)
            attn = np.einsum("hts,shd->thd", probs, v).reshape(T, -1)
            h = h + attn @ w[p + "self_attn.o_proj.weight"].T
            x = rms_norm(h, w[p + "post_attention_layernorm.weight"], self.eps)
            h = h + (self.mlp(p + "mlp.", x) if layer < self.first_dense else self.moe(p + "mlp.", x))
        h = rms_norm(h, w["model.norm.weight"], self.eps)
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return h[-1] @ head.T


def main():
    args = sys.argv[1:]
    ablate = None
    if "--ablate" in args:
        i = args.index("--ablate")
        ablate = args[i + 1]
        del args[i:i + 2]
    model_dir, ids_text, steps = args[0], args[1], int(args[2])
    model = Glm4Moe(model_dir, ablate)
    ids = [int(t) for t in ids_text.split(",")]
    out_ids, rows = [], []
    for _ in range(steps):
        logits = model.forward(ids + out_ids)
        rows.append(logits.tolist())
        out_ids.append(int(np.argmax(logits)))
    json.dump({"ids": out_ids, "logits": rows}, sys.stdout)


if __name__ == "__main__":
    main()
