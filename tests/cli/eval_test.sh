#!/usr/bin/env bash
# `exl3serve eval` on the real stories260K (../shared): its perplexity on the
# second half of the TinyStories validation text agrees with an independent
# float64 NumPy forward of the llama2.c file (tests/cli/eval_reference.py)
# over the same windows within 0.1 %; the model against itself has KL 0 and
# top-1 100 %; a 4-bit EXL3 conversion against the original has KL > 0, and
# the same figures through TP = 2; JSON output; bad flags are clear errors.
set -euo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
SHARED=${EXL3_SHARED_DIR:-$SRC/../shared}
STORIES=$SHARED/models/stories260K
TEXT=$SHARED/testdata/text/tinystories_valid_first1000.txt
[ -f "$STORIES/stories260K.bin" ] && [ -f "$TEXT" ] || { echo "SKIP: $STORIES or $TEXT not found"; exit 77; }
/usr/bin/python3 -c 'import numpy' 2>/dev/null || { echo "SKIP: no numpy for /usr/bin/python3"; exit 77; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$BIN" import-llama2c --in "$STORIES/stories260K.bin" --tokenizer "$STORIES/tok512.bin" --out "$TMP/hf" >/dev/null
"$BIN" eval --model "$TMP/hf" --text "$TEXT" --range second-half --max-tokens 3000 --context 256 \
  --stride 96 --json "$TMP/hf.json" --ids-out "$TMP/ids.json" --no-progress >"$TMP/hf.txt"
cat "$TMP/hf.txt"
read -r ref_ppl ref_scored < <(/usr/bin/python3 "$SRC/tests/cli/eval_reference.py" \
  "$STORIES/stories260K.bin" "$TMP/ids.json" 256 96)
/usr/bin/python3 - "$TMP/hf.json" "$ref_ppl" "$ref_scored" <<'PY' || fail "perplexity vs the float64 reference"
import json, sys
got = json.load(open(sys.argv[1]))
ref, scored = float(sys.argv[2]), int(sys.argv[3])
rel = abs(got["perplexity"] - ref) / ref
print(f"eval perplexity {got['perplexity']:.6f} vs float64 NumPy {ref:.6f} over {scored} tokens: {100 * rel:.4f} %")
assert got["tokens_scored"] == scored == 3000, (got["tokens_scored"], scored)
assert rel < 1e-3, rel
PY

# Against itself: KL 0, top-1 100 %.
"$BIN" eval --model "$TMP/hf" --reference "$TMP/hf" --text "$TEXT" --max-tokens 600 --json "$TMP/self.json" \
  --no-progress >/dev/null
/usr/bin/python3 -c "
import json; r = json.load(open('$TMP/self.json'))['reference']
assert r['kl_mean'] < 1e-9 and r['top1_agreement'] == 1.0, r
print('self: KL', r['kl_mean'], 'top-1', r['top1_agreement'])" || fail "self comparison"

# EXL3 4 bpw vs the original, one rank and TP = 2: the same figures.
"$BIN" convert --in "$TMP/hf" --out "$TMP/q4" --bits 4 --threads 2 --no-progress >/dev/null
for tp in 1 2; do
  "$BIN" --log-level warning eval --model "$TMP/q4" --reference "$TMP/hf" --text "$TEXT" --range second-half \
    --max-tokens 1500 --tp $tp --json "$TMP/q4-tp$tp.json" --no-progress >/dev/null
done
/usr/bin/python3 - "$TMP/q4-tp1.json" "$TMP/q4-tp2.json" <<'PY' || fail "4-bit KL / TP agreement"
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:])
ra, rb = a["reference"], b["reference"]
print(f"4 bpw: ppl {a['perplexity']:.4f} (ref {ra['perplexity']:.4f}), KL {ra['kl_mean']:.5f} "
      f"p99 {ra['kl_p99']:.5f}, top-1 {100 * ra['top1_agreement']:.2f} %; TP 2 KL {rb['kl_mean']:.5f}")
assert 0 < ra["kl_mean"] < 1.0 and 0.5 < ra["top1_agreement"] < 1.0, ra
assert abs(ra["kl_mean"] - rb["kl_mean"]) < 1e-4 * max(1.0, ra["kl_mean"]), (ra, rb)
assert abs(a["perplexity"] - b["perplexity"]) < 1e-4 * a["perplexity"], (a, b)
PY

if "$BIN" eval --model "$TMP/hf" --text "$TEXT" --stride 300 --context 256 2>"$TMP/err.txt"; then
  fail "--stride > --context accepted"
fi
grep -q "is larger than --context" "$TMP/err.txt" || fail "stride message: $(cat "$TMP/err.txt")"
if "$BIN" eval --model "$TMP/hf" --text "$TMP/missing.txt" 2>"$TMP/err.txt"; then fail "missing text accepted"; fi
grep -q "cannot open" "$TMP/err.txt" || fail "missing-file message: $(cat "$TMP/err.txt")"
echo "eval_test: OK"
