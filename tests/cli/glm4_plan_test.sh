#!/usr/bin/env bash
# `exl3serve plan` from a config.json alone (issue 19): the published GLM-4.6
# configuration (values from ../shared/docs/architectures.md §1.1, written
# here; no weights) at 3 and 4 bpw on 2, 3 and 4 boxes of 8 ranks (8 x 80 GB
# GPUs each), pure expert parallelism (--ep = ranks).
#   * The model's bytes equal an independent count (Python below, from the
#     storage table of architectures.md §1.3: EXL3 linears as trellis
#     k*n*K/8 + suh + svh + a 4-byte marker, router, embedding, norms and
#     biases 16-bit, head at 6 bits, MTP layer not written; at whole bpw the
#     converter's allocation leaves every budgeted linear at K = bpw).
#   * Every plan: 8 ranks per box, the 160 experts exactly once in contiguous
#     ranges, the rank bytes sum to the summary, every rank under 80 GB.
#   * On a small GLM test model, `plan --bits 3` on the Hugging Face directory
#     predicts exactly the bytes `convert --bits 3` writes (planned on the
#     converted model).
#   * Without --bits a config-only directory is planned at fp16; errors.
# Prints the table docs/BENCHMARKS.md quotes.
set -euo pipefail
BIN=$1
PY=/usr/bin/python3
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

mkdir -p "$TMP/glm46"
cat >"$TMP/glm46/config.json" <<'JSON'
{
  "architectures": ["Glm4MoeForCausalLM"],
  "model_type": "glm4_moe",
  "hidden_size": 5120,
  "num_hidden_layers": 92,
  "num_attention_heads": 96,
  "num_key_value_heads": 8,
  "head_dim": 128,
  "partial_rotary_factor": 0.5,
  "rope_theta": 1000000,
  "rope_scaling": null,
  "max_position_embeddings": 202752,
  "attention_bias": true,
  "use_qk_norm": true,
  "rms_norm_eps": 1e-05,
  "hidden_act": "silu",
  "first_k_dense_replace": 3,
  "intermediate_size": 12288,
  "n_routed_experts": 160,
  "num_experts_per_tok": 8,
  "moe_intermediate_size": 1536,
  "n_shared_experts": 1,
  "scoring_func": "sigmoid",
  "topk_method": "noaux_tc",
  "n_group": 1,
  "topk_group": 1,
  "norm_topk_prob": true,
  "routed_scaling_factor": 2.5,
  "num_nextn_predict_layers": 1,
  "vocab_size": 151552,
  "tie_word_embeddings": false
}
JSON

