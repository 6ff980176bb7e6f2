#!/usr/bin/python3
"""An independent float64 NumPy reference forward of the hybrid Gated DeltaNet
text models Qwen3NextForCausalLM (Qwen3-Next), Qwen3_5ForConditionalGeneration
(Qwen3.5/3.6 dense) and Qwen3_5MoeForConditionalGeneration (Qwen3.5/3.6 MoE),
written from ../shared/docs/arch-gated-deltanet.md sections 2-4 (the gated
delta rule, the gated full attention, the MoE block; config keys and tensor
names from sections 1 and 5), reading the HF safetensors directly (no
exl3serve code). Text only: `model.visual.*` and `mtp.*` tensors are ignored,
and for Qwen3.5 the text-only MRoPE is plain 1-D RoPE.

  qwen3_next_forward.py MODEL_DIR 1,2,3 N [--ablate WHAT] > out.json

prints {"ids": [N greedy ids after the prompt], "logits": [[vocab] x N]}:
row i holds the logits after prompt + ids[:i] (what `exl3serve generate
--logits-out` writes), computed by a full forward each step (no cache). The
linear-attention layers run in the recurrent form, token by token from a zero
state: the causal depthwise conv over a window of the last K-1 inputs, then
per value head S [dk, dv] <- exp(g) S; u = beta (v - S^T k); S <- S + k u^T;
o = S^T q (section 2.4).

--ablate drops one feature (to show a test comparing against this reference
fails without it): gate (no attention output gate), zero_centred (w instead
of 1 + w in the zero-centred RMSNorms), l2norm (no q/k L2 norm in the GDN),
conv (no conv1d, SiLU kept), decay (g = 0), grouping (value head h reads key
head h % Hk, the tiled order, instead of h // G), shared_gate (no sigmoid gate
on the shared expert).
"""
import json

import numpy as np

from numpy_moe_common import greedy_main, load_safetensors, rms_norm, rotate_half, silu

