#!/usr/bin/env bash
# Real text end to end: stories260K (../shared) imported with its tokenizer and
# converted to EXL3 at 4 bpw, served on a 2-rank cluster (`serve --tp 2`);
# a greedy "Once upon a time" continuation through the gRPC API
#   * from the unquantized model equals an independent float64 NumPy forward
#     of the llama2.c file (tests/cli/eval_reference.py --greedy), all 32 tokens;
#   * from the 4 bpw model agrees with it for at least as many tokens as the
#     model's measured top-1 agreement predicts (1 / (1 - top-1), from
#     `exl3serve eval --reference`), and reads as English: every word of it
#     occurs in the TinyStories text.
# A trap stops the servers and their ranks on any exit.
set -uo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
SHARED=${EXL3_SHARED_DIR:-$SRC/../shared}
STORIES=$SHARED/models/stories260K
TEXT=$SHARED/testdata/text/tinystories_valid_first1000.txt
[ -f "$STORIES/stories260K.bin" ] && [ -f "$TEXT" ] || { echo "SKIP: $STORIES or $TEXT not found"; exit 77; }
/usr/bin/python3 -c 'import numpy' 2>/dev/null || { echo "SKIP: no numpy for /usr/bin/python3"; exit 77; }
WORK=$(mktemp -d)
source "$SRC/tests/cli/lib/serve.sh"
cleanup() { serve_stop >/dev/null 2>&1; rm -rf "$WORK"; }
trap cleanup EXIT
trap 'exit 1' INT TERM
fail() { echo "FAIL: $*"; for f in "$WORK"/*.log; do [ -f "$f" ] && tail -20 "$f"; done; exit 1; }
N=32

serve_continuation() {  # serve_continuation MODEL OUT: the continuation's ids into OUT
  serve_start "$1" --tp 2
  "$BIN" client --addr "$ADDR" --prompt "Once upon a time" --add-special-tokens --temperature 0 \
    --max-tokens $N --ignore-eos --ids >"$2" || fail "client on $1"
  serve_stop || fail "serve $1 exited non-zero"
}

"$BIN" import-llama2c --in "$STORIES/stories260K.bin" --tokenizer "$STORIES/tok512.bin" --out "$WORK/hf" \
  >/dev/null || fail "import"
"$BIN" convert --in "$WORK/hf" --out "$WORK/q4" --bits 4 --threads 2 --no-progress >/dev/null || fail "convert"
prompt=$("$BIN" tokenize --model "$WORK/hf" --text "Once upon a time" | tr -d '[] ')
want=$(/usr/bin/python3 "$SRC/tests/cli/eval_reference.py" --greedy "$STORIES/stories260K.bin" "1,$prompt" $N) ||
  fail "float64 reference"

serve_continuation "$WORK/hf" "$WORK/hf.ids"
got=$(echo $(cat "$WORK/hf.ids"))
[ "$got" = "$want" ] || fail "unquantized served '$got' != float64 reference '$want'"
text=$("$BIN" tokenize --model "$WORK/hf" --decode "$(echo $want | tr ' ' ',')")
echo "unquantized, $N tokens = float64 reference: Once upon a time$text"

serve_continuation "$WORK/q4" "$WORK/q4.ids"
q4=$(echo $(cat "$WORK/q4.ids"))
"$BIN" --log-level warning eval --model "$WORK/q4" --reference "$WORK/hf" --text "$TEXT" --range second-half \
  --max-tokens 2000 --json "$WORK/q4.json" --no-progress >/dev/null || fail "eval"
q4_text=$("$BIN" tokenize --model "$WORK/hf" --decode "$(echo $q4 | tr ' ' ',')")
/usr/bin/python3 - "$WORK/q4.json" "$want" "$q4" "$q4_text" "$TEXT" <<'PY' || fail "4 bpw continuation"
import json, re, sys
top1 = json.load(open(sys.argv[1]))["reference"]["top1_agreement"]
want, got, text = sys.argv[2].split(), sys.argv[3].split(), sys.argv[4]
same = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
predicted = int(1 / max(1e-9, 1 - top1))
words = set(re.findall(r"[a-z]+", open(sys.argv[5]).read().lower()))
unknown = [w for w in re.findall(r"[a-z]+", text.lower()) if w not in words]
print(f"4 bpw: first {same} of {len(want)} tokens equal the reference (top-1 {100 * top1:.1f} % predicts "
      f">= {predicted}); text: Once upon a time{text}")
assert len(got) == len(want), got
assert same >= predicted, (same, predicted)
assert not unknown, unknown
PY
echo "stories_serve_test: OK"
