#!/usr/bin/env bash
# `exl3serve plan` from a config.json alone (issue 19) for the MLA models:
# the published Kimi K2 and DeepSeek-V3 configurations (values from
# ../shared/docs/architectures.md §2.1, written here; no weights) at 3 and 4
# bpw on 2, 3 and 4 boxes of 8 ranks (8 x 80 GB GPUs each), pure expert
# parallelism (--ep = ranks), MLA split by query heads (q_a_proj,
# kv_a_proj_with_mqa and the latent cache on every rank).
#   * The model's bytes equal an independent count (Python below, from the
#     storage table of architectures.md §2.4: EXL3 linears as trellis
#     k*n*K/8 + suh + svh + a 4-byte marker over 128-padded shapes, kv_b_proj
#     fp16 unpadded, router, embedding, norms 16-bit, correction bias fp16
#     once converted, head at 6 bits, MTP layer not written).
#   * Every plan: 8 ranks per box, every expert exactly once in contiguous
#     ranges, the rank bytes sum to the summary, every rank under 80 GB.
#   * On a small DeepSeek test model, `plan --bits 3` on the Hugging Face
#     directory predicts exactly the bytes `convert --bits 3` writes.
# Prints the table docs/BENCHMARKS.md quotes.
set -euo pipefail
BIN=$1
PY=/usr/bin/python3
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

