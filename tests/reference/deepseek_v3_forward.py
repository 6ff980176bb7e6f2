#!/usr/bin/python3
"""An independent float64 NumPy reference forward of DeepseekV3ForCausalLM
(DeepSeek-V3/R1, Kimi K2), written from the published transformers definition
(models/deepseek_v3/modeling_deepseek_v3.py: DeepseekV3Attention in its naive
form — k and v decompressed through kv_b_proj, ordinary multi-head attention —
DeepseekV3RotaryEmbedding with _compute_yarn_parameters,
apply_rotary_pos_emb_interleave, DeepseekV3TopkRouter, DeepseekV3MoE) and
../shared/docs/architectures.md section 2, reading the HF safetensors
directly (no exl3serve code, no absorbed form, no latent cache).

  deepseek_v3_forward.py MODEL_DIR 1,2,3 N [--ablate WHAT] > out.json

prints {"ids": [N greedy ids after the prompt], "logits": [[vocab] x N]}:
row i holds the logits after prompt + ids[:i] (what `exl3serve generate
--logits-out` writes), computed by a full causal forward each step.

--ablate drops one feature (to show a test comparing against this reference
fails without it): yarn (plain RoPE frequencies), rope_mscale (no cos/sin
attention factor), softmax_mscale (softmax scale (n+r)^-0.5 only),
interleave (rotate-half on the rope dims as stored, no de-interleave),
q_a_norm, kv_a_norm, correction_bias, groups, shared_expert, scaling
(routed_scaling_factor 1).
"""
import json
import math
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
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate((-x[..., half:], x[..., :half]), axis=-1)


def silu(x):
    return x / (1.0 + np.exp(-x))


def yarn_get_mscale(scale, mscale=1.0):
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


