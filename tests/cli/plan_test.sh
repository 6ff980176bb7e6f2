#!/usr/bin/env bash
# `exl3serve plan` end to end: the plan of a small Llama test model over 3
# ranks (ranges checked against the split rules by hand: 4 query heads of
# head_dim 64 over 2 KV heads, 640 MLP channels, 1000 vocab rows), byte totals
# checked from outside against the safetensors headers (read by a few lines of
# independent Python), an EXL3 model, an MoE model on two boxes, and the exit
# codes and messages of bad invocations.
set -euo pipefail
BIN=$1
PY=/usr/bin/python3
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# Sum of the tensor bytes in a model directory's *.safetensors, from the headers.
stored_bytes() {
  "$PY" - "$1" <<'PYEOF'
import glob, json, struct, sys
total = 0
for path in glob.glob(sys.argv[1] + "/*.safetensors"):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    total += sum(t["data_offsets"][1] - t["data_offsets"][0]
                 for k, t in header.items() if k != "__metadata__")
print(total)
PYEOF
}

# Sum of the `bytes` column of the rank lines (the third field from the end:
# bytes, MiB, replicated MiB).
rank_bytes_sum() {
  awk '/^ *[0-9]+  /{sum += $(NF - 2)} END {printf "%d\n", sum}' "$1"
}

"$BIN" make-test-model --arch llama --out "$TMP/hf" >/dev/null

# --- 3 ranks, one box ----------------------------------------------------------
"$BIN" plan --model "$TMP/hf" --ranks 3 >"$TMP/plan3.txt" || { cat "$TMP/plan3.txt"; fail "plan --ranks 3 failed"; }
cat "$TMP/plan3.txt"
[ "$(grep -cE '^ +[0-9]+  local  cpu' "$TMP/plan3.txt")" = 3 ] || fail "expected 3 rank lines"
# 2 KV heads of 64 = 1 unit of 128 < 3 ranks: query heads in pairs (128
# channels), 2 pairs over 3 ranks -> ranks 0 and 1, rank 2 none; rank 0 adds o's bias.
grep -qE '^ +0  local .* \[0,2\)\*  +\[0,1\)  +\[0,256\)\*  +\[0,384\) ' "$TMP/plan3.txt" || fail "rank 0 line"
grep -qE '^ +1  local .* \[2,4\)  +\[1,2\)  +\[256,512\)  +\[384,768\) ' "$TMP/plan3.txt" || fail "rank 1 line"
grep -qE '^ +2  local .* -  +-  +\[512,640\)  +\[768,1000\) ' "$TMP/plan3.txt" || fail "rank 2 line"
model_bytes=$(stored_bytes "$TMP/hf")
grep -q "^model: $model_bytes bytes" "$TMP/plan3.txt" || fail "model bytes should be $model_bytes"
sum=$(rank_bytes_sum "$TMP/plan3.txt")
grep -q "all ranks together: $sum bytes" "$TMP/plan3.txt" || fail "rank bytes sum to $sum, summary disagrees"
[ "$sum" -gt "$model_bytes" ] || fail "3 ranks must hold more than the model (replicated embedding)"

# One rank holds exactly the model.
"$BIN" plan --model "$TMP/hf" --ranks 1 >"$TMP/plan1.txt"
[ "$(rank_bytes_sum "$TMP/plan1.txt")" = "$model_bytes" ] || fail "1 rank should read $model_bytes bytes"

# Capacities: 1000 vocab rows = 8 units at 2:1:1 -> 4, 2, 2.
"$BIN" plan --model "$TMP/hf" --ranks 3 --capacity 2,1,1 >"$TMP/cap.txt"
grep -qE '^ +0  local  cpu +2\.00 .*\[0,512\) ' "$TMP/cap.txt" || { cat "$TMP/cap.txt"; fail "capacity 2 rank"; }
"$BIN" plan --model "$TMP/hf" --ranks 2 --replicate-head >"$TMP/rep.txt"
[ "$(grep -cF '[0,1000)' "$TMP/rep.txt")" = 2 ] || fail "replicated head on both ranks"

# --- an EXL3 model ---------------------------------------------------------------
"$BIN" make-test-model --arch llama --layers 1 --hidden 128 --intermediate 256 --vocab 300 \
  --out "$TMP/small" >/dev/null
"$BIN" convert --in "$TMP/small" --out "$TMP/exl3" --bits 4 --threads 2 --no-progress >/dev/null
"$BIN" plan --model "$TMP/exl3" --ranks 2 >"$TMP/exl3.txt" || { cat "$TMP/exl3.txt"; fail "plan on EXL3"; }
grep -q "^model: $(stored_bytes "$TMP/exl3") bytes" "$TMP/exl3.txt" || { cat "$TMP/exl3.txt"; fail "EXL3 model bytes"; }

# --- MoE on two boxes, 2 expert groups -------------------------------------------
"$BIN" make-test-model --arch qwen3-moe --out "$TMP/moe" >/dev/null
"$BIN" plan --model "$TMP/moe" --ranks 4 --ep 2 --boxes a:2,b:2 >"$TMP/moe.txt" || { cat "$TMP/moe.txt"; fail "moe plan"; }
grep -q "experts: 2 groups of 2 ranks" "$TMP/moe.txt" || fail "moe groups line"
grep -qE '^ +1  a  .* \[0,2\) ' "$TMP/moe.txt" || { cat "$TMP/moe.txt"; fail "rank 1 on box a with experts [0,2)"; }
grep -qE '^ +2  b  .* \[2,4\) ' "$TMP/moe.txt" || { cat "$TMP/moe.txt"; fail "rank 2 on box b with experts [2,4)"; }

# --- bad invocations: exit 1 with a one-line message naming the option -----------
expect() {  # expect RC SUBSTRING ARGS...
  local want=$1 text=$2; shift 2
  set +e
  "$BIN" plan "$@" >/dev/null 2>"$TMP/err.txt"; local rc=$?
  set -e
  [ $rc = "$want" ] || fail "plan $* exited $rc, expected $want: $(cat "$TMP/err.txt")"
  grep -q -- "$text" "$TMP/err.txt" || fail "plan $*: message lacks '$text': $(cat "$TMP/err.txt")"
}
expect 1 "sum to 4, but --ranks is 3" --model "$TMP/hf" --ranks 3 --boxes a:2,b:2
expect 1 "is not NAME:COUNT" --model "$TMP/hf" --ranks 2 --boxes a2
expect 1 "2 values for 3 ranks" --model "$TMP/hf" --ranks 3 --capacity 1,1
expect 1 "is not a number > 0" --model "$TMP/hf" --ranks 2 --capacity 1,0
expect 1 "must divide the world size 3" --model "$TMP/moe" --ranks 3 --ep 2
expect 1 "number of experts 4" --model "$TMP/moe" --ranks 8
expect 1 "config.json" --model "$TMP/nope" --ranks 2
expect 1 "--ranks must be >= 1, got 0" --model "$TMP/hf" --ranks 0
# Not a number: the command-line parser refuses it (non-zero, not a run failure).
set +e
"$BIN" plan --model "$TMP/hf" --ranks three >/dev/null 2>"$TMP/err.txt"; rc=$?
set -e
{ [ $rc != 0 ] && [ $rc != 1 ]; } || fail "--ranks three exited $rc"
grep -q -- "--ranks" "$TMP/err.txt" || fail "--ranks three: $(cat "$TMP/err.txt")"
echo "plan end to end: OK"
