#!/usr/bin/env bash
# DeepseekV3ForCausalLM (issue 19 part 2: DeepSeek-V3/R1, Kimi K2) against an
# independent float64 NumPy forward written from the transformers definition
# in its naive form (tests/reference/deepseek_v3_forward.py: k and v
# decompressed through kv_b_proj, interleaved RoPE, YaRN), on `make-test-model
# --arch deepseek-v3`: hidden 200, 5 heads of nope 24 + rope 16 with v 20,
# q_lora_rank 72, kv_lora_rank 56, YaRN factor 4 (mscale 1, mscale_all_dim
# 0.8, so cos/sin and the softmax scale are both corrected), 12 experts in 4
# groups of which 2 are kept, a non-zero correction bias, one shared expert,
# layer 0 dense, one MTP layer in the checkpoint. The prompt is 17 tokens, so
# it runs the prefill path (latent decompressed) and the 63 decode steps
# the absorbed form over the paged latent cache.
#   * unquantized (bf16 weights, fp32 activations, fp32 KV): each of the 64
#     generated steps' logits within REL_FP32 relative L2 of the reference,
#     and the 64 greedy ids equal; also with q_lora_rank null (plain q_proj);
#   * the reference is sensitive to every feature: with any one of them
#     dropped (YaRN, its cos/sin factor, its softmax-scale correction, the
#     interleaved rope layout, q_a/kv_a norms, correction bias, groups,
#     shared expert, routed scaling) its logits miss ours by > 100 x REL_FP32;
#   * EXL3 4 bpw (head 16 bit) of the --peaked-logits variant: logits within
#     REL_EXL3_MEAN (mean) and REL_EXL3_MAX (any step) of the float64
#     reference of the bf16 weights, greedy ids equal; kv_b_proj stays 16-bit;
#   * the 8-bit latent cache (--kv-bits 8) on the peaked model: greedy ids
#     equal to the reference, logits within REL_INT8_KV;
#   * TP 2, TP 3 (heads 2/2/1), EP 2, TP 2 x EP 2 (4 ranks) and TP 3 with
#     uneven capacities 2,1,0.5 give the TP 1 greedy ids, unquantized (random
#     model) and EXL3 (peaked model).
# Needs /usr/bin/python3 with NumPy (else exit 77 = skip).
set -euo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
PY=/usr/bin/python3
"$PY" -c "import numpy" 2>/dev/null || { echo "SKIP: /usr/bin/python3 lacks numpy"; exit 77; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
REF="$SRC/tests/reference/deepseek_v3_forward.py"
REL_FP32=1e-5       # fp32 activations vs float64, same bf16 weights: measured max 3.4e-6 (q_lora null 3.1e-6)
REL_EXL3_MEAN=0.1   # 4 bpw, peaked model: measured mean 6.0e-2, max 2.0e-1 (seed 5)
REL_EXL3_MAX=0.3
REL_INT8_KV=0.02    # peaked model, int8 latent cache: measured max 7.0e-3, mean 2.8e-3
PROMPT=1,17,202,5,99,3,250,7,61,128,33,4,190,8,77,11,2
STEPS=64

"$BIN" make-test-model --arch deepseek-v3 --seed 5 --out "$TMP/ds" >/dev/null
"$PY" "$REF" "$TMP/ds" "$PROMPT" "$STEPS" >"$TMP/ref.json"

gen() {  # gen MODEL OUT_PREFIX [flags...]: greedy ids (and .npy logits) of the prompt
  local model=$1 out=$2
  shift 2
  "$BIN" generate --model "$model" --prompt-ids "$PROMPT" --ids --max-tokens "$STEPS" \
    --ignore-eos --kv-bits "${KV_BITS:-32}" --logits-out "$out.npy" "$@" 2>"$out.log" | tr -s ' \n' ',' >"$out.ids" ||
    { echo "FAIL: generate $model $*"; tail -20 "$out.log"; exit 1; }
}

compare() {  # compare NPY REF.json MAX_TOLERANCE NAME [--ids IDS_FILE [MEAN_TOLERANCE]]
  "$PY" - "$@" <<'PYEOF'
import json, sys
import numpy as np
ours = np.load(sys.argv[1]).astype(np.float64)
ref = json.load(open(sys.argv[2]))
tol, name = float(sys.argv[3]), sys.argv[4]
logits = np.array(ref["logits"], dtype=np.float64)
n = min(len(ours), len(logits))
rel = [np.linalg.norm(ours[i] - logits[i]) / np.linalg.norm(logits[i]) for i in range(n)]
print(f"{name}: {n} steps, relative L2 vs float64 reference: max {max(rel):.2e}, mean {np.mean(rel):.2e}")
assert n == len(logits), (n, len(logits))
assert max(rel) <= tol, f"{name}: {max(rel):.3e} > {tol}"
if len(sys.argv) > 7:
    assert np.mean(rel) <= float(sys.argv[7]), f"{name}: mean {np.mean(rel):.3e} > {sys.argv[7]}"
if len(sys.argv) > 6:
    ids = [int(t) for t in open(sys.argv[6]).read().strip().strip(",").split(",")]
    same = sum(a == b for a, b in zip(ids, ref["ids"]))
    print(f"{name}: greedy ids equal to the reference at {same} of {len(ref['ids'])} steps")
    assert ids == ref["ids"], (ids, ref["ids"])
PYEOF
}

# The MTP layer is in the checkpoint and is skipped with one log line.
"$PY" - "$TMP/ds/model.safetensors" <<'PYEOF'
import json, struct, sys
raw = open(sys.argv[1], "rb").read(8 + 10**6)
header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
for key in ["model.layers.3.eh_proj.weight", "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
            "model.layers.2.mlp.gate.e_score_correction_bias", "model.layers.1.self_attn.kv_b_proj.weight",
            "model.layers.0.self_attn.q_a_layernorm.weight", "model.layers.0.self_attn.kv_a_layernorm.weight"]:
    assert key in header, key
PYEOF

# Unquantized.
gen "$TMP/ds" "$TMP/fp"
grep -q "MTP" "$TMP/fp.log" || { echo "FAIL: no MTP log line"; cat "$TMP/fp.log"; exit 1; }
compare "$TMP/fp.npy" "$TMP/ref.json" "$REL_FP32" "deepseek-v3 bf16" --ids "$TMP/fp.ids"

# q_lora_rank null: a plain q_proj.
"$BIN" make-test-model --arch deepseek-v3 --no-q-lora --seed 6 --out "$TMP/noq" >/dev/null
grep -q '"q_lora_rank": null' "$TMP/noq/config.json" || { echo "FAIL: q_lora_rank not null"; exit 1; }
"$PY" "$REF" "$TMP/noq" "$PROMPT" "$STEPS" >"$TMP/noq-ref.json"
gen "$TMP/noq" "$TMP/noq"
compare "$TMP/noq.npy" "$TMP/noq-ref.json" "$REL_FP32" "deepseek-v3 q_lora_rank null bf16" --ids "$TMP/noq.ids"

# Each feature matters: the reference without it misses ours by far.
"$BIN" generate --model "$TMP/ds" --prompt-ids "$PROMPT" --ids --max-tokens 1 --kv-bits 32 \
  --logits-out "$TMP/one.npy" >/dev/null 2>&1
for what in yarn rope_mscale softmax_mscale interleave q_a_norm kv_a_norm correction_bias groups \
  shared_expert scaling; do
  "$PY" "$REF" "$TMP/ds" "$PROMPT" 1 --ablate "$what" >"$TMP/ablate.json"
  "$PY" - "$TMP/one.npy" "$TMP/ablate.json" "$REL_FP32" "$what" <<'PYEOF'
import json, sys
import numpy as np
ours = np.load(sys.argv[1])[0].astype(np.float64)
ref = np.array(json.load(open(sys.argv[2]))["logits"][0], dtype=np.float64)
rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
print(f"reference without {sys.argv[4]}: relative L2 {rel:.2e}")
assert rel > 100 * float(sys.argv[3]), f"dropping {sys.argv[4]} changes nothing the test can see"
PYEOF
done

# EXL3 at 4 bpw (the head at 16 bits, as the demo models convert), peaked.
"$BIN" make-test-model --arch deepseek-v3 --seed 5 --peaked-logits --out "$TMP/peaked" >/dev/null
"$PY" "$REF" "$TMP/peaked" "$PROMPT" "$STEPS" >"$TMP/peaked-ref.json"
gen "$TMP/peaked" "$TMP/pk"
compare "$TMP/pk.npy" "$TMP/peaked-ref.json" "$REL_FP32" "deepseek-v3 peaked bf16" --ids "$TMP/pk.ids"
KV_BITS=8 gen "$TMP/peaked" "$TMP/pk8"
compare "$TMP/pk8.npy" "$TMP/peaked-ref.json" "$REL_INT8_KV" "deepseek-v3 peaked bf16, int8 latent cache" \
  --ids "$TMP/pk8.ids"
"$BIN" convert --in "$TMP/peaked" --out "$TMP/ds-exl3" --bits 4 --head-bits 16 >"$TMP/convert.log" 2>&1 ||
  { echo "FAIL: convert"; tail -20 "$TMP/convert.log"; exit 1; }
"$PY" - "$TMP/ds-exl3" <<'PYEOF'
import json, struct, sys, glob
header = {}
for f in glob.glob(sys.argv[1] + "/*.safetensors"):
    with open(f, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header.update(json.loads(fh.read(n)))
names = set(header)
want_exl3 = ["model.layers.0.mlp.gate_proj", "model.layers.1.self_attn.q_a_proj",
             "model.layers.1.self_attn.q_b_proj", "model.layers.1.self_attn.kv_a_proj_with_mqa",
             "model.layers.2.self_attn.o_proj", "model.layers.1.mlp.experts.11.down_proj",
             "model.layers.2.mlp.shared_experts.up_proj"]
for key in want_exl3:
    assert key + ".trellis" in names, key
kv_b = header["model.layers.1.self_attn.kv_b_proj.weight"]
assert kv_b["dtype"] == "F16" and kv_b["shape"] == [5 * (24 + 20), 56], kv_b
assert "model.layers.1.self_attn.kv_b_proj.trellis" not in names
for plain in ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
              "model.layers.1.self_attn.q_a_layernorm.weight", "model.layers.1.self_attn.kv_a_layernorm.weight"]:
    assert plain in names, plain
assert not any(n.startswith("model.layers.3.") for n in names), "MTP layer written"
print("convert: q_a/q_b/kv_a/o, dense MLP, experts and shared experts EXL3; kv_b_proj fp16 [220, 56]; "
      "router, bias, norms 16-bit; MTP not written")
PYEOF
"$BIN" inspect "$TMP/ds-exl3" >"$TMP/inspect.txt"
grep -q "mla: q_lora_rank 72, kv_lora_rank 56, q/k head 24 nope + 16 rope, v 20" "$TMP/inspect.txt" ||
  { echo "FAIL: inspect"; head "$TMP/inspect.txt"; exit 1; }
gen "$TMP/ds-exl3" "$TMP/q"
compare "$TMP/q.npy" "$TMP/peaked-ref.json" "$REL_EXL3_MAX" "deepseek-v3 peaked exl3 4bpw" \
  --ids "$TMP/q.ids" "$REL_EXL3_MEAN"

# Parallel: the TP 1 greedy ids at TP 2, TP 3, EP 2 and TP 2 x EP 2.
for model in ds ds-exl3; do
  [ $model = ds ] && base="$TMP/fp" || base="$TMP/q"
  for par in "--tp 2" "--tp 3" "--tp 2 --ep 2" "--tp 4 --ep 2" "--tp 3 --capacities 2,1,0.5"; do
    # shellcheck disable=SC2086
    gen "$TMP/$model" "$TMP/par" $par --threads-per-rank 1
    cmp -s "$TMP/par.ids" "$base.ids" ||
      { echo "FAIL: $model $par: $(cat "$TMP/par.ids") != $(cat "$base.ids")"; exit 1; }
    echo "$model $par: greedy ids equal to TP 1"
  done
done
echo "deepseek-v3 reference: OK"
