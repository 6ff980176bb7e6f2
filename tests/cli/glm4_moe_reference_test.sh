#!/usr/bin/env bash
# Glm4MoeForCausalLM (issue 19 part 1) against an independent float64 NumPy
# forward written from the transformers definition
# (tests/reference/glm4_moe_forward.py), on `make-test-model --arch glm4-moe`:
# hidden 200, head_dim 48 != 200/6, half of each head rotated, q/k/v bias,
# q/k norm, 12 experts in 4 groups of which 2 are kept, a non-zero
# correction bias, one shared expert, layer 0 dense, one MTP layer in the
# checkpoint.
#   * unquantized (bf16 weights, fp32 activations, fp32 KV): each of the 64
#     generated steps' logits within REL_FP32 relative L2 of the reference,
#     and the 64 greedy ids equal;
#   * the reference is sensitive to every GLM feature: with any one of them
#     dropped (correction bias, groups, partial rotary, q/k norm, q/k/v bias,
#     shared expert, routed scaling) its logits miss ours by > 100 x REL_FP32,
#     so the check above would fail without it;
#   * EXL3 4 bpw (head 16 bit) of the --peaked-logits variant (large logit
#     margins): logits within REL_EXL3_MEAN (mean over 64 steps) and
#     REL_EXL3_MAX (any step) of the float64 reference of the bf16 weights,
#     greedy ids equal. (On the plain random model 4 bpw moves the logits by
#     ~0.3-0.7 relative already at the prompt, as it does for the llama and
#     qwen3-moe test models: their logits are near-random and amplify weight
#     error, so a bound there would say little.)
#   * TP 2, EP 2 and TP 2 x EP 2 (4 ranks) give the TP 1 greedy ids,
#     unquantized (random model) and EXL3 (peaked model).
# Needs /usr/bin/python3 with NumPy (else exit 77 = skip).
set -euo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
PY=/usr/bin/python3
"$PY" -c "import numpy" 2>/dev/null || { echo "SKIP: /usr/bin/python3 lacks numpy"; exit 77; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
REF="$SRC/tests/reference/glm4_moe_forward.py"
REL_FP32=1e-5   # fp32 activations vs float64, same bf16 weights
REL_EXL3_MEAN=0.08  # 4 bpw, peaked model: measured mean 0.040, max 0.117 (seed 5)
REL_EXL3_MAX=0.25
PROMPT=1,17,202,5,99,3,250,7,61,128,33,4,190,8,77,11,2
STEPS=64

"$BIN" make-test-model --arch glm4-moe --seed 5 --out "$TMP/glm" >/dev/null
"$PY" "$REF" "$TMP/glm" "$PROMPT" "$STEPS" >"$TMP/ref.json"

gen() {  # gen MODEL OUT_PREFIX [flags...]: greedy ids (and .npy logits) of the prompt
  local model=$1 out=$2
  shift 2
  "$BIN" generate --model "$model" --prompt-ids "$PROMPT" --ids --max-tokens "$STEPS" \
    --ignore-eos --kv-bits 32 --logits-out "$out.npy" "$@" 2>"$out.log" | tr -s ' \n' ',' >"$out.ids" ||
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
"$PY" - "$TMP/glm/model.safetensors" <<'PYEOF'
import json, struct, sys
raw = open(sys.argv[1], "rb").read(8 + 10**6)
header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
assert "model.layers.3.eh_proj.weight" in header and "model.layers.2.mlp.gate.e_score_correction_bias" in header
PYEOF

# Unquantized.
gen "$TMP/glm" "$TMP/fp"
grep -q "MTP" "$TMP/fp.log" || { echo "FAIL: no MTP log line"; cat "$TMP/fp.log"; exit 1; }
compare "$TMP/fp.npy" "$TMP/ref.json" "$REL_FP32" "glm4-moe bf16" --ids "$TMP/fp.ids"

# Each feature matters: the reference without it misses ours by far.
"$BIN" generate --model "$TMP/glm" --prompt-ids "$PROMPT" --ids --max-tokens 1 --kv-bits 32 \
  --logits-out "$TMP/one.npy" >/dev/null 2>&1
for what in correction_bias groups partial_rotary qk_norm bias shared_expert scaling; do
  "$PY" "$REF" "$TMP/glm" "$PROMPT" 1 --ablate "$what" >"$TMP/ablate.json"
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
"$BIN" make-test-model --arch glm4-moe --seed 5 --peaked-logits --out "$TMP/peaked" >/dev/null
"$PY" "$REF" "$TMP/peaked" "$PROMPT" "$STEPS" >"$TMP/peaked-ref.json"
gen "$TMP/peaked" "$TMP/pk"
compare "$TMP/pk.npy" "$TMP/peaked-ref.json" "$REL_FP32" "glm4-moe peaked bf16" --ids "$TMP/pk.ids"
"$BIN" convert --in "$TMP/peaked" --out "$TMP/glm-exl3" --bits 4 --head-bits 16 >"$TMP/convert.log" 2>&1 ||
  { echo "FAIL: convert"; tail -20 "$TMP/convert.log"; exit 1; }
"$PY" - "$TMP/glm-exl3" <<'PYEOF'
import json, struct, sys, glob
names = set()
for f in glob.glob(sys.argv[1] + "/*.safetensors"):
    raw = open(f, "rb").read(8)
    with open(f, "rb") as fh:
        fh.seek(8)
        names |= set(json.loads(fh.read(struct.unpack("<Q", raw)[0])))
want_exl3 = ["model.layers.0.mlp.gate_proj", "model.layers.1.self_attn.q_proj",
             "model.layers.1.mlp.experts.11.down_proj", "model.layers.2.mlp.shared_experts.up_proj"]
for key in want_exl3:
    assert key + ".trellis" in names, key
for plain in ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
              "model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.k_norm.weight"]:
    assert plain in names, plain
assert not any(n.startswith("model.layers.3.") for n in names), "MTP layer written"
print("convert: attention, dense MLP, experts and shared experts EXL3; router, bias, norms 16-bit; MTP not written")
PYEOF
"$BIN" inspect "$TMP/glm-exl3" >"$TMP/inspect.txt"
grep -q "shared expert width 160; 1 MTP" "$TMP/inspect.txt" || { echo "FAIL: inspect"; head "$TMP/inspect.txt"; exit 1; }
gen "$TMP/glm-exl3" "$TMP/q"
compare "$TMP/q.npy" "$TMP/peaked-ref.json" "$REL_EXL3_MAX" "glm4-moe peaked exl3 4bpw" \
  --ids "$TMP/q.ids" "$REL_EXL3_MEAN"

# Parallel: the TP 1 greedy ids at TP 2, TP 3 (6 query heads 2/2/2 over 2 KV
# heads: rank 1 needs both, replicated; experts 3 groups), EP 2 and TP 2 x EP 2.
for model in glm glm-exl3; do
  [ $model = glm ] && base="$TMP/fp" || base="$TMP/q"
  for par in "--tp 2" "--tp 3" "--tp 2 --ep 2" "--tp 4 --ep 2"; do
    # shellcheck disable=SC2086
    gen "$TMP/$model" "$TMP/par" $par --threads-per-rank 1
    cmp -s "$TMP/par.ids" "$base.ids" ||
      { echo "FAIL: $model $par: $(cat "$TMP/par.ids") != $(cat "$base.ids")"; exit 1; }
    echo "$model $par: greedy ids equal to TP 1"
  done
done
echo "glm4-moe reference: OK"