class DeepseekV3:
    def __init__(self, model_dir, ablate):
        self.cfg = cfg = json.load(open(f"{model_dir}/config.json"))
        assert cfg["architectures"][0] == "DeepseekV3ForCausalLM", cfg["architectures"]
        self.w = load_safetensors(f"{model_dir}/model.safetensors")
        self.ablate = ablate
        self.heads = cfg["num_attention_heads"]
        self.q_lora = cfg["q_lora_rank"]
        self.kv_lora = cfg["kv_lora_rank"]
        self.nope = cfg["qk_nope_head_dim"]
        self.rope = cfg["qk_rope_head_dim"]
        self.v = cfg["v_head_dim"]
        self.eps = cfg["rms_norm_eps"]
        self.layers = cfg["num_hidden_layers"]
        self.experts = cfg["n_routed_experts"]
        self.top_k = cfg["num_experts_per_tok"]
        self.n_group = 1 if ablate == "groups" else cfg["n_group"]
        self.topk_group = 1 if ablate == "groups" else cfg["topk_group"]
        self.norm_topk = cfg["norm_topk_prob"]
        self.scale = 1.0 if ablate == "scaling" else cfg["routed_scaling_factor"]
        self.first_dense = cfg["first_k_dense_replace"]
        self.inv_freq, self.attention_factor = self.rope_parameters()
        # DeepseekV3Attention.__init__: softmax scale with mscale_all_dim.
        self.softmax_scale = (self.nope + self.rope) ** -0.5
        rs = cfg.get("rope_scaling")
        if rs is not None and ablate != "softmax_mscale":
            mscale_all_dim = rs.get("mscale_all_dim", 0)
            if mscale_all_dim:
                m = yarn_get_mscale(rs["factor"], mscale_all_dim)
                self.softmax_scale *= m * m

    def rope_parameters(self):
        """_compute_default_rope_parameters / _compute_yarn_parameters."""
        cfg, dim = self.cfg, self.rope
        base = cfg["rope_theta"]
        pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        rs = cfg.get("rope_scaling")
        if rs is None or self.ablate == "yarn":
            return 1.0 / pos_freqs, 1.0
        assert rs.get("type", rs.get("rope_type")) == "yarn", rs
        factor = rs["factor"]
        if "original_max_position_embeddings" in rs:
            original = rs["original_max_position_embeddings"]
            factor = cfg["max_position_embeddings"] / original
        else:
            original = cfg["max_position_embeddings"]
        mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
        if self.ablate == "rope_mscale":
            attention_factor = 1.0
        beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

        def correction_dim(rotations):
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation_factor = 1 - ramp
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
        return inv_freq, attention_factor

    def mlp(self, p, x):
        w = self.w
        g = x @ w[p + "gate_proj.weight"].T
        u = x @ w[p + "up_proj.weight"].T
        return (silu(g) * u) @ w[p + "down_proj.weight"].T

    def route(self, p, x):
        """DeepseekV3TopkRouter + DeepseekV3MoE.route_tokens_to_experts."""
        scores = 1.0 / (1.0 + np.exp(-(x @ self.w[p + "gate.weight"].T)))
        bias = self.w[p + "gate.e_score_correction_bias"]
        if self.ablate == "correction_bias":
            bias = np.zeros_like(bias)
        choice = scores + bias[None, :]
        T = x.shape[0]
        per_group = self.experts // self.n_group
        grouped = choice.reshape(T, self.n_group, per_group)
        group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
        idx = np.empty((T, self.top_k), dtype=np.int64)
        for t in range(T):
            keep = np.argsort(-group_scores[t], kind="stable")[: self.topk_group]
            mask = np.zeros(self.n_group, dtype=bool)
            mask[keep] = True
            masked = np.where(np.repeat(mask, per_group), choice[t], 0.0)
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
                out[t] += weights[t, j] * self.mlp(f"{p}experts.{idx[t, j]}.", x[t:t + 1])[0]
        if self.ablate != "shared_expert":
            out += self.mlp(p + "shared_experts.", x)
        return out

    def apply_rope(self, x, cos, sin):
        """apply_rotary_pos_emb_interleave on x [..., T, rope] (heads first)."""
        if self.ablate != "interleave":
            shape = x.shape
            x = x.reshape(*shape[:-1], shape[-1] // 2, 2).swapaxes(-1, -2).reshape(shape)
        return x * cos + rotate_half(x) * sin

    def attention(self, p, x, cos, sin, mask):
        w, H, T = self.w, self.heads, x.shape[0]
        n, r, vd = self.nope, self.rope, self.v
        if self.q_lora is None:
            q = x @ w[p + "q_proj.weight"].T
        else:
            c_q = x @ w[p + "q_a_proj.weight"].T
            if self.ablate != "q_a_norm":
                c_q = rms_norm(c_q, w[p + "q_a_layernorm.weight"], self.eps)
            q = c_q @ w[p + "q_b_proj.weight"].T
        q = q.reshape(T, H, n + r).transpose(1, 0, 2)  # [H, T, n + r]
        q_pass, q_rot = q[..., :n], q[..., n:]
        compressed = x @ w[p + "kv_a_proj_with_mqa.weight"].T
        k_pass, k_rot = compressed[:, :self.kv_lora], compressed[:, self.kv_lora:]
        if self.ablate != "kv_a_norm":
            k_pass = rms_norm(k_pass, w[p + "kv_a_layernorm.weight"], self.eps)
        kv = (k_pass @ w[p + "kv_b_proj.weight"].T).reshape(T, H, n + vd).transpose(1, 0, 2)
        k_pass, value = kv[..., :n], kv[..., n:]
        k_rot = k_rot[None, :, :]  # one rope key for every head
        q_rot = self.apply_rope(q_rot, cos, sin)
        k_rot = np.broadcast_to(self.apply_rope(k_rot, cos, sin), (H, T, r))
        query = np.concatenate((q_pass, q_rot), axis=-1)
        key = np.concatenate((k_pass, k_rot), axis=-1)
        scores = np.einsum("htd,hsd->hts", query, key) * self.softmax_scale + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        out = np.einsum("hts,hsd->thd", probs, value).reshape(T, H * vd)
        return out @ w[p + "o_proj.weight"].T

    def forward(self, ids):
        w = self.w
        T = len(ids)
        h = w["model.embed_tokens.weight"][ids]
        ang = np.arange(T, dtype=np.float64)[:, None] * self.inv_freq[None, :]
        emb = np.concatenate((ang, ang), axis=-1)
        cos = np.cos(emb)[None] * self.attention_factor
        sin = np.sin(emb)[None] * self.attention_factor
        mask = np.triu(np.full((T, T), -np.inf), 1)
        for layer in range(self.layers):
            p = f"model.layers.{layer}."
            x = rms_norm(h, w[p + "input_layernorm.weight"], self.eps)
            h = h + self.attention(p + "self_attn.", x, cos, sin, mask)
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
    model = DeepseekV3(model_dir, ablate)
    ids = [int(t) for t in ids_text.split(",")]
    out_ids, rows = [], []
    for _ in range(steps):
        logits = model.forward(ids + out_ids)
        rows.append(logits.tolist())
        out_ids.append(int(np.argmax(logits)))
    json.dump({"ids": out_ids, "logits": rows}, sys.stdout)


if __name__ == "__main__":
    main()
