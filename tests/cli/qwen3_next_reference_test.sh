#!/usr/bin/env bash
# The Gated DeltaNet hybrids (issue 36 part 3) against an independent float64
# NumPy forward written from ../shared/docs/arch-gated-deltanet.md
# (tests/reference/qwen3_next_forward.py: the recurrence token by token), on
# `make-test-model --arch qwen3-next | qwen3.5 | qwen3.5-moe`: hidden 200, 4
# layers [linear x 3, full], Hk 2 / Hv 6 (G = 3, odd), dk 24 != dv 20, conv 4,
# gated attention of 6 heads of 48 over 2 KV heads with 12 dims rotated,
# (1 + w) norms, 8 experts top-2 and a gated shared expert, qwen3-next's
# layer 0 dense.
#   * unquantized (bf16 weights, fp32 activations and state, fp32 KV): each
#     of the 64 generated steps' logits within REL_MAX (mean within
#     REL_MEAN) relative L2 of the reference, the 64 greedy ids equal;
#   * the reference is sensitive to every mechanism: with any one dropped
#     (output gate, zero-centred norms, q/k L2 norm, conv, decay, head
#     grouping, shared-expert gate) its logits miss ours by > 100 x REL_MAX;
#   * the same weights in the fused (Qwen3-Next) and the split (Qwen3.5)
#     layout give bit-identical logits;
#   * EXL3 4 bpw (head 16 bit) of the --peaked-logits model: greedy ids of
#     the float64 reference of the bf16 weights;
#   * TP 2, TP 3, EP 2 and TP 2 x EP 2 give the TP 1 greedy ids, unquantized
#     and EXL3;
#   * `plan` splits the linear-attention layers by key heads;
#   * bad configs are clear errors naming the field.
# Needs /usr/bin/python3 with NumPy (else exit 77 = skip).
set -euo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
PY=/usr/bin/python3
"$PY" -c "import numpy" 2>/dev/null || { echo "SKIP: /usr/bin/python3 lacks numpy"; exit 77; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
REF="$SRC/tests/reference/qwen3_next_forward.py"
# fp32 activations and state vs float64, same bf16 weights: measured max
# 1.66e-5 / mean 2.45e-6 (qwen3-next), 5.2e-6 / 8.2e-7 (qwen3.5), 8.1e-6 /
# 1.3e-6 (qwen3.5-moe), seed 5, with the chunked recurrence (its in-chunk sums
# in float64; the recurrent form with float64 dots gave 2.5e-5 / 6.5e-6 / 9.3e-6).
REL_MAX=4e-5
REL_MEAN=6e-6
PROMPT=1,17,202,5,99,3,250,7,61,128,33,4,190,8,77,11,2
STEPS=64

gen() {  # gen MODEL OUT_PREFIX [flags...]: greedy ids (and .npy logits) of the prompt
  local model=$1 out=$2
  shift 2
  "$BIN" generate --model "$model" --prompt-ids "$PROMPT" --ids --max-tokens "$STEPS" \
    --ignore-eos --kv-bits 32 --logits-out "$out.npy" "$@" 2>"$out.log" | tr -s ' \n' ',' >"$out.ids" ||
    { echo "FAIL: generate $model $*"; tail -20 "$out.log"; exit 1; }
}

compare() {  # compare NPY REF.json NAME [IDS_FILE]: tolerances above
  "$PY" - "$@" "$REL_MAX" "$REL_MEAN" <<'PYEOF'
import json, sys
import numpy as np
npy, ref_path, name = sys.argv[1:4]
ids_path = sys.argv[4] if len(sys.argv) > 6 else None
rel_max, rel_mean = float(sys.argv[-2]), float(sys.argv[-1])
ours = np.load(npy).astype(np.float64)
ref = json.load(open(ref_path))
logits = np.array(ref["logits"], dtype=np.float64)
assert len(ours) == len(logits), (len(ours), len(logits))
rel = [np.linalg.norm(ours[i] - logits[i]) / np.linalg.norm(logits[i]) for i in range(len(logits))]
print(f"{name}: {len(rel)} steps, relative L2 vs float64 reference: max {max(rel):.2e}, mean {np.mean(rel):.2e}")
assert max(rel) <= rel_max, f"{name}: max {max(rel):.3e} > {rel_max}"
assert np.mean(rel) <= rel_mean, f"{name}: mean {np.mean(rel):.3e} > {rel_mean}"
if ids_path:
    ids = [int(t) for t in open(ids_path).read().strip().strip(",").split(",")]
    assert ids == ref["ids"], (ids, ref["ids"])
    print(f"{name}: {len(ids)} greedy ids equal to the reference")
PYEOF
}

same_ids() {  # same_ids A B NAME
  cmp -s "$1" "$2" || { echo "FAIL: $3: greedy ids differ"; cat "$1"; echo; cat "$2"; echo; exit 1; }
  echo "$3: greedy ids equal"
}

for arch in qwen3-next qwen3.5 qwen3.5-moe; do
  "$BIN" make-test-model --arch "$arch" --seed 5 --out "$TMP/$arch" >/dev/null
  "$PY" "$REF" "$TMP/$arch" "$PROMPT" "$STEPS" >"$TMP/$arch.ref.json"
  gen "$TMP/$arch" "$TMP/$arch"
  compare "$TMP/$arch.npy" "$TMP/$arch.ref.json" "$arch bf16" "$TMP/$arch.ids"
done

# The reference is sensitive to each mechanism (4 steps suffice).
for ablate in gate zero_centred l2norm conv decay grouping shared_gate; do
  "$PY" "$REF" "$TMP/qwen3-next" "$PROMPT" 4 --ablate "$ablate" >"$TMP/ablate.json"
  "$PY" - "$TMP/qwen3-next.npy" "$TMP/ablate.json" "$ablate" "$REL_MAX" <<'PYEOF'
import json, sys
import numpy as np
ours = np.load(sys.argv[1]).astype(np.float64)
logits = np.array(json.load(open(sys.argv[2]))["logits"], dtype=np.float64)
rel = max(np.linalg.norm(ours[i] - logits[i]) / np.linalg.norm(logits[i]) for i in range(len(logits)))
print(f"reference without {sys.argv[3]}: misses ours by {rel:.2e}")
assert rel > 100 * float(sys.argv[4]), f"the reference is insensitive to {sys.argv[3]}"
PYEOF
done

# The same weights in the split (Qwen3.5-MoE) layout: bit-identical logits.
"$PY" - "$TMP/qwen3-next" "$TMP/split" <<'PYEOF'
import json, os, struct, sys
import numpy as np
src, dst = sys.argv[1:3]
os.makedirs(dst, exist_ok=True)
cfg = json.load(open(f"{src}/config.json"))
raw = open(f"{src}/model.safetensors", "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
def tensor(name):
    t = header[name]
    b, e = t["data_offsets"]
    dt = {"BF16": "<u2", "F16": "<u2", "F32": "<f4"}[t["dtype"]]
    return t["dtype"], np.frombuffer(raw[8 + n + b:8 + n + e], dtype=dt).reshape(t["shape"])
hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
dk, dv, g = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], hv // hk
out = {}
for name in header:
    if name == "__metadata__":
        continue
    dtype, a = tensor(name)
    new = name if name.startswith("lm_head") else "model.language_model." + name[len("model."):]
    if name.endswith("in_proj_qkvz.weight"):
        grp = a.reshape(hk, 2 * dk + 2 * g * dv, -1)
        q, k = grp[:, :dk], grp[:, dk:2 * dk]
        v, z = grp[:, 2 * dk:2 * dk + g * dv], grp[:, 2 * dk + g * dv:]
        h = a.shape[1]
        out[new.replace("in_proj_qkvz", "in_proj_qkv")] = (dtype, np.concatenate(
            [q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)]))
        out[new.replace("in_proj_qkvz", "in_proj_z")] = (dtype, z.reshape(-1, h))
    elif name.endswith("in_proj_ba.weight"):
        grp = a.reshape(hk, 2 * g, -1)
        h = a.shape[1]
        out[new.replace("in_proj_ba", "in_proj_b")] = (dtype, grp[:, :g].reshape(-1, h))
        out[new.replace("in_proj_ba", "in_proj_a")] = (dtype, grp[:, g:].reshape(-1, h))
    else:
        out[new] = (dtype, a)
