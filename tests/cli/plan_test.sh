#!/usr/bin/env bash
# `exl3serve plan` end to end: the plan of a small Llama test model over 3
# ranks (ranges checked against the split rules by hand: 4 query heads of
# head_dim 64 over 2 KV heads, 640 MLP channels, 1000 vocab rows), byte totals
# checked from outside against the safetensors headers (read by a few lines of
# independent Python), an EXL3 model, an MoE model on two boxes, which row
# tables each rank holds resident or spilled (threshold, memory budget), the
# exit codes and messages of bad invocations, and the same capacities on real
# ranks (`generate --tp 3 --capacities 1,1,0.5` = one rank's greedy ids, the
# small rank reads less) with their errors in generate/serve/worker/coordinator.
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
# Uneven capacities (issue 5): the half-capacity rank reads fewer bytes than
# either full one; all 1 is the default plan; --capacities is --capacity.
"$BIN" plan --model "$TMP/hf" --ranks 3 --capacities 1,1,0.5 >"$TMP/half.txt"
rank_bytes() { awk -v r="$2" '$1 == r && /^ *[0-9]+  /{print $(NF - 2)}' "$1"; }
b0=$(rank_bytes "$TMP/half.txt" 0); b1=$(rank_bytes "$TMP/half.txt" 1); b2=$(rank_bytes "$TMP/half.txt" 2)
{ [ -n "$b2" ] && [ "$b2" -lt "$b0" ] && [ "$b2" -lt "$b1" ]; } ||
  { cat "$TMP/half.txt"; fail "capacity 0.5 rank should read less ($b0 $b1 $b2)"; }
grep -qE '^ +2  local  cpu +0\.50 ' "$TMP/half.txt" || { cat "$TMP/half.txt"; fail "rank 2 capacity column"; }
"$BIN" plan --model "$TMP/hf" --ranks 3 --capacities 1,1,1 | cmp -s - "$TMP/plan3.txt" ||
  fail "--capacities 1,1,1 should give the default plan"
# One box name per rank: the same plan as NAME:COUNT.
"$BIN" plan --model "$TMP/hf" --ranks 3 --boxes a,a,b --capacities 1,1,0.5 >"$TMP/names.txt"
"$BIN" plan --model "$TMP/hf" --ranks 3 --boxes a:2,b:1 --capacity 1,1,0.5 | cmp -s - "$TMP/names.txt" ||
  { cat "$TMP/names.txt"; fail "--boxes a,a,b should equal --boxes a:2,b:1"; }
grep -qE '^ +2  b  ' "$TMP/names.txt" || { cat "$TMP/names.txt"; fail "rank 2 on box b"; }
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

# --- row tables: resident or spilled per rank and box (issue 8) ------------------
# The embedding's stored bytes from the header; resident it is fp32 (1000 x 256 x 4).
embed_stored=$("$PY" - "$TMP/hf" <<'PYEOF'
import glob, json, struct, sys
for path in glob.glob(sys.argv[1] + "/*.safetensors"):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        t = json.loads(f.read(n)).get("model.embed_tokens.weight")
    if t: print(t["data_offsets"][1] - t["data_offsets"][0])
PYEOF
)
embed_resident=$((1000 * 256 * 4))
for r in 0 1 2; do
  grep -q "^  rank $r (box local): model.embed_tokens.weight \[1000 x 256\] resident $embed_resident bytes (stored $embed_stored)$" \
    "$TMP/plan3.txt" || { cat "$TMP/plan3.txt"; fail "rank $r: embedding resident by default"; }
done
grep -q "^  box local: tables resident $((3 * embed_resident)) bytes, spilled (on local disk) 0 bytes$" "$TMP/plan3.txt" ||
  fail "box totals without spilling"
