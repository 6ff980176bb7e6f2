#!/usr/bin/env bash
# --prefill-precision / --decode-precision end to end: a peaked-logits Llama
# test model converted to EXL3 (mul1, 3 bits); `generate --tp 2
# --decode-precision int8 --prefill-precision bf16` (a 20-token prompt, so the
# prefill runs bf16 and every decode step int8 on both rank processes) gives
# the same greedy tokens as one exact rank, its logits (checked by numpy)
# within the int8 bound, and both ranks log the precisions they run; a value
# outside the lists is a command-line error (CLI11's validation exit code, not
# 0 or 1) naming the flag and the values it takes.
set -euo pipefail
BIN=$1
PY=/usr/bin/python3
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$BIN" make-test-model --arch llama --peaked-logits --seed 5 --out "$TMP/hf" >/dev/null
"$BIN" convert --in "$TMP/hf" --out "$TMP/exl3" --bits 3 --codebook mul1 --threads 2 \
  --no-progress >/dev/null
PROMPT=5,17,230,41,9,77,310,12,64,101,3,250,18,90,400,33,7,61,222,15
common=(generate --model "$TMP/exl3" --prompt-ids "$PROMPT" --ids --max-tokens 24 --ignore-eos)

exact=$("$BIN" --log-level warning "${common[@]}" --decode-precision fp32 --logits-out "$TMP/exact.npy")
tp=$("$BIN" "${common[@]}" --tp 2 --decode-precision int8 --prefill-precision bf16 \
     --logits-out "$TMP/tp.npy" 2>"$TMP/tp.log") || { cat "$TMP/tp.log" >&2; fail "tp 2 run"; }
[ "$tp" = "$exact" ] || fail "greedy tokens differ: exact '$exact', tp2 int8/bf16 '$tp'"
for r in 0 1; do
  grep -q "rank $r: precision prefill=bf16 decode=int8" "$TMP/tp.log" ||
    fail "rank $r did not log its precisions: $(cat "$TMP/tp.log")"
done
single=$("$BIN" --log-level warning "${common[@]}" --decode-precision int8 \
         --logits-out "$TMP/single.npy")
[ "$single" = "$exact" ] || fail "single-rank int8 tokens differ: '$single' vs '$exact'"

"$PY" - "$TMP/exact.npy" "$TMP/tp.npy" "$TMP/single.npy" <<'PYEOF'
import sys
import numpy as np
exact = np.load(sys.argv[1]).astype(np.float64)
for name, path in (("tp2 int8 decode + bf16 prefill", sys.argv[2]), ("1 rank int8 decode", sys.argv[3])):
    got = np.load(path).astype(np.float64)
    assert got.shape == exact.shape and np.all(np.isfinite(got)), (got.shape, exact.shape)
    err = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    print(f"{name}: logits relative L2 error vs 1 rank fp32 {err:.3g}")
    # Bound of tests/worker/linear_prefill_test.cc (kInt8DecodeLogitsBound).
    assert 0 < err <= 6e-2, err
PYEOF

# Values outside the lists: CLI11 refuses them before anything runs, naming the flag.
for cmd in "generate --model $TMP/exl3 --prompt-ids 1" "serve --model $TMP/exl3" "worker --rank 0"; do
  for flag in "--decode-precision int4" "--decode-precision bf16" "--prefill-precision int8"; do
    set +e
    "$BIN" $cmd $flag >"$TMP/out.txt" 2>"$TMP/err.txt"
    rc=$?
    set -e
    [ $rc -ne 0 ] && [ $rc -ne 1 ] || fail "$cmd $flag: exit $rc, want a command-line error: $(cat "$TMP/err.txt")"
    grep -q -- "${flag% *}: ${flag#* } not in {" "$TMP/err.txt" || fail "$cmd $flag: message: $(cat "$TMP/err.txt")"
  done
done
echo "precision flags ok"
