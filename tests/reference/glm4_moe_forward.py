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

import numpy as np

from numpy_moe_common import GroupedSigmoidMoE, greedy_main, load_safetensors, rms_norm, rotate_half


class Glm4Moe(GroupedSigmoidMoE):
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
        self.read_moe_config(cfg, ablate)

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


if __name__ == "__main__":
    greedy_main(Glm4Moe)
