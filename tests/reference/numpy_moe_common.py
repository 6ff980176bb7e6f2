"""Shared pieces of the float64 NumPy reference forwards (glm4_moe_forward.py,
deepseek_v3_forward.py): safetensors loading, RMSNorm, SiLU, rotate-half, the
sigmoid grouped top-k router with e_score_correction_bias that GLM-4.x MoE and
DeepSeek-V3 share (transformers' Glm4MoeTopkRouter / DeepseekV3TopkRouter and
their MoE.route_tokens_to_experts), and the greedy driver both scripts run.
No exl3serve code: written from the published definitions.
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
    # x * rsqrt(mean(x^2) + eps) * weight, over the last axis.
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate((-x[..., half:], x[..., :half]), axis=-1)


def silu(x):
    return x / (1.0 + np.exp(-x))


class GroupedSigmoidMoE:
    """Dense MLP, router and MoE block. The subclass sets w, ablate, experts,
    top_k, n_group, topk_group, norm_topk, scale (see read_moe_config)."""

    def read_moe_config(self, cfg, ablate):
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
        """TopkRouter + MoE.route_tokens_to_experts: sigmoid scores; experts
        chosen on scores + correction bias within the topk_group groups of
        the best top-2 sums; weights are the unbiased scores."""
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
                out[t] += weights[t, j] * self.mlp(f"{p}experts.{idx[t, j]}.", x[t:t + 1])[0]
        if self.ablate != "shared_expert":
            out += self.mlp(p + "shared_experts.", x)
        return out


def greedy_main(model_class):
    """MODEL_DIR IDS N [--ablate WHAT]: prints {"ids": [N greedy ids],
    "logits": [[vocab] x N]} (row i: the logits after prompt + ids[:i])."""
    args = sys.argv[1:]
    ablate = None
    if "--ablate" in args:
        i = args.index("--ablate")
        ablate = args[i + 1]
        del args[i:i + 2]
    model_dir, ids_text, steps = args[0], args[1], int(args[2])
    model = model_class(model_dir, ablate)
    ids = [int(t) for t in ids_text.split(",")]
    out_ids, rows = [], []
    for _ in range(steps):
        logits = model.forward(ids + out_ids)
        rows.append(logits.tolist())
        out_ids.append(int(np.argmax(logits)))
    json.dump({"ids": out_ids, "logits": rows}, sys.stdout)