# Above the threshold: spilled on every rank; the box needs the stored table on disk per rank.
"$BIN" plan --model "$TMP/hf" --ranks 3 --boxes a:2,b:1 --spill-threshold-bytes $embed_resident >"$TMP/thr.txt"
[ "$(grep -c 'model.embed_tokens.weight \[1000 x 256\] spilled' "$TMP/thr.txt")" = 3 ] || { cat "$TMP/thr.txt"; fail "threshold spills on 3 ranks"; }
grep -q "^  box a: tables resident 0 bytes, spilled (on local disk) $((2 * embed_stored)) bytes$" "$TMP/thr.txt" || { cat "$TMP/thr.txt"; fail "box a totals"; }
grep -q "^  box b: tables resident 0 bytes, spilled (on local disk) $embed_stored bytes$" "$TMP/thr.txt" || fail "box b totals"
"$BIN" plan --model "$TMP/hf" --ranks 3 --spill-threshold-bytes $((embed_resident + 1)) >"$TMP/thr2.txt"
[ "$(grep -c 'resident 1024000 bytes' "$TMP/thr2.txt")" = 3 ] || fail "below the threshold: resident"
# A memory budget per rank (1 rank: the whole model): the table fits resident
# exactly at model + (fp32 - stored) bytes; one byte less spills it (with a
# 64 KiB row cache); below what the rest needs is an error naming the budget.
fits=$((model_bytes - embed_stored + embed_resident))
"$BIN" plan --model "$TMP/hf" --ranks 1 --memory-budget-bytes $fits --spill-cache-bytes 65536 >"$TMP/b1.txt"
grep -q "weight \[1000 x 256\] resident" "$TMP/b1.txt" || { cat "$TMP/b1.txt"; fail "budget $fits: resident"; }
"$BIN" plan --model "$TMP/hf" --ranks 1 --memory-budget-bytes $((fits - 1)) --spill-cache-bytes 65536 >"$TMP/b2.txt"
grep -q "weight \[1000 x 256\] spilled $embed_stored bytes" "$TMP/b2.txt" || { cat "$TMP/b2.txt"; fail "budget $((fits - 1)): spilled"; }

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
expect 1 "2 names for 3 ranks" --model "$TMP/hf" --ranks 3 --boxes a,b
# --capacities / --capacity: the parser generate/serve/worker share
# (cli/capacity_flags.h); every message names --capacities and the bad value.
expect 1 "--capacities: 2 values for 3 ranks" --model "$TMP/hf" --ranks 3 --capacity 1,1
expect 1 "--capacities: \`0\` is not a finite number > 0" --model "$TMP/hf" --ranks 2 --capacity 1,0
expect 1 "--capacities: \`abc\` is not a finite number > 0" --model "$TMP/hf" --ranks 2 --capacities 1,abc
expect 1 "--capacities: \`inf\` is not a finite number > 0" --model "$TMP/hf" --ranks 2 --capacities inf,1
expect 1 "--capacities: \`-0.5\` is not" --model "$TMP/hf" --ranks 3 --boxes a:2,b:1 --capacities 1,1,-0.5
expect 1 "--capacities: \`\` is not" --model "$TMP/hf" --ranks 2 --capacities 1,1,
expect 1 "must divide the world size 3" --model "$TMP/moe" --ranks 3 --ep 2
expect 1 "number of experts 4" --model "$TMP/moe" --ranks 8
expect 1 "config.json" --model "$TMP/nope" --ranks 2
expect 1 "--ranks must be >= 1, got 0" --model "$TMP/hf" --ranks 0
expect 1 "rank 0 (box local): spill: resident weights need" --model "$TMP/hf" --ranks 1 --memory-budget-bytes 1000
expect 1 "is not a row-lookup table" --model "$TMP/hf" --ranks 2 --spill-tensor lm_head.weight
# Not a number: the command-line parser refuses it (non-zero, not a run failure).
set +e
"$BIN" plan --model "$TMP/hf" --ranks three >/dev/null 2>"$TMP/err.txt"; rc=$?
set -e
{ [ $rc != 0 ] && [ $rc != 1 ]; } || fail "--ranks three exited $rc"
grep -q -- "--ranks" "$TMP/err.txt" || fail "--ranks three: $(cat "$TMP/err.txt")"

# --- the plan's capacities on real ranks: generate/serve --capacities (issue 5) ---
# TP = 3 at 1,1,0.5 gives the same greedy ids as one rank; the 0.5 rank reads
# fewer checkpoint bytes (the driver logs each rank's read).
"$BIN" generate --model "$TMP/hf" --prompt-ids 3,1,4,1,5,9,2,6 --ids --max-tokens 16 >"$TMP/gen1.txt"
"$BIN" generate --model "$TMP/hf" --prompt-ids 3,1,4,1,5,9,2,6 --ids --max-tokens 16 --tp 3 \
  --capacities 1,1,0.5 >"$TMP/gen3.txt" 2>"$TMP/gen3.err" || { cat "$TMP/gen3.err"; fail "generate --capacities"; }
cmp -s "$TMP/gen1.txt" "$TMP/gen3.txt" || fail "tp 3 at 1,1,0.5: $(cat "$TMP/gen3.txt") vs tp 1: $(cat "$TMP/gen1.txt")"
read_bytes() { sed -nE "s/.*rank $2: read ([0-9]+) checkpoint bytes.*/\1/p" "$1"; }
g0=$(read_bytes "$TMP/gen3.err" 0); g2=$(read_bytes "$TMP/gen3.err" 2)
{ [ -n "$g2" ] && [ "$g2" -lt "$g0" ]; } || { cat "$TMP/gen3.err"; fail "0.5 rank should read less ($g0 $g2)"; }
expect_cmd() {  # expect_cmd SUBSTRING ARGS...: exit 1, the message names --capacities
  local text=$1; shift
  set +e
  timeout 60 "$BIN" "$@" >/dev/null 2>"$TMP/err.txt"; local rc=$?
  set -e
  [ $rc = 1 ] || fail "$* exited $rc, expected 1: $(cat "$TMP/err.txt")"
  grep -q -- "$text" "$TMP/err.txt" || fail "$*: message lacks '$text': $(cat "$TMP/err.txt")"
}
expect_cmd "--capacities: 2 values for 3 ranks" generate --model "$TMP/hf" --prompt-ids 1 --tp 3 --capacities 1,1
expect_cmd "--capacities: \`0\` is not a finite number > 0" generate --model "$TMP/hf" --prompt-ids 1 --tp 2 --capacities 1,0
expect_cmd "--capacities: \`-1\` is not" serve --model "$TMP/hf" --tp 2 --port 0 --capacities -1,1
expect_cmd "--capacities: 3 values for 2 ranks" serve --model "$TMP/hf" --tp 2 --port 0 --capacities 1,1,1
expect_cmd "--capacities is for --control-fd mode" worker --coordinator 127.0.0.1:1 --rank 0 --capacities 1,1
printf 'model_dir: %s\nworld_size: 3\ncapacities: [1, 1]\n' "$TMP/hf" >"$TMP/cap.yaml"
expect_cmd "config key \`capacities\`: 2 values for 3 ranks" coordinator --config "$TMP/cap.yaml"
echo "plan end to end: OK"
