#!/usr/bin/env bash
# quality_table: the teacher-forced quality of EXL3 on the real models in
# ../shared (stories260K, BabyLlama tok105) — what docs/QUALITY.md reports.
# For each model: import with its tokenizer (fp32 = the reference), bf16 and
# fp16 casts (the floor), then EXL3 at 2, 3, 4, 5, 6, 8 bpw with codebooks
# mul1 / mcg / 3inst, uncalibrated and calibrated (--calib on the first half of
# the TinyStories validation text), and the CPU precisions (int8 decode,
# bf16 prefill) on 4 bpw mul1; each scored by `exl3serve eval --reference fp32`
# on the second half (perplexity, KL mean / p99, top-1). Prints Markdown rows;
# JSON per cell under OUT (default: a temporary folder, removed).
#
#   tests/bench/quality_table.sh [build/cli/exl3serve] [max_tokens=8000] [OUT]
set -euo pipefail
BIN=${1:-build/cli/exl3serve}
MAXTOK=${2:-8000}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
SHARED=${EXL3_SHARED_DIR:-$SRC/../shared}
TEXT=$SHARED/testdata/text/tinystories_valid_first1000.txt
OUT=${3:-}
KEEP=1
[ -n "$OUT" ] || { OUT=$(mktemp -d /tmp/exl3-quality-XXXXXX); KEEP=0; }
mkdir -p "$OUT"
[ $KEEP = 1 ] || trap 'rm -rf "$OUT"' EXIT
head -c $(( $(stat -c %s "$TEXT") / 2 )) "$TEXT" >"$OUT/calib.txt"
EVAL=(eval --text "$TEXT" --range second-half --max-tokens "$MAXTOK" --context 256 --stride 128 --no-progress)

row() {  # row MODEL_NAME LABEL DIR REF [eval flags...]
  local name=$1 label=$2 dir=$3 ref=$4
  shift 4
  local js="$OUT/$name-$(echo "$label" | tr -c 'a-zA-Z0-9' _).json"
  "$BIN" --log-level warning "${EVAL[@]}" --model "$dir" --reference "$ref" --json "$js" "$@" >/dev/null
  /usr/bin/python3 - "$js" "$name" "$label" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); r = j["reference"]
print(f"| {sys.argv[2]} | {sys.argv[3]} | {j['perplexity']:.4f} | {r['kl_mean']:.5f} | "
      f"{r['kl_p99']:.4f} | {100 * r['top1_agreement']:.2f} % |", flush=True)
PY
}

echo "| model | weights | perplexity | KL mean (nats) | KL p99 | top-1 |"
echo "|---|---|---|---|---|---|"
for m in stories260K:stories260K/stories260K.bin:stories260K/tok512.bin \
         babyllama:babyllama-tok105/model5000.bin:babyllama-tok105/tok105.bin; do
  IFS=: read -r name bin tok <<<"$m"
  D="$OUT/$name"
  "$BIN" import-llama2c --in "$SHARED/models/$bin" --tokenizer "$SHARED/models/$tok" --out "$D/fp32" >/dev/null
  row "$name" "fp32 (reference)" "$D/fp32" "$D/fp32"
  for cast in bf16 f16; do
    mkdir -p "$D/$cast"
    cp "$D/fp32"/*.json "$D/$cast/"
    /usr/bin/python3 "$SRC/tests/bench/cast_safetensors.py" "$D/fp32/model.safetensors" \
      "$D/$cast/model.safetensors" $cast
    row "$name" "$cast cast" "$D/$cast" "$D/fp32"
  done
  for bits in 2 3 4 5 6 8; do
    for cb in mul1 mcg 3inst; do
      for cal in none calib; do
        q="$D/q$bits-$cb-$cal"
        flags=(--bits "$bits" --codebook "$cb" --threads 2 --no-progress)
        [ $cal = calib ] && flags+=(--calib "$OUT/calib.txt" --calib-cols 256 --calib-rows 64)
        "$BIN" --log-level warning convert --in "$D/fp32" --out "$q" "${flags[@]}" >/dev/null 2>"$q.log" ||
          { cat "$q.log"; exit 1; }
        label="EXL3 $bits bpw $cb"
        [ $cal = calib ] && label="$label calibrated"
        row "$name" "$label" "$q" "$D/fp32"
      done
    done
  done
  q="$D/q4-mul1-calib"
  row "$name" "EXL3 4 bpw mul1 calibrated, decode (16-token chunks) fp32" "$q" "$D/fp32" --chunk-tokens 16
  row "$name" "EXL3 4 bpw mul1 calibrated, decode (16-token chunks) int8" "$q" "$D/fp32" --chunk-tokens 16 \
    --decode-precision int8
  row "$name" "EXL3 4 bpw mul1 calibrated, prefill bf16" "$q" "$D/fp32" --prefill-precision bf16
done
