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

import numpy as np

from numpy_moe_common import GroupedSigmoidMoE, greedy_main, load_safetensors, rms_norm, rotate_half


def yarn_get_mscale(scale, mscale=1.0):
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


class DeepseekV3(GroupedSigmoidMoE):
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
        self.read_moe_config(cfg, ablate)
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


if __name__ == "__main__":
    greedy_main(DeepseekV3)