# GLM-4.6's stored bytes at K bits (head 6) or fp16 (K = 16), counted from the config.
expected_bytes() {
  "$PY" - "$TMP/glm46/config.json" "$1" <<'PYEOF'
import json, sys
c = json.load(open(sys.argv[1])); K = int(sys.argv[2])
H, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
hd, nq, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
E, dense, I, Im = c["n_routed_experts"], c["first_k_dense_replace"], c["intermediate_size"], c["moe_intermediate_size"]
shared = c["n_shared_experts"] * Im
pad = lambda n: (n + 127) // 128 * 128
def linear(i, o, k):  # EXL3 at k bits, or fp16 (HF) when k == 16
    return 2 * i * o if k == 16 else pad(i) * pad(o) * k // 8 + 2 * (pad(i) + pad(o)) + 4
total = 2 * V * H + (2 * H * V if K == 16 else linear(H, V, 6)) + 2 * H  # embed, head, final norm
for l in range(L):
    total += linear(H, nq * hd, K) + 2 * linear(H, nkv * hd, K) + linear(nq * hd, H, K)
    bias = [nq * hd, nkv * hd, nkv * hd]
    total += 2 * sum(bias if K == 16 else map(pad, bias)) + 2 * 2 * hd + 2 * 2 * H  # biases, q/k norms, 2 norms
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

echo "| bpw | boxes x 8 ranks | model GiB | largest rank GiB | smallest rank GiB | replicated GiB per rank | experts per rank |"
echo "|---|---|---|---|---|---|---|"
for bits in 3 4; do
  want=$(expected_bytes $bits)
  for boxes in 2 3 4; do
    ranks=$((8 * boxes))
    spec=$(seq -s, -f "box%g:8" 1 $boxes)
    out="$TMP/plan-$bits-$boxes.txt"
    "$BIN" plan --model "$TMP/glm46" --ranks $ranks --boxes "$spec" --bits $bits >"$out" ||
      { cat "$out"; fail "plan $bits bpw on $boxes boxes"; }
    grep -q "^bytes from: config.json, as EXL3 at $bits bpw" "$out" || fail "$bits/$boxes: bytes-from line"
    grep -q "^model: $want bytes" "$out" || { grep '^model:' "$out"; fail "$bits bpw: model bytes should be $want"; }
    [ "$(grep -cE '^ +[0-9]+  box' "$out")" = $ranks ] || fail "$bits/$boxes: expected $ranks rank lines"
    for b in $(seq 1 $boxes); do
      [ "$(grep -cE "^ +[0-9]+  box$b " "$out")" = 8 ] || fail "$bits/$boxes: box$b should hold 8 ranks"
    done
    sum=$(rank_bytes_sum "$out")
    grep -q "all ranks together: $sum bytes" "$out" || fail "$bits/$boxes: rank bytes sum to $sum, summary disagrees"
    # Columns from the right: ... experts, expert channels, vocab, bytes, MiB, replicated MiB.
    awk -v out="$TMP/row" -v bits=$bits -v boxes=$boxes '
      /^ *[0-9]+  box/ {
        split($(NF - 5), e, /[\[,)]/); n = e[3] - e[2]
        if (e[2] != next_expert) { print "experts not contiguous at rank " $1; bad = 1 }
        next_expert = e[3]
        if (min_e == "" || n < min_e) min_e = n; if (n > max_e) max_e = n
        b = $(NF - 2); if (b >= 80e9) { print "rank " $1 " holds " b " bytes >= 80 GB"; bad = 1 }
        if (min_b == "" || b < min_b) min_b = b; if (b > max_b) max_b = b; rep = $NF
      }
      /^model: / { model = $2 }
      END {
        if (next_expert != 160) { print "experts end at " next_expert ", not 160"; bad = 1 }
        printf "| %d | %d x 8 = %d | %.1f | %.2f | %.2f | %.2f | %s |\n", bits, boxes, boxes * 8,
               model / 2^30, max_b / 2^30, min_b / 2^30, rep / 1024, min_e == max_e ? min_e : min_e "-" max_e
        exit bad
      }' "$out" || { cat "$out"; fail "$bits/$boxes: plan checks"; }
  done
done
echo "command: exl3serve plan --model GLM46_CONFIG_DIR --ranks 16 --boxes box1:8,box2:8 --bits 4 (and 3 bpw, 24 and 32 ranks)"

# Without --bits: fp16, every tensor as the Hugging Face checkpoint holds it (no MTP).
"$BIN" plan --model "$TMP/glm46" --ranks 16 >"$TMP/fp16.txt" || { cat "$TMP/fp16.txt"; fail "fp16 plan"; }
grep -q "^bytes from: config.json, every tensor fp16" "$TMP/fp16.txt" || fail "fp16 bytes-from line"
want=$(expected_bytes 16)
grep -q "^model: $want bytes" "$TMP/fp16.txt" || { grep '^model:' "$TMP/fp16.txt"; fail "fp16 model bytes should be $want"; }

# The estimate equals what the converter writes (a small GLM test model).
"$BIN" make-test-model --arch glm4-moe --hidden 128 --intermediate 128 --layers 2 --experts 4 \
  --out "$TMP/hf" >/dev/null
"$BIN" convert --in "$TMP/hf" --out "$TMP/q3" --bits 3 --threads 2 --no-progress >/dev/null 2>&1 ||
  fail "convert the GLM test model"
"$BIN" plan --model "$TMP/q3" --ranks 2 >"$TMP/q3.txt"
"$BIN" plan --model "$TMP/hf" --ranks 2 --bits 3 >"$TMP/est.txt"
stored=$(sed -n 's/^model: \([0-9]*\) bytes.*/\1/p' "$TMP/q3.txt")
estimated=$(sed -n 's/^model: \([0-9]*\) bytes.*/\1/p' "$TMP/est.txt")
[ -n "$stored" ] && [ "$stored" = "$estimated" ] || fail "plan --bits 3 estimates $estimated bytes, convert wrote $stored"
echo "small GLM test model: plan --bits 3 = $estimated bytes = the converted model's"

# Errors: exit 1, a one-line message naming the option or the file.
expect() {  # expect SUBSTRING ARGS...
  local text=$1; shift
  set +e
  "$BIN" plan "$@" >/dev/null 2>"$TMP/err.txt"; local rc=$?
  set -e
  [ $rc = 1 ] || fail "plan $* exited $rc, expected 1: $(cat "$TMP/err.txt")"
  grep -q -- "$text" "$TMP/err.txt" || fail "plan $*: message lacks '$text': $(cat "$TMP/err.txt")"
}
expect "estimate bits must be 0 (fp16) or in \[1, 8\], got 9" --model "$TMP/glm46" --ranks 2 --bits 9
expect "estimate head bits must be 1..8 or 16, got 12" --model "$TMP/glm46" --ranks 2 --bits 4 --head-bits 12
expect "--head-bits needs --bits" --model "$TMP/glm46" --ranks 2 --head-bits 6
expect "must divide the world size 16" --model "$TMP/glm46" --ranks 16 --ep 3 --bits 4
mkdir -p "$TMP/other"
echo '{"architectures": ["FalconForCausalLM"]}' >"$TMP/other/config.json"
expect "other/config.json" --model "$TMP/other" --ranks 2
echo "glm4_plan: OK"
