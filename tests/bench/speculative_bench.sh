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
#             (b) of the issue), against the 4 bpw model without drafts.
# Three servers per row: no drafts (the ceiling), drafts with the governor
# (the default: drafting only while it measures cheaper per token), and
# drafts at every step the windows allow (--no-draft-governor: the raw cost).
# Prints bench-serve's tables and one summary table (output tok/s, ratios,
# acceptance and mean accepted length of the raw run). Not run by ctest
# (minutes); figures go to docs/BENCHMARKS.md.
#
#   tests/bench/speculative_bench.sh [build/cli/exl3serve] [draft-tokens]
set -euo pipefail
BIN=${1:-build/cli/exl3serve}
K=${2:-6}
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

# Prompts (one per line, comma-separated ids: BOS, then the text's ids).
/usr/bin/python3 - "$TEXT" "$WORK" "$BIN" <<'PY'
import json, random, subprocess, sys
text, work, binary = sys.argv[1:]
stories = [s.strip() for s in open(text).read().split("<|endoftext|>") if len(s.strip()) > 200]
def ids(t):
    return [1] + json.loads(subprocess.check_output(
        [binary, "tokenize", "--model", f"{work}/stories", "--text", t]))
def write(name, prompts):
    with open(f"{work}/{name}.ids", "w") as f:
        for p in prompts:
            f.write(",".join(map(str, p)) + "\n")
paragraphs = [s[:240].rsplit(" ", 1)[0] for s in stories[:16]]
write("copy", [ids(f"{p}\n\n{p}\n\n{' '.join(p.split()[:6])}") for p in paragraphs])
write("stories", [ids(s.split(".")[0] + ".") for s in stories[16:32]])
rng = random.Random(7)
write("rejected", [[rng.randrange(3, 512) for _ in range(12)] * 4 for _ in range(16)])
write("big", [[rng.randrange(1, 32000) for _ in range(12)] * 4 for _ in range(16)])
write("cycles", [[rng.randrange(1, 1000) for _ in range(12)] for _ in range(16)])
PY

declare -A TPS ACC MAL
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
  TPS[$name]=$(sed -n 's/^  output throughput *\([0-9.]*\) tokens.*/\1/p' "$WORK/bench-$name.txt")
  ACC[$name]=$(sed -n 's/.*accepted (\([0-9.]*\) %).*/\1/p' "$WORK/bench-$name.txt")
  MAL[$name]=$(sed -n 's/.*mean accepted length \([0-9.]*\).*/\1/p' "$WORK/bench-$name.txt")
  kill -TERM "$SERVER_PID"
  wait "$SERVER_PID" || true
  SERVER_PID=""
}

WORKLOADS=${WORKLOADS:-"copy stories rejected cycles big draft"}  # a subset: WORKLOADS="draft copy" ...
for workload in $WORKLOADS; do
  model=$WORK/stories ids=$WORK/$workload.ids spec=(--speculative ngram --draft-tokens "$K")
  gen=256 per_stream=32
  [ $workload = cycles ] && { model=$WORK/qwen3; per_stream=8; }
  [ $workload = big ] && { model=$WORK/llama; gen=128 per_stream=4; }
  if [ $workload = draft ]; then
    model=$WORK/stories-q4 ids=$WORK/stories.ids
    spec=(--speculative draft --draft-model "$WORK/stories-q2" --draft-tokens "$K")
  fi
  for streams in 1 8; do
    requests=$((streams == 1 ? per_stream : per_stream * 2))
    run "$workload-$streams-off" "$model" "$ids" $streams $requests $gen
    run "$workload-$streams-gov" "$model" "$ids" $streams $requests $gen "${spec[@]}"
    run "$workload-$streams-raw" "$model" "$ids" $streams $requests $gen "${spec[@]}" --no-draft-governor
  done
done

echo
echo "| workload | streams | tok/s without drafts (ceiling) | with drafts, governed | ratio | drafts at every step (raw) | ratio | acceptance (raw) | mean accepted length (raw) |"
echo "|---|---|---|---|---|---|---|---|---|"
for workload in $WORKLOADS; do
  for streams in 1 8; do
    off=${TPS[$workload-$streams-off]} gov=${TPS[$workload-$streams-gov]} raw=${TPS[$workload-$streams-raw]}
    r1=$(awk -v a="$gov" -v b="$off" 'BEGIN { printf "%.2fx", a / b }')
    r2=$(awk -v a="$raw" -v b="$off" 'BEGIN { printf "%.2fx", a / b }')
    echo "| $workload | $streams | $off | $gov | $r1 | $raw | $r2 | ${ACC[$workload-$streams-raw]:-0} % | ${MAL[$workload-$streams-raw]:-} |"
  done
done
