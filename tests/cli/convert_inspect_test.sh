#!/usr/bin/env bash
# End to end through the binary: make-test-model -> convert -> inspect ->
# inspect --dequant, with the .npy checked from outside by numpy against the
# source safetensors (read by a few lines of independent Python), plus the
# exit codes and messages of bad invocations.
set -euo pipefail
BIN=$1
PY=/usr/bin/python3
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$BIN" make-test-model --arch llama --layers 1 --hidden 128 --intermediate 256 --vocab 300 \
  --out "$TMP/hf" >/dev/null
"$BIN" convert --in "$TMP/hf" --out "$TMP/exl3" --bits 4 --threads 2 --no-progress >"$TMP/convert.txt"
grep -q "model.layers.0.mlp.down_proj" "$TMP/convert.txt" || fail "convert table lacks down_proj"
grep -q "bits per weight: 4.000" "$TMP/convert.txt" || fail "convert did not report 4.000 bpw"

"$BIN" inspect "$TMP/exl3" >"$TMP/inspect.txt"
grep -q "average bits per weight: 4.000" "$TMP/inspect.txt" || fail "inspect bpw"
grep -qE "lm_head +128 x 384 +6 +mul1" "$TMP/inspect.txt" || { cat "$TMP/inspect.txt"; fail "inspect head row"; }

"$BIN" inspect "$TMP/exl3" --dequant model.layers.0.mlp.down_proj --out "$TMP/down.npy" >/dev/null
"$PY" - "$TMP/down.npy" "$TMP/hf/model.safetensors" <<'PYEOF'
import json, struct, sys
import numpy as np
w = np.load(sys.argv[1])
assert w.dtype == np.float32 and w.shape == (128, 256), (w.dtype, w.shape)
raw = open(sys.argv[2], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
t = header["model.layers.0.mlp.down_proj.weight"]
assert t["dtype"] == "BF16"
b, e = t["data_offsets"]
bits = np.frombuffer(raw[8 + n + b:8 + n + e], dtype="<u2").astype(np.uint32) << 16
src = bits.view(np.float32).reshape(t["shape"])
rel = np.linalg.norm(w - src) / np.linalg.norm(src)
print(f"down_proj relative error from outside: {rel:.5f}")
assert 0.0 < rel < 1.6 * 2.0 ** -4, rel   # K = 4: about 2^-K
PYEOF

# Bad invocations: exit 1 with a one-line message naming the problem; never a crash.
set +e
"$BIN" inspect "$TMP/nope" 2>"$TMP/err.txt"; rc=$?
set -e
[ $rc = 1 ] || fail "inspect of a missing dir exited $rc"
grep -q "config.json" "$TMP/err.txt" || fail "missing-dir message: $(cat "$TMP/err.txt")"
set +e
"$BIN" convert --in "$TMP/hf" --out "$TMP/exl3" --bits 4 --no-progress 2>"$TMP/err.txt"; rc=$?
set -e
[ $rc = 1 ] || fail "convert into a non-empty dir exited $rc"
grep -q "not empty" "$TMP/err.txt" || fail "non-empty message: $(cat "$TMP/err.txt")"
set +e
"$BIN" inspect "$TMP/exl3" --dequant no.such.layer --out "$TMP/x.npy" 2>"$TMP/err.txt"; rc=$?
set -e
[ $rc = 1 ] || fail "dequant of an unknown layer exited $rc"
grep -q "no layer" "$TMP/err.txt" || fail "unknown-layer message"
printf 'garbage' >"$TMP/exl3/model.safetensors"
set +e
"$BIN" inspect "$TMP/exl3" 2>"$TMP/err.txt"; rc=$?
set -e
[ $rc = 1 ] || fail "inspect of a corrupt file exited $rc"
grep -q "model.safetensors" "$TMP/err.txt" || fail "corrupt-file message: $(cat "$TMP/err.txt")"
echo "convert/inspect end to end: OK"