write_config() {  # write_config DIR HEADS EXPERTS DENSE N_GROUP TOPK_GROUP SCALE THETA FACTOR BETA_FAST VOCAB MAXPOS MTP TYPE
  mkdir -p "$1"
  cat >"$1/config.json" <<JSON
{
  "architectures": ["DeepseekV3ForCausalLM"],
  "model_type": "${14}",
  "hidden_size": 7168,
  "num_hidden_layers": 61,
  "num_attention_heads": $2,
  "num_key_value_heads": $2,
  "q_lora_rank": 1536,
  "kv_lora_rank": 512,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "v_head_dim": 128,
  "intermediate_size": 18432,
  "moe_intermediate_size": 2048,
  "n_routed_experts": $3,
  "num_experts_per_tok": 8,
  "n_shared_experts": 1,
  "first_k_dense_replace": $4,
  "moe_layer_freq": 1,
  "n_group": $5,
  "topk_group": $6,
  "norm_topk_prob": true,
  "scoring_func": "sigmoid",
  "topk_method": "noaux_tc",
  "routed_scaling_factor": $7,
  "rope_theta": $8,
  "max_position_embeddings": ${12},
  "rope_scaling": {"type": "yarn", "factor": $9, "original_max_position_embeddings": 4096,
                   "beta_fast": ${10}, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
  "rms_norm_eps": 1e-06,
  "hidden_act": "silu",
  "attention_bias": false,
  "num_nextn_predict_layers": ${13},
  "vocab_size": ${11},
  "tie_word_embeddings": false
}
JSON
}
write_config "$TMP/kimi-k2" 64 384 1 1 1 2.827 50000 32 1 163840 131072 0 kimi_k2
write_config "$TMP/deepseek-v3" 128 256 3 8 4 2.5 10000 40 32 129280 163840 1 deepseek_v3

# Stored bytes at K bits (head 6) or fp16 (K = 16), counted from the config.
expected_bytes() {
  "$PY" - "$1/config.json" "$2" <<'PYEOF'
import json, sys
c = json.load(open(sys.argv[1])); K = int(sys.argv[2])
H, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
nh, ql, dc = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
n, r, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
E, dense, I, Im = c["n_routed_experts"], c["first_k_dense_replace"], c["intermediate_size"], c["moe_intermediate_size"]
shared = c["n_shared_experts"] * Im
pad = lambda x: (x + 127) // 128 * 128
def linear(i, o, k):  # EXL3 at k bits, or fp16 (HF) when k == 16
    return 2 * i * o if k == 16 else pad(i) * pad(o) * k // 8 + 2 * (pad(i) + pad(o)) + 4
total = 2 * V * H + (2 * H * V if K == 16 else linear(H, V, 6)) + 2 * H  # embed, head, final norm
for l in range(L):
    total += linear(H, ql, K) + linear(ql, nh * (n + r), K) + linear(H, dc + r, K)
    total += 2 * dc * nh * (n + v)  # kv_b_proj: fp16, unpadded, never quantized
    total += linear(nh * v, H, K)
    total += 2 * (2 * H + ql + dc)  # input/post-attention, q_a and kv_a norms
    if l < dense:
        total += 2 * linear(H, I, K) + linear(I, H, K)
    else:
        total += E * (2 * linear(H, Im, K) + linear(Im, H, K))
        total += 2 * linear(H, shared, K) + linear(shared, H, K)
        total += 2 * E * H + (4 if K == 16 else 2) * E  # router fp16, correction bias
print(total)
PYEOF
}

rank_bytes_sum() { awk '/^ *[0-9]+  /{sum += $(NF - 2)} END {printf "%.0f\n", sum}' "$1"; }

echo "| model | bpw | boxes x 8 ranks | model GiB | largest rank GiB | smallest rank GiB | replicated GiB per rank | q heads per rank | experts per rank |"
echo "|---|---|---|---|---|---|---|---|---|"
for model in kimi-k2 deepseek-v3; do
  experts=$(sed -n 's/.*"n_routed_experts": \([0-9]*\).*/\1/p' "$TMP/$model/config.json")
  for bits in 3 4; do
    want=$(expected_bytes "$TMP/$model" $bits)
    for boxes in 2 3 4; do
      ranks=$((8 * boxes))
      spec=$(seq -s, -f "box%g:8" 1 $boxes)
      out="$TMP/plan-$model-$bits-$boxes.txt"
      "$BIN" plan --model "$TMP/$model" --ranks $ranks --boxes "$spec" --bits $bits >"$out" ||
        { cat "$out"; fail "$model: plan $bits bpw on $boxes boxes"; }
      grep -q "^bytes from: config.json, as EXL3 at $bits bpw" "$out" || fail "$model $bits/$boxes: bytes-from line"
      grep -q "^model: $want bytes" "$out" || { grep '^model:' "$out"; fail "$model $bits bpw: model bytes should be $want"; }
      [ "$(grep -cE '^ +[0-9]+  box' "$out")" = $ranks ] || fail "$model $bits/$boxes: expected $ranks rank lines"
      for b in $(seq 1 $boxes); do
        [ "$(grep -cE "^ +[0-9]+  box$b " "$out")" = 8 ] || fail "$model $bits/$boxes: box$b should hold 8 ranks"
      done
      sum=$(rank_bytes_sum "$out")
      grep -q "all ranks together: $sum bytes" "$out" || fail "$model $bits/$boxes: rank bytes sum to $sum, summary disagrees"
      # Columns from the right: ... experts, expert channels, vocab, bytes, MiB, replicated MiB;
      # query heads and KV heads come after box and capacity.
      awk -v model=$model -v bits=$bits -v boxes=$boxes -v experts=$experts '
        /^ *[0-9]+  box/ {
          split($(NF - 5), e, /[\[,)]/); n = e[3] - e[2]
          if (e[2] != next_expert) { print "experts not contiguous at rank " $1; bad = 1 }
          next_expert = e[3]
          if (min_e == "" || n < min_e) min_e = n; if (n > max_e) max_e = n
          split($5, q, /[\[,)]/); h = q[3] - q[2]
          if (min_q == "" || h < min_q) min_q = h; if (h > max_q) max_q = h
          if ($6 != "[0,1)") { print "rank " $1 " lacks the latent: kv " $6; bad = 1 }
          b = $(NF - 2); if (b >= 80e9) { print "rank " $1 " holds " b " bytes >= 80 GB"; bad = 1 }
          if (min_b == "" || b < min_b) min_b = b; if (b > max_b) max_b = b; rep = $NF
        }
        /^model: / { total = $2 }
        END {
          if (next_expert != experts) { print "experts end at " next_expert ", not " experts; bad = 1 }
          printf "| %s | %d | %d x 8 = %d | %.1f | %.2f | %.2f | %.2f | %s | %s |\n", model, bits, boxes,
                 boxes * 8, total / 2^30, max_b / 2^30, min_b / 2^30, rep / 1024,
                 min_q == max_q ? min_q : min_q "-" max_q, min_e == max_e ? min_e : min_e "-" max_e
          exit bad
        }' "$out" || { cat "$out"; fail "$model $bits/$boxes: plan checks"; }
    done
  done
  # Without --bits: fp16, every tensor as the Hugging Face checkpoint holds it (no MTP).
  "$BIN" plan --model "$TMP/$model" --ranks 16 >"$TMP/fp16.txt" || { cat "$TMP/fp16.txt"; fail "$model fp16 plan"; }
  want=$(expected_bytes "$TMP/$model" 16)
  grep -q "^model: $want bytes" "$TMP/fp16.txt" || { grep '^model:' "$TMP/fp16.txt"; fail "$model fp16 model bytes should be $want"; }
done
echo "command: exl3serve plan --model KIMI_K2_CONFIG_DIR --ranks 16 --boxes box1:8,box2:8 --bits 4 (and 3 bpw, 24 and 32 ranks, DeepSeek-V3)"

# The estimate equals what the converter writes (a small DeepSeek test model).
"$BIN" make-test-model --arch deepseek-v3 --hidden 128 --intermediate 128 --layers 2 --experts 4 \
  --out "$TMP/hf" >/dev/null
"$BIN" convert --in "$TMP/hf" --out "$TMP/q3" --bits 3 --threads 2 --no-progress >/dev/null 2>&1 ||
  fail "convert the DeepSeek test model"
"$BIN" plan --model "$TMP/q3" --ranks 2 >"$TMP/q3.txt"
"$BIN" plan --model "$TMP/hf" --ranks 2 --bits 3 >"$TMP/est.txt"
stored=$(sed -n 's/^model: \([0-9]*\) bytes.*/\1/p' "$TMP/q3.txt")
estimated=$(sed -n 's/^model: \([0-9]*\) bytes.*/\1/p' "$TMP/est.txt")
[ -n "$stored" ] && [ "$stored" = "$estimated" ] || fail "plan --bits 3 estimates $estimated bytes, convert wrote $stored"
echo "small DeepSeek test model: plan --bits 3 = $estimated bytes = the converted model's"
echo "deepseek_v3_plan: OK"
