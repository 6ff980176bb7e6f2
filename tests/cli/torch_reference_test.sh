#!/usr/bin/env bash
# The unquantized path against an independent implementation: PyTorch (Debian's
# python3-torch, CPU) running tests/reference/torch_forward.py — a reference
# forward written from the published model equations — on the same
# safetensors. Last-position logits of a 17-token prompt must agree within
# 1e-4 relative L2 (fp32, fp32 KV cache), for Llama and Qwen3.
# Exit 77 (skip) when python3-torch is not installed.
set -euo pipefail
BIN=$1
PY=/usr/bin/python3
"$PY" -c "import torch, numpy" 2>/dev/null || { echo "SKIP: /usr/bin/python3 lacks torch (python3-torch)"; exit 77; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
PROMPT=1,17,202,5,99,3,250,7,61,128,33,4,190,8,77,11,2
for arch in llama qwen3; do
  "$BIN" make-test-model --arch "$arch" --layers 2 --hidden 256 --intermediate 384 --vocab 300 \
    --seed 3 --out "$TMP/$arch" >/dev/null
  "$BIN" generate --model "$TMP/$arch" --prompt-ids "$PROMPT" --ids --max-tokens 1 --kv-bits 32 \
    --logits-out "$TMP/$arch.npy" >/dev/null
  "$PY" "${EXL3_SOURCE_DIR}/tests/reference/torch_forward.py" "$TMP/$arch" "$PROMPT" >"$TMP/$arch.json"
  "$PY" - "$TMP/$arch.npy" "$TMP/$arch.json" "$arch" <<'PYEOF'
import json, sys
import numpy as np
ours = np.load(sys.argv[1])[0].astype(np.float64)
ref = np.array(json.load(open(sys.argv[2])), dtype=np.float64)
assert ours.shape == ref.shape, (ours.shape, ref.shape)
rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
print(f"{sys.argv[3]}: relative L2 vs PyTorch {rel:.2e}")
assert rel <= 1e-4, rel
PYEOF
done
echo "torch reference: OK"