hdr, blobs, off = {}, [], 0
for name, (dtype, a) in out.items():
    b = np.ascontiguousarray(a).tobytes()
    hdr[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
    blobs.append(b)
    off += len(b)
h = json.dumps(hdr).encode()
h += b" " * (-len(h) % 8)
with open(f"{dst}/model.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
text = dict(cfg)
for k in ("architectures", "partial_rotary_factor", "rope_theta", "norm_topk_prob"):
    text.pop(k, None)
text["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_theta"],
                           "partial_rotary_factor": cfg["partial_rotary_factor"]}
json.dump({"architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": text,
           "tie_word_embeddings": cfg["tie_word_embeddings"]}, open(f"{dst}/config.json", "w"))
PYEOF
gen "$TMP/split" "$TMP/split"
"$PY" - "$TMP/qwen3-next.npy" "$TMP/split.npy" <<'PYEOF'
import sys
import numpy as np
a, b = np.load(sys.argv[1]), np.load(sys.argv[2])
assert a.shape == b.shape and np.array_equal(a, b), f"fused vs split: max |diff| {np.abs(a - b).max()}"
print(f"fused (Qwen3-Next) vs split (Qwen3.5) layout of the same weights: {a.shape[0]} steps of logits bit-identical")
PYEOF

# The plan splits the linear-attention layers by key heads (one each at 2 ranks).
"$BIN" plan --model "$TMP/qwen3-next" --ranks 2 >"$TMP/plan.txt" 2>&1 || { echo "FAIL: plan"; cat "$TMP/plan.txt"; exit 1; }
"$PY" - "$TMP/plan.txt" <<'PYEOF'
import sys
lines = open(sys.argv[1]).read().splitlines()
header = next(l for l in lines if l.startswith("rank "))
col = header.index("linear k heads")
rows = [l for l in lines if l[:4].strip().isdigit()]
got = [r[col:col + 14].split()[0] for r in rows]
assert got == ["[0,1)", "[1,2)"], got
print(f"plan --ranks 2: linear-attention key heads {got}")
PYEOF

# Tensor and expert parallelism: the TP 1 greedy ids.
for arch in qwen3-next qwen3.5-moe; do
  for par in "--tp 2" "--tp 3" "--ep 2" "--tp 4 --ep 2"; do
    gen "$TMP/$arch" "$TMP/par" $par
    same_ids "$TMP/par.ids" "$TMP/$arch.ids" "$arch bf16 $par"
  done
done

# EXL3 4 bpw of the peaked model (large logit margins): the reference's greedy
# ids, and TP 2 / TP 2 x EP 2 the TP 1 ids (default int8 decode).
"$BIN" make-test-model --arch qwen3-next --seed 6 --peaked-logits --out "$TMP/peaked" >/dev/null
"$PY" "$REF" "$TMP/peaked" "$PROMPT" "$STEPS" >"$TMP/peaked.ref.json"
"$BIN" convert --in "$TMP/peaked" --out "$TMP/peaked-exl3" --bits 4 --head-bits 16 >"$TMP/convert.log" 2>&1 ||
  { echo "FAIL: convert"; tail -20 "$TMP/convert.log"; exit 1; }
gen "$TMP/peaked-exl3" "$TMP/exl3" --decode-precision int8
"$PY" - "$TMP/exl3.ids" "$TMP/peaked.ref.json" <<'PYEOF'
import json, sys
ids = [int(t) for t in open(sys.argv[1]).read().strip().strip(",").split(",")]
ref = json.load(open(sys.argv[2]))["ids"]
same = sum(a == b for a, b in zip(ids, ref))
print(f"EXL3 4 bpw (int8 decode): greedy ids equal to the float64 reference of the bf16 weights at {same} of {len(ref)} steps")
assert ids == ref
PYEOF
for par in "--tp 2" "--tp 2 --ep 2"; do
  gen "$TMP/peaked-exl3" "$TMP/par" --decode-precision int8 $par
  same_ids "$TMP/par.ids" "$TMP/exl3.ids" "qwen3-next EXL3 int8 $par"
done

# Bad configs: clear errors naming the field.
bad() {  # bad KEY JSON_VALUE EXPECTED_SUBSTRING
  rm -rf "$TMP/bad" && cp -r "$TMP/qwen3-next" "$TMP/bad"
  "$PY" - "$TMP/bad/config.json" "$1" "$2" <<'PYEOF'
import json, sys
cfg = json.load(open(sys.argv[1]))
value = json.loads(sys.argv[3])
if value is None:
    cfg.pop(sys.argv[2], None)
else:
    cfg[sys.argv[2]] = value
json.dump(cfg, open(sys.argv[1], "w"))
PYEOF
  if "$BIN" generate --model "$TMP/bad" --prompt-ids 1,2 --max-tokens 1 >"$TMP/bad.log" 2>&1; then
    echo "FAIL: $1=$2 was accepted"; exit 1
  fi
  grep -qF -- "$3" "$TMP/bad.log" || { echo "FAIL: $1=$2: no \"$3\" in"; cat "$TMP/bad.log"; exit 1; }
  echo "bad $1=$2: $(grep -F -- "$3" "$TMP/bad.log" | head -1 | cut -c1-160)"
}
bad layer_types '["linear_attention","banana","linear_attention","full_attention"]' 'layer_types[1]'
bad linear_num_value_heads 5 'linear_num_value_heads'
bad linear_key_head_dim null 'linear_key_head_dim'
bad linear_conv_kernel_dim 3 'conv1d.weight'
rm -rf "$TMP/bad" && cp -r "$TMP/qwen3-next" "$TMP/bad"
"$PY" - "$TMP/bad/model.safetensors" <<'PYEOF'
import json, struct, sys
# Rename layer 1's A_log so the checkpoint lacks it.
raw = bytearray(open(sys.argv[1], "rb").read())
n = struct.unpack("<Q", raw[:8])[0]
header = raw[8:8 + n].decode()
assert "model.layers.1.linear_attn.A_log" in header
header = header.replace("model.layers.1.linear_attn.A_log", "model.layers.1.linear_attn.X_log")
raw[8:8 + n] = header.encode()
open(sys.argv[1], "wb").write(raw)
PYEOF
if "$BIN" generate --model "$TMP/bad" --prompt-ids 1,2 --max-tokens 1 >"$TMP/bad.log" 2>&1; then
  echo "FAIL: a checkpoint without A_log was accepted"; exit 1
fi
grep -q "linear_attn.A_log" "$TMP/bad.log" || { echo "FAIL: missing A_log not named"; cat "$TMP/bad.log"; exit 1; }
echo "missing A_log: $(grep -o "no tensor.*" "$TMP/bad.log" | head -1)"
echo "PASS"
