#!/usr/bin/env bash
# speculative_bench: decode throughput with and without n-gram drafting
# (issue 18) through the gRPC API, `serve --tp 1` (the model in the
# coordinator's process, both cores), `bench-serve` greedy, ignore_eos.
#
# Workloads (each at 1 and 8 streams; requests of 256 tokens, 128 on the big
# model; enough requests that a run takes seconds, not milliseconds):
#   copy      stories260K (a real trained model, ../shared/models), prompts that
#             hold a TinyStories paragraph twice and then its first words
#             again: the model may copy the paragraph a third time, the case
#             prompt lookup is for (case (a) of the issue);
#   stories   stories260K, prompts that are one story's first sentence: the
#             model writes a new story; n-gram drafts come only from its own
#             repetitions;
#   rejected  stories260K, prompts of random token spans repeated 4 times:
#             n-gram drafts are proposed from the prompt and mostly rejected;
#   cycles    the random-weights Qwen3 test model (make-test-model, hidden
#             256, 2 layers, vocab 1000): its greedy output falls into short
#             cycles at once, which n-gram drafts predict nearly always — the
#             ceiling of what accepted drafts buy on this machine;
#   big       a random-weights Llama (make-test-model, hidden 1024, 8 layers,
#             vocab 32000, ~130 M parameters, bf16) on random repeated spans:
#             its greedy output falls into cycles that n-gram drafts predict,
#             but a verify step of 1 + k rows costs more than a decode row;
#   draft     stories prompts on stories260K at 4 bpw (EXL3) drafted by its
#             own 2 bpw conversion (`--speculative draft --draft-model`, case
#             (b) of the issue), against the 4 bpw model without drafts;
#   copy-big  the big model converted to EXL3 at 4 bpw (as users run it), on
#             prompts that quote the text it is about to write: a random span
#             x4, then the model's own greedy continuation of that span (128
#             tokens, written by `generate` beforehand), then the span x4
#             again — prompt lookup finds the quote and drafts it, the case
#             of a model copying a quoted span (case (a) of the issue with a
#             model that copies; the real stories260K copies half its drafts).
#             Drafts of K_COPY tokens (default 12; the other rows use K).
# Three servers per row: no drafts (the ceiling), drafts with the governor
# (the default: drafting only while it measures cheaper per token), and
# drafts at every step the windows allow (--no-draft-governor: the raw cost).
# Prints bench-serve's tables and one summary table: output tok/s (prefill
# included) and decode tok/s per stream (bench-serve's 1 / TPOT: tokens after
# the first over first-to-last-token time), their ratios, acceptance and
# mean accepted length of the raw run. Not run by ctest (minutes); figures
# go to docs/BENCHMARKS.md.
#
# PAIRS=N (default 1) runs the ceiling and the governed server N times each,
# alternating (off gov, gov off, off gov, ...: neither is always first), and
# the summary gives medians: tok/s of each, and the ratio as the median of
# the N paired ratios; a second table lists every pair's decode ratio and
# the spread between the ceiling's own runs (max / min of its N runs: what
# the same server measures twice, the noise a single ratio carries).
#
#   [WORKLOADS="copy draft ..."] [K_COPY=12] [PAIRS=1] \
#   tests/bench/speculative_bench.sh [build/cli/exl3serve] [draft-tokens]
set -euo pipefail
BIN=${1:-build/cli/exl3serve}
K=${2:-6}
K_COPY=${K_COPY:-12}
WORKLOADS=${WORKLOADS:-"copy stories rejected cycles big draft copy-big"}
PAIRS=${PAIRS:-1}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
STORIES=$SRC/../shared/models/stories260K
TEXT=$SRC/../shared/testdata/text/tinystories_valid_first1000.txt
[ -f "$STORIES/stories260K.bin" ] || { echo "skip: no $STORIES (../shared)"; exit 0; }
WORK=$(mktemp -d /tmp/exl3-spec-bench-XXXXXX)
SERVER_PID=""
cleanup() {
  [ -n "$SERVER_PID" ] && kill -TERM "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), $(date -u '+%Y-%m-%d %H:%M UTC')"

"$BIN" --log-level warning import-llama2c --in "$STORIES/stories260K.bin" --tokenizer "$STORIES/tok512.bin" \
  --out "$WORK/stories" >/dev/null
for bits in 4 2; do
  "$BIN" --log-level warning convert --in "$WORK/stories" --out "$WORK/stories-q$bits" --bits $bits \
    --threads 2 --no-progress >/dev/null
done
"$BIN" --log-level warning make-test-model --arch llama --hidden 1024 --layers 8 \
  --intermediate 2816 --vocab 32000 --peaked-logits --out "$WORK/llama" >/dev/null
"$BIN" --log-level warning make-test-model --arch qwen3 --out "$WORK/qwen3" >/dev/null
if [[ " $WORKLOADS " == *" copy-big "* ]]; then
  "$BIN" --log-level warning convert --in "$WORK/llama" --out "$WORK/llama-q4" --bits 4 --threads 2 \
    --no-progress >/dev/null
fi

# Prompts (one per line, comma-separated ids: BOS, then the text's ids).
/usr/bin/python3 - "$TEXT" "$WORK" "$BIN" <<'PY'
import json, os, random, subprocess, sys
text, work, binary = sys.argv[1:]
stories = [s.strip() for s in open(text).read().split("<|endoftext|>") if len(s.strip()) > 200]
def ids(t):
    return [1] + json.loads(subprocess.check_output(
        [binary, "tokenize", "--model", f"{work}/stories", "--text", t]))
def write(name, prompts):
    with open(f"{work}/{name}.ids", "w") as f:
        for p in prompts:
            f.write(",".join(map(str, p)) + "\n")
# Prompts of at most 256 tokens: + 256 generated fits stories260K's 512
# positions (longer ones are refused; the next paragraphs stand in).
copy = []
for s in stories[:16] + stories[32:64]:
    p = s[:240].rsplit(" ", 1)[0]
    prompt = ids(f"{p}\n\n{p}\n\n{' '.join(p.split()[:6])}")
    if len(prompt) <= 256 and len(copy) < 16:
        copy.append(prompt)
write("copy", copy)
write("stories", [ids(s.split(".")[0] + ".") for s in stories[16:32]])
rng = random.Random(7)
write("rejected", [[rng.randrange(3, 512) for _ in range(12)] * 4 for _ in range(16)])
write("big", [[rng.randrange(1, 32000) for _ in range(12)] * 4 for _ in range(16)])
write("cycles", [[rng.randrange(1, 1000) for _ in range(12)] for _ in range(16)])
if os.path.isdir(f"{work}/llama-q4"):
    quoted = []
    for _ in range(8):
        span = [rng.randrange(1, 32000) for _ in range(12)] * 4
        own = subprocess.check_output(
            [binary, "--log-level", "warning", "generate", "--model", f"{work}/llama-q4",
             "--prompt-ids", ",".join(map(str, span)), "--ids", "--max-tokens", "128",
             "--ignore-eos", "--threads-per-rank", "2"]).split()
        quoted.append(span + [int(t) for t in own] + span)
    write("copy-big", quoted)
PY

declare -A TPS DPS ACC MAL
run() {  # NAME MODEL IDS STREAMS REQUESTS GEN SERVE-FLAGS...
  local name=$1 model=$2 ids=$3 streams=$4 requests=$5 gen=$6
  shift 6
  local log="$WORK/serve-$name.log"
  "$BIN" --log-level warning serve --model "$model" --tp 1 --threads-per-rank 2 --kv-pages 1024 \
    --host 127.0.0.1 --port 0 "$@" >"$log" 2>&1 &
  SERVER_PID=$!
  local addr=""
  for _ in $(seq 600); do
    addr=$(sed -n 's/^listening on //p' "$log")
    [ -n "$addr" ] && break
    kill -0 "$SERVER_PID" 2>/dev/null || { cat "$log"; exit 1; }
    sleep 0.1
  done
  "$BIN" client --addr "$addr" --health --wait-ready-ms 120000 >/dev/null
  # Warm-up (page cache, thread pool), then the measured run.
  "$BIN" bench-serve --addr "$addr" --concurrency "$streams" --requests "$streams" --gen-len 16 \
    --prompt-ids-file "$ids" >/dev/null
  echo
  echo "== $name: $*"
  "$BIN" bench-serve --addr "$addr" --concurrency "$streams" --requests "$requests" \
    --gen-len "$gen" --prompt-ids-file "$ids" | tee "$WORK/bench-$name.txt"
  grep -qE "requests ok +([0-9]+) / \1$" "$WORK/bench-$name.txt" ||
    { echo "speculative_bench: requests failed in $name"; exit 1; }
  TPS[$name]=$(sed -n 's/^  output throughput *\([0-9.]*\) tokens.*/\1/p' "$WORK/bench-$name.txt")
  DPS[$name]=$(sed -n 's/^  decode throughput \/ stream *\([0-9.]*\) tokens.*/\1/p' "$WORK/bench-$name.txt")
  ACC[$name]=$(sed -n 's/.*accepted (\([0-9.]*\) %).*/\1/p' "$WORK/bench-$name.txt")
  MAL[$name]=$(sed -n 's/.*mean accepted length \([0-9.]*\).*/\1/p' "$WORK/bench-$name.txt")
  kill -TERM "$SERVER_PID"
  wait "$SERVER_PID" || true
  SERVER_PID=""
}

for workload in $WORKLOADS; do
  model=$WORK/stories ids=$WORK/$workload.ids spec=(--speculative ngram --draft-tokens "$K")
  gen=256 per_stream=32
  [ $workload = cycles ] && { model=$WORK/qwen3; per_stream=8; }
  [ $workload = big ] && { model=$WORK/llama; gen=128 per_stream=4; }
  if [ $workload = copy-big ]; then
    model=$WORK/llama-q4 gen=128 per_stream=4 spec=(--speculative ngram --draft-tokens "$K_COPY")
  fi
  if [ $workload = draft ]; then
    model=$WORK/stories-q4 ids=$WORK/stories.ids
    spec=(--speculative draft --draft-model "$WORK/stories-q2" --draft-tokens "$K")
  fi
  for streams in 1 8; do
    requests=$((streams == 1 ? per_stream : per_stream * 2))
    for pair in $(seq "$PAIRS"); do
      if ((pair % 2)); then
        run "$workload-$streams-off-$pair" "$model" "$ids" $streams $requests $gen
        run "$workload-$streams-gov-$pair" "$model" "$ids" $streams $requests $gen "${spec[@]}"
      else
        run "$workload-$streams-gov-$pair" "$model" "$ids" $streams $requests $gen "${spec[@]}"
        run "$workload-$streams-off-$pair" "$model" "$ids" $streams $requests $gen
      fi
    done
    run "$workload-$streams-raw" "$model" "$ids" $streams $requests $gen "${spec[@]}" --no-draft-governor
  done
done

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else printf "-" }'; }
# median VALUES... (empty if none)
median() { printf '%s\n' "$@" | sort -g | awk 'NF { v[n++] = $1 } END { if (n) printf "%.6g", n % 2 ? v[(n - 1) / 2] : (v[n / 2 - 1] + v[n / 2]) / 2 }'; }
# median_ratio ARRAY WORKLOAD STREAMS: median over pairs of gov_i / off_i
median_ratio() {
  local -n values=$1
  local pair list=()
  for pair in $(seq "$PAIRS"); do
    list+=("$(awk -v a="${values[$2-$3-gov-$pair]}" -v b="${values[$2-$3-off-$pair]}" 'BEGIN { if (b > 0) printf "%.4f", a / b }')")
  done
  median "${list[@]}" | awk '{ printf "%.2fx", $1 }'
}
echo
echo "| workload | streams | tok/s without drafts (ceiling) | with drafts, governed | ratio | drafts at every step (raw) | ratio | decode tok/s / stream without | governed | raw | acceptance (raw) | mean accepted length (raw) |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
for workload in $WORKLOADS; do
  for streams in 1 8; do
    offs=() govs=() doffs=() dgovs=()
    for pair in $(seq "$PAIRS"); do
      offs+=("${TPS[$workload-$streams-off-$pair]}") govs+=("${TPS[$workload-$streams-gov-$pair]}")
      doffs+=("${DPS[$workload-$streams-off-$pair]}") dgovs+=("${DPS[$workload-$streams-gov-$pair]}")
    done
    off=$(median "${offs[@]}" | awk '{ printf "%.1f", $1 }') raw=${TPS[$workload-$streams-raw]}
    gov=$(median "${govs[@]}" | awk '{ printf "%.1f", $1 }')
    doff=$(median "${doffs[@]}" | awk '{ printf "%.1f", $1 }') draw=${DPS[$workload-$streams-raw]}
    dgov=$(median "${dgovs[@]}" | awk '{ printf "%.1f", $1 }')
    echo "| $workload | $streams | $off | $gov | $(median_ratio TPS "$workload" "$streams") | $raw | $(ratio "$raw" "$off") |" \
         "$doff | $dgov ($(median_ratio DPS "$workload" "$streams")) | $draw ($(ratio "$draw" "$doff")) |" \
         "${ACC[$workload-$streams-raw]:-0} % | ${MAL[$workload-$streams-raw]:-} |"
  done
done
if ((PAIRS > 1)); then
  echo
  echo "Pairs (decode tok/s per stream, governed / without drafts, in run order; spread of the ceiling's own runs = max / min):"
  echo
  echo "| workload | streams | governed / without, each pair | median | ceiling spread |"
  echo "|---|---|---|---|---|"
  for workload in $WORKLOADS; do
    for streams in 1 8; do
      list="" doffs=()
      for pair in $(seq "$PAIRS"); do
        list+="$(ratio "${DPS[$workload-$streams-gov-$pair]}" "${DPS[$workload-$streams-off-$pair]}") "
        doffs+=("${DPS[$workload-$streams-off-$pair]}")
      done
      spread=$(printf '%s\n' "${doffs[@]}" | sort -g | awk 'NR == 1 { lo = $1 } { hi = $1 } END { if (lo > 0) printf "%.2fx", hi / lo }')
      echo "| $workload | $streams | $list| $(median_ratio DPS "$workload" "$streams") | $spread |"
    done
  done
fi