ABLATIONS = ("gate", "zero_centred", "l2norm", "conv", "decay", "grouping", "shared_gate")
ARCHS = ("Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    # PyTorch's softplus (beta 1, threshold 20): linear above 20.
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def l2norm(x):
    # x * rsqrt(sum(x^2) + 1e-6) over the head dim (eps fixed, not rms_norm_eps).
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def causal_conv1d_silu(x, w):
    """x [T, C] (the projected [Q | K | V] channels), w [C, K]: token by token
    with a window of the last K-1 raw inputs (zeros before the sequence);
    y_t[c] = silu(sum_j w[c, j] x_{t-K+1+j}[c]), the newest input times
    w[c, K-1]."""
    T, C = x.shape
    K = w.shape[1]
    window = np.zeros((K - 1, C))
    y = np.empty_like(x)
    for t in range(T):
        full = np.concatenate((window, x[t:t + 1]), axis=0)  # [K, C], oldest first
        y[t] = silu((full * w.T).sum(0))
        window = full[1:]
    return y


def recurrent_gated_delta_rule(q, k, v, g, beta, key_head):
    """q, k [T, Hk, dk] (already L2-normalised, q scaled by dk^-1/2),
    v [T, Hv, dv], g, beta [T, Hv], key_head [Hv] (the key head each value
    head reads). Returns o [T, Hv, dv] and the final state [Hv, dk, dv]."""
    T, Hv, dv = v.shape
    dk = k.shape[-1]
    S = np.zeros((Hv, dk, dv))
    o = np.empty((T, Hv, dv))
    for t in range(T):
        qt, kt = q[t][key_head], k[t][key_head]  # [Hv, dk]
        S = np.exp(g[t])[:, None, None] * S  # decay first
        r = np.einsum("hij,hi->hj", S, kt)  # S^T k: the state's prediction of v
        u = beta[t][:, None] * (v[t] - r)
        S = S + kt[:, :, None] * u[:, None, :]  # S + k u^T
        o[t] = np.einsum("hij,hi->hj", S, qt)  # S^T q with the updated state
    return o, S


class Qwen3Next:
    def __init__(self, model_dir, ablate):
        if ablate is not None and ablate not in ABLATIONS:
            raise SystemExit(f"unknown --ablate {ablate}; one of {', '.join(ABLATIONS)}")
        self.ablate = ablate
        cfg = json.load(open(f"{model_dir}/config.json"))
        self.arch = arch = cfg["architectures"][0]
        assert arch in ARCHS, cfg["architectures"]
        self.next = arch == "Qwen3NextForCausalLM"
        # Qwen3-Next: text keys top-level, tensors under model.; Qwen3.5: text keys
        # under text_config (rope keys under rope_parameters), tensors under
        # model.language_model., lm_head top-level.
        text = cfg if self.next else cfg["text_config"]
        self.prefix = "model." if self.next else "model.language_model."
        rope = text.get("rope_parameters") or {}
        self.w = load_safetensors(f"{model_dir}/model.safetensors")
        self.hidden = text["hidden_size"]
        self.layers = text["num_hidden_layers"]
        self.eps = text["rms_norm_eps"]
        if "layer_types" in text and text["layer_types"]:
            self.layer_types = list(text["layer_types"])
        else:
            interval = text.get("full_attention_interval", 4)
            self.layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                for i in range(self.layers)]
        assert len(self.layer_types) == self.layers, (len(self.layer_types), self.layers)
        # Gated full attention.
        self.heads = text["num_attention_heads"]
        self.kv_heads = text["num_key_value_heads"]
        self.head_dim = text.get("head_dim", 256)  # HF default head_dim 256
        theta = rope.get("rope_theta", text.get("rope_theta"))
        if theta is None:
            raise SystemExit("config has no rope_theta")
        factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))  # HF BC default 0.25
        self.theta = float(theta)
        self.rotary_dim = int(self.head_dim * factor)
        # Gated DeltaNet geometry.
        self.hk = text["linear_num_key_heads"]
        self.hv = text["linear_num_value_heads"]
        self.dk = text["linear_key_head_dim"]
        self.dv = text["linear_value_head_dim"]
        self.conv_k = text["linear_conv_kernel_dim"]
        assert self.hv % self.hk == 0, (self.hv, self.hk)
        self.group = self.hv // self.hk
        if ablate == "grouping":
            self.key_head = np.arange(self.hv) % self.hk  # tiled
        else:
            self.key_head = np.arange(self.hv) // self.group  # grouped (repeat_interleave)
        # Feed-forward.
        self.experts = text.get("num_experts", 0) or 0
        self.top_k = text.get("num_experts_per_tok", 0)
        self.mlp_only = set(text.get("mlp_only_layers", []) or [])
        self.sparse_step = text.get("decoder_sparse_step", 1) or 1
        # Qwen3-Next reads norm_topk_prob; the Qwen3.5-MoE router always renormalises.
        self.norm_topk = bool(text.get("norm_topk_prob", True)) if self.next else True
        p = self.prefix
        if "lm_head.weight" in self.w:
            self.lm_head = self.w["lm_head.weight"]
        elif text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)):
            self.lm_head = self.w[p + "embed_tokens.weight"]
        else:
            raise SystemExit("no lm_head.weight and tie_word_embeddings is false")

    # RMSNorms ---------------------------------------------------------------

    def norm(self, x, weight):
        """The zero-centred RMSNorm (input/post-attention, q/k, final): x * rsqrt(mean(x^2) + eps) * (1 + w)."""
        return rms_norm(x, weight if self.ablate == "zero_centred" else 1.0 + weight, self.eps)

    # Mixers -----------------------------------------------------------------

    def gdn_projections(self, p, x):
        """Returns mixed [T, conv_dim] in the flat [Q | K | V] order, z [T, Hv, dv], b, a [T, Hv]."""
        w, T = self.w, x.shape[0]
        hk, hv, dk, dv, G = self.hk, self.hv, self.dk, self.dv, self.group
        if p + "in_proj_qkvz.weight" in w:
            # Fused, grouped per key head: [q (dk), k (dk), v (G dv), z (G dv)] per key head,
            # value head kh * G + g.
            y = (x @ w[p + "in_proj_qkvz.weight"].T).reshape(T, hk, 2 * dk + 2 * G * dv)
            q = y[..., :dk].reshape(T, hk * dk)
            k = y[..., dk:2 * dk].reshape(T, hk * dk)
            v = y[..., 2 * dk:2 * dk + G * dv].reshape(T, hv * dv)
            z = y[..., 2 * dk + G * dv:].reshape(T, hv, dv)
            ba = (x @ w[p + "in_proj_ba.weight"].T).reshape(T, hk, 2 * G)
            b = ba[..., :G].reshape(T, hv)
            a = ba[..., G:].reshape(T, hv)
            mixed = np.concatenate((q, k, v), axis=-1)
        else:
            # Split, flat: in_proj_qkv rows [Q (Hk dk) | K (Hk dk) | V (Hv dv)].
            mixed = x @ w[p + "in_proj_qkv.weight"].T
            z = (x @ w[p + "in_proj_z.weight"].T).reshape(T, hv, dv)
            b = x @ w[p + "in_proj_b.weight"].T
            a = x @ w[p + "in_proj_a.weight"].T
        return mixed, z, b, a

    def gated_delta_net(self, p, x):
        w, T = self.w, x.shape[0]
        hk, hv, dk, dv = self.hk, self.hv, self.dk, self.dv
        mixed, z, b, a = self.gdn_projections(p, x)
        assert mixed.shape[1] == 2 * hk * dk + hv * dv, mixed.shape
        if self.ablate == "conv":
            mixed = silu(mixed)
        else:
            conv_w = w[p + "conv1d.weight"]  # [conv_dim, 1, K]
            assert conv_w.shape == (mixed.shape[1], 1, self.conv_k), conv_w.shape
            mixed = causal_conv1d_silu(mixed, conv_w[:, 0, :])
        q = mixed[:, :hk * dk].reshape(T, hk, dk)
        k = mixed[:, hk * dk:2 * hk * dk].reshape(T, hk, dk)
        v = mixed[:, 2 * hk * dk:].reshape(T, hv, dv)
        if self.ablate != "l2norm":
            q, k = l2norm(q), l2norm(k)
        q = q * dk ** -0.5
        beta = sigmoid(b)
        g = -np.exp(w[p + "A_log"])[None, :] * softplus(a + w[p + "dt_bias"][None, :])
        if self.ablate == "decay":
            g = np.zeros_like(g)
        o, _ = recurrent_gated_delta_rule(q, k, v, g, beta, self.key_head)
        # Gated RMSNorm per value head over dv, PLAIN weight, norm before the SiLU gate.
        o = rms_norm(o, w[p + "norm.weight"], self.eps) * silu(z)
        return o.reshape(T, hv * dv) @ w[p + "out_proj.weight"].T

    def attention(self, p, x, cos, sin):
        w, T, hd, r = self.w, x.shape[0], self.head_dim, self.rotary_dim
        qg = (x @ w[p + "q_proj.weight"].T).reshape(T, self.heads, 2 * hd)  # per head [query, gate]
        q, gate = qg[..., :hd], qg[..., hd:].reshape(T, self.heads * hd)
        k = (x @ w[p + "k_proj.weight"].T).reshape(T, self.kv_heads, hd)
        v = (x @ w[p + "v_proj.weight"].T).reshape(T, self.kv_heads, hd)
        q = self.norm(q, w[p + "q_norm.weight"])
        k = self.norm(k, w[p + "k_norm.weight"])
        # NEOX rotate-half on the first rotary_dim dims; the rest pass through.
        q = np.concatenate((q[..., :r] * cos + rotate_half(q[..., :r]) * sin, q[..., r:]), axis=-1)
        k = np.concatenate((k[..., :r] * cos + rotate_half(k[..., :r]) * sin, k[..., r:]), axis=-1)
        rep = self.heads // self.kv_heads
        k = np.repeat(k, rep, axis=1)  # query head h uses KV head h // rep
        v = np.repeat(v, rep, axis=1)
        mask = np.triu(np.full((T, T), -np.inf), 1)
        scores = np.einsum("thd,shd->hts", q, k) * hd ** -0.5 + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        out = np.einsum("hts,shd->thd", probs, v).reshape(T, self.heads * hd)
        if self.ablate != "gate":
            out = out * sigmoid(gate)
        return out @ w[p + "o_proj.weight"].T

    # Feed-forward -----------------------------------------------------------

    def mlp(self, p, x):
        w = self.w
        return (silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T

    def moe(self, p, x):
        w = self.w
        logits = x @ w[p + "gate.weight"].T  # [T, E]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs = probs / probs.sum(-1, keepdims=True)  # softmax over all experts
        idx = np.argsort(-probs, axis=-1, kind="stable")[:, :self.top_k]  # ties: lower index first
        weights = np.take_along_axis(probs, idx, axis=1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdims=True)
        out = np.zeros_like(x)
        for e in np.unique(idx):
            rows, slot = np.nonzero(idx == e)
            out[rows] += weights[rows, slot][:, None] * self.mlp(f"{p}experts.{e}.", x[rows])
        if p + "shared_expert.gate_proj.weight" in w:
            shared = self.mlp(p + "shared_expert.", x)
            if self.ablate != "shared_gate":
                shared = sigmoid(x @ w[p + "shared_expert_gate.weight"].T) * shared  # [T, 1] gate
            out += shared
        return out

    def is_moe(self, layer):
        return (self.experts > 0 and layer not in self.mlp_only
                and (layer + 1) % self.sparse_step == 0)

    # Model ------------------------------------------------------------------

    def forward(self, ids):
        w, pre = self.w, self.prefix
        T = len(ids)
        h = w[pre + "embed_tokens.weight"][ids]
        r = self.rotary_dim
        inv_freq = 1.0 / (self.theta ** (np.arange(0, r, 2, dtype=np.float64) / r))
        ang = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]
        emb = np.concatenate((ang, ang), axis=-1)
        cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
        for layer in range(self.layers):
            p = f"{pre}layers.{layer}."
            x = self.norm(h, w[p + "input_layernorm.weight"])
            kind = self.layer_types[layer]
            if kind == "linear_attention":
                h = h + self.gated_delta_net(p + "linear_attn.", x)
            elif kind == "full_attention":
                h = h + self.attention(p + "self_attn.", x, cos, sin)
            else:
                raise SystemExit(f"layer {layer}: unknown layer type {kind}")
            x = self.norm(h, w[p + "post_attention_layernorm.weight"])
            h = h + (self.moe(p + "mlp.", x) if self.is_moe(layer) else self.mlp(p + "mlp.", x))
        h = self.norm(h, w[pre + "norm.weight"])
        return h[-1] @ self.lm_head.T


if __name__ == "__main__":
    greedy_main(Qwen3Next)
